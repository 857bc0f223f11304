#include "harness/worker_pool.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <utility>

extern char** environ;

namespace kernelgate::harness {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr size_t kStderrTailBytes = 4096;
constexpr size_t kMaxResponseBytes = size_t(16) << 20;
// Death shows as EOF on the pipes, unless a grandchild still holds them; so the worker's status is
// also polled at this interval.
constexpr milliseconds kStatusPollInterval(20);
// Once the worker can no longer answer (its stdout closed, or its stdin), how long it may take to
// exit on its own, so that we report how it ended rather than our kill.
constexpr milliseconds kDyingGrace(1000);

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

std::string signal_name(int sig) {
  static const std::pair<int, const char*> kNames[] = {
      {SIGSEGV, "SIGSEGV"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
      {SIGILL, "SIGILL"},   {SIGKILL, "SIGKILL"}, {SIGTERM, "SIGTERM"}, {SIGPIPE, "SIGPIPE"},
      {SIGTRAP, "SIGTRAP"}, {SIGSYS, "SIGSYS"},   {SIGINT, "SIGINT"},   {SIGHUP, "SIGHUP"},
      {SIGQUIT, "SIGQUIT"}, {SIGXCPU, "SIGXCPU"}, {SIGXFSZ, "SIGXFSZ"}, {SIGALRM, "SIGALRM"}};
  for (const auto& [number, name] : kNames) {
    if (number == sig) return name;
  }
  return "SIG" + std::to_string(sig);
}

bool mentions_out_of_memory(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text.find("out of memory") != std::string::npos ||
         text.find("bad_alloc") != std::string::npos;
}

// The last non-blank line of `text`, at most 300 characters: enough to name the error in a reason.
std::string last_line(const std::string& text) {
  const size_t end = text.find_last_not_of("\r\n \t");
  if (end == std::string::npos) return "";
  const size_t newline = text.rfind('\n', end);
  const size_t begin = newline == std::string::npos ? 0 : newline + 1;
  return text.substr(begin, std::min<size_t>(end + 1 - begin, 300));
}

// Appends what a non-blocking fd has to `into`, at most `max_reads` chunks (a worker that never
// stops writing must not keep us from our deadline). Closes the fd at EOF or on an error.
void read_some(int& fd, std::string& into, int max_reads) {
  char buffer[65536];
  for (int i = 0; i < max_reads && fd >= 0; ++i) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n > 0) {
      into.append(buffer, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      --i;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      close_fd(fd);
    }
  }
}

// write() to a pipe whose reader may be gone. SIGPIPE is blocked for this thread around the write,
// and a SIGPIPE that the write raised is consumed, so the process-wide disposition (owned by the
// embedding application, e.g. Python) is never touched. Returns write()'s result and errno.
ssize_t write_without_sigpipe(int fd, const char* data, size_t size) {
  sigset_t pipe_set, old_mask, pending;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old_mask);
  sigpending(&pending);
  const bool was_pending = sigismember(&pending, SIGPIPE) == 1;  // someone else's: leave it
  ssize_t n;
  do {
    n = ::write(fd, data, size);
  } while (n < 0 && errno == EINTR);
  const int saved_errno = errno;
  if (n < 0 && saved_errno == EPIPE && !was_pending) {
    const timespec zero{};
    while (sigtimedwait(&pipe_set, nullptr, &zero) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  errno = saved_errno;
  return n;
}

}  // namespace

void die_with_parent() {
  const char* parent = std::getenv(kWorkerParentEnv);
  if (parent == nullptr) return;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (std::to_string(::getppid()) != parent) ::_exit(3);  // the parent died before the prctl
}

std::string to_string(Outcome::Kind kind) {
  switch (kind) {
    case Outcome::Kind::kOk: return "ok";
    case Outcome::Kind::kCrashed: return "crashed";
    case Outcome::Kind::kTimedOut: return "timed out";
    case Outcome::Kind::kOutOfMemory: return "out of memory";
    case Outcome::Kind::kProtocolError: return "protocol error";
  }
  return "unknown";
}

WorkerPool::WorkerPool(WorkerCommand command, milliseconds shutdown_grace)
    : command_(std::move(command)), shutdown_grace_(shutdown_grace) {}

WorkerPool::~WorkerPool() { stop(); }

void WorkerPool::spawn() {
  if (command_.argv.empty()) throw std::invalid_argument("WorkerCommand.argv is empty");
  // [0,1] stdin, [2,3] stdout, [4,5] stderr. O_CLOEXEC everywhere: a worker must not inherit the
  // pipes of another worker, or that one would never see EOF on its stdin.
  int fds[6] = {-1, -1, -1, -1, -1, -1};
  for (int i = 0; i < 6; i += 2) {
    if (::pipe2(fds + i, O_CLOEXEC) != 0) {
      const int saved_errno = errno;
      for (int& fd : fds) close_fd(fd);
      throw std::system_error(saved_errno, std::generic_category(), "pipe2 for a worker");
    }
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[0], 0);
  posix_spawn_file_actions_adddup2(&actions, fds[3], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[5], 2);
  // Own process group (killable as a whole); default signal handling and an empty mask, whatever
  // this process ignores or blocks.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  sigset_t signals;
  sigemptyset(&signals);
  posix_spawnattr_setsigmask(&attr, &signals);
  sigfillset(&signals);
  posix_spawnattr_setsigdefault(&attr, &signals);

  std::vector<std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string kv(*entry);
    if (command_.env_overrides.count(kv.substr(0, kv.find('='))) == 0) env.push_back(kv);
  }
  for (const auto& [name, value] : command_.env_overrides) env.push_back(name + "=" + value);
  env.push_back(std::string(kWorkerParentEnv) + "=" + std::to_string(::getpid()));
  std::vector<char*> argv, envp;
  for (auto& arg : command_.argv) argv.push_back(arg.data());
  for (auto& kv : env) envp.push_back(kv.data());
  argv.push_back(nullptr);
  envp.push_back(nullptr);

  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, argv[0], &actions, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close_fd(fds[0]);
  close_fd(fds[3]);
  close_fd(fds[5]);
  if (rc != 0) {
    for (int& fd : fds) close_fd(fd);
    throw std::system_error(rc, std::generic_category(), "starting worker " + command_.argv[0]);
  }
  pid_ = pid;
  stdin_ = fds[1];
  stdout_ = fds[2];
  stderr_ = fds[4];
  for (int fd : {stdin_, stdout_, stderr_}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  stdout_buffer_.clear();
  stderr_tail_.clear();
  if (lost_) ++restarts_;
  lost_ = false;
}

// Without reaping: while the worker is an unreaped zombie its pid (which is also its process group
// id) cannot be reused, so killing the group afterwards cannot hit a stranger. ECHILD (someone
// reaped it behind our back) counts as exited, status unknown.
std::optional<WorkerPool::ExitStatus> WorkerPool::peek_exit(pid_t pid) {
  siginfo_t info{};
  int rc;
  do {
    rc = ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT);
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) return ExitStatus{};
  if (info.si_pid == 0) return std::nullopt;
  if (info.si_code == CLD_EXITED) return ExitStatus{info.si_status, 0};
  return ExitStatus{-1, info.si_status};
}

