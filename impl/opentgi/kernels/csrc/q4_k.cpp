// Q4_K (w = d * sc * q - dmin * m, 8 sub-blocks of 32 with 6-bit sc and m) against ActQ8K.
// Per superblock the integer sums are exact (sum_j sc_j * dot_j and sum_j m_j * sum_j(q_x)), so
// both paths add the same two floats per superblock, in superblock order: AVX2 and scalar agree
// bit for bit, and AVX2 computes eight outputs at once (one float lane each) by exactly that
// arithmetic, the scale and min unpacking, float16 scales and mins sums shared by the eight.
// The wide form (TileQ4KWide) takes 16-bit activations the same way.
#include <cstddef>

#include "kquants16.h"

namespace opentgi {
namespace {

#ifdef OPENTGI_AVX2
// sums[i][c]: eight int32 lanes whose total is weight row c's exact sum_j sc_j * dot_j against the
// 256 activation bytes ys[i] (ActQ8K's order), for the eight superblocks at base + c * row_bytes
// with their scales as kquant_headers8 leaves them; each row's nibbles unpacked once for all N.
#ifdef OPENTGI_AVX512
// In 512-bit steps: sub-blocks 2j and 2j + 1 (a byte vector's low nibbles, then its high ones) in
// one vector against the 64 activation bytes they meet, VNNI's multiply-add by their scales; lane
// by lane (fold16) the 256-bit form's sums.
template <int N>
static inline void q4k_dots8(const uint8_t* base, size_t row_bytes, const int16_t* sc16, const int8_t* const* ys,
                             __m256i (*sums)[8]) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 8; ++c) {
    const uint8_t* qs = base + c * row_bytes + offsetof(BlockQ4_K, qs);
    const int16_t* sc = sc16 + 16 * (c % 4) + 8 * (c / 4);
    __m512i q[4], s[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i bits = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
      q[j] = _mm512_and_si512(join256(bits, _mm256_srli_epi16(bits, 4)), mask);
      s[j] = join256(_mm256_set1_epi16(sc[2 * j]), _mm256_set1_epi16(sc[2 * j + 1]));
    }
    for (int i = 0; i < N; ++i) {
      const int8_t* yq = ys[i];
      __m512i sum = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j)
        sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(q[j], _mm512_loadu_si512((const void*)(yq + 64 * j))), s[j]);
      sums[i][c] = fold16(sum);
    }
  }
}
#else
template <int N>
static inline void q4k_dots8(const uint8_t* base, size_t row_bytes, const int16_t* sc16, const int8_t* const* ys,
                             __m256i (*sums)[8]) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 8; ++c) {
    const uint8_t* qs = base + c * row_bytes + offsetof(BlockQ4_K, qs);
    const int16_t* sc = sc16 + 16 * (c % 4) + 8 * (c / 4);
    __m256i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i bits = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
      lo[j] = _mm256_and_si256(bits, mask);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), mask);
    }
    for (int i = 0; i < N; ++i) {
      const int8_t* yq = ys[i];
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i pl = _mm256_maddubs_epi16(lo[j], _mm256_loadu_si256((const __m256i*)(yq + 64 * j)));
        const __m256i ph = _mm256_maddubs_epi16(hi[j], _mm256_loadu_si256((const __m256i*)(yq + 64 * j + 32)));
        sum = madd_add(sum, pl, _mm256_set1_epi16(sc[2 * j]));
        sum = madd_add(sum, ph, _mm256_set1_epi16(sc[2 * j + 1]));
      }
      sums[i][c] = sum;
    }
  }
}
#endif
#endif

struct TileQ4K {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const BlockQ4_K* w = (const BlockQ4_K*)wr;
    const ActQ8K* a[R];
    float acc[R], accm[R];
    start_tile(act, stride, a, acc, accm);
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
          sum = madd_add(sum, pl, _mm256_set1_epi16(sc[2 * j]));
          sum = madd_add(sum, ph, _mm256_set1_epi16(sc[2 * j + 1]));
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
  static constexpr int rows = BYTE_TILE_ROWS;
  template <int R>
  static inline void run8(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                          float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ8K* a[R];
    __m256 acc[R], accm[R];
    start_tile(act, stride, a, acc, accm);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockQ4_K);
      prefetch_next(wr, row_bytes, b, nb);
      __m256 d, dmin;
      alignas(32) int16_t sc16[64];
      __m256i mins[4];
      kquant_headers8(base, row_bytes, &d, &dmin, sc16, mins);
      const int8_t* ys[R];
      for (int r = 0; r < R; ++r) ys[r] = a[r][b].qs;
      __m256i sums[R][8];
      q4k_dots8<R>(base, row_bytes, sc16, ys, sums);
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
  // Sixteen weight rows at once, row c's exact sums in int32 lane c (kquant_totals16, kquant_mins16):
  // the same integers as run8's, then its float arithmetic lane by lane.
  // (S = 16: the rows repacked, r16.h.)
  static constexpr int run16_from = 2;
  template <int R, int S = 1>
  static inline void run16(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                           float* out, int ldo) {
    kquant_run16<R, false, S>(wr, row_bytes, sizeof(BlockQ4_K), offsetof(BlockQ4_K, qs), 0, act, stride, K, out, ldo);
  }
#endif
#endif
};

