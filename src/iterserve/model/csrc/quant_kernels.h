// Per-row kernels over packed quantized weights (model/quant/packed.py), shared by the
// standalone projection op (quant_gemm.cpp) and the one-token decoder (cpu_ops.cpp).
// Compiled for AVX-512 (+VNNI) wherever included (the pragma below), so the AVX2 build
// of the decoder carries them too; callers run them only on CPUs that have those units.
//
// Layouts (packed.py): bits 8: int8 [out, in]; bits 4: uint8 [out, in / 2], each 32
// elements one 16-byte chunk whose byte j holds element j (low nibble) and element
// j + 16 (high nibble); bits 6: uint8 [out, in / 64 * 48], each 64 elements one 48-byte
// chunk: bytes 0-31 the low 4 bits of element j (low nibble) and j + 32 (high nibble),
// bytes 32-47 the top 2 bits of elements j, j + 16, j + 32, j + 48 (bits 0-1 .. 6-7).
// scales [out, in / group] (float32 / float16, or uint8 / int8 under a float32 or
// float16 base per 256 weights of a row); optional mins of the same shape (not with 6
// bits).
// w = s * q - m with mins; without: 8-bit w = s * q, 4-bit w = s * (q - 8), 6-bit
// w = s * (q - 32).
//
// Two kernels:
// - float activations (row): each weight widened to float32 in registers, q . x summed
//   per group and scaled once per group; the offset term (m or 8 s) is a dot of the
//   group offsets with the input's group sums.
// - int8 activations (row_vnni), as llama.cpp's q8_0 dot products: the input quantized
//   per 32 elements (a float scale each, round to nearest), 64 weights at a time dotted
//   with it by one vpdpbusd (unsigned x signed bytes into 16 int32 lanes of 4 products).
//   The weights are the unsigned operand: 4-bit and 6-bit codes as they are (0..15,
//   0..63), 8-bit codes offset by 128 (w ^ 0x80); the offsets' share (8, 32 or 128
//   times the input's sum over each lane's 4 elements) is computed with the quantized
//   input and starts each lane's accumulator, so a lane holds the exact integer dot.
//   Each lane is then scaled by its group's weight scale times its block's input scale.
//   The 6-bit layout unpacks in natural order; the input of a 4-bit layer is stored
//   permuted (per 64 elements: 0-15, 32-47, 16-31, 48-63) to match the nibbles
//   unpacked as [low nibbles of 32 bytes | high nibbles].
#pragma once
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")

