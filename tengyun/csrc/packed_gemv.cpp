// Small-batch linear layers (decode batches of 1-64 rows) straight from oneDNN's prepacked weight.
//
// oneDNN's fp32/bf16 inner-product weight, as torch.ops.mkldnn._reorder_linear_weight packs it on
// AVX-512 cores, is blocked by B output columns, K-major inside a block:
//   float32:  [Npad / B][Kpad][B]          element (n, k) at (n / B) * Kpad * B + k * B + n % B
//   bfloat16: [Npad / B][Kpad / 2][B][2]   element (n, k) at (n / B) * Kpad * B + (k / 2) * 2 B
//                                                            + (n % B) * 2 + k % 2
// B = 64, except bfloat16 on cores with AMX, where oneDNN blocks by 32 (its AMX kernels' tiles)
// (Npad: N rounded up to a multiple of B; padding is zero). That is the ideal layout for y = x W^T with a few x
// rows: each step broadcasts x[k] (bf16: the pair x[k], x[k + 1]) and multiplies 16 output columns
// per vector, so the weight streams once, front to back, at memory speed, with no horizontal sums.
// oneDNN's own M = 1 path runs at ~36 GB/s here, this at ~50 (benchmarks/README.md). More than 4 rows
// take a pass of 4 rows each over a run of columns (a block's, up to 64), the later passes from L2;
// meanwhile they stream the next run into L2 (Ahead), so memory and arithmetic overlap: 16-64 rows of
// SmolLM2's projections ran 1.27-1.65x oneDNN on an AMD EPYC (64 rows at ~395 GFLOP/s on 2 cores).
// Threads claim chunks of whole blocks, each one chunk ahead so its first run streams in like a
// following run of their own (gemv_all), instead of fixed halves: a thread that another process
// holds off its core (a served API process, the client) no longer stalls the other at the end of
// every layer. Served (vLLM's client on the same 2 cores, Qwen2.5-Coder at concurrency 64, AMD
// EPYC, 2026-12-07), the 64-sequence decode step took 172.6 / 169.7 ms against 179.0 / 175.4 with
// fixed halves (medians of ~435 steps, runs alternated); alone, the two are level. Few blocks that
// do not share out evenly are split by rows at the end instead (gemv_all).
//
// The layout is oneDNN's choice, not a contract: tengyun/platforms/cpu/kernels/linear.py checks every packed
// weight against oneDNN's own product before it routes any row through this kernel, and keeps oneDNN
// where the check fails (another CPU, another oneDNN).
//
// torch.ops.tengyun.packed_gemv(x, weight_ptr, out_features, k_padded, bias, block=64) -> y
//   x [M, K] float32 or bfloat16 with unit last stride; weight_ptr: the packed weight's address
//   (torch.ops.mkldnn.data_ptr), which the caller keeps alive; bias [N] in x's dtype or None.
//   y [M, N] in x's dtype: float32 sums, one rounding, as oneDNN. block: B above, 32 or 64.
// torch.ops.tengyun.packed_gemv_supported(dtype) -> bool: whether this CPU runs the kernel for
//   "float32" (AVX-512F) or "bfloat16" (AVX-512 BF16).
// torch.ops.tengyun.packed_rows(ids, weight_ptr, out_features, k, k_padded, dtype, block=64) -> rows
//   ids [T] int32/int64 in [0, out_features); rows [T, k] in dtype (float32 or bfloat16): row n of
//   the packed [N, K] weight, copied bit for bit (a tied LM head's packed weight serves the
//   embedding lookups, so the plain copy can go). Plain C++: runs on any CPU. block may also be 16:
//   bf16_weight_gemm.cpp's packing (the same layout in 16-column blocks).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "cpu_isa.h"

