// Fused element-wise layer ops for CPU: RMSNorm (optionally after the residual add), neox rotary
// (in place) and SiLU-and-mul, each one pass over memory instead of PyTorch's 4-8 (float32
// round trips of a bf16 model included). Same arithmetic as tengyun/layers/layer_ops.py's
// TorchLayerOps (see layer_ops_impl.h for the rounding).
//
// torch.ops.tengyun.rms_norm(x, gamma, eps) -> out
//   x [..., H] with unit last stride (rows may be strided); gamma [H], x's dtype or float32.
// torch.ops.tengyun.add_rms_norm(x, residual, gamma, eps) -> (out, x + residual)
// torch.ops.tengyun.rotary_neox_(q, k, cos, sin) -> ()
//   q [T, Hq, R], k [T, Hkv, R] rotated in place (unit last stride, any token/head strides);
//   cos, sin [T, R / 2] float32 contiguous.
// torch.ops.tengyun.rotary_neox_at_(q, k, cos_table, sin_table, positions) -> ()
//   as rotary_neox_, token t turned by row positions[t] of the [P, R / 2] float32 tables (one
//   call per layer instead of gathering cos/sin rows first); positions [T] int64 in [0, P).
// torch.ops.tengyun.decode_qkv_to_cache(qkv, cos_table, sin_table, positions, k_cache, v_cache,
//                                       slot_mapping, q_heads, kv_heads) -> q
//   Decode tokens straight from the qkv projection: qkv [T, (Hq + 2 Hkv) D] (unit last stride)
//   -> q [T, Hq, D] contiguous and rotated; k rotated and v as is written to cache slot
//   slot_mapping[t] of k_cache / v_cache [N, block_size, Hkv, D] (contiguous, qkv's dtype).
//   Full-width neox rotary: tables [P, D / 2] float32; positions, slot_mapping [T] int64.
// torch.ops.tengyun.qkv_to_cache_(qkv, cos_table, sin_table, positions, k_cache, v_cache,
//                                 slot_mapping, q_heads, kv_heads) -> ()
//   Any step's tokens (prefill chunks too): as decode_qkv_to_cache, but q and k are turned in
//   place in qkv (whose q / k / v views attention then reads) and no q is returned: rotary_neox_at_
//   and the two index_copy_ cache writes in one pass.
// torch.ops.tengyun.silu_and_mul(x) -> out: x [..., 2d] -> silu(x[..., :d]) * x[..., d:].
// torch.ops.tengyun.quantize_per_token_int8(x) -> (x_q, s_x): W8A8's activations in one pass,
//   x [M, K] (unit last stride) -> x_q int8 [M, K], s_x float32 [M, 1], bit-equal to
//   tengyun/layers/quant_kernels.py's quantize_per_token.
// torch.ops.tengyun.rescale_int32(acc, s_x, s_w, dtype) -> out: acc int32 [M, N] contiguous,
//   s_x float32 [M, 1], s_w [N, 1] any float dtype -> (acc.float() * s_x * s_w.float().t()).to(dtype).
// Dtypes: float32, bfloat16, float16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <tuple>

#include "cpu_isa.h"

