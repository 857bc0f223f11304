// rms_norm CUDA kernels (contract in rms_norm.h).
//
// Two layouts per direction:
//  * "row in registers": each thread loads VPT 16-byte vectors of the row before using any,
//    so every input is read once. Needs 16-byte aligned pointers and row starts (strides and
//    hidden multiples of 16 / sizeof(T)) and a row that fits: up to 8192 vectors forward
//    (65536 bf16), 4096 backward (32768 bf16).
//  * "two pass": any hidden; 16-byte accesses when aligned as above, scalar ones otherwise.
//    The second pass re-reads the row, mostly from L1/L2. Correct for everything; only the
//    aligned variant is meant to be fast (scalar rows run at about a third of bandwidth).
// Backward is a persistent grid: each block keeps float32 dweight sums for its columns and
// writes them as one partial row to the workspace; rms_norm_bwd_sum_partials then reduces the
// rows in a fixed order, so results are deterministic for a given (problem, sm_count, device).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/rms_norm.h"
#include "kernels/vec16.cuh"

namespace kernelgate::kernels {
namespace rms_norm_detail {

constexpr int kFwdMaxThreads = 1024;
constexpr int kBwdMaxThreads = 512;  // 128 registers: x, dy and dweight sums per thread
constexpr int64_t kMaxWorkspaceFloats = int64_t{1} << 25;  // 128 MiB: caps the bwd grid
constexpr int64_t kL2SumsFloats = int64_t{6} << 20;        // 24 MiB

using namespace vec;  // to_float, from_float, Vec, unpack, pack: kernels/vec16.cuh

// ---------------------------------------------------------------- row reduction
// Sum of v over the blockDim.x threads that share a row (threadIdx.y). blockDim.x is a power
// of two below 32 (several rows per warp) or a multiple of 32; the block is whole warps.
// `red` must not be reused by the next call before every thread has read it: callers in a loop
// alternate two buffers (a fast thread's next write is fenced by the other buffer's barrier).
__device__ __forceinline__ float row_sum(float v, float* red) {
  const int tpr = blockDim.x;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    if (o < tpr) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (tpr <= 32) return v;
  const int wpr = tpr >> 5;
  if ((threadIdx.x & 31) == 0) red[threadIdx.y * wpr + (threadIdx.x >> 5)] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < wpr; ++i) s += red[threadIdx.y * wpr + i];
  return s;
}

// ---------------------------------------------------------------- forward kernels
template <class T, int VPT>
__global__ void __launch_bounds__(VPT >= 8 ? 512 : kFwdMaxThreads)
    rms_norm_fwd_row_in_registers(T* __restrict__ y, float* __restrict__ rstd,
                                  const T* __restrict__ x, const T* __restrict__ weight,
                                  int64_t rows, int nvec, int64_t x_stride, float eps) {
  constexpr int kN = Vec<T>::kN;
  __shared__ float red[2][32];
  const float hidden_f = float(nvec) * kN;
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
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      float f[kN];
      unpack<T>(xv[k], f);
#pragma unroll
      for (int i = 0; i < kN; ++i) ss += f[i] * f[i];
    }
    ss = row_sum(ss, red[parity]);
    parity ^= 1;
    const float r = 1.f / sqrtf(ss / hidden_f + eps);
    if (!valid) continue;
    if (rstd != nullptr && threadIdx.x == 0) rstd[row] = r;
    uint4* yr = reinterpret_cast<uint4*>(y + row * nvec * kN);
    const uint4* wr = reinterpret_cast<const uint4*>(weight);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j >= nvec) break;
      float f[kN], w[kN];
      unpack<T>(xv[k], f);
      if (weight != nullptr) {
        unpack<T>(wr[j], w);
      } else {
#pragma unroll
        for (int i = 0; i < kN; ++i) w[i] = 1.f;
      }
#pragma unroll
      for (int i = 0; i < kN; ++i) f[i] = f[i] * r * w[i];
      yr[j] = pack<T>(f);
    }
  }
}

