// add_rms_norm: h = x + residual (in x's dtype), y = rms_norm(h) * weight; returns (y, h).
// Contract, backends (reference, kernelgate_cuda), routers and the TORCH_LIBRARY impls
// (CPU/CUDA router, Meta, Autograd).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>

#include "kernelgate/dispatch.h"
#include "kernelgate/kernelgate.h"
#include "kernels/add_rms_norm.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using Fwd = std::tuple<Tensor, Tensor, Tensor> (*)(const Tensor& x, const Tensor& residual,
                                                   const OptTensor& weight, double eps,
                                                   bool want_rstd);
using Bwd = std::tuple<Tensor, Tensor> (*)(const Tensor& dy, const OptTensor& dh, const Tensor& h,
                                           const OptTensor& weight, const Tensor& rstd,
                                           bool weight_grad);
struct Impl {
  Fwd fwd = nullptr;
  Bwd bwd = nullptr;
};

OpId g_op = kNoOp;
std::array<Impl, kMaxBackends> g_impls;

Tensor rstd_shape_like(const Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

Tensor no_dweight(const Tensor& x) { return at::empty({0}, x.options()); }

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

std::tuple<Tensor, Tensor, Tensor> reference_fwd(const Tensor& x, const Tensor& residual,
                                                 const OptTensor& w, double eps, bool) {
  auto [y, h, rstd] = reference_math(x, residual, w, eps);
  // Dense outputs, as the Meta impl promises (x + residual follows a strided x's layout).
  return {y.contiguous(), h.contiguous(), rstd.to(at::kFloat)};
}

std::tuple<Tensor, Tensor> reference_bwd(const Tensor& dy, const OptTensor& dh, const Tensor& h,
                                         const OptTensor& w, const Tensor& rstd,
                                         bool weight_grad) {
  Tensor hf = h.to(at::kFloat), dyf = dy.to(at::kFloat);
  Tensor r = rstd.unsqueeze(-1);
  Tensor hhat = hf * r;
  Tensor g = w ? dyf * w->to(at::kFloat) : dyf;
  Tensor dx = r * (g - hhat * (g * hhat).mean(-1, /*keepdim=*/true));
  if (dh) dx = dx + dh->to(at::kFloat);
  Tensor dw = no_dweight(h);
  if (weight_grad && w) dw = (dyf * hhat).reshape({-1, h.size(-1)}).sum(0).to(w->scalar_type());
  return {dx.to(h.scalar_type()).contiguous(), dw};
}

// ---- kernelgate_cuda: our CUDA kernels.

#ifdef KERNELGATE_WITH_CUDA
std::tuple<Tensor, Tensor, Tensor> cuda_fwd(const Tensor& x, const Tensor& residual,
                                            const OptTensor& w, double eps, bool want_rstd) {
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
  Tensor dw = want_dw ? at::empty_like(wc) : no_dweight(h);
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
  const Tensor& x = *call.tensors[0];
  if (!x.is_cuda()) return Support::no("x is not on a CUDA device");
  if (cuda_arch(x.get_device()) < 80) return Support::no("needs compute capability 8.0 or newer");
  return Support::yes();
}
#endif

// ---- routers --------------------------------------------------------------------------------

CallView make_call(const Tensor& x, const Tensor& residual, const OptTensor& w, bool grad) {
  CallView call;
  call.num_tensors = 3;
  call.tensors[0] = &x;
  call.tensors[1] = &residual;
  call.tensors[2] = w ? &*w : nullptr;
  call.grad = grad;
  return call;
}

const OpContract& contract() { return Dispatcher::get().op(g_op).contract; }

// What the named dims cannot say: residual has x's exact shape, hidden >= 1, a sane eps.
BoundDims check_args(const Tensor& x, const Tensor& residual, const OptTensor& w, double eps,
                     bool grad) {
  BoundDims dims = check_call(contract(), make_call(x, residual, w, grad));
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: residual must have the shape of x (",
              x.sizes(), "), got ", residual.sizes());
  TORCH_CHECK(x.size(-1) > 0,
              "add_rms_norm: x.size(-1) (hidden) must be at least 1, got 0 (shape ", x.sizes(),
              ")");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0,
              "add_rms_norm: eps must be a finite number >= 0, got ", number(eps));
  return dims;
}

int route(const Tensor& x, const Tensor& residual, const OptTensor& w, double eps, bool grad) {
  BoundDims dims = check_args(x, residual, w, eps, grad);
  return Dispatcher::get().select(g_op, make_call(x, residual, w, grad), dims);
}

