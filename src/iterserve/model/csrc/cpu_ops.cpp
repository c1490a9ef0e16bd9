// Hand-written CPU kernels for the batch-1 decode step (AVX2 + FMA), built on first
// use by iterserve.model.cpu_ops. A decode step at batch 1 streams every weight once,
// so it is bound by memory bandwidth; these kernels exist because the library paths
// lose a third of it on small models:
//
// - gemv: y = x W^T (+ b) for one row. MKL's sgemv runs on one core, and a bmm over
//   weight slices (linear.py's "rows"/"cols") streams at ~70% of what a plain read
//   of memory gets. Here each thread reads one contiguous run of rows, as two
//   interleaved streams (its first and second half, each a stream the hardware
//   prefetcher locks on to) with a software prefetch a few cache lines ahead.
// - decode_attention: one query token of one sequence: writes its K/V into the
//   paged cache, then attends over the sequence's blocks in place (no gather copy),
//   the threads splitting the context (split-K, as flash-decoding does).
// - Decoder: the whole one-token forward (embedding to logits) built from those two,
//   in one parallel region: what the runner calls for a batch-1 step.
//   Its few-row steps (a handful of decodes, one request's verify run) project through
//   few_rows.h's register tiles.
// - argmax: the sampler's greedy pick, vectorised.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
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

#include "few_rows.h"
#include "kernels.h"
#include "quant_kernels.h"

namespace {

using namespace iterserve_cpu;

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "gemv: x must be [1, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "gemv: weight must be a contiguous [out, in]");
  TORCH_CHECK(weight.size(1) == x.size(1), "gemv: x and weight disagree on in_features");
  const int64_t out = weight.size(0), in = weight.size(1);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({1, out}, x.options().dtype(at::kFloat));
  if (weight.scalar_type() == at::kFloat) {
    gemv_rows(weight.data_ptr<float>(), xf.data_ptr<float>(), y.data_ptr<float>(), out, in);
  } else if (weight.scalar_type() == at::kBFloat16) {
    gemv_rows(weight.data_ptr<c10::BFloat16>(), xf.data_ptr<float>(), y.data_ptr<float>(), out, in);
  } else {
    TORCH_CHECK(false, "gemv: weight dtype must be float32 or bfloat16");
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The standalone op: writes this token's K/V to `slot`, then attends in its own region.
template <typename T>
void decode_attention_impl(const T* qp, const T* kp, const T* vp, T* kc, int64_t num_blocks,
                           int64_t block_size, int64_t kvh, int64_t hd, int64_t heads,
                           const int64_t* blocks, int64_t slot, int64_t context_len, float scale,
                           T* op, int64_t window, float softcap) {
  const int64_t row = kvh * hd;
  std::memcpy(kc + slot * row, kp, row * sizeof(T));
  std::memcpy(kc + (num_blocks * block_size + slot) * row, vp, row * sizeof(T));
  const int64_t skip = window_blocks(window, block_size, context_len);
  blocks += skip;
  context_len -= skip * block_size;
  const int64_t nblk = (context_len + block_size - 1) / block_size;
  const int nthr = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nblk)));
  std::vector<float> qf(heads * hd), scores(heads * context_len), stats(2 * nthr * heads), out(heads * hd);
  std::vector<float> partial(nthr * heads * hd);
  for (int64_t i = 0; i < heads * hd; ++i) qf[i] = to_float(qp[i]) * scale;
#pragma omp parallel num_threads(nthr)
  attend_in_region<T>(TeamSync{nullptr, false}, omp_get_thread_num(), omp_get_num_threads(), qf.data(), kc,
                      num_blocks, block_size, kvh, hd, heads, blocks, context_len, scores.data(), stats.data(),
                      partial.data(), out.data(), window, softcap);
  for (int64_t i = 0; i < heads * hd; ++i) op[i] = static_cast<T>(out[i]);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::Tensor kv_cache, const at::Tensor& block_ids,
                            const at::Tensor& slot_mapping, int64_t context_len, double scale,
                            int64_t window, double softcap) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "decode_attention: kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kvh = kv_cache.size(3), hd = kv_cache.size(4);
  // Views straight out of the fused qkv projection are already contiguous per token.
  at::Tensor qc = q.reshape({-1, hd}).contiguous();
  at::Tensor kk = k.reshape({kvh, hd}).contiguous(), vv = v.reshape({kvh, hd}).contiguous();
  const int64_t heads = qc.size(0);
  TORCH_CHECK(heads % kvh == 0, "decode_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(qc.scalar_type() == kv_cache.scalar_type() && kk.scalar_type() == kv_cache.scalar_type(),
              "decode_attention: q/k/v and cache dtypes differ");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous() &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == 1,
              "decode_attention: block_ids and slot_mapping must be contiguous int64 (one slot)");
  TORCH_CHECK(context_len >= 1 && block_ids.numel() * block_size >= context_len,
              "decode_attention: too few blocks for the context");
  const int64_t slot = *slot_mapping.data_ptr<int64_t>();
  TORCH_CHECK(slot >= 0 && slot < num_blocks * block_size, "decode_attention: slot out of range");
  at::Tensor out = at::empty({1, heads * hd}, qc.options());
  const float sc = static_cast<float>(scale);
  auto run = [&](auto zero) {
    using T = decltype(zero);
    decode_attention_impl<T>(qc.data_ptr<T>(), kk.data_ptr<T>(), vv.data_ptr<T>(), kv_cache.data_ptr<T>(),
                             num_blocks, block_size, kvh, hd, heads, block_ids.data_ptr<int64_t>(), slot,
                             context_len, sc, out.data_ptr<T>(), window, static_cast<float>(softcap));
  };
  if (kv_cache.scalar_type() == at::kFloat) {
    run(float{});
  } else if (kv_cache.scalar_type() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "decode_attention: cache dtype must be float32 or bfloat16");
  }
  return out;
}