WorkerPool::ExitStatus WorkerPool::kill_and_reap() {
  // The group takes any grandchildren with it; the pid itself in case the worker left the group.
  ::kill(-pid_, SIGKILL);
  ::kill(pid_, SIGKILL);
  // Blocking on purpose: a worker stuck in the GPU driver may take a while to die, and a fresh
  // worker must not start on the device while the old one still holds its context.
  int status = 0;
  pid_t rc;
  do {
    rc = ::waitpid(pid_, &status, 0);
  } while (rc < 0 && errno == EINTR);
  ExitStatus result;
  if (rc == pid_ && WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (rc == pid_ && WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  pid_ = -1;
  close_fd(stdin_);
  close_fd(stdout_);
  close_fd(stderr_);
  return result;
}

void WorkerPool::read_stderr(int max_reads) {
  read_some(stderr_, stderr_tail_, max_reads);
  if (stderr_tail_.size() > kStderrTailBytes) {
    stderr_tail_.erase(0, stderr_tail_.size() - kStderrTailBytes);
  }
}

bool WorkerPool::idle_and_alive() {
  if (peek_exit(pid_)) return false;
  pollfd out{stdout_, POLLIN, 0};
  if (stdout_ < 0 || ::poll(&out, 1, 0) != 0) return false;  // stray output, EOF or an error
  std::string discarded;  // stderr written between requests belongs to no request
  read_some(stderr_, discarded, 16);
  return true;
}

Outcome WorkerPool::request(const std::string& line, milliseconds timeout) {
  if (line.find('\n') != std::string::npos) {
    throw std::invalid_argument("WorkerPool::request: the request line contains '\\n'");
  }
  const auto deadline = Clock::now() + timeout;
  if (pid_ >= 0 && !idle_and_alive()) {
    kill_and_reap();
    lost_ = true;
  }
  if (pid_ < 0) spawn();
  stdout_buffer_.clear();
  stderr_tail_.clear();

  const std::string message = line + '\n';
  size_t written = 0;
  std::optional<Clock::time_point> dying_deadline;  // set once the worker can no longer answer
  for (;;) {
    pollfd fds[3];
    nfds_t count = 0;
    if (stdin_ >= 0 && written < message.size()) fds[count++] = {stdin_, POLLOUT, 0};
    if (stdout_ >= 0) fds[count++] = {stdout_, POLLIN, 0};
    if (stderr_ >= 0) fds[count++] = {stderr_, POLLIN, 0};
    const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now());
    const int wait_ms =
        static_cast<int>(std::clamp(left, milliseconds(0), kStatusPollInterval).count());
    if (::poll(fds, count, wait_ms) < 0 && errno != EINTR) {
      throw std::system_error(errno, std::generic_category(), "poll on worker pipes");
    }
    for (nfds_t i = 0; i < count; ++i) {
      if (fds[i].revents == 0) continue;
      if (fds[i].fd == stdin_) {
        const ssize_t n =
            write_without_sigpipe(stdin_, message.data() + written, message.size() - written);
        if (n > 0) written += static_cast<size_t>(n);
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) close_fd(stdin_);  // EPIPE
      } else if (fds[i].fd == stdout_) {
        read_some(stdout_, stdout_buffer_, 1);
      } else {
        read_stderr(1);
      }
    }

    if (const size_t nl = stdout_buffer_.find('\n'); nl != std::string::npos) {
      return finish_response(nl);
    }
    if (interrupted_ && interrupted_()) {
      kill_and_reap();
      throw Interrupted();
    }
    if (stdout_buffer_.size() > kMaxResponseBytes) {
      return finish_killed(
          Outcome::Kind::kProtocolError,
          "response line longer than " + std::to_string(kMaxResponseBytes) + " bytes");
    }
    if (const auto status = peek_exit(pid_)) {
      // Whatever it wrote before dying is in the pipes now; a response still counts.
      read_some(stdout_, stdout_buffer_, 16);
      read_stderr(16);
      if (const size_t nl = stdout_buffer_.find('\n'); nl != std::string::npos) {
        return finish_response(nl);
      }
      return finish_dead(*status);
    }
    const auto now = Clock::now();
    if (!dying_deadline && (stdout_ < 0 || (stdin_ < 0 && written < message.size()))) {
      dying_deadline = std::min(deadline, now + kDyingGrace);
    }
    if (dying_deadline && now >= *dying_deadline) {
      return finish_killed(Outcome::Kind::kProtocolError,
                           stdout_ < 0 ? "worker closed its stdout without responding"
                                       : "worker closed its stdin before reading the request");
    }
    if (now >= deadline) {
      return finish_killed(Outcome::Kind::kTimedOut, "no response within " +
                                                         std::to_string(timeout.count()) +
                                                         " ms; worker process group killed");
    }
  }
}

