// The row loop every block family shares: for each weight row (or eight, where the tile has an
// eight-output form), activation rows in tiles of up to four (Tile::rows where the tile says: the
// weight's blocks loaded, or unpacked, once per tile); Tile::run<R> computes R rows, each by the
// same instructions as alone. Also the small helpers several families share.
#pragma once
#include <vector>

#include "common.h"
#include "r16.h"

namespace opentgi {

template <class Tile, class = void>
struct HasRun8 { static constexpr bool value = false; };
template <class Tile>
struct HasRun8<Tile, decltype((void)Tile::has_run8)> { static constexpr bool value = Tile::has_run8; };

// Tiles with a sixteen-output form (AVX-512) say from how many activation rows it is the faster one
// (Tile::run16_from; below it, the weights arrive too slowly for sixteen rows' streams at once).
template <class Tile, class = void>
struct HasRun16 { static constexpr bool value = false; static constexpr int from = 0; };
template <class Tile>
struct HasRun16<Tile, decltype((void)Tile::run16_from)> {
  static constexpr bool value = true;
  static constexpr int from = Tile::run16_from;
};

template <class Tile, class = void>
struct TileRows { static constexpr int value = 4; };

// Tiles whose activation rows are wide (16-bit) take the rows in blocks that stay in L2 while every
// group of eight outputs passes over them (drive): the same tiles, so the same bits.
template <class Tile, class = void>
struct RowBlocks { static constexpr bool value = false; };
template <class Tile>
struct RowBlocks<Tile, decltype((void)Tile::row_blocks)> { static constexpr bool value = Tile::row_blocks; };
constexpr size_t ROW_BLOCK_BYTES = 192 * 1024;
// Activation rows a K-quant tile takes at once, its weights unpacked once for them: wide (16-bit)
// and byte (8-bit) activations; more where AVX-512's 32 registers and cheaper products leave the
// unpacking a larger share
#ifdef OPENTGI_AVX512
constexpr int WIDE_TILE_ROWS = 16, BYTE_TILE_ROWS = 8;
#else
constexpr int WIDE_TILE_ROWS = 8, BYTE_TILE_ROWS = 4;
#endif
template <class Tile>
struct TileRows<Tile, decltype((void)Tile::rows)> { static constexpr int value = Tile::rows; };

// rows m0 .. m0 + R - 1 against the one output n (Tile::run<R>)
template <class Tile, int R>
static inline void run_one(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes, int m0,
                           int n, int K, float* out, int ldo) {
  Tile::template run<R>(w + (size_t)n * row_bytes, act + m0 * act_row_bytes, act_row_bytes, K,
                        out + (size_t)m0 * ldo + n, ldo);
}

// rows m0 .. m0 + R - 1 against outputs n .. n + W - 1: W = 1 (Tile::run<R>), 8 (Tile::run8<R>: eight
// weight rows at once, one output a float lane) or 16 (Tile::run16<R>, AVX-512: sixteen), each lane
// by exactly run<R>'s arithmetic, so the same bits whichever form computes an output
template <class Tile, int R, int W>
static inline void run_at(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes, int m0,
                          int n, int K, float* out, int ldo) {
  const uint8_t* a = act + m0 * act_row_bytes;
  float* o = out + (size_t)m0 * ldo + n;
  if constexpr (W == 1) {
    Tile::template run<R>(w + (size_t)n * row_bytes, a, act_row_bytes, K, o, ldo);
  } else if constexpr (W == 8) {
    Tile::template run8<R>(w + (size_t)n * row_bytes, row_bytes, a, act_row_bytes, K, o, ldo);
  } else {
    Tile::template run16<R>(w + (size_t)n * row_bytes, row_bytes, a, act_row_bytes, K, o, ldo);
  }
}

// the last rows (R or fewer) of the tiles
template <class Tile, int W, int R>
static inline void rows_rest(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes, int rest,
                             int m, int n, int K, float* out, int ldo) {
  if constexpr (R > 0) {
    if (rest == R) run_at<Tile, R, W>(w, row_bytes, act, act_row_bytes, m, n, K, out, ldo);
    else rows_rest<Tile, W, R - 1>(w, row_bytes, act, act_row_bytes, rest, m, n, K, out, ldo);
  }
}

// every row tile of up to four (TileRows) rows against outputs n .. n + W - 1
template <class Tile, int W>
static inline void rows_against(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes, int M,
                                int n, int K, float* out, int ldo) {
  constexpr int T = TileRows<Tile>::value;
  int m = 0;
  for (; m + T <= M; m += T) run_at<Tile, T, W>(w, row_bytes, act, act_row_bytes, m, n, K, out, ldo);
  rows_rest<Tile, W, T - 1>(w, row_bytes, act, act_row_bytes, M - m, m, n, K, out, ldo);
}

// Outputs n0 .. n1 - 1 of every row: sixteen or eight outputs at a time where the tile has such a
// form (Tile::run16, Tile::run8), the rest one at a time; a weight row (or eight, or sixteen) is
// loaded once per tile of activation rows and stays in L1 across the tiles.
template <class Tile>
static inline void drive_rows(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes,
                              int M, int n0, int n1, int K, float* out, int ldo) {
  int n = n0;
  if constexpr (HasRun16<Tile>::value) {
    if (M >= HasRun16<Tile>::from)
      for (; n + 16 <= n1; n += 16) rows_against<Tile, 16>(w, row_bytes, act, act_row_bytes, M, n, K, out, ldo);
  }
  if constexpr (HasRun8<Tile>::value) {
    for (; n + 8 <= n1; n += 8) rows_against<Tile, 8>(w, row_bytes, act, act_row_bytes, M, n, K, out, ldo);
  }
  for (; n < n1; ++n) rows_against<Tile, 1>(w, row_bytes, act, act_row_bytes, M, n, K, out, ldo);
}

template <class Tile>
static inline void drive(const uint8_t* w, size_t row_bytes, const uint8_t* act, size_t act_row_bytes,
                         int M, int n0, int n1, int K, float* out, int ldo) {
  if constexpr (RowBlocks<Tile>::value) {
    constexpr int T = TileRows<Tile>::value;
    int per = (int)(ROW_BLOCK_BYTES / act_row_bytes) / T * T;
    per = per < T ? T : per;
    for (int m0 = 0; m0 < M; m0 += per)
      drive_rows<Tile>(w, row_bytes, act + (size_t)m0 * act_row_bytes, act_row_bytes, M - m0 < per ? M - m0 : per,
                       n0, n1, K, out + (size_t)m0 * ldo, ldo);
  } else {
    drive_rows<Tile>(w, row_bytes, act, act_row_bytes, M, n0, n1, K, out, ldo);
  }
}

// A tile whose sixteen-output form reads its rows repacked (run16<R, 16>): the form drive_r16
// takes for that type's *_R16 groups (r16.h), the file layout's bits. (Where the variant has no
// sixteen-output form, drive_r16 puts the groups back and drives the tile itself.)
#ifdef OPENTGI_AVX512
template <class Tile>
struct TileR16 : Tile {
  template <int R>
  static inline void run16(const uint8_t* grp, size_t row_bytes, const uint8_t* act, size_t stride, int K, float* out,
                           int ldo) {
    Tile::template run16<R, 16>(grp, row_bytes, act, stride, K, out, ldo);
  }
};
#else
template <class Tile>
using TileR16 = Tile;
#endif

// Outputs n0 .. n1 - 1 (whole groups of sixteen) of a weight repacked by sixteen rows (r16.h, blocks of
// block_bytes): TileG's sixteen-output form (TileR16<Tile> unless the type's groups have a form of their own)
// where the variant has it (AVX-512), else each group put back in the file's layout and driven as Tile:
// the same bits.
template <class Tile, class TileG = TileR16<Tile>>
static void drive_r16(const uint8_t* w, size_t rb, size_t block_bytes, const uint8_t* act, size_t arb, int M, int n0,
                      int n1, int K, float* out, int ldo) {
#ifdef OPENTGI_AVX512
  (void)block_bytes;
  for (int n = n0; n + 16 <= n1; n += 16) rows_against<TileG, 16>(w, rb, act, arb, M, n, K, out, ldo);
#else
  std::vector<uint8_t> rows(16 * rb);
  for (int n = n0; n + 16 <= n1; n += 16) {
    r16_group<true>(rows.data(), rb, (int)(rb / block_bytes), block_bytes, (uint8_t*)w + (size_t)n * rb);
    drive<Tile>(rows.data(), rb, act, arb, M, 0, 16, K, out + n, ldo);
  }
#endif
}

// Q6_K superblock x's 256 values q (0..63, before the -32 offset), in ggml's order, as T
template <class T>
static inline void q6k_unpack(const BlockQ6_K& x, T* q) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = x.ql + 64 * h;
    for (int l = 0; l < 32; ++l) {
      const uint8_t qh = x.qh[32 * h + l];
      q[128 * h + l] = (T)((ql[l] & 0xF) | ((qh & 3) << 4));
      q[128 * h + l + 32] = (T)((ql[l + 32] & 0xF) | (((qh >> 2) & 3) << 4));
      q[128 * h + l + 64] = (T)((ql[l] >> 4) | (((qh >> 4) & 3) << 4));
      q[128 * h + l + 96] = (T)((ql[l + 32] >> 4) | (((qh >> 6) & 3) << 4));
    }
  }
}