// Wide activations (ActQ16K): a superblock's weights unpacked once to int16 with their sub-block
// scale multiplied in (q * sc <= 945), reused by every activation row of the tile; per row the
// exact total sum_i q_i * sc_i * x_i (int32 lanes of 32 products, < 2^29, added exactly: common.h)
// and mins sum_j m_j * sums_j (|.| <= 8 * 63 * 32 * 16383 < 2^28), then the same two float
// products per superblock as against ActQ8K, on every path.
static inline void unpack_q4k16(const uint8_t* qs, const int16_t* sc, int16_t* w16) {
#ifdef OPENTGI_AVX512
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {  // a sub-block of 32 a step
    const __m256i bits = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
    const __m256i lo = _mm256_and_si256(bits, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), mask);
    _mm512_storeu_si512((void*)(w16 + 64 * j), _mm512_mullo_epi16(_mm512_cvtepu8_epi16(lo), _mm512_set1_epi16(sc[2 * j])));
    _mm512_storeu_si512((void*)(w16 + 64 * j + 32),
                        _mm512_mullo_epi16(_mm512_cvtepu8_epi16(hi), _mm512_set1_epi16(sc[2 * j + 1])));
  }
#elif defined(OPENTGI_AVX2)
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m256i bits = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
    const __m256i lo = _mm256_and_si256(bits, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), mask);
    const __m256i sl = _mm256_set1_epi16(sc[2 * j]), sh = _mm256_set1_epi16(sc[2 * j + 1]);
    int16_t* o = w16 + 64 * j;
    _mm256_store_si256((__m256i*)o, _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)), sl));
    _mm256_store_si256((__m256i*)(o + 16), _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)), sl));
    _mm256_store_si256((__m256i*)(o + 32), _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)), sh));
    _mm256_store_si256((__m256i*)(o + 48), _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1)), sh));
  }
#else
  for (int j = 0; j < 4; ++j) {
    for (int i = 0; i < 32; ++i) {
      w16[64 * j + i] = (int16_t)((qs[32 * j + i] & 0x0F) * sc[2 * j]);
      w16[64 * j + 32 + i] = (int16_t)((qs[32 * j + i] >> 4) * sc[2 * j + 1]);
    }
  }
#endif
}

