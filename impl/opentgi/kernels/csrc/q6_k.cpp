// Q6_K (w = d * sc * (q - 32), 16 sub-blocks of 16 with int8 sc) against ActQ8K. As Q4_K: exact
// integer sums per superblock (the -32 offset taken as 32 * sum_k sc_k * bsum_k), one float added
// per superblock in order, so AVX2 and scalar agree bit for bit; AVX2 computes eight outputs at once
// (one float lane each) by exactly that arithmetic. The wide form (TileQ6KWide) takes 16-bit
// activations the same way. One or two rows read the eight weight rows in memory order
// (in_memory_order8): Q6_K's unpacking keeps the cores busy enough that the interleaved order's
// waits on memory showed; the lighter formats keep that order.
#include <cstddef>

#include "tiles.h"

namespace opentgi {
namespace {

#ifdef OPENTGI_AVX2
// Values 128h + 32k .. + 31 of the superblock (0..63) into q[k], k < 4: the 2-bit pairs of qh moved
// to bits 4-5 (shifts within 16-bit lanes; the mask drops what crosses a byte)
static inline void q6k_values(const BlockQ6_K& x, int h, __m256i* q) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i l1 = _mm256_loadu_si256((const __m256i*)(x.ql + 64 * h));
  const __m256i l2 = _mm256_loadu_si256((const __m256i*)(x.ql + 64 * h + 32));
  const __m256i hb = _mm256_loadu_si256((const __m256i*)(x.qh + 32 * h));
  q[0] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
  q[1] = _mm256_or_si256(_mm256_and_si256(l2, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(hb, m30));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
}

// sums[i][c]: eight int32 lanes whose total is the exact superblock sum of weight row c (at x, its
// -32 offset folded in by the sums per 16, bs[i]) against the 256 activation bytes ys[i] (ActQ8K's
// order); the row's 6-bit values unpacked once for all N.
template <int N>
static inline void q6k_dots1(const BlockQ6_K& x, const int8_t* const* ys, const int16_t* const* bs,
                             __m256i (*sums)[8], int c) {
  // scale 2k in the low half, 2k + 1 in the high half, from int16 scales 0..7 (or 8..15) in both
  const __m256i pick[4] = {
      _mm256_set_m128i(_mm_set1_epi16(0x0302), _mm_set1_epi16(0x0100)),
      _mm256_set_m128i(_mm_set1_epi16(0x0706), _mm_set1_epi16(0x0504)),
      _mm256_set_m128i(_mm_set1_epi16(0x0B0A), _mm_set1_epi16(0x0908)),
      _mm256_set_m128i(_mm_set1_epi16(0x0F0E), _mm_set1_epi16(0x0D0C))};
  __m256i q[8];  // values 32k .. 32k + 31 of the superblock, 0..63
  for (int h = 0; h < 2; ++h) q6k_values(x, h, q + 4 * h);
  const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)x.scales));  // 0..7 | 8..15
  const __m256i lo = _mm256_permute4x64_epi64(s16, 0x44), hi = _mm256_permute4x64_epi64(s16, 0xEE);
  __m256i sc[8];
  for (int k = 0; k < 8; ++k) sc[k] = _mm256_shuffle_epi8(k < 4 ? lo : hi, pick[k % 4]);
#ifdef OPENTGI_AVX512
  // values 64m .. 64m + 63 in one vector against their 64 activation bytes, VNNI's multiply-add
  // by the scales: lane by lane (fold16) the 256-bit form's sums
  __m512i q2[4], sc2[4];
  for (int m = 0; m < 4; ++m) {
    q2[m] = join256(q[2 * m], q[2 * m + 1]);
    sc2[m] = join256(sc[2 * m], sc[2 * m + 1]);
  }
#endif
  for (int i = 0; i < N; ++i) {
#ifdef OPENTGI_AVX512
    __m512i sum2 = _mm512_setzero_si512();
    for (int m = 0; m < 4; ++m)
      sum2 = _mm512_dpwssd_epi32(sum2, _mm512_maddubs_epi16(q2[m], _mm512_loadu_si512((const void*)(ys[i] + 64 * m))), sc2[m]);
    const __m256i sum = fold16(sum2);
#else
    __m256i sum = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
      const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i*)(ys[i] + 32 * k)));
      sum = madd_add(sum, p, sc[k]);
    }
