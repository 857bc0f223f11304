// kernelgate._C: the Python face of the dispatcher. Loading it registers the kernelgate ops
// (libkernelgate is linked in). Everything here is off the hot path: ops are called through
// torch.ops.kernelgate.
#include <torch/csrc/Dtype.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>

#include "harness/evidence.h"
#include "harness/harness.h"
#include "harness/sweep.h"
#include "harness/worker_pool.h"
#include "kernelgate/kernelgate.h"
#include "python/python_ops.h"
#include "store/store.h"

namespace py = pybind11;

namespace kernelgate {
namespace {

const OpEntry& find(const std::string& name) {
  const OpEntry* e = Dispatcher::get().find_op(name);
  if (e == nullptr) {
    std::string known;
    for (const auto& n : Dispatcher::get().op_names()) known += (known.empty() ? "" : ", ") + n;
    throw py::value_error("unknown op '" + name + "'; kernelgate has: " + known);
  }
  return *e;
}

// Tensor arguments in contract order; None for an absent optional.
CallView to_call(const OpEntry& e, const std::vector<std::optional<at::Tensor>>& tensors, bool grad,
                 std::vector<at::Tensor>& keep) {
  if (tensors.size() != e.contract.tensor_args.size()) {
    throw py::value_error(e.contract.name + " takes " +
                          std::to_string(e.contract.tensor_args.size()) +
                          " tensor arguments, got " + std::to_string(tensors.size()));
  }
  keep.reserve(tensors.size());
  CallView call;
  call.num_tensors = static_cast<int>(tensors.size());
  call.grad = grad;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].has_value()) {
      keep.push_back(*tensors[i]);
      call.tensors[i] = &keep.back();
    }
  }
  return call;
}

// `device`: the device the call would run on, when the tensors stand for it (meta tensors).
py::dict explain(const std::string& op, const std::vector<std::optional<at::Tensor>>& tensors,
                 bool grad, const std::map<std::string, std::string>& strings,
                 const std::optional<std::string>& device) {
  const OpEntry& e = find(op);
  std::vector<at::Tensor> keep;
  CallView call = to_call(e, tensors, grad, keep);
  call.variant = variant_of(e.contract, strings);
  if (device) call.on = c10::Device(*device);
  BoundDims dims = check_call(e.contract, call);
  Explanation ex = Dispatcher::get().explain(e.id, call, dims);
  py::list cands;
  for (const auto& c : ex.candidates) {
    py::dict d;
    d["backend"] = c.backend;
    d["kind"] = c.kind;
    d["selected"] = c.selected;
    d["reason"] = c.reason;
    cands.append(d);
  }
  py::dict out;
  out["op"] = ex.op;
  out["key"] = ex.key;
  out["backend"] = ex.backend;
  out["reason"] = ex.reason;
  out["candidates"] = cands;
  out["evidence_problems"] = ex.evidence_problems;
  return out;
}

py::list ops() {
  py::list out;
  Dispatcher& d = Dispatcher::get();
  for (const auto& name : d.op_names()) {
    const OpEntry& e = *d.find_op(name);
    py::list backends;
    for (size_t i = 0; i < e.backends.size(); ++i) {
      py::dict b;
      b["name"] = e.backends[i].name;
      b["kind"] = backend_kind_name(e.backends[i].kind);
      b["available"] = e.availability[i].ok;
      b["reason"] = std::string(e.availability[i].reason);
      b["version"] = e.backends[i].version;
      b["has_backward"] = e.backends[i].impl ? e.backends[i].impl->has_backward() : false;
      backends.append(b);
    }
    py::list dtypes;
    for (auto t : e.contract.dtypes) dtypes.append(dtype_name(t));
    py::dict scalars;
    for (const auto& [n, v] : e.contract.scalar_test_values) scalars[py::str(n)] = v;
    py::list targs;
    for (const auto& a : e.contract.tensor_args) targs.append(a.name);
    py::dict o;
    o["name"] = name;
    o["schema"] = e.contract.schema;
    o["dims"] = e.contract.dims;
    o["tensor_args"] = targs;
    o["named_dims"] = e.contract.named_dims;
    o["dtypes"] = dtypes;
    o["scalar_test_values"] = scalars;
    o["backends"] = backends;
    // The protocol a backend implements (docs/adding_an_op.md).
    o["forward_schema"] = e.contract.forward_schema;
    o["backward_schema"] = e.contract.backward_schema;
    o["outputs"] = e.contract.outputs;
    o["extras"] = e.contract.extras;
    o["saved"] = e.contract.saved;
    py::list diff;
    for (const auto& a : e.contract.tensor_args) {
      if (a.differentiable && !e.contract.shared_grads.count(a.name)) diff.append(a.name);
    }
    o["gradients"] = diff;
    o["variant_args"] = e.contract.variant_args;
    o["production_shapes"] = e.contract.production_shapes;
    o["production_layouts"] = e.contract.production_layouts;
    o["production_optionals"] = e.contract.production_optionals;
    o["defined_in_python"] = !e.contract.source_hash.empty();
    out.append(o);
  }
  return out;
}

