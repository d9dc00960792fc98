// The lazily loaded CUDA driver and NVRTC tables, cuda_available(), and NVRTC
// compilation. Runs without a GPU (the driver checks then pin the "no CUDA
// driver" path) and without the toolkit (the NVRTC tests skip); on a GPU machine
// it also loads and runs a compiled kernel through the driver table.
#include <gmock/gmock-matchers.h>  // header-only matchers: HasSubstr
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "jit/cuda/nvrtc_compile.hpp"
#include "jit/base/cuda_api.hpp"
#include "reference/test_util.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/stepfuse.hpp"

extern char** environ;  // POSIX: the process environment, copied into the child's

namespace {

using namespace stepfuse;
using ::testing::HasSubstr;
using ref::thrown_text;
using jit::CudaOutput;
using jit::CudaTarget;

// ---- Child processes --------------------------------------------------------
// The tables load once per process, so each check of a load failure runs in a
// fresh copy of this binary. The child does its work in a static initializer,
// before gtest's main, and exits: it never runs (or lists) any test.
constexpr const char* kChildEnv = "STEPFUSE_LOADER_TEST_CHILD";        // "driver" or "nvrtc"
constexpr const char* kChildPathEnv = "STEPFUSE_LOADER_TEST_CHILD_PATH";  // the library to load

[[maybe_unused]] const bool kRanAsChild = [] {
  const char* mode = std::getenv(kChildEnv);
  if (!mode) return false;
  const char* path = std::getenv(kChildPathEnv);
  const bool for_driver = std::strcmp(mode, "driver") == 0;
  const std::string lib = path ? path : "";
  cuda::set_library_paths_for_testing(for_driver ? lib : "", for_driver ? "" : lib);
  const bool loaded = for_driver ? cuda::driver() != nullptr : cuda::nvrtc() != nullptr;
  const cuda::Loaded& status = for_driver ? cuda::driver_status() : cuda::nvrtc_status();
  // The public queries must report the same failure, not throw.
  const CudaStatus pub = for_driver ? cuda_available() : nvrtc_available();
  std::printf("loaded=%d\nok=%d\nreason=%s\npublic_available=%d\npublic_reason=%s\n", loaded ? 1 : 0,
              status.ok ? 1 : 0, status.reason.c_str(), pub.available ? 1 : 0, pub.reason.c_str());
  std::fflush(stdout);
  std::_Exit(0);
}();

struct ChildResult {
  int exit_status = -1;
  std::string out;
  std::string field(const std::string& key) const {
    const std::string prefix = key + "=";
    std::size_t pos = 0;
    while (pos < out.size()) {
      std::size_t end = out.find('\n', pos);
      if (end == std::string::npos) end = out.size();
      if (out.compare(pos, prefix.size(), prefix) == 0) return out.substr(pos + prefix.size(), end - pos - prefix.size());
      pos = end + 1;
    }
    return "<missing " + key + ">";
  }
};

// Runs this binary again with the child environment; returns its stdout and exit status.
ChildResult run_child(const std::string& mode, const std::string& path) {
  std::vector<std::string> env_strings = {std::string(kChildEnv) + "=" + mode,
                                          std::string(kChildPathEnv) + "=" + path};
  for (char** e = environ; *e; ++e) {
    if (std::strncmp(*e, kChildEnv, std::strlen(kChildEnv)) != 0) env_strings.emplace_back(*e);
  }
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string self = "/proc/self/exe";
  char* argv[] = {self.data(), nullptr};

  int fds[2];
  ChildResult result;
  if (pipe(fds) != 0) return result;
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    execve("/proc/self/exe", argv, envp.data());
    _exit(127);
  }
  close(fds[1]);
  if (pid < 0) {
    close(fds[0]);
    return result;
  }
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) result.out.append(buf, static_cast<std::size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  result.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

bool file_exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

#define REQUIRE_NVRTC()                                                            \
  do {                                                                             \
    if (!cuda::nvrtc()) GTEST_SKIP() << "no NVRTC: " << cuda::nvrtc_status().reason; \
  } while (0)

// A small self-contained kernel: a __device__ helper, no #include. The helper
// computes a*x + y as two operations, so with --fmad=false it must not become an FMA.
const std::string kSaxpy = R"(__device__ float axpy(float a, float x, float y) { return a * x + y; }

extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = axpy(a, x[i], y[i]);
}
)";

