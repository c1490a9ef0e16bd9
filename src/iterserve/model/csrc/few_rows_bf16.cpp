// The few-row projections' bf16 dot-product tiles (few_rows.h's kFewRowsBf16Dot), for
// bf16 weights on CPUs with AVX512_BF16: the inputs are rounded to bf16 once per
// projection (round-to-nearest-even, as torch rounds a bf16 model's activations before
// every linear), then each vdpbf16ps multiplies 32 weight/input pairs into 16 float
// accumulators. Against widening the weights to float and FMA-ing (the AVX-512 tiles)
// that is twice the products per instruction and no widening, which is what a verify
// run or a handful of decodes over cache-resident weights is bound by. The weights stay
// in their natural layout: vdpbf16ps pairs neighbouring elements of both operands, so
// a row's dot product is the lane sum whatever the pairing.
//
// Tiles of 4 weight rows x up to 6 inputs (24 accumulators, 6 inputs and one weight
// vector: 31 of the 32 zmm registers); more inputs take several passes over the tile.
#include "few_rows.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")

namespace iterserve_cpu {
namespace {

constexpr int kMaxM = 6;

inline void reduce_store(const __m512* a, int k, float* out) {
  __m256 h[kTileRows * kMaxM];
  for (int j = 0; j < k; ++j) h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm512_extractf32x8_ps(a[j], 1));
  hsum_store(h, k, out);
}

// out[t * M + m] = dot(w[t * n : t * n + n], x[m * xs : m * xs + n]) over bf16 w and x.
template <int TR, int M>
void tile(const uint16_t* w, int64_t n, const uint16_t* x, int64_t xs, float* out) {
  __m512 a[TR * M];
  for (auto& v : a) v = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int t = 0; t < TR; ++t) _mm_prefetch(reinterpret_cast<const char*>(w + t * n + i + 4 * kPrefetch), _MM_HINT_T0);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * xs + i);
    for (int t = 0; t < TR; ++t) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + t * n + i);
      for (int m = 0; m < M; ++m) a[t * M + m] = _mm512_dpbf16_ps(a[t * M + m], wv, xv[m]);
    }
  }
  if (i < n) {
    // Zeros past the end pair with zeros: they add nothing.
    const __mmask32 k = static_cast<__mmask32>((1ull << (n - i)) - 1ull);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(k, x + m * xs + i);
    for (int t = 0; t < TR; ++t) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(k, w + t * n + i);
      for (int m = 0; m < M; ++m) a[t * M + m] = _mm512_dpbf16_ps(a[t * M + m], wv, xv[m]);
    }
  }
  reduce_store(a, TR * M, out);
}

template <int TR>
inline void tile_m(int64_t M, const uint16_t* w, int64_t n, const uint16_t* x, float* out) {
  switch (M) {
    case 6: tile<TR, 6>(w, n, x, n, out); break;
    case 5: tile<TR, 5>(w, n, x, n, out); break;
    case 4: tile<TR, 4>(w, n, x, n, out); break;
    case 3: tile<TR, 3>(w, n, x, n, out); break;
    case 2: tile<TR, 2>(w, n, x, n, out); break;
    default: tile<TR, 1>(w, n, x, n, out); break;
  }
}

}  // namespace

void to_bf16_rows(const float* x, int64_t n, uint16_t* xb) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(xb + i, (__m512i)v);
  }
  for (; i < n; ++i) xb[i] = c10::BFloat16(x[i]).x;  // round-to-nearest-even, as above
}

void tiles_bf16dot_range(const c10::BFloat16* w, const c10::BFloat16* b, int64_t in, int64_t out, const uint16_t* xb,
                         int64_t R, float* y, int64_t r0, int64_t r1, bool add) {
  const auto* wb = reinterpret_cast<const uint16_t*>(w);
  const int64_t g = input_groups(R, kMaxM);
  float res[kTileRows * kMaxM];
  const int64_t done = for_tiles(r0, r1, [&](int64_t o) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t m0 = R * j / g, M = R * (j + 1) / g - m0;
      tile_m<kTileRows>(M, wb + o * in, in, xb + m0 * in, res);
      store_tile(res, kTileRows, static_cast<int>(M), b, o, out, y + m0 * out, add);
    }
  });
  for (int64_t o = done; o < r1; ++o) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t m0 = R * j / g, M = R * (j + 1) / g - m0;
      tile_m<1>(M, wb + o * in, in, xb + m0 * in, res);
      store_tile(res, 1, static_cast<int>(M), b, o, out, y + m0 * out, add);
    }
  }
}


// -- the packed layout (kFewRowsBf16Packed) ------------------------------------------
//
// W [out, in] as 16-row blocks of element pairs: P[blk][k][r][j] = W[16 blk + r][2 k + j]
// (zeros past the ends), so one 64-byte load holds a pair of elements of 16 output rows
// and vdpbf16ps against one input pair, broadcast, adds into those 16 rows' sums: the
// accumulators are the outputs, with no horizontal sums at all. The tiles: TB blocks x
// M inputs per pass.

