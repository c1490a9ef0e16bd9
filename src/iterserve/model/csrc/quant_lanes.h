// The many-row int8-activation GEMM for the layouts whose groups are whole 32-element
// blocks (8 and 4 bits: Q8_0, Q4_0, Q4_K; int8 / int4 at load, AWQ, GPTQ,
// compressed-tensors; 6 bits: Q5_0): 16 output rows side by side, one per lane of a
// register, so that one vpdpbusd makes 4 products for each of 16 output rows and a
// 32-element block's integer dot of an input row with 16 weight rows is 8 of them,
// scaled once (one convert, one multiply, one add for 16 outputs). The per-chunk
// kernels (quant_tile.h, row_vnni) scale every 64 products of one output row, so
// three float operations stand beside each vpdpbusd there and under one here.
//
// The weights stay in their packed row layout (packed.py). Each 16 x 16-byte slice (16
// rows, one 4-bit block or half an 8-bit one) is turned into 4 registers by a 4 x 4
// transpose of dwords within 128-bit lanes; the lane of output row 4a + i is 4i + a
// (kLanePerm, its own inverse), undone by one permute per stored register. The slice
// is turned once per tile of up to kLaneInRows input rows.
//
// Per (input row, output row) the result is, block by block in order, acc = fma(float(
// d), s_w * s_x, acc) from 0, d the exact integer dot of the block, and with mins then
// acc = fma(-m_w, sum(x), acc): the same bits whatever the number of input
// rows, the tiles or the threads (the rows past the last whole tile of 16 are computed
// the same way one at a time).
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "quant_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")

namespace iterserve_quant {
namespace {

constexpr int kLaneRows = 16;    // output rows per register
constexpr int kLaneInRows = 12;  // input rows per pass over a slice (accumulators in registers)
constexpr int kLaneBlock = 32;   // input elements per int8 scale (and per integer dot)

// Whether the lane GEMM takes the layout: groups of whole blocks (6 bits: no mins, whole
// 64-element chunks; so Q5_0, not Q6_K's groups of 16).
inline bool lanes_ok(const Args& a) {
  if (a.bits == 6) return !a.m && a.group % kLaneBlock == 0 && a.in % 64 == 0 && a.in % a.group == 0;
  return (a.bits == 8 || a.bits == 4) && a.group % kLaneBlock == 0 && a.in % a.group == 0;
}

inline int lane_of(int row) { return 4 * (row % 4) + row / 4; }  // its own inverse

// The input as the lane GEMM reads it: per row and 32-element block, the int8 values
// (as prep_vnni rounds them, in natural order), the block's scale, the integer the
// block's dot starts from (minus the weights' code offset, 128 for 8 bits, 32 for 6,
// 8 for 4 bits without mins, times the values' sum), and the float input's sum over the block
// (what the mins multiply, as the few-row kernels' group sums).
struct LaneInput {
  int8_t* xq;     // [rows, in]
  float* dx;      // [rows, in / 32]
  int32_t* init;  // [rows, in / 32]
  float* xs;      // [rows, in / 32]
};

inline void prep_lanes(const float* x, int64_t R, int64_t in, int64_t bits, bool mins, const LaneInput& p) {
  const int64_t blocks = in / kLaneBlock;
  const int32_t k = bits == 8 ? 128 : bits == 6 ? 32 : mins ? 0 : 8;
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * in + kLaneBlock * b;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i i0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), lo), hi);
      const __m512i i1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)), lo), hi);
      int8_t* q = p.xq + r * in + kLaneBlock * b;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(i0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(i1));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
      p.dx[r * blocks + b] = amax / 127.f;
      p.init[r * blocks + b] = -k * sum;
      p.xs[r * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    }
}

