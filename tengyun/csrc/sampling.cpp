// The sampler's last stage for CPU, fused: each row's greedy argmax, or its draw from
// softmax(logits / temperature) by inverse CDF, in one kernel that reads the logits where they lie
// (bfloat16 included) instead of PyTorch's float32 copy, divided copy, softmax, float64 cumulative
// sum and search (tengyun/layers/sampler.py's TorchSampling, the same draw up to rounding).
//
// torch.ops.tengyun.sample_rows(logits, temperature=None, u=None, greedy=None) -> tokens
//   logits [B, V] float32 / bfloat16 / float16 with unit last stride; temperature float32 [B]
//   (None: 1); u float64 [B] in [0, 1), one uniform per row (None: every row greedy); greedy
//   bool [B], rows that take the argmax (None: none when u is given). tokens int64 [B].
//   Greedy rows: the first maximum, as torch.argmax. Other rows: the first token whose running
//   exp(logit / t - max) exceeds u times the row's total, sums in float64 (sampler.py's
//   sample_from_probs); a token more than 87.3 nats below the row's best weighs exactly 0.
//
// Instruction sets as paged_attention.cpp: three copies of sampling_impl.h, the one to run picked
// at load time (active_isa).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "cpu_isa.h"
#include "half_convert.h"

namespace tengyun {

struct SampleArgs {  // one sample_rows call
  const void* logits;
  const float* temperature;  // nullptr: 1 for every row
  const double* u;  // nullptr: every row greedy
  const bool* greedy;  // nullptr: no row greedy (when u is given)
  int64_t* out;
  int64_t rows, vocab, row_stride;
  DType dtype;
};

#if TY_HAVE_X86_COPIES
#define TY_ISA 512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
namespace avx512 {
namespace {
#include "sampling_impl.h"
}  // namespace
}  // namespace avx512
#pragma GCC pop_options
#undef TY_ISA

#define TY_ISA 256
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
namespace {
#include "sampling_impl.h"
}  // namespace
}  // namespace avx2
#pragma GCC pop_options
#undef TY_ISA
#endif

#define TY_ISA 0
namespace generic {
namespace {
#include "sampling_impl.h"
}  // namespace
}  // namespace generic
#undef TY_ISA

namespace {

const void* row_input(const std::optional<at::Tensor>& t, at::ScalarType type, int64_t rows, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == type && t->dim() == 1 && t->size(0) == rows &&
                  t->is_contiguous(),
              "sample_rows: ", name, " must be a contiguous ", type, " [", rows, "] on the CPU");
  return t->data_ptr();
}

}  // namespace

at::Tensor sample_rows(const at::Tensor& logits, const std::optional<at::Tensor>& temperature,
                       const std::optional<at::Tensor>& u, const std::optional<at::Tensor>& greedy) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.size(1) > 0,
              "sample_rows: logits must be a CPU [B, V] with V > 0");
  const at::Tensor rows = logits.stride(1) == 1 ? logits : logits.contiguous();
  DType dtype;
  switch (rows.scalar_type()) {
    case at::kFloat: dtype = DType::f32; break;
    case at::kBFloat16: dtype = DType::bf16; break;
    case at::kHalf: dtype = DType::f16; break;
    default: TORCH_CHECK(false, "sample_rows: logits must be float32, bfloat16 or float16, got ", rows.scalar_type());
  }
  const int64_t batch = rows.size(0);
  at::Tensor out = at::empty({batch}, rows.options().dtype(at::kLong));
  const SampleArgs a{rows.data_ptr(),
                     static_cast<const float*>(row_input(temperature, at::kFloat, batch, "temperature")),
                     static_cast<const double*>(row_input(u, at::kDouble, batch, "u")),
                     static_cast<const bool*>(row_input(greedy, at::kBool, batch, "greedy")),
                     out.data_ptr<int64_t>(), batch, rows.size(1), rows.stride(0), dtype};
  if (batch == 0) return out;
  switch (active_isa) {
#if TY_HAVE_X86_COPIES
    case Isa::avx512: avx512::sample(a); break;
    case Isa::avx2: avx2::sample(a); break;
#endif
    default: generic::sample(a);
  }
  return out;
}

}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("sample_rows(Tensor logits, Tensor? temperature=None, Tensor? u=None, Tensor? greedy=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) { m.impl("sample_rows", &tengyun::sample_rows); }
