// Causal depthwise conv1d CUDA kernels (contract in causal_conv1d.h).
//
// x is [batch, seq, dim] with dim contiguous, so a row of x (one time step) is a run of
// channels. A thread owns V consecutive channels (an 8-byte vector; one channel where dim or a
// pointer does not allow a vector) and a tile of consecutive time steps; a warp's 32 threads
// cover 32 * V consecutive channels, so every load and store is coalesced. Walking its tile, a
// thread keeps the last width inputs of its channels in registers (a sliding window) and its
// weights there too: x is read once, plus width - 1 rows before each tile. It loads U rows (8
// forward, 2 backward) before computing any, so U loads per thread are in flight. blockDim.y
// threads take consecutive tiles of the same channels.
//
// Measured on the H200 (B4 T4096 D8192 W4 silu bf16, bench/results/h200/tuning/
// causal_conv1d_variants.json): the forward at 16-byte vectors and 4 rows (136 registers) moved
// 0.40 of the copy bandwidth, at 8 bytes and 8 rows (108) 0.75; capping registers by launch
// bounds spilled and was slower (0.25-0.56), as were 16 rows, a window kept as loaded vectors and
// L2 prefetch hints 8-32 rows ahead (0.65-0.76). A shared-memory ring holding 16 rows per thread
// in flight (cp.async, 72 registers) reached 0.76: past 8 rows, bytes in flight are not the
// limit. The backward's 8 bytes and 2 rows (125 registers) was the best of 4-16 bytes, 2-8 rows.
//
// The backward recomputes the pre-activation from x (nothing is saved but the inputs):
//   g[t] = dy[t] * act'(pre[t]),  dx[t] = sum_j w[j] g[t + width - 1 - j],
//   dw[j] = sum_{b,t} g[t] x[t - (width - 1) + j],  db = sum_{b,t} g[t].
// A tile needs g up to width - 1 steps past its end (recomputed: the next tile's first steps).
// Each block reduces its threads' dw / db partial sums over blockDim.y in shared memory and
// writes one partial per block; a second kernel sums the partials of each channel in block
// order. The sum's order is fixed by the shape: the result does not depend on scheduling.
//
// Positions before t = 0 (and, in the backward, past the end) are zeros that are multiplied like
// any input, as the reference's zero padding is: an infinite weight gives NaN there too. Past the
// end, g is exactly 0 and dx takes no term from it (the reference's gradient has none there).
// Width is
// a template parameter for 2, 3 and 4 (the models' widths); other widths up to 8 take a kernel
// whose window is 8 long and skips the weights it does not have.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/causal_conv1d.h"
#include "kernels/vec16.cuh"

namespace kernelgate::kernels {
namespace causal_conv1d_detail {

constexpr int kCols = 32;  // blockDim.x: threads along channels
constexpr int kRows = 4;   // blockDim.y: threads along time tiles
constexpr int kFwdU = 8;   // rows loaded before computing
constexpr int kBwdU = 2;
constexpr int kMaxW = static_cast<int>(kCausalConv1dMaxWidth);

using vec::from_float;
using vec::to_float;

// V channels at p (aligned to V elements) as floats, and back: one vector access.
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <class T, int V>
__device__ __forceinline__ void load(const T* p, float (&f)[V]) {
  const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int v = 0; v < V; ++v) f[v] = to_float(pk.v[v]);
}

template <class T, int V>
__device__ __forceinline__ void store(T* p, const float (&f)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int v = 0; v < V; ++v) pk.v[v] = from_float<T>(f[v]);
  *reinterpret_cast<Pack<T, V>*>(p) = pk;
}

template <int V>
__device__ __forceinline__ void zero(float (&f)[V]) {
#pragma unroll
  for (int v = 0; v < V; ++v) f[v] = 0.f;
}

// sigmoid(z) from e = exp(-|z|) <= 1: nothing overflows for finite z (silu(-100) = -0).
__device__ __forceinline__ float sigmoid(float z) {
  const float e = __expf(-fabsf(z));
  const float r = 1.f / (1.f + e);
  return z >= 0.f ? r : e * r;
}

