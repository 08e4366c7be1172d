// Linear layers with bfloat16 weights on cores that have no bfloat16 arithmetic (AVX2 + FMA, no
// AVX512-BF16): there oneDNN refuses to pack a bfloat16 weight, and F.linear's own bfloat16 GEMM
// runs at ~19 GFLOP/s on 2 cores against ~135 for float32 (benchmarks/README.md, "An AVX2 machine").
//
// The weight is packed once (platforms/cpu/kernels/bf16_weights.py pack_weight) in oneDNN's
// bfloat16 inner-product layout with 16-column blocks, K in pairs:
//   packed [Npad / 16][Kpad / 2][16][2]: element (n, k) at (n / 16) * Kpad * 16 + (k / 2) * 32
//                                        + (n % 16) * 2 + k % 2
// (Npad: N rounded up to 16, Kpad: K rounded up to 2; padding is zero), half the bytes of float32,
// which is what a decode step streams. One 32-byte load holds 8 columns' (k, k + 1) pairs: shifted
// left by 16 it is those columns' float32 weights at k, masked to the high halves their weights at
// k + 1 (bfloat16 is the high half of a float32: exact). Each is multiplied with FMA against x[r][k]
// (or x[r][k + 1]) broadcast, so every output column keeps its float32 sum in its own lane: a tile
// of R <= 4 rows x 16 columns holds 8 sums in registers and needs no reduction across lanes. The
// weight is read front to back, one block after another, at memory speed.
//
// x's rows are read as float32 with K padded to Kpad (a scratch copy, exact). Rows are taken in
// blocks of kRowBlock (their copy stays in L2); inside a block each 16-column block of the weight
// makes passes of 4 rows, the later ones reading it from L1/L2. One op for every row count: on an
// AMD EPYC without AVX-512 it ran SmolLM2's projections level with oneDNN's float32 up to 256 rows
// and at ~0.8x at 512, and ahead of widening the weight to float32 for F.linear at every count
// (benchmarks/README.md, "An AVX2 machine").
//
// torch.ops.tengyun.bf16_weight_gemm(x, packed, out_features, bias) -> y
//   x [M, K] bfloat16 or float32 with unit last stride; packed as above, bfloat16, contiguous,
//   [ceil(out_features / 16), ceil(K / 2), 16, 2]; bias [out_features] in x's dtype, contiguous, or
//   None. y [M, out_features] in x's dtype: float32 sums (+ bias in float32), rounded once (bfloat16:
//   to nearest even, as torch's conversion).
// torch.ops.tengyun.bf16_weight_gemm_supported() -> bool: the AVX2 copies run here (AVX2, FMA and
//   F16C, and the active instruction set is not "generic", cpu_isa.h); the op refuses otherwise.
// The packed rows also serve a tied embedding's lookups: packed_gemv.cpp's packed_rows with block 16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_isa.h"

namespace tengyun {
namespace {

constexpr int64_t kBlock = 16;      // output columns per packed block (two float32 vectors)
constexpr int kMaxRows = 4;         // x rows per tile (4 x 2 sums, 4 widened weights, 2 broadcasts)
constexpr int64_t kRowBlock = 64;   // x rows whose float32 copy a pass over the weight walks through
// Each tile prefetches the weight this far ahead of its loads (a block is read front to back).
constexpr int64_t kPrefetchBytes = 2048;

struct Bf16GemmArgs {
  const float* x;        // [rows][k_pad] float32, zero past k
  const uint16_t* w;     // packed bfloat16 bits, as above
  const float* bias;     // [n] float32, or nullptr
  float* y;              // [rows][n] float32 output, or nullptr when y_bf16 is set
  uint16_t* y_bf16;      // [rows][n] bfloat16 output, or nullptr
  int64_t rows, n, k_pad;
};

inline uint16_t round_to_bf16(float value) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Row r's sums for columns n0 .. n0 + 16 (clipped at a.n), plus bias, in the output dtype.
inline void store(const Bf16GemmArgs& a, int64_t r, int64_t n0, const float (&sums)[kBlock]) {
  const int64_t count = std::min(kBlock, a.n - n0);
  for (int64_t j = 0; j < count; ++j) {
    const float value = a.bias != nullptr ? sums[j] + a.bias[n0 + j] : sums[j];
    if (a.y_bf16 != nullptr) {
      a.y_bf16[r * a.n + n0 + j] = round_to_bf16(value);
    } else {
      a.y[r * a.n + n0 + j] = value;
    }
  }
}

#if TY_HAVE_X86_COPIES
#define TY_BF16W_TARGET __attribute__((target("avx2,fma,f16c")))

// Sums of x rows [r0, r0 + R) times block b's 16 columns over all of K.
template <int R>
TY_BF16W_TARGET void tile(const Bf16GemmArgs& a, int64_t r0, int64_t b) {
  __m256 acc[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint16_t* w = a.w + b * a.k_pad * kBlock;
  const float* x = a.x + r0 * a.k_pad;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t pairs = a.k_pad / 2;
  for (int64_t p = 0; p < pairs; ++p, w += 2 * kBlock) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));            // columns 0-7
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlock));   // columns 8-15
    const __m256 lo_k = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
    const __m256 lo_k1 = _mm256_castsi256_ps(_mm256_and_si256(lo, high));
    const __m256 hi_k = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
    const __m256 hi_k1 = _mm256_castsi256_ps(_mm256_and_si256(hi, high));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xk = _mm256_broadcast_ss(x + r * a.k_pad + 2 * p);
      const __m256 xk1 = _mm256_broadcast_ss(x + r * a.k_pad + 2 * p + 1);
      acc[r][0] = _mm256_fmadd_ps(xk, lo_k, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xk, hi_k, acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(xk1, lo_k1, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xk1, hi_k1, acc[r][1]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float sums[kBlock];
    _mm256_storeu_ps(sums, acc[r][0]);
    _mm256_storeu_ps(sums + 8, acc[r][1]);
    store(a, r0 + r, b * kBlock, sums);
  }
}

