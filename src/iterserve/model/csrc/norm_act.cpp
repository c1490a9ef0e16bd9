// RMSNorm (optionally after a residual add), SiLU-and-mul and RoPE, each one pass over
// memory instead of torch's chain of small ops (upcast, pow, mean, rsqrt, mul, downcast,
// mul: ~7 passes and as many allocations, which cost a bf16 decode step of a 0.6B model
// ~10%, and a float32 step of a saturated 56M one ~8%).
//
// The arithmetic follows transformers' op order: float32 math on the widened input, a
// rounding to the model dtype where transformers rounds (RMSNorm: the normalized row,
// then the weight product; SiLU-and-mul: silu(gate), then the product; RoPE: x * cos,
// then the sum). Only the sum of squares is accumulated in another order than torch's
// reduction (and exp, 1 / sqrt and the products' fusing differ in the last bit), so an
// output can differ from torch's by a unit or two in the last place, rarely.

#include "kernels.h"

namespace {

using namespace iterserve_cpu;

inline __m256 load8h(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8h(const c10::BFloat16* p) { return load8(p); }

// 8 floats rounded to bfloat16, nearest even (c10's rule, NaN kept quiet): the bf16
// bits in the low half of each 32-bit lane.
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

inline void store8h(c10::BFloat16* p, __m256 v) {
  const __m256i r = bf16_bits(v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store8h(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline __m256 load8h(const float* p) { return _mm256_loadu_ps(p); }
inline void store8h(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// The value as the model dtype would hold it (one rounding), back in float.
template <typename T>
inline __m256 round8(__m256 v);
template <>
inline __m256 round8<c10::BFloat16>(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}
template <>
inline __m256 round8<c10::Half>(__m256 v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
template <>
inline __m256 round8<float>(__m256 v) {
  return v;
}
template <typename T>
inline float round1(float v) { return static_cast<float>(static_cast<T>(v)); }

// One row of n: out = norm(x) (Llama: w * dtype(x * r); Gemma: dtype(x * r * (1 + w))),
// r = 1 / sqrt(mean(x^2) + eps). With `res`: first res = dtype(res + x), then the norm
// of res (x is only read).
template <typename T>
void norm_row(const T* x, T* res, const T* w, float eps, bool gemma, int64_t n, T* out, float* buf) {
  const T* src = x;
  if (res != nullptr) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8h(res + i, _mm256_add_ps(load8h(res + i), load8h(x + i)));
    for (; i < n; ++i) res[i] = static_cast<T>(static_cast<float>(res[i]) + static_cast<float>(x[i]));
    src = res;
  }
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = load8h(src + i), v1 = load8h(src + i + 8);
    _mm256_storeu_ps(buf + i, v0);
    _mm256_storeu_ps(buf + i + 8, v1);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  float ss = hsum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) {
    buf[i] = static_cast<float>(src[i]);
    ss += buf[i] * buf[i];
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m256 rv = _mm256_set1_ps(r), one = _mm256_set1_ps(1.f);
  i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 h = _mm256_mul_ps(_mm256_loadu_ps(buf + i), rv);
    const __m256 wv = load8h(w + i);
    store8h(out + i, gemma ? _mm256_mul_ps(h, _mm256_add_ps(one, wv)) : _mm256_mul_ps(wv, round8<T>(h)));
  }
  for (; i < n; ++i) {
    const float h = buf[i] * r, wf = static_cast<float>(w[i]);
    out[i] = static_cast<T>(gemma ? h * (1.f + wf) : wf * round1<T>(h));
  }
}

// x: [rows, n] or [rows, heads, n] with the last dim contiguous (a view of the fused qkv
// output is fine); out: contiguous, x's shape.
template <typename T>
void norm_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& w, double eps, bool gemma,
               at::Tensor& out) {
  const int64_t n = x.size(-1);
  const int64_t a = x.size(0), b = x.dim() == 3 ? x.size(1) : 1;
  const int64_t sa = x.stride(0), sb = x.dim() == 3 ? x.stride(1) : 0;
  const T* xp = x.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const int64_t rs = residual ? residual->stride(0) : 0;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t rows = a * b;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r / b, j = r % b;
      norm_row<T>(xp + i * sa + j * sb, rp ? rp + i * rs : nullptr, wp, static_cast<float>(eps), gemma, n,
                  op + r * n, buf.data());
    }
  });
}

bool supported_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(supported_dtype(x), op, ": x must be float32, bfloat16 or float16");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, op,
              ": x must be [rows, n] or [rows, heads, n] with the last dim contiguous");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type(),
              op, ": weight must be a contiguous [n] of x's dtype");
}

template <typename F>
void by_dtype(const at::Tensor& x, F&& fn) {
  if (x.scalar_type() == at::kFloat) {
    fn(float{});
  } else if (x.scalar_type() == at::kBFloat16) {
    fn(c10::BFloat16{});
  } else {
    fn(c10::Half{});
  }
}

// RMSNorm of x's rows (see norm_row); gemma: the (1 + w) form.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  check_norm_args(x, weight, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  by_dtype(x, [&](auto z) { norm_rows<decltype(z)>(x, nullptr, weight, eps, gemma, out); });
  return out;
}

