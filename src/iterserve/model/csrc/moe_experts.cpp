// The routed experts of a bfloat16 mixture-of-experts block in one call: the step's
// (token, expert) assignments sorted by expert (a counting sort), then per active expert
// gate+up with SiLU-and-multiply fused into its tiles, down, and the weighted sum per
// token. It replaces a Python loop of two oneDNN GEMMs per expert, which reorders each
// weight per call and builds a primitive per new row count (layers/moe.py).
//
// Weights are packed at load (layers/moe.py ``pack_experts``) in pair_tile.h's layout,
// [E, N / 16, K / 2, 16, 2], and run on its tiles: vdpbf16ps, or the pairs widened to
// float and two FMAs (every AVX-512 CPU; ``dot_max_tokens`` picks by step size).
//
// A tile is up to 12 rows x 32 columns (24 accumulators): gate and up take 16 columns
// each, so SiLU(gate) * up is computed in registers; down takes 32 of H. Tiles of one
// column block reuse its weights from cache, so weights stream from memory once per
// step however many rows an expert has.
//
// Rounding follows transformers' bfloat16 path: gate and up outputs, SiLU, the product,
// the down output and (for bfloat16 routing weights) each weighted output are rounded
// to bfloat16; each token's sum over its experts is accumulated in float32 and rounded
// once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "avx512_math.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")

#include "pair_tile.h"

namespace {

using iterserve_avx512::exp16;
using namespace iterserve_pair;

// The step's layout: assignments sorted by expert.
struct Plan {
  int64_t T = 0, k = 0, E = 0;
  std::vector<int64_t> start;  // [E + 1]: expert e's rows are start[e] .. start[e + 1]
  std::vector<int64_t> token;  // [T * k]: sorted row -> its token
  std::vector<int64_t> slot;   // [T * k]: assignment (t * k + j) -> its sorted row
};

Plan plan(const int64_t* ids, int64_t T, int64_t k, int64_t E) {
  Plan p;
  p.T = T, p.k = k, p.E = E;
  p.start.assign(E + 1, 0);
  for (int64_t a = 0; a < T * k; ++a) {
    TORCH_CHECK(ids[a] >= 0 && ids[a] < E, "moe_experts: expert id ", ids[a], " out of range");
    ++p.start[ids[a] + 1];
  }
  for (int64_t e = 0; e < E; ++e) p.start[e + 1] += p.start[e];
  std::vector<int64_t> fill(p.start.begin(), p.start.end() - 1);
  p.token.resize(T * k);
  p.slot.resize(T * k);
  for (int64_t a = 0; a < T * k; ++a) {  // stable: tokens stay in order within an expert
    const int64_t s = fill[ids[a]]++;
    p.token[s] = a / k;
    p.slot[a] = s;
  }
  return p;
}

// A unit of work: one expert's rows against one column block.
struct Unit {
  int64_t e, block, cost;
};

// Units split into one contiguous range per thread, balanced by cost (each unit costs
// its rows, plus a few rows' worth for streaming its weights).
template <typename F>
void run_units(const std::vector<Unit>& units, F&& f) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units.size()));
  int64_t total = 0;
  for (const Unit& u : units) total += u.cost;
  std::vector<size_t> bounds(threads + 1, units.size());
  bounds[0] = 0;
  int64_t acc = 0, t = 1;
  for (size_t i = 0; i < units.size() && t < threads; ++i) {
    acc += units[i].cost;
    while (t < threads && acc * threads >= total * t) bounds[t++] = i + 1;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (size_t i = bounds[t]; i < bounds[t + 1]; ++i) f(units[i]);
  });
}

std::vector<Unit> units_for(const Plan& p, int64_t blocks) {
  std::vector<Unit> units;
  for (int64_t e = 0; e < p.E; ++e) {
    const int64_t n = p.start[e + 1] - p.start[e];
    if (n)
      for (int64_t b = 0; b < blocks; ++b) units.push_back({e, b, n + 4});
  }
  return units;
}