bool is_elf(const std::string& bytes) { return bytes.size() > 4 && bytes.compare(0, 4, "\x7f" "ELF") == 0; }

// ---- NVRTC ------------------------------------------------------------------

TEST(NvrtcLoader, LoadsAndReportsVersion) {
  REQUIRE_NVRTC();
  EXPECT_TRUE(cuda::nvrtc_status().ok);
  EXPECT_TRUE(cuda::nvrtc_status().reason.empty());
  const auto [major, minor] = cuda::nvrtc_version();
  EXPECT_GE(major, 12);
  EXPECT_GE(minor, 0);
  EXPECT_EQ(jit::nvrtc_version_string(), std::to_string(major) + "." + std::to_string(minor));

  const CudaStatus s = nvrtc_available();
  EXPECT_TRUE(s.available);
  EXPECT_TRUE(s.reason.empty());
  EXPECT_EQ(s.nvrtc_major, major);
  EXPECT_EQ(s.nvrtc_minor, minor);
}

TEST(NvrtcLoader, SupportedArchsAscendingWithAmpereAndHopper) {
  REQUIRE_NVRTC();
  const std::vector<int> archs = jit::nvrtc_supported_archs();
  ASSERT_FALSE(archs.empty());
  EXPECT_TRUE(std::is_sorted(archs.begin(), archs.end()));
  EXPECT_NE(std::find(archs.begin(), archs.end(), 80), archs.end());
  EXPECT_NE(std::find(archs.begin(), archs.end(), 90), archs.end());
}

TEST(NvrtcCompile, OptionsAreExactAndIeee) {
  const std::vector<std::string> expected_tail = {"--fmad=false", "-ftz=false", "-prec-div=true",
                                                  "-prec-sqrt=true", "-std=c++17", "-minimal"};
  std::vector<std::string> cubin = {"-arch=sm_90"};
  cubin.insert(cubin.end(), expected_tail.begin(), expected_tail.end());
  EXPECT_EQ(jit::nvrtc_options({90, CudaOutput::cubin}), cubin);
  std::vector<std::string> ptx = {"-arch=compute_80"};
  ptx.insert(ptx.end(), expected_tail.begin(), expected_tail.end());
  EXPECT_EQ(jit::nvrtc_options({80, CudaOutput::ptx}), ptx);
  EXPECT_EQ(jit::arch_name({86, CudaOutput::cubin}), "sm_86");
  EXPECT_EQ(jit::arch_name({121, CudaOutput::ptx}), "compute_121");
}

TEST(NvrtcCompile, NumberedSource) {
  EXPECT_EQ(jit::numbered_source("a\nbb\n"), "   1| a\n   2| bb\n");
  EXPECT_EQ(jit::numbered_source("a\n\nc"), "   1| a\n   2| \n   3| c\n");
  EXPECT_EQ(jit::numbered_source(""), "");
}

TEST(NvrtcCompile, CubinForSm80AndSm90) {
  REQUIRE_NVRTC();
  for (int sm : {80, 90}) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string cubin = jit::nvrtc_compile(kSaxpy, "saxpy.cu", {sm, CudaOutput::cubin});
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    RecordProperty("compile_ms_sm" + std::to_string(sm), std::to_string(ms));
    EXPECT_TRUE(is_elf(cubin)) << "sm_" << sm << ": " << cubin.size() << " bytes, not an ELF image";
    // The kernel's name is in the image's symbol table (extern "C": unmangled).
    EXPECT_NE(cubin.find("saxpy"), std::string::npos);
  }
}

