// rms_norm: contract, backends (reference, aten, kernelgate_cpu, kernelgate_cuda), routers and the
// TORCH_LIBRARY impls (CPU/CUDA router, Meta, Autograd).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <mutex>

#include "kernelgate/dispatch.h"
#include "kernelgate/kernelgate.h"
#include "kernels/rms_norm.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
struct Impl {
  RmsNormFwd fwd = nullptr;
  RmsNormBwd bwd = nullptr;
};

OpId g_op = kNoOp;
std::array<Impl, kMaxBackends> g_impls;

Tensor rstd_shape_like(const Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

Tensor no_dweight(const Tensor& x) { return at::empty({0}, x.options()); }

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

std::tuple<Tensor, Tensor> reference_fwd(const Tensor& x, const OptTensor& w, double eps, bool) {
  auto [y, rstd] = reference_math(x, w, eps);
  return {y, rstd.to(at::kFloat)};
}

std::tuple<Tensor, Tensor> reference_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w,
                                         const Tensor& rstd, bool weight_grad) {
  Tensor xf = x.to(at::kFloat), dyf = dy.to(at::kFloat);
  Tensor r = rstd.unsqueeze(-1);
  Tensor xhat = xf * r;
  Tensor g = w ? dyf * w->to(at::kFloat) : dyf;
  Tensor dx = r * (g - xhat * (g * xhat).mean(-1, /*keepdim=*/true));
  Tensor dw = no_dweight(x);
  if (weight_grad && w) {
    dw = (dyf * xhat).reshape({-1, x.size(-1)}).sum(0).to(w->scalar_type());
  }
  return {dx.to(x.scalar_type()), dw};
}

// ---- aten: PyTorch's fused rms_norm (vendor path).

std::tuple<Tensor, Tensor> aten_fwd(const Tensor& x, const OptTensor& w, double eps, bool) {
  auto [y, rstd] = at::_fused_rms_norm(x, {x.size(-1)}, w, eps);
  return {y, rstd.reshape(rstd_shape_like(x).sizes()).to(at::kFloat)};
}

std::tuple<Tensor, Tensor> aten_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w,
                                    const Tensor& rstd, bool weight_grad) {
  auto [dx, dw] = at::_fused_rms_norm_backward(dy, x, {x.size(-1)}, rstd.unsqueeze(-1), w,
                                               {true, weight_grad && w.has_value()});
  return {dx, dw.defined() ? dw : no_dweight(x)};
}

Support aten_can_implement(const CallView& call) {
  if (call.grad && !call.tensors[0]->is_cuda()) {
    return Support::no("ATen's fused rms_norm backward exists only for CUDA");
  }
  return Support::yes();
}

// ---- Launch preparation shared by our CPU and CUDA backends: 2-D row views, contiguous
// weight and rstd, dense outputs and the kernel problem.

int64_t grain_rows(int64_t hidden) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(hidden, 1)); }

const void* data_or_null(const Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

struct FwdLaunch {
  RowView xv;
  Tensor wc, y, rstd;
  kernels::RmsNormProblem p;
};

FwdLaunch prepare_fwd(const Tensor& x, const OptTensor& w, double eps, bool want_rstd) {
  FwdLaunch l{row_view(x), w ? w->contiguous() : Tensor(),
              at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous)),
              want_rstd ? rstd_shape_like(x) : Tensor(), {}};
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

std::tuple<Tensor, Tensor> cpu_fwd(const Tensor& x, const OptTensor& w, double eps,
                                   bool want_rstd) {
  FwdLaunch l = prepare_fwd(x, w, eps, want_rstd);
  at::parallel_for(0, l.p.rows, grain_rows(l.p.hidden), [&](int64_t b, int64_t e) {
    kernels::rms_norm_fwd_cpu(l.y.data_ptr(), want_rstd ? l.rstd.data_ptr<float>() : nullptr,
                              l.xv.data.const_data_ptr(), data_or_null(l.wc), l.p, b, e);
  });
  return {l.y, l.rstd};
}