// Row-wise argmax of [rows, n] float32 logits, as torch.argmax: the first index of the
// maximum, and the first NaN if a row has one. torch's CPU argmax is a scalar loop,
// ~80 us over a 32,000-entry vocabulary (1% of a batch-1 step); this is a vectorised
// max, then a search for its first occurrence.
int64_t argmax_row(const float* p, int64_t n) {
  int64_t i = 0;
  __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(p + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  float best = -INFINITY;
  {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    for (float l : lanes) best = std::max(best, l);
  }
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(p[j])) has_nan = true;
    else best = std::max(best, p[j]);
  }
  for (int64_t j = 0; j < n; ++j)
    if (has_nan ? std::isnan(p[j]) : p[j] == best) return j;
  return 0;  // n == 0 is rejected by the caller
}

at::Tensor argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.scalar_type() == at::kFloat,
              "argmax: logits must be a [rows, n] float32 tensor, n > 0");
  at::Tensor l = logits.contiguous();
  const int64_t rows = l.size(0), n = l.size(1);
  at::Tensor out = at::empty({rows}, l.options().dtype(at::kLong));
  const float* p = l.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) o[r] = argmax_row(p + r * n, n);
  return out;
}

// ---------------------------------------------------------------------------------
// The whole one-token forward of a Llama-family decoder (optionally with Qwen3's
// per-head q/k RMSNorms) in one parallel region.
//
// Even with the kernels above, a batch-1 step driven from Python spends ~30% of its
// time between them (dispatch, the Python wrapper of the compiled graph, guards), and
// every GEMV starts cold. Here each thread walks the layers with barriers between the
// stages: GEMVs split by rows, RMSNorm and RoPE computed by every thread for itself
// (a few hundred floats: cheaper than a barrier), attention split by context blocks.
// Activations stay in float32 whatever the weights' dtype (bf16 weights are widened
// in registers), so the step streams the weights once and does little else.
// A projection over packed quantized weights (model/quant/packed.py): its parts by output
// rows, each on the float-activation or the int8-activation kernel (quant_kernels.h).
struct QPart {
  iterserve_quant::Args a;
  int64_t row0 = 0;
  bool vnni = false;
  std::vector<at::Tensor> keep;  // the tensors `a` points into
};

struct Lin {
  at::Tensor w, b;  // w: contiguous [out, in], or empty for a quantized one; b: [out] or undefined
  int64_t out = 0, in = 0;
  std::vector<QPart> quant;  // set_quant: nonempty for a quantized projection
  bool pending = false;      // quantized, parts not given yet
  at::Tensor wp;             // bf16 w in pack_bf16_pairs' layout (Decoder.pack_bf16), or undefined
};

// One thread's input to quantized projections, prepared once per (projection, part)
// per step: group sums (float kernel) or the quantized input (int8 kernel), for every
// row of the step.
struct QScratch {
  std::vector<float> f;  // xsum [R, in / 16] | xsu [R, in / 4] | wd [2, 4, in / 16]
  std::vector<int8_t> xq;
  std::vector<int32_t> corr;
  const Lin* lin = nullptr;
  size_t part = 0;
  void reserve(int64_t in, int64_t rows) {
    f.resize(rows * (in / 16 + in / 4) + 8 * (in / 16) + 64);
    xq.resize(rows * in);
    corr.resize(rows * (in / 4));
  }
};

// Rows [r0, r1) of y = x W^T (+ b), or y += ... when `add`, for a quantized projection;
// x: [R, in], y: [R, out].
template <typename T>
inline void quant_rows_range(const Lin& l, const float* x, int64_t R, QScratch& qs, float* y, int64_t r0,
                             int64_t r1, bool add) {
  using namespace iterserve_quant;
  const int64_t in = l.in;
  for (size_t pi = 0; pi < l.quant.size(); ++pi) {
    const QPart& p = l.quant[pi];
    const int64_t lo = std::max(r0, p.row0), hi = std::min(r1, p.row0 + p.a.out);
    if (lo >= hi) continue;
    float* xsum = qs.f.data();
    float* xsu = xsum + R * (in / 16) + 16;
    float* wd = xsu + R * (in / 4) + 16;
    const bool fresh = qs.lin != &l || qs.part != pi;
    qs.lin = &l, qs.part = pi;
    if (p.vnni) {
      const QInput qi{qs.xq.data(), qs.corr.data(), xsu, xsum};
      if (fresh) prep_vnni(x, R, in, p.a.bits, p.a.group, p.a.m != nullptr, qi);
      // The kernel takes at most kMaxRows inputs at a time.
      const int64_t unit = vnni_unit(p.a.group), groups = in / p.a.group;
      for (int64_t m = 0; m < R; m += kMaxRows) {
        const QInput qm{qi.xq + m * in, qi.corr + m * (in / 4), qi.xsu + m * (in / unit), qi.xsum + m * groups};
        rows_vnni(p.a, qm, y + m * l.out + p.row0, l.out, std::min<int64_t>(kMaxRows, R - m), lo - p.row0,
                  hi - p.row0, add, wd);
      }
    } else {
      if (fresh && (p.a.m != nullptr || p.a.bits == 4)) group_sums(x, R, in, p.a.group, xsum);
      rows_float(p.a, x, xsum, y + p.row0, l.out, R, lo - p.row0, hi - p.row0, add);
    }
  }
  if (l.b.defined()) {
    const T* b = l.b.data_ptr<T>();
    for (int64_t m = 0; m < R; ++m)
      for (int64_t o = r0; o < r1; ++o) y[m * l.out + o] += to_float(b[o]);
  }
}

// The most rows one decoder call takes (a few-row step: a handful of decodes, or one
// request's verify run).
constexpr int64_t kDecoderMaxRows = 64;

// The constructor's tensors per layer (see Decoder's constructor).
constexpr int64_t kLayerTensors = 12;

