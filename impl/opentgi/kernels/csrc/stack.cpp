// opentgi::decode_stack_run: a step's decoder layers in one call, every row a decode row or, beside
// them, prompt rows in their own attention form, registered into the opentgi library ops.cpp
// defines. The layer is models/families/decoder.py's:
//   norm, one qkv matmul (+ bias), q and k normed per head (Qwen3, Gemma 3), RoPE by halves on q
//   and k (the layer's table: Gemma 3's local layers have their own), k and v stored in the paged
//   cache, paged attention (the layer's window; soft-capped logits: Gemma 2), o (+ bias), then
//   Llama's residual add + norm, or with sandwich norms (Gemma 2/3) the norm of o added to the
//   residual and the pre-feed-forward norm of that; gate_up, SiLU- or GELU(tanh)-and-multiply,
//   down, and the residual add (with sandwich norms: of down's output normed). A routed-experts
//   layer (Qwen3-MoE, Mixtral) instead routes each row (the router's float32 weight) and runs its
//   k experts grouped: moe_ops.cpp's gate/up call, the activation, its down call and weighted sum.
// Every norm is layer_ops.h's RMSNorm, its weight in h's dtype (RMSNorm) or float32 (Gemma's 1 + w).
// Every matmul is on GGUF blocks (q, k and v, or gate and up, one weight or parts of different
// block types side by side, as a Q4_K_M file holds them). Each op is the function the layer's
// modules call one by one, in their order, rounding to the row dtype where they round, so the
// hidden states equal the module-by-module step's bit for bit (and stay batch-invariant).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

#include "common.h"
#include "matmul.h"
#include "op_helpers.h"

