// Attention's gradient rule at non-finite inputs (contract in attention.h): NaN over the
// flagged heads of dq, dk and dv. A flagged head is rare (an input that already holds a NaN or an
// Inf), so the launch is sized for the common case: a few blocks per head and gradient that read
// their head's flag and return; only a flagged head's blocks write, striding over its slice.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention.h"

namespace kernelgate::kernels {
namespace attention_detail {

constexpr int kThreads = 256;
constexpr int kBlocksPerHead = 16;

struct Slices {
  void* ptr[kAttentionMaxPoisoned];
  int64_t per_head[kAttentionMaxPoisoned];
};

template <class Bits>
__global__ void poison_heads(Slices s, const bool* bad, Bits nan) {
  const int64_t head = blockIdx.y;
  const int t = blockIdx.z;
  if (!bad[head] || s.ptr[t] == nullptr) return;
  const int64_t n = s.per_head[t];
  Bits* p = static_cast<Bits*>(s.ptr[t]) + head * n;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    p[i] = nan;
  }
}

}  // namespace attention_detail

int attention_poison_heads_cuda(void* const* grads, const int64_t* per_head, int count,
                                const bool* bad, int64_t heads, DType dtype, void* stream) {
  using namespace attention_detail;
  if (count < 0 || count > kAttentionMaxPoisoned || heads < 0 || heads > 65535) {
    return cudaErrorInvalidValue;
  }
  Slices s{};
  for (int t = 0; t < count; ++t) {
    if (per_head[t] < 0) return cudaErrorInvalidValue;
    s.ptr[t] = per_head[t] > 0 ? grads[t] : nullptr;
    s.per_head[t] = per_head[t];
  }
  if (count == 0 || heads == 0) return 0;
  const dim3 grid(kBlocksPerHead, static_cast<unsigned>(heads), static_cast<unsigned>(count));
  auto st = static_cast<cudaStream_t>(stream);
  // Quiet NaNs: float32 0x7fc00000, float16 0x7e00, bfloat16 0x7fc0.
  if (dtype == DType::kFloat32) {
    poison_heads<uint32_t><<<grid, kThreads, 0, st>>>(s, bad, 0x7fc00000u);
  } else {
    poison_heads<uint16_t><<<grid, kThreads, 0, st>>>(
        s, bad, static_cast<uint16_t>(dtype == DType::kFloat16 ? 0x7e00u : 0x7fc0u));
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kernelgate::kernels
