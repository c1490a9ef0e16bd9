// The decoder's few-row projections (R = 2..64 inputs: a handful of decodes, or one
// request's verify run): y[m, o] = x[m] . W[o] (+ b[o]) over a range of output rows.
//
// Register tiles: TR consecutive weight rows times a group of M inputs per pass, one
// accumulator per (row, input), so each weight vector is loaded (and, in bf16, widened)
// once for M inputs and each input vector once for TR rows. The accumulators are then
// reduced together (hsum8_store: eight of them in three rounds of hadd) instead of one
// horizontal sum per (row, input), which at the decoder's widths (a few hundred
// elements) cost as much as the products. More than M inputs take several passes over
// the tile's rows (a few KB, still in L1). Rows left over at the end of a range take
// the per-row kernel (dot_rows_any).
//
// AVX2 (16 ymm registers): tiles of 4 rows x up to 3 inputs. AVX-512 (32 zmm, on CPUs
// that have it, picked at run time): 4 rows x up to 4 inputs, the element tail by
// masked loads; bf16 inputs in pair_layout32 (the same even/odd trick over 32-element
// blocks, one 512-bit load of weights widened by one shift and one AND).
#pragma once
#include "kernels.h"

namespace iterserve_cpu {

// Which kernel the few-row projections take: the per-row one, the AVX2 tiles, the
// AVX-512 tiles, or (bf16 weights; float ones take the AVX-512 tiles) the bf16
// dot-product tiles of few_rows_bf16.cpp.
enum FewRowsKernel : int {
  kFewRowsPerRow = 0,
  kFewRowsAvx2 = 1,
  kFewRowsAvx512 = 2,
  kFewRowsBf16Dot = 3,
  kFewRowsBf16Packed = 4,  // bf16 weights in pack_bf16_pairs' layout; others as kFewRowsBf16Dot
};
constexpr int kFewRowsLast = kFewRowsBf16Packed;

inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
}
inline bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}
inline int default_few_rows_kernel() { return cpu_has_avx512() ? kFewRowsAvx512 : kFewRowsAvx2; }
// The kernel the decoder takes (set_few_rows_kernel changes it).
inline std::atomic<int>& few_rows_kernel() {
  static std::atomic<int> k{default_few_rows_kernel()};
  return k;
}
inline void check_few_rows_kernel(int64_t kernel) {
  TORCH_CHECK(kernel >= 0 && kernel <= kFewRowsLast && (kernel != kFewRowsAvx512 || cpu_has_avx512()) &&
                  (kernel < kFewRowsBf16Dot || cpu_has_avx512_bf16()),
              "few-row kernel ", kernel, " does not exist on this CPU");
}

constexpr int kTileRows = 4;

// out[0..k) = the lane sums of a[0..k): eights together, then fours, then one by one.
inline void hsum_store(const __m256* a, int k, float* out) {
  int j = 0;
  for (; j + 8 <= k; j += 8) hsum8_store(a + j, out + j);
  for (; j + 4 <= k; j += 4) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[j], a[j + 1]), _mm256_hadd_ps(a[j + 2], a[j + 3]));
    _mm_storeu_ps(out + j, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
  }
  for (; j < k; ++j) out[j] = hsum(a[j]);
}

// out[t * M + m] = dot(w[t * n : t * n + n], x[m * xs : m * xs + n]), t < TR, m < M.
template <int TR, int M>
inline void tile_avx2(const float* w, int64_t n, const float* x, int64_t xs, float* out) {
  __m256 a[TR * M];
  for (auto& v : a) v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (i % 16 == 0)
      for (int t = 0; t < TR; ++t) _mm_prefetch(reinterpret_cast<const char*>(w + t * n + i + 2 * kPrefetch), _MM_HINT_T0);
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * xs + i);
    for (int t = 0; t < TR; ++t) {
      const __m256 wv = _mm256_loadu_ps(w + t * n + i);
      for (int m = 0; m < M; ++m) a[t * M + m] = _mm256_fmadd_ps(wv, xv[m], a[t * M + m]);
    }
  }
  hsum_store(a, TR * M, out);
  for (; i < n; ++i)
    for (int t = 0; t < TR; ++t)
      for (int m = 0; m < M; ++m) out[t * M + m] += w[t * n + i] * x[m * xs + i];
}

