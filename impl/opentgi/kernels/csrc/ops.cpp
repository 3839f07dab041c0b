// The torch ops: opentgi::gguf_mm(x, w, qtype, out_features, isa, passes) -> x @ W.T, W the GGUF
// blocks of `qtype` (uint8 [N, row bytes], e.g. a view of the memory-mapped file), x float32 or
// bfloat16 [M, K]. Activation rows are quantized by rows (in one or two passes: matmul.h), then
// outputs are split among torch's intra-op threads by columns; each output is computed whole by
// one thread (common.h's invariant), so a row's bits depend neither on the other rows nor on the
// thread count. The grouped-experts ops are moe_ops.cpp's, the decode stack stack.cpp's.
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

#include "common.h"
#include "matmul.h"
#include "op_helpers.h"
#include "r16.h"

namespace opentgi {
namespace {

at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t out_features, int64_t isa,
                   int64_t passes) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "gguf_mm: x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gguf_mm: x float32 or bfloat16");
  const Matmul mm = make_matmul(w, qtype, out_features, x.size(1), isa, "gguf_mm", passes,
                                x.scalar_type() == at::kBFloat16);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  Scratch<uint8_t> act;
  run_matmul(mm, xf.data_ptr<float>(), x.size(0), isa, out.data_ptr<float>(), act);
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

std::vector<int64_t> isas();  // the ISA variants this CPU runs (below)

// Rows [N, row bytes] of a type repacked by sixteen rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
// Q5_K, Q6_K, IQ4_NL, IQ4_XS) into their groups of sixteen (r16.h: *_R16), or (back) those groups into rows: the same
// bytes, moved
at::Tensor repack_by_16_rows(const at::Tensor& w, int64_t qtype, int64_t N, int64_t K, bool back) {
  int64_t values = QK, block_bytes = 0;
  switch (qtype) {
    case Q4_0: block_bytes = sizeof(BlockQ4_0); break;
    case Q4_1: block_bytes = sizeof(BlockQ4_1); break;
    case Q5_0: block_bytes = sizeof(BlockQ5_0); break;
    case Q5_1: block_bytes = sizeof(BlockQ5_1); break;
    case Q8_0: block_bytes = sizeof(BlockQ8_0); break;
    case IQ4_NL: block_bytes = sizeof(BlockIQ4_NL); break;
    case IQ4_XS: values = QK_K, block_bytes = sizeof(BlockIQ4_XS); break;
    case Q2_K: values = QK_K, block_bytes = sizeof(BlockQ2_K); break;
    case Q3_K: values = QK_K, block_bytes = sizeof(BlockQ3_K); break;
    case Q5_K: values = QK_K, block_bytes = sizeof(BlockQ5_K); break;
    case Q4_K: values = QK_K, block_bytes = sizeof(BlockQ4_K); break;
    case Q6_K: values = QK_K, block_bytes = sizeof(BlockQ6_K); break;
    default:
      TORCH_CHECK(false, "repack_by_16_rows: GGML type ", qtype,
                  " is not Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS");
  }
  TORCH_CHECK(K > 0 && K % values == 0 && N > 0 && N % 16 == 0, "repack_by_16_rows: N must be a multiple of 16 and K of ",
              values, ", not ", N, " and ", K);
  const int64_t row_bytes = K / values * block_bytes;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N * row_bytes,
              "repack_by_16_rows: w must be contiguous uint8 holding ", N, " rows of ", row_bytes, " bytes");
  at::Tensor out = at::empty({N, row_bytes}, w.options());
  uint8_t* src = (uint8_t*)w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int nb = (int)(K / values);
  auto words = repack_words16_scalar;  // forward: the AVX-512 variant's transposition where it runs
  auto q6k = repack_q6_k16_scalar;
#ifdef OPENTGI_WITH_AVX512
  const std::vector<int64_t> found = isas();
  if (std::find(found.begin(), found.end(), (int64_t)AVX512) != found.end()) {
    words = repack_words16_avx512;
    q6k = repack_q6_k16_avx512;
  }
