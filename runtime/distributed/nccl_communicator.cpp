// The NCCL Communicator (include/stepfuse/nccl.hpp): libnccl loaded with dlopen.
#include <dlfcn.h>

#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "jit/base/cuda_api.hpp"
#include "nccl_api.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {
namespace detail {
namespace {

constexpr int kMinVersion = 21000;  // 2.10: ncclBfloat16
constexpr const char* kSoname = "libnccl.so.2";

std::string version_text(int code) {
  // NCCL_VERSION(X, Y, Z): X * 10000 + Y * 100 + Z from 2.9 on (X * 1000 + Y * 100 + Z before).
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code / 100 % 100 : code / 100 % 10;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

// Fills `a` from an open libnccl; returns the first missing required symbol, or "".
std::string resolve(void* lib, NcclApi& a) {
  std::string missing;
  auto get = [&](auto& slot, const char* name, bool required = true) {
    cuda::resolve_symbol(lib, slot, name, missing, required);
  };
  get(a.ncclGetVersion, "ncclGetVersion");
  get(a.ncclGetErrorString, "ncclGetErrorString");
  get(a.ncclGetLastError, "ncclGetLastError", false);
  get(a.ncclCommCount, "ncclCommCount");
  get(a.ncclCommUserRank, "ncclCommUserRank");
  get(a.ncclCommCuDevice, "ncclCommCuDevice");
  get(a.ncclAllGather, "ncclAllGather");
  get(a.ncclAllReduce, "ncclAllReduce");
  get(a.ncclReduceScatter, "ncclReduceScatter");
  return missing;
}

// Takes `lib` when it is a usable NCCL; else closes it and says why in `tried`.
bool accept(void* lib, const std::string& path, NcclLibrary& out, std::string& tried) {
  NcclApi a{};
  std::string why;
  int version = 0;
  if (std::string missing = resolve(lib, a); !missing.empty()) {
    why = "no " + missing;
  } else if (a.ncclGetVersion(&version) != kNcclSuccess) {
    why = "ncclGetVersion failed";
  } else if (version < kMinVersion) {
    why = "NCCL " + version_text(version) + ", older than 2.10";
  }
  if (!why.empty()) {
    tried += " [" + why + "]";
    dlclose(lib);
    return false;
  }
  out.api = a;
  out.handle = lib;
  out.version = version;
  out.path = path;
  out.error.clear();
  return true;
}

const char* dl_error_text() {
  const char* e = dlerror();
  return e ? e : "unknown dlopen error";
}

}  // namespace

NcclLibrary open_nccl(const std::vector<std::string>& candidates, bool prefer_loaded) {
  NcclLibrary out;
  std::string tried;
  if (prefer_loaded) {
    // A libnccl.so.2 already in the process (PyTorch's, the application's): the comm
    // the caller passes was made by it, so no other copy may be used.
    if (void* lib = dlopen(kSoname, RTLD_NOW | RTLD_NOLOAD)) {
      tried = std::string("the loaded ") + kSoname;
      if (accept(lib, kSoname, out, tried)) return out;
      out.error = "the process has loaded " + std::string(kSoname) + " but it is not usable (" + tried +
                  "); stepfuse must use the NCCL that made the communicator";
      return out;
    }
  }
  for (const std::string& path : candidates) {
    if (!tried.empty()) tried += ", ";
    tried += path;
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      // A file that exists but does not load is worth the detail; "no such file" is not.
      const std::string err = dl_error_text();
      if (err.find("No such file") == std::string::npos) tried += " [" + err + "]";
      continue;
    }
    if (accept(lib, path, out, tried)) return out;
  }
  out.error = "NCCL not found (tried: " + tried +
              "); install NCCL 2.10 or newer (the CUDA toolkit's libnccl.so.2, or the nvidia-nccl-cu* wheel) or set "
              "STEPFUSE_NCCL_PATH to libnccl.so.2 or its directory";
  return out;
}

const NcclLibrary& nccl_library_loaded() {
  static const NcclLibrary library = [] {
    static const char* const kNames[] = {kSoname};
    return open_nccl(cuda::toolkit_library_candidates("STEPFUSE_NCCL_PATH", kNames), /*prefer_loaded=*/true);
  }();
  if (!library.error.empty()) throw Error(ErrorCode::device_error, "nccl: " + library.error);
  return library;
}

namespace {

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclLibrary& library, ncclComm_t comm, CUstream stream)
      : nccl_(library.api), comm_(comm), stream_(stream) {
    if (comm == nullptr)
      throw Error(ErrorCode::invalid_argument,
                  "nccl_communicator: comm is null (pass the ncclComm_t that ncclCommInitRank made)");
    check(nccl_.ncclCommCount(comm, &size_), "ncclCommCount", "");
    check(nccl_.ncclCommUserRank(comm, &rank_), "ncclCommUserRank", "");
    check(nccl_.ncclCommCuDevice(comm, &device_), "ncclCommCuDevice", "");
    if (size_ < 1 || rank_ < 0 || rank_ >= size_ || device_ < 0)
      throw Error(ErrorCode::invalid_argument, "nccl_communicator: NCCL reports rank " + std::to_string(rank_) + " of " +
                                                   std::to_string(size_) + " on device " + std::to_string(device_) +
                                                   " (is comm an initialized, not yet destroyed ncclComm_t?)");
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda(device_); }
  void* cuda_stream() const override { return stream_; }
  std::string_view name() const override { return "nccl"; }

