// rms_norm CPU kernels (contract in rms_norm.h). Plain C++: rows are converted to float a chunk
// at a time into stack buffers so the arithmetic loops are simple enough for gcc to vectorise.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/rms_norm.h"

// Function multiversioning needs gcc's ifunc support (x86-64 ELF); elsewhere: one version.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KG_RMS_NORM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KG_RMS_NORM_CLONES
#endif

namespace kernelgate::kernels {
namespace {

constexpr int64_t kChunk = 512;  // floats per stack buffer
constexpr int kLanes = 16;       // independent partial sums: a fixed order gcc can vectorise

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

struct Bf16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline float to_float(Bf16 v) { return bits_to_float(uint32_t(v.bits) << 16); }
// Branch-free fp16 -> fp32 (normals rescaled by 2^-112; subnormals via a magic-number subtract).
inline float to_float(Half v) {
  const uint32_t w = uint32_t(v.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t mag = two_w < (1u << 27) ? float_to_bits(denormalized) : float_to_bits(normalized);
  return bits_to_float(sign | mag);
}

template <class T>
T from_float(float f);
template <>
inline float from_float<float>(float f) {
  return f;
}
// Round to nearest even; NaN stays NaN (quiet bit set, sign kept); overflow rounds to inf.
template <>
inline Bf16 from_float<Bf16>(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40u)};
  return {uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
// Round to nearest even through float arithmetic: scaling by 2^112 then 2^-110 sends values
// past the fp16 range to inf; adding a power of two aligned to the result's exponent makes
// the FPU round the mantissa to 10 bits. Both products are exact, so contraction into an
// fma cannot change the result.
template <>
inline Half from_float<Half>(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return {uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}

template <class T>
inline void load(float* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}
template <class T>
inline void load_weight(float* dst, const T* w, int64_t n) {
  if (w == nullptr) {
    std::fill(dst, dst + n, 1.f);
  } else {
    load(dst, w, n);
  }
}

// Sum of a[i] * b[i] over one chunk into kLanes partial sums (n may be any length).
inline void dot_lanes(float (&acc)[kLanes], const float* a, const float* b, int64_t n) {
  const int64_t whole = n - n % kLanes;
  for (int64_t i = 0; i < whole; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  for (int64_t i = whole; i < n; ++i) acc[i - whole] += a[i] * b[i];
}

inline float sum_lanes(const float (&acc)[kLanes]) {
  float s[kLanes / 2];
  for (int j = 0; j < kLanes / 2; ++j) s[j] = acc[j] + acc[j + kLanes / 2];
  for (int w = kLanes / 4; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) s[j] += s[j + w];
  return s[0];
}

template <class T>
[[gnu::always_inline]] inline void fwd_rows(T* y, float* rstd, const T* x, const T* weight,
                                            const RmsNormProblem& p, int64_t r0, int64_t r1) {
  const int64_t h = p.hidden;
  float xb[kChunk], wb[kChunk];
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * p.x_row_stride;
    float acc[kLanes] = {};
    for (int64_t c0 = 0; c0 < h; c0 += kChunk) {
      const int64_t n = std::min(kChunk, h - c0);
      load(xb, xr + c0, n);
      dot_lanes(acc, xb, xb, n);
    }
    const float rs = 1.f / std::sqrt(sum_lanes(acc) / float(h) + p.eps);
    if (rstd != nullptr) rstd[r] = rs;
    T* yr = y + r * h;
    for (int64_t c0 = 0; c0 < h; c0 += kChunk) {
      const int64_t n = std::min(kChunk, h - c0);
      load(xb, xr + c0, n);
      load_weight(wb, weight == nullptr ? nullptr : weight + c0, n);
      for (int64_t i = 0; i < n; ++i) yr[c0 + i] = from_float<T>(xb[i] * rs * wb[i]);
    }
  }
}

template <class T>
[[gnu::always_inline]] inline void bwd_rows(T* dx, float* dw, const T* dy, const T* x,
                                            const T* weight, const float* rstd,
                                            const RmsNormProblem& p, int64_t r0, int64_t r1) {
  const int64_t h = p.hidden;
  float xb[kChunk], gb[kChunk], wb[kChunk];
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * p.x_row_stride;
    const T* dyr = dy + r * p.dy_row_stride;
    const float rs = rstd[r];
    float acc[kLanes] = {};
    for (int64_t c0 = 0; c0 < h; c0 += kChunk) {  // acc = sum(g * xhat)
      const int64_t n = std::min(kChunk, h - c0);
      load(xb, xr + c0, n);
      load(gb, dyr + c0, n);
      load_weight(wb, weight == nullptr ? nullptr : weight + c0, n);
      for (int64_t i = 0; i < n; ++i) {
        gb[i] = gb[i] * wb[i];
        xb[i] = xb[i] * rs;
      }
      dot_lanes(acc, gb, xb, n);
    }
    const float mean = sum_lanes(acc) / float(h);
    T* dxr = dx + r * h;
    for (int64_t c0 = 0; c0 < h; c0 += kChunk) {
      const int64_t n = std::min(kChunk, h - c0);
      load(xb, xr + c0, n);
      load(gb, dyr + c0, n);
      load_weight(wb, weight == nullptr ? nullptr : weight + c0, n);
      for (int64_t i = 0; i < n; ++i) {
        const float xhat = xb[i] * rs;
        dxr[c0 + i] = from_float<T>(rs * (gb[i] * wb[i] - xhat * mean));
      }
      if (dw != nullptr)
        for (int64_t i = 0; i < n; ++i) dw[c0 + i] += gb[i] * (xb[i] * rs);
    }
  }
}

// One non-template entry per dtype, so target_clones sees plain functions.
#define KG_RMS_NORM_CPU_ENTRIES(T, NAME)                                                         \
  KG_RMS_NORM_CLONES void fwd_##NAME(void* y, float* rstd, const void* x, const void* w,         \
                                     const RmsNormProblem& p, int64_t r0, int64_t r1) {          \
    fwd_rows<T>(static_cast<T*>(y), rstd, static_cast<const T*>(x), static_cast<const T*>(w), p, \
                r0, r1);                                                                         \
  }                                                                                              \
  KG_RMS_NORM_CLONES void bwd_##NAME(void* dx, float* dw, const void* dy, const void* x,         \
                                     const void* w, const float* rstd, const RmsNormProblem& p,  \
                                     int64_t r0, int64_t r1) {                                   \
    bwd_rows<T>(static_cast<T*>(dx), dw, static_cast<const T*>(dy), static_cast<const T*>(x),    \
                static_cast<const T*>(w), rstd, p, r0, r1);                                      \
  }
KG_RMS_NORM_CPU_ENTRIES(float, f32)
KG_RMS_NORM_CPU_ENTRIES(Half, f16)
KG_RMS_NORM_CPU_ENTRIES(Bf16, bf16)
#undef KG_RMS_NORM_CPU_ENTRIES

}  // namespace

