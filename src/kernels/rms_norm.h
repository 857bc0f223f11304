// rms_norm kernels: framework-free entry points (raw pointers, sizes, strides, stream).
// Only src/ops/rms_norm.cpp sees at::Tensor; it makes the layout match what these expect.
#pragma once
#include <cstdint>

#include "kernels/dtype.h"

namespace kernelgate::kernels {

// Rows of a 2-D view [rows, hidden]: element (r, c) of x lives at x + r * x_row_stride + c
// (the last dim is unit-stride). y and dx are written densely with row stride `hidden`.
struct RmsNormProblem {
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;   // in elements
  int64_t dy_row_stride = 0;  // in elements (backward only)
  float eps = 1e-6f;
  DType dtype = DType::kFloat32;  // dtype of x, y, weight, dy, dx, dweight
};

// Forward: rstd[r] = 1 / sqrt(mean(x[r,:]^2) + eps) (float32 accumulation);
// y[r,c] = x[r,c] * rstd[r] * weight[c] (weight may be null: treated as ones).
// rstd may be null (not written). Returns 0 on success or a CUDA error code.
int rms_norm_fwd_cuda(void* y, float* rstd, const void* x, const void* weight,
                      const RmsNormProblem& p, void* stream);

// Backward, given rstd from the forward:
//   xhat = x * rstd; g = dy * weight;
//   dx = rstd * (g - xhat * mean(g * xhat))
//   dweight[c] = sum_r dy[r,c] * xhat[r,c]          (only when dweight != null)
// `workspace` holds rms_norm_bwd_cuda_workspace_floats(p, sm_count) floats (partial dweight sums).
int64_t rms_norm_bwd_cuda_workspace_floats(const RmsNormProblem& p, int sm_count);
int rms_norm_bwd_cuda(void* dx, void* dweight, const void* dy, const void* x, const void* weight,
                      const float* rstd, float* workspace, int sm_count, const RmsNormProblem& p,
                      void* stream);

// CPU versions process rows [row_begin, row_end) so the caller can split rows across threads.
void rms_norm_fwd_cpu(void* y, float* rstd, const void* x, const void* weight,
                      const RmsNormProblem& p, int64_t row_begin, int64_t row_end);
// dweight_partial: float32 [hidden], accumulated (+=) over the given rows; may be null.
void rms_norm_bwd_cpu(void* dx, float* dweight_partial, const void* dy, const void* x,
                      const void* weight, const float* rstd, const RmsNormProblem& p,
                      int64_t row_begin, int64_t row_end);

}  // namespace kernelgate::kernels
