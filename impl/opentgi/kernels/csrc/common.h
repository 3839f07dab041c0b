// Shared by every kernel source: GGUF block layouts (ggml-common.h), the 8-bit activation blocks,
// and the signature each block family exports once per instruction-set variant.
//
// Invariant of every kernel: output (m, n) is the dot product of activation row m with weight row
// n, its blocks summed in one fixed order (block 0, 1, ... of the row), by the same instructions
// whatever the row count, the tile of rows it shares a weight load with, or the thread computing it.
// (A block's integer sum is exact, so where a wide kernel forms it two ways, int16 products for
// tiles of rows and byte halves for a tile of one or two, it is the same integer: the float
// instructions on it, which alone round, are the same.)
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

// The AVX-512 variant is the AVX2 code (OPENTGI_AVX2 holds in both) compiled with AVX-512's
// encodings (32 vector registers) plus, under OPENTGI_AVX512, wider or fused forms of the same
// integer arithmetic (VNNI's dot products, 512-bit lanes), exact as the AVX2 forms are: the same
// integers, then the same float instructions, so the same bits.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) \
    && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define OPENTGI_AVX2 1
#define OPENTGI_AVX512 1
#include <immintrin.h>
#define OPENTGI_ISA avx512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
// The AVX-VNNI variant: the AVX2 code with VNNI's 256-bit dot products where it sums bytes or int16
// pairs (dot_u8_add, madd_add, tiles.h pair_sums8): the same integers, so the same bits.
#define OPENTGI_AVX2 1
#define OPENTGI_AVXVNNI 1
#include <immintrin.h>
#define OPENTGI_ISA avxvnni
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define OPENTGI_AVX2 1
#include <immintrin.h>
#define OPENTGI_ISA avx2
#else
#define OPENTGI_ISA scalar
#endif

#define OPENTGI_CAT2(a, b) a##_##b
#define OPENTGI_CAT(a, b) OPENTGI_CAT2(a, b)
#define OPENTGI_FN(name) OPENTGI_CAT(name, OPENTGI_ISA)

namespace opentgi {

// Working memory that grows to the largest size asked of it and is never cleared, for buffers whose
// every element is written before it is read (a std::vector zeroes what it grows by, every time it
// grows again after a smaller size).
template <class T>
class Scratch {
 public:
  T* get(size_t n) {
    if (n > size_) {
      data_.reset(new T[n]);
      size_ = n;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<T[]> data_;
  size_t size_ = 0;
};

constexpr int QK = 32;     // values in a Q4_0 / Q4_1 / Q8_0 block
constexpr int QK_K = 256;  // values in a K-quant superblock

struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockIQ4_NL { uint16_t d; uint8_t qs[16]; };
struct BlockIQ4_XS { uint16_t d, scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };
struct BlockQ2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
struct BlockQ3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34, "ggml layout");
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24, "ggml layout");
static_assert(sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136, "ggml layout");
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110, "ggml layout");
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "ggml layout");

// Activations, per row: blocks of 32 int8 with their float scale and the exact sum of the
// quantized values (Q4_1's minimum term), or superblocks of 256 with sums per 16 (K-quants).
struct ActQ8 { float d; int32_t sum; float ds; int8_t qs[32]; };  // ds = d * (float)sum
struct ActQ8K { float d; int8_t qs[256]; int16_t bsums[16]; };

// Wide (16-bit) activations, the form `passes=2` asks for where a block type has a wide kernel:
// per block of 32 (Q4_0 / Q4_1 / Q8_0) int16 values |q| <= 32767 with one float scale and their exact sum
// (Q4_1's minimum term); per superblock of 256 (Q4_K / Q6_K) |q| <= 16383 with one float scale and
// the exact sums per 32 (Q4_K's mins term), and the same values split into bytes, q = 128 * hi + lo
// (hi in [-128, 127], lo in [0, 127], each with its sums per 16): a tile of one or two rows, where
// the weights are not reused enough to pay for their unpacking to int16, multiplies the weights'
// bytes by hi and by lo as the 8-bit kernels do (tiles.h exact_combine8). 16383 is what Q6_K's int32 lanes allow: its weights
// enter the products as (q - 32) * sc, |.| <= 32 * 128 = 4096, and an AVX2 lane adds 32 products of
// a superblock: 32 * 4096 * 16383 < 2^31 (Q4_K's q * sc <= 15 * 63 = 945 leaves more room). A
// superblock's total over its lanes may pass 2^31: the kernels add the lanes exactly (int64, or
// doubles holding integers) and round the total to float once.
constexpr int Q16_MAX = 32767;
constexpr int Q16K_MAX = 16383;
struct ActQ16 { float d; int32_t sum; int16_t qs[32]; };
// A row of K values: K / 256 ActQ16K, then K / 256 ActQ16KBytes (the byte halves apart, so that
// the int16 form reads only its own cache lines).
struct ActQ16K { float d; int32_t sums[8]; int16_t qs[256]; };
struct ActQ16KBytes { int8_t hi[256], lo[256]; int16_t bsums_hi[16], bsums_lo[16]; };
// A bfloat16 row as the bfloat16 kernels of Q4_0 and Q4_1 take it (blocks_bf16.cpp): per block of
// 32, the values' sum (float32, by quantize_bf16's tree) and the values as bfloat16 in pairs, pair k
// holding values 4 * (k / 2) + k % 2 and that + 2 (the even and odd halves of a 32-bit word).
struct ActBF16 { float sum; uint16_t v[32]; };

