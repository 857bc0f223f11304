// Rotary position embedding (rotate-half convention) and the fused per-head rms_norm + rope
// (qk-norm): framework-free entry points (raw pointers, sizes, strides, stream).
// Only src/ops/rope.cpp sees at::Tensor.
#pragma once
#include <cstdint>

#include "kernels/dtype.h"

namespace kernelgate::kernels {

// A [batch, heads, seq, head_dim] tensor: element (b, h, s, d) lives at
// ptr + b * sb + h * sh + s * ss + d (strides in elements; the last dim is unit-stride).
struct RopeStrides {
  int64_t sb = 0, sh = 0, ss = 0;
};

// q [batch, q_heads, seq, head_dim], k [batch, kv_heads, seq, head_dim];
// cos, sin [cos_batch, seq, head_dim] seen through (batch, seq) strides: a broadcast batch has
// stride 0. head_dim is even; h = head_dim / 2 below.
struct RopeProblem {
  int64_t batch = 0, seq = 0, head_dim = 0, q_heads = 0, kv_heads = 0;
  RopeStrides q, k;          // inputs: q and k (forward) or their output gradients (backward)
  RopeStrides q_out, k_out;  // outputs
  int64_t cos_sb = 0, cos_ss = 0, sin_sb = 0, sin_ss = 0;
  DType dtype = DType::kFloat32;  // of every tensor argument
};

// rope forward (backward = false), for d < h and its partner d + h:
//   out[d]     = x[d] cos[d]         - x[d + h] sin[d]
//   out[d + h] = x[d + h] cos[d + h] + x[d] sin[d + h]
// i.e. out = x cos + rotate_half(x) sin. Backward (x = output gradient; the transpose):
//   dx[d]     = g[d] cos[d]         + g[d + h] sin[d + h]
//   dx[d + h] = g[d + h] cos[d + h] - g[d] sin[d]
// q and k are done by one launch. Outputs must not overlap inputs. Returns 0 or a CUDA error
// code (cudaErrorInvalidValue for a bad problem or null pointer). Never synchronizes.
int rope_cuda(void* q_out, void* k_out, const void* q, const void* k, const void* cos,
              const void* sin, const RopeProblem& p, bool backward, void* stream);

// qk_norm_rope forward: per (b, head, s) row, rstd = 1 / sqrt(mean(x^2) + eps) in float32,
// n = x * rstd * weight (q_weight for q rows, k_weight for k rows, both [head_dim]), out =
// rope(n) with n kept in float32. q_rstd [batch, q_heads, seq] and k_rstd [batch, kv_heads, seq]
// (contiguous float32) are written when not null.
int qk_norm_rope_fwd_cuda(void* q_out, void* k_out, float* q_rstd, float* k_rstd, const void* q,
                          const void* k, const void* q_weight, const void* k_weight,
                          const void* cos, const void* sin, float eps, const RopeProblem& p,
                          void* stream);

// qk_norm_rope backward. In p, q / k are the strides of the output gradients dq_out / dk_out,
// q_out / k_out those of dq / dk; xq / xk are the forward inputs with strides xq_s / xk_s.
//   dn = rope backward of the output gradient; xhat = x rstd; g = dn w
//   dx = rstd (g - xhat mean(g xhat));  dweight[d] = sum over rows of dn[d] xhat[d]
// dq_weight / dk_weight may be null (not wanted); otherwise `workspace` holds
// qk_norm_rope_bwd_workspace_floats(p, sm_count) floats and the sums are reduced in a fixed
// order (deterministic for a given problem, sm_count and device).
int64_t qk_norm_rope_bwd_workspace_floats(const RopeProblem& p, int sm_count);
int qk_norm_rope_bwd_cuda(void* dq, void* dk, void* dq_weight, void* dk_weight, const void* dq_out,
                          const void* dk_out, const void* xq, const void* xk,
                          const RopeStrides& xq_s, const RopeStrides& xk_s, const void* q_weight,
                          const void* k_weight, const float* q_rstd, const float* k_rstd,
                          const void* cos, const void* sin, float* workspace, int sm_count,
                          const RopeProblem& p, void* stream);

}  // namespace kernelgate::kernels
