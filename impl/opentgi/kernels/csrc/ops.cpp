// The torch ops: opentgi::gguf_mm(x, w, qtype, out_features, isa) -> x @ W.T, W the GGUF blocks of
// `qtype` (uint8 [N, row bytes], e.g. a view of the memory-mapped file), x float32 or bfloat16
// [M, K]. Activation rows are quantized by rows, then outputs are split among torch's intra-op
// threads by columns; each output is computed whole by one thread (common.h's invariant), so a
// row's bits depend neither on the other rows nor on the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "attention.h"
#include "common.h"
#include "layer_ops.h"

namespace opentgi {

#define OPENTGI_DECLARE(isa)                                                                         \
  void quantize_q8_##isa(const float*, int, ActQ8*);                                                 \
  void quantize_q8k_##isa(const float*, int, ActQ8K*);                                               \
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
  void matmul_iq4_xs_##isa(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);

OPENTGI_DECLARE(scalar)
#ifdef OPENTGI_WITH_AVX2
OPENTGI_DECLARE(avx2)
#endif

namespace {

enum Isa { SCALAR = 0, AVX2 = 1 };

struct Kernel {
  MatmulFn matmul;
  bool superblocks;  // K-quant: ActQ8K activations
  int block_values, block_bytes;
};

bool kernel_for(int64_t qtype, int64_t isa, Kernel* k) {
#define OPENTGI_PICK(fn) (isa == AVX2 ? AVX2_OR_NULL(fn) : fn##_scalar)
#ifdef OPENTGI_WITH_AVX2
#define AVX2_OR_NULL(fn) fn##_avx2
#else
#define AVX2_OR_NULL(fn) nullptr
#endif
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
    default: return false;
  }
  return k->matmul != nullptr;
}

void quantize_rows(const float* x, int64_t M, int K, bool superblocks, int64_t isa, uint8_t* act, size_t arb) {
  const auto one = [&](int64_t m) {
    const float* row = x + m * K;
    uint8_t* dst = act + m * arb;
#ifdef OPENTGI_WITH_AVX2
    if (isa == AVX2) {
      if (superblocks) quantize_q8k_avx2(row, K, (ActQ8K*)dst); else quantize_q8_avx2(row, K, (ActQ8*)dst);
      return;
    }
#endif
    if (superblocks) quantize_q8k_scalar(row, K, (ActQ8K*)dst); else quantize_q8_scalar(row, K, (ActQ8*)dst);
  };
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) one(m);
  });
}

