// W8A8 linear layers in one call for any number of rows: activations quantised to int8, int32
// sums with AVX-512 VNNI (vpdpbusd), rescaled to the output dtype (+ bias).
//
// The weight is repacked once (cpu_quant.pack_w8a8_weight) from the checkpoint's int8 [N, K] into
// packed uint8 [ceil(N / 16), quads = ceil(K / 4), 64]: block b, quad q holds outputs 16b..16b+15 x
// inputs 4q..4q+3 (byte 4j + i: output 16b + j, input 4q + i) as u = w + 128, zero weights (u =
// 128) past N and K. One vpdpbusd takes 16 outputs' 4 inputs against the row's 4 x_q bytes
// broadcast, so each output keeps its int32 sum in its own lane: a tile of R rows x C blocks holds
// R * C sums and reads C weight vectors per quad, with no reduction across lanes. Its panel of C
// blocks stays in L2 while every row passes, so one call serves decode (the weight streamed once,
// at memory speed) and prefill (measured faster than torch._int_mm, which repacks the weight on
// every call: benchmarks/README.md).
//
// vpdpbusd multiplies unsigned by signed bytes: the weight goes in as u = w + 128 against the
// signed x_q, so sum_k u_k x_k = sum_k w_k x_k + 128 sum_k x_k, and the row's correction
// -128 sum_k x_q,k (computed while quantising) takes it back out. vpdpbusd adds the four u8 x s8
// products to int32 without saturation, so every sum is exact modulo 2^32, i.e. torch._int_mm's
// (exact while |x_q . w| < 2^31, K < 2^17).
//
// torch.ops.tengyun.w8a8_packed_gemm(x, packed, weight_scale, bias, quant_bias, input_scale_reciprocal,
//                                    input_offset, n) -> y [M, n]
//   x [M, K] float32 or bfloat16 (unit last stride); packed as above; weight_scale [n] float32,
//   bfloat16 or float16, contiguous; bias [n] in x's dtype or None; quant_bias int32 [n] or None
//   (msModelSlim: added to the int32 sums).
//   input_scale_reciprocal None: per-token dynamic quantisation (quant_kernels.quantize_per_token):
//     s_x = max(max|x|, 1e-10) / 127, x_q = clamp(rint(x / s_x), -128, 127);
//     y = round(float(acc) * s_x * float(weight_scale)), then round(y + bias).
//   input_scale_reciprocal, input_offset float32 [1] (quant_kernels.quantize_per_tensor):
//     x_q = clamp(rint(x * r + offset), -128, 127); y = round(float(acc + quant_bias) * weight_scale).
//   Same float32 operations in the same order as the PyTorch ops: bit-equal outputs.
// torch.ops.tengyun.w8a8_packed_supported() -> bool: this CPU has AVX-512 F/BW/VL/DQ + VNNI (and the
//   AVX-512 copies are the active ones, cpu_isa.h); the op refuses to run otherwise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_isa.h"

namespace tengyun {
namespace {

constexpr int kMaxRows = 8;     // rows per tile (R * C sums + C weights in 32 registers)
constexpr int64_t kChunk = 64;  // x_q rows are padded to this many bytes (the quantiser's stride)
// Each of a tile's C weight streams prefetches the line this far ahead of its load.
constexpr int64_t kPrefetchBytes = 8192;

enum class ScaleType { f32, bf16, f16 };

struct Int8GemvArgs {
  const int8_t* xq;          // [rows][k_pad] x_q, zero past k
  const float* s_x;          // [rows] (1 for static quantisation)
  const int32_t* row_offset; // [rows] -128 sum_k x_q
  const uint8_t* w;          // packed [ceil(n / 16)][quads][64]
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

// Lanes [0, left) of 16: all for left >= 16, none for left <= 0.
inline __mmask16 tail_mask(int64_t left) {
  if (left <= 0) return 0;
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

// The most blocks of 16 outputs a tile of R rows holds: R * C sums + C weights in 32 registers.
constexpr int packed_columns(int rows) { return rows == 1 ? 8 : rows == 2 ? 6 : rows == 3 ? 5 : rows == 4 ? 4 : 3; }

inline int32_t load_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Rows [r0, r0 + R) x outputs [16 b0, 16 (b0 + C)) (clipped at n). Only C <= packed_columns(R)
// has a body: run_packed picks C for its tallest row group, and shorter groups may take more.
template <int R, int C>
TY_INT8_TARGET void packed_tile(const Int8GemvArgs& a, int64_t quads, int64_t r0, int64_t b0) {
  if constexpr (C <= packed_columns(R)) {
    const uint8_t* w = a.w + b0 * quads * 64;
    __m512i acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
    const int8_t* x = a.xq + r0 * a.k_pad;
    for (int64_t q = 0; q < quads; ++q) {
      __m512i wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (c * quads + q) * 64 + kPrefetchBytes), _MM_HINT_T0);
        wv[c] = _mm512_loadu_si512(w + (c * quads + q) * 64);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(load_quad(x + r * a.k_pad + 4 * q));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[c], xb);
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const int64_t n0 = (b0 + c) * 16, cols = std::min<int64_t>(16, a.n - n0);
      if (cols <= 0) break;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) store_row(a, acc[r][c], r0 + r, n0, cols);
    }
  }
}