// a K-quant's 6-bit scales and mins of its 8 sub-blocks (ggml's get_scale_min_k4)
static inline void scales_mins(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
}

#ifdef OPENTGI_AVX2
// the sum of the 8 int32 lanes
static inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// the totals of eight vectors of 8 int32: lane i holds sum(s[i])
static inline __m256i reduce8(const __m256i* s) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// Eight rows' block sums against one 32-value activation block y, row c in lane c: rows p and p + 4
// share lo[p] (their values 0..15 as unsigned bytes, row p in the low half) and hi[p] (values
// 16..31); pairs of products stay in int16 (the caller bounds them), then two rounds of hadd.
static inline __m256i pair_sums8(const __m256i* lo, const __m256i* hi, const int8_t* y) {
  const __m256i ylo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)y));
  const __m256i yhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(y + 16)));
  __m256i s[4];
#if defined(OPENTGI_AVX512) || defined(OPENTGI_AVXVNNI)
  // the same lanes (bytes 4i .. 4i + 3 of lo and of hi), exact either way
  for (int p = 0; p < 4; ++p) s[p] = dot_u8_add(dot_u8_add(_mm256_setzero_si256(), lo[p], ylo), hi[p], yhi);
#else
  const __m256i ones = _mm256_set1_epi16(1);  // the pairs added in int16 first: one madd for both halves
  for (int p = 0; p < 4; ++p)
    s[p] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[p], ylo), _mm256_maddubs_epi16(hi[p], yhi)), ones);
