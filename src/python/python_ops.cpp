// Backends and ops defined from Python (kg.register_backend, kg.define_op): Python callables
// behind the same BackendImpl and op mechanism as the C++ ones, so they are served through the
// same torch.ops.kernelgate ops (autograd, torch.compile, CUDA graphs) and swept by the same
// harness.
//
// Note on the GIL: routers run with the GIL released (torch.ops releases it before dispatching),
// so every call into Python takes it, and no Python error escapes into the dispatcher: it becomes
// a c10::Error naming the op and the backend. The callables are never freed: backends live as
// long as the process, past the interpreter.
#include "python/python_ops.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/function_schema_parser.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <optional>

#include "kernelgate/op.h"

namespace kernelgate {
namespace {

namespace py = pybind11;

py::object to_py(const c10::IValue& v) {
  if (v.isTensor()) return py::reinterpret_steal<py::object>(THPVariable_Wrap(v.toTensor()));
  if (v.isNone()) return py::none();
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isString()) return py::str(v.toStringRef());
  return torch::jit::toPyObject(v);
}

// The last n values of the stack as call arguments; they are popped.
py::tuple pop_args(torch::jit::Stack& s, size_t n) {
  py::tuple args(n);
  const size_t base = s.size() - n;
  for (size_t i = 0; i < n; ++i)
    PyTuple_SET_ITEM(args.ptr(), i, to_py(s[base + i]).release().ptr());
  torch::jit::drop(s, n);
  return args;
}

// A callable's result as tensors: one tensor, or a tuple / list of tensors and Nones.
std::vector<at::Tensor> tensors_of(const py::handle& r, const std::string& what) {
  std::vector<at::Tensor> out;
  auto one = [&](const py::handle& h) {
    if (h.is_none()) {
      out.emplace_back();
    } else if (THPVariable_Check(h.ptr())) {
      out.push_back(THPVariable_Unpack(h.ptr()));
    } else {
      TORCH_CHECK(false, what, " returned a ",
                  std::string(py::str(py::type::of(h).attr("__name__"))),
                  " where a tensor was expected");
    }
  };
  if (py::isinstance<py::tuple>(r) || py::isinstance<py::list>(r)) {
    for (const auto& h : r) one(h);
  } else {
    one(r);
  }
  return out;
}

// `fn` itself, or for a "module:attr" string the callable it names, imported now: library
// backends are registered at `import kernelgate` without importing their library (seconds),
// which happens at their first call. An import error becomes a c10::Error naming `what`.
py::object resolve(const py::object& fn, const std::string& what) {
  if (!py::isinstance<py::str>(fn)) return fn;
  try {  // kg.register_backend's own resolution of "module:attr"
    return py::module_::import("kernelgate._define").attr("_resolve")(fn, what);
  } catch (py::error_already_set& e) {
    TORCH_CHECK(false, what, ": cannot import ", fn.cast<std::string>(), ": ", e.what());
  }
}

// Calls `fn`; a Python exception becomes a c10::Error naming `what`.
py::object call(const py::object& fn, const py::tuple& args, const std::string& what,
                PyObject* kwargs = nullptr) {
  PyObject* r = PyObject_Call(fn.ptr(), args.ptr(), kwargs);
  if (r == nullptr) {
    py::error_already_set e;
    TORCH_CHECK(false, what, " raised: ", e.what());
  }
  return py::reinterpret_steal<py::object>(r);
}

struct Protocol {
  size_t nargs = 0, n_out = 0, n_extra = 0, n_bwd_args = 0, n_grads = 0;
  std::vector<std::string> outputs, extras;
  std::vector<std::string> tensor_args;  // by position: GradRequest's bits
};

Protocol protocol_of(const OpContract& c) {
  const auto fwd = torch::jit::parseSchema(c.forward_schema);
  const auto bwd = torch::jit::parseSchema(c.backward_schema);
  Protocol p;
  p.nargs = fwd.arguments().size() - 1;  // the trailing mask is not the callables'
  p.n_out = c.outputs.size();
  p.n_extra = c.extras.size();
  p.n_bwd_args = bwd.arguments().size() - 1;
  p.n_grads = bwd.returns().size();
  p.outputs = c.outputs;
  p.extras = c.extras;
  for (const auto& t : c.tensor_args) p.tensor_args.push_back(t.name);
  return p;
}

std::string names(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& n : v) s += (s.empty() ? "" : ", ") + n;
  return s;
}

