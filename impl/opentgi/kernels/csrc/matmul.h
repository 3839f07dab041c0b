// The matmul plumbing the torch-op sources share (ops.cpp, moe_ops.cpp): each block family's
// kernels per instruction set, picking one for a GGML type, quantizing activation rows (in one or
// two passes) and running a weight of GGUF blocks over them, outputs split among torch's intra-op
// threads, each output computed whole by one thread (common.h's invariant).
//
// `passes=2` asks for ~16-bit activations: 16-bit activation blocks (common.h ActQ16 / ActQ16K)
// against the type's wide kernel where it has one (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), else two 8-bit passes
// (quantize_rows).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "common.h"
#include "op_helpers.h"

namespace opentgi {

#define OPENTGI_DECLARE(isa)                                                                         \
  void quantize_q8_##isa(const float*, int, ActQ8*);                                                 \
  void quantize_q8k_##isa(const float*, int, ActQ8K*);                                               \
  void quantize_q16_##isa(const float*, int, ActQ16*);                                               \
  void quantize_q16k_##isa(const float*, int, ActQ16K*);                                             \
  void quantize_bf16_##isa(const float*, int, ActBF16*);                                             \
  void matmul_q4_0_bf16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_1_bf16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q6_k_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_k_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void repack_words16_##isa(const uint8_t*, size_t, int, size_t, uint8_t*); \
  void repack_q6_k16_##isa(const uint8_t*, size_t, int, uint8_t*); \
  void matmul_q4_1_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_0_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_0_bf16_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_0_wide_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_1_wide_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q8_0_wide_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q5_k_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q2_k_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q3_k_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q5_0_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q5_1_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_iq4_nl_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_iq4_xs_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_1_bf16_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q8_0_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_k_wide_r16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_0_wide_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_1_wide_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q8_0_wide_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_k_wide_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q6_k_wide_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_0_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_1_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q8_0_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q4_k_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q6_k_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q5_0_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q5_1_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q5_k_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q2_k_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_q3_k_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_iq4_nl_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_iq4_xs_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_f32_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_f16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int); \
  void matmul_bf16_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);

OPENTGI_DECLARE(scalar)
#ifdef OPENTGI_WITH_AVX2
OPENTGI_DECLARE(avx2)
#endif
#ifdef OPENTGI_WITH_AVXVNNI
OPENTGI_DECLARE(avxvnni)
#endif
#ifdef OPENTGI_WITH_AVX512
OPENTGI_DECLARE(avx512)
MatmulFn matmul_bf16_dp_avx512();  // dense.cpp: nullptr where the CPU lacks AVX-512 BF16
#endif

