// Fused per-row layer ops (layer_ops.h): RMSNorm with an optional residual add before it, and
// SiLU- and GELU(tanh)-and-multiply. Each row is computed on its own, its sums in one fixed order and every value
// through the same instructions wherever it sits in the row, so a row's bits depend only on the
// row (and the ISA).
#include <cmath>
#include <cstring>
#include <limits>

#include "attention.h"
#include "common.h"
#include "layer_ops.h"

namespace opentgi {

namespace {

static inline float round_to(float f, int dtype) {
  return dtype == ROW_BF16 ? bf16_to_fp32(bf16_store(f)) : f;
}

static inline float load(const void* p, int64_t i, int dtype) {
  return dtype == ROW_BF16 ? bf16_to_fp32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void store(void* p, int64_t i, float f, int dtype) {
  if (dtype == ROW_BF16) ((uint16_t*)p)[i] = bf16_store(f); else ((float*)p)[i] = f;
}

#ifdef OPENTGI_AVX2
// round_to(bfloat16) of eight floats
static inline __m256 round_bf16_8(__m256 v) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_rounded8(v), _mm256_set1_epi32((int)0xFFFF0000u)));
}
// bfloat16 values i .. i + 7 as floats (exact)
static inline __m256 bf16x8(const void* p, int i) {
  const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// sum of squares of n floats, in one fixed order for a given n
static inline float sum_squares(const float* x, int n) {
  int i = 0;
#ifdef OPENTGI_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 32 <= n; i += 32) {
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    const __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
    a1 = _mm256_fmadd_ps(x1, x1, a1);
    a2 = _mm256_fmadd_ps(x2, x2, a2);
    a3 = _mm256_fmadd_ps(x3, x3, a3);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 x0 = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
  }
  float s = hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
  float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) p[j] += x[i + j] * x[i + j];
  float s = (p[0] + p[1]) + (p[2] + p[3]);
#endif
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// silu(g) in place over n floats (n rounded up to 8 writable): every value the same instructions
static inline void silu_inplace(float* g, int n) {
#ifdef OPENTGI_AVX2
  int i = 0;
#ifdef OPENTGI_AVX512  // sixteen values a step, then eight: the same instructions a value
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_storeu_ps(g + i, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
  }
#endif
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
    _mm256_storeu_ps(g + i, _mm256_div_ps(x, _mm256_add_ps(one, e)));
  }
#else
  for (int i = 0; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i]));
#endif
}

// gelu_tanh(g) in place over n floats (n rounded up to 8 writable), as g / (1 + exp(-2 c (g + k g^3)))
static inline void gelu_tanh_inplace(float* g, int n) {
  const float k = 0.044715f, c2 = -1.5957691216057308f;  // -2 sqrt(2 / pi)
#ifdef OPENTGI_AVX2
  int i = 0;
#ifdef OPENTGI_AVX512
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 inner = _mm512_add_ps(x, _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(k), x), x), x));
    const __m512 e = exp512(_mm512_mul_ps(_mm512_set1_ps(c2), inner));
    _mm512_storeu_ps(g + i, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
  }
#endif
  const __m256 one = _mm256_set1_ps(1.0f), kk = _mm256_set1_ps(k), cc = _mm256_set1_ps(c2);
  for (; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 inner = _mm256_add_ps(x, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(kk, x), x), x));
    const __m256 e = exp256(_mm256_mul_ps(cc, inner));
    _mm256_storeu_ps(g + i, _mm256_div_ps(x, _mm256_add_ps(one, e)));
  }
#else
  for (int i = 0; i < n; ++i) {
    const float x = g[i];
    g[i] = x / (1.0f + std::exp(c2 * (x + k * x * x * x)));
  }
#endif
}

