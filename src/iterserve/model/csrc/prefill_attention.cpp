// Prefill attention on AVX-512: every prefill chunk of a step in one call, each chunk's
// queries attending causally over its keys in the paged cache, in place (the chunk's
// own K/V already written there). Flash-style: tiles of 32 queries x 64 keys, the
// softmax kept online per query (running max and sum), so no score matrix is ever
// materialised and no K/V is gathered or copied (bf16 tiles are widened into a small
// float32 scratch). torch's CPU flash attention runs its two products on MKL's
// sgemm, which takes a slow path on AMD cores (about 75 GFLOP/s on two here); these
// tiles run at several times that.
//
// The layout is transposed against the usual one: queries sit in vector lanes. The
// scores S^T[key][query] come from broadcasting one K element against a row of packed
// Q^T, the softmax statistics are lane-wise maxima and sums over key rows (no
// horizontal reductions), and O^T[d][query] += V[key][d] * P^T[key][query] broadcasts
// one V element against a row of P^T. K and V are read straight from the cache rows.
//
// Built (a separate extension, -mavx512f/bw/dq/vl) only on CPUs with AVX-512; elsewhere
// prefill takes torch's flash attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>
#include <omp.h>

#include "avx512_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int kTQ = 32;  // queries per tile: two 16-lane vectors
constexpr int kTK = 64;  // keys per tile
constexpr int kKR = 8;   // key rows per step of the score micro-kernel
constexpr int kDR = 8;   // head-dim rows per step of the P.V micro-kernel

using iterserve_avx512::exp16;

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// S^T[r][0:32] = sum_d K[r][d] * Q^T[d][0:32] for R key rows.
template <int R>
inline void scores(const float* const* kp, const float* qt, int64_t hd, float* s) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd; ++d) {
    const __m512 q0 = _mm512_loadu_ps(qt + d * kTQ), q1 = _mm512_loadu_ps(qt + d * kTQ + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 k = _mm512_set1_ps(kp[r][d]);
      a0[r] = _mm512_fmadd_ps(k, q0, a0[r]);
      a1[r] = _mm512_fmadd_ps(k, q1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * kTQ, a0[r]);
    _mm512_storeu_ps(s + r * kTQ + 16, a1[r]);
  }
}

// O^T[d0:d0+8][0:32] = O^T * alpha + sum_j V[j][d0:d0+8] (x) P^T[j][0:32].
inline void accumulate(float* ot, const float* const* vp, int64_t d0, const float* p, int tk, __m512 al0,
                       __m512 al1) {
  __m512 a0[kDR], a1[kDR];
  for (int r = 0; r < kDR; ++r) {
    a0[r] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + r) * kTQ), al0);
    a1[r] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + r) * kTQ + 16), al1);
  }
  for (int j = 0; j < tk; ++j) {
    const __m512 p0 = _mm512_loadu_ps(p + j * kTQ), p1 = _mm512_loadu_ps(p + j * kTQ + 16);
    const float* v = vp[j] + d0;
    for (int r = 0; r < kDR; ++r) {
      const __m512 b = _mm512_set1_ps(v[r]);
      a0[r] = _mm512_fmadd_ps(b, p0, a0[r]);
      a1[r] = _mm512_fmadd_ps(b, p1, a1[r]);
    }
  }
  for (int r = 0; r < kDR; ++r) {
    _mm512_storeu_ps(ot + (d0 + r) * kTQ, a0[r]);
    _mm512_storeu_ps(ot + (d0 + r) * kTQ + 16, a1[r]);
  }
}

struct Chunk {
  int64_t q_start, n, c;  // rows [q_start, q_start + n) of q, on c cached tokens
  const int64_t* blocks;  // its block ids
};

struct Item {
  int64_t chunk, kv_head, q0, cost;
};

// Per-thread scratch for one (chunk, KV head, query tile) item and its group of heads.
struct Scratch {
  std::vector<float> qt, ot, s, m, l, kf, vf;
  std::vector<const float*> kp, vp;
  Scratch(int64_t group, int64_t hd)
      : qt(group * hd * kTQ), ot(group * hd * kTQ), s(kTK * kTQ), m(group * kTQ), l(group * kTQ),
        kf(kTK * hd), vf(kTK * hd), kp(kTK), vp(kTK) {}
};