namespace opentgi {
namespace {

static inline float to_dtype(float f, int dtype) { return dtype == ROW_BF16 ? bf16_to_fp32(bf16_store(f)) : f; }
static inline float ld(const void* p, int64_t i, int dtype) {
  return dtype == ROW_BF16 ? bf16_to_fp32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
static inline void st(void* p, int64_t i, float f, int dtype) {
  if (dtype == ROW_BF16) ((uint16_t*)p)[i] = bf16_store(f); else ((float*)p)[i] = f;
}

// A projection: one weight, or parts side by side (q, k, v or gate, up of different block types,
// as ConcatLinear concatenates them), each with its bias or none.
struct Projection {
  std::vector<Matmul> parts;
  std::vector<const void*> biases;
  int64_t N = 0, K = 0;
};

// out [M, N] (dtype) = x [M, K] (dtype) @ W.T, each part's outputs rounded to the dtype and then its
// bias added in the dtype: gguf_mm's rounding, then add_'s, part by part, as the modules compute
// (each thread finishes the outputs it made: multiply_quantized's finish). Returns the float32
// products before that rounding; with out null, only them (in `of`). With `ready`, x's rows are
// quantized already (by the row op that wrote them) and x is unused.
// Rows quantized for the projection `next` by the row op that wrote them: their layouts and buffer
struct Ready {
  const Projection* next = nullptr;
  Acts acts;
  uint8_t* ap = nullptr;
};

const float* linear_rows(const Projection& p, const void* x, int64_t M, int dtype, int64_t isa, Scratch<float>& of,
                         Scratch<uint8_t>& act, void* out, const Ready* ready = nullptr) {
  const int64_t N = p.N;
  float* o = dtype != ROW_F32 || out == nullptr ? of.get(M * N) : (float*)out;
  bool any_bias = false;
  for (const void* b : p.biases) any_bias = any_bias || b != nullptr;
  const auto multiply = [&](const Finish* finish) {
    if (ready == nullptr) return run_matmuls(p.parts, x, M, isa, o, act, N, dtype, finish);
    multiply_quantized(p.parts, ready->acts, ready->ap, M, o, N, finish);
  };
  if (out == nullptr || (dtype == ROW_F32 && !any_bias)) {
    multiply(nullptr);
    return o;
  }
  std::vector<int64_t> off(p.parts.size(), 0);
  for (size_t j = 1; j < p.parts.size(); ++j) off[j] = off[j - 1] + p.parts[j - 1].N;
  const Finish finish = [&](size_t j, int64_t c0, int64_t c1) {
    for (int64_t m = 0; m < M; ++m) {
      if (p.biases[j] == nullptr && dtype == ROW_BF16) {  // rounded once (to_dtype then st: the same bits)
        kv_row(isa, (uint16_t*)out + m * N + c0, KV_BF16, o + m * N + c0, ROW_F32, (int)(c1 - c0));
        continue;
      }
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t i = m * N + c;
        const float v = to_dtype(o[i], dtype);
        st(out, i, p.biases[j] == nullptr ? v : to_dtype(v + ld(p.biases[j], c - off[j], dtype), dtype), dtype);
      }
    }
  };
  multiply(&finish);
  return o;
}

// The four projections of each layer (qkv, o, gate_up, down; a routed-experts layer's last two
// empty), checked against the layer's shape.
std::vector<Projection> projections_of(at::TensorList weights, at::IntArrayRef qtypes, at::IntArrayRef passes,
                                       const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef parts,
                                       const std::vector<bool>& moe, int64_t L, int64_t hidden, int64_t H, int64_t KV,
                                       int64_t D, at::ScalarType dt, int64_t isa, std::vector<at::Tensor>& kept,
                                       const char* op) {
  const int64_t qkv_n = (H + 2 * KV) * D;
  std::vector<Projection> projections;
  kept.reserve(weights.size());
  size_t next = 0;
  for (int64_t l = 0; l < L; ++l) {
    for (int j = 0; j < 4; ++j) {
      Projection p;
      if (j >= 2 && moe[l]) {
        TORCH_CHECK(parts[4 * l + j] == 0, op, ": layer ", l, " routes to experts: no gate_up or down of its own");
        projections.push_back(std::move(p));
        continue;
      }
      TORCH_CHECK(parts[4 * l + j] >= 1 && next + parts[4 * l + j] <= weights.size(), op, ": a projection's parts");
      for (int64_t part = 0; part < parts[4 * l + j]; ++part, ++next) {
        const int64_t n = weights[next].size(0);
        const int64_t k = j == 1 ? H * D : j == 3 ? projections[4 * l + 2].N / 2 : hidden;
        p.parts.push_back(make_matmul(weights[next], qtypes[next], n, k, isa, op, passes[next], dt == at::kBFloat16));
        p.N += n;
        p.K = k;
        const std::optional<at::Tensor> b = biases.get(next);
        if (b.has_value() && b->defined()) {
          TORCH_CHECK(b->numel() == n && b->scalar_type() == dt, op, ": a bias [out] in h's dtype");
          kept.push_back(b->contiguous());
          p.biases.push_back(kept.back().data_ptr());
        } else {
          p.biases.push_back(nullptr);
        }
      }
      const int64_t want = j == 0 ? qkv_n : j == 2 ? p.N : hidden;
      TORCH_CHECK(p.N == want && (j != 2 || p.N % 2 == 0), op, ": layer ", l, " projection ", j, " has ", p.N,
                  " outputs (q, k, v: ", qkv_n, "; gate then up of one size; o and down: ", hidden, ")");
      projections.push_back(std::move(p));
    }
  }
  TORCH_CHECK(next == weights.size(), op, ": ", weights.size() - next, " weights belong to no projection");
  return projections;
}

// A step's working memory, kept from step to step (each buffer written before it is read)
struct StepScratch {
  Scratch<char> qkv, att_d, o, d, gu, a;
  Scratch<float> qf, out, of;
  Scratch<uint8_t> act;
};

// projections_of's result (and the biases' copies it points into) and the steps' working memory,
// kept across calls by DecodeStackArgs: made again only where a call's hidden size, head_dim or
// dtype differ
struct Prepared {
  std::vector<Projection> projections;
  std::vector<at::Tensor> kept;
  StepScratch scratch;
  int64_t hidden = -1, D = -1;
  at::ScalarType dt = at::kFloat;
};

// a norm's weight: `numel` values in h's dtype or float32, contiguous
void check_norm(const at::Tensor& w, int64_t numel, at::ScalarType dt, const char* what, const char* op) {
  TORCH_CHECK(w.numel() == numel && (w.scalar_type() == dt || w.scalar_type() == at::kFloat) && w.is_contiguous(),
              op, ": ", what, " weights [", numel, "] in h's dtype or float32");
}

at::Tensor decode_stack_on(const at::Tensor& h_in, at::TensorList cos, at::TensorList sin, at::IntArrayRef ropes,
                        at::TensorList weights, at::IntArrayRef qtypes, at::IntArrayRef passes,
                        const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef parts,
                        at::TensorList norms, at::TensorList qk_norms, at::TensorList k_caches,
                        at::TensorList v_caches, const at::Tensor& slots, const std::optional<at::Tensor>& tails,
                        const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& ctx,
                        int64_t num_heads, int64_t num_kv_heads, double scale, at::IntArrayRef windows,
                        double softcap, int64_t act_kind, double eps,
                        const c10::List<std::optional<at::Tensor>>& routers, at::TensorList expert_weights,
                        at::IntArrayRef expert_types, int64_t top_k, bool renormalize, int64_t isa,
                        Prepared* prepared, const std::optional<at::Tensor>& prompt = std::nullopt) {
  const char* op = "decode_stack";
  check_isa(isa, op);
  const int dtype = row_dtype(h_in, op);
  const int64_t L = (int64_t)k_caches.size();
  TORCH_CHECK(h_in.dim() == 2 && L >= 1 && !cos.empty(), op, ": h [rows, hidden], at least one layer and RoPE table");
  const bool sandwich = (int64_t)norms.size() == 4 * L;
  TORCH_CHECK((int64_t)parts.size() == 4 * L && qtypes.size() == weights.size() && passes.size() == weights.size()
                  && biases.size() == weights.size() && ((int64_t)norms.size() == 2 * L || sandwich)
                  && (qk_norms.empty() || (int64_t)qk_norms.size() == L) && (int64_t)v_caches.size() == L
                  && (int64_t)windows.size() == L && (int64_t)ropes.size() == L && sin.size() == cos.size(),
              op, ": 4 projections a layer (their parts' weights, qtypes, passes and biases), 2 norms (4 with "
              "sandwich norms), a q/k norm (or none), a k and a v cache, a window and a RoPE table per layer");
  TORCH_CHECK(act_kind == ACT_SILU || act_kind == ACT_GELU_TANH, op, ": act 0 (SiLU) or 1 (GELU tanh)");
  const int64_t T = h_in.size(0), hidden = h_in.size(1), H = num_heads, KV = num_kv_heads;
  const int64_t D = cos[0].size(-1), es = h_in.element_size();
  const auto dt = h_in.scalar_type();
  for (size_t i = 0; i < cos.size(); ++i)
    TORCH_CHECK(cos[i].numel() == T * D && sin[i].numel() == T * D && cos[i].scalar_type() == dt
                    && sin[i].scalar_type() == dt && cos[i].is_contiguous() && sin[i].is_contiguous() && D % 2 == 0,
                op, ": cos and signed sin [rows, 1, head_dim] in h's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T, op,
              ": slots int64 [rows]");
  at::Tensor h = h_in.contiguous().clone();
  if (T == 0) return h;
  const int64_t qkv_n = (H + 2 * KV) * D;
  TORCH_CHECK((int64_t)routers.size() == L, op, ": a router (or none) per layer");
  std::vector<bool> moe(L);
  std::vector<Experts> experts(L);
  size_t next_expert = 0, next_type = 0;
  for (int64_t l = 0; l < L; ++l) {
    const std::optional<at::Tensor> r = routers.get(l);
    moe[l] = r.has_value() && r->defined();
    if (!moe[l]) continue;
    Experts& ex = experts[l];
    ex.router = r->contiguous();
    const int64_t E = ex.router.size(0);
    TORCH_CHECK(ex.router.dim() == 2 && ex.router.size(1) == hidden && ex.router.scalar_type() == at::kFloat
                    && top_k >= 1 && top_k <= E && next_expert + 2 * E <= expert_weights.size()
                    && next_type + 5 <= expert_types.size(),
                op, ": layer ", l, ": a float32 router [experts, hidden], k of its experts, each expert's gate_up and "
                "down, and 5 types (gate_up's qtype, passes and outputs; down's qtype and passes)");
    ex.up.assign(expert_weights.begin() + next_expert, expert_weights.begin() + next_expert + E);
    ex.down.assign(expert_weights.begin() + next_expert + E, expert_weights.begin() + next_expert + 2 * E);
    next_expert += 2 * E;
    ex.up_qtype = expert_types[next_type];
    ex.up_passes = expert_types[next_type + 1];
    ex.up_n = expert_types[next_type + 2];
    ex.down_qtype = expert_types[next_type + 3];
    ex.down_passes = expert_types[next_type + 4];
    next_type += 5;
    TORCH_CHECK(ex.up_n >= 2 && ex.up_n % 2 == 0, op, ": an expert's gate then up, of one size");
  }
  TORCH_CHECK(next_expert == expert_weights.size() && next_type == expert_types.size(), op,
              ": expert weights or types that belong to no layer");
  std::vector<at::Tensor> kept;  // the biases' contiguous copies, alive for the call
  if (prepared->hidden != hidden || prepared->D != D || prepared->dt != dt) {  // made on the first call
    prepared->projections =
        projections_of(weights, qtypes, passes, biases, parts, moe, L, hidden, H, KV, D, dt, isa, kept, op);
    prepared->kept = std::move(kept);
    prepared->hidden = hidden, prepared->D = D, prepared->dt = dt;
  }
  const std::vector<Projection>& projections = prepared->projections;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t j = 0; j < (sandwich ? 4 : 2); ++j) check_norm(norms[(sandwich ? 4 : 2) * l + j], hidden, dt, "norm", op);
    if (!qk_norms.empty()) check_norm(qk_norms[l], (H + KV) * D, dt, "q/k norm", op);
    TORCH_CHECK(ropes[l] >= 0 && ropes[l] < (int64_t)cos.size(), op, ": layer ", l, " names RoPE table ", ropes[l]);
    TORCH_CHECK(k_caches[l].sizes() == k_caches[0].sizes() && v_caches[l].sizes() == k_caches[0].sizes()
                    && k_caches[l].scalar_type() == k_caches[0].scalar_type()
                    && v_caches[l].scalar_type() == k_caches[0].scalar_type()
                    && k_caches[l].is_contiguous() && v_caches[l].is_contiguous(),
                op, ": every layer's caches [blocks, block_size, kv_heads, head_dim] alike, in one dtype");
  }
  // every block any layer reads (windows only narrow what a row reads), checked once
  PagedAttention att = attention_args(k_caches[0], v_caches[0], block_tables, seq, ctx, T, H, D, 0, scale, softcap, op);
  TORCH_CHECK(k_caches[0].size(2) == KV, op, ": the caches hold ", k_caches[0].size(2), " kv heads, not ", KV);
  std::optional<AttentionForms> forms;  // with prompt rows: each row's attention form
  if (prompt.has_value() && prompt->defined()) {
    TORCH_CHECK(prompt->scalar_type() == at::kBool && prompt->is_contiguous() && prompt->numel() == T, op,
                ": prompt rows a bool [rows]");
    forms = attention_forms(prompt->data_ptr<bool>(), att, T);
  }
  const int64_t cache_slots = k_caches[0].size(0) * k_caches[0].size(1);
  const int64_t slot_bytes = KV * D * k_caches[0].element_size();  // a token's row, in the cache's dtype
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= -1 && sl[t] < cache_slots, op, ": row ", t, " writes slot ", sl[t], " of ", cache_slots);
  at::Tensor tail;
  if (tails.has_value() && tails->defined()) {
    tail = tails->to(at::kLong).contiguous();
    for (int64_t i = 0; i < tail.numel(); ++i)
      TORCH_CHECK(tail.data_ptr<int64_t>()[i] >= 0 && tail.data_ptr<int64_t>()[i] < cache_slots, op,
                  ": a tail slot out of the cache");
  }
  int64_t gu_max = 0;
  for (int64_t l = 0; l < L; ++l) gu_max = std::max(gu_max, projections[4 * l + 2].N);
  at::Tensor x_rows = at::empty({T, hidden}, h.options());  // the normed rows (an expert call's input)
  char* x = (char*)x_rows.data_ptr();
  StepScratch& sc = prepared->scratch;
  char* qkv = sc.qkv.get(T * qkv_n * es);
  char* att_d = sc.att_d.get(T * H * D * es);
  char* o = sc.o.get(T * hidden * es);
  char* d = sc.d.get(T * hidden * es);
  char* gu = sc.gu.get(T * gu_max * es);
  char* a = sc.a.get(T * gu_max / 2 * es);
  float* qf = sc.qf.get(T * H * D);
  float* out = sc.out.get(T * H * D);
  std::memset(out, 0, sizeof(float) * T * H * D);  // a row no attention form writes reads zeros
  char* hp = (char*)h.data_ptr();
  // A row op's output rows quantized on the op's threads for the projection that takes them next
  // (linear_rows' `ready`): row r (at `row`) into sc.act, in the projection's layouts
  const auto ready_for = [&](const Projection* next) {
    Ready q;
    if (next == nullptr) return q;
    q.next = next;
    q.acts = acts_for(next->parts, T);
    q.ap = sc.act.get(q.acts.total);
    return q;
  };
  const auto quantize = [&](const Ready& q, const char* row, int64_t r, std::vector<float>& wide,
                            std::vector<float>& rest) {
    if (q.next == nullptr) return;
    wide.resize(q.next->K);
    rest.resize(q.next->K);
    quantize_row_for(q.next->parts, q.acts, row, dtype, r, isa, q.ap, wide.data(), rest.data());
  };
  // x = norm(src) (with `residual`: of src + h, the sum stored to h), row by row, quantized for `next`
  // (returned: linear_rows' `ready`)
  const auto norm_all = [&](const void* src, bool residual, const at::Tensor& w, const Projection* next) {
    const Ready q = ready_for(next);
    at::parallel_for(0, T, 4, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(hidden + 8), wide, rest;
      for (int64_t r = r0; r < r1; ++r) {
        const size_t off = (size_t)r * hidden * es;
        norm_row(isa, (const char*)src + off, residual ? hp + off : nullptr, residual ? hp + off : nullptr,
                 w.data_ptr(), w.scalar_type() == at::kFloat, (int)hidden, (float)eps, dtype, x + off,
                 buf.data());
        quantize(q, x + off, r, wide, rest);
      }
    });
    return q;
  };
  // h = norm(src) + h (sandwich norms: the norm's output added to the residual stream), via x
  const auto norm_add = [&](const void* src, const at::Tensor& w) {
    norm_all(src, false, w, nullptr);
    at::parallel_for(0, T, 4, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * hidden; i < r1 * hidden; ++i) st(hp, i, ld(x, i, dtype) + ld(hp, i, dtype), dtype);
    });
  };
  const int64_t per = sandwich ? 4 : 2;
  for (int64_t l = 0; l < L; ++l) {
    const Projection* mm = &projections[4 * l];
    const Ready qn = sandwich || l == 0 ? norm_all(hp, false, norms[per * l], &mm[0])
                                        : norm_all(d, true, norms[per * l], &mm[0]);
    linear_rows(mm[0], x, T, dtype, isa, sc.of, sc.act, qkv, &qn);
    char* kc = (char*)k_caches[l].data_ptr();
    char* vc = (char*)v_caches[l].data_ptr();
    const char* cp = (const char*)cos[ropes[l]].data_ptr();
    const char* sp = (const char*)sin[ropes[l]].data_ptr();
    const char* qkw = qk_norms.empty() ? nullptr : (const char*)qk_norms[l].data_ptr();
    const bool qkw_f32 = qkw != nullptr && qk_norms[l].scalar_type() == at::kFloat;
    const int64_t qkw_row = qkw == nullptr ? 0 : D * qk_norms[l].element_size();
    at::parallel_for(0, T, 4, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(D + 8);
      for (int64_t t = r0; t < r1; ++t) {
        char* row = qkv + t * qkv_n * es;
        const char* c = cp + t * D * es;
        const char* s = sp + t * D * es;
        for (int64_t j = 0; j < H + KV; ++j) {
          char* hd = row + j * D * es;
          if (qkw != nullptr)  // per head, q's heads with q_norm's weight, k's with k_norm's (HeadsNorm)
            norm_row(isa, hd, nullptr, nullptr, qkw + j * qkw_row, qkw_f32, (int)D, (float)eps, dtype, hd, buf.data());
          rope(isa, hd, c, s, (int)D, dtype, buf.data());  // x * cos + cat(x2, x1) * signed sin
        }
        kv_row(isa, qf + t * H * D, KV_F32, row, dtype, (int)(H * D));
        if (sl[t] >= 0) {  // in the cache's dtype (float16 caches: rounded to nearest even)
          kv_row(isa, kc + sl[t] * slot_bytes, att.kv_dtype, row + H * D * es, dtype, (int)(KV * D));
          kv_row(isa, vc + sl[t] * slot_bytes, att.kv_dtype, row + (H + KV) * D * es, dtype, (int)(KV * D));
        }
      }
    });
    for (int64_t i = 0; i < tail.numel(); ++i) {  // zeros past the context (the torch forms read whole blocks)
      std::memset(kc + tail.data_ptr<int64_t>()[i] * slot_bytes, 0, slot_bytes);
      std::memset(vc + tail.data_ptr<int64_t>()[i] * slot_bytes, 0, slot_bytes);
    }
    att.k_cache = kc;
    att.v_cache = vc;
    att.window = windows[l] > 0 ? (int)windows[l] : 0;
    att.q = qf;
    att.out = out;
    if (forms.has_value()) run_attention_forms(att, *forms, isa);
    else run_attention(att, T, isa);
    const Ready qo = ready_for(&mm[1]);
    at::parallel_for(0, T, 4, [&](int64_t r0, int64_t r1) {  // in the row dtype, as st rounds
      std::vector<float> wide, rest;
      for (int64_t t = r0; t < r1; ++t) {
        kv_row(isa, att_d + t * H * D * es, dtype == ROW_BF16 ? KV_BF16 : KV_F32, out + t * H * D,
               ROW_F32, (int)(H * D));
        quantize(qo, att_d + t * H * D * es, t, wide, rest);
      }
    });
    linear_rows(mm[1], att_d, T, dtype, isa, sc.of, sc.act, o, &qo);
    const Projection* up = moe[l] ? nullptr : &mm[2];
    if (sandwich) norm_add(o, norms[per * l + 1]);
    const Ready qu = sandwich ? norm_all(hp, false, norms[per * l + 2], up)
                              : norm_all(o, true, norms[per * l + 1], up);
    if (moe[l]) {
      routed_experts(experts[l], x_rows, (int)act_kind, top_k, renormalize, isa, d);
    } else {
      linear_rows(mm[2], x, T, dtype, isa, sc.of, sc.act, gu, &qu);
      const int64_t I = mm[2].N / 2;
      const Ready qd = ready_for(&mm[3]);
      at::parallel_for(0, T, 4, [&](int64_t r0, int64_t r1) {
        std::vector<float> buf(I + 8), wide, rest;
        for (int64_t r = r0; r < r1; ++r) {
          act_row(isa, (int)act_kind, gu + r * 2 * I * es, gu + (r * 2 + 1) * I * es, (int)I, dtype,
                  a + r * I * es, buf.data());
          quantize(qd, a + r * I * es, r, wide, rest);
        }
      });
      linear_rows(mm[3], a, T, dtype, isa, sc.of, sc.act, d, &qd);
    }
    if (sandwich) norm_add(d, norms[per * l + 3]);
  }
  if (!sandwich)
    for (int64_t i = 0; i < T * hidden; ++i) st(hp, i, ld(d, i, dtype) + ld(hp, i, dtype), dtype);
  return h;
}