using PackedFn = void (*)(const Int8GemvArgs&, int64_t, int64_t, int64_t);

template <int R, int... Cs>
constexpr std::array<PackedFn, sizeof...(Cs)> packed_row(std::integer_sequence<int, Cs...>) {
  return {packed_tile<R, Cs + 1>...};
}

template <int... Rs>
constexpr std::array<std::array<PackedFn, 8>, 8> packed_tiles(std::integer_sequence<int, Rs...>) {
  return {packed_row<Rs + 1>(std::make_integer_sequence<int, 8>())...};
}

constexpr auto kPackedTiles = packed_tiles(std::make_integer_sequence<int, 8>());

// Blocks [b0, b1) (one thread's share), every row: panels of at most C blocks and near-equal
// width, each in groups of at most 8 rows of near-equal size.
void run_packed(const Int8GemvArgs& a, int64_t quads, int C, int64_t b0, int64_t b1) {
  const int64_t groups = (a.rows + kMaxRows - 1) / kMaxRows;
  const int64_t panels = (b1 - b0 + C - 1) / C;
  for (int64_t p = 0, b = b0; p < panels; ++p) {
    const int cols = static_cast<int>((b1 - b) / (panels - p));  // the rest shared evenly
    for (int64_t g = 0, r0 = 0; g < groups; ++g) {
      const int64_t rows = (a.rows - r0) / (groups - g);  // the rest shared evenly: sizes differ by <= 1
      kPackedTiles[rows - 1][cols - 1](a, quads, r0, b);
      r0 += rows;
    }
    b += cols;
  }
}

constexpr int64_t kChunksPerThread = 16;  // chunks a thread takes on average where blocks are many
constexpr int64_t kClaimRows = 32;        // fewer rows split the blocks evenly once

// Every block over torch's threads. From kClaimRows rows, where there are blocks for kChunksPerThread
// chunks of at least C a thread, threads claim chunks in turn, so a thread held off its core (the API
// process, a client, another job) keeps one chunk and the others take the rest. Otherwise the blocks
// split evenly once (at::parallel_for). Qwen2.5-Coder's 4 projections x 12 layers, two threads bound
// one to a core, AMD EPYC family 25, alternated (benchmarks/README.md, "W8A8: threads that claim
// chunks"): with a spinner on the second core, 64 rows 65.2-66.5 against 71.1-78.7 ms and 256 rows
// 208.7-219.8 against 246.5-266.3 in one run, 49.2-64.1 against 62.6-71.1 and level in another
// (benchmarks/w8a8_busy_core.py); quiet, level. Claiming at 1 and 16 rows was 4-10% slower quiet
// (each chunk starts a new weight stream, likely the cause) and no faster busy, hence kClaimRows.
void run_all(const Int8GemvArgs& a, int64_t quads, int C, int64_t blocks) {
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = blocks / (threads * kChunksPerThread) / C * C;  // whole panels of C blocks
  if (threads <= 1 || chunk == 0 || a.rows < kClaimRows || at::in_parallel_region()) {
    at::parallel_for(0, blocks, C, [&](int64_t b0, int64_t b1) { run_packed(a, quads, C, b0, b1); });
    return;
  }
  const int64_t chunks = (blocks + chunk - 1) / chunk;
  std::atomic<int64_t> claims{0};
#pragma omp parallel num_threads(static_cast<int>(threads))
  for (int64_t c = claims.fetch_add(1); c < chunks; c = claims.fetch_add(1)) {
    run_packed(a, quads, C, c * chunk, std::min(blocks, (c + 1) * chunk));
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
              "w8a8_packed_gemm: weight_scale must be a contiguous float32, bfloat16 or float16 [N]");
  return s_w.scalar_type() == at::kFloat ? ScaleType::f32 : s_w.scalar_type() == at::kBFloat16 ? ScaleType::bf16 : ScaleType::f16;
}

