// add_rms_norm CUDA kernels (contract in add_rms_norm.h).
//
// Two layouts per direction, as in rms_norm_cuda.cu:
//  * "row in registers": each thread loads VPT 16-byte vectors of each input row before using
//    any, so every input is read once and every output written once. Needs 16-byte aligned
//    pointers and row starts (strides and hidden multiples of 16 / sizeof(T)) and a row that fits
//    (forward up to 512 threads x 8 vectors: 32768 bf16; backward up to 256 x 8: 16384 bf16).
//  * "general": any hidden and alignment; 16-byte accesses when aligned as above, scalar ones
//    otherwise. The forward's second pass re-reads h from its own output (mostly L2); the
//    backward's second pass re-reads the row.
// The backward is a persistent grid: each row slot keeps float32 dweight sums for its columns and
// writes them as one partial row of the workspace; sum_partial_rows reduces those rows in a fixed
// order, so dweight is deterministic for a given (problem, sm_count, device).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/add_rms_norm.h"
#include "kernels/norm_rows.cuh"

namespace kernelgate::kernels {
namespace add_rms_norm_detail {

using namespace norm_rows;

constexpr int kFwdMaxThreads = 512;
constexpr int kBwdMaxThreads = 256;      // registers: h, dy, dh and the dweight sums
constexpr int kGeneralMaxThreads = 512;  // general kernels (both directions)

// ---------------------------------------------------------------- forward
template <class T, int VPT>
__global__ void __launch_bounds__(kFwdMaxThreads, VPT >= 8 ? 1 : 2)
    add_rms_norm_fwd_row_in_registers(T* __restrict__ y, T* __restrict__ h,
                                      float* __restrict__ rstd, const T* __restrict__ x,
                                      const T* __restrict__ res, const T* __restrict__ weight,
                                      int64_t rows, int nvec, int64_t x_stride, int64_t r_stride,
                                      float eps) {
  constexpr int kN = Vec<T>::kN;
  __shared__ float red[2][32];
  const float inv_n = 1.f / (float(nvec) * kN);
  const uint4* wr = reinterpret_cast<const uint4*>(weight);
  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const uint4* xr = reinterpret_cast<const uint4*>(x + row * x_stride);
    const uint4* rr = reinterpret_cast<const uint4*>(res + row * r_stride);
    uint4 hv[VPT], rv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      const bool in = valid && j < nvec;
      hv[k] = in ? xr[j] : make_uint4(0, 0, 0, 0);
      rv[k] = in ? rr[j] : make_uint4(0, 0, 0, 0);
    }
    uint4* hr = reinterpret_cast<uint4*>(h + row * nvec * kN);
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      float a[kN], b[kN];
      unpack<T>(hv[k], a);
      unpack<T>(rv[k], b);
#pragma unroll
      for (int i = 0; i < kN; ++i) a[i] += b[i];
      hv[k] = pack<T>(a);
      // Statistics of h as stored (rounded to T), as `h = x + residual; rms_norm(h)` computes.
      unpack<T>(hv[k], a);
#pragma unroll
      for (int i = 0; i < kN; ++i) ss += a[i] * a[i];
      if (valid && j < nvec) hr[j] = hv[k];
    }
    ss = row_sum(ss, red[parity]);
    parity ^= 1;
    const float r = 1.f / sqrtf(ss * inv_n + eps);
    if (!valid) continue;
    if (rstd != nullptr && threadIdx.x == 0) rstd[row] = r;
    uint4* yr = reinterpret_cast<uint4*>(y + row * nvec * kN);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j >= nvec) break;
      float f[kN], w[kN];
      unpack<T>(hv[k], f);
      unpack<T>(weight != nullptr ? wr[j] : ones_vec<T>(), w);
#pragma unroll
      for (int i = 0; i < kN; ++i) f[i] = f[i] * r * w[i];
      yr[j] = pack<T>(f);
    }
  }
}

