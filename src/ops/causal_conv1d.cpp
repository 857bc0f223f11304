// causal_conv1d: the depthwise causal convolution over time of Mamba and Gated DeltaNet blocks
// (their "short conv"), on [batch, seq, dim] with a [dim, width] weight:
//   y[b, t, d] = act(bias[d] + sum_j weight[d, j] * x[b, t - (width - 1) + j, d]),
// x zero before t = 0, act none or silu. Contract, reference and backends (reference, eager,
// kernelgate_cuda).
#include <ATen/ATen.h>

#include "kernelgate/kernelgate.h"
#include "kernels/causal_conv1d.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using Grads = std::tuple<Tensor, Tensor, Tensor>;
constexpr const char* kOp = "causal_conv1d";

bool parse_activation(c10::string_view activation) {
  if (activation == "silu") return true;
  if (activation == "none") return false;
  TORCH_CHECK(false, kOp, ": activation must be 'none' or 'silu', got '", activation, "'");
}

Tensor in_dtype(const Tensor& t, at::ScalarType s) { return t.scalar_type() == s ? t : t.to(s); }

at::ScalarType acc_type(const Tensor& x) { return at::promote_types(x.scalar_type(), at::kFloat); }

// ---- reference: ATen in float32 (float64 for float64 inputs: the oracle), as a sum of shifted
// copies of x zero-padded in front. Its autograd, as the op _causal_conv1d_reference, is the
// gradient contract.

// x [batch, seq, dim] in acc, zero-padded by width - 1 steps before t = 0.
Tensor padded(const Tensor& x, int64_t width, at::ScalarType acc) {
  return at::constant_pad_nd(in_dtype(x, acc), {0, 0, width - 1, 0});
}

// bias + sum_j weight[:, j] * x[t - (width - 1) + j], in acc, from x padded (padded()).
Tensor pre_activation(const Tensor& xp, const Tensor& w, const OptTensor& b, at::ScalarType acc) {
  const int64_t width = w.size(1), seq = xp.size(1) - (width - 1);
  Tensor wf = in_dtype(w, acc);
  Tensor pre = xp.narrow(1, 0, seq) * wf.select(1, 0);
  for (int64_t j = 1; j < width; ++j) pre = pre + xp.narrow(1, j, seq) * wf.select(1, j);
  return b ? pre + in_dtype(*b, acc) : pre;
}

Tensor reference_op(const Tensor& x, const Tensor& w, const OptTensor& b,
                    c10::string_view activation) {
  const bool silu = parse_activation(activation);
  const auto acc = acc_type(x);
  Tensor pre = pre_activation(padded(x, w.size(1), acc), w, b, acc);
  return in_dtype(silu ? at::silu(pre) : pre, x.scalar_type());
}

Tensor reference_fwd(const Tensor& x, const Tensor& w, const OptTensor& b,
                     c10::string_view activation) {
  return reference_op(x, w, b, activation).contiguous();  // dense, as the Meta impl promises
}

// g = dy * act'(pre); dx[t] = sum_j w[j] g[t + width - 1 - j] (no term past the end);
// dw[j] = sum_{b,t} g[t] x_padded[t + j]; db = sum_{b,t} g.
Grads reference_bwd(const Tensor& dy, const Tensor& x, const Tensor& w, const OptTensor& b,
                    c10::string_view activation, GradRequest need) {
  const bool silu = parse_activation(activation);
  const auto acc = acc_type(x);
  const int64_t width = w.size(1), seq = x.size(1);
  Tensor g = in_dtype(dy, acc);
  Tensor xp = silu || need(1) ? padded(x, width, acc) : Tensor();
  if (silu) {
    Tensor pre = pre_activation(xp, w, b, acc), s = at::sigmoid(pre);
    g = g * (s * (1 + pre * (1 - s)));
  }
  Tensor dx, dw, db;
  if (need(0)) {
    Tensor wf = in_dtype(w, acc);
    dx = at::zeros_like(g);
    for (int64_t j = 0; j < width; ++j) {
      const int64_t shift = width - 1 - j;  // dx[t] += w[j] g[t + shift], for t + shift < seq
      if (shift >= seq) continue;
      dx.narrow(1, 0, seq - shift).add_(g.narrow(1, shift, seq - shift) * wf.select(1, j));
    }
    dx = in_dtype(dx, x.scalar_type()).contiguous();
  }
  if (need(1)) {
    std::vector<Tensor> taps;
    for (int64_t j = 0; j < width; ++j) taps.push_back((g * xp.narrow(1, j, seq)).sum(at::IntArrayRef{0, 1}));
    dw = in_dtype(at::stack(taps, 1), w.scalar_type()).contiguous();
  }
  if (need(2) && b) db = in_dtype(g.sum(at::IntArrayRef{0, 1}), b->scalar_type()).contiguous();
  return {dx, dw, db};
}

// ---- eager: what a user writes without kernelgate (PyTorch's depthwise conv1d over [b, d, t]),
// at the input dtype

Tensor eager(const Tensor& x, const Tensor& w, const OptTensor& b, c10::string_view activation) {
  const bool silu = parse_activation(activation);
  const int64_t width = w.size(1), seq = x.size(1), dim = x.size(2);
  Tensor y = at::conv1d(x.transpose(1, 2), w.unsqueeze(1), b, /*stride=*/{1},
                        /*padding=*/{width - 1}, /*dilation=*/{1}, /*groups=*/dim)
                 .narrow(2, 0, seq);
  if (silu) y = at::silu(y);
  return y.transpose(1, 2).contiguous();
}

