// The op mechanism (kernelgate/op.h) on test ops of its own, with the core alone: routers,
// Meta, autograd with a routed backward, double backward through the reference, forward-only
// backends, placeholders, and every declaration error it must catch at install().
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <atomic>

#include "kernelgate/op.h"

namespace kernelgate {
namespace {

using at::Tensor;
using Pair = std::tuple<Tensor, Tensor>;

// kgtest_mul: y = alpha * x * weight (weight optional; broadcast over rows). Its extra is
// s = alpha * weight, what the backward multiplies by.
Tensor reference(const Tensor& x, const OptTensor& w, double alpha) {
  return w ? alpha * x * *w : alpha * x;
}

Tensor scale_of(const Tensor& x, const OptTensor& w, double alpha) {
  return w ? alpha * *w : at::full({x.size(-1)}, alpha, x.options());
}

std::atomic<int> g_fwd_calls{0}, g_bwd_calls{0};

Pair counted_fwd(const Tensor& x, const OptTensor& w, double alpha, GradRequest need) {
  ++g_fwd_calls;
  return {reference(x, w, alpha).contiguous(), need.any() ? scale_of(x, w, alpha) : Tensor()};
}

Pair counted_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w, const Tensor& s,
                 double alpha, GradRequest need) {
  ++g_bwd_calls;
  Tensor dx = need(0) ? (dy * s).contiguous() : Tensor();
  Tensor dw = need(1) && w ? (dy * x * alpha).reshape({-1, x.size(-1)}).sum(0) : Tensor();
  return {dx, dw};
}

// The reference backend: the same math, uncounted.
Pair ref_fwd(const Tensor& x, const OptTensor& w, double alpha, GradRequest need) {
  return {reference(x, w, alpha).contiguous(), need.any() ? scale_of(x, w, alpha) : Tensor()};
}
Pair ref_bwd(const Tensor& dy, const Tensor& x, const OptTensor& w, const Tensor& s, double alpha,
             GradRequest need) {
  return {need(0) ? (dy * s).contiguous() : Tensor(),
          need(1) && w ? (dy * x * alpha).reshape({-1, x.size(-1)}).sum(0) : Tensor()};
}

// Returns its input as its output when alpha is 1 and there is no weight (an alias).
Pair aliasing_fwd(const Tensor& x, const OptTensor& w, double alpha, GradRequest need) {
  if (alpha == 1.0 && !w) return {x, need.any() ? scale_of(x, w, alpha) : Tensor()};
  return ref_fwd(x, w, alpha, need);
}

Pair meta(const Tensor& x, const OptTensor&, double) {
  return {at::empty_like(x, at::MemoryFormat::Contiguous), at::empty({x.size(-1)}, x.options())};
}

void check(const Tensor&, const OptTensor&, double alpha) {
  TORCH_CHECK(alpha != 0.0, "kgtest_mul: alpha must not be 0");
}

OpContract contract(const char* name) {
  OpContract c;
  c.name = name;
  c.schema = std::string(name) + "(Tensor x, Tensor? weight=None, float alpha=1.0) -> Tensor";
  c.dims = "x: [*rows, hidden]; weight?: [hidden]";
  c.dtypes = {at::kFloat};
  c.extras = {"s"};
  c.saved = {"x", "weight", "s"};
  return c;
}

struct Installed {
  OpId id;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const OptTensor&, double)> op;
};

const Installed& mul_op() {
  static const Installed installed = [] {
    OpId id = OpDeclaration(contract("kgtest_mul"))
                  .reference(reference)
                  .meta(meta)
                  .check(check)
                  .backend("reference", BackendKind::kReference, ref_fwd, ref_bwd)
                  .backend("counted", BackendKind::kKernelgate, counted_fwd, counted_bwd)
                  .backend("forward_only", BackendKind::kKernelgate, counted_fwd, nullptr)
                  .backend("aliasing", BackendKind::kKernelgate, aliasing_fwd, ref_bwd)
                  .unavailable("absent", BackendKind::kKernelgate, "not in this build")
                  .install();
    return Installed{id, typed_op<Tensor(const Tensor&, const OptTensor&, double)>("kgtest_mul")};
  }();
  return installed;
}

