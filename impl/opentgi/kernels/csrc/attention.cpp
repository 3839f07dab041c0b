// Paged decode attention (attention.h): per work item, the group of query heads sharing a kv head
// reads each of the row's key and value rows once, in place in the cache, a tile of blocks at a time.
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>

#include "attention.h"
#include "common.h"

namespace opentgi {

namespace {

// Value i of a cache row (head_dim values of one position and kv head, in the cache's dtype) as
// float32, exactly: a 16-bit cache is read in place, each value converted where it is used (no
// float32 copy of the tile: half the bytes through the caches), so its numbers are those of a
// float32 cache holding the same values.
template <int KV>
static inline float load1(const void* row, int i) {
  if (KV == KV_F32) return ((const float*)row)[i];
  const uint16_t h = ((const uint16_t*)row)[i];
  return KV == KV_BF16 ? bf16_to_fp32(h) : fp16_to_fp32(h);
}

#ifdef OPENTGI_AVX2
// values i .. i + 7 of a cache row as float32 (F16C for float16)
template <int KV>
static inline __m256 load8(const void* row, int i) {
  if (KV == KV_F32) return _mm256_loadu_ps((const float*)row + i);
  const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)row + i));
  if (KV == KV_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}
#endif
#ifdef OPENTGI_AVX512
// values i .. i + 15 of a cache row as float32
template <int KV>
static inline __m512 load16(const void* row, int i) {
  if (KV == KV_F32) return _mm512_loadu_ps((const float*)row + i);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)row + i));
  if (KV == KV_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}
#endif

// The logits of NG query heads (q + g * D) against the same n key rows: out[g * ostride + j] =
// q_g . k[j] * scale (each out row has n rounded up to 8 writable). In the AVX2 variant keys go 8
// at a time (eight independent FMA chains a head), each key's lanes summed by the same tree
// whatever its place among the 8 (a short last group repeats its last key), so a logit's bits
// depend only on q, the key and D, never on NG (a key's values are loaded once for the NG heads).
// The AVX-512 variant's chains take 16 dimensions a step, each folded to 8 lanes (lane i + lane
// i + 8) before a last 8-wide step where D leaves one and the same tree: its own bits.
template <int KV, int NG>
static inline void logits_of(const float* q, const void* const* k, int n, int D, float scale, float* out,
                             int ostride) {
#ifdef OPENTGI_AVX2
  const int body = D / 8 * 8;
  const __m256 sv = _mm256_set1_ps(scale);
  for (int j = 0; j < n; j += 8) {
    const void* kr[8];
    for (int u = 0; u < 8; ++u) kr[u] = k[j + u < n ? j + u : n - 1];
    __m256 a[NG][8];
#ifdef OPENTGI_AVX512
    const int wide = D / 16 * 16;
    __m512 w[NG][8];
    for (int g = 0; g < NG; ++g)
      for (int u = 0; u < 8; ++u) w[g][u] = _mm512_setzero_ps();
    for (int i = 0; i < wide; i += 16) {
      __m512 qv[NG];
      for (int g = 0; g < NG; ++g) qv[g] = _mm512_loadu_ps(q + g * D + i);
      for (int u = 0; u < 8; ++u) {
        const __m512 kv = load16<KV>(kr[u], i);
        for (int g = 0; g < NG; ++g) w[g][u] = _mm512_fmadd_ps(qv[g], kv, w[g][u]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int u = 0; u < 8; ++u)
        a[g][u] = _mm256_add_ps(_mm512_castps512_ps256(w[g][u]), _mm512_extractf32x8_ps(w[g][u], 1));
    for (int i = wide; i < body; i += 8)
      for (int u = 0; u < 8; ++u) {
        const __m256 kv = load8<KV>(kr[u], i);
        for (int g = 0; g < NG; ++g) a[g][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), kv, a[g][u]);
      }
#else
    for (int g = 0; g < NG; ++g)
      for (int u = 0; u < 8; ++u) a[g][u] = _mm256_setzero_ps();
    for (int i = 0; i < body; i += 8)
      for (int u = 0; u < 8; ++u) {
        const __m256 kv = load8<KV>(kr[u], i);
        for (int g = 0; g < NG; ++g) a[g][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), kv, a[g][u]);
      }
#endif
    for (int g = 0; g < NG; ++g) {
      const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
      const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[g][4], a[g][5]), _mm256_hadd_ps(a[g][6], a[g][7]));
      __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
      if (body < D) {
        float tail[8];
        _mm256_storeu_ps(tail, sums);
        for (int u = 0; u < 8; ++u)
          for (int i = body; i < D; ++i) tail[u] += q[g * D + i] * load1<KV>(kr[u], i);
        sums = _mm256_loadu_ps(tail);
      }
      _mm256_storeu_ps(out + g * ostride + j, _mm256_mul_ps(sums, sv));
    }
  }