class PythonBackend final : public BackendImpl {
 public:
  PythonBackend(std::string what, Protocol p, py::object fwd, py::object bwd, bool grad_request)
      : what_(std::move(what)),
        fwd_what_(what_ + " forward"),
        bwd_what_(what_ + " backward"),
        p_(std::move(p)),
        fwd_(new py::object(std::move(fwd))),
        bwd_(bwd.is_none() ? nullptr : new py::object(std::move(bwd))),
        grad_request_(grad_request) {
    // Callables given as objects (kg.register_backend) are imported already.
    if (!py::isinstance<py::str>(*fwd_) && (bwd_ == nullptr || !py::isinstance<py::str>(*bwd_)))
      import_state_.store(kImported, std::memory_order_release);
  }

  // Returns the outputs, or the outputs and the extras (required when gradients are needed).
  // With grad_request, the forward also gets needs_grad=: the names of the tensor arguments the
  // call needs gradients for. requires_grad cannot say it: AOT autograd and torch.compile call
  // the forward on tensors that do not carry it.
  void forward(torch::jit::Stack& s, GradRequest need) const override {
    py::gil_scoped_acquire gil;
    require_imported();
    py::tuple args = pop_args(s, p_.nargs);
    py::object kwargs;  // null unless grad_request
    if (grad_request_) {
      py::list names;
      for (size_t i = 0; i < p_.tensor_args.size(); ++i) {
        if (need(static_cast<int>(i))) names.append(p_.tensor_args[i]);
      }
      py::dict d;
      d["needs_grad"] = py::tuple(names);
      kwargs = std::move(d);
    }
    auto got = tensors_of(call(*fwd_, args, fwd_what_, kwargs.ptr()), fwd_what_);
    const bool extras_needed = need.any() && p_.n_extra > 0;
    TORCH_CHECK(got.size() == p_.n_out + p_.n_extra || (!extras_needed && got.size() == p_.n_out),
                what_, " forward returned ", got.size(), " tensors, expected ", p_.n_out, " (",
                names(p_.outputs), ")",
                p_.n_extra ? " followed by " + std::to_string(p_.n_extra) + " (" +
                                 names(p_.extras) + ") when gradients are needed"
                           : std::string());
    got.resize(p_.n_out + p_.n_extra);
    for (auto& t : got) s.emplace_back(std::move(t));
  }

  void backward(torch::jit::Stack& s, GradRequest) const override {
    py::gil_scoped_acquire gil;
    TORCH_INTERNAL_ASSERT(bwd_ != nullptr);
    require_imported();
    py::tuple args = pop_args(s, p_.n_bwd_args);
    auto got = tensors_of(call(*bwd_, args, bwd_what_), bwd_what_);
    TORCH_CHECK(got.size() == p_.n_grads, what_, " backward returned ", got.size(),
                " gradients, expected ", p_.n_grads, " (one per differentiable tensor argument)");
    for (auto& t : got) s.emplace_back(std::move(t));
  }

  bool has_backward() const override { return bwd_ != nullptr; }

  // Whether the callables are imported ("module:attr" strings of a library backend are imported
  // at the first call that reaches this backend), importing them now if not yet: a library that
  // is installed but cannot be imported (a missing or broken dependency) makes the backend one
  // that cannot implement any call, with the reason, warned once; the next backend serves.
  // Without the GIL once imported (the hot path).
  Support importable() const {
    const int state = import_state_.load(std::memory_order_acquire);
    if (state == kImported) return Support::yes();
    if (state == kUnimportable) return Support::no(import_failure_);
    // A library's import may touch the device: never inside a CUDA-graph capture (its first call
    // could not be captured either: the warm-set rule).
    if (capture_rules_on() && stream_capturing())
      return Support::no("its library is not imported yet, which a CUDA-graph capture forbids");
    py::gil_scoped_acquire gil;
    return import_now() ? Support::yes() : Support::no(import_failure_);
  }

 private:
  enum : int { kNotYet = 0, kImported = 1, kUnimportable = 2 };

