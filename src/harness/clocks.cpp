#include "harness/clocks.h"

#include <dlfcn.h>

#include <cstdio>

#ifdef KERNELGATE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace kernelgate::harness {
namespace {

// The few NVML entry points we need, with their C signatures (nvml.h).
using Device = void*;
struct Nvml {
  int (*init)() = nullptr;
  int (*by_pci)(const char*, Device*) = nullptr;
  int (*clock)(Device, int, unsigned*) = nullptr;
  int (*reasons)(Device, unsigned long long*) = nullptr;
  bool ok = false;
};

const Nvml& nvml() {
  static Nvml n = [] {
    Nvml r;
    void* h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) return r;
    r.init = reinterpret_cast<int (*)()>(dlsym(h, "nvmlInit_v2"));
    r.by_pci = reinterpret_cast<int (*)(const char*, Device*)>(
        dlsym(h, "nvmlDeviceGetHandleByPciBusId_v2"));
    r.clock = reinterpret_cast<int (*)(Device, int, unsigned*)>(dlsym(h, "nvmlDeviceGetClockInfo"));
    r.reasons = reinterpret_cast<int (*)(Device, unsigned long long*)>(
        dlsym(h, "nvmlDeviceGetCurrentClocksEventReasons"));
    if (r.reasons == nullptr) {
      r.reasons = reinterpret_cast<int (*)(Device, unsigned long long*)>(
          dlsym(h, "nvmlDeviceGetCurrentClocksThrottleReasons"));
    }
    r.ok = r.init && r.by_pci && r.clock && r.reasons && r.init() == 0;
    return r;
  }();
  return n;
}

}  // namespace

ClockReading read_clocks(int cuda_device_index) {
  ClockReading out;
#ifdef KERNELGATE_WITH_CUDA
  const Nvml& n = nvml();
  char pci[32] = {0};
  Device dev = nullptr;
  if (!n.ok || cudaDeviceGetPCIBusId(pci, sizeof(pci), cuda_device_index) != cudaSuccess ||
      n.by_pci(pci, &dev) != 0) {
    out.text = "unavailable";
    return out;
  }
  unsigned sm = 0, mem = 0;
  unsigned long long reasons = 0;
  constexpr int kClockSm = 1, kClockMem = 2;
  n.clock(dev, kClockSm, &sm);
  n.clock(dev, kClockMem, &mem);
  n.reasons(dev, &reasons);
  // SW power cap, HW slowdown, SW/HW thermal slowdown, HW power brake.
  out.throttled = (reasons & (0x4ull | 0x8ull | 0x20ull | 0x40ull | 0x80ull)) != 0;
  char buf[96];
  std::snprintf(buf, sizeof(buf), "sm=%uMHz mem=%uMHz reasons=0x%llx", sm, mem, reasons);
  out.text = buf;
#else
  (void)cuda_device_index;
#endif
  return out;
}

}  // namespace kernelgate::harness
