// The op mechanism: an OpDeclaration (kernelgate/op.h) becomes the TORCH_LIBRARY definitions of
// kernelgate::<op>, _<op>_reference, _<op>_fwd and _<op>_bwd, one boxed router per op for the CPU
// and CUDA keys, Meta impls, and the autograd of <op> with a routed backward.
//
// Note on the protocol. Every backend of an op implements one forward and one backward with the
// same meaning (OpContract: outputs, extras, saved), so the backward that a forward's extras reach
// may be any backend's: both route by the same dispatch key, and the backward's key is rebuilt
// from what it receives (the saved tensors, or the stand-ins the contract names).
//
// Note on double backward. The first-order backward is a routed kernel call; autograd does not
// see inside it. With create_graph=True the gradient is instead taken by differentiating the
// reference again (its autograd is the gradient contract), which needs every tensor argument
// saved; an op that does not save them refuses with a message that says so.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/jit/frontend/function_schema_parser.h>
#include <torch/library.h>

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <mutex>

#include "kernelgate/op.h"

namespace kernelgate {

struct OpDeclaration::State {
  OpContract contract;
  bool reference_backend = false;
  bool record_reference = false;
  std::function<void(torch::jit::Stack&)> reference, eager;
  BoxedArgsFn meta, check;
  std::vector<BackendDesc> backends;
  std::function<void(torch::Library&)> custom_autograd;
};

namespace {

using at::Tensor;
using c10::IValue;
using torch::jit::Stack;

char kind_of(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::TensorType) return 'T';
  if (auto o = t->cast<c10::OptionalType>()) {
    if (o->getElementType()->kind() == c10::TypeKind::TensorType) return 'O';
  }
  switch (t->kind()) {
    case c10::TypeKind::FloatType: return 'f';
    case c10::TypeKind::IntType: return 'i';
    case c10::TypeKind::BoolType: return 'b';
    case c10::TypeKind::StringType: return 's';
    default: return '?';
  }
}

// What the routers, Meta impls and autograd need of one op, fixed at install(). Leaked: the
// registered kernels point at it for the life of the process.
struct RoutedOp {
  OpId id = 0;
  const OpEntry* entry = nullptr;
  std::string name;
  size_t nargs = 0;                // arguments of <op>
  std::vector<int> tensor_pos;     // schema position of each contract tensor argument
  std::vector<int> nontensor_pos;  // schema positions of the other arguments
  int n_out = 0, n_extra = 0;
  // Contract tensor arguments that get gradients, in order (the node's edges), and for each the
  // position of its gradient among _<op>_bwd's results (`diff`: the arguments with a result of
  // their own; one sharing another's gradient points at that one's).
  std::vector<int> grad_args, grad_slot;
  std::vector<int> diff;
  std::vector<uint32_t> out_deps;  // per output: the tensor arguments it depends on (mask)
  bool keeps_layout = false;       // OpContract::keeps_input_layout

  enum class Src { kInput, kOutput, kExtra };
  struct Saved {
    Src src;
    int index;
  };
  std::vector<Saved> saved;
  // _<op>_bwd's arguments: [grads (n_out)] [saved] [non-tensor args]
  size_t n_bwd_args = 0;
  std::vector<int> bwd_key_pos;  // per contract tensor argument: its offset there (stand-ins)
  std::vector<std::pair<int, int>> variant_pos;  // (schema position, bwd offset) per variant arg
  bool optional_grads = false;
  bool reference_recompute = false;  // every tensor argument is saved
  bool reference_recorded = false;   // OpDeclaration::record_reference

  BoxedArgsFn meta, check;
  // The op as plain PyTorch code (OpDeclaration::eager) and its backend's local index, or -1.
  std::function<void(Stack&)> eager;
  int eager_index = -1;
  // The plain code as a forward that needs no gradient: its outputs, and no extras.
  void forward_eager(Stack& s) const {
    eager(s);
    for (int j = 0; j < n_extra; ++j) s.emplace_back(Tensor());
  }
  bool custom_autograd = false;  // OpDeclaration::custom_autograd: the op's own Autograd kernel
  c10::OperatorHandle* fwd = nullptr;
  c10::OperatorHandle* bwd = nullptr;
  c10::OperatorHandle* ref = nullptr;

  const OpContract& contract() const { return entry->contract; }

  // The reference on the stack, its outputs dense as the Meta impls promise (where the contract
  // keeps input layouts, the router lays them out). Under autograd the copies are recorded.
  void run_reference(Stack& s) const {
    ref->callBoxed(s);
    if (keeps_layout) return;
    for (size_t i = s.size() - n_out; i < s.size(); ++i) s[i] = s[i].toTensor().contiguous();
  }

  uint16_t variant_at(const IValue* args, bool backward) const {
    uint16_t variant = 0;
    const auto& specs = contract().variant_args;
    for (size_t v = 0; v < specs.size(); ++v) {
      const auto& values = specs[v].second;
      const IValue& value = args[backward ? variant_pos[v].second : variant_pos[v].first];
      const c10::string_view got = value.toStringView();
      size_t index = 0;
      while (index < values.size() && values[index] != got) ++index;
      if (index == values.size()) {
        TORCH_CHECK(false, name, ": ", specs[v].first, " must be ", one_of(values), ", got '",
                    std::string(got), "'");
      }
      variant = static_cast<uint16_t>(variant * values.size() + index);
    }
    return variant;
  }

  CallView view_forward(const IValue* args, bool grad) const {
    CallView call;
    call.num_tensors = static_cast<int>(tensor_pos.size());
    for (size_t i = 0; i < tensor_pos.size(); ++i) {
      const IValue& v = args[tensor_pos[i]];
      call.tensors[i] = v.isTensor() ? &v.toTensor() : nullptr;
    }
    call.grad = grad;
    call.variant = variant_at(args, false);
    return call;
  }

  CallView view_backward(const IValue* args) const {
    CallView call;
    call.num_tensors = static_cast<int>(bwd_key_pos.size());
    for (size_t i = 0; i < bwd_key_pos.size(); ++i) {
      const IValue& v = args[bwd_key_pos[i]];
      call.tensors[i] = v.isTensor() ? &v.toTensor() : nullptr;
    }
    call.grad = true;
    call.variant = variant_at(args, true);
    return call;
  }