class OpMechanismTest : public ::testing::Test {
 protected:
  void SetUp() override {
    mul_op();
    Dispatcher::get().clear_overrides();
    Dispatcher::get().clear_policy();
    g_fwd_calls = 0;
    g_bwd_calls = 0;
  }
  void TearDown() override { Dispatcher::get().clear_overrides(); }
  void force(const char* backend) { Dispatcher::get().force("kgtest_mul", backend); }
};

TEST_F(OpMechanismTest, InternalOpsAreDefinedFromTheContract) {
  const OpContract& c = Dispatcher::get().op(mul_op().id).contract;
  EXPECT_EQ(
      c.forward_schema,
      "_kgtest_mul_fwd(Tensor x, Tensor? weight, float alpha, int needs) -> (Tensor, Tensor)");
  EXPECT_EQ(
      c.backward_schema,
      "_kgtest_mul_bwd(Tensor grad_0, Tensor x, Tensor? weight, Tensor s, float alpha, int needs) "
      "-> (Tensor, Tensor)");
  for (const char* name : {"kernelgate::_kgtest_mul_reference", "kernelgate::_kgtest_mul_fwd",
                           "kernelgate::_kgtest_mul_bwd"}) {
    EXPECT_TRUE(c10::Dispatcher::singleton().findSchema({name, ""}).has_value()) << name;
  }
  const OpEntry& e = Dispatcher::get().op(mul_op().id);
  EXPECT_FALSE(e.availability.back().ok);
  EXPECT_STREQ(e.availability.back().reason, "not in this build");
}

TEST_F(OpMechanismTest, RoutesForwardAndBackwardToTheChosenBackend) {
  Tensor x = at::randn({3, 5}).requires_grad_(true), w = at::randn({5}).requires_grad_(true);
  Tensor y = mul_op().op.call(x, w, 2.0);  // no evidence: the reference
  EXPECT_EQ(g_fwd_calls.load(), 0);
  force("counted");
  Tensor y2 = mul_op().op.call(x, w, 2.0);
  EXPECT_EQ(g_fwd_calls.load(), 1);
  EXPECT_TRUE(at::allclose(y, y2));
  auto g = torch::autograd::grad({y2.sum()}, {x, w});
  EXPECT_EQ(g_bwd_calls.load(), 1);
  EXPECT_TRUE(at::allclose(g[0], (2.0 * w).expand({3, 5})));
  EXPECT_TRUE(at::allclose(g[1], (2.0 * x).sum(0)));
}

TEST_F(OpMechanismTest, OnlyTheGradientsAskedForAreComputed) {
  force("counted");
  Tensor x = at::randn({3, 5}).requires_grad_(true), w = at::randn({5});  // w needs none
  Tensor y = mul_op().op.call(x, w, 1.5);
  auto g = torch::autograd::grad({y.sum()}, {x});
  EXPECT_TRUE(at::allclose(g[0], (1.5 * w).expand({3, 5})));
  // The internal backward gives an empty placeholder for what was not asked for.
  auto bwd = c10::Dispatcher::singleton().findSchemaOrThrow("kernelgate::_kgtest_mul_bwd", "");
  torch::jit::Stack s{at::ones({3, 5}), x.detach(), w, 1.5 * w, 1.5, int64_t{1}};
  bwd.callBoxed(s);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].toTensor().sizes(), (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(s[1].toTensor().numel(), 0);
}

TEST_F(OpMechanismTest, NoGradCallsSkipAutogradAndExtras) {
  force("counted");
  Tensor x = at::randn({2, 4}).requires_grad_(true);
  {
    at::NoGradGuard no_grad;
    Tensor y = mul_op().op.call(x, std::nullopt, 3.0);
    EXPECT_FALSE(y.requires_grad());
  }
  EXPECT_EQ(g_fwd_calls.load(), 1);
}