#endif
  return _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
}

// The next N weight rows follow the N being computed (at rows): a few of their cache lines a block
// (of nb in a row), so they are in L1 when their turn comes.
template <int N = 8>
static inline void prefetch_next(const uint8_t* rows, size_t row_bytes, int b, int nb) {
  const uint8_t* next = rows + N * row_bytes;
  const int lines = (int)((N * row_bytes + 63) / 64), per_block = (lines + nb - 1) / nb;
  for (int i = 0; i < per_block; ++i) _mm_prefetch((const char*)next + 64 * (b * per_block + i), _MM_HINT_T0);
}

#ifdef OPENTGI_AVX512
// The prefetches of sixteen rows' block b (at base; nb a row): the next sixteen rows' a few lines a
// block (prefetch_next), or (S = 16, the rows repacked: one stream) a block's 16 * block_bytes,
// R16_AHEAD bytes ahead.
constexpr size_t R16_AHEAD = 4096;
template <int S>
static inline void prefetch_blocks16(const uint8_t* rows, size_t row_bytes, const uint8_t* base, size_t block_bytes,
                                     int b, int nb) {
  if constexpr (S == 16) {
    for (size_t l = 0; l < (16 * block_bytes + 63) / 64; ++l) _mm_prefetch((const char*)base + R16_AHEAD + 64 * l, _MM_HINT_T0);
  } else {
    prefetch_next<16>(rows, row_bytes, b, nb);
  }
}
#endif