namespace {

// ids the ops take (kernels/native.py ISAS); AVX-VNNI's is the newest, not a rank: `isa >= AVX2`
// holds for every x86-64 variant (prompt attention runs AVX2's code on all of them, the row ops on
// all but AVX-512)
enum Isa { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVXVNNI = 3 };

// activation layouts: common.h's blocks; for dense weights (dense.cpp) the row's float32 values
// (ACT_F32), the same with each 32 values' evens and then odds (ACT_F32_PAIRS), or as bfloat16
// (ACT_BF16); for Q4_0 / Q4_1 by bfloat16 rows, common.h ActBF16 (ACT_BF16_BLOCKS)
enum Act { ACT_Q8 = 0, ACT_Q8K = 1, ACT_Q16 = 2, ACT_Q16K = 3, ACT_F32 = 4, ACT_F32_PAIRS = 5, ACT_BF16 = 6,
           ACT_BF16_BLOCKS = 7 };

struct Kernel {
  MatmulFn matmul;
  bool superblocks;  // K-quant: ActQ8K activations (ActQ16K when wide)
  int block_values, block_bytes;
  int act = ACT_Q8;  // the activations' layout
  int passes = 1;    // activation rows an input row: 2 for two 8-bit passes
  int unit = 8;      // outputs a thread takes at a time (repacked weights: their groups of sixteen)
};

// a row of K values in activation layout `act`, in bytes
static inline size_t act_bytes(int act, int64_t K) {
  switch (act) {
    case ACT_Q8K: return K / QK_K * sizeof(ActQ8K);
    case ACT_Q16: return K / QK * sizeof(ActQ16);
    case ACT_Q16K: return K / QK_K * (sizeof(ActQ16K) + sizeof(ActQ16KBytes));
    case ACT_F32: case ACT_F32_PAIRS: return K * sizeof(float);
    case ACT_BF16: return K * sizeof(uint16_t);
    case ACT_BF16_BLOCKS: return K / QK * sizeof(ActBF16);
    default: return K / QK * sizeof(ActQ8);
  }
}

// Whether this CPU has AVX-512 BF16's dot products (and the library its AVX-512 variant): where it
// does, `passes=2` on Q4_0 and Q4_1 by bfloat16 rows takes their bfloat16 kernels (blocks_bf16.cpp)
// on every ISA, one order of operations, instead of 16-bit activation blocks; so does Q6_K repacked
// (Q6_K_R16), the only form that layout has.
static inline bool bf16_dots() {
#ifdef OPENTGI_WITH_AVX512
  static const bool has = matmul_bf16_dp_avx512() != nullptr;
  return has;
#else
  return false;
#endif
}

// The kernel for a GGML type on an ISA; `passes` 2 asks for ~16-bit activations: the wide kernel
// (one pass of ActQ16 / ActQ16K) where the type has one, else two 8-bit passes. Dense types (F32,
// F16, BF16: dense.cpp) take the rows' values as they are, in one pass whatever `passes` asks;
// BF16 weights by rows that hold bfloat16 values (`bf16_rows`) take AVX-512 BF16's dot products
// where the CPU has them: the same bits as the FMAs' form (dense.cpp).
bool kernel_for(int64_t qtype, int64_t isa, Kernel* k, int64_t passes = 1, bool bf16_rows = false) {
#define OPENTGI_PICK(fn) \
  (isa == AVX512 ? AVX512_OR_NULL(fn) : isa == AVXVNNI ? AVXVNNI_OR_NULL(fn) : isa == AVX2 ? AVX2_OR_NULL(fn) : fn##_scalar)
#ifdef OPENTGI_WITH_AVX2
#define AVX2_OR_NULL(fn) fn##_avx2
#else
#define AVX2_OR_NULL(fn) nullptr
#endif
#ifdef OPENTGI_WITH_AVXVNNI
#define AVXVNNI_OR_NULL(fn) fn##_avxvnni
#else
#define AVXVNNI_OR_NULL(fn) nullptr
#endif
#ifdef OPENTGI_WITH_AVX512
#define AVX512_OR_NULL(fn) fn##_avx512
#else
#define AVX512_OR_NULL(fn) nullptr
#endif
  if (qtype == Q4_0_R16 || qtype == Q4_1_R16 || qtype == Q8_0_R16) {
    // repacked (r16.h): 8-bit rows; at passes=2 16-bit activation blocks, or (Q4_0, Q4_1) bfloat16
    // rows where the CPU has AVX-512 BF16: the forms and the precedence of the file's layout
    const bool q41 = qtype == Q4_1_R16, q80 = qtype == Q8_0_R16;
    *k = {q80 ? OPENTGI_PICK(matmul_q8_0_r16) : q41 ? OPENTGI_PICK(matmul_q4_1_r16) : OPENTGI_PICK(matmul_q4_0_r16),
          false, QK, q80 ? 34 : q41 ? 20 : 18, ACT_Q8, 1, 16};
    if (passes == 2) {
      k->matmul = q80 ? OPENTGI_PICK(matmul_q8_0_wide_r16)
                      : q41 ? OPENTGI_PICK(matmul_q4_1_wide_r16) : OPENTGI_PICK(matmul_q4_0_wide_r16);
      k->act = ACT_Q16;
      if (!q80 && bf16_rows && bf16_dots()) {
        k->matmul = q41 ? OPENTGI_PICK(matmul_q4_1_bf16_r16) : OPENTGI_PICK(matmul_q4_0_bf16_r16);
        k->act = ACT_BF16_BLOCKS;
      }
    }
    return k->matmul != nullptr;
  }
  bool plain_r16 = true;
  switch (qtype) {  // repacked (r16.h), types without a 16-bit form: their 8-bit kernels, one pass or two
    case Q5_0_R16: *k = {OPENTGI_PICK(matmul_q5_0_r16), false, QK, 22, ACT_Q8, (int)passes, 16}; break;
    case Q5_1_R16: *k = {OPENTGI_PICK(matmul_q5_1_r16), false, QK, 24, ACT_Q8, (int)passes, 16}; break;
    case IQ4_NL_R16: *k = {OPENTGI_PICK(matmul_iq4_nl_r16), false, QK, 18, ACT_Q8, (int)passes, 16}; break;
    case IQ4_XS_R16: *k = {OPENTGI_PICK(matmul_iq4_xs_r16), true, QK_K, 136, ACT_Q8K, (int)passes, 16}; break;
    case Q2_K_R16: *k = {OPENTGI_PICK(matmul_q2_k_r16), true, QK_K, 84, ACT_Q8K, (int)passes, 16}; break;
    case Q3_K_R16: *k = {OPENTGI_PICK(matmul_q3_k_r16), true, QK_K, 110, ACT_Q8K, (int)passes, 16}; break;
    case Q5_K_R16: *k = {OPENTGI_PICK(matmul_q5_k_r16), true, QK_K, 176, ACT_Q8K, (int)passes, 16}; break;
    default: plain_r16 = false;
  }
  if (plain_r16) return k->matmul != nullptr;
  if (qtype == Q4_K_R16) {  // repacked (r16.h; native.py repack_by_16_rows): Q4_K's kernels on the groups
    *k = {OPENTGI_PICK(matmul_q4_k_r16), true, QK_K, 144, ACT_Q8K, 1, 16};
    if (passes == 2) {
      k->matmul = OPENTGI_PICK(matmul_q4_k_wide_r16);
      k->act = ACT_Q16K;
    }
    return k->matmul != nullptr;
  }
  if (qtype == Q6_K_R16) {  // repacked for bfloat16 rows only (r16.h; native.py repack_by_16_rows)
    if (!bf16_dots()) return false;  // (float32 rows, never given it, would be rounded to bfloat16)
    *k = {OPENTGI_PICK(matmul_q6_k_r16), true, QK_K, 210, ACT_BF16_BLOCKS, 1, 16};
    return k->matmul != nullptr;
  }
  switch (qtype) {
    case Q4_0: *k = {OPENTGI_PICK(matmul_q4_0), false, QK, 18}; break;
    case Q4_1: *k = {OPENTGI_PICK(matmul_q4_1), false, QK, 20}; break;
    case Q8_0: *k = {OPENTGI_PICK(matmul_q8_0), false, QK, 34}; break;
    case Q4_K: *k = {OPENTGI_PICK(matmul_q4_k), true, QK_K, 144}; break;
    case Q6_K: *k = {OPENTGI_PICK(matmul_q6_k), true, QK_K, 210}; break;
    case Q5_0: *k = {OPENTGI_PICK(matmul_q5_0), false, QK, 22}; break;
    case Q5_1: *k = {OPENTGI_PICK(matmul_q5_1), false, QK, 24}; break;
    case Q5_K: *k = {OPENTGI_PICK(matmul_q5_k), true, QK_K, 176}; break;
    case Q2_K: *k = {OPENTGI_PICK(matmul_q2_k), true, QK_K, 84}; break;
    case Q3_K: *k = {OPENTGI_PICK(matmul_q3_k), true, QK_K, 110}; break;
    case IQ4_NL: *k = {OPENTGI_PICK(matmul_iq4_nl), false, QK, 18}; break;
    case IQ4_XS: *k = {OPENTGI_PICK(matmul_iq4_xs), true, QK_K, 136}; break;
    case F32: *k = {OPENTGI_PICK(matmul_f32), false, 16, 64, ACT_F32}; return k->matmul != nullptr;
    case F16: *k = {OPENTGI_PICK(matmul_f16), false, 16, 32, ACT_F32}; return k->matmul != nullptr;
    case BF16:
      *k = {OPENTGI_PICK(matmul_bf16), false, 32, 64, ACT_F32_PAIRS};
#ifdef OPENTGI_WITH_AVX512
      if (isa == AVX512 && bf16_rows && matmul_bf16_dp_avx512() != nullptr) {
        k->matmul = matmul_bf16_dp_avx512();
        k->act = ACT_BF16;
      }
#endif
      return k->matmul != nullptr;
    default: return false;
  }
  k->act = k->superblocks ? ACT_Q8K : ACT_Q8;
  k->passes = (int)passes;
  if (passes == 2) {
    MatmulFn wide = nullptr;
    switch (qtype) {
      case Q4_0: wide = OPENTGI_PICK(matmul_q4_0_wide); break;
      case Q4_1: wide = OPENTGI_PICK(matmul_q4_1_wide); break;
      case Q8_0: wide = OPENTGI_PICK(matmul_q8_0_wide); break;
      case Q4_K: wide = OPENTGI_PICK(matmul_q4_k_wide); break;
      case Q6_K: wide = OPENTGI_PICK(matmul_q6_k_wide); break;
      default: break;
    }
    if (wide != nullptr) {
      k->matmul = wide;
      k->act = k->superblocks ? ACT_Q16K : ACT_Q16;
      k->passes = 1;
    }
    MatmulFn own = nullptr;  // the rows' own values (bfloat16 rows, AVX-512 BF16): every ISA
    if (bf16_rows && bf16_dots()) {
      switch (qtype) {
        case Q4_0: own = OPENTGI_PICK(matmul_q4_0_bf16); break;
        case Q4_1: own = OPENTGI_PICK(matmul_q4_1_bf16); break;
        default: break;
      }
    }
    if (own != nullptr) {
      k->matmul = own;
      k->act = ACT_BF16_BLOCKS;
      k->passes = 1;
    }
  }
  return k->matmul != nullptr;
}

// Activation row m (row src[m] of x where src is given) into act rows m * passes .. + passes - 1
// in layout `act`: the row quantized, then (passes == 2, 8-bit layouts) what that rounding left,
// x - d * q in float32, quantized by the same code. A weight's products with the two rows, added,
// are the row's product to about 16 bits of each block's range; every block kernel is linear in
// the activation's values, so no kernel changes, and a row's bits stay its own.
void quantize_one(const float* row, int K, int act, int64_t isa, uint8_t* dst) {
  if (act == ACT_F32) {
    std::memcpy(dst, row, K * sizeof(float));
    return;
  }
  if (act == ACT_F32_PAIRS) {  // each 32 values' evens, then odds
    float* out = (float*)dst;
    for (int c = 0; c < K; c += 32)
      for (int j = 0; j < 16; ++j) {
        out[c + j] = row[c + 2 * j];
        out[c + 16 + j] = row[c + 2 * j + 1];
      }
    return;
  }
  if (act == ACT_BF16_BLOCKS) {  // the same bits from every variant (one order of adds)
#ifdef OPENTGI_WITH_AVX512
    if (isa == AVX512) return quantize_bf16_avx512(row, K, (ActBF16*)dst);
#endif
#ifdef OPENTGI_WITH_AVX2
    if (isa == AVX2 || isa == AVXVNNI) return quantize_bf16_avx2(row, K, (ActBF16*)dst);
#endif
    return quantize_bf16_scalar(row, K, (ActBF16*)dst);
  }
  if (act == ACT_BF16) {  // exact for rows that hold bfloat16 values (the only ones given this layout)
    uint16_t* out = (uint16_t*)dst;
    for (int i = 0; i < K; ++i) out[i] = bf16_store(row[i]);
    return;
  }
#ifdef OPENTGI_WITH_AVX512
  if (isa == AVX512) {
    switch (act) {
      case ACT_Q8K: quantize_q8k_avx512(row, K, (ActQ8K*)dst); return;
      case ACT_Q16: quantize_q16_avx512(row, K, (ActQ16*)dst); return;
      case ACT_Q16K: quantize_q16k_avx512(row, K, (ActQ16K*)dst); return;
      default: quantize_q8_avx512(row, K, (ActQ8*)dst); return;
    }
  }
#endif
#ifdef OPENTGI_WITH_AVX2
  if (isa == AVX2 || isa == AVXVNNI) {  // the same quantizer (no dot products in it)
    switch (act) {
      case ACT_Q8K: quantize_q8k_avx2(row, K, (ActQ8K*)dst); return;
      case ACT_Q16: quantize_q16_avx2(row, K, (ActQ16*)dst); return;
      case ACT_Q16K: quantize_q16k_avx2(row, K, (ActQ16K*)dst); return;
      default: quantize_q8_avx2(row, K, (ActQ8*)dst); return;
    }
  }
#endif
  switch (act) {
    case ACT_Q8K: quantize_q8k_scalar(row, K, (ActQ8K*)dst); return;
    case ACT_Q16: quantize_q16_scalar(row, K, (ActQ16*)dst); return;
    case ACT_Q16K: quantize_q16k_scalar(row, K, (ActQ16K*)dst); return;
    default: quantize_q8_scalar(row, K, (ActQ8*)dst); return;
  }
}

void residual(const float* row, int K, int act, const uint8_t* q, float* out) {
  const bool superblocks = act == ACT_Q8K;
  const uint8_t* act_rows = q;
  const int n = superblocks ? QK_K : QK;
  for (int b = 0; b < K / n; ++b) {
    float d;
    const int8_t* qs;
    if (superblocks) {
      d = ((const ActQ8K*)act_rows)[b].d;
      qs = ((const ActQ8K*)act_rows)[b].qs;
    } else {
      d = ((const ActQ8*)act_rows)[b].d;
      qs = ((const ActQ8*)act_rows)[b].qs;
    }
    for (int i = 0; i < n; ++i) out[b * n + i] = row[b * n + i] - d * (float)qs[i];
  }
}

// Rows of x quantized into `layout`, row m from x's row src[m] (m without src), in `passes` passes
void quantize_rows(const float* x, int64_t M, int K, int layout, int64_t isa, uint8_t* act, size_t arb,
                   int passes = 1, const int64_t* src = nullptr) {
  // a few rows a thread: a decode step's 16 rows are not left to one thread while the others wait
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> rest(passes > 1 ? K : 0);
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + (src ? src[m] : m) * K;
      uint8_t* dst = act + m * passes * arb;
      quantize_one(row, K, layout, isa, dst);
      if (passes > 1) {
        residual(row, K, layout, dst, rest.data());
        quantize_one(rest.data(), K, layout, isa, dst + arb);
      }
    }
  });
}

