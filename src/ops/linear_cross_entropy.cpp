// linear_cross_entropy: cross_entropy(hidden @ weight.T + bias, target) without the float32
// logits. Contract, reference, backends (reference, kernelgate_cpu, kernelgate_cuda) and its own
// autograd (the gradients come from the forward; see below).
//
// Every backend runs one chunk loop (below) over blocks of rows:
//   logits_c = hidden_c @ weight.T (+ bias)         cuBLAS / ATen, in the input dtype
//   chunk step: row losses and lse; in training, logits_c overwritten in place with dlogits
//   grad_hidden_c = dlogits @ weight;  grad_weight += dlogits.T @ hidden_c;  grad_bias += sums
// The step is ATen (reference, kernelgate_cpu) or our CUDA kernel (kernelgate_cuda); the
// reference runs the loop as one chunk, i.e. with materialised logits.
//
// The loss is float32 whatever the input dtype, as F.cross_entropy(logits.float(), ...) gives
// it (what Hugging Face's models and Liger compute): a bfloat16 loss would move a logged loss
// curve in steps of 1/16 at 12. Its cotangent is float32 too, applied before any rounding.
//
// Training with reduction "mean" / "sum" (bfloat16, float32): the forward computes the
// gradients for a unit cotangent, and the backward scales them, in place, by the incoming
// scalar (on CUDA not at all when that scalar is exactly 1: _linear_cross_entropy_scale_).
// Reduction "none" has a per-row cotangent, and float16 must not round its gradients before the
// cotangent is applied (see LinearCrossEntropyFunction), so their backward
// (_linear_cross_entropy_bwd) recomputes each chunk's logits from the saved lse.
//
// grad_weight precision: grad_weight sums every chunk's dlogits.T @ hidden_c. Accumulated in
// the 16-bit input dtype (addmm, beta = 1) it is rounded once per chunk, and with LM target
// statistics (Zipf-like targets) its error exceeds the oracle rule (2x the materialised
// reference's error) for 8 chunks. So kernelgate_cpu / kernelgate_cuda accumulate in float32
// (cublasGemmEx: 16-bit A, B, float32 C, beta = 1) and round once: classes * hidden * 4 extra
// bytes, 2.1 GB at 128256 x 4096, half the materialised float32 logits and over the 10% memory
// target. The *_narrow_accum backends accumulate in the input dtype instead (within the memory
// target, error measured in tests/python/test_linear_cross_entropy.py): the evidence decides
// where they are correct.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <atomic>
#include <limits>

#include "kernelgate/kernelgate.h"
#include "ops/cross_entropy_common.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using ce::CeReduction;

constexpr const char* kOp = "linear_cross_entropy";

// Rows per chunk when set (> 0); tests use it to make small shapes take several chunks.
std::atomic<int64_t> g_chunk_rows_override{0};

struct GradMask {
  bool hidden = false, weight = false, bias = false;
  bool any() const { return hidden || weight || bias; }
};

struct Args {
  const Tensor& hidden;
  const Tensor& weight;
  const Tensor& target;
  const OptTensor& bias;
  int64_t ignore_index;
  double eps;
  CeReduction red;
};

// (loss, lse, grad_hidden, grad_weight, grad_bias); gradients for a unit cotangent, only for
// "mean" / "sum" and the inputs in the mask, else empty [0] tensors. lse: float32 [rows].
using Fwd = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> (*)(const Args& a, GradMask need);
// (grad_hidden, grad_weight, grad_bias) for cotangent dloss, from the forward's lse.
using Bwd = std::tuple<Tensor, Tensor, Tensor> (*)(const Tensor& dloss, const Args& a,
                                                   const Tensor& lse, GradMask need);

Tensor no_grad_tensor(const Tensor& like) { return at::empty({0}, like.options()); }

// Rows per chunk: the logits buffer (chunk x classes in the input dtype) is at most 1/16 of the
// materialised float32 logits (rows x classes x 4), or 32 MiB where that allows more (small
// problems gain nothing from small GEMMs); a multiple of 64 rows where it is large.
int64_t auto_chunk_rows(int64_t rows, int64_t classes, int64_t elem) {
  const int64_t overridden = g_chunk_rows_override.load(std::memory_order_relaxed);
  if (overridden > 0) return overridden;
  const int64_t by_budget = rows / (4 * elem);
  const int64_t by_floor = (int64_t{32} << 20) / std::max<int64_t>(1, classes * elem);
  int64_t c = std::max<int64_t>({by_budget, by_floor, 1});
  if (c >= 128) c = c / 64 * 64;
  return std::min(c, std::max<int64_t>(rows, 1));
}

