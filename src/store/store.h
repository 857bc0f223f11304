// The evidence store facade: fingerprints, runs and measured results in one SQLite file.
// Code outside src/store includes only this header. Never used on the dispatch hot path.
//
// Note on identity: a Result belongs to the Fingerprint of its run. Readers ask for rows of one
// fingerprint id; rows of any other fingerprint are stale and only show up in stale() reports, so
// evidence measured under other software or hardware is never silently reused (invariant 7).
//
// Note on concurrency: one Store (one SQLite connection) per thread at a time. Many processes
// may write one file at once (WAL, busy timeout, retried short transactions). After fork(),
// open a new Store in the child; never use one opened before the fork.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

struct sqlite3;

namespace kernelgate::store {

// The schema version this code writes; stores at a lower version are migrated on read-write
// open, stores at a higher one are refused.
inline constexpr int kSchemaVersion = 2;
// The version of the JSON exchange document (export_json / import_json): its rows are the
// fingerprints, runs and results, unchanged since schema version 1.
inline constexpr int kExchangeVersion = 1;

// 16 hex digits: FNV-1a 64 of `bytes`; stable across machines and processes.
std::string fnv1a64_hex(std::string_view bytes);

// The device + software environment a measurement was taken in.
struct Fingerprint {
  std::string gpu_name;
  std::string compute_capability;  // "9.0", or "cpu"
  int sm_count = 0;
  int64_t memory_bytes = 0;
  std::string driver;
  std::string cuda_runtime;
  std::string torch_version;
  std::string kernelgate_version;
  std::string source_hash;
  // Backend -> its version (BackendDesc::version), for a backend with one whose rows these are.
  std::map<std::string, std::string> backend_versions;
  std::string clocks_seen;  // informational only: not part of id()

  // 16 hex digits: FNV-1a 64 of a versioned, length-prefixed serialisation of every field but
  // clocks_seen. Equal on every machine and process for equal fields.
  std::string id() const;
  // Why evidence measured under *this (stored) does not apply under `current`, one line per
  // differing identity field, e.g. "torch_version: stored 2.10.0, current 2.11.0". Empty iff
  // the ids are equal.
  std::vector<std::string> differences(const Fingerprint& current) const;

  bool operator==(const Fingerprint&) const = default;
};

enum class Disposition { kPassed, kIncorrect, kCrashed, kTimedOut, kOutOfMemory, kUnsupported };
// "passed", "incorrect", "crashed", "timed_out", "out_of_memory", "unsupported".
std::string_view to_string(Disposition disposition);
std::optional<Disposition> disposition_from_string(std::string_view text);

// One measured (case, backend).
struct Result {
  std::string op;
  std::string backend;
  std::string case_id;  // stable id of the case within the op
  // Dispatch region.
  int arch = -1;  // e.g. 90; -1 for cpu
  std::string dtype;
  std::string buckets;  // per named dim, e.g. "14,12"
  std::string region;   // the dispatch key's description (describe_key): the policy's unit
  std::string align;
  bool grad = false;
  // Case details.
  std::string shape;
  std::string layout;
  std::string regime;
  int64_t seed = 0;
  // Outcome.
  Disposition disposition = Disposition::kUnsupported;
  std::string reason;
  double max_rel_l2 = kNotMeasured;  // NaN = not measured; stored as NULL
  double max_max_over_rms = kNotMeasured;
  // Timing: absent for anything not timed (a failing candidate never is); NaN is stored as absent.
  std::optional<double> device_median_us;
  std::optional<double> device_spread_us;  // p90 - p10
  int device_samples = 0;
  std::optional<double> eager_median_us;
  std::optional<double> eager_spread_us;
  int eager_samples = 0;
  std::optional<double> rel_noise;
  bool throttled = false;
  std::string clocks_before;
  std::string clocks_after;
  int64_t created_at = 0;  // unix seconds; add_result() fills 0 with the current time
  int64_t run_id = 0;      // set when read back; add_result() takes the run id separately

  static constexpr double kNotMeasured = std::numeric_limits<double>::quiet_NaN();
};

// A stored fingerprint other than the current one, and why its rows do not apply.
struct StaleFingerprint {
  std::string id;
  Fingerprint fingerprint;
  int64_t runs = 0;
  int64_t results = 0;
  std::vector<std::string> differences;  // fingerprint.differences(current)
};

struct StaleReport {
  std::string current_id;
  int64_t current_results = 0;
  std::vector<StaleFingerprint> stale;  // ordered by id
};

// What merge() or import_json() added; rows already present (same run uuid, op, backend,
// case_id) are skipped, which makes both idempotent.
struct MergeStats {
  int64_t fingerprints_added = 0;
  int64_t runs_added = 0;
  int64_t results_added = 0;
  int64_t results_skipped = 0;
};

// Every failure inside an operation on an open store. The message names the store's path and,
// where SQLite failed, SQLite's message; sqlite_code() is SQLite's extended code, or 0.
class StoreError : public std::runtime_error {
 public:
  explicit StoreError(const std::string& message, int sqlite_code = 0)
      : std::runtime_error(message), sqlite_code_(sqlite_code) {}
  int sqlite_code() const { return sqlite_code_; }

