// W8A8 linear layers for a few rows (decode at batch 1-8) in one call: activations quantised to
// int8, int32 sums with AVX-512 VNNI (vpdpbusd), rescaled to the output dtype (+ bias).
//
// The weight is the checkpoint's int8 [N, K], row-major, as torch._int_mm reads it (its .t()) for
// larger batches: one copy serves both. Each output's K bytes are contiguous, so a 64-byte load is
// 64 inputs of one output; a tile keeps C outputs x M rows of 16-lane int32 sums and reduces them
// across lanes once at the end (16 sums per tree of 45 ops).
//
// vpdpbusd multiplies unsigned by signed bytes: the weight goes in as u = w + 128 (w XOR 0x80 as a
// byte, 0..255, one vpxorq per load) against the signed x_q, so sum_k u_k x_k = sum_k w_k x_k +
// 128 sum_k x_k, and the row's correction -128 sum_k x_q,k (computed while quantising) takes it
// back out: no extra tensor per output. vpdpbusd adds the four u8 x s8 products to int32 without
// saturation, so every sum is exact modulo 2^32, i.e. torch._int_mm's (exact while |x_q . w| <
// 2^31, K < 2^17).
//
// torch.ops.tengyun.w8a8_gemv(x, weight, weight_scale, bias, quant_bias, input_scale_reciprocal,
//                             input_offset) -> y
//   x [M, K] float32 or bfloat16 (unit last stride), M <= 64; weight int8 [N, K] contiguous;
//   weight_scale [N] (or [N, 1]) float32, bfloat16 or float16, contiguous; bias [N] in x's dtype or
//   None; quant_bias int32 [N] or None (msModelSlim: added to the int32 sums).
//   input_scale_reciprocal None: per-token dynamic quantisation (quant_kernels.quantize_per_token):
//     s_x = max(max|x|, 1e-10) / 127, x_q = clamp(rint(x / s_x), -128, 127);
//     y = round(float(acc) * s_x * float(weight_scale)), then round(y + bias).
//   input_scale_reciprocal, input_offset float32 [1] (quant_kernels.quantize_per_tensor):
//     x_q = clamp(rint(x * r + offset), -128, 127); y = round(float(acc + quant_bias) * weight_scale).
//   Same float32 operations in the same order as the PyTorch ops: bit-equal outputs.
// torch.ops.tengyun.w8a8_gemv_supported() -> bool: this CPU has AVX-512 F/BW/VL/DQ + VNNI (and the
//   AVX-512 copies are the active ones, cpu_isa.h); the op refuses to run otherwise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_isa.h"

