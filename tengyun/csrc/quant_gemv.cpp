// Weight-only quantised linear layers (4-bit nibbles or 8-bit integers, a scale and an offset per
// group of inputs and output column) for bfloat16 activations and a few rows (decode), weights
// dequantised in registers: the packed weight streams once per pass of 4 rows, front to back.
//
// Layout (tengyun/platforms/cpu/kernels/quant_layout.py writes it once at load), NB = ceil(N / 32) blocks
// of 32 output columns (padding columns hold zero), G = K / group groups:
//   packed  4 bits: uint8 [NB][K / 2][32]  byte i of (block b, inputs 2p, 2p + 1), c = i / 2,
//                   k = 2p + i % 2: n[32 b + c, k] | n[32 b + 16 + c, k] << 4, n in [0, 16) (K, group
//                   even; the Python side views it as [NB][K][16]);
//           8 bits: int8  [NB][K][32]  byte j of (b, k) = q[32 b + j, k], signed;
//   scales  [NB][G][32] float32, bfloat16 or float16: s of (column 32 b + j, group g);
//   zeros   uint8 [NB][G][32] or none; offsets [NB][G][32] in scales' dtype or none.
// Arithmetic contract (float32 throughout):
//   o = offsets[b, g, j] if given, else -zeros[b, g, j] * s if given, else -zero * s (argument);
//   the weight is w[n, k] = fma(n, s, o), one rounding (with 16-bit scales and integer zeros,
//   -zero * s is exact, so w is (n - zero) * s rounded once, as the references dequantise);
//   quant_dequantize_t returns exactly these w.
//   8 bits, up to kMaxRows rows: y[m, n] = bf16(sum_g (s * Q_g + o * X_g) + bias[n]) with
//           Q_g = sum_{k in g} x[m, k] q[n, k] (float32 FMAs in k order; each product exact) and X_g
//           as below: the 4-bit path's form, which keeps the scale out of the inner loop (3 vector
//           ops per 16 weights instead of 4); more rows: as 4 bits below with n = q (int8 is exact
//           in bfloat16).
//   4 bits: y[m, n] = bf16(sum_g (s * P_g + o * X_g) + bias[n]) with P_g = sum_{k in g} x[m, k] n[n, k]
//           (vdpbf16ps: nibbles exact in bfloat16, exact products, float32 sums) and X_g = sum_{k in g}
//           x[m, k] in float32: the same sum as with w, in another float32 rounding order.
//
// torch.ops.tengyun.quant_linear(x, packed, bits, group, scales, zeros, offsets, zero, out_features,
//   bias) -> y [M, N] bfloat16 (x bfloat16 [M, K] with unit last stride; bias bfloat16 [N] or None).
// torch.ops.tengyun.quant_dequantize_t(packed, bits, group, scales, zeros, offsets, zero,
//   out_features, dtype) -> w^T [K, N] in "float32" or "bfloat16" (the same w, then rounded).
// torch.ops.tengyun.quant_linear_supported() -> bool: this CPU has AVX-512F/BW/VL and AVX-512 BF16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_isa.h"

namespace tengyun {
namespace {

constexpr int64_t kCols = 32;  // output columns per block: two zmm of float32 sums per row
constexpr int kMaxRows = 4;    // rows per pass over a block (4 x 2 sums, 2 scales, 2 offsets, 2 w)
// The tiles prefetch the packed weight this far ahead of their loads: a block is one front-to-back
// stream, and the hardware prefetcher alone left the 8-bit tile at ~14 GB/s here (int8_gemv.cpp's
// VNNI tiles, prefetching, stream at ~22).
constexpr int64_t kPrefetchBytes = 4096;

enum class ScaleType { f32, bf16, f16 };

struct QuantArgs {
  const float* xf;        // 8 bits: x in float32 [rows, k], contiguous
  const uint16_t* xb;     // 4 bits: x in bfloat16 [rows, k], row stride x_stride
  const float* x_sums;    // float32 [rows, k / group], each group's sum of x
  const uint8_t* packed;
  const void* scales;
  const uint8_t* zeros;  // nullptr: none
  const void* offsets;   // nullptr: none
  const void* bias;      // nullptr: none; x's dtype
  void* y;               // bfloat16 [rows, n]
  ScaleType scale_type;
  int64_t rows, n, k, group, blocks, x_stride;
  float zero;
};

// 8 bits at more than kMaxRows rows: each block widened once into bfloat16 pairs (linear_blocks).
bool wide_rows(const QuantArgs& a, int bits) { return bits == 8 && a.rows > kMaxRows && a.group % 2 == 0; }

#if TY_HAVE_X86_COPIES
#define TY_QUANT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// bfloat16 bits of (i & 15) for i in [0, 32): vpermw reads an index's low 5 bits, so a zero-extended
// byte indexes its low nibble directly (integers below 256 are exact in bfloat16).
alignas(64) constexpr uint16_t kNibbleBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

TY_QUANT_TARGET inline __m512 load_param(const void* base, ScaleType type, int64_t at) {
  switch (type) {
    case ScaleType::f32: return _mm512_loadu_ps(static_cast<const float*>(base) + at);
    case ScaleType::bf16: {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
    default:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at)));
  }
}

