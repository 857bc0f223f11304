// layer_norm CUDA kernels (contract in layer_norm.h).
//
// Two layouts per direction, as in rms_norm_cuda.cu:
//  * "row in registers": each thread loads VPT 16-byte vectors of the row before using any, so
//    x (and dy) are read once; the mean and then the variance of the deviations come from the
//    registers (two reductions), which stays exact where E[x^2] - E[x]^2 cancels (rows with a
//    mean far from 0).
//    Needs 16-byte aligned pointers and row starts and a row that fits (forward up to 512 threads
//    x 8 vectors: 32768 bf16; backward up to 256 x 8: 16384 bf16).
//  * "general": any hidden and alignment; 16-byte accesses when aligned, scalar otherwise. Three
//    passes forward (sum, squared deviations, output), two backward; the later passes re-read
//    the row, mostly from L1/L2.
// The backward is a persistent grid: each row slot keeps float32 dweight and dbias sums for its
// columns and writes them as partial rows of the workspace ([2][partial rows][hidden]: dweight's
// then dbias's); sum_partial_rows reduces them in a fixed order (deterministic per plan).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/layer_norm.h"
#include "kernels/norm_rows.cuh"

namespace kernelgate::kernels {
namespace layer_norm_detail {

using namespace norm_rows;

constexpr int kFwdMaxThreads = 512;
constexpr int kBwdMaxThreads = 256;  // registers: x, dy and two sets of sums
constexpr int kGeneralMaxThreads = 512;

// ---------------------------------------------------------------- forward
// Mean and rstd from a first mean mu0 and the row sums m = (sum d, sum d^2) of d = x - mu0: the
// corrected two-pass variance (Chan, Golub and LeVeque). The float32 first sum of a row whose mean
// is far from 0 carries an absolute error of a few ulps of the row sum; sum d, taken over small
// deviations, recovers it, so mean and variance are exact to rounding of the deviations.
__device__ __forceinline__ void finish_stats(float mu0, float2 m, float inv_n, float eps, float& mu,
                                             float& rs) {
  const float c = m.x * inv_n;
  mu = mu0 + c;
  const float var = m.y * inv_n - c * c;  // >= 0 up to rounding; NaN stays NaN (not fmaxf)
  rs = 1.f / sqrtf((var < 0.f ? 0.f : var) + eps);
}

template <class T, int VPT>
__global__ void __launch_bounds__(kFwdMaxThreads, VPT >= 8 ? 1 : 2)
    layer_norm_fwd_row_in_registers(T* __restrict__ y, float* __restrict__ mean_out,
                                    float* __restrict__ rstd_out, const T* __restrict__ x,
                                    const T* __restrict__ weight, const T* __restrict__ bias,
                                    int64_t rows, int nvec, int64_t x_stride, float eps) {
  constexpr int kN = Vec<T>::kN;
  __shared__ float2 red[2][32];  // row_sum uses the first half of a buffer, row_sum2 all of it
  const float inv_n = 1.f / (float(nvec) * kN);
  const uint4* wr = reinterpret_cast<const uint4*>(weight);
  const uint4* br = reinterpret_cast<const uint4*>(bias);
  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const uint4* xr = reinterpret_cast<const uint4*>(x + row * x_stride);
    uint4 xv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      xv[k] = (valid && j < nvec) ? xr[j] : make_uint4(0, 0, 0, 0);
    }
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      float f[kN];
      unpack<T>(xv[k], f);
#pragma unroll
      for (int i = 0; i < kN; ++i) s += f[i];
    }
    const float mu0 = row_sum(s, reinterpret_cast<float*>(red[parity])) * inv_n;
    parity ^= 1;
    float sd = 0.f, q = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nvec) {  // lanes past the row hold zeros, which are not x - mean
        float f[kN];
        unpack<T>(xv[k], f);
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          const float d = f[i] - mu0;
          sd += d;
          q += d * d;
        }
      }
    }
    const float2 m = row_sum2(sd, q, red[parity]);
    parity ^= 1;
    float mu, rs;
    finish_stats(mu0, m, inv_n, eps, mu, rs);
    if (!valid) continue;
    if (threadIdx.x == 0) {
      if (mean_out != nullptr) mean_out[row] = mu;
      if (rstd_out != nullptr) rstd_out[row] = rs;
    }
    uint4* yr = reinterpret_cast<uint4*>(y + row * nvec * kN);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j >= nvec) break;
      float f[kN], w[kN], b[kN];
      unpack<T>(xv[k], f);
      unpack<T>(weight != nullptr ? wr[j] : ones_vec<T>(), w);
      unpack<T>(bias != nullptr ? br[j] : make_uint4(0, 0, 0, 0), b);
