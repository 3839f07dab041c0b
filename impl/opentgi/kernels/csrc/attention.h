// Paged decode attention: one query token (all its heads) per row, keys and values read in place
// from the paged KV cache through the row's block table.
//
// Invariant: a work item is one row's kv heads h0 .. h0 + kv_heads_per_item - 1; each kv head's
// query heads are computed against its visible keys (positions lo .. ctx - 1, lo = ctx - window with a window, else 0), met a tile of cache blocks
// (tile_keys) at a time in position order, with a float32 online softmax (running max, running sum, output
// rescaled when the max grows), the kv heads of an item one after the other within each tile (so a
// tile's cache lines are read once for all of them); a row's visible blocks are cut in splits of
// SPLIT_KEYS keys from its first visible block, each split attended on its own (so one long row
// keeps every thread busy) and the splits' results combined in split order. A head's bits depend only on the row's query, its keys and values, the
// block size, scale, window and soft-cap: never on the other rows, their padding, or which thread runs
// it. Each ISA variant has its own bits (its own exp and dot products).
#pragma once
#include <cstdint>

namespace opentgi {

enum KvDtype { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

struct PagedAttention {
  const float* q;             // float32 [rows][num_heads][head_dim], contiguous
  const void* k_cache;        // [num_blocks][block_size][num_kv_heads][head_dim] of kv_dtype
  const void* v_cache;
  int kv_dtype;
  const int32_t* block_tables;  // [num_seqs][table_stride]
  int64_t table_stride;
  const int32_t* seq;  // [rows]: the row's block table
  const int32_t* ctx;  // [rows]: its keys are positions < ctx (1 <= ctx <= table's blocks * block_size)
  int num_heads, num_kv_heads, head_dim, block_size;
  int window;     // > 0: keys at positions > ctx - 1 - window only
  float scale;    // logits are q.k * scale
  float softcap;  // > 0: logits become softcap * tanh(logit / softcap)
  float* out;     // float32 [rows][num_heads][head_dim]
  int kv_heads_per_item;  // divides num_kv_heads: 1, or all of them (which does not change a bit)
  // Work units: a row's visible blocks in splits of split_blocks blocks (the row's first visible
  // block onwards), unit u = split unit_split[u] of row unit_row[u], the row having unit_parts[u]
  // splits. A row of one split writes `out`; a row of several writes each split's unnormalised
  // accumulators, running max and sum to partial[item][head][head_dim + 2], and
  // combine_splits adds them in split order.
  int split_blocks;
  const int32_t* unit_row;
  const int32_t* unit_split;
  const int32_t* unit_parts;
  float* partial;
};

// Work items item0 .. item1 - 1 (item = unit * (num_kv_heads / kv_heads_per_item) + chunk of kv
// heads); scratch holds
// paged_attention_scratch(args) floats for the calling thread.
void paged_attention_scalar(const PagedAttention& a, int64_t item0, int64_t item1, float* scratch);
void paged_attention_avx2(const PagedAttention& a, int64_t item0, int64_t item1, float* scratch);
void paged_attention_avx512(const PagedAttention& a, int64_t item0, int64_t item1, float* scratch);

// The keys a row splits into: a split's bits depend on the row alone (its context and window), never
// on the other rows or the threads.
constexpr int SPLIT_KEYS = 512;

inline int split_blocks_for(int block_size) { return block_size >= SPLIT_KEYS ? 1 : SPLIT_KEYS / block_size; }

// The keys of one softmax update: whole blocks, 64 keys where blocks are smaller, else one block.
inline int tile_keys(int block_size) { return block_size >= 64 ? block_size : 64 / block_size * block_size; }

inline int64_t paged_attention_scratch(const PagedAttention& a) {
  const int64_t group = a.num_heads / a.num_kv_heads, heads = group * a.kv_heads_per_item;
  const int64_t keys = tile_keys(a.block_size);
  // logits [group][tile rounded to 8], accumulators [heads][head_dim], max and sum [heads] (keys
  // and values are read in place, 16-bit caches converted as they are used)
  return group * ((keys + 7) / 8 * 8) + heads * a.head_dim + 2 * heads + 16;
}

// Prompt attention (prompt_attention.cpp): the prompt tokens' own form. A tile is up to
// PROMPT_TILE_ROWS consecutive rows of one sequence at consecutive contexts; a work item is a tile's
// kv head. Keys are met in units of PROMPT_UNIT positions (unit u: positions u * PROMPT_UNIT ..),
// in position order, with a float32 online softmax per unit; a logit is one chain of multiply-adds
// over the head dimension in order, a value sum one chain over the unit's keys in order. A row's
// bits depend only on its query, its keys and values, the scale, window and soft-cap: not on the
// tile it shares a unit's keys with, the block size or table, or the thread; so a prompt token gets
// the same numbers however the prompt was split into steps (chunks, a cached prefix). They are not
// the decode form's bits (the kernels above).
constexpr int PROMPT_UNIT = 64;
constexpr int PROMPT_TILE_ROWS = 16;

// Work items item0 .. item1 - 1 (item = tile * num_kv_heads + kv head; tile t is rows tiles[2t] ..
// tiles[2t] + tiles[2t + 1] - 1); scratch holds prompt_attention_scratch(args) floats.
void prompt_attention_scalar(const PagedAttention& a, const int32_t* tiles, int64_t item0, int64_t item1,
                             float* scratch);
void prompt_attention_avx2(const PagedAttention& a, const int32_t* tiles, int64_t item0, int64_t item1,
                           float* scratch);

inline int64_t prompt_attention_scratch(const PagedAttention& a) {
  const int64_t queries = (int64_t)PROMPT_TILE_ROWS * (a.num_heads / a.num_kv_heads);
  // a unit's keys twice (transposed; as float32), a zero row, logits [queries][unit + 8],
  // accumulators [queries][head_dim], max and sum [queries]
  return (2 * (int64_t)PROMPT_UNIT + 1) * a.head_dim + queries * (PROMPT_UNIT + 8 + a.head_dim + 2) + 16;
}

}  // namespace opentgi
