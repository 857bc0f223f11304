// The evidence store's postconditions: every field round-trips, identity is exact, unusable files
// are refused and left untouched, concurrent writers lose nothing, merge and import are
// idempotent and all-or-nothing.
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "store/store.h"

namespace kernelgate::store {
namespace {

namespace fs = std::filesystem;

Fingerprint sample_fingerprint() {
  Fingerprint fp;
  fp.gpu_name = "NVIDIA H200";
  fp.compute_capability = "9.0";
  fp.sm_count = 132;
  fp.memory_bytes = 150754820096;
  fp.driver = "570.124.06";
  fp.cuda_runtime = "12.8";
  fp.torch_version = "2.10.0";
  fp.kernelgate_version = "0.1.0";
  fp.source_hash = "3f2a9c";
  fp.backend_versions = {{"liger_kernel", "0.5.10"}, {"triton", "3.4.0"}};
  fp.clocks_seen = "sm=1980MHz mem=3201MHz";
  return fp;
}

Result sample_result(int i = 0) {
  Result r;
  r.op = "rms_norm";
  r.backend = "kernelgate";
  r.case_id = "case-" + std::to_string(i);
  r.arch = 90;
  r.dtype = "bfloat16";
  r.buckets = "14,12";
  r.align = "16";
  r.grad = true;
  r.shape = "x=[8192,4096] weight=[4096]";
  r.layout = "contiguous";
  r.regime = "normal";
  r.seed = 1234567890123ll + i;
  r.disposition = Disposition::kPassed;
  r.reason = "within tolerance \"quoted\"\n\ttab \\ back ü";
  r.max_rel_l2 = 1.25e-3;
  r.max_max_over_rms = 0.1 + 0.2;  // not exactly representable in short decimal
  r.device_median_us = 12.5;
  r.device_spread_us = 0.75;
  r.device_samples = 200;
  r.eager_median_us = 20.125;
  r.eager_spread_us = 1.5;
  r.eager_samples = 100;
  r.rel_noise = 0.004;
  r.throttled = true;
  r.clocks_before = "sm=1980";
  r.clocks_after = "sm=1755";
  r.created_at = 1700000000 + i;
  return r;
}

Result failed_result(int i) {
  Result r = sample_result(i);
  r.disposition = Disposition::kIncorrect;
  r.reason = "max_rel_l2 above tolerance";
  r.max_rel_l2 = INFINITY;
  r.max_max_over_rms = NAN;
  r.device_median_us = r.device_spread_us = r.eager_median_us = r.eager_spread_us = std::nullopt;
  r.rel_noise = std::nullopt;
  r.device_samples = r.eager_samples = 0;
  return r;
}

void expect_double_eq(double a, double b, const char* name) {
  if (std::isnan(a) || std::isnan(b)) {
    EXPECT_TRUE(std::isnan(a) && std::isnan(b)) << name << ": " << a << " vs " << b;
  } else {
    EXPECT_EQ(a, b) << name;  // exact: the store must not round
  }
}

void expect_same(const Result& a, const Result& b) {
  EXPECT_EQ(a.op, b.op);
  EXPECT_EQ(a.backend, b.backend);
  EXPECT_EQ(a.case_id, b.case_id);
  EXPECT_EQ(a.arch, b.arch);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.buckets, b.buckets);
  EXPECT_EQ(a.align, b.align);
  EXPECT_EQ(a.grad, b.grad);
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.layout, b.layout);
  EXPECT_EQ(a.regime, b.regime);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.disposition, b.disposition);
  EXPECT_EQ(a.reason, b.reason);
  expect_double_eq(a.max_rel_l2, b.max_rel_l2, "max_rel_l2");
  expect_double_eq(a.max_max_over_rms, b.max_max_over_rms, "max_max_over_rms");
  EXPECT_EQ(a.device_median_us, b.device_median_us);
  EXPECT_EQ(a.device_spread_us, b.device_spread_us);
  EXPECT_EQ(a.device_samples, b.device_samples);
  EXPECT_EQ(a.eager_median_us, b.eager_median_us);
  EXPECT_EQ(a.eager_spread_us, b.eager_spread_us);
  EXPECT_EQ(a.eager_samples, b.eager_samples);
  EXPECT_EQ(a.rel_noise, b.rel_noise);
  EXPECT_EQ(a.throttled, b.throttled);
  EXPECT_EQ(a.clocks_before, b.clocks_before);
  EXPECT_EQ(a.clocks_after, b.clocks_after);
  EXPECT_EQ(a.created_at, b.created_at);
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

// Runs SQL on a file with plain SQLite, bypassing the store (to build odd files and inspect).
std::string raw_sql(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  EXPECT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  std::string out;
  char* err = nullptr;
  auto collect = [](void* acc, int n, char** values, char**) {
    auto* s = static_cast<std::string*>(acc);
    for (int i = 0; i < n; ++i) *s += (i ? "|" : "") + std::string(values[i] ? values[i] : "NULL");
    *s += "\n";
    return 0;
  };
  EXPECT_EQ(sqlite3_exec(db, sql.c_str(), collect, &out, &err), SQLITE_OK) << (err ? err : "");
  sqlite3_free(err);
  sqlite3_close(db);
  return out;
}

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "kg_store_XXXXXX").string();
    ASSERT_NE(mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  std::unique_ptr<Store> open_rw(const std::string& name) {
    OpenResult r = Store::open(path(name), Mode::kReadWrite);
    EXPECT_TRUE(r) << r.problem;
    return std::move(r.store);
  }

  // A closed store holding one run of `count` results.
  std::string make_store(const std::string& name, int count, const Fingerprint& fp) {
    auto store = open_rw(name);
    int64_t run = store->begin_run(fp, "kernelgate bench run");
    for (int i = 0; i < count; ++i)
      store->add_result(run, i % 2 ? failed_result(i) : sample_result(i));
    return path(name);
  }

  std::set<std::string> files() const {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.insert(e.path().filename().string());
    return out;
  }

  // Open must refuse the file, name it, and leave it (and the directory) exactly as it was.
  void expect_refused(const std::string& file, const std::string& reason_part) {
    const std::string before = read_bytes(file);
    const auto listing = files();
    for (Mode mode : {Mode::kReadOnly, Mode::kReadWrite}) {
      OpenResult r = Store::open(file, mode);
      EXPECT_FALSE(r);
      EXPECT_NE(r.problem.find(file), std::string::npos) << r.problem;
      EXPECT_NE(r.problem.find(reason_part), std::string::npos) << r.problem;
    }
    EXPECT_EQ(read_bytes(file), before);
    EXPECT_EQ(files(), listing);
  }

  std::string dir_;
};

// ---- Identity ------------------------------------------------------------------------------

TEST(Disposition, StringsRoundTripAndUnknownFails) {
  for (auto d : {Disposition::kPassed, Disposition::kIncorrect, Disposition::kCrashed,
                 Disposition::kTimedOut, Disposition::kOutOfMemory, Disposition::kUnsupported}) {
    EXPECT_EQ(disposition_from_string(to_string(d)), d);
  }
  EXPECT_EQ(to_string(Disposition::kTimedOut), "timed_out");
  EXPECT_EQ(to_string(Disposition::kOutOfMemory), "out_of_memory");
  for (const char* bad : {"", "pass", "PASSED", "passed ", "not_verified"}) {
    EXPECT_FALSE(disposition_from_string(bad).has_value()) << bad;
  }
}

TEST(Fingerprint, IdIsStableAcrossProcessesAndBuilds) {
  // Pinned: a changed id makes every stored row stale, so it must only change on purpose.
  EXPECT_EQ(sample_fingerprint().id(), "8698f1b65f22a235");
  EXPECT_EQ(Fingerprint{}.id().size(), 16u);
}

