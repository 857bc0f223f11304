// What the parts of the evidence store share: the file's identity, the field tables, and rows as
// they are stored, merged and exchanged. Private to src/store.
//
// Note on rows: merge, import and export stream rows in one order (fingerprints, runs, results)
// from a source (a store, a JSON document) to a RowSink (an Importer, the JSON writer), so memory
// stays flat however large the store.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "store/sqlite_db.h"
#include "store/store.h"

namespace kernelgate::store::detail {

// Why kernelgate must not write `path` ("is a FIFO", "is a directory", ...), decided from the
// file's type alone (following symbolic links) without opening it: empty when the path is new
// or names a regular file. Every file a command writes at a path a user named goes through this:
// writing would replace a device, block on a FIFO, or write through a dangling link.
std::string unwritable_reason(const std::string& path);

constexpr int32_t kApplicationId = 0x4B474556;  // "KGEV" in the SQLite header
constexpr std::string_view kApplicationName = "kernelgate-evidence";

// ---- Field tables ---------------------------------------------------------------------------
// One list per struct drives SQL column lists, binding, reading and JSON, so a field is added in
// one place (plus a schema step).

// A column: its name (in SQL and JSON) and the member it holds, of one of the types Stmt and the
// JSON exchange read and write.
template <class Row, class... Types>
struct Column {
  const char* name;
  std::variant<Types Row::*...> field;
};

// Identity fields in id() order. Names and order are part of every stored id: changing them
// changes every id (and so makes all stored evidence stale); bump kFingerprintIdScheme with it.
constexpr std::string_view kFingerprintIdScheme = "kernelgate.fingerprint.1";
using FingerprintColumn = Column<Fingerprint, std::string, int, int64_t>;
inline const FingerprintColumn kFingerprintIdentity[] = {
    {"gpu_name", &Fingerprint::gpu_name},
    {"compute_capability", &Fingerprint::compute_capability},
    {"sm_count", &Fingerprint::sm_count},
    {"memory_bytes", &Fingerprint::memory_bytes},
    {"driver", &Fingerprint::driver},
    {"cuda_runtime", &Fingerprint::cuda_runtime},
    {"torch_version", &Fingerprint::torch_version},
    {"kernelgate_version", &Fingerprint::kernelgate_version},
    {"source_hash", &Fingerprint::source_hash},
};

using ResultColumn =
    Column<Result, std::string, int, int64_t, bool, double, std::optional<double>, Disposition>;
inline const ResultColumn kResultColumns[] = {
    {"op", &Result::op},
    {"backend", &Result::backend},
    {"case_id", &Result::case_id},
    {"arch", &Result::arch},
    {"dtype", &Result::dtype},
    {"buckets", &Result::buckets},
    {"region", &Result::region},
    {"align", &Result::align},
    {"grad", &Result::grad},
    {"shape", &Result::shape},
    {"layout", &Result::layout},
    {"regime", &Result::regime},
    {"seed", &Result::seed},
    {"disposition", &Result::disposition},
    {"reason", &Result::reason},
    {"max_rel_l2", &Result::max_rel_l2},
    {"max_max_over_rms", &Result::max_max_over_rms},
    {"device_median_us", &Result::device_median_us},
    {"device_spread_us", &Result::device_spread_us},
    {"device_samples", &Result::device_samples},
    {"eager_median_us", &Result::eager_median_us},
    {"eager_spread_us", &Result::eager_spread_us},
    {"eager_samples", &Result::eager_samples},
    {"rel_noise", &Result::rel_noise},
    {"throttled", &Result::throttled},
    {"clocks_before", &Result::clocks_before},
    {"clocks_after", &Result::clocks_after},
    {"created_at", &Result::created_at},
};

// Calls visit(column name, row.*field) for each column of the table, in table order.
template <class Row, class Columns, class Visit>
void for_each_column(Row& row, const Columns& columns, Visit&& visit) {
  for (const auto& col : columns) {
    std::visit([&](auto field) { visit(col.name, row.*field); }, col.field);
  }
}

// "a, b, c", each name behind `prefix`.
template <class Columns>
std::string column_list(const Columns& columns, std::string_view prefix = "") {
  std::string out;
  for (const auto& c : columns) out += (out.empty() ? "" : ", ") + std::string(prefix) + c.name;
  return out;
}

// Throws StoreError unless the store was opened read-write.
void require_writable(const Store& store);

// ---- Rows -----------------------------------------------------------------------------------

// A merge or import source that is inconsistent; nothing of it is kept.
struct SourceError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct RunRow {
  std::string uuid;
  std::string fingerprint_id;
  std::string command;
  int64_t started_at = 0;
  std::string kernelgate_version;
};

// Where a source sends its rows: begin(section) for "fingerprints", "runs", "results" in that
// order, each followed by that section's rows.
class RowSink {
 public:
  virtual ~RowSink() = default;
  virtual void begin(const std::string& section) = 0;
  virtual void fingerprint(const std::string& id, const Fingerprint& fp) = 0;
  virtual void run(const RunRow& run) = 0;
  virtual void result(const std::string& run_uuid, const Result& r) = 0;
};

// Source: every row of a store, from one read snapshot.
void read_store(sqlite3* db, const std::string& path, RowSink& sink);

// The stored form of Fingerprint::backend_versions: a JSON object of strings. Both throw
// SourceError, its message starting with `where`, on a map that is not UTF-8 or text that is
// not such an object.
std::string string_map_to_json(const std::map<std::string, std::string>& map,
                               const std::string& where);
std::map<std::string, std::string> string_map_from_json(const std::string& text,
                                                        const std::string& where);

// "SELECT id, <identity columns>, backend_versions, clocks_seen FROM fingerprints".
const std::string& fingerprint_select();
// Reads a row of fingerprint_select() starting at column `first`.
Fingerprint read_fingerprint(const Stmt& s, const std::string& path, int first = 1);
// Whether the fingerprint was new.
bool insert_fingerprint(sqlite3* db, const std::string& path, const std::string& id,
                        const Fingerprint& fp);
// Reads the result columns of a row starting at column `first`.
Result read_result(const Stmt& s, int first);

// Inserts into results; with skip_duplicates a row whose natural key exists is left alone
// (returns false), otherwise that is an error.
class ResultInserter {
 public:
  ResultInserter(sqlite3* db, const std::string& path, bool skip_duplicates);
  bool insert(int64_t run_id, const std::string& fingerprint_id, const Result& r);

 private:
  sqlite3* db_;
  const std::string& path_;
  Stmt stmt_;
};

// Sink: inserts into a store inside the caller's write transaction. A source must be
// self-contained and consistent: each fingerprint id is recomputed from its fields, and every
// run and result must name a fingerprint or run listed before it; otherwise SourceError.
class Importer final : public RowSink {
 public:
  Importer(sqlite3* db, const std::string& path);

  void begin(const std::string&) override {}
  void fingerprint(const std::string& id, const Fingerprint& fp) override;
  void run(const RunRow& run) override;
  void result(const std::string& run_uuid, const Result& r) override;

  const MergeStats& stats() const { return stats_; }

 private:
  sqlite3* db_;
  const std::string& path_;
  Stmt add_run_, find_run_;
  ResultInserter results_;
  std::set<std::string> fingerprints_;
  std::map<std::string, std::pair<int64_t, std::string>> runs_;  // uuid -> (local id, fp id)
  MergeStats stats_;
};

}  // namespace kernelgate::store::detail