#pragma unroll
      for (int i = 0; i < kN; ++i) f[i] = (f[i] - mu) * rs * w[i] + b[i];
      yr[j] = pack<T>(f);
    }
  }
}

// W > 1 needs the row-in-registers alignment (hidden % W == 0 included).
template <class T, int W>
__global__ void __launch_bounds__(kGeneralMaxThreads, 1)
    layer_norm_fwd_general(T* __restrict__ y, float* __restrict__ mean_out,
                           float* __restrict__ rstd_out, const T* __restrict__ x,
                           const T* __restrict__ weight, const T* __restrict__ bias, int64_t rows,
                           int64_t hidden, int64_t x_stride, float eps) {
  __shared__ float2 red[2][32];  // row_sum uses the first half of a buffer, row_sum2 all of it
  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  const int64_t c0 = int64_t(threadIdx.x) * W, cstep = int64_t(blockDim.x) * W;
  const float inv_n = 1.f / float(hidden);
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const T* xr = x + row * x_stride;
    float s = 0.f;
    if (valid) {
#pragma unroll(W == 1 ? 8 : 4)
      for (int64_t c = c0; c < hidden; c += cstep) {
        float f[W];
        load_elems<T, W>(xr + c, f);
#pragma unroll
        for (int i = 0; i < W; ++i) s += f[i];
      }
    }
    const float mu0 = row_sum(s, reinterpret_cast<float*>(red[parity])) * inv_n;
    parity ^= 1;
    float sd = 0.f, q = 0.f;
    if (valid) {
#pragma unroll(W == 1 ? 8 : 4)
      for (int64_t c = c0; c < hidden; c += cstep) {
        float f[W];
        load_elems<T, W>(xr + c, f);
#pragma unroll
        for (int i = 0; i < W; ++i) {
          const float d = f[i] - mu0;
          sd += d;
          q += d * d;
        }
      }
    }
    const float2 m = row_sum2(sd, q, red[parity]);
    parity ^= 1;
    float mu, rs;
    finish_stats(mu0, m, inv_n, eps, mu, rs);
    if (!valid) continue;
    if (threadIdx.x == 0) {
      if (mean_out != nullptr) mean_out[row] = mu;
      if (rstd_out != nullptr) rstd_out[row] = rs;
    }
    T* yr = y + row * hidden;
#pragma unroll(W == 1 ? 8 : 4)
    for (int64_t c = c0; c < hidden; c += cstep) {
      float f[W], w[W], b[W];
      load_elems<T, W>(xr + c, f);
      load_or<T, W>(weight, c, 1.f, w);
      load_or<T, W>(bias, c, 0.f, b);
#pragma unroll
      for (int i = 0; i < W; ++i) f[i] = (f[i] - mu) * rs * w[i] + b[i];
      store_elems<T, W>(yr + c, f);
    }
  }
}

