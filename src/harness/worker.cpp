// The worker side of the sweep protocol (worker_pool.h): one request per line on stdin, one answer
// per line on stdout. Served by the kernelgate-worker program and by the Python worker
// (python -m kernelgate.worker), which can also host Python backends and ops.
#include <c10/core/CPUAllocator.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "harness/harness.h"
#include "harness/sweep.h"
#include "kernelgate/dispatch.h"

namespace kernelgate::harness {
namespace {

// Fills every new CPU allocation with 0xFF bytes: NaN in float32, float16 and bfloat16, so an
// output element a backend never writes fails the NaN-pattern check.
class PoisonAllocator final : public c10::Allocator {
 public:
  explicit PoisonAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr p = base_->allocate(n);
    if (n > 0) std::memset(p.get(), 0xFF, n);
    return p;
  }
  c10::DeleterFnPtr raw_deleter() const override { return base_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  c10::Allocator* base_;
};

}  // namespace

int serve_worker() {
  static PoisonAllocator poison(c10::GetDefaultCPUAllocator());
  c10::SetCPUAllocator(&poison, /*priority=*/100);
  Dispatcher::get().set_log_hook([](LogLevel, const std::string&, const std::string&) {});
  prepare_worker_device();

  // Responses go to the original stdout; anything a library prints goes to stderr, so it can
  // never corrupt the protocol.
  FILE* responses = fdopen(dup(STDOUT_FILENO), "w");
  dup2(STDERR_FILENO, STDOUT_FILENO);
  if (responses == nullptr) return 2;

  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "ping") {  // the parent waits for start-up before timing cases
      std::fprintf(responses, "pong\n");
      std::fflush(responses);
      continue;
    }
    std::map<std::string, std::string> f;
    std::string problem;
    Measured m;
    std::optional<Case> c;
    if (!decode_fields(line, &f, &problem) || !(c = Case::decode(f["case"], &problem))) {
      m.disposition = store::Disposition::kCrashed;
      m.reason = "bad request: " + problem;
    } else {
      RunOptions o;
      o.time = f["time"] == "1";
      if (!f["cap"].empty()) o.time_cap_s = std::stod(f["cap"]);
      if (!f["noise"].empty()) o.target_rel_noise = std::stod(f["noise"]);
      m = run_case(*c, f["backend"], o);  // an OOM error is a disposition here
    }
    // After a failed graph capture the device state is suspect: the worker answers, says it is
    // exiting (so that no further request is sent to it), and exits.
    const bool exiting = device_state_suspect();
    std::fprintf(responses, "%s%s\n", m.encode().c_str(),
                 exiting ? (std::string(";") + kWorkerExitsField + "=1").c_str() : "");
    std::fflush(responses);
    if (exiting) return 0;
  }
  return 0;
}

}  // namespace kernelgate::harness
