// rope and qk_norm_rope: contracts, reference and backends (reference, kernelgate_cuda). rope
// rotates q and k by cos / sin (rotate-half convention); qk_norm_rope first rms-normalises every
// head of q and k (Qwen3 / OLMo2 qk-norm), then rotates.
//
// cos and sin are constants to autograd: no gradient flows to them (the reference detaches
// them), as in every model that builds them from positions.
#include <ATen/ATen.h>

#include <cmath>

#include "kernelgate/kernelgate.h"
#include "kernels/rope.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using TensorPair = std::tuple<Tensor, Tensor>;
using TensorQuad = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// Backends' own signatures; the protocol (kernelgate/op.h) adapts them below. rope saves nothing
// a backend makes: its forward is the op itself, its backward takes the output gradients.
// qk_norm_rope's forward returns (q_out, k_out, q_rstd, k_rstd), the rstds undefined when
// want_rstd is false; its backward (dq, dk, dq_weight, dk_weight).
using NormFwd = TensorQuad (*)(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                               const Tensor& cos, const Tensor& sin, double eps, bool want_rstd);
using NormBwd = TensorQuad (*)(const Tensor& gq, const Tensor& gk, const Tensor& q, const Tensor& k,
                               const Tensor& qw, const Tensor& kw, const Tensor& cos,
                               const Tensor& sin, const Tensor& q_rstd, const Tensor& k_rstd,
                               bool weight_grad);

// ---- reference: ATen in float32 (float64 for float64 inputs: the oracle). Its autograd, as the
// ops _rope_reference / _qk_norm_rope_reference, is the gradient contract.

Tensor in_dtype(const Tensor& t, at::ScalarType acc) {
  return t.scalar_type() == acc ? t : t.to(acc);
}

at::ScalarType acc_type(const Tensor& x) { return at::promote_types(x.scalar_type(), at::kFloat); }

// t in x's dtype and layout (as at::empty_like(x) has it): the layout every backend returns for
// x's output or gradient (the contract keeps input layouts), whatever layout ATen's elementwise
// ops chose.
Tensor like(const Tensor& t, const Tensor& x) { return in_layout_of(in_dtype(t, x.scalar_type()), x); }

