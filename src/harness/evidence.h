// Evidence: the fingerprints it is measured under, which stored rows may serve this process, and
// the policy they give. The sweep (sweep.h) writes the rows; the dispatcher's evidence source
// (LazyEvidencePolicy) and the CLI (`kernelgate policy show`, `doctor`) read them through here.
//
// Note on fingerprints: evidence of (op, backend) carries the device, the software, the op's
// source hash and, for a backend with a version (BackendDesc::version: a Python backend's
// package version and code hash), {backend: version} in backend_versions. A backend's version
// moving makes its own evidence stale and no other backend's.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kernelgate/dispatch.h"
#include "store/store.h"

namespace kernelgate::harness {

// ---- fingerprints -----------------------------------------------------------------------------

// The source hash of `op`'s evidence: its own files and the shared ones (CMakeLists.txt says
// which); the whole build's hash for "" or an op outside that table.
std::string op_source_hash(const std::string& op);
// The files that hash covers (empty for an op defined from Python: its hash is its own).
std::vector<std::string> op_source_files(const std::string& op);

// The fingerprint of this process's device and software (CUDA device 0 when present, else CPU)
// for evidence of `op` (source hash: op_source_hash(op)) measured on `backend` ("": any backend
// without a version). Throws std::runtime_error for a backend the op does not have.
store::Fingerprint current_fingerprint(const std::string& op = "", const std::string& backend = "");

// The current fingerprints of one op's evidence.
struct OpFingerprints {
  store::Fingerprint op;                               // current_fingerprint(op)
  std::map<std::string, store::Fingerprint> backends;  // current_fingerprint(op, b), registered b
  // The fingerprint rows of `backend` must carry to be current. A backend this process does not
  // have (a plugin not loaded here) gets the op's: only its rows without a version can be current.
  const store::Fingerprint& of(const std::string& backend) const;
};
// Each registered op's current fingerprints (`op` alone when given; none for an unknown op).
std::map<std::string, OpFingerprints> current_fingerprints(const std::string& op = "");

// True when shipped evidence measured under `stored` may serve a process with `current`: every
// field matches but the driver version and the memory size.
bool shipped_evidence_applies(const store::Fingerprint& stored, const store::Fingerprint& current);

// True when shipped evidence measured under `stored` is *borrowed* by a process with `current`:
// another GPU model (name, SM count, memory, driver differ) of the same architecture (compute
// capability) running an identical build (CUDA runtime, torch, kernelgate, the op's source hash,
// backend versions), and shipped_evidence_applies does not hold. Its pass/fail results transfer
// (the same compiled code on the same instruction set); its timings do not (another memory
// system, SM count and clock): borrowed rows give eligibility, never a ranking.
bool evidence_borrowable(const store::Fingerprint& stored, const store::Fingerprint& current);

// ---- usable evidence --------------------------------------------------------------------------

// Rows that may serve this process, from one source.
struct EvidenceSet {
  bool shipped = false;
  bool borrowed = false;  // rows borrowed from another GPU of this architecture, untimed
  // What explain and `policy show` name as the evidence: "evidence in <user store>",
  // "evidence shipped with kernelgate" or "evidence borrowed from <GPU> ...".
  std::string provenance;
  std::vector<store::Result> rows;
};

inline constexpr double kRerankSlowerOnLender = 3.0;

struct UsableEvidence {
  // The user's store first (when it could be read), then the shipped evidence (when any row
  // applies), then evidence borrowed from other GPUs of this architecture for the regions
  // neither speaks for. No region has rows in two sets.
  std::vector<EvidenceSet> sets;
  // Regions holding borrowed rows -> the GPUs lending them (also regions of the user's set: a
  // rerank times there what borrowed rows prove correct, case by case).
  std::map<std::string, std::set<std::string>> borrowed_in;
  // (op, backend, case id) that borrowed rows show passing and their lender timed, and the
  // user's store holds no row of: what `kernelgate rerank` runs (validated and timed here);
  // not a run its lender timed more than kRerankSlowerOnLender times slower than the fastest
  // backend of the same case.
  std::set<std::tuple<std::string, std::string, std::string>> to_rerank;
  std::vector<std::string> notes;     // per source used (or user store not made yet): for people
  std::vector<std::string> problems;  // per existing source left out: why
};

// The one rule for which evidence serves this process, for the ops of `fingerprints`:
// - the user's store: rows whose fingerprint is their (op, backend)'s current one;
// - shipped stores: rows whose fingerprint shipped_evidence_applies to their (op, backend)'s,
//   only in regions where the user's store has no evidence (a row other than unsupported);
// - borrowed rows (evidence_borrowable), their timings cleared: in a region the user's store
//   speaks for, for each (backend, case) it has no row of (so a rerank's local timings rank
//   the backends the borrowed rows prove correct, and a borrowed failure keeps its backend out);
//   in a region no other set speaks for, as a set of their own, which ranks nothing.
// A source that cannot be opened or read is left out, with the reason in problems. Never throws.
UsableEvidence usable_evidence(const std::string& user_db,
                               const std::vector<std::string>& shipped_dbs,
                               const std::map<std::string, OpFingerprints>& fingerprints);

// The user's store as `kernelgate doctor` shows it: rows current for their (op, backend), and
// each stored fingerprint holding rows current for none, counting those rows, with why: how it
// differs from those rows' current fingerprint (the closest one, where they are of several
// backends or of an op this process does not have). Throws store::StoreError.
struct StoreStanding {
  int64_t current_results = 0;
  std::vector<store::StaleFingerprint> stale;  // ordered by id; `results`: its stale rows only
};
StoreStanding store_standing(const store::Store& s,
                             const std::map<std::string, OpFingerprints>& fingerprints);

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
  std::vector<std::string> ranked;         // eligible backends, fastest first
  std::vector<BackendStanding> standings;  // every backend measured in the region
  std::string comparison;                  // winner vs runner-up: faster / same
  double margin = 0;                       // runner-up time / winner time - 1
  std::string evidence;                    // the provenance of its rows (EvidenceSet)
};