namespace tengyun {
namespace {

constexpr int kMaxRows = 8;      // rows per tile pass (register budget: 16 sums)
constexpr int64_t kMaxOpRows = 64;  // rows per call: past 8, each tile of 2 outputs runs 8 rows at a time
constexpr int64_t kChunk = 64;  // inputs per vpdpbusd
// Tiles run front to back through the weight: each 64-byte load prefetches the line this far ahead
// (a tile's C rows are C * K contiguous bytes, so the prefetches cover the weight once, in order).
constexpr int64_t kPrefetchBytes = 8192;

enum class ScaleType { f32, bf16, f16 };

struct Int8GemvArgs {
  const int8_t* xq;          // [rows][k_pad] x_q, zero past k
  const float* s_x;          // [rows] (1 for static quantisation)
  const int32_t* row_offset; // [rows] -128 sum_k x_q
  const int8_t* w;           // [n][k]
  const void* s_w;           // [n] in s_w_type
  const int32_t* quant_bias; // [n] or nullptr
  const void* bias;          // [n] in the output dtype, or nullptr
  void* y;                   // [rows][n]
  int64_t rows, n, k, k_pad;
  bool bf16;                 // x, bias and y: bfloat16, else float32
  ScaleType s_w_type;
};

#if TY_HAVE_X86_COPIES
#define TY_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

TY_INT8_TARGET inline __m512 from_bf16_bits(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// v as computed: the compiler may not fuse the product that made it into a later add (GCC contracts
// _mm512_mul_ps + _mm512_add_ps into an fma by default; torch rounds the product first).
TY_INT8_TARGET inline __m512 rounded(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

TY_INT8_TARGET inline __m512 load_floats(const void* p, bool bf16, int64_t i, __mmask16 mask) {
  if (!bf16) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
  return from_bf16_bits(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i));
}

// One row -> x_q (k_pad bytes, zero past k); returns s_x (1 for static), *offset = -128 sum x_q.
// Dynamic: s = max(amax, 1e-10) / 127, q = rint(x / s) (a true division, as torch's x / s).
// Static: q = rint(x * r + offset), the product rounded before the sum (no fma), as torch.
TY_INT8_TARGET float quantize_row(int8_t* q_out, int32_t* offset, const void* x, bool bf16, int64_t k, int64_t k_pad,
                                  const float* static_quant) {
  float scale = 1.0f;
  if (static_quant == nullptr) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_floats(x, bf16, i, tail_mask(k - i))));
    const float m = _mm512_reduce_max_ps(amax);
    scale = (m > 1e-10f ? m : 1e-10f) / 127.0f;
  }
  const __m512 lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t i = 0; i < k_pad; i += 16) {
    const __mmask16 mask = tail_mask(k - i);  // zero when i >= k
    const __m512 v = load_floats(x, bf16, i, mask);
    __m512 q;
    if (static_quant == nullptr) {
      q = _mm512_div_ps(v, _mm512_set1_ps(scale));
    } else {
      const __m512 product = rounded(_mm512_mul_ps(v, _mm512_set1_ps(static_quant[0])));
      q = _mm512_add_ps(product, _mm512_set1_ps(static_quant[1]));
    }
    q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // half to even
    const __m512i qi = _mm512_maskz_cvtps_epi32(mask, _mm512_min_ps(_mm512_max_ps(q, lo), hi));
    sum = _mm512_add_epi32(sum, qi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q_out + i), _mm512_cvtepi32_epi8(qi));
  }
  *offset = -128 * _mm512_reduce_add_epi32(sum);
  return scale;
}

// v[i] -> lane i holds the sum of v[i]'s 16 lanes.
TY_INT8_TARGET __attribute__((always_inline)) inline __m512i reduce16(const __m512i (&v)[16]) {
  __m512i a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x88), _mm512_shuffle_i32x4(c[0], c[1], 0xdd));
}

// bfloat16 bits of v, rounded to nearest even as c10::BFloat16 (NaN -> 0x7fc0).
TY_INT8_TARGET inline __m256i to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}

TY_INT8_TARGET inline __m512 load_scales(const Int8GemvArgs& a, int64_t n0, __mmask16 mask) {
  if (a.s_w_type == ScaleType::f32) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(a.s_w) + n0);
  const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(a.s_w) + n0);
  return a.s_w_type == ScaleType::bf16 ? from_bf16_bits(h) : _mm512_cvtph_ps(h);
}

// Outputs [n0, n0 + cols) of row r from their int32 sums (lane c: output n0 + c).
TY_INT8_TARGET void store_row(const Int8GemvArgs& a, __m512i acc, int64_t r, int64_t n0, int64_t cols) {
  const __mmask16 mask = tail_mask(cols);
  acc = _mm512_add_epi32(acc, _mm512_set1_epi32(a.row_offset[r]));
  if (a.quant_bias != nullptr) acc = _mm512_add_epi32(acc, _mm512_maskz_loadu_epi32(mask, a.quant_bias + n0));
  const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(a.s_x[r]));
  const __m512 y = rounded(_mm512_mul_ps(scaled, load_scales(a, n0, mask)));
  if (!a.bf16) {  // the bias add is its own rounding (no fma), as torch's y + bias
    __m512 out = y;
    if (a.bias != nullptr) out = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, static_cast<const float*>(a.bias) + n0));
    _mm512_mask_storeu_ps(static_cast<float*>(a.y) + r * a.n + n0, mask, out);
    return;
  }
  __m256i out = to_bf16_bits(y);  // the rescale rounds to bf16, then the bias add rounds again
  if (a.bias != nullptr) {
    const __m256i b = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(a.bias) + n0);
    out = to_bf16_bits(_mm512_add_ps(from_bf16_bits(out), from_bf16_bits(b)));
  }
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.y) + r * a.n + n0, mask, out);
}

