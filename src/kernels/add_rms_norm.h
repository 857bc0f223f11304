// add_rms_norm kernels: framework-free entry points (raw pointers, sizes, strides, stream).
// Only src/ops/add_rms_norm.cpp sees at::Tensor; it makes the layout match what these expect.
#pragma once
#include <cstdint>

#include "kernels/dtype.h"

namespace kernelgate::kernels {

// Rows of 2-D views [rows, hidden]: element (r, c) of an input lives at base + r * stride + c
// (the last dim is unit-stride). Outputs (y, h, dx) are written densely with row stride hidden.
struct AddRmsNormProblem {
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;         // forward
  int64_t residual_row_stride = 0;  // forward
  int64_t h_row_stride = 0;         // backward
  int64_t dy_row_stride = 0;        // backward
  int64_t dh_row_stride = 0;        // backward (when dh is given)
  float eps = 1e-6f;
  DType dtype = DType::kFloat32;  // of every tensor but rstd and the workspace
};

// Forward, one pass over memory:
//   h[r,c] = round_to_dtype(x[r,c] + residual[r,c])
//   rstd[r] = 1 / sqrt(mean(h[r,:]^2) + eps)           (float32, from the rounded h)
//   y[r,c] = h[r,c] * rstd[r] * weight[c]              (weight may be null: ones)
// rstd may be null (not written). Returns 0 on success or a CUDA error code.
int add_rms_norm_fwd_cuda(void* y, void* h, float* rstd, const void* x, const void* residual,
                          const void* weight, const AddRmsNormProblem& p, void* stream);

// Backward, given h and rstd from the forward, dy the cotangent of y and dh (may be null) that
// of h:
//   hhat = h * rstd; g = dy * weight
//   dx = rstd * (g - hhat * mean(g * hhat)) + dh       (the gradient of x and of residual)
//   dweight[c] = sum_r dy[r,c] * hhat[r,c]            (only when dweight != null)
// `workspace` holds add_rms_norm_bwd_cuda_workspace_floats(p, sm_count) floats.
int64_t add_rms_norm_bwd_cuda_workspace_floats(const AddRmsNormProblem& p, int sm_count);
int add_rms_norm_bwd_cuda(void* dx, void* dweight, const void* dy, const void* dh, const void* h,
                          const void* weight, const float* rstd, float* workspace, int sm_count,
                          const AddRmsNormProblem& p, void* stream);

}  // namespace kernelgate::kernels