// Rows p + i * stride (i < 16), 16 bytes each, as V[m]: lane lane_of(i) holds dword m of row i.
__attribute__((always_inline)) inline void load_slice(const uint8_t* p, int64_t stride, __m512i V[4]) {
  __m512i z[4];
  for (int a = 0; a < 4; ++a) {
    const uint8_t* r = p + 4 * a * stride;
    __m512i t = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
    t = _mm512_inserti32x4(t, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + stride)), 1);
    t = _mm512_inserti32x4(t, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2 * stride)), 2);
    z[a] = _mm512_inserti32x4(t, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 3 * stride)), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  V[0] = _mm512_unpacklo_epi64(t0, t2);
  V[1] = _mm512_unpackhi_epi64(t0, t2);
  V[2] = _mm512_unpacklo_epi64(t1, t3);
  V[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Block b of 16 weight rows from q (row stride rb) as the unsigned operand: W[k] holds
// each row's weights 4k .. 4k + 3 of the block. 6 bits: an even block's call also
// unpacks the odd block after it into `next` (the same three slices hold both), which
// the odd block's call takes as it is; blocks come in order, in pairs (in % 64 == 0).
template <int BITS>
__attribute__((always_inline)) inline void load_block(const uint8_t* q, int64_t rb, int64_t b, __m512i W[8],
                                                      __m512i next[8]) {
  if constexpr (BITS == 4) {  // byte j: element j (low nibble), j + 16 (high)
    __m512i V[4];
    load_slice(q + 16 * b, rb, V);
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int m = 0; m < 4; ++m) {
      W[m] = _mm512_and_si512(V[m], nib);
      W[4 + m] = _mm512_and_si512(_mm512_srli_epi16(V[m], 4), nib);
    }
  } else if constexpr (BITS == 6) {
    // Block b is half of 64-element chunk b / 2 (48 bytes: 32 of low nibbles, element
    // j's low, j + 32's high; 16 of top bit pairs, elements j, j + 16, j + 32, j + 48).
    // Byte shifts go through 16-bit ones: the masks drop what crosses a byte.
    if (b % 2) {
      for (int k = 0; k < 8; ++k) W[k] = next[k];
      return;
    }
    __m512i L0[4], L1[4], H[4];
    const uint8_t* c = q + 48 * (b / 2);
    load_slice(c, rb, L0);
    load_slice(c + 16, rb, L1);
    load_slice(c + 32, rb, H);
    const __m512i nib = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    for (int m = 0; m < 4; ++m) {
      // Elements 32..63 (the odd block): high nibbles; top bits 4-5 (j + 32), 6-7 (j + 48).
      next[m] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L0[m], 4), nib), _mm512_and_si512(H[m], top));
      next[4 + m] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L1[m], 4), nib),
                                    _mm512_and_si512(_mm512_srli_epi16(H[m], 2), top));
      // Elements 0..31: low nibbles; top bits 0-1 (j), 2-3 (j + 16).
      W[m] = _mm512_or_si512(_mm512_and_si512(L0[m], nib), _mm512_and_si512(_mm512_slli_epi16(H[m], 4), top));
      W[4 + m] = _mm512_or_si512(_mm512_and_si512(L1[m], nib), _mm512_and_si512(_mm512_slli_epi16(H[m], 2), top));
    }
  } else {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    load_slice(q + 32 * b, rb, W);
    load_slice(q + 32 * b + 16, rb, W + 4);
    for (int k = 0; k < 8; ++k) W[k] = _mm512_xor_si512(W[k], flip);
  }
}

// y[r * ys + o + i] = x[r] . w[o + i] for i < 16, r < R: the 16 weight rows from o, their
// scales ws [blocks][16] in lane order (and with MINS their mins wm, the same shape).
template <int R, int BITS, bool MINS>
inline void lane_tile(const uint8_t* q, int64_t rb, int64_t in, const float* ws, const float* wm,
                      const LaneInput& p, float* y, int64_t ys) {
  const int64_t blocks = in / kLaneBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512i next[8];  // 6 bits: the odd block, unpacked with the even one before it
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i W[8];
    load_block<BITS>(q, rb, b, W, next);
    const __m512 sv = _mm512_loadu_ps(ws + kLaneRows * b);
    for (int r = 0; r < R; ++r) {
      const int32_t* xd = reinterpret_cast<const int32_t*>(p.xq + r * in + kLaneBlock * b);
      __m512i d0 = _mm512_set1_epi32(p.init[r * blocks + b]), d1 = _mm512_setzero_si512();
      for (int k = 0; k < 8; k += 2) {  // two chains: half the latency
        d0 = _mm512_dpbusd_epi32(d0, W[k], _mm512_set1_epi32(xd[k]));
        d1 = _mm512_dpbusd_epi32(d1, W[k + 1], _mm512_set1_epi32(xd[k + 1]));
      }
      const __m512 s = _mm512_mul_ps(sv, _mm512_set1_ps(p.dx[r * blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), s, acc[r]);
      if constexpr (MINS)
        acc[r] = _mm512_fnmadd_ps(_mm512_loadu_ps(wm + kLaneRows * b), _mm512_set1_ps(p.xs[r * blocks + b]), acc[r]);
    }
  }
  const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ys, _mm512_permutexvar_ps(perm, acc[r]));
}