std::tuple<Tensor, Tensor> add_rms_norm_router(const Tensor& x, const Tensor& residual,
                                               const OptTensor& w, double eps) {
  int b = route(x, residual, w, eps, /*grad=*/false);
  auto [y, h, rstd] = g_impls[b].fwd(x, residual, w, eps, /*want_rstd=*/false);
  return {y, h};
}

std::tuple<Tensor, Tensor, Tensor> add_rms_norm_fwd_router(const Tensor& x,
                                                           const Tensor& residual,
                                                           const OptTensor& w, double eps) {
  int b = route(x, residual, w, eps, /*grad=*/true);
  return g_impls[b].fwd(x, residual, w, eps, /*want_rstd=*/true);
}

std::tuple<Tensor, Tensor> add_rms_norm_bwd_router(const Tensor& dy, const OptTensor& dh,
                                                   const Tensor& h, const OptTensor& w,
                                                   const Tensor& rstd, bool weight_grad) {
  TORCH_CHECK(dy.sizes() == h.sizes() && dy.scalar_type() == h.scalar_type(),
              "add_rms_norm backward: grad_y must have the shape and dtype of h (", h.sizes(),
              ", ", h.scalar_type(), "), got ", dy.sizes(), ", ", dy.scalar_type());
  TORCH_CHECK(!dh || (dh->sizes() == h.sizes() && dh->scalar_type() == h.scalar_type()),
              "add_rms_norm backward: grad_h must have the shape and dtype of h");
  // The forward's key: x and residual have h's shape and dtype.
  int b = route(h, h, w, 0.0, /*grad=*/true);
  return g_impls[b].bwd(dy, dh, h, w, rstd, weight_grad);
}

// ---- Meta: shapes only, same checks.

std::tuple<Tensor, Tensor> add_rms_norm_meta(const Tensor& x, const Tensor& residual,
                                             const OptTensor& w, double eps) {
  check_args(x, residual, w, eps, false);
  return {at::empty_like(x, at::MemoryFormat::Contiguous),
          at::empty_like(x, at::MemoryFormat::Contiguous)};
}

std::tuple<Tensor, Tensor, Tensor> add_rms_norm_fwd_meta(const Tensor& x, const Tensor& residual,
                                                         const OptTensor& w, double eps) {
  auto [y, h] = add_rms_norm_meta(x, residual, w, eps);
  return {y, h, rstd_shape_like(x)};
}

std::tuple<Tensor, Tensor> add_rms_norm_bwd_meta(const Tensor& dy, const OptTensor& dh,
                                                 const Tensor& h, const OptTensor& w,
                                                 const Tensor& rstd, bool weight_grad) {
  Tensor dw = weight_grad && w ? at::empty_like(*w, at::MemoryFormat::Contiguous) : no_dweight(h);
  return {at::empty_like(h, at::MemoryFormat::Contiguous), dw};
}

// ---- Autograd: the forward and backward both go through the routers above.

auto& fwd_handle() {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("kernelgate::_add_rms_norm_fwd", "")
                      .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                                const OptTensor&, double)>();
  return h;
}

auto& bwd_handle() {
  static auto h =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kernelgate::_add_rms_norm_bwd", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&,
                                            const OptTensor&, const Tensor&, bool)>();
  return h;
}

auto& op_handle() {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("kernelgate::add_rms_norm", "")
                      .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                        const OptTensor&, double)>();
  return h;
}

class AddRmsNormFunction : public torch::autograd::Function<AddRmsNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const Tensor& x, const Tensor& residual,
                                                const OptTensor& w, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, h, rstd] = fwd_handle().call(x, residual, w, eps);
    ctx->save_for_backward({h, w.value_or(Tensor()), rstd});
    ctx->saved_data["has_weight"] = w.has_value();
    return {y, h};
  }

  // Both outputs may carry cotangents: dy flows through the norm, dh straight into x and
  // residual, which share one gradient.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Tensor &dy = grads[0], &dh = grads[1];
    if (!dy.defined() && !dh.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    auto saved = ctx->get_saved_variables();
    const bool has_w = ctx->saved_data["has_weight"].toBool();
    const bool need_dw = has_w && ctx->needs_input_grad(2);
    OptTensor w = has_w ? OptTensor(saved[1]) : std::nullopt;
    Tensor dx, dw;
    if (!dy.defined()) {  // only h was used downstream
      dx = dh;
      if (need_dw) dw = at::zeros_like(saved[1]);
    } else {
      std::tie(dx, dw) =
          bwd_handle().call(dy, dh.defined() ? OptTensor(dh) : std::nullopt, saved[0], w,
                            saved[2], need_dw);
    }
    return {ctx->needs_input_grad(0) ? dx : Tensor(), ctx->needs_input_grad(1) ? dx : Tensor(),
            need_dw ? dw : Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> add_rms_norm_autograd(c10::DispatchKeySet ks, const Tensor& x,
                                                 const Tensor& residual, const OptTensor& w,
                                                 double eps) {
  const bool needs_grad =
      at::GradMode::is_enabled() &&
      (x.requires_grad() || residual.requires_grad() || (w && w->requires_grad()));
  if (!needs_grad) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return op_handle().redispatch(ks & c10::after_ADInplaceOrView_keyset, x, residual, w, eps);
  }
  auto out = AddRmsNormFunction::apply(x, residual, w, eps);
  return {out[0], out[1]};
}

}  // namespace