using Pairs = std::vector<std::pair<std::string, std::string>>;

void set_log_hook(py::object fn) {
  if (fn.is_none()) {
    Dispatcher::get().set_log_hook(nullptr);
    return;
  }
  // The hook may run on any thread that calls an op; take the GIL, and never let a Python error
  // escape into the dispatcher.
  auto holder = std::make_shared<py::object>(std::move(fn));
  Dispatcher::get().set_log_hook(
      [holder](LogLevel level, const std::string& op, const std::string& msg) {
        if (!Py_IsInitialized()) return;
        py::gil_scoped_acquire gil;
        try {
          (*holder)(level == LogLevel::kWarning ? "warning" : "info", op, msg);
        } catch (py::error_already_set& err) {
          err.discard_as_unraisable("kernelgate log hook");
        }
      });
}

py::dict fingerprint_dict(const store::Fingerprint& f) {
  py::dict d;
  d["id"] = f.id();
  d["gpu_name"] = f.gpu_name;
  d["compute_capability"] = f.compute_capability;
  d["sm_count"] = f.sm_count;
  d["memory_bytes"] = f.memory_bytes;
  d["driver"] = f.driver;
  d["cuda_runtime"] = f.cuda_runtime;
  d["torch_version"] = f.torch_version;
  d["kernelgate_version"] = f.kernelgate_version;
  d["source_hash"] = f.source_hash;
  d["backend_versions"] = f.backend_versions;
  return d;
}

// The id a fingerprint with these fields has (fingerprint_dict's keys; "id" is ignored): for
// tools and tests that write evidence under another machine's fingerprint.
std::string fingerprint_id(const py::dict& d) {
  store::Fingerprint f;
  f.gpu_name = d["gpu_name"].cast<std::string>();
  f.compute_capability = d["compute_capability"].cast<std::string>();
  f.sm_count = d["sm_count"].cast<int>();
  f.memory_bytes = d["memory_bytes"].cast<int64_t>();
  f.driver = d["driver"].cast<std::string>();
  f.cuda_runtime = d["cuda_runtime"].cast<std::string>();
  f.torch_version = d["torch_version"].cast<std::string>();
  f.kernelgate_version = d["kernelgate_version"].cast<std::string>();
  f.source_hash = d["source_hash"].cast<std::string>();
  f.backend_versions = d["backend_versions"].cast<std::map<std::string, std::string>>();
  return f.id();
}

py::dict run_sweep(const std::string& op, const std::vector<std::string>& backends,
                   const std::vector<std::string>& dtypes, const std::string& grid, int seeds,
                   int shard_index, int shard_count, const std::string& db, bool time,
                   double case_timeout_s, double time_cap_s,
                   const std::vector<std::string>& worker_argv, const std::string& command,
                   py::object progress,
                   const std::vector<std::pair<std::string, std::string>>& only) {
  harness::SweepOptions o;
  o.only.insert(only.begin(), only.end());
  o.op = op;
  o.backends = backends;
  o.dtypes = dtypes;
  if (grid != "smoke" && grid != "quick" && grid != "full") {
    throw py::value_error("grid must be 'smoke', 'quick' or 'full', got '" + grid + "'");
  }
  o.grid = grid == "full"    ? harness::Grid::kFull
           : grid == "smoke" ? harness::Grid::kSmoke
                             : harness::Grid::kQuick;
  o.seeds = seeds;
  o.shard_index = shard_index;
  o.shard_count = shard_count;
  o.db_path = db;
  o.time = time;
  o.case_timeout_s = case_timeout_s;
  o.time_cap_s = time_cap_s;
  o.worker_argv = worker_argv;
  o.command = command;
  if (!progress.is_none()) {
    o.progress = [progress](int done, int total, const std::string& what) {
      py::gil_scoped_acquire gil;
      progress(done, total, what);
    };
  }
  // Ctrl-C reaches Python's handler, which only flags it: the sweep asks between polls, and
  // stops with what it stored kept; the KeyboardInterrupt is raised here.
  bool interrupted = false;
  o.interrupted = [&interrupted] {
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) interrupted = true;
    return interrupted;
  };
  harness::SweepReport r;
  try {
    py::gil_scoped_release release;
    r = harness::sweep(o);
  } catch (const harness::Interrupted&) {
    if (PyErr_Occurred() == nullptr) PyErr_SetNone(PyExc_KeyboardInterrupt);
    throw py::error_already_set();
  }
  py::dict d;
  d["fingerprint_id"] = r.fingerprint_id;
  d["fingerprint_ids"] = r.fingerprint_ids;
  d["planned"] = r.planned;
  d["skipped"] = r.skipped;
  d["dispositions"] = r.dispositions;
  d["worker_restarts"] = r.worker_restarts;
  d["seconds"] = r.seconds;
  return d;
}