// W > 1 needs the row-in-registers alignment (hidden % W == 0 included).
template <class T, int W>
__global__ void __launch_bounds__(kGeneralMaxThreads, 1)
    add_rms_norm_fwd_general(T* __restrict__ y, T* __restrict__ h, float* __restrict__ rstd,
                             const T* __restrict__ x, const T* __restrict__ res,
                             const T* __restrict__ weight, int64_t rows, int64_t hidden,
                             int64_t x_stride, int64_t r_stride, float eps) {
  __shared__ float red[2][32];
  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  const int64_t c0 = int64_t(threadIdx.x) * W, cstep = int64_t(blockDim.x) * W;
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const T* xr = x + row * x_stride;
    const T* rr = res + row * r_stride;
    T* hr = h + row * hidden;
    float ss = 0.f;
    if (valid) {
#pragma unroll(W == 1 ? 8 : 4)
      for (int64_t c = c0; c < hidden; c += cstep) {
        float a[W], b[W];
        load_elems<T, W>(xr + c, a);
        load_elems<T, W>(rr + c, b);
#pragma unroll
        for (int i = 0; i < W; ++i) a[i] = round_to<T>(a[i] + b[i]);
        store_elems<T, W>(hr + c, a);
#pragma unroll
        for (int i = 0; i < W; ++i) ss += a[i] * a[i];
      }
    }
    ss = row_sum(ss, red[parity]);
    parity ^= 1;
    const float r = 1.f / sqrtf(ss / float(hidden) + eps);
    if (!valid) continue;
    if (rstd != nullptr && threadIdx.x == 0) rstd[row] = r;
    T* yr = y + row * hidden;
    // Each thread re-reads only the h elements it wrote itself: no barrier needed.
#pragma unroll(W == 1 ? 8 : 4)
    for (int64_t c = c0; c < hidden; c += cstep) {
      float f[W], w[W];
      load_elems<T, W>(hr + c, f);
      load_or<T, W>(weight, c, 1.f, w);
#pragma unroll
      for (int i = 0; i < W; ++i) f[i] = f[i] * r * w[i];
      store_elems<T, W>(yr + c, f);
    }
  }
}

// ---------------------------------------------------------------- backward
// dw_partial (null when dweight is not wanted) receives row blockIdx.x of [gridDim.x, hidden].
// VPT <= 4 keeps the sums in registers and adds the block's row slots together through dynamic
// shared memory ((rows per block / 2) * hidden floats) at the end; VPT == 8 is launched with one
// row per block and keeps them in dynamic shared memory (hidden floats, each thread owning its
// columns), which leaves registers for the row.
// Two blocks per SM at least when the row takes 4 vectors or fewer (x, dy and the sums fit in
// 128 registers without spilling).
template <class T, int VPT>
__global__ void __launch_bounds__(kBwdMaxThreads, VPT >= 8 ? 1 : 2)
    add_rms_norm_bwd_row_in_registers(T* __restrict__ dx, float* __restrict__ dw_partial,
                                      const T* __restrict__ dy, const T* __restrict__ dh,
                                      const T* __restrict__ h, const T* __restrict__ weight,
                                      const float* __restrict__ rstd, int64_t rows, int nvec,
                                      int64_t h_stride, int64_t dy_stride, int64_t dh_stride) {
  constexpr int kN = Vec<T>::kN;
  constexpr bool kSumsInSmem = VPT >= 8;
  constexpr int kRegVecs = kSumsInSmem ? 1 : VPT;
  __shared__ float red[2][32];
  extern __shared__ float4 smem[];
  float* sums = reinterpret_cast<float*>(smem);
  const float inv_n = 1.f / (float(nvec) * kN);
  const uint4* wr = reinterpret_cast<const uint4*>(weight);
  float acc[kRegVecs][kN];
#pragma unroll
  for (int k = 0; k < kRegVecs; ++k)
#pragma unroll
    for (int i = 0; i < kN; ++i) acc[k][i] = 0.f;
  if (kSumsInSmem && dw_partial != nullptr)
    for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
      float z[kN] = {};
      store_sums<kN>(sums + j * kN, z);
    }

  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const uint4* hr = reinterpret_cast<const uint4*>(h + row * h_stride);
    const uint4* dyr = reinterpret_cast<const uint4*>(dy + row * dy_stride);
    const uint4* dhr =
        dh == nullptr ? nullptr : reinterpret_cast<const uint4*>(dh + row * dh_stride);
    // weight is re-read per row and pass (L1 hits) rather than held: registers go to the row.
    auto weight_vec = [&](int j, bool in) {
      return (in && weight != nullptr) ? wr[j] : ones_vec<T>();
    };
    uint4 hv[VPT], gv[VPT], dhv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      const bool in = valid && j < nvec;
      hv[k] = in ? hr[j] : make_uint4(0, 0, 0, 0);
      gv[k] = in ? dyr[j] : make_uint4(0, 0, 0, 0);
      dhv[k] = (in && dh != nullptr) ? dhr[j] : make_uint4(0, 0, 0, 0);
    }
    const float r = valid ? rstd[row] : 0.f;
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      float hf[kN], gf[kN], wf[kN];
      unpack<T>(hv[k], hf);
      unpack<T>(gv[k], gf);
      unpack<T>(weight_vec(j, valid && j < nvec), wf);
