// The dispatcher facade: op contracts, backends, dispatch keys, policy and the router's decision.
// Code outside src/core includes only this header (and kernelgate.h for the op API; op.h to
// declare an op).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace kernelgate {

constexpr int kMaxTensorArgs = 8;
constexpr int kMaxNamedDims = 8;
constexpr int kMaxBackends = 32;

using OpId = uint16_t;
constexpr OpId kNoOp = 0xFFFF;  // log messages that concern no single op

// Answer of a capability query. `reason` is a string with static storage (a literal, or
// intern()ed): no allocation on the hot path. It says why not when ok is false.
struct Support {
  bool ok = true;
  const char* reason = "";
  static Support yes() { return {true, ""}; }
  static Support no(const char* why) { return {false, why}; }
};

// A copy of `text` that lives as long as the process (for Support reasons made at run time).
// Never on the hot path: each distinct text is stored once.
const char* intern(const std::string& text);

// `text` with each byte that is not part of valid UTF-8 written as \xNN: for messages that
// quote environment values or file names on their way to Python.
std::string valid_utf8(const std::string& text);

// kEager: the op as plain PyTorch code (OpDeclaration::eager), the fallback where no evidence
// ranks a backend.
enum class BackendKind : uint8_t { kReference, kKernelgate, kVendor, kPython, kEager };
const char* backend_kind_name(BackendKind kind);

// What the router sees of one call: the tensor arguments in schema order (nullptr for an absent
// optional) and whether the call is part of a step that will run backward. Non-owning.
struct CallView {
  std::array<const at::Tensor*, kMaxTensorArgs> tensors{};
  int num_tensors = 0;
  bool grad = false;
  // Non-tensor arguments that select different code (geglu's approximate): 0 for the schema's
  // defaults, another value per alternative. Part of the key, so evidence for one never serves
  // another.
  uint16_t variant = 0;
  // Set when the tensors stand for a call elsewhere (explain on meta tensors of a CUDA call).
  std::optional<c10::Device> on;

  // The device the call runs on: `on`, else the first present tensor's.
  c10::Device device() const {
    if (on) return *on;
    for (int i = 0; i < num_tensors; ++i) {
      if (tensors[i] != nullptr && tensors[i]->defined()) return tensors[i]->device();
    }
    return c10::Device(c10::kCPU);
  }
};

// Which tensor arguments (by position in the contract) a call needs gradients for. Empty: the
// call needs none (inference), and a forward need not compute what only a backward reads.
struct GradRequest {
  uint32_t mask = 0;
  bool any() const { return mask != 0; }
  bool operator()(int tensor_arg) const { return (mask >> tensor_arg) & 1u; }
};

// ---- Op contract ---------------------------------------------------------------------------

// One dim of a tensor argument: a named dim, or a run of leading dims folded into one (`*rows`).
struct DimSpec {
  int named_dim = 0;
  bool variadic = false;
};

enum class DTypeClass : uint8_t { kFloat, kIndex };

struct TensorArgSpec {
  std::string name;
  bool optional = false;
  DTypeClass dtype_class = DTypeClass::kFloat;
  std::vector<DimSpec> dims;
  int schema_index = -1;       // position among the schema's arguments (set by the op mechanism)
  bool differentiable = true;  // float tensors get gradients unless listed in OpContract::no_grad
};

// Declared once per op. `dims` names the dims of every tensor argument, in schema order:
//   "x: [*rows, hidden]; weight?: [hidden]"     ('?' marks an optional tensor,
//   "target: [rows] index"                        'index' an integer tensor).
// Float tensors must all share one dtype from `dtypes`.
struct OpContract {
  std::string name;
  std::string schema;
  std::string dims;
  std::vector<c10::ScalarType> dtypes;
  // Values the harness tries for each scalar argument, e.g. {"eps", {1e-6, 1e-5, 0.1}}.
  std::vector<std::pair<std::string, std::vector<double>>> scalar_test_values;
  // Harness: sizes each named dim may take ([lo, hi]) and LLM production shapes, most
  // representative first.
  std::map<std::string, std::pair<int64_t, int64_t>> dim_ranges;
  // String arguments that select different code, each with its allowed values, default first:
  // the value's index is the call's variant (CallView::variant).
  std::vector<std::pair<std::string, std::vector<std::string>>> variant_args;
  std::vector<std::map<std::string, int64_t>> production_shapes;
  // Harness: how production calls pass their tensors. The production shapes are swept in each
  // layout named here (rope: also "transposed", the [batch, seq, heads, head_dim] storage that
  // attention code's q.view(...).transpose(1, 2) gives) and with the optional tensor arguments
  // present, absent, or both (linear_cross_entropy: absent, as an lm_head has no bias). Other
  // layouts and optionals are swept on a mid-size shape only, whose region no production call
  // reaches.
  std::vector<std::string> production_layouts = {"contiguous"};
  std::vector<bool> production_optionals = {true};
  // Harness: named dims whose sizes must be a multiple of a number (rope's head_dim: 2); the
  // cases round their sizes up to it.
  std::map<std::string, int64_t> dim_multiples;
  // Harness: for each index tensor, the named dim that bounds its values ({"target", "classes"}:
  // values in [0, classes)). When the op has an int argument `ignore_index`, every 8th entry
  // takes its value, so the ignored path is always exercised.
  std::map<std::string, std::string> index_ranges;
  // The stems of the files that compute this op, comma-separated (src/ops/<stem>.cpp,
  // src/ops/<stem>_*, src/kernels/<stem>.*, src/kernels/<stem>_*): their hash, with the shared
  // computing files, is the op's source hash in stored evidence (docs/evidence.md). Empty: the
  // op's name. An op defined from Python gives `source_hash` instead.
  std::string source_stem;
  std::string source_hash;