// One weight of GGUF blocks, checked against its input width; its activations quantized in
// `passes` passes (quantize_rows): 1 where the type's wide kernel serves `passes=2` (kernel_for).
struct Matmul {
  Kernel k;
  const uint8_t* w;
  int64_t N, K, row_bytes;
  size_t act_row_bytes;
  int passes;
};

Matmul make_matmul(const at::Tensor& w, int64_t qtype, int64_t N, int64_t K, int64_t isa, const char* op,
                   int64_t passes = 1, bool bf16_rows = false) {
  Matmul mm;
  TORCH_CHECK(passes == 1 || passes == 2, op, ": passes must be 1 or 2");
  TORCH_CHECK(kernel_for(qtype, isa, &mm.k, passes, bf16_rows), op, ": no kernel for GGML type ", qtype, " on ISA ", isa);
  TORCH_CHECK(K % mm.k.block_values == 0, op, ": K=", K, " is not a multiple of ", mm.k.block_values);
  TORCH_CHECK(mm.k.unit != 16 || N % 16 == 0, op, ": a weight repacked by 16 rows holds whole groups of 16, not ", N);
  mm.N = N;
  mm.K = K;
  mm.passes = mm.k.passes;
  mm.row_bytes = K / mm.k.block_values * mm.k.block_bytes;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N * mm.row_bytes, op,
              ": w must be contiguous uint8 holding ", N, " rows of ", mm.row_bytes, " bytes");
  mm.w = w.data_ptr<uint8_t>();
  mm.act_row_bytes = act_bytes(mm.k.act, K);
  return mm;
}