// The window is WM long (WM = W, or kMaxW for a runtime width); weight j of a width-`width`
// filter sits at window position j + WM - width, the current input at WM - 1.
template <int W>
struct Width {
  static constexpr int kWM = W > 0 ? W : kMaxW;
  int width;
  __device__ explicit Width(int runtime) : width(W > 0 ? W : runtime) {}
  __device__ __forceinline__ int first() const { return kWM - width; }  // first used position
  __device__ __forceinline__ bool used(int k) const { return W > 0 || k >= first(); }
};

struct Args {
  int64_t seq, dim, tile, tiles_per_batch;
  int width;
  bool silu;
};

// This thread's channels and time tile, or false when it has none.
struct Place {
  int64_t col, batch, t0, t1;
};

template <int V>
__device__ __forceinline__ bool place(const Args& a, Place& p) {
  p.col = (static_cast<int64_t>(blockIdx.y) * kCols + threadIdx.x) * V;
  p.batch = blockIdx.x / a.tiles_per_batch;
  const int64_t tile = (blockIdx.x % a.tiles_per_batch) * kRows + threadIdx.y;
  p.t0 = tile * a.tile;
  p.t1 = min(p.t0 + a.tile, a.seq);
  return p.col < a.dim && p.t0 < a.seq;
}

template <class T, int V, int W>
__device__ __forceinline__ void load_weights(const T* w, const T* b, const Args& a, int64_t col,
                                             float (&wt)[Width<W>::kWM][V], float (&bias)[V]) {
  const Width<W> wd(a.width);
#pragma unroll
  for (int k = 0; k < Width<W>::kWM; ++k) {
#pragma unroll
    for (int v = 0; v < V; ++v) {
      wt[k][v] = wd.used(k) ? to_float(w[(col + v) * wd.width + (k - wd.first())]) : 0.f;
    }
  }
#pragma unroll
  for (int v = 0; v < V; ++v) bias[v] = b != nullptr ? to_float(b[col + v]) : 0.f;
}

// pre-activation at window position i + WM - 1 of xw.
template <int V, int W, int N>
__device__ __forceinline__ void conv(const float (&xw)[N][V], int i, const Width<W>& wd,
                                     const float (&wt)[Width<W>::kWM][V], const float (&bias)[V],
                                     float (&pre)[V]) {
#pragma unroll
  for (int v = 0; v < V; ++v) pre[v] = bias[v];
#pragma unroll
  for (int k = 0; k < Width<W>::kWM; ++k) {
    if (!wd.used(k)) continue;
#pragma unroll
    for (int v = 0; v < V; ++v) pre[v] = fmaf(wt[k][v], xw[i + k][v], pre[v]);
  }
}

template <int U, int V, int N>
__device__ __forceinline__ void shift(float (&w)[N][V]) {
#pragma unroll
  for (int k = 0; k + U < N; ++k) {
#pragma unroll
    for (int v = 0; v < V; ++v) w[k][v] = w[k + U][v];
  }
}

// The window's first WM - 1 rows: x before t0 (zeros before t = 0 and at positions no weight
// reads).
template <class T, int V, int W, int N>
__device__ __forceinline__ void prologue(const T* xb, const Args& a, int64_t t0, const Width<W>& wd,
                                         float (&xw)[N][V]) {
  constexpr int WM = Width<W>::kWM;
#pragma unroll
  for (int k = 0; k < WM - 1; ++k) {
    const int64_t t = t0 - (WM - 1) + k;
    if (t >= 0 && wd.used(k)) {
      load<T, V>(xb + t * a.dim, xw[k]);
    } else {
      zero<V>(xw[k]);
    }
  }
}

