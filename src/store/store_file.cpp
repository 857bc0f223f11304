// The store file: its schema and migrations, and Store::open.
//
// Note on open(): an existing file is classified before anything can write to it: first from the
// main file alone (immutable, no locks, no side files), then through a read-only connection.
// Only a file classified as ours (or empty) is reopened read-write.
#include "store/store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include <cctype>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <map>
#include <vector>

#include "store/store_internal.h"

namespace kernelgate::store {

using namespace detail;
namespace fs = std::filesystem;

namespace {

// Schema version 1. Released steps are never edited; a change is a new step.
//
// Note: results repeats its run's fingerprint_id so that every reader's lookup (fingerprint, op)
// and the resume probe (fingerprint, op, backend, case_id) use one index, whose leftmost prefix
// serves the former. UNIQUE (run_id, op, backend, case_id) is the natural key that makes merge
// idempotent (run_id stands for the run's uuid, which merge maps).
constexpr std::string_view kSchemaV1 = R"sql(
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE fingerprints (
  id TEXT PRIMARY KEY,
  gpu_name TEXT NOT NULL, compute_capability TEXT NOT NULL, sm_count INTEGER NOT NULL,
  memory_bytes INTEGER NOT NULL, driver TEXT NOT NULL, cuda_runtime TEXT NOT NULL,
  torch_version TEXT NOT NULL, kernelgate_version TEXT NOT NULL, source_hash TEXT NOT NULL,
  backend_versions TEXT NOT NULL,
  clocks_seen TEXT NOT NULL);
CREATE TABLE runs (
  id INTEGER PRIMARY KEY,
  uuid TEXT NOT NULL UNIQUE,
  fingerprint_id TEXT NOT NULL REFERENCES fingerprints (id),
  command TEXT NOT NULL, started_at INTEGER NOT NULL, kernelgate_version TEXT NOT NULL);
CREATE TABLE results (
  id INTEGER PRIMARY KEY,
  run_id INTEGER NOT NULL REFERENCES runs (id),
  fingerprint_id TEXT NOT NULL REFERENCES fingerprints (id),
  op TEXT NOT NULL, backend TEXT NOT NULL, case_id TEXT NOT NULL,
  arch INTEGER NOT NULL, dtype TEXT NOT NULL, buckets TEXT NOT NULL, region TEXT NOT NULL,
  align TEXT NOT NULL,
  grad INTEGER NOT NULL, shape TEXT NOT NULL, layout TEXT NOT NULL, regime TEXT NOT NULL,
  seed INTEGER NOT NULL,
  disposition TEXT NOT NULL CHECK (disposition IN ('passed', 'incorrect', 'crashed',
                                                   'timed_out', 'out_of_memory', 'unsupported')),
  reason TEXT NOT NULL,
  max_rel_l2 REAL, max_max_over_rms REAL,
  device_median_us REAL, device_spread_us REAL, device_samples INTEGER NOT NULL,
  eager_median_us REAL, eager_spread_us REAL, eager_samples INTEGER NOT NULL,
  rel_noise REAL, throttled INTEGER NOT NULL,
  clocks_before TEXT NOT NULL, clocks_after TEXT NOT NULL,
  created_at INTEGER NOT NULL,
  UNIQUE (run_id, op, backend, case_id));
CREATE INDEX results_by_case ON results (fingerprint_id, op, backend, case_id);
)sql";

// Schema version 2: claims, so that concurrent sweeps into one store share the work
// (Store::claim). Readers never look at them.
constexpr std::string_view kSchemaV2 = R"sql(
CREATE TABLE claims (
  fingerprint_id TEXT NOT NULL, op TEXT NOT NULL, backend TEXT NOT NULL, case_id TEXT NOT NULL,
  owner TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL, claimed_at INTEGER NOT NULL,
  PRIMARY KEY (fingerprint_id, op, backend, case_id));
)sql";

constexpr Migration kMigrations[] = {{1, kSchemaV1}, {2, kSchemaV2, /*readers_unaffected=*/true}};
static_assert(std::size(kMigrations) == kSchemaVersion, "one step per schema version");

// A reason the file cannot be used; becomes OpenResult::problem.
// The wait for a store another process is creating at the same path: between creating the
// file and its first transaction it is empty for a few milliseconds.
constexpr int kEmptyFileRechecks = 20;
constexpr auto kEmptyFileRecheckDelay = std::chrono::milliseconds(50);

struct Problem {
  std::string message;
};

struct Classification {
  bool empty = false;  // no tables and no application id: a new store
  int version = 0;
};

