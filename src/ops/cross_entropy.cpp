// cross_entropy: contract, the shared reference math and chunk steps (ops/cross_entropy_common.h),
// backends (reference, kernelgate_cuda), routers, Meta and autograd.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "kernelgate/dispatch.h"
#include "kernelgate/kernelgate.h"
#include "kernels/cross_entropy.h"
#include "ops/cross_entropy_common.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace ce {

using at::Tensor;

CeReduction parse_reduction(const char* op, c10::string_view reduction) {
  if (reduction == "mean") return CeReduction::kMean;
  if (reduction == "sum") return CeReduction::kSum;
  if (reduction == "none") return CeReduction::kNone;
  TORCH_CHECK(false, op, ": reduction must be 'mean', 'sum' or 'none', got '", reduction, "'");
}

void check_scalars(const char* op, const char* classes_where, int64_t rows, int64_t classes,
                   double label_smoothing) {
  TORCH_CHECK(classes >= 1 || rows == 0, op, ": ", classes_where,
              " (classes) must be at least 1, got 0");
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op,
              ": label_smoothing must be in [0, 1], got ", number(label_smoothing));
}

void check_targets_on_cpu(const char* op, const Tensor& target, int64_t classes,
                          int64_t ignore_index) {
  if (!target.is_cpu() || target.numel() == 0) return;
  Tensor bad = (target != ignore_index) & ((target < 0) | (target >= classes));
  if (!bad.any().item<bool>()) return;
  const int64_t row = bad.nonzero()[0][0].item<int64_t>();
  TORCH_CHECK(false, op, ": target[", row, "] = ", target[row].item<int64_t>(),
              " is out of range: expected 0 <= target < ", classes, " (classes) or ignore_index (",
              ignore_index, ")");
}

namespace {

Tensor in_dtype(const Tensor& t, at::ScalarType s) { return t.scalar_type() == s ? t : t.to(s); }

// Per row: the target (0 where it cannot index), whether it counts, whether it is in range, and
// the loss of a row whose target is not in range (0 when ignored, NaN otherwise).
struct Rows {
  Tensor safe_target, in_range, fill;
};

Rows classify(const Tensor& target, int64_t classes, int64_t ignore_index, at::ScalarType acc) {
  Tensor t = target.to(at::kLong);
  Tensor valid = t != ignore_index;
  Tensor in_range = valid & (t >= 0) & (t < classes);
  Tensor fill = at::where(valid, std::numeric_limits<double>::quiet_NaN(), 0.0).to(acc);
  return {at::where(in_range, t, 0), in_range, fill};
}

// lse, and the loss of in-range rows: lse - (1 - e) x[t] - (e / C) sum(x).
std::tuple<Tensor, Tensor> row_math(const Tensor& x, const Rows& r, double eps) {
  const int64_t classes = x.size(1);
  Tensor lse = at::logsumexp(x, {1});
  Tensor xt = x.gather(1, r.safe_target.unsqueeze(1)).squeeze(1);
  Tensor loss = lse - (1.0 - eps) * xt;
  // Skipped at e == 0: -inf logits would make 0 * -inf = NaN.
  if (eps > 0) loss = loss - (eps / double(classes)) * x.sum(1);
  return {lse, loss};
}

}  // namespace

Tensor unit_stride_rows(const Tensor& x) { return x.stride(1) == 1 ? x : x.contiguous(); }

Tensor count_valid(const Tensor& target, int64_t ignore_index) {
  return (target != ignore_index).sum().to(at::kFloat);
}

Tensor reduce_rows(const Tensor& row_loss, CeReduction reduction, const Tensor& n_valid) {
  switch (reduction) {
    case CeReduction::kNone: return row_loss;
    case CeReduction::kSum: return row_loss.sum();
    case CeReduction::kMean: return row_loss.sum() / n_valid;  // 0 / 0 = NaN: all rows ignored
  }
  return row_loss;
}

