// attention: softmax attention with grouped-query heads (GQA; MHA at group 1, MQA at one kv head),
//   o[b, h, g, i] = sum_j softmax_j(scale * q[b, h, g, i] . k[b, h, j]) v[b, h, j],
// j <= i when the mask is causal. The op's q is grouped by kv head, [batch, kv_heads, group, seq,
// head_dim] (query head h * group + g reads kv head h): the [batch, heads, seq, head_dim] q of
// attention code is a view of it, which kg.attention takes; k and v are [batch, kv_heads, seq,
// head_dim]. scale 0 means 1 / sqrt(head_dim). Contract, reference and backends (reference,
// eager: PyTorch's scaled_dot_product_attention; aten_flash, aten_cudnn, aten_efficient: ATen's
// fused attention kernels, each with its own backward).
//
// Gradients at non-finite inputs. A query row whose scores are not all finite (a NaN or an Inf
// in q or k: its log-sum-exp is not finite) makes every gradient of its kv head NaN: dq of the
// head's query heads, dk and dv. The fused kernels compute the backward's score gradients
// P (dP - D) over whole tiles, masked entries included, so such a row's NaN reaches dk and dv of
// every key in its tile, and how far depends on the kernel's tile size; the masked float64
// reference gives NaN in fewer places still. The rule is the union of them all, the same for
// every backend, and never gives a finite gradient where any of them gives NaN. Forward outputs
// are not touched.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <atomic>
#include <cmath>

#include "kernelgate/kernelgate.h"
#include "kernels/attention.h"
#include "ops/op_util.h"

namespace kernelgate {
namespace {

using at::Tensor;
using Outs = std::tuple<Tensor, Tensor>;  // o, lse
using Grads = std::tuple<Tensor, Tensor, Tensor>;
constexpr const char* kOp = "attention";

bool parse_mask(c10::string_view mask) {
  if (mask == "causal") return true;
  if (mask == "none") return false;
  TORCH_CHECK(false, kOp, ": mask must be 'causal' or 'none', got '", mask, "'");
}

double scale_of(const Tensor& q, double scale) {
  const int64_t d = q.size(-1);
  return scale == 0.0 && d > 0 ? 1.0 / std::sqrt(static_cast<double>(d)) : scale;
}

Tensor in_dtype(const Tensor& t, at::ScalarType s) { return t.scalar_type() == s ? t : t.to(s); }

// ---- the gradient rule at non-finite inputs (above)

// [batch, kv_heads] bool: the kv heads with a query row whose log-sum-exp ([batch, kv_heads,
// group, seq]) is not finite.
Tensor bad_heads(const Tensor& lse) {
  return at::isfinite(lse).logical_not().flatten(2).any(-1);
}

// Sets to NaN each flagged kv head's elements of the gradients dq [batch, kv_heads, group, seq,
// head_dim], dk and dv [batch, kv_heads, seq, head_dim] (any strides); undefined ones are skipped.
void poison(Grads& g, const Tensor& bad) {
  Tensor* grads[] = {&std::get<0>(g), &std::get<1>(g), &std::get<2>(g)};
#ifdef KERNELGATE_WITH_CUDA
  const Tensor* first = nullptr;
  for (Tensor* t : grads) {
    if (t->defined()) first = first ? first : t;
  }
  if (first != nullptr && first->is_cuda() && first->scalar_type() != at::kDouble) {
    kernels::AttentionGrad views[kernels::kAttentionMaxPoisoned];
    for (int i = 0; i < kernels::kAttentionMaxPoisoned; ++i) {
      const Tensor& t = *grads[i];
      if (!t.defined() || t.numel() == 0) continue;
      TORCH_INTERNAL_ASSERT(t.scalar_type() == first->scalar_type() && t.dim() <= kernels::kAttentionMaxDims);
      views[i].ptr = t.data_ptr();
      views[i].dims = static_cast<int>(t.dim());
      for (int64_t d = 0; d < t.dim(); ++d) {
        views[i].sizes[d] = t.size(d);
        views[i].strides[d] = t.stride(d);
      }
    }
    CudaContext ctx(*first);
    Tensor flags = bad.contiguous();
    check_cuda(kernels::attention_poison_heads_cuda(views, kernels::kAttentionMaxPoisoned,
                                                    flags.const_data_ptr<bool>(), bad.size(0),
                                                    bad.size(1), kernel_dtype(first->scalar_type()),
                                                    ctx.stream),
               "attention gradient rule");
    return;
  }
#endif
  for (Tensor* t : grads) {
    if (!t->defined()) continue;
    std::vector<int64_t> flag_shape(static_cast<size_t>(t->dim()), 1);
    flag_shape[0] = bad.size(0);
    flag_shape[1] = bad.size(1);
    *t = in_layout_of(t->masked_fill(bad.view(flag_shape), std::nan("")), *t);
  }
}

// The rule in the reference's autograd: identity on o; its backward passes o's gradient through
// and adds, to q, k and v's, NaN over the flagged kv heads and 0 elsewhere.
class PoisonHeads : public torch::autograd::Function<PoisonHeads> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& o, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& bad) {
    ctx->save_for_backward({bad});
    ctx->saved_data["q"] = q.sizes().vec();
    ctx->saved_data["kv"] = k.sizes().vec();
    return o.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Tensor bad = ctx->get_saved_variables()[0];
    const auto opts = grads[0].options();
    Grads g{at::zeros(ctx->saved_data["q"].toIntVector(), opts),
            at::zeros(ctx->saved_data["kv"].toIntVector(), opts),
            at::zeros(ctx->saved_data["kv"].toIntVector(), opts)};
    poison(g, bad);
    return {grads[0], std::get<0>(g), std::get<1>(g), std::get<2>(g), Tensor()};
  }
};

