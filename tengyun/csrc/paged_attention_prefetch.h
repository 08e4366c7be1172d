// The paged attention kernel's software prefetches, for one instruction set. No include guard on
// purpose: paged_attention_impl.h includes it once per ISA, inside that ISA's namespace.

// Into L2, not L1 (prefetcht0): 1.3-1.65x the decode attention's speed on this EPYC, float32 and
// bfloat16 (benchmarks/decode_attention_bandwidth.py; prefetcht2 the same, prefetchnta no gain).
inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*p));  // not __builtin_prefetch: GCC deleted loops of those here
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

inline void prefetch_rows(const void* first, int64_t rows, int64_t row_stride_bytes, int64_t row_bytes) {
  const char* base = static_cast<const char*>(first);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t b = 0; b < row_bytes; b += 64) prefetch_line(base + t * row_stride_bytes + b);
}

// A span's V rows read in place: block i's first row at ptr[i] (`size` rows each, the last `last`);
// before reading it, the rows at ahead[i] (a later block, or the next span's K) go into the cache.
struct PrefetchRows {
  const void* first;  // nullptr: nothing
  int64_t rows, row_bytes;  // row_bytes: one KV head's row, or every head's (Task::shared_rows)
};

// Where a thread attends whole sequences (paged_attention_threads.h attend_sequences), the sequence
// it takes next: its whole cache rows (every KV head's, K then V), a few rows at each block step of
// the current sequence, so memory is read while the current one computes and the next one's heads
// all find their rows in L2. Without it head 0 of each sequence waited for all of them (its scores
// and values read in bursts) and the other heads read from L2 with memory idle.
struct NextRows {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* table = nullptr;  // the next sequence's block ids
  int64_t len = 0, block_size = 0, row_bytes = 0, block_bytes = 0;
  int64_t done = 0, per_step = 0;  // rows issued of 2 * len (K's, then V's); rows per step

  // Sequence b's rows (cache elements of elem_bytes), spread over `steps` calls of step().
  void start(const Problem& p, int64_t b, int64_t elem_bytes, int64_t steps) {
    k = static_cast<const char*>(p.k_cache);
    v = static_cast<const char*>(p.v_cache);
    table = p.block_tables + b * p.table_stride;
    len = p.seq_lens[b];
    block_size = p.block_size;
    row_bytes = p.kv_heads * p.head_dim * elem_bytes;
    block_bytes = p.block_stride * elem_bytes;
    done = 0;
    per_step = (2 * len + steps - 1) / std::max<int64_t>(steps, 1);
  }
  void issue(int64_t end) {
    for (; done < end; ++done) {
      const bool value = done >= len;
      const int64_t t = value ? done - len : done;
      const char* row = (value ? v : k) + table[t / block_size] * block_bytes + (t % block_size) * row_bytes;
      for (int64_t b = 0; b < row_bytes; b += 64) prefetch_line(row + b);
    }
  }
  void step() { issue(std::min(2 * len, done + per_step)); }
  void finish() { issue(2 * len); }
};
