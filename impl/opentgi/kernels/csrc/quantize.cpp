// Activations quantized per row from the row's own values: blocks of 32 (ActQ8) or superblocks of
// 256 (ActQ8K), scale amax / 127, values rounded to nearest (ties to even) and clamped to +-127;
// the wide forms (ActQ16, ActQ16K) the same way with amax / Q16_MAX (Q16K_MAX) and int16 values.
// A block holding NaN or Inf gets a NaN scale and zero values: its products come out NaN, never a
// crash and never a silently finite result.
#include <cfloat>
#include <cmath>
#include <cstring>

#include "common.h"

namespace opentgi {

static inline float block_scale(const float* x, int n, float* inv, float top = 127.0f) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    finite = finite && a <= FLT_MAX;
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    *inv = 0.0f;
    return NAN;
  }
  *inv = amax > 0.0f ? top / amax : 0.0f;
  return amax / top;
}

static inline int8_t to_q8(float v) {
  v = std::nearbyint(v);
  v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
  return (int8_t)(int)v;
}

static inline int16_t to_q16(float v, float top) {
  v = std::nearbyint(v);
  v = v > top ? top : (v < -top ? -top : v);
  return (int16_t)(int)v;
}

#ifdef OPENTGI_AVX512
// The largest magnitude of n values (a multiple of 16; a maximum: exact in any order), or false
// where one is NaN or Inf (block_scale's test)
static inline bool amax16(const float* v, int n, float* amax) {
  const __m512 top = _mm512_set1_ps(FLT_MAX);
  __m512 m = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  for (int i = 0; i < n; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(v + i));
    finite &= _mm512_cmp_ps_mask(a, top, _CMP_LE_OQ);
    m = _mm512_max_ps(m, a);
  }
  *amax = _mm512_reduce_max_ps(m);
  return finite == 0xFFFF;
}

// sixteen values times inv, rounded to nearest even (as nearbyint) and clamped to +-top, as int32
static inline __m512i rounded_lanes(const float* v, __m512 inv, int top) {
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v), inv));
  return _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-top)), _mm512_set1_epi32(top));
}