// Weight types by GGML id (gguf's GGMLQuantizationType).
enum QType { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14,
             Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q5_K = 13, IQ4_NL = 20, IQ4_XS = 23,
             F32 = 0, F16 = 1, BF16 = 30,  // the dense types (dense.cpp)
             // not GGML's: repacked by 16 rows (r16.h), 1000 + the file's type
             Q4_0_R16 = 1002, Q4_1_R16 = 1003, Q5_0_R16 = 1006, Q5_1_R16 = 1007, Q8_0_R16 = 1008, Q2_K_R16 = 1010,
             Q3_K_R16 = 1011, Q4_K_R16 = 1012, Q5_K_R16 = 1013, Q6_K_R16 = 1014, IQ4_NL_R16 = 1020, IQ4_XS_R16 = 1023 };

// bfloat16 is float32's upper half: exact
static inline float bf16_to_fp32(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float32 -> bfloat16, round to nearest even (NaN kept a NaN), as torch rounds
static inline uint16_t bf16_store(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

// float32 -> float16, round to nearest even (overflow to infinity, NaN kept a quiet NaN): the bits of
// F16C's _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT) and of torch's conversion
static inline uint16_t fp16_store(float f) {
#ifdef OPENTGI_AVX2
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return sign | 0x7E00u | (uint16_t)((x >> 13) & 0x3FFu);
  if (x >= 0x477FF000u) return sign | 0x7C00u;  // 65520 and up round to infinity
  if (x <= 0x33000000u) return sign;             // 2^-25 and below round to zero
  uint32_t m, shift;
  if (x >= 0x38800000u) {  // normal: rebias the exponent, drop 13 mantissa bits
    m = x - 0x38000000u;
    shift = 13;
  } else {  // subnormal: the significand with its hidden bit, in units of 2^-24
    m = (x & 0x7FFFFFu) | 0x800000u;
    shift = 126 - (x >> 23);
  }
  uint32_t h = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1u))) ++h;  // a carry moves into the exponent, as it should
  return sign | (uint16_t)h;
#endif
}

static inline float fp16_to_fp32(uint16_t h) {
#ifdef OPENTGI_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { mant <<= 1; ++e; } while (!(mant & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3FF) << 13);
    }
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// A tile's R activation rows (`stride` bytes apart from `act`) and its accumulators of each kind
// (floats or vectors), zeroed: the start of every block family's tile of rows.
template <typename A, int R, typename... V>
static inline void start_tile(const uint8_t* act, size_t stride, const A* (&a)[R], V (&... acc)[R]) {
  for (int r = 0; r < R; ++r) {
    a[r] = (const A*)(act + r * stride);
    ((acc[r] = V{}), ...);
  }
}

// out[m * ldo + n] for rows m < M and outputs n0 <= n < n1; w: the weight's rows of blocks
// (row_bytes each), act: M rows of activation blocks (act_row_bytes each).
typedef void (*MatmulFn)(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes,
                         int M, int n0, int n1, int K, float* out, int ldo);

// Each quantizes one row of K floats into activation blocks.
void OPENTGI_FN(quantize_q8)(const float* x, int K, ActQ8* out);
void OPENTGI_FN(quantize_q8k)(const float* x, int K, ActQ8K* out);
void OPENTGI_FN(quantize_q16)(const float* x, int K, ActQ16* out);
void OPENTGI_FN(quantize_q16k)(const float* x, int K, ActQ16K* out);
void OPENTGI_FN(quantize_bf16)(const float* x, int K, ActBF16* out);

