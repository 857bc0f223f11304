// rms_norm: y = x / rms(x) * weight over the last dim. Contract, reference and backends
// (reference, aten, kernelgate_cpu, kernelgate_cuda); the op mechanism (kernelgate/op.h) makes
// the rest.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "kernelgate/kernelgate.h"
#include "kernels/rms_norm.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using Pair = std::tuple<Tensor, Tensor>;

Tensor rstd_shape_like(const Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

// ---- reference: ATen ops in float32 (float64 for float64 inputs: that is the oracle). Its
// autograd through ATen, as the op _rms_norm_reference, is the gradient contract.

std::tuple<Tensor, Tensor> reference_math(const Tensor& x, const OptTensor& w, double eps) {
  const auto acc = at::promote_types(x.scalar_type(), at::kFloat);
  Tensor xf = x.to(acc);
  Tensor rstd = at::rsqrt(xf.square().mean(-1, /*keepdim=*/true) + eps);
  Tensor y = xf * rstd;
  if (w) y = y * w->to(acc);
  return {y.to(x.scalar_type()), rstd.squeeze(-1)};
}

Tensor rms_norm_reference_op(const Tensor& x, const OptTensor& w, double eps) {
  return std::get<0>(reference_math(x, w, eps));
}

// Forwards return (y, rstd); rstd (float32, x.shape[:-1]) only when gradients are needed.
// Backwards return (dx, dweight); dweight only when asked for.
Pair reference_fwd(const Tensor& x, const OptTensor& w, double eps, GradRequest need) {
  auto [y, rstd] = reference_math(x, w, eps);
  return {y, need.any() ? rstd.to(at::kFloat) : Tensor()};
}

Pair reference_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w, const Tensor& rstd,
                   double, GradRequest need) {
  const bool weight_grad = need(1);
  Tensor xf = x.to(at::kFloat), dyf = dy.to(at::kFloat);
  Tensor r = rstd.unsqueeze(-1);
  Tensor xhat = xf * r;
  Tensor g = w ? dyf * w->to(at::kFloat) : dyf;
  Tensor dx = r * (g - xhat * (g * xhat).mean(-1, /*keepdim=*/true));
  Tensor dw = Tensor();
  if (weight_grad && w) {
    dw = (dyf * xhat).reshape({-1, x.size(-1)}).sum(0).to(w->scalar_type());
  }
  return {dx.to(x.scalar_type()), dw};
}

// ---- aten: PyTorch's fused rms_norm (vendor path).

Pair aten_fwd(const Tensor& x, const OptTensor& w, double eps, GradRequest need) {
  auto [y, rstd] = at::_fused_rms_norm(x, {x.size(-1)}, w, eps);
  if (!need.any()) return {y, Tensor()};
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return {y, rstd.reshape(sizes).to(at::kFloat)};
}

Pair aten_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w, const Tensor& rstd, double,
              GradRequest need) {
  auto [dx, dw] = at::_fused_rms_norm_backward(dy, x, {x.size(-1)}, rstd.unsqueeze(-1), w,
                                               {true, need(1) && w.has_value()});
  return {dx, dw};
}

Support aten_can_implement(const CallView& call) {
  if (call.grad && !call.device().is_cuda()) {
    return Support::no("ATen's fused rms_norm backward exists only for CUDA");
  }
  return Support::yes();
}

// ---- Launch preparation shared by our CPU and CUDA backends: 2-D row views, contiguous
// weight and rstd, dense outputs and the kernel problem.

int64_t grain_rows(int64_t hidden) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(hidden, 1));
}

const void* data_or_null(const Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

struct FwdLaunch {
  RowView xv;
  Tensor wc, y, rstd;
  kernels::RmsNormProblem p;
};

FwdLaunch prepare_fwd(const Tensor& x, const OptTensor& w, double eps, bool want_rstd) {
  FwdLaunch l{row_view(x),
              w ? w->contiguous() : Tensor(),
              at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous)),
              want_rstd ? rstd_shape_like(x) : Tensor(),
              {}};
  l.p.rows = l.xv.rows;
  l.p.hidden = x.size(-1);
  l.p.x_row_stride = l.xv.row_stride;
  l.p.eps = static_cast<float>(eps);
  l.p.dtype = kernel_dtype(x.scalar_type());
  return l;
}

struct BwdLaunch {
  FwdLaunch f;  // x view, weight, problem; f.y is dx
  RowView dyv;
  Tensor rc;
  bool want_dw;
};

BwdLaunch prepare_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w, const Tensor& rstd,
                      bool weight_grad) {
  BwdLaunch l{prepare_fwd(x, w, 0.0, false), row_view(dy), rstd.contiguous(),
              weight_grad && w.has_value()};
  l.f.p.dy_row_stride = l.dyv.row_stride;
  return l;
}

// ---- kernelgate_cpu: our CPU kernel, rows split over ATen's thread pool.

Pair cpu_fwd(const Tensor& x, const OptTensor& w, double eps, GradRequest need) {
  const bool want_rstd = need.any();
  FwdLaunch l = prepare_fwd(x, w, eps, want_rstd);
  at::parallel_for(0, l.p.rows, grain_rows(l.p.hidden), [&](int64_t b, int64_t e) {
    kernels::rms_norm_fwd_cpu(l.y.data_ptr(), want_rstd ? l.rstd.data_ptr<float>() : nullptr,
                              l.xv.data.const_data_ptr(), data_or_null(l.wc), l.p, b, e);
  });
  return {l.y, l.rstd};
}

