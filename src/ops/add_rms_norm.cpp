// add_rms_norm: h = x + residual (in x's dtype), y = rms_norm(h) * weight; returns (y, h).
// Contract, reference and backends (reference, kernelgate_cuda).
#include <ATen/ATen.h>

#include <cmath>

#include "kernelgate/kernelgate.h"
#include "kernels/add_rms_norm.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using Triple = std::tuple<Tensor, Tensor, Tensor>;
// A backend's backward proper: (dx, dweight) from both output gradients, dy defined.
using Bwd = std::tuple<Tensor, Tensor> (*)(const Tensor& dy, const OptTensor& dh, const Tensor& h,
                                           const OptTensor& weight, const Tensor& rstd,
                                           bool weight_grad);

Tensor rstd_shape_like(const Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

Tensor in_dtype(const Tensor& t, at::ScalarType s) { return t.scalar_type() == s ? t : t.to(s); }

// ---- reference: ATen ops, statistics in float32 (float64 for float64 inputs: that is the
// oracle). Its autograd through ATen, as the op _add_rms_norm_reference, is the gradient contract.

std::tuple<Tensor, Tensor, Tensor> reference_math(const Tensor& x, const Tensor& residual,
                                                  const OptTensor& w, double eps) {
  Tensor h = x + residual;  // rounded to x's dtype, as the eager `h = x + residual` is
  const auto acc = at::promote_types(x.scalar_type(), at::kFloat);
  Tensor hf = in_dtype(h, acc);
  Tensor rstd = at::rsqrt(hf.square().mean(-1, /*keepdim=*/true) + eps);
  Tensor y = hf * rstd;
  if (w) y = y * in_dtype(*w, acc);
  return {in_dtype(y, x.scalar_type()), h, rstd.squeeze(-1)};
}

std::tuple<Tensor, Tensor> add_rms_norm_reference_op(const Tensor& x, const Tensor& residual,
                                                     const OptTensor& w, double eps) {
  auto [y, h, rstd] = reference_math(x, residual, w, eps);
  return {y, h};
}

// eager: what a user writes without kernelgate (h = x + residual; y = F.rms_norm(h, ...)).
std::tuple<Tensor, Tensor> add_rms_norm_eager(const Tensor& x, const Tensor& residual,
                                              const OptTensor& w, double eps) {
  Tensor h = x + residual;
  return {at::rms_norm(h, {h.size(-1)}, w, eps), h};
}

// Forwards return (y, h, rstd); rstd (float32, x.shape[:-1]) only when gradients are needed.
Triple reference_fwd(const Tensor& x, const Tensor& residual, const OptTensor& w, double eps,
                     GradRequest) {
  auto [y, h, rstd] = reference_math(x, residual, w, eps);
  // Dense outputs, as the Meta impl promises (x + residual follows a strided x's layout).
  return {y.contiguous(), h.contiguous(), rstd.to(at::kFloat)};
}

std::tuple<Tensor, Tensor> reference_bwd(const Tensor& dy, const OptTensor& dh, const Tensor& h,
                                         const OptTensor& w, const Tensor& rstd, bool weight_grad) {
  Tensor hf = h.to(at::kFloat), dyf = dy.to(at::kFloat);
  Tensor r = rstd.unsqueeze(-1);
  Tensor hhat = hf * r;
  Tensor g = w ? dyf * w->to(at::kFloat) : dyf;
  Tensor dx = r * (g - hhat * (g * hhat).mean(-1, /*keepdim=*/true));
  if (dh) dx = dx + dh->to(at::kFloat);
  Tensor dw = Tensor();
  if (weight_grad && w) dw = (dyf * hhat).reshape({-1, h.size(-1)}).sum(0).to(w->scalar_type());
  return {dx.to(h.scalar_type()).contiguous(), dw};
}

// ---- kernelgate_cuda: our CUDA kernels.

#ifdef KERNELGATE_WITH_CUDA
Triple cuda_fwd(const Tensor& x, const Tensor& residual, const OptTensor& w, double eps,
                GradRequest need) {
  const bool want_rstd = need.any();
  CudaContext ctx(x);
  RowView xv = row_view(x), rv = row_view(residual);
  Tensor wc = w ? w->contiguous() : Tensor();
  const auto dense = x.options().memory_format(at::MemoryFormat::Contiguous);
  Tensor y = at::empty(x.sizes(), dense), h = at::empty(x.sizes(), dense);
  Tensor rstd = want_rstd ? rstd_shape_like(x) : Tensor();
  kernels::AddRmsNormProblem p;
  p.rows = xv.rows;
  p.hidden = x.size(-1);
  p.x_row_stride = xv.row_stride;
  p.residual_row_stride = rv.row_stride;
  p.eps = static_cast<float>(eps);
  p.dtype = kernel_dtype(x.scalar_type());
  check_cuda(kernels::add_rms_norm_fwd_cuda(
                 y.data_ptr(), h.data_ptr(), want_rstd ? rstd.data_ptr<float>() : nullptr,
                 xv.data.const_data_ptr(), rv.data.const_data_ptr(),
                 wc.defined() ? wc.const_data_ptr() : nullptr, p, ctx.stream),
             "add_rms_norm forward");
  return {y, h, rstd};
}

std::tuple<Tensor, Tensor> cuda_bwd(const Tensor& dy, const OptTensor& dh, const Tensor& h,
                                    const OptTensor& w, const Tensor& rstd, bool weight_grad) {
  CudaContext ctx(h);
  RowView hv = row_view(h), dyv = row_view(dy);
  RowView dhv = dh ? row_view(*dh) : RowView{};
  Tensor wc = w ? w->contiguous() : Tensor();
  Tensor rc = rstd.contiguous();
  const bool want_dw = weight_grad && w.has_value();
  Tensor dx = at::empty(h.sizes(), h.options().memory_format(at::MemoryFormat::Contiguous));
  Tensor dw = want_dw ? at::empty_like(wc) : Tensor();
  kernels::AddRmsNormProblem p;
  p.rows = hv.rows;
  p.hidden = h.size(-1);
  p.h_row_stride = hv.row_stride;
  p.dy_row_stride = dyv.row_stride;
  p.dh_row_stride = dh ? dhv.row_stride : 0;
  p.dtype = kernel_dtype(h.scalar_type());
  // Partial dweight sums, one row per row slot of the persistent grid (when dweight is wanted).
  const int64_t ws_floats =
      want_dw ? kernels::add_rms_norm_bwd_cuda_workspace_floats(p, ctx.sm_count) : 0;
  Tensor ws = at::empty({std::max<int64_t>(1, ws_floats)}, h.options().dtype(at::kFloat));
  check_cuda(kernels::add_rms_norm_bwd_cuda(
                 dx.data_ptr(), want_dw ? dw.data_ptr() : nullptr, dyv.data.const_data_ptr(),
                 dh ? dhv.data.const_data_ptr() : nullptr, hv.data.const_data_ptr(),
                 wc.defined() ? wc.const_data_ptr() : nullptr, rc.const_data_ptr<float>(),
                 ws.data_ptr<float>(), ctx.sm_count, p, ctx.stream),
             "add_rms_norm backward");
  return {dx, dw};
}

Support cuda_can_implement(const CallView& call) {
  return cuda_sm80(call, "x is not on a CUDA device");
}
#endif

// ---- the backward every backend shares: both output gradients may be absent (optional_grads)

// (dx, dweight): dy flows through the norm, dh straight into x and residual, which share one
// gradient (shared_grads).
template <Bwd B>
std::tuple<Tensor, Tensor> backward(const OptTensor& dy, const OptTensor& dh, const Tensor& h,
                                    const OptTensor& w, const Tensor& rstd, double,
                                    GradRequest need) {
  const bool need_dw = need(2) && w.has_value();
  if (!dy) {  // only h was used downstream
    return {dh->contiguous(), need_dw ? at::zeros_like(*w) : Tensor()};
  }
  return B(*dy, dh, h, w, rstd, need_dw);
}

// What the named dims cannot say: residual has x's exact shape, hidden >= 1, a sane eps.
void check_args(const Tensor& x, const Tensor& residual, const OptTensor&, double eps) {
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: residual must have the shape of x (",
              x.sizes(), "), got ", residual.sizes());
  TORCH_CHECK(x.size(-1) > 0, "add_rms_norm: x.size(-1) (hidden) must be at least 1, got 0 (shape ",
              x.sizes(), ")");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0,
              "add_rms_norm: eps must be a finite number >= 0, got ", number(eps));
}

