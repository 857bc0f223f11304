// Sweeps into the store, and policy derivation from the store.
#include "harness/sweep.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <cmath>
#include <set>
#include <stdexcept>

#include "harness/worker_pool.h"

#ifdef KERNELGATE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>
#endif

#ifndef KERNELGATE_VERSION
#define KERNELGATE_VERSION "unknown"
#endif
#ifndef KERNELGATE_SOURCE_HASH
#define KERNELGATE_SOURCE_HASH "unknown"
#endif
#ifndef KERNELGATE_OP_SOURCE_HASHES
#define KERNELGATE_OP_SOURCE_HASHES ""
#endif
#ifndef KERNELGATE_TORCH_VERSION
#define KERNELGATE_TORCH_VERSION "unknown"
#endif
#ifndef KERNELGATE_TORCH_CUDA
#define KERNELGATE_TORCH_CUDA "none"
#endif

namespace kernelgate::harness {

void load_backend_plugin(const std::string& path) {
  static std::mutex mu;
  static std::set<std::string> loaded;
  std::lock_guard<std::mutex> lock(mu);
  if (loaded.count(path)) return;
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (h == nullptr) throw std::runtime_error("cannot load plugin " + path + ": " + dlerror());
  using Fn = void (*)(Dispatcher&);
  auto fn = reinterpret_cast<Fn>(dlsym(h, "kernelgate_register_backends"));
  if (fn == nullptr) {
    throw std::runtime_error("plugin " + path + " has no kernelgate_register_backends function");
  }
  fn(Dispatcher::get());
  loaded.insert(path);
}

namespace {

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  for (size_t at = 0; at <= s.size();) {
    size_t end = std::min(s.find(',', at), s.size());
    if (end > at) out.push_back(s.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

// stem -> hash, from the "stem=hash," table CMakeLists.txt builds.
const std::map<std::string, std::string>& stem_hashes() {
  static const std::map<std::string, std::string> table = [] {
    std::map<std::string, std::string> t;
    for (const auto& entry : split_commas(KERNELGATE_OP_SOURCE_HASHES)) {
      size_t eq = entry.find('=');
      if (eq != std::string::npos) t[entry.substr(0, eq)] = entry.substr(eq + 1);
    }
    return t;
  }();
  return table;
}

}  // namespace

std::string op_source_hash(const std::string& op) {
  const OpEntry* e = op.empty() ? nullptr : Dispatcher::get().find_op(op);
  if (e == nullptr) return KERNELGATE_SOURCE_HASH;
  const auto stems = split_commas(e->contract.source_stem.empty() ? op : e->contract.source_stem);
  std::string combined;
  for (const auto& stem : stems) {
    auto it = stem_hashes().find(stem);
    if (it == stem_hashes().end()) return KERNELGATE_SOURCE_HASH;  // outside the table: the build's hash
    combined += it->second;
  }
  // Several stems: one stable hash of theirs.
  return stems.size() == 1 ? combined : store::fnv1a64_hex(combined);
}

store::Fingerprint current_fingerprint(const std::string& op) {
  store::Fingerprint f;
  f.torch_version = KERNELGATE_TORCH_VERSION;
  f.kernelgate_version = KERNELGATE_VERSION;
  f.source_hash = op_source_hash(op);
  f.gpu_name = "cpu";
  f.compute_capability = "cpu";
  f.cuda_runtime = KERNELGATE_TORCH_CUDA;
  f.driver = "none";
#ifdef KERNELGATE_WITH_CUDA
  if (at::cuda::is_available()) {
    const cudaDeviceProp* p = at::cuda::getDeviceProperties(0);
    f.gpu_name = p->name;
    f.compute_capability = std::to_string(p->major) + "." + std::to_string(p->minor);
    f.sm_count = p->multiProcessorCount;
    f.memory_bytes = static_cast<int64_t>(p->totalGlobalMem);
    int driver = 0;
    cudaDriverGetVersion(&driver);
    f.driver = std::to_string(driver / 1000) + "." + std::to_string((driver % 1000) / 10);
  }
#endif
  if (f.gpu_name == "cpu") f.sm_count = static_cast<int>(at::get_num_threads());
  return f;
}

namespace {

store::Disposition disposition_of(const std::string& s) {
  auto d = store::disposition_from_string(s);
  return d ? *d : store::Disposition::kCrashed;
}

std::string dims_text(const Case& c) {
  std::string s;
  for (const auto& [k, v] : c.dims) s += (s.empty() ? "" : "x") + std::to_string(v);
  return s;
}

// A worker's outcome as a measurement: a crash, hang or OOM of the worker is the result.
Measured from_outcome(const Outcome& o) {
  Measured m;
  if (o.ok()) {
    std::string problem;
    auto decoded = Measured::decode(o.response, &problem);
    if (decoded) return *decoded;
    m.disposition = "crashed";
    m.reason = "unreadable worker response: " + problem;
    return m;
  }
  switch (o.kind) {
    case Outcome::Kind::kTimedOut: m.disposition = "timed_out"; break;
    case Outcome::Kind::kOutOfMemory: m.disposition = "out_of_memory"; break;
    default: m.disposition = "crashed";
  }
  m.reason = o.reason;  // names the signal or exit code and ends with the worker's last stderr line
  return m;
}

// A fresh worker loads torch and the plugins before it can answer: wait for that with a
// generous limit, so the per-case timeout measures the case alone.
Outcome start_worker(WorkerPool& pool) {
  if (pool.pid() > 0) return Outcome{};
  return pool.request("ping", std::chrono::minutes(5));
}

}  // namespace

SweepReport sweep(const SweepOptions& o) {
  auto t0 = std::chrono::steady_clock::now();
  const OpEntry* e = Dispatcher::get().find_op(o.op);
  if (e == nullptr) throw std::runtime_error("unknown op '" + o.op + "'");
  for (const auto& a : e->contract.tensor_args) {
    if (a.dtype_class == DTypeClass::kIndex && !e->contract.index_ranges.count(a.name)) {
      throw std::runtime_error("cannot sweep " + o.op + " yet: the harness does not generate integer (index) "
                               "tensors without a range, and its contract gives none for '" + a.name +
                               "'; calls run the reference until it has evidence");
    }
  }
  if (o.shard_count < 1 || o.shard_index < 0 || o.shard_index >= o.shard_count) {
    throw std::runtime_error("--shard must be i/N with 0 <= i < N");
  }
  std::vector<std::string> backends = o.backends;
  if (backends.empty()) {
    for (const auto& b : e->backends) backends.push_back(b.name);
  }
  std::map<std::string, Support> availability;
  for (const auto& name : backends) {
    auto it = std::find_if(e->backends.begin(), e->backends.end(),
                           [&](const BackendDesc& b) { return b.name == name; });
    if (it == e->backends.end()) {
      throw std::runtime_error("op " + o.op + " has no backend '" + name + "'");
    }
    availability[name] = e->availability[it - e->backends.begin()];
  }
  auto opened = store::Store::open(o.db_path, store::Mode::kReadWrite);
  if (!opened) throw std::runtime_error(opened.problem);
  store::Store& db = *opened.store;
  const store::Fingerprint fp = current_fingerprint(o.op);
  const std::string fp_id = fp.id();
  int64_t run_id = db.begin_run(fp, o.command);

  const bool gpu = fp.gpu_name != "cpu";
  const int device_arch = gpu ? cuda_arch(0) : kCpuArch;
  const int64_t max_elements = gpu ? (int64_t{1} << 28) : (int64_t{1} << 20);
  std::vector<Case> cases = make_cases(o.op, o.grid, o.dtypes, o.seeds, max_elements);
  std::vector<std::pair<const Case*, std::string>> work;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (static_cast<int>(i % o.shard_count) != o.shard_index) continue;
    for (const auto& b : backends) work.emplace_back(&cases[i], b);
  }
  SweepReport report;
  report.fingerprint_id = fp_id;
  report.planned = static_cast<int>(work.size());
  WorkerPool pool(WorkerCommand{o.worker_argv, {}});
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o.case_timeout_s * 1000));
  int done = 0;
  for (const auto& [c, backend] : work) {
    // Validation-only rows are kept apart from timed ones, so a later bench run still times.
    const std::string case_id =
        c->id() + (o.time ? "" : "/untimed") + "/seed=" + std::to_string(c->seed);
    ++done;
    if (db.has_result(fp_id, o.op, backend, case_id)) {
      ++report.skipped;
      if (o.progress) o.progress(done, report.planned, "resumed " + backend);
      continue;
    }
    Measured m;
    if (!availability[backend].ok) {
      m.disposition = "unsupported";
      m.reason = std::string("not available: ") + availability[backend].reason;
    } else if (Outcome ready = start_worker(pool); !ready.ok()) {
      m = from_outcome(ready);
      m.reason = "worker did not start: " + m.reason;
    } else {
      // Seeds repeat a case with fresh values: each is validated, and the first is timed (the
      // values do not change the time; the sweep spends its time on more cases instead).
      const bool time_this = o.time && c->seed == 0;
      std::string line = encode_fields({{"backend", backend},
                                        {"time", time_this ? "1" : "0"},
                                        {"cap", std::to_string(o.time_cap_s)},
                                        {"case", c->encode()}});
      const Outcome out = pool.request(line, timeout);
      m = from_outcome(out);
      std::map<std::string, std::string> fields;
      std::string ignored;
      if (out.ok() && decode_fields(out.response, &fields, &ignored) && fields[kWorkerExitsField] == "1") {
        pool.retire();  // the next run must not reach a worker that is exiting
      }
    }
    store::Result r;
    r.op = o.op;
    r.backend = backend;
    r.case_id = case_id;
    r.arch = m.arch;
    r.dtype = c->dtype;
    r.buckets = m.buckets;
    r.region = m.region.empty() ? case_region(*c, device_arch) : m.region;
    r.align = m.align;
    r.grad = c->grad;
    r.shape = dims_text(*c);
    r.layout = c->layout;
    r.regime = c->regime;
    r.seed = c->seed;
    r.disposition = disposition_of(m.disposition);
    r.reason = m.reason;
    if (m.disposition == "passed" || m.disposition == "incorrect") {
      r.max_rel_l2 = m.max_rel_l2;
      r.max_max_over_rms = m.max_max_over_rms;
    }
    r.device_median_us = m.device_median_us;
    r.device_spread_us = m.device_spread_us;
    r.device_samples = m.device_samples;
    r.eager_median_us = m.eager_median_us;
    r.eager_spread_us = m.eager_spread_us;
    r.eager_samples = m.eager_samples;
    if (m.device_median_us) r.rel_noise = m.rel_noise;
    r.throttled = m.throttled;
    r.clocks_before = m.clocks_before;
    r.clocks_after = m.clocks_after;
    db.add_result(run_id, r);
    report.dispositions[m.disposition]++;
    if (o.progress) o.progress(done, report.planned, backend + " " + m.disposition);
  }
  report.worker_restarts = pool.restarts();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return report;
}