// decode_stack's arguments that stay the same from step to step (the model's weights and shape,
// its paged caches, the final norm), converted once: a step passes only its own tensors
// (decode_stack_run) instead of some 250 list items and numbers.
struct DecodeStackArgs : torch::CustomClassHolder {
  std::vector<int64_t> ropes, qtypes, passes, parts, windows, expert_types;
  std::vector<at::Tensor> weights, norms, qk_norms, k_caches, v_caches, expert_weights;
  c10::List<std::optional<at::Tensor>> biases, routers;
  int64_t num_heads = 0, num_kv_heads = 0, act = 0, top_k = 1, isa = 0;
  double scale = 0, softcap = 0, eps = 0, final_eps = 0;
  bool renormalize = true;
  std::optional<at::Tensor> final_norm;  // the decoder's final RMSNorm weight, or none (the caller norms)
  std::optional<at::Tensor> embedding;   // Q8_0 token embedding blocks [vocab, row bytes], or none
  bool embed_bf16 = false;               // its rows rounded to bfloat16 (else float32)
  std::optional<at::Tensor> head;        // the LM head's GGUF blocks [vocab, row bytes], or none
  int64_t head_qtype = 0, head_passes = 1, head_n = 0;
  Prepared prepared;  // the layers' projections, made on the first call
  std::mutex mu;      // one call at a time on these arguments (and their caches)
};

