// rope and qk_norm_rope CUDA kernels (contract in rope.h).
//
// Work unit: one (batch, seq) position. Its q_heads + kv_heads rows share one cos / sin row, so
// a block loads cos / sin for the position once (from DRAM; the block's other row groups hit
// L1) and applies it to every head of q and k: each input byte is read once and each output
// byte written once, in one launch for q and k.
//
// Threads: x = lanes over the first half of head_dim (lane c owns elements [cW, cW + W) and
// their partners [cW + h, cW + h + W), h = head_dim / 2), y = row groups, z (rope only) =
// positions per block. W is a 16-byte vector of T when every pointer, stride and h allow it,
// else 1 (the general path: any even head_dim, any strides, unaligned pointers).
//
// rope: each thread loads U rows (2 accesses each) before storing any, so a block with
// ceil(rows / U) row groups has every load of its position in flight at once.
// qk_norm_rope: the lanes of a row form a power-of-two group inside one warp and reduce with
// shuffles. "One pass" keeps the row in registers (head_dim <= 32 W); otherwise the row is read
// twice (the second read mostly hits L1). The backward is a persistent grid: each block keeps
// float32 weight-gradient sums per row group in shared memory (each column owned by one
// thread: no atomics), sums its groups in a fixed order into one workspace row, and a second
// kernel sums the workspace rows in a fixed order: deterministic results.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/rope.h"
#include "kernels/vec16.cuh"

