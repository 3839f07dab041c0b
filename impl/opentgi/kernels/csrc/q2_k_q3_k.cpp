// Q2_K (w = d * sc * q - dmin * m, q 2 bits, 16 sub-blocks of 16 with 4-bit sc and m) and Q3_K
// (w = d * (sc - 32) * (q - 4), q 2 bits in qs plus a third in hmask, 16 sub-blocks of 16 with
// 6-bit sc) against ActQ8K. The weights go into maddubs unsigned (0..3, 0..7: pairs far under
// int16's limit); Q2_K's minimum (sum_k m_k * bsum_k) and Q3_K's -4 offset (4 * sum_k sc_k *
// bsum_k) are subtracted exactly from the bsums, so each superblock gives exact integer sums and
// both paths add the same floats per superblock in superblock order: AVX2 and scalar agree bit for
// bit, and a row's bits never depend on the other rows. AVX2 computes eight outputs at once (one
// float lane each) by exactly that arithmetic.
#include <cstddef>
#include <type_traits>

#include "tiles.h"

namespace opentgi {
namespace {

// Q3_K's 16 six-bit scales, 0..63 (ggml's kmask1 / kmask2 unpacking); the multipliers are these - 32
static inline void q3_scales(const uint8_t* s, uint32_t* aux) {
  std::memcpy(aux, s, 12);
  const uint32_t tmp = aux[2], m4 = 0x0F0F0F0F, m2 = 0x03030303;
  aux[2] = ((aux[0] >> 4) & m4) | (((tmp >> 4) & m2) << 4);
  aux[3] = ((aux[1] >> 4) & m4) | (((tmp >> 6) & m2) << 4);
  aux[0] = (aux[0] & m4) | ((tmp & m2) << 4);
  aux[1] = (aux[1] & m4) | (((tmp >> 2) & m2) << 4);
}

#ifdef OPENTGI_AVX2
// q3_scales in one vector, no store and reload: the 16 six-bit scales 0..63 in bytes 0..15
static inline __m128i q3_scales_v(const uint8_t* s) {
  uint32_t tmp;
  std::memcpy(&tmp, s + 8, 4);
  const __m128i lo = _mm_srlv_epi32(_mm_shuffle_epi32(_mm_loadl_epi64((const __m128i*)s), 0x44), _mm_setr_epi32(0, 0, 4, 4));
  const __m128i hi = _mm_srlv_epi32(_mm_set1_epi32((int)tmp), _mm_setr_epi32(0, 2, 4, 6));
  return _mm_or_si128(_mm_and_si128(lo, _mm_set1_epi8(0x0F)), _mm_slli_epi32(_mm_and_si128(hi, _mm_set1_epi8(0x03)), 4));
}

// Sub-block order "split": the even sub-blocks' 8 int16 in the low lane, the odd ones' in the high
// lane, so that values 32j .. 32j + 31 (sub-block 2j in the low lane, 2j + 1 in the high one) take
// their multipliers by one in-lane shuffle (scale_pair). 16 bytes (int8) -> split int16:
static inline __m256i split_bytes(__m128i v) {
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
}
// the 16 bsums of an activation superblock, split (a dot product with split multipliers: the same
// integer as in sub-block order)
static inline __m256i split_bsums(const int16_t* bsums) {
  const __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i*)bsums),
                                        _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  return _mm256_permute4x64_epi64(v, 0xD8);
}
// multipliers of values 32j .. 32j + 31: sub-block 2j's in the low lane, 2j + 1's in the high one
static inline __m256i scale_pair(__m256i split, int j) {
  return _mm256_shuffle_epi8(split, _mm256_set1_epi16((short)(0x0100 * (2 * j + 1) + 2 * j)));
}