  // ---- The autograd protocol every backend of the op implements (docs/adding_an_op.md).
  // Names of the outputs (default out0, out1, ...) and of the extra tensors a training forward
  // returns after them for the backward (rms_norm: "rstd").
  std::vector<std::string> outputs, extras;
  // What the backward receives besides the output gradients, by name: tensor arguments,
  // outputs, extras. Default: every tensor argument.
  std::vector<std::string> saved;
  // Float tensor arguments that get no gradient (rope's cos and sin). Index tensors never do.
  std::vector<std::string> no_grad;
  // The backward's dispatch key is the forward's: a tensor argument the backward does not
  // receive is represented by the tensor named here, which has its shape and dtype (rope:
  // {"q", "grad_0"}: the gradient of q_out).
  std::map<std::string, std::string> backward_stand_ins;
  // Tensor arguments whose gradient is another's (add_rms_norm: {"residual", "x"}): the backward
  // returns it once, and autograd hands the same gradient to both.
  std::map<std::string, std::string> shared_grads;
  // Per output, the tensor arguments it depends on (default: every one). An output none of whose
  // arguments needs a gradient gets none, as through the reference.
  std::map<std::string, std::vector<std::string>> output_inputs;
  // The backward receives an undefined gradient for an output nobody used, instead of zeros.
  bool optional_grads = false;
  // Each output keeps the layout of the first tensor argument it depends on (output_inputs)
  // that has its sizes, and each gradient its argument's (or, in the backward, its stand-in's),
  // as at::empty_like gives it: their strides where they are non-overlapping and dense. The
  // router enforces it after every backend and Meta impl (in_layout_of: a copy only where a
  // backend returned another layout). Default: every output and gradient dense.
  // attention: o and dq in attention code's [batch, seq, heads, head_dim] storage, so that its
  // o.transpose(1, 2).reshape(...) and q's view backward copy nothing, as with SDPA; rope: q_out
  // and k_out in q's and k's.
  bool keeps_input_layout = false;

  // Filled when the op is added (parse_dims, the op mechanism).
  std::vector<TensorArgSpec> tensor_args;
  std::vector<std::string> named_dims;
  std::string forward_schema, backward_schema;  // the internal _<op>_fwd and _<op>_bwd ops
};

// Python's name of a dtype: "bfloat16", "float32", "int64".
std::string dtype_name(c10::ScalarType t);

// Parses contract.dims into tensor_args/named_dims; throws c10::Error on a malformed spec.
void parse_dims(OpContract& contract);

// The variant of a call whose string arguments are `strings` (absent: the default). Throws
// c10::Error naming the argument for a value the contract does not allow.
uint16_t variant_of(const OpContract& contract, const std::map<std::string, std::string>& strings);

// Sizes of the named dims of one call, in contract.named_dims order.
struct BoundDims {
  std::array<int64_t, kMaxNamedDims> size{};
};

// t (of model's sizes) with the strides at::empty_like(model) gives: model's where it is
// non-overlapping and dense, else dense in model's dim order. t itself when it has them, else a
// copy.
at::Tensor in_layout_of(const at::Tensor& t, const at::Tensor& model);

// "'a', 'b' or 'c'": the allowed values of an argument, for error messages.
std::string one_of(const std::vector<std::string>& values);

// Checks a call against the contract (presence, device, dtype, rank, named-dim agreement) and
// returns the bound sizes. Throws c10::Error with a message naming the argument, what was expected
// and what came.
BoundDims check_call(const OpContract& contract, const CallView& call);

// ---- Backends --------------------------------------------------------------------------------