// out[m * ldo + n] = y[m * passes][n] + ... (the passes' products of row m, added in pass order)
void add_passes(const float* y, int64_t M, int64_t N, int passes, float* out, int64_t ldo) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* a = y + m * passes * N;
      for (int64_t n = 0; n < N; ++n) {
        float v = a[n];
        for (int p = 1; p < passes; ++p) v += a[p * N + n];
        out[m * ldo + n] = v;
      }
    }
  });
}

// out [M, N] float32 (rows ldo apart, N by default) = x [M, K] float32 @ W.T: rows quantized,
// outputs split among the threads
void run_matmul(const Matmul& mm, const float* x, int64_t M, int64_t isa, float* out, Scratch<uint8_t>& act,
                int64_t ldo = 0) {
  if (M == 0 || mm.N == 0) return;
  if (ldo == 0) ldo = mm.N;
  const int passes = mm.passes;
  uint8_t* ap = act.get(M * passes * mm.act_row_bytes);
  quantize_rows(x, M, (int)mm.K, mm.k.act, isa, ap, mm.act_row_bytes, passes);
  std::vector<float> y(passes > 1 ? M * passes * mm.N : 0);
  float* dst = passes > 1 ? y.data() : out;
  const int64_t stride = passes > 1 ? mm.N : ldo;
  const int64_t unit = mm.k.unit;
  at::parallel_for(0, (mm.N + unit - 1) / unit, 1, [&](int64_t u0, int64_t u1) {
    mm.k.matmul(mm.w, mm.row_bytes, ap, mm.act_row_bytes, (int)(M * passes), (int)(u0 * unit),
                (int)std::min(u1 * unit, mm.N), (int)mm.K, dst, (int)stride);
  });
  if (passes > 1) add_passes(y.data(), M, mm.N, passes, out, ldo);
}

