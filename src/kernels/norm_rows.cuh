// Pieces shared by the row-normalisation kernels of add_rms_norm and layer_norm (the layout ideas
// of rms_norm_cuda.cu): block-wide row sums, element loads of one scalar or one 16-byte vector,
// launch layouts, persistent-grid sizing and the fixed-order reduction of per-block partial sums.
// Included only by .cu files.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/dtype.h"
#include "kernels/vec16.cuh"

namespace kernelgate::kernels::norm_rows {

using namespace vec;  // to_float, from_float, Vec, unpack, pack

constexpr int64_t kMaxWorkspaceFloats = int64_t{1} << 25;  // 128 MiB: caps the bwd grid
constexpr int64_t kL2SumsFloats = int64_t{6} << 20;        // sums kept in global memory stay in L2

// ---------------------------------------------------------------- device helpers
// Sum of v over the blockDim.x threads that share a row (threadIdx.y). blockDim.x is a power of
// two up to 32 (several rows per warp) or a multiple of 32; the block is whole warps. Callers
// alternate two `red` buffers between consecutive calls: a fast thread's next write then lands
// in the other buffer, fenced by that buffer's barrier, never in one still being read.
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

// Two sums at once (one barrier instead of two); same buffer rule as row_sum.
__device__ __forceinline__ float2 row_sum2(float a, float b, float2* red) {
  const int tpr = blockDim.x;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    if (o < tpr) {
      a += __shfl_xor_sync(0xffffffffu, a, o);
      b += __shfl_xor_sync(0xffffffffu, b, o);
    }
  if (tpr <= 32) return make_float2(a, b);
  const int wpr = tpr >> 5;
  if ((threadIdx.x & 31) == 0) red[threadIdx.y * wpr + (threadIdx.x >> 5)] = make_float2(a, b);
  __syncthreads();
  float2 s = make_float2(0.f, 0.f);
  for (int i = 0; i < wpr; ++i) {
    const float2 t = red[threadIdx.y * wpr + i];
    s.x += t.x;
    s.y += t.y;
  }
  return s;
}

// v rounded to T and back: what a tensor of dtype T holds after storing v.
template <class T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// Bits of a 16-byte vector whose every element is 1 (or 0) in T: a missing weight (bias) costs
// nothing in the loops.
template <class T>
__device__ __forceinline__ uint4 ones_vec() {
  constexpr uint32_t k = sizeof(T) == 4              ? 0x3f800000u
                         : std::is_same_v<T, __half> ? 0x3c003c00u
                                                     : 0x3f803f80u;
  return make_uint4(k, k, k, k);
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
// W elements of an optional vector at column c (null: `fill`).
template <class T, int W>
__device__ __forceinline__ void load_or(const T* v, int64_t c, float fill, float (&f)[W]) {
  if (v != nullptr) {
    load_elems<T, W>(v + c, f);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) f[i] = fill;
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
// float32 sums of W columns (W a multiple of 4 travels as float4).
template <int W>
__device__ __forceinline__ void add_sums(float* p, const float (&f)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W; i += 4) {
      float4& a = *reinterpret_cast<float4*>(p + i);
      a.x += f[i], a.y += f[i + 1], a.z += f[i + 2], a.w += f[i + 3];
    }
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) p[i] += f[i];
  }
}
template <int W>
__device__ __forceinline__ void store_sums(float* p, const float (&f)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W; i += 4)
      *reinterpret_cast<float4*>(p + i) = make_float4(f[i], f[i + 1], f[i + 2], f[i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) p[i] = f[i];
  }
}