// ---------------------------------------------------------------- backward
// dw_partial / db_partial (null when not wanted) receive row blockIdx.x of their
// [gridDim.x, hidden] arrays. VPT <= 4 keeps the sums in registers and adds the block's row slots
// together through dynamic shared memory ((rows per block / 2) * hidden floats, one array at a
// time) at the end; VPT == 8 is launched with one row per block and keeps them in dynamic shared
// memory (2 * hidden floats, each thread owning its columns), which leaves registers for the row.
// Two blocks per SM at least when the row takes 4 vectors or fewer (x, dy and the sums fit in
// 128 registers without spilling).
template <class T, int VPT>
__global__ void __launch_bounds__(kBwdMaxThreads, VPT >= 8 ? 1 : 2)
    layer_norm_bwd_row_in_registers(T* __restrict__ dx, float* __restrict__ dw_partial,
                                    float* __restrict__ db_partial, const T* __restrict__ dy,
                                    const T* __restrict__ x, const T* __restrict__ weight,
                                    const float* __restrict__ mean, const float* __restrict__ rstd,
                                    int64_t rows, int nvec, int64_t x_stride, int64_t dy_stride) {
  constexpr int kN = Vec<T>::kN;
  constexpr bool kSumsInSmem = VPT >= 8;
  constexpr int kRegVecs = kSumsInSmem ? 1 : VPT;
  __shared__ float2 red[2][32];
  extern __shared__ float4 smem[];
  const int hidden = nvec * kN;
  float* wsums = reinterpret_cast<float*>(smem);
  float* bsums = wsums + hidden;
  const bool want_sums = dw_partial != nullptr || db_partial != nullptr;
  const float inv_n = 1.f / float(hidden);
  const uint4* wr = reinterpret_cast<const uint4*>(weight);
  float accw[kRegVecs][kN], accb[kRegVecs][kN];
#pragma unroll
  for (int k = 0; k < kRegVecs; ++k)
#pragma unroll
    for (int i = 0; i < kN; ++i) accw[k][i] = accb[k][i] = 0.f;
  if (kSumsInSmem && want_sums)
    for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
      float z[kN] = {};
      store_sums<kN>(wsums + j * kN, z);
      store_sums<kN>(bsums + j * kN, z);
    }

  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const uint4* xr = reinterpret_cast<const uint4*>(x + row * x_stride);
    const uint4* dyr = reinterpret_cast<const uint4*>(dy + row * dy_stride);
    // weight is re-read per row and pass (L1 hits) rather than held: registers go to the row.
    auto weight_vec = [&](int j, bool in) {
      return (in && weight != nullptr) ? wr[j] : ones_vec<T>();
    };
    uint4 xv[VPT], gv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      const bool in = valid && j < nvec;
      xv[k] = in ? xr[j] : make_uint4(0, 0, 0, 0);
      gv[k] = in ? dyr[j] : make_uint4(0, 0, 0, 0);
    }
    const float mu = valid ? mean[row] : 0.f;
    const float rs = valid ? rstd[row] : 0.f;
    float a = 0.f, b = 0.f;  // sums of g and of g * xhat (zero on lanes past the row: dy = 0)
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      float xf[kN], gf[kN], wf[kN];
      unpack<T>(xv[k], xf);
      unpack<T>(gv[k], gf);
      unpack<T>(weight_vec(j, valid && j < nvec), wf);
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const float g = gf[i] * wf[i];
        a += g;
        b += g * ((xf[i] - mu) * rs);
      }
    }
    const float2 ab = row_sum2(a, b, red[parity]);
    parity ^= 1;
    const float ma = ab.x * inv_n, mb = ab.y * inv_n;
    uint4* dxr = reinterpret_cast<uint4*>(dx + row * nvec * kN);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      const bool in = valid && j < nvec;
      float xf[kN], gf[kN], wf[kN], o[kN], dw[kN];
      unpack<T>(xv[k], xf);
      unpack<T>(gv[k], gf);
      unpack<T>(weight_vec(j, in), wf);
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const float xhat = (xf[i] - mu) * rs;
        o[i] = rs * (gf[i] * wf[i] - ma - xhat * mb);
        dw[i] = gf[i] * xhat;
      }
      if (in) {
        dxr[j] = pack<T>(o);
        if (kSumsInSmem && want_sums) {
          add_sums<kN>(wsums + j * kN, dw);
          add_sums<kN>(bsums + j * kN, gf);
        }
      }
      if constexpr (!kSumsInSmem)