Tensor rotate_half(const Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// cos / sin [cos_batch, seq, head_dim] -> [cos_batch, 1, seq, head_dim] in acc, detached: they
// broadcast over heads (and over batch when cos_batch is 1) and get no gradient.
Tensor per_head(const Tensor& cs, at::ScalarType acc) {
  return in_dtype(cs.detach(), acc).unsqueeze(1);
}

// x in acc; c, s from per_head.
Tensor rope_math(const Tensor& x, const Tensor& c, const Tensor& s) {
  return x * c + rotate_half(x) * s;
}

// The transpose of rope_math: rotate_half's transpose is -rotate_half.
Tensor rope_math_bwd(const Tensor& g, const Tensor& c, const Tensor& s) {
  return g * c - rotate_half(g * s);
}

TensorPair rope_reference_fwd(const Tensor& q, const Tensor& k, const Tensor& cos,
                              const Tensor& sin) {
  const auto acc = acc_type(q);
  Tensor c = per_head(cos, acc), s = per_head(sin, acc);
  return {like(rope_math(in_dtype(q, acc), c, s), q), like(rope_math(in_dtype(k, acc), c, s), k)};
}

TensorPair rope_reference_bwd(const Tensor& gq, const Tensor& gk, const Tensor& cos,
                              const Tensor& sin) {
  const auto acc = acc_type(gq);
  Tensor c = per_head(cos, acc), s = per_head(sin, acc);
  return {like(rope_math_bwd(in_dtype(gq, acc), c, s), gq),
          like(rope_math_bwd(in_dtype(gk, acc), c, s), gk)};
}

// x * c + rotate_half(x) * s with each temporary freed where Python frees it: one C++ expression
// would keep every temporary of it alive to its end (a q-sized buffer more at the peak).
Tensor rope_eager_one(const Tensor& x, const Tensor& c, const Tensor& s) {
  Tensor xc = x * c;
  Tensor rs = rotate_half(x);
  rs = rs * s;
  return xc + rs;
}

// eager: what a user writes without kernelgate, at the input dtype (the Llama code: q * cos +
// rotate_half(q) * sin, cos / sin broadcast over heads; for qk_norm_rope F.rms_norm first).
TensorPair rope_eager(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  // cos and sin get no gradient (the op's contract): detached, as the model code holds them.
  Tensor c = cos.detach().unsqueeze(1), s = sin.detach().unsqueeze(1);
  return {rope_eager_one(q, c, s), rope_eager_one(k, c, s)};
}

TensorPair qk_norm_rope_eager(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                              const Tensor& cos, const Tensor& sin, double eps) {
  const int64_t d = q.size(-1);
  return rope_eager(at::rms_norm(q, {d}, qw, eps), at::rms_norm(k, {d}, kw, eps), cos, sin);
}

// Per-head rms_norm in acc: (x rstd w, rstd [batch, heads, seq]).
TensorPair head_rms_norm(const Tensor& x, const Tensor& w, double eps, at::ScalarType acc) {
  Tensor xf = in_dtype(x, acc);
  Tensor rstd = at::rsqrt(xf.square().mean(-1, /*keepdim=*/true) + eps);
  return {xf * rstd * in_dtype(w, acc), rstd.squeeze(-1)};
}

// The normalised heads stay in acc between the norm and the rotation: one rounding, at the end.
// (The eager composition rms_norm -> rope rounds them to the input dtype in between, one more
// rounding than here; the float64 oracle has none, so this is the more accurate choice.)
TensorQuad norm_reference_math(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                               const Tensor& cos, const Tensor& sin, double eps) {
  const auto acc = acc_type(q);
  Tensor c = per_head(cos, acc), s = per_head(sin, acc);
  auto [qn, q_rstd] = head_rms_norm(q, qw, eps, acc);
  auto [kn, k_rstd] = head_rms_norm(k, kw, eps, acc);
  return {like(rope_math(qn, c, s), q), like(rope_math(kn, c, s), k), q_rstd, k_rstd};
}

TensorQuad norm_reference_fwd(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                              const Tensor& cos, const Tensor& sin, double eps, bool want_rstd) {
  auto [qo, ko, qr, kr] = norm_reference_math(q, k, qw, kw, cos, sin, eps);
  if (!want_rstd) return {qo, ko, Tensor(), Tensor()};
  return {qo, ko, qr.to(at::kFloat), kr.to(at::kFloat)};
}

// (dx, dweight or empty) of one of q / k, given its output gradient g.
TensorPair head_norm_rope_bwd(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& c,
                              const Tensor& s, const Tensor& rstd, bool weight_grad) {
  Tensor dn = rope_math_bwd(in_dtype(g, at::kFloat), c, s);
  Tensor r = rstd.unsqueeze(-1);
  Tensor xhat = in_dtype(x, at::kFloat) * r;
  Tensor gw = dn * in_dtype(w, at::kFloat);
  Tensor dx = r * (gw - xhat * (gw * xhat).mean(-1, /*keepdim=*/true));
  Tensor dw = weight_grad ? (dn * xhat).reshape({-1, x.size(-1)}).sum(0).to(w.scalar_type())
                          : at::empty({0}, w.options());
  return {like(dx, x), dw};
}

TensorQuad norm_reference_bwd(const Tensor& gq, const Tensor& gk, const Tensor& q, const Tensor& k,
                              const Tensor& qw, const Tensor& kw, const Tensor& cos,
                              const Tensor& sin, const Tensor& q_rstd, const Tensor& k_rstd,
                              bool weight_grad) {
  Tensor c = per_head(cos, at::kFloat), s = per_head(sin, at::kFloat);
  auto [dq, dqw] = head_norm_rope_bwd(gq, q, qw, c, s, q_rstd, weight_grad);
  auto [dk, dkw] = head_norm_rope_bwd(gk, k, kw, c, s, k_rstd, weight_grad);
  return {dq, dk, dqw, dkw};
}

TensorPair rope_reference_op(const Tensor& q, const Tensor& k, const Tensor& cos,
                             const Tensor& sin) {
  return rope_reference_fwd(q, k, cos, sin);
}

TensorPair norm_reference_op(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                             const Tensor& cos, const Tensor& sin, double eps) {
  auto [qo, ko, qr, kr] = norm_reference_math(q, k, qw, kw, cos, sin, eps);
  return {qo, ko};
}

// ---- kernelgate_cuda

#ifdef KERNELGATE_WITH_CUDA
// The kernels need a unit-stride last dim (any strides elsewhere): copy only when it is not.
Tensor unit_last(const Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// Strides of the first three dims; a dim of size 1 gets stride 0 (never stepped, and then its
// stride cannot keep the vectorised path from being taken).
kernels::RopeStrides strides_of(const Tensor& t) {
  auto st = [&](int i) { return t.size(i) == 1 ? 0 : t.stride(i); };
  return {st(0), st(1), st(2)};
}

// An output or gradient for t, in t's layout (the contract keeps input layouts; the kernels
// write any strides).
Tensor out_like(const Tensor& t) { return at::empty_like(t); }

kernels::RopeProblem problem(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                             const Tensor& q_out, const Tensor& k_out) {
  kernels::RopeProblem p;
  p.batch = q.size(0);
  p.q_heads = q.size(1);
  p.seq = q.size(2);
  p.head_dim = q.size(3);
  p.kv_heads = k.size(1);
  p.q = strides_of(q);
  p.k = strides_of(k);
  p.q_out = strides_of(q_out);
  p.k_out = strides_of(k_out);
  p.cos_sb = cos.size(0) == 1 ? 0 : cos.stride(0);
  p.cos_ss = cos.size(1) == 1 ? 0 : cos.stride(1);
  p.sin_sb = sin.size(0) == 1 ? 0 : sin.stride(0);
  p.sin_ss = sin.size(1) == 1 ? 0 : sin.stride(1);
  p.dtype = kernel_dtype(q.scalar_type());
  return p;
}

TensorPair rope_cuda_apply(const Tensor& x_q, const Tensor& x_k, const Tensor& cos,
                           const Tensor& sin, bool backward) {
  CudaContext ctx(x_q);
  Tensor q = unit_last(x_q), k = unit_last(x_k), c = unit_last(cos), s = unit_last(sin);
  Tensor qo = out_like(q), ko = out_like(k);
  check_cuda(kernels::rope_cuda(qo.data_ptr(), ko.data_ptr(), q.const_data_ptr(),
                                k.const_data_ptr(), c.const_data_ptr(), s.const_data_ptr(),
                                problem(q, k, c, s, qo, ko), backward, ctx.stream),
             backward ? "rope backward" : "rope forward");
  return {qo, ko};
}

TensorPair rope_cuda_fwd(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  return rope_cuda_apply(q, k, cos, sin, false);
}

TensorPair rope_cuda_bwd(const Tensor& gq, const Tensor& gk, const Tensor& cos, const Tensor& sin) {
  return rope_cuda_apply(gq, gk, cos, sin, true);
}

TensorQuad norm_cuda_fwd(const Tensor& x_q, const Tensor& x_k, const Tensor& qw, const Tensor& kw,
                         const Tensor& cos, const Tensor& sin, double eps, bool want_rstd) {
  CudaContext ctx(x_q);
  Tensor q = unit_last(x_q), k = unit_last(x_k), c = unit_last(cos), s = unit_last(sin);
  Tensor qwc = qw.contiguous(), kwc = kw.contiguous();
  Tensor qo = out_like(q), ko = out_like(k);
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor qr = want_rstd ? at::empty({q.size(0), q.size(1), q.size(2)}, f32) : Tensor();
  Tensor kr = want_rstd ? at::empty({k.size(0), k.size(1), k.size(2)}, f32) : Tensor();
  check_cuda(kernels::qk_norm_rope_fwd_cuda(
                 qo.data_ptr(), ko.data_ptr(), want_rstd ? qr.data_ptr<float>() : nullptr,
                 want_rstd ? kr.data_ptr<float>() : nullptr, q.const_data_ptr(), k.const_data_ptr(),
                 qwc.const_data_ptr(), kwc.const_data_ptr(), c.const_data_ptr(), s.const_data_ptr(),
                 static_cast<float>(eps), problem(q, k, c, s, qo, ko), ctx.stream),
             "qk_norm_rope forward");
  return {qo, ko, qr, kr};
}

TensorQuad norm_cuda_bwd(const Tensor& g_q, const Tensor& g_k, const Tensor& x_q, const Tensor& x_k,
                         const Tensor& qw, const Tensor& kw, const Tensor& cos, const Tensor& sin,
                         const Tensor& q_rstd, const Tensor& k_rstd, bool weight_grad) {
  CudaContext ctx(x_q);
  Tensor gq = unit_last(g_q), gk = unit_last(g_k), q = unit_last(x_q), k = unit_last(x_k);
  Tensor c = unit_last(cos), s = unit_last(sin);
  Tensor qwc = qw.contiguous(), kwc = kw.contiguous();
  Tensor qr = q_rstd.contiguous(), kr = k_rstd.contiguous();
  Tensor dq = out_like(q), dk = out_like(k);
  kernels::RopeProblem p = problem(gq, gk, c, s, dq, dk);
  Tensor dqw = weight_grad ? at::empty_like(qwc) : at::empty({0}, qw.options());
  Tensor dkw = weight_grad ? at::empty_like(kwc) : at::empty({0}, kw.options());
  const int64_t ws_floats =
      weight_grad ? kernels::qk_norm_rope_bwd_workspace_floats(p, ctx.sm_count) : 0;
  Tensor ws = at::empty({std::max<int64_t>(1, ws_floats)}, q.options().dtype(at::kFloat));
  check_cuda(kernels::qk_norm_rope_bwd_cuda(
                 dq.data_ptr(), dk.data_ptr(), weight_grad ? dqw.data_ptr() : nullptr,
                 weight_grad ? dkw.data_ptr() : nullptr, gq.const_data_ptr(), gk.const_data_ptr(),
                 q.const_data_ptr(), k.const_data_ptr(), strides_of(q), strides_of(k),
                 qwc.const_data_ptr(), kwc.const_data_ptr(), qr.const_data_ptr<float>(),
                 kr.const_data_ptr<float>(), c.const_data_ptr(), s.const_data_ptr(),
                 ws.data_ptr<float>(), ctx.sm_count, p, ctx.stream),
             "qk_norm_rope backward");
  return {dq, dk, dqw, dkw};
}

Support rope_cuda_can_implement(const CallView& call) {
  if (Support s = cuda_sm80(call, "q is not on a CUDA device"); !s.ok) return s;
  const Tensor& q = *call.tensors[0];
  if (q.size(-1) > 65536)
    return Support::no("head_dim above 65536 is not supported by the CUDA kernel");
  return Support::yes();
}

Support norm_cuda_can_implement(const CallView& call) {
  if (Support s = cuda_sm80(call, "q is not on a CUDA device"); !s.ok) return s;
  const Tensor& q = *call.tensors[0];
  // The backward keeps two float32 rows of weight-gradient sums in 48 KiB of shared memory.
  if (q.size(-1) > 4096)
    return Support::no("head_dim above 4096 is not supported by the CUDA kernel");
  return Support::yes();
}
#endif

// ---- checks, shapes and the protocol

// What the named dims cannot say. q, k, cos, sin have passed check_call.
void check_rope_shapes(const char* op, const Tensor& q, const Tensor& cos) {
  TORCH_CHECK(q.size(-1) > 0 && q.size(-1) % 2 == 0, op,
              ": head_dim (q.size(-1)) must be a positive even number (rope rotates its two "
              "halves), got ",
              q.size(-1));
  TORCH_CHECK(
      cos.size(0) == 1 || cos.size(0) == q.size(0), op,
      ": cos.size(0) and sin.size(0) must be 1 (shared by the batch) or batch (q.size(0) = ",
      q.size(0), "), got ", cos.size(0));
}

void check_rope(const Tensor& q, const Tensor&, const Tensor& cos, const Tensor&) {
  check_rope_shapes("rope", q, cos);
}

void check_norm(const Tensor& q, const Tensor&, const Tensor&, const Tensor&, const Tensor& cos,
                const Tensor&, double eps) {
  check_rope_shapes("qk_norm_rope", q, cos);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0,
              "qk_norm_rope: eps must be a finite number >= 0, got ", number(eps));
}

Tensor out_meta(const Tensor& t) { return at::empty_like(t); }

Tensor rstd_meta(const Tensor& x) {
  return at::empty({x.size(0), x.size(1), x.size(2)}, x.options().dtype(at::kFloat));
}

TensorPair rope_meta(const Tensor& q, const Tensor& k, const Tensor&, const Tensor&) {
  return {out_meta(q), out_meta(k)};
}

TensorQuad norm_meta(const Tensor& q, const Tensor& k, const Tensor&, const Tensor&, const Tensor&,
                     const Tensor&, double) {
  return {out_meta(q), out_meta(k), rstd_meta(q), rstd_meta(k)};
}

template <NormFwd F>
TensorQuad norm_forward(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                        const Tensor& cos, const Tensor& sin, double eps, GradRequest need) {
  return F(q, k, qw, kw, cos, sin, eps, need.any());
}

template <NormBwd B>
TensorQuad norm_backward(const Tensor& gq, const Tensor& gk, const Tensor& q, const Tensor& k,
                         const Tensor& qw, const Tensor& kw, const Tensor& cos, const Tensor& sin,
                         const Tensor& q_rstd, const Tensor& k_rstd, double, GradRequest need) {
  return B(gq, gk, q, k, qw, kw, cos, sin, q_rstd, k_rstd, need(2) || need(3));
}

void add_llm_shapes(OpContract& c) {
  // (batch, q_heads, kv_heads, seq, head_dim): Llama-3 8B (GQA 32/8), Llama-3 70B (64/8),
  // Qwen3 (GQA, head_dim 128), a long single sequence, MHA with head_dim 64, the model of
  // bench/bench_train_step.py (GQA 16/4, batch 4 x 2048).
  const int64_t shapes[][5] = {{4, 32, 8, 4096, 128},
                               {1, 64, 8, 8192, 128},
                               {8, 32, 8, 2048, 128},
                               {1, 32, 8, 32768, 128},
                               {16, 16, 16, 1024, 64},
                               {4, 16, 4, 2048, 128}};
  for (const auto& s : shapes) {
    c.production_shapes.push_back({{"batch", s[0]},
                                   {"q_heads", s[1]},
                                   {"kv_heads", s[2]},
                                   {"seq", s[3]},
                                   {"head_dim", s[4]},
                                   {"cos_batch", 1}});
  }
  // Attention code's q and k are views: q_proj(x).view(batch, seq, heads, head_dim)
  // .transpose(1, 2); some models make them contiguous first.
  c.production_layouts = {"contiguous", "transposed"};
  // cos_batch is 1 or batch; the harness varies dims one at a time, so it keeps 1.
  c.dim_ranges = {{"batch", {1, 64}},  {"q_heads", {1, 128}},  {"kv_heads", {1, 128}},
                  {"seq", {1, 65536}}, {"head_dim", {2, 512}}, {"cos_batch", {1, 1}}};
  c.dim_multiples = {{"head_dim", 2}};  // rope rotates two halves
  c.outputs = {"q_out", "k_out"};
  // q_out, k_out and the gradients in q's and k's layout: for attention code's views, SDPA then
  // returns o in that layout too, and neither o.transpose(1, 2).reshape(...) nor the projections'
  // backward copies (with dense outputs a training step copied three tensors per layer).
  c.keeps_input_layout = true;
  // cos and sin are constants to autograd (the reference detaches them).
  c.no_grad = {"cos", "sin"};
}

OpContract rope_contract() {
  OpContract c;
  c.name = "rope";
  c.schema = "rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)";
  c.dims =
      "q: [batch, q_heads, seq, head_dim]; k: [batch, kv_heads, seq, head_dim]; "
      "cos: [cos_batch, seq, head_dim]; sin: [cos_batch, seq, head_dim]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  add_llm_shapes(c);
  c.output_inputs = {{"q_out", {"q"}}, {"k_out", {"k"}}};
  // The backward needs only cos and sin; the output gradients have q's and k's shapes and dtype.
  c.saved = {"cos", "sin"};
  c.backward_stand_ins = {{"q", "grad_0"}, {"k", "grad_1"}};
  return c;
}

OpContract qk_norm_rope_contract() {
  OpContract c;
  c.name = "qk_norm_rope";
  c.source_stem = "rope";
  c.schema =
      "qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, "
      "Tensor sin, float eps=1e-06) -> (Tensor, Tensor)";
  c.dims =
      "q: [batch, q_heads, seq, head_dim]; k: [batch, kv_heads, seq, head_dim]; "
      "q_weight: [head_dim]; k_weight: [head_dim]; "
      "cos: [cos_batch, seq, head_dim]; sin: [cos_batch, seq, head_dim]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.scalar_test_values = {{"eps", {1e-6, 1e-5, 0.1}}};
  add_llm_shapes(c);
  c.output_inputs = {{"q_out", {"q", "q_weight"}}, {"k_out", {"k", "k_weight"}}};
  c.extras = {"q_rstd", "k_rstd"};
  c.saved = {"q", "k", "q_weight", "k_weight", "cos", "sin", "q_rstd", "k_rstd"};
  return c;
}

const OpId kRope =
    OpDeclaration(rope_contract())
        .reference(rope_reference_op)
        .eager(rope_eager)
        .meta(rope_meta)
        .check(check_rope)
        .backend("reference", BackendKind::kReference, rope_reference_fwd, rope_reference_bwd)
#ifdef KERNELGATE_WITH_CUDA
        .backend("kernelgate_cuda", BackendKind::kKernelgate, rope_cuda_fwd, rope_cuda_bwd,
                 rope_cuda_can_implement, cuda_available)
#else
        .unavailable("kernelgate_cuda", BackendKind::kKernelgate, kNoCudaBuild)
#endif
        .install();

const OpId kQkNormRope =
    OpDeclaration(qk_norm_rope_contract())
        .reference(norm_reference_op)
        .eager(qk_norm_rope_eager)
        .meta(norm_meta)
        .check(check_norm)
        .backend("reference", BackendKind::kReference, norm_forward<norm_reference_fwd>,
                 norm_backward<norm_reference_bwd>)
#ifdef KERNELGATE_WITH_CUDA
        .backend("kernelgate_cuda", BackendKind::kKernelgate, norm_forward<norm_cuda_fwd>,
                 norm_backward<norm_cuda_bwd>, norm_cuda_can_implement, cuda_available)
#else
        .unavailable("kernelgate_cuda", BackendKind::kKernelgate, kNoCudaBuild)
#endif
        .install();

}  // namespace

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& cos, const at::Tensor& sin) {
  static const auto op =
      typed_op<TensorPair(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>("rope");
  return op.call(q, k, cos, sin);
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& q_weight,
                                                const at::Tensor& k_weight, const at::Tensor& cos,
                                                const at::Tensor& sin, double eps) {
  static const auto op =
      typed_op<TensorPair(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, double)>("qk_norm_rope");
  return op.call(q, k, q_weight, k_weight, cos, sin, eps);
}

}  // namespace kernelgate
