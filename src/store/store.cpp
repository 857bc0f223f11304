// The evidence store facade: fingerprints, runs, results, stale reports and merge. Opening the
// file is in store_file.cpp, the JSON exchange in json_exchange.cpp.
//
// Note on merge and import: the source is streamed into the store inside one write transaction
// and checked row by row (fingerprint ids recomputed from their fields, every reference resolved);
// the first bad row rolls everything back, so a bad source adds nothing, and the natural key on
// results makes a repeated source add nothing new.
#include "store/store.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>

#include <signal.h>
#include <unistd.h>

#include "store/store_internal.h"

namespace kernelgate::store {

using namespace detail;
namespace fs = std::filesystem;

namespace {

int64_t unix_now() {
  using namespace std::chrono;
  return duration_cast<seconds>(system_clock::now().time_since_epoch()).count();
}

std::string random_uuid() {
  std::random_device rd;  // fresh per call, so forked children never share a sequence
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

// Binds ?1..?4 to the key of a run of an op's case: (fingerprint, op, backend, case_id).
void bind_key(Stmt& s, const std::string& fingerprint_id, const std::string& op,
              const std::string& backend, const std::string& case_id) {
  s.bind(1, fingerprint_id);
  s.bind(2, op);
  s.bind(3, backend);
  s.bind(4, case_id);
}

}  // namespace

Store::Store(sqlite3* db, std::string path, Mode mode, int schema_version)
    : db_(db),
      path_(std::move(path)),
      mode_(mode),
      schema_version_(schema_version),
      owner_(random_uuid()) {}

Store::~Store() { sqlite3_close_v2(db_); }

std::string Store::default_path() {
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? v : "";
  };
  if (auto db = env("KERNELGATE_DB"); !db.empty()) return db;
  if (auto cache = env("XDG_CACHE_HOME"); !cache.empty()) {
    return (fs::path(cache) / "kernelgate" / "evidence.sqlite").string();
  }
  return (fs::path(env("HOME")) / ".cache" / "kernelgate" / "evidence.sqlite").string();
}

namespace detail {
void require_writable(const Store& store) {
  if (store.mode() != Mode::kReadWrite) fail(store.path(), "opened read-only; cannot write");
}
}  // namespace detail

int64_t Store::begin_run(const Fingerprint& fingerprint, const std::string& command) {
  require_writable(*this);
  const std::string id = fingerprint.id(), uuid = random_uuid();
  const int64_t now = unix_now();
  return write_txn(db_, path_, [&] {
    insert_fingerprint(db_, path_, id, fingerprint);
    Stmt s(db_, path_,
           "INSERT INTO runs (uuid, fingerprint_id, command, started_at, kernelgate_version) "
           "VALUES (?1, ?2, ?3, ?4, ?5)");
    s.bind(1, uuid);
    s.bind(2, id);
    s.bind(3, command);
    s.bind(4, now);
    s.bind(5, fingerprint.kernelgate_version);
    s.step();
    return static_cast<int64_t>(sqlite3_last_insert_rowid(db_));
  });
}

void Store::add_result(int64_t run_id, const Result& result) {
  require_writable(*this);
  Result row = result;
  if (row.created_at == 0) row.created_at = unix_now();
  write_txn(db_, path_, [&] {
    Stmt run(db_, path_, "SELECT fingerprint_id FROM runs WHERE id = ?1");
    run.bind(1, run_id);
    if (!run.step()) fail(path_, "no run with id " + std::to_string(run_id));
    const std::string fingerprint_id = run.get<std::string>(0);
    ResultInserter(db_, path_, /*skip_duplicates=*/false).insert(run_id, fingerprint_id, row);
    if (schema_version_ >= 2) {
      Stmt drop(db_, path_,
                "DELETE FROM claims WHERE fingerprint_id = ?1 AND op = ?2 AND backend = ?3 "
                "AND case_id = ?4");
      bind_key(drop, fingerprint_id, row.op, row.backend, row.case_id);
      drop.step();
    }
  });
}

Store::Claim Store::claim(const std::string& fingerprint_id, const std::string& op,
                          const std::string& backend, const std::string& case_id,
                          int64_t stale_after_s) {
  require_writable(*this);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const int64_t now = unix_now(), pid = ::getpid();
  return write_txn(db_, path_, [&] {
    if (has_result(fingerprint_id, op, backend, case_id)) return Claim::kDone;
    Stmt held(db_, path_,
              "SELECT owner, host, pid, claimed_at FROM claims WHERE fingerprint_id = ?1 AND "
              "op = ?2 AND backend = ?3 AND case_id = ?4");
    bind_key(held, fingerprint_id, op, backend, case_id);
    if (held.step() && held.get<std::string>(0) != owner_) {
      const bool here = held.get<std::string>(1) == host;
      const auto other = static_cast<pid_t>(held.get<int64_t>(2));
      const bool alive = !here || ::kill(other, 0) == 0 || errno == EPERM;
      if (alive && now - held.get<int64_t>(3) < stale_after_s) return Claim::kTaken;
    }
    Stmt take(db_, path_,
              "INSERT INTO claims (fingerprint_id, op, backend, case_id, owner, host, pid, "
              "claimed_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) ON CONFLICT DO UPDATE SET "
              "owner = excluded.owner, host = excluded.host, pid = excluded.pid, "
              "claimed_at = excluded.claimed_at");
    bind_key(take, fingerprint_id, op, backend, case_id);
    take.bind(5, owner_);
    take.bind(6, std::string(host));
    take.bind(7, pid);
    take.bind(8, now);
    take.step();
    return Claim::kMine;
  });
}

bool Store::has_result(const std::string& fingerprint_id, const std::string& op,
                       const std::string& backend, const std::string& case_id) const {
  Stmt s(db_, path_,
         "SELECT 1 FROM results WHERE fingerprint_id = ?1 AND op = ?2 AND backend = ?3 "
         "AND case_id = ?4 LIMIT 1");
  bind_key(s, fingerprint_id, op, backend, case_id);
  return s.step();
}

std::vector<Result> Store::results(const std::string& fingerprint_id, const std::string& op) const {
  Stmt s(db_, path_,
         "SELECT run_id, " + column_list(kResultColumns) +
             " FROM results WHERE fingerprint_id = ?1" + (op.empty() ? "" : " AND op = ?2") +
             " ORDER BY id");
  s.bind(1, fingerprint_id);
  if (!op.empty()) s.bind(2, op);
  std::vector<Result> out;
  while (s.step()) {
    out.push_back(read_result(s, 1));
    out.back().run_id = s.get<int64_t>(0);
  }
  return out;
}

std::map<std::pair<std::string, std::string>, int64_t> Store::result_counts(
    const std::string& fingerprint_id) const {
  Stmt s(db_, path_,
         "SELECT op, backend, COUNT(*) FROM results WHERE fingerprint_id = ?1 "
         "GROUP BY op, backend");
  s.bind(1, fingerprint_id);
  std::map<std::pair<std::string, std::string>, int64_t> out;
  while (s.step()) out[{s.get<std::string>(0), s.get<std::string>(1)}] = s.get<int64_t>(2);
  return out;
}

std::optional<Fingerprint> Store::fingerprint(const std::string& fingerprint_id) const {
  Stmt s(db_, path_, fingerprint_select() + " WHERE id = ?1");
  s.bind(1, fingerprint_id);
  if (!s.step()) return std::nullopt;
  return read_fingerprint(s, path_);
}

StaleReport Store::stale(const Fingerprint& current) const {
  StaleReport report;
  report.current_id = current.id();
  Stmt s(db_, path_,
         "SELECT (SELECT COUNT(*) FROM runs WHERE fingerprint_id = f.id), "
         "(SELECT COUNT(*) FROM results WHERE fingerprint_id = f.id), f.* FROM (" +
             fingerprint_select() + ") f ORDER BY f.id");
  while (s.step()) {
    auto id = s.get<std::string>(2);
    auto results = s.get<int64_t>(1);
    if (id == report.current_id) {
      report.current_results = results;
      continue;
    }
    StaleFingerprint entry{id, read_fingerprint(s, path_, 3), s.get<int64_t>(0), results, {}};
    entry.differences = entry.fingerprint.differences(current);
    if (entry.differences.empty()) {  // fields equal, id not: written under another id scheme
      entry.differences.push_back("id: stored " + id + ", current " + report.current_id);
    }
    report.stale.push_back(std::move(entry));
  }
  return report;
}

MergeStats Store::merge(const std::string& other_path) {
  require_writable(*this);
  OpenResult other = Store::open(other_path, Mode::kReadOnly);
  if (!other) fail(path_, "cannot merge: " + other.problem);
  try {
    return write_txn(db_, path_, [&] {
      Importer importer(db_, path_);
      read_store(other.store->db_, other.store->path_, importer);
      return importer.stats();
    });
  } catch (const SourceError& e) {
    fail(path_, "cannot merge " + other_path + ": " + e.what() + "; nothing was merged");
  }
}

}  // namespace kernelgate::store