c10::intrusive_ptr<DecodeStackArgs> make_stack_args(
    std::vector<int64_t> ropes, std::vector<at::Tensor> weights, std::vector<int64_t> qtypes,
    std::vector<int64_t> passes, c10::List<std::optional<at::Tensor>> biases, std::vector<int64_t> parts,
    std::vector<at::Tensor> norms, std::vector<at::Tensor> qk_norms, std::vector<at::Tensor> k_caches,
    std::vector<at::Tensor> v_caches, int64_t num_heads, int64_t num_kv_heads, double scale,
    std::vector<int64_t> windows, double softcap, int64_t act, double eps, c10::List<std::optional<at::Tensor>> routers,
    std::vector<at::Tensor> expert_weights, std::vector<int64_t> expert_types, int64_t top_k, bool renormalize,
    int64_t isa, std::optional<at::Tensor> final_norm, double final_eps, std::optional<at::Tensor> embedding,
    bool embed_bf16, std::optional<at::Tensor> head, int64_t head_qtype, int64_t head_passes, int64_t head_n) {
  auto a = c10::make_intrusive<DecodeStackArgs>();
  a->ropes = std::move(ropes);
  a->weights = std::move(weights);
  a->qtypes = std::move(qtypes);
  a->passes = std::move(passes);
  a->biases = std::move(biases);
  a->parts = std::move(parts);
  a->norms = std::move(norms);
  a->qk_norms = std::move(qk_norms);
  a->k_caches = std::move(k_caches);
  a->v_caches = std::move(v_caches);
  a->num_heads = num_heads;
  a->num_kv_heads = num_kv_heads;
  a->scale = scale;
  a->windows = std::move(windows);
  a->softcap = softcap;
  a->act = act;
  a->eps = eps;
  a->routers = std::move(routers);
  a->expert_weights = std::move(expert_weights);
  a->expert_types = std::move(expert_types);
  a->top_k = top_k;
  a->renormalize = renormalize;
  a->isa = isa;
  if (final_norm.has_value() && final_norm->defined()) a->final_norm = final_norm->contiguous();
  a->final_eps = final_eps;
  if (embedding.has_value() && embedding->defined()) {
    TORCH_CHECK(embedding->dim() == 2 && embedding->scalar_type() == at::kByte && embedding->size(1) % 34 == 0,
                "DecodeStackArgs: a Q8_0 embedding's blocks [vocab, 34 bytes a block] as uint8");
    a->embedding = embedding->contiguous();
  }
  a->embed_bf16 = embed_bf16;
  if (head.has_value() && head->defined()) {
    TORCH_CHECK(a->final_norm.has_value() && head_n >= 1, "DecodeStackArgs: an LM head needs the final norm");
    a->head = head->contiguous();
  }
  a->head_qtype = head_qtype;
  a->head_passes = head_passes;
  a->head_n = head_n;
  return a;
}