namespace tengyun {
namespace {

constexpr int64_t kGroup = 16;  // output columns per vector (one zmm of float32 sums)
constexpr int kMaxRows = 4;     // x rows per pass over a run of columns (register budget: 4 x 4 sums)
// Each of a tile's 64-byte column-group streams prefetches this far ahead of its load: a block is
// read front to back, and the hardware prefetcher alone streamed ~14 GB/s on an AMX VM whose
// memory reads ~22 GB/s (benchmarks/README.md).
constexpr int64_t kPrefetchBytes = 4096;

struct GemvArgs {
  const void* x;
  const void* w;
  const void* bias;  // nullptr: none
  void* y;
  int64_t rows, n, k, k_pad, x_stride;
  int64_t block;  // output columns per packed block: 32 or 64
};

// While passes after the first read a run of columns again from L2, the run after it streams into
// L2: each pass prefetches its share of the next run's K steps (step s when s % passes == pass).
struct Ahead {
  const char* next = nullptr;  // the next run's first byte; nullptr: prefetch nothing
  int lines = 0;               // 64-byte lines of the next run per K step (its column groups)
  int64_t row_bytes = 0;       // bytes per K step of a block: block * 4 (a float32, or a bf16 pair)
  int64_t pass = 0, passes = 1;
};

// Runs up to this size prefetch the next. Qwen2.5-0.5B's 24 layers at 16 rows (2026-12-06, AMD EPYC,
// 1 MiB L2): 41-46 ms without Ahead, 33-36 with it, whether its down projection's 608 KiB runs
// prefetched too or not; much larger runs fit L2 neither alone nor two at a time, and skip it.
constexpr int64_t kAheadMaxRunBytes = 1 << 20;

#if TY_HAVE_X86_COPIES
#define TY_GEMV_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

TY_GEMV_TARGET inline __m512 widen_bf16(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// Stores sums [M][G] of columns n0 .. n0 + 16 G (clipped at a.n) for rows r0 .. r0 + M, adding bias.
template <typename S, int M, int G>
TY_GEMV_TARGET inline void store_tile(const GemvArgs& a, __m512 (&acc)[M][G], int64_t r0, int64_t n0) {
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const int64_t n = n0 + g * kGroup;
    if (n >= a.n) break;
    const int64_t left = a.n - n;
    const __mmask16 mask = left >= kGroup ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    __m512 bias = _mm512_setzero_ps();
    if (a.bias != nullptr) {
      bias = std::is_same<S, float>::value ? _mm512_maskz_loadu_ps(mask, static_cast<const float*>(a.bias) + n)
                                           : widen_bf16(static_cast<const uint16_t*>(a.bias) + n, mask);
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m512 v = _mm512_add_ps(acc[m][g], bias);
      if constexpr (std::is_same<S, float>::value) {
        _mm512_mask_storeu_ps(static_cast<float*>(a.y) + (r0 + m) * a.n + n, mask, v);
      } else {
        const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));  // round to nearest even
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.y) + (r0 + m) * a.n + n, mask, bits);
      }
    }
  }
}

// Columns [n0, n0 + 16 G) of one block (n0 % B + 16 G <= B), rows [r0, r0 + M).
template <int M, int G>
TY_GEMV_TARGET void tile_f32(const GemvArgs& a, int64_t r0, int64_t n0, const Ahead& ahead) {
  const float* x = static_cast<const float*>(a.x) + r0 * a.x_stride;
  const int64_t block = a.block;
  const float* w = static_cast<const float*>(a.w) + (n0 / block) * a.k_pad * block + n0 % block;
  __m512 acc[M][G];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) acc[m][g] = _mm512_setzero_ps();
  int64_t due = ahead.next != nullptr ? ahead.pass : a.k;
  for (int64_t k = 0; k < a.k; ++k, w += block) {
    if (k == due) {
      for (int l = 0; l < ahead.lines; ++l) _mm_prefetch(ahead.next + k * ahead.row_bytes + l * 64, _MM_HINT_T1);
      due += ahead.passes;
    }
    __m512 xs[M];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) xs[m] = _mm512_set1_ps(x[m * a.x_stride + k]);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(w + g * kGroup) + kPrefetchBytes, _MM_HINT_T0);
      const __m512 wv = _mm512_loadu_ps(w + g * kGroup);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc[m][g] = _mm512_fmadd_ps(xs[m], wv, acc[m][g]);
    }
  }
  store_tile<float, M, G>(a, acc, r0, n0);
}

// x[m][2p, 2p + 1], read as one 32-bit pair and broadcast to the 16 lanes.
TY_GEMV_TARGET inline __m512bh pair_at(const uint16_t* x) {
  uint32_t pair;
  std::memcpy(&pair, x, sizeof pair);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
}