TEST_F(OpMechanismTest, ForwardOnlyBackendServesOnlyCallsWithoutGradients) {
  force("forward_only");
  Tensor x = at::randn({2, 4});
  mul_op().op.call(x, std::nullopt, 3.0);
  EXPECT_EQ(g_fwd_calls.load(), 1);
  Tensor xg = x.clone().requires_grad_(true);
  Tensor y = mul_op().op.call(xg, std::nullopt, 3.0);  // falls back: the reference
  EXPECT_EQ(g_fwd_calls.load(), 1);
  y.sum().backward();
  EXPECT_TRUE(at::allclose(xg.grad(), at::full({2, 4}, 3.0)));
  CallView call;
  call.num_tensors = 2;
  call.tensors[0] = &xg;
  call.grad = true;
  Explanation ex = Dispatcher::get().explain(
      mul_op().id, call, check_call(Dispatcher::get().op(mul_op().id).contract, call));
  for (const auto& c : ex.candidates) {
    if (c.backend == "forward_only")
      EXPECT_NE(c.reason.find("forward only"), std::string::npos) << c.reason;
  }
}

TEST_F(OpMechanismTest, AnOutputAliasingAnInputGetsItsOwnStorage) {
  force("aliasing");
  Tensor x = at::randn({2, 4}).requires_grad_(true);
  Tensor y = mul_op().op.call(x, std::nullopt, 1.0);
  EXPECT_FALSE(y.is_alias_of(x));
  y.sum().backward();
  EXPECT_TRUE(at::allclose(x.grad(), at::ones({2, 4})));
}

