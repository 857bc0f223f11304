// layer_norm over the last dim: (x - mean) * rstd * weight + bias, float32 statistics.
// Contract, backends (reference, aten, kernelgate_cuda), routers and the TORCH_LIBRARY impls
// (CPU/CUDA router, Meta, Autograd).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>

#include "kernelgate/dispatch.h"
#include "kernelgate/kernelgate.h"
#include "kernels/layer_norm.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
// Forward: (y, mean, rstd), the statistics float32 of x.shape[:-1] (undefined unless want_stats).
using Fwd = Tensor3 (*)(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                        double eps, bool want_stats);
// Backward: (dx, dweight, dbias), each gradient of a parameter empty when not wanted.
using Bwd = Tensor3 (*)(const Tensor& dy, const Tensor& x, const OptTensor& weight,
                        const Tensor& mean, const Tensor& rstd, bool weight_grad, bool bias_grad);
struct Impl {
  Fwd fwd = nullptr;
  Bwd bwd = nullptr;
};

OpId g_op = kNoOp;
std::array<Impl, kMaxBackends> g_impls;

Tensor stats_shape_like(const Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

Tensor empty_grad(const Tensor& x) { return at::empty({0}, x.options()); }

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
  Tensor dx = r * (g - g.mean(-1, /*keepdim=*/true) -
                   xhat * (g * xhat).mean(-1, /*keepdim=*/true));
  const int64_t hidden = x.size(-1);
  Tensor dw = weight_grad && w ? (dyf * xhat).reshape({-1, hidden}).sum(0).to(x.scalar_type())
                               : empty_grad(x);
  Tensor db = bias_grad ? dyf.reshape({-1, hidden}).sum(0).to(x.scalar_type()) : empty_grad(x);
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
  auto [dx, dw, db] = at::native_layer_norm_backward(
      dy, x, {x.size(-1)}, mean.unsqueeze(-1), rstd.unsqueeze(-1), w, b,
      {true, weight_grad, bias_grad});
  return {dx.contiguous(), dw.defined() ? dw : empty_grad(x), db.defined() ? db : empty_grad(x)};
}

Support aten_can_implement(const CallView& call) {
  const Tensor& x = *call.tensors[0];
  if (call.grad && !x.is_cuda()) {
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
  check_cuda(kernels::layer_norm_fwd_cuda(y.data_ptr(),
                                          want_stats ? mean.data_ptr<float>() : nullptr,
                                          want_stats ? rstd.data_ptr<float>() : nullptr,
                                          xv.data.const_data_ptr(), data_or_null(wc),
                                          data_or_null(bc), p, ctx.stream),
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
  Tensor dw = want_dw ? at::empty({x.size(-1)}, x.options()) : empty_grad(x);
  Tensor db = bias_grad ? at::empty({x.size(-1)}, x.options()) : empty_grad(x);
  kernels::LayerNormProblem p;
  p.rows = xv.rows;
  p.hidden = x.size(-1);
  p.x_row_stride = xv.row_stride;
  p.dy_row_stride = dyv.row_stride;
  p.dtype = kernel_dtype(x.scalar_type());
  // Partial dweight / dbias sums, one row per row slot of the persistent grid.
  const int64_t ws_floats = want_dw || bias_grad
                                ? kernels::layer_norm_bwd_cuda_workspace_floats(p, ctx.sm_count)
                                : 0;
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
  const Tensor& x = *call.tensors[0];
  if (!x.is_cuda()) return Support::no("x is not on a CUDA device");
  if (cuda_arch(x.get_device()) < 80) return Support::no("needs compute capability 8.0 or newer");
  return Support::yes();
}
#endif

// ---- routers --------------------------------------------------------------------------------

CallView make_call(const Tensor& x, const OptTensor& w, const OptTensor& b, bool grad) {
  CallView call;
  call.num_tensors = 3;
  call.tensors[0] = &x;
  call.tensors[1] = w ? &*w : nullptr;
  call.tensors[2] = b ? &*b : nullptr;
  call.grad = grad;
  return call;
}

const OpContract& contract() { return Dispatcher::get().op(g_op).contract; }

BoundDims check_args(const Tensor& x, const OptTensor& w, const OptTensor& b, double eps,
                     bool grad) {
  BoundDims dims = check_call(contract(), make_call(x, w, b, grad));
  TORCH_CHECK(x.size(-1) > 0,
              "layer_norm: x.size(-1) (hidden) must be at least 1, got 0 (shape ", x.sizes(), ")");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "layer_norm: eps must be a finite number >= 0, got ",
              number(eps));
  return dims;
}

int route(const Tensor& x, const OptTensor& w, const OptTensor& b, double eps, bool grad) {
  BoundDims dims = check_args(x, w, b, eps, grad);
  return Dispatcher::get().select(g_op, make_call(x, w, b, grad), dims);
}

Tensor layer_norm_router(const Tensor& x, const OptTensor& w, const OptTensor& b, double eps) {
  int k = route(x, w, b, eps, /*grad=*/false);
  return std::get<0>(g_impls[k].fwd(x, w, b, eps, /*want_stats=*/false));
}

Tensor3 layer_norm_fwd_router(const Tensor& x, const OptTensor& w, const OptTensor& b,
                              double eps) {
  int k = route(x, w, b, eps, /*grad=*/true);
  return g_impls[k].fwd(x, w, b, eps, /*want_stats=*/true);
}

// bias is passed only so that the backward is routed with the forward's key.
Tensor3 layer_norm_bwd_router(const Tensor& dy, const Tensor& x, const OptTensor& w,
                              const OptTensor& b, const Tensor& mean, const Tensor& rstd,
                              bool weight_grad, bool bias_grad) {
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(),
              "layer_norm backward: grad must have the shape and dtype of x (", x.sizes(), ", ",
              x.scalar_type(), "), got ", dy.sizes(), ", ", dy.scalar_type());
  int k = route(x, w, b, 0.0, /*grad=*/true);
  return g_impls[k].bwd(dy, x, w, mean, rstd, weight_grad && w.has_value(),
                        bias_grad && b.has_value());
}