#endif
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const size_t at = (size_t)g * 16 * row_bytes;
      if (back) r16_group<true>(dst + at, row_bytes, nb, block_bytes, src + at);
      else if (qtype == Q6_K) q6k(src + at, row_bytes, nb, dst + at);
      else if (block_bytes % 16 == 0) words(src + at, row_bytes, nb, block_bytes, dst + at);
      else r16_group<false>(src + at, row_bytes, nb, block_bytes, dst + at);  // the others: word by word
    }
  });
  return out;
}

}  // namespace

// a row's kv heads in one item where the rows alone keep the threads busy (a block read once for
// all its kv heads), else one item per (row, kv head): the same bits either way (attention.h)
static int kv_heads_per_item(int64_t rows, int64_t kv_heads) {
  return rows >= 2 * at::get_num_threads() ? (int)kv_heads : 1;
}

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
  a.kv_heads_per_item = kv_heads_per_item(rows, kv_heads);
  return a;
}

// Each row's visible blocks in splits (attention.h), every (split, kv head chunk) a work item among
// torch's intra-op threads; then each row of several splits gets its heads' splits combined in split
// order: max of the running maxima, then the sums and accumulators rescaled and added, then divided.
// (The AVX-512 variant holds the matmuls, this decode attention and the row ops: prompt attention
// runs AVX2's on an AVX-512 CPU.)
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
#ifdef OPENTGI_WITH_AVX512
    if (isa == AVX512) {
      paged_attention_avx512(a, i0, i1, buf.data());
      return;
    }
#endif
#ifdef OPENTGI_WITH_AVX2
    if (isa >= AVX2) {
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

namespace {

// opentgi::paged_attention (attention.h): q [rows, heads, D] float32 or bfloat16, the caches
// [blocks, block_size, kv_heads, D] float32, bfloat16 or float16, block_tables int32 [seqs, width],
// seq and ctx int32 [rows] -> [rows, heads, D] in q's dtype. Work items (a row's kv heads, or one of
// them) are split among torch's intra-op threads, each computed whole by one thread.
// q as float32, the float32 output and the kernel's arguments, after the checks both attention
// ops share
struct AttentionCall {
  at::Tensor qf, out;
  PagedAttention a;
};

AttentionCall attention_call(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& ctx,
                             double scale, int64_t window, double softcap, int64_t isa, const char* op) {
  TORCH_CHECK(isa == SCALAR
#ifdef OPENTGI_WITH_AVX2
                  || isa == AVX2
#endif
#ifdef OPENTGI_WITH_AVXVNNI
                  || isa == AVXVNNI
#endif
#ifdef OPENTGI_WITH_AVX512
                  || isa == AVX512
#endif
              , op, ": no kernel for ISA ", isa);
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu(), op, ": q must be a 3-D CPU tensor");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, op, ": q float32 or bfloat16");
  const int64_t rows = q.size(0), heads = q.size(1), D = q.size(2);
  AttentionCall c;
  c.qf = q.to(at::kFloat).contiguous();
  c.out = at::empty({rows, heads, D}, q.options().dtype(at::kFloat));
  c.a = attention_args(k_cache, v_cache, block_tables, seq, ctx, rows, heads, D, window, scale, softcap, op);
  c.a.q = c.qf.data_ptr<float>();
  c.a.out = c.out.data_ptr<float>();
  return c;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& ctx,
                           double scale, int64_t window, double softcap, int64_t isa) {
  AttentionCall c = attention_call(q, k_cache, v_cache, block_tables, seq, ctx, scale, window, softcap, isa,
                                   "paged_attention");
  const int64_t rows = q.size(0);
  if (rows == 0) return c.out.to(q.scalar_type());
  run_attention(c.a, rows, isa);
  return q.scalar_type() == at::kFloat ? c.out : c.out.to(q.scalar_type());
}