// W elements at p: one scalar (W == 1) or one 16-byte vector (W == Vec<T>::kN).
template <class T, int W>
__device__ __forceinline__ void load_elems(const T* p, float (&f)[W]) {
  if constexpr (W == 1) {
    f[0] = to_float(*p);
  } else {
    unpack<T>(*reinterpret_cast<const uint4*>(p), f);
  }
}
template <class T, int W>
__device__ __forceinline__ void load_weight(const T* w, int64_t c, float (&f)[W]) {
  if (w != nullptr) {
    load_elems<T, W>(w + c, f);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) f[i] = 1.f;
  }
}
template <class T, int W>
__device__ __forceinline__ void store_elems(T* p, const float (&f)[W]) {
  if constexpr (W == 1) {
    *p = from_float<T>(f[0]);
  } else {
    *reinterpret_cast<uint4*>(p) = pack<T>(f);
  }
}

// W > 1 needs the row-in-registers alignment (hidden % W == 0 included); the second pass
// re-reads the row, mostly from L2.
template <class T, int W>
__global__ void __launch_bounds__(kFwdMaxThreads)
    rms_norm_fwd_two_pass(T* __restrict__ y, float* __restrict__ rstd, const T* __restrict__ x,
                          const T* __restrict__ weight, int64_t rows, int64_t hidden,
                          int64_t x_stride, float eps) {
  __shared__ float red[2][32];
  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  const int64_t c0 = int64_t(threadIdx.x) * W, cstep = int64_t(blockDim.x) * W;
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const T* xr = x + row * x_stride;
    float ss = 0.f;
    if (valid) {
#pragma unroll(W == 1 ? 8 : 4)
      for (int64_t c = c0; c < hidden; c += cstep) {
        float f[W];
        load_elems<T, W>(xr + c, f);
#pragma unroll
        for (int i = 0; i < W; ++i) ss += f[i] * f[i];
      }
    }
    ss = row_sum(ss, red[parity]);
    parity ^= 1;
    const float r = 1.f / sqrtf(ss / float(hidden) + eps);
    if (!valid) continue;
    if (rstd != nullptr && threadIdx.x == 0) rstd[row] = r;
    T* yr = y + row * hidden;
#pragma unroll(W == 1 ? 8 : 4)
    for (int64_t c = c0; c < hidden; c += cstep) {
      float f[W], w[W];
      load_elems<T, W>(xr + c, f);
      load_weight<T, W>(weight, c, w);
#pragma unroll
      for (int i = 0; i < W; ++i) f[i] = f[i] * r * w[i];
      store_elems<T, W>(yr + c, f);
    }
  }
}

// ---------------------------------------------------------------- backward kernels
// dw_partial (null when dweight is not wanted) receives row blockIdx.x of [gridDim.x, hidden].
// VPT <= 4 keeps the dweight sums in registers and combines the block's row slots through
// dynamic shared memory ((rows per block / 2) * hidden floats) at the end; VPT == 8 is only
// launched with one row per block and keeps them in dynamic shared memory (hidden floats),
// which leaves registers for eight vectors of x and dy.
template <class T, int VPT>
__global__ void __launch_bounds__(kBwdMaxThreads, 1)
    rms_norm_bwd_row_in_registers(T* __restrict__ dx, float* __restrict__ dw_partial,
                                  const T* __restrict__ dy, const T* __restrict__ x,
                                  const T* __restrict__ weight, const float* __restrict__ rstd,
                                  int64_t rows, int nvec, int64_t x_stride, int64_t dy_stride) {
  constexpr int kN = Vec<T>::kN;
  constexpr bool kSumsInSmem = VPT >= 8;
  constexpr int kRegVecs = kSumsInSmem ? 1 : VPT;
  __shared__ float red[2][32];
  extern __shared__ float4 smem[];
  const float hidden_f = float(nvec) * kN;
  const uint4* wr = reinterpret_cast<const uint4*>(weight);
  // Bits of 1.0 in T, so a null weight costs nothing in the loop.
  constexpr uint32_t kOne = sizeof(T) == 4              ? 0x3f800000u
                            : std::is_same_v<T, __half> ? 0x3c003c00u
                                                        : 0x3f803f80u;
  float acc[kRegVecs][kN];
#pragma unroll
  for (int k = 0; k < kRegVecs; ++k)
#pragma unroll
    for (int i = 0; i < kN; ++i) acc[k][i] = 0.f;
  // Column sums in shared memory: each thread owns its columns, so no barrier is needed.
  if (kSumsInSmem && dw_partial != nullptr)
    for (int j = threadIdx.x; j < nvec; j += blockDim.x)
#pragma unroll
      for (int i = 0; i < kN / 4; ++i) smem[j * kN / 4 + i] = make_float4(0.f, 0.f, 0.f, 0.f);

  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const uint4* xr = reinterpret_cast<const uint4*>(x + row * x_stride);
    const uint4* dyr = reinterpret_cast<const uint4*>(dy + row * dy_stride);
    // weight is re-read per row and pass (L1 hits) rather than held: registers go to the
    // dweight sums, or to more vectors of x and dy.
    auto weight_vec = [&](int j, bool in) {
      return (in && weight != nullptr) ? wr[j] : make_uint4(kOne, kOne, kOne, kOne);
    };
    uint4 xv[VPT], dyv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      const bool in = valid && j < nvec;
      xv[k] = in ? xr[j] : make_uint4(0, 0, 0, 0);
      dyv[k] = in ? dyr[j] : make_uint4(0, 0, 0, 0);
    }
    const float r = valid ? rstd[row] : 0.f;
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      float xf[kN], gf[kN], wf[kN];
      unpack<T>(xv[k], xf);
      unpack<T>(dyv[k], gf);
      unpack<T>(weight_vec(j, valid && j < nvec), wf);