std::tuple<Tensor, Tensor> cpu_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w,
                                   const Tensor& rstd, bool weight_grad) {
  BwdLaunch l = prepare_bwd(dy, x, w, rstd, weight_grad);
  const auto& p = l.f.p;
  // One float32 partial row per pool thread; summed and cast once at the end.
  Tensor partial = l.want_dw ? at::zeros({at::get_num_threads(), p.hidden}, x.options().dtype(at::kFloat))
                             : Tensor();
  at::parallel_for(0, p.rows, grain_rows(p.hidden), [&](int64_t b, int64_t e) {
    float* part = l.want_dw ? partial[at::get_thread_num()].data_ptr<float>() : nullptr;
    kernels::rms_norm_bwd_cpu(l.f.y.data_ptr(), part, l.dyv.data.const_data_ptr(),
                              l.f.xv.data.const_data_ptr(), data_or_null(l.f.wc),
                              l.rc.const_data_ptr<float>(), p, b, e);
  });
  Tensor dw = l.want_dw ? partial.sum(0).to(w->scalar_type()) : no_dweight(x);
  return {l.f.y, dw};
}

Support cpu_can_implement(const CallView& call) {
  if (!call.tensors[0]->is_cpu()) return Support::no("x is not on the CPU");
  return Support::yes();
}

// ---- kernelgate_cuda: our CUDA kernels.

#ifdef KERNELGATE_WITH_CUDA
std::tuple<Tensor, Tensor> cuda_fwd(const Tensor& x, const OptTensor& w, double eps,
                                    bool want_rstd) {
  CudaContext ctx(x);
  FwdLaunch l = prepare_fwd(x, w, eps, want_rstd);
  check_cuda(kernels::rms_norm_fwd_cuda(l.y.data_ptr(), want_rstd ? l.rstd.data_ptr<float>() : nullptr,
                                        l.xv.data.const_data_ptr(), data_or_null(l.wc), l.p,
                                        ctx.stream),
             "rms_norm forward");
  return {l.y, l.rstd};
}

std::tuple<Tensor, Tensor> cuda_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w,
                                    const Tensor& rstd, bool weight_grad) {
  CudaContext ctx(x);
  BwdLaunch l = prepare_bwd(dy, x, w, rstd, weight_grad);
  Tensor dw = l.want_dw ? at::empty_like(l.f.wc) : no_dweight(x);
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
  const Tensor& x = *call.tensors[0];
  if (!x.is_cuda()) return Support::no("x is not on a CUDA device");
  if (cuda_arch(x.get_device()) < 80) return Support::no("needs compute capability 8.0 or newer");
  return Support::yes();
}
#endif

// ---- routers --------------------------------------------------------------------------------

CallView make_call(const Tensor& x, const OptTensor& w, bool grad) {
  CallView call;
  call.num_tensors = 2;
  call.tensors[0] = &x;
  call.tensors[1] = w ? &*w : nullptr;
  call.grad = grad;
  return call;
}

const OpContract& contract() { return Dispatcher::get().op(g_op).contract; }

void check_scalars(const Tensor& x, double eps) {
  TORCH_CHECK(x.size(-1) > 0, "rms_norm: x.size(-1) (hidden) must be at least 1, got 0 (shape ",
              x.sizes(), ")");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "rms_norm: eps must be a finite number >= 0, got ",
              number(eps));
}

int route(const Tensor& x, const OptTensor& w, double eps, bool grad) {
  Dispatcher& d = Dispatcher::get();
  CallView call = make_call(x, w, grad);
  BoundDims dims = check_call(contract(), call);
  check_scalars(x, eps);
  return d.select(g_op, call, dims);
}

Tensor rms_norm_router(const Tensor& x, const OptTensor& w, double eps) {
  int b = route(x, w, eps, /*grad=*/false);
  return std::get<0>(g_impls[b].fwd(x, w, eps, /*want_rstd=*/false));
}