#pragma unroll
      for (int i = 0; i < kN; ++i) dot += (gf[i] * wf[i]) * (hf[i] * r);
    }
    dot = row_sum(dot, red[parity]);
    parity ^= 1;
    const float mean = dot * inv_n;
    uint4* dxr = reinterpret_cast<uint4*>(dx + row * nvec * kN);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      const bool in = valid && j < nvec;
      float hf[kN], gf[kN], wf[kN], df[kN], o[kN], dw[kN];
      unpack<T>(hv[k], hf);
      unpack<T>(gv[k], gf);
      unpack<T>(weight_vec(j, in), wf);
      unpack<T>(dhv[k], df);
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const float hhat = hf[i] * r;
        o[i] = r * (gf[i] * wf[i] - hhat * mean) + df[i];
        dw[i] = gf[i] * hhat;
      }
      if (in) {
        dxr[j] = pack<T>(o);
        if (kSumsInSmem && dw_partial != nullptr) add_sums<kN>(sums + j * kN, dw);
      }
      if constexpr (!kSumsInSmem)
#pragma unroll
        for (int i = 0; i < kN; ++i) acc[k][i] += dw[i];  // zero for lanes out of the row
    }
  }
  if (dw_partial == nullptr) return;  // uniform over the block
  float* out = dw_partial + int64_t(blockIdx.x) * nvec * kN;
  if constexpr (kSumsInSmem) {
    for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
      float a[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) a[i] = sums[j * kN + i];
      store_sums<kN>(out + j * kN, a);
    }
  } else {
    combine_row_slots<kRegVecs, kN>(acc, sums, nvec);
    if (threadIdx.y != 0) return;
#pragma unroll
    for (int k = 0; k < kRegVecs; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nvec) store_sums<kN>(out + j * kN, acc[k]);
    }
  }
}

// Sums accumulate directly in the slot's workspace row (each column touched by one thread only;
// the plan keeps the workspace within L2).
template <class T, int W>
__global__ void __launch_bounds__(kGeneralMaxThreads, 1)
    add_rms_norm_bwd_general(T* __restrict__ dx, float* __restrict__ dw_partial,
                             const T* __restrict__ dy, const T* __restrict__ dh,
                             const T* __restrict__ h, const T* __restrict__ weight,
                             const float* __restrict__ rstd, int64_t rows, int64_t hidden,
                             int64_t h_stride, int64_t dy_stride, int64_t dh_stride) {
  __shared__ float red[2][32];
  const int64_t slot = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  float* acc = dw_partial == nullptr ? nullptr : dw_partial + slot * hidden;
  const int64_t c0 = int64_t(threadIdx.x) * W, cstep = int64_t(blockDim.x) * W;
  if (acc != nullptr)
    for (int64_t c = c0; c < hidden; c += cstep) {
      float z[W] = {};
      store_sums<W>(acc + c, z);
    }
  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const T* hr = h + row * h_stride;
    const T* dyr = dy + row * dy_stride;
    const T* dhr = dh == nullptr ? nullptr : dh + row * dh_stride;
    const float r = valid ? rstd[row] : 0.f;
    float dot = 0.f;
    if (valid) {
#pragma unroll(W == 1 ? 8 : 4)
      for (int64_t c = c0; c < hidden; c += cstep) {
        float hf[W], gf[W], wf[W];
        load_elems<T, W>(hr + c, hf);
        load_elems<T, W>(dyr + c, gf);
        load_or<T, W>(weight, c, 1.f, wf);
#pragma unroll
        for (int i = 0; i < W; ++i) dot += (gf[i] * wf[i]) * (hf[i] * r);
      }
    }
    dot = row_sum(dot, red[parity]);
    parity ^= 1;
    if (!valid) continue;
    const float mean = dot / float(hidden);
    T* dxr = dx + row * hidden;
#pragma unroll(W == 1 ? 8 : 4)
    for (int64_t c = c0; c < hidden; c += cstep) {
      float hf[W], gf[W], wf[W], df[W], o[W], dw[W];
      load_elems<T, W>(hr + c, hf);
      load_elems<T, W>(dyr + c, gf);
      load_or<T, W>(weight, c, 1.f, wf);
      load_or<T, W>(dhr, c, 0.f, df);
#pragma unroll
      for (int i = 0; i < W; ++i) {
        const float hhat = hf[i] * r;
        o[i] = r * (gf[i] * wf[i] - hhat * mean) + df[i];
        dw[i] = gf[i] * hhat;
      }
      store_elems<T, W>(dxr + c, o);
      if (acc != nullptr) add_sums<W>(acc + c, dw);
    }
  }
}