// bf16 weights, x in pair_layout (the tail, n % 16, in natural order).
template <int TR, int M>
inline void tile_avx2(const c10::BFloat16* w, int64_t n, const float* xd, int64_t xs, float* out) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 a[TR * M];
  for (auto& v : a) v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int t = 0; t < TR; ++t) _mm_prefetch(reinterpret_cast<const char*>(w + t * n + i + 2 * kPrefetch), _MM_HINT_T0);
    __m256 x0[M], x1[M];
    for (int m = 0; m < M; ++m) x0[m] = _mm256_loadu_ps(xd + m * xs + i), x1[m] = _mm256_loadu_ps(xd + m * xs + i + 8);
    for (int t = 0; t < TR; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + t * n + i));
      const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 up = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
      for (int m = 0; m < M; ++m) a[t * M + m] = _mm256_fmadd_ps(up, x1[m], _mm256_fmadd_ps(lo, x0[m], a[t * M + m]));
    }
  }
  hsum_store(a, TR * M, out);
  for (; i < n; ++i)
    for (int t = 0; t < TR; ++t)
      for (int m = 0; m < M; ++m) out[t * M + m] += static_cast<float>(w[t * n + i]) * xd[m * xs + i];
}

// The inputs [0, R) in g = ceil(R / mmax) groups of nearly equal size (a group of 1
// leaves most of the tile's accumulators idle): group j starts at R * j / g.
inline int64_t input_groups(int64_t R, int64_t mmax) { return (R + mmax - 1) / mmax; }

// y[m * out + o] = v (+ b[o]) for the tile's results res[t * M + m], or y += that.
template <typename T>
inline void store_tile(const float* res, int TR, int M, const T* b, int64_t o, int64_t out, float* y, bool add) {
  for (int t = 0; t < TR; ++t) {
    const float bo = b ? to_float(b[o + t]) : 0.f;
    for (int m = 0; m < M; ++m) {
      float& dst = y[m * out + o + t];
      const float v = res[t * M + m] + bo;
      dst = add ? dst + v : v;
    }
  }
}

// Rows [r0, r1) through the per-row kernel (x in pair_layout for bf16).
template <typename T>
inline void per_row_range(const T* w, const T* b, int64_t in, int64_t out, const float* x, int64_t R, float* y,
                          int64_t r0, int64_t r1, bool add) {
  float s[64];
  for (int64_t o = r0; o < r1; ++o) {
    for (int64_t m0 = 0; m0 < R; m0 += 64) {
      const int64_t k = std::min<int64_t>(64, R - m0);
      dot_rows_any(w + o * in, x + m0 * in, in, in, k, s);
      store_tile(s, 1, static_cast<int>(k), b, o, out, y + m0 * out, add);
    }
  }
}

// The tiles of rows [r0, r1) (whole tiles only), as two interleaved streams
// (for_rows_two_streams) over the tile index; fn(o) computes the tile at row o.
template <typename F>
inline int64_t for_tiles(int64_t r0, int64_t r1, F&& fn) {
  const int64_t tiles = (r1 - r0) / kTileRows;
  for_rows_two_streams(0, tiles, [&](int64_t k) { fn(r0 + k * kTileRows); });
  return r0 + tiles * kTileRows;
}

template <typename T>
inline void tiles_avx2_range(const T* w, const T* b, int64_t in, int64_t out, const float* x, int64_t R, float* y,
                             int64_t r0, int64_t r1, bool add) {
  constexpr int kMaxM = 3;
  const int64_t g = input_groups(R, kMaxM);
  float res[kTileRows * kMaxM];
  const int64_t done = for_tiles(r0, r1, [&](int64_t o) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t m0 = R * j / g, M = R * (j + 1) / g - m0;
      const T* wt = w + o * in;
      const float* xm = x + m0 * in;
      switch (M) {
        case 3: tile_avx2<kTileRows, 3>(wt, in, xm, in, res); break;
        case 2: tile_avx2<kTileRows, 2>(wt, in, xm, in, res); break;
        default: tile_avx2<kTileRows, 1>(wt, in, xm, in, res); break;
      }
      store_tile(res, kTileRows, static_cast<int>(M), b, o, out, y + m0 * out, add);
    }
  });
  per_row_range(w, b, in, out, x, R, y, done, r1, add);
}

// bf16 inputs for the AVX-512 tiles: per 32-element block, the 16 even-indexed entries,
// then the 16 odd; the tail (n % 32) in natural order.
inline void pair_layout32(const float* x, float* xd, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int j = 0; j < 16; ++j) xd[i + j] = x[i + 2 * j], xd[i + 16 + j] = x[i + 2 * j + 1];
  for (; i < n; ++i) xd[i] = x[i];
}

// Compiled for AVX-512 in this AVX2 build; run only where cpu_has_avx512().
void tiles_avx512_range(const float* w, const float* b, int64_t in, int64_t out, const float* x, int64_t R, float* y,
                        int64_t r0, int64_t r1, bool add);
