// Linear layers of 1 to 128 rows (decode at batch 1-128, short prompts) on AMX tiles, straight from
// oneDNN's prepacked bfloat16 weight.
//
// Where oneDNN packs bfloat16 for AMX it blocks the weight [N, K] by 32 output columns, K-major
// inside a block (packed_gemv.cpp has the general form):
//   [Npad / 32][Kpad / 2][32][2]   element (n, k) at (n / 32) * Kpad * 32 + (k / 2) * 64 + (n % 32) * 2 + k % 2
// A 32-deep slice of K in a block is 16 lines of 128 bytes: bytes 0-63 of each line are columns
// 0-15 as (k, k + 1) pairs, bytes 64-127 columns 16-31. Read with a row stride of 128 bytes, each
// half is exactly an AMX B tile (16 K-pairs x 16 columns), so the weight streams front to back
// once, 2 KiB per step, with no repacking.
//
// Why not oneDNN's own AMX path: at 1-32 rows it reads the weight at 12-19 GB/s on a VM whose memory
// gives ~22 (it does not prefetch ahead of its tile loads); this kernel prefetches kPrefetchBytes
// ahead and reads at 20-30 GB/s there, and at 48-128 rows runs level with oneDNN or ahead, as a
// compiled op that decode graphs can hold (benchmarks/README.md, "AMX tiles for 1-64 rows").
//
// Tiles (palette 1, 64 bytes a row): 0-3 float32 sums C[row group][column half], 4-5 x rows
// (A: up to 16 rows x 32 K), 6-7 the weight halves (B). A pass covers up to 32 rows; more rows take
// more passes over the block, which L2 then holds (only the first prefetches). Row groups past M
// start at M - 16 instead (rows computed twice, bit for bit the same, stored twice) so every tile is
// full; fewer than 16 rows configure the A and C tiles to M rows.
//
// The layout is oneDNN's choice: tengyun/platforms/cpu/kernels/linear.py compares this kernel's
// product with oneDNN's on every packed weight before any row runs here.
//
// torch.ops.tengyun.amx_packed_gemm(x, weight_ptr, out_features, k_padded, bias) -> y
//   x [M, K] bfloat16, unit last stride, K % 32 == 0; weight_ptr: the packed weight's address
//   (torch.ops.mkldnn.data_ptr), which the caller keeps alive; bias [N] bfloat16 or None.
//   y [M, N] bfloat16: float32 sums of 32-deep K steps in order, one rounding (as oneDNN's AMX path).
// torch.ops.tengyun.amx_packed_gemm_supported() -> bool: the CPU has AMX-BF16 and AVX-512 BF16 and
//   the kernel (Linux) lets this process use the tile registers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_isa.h"

#if TY_HAVE_X86_COPIES && defined(__linux__)
#define TY_HAVE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define TY_HAVE_AMX 0
#endif