// ---- reference: what PyTorch's attention computes at the input dtype (its math path): the
// matrix products in q's dtype (float32 accumulation), the softmax in float32, the scores of every
// query against every key materialised; in float64 for float64 inputs, the oracle. Its autograd,
// as the op _attention_reference, is the gradient contract. As in FlashAttention's own tests, a
// fused kernel's error is judged against twice this computation's error at the dtype: the fused
// kernels also round the probabilities (and in their backward the score gradients) to q's dtype
// for their products. A row whose every visible score is -inf gets probabilities 0 (PyTorch's
// safe softmax, as the fused kernels give), and a key the mask hides contributes nothing.

at::ScalarType acc_type(const Tensor& q) { return at::promote_types(q.scalar_type(), at::kFloat); }

// The dtype of the products: q's for 16-bit inputs, else float32 / float64.
at::ScalarType mm_type(const Tensor& q) {
  const auto t = q.scalar_type();
  return t == at::kHalf || t == at::kBFloat16 ? t : acc_type(q);
}

// The causal mask's upper triangle, made on the device (no host-to-device copy: a CUDA graph
// captures it).
Tensor above_diagonal(const Tensor& q) {
  const int64_t n = q.size(3);
  return at::ones({n, n}, q.options().dtype(at::kBool)).triu(1);
}

// scale * q k^T, [batch, kv_heads, group, seq, seq] in acc, -inf above the diagonal when causal.
Tensor scores(const Tensor& q, const Tensor& k, bool causal, double scale) {
  const auto mm = mm_type(q);
  Tensor s = at::matmul(in_dtype(q, mm), in_dtype(k, mm).unsqueeze(2).transpose(-1, -2));
  s = in_dtype(s, acc_type(q)) * scale;
  if (causal) s = s.masked_fill(above_diagonal(q), -std::numeric_limits<double>::infinity());
  return s;
}

// The probabilities in acc: safe softmax, zero where the mask is.
Tensor probabilities(const Tensor& s, const Tensor& q, bool causal) {
  Tensor p = at::_safe_softmax(s, -1);
  return causal ? p.masked_fill(above_diagonal(q), 0.0) : p;
}

