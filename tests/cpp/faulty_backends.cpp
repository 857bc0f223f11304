// Test-only rms_norm backends, each wrong in one way the harness must catch (with the right
// disposition) and never time or dispatch. Loaded by kernelgate-worker --load.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "kernelgate/op.h"

namespace {

using at::Tensor;
using kernelgate::GradRequest;
using kernelgate::OptTensor;

std::tuple<Tensor, Tensor> correct(const Tensor& x, const OptTensor& w, double eps) {
  Tensor xf = x.to(at::kFloat);
  Tensor rstd = at::rsqrt(xf.square().mean(-1, true) + eps);
  Tensor y = xf * rstd;
  if (w) y = y * w->to(at::kFloat);
  return {y.to(x.scalar_type()), rstd.squeeze(-1)};
}

std::tuple<Tensor, Tensor> bwd(const Tensor& dy, const Tensor& x, const OptTensor& w,
                               const Tensor& rstd, double, GradRequest need) {
  const bool weight_grad = need(1);
  Tensor xf = x.to(at::kFloat), dyf = dy.to(at::kFloat), r = rstd.unsqueeze(-1);
  Tensor xhat = xf * r;
  Tensor g = w ? dyf * w->to(at::kFloat) : dyf;
  Tensor dx = r * (g - xhat * (g * xhat).mean(-1, true));
  Tensor dw = weight_grad && w ? (dyf * xhat).reshape({-1, x.size(-1)}).sum(0).to(w->scalar_type())
                               : Tensor();
  return {dx.to(x.scalar_type()), dw};
}

// Leaves the last row of y unwritten (fresh, poisoned memory).
std::tuple<Tensor, Tensor> skips_last_row(const Tensor& x, const OptTensor& w, double eps,
                                          GradRequest) {
  auto [y, rstd] = correct(x, w, eps);
  Tensor out = at::empty(y.sizes(), y.options());
  int64_t rows = y.numel() / std::max<int64_t>(y.size(-1), 1);
  if (rows > 1)
    out.view({rows, -1}).narrow(0, 0, rows - 1).copy_(y.reshape({rows, -1}).narrow(0, 0, rows - 1));
  return {out, rstd};
}

std::tuple<Tensor, Tensor> ignores_eps(const Tensor& x, const OptTensor& w, double, GradRequest) {
  return correct(x, w, 0.0);
}

// Writes only the first half of each row.
std::tuple<Tensor, Tensor> partial_write(const Tensor& x, const OptTensor& w, double eps,
                                         GradRequest) {
  auto [y, rstd] = correct(x, w, eps);
  Tensor out = at::empty(y.sizes(), y.options());
  int64_t half = (y.size(-1) + 1) / 2;
  out.narrow(-1, 0, half).copy_(y.narrow(-1, 0, half));
  return {out, rstd};
}

// Reads x's storage as if it were contiguous.
std::tuple<Tensor, Tensor> assumes_contiguous(const Tensor& x, const OptTensor& w, double eps,
                                              GradRequest) {
  Tensor flat = at::from_blob(const_cast<void*>(x.const_data_ptr()), x.sizes(), x.options());
  return correct(flat.clone(), w, eps);
}

std::tuple<Tensor, Tensor> nan_to_zero(const Tensor& x, const OptTensor& w, double eps,
                                       GradRequest) {
  auto [y, rstd] = correct(x, w, eps);
  return {at::nan_to_num(y, 0.0, 0.0, 0.0), rstd};
}

// Returns the output buffer of its previous call when the shape matches.
std::tuple<Tensor, Tensor> stale_buffer(const Tensor& x, const OptTensor& w, double eps,
                                        GradRequest) {
  static Tensor last_y, last_r;
  if (last_y.defined() && last_y.sizes() == x.sizes() && last_y.device() == x.device()) {
    return {last_y, last_r};
  }
  std::tie(last_y, last_r) = correct(x, w, eps);
  return {last_y, last_r};
}

std::tuple<Tensor, Tensor> aborts(const Tensor&, const OptTensor&, double, GradRequest) {
  std::abort();
}

std::tuple<Tensor, Tensor> hangs(const Tensor&, const OptTensor&, double, GradRequest) {
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace

extern "C" void kernelgate_register_backends(kernelgate::Dispatcher&) {
  using Fwd = std::tuple<Tensor, Tensor> (*)(const Tensor&, const OptTensor&, double, GradRequest);
  struct Entry {
    const char* name;
    Fwd fwd;
  } entries[] = {{"faulty_skips_last_row", skips_last_row},
                 {"faulty_ignores_eps", ignores_eps},
                 {"faulty_partial_write", partial_write},
                 {"faulty_assumes_contiguous", assumes_contiguous},
                 {"faulty_nan_to_zero", nan_to_zero},
                 {"faulty_stale_buffer", stale_buffer},
                 {"faulty_aborts", aborts},
                 {"faulty_hangs", hangs}};
  for (const auto& e : entries) {
    kernelgate::add_backend("rms_norm", e.name, kernelgate::BackendKind::kKernelgate, e.fwd, bwd);
  }
}
