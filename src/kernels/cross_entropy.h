// Cross-entropy over the rows of a logits matrix: framework-free entry points (raw pointers,
// sizes, strides, stream). Only src/ops/cross_entropy.cpp sees at::Tensor.
//
// Row r with target t = target[r], C classes, smoothing e:
//   ignored  (t == ignore_index):  loss 0, gradient row 0; the row is not read.
//   in range (0 <= t < C):         lse  = log(sum_c exp(x[r,c]))
//                                  loss = lse - (1 - e) x[r,t] - (e / C) sum_c x[r,c]
//                                  d loss / d x[r,c] = softmax(x[r])[c] - (e / C) - (1 - e) [c ==
//                                  t]
//   out of range (anything else):  loss NaN, gradient row NaN. The kernels never read outside
//                                  the row; checking targets on the host would need a sync, so
//                                  a bad target shows up as a NaN loss instead of an error.
// (e == 0 skips the sum term, so -inf logits give +inf / finite losses exactly as F.cross_entropy.)
#pragma once
#include <cstdint>

#include "kernels/dtype.h"

namespace kernelgate::kernels {

enum class CeReduction : int { kMean = 0, kSum = 1, kNone = 2 };

// One launch over `rows` rows. Element (r, c) of logits lives at logits + r * logits_row_stride
// + c, of grad at grad + r * grad_row_stride + c (strides in elements). Math is float32.
//
// Stats pass (compute_stats): row_loss[r] (float32, may be null), loss_out[r] (dtype, may be
// null: reduction "none" output) and lse[r] (float32; 0 for ignored rows) are written.
// Gradient pass (grad != null): grad[r, :] = d loss_r / d x[r, :] * scale_r with
//   scale_r = (dloss ? dloss[dloss_per_row ? r : 0] : 1) / (n_valid ? *n_valid : 1),
// using the lse just computed, or lse[r] from an earlier stats pass when !compute_stats (lse is
// required whenever grad is given).
// grad may equal logits (in place, same row stride): each element is read before it is written
// by the same thread. dloss and n_valid are float32 on the device. Never
// synchronizes. Returns 0 on success or a CUDA error code (cudaErrorInvalidValue for bad
// arguments: negative sizes, null pointers that are required, classes < 1 with rows > 0).
struct CeRowsArgs {
  void* grad = nullptr;
  void* loss_out = nullptr;
  float* row_loss = nullptr;
  float* lse = nullptr;
  const void* logits = nullptr;
  const void* target = nullptr;  // int64 or int32, contiguous [rows]
  const float* dloss = nullptr;
  const float* n_valid = nullptr;
  int64_t rows = 0;
  int64_t classes = 0;
  int64_t logits_row_stride = 0;
  int64_t grad_row_stride = 0;
  int64_t ignore_index = -100;
  float label_smoothing = 0.f;
  DType dtype = DType::kFloat32;
  bool target_int32 = false;
  bool compute_stats = true;
  bool dloss_per_row = false;
};
int cross_entropy_rows_cuda(const CeRowsArgs& a, void* stream);

// One block: n_valid_out[0] = number of rows whose target != ignore_index (float32, may be
// null), and for kSum / kMean out[0] (dtype) = sum of row_loss (accumulated in float64), divided
// by that count for kMean (0 / 0 = NaN when every row is ignored). kNone writes only the count.
// Deterministic: a fixed summation order for given rows.
int cross_entropy_reduce_cuda(void* out, float* n_valid_out, const float* row_loss,
                              const void* target, bool target_int32, int64_t rows,
                              int64_t ignore_index, CeReduction reduction, DType dtype,
                              void* stream);

// data[i] *= scale[0] in place (float32 math, rounded to dtype once), for n elements of a
// contiguous array in `dtype`; scale is a float32 device scalar (the loss's cotangent). When
// scale[0] is exactly 1 (the usual unit cotangent of a loss) nothing is written: every block
// returns after one load, without a host sync. linear_cross_entropy's backward applies the
// incoming cotangent to the gradients its forward computed this way. The grid is sized from
// sm_count (8 blocks of 256 threads per SM).
int scale_unless_one_cuda(void* data, int64_t n, DType dtype, const float* scale, int sm_count,
                          void* stream);

}  // namespace kernelgate::kernels