template <class T, int V, int W>
__global__ void __launch_bounds__(kCols* kRows) fwd_kernel(T* __restrict__ y, const T* __restrict__ x,
                                                           const T* __restrict__ w,
                                                           const T* __restrict__ b, Args a) {
  constexpr int WM = Width<W>::kWM;
  constexpr int N = WM - 1 + kFwdU;  // window: WM - 1 earlier rows, then the rows computed
  Place p;
  if (!place<V>(a, p)) return;
  const Width<W> wd(a.width);
  float wt[WM][V], bias[V];
  load_weights<T, V, W>(w, b, a, p.col, wt, bias);
  const T* xb = x + p.batch * a.seq * a.dim + p.col;
  T* yb = y + p.batch * a.seq * a.dim + p.col;
  float xw[N][V];
  prologue<T, V, W>(xb, a, p.t0, wd, xw);
  for (int64_t t = p.t0; t < p.t1; t += kFwdU) {
#pragma unroll
    for (int i = 0; i < kFwdU; ++i) {
      if (t + i < p.t1) {
        load<T, V>(xb + (t + i) * a.dim, xw[WM - 1 + i]);
      } else {
        zero<V>(xw[WM - 1 + i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kFwdU; ++i) {
      if (t + i >= p.t1) break;
      float pre[V];
      conv<V, W>(xw, i, wd, wt, bias, pre);
      if (a.silu) {
#pragma unroll
        for (int v = 0; v < V; ++v) pre[v] *= sigmoid(pre[v]);
      }
      store<T, V>(yb + (t + i) * a.dim, pre);
    }
    shift<kFwdU>(xw);
  }
}

template <class T, int V, int W>
__global__ void __launch_bounds__(kCols* kRows)
    bwd_kernel(T* __restrict__ dx, float* __restrict__ part_w, float* __restrict__ part_b,
               const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
               const T* __restrict__ b, Args a) {
  constexpr int WM = Width<W>::kWM;
  constexpr int N = WM - 1 + kBwdU;
  extern __shared__ float red[];  // [kRows][kCols][(WM + 1) * V]: dw and db partials
  constexpr int kSlot = (WM + 1) * V;
  const Width<W> wd(a.width);
  float dw[WM][V], db[V];
#pragma unroll
  for (int k = 0; k < WM; ++k) zero<V>(dw[k]);
  zero<V>(db);
  Place p;  // p.col is set whether or not the thread has work
  if (place<V>(a, p)) {
    float wt[WM][V], bias[V];
    load_weights<T, V, W>(w, b, a, p.col, wt, bias);
    const int64_t base = p.batch * a.seq * a.dim + p.col;
    const T* xb = x + base;
    const T* dyb = dy + base;
    T* dxb = dx != nullptr ? dx + base : nullptr;
    float xw[N][V], gw[N][V];  // x and g at u0 - (WM - 1) + m
    prologue<T, V, W>(xb, a, p.t0, wd, xw);
#pragma unroll
    for (int k = 0; k < WM - 1; ++k) zero<V>(gw[k]);  // g before the tile: never read
    // u runs over the tile and WM - 1 steps past it; dx[t] is made at u = t + WM - 1, from
    // g[u - k] (window position WM - 1 + i - k) times the weight at position k.
    const int64_t u_end = p.t1 + WM - 1;
    for (int64_t u0 = p.t0; u0 < u_end; u0 += kBwdU) {
      float dyv[kBwdU][V];
#pragma unroll
      for (int i = 0; i < kBwdU; ++i) {
        const int64_t u = u0 + i;
        if (u < a.seq && u < u_end) {
          load<T, V>(xb + u * a.dim, xw[WM - 1 + i]);
          load<T, V>(dyb + u * a.dim, dyv[i]);
        } else {
          zero<V>(xw[WM - 1 + i]);
          zero<V>(dyv[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < kBwdU; ++i) {
        const int64_t u = u0 + i;
        float(&g)[V] = gw[WM - 1 + i];
        if (u >= a.seq) {
          zero<V>(g);
        } else if (a.silu) {
          float pre[V];
          conv<V, W>(xw, i, wd, wt, bias, pre);
#pragma unroll
          for (int v = 0; v < V; ++v) {
            const float s = sigmoid(pre[v]);
            g[v] = dyv[i][v] * (s * (1.f + pre[v] * (1.f - s)));
          }
        } else {
#pragma unroll
          for (int v = 0; v < V; ++v) g[v] = dyv[i][v];
        }
        if (u < p.t1) {
#pragma unroll
          for (int k = 0; k < WM; ++k) {
            if (!wd.used(k)) continue;
#pragma unroll
            for (int v = 0; v < V; ++v) dw[k][v] = fmaf(g[v], xw[i + k][v], dw[k][v]);
          }
#pragma unroll
          for (int v = 0; v < V; ++v) db[v] += g[v];
        }
        const int64_t t = u - (WM - 1);
        if (dxb != nullptr && t >= p.t0 && t < p.t1) {
          float acc[V];
          zero<V>(acc);
#pragma unroll
          for (int k = 0; k < WM; ++k) {
            if (!wd.used(k) || u - k >= a.seq) continue;
#pragma unroll
            for (int v = 0; v < V; ++v) acc[v] = fmaf(wt[k][v], gw[WM - 1 + i - k][v], acc[v]);
          }
          store<T, V>(dxb + t * a.dim, acc);
        }
      }
      shift<kBwdU>(xw);
      shift<kBwdU>(gw);
    }
  }
  // Block reduction of dw / db over threadIdx.y, then one partial per block.
  float* mine = red + (threadIdx.y * kCols + threadIdx.x) * kSlot;
#pragma unroll
  for (int k = 0; k < WM; ++k) {
#pragma unroll
    for (int v = 0; v < V; ++v) mine[k * V + v] = dw[k][v];
  }
#pragma unroll
  for (int v = 0; v < V; ++v) mine[WM * V + v] = db[v];
  if (part_w == nullptr && part_b == nullptr) return;  // uniform over the block
  __syncthreads();
  if (threadIdx.y != 0) return;
  const int64_t col = p.col;
  if (col >= a.dim) return;
  for (int r = 1; r < kRows; ++r) {
    const float* other = red + (r * kCols + threadIdx.x) * kSlot;
    for (int s = 0; s < kSlot; ++s) mine[s] += other[s];
  }
  if (part_w != nullptr) {
    float* pw = part_w + static_cast<int64_t>(blockIdx.x) * a.dim * wd.width;
    for (int v = 0; v < V; ++v) {
      for (int j = 0; j < wd.width; ++j) pw[(col + v) * wd.width + j] = mine[(j + wd.first()) * V + v];
    }
  }
  if (part_b != nullptr) {
    float* pb = part_b + static_cast<int64_t>(blockIdx.x) * a.dim;
    for (int v = 0; v < V; ++v) pb[col + v] = mine[WM * V + v];
  }
}

// dweight[d, j] = sum_p part_w[p, d, j]; dbias[d] = sum_p part_b[p, d]; p in order.
template <class T>
__global__ void reduce_kernel(T* __restrict__ dweight, T* __restrict__ dbias,
                              const float* __restrict__ part_w, const float* __restrict__ part_b,
                              int64_t parts, int64_t dim, int width) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nw = dim * width;
  if (i < nw) {
    if (dweight == nullptr) return;
    float s = 0.f;
    for (int64_t p = 0; p < parts; ++p) s += part_w[p * nw + i];
    dweight[i] = from_float<T>(s);
  } else if (i < nw + dim && dbias != nullptr) {
    const int64_t d = i - nw;
    float s = 0.f;
    for (int64_t p = 0; p < parts; ++p) s += part_b[p * dim + d];
    dbias[d] = from_float<T>(s);
  }
}

// Time tiles: the longest of 256, 128, ..., 8 steps that still gives every SM 1024 threads
// (fewer, longer tiles re-read fewer rows and leave fewer partial sums). From the shape alone,
// so that the workspace's size is known before the pointers are.
struct Plan {
  int64_t tile = 8, tiles_per_batch = 0, parts = 0;
};

Plan plan(const CausalConv1dShape& s, int sm_count) {
  Plan p;
  const int64_t cols = (s.dim + 3) / 4;
  p.tile = 256;
  while (p.tile > 8 && cols * s.batch * ((s.seq + p.tile - 1) / p.tile) < int64_t{sm_count} * 1024) {
    p.tile /= 2;
  }
  const int64_t tiles = (s.seq + p.tile - 1) / p.tile;
  p.tiles_per_batch = (tiles + kRows - 1) / kRows;
  p.parts = s.batch * p.tiles_per_batch;
  return p;
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

bool valid(const CausalConv1dShape& s) {
  return s.batch >= 0 && s.seq >= 0 && s.dim >= 0 && s.width >= 1 &&
         s.width <= kCausalConv1dMaxWidth;
}

template <class T, int V>
bool vectorizable(int64_t dim, std::initializer_list<const void*> ptrs) {
  if (V == 1) return true;
  if (dim % V != 0) return false;
  for (const void* p : ptrs) {
    if (p != nullptr && !aligned(p, static_cast<int>(sizeof(T)) * V)) return false;
  }
  return true;
}

// Both directions' grid: batch x time-tile groups, then blocks of kCols channel vectors of V.
dim3 grid_of(const CausalConv1dShape& s, const Plan& pl, int v) {
  const int64_t cols = (s.dim + v - 1) / v;
  return dim3(static_cast<unsigned>(s.batch * pl.tiles_per_batch),
              static_cast<unsigned>((cols + kCols - 1) / kCols));
}

Args args_of(const CausalConv1dShape& s, const Plan& pl) {
  return {s.seq, s.dim, pl.tile, pl.tiles_per_batch, static_cast<int>(s.width), s.silu};
}

template <class T, int V, int W>
int fwd_launch(T* y, const T* x, const T* w, const T* b, const CausalConv1dShape& s, const Plan& pl,
               cudaStream_t stream) {
  fwd_kernel<T, V, W><<<grid_of(s, pl, V), dim3(kCols, kRows), 0, stream>>>(y, x, w, b, args_of(s, pl));
  return static_cast<int>(cudaGetLastError());
}

template <class T, int V, int W>
int bwd_launch(T* dx, float* part_w, float* part_b, const T* dy, const T* x, const T* w, const T* b,
               const CausalConv1dShape& s, const Plan& pl, cudaStream_t stream) {
  const size_t smem = sizeof(float) * kRows * kCols * (Width<W>::kWM + 1) * V;
  bwd_kernel<T, V, W><<<grid_of(s, pl, V), dim3(kCols, kRows), smem, stream>>>(
      dx, part_w, part_b, dy, x, w, b, args_of(s, pl));
  return static_cast<int>(cudaGetLastError());
}

// The kernels for a width: templated for 2, 3 and 4, the runtime-width one (W = 0) otherwise.
template <class T, int V>
int fwd_width(T* y, const T* x, const T* w, const T* b, const CausalConv1dShape& s, const Plan& pl,
              cudaStream_t stream) {
  switch (s.width) {
    case 2: return fwd_launch<T, V, 2>(y, x, w, b, s, pl, stream);
    case 3: return fwd_launch<T, V, 3>(y, x, w, b, s, pl, stream);
    case 4: return fwd_launch<T, V, 4>(y, x, w, b, s, pl, stream);
    default: return fwd_launch<T, V, 0>(y, x, w, b, s, pl, stream);
  }
}

template <class T, int V>
int bwd_width(T* dx, float* part_w, float* part_b, const T* dy, const T* x, const T* w, const T* b,
              const CausalConv1dShape& s, const Plan& pl, cudaStream_t stream) {
  switch (s.width) {
    case 2: return bwd_launch<T, V, 2>(dx, part_w, part_b, dy, x, w, b, s, pl, stream);
    case 3: return bwd_launch<T, V, 3>(dx, part_w, part_b, dy, x, w, b, s, pl, stream);
    case 4: return bwd_launch<T, V, 4>(dx, part_w, part_b, dy, x, w, b, s, pl, stream);
    default: return bwd_launch<T, V, 0>(dx, part_w, part_b, dy, x, w, b, s, pl, stream);
  }
}

template <class T>
int fwd(void* y, const void* x, const void* w, const void* b, const CausalConv1dShape& s,
        int sm_count, cudaStream_t stream) {
  constexpr int V = 8 / sizeof(T);
  const Plan pl = plan(s, sm_count);
  auto* yp = static_cast<T*>(y);
  const auto *xp = static_cast<const T*>(x), *wp = static_cast<const T*>(w),
             *bp = static_cast<const T*>(b);
  return vectorizable<T, V>(s.dim, {y, x}) ? fwd_width<T, V>(yp, xp, wp, bp, s, pl, stream)
                                           : fwd_width<T, 1>(yp, xp, wp, bp, s, pl, stream);
}

template <class T>
int bwd(void* dx, void* dweight, void* dbias, const void* dy, const void* x, const void* w,
        const void* b, const CausalConv1dShape& s, void* workspace, int sm_count,
        cudaStream_t stream) {
  constexpr int V = 8 / sizeof(T);
  const Plan pl = plan(s, sm_count);
  float* ws = static_cast<float*>(workspace);
  float* part_w = dweight != nullptr ? ws : nullptr;
  float* part_b = dbias != nullptr ? ws + pl.parts * s.dim * s.width : nullptr;
  auto* dxp = static_cast<T*>(dx);
  const auto *dyp = static_cast<const T*>(dy), *xp = static_cast<const T*>(x),
             *wp = static_cast<const T*>(w), *bp = static_cast<const T*>(b);
  int rc = 0;
  if (s.batch > 0 && s.seq > 0) {
    rc = vectorizable<T, V>(s.dim, {dx, dy, x})
             ? bwd_width<T, V>(dxp, part_w, part_b, dyp, xp, wp, bp, s, pl, stream)
             : bwd_width<T, 1>(dxp, part_w, part_b, dyp, xp, wp, bp, s, pl, stream);
  }
  if (rc != 0 || (dweight == nullptr && dbias == nullptr)) return rc;
  // No parts (no batch or no steps): the sums are zeros.
  const int64_t n = s.dim * s.width + s.dim;
  constexpr int kThreads = 256;
  reduce_kernel<T><<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<T*>(dweight), static_cast<T*>(dbias), part_w, part_b, pl.parts, s.dim,
      static_cast<int>(s.width));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace causal_conv1d_detail

size_t causal_conv1d_bwd_workspace_bytes(const CausalConv1dShape& shape, int sm_count) {
  using namespace causal_conv1d_detail;
  if (!valid(shape)) return 0;
  const Plan pl = plan(shape, sm_count);
  return sizeof(float) * static_cast<size_t>(pl.parts * shape.dim * (shape.width + 1));
}

int causal_conv1d_fwd_cuda(void* y, const void* x, const void* weight, const void* bias,
                           const CausalConv1dShape& shape, DType dtype, int sm_count,
                           void* stream) {
  using namespace causal_conv1d_detail;
  if (!valid(shape)) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t n = shape.batch * shape.seq * shape.dim;
  if (n == 0) return 0;
  if (y == nullptr || x == nullptr || weight == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  auto st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: return fwd<float>(y, x, weight, bias, shape, sm_count, st);
    case DType::kFloat16: return fwd<__half>(y, x, weight, bias, shape, sm_count, st);
    case DType::kBFloat16: return fwd<__nv_bfloat16>(y, x, weight, bias, shape, sm_count, st);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int causal_conv1d_bwd_cuda(void* dx, void* dweight, void* dbias, const void* dy, const void* x,
                           const void* weight, const void* bias, const CausalConv1dShape& shape,
                           DType dtype, void* workspace, int sm_count, void* stream) {
  using namespace causal_conv1d_detail;
  if (!valid(shape) || (dbias != nullptr && bias == nullptr)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const bool elements = shape.batch * shape.seq * shape.dim > 0;
  if ((elements && (dy == nullptr || x == nullptr)) || weight == nullptr ||
      ((dweight != nullptr || dbias != nullptr) && shape.dim > 0 && elements && workspace == nullptr)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (shape.dim == 0) return 0;
  auto st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32:
      return bwd<float>(dx, dweight, dbias, dy, x, weight, bias, shape, workspace, sm_count, st);
    case DType::kFloat16:
      return bwd<__half>(dx, dweight, dbias, dy, x, weight, bias, shape, workspace, sm_count, st);
    case DType::kBFloat16:
      return bwd<__nv_bfloat16>(dx, dweight, dbias, dy, x, weight, bias, shape, workspace, sm_count,
                                st);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace kernelgate::kernels