Tensor reference_loss(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                      double label_smoothing, CeReduction reduction) {
  const auto acc = at::promote_types(logits.scalar_type(), at::kFloat);
  Tensor x = in_dtype(logits, acc);
  Rows r = classify(target, logits.size(1), ignore_index, acc);
  // The loss does not depend on ignored rows, so their gradient is exactly 0 whatever their
  // logits hold: masked before the math, autograd gives them 0 rather than 0 * NaN
  // (F.cross_entropy's gradient is NaN on an ignored row holding a NaN or an Inf).
  const Tensor ignored = (target.to(at::kLong) == ignore_index).unsqueeze(1);
  x = at::where(ignored, at::zeros({}, x.options()), x);
  auto [lse, loss] = row_math(x, r, label_smoothing);
  loss = at::where(r.in_range, loss, r.fill);
  Tensor out = reduction == CeReduction::kNone ? loss
               : reduction == CeReduction::kSum ? loss.sum()
                                                : loss.sum() / (target != ignore_index).sum();
  return in_dtype(out, logits.scalar_type());
}

void aten_chunk_step(const ChunkStep& s) {
  const int64_t n = s.logits.size(0), classes = s.logits.size(1);
  const double eps = s.label_smoothing;
  Tensor x = in_dtype(s.logits, at::kFloat);
  Rows r = classify(s.target, classes, s.ignore_index, at::kFloat);
  Tensor lse = s.lse;
  if (s.stats) {
    auto [l, loss] = row_math(x, r, eps);
    if (s.row_loss.defined()) s.row_loss.copy_(at::where(r.in_range, loss, r.fill));
    lse.copy_(at::where(r.in_range, l, r.fill));
  }
  if (!s.grad_out.defined()) return;
  Tensor p = at::exp(x - lse.unsqueeze(1));
  if (eps > 0) p = p - eps / double(classes);
  p = p.scatter_add(1, r.safe_target.unsqueeze(1), at::full({n, 1}, eps - 1.0, p.options()));
  Tensor scale = s.dloss.defined() ? s.dloss.to(at::kFloat).expand({n}) : at::ones({n}, p.options());
  if (s.n_valid.defined()) scale = scale / s.n_valid;
  s.grad_out.copy_(at::where(r.in_range.unsqueeze(1), p * scale.unsqueeze(1), r.fill.unsqueeze(1)));
}

#ifdef KERNELGATE_WITH_CUDA
void cuda_chunk_step(const ChunkStep& s) {
  TORCH_INTERNAL_ASSERT(s.logits.stride(1) == 1 && s.target.is_contiguous() && s.lse.is_contiguous());
  CudaContext ctx(s.logits);
  kernels::CeRowsArgs a;
  Tensor dloss = s.dloss.defined() ? s.dloss.contiguous() : Tensor();
  if (s.grad_out.defined()) {
    TORCH_INTERNAL_ASSERT(s.grad_out.stride(1) == 1);
    a.grad = s.grad_out.data_ptr();
    a.grad_row_stride = s.grad_out.stride(0);
  }
  a.row_loss = s.row_loss.defined() ? s.row_loss.data_ptr<float>() : nullptr;
  a.lse = s.lse.data_ptr<float>();
  a.logits = s.logits.const_data_ptr();
  a.target = s.target.const_data_ptr();
  a.dloss = dloss.defined() ? dloss.const_data_ptr() : nullptr;
  a.dloss_per_row = dloss.defined() && dloss.dim() == 1;
  a.n_valid = s.n_valid.defined() ? s.n_valid.const_data_ptr<float>() : nullptr;
  a.rows = s.logits.size(0);
  a.classes = s.logits.size(1);
  a.logits_row_stride = s.logits.stride(0);
  a.ignore_index = s.ignore_index;
  a.label_smoothing = static_cast<float>(s.label_smoothing);
  a.dtype = kernel_dtype(s.logits.scalar_type());
  a.target_int32 = s.target.scalar_type() == at::kInt;
  a.compute_stats = s.stats;
  check_cuda(kernels::cross_entropy_rows_cuda(a, ctx.stream), "cross_entropy rows");
}
#endif

}  // namespace ce