struct LoopResult {
  Tensor row_loss, lse, gh, gw, gb;
};

// How a backend runs the loop.
struct Plan {
  ce::ChunkStepFn step;
  bool chunked;    // false: one chunk (materialised logits)
  bool f32_accum;  // grad_weight accumulated over chunks in float32 (see the file comment)
};

#ifdef KERNELGATE_WITH_CUDA
// out [V, H] (float32, contiguous) (+)= dl.T @ hc for 16-bit dl [c, V] and hc [c, H] with
// unit-stride rows: one cuBLAS GEMM, float32 accumulation into a float32 C (beta = 1).
// ATen's addmm with out_dtype wants C in the input dtype, so it cannot accumulate in float32.
// Column-major view: out^T [H, V] = hc^T [H, c] @ dl [c, V].
void gemm_dlt_h_f32_cuda(Tensor& out, const Tensor& dl, const Tensor& hc, bool accumulate) {
  const int64_t c = dl.size(0), classes = dl.size(1), hidden = hc.size(1);
  TORCH_INTERNAL_ASSERT(dl.stride(1) == 1 && hc.stride(1) == 1 && out.is_contiguous() &&
                        out.scalar_type() == at::kFloat && dl.scalar_type() == hc.scalar_type());
  if (classes == 0 || hidden == 0) return;
  if (c == 0) {
    if (!accumulate) out.zero_();
    return;
  }
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  TORCH_CHECK(classes <= kMax && hidden <= kMax && c <= kMax && dl.stride(0) <= kMax &&
                  hc.stride(0) <= kMax,
              kOp, ": sizes beyond 32-bit cuBLAS arguments");
  const cudaDataType_t type = dl.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  c10::cuda::CUDAGuard guard(out.device());
  const cublasStatus_t st =
      cublasGemmEx(at::cuda::getCurrentCUDABlasHandle(), CUBLAS_OP_N, CUBLAS_OP_T, int(hidden),
                   int(classes), int(c), &alpha, hc.const_data_ptr(), type, int(hc.stride(0)),
                   dl.const_data_ptr(), type, int(dl.stride(0)), &beta, out.data_ptr(), CUDA_R_32F,
                   int(hidden), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, kOp,
              ": cuBLAS GEMM for grad_weight failed: ", cublasGetStatusString(st));
}
#endif

// out (+)= dl.T @ hc, float32 accumulation and output, for 16-bit dl and hc.
void grad_weight_f32(Tensor& out, const Tensor& dl, const Tensor& hc, bool accumulate) {
#ifdef KERNELGATE_WITH_CUDA
  if (out.is_cuda()) return gemm_dlt_h_f32_cuda(out, dl, hc, accumulate);
#endif
  // ATen has no float32-output GEMM of 16-bit inputs on the CPU: upcast (exact) and multiply.
  Tensor p = at::mm(dl.t().to(at::kFloat), hc.to(at::kFloat));
  accumulate ? out.add_(p) : out.copy_(p);
}

