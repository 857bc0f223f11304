// Helpers shared by op files: the declaration API, 2-D row views for the kernels, dtype mapping,
// CUDA context. Included only by src/ops/*.cpp (it sees at::Tensor; kernels never do).
#pragma once
#include <ATen/ATen.h>

#include <cstdio>
#include <string>

#include "kernelgate/op.h"
#include "kernels/dtype.h"

#ifdef KERNELGATE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace kernelgate {

// The reason a CUDA backend is listed but unavailable in a build without CUDA.
constexpr const char* kNoCudaBuild = "this build has no CUDA support";

// A double in an error message. snprintf, not an ostream: in a process where a library loaded
// earlier exports its own copy of libstdc++'s stream internals (as on our H200 machine),
// formatting a double through an ostream crashed.
inline std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

// A tensor seen as [rows, size(-1)] with a unit-stride last dim and one row stride. When the
// leading dims cannot be folded into one stride, `data` is a contiguous copy.
struct RowView {
  at::Tensor data;
  int64_t rows = 0;
  int64_t row_stride = 0;
};

inline RowView row_view(const at::Tensor& x) {
  const int64_t inner = x.size(-1);
  const int64_t rows = inner == 0 ? 0 : x.numel() / inner;
  if (rows <= 1 && (inner <= 1 || x.stride(-1) == 1)) return {x, rows, inner};
  if (x.stride(-1) == 1 || inner == 1) {
    // Leading dims fold into one stride when each (non-unit) one steps over the next.
    int64_t expected = -1;
    bool foldable = true;
    for (int64_t i = x.dim() - 2; i >= 0; --i) {
      if (x.size(i) == 1) continue;
      if (expected >= 0 && x.stride(i) != expected) {
        foldable = false;
        break;
      }
      if (expected < 0) expected = x.stride(i);
      expected *= x.size(i);
    }
    if (foldable) {
      int64_t stride = inner;
      for (int64_t i = x.dim() - 2; i >= 0; --i) {
        if (x.size(i) != 1) {
          stride = x.stride(i);
          break;
        }
      }
      return {x, rows, stride};
    }
  }
  return {x.contiguous(), rows, inner};
}

inline kernels::DType kernel_dtype(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::DType::kFloat32;
    case at::kHalf: return kernels::DType::kFloat16;
    case at::kBFloat16: return kernels::DType::kBFloat16;
    default: TORCH_INTERNAL_ASSERT(false, "no kernel dtype for ", t);
  }
  return kernels::DType::kFloat32;
}

#ifdef KERNELGATE_WITH_CUDA
// Device guard, current stream and SM count for a launch on x's device.
struct CudaContext {
  c10::cuda::CUDAGuard guard;
  void* stream;
  int sm_count;
  explicit CudaContext(const at::Tensor& x)
      : guard(x.device()),
        stream(at::cuda::getCurrentCUDAStream(x.get_device()).stream()),
        sm_count(at::cuda::getDeviceProperties(x.get_device())->multiProcessorCount) {}
};

inline void check_cuda(int rc, const char* what) {
  TORCH_CHECK(rc == 0, what,
              " kernel launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(rc)));
}

inline Support cuda_available() {
  return at::cuda::is_available() ? Support::yes() : Support::no("no CUDA device is visible");
}
#endif

// What every CUDA kernel of ours needs: the call on a CUDA device of compute capability 8.0 or
// newer. `not_cuda` names the tensor ("x is not on a CUDA device").
inline Support cuda_sm80(const CallView& call, const char* not_cuda) {
  const c10::Device device = call.device();
  if (!device.is_cuda()) return Support::no(not_cuda);
  if (cuda_arch(device.index() < 0 ? 0 : device.index()) < 80) {
    return Support::no("needs compute capability 8.0 or newer");
  }
  return Support::yes();
}

// The call is on the CPU. `not_cpu` names the tensor ("x is not on the CPU").
inline Support on_cpu(const CallView& call, const char* not_cpu) {
  return call.device().is_cpu() ? Support::yes() : Support::no(not_cpu);
}

}  // namespace kernelgate
