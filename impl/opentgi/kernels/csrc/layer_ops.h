// Fused per-row layer ops, one row a call, float32 or bfloat16 rows (values computed in float32 and
// rounded to the row's dtype where torch's unfused composition rounds them).
#pragma once
#include <cstdint>

namespace opentgi {

enum RowDtype { ROW_F32 = 0, ROW_BF16 = 1 };

// out = RMSNorm(s) * weight, s = x (+ residual, then stored to `sum`, when residual is not null):
// rstd = 1 / sqrt(mean(s^2) + eps) in float32; with a weight in the row dtype, s * rstd rounded to
// the dtype, times the weight in the dtype (models/layers/norm.py's RMSNorm); with a float32 weight
// (weight_f32, Gemma's 1 + w), s * rstd * weight in float32, rounded once (GemmaRMSNorm). out may be
// x itself. buf: n floats.
void rms_norm_row_scalar(const void* x, const void* residual, void* sum, const void* weight, bool weight_f32, int n,
                         float eps, int dtype, void* out, float* buf);
void rms_norm_row_avx2(const void* x, const void* residual, void* sum, const void* weight, bool weight_f32, int n,
                       float eps, int dtype, void* out, float* buf);
void rms_norm_row_avx512(const void* x, const void* residual, void* sum, const void* weight, bool weight_f32, int n,
                         float eps, int dtype, void* out, float* buf);

// out = silu(gate) * up: silu in float32 rounded to the dtype, the product in the dtype.
// buf: n rounded up to 8 floats.
void silu_mul_row_scalar(const void* gate, const void* up, int n, int dtype, void* out, float* buf);
void silu_mul_row_avx2(const void* gate, const void* up, int n, int dtype, void* out, float* buf);
void silu_mul_row_avx512(const void* gate, const void* up, int n, int dtype, void* out, float* buf);

// out = gelu_tanh(gate) * up (GeGLU: Gemma), gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715
// g^3))) computed as g / (1 + exp(-2 sqrt(2 / pi) (g + 0.044715 g^3))): in float32 rounded to the
// dtype, the product in the dtype. buf: n rounded up to 8 floats.
void gelu_tanh_mul_row_scalar(const void* gate, const void* up, int n, int dtype, void* out, float* buf);
void gelu_tanh_mul_row_avx2(const void* gate, const void* up, int n, int dtype, void* out, float* buf);
void gelu_tanh_mul_row_avx512(const void* gate, const void* up, int n, int dtype, void* out, float* buf);

// One head's D values (the row dtype, in place) rotated by halves as models/layers/rotary.py does:
// x * cos + cat(x2, x1) * sin (sin signed: its first half negated), each product rounded to the
// dtype, then their sum. cos, sin: D values of the dtype. buf: D floats.
void rope_row_scalar(void* x, const void* cos, const void* sin, int D, int dtype, float* buf);
void rope_row_avx2(void* x, const void* cos, const void* sin, int D, int dtype, float* buf);
void rope_row_avx512(void* x, const void* cos, const void* sin, int D, int dtype, float* buf);

// acc[i] += y[i] * w for n float32 values (a routed expert's output weighted into its token's sum),
// as torch computes it in the dtype: float32, y * w then the add; bfloat16, y rounded to bfloat16,
// times w rounded to bfloat16, then added in float32. The same bits in both variants.
void weighted_add_row_scalar(float* acc, const float* y, float w, int n, int dtype);
void weighted_add_row_avx2(float* acc, const float* y, float w, int n, int dtype);
void weighted_add_row_avx512(float* acc, const float* y, float w, int n, int dtype);

// The router's logits of one token (moe_route): logits[e] = x . w_e over E rows of w (float32
// [E, n]), each summed in one fixed order: sixteen running sums (value i into sum i % 16, each
// product rounded, then added), those added in order, then the tail. The same bits in every variant.
void router_logits_row_scalar(const float* x, const float* w, int n, int E, float* logits);
void router_logits_row_avx2(const float* x, const float* w, int n, int E, float* logits);
void router_logits_row_avx512(const float* x, const float* w, int n, int E, float* logits);

// A token's keys or values (n values of the row dtype) stored into the KV cache's row in the
// cache's dtype (attention.h's KvDtype): copied as they are where the dtypes agree, else rounded to
// nearest even (float16: F16C's conversion in the AVX2 variant, the same bits in the scalar one), as
// torch's `.to(cache dtype)` stores them on the module path.
void kv_store_row_scalar(void* dst, int kv_dtype, const void* src, int dtype, int n);
void kv_store_row_avx2(void* dst, int kv_dtype, const void* src, int dtype, int n);
void kv_store_row_avx512(void* dst, int kv_dtype, const void* src, int dtype, int n);

// The first index of the largest of n float32 values as rounded to the row dtype (a row of logits
// as the LM head returns them), or of the first NaN where there is one: numpy's argmax of the
// rounded row. The same index in both variants.
int64_t argmax_row_scalar(const float* x, int n, int dtype);
int64_t argmax_row_avx2(const float* x, int n, int dtype);
int64_t argmax_row_avx512(const float* x, int n, int dtype);

}  // namespace opentgi