  // The options of the call's first tensor: placeholders take them.
  static at::TensorOptions first_options(const CallView& call) {
    for (int i = 0; i < call.num_tensors; ++i) {
      if (call.tensors[i] != nullptr && call.tensors[i]->defined())
        return call.tensors[i]->options();
    }
    return {};
  }

  // Outputs and extras of a forward. Inference drops the extras; an extra a training forward
  // leaves undefined becomes an empty [0] tensor (as Meta's), so real and fake results agree.
  void finish_forward(Stack& s, const at::TensorOptions& like, bool training) const {
    const size_t base = s.size() - n_out - n_extra;
    if (!training) s.resize(s.size() - n_extra);
    for (size_t i = base; i < s.size(); ++i) {
      if (s[i].isTensor() && s[i].toTensor().defined()) continue;
      TORCH_CHECK(i >= base + n_out, name, ": the backend returned no ",
                  contract().outputs[i - base]);
      s[i] = at::empty({0}, like);
    }
  }

  // Reads the mask that ends the stack of _<op>_fwd and _<op>_bwd.
  static GradRequest pop_request(Stack& s) {
    GradRequest need{static_cast<uint32_t>(s.back().toInt())};
    s.pop_back();
    return need;
  }

  // ---- OpContract::keeps_input_layout: enforced here, after every backend and Meta impl, so
  // real and fake results agree whatever a backend returns (one that writes the layout itself
  // costs nothing more: in_layout_of then returns its tensor).

  // The call's tensor arguments (backward: what its key holds for them, stand-ins included),
  // held past the pop that consumes them. Empty where the contract does not keep layouts.
  std::array<Tensor, kMaxTensorArgs> held(const CallView& call) const {
    std::array<Tensor, kMaxTensorArgs> out;
    for (int i = 0; keeps_layout && i < call.num_tensors; ++i) {
      if (call.tensors[i] != nullptr) out[static_cast<size_t>(i)] = *call.tensors[i];
    }
    return out;
  }

  // Each output in the layout of the first tensor argument it depends on that has its sizes.
  // The stack ends with the outputs of a forward and `extras` more.
  void keep_output_layouts(Stack& s, const std::array<Tensor, kMaxTensorArgs>& args,
                           size_t extras) const {
    const size_t base = s.size() - static_cast<size_t>(n_out) - extras;
    for (int j = 0; keeps_layout && j < n_out; ++j) {
      IValue& v = s[base + static_cast<size_t>(j)];
      if (!v.isTensor() || !v.toTensor().defined()) continue;
      for (size_t i = 0; i < tensor_pos.size(); ++i) {
        const Tensor& model = args[i];
        if ((out_deps[static_cast<size_t>(j)] >> i & 1u) && model.defined() &&
            model.sizes() == v.toTensor().sizes()) {
          v = in_layout_of(v.toTensor(), model);
          break;
        }
      }
    }
  }

  // Each gradient in its argument's layout. The stack ends with a backward's gradients.
  void keep_grad_layouts(Stack& s, const std::array<Tensor, kMaxTensorArgs>& args,
                         GradRequest need) const {
    const size_t base = s.size() - diff.size();
    for (size_t k = 0; keeps_layout && k < diff.size(); ++k) {
      IValue& g = s[base + k];
      const Tensor& model = args[static_cast<size_t>(diff[k])];
      if (need(diff[k]) && g.isTensor() && g.toTensor().defined() && model.defined() &&
          model.sizes() == g.toTensor().sizes()) {
        g = in_layout_of(g.toTensor(), model);
      }
    }
  }

  // ---- routers (CPU, CUDA) --------------------------------------------------------------------

  void route_forward(Stack& s, bool training) const {
    const GradRequest need = training ? pop_request(s) : GradRequest{};
    const IValue* args = s.data() + (s.size() - nargs);
    const CallView call = view_forward(args, training);
    const BoundDims dims = check_call(contract(), call);
    if (check) check(s, need);
    const int pick = Dispatcher::get().select(id, call, dims);
    const at::TensorOptions like = first_options(call);  // the call's tensors are popped below
    const auto args_held = held(call);
    if (!training && pick == eager_index) {
      // A call of the op itself returns no extras (finish_forward drops them): the plain code
      // serves it, whatever autograd the op has.
      forward_eager(s);
    } else {
      entry->backends[pick].impl->forward(s, need);
    }
    keep_output_layouts(s, args_held, n_extra);
    finish_forward(s, like, training);
  }

  // Per differentiable argument (in order): the options its gradient's placeholder takes.
  std::array<at::TensorOptions, kMaxTensorArgs> grad_options(const CallView& call) const {
    std::array<at::TensorOptions, kMaxTensorArgs> out{};
    const at::TensorOptions first = first_options(call);
    for (size_t k = 0; k < diff.size(); ++k) {
      const at::Tensor* t = call.tensors[diff[k]];
      out[k] = t != nullptr && t->defined() ? t->options() : first;
    }
    return out;
  }

  // Gradients a backward returned: one per differentiable argument; those not asked for become
  // empty [0] tensors (as Meta's).
  void finish_backward(Stack& s, const std::array<at::TensorOptions, kMaxTensorArgs>& like,
                       GradRequest need) const {
    const size_t base = s.size() - diff.size();
    for (size_t k = 0; k < diff.size(); ++k) {
      IValue& g = s[base + k];
      if (need(diff[k])) {
        TORCH_CHECK(g.isTensor() && g.toTensor().defined(), name,
                    " backward: the backend returned no gradient for ",
                    contract().tensor_args[diff[k]].name);
      } else {
        g = at::empty({0}, like[k]);
      }
    }
  }

  void route_backward(Stack& s) const {
    const GradRequest need = pop_request(s);
    const IValue* args = s.data() + (s.size() - n_bwd_args);
    const CallView call = view_backward(args);
    const BoundDims dims = check_call(contract(), call);
    const BackendImpl& impl =
        *entry->backends[Dispatcher::get().select(id, call, dims, /*backward=*/true)].impl;
    const auto like = grad_options(call);  // the call's tensors are popped below
    const auto args_held = held(call);
    impl.backward(s, need);
    keep_grad_layouts(s, args_held, need);
    finish_backward(s, like, need);
  }

  // ---- Meta ----------------------------------------------------------------------------------