  // Under the GIL, which makes it happen once.
  bool import_now() const {
    const int state = import_state_.load(std::memory_order_acquire);
    if (state != kNotYet) return state == kImported;
    try {
      *fwd_ = resolve(*fwd_, fwd_what_);
      if (bwd_ != nullptr) *bwd_ = resolve(*bwd_, bwd_what_);
    } catch (const c10::Error& e) {
      import_failure_ = intern(e.what_without_backtrace());
      const std::string warning =
          "kernelgate: " + std::string(import_failure_) + "; the next backend serves its calls";
      if (PyErr_WarnEx(PyExc_RuntimeWarning, warning.c_str(), 1) != 0) PyErr_Clear();
      import_state_.store(kUnimportable, std::memory_order_release);
      return false;
    }
    import_state_.store(kImported, std::memory_order_release);
    return true;
  }

  // A call that reached the backend without its can_implement (none does when it is routed).
  void require_imported() const {
    if (!import_now()) TORCH_CHECK(false, import_failure_);
  }

  std::string what_, fwd_what_, bwd_what_;
  Protocol p_;
  // Leaked on purpose (see the note at the top).
  py::object* fwd_;
  py::object* bwd_;
  bool grad_request_;
  mutable std::atomic<int> import_state_{kNotYet};
  mutable const char* import_failure_ = "";
};

// What a backend declares it needs of a call (kg.register_backend's device, dtypes, variants and
// present), checked in C++ on the hot path: no Python, no GIL.
struct Requirements {
  std::optional<c10::DeviceType> device;
  std::vector<c10::ScalarType> dtypes;  // of the call's first tensor; empty: any
  std::vector<bool> variant_ok;         // per variant index; empty: every variant
  std::vector<int> present;             // optional tensor arguments that must be given
  bool capturable = true;               // false: it syncs with the host
  bool nonempty = false;                // every given tensor has an element
  int64_t max_row_bytes = 0;            // the first tensor's last dim, in bytes; 0: any
  int64_t row_bytes_multiple = 0;       // ... a multiple of this many bytes; 0: any
  std::vector<const char*> empty_reason;  // per tensor argument
  const char* device_reason = "";
  const char* row_reason = "";
  const char* row_multiple_reason = "";
  const char* dtype_reason = "";
  const char* variant_reason = "";
  std::vector<const char*> present_reason;
  std::vector<int> absent;              // optional tensor arguments that must not be given
  std::vector<const char*> absent_reason;
  struct DimLimit {
    int tensor, dim;  // where the named dim is: tensor argument, dim from its end
    int64_t max;
    const char* reason;
  };
  std::vector<DimLimit> dim_limits;
  bool any() const {
    return device || !dtypes.empty() || !variant_ok.empty() || !present.empty() || !capturable ||
           nonempty || max_row_bytes > 0 || row_bytes_multiple > 0 || !absent.empty() ||
           !dim_limits.empty();
  }
};

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

