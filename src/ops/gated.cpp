// swiglu and geglu: act(gate) * up. Contracts, backends (reference, kernelgate_cuda), routers,
// Meta and autograd, shared by both ops (they differ only in the activation).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>

#include "kernelgate/dispatch.h"
#include "kernelgate/kernelgate.h"
#include "kernels/gated.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using kernels::GatedActivation;

struct GatedOp {
  const char* name;
  OpId id = kNoOp;
  using Fwd = Tensor (*)(const Tensor& gate, const Tensor& up, GatedActivation act);
  using Bwd = std::tuple<Tensor, Tensor> (*)(const Tensor& dy, const Tensor& gate, const Tensor& up,
                                             GatedActivation act);
  std::array<Fwd, kMaxBackends> fwd{};
  std::array<Bwd, kMaxBackends> bwd{};
};

GatedOp g_swiglu{"swiglu"}, g_geglu{"geglu"};

GatedActivation parse_approximate(c10::string_view approximate) {
  if (approximate == "tanh") return GatedActivation::kGeluTanh;
  if (approximate == "none") return GatedActivation::kGeluErf;
  TORCH_CHECK(false, "geglu: approximate must be 'tanh' or 'none', got '", approximate, "'");
}

// ---- reference: ATen in float32 (float64 for float64 inputs: the oracle).

// t in dtype `acc`, with no aten::to call when it already is (an op below autograd must not
// hand back an input).
Tensor in_dtype(const Tensor& t, at::ScalarType acc) {
  return t.scalar_type() == acc ? t : t.to(acc);
}

Tensor act_math(const Tensor& g, GatedActivation act) {
  switch (act) {
    case GatedActivation::kSilu: return at::silu(g);
    // Written out: ATen's float32 CPU gelu(+inf, "none") gives NaN where the float64 one gives
    // +inf; the formula gives +inf at any precision.
    case GatedActivation::kGeluErf: return g * 0.5 * (1 + at::erf(g * M_SQRT1_2));
    case GatedActivation::kGeluTanh: return at::gelu(g, "tanh");
  }
  return g;
}

Tensor reference_fwd(const Tensor& gate, const Tensor& up, GatedActivation act) {
  const auto acc = at::promote_types(gate.scalar_type(), at::kFloat);
  return in_dtype(act_math(in_dtype(gate, acc), act) * in_dtype(up, acc), gate.scalar_type());
}

std::tuple<Tensor, Tensor> reference_bwd(const Tensor& dy, const Tensor& gate, const Tensor& up,
                                         GatedActivation act) {
  Tensor g = in_dtype(gate, at::kFloat), u = in_dtype(up, at::kFloat), d = in_dtype(dy, at::kFloat);
  Tensor a, da;
  if (act == GatedActivation::kSilu) {
    Tensor s = at::sigmoid(g);
    a = g * s;
    da = s * (1 + g * (1 - s));
  } else if (act == GatedActivation::kGeluErf) {
    a = act_math(g, act);
    da = 0.5 * (1 + at::erf(g * M_SQRT1_2)) + g * at::exp(-0.5 * g * g) * (0.5 * M_2_SQRTPI * M_SQRT1_2);
  } else {
    a = act_math(g, act);
    da = at::gelu_backward(at::ones_like(g), g, "tanh");
  }
  return {in_dtype(d * u * da, gate.scalar_type()), in_dtype(d * a, up.scalar_type())};
}

Tensor swiglu_reference_op(const Tensor& gate, const Tensor& up) {
  return reference_fwd(gate, up, GatedActivation::kSilu);
}

Tensor geglu_reference_op(const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  return reference_fwd(gate, up, parse_approximate(approximate));
}

// ---- kernelgate_cuda