// The chunk loop. stats: row losses and lse are computed (forward); otherwise `lse_in` is used
// (backward). grad: gradients for the mask, with cotangent dloss (undefined: 1).
LoopResult chunk_loop(const Args& a, const Plan& plan, int64_t chunk, bool stats, bool grad,
                      GradMask need, const Tensor& dloss, const Tensor& lse_in,
                      const Tensor& n_valid) {
  const Tensor h = a.hidden.contiguous(), w = a.weight.contiguous(), t = a.target.contiguous();
  const Tensor b = a.bias ? a.bias->contiguous() : Tensor();
  const int64_t rows = h.size(0), classes = w.size(0);
  const auto f32 = h.options().dtype(at::kFloat);
  LoopResult r;
  r.lse = stats ? at::empty({rows}, f32) : lse_in.contiguous();
  if (stats) r.row_loss = at::empty({rows}, f32);
  grad = grad && need.any();
  r.gh = grad && need.hidden ? at::empty_like(h) : no_grad_tensor(h);
  r.gw = no_grad_tensor(h);
  r.gb = no_grad_tensor(h);
  if (!stats && !grad) return r;  // a backward that wants no gradient
  // grad_weight's accumulator: the output itself, or float32 [classes, hidden].
  Tensor gw_acc;
  if (grad && need.weight) {
    const bool f32_acc = plan.f32_accum && h.scalar_type() != at::kFloat;
    gw_acc = at::empty(w.sizes(), f32_acc ? f32 : h.options());
    if (rows == 0) gw_acc.zero_();
  }
  Tensor gb32 = grad && need.bias && b.defined() ? at::zeros({classes}, f32) : Tensor();
  chunk = std::max<int64_t>(1, std::min(chunk, rows));
  Tensor buf = at::empty({rows == 0 ? 0 : chunk, classes}, h.options());
  const Tensor wt = w.t();
  for (int64_t s = 0; s < rows; s += chunk) {
    const int64_t n = std::min(chunk, rows - s);
    Tensor hc = h.narrow(0, s, n), lc = buf.narrow(0, 0, n);
    if (b.defined()) {
      at::addmm_out(lc, b, hc, wt);
    } else {
      at::mm_out(lc, hc, wt);
    }
    ce::ChunkStep st;
    st.logits = lc;
    st.target = t.narrow(0, s, n);
    st.lse = r.lse.narrow(0, s, n);
    if (stats) st.row_loss = r.row_loss.narrow(0, s, n);
    st.stats = stats;
    if (grad) st.grad_out = lc;  // in place: lc becomes dlogits
    if (dloss.defined()) st.dloss = dloss.dim() == 1 ? dloss.narrow(0, s, n) : dloss;
    if (a.red == CeReduction::kMean) st.n_valid = n_valid;
    st.ignore_index = a.ignore_index;
    st.label_smoothing = a.eps;
    plan.step(st);
    if (!grad) continue;
    if (need.hidden) {
      Tensor ghc = r.gh.narrow(0, s, n);
      at::mm_out(ghc, lc, w);
    }
    if (gw_acc.defined()) {
      if (gw_acc.scalar_type() == h.scalar_type()) {
        s == 0 ? at::mm_out(gw_acc, lc.t(), hc) : gw_acc.addmm_(lc.t(), hc);
      } else {
        grad_weight_f32(gw_acc, lc, hc, /*accumulate=*/s > 0);
      }
    }
    if (gb32.defined()) gb32.add_(at::sum(lc, {0}, false, at::kFloat));
  }
  if (gw_acc.defined())
    r.gw = gw_acc.scalar_type() == h.scalar_type() ? gw_acc : gw_acc.to(h.scalar_type());
  if (gb32.defined()) r.gb = gb32.to(h.scalar_type());
  return r;
}

Tensor n_valid_for(const Args& a) {
  return a.red == CeReduction::kMean ? ce::count_valid(a.target, a.ignore_index) : Tensor();
}