Requirements requirements_of(const OpContract& c, const py::dict& spec, const std::string& what) {
  Requirements r;
  if (spec.contains("device") && !spec["device"].is_none()) {
    const std::string d = spec["device"].cast<std::string>();
    r.device = c10::Device(d).type();
    r.device_reason = intern("runs on " + d + " tensors only");
  }
  if (spec.contains("dtypes")) {
    std::vector<std::string> names;
    for (const auto& t : spec["dtypes"]) {
      TORCH_CHECK(THPDtype_Check(t.ptr()), what, ": dtypes must be torch dtypes");
      r.dtypes.push_back(reinterpret_cast<THPDtype*>(t.ptr())->scalar_type);
      std::string n = py::str(t);  // "torch.float32"
      names.push_back(n.substr(n.find('.') + 1));
    }
    r.dtype_reason = intern("implements " + join(names, ", ") + " only");
  }
  if (spec.contains("variants")) {
    // Mixed radix, as variant_of: the allowed values of each argument, every combination.
    size_t total = 1;
    for (const auto& [name, values] : c.variant_args) total *= values.size();
    r.variant_ok.assign(total, true);
    std::vector<std::string> said;
    for (const auto& [k, v] : spec["variants"].cast<py::dict>()) {
      const std::string arg = k.cast<std::string>();
      const auto allowed = v.cast<std::vector<std::string>>();
      size_t stride = 1, pos = c.variant_args.size();
      for (size_t i = c.variant_args.size(); i-- > 0;) {
        if (c.variant_args[i].first == arg) {
          pos = i;
          break;
        }
        stride *= c.variant_args[i].second.size();
      }
      TORCH_CHECK(pos < c.variant_args.size(), what, ": variants: '", arg,
                  "' is not a variant argument of ", c.name);
      const auto& values = c.variant_args[pos].second;
      for (const auto& a : allowed) {
        TORCH_CHECK(std::find(values.begin(), values.end(), a) != values.end(), what,
                    ": variants: ", arg, " has no value '", a, "' (it takes ", join(values, ", "),
                    ")");
      }
      for (size_t index = 0; index < total; ++index) {
        const std::string& value = values[(index / stride) % values.size()];
        if (std::find(allowed.begin(), allowed.end(), value) == allowed.end())
          r.variant_ok[index] = false;
      }
      said.push_back(arg + " " + join(allowed, " or "));
    }
    r.variant_reason = intern("implements " + join(said, ", ") + " only");
  }
  if (spec.contains("capturable")) r.capturable = spec["capturable"].cast<bool>();
  if (spec.contains("nonempty")) r.nonempty = spec["nonempty"].cast<bool>();
  if (spec.contains("max_row_bytes")) {
    r.max_row_bytes = spec["max_row_bytes"].cast<int64_t>();
    TORCH_CHECK(r.max_row_bytes > 0, what, ": max_row_bytes must be positive, got ", r.max_row_bytes);
    r.row_reason = intern("implements rows (the last dim of " + c.tensor_args.at(0).name + ") of at most " +
                          std::to_string(r.max_row_bytes) + " bytes only");
  }
  if (spec.contains("row_bytes_multiple")) {
    r.row_bytes_multiple = spec["row_bytes_multiple"].cast<int64_t>();
    TORCH_CHECK(r.row_bytes_multiple > 0, what, ": row_bytes_multiple must be positive, got ",
                r.row_bytes_multiple);
    r.row_multiple_reason = intern("implements rows (the last dim of " + c.tensor_args.at(0).name +
                                   ") of a multiple of " + std::to_string(r.row_bytes_multiple) +
                                   " bytes only");
  }
  if (r.nonempty) {
    for (const auto& a : c.tensor_args)
      r.empty_reason.push_back(intern("needs tensors with elements (" + a.name + " has none)"));
  }
  auto tensor_arg = [&](const std::string& arg, const char* field) {
    for (size_t i = 0; i < c.tensor_args.size(); ++i) {
      if (c.tensor_args[i].name == arg) return static_cast<int>(i);
    }
    TORCH_CHECK(false, what, ": ", field, ": ", c.name, " has no tensor argument '", arg, "'");
    return -1;
  };
  if (spec.contains("present")) {
    for (const auto& n : spec["present"]) {
      const std::string arg = n.cast<std::string>();
      r.present.push_back(tensor_arg(arg, "present"));
      r.present_reason.push_back(intern("needs " + arg + " (it is absent)"));
    }
  }
  if (spec.contains("absent")) {
    for (const auto& n : spec["absent"]) {
      const std::string arg = n.cast<std::string>();
      const int pos = tensor_arg(arg, "absent");
      TORCH_CHECK(c.tensor_args[pos].optional, what, ": absent: ", arg, " of ", c.name,
                  " is not optional");
      r.absent.push_back(pos);
      r.absent_reason.push_back(intern("implements calls without " + arg + " only (it is given)"));
    }
  }
  if (spec.contains("max_dims")) {
    for (const auto& [k, v] : spec["max_dims"].cast<py::dict>()) {
      const std::string dim = k.cast<std::string>();
      const int64_t max = v.cast<int64_t>();
      bool found = false;
      // The first tensor argument that has the dim (not a variadic run), counted from its end.
      for (size_t i = 0; i < c.tensor_args.size() && !found; ++i) {
        const auto& dims = c.tensor_args[i].dims;
        for (size_t j = 0; j < dims.size(); ++j) {
          if (dims[j].variadic || c.named_dims[dims[j].named_dim] != dim) continue;
          const int from_end = static_cast<int>(dims.size() - j);
          r.dim_limits.push_back(
              {static_cast<int>(i), from_end, max,
               intern("implements " + dim + " (" + c.tensor_args[i].name + ".size(-" +
                      std::to_string(from_end) + ")) of at most " + std::to_string(max) +
                      " only")});
          found = true;
          break;
        }
      }
      TORCH_CHECK(found, what, ": max_dims: ", c.name, " has no named dim '", dim, "'");
    }
  }
  return r;
}

