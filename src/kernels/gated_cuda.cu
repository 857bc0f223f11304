// Gated activation CUDA kernels (contract in gated.h).
//
// One elementwise kernel serves both directions: a grid-stride loop over accesses of W
// elements, W = one 16-byte vector when every pointer is 16-byte aligned (else 1). Each thread
// loads U accesses of every input before using any, so U * inputs loads are in flight per
// thread; elements past the last whole vector are done as scalars by block 0.
//
// Math is float32 and stays accurate under --use_fast_math (expf becomes __expf, division
// becomes approximate):
//  * sigmoid_pair gives sigmoid(z) and 1 - sigmoid(z) from e = exp(-|z|) <= 1, so nothing
//    overflows or cancels for finite z: silu(-100) = -0, never inf / inf.
//  * 1 + tanh(u) = 2 sigmoid(2u): the tanh GELU needs no tanhf (approximate under fast math)
//    and does not cancel for negative gates.
//  * Phi(g) = (1 + erf(g / sqrt(2))) / 2, as PyTorch computes it: accurate to ~6e-8 absolute,
//    not relative, for g << 0. erfcf(-g / sqrt(2)) / 2 would be, but costs three times erff
//    (~70 instructions) and would make the bf16 GEGLU forward compute-bound.
// Infinite gates follow the formulas, as PyTorch's float64 ops do: act(+inf) = +inf,
// act(-inf) = NaN (-inf * 0), act'(+-inf) = NaN; NaN propagates.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/gated.h"
#include "kernels/vec16.cuh"