TEST(NvrtcCompile, PtxForCompute90HonoursFmadFalse) {
  REQUIRE_NVRTC();
  const std::string ptx = jit::nvrtc_compile(kSaxpy, "saxpy.cu", {90, CudaOutput::ptx});
  EXPECT_FALSE(is_elf(ptx));
  EXPECT_NE(ptx.find(".version"), std::string::npos);
  EXPECT_NE(ptx.find(".target sm_90"), std::string::npos);
  EXPECT_NE(ptx.find(".entry saxpy"), std::string::npos);
  EXPECT_EQ(ptx.find('\0'), std::string::npos) << "PTX returned with its NUL terminator";
  // --fmad=false: the product and the sum are rounded separately.
  EXPECT_NE(ptx.find("mul.rn.f32"), std::string::npos) << ptx;
  EXPECT_NE(ptx.find("add.rn.f32"), std::string::npos) << ptx;
  EXPECT_EQ(ptx.find("fma.rn.f32"), std::string::npos) << ptx;

  // Control: the same source with NVRTC's default (--fmad=true) contracts to an
  // FMA, so the assertions above do detect a dropped option.
  const cuda::NvrtcApi& api = *cuda::nvrtc();
  cuda::nvrtcProgram prog = nullptr;
  cuda::check_nvrtc(api.nvrtcCreateProgram(&prog, kSaxpy.c_str(), "saxpy_fmad.cu", 0, nullptr, nullptr),
                    "nvrtcCreateProgram");
  const char* opts[] = {"-arch=compute_90"};
  cuda::check_nvrtc(api.nvrtcCompileProgram(prog, 1, opts), "nvrtcCompileProgram");
  std::size_t size = 0;
  cuda::check_nvrtc(api.nvrtcGetPTXSize(prog, &size), "nvrtcGetPTXSize");
  std::string fused(size, '\0');
  cuda::check_nvrtc(api.nvrtcGetPTX(prog, fused.data()), "nvrtcGetPTX");
  api.nvrtcDestroyProgram(&prog);
  EXPECT_NE(fused.find("fma.rn.f32"), std::string::npos) << fused;
}

TEST(NvrtcCompile, SyntaxErrorCarriesLogAndNumberedSource) {
  REQUIRE_NVRTC();
  const std::string bad =
      "extern \"C\" __global__ void broken(float* y) {\n"
      "  float x = 1.0f;\n"
      "  y[0] = x +* ;\n"
      "}\n";
  const std::string msg = thrown_text([&] { jit::nvrtc_compile(bad, "broken.cu", {90, CudaOutput::cubin}); },
                                      ErrorCode::compile_failed);
  EXPECT_THAT(msg, HasSubstr("NVRTC failed to compile broken.cu for sm_90: NVRTC_ERROR_COMPILATION"));
  // NVRTC's log names the program, the line and the problem.
  EXPECT_THAT(msg, HasSubstr("--- log ---\nbroken.cu(3)"));
  EXPECT_THAT(msg, HasSubstr("error"));
  EXPECT_THAT(msg, HasSubstr("--- source ---\n   1| extern \"C\""));
  EXPECT_THAT(msg, HasSubstr("   3|   y[0] = x +* ;\n"));
}