template <bool BF16>
void experts(const uint16_t* x, const uint16_t* w13, const uint16_t* w2, const float* weights,
             bool round_weighted, const Plan& p, int64_t H, int64_t I, uint16_t* out) {
  const int64_t A = p.T * p.k;
  // Every element is written before it is read: no zero-fill.
  std::unique_ptr<uint16_t[]> act_buf(new uint16_t[A * I]), ys_buf(new uint16_t[A * H]);
  uint16_t* const act = act_buf.get();
  uint16_t* const ys = ys_buf.get();
  // The FMA tiles read float inputs: x, then act, widened once here (exact).
  using X = std::conditional_t<BF16, uint16_t, float>;
  std::vector<float> xf(BF16 ? 0 : p.T * H), actf(BF16 ? 0 : A * I);
  auto rows_of = [](const uint16_t* src, std::vector<float>& f) -> const X* {
    if constexpr (BF16) {
      return src;
    } else {
      for (size_t i = 0; i < f.size(); ++i) f[i] = c10::detail::f32_from_bits(src[i]);
      return f.data();
    }
  };
  const X* xin = rows_of(x, xf);
  // gate+up: block b is gate columns 16b.. and up columns I + 16b..; act = silu(g) * u.
  run_units(units_for(p, I / 16), [&](const Unit& u) {
    const uint16_t* wg = w13 + (u.e * (2 * I / 16) + u.block) * H * 16;
    const uint16_t* wu = w13 + (u.e * (2 * I / 16) + I / 16 + u.block) * H * 16;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t s0 = p.start[u.e]; s0 < p.start[u.e + 1]; s0 += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, p.start[u.e + 1] - s0));
      const X* xr[kRows];
      for (int r = 0; r < n; ++r) xr[r] = xin + p.token[s0 + r] * H;
      __m512 acc[kRows][2];
      tile_n<BF16>(n, xr, wg, wu, H, acc);
      for (int r = 0; r < n; ++r) {
        const __m512 g = round_bf16(acc[r][0]), up = round_bf16(acc[r][1]);
        const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), g);
        const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(neg))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(act + (s0 + r) * I + u.block * 16),
                            to_bf16(_mm512_mul_ps(silu, up)));
      }
    }
  });
  // down: block b is output columns 32b .. 32b + 31.
  const X* ain = rows_of(act, actf);
  run_units(units_for(p, H / 32), [&](const Unit& u) {
    const uint16_t* w0 = w2 + (u.e * (H / 16) + 2 * u.block) * I * 16;
    const uint16_t* w1 = w0 + I * 16;
    for (int64_t s0 = p.start[u.e]; s0 < p.start[u.e + 1]; s0 += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, p.start[u.e + 1] - s0));
      const X* xr[kRows];
      for (int r = 0; r < n; ++r) xr[r] = ain + (s0 + r) * I;
      __m512 acc[kRows][2];
      tile_n<BF16>(n, xr, w0, w1, I, acc);
      for (int r = 0; r < n; ++r) {
        uint16_t* y = ys + (s0 + r) * H + u.block * 32;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), to_bf16(acc[r][0]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16), to_bf16(acc[r][1]));
      }
    }
  });
  // Each token's weighted sum, in float32, rounded once.
  at::parallel_for(0, p.T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> sum(H);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t j = 0; j < p.k; ++j) {
        const uint16_t* y = ys + p.slot[t * p.k + j] * H;
        const __m512 w = _mm512_set1_ps(weights[t * p.k + j]);
        for (int64_t h = 0; h < H; h += 16) {
          __m512 v = _mm512_mul_ps(from_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + h))), w);
          if (round_weighted) v = round_bf16(v);
          _mm512_storeu_ps(sum.data() + h, _mm512_add_ps(_mm512_loadu_ps(sum.data() + h), v));
        }
      }
      for (int64_t h = 0; h < H; h += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * H + h), to_bf16(_mm512_loadu_ps(sum.data() + h)));
    }
  });
}

bool cpu_has_bf16() { return __builtin_cpu_supports("avx512bf16"); }

// x [T, H] bf16; w13 [E, 2I / 16, H / 2, 16, 2] and w2 [E, H / 16, I / 2, 16, 2] bf16,
// packed; topk_weights [T, k] (float32 or bfloat16: bfloat16 weights round each weighted
// output, as transformers' bfloat16 product does); topk_ids [T, k] int64.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                       const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                       int64_t dot_max_tokens) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "moe_experts: x must be bf16 [T, H]");
  TORCH_CHECK(w13.dim() == 5 && w2.dim() == 5 && w13.scalar_type() == at::kBFloat16 &&
              w2.scalar_type() == at::kBFloat16 && w13.is_contiguous() && w2.is_contiguous(),
              "moe_experts: weights must be packed bf16 [E, N / 16, K / 2, 16, 2]");
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), I = w13.size(1) * 8;
  TORCH_CHECK(w13.size(2) * 2 == H && w2.size(0) == E && w2.size(1) * 16 == H && w2.size(2) * 2 == I,
              "moe_experts: weight shapes disagree with x");
  TORCH_CHECK(H % 32 == 0 && I % 16 == 0, "moe_experts: hidden must be a multiple of 32, "
              "intermediate of 16");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_weights.sizes() == topk_ids.sizes(),
              "moe_experts: topk_weights / topk_ids must be [T, k]");
  const at::Tensor xc = x.contiguous();
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor wf = topk_weights.to(at::kFloat).contiguous();
  const bool round_weighted = topk_weights.scalar_type() == at::kBFloat16;
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const Plan p = plan(ids.data_ptr<int64_t>(), T, ids.size(1), E);
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* a = reinterpret_cast<const uint16_t*>(w13.data_ptr<at::BFloat16>());
  const auto* b = reinterpret_cast<const uint16_t*>(w2.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  static const bool has_bf16 = cpu_has_bf16();
  TORCH_CHECK(dot_max_tokens <= 0 || has_bf16,
              "moe_experts: dot_max_tokens > 0 (vdpbf16ps) needs a CPU with AVX512_BF16");
  // vdpbf16ps for steps of at most dot_max_tokens tokens (-1: every step, where the CPU
  // has it), else the pairs widened to float and two FMAs: on CPUs that issue vdpbf16ps
  // at half their FMA rate, the FMAs win once a step is compute-bound (layers/moe.py
  // times the crossover at load).
  if (dot_max_tokens < 0 ? has_bf16 : T <= dot_max_tokens)
    experts<true>(xp, a, b, wf.data_ptr<float>(), round_weighted, p, H, I, o);
  else
    experts<false>(xp, a, b, wf.data_ptr<float>(), round_weighted, p, H, I, o);
  return out;
}

}  // namespace

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(iterserve_cpu, m) {
  m.def("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, int dot_max_tokens=-1) -> Tensor");
}
TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) { m.impl("moe_experts", moe_experts); }
