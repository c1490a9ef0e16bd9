// Projections of a few rows (small decode batches) on AVX-512: y = x W^T for x of 2 to 4
// rows, each weight row streamed from memory once for all of them. At these row counts
// a step is bound by reading the weights, which oneDNN does at 30-55 GB/s here where a
// plain stream reaches 50-99. One weight row at a time, 32 elements a step in two
// accumulators per input row, prefetching 2 KB ahead (a shorter distance left the
// stream starved once the loop body grew with the rows). The loader keeps it only
// where it times faster than the multi-row GEMM (model/linear.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// y[m * ys + o] = x[m] . w for m < MX.
template <typename T, int MX>
inline void row(const T* w, const float* x, int64_t in, float* y, int64_t ys, int64_t o) {
  __m512 a[MX][2];
  for (int m = 0; m < MX; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + 2048, _MM_HINT_T0);
    const __m512 w0 = load16(w + k), w1 = load16(w + k + 16);
    for (int m = 0; m < MX; ++m) {
      a[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * in + k), a[m][0]);
      a[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * in + k + 16), a[m][1]);
    }
  }
  for (; k < in; k += 16) {
    const __m512 w0 = load16(w + k);
    for (int m = 0; m < MX; ++m) a[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * in + k), a[m][0]);
  }
  for (int m = 0; m < MX; ++m) y[m * ys + o] = _mm512_reduce_add_ps(_mm512_add_ps(a[m][0], a[m][1]));
}

template <typename T>
inline void one_row(const T* w, const float* x, int64_t rows, int64_t in, float* y, int64_t out, int64_t o) {
  int64_t m = 0;
  for (; m + 8 <= rows; m += 8) row<T, 8>(w, x + m * in, in, y + m * out, out, o);
  const float* xm = x + m * in;
  float* ym = y + m * out;
  switch (rows - m) {
    case 7: row<T, 7>(w, xm, in, ym, out, o); break;
    case 6: row<T, 6>(w, xm, in, ym, out, o); break;
    case 5: row<T, 5>(w, xm, in, ym, out, o); break;
    case 4: row<T, 4>(w, xm, in, ym, out, o); break;
    case 3: row<T, 3>(w, xm, in, ym, out, o); break;
    case 2: row<T, 2>(w, xm, in, ym, out, o); break;
    case 1: row<T, 1>(w, xm, in, ym, out, o); break;
    default: break;
  }
}

template <typename T>
void skinny_rows(const T* w, const float* x, float* y, int64_t rows, int64_t out, int64_t in) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, (out + threads - 1) / threads);
  at::parallel_for(0, out, grain, [&](int64_t r0, int64_t r1) {
    const int64_t half = (r1 - r0 + 1) / 2;
    for (int64_t o = r0; o < r0 + half; ++o) {
      one_row(w + o * in, x, rows, in, y, out, o);
      if (o + half < r1) one_row(w + (o + half) * in, x, rows, in, y, out, o + half);
    }
  });
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "skinny_linear: x must be [rows, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "skinny_linear: weight must be a contiguous [out, in]");
  TORCH_CHECK(weight.size(1) == x.size(1), "skinny_linear: x and weight disagree on in_features");
  TORCH_CHECK(weight.size(1) % 16 == 0, "skinny_linear: in_features must be a multiple of 16");
  const int64_t rows = x.size(0), out = weight.size(0), in = weight.size(1);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, out}, x.options().dtype(at::kFloat));
  if (weight.scalar_type() == at::kFloat) {
    skinny_rows(weight.data_ptr<float>(), xf.data_ptr<float>(), y.data_ptr<float>(), rows, out, in);
  } else if (weight.scalar_type() == at::kBFloat16) {
    skinny_rows(weight.data_ptr<c10::BFloat16>(), xf.data_ptr<float>(), y.data_ptr<float>(), rows, out, in);
  } else {
    TORCH_CHECK(false, "skinny_linear: weight dtype must be float32 or bfloat16");
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(iterserve_cpu, m) { m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) { m.impl("skinny_linear", skinny_linear); }
