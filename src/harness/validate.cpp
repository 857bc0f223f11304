// Validation of one backend on one case against the float64 oracle, and timing of passing runs.
//
// The backend runs through the op's public path (the torch op, with the backend forced), so what
// is validated is what a user's call executes. The oracle is the op's reference op
// (`kernelgate::_<op>_reference`) on float64 copies of the same (dtype-rounded) inputs; the
// reference backend at the tested dtype sets the error budget (tolerance rule: testing.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <mutex>
#include <optional>

#include "harness/clocks.h"
#include "harness/harness.h"
#include "harness/stats.h"
#include "kernelgate/dispatch.h"

#ifdef KERNELGATE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace kernelgate::harness {
namespace {

using at::Tensor;

// The tolerance rule, stated once (python/kernelgate/testing.py documents the why):
// metric(backend) <= kFactor * metric(reference at dtype) + floor(dtype), for the relative L2
// error and the max error over the oracle's rms; NaN/Inf patterns must match the oracle's.
constexpr double kFactor = 2.0;

double floor_for(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return 2 * std::ldexp(1.0, -11);
    case at::kBFloat16: return 2 * std::ldexp(1.0, -8);
    default: return 1e-5;
  }
}

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "float32") return at::kFloat;
  if (s == "float16") return at::kHalf;
  if (s == "bfloat16") return at::kBFloat16;
  TORCH_CHECK(false, "unknown dtype '", s, "'");
}

struct Metrics {
  double l2 = 0, mx = 0;
};

// Computed where the tensors live (the GPU for GPU cases: production shapes hold up to 2^28
// elements), masked by `finite` without compacting; one device-to-host copy.
Metrics metrics(const Tensor& got, const Tensor& oracle, const Tensor& finite) {
  if (oracle.numel() == 0) return {};
  const Tensor zero = at::zeros({}, oracle.options());
  const Tensor o = at::where(finite, oracle, zero);
  const Tensor diff = at::where(finite, (got.to(at::kDouble) - oracle).abs(), zero);
  const Tensor v =
      at::stack({finite.sum().to(at::kDouble), o.norm(), diff.norm(), diff.max()}).cpu();
  const double* d = v.data_ptr<double>();
  const double n = d[0], norm = d[1];
  if (n == 0) return {};
  const double rms = norm / std::sqrt(n);
  return {d[2] / (norm > 0 ? norm : 1.0), d[3] / (rms > 0 ? rms : 1.0)};
}

}  // namespace

OracleCheck check_against_oracle(const std::string& name, const Tensor& got_in,
                                 const Tensor& ref_in, const Tensor& oracle_in,
                                 at::ScalarType dtype) {
  OracleCheck out;
  auto fail = [&](std::string why) {
    out.failure = std::move(why);
    return out;
  };
  Tensor got = got_in.detach();
  Tensor ref = ref_in.detach().to(got.device());
  Tensor oracle = oracle_in.detach().to(got.device(), at::kDouble);
  if (got.sizes() != oracle.sizes()) {
    return fail(name + ": shape " + c10::str(got.sizes()) + " differs from the oracle's " +
                c10::str(oracle.sizes()));
  }
  if (got.scalar_type() != ref.scalar_type()) {
    return fail(name + ": dtype " + dtype_name(got.scalar_type()) +
                " differs from the reference's " + dtype_name(ref.scalar_type()));
  }
  Tensor gd = got.to(at::kDouble);
  if (!at::equal(gd.isnan(), oracle.isnan())) {
    return fail(name + ": NaN pattern differs from the oracle (" +
                std::to_string(gd.isnan().sum().item<int64_t>()) + " NaN in result, " +
                std::to_string(oracle.isnan().sum().item<int64_t>()) + " in oracle)");
  }
  // Infinities are the oracle's as the output's dtype holds it: a value past the dtype's range
  // (a float16 sum over 1e5) is an Inf in any correct result of that dtype.
  const Tensor held = oracle.to(got.scalar_type()).to(at::kDouble);
  Tensor oi = held.isinf(), gi = gd.isinf();
  if (!at::equal(oi, gi) ||
      !at::equal(held.masked_select(oi).sign(), gd.masked_select(gi).sign())) {
    return fail(name + ": Inf pattern differs from the oracle");
  }
  Tensor finite = held.isfinite();
  Metrics r = metrics(ref, oracle, finite & ref.to(at::kDouble).isfinite());
  Metrics g = metrics(got, oracle, finite);
  out.rel_l2 = g.l2;
  out.max_over_rms = g.mx;
  out.ref_rel_l2 = r.l2;
  out.ref_max_over_rms = r.mx;
  const double fl = floor_for(dtype);
  char buf[256];
  if (g.l2 > kFactor * r.l2 + fl) {
    std::snprintf(buf, sizeof(buf),
                  "%s: relative L2 error %.3e > %.1f x reference %.3e + floor %.1e", name.c_str(),
                  g.l2, kFactor, r.l2, fl);
    return fail(buf);
  }
  if (g.mx > kFactor * r.mx + fl) {
    std::snprintf(buf, sizeof(buf), "%s: max error / rms %.3e > %.1f x reference %.3e + floor %.1e",
                  name.c_str(), g.mx, kFactor, r.mx, fl);
    return fail(buf);
  }
  return out;
}

