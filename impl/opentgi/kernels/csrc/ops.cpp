// The torch ops: opentgi::gguf_mm(x, w, qtype, out_features, isa, passes) -> x @ W.T, W the GGUF
// blocks of `qtype` (uint8 [N, row bytes], e.g. a view of the memory-mapped file), x float32 or
// bfloat16 [M, K]. Activation rows are quantized by rows (in one or two passes: matmul.h), then
// outputs are split among torch's intra-op threads by columns; each output is computed whole by
// one thread (common.h's invariant), so a row's bits depend neither on the other rows nor on the
// thread count. The grouped-experts ops are moe_ops.cpp's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "attention.h"
#include "common.h"
#include "layer_ops.h"
#include "matmul.h"

namespace opentgi {
namespace {

at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t out_features, int64_t isa,
                   int64_t passes) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "gguf_mm: x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gguf_mm: x float32 or bfloat16");
  const Matmul mm = make_matmul(w, qtype, out_features, x.size(1), isa, "gguf_mm", passes);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  std::vector<uint8_t> act;
  run_matmul(mm, xf.data_ptr<float>(), x.size(0), isa, out.data_ptr<float>(), act);
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// The attention's arguments but q and out, after checking that every block a row reads (through
// its table, from its window's first key to its last) is one of the cache's.
PagedAttention attention_args(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq, const at::Tensor& ctx, int64_t rows, int64_t heads, int64_t D,
                              int64_t window, double scale, double softcap, const char* op) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type()
                  && k_cache.is_contiguous() && v_cache.is_contiguous(),
              op, ": k_cache and v_cache must be contiguous [blocks, block_size, kv_heads, D] alike");
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, ": cache float32, bfloat16 or float16");
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(bs >= 1 && bs <= 1024, op, ": block size ", bs, " is not in 1..1024");
  TORCH_CHECK(k_cache.size(3) == D && kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 256,
              op, ": heads must be a multiple (at most 256x) of the cache's kv heads, head_dim alike");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              op, ": block_tables must be contiguous int32 [seqs, width]");
  TORCH_CHECK(seq.scalar_type() == at::kInt && ctx.scalar_type() == at::kInt && seq.is_contiguous() && ctx.is_contiguous()
                  && seq.numel() == rows && ctx.numel() == rows,
              op, ": seq and ctx must be contiguous int32 [rows]");
  const int64_t seqs = block_tables.size(0), width = block_tables.size(1);
  const int32_t* sp = seq.data_ptr<int32_t>();
  const int32_t* cp = ctx.data_ptr<int32_t>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < seqs, op, ": row ", r, " names block table ", sp[r], " of ", seqs);
    TORCH_CHECK(cp[r] >= 1 && cp[r] <= width * bs, op, ": row ", r, " has ", cp[r], " keys; its table holds ", width * bs);
    const int64_t lo = window > 0 && cp[r] > window ? cp[r] - window : 0;
    for (int64_t b = lo / bs; b * bs < cp[r]; ++b) {
      const int32_t id = tp[sp[r] * width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, op, ": row ", r, " reads block ", id, " of ", num_blocks);
    }
  }
  PagedAttention a;
  a.q = nullptr;
  a.out = nullptr;
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.kv_dtype = dt == at::kFloat ? KV_F32 : dt == at::kBFloat16 ? KV_BF16 : KV_F16;
  a.block_tables = tp;
  a.table_stride = width;
  a.seq = sp;
  a.ctx = cp;
  a.num_heads = (int)heads;
  a.num_kv_heads = (int)kv_heads;
  a.head_dim = (int)k_cache.size(3);
  a.block_size = (int)bs;
  a.window = window > 0 ? (int)window : 0;
  a.scale = (float)scale;
  a.softcap = softcap > 0 ? (float)softcap : 0.0f;
  // a row's kv heads in one item where the rows alone keep the threads busy (a block read once
  // for all its kv heads), else one item per (row, kv head): the same bits either way (attention.h)
  a.kv_heads_per_item = rows >= 2 * at::get_num_threads() ? (int)kv_heads : 1;
  return a;
}