void OPENTGI_FN(matmul_q4_0)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q4_1)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q8_0)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q4_k)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q6_k)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
// the same weights against wide activations (ActQ16 / ActQ16K)
void OPENTGI_FN(matmul_q4_0_wide)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q4_1_wide)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q8_0_wide)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q4_k_wide)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q6_k_wide)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
// Q4_K repacked by sixteen rows (r16.h), against ActQ8K and wide activations
void OPENTGI_FN(matmul_q4_k_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q4_k_wide_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(repack_words16)(const uint8_t* rows, size_t row_bytes, int nb, size_t block_bytes, uint8_t* group);
void OPENTGI_FN(repack_q6_k16)(const uint8_t* rows, size_t row_bytes, int nb, uint8_t* group);
// Q4_0, Q4_1 and Q8_0 repacked by sixteen rows (r16.h), against wide activations (ActQ16)
void OPENTGI_FN(matmul_q4_0_wide_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q4_1_wide_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q8_0_wide_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
// Q4_0 and Q4_1 repacked by sixteen rows (r16.h), against ActQ8 and bfloat16 rows
void OPENTGI_FN(matmul_q4_0_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q4_0_bf16_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q4_1_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q4_1_bf16_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
// Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q5_K, IQ4_NL and IQ4_XS repacked by sixteen rows (r16.h), against ActQ8 / ActQ8K
void OPENTGI_FN(matmul_q5_k_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q2_k_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q3_k_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q5_0_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q5_1_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q8_0_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_iq4_nl_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_iq4_xs_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
// Q4_0 / Q4_1 / Q6_K_R16 against bfloat16 rows (ActBF16)
void OPENTGI_FN(matmul_q4_0_bf16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q4_1_bf16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);
void OPENTGI_FN(matmul_q6_k_r16)(const uint8_t*, size_t, const uint8_t*, size_t, int, int, int, int, float*, int);

#ifdef OPENTGI_AVX2
// eight floats rounded to bfloat16 as bf16_store rounds them (to nearest even, NaN kept quiet), the
// bfloat16 bits in each lane's upper half (the lower half is not cleared)
static inline __m256i bf16_rounded8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
}
// bf16_store of eight floats into p[i .. i + 7]
static inline void store_bf16_8(void* p, int i, __m256 v) {
  const __m256i r = _mm256_srli_epi32(bf16_rounded8(v), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128((__m128i*)((uint16_t*)p + i), _mm256_castsi256_si128(packed));
}
static inline float hsum_ps(__m256 x) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
// s + the int32 lanes of x * y in unsigned by signed bytes, four products a lane: VNNI's one
// instruction in the AVX-512 and AVX-VNNI variants, maddubs then madd by ones in AVX2's. The same integers
// wherever maddubs' pairs stay within int16 (every caller bounds them).
static inline __m256i dot_u8_add(__m256i s, __m256i x, __m256i y) {
#ifdef OPENTGI_AVX512
  return _mm256_dpbusd_epi32(s, x, y);
#elif defined(OPENTGI_AVXVNNI)
  return _mm256_dpbusd_avx_epi32(s, x, y);
#else
  return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1)));
#endif
}
// s + madd(x, y) (pairs of int16 products into int32 lanes): VNNI's one instruction where present
static inline __m256i madd_add(__m256i s, __m256i x, __m256i y) {
#ifdef OPENTGI_AVX512
  return _mm256_dpwssd_epi32(s, x, y);
#elif defined(OPENTGI_AVXVNNI)
  return _mm256_dpwssd_avx_epi32(s, x, y);
#else
  return _mm256_add_epi32(s, _mm256_madd_epi16(x, y));
#endif
}

// 8 int32 sums of 4 products each: signed x signed bytes (|values| <= 127, no int16 overflow)
static inline __m256i dot_i8(__m256i x, __m256i y) {
  return dot_u8_add(_mm256_setzero_si256(), _mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}
// unsigned x signed bytes (x <= 63 here)
static inline __m256i dot_u8(__m256i x, __m256i y) { return dot_u8_add(_mm256_setzero_si256(), x, y); }
// 32 nibbles of 16 bytes: low nibbles first, then high ones (Q4_0 / Q4_1 value order)
static inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128((const __m128i*)qs);
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}
#endif

#ifdef OPENTGI_AVX2
// e^x, float32, ~1 ulp on [-87, 88] (Cephes' expf); flushes to 0 below -87.3
static inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#ifdef OPENTGI_AVX512
// exp256's arithmetic on sixteen lanes: the same bits lane by lane
static inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
// bf16_rounded8 on sixteen floats
static inline __m512i bf16_rounded16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
}
// bf16_store of sixteen floats into p[i .. i + 15]
static inline void store_bf16_16(void* p, int64_t i, __m512 v) {
  _mm256_storeu_si256((__m256i*)((uint16_t*)p + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded16(v), 16)));
}
// bfloat16 values i .. i + 15 as floats (exact)
static inline __m512 bf16x16(const void* p, int64_t i) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i))), 16));
}
// round_to(bfloat16) of sixteen floats
static inline __m512 round_bf16_16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_rounded16(v), _mm512_set1_epi32((int)0xFFFF0000u)));
}
#endif

// s[j] = exp(s[j] - m) for j < n (n rounded up to 8 is writable)
static inline void exp_shifted(float* s, int n, float m) {
  int j = 0;
#ifdef OPENTGI_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  for (; j < n; j += 8) _mm256_storeu_ps(s + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)));
#endif
  for (; j < n; ++j) s[j] = std::exp(s[j] - m);
}

}  // namespace opentgi