  void meta_forward(Stack& s, bool training) const {
    const GradRequest need = training ? pop_request(s) : GradRequest{};
    const IValue* args = s.data() + (s.size() - nargs);
    const CallView call = view_forward(args, training);
    check_call(contract(), call);
    if (check) check(s, need);
    const at::TensorOptions like = first_options(call);
    const auto args_held = held(call);
    meta(s, need);
    keep_output_layouts(s, args_held, n_extra);
    finish_forward(s, like, training);
  }

  // A gradient has its argument's shape and dtype, contiguous (where the contract keeps input
  // layouts: at::empty_like's, in_layout_of's layout of the argument or its stand-in).
  void meta_backward(Stack& s) const {
    const GradRequest need = pop_request(s);
    const IValue* args = s.data() + (s.size() - n_bwd_args);
    const CallView call = view_backward(args);
    const auto like = grad_options(call);
    std::vector<Tensor> grads;
    for (size_t k = 0; k < diff.size(); ++k) {
      const at::Tensor* t = call.tensors[diff[k]];
      const bool want = need(diff[k]) && t != nullptr && t->defined();
      grads.push_back(!want ? at::empty({0}, like[k])
                      : keeps_layout
                          ? at::empty_like(*t, at::MemoryFormat::Preserve)
                          : at::empty(t->sizes(), t->options().memory_format(at::MemoryFormat::Contiguous)));
    }
    torch::jit::drop(s, n_bwd_args);
    for (auto& g : grads) s.emplace_back(std::move(g));
  }
};

// ---- autograd
// ------------------------------------------------------------------------------------

struct RoutedBackward final : torch::autograd::Node {
  const RoutedOp* op = nullptr;
  GradRequest need;
  // Outputs that got no gradient edge (none of their arguments needs one): their shapes, for
  // the zeros the backward receives in their place.
  std::vector<std::optional<std::pair<std::vector<c10::SymInt>, at::TensorOptions>>> plain;
  std::vector<torch::autograd::SavedVariable> saved;
  std::vector<IValue> nontensors;
  std::mutex mu;

  std::string name() const override { return "kernelgate::" + op->name + "_backward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& s : saved) s.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mu);
    torch::autograd::variable_list out(op->grad_args.size());
    if (std::none_of(grads.begin(), grads.end(), [](const Tensor& g) { return g.defined(); })) {
      return out;
    }
    if (!op->optional_grads) {
      for (size_t i = 0; i < grads.size(); ++i) {
        if (grads[i].defined()) continue;
        grads[i] = plain[i] ? at::zeros_symint(plain[i]->first, plain[i]->second)
                            : input_metadata(i).zeros_like();
      }
    }
    std::vector<Tensor> values;
    for (size_t i = 0; i < saved.size(); ++i) {
      const bool is_output = op->saved[i].src == RoutedOp::Src::kOutput;
      values.push_back(saved[i].unpack(is_output ? shared_from_this() : nullptr));
    }
    if (at::GradMode::is_enabled()) return double_backward(grads, values);
    Stack s;
    s.reserve(op->n_bwd_args + 1);
    for (auto& g : grads) s.emplace_back(g.defined() ? IValue(std::move(g)) : IValue());
    for (auto& v : values) s.emplace_back(v.defined() ? IValue(std::move(v)) : IValue());
    for (const auto& v : nontensors) s.push_back(v);
    s.emplace_back(static_cast<int64_t>(need.mask));
    op->bwd->callBoxed(s);
    for (size_t k = 0; k < op->grad_args.size(); ++k) {
      if (need(op->grad_args[k])) out[k] = s[op->grad_slot[k]].toTensor();
    }
    return out;
  }

  // create_graph=True: the gradient of the reference, itself differentiable.
  torch::autograd::variable_list double_backward(const torch::autograd::variable_list& grads,
                                                 const std::vector<Tensor>& values) {
    if (!op->reference_recompute) {
      std::string missing;
      for (size_t i = 0; i < op->tensor_pos.size(); ++i) {
        bool kept = false;
        for (const auto& s : op->saved) kept |= s.src == RoutedOp::Src::kInput && s.index == int(i);
        if (!kept) missing += (missing.empty() ? "" : ", ") + op->contract().tensor_args[i].name;
      }
      TORCH_CHECK(false, op->name,
                  ": double backward (create_graph=True) is not supported: its backward does not "
                  "keep ",
                  missing, ", which differentiating it again would need");
    }
    Stack s(op->nargs);
    std::vector<Tensor> inputs(op->tensor_pos.size());
    for (size_t i = 0; i < op->saved.size(); ++i) {
      if (op->saved[i].src == RoutedOp::Src::kInput) inputs[op->saved[i].index] = values[i];
    }
    for (size_t i = 0; i < op->tensor_pos.size(); ++i) {
      s[op->tensor_pos[i]] = inputs[i].defined() ? IValue(inputs[i]) : IValue();
    }
    for (size_t j = 0; j < op->nontensor_pos.size(); ++j) s[op->nontensor_pos[j]] = nontensors[j];
    op->ref->callBoxed(s);
    std::vector<Tensor> outs, cots, wrt;
    for (size_t j = 0; j < s.size() && j < grads.size(); ++j) {
      const Tensor& o = s[j].toTensor();
      if (o.requires_grad() && grads[j].defined()) {
        outs.push_back(o);
        cots.push_back(grads[j]);
      }
    }
    std::vector<size_t> slots;
    for (size_t k = 0; k < op->grad_args.size(); ++k) {
      if (need(op->grad_args[k])) {
        wrt.push_back(inputs[op->grad_args[k]]);
        slots.push_back(k);
      }
    }
    torch::autograd::variable_list out(op->grad_args.size());
    if (outs.empty() || wrt.empty()) return out;
    auto g = torch::autograd::grad(outs, wrt, cots, /*retain_graph=*/true, /*create_graph=*/true,
                                   /*allow_unused=*/true);
    for (size_t i = 0; i < slots.size(); ++i) {
      out[slots[i]] = g[i].defined() ? g[i] : at::zeros_like(wrt[i]);
    }
    return out;
  }
};

// The defined tensor arguments of a call (nullptr for the others).
std::array<const Tensor*, kMaxTensorArgs> inputs_of(const RoutedOp& op, const IValue* args) {
  std::array<const Tensor*, kMaxTensorArgs> out{};
  for (size_t i = 0; i < op.tensor_pos.size(); ++i) {
    const IValue& v = args[op.tensor_pos[i]];
    if (v.isTensor() && v.toTensor().defined()) out[i] = &v.toTensor();
  }
  return out;
}

GradRequest grad_request(const RoutedOp& op, const IValue* args) {
  GradRequest need;
  if (at::GradMode::is_enabled()) {
    for (size_t k = 0; k < op.grad_args.size(); ++k) {
      const int d = op.grad_args[k];
      const IValue& v = args[op.tensor_pos[d]];
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad()) {
        need.mask |= 1u << d | 1u << op.diff[op.grad_slot[k]];  // and the one it shares with
      }
    }
  }
  return need;
}