TEST(Fingerprint, IdCoversEveryIdentityFieldButNotClocks) {
  const Fingerprint base = sample_fingerprint();
  std::vector<std::function<void(Fingerprint&)>> edits = {
      [](Fingerprint& f) { f.gpu_name += "x"; },
      [](Fingerprint& f) { f.compute_capability = "8.0"; },
      [](Fingerprint& f) { f.sm_count += 1; },
      [](Fingerprint& f) { f.memory_bytes += 1; },
      [](Fingerprint& f) { f.driver = "570.124.07"; },
      [](Fingerprint& f) { f.cuda_runtime = "12.9"; },
      [](Fingerprint& f) { f.torch_version = "2.11.0"; },
      [](Fingerprint& f) { f.kernelgate_version = "0.2.0"; },
      [](Fingerprint& f) { f.source_hash = "3f2a9d"; },
      [](Fingerprint& f) { f.backend_versions["triton"] = "3.5.0"; },
      [](Fingerprint& f) { f.backend_versions["quack"] = "0.1"; },
      [](Fingerprint& f) { f.backend_versions.erase("triton"); },
      // Moving text between fields must not collide.
      [](Fingerprint& f) { f.driver += "12.8", f.cuda_runtime = ""; },
  };
  std::set<std::string> ids = {base.id()};
  for (size_t i = 0; i < edits.size(); ++i) {
    Fingerprint f = base;
    edits[i](f);
    EXPECT_TRUE(ids.insert(f.id()).second) << "edit " << i << " did not change the id";
  }
  Fingerprint clocks = base;
  clocks.clocks_seen = "sm=1410MHz";
  EXPECT_EQ(clocks.id(), base.id());
}

TEST(Fingerprint, DifferencesSayWhatChanged) {
  Fingerprint stored = sample_fingerprint(), current = sample_fingerprint();
  current.clocks_seen = "other";
  EXPECT_TRUE(stored.differences(current).empty());
  current.torch_version = "2.11.0";
  current.sm_count = 78;
  current.backend_versions["triton"] = "3.5.0";
  current.backend_versions.erase("liger_kernel");
  current.backend_versions["quack"] = "";
  EXPECT_EQ(stored.differences(current),
            (std::vector<std::string>{
                "sm_count: stored 132, current 78",
                "torch_version: stored 2.10.0, current 2.11.0",
                "backend_versions[liger_kernel]: stored 0.5.10, current (absent)",
                "backend_versions[quack]: stored (absent), current (empty)",
                "backend_versions[triton]: stored 3.4.0, current 3.5.0",
            }));
}

// ---- Rows ----------------------------------------------------------------------------------

TEST_F(StoreTest, EveryFieldRoundTrips) {
  auto store = open_rw("e.sqlite");
  const Fingerprint fp = sample_fingerprint();
  int64_t run = store->begin_run(fp, "kernelgate bench run --op rms_norm");
  const Result passed = sample_result(1), failed = failed_result(2);
  Result unstamped = sample_result(3);
  unstamped.created_at = 0;
  store->add_result(run, passed);
  store->add_result(run, failed);
  store->add_result(run, unstamped);

  auto rows = store->results(fp.id());
  ASSERT_EQ(rows.size(), 3u);
  expect_same(rows[0], passed);
  expect_same(rows[1], failed);
  EXPECT_EQ(rows[0].run_id, run);
  EXPECT_TRUE(std::isinf(rows[1].max_rel_l2));
  EXPECT_TRUE(std::isnan(rows[1].max_max_over_rms));
  EXPECT_FALSE(rows[1].device_median_us.has_value());
  EXPECT_GT(rows[2].created_at, 1700000000);  // filled with the time of the add
  EXPECT_EQ(store->fingerprint(fp.id()), fp);
  EXPECT_FALSE(store->fingerprint("0000000000000000").has_value());

  // Not measured is NULL in the file, not NaN or 0.
  store.reset();
  EXPECT_EQ(raw_sql(path("e.sqlite"),
                    "SELECT max_max_over_rms IS NULL, device_median_us IS NULL, rel_noise IS NULL "
                    "FROM results WHERE case_id = 'case-2'"),
            "1|1|1\n");
}

TEST_F(StoreTest, ResultsOnlyOfTheAskedFingerprintAndOp) {
  auto store = open_rw("f.sqlite");
  Fingerprint old_fp = sample_fingerprint(), cur = sample_fingerprint();
  cur.torch_version = "2.11.0";
  int64_t old_run = store->begin_run(old_fp, "old");
  int64_t run = store->begin_run(cur, "new");
  for (int i = 0; i < 5; ++i) store->add_result(old_run, sample_result(i));
  Result other_op = sample_result(9);
  other_op.op = "softmax";
  store->add_result(run, sample_result(0));
  store->add_result(run, other_op);

  auto rows = store->results(cur.id());
  ASSERT_EQ(rows.size(), 2u);
  for (const auto& r : rows) EXPECT_EQ(r.run_id, run);
  ASSERT_EQ(store->results(cur.id(), "softmax").size(), 1u);
  EXPECT_EQ(store->results(cur.id(), "rms_norm").size(), 1u);
  EXPECT_EQ(store->results(old_fp.id(), "rms_norm").size(), 5u);
  EXPECT_TRUE(store->results("no-such-fingerprint").empty());
}

TEST_F(StoreTest, HasResultForResume) {
  auto store = open_rw("h.sqlite");
  Fingerprint fp = sample_fingerprint(), other = sample_fingerprint();
  other.driver = "999";
  int64_t run = store->begin_run(fp, "sweep");
  store->add_result(run, sample_result(7));
  EXPECT_TRUE(store->has_result(fp.id(), "rms_norm", "kernelgate", "case-7"));
  EXPECT_FALSE(store->has_result(fp.id(), "rms_norm", "kernelgate", "case-8"));
  EXPECT_FALSE(store->has_result(fp.id(), "rms_norm", "liger", "case-7"));
  EXPECT_FALSE(store->has_result(fp.id(), "softmax", "kernelgate", "case-7"));
  EXPECT_FALSE(store->has_result(other.id(), "rms_norm", "kernelgate", "case-7"));
  // A later run (resumed sweep) sees the first run's rows.
  store->begin_run(fp, "sweep --resume");
  EXPECT_TRUE(store->has_result(fp.id(), "rms_norm", "kernelgate", "case-7"));
}

TEST_F(StoreTest, ResultCountsPerOpAndBackendOfOneFingerprint) {
  auto store = open_rw("counts.sqlite");
  Fingerprint fp = sample_fingerprint(), other = sample_fingerprint();
  other.driver = "999";
  int64_t run = store->begin_run(fp, "sweep"), other_run = store->begin_run(other, "sweep");
  for (int i = 0; i < 3; ++i) store->add_result(run, sample_result(i));
  Result liger = sample_result(0);
  liger.backend = "liger";
  store->add_result(run, liger);
  store->add_result(other_run, sample_result(0));
  using Key = std::pair<std::string, std::string>;
  EXPECT_EQ(store->result_counts(fp.id()),
            (std::map<Key, int64_t>{{{"rms_norm", "kernelgate"}, 3}, {{"rms_norm", "liger"}, 1}}));
  EXPECT_EQ(store->result_counts(other.id()),
            (std::map<Key, int64_t>{{{"rms_norm", "kernelgate"}, 1}}));
  EXPECT_TRUE(store->result_counts("0000000000000000").empty());
}

TEST_F(StoreTest, ResultsAreNeverOverwritten) {
  auto store = open_rw("d.sqlite");
  int64_t run = store->begin_run(sample_fingerprint(), "x");
  store->add_result(run, failed_result(1));
  Result retry = sample_result(1);  // same case and backend, now "passing"
  try {
    store->add_result(run, retry);
    FAIL() << "a duplicate result was accepted";
  } catch (const StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("never overwritten"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path("d.sqlite")), std::string::npos) << e.what();
  }
  auto rows = store->results(sample_fingerprint().id());
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].disposition, Disposition::kIncorrect);
  EXPECT_THROW(store->add_result(run + 100, sample_result(2)), StoreError);
}

