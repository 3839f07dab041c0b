// Q4_0, Q4_1 and Q6_K weights against bfloat16 activation rows (common.h ActBF16): the form
// `passes=2` takes for rows that hold bfloat16 values where the CPU has AVX-512 BF16 (matmul.h
// kernel_for). The rows' own values enter the products (ActQ16 would round each to 16 bits of its
// block's range), and the weights' integers (Q4_0's q - 8, Q4_1's q, Q6_K's q - 32) are exact in
// bfloat16. Q6_K takes it repacked by sixteen rows (Q6_K_R16, r16.h; models/quantization/
// gguf_blocks.py repacks): in the file's layout, transposing sixteen rows' bytes a superblock left
// its one-row form at 0.72x its 16-bit kernel. (Q4_K keeps its 16-bit activation blocks: its wide
// kernel was as fast from 16 rows and faster for one to four, whose arithmetic a bfloat16 form would
// have to share.)
//
// One order per output on every ISA, whatever the rows, the tile or the thread. A block's 32 values
// (ActBF16's block) are summed as four float32 sums from zero, sum j taking the block's value pairs
// (ActBF16's words) k = j, j + 4, j + 8, j + 12 in turn, each pair's second value's product then its
// first's by fused multiply-adds (AVX-512 BF16's VDPBF16PS order: one instruction for sixteen
// outputs where the CPU has it, two fused multiply-adds elsewhere), then (s0 + s1) + (s2 + s3).
// Each block adds one term to the output, in block order from zero: Q4_0's d * sum, Q4_1's
// d * sum + m * x_sum (x_sum: the block's values added by quantize_bf16's tree). The two forms agree
// bit for bit except where a value or partial sum falls below float32's normal range, which the
// instruction flushes to zero (dense.cpp's BF16 rule).
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "tiles.h"

namespace opentgi {
namespace {

// the bfloat16 bits of a small integer (|n| < 256: exact)
constexpr uint16_t bf16_of_int(int n) {
  if (n == 0) return 0;
  const uint16_t sign = n < 0 ? 0x8000 : 0;
  const int a = n < 0 ? -n : n;
  int e = 0;
  while ((a >> (e + 1)) != 0) ++e;
  return (uint16_t)(sign | ((127 + e) << 7) | (((a - (1 << e)) << (7 - e)) & 0x7F));
}

// ActBF16's pair k: values lo(k) (the first, low half) and lo(k) + 2 (the second, high half)
constexpr int pair_lo(int k) { return 4 * (k / 2) + (k & 1); }

#ifdef OPENTGI_AVX512
// acc + the sixteen lanes of w by the bfloat16 pair at p, broadcast (VDPBF16PS with the pair as its
// broadcast memory operand: one instruction, where the intrinsics take a second for the broadcast)
__attribute__((target("avx512bf16"))) static inline __m512 dp_pair(__m512 acc, __m512bh w, const uint16_t* p) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)p));
  return acc;
}
#endif

