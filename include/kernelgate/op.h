// Declaring a routed op, in the op's own file: its contract, reference, Meta shapes, argument
// checks and backends. One generic mechanism (src/core/op_mechanism.cpp) turns the declaration
// into the TORCH_LIBRARY definitions of kernelgate::<op>, _<op>_reference, _<op>_fwd and
// _<op>_bwd, their CPU/CUDA routers and Meta impls, and the autograd of <op> with a routed
// backward. docs/adding_an_op.md walks through an example.
//
//   const OpId kRmsNorm = OpDeclaration(contract())
//       .reference(reference_op)          // ATen ops: the semantics and the gradient contract
//       .meta(meta)                       // outputs then extras, shapes only
//       .check(check_scalars)             // what the contract's named dims cannot say
//       .backend("reference", BackendKind::kReference, reference_fwd, reference_bwd)
//       .backend("aten", BackendKind::kVendor, aten_fwd, aten_bwd, aten_can_implement)
//       .install();
//
// Typed functions, with the op's arguments in schema order (Tensor: const at::Tensor&, Tensor?:
// const std::optional<at::Tensor>&, float: double, int: int64_t, bool: bool, str:
// c10::string_view):
//   reference  (args...) -> outputs                           composite ATen; float64 = oracle
//   meta       (args...[, GradRequest]) -> outputs, extras    shapes only
//   check      (args...) -> void                              throws c10::Error on bad input
//   forward    (args...[, GradRequest]) -> outputs, extras    extras may be undefined when the
//                                                             request is empty (inference)
//   backward   (output grads..., saved..., non-tensor args...[, GradRequest])
//                  -> one gradient per differentiable tensor argument (undefined if not asked)
// A result is an at::Tensor or a std::tuple of them. Every signature is checked against the
// schema when the op is installed; a mismatch is an error naming the op and the function.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernelgate/dispatch.h"

namespace torch {
class Library;
}

namespace kernelgate {

using OptTensor = std::optional<at::Tensor>;

namespace op_detail {

// One parameter of a typed function, read from its IValue. `kind` matches the schema's type:
// T Tensor, O Tensor?, f float, i int, b bool, s str.
template <class T>
struct Param;
template <>
struct Param<const at::Tensor&> {
  static constexpr char kind = 'T';
  static const at::Tensor& get(const c10::IValue& v) { return v.toTensor(); }
};
template <>
struct Param<at::Tensor> : Param<const at::Tensor&> {};
template <>
struct Param<const OptTensor&> {
  static constexpr char kind = 'O';
  static OptTensor get(const c10::IValue& v) {
    return v.isNone() ? std::nullopt : OptTensor(v.toTensor());
  }
};
template <>
struct Param<OptTensor> : Param<const OptTensor&> {};
template <>
struct Param<double> {
  static constexpr char kind = 'f';
  static double get(const c10::IValue& v) { return v.toDouble(); }
};
template <>
struct Param<int64_t> {
  static constexpr char kind = 'i';
  static int64_t get(const c10::IValue& v) { return v.toInt(); }
};
template <>
struct Param<bool> {
  static constexpr char kind = 'b';
  static bool get(const c10::IValue& v) { return v.toBool(); }
};
template <>
struct Param<c10::string_view> {
  static constexpr char kind = 's';
  static c10::string_view get(const c10::IValue& v) { return v.toStringView(); }
};

template <class R>
struct Results;
template <>
struct Results<at::Tensor> {
  static constexpr int count = 1;
  static void push(torch::jit::Stack& s, at::Tensor&& t) { s.emplace_back(std::move(t)); }
};
template <class... T>
struct Results<std::tuple<T...>> {
  static_assert((std::is_same_v<T, at::Tensor> && ...), "results are tensors");
  static constexpr int count = sizeof...(T);
  static void push(torch::jit::Stack& s, std::tuple<T...>&& t) {
    std::apply([&](auto&... e) { (s.emplace_back(std::move(e)), ...); }, t);
  }
};
template <>
struct Results<void> {
  static constexpr int count = 0;
};

// A typed function's shape: its parameter kinds (without a trailing GradRequest) and results.
template <class F>
struct Fn;
template <class R, class... A>
struct Fn<R (*)(A...)> {
  using Result = std::decay_t<R>;
  static constexpr size_t arity = sizeof...(A);
  static constexpr bool takes_request = [] {
    if constexpr (arity == 0) {
      return false;
    } else {
      return std::is_same_v<std::decay_t<std::tuple_element_t<arity - 1, std::tuple<A...>>>,
                            GradRequest>;
    }
  }();
  static constexpr size_t stack_args = takes_request ? arity - 1 : arity;

