// Fused per-row layer ops, one row a call, float32 or bfloat16 rows (values computed in float32 and
// rounded to the row's dtype where torch's unfused composition rounds them).
#pragma once
#include <cstdint>

namespace opentgi {

enum RowDtype { ROW_F32 = 0, ROW_BF16 = 1 };

// out = RMSNorm(s) * weight, s = x (+ residual, then stored to `sum`, when residual is not null):
// rstd = 1 / sqrt(mean(s^2) + eps) in float32, s * rstd rounded to the dtype, times the weight in
// the dtype (models/layers/norm.py's RMSNorm). buf: n floats.
void rms_norm_row_scalar(const void* x, const void* residual, void* sum, const void* weight, int n, float eps,
                         int dtype, void* out, float* buf);
void rms_norm_row_avx2(const void* x, const void* residual, void* sum, const void* weight, int n, float eps,
                       int dtype, void* out, float* buf);

// out = silu(gate) * up: silu in float32 rounded to the dtype, the product in the dtype.
// buf: n rounded up to 8 floats.
void silu_mul_row_scalar(const void* gate, const void* up, int n, int dtype, void* out, float* buf);
void silu_mul_row_avx2(const void* gate, const void* up, int n, int dtype, void* out, float* buf);

}  // namespace opentgi