#else
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < n; ++j) {
      const float* qg = q + g * D;
      float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      int i = 0;
      for (; i + 4 <= D; i += 4)
        for (int u = 0; u < 4; ++u) p[u] += qg[i + u] * load1<KV>(k[j], i + u);
      float sum = (p[0] + p[1]) + (p[2] + p[3]);
      for (; i < D; ++i) sum += qg[i] * load1<KV>(k[j], i);
      out[g * ostride + j] = sum * scale;
    }
#endif
}

#ifdef OPENTGI_AVX2
// acc[d .. d + 8W) += sum over j (in order) of p[j] * v[j][d ..], the accumulators in registers
template <int W, int KV>
static inline void pv_chunk(float* acc, const float* p, const void* const* v, int n, int d) {
  __m256 r[W];
  for (int u = 0; u < W; ++u) r[u] = _mm256_loadu_ps(acc + d + 8 * u);
  for (int j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int u = 0; u < W; ++u) r[u] = _mm256_fmadd_ps(pj, load8<KV>(v[j], d + 8 * u), r[u]);
  }
  for (int u = 0; u < W; ++u) _mm256_storeu_ps(acc + d + 8 * u, r[u]);
}
#endif

#ifdef OPENTGI_AVX512
// pv_chunk in 512-bit registers for NG heads (acc + g * D, probabilities p + g * pstride) over the
// same value rows, each value loaded once for them: each value's arithmetic as the 256-bit form's
// (the same bits)
template <int NG, int W, int KV>
static inline void pv_chunk16(float* acc, const float* p, int pstride, const void* const* v, int n, int D, int d) {
  __m512 r[NG][W];
  for (int g = 0; g < NG; ++g)
    for (int u = 0; u < W; ++u) r[g][u] = _mm512_loadu_ps(acc + g * D + d + 16 * u);
  for (int j = 0; j < n; ++j) {
    __m512 pj[NG];
    for (int g = 0; g < NG; ++g) pj[g] = _mm512_set1_ps(p[g * pstride + j]);
    for (int u = 0; u < W; ++u) {
      const __m512 vv = load16<KV>(v[j], d + 16 * u);
      for (int g = 0; g < NG; ++g) r[g][u] = _mm512_fmadd_ps(pj[g], vv, r[g][u]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int u = 0; u < W; ++u) _mm512_storeu_ps(acc + g * D + d + 16 * u, r[g][u]);
}
#endif

// acc[g * D + d] += p[g * pstride + j] * v[j][d] for j = 0 .. n - 1 in order, each (head, d) on its
// own, for NG heads over the same value rows
template <int NG, int KV>
static inline void probs_times_values(float* acc, const float* p, int pstride, const void* const* v, int n, int D) {
  int d = 0;
#ifdef OPENTGI_AVX512
  for (; d + 128 <= D; d += 128) pv_chunk16<NG, 8, KV>(acc, p, pstride, v, n, D, d);
  for (; d + 64 <= D; d += 64) pv_chunk16<NG, 4, KV>(acc, p, pstride, v, n, D, d);
  for (; d + 16 <= D; d += 16) pv_chunk16<NG, 1, KV>(acc, p, pstride, v, n, D, d);
#endif
  for (int g = 0; g < NG; ++g) {
    float* ag = acc + g * D;
    const float* pg = p + g * pstride;
    int e = d;
#ifdef OPENTGI_AVX2
    for (; e + 64 <= D; e += 64) pv_chunk<8, KV>(ag, pg, v, n, e);
    for (; e + 8 <= D; e += 8) pv_chunk<1, KV>(ag, pg, v, n, e);
#endif
    for (; e < D; ++e)
      for (int j = 0; j < n; ++j) ag[e] += pg[j] * load1<KV>(v[j], e);
  }
}

// A kv head's G query heads (q + g * D, acc + g * D, logits + g * stride), their logits and their
// probabilities times the values, by groups of heads sharing each key's and value's loads: three
// where AVX-512's registers hold them, else one.
#ifdef OPENTGI_AVX512
constexpr int HEAD_GROUP = 3;
#else
constexpr int HEAD_GROUP = 1;
#endif

template <int KV>
static inline void logits_of_heads(const float* q, int G, const void* const* k, int n, int D, float scale,
                                   float* logits, int stride) {
  int g = 0;
  for (; g + HEAD_GROUP <= G; g += HEAD_GROUP)
    logits_of<KV, HEAD_GROUP>(q + (int64_t)g * D, k, n, D, scale, logits + g * stride, stride);
  if (HEAD_GROUP > 2)
    for (; g + 2 <= G; g += 2) logits_of<KV, 2>(q + (int64_t)g * D, k, n, D, scale, logits + g * stride, stride);
  for (; g < G; ++g) logits_of<KV, 1>(q + (int64_t)g * D, k, n, D, scale, logits + g * stride, stride);
}

template <int KV>
static inline void values_of_heads(float* acc, int G, const float* p, int stride, const void* const* v, int n,
                                   int D) {
  int g = 0;
  for (; g + HEAD_GROUP <= G; g += HEAD_GROUP)
    probs_times_values<HEAD_GROUP, KV>(acc + (int64_t)g * D, p + g * stride, stride, v, n, D);
  if (HEAD_GROUP > 2)
    for (; g + 2 <= G; g += 2) probs_times_values<2, KV>(acc + (int64_t)g * D, p + g * stride, stride, v, n, D);
  for (; g < G; ++g) probs_times_values<1, KV>(acc + (int64_t)g * D, p + g * stride, stride, v, n, D);
}

// the largest and the sum of s[0 .. n) (AVX2: 8 lanes, then across them)
static inline float max_of(const float* s, int n) {
  int j = 0;
  float mb = -std::numeric_limits<float>::infinity();
#ifdef OPENTGI_AVX2
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + j));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    mb = _mm_cvtss_f32(x);
  }