// One or two activation rows pass over each weight once, so their eight-output forms are bound by
// how fast the weights arrive: in_memory_order8 reads the eight rows in memory order (row c's
// superblocks one after another, then row c + 1's: a stream the hardware prefetcher follows, with
// a software prefetch PREFETCH_AHEAD bytes ahead) instead of superblock by superblock across the
// rows. dots(x, b, sums, c) sets sums[i][c], the exact int32 lanes of weight row c's superblock b
// (at x) against activation stream i < N; once the eight rows of a run of superblocks are done,
// finish(b, sums) takes superblock b's lanes, in superblock order. The integers are the same
// whatever the order they were formed in, and finish does the float arithmetic of the
// superblock-by-superblock form in the same order: the same bits.
constexpr int PREFETCH_AHEAD = 16384;
template <int N, class Dots, class Finish>
static inline void in_memory_order8(const uint8_t* rows8, size_t row_bytes, size_t block_bytes, int nb, Dots dots,
                                    Finish finish) {
  constexpr int RUN = 128 / N;  // superblocks a run (32 KB of lanes): whole rows up to K = 32768 / N
  alignas(32) __m256i sums[RUN][N][8];
  const int lines = (int)((block_bytes + 63) / 64);
  for (int b0 = 0; b0 < nb; b0 += RUN) {
    const int b1 = b0 + RUN < nb ? b0 + RUN : nb;
    for (int c = 0; c < 8; ++c) {
      const uint8_t* row = rows8 + c * row_bytes;
      for (int b = b0; b < b1; ++b) {
        const uint8_t* x = row + (size_t)b * block_bytes;
        for (int l = 0; l < lines; ++l) _mm_prefetch((const char*)x + PREFETCH_AHEAD + 64 * l, _MM_HINT_T0);
        dots(x, b, sums[b - b0], c);
      }
    }
    for (int b = b0; b < b1; ++b) finish(b, sums[b - b0]);
  }
}

// Eight rows' float16 scale (at p + c * row_bytes) as 8 floats, row c in lane c.
static inline __m256 fp16_8(const uint8_t* p, size_t row_bytes) {
  uint16_t d[8];
  for (int c = 0; c < 8; ++c) std::memcpy(&d[c], p + c * row_bytes, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)d));
}

// The first 16 bytes of eight rows (at base + c * row_bytes) transposed: w[k] holds word k (bytes
// 4k .. 4k + 3) of row c in int32 lane c (rows p and p + 4 loaded together, then unpacked).
static inline void header_words8(const uint8_t* base, size_t row_bytes, __m256i* w) {
  __m256i h[4];
  for (int p = 0; p < 4; ++p)
    h[p] = _mm256_loadu2_m128i((const __m128i*)(base + (p + 4) * row_bytes), (const __m128i*)(base + p * row_bytes));
  const __m256i a = _mm256_unpacklo_epi32(h[0], h[1]), b = _mm256_unpackhi_epi32(h[0], h[1]);
  const __m256i c = _mm256_unpacklo_epi32(h[2], h[3]), e = _mm256_unpackhi_epi32(h[2], h[3]);
  w[0] = _mm256_unpacklo_epi64(a, c);
  w[1] = _mm256_unpackhi_epi64(a, c);
  w[2] = _mm256_unpacklo_epi64(b, e);
  w[3] = _mm256_unpackhi_epi64(b, e);
}

// The low and high float16 halves of eight int32 lanes (a header word, row c in lane c) as floats.
static inline void fp16_halves8(__m256i w, __m256* lo, __m256* hi) {
  const __m256i v = _mm256_permute4x64_epi64(
      _mm256_shuffle_epi8(w, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                              0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)),
      0xD8);  // lows of lanes 0..7 | highs
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
}