// residual = dtype(residual + x) in place, then returns RMSNorm(residual).
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                        bool gemma) {
  check_norm_args(x, weight, "add_rms_norm");
  TORCH_CHECK(x.dim() == 2 && residual.dim() == 2 && residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be x's [rows, n] shape and dtype, rows contiguous");
  at::Tensor out = at::empty(x.sizes(), x.options());
  by_dtype(x, [&](auto z) { norm_rows<decltype(z)>(x, &residual, weight, eps, gemma, out); });
  return out;
}

// gate_up: [rows, 2 * n] (gate, then up), rows contiguous; returns [rows, n] =
// dtype(dtype(silu(gate)) * up), as F.silu(gate) * up computes it in the model dtype.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(supported_dtype(gate_up), "silu_and_mul: gate_up must be float32, bfloat16 or float16");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be [rows, 2 * n] with rows contiguous");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, s = gate_up.stride(0);
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  by_dtype(gate_up, [&](auto z) {
    using T = decltype(z);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t chunk = 512;  // elements per task: rows are split so a few rows still use every thread
    const int64_t per_row = (n + chunk - 1) / chunk;
    at::parallel_for(0, rows * per_row, std::max<int64_t>(1, 32768 / chunk / 4), [&](int64_t t0, int64_t t1) {
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      const __m256 inf = _mm256_set1_ps(INFINITY), big = _mm256_set1_ps(88.3762626647949f);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = t / per_row, c0 = (t % per_row) * chunk, c1 = std::min(n, c0 + chunk);
        const T* g = gp + r * s;
        const T* u = g + n;
        T* o = op + r * n;
        int64_t i = c0;
        for (; i + 8 <= c1; i += 8) {
          const __m256 gv = load8h(g + i);
          const __m256 ng = _mm256_sub_ps(zero, gv);
          // exp8 saturates where exp(-g) overflows; torch's gives inf there, so silu is -0.
          const __m256 den = _mm256_blendv_ps(_mm256_add_ps(one, exp8(ng)), inf,
                                              _mm256_cmp_ps(ng, big, _CMP_GT_OQ));
          const __m256 act = _mm256_div_ps(gv, den);
          store8h(o + i, _mm256_mul_ps(round8<T>(act), load8h(u + i)));
        }
        for (; i < c1; ++i) {
          const float gf = static_cast<float>(g[i]);
          o[i] = static_cast<T>(round1<T>(gf / (1.f + std::exp(-gf))) * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}

// RoPE in place on x [rows, heads, d] (the last dim contiguous; a view of the fused qkv
// output is fine), as rotary.apply_rope computes it: x * cos + roll(x, rd / 2) * sin over
// the first rd dims, cos and sin [rows, 1, rd] or [rows, rd] in x's dtype with
// rotate_half's sign folded into sin; x * cos is rounded to the dtype, then added to
// roll(x) * sin in one fused multiply-add, as torch's addcmul does (so float32 equals
// apply_rope bit for bit).
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(supported_dtype(x), "rope_: x must be float32, bfloat16 or float16");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope_: x must be [rows, heads, d] with the last dim contiguous");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope_: cos and sin must be contiguous, of one shape, in x's dtype");
  const int64_t rd = cos.size(-1);
  TORCH_CHECK(cos.numel() == x.size(0) * rd && rd % 2 == 0 && rd <= x.size(2),
              "rope_: cos must be [rows, 1, rd] or [rows, rd] with rd even and at most x's last dim");
  const int64_t heads = x.size(1), half = rd / 2, s0 = x.stride(0), s1 = x.stride(1);
  by_dtype(x, [&](auto z) {
    using T = decltype(z);
    T* xp = x.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    at::parallel_for(0, x.size(0) * heads, std::max<int64_t>(1, 8192 / rd), [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t r = u / heads;
        T* p = xp + r * s0 + (u % heads) * s1;
        const T* c = cp + r * rd;
        const T* sn = sp + r * rd;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          const __m256 x0 = load8h(p + i), x1 = load8h(p + half + i);
          const __m256 a0 = round8<T>(_mm256_mul_ps(x0, load8h(c + i)));
          const __m256 a1 = round8<T>(_mm256_mul_ps(x1, load8h(c + half + i)));
          store8h(p + i, _mm256_fmadd_ps(x1, load8h(sn + i), a0));
          store8h(p + half + i, _mm256_fmadd_ps(x0, load8h(sn + half + i), a1));
        }
        for (; i < half; ++i) {
          const float x0 = static_cast<float>(p[i]), x1 = static_cast<float>(p[half + i]);
          const float a0 = round1<T>(x0 * static_cast<float>(c[i]));
          const float a1 = round1<T>(x1 * static_cast<float>(c[half + i]));
          p[i] = static_cast<T>(std::fma(x1, static_cast<float>(sn[i]), a0));
          p[half + i] = static_cast<T>(std::fma(x0, static_cast<float>(sn[half + i]), a1));
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(iterserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool gemma=False) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, bool gemma=False) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("rope_", rope_);
}
