// Lazy loading of the CUDA driver (libcuda.so.1) and NVRTC with dlopen: the two
// function tables of cuda_api.hpp, and the error checks that name CUresults.
#include "jit/base/cuda_api.hpp"

#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "jit/base/warning.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::cuda {
namespace {

constexpr CUresult kErrorStubLibrary = 34;  // CUDA_ERROR_STUB_LIBRARY
constexpr CUresult kErrorNoDevice = 100;    // CUDA_ERROR_NO_DEVICE
constexpr nvrtcResult kNvrtcErrorCompilation = 6;
// The ABI we ask cuGetProcAddress for: the entry points as cuda.h 12.0 declares
// them. Raising it changes which versioned function a base name returns, so the
// signatures in DriverApi must be re-checked against cudaTypedefs.h if it moves.
constexpr int kRequestedCudaVersion = 12000;

using GetProcAddressFn = CUresult (*)(const char* symbol, void** pfn, int cuda_version, std::uint64_t flags,
                                      int* symbol_status);

// Paths set by set_library_paths_for_testing, and whether each table has begun
// loading (after which a new path would be silently ignored).
struct TestPaths {
  std::mutex mutex;
  std::string libcuda, libnvrtc;
  std::optional<DriverApi> fake_driver;  // set_driver_for_testing
  std::atomic<bool> driver_started{false}, nvrtc_started{false};
};
TestPaths& test_paths() {
  static TestPaths paths;
  return paths;
}

std::string dl_error_text() {
  const char* e = dlerror();
  return e ? e : "unknown dlopen error";
}

// Names of the CUresults that can come before the driver's own cuGetErrorName is
// usable (cuInit failing, the stub library); anything else prints as a number.
const char* fallback_cu_name(CUresult r) {
  switch (r) {
    case 1: return "CUDA_ERROR_INVALID_VALUE";
    case 2: return "CUDA_ERROR_OUT_OF_MEMORY";
    case 3: return "CUDA_ERROR_NOT_INITIALIZED";
    case 34: return "CUDA_ERROR_STUB_LIBRARY";
    case 35: return "CUDA_ERROR_INSUFFICIENT_DRIVER";
    case 46: return "CUDA_ERROR_DEVICES_UNAVAILABLE";
    case 100: return "CUDA_ERROR_NO_DEVICE";
    case 101: return "CUDA_ERROR_INVALID_DEVICE";
    case 304: return "CUDA_ERROR_OPERATING_SYSTEM";
    case 803: return "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH";
    case 804: return "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE";
    case 999: return "CUDA_ERROR_UNKNOWN";
    default: return nullptr;
  }
}

// "CUDA_ERROR_X: description" from the driver when it can say, else the
// fallback name or "CUresult <n>".
std::string cu_result_text(const DriverApi& api, CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api.cuGetErrorName && api.cuGetErrorName(r, &name) != CUDA_SUCCESS) name = nullptr;
  if (api.cuGetErrorString && api.cuGetErrorString(r, &text) != CUDA_SUCCESS) text = nullptr;
  if (!name) name = fallback_cu_name(r);
  std::string out = name ? name : "CUresult " + std::to_string(r);
  if (text) out += std::string(": ") + text;
  return out;
}

// ---------------------------------------------------------------- driver

struct DriverState {
  DriverApi api{};
  Loaded status;
};

// Fills a DriverApi from an open libcuda. Each entry comes from cuGetProcAddress
// by base name and, failing that (no cuGetProcAddress_v2: a driver older than
// 12.0), from dlsym of the exact versioned symbol cuda.h maps the name to.
class DriverResolver {
 public:
  DriverResolver(void* lib, GetProcAddressFn get_proc, int version)
      : lib_(lib), get_proc_(get_proc), version_(version) {}

