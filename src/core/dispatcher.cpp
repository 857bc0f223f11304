// The dispatcher: registry of ops and backends, cached decisions per dispatch key, overrides,
// environment switches and log-once.
//
// Note on the decision cache: each thread keeps a small direct-mapped cache of (key, generation)
// -> Decision*. Any change to policy or overrides bumps the generation, so stale entries miss.
// Decisions are never freed while the process runs (a retired decision may still be read by a
// thread that loaded it under the old generation); they are small and only change when the user
// changes policy or overrides.
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>

#include "kernelgate/dispatch.h"

namespace kernelgate {

bool DispatchKey::operator==(const DispatchKey& o) const {
  return std::memcmp(this, &o, sizeof(DispatchKey)) == 0;
}

size_t DispatchKey::hash() const {
  uint64_t w[3];
  std::memcpy(w, this, sizeof(w));
  uint64_t h = w[0] * 0x9E3779B97F4A7C15ull;
  h ^= (w[1] + 0x632BE59BD9B4E019ull) * 0xC2B2AE3D27D4EB4Full;
  h ^= (w[2] + (h << 6) + (h >> 2)) * 0x165667B19E3779F9ull;
  return static_cast<size_t>(h ^ (h >> 29));
}

namespace {

struct KeyHash {
  size_t operator()(const DispatchKey& k) const { return k.hash(); }
};

struct Decision {
  std::array<uint8_t, kMaxBackends + 1> ranked{};  // local backend indices; reference last
  int n = 0;
  int forced = -1;     // local index of a forced backend, if any
  std::string reason;  // why ranked[0] leads
};

std::atomic<int (*)(int)> g_arch_provider{nullptr};
std::array<std::atomic<int16_t>, 64> g_arch_cache{};

void default_log(LogLevel level, bool info_enabled, const std::string& op, const std::string& msg) {
  if (level == LogLevel::kInfo && !info_enabled) return;
  std::fprintf(stderr, "kernelgate %s%s%s: %s\n", level == LogLevel::kWarning ? "warning" : "info",
               op.empty() ? "" : " ", op.c_str(), msg.c_str());
}

std::string rtrim_copy(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.pop_back();
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.erase(s.begin());
  return s;
}

}  // namespace

std::string valid_utf8(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = n > 0 && i + n <= text.size();
    for (size_t k = 1; ok && k < n; ++k) ok = (static_cast<unsigned char>(text[i + k]) >> 6) == 0x2;
    if (ok) {
      out.append(text, i, n);
      i += n;
    } else {
      char esc[5];
      std::snprintf(esc, sizeof(esc), "\\x%02x", c);
      out += esc;
      ++i;
    }
  }
  return out;
}

int cuda_arch(int device_index) {
  if (device_index < 0 || device_index >= static_cast<int>(g_arch_cache.size())) return 0;
  int16_t cached = g_arch_cache[device_index].load(std::memory_order_relaxed);
  if (cached != 0) return cached;
  auto* provider = g_arch_provider.load();
  int arch = provider ? provider(device_index) : 0;
  if (arch > 0) g_arch_cache[device_index].store(static_cast<int16_t>(arch));
  return arch;
}

void set_cuda_arch_provider(int (*provider)(int)) { g_arch_provider.store(provider); }

std::atomic<bool (*)()> g_capture_provider{nullptr};
std::atomic<bool> g_simulated_capture{false};

bool stream_capturing() {
  if (g_simulated_capture.load(std::memory_order_relaxed)) return true;
  auto* provider = g_capture_provider.load(std::memory_order_relaxed);
  return provider != nullptr && provider();
}

void set_capture_provider(bool (*provider)()) { g_capture_provider.store(provider); }
void simulate_capture_for_tests(bool on) { g_simulated_capture.store(on); }

std::atomic<bool> g_capture_rules{true};
bool capture_rules_on() { return g_capture_rules.load(std::memory_order_relaxed); }
void set_capture_rules(bool on) { g_capture_rules.store(on); }

struct Dispatcher::Impl {
  // The warm set of the CUDA-graph rule (see select): hashes of (key, backend, direction) that a
  // Python backend served outside capture.
  std::mutex warm_mu;
  std::unordered_set<uint64_t> warm;