// Where the eager backend serves, the op is the plain PyTorch code itself: for a call needing
// gradients, recorded by PyTorch's autograd (it costs, and saves, what it would without
// kernelgate); under torch.compile's tracing with concrete shapes, traced into the graph,
// where the compiler fuses it as it would the user's own code. With symbolic shapes the
// region is unknown: the op stays one node and routes when the graph runs. (An op without an
// eager backend, and a real call needing no gradient, go on to the router.) The reference of an
// op that records it (OpDeclaration::record_reference) serves a real call needing gradients the
// same way, recorded. Runs it on s and returns true where it serves.
bool serve_eager(const RoutedOp& op, Stack& s, GradRequest need) {
  if (op.eager_index < 0 && !op.reference_recorded) return false;
  const IValue* args = s.data() + (s.size() - op.nargs);
  const auto tensors = inputs_of(op, args);
  auto any = [&](auto&& pred) {
    return std::any_of(tensors.begin(), tensors.end(),
                       [&](const Tensor* t) { return t != nullptr && pred(*t); });
  };
  const bool traced =
      any([](const Tensor& t) { return t.key_set().has(c10::DispatchKey::Python); });
  if (!(need.any() || traced) ||
      any([](const Tensor& t) { return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); })) {
    return false;
  }
  const CallView call = op.view_forward(args, need.any());
  const BoundDims dims = check_call(op.contract(), call);
  const int pick = Dispatcher::get().select(op.id, call, dims);
  const bool recorded = op.reference_recorded && pick == 0 && need.any() && !traced;
  if (pick != op.eager_index && !recorded) return false;
  if (op.check) op.check(s, need);
  const auto args_held = op.held(call);
  if (recorded) {
    op.run_reference(s);
  } else {
    op.eager(s);
  }
  // Its outputs in the layout every backend gives them (under autograd, a recorded copy where
  // PyTorch's code gave another); its gradients are PyTorch's.
  op.keep_output_layouts(s, args_held, 0);
  return true;
}

// Installed ops by id, for serve_eager(OpId, ...). Written while ops install (library load),
// read afterwards.
std::mutex g_routed_mu;
std::vector<const RoutedOp*>& routed_ops() {
  static std::vector<const RoutedOp*> ops;
  return ops;
}

void autograd_forward(const RoutedOp& op, const c10::OperatorHandle& handle, c10::DispatchKeySet ks,
                      Stack& s) {
  const IValue* args = s.data() + (s.size() - op.nargs);
  const GradRequest need = grad_request(op, args);
  if (serve_eager(op, s, need)) return;
  if (!need.any()) {
    // Straight to the device router: no autograd node, no second key computation.
    at::AutoDispatchBelowADInplaceOrView guard;
    handle.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, &s);
    return;
  }
  std::vector<Tensor> inputs(op.tensor_pos.size());
  for (size_t i = 0; i < op.tensor_pos.size(); ++i) {
    const IValue& v = args[op.tensor_pos[i]];
    if (v.isTensor()) inputs[i] = v.toTensor();
  }
  auto node = std::shared_ptr<RoutedBackward>(new RoutedBackward(), torch::autograd::deleteNode);
  node->op = &op;
  node->need = need;
  for (int p : op.nontensor_pos) node->nontensors.push_back(args[p]);
  torch::autograd::edge_list edges;
  for (int d : op.grad_args) {
    edges.push_back(inputs[d].defined() ? torch::autograd::impl::gradient_edge(inputs[d])
                                        : torch::autograd::Edge());
  }
  node->set_next_edges(std::move(edges));

  s.emplace_back(static_cast<int64_t>(need.mask));
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::AutoGradMode no_grad(false);
    op.fwd->callBoxed(s);
  }
  const size_t base = s.size() - op.n_out - op.n_extra;
  std::vector<Tensor> outputs;
  for (int j = 0; j < op.n_out; ++j) {
    Tensor o = s[base + j].toTensor();
    // An output that aliases an input (a backend returning a view) would share its autograd
    // history; the op's outputs are new tensors, so it gets its own storage.
    for (const auto& in : inputs) {
      if (in.defined() && o.is_alias_of(in)) {
        o = o.clone();
        break;
      }
    }
    if (torch::autograd::isDifferentiableType(o.scalar_type()) && (need.mask & op.out_deps[j])) {
      torch::autograd::set_history(o, node);
      node->plain.emplace_back();
    } else {
      node->add_input_metadata(torch::autograd::Node::undefined_input());
      node->plain.emplace_back(std::make_pair(o.sym_sizes().vec(), o.options()));
    }
    s[base + j] = o;
    outputs.push_back(o);
  }
  for (const auto& item : op.saved) {
    switch (item.src) {
      case RoutedOp::Src::kInput: node->saved.emplace_back(inputs[item.index], false); break;
      case RoutedOp::Src::kOutput: node->saved.emplace_back(outputs[item.index], true); break;
      case RoutedOp::Src::kExtra:
        node->saved.emplace_back(s[base + op.n_out + item.index].toTensor(), false);
        break;
    }
  }
  s.resize(s.size() - op.n_extra);
}

}  // namespace

at::Tensor in_layout_of(const at::Tensor& t, const at::Tensor& model) {
  TORCH_INTERNAL_ASSERT(t.sizes() == model.sizes(), "in_layout_of: sizes ", t.sizes(), " and ",
                        model.sizes());
  if (model.is_non_overlapping_and_dense()) {
    if (t.strides() == model.strides()) return t;
    return at::empty_strided(model.sizes(), model.strides(), t.options()).copy_(t);
  }
  at::Tensor out = at::empty_like(model, t.options());  // its strides for a model not dense
  return out.strides() == t.strides() ? t : out.copy_(t);
}