#pragma unroll
      for (int i = 0; i < kN; ++i) dot += (gf[i] * wf[i]) * (xf[i] * r);
    }
    dot = row_sum(dot, red[parity]);
    parity ^= 1;
    const float mean = dot / hidden_f;
    uint4* dxr = reinterpret_cast<uint4*>(dx + row * nvec * kN);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      float xf[kN], dyf[kN], wf[kN], o[kN], dw[kN];
      unpack<T>(xv[k], xf);
      unpack<T>(dyv[k], dyf);
      unpack<T>(weight_vec(j, valid && j < nvec), wf);
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const float xhat = xf[i] * r;
        o[i] = r * (dyf[i] * wf[i] - xhat * mean);
        dw[i] = dyf[i] * xhat;
      }
      if (valid && j < nvec) {
        dxr[j] = pack<T>(o);
        if (kSumsInSmem && dw_partial != nullptr)
#pragma unroll
          for (int i = 0; i < kN; i += 4) {
            float4& a = smem[(j * kN + i) / 4];
            a.x += dw[i], a.y += dw[i + 1], a.z += dw[i + 2], a.w += dw[i + 3];
          }
      }
      if constexpr (!kSumsInSmem)
#pragma unroll
        for (int i = 0; i < kN; ++i) acc[k][i] += dw[i];
    }
  }
  if (dw_partial == nullptr) return;
  float4* out = reinterpret_cast<float4*>(dw_partial + int64_t(blockIdx.x) * nvec * kN);
  if constexpr (kSumsInSmem) {
    for (int j = threadIdx.x; j < nvec; j += blockDim.x)
#pragma unroll
      for (int i = 0; i < kN / 4; ++i) out[j * kN / 4 + i] = smem[j * kN / 4 + i];
    return;
  }
  // Tree over the row slots: at stride s, slot y (y % 2s == s) hands its sums to slot y - s.
  const int ty = threadIdx.y, nq = nvec * kN / 4;
  for (int s = 1; s < int(blockDim.y); s *= 2) {
    __syncthreads();
    if (ty % (2 * s) == s) {
      float4* buf = smem + (ty / (2 * s)) * nq;
#pragma unroll
      for (int k = 0; k < kRegVecs; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < nvec)
#pragma unroll
          for (int i = 0; i < kN; i += 4)
            buf[(j * kN + i) / 4] =
                make_float4(acc[k][i], acc[k][i + 1], acc[k][i + 2], acc[k][i + 3]);
      }
    }
    __syncthreads();
    if (ty % (2 * s) == 0 && ty + s < int(blockDim.y)) {
      const float4* buf = smem + (ty / (2 * s)) * nq;
#pragma unroll
      for (int k = 0; k < kRegVecs; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < nvec)
#pragma unroll
          for (int i = 0; i < kN; i += 4) {
            const float4 c = buf[(j * kN + i) / 4];
            acc[k][i] += c.x, acc[k][i + 1] += c.y, acc[k][i + 2] += c.z, acc[k][i + 3] += c.w;
          }
      }
    }
  }
  if (ty != 0) return;