void rms_norm_fwd_cpu(void* y, float* rstd, const void* x, const void* weight,
                      const RmsNormProblem& p, int64_t row_begin, int64_t row_end) {
  if (row_begin >= row_end || p.hidden < 1) return;
  switch (p.dtype) {
    case DType::kFloat32: return fwd_f32(y, rstd, x, weight, p, row_begin, row_end);
    case DType::kFloat16: return fwd_f16(y, rstd, x, weight, p, row_begin, row_end);
    case DType::kBFloat16: return fwd_bf16(y, rstd, x, weight, p, row_begin, row_end);
  }
}

void rms_norm_bwd_cpu(void* dx, float* dweight_partial, const void* dy, const void* x,
                      const void* weight, const float* rstd, const RmsNormProblem& p,
                      int64_t row_begin, int64_t row_end) {
  if (row_begin >= row_end || p.hidden < 1) return;
  switch (p.dtype) {
    case DType::kFloat32:
      return bwd_f32(dx, dweight_partial, dy, x, weight, rstd, p, row_begin, row_end);
    case DType::kFloat16:
      return bwd_f16(dx, dweight_partial, dy, x, weight, rstd, p, row_begin, row_end);
    case DType::kBFloat16:
      return bwd_bf16(dx, dweight_partial, dy, x, weight, rstd, p, row_begin, row_end);
  }
}

}  // namespace kernelgate::kernels