namespace iterserve_quant {
namespace {

constexpr int kMaxRows = 4;
enum ScaleType : int { kF32 = 0, kF16 = 1, kU8 = 2, kI8 = 3 };

// Bytes of one packed row of `in` weights.
inline int64_t row_bytes(int64_t bits, int64_t in) { return bits == 8 ? in : bits == 4 ? in / 2 : in / 64 * 48; }
// in_features of a packed row of `cols` bytes (-1: no whole number of chunks).
inline int64_t row_in(int64_t bits, int64_t cols) {
  if (bits == 8) return cols;
  if (bits == 4) return 2 * cols;
  return cols % 48 == 0 ? cols / 48 * 64 : -1;
}
// Whether `bits` / `group` / mins make a layout the kernels take (6-bit: no mins).
inline bool layout_ok(int64_t bits, int64_t in, int64_t group, bool mins) {
  if (bits != 4 && bits != 6 && bits != 8) return false;
  if (group <= 0 || in <= 0 || in % group) return false;
  if (bits == 6) return !mins && group % 16 == 0 && in % 64 == 0;
  return group % (bits == 8 ? 16 : 32) == 0;
}

// Two-level scales' bases [out, in / 256]: float32, or float16 (Q6_K's d as in the file).
struct Base {
  const void* p = nullptr;  // nullptr: one-level scales
  bool half = false;
  explicit operator bool() const { return p != nullptr; }
  float operator[](int64_t i) const {
    return half ? static_cast<float>(static_cast<const c10::Half*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  Base from(int64_t i) const {  // the bases from index i on
    return p ? Base{static_cast<const char*>(p) + i * (half ? 2 : 4), half} : *this;
  }
};

struct Args {
  const void* q;
  const void* s;
  const void* m;  // nullptr: no mins
  Base sb;        // two-level: the bases of s and m; else empty
  Base mb;
  int64_t out, in, group, bits;
  int st;  // ScaleType of s (and m)
};

inline float sc(const float* s, int64_t i) { return s[i]; }
inline float sc(const c10::Half* s, int64_t i) { return static_cast<float>(s[i]); }
inline float sc(const uint8_t* s, int64_t i) { return static_cast<float>(s[i]); }
inline float sc(const int8_t* s, int64_t i) { return static_cast<float>(s[i]); }

// 16 weights (as float32) starting at element k of one row.
inline void load_q8(const int8_t* q, int64_t k, __m512& w) {
  w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
}
// The 32 weights of the 4-bit chunk starting at element k (k a multiple of 32).
inline void load_q4(const uint8_t* q, int64_t k, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

// The 16 weights (as float32, q - 32) of the 6-bit row q starting at element k (a
// multiple of 16): quarter k / 16 % 4 of its 64-element chunk.
inline void load_q6(const uint8_t* q, int64_t k, __m512& w) {
  const uint8_t* c = q + k / 64 * 48;
  const int sub = static_cast<int>(k / 16 % 4);
  const __m512i lo = _mm512_srlv_epi32(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * (sub & 1)))),
      _mm512_set1_epi32(4 * (sub >> 1)));
  const __m512i hi = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 32))),
                                       _mm512_set1_epi32(2 * sub));
  const __m512i v = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xF)),
                                    _mm512_slli_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(3)), 4));
  w = _mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(32)));
}
// Element k of a 6-bit row as q - 32.
inline int q6_at(const uint8_t* q, int64_t k) {
  const uint8_t* c = q + k / 64 * 48;
  const int e = static_cast<int>(k % 64);
  const int lo = (c[e % 32] >> (4 * (e / 32))) & 0xF, hi = (c[32 + e % 16] >> (2 * (e / 16))) & 3;
  return (lo | (hi << 4)) - 32;
}

// Group g's scale and offset (m, or 8 s for 4-bit without mins) of one row.
template <int BITS, typename S>
inline void group_scale(const Args& a, const S* s, const S* mn, const Base& sb, const Base& mb,
                        int64_t g, float& sg, float& cg) {
  sg = sc(s, g);
  const int64_t sup = g * a.group / 256;
  if (sb) sg *= sb[sup];
  if (mn) {
    cg = sc(mn, g);
    if (mb) cg *= mb[sup];
  } else {
    cg = BITS == 4 ? 8.f * sg : 0.f;
  }
}

inline void store(float* y, float v, bool add) { *y = add ? *y + v : v; }

// y[r * ys + o] (= or +=) x[r] . w[o] for r < R; xsum: the inputs' per-group sums
// [R, in / group]. OFF: whether the weights carry an offset (mins, or 4-bit's 8 s);
// without one (8-bit, no mins) the group sums are neither computed nor read.
template <int R, int BITS, typename S, bool OFF>
inline void row(const Args& a, int64_t o, const float* x, const float* xsum, float* y, int64_t ys, bool add) {
  const int64_t groups = a.in / a.group;
  const S* s = static_cast<const S*>(a.s) + o * groups;
  const S* mn = a.m ? static_cast<const S*>(a.m) + o * groups : nullptr;
  const int8_t* q8 = static_cast<const int8_t*>(a.q) + o * a.in;
  const uint8_t* q4 = static_cast<const uint8_t*>(a.q) + o * row_bytes(BITS, a.in);
  const Base sb = a.sb.from(o * (a.in / 256)), mb = a.mb.from(o * (a.in / 256));
  __m512 acc[R];
  float off[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm512_setzero_ps(); off[r] = 0.f; }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * a.group, k1 = k0 + a.group;
    __m512 t[R];
    for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_ps();
    if constexpr (BITS == 8) {
      _mm_prefetch(reinterpret_cast<const char*>(q8 + k0) + 1024, _MM_HINT_T0);
      for (int64_t k = k0; k < k1; k += 16) {
        __m512 w;
        load_q8(q8, k, w);
        for (int r = 0; r < R; ++r) t[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * a.in + k), t[r]);
      }
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(q4 + k0 / 2) + 1024, _MM_HINT_T0);
      for (int64_t k = k0; k < k1; k += 32) {
        __m512 lo, hi;
        load_q4(q4, k, lo, hi);
        for (int r = 0; r < R; ++r) {
          t[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * a.in + k), t[r]);
          t[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * a.in + k + 16), t[r]);
        }
      }
    }
    float sg, cg;
    group_scale<BITS, S>(a, s, mn, sb, mb, g, sg, cg);
    const __m512 sv = _mm512_set1_ps(sg);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(t[r], sv, acc[r]);
      if constexpr (OFF) off[r] += cg * xsum[r * groups + g];
    }
  }
  for (int r = 0; r < R; ++r) store(y + r * ys + o, _mm512_reduce_add_ps(acc[r]) - off[r], add);
}