#endif
    // - 32 * sum_k sc_k * bsum_k
    const __m256i offset = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i*)bs[i]));
    sums[i][c] = _mm256_sub_epi32(sum, _mm256_slli_epi32(offset, 5));
  }
}

// q6k_dots1 for the eight superblocks at base + c * row_bytes
template <int N>
static inline void q6k_dots8(const uint8_t* base, size_t row_bytes, const int8_t* const* ys,
                             const int16_t* const* bs, __m256i (*sums)[8]) {
  for (int c = 0; c < 8; ++c) q6k_dots1<N>(*(const BlockQ6_K*)(base + c * row_bytes), ys, bs, sums, c);
}
#ifdef OPENTGI_AVX512
// Sixteen Q6_K superblocks' scales (at base + c * row_bytes), row c in lane c: sc[k] sub-block k's
// as int32, pairs[m] sub-blocks 2m and 2m + 1 as two int16 (for VNNI's 16-bit multiply-add), and d.
struct Q6KHeaders16 {
  __m512 d;
  __m512i sc[16], pairs[8];
  Q6KHeaders16(const uint8_t* base, size_t row_bytes) {
    d = fp16_lanes16<true>(header16(base + offsetof(BlockQ6_K, d) - 2, row_bytes));  // scales 14, 15 | d
    const __m512i pick0 = pair_pick<0, true>(), pick1 = pair_pick<1, true>();
    __m512i words[4];  // scales 4m .. 4m + 3 in words[m]
    words16(base + offsetof(BlockQ6_K, scales), row_bytes, words);
    for (int m = 0; m < 4; ++m) {
      const __m512i w = words[m];
      for (int i = 0; i < 4; ++i) sc[4 * m + i] = _mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * i), 24);
      pairs[2 * m] = _mm512_srai_epi16(_mm512_shuffle_epi8(w, pick0), 8);
      pairs[2 * m + 1] = _mm512_srai_epi16(_mm512_shuffle_epi8(w, pick1), 8);
    }
  }
};

// Sixteen weight rows' superblocks (at base + c * row_bytes) against N <= 8 streams of 256
// activation bytes ys[i] (ActQ8K's order) with their sums per 16
// bs[i]: total[i] lane c = row c's exact sum_k sc_k * dot_k - 32 * sum_k sc_k * bs_k (|.| < 2^29),
// the q6k_dots1 integer. The rows' ql and qh bytes are transposed 16 at a time (words16: four
// bytes a lane), each 16-value sub-block's 6-bit values assembled as q6k_values does, its dot by
// VNNI against the stream's four bytes broadcast, times its scale; the offset by VNNI's 16-bit
// multiply-add (the scales in pairs against the pairs of sums).
template <int N>
static inline void q6k_totals16(const uint8_t* base, size_t row_bytes, const Q6KHeaders16& hd,
                                const int8_t* const* ys, const int16_t* const* bs, __m512i* total) {
  static_assert(N <= 8, "every sum in registers");
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  for (int i = 0; i < N; ++i) total[i] = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    for (int u = 0; u < 2; ++u) {  // bytes 16u .. 16u + 15 of ql's and qh's 32-byte runs
      __m512i l1[4], l2[4], hb[4];
      words16(base + offsetof(BlockQ6_K, ql) + 64 * h + 16 * u, row_bytes, l1);
      words16(base + offsetof(BlockQ6_K, ql) + 64 * h + 32 + 16 * u, row_bytes, l2);
      words16(base + offsetof(BlockQ6_K, qh) + 32 * h + 16 * u, row_bytes, hb);
      for (int part = 0; part < 4; ++part) {  // values 128h + 32 * part + 16u ..: sub-block 8h + 2 * part + u
        const int k = 8 * h + 2 * part + u;
        __m512i w[4];
        for (int g = 0; g < 4; ++g) {
          switch (part) {
            case 0: w[g] = _mm512_or_si512(_mm512_and_si512(l1[g], m4), _mm512_and_si512(_mm512_slli_epi16(hb[g], 4), m30)); break;
            case 1: w[g] = _mm512_or_si512(_mm512_and_si512(l2[g], m4), _mm512_and_si512(_mm512_slli_epi16(hb[g], 2), m30)); break;
            case 2: w[g] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1[g], 4), m4), _mm512_and_si512(hb[g], m30)); break;
            default: w[g] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l2[g], 4), m4),
                                            _mm512_and_si512(_mm512_srli_epi16(hb[g], 2), m30));
          }
        }
        for (int i = 0; i < N; ++i) {
          const int8_t* yq = ys[i] + 16 * k;
          __m512i dot = _mm512_setzero_si512();
          for (int g = 0; g < 4; ++g) dot = dpbusd_word(dot, w[g], yq + 4 * g);
          total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(dot, hd.sc[k]));
        }
      }
    }
  }
  for (int i = 0; i < N; ++i) {
    __m512i offset = _mm512_setzero_si512();
    for (int m = 0; m < 8; ++m) offset = dpwssd_word(offset, hd.pairs[m], bs[i] + 2 * m);
    total[i] = _mm512_sub_epi32(total[i], _mm512_slli_epi32(offset, 5));
  }
}
#endif
#endif

