// Vector helpers and the one-query paged attention shared by the CPU kernels
// (cpu_ops.cpp: the batch-1 decoder; paged_attention.cpp: batched decodes).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace iterserve_cpu {

// How far ahead (in elements) the GEMV prefetches within its row stream.
constexpr int64_t kPrefetch = 64;

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  // bf16 is the high half of a float32: widen to 32 bits and shift into place.
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// An 8-bit KV cache (model/kv_quant.py): int8 or e4m3 values, one bfloat16 scale per
// cached row (token, KV head). The loads give the raw value, the row's scale is
// applied once per score (K) and per softmax weight (V).
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float to_float(int8_t v) { return static_cast<float>(v); }

// e4m3 (no infinities, max 448) moved into a float16's bits: the sign to bit 15, the
// 4 exponent and 3 mantissa bits to bits 7-13. That half is the e4m3 value / 256,
// subnormals included (both formats' subnormals line up), and F16C widens it exactly.
struct E4M3 {
  uint8_t bits;
};
inline __m128i e4m3_to_half_bits(__m128i b16) {  // 8 bytes zero-extended to 16 bits
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b16, _mm_set1_epi16(0x80)), 8);
  return _mm_or_si128(sign, _mm_slli_epi16(_mm_and_si128(b16, _mm_set1_epi16(0x7F)), 7));
}
inline __m256 load8(const E4M3* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(e4m3_to_half_bits(b));
}
inline float to_float(E4M3 v) {
  const uint16_t h = static_cast<uint16_t>(((v.bits & 0x80) << 8) | ((v.bits & 0x7F) << 7));
  return _cvtsh_ss(h);
}
// One token's K or V rows (float32, [kvh * hd]) into a cache row `dst` of type C: cast
// (float / bf16), or quantized per KV head with its scale into `scales` [kvh] (8-bit),
// bit for bit as model/kv_quant.py's quantize_rows does.
template <typename C>
inline void store_kv_row(C* dst, c10::BFloat16* scales, const float* x, int64_t kvh, int64_t hd) {
  if constexpr (std::is_same<C, int8_t>::value || std::is_same<C, E4M3>::value) {
    constexpr float qmax = std::is_same<C, int8_t>::value ? 127.f : 448.f;
    for (int64_t h = 0; h < kvh; ++h) {
      const float* xs = x + h * hd;
      float amax = 0.f;
      for (int64_t d = 0; d < hd; ++d) amax = std::max(amax, std::fabs(xs[d]));
      const c10::BFloat16 s(std::max(amax / qmax, 1e-30f));
      scales[h] = s;
      const float sf = static_cast<float>(s);
      for (int64_t d = 0; d < hd; ++d) {
        const float y = std::min(std::max(xs[d] / sf, -qmax), qmax);
        if constexpr (std::is_same<C, int8_t>::value) {
          dst[h * hd + d] = static_cast<int8_t>(std::nearbyint(y));
        } else {
          dst[h * hd + d] = E4M3{c10::Float8_e4m3fn(y).x};
        }
      }
    }
  } else {
    for (int64_t i = 0; i < kvh * hd; ++i) dst[i] = static_cast<C>(x[i]);
  }
}

template <typename T>
constexpr bool kQuantizedKV = std::is_same<T, int8_t>::value || std::is_same<T, E4M3>::value;
// A row's scale as the loads above need it (e4m3 loads give value / 256).
template <typename T>
inline float row_scale(c10::BFloat16 s) {
  return static_cast<float>(s) * (std::is_same<T, E4M3>::value ? 256.f : 1.f);
}

// dot(w[0:n], x[0:n]) with x float32; a single forward stream over w.
template <typename T>
inline float dot_row(const T* w, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + i + kPrefetch + 16), _MM_HINT_T0);
    a0 = _mm256_fmadd_ps(load8(w + i), load8(x + i), a0);
    a1 = _mm256_fmadd_ps(load8(w + i + 8), load8(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + i + 16), load8(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + i + 24), load8(x + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load8(w + i), load8(x + i), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += to_float(w[i]) * x[i];
  return s;
}

// Prefetch one cached K or V row (`bytes` long) into L1: the next block's, while this
// block is computed, since a block is a new stream the hardware prefetcher has to find.
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}
// out[t] = the sum of a[t]'s 8 lanes, for t = 0..7, in three rounds of hadd.
inline void hsum8_store(const __m256* a, float* out) {
  // hadd pairs: lanes hold partial sums of (0,1,0,1 | ...), then (0,1,2,3 | ...).
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // Each 128-bit half now holds 0-3 (resp. 4-7) summed over half of the lanes.
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}