// What `kernelgate rerank` runs for `op`: the (backend, case id) runs that borrowed evidence
// shows correct and its lender timed, which the user's store does not hold
// (UsableEvidence::to_rerank: not those far slower on the lender).
std::vector<std::pair<std::string, std::string>> rerank_plan(
    const std::string& op, const std::string& db, const std::vector<std::string>& shipped) {
  const auto evidence = harness::usable_evidence(db, shipped, harness::current_fingerprints(op));
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [o, backend, case_id] : evidence.to_rerank) {
    if (o == op) out.emplace_back(backend, case_id);
  }
  return out;
}

// The regions the dispatcher's evidence source (LazyEvidencePolicy) would load for `op`: the
// same usable evidence, the same derivation, each region with the provenance explain shows.
py::dict policy_regions(const std::string& op, const std::string& db,
                        const std::vector<std::string>& shipped) {
  const auto evidence = harness::usable_evidence(db, shipped, harness::current_fingerprints(op));
  py::list notes;
  for (const auto& p : evidence.problems) notes.append(p);
  for (const auto& n : evidence.notes) notes.append(n);
  auto derived = harness::derive_policy(evidence);  // set by set; listed by region, as ever
  std::stable_sort(derived.begin(), derived.end(),
                   [](const auto& a, const auto& b) { return a.region < b.region; });
  py::list regions;
  for (const auto& r : derived) {
    py::list standings;
    for (const auto& s : r.standings) {
      py::dict d;
      d["backend"] = s.backend;
      d["cases"] = s.cases;
      d["passed"] = s.passed;
      d["failures"] = s.failures;
      d["first_failure"] = s.first_failure;
      d["score_us"] = s.score_us;
      d["noise"] = s.noise;
      standings.append(d);
    }
    py::dict d;
    d["op"] = r.op;
    d["region"] = r.region;
    d["ranked"] = r.ranked;
    d["comparison"] = r.comparison;
    d["margin"] = r.margin;
    d["standings"] = standings;
    d["evidence"] = r.evidence;
    regions.append(d);
  }
  py::dict out;
  out["notes"] = notes;
  out["regions"] = regions;
  return out;
}

store::Store& must_open(std::optional<store::OpenResult>& holder, const std::string& path,
                        store::Mode mode) {
  holder = store::Store::open(path, mode);
  if (!*holder) throw std::runtime_error(holder->problem);
  return *holder->store;
}

py::dict store_status(const std::string& db) {
  py::dict d;
  d["path"] = db;
  d["fingerprint"] = fingerprint_dict(harness::current_fingerprint());
  auto opened = store::Store::open(db, store::Mode::kReadOnly);
  d["usable"] = static_cast<bool>(opened);
  d["problem"] = opened.problem;
  if (!opened) return d;
  // Each (op, backend)'s evidence has its own fingerprint: a stored one is stale for the rows
  // that are current for none.
  const auto standing = harness::store_standing(*opened.store, harness::current_fingerprints());
  d["schema_version"] = opened.store->schema_version();
  d["current_results"] = standing.current_results;
  py::list stale;
  for (const auto& s : standing.stale) {
    py::dict e;
    e["id"] = s.id;
    e["gpu_name"] = s.fingerprint.gpu_name;
    e["runs"] = s.runs;
    e["results"] = s.results;
    e["why_stale"] = s.differences;
    stale.append(e);
  }
  d["stale"] = stale;
  return d;
}

py::dict merge_stats(const store::MergeStats& s) {
  py::dict d;
  d["fingerprints_added"] = s.fingerprints_added;
  d["runs_added"] = s.runs_added;
  d["results_added"] = s.results_added;
  d["results_skipped"] = s.results_skipped;
  return d;
}

}  // namespace
}  // namespace kernelgate