namespace {

// ---- inputs ----------------------------------------------------------------------------------

struct Inputs {
  std::vector<Tensor> leaves;  // per tensor argument (undefined if absent); gradients w.r.t. these
  std::vector<Tensor> args;    // what the op receives: views of the leaves
};

std::vector<int64_t> shape_of(const TensorArgSpec& spec, const OpContract& c, const Case& k) {
  std::vector<int64_t> shape;
  for (const DimSpec& d : spec.dims) {
    const std::string& n = c.named_dims[d.named_dim];
    TORCH_CHECK(k.dims.count(n), "case gives no size for dim '", n, "'");
    shape.push_back(k.dims.at(n));
  }
  return shape;
}

// The value of the op's int argument `ignore_index` for this case (its scalar or the schema
// default), if it has one.
std::optional<int64_t> ignore_index_of(const OpContract& c, const Case& k) {
  if (auto it = k.scalars.find("ignore_index"); it != k.scalars.end()) {
    return static_cast<int64_t>(it->second);
  }
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(("kernelgate::" + c.name).c_str(), "");
  for (const auto& arg : op.schema().arguments()) {
    if (arg.name() == "ignore_index" && arg.default_value() && arg.default_value()->isInt()) {
      return arg.default_value()->toInt();
    }
  }
  return std::nullopt;
}

// Standard-normal float64 values, seeded, drawn where they will live: on the GPU with a CUDA
// generator (the CPU generator is sequential; at production shapes it took tens of seconds a run).
Tensor seeded_randn(at::IntArrayRef shape, uint64_t seed, at::Device device) {
#ifdef KERNELGATE_WITH_CUDA
  if (device.is_cuda()) {
    at::Generator gen = at::cuda::detail::createCUDAGenerator(device.index());
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_current_seed(seed);
    }
    return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble).device(device));
  }
#endif
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble).device(device));
}

Tensor values(std::vector<int64_t> shape, const std::string& regime, uint64_t seed,
              at::Device device, at::ScalarType dtype) {
  Tensor v = seeded_randn(shape, seed, device);
  // Large, yet within what the dtype holds through an op's sums and products: float16 overflows
  // at 65504 (a matrix product of 5e3-scaled rows overflowed it for every backend, the reference
  // included, which taught nothing).
  if (regime == "large") v = v * (dtype == at::kHalf ? 300.0 : 5e3);
  if (regime == "small") v = v * 1e-4;
  if (regime == "offset") v = v * 0.01 + 3.0;
  // Special values in every shape that has an element: a NaN in the first row, an Inf in the
  // second (or at the end of the first), an all-zero third row.
  if (regime == "special" && v.numel() > 0) {
    const int64_t last = v.size(-1), rows = v.numel() / last;
    Tensor m = v.view({rows, last});
    m[0][0] = std::nan("");
    if (rows >= 2) {
      m[1][std::min<int64_t>(1, last - 1)] = INFINITY;
    } else if (last >= 2) {
      m[0][last - 1] = INFINITY;
    }
    if (rows >= 3) m[2].zero_();
  }
  return v;
}