Support check(const Requirements& r, const CallView& call) {
  if (r.device && call.device().type() != *r.device) return Support::no(r.device_reason);
  if (!r.dtypes.empty()) {
    for (int i = 0; i < call.num_tensors; ++i) {
      const at::Tensor* t = call.tensors[i];
      if (t == nullptr || !t->defined()) continue;
      if (std::find(r.dtypes.begin(), r.dtypes.end(), t->scalar_type()) == r.dtypes.end())
        return Support::no(r.dtype_reason);
      break;
    }
  }
  if (!r.variant_ok.empty() && !r.variant_ok[call.variant]) return Support::no(r.variant_reason);
  for (size_t i = 0; i < r.present.size(); ++i) {
    const at::Tensor* t = call.tensors[r.present[i]];
    if (t == nullptr || !t->defined()) return Support::no(r.present_reason[i]);
  }
  for (size_t i = 0; i < r.absent.size(); ++i) {
    const at::Tensor* t = call.tensors[r.absent[i]];
    if (t != nullptr && t->defined()) return Support::no(r.absent_reason[i]);
  }
  for (const auto& l : r.dim_limits) {
    const at::Tensor* t = call.tensors[l.tensor];
    if (t != nullptr && t->defined() && t->dim() >= l.dim && t->size(-l.dim) > l.max)
      return Support::no(l.reason);
  }
  if (r.nonempty) {
    for (int i = 0; i < call.num_tensors; ++i) {
      const at::Tensor* t = call.tensors[i];
      if (t != nullptr && t->defined() && t->numel() == 0)
        return Support::no(r.empty_reason[i]);
    }
  }
  if (r.max_row_bytes > 0 || r.row_bytes_multiple > 0) {
    const at::Tensor* t = call.tensors[0];
    if (t != nullptr && t->defined() && t->dim() > 0) {
      const int64_t row_bytes = t->size(-1) * static_cast<int64_t>(t->element_size());
      if (r.max_row_bytes > 0 && row_bytes > r.max_row_bytes) return Support::no(r.row_reason);
      if (r.row_bytes_multiple > 0 && row_bytes % r.row_bytes_multiple != 0)
        return Support::no(r.row_multiple_reason);
    }
  }
  if (!r.capturable && capture_rules_on() && stream_capturing())
    return Support::no("syncs with the host, which CUDA-graph capture forbids");
  return Support::yes();
}

CanImplement python_can_implement(py::object fn, std::string what) {
  auto* held = new py::object(std::move(fn));  // leaked: see the note at the top
  return [held, what](const CallView& call) -> Support {
    py::gil_scoped_acquire gil;
    try {
      py::tuple tensors(call.num_tensors);
      for (int i = 0; i < call.num_tensors; ++i) {
        const at::Tensor* t = call.tensors[i];
        tensors[i] = t ? py::reinterpret_steal<py::object>(THPVariable_Wrap(*t)) : py::none();
      }
      py::object r = (*held)(*tensors);
      if (r.is_none() || (py::isinstance<py::bool_>(r) && r.cast<bool>())) return Support::yes();
      if (py::isinstance<py::str>(r)) return Support::no(intern(r.cast<std::string>()));
      return Support::no("can_implement said no");
    } catch (py::error_already_set& e) {
      return Support::no(intern("can_implement raised: " + std::string(e.what())));
    }
  };
}

}  // namespace

FastOp::FastOp(const std::string& name)
    : handle_(c10::Dispatcher::singleton().findSchemaOrThrow(("kernelgate::" + name).c_str(), "")),
      entry_(Dispatcher::get().find_op(name)) {
  TORCH_CHECK(entry_ != nullptr, "no kernelgate op '", name, "'");
  for (const auto& a : handle_.schema().arguments()) {
    const auto& t = a.type();
    char k = '?';
    if (t->kind() == c10::TypeKind::TensorType) {
      k = 'T';
    } else if (auto o = t->cast<c10::OptionalType>()) {
      if (o->getElementType()->kind() == c10::TypeKind::TensorType) k = 'O';
    } else if (t->kind() == c10::TypeKind::FloatType) {
      k = 'f';
    } else if (t->kind() == c10::TypeKind::IntType) {
      k = 'i';
    } else if (t->kind() == c10::TypeKind::BoolType) {
      k = 'b';
    } else if (t->kind() == c10::TypeKind::StringType) {
      k = 's';
    }
    kinds_ += k;
    defaults_.push_back(a.default_value() ? *a.default_value() : c10::IValue());
    has_default_.push_back(a.default_value().has_value());
  }
  returns_ = handle_.schema().returns().size();
}