// Blocks [b0, b1), every row of x: row blocks outermost, then each weight block's 4-row passes.
TY_BF16W_TARGET void run(const Bf16GemmArgs& a, int64_t b0, int64_t b1) {
  for (int64_t rb = 0; rb < a.rows; rb += kRowBlock) {
    const int64_t re = std::min(a.rows, rb + kRowBlock);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r = rb; r < re; r += kMaxRows) {
        switch (std::min<int64_t>(kMaxRows, re - r)) {
          case 1: tile<1>(a, r, b); break;
          case 2: tile<2>(a, r, b); break;
          case 3: tile<3>(a, r, b); break;
          default: tile<4>(a, r, b); break;
        }
      }
    }
  }
}
#endif  // TY_HAVE_X86_COPIES

bool supported() {
#if TY_HAVE_X86_COPIES
  return active_isa != Isa::generic && cpu_has(Isa::avx2);
#else
  return false;
#endif
}

}  // namespace

bool bf16_weight_gemm_supported() { return supported(); }

at::Tensor bf16_weight_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "bf16_weight_gemm: this CPU lacks AVX2 + FMA (bf16_weight_gemm_supported)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bf16_weight_gemm: x must be a CPU float32 or bfloat16 [M, K] with unit last stride");
  const int64_t rows = x.size(0), k = x.size(1), k_pad = (k + 1) / 2 * 2;
  TORCH_CHECK(out_features > 0 && packed.device().is_cpu() && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(0) == (out_features + kBlock - 1) / kBlock && packed.size(1) == k_pad / 2 &&
                  packed.size(2) == kBlock && packed.size(3) == 2,
              "bf16_weight_gemm: packed must be a contiguous bfloat16 [ceil(N / 16), ceil(K / 2), 16, 2] for N = ",
              out_features, " and x's K = ", k);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == out_features,
                "bf16_weight_gemm: bias must be a contiguous [N] in x's dtype");
  }
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  at::Tensor x32 = at::empty({rows, k_pad}, x.options().dtype(at::kFloat));  // exact: bfloat16 widens
  x32.narrow(1, 0, k).copy_(x);
  if (k_pad > k) x32.narrow(1, k, k_pad - k).zero_();
  const at::Tensor bias32 = has_bias ? bias->to(at::kFloat) : at::Tensor();
  const bool bf16_out = x.scalar_type() == at::kBFloat16;
  Bf16GemmArgs a{x32.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                 has_bias ? bias32.data_ptr<float>() : nullptr, bf16_out ? nullptr : y.data_ptr<float>(),
                 bf16_out ? reinterpret_cast<uint16_t*>(y.data_ptr()) : nullptr, rows, out_features, k_pad};
#if TY_HAVE_X86_COPIES
  at::parallel_for(0, packed.size(0), 1, [&](int64_t b0, int64_t b1) { run(a, b0, b1); });
#endif
  return y;
}

}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("bf16_weight_gemm(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("bf16_weight_gemm_supported() -> bool", &tengyun::bf16_weight_gemm_supported);
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) { m.impl("bf16_weight_gemm", &tengyun::bf16_weight_gemm); }
