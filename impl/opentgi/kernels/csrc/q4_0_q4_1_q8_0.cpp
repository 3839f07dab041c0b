// Q4_0 (w = d * (q - 8)), Q4_1 (w = d * q + m) and Q8_0 (w = d * q): blocks of 32 against ActQ8.
// Per output: AVX2 keeps 8 float lanes, each adding its block's 4-product integer sums times
// d_w * d_x by FMA in block order, summed across lanes once at the end (Q4_1's m * d_x * sum(q_x)
// added in a separate float, block by block); the scalar path adds (d_w * d_x) * (exact block sum)
// in block order. Each path gives a row the same bits alone or among others.
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
    for (int r = 0; r < R; ++r) a[r] = (const ActQ8*)(act + r * stride);
    float mins[R];
    for (int r = 0; r < R; ++r) mins[r] = 0.0f;
#ifdef OPENTGI_AVX2
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const float dw = fp16_to_fp32(w[b].d);
      __m256i q;
      if constexpr (Kind == 2) q = _mm256_loadu_si256((const __m256i*)w[b].qs);
      else q = nibbles32(w[b].qs);
      if constexpr (Kind == 0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
      for (int r = 0; r < R; ++r) {
        const ActQ8& y = a[r][b];
        const __m256i qy = _mm256_loadu_si256((const __m256i*)y.qs);
        const __m256i s = Kind == 1 ? dot_u8(q, qy) : dot_i8(q, qy);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * y.d), _mm256_cvtepi32_ps(s), acc[r]);
        if constexpr (Kind == 1) mins[r] += fp16_to_fp32(((const BlockQ4_1*)w)[b].m) * (y.d * (float)y.sum);
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = hsum_ps(acc[r]) + mins[r];
#else
    float acc[R];
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int b = 0; b < nb; ++b) {
      const float dw = fp16_to_fp32(w[b].d);
      int8_t q[QK];
      for (int i = 0; i < QK; ++i) {
        if constexpr (Kind == 2) {
          q[i] = ((const BlockQ8_0*)w)[b].qs[i];
        } else {
          const uint8_t byte = ((const uint8_t*)w[b].qs)[i % 16];
          q[i] = (int8_t)((i < 16 ? byte & 0x0F : byte >> 4) - (Kind == 0 ? 8 : 0));
        }
      }
      for (int r = 0; r < R; ++r) {
        const ActQ8& y = a[r][b];
        int32_t s = 0;
        for (int i = 0; i < QK; ++i) s += (int32_t)q[i] * y.qs[i];
        acc[r] += (dw * y.d) * (float)s;
        if constexpr (Kind == 1) mins[r] += fp16_to_fp32(((const BlockQ4_1*)w)[b].m) * (y.d * (float)y.sum);
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = acc[r] + mins[r];
#endif
  }

#ifdef OPENTGI_AVX2
  // C weight rows (row_bytes apart) at once against R < 4 activation rows: each output by exactly
  // run<R>'s instructions in run<R>'s order (the same bits), C independent chains in flight where
  // run<1> has one (out[r * ldo + c]). Q8_0 keeps one weight row at a time: its column form read a
  // large weight from memory slower (a model's head), whatever the prefetch distance.
  static constexpr bool has_cols = Kind != 2;
  template <int R, int C>
  static inline void run_cols(const uint8_t* wr, size_t row_bytes, const uint8_t* act, size_t stride, int K,
                              float* out, int ldo) {
    const int nb = K / QK;
    const ActQ8* a[R];
    for (int r = 0; r < R; ++r) a[r] = (const ActQ8*)(act + r * stride);
    const Block* w[C];
    for (int c = 0; c < C; ++c) w[c] = (const Block*)(wr + c * row_bytes);
    __m256 acc[R][C];
    float mins[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm256_setzero_ps();
        mins[r][c] = 0.0f;
      }
    for (int b = 0; b < nb; ++b) {
      __m256i qy[R];
      for (int r = 0; r < R; ++r) qy[r] = _mm256_loadu_si256((const __m256i*)a[r][b].qs);
      for (int c = 0; c < C; ++c) {
        // the next C rows' same bytes: streams of C interleaved rows defeat the hardware
        // prefetcher where the weight comes from memory (a large head)
        _mm_prefetch((const char*)(w[c] + b) + 2 * C * row_bytes, _MM_HINT_T0);
        const float dw = fp16_to_fp32(w[c][b].d);
        __m256i q;
        if constexpr (Kind == 2) q = _mm256_loadu_si256((const __m256i*)w[c][b].qs);
        else q = nibbles32(w[c][b].qs);
        if constexpr (Kind == 0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
        for (int r = 0; r < R; ++r) {
          const ActQ8& y = a[r][b];
          const __m256i s = Kind == 1 ? dot_u8(q, qy[r]) : dot_i8(q, qy[r]);
          acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * y.d), _mm256_cvtepi32_ps(s), acc[r][c]);
          if constexpr (Kind == 1) mins[r][c] += fp16_to_fp32(((const BlockQ4_1*)w[c])[b].m) * (y.d * (float)y.sum);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[r * ldo + c] = hsum_ps(acc[r][c]) + mins[r][c];
  }
#endif
};

}  // namespace

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