// Scales and offsets of columns [16 h, 16 h + 16) of block b, group g (the contract's s and o).
TY_QUANT_TARGET inline void load_group(const QuantArgs& a, int64_t b, int64_t g, int h, __m512& s, __m512& o) {
  const int64_t at = (b * (a.k / a.group) + g) * kCols + 16 * h;
  s = load_param(a.scales, a.scale_type, at);
  if (a.offsets != nullptr) {
    o = load_param(a.offsets, a.scale_type, at);
  } else if (a.zeros != nullptr) {
    const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.zeros + at))));
    o = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(z, s));
  } else {
    o = _mm512_mul_ps(_mm512_set1_ps(-a.zero), s);
  }
}

// The 32 weights of (block b, input k) of the 8-bit layout as two float32 vectors (columns 0-15, 16-31).
TY_QUANT_TARGET inline void load_weights8(const uint8_t* p, const __m512 (&s)[2], const __m512 (&o)[2], __m512 (&w)[2]) {
  const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), s[0], o[0]);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), s[1], o[1]);
}

// The 64 nibbles of (block b, inputs 2p, 2p + 1) as bfloat16 pairs: lo holds columns 0-15, hi 16-31,
// each 32-bit lane (n[c, 2p], n[c, 2p + 1]).
TY_QUANT_TARGET inline void load_nibble_pairs(const uint8_t* p, __m512i lut, __m512i& lo, __m512i& hi) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  lo = _mm512_permutexvar_epi16(bytes, lut);
  hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), lut);
}

TY_QUANT_TARGET inline void store_row(const QuantArgs& a, __m512 v, int64_t row, int64_t col) {
  if (col >= a.n) return;
  const int64_t left = a.n - col;
  const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
  if (a.bias != nullptr) {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(a.bias) + col);
    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  }
  const __m256i out = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));  // round to nearest even
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.y) + row * a.n + col, mask, out);
}

// acc += s * part + o * sum(x) for group g of block b, rows [r0, r0 + M) (both tiles' group end).
template <int M>
TY_QUANT_TARGET inline void fold_group(const QuantArgs& a, int64_t b, int64_t g, int64_t r0, const __m512 (&part)[M][2],
                                       __m512 (&acc)[M][2]) {
  __m512 s[2], o[2];
  load_group(a, b, g, 0, s[0], o[0]);
  load_group(a, b, g, 1, s[1], o[1]);
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    const __m512 x_sum = _mm512_set1_ps(a.x_sums[(r0 + m) * (a.k / a.group) + g]);
    for (int h = 0; h < 2; ++h) acc[m][h] = _mm512_fmadd_ps(o[h], x_sum, _mm512_fmadd_ps(s[h], part[m][h], acc[m][h]));
  }
}

// 8 bits, rows [r0, r0 + M) of block b: per group, the int8 values (exact in float32) against x
// in float32 FMAs, then s * sum(x q) + o * sum(x).
template <int M>
TY_QUANT_TARGET void tile8(const QuantArgs& a, int64_t r0, int64_t b) {
  const int64_t groups = a.k / a.group;
  const uint8_t* p = a.packed + b * a.k * kCols;
  const float* x = a.xf + r0 * a.k;
  __m512 acc[M][2];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[M][2];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) part[m][0] = part[m][1] = _mm512_setzero_ps();
    for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k, p += kCols) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m512 xs = _mm512_set1_ps(x[m * a.k + k]);
        part[m][0] = _mm512_fmadd_ps(xs, q0, part[m][0]);
        part[m][1] = _mm512_fmadd_ps(xs, q1, part[m][1]);
      }
    }
    fold_group<M>(a, b, g, r0, part, acc);
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) store_row(a, acc[m][0], r0 + m, b * kCols), store_row(a, acc[m][1], r0 + m, b * kCols + 16);
}