struct DecoderLayer {
  at::Tensor in_norm, post_norm;
  at::Tensor q_norm, k_norm;  // per-head RMSNorm weights [head_dim] (Qwen3), or undefined
  Lin qkv, o, gate_up, down;
};

template <typename T>
inline void rms_norm_into(const float* x, const T* w, float eps, int64_t n, float* y) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) y[i] = x[i] * r * to_float(w[i]);
}

// Rows [r0, r1) of y = x W^T (+ b), or y += ... when `add` (a residual), for R rows of
// x [R, in] into y [R, out]. xd: scratch [R, in] for the pair_layout of x (bf16
// weights), filled here. One row: the single-row GEMV; more: few_rows_range's tiles.
template <typename T>
inline void gemv_rows_range(const Lin& l, const float* x, int64_t R, float* xd, float* y, int64_t r0,
                            int64_t r1, bool add, QScratch& qs, int kernel) {
  if (!l.quant.empty()) {
    quant_rows_range<T>(l, x, R, qs, y, r0, r1, add);
    return;
  }
  const T* w = l.w.data_ptr<T>();
  const T* b = l.b.defined() ? l.b.data_ptr<T>() : nullptr;
  const auto* packed = l.wp.defined() ? reinterpret_cast<const uint16_t*>(l.wp.data_ptr<int16_t>()) : nullptr;
  // One row: the single-row GEMV, but for the packed layout (no horizontal sums).
  if (R == 1 && !(kernel == kFewRowsBf16Packed && packed)) {
    const bool pairs = std::is_same<T, c10::BFloat16>::value;
    if (pairs) pair_layout(x, xd, l.in);
    for_rows_two_streams(r0, r1, [&](int64_t o) {
      float s = row_dot(w + o * l.in, x, xd, l.in);
      if (b) s += to_float(b[o]);
      y[o] = add ? y[o] + s : s;
    });
    return;
  }
  few_rows_range(w, b, l.in, l.out, x, R, xd, y, r0, r1, add, kernel, packed);
}

// Thread tid's share [r0, r1) of `out` rows; on 16-row boundaries, so that the packed
// layout's blocks are never split between threads.
inline std::pair<int64_t, int64_t> part_rows(int64_t out, int tid, int nt) {
  const int64_t blocks = (out + 15) / 16;
  return {std::min(out, blocks * tid / nt * 16), std::min(out, blocks * (tid + 1) / nt * 16)};
}

template <typename T>
inline void gemv_part(int tid, int nt, const Lin& l, const float* x, int64_t R, float* xd, float* y, bool add,
                      QScratch& qs, int kernel) {
  const auto [r0, r1] = part_rows(l.out, tid, nt);
  gemv_rows_range<T>(l, x, R, xd, y, r0, r1, add, qs, kernel);
}

// Qwen3's per-head RMSNorm on `heads` heads of x [heads, hd], in place, before RoPE.
template <typename T>
inline void head_norms(float* x, int64_t heads, int64_t hd, const at::Tensor& w, float eps) {
  const T* wp = w.data_ptr<T>();
  for (int64_t h = 0; h < heads; ++h) rms_norm_into(x + h * hd, wp, eps, hd, x + h * hd);
}

// RoPE (rotate_half convention) on `heads` heads of x [heads, hd], in place.
inline void rope(float* x, int64_t heads, int64_t hd, const float* cs, const float* sn) {
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* p = x + h * hd;
    for (int64_t i = 0; i < half; ++i) {
      const float a = p[i], b = p[i + half];
      p[i] = a * cs[i] - b * sn[i];
      p[i + half] = b * cs[i] + a * sn[i];
    }
  }
}

class Decoder : public torch::CustomClassHolder {
 public:

  // tensors: embed, final norm, lm_head weight, lm_head bias, inv_freq, then per layer
  // input norm, qkv w, qkv b, o w, o b, post-attention norm, gate_up w, gate_up b,
  // down w, down b, q norm, k norm; a bias or q/k norm that does not exist is an
  // empty tensor (the q/k norms: both or neither).
  // dims: layers, hidden, heads, kv_heads, head_dim, intermediate, vocab.
  Decoder(std::vector<at::Tensor> tensors, std::vector<int64_t> dims, double eps, at::Tensor kv_cache)
      : eps_(static_cast<float>(eps)), kv_cache_(kv_cache) {
    TORCH_CHECK(dims.size() == 7, "Decoder: dims must be 7 ints");
    layers_n_ = dims[0], hidden_ = dims[1], heads_ = dims[2], kvh_ = dims[3], hd_ = dims[4];
    inter_ = dims[5], vocab_ = dims[6];
    TORCH_CHECK(tensors.size() == static_cast<size_t>(5 + kLayerTensors * layers_n_), "Decoder: wrong number of tensors");
    TORCH_CHECK(heads_ % kvh_ == 0 && hd_ % 2 == 0, "Decoder: bad head layout");
    dtype_ = tensors[0].scalar_type();
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "Decoder: float32 or bfloat16 only");
    for (const auto& t : tensors)
      TORCH_CHECK(t.numel() == 0 || (t.is_contiguous() && t.device().is_cpu()), "Decoder: tensors must be contiguous CPU");
    // An 8-bit cache (int8 / e4m3) takes its scales from set_kv_scales.
    kv_dtype_ = kv_cache.scalar_type();
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() &&
                    (kv_dtype_ == dtype_ || kv_dtype_ == at::kChar || kv_dtype_ == at::kFloat8_e4m3fn) &&
                    kv_cache.size(0) == layers_n_ && kv_cache.size(4) == kvh_ && kv_cache.size(5) == hd_,
                "Decoder: kv_cache must be a contiguous [layers, 2, blocks, block_size, kv_heads, head_dim]");
    num_blocks_ = kv_cache.size(2), block_size_ = kv_cache.size(3);
    auto lin = [&](size_t wi, int64_t out, int64_t in) {
      Lin l{tensors[wi], tensors[wi + 1].numel() ? tensors[wi + 1] : at::Tensor(), out, in};
      l.pending = l.w.numel() == 0;  // quantized: set_quant gives its parts
      TORCH_CHECK(l.pending || (l.w.scalar_type() == dtype_ && l.w.dim() == 2 && l.w.size(0) == out &&
                                l.w.size(1) == in),
                  "Decoder: weight ", wi, " has the wrong shape or dtype");
      TORCH_CHECK(!l.b.defined() || (l.b.scalar_type() == dtype_ && l.b.numel() == out), "Decoder: bad bias ", wi);
      return l;
    };
    embed_ = tensors[0];
    embed_q_.out = vocab_, embed_q_.in = hidden_, embed_q_.pending = embed_.numel() == 0;
    norm_ = tensors[1];
    head_ = lin(2, vocab_, hidden_);
    inv_freq_ = tensors[4].to(at::kFloat).contiguous();
    TORCH_CHECK(inv_freq_.numel() == hd_ / 2, "Decoder: inv_freq must have head_dim / 2 entries");
    const int64_t q = heads_ * hd_, kv = kvh_ * hd_;
    for (int64_t i = 0; i < layers_n_; ++i) {
      const size_t base = 5 + kLayerTensors * i;
      DecoderLayer L;
      L.in_norm = tensors[base];
      L.qkv = lin(base + 1, q + 2 * kv, hidden_);
      L.o = lin(base + 3, hidden_, q);
      L.post_norm = tensors[base + 5];
      L.gate_up = lin(base + 6, 2 * inter_, hidden_);
      L.down = lin(base + 8, hidden_, inter_);
      const at::Tensor &qn = tensors[base + 10], &kn = tensors[base + 11];
      TORCH_CHECK(qn.numel() == kn.numel() && (qn.numel() == 0 || qn.numel() == hd_),
                  "Decoder: layer ", i, "'s q/k norms must both be empty or both have head_dim entries");
      TORCH_CHECK(qn.numel() == 0 || (qn.scalar_type() == dtype_ && kn.scalar_type() == dtype_),
                  "Decoder: layer ", i, "'s q/k norms must have the weights' dtype");
      if (qn.numel()) L.q_norm = qn, L.k_norm = kn;
      layers_.push_back(std::move(L));
    }
  }

  // The packed parts of the quantized projection whose weight was given as an empty
  // tensor at index `slot` of the constructor's list (0: the embedding). Per part: five
  // tensors (qweight, scales, mins, scale_base, min_base; an absent one empty) and three
  // ints (bits, group, kernel: 0 float activations, 1 int8 activations).
  void set_quant(int64_t slot, std::vector<at::Tensor> tensors, std::vector<int64_t> meta) {
    Lin* l = slot_lin(slot);
    TORCH_CHECK(l != nullptr && l->pending, "Decoder.set_quant: slot ", slot, " is not a quantized projection");
    TORCH_CHECK(!tensors.empty() && tensors.size() % 5 == 0 && meta.size() == tensors.size() / 5 * 3,
                "Decoder.set_quant: 5 tensors and 3 ints per part");
    std::vector<QPart> parts;
    int64_t row0 = 0;
    for (size_t i = 0; i < tensors.size() / 5; ++i) {
      const at::Tensor* t = &tensors[5 * i];
      const int64_t bits = meta[3 * i], group = meta[3 * i + 1], kernel = meta[3 * i + 2];
      for (int k = 0; k < 5; ++k)
        TORCH_CHECK(t[k].numel() == 0 || (t[k].is_contiguous() && t[k].device().is_cpu()),
                    "Decoder.set_quant: tensors must be contiguous CPU");
      const auto st = t[1].scalar_type();
      const bool two_level = t[3].numel() > 0;
      TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "Decoder.set_quant: bits must be 4, 6 or 8");
      TORCH_CHECK(t[0].dim() == 2 && t[0].scalar_type() == (bits == 8 ? at::kChar : at::kByte),
                  "Decoder.set_quant: qweight dtype");
      const int64_t out = t[0].size(0), in = iterserve_quant::row_in(bits, t[0].size(1));
      TORCH_CHECK(in == l->in && iterserve_quant::layout_ok(bits, in, group, t[2].numel() > 0),
                  "Decoder.set_quant: part ", i, " does not fit the projection");
      TORCH_CHECK(t[1].dim() == 2 && t[1].size(0) == out && t[1].size(1) == in / group &&
                      (two_level ? (st == at::kByte || st == at::kChar) : (st == at::kFloat || st == at::kHalf)),
                  "Decoder.set_quant: scales");
      TORCH_CHECK(t[2].numel() == 0 || (t[2].sizes() == t[1].sizes() && t[2].scalar_type() == st),
                  "Decoder.set_quant: mins must match scales");
      for (int k = 3; k < 5; ++k)
        TORCH_CHECK(t[k].numel() == 0 || (t[k].scalar_type() == t[3].scalar_type() &&
                                          (t[k].scalar_type() == at::kFloat || t[k].scalar_type() == at::kHalf) &&
                                          in % 256 == 0 && 256 % group == 0 && t[k].numel() == out * (in / 256)),
                    "Decoder.set_quant: scale_base / min_base must be float32 or float16 [out, in / 256], "
                    "one dtype");
      TORCH_CHECK(two_level == (t[2].numel() > 0 ? t[4].numel() > 0 : two_level),
                  "Decoder.set_quant: two-level mins need a min_base");
      TORCH_CHECK(kernel == 0 || iterserve_quant::vnni_layout_ok(bits, in, group),
                  "Decoder.set_quant: the int8-activation kernel does not take this layout");
      QPart p;
      const int kind = st == at::kHalf ? iterserve_quant::kF16 : st == at::kByte ? iterserve_quant::kU8
                       : st == at::kChar ? iterserve_quant::kI8 : iterserve_quant::kF32;
      auto ptr = [&](int k) -> const void* { return t[k].numel() ? t[k].data_ptr() : nullptr; };
      const bool half_base = t[3].numel() > 0 && t[3].scalar_type() == at::kHalf;
      p.a = iterserve_quant::Args{ptr(0), ptr(1), ptr(2), iterserve_quant::Base{ptr(3), half_base},
                                  iterserve_quant::Base{ptr(4), half_base}, out, in, group, bits, kind};
      p.row0 = row0;
      p.vnni = kernel == 1;
      p.keep.assign(t, t + 5);
      row0 += out;
      parts.push_back(std::move(p));
    }
    TORCH_CHECK(row0 == l->out, "Decoder.set_quant: the parts have ", row0, " rows, the projection ", l->out);
    TORCH_CHECK(slot != 0 || parts.size() == 1, "Decoder.set_quant: the embedding is one part");
    l->quant = std::move(parts);
    l->pending = false;
    quantized_ = true;
  }

  // Packs every bf16 projection (not the embedding) into pack_bf16_pairs' layout, for
  // kFewRowsBf16Packed; returns the bytes it added (0 on a float32 model, or a CPU
  // without AVX512_BF16, where that kernel does not exist).
  int64_t pack_bf16() {
    if (dtype_ != at::kBFloat16 || !cpu_has_avx512_bf16()) return 0;
    int64_t bytes = 0;
    auto pack = [&](Lin& l) {
      if (!l.quant.empty() || l.pending || l.w.numel() == 0 || l.wp.defined()) return;
      l.wp = pack_bf16_pairs(l.w);
      bytes += l.wp.numel() * 2;
    };
    pack(head_);
    for (auto& L : layers_) pack(L.qkv), pack(L.o), pack(L.gate_up), pack(L.down);
    return bytes;
  }

  // The FewRowsKernel this decoder's few-row projections take (-1: the process-wide
  // one, set_few_rows_kernel's); returns the one it replaces.
  int64_t set_kernel(int64_t kernel) {
    if (kernel >= 0) check_few_rows_kernel(kernel);
    const int64_t before = kernel_;
    kernel_ = static_cast<int>(kernel);
    return before;
  }

  // One token at `position` (its context: positions 0..position, the earlier ones
  // already cached in `block_ids`): writes its K/V into every layer's cache and, when
  // `logits`, returns [1, vocab] float32 logits (else an empty tensor).
  at::Tensor step(int64_t token, int64_t position, std::vector<int64_t> block_ids, bool logits) {
    const Row row{token, position, block_ids.data(), static_cast<int64_t>(block_ids.size())};
    check(row);
    at::Tensor out = logits ? at::empty({1, vocab_}, embed_.options().dtype(at::kFloat)) : at::Tensor();
    dispatch(&row, 1, logits ? out.data_ptr<float>() : nullptr, nullptr);
    return logits ? out : at::empty({0}, embed_.options().dtype(at::kFloat));
  }

  // step() plus the greedy pick (torch.argmax's: the first maximum, or the first NaN),
  // without handing the logits back: a plain greedy request needs nothing else.
  int64_t step_greedy(int64_t token, int64_t position, std::vector<int64_t> block_ids) {
    const Row row{token, position, block_ids.data(), static_cast<int64_t>(block_ids.size())};
    check(row);
    if (static_cast<int64_t>(logits_buf_.size()) != vocab_) logits_buf_.resize(vocab_);
    int64_t best = 0;
    dispatch(&row, 1, logits_buf_.data(), &best);
    return best;
  }

  // A few rows in one forward: row r is token tokens[r] at positions[r] of the request
  // whose block table is block_ids[table_starts[r] : table_starts[r + 1]]. Every row's
  // K/V is written into the cache first, layer by layer, then each row attends over
  // its table up to and including its own position: one request's consecutive
  // positions (a speculative verify) are exactly causal, rows of different requests
  // independent. Returns [rows, vocab] float32 logits.
  at::Tensor step_rows(std::vector<int64_t> tokens, std::vector<int64_t> positions, std::vector<int64_t> block_ids,
                       std::vector<int64_t> table_starts) {
    const std::vector<Row> rows = make_rows(tokens, positions, block_ids, table_starts);
    const int64_t R = static_cast<int64_t>(rows.size());
    at::Tensor out = at::empty({R, vocab_}, embed_.options().dtype(at::kFloat));
    dispatch(rows.data(), R, out.data_ptr<float>(), nullptr);
    return out;
  }

  // step_rows() plus each row's greedy pick (as step_greedy), without handing the
  // logits back: a step of plain greedy requests (decodes, or a speculative verify
  // whose drafts are checked against the picks) needs nothing else.
  std::vector<int64_t> step_rows_greedy(std::vector<int64_t> tokens, std::vector<int64_t> positions,
                                        std::vector<int64_t> block_ids, std::vector<int64_t> table_starts) {
    const std::vector<Row> rows = make_rows(tokens, positions, block_ids, table_starts);
    const int64_t R = static_cast<int64_t>(rows.size());
    if (static_cast<int64_t>(logits_buf_.size()) != R * vocab_) logits_buf_.resize(R * vocab_);
    std::vector<int64_t> best(R, 0);
    dispatch(rows.data(), R, logits_buf_.data(), best.data());
    return best;
  }

  // The per-row scales of an 8-bit KV cache: [layers, 2, blocks, block_size, kv_heads].
  void set_kv_scales(at::Tensor scales) {
    TORCH_CHECK(kv_dtype_ != dtype_, "Decoder.set_kv_scales: the KV cache is not 8-bit");
    TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.dim() == 5 &&
                    scales.size(0) == layers_n_ && scales.size(1) == 2 && scales.size(2) == num_blocks_ &&
                    scales.size(3) == block_size_ && scales.size(4) == kvh_,
                "Decoder.set_kv_scales: scales must be contiguous bfloat16 [layers, 2, blocks, block_size, kv_heads]");
    kv_scales_ = scales;
  }

 private:
  // One row of a step: a token, its position, its request's block table.
  struct Row {
    int64_t token = 0, position = 0;
    const int64_t* blocks = nullptr;
    int64_t num_blocks = 0;
    int64_t slot(int64_t bs) const { return blocks[position / bs] * bs + position % bs; }
  };

  // The rows of step_rows' arguments, checked.
  std::vector<Row> make_rows(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                             const std::vector<int64_t>& block_ids, const std::vector<int64_t>& table_starts) const {
    const int64_t R = static_cast<int64_t>(tokens.size());
    TORCH_CHECK(R >= 1 && R <= kDecoderMaxRows, "Decoder.step_rows: 1 to ", kDecoderMaxRows, " rows");
    TORCH_CHECK(static_cast<int64_t>(positions.size()) == R && static_cast<int64_t>(table_starts.size()) == R + 1,
                "Decoder.step_rows: positions needs one entry a row, table_starts one more");
    std::vector<Row> rows(R);
    const int64_t nb = static_cast<int64_t>(block_ids.size());
    for (int64_t r = 0; r < R; ++r) {
      const int64_t a = table_starts[r], b = table_starts[r + 1];
      TORCH_CHECK(0 <= a && a <= b && b <= nb, "Decoder.step_rows: table_starts out of order or range");
      rows[r] = Row{tokens[r], positions[r], block_ids.data() + a, b - a};
      check(rows[r]);
    }
    // Two rows writing one cache slot would race (and one of them would read the other's K/V).
    for (int64_t r = 0; r < R; ++r)
      for (int64_t q = 0; q < r; ++q)
        TORCH_CHECK(rows[r].slot(block_size_) != rows[q].slot(block_size_), "Decoder.step_rows: rows ", q, " and ",
                    r, " write the same cache slot");
    return rows;
  }

  Lin* slot_lin(int64_t slot) {
    if (slot == 0) return &embed_q_;
    if (slot == 2) return &head_;
    const int64_t i = (slot - 5) / kLayerTensors, k = (slot - 5) % kLayerTensors;
    if (slot < 5 || i >= layers_n_) return nullptr;
    DecoderLayer& L = layers_[i];
    return k == 1 ? &L.qkv : k == 3 ? &L.o : k == 6 ? &L.gate_up : k == 8 ? &L.down : nullptr;
  }

  void check(const Row& row) const {
    TORCH_CHECK(row.token >= 0 && row.token < vocab_, "Decoder.step: token id out of range");
    TORCH_CHECK(!embed_q_.pending && !head_.pending, "Decoder.step: a quantized projection has no parts yet");
    for (const auto& L : layers_)
      TORCH_CHECK(!(L.qkv.pending || L.o.pending || L.gate_up.pending || L.down.pending),
                  "Decoder.step: a quantized projection has no parts yet");
    TORCH_CHECK(row.position >= 0 && row.num_blocks * block_size_ >= row.position + 1,
                "Decoder.step: too few blocks for the context");
    for (int64_t i = 0; i < row.num_blocks; ++i)
      TORCH_CHECK(row.blocks[i] >= 0 && row.blocks[i] < num_blocks_, "Decoder.step: block id out of range");
    TORCH_CHECK(kv_dtype_ == dtype_ || kv_scales_.defined(), "Decoder.step: an 8-bit KV cache needs set_kv_scales");
  }

  void dispatch(const Row* rows, int64_t R, float* logits, int64_t* argmax_out) {
    auto go = [&](auto wzero) {
      using T = decltype(wzero);
      if (kv_dtype_ == at::kChar) {
        run<T, int8_t>(rows, R, logits, argmax_out);
      } else if (kv_dtype_ == at::kFloat8_e4m3fn) {
        run<T, E4M3>(rows, R, logits, argmax_out);
      } else {
        run<T, T>(rows, R, logits, argmax_out);
      }
    };
    if (dtype_ == at::kFloat) {
      go(float{});
    } else {
      go(c10::BFloat16{});
    }
  }

  // T: the weights' dtype; C: the KV cache's (T, or int8_t / E4M3 with kv_scales_).
  // R rows (see step_rows); argmax_out: each row's greedy pick (R entries), or null.
  template <typename T, typename C>
  void run(const Row* rows, int64_t R, float* logits, int64_t* argmax_out) {
    const int64_t q = heads_ * hd_, kv = kvh_ * hd_, row = kvh_ * hd_, qkv_n = q + 2 * kv;
    const int nt = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
    const int kern = kernel_ >= 0 ? kernel_ : few_rows_kernel().load(std::memory_order_relaxed);
    const float scale = 1.f / std::sqrt(static_cast<float>(hd_));
    std::vector<int64_t> part_best(argmax_out ? nt * R : 0, -1);  // [thread, row]
    SpinBarrier bar;
    bar.n = nt;
    // Shared buffers, [R, width] (written by row ranges, read after a barrier); each
    // row's attention scratch of its own (scores at its context's length).
    std::vector<float> h(R * hidden_), qkv(R * qkv_n), attn(R * q), act(R * inter_), gate_up(R * 2 * inter_);
    std::vector<int64_t> score_off(R + 1, 0);
    for (int64_t r = 0; r < R; ++r) score_off[r + 1] = score_off[r] + heads_ * (rows[r].position + 1);
    std::vector<float> scores(score_off[R]), stats(R * 2 * nt * heads_), partial(R * nt * q);
    // Rows that attend together (attend_rows): a run of rows, each further on than the
    // one before and its block table extending that one's (one request's verify run),
    // read each K/V block once for the run. groups: the runs' first rows, then R.
    std::vector<int64_t> groups{0};
    for (int64_t r = 1; r < R; ++r) {
      const Row &a = rows[r - 1], &b = rows[r];
      const int64_t need = a.position / block_size_ + 1;
      if (!(b.position > a.position && b.num_blocks >= need && std::equal(a.blocks, a.blocks + need, b.blocks)))
        groups.push_back(r);
    }
    groups.push_back(R);
    // RoPE for each row's position, float32 as transformers computes it.
    const int64_t half = hd_ / 2;
    std::vector<float> cs(R * half), sn(R * half);
    const float* invf = inv_freq_.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < half; ++i) {
        const float f = static_cast<float>(rows[r].position) * invf[i];
        cs[r * half + i] = std::cos(f), sn[r * half + i] = std::sin(f);
      }
    for (int64_t r = 0; r < R; ++r) {
      float* hr = h.data() + r * hidden_;
      if (!embed_q_.quant.empty()) {
        iterserve_quant::dequant_row(embed_q_.quant[0].a, rows[r].token, hr);
      } else {
        const T* e = embed_.data_ptr<T>() + rows[r].token * hidden_;
        for (int64_t i = 0; i < hidden_; ++i) hr[i] = to_float(e[i]);
      }
    }
    C* cache = static_cast<C*>(kv_cache_.data_ptr());
    c10::BFloat16* kv_scales = kv_scales_.defined() ? kv_scales_.data_ptr<c10::BFloat16>() : nullptr;
    const int64_t scales_stride = 2 * num_blocks_ * block_size_ * kvh_;
    const int64_t layer_stride = 2 * num_blocks_ * block_size_ * row;