// Throws Problem unless the database is empty or one of ours at a version <= known.
Classification classify(sqlite3* db, const std::string& path, int known) {
  auto unusable = [&](const std::string& why) {
    return Problem{"evidence store " + path + " " + why + "; the file was left as it was"};
  };
  try {
    Stmt app(db, path, "PRAGMA application_id");
    app.step();
    auto application_id = app.get<int64_t>(0);
    std::vector<std::string> tables;
    Stmt t(db, path,
           "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
           "ORDER BY name");
    while (t.step()) tables.push_back(t.get<std::string>(0));
    if (application_id == 0 && tables.empty()) return {true, 0};
    if (application_id != kApplicationId) {
      std::string names;
      for (const auto& name : tables) names += (names.empty() ? "" : ", ") + name;
      char id[16];
      std::snprintf(id, sizeof(id), "0x%08llx", static_cast<unsigned long long>(application_id));
      throw unusable("is a SQLite database of another application (application_id " +
                     std::string(id) + ", tables: " + names + ")");
    }
    Stmt m(db, path, "SELECT key, value FROM meta WHERE key IN ('application', 'schema_version')");
    std::map<std::string, std::string> meta;
    while (m.step()) meta[m.get<std::string>(0)] = m.get<std::string>(1);
    const std::string& text = meta["schema_version"];
    int version = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), version);
    if (meta["application"] != kApplicationName || ec != std::errc() ||
        end != text.data() + text.size() || version < 1) {
      throw unusable("has a damaged meta table (no valid application and schema_version)");
    }
    if (version > known) {
      throw unusable("has schema version " + std::to_string(version) + ", newer than " +
                     std::to_string(known) +
                     " which this kernelgate knows; upgrade kernelgate "
                     "or use another store (KERNELGATE_DB)");
    }
    return {false, version};
  } catch (const StoreError& e) {
    if (is_busy(e.sqlite_code())) throw;  // in use, not unusable
    throw unusable(std::string("is not a SQLite database or is damaged (") +
                   sqlite3_errstr(e.sqlite_code()) + ")");
  }
}

bool main_file_is_whole(const std::string& path) {
  std::error_code ec;
  return !fs::exists(path + "-wal", ec) && !fs::exists(path + "-journal", ec);
}

// A SQLite URI that opens the file without locks or side files, trusting that nobody writes it.
std::string immutable_uri(const std::string& path) {
  std::string uri = "file://";
  for (unsigned char c : fs::absolute(path).string()) {
    if (std::isalnum(c) ||
        std::string_view("/-._~").find(static_cast<char>(c)) != std::string_view::npos) {
      uri += static_cast<char>(c);
    } else {
      char esc[4];
      std::snprintf(esc, sizeof(esc), "%%%02X", c);
      uri += esc;
    }
  }
  return uri + "?immutable=1";
}

// A refusal decided from the main file alone, without a lock or a side file. Only trusted when no
// -wal or -journal exists before and after the look: otherwise the main file may lag the real
// database (a checkpoint in progress or interrupted), and a normal connection must decide.
std::optional<Problem> first_look(const std::string& path, int known) {
  if (!main_file_is_whole(path)) return std::nullopt;
  DbPtr db = open_connection(path, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI, immutable_uri(path));
  try {
    classify(db.get(), path, known);
  } catch (const Problem& p) {
    if (main_file_is_whole(path)) return p;
  }
  return std::nullopt;
}

// Evidence shipped inside an installed package sits in a directory we cannot write, where SQLite
// cannot create the -shm a WAL-mode file needs even to be read; nobody can be writing it there
// either, so it is read as immutable.
DbPtr open_read_only(const std::string& path) {
  fs::path dir = fs::path(path).parent_path();
  bool dir_writable = ::access(dir.empty() ? "." : dir.c_str(), W_OK) == 0;
  if (!dir_writable && main_file_is_whole(path)) {
    return open_connection(path, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI, immutable_uri(path));
  }
  return open_connection(path, SQLITE_OPEN_READONLY);
}

void migrate(sqlite3* db, const std::string& path, int from, std::span<const Migration> steps) {
  for (const auto& step : steps) {
    if (step.to_version <= from) continue;
    if (sqlite3_exec(db, std::string(step.sql).c_str(), nullptr, nullptr, nullptr) != SQLITE_OK) {
      fail(db, path, "migrating to schema version " + std::to_string(step.to_version));
    }
  }
  if (from == 0) {
    exec(db, path, "PRAGMA application_id = " + std::to_string(kApplicationId));
    Stmt s(db, path, "INSERT INTO meta (key, value) VALUES ('application', ?1)");
    s.bind(1, kApplicationName);
    s.step();
  }
  Stmt s(db, path,
         "INSERT INTO meta (key, value) VALUES ('schema_version', ?1) "
         "ON CONFLICT (key) DO UPDATE SET value = excluded.value");
  s.bind(1, std::to_string(steps.back().to_version));
  s.step();
}

}  // namespace

std::string detail::unwritable_reason(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) return std::string("cannot be inspected (") + std::strerror(errno) + ")";
    struct stat link;
    if (::lstat(path.c_str(), &link) != 0) return "";  // a new path
    if (S_ISLNK(link.st_mode)) return "is a symbolic link to a missing file";
    st = link;  // created between the two looks (another process opening the same new store)
  }
  if (S_ISREG(st.st_mode)) return "";
  if (S_ISDIR(st.st_mode)) return "is a directory, not a file";
  if (S_ISFIFO(st.st_mode)) return "is a FIFO (named pipe), not a regular file";
  if (S_ISCHR(st.st_mode)) return "is a character device, not a regular file";
  if (S_ISBLK(st.st_mode)) return "is a block device, not a regular file";
  if (S_ISSOCK(st.st_mode)) return "is a socket, not a regular file";
  return "is not a regular file";
}