// opentgi::prompt_attention (attention.h): paged_attention's arguments and result, prompt rows in
// their own form (run_prompt_attention).
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& ctx,
                            double scale, int64_t window, double softcap, int64_t isa) {
  AttentionCall c = attention_call(q, k_cache, v_cache, block_tables, seq, ctx, scale, window, softcap, isa,
                                   "prompt_attention");
  const int64_t rows = q.size(0);
  if (rows == 0) return c.out.to(q.scalar_type());
  run_prompt_attention(c.a, rows, isa);
  return q.scalar_type() == at::kFloat ? c.out : c.out.to(q.scalar_type());
}

}  // namespace

AttentionForms attention_forms(const bool* prompt, const PagedAttention& a, int64_t rows) {
  AttentionForms f;
  for (int64_t t = 0; t < rows; ++t) {
    const int form = prompt[t] ? 1 : 0;
    f.rows[form].push_back(t);
    f.seq[form].push_back(a.seq[t]);
    f.ctx[form].push_back(a.ctx[t]);
  }
  return f;
}

// as the modules' NativeAttentionBackend calls the two kernels on these rows
void run_attention_forms(const PagedAttention& all, const AttentionForms& forms, int64_t isa) {
  const int64_t width = (int64_t)all.num_heads * all.head_dim;
  for (int form = 0; form < 2; ++form) {
    const std::vector<int64_t>& taken = forms.rows[form];
    const int64_t n = (int64_t)taken.size();
    if (n == 0) continue;
    std::vector<float> q(n * width), out(n * width);
    for (int64_t i = 0; i < n; ++i) std::memcpy(q.data() + i * width, all.q + taken[i] * width, width * sizeof(float));
    PagedAttention a = all;
    a.seq = forms.seq[form].data();
    a.ctx = forms.ctx[form].data();
    a.q = q.data();
    a.out = out.data();
    if (form == 1) {
      run_prompt_attention(a, n, isa);
    } else {
      a.kv_heads_per_item = kv_heads_per_item(n, a.num_kv_heads);
      run_attention(a, n, isa);
    }
    for (int64_t i = 0; i < n; ++i) std::memcpy(all.out + taken[i] * width, out.data() + i * width, width * sizeof(float));
  }
}

// Rows cut into tiles (runs of one sequence at consecutive contexts), work items (a tile's kv head)
// split among torch's intra-op threads, each computed whole by one thread.
void run_prompt_attention(const PagedAttention& a, int64_t rows, int64_t isa) {
  std::vector<int32_t> tiles;
  for (int64_t r = 0; r < rows;) {
    int64_t n = 1;
    while (n < PROMPT_TILE_ROWS && r + n < rows && a.seq[r + n] == a.seq[r] && a.ctx[r + n] == a.ctx[r] + n) ++n;
    tiles.push_back((int32_t)r);
    tiles.push_back((int32_t)n);
    r += n;
  }
  const int64_t items = (int64_t)tiles.size() / 2 * a.num_kv_heads, scratch = prompt_attention_scratch(a);
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(scratch);
#ifdef OPENTGI_WITH_AVX2
    if (isa >= AVX2) {
      prompt_attention_avx2(a, tiles.data(), i0, i1, buf.data());
      return;
    }
#endif
    prompt_attention_scalar(a, tiles.data(), i0, i1, buf.data());
  });
}

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
#ifdef OPENTGI_WITH_AVXVNNI
                  || isa == AVXVNNI
#endif
#ifdef OPENTGI_WITH_AVX512
                  || isa == AVX512
#endif
              , op, ": no kernel for ISA ", isa);
}