#pragma unroll
  for (int k = 0; k < kRegVecs; ++k) {
    const int j = threadIdx.x + k * blockDim.x;
    if (j < nvec)
#pragma unroll
      for (int i = 0; i < kN; i += 4)
        out[(j * kN + i) / 4] = make_float4(acc[k][i], acc[k][i + 1], acc[k][i + 2], acc[k][i + 3]);
  }
}

// W float sums at p (shared or global memory), as 16-byte accesses when W > 1: a thread's W
// sums are contiguous, and scalar accesses would touch W times the sectors per warp.
template <int W>
__device__ __forceinline__ void load_sums(const float* p, float (&a)[W]) {
#pragma unroll
  for (int i = 0; i < W; i += (W > 1 ? 4 : 1)) {
    if constexpr (W == 1) {
      a[0] = *p;
    } else {
      const float4 v = *reinterpret_cast<const float4*>(p + i);
      a[i] = v.x, a[i + 1] = v.y, a[i + 2] = v.z, a[i + 3] = v.w;
    }
  }
}
template <int W>
__device__ __forceinline__ void store_sums(float* p, const float (&a)[W]) {
#pragma unroll
  for (int i = 0; i < W; i += (W > 1 ? 4 : 1)) {
    if constexpr (W == 1) {
      *p = a[0];
    } else {
      *reinterpret_cast<float4*>(p + i) = make_float4(a[i], a[i + 1], a[i + 2], a[i + 3]);
    }
  }
}

// Each row slot (blockIdx.x * blockDim.y + threadIdx.y) owns workspace row `slot`; its sums
// live in dynamic shared memory (rows per block * hidden floats) when sums_in_smem, else
// directly in that workspace row. Each column is only touched by one thread: no barriers.
template <class T, int W>
__global__ void __launch_bounds__(kFwdMaxThreads)
    rms_norm_bwd_two_pass(T* __restrict__ dx, float* __restrict__ dw_partial,
                          const T* __restrict__ dy, const T* __restrict__ x,
                          const T* __restrict__ weight, const float* __restrict__ rstd,
                          int64_t rows, int64_t hidden, int64_t x_stride, int64_t dy_stride,
                          bool sums_in_smem) {
  __shared__ float red[2][32];
  extern __shared__ float4 smem[];
  const int64_t slot = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  float* out = dw_partial == nullptr ? nullptr : dw_partial + slot * hidden;
  float* acc = sums_in_smem ? reinterpret_cast<float*>(smem) + threadIdx.y * hidden : out;
  const int64_t c0 = int64_t(threadIdx.x) * W, cstep = int64_t(blockDim.x) * W;
  if (out != nullptr)
    for (int64_t c = c0; c < hidden; c += cstep) {
      float z[W] = {};
      store_sums<W>(acc + c, z);
    }
  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const T* xr = x + row * x_stride;
    const T* dyr = dy + row * dy_stride;
    const float r = valid ? rstd[row] : 0.f;
    float dot = 0.f;
    if (valid) {
#pragma unroll(W == 1 ? 8 : 4)
      for (int64_t c = c0; c < hidden; c += cstep) {
        float xf[W], gf[W], wf[W];
        load_elems<T, W>(xr + c, xf);
        load_elems<T, W>(dyr + c, gf);
        load_weight<T, W>(weight, c, wf);
#pragma unroll
        for (int i = 0; i < W; ++i) dot += (gf[i] * wf[i]) * (xf[i] * r);
      }
    }
    dot = row_sum(dot, red[parity]);
    parity ^= 1;
    if (!valid) continue;
    const float mean = dot / float(hidden);
    T* dxr = dx + row * hidden;
#pragma unroll(W == 1 ? 8 : 4)
    for (int64_t c = c0; c < hidden; c += cstep) {
      float xf[W], gf[W], wf[W], o[W];
      load_elems<T, W>(xr + c, xf);
      load_elems<T, W>(dyr + c, gf);
      load_weight<T, W>(weight, c, wf);
      float dw[W];
#pragma unroll
      for (int i = 0; i < W; ++i) {
        const float xhat = xf[i] * r;
        o[i] = r * (gf[i] * wf[i] - xhat * mean);
        dw[i] = gf[i] * xhat;
      }
      store_elems<T, W>(dxr + c, o);
      if (out != nullptr) {
        float a[W];
        load_sums<W>(acc + c, a);
#pragma unroll
        for (int i = 0; i < W; ++i) a[i] += dw[i];
        store_sums<W>(acc + c, a);
      }
    }
  }
  if (out != nullptr && sums_in_smem)
    for (int64_t c = c0; c < hidden; c += cstep) {
      float a[W];
      load_sums<W>(acc + c, a);
      store_sums<W>(out + c, a);
    }
}

