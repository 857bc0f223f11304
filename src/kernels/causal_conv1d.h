// Causal depthwise conv1d (the short convolution of Mamba / Gated DeltaNet blocks):
// framework-free entry points (raw pointers, sizes, stream). Only src/ops/causal_conv1d.cpp sees
// at::Tensor; it makes every tensor contiguous before calling.
#pragma once
#include <cstdint>

#include "kernels/dtype.h"

namespace kernelgate::kernels {

// Sizes of one call: x and y are [batch, seq, dim], weight [dim, width], bias [dim] or null.
// pre[b, t, d] = bias[d] + sum_k weight[d, k] * x[b, t - (width - 1) + k, d]  (x = 0 before t = 0)
// y = pre, or silu(pre) = pre * sigmoid(pre) when `silu`.
struct CausalConv1dShape {
  int64_t batch = 0, seq = 0, dim = 0, width = 0;
  bool silu = false;
};

constexpr int64_t kCausalConv1dMaxWidth = 8;

// Every tensor contiguous, of `dtype`; math is float32. Returns 0 on success or a CUDA error
// code (cudaErrorInvalidValue for a width outside [1, kCausalConv1dMaxWidth], a negative size or
// a null pointer where elements are). Never synchronizes. Outputs must not overlap inputs.
int causal_conv1d_fwd_cuda(void* y, const void* x, const void* weight, const void* bias,
                           const CausalConv1dShape& shape, DType dtype, int sm_count,
                           void* stream);

// Gradients: dx [batch, seq, dim] (null: not wanted), dweight [dim, width] and dbias [dim]
// (null: not wanted; dbias needs bias). `workspace` holds causal_conv1d_bwd_workspace_bytes()
// bytes (the per-tile partial sums of dweight and dbias, reduced in a fixed order: the result
// does not depend on scheduling).
size_t causal_conv1d_bwd_workspace_bytes(const CausalConv1dShape& shape, int sm_count);
int causal_conv1d_bwd_cuda(void* dx, void* dweight, void* dbias, const void* dy, const void* x,
                           const void* weight, const void* bias, const CausalConv1dShape& shape,
                           DType dtype, void* workspace, int sm_count, void* stream);

}  // namespace kernelgate::kernels
