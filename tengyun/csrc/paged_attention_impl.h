// Paged decode attention for one instruction set. No include guard on purpose: paged_attention.cpp
// includes this file once per ISA, each time inside its own namespace and under a matching
// `#pragma GCC target`, with TY_ISA set to 512 (AVX-512 F/BW/VL/DQ), 256 (AVX2 + FMA + F16C) or 0
// (portable C++). Everything defined here is therefore compiled for that ISA only and runs only
// after paged_attention.cpp has checked the CPU has it (__builtin_cpu_supports).
//
// Cache layout (shared by every backend): k/v [num_blocks, block_size, num_kv_heads, head_dim];
// row t of block n, KV head h starts at n * block_stride + (t * num_kv_heads + h) * head_dim.

#if TY_ISA == 512
struct Vec {  // 16 float lanes
  static constexpr int64_t W = 16;
  using T = __m512;
  static inline T zero() { return _mm512_setzero_ps(); }
  static inline T set1(float x) { return _mm512_set1_ps(x); }
  static inline T load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static inline T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static inline T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static inline T add(T a, T b) { return _mm512_add_ps(a, b); }
  static inline T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static inline T max(T a, T b) { return _mm512_max_ps(a, b); }
  static inline float hsum(T v) { return _mm512_reduce_add_ps(v); }
  static constexpr int kMaxPiece = 8;  // chunks of W held in registers at once (of 32 zmm)
  // v[0..15] -> one vector whose lane i is the sum of v[i]'s lanes (45 ops, not 16 reductions).
  static inline T transpose_sum(const T* v) {
    T w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
      w[i] = add(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: partial sums of v[4i .. 4i+3]
      x[i] = add(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)  // 128-bit lanes: [x(2i) L0+L1, x(2i) L2+L3, x(2i+1) L0+L1, x(2i+1) L2+L3]
      y[i] = add(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88), _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    return add(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  }
  static inline float hmax(T v) { return _mm512_reduce_max_ps(v); }
  static inline T load_bf16(const uint16_t* p) {  // bfloat16 is the high half of a float32
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline T load_fp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline T exp(T x) {  // Cephes expf: 2^n * e^r, |r| <= ln2 / 2; ~1 ulp
    x = _mm512_min_ps(_mm512_max_ps(x, set1(-87.3f)), set1(88.3f));
    T n = _mm512_roundscale_ps(mul(x, set1(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    T r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    return _mm512_scalef_ps(exp_reduced(r), n);
  }
  static inline T exp_reduced(T r) {
    T y = fmadd(set1(1.9875691500e-4f), r, set1(1.3981999507e-3f));
    y = fmadd(y, r, set1(8.3334519073e-3f));
    y = fmadd(y, r, set1(4.1665795894e-2f));
    y = fmadd(y, r, set1(1.6666665459e-1f));
    y = fmadd(y, r, set1(5.0000001201e-1f));
    return _mm512_add_ps(fmadd(y, mul(r, r), r), set1(1.0f));
  }
};
#elif TY_ISA == 256
struct Vec {  // 8 float lanes
  static constexpr int64_t W = 8;
  using T = __m256;
  static inline T zero() { return _mm256_setzero_ps(); }
  static inline T set1(float x) { return _mm256_set1_ps(x); }
  static inline T load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static inline T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static inline T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static inline T add(T a, T b) { return _mm256_add_ps(a, b); }
  static inline T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static inline T max(T a, T b) { return _mm256_max_ps(a, b); }
  static constexpr int kMaxPiece = 4;  // chunks of W held in registers at once (of 16 ymm)
  static inline T transpose_sum(const T* v) {  // v[0..7] -> lane i = sum of v[i]'s lanes
    T a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // per 128: v0..v3 halves
    T b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return add(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  static inline float hsum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static inline float hmax(T v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static inline T load_bf16(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline T load_fp16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline T exp(T x) {
    x = _mm256_min_ps(_mm256_max_ps(x, set1(-87.3f)), set1(88.3f));
    T n = _mm256_round_ps(mul(x, set1(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    T r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    T y = fmadd(set1(1.9875691500e-4f), r, set1(1.3981999507e-3f));
    y = fmadd(y, r, set1(8.3334519073e-3f));
    y = fmadd(y, r, set1(4.1665795894e-2f));
    y = fmadd(y, r, set1(1.6666665459e-1f));
    y = fmadd(y, r, set1(5.0000001201e-1f));
    y = _mm256_add_ps(fmadd(y, mul(r, r), r), set1(1.0f));
    __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return mul(y, _mm256_castsi256_ps(pow2n));
  }
};
#else
struct Vec {  // one lane: plain C++ for CPUs without AVX2 (and non-x86 builds)
  static constexpr int64_t W = 1;
  using T = float;
  static inline T zero() { return 0.0f; }
  static inline T set1(float x) { return x; }
  static inline T load(const float* p) { return *p; }
  static inline void store(float* p, T v) { *p = v; }
  static inline T fmadd(T a, T b, T c) { return a * b + c; }
  static inline T mul(T a, T b) { return a * b; }
  static inline T add(T a, T b) { return a + b; }
  static inline T sub(T a, T b) { return a - b; }
  static inline T max(T a, T b) { return a > b ? a : b; }
  static inline float hsum(T v) { return v; }
  static constexpr int kMaxPiece = 8;
  static inline T transpose_sum(const T* v) { return v[0]; }
  static inline float hmax(T v) { return v; }
  static inline T load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static inline T load_fp16(const uint16_t* p) { return fp16_to_float(*p); }
  static inline T exp(T x) { return std::exp(x); }
};
#endif

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

// acc[P chunks] = acc * correction + sum_t p[t] * v_t, the accumulators held in registers.
template <int P>
void values_piece(float* acc, float correction, const float* p, Rows v, int64_t n) {
  V a[P];
  for (int c = 0; c < P; ++c) a[c] = Vec::mul(Vec::load(acc + c * Vec::W), Vec::set1(correction));
  for (int64_t t = 0; t < n; ++t) {
    const V weight = Vec::set1(p[t]);
    const float* row = v.data + t * v.stride;
    for (int c = 0; c < P; ++c) a[c] = Vec::fmadd(weight, Vec::load(row + c * Vec::W), a[c]);
  }
  for (int c = 0; c < P; ++c) Vec::store(acc + c * Vec::W, a[c]);
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

inline void block_values(float* acc, float correction, const float* p, Rows v, int64_t n, int64_t padded) {
  for (int64_t c0 = 0; c0 < padded / Vec::W; c0 += Vec::kMaxPiece) {
    const int64_t piece = std::min<int64_t>(Vec::kMaxPiece, padded / Vec::W - c0), off = c0 * Vec::W;
    const Rows part{v.data + off, v.stride};
#define TY_VALUES(P) values_piece<P>(acc + off, correction, p, part, n)
    TY_PIECES(TY_VALUES)
#undef TY_VALUES
  }
}
#undef TY_PIECES

inline float row_max(const float* s, int64_t n) {
  V m = Vec::set1(-INFINITY);
  int64_t t = 0;
  for (; t + Vec::W <= n; t += Vec::W) m = Vec::max(m, Vec::load(s + t));
  float best = Vec::hmax(m);
  for (; t < n; ++t) best = std::max(best, s[t]);
  return best;
}

inline float exp_minus_and_sum(float* s, int64_t n, float shift) {  // s[t] = exp(s[t] - shift); -> sum
  V sum = Vec::zero();
  const V sh = Vec::set1(shift);
  int64_t t = 0;
  for (; t + Vec::W <= n; t += Vec::W) {
    const V e = Vec::exp(Vec::sub(Vec::load(s + t), sh));
    Vec::store(s + t, e);
    sum = Vec::add(sum, e);
  }
  float total = Vec::hsum(sum);
  for (; t < n; ++t) total += (s[t] = std::exp(s[t] - shift));
  return total;
}

inline void prefetch_rows(const void* first, int64_t rows, int64_t row_stride_bytes, int64_t row_bytes) {
  const char* base = static_cast<const char*>(first);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(base + t * row_stride_bytes + b, 0, 3);
}

struct Layout {  // attend_group's scratch, in floats
  int64_t group, rows, padded, score_stride, block_size;
  explicit Layout(const Problem& p)
      : group(p.q_heads / p.kv_heads), rows(group * p.max_query_len), padded(round_up(p.head_dim, Vec::W)),
        score_stride(round_up(p.block_size, Vec::W)), block_size(p.block_size) {}
  // rows = group x (most query tokens of a sequence); row r = i * group + g (query token i, head g)
  // [rows, padded] scaled queries | [rows, padded] accumulators | [rows, score_stride] scores |
  // [block_size, padded] K block as float32 | the same for V | [rows] running max | [rows] running sum
  int64_t query() const { return 0; }
  int64_t acc() const { return rows * padded; }
  int64_t scores() const { return 2 * rows * padded; }
  int64_t k_rows() const { return scores() + rows * score_stride; }
  int64_t v_rows() const { return k_rows() + block_size * padded; }
  int64_t run_max() const { return v_rows() + block_size * padded; }
  int64_t run_sum() const { return run_max() + rows; }
  int64_t floats() const { return run_sum() + rows; }
};

// Online-softmax update of one query row with the first m tokens of a block: s = q . K (scale is
// folded into q), run_max / run_sum rescaled, acc = acc * correction + softmax numerators . V.
inline void attend_rows(const float* query, float* acc, float* s, float& run_max, float& run_sum, Rows k, Rows v,
                        int64_t m, int64_t padded) {
  block_scores(query, k, m, padded, s);
  const float new_max = std::max(run_max, row_max(s, m));
  const float correction = run_sum > 0.0f ? std::exp(run_max - new_max) : 0.0f;
  run_sum = run_sum * correction + exp_minus_and_sum(s, m, new_max);
  run_max = new_max;
  block_values(acc, correction, s, v, m, padded);
}

// Sequence b, KV head h: the `group` query heads that read KV head h, for each of the sequence's
// query tokens (one in a decode; the last token and the drafts in a speculative verify), attended
// together over the sequence's blocks with an online softmax, so each K/V row is read from memory
// once. Query token i of n attends over the first seq_lens[b] - (n - 1 - i) tokens (causal).
template <typename CacheT, typename IoT>
void attend_group(const Problem& p, const Layout& lay, int64_t b, int64_t h, float* work) {
  const int64_t group = lay.group, dim = p.head_dim, padded = lay.padded, bs = p.block_size;
  const int64_t row_stride = p.kv_heads * dim, len = p.seq_lens[b];
  const int64_t first = p.query_start ? p.query_start[b] : b;  // query tokens [first, first + nq)
  const int64_t nq = p.query_start ? p.query_start[b + 1] - first : 1, rows = nq * group;
  float *query = work + lay.query(), *acc = work + lay.acc(), *scores = work + lay.scores();
  float *run_max = work + lay.run_max(), *run_sum = work + lay.run_sum();
  for (int64_t r = 0; r < rows; ++r) {  // row r: query token r / group, its head h * group + r % group
    const IoT* q = static_cast<const IoT*>(p.q) + ((first + r / group) * p.q_heads + h * group + r % group) * dim;
    for (int64_t d = 0; d < padded; ++d) query[r * padded + d] = d < dim ? static_cast<float>(q[d]) * p.scale : 0.0f;
    std::fill(acc + r * padded, acc + (r + 1) * padded, 0.0f);
    run_max[r] = -INFINITY;
    run_sum[r] = 0.0f;
  }
  const CacheT* k_cache = static_cast<const CacheT*>(p.k_cache);
  const CacheT* v_cache = static_cast<const CacheT*>(p.v_cache);
  const int64_t* table = p.block_tables + b * p.table_stride;
  const int64_t num_blocks = (len + bs - 1) / bs, stride_bytes = row_stride * sizeof(CacheT);
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t n = std::min(bs, len - j * bs), start = table[j] * p.block_stride + h * dim;
    if (j + 1 < num_blocks) {  // stream: the next block's rows of this head, while this one computes
      const int64_t next = table[j + 1] * p.block_stride + h * dim, next_rows = std::min(bs, len - (j + 1) * bs);
      prefetch_rows(k_cache + next, next_rows, stride_bytes, dim * sizeof(CacheT));
      prefetch_rows(v_cache + next, next_rows, stride_bytes, dim * sizeof(CacheT));
    }
    const Rows k = block_rows(k_cache + start, n, row_stride, dim, padded, work + lay.k_rows());
    const Rows v = block_rows(v_cache + start, n, row_stride, dim, padded, work + lay.v_rows());
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t m = std::min(n, len - (nq - 1 - i) - j * bs);  // tokens of this block query token i sees
      if (m <= 0) continue;
      for (int64_t r = i * group; r < (i + 1) * group; ++r)
        attend_rows(query + r * padded, acc + r * padded, scores + r * lay.score_stride, run_max[r], run_sum[r], k, v,
                    m, padded);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    IoT* out = static_cast<IoT*>(p.out) + ((first + r / group) * p.q_heads + h * group + r % group) * dim;
    const float inv = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;  // len 0 (a padding row): zeros
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<IoT>(acc[r * padded + d] * inv);
  }
}

// Every (sequence, KV head) pair, spread over torch's OpenMP threads.
template <typename CacheT, typename IoT>
void run_typed(const Problem& p) {
  const Layout lay(p);
  const int64_t tasks = p.batch * p.kv_heads;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(p.threads, tasks)));
#pragma omp parallel num_threads(threads)
  {
    float* work = static_cast<float*>(std::aligned_alloc(64, round_up(lay.floats() * sizeof(float), 64)));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task)
      attend_group<CacheT, IoT>(p, lay, task / p.kv_heads, task % p.kv_heads, work);
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