template <int Kind>  // 0 Q4_0, 1 Q4_1
struct TileBF16 {
  using Block = std::conditional_t<Kind == 1, BlockQ4_1, BlockQ4_0>;
  static constexpr int OFF = Kind == 0 ? 8 : 0;

  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const Block* w = (const Block*)wr;
    const ActBF16* a[R];
    float acc[R];
    start_tile(act, stride, a, acc);
    float wv[QK];
    for (int b = 0; b < K / QK; ++b) {
      for (int i = 0; i < 16; ++i) {
        wv[i] = (float)((w[b].qs[i] & 0x0F) - OFF);
        wv[i + 16] = (float)((w[b].qs[i] >> 4) - OFF);
      }
      const float dw = fp16_to_fp32(w[b].d);
      for (int r = 0; r < R; ++r) {
        const ActBF16& y = a[r][b];
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k = 0; k < 16; ++k) {
          const int lo = pair_lo(k);
          s[k % 4] = std::fma(wv[lo + 2], bf16_to_fp32(y.v[2 * k + 1]), s[k % 4]);
          s[k % 4] = std::fma(wv[lo], bf16_to_fp32(y.v[2 * k]), s[k % 4]);
        }
        const float t = dw * ((s[0] + s[1]) + (s[2] + s[3]));
        if constexpr (Kind == 1) acc[r] += t + fp16_to_fp32(w[b].m) * y.sum; else acc[r] += t;
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
  }

#ifdef OPENTGI_AVX512
  // Sixteen weight rows at once, row c's sums in float lane c, run<R>'s arithmetic lane by lane: the
  // nibbles (tiles.h values16) as bfloat16 by one permute each (a 16-bit lane's low byte, value 4g
  // or 4g + 1, picks its entry; the pair's second value, 4g + 2 or 4g + 3, is that lane's high
  // byte), each activation pair broadcast; the weights unpacked once a block for a tile of up to
  // sixteen activation rows (the unpacking is a large share of the work: the more rows the better,
  // up to what the registers hold).
  // (S = 16: the rows repacked, r16.h.)
  static constexpr int run16_from = 1;
  static constexpr int rows = 16;
  template <int R, int S = 1>
  __attribute__((target("avx512bf16"))) static void run16(const uint8_t* wr, size_t row_bytes, const uint8_t* act,
                                                          size_t stride, int K, float* out, int ldo) {
    const int nb = K / QK;
    const ActBF16* a[R];
    __m512 acc[R];
    start_tile(act, stride, a, acc);
    alignas(64) uint16_t entries[32] = {};
    for (int q = 0; q < 16; ++q) entries[q] = bf16_of_int(q - OFF);
    const __m512i table = _mm512_load_si512(entries);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(Block) * S;
      prefetch_blocks16<S>(wr, row_bytes, base, sizeof(Block), b, nb);
      __m512 dv, mv;
      if constexpr (Kind == 0) {  // d alone (Q4_0_R16: the sixteen d side by side, r16.h)
        dv = mv = d16<S>(base, row_bytes);
      } else {
        const __m512i head = header16<S>(base, row_bytes);
        dv = fp16_lanes16<false>(head), mv = fp16_lanes16<true>(head);
      }
      __m512i w[8];  // w[g] lane c: values 4g .. 4g + 3 of row c, as bytes
      values16<Kind, S>(base, row_bytes, w);
      __m512bh wb[16];  // pair k of ActBF16's order, row c in lane c
      for (int g = 0; g < 8; ++g) {
        wb[2 * g] = (__m512bh)_mm512_permutexvar_epi16(w[g], table);
        wb[2 * g + 1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w[g], 8), table);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const ActBF16& y = a[r][b];
        __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int k = 0; k < 16; ++k) s[k % 4] = dp_pair(s[k % 4], wb[k], y.v + 2 * k);
        __m512 t = _mm512_mul_ps(dv, _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3])));
        if constexpr (Kind == 1) t = _mm512_add_ps(t, _mm512_mul_ps(mv, _mm512_set1_ps(y.sum)));
        acc[r] = _mm512_add_ps(acc[r], t);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
  }
#endif
};

#ifdef OPENTGI_AVX512
// Q4_0_R16 and Q4_1_R16 (r16.h): the sixteen-output form on the repacked groups (the file layout's bits);
// tiles.h's TileR16 with AVX-512 BF16's target, so that the form inlines into its call
template <int Kind>
struct TileBF16R16 : TileBF16<Kind> {
  template <int R>
  __attribute__((target("avx512bf16"))) static void run16(const uint8_t* grp, size_t row_bytes, const uint8_t* act,
                                                          size_t stride, int K, float* out, int ldo) {
    TileBF16<Kind>::template run16<R, 16>(grp, row_bytes, act, stride, K, out, ldo);
  }
};
#else
template <int Kind>
using TileBF16R16 = TileBF16<Kind>;
#endif

// q - 32 as bfloat16 for q = 0 .. 63 (the two 32-entry tables of a two-table permute)
struct alignas(64) Q6KTable { uint16_t v[64]; };
constexpr Q6KTable q6k_table() {
  Q6KTable t{};
  for (int q = 0; q < 64; ++q) t.v[q] = bf16_of_int(q - 32);
  return t;
}

// The order of a superblock's sub-blocks in Q6_K's sums: those whose values share ql's and qh's
// words in turn (the order the sixteen-row form unpacks them in).
constexpr int Q6K_ORDER[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};