#ifdef KERNELGATE_WITH_CUDA
Tensor cuda_fwd(const Tensor& gate, const Tensor& up, GatedActivation act) {
  CudaContext ctx(gate);
  Tensor g = gate.contiguous(), u = up.contiguous();
  Tensor out = at::empty(g.sizes(), g.options());
  check_cuda(kernels::gated_fwd_cuda(out.data_ptr(), g.const_data_ptr(), u.const_data_ptr(),
                                     g.numel(), kernel_dtype(g.scalar_type()), act, ctx.stream),
             "gated forward");
  return out;
}

std::tuple<Tensor, Tensor> cuda_bwd(const Tensor& dy, const Tensor& gate, const Tensor& up,
                                    GatedActivation act) {
  CudaContext ctx(gate);
  Tensor d = dy.contiguous(), g = gate.contiguous(), u = up.contiguous();
  Tensor dg = at::empty(g.sizes(), g.options()), du = at::empty(u.sizes(), u.options());
  check_cuda(kernels::gated_bwd_cuda(dg.data_ptr(), du.data_ptr(), d.const_data_ptr(),
                                     g.const_data_ptr(), u.const_data_ptr(), g.numel(),
                                     kernel_dtype(g.scalar_type()), act, ctx.stream),
             "gated backward");
  return {dg, du};
}

Support cuda_can_implement(const CallView& call) {
  const Tensor& g = *call.tensors[0];
  if (!g.is_cuda()) return Support::no("gate is not on a CUDA device");
  if (cuda_arch(g.get_device()) < 80) return Support::no("needs compute capability 8.0 or newer");
  return Support::yes();
}
#endif

// ---- routers, Meta, autograd

int route(GatedOp& op, const Tensor& gate, const Tensor& up, GatedActivation act, bool grad) {
  Dispatcher& d = Dispatcher::get();
  CallView call;
  call.num_tensors = 2;
  call.tensors = {&gate, &up};
  call.grad = grad;
  call.variant = act == GatedActivation::kGeluErf ? 1 : 0;  // geglu: "tanh" is the default
  BoundDims dims = check_call(d.op(op.id).contract, call);
  TORCH_CHECK(gate.sizes() == up.sizes(), op.name, ": up must have the shape of gate (",
              gate.sizes(), "), got ", up.sizes());
  return d.select(op.id, call, dims);
}

Tensor forward(GatedOp& op, const Tensor& gate, const Tensor& up, GatedActivation act, bool grad) {
  return op.fwd[route(op, gate, up, act, grad)](gate, up, act);
}

std::tuple<Tensor, Tensor> backward(GatedOp& op, const Tensor& dy, const Tensor& gate,
                                    const Tensor& up, GatedActivation act) {
  TORCH_CHECK(dy.sizes() == gate.sizes() && dy.scalar_type() == gate.scalar_type(), op.name,
              " backward: grad must have the shape and dtype of gate");
  return op.bwd[route(op, gate, up, act, /*grad=*/true)](dy, gate, up, act);
}

Tensor meta(GatedOp& op, const Tensor& gate, const Tensor& up) {
  CallView call;
  call.num_tensors = 2;
  call.tensors = {&gate, &up};
  check_call(Dispatcher::get().op(op.id).contract, call);
  TORCH_CHECK(gate.sizes() == up.sizes(), op.name, ": up must have the shape of gate (",
              gate.sizes(), "), got ", up.sizes());
  return at::empty_like(gate, at::MemoryFormat::Contiguous);
}

// Autograd: the forward is the op itself below autograd (it saves nothing a backend makes, so
// it is routed as a plain forward); the backward is the routed _<op>_bwd op (grad-mode key).
auto& swiglu_handle() {
  static auto h = c10::Dispatcher::singleton().findSchemaOrThrow("kernelgate::swiglu", "")
                      .typed<Tensor(const Tensor&, const Tensor&)>();
  return h;
}

