// cross_entropy: contract, the shared reference math and chunk steps (ops/cross_entropy_common.h),
// backends (reference, kernelgate_cuda).
#include <ATen/ATen.h>

#include <cmath>
#include <limits>

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
  // A tensor being traced (torch.compile's fake and functional tensors) has no values to read.
  const auto keys = target.key_set();
  if (keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::Functionalize) ||
      !target.unsafeGetTensorImpl()->has_storage()) {
    return;
  }
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
  Tensor out = reduction == CeReduction::kNone  ? loss
               : reduction == CeReduction::kSum ? loss.sum()
                                                : loss.sum() / (target != ignore_index).sum();
  return in_dtype(out, logits.scalar_type());
}

Tensor eager_loss(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                  double label_smoothing, CeReduction reduction) {
  const int64_t classes = logits.size(1);
  const Tensor t = target.to(at::kLong);
  const Tensor bad = (t != ignore_index) & ((t < 0) | (t >= classes));
  // PyTorch asserts on the device for such a target: it goes in as ignored, its row made NaN.
  const Tensor safe = at::where(bad, at::full({}, ignore_index, t.options()), t);
  const int64_t red = reduction == CeReduction::kNone  ? at::Reduction::None
                      : reduction == CeReduction::kSum ? at::Reduction::Sum
                                                       : at::Reduction::Mean;
  Tensor loss = at::cross_entropy_loss(logits.to(at::kFloat), safe, {}, red, ignore_index,
                                       label_smoothing);
  const Tensor nan = at::full({}, std::numeric_limits<float>::quiet_NaN(), loss.options());
  if (reduction == CeReduction::kNone) {
    loss = at::where(bad, nan, loss);
  } else {
    // mean's count includes such rows, as every backend's does: the loss is NaN either way.
    loss = at::where(bad.any(), nan, loss);
  }
  return loss.to(logits.scalar_type());
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
  Tensor scale =
      s.dloss.defined() ? s.dloss.to(at::kFloat).expand({n}) : at::ones({n}, p.options());
  if (s.n_valid.defined()) scale = scale / s.n_valid;
  s.grad_out.copy_(at::where(r.in_range.unsqueeze(1), p * scale.unsqueeze(1), r.fill.unsqueeze(1)));
}

#ifdef KERNELGATE_WITH_CUDA
void cuda_chunk_step(const ChunkStep& s) {
  TORCH_INTERNAL_ASSERT(s.logits.stride(1) == 1 && s.target.is_contiguous() &&
                        s.lse.is_contiguous());
  CudaContext ctx(s.logits);
  kernels::CeRowsArgs a;
  Tensor dloss = s.dloss.defined() ? s.dloss.to(at::kFloat).contiguous() : Tensor();
  if (s.grad_out.defined()) {
    TORCH_INTERNAL_ASSERT(s.grad_out.stride(1) == 1);
    a.grad = s.grad_out.data_ptr();
    a.grad_row_stride = s.grad_out.stride(0);
  }
  a.row_loss = s.row_loss.defined() ? s.row_loss.data_ptr<float>() : nullptr;
  a.lse = s.lse.data_ptr<float>();
  a.logits = s.logits.const_data_ptr();
  a.target = s.target.const_data_ptr();
  a.dloss = dloss.defined() ? dloss.const_data_ptr<float>() : nullptr;
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
  s.grad_out =
      at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
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
  return grad_step(ce::aten_chunk_step, dloss, logits, target, lse, n_valid, ignore_index, eps,
                   red);
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
  if (Support s = cuda_sm80(call, "logits is not on a CUDA device"); !s.ok) return s;
  const Tensor& x = *call.tensors[0];
  if (x.size(1) > std::numeric_limits<int>::max() / 2) return Support::no("more than 2^30 classes");
  return Support::yes();
}
#endif

// ---- checks, shapes and the protocol

using Triple = std::tuple<Tensor, Tensor, Tensor>;

template <CeFwd F>
Triple forward(const Tensor& logits, const Tensor& target, int64_t ignore_index, double eps,
               c10::string_view reduction, GradRequest need) {
  return F(logits, target, ignore_index, eps, ce::parse_reduction(kOp, reduction), need.any());
}

template <CeBwd B>
Tensor backward(const Tensor& dloss, const Tensor& logits, const Tensor& target, const Tensor& lse,
                const Tensor& n_valid, int64_t ignore_index, double eps, c10::string_view reduction,
                GradRequest) {
  return B(dloss, logits, target, lse, n_valid, ignore_index, eps,
           ce::parse_reduction(kOp, reduction));
}

void check_args(const Tensor& logits, const Tensor& target, int64_t ignore_index, double eps,
                c10::string_view) {
  ce::check_scalars(kOp, "logits.size(1)", logits.size(0), logits.size(1), eps);
  ce::check_targets_on_cpu(kOp, target, logits.size(1), ignore_index);
}

Triple meta(const Tensor& logits, const Tensor&, int64_t, double, c10::string_view reduction) {
  Tensor loss = ce::parse_reduction(kOp, reduction) == CeReduction::kNone
                    ? at::empty({logits.size(0)}, logits.options())
                    : at::empty({}, logits.options());
  return {loss, rows_f32(logits), at::empty({}, logits.options().dtype(at::kFloat))};
}

Tensor ce_reference_op(const Tensor& logits, const Tensor& target, int64_t ignore_index, double eps,
                       c10::string_view reduction) {
  const CeReduction red = ce::parse_reduction(kOp, reduction);
  ce::check_scalars(kOp, "logits.size(1)", logits.size(0), logits.size(1), eps);
  ce::check_targets_on_cpu(kOp, target, logits.size(1), ignore_index);
  return ce::reference_loss(logits, target, ignore_index, eps, red);
}

OpContract contract() {
  OpContract c;
  c.name = kOp;
  c.schema =
      "cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, float "
      "label_smoothing=0.0, "
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
  c.outputs = {"loss"};
  // lse: float32 [rows]; n_valid: the float32 count of rows not ignored.
  c.extras = {"lse", "n_valid"};
  c.saved = {"logits", "target", "lse", "n_valid"};
  return c;
}

// ---- eager: what a user writes without kernelgate
Tensor ce_eager(const Tensor& logits, const Tensor& target, int64_t ignore_index, double eps,
                c10::string_view reduction) {
  return ce::eager_loss(logits, target, ignore_index, eps, ce::parse_reduction(kOp, reduction));
}

const OpId kOpId = OpDeclaration(contract())
                       .reference(ce_reference_op)
                       .eager(ce_eager)
                       .meta(meta)
                       .check(check_args)
                       .backend("reference", BackendKind::kReference, forward<reference_fwd>,
                                backward<reference_bwd>)
#ifdef KERNELGATE_WITH_CUDA
                       .backend("kernelgate_cuda", BackendKind::kKernelgate, forward<cuda_fwd>,
                                backward<cuda_bwd>, cuda_can_implement, cuda_available)
#else
                       .unavailable("kernelgate_cuda", BackendKind::kKernelgate, kNoCudaBuild)
#endif
                       .install();

}  // namespace

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                         double label_smoothing, c10::string_view reduction) {
  static const auto op =
      typed_op<Tensor(const Tensor&, const Tensor&, int64_t, double, c10::string_view)>(
          "cross_entropy");
  return op.call(logits, target, ignore_index, label_smoothing, reduction);
}

}  // namespace kernelgate