namespace tengyun {

struct NormArgs {  // one rms_norm / add_rms_norm call; element counts and strides, not bytes
  void* out;
  void* sum_out;  // add_rms_norm only: x + residual, [rows, n] contiguous
  const void* x;
  const void* residual;  // nullptr for plain rms_norm
  const void* gamma;
  int64_t rows, n, x_stride, residual_stride;
  float eps;
  DType dtype, gamma_dtype;
};

struct RotaryArgs {  // one rotary_neox_ / rotary_neox_at_ call
  void* q;
  void* k;
  const float* cos;
  const float* sin;
  const int64_t* positions;  // rotary_neox_at_: token t reads row positions[t] of cos/sin; else row t
  int64_t tokens, q_heads, k_heads, rotary_dim;
  int64_t q_token_stride, q_head_stride, k_token_stride, k_head_stride;
  DType dtype;
};

struct QkvCacheArgs {  // one decode_qkv_to_cache or qkv_to_cache_ call
  void* qkv;  // written only by qkv_to_cache_ (q_out nullptr)
  void* q_out;  // nullptr: q and k turned in place in qkv
  void* k_cache;
  void* v_cache;
  const float* cos;
  const float* sin;
  const int64_t* positions;
  const int64_t* slots;
  int64_t tokens, q_heads, kv_heads, head_dim, qkv_stride;
  DType dtype;
};

#if TY_HAVE_X86_COPIES
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
namespace avx512 {
#include "layer_ops_impl.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "layer_ops_impl.h"
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace generic {
#include "layer_ops_impl.h"
}  // namespace generic

namespace {

DType dtype_of(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: TORCH_CHECK(false, op, ": ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

// x viewed as [rows, H] with unit last stride and a uniform row stride, copying only when needed.
at::Tensor as_rows(const at::Tensor& x) {
  at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
  return rows.stride(-1) == 1 ? rows : rows.contiguous();
}

void check_norm(const at::Tensor& x, const at::Tensor& gamma, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && gamma.device().is_cpu(), op, ": tensors must be on the CPU");
  TORCH_CHECK(x.dim() >= 1 && gamma.dim() == 1 && gamma.size(0) == x.size(-1) && gamma.is_contiguous(), op,
              ": gamma must be a contiguous [H] for x [..., H]");
  TORCH_CHECK(gamma.scalar_type() == x.scalar_type() || gamma.scalar_type() == at::kFloat, op,
              ": gamma must have x's dtype or float32");
}

void run_norm(const NormArgs& a) {
  switch (active_isa) {
#if TY_HAVE_X86_COPIES
    case Isa::avx512: return avx512::rms_norm(a);
    case Isa::avx2: return avx2::rms_norm(a);
#endif
    default: return generic::rms_norm(a);
  }
}

void check_rotary_qk(const at::Tensor& q, const at::Tensor& k, const char* op) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.size(2) % 2 == 0 && q.stride(2) == 1 && k.stride(2) == 1,
              op, ": q [T, Hq, R] and k [T, Hkv, R] with an even R and unit last stride");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), op, ": q and k must have one dtype");
}

void run_rotary(const RotaryArgs& a) {
  if (a.tokens == 0) return;
  switch (active_isa) {
#if TY_HAVE_X86_COPIES
    case Isa::avx512: return avx512::rotary(a);
    case Isa::avx2: return avx2::rotary(a);
#endif
    default: return generic::rotary(a);
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& gamma, double eps) {
  check_norm(x, gamma, "rms_norm");
  at::Tensor rows = as_rows(x);
  at::Tensor out = at::empty(x.sizes(), x.options());
  NormArgs a{out.data_ptr(), nullptr, rows.data_ptr(), nullptr, gamma.data_ptr(), rows.size(0), rows.size(1),
             rows.stride(0), 0, static_cast<float>(eps), dtype_of(x, "rms_norm", "x"),
             dtype_of(gamma, "rms_norm", "gamma")};
  if (a.rows > 0) run_norm(a);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& gamma, double eps) {
  check_norm(x, gamma, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.device().is_cpu(),
              "add_rms_norm: residual must match x's shape and dtype");
  at::Tensor rows = as_rows(x), res_rows = as_rows(residual);
  at::Tensor out = at::empty(x.sizes(), x.options()), sum = at::empty(x.sizes(), x.options());
  NormArgs a{out.data_ptr(), sum.data_ptr(), rows.data_ptr(), res_rows.data_ptr(), gamma.data_ptr(),
             rows.size(0), rows.size(1), rows.stride(0), res_rows.stride(0), static_cast<float>(eps),
             dtype_of(x, "add_rms_norm", "x"), dtype_of(gamma, "add_rms_norm", "gamma")};
  if (a.rows > 0) run_norm(a);
  return {out, sum};
}

void rotary_neox_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary_qk(q, k, "rotary_neox_");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == q.size(0) * (q.size(2) / 2) && sin.numel() == cos.numel(),
              "rotary_neox_: cos and sin must be contiguous float32 [T, R / 2]");
  RotaryArgs a{q.data_ptr(), k.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), nullptr, q.size(0),
               q.size(1), k.size(1), q.size(2), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
               dtype_of(q, "rotary_neox_", "q")};
  run_rotary(a);
}

