// Cross-entropy CUDA kernels (contract in cross_entropy.h).
//
// ce_rows: one block per row (a grid-stride loop over rows), up to 512 threads.
//  * Stats pass: one read of the row. Each thread keeps an online softmax (running max m, sum
//    of exp(x - m)) and the plain sum of x (label smoothing; it also carries NaN), updated once
//    per kUnroll vectors in flight, so the rescale exp costs one per 32 bf16 elements. The
//    block combines the per-thread triples in a fixed order; the target logit is one scalar
//    load. The forward of cross_entropy is this pass alone: it reads the logits once.
//  * Gradient pass: reads the row once more and writes the gradient once, from the row's lse.
//    cross_entropy's backward is this pass alone; linear_cross_entropy's chunk step runs both
//    passes in one block, in place, the second pass walking the row backwards so that its
//    first reads hit what the first pass read last (L1/L2).
//  * 16-byte accesses on every row: each row is split into a scalar head up to the first
//    16-byte boundary, whole vectors, and a scalar tail, so odd class counts, odd row strides
//    and unaligned views all take the vector path. A separate gradient buffer needs the same
//    16-byte phase as the logits on every row for that; otherwise the gradient pass runs on
//    scalars (correct, slower).
// Math is float32. Under --use_fast_math expf/logf become ex2/lg2.approx: exp(x - m) is formed
// from the difference (exact near the max, so logits of magnitude 1e4 lose nothing) and
// exp(-inf) = 0, so -inf logits drop out of the sums.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cross_entropy.h"
#include "kernels/vec16.cuh"

namespace kernelgate::kernels {
namespace ce_detail {

using namespace vec;  // to_float, from_float, Vec, unpack, pack

constexpr int kMaxThreads = 512;
constexpr int kUnroll = 4;  // vectors (or scalars) in flight per thread
constexpr int kReduceThreads = 1024;

// ---------------------------------------------------------------- element access
// W elements as loaded: one T (W == 1) or a 16-byte vector of W elements.
template <class T, int W>
using Raw = std::conditional_t<W == 1, T, uint4>;

// Plain loads (no read-only cache path): the gradient pass may write the same buffer.
template <class T, int W>
__device__ __forceinline__ Raw<T, W> load(const T* p) {
  if constexpr (W == 1) {
    return *p;
  } else {
    return *reinterpret_cast<const uint4*>(p);
  }
}

template <class T, int W>
__device__ __forceinline__ void to_floats(const Raw<T, W>& r, float (&f)[W]) {
  if constexpr (W == 1) {
    f[0] = to_float(r);
  } else {
    unpack<T>(r, f);
  }
}

template <class T, int W>
__device__ __forceinline__ void store(T* p, const float (&f)[W]) {
  if constexpr (W == 1) {
    *p = from_float<T>(f[0]);
  } else {
    *reinterpret_cast<uint4*>(p) = pack<T>(f);
  }
}

// ---------------------------------------------------------------- online softmax
struct Stats {
  float m;   // running max (-inf before any finite value)
  float s;   // sum of exp(x - m)
  float sx;  // sum of x
};

// s carries NaN: any NaN logit makes it NaN. What exponents are taken against for a running max
// m: m itself, except that once a +inf has been seen (m = +inf) finite values count
// exp(x - FLT_MAX) = 0 and each +inf exp(+inf) = +inf, so s = +inf and lse = +inf (the loss of a
// +inf logit away from the target), where x - m would make everything NaN.
__device__ __forceinline__ float exp_base(float m) { return m == INFINITY ? FLT_MAX : m; }

__device__ __forceinline__ Stats combine(const Stats& a, const Stats& b) {
  const float m = fmaxf(a.m, b.m), base = exp_base(m);
  // Both maxima -inf: every value seen is -inf; the sums are 0 (or NaN, kept).
  const float s =
      m == -INFINITY ? a.s + b.s : a.s * __expf(a.m - base) + b.s * __expf(b.m - base);
  return {m, s, a.sx + b.sx};
}

// Adds one value (head and tail elements).
__device__ __forceinline__ void add_value(Stats& st, float v) {
  st.sx += v;
  const float nm = fmaxf(st.m, v), base = exp_base(nm);
  if (nm == -INFINITY) {  // nothing but -inf (or NaN) so far: s stays as it is, or turns NaN
    if (isnan(v)) st.s = NAN;
    return;
  }
  st.s = st.s * __expf(st.m - base) + __expf(v - base);
  st.m = nm;
}

// Adds the loaded accesses k with in[k], with one rescale. The raw data is unpacked twice
// (max, then exponentials) rather than held as floats: that keeps 16 bytes per access live
// instead of 4 * W, and the kernel under 64 registers.
template <class T, int W>
__device__ __forceinline__ void add_accesses(Stats& st, const Raw<T, W> (&raw)[kUnroll],
                                             const bool (&in)[kUnroll]) {
  float cm = -INFINITY;
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    if (!in[k]) continue;
    float f[W];
    to_floats<T, W>(raw[k], f);
#pragma unroll
    for (int i = 0; i < W; ++i) {
      cm = fmaxf(cm, f[i]);
      st.sx += f[i];
    }
  }
  const float nm = fmaxf(st.m, cm), base = exp_base(nm);
  if (nm == -INFINITY) {  // no +inf here, so a NaN sum of x means a NaN was seen
    if (isnan(st.sx)) st.s = NAN;
    return;
  }
  float s = st.s * __expf(st.m - base);
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    if (!in[k]) continue;
    float f[W];
    to_floats<T, W>(raw[k], f);
#pragma unroll
    for (int i = 0; i < W; ++i) s += __expf(f[i] - base);
  }
  st.s = s;
  st.m = nm;
}

