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

#if defined(OPENTGI_AVX512) || defined(OPENTGI_AVX2)
// The vector variants quantize W values an instruction by the scalar loops' arithmetic: the
// largest magnitude (a maximum: exact in any order), the same scale and reciprocal, each value's
// product rounded to nearest even by the conversion (MXCSR's default mode, as nearbyint) and
// clamped, and exact integer sums; so every variant gives the same bits.
#define OPENTGI_VECTOR_QUANTIZE
namespace lanes {
#ifdef OPENTGI_AVX512
constexpr int W = 16;
using I = __m512i;
// the largest magnitude of n values (a multiple of W), or false where one is NaN or Inf (block_scale's test)
static inline bool amax(const float* v, int n, float* out) {
  const __m512 top = _mm512_set1_ps(FLT_MAX);
  __m512 m = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  for (int i = 0; i < n; i += W) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(v + i));
    finite &= _mm512_cmp_ps_mask(a, top, _CMP_LE_OQ);
    m = _mm512_max_ps(m, a);
  }
  *out = _mm512_reduce_max_ps(m);
  return finite == 0xFFFF;
}
// W values times inv, rounded and clamped to +-top, as int32
static inline I rounded(const float* v, float inv, int top) {
  const I q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v), _mm512_set1_ps(inv)));
  return _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-top)), _mm512_set1_epi32(top));
}
static inline I zero() { return _mm512_setzero_si512(); }
static inline I add(I a, I b) { return _mm512_add_epi32(a, b); }
static inline int32_t sum(I q) { return _mm512_reduce_add_epi32(q); }
static inline I high(I q) { return _mm512_srai_epi32(q, 7); }  // q >> 7 (q = 128 * high + low)
static inline I low(I q) { return _mm512_and_si512(q, _mm512_set1_epi32(127)); }
static inline void store8(int8_t* p, I q) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(q)); }
static inline void store16(int16_t* p, I q) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(q)); }
#else
constexpr int W = 8;
using I = __m256i;
static inline bool amax(const float* v, int n, float* out) {
  const __m256 top = _mm256_set1_ps(FLT_MAX), sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  int finite = 0xFF;
  for (int i = 0; i < n; i += W) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i));
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, top, _CMP_LE_OQ));
    m = _mm256_max_ps(m, a);
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  *out = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  return finite == 0xFF;
}
static inline I rounded(const float* v, float inv, int top) {
  const I q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), _mm256_set1_ps(inv)));
  return _mm256_min_epi32(_mm256_max_epi32(q, _mm256_set1_epi32(-top)), _mm256_set1_epi32(top));
}
static inline I zero() { return _mm256_setzero_si256(); }
static inline I add(I a, I b) { return _mm256_add_epi32(a, b); }
static inline int32_t sum(I q) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}
static inline I high(I q) { return _mm256_srai_epi32(q, 7); }
static inline I low(I q) { return _mm256_and_si256(q, _mm256_set1_epi32(127)); }
// (the values are clamped, so the saturating packs keep them)
static inline __m128i words(I q) { return _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)); }
static inline void store8(int8_t* p, I q) { const __m128i w = words(q); _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(w, w)); }
static inline void store16(int16_t* p, I q) { _mm_storeu_si128((__m128i*)p, words(q)); }
#endif
}  // namespace lanes

// One block of 32 (ActQ8: top 127, int8 values; ActQ16: Q16_MAX, int16) as the scalar loops
// quantize it; a block with NaN or Inf gets a NaN scale and zero values (the scalar loops' products
// by a zero reciprocal).
template <class Block, int Top>
static inline void quantize_block(const float* v, Block* out) {
  float amax;
  if (!lanes::amax(v, QK, &amax)) {
    std::memset(out->qs, 0, sizeof(out->qs));
    out->d = NAN;
    out->sum = 0;
    if constexpr (Top == 127) ((ActQ8*)out)->ds = NAN;
    return;
  }
  const float inv = amax > 0.0f ? (float)Top / amax : 0.0f;
  out->d = amax / (float)Top;
  lanes::I total = lanes::zero();
  for (int i = 0; i < QK; i += lanes::W) {
    const lanes::I q = lanes::rounded(v + i, inv, Top);
    if constexpr (Top == 127) lanes::store8((int8_t*)out->qs + i, q);
    else lanes::store16((int16_t*)out->qs + i, q);
    total = lanes::add(total, q);
  }
  out->sum = lanes::sum(total);
  if constexpr (Top == 127) ((ActQ8*)out)->ds = out->d * (float)out->sum;
}

// One superblock of 256 as the scalar loops quantize it: ActQ8K's values (clamped to +-127) and
// their sums by 16; or (bytes given) ActQ16K's int16 values and their sums by 32, then the byte
// halves (hi = q >> 7, lo = q & 127: q = 128 * hi + lo) and their sums by 16
template <class Super, int Top>
static inline void quantize_super(const float* v, Super* out, ActQ16KBytes* bytes = nullptr) {
  float amax;
  const bool finite = lanes::amax(v, QK_K, &amax);
  const float inv = finite && amax > 0.0f ? (float)Top / amax : 0.0f;
  out->d = finite ? amax / (float)Top : NAN;
  int32_t s16 = 0, hi16 = 0, lo16 = 0;  // the running sums of the current 16 values
  for (int i = 0; i < QK_K; i += lanes::W) {
    const lanes::I q = finite ? lanes::rounded(v + i, inv, Top) : lanes::zero();
    s16 += lanes::sum(q);
    if constexpr (Top == 127) {
      lanes::store8(((ActQ8K*)out)->qs + i, q);
    } else {
      const lanes::I hi = lanes::high(q), lo = lanes::low(q);
      lanes::store16(((ActQ16K*)out)->qs + i, q);
      lanes::store8(bytes->hi + i, hi);
      lanes::store8(bytes->lo + i, lo);
      hi16 += lanes::sum(hi);
      lo16 += lanes::sum(lo);
    }
    if ((i + lanes::W) % 16 != 0) continue;
    if constexpr (Top == 127) {
      ((ActQ8K*)out)->bsums[i / 16] = (int16_t)s16;
    } else {
      bytes->bsums_hi[i / 16] = (int16_t)hi16;
      bytes->bsums_lo[i / 16] = (int16_t)lo16;
      if (i % 32 < 16) ((ActQ16K*)out)->sums[i / 32] = s16;
      else ((ActQ16K*)out)->sums[i / 32] += s16;
    }
    s16 = hi16 = lo16 = 0;
  }
}
#endif

void OPENTGI_FN(quantize_q8)(const float* x, int K, ActQ8* out) {
  for (int b = 0; b < K / QK; ++b) {
#ifdef OPENTGI_VECTOR_QUANTIZE
    quantize_block<ActQ8, 127>(x + b * QK, out + b);
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
#ifdef OPENTGI_VECTOR_QUANTIZE
    quantize_super<ActQ8K, 127>(x + b * QK_K, out + b);
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
#ifdef OPENTGI_VECTOR_QUANTIZE
    quantize_block<ActQ16, Q16_MAX>(x + b * QK, out + b);
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
#ifdef OPENTGI_VECTOR_QUANTIZE
    quantize_super<ActQ16K, Q16K_MAX>(x + b * QK_K, out + b, bytes + b);
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
