// Rows as stored: reading and inserting fingerprints, runs and results, a store as a row source,
// and the Importer sink that merge and import share.
#include "store/store_internal.h"

#include <string>

namespace kernelgate::store::detail {
namespace {

// "?first, ?first+1, ..." for `count` parameters.
std::string placeholders(int first, int count) {
  std::string out;
  for (int i = first; i < first + count; ++i) out += (i == first ? "?" : ", ?") + std::to_string(i);
  return out;
}

}  // namespace

const std::string& fingerprint_select() {
  static const std::string sql = "SELECT id, " + column_list(kFingerprintIdentity) +
                                 ", backend_versions, clocks_seen FROM fingerprints";
  return sql;
}

Fingerprint read_fingerprint(const Stmt& s, const std::string& path, int first) {
  Fingerprint fp;
  int c = first;
  for_each_column(fp, kFingerprintIdentity, [&](const char*, auto& field) { s.get(c++, field); });
  try {
    fp.backend_versions = string_map_from_json(s.get<std::string>(c), "backend_versions");
  } catch (const SourceError& e) {
    fail(path, std::string("damaged fingerprint row: ") + e.what());
  }
  s.get(c + 1, fp.clocks_seen);
  return fp;
}

bool insert_fingerprint(sqlite3* db, const std::string& path, const std::string& id,
                        const Fingerprint& fp) {
  constexpr int n = static_cast<int>(std::size(kFingerprintIdentity));
  static const std::string sql = "INSERT INTO fingerprints (id, " +
                                 column_list(kFingerprintIdentity) +
                                 ", backend_versions, clocks_seen) VALUES (" +
                                 placeholders(1, n + 3) + ") ON CONFLICT (id) DO NOTHING";
  std::string backend_versions;
  try {
    backend_versions = string_map_to_json(fp.backend_versions, "backend_versions");
  } catch (const SourceError& e) {
    fail(path, "cannot store fingerprint " + id + ": " + e.what());
  }
  Stmt s(db, path, sql);
  s.bind(1, id);
  int i = 2;
  for_each_column(fp, kFingerprintIdentity, [&](const char*, const auto& v) { s.bind(i++, v); });
  s.bind(i, backend_versions);
  s.bind(i + 1, fp.clocks_seen);
  s.step();
  return sqlite3_changes(db) == 1;
}

Result read_result(const Stmt& s, int first) {
  Result r;
  int c = first;
  for_each_column(r, kResultColumns, [&](const char*, auto& field) { s.get(c++, field); });
  return r;
}

ResultInserter::ResultInserter(sqlite3* db, const std::string& path, bool skip_duplicates)
    : db_(db),
      path_(path),
      stmt_(db, path,
            "INSERT INTO results (run_id, fingerprint_id, " + column_list(kResultColumns) +
                ") VALUES (" + placeholders(1, static_cast<int>(std::size(kResultColumns)) + 2) +
                ")" +
                (skip_duplicates ? " ON CONFLICT (run_id, op, backend, case_id) DO NOTHING" : "")) {
}

bool ResultInserter::insert(int64_t run_id, const std::string& fingerprint_id, const Result& r) {
  stmt_.reset();
  stmt_.bind(1, run_id);
  stmt_.bind(2, fingerprint_id);
  int i = 3;
  for_each_column(r, kResultColumns, [&](const char*, const auto& v) { stmt_.bind(i++, v); });
  try {
    stmt_.step();
  } catch (const StoreError& e) {
    if (e.sqlite_code() != SQLITE_CONSTRAINT_UNIQUE) throw;
    fail(path_, "run " + std::to_string(run_id) + " already has a result for op " + r.op +
                    ", backend " + r.backend + ", case " + r.case_id +
                    " (results are never overwritten)");
  }
  return sqlite3_changes(db_) == 1;
}

void read_store(sqlite3* db, const std::string& path, RowSink& sink) {
  exec(db, path, "BEGIN");
  try {
    sink.begin("fingerprints");
    Stmt f(db, path, fingerprint_select() + " ORDER BY id");
    while (f.step()) sink.fingerprint(f.get<std::string>(0), read_fingerprint(f, path));
    sink.begin("runs");
    Stmt r(db, path,
           "SELECT uuid, fingerprint_id, command, started_at, kernelgate_version FROM runs "
           "ORDER BY id");
    while (r.step()) {
      sink.run({r.get<std::string>(0), r.get<std::string>(1), r.get<std::string>(2),
                r.get<int64_t>(3), r.get<std::string>(4)});
    }
    sink.begin("results");
    Stmt x(db, path,
           "SELECT r.uuid, " + column_list(kResultColumns, "x.") +
               " FROM results x JOIN runs r ON r.id = x.run_id ORDER BY x.id");
    while (x.step()) sink.result(x.get<std::string>(0), read_result(x, 1));
  } catch (...) {
    rollback(db);
    throw;
  }
  exec(db, path, "COMMIT");
}

Importer::Importer(sqlite3* db, const std::string& path)
    : db_(db),
      path_(path),
      add_run_(db, path,
               "INSERT INTO runs (uuid, fingerprint_id, command, started_at, kernelgate_version) "
               "VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (uuid) DO NOTHING"),
      find_run_(db, path, "SELECT id, fingerprint_id FROM runs WHERE uuid = ?1"),
      results_(db, path, /*skip_duplicates=*/true) {}

void Importer::fingerprint(const std::string& id, const Fingerprint& fp) {
  if (id != fp.id()) {
    throw SourceError("fingerprint " + id + " does not match its fields (they hash to " + fp.id() +
                      ")");
  }
  fingerprints_.insert(id);
  stats_.fingerprints_added += insert_fingerprint(db_, path_, id, fp);
}

void Importer::run(const RunRow& run) {
  if (run.uuid.empty() || runs_.count(run.uuid)) {
    throw SourceError("run uuid '" + run.uuid + "' is empty or repeated");
  }
  if (!fingerprints_.count(run.fingerprint_id)) {
    throw SourceError("run " + run.uuid +
                      " names a fingerprint not listed before it: " + run.fingerprint_id);
  }
  add_run_.reset();
  add_run_.bind(1, run.uuid);
  add_run_.bind(2, run.fingerprint_id);
  add_run_.bind(3, run.command);
  add_run_.bind(4, run.started_at);
  add_run_.bind(5, run.kernelgate_version);
  add_run_.step();
  stats_.runs_added += sqlite3_changes(db_);
  find_run_.reset();
  find_run_.bind(1, run.uuid);
  find_run_.step();
  auto here = find_run_.get<std::string>(1);
  if (here != run.fingerprint_id) {
    throw SourceError("run " + run.uuid + " is recorded here under fingerprint " + here +
                      " but under " + run.fingerprint_id + " in the source");
  }
  runs_[run.uuid] = {find_run_.get<int64_t>(0), here};
}

void Importer::result(const std::string& run_uuid, const Result& r) {
  auto it = runs_.find(run_uuid);
  if (it == runs_.end()) {
    throw SourceError("a result names a run not listed before it: " + run_uuid);
  }
  bool added = results_.insert(it->second.first, it->second.second, r);
  ++(added ? stats_.results_added : stats_.results_skipped);
}

}  // namespace kernelgate::store::detail
