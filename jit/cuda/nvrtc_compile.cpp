// NVRTC compilation of generated CUDA C++ to CUBIN or PTX.
#include "jit/cuda/nvrtc_compile.hpp"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <string>
#include <vector>

#include "jit/base/cuda_api.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::jit {
namespace {

const cuda::NvrtcApi& require_nvrtc() {
  const cuda::NvrtcApi* api = cuda::nvrtc();
  if (!api) throw Error(ErrorCode::unsupported, "cannot compile CUDA kernels: " + cuda::nvrtc_status().reason);
  return *api;
}

// Destroys the program however nvrtc_compile leaves.
class ProgramGuard {
 public:
  ProgramGuard(const cuda::NvrtcApi& api, cuda::nvrtcProgram prog) : api_(api), prog_(prog) {}
  ~ProgramGuard() { api_.nvrtcDestroyProgram(&prog_); }
  ProgramGuard(const ProgramGuard&) = delete;
  ProgramGuard& operator=(const ProgramGuard&) = delete;

 private:
  const cuda::NvrtcApi& api_;
  cuda::nvrtcProgram prog_;
};

std::string program_log(const cuda::NvrtcApi& api, cuda::nvrtcProgram prog) {
  std::size_t size = 0;
  if (api.nvrtcGetProgramLogSize(prog, &size) != cuda::NVRTC_SUCCESS || size == 0) return {};
  std::string log(size, '\0');
  if (api.nvrtcGetProgramLog(prog, log.data()) != cuda::NVRTC_SUCCESS) return {};
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  return log;
}

}  // namespace

std::string arch_name(const CudaTarget& t) {
  return (t.output == CudaOutput::cubin ? "sm_" : "compute_") + std::to_string(t.sm);
}

std::vector<std::string> nvrtc_options(const CudaTarget& t) {
  return {
      "-arch=" + arch_name(t),
      // Bitwise agreement with the CPU backends (docs/architecture.md §5): a multiply-add is
      // fused only where the program says fma (the emitter writes __fmaf_rn then).
      "--fmad=false",
      "-ftz=false",
      "-prec-div=true",
      "-prec-sqrt=true",
      "-std=c++17",
      // Leaves out textures, device-runtime calls and the runtime's types, none of
      // which generated kernels use: ~10 ms less per compile with NVRTC 13.
      "-minimal",
  };
}

std::string numbered_source(const std::string& source) {
  std::string out;
  out.reserve(source.size() + source.size() / 8 + 16);
  std::size_t line = 1;
  std::size_t begin = 0;
  char number[32];
  while (begin < source.size()) {
    std::size_t end = source.find('\n', begin);
    if (end == std::string::npos) end = source.size();
    std::snprintf(number, sizeof number, "%4zu| ", line++);
    out += number;
    out.append(source, begin, end - begin);
    out += '\n';
    begin = end + 1;
  }
  return out;
}

std::string nvrtc_compile(const std::string& source, const std::string& program_name, const CudaTarget& t) {
  const cuda::NvrtcApi& api = require_nvrtc();
  cuda::nvrtcProgram prog = nullptr;
  cuda::check_nvrtc(api.nvrtcCreateProgram(&prog, source.c_str(), program_name.c_str(), 0, nullptr, nullptr),
                    "nvrtcCreateProgram");
  ProgramGuard guard(api, prog);

  const std::vector<std::string> options = nvrtc_options(t);
  std::vector<const char*> argv;
  argv.reserve(options.size());
  for (const std::string& o : options) argv.push_back(o.c_str());
  const cuda::nvrtcResult result = api.nvrtcCompileProgram(prog, static_cast<int>(argv.size()), argv.data());
  if (result != cuda::NVRTC_SUCCESS) {
    // Any failure here (a syntax error, an arch NVRTC does not know) is explained
    // by the log, so all of them are compile_failed.
    throw Error(ErrorCode::compile_failed, "NVRTC failed to compile " + program_name + " for " + arch_name(t) +
                                               ": " + api.nvrtcGetErrorString(result) + "\n--- log ---\n" +
                                               program_log(api, prog) + "\n--- source ---\n" +
                                               numbered_source(source));
  }

  std::size_t size = 0;
  std::string out;
  if (t.output == CudaOutput::cubin) {
    cuda::check_nvrtc(api.nvrtcGetCUBINSize(prog, &size), "nvrtcGetCUBINSize");
    out.resize(size);
    cuda::check_nvrtc(api.nvrtcGetCUBIN(prog, out.data()), "nvrtcGetCUBIN");
  } else {
    cuda::check_nvrtc(api.nvrtcGetPTXSize(prog, &size), "nvrtcGetPTXSize");
    out.resize(size);
    cuda::check_nvrtc(api.nvrtcGetPTX(prog, out.data()), "nvrtcGetPTX");
    // The size counts the terminating NUL; std::string keeps its own.
    while (!out.empty() && out.back() == '\0') out.pop_back();
  }
  return out;
}

std::string nvrtc_version_string() {
  require_nvrtc();
  const auto [major, minor] = cuda::nvrtc_version();
  return std::to_string(major) + "." + std::to_string(minor);
}

std::vector<int> nvrtc_supported_archs() {
  const cuda::NvrtcApi& api = require_nvrtc();
  // Fixed for the process (one NVRTC is loaded once), so computed once.
  static const std::vector<int> archs = [&api] {
    int count = 0;
    cuda::check_nvrtc(api.nvrtcGetNumSupportedArchs(&count), "nvrtcGetNumSupportedArchs");
    std::vector<int> v(static_cast<std::size_t>(std::max(count, 0)));
    if (!v.empty()) cuda::check_nvrtc(api.nvrtcGetSupportedArchs(v.data()), "nvrtcGetSupportedArchs");
    std::sort(v.begin(), v.end());
    return v;
  }();
  return archs;
}

CudaTarget target_for_device(int major, int minor) {
  if (major < 1 || minor < 0 || minor > 9) {
    throw Error(ErrorCode::invalid_argument, "target_for_device: compute capability " + std::to_string(major) +
                                                 "." + std::to_string(minor) +
                                                 " is not valid (expected major >= 1, minor 0-9)");
  }
  const int sm = major * 10 + minor;
  const std::vector<int> archs = nvrtc_supported_archs();
  if (std::binary_search(archs.begin(), archs.end(), sm)) return CudaTarget{sm, CudaOutput::cubin};
  // PTX is forward compatible: the driver compiles it for any newer device.
  const auto newer = std::upper_bound(archs.begin(), archs.end(), sm);
  if (newer == archs.begin()) {
    throw Error(ErrorCode::unsupported,
                "NVRTC " + nvrtc_version_string() + " cannot generate code for compute capability " +
                    std::to_string(major) + "." + std::to_string(minor) + " (its oldest target is sm_" +
                    (archs.empty() ? std::string("?") : std::to_string(archs.front())) +
                    "); use an older CUDA toolkit's NVRTC (STEPFUSE_NVRTC_PATH) or the CPU backend");
  }
  return CudaTarget{*std::prev(newer), CudaOutput::ptx};
}

}  // namespace stepfuse::jit