// Eligible: every validated run of the backend in the region passed (and one was timed). Ranked
// by the geometric mean over the region's cases, common to all, of the per-case median device
// time (the eager call time where no device time could be measured); two backends are "same"
// when their ratio is within max(2%, 2 x their largest relative noise); ties are ordered by a
// fixed preference (our kernels, vendor paths, Python packages, then the reference), so noise
// never flips a ranking. Unsupported rows do not place a backend in a region.
std::vector<RegionPolicy> derive_policy(const std::vector<store::Result>& rows);
// The regions of every set, set by set, each with its set's provenance.
std::vector<RegionPolicy> derive_policy(const UsableEvidence& evidence);

// A policy source over the regions the evidence gives: exact match on the dispatch key's
// description; each region answers with its own provenance.
class EvidencePolicy final : public PolicySource {
 public:
  explicit EvidencePolicy(const UsableEvidence& evidence);
  std::vector<std::string> ranked(const std::string& op, const DispatchKey& key,
                                  std::string* evidence) const override;
  std::string describe() const override;  // "<provenance> (N regions)" per set

 private:
  struct Entry {
    std::vector<std::string> ranked;
    std::string evidence;
  };
  std::map<std::string, Entry> by_region_;
  std::string description_;
};

// Loads evidence lazily (on the dispatcher's first decision) from the user's store and the
// evidence shipped with the package, by usable_evidence(). Problems leave that source out, with
// the reason in describe().
class LazyEvidencePolicy final : public PolicySource {
 public:
  LazyEvidencePolicy(std::string user_db, std::vector<std::string> shipped_dbs);
  std::vector<std::string> ranked(const std::string& op, const DispatchKey& key,
                                  std::string* evidence) const override;
  std::string describe() const override;
  std::vector<std::string> problems() const override;

 private:
  void load() const;
  std::string user_db_;
  std::vector<std::string> shipped_;
  // Each registered op's fingerprints, taken at construction: load() runs inside the dispatcher's
  // decision (under its lock) and must not call back into the dispatcher.
  std::map<std::string, OpFingerprints> fingerprints_;
  mutable std::once_flag once_;
  mutable std::unique_ptr<EvidencePolicy> policy_;
  mutable std::string status_;
  mutable std::vector<std::string> problems_;
};

}  // namespace kernelgate::harness
