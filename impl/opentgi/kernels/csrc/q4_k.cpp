// Q4_K (w = d * sc * q - dmin * m, 8 sub-blocks of 32 with 6-bit sc and m) against ActQ8K.
// Per superblock the integer sums are exact (sum_j sc_j * dot_j and sum_j m_j * sum_j(q_x)), so
// both paths add the same two floats per superblock, in superblock order: AVX2 and scalar agree
// bit for bit, and AVX2 computes eight outputs at once (one float lane each) by exactly that
// arithmetic, the scale and min unpacking, float16 scales and mins sums shared by the eight.
#include <cstddef>

#include "tiles.h"

namespace opentgi {
namespace {

struct TileQ4K {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const BlockQ4_K* w = (const BlockQ4_K*)wr;
    const ActQ8K* a[R];
    float acc[R], accm[R];
    for (int r = 0; r < R; ++r) {
      a[r] = (const ActQ8K*)(act + r * stride);
      acc[r] = accm[r] = 0.0f;
    }
    for (int b = 0; b < K / QK_K; ++b) {
      const BlockQ4_K& x = w[b];
      const float d = fp16_to_fp32(x.d), dmin = fp16_to_fp32(x.dmin);
      uint8_t sc[8], mn[8];
      scales_mins(x.scales, sc, mn);
#ifdef OPENTGI_AVX2
      __m256i lo[4], hi[4];
      const __m256i mask = _mm256_set1_epi8(0x0F);
      for (int j = 0; j < 4; ++j) {
        const __m256i bits = _mm256_loadu_si256((const __m256i*)(x.qs + 32 * j));
        lo[j] = _mm256_and_si256(bits, mask);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), mask);
      }
#endif
      for (int r = 0; r < R; ++r) {
        const ActQ8K& y = a[r][b];
        int32_t total = 0, mins = 0;
        for (int j = 0; j < 8; ++j) mins += (int32_t)mn[j] * (y.bsums[2 * j] + y.bsums[2 * j + 1]);
#ifdef OPENTGI_AVX2
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          const __m256i pl = _mm256_maddubs_epi16(lo[j], _mm256_loadu_si256((const __m256i*)(y.qs + 64 * j)));
          const __m256i ph = _mm256_maddubs_epi16(hi[j], _mm256_loadu_si256((const __m256i*)(y.qs + 64 * j + 32)));
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pl, _mm256_set1_epi16(sc[2 * j])));
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(ph, _mm256_set1_epi16(sc[2 * j + 1])));
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        total = _mm_cvtsi128_si32(s4);
#else
        for (int j = 0; j < 4; ++j) {
          int32_t sl = 0, sh = 0;
          for (int i = 0; i < 32; ++i) {
            sl += (x.qs[32 * j + i] & 0x0F) * y.qs[64 * j + i];
            sh += (x.qs[32 * j + i] >> 4) * y.qs[64 * j + 32 + i];
          }
          total += sc[2 * j] * sl + sc[2 * j + 1] * sh;
        }
#endif
        acc[r] += (d * y.d) * (float)total;
        accm[r] += (dmin * y.d) * (float)mins;
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = acc[r] - accm[r];
  }

#ifdef OPENTGI_AVX2
  // Eight weight rows (row_bytes apart) at once against R activation rows, output c in float lane c
  // by run<R>'s arithmetic (out[r * ldo + c]): the superblock's exact total and mins of each row
  // come out in column order (reduce8, mins_dot8), then the same two float products per superblock.
  // int32 holds them: |total| <= 8 * 63 * 32 * 15 * 127 < 2^25, |mins| <= 8 * 63 * 4064 < 2^22.
  static constexpr bool has_run8 = true;
  template <int R>
  static inline void run8(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                          float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ8K* a[R];
    __m256 acc[R], accm[R];
    for (int r = 0; r < R; ++r) {
      a[r] = (const ActQ8K*)(act + r * stride);
      acc[r] = accm[r] = _mm256_setzero_ps();
    }
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockQ4_K);
      prefetch_next8(wr, row_bytes, b, nb);
      __m256 d, dmin;
      alignas(32) int16_t sc16[64];
      __m256i mins[4];
      kquant_headers8(base, row_bytes, &d, &dmin, sc16, mins);
      __m256i sums[R][8];
      for (int c = 0; c < 8; ++c) {
        const uint8_t* qs = base + c * row_bytes + offsetof(BlockQ4_K, qs);
        const int16_t* sc = sc16 + 16 * (c % 4) + 8 * (c / 4);
        __m256i lo[4], hi[4];
        for (int j = 0; j < 4; ++j) {
          const __m256i bits = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
          lo[j] = _mm256_and_si256(bits, mask);
          hi[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), mask);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* yq = a[r][b].qs;
          __m256i sum = _mm256_setzero_si256();
          for (int j = 0; j < 4; ++j) {
            const __m256i pl = _mm256_maddubs_epi16(lo[j], _mm256_loadu_si256((const __m256i*)(yq + 64 * j)));
            const __m256i ph = _mm256_maddubs_epi16(hi[j], _mm256_loadu_si256((const __m256i*)(yq + 64 * j + 32)));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pl, _mm256_set1_epi16(sc[2 * j])));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(ph, _mm256_set1_epi16(sc[2 * j + 1])));
          }
          sums[r][c] = sum;
        }
      }
      for (int r = 0; r < R; ++r) {
        const ActQ8K& y = a[r][b];
        const __m256 yd = _mm256_set1_ps(y.d);
        const __m256i total = reduce8(sums[r]), mn = mins_dot8(mins, y.bsums);
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(total)));
        accm[r] = _mm256_add_ps(accm[r], _mm256_mul_ps(_mm256_mul_ps(dmin, yd), _mm256_cvtepi32_ps(mn)));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, _mm256_sub_ps(acc[r], accm[r]));
  }
#endif
};

}  // namespace

void OPENTGI_FN(matmul_q4_k)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<TileQ4K>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

}  // namespace opentgi