#pragma unroll
        for (int i = 0; i < kN; ++i) accw[k][i] += dw[i], accb[k][i] += gf[i];  // dy = 0 off row
    }
  }
  if (!want_sums) return;  // uniform over the block
  if constexpr (!kSumsInSmem) {
    combine_row_slots<kRegVecs, kN>(accw, wsums, nvec);
    combine_row_slots<kRegVecs, kN>(accb, wsums, nvec);
    if (threadIdx.y != 0) return;
  }
  const int64_t slot_off = int64_t(blockIdx.x) * hidden;
  for (int which = 0; which < 2; ++which) {
    float* out = which == 0 ? dw_partial : db_partial;
    if (out == nullptr) continue;
    out += slot_off;
    if constexpr (kSumsInSmem) {
      const float* src = which == 0 ? wsums : bsums;
      for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
        float t[kN];
#pragma unroll
        for (int i = 0; i < kN; ++i) t[i] = src[j * kN + i];
        store_sums<kN>(out + j * kN, t);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kRegVecs; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < nvec) store_sums<kN>(out + j * kN, which == 0 ? accw[k] : accb[k]);
      }
    }
  }
}

// Sums accumulate directly in the slot's workspace rows (each column touched by one thread
// only; the plan keeps the workspace within L2).
template <class T, int W>
__global__ void __launch_bounds__(kGeneralMaxThreads, 1)
    layer_norm_bwd_general(T* __restrict__ dx, float* __restrict__ dw_partial,
                           float* __restrict__ db_partial, const T* __restrict__ dy,
                           const T* __restrict__ x, const T* __restrict__ weight,
                           const float* __restrict__ mean, const float* __restrict__ rstd,
                           int64_t rows, int64_t hidden, int64_t x_stride, int64_t dy_stride) {
  __shared__ float2 red[2][32];
  const int64_t slot = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  float* accw = dw_partial == nullptr ? nullptr : dw_partial + slot * hidden;
  float* accb = db_partial == nullptr ? nullptr : db_partial + slot * hidden;
  const int64_t c0 = int64_t(threadIdx.x) * W, cstep = int64_t(blockDim.x) * W;
  for (int64_t c = c0; c < hidden; c += cstep) {
    float z[W] = {};
    if (accw != nullptr) store_sums<W>(accw + c, z);
    if (accb != nullptr) store_sums<W>(accb + c, z);
  }
  const float inv_n = 1.f / float(hidden);
  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const T* xr = x + row * x_stride;
    const T* dyr = dy + row * dy_stride;
    const float mu = valid ? mean[row] : 0.f;
    const float rs = valid ? rstd[row] : 0.f;
    float a = 0.f, b = 0.f;
    if (valid) {
#pragma unroll(W == 1 ? 8 : 4)
      for (int64_t c = c0; c < hidden; c += cstep) {
        float xf[W], gf[W], wf[W];
        load_elems<T, W>(xr + c, xf);
        load_elems<T, W>(dyr + c, gf);
        load_or<T, W>(weight, c, 1.f, wf);
#pragma unroll
        for (int i = 0; i < W; ++i) {
          const float g = gf[i] * wf[i];
          a += g;
          b += g * ((xf[i] - mu) * rs);
        }
      }
    }
    const float2 ab = row_sum2(a, b, red[parity]);
    parity ^= 1;
    if (!valid) continue;
    const float ma = ab.x * inv_n, mb = ab.y * inv_n;
    T* dxr = dx + row * hidden;
#pragma unroll(W == 1 ? 8 : 4)
    for (int64_t c = c0; c < hidden; c += cstep) {
      float xf[W], gf[W], wf[W], o[W], dw[W];
      load_elems<T, W>(xr + c, xf);
      load_elems<T, W>(dyr + c, gf);
      load_or<T, W>(weight, c, 1.f, wf);
#pragma unroll
      for (int i = 0; i < W; ++i) {
        const float xhat = (xf[i] - mu) * rs;
        o[i] = rs * (gf[i] * wf[i] - ma - xhat * mb);
        dw[i] = gf[i] * xhat;
      }
      store_elems<T, W>(dxr + c, o);
      if (accw != nullptr) add_sums<W>(accw + c, dw);
      if (accb != nullptr) add_sums<W>(accb + c, gf);
    }
  }
}