struct TileQ6K {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const BlockQ6_K* w = (const BlockQ6_K*)wr;
    const ActQ8K* a[R];
    float acc[R];
    start_tile(act, stride, a, acc);
    for (int b = 0; b < K / QK_K; ++b) {
      const BlockQ6_K& x = w[b];
      const float d = fp16_to_fp32(x.d);
#ifdef OPENTGI_AVX2
      __m256i q[8];  // values 32k .. 32k + 31 of the superblock, 0..63
      for (int h = 0; h < 2; ++h) q6k_values(x, h, q + 4 * h);
#else
      uint8_t q[256];
      q6k_unpack(x, q);
#endif
      for (int r = 0; r < R; ++r) {
        const ActQ8K& y = a[r][b];
        int32_t total = 0, offset = 0;
        for (int k = 0; k < 16; ++k) offset += (int32_t)x.scales[k] * y.bsums[k];
#ifdef OPENTGI_AVX2
        __m256i sum = _mm256_setzero_si256();
        for (int k = 0; k < 8; ++k) {
          const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i*)(y.qs + 32 * k)));
          const __m256i s = _mm256_set_m128i(_mm_set1_epi16(x.scales[2 * k + 1]), _mm_set1_epi16(x.scales[2 * k]));
          sum = madd_add(sum, p, s);
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        total = _mm_cvtsi128_si32(s4);
#else
        for (int k = 0; k < 16; ++k) {
          int32_t s = 0;
          for (int i = 0; i < 16; ++i) s += q[16 * k + i] * y.qs[16 * k + i];
          total += x.scales[k] * s;
        }
#endif
        total -= 32 * offset;
        acc[r] += (d * y.d) * (float)total;
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
  }

#ifdef OPENTGI_AVX2
  // Eight weight rows (row_bytes apart) at once against R activation rows, output c in float lane c
  // by run<R>'s arithmetic (out[r * ldo + c]): each row's superblock total (its offset term folded
  // in, exact) comes out in column order (reduce8), then the same float product per superblock;
  // one or two rows form the totals in memory order first (in_memory_order8), the same integers.
  // int32 holds it: |sum_k sc_k * dot_k| <= 16 * 128 * 16 * 63 * 127 < 2^28, |32 * offset| < 2^28.
  static constexpr bool has_run8 = true;
  static constexpr int rows = BYTE_TILE_ROWS;
  template <int R>
  static inline void run8(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                          float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ8K* a[R];
    __m256 acc[R];
    start_tile(act, stride, a, acc);
    auto finish = [&](int b, __m256i (*sums)[8]) {
      const __m256 d = fp16_8(wr + (size_t)b * sizeof(BlockQ6_K) + offsetof(BlockQ6_K, d), row_bytes);
      for (int r = 0; r < R; ++r) {
        const __m256 dy = _mm256_mul_ps(d, _mm256_set1_ps(a[r][b].d));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dy, _mm256_cvtepi32_ps(reduce8(sums[r]))));
      }
    };
    if constexpr (R <= 2) {
      in_memory_order8<R>(wr, row_bytes, sizeof(BlockQ6_K), nb, [&](const uint8_t* x, int b, __m256i (*sums)[8], int c) {
        const int8_t* ys[R];
        const int16_t* bs[R];
        for (int r = 0; r < R; ++r) {
          ys[r] = a[r][b].qs;
          bs[r] = a[r][b].bsums;
        }
        q6k_dots1<R>(*(const BlockQ6_K*)x, ys, bs, sums, c);
      }, finish);
    } else {
      for (int b = 0; b < nb; ++b) {
        const uint8_t* base = wr + (size_t)b * sizeof(BlockQ6_K);
        prefetch_next(wr, row_bytes, b, nb);
        const int8_t* ys[R];
        const int16_t* bs[R];
        for (int r = 0; r < R; ++r) {
          ys[r] = a[r][b].qs;
          bs[r] = a[r][b].bsums;
        }
        __m256i sums[R][8];
        q6k_dots8<R>(base, row_bytes, ys, bs, sums);
        finish(b, sums);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
  }

#ifdef OPENTGI_AVX512
  // Sixteen weight rows at once, row c's exact total in int32 lane c (q6k_totals16), then run8's
  // float arithmetic lane by lane. (The wide form keeps its int16 weights: against byte halves,
  // twice the products, it measured slower from eight rows on.)
  static constexpr int run16_from = 6;
  template <int R>
  static inline void run16(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                           float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ8K* a[R];
    __m512 acc[R];
    start_tile(act, stride, a, acc);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockQ6_K);
      prefetch_next<16>(wr, row_bytes, b, nb);
      const Q6KHeaders16 hd(base, row_bytes);
      const int8_t* ys[R];
      const int16_t* bs[R];
      for (int r = 0; r < R; ++r) {
        ys[r] = a[r][b].qs;
        bs[r] = a[r][b].bsums;
      }
      __m512i total[R];
      q6k_totals16<R>(base, row_bytes, hd, ys, bs, total);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(hd.d, _mm512_set1_ps(a[r][b].d)),
                                                     _mm512_cvtepi32_ps(total[r])));
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
  }