// The block's combined stats, the same in every thread (fixed combination order). `red` holds
// blockDim.x / 32 entries; the trailing barrier lets the caller's next row reuse it.
__device__ __forceinline__ Stats block_stats(Stats st, Stats* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Stats other{__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o),
                __shfl_xor_sync(0xffffffffu, st.sx, o)};
    st = combine(st, other);
  }
  const int warps = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = st;
  __syncthreads();
  Stats r = red[0];
  for (int w = 1; w < warps; ++w) r = combine(r, red[w]);
  __syncthreads();
  return r;
}

// ---------------------------------------------------------------- the row kernel
__device__ __forceinline__ int64_t load_target(const void* target, bool int32, int64_t row) {
  return int32 ? int64_t(static_cast<const int32_t*>(target)[row])
               : static_cast<const int64_t*>(target)[row];
}

// Where the 16-byte vectors of a row start and how many there are (W == 1: all scalars).
template <class T, int W>
struct RowSplit {
  int head, nvec, tail_start, tail;
  __device__ __forceinline__ RowSplit(const T* row, int classes) {
    if constexpr (W == 1) {
      head = 0;
      nvec = classes;
    } else {
      const int mis = int((reinterpret_cast<uintptr_t>(row) & 15) / sizeof(T));
      head = min(classes, (W - mis) % W);
      nvec = (classes - head) / W;
    }
    tail_start = head + nvec * W;
    tail = classes - tail_start;
  }
};

