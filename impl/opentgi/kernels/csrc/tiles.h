// The row loop every block family shares: for each weight row, activation rows in tiles of up to
// four (the weight's blocks loaded once per tile); Tile::run<R> computes R rows, each by the same
// instructions as alone. Also the small helpers several families share.
#pragma once
#include "common.h"

namespace opentgi {

template <class Tile>
static inline void drive(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes,
                         int M, int n0, int n1, int K, float* out, int ldo) {
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + (size_t)n * row_bytes;
    int m = 0;
    for (; m + 4 <= M; m += 4) Tile::template run<4>(wr, act + m * act_row_bytes, act_row_bytes, K, out + (size_t)m * ldo + n, ldo);
    switch (M - m) {
      case 3: Tile::template run<3>(wr, act + m * act_row_bytes, act_row_bytes, K, out + (size_t)m * ldo + n, ldo); break;
      case 2: Tile::template run<2>(wr, act + m * act_row_bytes, act_row_bytes, K, out + (size_t)m * ldo + n, ldo); break;
      case 1: Tile::template run<1>(wr, act + m * act_row_bytes, act_row_bytes, K, out + (size_t)m * ldo + n, ldo); break;
      default: break;
    }
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