// ---- Meta: shapes only, same checks.

Tensor layer_norm_meta(const Tensor& x, const OptTensor& w, const OptTensor& b, double eps) {
  check_args(x, w, b, eps, false);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

Tensor3 layer_norm_fwd_meta(const Tensor& x, const OptTensor& w, const OptTensor& b, double eps) {
  return {layer_norm_meta(x, w, b, eps), stats_shape_like(x), stats_shape_like(x)};
}

Tensor3 layer_norm_bwd_meta(const Tensor& dy, const Tensor& x, const OptTensor& w,
                            const OptTensor& b, const Tensor& mean, const Tensor& rstd,
                            bool weight_grad, bool bias_grad) {
  const auto dense = at::MemoryFormat::Contiguous;
  Tensor dw = weight_grad && w ? at::empty_like(*w, dense) : empty_grad(x);
  Tensor db = bias_grad && b ? at::empty_like(*b, dense) : empty_grad(x);
  return {at::empty_like(x, dense), dw, db};
}

// ---- Autograd: the forward and backward both go through the routers above.

auto& fwd_handle() {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("kernelgate::_layer_norm_fwd", "")
                      .typed<Tensor3(const Tensor&, const OptTensor&, const OptTensor&, double)>();
  return h;
}

auto& bwd_handle() {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("kernelgate::_layer_norm_bwd", "")
                      .typed<Tensor3(const Tensor&, const Tensor&, const OptTensor&,
                                     const OptTensor&, const Tensor&, const Tensor&, bool, bool)>();
  return h;
}

auto& op_handle() {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("kernelgate::layer_norm", "")
                      .typed<Tensor(const Tensor&, const OptTensor&, const OptTensor&, double)>();
  return h;
}

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const OptTensor& w,
                        const OptTensor& b, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, mean, rstd] = fwd_handle().call(x, w, b, eps);
    ctx->save_for_backward({x, w.value_or(Tensor()), b.value_or(Tensor()), mean, rstd});
    ctx->saved_data["has_weight"] = w.has_value();
    ctx->saved_data["has_bias"] = b.has_value();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    auto s = ctx->get_saved_variables();
    const bool has_w = ctx->saved_data["has_weight"].toBool();
    const bool has_b = ctx->saved_data["has_bias"].toBool();
    // needs_input_grad counts edges, which only present tensors have.
    const bool need_dw = has_w && ctx->needs_input_grad(1);
    const bool need_db = has_b && ctx->needs_input_grad(has_w ? 2 : 1);
    OptTensor w = has_w ? OptTensor(s[1]) : std::nullopt;
    OptTensor b = has_b ? OptTensor(s[2]) : std::nullopt;
    auto [dx, dw, db] = bwd_handle().call(grads[0], s[0], w, b, s[3], s[4], need_dw, need_db);
    return {ctx->needs_input_grad(0) ? dx : Tensor(), need_dw ? dw : Tensor(),
            need_db ? db : Tensor(), Tensor()};
  }
};

