// Q5_K (w = d * sc * q - dmin * m, q = 5 bits: low nibble in qs, fifth bit in qh; 8 sub-blocks of
// 32 with 6-bit sc and m) against ActQ8K. As Q4_K: per superblock the integer sums are exact
// (sum_j sc_j * dot_j, q unsigned 0..31 so maddubs pairs stay under 2 * 31 * 127, and
// sum_j m_j * sum_j(q_x) from bsums), both paths add the same two floats per superblock in
// superblock order: AVX2 and scalar agree bit for bit; AVX2 computes eight outputs at once (one
// float lane each) by exactly that arithmetic, as Q4_K does.
#include <cstddef>

#include "kquants16.h"

namespace opentgi {
namespace {

static_assert(sizeof(BlockQ5_K) == 176, "ggml layout");

struct TileQ5K {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const BlockQ5_K* w = (const BlockQ5_K*)wr;
    const ActQ8K* a[R];
    float acc[R], accm[R];
    start_tile(act, stride, a, acc, accm);
    for (int b = 0; b < K / QK_K; ++b) {
      const BlockQ5_K& x = w[b];
      const float d = fp16_to_fp32(x.d), dmin = fp16_to_fp32(x.dmin);
      uint8_t sc[8], mn[8];
      scales_mins(x.scales, sc, mn);
#ifdef OPENTGI_AVX2
      __m256i q[8];  // values 32j .. 32j + 31 of the superblock, 0..31
      const __m256i m4 = _mm256_set1_epi8(0x0F), m1 = _mm256_set1_epi8(0x01);
      const __m256i hb = _mm256_loadu_si256((const __m256i*)x.qh);
      for (int j = 0; j < 4; ++j) {
        const __m256i bits = _mm256_loadu_si256((const __m256i*)(x.qs + 32 * j));
        const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), m1);
        const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), m1);
        q[2 * j] = _mm256_or_si256(_mm256_and_si256(bits, m4), _mm256_slli_epi16(h0, 4));
        q[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), _mm256_slli_epi16(h1, 4));
      }
#else
      uint8_t q[QK_K];
      for (int j = 0; j < 4; ++j) {
        for (int l = 0; l < 32; ++l) {
          q[64 * j + l] = (x.qs[32 * j + l] & 0x0F) | (((x.qh[l] >> (2 * j)) & 1) << 4);
          q[64 * j + 32 + l] = (x.qs[32 * j + l] >> 4) | (((x.qh[l] >> (2 * j + 1)) & 1) << 4);
        }
      }
#endif
      for (int r = 0; r < R; ++r) {
        const ActQ8K& y = a[r][b];
        int32_t total = 0, mins = 0;
        for (int j = 0; j < 8; ++j) mins += (int32_t)mn[j] * (y.bsums[2 * j] + y.bsums[2 * j + 1]);
#ifdef OPENTGI_AVX2
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i p = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i*)(y.qs + 32 * j)));
          sum = madd_add(sum, p, _mm256_set1_epi16(sc[j]));
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        total = _mm_cvtsi128_si32(s4);
#else
        for (int j = 0; j < 8; ++j) {
          int32_t s = 0;
          for (int i = 0; i < 32; ++i) s += q[32 * j + i] * y.qs[32 * j + i];
          total += sc[j] * s;
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
  // by run<R>'s arithmetic (out[r * ldo + c]), as Q4_K's run8: exact totals and mins in column order
  // (|total| <= 8 * 63 * 32 * 31 * 127 < 2^26).
  static constexpr bool has_run8 = true;
  template <int R>
  static inline void run8(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                          float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ8K* a[R];
    __m256 acc[R], accm[R];
    start_tile(act, stride, a, acc, accm);
    const __m256i m4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockQ5_K);
      prefetch_next(wr, row_bytes, b, nb);
      __m256 d, dmin;
      alignas(32) int16_t sc16[64];
      __m256i mins[4];
      kquant_headers8(base, row_bytes, &d, &dmin, sc16, mins);
      __m256i sums[R][8];
      for (int c = 0; c < 8; ++c) {
        const BlockQ5_K& x = *(const BlockQ5_K*)(base + c * row_bytes);
        const int16_t* sc = sc16 + 16 * (c % 4) + 8 * (c / 4);
        __m256i q[8];  // values 32j .. 32j + 31 of the superblock, 0..31: qh bit j moved to bit 4
        const __m256i hb = _mm256_loadu_si256((const __m256i*)x.qh);
        for (int j = 0; j < 4; ++j) {
          const __m256i bits = _mm256_loadu_si256((const __m256i*)(x.qs + 32 * j));
          const __m256i h0 = 2 * j <= 4 ? _mm256_slli_epi16(hb, 4 - 2 * j) : _mm256_srli_epi16(hb, 2 * j - 4);
          const __m256i h1 = 2 * j + 1 <= 4 ? _mm256_slli_epi16(hb, 3 - 2 * j) : _mm256_srli_epi16(hb, 2 * j - 3);
          q[2 * j] = _mm256_or_si256(_mm256_and_si256(bits, m4), _mm256_and_si256(h0, bit4));
          q[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), _mm256_and_si256(h1, bit4));
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* yq = a[r][b].qs;
          __m256i sum = _mm256_setzero_si256();
          for (int j = 0; j < 8; ++j) {
            const __m256i p = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i*)(yq + 32 * j)));
            sum = madd_add(sum, p, _mm256_set1_epi16(sc[j]));
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

#ifdef OPENTGI_AVX512
  // Sixteen weight rows at once (kquant_run16 with the fifth bits): run8's integers and float
  // arithmetic lane by lane. Tiles of eight activation rows here (AVX-512's registers).
  static constexpr int rows = BYTE_TILE_ROWS;
  // (S = 16: the rows repacked, r16.h.)
  static constexpr int run16_from = 2;
  template <int R, int S = 1>
  static inline void run16(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                           float* out, int ldo) {
    kquant_run16<R, true, S>(wr, row_bytes, sizeof(BlockQ5_K), offsetof(BlockQ5_K, qs), offsetof(BlockQ5_K, qh), act,
                             stride, K, out, ldo);
  }
#endif
#endif
};

}  // namespace

void OPENTGI_FN(matmul_q5_k_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                                 int K, float* out, int ldo) {
  drive_r16<TileQ5K>(w, rb, sizeof(BlockQ5_K), act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q5_k)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<TileQ5K>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

}  // namespace opentgi
