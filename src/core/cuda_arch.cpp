// The CUDA device facts the dispatch key needs (built only with CUDA support).
#include <ATen/cuda/CUDAContext.h>

#include "kernelgate/dispatch.h"

namespace kernelgate {
namespace {

int device_arch(int index) {
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(index);
  return p->major * 10 + p->minor;
}

const bool kInstalled = (set_cuda_arch_provider(device_arch), true);

}  // namespace
}  // namespace kernelgate