int64_t chunk_for(const Args& a, const Plan& plan) {
  if (!plan.chunked) return a.hidden.size(0);
  return auto_chunk_rows(a.hidden.size(0), a.weight.size(0), a.hidden.element_size());
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> loop_fwd(const Args& a, GradMask need,
                                                            const Plan& plan) {
  const Tensor n_valid = n_valid_for(a);
  const bool grad = a.red != CeReduction::kNone && need.any();
  LoopResult r = chunk_loop(a, plan, chunk_for(a, plan), /*stats=*/true, grad, need, Tensor(),
                            Tensor(), n_valid);
  Tensor loss = ce::reduce_rows(r.row_loss, a.red, n_valid);  // float32, whatever the input dtype
  return {loss, r.lse, r.gh, r.gw, r.gb};
}

std::tuple<Tensor, Tensor, Tensor> loop_bwd(const Tensor& dloss, const Args& a, const Tensor& lse,
                                            GradMask need, const Plan& plan) {
  LoopResult r = chunk_loop(a, plan, chunk_for(a, plan), /*stats=*/false, /*grad=*/true, need,
                            dloss, lse, n_valid_for(a));
  return {r.gh, r.gw, r.gb};
}

// One typed backend per plan.
template <const Plan& P>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> plan_fwd(const Args& a, GradMask need) {
  return loop_fwd(a, need, P);
}
template <const Plan& P>
std::tuple<Tensor, Tensor, Tensor> plan_bwd(const Tensor& dloss, const Args& a, const Tensor& lse,
                                            GradMask need) {
  return loop_bwd(dloss, a, lse, need, P);
}

// reference: materialised logits (one chunk), ATen step. kernelgate_cpu: chunked, ATen step.
// kernelgate_cuda: chunked, our CUDA step. The *_narrow_accum variants accumulate grad_weight in
// the input dtype: no float32 [classes, hidden] buffer, one rounding per chunk.
constexpr Plan kReference{ce::aten_chunk_step, false, false};
constexpr Plan kCpu{ce::aten_chunk_step, true, true};
constexpr Plan kCpuNarrow{ce::aten_chunk_step, true, false};

Support cpu_can_implement(const CallView& call) { return on_cpu(call, "hidden is not on the CPU"); }

#ifdef KERNELGATE_WITH_CUDA
constexpr Plan kCuda{ce::cuda_chunk_step, true, true};
constexpr Plan kCudaNarrow{ce::cuda_chunk_step, true, false};

Support cuda_can_implement(const CallView& call) {
  if (Support s = cuda_sm80(call, "hidden is not on a CUDA device"); !s.ok) return s;
  if (call.tensors[1]->size(0) > std::numeric_limits<int>::max() / 2) {
    return Support::no("more than 2^30 classes");
  }
  return Support::yes();
}
#endif

// ---- checks, shapes and the protocol (kernelgate/op.h) over the typed backends above

// Tensor arguments: hidden 0, weight 1, target 2, bias 3.
GradMask mask_of(GradRequest need) { return {need(0), need(1), need(3)}; }

using Five = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using Three = std::tuple<Tensor, Tensor, Tensor>;

template <Fwd F>
Five forward(const Tensor& hidden, const Tensor& weight, const Tensor& target,
             const OptTensor& bias, int64_t ignore_index, double eps, c10::string_view reduction,
             GradRequest need) {
  Args a{hidden, weight, target, bias, ignore_index, eps, ce::parse_reduction(kOp, reduction)};
  return F(a, mask_of(need));
}

template <Bwd B>
Three backward(const Tensor& dloss, const Tensor& hidden, const Tensor& weight,
               const Tensor& target, const OptTensor& bias, const Tensor& lse, int64_t ignore_index,
               double eps, c10::string_view reduction, GradRequest need) {
  Args a{hidden, weight, target, bias, ignore_index, eps, ce::parse_reduction(kOp, reduction)};
  const int64_t rows = hidden.size(0);
  const bool none = a.red == CeReduction::kNone;
  TORCH_CHECK(none ? (dloss.dim() == 1 && dloss.size(0) == rows) : dloss.dim() == 0, kOp,
              " backward: grad must have the loss's shape (", none ? "[rows]" : "[]", "), got ",
              dloss.sizes());
  TORCH_CHECK(dloss.scalar_type() == at::kFloat, kOp,
              " backward: grad must have the loss's dtype (float32), got ", dloss.scalar_type());
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == rows && lse.scalar_type() == at::kFloat, kOp,
              " backward: lse must be float32 [rows]");
  return B(dloss, a, lse, mask_of(need));
}

void check_args(const Tensor& hidden, const Tensor& weight, const Tensor& target, const OptTensor&,
                int64_t ignore_index, double eps, c10::string_view) {
  ce::check_scalars(kOp, "weight.size(0)", hidden.size(0), weight.size(0), eps);
  ce::check_targets_on_cpu(kOp, target, weight.size(0), ignore_index);
}

// Shapes the backends return; gradients only for "mean" / "sum" and the inputs asked for
// (undefined: the op mechanism's empty [0] tensor).
Five meta(const Tensor& hidden, const Tensor& weight, const Tensor&, const OptTensor& bias, int64_t,
          double, c10::string_view reduction, GradRequest need) {
  const bool none = ce::parse_reduction(kOp, reduction) == CeReduction::kNone;
  const GradMask m = mask_of(need);
  auto grad = [&](bool wanted, at::IntArrayRef sizes) {
    return !none && wanted ? at::empty(sizes, hidden.options()) : Tensor();
  };
  const auto f32 = hidden.options().dtype(at::kFloat);
  return {none ? at::empty({hidden.size(0)}, f32) : at::empty({}, f32), at::empty({hidden.size(0)}, f32),
          grad(m.hidden, hidden.sizes()), grad(m.weight, weight.sizes()),
          grad(m.bias && bias.has_value(), {weight.size(0)})};
}

