// Paged decode attention for one instruction set. No include guard on purpose: paged_attention.cpp
// includes this file once per ISA, each time inside its own namespace and under a matching
// `#pragma GCC target`, with TY_ISA set to 512 (AVX-512 F/BW/VL/DQ), 256 (AVX2 + FMA + F16C) or 0
// (portable C++). Everything defined here is therefore compiled for that ISA only and runs only
// after paged_attention.cpp has checked the CPU has it (__builtin_cpu_supports).
//
// Cache layout (shared by every backend): k/v [num_blocks, block_size, num_kv_heads, head_dim];
// row t of block n, KV head h starts at n * block_stride + (t * num_kv_heads + h) * head_dim.

#include "paged_attention_vec.h"  // struct Vec: W float lanes of this ISA

using V = typename Vec::T;

// n rows of a block (row i at src + i * src_stride, dim elements) as float32 rows a multiple of W
// long -> (first row, row stride). A float32 block whose rows need no padding is read where it lies.
struct Rows {
  const float* data;
  int64_t stride;
};

template <typename Load, typename Scalar>
inline Rows widen_rows(const uint16_t* src, int64_t n, int64_t src_stride, int64_t dim, int64_t padded, float* buf,
                       Load load, Scalar scalar) {
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* row = src + t * src_stride;
    float* dst = buf + t * padded;
    int64_t d = 0;
    for (; d + Vec::W <= dim; d += Vec::W) Vec::store(dst + d, load(row + d));
    for (; d < dim; ++d) dst[d] = scalar(row[d]);
    std::fill(dst + dim, dst + padded, 0.0f);
  }
  return {buf, padded};
}

inline Rows block_rows(const float* src, int64_t n, int64_t src_stride, int64_t dim, int64_t padded, float* buf) {
  if (dim == padded) return {src, src_stride};
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(buf + t * padded, src + t * src_stride, dim * sizeof(float));
    std::fill(buf + t * padded + dim, buf + (t + 1) * padded, 0.0f);
  }
  return {buf, padded};
}

inline Rows block_rows(const c10::BFloat16* src, int64_t n, int64_t src_stride, int64_t dim, int64_t padded,
                       float* buf) {
  return widen_rows(reinterpret_cast<const uint16_t*>(src), n, src_stride, dim, padded, buf, Vec::load_bf16,
                    bf16_to_float);
}

inline Rows block_rows(const c10::Half* src, int64_t n, int64_t src_stride, int64_t dim, int64_t padded,
                       float* buf) {
  return widen_rows(reinterpret_cast<const uint16_t*>(src), n, src_stride, dim, padded, buf, Vec::load_fp16,
                    fp16_to_float);
}

// s[t] (+)= q . k_t over P chunks of W dims, for t < n; s has room for n rounded up to W. Tokens go
// W at a time: W partial-product vectors, then one transpose_sum instead of W reductions.
template <int P>
void scores_piece(const float* q, Rows k, int64_t n, float* s, bool accumulate) {
  V qv[P];
  for (int c = 0; c < P; ++c) qv[c] = Vec::load(q + c * Vec::W);
  for (int64_t t0 = 0; t0 < n; t0 += Vec::W) {
    V part[Vec::W];
    const int64_t m = std::min<int64_t>(Vec::W, n - t0);
    for (int64_t i = 0; i < m; ++i) {
      const float* row = k.data + (t0 + i) * k.stride;
      V a = Vec::mul(qv[0], Vec::load(row));
      for (int c = 1; c < P; ++c) a = Vec::fmadd(qv[c], Vec::load(row + c * Vec::W), a);
      part[i] = a;
    }
    for (int64_t i = m; i < Vec::W; ++i) part[i] = Vec::zero();
    V sums = Vec::transpose_sum(part);
    Vec::store(s + t0, accumulate ? Vec::add(sums, Vec::load(s + t0)) : sums);
  }
}

