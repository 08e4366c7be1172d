// CPU paged attention for decodes and short chunks: K/V read in place from the paged cache (no
// gather copy), float32 accumulation. One task per (sequence, KV head) attends all its query rows
// (the group of query heads x the chunk's tokens) together, 512 tokens at a time: the scores of
// every row (each K block widened to float32 once when 16-bit), one softmax update per row, then
// the values with each V row read (and widened in registers) once for all rows; blocks prefetched
// two ahead into L2 (paged_attention_impl.h). Spread over the threads (paged_attention_threads.h):
// from 4 sequences per thread each thread takes whole sequences and streams the next one's rows
// into L2 meanwhile; fewer, a chunk's query tokens go in pieces of equal causal work. With bfloat16 q and cache on a CPU with AVX512_BF16 the
// scores are vdpbf16ps dot products of the rows as they lie (products exact in float32, float32
// sums: the float32 path's precision, another summation order).
//
// torch.ops.tengyun.paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, scale,
//                                          query_start_loc=None)
//   q, out [T, Hq, D] (float32 / bfloat16 / float16, the same dtype); k_cache, v_cache
//   [num_blocks, block_size, Hkv, D] (float32 / bfloat16 / float16); block_tables [B, max_blocks]
//   int64 (rows padded with any valid block id); seq_lens [B] int64, tokens to attend over.
//   Query head h reads KV head h / (Hq / Hkv).
//   query_start_loc None: one query token per sequence (T = B, a decode). Else int64 [B + 1],
//   non-decreasing: sequence b's query tokens are rows [qsl[b], qsl[b + 1]) of q, the last token
//   of its context and the n - 1 before it (a speculative verify: the last token and the drafts,
//   already in the cache); token i of n attends over the first seq_lens[b] - (n - 1 - i) tokens.
//   [5, 7, 9] verifying after 20 cached tokens: seq_lens 23, rows see 21, 22, 23 tokens.
// torch.ops.tengyun.paged_attention_isa(request) -> the instruction set in use ("avx512", "avx2",
//   "generic"); a non-empty request switches to that one when this CPU has it (tests).
//
// Instruction sets: the build uses no -march flag, so the library loads on any x86-64 (or other)
// CPU. The kernel is compiled three times (paged_attention_impl.h under `#pragma GCC target`) and
// the copy to run is chosen at load time from __builtin_cpu_supports, never by what the build
// host had.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "half_convert.h"

namespace tengyun {

struct Problem {  // one call's raw pointers and sizes (element counts, not bytes)
  const void* q;
  void* out;
  const void* k_cache;
  const void* v_cache;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  int64_t batch, q_heads, kv_heads, head_dim, block_size;
  int64_t block_stride;  // elements from one cache block to the next (k_cache.stride(0))
  int64_t table_stride;  // elements from one block-table row to the next
  const int64_t* query_start;  // [batch + 1] first query row of each sequence; nullptr: row b alone
  int64_t max_query_len;  // most query rows of one sequence (1 for decodes)
  float scale;
  DType cache_type, io_type;
  int64_t threads;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#if TY_HAVE_X86_COPIES
#define TY_ISA 512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
namespace avx512 {
namespace {  // internal linkage: direct calls, inlined at will
#include "paged_attention_impl.h"
}  // namespace
}  // namespace avx512
#pragma GCC pop_options
#undef TY_ISA

#define TY_ISA 256
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
namespace {  // internal linkage: direct calls, inlined at will
#include "paged_attention_impl.h"
}  // namespace
}  // namespace avx2
#pragma GCC pop_options
#undef TY_ISA
#endif

#define TY_ISA 0
namespace generic {
namespace {  // internal linkage: direct calls, inlined at will
#include "paged_attention_impl.h"
}  // namespace
}  // namespace generic
#undef TY_ISA

bool cpu_has(Isa isa) {
#if TY_HAVE_X86_COPIES
  __builtin_cpu_init();
  switch (isa) {
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::generic:
      return true;
  }
  return false;
#else
  return isa == Isa::generic;
#endif
}

static Isa best_isa() { return cpu_has(Isa::avx512) ? Isa::avx512 : cpu_has(Isa::avx2) ? Isa::avx2 : Isa::generic; }

Isa active_isa = best_isa();

const char* isa_name(Isa isa) {
  return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "generic";
}

std::string paged_attention_isa(const std::string& request) {
  for (Isa isa : {Isa::generic, Isa::avx2, Isa::avx512}) {
    if (request == isa_name(isa)) {
      TORCH_CHECK(cpu_has(isa), "paged_attention_isa: this CPU lacks ", request);
      active_isa = isa;
    }
  }
  TORCH_CHECK(request.empty() || request == isa_name(active_isa),
              "paged_attention_isa: unknown instruction set '", request, "' (avx512, avx2, generic)");
  return isa_name(active_isa);
}

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: TORCH_CHECK(false, "paged_decode_attention: ", name, " must be float32, bfloat16 or float16, got ",
                         t.scalar_type());
  }
}

void check_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t batch) {
  for (const at::Tensor* t : {&out, &q, &k_cache, &v_cache, &block_tables, &seq_lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention: every tensor must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_decode_attention: q must be a contiguous [T, Hq, D]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "paged_decode_attention: out must be contiguous, of q's shape and dtype");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: k_cache and v_cache must be [num_blocks, block_size, Hkv, D] alike");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                  k_cache.stride(1) == k_cache.size(2) * k_cache.size(3),
              "paged_decode_attention: each cache block must be contiguous");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0,
              "paged_decode_attention: q's head dim must match the cache's and Hq be a multiple of Hkv");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) >= batch,
              "paged_decode_attention: block_tables must be int64 [B, max_blocks] with unit column stride");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1 && seq_lens.is_contiguous() &&
                  seq_lens.size(0) >= batch,
              "paged_decode_attention: seq_lens must be a contiguous int64 [B]");
}

// Sequences, and the most query rows one has: query_start_loc's, else q's rows one each. Checks
// query_start_loc (int64 [B + 1], non-decreasing, within q) and that each sequence's context
// holds its query tokens.
int64_t query_layout(const at::Tensor& q, const std::optional<at::Tensor>& query_start_loc, int64_t* batch) {
  if (!query_start_loc.has_value()) {
    *batch = q.size(0);
    return 1;
  }
  const at::Tensor& qsl = *query_start_loc;
  TORCH_CHECK(qsl.device().is_cpu() && qsl.scalar_type() == at::kLong && qsl.dim() == 1 && qsl.is_contiguous() &&
                  qsl.size(0) >= 1,
              "paged_decode_attention: query_start_loc must be a contiguous int64 [B + 1] on the CPU");
  const int64_t* starts = qsl.data_ptr<int64_t>();
  *batch = qsl.size(0) - 1;
  int64_t most = 0;
  for (int64_t b = 0; b < *batch; ++b) {
    TORCH_CHECK(starts[b] >= 0 && starts[b] <= starts[b + 1] && starts[b + 1] <= q.size(0),
                "paged_decode_attention: query_start_loc must be non-decreasing within q's ", q.size(0),
                " rows; got ", starts[b], " then ", starts[b + 1], " at sequence ", b);
    most = std::max(most, starts[b + 1] - starts[b]);
  }
  return most;
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, const std::optional<at::Tensor>& query_start_loc) {
  int64_t batch = 0;
  const int64_t max_query = query_layout(q, query_start_loc, &batch);
  check_inputs(out, q, k_cache, v_cache, block_tables, seq_lens, batch);
  const int64_t max_len = block_tables.size(1) * k_cache.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.has_value() ? query_start_loc->data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_len, "paged_decode_attention: seq_lens[", b, "] = ", lens[b],
                " outside [0, ", max_len, "] (block_tables holds ", block_tables.size(1), " blocks per row)");
    const int64_t n = starts ? starts[b + 1] - starts[b] : 1;
    TORCH_CHECK(!starts || n <= lens[b], "paged_decode_attention: sequence ", b, " has ", n,
                " query tokens but seq_lens[", b, "] = ", lens[b], ": its context must hold them");
  }
  Problem p{q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr<int64_t>(), lens, batch, q.size(1), k_cache.size(2), k_cache.size(3),
            k_cache.size(1), k_cache.stride(0), block_tables.stride(0), starts, std::max<int64_t>(max_query, 1),
            static_cast<float>(scale), dtype_of(k_cache, "k_cache"), dtype_of(q, "q"), at::get_num_threads()};
  if (p.batch == 0) return;
  switch (active_isa) {
#if TY_HAVE_X86_COPIES
    case Isa::avx512: return avx512::run(p);
    case Isa::avx2: return avx2::run(p);
#endif
    default: return generic::run(p);
  }
}

}  // namespace tengyun

TORCH_LIBRARY(tengyun, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor? query_start_loc=None) -> ()");
  m.def("paged_attention_isa(str request) -> str", &tengyun::paged_attention_isa);
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) { m.impl("paged_decode_attention", &tengyun::paged_decode_attention); }