// Each row's visible blocks in splits (attention.h), every (split, kv head chunk) a work item among
// torch's intra-op threads; then each row of several splits gets its heads' splits combined in split
// order: max of the running maxima, then the sums and accumulators rescaled and added, then divided.
void run_attention(const PagedAttention& args, int64_t rows, int64_t isa) {
  PagedAttention a = args;
  const int bs = a.block_size, per = a.kv_heads_per_item, chunks = a.num_kv_heads / per;
  const int G = a.num_heads / a.num_kv_heads, D = a.head_dim;
  a.split_blocks = split_blocks_for(bs);
  std::vector<int32_t> unit_row, unit_split, unit_parts;
  std::vector<int64_t> first_unit(rows);
  unit_row.reserve(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int ctx = a.ctx[r], lo = a.window > 0 && ctx > a.window ? ctx - a.window : 0;
    const int blocks = (ctx + bs - 1) / bs - lo / bs;
    const int parts = (blocks + a.split_blocks - 1) / a.split_blocks;
    first_unit[r] = (int64_t)unit_row.size();
    for (int s = 0; s < parts; ++s) {
      unit_row.push_back((int32_t)r);
      unit_split.push_back(s);
      unit_parts.push_back(parts);
    }
  }
  const int64_t units = (int64_t)unit_row.size(), items = units * chunks, width = (int64_t)per * G * (D + 2);
  std::vector<float> partial(units > rows ? items * width : 0);
  a.unit_row = unit_row.data();
  a.unit_split = unit_split.data();
  a.unit_parts = unit_parts.data();
  a.partial = partial.data();
  const int64_t scratch = paged_attention_scratch(a);
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(scratch);
#ifdef OPENTGI_WITH_AVX2
    if (isa == AVX2) {
      paged_attention_avx2(a, i0, i1, buf.data());
      return;
    }
#endif
    paged_attention_scalar(a, i0, i1, buf.data());
  });
  if (units == rows) return;
  at::parallel_for(0, rows * chunks, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> acc(D);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t r = j / chunks, c = j % chunks, u0 = first_unit[r];
      const int parts = unit_parts[u0];
      if (parts == 1) continue;
      float* out = a.out + (r * a.num_heads + c * per * G) * D;
      for (int i = 0; i < per * G; ++i) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int s = 0; s < parts; ++s) {
          const float ms = a.partial[((u0 + s) * chunks + c) * width + (int64_t)i * (D + 2) + D];
          mx = ms > mx ? ms : mx;
        }
        float sum = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int s = 0; s < parts; ++s) {
          const float* p = a.partial + ((u0 + s) * chunks + c) * width + (int64_t)i * (D + 2);
          const float w = p[D] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(p[D] - mx);
          sum += p[D + 1] * w;
          for (int d = 0; d < D; ++d) acc[d] += p[d] * w;
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int d = 0; d < D; ++d) out[(int64_t)i * D + d] = acc[d] * inv;
      }
    }
  });
}

// opentgi::paged_attention (attention.h): q [rows, heads, D] float32 or bfloat16, the caches
// [blocks, block_size, kv_heads, D] float32, bfloat16 or float16, block_tables int32 [seqs, width],
// seq and ctx int32 [rows] -> [rows, heads, D] in q's dtype. Work items (a row's kv heads, or one of
// them) are split among torch's intra-op threads, each computed whole by one thread.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& ctx,
                           double scale, int64_t window, double softcap, int64_t isa) {
  TORCH_CHECK(isa == SCALAR
#ifdef OPENTGI_WITH_AVX2
                  || isa == AVX2
#endif
              , "paged_attention: no kernel for ISA ", isa);
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu(), "paged_attention: q must be a 3-D CPU tensor");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "paged_attention: q float32 or bfloat16");
  const int64_t rows = q.size(0), heads = q.size(1), D = q.size(2);
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows, heads, D}, q.options().dtype(at::kFloat));
  PagedAttention a = attention_args(k_cache, v_cache, block_tables, seq, ctx, rows, heads, D, window, scale,
                                    softcap, "paged_attention");
  if (rows == 0) return out.to(q.scalar_type());
  a.q = qf.data_ptr<float>();
  a.out = out.data_ptr<float>();
  run_attention(a, rows, isa);
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

