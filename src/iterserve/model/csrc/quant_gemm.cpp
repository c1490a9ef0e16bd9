// Projections over quantized weights that stay packed (model/quant/): y = x W^T with
// W stored as integers with group scales (layouts and per-row kernels: quant_kernels.h).
// Few rows (decode): each weight row streams from memory once for all the input rows,
// on the float-activation kernel or (kernel 1) the int8-activation VNNI one. Many rows
// (prefill): tiles of a few hundred KB of weight rows dequantized to float32, each
// multiplied by at::mm, never the whole layer; or (kernel 2) the int8-activation GEMM
// of quant_tile.h: register tiles of input rows x output rows over L2-sized blocks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <vector>

#include "quant_kernels.h"
#include "quant_lanes.h"
#include "quant_tile.h"

namespace {

using namespace iterserve_quant;

// Rows split into one contiguous run per thread, each streaming its own part of W.
template <typename F>
void over_rows(int64_t out, F&& f) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, (out + threads - 1) / threads);
  at::parallel_for(0, out, grain, f);
}

void few_rows_float(const Args& a, const float* x, float* y, int64_t rows) {
  std::vector<float> xsum;
  if (a.m != nullptr || a.bits == 4) {
    xsum.resize(rows * (a.in / a.group));
    group_sums(x, rows, a.in, a.group, xsum.data());
  }
  over_rows(a.out, [&](int64_t o0, int64_t o1) { rows_float(a, x, xsum.data(), y, a.out, rows, o0, o1, false); });
}

void few_rows_vnni(const Args& a, const float* x, float* y, int64_t rows) {
  const int64_t in = a.in, groups = in / a.group;
  std::vector<int8_t> xq(rows * in);
  std::vector<int32_t> corr(rows * in / 4);
  std::vector<float> xsu(rows * in / 4), xsum(rows * groups);
  const QInput p{xq.data(), corr.data(), xsu.data(), xsum.data()};
  prep_vnni(x, rows, in, a.bits, a.group, a.m != nullptr, p);
  over_rows(a.out, [&](int64_t o0, int64_t o1) {
    std::vector<float> wd(2 * kMaxRows * (in / 16) + 16);
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      const int64_t n = std::min<int64_t>(kMaxRows, rows - r0);
      const QInput pr{p.xq + r0 * in, p.corr + r0 * (in / 4), p.xsu + r0 * (in / vnni_unit(a.group)),
                      p.xsum + r0 * groups};
      rows_vnni(a, pr, y + r0 * a.out, a.out, n, o0, o1, false, wd.data());
    }
  });
}

