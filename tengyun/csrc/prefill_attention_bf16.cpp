// Causal attention of prefill chunks in bfloat16 on CPUs with AVX512_BF16 (no AMX needed): K/V from
// the paged cache, the two products as register tiles instead of a decode row's work per query token.
//
// The decode kernel (paged_attention.cpp) attends a chunk's query tokens as decode rows: per row and
// key a dot product with a horizontal sum, then the values for every key of the span whatever the
// row's causal limit. Here one task (sequence, KV head, piece of at most 256 of its query tokens)
// copies the keys its rows see, 2,048 at a time (a span), into tiles of 32 keys laid out for
// vdpbf16ps ([D / 2 dim pairs][32 keys] of bfloat16 pairs) and widens their values to float32; then
// 4 query rows at a time (the KV head's query heads x tokens; 2 for head dims over 64) walk the
// span's key tiles up to their causal limit:
//   scores  S[4][32] = q . k             vdpbf16ps: q's dim pair broadcast against 32 keys' pairs;
//                                        products exact in float32, float32 sums
//   softmax running max / sum per row     one update per tile (online softmax), float32
//   values  O[4][D] += P[4][32] . V       float32 FMAs, O in registers across the span's tiles
// (kept in the task's scratch between spans), so a row's result depends only on its query, its
// limit and the cache, not on the task it is in. A thread's scratch is bounded by the span and the
// piece, whatever the context length.
//
// torch.ops.tengyun.prefill_attention_bf16(out, q, k_cache, v_cache, block_tables, seq_lens, scale,
//                                          query_start_loc)
//   The contract of paged_decode_attention with query_start_loc: q, out [T, Hq, D] bfloat16,
//   contiguous; k_cache, v_cache [num_blocks, block_size, Hkv, D] bfloat16, contiguous blocks;
//   block_tables [B, max_blocks] int64; seq_lens [B] int64; query_start_loc [B + 1] int64:
//   sequence b's query tokens are rows [qsl[b], qsl[b + 1]) of q, the last n of its seq_lens[b]
//   tokens (their K/V already in the cache); token i of n sees the first seq_lens[b] - (n - 1 - i).
//   D a multiple of 32, at most 128; Hq a multiple of Hkv.
// torch.ops.tengyun.prefill_attention_bf16_supported() -> bool: the CPU has AVX512_BF16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "half_convert.h"