struct TileQ4KWide {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const BlockQ4_K* w = (const BlockQ4_K*)wr;
    const ActQ16K* a[R];
    float acc[R], accm[R];
    start_tile(act, stride, a, acc, accm);
    alignas(32) int16_t w16[QK_K];
    for (int b = 0; b < K / QK_K; ++b) {
      const BlockQ4_K& x = w[b];
      const float d = fp16_to_fp32(x.d), dmin = fp16_to_fp32(x.dmin);
      uint8_t sc[8], mn[8];
      scales_mins(x.scales, sc, mn);
      int16_t sc16[8];
      for (int j = 0; j < 8; ++j) sc16[j] = sc[j];
      unpack_q4k16(x.qs, sc16, w16);
      for (int r = 0; r < R; ++r) {
        const ActQ16K& y = a[r][b];
        int32_t mins = 0;
        for (int j = 0; j < 8; ++j) mins += (int32_t)mn[j] * y.sums[j];
        const int64_t total = dot16_exact(w16, y.qs, QK_K);
        acc[r] += (d * y.d) * (float)total;
        accm[r] += (dmin * y.d) * (float)mins;
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = acc[r] - accm[r];
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
    if constexpr (R <= 2) {
      run8_bytes<R>(wr, row_bytes, act, stride, K, out, ldo);
      return;
    }
    const int nb = K / QK_K;
    const ActQ16K* a[R];
    alignas(32) float acc[R][8] = {}, accm[R][8] = {};  // in memory: the registers go to the products
    for (int r = 0; r < R; ++r) a[r] = (const ActQ16K*)(act + r * stride);
    alignas(64) int16_t w16[8 * QK_K];
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockQ4_K);
      prefetch_next(wr, row_bytes, b, nb);
      __m256 d, dmin;
      alignas(32) int16_t sc16[64];
      __m256i mins[4];
      kquant_headers8(base, row_bytes, &d, &dmin, sc16, mins);
      {  // the mins term first, so its registers are free for the products
        __m256i mrow[8];  // row c's 8 mins as int32
        for (int c = 0; c < 4; ++c) {
          mrow[c] = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(mins[c]));
          mrow[c + 4] = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(mins[c], 1));
        }
        for (int r = 0; r < R; ++r) {
          const ActQ16K& y = a[r][b];
          const __m256i ys = _mm256_loadu_si256((const __m256i*)y.sums);
          __m256i mp[8];
          for (int c = 0; c < 8; ++c) mp[c] = _mm256_mullo_epi32(mrow[c], ys);
          const __m256 dy = _mm256_mul_ps(dmin, _mm256_set1_ps(y.d));
          _mm256_store_ps(accm[r], _mm256_add_ps(_mm256_load_ps(accm[r]), _mm256_mul_ps(dy, _mm256_cvtepi32_ps(reduce8(mp)))));
        }
      }
      for (int c = 0; c < 8; ++c)
        unpack_q4k16(base + c * row_bytes + offsetof(BlockQ4_K, qs), sc16 + 16 * (c % 4) + 8 * (c / 4), w16 + c * QK_K);
      const int16_t* xs[R];
      for (int r = 0; r < R; ++r) xs[r] = a[r][b].qs;
      __m256i sums[R][8];
      wide_dots8<R>(w16, xs, sums);
      for (int r = 0; r < R; ++r) {
        const __m256 dy = _mm256_mul_ps(d, _mm256_set1_ps(a[r][b].d));
        _mm256_store_ps(acc[r], _mm256_add_ps(_mm256_load_ps(acc[r]), _mm256_mul_ps(dy, exact_totals8(sums[r]))));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, _mm256_sub_ps(_mm256_load_ps(acc[r]), _mm256_load_ps(accm[r])));
  }

  // One or two rows: the weights' nibbles against the activations' byte halves (hi, lo) as the
  // 8-bit kernel multiplies them, each half's total exact in int32 (< 2^25, as TileQ4K's), the
  // superblock's total 128 * hi + lo exact until rounded once (exact_combine8): the same integer,
  // so the same bits, as the int16 form.
  template <int R>
  static inline void run8_bytes(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                                float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ16K* a[R];
    __m256 acc[R], accm[R];
    start_tile(act, stride, a, acc, accm);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockQ4_K);
      prefetch_next(wr, row_bytes, b, nb);
      __m256 d, dmin;
      alignas(32) int16_t sc16[64];
      __m256i mins[4];
      kquant_headers8(base, row_bytes, &d, &dmin, sc16, mins);
      const int8_t* ys[2 * R];  // row r's high bytes at 2r, low bytes at 2r + 1
      for (int r = 0; r < R; ++r) {
        const ActQ16KBytes& yb = ((const ActQ16KBytes*)(a[r] + nb))[b];
        ys[2 * r] = yb.hi;
        ys[2 * r + 1] = yb.lo;
      }
      __m256i sums[2 * R][8];
      q4k_dots8<2 * R>(base, row_bytes, sc16, ys, sums);
      __m256i mrow[8];  // row c's 8 mins as int32
      for (int c = 0; c < 4; ++c) {
        mrow[c] = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(mins[c]));
        mrow[c + 4] = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(mins[c], 1));
      }
      for (int r = 0; r < R; ++r) {
        const ActQ16K& y = a[r][b];
        const __m256i ys = _mm256_loadu_si256((const __m256i*)y.sums);
        __m256i mp[8];
        for (int c = 0; c < 8; ++c) mp[c] = _mm256_mullo_epi32(mrow[c], ys);
        const __m256 yd = _mm256_set1_ps(y.d);
        const __m256 total = exact_combine8(reduce8(sums[2 * r]), reduce8(sums[2 * r + 1]));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_mul_ps(d, yd), total));
        accm[r] = _mm256_add_ps(accm[r], _mm256_mul_ps(_mm256_mul_ps(dmin, yd), _mm256_cvtepi32_ps(reduce8(mp))));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, _mm256_sub_ps(acc[r], accm[r]));
  }