// --- int8 activations ------------------------------------------------------------

// What the int8-activation kernel can take: rows of whole 64-element chunks, and
// groups of 16 (8-bit, 6-bit), 32, or a multiple of 64.
inline bool vnni_layout_ok(int64_t bits, int64_t in, int64_t group) {
  return in % 64 == 0 && ((group == 16 && bits != 4) || group == 32 || group % 64 == 0);
}
// The unit the input's scales are stored at for the row kernel: per group of 16 or 32
// (multiplied into the weight scales once per row), else one per vpdpbusd lane.
inline int64_t vnni_unit(int64_t group) { return group <= 32 ? group : 4; }

// The prepared input of the int8-activation kernel, R rows: xq [R, in] int8 (permuted
// for 4-bit), corr [R, in / 4] (each lane's offset share), xsu [R, in / unit] scales,
// xsum [R, in / group] float group sums (mins only).
struct QInput {
  int8_t* xq;
  int32_t* corr;
  float* xsu;
  float* xsum;
};

inline int64_t qinput_floats(int64_t in) { return in / 4 + in / 4 + in / 16 + in / 16 + 16; }

// Quantize R rows of x [R, in] for a layer of `bits` / `group` / mins.
inline void prep_vnni(const float* x, int64_t R, int64_t in, int64_t bits, int64_t group, bool mins,
                      const QInput& p) {
  const int64_t unit = vnni_unit(group), groups = in / group;
  const int32_t k = bits == 8 ? 128 : bits == 6 ? 32 : (mins ? 0 : 8);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * in;
    int8_t* q = p.xq + r * in;
    int32_t* corr = p.corr + r * (in / 4);
    float* xsu = p.xsu + r * (in / unit);
    for (int64_t c = 0; c < in / 64; ++c) {
      __m128i b[4];  // blocks 2c, 2c+1 as int8, 16 elements each: b0 lo, b0 hi, b1 lo, b1 hi
      float xs[2];
      for (int h = 0; h < 2; ++h) {
        const float* p0 = xr + 64 * c + 32 * h;
        const __m512 v0 = _mm512_loadu_ps(p0), v1 = _mm512_loadu_ps(p0 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        xs[h] = amax / 127.f;
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        b[2 * h] = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)));
        b[2 * h + 1] = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)));
      }
      __m512i z;
      if (bits != 4) {  // natural order
        z = _mm512_inserti64x2(_mm512_castsi128_si512(b[0]), b[1], 1);
        z = _mm512_inserti64x2(_mm512_inserti64x2(z, b[2], 2), b[3], 3);
      } else {  // 0-15, 32-47, 16-31, 48-63: as the nibbles unpack
        z = _mm512_inserti64x2(_mm512_castsi128_si512(b[0]), b[2], 1);
        z = _mm512_inserti64x2(_mm512_inserti64x2(z, b[1], 2), b[3], 3);
      }
      _mm512_storeu_si512(q + 64 * c, z);
      const __m512i lane_sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, z);
      _mm512_storeu_si512(corr + 16 * c, _mm512_mullo_epi32(lane_sums, _mm512_set1_epi32(-k)));
      if (unit == 32) {
        xsu[2 * c] = xs[0], xsu[2 * c + 1] = xs[1];
      } else if (unit == 16) {
        xsu[4 * c] = xsu[4 * c + 1] = xs[0], xsu[4 * c + 2] = xsu[4 * c + 3] = xs[1];
      } else {  // per lane
        for (int l = 0; l < 16; ++l) xsu[16 * c + l] = xs[bits != 4 ? l / 8 : (l / 4) % 2];
      }
    }
    if (mins)
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.f;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) s += xr[i];
        p.xsum[r * groups + g] = s;
      }
  }
}

