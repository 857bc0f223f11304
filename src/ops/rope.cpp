// rope and qk_norm_rope: contracts, backends (reference, kernelgate_cuda), routers, Meta and
// autograd. rope rotates q and k by cos / sin (rotate-half convention); qk_norm_rope first
// rms-normalises every head of q and k (Qwen3 / OLMo2 qk-norm), then rotates.
//
// cos and sin are constants to autograd: no gradient flows to them (the reference detaches
// them), as in every model that builds them from positions.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>

#include "kernelgate/dispatch.h"
#include "kernelgate/kernelgate.h"
#include "kernels/rope.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using TensorPair = std::tuple<Tensor, Tensor>;
using TensorQuad = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// Typed backends. rope's forward saves nothing a backend makes, so its forward is the op itself.
using RopeFwd = TensorPair (*)(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin);
// (dq, dk) from the output gradients.
using RopeBwd = TensorPair (*)(const Tensor& gq, const Tensor& gk, const Tensor& cos, const Tensor& sin);
// (q_out, k_out, q_rstd, k_rstd); the rstds are undefined when want_rstd is false.
using NormFwd = TensorQuad (*)(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                               const Tensor& cos, const Tensor& sin, double eps, bool want_rstd);
// (dq, dk, dq_weight, dk_weight); the weight gradients are empty tensors when not wanted.
using NormBwd = TensorQuad (*)(const Tensor& gq, const Tensor& gk, const Tensor& q, const Tensor& k,
                               const Tensor& qw, const Tensor& kw, const Tensor& cos,
                               const Tensor& sin, const Tensor& q_rstd, const Tensor& k_rstd,
                               bool weight_grad);

OpId g_rope = kNoOp, g_norm = kNoOp;
std::array<RopeFwd, kMaxBackends> g_rope_fwd{};
std::array<RopeBwd, kMaxBackends> g_rope_bwd{};
std::array<NormFwd, kMaxBackends> g_norm_fwd{};
std::array<NormBwd, kMaxBackends> g_norm_bwd{};

// ---- reference: ATen in float32 (float64 for float64 inputs: the oracle). Its autograd, as the
// ops _rope_reference / _qk_norm_rope_reference, is the gradient contract.

Tensor in_dtype(const Tensor& t, at::ScalarType acc) { return t.scalar_type() == acc ? t : t.to(acc); }

at::ScalarType acc_type(const Tensor& x) { return at::promote_types(x.scalar_type(), at::kFloat); }

// t in x's dtype, contiguous: the layout every backend returns (and the Meta impls promise),
// whatever layout ATen's elementwise ops chose for a strided x.
Tensor dense(const Tensor& t, const Tensor& x) {
  return in_dtype(t, x.scalar_type()).contiguous();
}