  Support warm_rule(size_t key_hash, int backend, bool backward) {
    const uint64_t w = static_cast<uint64_t>(key_hash) ^
                       (static_cast<uint64_t>(backend + 1) * 0x9E3779B97F4A7C15ull) ^
                       (backward ? 0xC2B2AE3D27D4EB4Full : 0);
    if (!capture_rules_on()) return Support::yes();
    const bool capturing = stream_capturing();
    std::lock_guard<std::mutex> lock(warm_mu);
    if (!capturing) {
      warm.insert(w);
      return Support::yes();
    }
    if (warm.count(w) != 0) return Support::yes();
    return Support::no(
        "not warm for CUDA-graph capture: a JIT backend serves a captured call only after it "
        "served the same call eagerly (kg.warmup)");
  }
  mutable std::mutex mu;  // registry, overrides, policy, decision map
  std::vector<std::unique_ptr<OpEntry>> ops;
  std::shared_ptr<PolicySource> policy;  // evidence; may be null
  bool policy_problems_logged = false;   // its problems() are logged once, at the first decision
  std::shared_ptr<InMemoryPolicy> memory;
  Overrides overrides;
  std::unordered_map<DispatchKey, Decision*, KeyHash> decisions;
  std::vector<std::unique_ptr<Decision>> all_decisions;  // owner, see the note at the top
  std::atomic<uint64_t> generation{1};
  std::once_flag env_once;

  std::mutex log_mu;
  LogHook hook;
  bool info_to_stderr = false;
  std::set<std::pair<OpId, std::string>> logged;
  std::set<std::tuple<OpId, int, const char*>> logged_rejections;

  Decision* decide(const OpEntry& e, const DispatchKey& key,
                   std::vector<std::pair<LogLevel, std::string>>* logs);

  void bump() {
    decisions.clear();
    generation.fetch_add(1, std::memory_order_release);
  }
};

namespace {
struct CacheSlot {
  DispatchKey key;
  uint64_t generation = 0;
  const Decision* decision = nullptr;
};
thread_local std::array<CacheSlot, 64> t_cache;
}  // namespace

// Op entries are read without the lock on the hot path: their vector never reallocates.
constexpr size_t kMaxOps = 1024;

Dispatcher::Dispatcher() : impl_(std::make_unique<Impl>()) {
  impl_->ops.reserve(kMaxOps);
  impl_->memory = std::make_shared<InMemoryPolicy>();
}

Dispatcher::~Dispatcher() = default;

Dispatcher& Dispatcher::get() {
  // Leaked on purpose: op registrations and thread-local caches may outlive static destruction.
  static Dispatcher* instance = new Dispatcher();
  return *instance;
}

const char* intern(const std::string& text) {
  static std::mutex mu;
  static auto* texts = new std::set<std::string>();  // leaked: reasons outlive static destruction
  std::lock_guard<std::mutex> lock(mu);
  return texts->insert(text).first->c_str();
}

OpId Dispatcher::add_op(OpContract contract) {
  if (contract.tensor_args.empty()) parse_dims(contract);
  std::lock_guard<std::mutex> lock(impl_->mu);
  TORCH_CHECK(impl_->ops.size() < kMaxOps, "too many ops registered (", kMaxOps, ")");
  for (const auto& e : impl_->ops) {
    TORCH_CHECK(e->contract.name != contract.name, "op ", contract.name, " is already registered");
  }
  auto entry = std::make_unique<OpEntry>();
  entry->id = static_cast<OpId>(impl_->ops.size());
  entry->contract = std::move(contract);
  entry->backends.reserve(kMaxBackends);
  entry->availability.reserve(kMaxBackends);
  impl_->ops.push_back(std::move(entry));
  impl_->bump();
  return impl_->ops.back()->id;
}