namespace tengyun {

bool prefill_attention_bf16_supported() {
#if TY_HAVE_X86_COPIES
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

struct PrefillProblem {  // one call's pointers and sizes (elements)
  const uint16_t* q;
  uint16_t* out;
  const uint16_t* k_cache;
  const uint16_t* v_cache;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  const int64_t* query_start;
  int64_t batch, q_heads, kv_heads, head_dim, block_size, block_stride, table_stride;
  float scale;
};

struct PrefillPiece {  // query tokens [q0, q1) of sequence b's chunk, KV head h
  int64_t b, h, q0, q1;
};

#if TY_HAVE_X86_COPIES
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,prefer-vector-width=512")
namespace prefill_bf16 {
namespace {

#define TY_ISA 512
#include "paged_attention_vec.h"  // struct Vec: 16 float lanes, Cephes exp
using V = __m512;
#include "paged_attention_bf16.h"  // store_out: float32 -> bfloat16 as static_cast rounds
#undef TY_ISA
constexpr int64_t kKeys = 32;  // keys per tile: two vectors of scores per row
constexpr int kTileRows = 4;  // query rows per register tile (head dims of up to 64; 2 rows above)

// Keys [key0, key0 + keys) of KV head h of sequence b as tiles for vdpbf16ps: tile t, dim pair p,
// key j at kp[(t * pairs + p) * 32 + j] (the pair's two bfloat16 as one uint32); keys past the last
// zero. Their values widened to float32 rows: vf[(key - key0) * D + d].
void pack_keys_values(const PrefillProblem& p, int64_t b, int64_t h, int64_t key0, int64_t keys, uint32_t* kp,
                      float* vf) {
  const int64_t dim = p.head_dim, pairs = dim / 2, tiles = (keys + kKeys - 1) / kKeys;
  const int64_t* table = p.block_tables + b * p.table_stride;
  std::memset(kp, 0, tiles * pairs * kKeys * sizeof(uint32_t));
  for (int64_t i = 0; i < keys; ++i) {
    const int64_t key = key0 + i;
    const int64_t offset = table[key / p.block_size] * p.block_stride + ((key % p.block_size) * p.kv_heads + h) * dim;
    const uint32_t* k = reinterpret_cast<const uint32_t*>(p.k_cache + offset);
    uint32_t* column = kp + (i / kKeys) * pairs * kKeys + i % kKeys;
    for (int64_t pr = 0; pr < pairs; ++pr) column[pr * kKeys] = k[pr];
    const uint16_t* v = p.v_cache + offset;
    for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(vf + i * dim + d, Vec::load_bf16(v + d));
  }
}

// A span of keys [span0, span0 + span_keys), packed (kp, vf), as seen by R query rows (row i: q at
// qrow[i], sees the first limit[i] keys of the sequence, limit[i] >= 1); C = D / 16 vectors of output
// per row. Each row's online softmax (float32 sums [D], partial sums of its weights [16], running
// max) starts empty at the first span and is kept in `state` between spans; the last span writes
// each row's output to orow[i].
struct RowState {
  float* acc;  // [R][D]
  float* sum;  // [R][16]
  float* max;  // [R]
};

#define TY_INLINE __attribute__((always_inline)) inline  // the tile's vectors stay in registers

// s[i] = q_i . k for the tile's 32 keys (unscaled): q_i's dim pair broadcast against the keys' pairs.
template <int R, int C>
TY_INLINE void tile_scores(const uint32_t* const* qrow, const uint32_t* tile, V (&s)[R][2]) {
  for (int i = 0; i < R; ++i) s[i][0] = s[i][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int pr = 0; pr < C * 8; ++pr) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(tile + pr * kKeys);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(tile + pr * kKeys + 16);
    for (int i = 0; i < R; ++i) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qrow[i][pr]));
      s[i][0] = _mm512_dpbf16_ps(s[i][0], qb, k0);
      s[i][1] = _mm512_dpbf16_ps(s[i][1], qb, k1);
    }
  }
}

// Each row's online-softmax update for the tile (its first key at `key0` of the sequence; `masked`:
// some row's limit ends in or before it): scores scaled, keys past the row's limit dropped, sums and
// running max rescaled when the max grows, the tile's weights stored for tile_values.
template <int R, int C>
TY_INLINE void tile_weights(V (&s)[R][2], const int64_t* limit, int64_t key0, bool masked, float scale,
                            V (&acc)[R][C], V (&sum)[R], float (&run_max)[R], float (&weights)[R][kKeys]) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const V neg = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
  for (int i = 0; i < R; ++i) {
    __mmask16 keep0 = 0xFFFF, keep1 = 0xFFFF;
    if (masked) {  // none where limit - key0 <= 0
      const __m512i bound = _mm512_set1_epi32(static_cast<int>(std::clamp<int64_t>(limit[i] - key0, 0, kKeys)));
      keep0 = _mm512_cmplt_epi32_mask(lane, bound);
      keep1 = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), bound);
    }
    const V a = _mm512_mask_mul_ps(neg, keep0, s[i][0], sc), b = _mm512_mask_mul_ps(neg, keep1, s[i][1], sc);
    const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
    if (tile_max > run_max[i]) {  // else nothing of this row changes scale (a fully masked tile: -inf)
      const V correction = _mm512_set1_ps(std::exp(run_max[i] - tile_max));  // exp(-inf) = 0 at the first tile
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_mul_ps(acc[i][c], correction);
      sum[i] = _mm512_mul_ps(sum[i], correction);
      run_max[i] = tile_max;
    }
    const V m = _mm512_set1_ps(run_max[i]);
    const V e0 = _mm512_maskz_mov_ps(keep0, Vec::exp(_mm512_sub_ps(a, m)));
    const V e1 = _mm512_maskz_mov_ps(keep1, Vec::exp(_mm512_sub_ps(b, m)));
    sum[i] = _mm512_add_ps(sum[i], _mm512_add_ps(e0, e1));
    _mm512_store_ps(weights[i], e0);
    _mm512_store_ps(weights[i] + 16, e1);
  }
}

