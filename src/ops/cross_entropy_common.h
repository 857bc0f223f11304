// Pieces shared by cross_entropy and linear_cross_entropy: argument checks, the ATen reference
// math (the float64 oracle), and the per-chunk step (ATen on any device, our kernel on CUDA)
// that linear_cross_entropy's chunk loop runs. Included only by src/ops/*cross_entropy*.cpp.
#pragma once
#include <ATen/ATen.h>

#include "kernels/cross_entropy.h"

namespace kernelgate::ce {

using kernels::CeReduction;

// "mean" / "sum" / "none"; anything else is an error naming `op`.
CeReduction parse_reduction(const char* op, c10::string_view reduction);

// classes >= 1 (when there are rows) and 0 <= label_smoothing <= 1.
void check_scalars(const char* op, const char* classes_where, int64_t rows, int64_t classes,
                   double label_smoothing);

// CPU tensors only (reading a device tensor would sync): every target is ignore_index or in
// [0, classes); otherwise an error naming the first bad row.
void check_targets_on_cpu(const char* op, const at::Tensor& target, int64_t classes,
                          int64_t ignore_index);

// The contract in ATen: loss of logits [rows, classes] (any float dtype; math in
// promote(dtype, float32), so float64 in the oracle) reduced as asked, in logits' dtype.
// Differentiable through ATen's autograd: that gradient is the gradient contract.
at::Tensor reference_loss(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                          double label_smoothing, CeReduction reduction);

// The loss as plain PyTorch code computes it: F.cross_entropy(logits.float(), target, ...), in
// logits' dtype (the eager backends). A target outside [0, classes) that is not ignore_index
// makes its row's loss NaN, as in every backend (not a device-side assert).
at::Tensor eager_loss(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                      double label_smoothing, CeReduction reduction);

// Reduces float32 row losses: none -> as is, sum -> sum, mean -> sum / n_valid.
at::Tensor reduce_rows(const at::Tensor& row_loss, CeReduction reduction,
                       const at::Tensor& n_valid);

// x [rows, classes] itself when its last dim is unit-stride, else a contiguous copy.
at::Tensor unit_stride_rows(const at::Tensor& x);

// float32 scalar: rows whose target is not ignore_index.
at::Tensor count_valid(const at::Tensor& target, int64_t ignore_index);

// One step over a block of rows (kernels/cross_entropy.h has the math):
//  stats: row_loss (if defined) and lse are written;
//  grad:  grad_out = d loss_r / d logits * (dloss, [] or [n], or 1 when undefined)
//         / (n_valid when defined), using lse (written just now, or given).
// grad_out may be logits itself (in place); logits' last dim is unit-stride.
struct ChunkStep {
  at::Tensor logits;    // [n, classes]
  at::Tensor target;    // [n], int32 or int64, contiguous
  at::Tensor row_loss;  // float32 [n] or undefined
  at::Tensor lse;       // float32 [n]
  at::Tensor grad_out;  // [n, classes] in logits' dtype; undefined: no gradient
  at::Tensor dloss;
  at::Tensor n_valid;
  bool stats = true;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
};
using ChunkStepFn = void (*)(const ChunkStep& step);

void aten_chunk_step(const ChunkStep& step);
#ifdef KERNELGATE_WITH_CUDA
void cuda_chunk_step(const ChunkStep& step);
#endif

}  // namespace kernelgate::ce
