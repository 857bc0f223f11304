// layer_norm kernels: framework-free entry points (raw pointers, sizes, strides, stream).
// Only src/ops/layer_norm.cpp sees at::Tensor; it makes the layout match what these expect.
#pragma once
#include <cstdint>

#include "kernels/dtype.h"

namespace kernelgate::kernels {

// Rows of 2-D views [rows, hidden]: element (r, c) of x lives at x + r * x_row_stride + c (the
// last dim is unit-stride); likewise dy. y and dx are written densely with row stride hidden.
struct LayerNormProblem {
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;
  int64_t dy_row_stride = 0;  // backward only
  float eps = 1e-5f;
  DType dtype = DType::kFloat32;  // of x, y, weight, bias, dy, dx, dweight, dbias
};

// Forward (float32 statistics, the variance from the deviations of the row held on chip, not
// E[x^2] - E[x]^2):
//   mean[r] = mean(x[r,:]); rstd[r] = 1 / sqrt(mean((x[r,:] - mean[r])^2) + eps)
//   y[r,c] = (x[r,c] - mean[r]) * rstd[r] * weight[c] + bias[c]
// weight / bias may be null (ones / zeros); mean and rstd may be null (not written).
// Returns 0 on success or a CUDA error code.
int layer_norm_fwd_cuda(void* y, float* mean, float* rstd, const void* x, const void* weight,
                        const void* bias, const LayerNormProblem& p, void* stream);

// Backward, given mean and rstd from the forward:
//   xhat = (x - mean) * rstd; g = dy * weight
//   dx = rstd * (g - mean_c(g) - xhat * mean_c(g * xhat))
//   dweight[c] = sum_r dy[r,c] * xhat[r,c]     (when dweight != null)
//   dbias[c]   = sum_r dy[r,c]                 (when dbias != null)
// `workspace` holds layer_norm_bwd_cuda_workspace_floats(p, sm_count) floats.
int64_t layer_norm_bwd_cuda_workspace_floats(const LayerNormProblem& p, int sm_count);
int layer_norm_bwd_cuda(void* dx, void* dweight, void* dbias, const void* dy, const void* x,
                        const void* weight, const float* mean, const float* rstd, float* workspace,
                        int sm_count, const LayerNormProblem& p, void* stream);

}  // namespace kernelgate::kernels
