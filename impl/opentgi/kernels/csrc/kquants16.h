// The K-quants' sixteen-output forms on AVX-512 (Q4_K, Q5_K; docs/quantization.md "Reading the
// weights"): sixteen weight rows' superblock headers and sums in int32 lanes, row c in lane c,
// the same exact integers as the eight-output forms' (tiles.h kquant_headers8, mins_dot8).
#pragma once
#include "tiles.h"

namespace opentgi {

#ifdef OPENTGI_AVX512
// Sixteen Q4_K / Q5_K superblocks' headers (d, dmin, then the 12 bytes of 6-bit scales and mins, at
// base + c * row_bytes), row c in lane c: d and dmin, the scales as int32 (sc[j]: sub-block j), the
// mins' bytes (mn_lo: sub-blocks 0..3, mn_hi: 4..7; byte k of a lane is sub-block k's), by
// get_scale_min_k4 on 32-bit words (kquant_headers8's).
// S = 16: the rows repacked (r16.h, words16).
template <int S = 1>
struct KQuantHeaders16 {
  __m512 d, dmin;
  __m512i sc[8], mn_lo, mn_hi;
  KQuantHeaders16(const uint8_t* base, size_t row_bytes) {
    __m512i words[4];  // d|dmin, then the scales' and mins' three words
    words16<S>(base, row_bytes, words);
    d = fp16_lanes16<false>(words[0]);
    dmin = fp16_lanes16<true>(words[0]);
    const __m512i u0 = words[1], u1 = words[2], u2 = words[3];
    const __m512i k1 = _mm512_set1_epi32(0x3F3F3F3F), k2 = _mm512_set1_epi32(0x0F0F0F0F),
                  k3 = _mm512_set1_epi32(0x03030303), byte = _mm512_set1_epi32(0xFF);
    const __m512i sc_lo = _mm512_and_si512(u0, k1);
    const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(u2, k2),
                                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), k3), 4));
    mn_lo = _mm512_and_si512(u1, k1);
    mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), k2),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), k3), 4));
    for (int j = 0; j < 4; ++j) {
      sc[j] = _mm512_and_si512(_mm512_srli_epi32(sc_lo, 8 * j), byte);
      sc[j + 4] = _mm512_and_si512(_mm512_srli_epi32(sc_hi, 8 * j), byte);
    }
  }
  // the mins as int16 pairs: mpair[k] holds sub-blocks 2k and 2k + 1's
  void min_pairs(__m512i* mpair) const {
    const __m512i pick0 = pair_pick<0, false>(), pick1 = pair_pick<1, false>();
    mpair[0] = _mm512_shuffle_epi8(mn_lo, pick0);
    mpair[1] = _mm512_shuffle_epi8(mn_lo, pick1);
    mpair[2] = _mm512_shuffle_epi8(mn_hi, pick0);
    mpair[3] = _mm512_shuffle_epi8(mn_hi, pick1);
  }
};

// Lane c: sum_j min_j(row c) * (bsums[2j] + bsums[2j + 1]), mins_dot8's integer: the pair sums
// (|.| <= 32 * 127) as int16 against the mins in pairs, VNNI's 16-bit multiply-add.
static inline __m512i kquant_mins16(const __m512i* mpair, const int16_t* bsums) {
  alignas(16) int16_t pairs[8];
  const __m256i p = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)bsums), _mm256_set1_epi16(1));
  _mm_store_si128((__m128i*)pairs, _mm_packs_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
  __m512i mn = _mm512_setzero_si512();
  for (int k = 0; k < 4; ++k) mn = dpwssd_word(mn, mpair[k], pairs + 2 * k);
  return mn;
}