namespace {

using at::Tensor;
using ce::CeReduction;

// A typed backend. Forward: (loss, lse, n_valid), lse float32 [rows] and n_valid a float32
// scalar, both only when want_stats (else undefined). Backward: d loss / d logits.
using CeFwd = std::tuple<Tensor, Tensor, Tensor> (*)(const Tensor& logits, const Tensor& target,
                                                     int64_t ignore_index, double eps,
                                                     CeReduction red, bool want_stats);
using CeBwd = Tensor (*)(const Tensor& dloss, const Tensor& logits, const Tensor& target,
                         const Tensor& lse, const Tensor& n_valid, int64_t ignore_index, double eps,
                         CeReduction red);

OpId g_op = kNoOp;
std::array<CeFwd, kMaxBackends> g_fwd{};
std::array<CeBwd, kMaxBackends> g_bwd{};
constexpr const char* kOp = "cross_entropy";

Tensor rows_f32(const Tensor& logits) {
  return at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
}

// ---- reference: the ATen chunk step over all rows (float32 math).

std::tuple<Tensor, Tensor, Tensor> reference_fwd(const Tensor& logits, const Tensor& target,
                                                 int64_t ignore_index, double eps, CeReduction red,
                                                 bool want_stats) {
  ce::ChunkStep s;
  s.logits = logits;
  s.target = target;
  s.row_loss = rows_f32(logits);
  s.lse = rows_f32(logits);
  s.ignore_index = ignore_index;
  s.label_smoothing = eps;
  ce::aten_chunk_step(s);
  Tensor n_valid = ce::count_valid(target, ignore_index);
  Tensor loss = ce::reduce_rows(s.row_loss, red, n_valid).to(logits.scalar_type());
  if (!want_stats) return {loss, Tensor(), Tensor()};
  return {loss, s.lse, n_valid};
}

// The backward of every backend: one gradient step over all rows into a new contiguous
// gradient, from the forward's lse; `step` gets logits, target and lse as the caller gives them.
Tensor grad_step(ce::ChunkStepFn step, const Tensor& dloss, const Tensor& logits,
                 const Tensor& target, const Tensor& lse, const Tensor& n_valid,
                 int64_t ignore_index, double eps, CeReduction red) {
  ce::ChunkStep s;
  s.logits = logits;
  s.target = target;
  s.lse = lse;
  s.stats = false;
  s.grad_out = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  s.dloss = dloss;
  if (red == CeReduction::kMean) s.n_valid = n_valid;
  s.ignore_index = ignore_index;
  s.label_smoothing = eps;
  step(s);
  return s.grad_out;
}

Tensor reference_bwd(const Tensor& dloss, const Tensor& logits, const Tensor& target,
                     const Tensor& lse, const Tensor& n_valid, int64_t ignore_index, double eps,
                     CeReduction red) {
  return grad_step(ce::aten_chunk_step, dloss, logits, target, lse, n_valid, ignore_index, eps, red);
}

// ---- kernelgate_cuda

#ifdef KERNELGATE_WITH_CUDA
std::tuple<Tensor, Tensor, Tensor> cuda_fwd(const Tensor& logits, const Tensor& target,
                                            int64_t ignore_index, double eps, CeReduction red,
                                            bool want_stats) {
  CudaContext ctx(logits);
  Tensor x = ce::unit_stride_rows(logits);
  Tensor t = target.contiguous();
  const int64_t rows = logits.size(0);
  const bool none = red == CeReduction::kNone;
  Tensor loss = none ? at::empty({rows}, logits.options()) : at::empty({}, logits.options());
  Tensor row_loss = none ? Tensor() : rows_f32(logits);
  Tensor lse = want_stats ? rows_f32(logits) : Tensor();
  Tensor n_valid = want_stats ? at::empty({}, logits.options().dtype(at::kFloat)) : Tensor();
  kernels::CeRowsArgs a;
  a.loss_out = none ? loss.data_ptr() : nullptr;
  a.row_loss = none ? nullptr : row_loss.data_ptr<float>();
  a.lse = want_stats ? lse.data_ptr<float>() : nullptr;
  a.logits = x.const_data_ptr();
  a.target = t.const_data_ptr();
  a.rows = rows;
  a.classes = logits.size(1);
  a.logits_row_stride = x.stride(0);
  a.ignore_index = ignore_index;
  a.label_smoothing = static_cast<float>(eps);
  a.dtype = kernel_dtype(logits.scalar_type());
  a.target_int32 = t.scalar_type() == at::kInt;
  check_cuda(kernels::cross_entropy_rows_cuda(a, ctx.stream), "cross_entropy forward");
  check_cuda(kernels::cross_entropy_reduce_cuda(
                 none ? nullptr : loss.data_ptr(), want_stats ? n_valid.data_ptr<float>() : nullptr,
                 none ? nullptr : row_loss.const_data_ptr<float>(), t.const_data_ptr(),
                 a.target_int32, rows, ignore_index, red, a.dtype, ctx.stream),
             "cross_entropy reduction");
  return {loss, lse, n_valid};
}

Tensor cuda_bwd(const Tensor& dloss, const Tensor& logits, const Tensor& target, const Tensor& lse,
                const Tensor& n_valid, int64_t ignore_index, double eps, CeReduction red) {
  return grad_step(ce::cuda_chunk_step, dloss, ce::unit_stride_rows(logits), target.contiguous(),
                   lse.contiguous(), n_valid, ignore_index, eps, red);
}

Support cuda_can_implement(const CallView& call) {
  const Tensor& x = *call.tensors[0];
  if (!x.is_cuda()) return Support::no("logits is not on a CUDA device");
  if (cuda_arch(x.get_device()) < 80) return Support::no("needs compute capability 8.0 or newer");
  if (x.size(1) > std::numeric_limits<int>::max() / 2) return Support::no("more than 2^30 classes");
  return Support::yes();
}
#endif

// ---- routers, Meta, autograd

CallView make_call(const Tensor& logits, const Tensor& target, CeReduction red, bool grad) {
  CallView call;
  call.num_tensors = 2;
  call.tensors = {&logits, &target};
  call.grad = grad;
  call.variant = static_cast<uint16_t>(red);  // the order of variant_args' reduction values
  return call;
}

const OpContract& contract() { return Dispatcher::get().op(g_op).contract; }

void check_call_and_scalars(const CallView& call, int64_t ignore_index, double eps) {
  check_call(contract(), call);
  const Tensor& logits = *call.tensors[0];
  ce::check_scalars(kOp, "logits.size(1)", logits.size(0), logits.size(1), eps);
  ce::check_targets_on_cpu(kOp, *call.tensors[1], logits.size(1), ignore_index);
}

int route(const Tensor& logits, const Tensor& target, int64_t ignore_index, double eps,
          CeReduction red, bool grad) {
  CallView call = make_call(logits, target, red, grad);
  BoundDims dims = check_call(contract(), call);
  ce::check_scalars(kOp, "logits.size(1)", logits.size(0), logits.size(1), eps);
  ce::check_targets_on_cpu(kOp, target, logits.size(1), ignore_index);
  return Dispatcher::get().select(g_op, call, dims);
}

Tensor ce_router(const Tensor& logits, const Tensor& target, int64_t ignore_index, double eps,
                 c10::string_view reduction) {
  const CeReduction red = ce::parse_reduction(kOp, reduction);
  const int b = route(logits, target, ignore_index, eps, red, /*grad=*/false);
  return std::get<0>(g_fwd[b](logits, target, ignore_index, eps, red, /*want_stats=*/false));
}

std::tuple<Tensor, Tensor, Tensor> ce_fwd_router(const Tensor& logits, const Tensor& target,
                                                 int64_t ignore_index, double eps,
                                                 c10::string_view reduction) {
  const CeReduction red = ce::parse_reduction(kOp, reduction);
  const int b = route(logits, target, ignore_index, eps, red, /*grad=*/true);
  return g_fwd[b](logits, target, ignore_index, eps, red, /*want_stats=*/true);
}

void check_bwd_args(const Tensor& dloss, const Tensor& logits, const Tensor& lse, CeReduction red) {
  const bool none = red == CeReduction::kNone;
  TORCH_CHECK(none ? (dloss.dim() == 1 && dloss.size(0) == logits.size(0)) : dloss.dim() == 0, kOp,
              " backward: grad must have the loss's shape (", none ? "[rows]" : "[]", "), got ",
              dloss.sizes());
  TORCH_CHECK(dloss.scalar_type() == logits.scalar_type(), kOp, " backward: grad must have dtype ",
              logits.scalar_type(), ", got ", dloss.scalar_type());
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == logits.size(0) && lse.scalar_type() == at::kFloat,
              kOp, " backward: lse must be float32 [rows]");
}