// What a backend computes, in the boxed calling convention of PyTorch's dispatcher.
//   forward:  the stack ends with the op's arguments (schema order); it pops them and pushes the
//             outputs, then the extras (undefined tensors allowed when `need` is empty).
//   backward: the stack ends with _<op>_bwd's arguments (output gradients, saved tensors, the
//             op's non-tensor arguments) without the trailing mask; it pops them and pushes one
//             gradient per differentiable tensor argument (undefined where `need` has no bit).
// Typed C++ functions become one through kernelgate/op.h; Python callables through the bindings.
class BackendImpl {
 public:
  virtual ~BackendImpl() = default;
  virtual void forward(torch::jit::Stack& stack, GradRequest need) const = 0;
  virtual void backward(torch::jit::Stack& stack, GradRequest need) const = 0;
  // A forward-only backend serves only calls that need no gradient (the router asks).
  virtual bool has_backward() const = 0;
};

struct BackendDesc {
  std::string name;  // unique within the op: "reference", "aten", "kernelgate_cuda", ...
  BackendKind kind = BackendKind::kReference;
  // Evaluated once, at registration: is this backend in the build / importable at all.
  std::function<Support()> available;
  // Exact and cheap; never throws. Called on the hot path for the ranked candidates. Null:
  // implements every valid call.
  std::function<Support(const CallView&)> can_implement;
  // The code. Null exactly when the backend is not available (a descriptor with a reason).
  std::shared_ptr<const BackendImpl> impl;
  // What identifies the backend's code beyond kernelgate's own sources (a Python package's
  // version, the hash of a Python function's source): part of its evidence's fingerprint.
  std::string version;
};

// ---- Dispatch key ----------------------------------------------------------------------------

enum class AlignClass : uint8_t {
  kVec16 = 0,       // every tensor contiguous, 16-byte aligned, innermost dim a multiple of 16 B
  kContiguous = 1,  // every tensor contiguous, some not 16-byte aligned
  kStrided = 2,     // some tensor is not contiguous
};
const char* align_class_name(AlignClass a);

constexpr uint8_t kAbsentDType = 0xFF;
constexpr uint8_t kEmptyBucket = 0xFF;  // a named dim of size 0
constexpr int16_t kCpuArch = -1;

struct DispatchKey {
  OpId op = 0;
  int16_t arch = kCpuArch;  // major * 10 + minor for CUDA devices
  std::array<uint8_t, kMaxTensorArgs> dtypes{};
  std::array<uint8_t, kMaxNamedDims> buckets{};
  AlignClass align = AlignClass::kVec16;
  uint8_t grad = 0;
  uint16_t variant = 0;

  bool operator==(const DispatchKey& o) const;
  size_t hash() const;
};
static_assert(sizeof(DispatchKey) == 24, "DispatchKey is packed into three words");

// ceil(log2(n)) for n >= 1; kEmptyBucket for n == 0.
uint8_t size_bucket(int64_t n);
AlignClass align_class(const CallView& call);
// Human-readable form, e.g. "rms_norm sm_90 bfloat16,bfloat16 rows<=2^14 hidden<=2^12 vec16 grad".
std::string describe_key(const DispatchKey& key);

// ---- Policy ----------------------------------------------------------------------------------

// A rule of the in-memory policy: fields left at their wildcard match every key.
struct PolicyRule {
  std::string op;
  int arch = -2;                    // -2: any; kCpuArch: CPU
  int dtype = -1;                   // ScalarType of the first tensor, -1: any
  std::vector<int> max_buckets;     // per named dim, key bucket must be <= this (empty: any)
  int align = -1;                   // AlignClass, -1: any
  int grad = -1;                    // 0/1, -1: any
  std::vector<std::string> ranked;  // fastest first
  std::string evidence;             // where the ranking came from
};

// Maps a key to the backends proven correct for it, fastest first. Never on the hot path: the
// dispatcher asks once per key and caches the answer.
class PolicySource {
 public:
  virtual ~PolicySource() = default;
  // Empty when the source holds no evidence for the key. `evidence` receives a short provenance.
  virtual std::vector<std::string> ranked(const std::string& op, const DispatchKey& key,
                                          std::string* evidence) const = 0;
  virtual std::string describe() const = 0;
  // Why some of its evidence cannot be used (an unreadable store, say), for people: logged as
  // warnings once, at the first decision, and shown by explain.
  virtual std::vector<std::string> problems() const { return {}; }
};

class InMemoryPolicy final : public PolicySource {
 public:
  void add(PolicyRule rule);
  void clear();
  size_t size() const;
  std::vector<std::string> ranked(const std::string& op, const DispatchKey& key,
                                  std::string* evidence) const override;
  std::string describe() const override;

 private:
  mutable std::mutex mu_;
  std::vector<PolicyRule> rules_;  // first match wins
};

// ---- Dispatcher ------------------------------------------------------------------------------