#define TY_PIECES(CALL) \
  switch (piece) {      \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; \
  }

// The head dim in pieces of at most kMaxPiece chunks (register budget); padded is a multiple of W.
inline void block_scores(const float* q, Rows k, int64_t n, int64_t padded, float* s) {
  for (int64_t c0 = 0; c0 < padded / Vec::W; c0 += Vec::kMaxPiece) {
    const int64_t piece = std::min<int64_t>(Vec::kMaxPiece, padded / Vec::W - c0), off = c0 * Vec::W;
    const Rows part{k.data + off, k.stride};
#define TY_SCORES(P) scores_piece<P>(q + off, part, n, s, c0 > 0)
    TY_PIECES(TY_SCORES)
#undef TY_SCORES
  }
}

#undef TY_PIECES

#include "paged_attention_bf16.h"  // 16-bit V loads, bfloat16 dot-product scores

#include "paged_attention_prefetch.h"  // prefetch_line / prefetch_rows, PrefetchRows, NextRows

template <typename E>
struct VBlocks {
  const E* const* ptr;
  int64_t count, size, last;
  const PrefetchRows* ahead;  // nullptr: the caller prefetches
  int64_t ahead_stride_bytes;
  NextRows* next;  // nullptr, or a step of the next sequence's rows at each block (with ahead's)
};

