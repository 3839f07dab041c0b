// Q4_0 (w = d * (q - 8)), Q4_1 (w = d * q + m) and Q8_0 (w = d * q): blocks of 32 against ActQ8.
// Every type, both paths: each block's integer sum is exact (Q4_0's as sum(q * x) - 8 * sum(x)),
// and an output adds (d_w * d_x) * sum block by block, in block order (Q4_1: that plus
// m * (d_x * sum(x)), then added; its 16-bit form keeps the two in floats of their own, added at
// the end): AVX2 and scalar agree bit for
// bit, and AVX2 computes eight outputs at once (one float lane each) by exactly that arithmetic,
// so a row gets the same bits alone or among others. Each also takes 16-bit activations
// (Tile32Wide).
#include "tiles.h"

namespace opentgi {
namespace {

template <class Block, int Kind>  // Kind: 0 Q4_0, 1 Q4_1, 2 Q8_0
struct Tile32 {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const Block* w = (const Block*)wr;
    const int nb = K / QK;
    const ActQ8* a[R];
    float acc[R];
    start_tile(act, stride, a, acc);
    for (int b = 0; b < nb; ++b) {
      const float dw = fp16_to_fp32(w[b].d);
#ifdef OPENTGI_AVX2
      const __m256i q = Kind == 2 ? _mm256_loadu_si256((const __m256i*)((const BlockQ8_0*)w)[b].qs)
                                  : nibbles32((const uint8_t*)w[b].qs);
#else
      int8_t q[QK];
      for (int i = 0; i < QK; ++i) {
        if constexpr (Kind == 2) {
          q[i] = ((const BlockQ8_0*)w)[b].qs[i];
        } else {
          const uint8_t byte = ((const uint8_t*)w[b].qs)[i % 16];
          q[i] = (int8_t)(i < 16 ? byte & 0x0F : byte >> 4);
        }
      }
#endif
      for (int r = 0; r < R; ++r) {
        const ActQ8& y = a[r][b];
#ifdef OPENTGI_AVX2
        const __m256i yq = _mm256_loadu_si256((const __m256i*)y.qs);
        int32_t s = hsum_i32(Kind == 2 ? dot_i8(q, yq) : dot_u8(q, yq));
#else
        int32_t s = 0;
        for (int i = 0; i < QK; ++i) s += (int32_t)q[i] * y.qs[i];
#endif
        if constexpr (Kind == 0) s -= 8 * y.sum;
        const float t = (dw * y.d) * (float)s;
        if constexpr (Kind == 1) acc[r] += t + fp16_to_fp32(((const BlockQ4_1*)w)[b].m) * y.ds;
        else acc[r] += t;
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
  }

#ifdef OPENTGI_AVX2
  // Eight weight rows (row_bytes apart) at once against R activation rows, output c in float lane c
  // by run<R>'s arithmetic (out[r * ldo + c]).
  static constexpr bool has_run8 = true;
#ifdef OPENTGI_AVX512  // sixteen rows a tile: their accumulators fit in the registers
  static constexpr int rows = 2 * BYTE_TILE_ROWS;
#else
  static constexpr int rows = BYTE_TILE_ROWS;
#endif
  template <int R>
  static inline void run8(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                          float* out, int ldo) {
    if constexpr (Kind == 2) run8_q8_0<R>(wr, row_bytes, act, stride, K, out, ldo);
    else run8_q4<R>(wr, row_bytes, act, stride, K, out, ldo);
  }

  // Q4_0 / Q4_1: rows c and c + 4 share a vector (one in each half); a block's integer sums come out
  // in column order after two rounds of hadd.
  template <int R>
  static inline void run8_q4(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                             float* out, int ldo) {
    constexpr int qs_at = Kind == 1 ? 4 : 2;
    const int nb = K / QK;
    const ActQ8* a[R];
    __m256 acc[R];
    start_tile(act, stride, a, acc);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    // the next eight rows follow these eight: a few of their cache lines a block, so they are in
    // L1 when their turn comes
    const uint8_t* next = wr + 8 * row_bytes;
    const int lines = (int)((8 * row_bytes + 63) / 64), per_block = (lines + nb - 1) / nb;
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(Block);
      for (int i = 0; i < per_block; ++i) _mm_prefetch((const char*)next + 64 * (b * per_block + i), _MM_HINT_T0);
      __m256 dv, mv;
      if constexpr (Kind == 1) {
        __m256i w[4];  // d and m side by side: word 0 of every row
        header_words8(base, row_bytes, w);
        fp16_halves8(w[0], &dv, &mv);
      } else {
        uint16_t d[8];
        for (int c = 0; c < 8; ++c) std::memcpy(&d[c], base + c * row_bytes, 2);
        dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)d));
        mv = dv;
      }
      __m256i lo[4], hi[4];
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu2_m128i((const __m128i*)(base + (p + 4) * row_bytes + qs_at),
                                              (const __m128i*)(base + p * row_bytes + qs_at));
        lo[p] = _mm256_and_si256(v, mask);
        hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      }
      for (int r = 0; r < R; ++r) {
        const ActQ8& y = a[r][b];
        __m256i sum = pair_sums8(lo, hi, y.qs);
        if constexpr (Kind == 0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * y.sum));
        __m256 t = _mm256_mul_ps(_mm256_mul_ps(dv, _mm256_set1_ps(y.d)), _mm256_cvtepi32_ps(sum));
        if constexpr (Kind == 1) t = _mm256_add_ps(t, _mm256_mul_ps(mv, _mm256_set1_ps(y.ds)));
        acc[r] = _mm256_add_ps(acc[r], t);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
  }

  // Q8_0: each row's exact block sum (signed bytes, dot_i8's sign trick: |q| <= 128 unsigned, pairs
  // of products under 2^15) in column order (reduce8)
  template <int R>
  static inline void run8_q8_0(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                               float* out, int ldo) {
    const int nb = K / QK;
    const ActQ8* a[R];
    __m256 acc[R];
    start_tile(act, stride, a, acc);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(BlockQ8_0);
      prefetch_next(wr, row_bytes, b, nb);
      const __m256 dv = fp16_8(base, row_bytes);
      __m256i q[8];
      for (int c = 0; c < 8; ++c) q[c] = _mm256_loadu_si256((const __m256i*)(base + c * row_bytes + 2));
      for (int r = 0; r < R; ++r) {
        const ActQ8& y = a[r][b];
        const __m256i yq = _mm256_loadu_si256((const __m256i*)y.qs);
        __m256i s[8];
        for (int c = 0; c < 8; ++c)
          s[c] = dot_u8_add(_mm256_setzero_si256(), _mm256_sign_epi8(q[c], q[c]), _mm256_sign_epi8(yq, q[c]));
        const __m256 dy = _mm256_mul_ps(dv, _mm256_set1_ps(y.d));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dy, _mm256_cvtepi32_ps(reduce8(s))));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
  }

