// The few-row projections' AVX-512 tiles (few_rows.h), compiled for AVX-512 within the
// AVX2 build and run only on CPUs that have it. Every header is included before the
// target switch, so none of their inline functions is emitted with AVX-512 code.
#include "few_rows.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma")

namespace iterserve_cpu {
namespace {

constexpr int kMaxM = 4;

// out[j] = the lane sums of a[j], j < k: each halved to 8 lanes, then hsum_store.
inline void reduce_store(const __m512* a, int k, float* out) {
  __m256 h[kTileRows * kMaxM];
  for (int j = 0; j < k; ++j) h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm512_extractf32x8_ps(a[j], 1));
  hsum_store(h, k, out);
}

inline __mmask16 tail_mask(int64_t rem) { return static_cast<__mmask16>((1u << rem) - 1u); }

// out[t * M + m] = dot(w[t * n : t * n + n], x[m * xs : m * xs + n]), t < TR, m < M.
template <int TR, int M>
void tile(const float* w, int64_t n, const float* x, int64_t xs, float* out) {
  __m512 a[TR * M];
  for (auto& v : a) v = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int t = 0; t < TR; ++t) _mm_prefetch(reinterpret_cast<const char*>(w + t * n + i + 2 * kPrefetch), _MM_HINT_T0);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * xs + i);
    for (int t = 0; t < TR; ++t) {
      const __m512 wv = _mm512_loadu_ps(w + t * n + i);
      for (int m = 0; m < M; ++m) a[t * M + m] = _mm512_fmadd_ps(wv, xv[m], a[t * M + m]);
    }
  }
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_ps(k, x + m * xs + i);
    for (int t = 0; t < TR; ++t) {
      const __m512 wv = _mm512_maskz_loadu_ps(k, w + t * n + i);
      for (int m = 0; m < M; ++m) a[t * M + m] = _mm512_fmadd_ps(wv, xv[m], a[t * M + m]);
    }
  }
  reduce_store(a, TR * M, out);
}

inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// bf16 weights, x in pair_layout32: one 512-bit load is 32 weights, the even ones
// widened by a shift, the odd ones by an AND; the tail (n % 32, natural order) widened
// 16 at a time, its last part by masked loads.
template <int TR, int M>
void tile(const c10::BFloat16* w, int64_t n, const float* xd, int64_t xs, float* out) {
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 a[TR * M];
  for (auto& v : a) v = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int t = 0; t < TR; ++t) _mm_prefetch(reinterpret_cast<const char*>(w + t * n + i + 4 * kPrefetch), _MM_HINT_T0);
    __m512 x0[M], x1[M];
    for (int m = 0; m < M; ++m) x0[m] = _mm512_loadu_ps(xd + m * xs + i), x1[m] = _mm512_loadu_ps(xd + m * xs + i + 16);
    for (int t = 0; t < TR; ++t) {
      const __m512i v = _mm512_loadu_si512(w + t * n + i);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 up = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
      for (int m = 0; m < M; ++m) a[t * M + m] = _mm512_fmadd_ps(up, x1[m], _mm512_fmadd_ps(lo, x0[m], a[t * M + m]));
    }
  }
  for (; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - i);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_ps(k, xd + m * xs + i);
    for (int t = 0; t < TR; ++t) {
      const __m512 wv = widen16(_mm256_maskz_loadu_epi16(k, w + t * n + i));
      for (int m = 0; m < M; ++m) a[t * M + m] = _mm512_fmadd_ps(wv, xv[m], a[t * M + m]);
    }
  }
  reduce_store(a, TR * M, out);
}

template <typename T>
void range(const T* w, const T* b, int64_t in, int64_t out, const float* x, int64_t R, float* y, int64_t r0,
           int64_t r1, bool add) {
  const int64_t g = input_groups(R, kMaxM);
  float res[kTileRows * kMaxM];
  const int64_t done = for_tiles(r0, r1, [&](int64_t o) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t m0 = R * j / g, M = R * (j + 1) / g - m0;
      const T* wt = w + o * in;
      const float* xm = x + m0 * in;
      switch (M) {
        case 4: tile<kTileRows, 4>(wt, in, xm, in, res); break;
        case 3: tile<kTileRows, 3>(wt, in, xm, in, res); break;
        case 2: tile<kTileRows, 2>(wt, in, xm, in, res); break;
        default: tile<kTileRows, 1>(wt, in, xm, in, res); break;
      }
      store_tile(res, kTileRows, static_cast<int>(M), b, o, out, y + m0 * out, add);
    }
  });
  // The rows left over, one tile row at a time.
  for (int64_t o = done; o < r1; ++o) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t m0 = R * j / g, M = R * (j + 1) / g - m0;
      const T* wt = w + o * in;
      const float* xm = x + m0 * in;
      switch (M) {
        case 4: tile<1, 4>(wt, in, xm, in, res); break;
        case 3: tile<1, 3>(wt, in, xm, in, res); break;
        case 2: tile<1, 2>(wt, in, xm, in, res); break;
        default: tile<1, 1>(wt, in, xm, in, res); break;
      }
      store_tile(res, 1, static_cast<int>(M), b, o, out, y + m0 * out, add);
    }
  }
}

}  // namespace

void tiles_avx512_range(const float* w, const float* b, int64_t in, int64_t out, const float* x, int64_t R, float* y,
                        int64_t r0, int64_t r1, bool add) {
  range(w, b, in, out, x, R, y, r0, r1, add);
}
void tiles_avx512_range(const c10::BFloat16* w, const c10::BFloat16* b, int64_t in, int64_t out, const float* xd,
                        int64_t R, float* y, int64_t r0, int64_t r1, bool add) {
  range(w, b, in, out, xd, R, y, r0, r1, add);
}

}  // namespace iterserve_cpu

#pragma GCC pop_options
