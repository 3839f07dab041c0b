// IQ4_NL (w = d * kvalues[q], blocks of 32 against ActQ8) and IQ4_XS (w = d * (ls - 32) *
// kvalues[q], superblocks of 256 with a 6-bit ls per sub-block of 32, against ActQ8K); q a 4-bit
// index into ggml's non-linear int8 table kvalues_iq4nl (-127..113). The weights are signed, so
// AVX2's maddubs takes |w| against sign(y, w) (pairs at most 2 * 127 * 127 < 32767; activations
// never hold -128): exact integer sums per block / superblock, and both paths add (d_w * d_x) *
// (float)sum per block in block order: AVX2 and scalar agree bit for bit, and a row's bits never
// depend on the other rows. AVX2 reduces eight IQ4_NL blocks' integer sums together (the same
// integers), and computes eight outputs at once (run8, one float lane each) by exactly that
// arithmetic, where |y| against sign(w, y) bounds the pairs the same way.
#include "tiles.h"

namespace opentgi {
namespace {

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

#ifdef OPENTGI_AVX512
// kvalues + 128 as unsigned bytes in every 128-bit lane (a shuffle's table)
static inline __m512i shifted_table() {
  return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)kvalues)), _mm512_set1_epi8((char)0x80));
}
#endif

struct TileIQ4NL {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const BlockIQ4_NL* w = (const BlockIQ4_NL*)wr;
    const ActQ8* a[R];
    float acc[R];
    start_tile(act, stride, a, acc);
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

#ifdef OPENTGI_AVX2
  // Eight weight rows (row_bytes apart) at once against R activation rows, output c in float lane c
  // by run<R>'s arithmetic (out[r * ldo + c]): rows p and p + 4 share a vector (16 values of each,
  // one in each half) against the activations' 16 broadcast to both, |y| against sign(w, y) (the
  // pairs bounded as above; the activation's absolute values taken once for the eight rows), a
  // block's exact sums in column order after two rounds of hadd (|.| <= 32 * 127 * 127 < 2^19).
  static constexpr bool has_run8 = true;
  template <int R>
  static inline void run8(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                          float* out, int ldo) {
    const int nb = K / QK;
    const ActQ8* a[R];
    __m256 acc[R];
    start_tile(act, stride, a, acc);
    const __m128i t = _mm_load_si128((const __m128i*)kvalues);
    const __m256i table = _mm256_set_m128i(t, t), mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockIQ4_NL);
      prefetch_next(wr, row_bytes, b, nb);
      const __m256 dv = fp16_8(base, row_bytes);
      __m256i ylo[R], yhi[R], alo[R], ahi[R], s[R][4];  // each activation's 16 and 16, both halves
      for (int r = 0; r < R; ++r) {
        ylo[r] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)a[r][b].qs));
        yhi[r] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(a[r][b].qs + 16)));
        alo[r] = _mm256_abs_epi8(ylo[r]);
        ahi[r] = _mm256_abs_epi8(yhi[r]);
      }
      for (int p = 0; p < 4; ++p) {  // values 0..15 and 16..31 of rows p (low half) and p + 4 (high half)
        const __m256i v = _mm256_loadu2_m128i((const __m128i*)(base + (p + 4) * row_bytes + 2),
                                              (const __m128i*)(base + p * row_bytes + 2));
        const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, mask));
        const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
        for (int r = 0; r < R; ++r)
          s[r][p] = _mm256_add_epi32(
              _mm256_madd_epi16(_mm256_maddubs_epi16(alo[r], _mm256_sign_epi8(lo, ylo[r])), ones),
              _mm256_madd_epi16(_mm256_maddubs_epi16(ahi[r], _mm256_sign_epi8(hi, yhi[r])), ones));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i sum =
            _mm256_hadd_epi32(_mm256_hadd_epi32(s[r][0], s[r][1]), _mm256_hadd_epi32(s[r][2], s[r][3]));
        const __m256 dy = _mm256_mul_ps(dv, _mm256_set1_ps(a[r][b].d));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dy, _mm256_cvtepi32_ps(sum)));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
  }