int Dispatcher::add_backend(OpId op, BackendDesc backend) {
  // `available` may import or probe: run it outside the lock.
  Support avail = backend.available ? backend.available() : Support::yes();
  if (avail.ok && !backend.impl) avail = Support::no("the backend has no implementation");
  if (backend.impl && !backend.impl->has_backward()) {
    // A forward-only backend: calls that need gradients go to the next ranked backend.
    auto inner = std::move(backend.can_implement);
    backend.can_implement = [inner](const CallView& call) {
      if (call.grad)
        return Support::no("forward only (no backward): serves calls that need no gradient");
      return inner ? inner(call) : Support::yes();
    };
  }
  if (!backend.can_implement)
    backend.can_implement = [](const CallView&) { return Support::yes(); };
  std::lock_guard<std::mutex> lock(impl_->mu);
  TORCH_CHECK(op < impl_->ops.size(), "unknown op id ", op);
  OpEntry& e = *impl_->ops[op];
  TORCH_CHECK(e.backends.size() < kMaxBackends, "op ", e.contract.name, " has too many backends");
  TORCH_CHECK((backend.kind == BackendKind::kReference) == e.backends.empty(), "op ",
              e.contract.name, ": its first backend, and only that one, is its reference (got ",
              backend.name, ")");
  TORCH_CHECK(!e.backends.empty() || avail.ok, "op ", e.contract.name,
              ": its reference must be available (", avail.reason, ")");
  for (const auto& b : e.backends) {
    TORCH_CHECK(b.name != backend.name, "backend ", backend.name, " is already registered for ",
                e.contract.name);
  }
  // The entries are complete before the size grows: a router that sees the new index sees them.
  e.availability.push_back(avail);
  e.backends.push_back(std::move(backend));
  impl_->bump();
  return static_cast<int>(e.backends.size()) - 1;
}

const OpEntry& Dispatcher::op(OpId id) const {
  // Entries are never removed, their storage never moves (unique_ptr) and the vector never
  // reallocates (reserved), so no lock is needed once an id has been handed out.
  return *impl_->ops[id];
}

const OpEntry* Dispatcher::find_op(const std::string& name) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (const auto& e : impl_->ops) {
    if (e->contract.name == name) return e.get();
  }
  return nullptr;
}

std::vector<std::string> Dispatcher::op_names() const {
  std::vector<std::string> out;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    for (const auto& e : impl_->ops) out.push_back(e->contract.name);
  }
  std::sort(out.begin(), out.end());  // ops register in whatever order their files load
  return out;
}

DispatchKey Dispatcher::make_key(OpId op, const CallView& call, const BoundDims& dims) const {
  DispatchKey key;
  key.op = op;
  key.dtypes.fill(kAbsentDType);
  const at::Tensor* first = nullptr;
  for (int a = 0; a < call.num_tensors; ++a) {
    const at::Tensor* t = call.tensors[a];
    if (t == nullptr || !t->defined()) continue;
    if (first == nullptr) first = t;
    key.dtypes[a] = static_cast<uint8_t>(t->scalar_type());
  }
  if (const c10::Device device = call.device(); device.is_cuda()) {
    key.arch = static_cast<int16_t>(cuda_arch(device.index() < 0 ? 0 : device.index()));
  }
  const size_t n = impl_->ops[op]->contract.named_dims.size();
  for (size_t i = 0; i < n; ++i) key.buckets[i] = size_bucket(dims.size[i]);
  key.align = align_class(call);
  key.grad = call.grad ? 1 : 0;
  key.variant = call.variant;
  return key;
}

