// The harness facade: cases from an op's contract, validation against the float64 oracle with
// dispositions, and timing of passing runs. Runs inside a worker process
// (src/harness/worker_main.cpp); the sweep (sweep.h) drives workers and writes the store.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "store/store.h"

namespace kernelgate::harness {

// key=value;key=value lines with '%', ';', '=' and newlines percent-escaped: the worker protocol.
std::string encode_fields(const std::vector<std::pair<std::string, std::string>>& fields);
bool decode_fields(const std::string& text, std::map<std::string, std::string>* out,
                   std::string* problem);

// One case: sizes of the op's named dims, a dtype, a layout (validate.cpp's make_inputs), a value
// regime, a seed (fresh inputs per seed), scalar values and grad mode. Encoded as one line
// (encode/decode) to cross the worker pipe.
struct Case {
  std::string op;
  std::map<std::string, int64_t> dims;
  std::string dtype = "float32";      // "float32", "float16", "bfloat16"
  std::string layout = "contiguous";  // contiguous, row_strided, offset, transposed, expanded
  std::string regime = "normal";      // normal, large, small, offset, special
  std::map<std::string, double> scalars;
  std::map<std::string, std::string>
      strings;                // string arguments (a call variant), default if absent
  bool with_optional = true;  // pass optional tensor arguments (e.g. weight)
  bool grad = true;           // validate gradients and time forward+backward
  int seed = 0;

  // Stable id of everything but the seed: "rms_norm/rows=4096,hidden=4097/bfloat16/...".
  std::string id() const;
  std::string encode() const;
  static std::optional<Case> decode(const std::string& text, std::string* problem);
};

// kSmoke: a handful of cases that exercise every stage (tests, a first look).
enum class Grid { kSmoke, kQuick, kFull };

// Cases for an op from its contract: per named dim, bucket edges and odd/unaligned sizes; LLM
// production shapes; tiny and degenerate shapes; every accepted dtype; scalar test values;
// non-contiguous layouts; value regimes. Deterministic. `dtypes` empty = all accepted. Shapes
// over max_elements (product of the named dims) are left out.
std::vector<Case> make_cases(const std::string& op, Grid grid,
                             const std::vector<std::string>& dtypes, int seeds,
                             int64_t max_elements);

struct Measured {
  store::Disposition disposition = store::Disposition::kPassed;  // its name on the worker wire
  std::string reason;
  std::string region;  // the dispatch key the call falls in (describe_key)
  int arch = -1;
  std::string buckets, align;
  double max_rel_l2 = 0, max_max_over_rms = 0;  // worst over outputs and gradients
  // Timing (passing runs only): device time by CUDA graph replay (CPU: wall time), eager call time.
  std::optional<double> device_median_us, device_spread_us, eager_median_us, eager_spread_us;
  int device_samples = 0, eager_samples = 0;
  double rel_noise = 0;
  bool throttled = false;
  std::string clocks_before, clocks_after;

  std::string encode() const;
  static std::optional<Measured> decode(const std::string& text, std::string* problem);
};

struct RunOptions {
  bool time = true;
  double time_cap_s = 1.0;
  double target_rel_noise = 0.02;
};

// The tolerance rule, the one place it is stated (docs/evidence.md, kernelgate.testing): `got`
// passes when its NaN and Inf pattern is the oracle's and, on the finite elements, its relative L2
// error and its max error over the oracle's rms are each within kFactor (2) x the reference's at
// the same dtype plus a floor per dtype (two unit roundoffs for 16-bit types, 1e-5 for float32).
struct OracleCheck {
  std::string failure;  // empty: passed
  double rel_l2 = 0, max_over_rms = 0, ref_rel_l2 = 0, ref_max_over_rms = 0;
};
OracleCheck check_against_oracle(const std::string& name, const at::Tensor& got,
                                 const at::Tensor& ref, const at::Tensor& oracle,
                                 c10::ScalarType dtype);

// A case's call: the op's arguments in schema order and the leaves gradients are taken against
// (undefined for absent and index tensors), on the CPU or CUDA device 0, at the case's dtype or
// in float64 (the oracle's: the same rounded values, upcast).
struct CaseArguments {
  std::vector<c10::IValue> args;
  std::vector<at::Tensor> leaves;
};
CaseArguments case_arguments(const Case& c, bool on_gpu, bool float64);

// The region (describe_key of the dispatch key) a case's call falls in on a device of `arch`
// (-1: CPU), computed without running anything: for results whose worker never answered.
std::string case_region(const Case& c, int arch);

// Validates `backend` on `c` (forward and every gradient against the oracle; outputs poisoned
// first) and, if it passed and options.time, times it. Never throws: failures are dispositions.
Measured run_case(const Case& c, const std::string& backend, const RunOptions& options);

// The worker loop (worker.cpp): poisons new CPU allocations, answers requests from stdin on
// stdout until stdin closes; returns the process's exit code.
int serve_worker();

// Worker set-up: a stream of the worker's own becomes current on the GPU.
void prepare_worker_device();
// True once a run may have left the device in a state later runs should not inherit (an
// interrupted graph capture): the worker answers and exits, and the sweep starts a fresh one.
bool device_state_suspect();

}  // namespace kernelgate::harness