Tensor rotate_half(const Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// cos / sin [cos_batch, seq, head_dim] -> [cos_batch, 1, seq, head_dim] in acc, detached: they
// broadcast over heads (and over batch when cos_batch is 1) and get no gradient.
Tensor per_head(const Tensor& cs, at::ScalarType acc) { return in_dtype(cs.detach(), acc).unsqueeze(1); }

// x in acc; c, s from per_head.
Tensor rope_math(const Tensor& x, const Tensor& c, const Tensor& s) { return x * c + rotate_half(x) * s; }

// The transpose of rope_math: rotate_half's transpose is -rotate_half.
Tensor rope_math_bwd(const Tensor& g, const Tensor& c, const Tensor& s) {
  return g * c - rotate_half(g * s);
}

TensorPair rope_reference_fwd(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  const auto acc = acc_type(q);
  Tensor c = per_head(cos, acc), s = per_head(sin, acc);
  return {dense(rope_math(in_dtype(q, acc), c, s), q), dense(rope_math(in_dtype(k, acc), c, s), k)};
}

TensorPair rope_reference_bwd(const Tensor& gq, const Tensor& gk, const Tensor& cos, const Tensor& sin) {
  const auto acc = acc_type(gq);
  Tensor c = per_head(cos, acc), s = per_head(sin, acc);
  return {dense(rope_math_bwd(in_dtype(gq, acc), c, s), gq), dense(rope_math_bwd(in_dtype(gk, acc), c, s), gk)};
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
  return {dense(rope_math(qn, c, s), q), dense(rope_math(kn, c, s), k), q_rstd, k_rstd};
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
  return {dense(dx, x), dw};
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

TensorPair rope_reference_op(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
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
Tensor unit_last(const Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

// Strides of the first three dims; a dim of size 1 gets stride 0 (never stepped, and then its
// stride cannot keep the vectorised path from being taken).
kernels::RopeStrides strides_of(const Tensor& t) {
  auto st = [&](int i) { return t.size(i) == 1 ? 0 : t.stride(i); };
  return {st(0), st(1), st(2)};
}

Tensor dense_like(const Tensor& t) { return at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous)); }

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

TensorPair rope_cuda_apply(const Tensor& x_q, const Tensor& x_k, const Tensor& cos, const Tensor& sin,
                           bool backward) {
  CudaContext ctx(x_q);
  Tensor q = unit_last(x_q), k = unit_last(x_k), c = unit_last(cos), s = unit_last(sin);
  Tensor qo = dense_like(q), ko = dense_like(k);
  check_cuda(kernels::rope_cuda(qo.data_ptr(), ko.data_ptr(), q.const_data_ptr(), k.const_data_ptr(),
                                c.const_data_ptr(), s.const_data_ptr(), problem(q, k, c, s, qo, ko),
                                backward, ctx.stream),
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
  Tensor qo = dense_like(q), ko = dense_like(k);
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
  Tensor dq = dense_like(q), dk = dense_like(k);
  kernels::RopeProblem p = problem(gq, gk, c, s, dq, dk);
  Tensor dqw = weight_grad ? at::empty_like(qwc) : at::empty({0}, qw.options());
  Tensor dkw = weight_grad ? at::empty_like(kwc) : at::empty({0}, kw.options());
  const int64_t ws_floats = weight_grad ? kernels::qk_norm_rope_bwd_workspace_floats(p, ctx.sm_count) : 0;
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
  const Tensor& q = *call.tensors[0];
  if (!q.is_cuda()) return Support::no("q is not on a CUDA device");
  if (cuda_arch(q.get_device()) < 80) return Support::no("needs compute capability 8.0 or newer");
  if (q.size(-1) > 65536) return Support::no("head_dim above 65536 is not supported by the CUDA kernel");
  return Support::yes();
}

Support norm_cuda_can_implement(const CallView& call) {
  const Tensor& q = *call.tensors[0];
  if (!q.is_cuda()) return Support::no("q is not on a CUDA device");
  if (cuda_arch(q.get_device()) < 80) return Support::no("needs compute capability 8.0 or newer");
  // The backward keeps two float32 rows of weight-gradient sums in 48 KiB of shared memory.
  if (q.size(-1) > 4096) return Support::no("head_dim above 4096 is not supported by the CUDA kernel");
  return Support::yes();
}
#endif

// ---- routers --------------------------------------------------------------------------------

const OpContract& contract(OpId id) { return Dispatcher::get().op(id).contract; }

// What the named dims cannot say. q, k, cos, sin have passed check_call.
void check_rope_shapes(const char* op, const Tensor& q, const Tensor& cos) {
  TORCH_CHECK(q.size(-1) > 0 && q.size(-1) % 2 == 0, op,
              ": head_dim (q.size(-1)) must be a positive even number (rope rotates its two "
              "halves), got ",
              q.size(-1));
  TORCH_CHECK(cos.size(0) == 1 || cos.size(0) == q.size(0), op,
              ": cos.size(0) and sin.size(0) must be 1 (shared by the batch) or batch (q.size(0) = ",
              q.size(0), "), got ", cos.size(0));
}

BoundDims check_rope(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin, CallView& call,
                     bool grad) {
  call.num_tensors = 4;
  call.tensors = {&q, &k, &cos, &sin};
  call.grad = grad;
  BoundDims dims = check_call(contract(g_rope), call);
  check_rope_shapes("rope", q, cos);
  return dims;
}

int route_rope(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin, bool grad) {
  CallView call;
  BoundDims dims = check_rope(q, k, cos, sin, call, grad);
  return Dispatcher::get().select(g_rope, call, dims);
}

void check_norm_scalars(double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "qk_norm_rope: eps must be a finite number >= 0, got ", number(eps));
}

BoundDims check_norm(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                     const Tensor& cos, const Tensor& sin, double eps, CallView& call, bool grad) {
  call.num_tensors = 6;
  call.tensors = {&q, &k, &qw, &kw, &cos, &sin};
  call.grad = grad;
  BoundDims dims = check_call(contract(g_norm), call);
  check_rope_shapes("qk_norm_rope", q, cos);
  check_norm_scalars(eps);
  return dims;
}

int route_norm(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw, const Tensor& cos,
               const Tensor& sin, double eps, bool grad) {
  CallView call;
  BoundDims dims = check_norm(q, k, qw, kw, cos, sin, eps, call, grad);
  return Dispatcher::get().select(g_norm, call, dims);
}

void check_grads(const char* op, const Tensor& gq, const Tensor& gk, const Tensor& q, const Tensor& k) {
  TORCH_CHECK(gq.sizes() == q.sizes() && gq.scalar_type() == q.scalar_type(), op,
              " backward: the gradient of q_out must have q's shape ", q.sizes(), " and dtype, got ",
              gq.sizes(), " ", gq.scalar_type());
  TORCH_CHECK(gk.sizes() == k.sizes() && gk.scalar_type() == k.scalar_type(), op,
              " backward: the gradient of k_out must have k's shape ", k.sizes(), " and dtype, got ",
              gk.sizes(), " ", gk.scalar_type());
}

TensorPair rope_router(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  return g_rope_fwd[route_rope(q, k, cos, sin, false)](q, k, cos, sin);
}

// Routed with the gradients in q / k's places: same shapes and dtypes, so the same region.
TensorPair rope_bwd_router(const Tensor& gq, const Tensor& gk, const Tensor& cos, const Tensor& sin) {
  return g_rope_bwd[route_rope(gq, gk, cos, sin, true)](gq, gk, cos, sin);
}

TensorPair norm_router(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                       const Tensor& cos, const Tensor& sin, double eps) {
  auto [qo, ko, qr, kr] = g_norm_fwd[route_norm(q, k, qw, kw, cos, sin, eps, false)](q, k, qw, kw, cos, sin, eps, false);
  return {qo, ko};
}

TensorQuad norm_fwd_router(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                           const Tensor& cos, const Tensor& sin, double eps) {
  return g_norm_fwd[route_norm(q, k, qw, kw, cos, sin, eps, true)](q, k, qw, kw, cos, sin, eps, true);
}

void check_rstd(const Tensor& rstd, const Tensor& x, const char* name) {
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.dim() == 3 && rstd.size(0) == x.size(0) &&
                  rstd.size(1) == x.size(1) && rstd.size(2) == x.size(2),
              "qk_norm_rope backward: ", name, " must be float32 of shape [batch, heads, seq] = ",
              x.sizes().slice(0, 3), ", got ", rstd.scalar_type(), " ", rstd.sizes());
}

TensorQuad norm_bwd_router(const Tensor& gq, const Tensor& gk, const Tensor& q, const Tensor& k,
                           const Tensor& qw, const Tensor& kw, const Tensor& cos, const Tensor& sin,
                           const Tensor& q_rstd, const Tensor& k_rstd, bool weight_grad) {
  const int b = route_norm(q, k, qw, kw, cos, sin, 0.0, true);
  check_grads("qk_norm_rope", gq, gk, q, k);
  check_rstd(q_rstd, q, "q_rstd");
  check_rstd(k_rstd, k, "k_rstd");
  return g_norm_bwd[b](gq, gk, q, k, qw, kw, cos, sin, q_rstd, k_rstd, weight_grad);
}

// ---- Meta: shapes only, same checks.

Tensor dense_meta(const Tensor& t) { return at::empty_like(t, at::MemoryFormat::Contiguous); }

TensorPair rope_meta(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  CallView call;
  check_rope(q, k, cos, sin, call, false);
  return {dense_meta(q), dense_meta(k)};
}

TensorPair rope_bwd_meta(const Tensor& gq, const Tensor& gk, const Tensor& cos, const Tensor& sin) {
  return rope_meta(gq, gk, cos, sin);
}

Tensor rstd_meta(const Tensor& x) {
  return at::empty({x.size(0), x.size(1), x.size(2)}, x.options().dtype(at::kFloat));
}

TensorPair norm_meta(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                     const Tensor& cos, const Tensor& sin, double eps) {
  CallView call;
  check_norm(q, k, qw, kw, cos, sin, eps, call, false);
  return {dense_meta(q), dense_meta(k)};
}

TensorQuad norm_fwd_meta(const Tensor& q, const Tensor& k, const Tensor& qw, const Tensor& kw,
                         const Tensor& cos, const Tensor& sin, double eps) {
  auto [qo, ko] = norm_meta(q, k, qw, kw, cos, sin, eps);
  return {qo, ko, rstd_meta(q), rstd_meta(k)};
}

TensorQuad norm_bwd_meta(const Tensor& gq, const Tensor& gk, const Tensor& q, const Tensor& k,
                         const Tensor& qw, const Tensor& kw, const Tensor& cos, const Tensor& sin,
                         const Tensor&, const Tensor&, bool weight_grad) {
  CallView call;
  check_norm(q, k, qw, kw, cos, sin, 0.0, call, true);
  check_grads("qk_norm_rope", gq, gk, q, k);
  auto dw = [&](const Tensor& w) { return weight_grad ? dense_meta(w) : at::empty({0}, w.options()); };
  return {dense_meta(q), dense_meta(k), dw(qw), dw(kw)};
}

// ---- Autograd: forward and backward both go through the routers above.

auto& rope_handle() {
  static auto h = c10::Dispatcher::singleton().findSchemaOrThrow("kernelgate::rope", "")
                      .typed<TensorPair(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>();
  return h;
}

auto& rope_bwd_handle() {
  static auto h = c10::Dispatcher::singleton().findSchemaOrThrow("kernelgate::_rope_bwd", "")
                      .typed<TensorPair(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>();
  return h;
}

auto& norm_handle() {
  static auto h =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernelgate::qk_norm_rope", "")
          .typed<TensorPair(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, double)>();
  return h;
}

auto& norm_fwd_handle() {
  static auto h =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernelgate::_qk_norm_rope_fwd", "")
          .typed<TensorQuad(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, double)>();
  return h;
}

auto& norm_bwd_handle() {
  static auto h =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernelgate::_qk_norm_rope_bwd", "")
          .typed<TensorQuad(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            bool)>();
  return h;
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& k, const Tensor& cos, const Tensor& sin) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({cos, sin});
    // Shapes for an output gradient autograd does not materialise (cos has q's dtype and device).
    ctx->saved_data["q_sizes"] = q.sizes().vec();
    ctx->saved_data["k_sizes"] = k.sizes().vec();
    auto [qo, ko] = rope_handle().call(q, k, cos, sin);
    // As through the reference: an output none of whose inputs needs a gradient has none.
    if (!q.requires_grad()) ctx->mark_non_differentiable({qo});
    if (!k.requires_grad()) ctx->mark_non_differentiable({ko});
    return {qo, ko};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    if (!grads[0].defined() && !grads[1].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    auto zeros = [&](const char* key) {
      return at::zeros(ctx->saved_data[key].toIntVector(), s[0].options().memory_format(at::MemoryFormat::Contiguous));
    };
    Tensor gq = grads[0].defined() ? grads[0] : zeros("q_sizes");
    Tensor gk = grads[1].defined() ? grads[1] : zeros("k_sizes");
    auto [dq, dk] = rope_bwd_handle().call(gq, gk, s[0], s[1]);
    return {dq, dk, Tensor(), Tensor()};
  }
};

bool any_requires_grad(std::initializer_list<const Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : ts)
    if (t->requires_grad()) return true;
  return false;
}

TensorPair rope_autograd(c10::DispatchKeySet ks, const Tensor& q, const Tensor& k, const Tensor& cos,
                         const Tensor& sin) {
  if (!any_requires_grad({&q, &k})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return rope_handle().redispatch(ks & c10::after_ADInplaceOrView_keyset, q, k, cos, sin);
  }
  auto out = RopeFunction::apply(q, k, cos, sin);
  return {out[0], out[1]};
}

class NormRopeFunction : public torch::autograd::Function<NormRopeFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& k, const Tensor& qw, const Tensor& kw,
                                                const Tensor& cos, const Tensor& sin, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [qo, ko, qr, kr] = norm_fwd_handle().call(q, k, qw, kw, cos, sin, eps);
    ctx->save_for_backward({q, k, qw, kw, cos, sin, qr, kr});
    if (!q.requires_grad() && !qw.requires_grad()) ctx->mark_non_differentiable({qo});
    if (!k.requires_grad() && !kw.requires_grad()) ctx->mark_non_differentiable({ko});
    return {qo, ko};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    if (!grads[0].defined() && !grads[1].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const bool need_dw = ctx->needs_input_grad(2) || ctx->needs_input_grad(3);
    Tensor gq = grads[0].defined() ? grads[0] : at::zeros_like(s[0], at::MemoryFormat::Contiguous);
    Tensor gk = grads[1].defined() ? grads[1] : at::zeros_like(s[1], at::MemoryFormat::Contiguous);
    auto [dq, dk, dqw, dkw] = norm_bwd_handle().call(gq, gk, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], need_dw);
    return {dq, dk, ctx->needs_input_grad(2) ? dqw : Tensor(), ctx->needs_input_grad(3) ? dkw : Tensor(),
            Tensor(), Tensor(), Tensor()};
  }
};