// 16 scales of one row from group g on (masked to `mask`), as float32, times their bases.
template <typename S>
inline __m512 load_scales16(const S* s, int64_t g, __mmask16 mask, const Base& base, int64_t group) {
  __m512 v;
  if constexpr (std::is_same<S, float>::value) {
    v = _mm512_maskz_loadu_ps(mask, s + g);
  } else if constexpr (std::is_same<S, c10::Half>::value) {
    v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, s + g));
  } else if constexpr (std::is_same<S, uint8_t>::value) {
    v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, s + g)));
  } else {
    v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, s + g)));
  }
  const int64_t top = 31 - __builtin_clz(static_cast<unsigned>(mask) | 1u);  // the last lane
  if (base && base.half && g * group / 256 == (g + top) * group / 256) {  // one base for all
    v = _mm512_mul_ps(v, _mm512_set1_ps(base[g * group / 256]));
  } else if (base && base.half) {  // lane l's base: (g + l) * group / 256
    alignas(64) float b[16] = {};
    int64_t last = -1;
    float bl = 0.f;
    int l = 0;
    for (unsigned m = mask; m; m >>= 1, ++l) {
      const int64_t i = (g + l) * group / 256;
      if (i != last) bl = base[i], last = i;  // one conversion per base (16 lanes share it at group 16)
      if (m & 1) b[l] = bl;
    }
    v = _mm512_mul_ps(v, _mm512_load_ps(b));
  } else if (base) {
    const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(g)),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i idx = _mm512_srli_epi32(_mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(group))), 8);
    v = _mm512_mul_ps(v, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, idx, static_cast<const float*>(base.p), 4));
  }
  return v;
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// The float-activation row kernel (row) for 6-bit weights: each 16 weights scaled by
// their group's scale before the dot (16 groups' scales loaded at once), so no per-group
// sums are kept; a 64-weight chunk unpacks with constant shifts, its loads shared.
template <int R, typename S>
inline void row6(const Args& a, int64_t o, const float* x, float* y, int64_t ys, bool add) {
  const int64_t groups = a.in / a.group;
  const S* s = static_cast<const S*>(a.s) + o * groups;
  const uint8_t* q = static_cast<const uint8_t*>(a.q) + o * row_bytes(6, a.in);
  const Base sb = a.sb.from(o * (a.in / 256));
  const __m512i lo4 = _mm512_set1_epi32(0xF), hi2 = _mm512_set1_epi32(0x30), off = _mm512_set1_epi32(32);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512 sv = _mm512_setzero_ps();
  int64_t g0 = 0;
  for (int64_t c = 0; c < a.in / 64; ++c) {
    const uint8_t* ch = q + 48 * c;
    _mm_prefetch(reinterpret_cast<const char*>(ch) + 1024, _MM_HINT_T0);
    const __m512i l0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch)));
    const __m512i l1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + 16)));
    const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + 32)));
    __m512i v[4];  // elements 0-15, 16-31, 32-47, 48-63 of the chunk, 0..63
    v[0] = _mm512_or_si512(_mm512_and_si512(l0, lo4), _mm512_and_si512(_mm512_slli_epi32(h, 4), hi2));
    v[1] = _mm512_or_si512(_mm512_and_si512(l1, lo4), _mm512_and_si512(_mm512_slli_epi32(h, 2), hi2));
    v[2] = _mm512_or_si512(_mm512_srli_epi32(l0, 4), _mm512_and_si512(h, hi2));
    v[3] = _mm512_or_si512(_mm512_srli_epi32(l1, 4), _mm512_and_si512(_mm512_srli_epi32(h, 2), hi2));
    for (int i = 0; i < 4; ++i) {
      const int64_t k = 64 * c + 16 * i, g = k / a.group;
      if (k == 0 || g - g0 >= 16) {
        g0 = g;
        sv = load_scales16(s, g0, tail_mask(groups - g0), sb, a.group);
      }
      const __m512 sp = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(g - g0)), sv);
      const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(v[i], off)), sp);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * a.in + k), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store(y + r * ys + o, _mm512_reduce_add_ps(acc[r]), add);
}