#endif
  for (; j < n; ++j) mb = s[j] > mb ? s[j] : mb;
  return mb;
}

static inline float sum_of(const float* s, int n) {
  int j = 0;
  float sum = 0.0f;
#ifdef OPENTGI_AVX2
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) v = _mm256_add_ps(v, _mm256_loadu_ps(s + j));
    sum = hsum_ps(v);
  }
#endif
  for (; j < n; ++j) sum += s[j];
  return sum;
}

static inline void scale_by(float* acc, float s, int D) {
  for (int i = 0; i < D; ++i) acc[i] *= s;
}


// A tile's keys and values (every kv head's, positions lo .. ctx - 1 of blocks first .. stop - 1),
// a load a cache line, before its arithmetic starts. The blocks lie anywhere in the pool; the dot
// products' chains, waiting on each line as they reach it, keep few of them in flight, where a loop
// of loads alone keeps the memory system busy (64 rows of 45-90 keys, caches larger than the
// last-level cache: about half the time of the same arithmetic without it; prefetch instructions,
// ahead of the arithmetic or a tile ahead, gained nothing or lost). Every kv head's rows: a token's lie side by side, so a block's
// visible tokens are one run of bytes, and an item of one kv head leaves the others' in the cache
// for the items of the same tile that follow it.
static inline void touch_tile(const PagedAttention& a, const int32_t* table, int first, int stop, int lo, int ctx,
                              size_t elem) {
  const int bs = a.block_size;
  const size_t row = (size_t)a.num_kv_heads * a.head_dim * elem;  // a token's keys (or values)
  uint64_t sum = 0;
  for (int blk = first; blk < stop; ++blk) {
    const int t0 = lo > blk * bs ? lo - blk * bs : 0, t1 = ctx < (blk + 1) * bs ? ctx - blk * bs : bs;
    const size_t offset = ((size_t)table[blk] * bs + t0) * row, bytes = (size_t)(t1 - t0) * row;
    for (const void* cache : {a.k_cache, a.v_cache}) {  // each line the run overlaps
      const uintptr_t begin = (uintptr_t)cache + offset, end = begin + bytes;
      for (uintptr_t line = begin & ~(uintptr_t)63; line < end; line += 64) sum += *(const uint8_t*)line;
    }
  }
  __asm__ volatile("" : : "r"(sum));  // the loads stay: their sum is "used"
}

