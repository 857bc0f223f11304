// layer_norm over the last dim: (x - mean) * rstd * weight + bias, float32 statistics.
// Contract, reference and backends (reference, aten, kernelgate_cuda).
#include <ATen/ATen.h>

#include <cmath>

#include "kernelgate/kernelgate.h"
#include "kernels/layer_norm.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
// Forward: (y, mean, rstd), the statistics float32 of x.shape[:-1] (undefined unless want_stats).
using Fwd = Tensor3 (*)(const Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps,
                        bool want_stats);
// Backward: (dx, dweight, dbias), each gradient of a parameter empty when not wanted.
using Bwd = Tensor3 (*)(const Tensor& dy, const Tensor& x, const OptTensor& weight,
                        const Tensor& mean, const Tensor& rstd, bool weight_grad, bool bias_grad);
Tensor stats_shape_like(const Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

Tensor in_dtype(const Tensor& t, at::ScalarType s) { return t.scalar_type() == s ? t : t.to(s); }

// ---- reference: ATen ops in float32 (float64 for float64 inputs: that is the oracle), the
// variance from the deviations. Its autograd through ATen, as the op _layer_norm_reference, is
// the gradient contract.

Tensor3 reference_math(const Tensor& x, const OptTensor& w, const OptTensor& b, double eps) {
  const auto acc = at::promote_types(x.scalar_type(), at::kFloat);
  Tensor xf = in_dtype(x, acc);
  Tensor mean = xf.mean(-1, /*keepdim=*/true);
  Tensor xc = xf - mean;
  Tensor rstd = at::rsqrt(xc.square().mean(-1, /*keepdim=*/true) + eps);
  Tensor y = xc * rstd;
  if (w) y = y * in_dtype(*w, acc);
  if (b) y = y + in_dtype(*b, acc);
  return {in_dtype(y, x.scalar_type()), mean.squeeze(-1), rstd.squeeze(-1)};
}

Tensor layer_norm_reference_op(const Tensor& x, const OptTensor& w, const OptTensor& b,
                               double eps) {
  return std::get<0>(reference_math(x, w, b, eps));
}

Tensor3 reference_fwd(const Tensor& x, const OptTensor& w, const OptTensor& b, double eps, bool) {
  auto [y, mean, rstd] = reference_math(x, w, b, eps);
  // Dense outputs, as the Meta impl promises (ATen follows a strided x's layout).
  return {y.contiguous(), mean.to(at::kFloat).contiguous(), rstd.to(at::kFloat).contiguous()};
}

Tensor3 reference_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w, const Tensor& mean,
                      const Tensor& rstd, bool weight_grad, bool bias_grad) {
  Tensor xf = x.to(at::kFloat), dyf = dy.to(at::kFloat);
  Tensor r = rstd.unsqueeze(-1);
  Tensor xhat = (xf - mean.unsqueeze(-1)) * r;
  Tensor g = w ? dyf * w->to(at::kFloat) : dyf;
  Tensor dx = r * (g - g.mean(-1, /*keepdim=*/true) - xhat * (g * xhat).mean(-1, /*keepdim=*/true));
  const int64_t hidden = x.size(-1);
  Tensor dw =
      weight_grad && w ? (dyf * xhat).reshape({-1, hidden}).sum(0).to(x.scalar_type()) : Tensor();
  Tensor db = bias_grad ? dyf.reshape({-1, hidden}).sum(0).to(x.scalar_type()) : Tensor();
  return {dx.to(x.scalar_type()).contiguous(), dw, db};
}

// ---- aten: PyTorch's native layer norm (vendor path; what F.layer_norm runs).

Tensor3 aten_fwd(const Tensor& x, const OptTensor& w, const OptTensor& b, double eps,
                 bool want_stats) {
  auto [y, mean, rstd] = at::native_layer_norm(x, {x.size(-1)}, w, b, eps);
  if (!want_stats) return {y.contiguous(), Tensor(), Tensor()};
  return {y.contiguous(), mean.squeeze(-1).to(at::kFloat).contiguous(),
          rstd.squeeze(-1).to(at::kFloat).contiguous()};
}

Tensor3 aten_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w, const Tensor& mean,
                 const Tensor& rstd, bool weight_grad, bool bias_grad) {
  // CUDA's native layer norm keeps float32 statistics for every input dtype, as our contract.
  // Its backward allocates dbias like bias and reads nothing else of it: a stand-in will do.
  OptTensor b = bias_grad ? OptTensor(at::empty({x.size(-1)}, x.options())) : std::nullopt;
  auto [dx, dw, db] =
      at::native_layer_norm_backward(dy, x, {x.size(-1)}, mean.unsqueeze(-1), rstd.unsqueeze(-1), w,
                                     b, {true, weight_grad, bias_grad});
  return {dx.contiguous(), dw, db};
}

Support aten_can_implement(const CallView& call) {
  if (call.grad && !call.device().is_cuda()) {
    return Support::no("ATen's CPU layer norm keeps its statistics in x's dtype, not float32");
  }
  return Support::yes();
}

// ---- kernelgate_cuda: our CUDA kernels.

