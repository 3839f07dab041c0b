// Dense weights: rows of K float32, float16 or bfloat16 values (a checkpoint's tensors as they
// are, e.g. a mixture of experts' bfloat16 experts) against activation rows in the layout the
// type asks for (matmul.h: ACT_F32, ACT_F32_PAIRS, ACT_BF16).
//
// One fixed order per output, whatever the ISA, the row count, the tile or the thread: sixteen
// lane sums from zero by fused multiply-adds (one rounding each), then the lanes folded as
// hsum_ps folds them (lane j + lane j + 8, then + 4, + 2, + 1). Weights widen to float32 exactly.
// - F32, F16 (K % 16 == 0): lane j adds w[k] * x[k] for k = j, j + 16, ...
// - BF16 (K % 32 == 0): per 32 values, lane j adds the odd product w[2j+1] * x[2j+1], then the even
//   one w[2j] * x[2j]: the order of AVX-512 BF16's VDPBF16PS, which forms a bfloat16 row's products
//   in one instruction where the CPU has it (`matmul_bf16_dp`, activations as bfloat16), and two
//   fused multiply-adds elsewhere (activations as float32, evens and odds apart: ACT_F32_PAIRS).
//   The two agree bit for bit except where a value or partial sum falls below float32's normal
//   range (~1.2e-38), which the instruction flushes to zero; a server runs one of them throughout.
#include <cmath>
#include <type_traits>

#include "common.h"