// One block of 32 as the scalar loop below quantizes it, sixteen values an instruction: the largest
// magnitude (a maximum: exact in any order), the same scale and reciprocal, each value's product
// rounded to nearest even by the conversion (MXCSR's default mode, as nearbyint) and clamped, and
// the exact sum of the integers. The wide blocks and the superblocks below take the same steps.
static inline void quantize_q8_block16(const float* v, ActQ8* out) {
  float amax;
  if (!amax16(v, QK, &amax)) {
    out->d = out->ds = NAN;  // NaN or Inf in the block: zero values (the scalar loop's, times a zero reciprocal)
    out->sum = 0;
    std::memset(out->qs, 0, QK);
    return;
  }
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  out->d = amax / 127.0f;
  const __m512 iv = _mm512_set1_ps(inv);
  const __m512i qa = rounded_lanes(v, iv, 127), qb = rounded_lanes(v + 16, iv, 127);
  _mm_storeu_si128((__m128i*)out->qs, _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128((__m128i*)(out->qs + 16), _mm512_cvtepi32_epi8(qb));
  out->sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  out->ds = out->d * (float)out->sum;
}

// One block of 32 as the scalar loop below quantizes it (quantize_q8_block16's steps, int16 values)
static inline void quantize_q16_block16(const float* v, ActQ16* out) {
  float amax;
  if (!amax16(v, QK, &amax)) {  // NaN or Inf in the block: zero values, a NaN scale
    out->d = NAN;
    out->sum = 0;
    std::memset(out->qs, 0, sizeof(out->qs));
    return;
  }
  const float inv = amax > 0.0f ? (float)Q16_MAX / amax : 0.0f;
  out->d = amax / (float)Q16_MAX;
  const __m512 iv = _mm512_set1_ps(inv);
  const __m512i qa = rounded_lanes(v, iv, Q16_MAX), qb = rounded_lanes(v + 16, iv, Q16_MAX);
  _mm256_storeu_si256((__m256i*)out->qs, _mm512_cvtepi32_epi16(qa));
  _mm256_storeu_si256((__m256i*)(out->qs + 16), _mm512_cvtepi32_epi16(qb));
  out->sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

// One superblock of 256 as the scalar loop below quantizes it: the int16 values and their sums by
// 32, then the byte halves (hi = q >> 7, lo = q & 127: q = 128 * hi + lo) and their sums by 16
static inline void quantize_q16k_block16(const float* v, ActQ16K* out, ActQ16KBytes* bytes) {
  float amax;
  const bool finite = amax16(v, QK_K, &amax);
  const float inv = finite && amax > 0.0f ? (float)Q16K_MAX / amax : 0.0f;
  out->d = finite ? amax / (float)Q16K_MAX : NAN;
  const __m512 iv = _mm512_set1_ps(inv);
  const __m512i low7 = _mm512_set1_epi32(127);
  for (int j = 0; j < 16; ++j) {  // sixteen values a step
    // (NaN or Inf in the superblock: zero values, as the scalar loop's products by a zero reciprocal)
    const __m512i q = finite ? rounded_lanes(v + 16 * j, iv, Q16K_MAX) : _mm512_setzero_si512();
    const __m512i hi = _mm512_srai_epi32(q, 7), lo = _mm512_and_si512(q, low7);
    _mm256_storeu_si256((__m256i*)(out->qs + 16 * j), _mm512_cvtepi32_epi16(q));
    _mm_storeu_si128((__m128i*)(bytes->hi + 16 * j), _mm512_cvtepi32_epi8(hi));
    _mm_storeu_si128((__m128i*)(bytes->lo + 16 * j), _mm512_cvtepi32_epi8(lo));
    bytes->bsums_hi[j] = (int16_t)_mm512_reduce_add_epi32(hi);
    bytes->bsums_lo[j] = (int16_t)_mm512_reduce_add_epi32(lo);
    const int32_t s = _mm512_reduce_add_epi32(q);
    if (j % 2 == 0) out->sums[j / 2] = s;
    else out->sums[j / 2] += s;
  }
}

// One superblock of 256 as the scalar loop below quantizes it: the values (clamped to +-127) and
// their sums by 16
static inline void quantize_q8k_block16(const float* v, ActQ8K* out) {
  float amax;
  const bool finite = amax16(v, QK_K, &amax);
  const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
  out->d = finite ? amax / 127.0f : NAN;
  const __m512 iv = _mm512_set1_ps(inv);
  for (int j = 0; j < 16; ++j) {  // (NaN or Inf in the superblock: zero values, as in quantize_q16k_block16)
    const __m512i q = finite ? rounded_lanes(v + 16 * j, iv, 127) : _mm512_setzero_si512();
    _mm_storeu_si128((__m128i*)(out->qs + 16 * j), _mm512_cvtepi32_epi8(q));
    out->bsums[j] = (int16_t)_mm512_reduce_add_epi32(q);
  }
}
#endif

void OPENTGI_FN(quantize_q8)(const float* x, int K, ActQ8* out) {
  for (int b = 0; b < K / QK; ++b) {
#ifdef OPENTGI_AVX512
    quantize_q8_block16(x + b * QK, out + b);
#else
    const float* v = x + b * QK;
    float inv;
    out[b].d = block_scale(v, QK, &inv);
    int32_t sum = 0;
    for (int i = 0; i < QK; ++i) {
      out[b].qs[i] = to_q8(v[i] * inv);
      sum += out[b].qs[i];
    }
    out[b].sum = sum;
    out[b].ds = out[b].d * (float)sum;
#endif
  }
}

void OPENTGI_FN(quantize_q8k)(const float* x, int K, ActQ8K* out) {
  for (int b = 0; b < K / QK_K; ++b) {
#ifdef OPENTGI_AVX512
    quantize_q8k_block16(x + b * QK_K, out + b);
#else
    const float* v = x + b * QK_K;
    float inv;
    out[b].d = block_scale(v, QK_K, &inv);
    for (int i = 0; i < QK_K; ++i) out[b].qs[i] = to_q8(v[i] * inv);
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += out[b].qs[16 * j + i];
      out[b].bsums[j] = (int16_t)s;
    }
#endif
  }
}


void OPENTGI_FN(quantize_q16)(const float* x, int K, ActQ16* out) {
  for (int b = 0; b < K / QK; ++b) {
#ifdef OPENTGI_AVX512
    quantize_q16_block16(x + b * QK, out + b);
#else
    const float* v = x + b * QK;
    float inv;
    out[b].d = block_scale(v, QK, &inv, (float)Q16_MAX);
    int32_t sum = 0;
    for (int i = 0; i < QK; ++i) {
      out[b].qs[i] = to_q16(v[i] * inv, (float)Q16_MAX);
      sum += out[b].qs[i];
    }
    out[b].sum = sum;
#endif
  }
}

void OPENTGI_FN(quantize_q16k)(const float* x, int K, ActQ16K* out) {
  ActQ16KBytes* bytes = (ActQ16KBytes*)(out + K / QK_K);
  for (int b = 0; b < K / QK_K; ++b) {
#ifdef OPENTGI_AVX512
    quantize_q16k_block16(x + b * QK_K, out + b, bytes + b);
#else
    const float* v = x + b * QK_K;
    float inv;
    out[b].d = block_scale(v, QK_K, &inv, (float)Q16K_MAX);
    for (int i = 0; i < QK_K; ++i) out[b].qs[i] = to_q16(v[i] * inv, (float)Q16K_MAX);
    for (int j = 0; j < 8; ++j) {
      int32_t s = 0;
      for (int i = 0; i < 32; ++i) s += out[b].qs[32 * j + i];
      out[b].sums[j] = s;
    }
    for (int i = 0; i < QK_K; ++i) {  // q = 128 * hi + lo
      const int q = out[b].qs[i];
      bytes[b].hi[i] = (int8_t)((q - (q & 127)) / 128);
      bytes[b].lo[i] = (int8_t)(q & 127);
    }
    for (int j = 0; j < 16; ++j) {
      int sh = 0, sl = 0;
      for (int i = 0; i < 16; ++i) {
        sh += bytes[b].hi[16 * j + i];
        sl += bytes[b].lo[16 * j + i];
      }
      bytes[b].bsums_hi[j] = (int16_t)sh;
      bytes[b].bsums_lo[j] = (int16_t)sl;
    }
#endif
  }
}

}  // namespace opentgi