// o = p v with p in the products' dtype, in q's dtype.
Tensor attend(const Tensor& p, const Tensor& q, const Tensor& v) {
  const auto mm = mm_type(q);
  return in_dtype(at::matmul(in_dtype(p, mm), in_dtype(v, mm).unsqueeze(2)), q.scalar_type());
}

Tensor reference_op(const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view mask,
                    double scale) {
  const bool causal = parse_mask(mask);
  Tensor s = scores(q, k, causal, scale_of(q, scale));
  Tensor o = attend(probabilities(s, q, causal), q, v);
  if (!at::GradMode::is_enabled() ||
      !(q.requires_grad() || k.requires_grad() || v.requires_grad())) {
    return o;
  }
  return PoisonHeads::apply(o, q, k, v, bad_heads(at::logsumexp(s.detach(), -1)));
}

// lse: [batch, kv_heads, group, seq], float32 (float64 for float64 inputs), the log of each
// query's softmax denominator, max + log(sum(exp(s - max))), as the fused kernels keep it for
// their backward.
Outs reference_fwd(const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view mask,
                   double scale, GradRequest need) {
  const bool causal = parse_mask(mask);
  Tensor s = scores(q, k, causal, scale_of(q, scale));
  Tensor o = in_layout_of(attend(probabilities(s, q, causal), q, v), q);
  Tensor lse;
  if (need.any()) {
    Tensor m = std::get<0>(s.max(-1, /*keepdim=*/true));
    lse = (m + at::log(at::exp(s - m).sum(-1, /*keepdim=*/true))).squeeze(-1);
  }
  return {o, lse};
}

// The steps of the reference's autograd, each product in its dtype (p recomputed by softmax, not
// from lse: at large scores s - lse loses the digits p needs): dv = sum_g p^T do; dp = do v^T,
// zero where the mask is; ds = scale p (dp - rowsum(p dp)), zero where the mask is, in the
// products' dtype; dq = ds k; dk = sum_g ds^T q.
Grads reference_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor&, const Tensor& lse, c10::string_view mask, double scale,
                    GradRequest need) {
  const auto acc = acc_type(q), mm = mm_type(q);
  const bool causal = parse_mask(mask);
  Tensor p = probabilities(scores(q, k, causal, scale_of(q, scale)), q, causal);
  Tensor g = in_dtype(dout, mm);
  Tensor dq, dk, dv;
  if (need(2)) dv = in_layout_of(at::matmul(in_dtype(p, mm).transpose(-1, -2), g).sum(2).to(v.scalar_type()), v);
  if (need(0) || need(1)) {
    Tensor dp = in_dtype(at::matmul(g, in_dtype(v, mm).unsqueeze(2).transpose(-1, -2)), acc);
    if (causal) dp = dp.masked_fill(above_diagonal(q), 0.0);
    Tensor ds = p * (dp - (p * dp).sum(-1, /*keepdim=*/true));
    if (causal) ds = ds.masked_fill(above_diagonal(q), 0.0);
    ds = in_dtype(ds * scale_of(q, scale), mm);
    if (need(0)) dq = in_layout_of(at::matmul(ds, in_dtype(k, mm).unsqueeze(2)).to(q.scalar_type()), q);
    if (need(1)) {
      dk = in_layout_of(at::matmul(ds.transpose(-1, -2), in_dtype(q, mm)).sum(2).to(k.scalar_type()), k);
    }
  }
  Grads out{dq, dk, dv};
  poison(out, bad_heads(lse));
  return out;
}

// ---- q as attention code holds it: [batch, heads, seq, head_dim] (a view where its strides
// allow), and the output back in the op's grouped form, in q's layout (in_layout_of: a view of
// what the kernel wrote where its strides are q's, as flash's are for attention code's q).

Tensor heads_view(const Tensor& q) {
  return q.reshape({q.size(0), q.size(1) * q.size(2), q.size(3), q.size(4)});
}