TEST(NvrtcCompile, TargetForDevice) {
  REQUIRE_NVRTC();
  const std::vector<int> archs = jit::nvrtc_supported_archs();
  auto supported = [&archs](int sm) { return std::find(archs.begin(), archs.end(), sm) != archs.end(); };

  CudaTarget t = jit::target_for_device(9, 0);
  EXPECT_EQ(t.sm, 90);
  EXPECT_EQ(t.output, CudaOutput::cubin);
  t = jit::target_for_device(8, 0);
  EXPECT_EQ(t.sm, 80);
  EXPECT_EQ(t.output, CudaOutput::cubin);

  // A device newer than anything this NVRTC knows: PTX for its newest arch.
  ASSERT_FALSE(supported(129)) << "pick a newer future arch for this NVRTC";
  t = jit::target_for_device(12, 9);
  const int newest_at_most_129 = *std::prev(std::upper_bound(archs.begin(), archs.end(), 129));
  EXPECT_EQ(t.sm, newest_at_most_129);
  EXPECT_EQ(t.output, CudaOutput::ptx);
  // And the PTX target compiles.
  const std::string ptx = jit::nvrtc_compile(kSaxpy, "saxpy.cu", t);
  EXPECT_NE(ptx.find(".target sm_" + std::to_string(t.sm)), std::string::npos);

  // Older than the oldest supported arch.
  EXPECT_THAT(thrown_text([] { jit::target_for_device(3, 0); }, ErrorCode::unsupported),
              HasSubstr("compute capability 3.0"))
      << "sm_30";
  thrown_text([] { jit::target_for_device(9, 12); }, ErrorCode::invalid_argument);  // minor 12
}

TEST(NvrtcCompile, CheckNvrtcNamesTheResult) {
  REQUIRE_NVRTC();
  EXPECT_NO_THROW(cuda::check_nvrtc(cuda::NVRTC_SUCCESS, "x"));
  EXPECT_THAT(thrown_text([] { cuda::check_nvrtc(5, "nvrtcCompileProgram"); }, ErrorCode::device_error),
              HasSubstr("nvrtcCompileProgram: NVRTC_ERROR_INVALID_OPTION"));
}

// A child that loads `library` ("nvrtc", "driver") from `path`, where there is none: it
// exits normally, loads nothing, and the public status is unavailable for the child's
// reason, which starts with `reason_start`. Returns the child's report.
ChildResult expect_not_found(const char* library, const std::string& path, const std::string& reason_start) {
  const ChildResult r = run_child(library, path);
  EXPECT_EQ(r.exit_status, 0) << r.out;
  if (r.exit_status != 0) return r;
  EXPECT_EQ(r.field("loaded"), "0") << r.out;
  const std::string reason = r.field("reason");
  EXPECT_TRUE(starts_with(reason, reason_start)) << reason;
  EXPECT_EQ(r.field("public_available"), "0") << r.out;
  EXPECT_EQ(r.field("public_reason"), reason);
  return r;
}

TEST(NvrtcLoader, MissingLibraryListsPathTried) {
  const std::string missing = "/nonexistent/stepfuse-test/libnvrtc.so.13";
  const ChildResult r = expect_not_found("nvrtc", missing, "NVRTC not found (tried: " + missing + ")");
  EXPECT_EQ(r.field("ok"), "0") << r.out;
}

TEST(NvrtcLoader, SetPathsAfterLoadIsRefused) {
  (void)cuda::nvrtc();  // loaded (or failed) now, in this process
  // A path after the load is refused.
  thrown_text([] { cuda::set_library_paths_for_testing("", "/elsewhere/libnvrtc.so"); }, ErrorCode::invalid_state);
}

// ---- Driver -------------------------------------------------------------------

TEST(DriverLoader, StatusAgreesWithCudaAvailable) {
  const CudaStatus s = cuda_available();  // must not throw, GPU or not
  const cuda::DriverApi* api = cuda::driver();
  if (!api) {
    const std::string reason = cuda::driver_status().reason;
    EXPECT_FALSE(cuda::driver_status().ok);
    // No libcuda (this CI), or a driver that sees no GPU.
    EXPECT_TRUE(starts_with(reason, "no CUDA driver (") || starts_with(reason, "no device (")) << reason;
    EXPECT_FALSE(s.available);
    EXPECT_FALSE(static_cast<bool>(s));
    EXPECT_EQ(s.reason, reason);
    EXPECT_EQ(s.device_count, 0);
    EXPECT_EQ(s.driver_version, 0);
  } else {
    EXPECT_TRUE(cuda::driver_status().ok);
    EXPECT_TRUE(cuda::driver_status().reason.empty());
    int count = 0;
    cuda::check(api->cuDeviceGetCount(&count), "cuDeviceGetCount");
    EXPECT_GT(s.driver_version, 0);
    if (cuda::nvrtc()) {
      EXPECT_EQ(s.device_count, count);
      EXPECT_GT(s.device_count, 0) << s.reason;
      EXPECT_TRUE(s.available) << s.reason;
      EXPECT_TRUE(s.reason.empty()) << s.reason;
    }
  }
  // NVRTC needs no driver.
  EXPECT_EQ(nvrtc_available().available, cuda::nvrtc() != nullptr);
}