// Builds the leaves at dtype on `device` and, from the same rounded values, the float64 leaves
// for the oracle. The case's layout applies to the first tensor argument where it is a matrix,
// and where it has three or more dims to every tensor argument of its rank (rope's q and k):
//   row_strided  the last dim padded by 5 in the leaf;   offset      one element into the leaf;
//   expanded     the first dim broadcast from size 1;
//   transposed   a matrix stored transposed; with more dims, dims -3 and -2 swapped in the
//                leaf (attention's [batch, seq, heads, head_dim] storage of [batch, heads, ...]).
std::pair<Inputs, Inputs> make_inputs(const OpContract& c, const Case& k, at::Device device,
                                      at::ScalarType dtype, bool with_values = true) {
  Inputs in, oracle;
  size_t first_rank = 0;
  for (size_t a = 0; a < c.tensor_args.size(); ++a) {
    const TensorArgSpec& spec = c.tensor_args[a];
    if (spec.optional && !k.with_optional) {
      in.leaves.emplace_back();
      in.args.emplace_back();
      oracle.leaves.emplace_back();
      oracle.args.emplace_back();
      continue;
    }
    std::vector<int64_t> full = shape_of(spec, c, k);
    const uint64_t seed = static_cast<uint64_t>(k.seed) * 1000003ull + a * 7919ull + 17;
    if (a == 0) first_rank = full.size();
    const bool laid_out = full.size() == 2 ? a == 0 : full.size() >= 3 && full.size() == first_rank;
    const std::string layout = laid_out && spec.dtype_class != DTypeClass::kIndex ? k.layout
                                                                                  : "contiguous";
    const int64_t rank = static_cast<int64_t>(full.size());
    int64_t numel = 1;
    for (int64_t n : full) numel *= n;
    std::vector<int64_t> leaf_shape = full;
    if (layout == "row_strided") leaf_shape.back() += 5;
    if (layout == "offset") leaf_shape = {numel + 1};
    if (layout == "transposed" && rank == 2) leaf_shape = {full[1], full[0]};
    if (layout == "transposed" && rank >= 3) std::swap(leaf_shape[rank - 3], leaf_shape[rank - 2]);
    if (layout == "expanded") leaf_shape[0] = 1;
    if (spec.dtype_class == DTypeClass::kIndex) {
      // Class indices in [0, bound), and the op's ignore_index in every 8th entry. Not a leaf:
      // no gradient flows to an index tensor.
      auto range = c.index_ranges.find(spec.name);
      TORCH_CHECK(range != c.index_ranges.end(), "op ", c.name, " gives no index range for ",
                  spec.name);
      const int64_t bound = std::max<int64_t>(k.dims.at(range->second), 1);
      Tensor idx;
      if (with_values) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
        idx = at::randint(0, bound, full, gen, at::TensorOptions().dtype(at::kLong));
        if (auto ignore = ignore_index_of(c, k); ignore && idx.numel() > 0) {
          idx.view(-1).slice(0, 0, idx.numel(), 8).fill_(*ignore);
        }
        idx = idx.to(device);
      } else {
        idx = at::empty(full, at::TensorOptions().device(device).dtype(at::kLong));
      }
      in.leaves.emplace_back();
      in.args.push_back(idx);
      oracle.leaves.emplace_back();
      oracle.args.push_back(idx);
      continue;
    }
    // The values are those of the call (the regime's pattern where the op sees it), placed in a
    // leaf of the layout.
    auto leaf_of = [&](const Tensor& logical) -> Tensor {
      if (layout == "row_strided") {
        Tensor l = seeded_randn(leaf_shape, seed + 1, device);
        l.narrow(-1, 0, full.back()).copy_(logical);
        return l;
      }
      if (layout == "offset") {
        Tensor l = seeded_randn(leaf_shape, seed + 1, device);
        l.narrow(0, 1, logical.numel()).copy_(logical.reshape(-1));
        return l;
      }
      if (layout == "transposed" && rank == 2) return logical.t().contiguous();
      if (layout == "transposed") return logical.transpose(-3, -2).contiguous();
      if (layout == "expanded") return logical.narrow(0, 0, 1).clone();
      return logical;
    };
    Tensor leaf =
        with_values
            ? leaf_of(values(full, a == 0 ? k.regime : "normal", seed, device, dtype)).to(dtype)
            : at::empty(leaf_shape, at::TensorOptions().device(device).dtype(dtype));
    leaf = leaf.detach().requires_grad_(k.grad);
    Tensor leaf64 = with_values ? leaf.detach().to(at::kDouble).requires_grad_(k.grad) : Tensor();
    auto view = [&](const Tensor& t) -> Tensor {
      if (layout == "row_strided") return t.narrow(-1, 0, full.back());
      if (layout == "offset") return t.narrow(0, 1, numel).view(full);
      if (layout == "transposed" && rank == 2) return t.t();
      if (layout == "transposed") return t.transpose(-3, -2);
      if (layout == "expanded") return t.expand(full);
      return t;
    };
    in.leaves.push_back(leaf);
    in.args.push_back(view(leaf));
    oracle.leaves.push_back(leaf64);
    oracle.args.push_back(leaf64.defined() ? view(leaf64) : Tensor());
  }
  return {in, oracle};
}

