// Q5_0 (w = d * (q - 16)) and Q5_1 (w = d * q + m), q = 5 bits (low nibble in qs, fifth bit in the
// 32-bit qh), blocks of 32 against ActQ8. Per block the integer sum is exact (q unsigned 0..31
// against int8: maddubs pairs stay under 2 * 31 * 127; Q5_0's -16 taken as 16 * sum(q_x)), and
// both paths add (d_w * d_x) * (float)sum per block in block order (Q5_1's m * d_x * sum(q_x) in a
// separate float, also in block order): AVX2 and scalar agree bit for bit, and a row's bits never
// depend on the other rows. AVX2 reduces eight blocks' integer sums together (the same integers),
// and computes eight outputs at once (run8: one float lane each) by exactly that arithmetic.
#include "tiles.h"

namespace opentgi {
namespace {

#ifdef OPENTGI_AVX2
// 0xFF in byte i where bit i of the 32 bits at x is set (llama.cpp's bytes_from_bits_32)
static inline __m256i bytes_from_bits_32(const uint8_t* x) {
  uint32_t x32;
  std::memcpy(&x32, x, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}
#endif

template <class Block, bool WithMin>
struct TileQ5 {
  // one block's float step, the same on both paths: (d_w * d_x) * sum, plus Q5_1's minimum term
  static inline void step(const Block& x, float dw, const ActQ8& y, int32_t s, float& acc, float& mins) {
    if constexpr (!WithMin) s -= 16 * y.sum;
    acc += (dw * y.d) * (float)s;
    if constexpr (WithMin) mins += fp16_to_fp32(((const BlockQ5_1&)x).m) * y.ds;
  }
#ifdef OPENTGI_AVX2
  static inline __m256i unpack(const Block& x) {
    return _mm256_or_si256(nibbles32(x.qs), _mm256_and_si256(bytes_from_bits_32(x.qh), _mm256_set1_epi8(0x10)));
  }
#else
  static inline void unpack(const Block& x, uint8_t* q) {
    uint32_t qh;
    std::memcpy(&qh, x.qh, 4);
    for (int i = 0; i < 16; ++i) {
      q[i] = (x.qs[i] & 0x0F) | (((qh >> i) & 1) << 4);
      q[i + 16] = (x.qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    }
  }
#endif

  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const Block* w = (const Block*)wr;
    const ActQ8* a[R];
    float acc[R], mins[R];
    start_tile(act, stride, a, acc, mins);
    const int nb = K / QK;
    int b = 0;
#ifdef OPENTGI_AVX2
    for (; b + 8 <= nb; b += 8) {  // eight blocks' integer sums reduced together, then added in order
      __m256i q[8];
      float dw[8];
      for (int i = 0; i < 8; ++i) q[i] = unpack(w[b + i]), dw[i] = fp16_to_fp32(w[b + i].d);
      for (int r = 0; r < R; ++r) {
        const ActQ8* y = a[r] + b;
        __m256i s[8];
        for (int i = 0; i < 8; ++i) s[i] = dot_u8(q[i], _mm256_loadu_si256((const __m256i*)y[i].qs));
        int32_t sums[8];
        _mm256_storeu_si256((__m256i*)sums, reduce8(s));
        for (int i = 0; i < 8; ++i) step(w[b + i], dw[i], y[i], sums[i], acc[r], mins[r]);
      }
    }
#endif
    for (; b < nb; ++b) {
      const Block& x = w[b];
      const float dw = fp16_to_fp32(x.d);
#ifdef OPENTGI_AVX2
      const __m256i q = unpack(x);
#else
      uint8_t q[QK];
      unpack(x, q);
#endif
      for (int r = 0; r < R; ++r) {
        const ActQ8& y = a[r][b];
#ifdef OPENTGI_AVX2
        const int32_t s = hsum_i32(dot_u8(q, _mm256_loadu_si256((const __m256i*)y.qs)));
#else
        int32_t s = 0;
        for (int i = 0; i < QK; ++i) s += (int32_t)q[i] * y.qs[i];
#endif
        step(x, dw, y, s, acc[r], mins[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = WithMin ? acc[r] + mins[r] : acc[r];
  }

#ifdef OPENTGI_AVX2
  // Eight weight rows (row_bytes apart) at once against R activation rows, output c in float lane c
  // by step's arithmetic (out[r * ldo + c]): rows p and p + 4 share a vector (one in each half), the
  // fifth bits of both spread from their qh words by one byte shuffle; a block's integer sums come
  // out in column order after two rounds of hadd. Exact: q <= 31 against |x| <= 127 (int8: 128),
  // the two maddubs (pairs) added in int16 hold 4 * 31 * 128 < 2^15, then int32.
  static constexpr bool has_run8 = true;
  template <int R>
  static inline void run8(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                          float* out, int ldo) {
    constexpr int qs_at = WithMin ? 8 : 6;  // after d (, m) and qh
    const int nb = K / QK;
    const ActQ8* a[R];
    __m256 acc[R], mins[R];
    start_tile(act, stride, a, acc, mins);
    const __m256i mask = _mm256_set1_epi8(0x0F), five = _mm256_set1_epi8(0x10);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);  // byte j: bit j % 8
    // bytes 0..7 of a half from qh byte 0 (values 0..7), 8..15 from byte 1; the high nibbles' from 2, 3
    const __m256i spread_lo = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                               0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m256i spread_hi = _mm256_add_epi8(spread_lo, _mm256_set1_epi8(2));
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(Block);
      prefetch_next(wr, row_bytes, b, nb);
      // the first 16 bytes of rows p (low half) and p + 4 (high half), transposed: words 0 and 1 of
      // row c in int32 lane c (d | m, qh for Q5_1; d | qh's low half, qh's high half | qs for Q5_0)
      __m256i w[4];
      header_words8(base, row_bytes, w);
      const __m256i w0 = w[0], w1 = w[1];
      __m256 dv, mv;  // mv: Q5_1's m
      fp16_halves8(w0, &dv, &mv);
      const __m256i hv = WithMin ? w1 : _mm256_or_si256(_mm256_srli_epi32(w0, 16), _mm256_slli_epi32(w1, 16));
      __m256i lo[4], hi[4];
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu2_m128i((const __m128i*)(base + (p + 4) * row_bytes + qs_at),
                                              (const __m128i*)(base + p * row_bytes + qs_at));
        const __m256i at = _mm256_set1_epi8((char)(4 * p));
        const __m256i blo = _mm256_and_si256(_mm256_shuffle_epi8(hv, _mm256_add_epi8(spread_lo, at)), bit);
        const __m256i bhi = _mm256_and_si256(_mm256_shuffle_epi8(hv, _mm256_add_epi8(spread_hi, at)), bit);
        lo[p] = _mm256_or_si256(_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_cmpeq_epi8(blo, bit), five));
        hi[p] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                                _mm256_and_si256(_mm256_cmpeq_epi8(bhi, bit), five));
      }
      for (int r = 0; r < R; ++r) {
        const ActQ8& y = a[r][b];
        __m256i sum = pair_sums8(lo, hi, y.qs);
        if constexpr (!WithMin) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(16 * y.sum));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_mul_ps(dv, _mm256_set1_ps(y.d)), _mm256_cvtepi32_ps(sum)));
        if constexpr (WithMin)
          mins[r] = _mm256_add_ps(mins[r], _mm256_mul_ps(mv, _mm256_set1_ps(y.ds)));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, WithMin ? _mm256_add_ps(acc[r], mins[r]) : acc[r]);
  }

#ifdef OPENTGI_AVX512
  // Sixteen weight rows at once, row c's block sum in int32 lane c (VNNI against the activations'
  // four bytes broadcast): the nibbles transposed as Q4_0's, each fifth bit added where a byte
  // test of the row's qh finds it; Q5_0's -16 * sum(y) the sum's start. run8's integers and float
  // arithmetic lane by lane.
  static constexpr int rows = BYTE_TILE_ROWS;
  // (S = 16: the rows repacked, r16.h.)
  static constexpr int run16_from = 2;
  template <int R, int S = 1>
  static inline void run16(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                           float* out, int ldo) {
    constexpr int qs_at = WithMin ? 8 : 6;
    const int nb = K / QK;
    const ActQ8* a[R];
    __m512 acc[R], mins[R];
    start_tile(act, stride, a, acc, mins);
    const __m512i five = _mm512_set1_epi8(0x10);
    // byte k of word j: the word's byte 0 (then + g / 2), in each 128-bit lane
    const __m512i word = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(Block) * S;
      prefetch_blocks16<S>(wr, row_bytes, base, sizeof(Block), b, nb);
      __m512 dv, mv;  // mv: Q5_1's m
      __m512i qh;
      if constexpr (!WithMin && S == 16) {  // Q5_0_R16: the sixteen d side by side, then the qh words (r16.h)
        dv = mv = d16<S>(base, row_bytes);
        qh = _mm512_loadu_si512((const void*)(base + 32));
      } else {
        __m512i hw[4];  // the first 16 bytes: d (| m), qh
        words16<S>(base, row_bytes, hw);
        dv = fp16_lanes16<false>(hw[0]), mv = fp16_lanes16<true>(hw[0]);
        qh = WithMin ? hw[1] : _mm512_or_si512(_mm512_srli_epi32(hw[0], 16), _mm512_slli_epi32(hw[1], 16));
      }
      __m512i w[8];  // w[g] lane c: values 4g .. 4g + 3 of row c
      nibbles16<S>(base + qs_at * S, row_bytes, w);
      for (int g = 0; g < 8; ++g) {  // bit 4g + k of qh to byte k: qh's byte g / 2 in every byte, tested
        const __m512i spread = _mm512_shuffle_epi8(qh, _mm512_add_epi8(word, _mm512_set1_epi8((char)(g / 2))));
        const __m512i bits = _mm512_set1_epi32((int)(0x08040201u << (4 * (g % 2))));
        w[g] = _mm512_or_si512(w[g], _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(spread, bits), five));
      }
      for (int r = 0; r < R; ++r) {
        const ActQ8& y = a[r][b];
        __m512i sum = WithMin ? _mm512_setzero_si512() : _mm512_set1_epi32(-16 * y.sum);
        for (int g = 0; g < 8; ++g) sum = dpbusd_word(sum, w[g], y.qs + 4 * g);
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(dv, _mm512_set1_ps(y.d)), _mm512_cvtepi32_ps(sum)));
        if constexpr (WithMin) mins[r] = _mm512_add_ps(mins[r], _mm512_mul_ps(mv, _mm512_set1_ps(y.ds)));
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, WithMin ? _mm512_add_ps(acc[r], mins[r]) : acc[r]);
  }
#endif
#endif
};

}  // namespace

void OPENTGI_FN(matmul_q5_0_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                                 int K, float* out, int ldo) {
  drive_r16<TileQ5<BlockQ5_0, false>>(w, rb, sizeof(BlockQ5_0), act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q5_1_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                                 int K, float* out, int ldo) {
  drive_r16<TileQ5<BlockQ5_1, true>>(w, rb, sizeof(BlockQ5_1), act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q5_0)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<TileQ5<BlockQ5_0, false>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q5_1)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<TileQ5<BlockQ5_1, true>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

}  // namespace opentgi