// The headers of eight Q4_K / Q5_K superblocks (d, dmin, then the 12 bytes of 6-bit scales and
// mins, at base + c * row_bytes), unpacked as scales_mins does, eight rows at once: d and dmin of
// row c in float lane c; sc16[16 * (c % 4) + 8 * (c / 4) + j] = scale j of row c; mins[k] holds the
// mins of rows k (low half) and k + 4 (high half) as 8 int16 each.
static inline void kquant_headers8(const uint8_t* base, size_t row_bytes, __m256* d, __m256* dmin, int16_t* sc16,
                                   __m256i* mins) {
  __m256i w[4];  // words d|dmin, scales 0-3, 4-7, 8-11 of every row
  header_words8(base, row_bytes, w);
  fp16_halves8(w[0], d, dmin);
  const __m256i u0 = w[1], u1 = w[2], u2 = w[3];
  // get_scale_min_k4 on 32-bit words (ggml's kmask form): 4 scales or 4 mins a word
  const __m256i k1 = _mm256_set1_epi32(0x3F3F3F3F), k2 = _mm256_set1_epi32(0x0F0F0F0F),
                k3 = _mm256_set1_epi32(0x03030303);
  const __m256i sc_lo = _mm256_and_si256(u0, k1);
  const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(u2, k2),
                                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), k3), 4));
  const __m256i mn_lo = _mm256_and_si256(u1, k1);
  const __m256i mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), k2),
                                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), k3), 4));
  // 8 bytes a row: rows 0, 1 | 4, 5 and 2, 3 | 6, 7; then widened to int16, rows k | k + 4
  const __m256i zero = _mm256_setzero_si256();
  const __m256i s01 = _mm256_unpacklo_epi32(sc_lo, sc_hi), s23 = _mm256_unpackhi_epi32(sc_lo, sc_hi);
  const __m256i m01 = _mm256_unpacklo_epi32(mn_lo, mn_hi), m23 = _mm256_unpackhi_epi32(mn_lo, mn_hi);
  _mm256_storeu_si256((__m256i*)sc16, _mm256_unpacklo_epi8(s01, zero));
  _mm256_storeu_si256((__m256i*)(sc16 + 16), _mm256_unpackhi_epi8(s01, zero));
  _mm256_storeu_si256((__m256i*)(sc16 + 32), _mm256_unpacklo_epi8(s23, zero));
  _mm256_storeu_si256((__m256i*)(sc16 + 48), _mm256_unpackhi_epi8(s23, zero));
  mins[0] = _mm256_unpacklo_epi8(m01, zero);
  mins[1] = _mm256_unpackhi_epi8(m01, zero);
  mins[2] = _mm256_unpacklo_epi8(m23, zero);
  mins[3] = _mm256_unpackhi_epi8(m23, zero);
}

// Wide activations (common.h ActQ16 / ActQ16K): the exact total of each of eight vectors of int32
// lanes (lane sums may pass 2^31: added as doubles, which hold these integers exactly), rounded to
// float once, total c in lane c: the float a scalar int64 sum converts to.
static inline __m256 exact_totals8(const __m256i* s) {
  __m256d t[8];
  for (int c = 0; c < 8; ++c)
    t[c] = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(s[c])),
                         _mm256_cvtepi32_pd(_mm256_extracti128_si256(s[c], 1)));
  __m128 half[2];
  for (int h = 0; h < 2; ++h) {
    const __m256d a = _mm256_hadd_pd(t[4 * h], t[4 * h + 1]), b = _mm256_hadd_pd(t[4 * h + 2], t[4 * h + 3]);
    half[h] = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_permute2f128_pd(a, b, 0x20), _mm256_permute2f128_pd(a, b, 0x31)));
  }
  return _mm256_set_m128(half[1], half[0]);
}

