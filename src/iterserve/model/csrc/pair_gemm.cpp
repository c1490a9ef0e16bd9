// A bfloat16 projection over a pair-packed weight (pair_tile.h): y = x W^T (+ b), each
// output accumulated in float32 and rounded once, as torch's bfloat16 linear does.
//
// For the row counts between the few-row kernels and a prefill chunk (a decode batch of
// 5 to a few dozen rows) on CPUs without AMX. There oneDNN's bfloat16 GEMM runs at half
// the FMA rate, and MKL's float32 GEMM on a widened copy streams twice the bytes and
// leaves its stream and its FMAs unoverlapped. Here the weight streams once as bfloat16
// and each 64-byte load feeds up to 2 x 12 FMAs. The loader keeps it for the row counts
// where it times fastest (model/linear.py).
//
// Threads take contiguous ranges of 32-column pairs of blocks; each runs every row tile
// against a pair while its weights (K x 64 bytes) sit in L2.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")

#include "pair_tile.h"

namespace {

using namespace iterserve_pair;

template <bool BF16>
void pair_gemm(const uint16_t* x, const uint16_t* w, const float* bias, int64_t M, int64_t K,
               int64_t N, uint16_t* y) {
  // The FMA tiles read float rows: x widened once (exact).
  using X = std::conditional_t<BF16, uint16_t, float>;
  std::vector<float> xf(BF16 ? 0 : M * K);
  const X* xin;
  if constexpr (BF16) {
    xin = x;
  } else {
    for (int64_t i = 0; i < M * K; ++i) xf[i] = c10::detail::f32_from_bits(x[i]);
    xin = xf.data();
  }
  const int64_t pairs = N / 32;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* w0 = w + 2 * p * K * 16;
      const uint16_t* w1 = w0 + K * 16;
      const __m512 b0 = bias ? _mm512_loadu_ps(bias + 32 * p) : _mm512_setzero_ps();
      const __m512 b1 = bias ? _mm512_loadu_ps(bias + 32 * p + 16) : _mm512_setzero_ps();
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const int n = static_cast<int>(std::min<int64_t>(kRows, M - r0));
        const X* xr[kRows];
        for (int r = 0; r < n; ++r) xr[r] = xin + (r0 + r) * K;
        __m512 acc[kRows][2];
        tile_n<BF16>(n, xr, w0, w1, K, acc);
        for (int r = 0; r < n; ++r) {
          uint16_t* out = y + (r0 + r) * N + 32 * p;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16(_mm512_add_ps(acc[r][0], b0)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16),
                              to_bf16(_mm512_add_ps(acc[r][1], b1)));
        }
      }
    }
  });
}

// x [M, K] bf16; weight [N / 16, K / 2, 16, 2] bf16 (layers/moe.py pack_experts' layout,
// one matrix), N a multiple of 32; bias [N] or none. dot: vdpbf16ps (needs AVX512_BF16)
// instead of the widened pairs' FMAs.
at::Tensor pair_linear(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, bool dot) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "pair_linear: x must be bf16 [M, K]");
  TORCH_CHECK(weight.dim() == 4 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
              weight.size(2) == 16 && weight.size(3) == 2,
              "pair_linear: weight must be pair-packed bf16 [N / 16, K / 2, 16, 2]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0) * 16;
  TORCH_CHECK(weight.size(1) * 2 == K, "pair_linear: weight's inputs (", weight.size(1) * 2,
              ") disagree with x's (", K, ")");
  TORCH_CHECK(N % 32 == 0, "pair_linear: outputs must be a multiple of 32, got ", N);
  static const bool has_bf16 = __builtin_cpu_supports("avx512bf16");
  TORCH_CHECK(!dot || has_bf16, "pair_linear: dot (vdpbf16ps) needs a CPU with AVX512_BF16");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "pair_linear: bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (dot)
    pair_gemm<true>(xp, wp, bp, M, K, N, o);
  else
    pair_gemm<false>(xp, wp, bp, M, K, N, o);
  return out;
}

}  // namespace

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(iterserve_cpu, m) {
  m.def("pair_linear(Tensor x, Tensor weight, Tensor? bias, bool dot=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) { m.impl("pair_linear", pair_linear); }
