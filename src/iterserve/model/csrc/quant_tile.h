// The many-row int8-activation GEMM over packed quantized weights (quant_gemm.cpp,
// kernel 2): the input quantized once per call as the few-row int8 kernel quantizes it
// (prep_vnni, quant_kernels.h), then tiles of kTileRows input rows x kTileCols output
// rows, every accumulator in a register, over a block of output rows small enough to
// stay in L2 while every row tile of the input passes over it: each weight chunk is
// read from memory once per call and widened once per row tile (not once per row).
//
// Per (output, input row) it computes what row_vnni computes, in the same order: lane
// dots by vpdpbusd started from the offset share, scaled per chunk by weight scale x
// input scale (the same two float32 factors, one multiply), summed over the chunks,
// reduced by _mm512_reduce_add_ps. So without mins the two kernels agree bit for bit;
// the mins' share (m . group sums of x) is summed 16 groups at a time here.
#pragma once
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "quant_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")

namespace iterserve_quant {
namespace {

constexpr int kTileRows = 4;
constexpr int kTileCols = 4;
// Packed weight bytes of one block of output rows (L2 holds it, its scales and a row
// tile's input).
constexpr int64_t kBlockBytes = int64_t(128) << 10;

// Weight scales per output row as float32 the tile reads: UNIT 16 / 32 one per group
// (= unit), UNIT 4 one per 64-element chunk.
template <int UNIT>
inline int64_t tile_scales_per_row(int64_t in, int64_t group) {
  return UNIT == 4 ? in / 64 : in / group;
}

// Output rows [b0, b1)'s scales into ws [b1 - b0, tile_scales_per_row] and, with mins,
// their mins (times their bases) into mf [b1 - b0, groups]: the values row_vnni uses.
template <typename S, int UNIT>
inline void tile_block_scales(const Args& a, int64_t b0, int64_t b1, float* ws, float* mf) {
  const int64_t groups = a.in / a.group, per = tile_scales_per_row<UNIT>(a.in, a.group);
  for (int64_t o = b0; o < b1; ++o) {
    const S* s = static_cast<const S*>(a.s) + o * groups;
    const Base sb = a.sb.from(o * (a.in / 256));
    float* w = ws + (o - b0) * per;
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 m = tail_mask(groups - g);
      const __m512 v = load_scales16(s, g, m, sb, a.group);
      if constexpr (UNIT != 4) {
        _mm512_mask_storeu_ps(w + g, m, v);
      } else {  // a group spans group / 64 chunks
        alignas(64) float t[16];
        _mm512_store_ps(t, v);
        const int64_t n = std::min<int64_t>(16, groups - g), cpg = a.group / 64;
        for (int64_t l = 0; l < n; ++l)
          for (int64_t c = 0; c < cpg; ++c) w[(g + l) * cpg + c] = t[l];
      }
    }
    if (a.m) {
      const S* mn = static_cast<const S*>(a.m) + o * groups;
      const Base mb = a.mb.from(o * (a.in / 256));
      for (int64_t g = 0; g < groups; ++g) {
        float mg = sc(mn, g);
        if (mb) mg *= mb[g * a.group / 256];
        mf[(o - b0) * groups + g] = mg;
      }
    }
  }
}

// y[r * ys + o + j] = x[r] . w[o + j] for r < R, j < NO, on the int8 input `p` (prep_vnni,
// R rows); ws / mf: rows o.. of tile_block_scales (mf unused without mins).
template <int R, int NO, int BITS, int UNIT>
inline void tile_vnni(const Args& a, int64_t o, const QInput& p, const float* ws, const float* mf, float* y,
                      int64_t ys) {
  const int64_t groups = a.in / a.group, chunks = a.in / 64, units = a.in / UNIT;
  const int64_t per = tile_scales_per_row<UNIT>(a.in, a.group);
  constexpr int64_t upc = UNIT == 4 ? 16 : 64 / UNIT;  // input scales per chunk
  const int64_t rb = row_bytes(BITS, a.in);
  const int8_t* q8 = static_cast<const int8_t*>(a.q) + o * a.in;
  const uint8_t* qb = static_cast<const uint8_t*>(a.q) + o * rb;
  const auto [idx, umask, shift, shift2, nib, flip, two] = unpack_consts<BITS, UNIT>();
  __m512 acc[NO][R];
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i w[NO];
    __m512 wv[NO];
    for (int j = 0; j < NO; ++j) {
      if constexpr (BITS == 8) {
        w[j] = _mm512_xor_si512(_mm512_loadu_si512(q8 + j * a.in + 64 * c), flip);
      } else if constexpr (BITS == 6) {
        const uint8_t* ch = qb + j * rb + 48 * c;
        const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch)));
        const __m512i h = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + 32)));
        w[j] = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(b, shift), nib),
                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift2), two), 4));
      } else {
        const __m512i b =
            _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + j * rb + 32 * c)));
        w[j] = _mm512_and_si512(_mm512_srlv_epi16(b, shift), nib);
      }
      if constexpr (UNIT == 4) wv[j] = _mm512_set1_ps(ws[j * per + c]);
      else wv[j] = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(umask, ws + j * per + upc * c));
    }
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_loadu_si512(p.corr + r * (a.in / 4) + 16 * c);
      const __m512i xq = _mm512_loadu_si512(p.xq + r * a.in + 64 * c);
      const __m512 xv = UNIT == 4 ? _mm512_loadu_ps(p.xsu + r * units + 16 * c)
                                  : _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(umask, p.xsu + r * units + upc * c));
      for (int j = 0; j < NO; ++j) {
        const __m512i dot = _mm512_dpbusd_epi32(corr, w[j], xq);
        acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(wv[j], xv), acc[j][r]);
      }
    }
  }
  for (int j = 0; j < NO; ++j) {
    float off[R] = {};
    if (a.m) {  // the mins' share: m . group sums of x
      for (int r = 0; r < R; ++r) {
        __m512 t = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g += 16) {
          const __mmask16 m = tail_mask(groups - g);
          t = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, mf + j * groups + g),
                              _mm512_maskz_loadu_ps(m, p.xsum + r * groups + g), t);
        }
        off[r] = _mm512_reduce_add_ps(t);
      }
    }
    for (int r = 0; r < R; ++r) y[r * ys + o + j] = _mm512_reduce_add_ps(acc[j][r]) - off[r];
  }
}