// ---- policy ------------------------------------------------------------------------------------

namespace {

int preference(const std::string& backend) {
  // Fixed tie order: our kernels, vendor paths, Python packages, the reference.
  if (backend == "reference") return 3;
  if (backend.rfind("kernelgate", 0) == 0) return 0;
  if (backend == "aten") return 1;
  return 2;
}

std::string case_of(const std::string& case_id) {
  size_t p = case_id.rfind("/seed=");
  return p == std::string::npos ? case_id : case_id.substr(0, p);
}

}  // namespace

std::vector<RegionPolicy> derive_policy(const std::vector<store::Result>& rows) {
  // region -> backend -> case -> device medians over seeds
  std::map<std::string, std::string> region_op;
  std::map<std::string, std::map<std::string, std::vector<const store::Result*>>> by;
  for (const auto& r : rows) {
    if (r.disposition == store::Disposition::kUnsupported) continue;  // not in this region at all
    by[r.region][r.backend].push_back(&r);
    region_op[r.region] = r.op;
  }
  std::vector<RegionPolicy> out;
  for (const auto& [region, backends] : by) {
    RegionPolicy rp;
    rp.op = region_op[region];
    rp.region = region;
    std::map<std::string, std::map<std::string, std::vector<double>>> times;
    std::vector<std::string> eligible;
    for (const auto& [backend, results] : backends) {
      BackendStanding s;
      s.backend = backend;
      int timed = 0;
      for (const store::Result* r : results) {
        ++s.cases;
        if (r->disposition == store::Disposition::kPassed) {
          ++s.passed;
          // Device time (graph replay) where measured, else the eager call time; validation-only
          // runs prove correctness, not speed.
          const std::optional<double> t = r->device_median_us ? r->device_median_us : r->eager_median_us;
          if (t) {
            ++timed;
            times[backend][case_of(r->case_id)].push_back(*t);
            if (r->rel_noise) s.noise = std::max(s.noise, *r->rel_noise);
          }
        } else {
          s.failures[std::string(store::to_string(r->disposition))]++;
          if (s.first_failure.empty()) s.first_failure = r->case_id + ": " + r->reason;
        }
      }
      if (s.passed == s.cases && timed > 0) eligible.push_back(backend);
      rp.standings.push_back(s);
    }
    // Cases every eligible backend has: scores compare like with like.
    std::set<std::string> common;
    bool first = true;
    for (const auto& b : eligible) {
      std::set<std::string> mine;
      for (const auto& [c, v] : times[b]) mine.insert(c);
      if (first) {
        common = mine;
        first = false;
      } else {
        std::set<std::string> both;
        std::set_intersection(common.begin(), common.end(), mine.begin(), mine.end(),
                              std::inserter(both, both.begin()));
        common = both;
      }
    }
    std::map<std::string, double> score, noise;
    for (auto& s : rp.standings) {
      if (std::find(eligible.begin(), eligible.end(), s.backend) == eligible.end()) continue;
      double log_sum = 0;
      int n = 0;
      for (const auto& c : common) {
        auto v = times[s.backend][c];
        std::sort(v.begin(), v.end());
        log_sum += std::log(std::max(v[v.size() / 2], 1e-3));
        ++n;
      }
      s.score_us = n ? std::exp(log_sum / n) : 0;
      score[s.backend] = s.score_us;
      noise[s.backend] = s.noise;
    }
    auto same = [&](const std::string& a, const std::string& b) {
      double m = std::max(0.02, 2 * std::max(noise[a], noise[b]));
      double hi = std::max(score[a], score[b]), lo = std::max(std::min(score[a], score[b]), 1e-12);
      return hi / lo - 1 <= m;  // symmetric: same(a, b) == same(b, a)
    };
    std::sort(eligible.begin(), eligible.end(),
              [&](const std::string& a, const std::string& b) { return score[a] < score[b]; });
    // Within-noise neighbours take the fixed preference order (stable, so noise never flips).
    for (size_t pass = 0; pass < eligible.size(); ++pass) {
      for (size_t i = 0; i + 1 < eligible.size(); ++i) {
        const auto& a = eligible[i];
        const auto& b = eligible[i + 1];
        if (same(a, b) && preference(b) < preference(a)) std::swap(eligible[i], eligible[i + 1]);
      }
    }
    rp.ranked = eligible;
    if (eligible.size() >= 2) {
      rp.margin = score[eligible[1]] / std::max(score[eligible[0]], 1e-12) - 1;
      rp.comparison = same(eligible[0], eligible[1]) ? "same" : "faster";
    }
    out.push_back(std::move(rp));
  }
  return out;
}