// The constant vectors that spread a chunk's packed codes over the 16 lanes.
struct UnpackConsts {
  __m512i idx;      // lane l's unit within a chunk
  __mmask16 umask;  // the units a chunk holds
  __m512i shift;    // nibble shifts
  __m512i shift2;   // 6-bit top bits: 128-bit lane i (elements 16 i ..) takes bits 2 i, 2 i + 1
  __m512i nib, flip, two;
};

template <int BITS, int UNIT>
inline UnpackConsts unpack_consts() {
  const __m512i idx = UNIT == 16 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                      : BITS != 4 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                  : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  const __mmask16 umask = UNIT == 16 ? 0xF : 0x3;
  const __m512i shift = _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004LL, 0x0004000400040004LL,
                                          0x0004000400040004LL, 0x0004000400040004LL);
  const __m512i shift2 = _mm512_setr_epi64(0, 0, 0x0002000200020002LL, 0x0002000200020002LL, 0x0004000400040004LL,
                                           0x0004000400040004LL, 0x0006000600060006LL, 0x0006000600060006LL);
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i two = _mm512_set1_epi8(0x03);
  return {idx, umask, shift, shift2, nib, flip, two};
}

// y[r * ys + o[j]] (= or +=) x[r] . w[o[j]] for r < R, j < NO, on the int8 input `p`
// (prep_vnni). NO output rows at once: independent accumulator chains, each input load
// shared, and (the caller pairing rows half a range apart) two weight streams for the
// hardware prefetcher. UNIT: the input's scale unit (16, 32, or 4: per lane).
// wd: scratch [NO, R, in / 16].
template <int R, int NO, int BITS, typename S, int UNIT>
inline void row_vnni(const Args& a, const int64_t* o, const QInput& p, float* y, int64_t ys, bool add, float* wd) {
  const int64_t groups = a.in / a.group, chunks = a.in / 64;
  constexpr int64_t units_per_chunk = UNIT == 4 ? 16 : 64 / UNIT;
  const int64_t units = a.in / UNIT;
  const S* s[NO];
  Base sb[NO];
  const int8_t* q8[NO];
  const uint8_t* q4[NO];
  for (int j = 0; j < NO; ++j) {
    s[j] = static_cast<const S*>(a.s) + o[j] * groups;
    sb[j] = a.sb.from(o[j] * (a.in / 256));
    q8[j] = static_cast<const int8_t*>(a.q) + o[j] * a.in;
    q4[j] = static_cast<const uint8_t*>(a.q) + o[j] * row_bytes(BITS, a.in);
  }
  if constexpr (UNIT != 4) {  // wd[j][r][u] = weight scale * input scale of unit u
    for (int j = 0; j < NO; ++j)
      for (int64_t u = 0; u < units; u += 16) {
        const __mmask16 m = tail_mask(units - u);
        const __m512 ws = load_scales16(s[j], u, m, sb[j], a.group);
        for (int r = 0; r < R; ++r)
          _mm512_mask_storeu_ps(wd + (j * R + r) * units + u, m,
                                _mm512_mul_ps(ws, _mm512_maskz_loadu_ps(m, p.xsu + r * units + u)));
      }
  }
  const auto [idx, umask, shift, shift2, nib, flip, two] = unpack_consts<BITS, UNIT>();
  __m512 acc[NO][R];
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i w[NO];
    for (int j = 0; j < NO; ++j) {
      if constexpr (BITS == 8) {
        _mm_prefetch(reinterpret_cast<const char*>(q8[j] + 64 * c) + 1024, _MM_HINT_T0);
        w[j] = _mm512_xor_si512(_mm512_loadu_si512(q8[j] + 64 * c), flip);
      } else if constexpr (BITS == 6) {
        const uint8_t* ch = q4[j] + 48 * c;
        _mm_prefetch(reinterpret_cast<const char*>(ch) + 1024, _MM_HINT_T0);
        const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch)));
        const __m512i h = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + 32)));
        w[j] = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(b, shift), nib),
                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift2), two), 4));
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(q4[j] + 32 * c) + 1024, _MM_HINT_T0);
        const __m512i b =
            _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q4[j] + 32 * c)));
        w[j] = _mm512_and_si512(_mm512_srlv_epi16(b, shift), nib);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_loadu_si512(p.corr + r * (a.in / 4) + 16 * c);
      const __m512i xq = _mm512_loadu_si512(p.xq + r * a.in + 64 * c);
      for (int j = 0; j < NO; ++j) {
        const __m512i dot = _mm512_dpbusd_epi32(corr, w[j], xq);
        __m512 d;
        if constexpr (UNIT == 4) {  // the weight scale of this chunk's group, per lane input scales
          d = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_setzero_si512(),
                                                  load_scales16(s[j], 64 * c / a.group, 0x1, sb[j], a.group)),
                            _mm512_loadu_ps(p.xsu + r * (a.in / 4) + 16 * c));
        } else {
          d = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(umask, wd + (j * R + r) * units + units_per_chunk * c));
        }
        acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[j][r]);
      }
    }
  }
  for (int j = 0; j < NO; ++j) {
    float off[R] = {};
    if (a.m) {  // the mins' share: m . group sums of x
      const S* mn = static_cast<const S*>(a.m) + o[j] * groups;
      const Base mb = a.mb.from(o[j] * (a.in / 256));
      for (int64_t g = 0; g < groups; ++g) {
        float mg = sc(mn, g);
        if (mb) mg *= mb[g * a.group / 256];
        for (int r = 0; r < R; ++r) off[r] += mg * p.xsum[r * groups + g];
      }
    }
    for (int r = 0; r < R; ++r) store(y + r * ys + o[j], _mm512_reduce_add_ps(acc[j][r]) - off[r], add);
  }
}