  static std::string kinds() {
    std::string k;
    size_t i = 0;
    ((i++ < stack_args ? (void)(k += kind_of<A>()) : (void)0), ...);
    return k;
  }
  static constexpr int results() { return Results<Result>::count; }

  // Calls f on the last stack_args values of `s`, leaving the stack as it was (checks).
  static void peek(R (*f)(A...), const torch::jit::Stack& s) {
    invoke(f, s.data() + (s.size() - stack_args), {}, std::index_sequence_for<A...>{});
  }
  // Calls f on the last stack_args values of `s`, pops them and pushes its results.
  static void run(R (*f)(A...), torch::jit::Stack& s, GradRequest need) {
    const c10::IValue* args = s.data() + (s.size() - stack_args);
    if constexpr (std::is_void_v<R>) {
      invoke(f, args, need, std::index_sequence_for<A...>{});
      torch::jit::drop(s, stack_args);
    } else {
      Result r = invoke(f, args, need, std::index_sequence_for<A...>{});
      torch::jit::drop(s, stack_args);
      Results<Result>::push(s, std::move(r));
    }
  }

 private:
  template <class T>
  static constexpr char kind_of() {
    if constexpr (std::is_same_v<std::decay_t<T>, GradRequest>) {
      return '?';
    } else {
      return Param<T>::kind;
    }
  }
  template <class T>
  static decltype(auto) arg(const c10::IValue* args, size_t i, GradRequest need) {
    if constexpr (std::is_same_v<std::decay_t<T>, GradRequest>) {
      return need;
    } else {
      return Param<T>::get(args[i]);
    }
  }
  template <size_t... I>
  static R invoke(R (*f)(A...), const c10::IValue* args, GradRequest need,
                  std::index_sequence<I...>) {
    return f(arg<A>(args, I, need)...);
  }
};

// The shape of one typed function, checked against the schemas at install().
struct Shape {
  std::string what;   // "backend 'aten' forward"
  char schema = 'F';  // F: the op's arguments, B: _<op>_bwd's arguments, R: like F, no extras
  std::string kinds;
  int results = 0;
  bool check_results = true;
};

template <class F>
Shape shape_of(std::string what, char schema) {
  return {std::move(what), schema, Fn<F>::kinds(), Fn<F>::results(), true};
}

template <class F, class B>
class TypedBackend final : public BackendImpl {
 public:
  TypedBackend(F fwd, B bwd) : fwd_(fwd), bwd_(bwd) {}
  void forward(torch::jit::Stack& s, GradRequest need) const override { Fn<F>::run(fwd_, s, need); }
  void backward(torch::jit::Stack& s, GradRequest need) const override {
    if constexpr (std::is_same_v<B, std::nullptr_t>) {
      TORCH_INTERNAL_ASSERT(false, "backward of a forward-only backend");
    } else {
      Fn<B>::run(bwd_, s, need);
    }
  }
  bool has_backward() const override { return !std::is_same_v<B, std::nullptr_t>; }

 private:
  F fwd_;
  B bwd_;
};

}  // namespace op_detail

using CanImplement = std::function<Support(const CallView&)>;

// A boxed function over the op's arguments at the end of a stack (meta: pops them and pushes
// outputs then extras; check: reads them and leaves the stack as it was).
using BoxedArgsFn = std::function<void(torch::jit::Stack&, GradRequest)>;

class OpDeclaration {
 public:
  explicit OpDeclaration(OpContract contract);
  OpDeclaration(OpDeclaration&&) noexcept;
  ~OpDeclaration();

