// Paged prompt attention (attention.h): a tile of one sequence's consecutive prompt rows against one
// kv head, keys met in units of PROMPT_UNIT positions, the unit's keys transposed once for all of
// the tile's query heads.
#include <cmath>
#include <cstring>
#include <limits>

#include "attention.h"
#include "common.h"

namespace opentgi {

namespace {

constexpr int U = PROMPT_UNIT;

// One cache row (head_dim values of one position and kv head) as float32: the cache's own memory
// for float32, else converted into `buf`.
template <int KV>
static inline const float* cache_row(const void* cache, int64_t off, int D, float* buf) {
  if (KV == KV_F32) return (const float*)cache + off;
  const uint16_t* src = (const uint16_t*)cache + off;
  int i = 0;
#ifdef OPENTGI_AVX2
  for (; i + 8 <= D; i += 8) {
    const __m128i h = _mm_loadu_si128((const __m128i*)(src + i));
    _mm256_storeu_ps(buf + i, KV == KV_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                            : _mm256_cvtph_ps(h));
  }
#endif
  for (; i < D; ++i) buf[i] = KV == KV_BF16 ? bf16_to_fp32(src[i]) : fp16_to_fp32(src[i]);
  return buf;
}

// kt[d][j] = k[j][d] for j < n8 (a multiple of 8; rows past the real keys are zero rows)
static void transpose_keys(const float* const* k, int n8, int D, float* kt) {
  int d0 = 0;
#ifdef OPENTGI_AVX2
  for (int j = 0; j < n8; j += 8) {
    for (int d = 0; d + 8 <= D; d += 8) {
      __m256 r[8];
      for (int u = 0; u < 8; ++u) r[u] = _mm256_loadu_ps(k[j + u] + d);
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      _mm256_storeu_ps(kt + (d + 0) * U + j, _mm256_permute2f128_ps(s0, s4, 0x20));
      _mm256_storeu_ps(kt + (d + 1) * U + j, _mm256_permute2f128_ps(s1, s5, 0x20));
      _mm256_storeu_ps(kt + (d + 2) * U + j, _mm256_permute2f128_ps(s2, s6, 0x20));
      _mm256_storeu_ps(kt + (d + 3) * U + j, _mm256_permute2f128_ps(s3, s7, 0x20));
      _mm256_storeu_ps(kt + (d + 4) * U + j, _mm256_permute2f128_ps(s0, s4, 0x31));
      _mm256_storeu_ps(kt + (d + 5) * U + j, _mm256_permute2f128_ps(s1, s5, 0x31));
      _mm256_storeu_ps(kt + (d + 6) * U + j, _mm256_permute2f128_ps(s2, s6, 0x31));
      _mm256_storeu_ps(kt + (d + 7) * U + j, _mm256_permute2f128_ps(s3, s7, 0x31));
    }
  }
  d0 = D / 8 * 8;
#endif
  for (int j = 0; j < n8; ++j)
    for (int d = d0; d < D; ++d) kt[d * U + j] = k[j][d];
}

// s[qi][j] = (sum over d in order of q_qi[d] * k_j[d]) * scale for the n keys of kt ([D][U], key j
// in column j, columns n .. U - 1 zero): each (query, key) one chain of multiply-adds in d order,
// whatever queries and keys are computed beside it
static void logits(const float* const* q, int nq, const float* kt, int n, int D, float scale, float* s, int ss) {
  int qi = 0;
#ifdef OPENTGI_AVX2
  const __m256 sv = _mm256_set1_ps(scale);
  for (; qi < nq; qi += 4) {
    const float* qq[4];
    for (int t = 0; t < 4; ++t) qq[t] = q[qi + t < nq ? qi + t : nq - 1];
    for (int j = 0; j < n; j += 16) {
      __m256 acc[4][2];
      for (int t = 0; t < 4; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * U + j), k1 = _mm256_loadu_ps(kt + d * U + j + 8);
        for (int t = 0; t < 4; ++t) {
          const __m256 b = _mm256_set1_ps(qq[t][d]);
          acc[t][0] = _mm256_fmadd_ps(b, k0, acc[t][0]);
          acc[t][1] = _mm256_fmadd_ps(b, k1, acc[t][1]);
        }
      }
      for (int t = 0; t < 4 && qi + t < nq; ++t) {
        _mm256_storeu_ps(s + (int64_t)(qi + t) * ss + j, _mm256_mul_ps(acc[t][0], sv));
        _mm256_storeu_ps(s + (int64_t)(qi + t) * ss + j + 8, _mm256_mul_ps(acc[t][1], sv));
      }
    }
  }
#else
  for (; qi < nq; ++qi)
    for (int j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int d = 0; d < D; ++d) sum += q[qi][d] * kt[d * U + j];
      s[(int64_t)qi * ss + j] = sum * scale;
    }
#endif
}