// out[t] = dot(w[t * stride : t * stride + n], x[0:n]) for 8 rows t (n a multiple of 8):
// one accumulator per row, reduced together (three rounds of hadd) instead of eight
// horizontal sums. Attention's scores over 8 cached keys at a time.
template <typename T>
inline void dot8_rows(const T* w, int64_t stride, const float* x, int64_t n, float* out) {
  __m256 a[8];
  for (auto& v : a) v = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(load8(w + t * stride + i), xv, a[t]);
  }
  hsum8_store(a, out);
}

// Scores of two query heads (x0, x1) sharing a KV head, over 4 cached keys (rows of
// `w`, `stride` apart; n a multiple of 8): each key row is loaded (and, in bf16,
// widened) once for both heads. out: head 0's 4 scores, then head 1's.
template <typename T>
inline void dot4x2_rows(const T* w, int64_t stride, const float* x0, const float* x1, int64_t n, float* out) {
  __m256 a[8];
  for (auto& v : a) v = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 q0 = _mm256_loadu_ps(x0 + i), q1 = _mm256_loadu_ps(x1 + i);
    for (int t = 0; t < 4; ++t) {
      const __m256 k = load8(w + t * stride + i);
      a[t] = _mm256_fmadd_ps(k, q0, a[t]);
      a[4 + t] = _mm256_fmadd_ps(k, q1, a[4 + t]);
    }
  }
  hsum8_store(a, out);
}

// bf16 weights, two elements per 32-bit lane: w[2j] is the lane's low half (shifted up
// 16 bits it is a float32), w[2j+1] its high half (masked, it is one). So the GEMV
// widens 16 weights with one load, one shift and one AND, against x laid out to match
// (pair_layout: per 16-element block, the 8 even-indexed entries, then the 8 odd).
// Widening each half separately (zero-extend, then shift) made bf16 GEMVs compute-bound
// here, at ~60% of the memory bandwidth.
inline void pair_layout(const float* x, float* xd, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 8; ++j) xd[i + j] = x[i + 2 * j], xd[i + 8 + j] = x[i + 2 * j + 1];
  for (; i < n; ++i) xd[i] = x[i];
}

inline float dot_row_pairs(const c10::BFloat16* w, const float* xd, int64_t n) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i + 2 * kPrefetch), _MM_HINT_T0);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i + 16));
    a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), _mm256_loadu_ps(xd + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v0, hi)), _mm256_loadu_ps(xd + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), _mm256_loadu_ps(xd + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v1, hi)), _mm256_loadu_ps(xd + i + 24), a3);
  }
  for (; i + 16 <= n; i += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
    a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), _mm256_loadu_ps(xd + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi)), _mm256_loadu_ps(xd + i + 8), a1);
  }
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += static_cast<float>(w[i]) * xd[i];
  return s;
}

// One GEMV row: x as is for float32 weights, x in pair_layout (xd) for bf16.
inline float row_dot(const float* w, const float* x, const float*, int64_t n) { return dot_row(w, x, n); }
inline float row_dot(const c10::BFloat16* w, const float*, const float* xd, int64_t n) {
  return dot_row_pairs(w, xd, n);
}

// out[m] = dot(w[0:n], x[m * xs : m * xs + n]) for M <= 4 inputs (the decoder's few-row
// steps): each weight loaded (and, in bf16, widened) once for all of them, two
// accumulators per input. bf16 weights take their inputs in pair_layout, as row_dot.
template <int M>
inline void dot_rows_multi(const float* w, const float* x, int64_t xs, int64_t n, float* out) {
  __m256 a[M][2];
  for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i + 2 * kPrefetch), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
    for (int m = 0; m < M; ++m) {
      a[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * xs + i), a[m][0]);
      a[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * xs + i + 8), a[m][1]);
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 w0 = _mm256_loadu_ps(w + i);
    for (int m = 0; m < M; ++m) a[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * xs + i), a[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    float s = hsum(_mm256_add_ps(a[m][0], a[m][1]));
    for (int64_t j = i; j < n; ++j) s += w[j] * x[m * xs + j];
    out[m] = s;
  }
}