// Where a tile reads the 64 weights of (block b, inputs k, k + 1) as bfloat16 pairs (lo: columns
// 0-15, hi: 16-31, each 32-bit lane (w[c, k], w[c, k + 1]) as integers, exact in bfloat16): the
// packed 4-bit block unpacked in registers (each pass streams it from memory), or the block widened
// once into a buffer (many rows: every pass after the widening reads it from cache).
struct NibblePairs {
  const uint8_t* p;
  __m512i lut;
  TY_QUANT_TARGET inline void next(__m512i& lo, __m512i& hi) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
    load_nibble_pairs(p, lut, lo, hi);
    p += kCols;
  }
};

struct WidenedPairs {
  const uint16_t* p;  // bfloat16 [K / 2][2 halves][32]
  TY_QUANT_TARGET inline void next(__m512i& lo, __m512i& hi) {
    lo = _mm512_loadu_si512(p);
    hi = _mm512_loadu_si512(p + kCols);
    p += 2 * kCols;
  }
};

// Rows [r0, r0 + M) of block b from bfloat16 pairs (4 bits; 8 bits widened): per group, the integer
// weights against bfloat16 x pairs (vdpbf16ps: exact products, float32 sums), then s * sum(x n) +
// o * sum(x).
template <int M, typename Pairs>
TY_QUANT_TARGET void tile_pairs(const QuantArgs& a, int64_t r0, int64_t b, Pairs src) {
  const int64_t groups = a.k / a.group;
  __m512 acc[M][2];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[M][2];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) part[m][0] = part[m][1] = _mm512_setzero_ps();
    for (int64_t k = g * a.group; k < (g + 1) * a.group; k += 2) {
      __m512i lo, hi;
      src.next(lo, hi);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        int32_t pair;  // x[k] in the low half, x[k + 1] in the high
        std::memcpy(&pair, a.xb + (r0 + m) * a.x_stride + k, sizeof pair);
        const __m512bh xs = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        part[m][0] = _mm512_dpbf16_ps(part[m][0], xs, reinterpret_cast<__m512bh>(lo));
        part[m][1] = _mm512_dpbf16_ps(part[m][1], xs, reinterpret_cast<__m512bh>(hi));
      }
    }
    fold_group<M>(a, b, g, r0, part, acc);
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) store_row(a, acc[m][0], r0 + m, b * kCols), store_row(a, acc[m][1], r0 + m, b * kCols + 16);
}

template <int M>
TY_QUANT_TARGET void tile4(const QuantArgs& a, int64_t r0, int64_t b) {
  tile_pairs<M>(a, r0, b, NibblePairs{a.packed + b * a.k * (kCols / 2), _mm512_load_si512(kNibbleBf16)});
}

// 8 bits at more than kMaxRows rows (an even group): block b is widened once into bfloat16 pairs,
// then passes of kMaxRows rows read it from cache with the 4-bit tile's arithmetic: the widening is
// paid once per block, not once per pass. Measured against passes of 6 and 8 rows (slower) and
// against widening the 4-bit blocks too (slower than unpacking nibbles in registers each pass).

alignas(64) constexpr int16_t kPairLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                              8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr int16_t kPairHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// 32 int16 -> 32 bfloat16 (exact: |v| <= 128).
TY_QUANT_TARGET inline __m512i int16_to_bf16(__m512i v) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
}

// Block b's 8-bit weights into ``pairs`` bfloat16 [K / 2][2 halves][32] (WidenedPairs' layout).
TY_QUANT_TARGET void widen_block8(const QuantArgs& a, int64_t b, uint16_t* pairs) {
  const __m512i low_index = _mm512_load_si512(kPairLow), high_index = _mm512_load_si512(kPairHigh);
  const uint8_t* p = a.packed + b * a.k * kCols;
  for (int64_t k = 0; k < a.k; k += 2, p += 2 * kCols, pairs += 2 * kCols) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
    const __m512i k0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i k1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kCols)));
    _mm512_storeu_si512(pairs, int16_to_bf16(_mm512_permutex2var_epi16(k0, low_index, k1)));
    _mm512_storeu_si512(pairs + kCols, int16_to_bf16(_mm512_permutex2var_epi16(k0, high_index, k1)));
  }
}

template <int M>
TY_QUANT_TARGET void tile_widened(const QuantArgs& a, int64_t r0, int64_t b, const uint16_t* pairs) {
  tile_pairs<M>(a, r0, b, WidenedPairs{pairs});
}

using TileFn = void (*)(const QuantArgs&, int64_t, int64_t);
using WideTileFn = void (*)(const QuantArgs&, int64_t, int64_t, const uint16_t*);