#ifdef OPENTGI_AVX512
  // Sixteen weight rows at once: the weights' nibbles against each activation row's byte halves
  // (hi, lo) as TileQ4K::run16 forms them (kquant_totals16), the total 128 * hi + lo exact until
  // rounded once; the mins term sum_j m_j * sums_j exact in int32 (< 2^28): run8's integers and
  // float arithmetic lane by lane.
  // (S = 16: the rows repacked, r16.h.)
  static constexpr int run16_from = 2;
  template <int R, int S = 1>
  static inline void run16(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                           float* out, int ldo) {
    if constexpr (R > 4) {  // four rows (eight byte streams) at a time, the sums in registers
      run16<4, S>(wr, row_bytes, act, stride, K, out, ldo);
      run16<R - 4, S>(wr, row_bytes, act + 4 * stride, stride, K, out + 4 * ldo, ldo);
    } else {
      run16_rows<R, S>(wr, row_bytes, act, stride, K, out, ldo);
    }
  }
  template <int R, int S>
  static inline void run16_rows(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                                float* out, int ldo) {
    const int nb = K / QK_K;
    const ActQ16K* a[R];
    alignas(64) float acc[R][16] = {}, accm[R][16] = {};  // in memory: the registers go to the products
    for (int r = 0; r < R; ++r) a[r] = (const ActQ16K*)(act + r * stride);
    const __m512i byte = _mm512_set1_epi32(0xFF);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockQ4_K) * S;
      prefetch_blocks16<S>(wr, row_bytes, base, sizeof(BlockQ4_K), b, nb);
      KQuantHeaders16<S> hd(base, row_bytes);
      const int8_t* ys[2 * R];  // row r's high bytes at 2r, low bytes at 2r + 1
      for (int r = 0; r < R; ++r) {
        const ActQ16KBytes& yb = ((const ActQ16KBytes*)(a[r] + nb))[b];
        ys[2 * r] = yb.hi;
        ys[2 * r + 1] = yb.lo;
      }
      __m512i total[2 * R];
      kquant_totals16<2 * R, false, S>(base + offsetof(BlockQ4_K, qs) * S, nullptr, row_bytes, hd.sc, ys, total);
      __m512i mn[8];  // row c's min of sub-block j in lane c
      for (int j = 0; j < 4; ++j) {
        mn[j] = _mm512_and_si512(_mm512_srli_epi32(hd.mn_lo, 8 * j), byte);
        mn[j + 4] = _mm512_and_si512(_mm512_srli_epi32(hd.mn_hi, 8 * j), byte);
      }
      for (int r = 0; r < R; ++r) {
        const ActQ16K& y = a[r][b];
        __m512i mins = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) mins = _mm512_add_epi32(mins, _mm512_mullo_epi32(mn[j], _mm512_set1_epi32(y.sums[j])));
        const __m512 yd = _mm512_set1_ps(y.d);
        _mm512_store_ps(acc[r], _mm512_add_ps(_mm512_load_ps(acc[r]), _mm512_mul_ps(_mm512_mul_ps(hd.d, yd),
                                                                                   exact_combine16(total[2 * r], total[2 * r + 1]))));
        _mm512_store_ps(accm[r], _mm512_add_ps(_mm512_load_ps(accm[r]),
                                               _mm512_mul_ps(_mm512_mul_ps(hd.dmin, yd), _mm512_cvtepi32_ps(mins))));
      }
    }
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(out + r * ldo, _mm512_sub_ps(_mm512_load_ps(acc[r]), _mm512_load_ps(accm[r])));
  }
#endif
#endif
};

}  // namespace

void OPENTGI_FN(matmul_q4_k_wide)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                  int n1, int K, float* out, int ldo) {
  drive<TileQ4KWide>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q4_k)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<TileQ4K>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

// Sixteen rows of nb blocks (block_bytes a multiple of 16) into their group (r16.h r16_fields): on
// AVX-512 sixteen words at once by the kernels' own transposition (words16)
void OPENTGI_FN(repack_words16)(const uint8_t* rows, size_t row_bytes, int nb, size_t block_bytes, uint8_t* group) {
#ifdef OPENTGI_AVX512
  for (int b = 0; b < nb; ++b) {
    const uint8_t* block = rows + (size_t)b * block_bytes;
    uint8_t* vecs = group + (size_t)b * 16 * block_bytes;
    for (size_t at = 0; at < block_bytes; at += 16) {
      __m512i t[4];
      words16(block + at, row_bytes, t);
      for (int g = 0; g < 4; ++g) _mm512_storeu_si512((void*)(vecs + 16 * at + 64 * g), t[g]);
    }
  }
#else
  r16_fields<false>((uint8_t*)rows, row_bytes, nb, block_bytes, group);
#endif
}

void OPENTGI_FN(matmul_q4_k_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                                 int K, float* out, int ldo) {
  drive_r16<TileQ4K>(w, rb, sizeof(BlockQ4_K), act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q4_k_wide_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                      int n1, int K, float* out, int ldo) {
  drive_r16<TileQ4KWide>(w, rb, sizeof(BlockQ4_K), act, arb, M, n0, n1, K, out, ldo);
}

}  // namespace opentgi
