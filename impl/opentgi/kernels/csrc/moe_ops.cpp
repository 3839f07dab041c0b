// The grouped-experts torch ops (opentgi::gguf_moe_up, opentgi::gguf_moe_down) and the router's
// (opentgi::moe_route), registered into the opentgi library ops.cpp defines; the decode stack
// (stack.cpp) calls the same functions (op_helpers.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include <cmath>
#include <tuple>

#include "common.h"
#include "matmul.h"
#include "op_helpers.h"

namespace opentgi {
namespace {

// Grouped experts (MoE): opentgi::gguf_moe_up(x [T, K], w, qtype, ids [T, k], N, isa) -> [T, k, N]
// is x's row t by expert ids[t, j]'s weight (w[e]: uint8 [N, row bytes] of `qtype` blocks) for
// every (token, slot) pair in one call; opentgi::gguf_moe_down(h [T * k, K], w, qtype, ids,
// weights [T, k], N, isa) -> [T, N] multiplies pair p's row of h by its expert's weight and sums
// each token's k products weighted, in increasing expert order. Each activation row is quantized
// once (a token's row serves its k experts); the pairs are grouped by expert (a stable counting
// sort), and work items (an expert's rows, a chunk of its outputs) are split among torch's
// intra-op threads, each output computed whole by one thread through the same per-row kernels as
// gguf_mm: a pair's product has gguf_mm's bits for that row, whatever the other rows, the experts
// they chose or the thread count. The weighted sum runs as the per-expert path writes it: each
// product y * w rounded to the output dtype, added in float32 from zero in expert order, rounded
// once. With `act` (RowAct) gguf_moe_up returns act(gate) * up [T * k, N / 2] instead, each pair's
// row rounded to x's dtype and then through the row op the separate activation runs (act_row): the
// same bits, without the [T, k, N] tensor and a second call.

struct Grouped {
  std::vector<int64_t> order;  // sorted position -> pair (t * k + j)
  std::vector<int64_t> pos;    // pair -> sorted position
  std::vector<int64_t> expert, start, count;  // the experts used, and their rows' range in sorted order
};

Grouped group_pairs(const at::Tensor& ids, int64_t experts, const char* op) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong, op, ": ids must be int64 [tokens, k]");
  const at::Tensor ic = ids.contiguous();
  const int64_t* ip = ic.data_ptr<int64_t>();
  const int64_t pairs = ic.numel();
  std::vector<int64_t> counts(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ip[p] >= 0 && ip[p] < experts, op, ": expert id ", ip[p], " is not one of ", experts);
    ++counts[ip[p] + 1];
  }
  Grouped g;
  for (int64_t e = 0; e < experts; ++e) {
    if (counts[e + 1]) {
      g.expert.push_back(e);
      g.start.push_back(counts[e]);
      g.count.push_back(counts[e + 1]);
    }
    counts[e + 1] += counts[e];
  }
  g.order.resize(pairs);
  g.pos.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t r = counts[ip[p]]++;
    g.order[r] = p;
    g.pos[p] = r;
  }
  return g;
}

std::vector<const uint8_t*> expert_weights(at::TensorList w, int64_t N, int64_t row_bytes, const char* op) {
  std::vector<const uint8_t*> found;
  found.reserve(w.size());
  for (const at::Tensor& t : w) {
    TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.device().is_cpu() && t.numel() == N * row_bytes,
                op, ": each expert's w must be contiguous uint8 holding ", N, " rows of ", row_bytes, " bytes");
    found.push_back(t.data_ptr<uint8_t>());
  }
  return found;
}

// y [pairs, N] float32, in sorted order: each used expert's rows (act in sorted order) by its weight
// (with `passes` activation rows a pair: the pair's rows and y's rows `passes` apart, added by add_passes)
void run_grouped(const Kernel& k, const std::vector<const uint8_t*>& wp, int64_t row_bytes, const uint8_t* act,
                 size_t arb, const Grouped& g, int64_t N, int64_t K, int passes, float* y) {
  constexpr int64_t CHUNK = 64;
  const int64_t chunks = (N + CHUNK - 1) / CHUNK;
  const int64_t items = (int64_t)g.expert.size() * chunks;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t u = i / chunks, n0 = i % chunks * CHUNK, n1 = std::min(N, n0 + CHUNK);
      k.matmul(wp[g.expert[u]], row_bytes, act + g.start[u] * passes * arb, arb, (int)(g.count[u] * passes), (int)n0,
               (int)n1, (int)K, y + g.start[u] * passes * N, (int)N);
    }
  });
}

