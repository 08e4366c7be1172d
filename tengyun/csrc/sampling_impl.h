// One row's next token from its logits, for one instruction set: the greedy argmax, or a draw from
// softmax(logits / temperature) by inverse CDF. No include guard on purpose: sampling.cpp includes
// this file once per ISA, inside its own namespace and `#pragma GCC target`, with TY_ISA set to
// 512, 256 or 0 (as paged_attention_impl.h, whose Vec it uses).

#include "paged_attention_vec.h"  // struct Vec: W float lanes of this ISA

using V = typename Vec::T;

inline V load_vec(const float* p) { return Vec::load(p); }
inline V load_vec(const c10::BFloat16* p) { return Vec::load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline V load_vec(const c10::Half* p) { return Vec::load_fp16(reinterpret_cast<const uint16_t*>(p)); }

// A token more than 87.3 nats below the row's best (probability under 1e-37 of the best's) weighs
// exactly 0, as a -inf (masked) logit does: it is never drawn.
constexpr float kFloor = -87.3f;

// Row of n logits, each divided by t as PyTorch's `logits / t` (float32 division; t 1 skips it).
template <typename E>
struct Row {
  const E* x;
  int64_t n;
  float t;
  V at(int64_t i) const {  // logits [i, i + W)
    const V v = load_vec(x + i);
    return t == 1.0f ? v : Vec::div(v, Vec::set1(t));
  }
  float one(int64_t i) const { return t == 1.0f ? static_cast<float>(x[i]) : static_cast<float>(x[i]) / t; }
  V weights(int64_t i, V best) const {  // exp(z - best) of [i, i + W), 0 below kFloor
    const V d = Vec::sub(at(i), best);
    return Vec::zero_below(Vec::exp(d), d, kFloor);
  }
  float weight(int64_t i, float best) const {
    const float d = one(i) - best;
    return d >= kFloor ? std::exp(d) : 0.0f;
  }
};

template <typename E>
float row_max(const Row<E>& r) {
  V best = Vec::set1(-INFINITY);
  int64_t i = 0;
  for (; i + Vec::W <= r.n; i += Vec::W) best = Vec::max(best, r.at(i));
  float m = Vec::hmax(best);
  for (; i < r.n; ++i) m = std::max(m, r.one(i));
  return m;
}

template <typename E>
int64_t first_index_of(const Row<E>& r, float m) {  // the argmax's tie rule: the first maximum
  int64_t i = 0;
  for (; i + Vec::W <= r.n; i += Vec::W) {
    const int lane = Vec::first_equal(r.at(i), m);
    if (lane >= 0) return i + lane;
  }
  for (; i < r.n; ++i)
    if (r.one(i) == m) return i;
  return 0;  // NaN logits: nothing equals the max
}

template <typename E>
double weight_sum(const Row<E>& r, float m) {  // float32 per W lanes, float64 across them
  const V best = Vec::set1(m);
  double total = 0.0;
  int64_t i = 0;
  for (; i + Vec::W <= r.n; i += Vec::W) total += Vec::hsum(r.weights(i, best));
  for (; i < r.n; ++i) total += r.weight(i, m);
  return total;
}

// The first token whose running weight exceeds u * (total weight), u in [0, 1): token i with
// probability weight_i / total. The running sum only grows at a token of positive weight, so a
// zero-weight token is never the answer; when rounding leaves the target at or past the end, the
// last token of positive weight is.
template <typename E>
int64_t draw(const Row<E>& r, double u) {
  const float m = row_max(r);
  const double target = u * weight_sum(r, m);
  const V best = Vec::set1(m);
  alignas(64) float w[Vec::W];
  double cum = 0.0;
  int64_t i = 0;
  for (; i + Vec::W <= r.n; i += Vec::W) {
    const V e = r.weights(i, best);
    const double chunk = Vec::hsum(e);
    if (cum + chunk <= target) {
      cum += chunk;
      continue;
    }
    Vec::store(w, e);
    for (int64_t l = 0; l < Vec::W; ++l) {
      cum += w[l];
      if (cum > target) return i + l;
    }
  }
  for (; i < r.n; ++i) {
    cum += r.weight(i, m);
    if (cum > target) return i;
  }
  for (int64_t j = r.n - 1; j > 0; --j)
    if (r.weight(j, m) > 0.0f) return j;
  return 0;
}

template <typename E>
void sample_typed(const SampleArgs& a) {
  const E* logits = static_cast<const E*>(a.logits);
  at::parallel_for(0, a.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const bool greedy = a.u == nullptr || (a.greedy != nullptr && a.greedy[b]);
      const Row<E> row{logits + b * a.row_stride, a.vocab, greedy || !a.temperature ? 1.0f : a.temperature[b]};
      a.out[b] = greedy ? first_index_of(row, row_max(row)) : draw(row, a.u[b]);
    }
  });
}

inline void sample(const SampleArgs& a) {
  switch (a.dtype) {
    case DType::f32: return sample_typed<float>(a);
    case DType::bf16: return sample_typed<c10::BFloat16>(a);
    case DType::f16: return sample_typed<c10::Half>(a);
  }
}