std::tuple<Tensor, Tensor> rms_norm_fwd_router(const Tensor& x, const OptTensor& w, double eps) {
  int b = route(x, w, eps, /*grad=*/true);
  return g_impls[b].fwd(x, w, eps, /*want_rstd=*/true);
}

std::tuple<Tensor, Tensor> rms_norm_bwd_router(const Tensor& dy, const Tensor& x,
                                               const OptTensor& w, const Tensor& rstd,
                                               bool weight_grad) {
  TORCH_CHECK(dy.sizes() == x.sizes(), "rms_norm backward: grad must have the shape of x (",
              x.sizes(), "), got ", dy.sizes());
  TORCH_CHECK(dy.scalar_type() == x.scalar_type(), "rms_norm backward: grad must have dtype ",
              x.scalar_type(), ", got ", dy.scalar_type());
  int b = route(x, w, 0.0, /*grad=*/true);
  return g_impls[b].bwd(dy, x, w, rstd, weight_grad);
}

// ---- Meta: shapes only, same checks.

Tensor rms_norm_meta(const Tensor& x, const OptTensor& w, double eps) {
  check_call(contract(), make_call(x, w, false));
  check_scalars(x, eps);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

std::tuple<Tensor, Tensor> rms_norm_fwd_meta(const Tensor& x, const OptTensor& w, double eps) {
  return {rms_norm_meta(x, w, eps), rstd_shape_like(x)};
}

std::tuple<Tensor, Tensor> rms_norm_bwd_meta(const Tensor& dy, const Tensor& x, const OptTensor& w,
                                             const Tensor& rstd, bool weight_grad) {
  Tensor dw = weight_grad && w ? at::empty_like(*w, at::MemoryFormat::Contiguous) : no_dweight(x);
  return {at::empty_like(x, at::MemoryFormat::Contiguous), dw};
}

// ---- Autograd: the forward and backward both go through the routers above.

auto& fwd_handle() {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("kernelgate::_rms_norm_fwd", "")
                      .typed<std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, double)>();
  return h;
}

auto& bwd_handle() {
  static auto h =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kernelgate::_rms_norm_bwd", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&,
                                            const Tensor&, bool)>();
  return h;
}

auto& op_handle() {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("kernelgate::rms_norm", "")
                      .typed<Tensor(const Tensor&, const OptTensor&, double)>();
  return h;
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const OptTensor& w,
                        double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd] = fwd_handle().call(x, w, eps);
    ctx->save_for_backward({x, w.value_or(Tensor()), rstd});
    ctx->saved_data["has_weight"] = w.has_value();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const bool has_w = ctx->saved_data["has_weight"].toBool();
    const bool need_dw = has_w && ctx->needs_input_grad(1);
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    OptTensor w = has_w ? OptTensor(saved[1]) : std::nullopt;
    auto [dx, dw] = bwd_handle().call(grads[0], saved[0], w, saved[2], need_dw);
    return {dx, need_dw ? dw : Tensor(), Tensor()};
  }
};

Tensor rms_norm_autograd(c10::DispatchKeySet ks, const Tensor& x, const OptTensor& w, double eps) {
  const bool needs_grad =
      at::GradMode::is_enabled() && (x.requires_grad() || (w && w->requires_grad()));
  if (!needs_grad) {
    // Straight to the device router: no autograd node, no second key computation.
    at::AutoDispatchBelowADInplaceOrView guard;
    return op_handle().redispatch(ks & c10::after_ADInplaceOrView_keyset, x, w, eps);
  }
  return RmsNormFunction::apply(x, w, eps);
}

}  // namespace

OpContract rms_norm_contract() {
  OpContract c;
  c.name = "rms_norm";
  c.schema = "rms_norm(Tensor x, Tensor? weight=None, float eps=1e-06) -> Tensor";
  c.dims = "x: [*rows, hidden]; weight?: [hidden]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.scalar_test_values = {{"eps", {1e-6, 1e-5, 0.1}}};
  c.dim_ranges = {{"rows", {0, 65536}}, {"hidden", {1, 65536}}};
  for (int64_t rows : {16384, 4096, 65536}) {
    for (int64_t hidden : {4096, 2048, 8192}) c.production_shapes.push_back({{"rows", rows}, {"hidden", hidden}});
  }
  return c;
}