#ifdef OPENTGI_AVX512
  // Sixteen weight rows at once, row c's block sum in int32 lane c (VNNI against the activations'
  // four bytes broadcast): the values looked up as kvalues + 128 (unsigned), 128 * sum(y) taken off
  // (the sum's start); the same exact integer as run8's, then its float arithmetic lane by lane.
  static constexpr int rows = BYTE_TILE_ROWS;
  // (S = 16: the rows repacked, r16.h.)
  static constexpr int run16_from = 2;
  template <int R, int S = 1>
  static inline void run16(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                           float* out, int ldo) {
    const int nb = K / QK;
    const ActQ8* a[R];
    __m512 acc[R];
    start_tile(act, stride, a, acc);
    const __m512i table = shifted_table();
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockIQ4_NL) * S;
      prefetch_blocks16<S>(wr, row_bytes, base, sizeof(BlockIQ4_NL), b, nb);
      const __m512 dv = d16<S>(base, row_bytes);
      __m512i w[8];  // w[g] lane c: values 4g .. 4g + 3 of row c, + 128
      values16<0, S>(base, row_bytes, w);
      for (int g = 0; g < 8; ++g) w[g] = _mm512_shuffle_epi8(table, w[g]);
      for (int r = 0; r < R; ++r) {
        const ActQ8& y = a[r][b];
        __m512i sum = _mm512_set1_epi32(-128 * y.sum);
        for (int g = 0; g < 8; ++g) sum = dpbusd_word(sum, w[g], y.qs + 4 * g);
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(dv, _mm512_set1_ps(y.d)), _mm512_cvtepi32_ps(sum)));
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
  }
#endif
#endif
};

struct TileIQ4XS {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const BlockIQ4_XS* w = (const BlockIQ4_XS*)wr;
    const ActQ8K* a[R];
    float acc[R];
    start_tile(act, stride, a, acc);
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
          sum = madd_add(sum, p, _mm256_set1_epi16(ls[j]));
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

#ifdef OPENTGI_AVX2
  // Eight weight rows (row_bytes apart) at once against R activation rows, output c in float lane c
  // by run<R>'s arithmetic (out[r * ldo + c]): the eight headers unpacked together (d and the
  // multipliers of every sub-block, row c in lane c), then sub-block by sub-block rows p and p + 4
  // share a vector as in TileIQ4NL::run8, each half's pair sums multiplied by its own row's
  // multiplier (madd), a superblock's exact totals in column order after two rounds of hadd.
  // int32 holds them: |total| <= 8 * 32 * 32 * 127 * 127 < 2^27.
  static constexpr bool has_run8 = true;
  template <int R>
  static inline void run8(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                          float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ8K* a[R];
    __m256 acc[R];
    start_tile(act, stride, a, acc);
    const __m128i t = _mm_load_si128((const __m128i*)kvalues);
    const __m256i table = _mm256_set_m128i(t, t), mask = _mm256_set1_epi8(0x0F);
    const __m256i k15 = _mm256_set1_epi32(15), k48 = _mm256_set1_epi32(48), k32 = _mm256_set1_epi32(32);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockIQ4_XS);
      prefetch_next(wr, row_bytes, b, nb);
      // words 0 (d | scales_h << 16) and 1 (scales_l) of every row, row c in lane c
      __m256i w[4];
      header_words8(base, row_bytes, w);
      const __m256i sl = w[1], sh = _mm256_srli_epi32(w[0], 16);
      __m256 d, unused;
      fp16_halves8(w[0], &d, &unused);
      __m256i s[R][4];
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < 4; ++p) s[r][p] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        // the multiplier ls - 32 of sub-block j, row c in lane c, then in the int16 words of rows p
        // (low half) and p + 4 (high half)
        const __m256i hbits = j < 2 ? _mm256_slli_epi32(sh, 4 - 2 * j) : _mm256_srli_epi32(sh, 2 * j - 4);
        const __m256i ls = _mm256_sub_epi32(
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(sl, 4 * j), k15), _mm256_and_si256(hbits, k48)), k32);
        __m256i ylo[R], yhi[R], alo[R], ahi[R];
        for (int r = 0; r < R; ++r) {
          const int8_t* yq = a[r][b].qs + 32 * j;
          ylo[r] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)yq));
          yhi[r] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(yq + 16)));
          alo[r] = _mm256_abs_epi8(ylo[r]);
          ahi[r] = _mm256_abs_epi8(yhi[r]);
        }
        for (int p = 0; p < 4; ++p) {
          const __m256i sv = _mm256_shuffle_epi8(ls, _mm256_set1_epi32(0x01000100 + 0x04040404 * p));
          const __m256i q = _mm256_loadu2_m128i((const __m128i*)(base + (p + 4) * row_bytes + 8 + 16 * j),
                                                (const __m128i*)(base + p * row_bytes + 8 + 16 * j));
          const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(q, mask));
          const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(q, 4), mask));
          for (int r = 0; r < R; ++r) {
            const __m256i pl = _mm256_maddubs_epi16(alo[r], _mm256_sign_epi8(lo, ylo[r]));
            const __m256i ph = _mm256_maddubs_epi16(ahi[r], _mm256_sign_epi8(hi, yhi[r]));
            s[r][p] = _mm256_add_epi32(s[r][p], _mm256_add_epi32(_mm256_madd_epi16(pl, sv), _mm256_madd_epi16(ph, sv)));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256i total = _mm256_hadd_epi32(_mm256_hadd_epi32(s[r][0], s[r][1]), _mm256_hadd_epi32(s[r][2], s[r][3]));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[r][b].d)), _mm256_cvtepi32_ps(total)));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
  }

