// Dispatcher contract: key bucketing, ranking, fail-closed fallback, overrides, log-once, bad
// environment values and concurrent callers. Uses a test op with controllable fake backends.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <thread>

#include "kernelgate/dispatch.h"

namespace kernelgate {
namespace {

// "even_only" implements only calls whose hidden size is even; "any" implements everything.
Support even_only(const CallView& call) {
  return call.tensors[0]->size(-1) % 2 == 0 ? Support::yes() : Support::no("hidden is odd");
}

// Backends here are only chosen, never run.
class NoCode final : public BackendImpl {
 public:
  void forward(torch::jit::Stack&, GradRequest) const override {}
  void backward(torch::jit::Stack&, GradRequest) const override {}
  bool has_backward() const override { return true; }
};

BackendDesc fake(const char* name, BackendKind kind, std::function<Support(const CallView&)> can) {
  return {name, kind, nullptr, std::move(can), std::make_shared<NoCode>(), ""};
}

struct Env {
  Dispatcher& d = Dispatcher::get();
  OpId op;
  int any_index, even_index, missing_index;
  std::vector<std::pair<LogLevel, std::string>> logs;
  std::mutex mu;

  Env() {
    OpContract c;
    c.name = "kgtest_scale";
    c.schema = "kgtest_scale(Tensor x, Tensor? w=None) -> Tensor";
    c.dims = "x: [*rows, hidden]; w?: [hidden]";
    c.dtypes = {at::kFloat, at::kBFloat16};
    op = d.add_op(c);
    d.add_backend(op, fake("reference", BackendKind::kReference, nullptr));
    any_index = d.add_backend(
        op, fake("any", BackendKind::kKernelgate, [](const CallView&) { return Support::yes(); }));
    even_index = d.add_backend(op, fake("even_only", BackendKind::kKernelgate, even_only));
    BackendDesc missing{"missing",
                        BackendKind::kPython,
                        [] { return Support::no("package not installed"); },
                        nullptr,
                        nullptr,
                        ""};
    missing_index = d.add_backend(op, std::move(missing));
  }
};

Env& env() {
  static Env* e = new Env();
  return *e;
}

class DispatcherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Env& e = env();
    unsetenv("KERNELGATE_FORCE");
    unsetenv("KERNELGATE_EXCLUDE");
    unsetenv("KERNELGATE_LOG");
    e.d.apply_env();
    e.d.clear_overrides();
    e.d.clear_policy();
    e.d.reset_log_once();
    {
      std::lock_guard<std::mutex> lock(e.mu);
      e.logs.clear();
    }
    e.d.set_log_hook([&e](LogLevel level, const std::string&, const std::string& msg) {
      std::lock_guard<std::mutex> lock(e.mu);
      e.logs.emplace_back(level, msg);
    });
  }
  void TearDown() override { env().d.set_log_hook(nullptr); }

  int select(const at::Tensor& x, const std::optional<at::Tensor>& w = std::nullopt,
             bool grad = false) {
    CallView call;
    call.num_tensors = 2;
    call.tensors[0] = &x;
    call.tensors[1] = w ? &*w : nullptr;
    call.grad = grad;
    BoundDims dims = check_call(env().d.op(env().op).contract, call);
    return env().d.select(env().op, call, dims);
  }

  DispatchKey key(const at::Tensor& x, bool grad = false) {
    CallView call;
    call.num_tensors = 2;
    call.tensors[0] = &x;
    call.grad = grad;
    BoundDims dims = check_call(env().d.op(env().op).contract, call);
    return env().d.make_key(env().op, call, dims);
  }

  size_t count_logs(const std::string& needle) {
    std::lock_guard<std::mutex> lock(env().mu);
    size_t n = 0;
    for (const auto& [level, msg] : env().logs) n += msg.find(needle) != std::string::npos;
    return n;
  }

  void rank(std::vector<std::string> ranked) {
    PolicyRule r;
    r.op = "kgtest_scale";
    r.ranked = std::move(ranked);
    r.evidence = "test";
    env().d.add_policy_rule(r);
  }
};

TEST(SizeBucket, IsCeilLog2WithEmptyApart) {
  EXPECT_EQ(size_bucket(0), kEmptyBucket);
  EXPECT_EQ(size_bucket(1), 0);
  EXPECT_EQ(size_bucket(2), 1);
  EXPECT_EQ(size_bucket(3), 2);
  EXPECT_EQ(size_bucket(4), 2);
  EXPECT_EQ(size_bucket(5), 3);
  EXPECT_EQ(size_bucket(4096), 12);
  EXPECT_EQ(size_bucket(4097), 13);
  EXPECT_EQ(size_bucket(int64_t{1} << 40), 40);
  EXPECT_EQ(size_bucket((int64_t{1} << 40) + 1), 41);
}