TEST_F(StoreTest, StaleReportExplainsEachOtherFingerprint) {
  auto store = open_rw("s.sqlite");
  Fingerprint cur = sample_fingerprint(), old_torch = cur, other_gpu = cur;
  old_torch.torch_version = "2.9.1";
  other_gpu.gpu_name = "NVIDIA A100-SXM4-80GB";
  other_gpu.compute_capability = "8.0";
  int64_t r1 = store->begin_run(old_torch, "a");
  for (int i = 0; i < 3; ++i) store->add_result(r1, sample_result(i));
  int64_t r2 = store->begin_run(other_gpu, "b");
  store->begin_run(other_gpu, "c");
  store->add_result(r2, sample_result(0));
  int64_t r3 = store->begin_run(cur, "d");
  for (int i = 0; i < 4; ++i) store->add_result(r3, sample_result(i));

  StaleReport report = store->stale(cur);
  EXPECT_EQ(report.current_id, cur.id());
  EXPECT_EQ(report.current_results, 4);
  ASSERT_EQ(report.stale.size(), 2u);
  for (const auto& s : report.stale) {
    if (s.id == old_torch.id()) {
      EXPECT_EQ(s.results, 3);
      EXPECT_EQ(s.runs, 1);
      EXPECT_EQ(s.fingerprint, old_torch);
      EXPECT_EQ(s.differences,
                std::vector<std::string>{"torch_version: stored 2.9.1, current 2.10.0"});
    } else {
      EXPECT_EQ(s.id, other_gpu.id());
      EXPECT_EQ(s.results, 1);
      EXPECT_EQ(s.runs, 2);
      EXPECT_EQ(s.differences.size(), 2u);
    }
  }
}

TEST_F(StoreTest, ReadOnlyStoreReadsButNeverWrites) {
  make_store("r.sqlite", 3, sample_fingerprint());
  OpenResult r = Store::open(path("r.sqlite"), Mode::kReadOnly);
  ASSERT_TRUE(r) << r.problem;
  EXPECT_EQ(r.store->results(sample_fingerprint().id()).size(), 3u);
  EXPECT_THROW(r.store->begin_run(sample_fingerprint(), "x"), StoreError);
  EXPECT_THROW(r.store->add_result(1, sample_result(5)), StoreError);
}

// ---- Many writers --------------------------------------------------------------------------

TEST_F(StoreTest, EightProcessesLoseNothing) {
  constexpr int kProcesses = 8, kEach = 200;
  const std::string file = path("sub/dir/concurrent.sqlite");  // created by the racing children
  int gate[2];
  ASSERT_EQ(pipe(gate), 0);
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {  // no SQLite handle crosses the fork: the child opens its own
      close(gate[1]);
      char c;
      (void)!read(gate[0], &c, 1);  // released together, to collide
      int code = 0;
      try {
        OpenResult r = Store::open(file, Mode::kReadWrite);
        if (!r) {
          fprintf(stderr, "child %d: %s\n", p, r.problem.c_str());
          _exit(2);
        }
        int64_t run = r.store->begin_run(sample_fingerprint(), "child " + std::to_string(p));
        for (int i = 0; i < kEach; ++i) {
          Result res = sample_result(i);
          res.backend = "backend-" + std::to_string(p);
          r.store->add_result(run, res);
        }
      } catch (const std::exception& e) {
        fprintf(stderr, "child %d: %s\n", p, e.what());
        code = 3;
      }
      _exit(code);
    }
    children.push_back(pid);
  }
  close(gate[0]);
  close(gate[1]);
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  }
  OpenResult r = Store::open(file, Mode::kReadOnly);
  ASSERT_TRUE(r) << r.problem;
  auto rows = r.store->results(sample_fingerprint().id());
  EXPECT_EQ(rows.size(), size_t{kProcesses * kEach});
  std::set<int64_t> runs;
  for (const auto& row : rows) runs.insert(row.run_id);
  EXPECT_EQ(runs.size(), size_t{kProcesses});
}

// ---- Files we must not use -----------------------------------------------------------------

TEST_F(StoreTest, RandomBytesAreRefusedUntouched) {
  std::mt19937 rng(7);
  std::string bytes(8192, '\0');
  for (auto& b : bytes) b = static_cast<char>(rng());
  write_bytes(path("junk.sqlite"), bytes);
  expect_refused(path("junk.sqlite"), "not a SQLite database");
}

TEST_F(StoreTest, TruncatedStoreIsRefusedUntouched) {
  const std::string file = make_store("t.sqlite", 400, sample_fingerprint());
  std::string bytes = read_bytes(file);
  ASSERT_GT(bytes.size(), 4 * 4096u);
  write_bytes(file, bytes.substr(0, bytes.size() / 2));
  expect_refused(file, "damaged");
}

TEST_F(StoreTest, ForeignDatabaseIsRefusedUntouched) {
  const std::string file = path("app.db");
  raw_sql(file,
          "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT); "
          "INSERT INTO users VALUES (1, 'ada');");
  expect_refused(file, "another application (application_id 0x00000000, tables: users)");
  // Even one that borrowed our table names but not our application id.
  const std::string lookalike = path("lookalike.db");
  raw_sql(lookalike, "CREATE TABLE meta (key TEXT, value TEXT); CREATE TABLE results (x);");
  expect_refused(lookalike, "another application");
}