template <void (*ACT)(float*, int)>
static inline void act_mul_row(const void* gate, const void* up, int n, int dtype, void* out, float* buf) {
  int i = 0;
#ifdef OPENTGI_AVX2
#ifdef OPENTGI_AVX512
  if (dtype == ROW_BF16)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(buf + i, bf16x16(gate, i));
#endif
  if (dtype == ROW_BF16)  // the loops below, eight values a step (the same conversions and products)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, bf16x8(gate, i));
#endif
  for (; i < n; ++i) buf[i] = load(gate, i, dtype);
  for (i = n; i < (n + 7) / 8 * 8; ++i) buf[i] = 0.0f;
  ACT(buf, n);
  i = 0;
#ifdef OPENTGI_AVX2
#ifdef OPENTGI_AVX512
  if (dtype == ROW_BF16)
    for (; i + 16 <= n; i += 16)
      store_bf16_16(out, i, _mm512_mul_ps(round_bf16_16(_mm512_loadu_ps(buf + i)), bf16x16(up, i)));
#endif
  if (dtype == ROW_BF16)
    for (; i + 8 <= n; i += 8) store_bf16_8(out, i, _mm256_mul_ps(round_bf16_8(_mm256_loadu_ps(buf + i)), bf16x8(up, i)));
#endif
  for (; i < n; ++i) store(out, i, round_to(buf[i], dtype) * load(up, i, dtype), dtype);
}

}  // namespace

void OPENTGI_FN(rms_norm_row)(const void* x, const void* residual, void* sum, const void* weight, bool weight_f32,
                              int n, float eps, int dtype, void* out, float* buf) {
  int i = 0;
#ifdef OPENTGI_AVX2
#ifdef OPENTGI_AVX512
  if (dtype == ROW_BF16)
    for (; i + 16 <= n; i += 16) {
      __m512 v = bf16x16(x, i);
      if (residual != nullptr) {
        v = round_bf16_16(_mm512_add_ps(v, bf16x16(residual, i)));
        store_bf16_16(sum, i, v);
      }
      _mm512_storeu_ps(buf + i, v);
    }
#endif
  if (dtype == ROW_BF16)  // the loops below, eight values a step (the same sums, roundings and products)
    for (; i + 8 <= n; i += 8) {
      __m256 v = bf16x8(x, i);
      if (residual != nullptr) {
        v = round_bf16_8(_mm256_add_ps(v, bf16x8(residual, i)));
        store_bf16_8(sum, i, v);
      }
      _mm256_storeu_ps(buf + i, v);
    }
#endif
  for (; i < n; ++i) {
    float v = load(x, i, dtype);
    if (residual != nullptr) {
      v = round_to(v + load(residual, i, dtype), dtype);  // the residual stream, in its own dtype
      store(sum, i, v, dtype);
    }
    buf[i] = v;
  }
  const float rstd = 1.0f / std::sqrt(sum_squares(buf, n) / (float)n + eps);
  i = 0;
  if (weight_f32) {
    const float* w = (const float*)weight;
#ifdef OPENTGI_AVX2
#ifdef OPENTGI_AVX512
    if (dtype == ROW_BF16)
      for (; i + 16 <= n; i += 16)
        store_bf16_16(out, i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(buf + i), _mm512_set1_ps(rstd)),
                                            _mm512_loadu_ps(w + i)));
#endif
    if (dtype == ROW_BF16)
      for (; i + 8 <= n; i += 8)
        store_bf16_8(out, i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(buf + i), _mm256_set1_ps(rstd)),
                                           _mm256_loadu_ps(w + i)));
#endif
    for (; i < n; ++i) store(out, i, buf[i] * rstd * w[i], dtype);
  } else {
#ifdef OPENTGI_AVX2
#ifdef OPENTGI_AVX512
    if (dtype == ROW_BF16)
      for (; i + 16 <= n; i += 16)
        store_bf16_16(out, i, _mm512_mul_ps(round_bf16_16(_mm512_mul_ps(_mm512_loadu_ps(buf + i), _mm512_set1_ps(rstd))),
                                            bf16x16(weight, i)));
#endif
    if (dtype == ROW_BF16)
      for (; i + 8 <= n; i += 8)
        store_bf16_8(out, i, _mm256_mul_ps(round_bf16_8(_mm256_mul_ps(_mm256_loadu_ps(buf + i), _mm256_set1_ps(rstd))),
                                           bf16x8(weight, i)));
#endif
    for (; i < n; ++i) store(out, i, round_to(buf[i] * rstd, dtype) * load(weight, i, dtype), dtype);
  }
}