#pragma omp parallel num_threads(nt)
    {
      const int tid = omp_get_thread_num(), n = omp_get_num_threads();
      const TeamSync sync{&bar, n == nt};
      const int64_t widest = std::max({hidden_, q, inter_});
      std::vector<float> xn(R * hidden_), qf(R * q), xd(R * widest), kr(kv), merge_w(n);
      std::vector<QueryPart> parts(R);
      for (int64_t r = 0; r < R; ++r)
        parts[r] = {qf.data() + r * q, rows[r].position + 1, scores.data() + score_off[r],
                    stats.data() + r * 2 * nt * heads_, partial.data() + r * nt * q};
      QScratch qs;
      if (quantized_) qs.reserve(widest, R);
      auto norm_rows = [&](const at::Tensor& w) {
        for (int64_t r = 0; r < R; ++r)
          rms_norm_into(h.data() + r * hidden_, w.data_ptr<T>(), eps_, hidden_, xn.data() + r * hidden_);
      };
      for (int64_t li = 0; li < layers_n_; ++li) {
        const DecoderLayer& L = layers_[li];
        C* kc = cache + li * layer_stride;
        c10::BFloat16* ks = kv_scales ? kv_scales + li * scales_stride : nullptr;
        norm_rows(L.in_norm);
        gemv_part<T>(tid, n, L.qkv, xn.data(), R, xd.data(), qkv.data(), false, qs, kern);
        sync();
        // Every thread ropes its own copy of every row's q; row r's K/V is written by
        // thread r % n, all of them before any row attends.
        for (int64_t r = 0; r < R; ++r) {
          const float* src = qkv.data() + r * qkv_n;
          float* qr = qf.data() + r * q;
          std::memcpy(qr, src, q * sizeof(float));
          if (L.q_norm.defined()) head_norms<T>(qr, heads_, hd_, L.q_norm, eps_);
          rope(qr, heads_, hd_, cs.data() + r * half, sn.data() + r * half);
          for (int64_t i = 0; i < q; ++i) qr[i] *= scale;
          if (r % n != tid) continue;
          std::memcpy(kr.data(), src + q, kv * sizeof(float));
          if (L.k_norm.defined()) head_norms<T>(kr.data(), kvh_, hd_, L.k_norm, eps_);
          rope(kr.data(), kvh_, hd_, cs.data() + r * half, sn.data() + r * half);
          const int64_t slot = rows[r].slot(block_size_), vslot = num_blocks_ * block_size_ + slot;
          store_kv_row<C>(kc + slot * row, ks ? ks + slot * kvh_ : nullptr, kr.data(), kvh_, hd_);
          store_kv_row<C>(kc + vslot * row, ks ? ks + vslot * kvh_ : nullptr, src + q + kv, kvh_, hd_);
        }
        sync();
        // Each run of rows split by context blocks over the whole team, then every (row,
        // head) merged.
        for (size_t g = 0; g + 1 < groups.size(); ++g)
          attend_rows<C>(tid, n, parts.data() + groups[g], groups[g + 1] - groups[g], kc, num_blocks_, block_size_,
                         kvh_, hd_, heads_, rows[groups[g + 1] - 1].blocks, 0, 0.f, ks);
        sync();
        for (int64_t i = tid; i < R * heads_; i += n) {
          const int64_t r = i / heads_;
          attend_merge_head(i % heads_, n, heads_, hd_, stats.data() + r * 2 * nt * heads_,
                            partial.data() + r * nt * q, attn.data() + r * q, merge_w.data());
        }
        sync();
        gemv_part<T>(tid, n, L.o, attn.data(), R, xd.data(), h.data(), true, qs, kern);
        sync();
        norm_rows(L.post_norm);
        // Gate and up rows i of my range together, so my act[i] needs no barrier.
        const auto [i0, i1] = part_rows(inter_, tid, n);
        gemv_rows_range<T>(L.gate_up, xn.data(), R, xd.data(), gate_up.data(), i0, i1, false, qs, kern);
        gemv_rows_range<T>(L.gate_up, xn.data(), R, xd.data(), gate_up.data(), inter_ + i0, inter_ + i1, false, qs, kern);
        for (int64_t r = 0; r < R; ++r) {
          const float* g = gate_up.data() + r * 2 * inter_;
          silu_mul(g + i0, g + inter_ + i0, act.data() + r * inter_ + i0, i1 - i0);
        }
        sync();
        gemv_part<T>(tid, n, L.down, act.data(), R, xd.data(), h.data(), true, qs, kern);
        sync();
      }
      if (logits) {
        norm_rows(norm_);
        gemv_part<T>(tid, n, head_, xn.data(), R, xd.data(), logits, false, qs, kern);
        if (argmax_out) {  // each thread over its own vocab rows (still in its cache)
          const auto [v0, v1] = part_rows(vocab_, tid, n);  // gemv_part's rows
          for (int64_t r = 0; r < R; ++r)
            part_best[tid * R + r] = v1 > v0 ? v0 + argmax_row(logits + r * vocab_ + v0, v1 - v0) : -1;
        }
      }
    }
    if (argmax_out) {
      // The parts in vocab order: a later part wins only with a strictly larger value
      // (or the first NaN), as in one pass over the row.
      for (int64_t r = 0; r < R; ++r) {
        const float* lr = logits + r * vocab_;
        int64_t best = -1;
        for (int t = 0; t < nt; ++t) {
          const int64_t b = part_best[t * R + r];
          if (b < 0) continue;
          if (best < 0) {
            best = b;
          } else if (!std::isnan(lr[best]) && (std::isnan(lr[b]) || lr[b] > lr[best])) {
            best = b;
          }
        }
        argmax_out[r] = best;
      }
    }
  }

  float eps_;
  at::Tensor kv_scales_;
  at::ScalarType kv_dtype_ = at::kFloat;
  at::Tensor kv_cache_, embed_, norm_, inv_freq_;
  Lin head_, embed_q_;  // embed_q_: a quantized embedding's parts (else unused)
  std::vector<DecoderLayer> layers_;
  bool quantized_ = false;  // any projection quantized
  int kernel_ = -1;         // the few-row projections' FewRowsKernel (-1: the process-wide one)
  int64_t layers_n_ = 0, hidden_ = 0, heads_ = 0, kvh_ = 0, hd_ = 0, inter_ = 0, vocab_ = 0;
  int64_t num_blocks_ = 0, block_size_ = 0;
  at::ScalarType dtype_ = at::kFloat;
  std::vector<float> logits_buf_;
};


