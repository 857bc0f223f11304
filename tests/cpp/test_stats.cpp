// Statistics on synthetic data: exact order statistics on small sets, noise that shrinks with n,
// Sampler stopping rules, and a tri-state comparison that does not flip on noise.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "harness/stats.h"

namespace kernelgate::harness {
namespace {

std::vector<double> normal_samples(int n, double mean, double sd, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(mean, sd);
  std::vector<double> x(n);
  for (double& v : x) v = dist(rng);
  return x;
}

std::vector<double> iota_samples(int n) {  // n, n-1, ..., 1: order must not matter
  std::vector<double> x;
  for (int i = n; i >= 1; --i) x.push_back(i);
  return x;
}

TEST(Summarize, ExactOrderStatisticsOnSmallSets) {
  const Summary odd = summarize({3, 1, 2});
  EXPECT_EQ(odd.n, 3);
  EXPECT_DOUBLE_EQ(odd.median, 2);
  EXPECT_DOUBLE_EQ(odd.min, 1);
  EXPECT_DOUBLE_EQ(odd.max, 3);
  EXPECT_DOUBLE_EQ(odd.mean, 2);
  EXPECT_DOUBLE_EQ(summarize({4, 1, 3, 2}).median, 2.5);

  const Summary eleven = summarize(iota_samples(11));  // positions 1.0 and 9.0: exact elements
  EXPECT_DOUBLE_EQ(eleven.p10, 2);
  EXPECT_DOUBLE_EQ(eleven.p90, 10);
  const Summary ten = summarize(iota_samples(10));  // positions 0.9 and 8.1: interpolated
  EXPECT_DOUBLE_EQ(ten.p10, 1.9);
  EXPECT_DOUBLE_EQ(ten.p90, 9.1);
  EXPECT_DOUBLE_EQ(ten.mean, 5.5);
}

TEST(Summarize, MedianIntervalUsesBinomialRanks) {
  // n = 10: 2 * P[B <= 1] = 22/1024 <= 0.05 < 2 * P[B <= 2] = 112/1024, so [x(2), x(9)].
  const Summary ten = summarize(iota_samples(10));
  EXPECT_DOUBLE_EQ(ten.ci_low, 2);
  EXPECT_DOUBLE_EQ(ten.ci_high, 9);
  EXPECT_DOUBLE_EQ(ten.rel_noise, (9.0 - 2.0) / (2 * 5.5));
  // n = 20: the textbook ranks 6 and 15.
  const Summary twenty = summarize(iota_samples(20));
  EXPECT_DOUBLE_EQ(twenty.ci_low, 6);
  EXPECT_DOUBLE_EQ(twenty.ci_high, 15);
  // n = 5: no rank reaches 95%, so the widest one: min..max.
  const Summary five = summarize(iota_samples(5));
  EXPECT_DOUBLE_EQ(five.ci_low, 1);
  EXPECT_DOUBLE_EQ(five.ci_high, 5);
  EXPECT_DOUBLE_EQ(five.rel_noise, 4.0 / 6.0);
  // n = 6 is the first with 95%: 2 / 64 <= 0.05; still min..max.
  EXPECT_DOUBLE_EQ(summarize(iota_samples(6)).ci_low, 1);
}

TEST(Summarize, DegenerateInputsNeverThrow) {
  const Summary empty = summarize({});
  EXPECT_EQ(empty.n, 0);
  EXPECT_TRUE(std::isnan(empty.median));
  EXPECT_TRUE(std::isnan(empty.p10));
  EXPECT_TRUE(std::isnan(empty.rel_noise));
  const Summary one = summarize({7});
  EXPECT_EQ(one.n, 1);
  EXPECT_DOUBLE_EQ(one.median, 7);
  EXPECT_TRUE(std::isinf(one.rel_noise));
  const Summary with_nan = summarize({NAN, 1, INFINITY, 3});
  EXPECT_EQ(with_nan.n, 2);
  EXPECT_DOUBLE_EQ(with_nan.median, 2);
  EXPECT_DOUBLE_EQ(summarize({5, 5, 5}).rel_noise, 0);
}

TEST(Summarize, NoiseShrinksAsSamplesGrow) {
  double previous = INFINITY;
  for (int n : {10, 100, 1000, 10000}) {
    const Summary s = summarize(normal_samples(n, 100, 5, 42));
    // Expected about 1.96 * 1.25 * (5 / 100) / sqrt(n): roughly 0.039, 0.012, 0.0039, 0.0012.
    EXPECT_LT(s.rel_noise, previous / 2) << n;
    EXPECT_LT(s.rel_noise, 0.3 / std::sqrt(n)) << n;
    previous = s.rel_noise;
  }
}

TEST(Sampler, StopsOnNoiseForQuietData) {
  Sampler sampler(SamplingPolicy{});
  int added = 0;
  for (double v : normal_samples(1000, 100, 0.5, 7)) {
    if (sampler.done()) break;
    sampler.add(v);
    ++added;
  }
  ASSERT_TRUE(sampler.done());
  EXPECT_GE(added, 10);
  EXPECT_LT(added, 1000);
  EXPECT_LE(sampler.summary().rel_noise, 0.01);
  EXPECT_EQ(sampler.stop_reason().rfind("noise ", 0), 0u) << sampler.stop_reason();
}

TEST(Sampler, ConstantDataStopsExactlyAtMinSamples) {
  Sampler sampler(SamplingPolicy{});
  for (int i = 0; i < 9; ++i) sampler.add(50);
  EXPECT_FALSE(sampler.done());
  EXPECT_EQ(sampler.stop_reason(), "");
  sampler.add(50);
  EXPECT_TRUE(sampler.done());
  EXPECT_EQ(sampler.stop_reason(), "noise 0.0% <= 1.0% after 10 samples");
}

TEST(Sampler, StopsAtMaxSamplesForNoisyData) {
  Sampler sampler(SamplingPolicy{.max_samples = 50, .time_cap_s = 1e9});
  std::mt19937_64 rng(3);
  std::lognormal_distribution<double> heavy(std::log(100.0), 1.0);
  int added = 0;
  while (!sampler.done()) {
    sampler.add(heavy(rng));
    ++added;
  }
  EXPECT_EQ(added, 50);
  EXPECT_EQ(sampler.stop_reason().rfind("max samples 50 reached with noise ", 0), 0u)
      << sampler.stop_reason();
}

TEST(Sampler, StopsAtTheTimeCap) {
  Sampler sampler(SamplingPolicy{.time_cap_s = 0.5});
  std::mt19937_64 rng(5);
  std::lognormal_distribution<double> heavy(std::log(100000.0), 1.0);  // ~0.1 s each, very noisy
  double total_s = 0, total_before_last = 0;
  while (!sampler.done()) {
    const double v = heavy(rng);
    total_before_last = total_s;
    sampler.add(v);
    total_s += v * 1e-6;
  }
  EXPECT_LT(total_before_last, 0.5);  // stopped at the first sample that reached the cap
  EXPECT_GE(total_s, 0.5);
  EXPECT_EQ(sampler.stop_reason().rfind("time cap 0.5 s reached with noise ", 0), 0u)
      << sampler.stop_reason();
}

TEST(Sampler, IgnoresNonFiniteSamples) {
  Sampler sampler(SamplingPolicy{});
  sampler.add(NAN);
  sampler.add(INFINITY);
  EXPECT_EQ(sampler.summary().n, 0);
  EXPECT_FALSE(sampler.done());
}

TEST(Compare, SameDistributionIsSame) {
  int flips = 0;
  for (unsigned seed = 0; seed < 100; ++seed) {
    const Summary a = summarize(normal_samples(100, 100, 1, 2 * seed));
    const Summary b = summarize(normal_samples(100, 100, 1, 2 * seed + 1));
    if (compare(a, b) != Comparison::kSame) ++flips;
  }
  EXPECT_LE(flips, 10);
}

TEST(Compare, ClearlyShiftedIsFasterOrSlower) {
  for (unsigned seed = 0; seed < 20; ++seed) {
    const Summary fast = summarize(normal_samples(30, 90, 0.9, 2 * seed));
    const Summary slow = summarize(normal_samples(30, 100, 1.0, 2 * seed + 1));
    EXPECT_EQ(compare(fast, slow), Comparison::kFaster) << seed;
    EXPECT_EQ(compare(slow, fast), Comparison::kSlower) << seed;
  }
}

TEST(Compare, IsAntisymmetric) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> shift(0.95, 1.05);
  for (unsigned seed = 0; seed < 200; ++seed) {
    const Summary a = summarize(normal_samples(20 + seed % 50, 100, 2, 2 * seed));
    const Summary b = summarize(normal_samples(20 + seed % 30, 100 * shift(rng), 2, 2 * seed + 1));
    const Comparison ab = compare(a, b), ba = compare(b, a);
    EXPECT_EQ(ab == Comparison::kFaster, ba == Comparison::kSlower) << seed;
    EXPECT_EQ(ab == Comparison::kSame, ba == Comparison::kSame) << seed;
  }
}

TEST(Compare, NoEvidenceIsSame) {
  const Summary some = summarize({1, 2, 3});
  EXPECT_EQ(compare(Summary{}, some), Comparison::kSame);
  EXPECT_EQ(compare(some, Summary{}), Comparison::kSame);
  EXPECT_EQ(compare(summarize({1}), summarize({100})), Comparison::kSame);  // one sample each
}

TEST(Compare, Names) {
  EXPECT_EQ(to_string(Comparison::kFaster), "faster");
  EXPECT_EQ(to_string(Comparison::kSlower), "slower");
  EXPECT_EQ(to_string(Comparison::kSame), "same");
}

}  // namespace
}  // namespace kernelgate::harness
