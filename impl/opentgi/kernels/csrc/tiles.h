// The row loop every block family shares: for each weight row, activation rows in tiles of up to
// four (the weight's blocks loaded once per tile); Tile::run<R> computes R rows, each by the same
// instructions as alone; the last M % 4 rows take four weight rows at a time where the tile has a
// column form. Also the small helpers several families share.
#pragma once
#include "common.h"

namespace opentgi {

template <class Tile, class = void>
struct HasCols { static constexpr bool value = false; };
template <class Tile>
struct HasCols<Tile, decltype((void)Tile::has_cols)> { static constexpr bool value = Tile::has_cols; };

// rows m0 .. m0 + R - 1 (R < 4) against outputs n0 .. n1 - 1: four weight rows at a time where the
// tile has a column form (Tile::run_cols<R, 4>: the same bits as run<R>, four chains in flight)
template <class Tile, int R>
static inline void drive_rest(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes,
                              int m0, int n0, int n1, int K, float* out, int ldo) {
  int n = n0;
  if constexpr (HasCols<Tile>::value) {
    for (; n + 4 <= n1; n += 4)
      Tile::template run_cols<R, 4>(w + (size_t)n * row_bytes, row_bytes, act + m0 * act_row_bytes, act_row_bytes, K,
                                    out + (size_t)m0 * ldo + n, ldo);
  }
  for (; n < n1; ++n)
    Tile::template run<R>(w + (size_t)n * row_bytes, act + m0 * act_row_bytes, act_row_bytes, K,
                          out + (size_t)m0 * ldo + n, ldo);
}

template <class Tile>
static inline void drive(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes,
                         int M, int n0, int n1, int K, float* out, int ldo) {
  const int full = M / 4 * 4;
  if (full) {
    for (int n = n0; n < n1; ++n) {
      const uint8_t* wr = w + (size_t)n * row_bytes;
      for (int m = 0; m < full; m += 4)
        Tile::template run<4>(wr, act + m * act_row_bytes, act_row_bytes, K, out + (size_t)m * ldo + n, ldo);
    }
  }
  switch (M - full) {
    case 3: drive_rest<Tile, 3>(w, row_bytes, act, act_row_bytes, full, n0, n1, K, out, ldo); break;
    case 2: drive_rest<Tile, 2>(w, row_bytes, act, act_row_bytes, full, n0, n1, K, out, ldo); break;
    case 1: drive_rest<Tile, 1>(w, row_bytes, act, act_row_bytes, full, n0, n1, K, out, ldo); break;
    default: break;
  }
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
