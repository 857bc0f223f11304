// kernelgate._C: the Python face of the dispatcher. Loading it registers the kernelgate ops
// (libkernelgate is linked in). Everything here is off the hot path: ops are called through
// torch.ops.kernelgate.
#include <torch/csrc/Dtype.h>
#include <torch/csrc/utils/pybind.h>

#include "kernelgate/kernelgate.h"

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
                          std::to_string(e.contract.tensor_args.size()) + " tensor arguments, got " +
                          std::to_string(tensors.size()));
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

py::dict explain(const std::string& op, const std::vector<std::optional<at::Tensor>>& tensors,
                 bool grad) {
  const OpEntry& e = find(op);
  std::vector<at::Tensor> keep;
  CallView call = to_call(e, tensors, grad, keep);
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
  Dispatcher::get().set_log_hook([holder](LogLevel level, const std::string& op,
                                          const std::string& msg) {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    try {
      (*holder)(level == LogLevel::kWarning ? "warning" : "info", op, msg);
    } catch (py::error_already_set& err) {
      err.discard_as_unraisable("kernelgate log hook");
    }
  });
}

}  // namespace
}  // namespace kernelgate

PYBIND11_MODULE(_C, m) {
  using namespace kernelgate;
  m.doc() = "kernelgate engine bindings";
  m.def("ops", &ops, "Ops, their contracts and backends with availability");
  m.def("explain", &explain, py::arg("op"), py::arg("tensors"), py::arg("grad") = false,
        "The decision for a call, with every candidate's reason");
  m.def("force", [](const std::string& op, const std::string& b) { Dispatcher::get().force(op, b); });
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
      [](const std::string& op, const std::vector<std::string>& ranked, int arch,
         py::object dtype, const std::vector<int>& max_buckets, int align, int grad,
         const std::string& evidence) {
        find(op);
        int st = -1;
        if (!dtype.is_none()) {
          if (!THPDtype_Check(dtype.ptr())) throw py::type_error("dtype must be a torch.dtype or None");
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
  m.def("cuda_arch", &cuda_arch);
}
