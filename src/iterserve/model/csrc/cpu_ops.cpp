// Hand-written CPU kernels for the batch-1 decode step (AVX2 + FMA), built on first
// use by iterserve.model.cpu_ops. A decode step at batch 1 streams every weight once,
// so it is bound by memory bandwidth; these kernels exist because the library paths
// lose a third of it on small models:
//
// - gemv: y = x W^T (+ b) for one row. MKL's sgemv runs on one core, and a bmm over
//   weight slices (linear.py's "rows"/"cols") streams at ~70% of what a plain read
//   of memory gets. Here each thread reads one contiguous run of rows, one row at a
//   time (a single stream, so the hardware prefetcher locks on) with a software
//   prefetch a few cache lines ahead: ~90% of a read-only sum's bandwidth, measured.
// - decode_attention: one query token of one sequence: writes its K/V into the
//   paged cache, then attends over the sequence's blocks in place (no gather copy),
//   the threads splitting the context (split-K, as flash-decoding does).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

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

template <typename T>
void gemv_rows(const T* w, const float* x, float* y, int64_t out, int64_t in) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // One contiguous run of rows per thread: each streams its own part of the matrix.
  const int64_t grain = std::max<int64_t>(1, (out + threads - 1) / threads);
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) y[o] = dot_row(w + o * in, x, in);
  });
}

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

// Attention of one query token over `context_len` tokens held in the paged cache.
// kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; q: [heads, head_dim];
// k, v: [kv_heads, head_dim] (this token's, written to `slot` first).
//
// The threads split the context by blocks, not the heads: a token's K (or V) row holds
// every KV head contiguously, so each thread streams whole rows of its own blocks (the
// cache is cold by now: the step's weights went through since this layer last ran).
// Phases, with barriers: scores for my tokens -> softmax per head (heads split) ->
// sum of p * V for my tokens into my partial -> partials summed per head (heads split).
template <typename T>
void decode_attention_impl(const T* qp, const T* kp, const T* vp, T* kc, int64_t num_blocks,
                           int64_t block_size, int64_t kvh, int64_t hd, int64_t heads,
                           const int64_t* blocks, int64_t slot, int64_t context_len, float scale,
                           T* op) {
  const int64_t group = heads / kvh;
  const int64_t row = kvh * hd;
  T* vc = kc + num_blocks * block_size * row;
  std::memcpy(kc + slot * row, kp, row * sizeof(T));
  std::memcpy(vc + slot * row, vp, row * sizeof(T));
  const int64_t nblk = (context_len + block_size - 1) / block_size;
  const int nthr = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nblk)));

  std::vector<float> qf(heads * hd), scores(heads * context_len), denom(heads);
  std::vector<float> partial(nthr * heads * hd, 0.f);
  for (int64_t i = 0; i < heads * hd; ++i) qf[i] = to_float(qp[i]) * scale;

#pragma omp parallel num_threads(nthr)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t b0 = nblk * tid / nt, b1 = nblk * (tid + 1) / nt;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t0 = b * block_size, n = std::min(block_size, context_len - t0);
      const T* base = kc + blocks[b] * block_size * row;
      for (int64_t j = 0; j < n; ++j)
        for (int64_t qh = 0; qh < heads; ++qh)
          scores[qh * context_len + t0 + j] = dot_row(base + j * row + (qh / group) * hd, &qf[qh * hd], hd);
    }
#pragma omp barrier
    for (int64_t qh = tid; qh < heads; qh += nt) {
      float* sc = &scores[qh * context_len];
      float mx = -INFINITY;
      for (int64_t t = 0; t < context_len; ++t) mx = std::max(mx, sc[t]);
      denom[qh] = exp_sum(sc, context_len, mx);
    }
#pragma omp barrier
    float* acc = &partial[tid * heads * hd];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t0 = b * block_size, n = std::min(block_size, context_len - t0);
      const T* base = vc + blocks[b] * block_size * row;
      for (int64_t j = 0; j < n; ++j)
        for (int64_t qh = 0; qh < heads; ++qh)
          axpy(acc + qh * hd, scores[qh * context_len + t0 + j], base + j * row + (qh / group) * hd, hd);
    }
#pragma omp barrier
    for (int64_t qh = tid; qh < heads; qh += nt) {
      const float inv = 1.f / denom[qh];
      for (int64_t d = 0; d < hd; ++d) {
        float sum = 0.f;
        for (int th = 0; th < nt; ++th) sum += partial[(th * heads + qh) * hd + d];
        op[qh * hd + d] = static_cast<T>(sum * inv);
      }
    }
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::Tensor kv_cache, const at::Tensor& block_ids,
                            const at::Tensor& slot_mapping, int64_t context_len, double scale) {
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
                             context_len, sc, out.data_ptr<T>());
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

// The single-token step's attention context, set once per step by the runner, so the
// compiled model can call attention as a plain C++ op per layer (no Python between the
// layers): the layers' caches (bound when the runner starts, or when another runner
// in the process takes over) and the token's blocks, slot and context length.
struct StepContext {
  std::vector<at::Tensor> kv_caches;
  at::Tensor block_ids, slot_mapping;
  int64_t context_len = 0;
};
// Per thread: each engine steps its model on its own thread, and two engines in one
// process must not see each other's context.
StepContext& step_context() {
  thread_local StepContext ctx;
  return ctx;
}

void bind_kv_caches(at::TensorList caches) {
  step_context().kv_caches.assign(caches.begin(), caches.end());
}

void set_decode_context(const at::Tensor& block_ids, const at::Tensor& slot_mapping, int64_t context_len) {
  StepContext& c = step_context();
  c.block_ids = block_ids;
  c.slot_mapping = slot_mapping;
  c.context_len = context_len;
}

at::Tensor decode_attention_layer(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  int64_t layer_idx, double scale) {
  StepContext& c = step_context();
  TORCH_CHECK(layer_idx >= 0 && layer_idx < static_cast<int64_t>(c.kv_caches.size()),
              "decode_attention_layer: no KV cache bound for layer ", layer_idx);
  TORCH_CHECK(c.block_ids.defined() && c.context_len > 0, "decode_attention_layer: no step context set");
  return decode_attention(q, k, v, c.kv_caches[layer_idx], c.block_ids, c.slot_mapping, c.context_len, scale);
}

}  // namespace

TORCH_LIBRARY(iterserve_cpu, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // kv_cache is written in place (this token's K/V).
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor block_ids, "
        "Tensor slot_mapping, int context_len, float scale) -> Tensor");
  m.def("bind_kv_caches(Tensor[] caches) -> ()");
  m.def("set_decode_context(Tensor block_ids, Tensor slot_mapping, int context_len) -> ()");
  // Writes this token's K/V into the bound cache: a side effect the graph never sees
  // (as with iterserve::attention), so the schema declares no mutation.
  m.def("decode_attention_layer(Tensor q, Tensor k, Tensor v, int layer_idx, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) {
  m.impl("gemv", gemv);
  m.impl("decode_attention", decode_attention);
  m.impl("decode_attention_layer", decode_attention_layer);
}

TORCH_LIBRARY_IMPL(iterserve_cpu, CompositeExplicitAutograd, m) {
  m.impl("bind_kv_caches", bind_kv_caches);
  m.impl("set_decode_context", set_decode_context);
}