void rotary_neox_at_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& positions) {
  check_rotary_qk(q, k, "rotary_neox_at_");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == q.size(2) / 2 && sin.sizes() == cos.sizes(),
              "rotary_neox_at_: cos and sin tables must be contiguous float32 [P, R / 2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1 &&
                  positions.size(0) == q.size(0) && positions.device().is_cpu(),
              "rotary_neox_at_: positions must be a contiguous int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_neox_at_: position ", pos[t], " is outside the ",
                cos.size(0), "-row tables");
  }
  RotaryArgs a{q.data_ptr(), k.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), pos, q.size(0),
               q.size(1), k.size(1), q.size(2), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
               dtype_of(q, "rotary_neox_at_", "q")};
  run_rotary(a);
}

namespace {
void check_qkv_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& positions, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slots, int64_t q_heads, int64_t kv_heads, const char* op) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == kv_heads && k_cache.device().is_cpu(),
              op, ": k_cache and v_cache must be contiguous CPU [N, block_size, Hkv, D]");
  const int64_t d = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (q_heads + 2 * kv_heads) * d && d % 2 == 0,
              op, ": qkv must be [T, (Hq + 2 Hkv) D] with unit last stride and an even D");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(), op,
              ": qkv and the caches must have one dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.dim() == 2 && cos.size(1) == d / 2 &&
                  sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat && sin.is_contiguous(),
              op, ": cos and sin tables must be contiguous float32 [P, D / 2]");
  for (const at::Tensor* index : {&positions, &slots}) {
    TORCH_CHECK(index->scalar_type() == at::kLong && index->is_contiguous() && index->dim() == 1 &&
                    index->size(0) == qkv.size(0),
                op, ": positions and slot_mapping must be contiguous int64 [T]");
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), op, ": position ", pos[t], " is outside the ", cos.size(0),
                "-row tables");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, op, ": slot ", slot[t], " is outside the cache's ",
                num_slots);
  }
}

void run_qkv_cache(const QkvCacheArgs& a) {
  if (a.tokens == 0) return;
  switch (active_isa) {
#if TY_HAVE_X86_COPIES
    case Isa::avx512: return avx512::qkv_cache(a);
    case Isa::avx2: return avx2::qkv_cache(a);
#endif
    default: return generic::qkv_cache(a);
  }
}
}  // namespace

at::Tensor decode_qkv_to_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
                               const at::Tensor& slot_mapping, int64_t q_heads, int64_t kv_heads) {
  check_qkv_cache(qkv, cos, sin, positions, k_cache, v_cache, slot_mapping, q_heads, kv_heads,
                  "decode_qkv_to_cache");
  const int64_t d = k_cache.size(3);
  at::Tensor q = at::empty({qkv.size(0), q_heads, d}, qkv.options());
  QkvCacheArgs a{qkv.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                 cos.data_ptr<float>(), sin.data_ptr<float>(), positions.data_ptr<int64_t>(),
                 slot_mapping.data_ptr<int64_t>(), qkv.size(0), q_heads, kv_heads, d, qkv.stride(0),
                 dtype_of(qkv, "decode_qkv_to_cache", "qkv")};
  run_qkv_cache(a);
  return q;
}

