// Register tiles over pair-packed bfloat16 weights, shared by the MoE experts kernel
// (moe_experts.cpp) and the dense pair GEMM (pair_gemm.cpp).
//
// A weight [N, K] is packed into column blocks of 16 outputs with input pairs
// interleaved, [N / 16, K / 2, 16, 2]: one 64-byte load is the 16 columns' weights for
// inputs k and k + 1, the operand of one vdpbf16ps (AVX-512 BF16) against a broadcast
// pair of a row's inputs; or, widened to two float vectors, of two FMAs (every AVX-512
// CPU; the faster where vdpbf16ps issues at half the FMA rate). A tile is up to kRows
// rows x 32 columns (24 accumulators).
//
// Include inside a `#pragma GCC target` region with avx512f/bw/dq/vl, avx512bf16, fma.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace iterserve_pair {

constexpr int kRows = 12;  // rows per tile

// float32 -> bfloat16 bits, round to nearest even (c10's rounding, NaN aside).
inline __m256i to_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

inline __m512 from_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 round_bf16(__m512 v) { return from_bf16(to_bf16(v)); }

// acc[r][c] = sum_k x_r[k] * w_c[k] for R rows and two 16-column blocks (w0, w1: packed
// [K / 2][16][2]). BF16: x_r bfloat16 rows, one vdpbf16ps per pair; else x_r float rows
// (widened once per pass, so each broadcast is a plain load) and the weight pair widened
// to two float vectors, two FMAs.
template <int R, bool BF16, typename X>
inline void tile(const X* const* x, const uint16_t* w0, const uint16_t* w1, int64_t K,
                 __m512 (&acc)[kRows][2]) {
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + p * 32) + 1024, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + p * 32) + 1024, _MM_HINT_T0);
    const __m512i a = _mm512_loadu_si512(w0 + p * 32), b = _mm512_loadu_si512(w1 + p * 32);
    if constexpr (BF16) {
      for (int r = 0; r < R; ++r) {
        int32_t xp;
        std::memcpy(&xp, x[r] + 2 * p, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, (__m512bh)a);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, (__m512bh)b);
      }
    } else {
      const __m512i hi = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      const __m512 a0 = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
      const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(a, hi));
      const __m512 b0 = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
      const __m512 b1 = _mm512_castsi512_ps(_mm512_and_si512(b, hi));
      for (int r = 0; r < R; ++r) {
        const __m512 x0 = _mm512_set1_ps(x[r][2 * p]);
        const __m512 x1 = _mm512_set1_ps(x[r][2 * p + 1]);
        acc[r][0] = _mm512_fmadd_ps(x1, a1, _mm512_fmadd_ps(x0, a0, acc[r][0]));
        acc[r][1] = _mm512_fmadd_ps(x1, b1, _mm512_fmadd_ps(x0, b0, acc[r][1]));
      }
    }
  }
}

// Dispatch a tile of n <= kRows rows to its instantiation.
template <bool BF16, typename X>
inline void tile_n(int n, const X* const* x, const uint16_t* w0, const uint16_t* w1,
                   int64_t K, __m512 (&acc)[kRows][2]) {
  switch (n) {
#define ITERSERVE_TILE(R) case R: tile<R, BF16, X>(x, w0, w1, K, acc); break;
    ITERSERVE_TILE(1) ITERSERVE_TILE(2) ITERSERVE_TILE(3) ITERSERVE_TILE(4)
    ITERSERVE_TILE(5) ITERSERVE_TILE(6) ITERSERVE_TILE(7) ITERSERVE_TILE(8)
    ITERSERVE_TILE(9) ITERSERVE_TILE(10) ITERSERVE_TILE(11) ITERSERVE_TILE(12)
#undef ITERSERVE_TILE
    default: break;
  }
}

}  // namespace iterserve_pair
