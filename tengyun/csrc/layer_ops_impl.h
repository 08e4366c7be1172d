// RMSNorm, residual add + RMSNorm, neox rotary and SiLU-and-mul for one instruction set. No include
// guard on purpose: layer_ops.cpp includes this file once per ISA, inside its own namespace and
// under a matching `#pragma GCC target` (cpu_isa.h). Plain loops that GCC vectorizes for that ISA.
//
// Rounding matches PyTorch's (and so HF's) arithmetic op by op: every element is widened to
// float32, each op computes in float32 and its result is rounded to the storage type where the
// PyTorch expression rounds (Store::round), so a bf16 model gets the same bits as the reference
// up to float32 summation order and exp's last bit.

// Storage types: float32 as is, bfloat16 and float16 as their 16 bits.
struct F32 {
  using S = float;
  static inline float load(S v) { return v; }
  static inline S store(float v) { return v; }
};
struct BF16 {
  using S = uint16_t;
  static inline float load(S v) {
    uint32_t wide = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof(f));
    return f;
  }
  static inline S store(float f) {  // round to nearest even (NaN stays NaN: its high bits survive)
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    const uint32_t nan = (bits & 0x7fffffffu) > 0x7f800000u;
    bits = nan ? (bits | 0x00400000u) : bits + 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<S>(bits >> 16);
  }
};
struct F16 {
  using S = uint16_t;
  static inline float load(S v) { return static_cast<float>(c10::Half(v, c10::Half::from_bits())); }
  static inline S store(float f) { return c10::Half(f).x; }
};

template <typename T>
inline float round_to(float v) { return T::load(T::store(v)); }

// exp(x) for the SiLU, vectorizable (Cephes expf: 2^n * e^r, |r| <= ln2/2, ~1 ulp; no libm call).
inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);  // not fmin/fmax: those keep GCC from vectorizing
  const float n = __builtin_rintf(x * 1.44269504f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// One row: out = x / sqrt(mean(x^2) + eps) * gamma. G is gamma's storage type; when it is the
// same 16-bit type as x the normalised row is rounded before the product (HF's Llama), when
// gamma is float32 (Qwen3.5's 1 + w) the product is taken in float32 and rounded once.
template <typename T, typename G>
inline void rms_norm_row(typename T::S* out, const typename T::S* x, const typename G::S* gamma, int64_t n,
                         float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = T::load(x[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  constexpr bool round_first = !std::is_same<G, F32>::value;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float normed = T::load(x[i]) * inv;
    if (round_first) normed = round_to<T>(normed);
    out[i] = T::store(normed * G::load(gamma[i]));
  }
}

// One row: sum = round(x + residual) written to sum_out, then out = rms_norm(sum).
template <typename T, typename G>
inline void add_rms_norm_row(typename T::S* out, typename T::S* sum_out, const typename T::S* x,
                             const typename T::S* residual, const typename G::S* gamma, int64_t n, float eps) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) sum_out[i] = T::store(T::load(x[i]) + T::load(residual[i]));
  rms_norm_row<T, G>(out, sum_out, gamma, n, eps);
}

// One head from src into dst: [x1, x2] (halves of `half` elements) -> [x1 c - x2 s, x2 c + x1 s].
// dst may be src (in place): element i and i + half are read before either is written, and no
// other iteration touches them.
template <typename T>
inline void rotate_head_to(typename T::S* dst, const typename T::S* src, const float* cos, const float* sin,
                           int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = T::load(src[i]), x2 = T::load(src[i + half]);
    const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
    dst[i] = T::store(a - b);
    dst[i + half] = T::store(c + d);
  }
}

template <typename T>
inline void rotate_head(typename T::S* x, const float* cos, const float* sin, int64_t half) {
  rotate_head_to<T>(x, x, cos, sin, half);
}

// One row: out[i] = round(round(silu(g[i])) * u[i]) with g = x[:d], u = x[d:] (F.silu(g) * u).
template <typename T>
inline void silu_and_mul_row(typename T::S* out, const typename T::S* x, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float g = T::load(x[i]);
    const float silu = round_to<T>(g / (1.0f + exp_approx(-g)));
    out[i] = T::store(silu * T::load(x[i + d]));
  }
}