// Q6_K (w = d * sc_j * (q - 32), sub-blocks j of 16 values, int8 sc_j) against ActBF16 rows: q - 32
// is exact in bfloat16, sc_j and d enter in float32. Per output and superblock: sub-block j's sum s_j
// from zero over its eight pairs in order (pairs 8 * (j % 2) .. + 7 of its 32-value block, each the
// second value's product then the first's, as TileBF16's); T = fma(s_j, sc_j, T) from zero, j in
// Q6K_ORDER; then the output adds d * T, superblock by superblock. This form reads the file's
// layout, one output at a time.
struct TileQ6KBF16 {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const BlockQ6_K* w = (const BlockQ6_K*)wr;
    const ActBF16* a[R];
    float acc[R];
    start_tile(act, stride, a, acc);
    float wv[QK_K];
    for (int b = 0; b < K / QK_K; ++b) {
      const BlockQ6_K& x = w[b];
      q6k_unpack(x, wv);
      for (float& v : wv) v -= 32.0f;  // exact: small integers
      const float dw = fp16_to_fp32(x.d);
      for (int r = 0; r < R; ++r) {
        float t = 0.0f;
        for (int j : Q6K_ORDER) {
          const ActBF16& y = a[r][8 * b + j / 2];
          const float* v = wv + 32 * (j / 2);
          float s = 0.0f;
          for (int p = 0; p < 8; ++p) {
            const int k = 8 * (j % 2) + p, lo = pair_lo(k);
            s = std::fma(v[lo + 2], bf16_to_fp32(y.v[2 * k + 1]), s);
            s = std::fma(v[lo], bf16_to_fp32(y.v[2 * k]), s);
          }
          t = std::fma(s, (float)x.scales[j], t);
        }
        acc[r] += dw * t;
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
  }
};

#ifdef OPENTGI_AVX512
// TileQ6KBF16's arithmetic for sixteen outputs at once, row c of a Q6_K_R16 group (r16.h) in
// lane c: a superblock's vectors loaded whole, the 6-bit values assembled (the two bits above them
// in each byte left as they come: the permute reads six), q - 32 as bfloat16 by one two-table permute
// a pair vector, two sub-blocks at a time in Q6K_ORDER, their pairs taken by every activation row of
// the tile as they come (two chains a row, interleaved; the rows' chains and the next sub-blocks'
// unpacking overlap).
struct TileQ6KR16 : TileQ6KBF16 {
  static constexpr int run16_from = 1;
  static constexpr int rows = 16;

  // one superblock's sums of R activation rows (t[r]), fed two sub-blocks at a time (a function of
  // its own, so that the dot products inline)
  template <int R>
  struct Rows {
    const ActBF16* a[R];
    int b;
    __m512 t[R];
    __attribute__((target("avx512bf16"))) inline void operator()(const int* j, const __m512bh (*pairs)[8],
                                                                 const __m512* sc) {
      for (int r = 0; r < R; ++r) {
        const uint16_t* y0 = a[r][8 * b + j[0] / 2].v + 16 * (j[0] % 2);
        const uint16_t* y1 = a[r][8 * b + j[1] / 2].v + 16 * (j[1] % 2);
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (int p = 0; p < 8; ++p) {
          s0 = dp_pair(s0, pairs[0][p], y0 + 2 * p);
          s1 = dp_pair(s1, pairs[1][p], y1 + 2 * p);
        }
        t[r] = _mm512_fmadd_ps(s1, sc[1], _mm512_fmadd_ps(s0, sc[0], t[r]));
      }
    }
  };