Tensor ce_bwd_router(const Tensor& dloss, const Tensor& logits, const Tensor& target,
                     const Tensor& lse, const Tensor& n_valid, int64_t ignore_index, double eps,
                     c10::string_view reduction) {
  const CeReduction red = ce::parse_reduction(kOp, reduction);
  check_bwd_args(dloss, logits, lse, red);
  const int b = route(logits, target, ignore_index, eps, red, /*grad=*/true);
  return g_bwd[b](dloss, logits, target, lse, n_valid, ignore_index, eps, red);
}

Tensor loss_meta(const Tensor& logits, CeReduction red) {
  return red == CeReduction::kNone ? at::empty({logits.size(0)}, logits.options())
                                   : at::empty({}, logits.options());
}

Tensor ce_meta(const Tensor& logits, const Tensor& target, int64_t ignore_index, double eps,
               c10::string_view reduction) {
  const CeReduction red = ce::parse_reduction(kOp, reduction);
  check_call_and_scalars(make_call(logits, target, red, false), ignore_index, eps);
  return loss_meta(logits, red);
}

std::tuple<Tensor, Tensor, Tensor> ce_fwd_meta(const Tensor& logits, const Tensor& target,
                                               int64_t ignore_index, double eps,
                                               c10::string_view reduction) {
  Tensor loss = ce_meta(logits, target, ignore_index, eps, reduction);
  return {loss, rows_f32(logits), at::empty({}, logits.options().dtype(at::kFloat))};
}

