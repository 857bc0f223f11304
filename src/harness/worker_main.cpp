// kernelgate-worker: runs cases for the sweep in its own process, so that a backend that
// crashes, aborts, hangs or runs out of memory takes only this process down.
//
//   kernelgate-worker [--load PLUGIN.so ...]
// Reads one request per line on stdin (fields: backend, time, cap, noise, case) and answers one
// line on stdout (Measured::encode). A plugin library registers extra backends through its
// `kernelgate_register_backends(kernelgate::Dispatcher&)` function. Python backends and ops need
// the Python worker instead (python -m kernelgate.worker), which serves the same protocol.
#include <cstring>
#include <iostream>

#include "harness/harness.h"
#include "harness/sweep.h"
#include "harness/worker_pool.h"

int main(int argc, char** argv) {
  kernelgate::harness::die_with_parent();
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--load") == 0 && i + 1 < argc) {
      try {
        kernelgate::harness::load_backend_plugin(argv[++i]);
      } catch (const std::exception& e) {
        std::cerr << "kernelgate-worker: " << e.what() << "\n";
        return 2;
      }
    } else {
      std::cerr << "kernelgate-worker: unknown argument " << argv[i] << "\n";
      return 2;
    }
  }
  return kernelgate::harness::serve_worker();
}