  // each(j, pairs, sc) for a superblock's 52 vectors at vecs, sub-blocks j[0], j[1] at a time in
  // Q6K_ORDER: their eight pairs each (ActBF16's order, lane c: row c) and their scales as floats
  template <class Each>
  __attribute__((target("avx512bf16"))) static inline void unpack(const uint8_t* vecs, Each& each) {
    static constexpr Q6KTable table = q6k_table();
    const __m512i lo_table = _mm512_load_si512(table.v), hi_table = _mm512_load_si512(table.v + 32);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i* V = (const __m512i*)vecs;
    __m512 sc[16];
    for (int m = 0; m < 4; ++m) {
      const __m512i w = _mm512_loadu_si512(V + m);
      for (int i = 0; i < 4; ++i)
        sc[4 * m + i] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * i), 24));
    }
    for (int h = 0; h < 2; ++h) {
      for (int u = 0; u < 2; ++u) {
        const __m512i* at = V + 4 + 12 * (2 * h + u);
        __m512i l1[4], l2[4], hb[4];  // lane c: ql bytes 64h + 16u + 4g, 64h + 32 + 16u + 4g; qh 32h + 16u + 4g
        for (int g = 0; g < 4; ++g) {
          l1[g] = _mm512_loadu_si512(at + g);
          l2[g] = _mm512_loadu_si512(at + 4 + g);
          hb[g] = _mm512_loadu_si512(at + 8 + g);
        }
        for (int half = 0; half < 2; ++half) {  // sub-blocks two at a time: two chains a row
          __m512bh pairs[2][8];
          int j[2];
          __m512 scs[2];
#pragma GCC unroll 2
          for (int i = 0; i < 2; ++i) {
            const int part = 2 * half + i;  // sub-block 8h + 2 * part + u
            for (int g = 0; g < 4; ++g) {  // lane c: values 4g .. 4g + 3 of the sub-block (low six bits)
              __m512i q;  // low nibbles from ql (0xCA: m4 ? ql : qh's bits), bits 4-5 from qh
              switch (part) {
                case 0: q = _mm512_ternarylogic_epi32(m4, l1[g], _mm512_slli_epi16(hb[g], 4), 0xCA); break;
                case 1: q = _mm512_ternarylogic_epi32(m4, l2[g], _mm512_slli_epi16(hb[g], 2), 0xCA); break;
                case 2: q = _mm512_ternarylogic_epi32(m4, _mm512_srli_epi16(l1[g], 4), hb[g], 0xCA); break;
                default: q = _mm512_ternarylogic_epi32(m4, _mm512_srli_epi16(l2[g], 4), _mm512_srli_epi16(hb[g], 2), 0xCA);
              }
              // a 16-bit lane's low byte picks its entry (values 4g, 4g + 2), then its high byte (4g + 1, 4g + 3)
              pairs[i][2 * g] = (__m512bh)_mm512_permutex2var_epi16(lo_table, q, hi_table);
              pairs[i][2 * g + 1] = (__m512bh)_mm512_permutex2var_epi16(lo_table, _mm512_srli_epi16(q, 8), hi_table);
            }
            j[i] = 8 * h + 2 * part + u;
            scs[i] = sc[j[i]];
          }
          each(j, pairs, scs);
        }
      }
    }
  }

  // rows against the sixteen outputs of the group at grp (16 * row_bytes bytes)
  template <int R>
  __attribute__((target("avx512bf16"))) static void run16(const uint8_t* grp, size_t row_bytes, const uint8_t* act,
                                                          size_t stride, int K, float* out, int ldo) {
    const int nb = K / QK_K;
    alignas(64) float acc[R][16] = {};
    Rows<R> rows;
    for (int r = 0; r < R; ++r) rows.a[r] = (const ActBF16*)(act + r * stride);
    const uint8_t* ds = grp + (size_t)nb * Q6K_R16_SUPER;
    for (int b = 0; b < nb; ++b) {
      const uint8_t* vecs = grp + (size_t)b * Q6K_R16_SUPER;
      prefetch_blocks16<16>(grp, row_bytes, vecs, Q6K_R16_SUPER / 16, b, nb);
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ds + 32 * b)));
      rows.b = b;
      for (int r = 0; r < R; ++r) rows.t[r] = _mm512_setzero_ps();
      unpack(vecs, rows);
      for (int r = 0; r < R; ++r)
        _mm512_store_ps(acc[r], _mm512_add_ps(_mm512_load_ps(acc[r]), _mm512_mul_ps(dv, rows.t[r])));
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_load_ps(acc[r]));
  }
};
#else
using TileQ6KR16 = TileQ6KBF16;
#endif

}  // namespace

