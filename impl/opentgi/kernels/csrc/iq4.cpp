// IQ4_NL (w = d * kvalues[q], blocks of 32 against ActQ8) and IQ4_XS (w = d * (ls - 32) *
// kvalues[q], superblocks of 256 with a 6-bit ls per sub-block of 32, against ActQ8K); q a 4-bit
// index into ggml's non-linear int8 table kvalues_iq4nl (-127..113). The weights are signed, so
// AVX2's maddubs takes |w| against sign(y, w) (pairs at most 2 * 127 * 127 < 32767; activations
// never hold -128): exact integer sums per block / superblock, and both paths add (d_w * d_x) *
// (float)sum per block in block order: AVX2 and scalar agree bit for bit, and a row's bits never
// depend on the other rows. AVX2 reduces eight IQ4_NL blocks' integer sums together (the same
// integers).
#include "tiles.h"

namespace opentgi {
namespace {

struct BlockIQ4_NL { uint16_t d; uint8_t qs[16]; };
struct BlockIQ4_XS { uint16_t d, scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };
static_assert(sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136, "ggml layout");

alignas(16) constexpr int8_t kvalues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1, 13, 25, 38, 53, 69, 89, 113};

#ifdef OPENTGI_AVX2
// the 32 values of 16 bytes (low nibbles first, then high ones), looked up in kvalues
static inline __m256i values32(const uint8_t* qs) {
  const __m128i t = _mm_load_si128((const __m128i*)kvalues);
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nibbles32(qs));
}
#else
static inline void values32(const uint8_t* qs, int8_t* v) {
  for (int i = 0; i < 16; ++i) {
    v[i] = kvalues[qs[i] & 0x0F];
    v[i + 16] = kvalues[qs[i] >> 4];
  }
}
#endif

struct TileIQ4NL {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const BlockIQ4_NL* w = (const BlockIQ4_NL*)wr;
    const ActQ8* a[R];
    float acc[R];
    for (int r = 0; r < R; ++r) {
      a[r] = (const ActQ8*)(act + r * stride);
      acc[r] = 0.0f;
    }
    const int nb = K / QK;
    int b = 0;
#ifdef OPENTGI_AVX2
    for (; b + 8 <= nb; b += 8) {  // eight blocks' integer sums reduced together, then added in order
      __m256i q[8], aq[8];
      float dw[8];
      for (int i = 0; i < 8; ++i) {
        q[i] = values32(w[b + i].qs);
        aq[i] = _mm256_sign_epi8(q[i], q[i]);
        dw[i] = fp16_to_fp32(w[b + i].d);
      }
      for (int r = 0; r < R; ++r) {
        const ActQ8* y = a[r] + b;
        __m256i s[8];
        for (int i = 0; i < 8; ++i) {
          const __m256i qy = _mm256_loadu_si256((const __m256i*)y[i].qs);
          s[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(aq[i], _mm256_sign_epi8(qy, q[i])), _mm256_set1_epi16(1));
        }
        int32_t sums[8];
        _mm256_storeu_si256((__m256i*)sums, reduce8(s));
        for (int i = 0; i < 8; ++i) acc[r] += (dw[i] * y[i].d) * (float)sums[i];
      }
    }
#endif
    for (; b < nb; ++b) {
      const float dw = fp16_to_fp32(w[b].d);
#ifdef OPENTGI_AVX2
      const __m256i q = values32(w[b].qs);
#else
      int8_t q[QK];
      values32(w[b].qs, q);
#endif
      for (int r = 0; r < R; ++r) {
        const ActQ8& y = a[r][b];
#ifdef OPENTGI_AVX2
        const int32_t s = hsum_i32(dot_i8(q, _mm256_loadu_si256((const __m256i*)y.qs)));
#else
        int32_t s = 0;
        for (int i = 0; i < QK; ++i) s += (int32_t)q[i] * y.qs[i];
#endif
        acc[r] += (dw * y.d) * (float)s;
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
  }
};

struct TileIQ4XS {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const BlockIQ4_XS* w = (const BlockIQ4_XS*)wr;
    const ActQ8K* a[R];
    float acc[R];
    for (int r = 0; r < R; ++r) {
      a[r] = (const ActQ8K*)(act + r * stride);
      acc[r] = 0.0f;
    }
    for (int b = 0; b < K / QK_K; ++b) {
      const BlockIQ4_XS& x = w[b];
      const float d = fp16_to_fp32(x.d);
      int16_t ls[8];  // each sub-block's multiplier, -32..31
      for (int j = 0; j < 8; ++j)
        ls[j] = (int16_t)((((x.scales_l[j / 2] >> (4 * (j % 2))) & 0x0F) | (((x.scales_h >> (2 * j)) & 3) << 4)) - 32);
#ifdef OPENTGI_AVX2
      __m256i q[8], aq[8];  // sub-block j's values and their absolute values
      for (int j = 0; j < 8; ++j) {
        q[j] = values32(x.qs + 16 * j);
        aq[j] = _mm256_sign_epi8(q[j], q[j]);
      }
#else
      int8_t q[QK_K];
      for (int j = 0; j < 8; ++j) values32(x.qs + 16 * j, q + 32 * j);
#endif
      for (int r = 0; r < R; ++r) {
        const ActQ8K& y = a[r][b];
        int32_t total = 0;
#ifdef OPENTGI_AVX2
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i qy = _mm256_loadu_si256((const __m256i*)(y.qs + 32 * j));
          const __m256i p = _mm256_maddubs_epi16(aq[j], _mm256_sign_epi8(qy, q[j]));
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, _mm256_set1_epi16(ls[j])));
        }
        total = hsum_i32(sum);
#else
        for (int j = 0; j < 8; ++j) {
          int32_t s = 0;
          for (int i = 0; i < 32; ++i) s += (int32_t)q[32 * j + i] * y.qs[32 * j + i];
          total += ls[j] * s;
        }
#endif
        acc[r] += (d * y.d) * (float)total;
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
  }
};

}  // namespace

void OPENTGI_FN(matmul_iq4_nl)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                               int K, float* out, int ldo) {
  drive<TileIQ4NL>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_iq4_xs)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                               int K, float* out, int ldo) {
  drive<TileIQ4XS>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

}  // namespace opentgi