at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t out_features, int64_t isa) {
  Kernel k;
  TORCH_CHECK(kernel_for(qtype, isa, &k), "opentgi::gguf_mm: no kernel for GGML type ", qtype, " on ISA ", isa);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "gguf_mm: x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gguf_mm: x float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % k.block_values == 0, "gguf_mm: K=", K, " is not a multiple of ", k.block_values);
  const int64_t row_bytes = K / k.block_values * k.block_bytes;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N * row_bytes,
              "gguf_mm: w must be contiguous uint8 holding ", N, " rows of ", row_bytes, " bytes");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out.to(x.scalar_type());
  const size_t arb = k.superblocks ? K / QK_K * sizeof(ActQ8K) : K / QK * sizeof(ActQ8);
  std::vector<uint8_t> act(M * arb);
  quantize_rows(xf.data_ptr<float>(), M, (int)K, k.superblocks, isa, act.data(), arb);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    k.matmul(wp, row_bytes, act.data(), arb, (int)M, (int)n0, (int)n1, (int)K, op, (int)N);
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
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
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type()
                  && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: k_cache and v_cache must be contiguous [blocks, block_size, kv_heads, D] alike");
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "paged_attention: cache float32, bfloat16 or float16");
  const int64_t rows = q.size(0), heads = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(bs >= 1 && bs <= 1024, "paged_attention: block size ", bs, " is not in 1..1024");
  TORCH_CHECK(k_cache.size(3) == D && kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 256,
              "paged_attention: heads must be a multiple (at most 256x) of the cache's kv heads, head_dim alike");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "paged_attention: block_tables must be contiguous int32 [seqs, width]");
  TORCH_CHECK(seq.scalar_type() == at::kInt && ctx.scalar_type() == at::kInt && seq.is_contiguous() && ctx.is_contiguous()
                  && seq.numel() == rows && ctx.numel() == rows,
              "paged_attention: seq and ctx must be contiguous int32 [rows]");
  const int64_t seqs = block_tables.size(0), width = block_tables.size(1);
  const int32_t* sp = seq.data_ptr<int32_t>();
  const int32_t* cp = ctx.data_ptr<int32_t>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {  // every block a row reads is one of the cache's
    TORCH_CHECK(sp[r] >= 0 && sp[r] < seqs, "paged_attention: row ", r, " names block table ", sp[r], " of ", seqs);
    TORCH_CHECK(cp[r] >= 1 && cp[r] <= width * bs, "paged_attention: row ", r, " has ", cp[r], " keys; its table holds ",
                width * bs);
    const int64_t lo = window > 0 && cp[r] > window ? cp[r] - window : 0;
    for (int64_t b = lo / bs; b * bs < cp[r]; ++b) {
      const int32_t id = tp[sp[r] * width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention: row ", r, " reads block ", id, " of ", num_blocks);
    }
  }
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows, heads, D}, q.options().dtype(at::kFloat));
  if (rows == 0) return out.to(q.scalar_type());
  PagedAttention a;
  a.q = qf.data_ptr<float>();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.kv_dtype = dt == at::kFloat ? KV_F32 : dt == at::kBFloat16 ? KV_BF16 : KV_F16;
  a.block_tables = tp;
  a.table_stride = width;
  a.seq = sp;
  a.ctx = cp;
  a.num_heads = (int)heads;
  a.num_kv_heads = (int)kv_heads;
  a.head_dim = (int)D;
  a.block_size = (int)bs;
  a.window = window > 0 ? (int)window : 0;
  a.scale = (float)scale;
  a.softcap = softcap > 0 ? (float)softcap : 0.0f;
  a.out = out.data_ptr<float>();
  // a row's kv heads in one item where the rows alone keep the threads busy (a block read once
  // for all its kv heads), else one item per (row, kv head): the same bits either way (attention.h)
  a.kv_heads_per_item = rows >= 2 * at::get_num_threads() ? (int)kv_heads : 1;
  const int64_t items = rows * (kv_heads / a.kv_heads_per_item);
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
#ifdef OPENTGI_WITH_AVX2
      if (isa == AVX2) {
        rms_norm_row_avx2(xp + off, rp ? rp + off : nullptr, sp ? sp + off : nullptr, wp, (int)n, (float)eps, dtype,
                          op + off, buf.data());
        continue;
      }
#endif
      rms_norm_row_scalar(xp + off, rp ? rp + off : nullptr, sp ? sp + off : nullptr, wp, (int)n, (float)eps, dtype,
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
#ifdef OPENTGI_WITH_AVX2
      if (isa == AVX2) {
        silu_mul_row_avx2(row, row + n * es, (int)n, dtype, op + (size_t)r * n * es, buf.data());
        continue;
      }
#endif
      silu_mul_row_scalar(row, row + n * es, (int)n, dtype, op + (size_t)r * n * es, buf.data());
    }
  });
  return out;
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
  m.def("gguf_mm(Tensor x, Tensor w, int qtype, int out_features, int isa) -> Tensor");
  m.def("isas() -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq, Tensor ctx, "
        "float scale, int window, float softcap, int isa) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int isa) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, int isa) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(opentgi, CPU, m) {
  m.impl("gguf_mm", gguf_mm);
  m.impl("paged_attention", paged_attention);
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
}

TORCH_LIBRARY_IMPL(opentgi, CompositeExplicitAutograd, m) {
  m.impl("isas", isas_op);
}

}  // namespace opentgi
