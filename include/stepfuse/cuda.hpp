// Whether the CUDA backend can run here, and why not.
#pragma once

#include <string>

namespace stepfuse {

struct CudaStatus {
  bool available = false;  // a driver, NVRTC and at least one device
  // Empty when available; otherwise what is missing, starting with one of
  // "no CUDA driver", "NVRTC not found" or "no device", then the details.
  std::string reason;
  int device_count = 0;
  int driver_version = 0;   // e.g. 13000 for CUDA 13.0; 0 without a driver
  int nvrtc_major = 0, nvrtc_minor = 0;  // 0.0 when NVRTC was not found
  explicit operator bool() const { return available; }
};

// Loads the CUDA driver and NVRTC on first call (dlopen; stepfuse links
// neither) and reports what it found. Cheap after the first call. Never throws.
CudaStatus cuda_available();

// Whether NVRTC alone is usable (it compiles without a GPU): code generation and
// compilation work, kernels cannot run. `reason` as above when not.
CudaStatus nvrtc_available();

}  // namespace stepfuse
