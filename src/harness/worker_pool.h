// Worker isolation (DESIGN.md, Harness): candidates run in child processes, so that a segfault, an
// illegal memory access, a hang or an OOM kills only the worker and becomes a recorded Outcome.
// Torch-free: the worker program and the meaning of its lines belong to the caller.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace kernelgate::harness {

// Exit status of a worker that caught an out-of-memory error itself (cudaErrorMemoryAllocation,
// torch.OutOfMemoryError, std::bad_alloc), so that OOM is told apart from other failures.
constexpr int kExitOutOfMemory = 86;

struct WorkerCommand {
  std::vector<std::string> argv;  // argv[0] is the program, searched in PATH if it has no '/'
  std::map<std::string, std::string> env_overrides;  // set on top of this process's environment
};

// What became of one request.
//   kOk            a full response line arrived (even if the worker exited right after).
//   kTimedOut      none within the timeout; the worker's process group was SIGKILLed and reaped.
//   kOutOfMemory   the worker died before responding and: exited with kExitOutOfMemory, or was
//                  SIGKILLed by someone other than us (the kernel OOM killer), or its stderr tail
//                  mentions "out of memory" or "bad_alloc".
//   kProtocolError the worker broke the line protocol: it exited with code 0 without responding,
//                  wrote more than one line or a line over 16 MiB, or closed its stdin or stdout
//                  while staying alive.
//   kCrashed       it died before responding in any other way (a signal, a non-zero exit code).
struct Outcome {
  enum class Kind { kOk, kCrashed, kTimedOut, kOutOfMemory, kProtocolError };
  Kind kind = Kind::kOk;
  std::string response;     // the response line without its '\n'
  std::string reason;       // for people: why the outcome is not kOk; empty for kOk
  int exit_code = -1;       // the worker's exit status if it exited during the request, else -1
  int signal = 0;           // the signal that ended the worker during the request, else 0
  std::string stderr_tail;  // the last 4 KiB the worker wrote to stderr during the request

  bool ok() const { return kind == Kind::kOk; }
};

// Thrown by WorkerPool::request when the pool's interrupt test says so (a Ctrl-C): the worker was
// killed and reaped, and the request has no outcome.
struct Interrupted : std::runtime_error {
  Interrupted() : std::runtime_error("interrupted") {}
};

// The environment variable a worker finds its parent's pid in (see die_with_parent).
constexpr char kWorkerParentEnv[] = "KERNELGATE_WORKER_PARENT";

// Called first by a worker program: the kernel kills this process when the process that started
// it exits (a sweep killed by SIGTERM or SIGKILL leaves no worker behind), and if that already
// happened between the spawn and this call, it exits at once. No-op outside a pool's worker.
void die_with_parent();

// "ok", "crashed", "timed out", "out of memory", "protocol error".
std::string to_string(Outcome::Kind kind);

// Runs requests on one worker process at a time and replaces the worker when it is lost.
//
// Protocol: the parent writes one request line to the worker's stdin; the worker answers with
// exactly one line on stdout. Lines are opaque here: the caller encodes them (no '\n' inside).
// stderr is free-form; it is drained concurrently, so a chatty worker never blocks on it. A worker
// should keep stdout for the protocol alone (dup fd 1 for its responses, then point fd 1 at
// stderr) so that a library printing to stdout cannot corrupt the exchange.
//
// Workers are spawned (posix_spawn, never a bare fork: the parent may have CUDA initialised) on
// the first request, in a process group of their own, so that a kill also reaches any processes
// they started. After any outcome other than kOk the worker is gone and the next request starts a
// fresh one; so does a worker found dead, or talking out of turn, before a request is sent.
//
// Not thread-safe: one pool per thread (e.g. per GPU). The process must not set SIGCHLD to
// SIG_IGN, or the workers' exit statuses are lost. SIGPIPE is handled per write, leaving the
// process-wide disposition alone.
class WorkerPool {
 public:
  explicit WorkerPool(WorkerCommand command,
                      std::chrono::milliseconds shutdown_grace = std::chrono::milliseconds(1000));
  ~WorkerPool();  // stop()
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Sends `line` and waits up to `timeout` for the response line. Throws std::invalid_argument if
  // `line` contains '\n', and std::system_error if a worker cannot be started at all (e.g. the
  // program does not exist): a configuration error, not a candidate's outcome.
  Outcome request(const std::string& line, std::chrono::milliseconds timeout);

  // Closes the worker's stdin, waits up to shutdown_grace for it to exit, then kills its process
  // group; always reaps it. A later request starts a new worker (not counted in restarts()).
  void stop();
  // As stop(), for a worker that said it is exiting: the next request starts a new one, counted
  // in restarts().
  void retire();

  // Tested between polls (at least every 20 ms) while a request waits; when it returns true the
  // worker is killed and request() throws Interrupted.
  void set_interrupt(std::function<bool()> interrupted) { interrupted_ = std::move(interrupted); }

  int restarts() const { return restarts_; }  // workers started to replace a lost one
  pid_t pid() const { return pid_; }          // the live worker's pid, or -1

 private:
  struct ExitStatus {
    int exit_code = -1;
    int signal = 0;
  };
  static std::optional<ExitStatus> peek_exit(pid_t pid);  // exited yet? (not reaped)
  void spawn();
  bool idle_and_alive();
  ExitStatus kill_and_reap();
  void read_stderr(int max_reads);
  Outcome finish_response(size_t newline);
  Outcome finish_dead(ExitStatus status);
  Outcome finish_killed(Outcome::Kind kind, std::string reason);

  WorkerCommand command_;
  std::chrono::milliseconds shutdown_grace_;
  pid_t pid_ = -1;
  int stdin_ = -1, stdout_ = -1, stderr_ = -1;  // our ends of the worker's pipes
  std::string stdout_buffer_, stderr_tail_;
  std::function<bool()> interrupted_;
  int restarts_ = 0;
  bool lost_ = false;  // the last worker was lost, so the next spawn is a restart
};

}  // namespace kernelgate::harness
