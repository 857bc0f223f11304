// rope and qk_norm_rope CUDA kernels (contract in rope.h).
//
// q and k rows of one (batch, seq) position share one cos / sin row; both are handled in one
// launch, each input byte read from DRAM once and each output byte written once.
//
// Lanes: lane c owns elements [cW, cW + W) of the first half of head_dim and their partners
// [cW + h, cW + h + W), h = head_dim / 2. W is a 16-byte vector of T when every pointer, stride
// and h allow it, else 1 (the general path: any even head_dim, any strides, unaligned pointers).
//
// rope: threads x = lanes, y = consecutive positions; blocks walk groups of rows (see rope_rows).
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
#include <cstring>
#include <type_traits>

#include "kernels/rope.h"
#include "kernels/vec16.cuh"

namespace kernelgate::kernels {
namespace rope_detail {

using namespace vec;  // to_float, from_float, Vec, unpack, pack

constexpr int kMaxThreads = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 30;
constexpr int kBwdBlocksPerSm = 8;
constexpr size_t kBwdMaxSmem = 48 * 1024;  // no opt-in needed

// W elements of T: one T (W == 1) or a 16-byte vector, as loaded (unconverted).
template <class T, int W>
using Raw = std::conditional_t<W == 1, T, uint4>;

template <class T, int W>
__device__ __forceinline__ Raw<T, W> load_raw(const T* p) {
  if constexpr (W == 1) {
    return __ldg(p);
  } else {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
}
template <class T, int W>
__device__ __forceinline__ void to_floats(const Raw<T, W>& v, float (&f)[W]) {
  if constexpr (W == 1) {
    f[0] = to_float(v);
  } else {
    unpack<T>(v, f);
  }
}
template <class T, int W>
__device__ __forceinline__ void load(const T* p, float (&f)[W]) {
  to_floats<T, W>(load_raw<T, W>(p), f);
}
template <class T, int W>
__device__ __forceinline__ void store_raw(T* p, const Raw<T, W>& v) {
  if constexpr (W == 1) {
    *p = v;
  } else {
    *reinterpret_cast<uint4*>(p) = v;
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

// Rotation applied to unconverted vectors one 32-bit word at a time, so that only a word's
// floats are live (the whole-vector form holds 6 W floats and spills at W = 8).
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ void set_word(uint4& v, int i, uint32_t w) {
  if (i == 0)
    v.x = w;
  else if (i == 1)
    v.y = w;
  else if (i == 2)
    v.z = w;
  else
    v.w = w;
}
template <class T>
__device__ __forceinline__ float2 word_floats(uint32_t w) {
  if constexpr (sizeof(T) == 4) {
    return make_float2(__uint_as_float(w), 0.f);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    __half2 h;
    memcpy(&h, &w, 4);
    return __half22float2(h);
  }
}
template <class T>
__device__ __forceinline__ uint32_t float_word(float2 f) {
  uint32_t w;
  if constexpr (sizeof(T) == 4) {
    w = __float_as_uint(f.x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f.x, f.y);
    memcpy(&w, &h, 4);
  } else {
    const __half2 h = __floats2half2_rn(f.x, f.y);
    memcpy(&w, &h, 4);
  }
  return w;
}

template <class T, int W, bool kBwd>
__device__ __forceinline__ void rotate_raw(Raw<T, W>& lo, Raw<T, W>& hi, const Raw<T, W>& clo,
                                           const Raw<T, W>& chi, const Raw<T, W>& slo,
                                           const Raw<T, W>& shi) {
  if constexpr (W == 1) {
    float a[1] = {to_float(lo)}, e[1] = {to_float(hi)};
    const float c0[1] = {to_float(clo)}, c1[1] = {to_float(chi)};
    const float s0[1] = {to_float(slo)}, s1[1] = {to_float(shi)};
    rotate<kBwd, 1>(a, e, c0, c1, s0, s1);
    lo = from_float<T>(a[0]);
    hi = from_float<T>(e[0]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = word_floats<T>(word_of(lo, i)), e = word_floats<T>(word_of(hi, i));
      const float2 c0 = word_floats<T>(word_of(clo, i)), c1 = word_floats<T>(word_of(chi, i));
      const float2 s0 = word_floats<T>(word_of(slo, i)), s1 = word_floats<T>(word_of(shi, i));
      float x[2] = {a.x, a.y}, y[2] = {e.x, e.y};
      const float cl[2] = {c0.x, c0.y}, ch[2] = {c1.x, c1.y};
      const float sl[2] = {s0.x, s0.y}, sh[2] = {s1.x, s1.y};
      rotate<kBwd, 2>(x, y, cl, ch, sl, sh);
      set_word(lo, i, float_word<T>(make_float2(x[0], x[1])));
      set_word(hi, i, float_word<T>(make_float2(y[0], y[1])));
    }
  }
}

template <class T>
struct Operands {
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
// Block (tx lanes, ty consecutive positions); blockIdx.y picks a group of rows (heads of q,
// then of k). A thread loads the cos / sin vectors of its (position, lane) once, unconverted,
// and applies them to every row of its group. A warp covers whole vectors of consecutive
// positions, so every access is coalesced in both q layouts ([b, h, s, d] and a [b, s, h, d]
// view); each row group re-reads cos / sin, from L2. The common case (16-byte vectors, at most
// 32 lanes, offsets below 2^31) runs rope_rows32: 32-bit index math, no loops, 40-60 registers,
// so an SM holds enough warps, and loads in flight, to keep HBM busy (a loop-per-position form
// needed 110-136 registers and reached 70% of the copy bandwidth on the H200; this one 89-90%).
constexpr int kRopeThreads = 256;
constexpr int kRopeRowsPerBlock = 8;    // general path
constexpr int kRopeRowsPerBlock32 = 2;  // 32-bit path
constexpr int64_t kMaxGridY = 65535;

template <class T, int W, bool kBwd>
__global__ void __launch_bounds__(kRopeThreads, 4)
    rope_rows(Operands<T> t, RopeProblem p, int64_t positions, int nlanes) {
  constexpr int R = kRopeRowsPerBlock;
  const int64_t h = p.head_dim / 2, rows = p.q_heads + p.kv_heads;
  const int64_t groups = (rows + R - 1) / R;
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    const int64_t r_begin = g * R;
    const int64_t r_end = min(rows, r_begin + R);
    for (int64_t pos = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; pos < positions;
         pos += int64_t(gridDim.x) * blockDim.y) {
      const int64_t b = pos / p.seq, s = pos - b * p.seq;
      const T* cr = t.cos + b * p.cos_sb + s * p.cos_ss;
      const T* sr = t.sin + b * p.sin_sb + s * p.sin_ss;
      // The position's row 0 of q, k and their outputs; a row is its head's stride away.
      const T* qp = t.q + b * p.q.sb + s * p.q.ss;
      const T* kp = t.k + b * p.k.sb + s * p.k.ss;
      T* qo = t.q_out + b * p.q_out.sb + s * p.q_out.ss;
      T* ko = t.k_out + b * p.k_out.sb + s * p.k_out.ss;
      for (int c = threadIdx.x; c < nlanes; c += blockDim.x) {
        const int64_t d = int64_t(c) * W;
        // Kept unconverted: 4 registers per vector instead of W.
        const Raw<T, W> clo_r = load_raw<T, W>(cr + d), chi_r = load_raw<T, W>(cr + d + h);
        const Raw<T, W> slo_r = load_raw<T, W>(sr + d), shi_r = load_raw<T, W>(sr + d + h);
        for (int64_t r = r_begin; r < r_end; ++r) {
          const T* x = (r < p.q_heads ? qp + r * p.q.sh : kp + (r - p.q_heads) * p.k.sh) + d;
          Raw<T, W> lo = load_raw<T, W>(x), hi = load_raw<T, W>(x + h);
          rotate_raw<T, W, kBwd>(lo, hi, clo_r, chi_r, slo_r, shi_r);
          T* y = (r < p.q_heads ? qo + r * p.q_out.sh : ko + (r - p.q_heads) * p.k_out.sh) + d;
          store_raw<T, W>(y, lo);
          store_raw<T, W>(y + h, hi);
        }
      }
    }
  }
}

// The common case in 32-bit index math: 16-byte vectors, at most 32 lanes per row (tx ==
// nlanes), every element offset below 2^31. One thread per (row, position, lane): no loops;
// blockIdx.y = row, blockIdx.x * ty + threadIdx.y = position. cos / sin come from L1 / L2 for
// all rows but the first to touch them.
template <class T, int W, bool kBwd, int R>
__global__ void __launch_bounds__(kRopeThreads)
    rope_rows32(Operands<T> t, RopeProblem p, int positions, int rows) {
  const int pos = blockIdx.x * blockDim.y + threadIdx.y;
  if (pos >= positions) return;
  const int h = int(p.head_dim) / 2, seq = int(p.seq), q_heads = int(p.q_heads);
  const int b = pos / seq, s = pos - b * seq;
  const int d = threadIdx.x * W;
  const int co = b * int(p.cos_sb) + s * int(p.cos_ss) + d,
            so = b * int(p.sin_sb) + s * int(p.sin_ss) + d;
  const Raw<T, W> clo = load_raw<T, W>(t.cos + co), chi = load_raw<T, W>(t.cos + co + h);
  const Raw<T, W> slo = load_raw<T, W>(t.sin + so), shi = load_raw<T, W>(t.sin + so + h);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = blockIdx.y * R + i;
    if (r >= rows) break;
    const bool is_q = r < q_heads;
    const RopeStrides& xs = is_q ? p.q : p.k;
    const RopeStrides& ys = is_q ? p.q_out : p.k_out;
    const int hr = is_q ? r : r - q_heads;
    const int xo = b * int(xs.sb) + hr * int(xs.sh) + s * int(xs.ss) + d;
    const int yo = b * int(ys.sb) + hr * int(ys.sh) + s * int(ys.ss) + d;
    const T* x = (is_q ? t.q : t.k) + xo;
    Raw<T, W> lo = load_raw<T, W>(x), hi = load_raw<T, W>(x + h);
    rotate_raw<T, W, kBwd>(lo, hi, clo, chi, slo, shi);
    T* y = (is_q ? t.q_out : t.k_out) + yo;
    store_raw<T, W>(y, lo);
    store_raw<T, W>(y + h, hi);
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

template <class T>
struct NormOperands {
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

__device__ __forceinline__ int64_t rstd_index(const RopeProblem& p, int64_t b, int64_t s, int64_t r,
                                              bool is_q) {
  return is_q ? (b * p.q_heads + r) * p.seq + s : (b * p.kv_heads + (r - p.q_heads)) * p.seq + s;
}

// Rows are walked in iterations that every thread of the block takes part in (`valid` says
// whether its row exists), so the group shuffles are always converged.
template <class T, int W, bool kOnePass>
__global__ void __launch_bounds__(kMaxThreads)
    qk_norm_rope_fwd_rows(NormOperands<T> t, RopeProblem p, int64_t positions, int nlanes,
                          float eps) {
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

// Whether every element offset of the problem's tensors fits in 32 bits (rope_rows32).
inline bool offsets_fit_int32(const RopeProblem& p) {
  const int64_t lim = int64_t{1} << 31;
  auto span = [&](const RopeStrides& s, int64_t heads) {
    return (p.batch - 1) * s.sb + (heads - 1) * s.sh + (p.seq - 1) * s.ss + p.head_dim;
  };
  const bool strides_ok = p.q.sb >= 0 && p.q.sh >= 0 && p.q.ss >= 0 && p.k.sb >= 0 && p.k.sh >= 0 &&
                          p.k.ss >= 0 && p.q_out.sb >= 0 && p.q_out.sh >= 0 && p.q_out.ss >= 0 &&
                          p.k_out.sb >= 0 && p.k_out.sh >= 0 && p.k_out.ss >= 0 && p.cos_sb >= 0 &&
                          p.cos_ss >= 0 && p.sin_sb >= 0 && p.sin_ss >= 0;
  return strides_ok && p.batch * p.seq < lim && p.q_heads + p.kv_heads < lim &&
         span(p.q, std::max<int64_t>(p.q_heads, 1)) < lim &&
         span(p.q_out, std::max<int64_t>(p.q_heads, 1)) < lim &&
         span(p.k, std::max<int64_t>(p.kv_heads, 1)) < lim &&
         span(p.k_out, std::max<int64_t>(p.kv_heads, 1)) < lim &&
         (p.batch - 1) * p.cos_sb + (p.seq - 1) * p.cos_ss + p.head_dim < lim &&
         (p.batch - 1) * p.sin_sb + (p.seq - 1) * p.sin_ss + p.head_dim < lim;
}

template <class T, int W, bool kBwd>
int launch_rope(const Operands<T>& t, const RopeProblem& p, cudaStream_t stream) {
  const int64_t rows = p.q_heads + p.kv_heads, positions = positions_of(p);
  const int nlanes = int(p.head_dim / 2 / W);
  const int tx = int(std::min<int64_t>(nlanes, 32));
  const int ty = kRopeThreads / tx;
  const unsigned grid_x = unsigned(std::clamp<int64_t>(ceil_div(positions, ty), 1, kMaxGrid));
  constexpr int R32 = kRopeRowsPerBlock32;
  if constexpr (W > 1) {
    if (nlanes <= 32 && ceil_div(rows, R32) <= kMaxGridY && ceil_div(positions, ty) <= kMaxGrid &&
        offsets_fit_int32(p)) {
      rope_rows32<T, W, kBwd, R32>
          <<<dim3(grid_x, unsigned(ceil_div(rows, R32))), dim3(tx, ty), 0, stream>>>(
              t, p, int(positions), int(rows));
      return int(cudaGetLastError());
    }
  }
  const unsigned grid_y =
      unsigned(std::clamp<int64_t>(ceil_div(rows, kRopeRowsPerBlock), 1, kMaxGridY));
  rope_rows<T, W, kBwd><<<dim3(grid_x, grid_y), dim3(tx, ty), 0, stream>>>(t, p, positions, nlanes);
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
  const int64_t cap =
      std::max<int64_t>(quantum, std::min<int64_t>(kMaxThreads / l.tx, max_ty) / quantum * quantum);
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
    const Operands<T> t{static_cast<T*>(q_out),     static_cast<T*>(k_out),
                        static_cast<const T*>(q),   static_cast<const T*>(k),
                        static_cast<const T*>(cos), static_cast<const T*>(sin)};
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (vec)
      return backward ? launch_rope<T, kN, true>(t, p, s) : launch_rope<T, kN, false>(t, p, s);
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
    t.o = {static_cast<T*>(q_out),   static_cast<T*>(k_out),     static_cast<const T*>(q),
           static_cast<const T*>(k), static_cast<const T*>(cos), static_cast<const T*>(sin)};
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

int qk_norm_rope_bwd_cuda(void* dq, void* dk, void* dq_weight, void* dk_weight, const void* dq_out,
                          const void* dk_out, const void* xq, const void* xk,
                          const RopeStrides& xq_s, const RopeStrides& xk_s, const void* q_weight,
                          const void* k_weight, const float* q_rstd, const float* k_rstd,
                          const void* cos, const void* sin, float* workspace, int sm_count,
                          const RopeProblem& p, void* stream) {
  if (!problem_ok(p)) return int(cudaErrorInvalidValue);
  const bool want_dw = dq_weight != nullptr || dk_weight != nullptr;
  const int64_t positions = positions_of(p);
  if ((positions == 0 || p.q_heads + p.kv_heads == 0) && !want_dw) return 0;
  if (want_dw && workspace == nullptr) return int(cudaErrorInvalidValue);
  if (positions > 0 && ((p.q_heads > 0 && (dq == nullptr || dq_out == nullptr || xq == nullptr ||
                                           q_weight == nullptr || q_rstd == nullptr)) ||
                        (p.kv_heads > 0 && (dk == nullptr || dk_out == nullptr || xk == nullptr ||
                                            k_weight == nullptr || k_rstd == nullptr)) ||
                        cos == nullptr || sin == nullptr))
    return int(cudaErrorInvalidValue);
  const bool vec =
      vectorizable(p, {dq, dk, dq_out, dk_out, xq, xk, q_weight, k_weight, cos, sin}, {xq_s, xk_s});
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    NormOperands<T> t{};
    t.o = {static_cast<T*>(dq),           static_cast<T*>(dk),        static_cast<const T*>(dq_out),
           static_cast<const T*>(dk_out), static_cast<const T*>(cos), static_cast<const T*>(sin)};
    t.q_weight = static_cast<const T*>(q_weight);
    t.k_weight = static_cast<const T*>(k_weight);
    t.q_rstd = const_cast<float*>(q_rstd);
    t.k_rstd = const_cast<float*>(k_rstd);
    t.xq = static_cast<const T*>(xq);
    t.xk = static_cast<const T*>(xk);
    t.xq_s = xq_s;
    t.xk_s = xk_s;
    t.partial = want_dw ? workspace : nullptr;
    return bwd_norm<T>(t, static_cast<T*>(dq_weight), static_cast<T*>(dk_weight), p, vec, sm_count,
                       static_cast<cudaStream_t>(stream));
  });
}

}  // namespace kernelgate::kernels