#endif
#endif
};

// Wide activations (ActQ16K): a superblock's weights unpacked once to int16 (q - 32) * sc, the
// offset and scale folded in (|.| <= 32 * 128 = 4096: with |x| <= 16383 an int32 lane's 32 products
// stay below 2^31, common.h), reused by every activation row of the tile; per row the exact total
// (lanes added exactly) and one float product per superblock, on every path.
static inline void unpack_q6k16(const BlockQ6_K& x, int16_t* w16) {
#ifdef OPENTGI_AVX512
  // 32 values a step: sub-blocks 2k and 2k + 1 widened at once, their two scales picked from the
  // sixteen (vpermw)
  const __m512i off = _mm512_set1_epi16(32);
  const __m512i s16 = _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)x.scales)));
  const __m512i pair = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);  // 0 x16 | 1 x16
  for (int h = 0; h < 2; ++h) {
    __m256i q[4];  // values 128h + 32k .. + 31, 0..63
    q6k_values(x, h, q);
    for (int k = 0; k < 4; ++k) {
      const __m512i sc = _mm512_permutexvar_epi16(_mm512_add_epi16(pair, _mm512_set1_epi16(8 * h + 2 * k)), s16);
      _mm512_storeu_si512((void*)(w16 + 128 * h + 32 * k),
                          _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(q[k]), off), sc));
    }
  }
#elif defined(OPENTGI_AVX2)
  const __m256i off = _mm256_set1_epi16(32);
  for (int h = 0; h < 2; ++h) {
    __m256i q[4];  // values 128h + 32k .. + 31, 0..63
    q6k_values(x, h, q);
    for (int k = 0; k < 4; ++k) {
      const int sub = 8 * h + 2 * k;  // the 16-value sub-block of the low half
      int16_t* o = w16 + 128 * h + 32 * k;
      const __m256i lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q[k])), off);
      const __m256i hi = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q[k], 1)), off);
      _mm256_store_si256((__m256i*)o, _mm256_mullo_epi16(lo, _mm256_set1_epi16(x.scales[sub])));
      _mm256_store_si256((__m256i*)(o + 16), _mm256_mullo_epi16(hi, _mm256_set1_epi16(x.scales[sub + 1])));
    }
  }
#else
  q6k_unpack(x, w16);
  for (int i = 0; i < QK_K; ++i) w16[i] = (int16_t)((w16[i] - 32) * x.scales[i / 16]);
#endif
}