// Rows [r0, r0 + M) x outputs [n0, n0 + C) (clipped at n): M * C <= 16 sums of 16 lanes each.
template <int M, int C>
TY_INT8_TARGET void tile(const Int8GemvArgs& a, int64_t r0, int64_t n0) {
  const int8_t* w[C];
  for (int c = 0; c < C; ++c) w[c] = a.w + std::min(n0 + c, a.n - 1) * a.k;  // past n: a valid row, unused
  __m512i acc[M][C];  // registers: every index is a constant once the loops below unroll
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_si512();
  const int64_t full = a.k / kChunk * kChunk;
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(a.w + n0 * a.k) + kPrefetchBytes;  // may pass the end: a hint
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k = 0; k < a.k_pad; k += kChunk) {
    const __mmask64 mask = k < full ? ~__mmask64(0) : (__mmask64(1) << (a.k - k)) - 1;
    __m512i xs[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) xs[m] = _mm512_loadu_si512(a.xq + (r0 + m) * a.k_pad + k);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + (k / kChunk * C + c) * kChunk), _MM_HINT_T0);
      const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w[c] + k), flip);  // w + 128 as u8
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[m][c] = _mm512_dpbusd_epi32(acc[m][c], wv, xs[m]);
    }
  }
  __m512i v[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) v[i] = i < M * C ? acc[i / C][i % C] : _mm512_setzero_si512();
  alignas(64) int32_t lanes[16];  // lane m * C + c: row m, output n0 + c
  _mm512_store_si512(lanes, reduce16(v));
  const int64_t cols = std::min<int64_t>(C, a.n - n0);
  for (int m = 0; m < M; ++m) store_row(a, _mm512_maskz_loadu_epi32(tail_mask(C), lanes + m * C), r0 + m, n0, cols);
}

using TileFn = void (*)(const Int8GemvArgs&, int64_t, int64_t);

// Tile width per row count: C = 16 / M rounded down to a power of two; past 8 rows, 2.
int64_t tile_columns(int64_t rows) { return rows == 1 ? 16 : rows == 2 ? 8 : rows <= 4 ? 4 : 2; }

TileFn tile_for(int64_t rows, int64_t cols) {
  static constexpr TileFn tiles[kMaxRows] = {tile<1, 16>, tile<2, 8>, tile<3, 4>, tile<4, 4>,
                                             tile<5, 2>,  tile<6, 2>, tile<7, 2>, tile<8, 2>};
  static constexpr TileFn pairs[kMaxRows] = {tile<1, 2>, tile<2, 2>, tile<3, 2>, tile<4, 2>,
                                             tile<5, 2>, tile<6, 2>, tile<7, 2>, tile<8, 2>};
  return (cols == 2 ? pairs : tiles)[rows - 1];
}

// Outputs [t0 * cols, t1 * cols), every row: 8 rows at a time while the tile's weight rows sit in L1.
void run_tiles(const Int8GemvArgs& a, int64_t cols, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t r0 = 0; r0 < a.rows; r0 += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, a.rows - r0);
      tile_for(rows, cols)(a, r0, t * cols);
    }
  }
}
#endif  // TY_HAVE_X86_COPIES