// R rows x P chunks of accumulators in registers: acc_r += sum_t p_r[t] * v_t over the blocks' rows
// (token t of block i: weight w[r * w_stride + i * size + t], row ptr[i] + off + t * v_stride), row r's
// accumulators at acc + r * acc_stride. Each V row is loaded (and widened) once for the R rows; R * P
// independent FMA chains; the accumulators stay in registers across the blocks.
template <int R, int P, typename E>
void values_tile(float* acc, int64_t acc_stride, const float* w, int64_t w_stride, const VBlocks<E>& v,
                 int64_t off, int64_t v_stride, bool prefetch) {
  V a[R][P];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < P; ++c) a[r][c] = Vec::load(acc + r * acc_stride + c * Vec::W);
  for (int64_t i = 0; i < v.count; ++i) {
    if (prefetch && v.ahead[i].first)
      prefetch_rows(v.ahead[i].first, v.ahead[i].rows, v.ahead_stride_bytes, v.ahead[i].row_bytes);
    if (prefetch && v.next) v.next->step();
    const E* rows = v.ptr[i] + off;
    const float* wi = w + i * v.size;
    const int64_t n = i + 1 < v.count ? v.size : v.last;
    for (int64_t t = 0; t < n; ++t) {
      V x[P];
      load_chunks<P>(rows + t * v_stride, x);
      for (int r = 0; r < R; ++r) {
        const V weight = Vec::set1(wi[r * w_stride + t]);
        for (int c = 0; c < P; ++c) a[r][c] = Vec::fmadd(weight, x[c], a[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < P; ++c) Vec::store(acc + r * acc_stride + c * Vec::W, a[r][c]);
}

template <int R, typename E>
void values_rows(int64_t piece, float* acc, int64_t acc_stride, const float* w, int64_t w_stride,
                 const VBlocks<E>& v, int64_t off, int64_t v_stride, bool prefetch) {
  static_assert(Vec::kValuePiece == 4, "values_rows covers pieces of 1 to 4 chunks");
  if constexpr (std::is_same_v<E, PairedBf16>) {  // pieces of 2 or 4 chunks (32-dim multiples)
    if (piece == 2) return values_tile<R, 2>(acc, acc_stride, w, w_stride, v, off, v_stride, prefetch);
    return values_tile<R, 4>(acc, acc_stride, w, w_stride, v, off, v_stride, prefetch);
  } else {
    switch (piece) {
      case 1: return values_tile<R, 1>(acc, acc_stride, w, w_stride, v, off, v_stride, prefetch);
      case 2: return values_tile<R, 2>(acc, acc_stride, w, w_stride, v, off, v_stride, prefetch);
      case 3: return values_tile<R, 3>(acc, acc_stride, w, w_stride, v, off, v_stride, prefetch);
      default: return values_tile<R, 4>(acc, acc_stride, w, w_stride, v, off, v_stride, prefetch);
    }
  }
}

// acc [rows, padded] += w [rows, tokens] (row stride w_stride) . the blocks' V rows [tokens, padded]
// (row stride v_stride): the head dim in pieces of kValuePiece chunks, the rows in even tiles of at
// most kRowTile (7 -> 4 + 3); the first pass issues the blocks' prefetches.
template <typename E>
void block_values(float* acc, int64_t padded, const float* w, int64_t w_stride, const VBlocks<E>& v,
                  int64_t v_stride, int64_t rows) {
  static_assert(Vec::kRowTile <= 6, "block_values covers tiles of 1 to 6 rows");
  const int64_t tiles = (rows + Vec::kRowTile - 1) / Vec::kRowTile, tile = (rows + tiles - 1) / tiles;
  for (int64_t c0 = 0; c0 < padded / Vec::W; c0 += Vec::kValuePiece) {
    const int64_t piece = std::min<int64_t>(Vec::kValuePiece, padded / Vec::W - c0), off = c0 * Vec::W;
    for (int64_t r0 = 0; r0 < rows; r0 += tile) {
      float* a = acc + r0 * padded + off;
      const float* wr = w + r0 * w_stride;
      const bool prefetch = v.ahead != nullptr && c0 == 0 && r0 == 0;
#define TY_ROWS(R) values_rows<(R < Vec::kRowTile ? R : Vec::kRowTile)>(piece, a, padded, wr, w_stride, v, off, \
                                                                        v_stride, prefetch)
      switch (std::min(tile, rows - r0)) {
        case 1: TY_ROWS(1); break; case 2: TY_ROWS(2); break; case 3: TY_ROWS(3); break;
        case 4: TY_ROWS(4); break; case 5: TY_ROWS(5); break; default: TY_ROWS(6); break;
      }
#undef TY_ROWS
    }
  }
}

inline float row_max(const float* s, int64_t m) {  // max of s[0..m), m > 0; lanes past m unread
  V best = Vec::set1(-INFINITY);
  int64_t t = 0;
  for (; t + Vec::W <= m; t += Vec::W) best = Vec::max(best, Vec::load(s + t));
  if (t < m) best = Vec::max(best, Vec::keep_first(Vec::load(s + t), m - t, -INFINITY));
  return Vec::hmax(best);
}

// s[t] = exp(s[t] - shift) for t < m, 0 for m <= t < end (end a multiple of W) -> sum over t < m.
inline float exp_minus_and_sum(float* s, int64_t m, int64_t end, float shift) {
  V sum = Vec::zero();
  const V sh = Vec::set1(shift);
  int64_t t = 0;
  for (; t + Vec::W <= m; t += Vec::W) {
    const V e = Vec::exp(Vec::sub(Vec::load(s + t), sh));
    Vec::store(s + t, e);
    sum = Vec::add(sum, e);
  }
  if (t < m) {
    const V e = Vec::keep_first(Vec::exp(Vec::sub(Vec::load(s + t), sh)), m - t, 0.0f);
    Vec::store(s + t, e);
    sum = Vec::add(sum, e);
    t += Vec::W;
  }
  for (; t < end; t += Vec::W) Vec::store(s + t, Vec::zero());
  return Vec::hsum(sum);
}

constexpr int64_t kSpanTokens = 512;  // scores held at once: whole blocks, this many tokens or one block
constexpr int64_t kAheadBlocks = 2;  // blocks prefetched ahead of the one being read

struct Layout {  // attend_group's scratch, in floats
  int64_t group, rows, padded, span, score_stride, block_size;
  bool dot_bf16 = false;  // scores by block_scores_bf16 (bfloat16 q and cache, AVX512_BF16, see run_typed)
  bool paired = false;  // V rows read as PairedBf16 (bfloat16 cache, AVX-512, head dim a multiple of 32)
  explicit Layout(const Problem& p)
      : group(p.q_heads / p.kv_heads), rows(group * p.max_query_len), padded(round_up(p.head_dim, Vec::W)),
        span(std::max<int64_t>(1, kSpanTokens / p.block_size) * p.block_size),
        score_stride(round_up(span, Vec::W) + Vec::W), block_size(p.block_size) {}
  // rows = group x (most query tokens of a sequence); row r = i * group + g (query token i, head g)
  // [rows, padded] scaled queries | [rows, padded] accumulators | [rows, score_stride] one span's
  // scores, then softmax numerators | [block_size, padded] K block as float32 | the same for V |
  // [rows] running max | [rows] running sum | [rows] the span's correction of the accumulators
  int64_t query() const { return 0; }
  int64_t acc() const { return rows * padded; }
  int64_t scores() const { return 2 * rows * padded; }
  int64_t k_rows() const { return scores() + rows * score_stride; }
  int64_t v_rows() const { return k_rows() + block_size * padded; }
  int64_t run_max() const { return v_rows() + block_size * padded; }
  int64_t run_sum() const { return run_max() + rows; }
  int64_t correction() const { return run_sum() + rows; }
  int64_t floats() const { return correction() + rows; }
};

// Sequence b, KV head h: `rows` query rows, row r = query token r / group (of nq) and query head
// h * group + r % group; row r sees the first limit(r) = len - (nq - 1 - r / group) tokens (causal).
struct Task {
  int64_t b, h, len, first, nq, rows, group, num_blocks;
  const int64_t* table;  // the sequence's block ids
  // Where one thread attends all the sequence's KV heads in turn (attend_sequences) and its K/V fit
  // kWholeRowsBytes: head 0 prefetches whole cache rows (every head's), one contiguous stream per
  // block instead of a 1-in-kv_heads stride, unless they were streamed in while the thread's
  // previous sequence ran (prefetched), and the later heads prefetch nothing (their rows are in L2
  // by then). Else each head prefetches its own rows.
  bool shared_rows;
  bool prefetched;  // its whole rows came in while the thread's previous sequence ran: no own prefetch
  NextRows* next;  // nullptr, or the thread's next sequence, a step per block of each pass
  int64_t limit(int64_t r) const { return len - (nq - 1 - r / group); }
  int64_t query_row(const Problem& p, int64_t r) const {  // row r's [head_dim] row of q / out
    return (first + r / group) * p.q_heads + h * group + r % group;
  }
};

constexpr int64_t kWholeRowsBytes = 512 * 1024;  // a sequence's K + V, all heads: well inside L2

template <typename CacheT>
inline bool whole_rows_fit(const Problem& p, int64_t b) {
  return 2 * p.seq_lens[b] * p.kv_heads * p.head_dim * int64_t{sizeof(CacheT)} <= kWholeRowsBytes;
}

// Query tokens [q0, q1) of sequence b's (a decode: [0, 1)), attended as a chunk of their own: the
// chunk's tokens after q1 drop out of the context, so each row keeps its causal limit.
struct Piece {
  int64_t b, q0, q1;
};

inline int64_t query_count(const Problem& p, int64_t b) {
  return p.query_start ? p.query_start[b + 1] - p.query_start[b] : 1;
}

template <typename CacheT>
inline Task make_task(const Problem& p, const Layout& lay, Piece piece, int64_t h, bool heads_together,
                      bool prefetched, NextRows* next) {
  const int64_t b = piece.b, nq = piece.q1 - piece.q0;  // query tokens [first, first + nq)
  const int64_t first = (p.query_start ? p.query_start[b] : b) + piece.q0;
  const int64_t len = p.seq_lens[b] - (query_count(p, b) - piece.q1);
  const bool fits = heads_together && whole_rows_fit<CacheT>(p, b);
  return {b, h, len, first, nq, nq * lay.group, lay.group, (len + p.block_size - 1) / p.block_size,
          p.block_tables + b * p.table_stride, fits, fits && prefetched, next};
}

// Block j's rows of KV head h in `cache` (K or V), or every head's, to prefetch; nothing past the
// task, nothing where head 0 brought them (Task::shared_rows).
template <typename CacheT>
inline PrefetchRows block_rows_of(const Problem& p, const Task& task, const void* cache, int64_t j) {
  if (j >= task.num_blocks || (task.shared_rows && (task.h > 0 || task.prefetched))) return {nullptr, 0, 0};
  const int64_t rows = std::min(p.block_size, task.len - j * p.block_size);
  const CacheT* block = static_cast<const CacheT*>(cache) + task.table[j] * p.block_stride;
  if (task.shared_rows) return {block, rows, static_cast<int64_t>(p.kv_heads * p.head_dim * sizeof(CacheT))};
  return {block + task.h * p.head_dim, rows, static_cast<int64_t>(p.head_dim * sizeof(CacheT))};
}

template <typename CacheT>
inline void prefetch_block(const Problem& p, const Task& task, const void* cache, int64_t j) {
  const PrefetchRows rows = block_rows_of<CacheT>(p, task, cache, j);
  if (rows.first) prefetch_rows(rows.first, rows.rows, p.kv_heads * p.head_dim * sizeof(CacheT), rows.row_bytes);
}

// Pass 1 over blocks [j0, j1) (one span): scores[r][t - j0 * bs] = q_r . k_t for the tokens row r
// sees; each K block widened (when needed) once for every row. Prefetches K ahead, then the span's V.
template <typename CacheT>
void span_scores(const Problem& p, const Layout& lay, const Task& task, int64_t j0, int64_t j1, float* work) {
  const int64_t bs = p.block_size, dim = p.head_dim, row_stride = p.kv_heads * dim;
  const CacheT* k_cache = static_cast<const CacheT*>(p.k_cache) + task.h * dim;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t ahead = j + kAheadBlocks;
    if (ahead < j1) prefetch_block<CacheT>(p, task, p.k_cache, ahead);
    else if (j0 + ahead - j1 < j1) prefetch_block<CacheT>(p, task, p.v_cache, j0 + ahead - j1);
    if (task.next) task.next->step();
    const int64_t n = std::min(bs, task.len - j * bs);
#if TY_ISA == 512
    if constexpr (std::is_same_v<CacheT, c10::BFloat16>) {
      if (lay.dot_bf16) {  // q and K as they lie, no widening
        for (int64_t r = 0; r < task.rows; ++r) {
          const int64_t m = std::min(n, task.limit(r) - j * bs);
          if (m > 0)
            block_scores_bf16(static_cast<const c10::BFloat16*>(p.q) + task.query_row(p, r) * dim,
                              k_cache + task.table[j] * p.block_stride, row_stride, m, dim, p.scale,
                              work + lay.scores() + r * lay.score_stride + (j - j0) * bs);
        }
        continue;
      }
    }
#endif
    const Rows k = block_rows(k_cache + task.table[j] * p.block_stride, n, row_stride, dim, lay.padded,
                              work + lay.k_rows());
    for (int64_t r = 0; r < task.rows; ++r) {
      const int64_t m = std::min(n, task.limit(r) - j * bs);  // tokens of this block row r sees
      if (m > 0)
        block_scores(work + lay.query() + r * lay.padded, k, m, lay.padded,
                     work + lay.scores() + r * lay.score_stride + (j - j0) * bs);
    }
  }
}

// Online-softmax update of every row with the span's scores (tokens [span0, span0 + span_len)):
// run_max / run_sum rescaled, scores turned into numerators (0 past what the row sees, to the
// span's end), correction[r] the factor row r's accumulators take before the span's values (1
// for a row that sees none of the span: nothing changes).
inline void span_softmax(const Layout& lay, const Task& task, int64_t span0, int64_t span_len, float* work) {
  float *run_max = work + lay.run_max(), *run_sum = work + lay.run_sum(), *correction = work + lay.correction();
  const int64_t end = round_up(span_len, Vec::W);
  for (int64_t r = 0; r < task.rows; ++r) {
    float* s = work + lay.scores() + r * lay.score_stride;
    const int64_t m = std::min(span_len, task.limit(r) - span0);
    if (m <= 0) {
      correction[r] = 1.0f;
      std::fill(s, s + end, 0.0f);
      continue;
    }
    const float new_max = std::max(run_max[r], row_max(s, m));
    correction[r] = run_sum[r] > 0.0f ? std::exp(run_max[r] - new_max) : 0.0f;
    run_sum[r] = run_sum[r] * correction[r] + exp_minus_and_sum(s, m, end, new_max);
    run_max[r] = new_max;
  }
}

// Pass 2 over blocks [j0, j1): acc_r = acc_r * correction[r] + sum_t numerator_r[t] * v_t, every
// row at once per V row (a row's zero numerators past its limit add exact zeros: the K/V of a
// chunk's later tokens, in the cache and finite, times 0). Prefetches V ahead, then the next span's K.
// span_values where V rows are read where they lie (as E: CacheT, or PairedBf16): all the span's
// blocks in one block_values call, each block's prefetch (V ahead, then the next span's K) issued
// as it is reached.
template <typename E, typename CacheT>
void span_values_in_place(const Problem& p, const Layout& lay, const Task& task, int64_t j0, int64_t j1,
                          float* work) {
  const E* ptr[kSpanTokens];  // a span holds at most kSpanTokens blocks (of one token)
  PrefetchRows ahead[kSpanTokens];
  const CacheT* v_cache = static_cast<const CacheT*>(p.v_cache) + task.h * p.head_dim;
  for (int64_t j = j0; j < j1; ++j) {
    ptr[j - j0] = reinterpret_cast<const E*>(v_cache + task.table[j] * p.block_stride);
    const int64_t a = j + kAheadBlocks;
    ahead[j - j0] = block_rows_of<CacheT>(p, task, a < j1 ? p.v_cache : p.k_cache, a);
  }
  const VBlocks<E> v{ptr, j1 - j0, p.block_size, std::min(p.block_size, task.len - (j1 - 1) * p.block_size), ahead,
                     static_cast<int64_t>(p.kv_heads * p.head_dim * sizeof(CacheT)), task.next};
  block_values(work + lay.acc(), lay.padded, work + lay.scores(), lay.score_stride, v, p.kv_heads * p.head_dim,
               task.rows);
}

template <typename CacheT>
void span_values(const Problem& p, const Layout& lay, const Task& task, int64_t j0, int64_t j1, float* work) {
  const int64_t bs = p.block_size, dim = p.head_dim, row_stride = p.kv_heads * dim, padded = lay.padded;
  float* acc = work + lay.acc();
  for (int64_t r = 0; r < task.rows; ++r) {
    const V c = Vec::set1(work[lay.correction() + r]);
    for (float* a = acc + r * padded; a < acc + (r + 1) * padded; a += Vec::W) Vec::store(a, Vec::mul(Vec::load(a), c));
  }
  const CacheT* v_cache = static_cast<const CacheT*>(p.v_cache) + task.h * dim;
#if TY_ISA == 512
  if constexpr (std::is_same_v<CacheT, c10::BFloat16>) {
    if (lay.paired) return span_values_in_place<PairedBf16, CacheT>(p, lay, task, j0, j1, work);
  }
#endif
  if (dim == padded) return span_values_in_place<CacheT, CacheT>(p, lay, task, j0, j1, work);
  for (int64_t j = j0; j < j1; ++j) {  // rows widened and padded into a copy, a block at a time
    const int64_t ahead = j + kAheadBlocks;
    prefetch_block<CacheT>(p, task, ahead < j1 ? p.v_cache : p.k_cache, ahead);
    if (task.next) task.next->step();
    const int64_t n = std::min(bs, task.len - j * bs);
    const Rows x = block_rows(v_cache + task.table[j] * p.block_stride, n, row_stride, dim, padded,
                              work + lay.v_rows());
    const float* rows[1] = {x.data};
    block_values(acc, padded, work + lay.scores() + (j - j0) * bs, lay.score_stride,
                 VBlocks<float>{rows, 1, n, n, nullptr, 0, nullptr}, x.stride, task.rows);
  }
}

template <typename IoT>
void load_queries(const Problem& p, const Layout& lay, const Task& task, float* work) {
  const int64_t dim = p.head_dim, padded = lay.padded;
  for (int64_t r = 0; r < task.rows; ++r) {  // row r: query token r / group, its head h * group + r % group
    const IoT* q = static_cast<const IoT*>(p.q) + ((task.first + r / task.group) * p.q_heads + task.h * task.group +
                                                   r % task.group) * dim;
    float* query = work + lay.query() + r * padded;
    if (lay.dot_bf16) {
      // block_scores_bf16 reads q where it lies: no scaled float32 copy
    } else if (dim == padded) {
      for (int64_t d = 0; d < dim; d += Vec::W) Vec::store(query + d, Vec::mul(load_chunk(q + d), Vec::set1(p.scale)));
    } else {
      for (int64_t d = 0; d < padded; ++d) query[d] = d < dim ? static_cast<float>(q[d]) * p.scale : 0.0f;
    }
    std::fill(work + lay.acc() + r * padded, work + lay.acc() + (r + 1) * padded, 0.0f);
    work[lay.run_max() + r] = -INFINITY;
    work[lay.run_sum() + r] = 0.0f;
  }
}

// The group's query rows attended over the sequence's blocks, a span (kSpanTokens) at a time: all
// scores of the span, one softmax update per row, then the values, every row per K/V row read.
// Row r's arithmetic depends only on its own limit, so token i of a chunk equals a decode row of
// limit(r) tokens bit for bit.
template <typename CacheT, typename IoT>
void attend_group(const Problem& p, const Layout& lay, Piece piece, int64_t h, bool heads_together, bool prefetched,
                  NextRows* next, float* work) {
  const Task task = make_task<CacheT>(p, lay, piece, h, heads_together, prefetched, next);
  load_queries<IoT>(p, lay, task, work);
  for (int64_t j = 0; j < kAheadBlocks; ++j) prefetch_block<CacheT>(p, task, p.k_cache, j);
  const int64_t span_blocks = lay.span / p.block_size;
  for (int64_t j0 = 0; j0 < task.num_blocks; j0 += span_blocks) {
    const int64_t j1 = std::min(task.num_blocks, j0 + span_blocks), span0 = j0 * p.block_size;
    span_scores<CacheT>(p, lay, task, j0, j1, work);
    span_softmax(lay, task, span0, std::min(lay.span, task.len - span0), work);
    span_values<CacheT>(p, lay, task, j0, j1, work);
  }
  const float* acc = work + lay.acc();
  for (int64_t r = 0; r < task.rows; ++r) {
    IoT* out = static_cast<IoT*>(p.out) + task.query_row(p, r) * p.head_dim;
    const float sum = work[lay.run_sum() + r], inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // len 0 (padding): zeros
    write_row(out, acc + r * lay.padded, p.head_dim, lay.paired, inv);
  }
}

#include "paged_attention_threads.h"  // the work of a call spread over the threads: run()
