// The torch ops: opentgi::gguf_mm(x, w, qtype, out_features, isa) -> x @ W.T, W the GGUF blocks of
// `qtype` (uint8 [N, row bytes], e.g. a view of the memory-mapped file), x float32 or bfloat16
// [M, K]. Activation rows are quantized by rows, then outputs are split among torch's intra-op
// threads by columns; each output is computed whole by one thread (common.h's invariant), so a
// row's bits depend neither on the other rows nor on the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "common.h"

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
}

TORCH_LIBRARY_IMPL(opentgi, CPU, m) {
  m.impl("gguf_mm", gguf_mm);
}

TORCH_LIBRARY_IMPL(opentgi, CompositeExplicitAutograd, m) {
  m.impl("isas", isas_op);
}

}  // namespace opentgi
