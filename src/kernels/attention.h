// Attention's gradient rule at non-finite inputs (src/ops/attention.cpp): framework-free entry
// point (raw pointers, sizes, strides, stream). Only src/ops/attention.cpp sees at::Tensor.
#pragma once
#include <cstdint>

#include "kernels/dtype.h"

namespace kernelgate::kernels {

constexpr int kAttentionMaxPoisoned = 3;  // dq, dk, dv
constexpr int kAttentionMaxDims = 5;      // dq: [batch, kv_heads, group, seq, head_dim]

// One gradient: [batch, kv_heads, ...] of `dims` dims (3 to kAttentionMaxDims), strides in
// elements (any, as long as distinct indices are distinct elements); null ptr: skipped.
struct AttentionGrad {
  void* ptr = nullptr;
  int dims = 0;
  int64_t sizes[kAttentionMaxDims] = {};
  int64_t strides[kAttentionMaxDims] = {};
};

// For each (b, h) with bad[b * kv_heads + h] != 0, sets every element of grads[t][b, h, ...] to
// NaN, for t < count; other heads are not read or written. Every grad has sizes[0] == batch and
// sizes[1] == kv_heads. Returns 0 or a CUDA error code (cudaErrorInvalidValue for count outside
// [0, kAttentionMaxPoisoned], dims outside [3, kAttentionMaxDims], sizes that disagree or a
// negative size). Never synchronizes.
int attention_poison_heads_cuda(const AttentionGrad* grads, int count, const bool* bad,
                                int64_t batch, int64_t kv_heads, DType dtype, void* stream);

}  // namespace kernelgate::kernels