// the Q8_0 embedding rows of token ids, as models/quantization/gguf_blocks.py's GGUFEmbedding
// computes them: float32 q times the float16 scale as float32 (one rounding), then the row dtype
at::Tensor embed_q8_0(const at::Tensor& blocks, const at::Tensor& ids, bool bf16, const char* op) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(), op, ": token ids int64 [rows]");
  const int64_t T = ids.numel(), V = blocks.size(0), nb = blocks.size(1) / 34, hidden = nb * 32;
  at::Tensor out = at::empty({T, hidden}, blocks.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const int64_t* id = ids.data_ptr<int64_t>();
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < V, op, ": token id ", id[t], " out of the embedding's ", V);
    const uint8_t* row = base + id[t] * nb * 34;
    for (int64_t b = 0; b < nb; ++b) {
      uint16_t dh;
      std::memcpy(&dh, row + b * 34, 2);
      const float d = fp16_to_fp32(dh);
      const int8_t* q = (const int8_t*)(row + b * 34 + 2);
      for (int64_t i = 0; i < 32; ++i) {
        const float v = (float)q[i] * d;
        const int64_t at = t * hidden + b * 32 + i;
        if (bf16) ((uint16_t*)out.data_ptr())[at] = bf16_store(v); else ((float*)out.data_ptr())[at] = v;
      }
    }
  }
  return out;
}