Outcome WorkerPool::finish_response(size_t newline) {
  if (newline + 1 != stdout_buffer_.size()) {
    Outcome outcome =
        finish_killed(Outcome::Kind::kProtocolError, "worker wrote more than one line in response");
    outcome.response = stdout_buffer_.substr(0, newline);
    return outcome;
  }
  read_stderr(16);  // what it wrote before answering is already in the pipe
  Outcome outcome;
  outcome.response = stdout_buffer_.substr(0, newline);
  outcome.stderr_tail = stderr_tail_;
  stdout_buffer_.clear();
  if (peek_exit(pid_)) {  // answered, then exited: fine for this request, the next gets a new one
    kill_and_reap();
    lost_ = true;
  }
  return outcome;
}

Outcome WorkerPool::finish_killed(Outcome::Kind kind, std::string reason) {
  read_stderr(16);
  const ExitStatus status = kill_and_reap();
  lost_ = true;
  Outcome outcome;
  outcome.kind = kind;
  outcome.reason = std::move(reason);
  outcome.exit_code = status.exit_code;
  outcome.signal = status.signal;
  outcome.stderr_tail = stderr_tail_;
  return outcome;
}

Outcome WorkerPool::finish_dead(ExitStatus status) {
  kill_and_reap();  // reaps it, and kills what it left behind in its group
  lost_ = true;
  Outcome outcome;
  outcome.exit_code = status.exit_code;
  outcome.signal = status.signal;
  outcome.stderr_tail = stderr_tail_;
  std::string how =
      status.signal != 0 ? "worker killed by signal " + std::to_string(status.signal) + " (" +
                               signal_name(status.signal) + ")"
      : status.exit_code >= 0 ? "worker exited with code " + std::to_string(status.exit_code)
                              : "worker vanished (exit status unknown)";
  how += " before responding";
  using Kind = Outcome::Kind;
  if (status.exit_code == kExitOutOfMemory) {
    outcome.kind = Kind::kOutOfMemory;
    outcome.reason = how + " (kExitOutOfMemory)";
  } else if (status.signal == SIGKILL) {  // we send SIGKILL only in finish_killed and stop()
    outcome.kind = Kind::kOutOfMemory;
    outcome.reason = how + ", not sent by the harness (likely the kernel OOM killer)";
  } else if (mentions_out_of_memory(stderr_tail_)) {
    outcome.kind = Kind::kOutOfMemory;
    outcome.reason = how + " after reporting out of memory";
  } else if (status.exit_code == 0) {
    outcome.kind = Kind::kProtocolError;
    outcome.reason = how;
  } else {
    outcome.kind = Kind::kCrashed;
    outcome.reason = how;
  }
  if (const std::string last = last_line(stderr_tail_); !last.empty()) {
    outcome.reason += "; stderr: " + last;
  }
  return outcome;
}

void WorkerPool::stop() {
  if (pid_ < 0) return;
  close_fd(stdin_);  // a well-behaved worker exits at EOF
  const auto deadline = Clock::now() + shutdown_grace_;
  std::string discarded;
  while (!peek_exit(pid_) && Clock::now() < deadline) {
    pollfd fds[2] = {{stdout_, POLLIN, 0}, {stderr_, POLLIN, 0}};  // poll ignores fd -1
    ::poll(fds, 2, static_cast<int>(kStatusPollInterval.count()));
    discarded.clear();  // keep draining so that a worker blocked on a full pipe can finish
    read_some(stdout_, discarded, 1);
    read_some(stderr_, discarded, 1);
  }
  kill_and_reap();
  lost_ = false;
}

void WorkerPool::retire() {
  stop();
  lost_ = true;
}

}  // namespace kernelgate::harness
