// Backends and ops defined from Python (python_ops.cpp), for the bindings (module.cpp).
#pragma once
#include <torch/csrc/utils/pybind.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

#include "kernelgate/dispatch.h"

namespace kernelgate {

// The eager entry of an op from Python, without torch.ops' generic argument parsing: positional
// arguments of the kinds the schema has (the schema's defaults for those left out), exact
// torch.Tensor arguments. Anything else (a subclass, a proxy, a keyword, a __torch_function__
// mode) returns NotImplemented, and the caller takes torch.ops (kernelgate/_ops.py). The call
// goes through PyTorch's dispatcher like any other: autograd, Python dispatch modes, CUDA graphs.
class FastOp {
 public:
  explicit FastOp(const std::string& name);
  pybind11::object call(const pybind11::args& args) const;

 private:
  bool has_python_backend() const;
  c10::OperatorHandle handle_;
  const OpEntry* entry_;
  std::string kinds_;
  std::vector<c10::IValue> defaults_;
  std::vector<bool> has_default_;
  size_t returns_ = 0;
};

// Adds a Python backend to `op`: forward(*op_args) -> outputs [+ extras]; backward (None:
// forward only) (*_<op>_bwd args without the mask) -> one gradient per differentiable tensor
// argument; can_implement(*tensor_args) -> True / None (yes), False or a reason (no); requirements:
// what is checked in C++ before it ("device": "cuda", "dtypes": [...], "variants": {arg:
// [values]}, "present": [optional tensor args]). forward / backward may be "module:attr"
// strings, imported at the first call. An unavailable backend is listed with `reason`.
// `version` joins its evidence's fingerprint. grad_request: the forward also gets needs_grad=
// (the names of the tensor arguments the call needs gradients for).
int register_python_backend(const std::string& op, const std::string& name,
                            pybind11::object forward, pybind11::object backward,
                            pybind11::object can_implement, const pybind11::dict& requirements,
                            bool available, const std::string& reason, const std::string& version,
                            bool grad_request);

// Defines an op from a spec (kernelgate/_define.py builds it): schema, dims, dtypes, test
// values, dim ranges, production shapes, variants, index ranges, dim multiples, no_grad,
// outputs, source_hash and the Python reference. Its reference backend is the reference.
OpId define_python_op(const pybind11::dict& spec);

}  // namespace kernelgate