std::span<const Migration> schema_migrations() { return kMigrations; }

OpenResult Store::open(const std::string& path, Mode mode) {
  return open(path, mode, schema_migrations());
}

OpenResult Store::open(const std::string& path, Mode mode, std::span<const Migration> steps) {
  OpenResult out;
  try {
    for (size_t i = 0; i < steps.size(); ++i) {
      if (steps[i].to_version != static_cast<int>(i) + 1) {
        throw Problem{"internal: migration steps must be numbered 1, 2, ... in order"};
      }
    }
    if (steps.empty()) throw Problem{"internal: no migration steps"};
    const int known = steps.back().to_version;
    // Decided before anything opens the path: SQLite would block on a FIFO, and write beside
    // (or into) a device.
    if (std::string why = unwritable_reason(path); !why.empty()) {
      throw Problem{"evidence store " + path + " " + why +
                    "; the store must be a regular file or a new path"};
    }
    std::error_code ec;
    bool exists = fs::exists(path, ec);
    if (ec) throw Problem{"cannot inspect evidence store " + path + ": " + ec.message()};
    if (!exists && mode == Mode::kReadOnly) {
      out.not_found = true;
      throw Problem{"no evidence store at " + path + " (a read-only open creates nothing)"};
    }
    if (exists) {
      if (auto problem = first_look(path, known)) throw *problem;
      // Read-only, so a file refused here is not written (a WAL-mode file gains -wal/-shm).
      DbPtr probe = open_read_only(path);
      Classification c = classify(probe.get(), path, known);
      // An existing file that is no store of ours (empty, or SQLite with no tables) is never
      // made one: only a new path or a kernelgate store is written. One another kernelgate
      // process has just created is empty for an instant: look again before refusing.
      for (int i = 0; c.empty && i < kEmptyFileRechecks; ++i) {
        std::this_thread::sleep_for(kEmptyFileRecheckDelay);
        probe = open_read_only(path);
        c = classify(probe.get(), path, known);
      }
      if (c.empty) {
        throw Problem{"evidence store " + path +
                      " exists but is not a kernelgate store (an empty file, or an SQLite "
                      "database with no tables); it was left as it was: kernelgate writes only a "
                      "new path or a store of its own"};
      }
      if (mode == Mode::kReadOnly) {
        const bool readable = std::all_of(steps.begin(), steps.end(), [&](const Migration& m) {
          return m.to_version <= c.version || m.readers_unaffected;
        });
        if (c.empty || !readable) {
          throw Problem{"evidence store " + path +
                        (c.empty
                             ? std::string(" is empty (a read-only open does not initialise it)")
                             : " has schema version " + std::to_string(c.version) +
                                   "; open it read-write once to migrate it to version " +
                                   std::to_string(known))};
        }
        exec(probe.get(), path, "PRAGMA query_only = ON");
        out.store.reset(new Store(probe.release(), path, mode, c.version));
        return out;
      }
    } else {
      fs::path parent = fs::path(path).parent_path();
      if (!parent.empty()) fs::create_directories(parent, ec);
      if (ec)
        throw Problem{"cannot create the directory of evidence store " + path + ": " +
                      ec.message()};
    }
    DbPtr db = open_connection(path, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE);
    if (sqlite3_db_readonly(db.get(), "main") == 1) {
      throw Problem{"evidence store " + path + " is not writable"};
    }
    exec(db.get(), path, "PRAGMA foreign_keys = ON");
    // WAL lets readers run beside one writer; where the file system cannot do WAL, SQLite keeps
    // the rollback journal, which is slower but just as safe. NORMAL sync is durable in WAL
    // except for the last commits on power loss, which only costs re-measuring them.
    retry_busy([&] { exec(db.get(), path, "PRAGMA journal_mode = WAL"); });
    exec(db.get(), path, "PRAGMA synchronous = NORMAL");
    // Classify again under the write lock: another process may have created or migrated it.
    int version = write_txn(db.get(), path, [&] {
      Classification c = classify(db.get(), path, known);
      if (c.version < known) migrate(db.get(), path, c.version, steps);
      return known;
    });
    out.store.reset(new Store(db.release(), path, mode, version));
  } catch (const Problem& p) {
    out.problem = p.message;
  } catch (const StoreError& e) {
    out.problem = e.what();
  } catch (const std::exception& e) {
    out.problem = std::string("cannot open evidence store ") + path + ": " + e.what();
  } catch (...) {
    out.problem = "cannot open evidence store " + path + ": unknown error";
  }
  return out;
}

}  // namespace kernelgate::store