// dweight[c] = sum over partial rows p of partial[p, c], in a fixed order. A block covers 32
// columns; its 32 thread rows each sum a strided subset of the partial rows.
template <class T>
__global__ void __launch_bounds__(1024)
    rms_norm_bwd_sum_partials(T* __restrict__ dweight, const float* __restrict__ partial,
                              int64_t partial_rows, int64_t hidden) {
  __shared__ float part[32][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (c < hidden) {
#pragma unroll 8
    for (int64_t p = threadIdx.y; p < partial_rows; p += 32) s += partial[p * hidden + c];
  }
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= hidden) return;
  float t = 0.f;
  for (int i = 0; i < 32; ++i) t += part[i][threadIdx.x];
  dweight[c] = from_float<T>(t);
}

// ---------------------------------------------------------------- launch planning
// Threads per row (tpr) x rows per block (rpb). tpr is a power of two below 32 or a multiple
// of 32; tpr * rpb is a multiple of 32.
struct Layout {
  int vpt = 0;    // 16-byte vectors per thread (row in registers), or 0 (two pass)
  int width = 1;  // two pass: elements per access (1, or a 16-byte vector)
  int tpr = 0;
  int rpb = 0;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int round_threads(int64_t n) {
  if (n >= 32) return int(ceil_div(n, 32) * 32);
  int t = 1;
  while (t < n) t <<= 1;
  return t;
}
inline int rows_per_block(int tpr, int min_block) { return std::max(1, min_block / tpr); }

// Row in registers: `pref_vpt` vectors per thread, doubled while the row needs more threads
// than max_threads(vpt); vpt == 0 when the row does not fit.
template <class MaxThreads>
inline Layout registers_layout(int64_t nvec, int pref_vpt, int max_vpt, MaxThreads max_threads,
                               int min_block) {
  int vpt = pref_vpt;
  while (vpt > 1 && vpt / 2 >= nvec) vpt /= 2;
  while (vpt <= max_vpt && ceil_div(nvec, vpt) > max_threads(vpt)) vpt *= 2;
  if (vpt > max_vpt) return {};
  const int tpr = round_threads(ceil_div(nvec, vpt));
  return {vpt, 1, tpr, rows_per_block(tpr, min_block)};
}

// About 4 vectors or 16 scalars per thread and pass, at most one block of threads per row.
inline Layout two_pass_layout(int64_t hidden, int width) {
  const int64_t per_thread = width > 1 ? 4 : 16;
  const int tpr = round_threads(
      std::min<int64_t>(ceil_div(ceil_div(hidden, width), per_thread), kFwdMaxThreads));
  return {0, width, tpr, rows_per_block(tpr, 256)};
}

template <class T>
struct Tag {
  using type = T;
};
template <class F>
int dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: return f(Tag<float>{});
    case DType::kFloat16: return f(Tag<__half>{});
    case DType::kBFloat16: return f(Tag<__nv_bfloat16>{});
  }
  return int(cudaErrorInvalidValue);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
inline int vec_elems(DType t) { return 16 / dtype_size(t); }

// Shapes whose every row start is 16-byte aligned once the base pointers are.
inline bool rows_vectorizable(const RmsNormProblem& p, bool bwd) {
  const int n = vec_elems(p.dtype);
  return p.hidden % n == 0 && p.x_row_stride % n == 0 && (!bwd || p.dy_row_stride % n == 0);
}

// Tunables of the layouts (the defaults are what the entry points use).
// Measured on H200 (bf16, 16384 rows): more than 512 threads per row in the forward, or 256
// in the backward (whose threads hold twice the data), leave one block per SM, and an SM
// whose only block waits at a row reduction has no loads in flight; wider vectors do better.
struct Tuning {
  int fwd_vpt = 4, fwd_min_block = 128, fwd_max_threads = 512;
  int bwd_vpt = 4, bwd_min_block = 128, bwd_max_blocks_per_sm = 4, bwd_max_threads = 256;
  size_t bwd_two_pass_max_smem = 200 * 1024;  // for its dweight sums, else they go to L2
};

