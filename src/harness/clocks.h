// GPU clocks and throttling, read (never set) through NVML, loaded at run time so that nothing
// links against the driver's library. On the CPU or without NVML: empty text, not throttled.
#pragma once
#include <string>

namespace kernelgate::harness {

struct ClockReading {
  std::string text;        // "sm=1980MHz mem=3201MHz reasons=0x0"
  bool throttled = false;  // power/thermal/hardware slowdown active
};

ClockReading read_clocks(int cuda_device_index);

}  // namespace kernelgate::harness