// acc_qi[d] += p_qi[j] * v_j[d] for j = 0 .. n - 1 in order, each (query, d) on its own (a zero
// p adds nothing: the values are finite)
static void values(float* const* acc, int nq, const float* p, int ps, const float* const* v, int n, int D) {
  int d0 = 0;
#ifdef OPENTGI_AVX2
  for (int qi = 0; qi < nq; qi += 4) {
    const int w = nq - qi < 4 ? nq - qi : 4;
    int d = 0;
    for (; d + 16 <= D; d += 16) {
      __m256 r[4][2];
      for (int t = 0; t < w; ++t) {
        r[t][0] = _mm256_loadu_ps(acc[qi + t] + d);
        r[t][1] = _mm256_loadu_ps(acc[qi + t] + d + 8);
      }
      for (int j = 0; j < n; ++j) {
        const __m256 v0 = _mm256_loadu_ps(v[j] + d), v1 = _mm256_loadu_ps(v[j] + d + 8);
        for (int t = 0; t < w; ++t) {
          const __m256 pj = _mm256_set1_ps(p[(int64_t)(qi + t) * ps + j]);
          r[t][0] = _mm256_fmadd_ps(pj, v0, r[t][0]);
          r[t][1] = _mm256_fmadd_ps(pj, v1, r[t][1]);
        }
      }
      for (int t = 0; t < w; ++t) {
        _mm256_storeu_ps(acc[qi + t] + d, r[t][0]);
        _mm256_storeu_ps(acc[qi + t] + d + 8, r[t][1]);
      }
    }
    for (; d + 8 <= D; d += 8)
      for (int t = 0; t < w; ++t) {
        __m256 r0 = _mm256_loadu_ps(acc[qi + t] + d);
        for (int j = 0; j < n; ++j)
          r0 = _mm256_fmadd_ps(_mm256_set1_ps(p[(int64_t)(qi + t) * ps + j]), _mm256_loadu_ps(v[j] + d), r0);
        _mm256_storeu_ps(acc[qi + t] + d, r0);
      }
  }
  d0 = D / 8 * 8;
#endif
  for (int qi = 0; qi < nq; ++qi)
    for (int d = d0; d < D; ++d)
      for (int j = 0; j < n; ++j) acc[qi][d] += p[(int64_t)qi * ps + j] * v[j][d];
}