bool supported() {
#if TY_HAVE_X86_COPIES
  __builtin_cpu_init();  // active_isa: paged_attention_isa("avx2") makes tests see a CPU without it
  return active_isa == Isa::avx512 && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

ScaleType scale_type(const at::Tensor& s_w, int64_t n) {
  TORCH_CHECK(s_w.is_contiguous() && s_w.numel() == n &&
                  (s_w.scalar_type() == at::kFloat || s_w.scalar_type() == at::kBFloat16 || s_w.scalar_type() == at::kHalf),
              "w8a8_gemv: weight_scale must be a contiguous float32, bfloat16 or float16 [N]");
  return s_w.scalar_type() == at::kFloat ? ScaleType::f32 : s_w.scalar_type() == at::kBFloat16 ? ScaleType::bf16 : ScaleType::f16;
}

void check_args(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                const c10::optional<at::Tensor>& quant_bias, const c10::optional<at::Tensor>& scale_reciprocal,
                const c10::optional<at::Tensor>& offset) {
  TORCH_CHECK(supported(), "w8a8_gemv: this CPU lacks AVX-512 VNNI (w8a8_gemv_supported)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(0) <= kMaxOpRows &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "w8a8_gemv: x must be a CPU float32 or bfloat16 [M <= 64, K] with unit last stride");
  const int64_t n = weight.size(0);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1) && n > 0 && x.size(1) < (int64_t(1) << 17),
              "w8a8_gemv: weight must be a contiguous int8 [N, K] with x's K (< 2^17)");
  if (given(bias)) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == n,
                "w8a8_gemv: bias must be a contiguous [N] in x's dtype");
  }
  if (given(quant_bias)) {
    TORCH_CHECK(quant_bias->scalar_type() == at::kInt && quant_bias->is_contiguous() && quant_bias->numel() == n,
                "w8a8_gemv: quant_bias must be a contiguous int32 [N]");
  }
  TORCH_CHECK(given(scale_reciprocal) == given(offset), "w8a8_gemv: pass input_scale_reciprocal and input_offset together");
  if (given(scale_reciprocal)) {
    TORCH_CHECK(scale_reciprocal->scalar_type() == at::kFloat && scale_reciprocal->numel() == 1 &&
                    offset->scalar_type() == at::kFloat && offset->numel() == 1,
                "w8a8_gemv: input_scale_reciprocal and input_offset must be float32 [1]");
  }
}

}  // namespace

bool w8a8_gemv_supported() { return supported(); }

at::Tensor w8a8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                     const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& quant_bias,
                     const c10::optional<at::Tensor>& input_scale_reciprocal,
                     const c10::optional<at::Tensor>& input_offset) {
  check_args(x, weight, bias, quant_bias, input_scale_reciprocal, input_offset);
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  const ScaleType s_w_type = scale_type(weight_scale, n);
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
#if TY_HAVE_X86_COPIES
  const int64_t k_pad = (k + kChunk - 1) / kChunk * kChunk;
  std::vector<int8_t> xq(rows * k_pad);
  std::vector<float> s_x(rows);
  std::vector<int32_t> row_offset(rows);
  float static_quant[2];
  const bool is_static = given(input_scale_reciprocal);
  if (is_static) static_quant[0] = *input_scale_reciprocal->data_ptr<float>(), static_quant[1] = *input_offset->data_ptr<float>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const char* x_bytes = static_cast<const char*>(x.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    s_x[r] = quantize_row(xq.data() + r * k_pad, row_offset.data() + r, x_bytes + r * x.stride(0) * x.element_size(),
                          bf16, k, k_pad, is_static ? static_quant : nullptr);
  }
  Int8GemvArgs a{xq.data(), s_x.data(), row_offset.data(), weight.data_ptr<int8_t>(), weight_scale.data_ptr(),
                 given(quant_bias) ? quant_bias->data_ptr<int32_t>() : nullptr, given(bias) ? bias->data_ptr() : nullptr,
                 y.data_ptr(), rows, n, k, k_pad, bf16, s_w_type};
  const int64_t cols = tile_columns(rows), tiles = (n + cols - 1) / cols;
  at::parallel_for(0, tiles, 16 / cols, [&](int64_t t0, int64_t t1) { run_tiles(a, cols, t0, t1); });
#endif
  return y;
}

}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("w8a8_gemv(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, Tensor? quant_bias, "
        "Tensor? input_scale_reciprocal, Tensor? input_offset) -> Tensor");
  m.def("w8a8_gemv_supported() -> bool", &tengyun::w8a8_gemv_supported);
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) { m.impl("w8a8_gemv", &tengyun::w8a8_gemv); }
