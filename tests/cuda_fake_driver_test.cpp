// The CUDA host code against a fake driver table (no GPU needed): "device memory" is
// host memory, kernels are recorded and not run, and any driver call can be made to
// fail. What it checks: destructors that meet a failing driver call report it through
// the warning handler instead of throwing (which would terminate the process); a
// GradScaler's load_state_dict and the setters change nothing when the device write
// fails, a copy's load_state_dict does not write the scale it shares with the
// original, and a CUDA unscale_() that fails part-way never unscales a gradient twice.
// The driver table is installed by a static initializer, before anything in this
// process can load the real one; the step kernels are compiled by NVRTC (the tests
// that need them skip without it).
#include <gmock/gmock-matchers.h>  // header-only matchers: HasSubstr
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "jit/base/cuda_api.hpp"
#include "jit/base/warning.hpp"
#include "runtime/cuda/cuda_backend.hpp"
#include "runtime/cuda/cuda_scaler.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using ::testing::HasSubstr;
using cuda::CUresult;

constexpr CUresult kOk = 0;
constexpr CUresult kFailure = 700;  // CUDA_ERROR_ILLEGAL_ADDRESS: a sticky error

// ---- The fake driver -------------------------------------------------------------------

// Which calls fail: by name, from the n-th call on (0: the next one), or not at all.
struct Faults {
  std::mutex mutex;
  std::map<std::string, int> fail_after;  // name -> calls still to succeed
  std::map<std::string, int> fail_times;  // name -> next calls to fail, then succeed again
  struct Launch {
    std::string kernel;
    void* first_arg = nullptr;  // the tensor pointer, for the scale kernels
  };
  std::vector<Launch> launches;
  std::vector<std::string> function_names;  // CUfunction = index + 1
  // Allocations whose cuMemFree was made to fail: a real driver keeps them until the context
  // dies; the fixture frees them when the test ends, so that LeakSanitizer sees no leak.
  std::vector<void*> orphans;
};
Faults& faults() {
  static Faults f;
  return f;
}

// What cuStreamIsCapturing says.
std::atomic<bool> g_capturing = false;