// Adds the register-held column sums of a block's row slots (threadIdx.y) into slot 0's, a tree
// through shared memory: at stride s, slot y with y % 2s == s hands its sums to slot y - s. `buf`
// holds (blockDim.y / 2) * nvec * kN floats. Every thread of the block must call it (barriers);
// it starts with a barrier, so back-to-back calls may share `buf`.
template <int VPT, int kN>
__device__ __forceinline__ void combine_row_slots(float (&acc)[VPT][kN], float* buf, int nvec) {
  const int ty = threadIdx.y, rpb = blockDim.y, hidden = nvec * kN;
  for (int s = 1; s < rpb; s *= 2) {
    __syncthreads();
    if (ty % (2 * s) == s) {
      float* b = buf + (ty / (2 * s)) * hidden;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < nvec) store_sums<kN>(b + j * kN, acc[k]);
      }
    }
    __syncthreads();
    if (ty % (2 * s) == 0 && ty + s < rpb) {
      const float* b = buf + (ty / (2 * s)) * hidden;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < nvec)
#pragma unroll
          for (int i = 0; i < kN; ++i) acc[k][i] += b[j * kN + i];
      }
    }
  }
}

// out[c] = sum over partial rows p of partial[p * hidden + c], in a fixed order (deterministic for
// a given launch plan). A block covers 32 columns; its 32 thread rows each sum a strided subset.
// partial_rows == 0 writes zeros.
template <class T>
__global__ void __launch_bounds__(1024)
    sum_partial_rows(T* __restrict__ out, const float* __restrict__ partial, int64_t partial_rows,
                     int64_t hidden) {
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
  out[c] = from_float<T>(t);
}

// ---------------------------------------------------------------- launch planning
// Threads per row (tpr) x rows per block (rpb). tpr is a power of two up to 32 or a multiple
// of 32; tpr * rpb is a multiple of 32.
struct Layout {
  int vpt = 0;    // 16-byte vectors per thread (row in registers), or 0 (general, multi-pass)
  int width = 1;  // general path: elements per access (1, or a 16-byte vector)
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

// Row in registers: `pref_vpt` vectors per thread (fewer for short rows), doubled while the row
// needs more than max_threads threads; vpt == 0 when even max_vpt does not fit.
inline Layout registers_layout(int64_t nvec, int pref_vpt, int max_vpt, int max_threads,
                               int min_block) {
  int vpt = pref_vpt;
  while (vpt > 1 && vpt / 2 >= nvec) vpt /= 2;
  while (vpt <= max_vpt && ceil_div(nvec, vpt) > max_threads) vpt *= 2;
  if (vpt > max_vpt) return {};
  const int tpr = round_threads(ceil_div(nvec, vpt));
  return {vpt, 1, tpr, rows_per_block(tpr, min_block)};
}

// About 4 vectors or 16 scalars per thread and pass, at most max_threads threads per row.
inline Layout general_layout(int64_t hidden, int width, int max_threads, int min_block) {
  const int64_t per_thread = width > 1 ? 4 : 16;
  const int tpr =
      round_threads(std::min<int64_t>(ceil_div(ceil_div(hidden, width), per_thread), max_threads));
  return {0, width, tpr, rows_per_block(tpr, min_block)};
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

// Dynamic shared memory a block may opt into on the current device, less room for the kernels'
// static buffers; 48 KiB if the device cannot be asked.
inline size_t smem_limit() {
  int dev = 0, bytes = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 48 * 1024;
  }
  return size_t(std::max(bytes, 48 * 1024 + 1024)) - 1024;
}

// Blocks of a persistent grid: as many as are resident at once (at most max_per_sm per SM, the
// occupancy query permitting), never more than `groups` (row groups). If a query fails, the cap
// is used (an upper bound); the opt-in for dynamic shared memory is set here, before any launch.
inline int64_t persistent_blocks(const void* kernel, int threads, size_t smem, int sm_count,
                                 int max_per_sm, int64_t groups) {
  int per_sm = std::max(1, max_per_sm);
  int occ = 0;
  if ((smem == 0 || cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(smem)) == cudaSuccess) &&
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, smem) == cudaSuccess &&
      occ > 0) {
    per_sm = std::min(per_sm, occ);
  } else {
    (void)cudaGetLastError();  // not to be reported by a later launch
  }
  return std::max<int64_t>(1, std::min<int64_t>(groups, int64_t(per_sm) * std::max(1, sm_count)));
}

}  // namespace kernelgate::kernels::norm_rows