// Where the activations of weights side by side over one input (q, k, v; gate, up) go: one
// quantized copy of the rows per (layout, passes, K), at[j] part j's offset into the buffer (`first`:
// the part that quantizes it), `total` bytes for M rows.
struct Acts {
  std::vector<size_t> at;
  std::vector<bool> first;
  size_t total = 0;
};
Acts acts_for(const std::vector<Matmul>& parts, int64_t M) {
  Acts a;
  a.at.resize(parts.size());
  a.first.resize(parts.size());
  for (size_t j = 0; j < parts.size(); ++j) {
    size_t k = 0;
    for (; k < j; ++k)
      if (parts[k].k.act == parts[j].k.act && parts[k].passes == parts[j].passes && parts[k].K == parts[j].K) break;
    a.first[j] = k == j;
    if (k < j) {
      a.at[j] = a.at[k];
    } else {
      a.at[j] = a.total;
      a.total += (size_t)M * parts[j].passes * parts[j].act_row_bytes;
    }
  }
  return a;
}

// row m (x: K values of x_dtype, RowDtype) quantized into every layout of `acts` (quantize_rows'
// arithmetic); wide, rest: K floats of the calling thread's
void quantize_row_for(const std::vector<Matmul>& parts, const Acts& acts, const void* x, int x_dtype, int64_t m,
                      int64_t isa, uint8_t* ap, float* wide, float* rest) {
  const float* row = (const float*)x;
  for (size_t j = 0; j < parts.size(); ++j) {
    if (!acts.first[j]) continue;
    const int K = (int)parts[j].K;
    if (x_dtype == ROW_BF16 && row != wide) {
      kv_row(isa, wide, KV_F32, x, ROW_BF16, K);
      row = wide;
    }
    uint8_t* dst = ap + acts.at[j] + m * parts[j].passes * parts[j].act_row_bytes;
    quantize_one(row, K, parts[j].k.act, isa, dst);
    if (parts[j].passes > 1) {
      residual(row, K, parts[j].k.act, dst, rest);
      quantize_one(rest, K, parts[j].k.act, isa, dst + parts[j].act_row_bytes);
    }
  }
}

