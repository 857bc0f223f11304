// CPU rms_norm kernels against a naive float64 implementation of the contract in rms_norm.h.
// Outputs are poisoned with NaN first, so an element that is not written fails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/rms_norm.h"

namespace kg = kernelgate::kernels;
using kg::DType;

namespace {

// ------------------------------------------------------------ element encode / decode
// Decoding is exact; encoding rounds to nearest even (only used to make inputs, which the
// reference then reads back exactly, so its rounding does not matter for the checks).
double half_to_double(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
  double v;
  if (exp == 0) {
    v = std::ldexp(double(mant), -24);
  } else if (exp == 31) {
    v = mant != 0 ? std::numeric_limits<double>::quiet_NaN()
                  : std::numeric_limits<double>::infinity();
  } else {
    v = std::ldexp(double(1024 + mant), exp - 25);
  }
  return sign != 0 ? -v : v;
}

uint16_t double_to_half(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(v);
  if (std::isnan(v)) return 0x7e00;
  if (a < std::ldexp(1.0, -14)) return sign | uint16_t(std::nearbyint(std::ldexp(a, 24)));
  int e = 0;
  const double f = std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  const int biased = e - 1 + 15;
  if (biased >= 31) return sign | 0x7c00;
  const uint32_t bits = (uint32_t(biased) << 10) + uint32_t(std::nearbyint(f * 2048)) - 1024;
  return sign | uint16_t(bits >= 0x7c00 ? 0x7c00 : bits);  // a carry may round up to inf
}

double bf16_to_double(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t double_to_bf16(double v) {
  const float f = float(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

int elem_size(DType t) { return kg::dtype_size(t); }

// A buffer of `n` elements of dtype t.
struct Buf {
  DType t;
  std::vector<unsigned char> bytes;
  Buf(DType t_, int64_t n) : t(t_), bytes(size_t(n * elem_size(t_)), 0xff) {}  // NaN poison
  void* data() { return bytes.data(); }
  double get(int64_t i) const {
    uint16_t h;
    float f;
    switch (t) {
      case DType::kFloat32: std::memcpy(&f, &bytes[i * 4], 4); return f;
      case DType::kFloat16: std::memcpy(&h, &bytes[i * 2], 2); return half_to_double(h);
      case DType::kBFloat16: std::memcpy(&h, &bytes[i * 2], 2); return bf16_to_double(h);
    }
    return 0;
  }
  void set(int64_t i, double v) {
    uint16_t h;
    float f = float(v);
    switch (t) {
      case DType::kFloat32: std::memcpy(&bytes[i * 4], &f, 4); return;
      case DType::kFloat16:
        h = double_to_half(v);
        std::memcpy(&bytes[i * 2], &h, 2);
        return;
      case DType::kBFloat16:
        h = double_to_bf16(v);
        std::memcpy(&bytes[i * 2], &h, 2);
        return;
    }
  }
};

// Relative half-ulp of the output type (rounding of the result) and the float32 accumulation
// allowance for the sizes tested here.
double out_rel(DType t) {
  return t == DType::kFloat32 ? 0.0 : t == DType::kFloat16 ? 0x1p-11 : 0x1p-8;
}
constexpr double kAccRel = 3e-5;
double abs_floor(DType t) { return t == DType::kFloat16 ? 0x1p-24 : 1e-30; }

// got matches ref: same NaN-ness; fp16 results past the range must be inf; else within tol.
::testing::AssertionResult close(DType t, double got, double ref, double tol) {
  if (std::isnan(ref) || std::isnan(got)) {
    if (std::isnan(ref) && std::isnan(got)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << got << ", expected " << ref;
  }
  if (t == DType::kFloat16 && std::fabs(ref) >= 65520.0) ref = std::copysign(INFINITY, ref);
  if (std::isinf(ref) || std::isinf(got)) {
    if (got == ref) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << got << ", expected " << ref;
  }
  if (std::fabs(got - ref) <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "got " << got << ", expected " << ref << " (tol " << tol << ")";
}

const char* name(DType t) {
  return t == DType::kFloat32 ? "f32" : t == DType::kFloat16 ? "f16" : "bf16";
}

// ------------------------------------------------------------ one problem with its inputs
struct Case {
  DType t = DType::kFloat32;
  int64_t rows = 0, hidden = 0, x_pad = 0, dy_pad = 0;
  double scale = 1.0;
  bool weight = true;

  kg::RmsNormProblem problem() const {
    kg::RmsNormProblem p;
    p.rows = rows;
    p.hidden = hidden;
    p.x_row_stride = hidden + x_pad;
    p.dy_row_stride = hidden + dy_pad;
    p.eps = 1e-6f;
    p.dtype = t;
    return p;
  }
  std::string str() const {
    return std::string(name(t)) + " rows=" + std::to_string(rows) +
           " hidden=" + std::to_string(hidden) + " x_pad=" + std::to_string(x_pad) +
           " scale=" + std::to_string(scale) + (weight ? "" : " no-weight");
  }
};

struct Inputs {
  Buf x, dy, w;
  Inputs(const Case& c, uint32_t seed)
      : x(c.t, std::max<int64_t>(1, c.rows * (c.hidden + c.x_pad))),
        dy(c.t, std::max<int64_t>(1, c.rows * (c.hidden + c.dy_pad))),
        w(c.t, c.hidden) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0), pos(0.5, 1.5);
    // Padding between rows stays NaN: reading it would poison the row.
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t i = 0; i < c.hidden; ++i) {
        x.set(r * (c.hidden + c.x_pad) + i, c.scale * u(rng));
        dy.set(r * (c.hidden + c.dy_pad) + i, u(rng));
      }
    for (int64_t i = 0; i < c.hidden; ++i) w.set(i, (u(rng) < 0 ? -1 : 1) * pos(rng));
  }
  double xv(const Case& c, int64_t r, int64_t i) const {
    return x.get(r * (c.hidden + c.x_pad) + i);
  }
  double dyv(const Case& c, int64_t r, int64_t i) const {
    return dy.get(r * (c.hidden + c.dy_pad) + i);
  }
  double wv(const Case& c, int64_t i) const { return c.weight ? w.get(i) : 1.0; }
};

double ref_rstd(const Case& c, const Inputs& in, int64_t r) {
  double ss = 0;
  for (int64_t i = 0; i < c.hidden; ++i) ss += in.xv(c, r, i) * in.xv(c, r, i);
  return 1.0 / std::sqrt(ss / double(c.hidden) + double(c.problem().eps));
}

// Runs the forward on rows [r0, r1) and checks every row: inside the range against the
// reference, outside still poisoned.
void check_fwd(const Case& c, bool with_rstd, int64_t r0, int64_t r1, uint32_t seed) {
  SCOPED_TRACE(c.str() + " rows [" + std::to_string(r0) + "," + std::to_string(r1) + ")");
  const Inputs in(c, seed);
  Buf y(c.t, std::max<int64_t>(1, c.rows * c.hidden));
  std::vector<float> rstd(size_t(std::max<int64_t>(1, c.rows)), NAN);
  kg::rms_norm_fwd_cpu(y.data(), with_rstd ? rstd.data() : nullptr, in.x.bytes.data(),
                       c.weight ? in.w.bytes.data() : nullptr, c.problem(), r0, r1);
  for (int64_t r = 0; r < c.rows; ++r) {
    const bool inside = r >= r0 && r < r1;
    const double rs = ref_rstd(c, in, r);
    if (with_rstd) {
      if (inside) {
        ASSERT_TRUE(close(DType::kFloat32, rstd[r], rs, kAccRel * std::fabs(rs))) << "row " << r;
      } else {
        ASSERT_TRUE(std::isnan(rstd[r])) << "rstd written outside the range, row " << r;
      }
    }
    for (int64_t i = 0; i < c.hidden; ++i) {
      const double got = y.get(r * c.hidden + i);
      if (!inside) {
        ASSERT_TRUE(std::isnan(got)) << "y written outside the range, row " << r;
        continue;
      }
      const double ref = in.xv(c, r, i) * rs * in.wv(c, i);
      const double tol = (out_rel(c.t) + kAccRel) * std::fabs(ref) + abs_floor(c.t);
      ASSERT_TRUE(close(c.t, got, ref, tol)) << "row " << r << " col " << i;
    }
  }
}

// Backward on rows [r0, r1) with a dweight partial that starts at `dw0` (checks the +=).
void check_bwd(const Case& c, bool with_dw, int64_t r0, int64_t r1, uint32_t seed) {
  SCOPED_TRACE(c.str() + (with_dw ? "" : " no-dweight"));
  const Inputs in(c, seed);
  std::vector<float> rstd(size_t(std::max<int64_t>(1, c.rows)));
  for (int64_t r = 0; r < c.rows; ++r) rstd[r] = float(ref_rstd(c, in, r));
  Buf dx(c.t, std::max<int64_t>(1, c.rows * c.hidden));
  std::vector<float> dw(size_t(c.hidden));
  for (int64_t i = 0; i < c.hidden; ++i) dw[i] = 0.25f * float(i % 7);
  const std::vector<float> dw0 = dw;
  kg::rms_norm_bwd_cpu(dx.data(), with_dw ? dw.data() : nullptr, in.dy.bytes.data(),
                       in.x.bytes.data(), c.weight ? in.w.bytes.data() : nullptr, rstd.data(),
                       c.problem(), r0, r1);
  std::vector<double> dw_ref(size_t(c.hidden), 0.0), dw_mag(size_t(c.hidden), 0.0);
  for (int64_t r = 0; r < c.rows; ++r) {
    const bool inside = r >= r0 && r < r1;
    const double rs = rstd[r];
    double dot = 0, dot_abs = 0;
    for (int64_t i = 0; i < c.hidden; ++i) {
      const double term = in.dyv(c, r, i) * in.wv(c, i) * in.xv(c, r, i) * rs;
      dot += term;
      dot_abs += std::fabs(term);
    }
    const double mean = dot / double(c.hidden), mean_abs = dot_abs / double(c.hidden);
    for (int64_t i = 0; i < c.hidden; ++i) {
      const double got = dx.get(r * c.hidden + i);
      if (!inside) {
        ASSERT_TRUE(std::isnan(got)) << "dx written outside the range, row " << r;
        continue;
      }
      const double xhat = in.xv(c, r, i) * rs, g = in.dyv(c, r, i) * in.wv(c, i);
      const double ref = rs * (g - xhat * mean);
      const double tol =
          out_rel(c.t) * std::fabs(ref) +
          kAccRel * rs * (std::fabs(g) + std::fabs(xhat) * (std::fabs(mean) + mean_abs)) +
          abs_floor(c.t);
      ASSERT_TRUE(close(c.t, got, ref, tol)) << "row " << r << " col " << i;
      dw_ref[i] += in.dyv(c, r, i) * xhat;
      dw_mag[i] += std::fabs(in.dyv(c, r, i) * xhat);
    }
  }
  for (int64_t i = 0; i < c.hidden; ++i) {
    if (!with_dw) break;
    const double ref = dw0[i] + dw_ref[i];
    ASSERT_TRUE(close(DType::kFloat32, dw[i], ref, kAccRel * (dw_mag[i] + dw0[i]) + 1e-30))
        << "dweight col " << i;
  }
}

const DType kTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

TEST(RmsNormCpuKernel, ForwardMatchesFloat64Reference) {
  uint32_t seed = 1;
  for (DType t : kTypes)
    for (int64_t hidden : {1, 3, 8, 127, 4097})
      for (int64_t rows : {1, 37})
        for (int64_t pad : {0, 5})
          for (double scale : {1.0, 1e4, 1e-4})
            for (bool weight : {true, false}) {
              const Case c{t, rows, hidden, pad, 0, scale, weight};
              check_fwd(c, /*with_rstd=*/true, 0, rows, seed++);
              check_fwd(c, /*with_rstd=*/false, 0, rows, seed++);
            }
}

TEST(RmsNormCpuKernel, ForwardWritesOnlyTheRowRange) {
  for (DType t : kTypes) check_fwd(Case{t, 12, 127, 3, 0, 1.0, true}, true, 3, 9, 7);
}

TEST(RmsNormCpuKernel, ZeroRowsTouchesNothing) {
  kg::RmsNormProblem p;
  p.hidden = 127;
  p.x_row_stride = p.dy_row_stride = 127;
  for (DType t : kTypes) {
    p.dtype = t;
    kg::rms_norm_fwd_cpu(nullptr, nullptr, nullptr, nullptr, p, 0, 0);
    kg::rms_norm_bwd_cpu(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, p, 0, 0);
  }
}

TEST(RmsNormCpuKernel, BackwardMatchesFloat64Reference) {
  uint32_t seed = 1000;
  for (DType t : kTypes)
    for (int64_t hidden : {1, 3, 8, 127, 4097})
      for (int64_t rows : {1, 37})
        for (int64_t pad : {0, 5})
          for (double scale : {1.0, 1e4, 1e-4})
            for (bool weight : {true, false}) {
              Case c{t, rows, hidden, pad, pad == 0 ? 0 : 3, scale, weight};
              check_bwd(c, /*with_dw=*/true, 0, rows, seed++);
              check_bwd(c, /*with_dw=*/false, 0, rows, seed++);
            }
}

TEST(RmsNormCpuKernel, BackwardWritesOnlyTheRowRange) {
  for (DType t : kTypes) check_bwd(Case{t, 12, 127, 3, 1, 1.0, true}, true, 3, 9, 11);
}

TEST(RmsNormCpuKernel, LongRows) {
  for (DType t : {DType::kFloat32, DType::kBFloat16}) {
    const Case c{t, 2, int64_t{1} << 20, 0, 0, 1.0, true};
    check_fwd(c, true, 0, 2, 21);
    check_bwd(c, true, 0, 2, 22);
  }
}

// Splitting rows between calls that share one dweight buffer gives bit-identical results.
TEST(RmsNormCpuKernel, DweightOverTwoRangesEqualsOneRange) {
  for (DType t : kTypes) {
    const Case c{t, 29, 4097, 5, 3, 1.0, true};
    const Inputs in(c, 31);
    std::vector<float> rstd(size_t(c.rows));
    for (int64_t r = 0; r < c.rows; ++r) rstd[r] = float(ref_rstd(c, in, r));
    Buf dx1(t, c.rows * c.hidden), dx2(t, c.rows * c.hidden);
    std::vector<float> dw1(size_t(c.hidden), 0.f), dw2(size_t(c.hidden), 0.f);
    const auto p = c.problem();
    kg::rms_norm_bwd_cpu(dx1.data(), dw1.data(), in.dy.bytes.data(), in.x.bytes.data(),
                         in.w.bytes.data(), rstd.data(), p, 0, c.rows);
    kg::rms_norm_bwd_cpu(dx2.data(), dw2.data(), in.dy.bytes.data(), in.x.bytes.data(),
                         in.w.bytes.data(), rstd.data(), p, 0, 11);
    kg::rms_norm_bwd_cpu(dx2.data(), dw2.data(), in.dy.bytes.data(), in.x.bytes.data(),
                         in.w.bytes.data(), rstd.data(), p, 11, c.rows);
    EXPECT_EQ(std::memcmp(dw1.data(), dw2.data(), dw1.size() * 4), 0) << name(t);
    EXPECT_EQ(dx1.bytes, dx2.bytes) << name(t);
  }
}

// A NaN or Inf in a row spreads through that row as the float math does; other rows are fine.
TEST(RmsNormCpuKernel, SpecialValuesPropagateWithinTheirRow) {
  for (DType t : kTypes) {
    const Case c{t, 4, 127, 0, 0, 1.0, true};
    const kg::RmsNormProblem p = c.problem();
    Inputs in(c, 41);
    in.x.set(1 * 127 + 5, NAN);
    in.x.set(2 * 127 + 9, INFINITY);
    in.x.set(3 * 127 + 0, -INFINITY);
    Buf y(t, c.rows * c.hidden);
    std::vector<float> rstd(size_t(c.rows));
    kg::rms_norm_fwd_cpu(y.data(), rstd.data(), in.x.bytes.data(), in.w.bytes.data(), p, 0, 4);
    for (int64_t r = 0; r < c.rows; ++r) {
      const double rs = ref_rstd(c, in, r);  // NaN, 0, 0 for rows 1..3
      EXPECT_TRUE(close(DType::kFloat32, rstd[r], rs, kAccRel * std::fabs(rs))) << name(t) << r;
      for (int64_t i = 0; i < c.hidden; ++i) {
        const double ref = in.xv(c, r, i) * rs * in.wv(c, i);
        const double tol = (out_rel(t) + kAccRel) * std::fabs(ref) + abs_floor(t);
        ASSERT_TRUE(close(t, y.get(r * c.hidden + i), ref, tol)) << name(t) << " " << r << "," << i;
      }
    }
  }
}

// fp16 results beyond its range round to inf (not clamp, not NaN).
TEST(RmsNormCpuKernel, Float16OverflowRoundsToInf) {
  const Case c{DType::kFloat16, 1, 4, 0, 0, 1.0, true};
  Inputs in(c, 51);
  const double xs[4] = {2, 0, 0, 0}, ws[4] = {60000, -60000, 1, 1};
  for (int i = 0; i < 4; ++i) {
    in.x.set(i, xs[i]);
    in.w.set(i, ws[i]);
  }
  Buf y(c.t, 4);
  kg::rms_norm_fwd_cpu(y.data(), nullptr, in.x.bytes.data(), in.w.bytes.data(), c.problem(), 0, 1);
  EXPECT_EQ(y.get(0), INFINITY);  // 2 * ~1 * 60000
  EXPECT_EQ(y.get(1), 0.0);
}

}  // namespace