Tensor layer_norm_autograd(c10::DispatchKeySet ks, const Tensor& x, const OptTensor& w,
                           const OptTensor& b, double eps) {
  const bool needs_grad = at::GradMode::is_enabled() &&
                          (x.requires_grad() || (w && w->requires_grad()) ||
                           (b && b->requires_grad()));
  if (!needs_grad) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return op_handle().redispatch(ks & c10::after_ADInplaceOrView_keyset, x, w, b, eps);
  }
  return LayerNormFunction::apply(x, w, b, eps);
}

}  // namespace

OpContract layer_norm_contract() {
  OpContract c;
  c.name = "layer_norm";
  c.source_stem = "layer_norm,norm_rows";
  c.schema =
      "layer_norm(Tensor x, Tensor? weight=None, Tensor? bias=None, float eps=1e-05) -> Tensor";
  c.dims = "x: [*rows, hidden]; weight?: [hidden]; bias?: [hidden]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.scalar_test_values = {{"eps", {1e-5, 1e-6, 0.1}}};
  c.dim_ranges = {{"rows", {0, 65536}}, {"hidden", {1, 65536}}};
  for (int64_t rows : {16384, 4096, 65536}) {
    for (int64_t hidden : {4096, 1024, 8192}) {
      c.production_shapes.push_back({{"rows", rows}, {"hidden", hidden}});
    }
  }
  return c;
}

void define_layer_norm(torch::Library& m) {
  m.def(torch::schema(layer_norm_contract().schema.c_str()));
  m.def(
      "_layer_norm_reference(Tensor x, Tensor? weight=None, Tensor? bias=None, float eps=1e-05)"
      " -> Tensor");
  m.def(
      "_layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps)"
      " -> (Tensor, Tensor, Tensor)");
  m.def(
      "_layer_norm_bwd(Tensor grad, Tensor x, Tensor? weight, Tensor? bias, Tensor mean,"
      " Tensor rstd, bool weight_grad, bool bias_grad) -> (Tensor, Tensor, Tensor)");
}

void register_layer_norm(Dispatcher& d) {
  g_op = d.add_op(layer_norm_contract(),
                  BackendDesc{"reference", BackendKind::kReference, nullptr, nullptr});
  g_impls[0] = {reference_fwd, reference_bwd};
  // Typed entries first: the router may pick the backend as soon as it is published.
  g_impls[d.op(g_op).backends.size()] = {aten_fwd, aten_bwd};
  d.add_backend(g_op, {"aten", BackendKind::kVendor, nullptr, aten_can_implement});
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

at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps) {
  return op_handle().call(x, weight, bias, eps);
}

TORCH_LIBRARY_IMPL(kernelgate, CPU, m) {
  m.impl("layer_norm", layer_norm_router);
  m.impl("_layer_norm_fwd", layer_norm_fwd_router);
  m.impl("_layer_norm_bwd", layer_norm_bwd_router);
}

#ifdef KERNELGATE_WITH_CUDA
TORCH_LIBRARY_IMPL(kernelgate, CUDA, m) {
  m.impl("layer_norm", layer_norm_router);
  m.impl("_layer_norm_fwd", layer_norm_fwd_router);
  m.impl("_layer_norm_bwd", layer_norm_bwd_router);
}
#endif

TORCH_LIBRARY_IMPL(kernelgate, Meta, m) {
  m.impl("layer_norm", layer_norm_meta);
  m.impl("_layer_norm_fwd", layer_norm_fwd_meta);
  m.impl("_layer_norm_bwd", layer_norm_bwd_meta);
}

TORCH_LIBRARY_IMPL(kernelgate, Autograd, m) { m.impl("layer_norm", layer_norm_autograd); }

TORCH_LIBRARY_IMPL(kernelgate, CompositeImplicitAutograd, m) {
  m.impl("_layer_norm_reference", layer_norm_reference_op);
}

}  // namespace kernelgate
