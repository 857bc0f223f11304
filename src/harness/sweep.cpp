// Sweeps: cases x backends, each run in a worker process, results into the store.
#include "harness/sweep.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "harness/evidence.h"
#include "harness/worker_pool.h"

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
    m.disposition = store::Disposition::kCrashed;
    m.reason = "unreadable worker response: " + problem;
    return m;
  }
  switch (o.kind) {
    case Outcome::Kind::kTimedOut: m.disposition = store::Disposition::kTimedOut; break;
    case Outcome::Kind::kOutOfMemory: m.disposition = store::Disposition::kOutOfMemory; break;
    default: m.disposition = store::Disposition::kCrashed;
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

// The stored row of one run.
store::Result to_result(const std::string& op, const std::string& backend,
                        const std::string& case_id, const Case& c, const Measured& m,
                        int device_arch) {
  store::Result r;
  r.op = op;
  r.backend = backend;
  r.case_id = case_id;
  r.arch = m.arch;
  r.dtype = c.dtype;
  r.buckets = m.buckets;
  r.region = m.region.empty() ? case_region(c, device_arch) : m.region;
  r.align = m.align;
  r.grad = c.grad;
  r.shape = dims_text(c);
  r.layout = c.layout;
  r.regime = c.regime;
  r.seed = c.seed;
  r.disposition = m.disposition;
  r.reason = m.reason;
  if (m.disposition == store::Disposition::kPassed ||
      m.disposition == store::Disposition::kIncorrect) {
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
  return r;
}

}  // namespace

SweepReport sweep(const SweepOptions& o) {
  auto t0 = std::chrono::steady_clock::now();
  const OpEntry* e = Dispatcher::get().find_op(o.op);
  if (e == nullptr) throw std::runtime_error("unknown op '" + o.op + "'");
  for (const auto& a : e->contract.tensor_args) {
    if (a.dtype_class == DTypeClass::kIndex && !e->contract.index_ranges.count(a.name)) {
      throw std::runtime_error("cannot sweep " + o.op +
                               " yet: the harness does not generate integer (index) "
                               "tensors without a range, and its contract gives none for '" +
                               a.name + "'; calls run the reference until it has evidence");
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
  // Each row is written under its own backend's fingerprint (a backend's version is part of it):
  // one run per distinct fingerprint.
  const OpFingerprints fps = current_fingerprints(o.op).at(o.op);
  std::map<std::string, std::string> fingerprint_of;  // backend -> fingerprint id
  std::map<std::string, int64_t> run_of;              // fingerprint id -> this sweep's run
  for (const auto& b : backends) fingerprint_of[b] = fps.of(b).id();

  const bool gpu = fps.op.gpu_name != "cpu";
  const int device_arch = gpu ? cuda_arch(0) : kCpuArch;
  // 2^30 on a GPU: cross_entropy's logits at a 128k vocabulary (8192 x 128256) and
  // linear_cross_entropy's weight at hidden 4096 are production shapes.
  const int64_t max_elements = gpu ? (int64_t{1} << 30) : (int64_t{1} << 20);
  std::vector<Case> cases = make_cases(o.op, o.grid, o.dtypes, o.seeds, max_elements);
  // One run per (case, backend) of this shard. Validation-only rows are kept apart from timed
  // ones, so a later bench run still times.
  struct Pending {
    const Case* c;
    std::string backend, case_id;
  };
  std::vector<Pending> work;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (static_cast<int>(i % o.shard_count) != o.shard_index) continue;
    const std::string case_id =
        cases[i].id() + (o.time ? "" : "/untimed") + "/seed=" + std::to_string(cases[i].seed);
    for (const auto& b : backends) {
      if (o.only.empty() || o.only.count({b, case_id})) work.push_back({&cases[i], b, case_id});
    }
  }
  SweepReport report;
  report.fingerprint_id = fps.op.id();
  report.fingerprint_ids = fingerprint_of;
  report.planned = static_cast<int>(work.size());
  WorkerPool pool(WorkerCommand{o.worker_argv, {}});
  if (o.interrupted) pool.set_interrupt(o.interrupted);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o.case_timeout_s * 1000));
  // A claim older than this is abandoned (its sweep hung or its host is gone): the longest a run
  // may take, twice, plus a worker's start.
  const auto stale_after_s = static_cast<int64_t>(2 * o.case_timeout_s) + 300;
  int done = 0;
  auto run_one = [&](const Pending& p) {
    const Case* c = p.c;
    const std::string& backend = p.backend;
    Measured m;
    if (!availability[backend].ok) {
      m.disposition = store::Disposition::kUnsupported;
      m.reason = std::string("not available: ") + availability[backend].reason;
    } else if (Outcome ready = start_worker(pool); !ready.ok()) {
      m = from_outcome(ready);
      m.reason = "worker did not start: " + m.reason;
    } else {
      // Seeds and value regimes repeat a case with other values: each is validated, and one (the
      // first seed of N(0, 1) values) is timed; the values do not change the time, and the sweep
      // spends its time on more cases instead.
      const bool time_this = o.time && c->seed == 0 && c->regime == "normal";
      std::string line = encode_fields({{"backend", backend},
                                        {"time", time_this ? "1" : "0"},
                                        {"cap", std::to_string(o.time_cap_s)},
                                        {"case", c->encode()}});
      const Outcome out = pool.request(line, timeout);
      m = from_outcome(out);
      std::map<std::string, std::string> fields;
      std::string ignored;
      if (out.ok() && decode_fields(out.response, &fields, &ignored) &&
          fields[kWorkerExitsField] == "1") {
        pool.retire();  // the next run must not reach a worker that is exiting
      }
    }
    store::Result r = to_result(o.op, backend, p.case_id, *c, m, device_arch);
    const std::string& id = fingerprint_of[backend];
    if (!run_of.count(id)) run_of[id] = db.begin_run(fps.of(backend), o.command);
    db.add_result(run_of[id], r);
    const std::string disposition(store::to_string(m.disposition));
    report.dispositions[disposition]++;
    if (o.progress) o.progress(done, report.planned, backend + " " + disposition);
  };
  // Each run is claimed first: what another sweep into the same store is running is left to it
  // and looked at again once this sweep has run everything else.
  std::vector<Pending> deferred;
  auto attempt = [&](const Pending& p) {
    if (o.interrupted && o.interrupted()) throw Interrupted();
    switch (db.claim(fingerprint_of[p.backend], o.op, p.backend, p.case_id, stale_after_s)) {
      case store::Store::Claim::kDone:
        ++done;
        ++report.skipped;
        if (o.progress) o.progress(done, report.planned, "resumed " + p.backend);
        return true;
      case store::Store::Claim::kTaken: return false;
      case store::Store::Claim::kMine:
        ++done;
        run_one(p);
        return true;
    }
    return false;
  };
  for (auto& p : work) {
    if (!attempt(p)) deferred.push_back(std::move(p));
  }
  while (!deferred.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::erase_if(deferred, attempt);
  }
  report.worker_restarts = pool.restarts();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return report;
}

}  // namespace kernelgate::harness