// acc[i] += sum over the tile's first n keys of weights[i][j] * v_j (float32 rows v_j at v + j * D).
template <int R, int C>
TY_INLINE void tile_values(const float (&weights)[R][kKeys], const float* v, int64_t n, V (&acc)[R][C]) {
  for (int64_t j = 0; j < n; ++j) {
    V x[C];
    for (int c = 0; c < C; ++c) x[c] = _mm512_loadu_ps(v + j * C * 16 + c * 16);
    for (int i = 0; i < R; ++i) {
      const V w = _mm512_set1_ps(weights[i][j]);
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_fmadd_ps(w, x[c], acc[i][c]);
    }
  }
}

template <int R, int C>
void attend_rows(const uint32_t* const* qrow, const int64_t* limit, int64_t span0, int64_t span_keys,
                 const uint32_t* kp, const float* vf, float scale, RowState state, bool first_span, bool last_span,
                 uint16_t* const* orow) {
  V acc[R][C], sum[R];
  float run_max[R];
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < C; ++c)
      acc[i][c] = first_span ? _mm512_setzero_ps() : _mm512_loadu_ps(state.acc + i * C * 16 + c * 16);
    sum[i] = first_span ? _mm512_setzero_ps() : _mm512_loadu_ps(state.sum + i * 16);
    run_max[i] = first_span ? -INFINITY : state.max[i];
  }
  int64_t most = 0, least = limit[0];  // within the span
  for (int i = 0; i < R; ++i) most = std::max(most, limit[i]), least = std::min(least, limit[i]);
  most = std::min(most - span0, span_keys), least -= span0;
  alignas(64) float weights[R][kKeys];
  for (int64_t t0 = 0; t0 < most; t0 += kKeys) {
    V s[R][2];
    tile_scores<R, C>(qrow, kp + (t0 / kKeys) * C * 8 * kKeys, s);
    tile_weights<R, C>(s, limit, span0 + t0, t0 + kKeys > least, scale, acc, sum, run_max, weights);
    tile_values<R, C>(weights, vf + t0 * C * 16, std::min(kKeys, most - t0), acc);  // keys past every limit: skipped
  }
  for (int i = 0; i < R; ++i) {
    if (last_span) {
      const V inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum[i]));
      c10::BFloat16* out = reinterpret_cast<c10::BFloat16*>(orow[i]);
      for (int c = 0; c < C; ++c) store_out(out + c * 16, _mm512_mul_ps(acc[i][c], inv));
    } else {
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(state.acc + i * C * 16 + c * 16, acc[i][c]);
      _mm512_storeu_ps(state.sum + i * 16, sum[i]);
      state.max[i] = run_max[i];
    }
  }
}

#undef TY_INLINE

constexpr int64_t kSpanKeys = 2048;  // keys packed at once: 2048 x D x 6 bytes (768 KiB at D = 64)
constexpr int64_t kMaxPieceTokens = 256;  // rows keep state between spans: 256 x group x (D + 17) floats