inline Layout fwd_layout(const RmsNormProblem& p, const void* y, const void* x, const void* weight,
                         const Tuning& t) {
  const int n = vec_elems(p.dtype);
  if (!rows_vectorizable(p, false) || !aligned16(x) || !aligned16(y) || !aligned16(weight))
    return two_pass_layout(p.hidden, 1);
  const Layout l = registers_layout(
      p.hidden / n, t.fwd_vpt, 16,
      [&](int vpt) { return std::min(t.fwd_max_threads, vpt >= 8 ? 512 : kFwdMaxThreads); },
      t.fwd_min_block);
  // vpt >= 8 kernels are built for at most 512 threads.
  if (l.vpt != 0 && l.tpr * l.rpb <= (l.vpt >= 8 ? 512 : kFwdMaxThreads)) return l;
  return two_pass_layout(p.hidden, n);
}

inline Layout bwd_registers_layout(const RmsNormProblem& p, const Tuning& t) {
  if (!rows_vectorizable(p, true)) return {};
  Layout l = registers_layout(
      p.hidden / vec_elems(p.dtype), t.bwd_vpt, 8,
      [&](int vpt) {
        return vpt >= 8 ? kBwdMaxThreads : std::min(t.bwd_max_threads, kBwdMaxThreads);
      },
      t.bwd_min_block);
  if (l.vpt >= 8) {  // sums in shared memory are per block: one row of whole warps
    l.rpb = 1;
    if (l.tpr < 32) l = {};
  }
  return l;
}

struct BwdPlan {
  Layout layout;
  int64_t blocks = 0;
  int64_t partial_rows = 0;  // rows of `hidden` floats the launch writes to the workspace
  size_t smem = 0;           // dynamic shared memory (only used when dweight is wanted)
};

template <class T>
const void* bwd_kernel(const Layout& l) {
  constexpr int kN = Vec<T>::kN;
  switch (l.vpt) {
    case 1: return reinterpret_cast<const void*>(&rms_norm_bwd_row_in_registers<T, 1>);
    case 2: return reinterpret_cast<const void*>(&rms_norm_bwd_row_in_registers<T, 2>);
    case 4: return reinterpret_cast<const void*>(&rms_norm_bwd_row_in_registers<T, 4>);
    case 8: return reinterpret_cast<const void*>(&rms_norm_bwd_row_in_registers<T, 8>);
  }
  return l.width == 1 ? reinterpret_cast<const void*>(&rms_norm_bwd_two_pass<T, 1>)
                      : reinterpret_cast<const void*>(&rms_norm_bwd_two_pass<T, kN>);
}

// Dynamic shared memory a block may opt into on the current device, less room for the
// kernels' static buffers; 48 KiB if the device cannot be asked.
inline size_t smem_limit() {
  int dev = 0, bytes = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 48 * 1024;
  }
  return size_t(std::max(bytes, 48 * 1024 + 1024)) - 1024;
}