Tensor lce_reference_op(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                        const OptTensor& bias, int64_t ignore_index, double eps,
                        c10::string_view reduction) {
  const CeReduction red = ce::parse_reduction(kOp, reduction);
  ce::check_scalars(kOp, "weight.size(0)", hidden.size(0), weight.size(0), eps);
  ce::check_targets_on_cpu(kOp, target, weight.size(0), ignore_index);
  Tensor logits = bias ? at::addmm(*bias, hidden, weight.t()) : at::mm(hidden, weight.t());
  // Logits rounded to the input dtype, the loss from them in float32 (float64 for the oracle).
  return ce::reference_loss(logits.to(at::promote_types(logits.scalar_type(), at::kFloat)), target,
                            ignore_index, eps, red);
}

int64_t set_chunk_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, kOp, ": chunk rows must be >= 0 (0: automatic), got ", rows);
  return g_chunk_rows_override.exchange(rows);
}

auto& op_handle() {
  static auto h = typed_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                  int64_t, double, c10::string_view)>(kOp);
  return h;
}

auto& fwd_handle() {
  static auto h =
      typed_op<Five(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, int64_t, double,
                    c10::string_view, int64_t)>("_linear_cross_entropy_fwd");
  return h;
}

auto& bwd_handle() {
  static auto h =
      typed_op<Three(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                     const Tensor&, int64_t, double, c10::string_view, int64_t)>(
          "_linear_cross_entropy_bwd");
  return h;
}

int64_t mask_bits(bool hidden, bool weight, bool bias) {
  return (hidden ? 1 : 0) | (weight ? 2 : 0) | (bias ? 8 : 0);
}

// grad *= cotangent (a scalar), in place: the backward of the "mean" / "sum" reductions applies
// the incoming cotangent to the gradients the forward computed. An op of its own, so that
// torch.compile and AOT autograd trace it (Meta: nothing to compute). On CUDA our kernel skips
// the pass over grad when the cotangent is exactly 1 (loss.backward()): grad_weight is
// classes x hidden, and multiplying it by 1 would cost a read and a write of all of it.
void scale_cpu(const Tensor& grad, const Tensor& cotangent) {
  if (grad.numel() > 0) grad.mul_(cotangent);
}

#ifdef KERNELGATE_WITH_CUDA
void scale_cuda(const Tensor& grad, const Tensor& cotangent) {
  if (grad.numel() == 0) return;
  if (!(grad.is_contiguous() && cotangent.numel() == 1 && cotangent.device() == grad.device() &&
        cotangent.scalar_type() == at::kFloat)) {
    grad.mul_(cotangent);
    return;
  }
  CudaContext ctx(grad);
  check_cuda(kernels::scale_unless_one_cuda(grad.data_ptr(), grad.numel(),
                                            kernel_dtype(grad.scalar_type()),
                                            cotangent.const_data_ptr<float>(), ctx.sm_count,
                                            ctx.stream),
             "linear_cross_entropy cotangent scaling");
}
#endif

void scale_meta(const Tensor&, const Tensor&) {}