void qkv_to_cache_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t q_heads,
                   int64_t kv_heads) {
  check_qkv_cache(qkv, cos, sin, positions, k_cache, v_cache, slot_mapping, q_heads, kv_heads, "qkv_to_cache_");
  QkvCacheArgs a{qkv.data_ptr(), nullptr, k_cache.data_ptr(), v_cache.data_ptr(), cos.data_ptr<float>(),
                 sin.data_ptr<float>(), positions.data_ptr<int64_t>(), slot_mapping.data_ptr<int64_t>(),
                 qkv.size(0), q_heads, kv_heads, k_cache.size(3), qkv.stride(0), dtype_of(qkv, "qkv_to_cache_", "qkv")};
  run_qkv_cache(a);
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "silu_and_mul: x must be a CPU [..., 2d]");
  at::Tensor rows = as_rows(x);
  const int64_t d = rows.size(1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d;
  at::Tensor out = at::empty(shape, x.options());
  const DType dtype = dtype_of(x, "silu_and_mul", "x");
  if (rows.size(0) == 0 || d == 0) return out;
  switch (active_isa) {
#if TY_HAVE_X86_COPIES
    case Isa::avx512: avx512::silu_and_mul(dtype, out.data_ptr(), rows.data_ptr(), rows.size(0), d, rows.stride(0)); break;
    case Isa::avx2: avx2::silu_and_mul(dtype, out.data_ptr(), rows.data_ptr(), rows.size(0), d, rows.stride(0)); break;
#endif
    default: generic::silu_and_mul(dtype, out.data_ptr(), rows.data_ptr(), rows.size(0), d, rows.stride(0));
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_per_token_int8(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "quantize_per_token_int8: x must be a CPU [M, K]");
  at::Tensor rows = as_rows(x);
  at::Tensor q = at::empty(rows.sizes(), rows.options().dtype(at::kChar));
  at::Tensor scales = at::empty({rows.size(0), 1}, rows.options().dtype(at::kFloat));
  const DType dtype = dtype_of(x, "quantize_per_token_int8", "x");
  if (rows.size(0) == 0 || rows.size(1) == 0) return {q, scales.fill_(1e-10f / 127.0f)};
  int8_t* q_ptr = q.data_ptr<int8_t>();
  float* s_ptr = scales.data_ptr<float>();
  switch (active_isa) {
#if TY_HAVE_X86_COPIES
    case Isa::avx512: avx512::quantize_per_token_int8(dtype, q_ptr, s_ptr, rows.data_ptr(), rows.size(0), rows.size(1), rows.stride(0)); break;
    case Isa::avx2: avx2::quantize_per_token_int8(dtype, q_ptr, s_ptr, rows.data_ptr(), rows.size(0), rows.size(1), rows.stride(0)); break;
#endif
    default: generic::quantize_per_token_int8(dtype, q_ptr, s_ptr, rows.data_ptr(), rows.size(0), rows.size(1), rows.stride(0));
  }
  return {q, scales};
}

at::Tensor rescale_int32(const at::Tensor& acc, const at::Tensor& s_x, const at::Tensor& s_w, at::ScalarType dtype) {
  const char* op = "rescale_int32";
  TORCH_CHECK(acc.device().is_cpu() && acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kInt, op,
              ": acc must be a contiguous CPU int32 [M, N]");
  TORCH_CHECK(s_x.scalar_type() == at::kFloat && s_x.is_contiguous() && s_x.numel() == acc.size(0), op,
              ": s_x must be a contiguous float32 [M, 1]");
  TORCH_CHECK(s_w.numel() == acc.size(1) && at::isFloatingType(s_w.scalar_type()), op, ": s_w must be a float [N, 1]");
  at::Tensor w_scale = s_w.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(acc.sizes(), acc.options().dtype(dtype));
  const DType out_dtype = dtype_of(out, op, "dtype");
  const int64_t rows = acc.size(0), n = acc.size(1);
  if (rows == 0 || n == 0) return out;
  const int32_t* a = acc.data_ptr<int32_t>();
  const float *sx = s_x.data_ptr<float>(), *sw = w_scale.data_ptr<float>();
  switch (active_isa) {
#if TY_HAVE_X86_COPIES
    case Isa::avx512: avx512::rescale_int32(out_dtype, out.data_ptr(), a, sx, sw, rows, n); break;
    case Isa::avx2: avx2::rescale_int32(out_dtype, out.data_ptr(), a, sx, sw, rows, n); break;
#endif
    default: generic::rescale_int32(out_dtype, out.data_ptr(), a, sx, sw, rows, n);
  }
  return out;
}

}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("rms_norm(Tensor x, Tensor gamma, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor gamma, float eps) -> (Tensor, Tensor)");
  m.def("rotary_neox_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("rotary_neox_at_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor positions) -> ()");
  m.def("decode_qkv_to_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int q_heads, int kv_heads) -> Tensor");
  m.def("qkv_to_cache_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, int q_heads, int kv_heads) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("quantize_per_token_int8(Tensor x) -> (Tensor, Tensor)");
  m.def("rescale_int32(Tensor acc, Tensor s_x, Tensor s_w, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) {
  m.impl("rms_norm", &tengyun::rms_norm);
  m.impl("add_rms_norm", &tengyun::add_rms_norm);
  m.impl("rotary_neox_", &tengyun::rotary_neox_);
  m.impl("rotary_neox_at_", &tengyun::rotary_neox_at_);
  m.impl("decode_qkv_to_cache", &tengyun::decode_qkv_to_cache);
  m.impl("qkv_to_cache_", &tengyun::qkv_to_cache_);
  m.impl("silu_and_mul", &tengyun::silu_and_mul);
  m.impl("quantize_per_token_int8", &tengyun::quantize_per_token_int8);
  m.impl("rescale_int32", &tengyun::rescale_int32);
}