// What the router sees of the case's call (pointers into `in`, which must outlive it).
CallView call_view(const OpContract& c, const Case& k, const Inputs& in) {
  CallView call;
  call.num_tensors = static_cast<int>(in.args.size());
  for (size_t a = 0; a < in.args.size(); ++a) {
    call.tensors[a] = in.args[a].defined() ? &in.args[a] : nullptr;
  }
  call.grad = k.grad;
  call.variant = variant_of(c, k.strings);
  return call;
}

// ---- running the op --------------------------------------------------------------------------

// The op's arguments for a case, in schema order: the tensors, the case's scalars and strings,
// the schema's defaults for the rest.
std::vector<c10::IValue> op_arguments(const c10::OperatorHandle& op, const OpContract& c,
                                      const Case& k, const std::vector<Tensor>& args) {
  std::vector<c10::IValue> stack;
  for (const auto& arg : op.schema().arguments()) {
    auto it = std::find_if(c.tensor_args.begin(), c.tensor_args.end(),
                           [&](const TensorArgSpec& s) { return s.name == arg.name(); });
    if (it != c.tensor_args.end()) {
      const Tensor& t = args[it - c.tensor_args.begin()];
      stack.emplace_back(t.defined() ? c10::IValue(t) : c10::IValue());
    } else if (k.scalars.count(arg.name())) {
      const double v = k.scalars.at(arg.name());
      if (arg.type()->kind() == c10::TypeKind::IntType) {
        stack.emplace_back(static_cast<int64_t>(v));
      } else {
        stack.emplace_back(v);
      }
    } else if (k.strings.count(arg.name())) {
      stack.emplace_back(k.strings.at(arg.name()));
    } else {
      TORCH_CHECK(arg.default_value().has_value(), "case gives no value for ", arg.name());
      stack.push_back(*arg.default_value());
    }
  }
  return stack;
}

std::vector<Tensor> call_op(const std::string& qualified, const OpContract& c, const Case& k,
                            const std::vector<Tensor>& args) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), "");
  std::vector<c10::IValue> stack = op_arguments(op, c, k, args);
  op.callBoxed(stack);
  std::vector<Tensor> out;
  for (const auto& v : stack) {
    if (v.isTensor()) out.push_back(v.toTensor());
    if (v.isTuple()) {
      for (const auto& e : v.toTupleRef().elements()) out.push_back(e.toTensor());
    }
  }
  return out;
}