// ---------------------------------------------------------------- planning
// Forward at 16384 x 4096 bf16 on the H200 (bench/results/h200/tuning/variants.json): 4
// vectors per thread 85.5% of the copy bandwidth, 8 vectors 86.2%, a warp per row (16 vectors,
// no block barrier) 75.6%. The Nsight Compute profile of the backward (128 registers per
// thread, 2 blocks of 256 per SM, 24% achieved occupancy, 73% of DRAM throughput) says what
// limits it: see bench/results/h200/README.md.
// As rms_norm's (measured on H200, bf16): 4 vectors per thread, at least 128 threads per block,
// at most 512 threads per row forward and 256 backward, about 512 backward threads per SM.
constexpr int kPrefVpt = 4, kMinBlock = 128, kBwdThreadsPerSm = 512;
// Backward blocks of at least 256 threads (two rows at hidden 4096 bf16, combined in the block):
// half the partial rows of one-row blocks, which matters with two sums arrays (not measured yet).
constexpr int kBwdMinBlock = 256;

inline Layout fwd_layout(const LayerNormProblem& p, bool aligned) {
  const int n = vec_elems(p.dtype);
  if (!aligned || p.hidden % n != 0 || p.x_row_stride % n != 0)
    return general_layout(p.hidden, 1, kGeneralMaxThreads, 256);
  const Layout l = registers_layout(p.hidden / n, kPrefVpt, 8, kFwdMaxThreads, kMinBlock);
  if (l.vpt != 0 && l.tpr * l.rpb <= kFwdMaxThreads) return l;
  return general_layout(p.hidden, n, kGeneralMaxThreads, 256);
}

struct BwdPlan {
  Layout layout;
  int64_t blocks = 0;
  int64_t partial_rows = 0;  // rows of `hidden` floats per sums array
  size_t smem = 0;           // dynamic shared memory when sums are wanted
};

template <class T>
const void* bwd_kernel(const Layout& l) {
  constexpr int kN = Vec<T>::kN;
  switch (l.vpt) {
    case 1: return reinterpret_cast<const void*>(&layer_norm_bwd_row_in_registers<T, 1>);
    case 2: return reinterpret_cast<const void*>(&layer_norm_bwd_row_in_registers<T, 2>);
    case 4: return reinterpret_cast<const void*>(&layer_norm_bwd_row_in_registers<T, 4>);
    case 8: return reinterpret_cast<const void*>(&layer_norm_bwd_row_in_registers<T, 8>);
  }
  return l.width == 1 ? reinterpret_cast<const void*>(&layer_norm_bwd_general<T, 1>)
                      : reinterpret_cast<const void*>(&layer_norm_bwd_general<T, kN>);
}

// Workspace sizing and launch both come here, so they agree.
inline BwdPlan bwd_plan(const LayerNormProblem& p, bool vectorized, int sm_count) {
  BwdPlan plan;
  const int n = vec_elems(p.dtype);
  Layout l = vectorized ? registers_layout(p.hidden / n, kPrefVpt, 8, kBwdMaxThreads, kBwdMinBlock)
                        : Layout{};
  if (l.vpt >= 8) {  // sums in shared memory hold one row: one row per block
    l.rpb = 1;
    if (l.tpr < 32) l = {};
  }
  const size_t row_bytes = size_t(p.hidden) * sizeof(float);
  plan.smem = l.vpt >= 8 ? 2 * row_bytes : size_t(l.rpb / 2) * row_bytes;
  if (l.vpt == 0 || plan.smem > smem_limit()) {
    l = general_layout(p.hidden, vectorized ? n : 1, kGeneralMaxThreads, 256);
    plan.smem = 0;
  }
  plan.layout = l;
  const void* kernel = nullptr;
  dispatch_dtype(p.dtype, [&](auto tag) {
    kernel = bwd_kernel<typename decltype(tag)::type>(l);
    return 0;
  });
  const int threads = l.tpr * l.rpb;
  const int max_per_sm = l.vpt != 0 ? kBwdThreadsPerSm / threads : 2048 / threads;
  plan.blocks =
      persistent_blocks(kernel, threads, plan.smem, sm_count, max_per_sm, ceil_div(p.rows, l.rpb));
  // Partial rows per block: one on the register path (row slots combined), one per slot else.
  const int64_t slots = l.vpt != 0 ? 1 : l.rpb;
  const int64_t cap = l.vpt != 0 ? kMaxWorkspaceFloats : kL2SumsFloats;
  plan.blocks = std::max<int64_t>(1, std::min(plan.blocks, cap / (2 * slots * p.hidden)));
  plan.partial_rows = plan.blocks * slots;
  return plan;
}

