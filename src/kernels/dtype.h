// Element types the kernels understand; the ops layer maps at::ScalarType onto these.
#pragma once

namespace kernelgate::kernels {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline int dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

}  // namespace kernelgate::kernels
