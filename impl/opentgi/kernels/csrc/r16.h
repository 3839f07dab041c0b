// Weights repacked by sixteen rows (types *_R16: every block type the kernels take: Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS): the same bytes as sixteen rows of the
// file's blocks, moved so that the kernels' sixteen-output forms (row c in lane c) load their vectors
// whole instead of transposing sixteen rows' bytes a block. Rows 16g .. 16g + 15 of a weight (nb
// blocks a row) take the group's 16 * row_bytes bytes, the same place as in the file.
//
// Every type but Q6_K: each block's bytes are 4-byte words and, where the block has 2 + 4k bytes,
// one 2-byte float16 d that breaks them (Q4_0, Q5_0, Q8_0, IQ4_NL: the first two bytes; Q3_K, 110
// bytes: the last two). The field at offset o of a block, w bytes wide, lies for row c of the group
// at b * 16 * block bytes + 16 * o + w * c: sixteen rows' words as one vector of 64 bytes, their d
// side by side in 32 (r16_group; tiles.h words16, header16 and d16 read them with the offsets the
// file layout has, scaled by 16).
//
// Q6_K_R16 (blocks of 210 bytes, whose float16 d breaks the words): for each superblock b, 52 vectors
// of 64 bytes at b * 3328, lane c of each (4 bytes) row 16g + c's word:
//   vectors 0..3: scales 4m .. 4m + 3 (m = 0..3);
//   then for (h, v) = (0, 0), (0, 1), (1, 0), (1, 1), at 4 + 12 * (2h + v): ql bytes 64h + 16v + 4i
//   (i = 0..3), ql bytes 64h + 32 + 16v + 4i, qh bytes 32h + 16v + 4i (q6k_r16_source);
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

// The offset of the float16 d that breaks a block's words, by the block's bytes (Q3_K's 110: its
// last two bytes; 2 + 4k otherwise: its first two), or -1 where the block is whole words
constexpr long r16_d_at(size_t block_bytes) {
  return block_bytes == 110 ? 108 : block_bytes % 4 == 2 ? 0 : -1;
}

// sixteen rows of nb blocks of block_bytes (row_bytes apart) into a group, or (Back) the group into the
// rows, field by field (the header above)
template <bool Back>
static inline void r16_fields(uint8_t* rows, size_t row_bytes, int nb, size_t block_bytes, uint8_t* group) {
  const long d_at = r16_d_at(block_bytes);
  for (int c = 0; c < 16; ++c)
    for (int b = 0; b < nb; ++b) {
      uint8_t* block = rows + c * row_bytes + (size_t)b * block_bytes;
      uint8_t* fields = group + (size_t)b * 16 * block_bytes;
      for (size_t o = 0; o < block_bytes;) {
        const size_t w = (long)o == d_at ? 2 : 4;
        if constexpr (Back) std::memcpy(block + o, fields + 16 * o + w * c, w);
        else std::memcpy(fields + 16 * o + w * c, block + o, w);
        o += w;
      }
    }
}

// sixteen rows of nb Q6_K superblocks (row_bytes apart) into a group, or (Back) the group into the rows
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

// sixteen rows of nb blocks of block_bytes into their group, or (Back) the group into the rows, in
// the layout of the blocks' type: Q6_K's (210-byte blocks) or field by field
template <bool Back>
static inline void r16_group(uint8_t* rows, size_t row_bytes, int nb, size_t block_bytes, uint8_t* group) {
  if (block_bytes == sizeof(BlockQ6_K)) q6k_r16_group<Back>(rows, row_bytes, nb, group);
  else r16_fields<Back>(rows, row_bytes, nb, block_bytes, group);
}

}  // namespace opentgi