namespace tengyun {
namespace {

#if TY_HAVE_AMX
#define TY_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

constexpr int64_t kStepBytes = 2048;  // one 32-deep K step of a 32-column block: 16 lines of 128 bytes
// How far ahead of its tile loads the first pass over a block prefetches, and how densely: one line
// in kPrefetchEvery (the hardware's adjacent-line and stream prefetchers fetch the rest). Prefetch
// instructions are not free beside tile loads: with the data in L1/L2, one 32-row K step (4 tile
// loads, 4 tile multiplies) took ~30 ns, and ~60 with 16-48 prefetches beside it (2026-12-06, AMX VM,
// a standalone loop). So a step prefetches 8 lines, not its 32, and passes after the first, which
// read the block again from L2, prefetch nothing (the next block's lines spread over them, tried on
// 2026-12-05, cost more than they saved once the first pass prefetched sparsely). 212 MB of SmolLM2
// projections, 2 threads, median of 13 (every line and next-block shares -> one line in 4): 1 row
// 7.50 -> 7.18 ms, 4: 7.22 -> 6.58, 16: 8.04 -> 7.41, 32: 9.46 -> 9.17, 64: 14.37 -> 12.45;
// Qwen2.5-Coder's 716 MB at 64 rows 49.1 -> 41.9 (benchmarks/README.md, "Sparser prefetch").
// Distance: 8 KiB the same, 32 KiB slower; one line in 8 the same as one in 4. Inside the model's
// 64-sequence decode step the gain did not show beyond the VM's spread (medians 38.5 against 39.2 ms).
constexpr int64_t kPrefetchBytes = 16384;
constexpr int64_t kPrefetchEvery = 4;

struct TileConfig {  // ldtilecfg's 64-byte operand
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct GemmArgs {
  const uint16_t* x;
  const uint8_t* w;
  const uint16_t* bias;  // nullptr: none
  uint16_t* y;
  int64_t m, n, k, k_pad, x_stride;
};

// Columns [n0, n0 + 32) (clipped at a.n) of G row groups starting at r0[g], `rows` rows each, from
// the stored sums c[g][row][32], plus bias, rounded to bfloat16.
TY_AMX_TARGET void store_block(const GemmArgs& a, const float (&c)[2][16][32], int groups, int rows,
                               const int64_t (&r0)[2], int64_t n0) {
  const int64_t left = a.n - n0;
  const __mmask32 mask = left >= 32 ? 0xffffffffu : ((1u << left) - 1);
  __m512 bias_lo = _mm512_setzero_ps(), bias_hi = _mm512_setzero_ps();
  if (a.bias != nullptr) {
    const __m512i raw = _mm512_maskz_loadu_epi16(mask, a.bias + n0);
    bias_lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
    bias_hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
  }
  for (int g = 0; g < groups; ++g) {
    for (int r = 0; r < rows; ++r) {
      const __m512 lo = _mm512_add_ps(_mm512_load_ps(c[g][r]), bias_lo);
      const __m512 hi = _mm512_add_ps(_mm512_load_ps(c[g][r] + 16), bias_hi);
      const __m512i bits = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // round to nearest even
      _mm512_mask_storeu_epi16(a.y + (r0[g] + r) * a.n + n0, mask, bits);
    }
  }
}

// One pass over a 32-column block `wb`, G (1 or 2) row groups at r0[0], r0[G - 1]: every K step loads
// both weight halves once and multiplies them with each group's x rows; the first pass (`prefetch`)
// also prefetches the weight kPrefetchBytes ahead.
template <int G>
TY_AMX_TARGET void block_pass(const GemmArgs& a, const uint8_t* wb, int rows, const int64_t (&r0)[2], int64_t n0,
                              bool prefetch) {
  _tile_zero(0);
  _tile_zero(1);
  if (G == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t steps = a.k / 32;
  const int64_t x_bytes = a.x_stride * 2;
  const uint8_t* x0 = reinterpret_cast<const uint8_t*>(a.x + r0[0] * a.x_stride);
  const uint8_t* x1 = reinterpret_cast<const uint8_t*>(a.x + r0[G - 1] * a.x_stride);
  for (int64_t s = 0; s < steps; ++s) {
    const uint8_t* ws = wb + s * kStepBytes;
    if (prefetch) {
      for (int64_t line = 0; line < kStepBytes; line += 64 * kPrefetchEvery) {
        _mm_prefetch(reinterpret_cast<const char*>(ws + kPrefetchBytes + line), _MM_HINT_T0);
      }
    }
    _tile_loadd(6, ws, 128);
    _tile_loadd(7, ws + 64, 128);
    _tile_loadd(4, x0 + s * 64, x_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (G == 2) {
      _tile_loadd(5, x1 + s * 64, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[2][16][32];
  _tile_stored(0, &c[0][0][0], 128);
  _tile_stored(1, &c[0][0][16], 128);
  if (G == 2) {
    _tile_stored(2, &c[1][0][0], 128);
    _tile_stored(3, &c[1][0][16], 128);
  }
  store_block(a, c, G, rows, r0, n0);
}

// Blocks [b0, b1), all rows; loads this thread's tile configuration (oneDNN's AMX kernels load
// their own between calls) and releases the tiles after.
TY_AMX_TARGET void gemm_blocks(const GemmArgs& a, int64_t b0, int64_t b1) {
  const int rows = static_cast<int>(std::min<int64_t>(16, a.m));
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = t < 6 ? rows : 16;  // x rows and sums: M rows below 16; weight: 16 K-pairs
  }
  _tile_loadconfig(&config);
  const int64_t groups = (a.m + 15) / 16;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = a.w + b * a.k_pad * 64;
    for (int64_t g = 0; g < groups; g += 2) {
      const int64_t r0[2] = {std::max<int64_t>(0, std::min(g * 16, a.m - 16)),
                             std::max<int64_t>(0, std::min((g + 1) * 16, a.m - 16))};
      if (g + 1 < groups) {
        block_pass<2>(a, wb, rows, r0, b * 32, g == 0);
      } else {
        block_pass<1>(a, wb, rows, r0, b * 32, g == 0);
      }
    }
  }
  _tile_release();
}

bool cpu_has_amx_bf16() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22);
  __builtin_cpu_init();
  return tile && bf16 && __builtin_cpu_supports("avx512bf16");
}

// Linux hands out the tile registers' state (8 KiB a thread) only on request (arch_prctl).
bool tiles_permitted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif  // TY_HAVE_AMX

bool supported() {
#if TY_HAVE_AMX
  static const bool ok = cpu_has_amx_bf16() && tiles_permitted();
  return ok;
#else
  return false;
#endif
}

}  // namespace

bool amx_packed_gemm_supported() { return supported(); }

at::Tensor amx_packed_gemm(const at::Tensor& x, int64_t weight_ptr, int64_t out_features, int64_t k_padded,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "amx_packed_gemm: this CPU or kernel does not run AMX tiles (amx_packed_gemm_supported)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "amx_packed_gemm: x must be a CPU bfloat16 [M, K] with unit last stride");
  TORCH_CHECK(x.size(1) % 32 == 0, "amx_packed_gemm: K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(weight_ptr != 0 && out_features > 0 && k_padded >= x.size(1) && k_padded % 32 == 0,
              "amx_packed_gemm: weight_ptr, out_features and k_padded must describe the packed [N, Kpad] weight");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == out_features,
                "amx_packed_gemm: bias must be a contiguous [N] bfloat16");
  }
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
#if TY_HAVE_AMX
  const GemmArgs a{reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint8_t*>(weight_ptr),
                   has_bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
                   reinterpret_cast<uint16_t*>(y.data_ptr()), x.size(0), out_features, x.size(1), k_padded,
                   x.stride(0)};
  at::parallel_for(0, (out_features + 31) / 32, 1, [&](int64_t b0, int64_t b1) { gemm_blocks(a, b0, b1); });
#endif
  return y;
}

}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("amx_packed_gemm(Tensor x, int weight_ptr, int out_features, int k_padded, Tensor? bias) -> Tensor");
  m.def("amx_packed_gemm_supported() -> bool", &tengyun::amx_packed_gemm_supported);
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) { m.impl("amx_packed_gemm", &tengyun::amx_packed_gemm); }