namespace {

// ---- the reference as a backend (reference_backend())
// --------------------------------------------

class ReferenceAutograd final : public BackendImpl {
 public:
  explicit ReferenceAutograd(const RoutedOp* op) : op_(op) {}

  void forward(Stack& s, GradRequest) const override {
    at::AutoGradMode no_grad(false);
    op_->run_reference(s);
  }

  // _<op>_bwd's arguments: the output gradients, every tensor argument, the other arguments.
  void backward(Stack& s, GradRequest need) const override {
    const size_t base = s.size() - op_->n_bwd_args;
    const int n_out = op_->n_out;
    std::vector<Tensor> grads, inputs;
    for (int j = 0; j < n_out; ++j)
      grads.push_back(s[base + j].isTensor() ? s[base + j].toTensor() : Tensor());
    // The router runs below autograd; the recomputation needs it back.
    auto keys = c10::impl::tls_local_dispatch_key_set();
    keys.excluded_ = keys.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
    c10::impl::ForceDispatchKeyGuard with_autograd(keys);
    at::AutoGradMode grad_mode(true);
    Stack ref(op_->nargs);
    for (size_t i = 0; i < op_->tensor_pos.size(); ++i) {
      const IValue& v = s[base + n_out + i];
      Tensor t = v.isTensor() ? v.toTensor().detach() : Tensor();
      if (t.defined() && need(static_cast<int>(i))) t.requires_grad_(true);
      inputs.push_back(t);
      ref[op_->tensor_pos[i]] = t.defined() ? IValue(t) : IValue();
    }
    const size_t nontensor_base = base + n_out + op_->tensor_pos.size();
    for (size_t j = 0; j < op_->nontensor_pos.size(); ++j)
      ref[op_->nontensor_pos[j]] = s[nontensor_base + j];
    op_->ref->callBoxed(ref);
    std::vector<Tensor> outs, cots, wrt;
    for (int j = 0; j < n_out; ++j) {
      const Tensor& o = ref[j].toTensor();
      if (o.requires_grad() && grads[j].defined()) {
        outs.push_back(o);
        cots.push_back(grads[j]);
      }
    }
    for (int d : op_->diff) {
      if (need(d)) wrt.push_back(inputs[d]);
    }
    std::vector<Tensor> got;
    if (!outs.empty() && !wrt.empty())
      got = torch::autograd::grad(outs, wrt, cots, false, false, true);
    torch::jit::drop(s, op_->n_bwd_args);
    size_t next = 0;
    for (int d : op_->diff) {
      if (!need(d)) {
        s.emplace_back(Tensor());
        continue;
      }
      Tensor g = next < got.size() ? got[next] : Tensor();
      ++next;
      const bool keep = op_->keeps_layout;  // the router lays it out then
      if (!g.defined()) {
        s.emplace_back(at::zeros_like(inputs[d], keep ? at::MemoryFormat::Preserve
                                                       : at::MemoryFormat::Contiguous));
      } else {
        s.emplace_back(keep ? g : g.contiguous());
      }
    }
  }

  bool has_backward() const override { return true; }

 private:
  const RoutedOp* op_;
};

// ---- the eager backend (eager()) -----------------------------------------------------------
// Served with autograd by autograd_forward itself, and a call of the op that needs no gradient
// by route_forward. A call of _<op>_fwd / _<op>_bwd routed to it is the reference's, whose
// extras and backward agree: a training forward, and any _<op>_fwd of an op with its own
// autograd, which may read the extras without gradients (linear_cross_entropy's lse).
class EagerBackend final : public BackendImpl {
 public:
  explicit EagerBackend(const RoutedOp* op) : op_(op) {}

  void forward(Stack& s, GradRequest need) const override {
    // A training forward (and any forward of an op with its own autograd, which may read the
    // extras without gradients: linear_cross_entropy's lse) is the reference's.
    if (need.any() || op_->custom_autograd) return op_->entry->backends[0].impl->forward(s, need);
    op_->forward_eager(s);
  }
  void backward(Stack& s, GradRequest need) const override {
    op_->entry->backends[0].impl->backward(s, need);
  }
  bool has_backward() const override { return true; }

 private:
  const RoutedOp* op_;
};

// ---- kernels registered with PyTorch -----------------------------------------------------------

enum class Which { kOp, kFwd, kBwd };

struct RouterKernel final : c10::OperatorKernel {
  RouterKernel(const RoutedOp* o, Which w) : op(o), which(w) {}
  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* s) {
    if (which == Which::kBwd) {
      op->route_backward(*s);
    } else {
      op->route_forward(*s, which == Which::kFwd);
    }
  }
  const RoutedOp* op;
  Which which;
};

struct MetaKernel final : c10::OperatorKernel {
  MetaKernel(const RoutedOp* o, Which w) : op(o), which(w) {}
  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* s) {
    if (which == Which::kBwd) {
      op->meta_backward(*s);
    } else {
      op->meta_forward(*s, which == Which::kFwd);
    }
  }
  const RoutedOp* op;
  Which which;
};

struct AutogradKernel final : c10::OperatorKernel {
  explicit AutogradKernel(const RoutedOp* o) : op(o) {}
  void operator()(const c10::OperatorHandle& h, c10::DispatchKeySet ks, Stack* s) {
    autograd_forward(*op, h, ks, *s);
  }
  const RoutedOp* op;
};

struct ReferenceKernel final : c10::OperatorKernel {
  explicit ReferenceKernel(std::function<void(Stack&)> f) : fn(std::move(f)) {}
  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* s) { fn(*s); }
  std::function<void(Stack&)> fn;
};

template <class K, class... A>
torch::CppFunction boxed(A&&... a) {
  return torch::CppFunction::makeFromBoxedFunctor(std::make_unique<K>(std::forward<A>(a)...));
}

c10::Argument plain(const c10::Argument& a) { return c10::Argument(a.name(), a.type()); }

c10::FunctionSchema make_schema(const std::string& name, std::vector<c10::Argument> args,
                                size_t returns) {
  std::vector<c10::Argument> rets(returns, c10::Argument("", c10::TensorType::get()));
  c10::FunctionSchema s(name, "", std::move(args), std::move(rets));
  s.setAliasAnalysis(c10::AliasAnalysisKind::FROM_SCHEMA);
  return s;
}