  template <class F>
  void get(F& slot, const char* base, const char* versioned) {  // every entry is required
    void* p = nullptr;
    if (get_proc_) {
      int symbol_status = 0;
      // flags 0 = CU_GET_PROC_ADDRESS_DEFAULT: the legacy-default-stream variants,
      // as cuda.h gives a program built without per-thread default streams.
      if (get_proc_(base, &p, version_, 0, &symbol_status) != CUDA_SUCCESS) p = nullptr;
    }
    if (!p) p = dlsym(lib_, versioned);
    // POSIX guarantees a dlsym result converts to a function pointer.
    slot = reinterpret_cast<F>(p);
    if (!p && missing_.empty()) missing_ = base;
  }
  const std::string& first_missing() const { return missing_; }

 private:
  void* lib_;
  GetProcAddressFn get_proc_;
  int version_;
  std::string missing_;
};

DriverState load_driver() {
  DriverState s;
  std::string path;
  {
    auto& tp = test_paths();
    std::lock_guard lock(tp.mutex);
    tp.driver_started = true;
    path = tp.libcuda.empty() ? "libcuda.so.1" : tp.libcuda;
    if (tp.fake_driver) {
      s.api = *tp.fake_driver;
      s.status.ok = true;
      return s;
    }
  }
  // RTLD_LOCAL: the driver's symbols stay out of the global namespace, so they
  // cannot satisfy (or clash with) another library's references by accident.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    s.status.reason = "no CUDA driver (" + dl_error_text() + ")";
    return s;
  }
  // Never dlclose: the tables hold pointers into the library for the process's life.

  DriverApi& a = s.api;
  // Bootstrap entry points, unversioned in every driver: needed before the
  // version to ask cuGetProcAddress for is known.
  a.cuInit = reinterpret_cast<decltype(a.cuInit)>(dlsym(lib, "cuInit"));
  a.cuDriverGetVersion = reinterpret_cast<decltype(a.cuDriverGetVersion)>(dlsym(lib, "cuDriverGetVersion"));
  a.cuGetErrorName = reinterpret_cast<decltype(a.cuGetErrorName)>(dlsym(lib, "cuGetErrorName"));
  a.cuGetErrorString = reinterpret_cast<decltype(a.cuGetErrorString)>(dlsym(lib, "cuGetErrorString"));
  if (!a.cuInit || !a.cuDriverGetVersion) {
    s.status.reason = std::string("no CUDA driver (") + path + " has no " +
                      (a.cuInit ? "cuDriverGetVersion" : "cuInit") + "; it is not a CUDA driver library)";
    s.api = DriverApi{};
    return s;
  }
  const CUresult init = a.cuInit(0);
  if (init == kErrorStubLibrary) {
    s.status.reason =
        "no CUDA driver (libcuda.so.1 is the toolkit's stub library; install the NVIDIA driver)";
    s.api = DriverApi{};
    return s;
  }
  if (init != CUDA_SUCCESS) {
    // A driver without a usable GPU is "no device", not "no driver": the fix differs.
    const char* kind = init == kErrorNoDevice ? "no device" : "no CUDA driver";
    s.status.reason = std::string(kind) + " (cuInit: " + cu_result_text(a, init) + ")";
    s.api = DriverApi{};
    return s;
  }
  int driver_version = 0;
  if (a.cuDriverGetVersion(&driver_version) != CUDA_SUCCESS) driver_version = 0;
  // cuGetProcAddress rejects a version above the driver's own (CUDA_ERROR_INVALID_VALUE).
  const int version = driver_version > 0 ? std::min(kRequestedCudaVersion, driver_version) : kRequestedCudaVersion;
  auto get_proc = reinterpret_cast<GetProcAddressFn>(dlsym(lib, "cuGetProcAddress_v2"));

  DriverResolver r(lib, get_proc, version);
  // Second column: the symbol cuda.h maps the name to (the dlsym fallback).
  r.get(a.cuInit, "cuInit", "cuInit");
  r.get(a.cuDriverGetVersion, "cuDriverGetVersion", "cuDriverGetVersion");
  r.get(a.cuGetErrorName, "cuGetErrorName", "cuGetErrorName");
  r.get(a.cuGetErrorString, "cuGetErrorString", "cuGetErrorString");
  r.get(a.cuDeviceGetCount, "cuDeviceGetCount", "cuDeviceGetCount");
  r.get(a.cuDeviceGet, "cuDeviceGet", "cuDeviceGet");
  r.get(a.cuDeviceGetName, "cuDeviceGetName", "cuDeviceGetName");
  r.get(a.cuDeviceGetAttribute, "cuDeviceGetAttribute", "cuDeviceGetAttribute");
  r.get(a.cuDeviceTotalMem, "cuDeviceTotalMem", "cuDeviceTotalMem_v2");
  r.get(a.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain");
  r.get(a.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2");
  r.get(a.cuCtxSetCurrent, "cuCtxSetCurrent", "cuCtxSetCurrent");
  r.get(a.cuCtxSynchronize, "cuCtxSynchronize", "cuCtxSynchronize");
  r.get(a.cuModuleLoadDataEx, "cuModuleLoadDataEx", "cuModuleLoadDataEx");
  r.get(a.cuModuleUnload, "cuModuleUnload", "cuModuleUnload");
  r.get(a.cuModuleGetFunction, "cuModuleGetFunction", "cuModuleGetFunction");
  r.get(a.cuLaunchKernel, "cuLaunchKernel", "cuLaunchKernel");
  r.get(a.cuMemAlloc, "cuMemAlloc", "cuMemAlloc_v2");
  r.get(a.cuMemFree, "cuMemFree", "cuMemFree_v2");
  r.get(a.cuPointerGetAttribute, "cuPointerGetAttribute", "cuPointerGetAttribute");
  r.get(a.cuMemcpyHtoD, "cuMemcpyHtoD", "cuMemcpyHtoD_v2");
  r.get(a.cuMemcpyDtoH, "cuMemcpyDtoH", "cuMemcpyDtoH_v2");
  r.get(a.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2");
  r.get(a.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2");
  r.get(a.cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync", "cuMemcpyDtoDAsync_v2");
  // Introduced with size_t counts (CUDA 3.2), so never renamed to _v2.
  r.get(a.cuMemsetD8Async, "cuMemsetD8Async", "cuMemsetD8Async");
  r.get(a.cuStreamCreate, "cuStreamCreate", "cuStreamCreate");
  r.get(a.cuStreamDestroy, "cuStreamDestroy", "cuStreamDestroy_v2");
  r.get(a.cuStreamSynchronize, "cuStreamSynchronize", "cuStreamSynchronize");
  r.get(a.cuStreamIsCapturing, "cuStreamIsCapturing", "cuStreamIsCapturing");
  r.get(a.cuStreamBeginCapture, "cuStreamBeginCapture", "cuStreamBeginCapture_v2");
  r.get(a.cuStreamEndCapture, "cuStreamEndCapture", "cuStreamEndCapture");
  // By its own name: "cuGraphInstantiate" is also the legacy 5-argument ABI
  // (cuGraphInstantiate_v2 in cuda.h 12+), and the 3-argument form is unambiguous.
  r.get(a.cuGraphInstantiate, "cuGraphInstantiateWithFlags", "cuGraphInstantiateWithFlags");
  r.get(a.cuGraphLaunch, "cuGraphLaunch", "cuGraphLaunch");
  r.get(a.cuGraphExecDestroy, "cuGraphExecDestroy", "cuGraphExecDestroy");
  r.get(a.cuGraphDestroy, "cuGraphDestroy", "cuGraphDestroy");
  r.get(a.cuEventCreate, "cuEventCreate", "cuEventCreate");
  r.get(a.cuEventRecord, "cuEventRecord", "cuEventRecord");
  r.get(a.cuEventSynchronize, "cuEventSynchronize", "cuEventSynchronize");
  // For 12.0 cuGetProcAddress returns the original; _v2 (12.8) has the same signature.
  r.get(a.cuEventElapsedTime, "cuEventElapsedTime", "cuEventElapsedTime");
  r.get(a.cuEventDestroy, "cuEventDestroy", "cuEventDestroy_v2");

  if (!r.first_missing().empty()) {
    s.status.reason = "no CUDA driver (missing " + r.first_missing() + " in " + path +
                      ", driver version " + std::to_string(driver_version) +
                      "; install an NVIDIA driver for CUDA 12 or newer)";
    s.api = DriverApi{};
    return s;
  }
  s.status.ok = true;
  return s;
}

const DriverState& driver_state() {
  // A function-local static: initialized exactly once, thread-safe (C++11).
  static const DriverState state = load_driver();
  return state;
}

// ---------------------------------------------------------------- NVRTC

struct NvrtcState {
  NvrtcApi api{};
  Loaded status;
  std::pair<int, int> version{0, 0};
};

bool is_directory(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The files to try, in the order cuda_api.hpp documents.
std::vector<std::string> nvrtc_candidates(const std::string& override_path) {
  if (!override_path.empty()) return {override_path};
  // Newest first: a directory holding both majors (rare) gets the newer NVRTC.
  static const char* const kNames[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
  return toolkit_library_candidates("STEPFUSE_NVRTC_PATH", kNames);
}

// Fills `a` from an open libnvrtc; returns the first missing symbol, or "" when complete.
std::string resolve_nvrtc(void* lib, NvrtcApi& a) {
  std::string missing;
  auto get = [&](auto& slot, const char* name) { resolve_symbol(lib, slot, name, missing); };
  get(a.nvrtcVersion, "nvrtcVersion");
  get(a.nvrtcGetErrorString, "nvrtcGetErrorString");
  get(a.nvrtcGetNumSupportedArchs, "nvrtcGetNumSupportedArchs");
  get(a.nvrtcGetSupportedArchs, "nvrtcGetSupportedArchs");
  get(a.nvrtcCreateProgram, "nvrtcCreateProgram");
  get(a.nvrtcDestroyProgram, "nvrtcDestroyProgram");
  get(a.nvrtcCompileProgram, "nvrtcCompileProgram");
  get(a.nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize");
  get(a.nvrtcGetProgramLog, "nvrtcGetProgramLog");
  get(a.nvrtcGetPTXSize, "nvrtcGetPTXSize");
  get(a.nvrtcGetPTX, "nvrtcGetPTX");
  get(a.nvrtcGetCUBINSize, "nvrtcGetCUBINSize");
  get(a.nvrtcGetCUBIN, "nvrtcGetCUBIN");
  return missing;
}

NvrtcState load_nvrtc() {
  NvrtcState s;
  std::string override_path;
  {
    auto& tp = test_paths();
    std::lock_guard lock(tp.mutex);
    tp.nvrtc_started = true;
    override_path = tp.libnvrtc;
  }
  std::string tried;
  for (const std::string& path : nvrtc_candidates(override_path)) {
    if (!tried.empty()) tried += ", ";
    tried += path;
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      // A file that exists but does not load (wrong architecture, a missing
      // dependency) is worth the detail; "no such file" for each path is not.
      std::string err = dl_error_text();
      if (err.find("No such file") == std::string::npos) tried += " [" + err + "]";
      continue;
    }
    NvrtcApi a{};
    if (std::string missing = resolve_nvrtc(lib, a); !missing.empty()) {
      tried += " [no " + missing + "]";
      dlclose(lib);
      continue;
    }
    int major = 0, minor = 0;
    if (a.nvrtcVersion(&major, &minor) != NVRTC_SUCCESS) {
      tried += " [nvrtcVersion failed]";
      dlclose(lib);
      continue;
    }
    s.api = a;
    s.version = {major, minor};
    s.status.ok = true;
    return s;
  }
  s.status.reason = "NVRTC not found (tried: " + tried +
                    "); install the CUDA toolkit's NVRTC or set STEPFUSE_NVRTC_PATH to libnvrtc.so or its directory";
  return s;
}

const NvrtcState& nvrtc_state() {
  static const NvrtcState state = load_nvrtc();
  return state;
}

}  // namespace

void* library_symbol(void* lib, const char* name, std::string& missing, bool required) {
  void* p = dlsym(lib, name);
  if (p == nullptr && required && missing.empty()) missing = name;
  return p;
}

std::vector<std::string> toolkit_library_candidates(const char* env_var, std::span<const char* const> names) {
  std::vector<std::string> out;
  auto add = [&out](std::string p) {
    if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(std::move(p));
  };
  auto add_dir = [&add, names](std::string dir) {
    if (!dir.empty() && dir.back() == '/') dir.pop_back();
    for (const char* n : names) add(dir + "/" + n);
  };
  if (const char* env = std::getenv(env_var); env && *env) {
    if (is_directory(env)) {
      add_dir(env);
    } else {
      add(env);
    }
  }
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
    if (const char* env = std::getenv(var); env && *env) add_dir(std::string(env) + "/lib64");
  }
  add_dir("/usr/local/cuda/lib64");
  // Bare names: the loader's search (LD_LIBRARY_PATH, ld.so.cache, RUNPATH).
  for (const char* n : names) add(n);
  return out;
}

const DriverApi* driver() {
  const DriverState& s = driver_state();
  return s.status.ok ? &s.api : nullptr;
}

const Loaded& driver_status() { return driver_state().status; }

const NvrtcApi* nvrtc() {
  const NvrtcState& s = nvrtc_state();
  return s.status.ok ? &s.api : nullptr;
}

const Loaded& nvrtc_status() { return nvrtc_state().status; }

std::pair<int, int> nvrtc_version() { return nvrtc_state().version; }

void check(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  // Without a loaded driver an empty table makes cu_result_text use its fallback names.
  const DriverApi* api = driver();
  throw Error(ErrorCode::device_error,
              std::string(what) + ": " + cu_result_text(api ? *api : DriverApi{}, result));
}

bool report(CUresult result, const char* what) noexcept {
  if (result == CUDA_SUCCESS) return true;
  try {
    const DriverApi* api = driver();
    const std::string text = cu_result_text(api ? *api : DriverApi{}, result);
    detail::warn_once(std::string("cuda_release:") + what + ":" + std::to_string(result),
                      std::string(what) + " failed while releasing CUDA resources: " + text +
                          " (ignored: a destructor cannot report it otherwise; the device may be in a bad state)");
  } catch (...) {
    // Out of memory for the message: nothing more can be done from a destructor.
  }
  return false;
}

void report_exception(const std::exception& e) noexcept {
  try {
    detail::warn_once(std::string("cuda_release:") + e.what(),
                      std::string(e.what()) +
                          " (while releasing CUDA resources; ignored: a destructor cannot report it otherwise; the "
                          "device may be in a bad state)");
  } catch (...) {
  }
}

void check_nvrtc(nvrtcResult result, const char* what) {
  if (result == NVRTC_SUCCESS) return;
  const NvrtcApi* api = nvrtc();
  const char* text = api ? api->nvrtcGetErrorString(result) : nullptr;
  const std::string message =
      std::string(what) + ": " + (text ? text : "nvrtcResult " + std::to_string(result));
  throw Error(result == kNvrtcErrorCompilation ? ErrorCode::compile_failed : ErrorCode::device_error, message);
}

void set_driver_for_testing(const DriverApi& api) {
  auto& tp = test_paths();
  std::lock_guard lock(tp.mutex);
  if (tp.driver_started)
    throw Error(ErrorCode::invalid_state,
                "set_driver_for_testing: the driver table is already loaded in this process; call it before the "
                "first driver() use (e.g. from a static initializer)");
  tp.fake_driver = api;
}

void set_library_paths_for_testing(const std::string& libcuda, const std::string& libnvrtc) {
  auto& tp = test_paths();
  std::lock_guard lock(tp.mutex);
  if ((!libcuda.empty() && tp.driver_started) || (!libnvrtc.empty() && tp.nvrtc_started)) {
    throw Error(ErrorCode::invalid_state,
                "set_library_paths_for_testing: the library concerned is already loaded in this process; "
                "call it before the first driver()/nvrtc() use (e.g. in a fresh child process)");
  }
  tp.libcuda = libcuda;
  tp.libnvrtc = libnvrtc;
}

}  // namespace stepfuse::cuda