auto& geglu_handle() {
  static auto h = c10::Dispatcher::singleton().findSchemaOrThrow("kernelgate::geglu", "")
                      .typed<Tensor(const Tensor&, const Tensor&, c10::string_view)>();
  return h;
}
class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& gate, const Tensor& up) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({gate, up});
    return swiglu_handle().call(gate, up);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    static auto h = c10::Dispatcher::singleton().findSchemaOrThrow("kernelgate::_swiglu_bwd", "")
                        .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&)>();
    auto [dg, du] = h.call(grads[0], s[0], s[1]);
    return {dg, du};
  }
};

class GegluFunction : public torch::autograd::Function<GegluFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& gate, const Tensor& up,
                        c10::string_view approximate) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({gate, up});
    ctx->saved_data["approximate"] = std::string(approximate);
    return geglu_handle().call(gate, up, approximate);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    static auto h =
        c10::Dispatcher::singleton().findSchemaOrThrow("kernelgate::_geglu_bwd", "")
            .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, c10::string_view)>();
    auto [dg, du] = h.call(grads[0], s[0], s[1], ctx->saved_data["approximate"].toStringRef());
    return {dg, du, Tensor()};
  }
};

bool needs_grad(const Tensor& a, const Tensor& b) {
  return at::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad());
}

Tensor swiglu_autograd(c10::DispatchKeySet ks, const Tensor& gate, const Tensor& up) {
  if (needs_grad(gate, up)) return SwigluFunction::apply(gate, up);
  at::AutoDispatchBelowADInplaceOrView guard;
  return swiglu_handle().redispatch(ks & c10::after_ADInplaceOrView_keyset, gate, up);
}

Tensor geglu_autograd(c10::DispatchKeySet ks, const Tensor& gate, const Tensor& up,
                      c10::string_view approximate) {
  if (needs_grad(gate, up)) return GegluFunction::apply(gate, up, approximate);
  at::AutoDispatchBelowADInplaceOrView guard;
  return geglu_handle().redispatch(ks & c10::after_ADInplaceOrView_keyset, gate, up, approximate);
}

OpContract gated_contract(const char* name, const char* schema) {
  OpContract c;
  c.name = name;
  c.source_stem = "gated";
  c.schema = schema;
  c.dims = "gate: [*rows, hidden]; up: [*rows, hidden]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.dim_ranges = {{"rows", {0, 65536}}, {"hidden", {1, 65536}}};
  for (int64_t rows : {16384, 4096}) {
    for (int64_t hidden : {14336, 11008, 8192}) c.production_shapes.push_back({{"rows", rows}, {"hidden", hidden}});
  }
  return c;
}

void register_gated(Dispatcher& d, GatedOp& op, OpContract contract) {
  op.id = d.add_op(std::move(contract), BackendDesc{"reference", BackendKind::kReference, nullptr, nullptr});
  op.fwd[0] = reference_fwd;
  op.bwd[0] = reference_bwd;
#ifdef KERNELGATE_WITH_CUDA
  // Typed entries first: the router may pick the backend as soon as it is published.
  const size_t index = d.op(op.id).backends.size();
  op.fwd[index] = cuda_fwd;
  op.bwd[index] = cuda_bwd;
  d.add_backend(op.id, {"kernelgate_cuda", BackendKind::kKernelgate, cuda_available, cuda_can_implement});
#else
  d.add_backend(op.id, {"kernelgate_cuda", BackendKind::kKernelgate,
                        [] { return Support::no("this build has no CUDA support"); },
                        [](const CallView&) { return Support::no("this build has no CUDA support"); }});
#endif
}

}  // namespace

OpContract swiglu_contract() {
  return gated_contract("swiglu", "swiglu(Tensor gate, Tensor up) -> Tensor");
}

OpContract geglu_contract() {
  OpContract c = gated_contract("geglu", "geglu(Tensor gate, Tensor up, str approximate=\"tanh\") -> Tensor");
  c.variant_args = {{"approximate", {"tanh", "none"}}};  // order: GatedActivation's variant below
  return c;
}

