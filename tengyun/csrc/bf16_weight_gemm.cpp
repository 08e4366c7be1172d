// Linear layers with bfloat16 weights on cores that have no bfloat16 arithmetic (AVX2 + FMA, no
// AVX512-BF16): there oneDNN refuses to pack a bfloat16 weight, and F.linear's own bfloat16 GEMM
// runs at ~19 GFLOP/s on 2 cores against ~135 for float32 (benchmarks/README.md, "An AVX2 machine").
//
// The weight stays as loaded, bfloat16 [N, K] row-major: half the bytes of float32, which is what a
// decode step streams. Each run of 8 weights is widened to float32 in registers (bfloat16 is the
// high half of a float32: zero-extend and shift left by 16, exact) and multiplied with FMA into
// float32 sums, one per (row, output), reduced across the 8 lanes once at the end of K. x's rows
// are read as float32 (a bfloat16 x is widened once into a scratch copy, exact).
//
// A tile multiplies R rows of x by NB rows of W (R * NB sums in registers). Rows of x are taken in
// blocks of kRowBlock (their float32 copy stays in L2); inside a block every tile of NB weight
// rows makes R-row passes over the block, the later passes reading those weight rows from L1. So
// one to four rows stream the weight once at memory speed, and a prefill of hundreds of rows
// reads it once per kRowBlock rows.
//
// torch.ops.tengyun.bf16_weight_gemm(x, weight, bias) -> y
//   x [M, K] bfloat16 or float32 with unit last stride; weight [N, K] bfloat16, contiguous;
//   bias [N] in x's dtype, contiguous, or None. y [M, N] in x's dtype: float32 sums (+ bias in
//   float32), rounded once (bfloat16: to nearest even, as torch's conversion).
// torch.ops.tengyun.bf16_weight_gemm_supported() -> bool: the AVX2 copies run here (AVX2, FMA and
//   F16C, and the active instruction set is not "generic", cpu_isa.h); the op refuses otherwise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "half_convert.h"

namespace tengyun {
namespace {

constexpr int kMaxRows = 4;         // x rows per tile
constexpr int64_t kRowBlock = 64;   // x rows whose float32 copy one thread walks through per weight tile
constexpr int64_t kGrainRows = 24;  // weight rows per parallel task (a multiple of every NB)

struct Bf16GemmArgs {
  const float* x;        // [rows][k] float32 (x itself, or its widened copy)
  int64_t x_stride;      // floats from one x row to the next
  const uint16_t* w;     // [n][k] bfloat16 bits
  const float* bias;     // [n] float32, or nullptr
  float* y;              // [rows][n] float32 sums; y_bf16 when set
  uint16_t* y_bf16;      // [rows][n] bfloat16 output, or nullptr
  int64_t rows, n, k;
};

inline uint16_t round_to_bf16(float value) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline void store(const Bf16GemmArgs& a, int64_t r, int64_t n, float sum) {
  if (a.bias != nullptr) sum += a.bias[n];
  if (a.y_bf16 != nullptr) {
    a.y_bf16[r * a.n + n] = round_to_bf16(sum);
  } else {
    a.y[r * a.n + n] = sum;
  }
}

#if TY_HAVE_X86_COPIES
#define TY_BF16W_TARGET __attribute__((target("avx2,fma,f16c")))

TY_BF16W_TARGET inline __m256 widen8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

TY_BF16W_TARGET inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Sums of x rows [r0, r0 + R) times weight rows [n0, n0 + NB) over all of K.
template <int R, int NB>
TY_BF16W_TARGET void tile(const Bf16GemmArgs& a, int64_t r0, int64_t n0) {
  __m256 acc[R][NB];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  const float* x = a.x + r0 * a.x_stride;
  const uint16_t* w = a.w + n0 * a.k;
  const int64_t whole = a.k / 8 * 8;
  for (int64_t k = 0; k < whole; k += 8) {
    __m256 wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = widen8(w + j * a.k + k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * a.x_stride + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      float sum = hsum(acc[r][j]);
      for (int64_t k = whole; k < a.k; ++k) sum += x[r * a.x_stride + k] * bf16_to_float(w[j * a.k + k]);
      store(a, r0 + r, n0 + j, sum);
    }
  }
}

// Weight rows per tile for R rows of x: R * NB sums, NB widened weights and one x vector in the 16
// ymm registers.
template <int R>
constexpr int tile_width() { return R == 1 ? 4 : R == 2 ? 4 : R == 3 ? 3 : 3; }

template <int R>
TY_BF16W_TARGET void pass(const Bf16GemmArgs& a, int64_t r0, int64_t n0, int64_t n1) {
  constexpr int NB = tile_width<R>();
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) tile<R, NB>(a, r0, n);
  for (; n < n1; ++n) tile<R, 1>(a, r0, n);
}

// Weight rows [n0, n1), every row of x: row blocks outermost, then tiles of weight rows, each
// making its R-row passes over the block.
TY_BF16W_TARGET void run(const Bf16GemmArgs& a, int64_t n0, int64_t n1) {
  constexpr int64_t kTileRows = 12;  // weight rows whose passes run back to back (in L1 meanwhile)
  for (int64_t b0 = 0; b0 < a.rows; b0 += kRowBlock) {
    const int64_t b1 = std::min(a.rows, b0 + kRowBlock);
    for (int64_t t0 = n0; t0 < n1; t0 += kTileRows) {
      const int64_t t1 = std::min(n1, t0 + kTileRows);
      for (int64_t r = b0; r < b1; r += kMaxRows) {
        switch (std::min<int64_t>(kMaxRows, b1 - r)) {
          case 1: pass<1>(a, r, t0, t1); break;
          case 2: pass<2>(a, r, t0, t1); break;
          case 3: pass<3>(a, r, t0, t1); break;
          default: pass<4>(a, r, t0, t1); break;
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

at::Tensor bf16_weight_gemm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "bf16_weight_gemm: this CPU lacks AVX2 + FMA (bf16_weight_gemm_supported)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bf16_weight_gemm: x must be a CPU float32 or bfloat16 [M, K] with unit last stride");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16 && weight.size(1) == x.size(1),
              "bf16_weight_gemm: weight must be a contiguous bfloat16 [N, K] with x's K (", x.size(1), ")");
  const int64_t rows = x.size(0), n = weight.size(0), k = x.size(1);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == n,
                "bf16_weight_gemm: bias must be a contiguous [N] in x's dtype");
  }
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  const at::Tensor x32 = bf16_x ? x.to(at::kFloat) : x;  // exact: bfloat16 widens to float32
  const at::Tensor bias32 = has_bias ? bias->to(at::kFloat) : at::Tensor();
  Bf16GemmArgs a{x32.data_ptr<float>(), x32.stride(0), reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                 has_bias ? bias32.data_ptr<float>() : nullptr, bf16_x ? nullptr : y.data_ptr<float>(),
                 bf16_x ? reinterpret_cast<uint16_t*>(y.data_ptr()) : nullptr, rows, n, k};
#if TY_HAVE_X86_COPIES
  at::parallel_for(0, (n + kGrainRows - 1) / kGrainRows, 1, [&](int64_t g0, int64_t g1) {
    run(a, g0 * kGrainRows, std::min(n, g1 * kGrainRows));
  });
#endif
  return y;
}

}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("bf16_weight_gemm(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("bf16_weight_gemm_supported() -> bool", &tengyun::bf16_weight_gemm_supported);
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) { m.impl("bf16_weight_gemm", &tengyun::bf16_weight_gemm); }