// The decoder's few-row projection as an op: y = x W^T (+ b) for x [R, in] (R <= 64),
// through `kernel` (FewRowsKernel; -1: the decoder's own), over all threads.
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           int64_t kernel) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kDecoderMaxRows, "few_rows_linear: x must be [1..64, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "few_rows_linear: weight must be a contiguous [out, in]");
  TORCH_CHECK(weight.size(1) == x.size(1), "few_rows_linear: x and weight disagree on in_features");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "few_rows_linear: weight dtype must be float32 or bfloat16");
  if (kernel < 0) kernel = few_rows_kernel().load();
  check_few_rows_kernel(kernel);
  const int64_t R = x.size(0), out = weight.size(0), in = weight.size(1);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor b = bias.has_value() && bias->defined() ? bias->to(weight.scalar_type()).contiguous() : at::Tensor();
  at::Tensor y = at::empty({R, out}, x.options().dtype(at::kFloat));
  const bool pack = kernel == kFewRowsBf16Packed && weight.scalar_type() == at::kBFloat16;
  const at::Tensor wp = pack ? pack_bf16_pairs(weight) : at::Tensor();
  const auto* packed = pack ? reinterpret_cast<const uint16_t*>(wp.data_ptr<int16_t>()) : nullptr;
  auto go = [&](auto wzero) {
    using T = decltype(wzero);
    const T* bp = b.defined() ? b.data_ptr<T>() : nullptr;
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    at::parallel_for(0, out, std::max<int64_t>(1, (out + threads - 1) / threads), [&](int64_t r0, int64_t r1) {
      std::vector<float> xd(R * in);
      few_rows_range(weight.data_ptr<T>(), bp, in, out, xf.data_ptr<float>(), R, xd.data(), y.data_ptr<float>(), r0,
                     r1, false, static_cast<int>(kernel), packed);
    });
  };
  if (weight.scalar_type() == at::kFloat) {
    go(float{});
  } else {
    go(c10::BFloat16{});
  }
  return y;
}