TensorPair norm_autograd(c10::DispatchKeySet ks, const Tensor& q, const Tensor& k, const Tensor& qw,
                         const Tensor& kw, const Tensor& cos, const Tensor& sin, double eps) {
  if (!any_requires_grad({&q, &k, &qw, &kw})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return norm_handle().redispatch(ks & c10::after_ADInplaceOrView_keyset, q, k, qw, kw, cos, sin, eps);
  }
  auto out = NormRopeFunction::apply(q, k, qw, kw, cos, sin, eps);
  return {out[0], out[1]};
}

}  // namespace

// ---- contracts and registration

namespace {
void add_llm_shapes(OpContract& c) {
  // (batch, q_heads, kv_heads, seq, head_dim): Llama-3 8B (GQA 32/8), Llama-3 70B (64/8),
  // Qwen3 (GQA, head_dim 128), a long single sequence, MHA with head_dim 64.
  const int64_t shapes[][5] = {{4, 32, 8, 4096, 128}, {1, 64, 8, 8192, 128}, {8, 32, 8, 2048, 128},
                               {1, 32, 8, 32768, 128}, {16, 16, 16, 1024, 64}};
  for (const auto& s : shapes) {
    c.production_shapes.push_back({{"batch", s[0]}, {"q_heads", s[1]}, {"kv_heads", s[2]},
                                   {"seq", s[3]}, {"head_dim", s[4]}, {"cos_batch", 1}});
  }
  // cos_batch is 1 or batch; the harness varies dims one at a time, so it keeps 1.
  c.dim_ranges = {{"batch", {1, 64}},    {"q_heads", {1, 128}},  {"kv_heads", {1, 128}},
                  {"seq", {1, 65536}},   {"head_dim", {2, 512}}, {"cos_batch", {1, 1}}};
}
}  // namespace