namespace opentgi {
namespace {

enum Form { W_F32, W_F16, W_BF16, W_BF16_DP };  // W_BF16_DP: BF16 weights by VDPBF16PS (tile_dp)
constexpr int CHUNK[] = {16, 16, 32};      // values an accumulation step takes
constexpr int ELEM_BYTES[] = {4, 2, 2};

#if defined(OPENTGI_AVX512)
struct Lanes {
  __m512 v;
};
static inline Lanes lanes_zero() { return {_mm512_setzero_ps()}; }
static inline Lanes loadu(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void fma_into(Lanes& acc, const Lanes& w, const Lanes& x) { acc.v = _mm512_fmadd_ps(w.v, x.v, acc.v); }
static inline float fold(const Lanes& a) {
  return hsum_ps(_mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1)));
}
// four outputs' folds at once (out[0..3]), each pair of lanes added as fold() adds it: the lanes of
// a and b as halves of one register, of the four as quarters, then within each quarter
static inline void fold4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));  // j + j+8
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));  // + 4
  const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));  // + 2
  const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));  // + 1
  const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(first, v)));
}
static inline Lanes widen16(const uint8_t* p, int form) {  // 16 F16 / BF16 values
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);
  if (form == W_F16) return {_mm512_cvtph_ps(h)};
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
static inline void bf16_pairs(const uint8_t* p, Lanes* even, Lanes* odd) {  // 32 BF16 values, lane j: 2j, 2j+1
  const __m512i v = _mm512_loadu_si512(p);
  even->v = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd->v = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
// tiles (rows x outputs) per form, as many sums as keep the multiply-adds busy without spilling
struct Tiles {
  int rows, outs, wide_rows, wide_outs;
};
constexpr Tiles tiles_for(int) { return {4, 4, 2, 8}; }
#elif defined(OPENTGI_AVX2)
struct Lanes {
  __m256 lo, hi;
};
static inline Lanes lanes_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline Lanes loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void fma_into(Lanes& acc, const Lanes& w, const Lanes& x) {
  acc.lo = _mm256_fmadd_ps(w.lo, x.lo, acc.lo);
  acc.hi = _mm256_fmadd_ps(w.hi, x.hi, acc.hi);
}
static inline float fold(const Lanes& a) { return hsum_ps(_mm256_add_ps(a.lo, a.hi)); }
static inline Lanes widen16(const uint8_t* p, int form) {
  const __m128i a = _mm_loadu_si128((const __m128i*)p), b = _mm_loadu_si128((const __m128i*)p + 1);
  if (form == W_F16) return {_mm256_cvtph_ps(a), _mm256_cvtph_ps(b)};
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16))};
}
static inline void bf16_pairs(const uint8_t* p, Lanes* even, Lanes* odd) {
  const __m256i a = _mm256_loadu_si256((const __m256i*)p), b = _mm256_loadu_si256((const __m256i*)p + 1);
  const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
  *even = {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
  *odd = {_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_castsi256_ps(_mm256_and_si256(b, high))};
}
// sixteen lanes are two registers: F32 / F16 weights 2 x 2 sums (8 registers), BF16's even and odd
// halves take twice the weight registers, so 4 x 1
struct Tiles {
  int rows, outs, wide_rows, wide_outs;
};
constexpr Tiles tiles_for(int form) { return form == W_BF16 ? Tiles{4, 1, 1, 2} : Tiles{2, 2, 1, 4}; }
#else
struct Lanes {
  float v[16];
};
static inline Lanes lanes_zero() { return Lanes{}; }
static inline Lanes loadu(const float* p) {
  Lanes x;
  std::memcpy(x.v, p, sizeof(x.v));
  return x;
}
static inline void fma_into(Lanes& acc, const Lanes& w, const Lanes& x) {
  for (int j = 0; j < 16; ++j) acc.v[j] = std::fma(w.v[j], x.v[j], acc.v[j]);
}
static inline float fold(const Lanes& a) {
  float b[8], c[4];
  for (int j = 0; j < 8; ++j) b[j] = a.v[j] + a.v[j + 8];
  for (int j = 0; j < 4; ++j) c[j] = b[j] + b[j + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}
static inline uint16_t half_at(const uint8_t* p, int i) {
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return h;
}
static inline Lanes widen16(const uint8_t* p, int form) {
  Lanes w;
  for (int j = 0; j < 16; ++j) w.v[j] = form == W_F16 ? fp16_to_fp32(half_at(p, j)) : bf16_to_fp32(half_at(p, j));
  return w;
}
static inline void bf16_pairs(const uint8_t* p, Lanes* even, Lanes* odd) {
  for (int j = 0; j < 16; ++j) {
    even->v[j] = bf16_to_fp32(half_at(p, 2 * j));
    odd->v[j] = bf16_to_fp32(half_at(p, 2 * j + 1));
  }
}
struct Tiles {
  int rows, outs, wide_rows, wide_outs;
};
constexpr Tiles tiles_for(int) { return {1, 1, 0, 1}; }
#endif

// A chunk of one weight row, widened once for every row of the tile
template <int F>
struct Weights {
  Lanes a, b;  // F32 / F16: a; BF16: a the evens, b the odds
  void load(const uint8_t* p) {
    if constexpr (F == W_F32) a = loadu((const float*)p);
    else if constexpr (F == W_F16) a = widen16(p, W_F16);
    else bf16_pairs(p, &a, &b);
  }
  // acc += this chunk by the activations' chunk x (BF16: ACT_F32_PAIRS, evens then odds)
  void into(Lanes& acc, const float* x) const {
    if constexpr (F == W_BF16) {
      fma_into(acc, b, loadu(x + 16));
      fma_into(acc, a, loadu(x));
    } else {
      fma_into(acc, a, loadu(x));
    }
  }
};

// the next strip's cache line at this offset of each of a tile's C weight rows: the weights stream from
// memory when few rows share them, and a strip's rows are short (an expert's 64 outputs a work item)
static inline void prefetch_strip(const uint8_t* w, size_t rb, int C, size_t at) {
#ifdef OPENTGI_AVX2
  for (int c = 0; c < C; ++c) _mm_prefetch((const char*)(w + (C + c) * rb + at), _MM_HINT_T0);
#else
  (void)w, (void)rb, (void)C, (void)at;
#endif
}

// out[r * ldo + c] for R rows of x (xs floats apart) and C weight rows (rb bytes apart)
template <int F, int R, int C, bool Ahead>
void tile_fma(const uint8_t* w, size_t rb, const float* x, size_t xs, int K, float* out, int ldo) {
  Lanes acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = lanes_zero();
  for (int k = 0; k < K; k += CHUNK[F]) {
    Weights<F> wv[C];
    for (int c = 0; c < C; ++c) wv[c].load(w + c * rb + (size_t)k * ELEM_BYTES[F]);
    if (Ahead) prefetch_strip(w, rb, C, (size_t)k * ELEM_BYTES[F]);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) wv[c].into(acc[r][c], x + r * xs + k);
  }
  for (int r = 0; r < R; ++r) {
    int c = 0;
#if defined(OPENTGI_AVX512)
    for (; c + 4 <= C; c += 4) fold4(acc[r][c].v, acc[r][c + 1].v, acc[r][c + 2].v, acc[r][c + 3].v, out + r * ldo + c);
#endif
    for (; c < C; ++c) out[r * ldo + c] = fold(acc[r][c]);
  }
}

// Outputs [n0, n1) for rows [0, M), strip by strip of C outputs (the form's wide_outs where the
// rows are at most wide_rows: enough independent sums to keep the multiply-adds busy; else its
// outs; the outputs left one at a time), each strip's rows in tiles of its rows and one of the rest.
// `run.template tile<R, C, Ahead>(m, n)`: rows m.., outputs n..; Ahead for a strip's first tile
// (of several rows: measured 1.4-1.6x for the grouped experts' 16-64 rows from memory).
template <typename Run>
void drive(const Run& run, int M, int n0, int n1) {
  constexpr Tiles t = tiles_for(Run::form);
  constexpr int TILE_ROWS = t.rows, TILE_OUTS = t.outs, WIDE_ROWS = t.wide_rows, WIDE_OUTS = t.wide_outs;
  auto strip = [&](auto c_tag, int n) {
    constexpr int C = decltype(c_tag)::value;
    int m = 0;
    for (; m + TILE_ROWS <= M; m += TILE_ROWS) {
      if (m == 0) run.template tile<TILE_ROWS, C, true>(m, n);
      else run.template tile<TILE_ROWS, C, false>(m, n);
    }
    const bool first = m == 0 && M > 1;  // a lone row streams its weights: the hardware's prefetch keeps up
    switch (M - m) {
      case 1:
        if (first) run.template tile<1, C, true>(m, n); else run.template tile<1, C, false>(m, n);
        break;
      case 2:
        if constexpr (TILE_ROWS > 2) {
          if (first) run.template tile<2, C, true>(m, n); else run.template tile<2, C, false>(m, n);
        }
        break;
      case 3:
        if constexpr (TILE_ROWS > 3) {
          if (first) run.template tile<3, C, true>(m, n); else run.template tile<3, C, false>(m, n);
        }
        break;
      default: break;
    }
  };
  int n = n0;
  if (M <= WIDE_ROWS)
    for (; n + WIDE_OUTS <= n1; n += WIDE_OUTS) strip(std::integral_constant<int, WIDE_OUTS>{}, n);
  for (; n + TILE_OUTS <= n1; n += TILE_OUTS) strip(std::integral_constant<int, TILE_OUTS>{}, n);
  for (; n < n1; ++n) strip(std::integral_constant<int, 1>{}, n);
}

#if defined(OPENTGI_AVX512)
// BF16 rows by bfloat16 activations (ACT_BF16), VDPBF16PS: per 32 values, each lane's odd then even
// product, as matmul_dense<W_BF16> orders them.
template <int R, int C, bool Ahead>
__attribute__((target("avx512bf16"))) void tile_dp(const uint8_t* w, size_t rb, const uint16_t* x, size_t xs, int K,
                                                   float* out, int ldo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int k = 0; k < K; k += 32) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * rb + (size_t)k * 2);
    if (Ahead) prefetch_strip(w, rb, C, (size_t)k * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * xs + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
    }
  }
  for (int r = 0; r < R; ++r) {
    int c = 0;
    for (; c + 4 <= C; c += 4) fold4(acc[r][c], acc[r][c + 1], acc[r][c + 2], acc[r][c + 3], out + r * ldo + c);
    for (; c < C; ++c) out[r * ldo + c] = fold({acc[r][c]});
  }
}