TEST_F(StoreTest, ReadOnlyOpenInAReadOnlyDirectory) {
  // Shipped evidence: a WAL-mode store installed where the user cannot write.
  if (geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  fs::create_directories(path("pkg"));
  make_store("pkg/shipped.sqlite", 3, sample_fingerprint());
  fs::permissions(path("pkg"), fs::perms::owner_read | fs::perms::owner_exec);
  OpenResult r = Store::open(path("pkg/shipped.sqlite"), Mode::kReadOnly);
  std::vector<std::string> listing;
  for (const auto& e : fs::directory_iterator(path("pkg"))) listing.push_back(e.path().filename());
  fs::permissions(path("pkg"), fs::perms::owner_all);
  ASSERT_TRUE(r) << r.problem;
  EXPECT_EQ(r.store->results(sample_fingerprint().id()).size(), 3u);
  EXPECT_EQ(listing, std::vector<std::string>{"shipped.sqlite"});
}

TEST_F(StoreTest, PathsWithUriCharactersWork) {
  // The first look at an existing file goes through a SQLite URI; these must be escaped.
  fs::create_directories(path("we?ird #dir%20"));
  const std::string store_path = path("we?ird #dir%20/e v.sqlite");
  make_store("we?ird #dir%20/e v.sqlite", 2, sample_fingerprint());
  OpenResult r = Store::open(store_path, Mode::kReadOnly);
  ASSERT_TRUE(r) << r.problem;
  EXPECT_EQ(r.store->results(sample_fingerprint().id()).size(), 2u);
  const std::string foreign = path("we?ird #dir%20/app&x=1.db");
  raw_sql(foreign, "CREATE TABLE users (id INTEGER);");
  expect_refused(foreign, "another application");
}

TEST_F(StoreTest, NewerSchemaIsRefusedUntouched) {
  const std::string file = make_store("n.sqlite", 2, sample_fingerprint());
  raw_sql(file, "UPDATE meta SET value = '7' WHERE key = 'schema_version'");
  expect_refused(file, "schema version 7, newer than " + std::to_string(kSchemaVersion));
}

TEST_F(StoreTest, ReadOnlyOpenOfMissingFileCreatesNothing) {
  OpenResult r = Store::open(path("none/evidence.sqlite"), Mode::kReadOnly);
  EXPECT_FALSE(r);
  EXPECT_NE(r.problem.find(path("none/evidence.sqlite")), std::string::npos) << r.problem;
  EXPECT_TRUE(files().empty());
}

TEST_F(StoreTest, ReadWriteOpenCreatesANewPathWithItsDirectories) {
  auto deep = Store::open(path("a/b/c/evidence.sqlite"), Mode::kReadWrite);
  ASSERT_TRUE(deep) << deep.problem;
  EXPECT_EQ(deep.store->schema_version(), kSchemaVersion);
  EXPECT_EQ(raw_sql(path("a/b/c/evidence.sqlite"), "PRAGMA application_id"), "1262962006\n");
  EXPECT_EQ(raw_sql(path("a/b/c/evidence.sqlite"), "PRAGMA journal_mode"), "wal\n");
}

// Only a new path or a kernelgate store is written: an existing empty file, or an SQLite file
// with no tables, is someone's, and stays byte for byte as it was.
TEST_F(StoreTest, AnExistingFileThatIsNoStoreIsNeverTakenOver) {
  write_bytes(path("empty.sqlite"), "");
  expect_refused(path("empty.sqlite"), "exists but is not a kernelgate store");
  raw_sql(path("tableless.sqlite"), "PRAGMA user_version = 7");  // a valid database, no tables
  expect_refused(path("tableless.sqlite"), "exists but is not a kernelgate store");
}

// A path that is not a regular file is refused from its type alone: nothing opens it (a FIFO
// would block the open forever, a device would gain a -journal beside it).
TEST_F(StoreTest, APathThatIsNoRegularFileIsRefusedWithoutBeingOpened) {
  ASSERT_EQ(mkfifo(path("fifo").c_str(), 0600), 0);
  fs::create_directory(path("dir"));
  fs::create_symlink(path("missing.sqlite"), path("dangling"));
  const std::pair<std::string, std::string> cases[] = {
      {path("fifo"), "is a FIFO"},
      {path("dir"), "is a directory"},
      {path("dangling"), "is a symbolic link to a missing file"},
      {"/dev/null", "is a character device"},
  };
  for (const auto& [file, why] : cases) {
    for (Mode mode : {Mode::kReadOnly, Mode::kReadWrite}) {
      OpenResult r = Store::open(file, mode);
      EXPECT_FALSE(r) << file;
      EXPECT_NE(r.problem.find(why), std::string::npos) << r.problem;
    }
  }
  EXPECT_FALSE(fs::exists("/dev/null-journal"));
  EXPECT_FALSE(fs::exists(path("missing.sqlite")));
  EXPECT_TRUE(fs::is_fifo(path("fifo")));
  // A link to a store is the store.
  make_store("real.sqlite", 2, sample_fingerprint());
  fs::create_symlink(path("real.sqlite"), path("link.sqlite"));
  OpenResult through = Store::open(path("link.sqlite"), Mode::kReadWrite);
  ASSERT_TRUE(through) << through.problem;
  EXPECT_EQ(through.store->results(sample_fingerprint().id()).size(), 2u);
}

// Export writes into what the user named: a new path or a regular file (through a link, which
// stays a link); anything else is refused and left as it was.
TEST_F(StoreTest, ExportNeverReplacesWhatThePathIs) {
  make_store("s.sqlite", 3, sample_fingerprint());
  OpenResult src = Store::open(path("s.sqlite"), Mode::kReadOnly);
  ASSERT_TRUE(src) << src.problem;
  ASSERT_EQ(mkfifo(path("fifo").c_str(), 0600), 0);
  fs::create_directory(path("dir"));
  for (const std::string target : {path("fifo"), path("dir"), std::string("/dev/null")}) {
    try {
      src.store->export_json(target);
      ADD_FAILURE() << "exported to " << target;
    } catch (const StoreError& e) {
      EXPECT_NE(std::string(e.what()).find("export writes only a regular file or a new path"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_TRUE(fs::is_fifo(path("fifo")));
  EXPECT_TRUE(fs::is_directory(path("dir")));
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
  write_bytes(path("old.json"), "old");
  fs::create_symlink(path("old.json"), path("link.json"));
  src.store->export_json(path("link.json"));
  EXPECT_TRUE(fs::is_symlink(path("link.json")));
  EXPECT_NE(read_bytes(path("old.json")).find("kernelgate-evidence"), std::string::npos);
  src.store->export_json(path("new.json"));
  EXPECT_EQ(read_bytes(path("new.json")), read_bytes(path("old.json")));
}

// ---- Migrations ----------------------------------------------------------------------------

TEST_F(StoreTest, MigrationStepsRunInOrderAndRecordTheVersion) {
  const std::string file = make_store("m.sqlite", 5, sample_fingerprint());
  constexpr int a = kSchemaVersion + 1, b = kSchemaVersion + 2;
  std::vector<Migration> steps(schema_migrations().begin(), schema_migrations().end());
  steps.push_back({a, "CREATE TABLE probe (step INTEGER); INSERT INTO probe VALUES (1);"});
  steps.push_back({b, "INSERT INTO probe VALUES (2); ALTER TABLE results ADD COLUMN note TEXT;"});

  // A read-only open does not migrate.
  EXPECT_FALSE(Store::open(file, Mode::kReadOnly, steps));
  {
    OpenResult r = Store::open(file, Mode::kReadWrite, steps);
    ASSERT_TRUE(r) << r.problem;
    EXPECT_EQ(r.store->schema_version(), b);
    EXPECT_EQ(r.store->results(sample_fingerprint().id()).size(), 5u);  // data kept
  }
  EXPECT_EQ(raw_sql(file, "SELECT step FROM probe ORDER BY rowid"), "1\n2\n");
  EXPECT_EQ(raw_sql(file, "SELECT value FROM meta WHERE key = 'schema_version'"),
            std::to_string(b) + "\n");
  // Reopening applies nothing twice.
  ASSERT_TRUE(Store::open(file, Mode::kReadWrite, steps));
  EXPECT_EQ(raw_sql(file, "SELECT count(*) FROM probe"), "2\n");
  // This build now refuses it.
  EXPECT_FALSE(Store::open(file, Mode::kReadWrite));
}

TEST_F(StoreTest, FailedMigrationChangesNothing) {
  const std::string file = make_store("fm.sqlite", 2, sample_fingerprint());
  std::vector<Migration> steps(schema_migrations().begin(), schema_migrations().end());
  steps.push_back(
      {kSchemaVersion + 1, "CREATE TABLE probe (x); INSERT INTO no_such_table VALUES (1);"});
  OpenResult r = Store::open(file, Mode::kReadWrite, steps);
  EXPECT_FALSE(r);
  EXPECT_NE(r.problem.find("migrating to schema version " + std::to_string(kSchemaVersion + 1)),
            std::string::npos)
      << r.problem;
  EXPECT_EQ(raw_sql(file, "SELECT value FROM meta WHERE key = 'schema_version'"),
            std::to_string(kSchemaVersion) + "\n");
  EXPECT_EQ(raw_sql(file, "SELECT count(*) FROM sqlite_master WHERE name = 'probe'"), "0\n");
  EXPECT_TRUE(Store::open(file, Mode::kReadWrite));
}

// A store of schema version 1 (before sweep claims) reads as it is, read-only (shipped evidence
// of an older build), and a read-write open migrates it.
TEST_F(StoreTest, AVersionOneStoreIsReadWithoutMigrating) {
  const std::string file = make_store("v1.sqlite", 3, sample_fingerprint());
  raw_sql(file, "DROP TABLE claims; UPDATE meta SET value = '1' WHERE key = 'schema_version'");
  {
    OpenResult r = Store::open(file, Mode::kReadOnly);
    ASSERT_TRUE(r) << r.problem;
    EXPECT_EQ(r.store->schema_version(), 1);
    EXPECT_EQ(r.store->results(sample_fingerprint().id()).size(), 3u);
  }
  EXPECT_EQ(raw_sql(file, "SELECT value FROM meta WHERE key = 'schema_version'"), "1\n");
  OpenResult rw = Store::open(file, Mode::kReadWrite);
  ASSERT_TRUE(rw) << rw.problem;
  EXPECT_EQ(rw.store->schema_version(), kSchemaVersion);
  EXPECT_EQ(raw_sql(file, "SELECT count(*) FROM sqlite_master WHERE name = 'claims'"), "1\n");
}

// ---- Claims: concurrent sweeps share the work ----------------------------------------------

TEST_F(StoreTest, AClaimIsHeldUntilItsResultIsStored) {
  make_store("c.sqlite", 0, sample_fingerprint());
  auto first = open_rw("c.sqlite"), second = open_rw("c.sqlite");
  const std::string fp = sample_fingerprint().id();
  Result row = sample_result(0);
  using Claim = Store::Claim;
  EXPECT_EQ(first->claim(fp, row.op, row.backend, row.case_id, 600), Claim::kMine);
  EXPECT_EQ(first->claim(fp, row.op, row.backend, row.case_id, 600),
            Claim::kMine);  // again: still ours
  EXPECT_EQ(second->claim(fp, row.op, row.backend, row.case_id, 600), Claim::kTaken);
  EXPECT_EQ(second->claim(fp, row.op, "other", row.case_id, 600), Claim::kMine);  // another key
  first->add_result(first->begin_run(sample_fingerprint(), "first"), row);
  EXPECT_EQ(second->claim(fp, row.op, row.backend, row.case_id, 600), Claim::kDone);
  EXPECT_EQ(raw_sql(path("c.sqlite"), "SELECT count(*) FROM claims"), "1\n");  // only 'other'
}

TEST_F(StoreTest, AStaleOrOrphanedClaimIsTakenOver) {
  make_store("s.sqlite", 0, sample_fingerprint());
  auto first = open_rw("s.sqlite"), second = open_rw("s.sqlite");
  const std::string fp = sample_fingerprint().id();
  using Claim = Store::Claim;
  EXPECT_EQ(first->claim(fp, "op", "b", "c1", 600), Claim::kMine);
  EXPECT_EQ(second->claim(fp, "op", "b", "c1", 0), Claim::kMine);  // older than 0 s: stale
  // A claim of a process on this host that no longer exists is no one's.
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto r = Store::open(path("s.sqlite"), Mode::kReadWrite);
    _exit(r && r.store->claim(fp, "op", "b", "c2", 600) == Claim::kMine ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(first->claim(fp, "op", "b", "c2", 600), Claim::kMine);
}

// ---- Merge, export, import -----------------------------------------------------------------

TEST_F(StoreTest, MergeTwiceAddsNothingTheSecondTime) {
  Fingerprint other_fp = sample_fingerprint();
  other_fp.gpu_name = "NVIDIA A100";
  const std::string a = make_store("a.sqlite", 10, sample_fingerprint());
  const std::string b = make_store("b.sqlite", 7, other_fp);
  {
    auto store = open_rw("b.sqlite");
    store->add_result(store->begin_run(sample_fingerprint(), "b2"), sample_result(0));
  }
  auto target = open_rw("a.sqlite");
  MergeStats first = target->merge(b);
  EXPECT_EQ(first.fingerprints_added, 1);
  EXPECT_EQ(first.runs_added, 2);
  EXPECT_EQ(first.results_added, 8);
  MergeStats second = target->merge(b);
  EXPECT_EQ(second.fingerprints_added + second.runs_added + second.results_added, 0);
  EXPECT_EQ(second.results_skipped, 8);
  EXPECT_EQ(target->results(sample_fingerprint().id()).size(), 11u);
  EXPECT_EQ(target->results(other_fp.id()).size(), 7u);
  // Merging a store into itself is a no-op too.
  EXPECT_EQ(target->merge(a).results_added, 0);
  // A source we cannot use is an error that names it, and adds nothing.
  write_bytes(path("junk"), "not a database at all, not at all, not at all.....");
  EXPECT_THROW(target->merge(path("junk")), StoreError);
  EXPECT_THROW(target->merge(path("missing.sqlite")), StoreError);
  EXPECT_EQ(target->results(other_fp.id()).size(), 7u);
}

TEST_F(StoreTest, MergeOfAnInconsistentStoreAddsNothing) {
  const std::string src = make_store("src.sqlite", 4, sample_fingerprint());
  // A row edited by hand: its fields no longer hash to its id, so its evidence cannot be trusted.
  raw_sql(src, "UPDATE fingerprints SET torch_version = '9.9'");
  auto target = open_rw("dst.sqlite");
  try {
    target->merge(src);
    FAIL() << "merged";
  } catch (const StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("does not match its fields"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(target->stale(sample_fingerprint()).stale.empty());
  EXPECT_EQ(target->stale(sample_fingerprint()).current_results, 0);
}

TEST_F(StoreTest, ExportThenImportReproducesTheRows) {
  Fingerprint fp = sample_fingerprint(), old_fp = fp;
  old_fp.cuda_runtime = "12.4";
  old_fp.clocks_seen = "";
  make_store("src.sqlite", 6, fp);
  {
    auto src = open_rw("src.sqlite");
    src->add_result(src->begin_run(old_fp, "old \"sweep\""), failed_result(3));
    src->export_json(path("evidence.json"));
  }
  auto dst = open_rw("dst.sqlite");
  MergeStats stats = dst->import_json(path("evidence.json"));
  EXPECT_EQ(stats.fingerprints_added, 2);
  EXPECT_EQ(stats.runs_added, 2);
  EXPECT_EQ(stats.results_added, 7);
  EXPECT_EQ(dst->import_json(path("evidence.json")).results_added, 0);

  OpenResult src = Store::open(path("src.sqlite"), Mode::kReadOnly);
  ASSERT_TRUE(src) << src.problem;
  for (const auto& f : {fp, old_fp}) {
    auto want = src.store->results(f.id()), got = dst->results(f.id());
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size(); ++i) expect_same(want[i], got[i]);
    EXPECT_EQ(dst->fingerprint(f.id()), f);
  }
  // Same runs (uuids) on both sides, so a merge of the source adds nothing either.
  EXPECT_EQ(dst->merge(path("src.sqlite")).results_added, 0);
  // Export of the copy is the same document.
  dst->export_json(path("again.json"));
  EXPECT_EQ(read_bytes(path("again.json")), read_bytes(path("evidence.json")));
}

TEST_F(StoreTest, ImportOfABadDocumentAddsNothing) {
  make_store("src.sqlite", 3, sample_fingerprint());
  {
    OpenResult src = Store::open(path("src.sqlite"), Mode::kReadOnly);
    src.store->export_json(path("good.json"));
  }
  const std::string good = read_bytes(path("good.json"));
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    size_t at = s.rfind(from);  // the last occurrence: inside the last result
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"truncated", good.substr(0, good.size() / 2)},
      {"empty", ""},
      {"not json", "hello"},
      {"trailing", good + "x"},
      {"foreign", R"({"format": "something-else", "schema_version": 1})"},
      {"newer", replaced("\"schema_version\": 1", "\"schema_version\": 2")},
      {"bad disposition", replaced("\"disposition\": \"incorrect\"", "\"disposition\": \"ok\"")},
      {"wrong type", replaced("\"seed\": ", "\"seed\": \"x\", \"old_seed\": ")},
      {"missing field", replaced("\"dtype\": \"bfloat16\", ", "")},
      {"unknown run", replaced("\"run_uuid\": \"", "\"run_uuid\": \"f")},
      {"forged fingerprint", replaced("\"torch_version\": \"2.10.0\"", "\"torch_version\": \"3\"")},
      {"deep", std::string(100000, '[')},
  };
  auto store = open_rw("dst.sqlite");
  int64_t run = store->begin_run(sample_fingerprint(), "existing");
  store->add_result(run, sample_result(99));
  for (const auto& [name, text] : bad) {
    write_bytes(path("bad.json"), text);
    try {
      store->import_json(path("bad.json"));
      ADD_FAILURE() << name << ": imported";
    } catch (const StoreError& e) {
      EXPECT_NE(std::string(e.what()).find("nothing was imported"), std::string::npos)
          << name << ": " << e.what();
    }
    EXPECT_EQ(store->results(sample_fingerprint().id()).size(), 1u) << name;
  }
  EXPECT_EQ(store->import_json(path("good.json")).results_added, 3);
}

TEST_F(StoreTest, ImportReadsHandWrittenJson) {
  make_store("src.sqlite", 1, sample_fingerprint());
  {
    OpenResult src = Store::open(path("src.sqlite"), Mode::kReadOnly);
    src.store->export_json(path("good.json"));
  }
  std::string text = read_bytes(path("good.json"));
  // Escapes our writer never emits, a surrogate pair, other spacing, and non-finite metrics.
  const std::string from = "\"regime\": \"normal\"",
                    to = "\"regime\"\t:\r\n\"n\\u00fc\\ud83d\\ude00\\/\"";
  ASSERT_NE(text.find(from), std::string::npos);
  text.replace(text.find(from), from.size(), to);
  // The old max_rel_l2 value moves under a key we do not know, which is ignored.
  text.replace(text.find("\"max_rel_l2\": "), 14, "\"max_rel_l2\": \"-inf\", \"unknown\": ");
  write_bytes(path("hand.json"), text);
  auto store = open_rw("dst.sqlite");
  ASSERT_EQ(store->import_json(path("hand.json")).results_added, 1);
  auto rows = store->results(sample_fingerprint().id());
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].regime, "n\u00fc\U0001F600/");
  EXPECT_EQ(rows[0].max_rel_l2, -INFINITY);
}

// ---- JSON exchange: the document's edges ---------------------------------------------------

class JsonExchangeTest : public StoreTest {
 protected:
  // The export of a store of one run of `count` results (passed, failed, passed, ...).
  std::string exported(int count) {
    make_store("src.sqlite", count, sample_fingerprint());
    OpenResult src = Store::open(path("src.sqlite"), Mode::kReadOnly);
    EXPECT_TRUE(src) << src.problem;
    src.store->export_json(path("src.json"));
    return read_bytes(path("src.json"));
  }

  // `text` with the last occurrence of `from` replaced: inside the last row that has it.
  static std::string replaced(std::string text, const std::string& from, const std::string& to) {
    size_t at = text.rfind(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? text : text.replace(at, from.size(), to);
  }

  // Importing `text` into a new store fails with a message naming the document and containing
  // `reason_part`, and adds nothing (earlier rows of the document included).
  void expect_import_refused(const std::string& text, const std::string& reason_part) {
    SCOPED_TRACE(reason_part);
    auto store = open_rw("dst-" + std::to_string(++imports_) + ".sqlite");
    write_bytes(path("bad.json"), text);
    try {
      store->import_json(path("bad.json"));
      ADD_FAILURE() << "imported: " << text.substr(0, 300);
    } catch (const StoreError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path("bad.json")), std::string::npos) << what;
      EXPECT_NE(what.find(reason_part), std::string::npos) << what;
      EXPECT_NE(what.find("nothing was imported"), std::string::npos) << what;
    }
    StaleReport report = store->stale(sample_fingerprint());
    EXPECT_EQ(report.current_results, 0);
    EXPECT_TRUE(report.stale.empty());
    EXPECT_FALSE(store->fingerprint(sample_fingerprint().id()).has_value());
  }

  int imports_ = 0;
};

TEST_F(JsonExchangeTest, ExportWritesOneRowPerLine) {
  const std::string text = exported(2);
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 14u) << text;
  EXPECT_EQ(text.back(), '\n');
  EXPECT_EQ(lines[0], "{");
  EXPECT_EQ(lines[1], "\"format\": \"kernelgate-evidence\",");
  EXPECT_EQ(lines[2], "\"schema_version\": 1,");
  EXPECT_EQ(lines[3], "\"fingerprints\": [");
  EXPECT_EQ(lines[4],
            "{\"id\": \"8698f1b65f22a235\", \"gpu_name\": \"NVIDIA H200\", "
            "\"compute_capability\": \"9.0\", \"sm_count\": 132, \"memory_bytes\": 150754820096, "
            "\"driver\": \"570.124.06\", \"cuda_runtime\": \"12.8\", "
            "\"torch_version\": \"2.10.0\", "
            "\"kernelgate_version\": \"0.1.0\", \"source_hash\": \"3f2a9c\", "
            "\"backend_versions\": {\"liger_kernel\": \"0.5.10\", \"triton\": \"3.4.0\"}, "
            "\"clocks_seen\": \"sm=1980MHz mem=3201MHz\"}");
  EXPECT_EQ(lines[5], "],");
  EXPECT_EQ(lines[6], "\"runs\": [");
  EXPECT_EQ(lines[7].rfind("{\"uuid\": \"", 0), 0u) << lines[7];
  EXPECT_NE(lines[7].find("\"command\": \"kernelgate bench run\", \"started_at\": "),
            std::string::npos)
      << lines[7];
  EXPECT_EQ(lines[8], "],");
  EXPECT_EQ(lines[9], "\"results\": [");
  EXPECT_EQ(lines[10].rfind("{\"run_uuid\": \"", 0), 0u) << lines[10];
  EXPECT_EQ(lines[10].back(), ',');
  EXPECT_NE(lines[10].find("\"reason\": \"within tolerance \\\"quoted\\\"\\n\\ttab \\\\ back ü\""),
            std::string::npos)
      << lines[10];
  // NaN is null, an infinity a string, a timing never taken null.
  EXPECT_NE(lines[11].find("\"max_rel_l2\": \"inf\", \"max_max_over_rms\": null, "
                           "\"device_median_us\": null, "),
            std::string::npos)
      << lines[11];
  EXPECT_EQ(lines[11].back(), '}');
  EXPECT_EQ(lines[12], "]");
  EXPECT_EQ(lines[13], "}");
}

TEST_F(JsonExchangeTest, ExtremeAndNonFiniteNumbersRoundTripExactly) {
  const double values[] = {INFINITY,
                           -INFINITY,
                           NAN,
                           -0.0,
                           std::numeric_limits<double>::denorm_min(),
                           std::numeric_limits<double>::min(),
                           std::numeric_limits<double>::max(),
                           -std::numeric_limits<double>::max(),
                           0.1 + 0.2,
                           1e-300,
                           123456789.125,
                           1.0,
                           1e22};
  constexpr size_t n = std::size(values);
  auto src = open_rw("src.sqlite");
  const int64_t run = src->begin_run(sample_fingerprint(), "extremes");
  auto measured = [](double v) { return std::isnan(v) ? std::nullopt : std::optional(v); };
  std::vector<Result> rows;
  for (size_t i = 0; i < n; ++i) {
    Result r = sample_result(static_cast<int>(i));
    r.max_rel_l2 = values[i];
    r.max_max_over_rms = values[(i + 1) % n];
    r.device_median_us = measured(values[(i + 2) % n]);
    r.eager_spread_us = measured(values[(i + 3) % n]);
    r.rel_noise = measured(values[(i + 4) % n]);
    rows.push_back(r);
  }
  rows[0].seed = std::numeric_limits<int64_t>::min();
  rows[1].seed = std::numeric_limits<int64_t>::max();
  rows[2].arch = std::numeric_limits<int>::min();
  rows[3].device_samples = std::numeric_limits<int>::max();
  rows[4].created_at = std::numeric_limits<int64_t>::max();
  for (const auto& r : rows) src->add_result(run, r);
  src->export_json(path("numbers.json"));

  auto dst = open_rw("dst.sqlite");
  ASSERT_EQ(dst->import_json(path("numbers.json")).results_added, static_cast<int64_t>(n));
  auto got = dst->results(sample_fingerprint().id());
  ASSERT_EQ(got.size(), n);
  for (size_t i = 0; i < n; ++i) {
    SCOPED_TRACE(i);
    expect_same(got[i], rows[i]);
  }
}

TEST_F(JsonExchangeTest, EveryCharacterRoundTripsExactly) {
  std::string every;  // each byte below 0x80 (NUL included), then UTF-8 of 2, 3 and 4 bytes
  for (int c = 0; c < 0x80; ++c) every += static_cast<char>(c);
  every += "\u00fc \u20ac \u2028 \U0001F600";
  Fingerprint fp = sample_fingerprint();
  fp.gpu_name = every;
  fp.backend_versions[every] = every;
  Result r = sample_result(0);
  r.case_id = r.reason = every;
  {
    auto src = open_rw("src.sqlite");
    src->add_result(src->begin_run(fp, every), r);
    src->export_json(path("text.json"));
  }
  auto dst = open_rw("dst.sqlite");
  ASSERT_EQ(dst->import_json(path("text.json")).results_added, 1);
  EXPECT_EQ(dst->fingerprint(fp.id()), fp);  // and so its id still matches its fields
  auto rows = dst->results(fp.id());
  ASSERT_EQ(rows.size(), 1u);
  expect_same(rows[0], r);
  dst->export_json(path("again.json"));
  EXPECT_EQ(read_bytes(path("again.json")), read_bytes(path("text.json")));
}

TEST_F(JsonExchangeTest, ExportReplacesBytesThatAreNotUtf8) {
  // A worker's stderr cut mid character: JSON cannot carry the bytes, the row still travels.
  Result r = sample_result(0);
  r.reason = "stderr: cut \xe2\x82 here \xff";
  {
    auto src = open_rw("src.sqlite");
    src->add_result(src->begin_run(sample_fingerprint(), "x"), r);
    src->export_json(path("bytes.json"));
  }
  EXPECT_EQ(read_bytes(path("bytes.json")).find('\xff'), std::string::npos);
  auto dst = open_rw("dst.sqlite");
  ASSERT_EQ(dst->import_json(path("bytes.json")).results_added, 1);
  const std::string reason = dst->results(sample_fingerprint().id()).at(0).reason;
  EXPECT_EQ(reason.rfind("stderr: cut \xef\xbf\xbd", 0), 0u) << reason;  // U+FFFD
  EXPECT_NE(reason.find(" here \xef\xbf\xbd"), std::string::npos) << reason;
}

TEST_F(JsonExchangeTest, ImportIgnoresUnknownMembersAtAnyDepth) {
  std::string text = exported(2);
  // Before the header (holding names of our own members, which mean nothing there, and a
  // repeated name), between the sections, at the end, and inside rows.
  text.replace(0, 2,
               "{\n\"comment\": {\"format\": 2, \"fingerprints\": [{\"id\": 1}], "
               "\"a\": [[], {}], \"a\": 3},\n");
  text = replaced(text, "\"runs\": [", "\"later\": [[1, {\"b\": null}], \"x\"],\n\"runs\": [");
  text = replaced(text, "\n]\n}\n", "\n],\n\"trailer\": {\"results\": 5}\n}\n");
  text = replaced(text, "\"clocks_seen\": ", "\"future\": true, \"clocks_seen\": ");
  text = replaced(text, "\"command\": ", "\"host\": {\"name\": [\"n\"]}, \"command\": ");
  text = replaced(text,
                  "\"reason\": ", "\"note\": {\"deep\": [[[\"x\"]]], \"deep\": 1}, \"reason\": ");
  write_bytes(path("extra.json"), text);
  auto store = open_rw("dst.sqlite");
  MergeStats stats = store->import_json(path("extra.json"));
  EXPECT_EQ(stats.fingerprints_added, 1);
  EXPECT_EQ(stats.runs_added, 1);
  EXPECT_EQ(stats.results_added, 2);
}

TEST_F(JsonExchangeTest, ImportRefusesAWrongOrLateHeader) {
  const std::string good = exported(2);
  const size_t body = good.find("\"fingerprints\"");
  const std::string rows = good.substr(body);  // "fingerprints": [...], ..., "results": [...]}
  const std::string format = "\"format\": \"kernelgate-evidence\"",
                    version = "\"schema_version\": 1";
  expect_import_refused(
      "{" + version + ",\n" + rows.substr(0, rows.size() - 3) + ",\n" + format + "}\n",
      "\"format\" and \"schema_version\" must come first");
  expect_import_refused("{" + format + ",\n" + rows, "must come first");
  expect_import_refused("{" + rows, "must come first");
  for (const char* wrong : {"\"kernelgate-evidence2\"", "1", "null", "[\"kernelgate-evidence\"]",
                            "{\"format\": \"kernelgate-evidence\"}"}) {
    expect_import_refused(replaced(good, "\"kernelgate-evidence\"", wrong),
                          "\"format\" is not \"kernelgate-evidence\"");
  }
  for (const char* wrong : {"2", "0", "-1", "1.0", "\"1\"", "18446744073709551617", "[1]"}) {
    expect_import_refused(replaced(good, version, std::string("\"schema_version\": ") + wrong),
                          "is not 1, the only version this build reads");
  }
  expect_import_refused(replaced(good, format, format + ", " + format),
                        "the document: repeated key format");
  expect_import_refused("[" + good + "]", "not a JSON object");
  expect_import_refused(good.substr(0, good.find(",\n\"results\"")) + "\n}\n",
                        "\"fingerprints\", \"runs\" or \"results\" missing");
}

TEST_F(JsonExchangeTest, ImportRefusesAmbiguousOrMistypedRows) {
  const std::string good = exported(2);
  const std::string header = good.substr(0, good.find("\"fingerprints\""));
  auto with_rows = [&](const std::string& fingerprints) {
    return header + "\"fingerprints\": " + fingerprints + ",\n\"runs\": [],\n\"results\": []\n}\n";
  };
  expect_import_refused(with_rows("{}"), "\"fingerprints\" is not an array");
  expect_import_refused(with_rows("3"), "\"fingerprints\" is not an array");
  expect_import_refused(with_rows("[1]"), "fingerprints[0]: expected an object");
  expect_import_refused(with_rows("[[]]"), "fingerprints[0]: expected an object");
  // JSON leaves a repeated name's meaning open, so it is refused rather than read either way.
  expect_import_refused(replaced(good, "\"reason\": ", "\"disposition\": \"passed\", \"reason\": "),
                        "results[1]: repeated key disposition");
  expect_import_refused(
      replaced(good, "\"triton\": \"3.4.0\"", "\"triton\": \"3.4.0\", \"triton\": \"3.5.0\""),
      "fingerprints[0].backend_versions: repeated key triton");
  const std::pair<std::string, std::string> mistyped[] = {
      {"\"seed\": 9223372036854775808", "results[1].seed: expected an integer"},
      {"\"seed\": -9223372036854775809", "results[1].seed: expected an integer"},
      {"\"seed\": 1.0", "results[1].seed: expected an integer"},
      {"\"arch\": 2147483648", "results[1].arch: expected a 32-bit integer"},
      {"\"grad\": 1", "results[1].grad: expected true or false"},
      {"\"max_rel_l2\": \"Infinity\"", "results[1].max_rel_l2: expected a number"},
      {"\"dtype\": null", "results[1].dtype: expected a string"},
      {"\"disposition\": \"passed \"", "results[1].disposition: expected a disposition"},
      {"\"max_rel_l2\": 1e999", "malformed JSON"},
      {"\"shape\": \"\xff\"", "malformed JSON"},
  };
  for (const auto& [member, reason] : mistyped) {
    const std::string name = member.substr(0, member.find(':') + 1);
    std::string text = good;
    const size_t at = text.rfind(name), end = text.find(", ", at);
    ASSERT_NE(at, std::string::npos) << name;
    expect_import_refused(text.replace(at, end - at, member), reason);
  }
}

TEST_F(JsonExchangeTest, TruncatedDocumentAddsNothing) {
  const std::string good = exported(3);
  auto store = open_rw("dst.sqlite");
  int tried = 0, imported = 0, unexplained = 0;
  // Prefixes but the whole document and the one lacking just its final newline: each one ending
  // near a line break (between rows and sections), and a spread of others.
  for (size_t cut = 0; cut + 1 < good.size(); ++cut) {
    const size_t line_break = good.find('\n', cut > 2 ? cut - 2 : 0);
    if (line_break > cut + 2 && cut % 17 != 0) continue;
    write_bytes(path("cut.json"), good.substr(0, cut));
    ++tried;
    try {
      store->import_json(path("cut.json"));
      ++imported;
    } catch (const StoreError& e) {
      unexplained += std::string(e.what()).find("nothing was imported") == std::string::npos;
    }
  }
  EXPECT_EQ(imported, 0);
  EXPECT_EQ(unexplained, 0);
  EXPECT_GT(tried, 200);
  EXPECT_TRUE(store->stale(sample_fingerprint()).stale.empty());
  EXPECT_EQ(store->stale(sample_fingerprint()).current_results, 0);
  EXPECT_FALSE(store->fingerprint(sample_fingerprint().id()).has_value());
}

TEST_F(JsonExchangeTest, ImportsWhatThePreviousWriterWrote) {
  // Written by the hand-made writer this one replaced: other escapes and number spellings.
  const std::string text =
      "{\n"
      "\"format\": \"kernelgate-evidence\",\n"
      "\"schema_version\": 1,\n"
      "\"fingerprints\": [\n"
      "{\"id\": \"8698f1b65f22a235\", \"gpu_name\": \"NVIDIA H200\", "
      "\"compute_capability\": \"9.0\", \"sm_count\": 132, \"memory_bytes\": 150754820096, "
      "\"driver\": \"570.124.06\", \"cuda_runtime\": \"12.8\", "
      "\"torch_version\": \"2.10.0\", \"kernelgate_version\": \"0.1.0\", "
      "\"source_hash\": \"3f2a9c\", \"backend_versions\": {\"liger_kernel\": \"0.5.10\", "
      "\"triton\": \"3.4.0\"}, \"clocks_seen\": \"sm=1980MHz mem=3201MHz\"}\n"
      "],\n"
      "\"runs\": [\n"
      "{\"uuid\": \"06366f1ef7903e161df5afcf13769cbc\", "
      "\"fingerprint_id\": \"8698f1b65f22a235\", \"command\": \"old \\\"build\\\"\", "
      "\"started_at\": 1796115045, \"kernelgate_version\": \"0.1.0\"}\n"
      "],\n"
      "\"results\": [\n"
      "{\"run_uuid\": \"06366f1ef7903e161df5afcf13769cbc\", \"op\": \"rms_norm\", "
      "\"backend\": \"kernelgate\", \"case_id\": \"case-0\", \"arch\": 90, "
      "\"dtype\": \"bfloat16\", \"buckets\": \"14,12\", \"region\": \"r\", "
      "\"align\": \"16\", \"grad\": true, \"shape\": \"s\", \"layout\": \"contiguous\", "
      "\"regime\": \"normal\", \"seed\": 7, \"disposition\": \"incorrect\", "
      "\"reason\": \"line\\u000anext\\u0009tab\", \"max_rel_l2\": \"inf\", "
      "\"max_max_over_rms\": 0, \"device_median_us\": 100, \"device_spread_us\": null, "
      "\"device_samples\": 3, \"eager_median_us\": null, \"eager_spread_us\": null, "
      "\"eager_samples\": 0, \"rel_noise\": 0.25, \"throttled\": false, "
      "\"clocks_before\": \"\", \"clocks_after\": \"\", \"created_at\": 1700000000}\n"
      "]\n"
      "}\n";
  write_bytes(path("old.json"), text);
  auto store = open_rw("dst.sqlite");
  MergeStats stats = store->import_json(path("old.json"));
  EXPECT_EQ(stats.fingerprints_added, 1);
  EXPECT_EQ(stats.results_added, 1);
  EXPECT_EQ(store->fingerprint(sample_fingerprint().id()), sample_fingerprint());
  auto rows = store->results(sample_fingerprint().id());
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].reason, "line\nnext\ttab");
  EXPECT_EQ(rows[0].max_rel_l2, INFINITY);
  EXPECT_EQ(rows[0].max_max_over_rms, 0.0);
  EXPECT_EQ(rows[0].device_median_us, 100.0);
  EXPECT_FALSE(rows[0].device_spread_us.has_value());
  EXPECT_EQ(rows[0].rel_noise, 0.25);
  EXPECT_EQ(rows[0].seed, 7);
}

