// Attention's gradient rule at non-finite inputs (contract in attention.h): NaN over the
// flagged kv heads of dq, dk and dv. A flagged head is rare (an input that already holds a NaN or
// an Inf), so the launch is sized for the common case: a few blocks per head and gradient that
// read their head's flag and return; only a flagged head's blocks write, striding over its
// elements through the gradient's strides (attention code's layout keeps a head's elements apart).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention.h"

namespace kernelgate::kernels {
namespace attention_detail {

constexpr int kThreads = 256;
constexpr int kBlocksPerHead = 16;

struct Grads {
  AttentionGrad g[kAttentionMaxPoisoned];
};

template <class Bits>
__global__ void poison_heads(Grads gs, const bool* bad, int64_t kv_heads, Bits nan) {
  const int64_t head = blockIdx.y;
  const AttentionGrad& g = gs.g[blockIdx.z];
  if (!bad[head] || g.ptr == nullptr) return;
  const int64_t b = head / kv_heads, h = head % kv_heads;
  Bits* base = static_cast<Bits*>(g.ptr) + b * g.strides[0] + h * g.strides[1];
  int64_t inner = 1;
  for (int d = 2; d < g.dims; ++d) inner *= g.sizes[d];
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < inner;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    int64_t rest = i, offset = 0;
    for (int d = g.dims - 1; d >= 2; --d) {
      offset += (rest % g.sizes[d]) * g.strides[d];
      rest /= g.sizes[d];
    }
    base[offset] = nan;
  }
}

}  // namespace attention_detail

int attention_poison_heads_cuda(const AttentionGrad* grads, int count, const bool* bad,
                                int64_t batch, int64_t kv_heads, DType dtype, void* stream) {
  using namespace attention_detail;
  if (count < 0 || count > kAttentionMaxPoisoned || batch < 0 || kv_heads < 0 ||
      batch * kv_heads > 65535) {
    return cudaErrorInvalidValue;
  }
  Grads gs{};
  for (int t = 0; t < count; ++t) {
    const AttentionGrad& g = grads[t];
    if (g.ptr == nullptr) continue;
    if (g.dims < 3 || g.dims > kAttentionMaxDims || g.sizes[0] != batch || g.sizes[1] != kv_heads) {
      return cudaErrorInvalidValue;
    }
    for (int d = 0; d < g.dims; ++d) {
      if (g.sizes[d] < 0) return cudaErrorInvalidValue;
    }
    gs.g[t] = g;
  }
  if (count == 0 || batch * kv_heads == 0) return 0;
  const dim3 grid(kBlocksPerHead, static_cast<unsigned>(batch * kv_heads), static_cast<unsigned>(count));
  auto st = static_cast<cudaStream_t>(stream);
  // Quiet NaNs: float32 0x7fc00000, float16 0x7e00, bfloat16 0x7fc0.
  if (dtype == DType::kFloat32) {
    poison_heads<uint32_t><<<grid, kThreads, 0, st>>>(gs, bad, kv_heads, 0x7fc00000u);
  } else {
    poison_heads<uint16_t><<<grid, kThreads, 0, st>>>(
        gs, bad, kv_heads, static_cast<uint16_t>(dtype == DType::kFloat16 ? 0x7e00u : 0x7fc0u));
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kernelgate::kernels