// a layer op (layer_ops.h) on the ISA's variant: AVX-512's, AVX2's (AVX-VNNI's too) or the scalar one
#if defined(OPENTGI_WITH_AVX512)
#define ROW_OP(name, ...) \
  (isa == AVX512 ? name##_avx512(__VA_ARGS__) : isa >= AVX2 ? name##_avx2(__VA_ARGS__) : name##_scalar(__VA_ARGS__))
#elif defined(OPENTGI_WITH_AVX2)
#define ROW_OP(name, ...) (isa >= AVX2 ? name##_avx2(__VA_ARGS__) : name##_scalar(__VA_ARGS__))
#else
#define ROW_OP(name, ...) name##_scalar(__VA_ARGS__)
#endif

void norm_row(int64_t isa, const void* x, const void* residual, void* sum, const void* weight, bool weight_f32, int n,
              float eps, int dtype, void* out, float* buf) {
  ROW_OP(rms_norm_row, x, residual, sum, weight, weight_f32, n, eps, dtype, out, buf);
}

void act_row(int64_t isa, int act, const void* gate, const void* up, int n, int dtype, void* out, float* buf) {
  if (act == ACT_GELU_TANH) ROW_OP(gelu_tanh_mul_row, gate, up, n, dtype, out, buf);
  else ROW_OP(silu_mul_row, gate, up, n, dtype, out, buf);
}

void weighted_row(int64_t isa, float* acc, const float* y, float w, int n, int dtype) {
  ROW_OP(weighted_add_row, acc, y, w, n, dtype);
}

void router_logits(int64_t isa, const float* x, const float* w, int n, int E, float* logits) {
  ROW_OP(router_logits_row, x, w, n, E, logits);
}

void rope(int64_t isa, void* x, const void* cos, const void* sin, int D, int dtype, float* buf) {
  ROW_OP(rope_row, x, cos, sin, D, dtype, buf);
}

void kv_row(int64_t isa, void* dst, int kv_dtype, const void* src, int dtype, int n) {
  ROW_OP(kv_store_row, dst, kv_dtype, src, dtype, n);
}

int64_t argmax_of(int64_t isa, const float* x, int n, int dtype) { return ROW_OP(argmax_row, x, n, dtype); }

void argmax_rows(int64_t isa, const float* x, int64_t M, int64_t N, int64_t n, int dtype, int64_t* out) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) out[m] = argmax_of(isa, x + m * N, (int)n, dtype);
  });
}

namespace {

// opentgi::argmax_rows: float32 x [M, N] -> int64 [M], each row's argmax_of over its first n values
// as rounded to bfloat16 (bf16) or as they are
at::Tensor argmax_rows_op(const at::Tensor& x, int64_t n, bool bf16, int64_t isa) {
  check_isa(isa, "argmax_rows");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && n >= 1 && n <= x.size(1), "argmax_rows: x float32 "
              "[rows, N] and 1 <= n <= N");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  argmax_rows(isa, xc.data_ptr<float>(), x.size(0), x.size(1), n, bf16 ? ROW_BF16 : ROW_F32, out.data_ptr<int64_t>());
  return out;
}

