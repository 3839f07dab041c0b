// The row loop every block family shares: for each weight row, activation rows in tiles of up to
// four (the weight's blocks loaded once per tile); Tile::run<R> computes R rows, each by the same
// instructions as alone.
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

}  // namespace opentgi