// ---------------------------------------------------------------- planning
// Measured for rms_norm on H200 (bf16): 4 vectors per thread, at least 128 threads per block,
// at most 512 threads per row forward and 256 backward, about 512 backward threads per SM.
constexpr int kPrefVpt = 4, kMinBlock = 128, kBwdThreadsPerSm = 512;

inline bool fwd_rows_vectorizable(const AddRmsNormProblem& p) {
  const int n = vec_elems(p.dtype);
  return p.hidden % n == 0 && p.x_row_stride % n == 0 && p.residual_row_stride % n == 0;
}

inline Layout fwd_layout(const AddRmsNormProblem& p, bool aligned) {
  const int n = vec_elems(p.dtype);
  if (!aligned || !fwd_rows_vectorizable(p))
    return general_layout(p.hidden, 1, kGeneralMaxThreads, 256);
  const Layout l = registers_layout(p.hidden / n, kPrefVpt, 8, kFwdMaxThreads, kMinBlock);
  if (l.vpt != 0 && l.tpr * l.rpb <= kFwdMaxThreads) return l;
  return general_layout(p.hidden, n, kGeneralMaxThreads, 256);
}

struct BwdPlan {
  Layout layout;
  int64_t blocks = 0;
  int64_t partial_rows = 0;  // workspace rows of `hidden` floats
  size_t smem = 0;           // dynamic shared memory when dweight is wanted
};

template <class T>
const void* bwd_kernel(const Layout& l) {
  constexpr int kN = Vec<T>::kN;
  switch (l.vpt) {
    case 1: return reinterpret_cast<const void*>(&add_rms_norm_bwd_row_in_registers<T, 1>);
    case 2: return reinterpret_cast<const void*>(&add_rms_norm_bwd_row_in_registers<T, 2>);
    case 4: return reinterpret_cast<const void*>(&add_rms_norm_bwd_row_in_registers<T, 4>);
    case 8: return reinterpret_cast<const void*>(&add_rms_norm_bwd_row_in_registers<T, 8>);
  }
  return l.width == 1 ? reinterpret_cast<const void*>(&add_rms_norm_bwd_general<T, 1>)
                      : reinterpret_cast<const void*>(&add_rms_norm_bwd_general<T, kN>);
}

// Workspace sizing and launch both come here, so they agree.
inline BwdPlan bwd_plan(const AddRmsNormProblem& p, bool vectorized, int sm_count) {
  BwdPlan plan;
  const int n = vec_elems(p.dtype);
  Layout l = vectorized ? registers_layout(p.hidden / n, kPrefVpt, 8, kBwdMaxThreads, kMinBlock)
                        : Layout{};
  if (l.vpt >= 8) {  // sums in shared memory hold one row: one row per block
    l.rpb = 1;
    if (l.tpr < 32) l = {};
  }
  const size_t row_bytes = size_t(p.hidden) * sizeof(float);
  plan.smem = l.vpt >= 8 ? row_bytes : size_t(l.rpb / 2) * row_bytes;
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
  plan.blocks = std::max<int64_t>(1, std::min(plan.blocks, cap / (slots * p.hidden)));
  plan.partial_rows = plan.blocks * slots;
  return plan;
}

