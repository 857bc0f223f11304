// kernelgate's C++ API: each op routed to the fastest backend proven correct for the call.
// Calls go through PyTorch's dispatcher, so autograd, torch.compile and CUDA graphs work as they
// do from Python (torch.ops.kernelgate.<op>). Every op, including those without a function here,
// is also reachable as kernelgate::typed_op<Signature>("<op>") (kernelgate/op.h).
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "kernelgate/dispatch.h"

namespace kernelgate {

// Normalises x over its last dim by its root mean square (float32 accumulation) and scales by
// weight; returns x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight = std::nullopt,
                    double eps = 1e-6);

// silu(gate) * up and gelu(gate, approximate) * up (approximate: "tanh" or "none"), float32
// math, in gate's dtype; gate and up of one shape.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up,
                 c10::string_view approximate = "tanh");

// h = x + residual (rounded to x's dtype), y = rms_norm(h) * weight (float32 statistics);
// returns (y, h). x and residual of one shape.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(
    const at::Tensor& x, const at::Tensor& residual,
    const std::optional<at::Tensor>& weight = std::nullopt, double eps = 1e-6);

// Layer norm over the last dim, float32 statistics: (x - mean) * rstd * weight + bias, as
// torch.nn.functional.layer_norm(x, (x.size(-1),), weight, bias, eps).
at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight = std::nullopt,
                      const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5);

// Rotary position embedding, rotate-half convention (Llama / HF): x cos + rotate_half(x) sin for
// q [batch, q_heads, seq, head_dim] and k [batch, kv_heads, seq, head_dim] (head_dim even),
// cos / sin [1 or batch, seq, head_dim] shared by all heads. float32 math, outputs in q's dtype.
// Gradients flow to q and k only: cos and sin are constants.
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& cos, const at::Tensor& sin);
// Per-head rms_norm of q and k over head_dim (weights q_weight / k_weight [head_dim], float32
// statistics), then rope, fused; the normalised heads stay float32 in between. Gradients flow to
// q, k, q_weight and k_weight.
std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& q_weight,
                                                const at::Tensor& k_weight, const at::Tensor& cos,
                                                const at::Tensor& sin, double eps = 1e-6);
// Cross-entropy of logits [rows, classes] against target [rows] (int64 or int32), float32 math,
// like torch.nn.functional.cross_entropy: rows whose target is ignore_index count for nothing;
// label_smoothing in [0, 1]; reduction "mean" (over the rows not ignored: NaN when all are),
// "sum" or "none" (per-row loss, 0 for ignored rows); loss in logits' dtype. On CUDA an
// out-of-range target gives a NaN loss (and NaN gradient row) instead of an error.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                         int64_t ignore_index = -100, double label_smoothing = 0.0,
                         c10::string_view reduction = "mean");

// cross_entropy(hidden @ weight.T + bias, target, ...) without materialising the float32
// logits (hidden [rows, hidden], weight [classes, hidden], bias [classes]); gradients for
// hidden, weight and bias.
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& target,
                                const std::optional<at::Tensor>& bias = std::nullopt,
                                int64_t ignore_index = -100, double label_smoothing = 0.0,
                                c10::string_view reduction = "mean");

}  // namespace kernelgate