#ifdef OPENTGI_AVX512
  // Sixteen weight rows at once, row c's sums in int32 lane c: each sub-block's dot by VNNI (the
  // values looked up as kvalues + 128, the 128 * its activations' sum taken off as the dot's
  // start), times the row's multiplier; the same exact total as run8's, then its float arithmetic.
  static constexpr int rows = BYTE_TILE_ROWS;
  // (S = 16: the rows repacked, r16.h.)
  static constexpr int run16_from = 2;
  template <int R, int S = 1>
  static inline void run16(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                           float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ8K* a[R];
    __m512 acc[R];
    start_tile(act, stride, a, acc);
    const __m512i table = shifted_table();
    const __m512i k15 = _mm512_set1_epi32(15), k3 = _mm512_set1_epi32(3), k32 = _mm512_set1_epi32(32);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockIQ4_XS) * S;
      prefetch_blocks16<S>(wr, row_bytes, base, sizeof(BlockIQ4_XS), b, nb);
      __m512i hw[4];  // d | scales_h << 16, scales_l, the first qs
      words16<S>(base, row_bytes, hw);
      const __m512 d = fp16_lanes16<false>(hw[0]);
      const __m512i sh = _mm512_srli_epi32(hw[0], 16);
      __m512i total[R];
      for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        const __m512i ls = _mm512_sub_epi32(
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(hw[1], 4 * j), k15),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(sh, 2 * j), k3), 4)), k32);
        __m512i w[8];  // w[g] lane c: values 32j + 4g .. + 3 of row c, + 128
        nibbles16<S>(base + (offsetof(BlockIQ4_XS, qs) + 16 * j) * S, row_bytes, w);
        for (int g = 0; g < 8; ++g) w[g] = _mm512_shuffle_epi8(table, w[g]);
        for (int r = 0; r < R; ++r) {
          const ActQ8K& y = a[r][b];
          const int8_t* yq = y.qs + 32 * j;
          __m512i dot = _mm512_set1_epi32(-128 * (y.bsums[2 * j] + y.bsums[2 * j + 1]));
          for (int g = 0; g < 8; ++g) dot = dpbusd_word(dot, w[g], yq + 4 * g);
          total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(dot, ls));
        }
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(a[r][b].d)),
                                                     _mm512_cvtepi32_ps(total[r])));
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
  }
#endif
#endif
};

}  // namespace

void OPENTGI_FN(matmul_iq4_nl_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                                   int K, float* out, int ldo) {
  drive_r16<TileIQ4NL>(w, rb, sizeof(BlockIQ4_NL), act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_iq4_xs_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                                   int K, float* out, int ldo) {
  drive_r16<TileIQ4XS>(w, rb, sizeof(BlockIQ4_XS), act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_iq4_nl)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                               int K, float* out, int ldo) {
  drive<TileIQ4NL>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_iq4_xs)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                               int K, float* out, int ldo) {
  drive<TileIQ4XS>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

}  // namespace opentgi