// Layout, dynamic shared memory and persistent grid of a backward launch: as many blocks as
// fit on the GPU at once (at most max_per_sm per SM), never more than there are row groups.
// Workspace sizing and launch both come here, so they agree; if the occupancy query fails,
// both use the cap (an upper bound). `vectorized`: rows and pointers allow 16-byte accesses.
inline BwdPlan bwd_plan(const RmsNormProblem& p, bool vectorized, int sm_count, const Tuning& t) {
  BwdPlan plan;
  const size_t row_bytes = size_t(p.hidden) * sizeof(float), limit = smem_limit();
  Layout l = vectorized ? bwd_registers_layout(p, t) : Layout{};
  if (l.vpt >= 8) {
    plan.smem = row_bytes;
  } else if (l.vpt != 0 && l.rpb > 1) {
    plan.smem = size_t(l.rpb / 2) * row_bytes;
  }
  if (l.vpt == 0 || plan.smem > limit) {
    l = two_pass_layout(p.hidden, vectorized ? vec_elems(p.dtype) : 1);
    plan.smem = size_t(l.rpb) * row_bytes;
    if (plan.smem > std::min(t.bwd_two_pass_max_smem, limit)) plan.smem = 0;
  }
  plan.layout = l;
  const void* kernel = nullptr;
  dispatch_dtype(p.dtype, [&](auto tag) {
    kernel = bwd_kernel<typename decltype(tag)::type>(l);
    return 0;
  });
  const int threads = l.tpr * l.rpb;
  int per_sm = std::max(1, std::min(t.bwd_max_blocks_per_sm, 2048 / threads));
  int occ = 0;
  // The opt-in covers dynamic + static shared memory: set it whenever dynamic memory is used
  // (48 KiB of dynamic memory plus the kernel's static buffers already needs it).
  if ((plan.smem == 0 || cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              int(plan.smem)) == cudaSuccess) &&
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, plan.smem) ==
          cudaSuccess &&
      occ > 0) {
    per_sm = std::min(per_sm, occ);
  } else {
    (void)cudaGetLastError();  // not to be reported by a later launch
  }
  const int64_t slots = l.vpt != 0 ? 1 : l.rpb;  // partial rows per block
  // Two pass with sums in the workspace itself: each row adds to them, so keep them within L2.
  const int64_t max_floats = l.vpt == 0 && plan.smem == 0 ? kL2SumsFloats : kMaxWorkspaceFloats;
  plan.blocks = std::min(ceil_div(p.rows, l.rpb), int64_t(per_sm) * std::max(1, sm_count));
  plan.blocks = std::max<int64_t>(1, std::min(plan.blocks, max_floats / (slots * p.hidden)));
  plan.partial_rows = plan.blocks * slots;
  return plan;
}

// ---------------------------------------------------------------- launchers
template <class T>
int launch_fwd(T* y, float* rstd, const T* x, const T* w, const RmsNormProblem& p, const Layout& l,
               cudaStream_t s) {
  constexpr int kN = Vec<T>::kN;
  const dim3 block(l.tpr, l.rpb);
  const unsigned grid = unsigned(std::min<int64_t>(ceil_div(p.rows, l.rpb), 1 << 30));
  const int nvec = int(p.hidden / kN);
  switch (l.vpt) {
#define KG_RMS_FWD_CASE(V)                                                           \
  case V:                                                                            \
    rms_norm_fwd_row_in_registers<T, V>                                              \
        <<<grid, block, 0, s>>>(y, rstd, x, w, p.rows, nvec, p.x_row_stride, p.eps); \
    break;
    KG_RMS_FWD_CASE(1)
    KG_RMS_FWD_CASE(2)
    KG_RMS_FWD_CASE(4)
    KG_RMS_FWD_CASE(8)
    KG_RMS_FWD_CASE(16)
#undef KG_RMS_FWD_CASE
    default:
      if (l.width == 1) {
        rms_norm_fwd_two_pass<T, 1>
            <<<grid, block, 0, s>>>(y, rstd, x, w, p.rows, p.hidden, p.x_row_stride, p.eps);
      } else {
        rms_norm_fwd_two_pass<T, kN>
            <<<grid, block, 0, s>>>(y, rstd, x, w, p.rows, p.hidden, p.x_row_stride, p.eps);
      }
  }
  return int(cudaGetLastError());
}