// Output rows [b0, b1) for R input rows: whole tiles of kTileCols, then one at a time.
template <int R, int BITS, int UNIT>
inline void tile_cols(const Args& a, int64_t b0, int64_t b1, const QInput& p, const float* ws, const float* mf,
                      float* y, int64_t ys) {
  const int64_t per = tile_scales_per_row<UNIT>(a.in, a.group), groups = a.in / a.group;
  int64_t o = b0;
  for (; o + kTileCols <= b1; o += kTileCols)
    tile_vnni<R, kTileCols, BITS, UNIT>(a, o, p, ws + (o - b0) * per, mf + (o - b0) * groups, y, ys);
  for (; o < b1; ++o) tile_vnni<R, 1, BITS, UNIT>(a, o, p, ws + (o - b0) * per, mf + (o - b0) * groups, y, ys);
}

// Output rows [b0, b1) (one block, its scales in ws / mf) for all `rows` input rows of p.
template <int BITS, int UNIT>
inline void tile_block(const Args& a, int64_t b0, int64_t b1, const QInput& p, int64_t rows, const float* ws,
                       const float* mf, float* y) {
  const int64_t in = a.in, groups = in / a.group, units = in / UNIT;
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const QInput pr{p.xq + r0 * in, p.corr + r0 * (in / 4), p.xsu + r0 * units, p.xsum + r0 * groups};
    float* yr = y + r0 * a.out;
    switch (std::min<int64_t>(kTileRows, rows - r0)) {
      case 4: tile_cols<4, BITS, UNIT>(a, b0, b1, pr, ws, mf, yr, a.out); break;
      case 3: tile_cols<3, BITS, UNIT>(a, b0, b1, pr, ws, mf, yr, a.out); break;
      case 2: tile_cols<2, BITS, UNIT>(a, b0, b1, pr, ws, mf, yr, a.out); break;
      default: tile_cols<1, BITS, UNIT>(a, b0, b1, pr, ws, mf, yr, a.out); break;
    }
  }
}

// Output rows [o0, o1) of y [rows, out] = x W^T on the prepared input p (all rows).
inline void gemm_vnni_range(const Args& a, const QInput& p, int64_t rows, float* y, int64_t o0, int64_t o1) {
  const int64_t groups = a.in / a.group;
  const int64_t rb = row_bytes(a.bits, a.in);
  const int64_t nb = std::max<int64_t>(kTileCols, kBlockBytes / rb / kTileCols * kTileCols);
  dispatch_scale(a.st, [&](auto zero) {
    using S = decltype(zero);
    auto go = [&](auto bb, auto uu) {
      constexpr int BB = decltype(bb)::value, UU = decltype(uu)::value;
      const int64_t per = tile_scales_per_row<UU>(a.in, a.group);
      std::vector<float> ws(nb * per), mf(a.m ? nb * groups : 1);
      for (int64_t b0 = o0; b0 < o1; b0 += nb) {
        const int64_t b1 = std::min(o1, b0 + nb);
        tile_block_scales<S, UU>(a, b0, b1, ws.data(), mf.data());
        tile_block<BB, UU>(a, b0, b1, p, rows, ws.data(), mf.data(), y);
      }
    };
    auto by_unit = [&](auto bb) {
      constexpr int BB = decltype(bb)::value;
      const int64_t u = vnni_unit(a.group);
      if (u == 32) go(bb, std::integral_constant<int, 32>{});
      else if (u == 16 && BB != 4) go(std::integral_constant<int, BB == 4 ? 8 : BB>{}, std::integral_constant<int, 16>{});
      else go(bb, std::integral_constant<int, 4>{});
    };
    if (a.bits == 4) by_unit(std::integral_constant<int, 4>{});
    else if (a.bits == 6) by_unit(std::integral_constant<int, 6>{});
    else by_unit(std::integral_constant<int, 8>{});
  });
}

}  // namespace
}  // namespace iterserve_quant

#pragma GCC pop_options
