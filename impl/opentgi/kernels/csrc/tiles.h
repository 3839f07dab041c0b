// The row loop every block family shares: for each weight row (or eight, where the tile has an
// eight-output form), activation rows in tiles of up to four (the weight's blocks loaded once per
// tile); Tile::run<R> computes R rows, each by the same instructions as alone. Also the small
// helpers several families share.
#pragma once
#include "common.h"

namespace opentgi {

template <class Tile, class = void>
struct HasRun8 { static constexpr bool value = false; };
template <class Tile>
struct HasRun8<Tile, decltype((void)Tile::has_run8)> { static constexpr bool value = Tile::has_run8; };

// rows m0 .. m0 + R - 1 against the one output n (Tile::run<R>)
template <class Tile, int R>
static inline void run_one(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes, int m0,
                           int n, int K, float* out, int ldo) {
  Tile::template run<R>(w + (size_t)n * row_bytes, act + m0 * act_row_bytes, act_row_bytes, K,
                        out + (size_t)m0 * ldo + n, ldo);
}

// rows m0 .. m0 + R - 1 against outputs n .. n + 7 (Tile::run8<R>: eight weight rows at once, one
// output a float lane, each lane by exactly run<R>'s arithmetic, so the same bits)
template <class Tile, int R>
static inline void run_eight(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes, int m0,
                             int n, int K, float* out, int ldo) {
  Tile::template run8<R>(w + (size_t)n * row_bytes, row_bytes, act + m0 * act_row_bytes, act_row_bytes, K,
                         out + (size_t)m0 * ldo + n, ldo);
}

// every row tile of up to four rows against one output, or (Eight) against outputs n .. n + 7
template <class Tile, bool Eight>
static inline void rows_against(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes, int M,
                                int n, int K, float* out, int ldo) {
  int m = 0;
  for (; m + 4 <= M; m += 4) {
    if constexpr (Eight) run_eight<Tile, 4>(w, row_bytes, act, act_row_bytes, m, n, K, out, ldo);
    else run_one<Tile, 4>(w, row_bytes, act, act_row_bytes, m, n, K, out, ldo);
  }
  switch (M - m) {
#define OPENTGI_REST(R)                                                               \
  case R:                                                                              \
    if constexpr (Eight) run_eight<Tile, R>(w, row_bytes, act, act_row_bytes, m, n, K, out, ldo); \
    else run_one<Tile, R>(w, row_bytes, act, act_row_bytes, m, n, K, out, ldo);        \
    break;
    OPENTGI_REST(3)
    OPENTGI_REST(2)
    OPENTGI_REST(1)
#undef OPENTGI_REST
    default: break;
  }
}

// Outputs n0 .. n1 - 1 of every row: eight outputs at a time where the tile has an eight-output
// form (Tile::run8), the rest one at a time; a weight row (or eight) is loaded once per tile of
// four activation rows and stays in L1 across the tiles.
template <class Tile>
static inline void drive(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes,
                         int M, int n0, int n1, int K, float* out, int ldo) {
  int n = n0;
  if constexpr (HasRun8<Tile>::value) {
    for (; n + 8 <= n1; n += 8) rows_against<Tile, true>(w, row_bytes, act, act_row_bytes, M, n, K, out, ldo);
  }
  for (; n < n1; ++n) rows_against<Tile, false>(w, row_bytes, act, act_row_bytes, M, n, K, out, ldo);
}

// a K-quant's 6-bit scales and mins of its 8 sub-blocks (ggml's get_scale_min_k4)
static inline void scales_mins(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
}

#ifdef OPENTGI_AVX2
// the sum of the 8 int32 lanes
static inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// the totals of eight vectors of 8 int32: lane i holds sum(s[i])
static inline __m256i reduce8(const __m256i* s) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}
#endif

}  // namespace opentgi