// Fused layer ops (layer_ops.h), rows split among torch's intra-op threads, each row by one thread.

int row_dtype(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16), op,
              ": a float32 or bfloat16 CPU tensor");
  return t.scalar_type() == at::kBFloat16 ? ROW_BF16 : ROW_F32;
}

void check_isa(int64_t isa, const char* op) {
  TORCH_CHECK(isa == SCALAR
#ifdef OPENTGI_WITH_AVX2
                  || isa == AVX2
#endif
              , op, ": no kernel for ISA ", isa);
}

void norm_row(int64_t isa, const void* x, const void* residual, void* sum, const void* weight, int n, float eps,
              int dtype, void* out, float* buf) {
#ifdef OPENTGI_WITH_AVX2
  if (isa == AVX2) return rms_norm_row_avx2(x, residual, sum, weight, n, eps, dtype, out, buf);
#endif
  rms_norm_row_scalar(x, residual, sum, weight, n, eps, dtype, out, buf);
}

void silu_row(int64_t isa, const void* gate, const void* up, int n, int dtype, void* out, float* buf) {
#ifdef OPENTGI_WITH_AVX2
  if (isa == AVX2) return silu_mul_row_avx2(gate, up, n, dtype, out, buf);
#endif
  silu_mul_row_scalar(gate, up, n, dtype, out, buf);
}

std::tuple<at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                             const at::Tensor& weight, double eps, int64_t isa) {
  check_isa(isa, "rms_norm");
  const int dtype = row_dtype(x, "rms_norm");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight [", n, "] in x's dtype");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor rc, sum;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "add_rms_norm: residual of x's shape and dtype");
    rc = residual->contiguous();
    sum = at::empty(xc.sizes(), xc.options());
  }
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  const int64_t rows = n ? xc.numel() / n : 0;
  const size_t es = xc.element_size();
  const char* xp = (const char*)xc.data_ptr();
  const char* rp = rc.defined() ? (const char*)rc.data_ptr() : nullptr;
  char* sp = sum.defined() ? (char*)sum.data_ptr() : nullptr;
  char* op = (char*)out.data_ptr();
  const void* wp = wc.data_ptr();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n + 8);
    for (int64_t r = r0; r < r1; ++r) {
      const size_t off = (size_t)r * n * es;
      norm_row(isa, xp + off, rp ? rp + off : nullptr, sp ? sp + off : nullptr, wp, (int)n, (float)eps, dtype,
               op + off, buf.data());
    }
  });
  return {out, sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t isa) {
  return std::get<0>(norm_rows(x, std::nullopt, weight, eps, isa));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, int64_t isa) {
  return norm_rows(x, residual, weight, eps, isa);
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t isa) {
  check_isa(isa, "silu_mul");
  const int dtype = row_dtype(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "silu_mul: the last dim holds gate then up, of one size");
  const int64_t n = gate_up.size(-1) / 2;
  const at::Tensor g = gate_up.contiguous();
  std::vector<int64_t> shape(g.sizes().begin(), g.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, g.options());
  const int64_t rows = n ? g.numel() / (2 * n) : 0;
  const size_t es = g.element_size();
  const char* gp = (const char*)g.data_ptr();
  char* op = (char*)out.data_ptr();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n + 8);
    for (int64_t r = r0; r < r1; ++r) {
      const char* row = gp + (size_t)r * 2 * n * es;
      silu_row(isa, row, row + n * es, (int)n, dtype, op + (size_t)r * n * es, buf.data());
    }
  });
  return out;
}