// Sixteen Q4_K (Fifth: Q5_K) weight rows' superblocks against N <= 8 streams of 256 activation
// bytes (ActQ8K's order, or a wide row's byte halves): total[i] lane c = row c's exact
// sum_j sc_j * dot_j (|.| <= 8 * 63 * 32 * 31 * 128 < 2^26), the eight-output forms' integer.
// qs: row 0's 128 nibble bytes, qh: its 32 fifth-bit bytes (Q5_K: bit j of byte l is value
// 32j + l's), rows row_bytes apart. The rows' bytes are transposed 16 at a time (words16: w[g]
// lane c holds values 32j + 4g .. + 3 of row c), then each sub-block's dot by VNNI against the
// stream's four bytes broadcast, times its scale: no horizontal sums.
template <int N, bool Fifth, int S = 1>
static inline void kquant_totals16(const uint8_t* qs, const uint8_t* qh, size_t row_bytes, const __m512i* sc,
                                   const int8_t* const* ys, __m512i* total) {
  static_assert(N <= 8, "every sum in registers");
  const __m512i mask = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  alignas(64) __m512i hb[Fifth ? 8 : 1];  // Q5_K: the fifth bits' bytes, transposed as the nibbles
  if constexpr (Fifth) {
    words16<S>(qh, row_bytes, hb);
    words16<S>(qh + 16 * S, row_bytes, hb + 4);
  }
  for (int i = 0; i < N; ++i) total[i] = _mm512_setzero_si512();
  for (int h = 0; h < 4; ++h) {  // 32 bytes of nibbles: sub-blocks 2h (low) and 2h + 1 (high)
    __m512i t[8];
    words16<S>(qs + 32 * h * S, row_bytes, t);
    words16<S>(qs + (32 * h + 16) * S, row_bytes, t + 4);
    for (int half = 0; half < 2; ++half) {
      const int j = 2 * h + half;
      __m512i w[8];
      for (int g = 0; g < 8; ++g) {
        w[g] = _mm512_and_si512(half ? _mm512_srli_epi16(t[g], 4) : t[g], mask);
        if constexpr (Fifth) {  // bit j of each qh byte to bit 4
          const __m512i b = j <= 4 ? _mm512_slli_epi16(hb[g], 4 - j) : _mm512_srli_epi16(hb[g], j - 4);
          w[g] = _mm512_or_si512(w[g], _mm512_and_si512(b, bit4));
        }
      }
      for (int i = 0; i < N; ++i) {
        const int8_t* yq = ys[i] + 32 * j;
        __m512i dot = _mm512_setzero_si512();
        for (int g = 0; g < 8; ++g) dot = dpbusd_word(dot, w[g], yq + 4 * g);
        total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(dot, sc[j]));
      }
    }
  }
}

// Sixteen Q4_K (Fifth: Q5_K) outputs against R <= 8 activation rows (ActQ8K), row c in lane c:
// per superblock the exact totals (kquant_totals16) and mins (kquant_mins16), then the
// eight-output forms' two float products, acc - accm at the end. Blocks of block_bytes; qs_at,
// qh_at: the nibbles' and the fifth bits' offsets in a block.
template <int R, bool Fifth, int S = 1>
static inline void kquant_run16(const uint8_t* wr, size_t row_bytes, size_t block_bytes, size_t qs_at, size_t qh_at,
                                const uint8_t* act, size_t stride, int K, float* out, int ldo) {
  const int nb = K / QK_K;
  const ActQ8K* a[R];
  alignas(64) float acc[R][16] = {}, accm[R][16] = {};  // in memory: the registers go to the products
  for (int r = 0; r < R; ++r) a[r] = (const ActQ8K*)(act + r * stride);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* base = wr + (size_t)b * block_bytes * S;
    prefetch_blocks16<S>(wr, row_bytes, base, block_bytes, b, nb);
    const KQuantHeaders16<S> hd(base, row_bytes);
    __m512i mpair[4];
    hd.min_pairs(mpair);
    const int8_t* ys[R];
    for (int r = 0; r < R; ++r) ys[r] = a[r][b].qs;
    __m512i total[R];
    kquant_totals16<R, Fifth, S>(base + qs_at * S, base + qh_at * S, row_bytes, hd.sc, ys, total);
    for (int r = 0; r < R; ++r) {
      const ActQ8K& y = a[r][b];
      const __m512i mn = kquant_mins16(mpair, y.bsums);
      const __m512 yd = _mm512_set1_ps(y.d);
      _mm512_store_ps(acc[r], _mm512_add_ps(_mm512_load_ps(acc[r]),
                                            _mm512_mul_ps(_mm512_mul_ps(hd.d, yd), _mm512_cvtepi32_ps(total[r]))));
      _mm512_store_ps(accm[r], _mm512_add_ps(_mm512_load_ps(accm[r]),
                                             _mm512_mul_ps(_mm512_mul_ps(hd.dmin, yd), _mm512_cvtepi32_ps(mn))));
    }
  }
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(out + r * ldo, _mm512_sub_ps(_mm512_load_ps(acc[r]), _mm512_load_ps(accm[r])));
}
#endif

}  // namespace opentgi