auto& scale_handle() {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("kernelgate::_linear_cross_entropy_scale_", "")
                      .typed<void(const Tensor&, const Tensor&)>();
  return h;
}

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& hidden,
                        const Tensor& weight, const Tensor& target, const OptTensor& bias,
                        int64_t ignore_index, double eps, c10::string_view reduction) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const GradMask need{hidden.requires_grad(), weight.requires_grad(),
                        bias && bias->requires_grad()};
    // float16 recomputes in the backward, with the cotangent folded into dlogits before they
    // are rounded: gradients for a unit cotangent, scaled afterwards, would be rounded twice in
    // float16's subnormal range (a mean over many rows and classes puts grad_weight there), and
    // a loss-scaled cotangent would magnify that error. bfloat16 has float32's exponent range.
    const bool precomputed = ce::parse_reduction(kOp, reduction) != CeReduction::kNone &&
                             hidden.scalar_type() != at::kHalf;
    auto [loss, lse, gh, gw, gb] =
        fwd_handle().call(hidden, weight, target, bias, ignore_index, eps, reduction,
                          precomputed ? mask_bits(need.hidden, need.weight, need.bias) : 0);
    if (precomputed) {
      ctx->save_for_backward({gh, gw, gb});
    } else {
      ctx->save_for_backward({hidden, weight, target, bias.value_or(Tensor()), lse});
      ctx->saved_data["ignore_index"] = ignore_index;
      ctx->saved_data["label_smoothing"] = eps;
      ctx->saved_data["reduction"] = std::string(reduction);
    }
    ctx->saved_data["precomputed"] = precomputed;
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["consumed"] = false;
    ctx->saved_data["need"] = std::vector<bool>{need.hidden, need.weight, need.bias};
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(7);
    const Tensor& dloss = grads[0];
    if (!dloss.defined()) return out;
    // The backward is routed kernels, not ATen ops autograd could differentiate again.
    TORCH_CHECK(!at::GradMode::is_enabled(), kOp,
                ": double backward (create_graph=True) is not supported: its gradients come from "
                "fused kernels (computed in the forward for reduction 'mean' and 'sum'), which "
                "autograd cannot differentiate again");
    auto need_list = ctx->saved_data["need"].toBoolList();
    const GradMask need{need_list[0], need_list[1], need_list[2]};
    const bool precomputed = ctx->saved_data["precomputed"].toBool();
    // The forward's gradients are scaled in place: a second backward through this graph would
    // scale them again, so it is refused (before unpacking, whose version check would fire first).
    TORCH_CHECK(!precomputed || !ctx->saved_data["consumed"].toBool(), kOp,
                ": backward through the same graph twice is not supported with reduction 'mean' "
                "or 'sum' (the forward computes the gradients and the first backward consumes "
                "them); recompute the loss instead of retain_graph=True");
    auto s = ctx->get_saved_variables();
    Tensor gh, gw, gb;
    if (precomputed) {
      ctx->saved_data["consumed"] = true;
      gh = s[0], gw = s[1], gb = s[2];
      for (const Tensor* g : {&gh, &gw, &gb}) scale_handle().call(*g, dloss);
    } else {
      OptTensor bias = ctx->saved_data["has_bias"].toBool() ? OptTensor(s[3]) : std::nullopt;
      std::tie(gh, gw, gb) = bwd_handle().call(
          dloss, s[0], s[1], s[2], bias, s[4], ctx->saved_data["ignore_index"].toInt(),
          ctx->saved_data["label_smoothing"].toDouble(), ctx->saved_data["reduction"].toStringRef(),
          mask_bits(need.hidden, need.weight, need.bias));
    }
    out[0] = need.hidden ? gh : Tensor();
    out[1] = need.weight ? gw : Tensor();
    out[3] = need.bias ? gb : Tensor();
    return out;
  }
};

// ---- eager: what a user writes without kernelgate,
// F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...), the loss in float32
Tensor lce_eager(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                 const OptTensor& bias, int64_t ignore_index, double eps,
                 c10::string_view reduction) {
  return ce::eager_loss(at::linear(hidden, weight, bias).to(at::kFloat), target, ignore_index, eps,
                        ce::parse_reduction(kOp, reduction));
}

OpId lce_id();