TileFn tile_for(int bits, int rows) {
  static constexpr TileFn tiles4[kMaxRows] = {tile4<1>, tile4<2>, tile4<3>, tile4<4>};
  static constexpr TileFn tiles8[kMaxRows] = {tile8<1>, tile8<2>, tile8<3>, tile8<4>};
  return (bits == 4 ? tiles4 : tiles8)[rows - 1];
}

WideTileFn wide_tile_for(int rows) {
  static constexpr WideTileFn tiles[kMaxRows] = {tile_widened<1>, tile_widened<2>, tile_widened<3>, tile_widened<4>};
  return tiles[rows - 1];
}

void linear_blocks(const QuantArgs& a, int bits, int64_t b0, int64_t b1) {
  const bool wide = wide_rows(a, bits);
  std::vector<uint16_t> pairs(wide ? a.k * kCols : 0);
  for (int64_t b = b0; b < b1; ++b) {
    if (wide) widen_block8(a, b, pairs.data());
    for (int64_t r = 0; r < a.rows; r += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, a.rows - r));
      if (wide) wide_tile_for(rows)(a, r, b, pairs.data());
      else tile_for(bits, rows)(a, r, b);
    }
  }
}

TY_QUANT_TARGET inline void store_weights(const QuantArgs& a, __m512 w, void* out, bool bf16, int64_t k, int64_t col) {
  if (col >= a.n) return;
  const int64_t left = a.n - col;
  const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
  if (bf16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + k * a.n + col, mask,
                             reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w)));
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + k * a.n + col, mask, w);
  }
}

// Block b's columns of w^T into out [K, N] (float32 or bfloat16): w = fma(n, s, o) per element.
TY_QUANT_TARGET void dequantize_block(const QuantArgs& a, int bits, int64_t b, void* out, bool bf16) {
  const uint8_t* p = a.packed + b * a.k * (bits * kCols / 8);
  const __m512i lut = _mm512_load_si512(kNibbleBf16);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t g = 0; g * a.group < a.k; ++g) {
    __m512 s[2], o[2];
    load_group(a, b, g, 0, s[0], o[0]);
    load_group(a, b, g, 1, s[1], o[1]);
    for (int64_t k = g * a.group; k < (g + 1) * a.group;) {
      if (bits == 8) {
        __m512 w[2];
        load_weights8(p, s, o, w);
        for (int h = 0; h < 2; ++h) store_weights(a, w[h], out, bf16, k, b * kCols + 16 * h);
        p += kCols;
        k += 1;
        continue;
      }
      __m512i pairs[2];
      load_nibble_pairs(p, lut, pairs[0], pairs[1]);
      for (int h = 0; h < 2; ++h) {  // bfloat16 pair lanes: k in the low half, k + 1 in the high
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs[h], 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pairs[h], high_half));
        store_weights(a, _mm512_fmadd_ps(even, s[h], o[h]), out, bf16, k, b * kCols + 16 * h);
        store_weights(a, _mm512_fmadd_ps(odd, s[h], o[h]), out, bf16, k + 1, b * kCols + 16 * h);
      }
      p += kCols;
      k += 2;
    }
  }
}
#endif  // TY_HAVE_X86_COPIES

bool supported() {
#if TY_HAVE_X86_COPIES
  if (!cpu_has(Isa::avx512)) return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// Checks the layout's tensors (see the file comment) and fills everything in QuantArgs but x and y.
QuantArgs describe(const at::Tensor& packed, int64_t bits, int64_t group, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& offsets, double zero,
                   int64_t out_features) {
  TORCH_CHECK(supported(), "quant_linear: this CPU lacks AVX-512 BF16 (quant_linear_supported)");
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, not ", bits);
  const int64_t blocks = (out_features + kCols - 1) / kCols;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(0) == blocks &&
                  packed.size(2) == bits * kCols / 8 && packed.element_size() == 1,
              "quant_linear: packed must be a contiguous 8-bit [ceil(out / 32), K, bits * 4]");
  const int64_t k = packed.size(1);
  TORCH_CHECK(group > 0 && k % group == 0 && (bits == 8 || group % 2 == 0), "quant_linear: group ", group,
              " must divide K ", k, " (and be even for 4 bits)");
  const auto type = scales.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
              "quant_linear: scales must be float32, bfloat16 or float16");
  const auto params_ok = [&](const at::Tensor& t) {
    return t.is_contiguous() && t.dim() == 3 && t.size(0) == blocks && t.size(1) == k / group && t.size(2) == kCols;
  };
  TORCH_CHECK(params_ok(scales), "quant_linear: scales must be a contiguous [ceil(out / 32), K / group, 32]");
  const bool has_zeros = zeros.has_value() && zeros->defined();
  const bool has_offsets = offsets.has_value() && offsets->defined();
  TORCH_CHECK(!has_zeros || (params_ok(*zeros) && zeros->scalar_type() == at::kByte),
              "quant_linear: zeros must be a uint8 tensor shaped as scales");
  TORCH_CHECK(!has_offsets || (params_ok(*offsets) && offsets->scalar_type() == type),
              "quant_linear: offsets must be shaped as scales, in their dtype");
  QuantArgs a{};
  a.packed = static_cast<const uint8_t*>(packed.data_ptr());
  a.scales = scales.data_ptr();
  a.zeros = has_zeros ? static_cast<const uint8_t*>(zeros->data_ptr()) : nullptr;
  a.offsets = has_offsets ? offsets->data_ptr() : nullptr;
  a.scale_type = type == at::kFloat ? ScaleType::f32 : type == at::kBFloat16 ? ScaleType::bf16 : ScaleType::f16;
  a.n = out_features;
  a.k = k;
  a.group = group;
  a.blocks = blocks;
  a.zero = static_cast<float>(zero);
  return a;
}