// Entry points (raw pointers, element strides); rows split across torch's threads.
constexpr int64_t kRowGrain = 8;  // rows per task: small batches stay on one thread

template <typename F>
inline void for_rows(int64_t rows, int64_t row_elements, F&& body) {
  const int64_t grain = std::max<int64_t>(1, kRowGrain * 1024 / std::max<int64_t>(row_elements, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

template <typename T, typename G>
void rms_norm_rows(const NormArgs& a) {
  using S = typename T::S;
  for_rows(a.rows, a.n, [&](int64_t r) {
    const auto* gamma = static_cast<const typename G::S*>(a.gamma);
    S* out = static_cast<S*>(a.out) + r * a.n;
    if (a.residual == nullptr) {
      rms_norm_row<T, G>(out, static_cast<const S*>(a.x) + r * a.x_stride, gamma, a.n, a.eps);
    } else {
      add_rms_norm_row<T, G>(out, static_cast<S*>(a.sum_out) + r * a.n, static_cast<const S*>(a.x) + r * a.x_stride,
                             static_cast<const S*>(a.residual) + r * a.residual_stride, gamma, a.n, a.eps);
    }
  });
}

template <typename T>
void rotary_rows(const RotaryArgs& a) {
  using S = typename T::S;
  const int64_t half = a.rotary_dim / 2;
  for_rows(a.tokens, a.rotary_dim * (a.q_heads + a.k_heads), [&](int64_t t) {
    const int64_t row = a.positions == nullptr ? t : a.positions[t];
    const float* cos = a.cos + row * half;
    const float* sin = a.sin + row * half;
    for (int64_t h = 0; h < a.q_heads; ++h)
      rotate_head<T>(static_cast<S*>(a.q) + t * a.q_token_stride + h * a.q_head_stride, cos, sin, half);
    for (int64_t h = 0; h < a.k_heads; ++h)
      rotate_head<T>(static_cast<S*>(a.k) + t * a.k_token_stride + h * a.k_head_stride, cos, sin, half);
  });
}

// Per token: k rotated and v copied into their cache slots; q rotated into q_out [T, Hq, D], or
// (q_out nullptr) q and k rotated in place in qkv, k then copied to the cache.
template <typename T>
void qkv_cache_rows(const QkvCacheArgs& a) {
  using S = typename T::S;
  const int64_t d = a.head_dim, half = d / 2, kv_row = a.kv_heads * d;
  for_rows(a.tokens, d * (a.q_heads + 2 * a.kv_heads), [&](int64_t t) {
    S* row = static_cast<S*>(a.qkv) + t * a.qkv_stride;
    const float* cos = a.cos + a.positions[t] * half;
    const float* sin = a.sin + a.positions[t] * half;
    S* k = row + a.q_heads * d;
    S* k_dst = static_cast<S*>(a.k_cache) + a.slots[t] * kv_row;
    if (a.q_out != nullptr) {
      S* q_out = static_cast<S*>(a.q_out) + t * a.q_heads * d;
      for (int64_t h = 0; h < a.q_heads; ++h) rotate_head_to<T>(q_out + h * d, row + h * d, cos, sin, half);
      for (int64_t h = 0; h < a.kv_heads; ++h) rotate_head_to<T>(k_dst + h * d, k + h * d, cos, sin, half);
    } else {
      for (int64_t h = 0; h < a.q_heads + a.kv_heads; ++h) rotate_head<T>(row + h * d, cos, sin, half);
      std::memcpy(k_dst, k, kv_row * sizeof(S));
    }
    std::memcpy(static_cast<S*>(a.v_cache) + a.slots[t] * kv_row, k + kv_row, kv_row * sizeof(S));
  });
}

template <typename T>
void silu_and_mul_rows(void* out, const void* x, int64_t rows, int64_t d, int64_t x_stride) {
  using S = typename T::S;
  for_rows(rows, 2 * d, [&](int64_t r) {
    silu_and_mul_row<T>(static_cast<S*>(out) + r * d, static_cast<const S*>(x) + r * x_stride, d);
  });
}

inline void rms_norm(const NormArgs& a) {
  if (a.dtype == DType::f32) return rms_norm_rows<F32, F32>(a);
  const bool wide_gamma = a.gamma_dtype == DType::f32;
  if (a.dtype == DType::bf16) return wide_gamma ? rms_norm_rows<BF16, F32>(a) : rms_norm_rows<BF16, BF16>(a);
  return wide_gamma ? rms_norm_rows<F16, F32>(a) : rms_norm_rows<F16, F16>(a);
}

inline void rotary(const RotaryArgs& a) {
  if (a.dtype == DType::f32) return rotary_rows<F32>(a);
  return a.dtype == DType::bf16 ? rotary_rows<BF16>(a) : rotary_rows<F16>(a);
}

inline void qkv_cache(const QkvCacheArgs& a) {
  if (a.dtype == DType::f32) return qkv_cache_rows<F32>(a);
  return a.dtype == DType::bf16 ? qkv_cache_rows<BF16>(a) : qkv_cache_rows<F16>(a);
}

inline void silu_and_mul(DType dtype, void* out, const void* x, int64_t rows, int64_t d, int64_t x_stride) {
  if (dtype == DType::f32) return silu_and_mul_rows<F32>(out, x, rows, d, x_stride);
  if (dtype == DType::bf16) return silu_and_mul_rows<BF16>(out, x, rows, d, x_stride);
  return silu_and_mul_rows<F16>(out, x, rows, d, x_stride);
}

// W8A8's activations, one row (quantize_per_token's arithmetic, all float32): s = max(max|x|,
// 1e-10) / 127, q[i] = clamp(rint(x[i] / s), -128, 127) (rint: half to even, as torch.round; a
// true division, as torch's float32 x / s). Returns s.
template <typename T>
inline float quantize_row_int8(int8_t* q, const typename T::S* x, int64_t n) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(T::load(x[i]));
    amax = a > amax ? a : amax;
  }
  const float scale = (amax > 1e-10f ? amax : 1e-10f) / 127.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float v = __builtin_rintf(T::load(x[i]) / scale);
    v = v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v);
    q[i] = static_cast<int8_t>(v);
  }
  return scale;
}