namespace {

const std::string* find_override(const std::vector<std::pair<std::string, std::string>>& list,
                                 const std::string& op) {
  const std::string* global = nullptr;
  for (const auto& [o, b] : list) {
    if (o == op) return &b;
    if (o.empty()) global = &b;
  }
  return global;
}

bool is_excluded(const std::vector<std::pair<std::string, std::string>>& list,
                 const std::string& op, const std::string& backend) {
  for (const auto& [o, b] : list) {
    if ((o.empty() || o == op) && b == backend) return true;
  }
  return false;
}

int local_index(const OpEntry& e, const std::string& name) {
  for (size_t i = 0; i < e.backends.size(); ++i) {
    if (e.backends[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

int fallback_index(const OpEntry& e) {
  int aten = -1;
  for (size_t i = 1; i < e.backends.size(); ++i) {
    if (e.backends[i].kind == BackendKind::kEager) return static_cast<int>(i);
    if (aten < 0 && e.backends[i].kind == BackendKind::kVendor && e.backends[i].name == "aten")
      aten = static_cast<int>(i);
  }
  return aten;
}

// Builds the ranked candidate list for a key. Called with mu held.
Decision* Dispatcher::Impl::decide(const OpEntry& e, const DispatchKey& key,
                                   std::vector<std::pair<LogLevel, std::string>>* logs) {
  Impl& im = *this;
  auto d = std::make_unique<Decision>();
  const std::string& op = e.contract.name;
  std::vector<bool> used(e.backends.size(), false);
  auto push = [&](int i) {
    if (!used[i]) {
      used[i] = true;
      d->ranked[d->n++] = static_cast<uint8_t>(i);
    }
  };
  if (const std::string* forced = find_override(im.overrides.forced, op)) {
    int i = local_index(e, *forced);
    if (i < 0) {
      logs->push_back({LogLevel::kWarning, "forced backend '" + *forced +
                                               "' is not registered for this op; not forced"});
    } else if (!e.availability[i].ok) {
      logs->push_back({LogLevel::kWarning, "forced backend '" + *forced + "' is not available (" +
                                               e.availability[i].reason + "); not forced"});
    } else {
      d->forced = i;
      d->reason = "forced by override";
      push(i);
    }
  }
  // In-memory rules (set by the user or tests) first, then the evidence source.
  std::string evidence;
  std::vector<std::string> ranked = im.memory->ranked(op, key, &evidence);
  if (ranked.empty() && im.policy) ranked = im.policy->ranked(op, key, &evidence);
  for (const std::string& name : ranked) {
    int i = local_index(e, name);
    if (i < 0 || !e.availability[i].ok || is_excluded(im.overrides.excluded, op, name)) continue;
    if (d->n == 0) d->reason = "ranked first by policy (" + evidence + ")";
    push(i);
  }
  // Then the fallback: the op as plain PyTorch code, so that a call without evidence costs what
  // it costs without kernelgate; the reference last.
  const int fb = fallback_index(e);
  const bool fallback_ok = fb > 0 && e.availability[fb].ok &&
                           !is_excluded(im.overrides.excluded, op, e.backends[fb].name);
  if (d->n == 0) {
    const std::string who =
        fallback_ok ? e.backends[fb].name + " (the op as plain PyTorch code) serves it"
                    : std::string("the reference serves it");
    d->reason = !ranked.empty() ? "no backend ranked by policy is available or allowed: " + who
                : evidence.empty()
                    ? "no evidence for this region: " + who
                    : "the evidence for this region ranks no backend (" + evidence + "): " + who;
    logs->push_back({LogLevel::kInfo, d->reason});
  }
  if (fallback_ok) push(fb);
  push(0);
  Decision* raw = d.get();
  im.all_decisions.push_back(std::move(d));
  im.decisions.emplace(key, raw);
  return raw;
}

int Dispatcher::select(OpId op, const CallView& call, const BoundDims& dims, bool backward) {
  const DispatchKey key = make_key(op, call, dims);
  const size_t h = key.hash();
  CacheSlot& slot = t_cache[h & (t_cache.size() - 1)];
  const uint64_t gen = impl_->generation.load(std::memory_order_acquire);
  const Decision* d;
  if (slot.generation == gen && slot.key == key) {
    d = slot.decision;
  } else {
    std::call_once(impl_->env_once, [this] { apply_env(); });
    std::vector<std::pair<LogLevel, std::string>> logs;
    std::shared_ptr<PolicySource> unlogged;  // whose problems are not yet logged
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      auto it = impl_->decisions.find(key);
      d = it != impl_->decisions.end() ? it->second : impl_->decide(*impl_->ops[op], key, &logs);
      if (!impl_->policy_problems_logged && impl_->policy) {
        impl_->policy_problems_logged = true;
        unlogged = impl_->policy;
      }
    }
    // Outside the lock: a log hook may run Python, which may call back into kernelgate.
    if (unlogged) {
      for (const auto& p : unlogged->problems()) log_once(LogLevel::kWarning, kNoOp, p);
    }
    for (auto& [level, msg] : logs) log_once(level, op, msg);
    slot.key = key;
    slot.decision = d;
    slot.generation = gen;
  }
  const OpEntry& e = *impl_->ops[op];
  for (int i = 0; i < d->n; ++i) {
    const int b = d->ranked[i];
    if (b == 0) return 0;  // the reference implements every valid call
    Support s = e.backends[b].can_implement(call);
    if (s.ok && e.backends[b].kind == BackendKind::kPython) s = impl_->warm_rule(h, b, backward);
    if (s.ok) return b;
    // Rare path: log the rejection once per (op, backend, reason).
    bool first;
    {
      std::lock_guard<std::mutex> lock(impl_->log_mu);
      first = impl_->logged_rejections.emplace(op, b, s.reason).second;
    }
    if (first) {
      log_once(i == 0 && d->forced == b ? LogLevel::kWarning : LogLevel::kInfo, op,
               e.backends[b].name + " cannot implement this call (" + s.reason + ")");
    }
  }
  return 0;
}

Explanation Dispatcher::explain(OpId op, const CallView& call, const BoundDims& dims) {
  std::call_once(impl_->env_once, [this] { apply_env(); });
  const DispatchKey key = make_key(op, call, dims);
  const OpEntry& e = *impl_->ops[op];
  Explanation ex;
  ex.op = e.contract.name;
  ex.key = describe_key(key);
  std::string reason;
  std::vector<uint8_t> ranked;
  Overrides ov;
  std::shared_ptr<PolicySource> policy;
  {
    std::vector<std::pair<LogLevel, std::string>> ignored;
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->decisions.find(key);
    const Decision* d = it != impl_->decisions.end() ? it->second : impl_->decide(e, key, &ignored);
    ranked.assign(d->ranked.begin(), d->ranked.begin() + d->n);
    reason = d->reason;
    ov = impl_->overrides;
    policy = impl_->policy;
  }
  if (policy) ex.evidence_problems = policy->problems();
  int chosen = -1;
  std::vector<std::string> reasons(e.backends.size());
  for (size_t r = 0; r < ranked.size(); ++r) {
    const int b = ranked[r];
    const Support s = b == 0 ? Support::yes() : e.backends[b].can_implement(call);
    if (!s.ok) {
      reasons[b] = std::string("ranked #") + std::to_string(r + 1) +
                   " but cannot implement this call: " + s.reason;
    } else if (chosen < 0) {
      chosen = b;
      reasons[b] = r == 0 ? reason : std::string("first ranked backend that implements this call");
    } else {
      reasons[b] = "ranked #" + std::to_string(r + 1) + ", below " + e.backends[chosen].name;
    }
  }
  for (size_t b = 0; b < e.backends.size(); ++b) {
    if (!reasons[b].empty()) continue;
    const std::string& name = e.backends[b].name;
    if (!e.availability[b].ok) {
      reasons[b] = std::string("not available: ") + e.availability[b].reason;
    } else if (is_excluded(ov.excluded, e.contract.name, name)) {
      reasons[b] = "excluded by override";
    } else {
      Support s = e.backends[b].can_implement(call);
      reasons[b] = s.ok ? "no evidence of a pass for this region"
                        : std::string("cannot implement this call: ") + s.reason;
    }
  }
  for (size_t b = 0; b < e.backends.size(); ++b) {
    CandidateReport c;
    c.backend = e.backends[b].name;
    c.kind = backend_kind_name(e.backends[b].kind);
    c.selected = static_cast<int>(b) == chosen;
    c.reason = reasons[b];
    ex.candidates.push_back(std::move(c));
  }
  ex.backend = e.backends[chosen].name;
  ex.reason = reasons[chosen];
  return ex;
}

void Dispatcher::set_policy(std::shared_ptr<PolicySource> policy) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->policy = std::move(policy);
  impl_->policy_problems_logged = false;
  impl_->bump();
}

void Dispatcher::add_policy_rule(PolicyRule rule) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->memory->add(std::move(rule));
  impl_->bump();
}

void Dispatcher::clear_policy() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->memory->clear();
  impl_->bump();
}

uint64_t Dispatcher::generation() const {
  return impl_->generation.load(std::memory_order_acquire);
}

std::string Dispatcher::describe_policy() const {
  std::shared_ptr<PolicySource> evidence;
  std::string text;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    evidence = impl_->policy;
    text = impl_->memory->describe();
  }
  return text + "; " + (evidence ? evidence->describe() : std::string("no evidence source"));
}