// A superblock's multipliers (Q2_K: sc, Q3_K: sc - 32) and Q2_K's minima, split (int16).
template <bool Q3>
static inline void lowbit_scales(const uint8_t* blk, __m256i* sc, __m256i* mn) {
  if constexpr (Q3) {
    *sc = split_bytes(_mm_sub_epi8(q3_scales_v(((const BlockQ3_K*)blk)->scales), _mm_set1_epi8(32)));
  } else {
    const __m128i raw = _mm_loadu_si128((const __m128i*)((const BlockQ2_K*)blk)->scales), m4 = _mm_set1_epi8(0x0F);
    *sc = split_bytes(_mm_and_si128(raw, m4));
    *mn = split_bytes(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
  }
}

// Q3_K's hmask (Q2_K: none)
template <bool Q3>
static inline __m256i load_hmask(const uint8_t* blk) {
  if constexpr (Q3) return _mm256_loadu_si256((const __m256i*)((const BlockQ3_K*)blk)->hmask);
  return _mm256_setzero_si256();
}

// values 32j .. 32j + 31 of the superblock (0..3, Q3_K 0..7): bits = qs[32h .. 32h + 31] for
// j = 4h + t, hm the Q3_K hmask (its bit j moved to bit 2, the bit alone in its byte)
template <bool Q3>
static inline __m256i lowbit_values(__m256i bits, __m256i hm, int j) {
  __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * (j % 4)), _mm256_set1_epi8(0x03));
  if constexpr (Q3) {
    const __m256i hb = j <= 2 ? _mm256_slli_epi16(hm, 2 - j) : _mm256_srli_epi16(hm, j - 2);
    q = _mm256_or_si256(q, _mm256_and_si256(hb, _mm256_set1_epi8(0x04)));
  }
  return q;
}
#endif