void define_gated(torch::Library& m) {
  m.def(torch::schema(swiglu_contract().schema.c_str()));
  m.def(torch::schema(geglu_contract().schema.c_str()));
  m.def("_swiglu_reference(Tensor gate, Tensor up) -> Tensor");
  m.def("_geglu_reference(Tensor gate, Tensor up, str approximate=\"tanh\") -> Tensor");
  m.def("_swiglu_bwd(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("_geglu_bwd(Tensor grad, Tensor gate, Tensor up, str approximate) -> (Tensor, Tensor)");
}

void register_gated_ops(Dispatcher& d) {
  register_gated(d, g_swiglu, swiglu_contract());
  register_gated(d, g_geglu, geglu_contract());
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  return swiglu_handle().call(gate, up);
}

at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up, c10::string_view approximate) {
  return geglu_handle().call(gate, up, approximate);
}

namespace {

Tensor swiglu_router(const Tensor& gate, const Tensor& up) {
  return forward(g_swiglu, gate, up, GatedActivation::kSilu, false);
}
Tensor geglu_router(const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  return forward(g_geglu, gate, up, parse_approximate(approximate), false);
}
std::tuple<Tensor, Tensor> swiglu_bwd_router(const Tensor& dy, const Tensor& gate, const Tensor& up) {
  return backward(g_swiglu, dy, gate, up, GatedActivation::kSilu);
}
std::tuple<Tensor, Tensor> geglu_bwd_router(const Tensor& dy, const Tensor& gate, const Tensor& up,
                                            c10::string_view approximate) {
  return backward(g_geglu, dy, gate, up, parse_approximate(approximate));
}
Tensor swiglu_meta(const Tensor& gate, const Tensor& up) { return meta(g_swiglu, gate, up); }
Tensor geglu_meta(const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  parse_approximate(approximate);
  return meta(g_geglu, gate, up);
}
std::tuple<Tensor, Tensor> swiglu_bwd_meta(const Tensor& dy, const Tensor& gate, const Tensor& up) {
  return {at::empty_like(gate, at::MemoryFormat::Contiguous), at::empty_like(up, at::MemoryFormat::Contiguous)};
}
std::tuple<Tensor, Tensor> geglu_bwd_meta(const Tensor& dy, const Tensor& gate, const Tensor& up,
                                          c10::string_view) {
  return swiglu_bwd_meta(dy, gate, up);
}

}  // namespace

TORCH_LIBRARY_IMPL(kernelgate, CPU, m) {
  m.impl("swiglu", swiglu_router);
  m.impl("geglu", geglu_router);
  m.impl("_swiglu_bwd", swiglu_bwd_router);
  m.impl("_geglu_bwd", geglu_bwd_router);
}

#ifdef KERNELGATE_WITH_CUDA
TORCH_LIBRARY_IMPL(kernelgate, CUDA, m) {
  m.impl("swiglu", swiglu_router);
  m.impl("geglu", geglu_router);
  m.impl("_swiglu_bwd", swiglu_bwd_router);
  m.impl("_geglu_bwd", geglu_bwd_router);
}
#endif

TORCH_LIBRARY_IMPL(kernelgate, Meta, m) {
  m.impl("swiglu", swiglu_meta);
  m.impl("geglu", geglu_meta);
  m.impl("_swiglu_bwd", swiglu_bwd_meta);
  m.impl("_geglu_bwd", geglu_bwd_meta);
}

TORCH_LIBRARY_IMPL(kernelgate, Autograd, m) {
  m.impl("swiglu", swiglu_autograd);
  m.impl("geglu", geglu_autograd);
}

TORCH_LIBRARY_IMPL(kernelgate, CompositeImplicitAutograd, m) {
  m.impl("_swiglu_reference", swiglu_reference_op);
  m.impl("_geglu_reference", geglu_reference_op);
}

}  // namespace kernelgate