TEST(DriverLoader, CheckNamesTheResult) {
  EXPECT_NO_THROW(cuda::check(cuda::CUDA_SUCCESS, "cuInit"));
  // The driver's name when one is loaded, else the built-in fallback.
  EXPECT_THAT(thrown_text([] { cuda::check(100, "cuInit"); }, ErrorCode::device_error),
              HasSubstr("cuInit: CUDA_ERROR_NO_DEVICE"));
  EXPECT_THAT(thrown_text([] { cuda::check(12345, "cuFoo"); }, ErrorCode::device_error), HasSubstr("cuFoo: "));
}

TEST(DriverLoader, MissingLibraryIsNoCudaDriver) {
  const std::string missing = "/nonexistent/stepfuse-test/libcuda.so.1";
  expect_not_found("driver", missing, "no CUDA driver (" + missing + ": ");
}

TEST(DriverLoader, StubLibraryIsRecognized) {
  std::string cuda_root = "/usr/local/cuda";
  if (const char* home = std::getenv("CUDA_HOME"); home && *home) cuda_root = home;
  const std::string stub = cuda_root + "/lib64/stubs/libcuda.so";
  if (!file_exists(stub)) GTEST_SKIP() << "no stub library at " << stub;
  const ChildResult r = run_child("driver", stub);
  ASSERT_EQ(r.exit_status, 0) << "the child crashed loading the stub: " << r.out;
  EXPECT_EQ(r.field("loaded"), "0") << r.out;
  const std::string reason = r.field("reason");
  EXPECT_EQ(reason, "no CUDA driver (libcuda.so.1 is the toolkit's stub library; install the NVIDIA driver)");
  EXPECT_EQ(r.field("public_reason"), reason);
}

// ---- On a GPU: the table end to end -----------------------------------------

