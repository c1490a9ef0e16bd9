// Batched paged decode attention (AVX2 + FMA): every decode row of a step in one call,
// each attending over its own blocks in the paged cache, in place. The torch path
// gathers each row's blocks into a padded copy and runs SDPA over it per group of
// rows; on CPU the gather copy alone costs as much as the attention, and the padding
// reads KV no row needs. vLLM's CPU paged attention works the same way.
//
// Rows are split among the threads whole (longest first, dynamically: contexts differ
// by 10x), each row attending with every query head over its blocks exactly as the
// batch-1 kernel does (kernels.h, attend_in_region). With fewer rows than threads a
// row's context is split across the team instead (split-K).
#include "kernels.h"

namespace {

using namespace iterserve_cpu;

// T: q's and out's dtype; C: the cache's (T, or int8_t / E4M3 with `scales`).
template <typename T, typename C>
void paged_decode_impl(const T* q, int64_t q_stride, const C* kc, int64_t num_blocks, int64_t block_size,
                       int64_t kvh, int64_t hd, int64_t heads, const int64_t* table, int64_t table_stride,
                       const int64_t* ctx, int64_t rows, float scale, T* out, int64_t window,
                       float softcap, const c10::BFloat16* scales) {
  const int nt = std::max(1, at::get_num_threads());
  int64_t max_ctx = 1;
  for (int64_t i = 0; i < rows; ++i) max_ctx = std::max(max_ctx, ctx[i]);
  auto load_q = [&](int64_t i, float* qf) {
    for (int64_t j = 0; j < heads * hd; ++j) qf[j] = to_float(q[i * q_stride + j]) * scale;
  };
  auto store = [&](int64_t i, const float* o) {
    for (int64_t j = 0; j < heads * hd; ++j) out[i * heads * hd + j] = static_cast<T>(o[j]);
  };
  if (rows < nt) {
    // Few rows: the whole team on each row in turn, splitting its context.
    std::vector<float> qf(heads * hd), scores(heads * max_ctx), stats(2 * nt * heads), part(nt * heads * hd),
        o(heads * hd);
    for (int64_t i = 0; i < rows; ++i) {
      load_q(i, qf.data());
      const int64_t skip = window_blocks(window, block_size, ctx[i]);
      const int64_t nblk = (ctx[i] - skip * block_size + block_size - 1) / block_size;
      const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nt, nblk)));
#pragma omp parallel num_threads(team)
      attend_in_region<C>(TeamSync{nullptr, false}, omp_get_thread_num(), omp_get_num_threads(), qf.data(), kc,
                          num_blocks, block_size, kvh, hd, heads, table + i * table_stride + skip,
                          ctx[i] - skip * block_size, scores.data(), stats.data(), part.data(), o.data(),
                          window, softcap, scales);
      store(i, o.data());
    }
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> qf(heads * hd), scores(heads * max_ctx), stats(2 * heads), part(heads * hd), o(heads * hd);
    SpinBarrier solo;  // a team of one: its barrier returns at once
    const TeamSync sync{&solo, true};
    // Rows arrive shortest context first: take them from the back (longest first).
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = rows - 1 - r;
      load_q(i, qf.data());
      const int64_t skip = window_blocks(window, block_size, ctx[i]);
      attend_in_region<C>(sync, 0, 1, qf.data(), kc, num_blocks, block_size, kvh, hd, heads,
                          table + i * table_stride + skip, ctx[i] - skip * block_size, scores.data(),
                          stats.data(), part.data(), o.data(), window, softcap, scales);
      store(i, o.data());
    }
  }
}

// q: [rows, heads, head_dim] (rows may be strided, e.g. a view of the fused qkv output);
// kv_cache: [2, blocks, block_size, kv_heads, head_dim], already holding the rows' new
// K/V; block_table: [rows, max_blocks] int64; context_lens: [rows] int64 (the new token
// included); window, softcap: see attend_in_region (0: none); kv_scales: an 8-bit
// (int8 / float8_e4m3fn) cache's bfloat16 [2, blocks, block_size, kv_heads] per-row
// scales. Returns [rows, heads * head_dim] in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale, int64_t window,
                                  double softcap, const c10::optional<at::Tensor>& kv_scales) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_decode_attention: kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kvh = kv_cache.size(3), hd = kv_cache.size(4);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == hd && q.stride(2) == 1 && q.stride(1) == hd,
              "paged_decode_attention: q must be [rows, heads, head_dim], each row contiguous");
  const int64_t rows = q.size(0), heads = q.size(1);
  TORCH_CHECK(heads % kvh == 0, "paged_decode_attention: heads must be a multiple of kv_heads");
  const bool quantized = kv_cache.scalar_type() == at::kChar || kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(quantized || q.scalar_type() == kv_cache.scalar_type(),
              "paged_decode_attention: q and cache dtypes differ");
  TORCH_CHECK(!quantized || (kv_scales.has_value() && kv_scales->scalar_type() == at::kBFloat16 &&
                             kv_scales->is_contiguous() && kv_scales->dim() == 4 && kv_scales->size(0) == 2 &&
                             kv_scales->size(1) == num_blocks && kv_scales->size(2) == block_size &&
                             kv_scales->size(3) == kvh),
              "paged_decode_attention: an 8-bit cache needs contiguous bfloat16 kv_scales "
              "[2, blocks, block_size, kv_heads]");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.size(0) == rows &&
                  block_table.stride(1) == 1,
              "paged_decode_attention: block_table must be int64 [rows, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == rows,
              "paged_decode_attention: context_lens must be contiguous int64 [rows]");
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t width = block_table.size(1);
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(ctx[i] >= 1 && ctx[i] <= width * block_size, "paged_decode_attention: context ", ctx[i],
                " of row ", i, " does not fit its block table");
    for (int64_t b = 0, n = (ctx[i] + block_size - 1) / block_size; b < n; ++b) {
      const int64_t id = table[i * block_table.stride(0) + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode_attention: block id out of range");
    }
  }
  at::Tensor out = at::empty({rows, heads * hd}, q.options());
  if (rows == 0) return out;
  const float sc = static_cast<float>(scale);
  const c10::BFloat16* sp = quantized ? kv_scales->data_ptr<c10::BFloat16>() : nullptr;
  auto run = [&](auto qzero, auto czero) {
    using T = decltype(qzero);
    using C = decltype(czero);
    paged_decode_impl<T, C>(q.data_ptr<T>(), q.stride(0), static_cast<const C*>(kv_cache.data_ptr()), num_blocks,
                            block_size, kvh, hd, heads, table, block_table.stride(0), ctx, rows, sc,
                            out.data_ptr<T>(), window, static_cast<float>(softcap), sp);
  };
  auto run_cache = [&](auto qzero) {
    if (kv_cache.scalar_type() == at::kChar) {
      run(qzero, int8_t{});
    } else if (kv_cache.scalar_type() == at::kFloat8_e4m3fn) {
      run(qzero, E4M3{});
    } else {
      run(qzero, qzero);
    }
  };
  if (q.scalar_type() == at::kFloat) {
    run_cache(float{});
  } else if (q.scalar_type() == at::kBFloat16) {
    run_cache(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "paged_decode_attention: dtype must be float32 or bfloat16 (cache: those, int8 or "
                "float8_e4m3fn)");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(iterserve_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor context_lens, "
        "float scale, int window=0, float softcap=0.0, Tensor? kv_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }
