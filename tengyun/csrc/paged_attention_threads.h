// The paged attention kernel's work spread over torch's OpenMP threads, for one instruction set. No
// include guard on purpose: paged_attention_impl.h includes it once per ISA, inside that ISA's
// namespace, after attend_group.
//
// Many sequences (from 4 per thread): each thread takes whole sequences, one KV head after another,
// while the next one it claimed streams into L2 (attend_sequences). Fewer: tasks of one KV head and
// one piece of a sequence's query tokens (split_queries), so a single prompt's three KV heads are
// not three tasks on two threads.

// One thread's share of whole sequences, claimed one ahead from `claims`: while sequence b's KV
// heads are attended, the one claimed after it streams into L2 (NextRows), its steps spread over
// b's block steps (two passes per head). Neither is streamed where either's rows exceed
// kWholeRowsBytes: a long sequence's own heads prefetch its rows as before.
template <typename CacheT, typename IoT>
void attend_sequences(const Problem& p, const Layout& lay, std::atomic<int64_t>& claims, float* work) {
  NextRows stream;
  bool prefetched = false;
  for (int64_t b = claims.fetch_add(1); b < p.batch;) {
    const int64_t following = claims.fetch_add(1);
    const bool streams = following < p.batch && whole_rows_fit<CacheT>(p, following) && whole_rows_fit<CacheT>(p, b);
    if (streams) {
      const int64_t steps = 2 * p.kv_heads * ((p.seq_lens[b] + p.block_size - 1) / p.block_size);
      stream.start(p, following, sizeof(CacheT), steps);
    }
    for (int64_t h = 0; h < p.kv_heads; ++h)
      attend_group<CacheT, IoT>(p, lay, Piece{b, 0, query_count(p, b)}, h, true, prefetched,
                                streams ? &stream : nullptr, work);
    if (streams) stream.finish();  // rows the steps did not reach (a pass without the hook)
    prefetched = streams;
    b = following;
  }
}

constexpr int64_t kMinPieceTokens = 16;  // query tokens per piece, on average at least: each re-reads its context

// Each sequence's query tokens in up to `split` pieces, and no more than n / kMinPieceTokens, of
// about equal causal work (token i of n after ctx cached tokens sees ctx + i + 1 keys; the later
// pieces are the shorter): a 128-token prompt of SmolLM2 (3 KV heads) on 2 threads, 3 pieces of
// 74, 31 and 23 tokens.
inline std::vector<Piece> split_queries(const Problem& p, int64_t split) {
  std::vector<Piece> pieces;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t n = query_count(p, b), ctx = p.seq_lens[b] - n;
    const int64_t count = std::max<int64_t>(1, std::min(split, n / kMinPieceTokens));
    const auto keys = [ctx](int64_t m) { return m * ctx + m * (m + 1) / 2; };  // seen by tokens [0, m)
    int64_t q0 = 0;
    for (int64_t k = 1; k < count; ++k) {
      int64_t q1 = q0 + 1;
      while (q1 < n && keys(q1) * count < keys(n) * k) ++q1;
      pieces.push_back({b, q0, q1});
      q0 = q1;
    }
    pieces.push_back({b, q0, n});
  }
  return pieces;
}

// The scratch of a thread (Layout) holds its largest task's rows: a piece's, not its whole chunk's
// (a fresh 1024-token prompt of SmolLM2 on 2 threads, 3 pieces of 591, 246 and 187 tokens: 1,773
// rows, 4.7 MB a thread, instead of 3,072 rows and 8.1 MB).
inline Problem sized_for(const Problem& p, const std::vector<Piece>& pieces) {
  Problem sized = p;
  if (!pieces.empty()) {
    sized.max_query_len = 1;
    for (const Piece& piece : pieces) sized.max_query_len = std::max(sized.max_query_len, piece.q1 - piece.q0);
  }
  return sized;
}

template <typename CacheT, typename IoT>
void run_typed(const Problem& p) {
  const int64_t threads = std::max<int64_t>(1, p.threads);
  const bool heads_together = p.kv_heads > 1 && p.batch >= 4 * threads;
  std::vector<Piece> pieces;
  if (!heads_together) pieces = split_queries(p, (4 * threads + p.batch * p.kv_heads - 1) / (p.batch * p.kv_heads));
  Layout lay(sized_for(p, pieces));
#if TY_ISA == 512
  static const bool has_bf16_dot = __builtin_cpu_supports("avx512bf16");
  lay.dot_bf16 = std::is_same_v<CacheT, c10::BFloat16> && std::is_same_v<IoT, c10::BFloat16> && has_bf16_dot &&
                 p.head_dim % 32 == 0 && p.head_dim <= 128;
  lay.paired = std::is_same_v<CacheT, c10::BFloat16> && p.head_dim % 32 == 0;
#endif
  const int64_t tasks = heads_together ? p.batch * p.kv_heads : static_cast<int64_t>(pieces.size()) * p.kv_heads;
  std::atomic<int64_t> claims{0};
#pragma omp parallel num_threads(static_cast<int>(std::min(threads, tasks)))
  {
    float* work = static_cast<float*>(std::aligned_alloc(64, round_up(lay.floats() * sizeof(float), 64)));
    std::fill(work, work + lay.floats(), 0.0f);  // lanes past a row's scores are read (then masked)
    if (heads_together) {
      attend_sequences<CacheT, IoT>(p, lay, claims, work);
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task)
        attend_group<CacheT, IoT>(p, lay, pieces[task / p.kv_heads], task % p.kv_heads, false, false, nullptr, work);
    }
    std::free(work);
  }
}

template <typename CacheT>
void run_cache(const Problem& p) {
  switch (p.io_type) {
    case DType::f32: return run_typed<CacheT, float>(p);
    case DType::bf16: return run_typed<CacheT, c10::BFloat16>(p);
    case DType::f16: return run_typed<CacheT, c10::Half>(p);
  }
}

inline void run(const Problem& p) {
  switch (p.cache_type) {
    case DType::f32: return run_cache<float>(p);
    case DType::bf16: return run_cache<c10::BFloat16>(p);
    case DType::f16: return run_cache<c10::Half>(p);
  }
}