// --- dispatch --------------------------------------------------------------------

template <typename F>
inline void dispatch_scale(int st, F&& f) {
  switch (st) {
    case kF16: f(c10::Half{}); break;
    case kU8: f(uint8_t{}); break;
    case kI8: f(int8_t{}); break;
    default: f(float{}); break;
  }
}

// Rows [o0, o1) of y = x W^T for R rows of x on the float-activation kernel; xsum: the
// per-group sums of x when the layer has an offset (mins, or 4-bit), else unused.
inline void rows_float(const Args& a, const float* x, const float* xsum, float* y, int64_t ys, int64_t R,
                       int64_t o0, int64_t o1, bool add) {
  const int64_t groups = a.in / a.group;
  const bool off = a.m != nullptr || a.bits == 4;
  dispatch_scale(a.st, [&](auto zero) {
    using S = decltype(zero);
    for (int64_t r0 = 0; r0 < R; r0 += kMaxRows) {
      const int64_t n = std::min<int64_t>(kMaxRows, R - r0);
      const float* xr = x + r0 * a.in;
      const float* sr = off ? xsum + r0 * groups : nullptr;
      float* yr = y + r0 * ys;
      auto go = [&](auto rr, auto bb, auto oo) {
        constexpr int RR = decltype(rr)::value, BB = decltype(bb)::value;
        constexpr bool OO = decltype(oo)::value;
        if constexpr (BB == 6) {
          for (int64_t o = o0; o < o1; ++o) row6<RR, S>(a, o, xr, yr, ys, add);
        } else {
          for (int64_t o = o0; o < o1; ++o) row<RR, BB, S, OO>(a, o, xr, sr, yr, ys, add);
        }
      };
      auto by_rows = [&](auto bb, auto oo) {
        switch (n) {
          case 4: go(std::integral_constant<int, 4>{}, bb, oo); break;
          case 3: go(std::integral_constant<int, 3>{}, bb, oo); break;
          case 2: go(std::integral_constant<int, 2>{}, bb, oo); break;
          default: go(std::integral_constant<int, 1>{}, bb, oo); break;
        }
      };
      if (a.bits == 4) by_rows(std::integral_constant<int, 4>{}, std::true_type{});
      else if (a.bits == 6) by_rows(std::integral_constant<int, 6>{}, std::false_type{});  // no mins
      else if (off) by_rows(std::integral_constant<int, 8>{}, std::true_type{});
      else by_rows(std::integral_constant<int, 8>{}, std::false_type{});
    }
  });
}