EvidencePolicy::EvidencePolicy(std::vector<RegionPolicy> regions, std::string provenance)
    : provenance_(std::move(provenance)) {
  for (auto& r : regions) {
    if (!r.ranked.empty()) by_region_[r.region] = std::move(r.ranked);
  }
}

std::vector<std::string> EvidencePolicy::ranked(const std::string&, const DispatchKey& key,
                                                std::string* evidence) const {
  auto it = by_region_.find(describe_key(key));
  if (it == by_region_.end()) return {};
  if (evidence) *evidence = provenance_;
  return it->second;
}

std::string EvidencePolicy::describe() const {
  return provenance_ + " (" + std::to_string(by_region_.size()) + " regions)";
}

bool shipped_evidence_applies(const store::Fingerprint& stored, const store::Fingerprint& current) {
  store::Fingerprint a = stored, b = current;
  a.driver = b.driver = "";
  a.memory_bytes = b.memory_bytes = 0;
  return a.id() == b.id();
}

namespace {

std::vector<store::Result> rows_of(const store::Store& s, bool shipped, const std::string& op,
                                   const store::Fingerprint& current) {
  std::vector<std::string> ids{current.id()};
  if (shipped) {
    for (const auto& st : s.stale(current).stale) {
      if (shipped_evidence_applies(st.fingerprint, current)) ids.push_back(st.id);
    }
  }
  std::vector<store::Result> rows;
  for (const auto& id : ids) {
    auto more = s.results(id, op);
    rows.insert(rows.end(), more.begin(), more.end());
  }
  return rows;
}

}  // namespace