template <int M>
inline void dot_rows_multi(const c10::BFloat16* w, const float* xd, int64_t xs, int64_t n, float* out) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 a[M][2];
  for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i + 2 * kPrefetch), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
    const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256 up = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
    for (int m = 0; m < M; ++m) {
      a[m][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xd + m * xs + i), a[m][0]);
      a[m][1] = _mm256_fmadd_ps(up, _mm256_loadu_ps(xd + m * xs + i + 8), a[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) {  // the tail (n % 16) is in natural order in pair_layout
    float s = hsum(_mm256_add_ps(a[m][0], a[m][1]));
    for (int64_t j = i; j < n; ++j) s += static_cast<float>(w[j]) * xd[m * xs + j];
    out[m] = s;
  }
}

// out[m] = row o of W . x[m] for m < rows (any count), four inputs per pass over the row
// (a row of a few KB stays in L1 for the next pass).
template <typename T>
inline void dot_rows_any(const T* w, const float* x, int64_t xs, int64_t n, int64_t rows, float* out) {
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) dot_rows_multi<4>(w, x + m * xs, xs, n, out + m);
  switch (rows - m) {
    case 3: dot_rows_multi<3>(w, x + m * xs, xs, n, out + m); break;
    case 2: dot_rows_multi<2>(w, x + m * xs, xs, n, out + m); break;
    case 1: dot_rows_multi<1>(w, x + m * xs, xs, n, out + m); break;
    default: break;
  }
}

// fn(o) for every row o in [r0, r1), as two interleaved streams: the first half and the
// second half of the range advance together. Each stream gets its own hardware
// prefetcher, so twice the lines are in flight; with the weights in huge pages this
// made the decoder's bf16 step ~10% faster and its fp32 step 1-5% (in-process A/B).
template <typename F>
inline void for_rows_two_streams(int64_t r0, int64_t r1, F&& fn) {
  if (r1 - r0 < 64) {
    for (int64_t o = r0; o < r1; ++o) fn(o);
    return;
  }
  const int64_t half = (r1 - r0 + 1) / 2;
  for (int64_t o = r0; o < r0 + half; ++o) {
    fn(o);
    if (o + half < r1) fn(o + half);
  }
}

template <typename T>
void gemv_rows(const T* w, const float* x, float* y, int64_t out, int64_t in) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<float> xd;
  if (std::is_same<T, c10::BFloat16>::value) {
    xd.resize(in);
    pair_layout(x, xd.data(), in);
  }
  // One contiguous run of rows per thread: each streams its own part of the matrix.
  const int64_t grain = std::max<int64_t>(1, (out + threads - 1) / threads);
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
    for_rows_two_streams(begin, end, [&](int64_t o) { y[o] = row_dot(w + o * in, x, xd.data(), in); });
  });
}

// exp(x) for 8 floats (Cephes' expf: range reduction by ln 2, degree-5 polynomial),
// within ~2 ulp; softmax calls it on x <= 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// In place: p[i] = exp(p[i] - mx); returns the sum.
inline float exp_sum(float* p, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), m));
    _mm256_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += (p[i] = std::exp(p[i] - mx));
  return s;
}

// a[0:n] += p * v[0:n]
template <typename T>
inline void axpy(float* a, float p, const T* v, int64_t n) {
  int64_t d = 0;
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(a + d, _mm256_fmadd_ps(load8(v + d), pv, _mm256_loadu_ps(a + d)));
  for (; d < n; ++d) a[d] += p * to_float(v[d]);
}

// out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i);
    __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// A barrier for the decoder's team (9 crossings a layer): the threads spin on one
// counter. It measured 1-2% faster a step than libgomp's barrier here.
struct SpinBarrier {
  alignas(64) std::atomic<int> count{0};
  alignas(64) std::atomic<int> gen{0};
  int n = 1;
  void wait() {
    const int g = gen.load(std::memory_order_acquire);
    if (count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count.store(0, std::memory_order_relaxed);
      gen.fetch_add(1, std::memory_order_release);
    } else {
      while (gen.load(std::memory_order_acquire) == g) _mm_pause();
    }
  }
};
// The region's barrier: ours when the team has the size it was made for, else OpenMP's.
struct TeamSync {
  SpinBarrier* bar;
  bool spin;
  void operator()() const {
    if (spin) {
      bar->wait();
    } else {
#pragma omp barrier
    }
  }
};

