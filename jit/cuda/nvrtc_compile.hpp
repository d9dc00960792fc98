// Compiling generated CUDA C++ with NVRTC (loaded lazily; no GPU needed): the
// options, the target for a device, and errors that carry the log and source.
#pragma once

#include <string>
#include <vector>

namespace stepfuse::jit {

enum class CudaOutput { cubin, ptx };

struct CudaTarget {
  int sm = 90;  // compute capability major*10 + minor
  CudaOutput output = CudaOutput::cubin;
};

// The NVRTC options for `t`: "-arch=sm_XY" (CUBIN) or "-arch=compute_XY" (PTX),
// then IEEE-exact float math (no fused multiply-add, no flush to zero, correctly
// rounded division and square root: docs/architecture.md §5), C++17 and -minimal. Part of the
// kernel cache key: a change here must bump the cache format version.
std::vector<std::string> nvrtc_options(const CudaTarget& t);

// "sm_90" or "compute_90", as in the -arch option.
std::string arch_name(const CudaTarget& t);

// Compiles self-contained CUDA C++ (no #include) and returns the CUBIN, or the
// PTX text (without its terminating NUL), for `t`. Allocates; touches no GPU.
// Throws Error(compile_failed) with the NVRTC log and the numbered source,
// Error(unsupported) when NVRTC is not available.
std::string nvrtc_compile(const std::string& source, const std::string& program_name, const CudaTarget& t);

// `source` with line numbers, "   1| first line\n   2| ...", for error messages.
std::string numbered_source(const std::string& source);

// The loaded NVRTC's version, e.g. "13.0". Throws Error(unsupported) when not loaded.
std::string nvrtc_version_string();

// The architectures NVRTC can generate code for, ascending (e.g. {75, 80, 86, ..., 90, 100, ...}).
// Throws Error(unsupported) when NVRTC is not loaded.
std::vector<int> nvrtc_supported_archs();

// What to compile for a device of compute capability (major, minor): CUBIN for
// sm_XY when NVRTC supports it; otherwise PTX for the newest supported arch not
// above the device's (the driver JIT-compiles it on load). Throws
// Error(unsupported) when NVRTC supports nothing that old, or is not loaded;
// Error(invalid_argument) for an impossible capability.
CudaTarget target_for_device(int major, int minor);

}  // namespace stepfuse::jit