// Two blocks per SM keep 2 x 512 threads x kUnroll x 16 bytes in flight. The fused variant
// (both passes) holds both passes' state and would spill under that cap; it runs one block per
// SM, which also keeps the rows in flight (132 x 256 KB at V = 128256 bf16) inside the L2 that
// its second pass re-reads.
template <class T, int W, bool kStats, bool kGrad>
__global__ void __launch_bounds__(kMaxThreads, kStats&& kGrad ? 1 : 2) ce_rows(const CeRowsArgs a) {
  static_assert(kStats || kGrad, "a launch computes something");
  __shared__ Stats red[kMaxThreads / 32];
  const int C = int(a.classes);
  const float eps = a.label_smoothing;
  const float eps_c = eps / float(C), keep = 1.f - eps;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int tile = kUnroll * nt;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t t = load_target(a.target, a.target_int32, row);
    const bool ignored = t == a.ignore_index;
    const bool in_range = !ignored && t >= 0 && t < C;
    const T* x = static_cast<const T*>(a.logits) + row * a.logits_row_stride;
    T* g = kGrad ? static_cast<T*>(a.grad) + row * a.grad_row_stride : nullptr;
    const RowSplit<T, W> sp(x, C);

    float lse = 0.f;
    if constexpr (kStats) {
      float loss = ignored ? 0.f : NAN;
      if (in_range) {  // uniform over the block: one row per block
        Stats st{-INFINITY, 0.f, 0.f};
        if (tid < sp.head) add_value(st, to_float(x[tid]));
        if (tid < sp.tail) add_value(st, to_float(x[sp.tail_start + tid]));
        const T* xv = x + sp.head;
        for (int base = tid; base < sp.nvec; base += tile) {
          Raw<T, W> raw[kUnroll];
          bool in[kUnroll];
#pragma unroll
          for (int k = 0; k < kUnroll; ++k) {
            const int j = base + k * nt;
            in[k] = j < sp.nvec;
            if (in[k]) raw[k] = load<T, W>(xv + int64_t(j) * W);
          }
          add_accesses<T, W>(st, raw, in);
        }
        // Read before block_stats' barriers: in place, the gradient pass overwrites x[t].
        const float xt = tid == 0 ? to_float(x[t]) : 0.f;
        st = block_stats(st, red);
        // s >= 1 once the max is finite; an all -inf row gives -inf + log(0) = -inf, a row with
        // a +inf gives +inf. A NaN logit makes s NaN (the sum of x cannot tell: +inf + -inf).
        lse = st.m + __logf(st.s);
        loss = lse - keep * xt;  // used by thread 0 only
        if (eps > 0.f) loss -= eps_c * st.sx;
      }
      if (tid == 0) {
        if (a.row_loss != nullptr) a.row_loss[row] = loss;
        if (a.loss_out != nullptr) static_cast<T*>(a.loss_out)[row] = from_float<T>(loss);
        if (a.lse != nullptr) a.lse[row] = in_range ? lse : (ignored ? 0.f : NAN);
      }
    }

    if constexpr (kGrad) {
      if constexpr (!kStats) lse = in_range ? a.lse[row] : 0.f;
      // Ignored rows get zeros, out-of-range ones NaN; neither reads the row.
      float scale = ignored ? 0.f : NAN;
      if (in_range) {
        scale = 1.f;
        if (a.dloss != nullptr)
          scale = a.dloss[a.dloss_per_row ? row : 0];
        if (a.n_valid != nullptr) scale = scale / *a.n_valid;
      }
      const float fill = ignored ? 0.f : NAN;
      // d loss / d x[c] * scale for the N elements from column c0, in place; `tc` is t - c0.
      auto grad_n = [&](auto& f, int64_t tc) {
        constexpr int N = int(std::extent_v<std::remove_reference_t<decltype(f)>>);
#pragma unroll
        for (int i = 0; i < N; ++i) {
          const float d = __expf(f[i] - lse) - eps_c - (tc == i ? keep : 0.f);
          f[i] = in_range ? d * scale : fill;
        }
      };
      auto scalar_grad = [&](int c) {
        float f[1] = {in_range ? to_float(x[c]) : 0.f};
        grad_n(f, t - c);
        store<T, 1>(g + c, f);
      };
      if (tid < sp.head) scalar_grad(tid);
      if (tid < sp.tail) scalar_grad(sp.tail_start + tid);
      const T* xv = x + sp.head;
      T* gv = g + sp.head;
      const int ntiles = (sp.nvec + tile - 1) / tile;
      for (int n = 0; n < ntiles; ++n) {
        // After a stats pass in the same block, walk the row backwards (see the file comment).
        const int base = (kStats ? ntiles - 1 - n : n) * tile + tid;
        Raw<T, W> raw[kUnroll];
        if (in_range) {
#pragma unroll
          for (int k = 0; k < kUnroll; ++k) {
            const int j = base + k * nt;
            if (j < sp.nvec) raw[k] = load<T, W>(xv + int64_t(j) * W);
          }
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          const int j = base + k * nt;
          if (j >= sp.nvec) continue;
          float f[W];
          if (in_range) {
            to_floats<T, W>(raw[k], f);
          } else {
#pragma unroll
            for (int i = 0; i < W; ++i) f[i] = 0.f;
          }
          grad_n(f, t - (sp.head + int64_t(j) * W));
          store<T, W>(gv + int64_t(j) * W, f);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- reduction
__global__ void __launch_bounds__(kReduceThreads)
    ce_reduce(void* out, float* n_valid_out, const float* row_loss, const void* target,
              bool target_int32, int64_t rows, int64_t ignore_index, CeReduction reduction,
              DType dtype) {
  __shared__ double sums[kReduceThreads / 32];
  __shared__ long long counts[kReduceThreads / 32];
  const bool want_sum = reduction != CeReduction::kNone;
  double s = 0.0;
  long long n = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    n += load_target(target, target_int32, r) != ignore_index;
    if (want_sum) s += double(row_loss[r]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    n += __shfl_xor_sync(0xffffffffu, n, o);
  }
  if ((threadIdx.x & 31) == 0) {
    sums[threadIdx.x >> 5] = s;
    counts[threadIdx.x >> 5] = n;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  s = 0.0;
  n = 0;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) {
    s += sums[w];
    n += counts[w];
  }
  if (n_valid_out != nullptr) *n_valid_out = float(n);
  if (!want_sum) return;
  // 0 / 0 is NaN in IEEE arithmetic, as F.cross_entropy's mean over no rows.
  const float v = float(reduction == CeReduction::kMean ? s / double(n) : s);
  switch (dtype) {
    case DType::kFloat32: *static_cast<float*>(out) = v; break;
    case DType::kFloat16: *static_cast<__half*>(out) = from_float<__half>(v); break;
    case DType::kBFloat16: *static_cast<__nv_bfloat16*>(out) = from_float<__nv_bfloat16>(v); break;
  }
}

// ---------------------------------------------------------------- cotangent scaling
constexpr int kScaleThreads = 256;

// 16-byte vectors over [0, nvec * kN), scalars over the rest; a grid-stride loop.
template <class T>
__global__ void __launch_bounds__(kScaleThreads)
    scale_unless_one(T* __restrict__ data, int64_t n, const float* __restrict__ scale) {
  constexpr int kN = Vec<T>::kN;
  const float f = *scale;
  if (f == 1.f) return;
  const bool vec = (reinterpret_cast<uintptr_t>(data) & 15) == 0;
  const int64_t nvec = vec ? n / kN : 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint4* dv = reinterpret_cast<uint4*>(data);
  for (int64_t i = first; i < nvec; i += stride) {
    float v[kN];
    unpack<T>(dv[i], v);
#pragma unroll
    for (int k = 0; k < kN; ++k) v[k] *= f;
    dv[i] = pack<T>(v);
  }
  for (int64_t i = nvec * kN + first; i < n; i += stride)
    data[i] = from_float<T>(to_float(data[i]) * f);
}

template <class T>
int launch_scale(void* data, int64_t n, const float* scale, int sm_count, cudaStream_t s) {
  constexpr int kN = Vec<T>::kN;
  // 8 blocks per SM of 256 threads: enough loads in flight for the bandwidth.
  const int64_t want = (n / kN + kScaleThreads - 1) / kScaleThreads;
  const unsigned grid =
      unsigned(std::max<int64_t>(1, std::min<int64_t>(want, int64_t(std::max(1, sm_count)) * 8)));
  scale_unless_one<T>
      <<<grid, kScaleThreads, 0, s>>>(static_cast<T*>(data), n, scale);
  return int(cudaGetLastError());
}

// ---------------------------------------------------------------- launch
template <class T, int W>
int threads_for(int64_t classes) {
  const int64_t units = (classes + W - 1) / W;  // vectors (or scalars) per row
  const int64_t want = (units + kUnroll - 1) / kUnroll;
  int nt = 32;
  while (nt < kMaxThreads && nt < want) nt *= 2;
  return nt;
}

template <class T, int W, bool kStats, bool kGrad>
int launch_rows(const CeRowsArgs& a, cudaStream_t s) {
  const int nt = threads_for<T, W>(a.classes);
  const unsigned grid = unsigned(std::min<int64_t>(a.rows, INT_MAX));
  ce_rows<T, W, kStats, kGrad><<<grid, nt, 0, s>>>(a);
  return int(cudaGetLastError());
}

template <class T>
int launch_typed(const CeRowsArgs& a, cudaStream_t s) {
  constexpr int kN = Vec<T>::kN;
  const auto lp = reinterpret_cast<uintptr_t>(a.logits);
  const auto gp = reinterpret_cast<uintptr_t>(a.grad);
  if (lp % sizeof(T) != 0 || gp % sizeof(T) != 0) return int(cudaErrorInvalidValue);
  if (a.grad == nullptr) return launch_rows<T, kN, true, false>(a, s);
  // A gradient buffer that starts every row at the logits row's 16-byte phase takes vectors.
  const bool same_phase =
      lp % 16 == gp % 16 &&
      (a.rows <= 1 || ((a.logits_row_stride - a.grad_row_stride) * int64_t(sizeof(T))) % 16 == 0);
  if (same_phase) {
    return a.compute_stats ? launch_rows<T, kN, true, true>(a, s)
                           : launch_rows<T, kN, false, true>(a, s);
  }
  if (a.compute_stats) {  // (not in place: the buffers differ) stats first, then the gradient
    if (int rc = launch_rows<T, kN, true, false>(a, s)) return rc;
  }
  return launch_rows<T, 1, false, true>(a, s);
}

}  // namespace ce_detail

int cross_entropy_rows_cuda(const CeRowsArgs& a, void* stream) {
  if (a.rows < 0 || a.classes < 0) return int(cudaErrorInvalidValue);
  if (a.rows == 0) return 0;
  const bool ok = a.classes >= 1 && a.classes <= INT_MAX / 2 && a.logits != nullptr &&
                  a.target != nullptr && (a.compute_stats || a.grad != nullptr) &&
                  (a.grad == nullptr || a.lse != nullptr) &&
                  (!a.dloss_per_row || a.dloss != nullptr);
  if (!ok) return int(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case DType::kFloat32: return ce_detail::launch_typed<float>(a, s);
    case DType::kFloat16: return ce_detail::launch_typed<__half>(a, s);
    case DType::kBFloat16: return ce_detail::launch_typed<__nv_bfloat16>(a, s);
  }
  return int(cudaErrorInvalidValue);
}

int scale_unless_one_cuda(void* data, int64_t n, DType dtype, const float* scale, int sm_count,
                          void* stream) {
  if (n < 0 || (n > 0 && (data == nullptr || scale == nullptr))) return int(cudaErrorInvalidValue);
  if (n == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: return ce_detail::launch_scale<float>(data, n, scale, sm_count, s);
    case DType::kFloat16: return ce_detail::launch_scale<__half>(data, n, scale, sm_count, s);
    case DType::kBFloat16:
      return ce_detail::launch_scale<__nv_bfloat16>(data, n, scale, sm_count, s);
  }
  return int(cudaErrorInvalidValue);
}

int cross_entropy_reduce_cuda(void* out, float* n_valid_out, const float* row_loss,
                              const void* target, bool target_int32, int64_t rows,
                              int64_t ignore_index, CeReduction reduction, DType dtype,
                              void* stream) {
  const bool want_sum = reduction != CeReduction::kNone;
  if (rows < 0 || (want_sum && out == nullptr) || (rows > 0 && target == nullptr) ||
      (want_sum && rows > 0 && row_loss == nullptr)) {
    return int(cudaErrorInvalidValue);
  }
  if (!want_sum && n_valid_out == nullptr) return 0;
  ce_detail::ce_reduce<<<1, ce_detail::kReduceThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      out, n_valid_out, row_loss, target, target_int32, rows, ignore_index, reduction, dtype);
  return int(cudaGetLastError());
}

}  // namespace kernelgate::kernels