std::string schema_text(const c10::FunctionSchema& s) { return c10::str(s); }

std::string kinds_of(const std::vector<c10::Argument>& args) {
  std::string k;
  for (const auto& a : args) k += kind_of(a.type());
  return k;
}

std::string describe_kinds(const std::string& kinds) {
  std::string out;
  for (char k : kinds) {
    const char* t = k == 'T'   ? "Tensor"
                    : k == 'O' ? "Tensor?"
                    : k == 'f' ? "float"
                    : k == 'i' ? "int"
                    : k == 'b' ? "bool"
                    : k == 's' ? "str"
                               : "?";
    out += (out.empty() ? "" : ", ") + std::string(t);
  }
  return "(" + out + ")";
}

// Every typed function against the schema it implements: the op's arguments (forward, meta,
// check, reference) or _<op>_bwd's (backward), and the number of tensors it returns.
void check_shapes(const OpContract& c, const std::vector<op_detail::Shape>& shapes) {
  const c10::FunctionSchema fwd = torch::jit::parseSchema(c.forward_schema);
  const c10::FunctionSchema bwd = torch::jit::parseSchema(c.backward_schema);
  auto without_mask = [](const std::vector<c10::Argument>& a) {
    return kinds_of(std::vector<c10::Argument>(a.begin(), a.end() - 1));
  };
  const std::string f_kinds = without_mask(fwd.arguments()),
                    b_kinds = without_mask(bwd.arguments());
  for (const auto& sh : shapes) {
    const std::string& want = sh.schema == 'B' ? b_kinds : f_kinds;
    TORCH_CHECK(sh.kinds == want, "op ", c.name, ": ", sh.what, " takes ", describe_kinds(sh.kinds),
                ", its schema says ", describe_kinds(want));
    if (!sh.check_results) continue;
    const size_t results = sh.schema == 'B'   ? bwd.returns().size()
                           : sh.schema == 'R' ? c.outputs.size()
                                              : fwd.returns().size();
    TORCH_CHECK(static_cast<size_t>(sh.results) == results, "op ", c.name, ": ", sh.what,
                " returns ", sh.results, " tensors, expected ", results);
  }
}

}  // namespace

int add_backend_checked(const std::string& op, BackendDesc desc,
                        const std::vector<op_detail::Shape>& shapes) {
  Dispatcher& d = Dispatcher::get();
  const OpEntry* e = d.find_op(op);
  TORCH_CHECK(e != nullptr, "no op '", op, "' to add backend '", desc.name, "' to");
  check_shapes(e->contract, shapes);
  return d.add_backend(e->id, std::move(desc));
}

// ---- OpDeclaration -----------------------------------------------------------------------------

OpDeclaration::OpDeclaration(OpContract contract) : state_(std::make_unique<State>()) {
  state_->contract = std::move(contract);
}
OpDeclaration::OpDeclaration(OpDeclaration&&) noexcept = default;
OpDeclaration::~OpDeclaration() = default;

OpDeclaration& OpDeclaration::reference_backend() {
  state_->reference_backend = true;
  return *this;
}

OpDeclaration& OpDeclaration::record_reference() {
  state_->record_reference = true;
  return *this;
}

OpDeclaration& OpDeclaration::unavailable(std::string name, BackendKind kind, const char* reason) {
  BackendDesc d;
  d.name = std::move(name);
  d.kind = kind;
  d.available = [reason] { return Support::no(reason); };
  return backend_desc(std::move(d));
}

OpDeclaration& OpDeclaration::backend_desc(BackendDesc desc) {
  state_->backends.push_back(std::move(desc));
  return *this;
}

OpDeclaration& OpDeclaration::reference_boxed(std::function<void(Stack&)> fn) {
  state_->reference = std::move(fn);
  return *this;
}

OpDeclaration& OpDeclaration::eager_boxed(std::function<void(Stack&)> fn) {
  state_->eager = std::move(fn);
  return *this;
}

OpDeclaration& OpDeclaration::meta_boxed(BoxedArgsFn fn) {
  state_->meta = std::move(fn);
  return *this;
}

OpDeclaration& OpDeclaration::check_boxed(BoxedArgsFn fn) {
  state_->check = std::move(fn);
  return *this;
}

bool serve_eager(OpId id, Stack& s) {
  const RoutedOp* op = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_routed_mu);
    if (id < routed_ops().size()) op = routed_ops()[id];
  }
  TORCH_CHECK(op != nullptr, "serve_eager: no installed op has id ", id);
  return serve_eager(*op, s, grad_request(*op, s.data() + (s.size() - op->nargs)));
}

OpDeclaration& OpDeclaration::custom_autograd(std::function<void(torch::Library&)> reg) {
  state_->custom_autograd = std::move(reg);
  return *this;
}

