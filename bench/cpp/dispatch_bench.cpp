// The C++ decision alone, on a cached key: check_call + make_key + cached lookup +
// can_implement, as the router runs it on every call. Target: <= 100 ns.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include "kernelgate/dispatch.h"
#include "kernelgate/kernelgate.h"

namespace {

using namespace kernelgate;

struct Call {
  at::Tensor x, w;
  CallView view;
  const OpEntry* op;
  Call(at::Device device) {
    Dispatcher& d = Dispatcher::get();
    op = d.find_op("rms_norm");
    x = at::randn({8, 256}, at::TensorOptions().device(device).dtype(at::kBFloat16));
    w = at::randn({256}, x.options());
    view.num_tensors = 2;
    view.tensors[0] = &x;
    view.tensors[1] = &w;
  }
};

at::Device bench_device() {
  return at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
}

void BM_Select(benchmark::State& state, bool with_policy) {
  Dispatcher& d = Dispatcher::get();
  d.clear_policy();
  Call c(bench_device());
  if (with_policy) {
    PolicyRule r;
    r.op = "rms_norm";
    r.ranked = {c.x.is_cuda() ? "kernelgate_cuda" : "kernelgate_cpu"};
    d.add_policy_rule(r);
  }
  BoundDims dims = check_call(c.op->contract, c.view);
  int expected = d.select(c.op->id, c.view, dims);  // warm the cache
  for (auto _ : state) {
    BoundDims b = check_call(c.op->contract, c.view);
    int chosen = d.select(c.op->id, c.view, b);
    benchmark::DoNotOptimize(chosen);
    if (chosen != expected) state.SkipWithError("decision changed");
  }
  state.SetLabel(c.op->backends[expected].name + " on " + c.x.device().str());
}

void BM_MakeKey(benchmark::State& state) {
  Dispatcher& d = Dispatcher::get();
  Call c(bench_device());
  BoundDims dims = check_call(c.op->contract, c.view);
  for (auto _ : state) benchmark::DoNotOptimize(d.make_key(c.op->id, c.view, dims));
}

}  // namespace

BENCHMARK_CAPTURE(BM_Select, reference_no_evidence, false);
BENCHMARK_CAPTURE(BM_Select, kernelgate_by_policy, true);
BENCHMARK(BM_MakeKey);
BENCHMARK_MAIN();