Tensor lce_autograd(c10::DispatchKeySet ks, const Tensor& hidden, const Tensor& weight,
                    const Tensor& target, const OptTensor& bias, int64_t ignore_index, double eps,
                    c10::string_view reduction) {
  {  // where the eager backend serves, PyTorch's autograd records the plain code
    torch::jit::Stack s;
    torch::jit::push(s, hidden, weight, target, bias, ignore_index, eps, std::string(reduction));
    if (serve_eager(lce_id(), s)) return s.back().toTensor();
  }
  const bool needs_grad =
      at::GradMode::is_enabled() &&
      (hidden.requires_grad() || weight.requires_grad() || (bias && bias->requires_grad()));
  if (needs_grad) {
    return LinearCrossEntropyFunction::apply(hidden, weight, target, bias, ignore_index, eps,
                                             reduction);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return op_handle().redispatch(ks & c10::after_ADInplaceOrView_keyset, hidden, weight, target,
                                bias, ignore_index, eps, reduction);
}

OpContract contract() {
  OpContract c;
  c.name = kOp;
  c.source_stem = "linear_cross_entropy,cross_entropy";
  c.schema =
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
      "int ignore_index=-100, float label_smoothing=0.0, str reduction=\"mean\") -> Tensor";
  c.dims =
      "hidden: [rows, hidden]; weight: [classes, hidden]; target: [rows] index; bias?: [classes]";
  c.index_ranges = {{"target", "classes"}};
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.scalar_test_values = {{"label_smoothing", {0.0, 0.1}}};
  c.variant_args = {{"reduction", {"mean", "sum", "none"}}};  // order: CeReduction
  c.dim_ranges = {{"rows", {0, 65536}}, {"hidden", {1, 16384}}, {"classes", {1, 262144}}};
  c.production_shapes = {{{"rows", 8192}, {"hidden", 4096}, {"classes", 128256}},
                         {{"rows", 4096}, {"hidden", 4096}, {"classes", 128256}},
                         {{"rows", 8192}, {"hidden", 3584}, {"classes", 152064}},
                         {{"rows", 8192}, {"hidden", 2048}, {"classes", 32000}},
                         {{"rows", 8192}, {"hidden", 2048}, {"classes", 128256}}};
  c.production_optionals = {false};  // an lm_head has no bias
  c.outputs = {"loss"};
  // The forward's gradients for a unit cotangent ("mean" / "sum" in training; see
  // LinearCrossEntropyFunction), and the lse that a recomputing backward reads.
  c.extras = {"lse", "grad_hidden", "grad_weight", "grad_bias"};
  c.saved = {"hidden", "weight", "target", "bias", "lse"};
  return c;
}

// Helper ops: the backward's in-place cotangent scaling, and the chunk size tests set.
void define_helpers(torch::Library& lib) {
  lib.def("_linear_cross_entropy_scale_(Tensor(a!) grad, Tensor cotangent) -> ()");
  // Tests: rows per chunk of the chunked backends (0: automatic); returns the previous value.
  lib.def("_linear_cross_entropy_set_chunk_rows(int rows) -> int", &set_chunk_rows);
  lib.impl("_linear_cross_entropy_scale_",
           torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(scale_cpu)));
#ifdef KERNELGATE_WITH_CUDA
  lib.impl("_linear_cross_entropy_scale_",
           torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(scale_cuda)));
#endif
  lib.impl("_linear_cross_entropy_scale_",
           torch::dispatch(c10::DispatchKey::Meta, TORCH_FN(scale_meta)));
  lib.impl(kOp, torch::dispatch(c10::DispatchKey::Autograd, TORCH_FN(lce_autograd)));
}

const OpId kOpId =
    OpDeclaration(contract())
        .reference(lce_reference_op)
        .eager(lce_eager)
        .meta(meta)
        .check(check_args)
        .backend("reference", BackendKind::kReference, forward<plan_fwd<kReference>>,
                 backward<plan_bwd<kReference>>)
        .backend("kernelgate_cpu", BackendKind::kKernelgate, forward<plan_fwd<kCpu>>,
                 backward<plan_bwd<kCpu>>, cpu_can_implement)
        .backend("kernelgate_cpu_narrow_accum", BackendKind::kKernelgate,
                 forward<plan_fwd<kCpuNarrow>>, backward<plan_bwd<kCpuNarrow>>, cpu_can_implement)
#ifdef KERNELGATE_WITH_CUDA
        .backend("kernelgate_cuda", BackendKind::kKernelgate, forward<plan_fwd<kCuda>>,
                 backward<plan_bwd<kCuda>>, cuda_can_implement, cuda_available)
        .backend("kernelgate_cuda_narrow_accum", BackendKind::kKernelgate,
                 forward<plan_fwd<kCudaNarrow>>, backward<plan_bwd<kCudaNarrow>>,
                 cuda_can_implement, cuda_available)
#else
        .unavailable("kernelgate_cuda", BackendKind::kKernelgate, kNoCudaBuild)
        .unavailable("kernelgate_cuda_narrow_accum", BackendKind::kKernelgate, kNoCudaBuild)
#endif
        .custom_autograd(define_helpers)
        .install();

OpId lce_id() { return kOpId; }

}  // namespace

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& target, const std::optional<at::Tensor>& bias,
                                int64_t ignore_index, double label_smoothing,
                                c10::string_view reduction) {
  return op_handle().call(hidden, weight, target, bias, ignore_index, label_smoothing, reduction);
}

}  // namespace kernelgate