// rows `positions` of each [n, 1, head_dim] RoPE table (index_select's copy)
std::vector<at::Tensor> table_rows(at::TensorList tables, const at::Tensor& positions, const char* op) {
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous(), op,
              ": positions int64 [rows]");
  const int64_t T = positions.numel();
  const int64_t* pos = positions.data_ptr<int64_t>();
  std::vector<at::Tensor> rows;
  rows.reserve(tables.size());
  for (const at::Tensor& table : tables) {
    TORCH_CHECK(table.dim() == 3 && table.size(1) == 1 && table.is_contiguous(), op,
                ": RoPE tables [positions, 1, head_dim], contiguous");
    const int64_t n = table.size(0), row_bytes = table.size(2) * table.element_size();
    at::Tensor out = at::empty({T, 1, table.size(2)}, table.options());
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < n, op, ": position ", pos[t], " past the RoPE table's ", n);
      std::memcpy((char*)out.data_ptr() + t * row_bytes, (const char*)table.data_ptr() + pos[t] * row_bytes, row_bytes);
    }
    rows.push_back(std::move(out));
  }
  return rows;
}

// decode_stack on `args` and a step's own tensors: its rows (h [rows, hidden], or token ids [rows]
// looked up in args' embedding), their positions (their RoPE rows gathered
// from each whole table here), slots, tails and native rows; then the final norm where args hold
// one (models/layers/norm.py's RMSNorm: rms_norm's rows); with `logits`, the LM head's matmul of
// the normed rows (gguf_mm's, in h's dtype) instead of them; with `greedy` > 0, each row's argmax
// over the first `greedy` of those logits (int64 [rows]: argmax_of) instead of the logits.
at::Tensor decode_stack_run(const c10::intrusive_ptr<DecodeStackArgs>& a, const at::Tensor& h,
                            const at::Tensor& positions, at::TensorList cos_tables, at::TensorList sin_tables,
                            const at::Tensor& slots, const std::optional<at::Tensor>& tails,
                            const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& ctx,
                            bool logits, const std::optional<at::Tensor>& prompt, int64_t greedy) {
  const char* op = "decode_stack_run";
  TORCH_CHECK((h.dim() == 2 || (h.dim() == 1 && a->embedding.has_value())) && positions.numel() == h.size(0), op,
              ": h [rows, hidden] (or token ids [rows] with a Q8_0 embedding in args) and a position a row");
  TORCH_CHECK((!logits && greedy == 0) || a->head.has_value(), op, ": logits asked of args without an LM head");
  std::lock_guard<std::mutex> lock(a->mu);
  const at::Tensor rows = h.dim() == 1 ? embed_q8_0(*a->embedding, h, a->embed_bf16, op) : h;
  const std::vector<at::Tensor> cos = table_rows(cos_tables, positions, op), sin = table_rows(sin_tables, positions, op);
  at::Tensor out = decode_stack_on(rows, cos, sin, a->ropes, a->weights, a->qtypes, a->passes, a->biases, a->parts, a->norms,
                                a->qk_norms, a->k_caches, a->v_caches, slots, tails, block_tables, seq, ctx,
                                a->num_heads, a->num_kv_heads, a->scale, a->windows, a->softcap, a->act, a->eps,
                                a->routers, a->expert_weights, a->expert_types, a->top_k, a->renormalize, a->isa,
                                &a->prepared, prompt);
  if (!a->final_norm.has_value()) return out;
  const at::Tensor& w = *a->final_norm;
  const int64_t T = out.size(0), n = out.size(1);
  TORCH_CHECK(w.numel() == n && (w.scalar_type() == out.scalar_type() || w.scalar_type() == at::kFloat), op,
              ": the final norm's weight [hidden] in h's dtype or float32");
  const int dtype = row_dtype(out, op);
  at::Tensor normed = at::empty(out.sizes(), out.options());
  const size_t es = out.element_size();
  const char* xp = (const char*)out.data_ptr();
  char* np = (char*)normed.data_ptr();
  at::parallel_for(0, T, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n + 8);
    for (int64_t r = r0; r < r1; ++r)
      norm_row(a->isa, xp + r * n * es, nullptr, nullptr, w.data_ptr(), w.scalar_type() == at::kFloat, (int)n,
               (float)a->final_eps, dtype, np + r * n * es, buf.data());
  });
  if (!logits && greedy == 0) return normed;
  Projection head;
  head.parts.push_back(
      make_matmul(*a->head, a->head_qtype, a->head_n, n, a->isa, op, a->head_passes, dtype == ROW_BF16));
  head.biases.push_back(nullptr);
  head.N = a->head_n;
  head.K = n;
  StepScratch& sc = a->prepared.scratch;
  if (greedy > 0) {  // each row's argmax over its first `greedy` logits, as `logits` would return them
    TORCH_CHECK(greedy <= a->head_n, op, ": greedy=", greedy, " past the head's ", a->head_n, " outputs");
    const float* products = linear_rows(head, normed.data_ptr(), T, dtype, a->isa, sc.of, sc.act, nullptr);
    at::Tensor tokens = at::empty({T}, out.options().dtype(at::kLong));
    argmax_rows(a->isa, products, T, a->head_n, greedy, dtype, tokens.data_ptr<int64_t>());
    return tokens;
  }
  at::Tensor out_logits = at::empty({T, a->head_n}, out.options());
  linear_rows(head, normed.data_ptr(), T, dtype, a->isa, sc.of, sc.act, out_logits.data_ptr());
  return out_logits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(opentgi, m) {
  m.class_<DecodeStackArgs>("DecodeStackArgs").def(torch::init(&make_stack_args));
  m.def("decode_stack_run(__torch__.torch.classes.opentgi.DecodeStackArgs args, Tensor h, Tensor positions, "
        "Tensor[] cos_tables, Tensor[] sin_tables, Tensor slots, Tensor? tails, Tensor block_tables, Tensor seq, "
        "Tensor ctx, bool logits=False, Tensor? prompt=None, int greedy=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(opentgi, CPU, m) {
  m.impl("decode_stack_run", decode_stack_run);
}

}  // namespace opentgi
