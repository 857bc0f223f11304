// Evidence: the fingerprints it is measured under, which stored rows may serve this process, and
// the policy they give. The sweep (sweep.h) writes the rows; the dispatcher's evidence source
// (LazyEvidencePolicy) and the CLI (`kernelgate policy show`, `doctor`) read them through here.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernelgate/dispatch.h"
#include "store/store.h"

namespace kernelgate::harness {

// ---- fingerprints -----------------------------------------------------------------------------

// The source hash of `op`'s evidence: its own files and the shared ones (CMakeLists.txt says
// which); the whole build's hash for "" or an op outside that table.
std::string op_source_hash(const std::string& op);

// The fingerprint of this process's device and software (CUDA device 0 when present, else CPU)
// for evidence of `op` (source hash: op_source_hash(op)).
store::Fingerprint current_fingerprint(const std::string& op = "");

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