// ---------------------------------------------------------------- launchers
template <class T>
int launch_fwd(T* y, T* h, float* rstd, const T* x, const T* res, const T* w,
               const AddRmsNormProblem& p, const Layout& l, cudaStream_t s) {
  constexpr int kN = Vec<T>::kN;
  const dim3 block(l.tpr, l.rpb);
  const unsigned grid = unsigned(std::min<int64_t>(ceil_div(p.rows, l.rpb), 1 << 30));
  const int nvec = int(p.hidden / kN);
  switch (l.vpt) {
#define KG_ADD_RMS_FWD_CASE(V)                                                              \
  case V:                                                                                   \
    add_rms_norm_fwd_row_in_registers<T, V><<<grid, block, 0, s>>>(                         \
        y, h, rstd, x, res, w, p.rows, nvec, p.x_row_stride, p.residual_row_stride, p.eps); \
    break;
    KG_ADD_RMS_FWD_CASE(1)
    KG_ADD_RMS_FWD_CASE(2)
    KG_ADD_RMS_FWD_CASE(4)
    KG_ADD_RMS_FWD_CASE(8)
#undef KG_ADD_RMS_FWD_CASE
    default:
      if (l.width == 1) {
        add_rms_norm_fwd_general<T, 1><<<grid, block, 0, s>>>(
            y, h, rstd, x, res, w, p.rows, p.hidden, p.x_row_stride, p.residual_row_stride, p.eps);
      } else {
        add_rms_norm_fwd_general<T, kN><<<grid, block, 0, s>>>(
            y, h, rstd, x, res, w, p.rows, p.hidden, p.x_row_stride, p.residual_row_stride, p.eps);
      }
  }
  return int(cudaGetLastError());
}

template <class T>
int launch_bwd(T* dx, T* dweight, const T* dy, const T* dh, const T* h, const T* w,
               const float* rstd, float* workspace, const AddRmsNormProblem& p, const BwdPlan& plan,
               cudaStream_t s) {
  constexpr int kN = Vec<T>::kN;
  const Layout& l = plan.layout;
  float* partial = dweight != nullptr ? workspace : nullptr;
  if (p.rows > 0) {
    const dim3 block(l.tpr, l.rpb);
    const unsigned grid = unsigned(plan.blocks);
    const int nvec = int(p.hidden / kN);
    const size_t smem = partial != nullptr ? plan.smem : 0;
    switch (l.vpt) {
#define KG_ADD_RMS_BWD_CASE(V)                                                                    \
  case V:                                                                                         \
    add_rms_norm_bwd_row_in_registers<T, V>                                                       \
        <<<grid, block, smem, s>>>(dx, partial, dy, dh, h, w, rstd, p.rows, nvec, p.h_row_stride, \
                                   p.dy_row_stride, p.dh_row_stride);                             \
    break;
      KG_ADD_RMS_BWD_CASE(1)
      KG_ADD_RMS_BWD_CASE(2)
      KG_ADD_RMS_BWD_CASE(4)
      KG_ADD_RMS_BWD_CASE(8)
#undef KG_ADD_RMS_BWD_CASE
      default:
        if (l.width == 1) {
          add_rms_norm_bwd_general<T, 1><<<grid, block, 0, s>>>(dx, partial, dy, dh, h, w, rstd,
                                                                p.rows, p.hidden, p.h_row_stride,
                                                                p.dy_row_stride, p.dh_row_stride);
        } else {
          add_rms_norm_bwd_general<T, kN><<<grid, block, 0, s>>>(dx, partial, dy, dh, h, w, rstd,
                                                                 p.rows, p.hidden, p.h_row_stride,
                                                                 p.dy_row_stride, p.dh_row_stride);
        }
    }
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return int(e);
  }
  if (dweight != nullptr) {
    const int64_t prows = p.rows > 0 ? plan.partial_rows : 0;  // no rows: dweight = 0
    sum_partial_rows<T><<<unsigned(ceil_div(p.hidden, 32)), dim3(32, 32), 0, s>>>(
        dweight, workspace, prows, p.hidden);
  }
  return int(cudaGetLastError());
}