// Output rows [t0 * 16, t1 * 16)'s scales (times their bases) as float32 per block in
// lane order, ws [t1 - t0][blocks][16], and their mins the same way into wm: 16 groups
// of a row at a time, scattered to their blocks (the values group_scale computes).
template <int BITS, typename S>
inline void lane_scales(const Args& a, int64_t t0, int64_t t1, float* ws, float* wm) {
  const int64_t blocks = a.in / kLaneBlock, groups = a.in / a.group, per = a.group / kLaneBlock;
  const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(kLaneRows * per)));
  for (int64_t t = t0; t < t1; ++t)
    for (int i = 0; i < kLaneRows; ++i) {
      const int64_t o = t * kLaneRows + i;
      const S* s = static_cast<const S*>(a.s) + o * groups;
      const S* mn = a.m ? static_cast<const S*>(a.m) + o * groups : nullptr;
      const Base sb = a.sb.from(o * (a.in / 256)), mb = a.mb.from(o * (a.in / 256));
      const int64_t at = (t - t0) * blocks * kLaneRows + lane_of(i);
      for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 m = tail_mask(groups - g);
        const __m512 v = load_scales16(s, g, m, sb, a.group);
        for (int64_t c = 0; c < per; ++c)
          _mm512_mask_i32scatter_ps(ws + at + (g * per + c) * kLaneRows, m, stride, v, 4);
        if (mn) {
          const __m512 u = load_scales16(mn, g, m, mb, a.group);
          for (int64_t c = 0; c < per; ++c)
            _mm512_mask_i32scatter_ps(wm + at + (g * per + c) * kLaneRows, m, stride, u, 4);
        }
      }
    }
}

// One output row o against R input rows, one at a time, in the lanes' order of operations.
template <int BITS, typename S>
inline void lane_row(const Args& a, int64_t o, const LaneInput& p, int64_t rows, float* y) {
  const int64_t blocks = a.in / kLaneBlock, rb = row_bytes(BITS, a.in), groups = a.in / a.group;
  const uint8_t* q = static_cast<const uint8_t*>(a.q) + o * rb;
  std::vector<float> sw(blocks), mw(blocks);
  {
    const S* s = static_cast<const S*>(a.s) + o * groups;
    const S* mn = a.m ? static_cast<const S*>(a.m) + o * groups : nullptr;
    const Base sb = a.sb.from(o * (a.in / 256)), mb = a.mb.from(o * (a.in / 256));
    for (int64_t b = 0; b < blocks; ++b) group_scale<BITS, S>(a, s, mn, sb, mb, b * kLaneBlock / a.group, sw[b], mw[b]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t d = p.init[r * blocks + b];
      const int8_t* x = p.xq + r * a.in + kLaneBlock * b;
      for (int e = 0; e < kLaneBlock; ++e) {
        int w;
        if constexpr (BITS == 4) {
          const uint8_t c = q[16 * b + e % 16];
          w = e < 16 ? (c & 15) : (c >> 4);
        } else if constexpr (BITS == 6) {
          const uint8_t* c = q + 48 * (b / 2);
          const int pos = 32 * (b % 2) + e;  // within the 64-element chunk
          const int low = pos < 32 ? (c[pos] & 15) : (c[pos - 32] >> 4);
          w = low | (((c[32 + pos % 16] >> (2 * (pos / 16))) & 3) << 4);
        } else {
          w = static_cast<uint8_t>(reinterpret_cast<const int8_t*>(q)[32 * b + e] ^ 0x80);
        }
        d += w * x[e];
      }
      acc = std::fma(static_cast<float>(d), sw[b] * p.dx[r * blocks + b], acc);
      if (a.m) acc = std::fma(-mw[b], p.xs[r * blocks + b], acc);
    }
    y[r * a.out + o] = acc;
  }
}