TEST_F(DispatcherTest, KeyBucketsNamedDimsAndFoldsLeadingDims) {
  DispatchKey k = key(at::randn({3, 5, 4097}));
  EXPECT_EQ(k.buckets[0], size_bucket(15));  // rows = 3 * 5
  EXPECT_EQ(k.buckets[1], 13);               // hidden 4097
  EXPECT_EQ(k.arch, kCpuArch);
  EXPECT_EQ(k.dtypes[0], static_cast<uint8_t>(at::kFloat));
  EXPECT_EQ(k.dtypes[1], kAbsentDType);
  EXPECT_EQ(k.grad, 0);
  EXPECT_EQ(key(at::randn({3, 5, 4097}), true).grad, 1);
  // Same bucket, same key; different bucket, different key.
  EXPECT_TRUE(key(at::randn({16, 4096})) == key(at::randn({9, 4096})));
  EXPECT_FALSE(key(at::randn({16, 4096})) == key(at::randn({17, 4096})));
  EXPECT_EQ(key(at::randn({0, 8})).buckets[0], kEmptyBucket);
}

TEST_F(DispatcherTest, KeyAlignmentClass) {
  EXPECT_EQ(key(at::randn({4, 64})).align, AlignClass::kVec16);
  EXPECT_EQ(key(at::randn({4, 63})).align, AlignClass::kContiguous);  // 252-byte rows
  at::Tensor base = at::randn({4 * 64 + 1});
  EXPECT_EQ(key(base.narrow(0, 1, 4 * 64).view({4, 64})).align, AlignClass::kContiguous);
  EXPECT_EQ(key(at::randn({64, 4}).t()).align, AlignClass::kStrided);
  EXPECT_EQ(key(at::randn({4, 128}).narrow(1, 0, 64)).align, AlignClass::kStrided);
}

TEST_F(DispatcherTest, NoEvidenceFailsClosedToReference) {
  EXPECT_EQ(select(at::randn({4, 8})), 0);
  EXPECT_EQ(count_logs("no evidence for this region"), 1u);
}

TEST_F(DispatcherTest, PolicyRankingIsFollowed) {
  rank({"even_only", "any"});
  EXPECT_EQ(select(at::randn({4, 8})), env().even_index);
  env().d.clear_policy();
  rank({"any", "even_only"});
  EXPECT_EQ(select(at::randn({4, 8})), env().any_index);
}

TEST_F(DispatcherTest, CannotImplementFallsToNextThenReference) {
  rank({"even_only", "any"});
  EXPECT_EQ(select(at::randn({4, 7})), env().any_index);
  env().d.clear_policy();
  rank({"even_only"});
  EXPECT_EQ(select(at::randn({4, 7})), 0);
  EXPECT_EQ(count_logs("even_only cannot implement this call (hidden is odd)"), 1u);
}

TEST_F(DispatcherTest, UnknownAndUnavailableBackendsInPolicyAreSkipped) {
  rank({"no_such_backend", "missing", "even_only"});
  EXPECT_EQ(select(at::randn({4, 8})), env().even_index);
}

TEST_F(DispatcherTest, RuleFieldsRestrictWhereItApplies) {
  PolicyRule r;
  r.op = "kgtest_scale";
  r.ranked = {"any"};
  r.dtype = static_cast<int>(at::kBFloat16);
  r.max_buckets = {20, 6};  // hidden <= 64
  r.grad = 0;
  env().d.add_policy_rule(r);
  EXPECT_EQ(select(at::randn({4, 64}, at::kBFloat16)), env().any_index);
  EXPECT_EQ(select(at::randn({4, 65}, at::kBFloat16)), 0);                      // bucket 7
  EXPECT_EQ(select(at::randn({4, 64})), 0);                                     // float32
  EXPECT_EQ(select(at::randn({4, 64}, at::kBFloat16), std::nullopt, true), 0);  // grad
}

