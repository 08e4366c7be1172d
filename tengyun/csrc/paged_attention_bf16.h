// The paged attention kernel's 16-bit readers and writer, for one instruction set: how a V row's
// chunks are loaded and widened (and, with AVX-512, a bfloat16 row as pairs of chunks), with
// AVX512_BF16 the scores straight from bfloat16 q and K rows, and how an output row is stored. No include guard on purpose: paged_attention_impl.h
// includes it once per ISA, inside that ISA's namespace, after struct Vec.

#if TY_ISA == 512
#define TY_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))
// s[t] = scale * (q . k_t) for t < n from bfloat16 q and K rows as they lie (k_t at k + t * k_stride),
// P chunks of 32 dims, with AVX512_BF16's vdpbf16ps: each product exact in float32, pairs summed,
// then accumulated in float32 (the float32 path's precision; only the summation order differs).
template <int P>
TY_BF16_TARGET inline V dot_bf16(const __m512bh* qv, const c10::BFloat16* row) {  // 16 lanes of partial sums
  V a = _mm512_dpbf16_ps(Vec::zero(), qv[0], (__m512bh)_mm512_loadu_si512(row));
  for (int c = 1; c < P; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
  return a;
}

template <int P>
TY_BF16_TARGET void scores_dot_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t k_stride, int64_t n,
                                    float scale, float* s) {
  __m512bh qv[P];
  for (int c = 0; c < P; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  int64_t t0 = 0;
  for (; t0 + 16 <= n; t0 += 16) {  // whole groups of 16: unrolled, so part[] stays in registers
    V part[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) part[i] = dot_bf16<P>(qv, k + (t0 + i) * k_stride);
    Vec::store(s + t0, Vec::mul(Vec::transpose_sum(part), Vec::set1(scale)));
  }
  if (t0 < n) {
    V part[16];
    const int64_t m = n - t0;
    for (int64_t i = 0; i < 16; ++i) part[i] = i < m ? dot_bf16<P>(qv, k + (t0 + i) * k_stride) : Vec::zero();
    Vec::store(s + t0, Vec::mul(Vec::transpose_sum(part), Vec::set1(scale)));
  }
}

TY_BF16_TARGET inline void block_scores_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t k_stride,
                                             int64_t n, int64_t dim, float scale, float* s) {
  switch (dim / 32) {
    case 1: return scores_dot_bf16<1>(q, k, k_stride, n, scale, s);
    case 2: return scores_dot_bf16<2>(q, k, k_stride, n, scale, s);
    case 3: return scores_dot_bf16<3>(q, k, k_stride, n, scale, s);
    default: return scores_dot_bf16<4>(q, k, k_stride, n, scale, s);
  }
}
#undef TY_BF16_TARGET
#endif

// One V row's chunk c as W floats: a float32 row where it lies (the cache, or a widened copy), or a
// bfloat16 / float16 row read in place and widened in registers.
inline V load_chunk(const float* p) { return Vec::load(p); }
inline V load_chunk(const c10::BFloat16* p) { return Vec::load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline V load_chunk(const c10::Half* p) { return Vec::load_fp16(reinterpret_cast<const uint16_t*>(p)); }

// A bfloat16 V row read as pairs of chunks (AVX-512, head dim a multiple of 32, Layout::paired): one
// 32-element load gives chunk 2i its even elements and chunk 2i + 1 its odd ones, a shift and a mask
// instead of two widening loads and two shifts. The accumulators of each 32 dims then hold
// [even 16 | odd 16]; attend_group's output puts them back in order (paired_index).
struct PairedBf16 {
  uint16_t bits;
};

template <int P, typename E>
inline void load_chunks(const E* row, V* x) {
  for (int c = 0; c < P; ++c) x[c] = load_chunk(row + c * Vec::W);
}

#if TY_ISA == 512
template <int P>
inline void load_chunks(const PairedBf16* row, V* x) {
  static_assert(P % 2 == 0, "paired bfloat16 rows come in pairs of chunks");
  for (int c = 0; c < P; c += 2) {
    const __m512i b = _mm512_loadu_si512(row + c * Vec::W);
    x[c] = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
    x[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
}
#endif

#if TY_ISA == 512
// 16 floats stored in out's dtype, rounded to nearest even as static_cast rounds (c10::BFloat16:
// NaN -> 0x7FC0).
inline void store_out(float* out, V x) { Vec::store(out, x); }
inline void store_out(c10::BFloat16* out, V x) {
  const __m512i bits = _mm512_castps_si512(x), one = _mm512_set1_epi32(1);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), one), _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}
inline void store_out(c10::Half* out, V x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// Where dim d of a paired accumulator row lies: [even 16 | odd 16] per 32 dims.
inline int64_t paired_index(int64_t d) { return (d & ~int64_t{31}) | ((d & 1) << 4) | ((d & 31) >> 1); }

// out[d] = row[d] * inv for d < dim in out's dtype (rounded to nearest even, as static_cast), the
// row's dims in order again where it holds paired accumulators.
template <typename IoT>
inline void write_row(IoT* out, const float* row, int64_t dim, bool paired, float inv) {
#if TY_ISA == 512
  const V s = Vec::set1(inv);
  if (paired) {  // [even 16 | odd 16] per 32 dims -> interleaved
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t d = 0; d < dim; d += 32) {
      const V even = Vec::mul(Vec::load(row + d), s), odd = Vec::mul(Vec::load(row + d + 16), s);
      store_out(out + d, _mm512_permutex2var_ps(even, lo, odd));
      store_out(out + d + 16, _mm512_permutex2var_ps(even, hi, odd));
    }
    return;
  }
  if (dim % Vec::W == 0) {
    for (int64_t d = 0; d < dim; d += Vec::W) store_out(out + d, Vec::mul(Vec::load(row + d), s));
    return;
  }
#endif
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<IoT>(row[paired ? paired_index(d) : d] * inv);
}
