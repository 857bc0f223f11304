#include "harness/stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <utility>

namespace kernelgate::harness {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kConfidenceMiss = 0.05;  // 1 - the confidence level of the median's interval

// The largest k >= 1 with 2 * P[Binomial(n, 1/2) <= k - 1] <= kConfidenceMiss, or 1 if none; see
// Summary::rel_noise. The pmf is walked upwards in log space (2^-n underflows), starting 8
// standard deviations below the mean, where the tail left out is below 1e-15: O(sqrt(n)) steps.
int median_ci_rank(int n) {
  const double sd = std::sqrt(n) / 2;
  int i = std::max(0, static_cast<int>(std::floor(n / 2.0 - 8 * sd)));
  double log_pmf =
      std::lgamma(n + 1.0) - std::lgamma(i + 1.0) - std::lgamma(n - i + 1.0) - n * std::log(2.0);
  double cdf = 0;
  int k = 1;
  for (; i < n / 2; ++i) {
    cdf += std::exp(log_pmf);  // now P[B <= i]
    if (2 * cdf > kConfidenceMiss) break;
    k = i + 1;
    log_pmf += std::log(static_cast<double>(n - i)) - std::log(i + 1.0);
  }
  return k;
}

// Linear interpolation between order statistics (numpy's default); x sorted, non-empty.
double quantile(const std::vector<double>& x, double q) {
  const double position = q * static_cast<double>(x.size() - 1);
  const size_t below = static_cast<size_t>(std::floor(position));
  if (below + 1 >= x.size()) return x.back();
  return x[below] + (position - static_cast<double>(below)) * (x[below + 1] - x[below]);
}

Summary summarize_sorted(const std::vector<double>& x) {
  Summary s;
  s.n = static_cast<int>(x.size());
  if (x.empty()) return s;
  s.median = quantile(x, 0.5);
  s.p10 = quantile(x, 0.1);
  s.p90 = quantile(x, 0.9);
  s.min = x.front();
  s.max = x.back();
  s.mean = std::accumulate(x.begin(), x.end(), 0.0) / s.n;
  const int k = median_ci_rank(s.n);
  s.ci_low = x[k - 1];
  s.ci_high = x[s.n - k];
  const double width = s.ci_high - s.ci_low;
  if (s.n == 1) {
    s.rel_noise = kInf;
  } else if (s.median == 0) {
    s.rel_noise = width == 0 ? 0 : kInf;
  } else {
    s.rel_noise = width / (2 * std::fabs(s.median));
  }
  return s;
}

std::string percent(double fraction) {
  if (!std::isfinite(fraction)) return "unknown";
  char text[32];
  std::snprintf(text, sizeof text, "%.1f%%", 100 * fraction);
  return text;
}

}  // namespace

Summary summarize(std::vector<double> samples) {
  samples.erase(
      std::remove_if(samples.begin(), samples.end(), [](double v) { return !std::isfinite(v); }),
      samples.end());
  std::sort(samples.begin(), samples.end());
  return summarize_sorted(samples);
}

Sampler::Sampler(SamplingPolicy policy) : policy_(policy) {}

void Sampler::add(double sample_us) {
  if (!std::isfinite(sample_us)) return;
  sorted_.insert(std::upper_bound(sorted_.begin(), sorted_.end(), sample_us), sample_us);
  total_us_ += sample_us;
  summary_ = summarize_sorted(sorted_);
}

bool Sampler::done() const { return !stop_reason().empty(); }

std::string Sampler::stop_reason() const {
  const int n = summary_.n;
  const std::string noise = percent(summary_.rel_noise);
  const std::string samples = " after " + std::to_string(n) + " samples";
  if (n >= policy_.min_samples && summary_.rel_noise <= policy_.target_rel_noise) {
    return "noise " + noise + " <= " + percent(policy_.target_rel_noise) + samples;
  }
  if (n >= policy_.max_samples) {
    return "max samples " + std::to_string(policy_.max_samples) + " reached with noise " + noise;
  }
  if (total_us_ * 1e-6 >= policy_.time_cap_s) {
    char cap[32];
    std::snprintf(cap, sizeof cap, "%.1f s", policy_.time_cap_s);
    return std::string("time cap ") + cap + " reached with noise " + noise + samples;
  }
  return "";
}

Comparison compare(const Summary& a, const Summary& b) {
  if (a.n == 0 || b.n == 0) return Comparison::kSame;
  const double scale = std::max(a.median, b.median);
  if (!(scale > 0)) return Comparison::kSame;  // also NaN: no evidence either way
  const bool intervals_overlap = a.ci_low <= b.ci_high && b.ci_low <= a.ci_high;
  const double relative_difference = std::fabs(a.median - b.median) / scale;
  if (intervals_overlap || !(relative_difference > std::max(a.rel_noise, b.rel_noise))) {
    return Comparison::kSame;
  }
  return a.median < b.median ? Comparison::kFaster : Comparison::kSlower;
}

std::string to_string(Comparison comparison) {
  switch (comparison) {
    case Comparison::kFaster: return "faster";
    case Comparison::kSlower: return "slower";
    case Comparison::kSame: return "same";
  }
  return "unknown";
}

}  // namespace kernelgate::harness
