// Which stored evidence serves a process (usable_evidence), what doctor calls stale
// (store_standing), per-backend fingerprints, and dispositions on the worker wire: on synthetic
// rows in real store files.
#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "harness/evidence.h"
#include "harness/harness.h"

namespace kernelgate::harness {
namespace {

using store::Disposition;
using Names = std::vector<std::string>;

constexpr char kRegion[] = "op cpu float32 n<=2^4 vec16 grad";

store::Fingerprint machine() {
  store::Fingerprint f;
  f.gpu_name = "NVIDIA H200";
  f.compute_capability = "9.0";
  f.sm_count = 132;
  f.memory_bytes = 150000000000;
  f.driver = "13.0";
  f.cuda_runtime = "13.0";
  f.torch_version = "2.11.0";
  f.kernelgate_version = "0.1.0";
  f.source_hash = "abc";
  return f;
}

store::Fingerprint with_version(store::Fingerprint f, const std::string& backend,
                                const std::string& version) {
  f.backend_versions[backend] = version;
  return f;
}

// The current fingerprints of op "op": reference and kernelgate_cpu without a version, the Python
// backend "py" at `py_version`.
std::map<std::string, OpFingerprints> current(const std::string& py_version) {
  OpFingerprints f;
  f.op = machine();
  f.backends = {
      {"reference", f.op}, {"kernelgate_cpu", f.op}, {"py", with_version(f.op, "py", py_version)}};
  return {{"op", f}};
}

store::Result row(const std::string& backend, double us, const std::string& region = kRegion,
                  Disposition d = Disposition::kPassed) {
  store::Result r;
  r.op = "op";
  r.backend = backend;
  r.case_id = region + "/a/seed=0";
  r.region = region;
  r.disposition = d;
  if (d == Disposition::kPassed) {
    r.device_median_us = us;
    r.rel_noise = 0.005;
  }
  return r;
}

class EvidenceTest : public ::testing::Test {
 protected:
  // Note on std::filesystem: linked with libtorch, this test resolved remove_all to a copy inside
  // libtorch.so that crashed; plain POSIX calls instead.
  void SetUp() override {
    std::string templ = "/tmp/kg_evidence_XXXXXX";
    ASSERT_NE(mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override {
    if (DIR* d = opendir(dir_.c_str())) {
      while (dirent* e = readdir(d)) {
        if (e->d_name[0] != '.') unlink((dir_ + "/" + e->d_name).c_str());
      }
      closedir(d);
    }
    rmdir(dir_.c_str());
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // A store file holding `rows`, each under the fingerprint beside it (one run per fingerprint).
  std::string make_store(const std::string& name,
                         const std::vector<std::pair<store::Fingerprint, store::Result>>& rows) {
    auto opened = store::Store::open(path(name), store::Mode::kReadWrite);
    EXPECT_TRUE(opened) << opened.problem;
    std::map<std::string, int64_t> runs;
    for (const auto& [fp, r] : rows) {
      if (!runs.count(fp.id())) runs[fp.id()] = opened.store->begin_run(fp, "test");
      opened.store->add_result(runs[fp.id()], r);
    }
    return path(name);
  }

  // A user store: the built-in backends' rows, py's rows from before it had a version, and py's
  // rows at version code=v1.
  std::string user_store() {
    const auto f = machine();
    return make_store("user.sqlite", {{f, row("reference", 10)},
                                      {f, row("kernelgate_cpu", 5)},
                                      {f, row("py", 2)},
                                      {with_version(f, "py", "code=v1"), row("py", 1)}});
  }

  std::string dir_;
};

// "backend@time" of each row, sorted.
Names backends_of(const std::vector<store::Result>& rows) {
  Names out;
  for (const auto& r : rows) out.push_back(r.backend + "@" + std::to_string(*r.device_median_us));
  std::sort(out.begin(), out.end());
  return out;
}

TEST_F(EvidenceTest, ABackendsVersionMakesOnlyItsOwnEvidenceStale) {
  const std::string db = user_store();
  // py at the version it was measured at: its versioned rows serve, its unversioned ones do not.
  auto v1 = usable_evidence(db, {}, current("code=v1"));
  ASSERT_EQ(v1.sets.size(), 1u);
  EXPECT_FALSE(v1.sets[0].shipped);
  EXPECT_EQ(v1.sets[0].provenance, "evidence in " + db);
  EXPECT_EQ(backends_of(v1.sets[0].rows),
            (Names{"kernelgate_cpu@5.000000", "py@1.000000", "reference@10.000000"}));
  EXPECT_EQ(derive_policy(v1).at(0).ranked, (Names{"py", "kernelgate_cpu", "reference"}));
  // py's code moved: none of its rows serve; the other backends' still do.
  auto v2 = usable_evidence(db, {}, current("code=v2"));
  ASSERT_EQ(v2.sets.size(), 1u);
  EXPECT_EQ(backends_of(v2.sets[0].rows),
            (Names{"kernelgate_cpu@5.000000", "reference@10.000000"}));
  const auto regions = derive_policy(v2);
  ASSERT_EQ(regions.size(), 1u);
  EXPECT_EQ(regions[0].ranked, (Names{"kernelgate_cpu", "reference"}));
  EXPECT_EQ(regions[0].evidence, "evidence in " + db);
  EXPECT_TRUE(v2.problems.empty());
  EXPECT_EQ(v2.notes, Names{"store " + db + ": 2 rows for this fingerprint"});
}

TEST_F(EvidenceTest, DoctorCallsStaleOnlyRowsCurrentForNoBackend) {
  const std::string db = user_store();
  auto opened = store::Store::open(db, store::Mode::kReadOnly);
  ASSERT_TRUE(opened) << opened.problem;
  const auto f = machine();
  const std::string unversioned = f.id(), v1 = with_version(f, "py", "code=v1").id();

  auto at_v1 = store_standing(*opened.store, current("code=v1"));
  EXPECT_EQ(at_v1.current_results, 3);
  ASSERT_EQ(at_v1.stale.size(), 1u);  // the built-in backends' fingerprint, for py's old row only
  EXPECT_EQ(at_v1.stale[0].id, unversioned);
  EXPECT_EQ(at_v1.stale[0].results, 1);
  EXPECT_EQ(at_v1.stale[0].differences,
            Names{"backend_versions[py]: stored (absent), current code=v1"});

  auto at_v2 = store_standing(*opened.store, current("code=v2"));
  EXPECT_EQ(at_v2.current_results, 2);
  ASSERT_EQ(at_v2.stale.size(), 2u);
  for (const auto& s : at_v2.stale) {
    EXPECT_EQ(s.results, 1) << s.id;
    const std::string stored = s.id == v1 ? "code=v1" : "(absent)";
    EXPECT_EQ(s.differences, Names{"backend_versions[py]: stored " + stored + ", current code=v2"});
  }
}

TEST_F(EvidenceTest, DoctorExplainsRowsOfAnOpThisProcessLacksAgainstTheClosestOp) {
  auto gone = machine();
  gone.source_hash = "def";
  store::Result r = row("reference", 1);
  r.op = "gone";
  const std::string db = make_store("gone.sqlite", {{gone, r}});
  auto opened = store::Store::open(db, store::Mode::kReadOnly);
  ASSERT_TRUE(opened) << opened.problem;
  auto standing = store_standing(*opened.store, current("code=v1"));
  EXPECT_EQ(standing.current_results, 0);
  ASSERT_EQ(standing.stale.size(), 1u);
  EXPECT_EQ(standing.stale[0].results, 1);
  EXPECT_EQ(standing.stale[0].differences, Names{"source_hash: stored def, current abc"});
}

TEST_F(EvidenceTest, ShippedEvidenceServesOnlyRegionsTheUserStoreSaysNothingAbout) {
  const auto f = machine();
  const std::string user =
      make_store("user.sqlite", {{f, row("reference", 10, "r1")},
                                 {f, row("kernelgate_cpu", 5, "r1")},
                                 {f, row("kernelgate_cpu", 0, "r2", Disposition::kUnsupported)}});
  auto ours = f;  // the same build on our GPU: another driver and memory size
  ours.driver = "12.9";
  ours.memory_bytes = 140000000000;
  auto other_gpu = ours;  // another GPU of the same architecture, the same build: borrowed
  other_gpu.gpu_name = "NVIDIA H100 80GB HBM3";
  auto other_arch = other_gpu;
  other_arch.compute_capability = "8.0";
  const std::string shipped = make_store(
      "shipped.sqlite", {{ours, row("reference", 30, "r1")},  // the user's evidence speaks for r1
                         {ours, row("reference", 30, "r2")},
                         {ours, row("kernelgate_cpu", 3, "r2")},
                         {ours, row("kernelgate_cpu", 4, "r3")},
                         {with_version(ours, "py", "code=v1"), row("py", 1, "r3")},
                         {other_gpu, row("reference", 7, "r4")},
                         {other_gpu, row("kernelgate_cpu", 2, "r2")},  // r2 has our own GPU's
                         {other_arch, row("reference", 7, "r5")}});
  const auto evidence = usable_evidence(user, {shipped}, current("code=v2"));
  ASSERT_EQ(evidence.sets.size(), 3u);
  EXPECT_TRUE(evidence.sets[1].shipped);
  EXPECT_EQ(evidence.sets[1].provenance, "evidence shipped with kernelgate");
  EXPECT_EQ(backends_of(evidence.sets[1].rows),
            (Names{"kernelgate_cpu@3.000000", "kernelgate_cpu@4.000000", "reference@30.000000"}));
  // Borrowed: the other GPU's row where nothing else speaks, its timing dropped.
  const auto& lent = evidence.sets[2];
  EXPECT_TRUE(lent.shipped && lent.borrowed);
  ASSERT_EQ(lent.rows.size(), 1u);
  EXPECT_EQ(lent.rows[0].region, "r4");
  EXPECT_FALSE(lent.rows[0].device_median_us.has_value());
  EXPECT_EQ(lent.rows[0].reason.rfind("borrowed from NVIDIA H100 80GB HBM3", 0), 0u);
  const std::string lent_by =
      "evidence borrowed from NVIDIA H100 80GB HBM3 (same architecture and build: correctness "
      "only, not timed on this GPU; kernelgate rerank times it)";
  EXPECT_EQ(lent.provenance, lent_by);
  EXPECT_EQ(evidence.to_rerank,
            (std::set<std::tuple<std::string, std::string, std::string>>{{"op", "reference", "r4/a/seed=0"}}));
  std::map<std::string, std::pair<std::string, Names>> got;  // region -> (provenance, ranked)
  for (const auto& r : derive_policy(evidence)) got[r.region] = {r.evidence, r.ranked};
  const std::string ours_too = "evidence shipped with kernelgate";
  EXPECT_EQ(got, (std::map<std::string, std::pair<std::string, Names>>{
                     {"r1", {"evidence in " + user, Names{"kernelgate_cpu", "reference"}}},
                     {"r2", {ours_too, Names{"kernelgate_cpu", "reference"}}},
                     {"r3", {ours_too, Names{"kernelgate_cpu"}}},
                     {"r4", {lent_by, Names{}}}}));
  EXPECT_EQ(evidence.notes.back(), "shipped evidence " + shipped +
                                       ": 3 rows apply, 2 borrowed (another GPU of this architecture)");
  EXPECT_EQ(EvidencePolicy(evidence).describe(),
            "evidence in " + user + " (1 regions); evidence shipped with kernelgate (2 regions); " +
                lent_by + " (1 rows; they rank no region until reranked)");
}

TEST_F(EvidenceTest, ASourceThatCannotBeReadIsLeftOutWithTheReason) {
  const std::string missing = path("missing.sqlite"), garbage = path("garbage.sqlite");
  std::ofstream(garbage) << "not a store";
  const auto evidence = usable_evidence(garbage, {garbage}, current("code=v1"));
  EXPECT_TRUE(evidence.sets.empty());
  EXPECT_TRUE(evidence.notes.empty());
  ASSERT_EQ(evidence.problems.size(), 2u);
  EXPECT_EQ(evidence.problems[0].rfind("store not used: ", 0), 0u) << evidence.problems[0];
  EXPECT_NE(evidence.problems[0].find(garbage), std::string::npos) << evidence.problems[0];
  EXPECT_EQ(evidence.problems[1].rfind("shipped evidence not used: ", 0), 0u)
      << evidence.problems[1];
  EXPECT_EQ(EvidencePolicy(evidence).describe(), "");
  // A user store not made yet is the first run, not a problem.
  const auto first_run = usable_evidence(missing, {}, current("code=v1"));
  EXPECT_TRUE(first_run.problems.empty());
  ASSERT_EQ(first_run.notes.size(), 1u);
  EXPECT_NE(first_run.notes[0].find(missing), std::string::npos) << first_run.notes[0];
}

TEST(Fingerprints, ShippedEvidenceRule) {
  const store::Fingerprint ours = machine();
  store::Fingerprint user = ours;
  user.driver = "13.1";
  user.memory_bytes = 140000000000;
  EXPECT_TRUE(shipped_evidence_applies(ours, user));  // another driver: same kernels, same chip
  for (auto change : std::vector<std::function<void(store::Fingerprint&)>>{
           [](auto& f) { f.gpu_name = "NVIDIA H100 80GB HBM3"; },
           [](auto& f) { f.compute_capability = "8.0"; }, [](auto& f) { f.sm_count = 114; },
           [](auto& f) { f.torch_version = "2.12.0"; }, [](auto& f) { f.source_hash = "def"; },
           [](auto& f) { f.cuda_runtime = "12.8"; },
           [](auto& f) { f.backend_versions["py"] = "code=v2"; }}) {
    store::Fingerprint other = user;
    change(other);
    EXPECT_FALSE(shipped_evidence_applies(ours, other)) << other.gpu_name;
  }
}

TEST(Fingerprints, BorrowingRule) {
  // Another GPU model of the same architecture, identical build: borrowed (correctness only).
  store::Fingerprint h200 = machine();
  h200.gpu_name = "NVIDIA H200";
  h200.compute_capability = "9.0";
  h200.sm_count = 132;
  store::Fingerprint h100 = h200;
  h100.gpu_name = "NVIDIA H100 80GB HBM3";
  h100.sm_count = 132;
  h100.memory_bytes = 85000000000;
  h100.driver = "13.1";
  EXPECT_TRUE(evidence_borrowable(h200, h100));
  EXPECT_FALSE(shipped_evidence_applies(h200, h100));
  h100.sm_count = 114;  // the PCIe part
  EXPECT_TRUE(evidence_borrowable(h200, h100));
  // Evidence that applies as it is is not borrowed.
  EXPECT_FALSE(evidence_borrowable(h200, h200));
  // Another architecture or any other build: neither.
  for (auto change : std::vector<std::function<void(store::Fingerprint&)>>{
           [](auto& f) { f.compute_capability = "10.0"; },
           [](auto& f) { f.torch_version = "2.12.0"; }, [](auto& f) { f.source_hash = "def"; },
           [](auto& f) { f.kernelgate_version = "0.2.0"; },
           [](auto& f) { f.cuda_runtime = "12.8"; },
           [](auto& f) { f.backend_versions["py"] = "code=v2"; }}) {
    store::Fingerprint other = h100;
    change(other);
    EXPECT_FALSE(evidence_borrowable(h200, other));
    EXPECT_FALSE(shipped_evidence_applies(h200, other));
  }
}

TEST(Fingerprints, ABackendWithAVersionHasItsOwn) {
  Dispatcher& d = Dispatcher::get();
  const OpEntry* e = d.find_op("rms_norm");
  ASSERT_NE(e, nullptr);
  BackendDesc b;
  b.name = "test_versioned";
  b.kind = BackendKind::kPython;
  b.version = "pkg==1.2;code=ab12";
  d.add_backend(e->id, b);  // a descriptor without code: listed as unavailable, never dispatched
  const auto op = current_fingerprint("rms_norm");
  EXPECT_TRUE(op.backend_versions.empty());
  EXPECT_EQ(current_fingerprint("rms_norm", "reference"), op);
  auto versioned = op;
  versioned.backend_versions = {{"test_versioned", "pkg==1.2;code=ab12"}};
  EXPECT_EQ(current_fingerprint("rms_norm", "test_versioned"), versioned);
  const auto all = current_fingerprints();
  EXPECT_EQ(all.at("rms_norm").of("test_versioned"), versioned);
  EXPECT_EQ(all.at("rms_norm").of("reference"), op);
  EXPECT_EQ(all.at("rms_norm").of("not_registered_here"), op);
  EXPECT_EQ(current_fingerprints("rms_norm").size(), 1u);
  EXPECT_TRUE(current_fingerprints("no_such_op").empty());
  EXPECT_THROW(current_fingerprint("rms_norm", "no_such_backend"), std::runtime_error);
}

TEST(WorkerWire, ADispositionTravelsAsItsName) {
  for (Disposition d :
       {Disposition::kPassed, Disposition::kIncorrect, Disposition::kCrashed,
        Disposition::kTimedOut, Disposition::kOutOfMemory, Disposition::kUnsupported}) {
    Measured m;
    m.disposition = d;
    m.reason = "why";
    const std::string line = m.encode();
    const std::string name(store::to_string(d));
    EXPECT_NE(line.find("disposition=" + name), std::string::npos) << line;
    std::string problem;
    auto back = Measured::decode(line, &problem);
    ASSERT_TRUE(back) << problem;
    EXPECT_EQ(back->disposition, d);
    EXPECT_EQ(back->reason, "why");
  }
  std::string problem;
  EXPECT_FALSE(Measured::decode("disposition=exploded;reason=x", &problem));
  EXPECT_EQ(problem, "unknown disposition 'exploded'");
}

}  // namespace
}  // namespace kernelgate::harness
