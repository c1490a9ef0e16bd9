// Projections over quantized weights that stay packed (model/quant/): y = x W^T where
// W is stored as integers with group scales, in one of two layouts:
//   bits 8: int8 [out, in]; bits 4: uint8 [out, in / 2], each 32 elements one 16-byte
//   chunk whose byte j holds element j (low nibble) and element j + 16 (high nibble).
//   scales [out, in / group] (float16 or float32); mins (same shape and dtype) optional.
//   w = s * q - m with mins; without: 8-bit w = s * q, 4-bit w = s * (q - 8).
//   Two-level scales (llama.cpp's K-quants): scales (and mins) uint8 or int8 under a
//   float32 base per 256 weights of a row, s = base * scale.
// Few rows (decode): each weight row streams from memory once for all the input rows and
// is widened to float32 in registers, q . x summed per group in float32 and scaled once
// per group; the offset term (m or 8 s) is a dot of the group offsets with the input's
// group sums, computed once per call. Many rows (prefill): tiles of a few hundred KB of
// weight rows dequantized to float32, each multiplied by at::mm, never the whole layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <vector>

namespace {

constexpr int kMaxRows = 4;

inline float sc(const float* s, int64_t i) { return s[i]; }
inline float sc(const c10::Half* s, int64_t i) { return static_cast<float>(s[i]); }
inline float sc(const uint8_t* s, int64_t i) { return static_cast<float>(s[i]); }
inline float sc(const int8_t* s, int64_t i) { return static_cast<float>(s[i]); }

// 16 weights (as float32) starting at element k of one row.
inline void load_q8(const int8_t* q, int64_t k, __m512& w) {
  w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
}
// The 32 weights of the 4-bit chunk starting at element k (k a multiple of 32).
inline void load_q4(const uint8_t* q, int64_t k, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

struct Args {
  const void* q;
  const void* s;
  const void* m;  // nullptr: no mins
  const float* sb;  // two-level: the bases of s and m [out, in / 256]; else nullptr
  const float* mb;
  int64_t out, in, group, bits;
};

// Group g's scale and offset (m, or 8 s for 4-bit without mins) of one row.
template <int BITS, typename S>
inline void group_scale(const Args& a, const S* s, const S* mn, const float* sb, const float* mb,
                        int64_t g, float& sg, float& cg) {
  sg = sc(s, g);
  const int64_t sup = g * a.group / 256;
  if (sb) sg *= sb[sup];
  if (mn) {
    cg = sc(mn, g);
    if (mb) cg *= mb[sup];
  } else {
    cg = BITS == 4 ? 8.f * sg : 0.f;
  }
}

// y[r * ys + o] = x[r] . w[o] for r < R; xsum: the inputs' per-group sums [R, in / group].
// OFF: whether the weights carry an offset (mins, or 4-bit's 8 s); without one (8-bit, no
// mins) the group sums are neither computed nor read.
template <int R, int BITS, typename S, bool OFF>
inline void row(const Args& a, int64_t o, const float* x, const float* xsum, float* y, int64_t ys) {
  const int64_t groups = a.in / a.group;
  const S* s = static_cast<const S*>(a.s) + o * groups;
  const S* mn = a.m ? static_cast<const S*>(a.m) + o * groups : nullptr;
  const int8_t* q8 = static_cast<const int8_t*>(a.q) + o * a.in;
  const uint8_t* q4 = static_cast<const uint8_t*>(a.q) + o * (a.in / 2);
  const float* sb = a.sb ? a.sb + o * (a.in / 256) : nullptr;
  const float* mb = a.mb ? a.mb + o * (a.in / 256) : nullptr;
  __m512 acc[R];
  float off[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm512_setzero_ps(); off[r] = 0.f; }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * a.group, k1 = k0 + a.group;
    __m512 t[R];
    for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_ps();
    if constexpr (BITS == 8) {
      _mm_prefetch(reinterpret_cast<const char*>(q8 + k0) + 1024, _MM_HINT_T0);
      for (int64_t k = k0; k < k1; k += 16) {
        __m512 w;
        load_q8(q8, k, w);
        for (int r = 0; r < R; ++r) t[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * a.in + k), t[r]);
      }
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(q4 + k0 / 2) + 1024, _MM_HINT_T0);
      for (int64_t k = k0; k < k1; k += 32) {
        __m512 lo, hi;
        load_q4(q4, k, lo, hi);
        for (int r = 0; r < R; ++r) {
          t[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * a.in + k), t[r]);
          t[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * a.in + k + 16), t[r]);
        }
      }
    }
    float sg, cg;
    group_scale<BITS, S>(a, s, mn, sb, mb, g, sg, cg);
    const __m512 sv = _mm512_set1_ps(sg);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(t[r], sv, acc[r]);
      if constexpr (OFF) off[r] += cg * xsum[r * groups + g];
    }
  }
  for (int r = 0; r < R; ++r) y[r * ys + o] = _mm512_reduce_add_ps(acc[r]) - off[r];
}

