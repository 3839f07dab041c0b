// Q4_0 and Q4_1 weights against bfloat16 activation rows (common.h ActBF16): the form `passes=2`
// takes for rows that hold bfloat16 values where the CPU has AVX-512 BF16 (matmul.h kernel_for).
// The rows' own values enter the products (ActQ16 would round each to 16 bits of its block's
// range), and the weights' integers (Q4_0's q - 8, Q4_1's q) are exact in bfloat16. (The K-quants
// keep their 16-bit activation blocks: their wide kernels were as fast from 16 rows and faster for
// one to four, whose arithmetic a bfloat16 form would have to share.)
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
  static constexpr int run16_from = 1;
  static constexpr int rows = 16;
  template <int R>
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
      const uint8_t* base = wr + (size_t)b * sizeof(Block);
      prefetch_next<16>(wr, row_bytes, b, nb);
      const __m512i head = header16(base, row_bytes);
      const __m512 dv = fp16_lanes16<false>(head), mv = fp16_lanes16<true>(head);
      __m512i w[8];  // w[g] lane c: values 4g .. 4g + 3 of row c, as bytes
      values16<Kind>(base, row_bytes, w);
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

}  // namespace

// a row of K float32 values (each a bfloat16 value) as ActBF16 blocks: the values in pair order, and
// each block's sum by one tree (values i and i + 16 added, then those sixteen folded by halves:
// + 8, + 4, + 2, + 1), the same bits whatever vectors a variant's compiler forms it with
void OPENTGI_FN(quantize_bf16)(const float* x, int K, ActBF16* out) {
  for (int b = 0; b < K / QK; ++b) {
    const float* v = x + b * QK;
    float l[16];
    for (int i = 0; i < 16; ++i) l[i] = v[i] + v[i + 16];
    for (int w = 8; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) l[i] = l[i] + l[i + w];
    out[b].sum = l[0];
    for (int k = 0; k < 16; ++k) {
      out[b].v[2 * k] = bf16_store(v[pair_lo(k)]);
      out[b].v[2 * k + 1] = bf16_store(v[pair_lo(k) + 2]);
    }
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

}  // namespace opentgi