TEST_F(OpMechanismTest, DoubleBackwardDifferentiatesTheReference) {
  force("counted");
  Tensor x = at::randn({3, 4}).requires_grad_(true), w = at::randn({4}).requires_grad_(true);
  Tensor y = mul_op().op.call(x, w, 2.0);
  auto g =
      torch::autograd::grad({(y * y).sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
  auto gg = torch::autograd::grad({g[0].sum()}, {w});
  // d/dw sum(2 * (2 x w) * 2 w) = sum over rows of 16 x w
  EXPECT_TRUE(at::allclose(gg[0], (16.0 * x * w).sum(0), 1e-4, 1e-5));
}

TEST_F(OpMechanismTest, MetaGivesShapesAndRunsTheChecks) {
  Tensor x = at::empty({6, 3}, at::TensorOptions().device(at::kMeta));
  Tensor y = mul_op().op.call(x, std::nullopt, 2.0);
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_TRUE(y.is_meta());
  EXPECT_THROW(mul_op().op.call(x, std::nullopt, 0.0), c10::Error);
  EXPECT_THROW(mul_op().op.call(at::randn({2, 3}), std::nullopt, 0.0), c10::Error);
}

std::string install_error(OpDeclaration& d) {
  try {
    d.install();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

Tensor wrong_kinds(const Tensor& x, double alpha) { return x * alpha; }
Tensor one_result(const Tensor& x, const OptTensor&, double, GradRequest) { return x; }

TEST(OpDeclarationErrors, NameTheOpAndWhatDoesNotFit) {
  std::vector<std::unique_ptr<OpDeclaration>> kept;
  auto base_ref = [&](const char* name) -> OpDeclaration& {
    kept.push_back(std::make_unique<OpDeclaration>(contract(name)));
    return kept.back()->reference(reference).meta(meta);
  };
  EXPECT_NE(
      install_error(
          base_ref("kgtest_e1").backend("reference", BackendKind::kReference, wrong_kinds, ref_bwd))
          .find("kgtest_e1: backend 'reference' forward takes (Tensor, float), its schema says "
                "(Tensor, Tensor?, float)"),
      std::string::npos);
  EXPECT_NE(
      install_error(
          base_ref("kgtest_e2").backend("reference", BackendKind::kReference, one_result, ref_bwd))
          .find("returns 1 tensors, expected 2"),
      std::string::npos);
  OpContract c = contract("kgtest_e3");
  c.dims = "weight?: [hidden]; x: [*rows, hidden]";
  EXPECT_NE(install_error(OpDeclaration(c).reference(reference).meta(meta))
                .find("is not the next one in dims"),
            std::string::npos);
  c = contract("kgtest_e4");
  c.saved = {"x", "nope"};
  EXPECT_NE(install_error(OpDeclaration(c).reference(reference).meta(meta).backend(
                              "reference", BackendKind::kReference, ref_fwd, ref_bwd))
                .find("saved names 'nope'"),
            std::string::npos);
  c = contract("kgtest_e5");
  c.saved = {"s"};
  EXPECT_NE(install_error(OpDeclaration(c).reference(reference).meta(meta))
                .find("the backward's dispatch key needs tensor argument 'x'"),
            std::string::npos);
  EXPECT_NE(install_error(
                base_ref("kgtest_e6").backend("fast", BackendKind::kKernelgate, ref_fwd, ref_bwd))
                .find("its first backend must be the reference"),
            std::string::npos);
}

// An op whose backward keeps only an extra: double backward must refuse, saying why.
Tensor only_s_bwd(const Tensor& dy, const Tensor& s, const Tensor& x, double, GradRequest) {
  (void)x;
  return (dy * s).contiguous();
}

TEST(OpMechanismDoubleBackward, RefusesClearlyWhenInputsAreNotKept) {
  OpContract c;
  c.name = "kgtest_scale_only";
  c.schema = "kgtest_scale_only(Tensor x, float alpha=1.0) -> Tensor";
  c.dims = "x: [n]";
  c.dtypes = {at::kFloat};
  c.extras = {"s"};
  c.saved = {"s", "out0"};
  c.backward_stand_ins = {{"x", "out0"}};
  auto ref = [](const Tensor& x, double a) { return x * a; };
  auto fwd = [](const Tensor& x, double a, GradRequest) -> Pair {
    return {x * a, at::full({x.size(0)}, a, x.options())};
  };
  auto met = [](const Tensor& x, double) -> Pair { return {at::empty_like(x), at::empty_like(x)}; };
  OpDeclaration(c)
      .reference(+ref)
      .meta(+met)
      .backend("reference", BackendKind::kReference, +fwd, only_s_bwd)
      .install();
  auto op = typed_op<Tensor(const Tensor&, double)>("kgtest_scale_only");
  Tensor x = at::randn({4}).requires_grad_(true);
  Tensor y = op.call(x, 3.0);
  auto g = torch::autograd::grad({y.sum()}, {x});
  EXPECT_TRUE(at::allclose(g[0], at::full({4}, 3.0)));
  Tensor y2 = op.call(x, 3.0);
  try {
    torch::autograd::grad({y2.sum()}, {x}, {}, true, /*create_graph=*/true);
    FAIL() << "double backward did not refuse";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("kgtest_scale_only: double backward (create_graph=True) is not "
                                   "supported: its backward does not keep x"),
        std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace kernelgate

// in_layout_of: what an op that keeps its inputs' layout (OpContract::keeps_input_layout) gives
// its outputs and gradients.
TEST(InLayoutOf, KeepsADenseModelsStridesAndCopiesOnlyWhereTheyDiffer) {
  using kernelgate::in_layout_of;
  // attention code's q: [batch, heads, seq, head_dim] as a view of [batch, seq, heads, head_dim].
  const at::Tensor model = at::randn({2, 5, 3, 4}).transpose(1, 2);
  const at::Tensor dense = model.contiguous();
  const at::Tensor kept = in_layout_of(dense, model);
  EXPECT_EQ(kept.strides(), model.strides());
  EXPECT_TRUE(at::equal(kept, dense));
  // Already in that layout: the same tensor, no copy.
  EXPECT_TRUE(in_layout_of(model, model).is_same(model));
  // A model that is not dense (padded rows of attention code's q, a stride-0 expand): the strides
  // at::empty_like gives it, dense (in the padded q's dim order: not contiguous).
  const at::Tensor values = at::randn({2, 3, 5, 4});
  for (const at::Tensor& other : {at::randn({2, 5, 3, 6}).narrow(-1, 0, 4).transpose(1, 2),
                                  at::randn({1, 3, 5, 4}).expand({2, 3, 5, 4})}) {
    const at::Tensor got = in_layout_of(values, other);
    EXPECT_EQ(got.strides(), at::empty_like(other).strides());
    EXPECT_TRUE(got.is_non_overlapping_and_dense());
    EXPECT_TRUE(at::equal(got, values));
  }
  EXPECT_FALSE(in_layout_of(values, at::randn({2, 5, 3, 6}).narrow(-1, 0, 4).transpose(1, 2)).is_contiguous());
}