// Widens a bf16 cache row into float32 scratch (16 at a time: zero-extend, shift up).
inline void widen(const c10::BFloat16* src, float* dst, int64_t hd, float) {
  for (int64_t d = 0; d < hd; d += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
    _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
}

// An 8-bit cache row (model/kv_quant.py) into float32 scratch, times its scale: int8
// sign-extended and converted; e4m3 moved into float16 bits (sign to bit 15, exponent
// and mantissa to bits 7-13: the e4m3 value / 256, subnormals included) and widened.
struct E4M3 {
  uint8_t bits;
};
inline void widen(const int8_t* src, float* dst, int64_t hd, float s) {
  const __m512 sv = _mm512_set1_ps(s);
  for (int64_t d = 0; d < hd; d += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
    _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), sv));
  }
}
inline void widen(const E4M3* src, float* dst, int64_t hd, float s) {
  const __m512 sv = _mm512_set1_ps(s * 256.f);
  for (int64_t d = 0; d < hd; d += 16) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m256i h = _mm256_or_si256(sign, _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtph_ps(h), sv));
  }
}

// Lanes (queries i = lane) that see a key `rel` = key - first positions past the tile's
// first query: i >= rel (causal) and, with a window, i < rel + window.
inline __mmask16 visible(__m512i lane, int64_t rel, int64_t window) {
  __mmask16 m = _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(std::max<int64_t>(rel, 0))));
  if (window > 0) m &= _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(rel + window)));
  return m;
}

// T: q's and out's dtype; C: the cache's (T, or int8_t / E4M3 with per-row scales
// ks / vs, [blocks * block_size, kv_heads] each).
template <typename T, typename C>
void attend_item(const Item& it, const Chunk& ch, const T* q, int64_t q_stride, const C* kc, const C* vc,
                 int64_t block_size, int64_t kvh, int64_t hd, int64_t group, float scale, T* out,
                 int64_t out_stride, Scratch& w, int64_t window, float softcap, const c10::BFloat16* ks,
                 const c10::BFloat16* vs) {
  const int64_t h0 = it.kv_head * group;
  const int64_t tq = std::min<int64_t>(kTQ, ch.n - it.q0);
  // Pack Q^T (scaled) per head; lanes past the chunk's end stay zero.
  std::fill(w.qt.begin(), w.qt.end(), 0.0f);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < tq; ++i) {
      const T* row = q + (ch.q_start + it.q0 + i) * q_stride + (h0 + g) * hd;
      float* dst = w.qt.data() + g * hd * kTQ + i;
      for (int64_t d = 0; d < hd; ++d) dst[d * kTQ] = to_float(row[d]) * scale;
    }
  std::fill(w.ot.begin(), w.ot.end(), 0.0f);
  std::fill(w.m.begin(), w.m.end(), -INFINITY);
  std::fill(w.l.begin(), w.l.end(), 0.0f);

  const int64_t first = ch.c + it.q0;       // the tile's first query sees keys [0, first]
  const int64_t kend = first + tq;          // ... its last, keys [0, kend)
  const __m512i lane0 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i lane1 = _mm512_add_epi32(lane0, _mm512_set1_epi32(16));
  const int64_t row_stride = kvh * hd;
  // A window of `window` keys: query i sees keys (first + i - window, first + i], so the
  // tile's keys start where its first query's window does (that query sees key j0, and
  // every later one a key of the first key tile: the maxima stay finite).
  const int64_t kstart = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
  for (int64_t j0 = kstart; j0 < kend; j0 += kTK) {
    const int tk = static_cast<int>(std::min<int64_t>(kTK, kend - j0));
    for (int j = 0; j < tk; ++j) {
      const int64_t pos = j0 + j;
      const int64_t slot = ch.blocks[pos / block_size] * block_size + pos % block_size;
      const int64_t off = slot * row_stride + it.kv_head * hd;
      if constexpr (std::is_same<C, float>::value) {
        w.kp[j] = kc + off;
        w.vp[j] = vc + off;
      } else {
        const int64_t si = slot * kvh + it.kv_head;
        widen(kc + off, w.kf.data() + j * hd, hd, ks ? static_cast<float>(ks[si]) : 1.f);
        widen(vc + off, w.vf.data() + j * hd, hd, vs ? static_cast<float>(vs[si]) : 1.f);
        w.kp[j] = w.kf.data() + j * hd;
        w.vp[j] = w.vf.data() + j * hd;
      }
    }
    // Keys past `first` are hidden from some lanes: query i sees key j iff j - first <= i
    // (and, with a window, i < j - first + window).
    const bool partial = j0 + tk - 1 > first || (window > 0 && j0 - first + window < kTQ);
    for (int64_t g = 0; g < group; ++g) {
      const float* qt = w.qt.data() + g * hd * kTQ;
      float* s = w.s.data();
      int j = 0;
      for (; j + kKR <= tk; j += kKR) scores<kKR>(w.kp.data() + j, qt, hd, s + j * kTQ);
      for (; j < tk; ++j) scores<1>(w.kp.data() + j, qt, hd, s + j * kTQ);
      if (softcap > 0.f)
        for (int64_t e = 0; e < tk * kTQ; ++e) s[e] = softcap * std::tanh(s[e] / softcap);

      float* m = w.m.data() + g * kTQ;
      float* l = w.l.data() + g * kTQ;
      const __m512 mold0 = _mm512_loadu_ps(m), mold1 = _mm512_loadu_ps(m + 16);
      __m512 mx0 = mold0, mx1 = mold1;
      for (j = 0; j < tk; ++j) {
        __m512 s0 = _mm512_loadu_ps(s + j * kTQ), s1 = _mm512_loadu_ps(s + j * kTQ + 16);
        if (partial) {
          const __mmask16 v0 = visible(lane0, j0 + j - first, window), v1 = visible(lane1, j0 + j - first, window);
          s0 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), v0, s0);
          s1 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), v1, s1);
          _mm512_storeu_ps(s + j * kTQ, s0);
          _mm512_storeu_ps(s + j * kTQ + 16, s1);
        }
        mx0 = _mm512_max_ps(mx0, s0);
        mx1 = _mm512_max_ps(mx1, s1);
      }
      // Key 0 is visible to every query and comes first, so the maxima are finite here.
      const __m512 al0 = exp16(_mm512_sub_ps(mold0, mx0)), al1 = exp16(_mm512_sub_ps(mold1, mx1));
      __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
      for (j = 0; j < tk; ++j) {
        __m512 p0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j * kTQ), mx0));
        __m512 p1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j * kTQ + 16), mx1));
        if (partial) {
          p0 = _mm512_maskz_mov_ps(visible(lane0, j0 + j - first, window), p0);
          p1 = _mm512_maskz_mov_ps(visible(lane1, j0 + j - first, window), p1);
        }
        _mm512_storeu_ps(s + j * kTQ, p0);
        _mm512_storeu_ps(s + j * kTQ + 16, p1);
        sum0 = _mm512_add_ps(sum0, p0);
        sum1 = _mm512_add_ps(sum1, p1);
      }
      _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), al0, sum0));
      _mm512_storeu_ps(l + 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16), al1, sum1));
      _mm512_storeu_ps(m, mx0);
      _mm512_storeu_ps(m + 16, mx1);
      float* ot = w.ot.data() + g * hd * kTQ;
      for (int64_t d0 = 0; d0 < hd; d0 += kDR) accumulate(ot, w.vp.data(), d0, s, tk, al0, al1);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float* ot = w.ot.data() + g * hd * kTQ;
    const float* l = w.l.data() + g * kTQ;
    for (int64_t i = 0; i < tq; ++i) {
      T* dst = out + (ch.q_start + it.q0 + i) * out_stride + (h0 + g) * hd;
      const float inv = 1.0f / l[i];
      for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<T>(ot[d * kTQ + i] * inv);
    }
  }
}