// Rows [r0, r0 + R) of a piece over one span: row r is query token q0 + r / group, head h * group + r % group.
template <int R, int C>
void attend_tile(const PrefillProblem& p, const PrefillPiece& piece, int64_t first, int64_t len, int64_t n,
                 int64_t r0, int64_t span0, int64_t span_keys, bool last_span, const uint32_t* kp, const float* vf,
                 float* state) {
  const int64_t group = p.q_heads / p.kv_heads, rows = (piece.q1 - piece.q0) * group;
  const uint32_t* qrow[R];
  uint16_t* orow[R];
  int64_t limit[R];
  for (int i = 0; i < R; ++i) {
    const int64_t token = piece.q0 + (r0 + i) / group, head = piece.h * group + (r0 + i) % group;
    const int64_t row = ((first + token) * p.q_heads + head) * p.head_dim;
    qrow[i] = reinterpret_cast<const uint32_t*>(p.q + row);
    orow[i] = p.out + row;
    limit[i] = len - (n - 1 - token);
  }
  const RowState rs{state + r0 * p.head_dim, state + rows * p.head_dim + r0 * 16,
                    state + rows * (p.head_dim + 16) + r0};
  attend_rows<R, C>(qrow, limit, span0, span_keys, kp, vf, p.scale, rs, span0 == 0, last_span, orow);
}

struct Scratch {  // a thread's, kept across calls: each bounded by kSpanKeys and kMaxPieceTokens
  std::vector<uint32_t> kp;
  std::vector<float> vf, state;
};

template <int C>
void attend_piece(const PrefillProblem& p, const PrefillPiece& piece, Scratch& scratch) {
  constexpr int R = C <= 4 ? kTileRows : 2;  // R * C accumulators + C of V within 32 registers
  const int64_t first = p.query_start[piece.b], n = p.query_start[piece.b + 1] - first, len = p.seq_lens[piece.b];
  const int64_t keys = len - (n - piece.q1);  // what the piece's last token sees
  const int64_t rows = (piece.q1 - piece.q0) * (p.q_heads / p.kv_heads);
  const int64_t span_tiles = (std::min(keys, kSpanKeys) + kKeys - 1) / kKeys;
  scratch.kp.resize(std::max<size_t>(scratch.kp.size(), span_tiles * kKeys * C * 8));
  scratch.vf.resize(std::max<size_t>(scratch.vf.size(), span_tiles * kKeys * C * 16));
  scratch.state.resize(std::max<size_t>(scratch.state.size(), rows * (C * 16 + 17)));  // read past one span only
  for (int64_t span0 = 0; span0 < keys; span0 += kSpanKeys) {
    const int64_t span_keys = std::min(kSpanKeys, keys - span0);
    const bool last = span0 + span_keys >= keys;
    pack_keys_values(p, piece.b, piece.h, span0, span_keys, scratch.kp.data(), scratch.vf.data());
    int64_t r0 = 0;
    for (; r0 + R <= rows; r0 += R)
      attend_tile<R, C>(p, piece, first, len, n, r0, span0, span_keys, last, scratch.kp.data(), scratch.vf.data(),
                        scratch.state.data());
    for (; r0 < rows; ++r0)
      attend_tile<1, C>(p, piece, first, len, n, r0, span0, span_keys, last, scratch.kp.data(), scratch.vf.data(),
                        scratch.state.data());
  }
}

constexpr int64_t kMinPieceTokens = 16;

// Each chunk's query tokens in pieces of about equal causal work (token i after ctx cached tokens
// sees ctx + i + 1 keys), enough pieces x KV heads for 4 per thread, none under kMinPieceTokens
// (unless the chunk is shorter), none over kMaxPieceTokens (a long fresh prompt's first pieces, of
// little work a token, stop there and the rest follow).
std::vector<PrefillPiece> split_pieces(const PrefillProblem& p, int64_t threads) {
  std::vector<PrefillPiece> pieces;
  const int64_t split = std::max<int64_t>(1, (4 * threads + p.batch * p.kv_heads - 1) / (p.batch * p.kv_heads));
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t n = p.query_start[b + 1] - p.query_start[b], ctx = p.seq_lens[b] - n;
    if (n == 0) continue;
    const int64_t count = std::max({int64_t{1}, std::min(split, n / kMinPieceTokens),
                                    (n + kMaxPieceTokens - 1) / kMaxPieceTokens});
    const auto work = [ctx](int64_t m) { return m * ctx + m * (m + 1) / 2; };  // keys seen by tokens [0, m)
    int64_t q0 = 0;
    for (int64_t k = 1; q0 < n; ++k) {  // piece k ends at k / count of the work, or kMaxPieceTokens on
      int64_t q1 = q0 + 1;
      while (q1 < n && q1 - q0 < kMaxPieceTokens && work(q1) * count < work(n) * k) ++q1;
      for (int64_t h = 0; h < p.kv_heads; ++h) pieces.push_back({b, h, q0, q1});
      q0 = q1;
    }
  }
  return pieces;
}

