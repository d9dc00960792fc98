// The CUDA Driver API and NVRTC, loaded lazily at run time.
//
// stepfuse links neither libcuda nor libnvrtc: every cu* and nvrtc* call goes
// through the two function tables below, filled on first use with dlopen
// (libcuda.so.1; libnvrtc from STEPFUSE_NVRTC_PATH, the CUDA install, or the
// loader path) and, for the driver, cuGetProcAddress, which returns the
// versioned entry point (cuMemAlloc_v2, ...) for a base name. The library so
// builds, links and runs its CPU path on machines with no CUDA at all.
//
// The types are declared here with the Driver API's ABI, so building needs no
// CUDA headers either.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace stepfuse::cuda {

// ---- Driver API types (ABI-compatible with cuda.h) ----
using CUresult = int;
inline constexpr CUresult CUDA_SUCCESS = 0;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUgraph = struct CUgraph_st*;
using CUgraphExec = struct CUgraphExec_st*;

// cuDeviceGetAttribute attributes used here (values from cuda.h).
inline constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97;
inline constexpr int CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 95;
// cuPointerGetAttribute: the memory type of a pointer (CU_MEMORYTYPE_*).
inline constexpr int CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2;
inline constexpr unsigned CU_MEMORYTYPE_HOST = 1;
inline constexpr unsigned CU_MEMORYTYPE_DEVICE = 2;
inline constexpr unsigned CU_MEMORYTYPE_UNIFIED = 4;
// cuStreamBeginCapture modes.
inline constexpr int CU_STREAM_CAPTURE_MODE_GLOBAL = 0;
inline constexpr int CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1;
inline constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;
// cuStreamIsCapturing results.
inline constexpr int CU_STREAM_CAPTURE_STATUS_NONE = 0;
inline constexpr int CU_STREAM_CAPTURE_STATUS_ACTIVE = 1;
// cuStreamCreate flags.
inline constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
// cuModuleLoadDataEx options.
inline constexpr int CU_JIT_INFO_LOG_BUFFER = 3;
inline constexpr int CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES = 4;
inline constexpr int CU_JIT_ERROR_LOG_BUFFER = 5;
inline constexpr int CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6;

// The driver entry points stepfuse uses. Each is fetched by base name with
// cuGetProcAddress for CUDA 12.0 (or the driver's version if older), which picks
// the ABI that cuda.h 12.x/13.x declares: cuMemAlloc -> cuMemAlloc_v2,
// cuStreamBeginCapture -> _v2 (with a mode), cuDevicePrimaryCtxRelease -> _v2.
// Two differ from a plain base-name lookup: cuGraphInstantiate is fetched as
// "cuGraphInstantiateWithFlags" (the 3-argument form cuda.h 12+ maps it to; the
// name "cuGraphInstantiate" also denotes the legacy 5-argument ABI), and
// cuEventElapsedTime is the original entry point (cuda.h 13 maps the name to
// cuEventElapsedTime_v2 from CUDA 12.8, with the same signature).
// Every member is non-null in a loaded table: each is required, so list only
// what stepfuse calls. The signatures must match cuda.h; the enum parameters are int.
struct DriverApi {
  CUresult (*cuInit)(unsigned flags);
  CUresult (*cuDriverGetVersion)(int* version);
  CUresult (*cuGetErrorName)(CUresult error, const char** name);
  CUresult (*cuGetErrorString)(CUresult error, const char** text);
  CUresult (*cuDeviceGetCount)(int* count);
  CUresult (*cuDeviceGet)(CUdevice* device, int ordinal);
  CUresult (*cuDeviceGetName)(char* name, int len, CUdevice device);
  CUresult (*cuDeviceGetAttribute)(int* value, int attribute, CUdevice device);
  CUresult (*cuDeviceTotalMem)(std::size_t* bytes, CUdevice device);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext* ctx, CUdevice device);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice device);
  CUresult (*cuCtxSetCurrent)(CUcontext ctx);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuModuleLoadDataEx)(CUmodule* module, const void* image, unsigned num_options, int* options,
                                 void** values);
  CUresult (*cuModuleUnload)(CUmodule module);
  CUresult (*cuModuleGetFunction)(CUfunction* fn, CUmodule module, const char* name);
  CUresult (*cuLaunchKernel)(CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz, unsigned shared_bytes, CUstream stream, void** params, void** extra);
  CUresult (*cuMemAlloc)(CUdeviceptr* ptr, std::size_t bytes);
  CUresult (*cuMemFree)(CUdeviceptr ptr);
  CUresult (*cuPointerGetAttribute)(void* data, int attribute, CUdeviceptr ptr);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr dst, const void* src, std::size_t bytes);
  CUresult (*cuMemcpyDtoH)(void* dst, CUdeviceptr src, std::size_t bytes);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr dst, const void* src, std::size_t bytes, CUstream stream);
  CUresult (*cuMemcpyDtoHAsync)(void* dst, CUdeviceptr src, std::size_t bytes, CUstream stream);
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr dst, CUdeviceptr src, std::size_t bytes, CUstream stream);
  CUresult (*cuMemsetD8Async)(CUdeviceptr dst, unsigned char value, std::size_t n, CUstream stream);
  CUresult (*cuStreamCreate)(CUstream* stream, unsigned flags);
  CUresult (*cuStreamDestroy)(CUstream stream);
  CUresult (*cuStreamSynchronize)(CUstream stream);
  CUresult (*cuStreamIsCapturing)(CUstream stream, int* status);
  CUresult (*cuStreamBeginCapture)(CUstream stream, int mode);
  CUresult (*cuStreamEndCapture)(CUstream stream, CUgraph* graph);
  CUresult (*cuGraphInstantiate)(CUgraphExec* exec, CUgraph graph, unsigned long long flags);
  CUresult (*cuGraphLaunch)(CUgraphExec exec, CUstream stream);
  CUresult (*cuGraphExecDestroy)(CUgraphExec exec);
  CUresult (*cuGraphDestroy)(CUgraph graph);
  CUresult (*cuEventCreate)(CUevent* event, unsigned flags);
  CUresult (*cuEventRecord)(CUevent event, CUstream stream);
  CUresult (*cuEventSynchronize)(CUevent event);
  CUresult (*cuEventElapsedTime)(float* ms, CUevent start, CUevent end);
  CUresult (*cuEventDestroy)(CUevent event);
};