// ---------------------------------------------------------------- launchers
template <class T>
int launch_fwd(T* y, float* mean, float* rstd, const T* x, const T* w, const T* b,
               const LayerNormProblem& p, const Layout& l, cudaStream_t s) {
  constexpr int kN = Vec<T>::kN;
  const dim3 block(l.tpr, l.rpb);
  const unsigned grid = unsigned(std::min<int64_t>(ceil_div(p.rows, l.rpb), 1 << 30));
  const int nvec = int(p.hidden / kN);
  switch (l.vpt) {
#define KG_LN_FWD_CASE(V)                                                                     \
  case V:                                                                                     \
    layer_norm_fwd_row_in_registers<T, V>                                                     \
        <<<grid, block, 0, s>>>(y, mean, rstd, x, w, b, p.rows, nvec, p.x_row_stride, p.eps); \
    break;
    KG_LN_FWD_CASE(1)
    KG_LN_FWD_CASE(2)
    KG_LN_FWD_CASE(4)
    KG_LN_FWD_CASE(8)
#undef KG_LN_FWD_CASE
    default:
      if (l.width == 1) {
        layer_norm_fwd_general<T, 1><<<grid, block, 0, s>>>(y, mean, rstd, x, w, b, p.rows,
                                                            p.hidden, p.x_row_stride, p.eps);
      } else {
        layer_norm_fwd_general<T, kN><<<grid, block, 0, s>>>(y, mean, rstd, x, w, b, p.rows,
                                                             p.hidden, p.x_row_stride, p.eps);
      }
  }
  return int(cudaGetLastError());
}

template <class T>
int launch_bwd(T* dx, T* dweight, T* dbias, const T* dy, const T* x, const T* w, const float* mean,
               const float* rstd, float* workspace, const LayerNormProblem& p, const BwdPlan& plan,
               cudaStream_t s) {
  constexpr int kN = Vec<T>::kN;
  const Layout& l = plan.layout;
  const int64_t array_floats = plan.partial_rows * p.hidden;
  float* dw_partial = dweight != nullptr ? workspace : nullptr;
  float* db_partial = dbias != nullptr ? workspace + array_floats : nullptr;
  if (p.rows > 0) {
    const dim3 block(l.tpr, l.rpb);
    const unsigned grid = unsigned(plan.blocks);
    const int nvec = int(p.hidden / kN);
    const size_t smem = (dw_partial != nullptr || db_partial != nullptr) ? plan.smem : 0;
    switch (l.vpt) {
#define KG_LN_BWD_CASE(V)                                                                          \
  case V:                                                                                          \
    layer_norm_bwd_row_in_registers<T, V>                                                          \
        <<<grid, block, smem, s>>>(dx, dw_partial, db_partial, dy, x, w, mean, rstd, p.rows, nvec, \
                                   p.x_row_stride, p.dy_row_stride);                               \
    break;
      KG_LN_BWD_CASE(1)
      KG_LN_BWD_CASE(2)
      KG_LN_BWD_CASE(4)
      KG_LN_BWD_CASE(8)
#undef KG_LN_BWD_CASE
      default:
        if (l.width == 1) {
          layer_norm_bwd_general<T, 1><<<grid, block, 0, s>>>(dx, dw_partial, db_partial, dy, x, w,
                                                              mean, rstd, p.rows, p.hidden,
                                                              p.x_row_stride, p.dy_row_stride);
        } else {
          layer_norm_bwd_general<T, kN><<<grid, block, 0, s>>>(dx, dw_partial, db_partial, dy, x, w,
                                                               mean, rstd, p.rows, p.hidden,
                                                               p.x_row_stride, p.dy_row_stride);
        }
    }
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return int(e);
  }
  const int64_t prows = p.rows > 0 ? plan.partial_rows : 0;  // no rows: zeros
  const unsigned cols = unsigned(ceil_div(p.hidden, 32));
  if (dweight != nullptr)
    sum_partial_rows<T><<<cols, dim3(32, 32), 0, s>>>(dweight, workspace, prows, p.hidden);
  if (dbias != nullptr)
    sum_partial_rows<T>
        <<<cols, dim3(32, 32), 0, s>>>(dbias, workspace + array_floats, prows, p.hidden);
  return int(cudaGetLastError());
}