// ---- backend_versions as stored ------------------------------------------------------------

TEST_F(StoreTest, BackendVersionsColumnKeepsItsText) {
  const std::string file = make_store("b.sqlite", 1, sample_fingerprint());
  EXPECT_EQ(raw_sql(file, "SELECT backend_versions FROM fingerprints"),
            "{\"liger_kernel\": \"0.5.10\", \"triton\": \"3.4.0\"}\n");
  const std::string id = sample_fingerprint().id();
  // Any JSON object of strings reads, whatever its spacing and escapes.
  raw_sql(file, "UPDATE fingerprints SET backend_versions = '{ \"a\\u0041\" :\"x\\n\" }'");
  {
    auto store = open_rw("b.sqlite");
    auto fp = store->fingerprint(id);
    ASSERT_TRUE(fp.has_value());
    EXPECT_EQ(fp->backend_versions, (std::map<std::string, std::string>{{"aA", "x\n"}}));
  }
  for (const char* damaged :
       {"not json", "[1]", "{\"a\": 1}", "{\"a\": \"1\", \"a\": \"2\"}", ""}) {
    raw_sql(file, "UPDATE fingerprints SET backend_versions = '" + std::string(damaged) + "'");
    auto store = open_rw("b.sqlite");
    try {
      store->fingerprint(id);
      ADD_FAILURE() << damaged << ": read";
    } catch (const StoreError& e) {
      EXPECT_NE(std::string(e.what()).find("damaged fingerprint row: backend_versions"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    }
  }
}

TEST_F(StoreTest, BackendVersionsThatAreNotUtf8AreRefused) {
  // Replacing the bytes would store a map that no longer hashes to the fingerprint's id.
  Fingerprint fp = sample_fingerprint();
  fp.backend_versions["triton"] = "3.4\xff";
  auto store = open_rw("u.sqlite");
  try {
    store->begin_run(fp, "x");
    FAIL() << "stored";
  } catch (const StoreError& e) {
    EXPECT_NE(std::string(e.what()).find(path("u.sqlite")), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("backend_versions"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(store->fingerprint(fp.id()).has_value());
  EXPECT_EQ(raw_sql(path("u.sqlite"), "SELECT count(*) FROM runs"), "0\n");
}

TEST(DefaultPath, FollowsTheEnvironment) {
  auto restore = [](const char* name, const char* old) {
    old ? setenv(name, old, 1) : unsetenv(name);
  };
  std::string old_db = getenv("KERNELGATE_DB") ? getenv("KERNELGATE_DB") : "";
  std::string old_xdg = getenv("XDG_CACHE_HOME") ? getenv("XDG_CACHE_HOME") : "";
  std::string old_home = getenv("HOME") ? getenv("HOME") : "";
  bool had_db = getenv("KERNELGATE_DB"), had_xdg = getenv("XDG_CACHE_HOME");

  setenv("HOME", "/home/u", 1);
  setenv("XDG_CACHE_HOME", "/xdg", 1);
  setenv("KERNELGATE_DB", "/data/e.sqlite", 1);
  EXPECT_EQ(Store::default_path(), "/data/e.sqlite");
  setenv("KERNELGATE_DB", "", 1);
  EXPECT_EQ(Store::default_path(), "/xdg/kernelgate/evidence.sqlite");
  unsetenv("KERNELGATE_DB");
  setenv("XDG_CACHE_HOME", "", 1);
  EXPECT_EQ(Store::default_path(), "/home/u/.cache/kernelgate/evidence.sqlite");

  restore("KERNELGATE_DB", had_db ? old_db.c_str() : nullptr);
  restore("XDG_CACHE_HOME", had_xdg ? old_xdg.c_str() : nullptr);
  restore("HOME", old_home.empty() ? nullptr : old_home.c_str());
}

}  // namespace
}  // namespace kernelgate::store