Triple meta(const Tensor& x, const Tensor&, const OptTensor&, double) {
  return {at::empty_like(x, at::MemoryFormat::Contiguous),
          at::empty_like(x, at::MemoryFormat::Contiguous), rstd_shape_like(x)};
}

OpContract contract() {
  OpContract c;
  c.name = "add_rms_norm";
  c.source_stem = "add_rms_norm,norm_rows";
  c.schema =
      "add_rms_norm(Tensor x, Tensor residual, Tensor? weight=None, float eps=1e-06) -> "
      "(Tensor, Tensor)";
  c.dims = "x: [*rows, hidden]; residual: [*rows, hidden]; weight?: [hidden]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.scalar_test_values = {{"eps", {1e-6, 1e-5, 0.1}}};
  c.dim_ranges = {{"rows", {0, 65536}}, {"hidden", {1, 65536}}};
  for (int64_t rows : {16384, 8192, 4096, 65536}) {
    for (int64_t hidden : {4096, 2048, 8192}) {
      c.production_shapes.push_back({{"rows", rows}, {"hidden", hidden}});
    }
  }
  c.outputs = {"y", "h"};
  c.extras = {"rstd"};
  // The backward needs h, not x and residual: x and residual have h's shape and dtype.
  c.saved = {"h", "weight", "rstd"};
  c.backward_stand_ins = {{"x", "h"}, {"residual", "h"}};
  c.shared_grads = {{"residual", "x"}};
  c.optional_grads = true;
  return c;
}

const OpId kOp =
    OpDeclaration(contract())
        .reference(add_rms_norm_reference_op)
        .eager(add_rms_norm_eager)
        .meta(meta)
        .check(check_args)
        .backend("reference", BackendKind::kReference, reference_fwd, backward<reference_bwd>)
#ifdef KERNELGATE_WITH_CUDA
        .backend("kernelgate_cuda", BackendKind::kKernelgate, cuda_fwd, backward<cuda_bwd>,
                 cuda_can_implement, cuda_available)
#else
        .unavailable("kernelgate_cuda", BackendKind::kKernelgate, kNoCudaBuild)
#endif
        .install();

}  // namespace

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const std::optional<at::Tensor>& weight,
                                                double eps) {
  static const auto op = typed_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double)>(
      "add_rms_norm");
  return op.call(x, residual, weight, eps);
}

}  // namespace kernelgate