inline bool problem_ok(const AddRmsNormProblem& p) { return p.rows >= 0 && p.hidden >= 1; }

int fwd(void* y, void* h, float* rstd, const void* x, const void* res, const void* weight,
        const AddRmsNormProblem& p, void* stream) {
  if (!problem_ok(p)) return int(cudaErrorInvalidValue);
  if (p.rows == 0) return 0;
  if (y == nullptr || h == nullptr || x == nullptr || res == nullptr)
    return int(cudaErrorInvalidValue);
  const bool aligned =
      aligned16(y) && aligned16(h) && aligned16(x) && aligned16(res) && aligned16(weight);
  const Layout l = fwd_layout(p, aligned);
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_fwd<T>(static_cast<T*>(y), static_cast<T*>(h), rstd, static_cast<const T*>(x),
                         static_cast<const T*>(res), static_cast<const T*>(weight), p, l,
                         static_cast<cudaStream_t>(stream));
  });
}

int64_t bwd_workspace_floats(const AddRmsNormProblem& p, int sm_count) {
  if (p.rows <= 0 || p.hidden < 1) return 0;
  // The pointers (and whether dh is given) are not known here: size for either plan.
  int64_t rows = bwd_plan(p, false, sm_count).partial_rows;
  if (p.hidden % vec_elems(p.dtype) == 0)
    rows = std::max(rows, bwd_plan(p, true, sm_count).partial_rows);
  return rows * p.hidden;
}

int bwd(void* dx, void* dweight, const void* dy, const void* dh, const void* h, const void* weight,
        const float* rstd, float* workspace, int sm_count, const AddRmsNormProblem& p,
        void* stream) {
  if (!problem_ok(p)) return int(cudaErrorInvalidValue);
  if (p.rows == 0 && dweight == nullptr) return 0;
  if (p.rows > 0 && (dx == nullptr || dy == nullptr || h == nullptr || rstd == nullptr ||
                     (dweight != nullptr && workspace == nullptr)))
    return int(cudaErrorInvalidValue);
  const int n = vec_elems(p.dtype);
  const bool vectorized = p.hidden % n == 0 && p.h_row_stride % n == 0 &&
                          p.dy_row_stride % n == 0 && (dh == nullptr || p.dh_row_stride % n == 0) &&
                          aligned16(dx) && aligned16(dy) && aligned16(dh) && aligned16(h) &&
                          aligned16(weight) && aligned16(workspace);
  const BwdPlan plan = p.rows > 0 ? bwd_plan(p, vectorized, sm_count) : BwdPlan{};
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_bwd<T>(static_cast<T*>(dx), static_cast<T*>(dweight), static_cast<const T*>(dy),
                         static_cast<const T*>(dh), static_cast<const T*>(h),
                         static_cast<const T*>(weight), rstd, workspace, p, plan,
                         static_cast<cudaStream_t>(stream));
  });
}

}  // namespace add_rms_norm_detail

int add_rms_norm_fwd_cuda(void* y, void* h, float* rstd, const void* x, const void* residual,
                          const void* weight, const AddRmsNormProblem& p, void* stream) {
  return add_rms_norm_detail::fwd(y, h, rstd, x, residual, weight, p, stream);
}

int64_t add_rms_norm_bwd_cuda_workspace_floats(const AddRmsNormProblem& p, int sm_count) {
  return add_rms_norm_detail::bwd_workspace_floats(p, sm_count);
}

int add_rms_norm_bwd_cuda(void* dx, void* dweight, const void* dy, const void* dh, const void* h,
                          const void* weight, const float* rstd, float* workspace, int sm_count,
                          const AddRmsNormProblem& p, void* stream) {
  return add_rms_norm_detail::bwd(dx, dweight, dy, dh, h, weight, rstd, workspace, sm_count, p,
                                  stream);
}

}  // namespace kernelgate::kernels