void define_rms_norm(torch::Library& m) {
  m.def(torch::schema(rms_norm_contract().schema.c_str()));
  m.def("_rms_norm_reference(Tensor x, Tensor? weight=None, float eps=1e-06) -> Tensor");
  m.def("_rms_norm_fwd(Tensor x, Tensor? weight, float eps) -> (Tensor, Tensor)");
  m.def("_rms_norm_bwd(Tensor grad, Tensor x, Tensor? weight, Tensor rstd, bool weight_grad)"
        " -> (Tensor, Tensor)");
}

void add_rms_norm_backend(Dispatcher& d, BackendDesc desc, RmsNormFwd fwd, RmsNormBwd bwd) {
  TORCH_CHECK(fwd != nullptr && bwd != nullptr, "rms_norm backend ", desc.name,
              " needs a forward and a backward");
  // The typed entry is in place before the backend is published to the router.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  const size_t index = d.op(g_op).backends.size();
  TORCH_CHECK(index < g_impls.size(), "rms_norm has too many backends");
  g_impls[index] = {fwd, bwd};
  TORCH_INTERNAL_ASSERT(d.add_backend(g_op, std::move(desc)) == static_cast<int>(index));
}

void register_rms_norm(Dispatcher& d) {
  BackendDesc ref{"reference", BackendKind::kReference, nullptr, nullptr};
  g_op = d.add_op(rms_norm_contract(), std::move(ref));
  g_impls[0] = {reference_fwd, reference_bwd};
  auto add = [&](BackendDesc desc, Impl impl) { add_rms_norm_backend(d, std::move(desc), impl.fwd, impl.bwd); };
  add({"aten", BackendKind::kVendor, nullptr, aten_can_implement}, {aten_fwd, aten_bwd});
  add({"kernelgate_cpu", BackendKind::kKernelgate, nullptr, cpu_can_implement}, {cpu_fwd, cpu_bwd});
#ifdef KERNELGATE_WITH_CUDA
  add({"kernelgate_cuda", BackendKind::kKernelgate, cuda_available, cuda_can_implement},
      {cuda_fwd, cuda_bwd});
#else
  add({"kernelgate_cuda", BackendKind::kKernelgate,
       [] { return Support::no("this build has no CUDA support"); },
       [](const CallView&) { return Support::no("this build has no CUDA support"); }},
      {reference_fwd, reference_bwd});
#endif
}

at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  return op_handle().call(x, weight, eps);
}

TORCH_LIBRARY_IMPL(kernelgate, CPU, m) {
  m.impl("rms_norm", rms_norm_router);
  m.impl("_rms_norm_fwd", rms_norm_fwd_router);
  m.impl("_rms_norm_bwd", rms_norm_bwd_router);
}

#ifdef KERNELGATE_WITH_CUDA
TORCH_LIBRARY_IMPL(kernelgate, CUDA, m) {
  m.impl("rms_norm", rms_norm_router);
  m.impl("_rms_norm_fwd", rms_norm_fwd_router);
  m.impl("_rms_norm_bwd", rms_norm_bwd_router);
}
#endif

TORCH_LIBRARY_IMPL(kernelgate, Meta, m) {
  m.impl("rms_norm", rms_norm_meta);
  m.impl("_rms_norm_fwd", rms_norm_fwd_meta);
  m.impl("_rms_norm_bwd", rms_norm_bwd_meta);
}

TORCH_LIBRARY_IMPL(kernelgate, Autograd, m) { m.impl("rms_norm", rms_norm_autograd); }

TORCH_LIBRARY_IMPL(kernelgate, CompositeImplicitAutograd, m) {
  m.impl("_rms_norm_reference", rms_norm_reference_op);
}

}  // namespace kernelgate