// Attention of one query token over `context_len` tokens held in the paged cache,
// run by every thread of an enclosing parallel region (thread `tid` of `nt`). kv: the
// layer's [2, num_blocks, block_size, kv_heads, head_dim] cache, already holding this
// token's K/V; qf: the query [heads, head_dim] in float32, already scaled; scratch:
// scores [heads * context_len], stats [nt * 2 * heads], partial [nt * heads * head_dim];
// out [heads * head_dim] float32. Ends with the partials merged; the caller's next
// barrier makes `out` whole.
//
// Split-K, as flash-decoding does: the threads split the context by blocks, each
// streaming whole K/V rows of its own blocks (a row holds every KV head contiguously),
// with a softmax of its own (its max, its sum of exp, its p * V); one barrier, then the
// per-thread parts are merged per head, rescaled to the common max.
//
// `window` > 0: the query sees only the last `window` keys (a sliding-window layer; the
// caller skips whole blocks before the window with `window_blocks`); `softcap` > 0:
// scores are capped as softcap * tanh(s / softcap) first (Gemma 2). An 8-bit cache
// (T int8_t or E4M3) comes with `scales`, the layer's [2, num_blocks, block_size,
// kv_heads] per-row scales.
// A windowed query's blocks and context with the whole blocks before its window dropped.
inline int64_t window_blocks(int64_t window, int64_t block_size, int64_t context_len) {
  return window > 0 && context_len > window ? (context_len - window) / block_size : 0;
}

// One query of attend_rows: its q (scaled, roped), its context and its scratch
// (scores [heads, context_len], stats [nt, 2, heads], partial [nt, heads, hd]).
struct QueryPart {
  const float* qf;
  int64_t context_len;
  float* scores;
  float* stats;
  float* partial;
};