// a row of K float32 values (each a bfloat16 value) as ActBF16 blocks: the values in pair order, and
// each block's sum by one tree (values i and i + 16 added, then those sixteen folded by halves:
// + 8, + 4, + 2, + 1), the same bits whatever vectors a variant's compiler forms it with
void OPENTGI_FN(quantize_bf16)(const float* x, int K, ActBF16* out) {
  for (int b = 0; b < K / QK; ++b) {
    const float* v = x + b * QK;
#ifdef OPENTGI_AVX2
    // the scalar loops' arithmetic eight values a step: the same tree of adds (halves, quarters,
    // ...), bf16_store's rounding, each group of four values in pair order (0, 2, 1, 3)
    const __m256 lo = _mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 16));
    const __m256 l8 = _mm256_add_ps(lo, _mm256_add_ps(_mm256_loadu_ps(v + 8), _mm256_loadu_ps(v + 24)));
    const __m128 l4 = _mm_add_ps(_mm256_castps256_ps128(l8), _mm256_extractf128_ps(l8, 1));
    const __m128 l2 = _mm_add_ps(l4, _mm_movehl_ps(l4, l4));
    out[b].sum = _mm_cvtss_f32(_mm_add_ss(l2, _mm_shuffle_ps(l2, l2, 1)));
    const __m256i order = _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7);
    for (int i = 0; i < QK; i += 8) store_bf16_8(out[b].v, i, _mm256_permutevar8x32_ps(_mm256_loadu_ps(v + i), order));
#else
    float l[16];
    for (int i = 0; i < 16; ++i) l[i] = v[i] + v[i + 16];
    for (int w = 8; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) l[i] = l[i] + l[i + w];
    out[b].sum = l[0];
    for (int k = 0; k < 16; ++k) {
      out[b].v[2 * k] = bf16_store(v[pair_lo(k)]);
      out[b].v[2 * k + 1] = bf16_store(v[pair_lo(k) + 2]);
    }
#endif
  }
}

void OPENTGI_FN(matmul_q4_0_bf16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                  int n1, int K, float* out, int ldo) {
  drive<TileBF16<0>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q4_1_bf16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                  int n1, int K, float* out, int ldo) {
  drive<TileBF16<1>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q4_0_bf16_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                      int n1, int K, float* out, int ldo) {
  drive_r16<TileBF16<0>, TileBF16R16<0>>(w, rb, sizeof(BlockQ4_0), act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q4_1_bf16_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                      int n1, int K, float* out, int ldo) {
  drive_r16<TileBF16<1>, TileBF16R16<1>>(w, rb, sizeof(BlockQ4_1), act, arb, M, n0, n1, K, out, ldo);
}

// Sixteen rows of nb Q6_K superblocks into their Q6_K_R16 group (r16.h q6k_r16_group): on AVX-512
// each run of four words by the kernels' own transposition (words16)
void OPENTGI_FN(repack_q6_k16)(const uint8_t* rows, size_t row_bytes, int nb, uint8_t* group) {
#ifdef OPENTGI_AVX512
  for (int b = 0; b < nb; ++b) {
    const uint8_t* block = rows + (size_t)b * sizeof(BlockQ6_K);
    uint8_t* vecs = group + (size_t)b * Q6K_R16_SUPER;
    for (int v = 0; v < (int)Q6K_R16_VECTORS; v += 4) {  // words v .. v + 3: 16 bytes of each row
      __m512i t[4];
      words16(block + q6k_r16_source(v), row_bytes, t);
      for (int g = 0; g < 4; ++g) _mm512_storeu_si512((void*)(vecs + 64 * (v + g)), t[g]);
    }
    uint8_t* d = group + (size_t)nb * Q6K_R16_SUPER + 32 * b;
    for (int c = 0; c < 16; ++c) std::memcpy(d + 2 * c, block + c * row_bytes + offsetof(BlockQ6_K, d), 2);
  }
#else
  q6k_r16_group<false>((uint8_t*)rows, row_bytes, nb, group);
#endif
}

// Q6_K_R16 (r16.h) against bfloat16 rows: outputs n0 .. n1 - 1, whole groups of sixteen
void OPENTGI_FN(matmul_q6_k_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                 int n1, int K, float* out, int ldo) {
  drive_r16<TileQ6KBF16, TileQ6KR16>(w, rb, sizeof(BlockQ6_K), act, arb, M, n0, n1, K, out, ldo);
}

}  // namespace opentgi