bool FastOp::has_python_backend() const {
  const auto& backends = entry_->backends;
  for (size_t i = 0; i < backends.size(); ++i) {
    if (backends[i].kind == BackendKind::kPython && entry_->availability[i].ok) return true;
  }
  return false;
}

py::object FastOp::call(const py::args& args) const {
  HANDLE_TH_ERRORS
  const size_t n = args.size();
  // What only torch's own path handles: a __torch_function__ mode, too many arguments.
  if (n > kinds_.size() || at::impl::torch_function_mode_enabled())
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  torch::jit::Stack stack;
  stack.reserve(kinds_.size());
  for (size_t i = 0; i < kinds_.size(); ++i) {
    if (i >= n) {
      if (!has_default_[i]) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
      stack.push_back(defaults_[i]);
      continue;
    }
    PyObject* o = PyTuple_GET_ITEM(args.ptr(), i);
    switch (kinds_[i]) {
      case 'O':
        if (o == Py_None) {
          stack.emplace_back();
          break;
        }
        [[fallthrough]];
      case 'T':
        // Exact tensors only: subclasses and proxies take torch's path (__torch_function__).
        if (!THPVariable_CheckExact(o))
          return py::reinterpret_borrow<py::object>(Py_NotImplemented);
        stack.emplace_back(THPVariable_Unpack(o));
        break;
      case 'f':
        if (!PyFloat_Check(o) && !(PyLong_Check(o) && !PyBool_Check(o))) {
          return py::reinterpret_borrow<py::object>(Py_NotImplemented);
        }
        stack.emplace_back(PyFloat_AsDouble(o));
        break;
      case 'i':
        if (!PyLong_Check(o) || PyBool_Check(o))
          return py::reinterpret_borrow<py::object>(Py_NotImplemented);
        stack.emplace_back(static_cast<int64_t>(PyLong_AsLongLong(o)));
        break;
      case 'b':
        if (!PyBool_Check(o)) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
        stack.emplace_back(o == Py_True);
        break;
      case 's':
        if (!PyUnicode_Check(o)) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
        stack.emplace_back(std::string(PyUnicode_AsUTF8(o)));
        break;
      default: return py::reinterpret_borrow<py::object>(Py_NotImplemented);
    }
    if (PyErr_Occurred()) return py::reinterpret_borrow<py::object>(Py_NotImplemented);  // overflow
  }
  // As torch's own path, other Python threads run while the op does; except where the op has a
  // Python backend, which would take the GIL straight back.
  if (has_python_backend()) {
    handle_.callBoxed(stack);
  } else {
    py::gil_scoped_release release;
    handle_.callBoxed(stack);
  }
  if (returns_ == 1)
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(stack[0].toTensor()));
  py::tuple out(stack.size());
  for (size_t i = 0; i < stack.size(); ++i) {
    PyTuple_SET_ITEM(out.ptr(), i, THPVariable_Wrap(stack[i].toTensor()));
  }
  return out;
  END_HANDLE_TH_ERRORS_PYBIND
}

int register_python_backend(const std::string& op, const std::string& name, py::object forward,
                            py::object backward, py::object can_implement,
                            const py::dict& requirements, bool available, const std::string& reason,
                            const std::string& version, bool grad_request) {
  const OpEntry* e = Dispatcher::get().find_op(op);
  if (e == nullptr) throw py::value_error("unknown op '" + op + "'");
  BackendDesc d;
  d.name = name;
  d.kind = BackendKind::kPython;
  d.version = version;
  if (!available) {
    const char* why = intern(reason);
    d.available = [why] { return Support::no(why); };
  } else {
    auto impl =
        std::make_shared<PythonBackend>(op + " backend '" + name + "'", protocol_of(e->contract),
                                        std::move(forward), std::move(backward), grad_request);
    d.impl = impl;
    const std::string what = op + " backend '" + name + "'";
    CanImplement python;
    if (!can_implement.is_none()) python = python_can_implement(std::move(can_implement), what);
    // The requirements first (C++, no GIL), so that a call the backend cannot take (another
    // device, dtype, ...) never imports its library; then the import; then its can_implement.
    d.can_implement = [r = requirements_of(e->contract, requirements, what), impl,
                       python](const CallView& call) {
      Support s = r.any() ? check(r, call) : Support::yes();
      if (s.ok) s = impl->importable();
      return s.ok && python ? python(call) : s;
    };
  }
  py::gil_scoped_release
      release;  // the dispatcher takes its lock; a router may hold it waiting for us
  return Dispatcher::get().add_backend(e->id, std::move(d));
}