// Outputs then gradients (w.r.t. each present leaf), for one run.
std::vector<Tensor> forward_backward(const std::string& qualified, const OpContract& c,
                                     const Case& k, const Inputs& in,
                                     const std::vector<Tensor>& cotangents) {
  std::vector<Tensor> out = call_op(qualified, c, k, in.args);
  if (!k.grad) return out;
  std::vector<Tensor> leaves, outs, cots;
  for (const Tensor& l : in.leaves) {
    if (l.defined()) leaves.push_back(l);
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].requires_grad()) {
      outs.push_back(out[i]);
      cots.push_back(cotangents[i].to(out[i].device(), out[i].scalar_type()));
    }
  }
  auto grads = torch::autograd::grad(outs, leaves, cots, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
  for (size_t i = 0; i < grads.size(); ++i) {
    out.push_back(grads[i].defined() ? grads[i] : at::zeros_like(leaves[i]));
  }
  return out;
}

void poison_device_memory(at::Device device) {
#ifdef KERNELGATE_WITH_CUDA
  // NaN into the caching allocator's free blocks, so an output element a kernel never writes
  // reads as NaN. (On the CPU the worker installs a poisoning allocator instead.)
  if (device.is_cuda()) {
    std::vector<Tensor> blocks;
    blocks.push_back(at::empty({int64_t{1} << 26}, at::TensorOptions().device(device)));
    for (int i = 0; i < 16; ++i) {
      blocks.push_back(
          at::empty({(int64_t{1} << 18) - 64 * i}, at::TensorOptions().device(device)));
    }
    for (auto& b : blocks) b.fill_(std::nan(""));
  }
#endif
  (void)device;
}

struct ForcedBackend {
  Dispatcher::Overrides saved;
  ForcedBackend(const std::string& op, const std::string& backend)
      : saved(Dispatcher::get().overrides()) {
    Dispatcher::get().force(op, backend);
  }
  ~ForcedBackend() { Dispatcher::get().set_overrides(saved); }
};

// ---- timing ----------------------------------------------------------------------------------

bool g_device_state_suspect = false;

#ifdef KERNELGATE_WITH_CUDA
// Ends a capture that an exception interrupted, so the stream is usable again.
void abort_capture(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone) {
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(stream, &partial);
    if (partial != nullptr) cudaGraphDestroy(partial);
  }
  (void)cudaGetLastError();
}
#endif

SamplingPolicy sampling(const RunOptions& o) {
  SamplingPolicy p;
  p.target_rel_noise = o.target_rel_noise;
  p.time_cap_s = o.time_cap_s;
  return p;
}