void OPENTGI_FN(silu_mul_row)(const void* gate, const void* up, int n, int dtype, void* out, float* buf) {
  act_mul_row<silu_inplace>(gate, up, n, dtype, out, buf);
}

void OPENTGI_FN(gelu_tanh_mul_row)(const void* gate, const void* up, int n, int dtype, void* out, float* buf) {
  act_mul_row<gelu_tanh_inplace>(gate, up, n, dtype, out, buf);
}


void OPENTGI_FN(weighted_add_row)(float* acc, const float* y, float w, int n, int dtype) {
  int i = 0;
#ifdef OPENTGI_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(acc + i), v = _mm256_loadu_ps(y + i);
    const __m256 p = dtype == ROW_BF16 ? round_bf16_8(_mm256_mul_ps(round_bf16_8(v), wv)) : _mm256_mul_ps(v, wv);
    _mm256_storeu_ps(acc + i, _mm256_add_ps(a, p));
  }
#endif
  for (; i < n; ++i) acc[i] += round_to(round_to(y[i], dtype) * w, dtype);
}


void OPENTGI_FN(router_logits_row)(const float* x, const float* w, int n, int E, float* logits) {
  for (int e = 0; e < E; ++e) {
    const float* we = w + (size_t)e * n;
    alignas(64) float p[16] = {0};  // the sixteen running sums
    int i = 0;
#ifdef OPENTGI_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(we + i)));
    _mm512_store_ps(p, acc);
#elif defined(OPENTGI_AVX2)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(we + i)));
      hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(we + i + 8)));
    }
    _mm256_store_ps(p, lo);
    _mm256_store_ps(p + 8, hi);
#else
    for (; i + 16 <= n; i += 16)
      for (int j = 0; j < 16; ++j) p[j] += x[i + j] * we[i + j];
#endif
    float s = 0.0f;
    for (int j = 0; j < 16; ++j) s += p[j];
    for (; i < n; ++i) s += x[i] * we[i];
    logits[e] = s;
  }
}

void OPENTGI_FN(rope_row)(void* x, const void* cos, const void* sin, int D, int dtype, float* buf) {
  int i = 0;
#ifdef OPENTGI_AVX2
  if (dtype == ROW_BF16)
    for (; i + 8 <= D; i += 8) _mm256_storeu_ps(buf + i, bf16x8(x, i));
#endif
  for (; i < D; ++i) buf[i] = load(x, i, dtype);
  const int half = D / 2;
  i = 0;
#ifdef OPENTGI_AVX512
  if (half % 16 == 0 && dtype == ROW_BF16) {  // sixteen values a step, none straddling the halves
    for (; i < D; i += 16) {
      const __m512 h = _mm512_loadu_ps(buf + i), rot = _mm512_loadu_ps(buf + (i < half ? i + half : i - half));
      store_bf16_16(x, i, _mm512_add_ps(round_bf16_16(_mm512_mul_ps(h, bf16x16(cos, i))),
                                        round_bf16_16(_mm512_mul_ps(rot, bf16x16(sin, i)))));
    }
  }
#endif
#ifdef OPENTGI_AVX2
  if (half % 8 == 0 && i < D) {  // eight values a step, none of them straddling the halves
    for (; i < D; i += 8) {
      const __m256 h = _mm256_loadu_ps(buf + i), rot = _mm256_loadu_ps(buf + (i < half ? i + half : i - half));
      if (dtype == ROW_BF16) {
        const __m256 c = bf16x8(cos, i), s = bf16x8(sin, i);
        store_bf16_8(x, i, _mm256_add_ps(round_bf16_8(_mm256_mul_ps(h, c)), round_bf16_8(_mm256_mul_ps(rot, s))));
      } else {
        const __m256 c = _mm256_loadu_ps((const float*)cos + i), s = _mm256_loadu_ps((const float*)sin + i);
        _mm256_storeu_ps((float*)x + i, _mm256_add_ps(_mm256_mul_ps(h, c), _mm256_mul_ps(rot, s)));
      }
    }
  }
#endif
  for (; i < D; ++i) {
    const float rot = buf[i < half ? i + half : i - half];
    store(x, i, round_to(buf[i] * load(cos, i, dtype), dtype) + round_to(rot * load(sin, i, dtype), dtype), dtype);
  }
}