#ifdef OPENTGI_AVX512
  // Sixteen weight rows at once, row c's block sum formed in int32 lane c (VNNI: four products a
  // lane an instruction, the activations' four bytes broadcast), so no horizontal sums; then
  // run<R>'s float arithmetic lane by lane. Q8_0's signed weights enter as q + 128 (unsigned), the
  // 128 * sum(y) taken off after: the same exact integer as the AVX2 form's. From one row for Q4_1
  // (measured faster than the eight-output form there), from two for the others.
  // (S = 16: the rows repacked, r16.h.)
  static constexpr int run16_from = Kind == 1 ? 1 : 2;
  template <int R, int S = 1>
  static inline void run16(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                           float* out, int ldo) {
    const int nb = K / QK;
    const ActQ8* a[R];
    __m512 acc[R];
    start_tile(act, stride, a, acc);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(Block) * S;
      prefetch_blocks16<S>(wr, row_bytes, base, sizeof(Block), b, nb);
      __m512 dv, mv;
      if constexpr (Kind != 1) {  // d alone (Q4_0_R16, Q8_0_R16: the sixteen d side by side, r16.h)
        dv = mv = d16<S>(base, row_bytes);
      } else {
        const __m512i head = header16<S>(base, row_bytes);
        dv = fp16_lanes16<false>(head), mv = fp16_lanes16<true>(head);
      }
      __m512i w[8];  // w[g] lane c: values 4g .. 4g + 3 of row c, as unsigned bytes
      values16<Kind, S>(base, row_bytes, w);
      if constexpr (Kind == 2)
        for (int g = 0; g < 8; ++g) w[g] = _mm512_xor_si512(w[g], flip);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const ActQ8& y = a[r][b];
        // Q4_0's -8 * sum(y) and Q8_0's -128 * sum(y) as the sum's start
        __m512i sum = Kind == 1 ? _mm512_setzero_si512() : _mm512_set1_epi32((Kind == 0 ? -8 : -128) * y.sum);
        for (int g = 0; g < 8; ++g) sum = dpbusd_word(sum, w[g], y.qs + 4 * g);
        __m512 t = _mm512_mul_ps(_mm512_mul_ps(dv, _mm512_set1_ps(y.d)), _mm512_cvtepi32_ps(sum));
        if constexpr (Kind == 1) t = _mm512_add_ps(t, _mm512_mul_ps(mv, _mm512_set1_ps(y.ds)));
        acc[r] = _mm512_add_ps(acc[r], t);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
  }