struct MoeCall {
  Kernel k;
  int64_t K, N, row_bytes;
  size_t arb;
  std::vector<const uint8_t*> wp;
};

MoeCall moe_call(const at::Tensor& x, at::TensorList w, int64_t qtype, int64_t N, int64_t isa, int64_t passes,
                 const char* op) {
  MoeCall c;
  TORCH_CHECK(passes == 1 || passes == 2, op, ": passes must be 1 or 2");
  TORCH_CHECK(kernel_for(qtype, isa, &c.k, passes, x.scalar_type() == at::kBFloat16), op, ": no kernel for GGML type ",
              qtype, " on ISA ", isa);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), op, ": x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x float32 or bfloat16");
  TORCH_CHECK(!w.empty(), op, ": no experts");
  c.K = x.size(1);
  c.N = N;
  TORCH_CHECK(c.K % c.k.block_values == 0, op, ": K=", c.K, " is not a multiple of ", c.k.block_values);
  c.row_bytes = c.K / c.k.block_values * c.k.block_bytes;
  c.arb = act_bytes(c.k.act, c.K);
  c.wp = expert_weights(w, N, c.row_bytes, op);
  return c;
}

}  // namespace

at::Tensor gguf_moe_up(const at::Tensor& x, at::TensorList w, int64_t qtype, const at::Tensor& ids,
                       int64_t out_features, int64_t isa, int64_t asked_passes, int64_t act) {
  const MoeCall c = moe_call(x, w, qtype, out_features, isa, asked_passes, "gguf_moe_up");
  const int64_t passes = c.k.passes;  // 1 where a wide kernel serves two
  const size_t rb = passes * c.arb;  // a row's activation rows
  const int64_t T = x.size(0), top = ids.dim() == 2 ? ids.size(1) : 0, N = c.N;
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T, "gguf_moe_up: ids must be [tokens, k], a row per row of x");
  const Grouped g = group_pairs(ids, (int64_t)w.size(), "gguf_moe_up");
  const int64_t pairs = T * top;
  TORCH_CHECK(act < 0 || ((act == ACT_SILU || act == ACT_GELU_TANH) && N % 2 == 0),
              "gguf_moe_up: act must be -1, or 0 (silu) or 1 (gelu_tanh) with an even out_features");
  at::Tensor out = act < 0 ? at::empty({T, top, N}, x.options()) : at::empty({pairs, N / 2}, x.options());
  if (pairs == 0 || N == 0) return out;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  std::vector<uint8_t> rows(T * rb), grouped(pairs * rb);
  quantize_rows(xf.data_ptr<float>(), T, (int)c.K, c.k.act, isa, rows.data(), c.arb, (int)passes);  // once a token
  for (int64_t r = 0; r < pairs; ++r) std::memcpy(grouped.data() + r * rb, rows.data() + g.order[r] / top * rb, rb);
  std::vector<float> y(pairs * passes * N);
  run_grouped(c.k, c.wp, c.row_bytes, grouped.data(), c.arb, g, N, c.K, (int)passes, y.data());
  std::vector<float> added(passes > 1 ? pairs * N : 0);
  if (passes > 1) add_passes(y.data(), pairs, N, (int)passes, added.data(), N);
  const float* ys = passes > 1 ? added.data() : y.data();  // [pairs, N] in sorted order
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int dtype = bf16 ? ROW_BF16 : ROW_F32;
  const size_t es = x.element_size();
  char* op = (char*)out.data_ptr();
  at::parallel_for(0, pairs, 16, [&](int64_t p0, int64_t p1) {
    std::vector<uint16_t> row(act >= 0 && bf16 ? N : 0);
    std::vector<float> buf(act >= 0 ? N / 2 + 8 : 0);
    for (int64_t p = p0; p < p1; ++p) {
      const float* src = ys + g.pos[p] * N;
      if (act < 0) {  // the pair's row in x's dtype (bfloat16: rounded as bf16_store rounds)
        kv_row(isa, op + p * N * es, bf16 ? KV_BF16 : KV_F32, src, ROW_F32, (int)N);
        continue;
      }
      const int64_t I = N / 2;
      const void* rounded = src;
      if (bf16) {
        kv_row(isa, row.data(), KV_BF16, src, ROW_F32, (int)N);
        rounded = row.data();
      }
      act_row(isa, (int)act, rounded, (const char*)rounded + I * es, (int)I, dtype, op + p * I * es, buf.data());
    }
  });
  return out;
}