Tensor grouped(const Tensor& o4, const Tensor& q) { return in_layout_of(o4.reshape(q.sizes()), q); }

// k or v with each kv head repeated for its group of query heads: [batch, heads, seq, head_dim]
// (a copy; the kernels without grouped heads of their own take it).
Tensor repeated(const Tensor& t, int64_t group) {
  if (group == 1) return t;
  return t.unsqueeze(2)
      .expand({t.size(0), t.size(1), group, t.size(2), t.size(3)})
      .reshape({t.size(0), t.size(1) * group, t.size(2), t.size(3)});
}

// The gradient of a repeated k or v: summed over each group.
Tensor summed(const Tensor& g, const Tensor& t, int64_t group) {
  if (!g.defined() || group == 1) return g;
  return g.view({t.size(0), t.size(1), group, t.size(2), t.size(3)}).sum(2);
}

// An operand as the fused kernels read it: unit last stride, every other stride and the data
// pointer 16-byte aligned (their vector loads; an unaligned one faults the device); a copy where
// it is not.
Tensor unit_last(const Tensor& t) {
  const int64_t per16 = 16 / static_cast<int64_t>(t.element_size());
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  for (int64_t d = 0; ok && d + 1 < t.dim(); ++d) ok = t.size(d) == 1 || (t.stride(d) != 0 && t.stride(d) % per16 == 0);
  // A clone, not contiguous(): a contiguous view whose data pointer is not aligned is returned
  // as it is by contiguous().
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// A kernel's log-sum-exp ([batch, heads, seq] with whatever trailing unit dim) as the op keeps
// it, [batch, kv_heads, group, seq] dense; and back as the kernels take it, [batch, heads, seq].
Tensor grouped_lse(const Tensor& l, const Tensor& q) {
  return l.reshape({q.size(0), q.size(1), q.size(2), q.size(3)}).contiguous();
}
Tensor heads_lse(const Tensor& lse, const Tensor& q) {
  return lse.reshape({q.size(0), q.size(1) * q.size(2), q.size(3)});
}

std::optional<double> sdpa_scale(const Tensor& q, double scale) {
  return scale == 0.0 ? std::nullopt : std::optional<double>(scale);
}

// ---- eager: what a user writes without kernelgate.

Tensor eager(const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view mask, double scale) {
  const bool causal = parse_mask(mask);
  Tensor o = at::scaled_dot_product_attention(heads_view(q), k, v, std::nullopt, 0.0, causal,
                                              sdpa_scale(q, scale), /*enable_gqa=*/q.size(2) > 1);
  return o.reshape(q.sizes());
}

// ---- ATen's fused kernels, called directly (scaled_dot_product_attention picks one of them by
// its own rules; here the evidence picks). Each keeps the log-sum-exp for its backward: the
// extra `lse`, [batch, kv_heads, group, seq] float32, whatever padding or trailing unit dim the
// kernel's own has.

Support fused_can_implement(const CallView& call, bool half_only, int64_t max_head_dim) {
  const Support s = cuda_sm80(call, "q is not on a CUDA device");
  if (!s.ok) return s;
  const at::Tensor& q = *call.tensors[0];
  if (half_only && q.scalar_type() == at::kFloat) return Support::no("implements float16 and bfloat16 only");
  const int64_t d = q.size(-1);
  if (d % 8 != 0) return Support::no("implements head_dim a multiple of 8 only");
  if (d > max_head_dim) {
    return Support::no(max_head_dim == 256 ? "implements head_dim up to 256 only"
                                           : "implements head_dim up to 128 only");
  }
  if (q.size(3) == 0 || d == 0) return Support::no("implements non-empty sequences only");
  return Support::yes();
}

#ifdef KERNELGATE_WITH_CUDA
Tensor no_tensor() { return Tensor(); }

// The dropout RNG state the backward kernels take: without dropout ATen's forwards return
// empty CPU scalars, and the backwards do not read them.
Tensor no_rng() { return at::zeros({}, at::dtype(at::kLong)); }
// cuDNN's backward checks that they are on q's device.
Tensor cudnn_rng(const Tensor& q) { return at::zeros({}, q.options().dtype(at::kLong)); }

// flash: grouped heads natively (the kernel maps query head h to kv head h / group).
Outs flash_fwd(const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view mask,
               double scale, GradRequest need) {
  Tensor q4 = unit_last(heads_view(q));
  auto r = at::_scaled_dot_product_flash_attention(q4, unit_last(k), unit_last(v), 0.0,
                                                   parse_mask(mask), false, sdpa_scale(q, scale));
  Tensor lse = need.any() ? grouped_lse(std::get<1>(r), q) : Tensor();
  return {grouped(std::get<0>(r), q), lse};
}

Grads flash_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& o, const Tensor& lse, c10::string_view mask, double scale,
                GradRequest) {
  const int64_t n = q.size(3);
  const Tensor rng = no_rng();
  auto r = at::_scaled_dot_product_flash_attention_backward(
      unit_last(heads_view(dout)), unit_last(heads_view(q)), unit_last(k), unit_last(v),
      unit_last(heads_view(o)), heads_lse(lse, q), no_tensor(), no_tensor(), n, n, 0.0,
      parse_mask(mask), rng, rng, sdpa_scale(q, scale));
  Grads g{grouped(std::get<0>(r), q), in_layout_of(std::get<1>(r), k), in_layout_of(std::get<2>(r), v)};
  poison(g, bad_heads(lse));
  return g;
}