TEST_F(DispatcherTest, ForceWinsOverPolicyAndExcludeRemoves) {
  rank({"any"});
  env().d.force("kgtest_scale", "even_only");
  EXPECT_EQ(select(at::randn({4, 8})), env().even_index);
  // A forced backend that cannot implement the call falls back to the policy's choice, warned.
  EXPECT_EQ(select(at::randn({4, 9})), env().any_index);
  EXPECT_EQ(count_logs("even_only cannot implement"), 1u);
  env().d.clear_overrides();
  env().d.exclude("", "any");
  EXPECT_EQ(select(at::randn({4, 8})), 0);
  env().d.clear_overrides();
  EXPECT_EQ(select(at::randn({4, 8})), env().any_index);
}

TEST_F(DispatcherTest, ForcingAnUnavailableBackendWarnsAndIsIgnored) {
  env().d.force("kgtest_scale", "missing");
  EXPECT_EQ(select(at::randn({4, 8})), 0);
  EXPECT_EQ(count_logs("forced backend 'missing' is not available (package not installed)"), 1u);
}

TEST_F(DispatcherTest, ReasonLoggedExactlyOnceAfterManyCalls) {
  rank({"even_only"});
  for (int i = 0; i < 1000; ++i) {
    select(at::randn({1 + i % 7, 2 * (i % 5) + 1}));  // odd hidden, many keys
    select(at::randn({2, 8}, at::kBFloat16));         // served by even_only: nothing to log
  }
  EXPECT_EQ(count_logs("even_only cannot implement this call (hidden is odd)"), 1u);
  env().d.clear_policy();
  for (int i = 0; i < 1000; ++i) select(at::randn({1 + i % 50, 3}));
  EXPECT_EQ(count_logs("no evidence for this region"), 1u);
}

TEST_F(DispatcherTest, EnvForceAndExclude) {
  rank({"any"});
  setenv("KERNELGATE_FORCE", "kgtest_scale=even_only", 1);
  env().d.apply_env();
  EXPECT_EQ(select(at::randn({4, 8})), env().even_index);
  unsetenv("KERNELGATE_FORCE");
  setenv("KERNELGATE_EXCLUDE", "any", 1);
  env().d.apply_env();
  EXPECT_EQ(select(at::randn({4, 8})), 0);
  EXPECT_TRUE(count_logs("malformed") == 0u);
}

TEST_F(DispatcherTest, MalformedEnvWarnsOnceAndUsesDefault) {
  rank({"any"});
  const char* bad[] = {"kgtest_scale=", "=any", ",",    "kgtest_scale=nope",
                       "no_op=any",     "nope", "any,", "kgtest_scale=any,,x"};
  for (const char* value : bad) {
    env().d.reset_log_once();
    {
      std::lock_guard<std::mutex> lock(env().mu);
      env().logs.clear();
    }
    setenv("KERNELGATE_FORCE", value, 1);
    ASSERT_NO_THROW(env().d.apply_env());
    ASSERT_NO_THROW(env().d.apply_env());  // a second read warns no more
    EXPECT_EQ(count_logs("KERNELGATE_FORCE='" + std::string(value) + "' is malformed"), 1u)
        << value;
    EXPECT_EQ(select(at::randn({4, 8})), env().any_index) << value;  // default: policy
  }
  unsetenv("KERNELGATE_FORCE");
  setenv("KERNELGATE_LOG", "verbose", 1);
  ASSERT_NO_THROW(env().d.apply_env());
  EXPECT_EQ(count_logs("KERNELGATE_LOG='verbose' is malformed"), 1u);
  unsetenv("KERNELGATE_LOG");
}

TEST_F(DispatcherTest, SixteenThreadsConcurrently) {
  rank({"even_only", "any"});
  std::atomic<int> wrong{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        const int64_t hidden = 1 + (i + t) % 33;
        at::Tensor x = at::empty({1 + (i % 9), hidden});
        int b = select(x);
        // The policy's pick or, while the other thread forces it, "any"; never the reference.
        bool ok =
            b == (hidden % 2 == 0 ? env().even_index : env().any_index) || b == env().any_index;
        if (!ok) ++wrong;
      }
    });
  }
  std::thread toggler([&] {
    while (!stop) {
      env().d.force("kgtest_scale", "any");
      env().d.clear_overrides();
    }
  });
  for (auto& th : threads) th.join();
  stop = true;
  toggler.join();
  EXPECT_EQ(wrong.load(), 0);
  env().d.clear_overrides();
  EXPECT_EQ(select(at::randn({4, 8})), env().even_index);
}