// ---- kernelgate_cuda

#ifdef KERNELGATE_WITH_CUDA
kernels::CausalConv1dShape shape_of(const Tensor& x, const Tensor& w, c10::string_view activation) {
  return {x.size(0), x.size(1), x.size(2), w.size(1), parse_activation(activation)};
}

const void* data_or_null(const OptTensor& t) { return t ? t->const_data_ptr() : nullptr; }

Tensor cuda_fwd(const Tensor& x, const Tensor& w, const OptTensor& b, c10::string_view activation) {
  CudaContext ctx(x);
  Tensor xc = x.contiguous(), wc = w.contiguous();
  OptTensor bc = b ? OptTensor(b->contiguous()) : std::nullopt;
  Tensor y = at::empty(xc.sizes(), xc.options());
  check_cuda(kernels::causal_conv1d_fwd_cuda(y.data_ptr(), xc.const_data_ptr(), wc.const_data_ptr(),
                                             data_or_null(bc), shape_of(xc, wc, activation),
                                             kernel_dtype(xc.scalar_type()), ctx.sm_count,
                                             ctx.stream),
             "causal_conv1d forward");
  return y;
}

Grads cuda_bwd(const Tensor& dy, const Tensor& x, const Tensor& w, const OptTensor& b,
               c10::string_view activation, GradRequest need) {
  CudaContext ctx(x);
  Tensor dyc = dy.contiguous(), xc = x.contiguous(), wc = w.contiguous();
  OptTensor bc = b ? OptTensor(b->contiguous()) : std::nullopt;
  const auto shape = shape_of(xc, wc, activation);
  Tensor dx = need(0) ? at::empty(xc.sizes(), xc.options()) : Tensor();
  Tensor dw = need(1) ? at::empty(wc.sizes(), wc.options()) : Tensor();
  Tensor db = need(2) && bc ? at::empty(bc->sizes(), bc->options()) : Tensor();
  Tensor workspace;
  if (dw.defined() || db.defined()) {
    const size_t bytes = kernels::causal_conv1d_bwd_workspace_bytes(shape, ctx.sm_count);
    workspace = at::empty({static_cast<int64_t>(bytes)}, xc.options().dtype(at::kByte));
  }
  auto ptr = [](const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
  check_cuda(kernels::causal_conv1d_bwd_cuda(ptr(dx), ptr(dw), ptr(db), dyc.const_data_ptr(),
                                             xc.const_data_ptr(), wc.const_data_ptr(),
                                             data_or_null(bc), shape, kernel_dtype(xc.scalar_type()),
                                             ptr(workspace), ctx.sm_count, ctx.stream),
             "causal_conv1d backward");
  return {dx, dw, db};
}

Support cuda_can_implement(const CallView& call) {
  const Support s = cuda_sm80(call, "x is not on a CUDA device");
  if (!s.ok) return s;
  if (call.tensors[1]->size(1) > kernels::kCausalConv1dMaxWidth) {
    return Support::no("implements widths (weight.size(1)) of at most 8 only");
  }
  return Support::yes();
}
#endif

// ---- declaration

void check_args(const Tensor&, const Tensor& w, const OptTensor&, c10::string_view activation) {
  TORCH_CHECK(w.size(1) >= 1, kOp, ": weight must have at least one tap (weight.size(1) >= 1), got "
              "weight of shape ", w.sizes());
  parse_activation(activation);
}

Tensor meta(const Tensor& x, const Tensor&, const OptTensor&, c10::string_view) {
  return at::empty(x.sizes(), x.options());
}

OpContract contract() {
  OpContract c;
  c.name = kOp;
  c.schema =
      "causal_conv1d(Tensor x, Tensor weight, Tensor? bias=None, str activation=\"none\") -> Tensor";
  c.dims = "x: [batch, seq, dim]; weight: [dim, width]; bias?: [dim]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.variant_args = {{"activation", {"none", "silu"}}};
  c.dim_ranges = {{"batch", {1, 256}}, {"seq", {1, 65536}}, {"dim", {1, 16384}}, {"width", {1, 8}}};
  // Gated DeltaNet's q / k / v short convs (dim = heads x head_dim, no bias) and Mamba's (bias).
  c.production_shapes = {
      {{"batch", 4}, {"seq", 4096}, {"dim", 8192}, {"width", 4}},
      {{"batch", 8}, {"seq", 2048}, {"dim", 4096}, {"width", 4}},
      {{"batch", 1}, {"seq", 8192}, {"dim", 6144}, {"width", 4}},
      {{"batch", 16}, {"seq", 1024}, {"dim", 2048}, {"width", 4}},
  };
  c.production_optionals = {false, true};
  c.outputs = {"y"};
  return c;
}

const OpId kCausalConv1d =
    OpDeclaration(contract())
        .reference(reference_op)
        .eager(eager)
        .meta(meta)
        .check(check_args)
        .backend("reference", BackendKind::kReference, reference_fwd, reference_bwd)
#ifdef KERNELGATE_WITH_CUDA
        .backend("kernelgate_cuda", BackendKind::kKernelgate, cuda_fwd, cuda_bwd,
                 cuda_can_implement, cuda_available)
#else
        .unavailable("kernelgate_cuda", BackendKind::kKernelgate, kNoCudaBuild)
#endif
        .install();

}  // namespace
}  // namespace kernelgate