// W8A8's output, one row: out[j] = round_to_T(float(acc[j]) * s_x * s_w[j]), the products in
// that order (the reference's (acc.float() * s_x) * s_w.t()).
template <typename T>
inline void rescale_row_int32(typename T::S* out, const int32_t* acc, float s_x, const float* s_w, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float scaled = static_cast<float>(acc[j]) * s_x;
    out[j] = T::store(scaled * s_w[j]);
  }
}

template <typename T>
void quantize_rows_int8(int8_t* q, float* scales, const void* x, int64_t rows, int64_t n, int64_t x_stride) {
  for_rows(rows, n, [&](int64_t r) {
    scales[r] = quantize_row_int8<T>(q + r * n, static_cast<const typename T::S*>(x) + r * x_stride, n);
  });
}

template <typename T>
void rescale_rows_int32(void* out, const int32_t* acc, const float* s_x, const float* s_w, int64_t rows, int64_t n) {
  for_rows(rows, n, [&](int64_t r) {
    rescale_row_int32<T>(static_cast<typename T::S*>(out) + r * n, acc + r * n, s_x[r], s_w, n);
  });
}

inline void quantize_per_token_int8(DType dtype, int8_t* q, float* scales, const void* x, int64_t rows, int64_t n,
                                    int64_t x_stride) {
  if (dtype == DType::f32) return quantize_rows_int8<F32>(q, scales, x, rows, n, x_stride);
  if (dtype == DType::bf16) return quantize_rows_int8<BF16>(q, scales, x, rows, n, x_stride);
  return quantize_rows_int8<F16>(q, scales, x, rows, n, x_stride);
}

inline void rescale_int32(DType dtype, void* out, const int32_t* acc, const float* s_x, const float* s_w,
                          int64_t rows, int64_t n) {
  if (dtype == DType::f32) return rescale_rows_int32<F32>(out, acc, s_x, s_w, rows, n);
  if (dtype == DType::bf16) return rescale_rows_int32<BF16>(out, acc, s_x, s_w, rows, n);
  return rescale_rows_int32<F16>(out, acc, s_x, s_w, rows, n);
}