// float(128 * hi + lo) lane by lane, exact until the one rounding (hi, lo: int32 totals of the byte
// halves of 16-bit activations, common.h ActQ16K), the float a scalar int64 total converts to
static inline __m256 exact_combine8(__m256i hi, __m256i lo) {
  const __m256d k = _mm256_set1_pd(128.0);
  const __m256d a = _mm256_add_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(hi)), k),
                                  _mm256_cvtepi32_pd(_mm256_castsi256_si128(lo)));
  const __m256d b = _mm256_add_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(hi, 1)), k),
                                  _mm256_cvtepi32_pd(_mm256_extracti128_si256(lo, 1)));
  return _mm256_set_m128(_mm256_cvtpd_ps(b), _mm256_cvtpd_ps(a));
}

// the exact sum of 8 int32 lanes
static inline int64_t lanes_exact(__m256i v) {
  alignas(32) int32_t l[8];
  _mm256_store_si256((__m256i*)l, v);
  int64_t s = 0;
  for (int i = 0; i < 8; ++i) s += l[i];
  return s;
}

#ifdef OPENTGI_AVX512
// 512-bit lanes i and i + 8 added: exact, and lane i then holds what the 256-bit form's lane i
// holds where the 512-bit form steps over twice the values (values k + 2i, k + 2i + 1 of each
// half of a 32-value step are the 256-bit form's values of two 16-value steps)
static inline __m256i fold16(__m512i s) {
  return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}
static inline __m512i join256(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

// Sixteen rows' 16 bytes (at base + c * row_bytes) as four vectors of one 32-bit word a row: t[g]'s
// lane c holds bytes 4g .. 4g + 3 of row c (loaded four rows a vector, then a 4x4 transpose of
// words in each 128-bit lane). S = 16: the sixteen rows repacked (r16.h), those four vectors as they
// lie at base (a row's byte offset o within its block at 16 * o in its group).
template <int S = 1>
static inline void words16(const uint8_t* base, size_t row_bytes, __m512i* t) {
  if constexpr (S == 16) {
    for (int g = 0; g < 4; ++g) t[g] = _mm512_loadu_si512((const void*)(base + 64 * g));
    return;
  }
  __m512i a[4];  // a[j]'s 128-bit lane q: row j + 4q
  for (int j = 0; j < 4; ++j) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(base + j * row_bytes)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(base + (j + 4) * row_bytes)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(base + (j + 8) * row_bytes)), 2);
    a[j] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(base + (j + 12) * row_bytes)), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  t[0] = _mm512_unpacklo_epi64(t0, t2);
  t[1] = _mm512_unpackhi_epi64(t0, t2);
  t[2] = _mm512_unpacklo_epi64(t1, t3);
  t[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Sixteen rows' 16 bytes of nibbles (at qs + c * row_bytes: low nibbles values 0..15, high ones
// 16..31, ggml's order) as w[g], lane c holding values 4g .. 4g + 3 of row c, g < 8.
template <int S = 1>
static inline void nibbles16(const uint8_t* qs, size_t row_bytes, __m512i* w) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  words16<S>(qs, row_bytes, w);
  for (int g = 0; g < 4; ++g) {
    w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(w[g], 4), mask);
    w[g] = _mm512_and_si512(w[g], mask);
  }
}

// Sixteen rows' blocks of 32 (at base + c * row_bytes) of Q4_0 / Q4_1 / Q8_0 (Kind 0, 1, 2; IQ4_NL's
// nibbles as Q4_0's): w[g] lane c holds values 4g .. 4g + 3 of row c as bytes (the nibbles, or
// Q8_0's signed bytes), g < 8.
template <int Kind, int S = 1>
static inline void values16(const uint8_t* base, size_t row_bytes, __m512i* w) {
  constexpr int qs_at = Kind == 1 ? 4 : 2;
  if constexpr (Kind == 2) {
    words16<S>(base + qs_at * S, row_bytes, w);
    words16<S>(base + (qs_at + 16) * S, row_bytes, w + 4);
  } else {
    nibbles16<S>(base + qs_at * S, row_bytes, w);
  }
}