OpContract add_rms_norm_contract() {
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
  for (int64_t rows : {16384, 4096, 65536}) {
    for (int64_t hidden : {4096, 2048, 8192}) {
      c.production_shapes.push_back({{"rows", rows}, {"hidden", hidden}});
    }
  }
  return c;
}

void define_add_rms_norm(torch::Library& m) {
  m.def(torch::schema(add_rms_norm_contract().schema.c_str()));
  m.def(
      "_add_rms_norm_reference(Tensor x, Tensor residual, Tensor? weight=None, float eps=1e-06)"
      " -> (Tensor, Tensor)");
  m.def(
      "_add_rms_norm_fwd(Tensor x, Tensor residual, Tensor? weight, float eps)"
      " -> (Tensor, Tensor, Tensor)");
  m.def(
      "_add_rms_norm_bwd(Tensor grad_y, Tensor? grad_h, Tensor h, Tensor? weight, Tensor rstd,"
      " bool weight_grad) -> (Tensor, Tensor)");
}

void register_add_rms_norm(Dispatcher& d) {
  g_op = d.add_op(add_rms_norm_contract(),
                  BackendDesc{"reference", BackendKind::kReference, nullptr, nullptr});
  g_impls[0] = {reference_fwd, reference_bwd};
  // Typed entries first: the router may pick the backend as soon as it is published.
  const size_t index = d.op(g_op).backends.size();
#ifdef KERNELGATE_WITH_CUDA
  g_impls[index] = {cuda_fwd, cuda_bwd};
  d.add_backend(g_op, {"kernelgate_cuda", BackendKind::kKernelgate, cuda_available,
                       cuda_can_implement});
#else
  g_impls[index] = {reference_fwd, reference_bwd};
  d.add_backend(g_op, {"kernelgate_cuda", BackendKind::kKernelgate,
                       [] { return Support::no("this build has no CUDA support"); },
                       [](const CallView&) { return Support::no("this build has no CUDA support"); }});
#endif
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const std::optional<at::Tensor>& weight,
                                                double eps) {
  return op_handle().call(x, residual, weight, eps);
}

TORCH_LIBRARY_IMPL(kernelgate, CPU, m) {
  m.impl("add_rms_norm", add_rms_norm_router);
  m.impl("_add_rms_norm_fwd", add_rms_norm_fwd_router);
  m.impl("_add_rms_norm_bwd", add_rms_norm_bwd_router);
}

#ifdef KERNELGATE_WITH_CUDA
TORCH_LIBRARY_IMPL(kernelgate, CUDA, m) {
  m.impl("add_rms_norm", add_rms_norm_router);
  m.impl("_add_rms_norm_fwd", add_rms_norm_fwd_router);
  m.impl("_add_rms_norm_bwd", add_rms_norm_bwd_router);
}
#endif

TORCH_LIBRARY_IMPL(kernelgate, Meta, m) {
  m.impl("add_rms_norm", add_rms_norm_meta);
  m.impl("_add_rms_norm_fwd", add_rms_norm_fwd_meta);
  m.impl("_add_rms_norm_bwd", add_rms_norm_bwd_meta);
}

TORCH_LIBRARY_IMPL(kernelgate, Autograd, m) { m.impl("add_rms_norm", add_rms_norm_autograd); }

TORCH_LIBRARY_IMPL(kernelgate, CompositeImplicitAutograd, m) {
  m.impl("_add_rms_norm_reference", add_rms_norm_reference_op);
}

}  // namespace kernelgate