Pair cpu_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w, const Tensor& rstd, double,
             GradRequest need) {
  BwdLaunch l = prepare_bwd(dy, x, w, rstd, need(1));
  const auto& p = l.f.p;
  // One float32 partial row per pool thread; summed and cast once at the end.
  Tensor partial = l.want_dw
                       ? at::zeros({at::get_num_threads(), p.hidden}, x.options().dtype(at::kFloat))
                       : Tensor();
  at::parallel_for(0, p.rows, grain_rows(p.hidden), [&](int64_t b, int64_t e) {
    float* part = l.want_dw ? partial[at::get_thread_num()].data_ptr<float>() : nullptr;
    kernels::rms_norm_bwd_cpu(l.f.y.data_ptr(), part, l.dyv.data.const_data_ptr(),
                              l.f.xv.data.const_data_ptr(), data_or_null(l.f.wc),
                              l.rc.const_data_ptr<float>(), p, b, e);
  });
  Tensor dw = l.want_dw ? partial.sum(0).to(w->scalar_type()) : Tensor();
  return {l.f.y, dw};
}

Support cpu_can_implement(const CallView& call) { return on_cpu(call, "x is not on the CPU"); }

// ---- kernelgate_cuda: our CUDA kernels.

#ifdef KERNELGATE_WITH_CUDA
Pair cuda_fwd(const Tensor& x, const OptTensor& w, double eps, GradRequest need) {
  const bool want_rstd = need.any();
  CudaContext ctx(x);
  FwdLaunch l = prepare_fwd(x, w, eps, want_rstd);
  check_cuda(
      kernels::rms_norm_fwd_cuda(l.y.data_ptr(), want_rstd ? l.rstd.data_ptr<float>() : nullptr,
                                 l.xv.data.const_data_ptr(), data_or_null(l.wc), l.p, ctx.stream),
      "rms_norm forward");
  return {l.y, l.rstd};
}

Pair cuda_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w, const Tensor& rstd, double,
              GradRequest need) {
  CudaContext ctx(x);
  BwdLaunch l = prepare_bwd(dy, x, w, rstd, need(1));
  Tensor dw = l.want_dw ? at::empty_like(l.f.wc) : Tensor();
  // Partial dweight sums, one row per block of the persistent grid (only when dweight is wanted).
  const int64_t ws_floats =
      l.want_dw ? kernels::rms_norm_bwd_cuda_workspace_floats(l.f.p, ctx.sm_count) : 0;
  Tensor ws = at::empty({std::max<int64_t>(1, ws_floats)}, x.options().dtype(at::kFloat));
  check_cuda(kernels::rms_norm_bwd_cuda(l.f.y.data_ptr(), l.want_dw ? dw.data_ptr() : nullptr,
                                        l.dyv.data.const_data_ptr(), l.f.xv.data.const_data_ptr(),
                                        data_or_null(l.f.wc), l.rc.const_data_ptr<float>(),
                                        ws.data_ptr<float>(), ctx.sm_count, l.f.p, ctx.stream),
             "rms_norm backward");
  return {l.f.y, dw};
}

Support cuda_can_implement(const CallView& call) {
  return cuda_sm80(call, "x is not on a CUDA device");
}
#endif

// ---- what the named dims cannot say, and the shapes

void check_scalars(const Tensor& x, const OptTensor&, double eps) {
  TORCH_CHECK(x.size(-1) > 0, "rms_norm: x.size(-1) (hidden) must be at least 1, got 0 (shape ",
              x.sizes(), ")");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "rms_norm: eps must be a finite number >= 0, got ",
              number(eps));
}

Pair meta(const Tensor& x, const OptTensor&, double) {
  return {at::empty_like(x, at::MemoryFormat::Contiguous), rstd_shape_like(x)};
}

OpContract contract() {
  OpContract c;
  c.name = "rms_norm";
  c.schema = "rms_norm(Tensor x, Tensor? weight=None, float eps=1e-06) -> Tensor";
  c.dims = "x: [*rows, hidden]; weight?: [hidden]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.scalar_test_values = {{"eps", {1e-6, 1e-5, 0.1}}};
  c.dim_ranges = {{"rows", {0, 65536}}, {"hidden", {1, 65536}}};
  for (int64_t rows : {16384, 8192, 4096, 65536}) {
    for (int64_t hidden : {4096, 2048, 8192})
      c.production_shapes.push_back({{"rows", rows}, {"hidden", hidden}});
  }
  c.outputs = {"y"};
  c.extras = {"rstd"};
  c.saved = {"x", "weight", "rstd"};
  return c;
}

const OpId kOp =
    OpDeclaration(contract())
        .reference(rms_norm_reference_op)
        .meta(meta)
        .check(check_scalars)
        .backend("reference", BackendKind::kReference, reference_fwd, reference_bwd)
        .backend("aten", BackendKind::kVendor, aten_fwd, aten_bwd, aten_can_implement)
        .backend("kernelgate_cpu", BackendKind::kKernelgate, cpu_fwd, cpu_bwd, cpu_can_implement)
#ifdef KERNELGATE_WITH_CUDA
        .backend("kernelgate_cuda", BackendKind::kKernelgate, cuda_fwd, cuda_bwd,
                 cuda_can_implement, cuda_available)
#else
        .unavailable("kernelgate_cuda", BackendKind::kKernelgate, kNoCudaBuild)
#endif
        .install();

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, double)>("rms_norm");
  return op.call(x, weight, eps);
}

}  // namespace kernelgate