 private:
  int sqlite_code_;
};

// One schema step: the SQL that takes a store from version to_version - 1 to to_version.
struct Migration {
  int to_version;
  std::string_view sql;
  // The step adds only what writers use (e.g. sweep claims): a store not yet migrated past it
  // still reads the same, so a read-only open (which never migrates) accepts it.
  bool readers_unaffected = false;
};
// The ordered steps of this build; the last one's to_version is kSchemaVersion. Steps are
// append-only: a released step is never edited.
std::span<const Migration> schema_migrations();

enum class Mode { kReadOnly, kReadWrite };

class Store;

// Either a store, or a problem saying why the file at the path cannot be used.
struct OpenResult {
  std::unique_ptr<Store> store;
  std::string problem;
  bool not_found = false;  // the problem is only that a read-only open found no file there
  explicit operator bool() const { return store != nullptr; }
};

class Store {
 public:
  // Never throws. A missing file is created (with its directories) in kReadWrite mode and is a
  // problem in kReadOnly mode. A file that is not a usable store (not SQLite, damaged, another
  // application's database, a newer schema; in kReadOnly mode also an older schema) is a problem
  // naming the path, and is left byte-for-byte as it was (with no file created beside it, unless
  // it already had a -wal or -journal). A read-write open migrates an older schema in one
  // transaction.
  static OpenResult open(const std::string& path, Mode mode);
  // Same, with an explicit migration list instead of schema_migrations() (tests, tools).
  static OpenResult open(const std::string& path, Mode mode, std::span<const Migration> steps);

  // $KERNELGATE_DB, else $XDG_CACHE_HOME/kernelgate/evidence.sqlite, else
  // $HOME/.cache/kernelgate/evidence.sqlite (unset and empty variables count as absent).
  static std::string default_path();

  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const std::string& path() const { return path_; }
  Mode mode() const { return mode_; }
  int schema_version() const { return schema_version_; }

  // Records the fingerprint (if new) and a run with a fresh random uuid; returns the run id.
  int64_t begin_run(const Fingerprint& fingerprint, const std::string& command);
  // One short transaction, retried while another process holds the write lock. Throws if the
  // run does not exist or (run, op, backend, case_id) is already recorded: a result is never
  // overwritten (invariant 3).
  void add_result(int64_t run_id, const Result& result);

  // Concurrent sweeps share work by claiming each (op, backend, case_id) of a fingerprint before
  // running it. kDone: a result is already stored. kTaken: another live owner claimed it less
  // than stale_after_s ago (an owner on this host whose process is gone is never live). kMine:
  // the claim is this Store's now. add_result() drops the claim of what it stores.
  enum class Claim { kMine, kDone, kTaken };
  Claim claim(const std::string& fingerprint_id, const std::string& op, const std::string& backend,
              const std::string& case_id, int64_t stale_after_s);

  // Whether any run of this fingerprint recorded (op, backend, case_id): resumable sweeps.
  bool has_result(const std::string& fingerprint_id, const std::string& op,
                  const std::string& backend, const std::string& case_id) const;
  // Rows of this fingerprint only, in insertion order; op "" means every op.
  std::vector<Result> results(const std::string& fingerprint_id, const std::string& op = "") const;
  // How many rows of this fingerprint each (op, backend) has.
  std::map<std::pair<std::string, std::string>, int64_t> result_counts(
      const std::string& fingerprint_id) const;
  std::optional<Fingerprint> fingerprint(const std::string& fingerprint_id) const;
  StaleReport stale(const Fingerprint& current) const;

  // Copies the fingerprints, runs and results of another store file (opened read-only) in one
  // transaction. All or nothing: a source that cannot be opened, or whose rows are inconsistent
  // (a fingerprint whose fields do not hash to its id, a dangling reference), adds nothing.
  MergeStats merge(const std::string& other_path);
  // A self-describing JSON document: {"format": "kernelgate-evidence", "schema_version": 1,
  // (kExchangeVersion) "fingerprints": [...], "runs": [...], "results": [...]}, one row per line,
  // rows in the order they were stored. NaN metrics are null, infinities "inf" / "-inf". Written to
  // a temporary file and renamed into place.
  void export_json(const std::string& json_path) const;
  // Reads what export_json() writes (members it does not know are ignored; "format" and
  // "schema_version" must come first, and rows may only name rows listed before them). All or
  // nothing, like merge().
  MergeStats import_json(const std::string& json_path);

 private:
  Store(sqlite3* db, std::string path, Mode mode, int schema_version);

  sqlite3* db_;
  std::string path_;
  Mode mode_;
  int schema_version_;
  std::string owner_;  // random, per Store: whose claims are ours
};

}  // namespace kernelgate::store