TEST(DriverLoader, RunsACompiledKernelAndAGraph) {
  const cuda::DriverApi* api = cuda::driver();
  if (!api) GTEST_SKIP() << cuda::driver_status().reason;
  REQUIRE_NVRTC();
  const CudaStatus s = cuda_available();
  if (!s) GTEST_SKIP() << s.reason;
  using cuda::check;

  cuda::CUdevice dev = 0;
  check(api->cuDeviceGet(&dev, 0), "cuDeviceGet");
  int major = 0, minor = 0;
  check(api->cuDeviceGetAttribute(&major, cuda::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "major");
  check(api->cuDeviceGetAttribute(&minor, cuda::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "minor");
  std::size_t total = 0;
  check(api->cuDeviceTotalMem(&total, dev), "cuDeviceTotalMem");
  EXPECT_GT(total, std::size_t{1} << 30);

  cuda::CUcontext ctx = nullptr;
  check(api->cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(api->cuCtxSetCurrent(ctx), "cuCtxSetCurrent");

  const CudaTarget target = jit::target_for_device(major, minor);
  const std::string image = jit::nvrtc_compile(kSaxpy, "saxpy.cu", target);
  char error_log[4096] = {};
  int options[] = {cuda::CU_JIT_ERROR_LOG_BUFFER, cuda::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[] = {error_log, reinterpret_cast<void*>(std::size_t{sizeof error_log})};
  cuda::CUmodule module = nullptr;
  const cuda::CUresult load = api->cuModuleLoadDataEx(&module, image.c_str(), 2, options, values);
  ASSERT_EQ(load, cuda::CUDA_SUCCESS) << error_log;
  cuda::CUfunction fn = nullptr;
  check(api->cuModuleGetFunction(&fn, module, "saxpy"), "cuModuleGetFunction");

  constexpr int n = 1000;
  std::vector<float> x(n), y(n), expect(n), got(n, -1.0f);
  float a = 1.1f;
  for (int i = 0; i < n; ++i) {
    x[i] = 0.37f * static_cast<float>(i) - 11.0f;
    y[i] = 3.0f - 0.013f * static_cast<float>(i);
  }
  cuda::CUdeviceptr dx = 0, dy = 0;
  check(api->cuMemAlloc(&dx, n * sizeof(float)), "cuMemAlloc");
  check(api->cuMemAlloc(&dy, n * sizeof(float)), "cuMemAlloc");
  check(api->cuMemcpyHtoD(dx, x.data(), n * sizeof(float)), "cuMemcpyHtoD");
  check(api->cuMemcpyHtoD(dy, y.data(), n * sizeof(float)), "cuMemcpyHtoD");

  cuda::CUstream stream = nullptr;
  check(api->cuStreamCreate(&stream, cuda::CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  int count = n;
  void* params[] = {&a, &dx, &dy, &count};
  // Captured into a graph and launched twice: y = a*x + y, twice.
  check(api->cuStreamBeginCapture(stream, cuda::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
  int capturing = 0;
  check(api->cuStreamIsCapturing(stream, &capturing), "cuStreamIsCapturing");
  EXPECT_EQ(capturing, cuda::CU_STREAM_CAPTURE_STATUS_ACTIVE);
  check(api->cuLaunchKernel(fn, (n + 255) / 256, 1, 1, 256, 1, 1, 0, stream, params, nullptr), "cuLaunchKernel");
  cuda::CUgraph graph = nullptr;
  check(api->cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
  cuda::CUgraphExec exec = nullptr;
  check(api->cuGraphInstantiate(&exec, graph, 0), "cuGraphInstantiate");
  cuda::CUevent start = nullptr, stop = nullptr;
  check(api->cuEventCreate(&start, 0), "cuEventCreate");
  check(api->cuEventCreate(&stop, 0), "cuEventCreate");
  check(api->cuEventRecord(start, stream), "cuEventRecord");
  check(api->cuGraphLaunch(exec, stream), "cuGraphLaunch");
  check(api->cuGraphLaunch(exec, stream), "cuGraphLaunch");
  check(api->cuEventRecord(stop, stream), "cuEventRecord");
  check(api->cuEventSynchronize(stop), "cuEventSynchronize");
  float ms = -1.0f;
  check(api->cuEventElapsedTime(&ms, start, stop), "cuEventElapsedTime");
  EXPECT_GE(ms, 0.0f);
  check(api->cuMemcpyDtoHAsync(got.data(), dy, n * sizeof(float), stream), "cuMemcpyDtoHAsync");
  check(api->cuStreamSynchronize(stream), "cuStreamSynchronize");

  // Built with -ffp-contract=off, as the kernel with --fmad=false: bitwise equal.
  for (int i = 0; i < n; ++i) {
    float v = y[i];
    for (int rep = 0; rep < 2; ++rep) {
      const float p = a * x[i];
      v = p + v;
    }
    expect[i] = v;
  }
  for (int i = 0; i < n; ++i) ASSERT_EQ(got[i], expect[i]) << "element " << i;

  check(api->cuEventDestroy(start), "cuEventDestroy");
  check(api->cuEventDestroy(stop), "cuEventDestroy");
  check(api->cuGraphExecDestroy(exec), "cuGraphExecDestroy");
  check(api->cuGraphDestroy(graph), "cuGraphDestroy");
  check(api->cuStreamDestroy(stream), "cuStreamDestroy");
  check(api->cuMemFree(dx), "cuMemFree");
  check(api->cuMemFree(dy), "cuMemFree");
  check(api->cuModuleUnload(module), "cuModuleUnload");
  check(api->cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease");
}

}  // namespace
