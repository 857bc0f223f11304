// WorkerPool against fake_worker: every way a worker can fail becomes the right Outcome, the
// next request gets a fresh worker, and nothing is left running.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "harness/worker_pool.h"

#ifndef KG_FAKE_WORKER_PATH
#error "KG_FAKE_WORKER_PATH must name the fake_worker executable"
#endif

namespace kernelgate::harness {
namespace {

using Kind = Outcome::Kind;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr milliseconds kTimeout(5000);

WorkerCommand fake_worker() { return WorkerCommand{{KG_FAKE_WORKER_PATH}, {}}; }

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Gone, or a zombie waiting for an init that may not reap (orphans are not ours to reap).
bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  std::getline(stat, content);
  const size_t paren = content.rfind(')');
  return paren != std::string::npos && content.size() > paren + 2 && content[paren + 2] == 'Z';
}

bool gone_within(pid_t pid, milliseconds limit) {
  const auto start = Clock::now();
  while (!process_gone(pid)) {
    if (Clock::now() - start > limit) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return true;
}

pid_t grandchild_pid(const std::string& stderr_tail) {
  const size_t at = stderr_tail.find("grandchild ");
  return at == std::string::npos ? -1 : std::stoi(stderr_tail.substr(at + 11));
}

TEST(WorkerPool, EchoesAndStartsLazily) {
  WorkerPool pool(fake_worker());
  EXPECT_EQ(pool.pid(), -1);
  const Outcome outcome = pool.request("echo hello world", kTimeout);
  EXPECT_EQ(outcome.kind, Kind::kOk) << outcome.reason;
  EXPECT_EQ(outcome.response, "hello world");
  EXPECT_TRUE(outcome.reason.empty());
  EXPECT_GT(pool.pid(), 0);
  EXPECT_EQ(pool.restarts(), 0);
}

TEST(WorkerPool, ManySequentialRequestsUseOneFastProcess) {
  WorkerPool pool(fake_worker());
  ASSERT_TRUE(pool.request("echo warm", kTimeout).ok());
  const pid_t pid = pool.pid();
  const auto start = Clock::now();
  for (int i = 0; i < 200; ++i) {
    const Outcome outcome = pool.request("echo " + std::to_string(i), kTimeout);
    ASSERT_EQ(outcome.kind, Kind::kOk) << outcome.reason;
    ASSERT_EQ(outcome.response, std::to_string(i));
  }
  EXPECT_LT(ms_since(start), 1000.0);
  EXPECT_EQ(pool.pid(), pid);
  EXPECT_EQ(pool.restarts(), 0);
}

TEST(WorkerPool, EnvironmentOverrides) {
  WorkerCommand command = fake_worker();
  command.env_overrides["KG_TEST_VALUE"] = "forty two";
  WorkerPool pool(command);
  EXPECT_EQ(pool.request("env KG_TEST_VALUE", kTimeout).response, "forty two");
  EXPECT_EQ(pool.request("env KG_SURELY_UNSET_VARIABLE", kTimeout).response, "<unset>");
}

TEST(WorkerPool, SegfaultIsACrashAndTheNextRequestGetsAFreshWorker) {
  WorkerPool pool(fake_worker());
  ASSERT_TRUE(pool.request("echo first", kTimeout).ok());
  const pid_t first = pool.pid();
  const Outcome crash = pool.request("segv", kTimeout);
  EXPECT_EQ(crash.kind, Kind::kCrashed);
  EXPECT_EQ(crash.signal, SIGSEGV);
  EXPECT_EQ(crash.exit_code, -1);
  EXPECT_NE(crash.reason.find("signal 11 (SIGSEGV)"), std::string::npos) << crash.reason;
  EXPECT_EQ(pool.pid(), -1);
  EXPECT_TRUE(process_gone(first));

  const Outcome next = pool.request("echo again", kTimeout);
  EXPECT_EQ(next.kind, Kind::kOk) << next.reason;
  EXPECT_EQ(next.response, "again");
  EXPECT_EQ(pool.restarts(), 1);
  EXPECT_NE(pool.pid(), first);
}

TEST(WorkerPool, AbortIsACrash) {
  WorkerPool pool(fake_worker());
  const Outcome outcome = pool.request("abort", kTimeout);
  EXPECT_EQ(outcome.kind, Kind::kCrashed);
  EXPECT_EQ(outcome.signal, SIGABRT);
  EXPECT_NE(outcome.reason.find("SIGABRT"), std::string::npos) << outcome.reason;
}

TEST(WorkerPool, NonZeroExitIsACrashWithItsCode) {
  WorkerPool pool(fake_worker());
  const Outcome outcome = pool.request("exit 3", kTimeout);
  EXPECT_EQ(outcome.kind, Kind::kCrashed);
  EXPECT_EQ(outcome.exit_code, 3);
  EXPECT_EQ(outcome.signal, 0);
  EXPECT_NE(outcome.reason.find("exited with code 3"), std::string::npos) << outcome.reason;
  EXPECT_TRUE(pool.request("echo x", kTimeout).ok());
  EXPECT_EQ(pool.restarts(), 1);
}

TEST(WorkerPool, CleanExitWithoutAnswerIsAProtocolError) {
  WorkerPool pool(fake_worker());
  const Outcome outcome = pool.request("exit 0", kTimeout);
  EXPECT_EQ(outcome.kind, Kind::kProtocolError);
  EXPECT_EQ(outcome.exit_code, 0);
}

TEST(WorkerPool, OutOfMemoryExitCodeAndStderrTail) {
  WorkerPool pool(fake_worker());
  const Outcome outcome = pool.request("oom", kTimeout);
  EXPECT_EQ(outcome.kind, Kind::kOutOfMemory) << outcome.reason;
  EXPECT_EQ(outcome.exit_code, kExitOutOfMemory);
  EXPECT_NE(outcome.stderr_tail.find("CUDA out of memory"), std::string::npos);
  EXPECT_NE(outcome.reason.find("CUDA out of memory"), std::string::npos) << outcome.reason;
}

TEST(WorkerPool, StderrDecidesBetweenCrashAndOutOfMemory) {
  WorkerPool pool(fake_worker());
  const Outcome crash = pool.request("fail RuntimeError: illegal memory access", kTimeout);
  EXPECT_EQ(crash.kind, Kind::kCrashed);
  EXPECT_EQ(crash.reason,
            "worker exited with code 1 before responding; stderr: RuntimeError: illegal memory "
            "access");
  const Outcome oom = pool.request(
      "fail terminate called after throwing an instance of 'std::bad_alloc'", kTimeout);
  EXPECT_EQ(oom.kind, Kind::kOutOfMemory) << oom.reason;
  EXPECT_EQ(oom.exit_code, 1);
  EXPECT_EQ(pool.restarts(), 1);
}

TEST(WorkerPool, SigkillFromOutsideIsOutOfMemory) {
  WorkerPool pool(fake_worker());
  ASSERT_TRUE(pool.request("echo up", kTimeout).ok());
  const pid_t pid = pool.pid();
  std::thread killer([pid] {
    std::this_thread::sleep_for(milliseconds(100));
    ::kill(pid, SIGKILL);  // what the kernel OOM killer does
  });
  const Outcome outcome = pool.request("hang", kTimeout);
  killer.join();
  EXPECT_EQ(outcome.kind, Kind::kOutOfMemory) << outcome.reason;
  EXPECT_EQ(outcome.signal, SIGKILL);
}

TEST(WorkerPool, HangTimesOutPromptlyAndIsKilled) {
  WorkerPool pool(fake_worker());
  ASSERT_TRUE(pool.request("echo up", kTimeout).ok());
  const pid_t pid = pool.pid();
  const auto start = Clock::now();
  const Outcome outcome = pool.request("hang", milliseconds(300));
  const double elapsed = ms_since(start);
  EXPECT_EQ(outcome.kind, Kind::kTimedOut);
  EXPECT_EQ(outcome.signal, SIGKILL);
  EXPECT_GE(elapsed, 300.0);
  EXPECT_LT(elapsed, 300.0 + 200.0);
  EXPECT_TRUE(process_gone(pid));
  EXPECT_TRUE(pool.request("echo after", kTimeout).ok());
  EXPECT_EQ(pool.restarts(), 1);
}

TEST(WorkerPool, TimeoutKillsTheWholeProcessGroup) {
  WorkerPool pool(fake_worker());
  const Outcome outcome = pool.request("fork_hang", milliseconds(300));
  EXPECT_EQ(outcome.kind, Kind::kTimedOut);
  const pid_t grandchild = grandchild_pid(outcome.stderr_tail);
  ASSERT_GT(grandchild, 0) << outcome.stderr_tail;
  EXPECT_TRUE(gone_within(grandchild, milliseconds(1000)));
}

TEST(WorkerPool, CrashIsSeenEvenWhileAGrandchildHoldsThePipes) {
  WorkerPool pool(fake_worker());
  const auto start = Clock::now();
  const Outcome outcome = pool.request("fork_exit 7", kTimeout);
  EXPECT_LT(ms_since(start), 1000.0);  // not the 5 s timeout: the pipes never reach EOF
  EXPECT_EQ(outcome.kind, Kind::kCrashed) << outcome.reason;
  EXPECT_EQ(outcome.exit_code, 7);
  const pid_t grandchild = grandchild_pid(outcome.stderr_tail);
  ASSERT_GT(grandchild, 0) << outcome.stderr_tail;
  EXPECT_TRUE(gone_within(grandchild, milliseconds(1000)));
}

TEST(WorkerPool, ChattyStderrNeverBlocksAndKeepsOnlyTheTail) {
  WorkerPool pool(fake_worker());
  const Outcome outcome = pool.request("spam 1024", kTimeout);  // 1 MiB, far over a pipe buffer
  EXPECT_EQ(outcome.kind, Kind::kOk) << outcome.reason;
  EXPECT_EQ(outcome.response, "ok");
  EXPECT_GT(outcome.stderr_tail.size(), 1000u);
  EXPECT_LE(outcome.stderr_tail.size(), 4096u);
  EXPECT_TRUE(pool.request("echo next", kTimeout).ok());
  EXPECT_EQ(pool.restarts(), 0);
}

TEST(WorkerPool, TwoLinesAreAProtocolError) {
  WorkerPool pool(fake_worker());
  const Outcome outcome = pool.request("two_lines", kTimeout);
  EXPECT_EQ(outcome.kind, Kind::kProtocolError);
  EXPECT_EQ(outcome.response, "a");
  EXPECT_EQ(pool.request("echo fresh", kTimeout).response, "fresh");
  EXPECT_EQ(pool.restarts(), 1);
}

TEST(WorkerPool, WritingToAClosedStdinNeitherKillsUsNorLeavesSigpipe) {
  WorkerPool pool(fake_worker());
  ASSERT_TRUE(pool.request("close_stdin", kTimeout).ok());
  const auto start = Clock::now();
  const Outcome outcome = pool.request("echo lost", kTimeout);  // write() fails with EPIPE
  EXPECT_EQ(outcome.kind, Kind::kProtocolError) << outcome.reason;
  EXPECT_LT(ms_since(start), 2000.0);  // the dying grace, not the timeout
  sigset_t pending, mask;
  sigpending(&pending);
  EXPECT_FALSE(sigismember(&pending, SIGPIPE));
  pthread_sigmask(SIG_BLOCK, nullptr, &mask);
  EXPECT_FALSE(sigismember(&mask, SIGPIPE));
  EXPECT_EQ(pool.request("echo fresh", kTimeout).response, "fresh");
}

TEST(WorkerPool, WorkerThatDiedBetweenRequestsIsReplacedTransparently) {
  WorkerPool pool(fake_worker());
  ASSERT_TRUE(pool.request("echo up", kTimeout).ok());
  const pid_t pid = pool.pid();
  ::kill(pid, SIGKILL);
  ASSERT_TRUE(gone_within(pid, milliseconds(1000)));
  const Outcome outcome = pool.request("echo next", kTimeout);
  EXPECT_EQ(outcome.kind, Kind::kOk) << outcome.reason;
  EXPECT_EQ(pool.restarts(), 1);
}

TEST(WorkerPool, RetiredWorkerIsReplacedAndCounted) {
  WorkerPool pool(fake_worker());
  ASSERT_TRUE(pool.request("echo up", kTimeout).ok());
  const pid_t pid = pool.pid();
  pool.retire();
  EXPECT_EQ(pool.pid(), -1);
  EXPECT_TRUE(gone_within(pid, milliseconds(1000)));
  const Outcome outcome = pool.request("echo next", kTimeout);
  EXPECT_EQ(outcome.kind, Kind::kOk) << outcome.reason;
  EXPECT_EQ(outcome.response, "next");
  EXPECT_NE(pool.pid(), pid);
  EXPECT_EQ(pool.restarts(), 1);
}

TEST(WorkerPool, RejectsARequestWithANewline) {
  WorkerPool pool(fake_worker());
  EXPECT_THROW(pool.request("echo a\necho b", kTimeout), std::invalid_argument);
}

TEST(WorkerPool, MissingProgramIsAConfigurationError) {
  WorkerPool pool(WorkerCommand{{"/nonexistent/kernelgate_worker"}, {}});
  EXPECT_THROW(pool.request("echo x", kTimeout), std::system_error);
}

TEST(WorkerPool, DestructorReapsAnIdleWorkerAndKillsAHungOne) {
  pid_t idle = -1;
  {
    WorkerPool pool(fake_worker());
    ASSERT_TRUE(pool.request("echo up", kTimeout).ok());
    idle = pool.pid();
  }
  // Reaped by us: waitpid finds no such child, and the pid is gone.
  EXPECT_EQ(::waitpid(idle, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
  EXPECT_TRUE(process_gone(idle));

  pid_t hung = -1;
  Clock::time_point start;
  {
    WorkerPool pool(fake_worker(), milliseconds(200));
    ASSERT_TRUE(pool.request("close_stdin", kTimeout).ok());  // then hangs, deaf to EOF
    hung = pool.pid();
    start = Clock::now();
  }
  EXPECT_LT(ms_since(start), 200.0 + 300.0);
  EXPECT_EQ(::waitpid(hung, nullptr, WNOHANG), -1);
  EXPECT_TRUE(process_gone(hung));
}

}  // namespace
}  // namespace kernelgate::harness
