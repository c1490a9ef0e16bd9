// The many-row int8-activation GEMM for Q8_0- and Q4_0-like layouts (8 or 4 bits, one
// float scale per 32 weights, no mins): 16 output rows side by side, one per lane of a
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
// d), s_w * s_x, acc) from 0, d the exact integer dot of the block: the same bits
// whatever the number of input rows, the tiles or the threads (the rows past the last
// whole tile of 16 are computed the same way one at a time).
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
constexpr int kLaneBlock = 32;   // weights per scale

// Whether the lane GEMM takes the layout: 8 or 4 bits, one float32 / float16 scale per 32.
inline bool lanes_ok(const Args& a) {
  return (a.bits == 8 || a.bits == 4) && a.group == kLaneBlock && a.m == nullptr && !a.sb &&
         (a.st == kF32 || a.st == kF16) && a.in % kLaneBlock == 0;
}

inline int lane_of(int row) { return 4 * (row % 4) + row / 4; }  // its own inverse

// The input as the lane GEMM reads it: per row and 32-element block, the int8 values
// (as prep_vnni rounds them, in natural order), the block's scale, and the integer the
// block's dot starts from (minus the weights' offset, 8 or 128, times the values' sum).
struct LaneInput {
  int8_t* xq;     // [rows, in]
  float* dx;      // [rows, in / 32]
  int32_t* init;  // [rows, in / 32]
};

inline void prep_lanes(const float* x, int64_t R, int64_t in, int64_t bits, const LaneInput& p) {
  const int64_t blocks = in / kLaneBlock;
  const int32_t k = bits == 8 ? 128 : 8;
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
      p.dx[r * blocks + b] = amax / 127.f;
      p.init[r * blocks + b] = -k * _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
}

// Rows p + i * stride (i < 16), 16 bytes each, as V[m]: lane lane_of(i) holds dword m of row i.
inline void load_slice(const uint8_t* p, int64_t stride, __m512i V[4]) {
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
// each row's weights 4k .. 4k + 3 of the block.
template <int BITS>
inline void load_block(const uint8_t* q, int64_t rb, int64_t b, __m512i W[8]) {
  if constexpr (BITS == 4) {  // byte j: element j (low nibble), j + 16 (high)
    __m512i V[4];
    load_slice(q + 16 * b, rb, V);
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int m = 0; m < 4; ++m) {
      W[m] = _mm512_and_si512(V[m], nib);
      W[4 + m] = _mm512_and_si512(_mm512_srli_epi16(V[m], 4), nib);
    }
  } else {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    load_slice(q + 32 * b, rb, W);
    load_slice(q + 32 * b + 16, rb, W + 4);
    for (int k = 0; k < 8; ++k) W[k] = _mm512_xor_si512(W[k], flip);
  }
}

// y[r * ys + o + i] = x[r] . w[o + i] for i < 16, r < R: the 16 weight rows from o, their
// scales ws [blocks][16] in lane order.
template <int R, int BITS>
inline void lane_tile(const uint8_t* q, int64_t rb, int64_t in, const float* ws, const LaneInput& p, float* y,
                      int64_t ys) {
  const int64_t blocks = in / kLaneBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i W[8];
    load_block<BITS>(q, rb, b, W);
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
    }
  }
  const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ys, _mm512_permutexvar_ps(perm, acc[r]));
}

// Output rows [t0 * 16, t1 * 16)'s scales as float32 in lane order, ws [t1 - t0][blocks][16].
template <typename S>
inline void lane_scales(const Args& a, int64_t t0, int64_t t1, float* ws) {
  const int64_t blocks = a.in / kLaneBlock;
  const S* s = static_cast<const S*>(a.s);
  for (int64_t t = t0; t < t1; ++t)
    for (int i = 0; i < kLaneRows; ++i) {
      const S* row = s + (t * kLaneRows + i) * blocks;
      float* w = ws + (t - t0) * blocks * kLaneRows + lane_of(i);
      for (int64_t b = 0; b < blocks; ++b) w[b * kLaneRows] = sc(row, b);
    }
}

// One output row o against R input rows, one at a time, in the lanes' order of operations.
template <int BITS, typename S>
inline void lane_row(const Args& a, int64_t o, const LaneInput& p, int64_t rows, float* y) {
  const int64_t blocks = a.in / kLaneBlock, rb = row_bytes(BITS, a.in);
  const uint8_t* q = static_cast<const uint8_t*>(a.q) + o * rb;
  const S* s = static_cast<const S*>(a.s) + o * blocks;
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
        } else {
          w = static_cast<uint8_t>(reinterpret_cast<const int8_t*>(q)[32 * b + e] ^ 0x80);
        }
        d += w * x[e];
      }
      acc = std::fma(static_cast<float>(d), sc(s, b) * p.dx[r * blocks + b], acc);
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
  const LaneInput p{xq.data(), dx.data(), init.data()};
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    prep_lanes(x + r0 * in, r1 - r0, in, a.bits,
               LaneInput{p.xq + r0 * in, p.dx + r0 * blocks, p.init + r0 * blocks});
  });
  const int64_t tiles = a.out / kLaneRows;
  // Tiles per L2 block: ~128 KB of packed weight, its scales and a pass's input beside it.
  const int64_t per_block = std::max<int64_t>(1, (int64_t(128) << 10) / (kLaneRows * rb));
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  dispatch_scale(a.st, [&](auto zero) {
    using S = decltype(zero);
    auto run = [&](auto bits) {
      constexpr int B = decltype(bits)::value;
      at::parallel_for(0, tiles, std::max<int64_t>(1, (tiles + threads - 1) / threads), [&](int64_t t0, int64_t t1) {
        std::vector<float> ws(per_block * blocks * kLaneRows);
        for (int64_t b0 = t0; b0 < t1; b0 += per_block) {
          const int64_t b1 = std::min(t1, b0 + per_block);
          lane_scales<S>(a, b0, b1, ws.data());
          for (int64_t r0 = 0; r0 < rows; r0 += kLaneInRows) {
            const int64_t n = std::min<int64_t>(kLaneInRows, rows - r0);
            const LaneInput pr{p.xq + r0 * in, p.dx + r0 * blocks, p.init + r0 * blocks};
            for (int64_t t = b0; t < b1; ++t) {
              const uint8_t* q = static_cast<const uint8_t*>(a.q) + t * kLaneRows * rb;
              const float* w = ws.data() + (t - b0) * blocks * kLaneRows;
              float* yt = y + r0 * a.out + t * kLaneRows;
              switch (n) {
#define LANE_CASE(N) case N: lane_tile<N, B>(q, rb, in, w, pr, yt, a.out); break;
                LANE_CASE(12) LANE_CASE(11) LANE_CASE(10) LANE_CASE(9) LANE_CASE(8) LANE_CASE(7)
                LANE_CASE(6) LANE_CASE(5) LANE_CASE(4) LANE_CASE(3) LANE_CASE(2)
                default: lane_tile<1, B>(q, rb, in, w, pr, yt, a.out); break;
#undef LANE_CASE
              }
            }
          }
        }
      });
      for (int64_t o = tiles * kLaneRows; o < a.out; ++o) lane_row<B, S>(a, o, p, rows, y);
    };
    if (a.bits == 8) run(std::integral_constant<int, 8>{});
    else run(std::integral_constant<int, 4>{});
  });
}

}  // namespace
}  // namespace iterserve_quant

#pragma GCC pop_options