// The input sums rows_float needs: [R, in / group].
inline void group_sums(const float* x, int64_t R, int64_t in, int64_t group, float* xsum) {
  const int64_t groups = in / group;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* p = x + r * in + g * group;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < group; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + k));
      xsum[r * groups + g] = _mm512_reduce_add_ps(acc);
    }
}

// Rows [o0, o1) of y = x W^T for R rows (at most kMaxRows) of the input prepared by
// prep_vnni; wd: scratch [2, R, in / 16] floats.
inline void rows_vnni(const Args& a, const QInput& p, float* y, int64_t ys, int64_t R, int64_t o0, int64_t o1,
                      bool add, float* wd) {
  dispatch_scale(a.st, [&](auto zero) {
    using S = decltype(zero);
    auto go = [&](auto rr, auto bb, auto uu) {
      constexpr int RR = decltype(rr)::value, BB = decltype(bb)::value, UU = decltype(uu)::value;
      // Rows i and i + half together: two streams through the range.
      const int64_t half = (o1 - o0 + 1) / 2;
      for (int64_t i = o0; i < o0 + half; ++i) {
        const int64_t rows[2] = {i, i + half};
        if (i + half < o1) row_vnni<RR, 2, BB, S, UU>(a, rows, p, y, ys, add, wd);
        else row_vnni<RR, 1, BB, S, UU>(a, rows, p, y, ys, add, wd);
      }
    };
    auto by_unit = [&](auto rr, auto bb) {
      const int64_t u = vnni_unit(a.group);
      constexpr int BB = decltype(bb)::value;
      if (u == 32) go(rr, bb, std::integral_constant<int, 32>{});
      else if (u == 16 && BB != 4) go(rr, std::integral_constant<int, BB == 4 ? 8 : BB>{}, std::integral_constant<int, 16>{});
      else go(rr, bb, std::integral_constant<int, 4>{});
    };
    auto by_bits = [&](auto rr) {
      if (a.bits == 4) by_unit(rr, std::integral_constant<int, 4>{});
      else if (a.bits == 6) by_unit(rr, std::integral_constant<int, 6>{});
      else by_unit(rr, std::integral_constant<int, 8>{});
    };
    switch (R) {
      case 4: by_bits(std::integral_constant<int, 4>{}); break;
      case 3: by_bits(std::integral_constant<int, 3>{}); break;
      case 2: by_bits(std::integral_constant<int, 2>{}); break;
      default: by_bits(std::integral_constant<int, 1>{}); break;
    }
  });
}

// Row `o` of the weight as float32 (an embedding lookup).
inline void dequant_row(const Args& a, int64_t o, float* dst) {
  dispatch_scale(a.st, [&](auto zero) {
    using S = decltype(zero);
    const int64_t groups = a.in / a.group;
    const S* s = static_cast<const S*>(a.s) + o * groups;
    const S* mn = a.m ? static_cast<const S*>(a.m) + o * groups : nullptr;
    const Base sb = a.sb.from(o * (a.in / 256)), mb = a.mb.from(o * (a.in / 256));
    for (int64_t g = 0; g < groups; ++g) {
      float sg, cg;
      if (a.bits == 4) group_scale<4, S>(a, s, mn, sb, mb, g, sg, cg);
      else group_scale<8, S>(a, s, mn, sb, mb, g, sg, cg);  // 6-bit: q - 32 below, no offset
      for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) {
        float q;
        if (a.bits == 8) {
          q = static_cast<float>(static_cast<const int8_t*>(a.q)[o * a.in + k]);
        } else if (a.bits == 6) {
          q = static_cast<float>(q6_at(static_cast<const uint8_t*>(a.q) + o * row_bytes(6, a.in), k));
        } else {
          const uint8_t b = static_cast<const uint8_t*>(a.q)[o * (a.in / 2) + (k / 32) * 16 + k % 16];
          q = static_cast<float>(k % 32 < 16 ? b & 15 : b >> 4);
        }
        dst[k] = q * sg - cg;
      }
    }
  });
}

}  // namespace
}  // namespace iterserve_quant

#pragma GCC pop_options