struct TileQ6KWide {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const BlockQ6_K* w = (const BlockQ6_K*)wr;
    const ActQ16K* a[R];
    float acc[R];
    start_tile(act, stride, a, acc);
    alignas(32) int16_t w16[QK_K];
    for (int b = 0; b < K / QK_K; ++b) {
      const float d = fp16_to_fp32(w[b].d);
      unpack_q6k16(w[b], w16);
      for (int r = 0; r < R; ++r) {
        const ActQ16K& y = a[r][b];
        acc[r] += (d * y.d) * (float)dot16_exact(w16, y.qs, QK_K);
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
  }

#ifdef OPENTGI_AVX2
  // Eight weight rows at once, output c in float lane c by run<R>'s arithmetic: the eight rows
  // unpacked once a superblock for a tile of up to eight activation rows (wide_dots8).
  static constexpr bool has_run8 = true;
  static constexpr int rows = WIDE_TILE_ROWS;
  static constexpr bool row_blocks = true;
  template <int R>
  static inline void run8(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                          float* out, int ldo) {
#ifndef OPENTGI_AVX512  // AVX-512's 16-bit products beat the byte halves for one and two rows too
    if constexpr (R <= 2) {
      run8_bytes<R>(wr, row_bytes, act, stride, K, out, ldo);
      return;
    }
#endif
    const int nb = K / QK_K;
    const ActQ16K* a[R];
    alignas(32) float acc[R][8] = {};  // in memory: the registers go to the products
    for (int r = 0; r < R; ++r) a[r] = (const ActQ16K*)(act + r * stride);
    alignas(64) int16_t w16[8 * QK_K];
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockQ6_K);
      prefetch_next(wr, row_bytes, b, nb);
      const __m256 d = fp16_8(base + offsetof(BlockQ6_K, d), row_bytes);
      for (int c = 0; c < 8; ++c) unpack_q6k16(*(const BlockQ6_K*)(base + c * row_bytes), w16 + c * QK_K);
      const int16_t* xs[R];
      for (int r = 0; r < R; ++r) xs[r] = a[r][b].qs;
      __m256i sums[R][8];
      wide_dots8<R>(w16, xs, sums);
      for (int r = 0; r < R; ++r) {
        const __m256 dy = _mm256_mul_ps(d, _mm256_set1_ps(a[r][b].d));
        _mm256_store_ps(acc[r], _mm256_add_ps(_mm256_load_ps(acc[r]), _mm256_mul_ps(dy, exact_totals8(sums[r]))));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, _mm256_load_ps(acc[r]));
  }

  // One or two rows on AVX2: the weights' 6-bit values against the activations' byte halves (hi,
  // lo) as the 8-bit kernel multiplies them (the -32 offset by the halves' sums per 16), each half's
  // total exact in int32 (< 2^29, as TileQ6K's), the superblock's total 128 * hi + lo exact until
  // rounded once (exact_combine8): the same integer, so the same bits, as the int16 form. The
  // weights are read in memory order (in_memory_order8).
  template <int R>
  static inline void run8_bytes(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                                float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ16K* a[R];
    __m256 acc[R];
    start_tile(act, stride, a, acc);
    in_memory_order8<2 * R>(wr, row_bytes, sizeof(BlockQ6_K), nb, [&](const uint8_t* x, int b, __m256i (*sums)[8], int c) {
      const int8_t* ys[2 * R];  // row r's high bytes at 2r, low bytes at 2r + 1
      const int16_t* bs[2 * R];
      for (int r = 0; r < R; ++r) {
        const ActQ16KBytes& yb = ((const ActQ16KBytes*)(a[r] + nb))[b];
        ys[2 * r] = yb.hi;
        ys[2 * r + 1] = yb.lo;
        bs[2 * r] = yb.bsums_hi;
        bs[2 * r + 1] = yb.bsums_lo;
      }
      q6k_dots1<2 * R>(*(const BlockQ6_K*)x, ys, bs, sums, c);
    }, [&](int b, __m256i (*sums)[8]) {
      const __m256 d = fp16_8(wr + (size_t)b * sizeof(BlockQ6_K) + offsetof(BlockQ6_K, d), row_bytes);
      for (int r = 0; r < R; ++r) {
        const __m256 dy = _mm256_mul_ps(d, _mm256_set1_ps(a[r][b].d));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dy, exact_combine8(reduce8(sums[2 * r]), reduce8(sums[2 * r + 1]))));
      }
    });
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
  }

#endif
};

}  // namespace

void OPENTGI_FN(matmul_q6_k_wide)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                  int n1, int K, float* out, int ldo) {
  drive<TileQ6KWide>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q6_k)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<TileQ6K>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

}  // namespace opentgi