// Sets the kernel the decoder's few-row projections take (-1: the CPU's best); returns
// the one it replaces. For tests and A/B timing.
int64_t set_few_rows_kernel(int64_t kernel) {
  if (kernel < 0) kernel = default_few_rows_kernel();
  check_few_rows_kernel(kernel);
  return few_rows_kernel().exchange(static_cast<int>(kernel));
}

}  // namespace

TORCH_LIBRARY(iterserve_cpu, m) {
  m.class_<Decoder>("Decoder")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double, at::Tensor>())
      .def("set_kv_scales", &Decoder::set_kv_scales)
      .def("set_quant", &Decoder::set_quant)
      .def("step", &Decoder::step)
      .def("step_greedy", &Decoder::step_greedy)
      .def("step_rows", &Decoder::step_rows)
      .def("step_rows_greedy", &Decoder::step_rows_greedy)
      .def("pack_bf16", &Decoder::pack_bf16)
      .def("set_kernel", &Decoder::set_kernel);
  m.def("argmax(Tensor logits) -> Tensor");
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias, int kernel=-1) -> Tensor");
  m.def("set_few_rows_kernel(int kernel) -> int", set_few_rows_kernel);
  // kv_cache is written in place (this token's K/V).
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor block_ids, "
        "Tensor slot_mapping, int context_len, float scale, int window=0, float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) {
  m.impl("gemv", gemv);
  m.impl("few_rows_linear", few_rows_linear);
  m.impl("argmax", argmax);
  m.impl("decode_attention", decode_attention);
}
