// Weights repacked by sixteen rows (types *_R16: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS, Q4_K and
// Q6_K): the same bytes as sixteen rows of the file's blocks, each 4-byte word moved so that the
// kernels' sixteen-output forms (row c in lane c) load their vectors whole instead of transposing
// sixteen rows' bytes a block. Rows 16g .. 16g + 15 of a weight (nb blocks a row) take the group's
// 16 * row_bytes bytes, the same place as in the file.
//
// Blocks of a whole number of words (Q4_1 20 bytes, Q5_1 24, IQ4_XS 136, Q4_K 144): block b's
// vectors of 64 bytes at b * 16 * block bytes, vector v's lane c (4 bytes) row 16g + c's word v
// (r16_words): a row's byte offset o within its block lies at 16 * o in the group, so the kernels
// read it with their offsets scaled by 16 (tiles.h words16, header16).
//
// Blocks led by a float16 d that breaks the words (2 + 4k bytes: Q4_0 and IQ4_NL 18, Q5_0 22, Q8_0
// 34): block b's 16 * block bytes at b * 16 * block bytes, the sixteen rows' d first (row c's at
// 2 * c), then the rest's k words as vectors (vector v's lane c at 32 + 64 * v: row c's bytes
// 2 + 4v .. 5 + 4v, so again at 16 * o, o their offset; tiles.h d16).
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

// sixteen rows of nb blocks of block_bytes (a multiple of 4; row_bytes apart) into a group, or (Back)
// the group into the rows: word v of row c's block b at group + b * 16 * block_bytes + 64 * v + 4 * c
template <bool Back>
static inline void r16_words(uint8_t* rows, size_t row_bytes, int nb, size_t block_bytes, uint8_t* group) {
  for (int c = 0; c < 16; ++c)
    for (int b = 0; b < nb; ++b) {
      uint8_t* block = rows + c * row_bytes + (size_t)b * block_bytes;
      uint8_t* vecs = group + (size_t)b * 16 * block_bytes + 4 * c;
      for (size_t v = 0; v < block_bytes / 4; ++v) {
        if constexpr (Back) std::memcpy(block + 4 * v, vecs + 64 * v, 4);
        else std::memcpy(vecs + 64 * v, block + 4 * v, 4);
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

// sixteen rows of nb blocks of block_bytes (2 + 4k: a float16 d, then k words; row_bytes apart) into
// a group, or (Back) the group into the rows
template <bool Back>
static inline void d_first_r16_group(uint8_t* rows, size_t row_bytes, int nb, size_t block_bytes, uint8_t* group) {
  for (int c = 0; c < 16; ++c)
    for (int b = 0; b < nb; ++b) {
      uint8_t* block = rows + c * row_bytes + (size_t)b * block_bytes;
      uint8_t* vecs = group + (size_t)b * 16 * block_bytes;
      if constexpr (Back) std::memcpy(block, vecs + 2 * c, 2);
      else std::memcpy(vecs + 2 * c, block, 2);
      for (size_t v = 0; v < (block_bytes - 2) / 4; ++v) {
        if constexpr (Back) std::memcpy(block + 2 + 4 * v, vecs + 32 + 64 * v + 4 * c, 4);
        else std::memcpy(vecs + 32 + 64 * v + 4 * c, block + 2 + 4 * v, 4);
      }
    }
}

// sixteen rows of nb blocks of block_bytes into their group, or (Back) the group into the rows, in
// the layout of the blocks' type: Q6_K's (210-byte blocks), d first (2 + 4k bytes) or whole words
template <bool Back>
static inline void r16_group(uint8_t* rows, size_t row_bytes, int nb, size_t block_bytes, uint8_t* group) {
  if (block_bytes == sizeof(BlockQ6_K)) q6k_r16_group<Back>(rows, row_bytes, nb, group);
  else if (block_bytes % 4 == 2) d_first_r16_group<Back>(rows, row_bytes, nb, block_bytes, group);
  else r16_words<Back>(rows, row_bytes, nb, block_bytes, group);
}

}  // namespace opentgi