template <typename T, typename C>
void prefill_impl(const std::vector<Chunk>& chunks, const T* q, int64_t q_stride, const C* kv,
                  int64_t num_blocks, int64_t block_size, int64_t kvh, int64_t hd, int64_t heads, float scale,
                  T* out, int64_t window, float softcap, const c10::BFloat16* scales) {
  std::vector<Item> items;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c)
    for (int64_t h = 0; h < kvh; ++h)
      for (int64_t q0 = 0; q0 < chunks[c].n; q0 += kTQ) items.push_back({c, h, q0, chunks[c].c + q0 + kTQ});
  // Costs differ by the causal triangle and the prefix: the longest first, taken dynamically.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const C* kc = kv;
  const C* vc = kv + num_blocks * block_size * kvh * hd;
  const c10::BFloat16* ks = scales;
  const c10::BFloat16* vs = scales ? scales + num_blocks * block_size * kvh : nullptr;
  const int64_t group = heads / kvh;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items)));
#pragma omp parallel num_threads(nt)
  {
    Scratch w(group, hd);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i)
      attend_item<T, C>(items[i], chunks[items[i].chunk], q, q_stride, kc, vc, block_size, kvh, hd, group, scale,
                        out, heads * hd, w, window, softcap, ks, vs);
  }
}