namespace kernelgate::kernels {
namespace rope_detail {

using namespace vec;  // to_float, from_float, Vec, unpack, pack

constexpr int kMaxThreads = 256;
constexpr int kRopeRowsPerThread = 4;  // U
constexpr int64_t kMaxGrid = int64_t{1} << 30;
constexpr int kBwdBlocksPerSm = 8;
constexpr size_t kBwdMaxSmem = 48 * 1024;  // no opt-in needed

// W elements of T: one T (W == 1) or a 16-byte vector, as loaded (unconverted).
template <class T, int W> using Raw = std::conditional_t<W == 1, T, uint4>;

template <class T, int W> __device__ __forceinline__ Raw<T, W> load_raw(const T* p) {
  if constexpr (W == 1) {
    return __ldg(p);
  } else {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
}
template <class T, int W> __device__ __forceinline__ void to_floats(const Raw<T, W>& v, float (&f)[W]) {
  if constexpr (W == 1) {
    f[0] = to_float(v);
  } else {
    unpack<T>(v, f);
  }
}
template <class T, int W> __device__ __forceinline__ void load(const T* p, float (&f)[W]) {
  to_floats<T, W>(load_raw<T, W>(p), f);
}
template <class T, int W> __device__ __forceinline__ void store(T* p, const float (&f)[W]) {
  if constexpr (W == 1) {
    *p = from_float<T>(f[0]);
  } else {
    *reinterpret_cast<uint4*>(p) = pack<T>(f);
  }
}

// Rotation of one lane's pair of W-vectors (lo at d, hi at d + h) by cos / sin at d and d + h.
// Forward: lo' = lo c_lo - hi s_lo, hi' = hi c_hi + lo s_hi. Backward is its transpose.
template <bool kBwd, int W>
__device__ __forceinline__ void rotate(float (&lo)[W], float (&hi)[W], const float (&clo)[W],
                                       const float (&chi)[W], const float (&slo)[W],
                                       const float (&shi)[W]) {
#pragma unroll
  for (int i = 0; i < W; ++i) {
    const float a = lo[i], b = hi[i];
    if constexpr (kBwd) {
      lo[i] = a * clo[i] + b * shi[i];
      hi[i] = b * chi[i] - a * slo[i];
    } else {
      lo[i] = a * clo[i] - b * slo[i];
      hi[i] = b * chi[i] + a * shi[i];
    }
  }
}

template <class T> struct Operands {
  T* q_out;
  T* k_out;
  const T* q;
  const T* k;
  const T* cos;
  const T* sin;
};

// Row r of position (b, s): r < q_heads is head r of q, else head r - q_heads of k.
template <class P>
__device__ __forceinline__ P* row_ptr(P* q, P* k, const RopeStrides& qs, const RopeStrides& ks,
                                      int64_t q_heads, int64_t b, int64_t s, int64_t r) {
  return r < q_heads ? q + b * qs.sb + r * qs.sh + s * qs.ss
                     : k + b * ks.sb + (r - q_heads) * ks.sh + s * ks.ss;
}

// ---------------------------------------------------------------- rope
// (kMaxThreads, 1): lets ptxas use the registers it wants (about 136 for 16-bit vectors); with
// a 128 cap sm_80 spills. Blocks are small (ceil(rows / U) row groups), so several still fit.
template <class T, int W, bool kBwd>
__global__ void __launch_bounds__(kMaxThreads, 1)
    rope_position_per_block(Operands<T> t, RopeProblem p, int64_t positions, int nlanes) {
  constexpr int U = kRopeRowsPerThread;
  const int64_t h = p.head_dim / 2, rows = p.q_heads + p.kv_heads;
  const int64_t row_step = int64_t(U) * blockDim.y;
  for (int64_t pos = int64_t(blockIdx.x) * blockDim.z + threadIdx.z; pos < positions;
       pos += int64_t(gridDim.x) * blockDim.z) {
    const int64_t b = pos / p.seq, s = pos - b * p.seq;
    const T* cr = t.cos + b * p.cos_sb + s * p.cos_ss;
    const T* sr = t.sin + b * p.sin_sb + s * p.sin_ss;
    for (int c = threadIdx.x; c < nlanes; c += blockDim.x) {
      const int64_t d = int64_t(c) * W;
      // Kept unconverted: 4 registers per vector instead of W.
      const Raw<T, W> clo_r = load_raw<T, W>(cr + d), chi_r = load_raw<T, W>(cr + d + h);
      const Raw<T, W> slo_r = load_raw<T, W>(sr + d), shi_r = load_raw<T, W>(sr + d + h);
      for (int64_t r0 = threadIdx.y; r0 < rows; r0 += row_step) {
        Raw<T, W> lo[U], hi[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t r = r0 + int64_t(u) * blockDim.y;
          if (r < rows) {
            const T* x = row_ptr(t.q, t.k, p.q, p.k, p.q_heads, b, s, r) + d;
            lo[u] = load_raw<T, W>(x);
            hi[u] = load_raw<T, W>(x + h);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t r = r0 + int64_t(u) * blockDim.y;
          if (r >= rows) break;
          float a[W], e[W], clo[W], chi[W], slo[W], shi[W];
          to_floats<T, W>(lo[u], a);
          to_floats<T, W>(hi[u], e);
          to_floats<T, W>(clo_r, clo);
          to_floats<T, W>(chi_r, chi);
          to_floats<T, W>(slo_r, slo);
          to_floats<T, W>(shi_r, shi);
          rotate<kBwd, W>(a, e, clo, chi, slo, shi);
          T* y = row_ptr(t.q_out, t.k_out, p.q_out, p.k_out, p.q_heads, b, s, r) + d;
          store<T, W>(y, a);
          store<T, W>(y + h, e);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- qk_norm_rope
// Sum over the blockDim.x lanes of a row (a power of two <= 32, aligned within the warp).
// Every thread of the warp must call it.
__device__ __forceinline__ float lane_group_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    if (o < int(blockDim.x)) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class T> struct NormOperands {
  Operands<T> o;  // forward: outputs, inputs; backward: dx, output gradients
  const T* q_weight;
  const T* k_weight;
  float* q_rstd;  // forward: written (may be null); backward: read
  float* k_rstd;
  // backward only
  const T* xq;
  const T* xk;
  RopeStrides xq_s, xk_s;
  float* partial;  // [gridDim.x, 2, head_dim] or null: weight gradients not wanted
};

__device__ __forceinline__ int64_t rstd_index(const RopeProblem& p, int64_t b, int64_t s,
                                              int64_t r, bool is_q) {
  return is_q ? (b * p.q_heads + r) * p.seq + s : (b * p.kv_heads + (r - p.q_heads)) * p.seq + s;
}

// Rows are walked in iterations that every thread of the block takes part in (`valid` says
// whether its row exists), so the group shuffles are always converged.
template <class T, int W, bool kOnePass>
__global__ void __launch_bounds__(kMaxThreads)
    qk_norm_rope_fwd_rows(NormOperands<T> t, RopeProblem p, int64_t positions, int nlanes, float eps) {
  const int64_t h = p.head_dim / 2, rows = p.q_heads + p.kv_heads;
  const float inv_d = 1.f / float(p.head_dim);
  const int64_t iters = (rows + blockDim.y - 1) / blockDim.y;
  for (int64_t pos = blockIdx.x; pos < positions; pos += gridDim.x) {
    const int64_t b = pos / p.seq, s = pos - b * p.seq;
    const T* cr = t.o.cos + b * p.cos_sb + s * p.cos_ss;
    const T* sr = t.o.sin + b * p.sin_sb + s * p.sin_ss;
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t r = it * blockDim.y + threadIdx.y;
      const bool valid = r < rows, is_q = r < p.q_heads;
      const T* x = valid ? row_ptr(t.o.q, t.o.k, p.q, p.k, p.q_heads, b, s, r) : nullptr;
      float lo[W] = {}, hi[W] = {};
      float ss = 0.f;
      for (int c = threadIdx.x; valid && c < nlanes; c += blockDim.x) {
        load<T, W>(x + int64_t(c) * W, lo);
        load<T, W>(x + int64_t(c) * W + h, hi);
#pragma unroll
        for (int i = 0; i < W; ++i) ss += lo[i] * lo[i] + hi[i] * hi[i];
        if constexpr (kOnePass) break;
      }
      ss = lane_group_sum(ss);
      if (!valid) continue;
      const float rstd = 1.f / sqrtf(ss * inv_d + eps);
      float* rstd_out = is_q ? t.q_rstd : t.k_rstd;
      if (rstd_out != nullptr && threadIdx.x == 0) rstd_out[rstd_index(p, b, s, r, is_q)] = rstd;
      const T* w = is_q ? t.q_weight : t.k_weight;
      T* y = row_ptr(t.o.q_out, t.o.k_out, p.q_out, p.k_out, p.q_heads, b, s, r);
      for (int c = threadIdx.x; c < nlanes; c += blockDim.x) {
        const int64_t d = int64_t(c) * W;
        if constexpr (!kOnePass) {
          load<T, W>(x + d, lo);
          load<T, W>(x + d + h, hi);
        }
        float wlo[W], whi[W], clo[W], chi[W], slo[W], shi[W];
        load<T, W>(w + d, wlo);
        load<T, W>(w + d + h, whi);
        load<T, W>(cr + d, clo);
        load<T, W>(cr + d + h, chi);
        load<T, W>(sr + d, slo);
        load<T, W>(sr + d + h, shi);
#pragma unroll
        for (int i = 0; i < W; ++i) {
          lo[i] = lo[i] * rstd * wlo[i];
          hi[i] = hi[i] * rstd * whi[i];
        }
        rotate<false, W>(lo, hi, clo, chi, slo, shi);
        store<T, W>(y + d, lo);
        store<T, W>(y + d + h, hi);
        if constexpr (kOnePass) break;
      }
    }
  }
}

// Dynamic shared memory: blockDim.y slots of [2, head_dim] float sums (when t.partial).
template <class T, int W, bool kOnePass>
__global__ void __launch_bounds__(kMaxThreads)
    qk_norm_rope_bwd_rows(NormOperands<T> t, RopeProblem p, int64_t positions, int nlanes) {
  extern __shared__ float sums[];
  const int64_t h = p.head_dim / 2, rows = p.q_heads + p.kv_heads, D = p.head_dim;
  const float inv_d = 1.f / float(D);
  const int64_t iters = (rows + blockDim.y - 1) / blockDim.y;
  const bool want_dw = t.partial != nullptr;
  float* my_sums = sums + int64_t(threadIdx.y) * 2 * D;
  if (want_dw)
    for (int64_t i = threadIdx.x; i < 2 * D; i += blockDim.x) my_sums[i] = 0.f;
  __syncthreads();  // a slot's columns are zeroed and summed by different threads of the group
  for (int64_t pos = blockIdx.x; pos < positions; pos += gridDim.x) {
    const int64_t b = pos / p.seq, s = pos - b * p.seq;
    const T* cr = t.o.cos + b * p.cos_sb + s * p.cos_ss;
    const T* sr = t.o.sin + b * p.sin_sb + s * p.sin_ss;
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t r = it * blockDim.y + threadIdx.y;
      const bool valid = r < rows, is_q = r < p.q_heads;
      const T* g = valid ? row_ptr(t.o.q, t.o.k, p.q, p.k, p.q_heads, b, s, r) : nullptr;
      const T* x = valid ? row_ptr(t.xq, t.xk, t.xq_s, t.xk_s, p.q_heads, b, s, r) : nullptr;
      const T* w = is_q ? t.q_weight : t.k_weight;
      const float rstd = valid ? (is_q ? t.q_rstd : t.k_rstd)[rstd_index(p, b, s, r, is_q)] : 0.f;
      // dn = rope backward of g; xhat = x rstd; gw = dn w. Computed per lane, twice when the
      // row does not stay in registers.
      float dlo[W] = {}, dhi[W] = {}, xlo[W] = {}, xhi[W] = {};
      auto lane = [&](int c) {
        const int64_t d = int64_t(c) * W;
        float clo[W], chi[W], slo[W], shi[W];
        load<T, W>(g + d, dlo);
        load<T, W>(g + d + h, dhi);
        load<T, W>(x + d, xlo);
        load<T, W>(x + d + h, xhi);
        load<T, W>(cr + d, clo);
        load<T, W>(cr + d + h, chi);
        load<T, W>(sr + d, slo);
        load<T, W>(sr + d + h, shi);
        rotate<true, W>(dlo, dhi, clo, chi, slo, shi);
#pragma unroll
        for (int i = 0; i < W; ++i) xlo[i] *= rstd, xhi[i] *= rstd;
      };
      float dot = 0.f;
      for (int c = threadIdx.x; valid && c < nlanes; c += blockDim.x) {
        lane(c);
        float wlo[W], whi[W];
        load<T, W>(w + int64_t(c) * W, wlo);
        load<T, W>(w + int64_t(c) * W + h, whi);
#pragma unroll
        for (int i = 0; i < W; ++i) dot += dlo[i] * wlo[i] * xlo[i] + dhi[i] * whi[i] * xhi[i];
        if constexpr (kOnePass) break;
      }
      dot = lane_group_sum(dot);
      if (!valid) continue;
      const float mean = dot * inv_d;
      T* dx = row_ptr(t.o.q_out, t.o.k_out, p.q_out, p.k_out, p.q_heads, b, s, r);
      float* acc = my_sums + (is_q ? 0 : D);
      for (int c = threadIdx.x; c < nlanes; c += blockDim.x) {
        const int64_t d = int64_t(c) * W;
        if constexpr (!kOnePass) lane(c);
        float wlo[W], whi[W], olo[W], ohi[W];
        load<T, W>(w + d, wlo);
        load<T, W>(w + d + h, whi);
#pragma unroll
        for (int i = 0; i < W; ++i) {
          olo[i] = rstd * (dlo[i] * wlo[i] - xlo[i] * mean);
          ohi[i] = rstd * (dhi[i] * whi[i] - xhi[i] * mean);
        }
        store<T, W>(dx + d, olo);
        store<T, W>(dx + d + h, ohi);
        if (want_dw) {
#pragma unroll
          for (int i = 0; i < W; ++i) {
            acc[d + i] += dlo[i] * xlo[i];
            acc[d + h + i] += dhi[i] * xhi[i];
          }
        }
        if constexpr (kOnePass) break;
      }
    }
  }
  if (!want_dw) return;
  __syncthreads();
  const int nthreads = blockDim.x * blockDim.y;
  float* out = t.partial + int64_t(blockIdx.x) * 2 * D;
  for (int64_t i = threadIdx.y * blockDim.x + threadIdx.x; i < 2 * D; i += nthreads) {
    float a = 0.f;
    for (int y = 0; y < int(blockDim.y); ++y) a += sums[int64_t(y) * 2 * D + i];
    out[i] = a;
  }
}

// dq_weight[d] = sum_b partial[b, 0, d]; dk_weight[d] = sum_b partial[b, 1, d]. Block (32, 32):
// 32 columns, 32 partial rows at a time, then the 32 sums of a column in order.
template <class T>
__global__ void __launch_bounds__(1024)
    qk_norm_rope_sum_partials(T* dq_weight, T* dk_weight, const float* partial, int64_t blocks,
                              int64_t head_dim) {
  __shared__ float part[32][33];
  const int64_t cols = 2 * head_dim;
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (c < cols)
    for (int64_t r = threadIdx.y; r < blocks; r += 32) s += partial[r * cols + c];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  float total = 0.f;
  for (int i = 0; i < 32; ++i) total += part[i][threadIdx.x];
  T* dst = c < head_dim ? dq_weight : dk_weight;
  if (dst != nullptr) dst[c < head_dim ? c : c - head_dim] = from_float<T>(total);
}

// ---------------------------------------------------------------- launch planning
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
inline int next_pow2(int64_t n) {
  int t = 1;
  while (t < n) t <<= 1;
  return t;
}

template <class T> struct Tag { using type = T; };
template <class F> int dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: return f(Tag<float>{});
    case DType::kFloat16: return f(Tag<__half>{});
    case DType::kBFloat16: return f(Tag<__nv_bfloat16>{});
  }
  return int(cudaErrorInvalidValue);
}

inline bool strides_multiple(const RopeStrides& s, int64_t n) {
  return s.sb % n == 0 && s.sh % n == 0 && s.ss % n == 0;
}

// 16-byte vectors fit when half of head_dim, every stride and every pointer line up.
inline bool vectorizable(const RopeProblem& p, std::initializer_list<const void*> ptrs,
                         std::initializer_list<RopeStrides> extra = {}) {
  const int64_t n = 16 / dtype_size(p.dtype);
  bool ok = (p.head_dim / 2) % n == 0 && strides_multiple(p.q, n) && strides_multiple(p.k, n) &&
            strides_multiple(p.q_out, n) && strides_multiple(p.k_out, n) && p.cos_sb % n == 0 &&
            p.cos_ss % n == 0 && p.sin_sb % n == 0 && p.sin_ss % n == 0;
  for (const RopeStrides& s : extra) ok = ok && strides_multiple(s, n);
  for (const void* q : ptrs) ok = ok && (q == nullptr || aligned16(q));
  return ok;
}

inline bool problem_ok(const RopeProblem& p) {
  return p.batch >= 0 && p.seq >= 0 && p.q_heads >= 0 && p.kv_heads >= 0 && p.head_dim >= 2 &&
         p.head_dim % 2 == 0;
}

inline int64_t positions_of(const RopeProblem& p) { return p.batch * p.seq; }

template <class T, int W, bool kBwd>
int launch_rope(const Operands<T>& t, const RopeProblem& p, cudaStream_t stream) {
  const int64_t rows = p.q_heads + p.kv_heads, positions = positions_of(p);
  const int nlanes = int(p.head_dim / 2 / W);
  const int tx = int(std::min<int64_t>(nlanes, kMaxThreads));
  const int ty = int(std::clamp<int64_t>(ceil_div(rows, kRopeRowsPerThread), 1, kMaxThreads / tx));
  // Small positions (few heads, short head_dim): several per block, so blocks are not tiny.
  const int tz = int(std::clamp<int64_t>(128 / (tx * ty), 1, 64));
  const unsigned grid = unsigned(std::clamp<int64_t>(ceil_div(positions, tz), 1, kMaxGrid));
  rope_position_per_block<T, W, kBwd><<<grid, dim3(tx, ty, tz), 0, stream>>>(t, p, positions, nlanes);
  return int(cudaGetLastError());
}

// Lanes per row (a power of two <= 32) and row groups per block (lanes * groups a multiple of
// 32, at most kMaxThreads) for the qk_norm_rope kernels.
struct NormLayout {
  int width = 1;  // W
  bool one_pass = false;
  int nlanes = 0, tx = 0, ty = 0;
};

inline NormLayout norm_layout(const RopeProblem& p, bool vec, int64_t max_ty) {
  NormLayout l;
  l.width = vec ? 16 / dtype_size(p.dtype) : 1;
  l.nlanes = int(p.head_dim / 2 / l.width);
  l.one_pass = l.nlanes <= 32;
  l.tx = l.one_pass ? next_pow2(l.nlanes) : 32;
  const int64_t rows = std::max<int64_t>(1, p.q_heads + p.kv_heads);
  const int64_t quantum = 32 / l.tx;  // row groups per warp
  const int64_t cap = std::max<int64_t>(quantum, std::min<int64_t>(kMaxThreads / l.tx, max_ty) / quantum * quantum);
  // As few iterations over the rows as the cap allows, spread evenly.
  const int64_t iters = ceil_div(rows, cap);
  l.ty = int(std::min<int64_t>(cap, ceil_div(ceil_div(rows, iters), quantum) * quantum));
  return l;
}

template <class T>
int fwd_norm(const NormOperands<T>& t, const RopeProblem& p, bool vec, float eps, cudaStream_t s) {
  const NormLayout l = norm_layout(p, vec, kMaxThreads);
  const int64_t positions = positions_of(p);
  const unsigned grid = unsigned(std::clamp<int64_t>(positions, 1, kMaxGrid));
  const dim3 block(l.tx, l.ty);
  constexpr int kN = Vec<T>::kN;
  if (vec && l.one_pass) {
    qk_norm_rope_fwd_rows<T, kN, true><<<grid, block, 0, s>>>(t, p, positions, l.nlanes, eps);
  } else if (vec) {
    qk_norm_rope_fwd_rows<T, kN, false><<<grid, block, 0, s>>>(t, p, positions, l.nlanes, eps);
  } else if (l.one_pass) {
    qk_norm_rope_fwd_rows<T, 1, true><<<grid, block, 0, s>>>(t, p, positions, l.nlanes, eps);
  } else {
    qk_norm_rope_fwd_rows<T, 1, false><<<grid, block, 0, s>>>(t, p, positions, l.nlanes, eps);
  }
  return int(cudaGetLastError());
}

// Backward layout: row groups capped so their float32 sums fit the shared memory budget.
inline NormLayout bwd_layout(const RopeProblem& p, bool vec) {
  const int64_t slot_bytes = 2 * p.head_dim * int64_t(sizeof(float));
  return norm_layout(p, vec, std::max<int64_t>(1, int64_t(kBwdMaxSmem) / slot_bytes));
}

inline int64_t bwd_blocks(const RopeProblem& p, int sm_count) {
  return std::clamp<int64_t>(positions_of(p), 1, int64_t(std::max(1, sm_count)) * kBwdBlocksPerSm);
}

template <class T>
int bwd_norm(const NormOperands<T>& t, T* dq_weight, T* dk_weight, const RopeProblem& p, bool vec,
             int sm_count, cudaStream_t s) {
  const int64_t positions = positions_of(p);
  const int64_t blocks = bwd_blocks(p, sm_count);
  if (positions > 0) {
    const NormLayout l = bwd_layout(p, vec);
    const size_t smem = t.partial != nullptr ? size_t(l.ty) * 2 * p.head_dim * sizeof(float) : 0;
    const dim3 block(l.tx, l.ty);
    const unsigned grid = unsigned(blocks);
    constexpr int kN = Vec<T>::kN;
    if (vec && l.one_pass) {
      qk_norm_rope_bwd_rows<T, kN, true><<<grid, block, smem, s>>>(t, p, positions, l.nlanes);
    } else if (vec) {
      qk_norm_rope_bwd_rows<T, kN, false><<<grid, block, smem, s>>>(t, p, positions, l.nlanes);
    } else if (l.one_pass) {
      qk_norm_rope_bwd_rows<T, 1, true><<<grid, block, smem, s>>>(t, p, positions, l.nlanes);
    } else {
      qk_norm_rope_bwd_rows<T, 1, false><<<grid, block, smem, s>>>(t, p, positions, l.nlanes);
    }
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return int(e);
  }
  if (t.partial != nullptr) {
    const int64_t rows = positions > 0 ? blocks : 0;  // no positions: the gradients are 0
    qk_norm_rope_sum_partials<T><<<unsigned(ceil_div(2 * p.head_dim, 32)), dim3(32, 32), 0, s>>>(
        dq_weight, dk_weight, t.partial, rows, p.head_dim);
  }
  return int(cudaGetLastError());
}

}  // namespace rope_detail

using namespace rope_detail;

int rope_cuda(void* q_out, void* k_out, const void* q, const void* k, const void* cos,
              const void* sin, const RopeProblem& p, bool backward, void* stream) {
  if (!problem_ok(p)) return int(cudaErrorInvalidValue);
  if (positions_of(p) == 0 || p.q_heads + p.kv_heads == 0) return 0;
  if ((p.q_heads > 0 && (q_out == nullptr || q == nullptr)) ||
      (p.kv_heads > 0 && (k_out == nullptr || k == nullptr)) || cos == nullptr || sin == nullptr)
    return int(cudaErrorInvalidValue);
  const bool vec = vectorizable(p, {q_out, k_out, q, k, cos, sin});
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kN = Vec<T>::kN;
    const Operands<T> t{static_cast<T*>(q_out),      static_cast<T*>(k_out),
                        static_cast<const T*>(q),    static_cast<const T*>(k),
                        static_cast<const T*>(cos),  static_cast<const T*>(sin)};
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (vec) return backward ? launch_rope<T, kN, true>(t, p, s) : launch_rope<T, kN, false>(t, p, s);
    return backward ? launch_rope<T, 1, true>(t, p, s) : launch_rope<T, 1, false>(t, p, s);
  });
}

int qk_norm_rope_fwd_cuda(void* q_out, void* k_out, float* q_rstd, float* k_rstd, const void* q,
                          const void* k, const void* q_weight, const void* k_weight,
                          const void* cos, const void* sin, float eps, const RopeProblem& p,
                          void* stream) {
  if (!problem_ok(p)) return int(cudaErrorInvalidValue);
  if (positions_of(p) == 0 || p.q_heads + p.kv_heads == 0) return 0;
  if ((p.q_heads > 0 && (q_out == nullptr || q == nullptr || q_weight == nullptr)) ||
      (p.kv_heads > 0 && (k_out == nullptr || k == nullptr || k_weight == nullptr)) ||
      cos == nullptr || sin == nullptr)
    return int(cudaErrorInvalidValue);
  const bool vec = vectorizable(p, {q_out, k_out, q, k, q_weight, k_weight, cos, sin});
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    NormOperands<T> t{};
    t.o = {static_cast<T*>(q_out),     static_cast<T*>(k_out),     static_cast<const T*>(q),
           static_cast<const T*>(k),   static_cast<const T*>(cos), static_cast<const T*>(sin)};
    t.q_weight = static_cast<const T*>(q_weight);
    t.k_weight = static_cast<const T*>(k_weight);
    t.q_rstd = q_rstd;
    t.k_rstd = k_rstd;
    return fwd_norm<T>(t, p, vec, eps, static_cast<cudaStream_t>(stream));
  });
}