#ifdef OPENTGI_AVX512
// two rows' 256-bit vectors as one: a in the low half, b in the high one
static inline __m512i pair512(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
// lowbit_values and scale_pair on two rows at once (every step within a 128-bit lane or a byte)
template <bool Q3>
static inline __m512i lowbit_values512(__m512i bits, __m512i hm, int j) {
  __m512i q = _mm512_and_si512(_mm512_srli_epi16(bits, 2 * (j % 4)), _mm512_set1_epi8(0x03));
  if constexpr (Q3) {
    const __m512i hb = j <= 2 ? _mm512_slli_epi16(hm, 2 - j) : _mm512_srli_epi16(hm, j - 2);
    q = _mm512_or_si512(q, _mm512_and_si512(hb, _mm512_set1_epi8(0x04)));
  }
  return q;
}
static inline __m512i scale_pair512(__m512i split, int j) {
  return _mm512_shuffle_epi8(split, _mm512_set1_epi16((short)(0x0100 * (2 * j + 1) + 2 * j)));
}
#endif

template <bool Q3>
struct TileLowBit {
  using Block = std::conditional_t<Q3, BlockQ3_K, BlockQ2_K>;

  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const Block* w = (const Block*)wr;
    const ActQ8K* a[R];
    float acc[R], accm[R];
    start_tile(act, stride, a, acc, accm);
    for (int b = 0; b < K / QK_K; ++b) {
      const Block& x = w[b];
      const float d = fp16_to_fp32(x.d);
#ifdef OPENTGI_AVX2
      __m256i sc, mn;  // split: each sub-block's multiplier and (Q2_K) minimum
      lowbit_scales<Q3>((const uint8_t*)&x, &sc, &mn);
      if constexpr (Q3) mn = sc;
      __m256i q[8], s[8];  // values 32j .. 32j + 31 of the superblock, their multipliers
      const __m256i hm = load_hmask<Q3>((const uint8_t*)&x);
      for (int h = 0; h < 2; ++h) {
        const __m256i bits = _mm256_loadu_si256((const __m256i*)(x.qs + 32 * h));
        for (int t = 0; t < 4; ++t) {
          q[4 * h + t] = lowbit_values<Q3>(bits, hm, 4 * h + t);
          s[4 * h + t] = scale_pair(sc, 4 * h + t);
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
        offset = hsum_i32(_mm256_madd_epi16(mn, split_bsums(y.bsums)));
        __m256i sum = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i p = _mm256_maddubs_epi16(q[c], _mm256_loadu_si256((const __m256i*)(y.qs + 32 * c)));
          sum = madd_add(sum, p, s[c]);
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

#ifdef OPENTGI_AVX2
  // Eight weight rows (row_bytes apart) at once against R activation rows, output c in float lane c
  // by run<R>'s arithmetic (out[r * ldo + c]): each row's exact superblock total (Q3_K: with its
  // -4 * offset, as run<R> subtracts it) and Q2_K's offset come out in column order (reduce8), then
  // the same float products per superblock. int32 holds every partial sum: Q2_K |total| <= 16 * 15
  // * 16 * 3 * 127 < 2^21, offset <= 16 * 15 * 2032 < 2^19; Q3_K |total| <= 16 * 32 * 16 * 7 * 127
  // + 4 * 16 * 32 * 2032 < 2^24 (4 * bsum <= 8128 stays an int16).
  static constexpr bool has_run8 = true;
  template <int R>
  static inline void run8(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                          float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ8K* a[R];
    __m256 acc[R], accm[R];
    start_tile(act, stride, a, acc, accm);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(Block);
      prefetch_next(wr, row_bytes, b, nb);
      __m256i bs[R];  // the activation rows' bsums, split (Q3_K: times 4)
      for (int r = 0; r < R; ++r) {
        bs[r] = split_bsums(a[r][b].bsums);
        if constexpr (Q3) bs[r] = _mm256_slli_epi16(bs[r], 2);
      }
      __m256i sums[R][8], offs[Q3 ? 1 : R][8];
#ifdef OPENTGI_AVX512  // rows c and c + 1 side by side, one in each 256-bit half: the same integers
      for (int c = 0; c < 8; c += 2) {
        __m256i sc2[2], mn2[2], hm2[2];
        for (int i = 0; i < 2; ++i) {
          const uint8_t* x = base + (c + i) * row_bytes;
          lowbit_scales<Q3>(x, &sc2[i], &mn2[i]);
          if constexpr (!Q3)
            for (int r = 0; r < R; ++r) offs[r][c + i] = _mm256_madd_epi16(mn2[i], bs[r]);
          hm2[i] = load_hmask<Q3>(x);
        }
        const __m512i sc = pair512(sc2[0], sc2[1]), hm = pair512(hm2[0], hm2[1]);
        __m512i sum[R];
        for (int r = 0; r < R; ++r)
          sum[r] = Q3 ? _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_madd_epi16(sc, pair512(bs[r], bs[r])))
                      : _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
          const __m512i bits = pair512(
              _mm256_loadu_si256((const __m256i*)(((const Block*)(base + c * row_bytes))->qs + 32 * h)),
              _mm256_loadu_si256((const __m256i*)(((const Block*)(base + (c + 1) * row_bytes))->qs + 32 * h)));
          for (int t = 0; t < 4; ++t) {
            const int j = 4 * h + t;
            const __m512i q = lowbit_values512<Q3>(bits, hm, j), sv = scale_pair512(sc, j);
            for (int r = 0; r < R; ++r) {
              const __m512i y = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(a[r][b].qs + 32 * j)));
              sum[r] = _mm512_dpwssd_epi32(sum[r], _mm512_maddubs_epi16(q, y), sv);
            }
          }
        }
        for (int r = 0; r < R; ++r) {
          sums[r][c] = _mm512_castsi512_si256(sum[r]);
          sums[r][c + 1] = _mm512_extracti64x4_epi64(sum[r], 1);
        }
      }
#else
      for (int c = 0; c < 8; ++c) {
        const Block& x = *(const Block*)(base + c * row_bytes);
        __m256i sc, mn;
        lowbit_scales<Q3>((const uint8_t*)&x, &sc, &mn);
        if constexpr (!Q3)
          for (int r = 0; r < R; ++r) offs[r][c] = _mm256_madd_epi16(mn, bs[r]);
        const __m256i hm = load_hmask<Q3>((const uint8_t*)&x);
        __m256i sum[R];
        for (int r = 0; r < R; ++r) sum[r] = Q3 ? _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(sc, bs[r]))
                                                : _mm256_setzero_si256();
        for (int h = 0; h < 2; ++h) {
          const __m256i bits = _mm256_loadu_si256((const __m256i*)(x.qs + 32 * h));
          for (int t = 0; t < 4; ++t) {
            const int j = 4 * h + t;
            const __m256i q = lowbit_values<Q3>(bits, hm, j), s = scale_pair(sc, j);
            for (int r = 0; r < R; ++r) {
              const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i*)(a[r][b].qs + 32 * j)));
              sum[r] = madd_add(sum[r], p, s);
            }
          }
        }
        for (int r = 0; r < R; ++r) sums[r][c] = sum[r];
      }