// attend_in_region in two phases, for a caller with several queries to attend (the
// decoder's few-row steps): every query's part, one barrier, then every query's
// attend_merge_head over its heads; each query with scratch of its own.
//
// M queries over one block table (`blocks`, covering the longest context; every
// query's context a prefix of it: the positions of one request's verify run, or rows
// whose tables extend each other): the threads split the longest context by blocks,
// and each block's K rows, then its V rows, are read once for all M queries while
// they sit in L1, instead of once per query.
template <typename T>
void attend_rows(int tid, int nt, const QueryPart* qs, int64_t M, const T* kc, int64_t num_blocks,
                 int64_t block_size, int64_t kvh, int64_t hd, int64_t heads, const int64_t* blocks,
                 int64_t window, float softcap, const c10::BFloat16* scales) {
  const int64_t group = heads / kvh;
  const int64_t row = kvh * hd;
  const T* vc = kc + num_blocks * block_size * row;
  const c10::BFloat16* vscales = scales ? scales + num_blocks * block_size * kvh : nullptr;
  int64_t longest = 0;
  for (int64_t m = 0; m < M; ++m) longest = std::max(longest, qs[m].context_len);
  const int64_t nblk = (longest + block_size - 1) / block_size;
  const int64_t b0 = nblk * tid / nt, b1 = nblk * (tid + 1) / nt;
  const int64_t t0 = b0 * block_size;
  for (int64_t m = 0; m < M; ++m)
    std::fill(qs[m].partial + tid * heads * hd, qs[m].partial + (tid + 1) * heads * hd, 0.f);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t tb = b * block_size;
    const T* base = kc + blocks[b] * block_size * row;
    const T* next = b + 1 < b1 ? kc + blocks[b + 1] * block_size * row : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      const float* qf = qs[m].qf;
      const int64_t ctx = qs[m].context_len, n = std::min(block_size, ctx - tb);
      if (n <= 0) continue;
      float* scores = qs[m].scores;
      // The next block's K rows are fetched alongside the first query's pass over this one.
      const T* pf = m == 0 ? next : nullptr;
      int64_t j = 0;
      if (hd % 8 == 0 && group % 2 == 0)  // GQA: both query heads of a KV head at once
        for (; j + 4 <= n; j += 4) {
          if (pf)
            for (int64_t t = j; t < j + 4; ++t) prefetch_row(pf + t * row, row * sizeof(T));
          for (int64_t qh = 0; qh < heads; qh += 2) {
            float o[8];
            dot4x2_rows(base + j * row + (qh / group) * hd, row, qf + qh * hd, qf + (qh + 1) * hd, hd, o);
            std::memcpy(scores + qh * ctx + tb + j, o, 4 * sizeof(float));
            std::memcpy(scores + (qh + 1) * ctx + tb + j, o + 4, 4 * sizeof(float));
          }
        }
      if (hd % 8 == 0)
        for (; j + 8 <= n; j += 8) {
          if (pf)
            for (int64_t t = j; t < j + 8; ++t) prefetch_row(pf + t * row, row * sizeof(T));
          for (int64_t qh = 0; qh < heads; ++qh)
            dot8_rows(base + j * row + (qh / group) * hd, row, qf + qh * hd, hd, scores + qh * ctx + tb + j);
        }
      for (; j < n; ++j)
        for (int64_t qh = 0; qh < heads; ++qh)
          scores[qh * ctx + tb + j] = dot_row(base + j * row + (qh / group) * hd, qf + qh * hd, hd);
      if constexpr (kQuantizedKV<T>) {
        const c10::BFloat16* sb = scales + blocks[b] * block_size * kvh;
        for (int64_t qh = 0; qh < heads; ++qh) {
          float* sc = scores + qh * ctx + tb;
          for (int64_t t = 0; t < n; ++t) sc[t] *= row_scale<T>(sb[t * kvh + qh / group]);
        }
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t ctx = qs[m].context_len;
    const int64_t nloc = std::max<int64_t>(0, std::min(b1 * block_size, ctx) - t0);
    float* mx = qs[m].stats + tid * 2 * heads;
    float* sm = mx + heads;
    // Keys before the window: weight 0 (they are a prefix of the context).
    const int64_t lo = window > 0 && ctx > window ? ctx - window : 0;
    const int64_t skip = std::min(nloc, std::max<int64_t>(0, lo - t0));
    for (int64_t qh = 0; qh < heads; ++qh) {
      float* sc = qs[m].scores + qh * ctx + t0;
      if (softcap > 0.f)
        for (int64_t t = skip; t < nloc; ++t) sc[t] = softcap * std::tanh(sc[t] / softcap);
      std::fill(sc, sc + skip, 0.f);
      float mv = -INFINITY;
      for (int64_t t = skip; t < nloc; ++t) mv = std::max(mv, sc[t]);
      mx[qh] = mv;
      sm[qh] = nloc > skip ? exp_sum(sc + skip, nloc - skip, mv) : 0.f;
    }
  }
  if (hd % 32 == 0) {
    // acc[qh] += sum_t p[qh][t] V[t], one cache block at a time (its V rows stay in L1
    // while every query, query head and 32-dim slice passes over them; passing over all
    // of a long context per slice re-read V from L3 once per slice): per KV head, 32
    // dims of one or two of its query heads in registers across the block's tokens.
    const bool two = group % 2 == 0;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t tb = b * block_size;
      const T* vb = vc + blocks[b] * block_size * row;
      if (b + 1 < b1) {
        const T* next = vc + blocks[b + 1] * block_size * row;
        for (int64_t t = 0; t < block_size; ++t) prefetch_row(next + t * row, row * sizeof(T));
      }
      for (int64_t m = 0; m < M; ++m) {
        const int64_t ctx = qs[m].context_len, n = std::min(block_size, ctx - tb);
        if (n <= 0) continue;
        float* acc = qs[m].partial + tid * heads * hd;
        for (int64_t qh = 0; qh < heads; qh += two ? 2 : 1) {
          const float* p0 = qs[m].scores + qh * ctx + tb;
          const float* p1 = two ? p0 + ctx : p0;
          float* o0 = acc + qh * hd;
          float* o1 = two ? o0 + hd : o0;
          for (int64_t d = 0; d < hd; d += 32) {
            __m256 a[2][4];
            for (int k = 0; k < 4; ++k) {
              a[0][k] = _mm256_loadu_ps(o0 + d + 8 * k);
              a[1][k] = two ? _mm256_loadu_ps(o1 + d + 8 * k) : _mm256_setzero_ps();
            }
            const T* vrow = vb + (qh / group) * hd + d;
            const c10::BFloat16* vs = vscales ? vscales + blocks[b] * block_size * kvh + qh / group : nullptr;
            for (int64_t j = 0; j < n; ++j, vrow += row) {
              float s = 1.f;
              if constexpr (kQuantizedKV<T>) s = row_scale<T>(vs[j * kvh]);
              const __m256 w0 = _mm256_set1_ps(p0[j] * s), w1 = _mm256_set1_ps(p1[j] * s);
              for (int k = 0; k < 4; ++k) {
                const __m256 v = load8(vrow + 8 * k);
                a[0][k] = _mm256_fmadd_ps(w0, v, a[0][k]);
                if (two) a[1][k] = _mm256_fmadd_ps(w1, v, a[1][k]);
              }
            }
            for (int k = 0; k < 4; ++k) {
              _mm256_storeu_ps(o0 + d + 8 * k, a[0][k]);
              if (two) _mm256_storeu_ps(o1 + d + 8 * k, a[1][k]);
            }
          }
        }
      }
    }
  } else {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t tb = b * block_size;
      const T* base = vc + blocks[b] * block_size * row;
      for (int64_t m = 0; m < M; ++m) {
        const int64_t ctx = qs[m].context_len, n = std::min(block_size, ctx - tb);
        float* acc = qs[m].partial + tid * heads * hd;
        for (int64_t j = 0; j < n; ++j)
          for (int64_t qh = 0; qh < heads; ++qh) {
            float p = qs[m].scores[qh * ctx + tb + j];
            if constexpr (kQuantizedKV<T>) p *= row_scale<T>(vscales[(blocks[b] * block_size + j) * kvh + qh / group]);
            axpy(acc + qh * hd, p, base + j * row + (qh / group) * hd, hd);
          }
      }
    }
  }
}