Tensor ce_bwd_meta(const Tensor& dloss, const Tensor& logits, const Tensor& target,
                   const Tensor& lse, const Tensor& n_valid, int64_t ignore_index, double eps,
                   c10::string_view reduction) {
  check_bwd_args(dloss, logits, lse, ce::parse_reduction(kOp, reduction));
  return at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
}

Tensor ce_reference_op(const Tensor& logits, const Tensor& target, int64_t ignore_index, double eps,
                       c10::string_view reduction) {
  const CeReduction red = ce::parse_reduction(kOp, reduction);
  ce::check_scalars(kOp, "logits.size(1)", logits.size(0), logits.size(1), eps);
  ce::check_targets_on_cpu(kOp, target, logits.size(1), ignore_index);
  return ce::reference_loss(logits, target, ignore_index, eps, red);
}

auto& op_handle() {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("kernelgate::cross_entropy", "")
                      .typed<Tensor(const Tensor&, const Tensor&, int64_t, double, c10::string_view)>();
  return h;
}

auto& fwd_handle() {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("kernelgate::_cross_entropy_fwd", "")
                      .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, int64_t,
                                                                double, c10::string_view)>();
  return h;
}

auto& bwd_handle() {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("kernelgate::_cross_entropy_bwd", "")
                      .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                    const Tensor&, int64_t, double, c10::string_view)>();
  return h;
}

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& logits,
                        const Tensor& target, int64_t ignore_index, double eps,
                        c10::string_view reduction) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, lse, n_valid] = fwd_handle().call(logits, target, ignore_index, eps, reduction);
    ctx->save_for_backward({logits, target, lse, n_valid});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = eps;
    ctx->saved_data["reduction"] = std::string(reduction);
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    auto s = ctx->get_saved_variables();
    Tensor dlogits = bwd_handle().call(grads[0], s[0], s[1], s[2], s[3],
                                       ctx->saved_data["ignore_index"].toInt(),
                                       ctx->saved_data["label_smoothing"].toDouble(),
                                       ctx->saved_data["reduction"].toStringRef());
    return {dlogits, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor ce_autograd(c10::DispatchKeySet ks, const Tensor& logits, const Tensor& target,
                   int64_t ignore_index, double eps, c10::string_view reduction) {
  if (at::GradMode::is_enabled() && logits.requires_grad()) {
    return CrossEntropyFunction::apply(logits, target, ignore_index, eps, reduction);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return op_handle().redispatch(ks & c10::after_ADInplaceOrView_keyset, logits, target,
                                ignore_index, eps, reduction);
}

}  // namespace

OpContract cross_entropy_contract() {
  OpContract c;
  c.name = kOp;
  c.schema =
      "cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0, "
      "str reduction=\"mean\") -> Tensor";
  c.dims = "logits: [rows, classes]; target: [rows] index";
  c.index_ranges = {{"target", "classes"}};
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  c.scalar_test_values = {{"label_smoothing", {0.0, 0.1, 1.0}}};
  c.variant_args = {{"reduction", {"mean", "sum", "none"}}};  // order: CeReduction
  c.dim_ranges = {{"rows", {0, 65536}}, {"classes", {1, 262144}}};
  for (int64_t rows : {8192, 4096, 16384}) {
    for (int64_t classes : {128256, 151936, 32000}) {
      c.production_shapes.push_back({{"rows", rows}, {"classes", classes}});
    }
  }
  return c;
}

void define_cross_entropy(torch::Library& m) {
  m.def(torch::schema(cross_entropy_contract().schema.c_str()));
  m.def("_cross_entropy_reference(Tensor logits, Tensor target, int ignore_index=-100, "
        "float label_smoothing=0.0, str reduction=\"mean\") -> Tensor");
  m.def("_cross_entropy_fwd(Tensor logits, Tensor target, int ignore_index, float label_smoothing, "
        "str reduction) -> (Tensor, Tensor, Tensor)");
  m.def("_cross_entropy_bwd(Tensor grad, Tensor logits, Tensor target, Tensor lse, Tensor n_valid, "
        "int ignore_index, float label_smoothing, str reduction) -> Tensor");
}

void register_cross_entropy(Dispatcher& d) {
  g_op = d.add_op(cross_entropy_contract(),
                  BackendDesc{"reference", BackendKind::kReference, nullptr, nullptr});
  g_fwd[0] = reference_fwd;
  g_bwd[0] = reference_bwd;
  const size_t index = d.op(g_op).backends.size();
#ifdef KERNELGATE_WITH_CUDA
  // Typed entries first: the router may pick the backend as soon as it is published.
  g_fwd[index] = cuda_fwd;
  g_bwd[index] = cuda_bwd;
  d.add_backend(g_op, {"kernelgate_cuda", BackendKind::kKernelgate, cuda_available, cuda_can_implement});
#else
  g_fwd[index] = reference_fwd;
  g_bwd[index] = reference_bwd;
  d.add_backend(g_op, {"kernelgate_cuda", BackendKind::kKernelgate,
                       [] { return Support::no("this build has no CUDA support"); },
                       [](const CallView&) { return Support::no("this build has no CUDA support"); }});
#endif
}

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                         double label_smoothing, c10::string_view reduction) {
  return op_handle().call(logits, target, ignore_index, label_smoothing, reduction);
}

TORCH_LIBRARY_IMPL(kernelgate, CPU, m) {
  m.impl("cross_entropy", ce_router);
  m.impl("_cross_entropy_fwd", ce_fwd_router);
  m.impl("_cross_entropy_bwd", ce_bwd_router);
}

#ifdef KERNELGATE_WITH_CUDA
TORCH_LIBRARY_IMPL(kernelgate, CUDA, m) {
  m.impl("cross_entropy", ce_router);
  m.impl("_cross_entropy_fwd", ce_fwd_router);
  m.impl("_cross_entropy_bwd", ce_bwd_router);
}
#endif

TORCH_LIBRARY_IMPL(kernelgate, Meta, m) {
  m.impl("cross_entropy", ce_meta);
  m.impl("_cross_entropy_fwd", ce_fwd_meta);
  m.impl("_cross_entropy_bwd", ce_bwd_meta);
}

TORCH_LIBRARY_IMPL(kernelgate, Autograd, m) { m.impl("cross_entropy", ce_autograd); }

TORCH_LIBRARY_IMPL(kernelgate, CompositeImplicitAutograd, m) {
  m.impl("_cross_entropy_reference", ce_reference_op);
}

}  // namespace kernelgate
