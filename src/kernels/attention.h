// Attention's gradient rule at non-finite inputs (src/ops/attention.cpp): framework-free entry
// point (raw pointers, sizes, stream). Only src/ops/attention.cpp sees at::Tensor.
#pragma once
#include <cstdint>

#include "kernels/dtype.h"

namespace kernelgate::kernels {

constexpr int kAttentionMaxPoisoned = 3;  // dq, dk, dv

// For each head h with bad[h] != 0, sets every element of grads[t][h * per_head[t], (h + 1) *
// per_head[t]) to NaN, for t < count (a null grads[t] is skipped); other heads are not read or
// written. grads[t] is contiguous, of `dtype`, `heads * per_head[t]` elements. Returns 0 or a
// CUDA error code (cudaErrorInvalidValue for count outside [0, kAttentionMaxPoisoned] or a
// negative size). Never synchronizes.
int attention_poison_heads_cuda(void* const* grads, const int64_t* per_head, int count,
                                const bool* bad, int64_t heads, DType dtype, void* stream);

}  // namespace kernelgate::kernels