// Fused layer ops (layer_ops.h), rows split among torch's intra-op threads, each row by one thread.
// The norm's weight: [n] for every row, or [R, n] with row r taking weight r % R (q's and k's heads
// normed per head, each with its own weight: models/layers/norm.py's HeadsNorm); in x's dtype, or
// float32 (applied in float32, rounded once: GemmaRMSNorm's 1 + w).
std::tuple<at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                             const at::Tensor& weight, double eps, int64_t isa) {
  check_isa(isa, "rms_norm");
  const int dtype = row_dtype(x, "rms_norm");
  const int64_t n = x.size(-1);
  const int64_t rows = n ? x.numel() / n : 0;
  const int64_t period = weight.dim() == 2 ? weight.size(0) : 1;
  TORCH_CHECK((weight.dim() == 1 || (weight.dim() == 2 && period >= 1 && rows % period == 0)) && weight.size(-1) == n
                  && (weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat),
              "rms_norm: weight [", n, "] or [R, ", n, "] (R dividing the rows) in x's dtype or float32");
  const bool weight_f32 = weight.scalar_type() == at::kFloat;
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor rc, sum;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "add_rms_norm: residual of x's shape and dtype");
    rc = residual->contiguous();
    sum = at::empty(xc.sizes(), xc.options());
  }
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  const size_t es = xc.element_size(), wes = wc.element_size();
  const char* xp = (const char*)xc.data_ptr();
  const char* rp = rc.defined() ? (const char*)rc.data_ptr() : nullptr;
  char* sp = sum.defined() ? (char*)sum.data_ptr() : nullptr;
  char* op = (char*)out.data_ptr();
  const char* wp = (const char*)wc.data_ptr();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n + 8);
    for (int64_t r = r0; r < r1; ++r) {
      const size_t off = (size_t)r * n * es;
      norm_row(isa, xp + off, rp ? rp + off : nullptr, sp ? sp + off : nullptr, wp + (r % period) * n * wes,
               weight_f32, (int)n, (float)eps, dtype, op + off, buf.data());
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

at::Tensor act_mul(const at::Tensor& gate_up, int act, int64_t isa, const char* name) {
  check_isa(isa, name);
  const int dtype = row_dtype(gate_up, name);
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, name,
              ": the last dim holds gate then up, of one size");
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
      act_row(isa, act, row, row + n * es, (int)n, dtype, op + (size_t)r * n * es, buf.data());
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t isa) { return act_mul(gate_up, ACT_SILU, isa, "silu_mul"); }

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up, int64_t isa) {
  return act_mul(gate_up, ACT_GELU_TANH, isa, "gelu_tanh_mul");
}

// x [rows, heads, D] rotated by its rows' cos and signed sin ([rows, D], x's dtype): rope_row per head
at::Tensor rope_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t isa) {
  check_isa(isa, "rope");
  const int dtype = row_dtype(x, "rope");
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0)
                  && cos.size(1) == x.size(2) && cos.scalar_type() == x.scalar_type()
                  && sin.scalar_type() == x.scalar_type(),
              "rope: x [rows, heads, D], cos and sin [rows, D] in x's dtype");
  at::Tensor out = x.contiguous().clone();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  const int64_t heads = x.size(1), D = x.size(2);
  const size_t es = x.element_size();
  char* op = (char*)out.data_ptr();
  at::parallel_for(0, x.size(0), 4, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(D + 8);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t h = 0; h < heads; ++h)
        rope(isa, op + (size_t)(r * heads + h) * D * es, (const char*)c.data_ptr() + r * D * es,
             (const char*)s.data_ptr() + r * D * es, (int)D, dtype, buf.data());
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
#ifdef OPENTGI_WITH_AVXVNNI
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")
      && __builtin_cpu_supports("avxvnni"))
    found.push_back(AVXVNNI);
#endif
#ifdef OPENTGI_WITH_AVX512
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
      && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
    found.push_back(AVX512);
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
  m.def("argmax_rows(Tensor x, int n, bool bf16, int isa) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq, Tensor ctx, "
        "float scale, int window, float softcap, int isa) -> Tensor");
  m.def("prompt_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq, Tensor ctx, "
        "float scale, int window, float softcap, int isa) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int isa) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, int isa) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up, int isa) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up, int isa) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, int isa) -> Tensor");
  m.def("repack_by_16_rows(Tensor w, int qtype, int N, int K, bool back=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(opentgi, CPU, m) {
  m.impl("gguf_mm", gguf_mm);
  m.impl("argmax_rows", argmax_rows_op);
  m.impl("paged_attention", paged_attention);
  m.impl("prompt_attention", prompt_attention);
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("gelu_tanh_mul", gelu_tanh_mul);
  m.impl("rope", rope_op);
  m.impl("repack_by_16_rows", repack_by_16_rows);
}

TORCH_LIBRARY_IMPL(opentgi, CompositeExplicitAutograd, m) {
  m.impl("isas", isas_op);
}

}  // namespace opentgi