OpContract rope_contract() {
  OpContract c;
  c.name = "rope";
  c.schema = "rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)";
  c.dims = "q: [batch, q_heads, seq, head_dim]; k: [batch, kv_heads, seq, head_dim]; "
           "cos: [cos_batch, seq, head_dim]; sin: [cos_batch, seq, head_dim]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  add_llm_shapes(c);
  c.dim_multiples = {{"head_dim", 2}};  // rope rotates two halves
  return c;
}

OpContract qk_norm_rope_contract() {
  OpContract c;
  c.name = "qk_norm_rope";
  c.source_stem = "rope";
  c.schema = "qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, "
             "Tensor sin, float eps=1e-06) -> (Tensor, Tensor)";
  c.dims = "q: [batch, q_heads, seq, head_dim]; k: [batch, kv_heads, seq, head_dim]; "
           "q_weight: [head_dim]; k_weight: [head_dim]; "
           "cos: [cos_batch, seq, head_dim]; sin: [cos_batch, seq, head_dim]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.scalar_test_values = {{"eps", {1e-6, 1e-5, 0.1}}};
  add_llm_shapes(c);
  c.dim_multiples = {{"head_dim", 2}};  // rope rotates two halves
  return c;
}

void define_rope(torch::Library& m) {
  m.def(torch::schema(rope_contract().schema.c_str()));
  m.def(torch::schema(qk_norm_rope_contract().schema.c_str()));
  m.def("_rope_reference(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("_rope_bwd(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("_qk_norm_rope_reference(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, "
        "Tensor sin, float eps=1e-06) -> (Tensor, Tensor)");
  m.def("_qk_norm_rope_fwd(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, "
        "Tensor sin, float eps) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("_qk_norm_rope_bwd(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, Tensor q_weight, "
        "Tensor k_weight, Tensor cos, Tensor sin, Tensor q_rstd, Tensor k_rstd, bool weight_grad) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
}

void register_rope_ops(Dispatcher& d) {
  g_rope = d.add_op(rope_contract(), BackendDesc{"reference", BackendKind::kReference, nullptr, nullptr});
  g_rope_fwd[0] = rope_reference_fwd;
  g_rope_bwd[0] = rope_reference_bwd;
  g_norm = d.add_op(qk_norm_rope_contract(), BackendDesc{"reference", BackendKind::kReference, nullptr, nullptr});
  g_norm_fwd[0] = norm_reference_fwd;
  g_norm_bwd[0] = norm_reference_bwd;
#ifdef KERNELGATE_WITH_CUDA
  // Typed entries first: the router may pick the backend as soon as it is published.
  g_rope_fwd[d.op(g_rope).backends.size()] = rope_cuda_fwd;
  g_rope_bwd[d.op(g_rope).backends.size()] = rope_cuda_bwd;
  d.add_backend(g_rope, {"kernelgate_cuda", BackendKind::kKernelgate, cuda_available, rope_cuda_can_implement});
  g_norm_fwd[d.op(g_norm).backends.size()] = norm_cuda_fwd;
  g_norm_bwd[d.op(g_norm).backends.size()] = norm_cuda_bwd;
  d.add_backend(g_norm, {"kernelgate_cuda", BackendKind::kKernelgate, cuda_available, norm_cuda_can_implement});
#else
  for (OpId id : {g_rope, g_norm}) {
    d.add_backend(id, {"kernelgate_cuda", BackendKind::kKernelgate,
                       [] { return Support::no("this build has no CUDA support"); },
                       [](const CallView&) { return Support::no("this build has no CUDA support"); }});
  }
#endif
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                        const at::Tensor& sin) {
  return rope_handle().call(q, k, cos, sin);
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& q_weight, const at::Tensor& k_weight,
                                                const at::Tensor& cos, const at::Tensor& sin, double eps) {
  return norm_handle().call(q, k, q_weight, k_weight, cos, sin, eps);
}

TORCH_LIBRARY_IMPL(kernelgate, CPU, m) {
  m.impl("rope", rope_router);
  m.impl("_rope_bwd", rope_bwd_router);
  m.impl("qk_norm_rope", norm_router);
  m.impl("_qk_norm_rope_fwd", norm_fwd_router);
  m.impl("_qk_norm_rope_bwd", norm_bwd_router);
}

#ifdef KERNELGATE_WITH_CUDA
TORCH_LIBRARY_IMPL(kernelgate, CUDA, m) {
  m.impl("rope", rope_router);
  m.impl("_rope_bwd", rope_bwd_router);
  m.impl("qk_norm_rope", norm_router);
  m.impl("_qk_norm_rope_fwd", norm_fwd_router);
  m.impl("_qk_norm_rope_bwd", norm_bwd_router);
}
#endif

TORCH_LIBRARY_IMPL(kernelgate, Meta, m) {
  m.impl("rope", rope_meta);
  m.impl("_rope_bwd", rope_bwd_meta);
  m.impl("qk_norm_rope", norm_meta);
  m.impl("_qk_norm_rope_fwd", norm_fwd_meta);
  m.impl("_qk_norm_rope_bwd", norm_bwd_meta);
}

TORCH_LIBRARY_IMPL(kernelgate, Autograd, m) {
  m.impl("rope", rope_autograd);
  m.impl("qk_norm_rope", norm_autograd);
}

TORCH_LIBRARY_IMPL(kernelgate, CompositeImplicitAutograd, m) {
  m.impl("_rope_reference", rope_reference_op);
  m.impl("_qk_norm_rope_reference", norm_reference_op);
}

}  // namespace kernelgate