inline bool problem_ok(const LayerNormProblem& p) { return p.rows >= 0 && p.hidden >= 1; }

int fwd(void* y, float* mean, float* rstd, const void* x, const void* weight, const void* bias,
        const LayerNormProblem& p, void* stream) {
  if (!problem_ok(p)) return int(cudaErrorInvalidValue);
  if (p.rows == 0) return 0;
  if (y == nullptr || x == nullptr) return int(cudaErrorInvalidValue);
  const bool aligned = aligned16(y) && aligned16(x) && aligned16(weight) && aligned16(bias);
  const Layout l = fwd_layout(p, aligned);
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_fwd<T>(static_cast<T*>(y), mean, rstd, static_cast<const T*>(x),
                         static_cast<const T*>(weight), static_cast<const T*>(bias), p, l,
                         static_cast<cudaStream_t>(stream));
  });
}

int64_t bwd_workspace_floats(const LayerNormProblem& p, int sm_count) {
  if (p.rows <= 0 || p.hidden < 1) return 0;
  // The pointers are not known here: size for either plan the launch may pick.
  int64_t rows = bwd_plan(p, false, sm_count).partial_rows;
  if (p.hidden % vec_elems(p.dtype) == 0)
    rows = std::max(rows, bwd_plan(p, true, sm_count).partial_rows);
  return 2 * rows * p.hidden;
}

int bwd(void* dx, void* dweight, void* dbias, const void* dy, const void* x, const void* weight,
        const float* mean, const float* rstd, float* workspace, int sm_count,
        const LayerNormProblem& p, void* stream) {
  if (!problem_ok(p)) return int(cudaErrorInvalidValue);
  const bool want_sums = dweight != nullptr || dbias != nullptr;
  if (p.rows == 0 && !want_sums) return 0;
  if (p.rows > 0 && (dx == nullptr || dy == nullptr || x == nullptr || mean == nullptr ||
                     rstd == nullptr || (want_sums && workspace == nullptr)))
    return int(cudaErrorInvalidValue);
  const int n = vec_elems(p.dtype);
  const bool vectorized = p.hidden % n == 0 && p.x_row_stride % n == 0 &&
                          p.dy_row_stride % n == 0 && aligned16(dx) && aligned16(dy) &&
                          aligned16(x) && aligned16(weight) && aligned16(workspace);
  const BwdPlan plan = p.rows > 0 ? bwd_plan(p, vectorized, sm_count) : BwdPlan{};
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_bwd<T>(static_cast<T*>(dx), static_cast<T*>(dweight), static_cast<T*>(dbias),
                         static_cast<const T*>(dy), static_cast<const T*>(x),
                         static_cast<const T*>(weight), mean, rstd, workspace, p, plan,
                         static_cast<cudaStream_t>(stream));
  });
}

}  // namespace layer_norm_detail

int layer_norm_fwd_cuda(void* y, float* mean, float* rstd, const void* x, const void* weight,
                        const void* bias, const LayerNormProblem& p, void* stream) {
  return layer_norm_detail::fwd(y, mean, rstd, x, weight, bias, p, stream);
}

int64_t layer_norm_bwd_cuda_workspace_floats(const LayerNormProblem& p, int sm_count) {
  return layer_norm_detail::bwd_workspace_floats(p, sm_count);
}

int layer_norm_bwd_cuda(void* dx, void* dweight, void* dbias, const void* dy, const void* x,
                        const void* weight, const float* mean, const float* rstd, float* workspace,
                        int sm_count, const LayerNormProblem& p, void* stream) {
  return layer_norm_detail::bwd(dx, dweight, dbias, dy, x, weight, mean, rstd, workspace, sm_count,
                                p, stream);
}

}  // namespace kernelgate::kernels