// the largest of s[0 .. n8) (n8 a multiple of 8): exact whatever the order
static inline float max_of(const float* s, int n8) {
#ifdef OPENTGI_AVX2
  __m256 mx = _mm256_loadu_ps(s);
  for (int j = 8; j < n8; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
  float lanes[8];
  _mm256_storeu_ps(lanes, mx);
  float m = lanes[0];
  for (int i = 1; i < 8; ++i) m = lanes[i] > m ? lanes[i] : m;
  return m;
#else
  float m = s[0];
  for (int j = 1; j < n8; ++j) m = s[j] > m ? s[j] : m;
  return m;
#endif
}

// the sum of s[0 .. n8): eight lanes over the chunks of 8 in order, then the lanes in one fixed
// tree (zeros past a row's keys add nothing)
static inline float sum_of(const float* s, int n8) {
#ifdef OPENTGI_AVX2
  __m256 acc = _mm256_loadu_ps(s);
  for (int j = 8; j < n8; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(s + j));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
#else
  float sum = 0.0f;
  for (int j = 0; j < n8; ++j) sum += s[j];
  return sum;
#endif
}

template <int KV>
void tile(const PagedAttention& a, int64_t r0, int R, int h, float* scratch) {
  const int D = a.head_dim, bs = a.block_size, Hkv = a.num_kv_heads, H = a.num_heads, G = H / Hkv;
  const int nq = R * G, ss = U + 8;
  float* kt = scratch;                         // [D][U]: the unit's keys, transposed
  float* buf = kt + (int64_t)D * U;            // [U][D]: its keys, then values, as float32 (16-bit caches)
  float* zero = buf + (int64_t)U * D;          // [D]: zeros, the keys past the unit's last
  float* s = zero + D;                         // [nq][U + 8]: logits, then probabilities
  float* acc = s + (int64_t)nq * ss;           // [nq][D]
  float* m = acc + (int64_t)nq * D;            // [nq]: running max
  float* l = m + nq;                           // [nq]: running sum
  const float* kp[U];
  const float* vp[U];
  std::memset(zero, 0, sizeof(float) * D);
  const float* q[PROMPT_TILE_ROWS * 256];
  float* accs[PROMPT_TILE_ROWS * 256];
  int ctx[PROMPT_TILE_ROWS], lo[PROMPT_TILE_ROWS];
  for (int i = 0; i < R; ++i) {
    ctx[i] = a.ctx[r0 + i];
    lo[i] = a.window > 0 && ctx[i] > a.window ? ctx[i] - a.window : 0;
    for (int g = 0; g < G; ++g) {
      q[i * G + g] = a.q + ((r0 + i) * H + (int64_t)h * G + g) * D;
      accs[i * G + g] = acc + (int64_t)(i * G + g) * D;
    }
  }
  for (int i = 0; i < nq; ++i) {
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.0f;
  }
  std::memset(acc, 0, sizeof(float) * nq * D);
  const int32_t* table = a.block_tables + (int64_t)a.seq[r0] * a.table_stride;
  const int64_t row_elems = (int64_t)Hkv * D;
  // lo and ctx grow with the row: units from row 0's first key to row R - 1's last
  for (int p0 = lo[0] / U * U; p0 < ctx[R - 1]; p0 += U) {
    const int n = ctx[R - 1] - p0 < U ? ctx[R - 1] - p0 : U;
    const int n8 = (n + 7) / 8 * 8, padded = (n + 15) / 16 * 16;
    for (int j = 0; j < padded; ++j) {
      if (j >= n) {
        kp[j] = zero;
        continue;
      }
      const int pos = p0 + j;
      kp[j] = cache_row<KV>(a.k_cache, ((int64_t)table[pos / bs] * bs + pos % bs) * row_elems + (int64_t)h * D, D,
                            buf + (int64_t)j * D);
    }
    transpose_keys(kp, padded, D, kt);
    for (int j = 0; j < n; ++j) {
      const int pos = p0 + j;
      vp[j] = cache_row<KV>(a.v_cache, ((int64_t)table[pos / bs] * bs + pos % bs) * row_elems + (int64_t)h * D, D,
                            buf + (int64_t)j * D);
    }
    logits(q, nq, kt, padded, D, a.scale, s, ss);
    for (int i = 0; i < R; ++i) {
      const int j0 = lo[i] > p0 ? lo[i] - p0 : 0;  // the row's keys in the unit: j0 .. j1 - 1
      const int j1 = ctx[i] - p0 < n ? ctx[i] - p0 : n;
      for (int g = 0; g < G; ++g) {
        const int qi = i * G + g;
        float* row = s + (int64_t)qi * ss;
        if (j1 <= j0) {  // none: the row adds nothing
          for (int j = 0; j < n; ++j) row[j] = 0.0f;
          continue;
        }
        if (a.softcap > 0.0f)
          for (int j = j0; j < j1; ++j) row[j] = a.softcap * std::tanh(row[j] / a.softcap);
        for (int j = 0; j < j0; ++j) row[j] = -std::numeric_limits<float>::infinity();
        for (int j = j1; j < n8; ++j) row[j] = -std::numeric_limits<float>::infinity();
        const float mb = max_of(row, n8);
        if (mb > m[qi]) {
          const float alpha = std::exp(m[qi] - mb);
          l[qi] *= alpha;
          for (int d = 0; d < D; ++d) accs[qi][d] *= alpha;
          m[qi] = mb;
        }
        exp_shifted(row + j0, j1 - j0, m[qi]);
        for (int j = 0; j < j0; ++j) row[j] = 0.0f;
        for (int j = j1; j < n8; ++j) row[j] = 0.0f;
        l[qi] += sum_of(row, n8);
      }
    }
    values(accs, nq, s, ss, vp, n, D);
  }
  for (int i = 0; i < R; ++i)
    for (int g = 0; g < G; ++g) {
      const int qi = i * G + g;
      const float inv = l[qi] > 0.0f ? 1.0f / l[qi] : 0.0f;
      float* out = a.out + ((r0 + i) * H + (int64_t)h * G + g) * D;
      for (int d = 0; d < D; ++d) out[d] = accs[qi][d] * inv;
    }
}

}  // namespace

void OPENTGI_FN(prompt_attention)(const PagedAttention& a, const int32_t* tiles, int64_t item0, int64_t item1,
                                  float* scratch) {
  for (int64_t item = item0; item < item1; ++item) {
    const int64_t t = item / a.num_kv_heads;
    const int h = (int)(item % a.num_kv_heads);
    switch (a.kv_dtype) {
      case KV_F32: tile<KV_F32>(a, tiles[2 * t], tiles[2 * t + 1], h, scratch); break;
      case KV_BF16: tile<KV_BF16>(a, tiles[2 * t], tiles[2 * t + 1], h, scratch); break;
      default: tile<KV_F16>(a, tiles[2 * t], tiles[2 * t + 1], h, scratch); break;
    }
  }
}

}  // namespace opentgi