// opentgi::decode_stack: a step's decoder layers, every row a decode row, in one call. The layer is
// Llama's (models/families/decoder.py): RMSNorm, one qkv matmul (+ bias), RoPE by halves on q and k,
// k and v stored in the paged cache, paged attention, o (+ bias), residual add + RMSNorm, gate_up,
// SiLU-and-multiply, down, residual add; every matmul on GGUF blocks (q, k and v, or gate and up, one
// weight or parts of different block types side by side, as a Q4_K_M file holds them). Each op is the function the
// layer's modules call one by one, in their order, rounding to the row dtype where they round, so
// the hidden states equal the module-by-module step's bit for bit (and stay batch-invariant).

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
void linear_rows(const Projection& p, const void* x, int64_t M, int dtype, int64_t isa, std::vector<float>& xf,
                 std::vector<float>& of, std::vector<uint8_t>& act, void* out) {
  const int64_t K = p.K, N = p.N;
  const float* xin = (const float*)x;
  if (dtype != ROW_F32) {
    xf.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = ld(x, i, dtype);
    xin = xf.data();
  }
  float* o = (float*)out;
  if (dtype != ROW_F32) {
    of.resize(M * N);
    o = of.data();
  }
  bool any_bias = false;
  for (size_t j = 0, off = 0; j < p.parts.size(); off += p.parts[j].N, ++j) {
    run_matmul(p.parts[j], xin, M, isa, o + off, act, N);
    any_bias = any_bias || p.biases[j] != nullptr;
  }
  if (dtype == ROW_F32 && !any_bias) return;
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (size_t j = 0, off = 0; j < p.parts.size(); off += p.parts[j].N, ++j)
        for (int64_t n = 0; n < p.parts[j].N; ++n) {
          const int64_t i = m * N + off + n;
          float v = to_dtype(o[i], dtype);
          if (p.biases[j] != nullptr) v = to_dtype(v + ld(p.biases[j], n, dtype), dtype);
          st(out, i, v, dtype);
        }
  });
}