  void all_gather(const void* send, void* recv, std::size_t count, CommType type) override {
    if (count == 0) return;
    const int t = nccl_type(type, "all_gather");
    check_buffers(send, recv, "all_gather");
    check(nccl_.ncclAllGather(send, recv, count, t, comm_, stream_), "ncclAllGather", describe(count, type));
  }
  void all_reduce(void* data, std::size_t count, CommType type, ReduceOp op) override {
    if (count == 0) return;
    const int t = nccl_type(type, "all_reduce");
    const int o = nccl_op(op, "all_reduce");
    check_buffers(data, data, "all_reduce");
    check(nccl_.ncclAllReduce(data, data, count, t, o, comm_, stream_), "ncclAllReduce", describe(count, type));
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, CommType type, ReduceOp op) override {
    if (count == 0) return;
    const int t = nccl_type(type, "reduce_scatter");
    const int o = nccl_op(op, "reduce_scatter");
    check_buffers(send, recv, "reduce_scatter");
    check(nccl_.ncclReduceScatter(send, recv, count, t, o, comm_, stream_), "ncclReduceScatter",
          describe(count, type));
  }

 private:
  static int nccl_type(CommType type, const char* call) {
    switch (type) {
      case CommType::u8: return kNcclUint8;
      case CommType::i32: return kNcclInt32;
      case CommType::i64: return kNcclInt64;
      case CommType::f16: return kNcclFloat16;
      case CommType::bf16: return kNcclBfloat16;
      case CommType::f32: return kNcclFloat32;
      case CommType::f64: return kNcclFloat64;
    }
    throw Error(ErrorCode::invalid_argument, std::string("nccl: ") + call + ": unknown CommType " +
                                                 std::to_string(static_cast<int>(type)));
  }
  static int nccl_op(ReduceOp op, const char* call) {
    switch (op) {
      case ReduceOp::sum: return kNcclSum;
      case ReduceOp::max: return kNcclMax;
      case ReduceOp::min: return kNcclMin;
    }
    throw Error(ErrorCode::invalid_argument, std::string("nccl: ") + call + ": unknown ReduceOp " +
                                                 std::to_string(static_cast<int>(op)));
  }
  static void check_buffers(const void* send, const void* recv, const char* call) {
    if (send == nullptr || recv == nullptr)
      throw Error(ErrorCode::invalid_argument, std::string("nccl: ") + call + ": a null buffer with a count above 0");
  }
  static std::string describe(std::size_t count, CommType type) {
    return std::to_string(count) + " " + std::string(comm_type_name(type)) + " per rank";
  }
  // Error(device_error) "nccl: <call> (<what>) failed: <ncclGetErrorString> (<ncclGetLastError>)".
  void check(NcclResult rc, const char* call, const std::string& what) const {
    if (rc == kNcclSuccess) return;
    std::string message = std::string("nccl: ") + call;
    if (!what.empty()) message += " (" + what + ")";
    const char* text = nccl_.ncclGetErrorString(rc);
    message += " failed: " + std::string(text ? text : "NCCL error " + std::to_string(rc));
    if (nccl_.ncclGetLastError != nullptr)
      if (const char* last = nccl_.ncclGetLastError(comm_); last != nullptr && *last != '\0')
        message += " (" + std::string(last) + ")";
    throw Error(rc == kNcclInvalidArgument ? ErrorCode::invalid_argument : ErrorCode::device_error, message);
  }

  const NcclApi& nccl_;
  ncclComm_t comm_;
  CUstream stream_;
  int rank_ = 0, size_ = 0, device_ = 0;
};

}  // namespace

std::shared_ptr<Communicator> nccl_communicator_with(const NcclLibrary& library, ncclComm_t comm, CUstream stream) {
  if (!library.error.empty()) throw Error(ErrorCode::device_error, "nccl: " + library.error);
  return std::make_shared<NcclCommunicator>(library, comm, stream);
}

}  // namespace detail

std::shared_ptr<Communicator> nccl_communicator(ncclComm_t comm, CUstream stream) {
  return detail::nccl_communicator_with(detail::nccl_library_loaded(), comm, stream);
}

std::string nccl_library() {
  const detail::NcclLibrary& library = detail::nccl_library_loaded();
  return library.path + " " + detail::version_text(library.version);
}

}  // namespace stepfuse