#ifdef KERNELGATE_WITH_CUDA
const void* data_or_null(const Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

Tensor3 cuda_fwd(const Tensor& x, const OptTensor& w, const OptTensor& b, double eps,
                 bool want_stats) {
  CudaContext ctx(x);
  RowView xv = row_view(x);
  Tensor wc = w ? w->contiguous() : Tensor(), bc = b ? b->contiguous() : Tensor();
  Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  Tensor mean = want_stats ? stats_shape_like(x) : Tensor();
  Tensor rstd = want_stats ? stats_shape_like(x) : Tensor();
  kernels::LayerNormProblem p;
  p.rows = xv.rows;
  p.hidden = x.size(-1);
  p.x_row_stride = xv.row_stride;
  p.eps = static_cast<float>(eps);
  p.dtype = kernel_dtype(x.scalar_type());
  check_cuda(kernels::layer_norm_fwd_cuda(
                 y.data_ptr(), want_stats ? mean.data_ptr<float>() : nullptr,
                 want_stats ? rstd.data_ptr<float>() : nullptr, xv.data.const_data_ptr(),
                 data_or_null(wc), data_or_null(bc), p, ctx.stream),
             "layer_norm forward");
  return {y, mean, rstd};
}

Tensor3 cuda_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w, const Tensor& mean,
                 const Tensor& rstd, bool weight_grad, bool bias_grad) {
  CudaContext ctx(x);
  RowView xv = row_view(x), dyv = row_view(dy);
  Tensor wc = w ? w->contiguous() : Tensor();
  Tensor mc = mean.contiguous(), rc = rstd.contiguous();
  const bool want_dw = weight_grad && w.has_value();
  const auto dense = x.options().memory_format(at::MemoryFormat::Contiguous);
  Tensor dx = at::empty(x.sizes(), dense);
  Tensor dw = want_dw ? at::empty({x.size(-1)}, x.options()) : Tensor();
  Tensor db = bias_grad ? at::empty({x.size(-1)}, x.options()) : Tensor();
  kernels::LayerNormProblem p;
  p.rows = xv.rows;
  p.hidden = x.size(-1);
  p.x_row_stride = xv.row_stride;
  p.dy_row_stride = dyv.row_stride;
  p.dtype = kernel_dtype(x.scalar_type());
  // Partial dweight / dbias sums, one row per row slot of the persistent grid.
  const int64_t ws_floats =
      want_dw || bias_grad ? kernels::layer_norm_bwd_cuda_workspace_floats(p, ctx.sm_count) : 0;
  Tensor ws = at::empty({std::max<int64_t>(1, ws_floats)}, x.options().dtype(at::kFloat));
  check_cuda(kernels::layer_norm_bwd_cuda(
                 dx.data_ptr(), want_dw ? dw.data_ptr() : nullptr,
                 bias_grad ? db.data_ptr() : nullptr, dyv.data.const_data_ptr(),
                 xv.data.const_data_ptr(), data_or_null(wc), mc.const_data_ptr<float>(),
                 rc.const_data_ptr<float>(), ws.data_ptr<float>(), ctx.sm_count, p, ctx.stream),
             "layer_norm backward");
  return {dx, dw, db};
}

Support cuda_can_implement(const CallView& call) {
  return cuda_sm80(call, "x is not on a CUDA device");
}
#endif

// ---- the protocol (kernelgate/op.h) over each backend's own signature

template <Fwd F>
Tensor3 forward(const Tensor& x, const OptTensor& w, const OptTensor& b, double eps,
                GradRequest need) {
  return F(x, w, b, eps, need.any());
}

// bias is saved only so that the backward is routed with the forward's key.
template <Bwd B>
Tensor3 backward(const Tensor& dy, const Tensor& x, const OptTensor& w, const OptTensor& b,
                 const Tensor& mean, const Tensor& rstd, double, GradRequest need) {
  return B(dy, x, w, mean, rstd, need(1) && w.has_value(), need(2) && b.has_value());
}

void check_args(const Tensor& x, const OptTensor&, const OptTensor&, double eps) {
  TORCH_CHECK(x.size(-1) > 0, "layer_norm: x.size(-1) (hidden) must be at least 1, got 0 (shape ",
              x.sizes(), ")");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "layer_norm: eps must be a finite number >= 0, got ",
              number(eps));
}

Tensor3 meta(const Tensor& x, const OptTensor&, const OptTensor&, double) {
  return {at::empty_like(x, at::MemoryFormat::Contiguous), stats_shape_like(x),
          stats_shape_like(x)};
}

OpContract contract() {
  OpContract c;
  c.name = "layer_norm";
  c.source_stem = "layer_norm,norm_rows";
  c.schema =
      "layer_norm(Tensor x, Tensor? weight=None, Tensor? bias=None, float eps=1e-05) -> Tensor";
  c.dims = "x: [*rows, hidden]; weight?: [hidden]; bias?: [hidden]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.scalar_test_values = {{"eps", {1e-5, 1e-6, 0.1}}};
  c.dim_ranges = {{"rows", {0, 65536}}, {"hidden", {1, 65536}}};
  for (int64_t rows : {16384, 8192, 4096, 65536}) {
    for (int64_t hidden : {4096, 1024, 8192}) {
      c.production_shapes.push_back({{"rows", rows}, {"hidden", hidden}});
    }
  }
  c.extras = {"mean", "rstd"};
  c.saved = {"x", "weight", "bias", "mean", "rstd"};
  return c;
}

const OpId kOp = OpDeclaration(contract())
                     .reference(layer_norm_reference_op)
                     .meta(meta)
                     .check(check_args)
                     .backend("reference", BackendKind::kReference, forward<reference_fwd>,
                              backward<reference_bwd>)
                     .backend("aten", BackendKind::kVendor, forward<aten_fwd>, backward<aten_bwd>,
                              aten_can_implement)
#ifdef KERNELGATE_WITH_CUDA
                     .backend("kernelgate_cuda", BackendKind::kKernelgate, forward<cuda_fwd>,
                              backward<cuda_bwd>, cuda_can_implement, cuda_available)
#else
                     .unavailable("kernelgate_cuda", BackendKind::kKernelgate, kNoCudaBuild)
#endif
                     .install();

}  // namespace

at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&,
                          const std::optional<at::Tensor>&, double)>("layer_norm");
  return op.call(x, weight, bias, eps);
}

}  // namespace kernelgate
