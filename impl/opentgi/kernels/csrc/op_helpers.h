// What the torch-op sources (ops.cpp, moe_ops.cpp, stack.cpp) share beyond matmul.h: the row dtype
// and ISA checks, the per-row layer ops (layer_ops.h) dispatched by ISA, paged attention's checked
// arguments and its run (attention.h), defined in ops.cpp; the grouped experts and the router,
// defined in moe_ops.cpp. Each has one definition.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "attention.h"
#include "layer_ops.h"

namespace opentgi {

enum RowAct { ACT_SILU = 0, ACT_GELU_TANH = 1 };

// ROW_F32 or ROW_BF16 for a float32 or bfloat16 CPU tensor; a clear error for anything else
int row_dtype(const at::Tensor& t, const char* op);
// an error unless this library has kernels for `isa`
void check_isa(int64_t isa, const char* op);
// rms_norm_row (layer_ops.h) on the ISA's variant
void norm_row(int64_t isa, const void* x, const void* residual, void* sum, const void* weight, bool weight_f32, int n,
              float eps, int dtype, void* out, float* buf);
// act(gate) * up (RowAct) on the ISA's variant; buf: n rounded up to 8 floats
void act_row(int64_t isa, int act, const void* gate, const void* up, int n, int dtype, void* out, float* buf);
// kv_store_row (layer_ops.h) on the ISA's variant
void kv_row(int64_t isa, void* dst, int kv_dtype, const void* src, int dtype, int n);
// argmax_row (layer_ops.h) on the ISA's variant
int64_t argmax_of(int64_t isa, const float* x, int n, int dtype);
// each row's argmax_of over its first n values (rows of N float32 values), among the threads
void argmax_rows(int64_t isa, const float* x, int64_t M, int64_t N, int64_t n, int dtype, int64_t* out);
// rope_row (layer_ops.h) on the ISA's variant; buf: D floats
void rope(int64_t isa, void* x, const void* cos, const void* sin, int D, int dtype, float* buf);
// weighted_add_row (layer_ops.h) on the ISA's variant
void weighted_row(int64_t isa, float* acc, const float* y, float w, int n, int dtype);
// router_logits_row (layer_ops.h) on the ISA's variant
void router_logits(int64_t isa, const float* x, const float* w, int n, int E, float* logits);

// The attention's arguments but q and out, after checking that every block a row reads (through
// its table, from its window's first key to its last) is one of the cache's.
PagedAttention attention_args(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq, const at::Tensor& ctx, int64_t rows, int64_t heads, int64_t D,
                              int64_t window, double scale, double softcap, const char* op);
// every row of `a` on torch's intra-op threads, each work item whole on one thread
void run_attention(const PagedAttention& a, int64_t rows, int64_t isa);
// prompt rows' attention (attention.h: the prompt form) over rows 0 .. rows - 1 of a
void run_prompt_attention(const PagedAttention& a, int64_t rows, int64_t isa);
// A step's rows by attention form (form 1: prompt[t] set, the prompt form; form 0: decode rows), each
// form's rows in step order with their tables and contexts: made once a step, used by every layer
struct AttentionForms {
  std::vector<int64_t> rows[2];
  std::vector<int32_t> seq[2], ctx[2];
};
AttentionForms attention_forms(const bool* prompt, const PagedAttention& a, int64_t rows);
// each form's rows of `a` gathered, attended by its kernel, and scattered back
void run_attention_forms(const PagedAttention& a, const AttentionForms& forms, int64_t isa);

// opentgi::gguf_moe_up, opentgi::gguf_moe_down (moe_ops.cpp: grouped experts)
at::Tensor gguf_moe_up(const at::Tensor& x, at::TensorList w, int64_t qtype, const at::Tensor& ids,
                       int64_t out_features, int64_t isa, int64_t passes, int64_t act = -1);
at::Tensor gguf_moe_down(const at::Tensor& h, at::TensorList w, int64_t qtype, const at::Tensor& ids,
                         const at::Tensor& weights, int64_t out_features, int64_t isa, int64_t passes);
// A routed-experts layer: the router's float32 weight [E, hidden] and each expert's gate_up and
// down GGUF blocks, their types, activation passes and outputs.
struct Experts {
  at::Tensor router;
  std::vector<at::Tensor> up, down;
  int64_t up_qtype = 0, up_passes = 1, up_n = 0, down_qtype = 0, down_passes = 1;
};
// out [T, hidden] = the routed experts' weighted sum for x's rows, as SparseMoE's grouped path
// computes it: route_row, the experts' gate_up call, act(gate) * up a (token, expert) row at a time,
// the down call with the weighted sum
void routed_experts(const Experts& ex, const at::Tensor& x, int act_kind, int64_t top, bool renormalize, int64_t isa,
                    void* out);
// one token's routing (opentgi::moe_route): x [hidden] of the row dtype, w float32 [E, hidden] ->
// ids [top] and weights [top] in the row dtype; buf: hidden + E floats
void route_row(const void* x, int dtype, int64_t hidden, const float* w, int64_t E, int64_t top, bool renormalize,
               int64_t isa, float* buf, int64_t* ids, void* weights);

}  // namespace opentgi