template <int M, int G>
TY_GEMV_TARGET void tile_bf16(const GemvArgs& a, int64_t r0, int64_t n0, const Ahead& ahead) {
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + r0 * a.x_stride;
  const int64_t block = a.block;
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + (n0 / block) * a.k_pad * block + (n0 % block) * 2;
  __m512 acc[M][G];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) acc[m][g] = _mm512_setzero_ps();
  const int64_t whole_pairs = a.k / 2;
  int64_t due = ahead.next != nullptr ? ahead.pass : whole_pairs;
  for (int64_t p = 0; p < whole_pairs; ++p, w += 2 * block) {
    if (p == due) {
      for (int l = 0; l < ahead.lines; ++l) _mm_prefetch(ahead.next + p * ahead.row_bytes + l * 64, _MM_HINT_T1);
      due += ahead.passes;
    }
    __m512bh wv[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(w + g * 2 * kGroup) + kPrefetchBytes, _MM_HINT_T0);
      wv[g] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + g * 2 * kGroup));
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh xs = pair_at(x + m * a.x_stride + 2 * p);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[m][g] = _mm512_dpbf16_ps(acc[m][g], xs, wv[g]);
    }
  }
  if (a.k % 2) {  // the last k alone: the high half of its x pair is zero, whatever the padding holds
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh xs = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x[m * a.x_stride + a.k - 1]));
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + g * 2 * kGroup));
        acc[m][g] = _mm512_dpbf16_ps(acc[m][g], xs, wv);
      }
    }
  }
  store_tile<uint16_t, M, G>(a, acc, r0, n0);
}

using TileFn = void (*)(const GemvArgs&, int64_t, int64_t, const Ahead&);

template <int M>
TileFn pick_tile(bool bf16, int groups) {
  static constexpr TileFn f32[4] = {tile_f32<M, 1>, tile_f32<M, 2>, tile_f32<M, 3>, tile_f32<M, 4>};
  static constexpr TileFn b16[4] = {tile_bf16<M, 1>, tile_bf16<M, 2>, tile_bf16<M, 3>, tile_bf16<M, 4>};
  return (bf16 ? b16 : f32)[groups - 1];
}

TileFn tile_for(bool bf16, int rows, int groups) {
  switch (rows) {
    case 1: return pick_tile<1>(bf16, groups);
    case 2: return pick_tile<2>(bf16, groups);
    case 3: return pick_tile<3>(bf16, groups);
    default: return pick_tile<4>(bf16, groups);
  }
}

// Byte offset of column n0's first K step in the packed weight.
int64_t column_offset(const GemvArgs& a, bool bf16, int64_t n0) {
  const int64_t elem = bf16 ? 2 : 4;
  return (n0 / a.block) * a.k_pad * a.block * elem + (n0 % a.block) * 4;
}

// Column groups [u0, u1) (16 columns each), every row: runs of up to B / 16 groups inside one block.
// [next0, next1): the groups this thread takes next (empty: none), whose first run the last run's
// passes stream into L2 as they do a following run of their own.
void gemv_groups(const GemvArgs& a, bool bf16, int64_t u0, int64_t u1, int64_t next0 = 0, int64_t next1 = 0) {
  const int64_t per_block = a.block / kGroup;
  const int64_t passes = (a.rows + kMaxRows - 1) / kMaxRows;
  const int64_t run_bytes = a.k_pad * a.block * (bf16 ? 2 : 4);
  const bool prefetch_next = passes > 1 && run_bytes <= kAheadMaxRunBytes;
  for (int64_t u = u0; u < u1;) {
    const int64_t end = std::min(u1, (u / per_block + 1) * per_block);
    const int groups = static_cast<int>(end - u);
    const int64_t following = end < u1 ? end : next0;  // the next run's first group
    const int64_t limit = end < u1 ? u1 : next1;
    Ahead ahead;
    if (prefetch_next && following < limit) {
      ahead.next = static_cast<const char*>(a.w) + column_offset(a, bf16, following * kGroup);
      ahead.lines = static_cast<int>(std::min(limit, (following / per_block + 1) * per_block) - following);
      ahead.row_bytes = a.block * 4;
      ahead.passes = passes;
    }
    for (int64_t r = 0; r < a.rows; r += kMaxRows, ++ahead.pass) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, a.rows - r));
      tile_for(bf16, rows, groups)(a, r, u * kGroup, ahead);
    }
    u = end;
  }
}

// Rows [r0, r1) of column groups [u0, u1), as gemv_groups does all rows.
void gemv_rows(const GemvArgs& a, bool bf16, int64_t u0, int64_t u1, int64_t r0, int64_t r1) {
  const int64_t elem = bf16 ? 2 : 4;
  GemvArgs part = a;
  part.x = static_cast<const char*>(a.x) + r0 * a.x_stride * elem;
  part.y = static_cast<char*>(a.y) + r0 * a.n * elem;
  part.rows = r1 - r0;
  gemv_groups(part, bf16, u0, u1);
}

constexpr int64_t kChunksPerThread = 16;  // chunks of whole blocks (at least one) per thread: small enough to share out

// Every column group over torch's threads, in chunks of whole blocks, each claimed one ahead (its
// first run streams into L2 during the chunk before): a thread held off its core keeps at most two
// chunks and the others take the rest. Serial inside another parallel region, as at::parallel_for.
// Where there are few blocks (one chunk each) that do not share out evenly, the last blocks % threads
// of them go by row parts instead (whole passes of 4 rows, one part per thread): SmolLM2's o and down
// projections are 9 blocks, so 2 threads took 5 and 4 and one waited a block's time in every layer.
// 30 layers' projections at 64 rows (linear_kernels.py --small-rows, 2 threads, AMD EPYC family 25,
// alternated): 32.66-34.66 against 33.48-35.54 ms; the kernel against oneDNN 1.17-1.20x against 1.12-1.15x.
// In the engine (SmolLM2 bfloat16, 64-sequence decode steps, torch profiler, alternated in one process)
// the kernel's time a step is 41.0-41.9 against 42.6-43.1 ms.
void gemv_all(const GemvArgs& a, bool bf16, int64_t groups) {
  const int64_t per_block = a.block / kGroup;
  const int64_t blocks = (groups + per_block - 1) / per_block;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), blocks);
  if (threads <= 1 || at::in_parallel_region()) return gemv_groups(a, bf16, 0, groups);
  const int64_t chunk = std::max<int64_t>(1, blocks / (threads * kChunksPerThread)) * per_block;  // groups
  const int64_t passes = (a.rows + kMaxRows - 1) / kMaxRows;
  const int64_t rest = blocks < threads * kChunksPerThread && passes >= 2 ? blocks % threads : 0;
  const int64_t parts = rest ? std::min(threads, passes) : 1;  // row parts of each of the last `rest` blocks
  const int64_t part_rows = (passes + parts - 1) / parts * kMaxRows;
  const int64_t whole = std::min(groups, (blocks - rest) * per_block);  // groups taken with all rows
  const int64_t chunks = (whole + chunk - 1) / chunk;
  const int64_t units = chunks + rest * parts;
  std::atomic<int64_t> claims{0};
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    for (int64_t c = claims.fetch_add(1); c < units;) {
      const int64_t following = claims.fetch_add(1);
      if (c >= chunks) {
        const int64_t block = blocks - rest + (c - chunks) / parts, r0 = (c - chunks) % parts * part_rows;
        if (r0 < a.rows) {  // more threads than passes leave a last part empty
          gemv_rows(a, bf16, block * per_block, std::min(groups, (block + 1) * per_block), r0,
                    std::min(a.rows, r0 + part_rows));
        }
        c = following;
        continue;
      }
      const int64_t u0 = c * chunk, u1 = std::min(whole, u0 + chunk);
      if (following < chunks) {
        gemv_groups(a, bf16, u0, u1, following * chunk, std::min(whole, (following + 1) * chunk));
      } else {
        gemv_groups(a, bf16, u0, u1);
      }
      c = following;
    }
  }
}
#endif  // TY_HAVE_X86_COPIES

bool supported(at::ScalarType dtype) {
#if TY_HAVE_X86_COPIES
  if (!cpu_has(Isa::avx512)) return false;
  if (dtype == at::kFloat) return true;
  __builtin_cpu_init();
  return dtype == at::kBFloat16 && __builtin_cpu_supports("avx512bf16");
#else
  (void)dtype;
  return false;
#endif
}

}  // namespace

bool packed_gemv_supported(const std::string& dtype) {
  if (dtype == "float32") return supported(at::kFloat);
  if (dtype == "bfloat16") return supported(at::kBFloat16);
  return false;
}

at::Tensor packed_gemv(const at::Tensor& x, int64_t weight_ptr, int64_t out_features, int64_t k_padded,
                       const c10::optional<at::Tensor>& bias, int64_t block) {
  TORCH_CHECK(block == 32 || block == 64, "packed_gemv: block must be 32 or 64, got ", block);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "packed_gemv: x must be a CPU [M, K] with unit last stride");
  TORCH_CHECK(supported(x.scalar_type()), "packed_gemv: this CPU does not run the kernel for ", x.scalar_type(),
              " (packed_gemv_supported)");
  TORCH_CHECK(weight_ptr != 0 && out_features > 0 && k_padded >= x.size(1),
              "packed_gemv: weight_ptr, out_features and k_padded must describe the packed [N, Kpad] weight");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == out_features,
                "packed_gemv: bias must be a contiguous [N] in x's dtype");
  }
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
#if TY_HAVE_X86_COPIES
  GemvArgs a{x.data_ptr(), reinterpret_cast<const void*>(weight_ptr), has_bias ? bias->data_ptr() : nullptr,
             y.data_ptr(), x.size(0), out_features, x.size(1), k_padded, x.stride(0), block};
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t groups = (out_features + kGroup - 1) / kGroup;
  gemv_all(a, bf16, groups);
#endif
  return y;
}

namespace {

// Row n of the packed weight into out[0, k), element (n, kk) as laid out above. Every element
// of the row sits in its own line (one lane of a K-major block), a constant stride the hardware
// prefetcher follows; bfloat16 moves a (k, k + 1) pair per 4-byte load.
void copy_packed_row_f32(const uint32_t* w, int64_t n, int64_t k, int64_t k_pad, int64_t block, uint32_t* out) {
  const uint32_t* lane = w + (n / block) * k_pad * block + n % block;
  for (int64_t kk = 0; kk < k; ++kk) out[kk] = lane[kk * block];
}

void copy_packed_row_bf16(const uint16_t* w, int64_t n, int64_t k, int64_t k_pad, int64_t block, uint16_t* out) {
  const uint16_t* lane = w + (n / block) * k_pad * block + (n % block) * 2;
  const int64_t whole_pairs = k / 2;
  for (int64_t p = 0; p < whole_pairs; ++p) std::memcpy(out + 2 * p, lane + p * 2 * block, 4);
  if (k % 2) out[k - 1] = lane[whole_pairs * 2 * block];
}

constexpr int64_t kRowsPerTask = 256;  // rows one thread copies before another is worth waking

void gather_packed_rows(const int64_t* ids, int64_t count, const void* weight, bool bf16, int64_t k, int64_t k_pad,
                        int64_t block, void* rows) {
  at::parallel_for(0, count, kRowsPerTask, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (bf16) {
        copy_packed_row_bf16(static_cast<const uint16_t*>(weight), ids[t], k, k_pad, block,
                             static_cast<uint16_t*>(rows) + t * k);
      } else {
        copy_packed_row_f32(static_cast<const uint32_t*>(weight), ids[t], k, k_pad, block,
                            static_cast<uint32_t*>(rows) + t * k);
      }
    }
  });
}

}  // namespace

at::Tensor packed_rows(const at::Tensor& ids, int64_t weight_ptr, int64_t out_features, int64_t k, int64_t k_padded,
                       at::ScalarType dtype, int64_t block) {
  TORCH_CHECK(block == 16 || block == 32 || block == 64, "packed_rows: block must be 16, 32 or 64, got ", block);
  TORCH_CHECK(ids.device().is_cpu() && ids.dim() == 1 && (ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt),
              "packed_rows: ids must be a CPU [T] int32 or int64 tensor");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "packed_rows: dtype must be float32 or bfloat16");
  TORCH_CHECK(weight_ptr != 0 && out_features > 0 && k > 0 && k_padded >= k && (dtype == at::kFloat || k_padded % 2 == 0),
              "packed_rows: weight_ptr, out_features, k and k_padded must describe the packed [N, Kpad] weight");
  const at::Tensor ids64 = ids.to(at::kLong).contiguous();
  const int64_t count = ids64.size(0);
  const int64_t* id = ids64.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < out_features, "packed_rows: id ", id[t], " is outside [0, ", out_features, ")");
  }
  at::Tensor rows = at::empty({count, k}, ids.options().dtype(dtype));
  gather_packed_rows(id, count, reinterpret_cast<const void*>(weight_ptr), dtype == at::kBFloat16, k, k_padded, block,
                     rows.data_ptr());
  return rows;
}

}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("packed_gemv(Tensor x, int weight_ptr, int out_features, int k_padded, Tensor? bias, int block=64) -> Tensor");
  m.def("packed_gemv_supported(str dtype) -> bool", &tengyun::packed_gemv_supported);
  m.def("packed_rows(Tensor ids, int weight_ptr, int out_features, int k, int k_padded, ScalarType dtype, "
        "int block=64) -> Tensor");
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) {
  m.impl("packed_gemv", &tengyun::packed_gemv);
  m.impl("packed_rows", &tengyun::packed_rows);
}