template <int BITS, typename S, bool OFF>
void few_rows(const Args& a, const float* x, const float* xsum, float* y, int64_t rows) {
  const int64_t groups = a.in / a.group;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, (a.out + threads - 1) / threads);
  at::parallel_for(0, a.out, grain, [&](int64_t o0, int64_t o1) {
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      const int64_t n = std::min<int64_t>(kMaxRows, rows - r0);
      const float* xr = x + r0 * a.in;
      const float* sr = OFF ? xsum + r0 * groups : nullptr;
      float* yr = y + r0 * a.out;
      for (int64_t o = o0; o < o1; ++o) {
        switch (n) {
          case 4: row<4, BITS, S, OFF>(a, o, xr, sr, yr, a.out); break;
          case 3: row<3, BITS, S, OFF>(a, o, xr, sr, yr, a.out); break;
          case 2: row<2, BITS, S, OFF>(a, o, xr, sr, yr, a.out); break;
          default: row<1, BITS, S, OFF>(a, o, xr, sr, yr, a.out); break;
        }
      }
    }
  });
}

// Rows o0..o1 of the weight as float32 into dst [o1 - o0, in].
template <int BITS, typename S>
void dequant_rows(const Args& a, int64_t o0, int64_t o1, float* dst) {
  const int64_t groups = a.in / a.group;
  at::parallel_for(o0, o1, 1, [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      const S* s = static_cast<const S*>(a.s) + o * groups;
      const S* mn = a.m ? static_cast<const S*>(a.m) + o * groups : nullptr;
      float* d = dst + (o - o0) * a.in;
      const float* sb = a.sb ? a.sb + o * (a.in / 256) : nullptr;
      const float* mb = a.mb ? a.mb + o * (a.in / 256) : nullptr;
      for (int64_t g = 0; g < groups; ++g) {
        float sg, cg;
        group_scale<BITS, S>(a, s, mn, sb, mb, g, sg, cg);
        const __m512 sv = _mm512_set1_ps(sg), cv = _mm512_set1_ps(cg);
        const int64_t k0 = g * a.group, k1 = k0 + a.group;
        if constexpr (BITS == 8) {
          const int8_t* q = static_cast<const int8_t*>(a.q) + o * a.in;
          for (int64_t k = k0; k < k1; k += 16) {
            __m512 w;
            load_q8(q, k, w);
            _mm512_storeu_ps(d + k, _mm512_fmsub_ps(w, sv, cv));
          }
        } else {
          const uint8_t* q = static_cast<const uint8_t*>(a.q) + o * (a.in / 2);
          for (int64_t k = k0; k < k1; k += 32) {
            __m512 lo, hi;
            load_q4(q, k, lo, hi);
            _mm512_storeu_ps(d + k, _mm512_fmsub_ps(lo, sv, cv));
            _mm512_storeu_ps(d + k + 16, _mm512_fmsub_ps(hi, sv, cv));
          }
        }
      }
    }
  });
}

const float* base(const c10::optional<at::Tensor>& b, int64_t out, int64_t in, const char* what) {
  if (!b.has_value() || !b->defined()) return nullptr;
  TORCH_CHECK(b->scalar_type() == at::kFloat && b->is_contiguous() && b->dim() == 2 &&
              b->size(0) == out && in % 256 == 0 && b->size(1) == in / 256,
              "quant: ", what, " must be a contiguous float32 [out, in / 256]");
  return b->data_ptr<float>();
}