#endif
      const __m256 d = fp16_8(base + offsetof(Block, d), row_bytes);
      for (int r = 0; r < R; ++r) {
        const __m256 dy = _mm256_mul_ps(d, _mm256_set1_ps(a[r][b].d));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dy, _mm256_cvtepi32_ps(reduce8(sums[r]))));
      }
      if constexpr (!Q3) {
        const __m256 dmin = fp16_8(base + offsetof(BlockQ2_K, dmin), row_bytes);
        for (int r = 0; r < R; ++r) {
          const __m256 dy = _mm256_mul_ps(dmin, _mm256_set1_ps(a[r][b].d));
          accm[r] = _mm256_add_ps(accm[r], _mm256_mul_ps(dy, _mm256_cvtepi32_ps(reduce8(offs[r]))));
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, Q3 ? acc[r] : _mm256_sub_ps(acc[r], accm[r]));
  }

#ifdef OPENTGI_AVX512
  // Sixteen weight rows at once, row c's sums in int32 lane c: each 16-value sub-block's dot by
  // VNNI (the rows' qs and hmask bytes transposed, four a lane, against the activations' four
  // bytes broadcast), times its multiplier; the offsets (Q2_K's minima, Q3_K's -4) by VNNI's 16-bit
  // multiply-add on pairs of multipliers and bsums. run8's integers and float arithmetic lane by lane.
  // (S = 16: the rows repacked, r16.h.)
  static constexpr int rows = BYTE_TILE_ROWS;
  static constexpr int run16_from = 2;
  template <int R, int S = 1>
  static inline void run16(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                           float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ8K* a[R];
    __m512 acc[R], accm[R];
    start_tile(act, stride, a, acc, accm);
    const __m512i m3 = _mm512_set1_epi8(0x03), m4 = _mm512_set1_epi8(0x0F), bit2 = _mm512_set1_epi8(0x04);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(Block) * S;
      prefetch_blocks16<S>(wr, row_bytes, base, sizeof(Block), b, nb);
      __m512i sw[4];  // the multipliers' bytes (Q3_K: sc - 32; Q2_K: sc), four sub-blocks a word
      __m512i mw[4];  // Q2_K: the minima's bytes, as sw
      __m512 d, dmin = _mm512_setzero_ps();
      if constexpr (Q3) {
        __m512i raw[4];  // bytes 92..107: raw[1..3] the 12 scale bytes
        words16<S>(base + (offsetof(BlockQ3_K, scales) - 4) * S, row_bytes, raw);
        if constexpr (S == 16) d = d16<S>(base + offsetof(BlockQ3_K, d) * S, row_bytes);  // the sixteen d side by side
        else d = fp16_lanes16<true>(header16(base + offsetof(BlockQ3_K, d) - 2, row_bytes));
        const __m512i k4 = _mm512_set1_epi32(0x0F0F0F0F), k2 = _mm512_set1_epi32(0x03030303);
        const __m512i a0 = raw[1], a1 = raw[2], tmp = raw[3];
        sw[0] = _mm512_or_si512(_mm512_and_si512(a0, k4), _mm512_slli_epi32(_mm512_and_si512(tmp, k2), 4));
        sw[1] = _mm512_or_si512(_mm512_and_si512(a1, k4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(tmp, 2), k2), 4));
        sw[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a0, 4), k4),
                                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(tmp, 4), k2), 4));
        sw[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a1, 4), k4),
                                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(tmp, 6), k2), 4));
        for (int i = 0; i < 4; ++i) sw[i] = _mm512_sub_epi8(sw[i], _mm512_set1_epi8(32));
      } else {
        words16<S>(base + offsetof(BlockQ2_K, scales) * S, row_bytes, sw);
        const __m512i head = header16<S>(base + offsetof(BlockQ2_K, d) * S, row_bytes);
        d = fp16_lanes16<false>(head);
        dmin = fp16_lanes16<true>(head);
        for (int i = 0; i < 4; ++i) {
          mw[i] = _mm512_and_si512(_mm512_srli_epi16(sw[i], 4), m4);
          sw[i] = _mm512_and_si512(sw[i], m4);
        }
      }
      // sub-block k's multiplier as int32 lanes (Q3_K's signed); pairs[i]: sub-blocks 2i, 2i + 1 as int16
      __m512i sc[16], pairs[8], mpairs[Q3 ? 1 : 8];
      for (int i = 0; i < 4; ++i) {
        for (int k = 0; k < 4; ++k)
          sc[4 * i + k] = Q3 ? _mm512_srai_epi32(_mm512_slli_epi32(sw[i], 24 - 8 * k), 24)
                             : _mm512_and_si512(_mm512_srli_epi32(sw[i], 8 * k), _mm512_set1_epi32(0xFF));
        pairs[2 * i] = Q3 ? _mm512_srai_epi16(_mm512_shuffle_epi8(sw[i], pair_pick<0, true>()), 8)
                          : _mm512_shuffle_epi8(sw[i], pair_pick<0, false>());
        pairs[2 * i + 1] = Q3 ? _mm512_srai_epi16(_mm512_shuffle_epi8(sw[i], pair_pick<1, true>()), 8)
                              : _mm512_shuffle_epi8(sw[i], pair_pick<1, false>());
        if constexpr (!Q3) {
          mpairs[2 * i] = _mm512_shuffle_epi8(mw[i], pair_pick<0, false>());
          mpairs[2 * i + 1] = _mm512_shuffle_epi8(mw[i], pair_pick<1, false>());
        }
      }
      __m512i total[R], offset[R];
      for (int r = 0; r < R; ++r) {
        const int16_t* bs = a[r][b].bsums;
        __m512i o = _mm512_setzero_si512();  // Q3_K: sum_k sc_k * bsum_k; Q2_K: sum_k m_k * bsum_k
        for (int i = 0; i < 8; ++i) o = dpwssd_word(o, Q3 ? pairs[i] : mpairs[i], bs + 2 * i);
        offset[r] = o;
        total[r] = Q3 ? _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(o, 2)) : _mm512_setzero_si512();
      }
      for (int u = 0; u < 2; ++u) {  // bytes l = 16u .. 16u + 15 of qs's 32-byte runs and of hmask
        __m512i hm[4];
        if constexpr (Q3) words16<S>(base + (offsetof(BlockQ3_K, hmask) + 16 * u) * S, row_bytes, hm);
        for (int h = 0; h < 2; ++h) {
          __m512i qb[4];
          words16<S>(base + (offsetof(Block, qs) + 32 * h + 16 * u) * S, row_bytes, qb);
          for (int t = 0; t < 4; ++t) {  // values 128h + 32t + l: sub-block 8h + 2t + u
            const int k = 8 * h + 2 * t + u, j = 4 * h + t;
            // Q2_K at one or two rows: the values left in place (q * 4^t <= 192, still a byte),
            // each dot shifted back exactly (a multiple of 4^t): one shift a row instead of four
            constexpr bool in_place = !Q3 && R <= 2;
            __m512i w[4];
            for (int g = 0; g < 4; ++g) {
              w[g] = in_place ? _mm512_and_si512(qb[g], _mm512_set1_epi8((char)(3 << (2 * t))))
                              : _mm512_and_si512(_mm512_srli_epi16(qb[g], 2 * t), m3);
              if constexpr (Q3) {  // hmask bit j to bit 2
                const __m512i hb = j <= 2 ? _mm512_slli_epi16(hm[g], 2 - j) : _mm512_srli_epi16(hm[g], j - 2);
                w[g] = _mm512_or_si512(w[g], _mm512_and_si512(hb, bit2));
              }
            }
            for (int r = 0; r < R; ++r) {
              const int8_t* yq = a[r][b].qs + 16 * k;
              __m512i dot = _mm512_setzero_si512();
              for (int g = 0; g < 4; ++g) dot = dpbusd_word(dot, w[g], yq + 4 * g);
              if (in_place && t > 0) dot = _mm512_srai_epi32(dot, 2 * t);
              total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(dot, sc[k]));
            }
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 yd = _mm512_set1_ps(a[r][b].d);
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(d, yd), _mm512_cvtepi32_ps(total[r])));
        if constexpr (!Q3)
          accm[r] = _mm512_add_ps(accm[r], _mm512_mul_ps(_mm512_mul_ps(dmin, yd), _mm512_cvtepi32_ps(offset[r])));
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, Q3 ? acc[r] : _mm512_sub_ps(acc[r], accm[r]));
  }
#endif
#endif
};

}  // namespace

void OPENTGI_FN(matmul_q2_k_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                                 int K, float* out, int ldo) {
  drive_r16<TileLowBit<false>>(w, rb, sizeof(BlockQ2_K), act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q3_k_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                                 int K, float* out, int ldo) {
  drive_r16<TileLowBit<true>>(w, rb, sizeof(BlockQ3_K), act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q2_k)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<TileLowBit<false>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q3_k)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<TileLowBit<true>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

}  // namespace opentgi