int64_t qk_norm_rope_bwd_workspace_floats(const RopeProblem& p, int sm_count) {
  if (!problem_ok(p)) return 0;
  return bwd_blocks(p, sm_count) * 2 * p.head_dim;
}

int qk_norm_rope_bwd_cuda(void* dq, void* dk, void* dq_weight, void* dk_weight,
                          const void* dq_out, const void* dk_out, const void* xq,
                          const void* xk, const RopeStrides& xq_s, const RopeStrides& xk_s,
                          const void* q_weight, const void* k_weight, const float* q_rstd,
                          const float* k_rstd, const void* cos, const void* sin,
                          float* workspace, int sm_count, const RopeProblem& p, void* stream) {
  if (!problem_ok(p)) return int(cudaErrorInvalidValue);
  const bool want_dw = dq_weight != nullptr || dk_weight != nullptr;
  const int64_t positions = positions_of(p);
  if ((positions == 0 || p.q_heads + p.kv_heads == 0) && !want_dw) return 0;
  if (want_dw && workspace == nullptr) return int(cudaErrorInvalidValue);
  if (positions > 0 &&
      ((p.q_heads > 0 && (dq == nullptr || dq_out == nullptr || xq == nullptr ||
                          q_weight == nullptr || q_rstd == nullptr)) ||
       (p.kv_heads > 0 && (dk == nullptr || dk_out == nullptr || xk == nullptr ||
                           k_weight == nullptr || k_rstd == nullptr)) ||
       cos == nullptr || sin == nullptr))
    return int(cudaErrorInvalidValue);
  const bool vec = vectorizable(p, {dq, dk, dq_out, dk_out, xq, xk, q_weight, k_weight, cos, sin},
                                {xq_s, xk_s});
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    NormOperands<T> t{};
    t.o = {static_cast<T*>(dq),           static_cast<T*>(dk),
           static_cast<const T*>(dq_out), static_cast<const T*>(dk_out),
           static_cast<const T*>(cos),    static_cast<const T*>(sin)};
    t.q_weight = static_cast<const T*>(q_weight);
    t.k_weight = static_cast<const T*>(k_weight);
    t.q_rstd = const_cast<float*>(q_rstd);
    t.k_rstd = const_cast<float*>(k_rstd);
    t.xq = static_cast<const T*>(xq);
    t.xk = static_cast<const T*>(xk);
    t.xq_s = xq_s;
    t.xk_s = xk_s;
    t.partial = want_dw ? workspace : nullptr;
    return bwd_norm<T>(t, static_cast<T*>(dq_weight), static_cast<T*>(dk_weight), p, vec,
                       sm_count, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace kernelgate::kernels