at::Tensor decode_stack(const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                        at::IntArrayRef qtypes, at::IntArrayRef passes,
                        const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef parts,
                        at::TensorList norms, at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots,
                        const std::optional<at::Tensor>& tails, const at::Tensor& block_tables, const at::Tensor& seq,
                        const at::Tensor& ctx, int64_t num_heads, int64_t num_kv_heads, double scale,
                        at::IntArrayRef windows, double eps, int64_t isa) {
  const char* op = "decode_stack";
  check_isa(isa, op);
  const int dtype = row_dtype(h_in, op);
  const int64_t L = (int64_t)k_caches.size();
  TORCH_CHECK(h_in.dim() == 2 && L >= 1, op, ": h [rows, hidden] and at least one layer");
  TORCH_CHECK((int64_t)parts.size() == 4 * L && qtypes.size() == weights.size() && passes.size() == weights.size()
                  && biases.size() == weights.size()
                  && (int64_t)norms.size() == 2 * L && (int64_t)v_caches.size() == L && (int64_t)windows.size() == L,
              op, ": 4 projections a layer (their parts' weights, qtypes, passes and biases), 2 norms, a k and a v cache and "
              "a window per layer");
  const int64_t T = h_in.size(0), hidden = h_in.size(1), H = num_heads, KV = num_kv_heads;
  const int64_t D = cos.size(-1), es = h_in.element_size();
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && cos.scalar_type() == h_in.scalar_type()
                  && sin.scalar_type() == h_in.scalar_type() && cos.is_contiguous() && sin.is_contiguous() && D % 2 == 0,
              op, ": cos and signed sin [rows, 1, head_dim] in h's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T, op,
              ": slots int64 [rows]");
  at::Tensor h = h_in.contiguous().clone();
  if (T == 0) return h;
  const int64_t qkv_n = (H + 2 * KV) * D;
  std::vector<Projection> projections;
  std::vector<at::Tensor> kept;  // the biases' contiguous copies, alive for the call
  kept.reserve(weights.size());
  size_t next = 0;
  for (int64_t l = 0; l < L; ++l) {
    for (int j = 0; j < 4; ++j) {
      Projection p;
      p.K = j == 0 || j == 2 ? hidden : 0;
      TORCH_CHECK(parts[4 * l + j] >= 1 && next + parts[4 * l + j] <= weights.size(), op, ": a projection's parts");
      for (int64_t part = 0; part < parts[4 * l + j]; ++part, ++next) {
        const int64_t n = weights[next].size(0);
        const int64_t k = j == 1 ? H * D : j == 3 ? projections[4 * l + 2].N / 2 : hidden;
        p.parts.push_back(make_matmul(weights[next], qtypes[next], n, k, isa, op, passes[next]));
        p.N += n;
        p.K = k;
        const std::optional<at::Tensor> b = biases.get(next);
        if (b.has_value() && b->defined()) {
          TORCH_CHECK(b->numel() == n && b->scalar_type() == h.scalar_type(), op, ": a bias [out] in h's dtype");
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
    for (int j = 0; j < 2; ++j)
      TORCH_CHECK(norms[2 * l + j].numel() == hidden && norms[2 * l + j].scalar_type() == h.scalar_type()
                      && norms[2 * l + j].is_contiguous(), op, ": norm weights [hidden] in h's dtype");
    TORCH_CHECK(k_caches[l].sizes() == k_caches[0].sizes() && v_caches[l].sizes() == k_caches[0].sizes()
                    && k_caches[l].scalar_type() == h.scalar_type() && v_caches[l].scalar_type() == h.scalar_type()
                    && k_caches[l].is_contiguous() && v_caches[l].is_contiguous(),
                op, ": every layer's caches [blocks, block_size, kv_heads, head_dim] alike, in h's dtype");
  }
  TORCH_CHECK(next == weights.size(), op, ": ", weights.size() - next, " weights belong to no projection");
  // every block any layer reads (windows only narrow what a row reads), checked once
  PagedAttention att = attention_args(k_caches[0], v_caches[0], block_tables, seq, ctx, T, H, D, 0, scale, 0.0, op);
  TORCH_CHECK(k_caches[0].size(2) == KV, op, ": the caches hold ", k_caches[0].size(2), " kv heads, not ", KV);
  const int64_t cache_slots = k_caches[0].size(0) * k_caches[0].size(1), slot_bytes = KV * D * es;
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= -1 && sl[t] < cache_slots, op, ": row ", t, " writes slot ", sl[t], " of ", cache_slots);
  at::Tensor tail;
  if (tails.has_value() && tails->defined()) {
    tail = tails->to(at::kLong).contiguous();
    for (int64_t i = 0; i < tail.numel(); ++i)
      TORCH_CHECK(tail.data_ptr<int64_t>()[i] >= 0 && tail.data_ptr<int64_t>()[i] < cache_slots, op, ": a tail slot out of the cache");
  }
  int64_t gu_max = 0;
  for (int64_t l = 0; l < L; ++l) gu_max = std::max(gu_max, projections[4 * l + 2].N);
  std::vector<char> x(T * hidden * es), qkv(T * qkv_n * es), att_d(T * H * D * es), o(T * hidden * es),
      d(T * hidden * es), gu(T * gu_max * es), a(T * gu_max / 2 * es);
  std::vector<float> qf(T * H * D), out(T * H * D), xf, of;
  std::vector<uint8_t> act;
  char* hp = (char*)h.data_ptr();
  const char* cp = (const char*)cos.data_ptr();
  const char* sp = (const char*)sin.data_ptr();
  const auto norm_all = [&](const void* src, bool residual, const at::Tensor& w) {
    at::parallel_for(0, T, 4, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(hidden + 8);
      for (int64_t r = r0; r < r1; ++r) {
        const size_t off = (size_t)r * hidden * es;
        norm_row(isa, (const char*)src + off, residual ? hp + off : nullptr, residual ? hp + off : nullptr,
                 w.data_ptr(), (int)hidden, (float)eps, dtype, x.data() + off, buf.data());
      }
    });
  };
  for (int64_t l = 0; l < L; ++l) {
    const Projection* mm = &projections[4 * l];
    if (l == 0) norm_all(hp, false, norms[0]); else norm_all(d.data(), true, norms[2 * l]);
    linear_rows(mm[0], x.data(), T, dtype, isa, xf, of, act, qkv.data());
    char* kc = (char*)k_caches[l].data_ptr();
    char* vc = (char*)v_caches[l].data_ptr();
    at::parallel_for(0, T, 4, [&](int64_t r0, int64_t r1) {
      for (int64_t t = r0; t < r1; ++t) {
        char* row = qkv.data() + t * qkv_n * es;
        const char* c = cp + t * D * es;
        const char* s = sp + t * D * es;
        std::vector<float> head(D);
        for (int64_t j = 0; j < H + KV; ++j) {  // x * cos + cat(x2, x1) * signed sin (layers/rotary.py)
          char* hd = row + j * D * es;
          for (int64_t i = 0; i < D; ++i) head[i] = ld(hd, i, dtype);
          for (int64_t i = 0; i < D; ++i) {
            const float rot = head[i < D / 2 ? i + D / 2 : i - D / 2];
            const float p = to_dtype(head[i] * ld(c, i, dtype), dtype);
            const float q = to_dtype(rot * ld(s, i, dtype), dtype);
            st(hd, i, p + q, dtype);
          }
        }
        for (int64_t i = 0; i < H * D; ++i) qf[t * H * D + i] = ld(row, i, dtype);
        if (sl[t] >= 0) {
          std::memcpy(kc + sl[t] * slot_bytes, row + H * D * es, slot_bytes);
          std::memcpy(vc + sl[t] * slot_bytes, row + (H + KV) * D * es, slot_bytes);
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
    att.q = qf.data();
    att.out = out.data();
    run_attention(att, T, isa);
    for (int64_t i = 0; i < T * H * D; ++i) st(att_d.data(), i, out[i], dtype);
    linear_rows(mm[1], att_d.data(), T, dtype, isa, xf, of, act, o.data());
    norm_all(o.data(), true, norms[2 * l + 1]);
    linear_rows(mm[2], x.data(), T, dtype, isa, xf, of, act, gu.data());
    const int64_t I = mm[2].N / 2;
    at::parallel_for(0, T, 4, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(I + 8);
      for (int64_t r = r0; r < r1; ++r)
        silu_row(isa, gu.data() + r * 2 * I * es, gu.data() + (r * 2 + 1) * I * es, (int)I, dtype,
                 a.data() + r * I * es, buf.data());
    });
    linear_rows(mm[3], a.data(), T, dtype, isa, xf, of, act, d.data());
  }
  for (int64_t i = 0; i < T * hidden; ++i) st(hp, i, to_dtype(ld(d.data(), i, dtype) + ld(hp, i, dtype), dtype), dtype);
  return h;
}

std::vector<int64_t> isas() {
  std::vector<int64_t> found = {SCALAR};
#ifdef OPENTGI_WITH_AVX2
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    found.push_back(AVX2);
#endif
  return found;
}

at::Tensor isas_op() {
  const std::vector<int64_t> found = isas();
  at::Tensor t = at::empty({(int64_t)found.size()}, at::TensorOptions().dtype(at::kLong));
  for (size_t i = 0; i < found.size(); ++i) t.data_ptr<int64_t>()[i] = found[i];
  return t;
}

}  // namespace

TORCH_LIBRARY(opentgi, m) {
  m.def("gguf_mm(Tensor x, Tensor w, int qtype, int out_features, int isa, int passes=1) -> Tensor");
  m.def("isas() -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq, Tensor ctx, "
        "float scale, int window, float softcap, int isa) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int isa) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, int isa) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up, int isa) -> Tensor");
  m.def("decode_stack(Tensor h, Tensor cos, Tensor sin, Tensor[] weights, int[] qtypes, int[] passes, "
        "Tensor?[] biases, int[] parts, Tensor[] norms, Tensor[] k_caches, Tensor[] v_caches, Tensor slots, "
        "Tensor? tails, Tensor block_tables, Tensor seq, Tensor ctx, int num_heads, int num_kv_heads, float scale, "
        "int[] windows, float eps, int isa) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(opentgi, CPU, m) {
  m.impl("gguf_mm", gguf_mm);
  m.impl("paged_attention", paged_attention);
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("decode_stack", decode_stack);
}

TORCH_LIBRARY_IMPL(opentgi, CompositeExplicitAutograd, m) {
  m.impl("isas", isas_op);
}

}  // namespace opentgi
