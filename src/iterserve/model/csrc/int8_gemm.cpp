// Many rows on a per-row int8 weight with inputs quantized per token (compressed-tensors
// W8A8, --quantization int8): y = (round(x / sx) Wq^T) * sx * sw (+ b), in x's dtype.
//
// The input rows are quantized in one pass, the product is one int8 GEMM (at::_int_mm:
// oneDNN's VNNI kernels), then scales, bias and the cast back run in one pass over the
// int32 product. As a chain of torch ops (widen, amax, divide, round, clamp, narrow,
// then widen, two multiplies, add, narrow) the elementwise passes over M x N cost about
// as much as the GEMM itself. The arithmetic and its order are the torch chain's
// (packed.py ``linear_int_mm``), so both give the same numbers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

// 16 elements (n < 16: the first n, the rest zero) as float32.
template <typename T>
inline __m512 load16(const T* p, int n) {
  const __mmask16 m = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
}

// The first n of 16 float32 values stored as T, rounded to nearest even (torch's casts).
template <typename T>
inline void store16(T* p, __m512 v, int n) {
  const __mmask16 m = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(p, m, v);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
  } else {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// Row r of x [M, K] to int8 (symmetric, max |x| -> 127) and its scale.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* sx) {
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * K;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, load16(row + k, int(std::min<int64_t>(16, K - k)))));
      }
      const float s = std::max(_mm512_reduce_max_ps(mx), 1e-12f) / 127.0f;
      sx[r] = s;
      const __m512 vs = _mm512_set1_ps(s);
      const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
      int8_t* out = xq + r * K;
      for (int64_t k = 0; k < K; k += 16) {
        const int n = int(std::min<int64_t>(16, K - k));
        // Division, not a reciprocal's product: the torch chain's rounding exactly.
        __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(load16(row + k, n), vs));
        q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
        _mm512_mask_cvtepi32_storeu_epi8(out + k, n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1), q);
      }
    }
  });
}

// y = acc * sx[row] * sw[col] (+ bias[col]), as T.
template <typename T>
void epilogue(const int32_t* acc, const float* sx, const float* sw, const float* bias, int64_t M,
              int64_t N, T* y) {
  at::parallel_for(0, M, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const __m512 s = _mm512_set1_ps(sx[r]);
      const int32_t* a = acc + r * N;
      for (int64_t c = 0; c < N; c += 16) {
        const int n = int(std::min<int64_t>(16, N - c));
        const __mmask16 m = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, a + c)), s);
        v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, sw + c));
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + c));
        store16(y + r * N + c, v, n);
      }
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x must be [rows, in_features]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "int8_linear: qweight must be a contiguous int8 [out_features, in_features]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K, "int8_linear: x and qweight disagree on in_features");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "int8_linear: x must be float32, bfloat16 or float16");
  const at::Tensor sw = scales.to(at::kFloat).contiguous().view({-1});
  TORCH_CHECK(sw.numel() == N, "int8_linear: one scale per output row expected");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "int8_linear: bias must have out_features elements");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::Tensor xc = x.contiguous();
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({M}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "int8_linear", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "int8_linear: double inputs are not supported");
    } else {
      quantize_rows(xc.data_ptr<scalar_t>(), M, K, xq.data_ptr<int8_t>(), sx.data_ptr<float>());
      const at::Tensor acc = at::_int_mm(xq, qweight.t());
      epilogue(acc.data_ptr<int32_t>(), sx.data_ptr<float>(), sw.data_ptr<float>(),
               b.defined() ? b.data_ptr<float>() : nullptr, M, N, y.data_ptr<scalar_t>());
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(iterserve_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) { m.impl("int8_linear", int8_linear); }
