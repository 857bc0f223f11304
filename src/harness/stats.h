// Timing statistics: pure functions over samples, tested on synthetic data (STYLE.md 9; after
// nvbench's stdrel criterion and nvbench_compare). No assumption about the distribution: timings
// are skewed and heavy-tailed, so everything rests on order statistics.
#pragma once
#include <limits>
#include <string>
#include <vector>

namespace kernelgate::harness {

struct Summary {
  static constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  // Percentiles interpolate linearly between order statistics (numpy's default): with x sorted
  // and 0-based, the q-quantile is x[q * (n - 1)], a fractional index interpolated.
  double median = kNaN, p10 = kNaN, p90 = kNaN, min = kNaN, max = kNaN, mean = kNaN;
  int n = 0;
  // rel_noise = (ci_high - ci_low) / (2 * median): the relative half-width of the ~95% confidence
  // interval of the median [ci_low, ci_high] = [x(k), x(n+1-k)] (1-based order statistics), where
  // k is the largest rank with 2 * P[Binomial(n, 1/2) <= k - 1] <= 0.05. The interval then covers
  // the true median with probability >= 95% whatever the distribution. For n <= 5 no rank
  // reaches 95% and k = 1 (min..max, coverage 1 - 2^(1-n)). rel_noise is +inf for n == 1 (one
  // sample says nothing about noise) and NaN for n == 0.
  double rel_noise = kNaN;
  double ci_low = kNaN, ci_high = kNaN;
};

// Samples in any order; non-finite ones are ignored (not counted in n). Never throws.
Summary summarize(std::vector<double> samples);

struct SamplingPolicy {
  int min_samples = 10;
  int max_samples = 1000;
  double target_rel_noise = 0.01;
  double time_cap_s = 2.0;
};

// Collects timing samples (durations in microseconds) until the median is known well enough.
// done() at the first of, checked in this order:
//   noise:    n >= min_samples and rel_noise <= target_rel_noise;
//   max:      n >= max_samples;
//   time cap: the samples add up to >= time_cap_s.
class Sampler {
 public:
  explicit Sampler(SamplingPolicy policy);
  void add(double sample_us);  // non-finite samples are ignored
  bool done() const;
  // Why done() holds, e.g. "noise 0.8% <= 1.0% after 37 samples", "max samples 1000 reached with
  // noise 3.1%", "time cap 2.0 s reached with noise 3.1% after 120 samples"; "" while not done.
  std::string stop_reason() const;
  Summary summary() const { return summary_; }

 private:
  SamplingPolicy policy_;
  std::vector<double> sorted_;  // kept sorted, so that each add is O(n) rather than a sort
  double total_us_ = 0;
  Summary summary_;
};

// Tri-state comparison of `a` relative to `b` (lower time is faster). The rule:
//   kSame   if either has no samples, or the medians' confidence intervals overlap, or the
//           relative difference |a.median - b.median| / max(a.median, b.median) is at most
//           max(a.rel_noise, b.rel_noise);
//   else    kFaster if a.median < b.median, kSlower otherwise.
// The rule is symmetric in a and b, so compare(a, b) == kFaster exactly when compare(b, a) ==
// kSlower; and a difference within either side's noise is always kSame, so noise alone never
// flips a policy.
enum class Comparison { kFaster, kSlower, kSame };
Comparison compare(const Summary& a, const Summary& b);
std::string to_string(Comparison comparison);  // "faster", "slower", "same"

}  // namespace kernelgate::harness