  // The reference op, registered as kernelgate::_<op>_reference (CompositeImplicitAutograd:
  // autograd records the ATen ops it calls).
  template <class F>
  OpDeclaration& reference(F f) {
    shapes_.push_back(op_detail::shape_of<F>("reference", 'R'));
    return reference_boxed([f](torch::jit::Stack& s) { op_detail::Fn<F>::run(f, s, {}); });
  }
  template <class F>
  OpDeclaration& meta(F f) {
    shapes_.push_back(op_detail::shape_of<F>("meta", 'F'));
    return meta_boxed(
        [f](torch::jit::Stack& s, GradRequest need) { op_detail::Fn<F>::run(f, s, need); });
  }
  template <class F>
  OpDeclaration& check(F f) {
    shapes_.push_back(op_detail::shape_of<F>("check", 'R'));
    shapes_.back().check_results = false;
    return check_boxed([f](torch::jit::Stack& s, GradRequest) { op_detail::Fn<F>::peek(f, s); });
  }
  // A backend from typed functions; `bwd` nullptr: forward only.
  template <class F, class B>
  OpDeclaration& backend(std::string name, BackendKind kind, F fwd, B bwd, CanImplement can = {},
                         std::function<Support()> available = {}) {
    shapes_.push_back(op_detail::shape_of<F>("backend '" + name + "' forward", 'F'));
    if constexpr (!std::is_same_v<B, std::nullptr_t>) {
      shapes_.push_back(op_detail::shape_of<B>("backend '" + name + "' backward", 'B'));
    }
    BackendDesc d{std::move(name),
                  kind,
                  std::move(available),
                  std::move(can),
                  std::make_shared<op_detail::TypedBackend<F, B>>(fwd, bwd),
                  ""};
    return backend_desc(std::move(d));
  }
  // The op as plain PyTorch code would compute it (what a user writes without kernelgate, at the
  // input dtype): the "eager" backend. Where no evidence ranks a backend it serves the call, and
  // PyTorch's own autograd differentiates it (no kernelgate node, nothing saved beyond what
  // PyTorch saves), so a call without evidence costs what it costs without kernelgate. Like every
  // backend it is validated against the float64 oracle; evidence ranks it like any other.
  template <class F>
  OpDeclaration& eager(F f) {
    shapes_.push_back(op_detail::shape_of<F>("eager", 'R'));
    return eager_boxed([f](torch::jit::Stack& s) { op_detail::Fn<F>::run(f, s, {}); });
  }
  // The reference backend made from the reference op itself: its forward runs the reference
  // without autograd, its backward differentiates the reference again. For ops without extras
  // that save every tensor argument (ops defined from Python).
  OpDeclaration& reference_backend();
  // Where the reference serves a call that needs gradients (outside torch.compile's tracing), it
  // runs under PyTorch's autograd as plain code does: its graph is kept from the forward to the
  // backward, which then runs no second forward. For an op whose reference is its fast fallback
  // and keeps less than the plain code it replaces (gated_delta_rule, kda).
  OpDeclaration& record_reference();
  // A backend this build or device cannot have: listed with its reason, never chosen.
  OpDeclaration& unavailable(std::string name, BackendKind kind, const char* reason);
  OpDeclaration& backend_desc(BackendDesc desc);

  // Boxed forms (Python-defined ops; tools).
  OpDeclaration& reference_boxed(std::function<void(torch::jit::Stack&)> fn);
  OpDeclaration& eager_boxed(std::function<void(torch::jit::Stack&)> fn);
  OpDeclaration& meta_boxed(BoxedArgsFn fn);
  OpDeclaration& check_boxed(BoxedArgsFn fn);
  // An op whose backward is not one routed call gives its own Autograd kernel, and any helper
  // ops it calls, registered through `lib`; the generic autograd is not used (its kernel calls
  // serve_eager() for an eager backend). Only linear_cross_entropy does (its gradients come from
  // the forward).
  OpDeclaration& custom_autograd(std::function<void(torch::Library& lib)> register_autograd);

  // Registers the op and its backends with the dispatcher and PyTorch; returns its id. Throws
  // c10::Error naming the op for a declaration that does not fit its schema.
  OpId install();

  struct State;

 private:
  std::vector<op_detail::Shape> shapes_;
  std::unique_ptr<State> state_;
};

// For an op with custom_autograd(), whose Autograd kernel is its own: where the op's eager
// backend serves the call whose arguments `s` holds (the generic autograd's rule: a call needing
// gradients or traced by torch.compile, in a region where routing picks eager), runs it and
// returns true, the stack then holding the outputs; otherwise returns false, `s` untouched.
bool serve_eager(OpId op, torch::jit::Stack& s);

// Adds a backend of typed functions to an installed op (plugins, tests), checking them against
// its schemas like install() does. Returns the backend's local index.
int add_backend_checked(const std::string& op, BackendDesc desc,
                        const std::vector<op_detail::Shape>& shapes);
template <class F, class B>
int add_backend(const std::string& op, std::string name, BackendKind kind, F fwd, B bwd,
                CanImplement can = {}) {
  std::vector<op_detail::Shape> shapes{
      op_detail::shape_of<F>("backend '" + name + "' forward", 'F')};
  if constexpr (!std::is_same_v<B, std::nullptr_t>) {
    shapes.push_back(op_detail::shape_of<B>("backend '" + name + "' backward", 'B'));
  }
  BackendDesc d{std::move(name),
                kind,
                {},
                std::move(can),
                std::make_shared<op_detail::TypedBackend<F, B>>(fwd, bwd),
                ""};
  return add_backend_checked(op, std::move(d), shapes);
}

// The kernelgate::<name> op, typed, for the C++ API functions (kernelgate.h).
template <class Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string("kernelgate::") + name).c_str(), "")
      .template typed<Sig>();
}

}  // namespace kernelgate