namespace {

constexpr int kPackMaxM = 6;

template <int TB, int M>
void packed_tile(const uint16_t* P, int64_t kp_n, const uint32_t* x, int64_t xs, __m512* acc) {
  for (int j = 0; j < TB * M; ++j) acc[j] = _mm512_setzero_ps();
  const uint16_t* wb[TB];
  for (int t = 0; t < TB; ++t) wb[t] = P + t * kp_n * 32;
  for (int64_t k = 0; k < kp_n; ++k) {
    if (k % 2 == 0)
      for (int t = 0; t < TB; ++t) _mm_prefetch(reinterpret_cast<const char*>(wb[t] + (k + 8) * 32), _MM_HINT_T0);
    __m512bh wv[TB];
    for (int t = 0; t < TB; ++t) wv[t] = (__m512bh)_mm512_loadu_si512(wb[t] + k * 32);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * xs + k]));
      for (int t = 0; t < TB; ++t) acc[t * M + m] = _mm512_dpbf16_ps(acc[t * M + m], wv[t], xv);
    }
  }
}

// y[m, o] (+)= acc + b for the lanes of block `blk` inside [r0, r1).
inline void packed_store(const __m512* acc, int TB, int M, int64_t blk, const c10::BFloat16* b, int64_t out,
                         float* y, int64_t r0, int64_t r1, bool add) {
  for (int t = 0; t < TB; ++t) {
    const int64_t o0 = (blk + t) * 16;
    // Ternaries, not std::max/min: no template is instantiated under this target.
    const int64_t lo = (r0 > o0 ? r0 : o0) - o0, hi = (r1 < o0 + 16 ? r1 : o0 + 16) - o0;
    if (hi <= lo) continue;
    const __mmask16 mk = static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    __m512 bias = _mm512_setzero_ps();
    if (b) {
      const __m256i raw = _mm256_maskz_loadu_epi16(mk, reinterpret_cast<const uint16_t*>(b) + o0);
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int m = 0; m < M; ++m) {
      float* dst = y + m * out + o0;
      __m512 v = _mm512_add_ps(acc[t * M + m], bias);
      if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, dst));
      _mm512_mask_storeu_ps(dst, mk, v);
    }
  }
}

template <int TB>
inline void packed_tile_m(int64_t M, const uint16_t* P, int64_t kp_n, const uint32_t* x, int64_t xs, __m512* acc) {
  switch (M) {
    case 6: packed_tile<TB, 6>(P, kp_n, x, xs, acc); break;
    case 5: packed_tile<TB, 5>(P, kp_n, x, xs, acc); break;
    case 4: packed_tile<TB, 4>(P, kp_n, x, xs, acc); break;
    case 3: packed_tile<TB, 3>(P, kp_n, x, xs, acc); break;
    case 2: packed_tile<TB, 2>(P, kp_n, x, xs, acc); break;
    default: packed_tile<TB, 1>(P, kp_n, x, xs, acc); break;
  }
}

}  // namespace

void packed_bf16dot_range(const uint16_t* P, const c10::BFloat16* b, int64_t in, int64_t out, const uint16_t* xb,
                          int64_t R, float* y, int64_t r0, int64_t r1, bool add) {
  if (r1 <= r0) return;
  // xb: R rows of in_pad = 2 * kp_n bf16 (the pad a zero), read as 32-bit pairs.
  const int64_t kp_n = (in + 1) / 2;
  const auto* x = reinterpret_cast<const uint32_t*>(xb);
  const int64_t g = input_groups(R, kPackMaxM);
  const int64_t b0 = r0 / 16, b1 = (r1 + 15) / 16;
  constexpr int TB = 4;
  __m512 acc[TB * kPackMaxM];
  int64_t blk = b0;
  for (; blk + TB <= b1; blk += TB)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t m0 = R * j / g, M = R * (j + 1) / g - m0;
      packed_tile_m<TB>(M, P + blk * kp_n * 32, kp_n, x + m0 * kp_n, kp_n, acc);
      packed_store(acc, TB, static_cast<int>(M), blk, b, out, y + m0 * out, r0, r1, add);
    }
  for (; blk < b1; ++blk)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t m0 = R * j / g, M = R * (j + 1) / g - m0;
      packed_tile_m<1>(M, P + blk * kp_n * 32, kp_n, x + m0 * kp_n, kp_n, acc);
      packed_store(acc, 1, static_cast<int>(M), blk, b, out, y + m0 * out, r0, r1, add);
    }
}

// x [R, in] float -> R rows of 2 * ceil(in / 2) bf16 (the pad a zero).
void to_bf16_pairs(const float* x, int64_t R, int64_t in, uint16_t* xb) {
  const int64_t in_pad = (in + 1) / 2 * 2;
  for (int64_t m = 0; m < R; ++m) {
    to_bf16_rows(x + m * in, in, xb + m * in_pad);
    if (in_pad != in) xb[m * in_pad + in] = 0;
  }
}

}  // namespace iterserve_cpu

#pragma GCC pop_options