template <class T>
int launch_bwd(T* dx, T* dweight, const T* dy, const T* x, const T* w, const float* rstd,
               float* workspace, const RmsNormProblem& p, const BwdPlan& plan, cudaStream_t s) {
  constexpr int kN = Vec<T>::kN;
  const Layout& l = plan.layout;
  float* partial = dweight != nullptr ? workspace : nullptr;
  if (p.rows > 0) {
    const dim3 block(l.tpr, l.rpb);
    const unsigned grid = unsigned(plan.blocks);
    const int nvec = int(p.hidden / kN);
    const size_t smem = partial != nullptr ? plan.smem : 0;
    switch (l.vpt) {
#define KG_RMS_BWD_CASE(V)                                                           \
  case V:                                                                            \
    rms_norm_bwd_row_in_registers<T, V><<<grid, block, smem, s>>>(                   \
        dx, partial, dy, x, w, rstd, p.rows, nvec, p.x_row_stride, p.dy_row_stride); \
    break;
      KG_RMS_BWD_CASE(1)
      KG_RMS_BWD_CASE(2)
      KG_RMS_BWD_CASE(4)
      KG_RMS_BWD_CASE(8)
#undef KG_RMS_BWD_CASE
      default:
        if (l.width == 1) {
          rms_norm_bwd_two_pass<T, 1><<<grid, block, smem, s>>>(dx, partial, dy, x, w, rstd, p.rows,
                                                                p.hidden, p.x_row_stride,
                                                                p.dy_row_stride, smem > 0);
        } else {
          rms_norm_bwd_two_pass<T, kN><<<grid, block, smem, s>>>(dx, partial, dy, x, w, rstd,
                                                                 p.rows, p.hidden, p.x_row_stride,
                                                                 p.dy_row_stride, smem > 0);
        }
    }
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return int(e);
  }
  if (dweight != nullptr) {
    const int64_t rows = p.rows > 0 ? plan.partial_rows : 0;  // rows == 0: dweight = 0
    rms_norm_bwd_sum_partials<T><<<unsigned(ceil_div(p.hidden, 32)), dim3(32, 32), 0, s>>>(
        dweight, workspace, rows, p.hidden);
  }
  return int(cudaGetLastError());
}

inline bool problem_ok(const RmsNormProblem& p) { return p.rows >= 0 && p.hidden >= 1; }

int fwd(void* y, float* rstd, const void* x, const void* weight, const RmsNormProblem& p,
        void* stream, const Tuning& t) {
  if (p.rows == 0) return 0;
  if (!problem_ok(p) || y == nullptr || x == nullptr) return int(cudaErrorInvalidValue);
  const Layout l = fwd_layout(p, y, x, weight, t);
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_fwd<T>(static_cast<T*>(y), rstd, static_cast<const T*>(x),
                         static_cast<const T*>(weight), p, l, static_cast<cudaStream_t>(stream));
  });
}

int64_t bwd_workspace_floats(const RmsNormProblem& p, int sm_count, const Tuning& t) {
  if (p.rows <= 0 || p.hidden < 1) return 0;
  // The pointers are not known here: size for either plan the launch may pick.
  int64_t rows = bwd_plan(p, false, sm_count, t).partial_rows;
  if (rows_vectorizable(p, true))
    rows = std::max(rows, bwd_plan(p, true, sm_count, t).partial_rows);
  return rows * p.hidden;
}

int bwd(void* dx, void* dweight, const void* dy, const void* x, const void* weight,
        const float* rstd, float* workspace, int sm_count, const RmsNormProblem& p, void* stream,
        const Tuning& t) {
  if (p.rows == 0 && p.hidden >= 1 && dweight == nullptr) return 0;
  if (!problem_ok(p)) return int(cudaErrorInvalidValue);
  if (p.rows > 0 && (dx == nullptr || dy == nullptr || x == nullptr || rstd == nullptr ||
                     (dweight != nullptr && workspace == nullptr)))
    return int(cudaErrorInvalidValue);
  const bool vectorized = rows_vectorizable(p, true) && aligned16(dx) && aligned16(dy) &&
                          aligned16(x) && aligned16(weight) && aligned16(workspace);
  const BwdPlan plan = p.rows > 0 ? bwd_plan(p, vectorized, sm_count, t) : BwdPlan{};
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_bwd<T>(static_cast<T*>(dx), static_cast<T*>(dweight), static_cast<const T*>(dy),
                         static_cast<const T*>(x), static_cast<const T*>(weight), rstd, workspace,
                         p, plan, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace rms_norm_detail

int rms_norm_fwd_cuda(void* y, float* rstd, const void* x, const void* weight,
                      const RmsNormProblem& p, void* stream) {
  return rms_norm_detail::fwd(y, rstd, x, weight, p, stream, {});
}

int64_t rms_norm_bwd_cuda_workspace_floats(const RmsNormProblem& p, int sm_count) {
  return rms_norm_detail::bwd_workspace_floats(p, sm_count, {});
}

int rms_norm_bwd_cuda(void* dx, void* dweight, const void* dy, const void* x, const void* weight,
                      const float* rstd, float* workspace, int sm_count, const RmsNormProblem& p,
                      void* stream) {
  return rms_norm_detail::bwd(dx, dweight, dy, x, weight, rstd, workspace, sm_count, p, stream, {});
}

}  // namespace kernelgate::kernels