// Many rows on int8 activations: the input quantized once (in parallel over rows),
// then each thread's output rows by blocks: 16 output rows to a register where the
// layout allows (quant_lanes.h), else register tiles (quant_tile.h).
void many_rows_vnni(const Args& a, const float* x, float* y, int64_t rows) {
  if (lanes_ok(a)) {
    gemm_lanes(a, x, rows, y);
    return;
  }
  const int64_t in = a.in, groups = in / a.group, units = in / vnni_unit(a.group);
  std::vector<int8_t> xq(rows * in);
  std::vector<int32_t> corr(rows * in / 4);
  std::vector<float> xsu(rows * in / 4), xsum(rows * groups);
  const QInput p{xq.data(), corr.data(), xsu.data(), xsum.data()};
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    const QInput pr{p.xq + r0 * in, p.corr + r0 * (in / 4), p.xsu + r0 * units, p.xsum + r0 * groups};
    prep_vnni(x + r0 * in, r1 - r0, in, a.bits, a.group, a.m != nullptr, pr);
  });
  over_rows(a.out, [&](int64_t o0, int64_t o1) { gemm_vnni_range(a, p, rows, y, o0, o1); });
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
      const Base sb = a.sb.from(o * (a.in / 256)), mb = a.mb.from(o * (a.in / 256));
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
        } else if constexpr (BITS == 6) {
          const uint8_t* q = static_cast<const uint8_t*>(a.q) + o * row_bytes(6, a.in);
          for (int64_t k = k0; k < k1; k += 16) {
            __m512 w;
            load_q6(q, k, w);
            _mm512_storeu_ps(d + k, _mm512_mul_ps(w, sv));
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

Base base(const c10::optional<at::Tensor>& b, int64_t out, int64_t in, const char* what) {
  if (!b.has_value() || !b->defined()) return Base{};
  const auto t = b->scalar_type();
  TORCH_CHECK((t == at::kFloat || t == at::kHalf) && b->is_contiguous() && b->dim() == 2 &&
              b->size(0) == out && in % 256 == 0 && b->size(1) == in / 256,
              "quant: ", what, " must be a contiguous float32 or float16 [out, in / 256]");
  return Base{b->data_ptr(), t == at::kHalf};
}

Args check(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
           const c10::optional<at::Tensor>& scale_base, const c10::optional<at::Tensor>& min_base,
           int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "quant: bits must be 4, 6 or 8");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "quant: qweight must be a contiguous 2-D tensor");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous(), "quant: scales must be a contiguous 2-D tensor");
  const auto st = scales.scalar_type();
  const bool two_level = scale_base.has_value() && scale_base->defined();
  TORCH_CHECK(two_level ? (st == at::kByte || st == at::kChar) : (st == at::kFloat || st == at::kHalf),
              "quant: scales must be float32 or float16 (uint8 or int8 under a scale_base)");
  const int64_t out = qweight.size(0);
  const int64_t in = row_in(bits, qweight.size(1));
  TORCH_CHECK(qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte), "quant: qweight dtype");
  TORCH_CHECK(in > 0, "quant: a 6-bit qweight has rows of whole 48-byte chunks");
  TORCH_CHECK(layout_ok(bits, in, group, mins.has_value() && mins->defined()),
              "quant: bad group size (or mins with 6 bits)");
  TORCH_CHECK(scales.size(0) == out && scales.size(1) == in / group, "quant: scales shape");
  const void* m = nullptr;
  if (mins.has_value() && mins->defined()) {
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == scales.scalar_type() &&
                mins->is_contiguous(), "quant: mins must match scales");
    m = mins->data_ptr();
  }
  const Base sb = base(scale_base, out, in, "scale_base");
  const Base mb = base(min_base, out, in, "min_base");
  TORCH_CHECK(!mb || mb.half == sb.half, "quant: min_base must have scale_base's dtype");
  TORCH_CHECK(!two_level || 256 % group == 0, "quant: two-level scales need a group dividing 256");
  TORCH_CHECK(!mb || (m && two_level), "quant: min_base needs mins and a scale_base");
  TORCH_CHECK(!two_level || !m || mb, "quant: two-level scales need a min_base for the mins");
  const int kind = st == at::kHalf ? kF16 : st == at::kByte ? kU8 : st == at::kChar ? kI8 : kF32;
  return Args{qweight.data_ptr(), scales.data_ptr(), m, sb, mb, out, in, group, bits, kind};
}

template <typename F>
void dispatch(const Args& a, at::ScalarType, F&& f) {
  dispatch_scale(a.st, [&](auto s) {
    if (a.bits == 8) f(std::integral_constant<int, 8>{}, s);
    else if (a.bits == 6) f(std::integral_constant<int, 6>{}, s);
    else f(std::integral_constant<int, 4>{}, s);
  });
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins,
                        const c10::optional<at::Tensor>& scale_base,
                        const c10::optional<at::Tensor>& min_base, int64_t bits, int64_t group,
                        int64_t max_few_rows, int64_t kernel) {
  const Args a = check(qweight, scales, mins, scale_base, min_base, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == a.in, "quant_linear: x must be [rows, in_features]");
  const int64_t rows = x.size(0);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, a.out}, x.options().dtype(at::kFloat));
  if (rows == 0) return y;
  const at::ScalarType st = scales.scalar_type();
  TORCH_CHECK(kernel >= 0 && kernel <= 2, "quant_linear: kernel must be 0 (float), 1 (int8 few rows) "
              "or 2 (int8 GEMM)");
  TORCH_CHECK(kernel == 0 || (kernel == 1 && rows > max_few_rows) || vnni_layout_ok(a.bits, a.in, a.group),
              "quant_linear: the int8-activation kernels need in_features a multiple of 64 and a "
              "group of 16 (8-bit, 6-bit), 32 or a multiple of 64");
  if (kernel == 2) {  // whatever the row count
    many_rows_vnni(a, xf.data_ptr<float>(), y.data_ptr<float>(), rows);
    return y;
  }
  if (rows <= max_few_rows) {
    if (kernel == 1) {
      few_rows_vnni(a, xf.data_ptr<float>(), y.data_ptr<float>(), rows);
    } else {
      few_rows_float(a, xf.data_ptr<float>(), y.data_ptr<float>(), rows);
    }
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
        "Tensor? min_base, int bits, int group, int max_few_rows, int kernel=0) -> Tensor");
  // kernel: 0 float activations (few rows; past max_few_rows dequantized tiles and at::mm),
  // 1 int8 activations (few rows; past max_few_rows as 0), 2 the int8 GEMM at any row count.
  m.def("quant_dequantize(Tensor qweight, Tensor scales, Tensor? mins, Tensor? scale_base, "
        "Tensor? min_base, int bits, int group) -> Tensor");
}
TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) {
  m.impl("quant_linear", quant_linear);
  m.impl("quant_dequantize", quant_dequantize);
}