void Dispatcher::force(const std::string& op, const std::string& backend) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& f = impl_->overrides.forced;
  f.erase(std::remove_if(f.begin(), f.end(), [&](const auto& p) { return p.first == op; }),
          f.end());
  f.emplace_back(op, backend);
  impl_->bump();
}

void Dispatcher::exclude(const std::string& op, const std::string& backend) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->overrides.excluded.emplace_back(op, backend);
  impl_->bump();
}

void Dispatcher::clear_overrides() { set_overrides({}); }

Dispatcher::Overrides Dispatcher::overrides() const {
  std::call_once(impl_->env_once, [this] { const_cast<Dispatcher*>(this)->apply_env(); });
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->overrides;
}

void Dispatcher::set_overrides(Overrides o) {
  std::call_once(impl_->env_once, [this] { apply_env(); });
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->overrides = std::move(o);
  impl_->bump();
}

void Dispatcher::set_log_hook(LogHook hook) {
  std::lock_guard<std::mutex> lock(impl_->log_mu);
  impl_->hook = std::move(hook);
}

void Dispatcher::log_once(LogLevel level, OpId op, const std::string& reason) {
  LogHook hook;
  bool info;
  const std::string name = op == kNoOp ? std::string() : impl_->ops[op]->contract.name;
  {
    std::lock_guard<std::mutex> lock(impl_->log_mu);
    if (!impl_->logged.emplace(op, reason).second) return;
    hook = impl_->hook;
    info = impl_->info_to_stderr;
  }
  // Messages quote environment values and file names, which may be any bytes: the hook (Python's
  // logging) gets valid UTF-8.
  const std::string text = valid_utf8(reason);
  if (hook) {
    hook(level, name, text);
  } else {
    default_log(level, info, name, text);
  }
}