// Whether this call fails.
bool fails(const char* name) {
  Faults& f = faults();
  std::lock_guard lock(f.mutex);
  if (auto once = f.fail_times.find(name); once != f.fail_times.end() && once->second > 0) {
    --once->second;
    return true;
  }
  auto it = f.fail_after.find(name);
  if (it == f.fail_after.end()) return false;
  if (it->second > 0) {
    --it->second;
    return false;
  }
  return true;
}
#define FAKE_CALL(name) \
  if (fails(#name)) return kFailure

void fail(const std::string& name, int after = 0) {
  std::lock_guard lock(faults().mutex);
  faults().fail_after[name] = after;
}
void heal() {
  std::lock_guard lock(faults().mutex);
  faults().fail_after.clear();
  faults().fail_times.clear();
}
// The next `times` calls of `name` fail; later ones succeed.
void fail_next(const std::string& name, int times = 1) {
  std::lock_guard lock(faults().mutex);
  faults().fail_times[name] = times;
}
std::vector<Faults::Launch> launches() {
  std::lock_guard lock(faults().mutex);
  return faults().launches;
}

cuda::DriverApi fake_driver() {
  cuda::DriverApi a{};
  a.cuInit = [](unsigned) -> CUresult { return kOk; };
  a.cuDriverGetVersion = [](int* v) -> CUresult {
    *v = 12000;
    return kOk;
  };
  a.cuGetErrorName = [](CUresult r, const char** name) -> CUresult {
    *name = r == kFailure ? "CUDA_ERROR_ILLEGAL_ADDRESS" : "CUDA_ERROR_FAKE";
    return kOk;
  };
  a.cuGetErrorString = [](CUresult, const char** text) -> CUresult {
    *text = "injected by the fake driver";
    return kOk;
  };
  a.cuDeviceGetCount = [](int* n) -> CUresult {
    *n = 1;
    return kOk;
  };
  a.cuDeviceGet = [](cuda::CUdevice* d, int ordinal) -> CUresult {
    *d = ordinal;
    return kOk;
  };
  a.cuDeviceGetName = [](char* name, int len, cuda::CUdevice) -> CUresult {
    std::strncpy(name, "fake", static_cast<std::size_t>(len));
    return kOk;
  };
  a.cuDeviceGetAttribute = [](int* v, int attribute, cuda::CUdevice) -> CUresult {
    *v = attribute == cuda::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR   ? 9
         : attribute == cuda::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR ? 0
                                                                           : 64;
    return kOk;
  };
  a.cuDeviceTotalMem = [](std::size_t* b, cuda::CUdevice) -> CUresult {
    *b = std::size_t{80} << 30;
    return kOk;
  };
  a.cuDevicePrimaryCtxRetain = [](cuda::CUcontext* c, cuda::CUdevice) -> CUresult {
    FAKE_CALL(cuDevicePrimaryCtxRetain);
    static int context;
    *c = reinterpret_cast<cuda::CUcontext>(&context);
    return kOk;
  };
  a.cuDevicePrimaryCtxRelease = [](cuda::CUdevice) -> CUresult {
    FAKE_CALL(cuDevicePrimaryCtxRelease);
    return kOk;
  };
  a.cuCtxSetCurrent = [](cuda::CUcontext) -> CUresult {
    FAKE_CALL(cuCtxSetCurrent);
    return kOk;
  };
  a.cuCtxSynchronize = []() -> CUresult {
    FAKE_CALL(cuCtxSynchronize);
    return kOk;
  };
  a.cuModuleLoadDataEx = [](cuda::CUmodule* m, const void*, unsigned, int*, void**) -> CUresult {
    FAKE_CALL(cuModuleLoadDataEx);
    static int module;
    *m = reinterpret_cast<cuda::CUmodule>(&module);
    return kOk;
  };
  a.cuModuleUnload = [](cuda::CUmodule) -> CUresult {
    FAKE_CALL(cuModuleUnload);
    return kOk;
  };
  a.cuModuleGetFunction = [](cuda::CUfunction* fn, cuda::CUmodule, const char* name) -> CUresult {
    FAKE_CALL(cuModuleGetFunction);
    Faults& f = faults();
    std::lock_guard lock(f.mutex);
    f.function_names.emplace_back(name);
    *fn = reinterpret_cast<cuda::CUfunction>(static_cast<std::uintptr_t>(f.function_names.size()));
    return kOk;
  };
  a.cuLaunchKernel = [](cuda::CUfunction fn, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        cuda::CUstream, void** params, void**) -> CUresult {
    FAKE_CALL(cuLaunchKernel);
    Faults& f = faults();
    std::lock_guard lock(f.mutex);
    const auto index = reinterpret_cast<std::uintptr_t>(fn) - 1;
    Faults::Launch l;
    l.kernel = index < f.function_names.size() ? f.function_names[index] : "?";
    if (params != nullptr && params[0] != nullptr) std::memcpy(&l.first_arg, params[0], sizeof(void*));
    f.launches.push_back(l);
    return kOk;
  };
  a.cuMemAlloc = [](cuda::CUdeviceptr* p, std::size_t bytes) -> CUresult {
    FAKE_CALL(cuMemAlloc);
    void* mem = std::calloc(1, bytes + 256);
    *p = static_cast<cuda::CUdeviceptr>(reinterpret_cast<std::uintptr_t>(mem));
    return kOk;
  };
  a.cuMemFree = [](cuda::CUdeviceptr p) -> CUresult {
    void* mem = reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
    if (fails("cuMemFree")) {
      std::lock_guard lock(faults().mutex);
      faults().orphans.push_back(mem);
      return kFailure;
    }
    std::free(mem);
    return kOk;
  };
  a.cuPointerGetAttribute = [](void* data, int attribute, cuda::CUdeviceptr) -> CUresult {
    if (attribute == cuda::CU_POINTER_ATTRIBUTE_MEMORY_TYPE) *static_cast<unsigned*>(data) = cuda::CU_MEMORYTYPE_DEVICE;
    else *static_cast<int*>(data) = 0;
    return kOk;
  };
  a.cuMemcpyHtoD = [](cuda::CUdeviceptr dst, const void* src, std::size_t n) -> CUresult {
    FAKE_CALL(cuMemcpyHtoD);
    std::memcpy(reinterpret_cast<void*>(static_cast<std::uintptr_t>(dst)), src, n);
    return kOk;
  };
  a.cuMemcpyDtoH = [](void* dst, cuda::CUdeviceptr src, std::size_t n) -> CUresult {
    FAKE_CALL(cuMemcpyDtoH);
    std::memcpy(dst, reinterpret_cast<const void*>(static_cast<std::uintptr_t>(src)), n);
    return kOk;
  };
  a.cuMemcpyHtoDAsync = [](cuda::CUdeviceptr dst, const void* src, std::size_t n, cuda::CUstream) -> CUresult {
    FAKE_CALL(cuMemcpyHtoDAsync);
    std::memcpy(reinterpret_cast<void*>(static_cast<std::uintptr_t>(dst)), src, n);
    return kOk;
  };
  a.cuMemcpyDtoHAsync = [](void* dst, cuda::CUdeviceptr src, std::size_t n, cuda::CUstream) -> CUresult {
    FAKE_CALL(cuMemcpyDtoHAsync);
    std::memcpy(dst, reinterpret_cast<const void*>(static_cast<std::uintptr_t>(src)), n);
    return kOk;
  };
  a.cuMemcpyDtoDAsync = [](cuda::CUdeviceptr dst, cuda::CUdeviceptr src, std::size_t n, cuda::CUstream) -> CUresult {
    FAKE_CALL(cuMemcpyDtoDAsync);
    std::memmove(reinterpret_cast<void*>(static_cast<std::uintptr_t>(dst)),
                 reinterpret_cast<const void*>(static_cast<std::uintptr_t>(src)), n);
    return kOk;
  };
  a.cuMemsetD8Async = [](cuda::CUdeviceptr dst, unsigned char v, std::size_t n, cuda::CUstream) -> CUresult {
    FAKE_CALL(cuMemsetD8Async);
    std::memset(reinterpret_cast<void*>(static_cast<std::uintptr_t>(dst)), v, n);
    return kOk;
  };
  a.cuStreamCreate = [](cuda::CUstream* s, unsigned) -> CUresult {
    static int stream;
    *s = reinterpret_cast<cuda::CUstream>(&stream);
    return kOk;
  };
  a.cuStreamDestroy = [](cuda::CUstream) -> CUresult { return kOk; };
  a.cuStreamSynchronize = [](cuda::CUstream) -> CUresult {
    FAKE_CALL(cuStreamSynchronize);
    // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: a capturing stream cannot be waited for (and
    // the capture is then invalidated).
    return g_capturing ? CUresult{900} : kOk;
  };
  a.cuStreamIsCapturing = [](cuda::CUstream, int* status) -> CUresult {
    *status = g_capturing ? cuda::CU_STREAM_CAPTURE_STATUS_ACTIVE : cuda::CU_STREAM_CAPTURE_STATUS_NONE;
    return kOk;
  };
  a.cuStreamBeginCapture = [](cuda::CUstream, int) -> CUresult { return kOk; };
  a.cuStreamEndCapture = [](cuda::CUstream, cuda::CUgraph*) -> CUresult { return kOk; };
  a.cuGraphInstantiate = [](cuda::CUgraphExec*, cuda::CUgraph, unsigned long long) -> CUresult { return kOk; };
  a.cuGraphLaunch = [](cuda::CUgraphExec, cuda::CUstream) -> CUresult { return kOk; };
  a.cuGraphExecDestroy = [](cuda::CUgraphExec) -> CUresult { return kOk; };
  a.cuGraphDestroy = [](cuda::CUgraph) -> CUresult { return kOk; };
  a.cuEventCreate = [](cuda::CUevent*, unsigned) -> CUresult { return kOk; };
  a.cuEventRecord = [](cuda::CUevent, cuda::CUstream) -> CUresult { return kOk; };
  a.cuEventSynchronize = [](cuda::CUevent) -> CUresult { return kOk; };
  a.cuEventElapsedTime = [](float* ms, cuda::CUevent, cuda::CUevent) -> CUresult {
    *ms = 0;
    return kOk;
  };
  a.cuEventDestroy = [](cuda::CUevent) -> CUresult { return kOk; };
  return a;
}

[[maybe_unused]] const bool kFakeDriverInstalled = [] {
  cuda::set_driver_for_testing(fake_driver());
  return true;
}();

// ---- Warnings ----------------------------------------------------------------------------

std::mutex g_warnings_mutex;
std::vector<std::string> g_warnings;
void capture_warning(std::string_view message) {
  std::lock_guard lock(g_warnings_mutex);
  g_warnings.emplace_back(message);
}

class FakeDriver : public ::testing::Test {
 protected:
  void SetUp() override {
    heal();
    detail::reset_warnings_for_testing();
    {
      std::lock_guard lock(g_warnings_mutex);
      g_warnings.clear();
    }
    previous_ = set_warning_handler(&capture_warning);
  }
  void TearDown() override {
    heal();
    set_warning_handler(previous_);
    std::lock_guard lock(faults().mutex);
    for (void* mem : faults().orphans) std::free(mem);
    faults().orphans.clear();
  }
  static std::vector<std::string> warnings() {
    std::lock_guard lock(g_warnings_mutex);
    return g_warnings;
  }
  // Exactly one warning, naming `call` and the injected error.
  static void expect_reported(const std::string& call) {
    const auto w = warnings();
    ASSERT_EQ(w.size(), 1u) << call;
    EXPECT_THAT(w[0], HasSubstr(call));
    EXPECT_THAT(w[0], HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS"));
  }
  WarningHandler previous_ = nullptr;
};

bool have_nvrtc() { return nvrtc_available().available; }

// ---- Destructors ---------------------------------------------------------------------------

TEST_F(FakeDriver, TheFakeDriverIsTheOneInUse) {
  ASSERT_TRUE(cuda_available().available) << cuda_available().reason;
  detail::DeviceBuffer b(64);
  EXPECT_NE(b.get(), 0u);
}

TEST_F(FakeDriver, DeviceBufferDestructorReportsAFailingFree) {
  {
    detail::DeviceBuffer b(64);
    fail("cuMemFree");
  }
  expect_reported("cuMemFree");
  heal();
  detail::DeviceBuffer a(32), b(32);
  fail("cuMemFree");
  a = std::move(b);  // the move assignment frees too, and is noexcept
  heal();
}

TEST_F(FakeDriver, ContextDestructorReportsAFailingRelease) {
  {
    detail::CudaContext ctx(0);
    fail("cuDevicePrimaryCtxRelease");
  }
  expect_reported("cuDevicePrimaryCtxRelease");
}

TEST_F(FakeDriver, ModuleDestructorReportsAFailingUnload) {
  {
    detail::CudaModule m("image", "test");
    fail("cuModuleUnload");
  }
  expect_reported("cuModuleUnload");
}

TEST_F(FakeDriver, ScalerStateDestructorReportsFailures) {
  {
    detail::CudaScalerState s(0);
    fail("cuMemFree");
    fail("cuDevicePrimaryCtxRelease");
  }
  const auto w = warnings();
  ASSERT_EQ(w.size(), 2u);
  EXPECT_THAT(w[0] + w[1], HasSubstr("cuMemFree"));
  EXPECT_THAT(w[0] + w[1], HasSubstr("cuDevicePrimaryCtxRelease"));
}

// Weights and gradients "on the device" (the fake's device memory is host memory).
struct DeviceModel {
  std::vector<float> w0 = std::vector<float>(1000, 1.0f), g0 = std::vector<float>(1000, 0.5f);
  std::vector<float> w1 = std::vector<float>(3000, 2.0f), g1 = std::vector<float>(3000, 0.25f);
  std::vector<float> w2 = std::vector<float>(77, 3.0f), g2 = std::vector<float>(77, 1.0f);
  std::vector<Param> params() {
    return {{{w0.data(), 1000, DType::f32}, {g0.data(), 1000, DType::f32}},
            {{w1.data(), 3000, DType::f32}, {g1.data(), 3000, DType::f32}},
            {{w2.data(), 77, DType::f32}, {g2.data(), 77, DType::f32}}};
  }
};

OptimizerOptions on_cuda() {
  OptimizerOptions o;
  o.device = Device::cuda(0);
  return o;
}

// ~CudaBackend waits for the stream after making its context current; both can fail
// (a sticky error, a driver gone bad). Before, make_current() threw out of the
// destructor and the process terminated.
TEST_F(FakeDriver, OptimizerOnCudaIsDestroyedWhenTheDriverFails) {
  if (!have_nvrtc()) GTEST_SKIP() << "NVRTC is not available: the step kernels cannot be compiled";
  for (const char* call : {"cuCtxSetCurrent", "cuStreamSynchronize"}) {
    SCOPED_TRACE(call);
    detail::reset_warnings_for_testing();
    {
      std::lock_guard lock(g_warnings_mutex);
      g_warnings.clear();
    }
    DeviceModel m;
    {
      Optimizer opt(optim::AdamW{}, m.params(), on_cuda());
      opt.step();
      fail(call);
    }
    heal();
    const auto w = warnings();
    ASSERT_FALSE(w.empty());
    EXPECT_THAT(w[0], HasSubstr(call));
  }
}

// A cached kernel image the driver refuses to load (it passed the cache's checks) is
// evicted and compiled once more: the optimizer is built, with one warning; a second
// refusal is an Error.
TEST_F(FakeDriver, ACachedImageThatDoesNotLoadIsEvictedAndRecompiled) {
  if (!have_nvrtc()) GTEST_SKIP() << "NVRTC is not available: the step kernels cannot be compiled";
  detail::reset_warnings_for_testing();
  {
    std::lock_guard lock(g_warnings_mutex);
    g_warnings.clear();
  }
  DeviceModel m;
  { Optimizer warm(optim::AdamW{}, m.params(), on_cuda()); }  // the images are cached now
  fail_next("cuModuleLoadDataEx");
  {
    Optimizer opt(optim::AdamW{}, m.params(), on_cuda());
    opt.step();
  }
  const auto w = warnings();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_THAT(w[0], HasSubstr("evicted and recompiled"));
  fail_next("cuModuleLoadDataEx", 2);
  EXPECT_THROW(Optimizer(optim::AdamW{}, m.params(), on_cuda()), Error);
  heal();
}

// Param groups on the GPU, with one program or mixed variants; hyperparameters change between replays, never inside a capture
// (the Error leaves the optimizer as it was).
TEST_F(FakeDriver, ParamGroupsOnTheGpu) {
  if (!have_nvrtc()) GTEST_SKIP() << "NVRTC is not available: the step kernels cannot be compiled";
  DeviceModel m;
  const std::vector<Param> p = m.params();
  Optimizer opt({{{p[0], p[1]}, optim::AdamW{.lr = 1e-3, .weight_decay = 0.1}}, {{p[2]}, optim::AdamW{.lr = 2e-3}}},
                on_cuda());
  opt.step();
  opt.set_lr(1, 5e-3);
  g_capturing = true;
  try {
    opt.set_lr(0, 1e-2);
    ADD_FAILURE() << "set_lr during a capture did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_state);
    EXPECT_THAT(std::string(e.what()), HasSubstr("captured"));
  }
  g_capturing = false;
  EXPECT_EQ(opt.lr(0), 1e-3);
  EXPECT_EQ(opt.lr(1), 5e-3);
  // NAdam's beta1 changed during a capture: refused as such before the step count (which
  // the carried mu_product needs) is read from the device, which would break the capture.
  Optimizer nadam(optim::NAdam{.lr = 1e-3}, p, on_cuda());
  nadam.step();
  g_capturing = true;
  try {
    nadam.set_config(optim::NAdam{.lr = 1e-3, .beta1 = 0.8});
    ADD_FAILURE() << "set_config during a capture did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_state);
    EXPECT_THAT(std::string(e.what()), HasSubstr("captured"));
  }
  g_capturing = false;
  EXPECT_EQ(std::get<optim::NAdam>(nadam.config()).beta1, 0.9);
  nadam.set_config(optim::NAdam{.lr = 1e-3, .beta1 = 0.8});  // between replays: taken
  EXPECT_EQ(std::get<optim::NAdam>(nadam.config()).beta1, 0.8);
  // A group whose flags pick another variant (amsgrad in group 1 only) runs it in the same
  // kernels (NVRTC compiles both element functions); its extra state is its own.
  Optimizer mixed({{{p[0]}, optim::AdamW{}}, {{p[1], p[2]}, optim::AdamW{.amsgrad = true}}}, on_cuda());
  mixed.step();
  EXPECT_THROW(mixed.state(0, "max_exp_avg_sq"), Error);
  EXPECT_EQ(mixed.state(1, "max_exp_avg_sq").size(), static_cast<std::size_t>(p[1].weight.numel));
  EXPECT_EQ(mixed.state(2, "exp_avg").size(), static_cast<std::size_t>(p[2].weight.numel));
  // Each state name is a buffer of its own (the backend maps names to its buffers).
  const float* const exp_avg = mixed.state(1, "exp_avg").data();
  const float* const exp_avg_sq = mixed.state(1, "exp_avg_sq").data();
  const float* const max_exp_avg_sq = mixed.state(1, "max_exp_avg_sq").data();
  EXPECT_NE(exp_avg, exp_avg_sq);
  EXPECT_NE(exp_avg, max_exp_avg_sq);
  EXPECT_NE(exp_avg_sq, max_exp_avg_sq);
}

// State stored as bf16 or q8 on the GPU: each tensor's state packed in its own format, the
// initial values encoded as the CPU encodes them (read back through the host copy), the
// kernels' tensor table pointing at them, and a write to the host copy (what a checkpoint
// load does) copied to the device before the next step. (The fake driver runs no kernel: the
// "device" memory keeps what was copied into it.)
TEST_F(FakeDriver, CompressedStateIsPackedAndItsHostCopyGoesBackBeforeAStep) {
  if (!have_nvrtc()) GTEST_SKIP() << "NVRTC is not available: the step kernels cannot be compiled";
  DeviceModel m, h;
  OptimizerOptions o = on_cuda();
  o.state_format = StateFormat::q8;
  o.min_q8_numel = 1000;  // the 77-element tensor keeps f32
  OptimizerOptions cpu_options = o;
  cpu_options.device = Device::cpu();
  const OptimizerConfig config = optim::Adagrad{.lr = 0.1, .initial_accumulator_value = 0.25};
  Optimizer gpu(config, m.params(), o), cpu(config, h.params(), cpu_options);
  for (std::size_t i = 0; i < 2; ++i) {  // (param 2's f32 state is filled by a kernel, which the fake does not run)
    EXPECT_EQ(gpu.state_format(i, "sum"), cpu.state_format(i, "sum")) << i;
    const std::span<const std::byte> gs = gpu.state_storage(i, "sum"), cs = cpu.state_storage(i, "sum");
    ASSERT_EQ(gs.size(), cs.size()) << i;
    EXPECT_TRUE(std::equal(gs.begin(), gs.end(), cs.begin())) << "param " << i << ": the initial codes";
    const std::span<const float> ga = gpu.state_absmax(i, "sum"), ca = cpu.state_absmax(i, "sum");
    EXPECT_TRUE(std::equal(ga.begin(), ga.end(), ca.begin(), ca.end())) << "param " << i << ": the initial absmaxes";
    for (const float v : gpu.state_values(i, "sum")) ASSERT_EQ(v, 0.25f) << i;
  }
  EXPECT_EQ(gpu.state_format(1, "sum"), StateFormat::q8);
  EXPECT_EQ(gpu.state_format(2, "sum"), StateFormat::f32);
  gpu.mutable_state_storage(1, "sum")[5] = std::byte{7};
  gpu.mutable_state_absmax(1, "sum")[2] = 3.0f;
  gpu.mutable_state(2, "sum")[76] = -1.5f;
  gpu.step();  // copies the host copy to the device first; the fake runs no kernel
  EXPECT_EQ(gpu.state_storage(1, "sum")[5], std::byte{7});  // read back from the device
  EXPECT_EQ(gpu.state_absmax(1, "sum")[2], 3.0f);
  EXPECT_EQ(gpu.state(2, "sum")[76], -1.5f);
  EXPECT_EQ(gpu.state_storage(1, "sum")[4], cpu.state_storage(1, "sum")[4]);
  // A state buffer only empty tensors use (amsgrad's, in a group of one empty param) has no
  // bytes: its tensors still say how they store it.
  std::vector<float> none;
  const std::vector<Param> p = m.params();
  const Param empty{{none.data(), 0, DType::f32}, {none.data(), 0, DType::f32}};
  OptimizerOptions bf16 = on_cuda();
  bf16.state_format = StateFormat::bf16;
  Optimizer groups({{{p[0]}, optim::AdamW{}}, {{empty}, optim::AdamW{.amsgrad = true}}}, bf16);
  EXPECT_EQ(groups.state_format(1, "max_exp_avg_sq"), StateFormat::bf16);
  EXPECT_TRUE(groups.state_storage(1, "max_exp_avg_sq").empty());
  EXPECT_EQ(groups.state_storage(0, "exp_avg").size(), 2u * 1000);
  groups.step();
}

// ---- GradScaler transactions ----------------------------------------------------------------

const std::map<std::string, double> kState = {
    {"scale", 8.0}, {"growth_factor", 3.0}, {"backoff_factor", 0.25}, {"growth_interval", 7}, {"_growth_tracker", 2}};

TEST_F(FakeDriver, ScalerLoadStateDictChangesNothingWhenTheDeviceWriteFails) {
  if (!have_nvrtc()) GTEST_SKIP() << "NVRTC is not available: the step kernels cannot be compiled";
  DeviceModel m;
  Optimizer opt(optim::SGD{.lr = 0.1}, m.params(), on_cuda());
  GradScaler scaler("cuda", 1024.0);
  scaler.step(opt);  // the scale moves to the device
  scaler.update(1024.0);
  ASSERT_EQ(scaler.where_scale_lives(), Device::cuda(0));
  const auto before = scaler.state_dict();
  fail("cuMemcpyHtoDAsync");
  EXPECT_THROW(scaler.load_state_dict(kState), Error);
  heal();
  EXPECT_EQ(scaler.state_dict(), before) << "a failed load left some values changed";
  fail("cuMemcpyHtoDAsync");
  EXPECT_THROW(scaler.set_growth_factor(5.0), Error);
  EXPECT_THROW(scaler.set_backoff_factor(0.75), Error);
  EXPECT_THROW(scaler.set_growth_interval(11), Error);
  heal();
  EXPECT_EQ(scaler.state_dict(), before) << "a failed setter left its value changed";
  scaler.load_state_dict(kState);
  EXPECT_EQ(scaler.state_dict(), kState);
}

// Copies share the device scale; loading into a copy (as a checkpoint load does before it
// commits) must not write the original's.
TEST_F(FakeDriver, ScalerCopyLoadStateDictLeavesTheOriginalAlone) {
  if (!have_nvrtc()) GTEST_SKIP() << "NVRTC is not available: the step kernels cannot be compiled";
  DeviceModel m;
  Optimizer opt(optim::SGD{.lr = 0.1}, m.params(), on_cuda());
  GradScaler scaler("cuda", 1024.0);
  scaler.step(opt);
  scaler.update(1024.0);
  const auto before = scaler.state_dict();
  GradScaler copy = scaler;
  copy.load_state_dict(kState);
  EXPECT_EQ(copy.state_dict(), kState);
  EXPECT_EQ(scaler.state_dict(), before) << "loading into a copy wrote the original's device scale";
  scaler = copy;  // the commit
  EXPECT_EQ(scaler.state_dict(), kState);
}

// unscale_ launches one kernel per gradient. A launch failing part-way leaves some
// gradients unscaled: a retry must do the others only, and step() must not treat the
// gradients as all scaled (or all unscaled) meanwhile.
TEST_F(FakeDriver, ScalerUnscaleFailingPartWayNeverUnscalesTwice) {
  if (!have_nvrtc()) GTEST_SKIP() << "NVRTC is not available: the step kernels cannot be compiled";
  DeviceModel m;
  Optimizer opt(optim::SGD{.lr = 0.1}, m.params(), on_cuda());
  GradScaler scaler("cuda", 1024.0);
  scaler.step(opt);
  scaler.update();
  const std::size_t first = launches().size();
  fail("cuLaunchKernel", 1);  // the second gradient's launch fails
  EXPECT_THROW(scaler.unscale_(opt), Error);
  heal();
  EXPECT_THROW(scaler.step(opt), Error) << "step() after a partial unscale_";
  scaler.unscale_(opt);  // finishes the job
  EXPECT_THROW(scaler.unscale_(opt), Error) << "a second unscale_ once all are unscaled";
  std::map<void*, int> unscaled;
  for (std::size_t i = first; i < launches().size(); ++i)
    if (launches()[i].kernel.rfind("sf_scale_", 0) == 0) ++unscaled[launches()[i].first_arg];
  ASSERT_EQ(unscaled.size(), 3u);
  for (const auto& [ptr, n] : unscaled) EXPECT_EQ(n, 1) << "gradient at " << ptr << " unscaled " << n << " times";
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
}

}  // namespace
}  // namespace stepfuse