// Sixteen rows' first 32-bit word (at base + c * row_bytes), row c in lane c (four loads a 128-bit
// lane: a gather measured slower on AMD); S = 16: the rows repacked, the vector at base.
template <int S = 1>
static inline __m512i header16(const uint8_t* base, size_t row_bytes) {
  if constexpr (S == 16) return _mm512_loadu_si512((const void*)base);
  __m128i q[4];
  for (int k = 0; k < 4; ++k) {
    const uint8_t* p = base + 4 * k * row_bytes;
    int32_t v0, v1, v2, v3;
    std::memcpy(&v0, p, 4);
    std::memcpy(&v1, p + row_bytes, 4);
    std::memcpy(&v2, p + 2 * row_bytes, 4);
    std::memcpy(&v3, p + 3 * row_bytes, 4);
    q[k] = _mm_insert_epi32(_mm_insert_epi32(_mm_insert_epi32(_mm_cvtsi32_si128(v0), v1, 1), v2, 2), v3, 3);
  }
  return _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(q[0]), q[1], 1), q[2], 2),
                            q[3], 3);
}

// The float16 in the low (High = false) or high half of sixteen 32-bit lanes, as floats.
template <bool High>
static inline __m512 fp16_lanes16(__m512i w) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(High ? _mm512_srli_epi32(w, 16) : w));
}

// Sixteen rows' float16 d, the first two bytes of blocks of 2 + 4k bytes (Q4_0, Q5_0, Q8_0, IQ4_NL),
// row c in lane c, as floats; S = 16: the rows repacked, their d side by side at base (r16.h).
template <int S = 1>
static inline __m512 d16(const uint8_t* base, size_t row_bytes) {
  if constexpr (S == 16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)base));
  return fp16_lanes16<false>(header16(base, row_bytes));
}

// A shuffle control taking bytes 2H and 2H + 1 of each 32-bit word to its two 16-bit halves: into
// their low bytes (zero-extended) or (IntoHigh) their high bytes, which an arithmetic shift by 8
// then sign-extends.
template <int H, bool IntoHigh>
static inline __m512i pair_pick() {
  alignas(16) int8_t c[16];
  for (int w = 0; w < 4; ++w)
    for (int i = 0; i < 2; ++i) {
      c[4 * w + 2 * i + (IntoHigh ? 1 : 0)] = (int8_t)(4 * w + 2 * H + i);
      c[4 * w + 2 * i + (IntoHigh ? 0 : 1)] = -128;
    }
  return _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)c));
}

// float(128 * hi + lo) lane by lane, exact until the one rounding: exact_combine8's sixteen lanes
static inline __m512 exact_combine16(__m512i hi, __m512i lo) {
  const __m512d k = _mm512_set1_pd(128.0);
  const __m512d a = _mm512_add_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(hi)), k),
                                  _mm512_cvtepi32_pd(_mm512_castsi512_si256(lo)));
  const __m512d b = _mm512_add_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(hi, 1)), k),
                                  _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(lo, 1)));
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(a)), _mm512_cvtpd_ps(b), 1);
}

// acc + VNNI's products of w's lanes with the four bytes (VPDPBUSD) or two int16 (VPDPWSSD) at p,
// broadcast: p as the instruction's broadcast memory operand, one instruction where the intrinsics
// take a second for the broadcast (which the compiler does not fold)
static inline __m512i dpbusd_word(__m512i acc, __m512i w, const void* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)p));
  return acc;
}
static inline __m512i dpwssd_word(__m512i acc, __m512i w, const void* p) {
  __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)p));
  return acc;
}

#endif