void Dispatcher::reset_log_once() {
  std::lock_guard<std::mutex> lock(impl_->log_mu);
  impl_->logged.clear();
  impl_->logged_rejections.clear();
}

namespace {

// Parses "backend" or "op=backend[,op=backend...]". Returns false with `problem` set when
// malformed.
bool parse_override_list(const char* text, Dispatcher& d, bool list_is_exclude,
                         std::vector<std::pair<std::string, std::string>>* out,
                         std::string* problem) {
  std::string s(text);
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    std::string item =
        rtrim_copy(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    start = comma == std::string::npos ? s.size() + 1 : comma + 1;
    if (item.empty()) {
      *problem = "empty entry";
      return false;
    }
    std::string op, backend = item;
    size_t eq = item.find('=');
    if (eq != std::string::npos) {
      op = rtrim_copy(item.substr(0, eq));
      backend = rtrim_copy(item.substr(eq + 1));
      if (op.empty() || backend.empty()) {
        *problem = "entry '" + item + "' is not op=backend";
        return false;
      }
    }
    bool known = false;
    for (const std::string& name : d.op_names()) {
      if (!op.empty() && name != op) continue;
      const OpEntry* e = d.find_op(name);
      for (const auto& b : e->backends) known |= b.name == backend;
      if (!op.empty()) {
        if (!known) {
          *problem = "op '" + op + "' has no backend '" + backend + "'";
          return false;
        }
        break;
      }
    }
    if (!op.empty() && d.find_op(op) == nullptr) {
      *problem = "unknown op '" + op + "'";
      return false;
    }
    if (!known) {
      *problem = "no op has a backend '" + backend + "'";
      return false;
    }
    if (list_is_exclude && backend == "reference") {
      *problem = "the reference cannot be excluded; it serves every call nothing else may";
      return false;
    }
    out->emplace_back(op, backend);
  }
  return true;
}

}  // namespace