// sums [rows, k / group]: each group's sum of x (bfloat16 [rows, k], row stride x_stride) in float32, in k order.
void group_sums(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t k, int64_t group, float* sums) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < k / group; ++g) {
      float sum = 0.0f;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) {
        const uint32_t bits = static_cast<uint32_t>(x[m * x_stride + i]) << 16;
        float value;
        std::memcpy(&value, &bits, sizeof value);
        sum += value;
      }
      sums[m * (k / group) + g] = sum;
    }
  }
}

}  // namespace

bool quant_linear_supported() { return supported(); }

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t group,
                        const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                        const c10::optional<at::Tensor>& offsets, double zero, int64_t out_features,
                        const c10::optional<at::Tensor>& bias) {
  QuantArgs a = describe(packed, bits, group, scales, zeros, offsets, zero, out_features);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == a.k && x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be a CPU bfloat16 [M, K] with K = ", a.k);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                            bias->numel() == out_features),
              "quant_linear: bias must be a contiguous [out_features] in x's dtype");
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
  const at::Tensor xc = x.stride(1) == 1 && x.stride(0) % 2 == 0 ? x : x.contiguous();
  at::Tensor widened, sums;
  a.rows = x.size(0);
  if (bits == 8 && !wide_rows(a, 8)) {
    widened = xc.to(at::kFloat).contiguous();  // bfloat16 widens exactly
    a.xf = widened.data_ptr<float>();
  }
  a.xb = static_cast<const uint16_t*>(xc.data_ptr());
  a.x_stride = xc.stride(0);
  sums = at::empty({xc.size(0), a.k / group}, x.options().dtype(at::kFloat));
  group_sums(a.xb, a.x_stride, xc.size(0), a.k, group, sums.data_ptr<float>());
  a.x_sums = sums.data_ptr<float>();
  a.bias = has_bias ? bias->data_ptr() : nullptr;
  a.y = y.data_ptr();
#if TY_HAVE_X86_COPIES
  at::parallel_for(0, a.blocks, 1, [&](int64_t b0, int64_t b1) { linear_blocks(a, static_cast<int>(bits), b0, b1); });
#endif
  return y;
}

at::Tensor quant_dequantize_t(const at::Tensor& packed, int64_t bits, int64_t group, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& offsets,
                              double zero, int64_t out_features, const std::string& dtype) {
  QuantArgs a = describe(packed, bits, group, scales, zeros, offsets, zero, out_features);
  TORCH_CHECK(dtype == "float32" || dtype == "bfloat16", "quant_dequantize_t: dtype must be float32 or bfloat16");
  const bool bf16 = dtype == "bfloat16";
  at::Tensor out = at::empty({a.k, out_features}, packed.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
#if TY_HAVE_X86_COPIES
  at::parallel_for(0, a.blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      dequantize_block(a, static_cast<int>(bits), b, out.data_ptr(), bf16);
    }
  });
#endif
  return out;
}

}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int bits, int group, Tensor scales, Tensor? zeros, Tensor? offsets, "
        "float zero, int out_features, Tensor? bias) -> Tensor");
  m.def("quant_dequantize_t(Tensor packed, int bits, int group, Tensor scales, Tensor? zeros, Tensor? offsets, "
        "float zero, int out_features, str dtype) -> Tensor");
  m.def("quant_linear_supported() -> bool", &tengyun::quant_linear_supported);
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) {
  m.impl("quant_linear", &tengyun::quant_linear);
  m.impl("quant_dequantize_t", &tengyun::quant_dequantize_t);
}
