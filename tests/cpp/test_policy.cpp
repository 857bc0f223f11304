// Policy derivation from stored results (a pure function of the rows): eligibility, ranking,
// ties within noise, fail-closed. Which rows are usable: test_evidence.cpp.
#include <gtest/gtest.h>

#include "harness/evidence.h"

namespace kernelgate::harness {
namespace {

using store::Disposition;

store::Result row(const std::string& backend, const std::string& case_id, double us,
                  Disposition d = Disposition::kPassed, double noise = 0.005,
                  const std::string& region = "op cpu float32 n<=2^4 vec16 grad") {
  store::Result r;
  r.op = "op";
  r.backend = backend;
  r.case_id = case_id;
  r.region = region;
  r.disposition = d;
  if (d == Disposition::kPassed && us > 0) {
    r.device_median_us = us;
    r.rel_noise = noise;
  }
  return r;
}

const RegionPolicy& only(const std::vector<RegionPolicy>& p) {
  EXPECT_EQ(p.size(), 1u);
  return p.front();
}

TEST(Policy, RanksByTimeFastestFirst) {
  auto p =
      derive_policy({row("reference", "a/seed=0", 30), row("reference", "b/seed=0", 60),
                     row("aten", "a/seed=0", 20), row("aten", "b/seed=0", 40),
                     row("kernelgate_cpu", "a/seed=0", 10), row("kernelgate_cpu", "b/seed=0", 20)});
  const auto& r = only(p);
  EXPECT_EQ(r.ranked, (std::vector<std::string>{"kernelgate_cpu", "aten", "reference"}));
  EXPECT_NEAR(r.margin, 1.0, 1e-9);  // aten takes twice as long
  EXPECT_EQ(r.comparison, "faster");
}

TEST(Policy, MedianOverSeedsAndGeometricMeanOverCases) {
  auto p = derive_policy({row("x_kernel", "a/seed=0", 10), row("x_kernel", "a/seed=1", 1000),
                          row("x_kernel", "a/seed=2", 11), row("reference", "a/seed=0", 12)});
  EXPECT_EQ(only(p).ranked.front(), "x_kernel");  // median 11 < 12, the outlier ignored
}

TEST(Policy, TieWithinNoiseKeepsFixedPreference) {
  // Within 2% of each other with 2% noise: "same"; the fixed order puts our kernel before aten
  // and the reference last, whichever measured faster.
  auto p = derive_policy({row("reference", "a/seed=0", 100.0, Disposition::kPassed, 0.02),
                          row("aten", "a/seed=0", 99.0, Disposition::kPassed, 0.02),
                          row("kernelgate_cuda", "a/seed=0", 101.0, Disposition::kPassed, 0.02)});
  const auto& r = only(p);
  EXPECT_EQ(r.ranked, (std::vector<std::string>{"kernelgate_cuda", "aten", "reference"}));
  EXPECT_EQ(r.comparison, "same");
}

TEST(Policy, AnyFailureInTheRegionFailsClosed) {
  for (Disposition bad : {Disposition::kIncorrect, Disposition::kCrashed, Disposition::kTimedOut,
                          Disposition::kOutOfMemory}) {
    auto p = derive_policy({row("fast", "a/seed=0", 1), row("fast", "b/seed=0", 0, bad),
                            row("reference", "a/seed=0", 10), row("reference", "b/seed=0", 10)});
    const auto& r = only(p);
    EXPECT_EQ(r.ranked, std::vector<std::string>{"reference"});
    for (const auto& s : r.standings) {
      if (s.backend == "fast") {
        EXPECT_EQ(s.failures.at(std::string(store::to_string(bad))), 1);
      }
    }
  }
}

TEST(Policy, UntimedPassesProveCorrectnessNotSpeed) {
  auto p = derive_policy(
      {row("validated_only", "a/untimed/seed=0", 0), row("reference", "a/seed=0", 10)});
  EXPECT_EQ(only(p).ranked, std::vector<std::string>{"reference"});
}

TEST(Policy, RegionsAreIndependent) {
  auto p = derive_policy({row("k", "a/seed=0", 1, Disposition::kPassed, 0.005, "r1"),
                          row("k", "b/seed=0", 0, Disposition::kIncorrect, 0.005, "r2"),
                          row("reference", "a/seed=0", 5, Disposition::kPassed, 0.005, "r1"),
                          row("reference", "b/seed=0", 5, Disposition::kPassed, 0.005, "r2")});
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].ranked.front(), "k");
  EXPECT_EQ(p[1].ranked, std::vector<std::string>{"reference"});
}

TEST(Policy, UnsupportedRowsAreNotFailures) {
  auto p = derive_policy(
      {row("gpu_only", "a/seed=0", 0, Disposition::kUnsupported), row("reference", "a/seed=0", 5)});
  EXPECT_EQ(only(p).ranked, std::vector<std::string>{"reference"});
  for (const auto& s : only(p).standings) EXPECT_NE(s.backend, "gpu_only");
}

}  // namespace
}  // namespace kernelgate::harness
