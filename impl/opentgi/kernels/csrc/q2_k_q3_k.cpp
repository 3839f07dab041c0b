// Q2_K (w = d * sc * q - dmin * m, q 2 bits, 16 sub-blocks of 16 with 4-bit sc and m) and Q3_K
// (w = d * (sc - 32) * (q - 4), q 2 bits in qs plus a third in hmask, 16 sub-blocks of 16 with
// 6-bit sc) against ActQ8K. The weights go into maddubs unsigned (0..3, 0..7: pairs far under
// int16's limit); Q2_K's minimum (sum_k m_k * bsum_k) and Q3_K's -4 offset (4 * sum_k sc_k *
// bsum_k) are subtracted exactly from the bsums, so each superblock gives exact integer sums and
// both paths add the same floats per superblock in superblock order: AVX2 and scalar agree bit for
// bit, and a row's bits never depend on the other rows.
#include <type_traits>

#include "tiles.h"

namespace opentgi {
namespace {

struct BlockQ2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
struct BlockQ3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110, "ggml layout");

// Q3_K's 16 six-bit scales, 0..63 (ggml's kmask1 / kmask2 unpacking); the multipliers are these - 32
static inline void q3_scales(const uint8_t* s, uint32_t* aux) {
  std::memcpy(aux, s, 12);
  const uint32_t tmp = aux[2], m4 = 0x0F0F0F0F, m2 = 0x03030303;
  aux[2] = ((aux[0] >> 4) & m4) | (((tmp >> 4) & m2) << 4);
  aux[3] = ((aux[1] >> 4) & m4) | (((tmp >> 6) & m2) << 4);
  aux[0] = (aux[0] & m4) | ((tmp & m2) << 4);
  aux[1] = (aux[1] & m4) | (((tmp >> 2) & m2) << 4);
}

template <bool Q3>
struct TileLowBit {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    using Block = std::conditional_t<Q3, BlockQ3_K, BlockQ2_K>;
    const Block* w = (const Block*)wr;
    const ActQ8K* a[R];
    float acc[R], accm[R];
    for (int r = 0; r < R; ++r) {
      a[r] = (const ActQ8K*)(act + r * stride);
      acc[r] = accm[r] = 0.0f;
    }
    for (int b = 0; b < K / QK_K; ++b) {
      const Block& x = w[b];
      const float d = fp16_to_fp32(x.d);
#ifdef OPENTGI_AVX2
      __m256i sc, mn;  // 16 int16: each sub-block's multiplier and (Q2_K) minimum
      if constexpr (Q3) {
        uint32_t aux[4];
        q3_scales(x.scales, aux);
        sc = _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_loadu_si128((const __m128i*)aux), _mm_set1_epi8(32)));
        mn = sc;
      } else {
        const __m128i raw = _mm_loadu_si128((const __m128i*)x.scales), m4 = _mm_set1_epi8(0x0F);
        sc = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
        mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
      }
      // scales of values 32c .. 32c + 31: sub-block 2c's in the low lane, 2c + 1's in the high one
      const __m256i pick = _mm256_set_epi8(3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                           1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
      __m256i q[8], s[8];  // values 32c .. 32c + 31 of the superblock (0..3 or 0..7), their scales
      const __m256i m3 = _mm256_set1_epi8(0x03), m1 = _mm256_set1_epi8(0x01);
      __m256i hm = _mm256_setzero_si256();
      if constexpr (Q3) hm = _mm256_loadu_si256((const __m256i*)x.hmask);
      for (int h = 0; h < 2; ++h) {
        const __m256i bits = _mm256_loadu_si256((const __m256i*)(x.qs + 32 * h));
        for (int t = 0; t < 4; ++t) {
          const int c = 4 * h + t;
          q[c] = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * t), m3);
          if constexpr (Q3)
            q[c] = _mm256_or_si256(q[c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, c), m1), 2));
          s[c] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc, _mm256_set1_epi32(c)), pick);
        }
      }
#else
      int16_t sc[16], mn[16];  // multiplier and (Q2_K) minimum of each sub-block of 16
      if constexpr (Q3) {
        uint32_t aux[4];
        q3_scales(x.scales, aux);
        for (int k = 0; k < 16; ++k) sc[k] = mn[k] = (int16_t)(((const uint8_t*)aux)[k] - 32);
      } else {
        for (int k = 0; k < 16; ++k) sc[k] = x.scales[k] & 0x0F, mn[k] = x.scales[k] >> 4;
      }
      uint8_t q[QK_K];
      for (int h = 0; h < 2; ++h) {
        for (int t = 0; t < 4; ++t) {
          for (int l = 0; l < 32; ++l) {
            const int v = 128 * h + 32 * t + l;
            q[v] = (x.qs[32 * h + l] >> (2 * t)) & 3;
            if constexpr (Q3) q[v] |= ((x.hmask[l] >> (4 * h + t)) & 1) << 2;
          }
        }
      }
#endif
      for (int r = 0; r < R; ++r) {
        const ActQ8K& y = a[r][b];
        int32_t total = 0, offset = 0;  // Q2_K: sum_k m_k * bsum_k; Q3_K: sum_k sc_k * bsum_k
#ifdef OPENTGI_AVX2
        offset = hsum_i32(_mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i*)y.bsums)));
        __m256i sum = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i p = _mm256_maddubs_epi16(q[c], _mm256_loadu_si256((const __m256i*)(y.qs + 32 * c)));
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, s[c]));
        }
        total = hsum_i32(sum);
#else
        for (int k = 0; k < 16; ++k) offset += (int32_t)mn[k] * y.bsums[k];
        for (int k = 0; k < 16; ++k) {
          int32_t t = 0;
          for (int i = 0; i < 16; ++i) t += q[16 * k + i] * y.qs[16 * k + i];
          total += sc[k] * t;
        }
#endif
        if constexpr (Q3) {
          total -= 4 * offset;
          acc[r] += (d * y.d) * (float)total;
        } else {
          acc[r] += (d * y.d) * (float)total;
          accm[r] += (fp16_to_fp32(((const BlockQ2_K&)x).dmin) * y.d) * (float)offset;
        }
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = Q3 ? acc[r] : acc[r] - accm[r];
  }
};

}  // namespace

void OPENTGI_FN(matmul_q2_k)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<TileLowBit<false>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q3_k)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<TileLowBit<true>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

}  // namespace opentgi