enum class LogLevel : uint8_t { kInfo, kWarning };
using LogHook = std::function<void(LogLevel, const std::string& op, const std::string& message)>;

struct CandidateReport {
  std::string backend;
  std::string kind;
  bool selected = false;
  std::string reason;  // why it was chosen or passed over
};

struct Explanation {
  std::string op;
  std::string key;
  std::string backend;  // the one that serves the call
  std::string reason;   // why
  std::vector<CandidateReport> candidates;
  std::vector<std::string> evidence_problems;  // the evidence source's problems(), if any
};

// An op as the router sees it: its contract and backends, local index 0 being the reference.
// `availability` is evaluated once per backend, when it is added.
struct OpEntry {
  OpId id = 0;
  OpContract contract;
  std::vector<BackendDesc> backends;  // never reallocates (reserved): read without a lock
  std::vector<Support> availability;
};

// The op's fallback where no evidence ranks a backend: its kEager backend, else its ATen kernel
// as a backend (kVendor, named "aten": rms_norm, layer_norm), else -1 (the reference serves).
int fallback_index(const OpEntry& e);

class Dispatcher {
 public:
  // The process-wide dispatcher. Ops register themselves (kernelgate/op.h); the dispatcher
  // knows none of them.
  static Dispatcher& get();

  // Registration. The first backend of an op is its reference (kind kReference).
  OpId add_op(OpContract contract);
  int add_backend(OpId op, BackendDesc backend);  // returns the local index
  const OpEntry& op(OpId id) const;
  const OpEntry* find_op(const std::string& name) const;
  std::vector<std::string> op_names() const;  // sorted

  // Hot path: the local index of the backend that serves this call (0 = reference). `dims` comes
  // from check_call on the same call; `backward`: the call is the op's backward.
  //
  // The CUDA-graph rule for JIT backends (kPython: Triton autotune, CuTe compile cannot first run
  // inside a capture): a Python backend serves a call made during capture only if it served the
  // same key and direction eagerly before (the warm set; kg.warmup fills it; the stream is not
  // part of the key). Otherwise the next ranked backend serves, with the reason logged once.
  int select(OpId op, const CallView& call, const BoundDims& dims, bool backward = false);
  DispatchKey make_key(OpId op, const CallView& call, const BoundDims& dims) const;
  Explanation explain(OpId op, const CallView& call, const BoundDims& dims);

  // Policy: in-memory rules (added here) are asked first, then the evidence source set with
  // set_policy (none by default; null removes it). Every change drops the cached decisions.
  void set_policy(std::shared_ptr<PolicySource> policy);
  void add_policy_rule(PolicyRule rule);
  void clear_policy();
  std::string describe_policy() const;
  // Changes with every change of policy or overrides: a decision cached under one generation
  // holds while it lasts.
  uint64_t generation() const;

  // Overrides, process-wide. op "" means every op. Forcing wins over policy; an excluded backend
  // is never chosen (the reference cannot be excluded). A forced backend that cannot implement a
  // call falls back to the normal decision (policy, then reference) with a logged warning.
  void force(const std::string& op, const std::string& backend);
  void exclude(const std::string& op, const std::string& backend);
  void clear_overrides();
  struct Overrides {
    std::vector<std::pair<std::string, std::string>> forced, excluded;
  };
  Overrides overrides() const;
  void set_overrides(Overrides o);

  // Logging: each (op, reason) reaches the hook once per process.
  void set_log_hook(LogHook hook);
  void log_once(LogLevel level, OpId op, const std::string& reason);
  void reset_log_once();  // tests only

  // Reads KERNELGATE_FORCE / KERNELGATE_EXCLUDE / KERNELGATE_LOG (once, before the first decision;
  // tests call it again after changing the environment). A malformed value: one warning, default.
  void apply_env();

  ~Dispatcher();

 private:
  Dispatcher();

 public:
  struct Impl;  // defined in dispatcher.cpp

 private:
  std::unique_ptr<Impl> impl_;
};

// Device facts the key needs; provided by the CUDA part of the build when present.
int cuda_arch(int device_index);  // major*10+minor, or 0 if unknown
void set_cuda_arch_provider(int (*provider)(int device_index));
// Whether the current CUDA stream is capturing a graph (false without CUDA).
bool stream_capturing();
void set_capture_provider(bool (*provider)());
void simulate_capture_for_tests(bool on);  // CPU tests of the warm-set rule
// Whether the CUDA-graph rules for Python backends (the warm set, capturable=false) apply; on by
// default. The sweep's worker turns them off: a timing it captures must run the backend it
// times, and a backend that cannot be captured must fail the capture, a recorded result.
bool capture_rules_on();
void set_capture_rules(bool on);

}  // namespace kernelgate