TEST_F(DispatcherTest, ExplainListsEveryCandidateWithReason) {
  rank({"even_only", "any"});
  at::Tensor x = at::randn({4, 7});
  CallView call;
  call.num_tensors = 2;
  call.tensors[0] = &x;
  BoundDims dims = check_call(env().d.op(env().op).contract, call);
  Explanation ex = env().d.explain(env().op, call, dims);
  EXPECT_EQ(ex.backend, "any");
  ASSERT_EQ(ex.candidates.size(), 4u);
  std::map<std::string, std::string> reasons;
  for (const auto& c : ex.candidates) reasons[c.backend] = c.reason;
  EXPECT_NE(reasons["even_only"].find("cannot implement this call: hidden is odd"),
            std::string::npos);
  EXPECT_NE(reasons["missing"].find("not available: package not installed"), std::string::npos);
  EXPECT_NE(reasons["reference"].find("below any"), std::string::npos);
  EXPECT_NE(ex.key.find("kgtest_scale cpu float32,none rows<=2^2 hidden<=2^3"), std::string::npos)
      << ex.key;
}

TEST(Contract, ParseDims) {
  OpContract c;
  c.name = "t";
  c.dims = "q: [b, h, *s, d]; w?: [d]; target: [b] index";
  parse_dims(c);
  ASSERT_EQ(c.tensor_args.size(), 3u);
  EXPECT_EQ(c.named_dims, (std::vector<std::string>{"b", "h", "s", "d"}));
  EXPECT_TRUE(c.tensor_args[1].optional);
  EXPECT_EQ(c.tensor_args[2].dtype_class, DTypeClass::kIndex);
  EXPECT_TRUE(c.tensor_args[0].dims[2].variadic);
  for (const char* bad : {"x [a]", "x: a]", "x: [*a, *b]", "x: [a] weird", ""}) {
    OpContract b;
    b.name = "t";
    b.dims = bad;
    EXPECT_THROW(parse_dims(b), c10::Error) << bad;
  }
}

std::string check_error(const at::Tensor& x, const std::optional<at::Tensor>& w) {
  CallView call;
  call.num_tensors = 2;
  call.tensors[0] = &x;
  call.tensors[1] = w ? &*w : nullptr;
  try {
    check_call(env().d.op(env().op).contract, call);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(Contract, CheckCallNamesArgumentExpectedAndGot) {
  EXPECT_NE(check_error(at::randn({4, 4096}), at::randn({4095}))
                .find("w.size(-1) must be 4096 to match x.size(-1) (hidden), got 4095"),
            std::string::npos);
  EXPECT_NE(check_error(at::randn({4, 8}), at::randn({2, 8})).find("w must have 1 dim, got 2"),
            std::string::npos);
  EXPECT_NE(check_error(at::randn({4, 8}), at::randn({8}, at::kBFloat16))
                .find("w must have the dtype of x (float32), got bfloat16"),
            std::string::npos);
  EXPECT_NE(check_error(at::ones({4, 8}, at::kLong), std::nullopt)
                .find("x must be a floating-point tensor of dtype float32 or bfloat16, got int64"),
            std::string::npos);
  EXPECT_NE(check_error(at::randn({4, 8}, at::kDouble), std::nullopt).find("got float64"),
            std::string::npos);
  EXPECT_NE(check_error(at::randn({}), std::nullopt).find("x must have at least 1 dim, got 0"),
            std::string::npos);
  EXPECT_EQ(check_error(at::randn({2, 3, 8}), at::randn({8})), "");
}

TEST(Registry, ReferenceComesFirstAndOnlyOnce) {
  Dispatcher& d = Dispatcher::get();
  OpContract c;
  c.name = "kgtest_registry";
  c.schema = "kgtest_registry(Tensor x) -> Tensor";
  c.dims = "x: [n]";
  c.dtypes = {at::kFloat};
  OpId op = d.add_op(c);
  EXPECT_THROW(d.add_backend(op, fake("any", BackendKind::kKernelgate, nullptr)), c10::Error);
  d.add_backend(op, fake("reference", BackendKind::kReference, nullptr));
  EXPECT_THROW(d.add_backend(op, fake("second", BackendKind::kReference, nullptr)), c10::Error);
  EXPECT_THROW(d.add_backend(op, fake("reference", BackendKind::kKernelgate, nullptr)), c10::Error);
  EXPECT_THROW(d.add_op(c), c10::Error);  // one op per name
}

TEST(Registry, CoreKnowsNoOp) {
  // This test binary links the core alone: no op registers itself into it.
  for (const auto& name : Dispatcher::get().op_names()) {
    EXPECT_EQ(name.rfind("kgtest_", 0), 0u) << name;
  }
}

}  // namespace
}  // namespace kernelgate