void run(const PrefillProblem& p) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const std::vector<PrefillPiece> pieces = split_pieces(p, threads);
  const int64_t tasks = static_cast<int64_t>(pieces.size());
  if (tasks == 0) return;
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(std::min(threads, tasks)))
  {
    static thread_local Scratch scratch;
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      switch (p.head_dim / 16) {
        case 2: attend_piece<2>(p, pieces[t], scratch); break;
        case 4: attend_piece<4>(p, pieces[t], scratch); break;
        case 6: attend_piece<6>(p, pieces[t], scratch); break;
        default: attend_piece<8>(p, pieces[t], scratch); break;
      }
    }
  }
}

}  // namespace
}  // namespace prefill_bf16
#pragma GCC pop_options
#endif

void prefill_attention_bf16(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            const at::Tensor& query_start_loc) {
  constexpr const char* op = "prefill_attention_bf16: ";
  TORCH_CHECK(prefill_attention_bf16_supported(), op, "this CPU lacks AVX512_BF16");
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&out), &q, &k_cache, &v_cache})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16, op, "q, out and the caches must be "
                "bfloat16 on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.sizes() == q.sizes() && out.is_contiguous(), op,
              "q and out must be contiguous [T, Hq, D] of one shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                  k_cache.stride(1) == k_cache.size(2) * k_cache.size(3),
              op, "k_cache and v_cache must be [num_blocks, block_size, Hkv, D] alike, each block contiguous");
  const int64_t dim = q.size(2), q_heads = q.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && dim % 32 == 0 && dim <= 128 && kv_heads > 0 && q_heads % kv_heads == 0, op,
              "the head dim must match the cache's and be a multiple of 32 up to 128, Hq a multiple of Hkv");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.dim() == 1 &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) >= 1,
              op, "query_start_loc must be a contiguous int64 [B + 1]");
  const int64_t batch = query_start_loc.size(0) - 1;
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) >= batch && seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous() && seq_lens.size(0) >= batch,
              op, "block_tables must be int64 [B, max_blocks] (unit column stride), seq_lens a contiguous int64 [B]");
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_len = block_tables.size(1) * k_cache.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(starts[b] >= 0 && starts[b] <= starts[b + 1] && starts[b + 1] <= q.size(0), op,
                "query_start_loc must be non-decreasing within q's ", q.size(0), " rows");
    TORCH_CHECK(lens[b] >= starts[b + 1] - starts[b] && lens[b] <= max_len, op, "seq_lens[", b, "] = ", lens[b],
                " must hold its ", starts[b + 1] - starts[b], " query tokens and fit its ", block_tables.size(1),
                " blocks");
  }
#if TY_HAVE_X86_COPIES
  const PrefillProblem p{reinterpret_cast<const uint16_t*>(q.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                         reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                         reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), block_tables.data_ptr<int64_t>(),
                         lens, starts, batch, q_heads, kv_heads, dim, k_cache.size(1), k_cache.stride(0),
                         block_tables.stride(0), static_cast<float>(scale)};
  prefill_bf16::run(p);
#endif
}

}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("prefill_attention_bf16(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor query_start_loc) -> ()");
  m.def("prefill_attention_bf16_supported() -> bool", &tengyun::prefill_attention_bf16_supported);
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) { m.impl("prefill_attention_bf16", &tengyun::prefill_attention_bf16); }