at::Tensor gguf_moe_down(const at::Tensor& h, at::TensorList w, int64_t qtype, const at::Tensor& ids,
                         const at::Tensor& weights, int64_t out_features, int64_t isa, int64_t asked_passes) {
  const MoeCall c = moe_call(h, w, qtype, out_features, isa, asked_passes, "gguf_moe_down");
  const int64_t passes = c.k.passes;  // 1 where a wide kernel serves two
  TORCH_CHECK(ids.dim() == 2, "gguf_moe_down: ids must be [tokens, k]");
  const int64_t T = ids.size(0), top = ids.size(1), pairs = T * top, N = c.N;
  TORCH_CHECK(h.size(0) == pairs, "gguf_moe_down: h must hold a row per (token, slot) pair: ", pairs);
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == h.scalar_type(),
              "gguf_moe_down: weights must be [tokens, k] in h's dtype");
  const Grouped g = group_pairs(ids, (int64_t)w.size(), "gguf_moe_down");
  at::Tensor out = at::empty({T, N}, h.options());
  if (T == 0 || N == 0) return out;
  const at::Tensor hf = h.to(at::kFloat).contiguous(), wf = weights.to(at::kFloat).contiguous();
  const at::Tensor ic = ids.contiguous();
  std::vector<uint8_t> act(pairs * passes * c.arb);
  quantize_rows(hf.data_ptr<float>(), pairs, (int)c.K, c.k.act, isa, act.data(), c.arb, (int)passes,
                g.order.data());
  std::vector<float> y(pairs * passes * N);
  run_grouped(c.k, c.wp, c.row_bytes, act.data(), c.arb, g, N, c.K, (int)passes, y.data());
  std::vector<float> added(passes > 1 ? pairs * N : 0);
  if (passes > 1) add_passes(y.data(), pairs, N, (int)passes, added.data(), N);
  const float* ys = passes > 1 ? added.data() : y.data();  // [pairs, N] in sorted order
  const bool bf16 = h.scalar_type() == at::kBFloat16;
  const float* wt = wf.data_ptr<float>();
  const int64_t* ip = ic.data_ptr<int64_t>();
  char* op = (char*)out.data_ptr();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> slots(top);
    std::vector<float> acc(N);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < top; ++j) slots[j] = j;  // the token's slots in increasing expert order
      std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return ip[t * top + a] < ip[t * top + b]; });
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j : slots) {
        const int64_t p = t * top + j;
        const float* src = ys + g.pos[p] * N;
        weighted_row(isa, acc.data(), src, wt[p], (int)N, bf16 ? ROW_BF16 : ROW_F32);
      }
      kv_row(isa, op + t * N * h.element_size(), bf16 ? KV_BF16 : KV_F32, acc.data(), ROW_F32, (int)N);
    }
  });
  return out;
}

// A token's routing (moe_route): the router's logits x . w_e, each summed in one fixed order
// (router_logits_row, the ISA's variant: the same bits on every one) and rounded to the dtype, as a
// linear layer in the dtype rounds; the top k logits (the first of equal ones); their weights the
// softmax of the top k (renormalize) or of every logit, in float32, rounded to the dtype.
void route_row(const void* x, int dtype, int64_t hidden, const float* w, int64_t E, int64_t top, bool renormalize,
               int64_t isa, float* buf, int64_t* ids, void* weights) {
  float* xf = buf;
  float* logits = buf + hidden;
  for (int64_t i = 0; i < hidden; ++i)
    xf[i] = dtype == ROW_BF16 ? bf16_to_fp32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
  router_logits(isa, xf, w, (int)hidden, (int)E, logits);
  if (dtype == ROW_BF16)
    for (int64_t e = 0; e < E; ++e) logits[e] = bf16_to_fp32(bf16_store(logits[e]));
  for (int64_t j = 0; j < top; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t q = 0; q < j; ++q) taken = taken || ids[q] == e;
      if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
    }
    ids[j] = best;
  }
  const float m = logits[ids[0]];
  float total = 0.0f;
  if (renormalize) {
    for (int64_t j = 0; j < top; ++j) total += std::exp(logits[ids[j]] - m);
  } else {
    for (int64_t e = 0; e < E; ++e) total += std::exp(logits[e] - m);
  }
  for (int64_t j = 0; j < top; ++j) {
    const float v = std::exp(logits[ids[j]] - m) / total;
    if (dtype == ROW_BF16) ((uint16_t*)weights)[j] = bf16_store(v); else ((float*)weights)[j] = v;
  }
}