// The cuDNN kernel's log-sum-exp has a trailing unit dim in some PyTorch releases: its forward
// says which, its backward gets it back in that form.
std::atomic<int> g_cudnn_lse_rank{4};
// t with exactly these strides and a 16-byte aligned data pointer (a copy where it is not so).
Tensor with_strides(const Tensor& t, const std::vector<int64_t>& strides) {
  const bool aligned = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  if (aligned && t.strides() == at::IntArrayRef(strides)) return t;
  return at::empty_strided(t.sizes(), strides, t.options()).copy_(t);
}

Outs cudnn_fwd(const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view mask,
               double scale, GradRequest need) {
  // Grouped heads natively (kv head h / group serves query head h), as SDPA's GQA calls it.
  Tensor q4 = unit_last(heads_view(q));
  auto r = at::_scaled_dot_product_cudnn_attention(q4, unit_last(k), unit_last(v), std::nullopt,
                                                   need.any(), 0.0, parse_mask(mask), false,
                                                   sdpa_scale(q, scale));
  Tensor lse;
  if (need.any()) {
    g_cudnn_lse_rank.store(static_cast<int>(std::get<1>(r).dim()), std::memory_order_relaxed);
    lse = grouped_lse(std::get<1>(r), q);
  }
  return {grouped(std::get<0>(r), q), lse};
}