namespace kernelgate::kernels {
namespace gated_detail {

constexpr int kThreads = 256;
// Grid cap: 32 blocks per SM of an H100 / H200 (132 SMs), several waves of resident blocks;
// the grid-stride loop gives every block the same number of tiles, give or take one.
constexpr int64_t kMaxBlocks = 132 * 32;
constexpr int64_t kMaxGrid = int64_t{1} << 30;

// ---------------------------------------------------------------- activations
constexpr float kSqrtHalf = 0.70710678118654752f;    // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;  // 1 / sqrt(2 pi)
constexpr float kTanhK2 = 1.5957691216057308f;       // 2 sqrt(2 / pi)
constexpr float kTanhC2 = kTanhK2 * 0.044715f;

// sigmoid(z), 1 - sigmoid(z)
struct SigmoidPair {
  float s, sm;
};
// act(g), act'(g)
struct ActGrad {
  float a, da;
};

__host__ __device__ __forceinline__ SigmoidPair sigmoid_pair(float z) {
  const float e = expf(-fabsf(z));
  const float r = 1.f / (1.f + e);
  return z >= 0.f ? SigmoidPair{r, e * r} : SigmoidPair{e * r, r};
}

// The forward uses only .a; the compiler drops the derivative there.
template <GatedActivation A>
__host__ __device__ __forceinline__ ActGrad act_grad(float g) {
  if constexpr (A == GatedActivation::kSilu) {
    const SigmoidPair p = sigmoid_pair(g);
    return {g * p.s, p.s * (1.f + g * p.sm)};
  } else if constexpr (A == GatedActivation::kGeluErf) {
    const float cdf = fmaf(0.5f, erff(kSqrtHalf * g), 0.5f);
    return {g * cdf, cdf + g * (kInvSqrt2Pi * expf(-0.5f * g * g))};
  } else {
    // gelu = g sigmoid(z), z = 2 sqrt(2/pi) (g + 0.044715 g^3); gelu' = s + g s (1 - s) z'.
    // z' caps g^2 so that a huge finite gate (g^2 = inf) gives 0 * finite, not 0 * inf: 1 - s
    // (or s) is already 0 long before the cap matters.
    const float g2 = g * g;
    const SigmoidPair p = sigmoid_pair(g * fmaf(kTanhC2, g2, kTanhK2));
    const float dz = fmaf(3.f * kTanhC2, fminf(g2, 1e30f), kTanhK2);
    return {g * p.s, p.s + g * p.s * p.sm * dz};
  }
}

// Elementwise ops: kOut outputs from kIn inputs, destination first.
template <GatedActivation A>
struct GatedFwd {
  static constexpr int kOut = 1, kIn = 2;  // out; gate, up
  __device__ __forceinline__ static void apply(float (&o)[kOut], const float (&x)[kIn]) {
    o[0] = act_grad<A>(x[0]).a * x[1];
  }
};
template <GatedActivation A>
struct GatedBwd {
  static constexpr int kOut = 2, kIn = 3;  // dgate, dup; dy, gate, up
  __device__ __forceinline__ static void apply(float (&o)[kOut], const float (&x)[kIn]) {
    const ActGrad r = act_grad<A>(x[1]);
    o[0] = x[0] * x[2] * r.da;
    o[1] = x[0] * r.a;
  }
};

// ---------------------------------------------------------------- element access
using vec::from_float;
using vec::to_float;

template <class T>
constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector

// W elements of T as loaded: one T (W == 1) or a 16-byte vector.
template <class T, int W>
using Raw = std::conditional_t<W == 1, T, uint4>;

template <class T, int W>
__device__ __forceinline__ Raw<T, W> load(const T* p) {
  if constexpr (W == 1) {
    return __ldg(p);
  } else {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
}

template <class T, int W>
__device__ __forceinline__ void unpack(const Raw<T, W>& v, float (&f)[W]) {
  if constexpr (W == 1) {
    f[0] = to_float(v);
  } else {
    vec::unpack<T>(v, f);
  }
}

template <class T, int W>
__device__ __forceinline__ void store(T* p, const float (&f)[W]) {
  if constexpr (W == 1) {
    *p = from_float<T>(f[0]);
  } else {
    *reinterpret_cast<uint4*>(p) = vec::pack<T>(f);
  }
}

// ---------------------------------------------------------------- kernel
template <class T, class Op>
struct Tensors {
  T* out[Op::kOut];
  const T* in[Op::kIn];
};

// Applies Op to the W elements of access `a` (elements a * W ...), given its loaded inputs.
template <class T, class Op, int W>
__device__ __forceinline__ void apply_store(const Tensors<T, Op>& t, int64_t a,
                                            const Raw<T, W> (&raw)[Op::kIn]) {
  float x[Op::kIn][W], y[Op::kOut][W];
#pragma unroll
  for (int j = 0; j < Op::kIn; ++j) unpack<T, W>(raw[j], x[j]);
#pragma unroll
  for (int e = 0; e < W; ++e) {
    float xe[Op::kIn], ye[Op::kOut];
#pragma unroll
    for (int j = 0; j < Op::kIn; ++j) xe[j] = x[j][e];
    Op::apply(ye, xe);
#pragma unroll
    for (int j = 0; j < Op::kOut; ++j) y[j][e] = ye[j];
  }
#pragma unroll
  for (int j = 0; j < Op::kOut; ++j) store<T, W>(t.out[j] + a * W, y[j]);
}

// W > 1 needs every pointer 16-byte aligned.
template <class T, class Op, int W, int U>
__global__ void __launch_bounds__(kThreads) gated_grid_stride(Tensors<T, Op> t, int64_t n) {
  const int64_t accesses = n / W;
  const int64_t tile = int64_t(U) * kThreads;
  for (int64_t base = int64_t(blockIdx.x) * tile + threadIdx.x; base < accesses;
       base += int64_t(gridDim.x) * tile) {
    Raw<T, W> raw[U][Op::kIn];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int64_t a = base + k * kThreads;
#pragma unroll
      for (int j = 0; j < Op::kIn; ++j)
        if (a < accesses) raw[k][j] = load<T, W>(t.in[j] + a * W);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int64_t a = base + k * kThreads;
      if (a < accesses) apply_store<T, Op, W>(t, a, raw[k]);
    }
  }
  if constexpr (W > 1) {  // fewer than W elements left: kThreads >= W covers them
    const int64_t i = accesses * W + threadIdx.x;
    if (blockIdx.x == 0 && i < n) {
      Raw<T, 1> raw[Op::kIn];
#pragma unroll
      for (int j = 0; j < Op::kIn; ++j) raw[j] = load<T, 1>(t.in[j] + i);
      apply_store<T, Op, 1>(t, i, raw);
    }
  }
}

// ---------------------------------------------------------------- launch
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <class T, class Op, int W>
int launch(const Tensors<T, Op>& t, int64_t n, cudaStream_t s) {
  // 16-byte accesses: 2 per thread and a tile per block (the grid-stride loop runs once where
  // the grid allows): 100% of the copy bandwidth forward and backward for bf16 swiglu / geglu at
  // 16384 x 14336 on the H200, where 4 per thread in a grid capped at 32 blocks per SM reached
  // 96% and evict-first (.cs) loads and stores 85-92% (bench/results/h200/tuning/variants.json).
  // Scalar accesses (unaligned tensors): 8 per thread, grid capped.
  constexpr int U = W == 1 ? 8 : 2;
  constexpr int64_t kCap = W == 1 ? kMaxBlocks : kMaxGrid;
  const int64_t tiles = (n / W + int64_t(U) * kThreads - 1) / (int64_t(U) * kThreads);
  const unsigned grid = unsigned(std::clamp<int64_t>(tiles, 1, kCap));
  gated_grid_stride<T, Op, W, U><<<grid, kThreads, 0, s>>>(t, n);
  return int(cudaGetLastError());
}

template <class T, class Op>
int launch_any_alignment(const Tensors<T, Op>& t, int64_t n, cudaStream_t s) {
  bool vec = true;
  for (const T* p : t.out) vec = vec && aligned16(p);
  for (const T* p : t.in) vec = vec && aligned16(p);
  return vec ? launch<T, Op, kVec<T>>(t, n, s) : launch<T, Op, 1>(t, n, s);
}

// out and in are the untyped pointers of Op<any act>, destination first.
template <template <GatedActivation> class Op, class T>
int launch_act(GatedActivation act, void* const* out, const void* const* in, int64_t n,
               void* stream) {
  auto go = [&](auto op) {
    using O = decltype(op);
    Tensors<T, O> t;
    for (int j = 0; j < O::kOut; ++j) t.out[j] = static_cast<T*>(out[j]);
    for (int j = 0; j < O::kIn; ++j) t.in[j] = static_cast<const T*>(in[j]);
    return launch_any_alignment<T, O>(t, n, static_cast<cudaStream_t>(stream));
  };
  switch (act) {
    case GatedActivation::kSilu: return go(Op<GatedActivation::kSilu>{});
    case GatedActivation::kGeluErf: return go(Op<GatedActivation::kGeluErf>{});
    case GatedActivation::kGeluTanh: return go(Op<GatedActivation::kGeluTanh>{});
  }
  return int(cudaErrorInvalidValue);
}

template <template <GatedActivation> class Op, int kOut, int kIn>
int run(DType dtype, GatedActivation act, void* const (&out)[kOut], const void* const (&in)[kIn],
        int64_t n, void* stream) {
  if (n == 0) return 0;
  bool ok = n > 0;
  for (const void* p : out) ok = ok && p != nullptr;
  for (const void* p : in) ok = ok && p != nullptr;
  if (!ok) return int(cudaErrorInvalidValue);
  switch (dtype) {
    case DType::kFloat32: return launch_act<Op, float>(act, out, in, n, stream);
    case DType::kFloat16: return launch_act<Op, __half>(act, out, in, n, stream);
    case DType::kBFloat16: return launch_act<Op, __nv_bfloat16>(act, out, in, n, stream);
  }
  return int(cudaErrorInvalidValue);
}

}  // namespace gated_detail

int gated_fwd_cuda(void* out, const void* gate, const void* up, int64_t n, DType dtype,
                   GatedActivation act, void* stream) {
  return gated_detail::run<gated_detail::GatedFwd>(dtype, act, {out}, {gate, up}, n, stream);
}

int gated_bwd_cuda(void* dgate, void* dup, const void* dy, const void* gate, const void* up,
                   int64_t n, DType dtype, GatedActivation act, void* stream) {
  return gated_detail::run<gated_detail::GatedBwd>(dtype, act, {dgate, dup}, {dy, gate, up}, n,
                                                   stream);
}

}  // namespace kernelgate::kernels
