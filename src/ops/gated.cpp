// swiglu and geglu: act(gate) * up. Contracts, reference and backends (reference,
// kernelgate_cuda), shared by both ops (they differ only in the activation).
#include <ATen/ATen.h>

#include <cmath>

#include "kernelgate/kernelgate.h"
#include "kernels/gated.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using kernels::GatedActivation;

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
    da = 0.5 * (1 + at::erf(g * M_SQRT1_2)) +
         g * at::exp(-0.5 * g * g) * (0.5 * M_2_SQRTPI * M_SQRT1_2);
  } else {
    a = act_math(g, act);
    da = at::gelu_backward(at::ones_like(g), g, "tanh");
  }
  return {in_dtype(d * u * da, gate.scalar_type()), in_dtype(d * a, up.scalar_type())};
}

// ---- eager: what a user writes without kernelgate, at the input dtype

Tensor swiglu_eager(const Tensor& gate, const Tensor& up) { return at::silu(gate) * up; }
Tensor geglu_eager(const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  return at::gelu(gate, approximate) * up;
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
  return cuda_sm80(call, "gate is not on a CUDA device");
}
#endif

// ---- the two ops: typed entry points over one implementation each

using Grads = std::tuple<Tensor, Tensor>;

// (forward, backward) of one implementation for swiglu (silu) and for geglu (its approximate).
template <Tensor (*Fwd)(const Tensor&, const Tensor&, GatedActivation),
          Grads (*Bwd)(const Tensor&, const Tensor&, const Tensor&, GatedActivation)>
struct Gated {
  static Tensor swiglu_fwd(const Tensor& g, const Tensor& u) {
    return Fwd(g, u, GatedActivation::kSilu);
  }
  static Grads swiglu_bwd(const Tensor& dy, const Tensor& g, const Tensor& u) {
    return Bwd(dy, g, u, GatedActivation::kSilu);
  }
  static Tensor geglu_fwd(const Tensor& g, const Tensor& u, c10::string_view approximate) {
    return Fwd(g, u, parse_approximate(approximate));
  }
  static Grads geglu_bwd(const Tensor& dy, const Tensor& g, const Tensor& u,
                         c10::string_view approximate) {
    return Bwd(dy, g, u, parse_approximate(approximate));
  }
};
using Reference = Gated<reference_fwd, reference_bwd>;
#ifdef KERNELGATE_WITH_CUDA
using Cuda = Gated<cuda_fwd, cuda_bwd>;
#endif

void check_swiglu(const Tensor& gate, const Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "swiglu: up must have the shape of gate (", gate.sizes(),
              "), got ", up.sizes());
}

void check_geglu(const Tensor& gate, const Tensor& up, c10::string_view) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "geglu: up must have the shape of gate (", gate.sizes(),
              "), got ", up.sizes());
}

Tensor swiglu_meta(const Tensor& gate, const Tensor&) {
  return at::empty_like(gate, at::MemoryFormat::Contiguous);
}
Tensor geglu_meta(const Tensor& gate, const Tensor&, c10::string_view) {
  return at::empty_like(gate, at::MemoryFormat::Contiguous);
}

OpContract gated_contract(const char* name, const char* schema) {
  OpContract c;
  c.name = name;
  c.source_stem = "gated";
  c.schema = schema;
  c.dims = "gate: [*rows, hidden]; up: [*rows, hidden]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.dim_ranges = {{"rows", {0, 65536}}, {"hidden", {1, 65536}}};
  for (int64_t rows : {16384, 8192, 4096}) {
    for (int64_t hidden : {14336, 11008, 8192, 5632})
      c.production_shapes.push_back({{"rows", rows}, {"hidden", hidden}});
  }
  return c;
}

OpContract geglu_contract() {
  OpContract c =
      gated_contract("geglu", "geglu(Tensor gate, Tensor up, str approximate=\"tanh\") -> Tensor");
  c.variant_args = {{"approximate", {"tanh", "none"}}};
  return c;
}

const OpId kSwiglu =
    OpDeclaration(gated_contract("swiglu", "swiglu(Tensor gate, Tensor up) -> Tensor"))
        .reference(Reference::swiglu_fwd)
        .eager(swiglu_eager)
        .meta(swiglu_meta)
        .check(check_swiglu)
        .backend("reference", BackendKind::kReference, Reference::swiglu_fwd, Reference::swiglu_bwd)
#ifdef KERNELGATE_WITH_CUDA
        .backend("kernelgate_cuda", BackendKind::kKernelgate, Cuda::swiglu_fwd, Cuda::swiglu_bwd,
                 cuda_can_implement, cuda_available)
#else
        .unavailable("kernelgate_cuda", BackendKind::kKernelgate, kNoCudaBuild)
#endif
        .install();

const OpId kGeglu =
    OpDeclaration(geglu_contract())
        .reference(Reference::geglu_fwd)
        .eager(geglu_eager)
        .meta(geglu_meta)
        .check(check_geglu)
        .backend("reference", BackendKind::kReference, Reference::geglu_fwd, Reference::geglu_bwd)
#ifdef KERNELGATE_WITH_CUDA
        .backend("kernelgate_cuda", BackendKind::kKernelgate, Cuda::geglu_fwd, Cuda::geglu_bwd,
                 cuda_can_implement, cuda_available)
#else
        .unavailable("kernelgate_cuda", BackendKind::kKernelgate, kNoCudaBuild)
#endif
        .install();

}  // namespace

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  static const auto op = typed_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("swiglu");
  return op.call(gate, up);
}

at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up, c10::string_view approximate) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>("geglu");
  return op.call(gate, up, approximate);
}

}  // namespace kernelgate