template <int KV>
void attend(const PagedAttention& a, int64_t item0, int64_t item1, float* scratch) {
  const int D = a.head_dim, bs = a.block_size, Hkv = a.num_kv_heads, H = a.num_heads;
  const int G = H / Hkv, per = a.kv_heads_per_item, chunks = Hkv / per;
  const int keys = tile_keys(bs), tile = keys / bs;
  const int stride = (keys + 7) / 8 * 8;  // logits of one query head in one tile
  const size_t elem = KV == KV_F32 ? 4 : 2;
  float* logits = scratch;
  float* acc = logits + (int64_t)G * stride;  // [per * G][D]
  float* m = acc + (int64_t)per * G * D;      // [per * G]: running max
  float* l = m + per * G;                     // [per * G]: running sum
  const void* kp[1024];                       // a tile's key rows, in the cache (tile_keys <= 1024:
  const void* vp[1024];                       // block_size checked by the op), and its value rows
  for (int64_t item = item0; item < item1; ++item) {
    const int64_t unit = item / chunks;
    const int64_t r = a.unit_row[unit];
    const int h0 = (int)(item % chunks) * per, h1 = h0 + per;
    const float* q = a.q + (r * H + (int64_t)h0 * G) * D;  // the item's query heads, in order
    const int ctx = a.ctx[r];
    const int lo = a.window > 0 && ctx > a.window ? ctx - a.window : 0;
    const int32_t* table = a.block_tables + (int64_t)a.seq[r] * a.table_stride;
    // this unit's split of the row's visible blocks
    const int first = lo / bs + a.unit_split[unit] * a.split_blocks, end = (ctx + bs - 1) / bs;
    const int stop = first + a.split_blocks < end ? first + a.split_blocks : end;
    for (int i = 0; i < per * G; ++i) {
      m[i] = -std::numeric_limits<float>::infinity();
      l[i] = 0.0f;
    }
    std::memset(acc, 0, sizeof(float) * per * G * D);
    for (int tb = first; tb < stop; tb += tile) {  // a tile: `tile` blocks, one softmax update
      const int te = tb + tile < stop ? tb + tile : stop;
      touch_tile(a, table, tb, te, lo, ctx, elem);
      for (int h = h0; h < h1; ++h) {  // each kv head on its own: its numbers never see the others
        int n = 0;
        for (int blk = tb; blk < te; ++blk) {
          const int t0 = lo > blk * bs ? lo - blk * bs : 0;
          const int t1 = ctx < (blk + 1) * bs ? ctx - blk * bs : bs;
          const int64_t row = ((int64_t)table[blk] * bs + t0) * Hkv + h;  // cache row of (t0, h)
          for (int j = 0; j < t1 - t0; ++j, ++n) {
            kp[n] = (const char*)a.k_cache + (row + (int64_t)j * Hkv) * D * elem;
            vp[n] = (const char*)a.v_cache + (row + (int64_t)j * Hkv) * D * elem;
          }
        }
        const int i0 = (h - h0) * G;  // the head's query heads within the item
        logits_of_heads<KV>(q + (int64_t)i0 * D, G, kp, n, D, a.scale, logits, stride);
        for (int g = 0; g < G; ++g) {
          float* s = logits + g * stride;
          if (a.softcap > 0.0f)
            for (int j = 0; j < n; ++j) s[j] = a.softcap * std::tanh(s[j] / a.softcap);
          const float mb = max_of(s, n);
          if (mb > m[i0 + g]) {
            const float alpha = std::exp(m[i0 + g] - mb);
            l[i0 + g] *= alpha;
            scale_by(acc + (int64_t)(i0 + g) * D, alpha, D);
            m[i0 + g] = mb;
          }
          exp_shifted(s, n, m[i0 + g]);
          l[i0 + g] += sum_of(s, n);
        }
        values_of_heads<KV>(acc + (int64_t)i0 * D, G, logits, stride, vp, n, D);
      }
    }
    if (a.unit_parts[unit] > 1) {  // the split's own numbers, for combine_splits
      float* part = a.partial + item * (int64_t)per * G * (D + 2);
      for (int i = 0; i < per * G; ++i) {
        std::memcpy(part + (int64_t)i * (D + 2), acc + (int64_t)i * D, sizeof(float) * D);
        part[(int64_t)i * (D + 2) + D] = m[i];
        part[(int64_t)i * (D + 2) + D + 1] = l[i];
      }
      continue;
    }
    float* out = a.out + (r * H + (int64_t)h0 * G) * D;
    for (int i = 0; i < per * G; ++i) {
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      for (int d = 0; d < D; ++d) out[(int64_t)i * D + d] = acc[(int64_t)i * D + d] * inv;
    }
  }
}

}  // namespace

void OPENTGI_FN(paged_attention)(const PagedAttention& a, int64_t item0, int64_t item1, float* scratch) {
  switch (a.kv_dtype) {
    case KV_F32: attend<KV_F32>(a, item0, item1, scratch); break;
    case KV_BF16: attend<KV_BF16>(a, item0, item1, scratch); break;
    default: attend<KV_F16>(a, item0, item1, scratch); break;
  }
}

}  // namespace opentgi