// Weights side by side over one input, out [M, sum of N] float32 (rows ldo apart) from the rows'
// activations in `ap` (acts' layouts): one parallel region over the parts' groups of outputs
// (Kernel::unit), so each part's outputs come out as run_matmul's, bit for bit. finish(j, c0, c1),
// where given: outputs c0 .. c1 - 1 (of the whole width, part j's) of every row are final; called
// in the region by the thread that made them, or (parts of two 8-bit passes) after it.
using Finish = std::function<void(size_t, int64_t, int64_t)>;
void multiply_quantized(const std::vector<Matmul>& parts, const Acts& acts, const uint8_t* ap, int64_t M, float* out,
                        int64_t ldo, const Finish* finish = nullptr) {
  if (M == 0 || parts.empty()) return;
  // two-pass parts' products per pass, added after
  std::vector<size_t> ys(parts.size());
  size_t ytotal = 0;
  std::vector<int64_t> group0(parts.size() + 1, 0), off(parts.size(), 0);
  for (size_t j = 0; j < parts.size(); ++j) {
    ys[j] = ytotal;
    if (parts[j].passes > 1) ytotal += (size_t)M * parts[j].passes * parts[j].N;
    group0[j + 1] = group0[j] + (parts[j].N + parts[j].k.unit - 1) / parts[j].k.unit;
    if (j > 0) off[j] = off[j - 1] + parts[j - 1].N;
  }
  std::vector<float> y(ytotal);
  at::parallel_for(0, group0.back(), 1, [&](int64_t g0, int64_t g1) {
    for (size_t j = 0; j < parts.size(); ++j) {
      const int64_t a = std::max(g0, group0[j]), b = std::min(g1, group0[j + 1]);
      if (a >= b) continue;
      const Matmul& mm = parts[j];
      const int64_t n0 = (a - group0[j]) * mm.k.unit, n1 = std::min<int64_t>((b - group0[j]) * mm.k.unit, mm.N);
      float* dst = mm.passes > 1 ? y.data() + ys[j] : out + off[j];
      const int64_t stride = mm.passes > 1 ? mm.N : ldo;
      mm.k.matmul(mm.w, mm.row_bytes, ap + acts.at[j], mm.act_row_bytes, (int)(M * mm.passes), (int)n0, (int)n1,
                  (int)mm.K, dst, (int)stride);
      if (finish != nullptr && ytotal == 0) (*finish)(j, off[j] + n0, off[j] + n1);
    }
  });
  if (ytotal == 0) return;
  for (size_t j = 0; j < parts.size(); ++j)
    if (parts[j].passes > 1) add_passes(y.data() + ys[j], M, parts[j].N, parts[j].passes, out + off[j], ldo);
  if (finish != nullptr)
    at::parallel_for(0, group0.back(), 1, [&](int64_t g0, int64_t g1) {
      for (size_t j = 0; j < parts.size(); ++j) {
        const int64_t a = std::max(g0, group0[j]), b = std::min(g1, group0[j + 1]);
        if (a < b)
          (*finish)(j, off[j] + (a - group0[j]) * parts[j].k.unit,
                    off[j] + std::min<int64_t>((b - group0[j]) * parts[j].k.unit, parts[j].N));
      }
    });
}

// multiply_quantized over x [M, K] (float32, or bfloat16: x_dtype), its rows quantized first (a few
// rows a thread: a decode step's 16 rows are not left to one thread while the others wait)
void run_matmuls(const std::vector<Matmul>& parts, const void* x, int64_t M, int64_t isa, float* out,
                 Scratch<uint8_t>& act, int64_t ldo, int x_dtype = ROW_F32, const Finish* finish = nullptr) {
  if (M == 0 || parts.empty()) return;
  const Acts acts = acts_for(parts, M);
  uint8_t* ap = act.get(acts.total);
  const int64_t K = parts[0].K, row_bytes = K * (x_dtype == ROW_BF16 ? 2 : 4);
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    std::vector<float> wide(K), rest(K);
    for (int64_t m = m0; m < m1; ++m)
      quantize_row_for(parts, acts, (const char*)x + m * row_bytes, x_dtype, m, isa, ap, wide.data(), rest.data());
  });
  multiply_quantized(parts, acts, ap, M, out, ldo, finish);
}

}  // namespace

}  // namespace opentgi