Grads cudnn_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& o, const Tensor& lse, c10::string_view mask, double scale,
                GradRequest) {
  const int64_t n = q.size(3);
  const Tensor rng = cudnn_rng(q);
  // ATen caches cuDNN's compiled backward by the sizes and strides of q, k and v alone, and the
  // strides of o, dout and the log-sum-exp are built into it: after an SDPA call elsewhere in the
  // program on q, k, v of these strides, ours runs SDPA's graph (in a training step of the H200,
  // a dout re-laid in o's order was read in SDPA's: dq 173% off). So o, dout and the log-sum-exp
  // go in exactly as SDPA's autograd hands them over for the same call: o as cuDNN's forward laid
  // it out (at::empty_like(q), so in_layout_of), dout as it comes (re-laid in o's order only where
  // its last stride is not 1, as SDPA does), the log-sum-exp dense as the forward gave it (torch
  // 2.11 for either q layout: bench/results/h200/cudnn_attention_check.json); a graph compiled by
  // either call reads the other's operands alike. (dout's data pointer aligned, strides kept: a q
  // one element into its storage gave a wrong dq on the H200.)
  Tensor q4 = unit_last(heads_view(q));
  Tensor o4 = in_layout_of(heads_view(o), q4);
  Tensor do4 = heads_view(dout);
  do4 = with_strides(do4, do4.stride(-1) == 1 && do4.is_non_overlapping_and_dense() ? do4.strides().vec()
                                                                                     : o4.strides().vec());
  Tensor l = heads_lse(lse, q);
  if (g_cudnn_lse_rank.load(std::memory_order_relaxed) == 4) l = l.unsqueeze(-1);
  auto r = at::_scaled_dot_product_cudnn_attention_backward(
      do4, q4, unit_last(k), unit_last(v), o4, l,
      rng, rng, no_tensor(), no_tensor(), no_tensor(), n, n, 0.0, parse_mask(mask), sdpa_scale(q, scale));
  Grads g{grouped(std::get<0>(r), q), in_layout_of(std::get<1>(r), k), in_layout_of(std::get<2>(r), v)};
  poison(g, bad_heads(lse));
  return g;
}

// The memory-efficient kernel pads its log-sum-exp to a multiple of 32 queries in the PyTorch
// releases we know: its forward says whether it did, its backward gets it back in that form.
std::atomic<bool> g_efficient_lse_padded{true};

Outs efficient_fwd(const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view mask,
                   double scale, GradRequest need) {
  const int64_t group = q.size(2), n = q.size(3);
  auto r = at::_scaled_dot_product_efficient_attention(
      unit_last(heads_view(q)), unit_last(repeated(k, group)), unit_last(repeated(v, group)),
      std::nullopt, need.any(), 0.0, parse_mask(mask), sdpa_scale(q, scale));
  Tensor lse;
  if (need.any()) {
    const Tensor& l = std::get<1>(r);
    if (n % 32 != 0) g_efficient_lse_padded.store(l.size(-1) != n, std::memory_order_relaxed);
    lse = grouped_lse(l.narrow(-1, 0, n), q);
  }
  return {grouped(std::get<0>(r), q), lse};
}

Grads efficient_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& o, const Tensor& lse, c10::string_view mask, double scale,
                    GradRequest need) {
  const int64_t group = q.size(2), n = q.size(3);
  Tensor l = heads_lse(lse, q);
  const Tensor rng = no_rng();
  const int64_t padded = (n + 31) / 32 * 32;
  if (padded != n && g_efficient_lse_padded.load(std::memory_order_relaxed))
    l = at::constant_pad_nd(l, {0, padded - n});
  // The kernel takes o's batch and head strides but derives its row stride from o being stored
  // [batch, seq, heads, head_dim], as its forward writes it (a dense [batch, heads, seq, head_dim]
  // o gave wrong dq, dk and dv on the H200): o in that storage.
  Tensor o_bmhk = heads_view(o).transpose(1, 2).contiguous().transpose(1, 2);
  auto r = at::_scaled_dot_product_efficient_attention_backward(
      unit_last(heads_view(dout)), unit_last(heads_view(q)), unit_last(repeated(k, group)),
      unit_last(repeated(v, group)), no_tensor(), o_bmhk, l, rng, rng, 0.0,
      {need(0), need(1), need(2), false}, parse_mask(mask), sdpa_scale(q, scale));
  Tensor dq = std::get<0>(r), dk = std::get<1>(r), dv = std::get<2>(r);
  Grads g{dq.defined() ? grouped(dq, q) : dq, dk.defined() ? in_layout_of(summed(dk, k, group), k) : dk,
          dv.defined() ? in_layout_of(summed(dv, v, group), v) : dv};
  poison(g, bad_heads(lse));
  return g;
}
#endif

// ---- declaration