// ---- NVRTC ----
using nvrtcResult = int;
inline constexpr nvrtcResult NVRTC_SUCCESS = 0;
using nvrtcProgram = struct _nvrtcProgram*;

struct NvrtcApi {
  nvrtcResult (*nvrtcVersion)(int* major, int* minor);
  const char* (*nvrtcGetErrorString)(nvrtcResult result);
  nvrtcResult (*nvrtcGetNumSupportedArchs)(int* count);
  nvrtcResult (*nvrtcGetSupportedArchs)(int* archs);
  nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram* prog, const char* src, const char* name, int num_headers,
                                    const char* const* headers, const char* const* include_names);
  nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram* prog);
  nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram prog, int num_options, const char* const* options);
  nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram prog, std::size_t* size);
  nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram prog, char* log);
  nvrtcResult (*nvrtcGetPTXSize)(nvrtcProgram prog, std::size_t* size);
  nvrtcResult (*nvrtcGetPTX)(nvrtcProgram prog, char* ptx);
  nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram prog, std::size_t* size);
  nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram prog, char* cubin);
};

// Why a table is or is not usable. `reason` is empty when ok, else one of
// "no CUDA driver (...)", "NVRTC not found (...)", "no device (...)", with the
// details in parentheses (the dlopen error, the CUresult name, ...).
struct Loaded {
  bool ok = false;
  std::string reason;
};

// The driver table, or nullptr when libcuda.so.1 cannot be loaded or cuInit
// fails; driver_status() says why ("no device (cuInit: CUDA_ERROR_NO_DEVICE...)"
// when a driver is installed but sees no GPU). Loaded once (thread-safe); never unloaded.
const DriverApi* driver();
const Loaded& driver_status();

// The NVRTC table, or nullptr; nvrtc_status() says why (and which paths were tried).
// Search order: $STEPFUSE_NVRTC_PATH (a file or a directory), $CUDA_HOME/lib64,
// $CUDA_PATH/lib64, /usr/local/cuda/lib64, then the loader path (libnvrtc.so.13,
// .so.12, .so).
const NvrtcApi* nvrtc();
const Loaded& nvrtc_status();
// (major, minor) of the loaded NVRTC, e.g. {13, 0}; {0, 0} when not loaded.
std::pair<int, int> nvrtc_version();

// The files to try when loading a library of the CUDA toolkit (NVRTC, NCCL), in order,
// without duplicates: $<env_var> (a file, or a directory holding one of `names`), then
// each name in $CUDA_HOME/lib64, $CUDA_PATH/lib64 and /usr/local/cuda/lib64, then the
// bare names (the loader's search: LD_LIBRARY_PATH, ld.so.cache, RUNPATH).
std::vector<std::string> toolkit_library_candidates(const char* env_var, std::span<const char* const> names);

// dlsym(lib, name) into `slot` (nullptr when absent); the first absent required name
// goes into `missing` when that is still empty. For filling a function table.
void* library_symbol(void* lib, const char* name, std::string& missing, bool required);
template <class Fn>
void resolve_symbol(void* lib, Fn*& slot, const char* name, std::string& missing, bool required = true) {
  // POSIX guarantees a dlsym result converts to a function pointer.
  slot = reinterpret_cast<Fn*>(library_symbol(lib, name, missing, required));
}

// Throws Error(device_error) "<what>: <CUresult name>: <description>" unless ok.
void check(CUresult result, const char* what);
// For destructors, which must not throw: true when ok; otherwise sends "<what> failed
// while releasing CUDA resources: <CUresult name>: <description>" to the warning
// handler (once per call and result in the process) and returns false. Never throws.
bool report(CUresult result, const char* what) noexcept;
// The same for an Error a destructor caught from a call that throws (cuda::check's
// message names the call and the CUresult). Never throws.
void report_exception(const std::exception& e) noexcept;
// Throws Error(device_error) "<what>: <nvrtcGetErrorString>" unless ok; NVRTC_ERROR_COMPILATION
// gives Error(compile_failed) (nvrtc_compile reports compile errors itself, with the log).
void check_nvrtc(nvrtcResult result, const char* what);

// For tests without a GPU: driver() returns this table (status ok) instead of loading
// libcuda. Only before the first driver() use; afterwards throws Error(invalid_state).
void set_driver_for_testing(const DriverApi& api);

// For tests: load the tables from these paths instead (empty = default search).
// Only before the first use of the table concerned; afterwards throws Error(invalid_state).
void set_library_paths_for_testing(const std::string& libcuda, const std::string& libnvrtc);

}  // namespace stepfuse::cuda
