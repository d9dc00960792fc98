// cuda_available() and nvrtc_available(): what the lazily loaded CUDA tables found.
#include <exception>
#include <string>
#include <string_view>

#include "jit/base/cuda_api.hpp"
#include "stepfuse/cuda.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {
namespace {

void fill_nvrtc(CudaStatus& s) {
  const auto [major, minor] = cuda::nvrtc_version();
  s.nvrtc_major = major;
  s.nvrtc_minor = minor;
}

// Error::what() starts with "stepfuse: "; inside a reason that is noise.
std::string without_prefix(std::string_view what) {
  constexpr std::string_view kPrefix = "stepfuse: ";
  if (what.substr(0, kPrefix.size()) == kPrefix) what.remove_prefix(kPrefix.size());
  return std::string(what);
}

}  // namespace

CudaStatus cuda_available() {
  CudaStatus s;
  // Documented never to throw; the loaders report through their status, but an
  // allocation failure while building a reason must not escape either.
  try {
    fill_nvrtc(s);
    const cuda::DriverApi* api = cuda::driver();
    if (!api) {
      s.reason = cuda::driver_status().reason;
      return s;
    }
    if (api->cuDriverGetVersion(&s.driver_version) != cuda::CUDA_SUCCESS) s.driver_version = 0;
    if (!cuda::nvrtc()) {
      s.reason = cuda::nvrtc_status().reason;
      return s;
    }
    int count = 0;
    try {
      cuda::check(api->cuDeviceGetCount(&count), "cuDeviceGetCount");
    } catch (const Error& e) {
      s.reason = "no device (" + without_prefix(e.what()) + ")";
      return s;
    }
    s.device_count = count;
    if (count == 0) {
      s.reason = "no device (the driver sees 0 CUDA devices)";
      return s;
    }
    s.available = true;
  } catch (const std::exception& e) {
    s.available = false;
    s.reason = "no CUDA driver (" + without_prefix(e.what()) + ")";
  }
  return s;
}

CudaStatus nvrtc_available() {
  CudaStatus s;
  try {
    fill_nvrtc(s);
    if (cuda::nvrtc()) {
      s.available = true;
    } else {
      s.reason = cuda::nvrtc_status().reason;
    }
  } catch (const std::exception& e) {
    s.available = false;
    s.reason = "NVRTC not found (" + without_prefix(e.what()) + ")";
  }
  return s;
}

}  // namespace stepfuse