// Eight weight rows' superblocks unpacked to int16 (w16: 256 values a row, rows 256 apart) against
// R wide activation rows (x[r]: 256 int16): sums[r][c] = the 8 int32 lanes of row r by weight row c
// (lanes bounded by the caller). Two weight rows and up to four activation rows a step, their
// products in registers: each weight and activation vector loaded once a step.
#ifdef OPENTGI_AVX512
// wide_dots8 in 512-bit steps (VNNI's multiply-add): four weight rows and up to four activation
// rows a step, sixteen sums in registers; sums[r][c] lane by lane the 256-bit form's (fold16).
template <int R>
static inline void wide_dots8(const int16_t* w16, const int16_t* const* x, __m256i (*sums)[8]) {
  if constexpr (R > 4) {
    wide_dots8<4>(w16, x, sums);
    wide_dots8<R - 4>(w16, x + 4, sums + 4);
  } else {
    for (int c = 0; c < 8; c += 4) {
      __m512i s[4][R];
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < R; ++r) s[j][r] = _mm512_setzero_si512();
      for (int k = 0; k < QK_K; k += 32) {
        __m512i w[4];
        for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_si512((const void*)(w16 + (c + j) * QK_K + k));
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_loadu_si512((const void*)(x[r] + k));
          for (int j = 0; j < 4; ++j) s[j][r] = _mm512_dpwssd_epi32(s[j][r], w[j], xv);
        }
      }
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < R; ++r) sums[r][c + j] = fold16(s[j][r]);
    }
  }
}
#else
template <int R>
static inline void wide_dots8(const int16_t* w16, const int16_t* const* x, __m256i (*sums)[8]) {
  if constexpr (R > 3) {  // three rows a step: 6 sums, 2 weight and 3 activation vectors in registers
    constexpr int H = R == 4 ? 2 : 3;
    wide_dots8<H>(w16, x, sums);
    wide_dots8<R - H>(w16, x + H, sums + H);
  } else {
    for (int c = 0; c < 8; c += 2) {
      __m256i s0[R], s1[R];
      for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int k = 0; k < QK_K; k += 16) {
        const __m256i w0 = _mm256_load_si256((const __m256i*)(w16 + c * QK_K + k));
        const __m256i w1 = _mm256_load_si256((const __m256i*)(w16 + (c + 1) * QK_K + k));
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_loadu_si256((const __m256i*)(x[r] + k));
          s0[r] = _mm256_add_epi32(s0[r], _mm256_madd_epi16(w0, xv));
          s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(w1, xv));
        }
      }
      for (int r = 0; r < R; ++r) {
        sums[r][c] = s0[r];
        sums[r][c + 1] = s1[r];
      }
    }
  }
}
#endif

// 8 int32 lanes of sum w[i] * x[i], i < n (n a multiple of 16; the caller bounds each lane)
static inline __m256i dot16_lanes(const int16_t* w, const int16_t* x, int n) {
  __m256i acc = _mm256_setzero_si256();
  for (int k = 0; k < n; k += 16)
    acc = madd_add(acc, _mm256_loadu_si256((const __m256i*)(w + k)), _mm256_loadu_si256((const __m256i*)(x + k)));
  return acc;
}
#endif

// the exact sum of w[i] * x[i], i < n (n a multiple of 16, each lane of 32 products within int32)
static inline int64_t dot16_exact(const int16_t* w, const int16_t* x, int n) {
#ifdef OPENTGI_AVX2
  return lanes_exact(dot16_lanes(w, x, n));
#else
  int64_t s = 0;
  for (int i = 0; i < n; ++i) s += (int32_t)w[i] * x[i];
  return s;
#endif
}

#ifdef OPENTGI_AVX2
// Lane c: sum_j min_j(row c) * (bsums[2j] + bsums[2j + 1]) (exact: |pair| <= 2 * 16 * 127), the
// mins as kquant_headers8 leaves them.
static inline __m256i mins_dot8(const __m256i* mins, const int16_t* bsums) {
  const __m256i pairs = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)bsums), _mm256_set1_epi16(1));
  const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(pairs, pairs), 0x88);  // pairs 0..7 | 0..7
  const __m256i u0 = _mm256_hadd_epi32(_mm256_madd_epi16(mins[0], p16), _mm256_madd_epi16(mins[1], p16));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_madd_epi16(mins[2], p16), _mm256_madd_epi16(mins[3], p16));
  return _mm256_hadd_epi32(u0, u1);  // rows 0..3 | 4..7
}
#endif

}  // namespace opentgi