// attend_rows for one query.
template <typename T>
void attend_part(int tid, int nt, const float* qf, const T* kc, int64_t num_blocks, int64_t block_size,
                 int64_t kvh, int64_t hd, int64_t heads, const int64_t* blocks, int64_t context_len,
                 float* scores, float* stats, float* partial, int64_t window, float softcap,
                 const c10::BFloat16* scales) {
  const QueryPart q{qf, context_len, scores, stats, partial};
  attend_rows<T>(tid, nt, &q, 1, kc, num_blocks, block_size, kvh, hd, heads, blocks, window, softcap, scales);
}

// Head qh of the query's output: the nt threads' parts of attend_part merged, rescaled
// to their common max. w: scratch [nt].
inline void attend_merge_head(int64_t qh, int nt, int64_t heads, int64_t hd, const float* stats,
                              const float* partial, float* out, float* w) {
  float m = -INFINITY;
  for (int th = 0; th < nt; ++th) m = std::max(m, stats[th * 2 * heads + qh]);
  float denom = 0.f;
  for (int th = 0; th < nt; ++th) {
    const float* st = stats + th * 2 * heads;
    w[th] = st[heads + qh] > 0.f ? std::exp(st[qh] - m) : 0.f;  // a thread with no tokens adds 0
    denom += w[th] * st[heads + qh];
  }
  const float inv = 1.f / denom;
  for (int64_t d = 0; d < hd; ++d) {
    float sum = 0.f;
    for (int th = 0; th < nt; ++th) sum += w[th] * partial[(th * heads + qh) * hd + d];
    out[qh * hd + d] = sum * inv;
  }
}

template <typename T>
void attend_in_region(const TeamSync& sync, int tid, int nt, const float* qf, const T* kc,
                      int64_t num_blocks, int64_t block_size, int64_t kvh, int64_t hd, int64_t heads,
                      const int64_t* blocks, int64_t context_len, float* scores, float* stats,
                      float* partial, float* out, int64_t window = 0, float softcap = 0.f,
                      const c10::BFloat16* scales = nullptr) {
  attend_part<T>(tid, nt, qf, kc, num_blocks, block_size, kvh, hd, heads, blocks, context_len, scores, stats,
                 partial, window, softcap, scales);
  sync();
  std::vector<float> w(nt);
  for (int64_t qh = tid; qh < heads; qh += nt) attend_merge_head(qh, nt, heads, hd, stats, partial, out, w.data());
}

}  // namespace iterserve_cpu
