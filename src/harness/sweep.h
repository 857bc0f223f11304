// Sweeps: cases x backends, each run in a worker process, results into the store. Which stored
// evidence serves a process, and the policy it gives, is evidence.h's.
#pragma once
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "harness/harness.h"
#include "kernelgate/dispatch.h"

namespace kernelgate::harness {

// Loads a plugin library and calls its `kernelgate_register_backends(kernelgate::Dispatcher&)`.
// Loading the same path twice registers once. Throws std::runtime_error naming the problem.
void load_backend_plugin(const std::string& path);

// Field a worker adds to its answer when it exits right after it (kernelgate-worker does after
// a failed graph capture): the sweep replaces it before the next run.
constexpr char kWorkerExitsField[] = "worker_exits";

struct SweepOptions {
  std::string op;
  std::vector<std::string> backends;  // empty: every backend registered for the op
  std::vector<std::string> dtypes;    // empty: every accepted dtype
  Grid grid = Grid::kQuick;
  int seeds = 3;
  int shard_index = 0, shard_count = 1;  // this process runs cases with index % count == index
  std::string db_path;
  bool time = true;
  double case_timeout_s = 120;
  double time_cap_s = 1.0;
  // Only these (backend, case id) runs, where not empty (`kernelgate rerank`: what borrowed
  // evidence shows correct, to time on this GPU); each is still validated.
  std::set<std::pair<std::string, std::string>> only;
  std::vector<std::string> worker_argv;  // kernelgate-worker [--load plugin.so ...]
  std::string command;                   // recorded with the run
  std::function<void(int done, int total, const std::string& what)> progress;
  // Asked before each run and while one waits (every 20 ms): true stops the sweep, which throws
  // Interrupted (worker_pool.h); what it stored is kept, the run in flight is not stored.
  std::function<bool()> interrupted;
};

struct SweepReport {
  std::string fingerprint_id;                          // the op's (every backend without a version)
  std::map<std::string, std::string> fingerprint_ids;  // backend -> the one its rows are under
  int planned = 0;                                     // (case, seed, backend) runs in this shard
  int skipped = 0;  // already in the store for their backend's fingerprint (resumed)
  std::map<std::string, int> dispositions;
  int worker_restarts = 0;
  double seconds = 0;
};

// Throws std::runtime_error for configuration errors (unknown op or backend, unusable store).
// A run row is written with the first result under its fingerprint: a sweep that measured
// nothing (everything resumed, or interrupted first) stores nothing.
SweepReport sweep(const SweepOptions& options);

}  // namespace kernelgate::harness
