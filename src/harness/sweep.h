// Sweeps (cases x backends, each run in a worker process, results into the store) and the
// policy derived from stored evidence.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "harness/harness.h"
#include "kernelgate/dispatch.h"
#include "store/store.h"

namespace kernelgate::harness {

// Loads a plugin library and calls its `kernelgate_register_backends(kernelgate::Dispatcher&)`.
// Loading the same path twice registers once. Throws std::runtime_error naming the problem.
void load_backend_plugin(const std::string& path);

// The source hash of `op`'s evidence (docs/evidence.md, "When evidence goes stale"): over the
// tokens of its stems' files and the shared computing files; the whole build's hash for "".
std::string op_source_hash(const std::string& op);
// The files that hash covers (empty for an op defined from Python: its hash is its own).
std::vector<std::string> op_source_files(const std::string& op);

// The fingerprint of this process's device and software (CUDA device 0 when present, else CPU)
// for evidence of `op` (source hash: op_source_hash(op)).
store::Fingerprint current_fingerprint(const std::string& op = "");

// Field a worker adds to its answer when it exits right after it (kernelgate-worker does after
// a failed graph capture): the sweep replaces it before the next run.
constexpr char kWorkerExitsField[] = "worker_exits";

struct SweepOptions {
  std::string op;
  std::vector<std::string> backends;  // empty: every backend registered for the op
  std::vector<std::string> dtypes;    // empty: every accepted dtype
  Grid grid = Grid::kQuick;
  int seeds = 3;
  int shard_index = 0, shard_count = 1;  // this process runs cases with index % count == index
  std::string db_path;
  bool time = true;
  double case_timeout_s = 120;
  double time_cap_s = 1.0;
  std::vector<std::string> worker_argv;  // kernelgate-worker [--load plugin.so ...]
  std::string command;                   // recorded with the run
  std::function<void(int done, int total, const std::string& what)> progress;
};

struct SweepReport {
  std::string fingerprint_id;
  int planned = 0;   // (case, seed, backend) runs in this shard
  int skipped = 0;   // already in the store for this fingerprint (resumed)
  std::map<std::string, int> dispositions;
  int worker_restarts = 0;
  double seconds = 0;
};

// Throws std::runtime_error for configuration errors (unknown op or backend, unusable store).
SweepReport sweep(const SweepOptions& options);

// ---- policy from evidence ---------------------------------------------------------------------

struct BackendStanding {
  std::string backend;
  int cases = 0, passed = 0;
  std::map<std::string, int> failures;  // disposition -> count
  std::string first_failure;            // one reason, for people
  double score_us = 0;                  // geometric mean of per-case median device times
  double noise = 0;                     // largest relative noise among its timed runs
};

struct RegionPolicy {
  std::string op, region;
  std::vector<std::string> ranked;           // eligible backends, fastest first
  std::vector<BackendStanding> standings;    // every backend measured in the region
  std::string comparison;                    // winner vs runner-up: faster / same
  double margin = 0;                         // runner-up time / winner time - 1
};

// Eligible: every validated run of the backend in the region passed (and one was timed). Ranked
// by the geometric mean over the region's cases, common to all, of the per-case median device
// time (the eager call time where no device time could be measured); two backends are "same" when their ratio is within max(2%, 2 x their largest relative
// noise); ties are ordered by a fixed preference (our kernels, vendor paths, Python packages,
// then the reference), so noise never flips a ranking.
std::vector<RegionPolicy> derive_policy(const std::vector<store::Result>& rows);

// A policy source over derived regions: exact match on the dispatch key's description.
class EvidencePolicy final : public PolicySource {
 public:
  explicit EvidencePolicy(std::vector<RegionPolicy> regions, std::string provenance);
  std::vector<std::string> ranked(const std::string& op, const DispatchKey& key,
                                  std::string* evidence) const override;
  std::string describe() const override;

 private:
  std::map<std::string, std::vector<std::string>> by_region_;
  std::string provenance_;
};

// Loads evidence lazily (on the dispatcher's first decision) from the user's store and the
// evidence shipped with the package. User store: rows of the current fingerprint. Shipped
// evidence: rows whose fingerprint matches the current one on every field but the driver
// version and memory size (same GPU model, SM count, CUDA runtime, torch, kernelgate build);
// anything else, e.g. another GPU, is not used. Problems (no file, corrupt, foreign schema)
// leave that source out, with the reason in describe().
class LazyEvidencePolicy final : public PolicySource {
 public:
  LazyEvidencePolicy(std::string user_db, std::vector<std::string> shipped_dbs);
  std::vector<std::string> ranked(const std::string& op, const DispatchKey& key,
                                  std::string* evidence) const override;
  std::string describe() const override;

 private:
  void load() const;
  std::string user_db_;
  std::vector<std::string> shipped_;
  // Each registered op's fingerprint, taken at construction: load() runs inside the dispatcher's
  // decision (under its lock) and must not call back into the dispatcher.
  std::map<std::string, store::Fingerprint> fingerprints_;
  mutable std::once_flag once_;
  mutable std::unique_ptr<EvidencePolicy> user_, shipped_policy_;
  mutable std::string status_;
};

// True when shipped evidence measured under `stored` may serve a process with `current`.
bool shipped_evidence_applies(const store::Fingerprint& stored, const store::Fingerprint& current);

// Rows of `s` (of `op`, or of every registered op) that may serve this process: those of the
// op's current fingerprint and, for shipped evidence, those of every fingerprint the rule above
// admits.
std::vector<store::Result> usable_rows(const store::Store& s, bool shipped, const std::string& op = "");
// The same for the ops of `fingerprints` (op -> its current fingerprint), without the dispatcher.
std::vector<store::Result> usable_rows(const store::Store& s, bool shipped,
                                       const std::map<std::string, store::Fingerprint>& fingerprints);
// Every registered op's current fingerprint.
std::map<std::string, store::Fingerprint> current_fingerprints();

}  // namespace kernelgate::harness
