// The one list of built-in ops: their schemas in TORCH_LIBRARY and their backends in the
// dispatcher. Adding an op adds a line to each.
#include <torch/library.h>

#include "kernelgate/kernelgate.h"
#include "ops/op_util.h"

namespace kernelgate {

#ifdef KERNELGATE_WITH_CUDA
namespace {
int device_arch(int index) {
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(index);
  return p->major * 10 + p->minor;
}
}  // namespace
#endif

void register_builtin_ops(Dispatcher& d) {
#ifdef KERNELGATE_WITH_CUDA
  set_cuda_arch_provider(device_arch);
#endif
  register_rms_norm(d);
  register_gated_ops(d);
  register_add_rms_norm(d);
  register_layer_norm(d);
  register_rope_ops(d);
  register_cross_entropy(d);
  register_linear_cross_entropy(d);
}

TORCH_LIBRARY(kernelgate, m) {
  define_rms_norm(m);
  define_gated(m);
  define_add_rms_norm(m);
  define_layer_norm(m);
  define_rope(m);
  define_cross_entropy(m);
  define_linear_cross_entropy(m);
}

}  // namespace kernelgate