OpId define_python_op(const py::dict& spec) {
  OpContract c;
  c.schema = spec["schema"].cast<std::string>();
  c.name = torch::jit::parseSchema(c.schema).name();
  c.dims = spec["dims"].cast<std::string>();
  for (const auto& t : spec["dtypes"]) {
    TORCH_CHECK(THPDtype_Check(t.ptr()), c.name, ": dtypes must be torch dtypes");
    c.dtypes.push_back(reinterpret_cast<THPDtype*>(t.ptr())->scalar_type);
  }
  for (const auto& [k, v] : spec["test_values"].cast<py::dict>()) {
    c.scalar_test_values.emplace_back(k.cast<std::string>(), v.cast<std::vector<double>>());
  }
  for (const auto& [k, v] : spec["dim_ranges"].cast<py::dict>()) {
    c.dim_ranges[k.cast<std::string>()] = v.cast<std::pair<int64_t, int64_t>>();
  }
  c.production_shapes =
      spec["production_shapes"].cast<std::vector<std::map<std::string, int64_t>>>();
  for (const auto& [k, v] : spec["variants"].cast<py::dict>()) {
    c.variant_args.emplace_back(k.cast<std::string>(), v.cast<std::vector<std::string>>());
  }
  c.index_ranges = spec["index_ranges"].cast<std::map<std::string, std::string>>();
  c.dim_multiples = spec["dim_multiples"].cast<std::map<std::string, int64_t>>();
  c.no_grad = spec["no_grad"].cast<std::vector<std::string>>();
  c.outputs = spec["outputs"].cast<std::vector<std::string>>();
  c.source_hash = spec["source_hash"].cast<std::string>();
  const size_t nargs = torch::jit::parseSchema(c.schema).arguments().size();
  const size_t n_out = torch::jit::parseSchema(c.schema).returns().size();
  // A Python function of the op's arguments, run on the stack: its tensors replace the arguments.
  auto boxed = [nargs, n_out](const py::object& fn, const std::string& what) {
    auto* f = new py::object(fn);  // leaked: see the note at the top
    return [f, nargs, n_out, what](torch::jit::Stack& s, bool dense) {
      py::gil_scoped_acquire gil;
      py::tuple args = pop_args(s, nargs);
      auto got = tensors_of(call(*f, args, what), what);
      TORCH_CHECK(got.size() == n_out, what, " returned ", got.size(), " tensors, the schema says ",
                  n_out);
      for (auto& t : got) {
        TORCH_CHECK(t.defined(), what, " returned None where a tensor was expected");
        s.emplace_back(dense ? t.contiguous() : t);
      }
    };
  };
  auto run_reference = boxed(spec["reference"], c.name + " reference");
  const py::object eager = spec.contains("eager") ? py::object(spec["eager"]) : py::none();
  const std::string eager_what = c.name + " eager backend";
  OpDeclaration d(std::move(c));
  // Meta: the reference on meta tensors (ATen ops have meta kernels), dense like every backend.
  d.reference_boxed([run_reference](torch::jit::Stack& s) { run_reference(s, false); })
      .meta_boxed([run_reference](torch::jit::Stack& s, GradRequest) { run_reference(s, true); })
      .reference_backend();
  if (spec.contains("record_reference") && spec["record_reference"].cast<bool>()) d.record_reference();
  // The op as the plain PyTorch code a user would write: the fallback where no evidence ranks a
  // backend, differentiated by PyTorch's autograd (OpDeclaration::eager).
  if (!eager.is_none()) {
    d.eager_boxed([run = boxed(eager, eager_what)](torch::jit::Stack& s) { run(s, false); });
  }
  py::gil_scoped_release release;
  return d.install();
}

}  // namespace kernelgate
