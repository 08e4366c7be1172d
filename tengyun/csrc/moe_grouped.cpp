// Quantised MoE experts as one call per stack: the rows sorted by expert (tengyun/layers/moe/routing.py)
// and the experts' cumulative row ends go in, the loop over the experts runs here. Reading the ends in a
// CPU kernel is not a device-to-host read, so the Python step never asks for the per-expert counts.
//
//   moe_quant_linear:     x [R, K] through expert e's quant_gemv.cpp layout (stacked [E, ...]) for rows
//                         ends[e - 1] .. ends[e] - 1; the same arithmetic as quant_layout.linear per expert:
//                         the kernel for up to kernel_rows bfloat16 rows, else the expert dequantized once
//                         ([K, N], bfloat16 for bfloat16 rows, float32 otherwise) and one dense matmul.
//   moe_w8a8_packed_gemm: the same over int8_gemv.cpp's packed W8A8 (dynamic per token, or msModelSlim's
//                         static scale and offset per expert).
// Rows past ends[E - 1] (other ranks' experts) come out 0. ends: int64 [E], non-decreasing, <= R.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

namespace tengyun {

// quant_gemv.cpp and int8_gemv.cpp
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t group,
                        const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                        const c10::optional<at::Tensor>& offsets, double zero, int64_t out_features,
                        const c10::optional<at::Tensor>& bias);
at::Tensor quant_dequantize_t(const at::Tensor& packed, int64_t bits, int64_t group, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& offsets,
                              double zero, int64_t out_features, const std::string& dtype);
at::Tensor w8a8_packed_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scale,
                            const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& quant_bias,
                            const c10::optional<at::Tensor>& input_scale_reciprocal,
                            const c10::optional<at::Tensor>& input_offset, int64_t n);

namespace {

bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

c10::optional<at::Tensor> expert_of(const c10::optional<at::Tensor>& stacked, int64_t e) {
  return given(stacked) ? c10::optional<at::Tensor>(stacked->select(0, e)) : c10::nullopt;
}

// ends as int64 on the CPU, checked against the rows and the experts.
at::Tensor checked_ends(const at::Tensor& x, const at::Tensor& ends, int64_t experts, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, op, ": x must be a CPU [R, K]");
  TORCH_CHECK(ends.device().is_cpu() && ends.dim() == 1 && ends.size(0) == experts, op, ": ends must be [E] with E = ",
              experts, " (the stacked experts)");
  at::Tensor e = ends.to(at::kLong).contiguous();
  const int64_t* p = e.data_ptr<int64_t>();
  int64_t previous = 0;
  for (int64_t i = 0; i < experts; ++i) {
    TORCH_CHECK(p[i] >= previous && p[i] <= x.size(0), op, ": ends must be non-decreasing and at most R = ", x.size(0));
    previous = p[i];
  }
  return e;
}

// y [R, N]: each expert's rows through ``run``, rows past the last end zero.
template <typename Run>
at::Tensor each_expert(const at::Tensor& x, const at::Tensor& ends, int64_t n, Run run) {
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const int64_t* end = ends.data_ptr<int64_t>();
  int64_t start = 0;
  for (int64_t e = 0; e < ends.size(0); ++e) {
    if (end[e] > start) {
      y.narrow(0, start, end[e] - start).copy_(run(e, x.narrow(0, start, end[e] - start)));
    }
    start = end[e];
  }
  y.narrow(0, start, x.size(0) - start).zero_();
  return y;
}

}  // namespace

at::Tensor moe_quant_linear(const at::Tensor& x, const at::Tensor& ends, const at::Tensor& packed, int64_t bits,
                            int64_t group, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                            const c10::optional<at::Tensor>& offsets, double zero, int64_t out_features,
                            int64_t kernel_rows) {
  TORCH_CHECK(packed.dim() == 4 && scales.dim() == 4 && scales.size(0) == packed.size(0),
              "moe_quant_linear: packed and scales must be the experts' layouts stacked, [E, ...]");
  const at::Tensor e = checked_ends(x, ends, packed.size(0), "moe_quant_linear");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  return each_expert(x, e, out_features, [&](int64_t expert, const at::Tensor& rows) {
    const at::Tensor w = packed.select(0, expert), s = scales.select(0, expert);
    const auto z = expert_of(zeros, expert), o = expert_of(offsets, expert);
    if (bf16 && rows.size(0) <= kernel_rows) {
      return quant_linear(rows, w, bits, group, s, z, o, zero, out_features, c10::nullopt);
    }
    const at::Tensor w_t = quant_dequantize_t(w, bits, group, s, z, o, zero, out_features, bf16 ? "bfloat16" : "float32");
    return at::mm(rows, w_t.to(x.scalar_type()));
  });
}

at::Tensor moe_w8a8_packed_gemm(const at::Tensor& x, const at::Tensor& ends, const at::Tensor& packed,
                                const at::Tensor& weight_scale, const c10::optional<at::Tensor>& quant_bias,
                                const c10::optional<at::Tensor>& input_scale_reciprocal,
                                const c10::optional<at::Tensor>& input_offset, int64_t n) {
  TORCH_CHECK(packed.dim() == 4 && weight_scale.dim() == 2 && weight_scale.size(0) == packed.size(0),
              "moe_w8a8_packed_gemm: packed [E, ...] and weight_scale [E, N] must be the experts' stacked");
  const at::Tensor e = checked_ends(x, ends, packed.size(0), "moe_w8a8_packed_gemm");
  return each_expert(x, e, n, [&](int64_t expert, const at::Tensor& rows) {
    return w8a8_packed_gemm(rows, packed.select(0, expert), weight_scale.select(0, expert), c10::nullopt,
                            expert_of(quant_bias, expert), expert_of(input_scale_reciprocal, expert),
                            expert_of(input_offset, expert), n);
  });
}

}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("moe_quant_linear(Tensor x, Tensor ends, Tensor packed, int bits, int group, Tensor scales, Tensor? zeros, "
        "Tensor? offsets, float zero, int out_features, int kernel_rows) -> Tensor");
  m.def("moe_w8a8_packed_gemm(Tensor x, Tensor ends, Tensor packed, Tensor weight_scale, Tensor? quant_bias, "
        "Tensor? input_scale_reciprocal, Tensor? input_offset, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tengyun, CPU, m) {
  m.impl("moe_quant_linear", &tengyun::moe_quant_linear);
  m.impl("moe_w8a8_packed_gemm", &tengyun::moe_w8a8_packed_gemm);
}