OpId OpDeclaration::install() {
  TORCH_CHECK(state_, "OpDeclaration::install() called twice");
  State& st = *state_;
  OpContract& c = st.contract;
  c10::FunctionSchema schema = torch::jit::parseSchema(c.schema);
  schema.setAliasAnalysis(c10::AliasAnalysisKind::FROM_SCHEMA);
  const std::string& op_name = schema.name();
  if (c.name.empty()) c.name = op_name;
  TORCH_CHECK(op_name == c.name, "op ", c.name, ": its schema names it '", op_name, "'");
  TORCH_CHECK(st.reference, "op ", c.name, ": no reference");
  TORCH_CHECK(st.meta, "op ", c.name, ": no meta (shape) function");
  parse_dims(c);

  auto* op = new RoutedOp();  // leaked: see RoutedOp
  op->name = c.name;
  const auto& args = schema.arguments();
  op->nargs = args.size();
  // The contract's tensor arguments are the schema's, in order.
  size_t t = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    const char k = kind_of(args[i].type());
    TORCH_CHECK(k != '?', "op ", c.name, ": argument '", args[i].name(), "' has type ",
                args[i].type()->str(),
                "; kernelgate ops take Tensor, Tensor?, float, int, bool and str");
    if (k != 'T' && k != 'O') {
      op->nontensor_pos.push_back(static_cast<int>(i));
      continue;
    }
    TORCH_CHECK(t < c.tensor_args.size() && c.tensor_args[t].name == args[i].name(), "op ", c.name,
                ": tensor argument '", args[i].name(),
                "' of the schema is not the next one in dims ('", c.dims, "')");
    TORCH_CHECK(c.tensor_args[t].optional == (k == 'O'), "op ", c.name, ": '", args[i].name(),
                "' is ", k == 'O' ? "optional" : "required", " in the schema but not in dims");
    c.tensor_args[t].schema_index = static_cast<int>(i);
    op->tensor_pos.push_back(static_cast<int>(i));
    ++t;
  }
  TORCH_CHECK(t == c.tensor_args.size(), "op ", c.name, ": dims names tensors the schema lacks");
  for (const auto& r : schema.returns()) {
    TORCH_CHECK(r.type()->kind() == c10::TypeKind::TensorType, "op ", c.name,
                ": returns must be tensors");
  }
  op->n_out = static_cast<int>(schema.returns().size());
  op->n_extra = static_cast<int>(c.extras.size());
  if (c.outputs.empty()) {
    for (int j = 0; j < op->n_out; ++j) c.outputs.push_back("out" + std::to_string(j));
  }
  TORCH_CHECK(static_cast<int>(c.outputs.size()) == op->n_out, "op ", c.name, ": ",
              c.outputs.size(), " output names for ", op->n_out, " outputs");
  for (auto& a : c.tensor_args) {
    a.differentiable = a.dtype_class == DTypeClass::kFloat &&
                       std::find(c.no_grad.begin(), c.no_grad.end(), a.name) == c.no_grad.end();
  }
  for (const auto& n : c.no_grad) {
    TORCH_CHECK(std::any_of(c.tensor_args.begin(), c.tensor_args.end(),
                            [&](const TensorArgSpec& a) { return a.name == n; }),
                "op ", c.name, ": no_grad names '", n, "', which is not a tensor argument");
  }
  auto arg_index = [&](const std::string& n) {
    for (size_t i = 0; i < c.tensor_args.size(); ++i) {
      if (c.tensor_args[i].name == n) return static_cast<int>(i);
    }
    TORCH_CHECK(false, "op ", c.name, ": '", n, "' is not a tensor argument");
    return -1;
  };
  for (size_t i = 0; i < c.tensor_args.size(); ++i) {
    if (c.tensor_args[i].differentiable && !c.shared_grads.count(c.tensor_args[i].name)) {
      op->diff.push_back(static_cast<int>(i));
    }
  }
  for (size_t i = 0; i < c.tensor_args.size(); ++i) {
    if (!c.tensor_args[i].differentiable) continue;
    auto shared = c.shared_grads.find(c.tensor_args[i].name);
    const int source =
        shared == c.shared_grads.end() ? static_cast<int>(i) : arg_index(shared->second);
    auto slot = std::find(op->diff.begin(), op->diff.end(), source);
    TORCH_CHECK(slot != op->diff.end(), "op ", c.name, ": '", c.tensor_args[i].name,
                "' shares the gradient of '", c.tensor_args[source].name,
                "', which has none of its own");
    op->grad_args.push_back(static_cast<int>(i));
    op->grad_slot.push_back(static_cast<int>(slot - op->diff.begin()));
  }
  for (const auto& out : c.outputs) {
    auto it = c.output_inputs.find(out);
    uint32_t mask = it == c.output_inputs.end() ? ~0u : 0u;
    if (it != c.output_inputs.end()) {
      for (const auto& n : it->second) mask |= 1u << arg_index(n);
    }
    op->out_deps.push_back(mask);
  }
  op->keeps_layout = c.keeps_input_layout;
  for (const auto& [out, deps] : c.output_inputs) {
    TORCH_CHECK(std::find(c.outputs.begin(), c.outputs.end(), out) != c.outputs.end(), "op ",
                c.name, ": output_inputs names '", out, "', which is not an output");
  }
  TORCH_CHECK(!op->diff.empty() || !c.dtypes.empty(), "op ", c.name, ": nothing to differentiate");

  // Saved tensors, by name.
  if (c.saved.empty()) {
    for (const auto& a : c.tensor_args) c.saved.push_back(a.name);
  }
  std::vector<c10::Argument> bwd_args;
  for (int j = 0; j < op->n_out; ++j) {
    bwd_args.emplace_back("grad_" + std::to_string(j),
                          c.optional_grads ? c10::TypePtr(c10::OptionalType::ofTensor())
                                           : c10::TypePtr(c10::TensorType::get()));
  }
  std::map<std::string, int> bwd_offset;  // name -> offset in _<op>_bwd's arguments
  for (int j = 0; j < op->n_out; ++j) bwd_offset["grad_" + std::to_string(j)] = j;
  for (const auto& name : c.saved) {
    RoutedOp::Saved s{RoutedOp::Src::kInput, -1};
    c10::TypePtr type = c10::TensorType::get();
    for (size_t i = 0; i < c.tensor_args.size(); ++i) {
      if (c.tensor_args[i].name == name) {
        s = {RoutedOp::Src::kInput, static_cast<int>(i)};
        if (c.tensor_args[i].optional) type = c10::OptionalType::ofTensor();
      }
    }
    for (size_t j = 0; j < c.outputs.size(); ++j) {
      if (c.outputs[j] == name) s = {RoutedOp::Src::kOutput, static_cast<int>(j)};
    }
    for (size_t j = 0; j < c.extras.size(); ++j) {
      if (c.extras[j] == name) s = {RoutedOp::Src::kExtra, static_cast<int>(j)};
    }
    TORCH_CHECK(s.index >= 0, "op ", c.name, ": saved names '", name,
                "', which is no tensor argument, output or extra");
    bwd_offset[name] = static_cast<int>(bwd_args.size());
    op->saved.push_back(s);
    bwd_args.emplace_back(name, type);
  }
  for (int p : op->nontensor_pos) {
    bwd_offset[args[p].name()] = static_cast<int>(bwd_args.size());
    bwd_args.push_back(plain(args[p]));
  }
  op->n_bwd_args = bwd_args.size();
  bwd_args.emplace_back("needs", c10::IntType::get());
  op->optional_grads = c.optional_grads;
  op->reference_recompute = true;
  for (const auto& a : c.tensor_args) {
    auto it = bwd_offset.find(a.name);
    bool saved_input = std::find(c.saved.begin(), c.saved.end(), a.name) != c.saved.end();
    op->reference_recompute &= saved_input;
    if (!saved_input) {
      auto s = c.backward_stand_ins.find(a.name);
      TORCH_CHECK(s != c.backward_stand_ins.end() && bwd_offset.count(s->second), "op ", c.name,
                  ": the backward's dispatch key needs tensor argument '", a.name,
                  "': save it, or name a saved tensor or output gradient standing in for it "
                  "(backward_stand_ins)");
      it = bwd_offset.find(s->second);
    }
    op->bwd_key_pos.push_back(it->second);
  }
  for (const auto& [vname, values] : c.variant_args) {
    int pos = -1;
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].name() == vname && kind_of(args[i].type()) == 's') pos = static_cast<int>(i);
    }
    TORCH_CHECK(pos >= 0 && !values.empty(), "op ", c.name, ": variant argument '", vname,
                "' is not a str argument of the schema");
    op->variant_pos.emplace_back(pos, bwd_offset.at(vname));
  }

  // The internal ops' schemas.
  std::vector<c10::Argument> fwd_args;
  for (const auto& a : args) fwd_args.push_back(plain(a));
  fwd_args.emplace_back("needs", c10::IntType::get());
  c10::FunctionSchema fwd_schema =
      make_schema("_" + c.name + "_fwd", fwd_args, op->n_out + op->n_extra);
  c10::FunctionSchema bwd_schema = make_schema("_" + c.name + "_bwd", bwd_args, op->diff.size());
  c10::FunctionSchema ref_schema = schema.cloneWithName("_" + c.name + "_reference", "");
  c.forward_schema = schema_text(fwd_schema);
  c.backward_schema = schema_text(bwd_schema);

  check_shapes(c, shapes_);
  if (st.reference_backend) {
    std::vector<std::string> args_in_order;
    for (const auto& a : c.tensor_args) args_in_order.push_back(a.name);
    TORCH_CHECK(c.extras.empty() && c.saved == args_in_order && c.shared_grads.empty(), "op ",
                c.name, ": reference_backend() needs no extras and every tensor argument saved");
    BackendDesc ref{
        "reference", BackendKind::kReference, {}, {}, std::make_shared<ReferenceAutograd>(op), ""};
    st.backends.insert(st.backends.begin(), std::move(ref));
  }
  TORCH_CHECK(!st.backends.empty() && st.backends[0].kind == BackendKind::kReference, "op ", c.name,
              ": its first backend must be the reference");

  if (st.eager) {
    // Outputs dense, as the Meta impls promise (most ATen ops keep a strided input's strides);
    // where the contract keeps input layouts, as they come: the router lays them out.
    op->eager = [fn = std::move(st.eager), n = static_cast<size_t>(op->n_out),
                 keep = c.keeps_input_layout](Stack& s) {
      fn(s);
      for (size_t i = s.size() - n; !keep && i < s.size(); ++i) {
        if (s[i].isTensor() && s[i].toTensor().defined()) s[i] = s[i].toTensor().contiguous();
      }
    };
    st.backends.push_back(
        {"eager", BackendKind::kEager, {}, {}, std::make_shared<EagerBackend>(op), ""});
  }

  op->meta = std::move(st.meta);
  op->check = std::move(st.check);
  Dispatcher& d = Dispatcher::get();
  op->id = d.add_op(c);
  {
    std::lock_guard<std::mutex> lock(g_routed_mu);
    auto& ops = routed_ops();
    if (ops.size() <= op->id) ops.resize(op->id + 1, nullptr);
    ops[op->id] = op;
  }
  op->entry = &d.op(op->id);
  for (auto& b : st.backends) d.add_backend(op->id, std::move(b));
  if (op->eager) op->eager_index = static_cast<int>(op->entry->backends.size()) - 1;
  op->reference_recorded = st.record_reference;

  // PyTorch: definitions, then impls. The library lives as long as the process.
  auto* lib =
      new torch::Library(torch::Library::FRAGMENT, "kernelgate", std::nullopt, __FILE__, __LINE__);
  lib->def(c10::FunctionSchema(schema));
  lib->def(std::move(ref_schema));
  lib->def(std::move(fwd_schema));
  lib->def(std::move(bwd_schema));
  const std::string fwd_name = "_" + c.name + "_fwd", bwd_name = "_" + c.name + "_bwd";
  const std::string ref_name = "_" + c.name + "_reference";
  lib->impl(ref_name.c_str(), torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd,
                                              boxed<ReferenceKernel>(std::move(st.reference))));
  for (auto key : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA}) {
    lib->impl(c.name.c_str(), torch::dispatch(key, boxed<RouterKernel>(op, Which::kOp)));
    lib->impl(fwd_name.c_str(), torch::dispatch(key, boxed<RouterKernel>(op, Which::kFwd)));
    lib->impl(bwd_name.c_str(), torch::dispatch(key, boxed<RouterKernel>(op, Which::kBwd)));
  }
  lib->impl(c.name.c_str(),
            torch::dispatch(c10::DispatchKey::Meta, boxed<MetaKernel>(op, Which::kOp)));
  lib->impl(fwd_name.c_str(),
            torch::dispatch(c10::DispatchKey::Meta, boxed<MetaKernel>(op, Which::kFwd)));
  lib->impl(bwd_name.c_str(),
            torch::dispatch(c10::DispatchKey::Meta, boxed<MetaKernel>(op, Which::kBwd)));
  if (st.custom_autograd) {
    op->custom_autograd = true;
    st.custom_autograd(*lib);
  } else {
    lib->impl(c.name.c_str(),
              torch::dispatch(c10::DispatchKey::Autograd, boxed<AutogradKernel>(op)));
  }
  auto& dispatcher = c10::Dispatcher::singleton();
  op->fwd = new c10::OperatorHandle(
      dispatcher.findSchemaOrThrow(("kernelgate::" + fwd_name).c_str(), ""));
  op->bwd = new c10::OperatorHandle(
      dispatcher.findSchemaOrThrow(("kernelgate::" + bwd_name).c_str(), ""));
  op->ref = new c10::OperatorHandle(
      dispatcher.findSchemaOrThrow(("kernelgate::" + ref_name).c_str(), ""));
  state_.reset();
  return op->id;
}

}  // namespace kernelgate