// x [M, K] and the optional tensors of a layer of n outputs.
void check_inputs(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& quant_bias, const c10::optional<at::Tensor>& scale_reciprocal,
                  const c10::optional<at::Tensor>& offset) {
  TORCH_CHECK(supported(), "w8a8_packed_gemm: this CPU lacks AVX-512 VNNI (w8a8_packed_supported)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.size(1) < (int64_t(1) << 17),
              "w8a8_packed_gemm: x must be a CPU float32 or bfloat16 [M, K < 2^17] with unit last stride");
  TORCH_CHECK(n > 0, "w8a8_packed_gemm: the layer needs at least one output");
  if (given(bias)) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == n,
                "w8a8_packed_gemm: bias must be a contiguous [N] in x's dtype");
  }
  if (given(quant_bias)) {
    TORCH_CHECK(quant_bias->scalar_type() == at::kInt && quant_bias->is_contiguous() && quant_bias->numel() == n,
                "w8a8_packed_gemm: quant_bias must be a contiguous int32 [N]");
  }
  TORCH_CHECK(given(scale_reciprocal) == given(offset), "w8a8_packed_gemm: pass input_scale_reciprocal and input_offset together");
  if (given(scale_reciprocal)) {
    TORCH_CHECK(scale_reciprocal->scalar_type() == at::kFloat && scale_reciprocal->numel() == 1 &&
                    offset->scalar_type() == at::kFloat && offset->numel() == 1,
                "w8a8_packed_gemm: input_scale_reciprocal and input_offset must be float32 [1]");
  }
}

// x's rows quantised as the kernels read them: x_q [rows][k_pad] (zero past k), s_x, -128 sum x_q.
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> s_x;
  std::vector<int32_t> row_offset;
  int64_t k_pad;
};

QuantizedRows quantize_rows(const at::Tensor& x, const c10::optional<at::Tensor>& input_scale_reciprocal,
                            const c10::optional<at::Tensor>& input_offset) {
  const int64_t rows = x.size(0), k = x.size(1);
  QuantizedRows out{{}, std::vector<float>(rows), std::vector<int32_t>(rows), (k + kChunk - 1) / kChunk * kChunk};
  out.xq.resize(rows * out.k_pad);
#if TY_HAVE_X86_COPIES
  float static_quant[2];
  const bool is_static = given(input_scale_reciprocal);
  if (is_static) static_quant[0] = *input_scale_reciprocal->data_ptr<float>(), static_quant[1] = *input_offset->data_ptr<float>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const char* x_bytes = static_cast<const char*>(x.data_ptr());
  const int64_t row_bytes = x.stride(0) * x.element_size();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      out.s_x[r] = quantize_row(out.xq.data() + r * out.k_pad, out.row_offset.data() + r, x_bytes + r * row_bytes,
                                bf16, k, out.k_pad, is_static ? static_quant : nullptr);
    }
  });
#endif
  return out;
}

}  // namespace

bool w8a8_packed_supported() { return supported(); }

at::Tensor w8a8_packed_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scale,
                            const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& quant_bias,
                            const c10::optional<at::Tensor>& input_scale_reciprocal,
                            const c10::optional<at::Tensor>& input_offset, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "w8a8_packed_gemm: x must be [M, K]");
  const int64_t k = x.size(1), quads = (k + 3) / 4, blocks = (n + 15) / 16;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(0) == blocks && packed.size(1) == quads && packed.size(2) == 64,
              "w8a8_packed_gemm: packed must be a contiguous uint8 [ceil(n / 16), ceil(K / 4), 64] (cpu_quant.pack_w8a8_weight)");
  check_inputs(x, n, bias, quant_bias, input_scale_reciprocal, input_offset);
  const int64_t rows = x.size(0);
  const ScaleType s_w_type = scale_type(weight_scale, n);
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
#if TY_HAVE_X86_COPIES
  const QuantizedRows q = quantize_rows(x, input_scale_reciprocal, input_offset);
  Int8GemvArgs a{q.xq.data(), q.s_x.data(), q.row_offset.data(), packed.data_ptr<uint8_t>(),
                 weight_scale.data_ptr(), given(quant_bias) ? quant_bias->data_ptr<int32_t>() : nullptr,
                 given(bias) ? bias->data_ptr() : nullptr, y.data_ptr(), rows, n, k, q.k_pad,
                 x.scalar_type() == at::kBFloat16, s_w_type};
  const int64_t groups = (rows + kMaxRows - 1) / kMaxRows;
  const int C = packed_columns(static_cast<int>((rows + groups - 1) / groups));
  // Blocks, not panels, shared among the threads: at one row, 36 blocks (576 outputs) in panels of 8
  // went 3 panels to one thread and 2 to the other (24 blocks against 12).
  run_all(a, quads, C, blocks);
#endif
  return y;
}

}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("w8a8_packed_gemm(Tensor x, Tensor packed, Tensor weight_scale, Tensor? bias, Tensor? quant_bias, "
        "Tensor? input_scale_reciprocal, Tensor? input_offset, int n) -> Tensor");
  m.def("w8a8_packed_supported() -> bool", &tengyun::w8a8_packed_supported);
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) {
  m.impl("w8a8_packed_gemm", &tengyun::w8a8_packed_gemm);
}
