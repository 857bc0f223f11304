// Gated activations (SwiGLU, GEGLU): framework-free entry points (raw pointers, sizes, stream).
// Only src/ops/gated.cpp sees at::Tensor; it makes every tensor contiguous before calling.
#pragma once
#include <cstdint>

#include "kernels/dtype.h"

namespace kernelgate::kernels {

// act(g): kSilu g * sigmoid(g); kGeluErf g * Phi(g) (Phi: standard normal CDF);
// kGeluTanh 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
enum class GatedActivation : int { kSilu = 0, kGeluErf = 1, kGeluTanh = 2 };

// All tensors hold n contiguous elements of `dtype`; math is float32. n == 0 launches nothing.
// Outputs must not overlap inputs or each other (inputs are read through the read-only cache).
// Returns 0 on success or a CUDA error code (cudaErrorInvalidValue for n < 0, a null pointer,
// or an unknown dtype / act). Never synchronizes.

// out[i] = act(gate[i]) * up[i]
int gated_fwd_cuda(void* out, const void* gate, const void* up, int64_t n, DType dtype,
                   GatedActivation act, void* stream);

// dgate[i] = dy[i] * up[i] * act'(gate[i]);  dup[i] = dy[i] * act(gate[i])
int gated_bwd_cuda(void* dgate, void* dup, const void* dy, const void* gate, const void* up,
                   int64_t n, DType dtype, GatedActivation act, void* stream);

}  // namespace kernelgate::kernels
