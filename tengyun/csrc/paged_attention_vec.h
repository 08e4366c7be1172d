// The float vector the paged attention kernel computes with, for one instruction set. No include
// guard on purpose: paged_attention_impl.h includes it once per ISA (TY_ISA 512: 16 lanes of AVX-512,
// 256: 8 lanes of AVX2 + FMA + F16C, 0: one lane of portable C++), inside that ISA's namespace and
// `#pragma GCC target`.

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
  static inline T div(T a, T b) { return _mm512_div_ps(a, b); }
  static inline T zero_below(T v, T x, float bound) {  // v where x >= bound, else 0 (NaN x too)
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(bound), _CMP_GE_OQ), v);
  }
  static inline int first_equal(T v, float x) {  // first lane equal to x, -1 when none
    const unsigned m = _mm512_cmp_ps_mask(v, set1(x), _CMP_EQ_OQ);
    return m ? __builtin_ctz(m) : -1;
  }
  static inline float hsum(T v) { return _mm512_reduce_add_ps(v); }
  static constexpr int kMaxPiece = 8;  // chunks of W held in registers at once (of 32 zmm)
  static constexpr int kValuePiece = 4, kRowTile = 6;  // values_tile: 6 rows x 4 chunks + 4 of V in 32 zmm
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
  static inline T keep_first(T v, int64_t k, float fill) {  // lanes >= k (0 < k < W) set to fill
    return _mm512_mask_mov_ps(set1(fill), static_cast<__mmask16>((1u << k) - 1), v);
  }
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
  static inline T div(T a, T b) { return _mm256_div_ps(a, b); }
  static inline T zero_below(T v, T x, float bound) {
    return _mm256_and_ps(v, _mm256_cmp_ps(x, set1(bound), _CMP_GE_OQ));
  }
  static inline int first_equal(T v, float x) {
    const unsigned m = _mm256_movemask_ps(_mm256_cmp_ps(v, set1(x), _CMP_EQ_OQ));
    return m ? __builtin_ctz(m) : -1;
  }
  static constexpr int kMaxPiece = 4;  // chunks of W held in registers at once (of 16 ymm)
  static constexpr int kValuePiece = 4, kRowTile = 2;  // values_tile: 2 rows x 4 chunks + 4 of V in 16 ymm
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
  static inline T keep_first(T v, int64_t k, float fill) {  // lanes >= k (0 < k < W) set to fill
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(set1(fill), v, _mm256_castsi256_ps(keep));
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
  static inline T div(T a, T b) { return a / b; }
  static inline T zero_below(T v, T x, float bound) { return x >= bound ? v : 0.0f; }
  static inline int first_equal(T v, float x) { return v == x ? 0 : -1; }
  static inline float hsum(T v) { return v; }
  static constexpr int kMaxPiece = 8;
  static constexpr int kValuePiece = 4, kRowTile = 4;
  static inline T transpose_sum(const T* v) { return v[0]; }
  static inline float hmax(T v) { return v; }
  static inline T keep_first(T v, int64_t, float) { return v; }  // never called: no 0 < k < W = 1
  static inline T load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static inline T load_fp16(const uint16_t* p) { return fp16_to_float(*p); }
  static inline T exp(T x) { return std::exp(x); }
};
#endif
