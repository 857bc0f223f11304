// The C++ API of the ops (kernelgate.h): each op runs through PyTorch's dispatcher from C++ and
// agrees with its reference.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "kernelgate/kernelgate.h"
#include "kernelgate/op.h"

namespace kernelgate {
namespace {

TEST(OpsCpp, RmsNormMatchesReference) {
  at::Tensor x = at::randn({5, 37});
  at::Tensor w = at::randn({37});
  at::Tensor y = rms_norm(x, w, 1e-6);
  at::Tensor expected = x * at::rsqrt(x.square().mean(-1, true) + 1e-6) * w;
  EXPECT_TRUE(at::allclose(y, expected, 1e-5, 1e-5));
}

TEST(OpsCpp, EveryWaveOneOpRegistersItself) {
  for (const char* name : {"rms_norm", "add_rms_norm", "layer_norm", "swiglu", "geglu", "rope",
                           "qk_norm_rope", "cross_entropy", "linear_cross_entropy"}) {
    const OpEntry* e = Dispatcher::get().find_op(name);
    ASSERT_NE(e, nullptr) << name;
    EXPECT_EQ(e->backends.front().name, "reference") << name;
    EXPECT_FALSE(e->contract.forward_schema.empty()) << name;
  }
}

TEST(OpsCpp, TypedOpReachesAnyOp) {
  at::Tensor g = at::randn({3, 8}), u = at::randn({3, 8});
  auto op = typed_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("swiglu");
  EXPECT_TRUE(at::allclose(op.call(g, u), at::silu(g) * u, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(swiglu(g, u), at::silu(g) * u, 1e-5, 1e-5));
}

TEST(OpsCpp, AutogradFromCpp) {
  at::Tensor x = at::randn({4, 16}).requires_grad_(true);
  at::Tensor w = at::randn({16}).requires_grad_(true);
  layer_norm(x, w, std::nullopt, 1e-5).sum().backward();
  at::Tensor x2 = x.detach().clone().requires_grad_(true);
  at::Tensor w2 = w.detach().clone().requires_grad_(true);
  at::layer_norm(x2, {16}, w2, {}, 1e-5).sum().backward();
  EXPECT_TRUE(at::allclose(x.grad(), x2.grad(), 1e-4, 1e-5));
  EXPECT_TRUE(at::allclose(w.grad(), w2.grad(), 1e-4, 1e-5));
}

}  // namespace
}  // namespace kernelgate