void time_run(const std::function<void()>& fn, at::Device device, const RunOptions& o,
              Measured* m) {
  Sampler eager(sampling(o)), dev(sampling(o));
  for (int i = 0; i < 3; ++i) fn();  // warm-up
#ifdef KERNELGATE_WITH_CUDA
  if (device.is_cuda()) {
    m->clocks_before = read_clocks(device.index()).text;
    Tensor flush = at::empty({256 << 20}, at::TensorOptions().device(device).dtype(at::kByte));
    auto timed = [&](const std::function<void()>& body) {
      flush.zero_();  // L2 flushed between samples
      at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
      auto stream = at::cuda::getCurrentCUDAStream(device.index());
      start.record(stream);
      body();
      stop.record(stream);
      stop.synchronize();
      return static_cast<double>(start.elapsed_time(stop)) * 1000.0;
    };
    while (!eager.done()) eager.add(timed(fn));
    // Captured on the worker's own stream (prepare_worker_device): the inputs, the autograd
    // nodes and the capture share one non-default stream, so nothing in the capture waits on
    // the legacy default stream. Relaxed mode: a backend's benign queries (occupancy,
    // attributes) are not capture errors.
    auto stream = at::cuda::getCurrentCUDAStream(device.index());
    try {
      at::cuda::CUDAGraph graph;
      graph.capture_begin({0, 0}, cudaStreamCaptureModeRelaxed);
      try {
        fn();
        graph.capture_end();
      } catch (...) {
        abort_capture(stream);
        throw;
      }
      stream.synchronize();
      while (!dev.done()) dev.add(timed([&] { graph.replay(); }));
    } catch (const c10::Error& e) {
      m->reason = std::string("device time not measured: graph capture failed: ") +
                  e.what_without_backtrace();
      g_device_state_suspect =
          true;  // the worker answers, then exits: the next case gets a fresh one
    }
    ClockReading after = read_clocks(device.index());
    m->clocks_after = after.text;
    m->throttled = after.throttled;
  } else
#endif
  {
    auto timed = [&](const std::function<void()>& body) {
      auto t0 = std::chrono::steady_clock::now();
      body();
      return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
          .count();
    };
    while (!eager.done()) eager.add(timed(fn));
    dev = eager;  // no graphs on the CPU: the call is the device time
  }
  Summary e = eager.summary();
  m->eager_median_us = e.median;
  m->eager_spread_us = e.p90 - e.p10;
  m->eager_samples = e.n;
  if (dev.summary().n > 0) {
    Summary d = dev.summary();
    m->device_median_us = d.median;
    m->device_spread_us = d.p90 - d.p10;
    m->device_samples = d.n;
    m->rel_noise = d.rel_noise;
  }
}

}  // namespace

bool device_state_suspect() { return g_device_state_suspect; }

void prepare_worker_device() {
#ifdef KERNELGATE_WITH_CUDA
  // A stream of the worker's own, current for all its work: CUDA-graph capture needs a
  // non-default stream, and inputs made on it keep autograd off the legacy default stream.
  if (at::cuda::is_available())
    at::cuda::setCurrentCUDAStream(at::cuda::getStreamFromPool(false, 0));
#endif
}

std::string case_region(const Case& k, int arch) {
  const OpEntry* e = Dispatcher::get().find_op(k.op);
  if (e == nullptr) return "";
  // Meta tensors with the case's layout: the key needs shapes, strides and alignment only.
  Inputs in = make_inputs(e->contract, k, at::Device(at::kMeta), parse_dtype(k.dtype), false).first;
  CallView call = call_view(e->contract, k, in);
  DispatchKey key = Dispatcher::get().make_key(e->id, call, check_call(e->contract, call));
  key.arch = static_cast<int16_t>(arch);
  return describe_key(key);
}

CaseArguments case_arguments(const Case& k, bool on_gpu, bool float64) {
  const OpEntry* e = Dispatcher::get().find_op(k.op);
  TORCH_CHECK(e != nullptr, "unknown op '", k.op, "'");
  at::Device device = on_gpu ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  auto [in, oracle] = make_inputs(e->contract, k, device, parse_dtype(k.dtype));
  const Inputs& chosen = float64 ? oracle : in;
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(("kernelgate::" + k.op).c_str(), "");
  return {op_arguments(op, e->contract, k, chosen.args), chosen.leaves};
}