Args check(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
           const c10::optional<at::Tensor>& scale_base, const c10::optional<at::Tensor>& min_base,
           int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant: bits must be 4 or 8");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "quant: qweight must be a contiguous 2-D tensor");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous(), "quant: scales must be a contiguous 2-D tensor");
  const auto st = scales.scalar_type();
  const bool two_level = scale_base.has_value() && scale_base->defined();
  TORCH_CHECK(two_level ? (st == at::kByte || st == at::kChar) : (st == at::kFloat || st == at::kHalf),
              "quant: scales must be float32 or float16 (uint8 or int8 under a scale_base)");
  const int64_t out = qweight.size(0);
  const int64_t in = bits == 8 ? qweight.size(1) : qweight.size(1) * 2;
  TORCH_CHECK(qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte), "quant: qweight dtype");
  TORCH_CHECK(group % (bits == 8 ? 16 : 32) == 0 && in % group == 0, "quant: bad group size");
  TORCH_CHECK(scales.size(0) == out && scales.size(1) == in / group, "quant: scales shape");
  const void* m = nullptr;
  if (mins.has_value() && mins->defined()) {
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == scales.scalar_type() &&
                mins->is_contiguous(), "quant: mins must match scales");
    m = mins->data_ptr();
  }
  const float* sb = base(scale_base, out, in, "scale_base");
  const float* mb = base(min_base, out, in, "min_base");
  TORCH_CHECK(!two_level || 256 % group == 0, "quant: two-level scales need a group dividing 256");
  TORCH_CHECK(!mb || (m && two_level), "quant: min_base needs mins and a scale_base");
  TORCH_CHECK(!two_level || !m || mb, "quant: two-level scales need a min_base for the mins");
  return Args{qweight.data_ptr(), scales.data_ptr(), m, sb, mb, out, in, group, bits};
}

template <int BITS, typename F>
void dispatch_scale(at::ScalarType st, F&& f) {
  const std::integral_constant<int, BITS> b{};
  switch (st) {
    case at::kHalf: f(b, c10::Half{}); break;
    case at::kByte: f(b, uint8_t{}); break;
    case at::kChar: f(b, int8_t{}); break;
    default: f(b, float{}); break;
  }
}

template <typename F>
void dispatch(const Args& a, at::ScalarType st, F&& f) {
  if (a.bits == 8) dispatch_scale<8>(st, f);
  else dispatch_scale<4>(st, f);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins,
                        const c10::optional<at::Tensor>& scale_base,
                        const c10::optional<at::Tensor>& min_base, int64_t bits, int64_t group,
                        int64_t max_few_rows) {
  const Args a = check(qweight, scales, mins, scale_base, min_base, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == a.in, "quant_linear: x must be [rows, in_features]");
  const int64_t rows = x.size(0);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, a.out}, x.options().dtype(at::kFloat));
  if (rows == 0) return y;
  const at::ScalarType st = scales.scalar_type();
  if (rows <= max_few_rows) {
    if (a.m == nullptr && a.bits == 8) {  // no offset term: no group sums
      dispatch(a, st, [&](auto b, auto s) {
        few_rows<decltype(b)::value, decltype(s), false>(a, xf.data_ptr<float>(), nullptr,
                                                         y.data_ptr<float>(), rows);
      });
      return y;
    }
    at::Tensor xsum = xf.view({rows, a.in / group, group}).sum(-1).contiguous();
    dispatch(a, st, [&](auto b, auto s) {
      few_rows<decltype(b)::value, decltype(s), true>(a, xf.data_ptr<float>(), xsum.data_ptr<float>(),
                                                      y.data_ptr<float>(), rows);
    });
    return y;
  }
  // About 512 KB of float32 weight per tile: dequantized, used and overwritten in cache.
  const int64_t tile = std::max<int64_t>(16, (int64_t(1) << 17) / a.in / 16 * 16);
  at::Tensor w = at::empty({std::min(tile, a.out), a.in}, xf.options());
  for (int64_t o0 = 0; o0 < a.out; o0 += tile) {
    const int64_t o1 = std::min(a.out, o0 + tile);
    at::Tensor wt = w.narrow(0, 0, o1 - o0);
    dispatch(a, st, [&](auto b, auto s) {
      dequant_rows<decltype(b)::value, decltype(s)>(a, o0, o1, wt.data_ptr<float>());
    });
    y.narrow(1, o0, o1 - o0).copy_(at::mm(xf, wt.t()));
  }
  return y;
}

at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins,
                            const c10::optional<at::Tensor>& scale_base,
                            const c10::optional<at::Tensor>& min_base, int64_t bits, int64_t group) {
  const Args a = check(qweight, scales, mins, scale_base, min_base, bits, group);
  at::Tensor w = at::empty({a.out, a.in}, scales.options().dtype(at::kFloat));
  dispatch(a, scales.scalar_type(), [&](auto b, auto s) {
    dequant_rows<decltype(b)::value, decltype(s)>(a, 0, a.out, w.data_ptr<float>());
  });
  return w;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(iterserve_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? scale_base, "
        "Tensor? min_base, int bits, int group, int max_few_rows) -> Tensor");
  m.def("quant_dequantize(Tensor qweight, Tensor scales, Tensor? mins, Tensor? scale_base, "
        "Tensor? min_base, int bits, int group) -> Tensor");
}
TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) {
  m.impl("quant_linear", quant_linear);
  m.impl("quant_dequantize", quant_dequantize);
}