// q: [tokens, heads, head_dim] (rows may be strided: a view of the fused qkv output);
// kv_cache: [2, blocks, block_size, kv_heads, head_dim], already holding the chunks'
// K/V; block_table: [chunks, max_blocks] int64; query_start: [chunks + 1] int64, chunk
// i's rows of q being [query_start[i], query_start[i + 1]); num_computed: [chunks]
// int64, its cached tokens; window > 0: each query sees only its last `window` keys;
// softcap > 0: scores capped as softcap * tanh(s / softcap); kv_scales: an 8-bit (int8
// / float8_e4m3fn) cache's bfloat16 [2, blocks, block_size, kv_heads] per-row scales.
// Returns [tokens, heads * head_dim] in q's dtype.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                             const at::Tensor& query_start, const at::Tensor& num_computed, double scale,
                             int64_t window, double softcap, const c10::optional<at::Tensor>& kv_scales) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "prefill_attention: kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kvh = kv_cache.size(3), hd = kv_cache.size(4);
  TORCH_CHECK(hd % 16 == 0 && hd <= 256, "prefill_attention: head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == hd && q.stride(2) == 1 && q.stride(1) == hd,
              "prefill_attention: q must be [tokens, heads, head_dim], each row contiguous");
  const int64_t tokens = q.size(0), heads = q.size(1);
  TORCH_CHECK(heads % kvh == 0, "prefill_attention: heads must be a multiple of kv_heads");
  const bool quantized = kv_cache.scalar_type() == at::kChar || kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(quantized || q.scalar_type() == kv_cache.scalar_type(), "prefill_attention: q and cache dtypes differ");
  TORCH_CHECK(!quantized || (kv_scales.has_value() && kv_scales->scalar_type() == at::kBFloat16 &&
                             kv_scales->is_contiguous() && kv_scales->dim() == 4 && kv_scales->size(0) == 2 &&
                             kv_scales->size(1) == num_blocks && kv_scales->size(2) == block_size &&
                             kv_scales->size(3) == kvh),
              "prefill_attention: an 8-bit cache needs contiguous bfloat16 kv_scales "
              "[2, blocks, block_size, kv_heads]");
  const int64_t n_chunks = block_table.size(0);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.stride(1) == 1,
              "prefill_attention: block_table must be int64 [chunks, max_blocks]");
  TORCH_CHECK(query_start.scalar_type() == at::kLong && query_start.is_contiguous() &&
                  query_start.numel() == n_chunks + 1,
              "prefill_attention: query_start must be contiguous int64 [chunks + 1]");
  TORCH_CHECK(num_computed.scalar_type() == at::kLong && num_computed.is_contiguous() &&
                  num_computed.numel() == n_chunks,
              "prefill_attention: num_computed must be contiguous int64 [chunks]");
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* comp = num_computed.data_ptr<int64_t>();
  const int64_t width = block_table.size(1);
  TORCH_CHECK(qs[0] == 0 && qs[n_chunks] == tokens, "prefill_attention: query_start must run from 0 to ",
              tokens);
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < n_chunks; ++i) {
    const int64_t n = qs[i + 1] - qs[i], ctx = comp[i] + n;
    TORCH_CHECK(n >= 1 && comp[i] >= 0, "prefill_attention: chunk ", i, " is empty or has a negative prefix");
    TORCH_CHECK(ctx <= width * block_size, "prefill_attention: context ", ctx, " of chunk ", i,
                " does not fit its block table");
    const int64_t* ids = block_table.data_ptr<int64_t>() + i * block_table.stride(0);
    for (int64_t b = 0, nb = (ctx + block_size - 1) / block_size; b < nb; ++b)
      TORCH_CHECK(ids[b] >= 0 && ids[b] < num_blocks, "prefill_attention: block id out of range");
    chunks.push_back({qs[i], n, comp[i], ids});
  }
  at::Tensor out = at::empty({tokens, heads * hd}, q.options());
  if (tokens == 0) return out;
  const float sc = static_cast<float>(scale);
  const c10::BFloat16* sp = quantized ? kv_scales->data_ptr<c10::BFloat16>() : nullptr;
  auto run = [&](auto qzero, auto czero) {
    using T = decltype(qzero);
    using C = decltype(czero);
    prefill_impl<T, C>(chunks, q.data_ptr<T>(), q.stride(0), static_cast<const C*>(kv_cache.data_ptr()),
                       num_blocks, block_size, kvh, hd, heads, sc, out.data_ptr<T>(), window,
                       static_cast<float>(softcap), sp);
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
    TORCH_CHECK(false, "prefill_attention: dtype must be float32 or bfloat16 (cache: those, int8 or "
                "float8_e4m3fn)");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(iterserve_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor query_start, "
        "Tensor num_computed, float scale, int window=0, float softcap=0.0, Tensor? kv_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) { m.impl("prefill_attention", prefill_attention); }