namespace {

// opentgi::moe_route(x [T, hidden] float32 or bfloat16, w float32 [E, hidden], k, renormalize, isa) ->
// (weights [T, k] in x's dtype, experts int64 [T, k]): route_row for each token, tokens split among
// torch's intra-op threads (a token's bits are its own).
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& w, int64_t top, bool renormalize,
                                             int64_t isa) {
  const int dtype = row_dtype(x, "moe_route");
  check_isa(isa, "moe_route");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1) && w.scalar_type() == at::kFloat
                  && w.device().is_cpu(), "moe_route: x [tokens, hidden], w float32 [experts, hidden]");
  const int64_t T = x.size(0), hidden = x.size(1), E = w.size(0);
  TORCH_CHECK(top >= 1 && top <= E, "moe_route: k=", top, " of ", E, " experts");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor weights = at::empty({T, top}, x.options());
  at::Tensor ids = at::empty({T, top}, x.options().dtype(at::kLong));
  const char* xp = (const char*)xc.data_ptr();
  char* wp = (char*)weights.data_ptr();
  int64_t* ip = ids.data_ptr<int64_t>();
  const size_t es = xc.element_size();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(hidden + E);
    for (int64_t t = t0; t < t1; ++t)
      route_row(xp + t * hidden * es, dtype, hidden, wc.data_ptr<float>(), E, top, renormalize, isa, buf.data(),
                ip + t * top, wp + t * top * es);
  });
  return {weights, ids};
}

}  // namespace

// decode_stack's routed-experts layer (op_helpers.h)
void routed_experts(const Experts& ex, const at::Tensor& x, int act_kind, int64_t top, bool renormalize, int64_t isa,
                    void* out) {
  const int64_t T = x.size(0), hidden = x.size(1), E = ex.router.size(0);
  const int dtype = row_dtype(x, "decode_stack");
  const size_t es = x.element_size();
  at::Tensor ids = at::empty({T, top}, x.options().dtype(at::kLong));
  at::Tensor weights = at::empty({T, top}, x.options());
  const char* xp = (const char*)x.data_ptr();
  char* wp = (char*)weights.data_ptr();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(hidden + E);
    for (int64_t t = t0; t < t1; ++t)
      route_row(xp + t * hidden * es, dtype, hidden, ex.router.data_ptr<float>(), E, top, renormalize, isa,
                buf.data(), ip + t * top, wp + t * top * es);
  });
  // act(gate) * up [T * k, I], in the gate/up call
  const at::Tensor hid = gguf_moe_up(x, ex.up, ex.up_qtype, ids, ex.up_n, isa, ex.up_passes, act_kind);
  const at::Tensor down = gguf_moe_down(hid, ex.down, ex.down_qtype, ids, weights, hidden, isa, ex.down_passes);
  std::memcpy(out, down.data_ptr(), T * hidden * es);
}

TORCH_LIBRARY_FRAGMENT(opentgi, m) {
  m.def("gguf_moe_up(Tensor x, Tensor[] w, int qtype, Tensor ids, int out_features, int isa, int passes=1, "
        "int act=-1) -> Tensor");
  m.def("gguf_moe_down(Tensor h, Tensor[] w, int qtype, Tensor ids, Tensor weights, int out_features, int isa, "
        "int passes=1) -> Tensor");
  m.def("moe_route(Tensor x, Tensor w, int k, bool renormalize, int isa) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(opentgi, CPU, m) {
  m.impl("gguf_moe_up", gguf_moe_up);
  m.impl("gguf_moe_down", gguf_moe_down);
  m.impl("moe_route", moe_route);
}

}  // namespace opentgi