Measured run_case(const Case& k, const std::string& backend, const RunOptions& options) {
  Measured m;
  try {
    Dispatcher& d = Dispatcher::get();
    const OpEntry* e = d.find_op(k.op);
    if (e == nullptr) return {store::Disposition::kUnsupported, "unknown op '" + k.op + "'"};
    const OpContract& c = e->contract;
    const at::ScalarType dtype = parse_dtype(k.dtype);
    at::Device device = at::kCPU;
#ifdef KERNELGATE_WITH_CUDA
    if (at::cuda::is_available()) device = at::Device(at::kCUDA, 0);
#endif
    auto [in, oracle_in] = make_inputs(c, k, device, dtype);

    // Which region the call falls in, and whether the backend serves it when forced.
    CallView call = call_view(c, k, in);
    BoundDims dims = check_call(c, call);
    DispatchKey key = d.make_key(e->id, call, dims);
    m.region = describe_key(key);
    m.arch = key.arch;
    m.align = align_class_name(key.align);
    for (size_t i = 0; i < c.named_dims.size(); ++i) {
      m.buckets += (i ? "," : "") + std::to_string(key.buckets[i]);
    }
    {
      ForcedBackend force(k.op, backend);
      Explanation ex = d.explain(e->id, call, dims);
      if (ex.backend != backend) {
        for (const auto& cand : ex.candidates) {
          if (cand.backend == backend) m.reason = cand.reason;
        }
        if (m.reason.empty()) m.reason = "no backend '" + backend + "' for " + k.op;
        m.disposition = store::Disposition::kUnsupported;
        return m;
      }
    }
    // Cotangents, seeded like the inputs, made once on the device in each output's dtype: no
    // copy or cast of them inside a timed region or a graph capture.
    const std::string qualified = "kernelgate::" + k.op;
    std::vector<Tensor> cot;
    {
      ForcedBackend force(k.op, "reference");
      for (const Tensor& t : call_op(qualified, c, k, in.args)) {
        cot.push_back(seeded_randn(t.sizes(), static_cast<uint64_t>(k.seed) + 99991, t.device())
                          .to(t.scalar_type()));
      }
    }
    std::vector<Tensor> ref, got, ora;
    {
      ForcedBackend force(k.op, "reference");
      ref = forward_backward(qualified, c, k, in, cot);
    }
    {
      ForcedBackend force(k.op, backend);
      // A decoy call on other values of the same shape first: a backend that returns a buffer
      // from its previous call returns the decoy's result and fails.
      Case decoy_case = k;
      decoy_case.seed = k.seed + 7777777;
      auto decoy = make_inputs(c, decoy_case, device, dtype).first;
      forward_backward(qualified, c, decoy_case, decoy, cot);
      poison_device_memory(device);
      got = forward_backward(qualified, c, k, in, cot);
    }
    ora = forward_backward("kernelgate::_" + k.op + "_reference", c, k, oracle_in, cot);
    if (got.size() != ora.size()) {
      return {store::Disposition::kIncorrect, "returned " + std::to_string(got.size()) +
                                                  " tensors, the oracle " +
                                                  std::to_string(ora.size())};
    }
    std::vector<std::string> names;
    for (size_t i = 0; i < got.size(); ++i) names.push_back("output " + std::to_string(i));
    if (k.grad) {  // the trailing entries are gradients, one per present input
      size_t g = got.size();
      for (size_t a = in.leaves.size(); a-- > 0;) {
        if (in.leaves[a].defined()) names[--g] = "grad of " + c.tensor_args[a].name;
      }
    }
    for (size_t i = 0; i < got.size(); ++i) {
      const std::string& name = names[i];
      const OracleCheck ok = check_against_oracle(name, got[i], ref[i], ora[i], dtype);
      m.max_rel_l2 = std::max(m.max_rel_l2, ok.rel_l2);
      m.max_max_over_rms = std::max(m.max_max_over_rms, ok.max_over_rms);
      if (!ok.failure.empty()) {
        m.disposition = store::Disposition::kIncorrect;
        m.reason = ok.failure;
        return m;
      }
    }
    if (options.time) {
      ForcedBackend force(k.op, backend);
      time_run([&] { forward_backward(qualified, c, k, in, cot); }, device, options, &m);
    }
  } catch (const c10::OutOfMemoryError& e) {
    m.disposition = store::Disposition::kOutOfMemory;
    m.reason = e.what_without_backtrace();
  } catch (const c10::Error& e) {
    m.disposition = store::Disposition::kCrashed;
    m.reason = std::string("raised: ") + e.what_without_backtrace();
  } catch (const std::exception& e) {
    m.disposition = store::Disposition::kCrashed;
    m.reason = std::string("raised: ") + e.what();
  }
  return m;
}

}  // namespace kernelgate::harness