std::map<std::string, store::Fingerprint> current_fingerprints() {
  std::map<std::string, store::Fingerprint> out;
  for (const auto& name : Dispatcher::get().op_names()) out[name] = current_fingerprint(name);
  return out;
}

std::vector<store::Result> usable_rows(const store::Store& s, bool shipped,
                                       const std::map<std::string, store::Fingerprint>& fingerprints) {
  std::vector<store::Result> rows;
  for (const auto& [op, fp] : fingerprints) {
    auto more = rows_of(s, shipped, op, fp);
    rows.insert(rows.end(), more.begin(), more.end());
  }
  return rows;
}

std::vector<store::Result> usable_rows(const store::Store& s, bool shipped, const std::string& op) {
  if (op.empty()) return usable_rows(s, shipped, current_fingerprints());
  return rows_of(s, shipped, op, current_fingerprint(op));
}

LazyEvidencePolicy::LazyEvidencePolicy(std::string user_db, std::vector<std::string> shipped_dbs)
    : user_db_(std::move(user_db)), shipped_(std::move(shipped_dbs)),
      fingerprints_(current_fingerprints()) {}

void LazyEvidencePolicy::load() const {
  std::call_once(once_, [this] {
    std::vector<std::string> notes;
    auto opened = store::Store::open(user_db_, store::Mode::kReadOnly);
    if (opened) {
      try {
        auto rows = usable_rows(*opened.store, /*shipped=*/false, fingerprints_);
        user_ = std::make_unique<EvidencePolicy>(derive_policy(rows), "evidence in " + user_db_);
        notes.push_back(user_->describe());
      } catch (const std::exception& ex) {
        notes.push_back(std::string("store not used: ") + ex.what());
      }
    } else {
      notes.push_back("store not used: " + opened.problem);
    }
    std::vector<store::Result> shipped_rows;
    for (const auto& path : shipped_) {
      auto s = store::Store::open(path, store::Mode::kReadOnly);
      if (!s) {
        notes.push_back("shipped evidence not used: " + s.problem);
        continue;
      }
      try {
        auto rows = usable_rows(*s.store, /*shipped=*/true, fingerprints_);
        shipped_rows.insert(shipped_rows.end(), rows.begin(), rows.end());
      } catch (const std::exception& ex) {
        notes.push_back(std::string("shipped evidence not used: ") + ex.what());
      }
    }
    if (!shipped_rows.empty()) {
      shipped_policy_ = std::make_unique<EvidencePolicy>(derive_policy(shipped_rows),
                                                         "evidence shipped with kernelgate");
      notes.push_back(shipped_policy_->describe());
    }
    for (const auto& n : notes) status_ += (status_.empty() ? "" : "; ") + n;
  });
}

std::vector<std::string> LazyEvidencePolicy::ranked(const std::string& op, const DispatchKey& key,
                                                    std::string* evidence) const {
  load();
  if (user_) {
    auto r = user_->ranked(op, key, evidence);
    if (!r.empty()) return r;
  }
  if (shipped_policy_) return shipped_policy_->ranked(op, key, evidence);
  return {};
}

std::string LazyEvidencePolicy::describe() const {
  load();
  return status_;
}

}  // namespace kernelgate::harness