PYBIND11_MODULE(_C, m) {
  using namespace kernelgate;
  m.doc() = "kernelgate engine bindings";
  m.def("ops", &ops, "Ops, their contracts and backends with availability");
  m.def("explain", &explain, py::arg("op"), py::arg("tensors"), py::arg("grad") = false,
        py::arg("strings") = std::map<std::string, std::string>{}, py::arg("device") = py::none(),
        "The decision for a call, with every candidate's reason");
  m.def("force",
        [](const std::string& op, const std::string& b) { Dispatcher::get().force(op, b); });
  m.def("exclude",
        [](const std::string& op, const std::string& b) { Dispatcher::get().exclude(op, b); });
  m.def("get_overrides", [] {
    auto o = Dispatcher::get().overrides();
    return std::make_pair(o.forced, o.excluded);
  });
  m.def("set_overrides", [](const Pairs& forced, const Pairs& excluded) {
    Dispatcher::get().set_overrides({forced, excluded});
  });
  m.def("apply_env", [] { Dispatcher::get().apply_env(); });
  m.def("set_log_hook", &set_log_hook);
  m.def("reset_log_once", [] { Dispatcher::get().reset_log_once(); });
  m.def(
      "add_policy_rule",
      [](const std::string& op, const std::vector<std::string>& ranked, int arch, py::object dtype,
         const std::vector<int>& max_buckets, int align, int grad, const std::string& evidence) {
        find(op);
        int st = -1;
        if (!dtype.is_none()) {
          if (!THPDtype_Check(dtype.ptr()))
            throw py::type_error("dtype must be a torch.dtype or None");
          st = static_cast<int>(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type);
        }
        PolicyRule r{op, arch, st, max_buckets, align, grad, ranked, evidence};
        Dispatcher::get().add_policy_rule(std::move(r));
      },
      py::arg("op"), py::arg("ranked"), py::arg("arch") = -2, py::arg("dtype") = py::none(),
      py::arg("max_buckets") = std::vector<int>{}, py::arg("align") = -1, py::arg("grad") = -1,
      py::arg("evidence") = "");
  m.def("clear_policy", [] { Dispatcher::get().clear_policy(); });
  m.def("describe_policy", [] { return Dispatcher::get().describe_policy(); });
  m.def("generation", [] { return Dispatcher::get().generation(); },
        "Changes with every change of policy or overrides (for caches of decisions)");
  m.def("cuda_arch", &cuda_arch);
  m.def(
      "fingerprint",
      [](const std::string& op, const std::string& backend) {
        return fingerprint_dict(harness::current_fingerprint(op, backend));
      },
      py::arg("op") = "", py::arg("backend") = "");
  // Bytes: KERNELGATE_DB may be any bytes (Python decodes them as file names: os.fsdecode).
  m.def("default_db_path", [] { return py::bytes(store::Store::default_path()); });
  m.def("op_source_files", &harness::op_source_files);
  m.def("sweep", &run_sweep);
  m.def("load_plugin", [](const std::string& path) { harness::load_backend_plugin(path); });
  m.def("policy_regions", &policy_regions);
  m.def("rerank_plan", &rerank_plan);
  m.def("fingerprint_id", &fingerprint_id);
  m.def("store_status", &store_status);
  m.def("db_merge", [](const std::string& db, const std::string& other) {
    std::optional<store::OpenResult> h;
    return merge_stats(must_open(h, db, store::Mode::kReadWrite).merge(other));
  });
  m.def("db_export", [](const std::string& db, const std::string& path) {
    std::optional<store::OpenResult> h;
    must_open(h, db, store::Mode::kReadOnly).export_json(path);
  });
  m.def("db_import", [](const std::string& db, const std::string& path) {
    std::optional<store::OpenResult> h;
    return merge_stats(must_open(h, db, store::Mode::kReadWrite).import_json(path));
  });
  m.def("use_evidence", [](const std::string& db, const std::vector<std::string>& shipped) {
    Dispatcher::get().set_policy(std::make_shared<harness::LazyEvidencePolicy>(db, shipped));
  });
  // The harness in this process (tests; the contract suite): cases, one run, a case's call, and
  // the tolerance rule.
  m.def(
      "make_cases",
      [](const std::string& op, const std::string& grid, const std::vector<std::string>& dtypes,
         int seeds, int64_t max_elements) {
        if (grid != "smoke" && grid != "quick" && grid != "full") {
          throw py::value_error("grid must be 'smoke', 'quick' or 'full', got '" + grid + "'");
        }
        const auto g = grid == "full"    ? harness::Grid::kFull
                       : grid == "smoke" ? harness::Grid::kSmoke
                                         : harness::Grid::kQuick;
        std::vector<std::pair<std::string, std::string>> out;
        for (const auto& c : harness::make_cases(op, g, dtypes, seeds, max_elements)) {
          out.emplace_back(c.id() + "/seed=" + std::to_string(c.seed), c.encode());
        }
        return out;
      },
      py::arg("op"), py::arg("grid") = "smoke", py::arg("dtypes") = std::vector<std::string>{},
      py::arg("seeds") = 1, py::arg("max_elements") = int64_t{1} << 20);
  m.def(
      "run_case",
      [](const std::string& encoded, const std::string& backend, bool time) {
        std::string problem;
        auto c = harness::Case::decode(encoded, &problem);
        if (!c) throw py::value_error("bad case: " + problem);
        harness::RunOptions o;
        o.time = time;
        harness::Measured m;
        {
          py::gil_scoped_release release;
          m = harness::run_case(*c, backend, o);
        }
        py::dict d;
        d["disposition"] = std::string(store::to_string(m.disposition));
        d["reason"] = m.reason;
        d["region"] = m.region;
        d["max_rel_l2"] = m.max_rel_l2;
        d["max_max_over_rms"] = m.max_max_over_rms;
        return d;
      },
      py::arg("case"), py::arg("backend"), py::arg("time") = false);
  m.def(
      "case_arguments",
      [](const std::string& encoded, bool on_gpu, bool float64) {
        std::string problem;
        auto c = harness::Case::decode(encoded, &problem);
        if (!c) throw py::value_error("bad case: " + problem);
        auto a = harness::case_arguments(*c, on_gpu, float64);
        py::list args;
        for (const auto& v : a.args) args.append(torch::jit::toPyObject(v));
        py::list leaves;
        for (const auto& t : a.leaves) leaves.append(t.defined() ? py::cast(t) : py::none());
        return py::make_tuple(args, leaves);
      },
      py::arg("case"), py::arg("on_gpu") = false, py::arg("float64") = false);
  m.def("check_against_oracle",
        [](const std::string& name, const at::Tensor& got, const at::Tensor& ref,
           const at::Tensor& oracle, py::object dtype) {
          if (!THPDtype_Check(dtype.ptr())) throw py::type_error("dtype must be a torch.dtype");
          auto r = harness::check_against_oracle(
              name, got, ref, oracle, reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type);
          py::dict d;
          d["failure"] = r.failure;
          d["rel_l2"] = r.rel_l2;
          d["max_over_rms"] = r.max_over_rms;
          d["ref_rel_l2"] = r.ref_rel_l2;
          d["ref_max_over_rms"] = r.ref_max_over_rms;
          return d;
        });
  m.def("fast_op", [](const std::string& name, py::object fallback) {
    auto op = std::make_shared<FastOp>(name);
    // A builtin function (torch.compile can substitute it), falling back to `fallback` (the
    // torch.ops overload) for what it does not take.
    return py::cpp_function(
        [op, fallback](py::args args, py::kwargs kwargs) -> py::object {
          if (kwargs.empty()) {
            py::object out = op->call(args);
            if (!out.is(py::handle(Py_NotImplemented))) return out;
          }
          return fallback(*args, **kwargs);
        },
        py::name(name.c_str()));
  });
  m.def("register_backend", &register_python_backend, py::arg("op"), py::arg("name"),
        py::arg("forward"), py::arg("backward"), py::arg("can_implement"), py::arg("requirements"),
        py::arg("available"), py::arg("reason"), py::arg("version"),
        py::arg("grad_request") = false);
  m.def("define_op", [](const py::dict& spec) { return static_cast<int>(define_python_op(spec)); });
  m.def("die_with_parent", &harness::die_with_parent);
  m.def("simulate_capture_for_tests", &simulate_capture_for_tests,
        "Tests only: every call is made as if a CUDA graph were being captured");
  m.def("set_capture_rules", &set_capture_rules,
        "Whether the CUDA-graph rules for Python backends apply (the sweep's worker: off)");
  m.def("serve_worker", [] {
    py::gil_scoped_release release;  // Python backends take it when they run
    return harness::serve_worker();
  });
  py::register_exception<store::StoreError>(m, "StoreError", PyExc_RuntimeError);
}