int64_t OPENTGI_FN(argmax_row)(const float* x, int n, int dtype) {
  int i = 0;
  int64_t best = 0;
  float top = -std::numeric_limits<float>::infinity();
#ifdef OPENTGI_AVX2
  if (n >= 8) {  // lane j: the first index of its largest among i = j mod 8 (strictly larger replaces)
    __m256 lane_top = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan = _mm256_setzero_ps();
    __m256i lane_at = _mm256_setzero_si256(), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    for (; i + 8 <= n; i += 8) {
      __m256 v = _mm256_loadu_ps(x + i);
      if (dtype == ROW_BF16) v = round_bf16_8(v);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 up = _mm256_cmp_ps(v, lane_top, _CMP_GT_OQ);
      lane_top = _mm256_blendv_ps(lane_top, v, up);
      lane_at = _mm256_blendv_epi8(lane_at, at, _mm256_castps_si256(up));
      at = _mm256_add_epi32(at, step);
    }
    if (_mm256_movemask_ps(nan) != 0) {  // the first NaN, in order
      for (int j = 0; j < i; ++j)
        if (std::isnan(round_to(x[j], dtype))) return j;
    }
    alignas(32) float tops[8];
    alignas(32) int32_t ats[8];
    _mm256_store_ps(tops, lane_top);
    _mm256_store_si256((__m256i*)ats, lane_at);
    best = ats[0], top = tops[0];
    for (int j = 1; j < 8; ++j)
      if (tops[j] > top || (tops[j] == top && ats[j] < best)) best = ats[j], top = tops[j];
  }
#endif
  for (; i < n; ++i) {
    const float v = round_to(x[i], dtype);
    if (std::isnan(v)) return i;
    if (v > top || i == 0) best = i, top = v;
  }
  return best;
}

void OPENTGI_FN(kv_store_row)(void* dst, int kv_dtype, const void* src, int dtype, int n) {
  if ((kv_dtype == KV_F32 && dtype == ROW_F32) || (kv_dtype == KV_BF16 && dtype == ROW_BF16)) {
    std::memcpy(dst, src, (size_t)n * (dtype == ROW_F32 ? 4 : 2));
    return;
  }
  int i = 0;
  if (kv_dtype == KV_F16) {
    uint16_t* out = (uint16_t*)dst;
#ifdef OPENTGI_AVX512
    if (dtype == ROW_F32)
      for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i*)(out + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps((const float*)src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
#ifdef OPENTGI_AVX2
    if (dtype == ROW_F32)
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps((const float*)src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; ++i) out[i] = fp16_store(load(src, i, dtype));
  } else if (kv_dtype == KV_BF16) {
    uint16_t* out = (uint16_t*)dst;
#ifdef OPENTGI_AVX2
    if (dtype == ROW_F32) {  // bf16_store's bits, eight (sixteen) at a time
#ifdef OPENTGI_AVX512
      for (; i + 16 <= n; i += 16) store_bf16_16(out, i, _mm512_loadu_ps((const float*)src + i));
#endif
      for (; i + 8 <= n; i += 8) store_bf16_8(out, i, _mm256_loadu_ps((const float*)src + i));
    }
#endif
    for (; i < n; ++i) out[i] = bf16_store(load(src, i, dtype));
  } else {
#ifdef OPENTGI_AVX2
#ifdef OPENTGI_AVX512
    if (dtype == ROW_BF16)
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps((float*)dst + i, bf16x16(src, i));
#endif
    if (dtype == ROW_BF16)  // bfloat16 is float32's upper half: exact
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i*)((float*)dst + i),
                            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)src + i))), 16));
#endif
    for (; i < n; ++i) ((float*)dst)[i] = load(src, i, dtype);
  }
}

}  // namespace opentgi