#endif
#endif
};

// Wide activations (ActQ16) for Q4_0, Q4_1 and Q8_0: the block's weights as int16 (Q4_0's q - 8
// in place, so no sum term; Q4_1's q; Q8_0's q), the exact block sum (|.| <= 32 * 128 * 32767 <
// 2^28), then the same float products per block as against ActQ8, on every path.
template <class Block, int Kind>  // Kind: 0 Q4_0, 1 Q4_1, 2 Q8_0
struct Tile32Wide {
  template <int R>
  static inline void run(const uint8_t* wr, const uint8_t* act, size_t stride, int K, float* out, int ldo) {
    const Block* w = (const Block*)wr;
    const ActQ16* a[R];
    float acc[R], mins[R];
    start_tile(act, stride, a, acc, mins);
    alignas(32) int16_t w16[QK];
    for (int b = 0; b < K / QK; ++b) {
      const float dw = fp16_to_fp32(w[b].d);
      if constexpr (Kind == 2) {
        for (int i = 0; i < QK; ++i) w16[i] = ((const BlockQ8_0*)w)[b].qs[i];
      } else {
        for (int i = 0; i < 16; ++i) {
          const uint8_t byte = ((const uint8_t*)w[b].qs)[i];
          w16[i] = (int16_t)((byte & 0x0F) - (Kind == 0 ? 8 : 0));
          w16[i + 16] = (int16_t)((byte >> 4) - (Kind == 0 ? 8 : 0));
        }
      }
      for (int r = 0; r < R; ++r) {
        const ActQ16& y = a[r][b];
        const int32_t s = (int32_t)dot16_exact(w16, y.qs, QK);
        acc[r] += (dw * y.d) * (float)s;
        if constexpr (Kind == 1) mins[r] += fp16_to_fp32(((const BlockQ4_1*)w)[b].m) * (y.d * (float)y.sum);
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = Kind == 1 ? acc[r] + mins[r] : acc[r];
  }

#ifdef OPENTGI_AVX2
  // Eight weight rows at once, output c in float lane c by run<R>'s arithmetic: rows p and p + 4
  // share a vector (8 values of each, one in each half, against the activations' 8 broadcast to
  // both), a block's sums coming out in column order after two rounds of hadd; the weights unpacked
  // once a block for a tile of up to eight activation rows.
  static constexpr bool has_run8 = true;
  static constexpr int rows = 8;
  static constexpr bool row_blocks = true;
  template <int R>
  static inline void run8(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                          float* out, int ldo) {
    constexpr int qs_at = Kind == 1 ? 4 : 2;
    const int nb = K / QK;
    const ActQ16* a[R];
    alignas(32) float acc[R][8] = {}, mins[R][8] = {};  // in memory: the registers go to the products
    for (int r = 0; r < R; ++r) a[r] = (const ActQ16*)(act + r * stride);
    const __m256i mask = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    const __m256i off = _mm256_set1_epi16(Kind == 0 ? 8 : 0);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(Block);
      prefetch_next(wr, row_bytes, b, nb);
      __m256 dv, mv;
      if constexpr (Kind == 1) {
        __m256i w[4];  // d and m side by side: word 0 of every row
        header_words8(base, row_bytes, w);
        fp16_halves8(w[0], &dv, &mv);
      } else {
        dv = mv = fp16_8(base, row_bytes);
      }
      alignas(32) __m256i wq[4][4];  // pair p, values 8i .. 8i + 7 of rows p (low half) and p + 4 (high half)
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu2_m128i((const __m128i*)(base + (p + 4) * row_bytes + qs_at),
                                              (const __m128i*)(base + p * row_bytes + qs_at));
        if constexpr (Kind == 2) {  // values 0..15 in v, 16..31 in v2, sign-extended
          const __m256i v2 = _mm256_loadu2_m128i((const __m128i*)(base + (p + 4) * row_bytes + qs_at + 16),
                                                 (const __m128i*)(base + p * row_bytes + qs_at + 16));
          const __m256i s1 = _mm256_cmpgt_epi8(zero, v), s2 = _mm256_cmpgt_epi8(zero, v2);
          wq[p][0] = _mm256_unpacklo_epi8(v, s1);
          wq[p][1] = _mm256_unpackhi_epi8(v, s1);
          wq[p][2] = _mm256_unpacklo_epi8(v2, s2);
          wq[p][3] = _mm256_unpackhi_epi8(v2, s2);
          continue;
        }
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        wq[p][0] = _mm256_sub_epi16(_mm256_unpacklo_epi8(lo, zero), off);
        wq[p][1] = _mm256_sub_epi16(_mm256_unpackhi_epi8(lo, zero), off);
        wq[p][2] = _mm256_sub_epi16(_mm256_unpacklo_epi8(hi, zero), off);
        wq[p][3] = _mm256_sub_epi16(_mm256_unpackhi_epi8(hi, zero), off);
      }
      for (int r = 0; r < R; ++r) {
        const ActQ16& y = a[r][b];
        __m256i xv[4];
        for (int i = 0; i < 4; ++i) xv[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(y.qs + 8 * i)));
        __m256i s[4];
        for (int p = 0; p < 4; ++p)
          s[p] = madd_add(madd_add(madd_add(_mm256_madd_epi16(wq[p][0], xv[0]), wq[p][1], xv[1]), wq[p][2], xv[2]),
                          wq[p][3], xv[3]);
        const __m256i sum = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
        const __m256 dy = _mm256_mul_ps(dv, _mm256_set1_ps(y.d));
        _mm256_store_ps(acc[r], _mm256_add_ps(_mm256_load_ps(acc[r]), _mm256_mul_ps(dy, _mm256_cvtepi32_ps(sum))));
        if constexpr (Kind == 1)
          _mm256_store_ps(mins[r], _mm256_add_ps(_mm256_load_ps(mins[r]), _mm256_mul_ps(mv, _mm256_set1_ps(y.d * (float)y.sum))));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_load_ps(acc[r]);
      _mm256_storeu_ps(out + r * ldo, Kind == 1 ? _mm256_add_ps(v, _mm256_load_ps(mins[r])) : v);
    }
  }

#ifdef OPENTGI_AVX512
  // Sixteen weight rows at once, row c's block sum formed in int32 lane c: the weights as int16
  // pairs (w16[k] lane c: values 2k, 2k + 1 of row c), each pair of activations broadcast (VNNI's
  // 16-bit multiply-add), no horizontal sums; then run<R>'s float arithmetic lane by lane.
  // (S = 16: the rows repacked, r16.h.)
  static constexpr int run16_from = 4;
  template <int R, int S = 1>
  static inline void run16(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                           float* out, int ldo) {
    const int nb = K / QK;
    const ActQ16* a[R];
    alignas(64) float acc[R][16] = {}, mins[R][16] = {};  // in memory: the registers go to the products
    for (int r = 0; r < R; ++r) a[r] = (const ActQ16*)(act + r * stride);
    const __m512i off = _mm512_set1_epi16(Kind == 0 ? 8 : 0);
    // bytes 0, 1 (pair 2g) or 2, 3 (pair 2g + 1) of each word to int16: zero-extended into the low
    // byte (nibbles), or into the high byte then shifted back with the sign (Q8_0)
    const __m512i pick0 = pair_pick<0, Kind == 2>(), pick1 = pair_pick<1, Kind == 2>();
    for (int b = 0; b < nb; ++b) {
      const uint8_t* base = wr + (size_t)b * sizeof(Block) * S;
      prefetch_blocks16<S>(wr, row_bytes, base, sizeof(Block), b, nb);
      __m512 dv, mv;  // mv: Q4_1's m
      if constexpr (Kind != 1) {  // d alone (Q4_0_R16, Q8_0_R16: the sixteen d side by side, r16.h)
        dv = mv = d16<S>(base, row_bytes);
      } else {
        const __m512i head = header16<S>(base, row_bytes);
        dv = fp16_lanes16<false>(head), mv = fp16_lanes16<true>(head);
      }
      __m512i w[8];  // w[g] lane c: values 4g .. 4g + 3 of row c, as bytes
      values16<Kind, S>(base, row_bytes, w);
      __m512i w16[16];
      for (int g = 0; g < 8; ++g) {
        w16[2 * g] = _mm512_shuffle_epi8(w[g], pick0);
        w16[2 * g + 1] = _mm512_shuffle_epi8(w[g], pick1);
        if constexpr (Kind == 2) {
          w16[2 * g] = _mm512_srai_epi16(w16[2 * g], 8);
          w16[2 * g + 1] = _mm512_srai_epi16(w16[2 * g + 1], 8);
        } else {
          w16[2 * g] = _mm512_sub_epi16(w16[2 * g], off);
          w16[2 * g + 1] = _mm512_sub_epi16(w16[2 * g + 1], off);
        }
      }
      for (int r = 0; r < R; ++r) {
        const ActQ16& y = a[r][b];
        __m512i sum = _mm512_setzero_si512();
        for (int k = 0; k < 16; ++k) sum = dpwssd_word(sum, w16[k], y.qs + 2 * k);
        const __m512 dy = _mm512_mul_ps(dv, _mm512_set1_ps(y.d));
        _mm512_store_ps(acc[r], _mm512_add_ps(_mm512_load_ps(acc[r]), _mm512_mul_ps(dy, _mm512_cvtepi32_ps(sum))));
        if constexpr (Kind == 1) {
          const __m512 m = _mm512_mul_ps(mv, _mm512_set1_ps(y.d * (float)y.sum));
          _mm512_store_ps(mins[r], _mm512_add_ps(_mm512_load_ps(mins[r]), m));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_load_ps(acc[r]);
      _mm512_storeu_ps(out + r * ldo, Kind == 1 ? _mm512_add_ps(v, _mm512_load_ps(mins[r])) : v);
    }
  }
#endif
#endif
};


}  // namespace

void OPENTGI_FN(matmul_q4_1_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                                 int K, float* out, int ldo) {
  drive_r16<Tile32<BlockQ4_1, 1>>(w, rb, sizeof(BlockQ4_1), act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q4_0_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                                 int K, float* out, int ldo) {
  drive_r16<Tile32<BlockQ4_0, 0>>(w, rb, sizeof(BlockQ4_0), act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q8_0_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                                 int K, float* out, int ldo) {
  drive_r16<Tile32<BlockQ8_0, 2>>(w, rb, sizeof(BlockQ8_0), act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q4_0_wide_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                      int n1, int K, float* out, int ldo) {
  drive_r16<Tile32Wide<BlockQ4_0, 0>>(w, rb, sizeof(BlockQ4_0), act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q4_1_wide_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                      int n1, int K, float* out, int ldo) {
  drive_r16<Tile32Wide<BlockQ4_1, 1>>(w, rb, sizeof(BlockQ4_1), act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q8_0_wide_r16)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                      int n1, int K, float* out, int ldo) {
  drive_r16<Tile32Wide<BlockQ8_0, 2>>(w, rb, sizeof(BlockQ8_0), act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q4_0_wide)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                  int n1, int K, float* out, int ldo) {
  drive<Tile32Wide<BlockQ4_0, 0>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q4_1_wide)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                  int n1, int K, float* out, int ldo) {
  drive<Tile32Wide<BlockQ4_1, 1>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q8_0_wide)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0,
                                  int n1, int K, float* out, int ldo) {
  drive<Tile32Wide<BlockQ8_0, 2>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

void OPENTGI_FN(matmul_q4_0)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<Tile32<BlockQ4_0, 0>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q4_1)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<Tile32<BlockQ4_1, 1>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}
void OPENTGI_FN(matmul_q8_0)(const uint8_t* w, size_t rb, const uint8_t* act, size_t arb, int M, int n0, int n1,
                             int K, float* out, int ldo) {
  drive<Tile32<BlockQ8_0, 2>>(w, rb, act, arb, M, n0, n1, K, out, ldo);
}

}  // namespace opentgi
