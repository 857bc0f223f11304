// The C++ decision on a cached key. BM_Select is the decision alone (make_key + cached lookup +
// can_implement; target <= 100 ns); BM_CheckAndSelect adds the contract check (argument
// validation) that the router also runs on every call.
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

void run_select(benchmark::State& state, bool with_policy, bool with_check) {
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
    BoundDims b = with_check ? check_call(c.op->contract, c.view) : dims;
    int chosen = d.select(c.op->id, c.view, b);
    benchmark::DoNotOptimize(chosen);
    if (chosen != expected) state.SkipWithError("decision changed");
  }
  state.SetLabel(c.op->backends[expected].name + " on " + c.x.device().str());
}

void BM_Select(benchmark::State& state, bool with_policy) { run_select(state, with_policy, false); }
void BM_CheckAndSelect(benchmark::State& state, bool with_policy) {
  run_select(state, with_policy, true);
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
BENCHMARK_CAPTURE(BM_CheckAndSelect, reference_no_evidence, false);
BENCHMARK_CAPTURE(BM_CheckAndSelect, kernelgate_by_policy, true);
BENCHMARK(BM_MakeKey);
BENCHMARK_MAIN();
