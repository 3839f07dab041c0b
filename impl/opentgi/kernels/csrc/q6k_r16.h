// Q6_K repacked by sixteen rows (type Q6_K_R16): the same bytes as sixteen rows of the file's Q6_K
// blocks, each 4-byte word moved so that the kernel's sixteen-row form (blocks_bf16.cpp TileQ6KR16)
// reads its vectors whole instead of transposing sixteen rows' bytes a superblock. Rows 16g .. 16g + 15
// of a weight (K / 256 superblocks a row) take the group's 16 * row_bytes bytes: for each superblock
// b, 52 vectors of 64 bytes at b * 3328, lane c of each (4 bytes) row 16g + c's word:
//   vectors 0..3: scales 4m .. 4m + 3 (m = 0..3);
//   then for (h, v) = (0, 0), (0, 1), (1, 0), (1, 1), at 4 + 12 * (2h + v): ql bytes 64h + 16v + 4i
//   (i = 0..3), ql bytes 64h + 32 + 16v + 4i, qh bytes 32h + 16v + 4i;
// then, after every superblock's vectors, each superblock's sixteen float16 d (32 bytes).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace opentgi {

constexpr size_t Q6K_R16_VECTORS = 52, Q6K_R16_SUPER = 64 * Q6K_R16_VECTORS;  // 3,328 bytes a superblock

// where each vector's words come from in a BlockQ6_K: vector v, lane c <- bytes at q6k_r16_source(v)
constexpr int q6k_r16_source(int v) {
  if (v < 4) return 192 + 4 * v;  // offsetof(BlockQ6_K, scales)
  const int hv = (v - 4) / 12, kind = (v - 4) % 12 / 4, i = (v - 4) % 4, h = hv / 2, u = hv % 2;
  return kind == 0 ? 64 * h + 16 * u + 4 * i : kind == 1 ? 64 * h + 32 + 16 * u + 4 * i : 128 + 32 * h + 16 * u + 4 * i;
}

// sixteen rows of nb superblocks (row_bytes apart) into a group, or (Back) the group into the rows
template <bool Back>
static inline void q6k_r16_group(uint8_t* rows, size_t row_bytes, int nb, uint8_t* group) {
  for (int c = 0; c < 16; ++c)
    for (int b = 0; b < nb; ++b) {
      uint8_t* block = rows + c * row_bytes + (size_t)b * sizeof(BlockQ6_K);
      uint8_t* vecs = group + (size_t)b * Q6K_R16_SUPER;
      for (int v = 0; v < (int)Q6K_R16_VECTORS; ++v) {
        if constexpr (Back) std::memcpy(block + q6k_r16_source(v), vecs + 64 * v + 4 * c, 4);
        else std::memcpy(vecs + 64 * v + 4 * c, block + q6k_r16_source(v), 4);
      }
      uint8_t* d = group + (size_t)nb * Q6K_R16_SUPER + 32 * b + 2 * c;
      if constexpr (Back) std::memcpy(block + offsetof(BlockQ6_K, d), d, 2);
      else std::memcpy(d, block + offsetof(BlockQ6_K, d), 2);
    }
}

}  // namespace opentgi