void Dispatcher::apply_env() {
  Overrides o;
  struct Var {
    const char* name;
    std::vector<std::pair<std::string, std::string>>* list;
  } vars[] = {{"KERNELGATE_FORCE", &o.forced}, {"KERNELGATE_EXCLUDE", &o.excluded}};
  for (const Var& v : vars) {
    const char* text = std::getenv(v.name);
    if (text == nullptr || *text == '\0') continue;
    std::vector<std::pair<std::string, std::string>> parsed;
    std::string problem;
    if (parse_override_list(text, *this, v.list == &o.excluded, &parsed, &problem)) {
      *v.list = std::move(parsed);
    } else {
      log_once(LogLevel::kWarning, kNoOp,
               std::string(v.name) + "='" + text + "' is malformed (" + problem +
                   "); ignoring it. Expected 'backend' or 'op=backend[,op=backend...]'");
    }
  }
  bool info = false;
  if (const char* level = std::getenv("KERNELGATE_LOG"); level != nullptr && *level != '\0') {
    std::string l(level);
    if (l == "info") {
      info = true;
    } else if (l != "warning") {
      log_once(LogLevel::kWarning, kNoOp,
               "KERNELGATE_LOG='" + l +
                   "' is malformed; expected 'info' or 'warning'; using "
                   "'warning'");
    }
  }
  {
    std::lock_guard<std::mutex> lock(impl_->log_mu);
    impl_->info_to_stderr = info;
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->overrides = std::move(o);
  impl_->bump();
}

// ---- In-memory policy ------------------------------------------------------------------------

void InMemoryPolicy::add(PolicyRule rule) {
  std::lock_guard<std::mutex> lock(mu_);
  rules_.push_back(std::move(rule));
}

void InMemoryPolicy::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  rules_.clear();
}

size_t InMemoryPolicy::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rules_.size();
}

std::vector<std::string> InMemoryPolicy::ranked(const std::string& op, const DispatchKey& key,
                                                std::string* evidence) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const PolicyRule& r : rules_) {
    if (r.op != op) continue;
    if (r.arch != -2 && r.arch != key.arch) continue;
    if (r.dtype >= 0) {
      int first = kAbsentDType;
      for (uint8_t t : key.dtypes) {
        if (t != kAbsentDType) {
          first = t;
          break;
        }
      }
      if (first != r.dtype) continue;
    }
    if (r.align >= 0 && r.align != static_cast<int>(key.align)) continue;
    if (r.grad >= 0 && r.grad != key.grad) continue;
    bool fits = true;
    for (size_t i = 0; i < r.max_buckets.size() && i < key.buckets.size(); ++i) {
      if (key.buckets[i] != kEmptyBucket && key.buckets[i] > r.max_buckets[i]) fits = false;
    }
    if (!fits) continue;
    if (evidence) *evidence = r.evidence.empty() ? "in-memory rule" : r.evidence;
    return r.ranked;
  }
  return {};
}

std::string InMemoryPolicy::describe() const {
  return "in-memory policy with " + std::to_string(size()) + " rule(s)";
}

std::string describe_key(const DispatchKey& key) {
  const Dispatcher& d = Dispatcher::get();
  const OpEntry& e = d.op(key.op);
  std::string s = e.contract.name + " ";
  s += key.arch == kCpuArch ? std::string("cpu") : "sm_" + std::to_string(key.arch);
  s += " ";
  bool first = true;
  for (size_t a = 0; a < e.contract.tensor_args.size(); ++a) {
    if (!first) s += ",";
    first = false;
    s += key.dtypes[a] == kAbsentDType ? std::string("none")
                                       : dtype_name(static_cast<c10::ScalarType>(key.dtypes[a]));
  }
  for (size_t i = 0; i < e.contract.named_dims.size(); ++i) {
    s += " " + e.contract.named_dims[i];
    s += key.buckets[i] == kEmptyBucket ? std::string("=0")
                                        : "<=2^" + std::to_string(key.buckets[i]);
  }
  s += " ";
  s += align_class_name(key.align);
  s += key.grad ? " grad" : " nograd";
  if (key.variant != 0) s += " variant=" + std::to_string(key.variant);
  return s;
}

}  // namespace kernelgate
