// A naive rms_norm for the loop: one thread per row, any layout (strides), sums in double.
// The starting point of the H200 loop demonstration (kernelgate loop start rms_norm --device cuda).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdio.h>

#include "kernelgate_loop.h"

namespace {

struct Geometry {
  int ndim;
  long long sizes[8], strides[8];
};

Geometry geometry(const kg_tensor& t) {
  Geometry g;
  g.ndim = t.ndim;
  for (int i = 0; i < t.ndim; ++i) g.sizes[i] = t.sizes[i], g.strides[i] = t.strides[i];
  return g;
}

// Every dtype is read from its tensor: x, weight and the outputs may differ (mixed precision).
// Element offset of (row r over the leading dims, column h).
__device__ long long offset(const Geometry& g, long long r, long long h) {
  long long off = h * g.strides[g.ndim - 1];
  for (int d = g.ndim - 2; d >= 0; --d) {
    off += (r % g.sizes[d]) * g.strides[d];
    r /= g.sizes[d];
  }
  return off;
}

__device__ float load(const void* p, int dtype, long long i) {
  if (dtype == KG_FLOAT16) return __half2float(static_cast<const __half*>(p)[i]);
  if (dtype == KG_BFLOAT16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ void store(void* p, int dtype, long long i, float v) {
  if (dtype == KG_FLOAT16) static_cast<__half*>(p)[i] = __float2half(v);
  else if (dtype == KG_BFLOAT16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v);
  else static_cast<float*>(p)[i] = v;
}

__global__ void forward_rows(const void* x, Geometry gx, const void* w, long long w_stride, int dtype,
                             int w_dtype, void* y, int y_dtype, float* rstd, long long rows, long long hidden,
                             float eps) {
  long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (r >= rows) return;
  double ss = 0.0;  // sequential float32 sums lose ~hidden * 2^-24 of the mean: double instead
  for (long long h = 0; h < hidden; ++h) {
    double v = load(x, dtype, offset(gx, r, h));
    ss += v * v;
  }
  float s = static_cast<float>(1.0 / sqrt(ss / hidden + eps));
  rstd[r] = s;
  for (long long h = 0; h < hidden; ++h) {
    float v = load(x, dtype, offset(gx, r, h)) * s;
    if (w) v *= load(w, w_dtype, h * w_stride);
    store(y, y_dtype, r * hidden + h, v);
  }
}

__global__ void backward_rows(const void* dy, Geometry gdy, int dy_dtype, const void* x, Geometry gx, const void* w,
                              long long w_stride, int dtype, int w_dtype, const float* rstd, void* dx,
                              int dx_dtype, long long rows, long long hidden) {
  long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float s = rstd[r];
  double dot = 0.0;
  for (long long h = 0; h < hidden; ++h) {
    float g = load(dy, dy_dtype, offset(gdy, r, h)) * (w ? load(w, w_dtype, h * w_stride) : 1.f);
    dot += g * load(x, dtype, offset(gx, r, h)) * s;
  }
  const float mean_dot = static_cast<float>(dot / hidden);
  for (long long h = 0; h < hidden; ++h) {
    float g = load(dy, dy_dtype, offset(gdy, r, h)) * (w ? load(w, w_dtype, h * w_stride) : 1.f);
    float xhat = load(x, dtype, offset(gx, r, h)) * s;
    store(dx, dx_dtype, r * hidden + h, s * (g - xhat * mean_dot));
  }
}

__global__ void backward_weight(const void* dy, Geometry gdy, int dy_dtype, const void* x, Geometry gx, int dtype,
                                const float* rstd, void* dw, int dw_dtype, long long rows, long long hidden) {
  long long h = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (h >= hidden) return;
  double acc = 0.0;
  for (long long r = 0; r < rows; ++r)
    acc += load(dy, dy_dtype, offset(gdy, r, h)) * load(x, dtype, offset(gx, r, h)) * rstd[r];
  store(dw, dw_dtype, h, static_cast<float>(acc));
}

int fail(char* err, int len, const char* what) {
  snprintf(err, len, "%s", what);
  return 1;
}

long long leading(const kg_tensor& t) {
  long long n = 1;
  for (int i = 0; i + 1 < t.ndim; ++i) n *= t.sizes[i];
  return n;
}

}  // namespace

// tensors: x, weight; scalars: eps; outputs: y, rstd.
extern "C" int kg_forward(const kg_tensor* t, int nt, const double* sc, int, const int*, int, kg_tensor* out,
                          int nout, int, void* stream, char* err, int err_len) {
  if (nt != 2 || nout < 1) return fail(err, err_len, "rms_norm: expected 2 tensors and an output");
  const kg_tensor &x = t[0], &w = t[1];
  long long rows = leading(x), hidden = x.sizes[x.ndim - 1];
  float* rstd = nullptr;
  if (nout > 1) {
    rstd = static_cast<float*>(out[1].data);
  } else if (cudaMallocAsync(reinterpret_cast<void**>(&rstd), (rows > 0 ? rows : 1) * sizeof(float),
                             static_cast<cudaStream_t>(stream)) != cudaSuccess) {
    return fail(err, err_len, "rms_norm: cudaMallocAsync failed");
  }
  if (rows > 0) {
    forward_rows<<<(rows + 127) / 128, 128, 0, static_cast<cudaStream_t>(stream)>>>(
        x.data, geometry(x), w.data, w.data ? w.strides[0] : 0, x.dtype, w.data ? w.dtype : 0, out[0].data,
        out[0].dtype, rstd, rows, hidden, static_cast<float>(sc[0]));
  }
  if (nout == 1) cudaFreeAsync(rstd, static_cast<cudaStream_t>(stream));
  return cudaGetLastError() == cudaSuccess ? 0 : fail(err, err_len, "rms_norm: launch failed");
}

// tensors: grad_y, x, weight, rstd; scalars: eps; grads: dx, dweight.
extern "C" int kg_backward(const kg_tensor* t, int nt, const double*, int, const int*, int, kg_tensor* g, int ng,
                           int, void* stream, char* err, int err_len) {
  if (nt != 4 || ng != 2) return fail(err, err_len, "rms_norm: expected 4 tensors and 2 gradients");
  const kg_tensor &dy = t[0], &x = t[1], &w = t[2], &rstd = t[3];
  if (rstd.dtype != KG_FLOAT32) return fail(err, err_len, "rms_norm: expected float32 rstd");
  long long rows = leading(x), hidden = x.sizes[x.ndim - 1];
  auto s = static_cast<cudaStream_t>(stream);
  if (rows > 0 && g[0].data) {
    backward_rows<<<(rows + 127) / 128, 128, 0, s>>>(dy.data, geometry(dy), dy.dtype, x.data, geometry(x), w.data,
                                                     w.data ? w.strides[0] : 0, x.dtype, w.data ? w.dtype : 0,
                                                     static_cast<const float*>(rstd.data), g[0].data, g[0].dtype,
                                                     rows, hidden);
  }
  if (g[1].data) {
    backward_weight<<<(hidden + 127) / 128, 128, 0, s>>>(dy.data, geometry(dy), dy.dtype, x.data, geometry(x), x.dtype,
                                                         static_cast<const float*>(rstd.data), g[1].data,
                                                         g[1].dtype, rows, hidden);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : fail(err, err_len, "rms_norm: launch failed");
}
