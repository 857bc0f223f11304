// A bare custom op that calls kernelgate's rms_norm kernels directly, with no routing: the
// baseline that bench/bench_dispatch.py compares kg.rms_norm against (dispatch overhead).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels/rms_norm.h"
#include "ops/op_util.h"

namespace {

using kernelgate::kernels::RmsNormProblem;

RmsNormProblem problem(const at::Tensor& x, double eps) {
  RmsNormProblem p;
  p.hidden = x.size(-1);
  p.rows = x.numel() / p.hidden;
  p.x_row_stride = p.hidden;
  p.eps = static_cast<float>(eps);
  p.dtype = kernelgate::kernel_dtype(x.scalar_type());
  return p;
}

at::Tensor direct_cpu(const at::Tensor& x, const std::optional<at::Tensor>& w, double eps) {
  at::Tensor y = at::empty_like(x);
  auto p = problem(x, eps);
  kernelgate::kernels::rms_norm_fwd_cpu(y.data_ptr(), nullptr, x.const_data_ptr(),
                                        w ? w->const_data_ptr() : nullptr, p, 0, p.rows);
  return y;
}

#ifdef KERNELGATE_WITH_CUDA
at::Tensor direct_cuda(const at::Tensor& x, const std::optional<at::Tensor>& w, double eps) {
  at::Tensor y = at::empty_like(x);
  auto p = problem(x, eps);
  void* stream = at::cuda::getCurrentCUDAStream(x.get_device()).stream();
  kernelgate::check_cuda(
      kernelgate::kernels::rms_norm_fwd_cuda(y.data_ptr(), nullptr, x.const_data_ptr(),
                                             w ? w->const_data_ptr() : nullptr, p, stream),
      "rms_norm_direct");
  return y;
}
#endif

}  // namespace

TORCH_LIBRARY(kgbench, m) {
  m.def("rms_norm_direct(Tensor x, Tensor? weight=None, float eps=1e-06) -> Tensor");
}

TORCH_LIBRARY_IMPL(kgbench, CPU, m) { m.impl("rms_norm_direct", direct_cpu); }

#ifdef KERNELGATE_WITH_CUDA
TORCH_LIBRARY_IMPL(kgbench, CUDA, m) { m.impl("rms_norm_direct", direct_cuda); }
#endif