#endif

// One call's tiles for `drive`: rows m.. by outputs n.. in form F (x: F's activation layout)
template <int F, typename X>
struct Run {
  static constexpr int form = F == W_BF16_DP ? W_BF16 : F;
  const uint8_t* w;
  size_t rb;
  const X* x;
  size_t xs;
  int K;
  float* out;
  int ldo;
  template <int R, int C, bool Ahead>
  void tile(int m, int n) const {
#if defined(OPENTGI_AVX512)
    if constexpr (F == W_BF16_DP) {
      tile_dp<R, C, Ahead>(w + n * rb, rb, x + m * xs, xs, K, out + (size_t)m * ldo + n, ldo);
      return;
    } else
#endif
    {
      tile_fma<F, R, C, Ahead>(w + n * rb, rb, x + m * xs, xs, K, out + (size_t)m * ldo + n, ldo);
    }
  }
};

template <int F>
void matmul_dense(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1, int K,
                  float* out, int ldo) {
  drive(Run<F, float>{w, rb, (const float*)act, arb / sizeof(float), K, out, ldo}, M, n0, n1);
}

#if defined(OPENTGI_AVX512)
__attribute__((target("avx512bf16"))) void matmul_dp(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb,
                                                     int M, int n0, int n1, int K, float* out, int ldo) {
  drive(Run<W_BF16_DP, uint16_t>{w, rb, (const uint16_t*)act, arb / sizeof(uint16_t), K, out, ldo}, M, n0, n1);
}
#endif

}  // namespace

void OPENTGI_FN(matmul_f32)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                            int K, float* out, int ldo) {
  matmul_dense<W_F32>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_f16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                            int K, float* out, int ldo) {
  matmul_dense<W_F16>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_bf16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  matmul_dense<W_BF16>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

#if defined(OPENTGI_AVX512)
// the BF16 instruction's form where this CPU has it, else nullptr (matmul.h falls back to the FMAs')
MatmulFn matmul_bf16_dp_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") ? matmul_dp : nullptr;
}
#endif

}  // namespace opentgi