// y [rows, out] = x W^T on the lane GEMM; x float32 [rows, in].
inline void gemm_lanes(const Args& a, const float* x, int64_t rows, float* y) {
  const int64_t in = a.in, blocks = in / kLaneBlock, rb = row_bytes(a.bits, in);
  std::vector<int8_t> xq(rows * in);
  std::vector<float> dx(rows * blocks);
  std::vector<int32_t> init(rows * blocks);
  std::vector<float> xs(rows * blocks);
  const LaneInput p{xq.data(), dx.data(), init.data(), xs.data()};
  auto from = [&](int64_t r0) {
    return LaneInput{p.xq + r0 * in, p.dx + r0 * blocks, p.init + r0 * blocks, p.xs + r0 * blocks};
  };
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    prep_lanes(x + r0 * in, r1 - r0, in, a.bits, a.m != nullptr, from(r0));
  });
  const int64_t tiles = a.out / kLaneRows;
  // Tiles per L2 block: ~128 KB of packed weight, its scales and a pass's input beside it.
  const int64_t per_block = std::max<int64_t>(1, (int64_t(128) << 10) / (kLaneRows * rb));
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // Only the scales' reading depends on their type: the tiles are instantiated per
  // bit width and mins alone (fewer copies of the hot loop, which stays inlined).
  auto scales = [&](auto bits, int64_t t0, int64_t t1, float* ws, float* wm) {
    constexpr int B = decltype(bits)::value;
    dispatch_scale(a.st, [&](auto zero) { lane_scales<B, decltype(zero)>(a, t0, t1, ws, wm); });
  };
  auto run = [&](auto bits, auto mins) {
    constexpr int B = decltype(bits)::value;
    constexpr bool M = decltype(mins)::value;
    at::parallel_for(0, tiles, std::max<int64_t>(1, (tiles + threads - 1) / threads), [&](int64_t t0, int64_t t1) {
      const int64_t per = blocks * kLaneRows;
      std::vector<float> ws(per_block * per), wm(M ? per_block * per : 1);
      for (int64_t b0 = t0; b0 < t1; b0 += per_block) {
        const int64_t b1 = std::min(t1, b0 + per_block);
        scales(bits, b0, b1, ws.data(), wm.data());
        for (int64_t r0 = 0; r0 < rows; r0 += kLaneInRows) {
          const int64_t n = std::min<int64_t>(kLaneInRows, rows - r0);
          const LaneInput pr = from(r0);
          for (int64_t t = b0; t < b1; ++t) {
            const uint8_t* q = static_cast<const uint8_t*>(a.q) + t * kLaneRows * rb;
            const float* w = ws.data() + (t - b0) * per;
            const float* m = M ? wm.data() + (t - b0) * per : nullptr;
            float* yt = y + r0 * a.out + t * kLaneRows;
            switch (n) {
#define LANE_CASE(N) case N: lane_tile<N, B, M>(q, rb, in, w, m, pr, yt, a.out); break;
              LANE_CASE(12) LANE_CASE(11) LANE_CASE(10) LANE_CASE(9) LANE_CASE(8) LANE_CASE(7)
              LANE_CASE(6) LANE_CASE(5) LANE_CASE(4) LANE_CASE(3) LANE_CASE(2)
              default: lane_tile<1, B, M>(q, rb, in, w, m, pr, yt, a.out); break;
#undef LANE_CASE
            }
          }
        }
      }
    });
    if (tiles * kLaneRows < a.out)
      dispatch_scale(a.st, [&](auto zero) {
        for (int64_t o = tiles * kLaneRows; o < a.out; ++o) lane_row<B, decltype(zero)>(a, o, p, rows, y);
      });
  };
  using T = std::true_type;
  using F = std::false_type;
  if (a.bits == 8) {
    if (a.m) run(std::integral_constant<int, 8>{}, T{});
    else run(std::integral_constant<int, 8>{}, F{});
  } else if (a.bits == 6) {
    run(std::integral_constant<int, 6>{}, F{});  // lanes_ok: no mins
  } else {
    if (a.m) run(std::integral_constant<int, 4>{}, T{});
    else run(std::integral_constant<int, 4>{}, F{});
  }
}

}  // namespace
}  // namespace iterserve_quant

#pragma GCC pop_options
