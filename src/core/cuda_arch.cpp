// The CUDA device facts the dispatch key needs (built only with CUDA support).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include "kernelgate/dispatch.h"

namespace kernelgate {
namespace {

int device_arch(int index) {
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(index);
  return p->major * 10 + p->minor;
}

bool capturing() {
  if (c10::cuda::device_count() == 0) return false;  // nothing to capture (and no driver to ask)
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

const bool kInstalled =
    (set_cuda_arch_provider(device_arch), set_capture_provider(capturing), true);

}  // namespace
}  // namespace kernelgate