void check_args(const Tensor&, const Tensor&, const Tensor&, c10::string_view mask, double scale) {
  parse_mask(mask);
  TORCH_CHECK(std::isfinite(scale), kOp, ": scale must be finite (0 for 1/sqrt(head_dim)), got ",
              number(scale));
}

Outs meta(const Tensor& q, const Tensor&, const Tensor&, c10::string_view, double) {
  std::vector<int64_t> rows(q.sizes().begin(), q.sizes().end() - 1);
  return {at::empty_like(q, at::MemoryFormat::Preserve), at::empty(rows, q.options().dtype(acc_type(q)))};
}

OpContract contract() {
  OpContract c;
  c.name = kOp;
  c.schema =
      "attention(Tensor q, Tensor k, Tensor v, str mask=\"causal\", float scale=0.0) -> Tensor";
  c.dims =
      "q: [batch, kv_heads, group, seq, head_dim]; k: [batch, kv_heads, seq, head_dim]; "
      "v: [batch, kv_heads, seq, head_dim]";
  c.dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  // causal first: the production shapes are swept with the default variant.
  c.variant_args = {{"mask", {"causal", "none"}}};
  c.scalar_test_values = {{"scale", {0.0, 0.0625}}};
  // seq at most 4096: the oracle materialises the float64 scores of every query and key.
  c.dim_ranges = {{"batch", {1, 16}},  {"kv_heads", {1, 32}},  {"group", {1, 8}},
                  {"seq", {1, 4096}},  {"head_dim", {1, 256}}};
  // The training step's Llama (16 query heads over 4 kv heads of 128), a Llama-3-8B layer
  // (32 over 8), a multi-head model of 64-wide heads.
  c.production_shapes = {
      {{"batch", 4}, {"kv_heads", 4}, {"group", 4}, {"seq", 2048}, {"head_dim", 128}},
      {{"batch", 1}, {"kv_heads", 8}, {"group", 4}, {"seq", 4096}, {"head_dim", 128}},
      {{"batch", 8}, {"kv_heads", 12}, {"group", 1}, {"seq", 1024}, {"head_dim", 64}},
  };
  // Attention code's q.view(batch, seq, heads, head_dim).transpose(1, 2), and dense heads.
  c.production_layouts = {"transposed", "contiguous"};
  c.outputs = {"o"};
  c.extras = {"lse"};
  c.saved = {"q", "k", "v", "o", "lse"};
  // o and dq in attention code's layout of q (dk, dv in k's, v's), as SDPA returns them.
  c.keeps_input_layout = true;
  return c;
}

const OpId kAttention =
    OpDeclaration(contract())
        .reference(reference_op)
        .eager(eager)
        .meta(meta)
        .check(check_args)
        .backend("reference", BackendKind::kReference, reference_fwd, reference_bwd)
#ifdef KERNELGATE_WITH_CUDA
        .backend("aten_flash", BackendKind::kVendor, flash_fwd, flash_bwd,
                 [](const CallView& call) { return fused_can_implement(call, true, 256); },
                 cuda_available)
        .backend("aten_cudnn", BackendKind::kVendor, cudnn_fwd, cudnn_bwd,
                 [](const CallView& call) {
                   const Support s = fused_can_implement(call, true, 128);
                   if (s.ok && call.tensors[0]->size(3) == 1) {
                     return Support::no("implements sequences of 2 or more only (cuDNN refuses "
                                        "s_q = s_kv = 1)");
                   }
                   return s;
                 },
                 cuda_available)
        .backend("aten_efficient", BackendKind::kVendor, efficient_fwd, efficient_bwd,
                 [](const CallView& call) { return fused_can_implement(call, false, 256); },
                 cuda_available)
#else
        .unavailable("aten_flash", BackendKind::kVendor, kNoCudaBuild)
        .unavailable("aten_cudnn", BackendKind::kVendor, kNoCudaBuild)
        .unavailable("aten_efficient", BackendKind::kVendor, kNoCudaBuild)
#endif
        .install();

}  // namespace
}  // namespace kernelgate