void tiles_avx512_range(const c10::BFloat16* w, const c10::BFloat16* b, int64_t in, int64_t out, const float* xd,
                        int64_t R, float* y, int64_t r0, int64_t r1, bool add);

// Compiled for AVX512_BF16 in this AVX2 build; run only where cpu_has_avx512_bf16().
// to_bf16_rows: xb[0..n) = x rounded to bf16 (nearest even); the tiles take R such
// rows back to back.
void to_bf16_rows(const float* x, int64_t n, uint16_t* xb);
void tiles_bf16dot_range(const c10::BFloat16* w, const c10::BFloat16* b, int64_t in, int64_t out, const uint16_t* xb,
                         int64_t R, float* y, int64_t r0, int64_t r1, bool add);
// The packed layout's projection: rows [r0, r1) (any bounds: a 16-row block that
// straddles one is computed whole, stored in part) for R inputs from to_bf16_pairs.
void to_bf16_pairs(const float* x, int64_t R, int64_t in, uint16_t* xb);
void packed_bf16dot_range(const uint16_t* P, const c10::BFloat16* b, int64_t in, int64_t out, const uint16_t* xb,
                          int64_t R, float* y, int64_t r0, int64_t r1, bool add);

// The packed layout (few_rows_bf16.cpp): 16-row blocks of element pairs,
// P[blk][k][r][j] = W[16 blk + r][2 k + j], zeros past the ends.
inline int64_t packed_bf16_elems(int64_t out, int64_t in) { return (out + 15) / 16 * 16 * ((in + 1) / 2 * 2); }
inline at::Tensor pack_bf16_pairs(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16, "pack_bf16_pairs: a bf16 [out, in]");
  const int64_t out = w.size(0), in = w.size(1), kp_n = (in + 1) / 2, blocks = (out + 15) / 16;
  at::Tensor p = at::empty({packed_bf16_elems(out, in)}, w.options().dtype(at::kShort));
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* P = reinterpret_cast<uint16_t*>(p.data_ptr<int16_t>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk)
      for (int64_t k = 0; k < kp_n; ++k)
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t j = 0; j < 2; ++j) {
            const int64_t o = blk * 16 + r, i = 2 * k + j;
            P[((blk * kp_n + k) * 16 + r) * 2 + j] = (o < out && i < in) ? src[o * in + i] : uint16_t{0};
          }
  });
  return p;
}

// Rows [r0, r1) of y = x W^T (+ b) (or y += ... when `add`) for R >= 1 inputs x [R, in],
// y [R, out], with `kernel`. xd: scratch [R, in], the bf16 inputs' layout, filled here.
// `packed`: W in pack_bf16_pairs' layout (bf16 only, else nullptr), which
// kFewRowsBf16Packed takes; without it that kernel is kFewRowsBf16Dot.
template <typename T>
inline void few_rows_range(const T* w, const T* b, int64_t in, int64_t out, const float* x, int64_t R, float* xd,
                           float* y, int64_t r0, int64_t r1, bool add, int kernel, const uint16_t* packed = nullptr) {
  constexpr bool pairs = std::is_same<T, c10::BFloat16>::value;
  if constexpr (pairs) {
    if (kernel == kFewRowsBf16Packed && packed != nullptr) {
      auto* xb = reinterpret_cast<uint16_t*>(xd);
      to_bf16_pairs(x, R, in, xb);
      packed_bf16dot_range(packed, b, in, out, xb, R, y, r0, r1, add);
      return;
    }
    if (kernel >= kFewRowsBf16Dot) {
      auto* xb = reinterpret_cast<uint16_t*>(xd);
      for (int64_t m = 0; m < R; ++m) to_bf16_rows(x + m * in, in, xb + m * in);
      tiles_bf16dot_range(w, b, in, out, xb, R, y, r0, r1, add);
      return;
    }
  }
  if (kernel >= kFewRowsAvx512) {
    if (pairs) {
      for (int64_t m = 0; m < R; ++m) pair_layout32(x + m * in, xd + m * in, in);
    }
    tiles_avx512_range(w, b, in, out, pairs ? xd : x, R, y, r0, r1, add);
    return;
  }
  if (pairs) {
    for (int64_t m = 0; m < R; ++m) pair_layout(x + m * in, xd + m * in, in);
  }
  if (kernel == kFewRowsAvx2) {
    tiles_avx2_range(w, b, in, out, pairs ? xd : x, R, y, r0, r1, add);
  } else {
    per_row_range(w, b, in, out, pairs ? xd : x, R, y, r0, r1, add);
  }
}

}  // namespace iterserve_cpu
