// The NCCL Communicator (stepfuse/nccl.hpp): the loader against the CUDA toolkit's real
// libnccl.so.2 (no GPU needed to load it), the communicator's calls through NCCL's ABI
// against a stand-in library (tests/nccl/fake_nccl.cpp), and, where a GPU exists, one-rank
// collectives on device memory and a sharded CUDA optimizer's step through the real NCCL
// (scripts/gpu_check.sh runs them).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "jit/base/cuda_api.hpp"
#include "runtime/distributed/nccl_api.hpp"
#include "stepfuse/convert.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/nccl.hpp"
#include "stepfuse/stepfuse.hpp"
#include "tests/nccl/fake_nccl.hpp"

namespace stepfuse {
namespace {

using detail::NcclLibrary;
using detail::open_nccl;

// tests/nccl/fake_nccl.cpp's comms and records.
struct Fake {
  NcclLibrary lib;
  ncclComm_t (*create)(int rank, int size, int device, int fail) = nullptr;
  void (*free)(ncclComm_t) = nullptr;
  const FakeNcclCall* (*last)() = nullptr;
};
Fake open_fake() {
  Fake f;
  f.lib = open_nccl({STEPFUSE_FAKE_NCCL}, /*prefer_loaded=*/false);
  EXPECT_EQ(f.lib.error, "");
  if (f.lib.handle == nullptr) return f;
  f.create = reinterpret_cast<decltype(f.create)>(dlsym(f.lib.handle, "fakeNcclCommCreate"));
  f.free = reinterpret_cast<decltype(f.free)>(dlsym(f.lib.handle, "fakeNcclCommFree"));
  f.last = reinterpret_cast<decltype(f.last)>(dlsym(f.lib.handle, "fakeNcclLastCall"));
  EXPECT_TRUE(f.create && f.free && f.last);
  return f;
}
// The message of the Error that fn throws, checking its code.
template <class Fn>
std::string error_of(Fn&& fn, ErrorCode code) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no Error";
  return "";
}

std::vector<std::string> toolkit_candidates() {
  static const char* const kNames[] = {"libnccl.so.2"};
  return cuda::toolkit_library_candidates("STEPFUSE_NCCL_PATH", kNames);
}

TEST(NcclLoader, LoadsTheToolkitsLibraryWithoutAGpu) {
  NcclLibrary lib = open_nccl(toolkit_candidates(), /*prefer_loaded=*/false);
  if (!lib.error.empty()) GTEST_SKIP() << "no libnccl.so.2 here: " << lib.error;
  EXPECT_GE(lib.version, 21000) << lib.path;
  const detail::NcclApi& a = lib.api;
  EXPECT_TRUE(a.ncclGetVersion && a.ncclGetErrorString && a.ncclCommCount && a.ncclCommUserRank &&
              a.ncclCommCuDevice && a.ncclAllGather && a.ncclAllReduce && a.ncclReduceScatter);
  EXPECT_NE(a.ncclGetLastError, nullptr) << "NCCL " << lib.version << " (2.13+ has ncclGetLastError)";
  // The enums this file maps to are NCCL's: its own names for the codes.
  EXPECT_STREQ(a.ncclGetErrorString(detail::kNcclSuccess), "no error");
  EXPECT_NE(std::string(a.ncclGetErrorString(detail::kNcclInvalidArgument)).find("invalid argument"), std::string::npos)
      << a.ncclGetErrorString(detail::kNcclInvalidArgument);
  dlclose(lib.handle);
}

TEST(NcclLoader, SaysWhatWasTriedAndWhatToInstall) {
  const NcclLibrary none = open_nccl({"/nonexistent/libnccl.so.2"}, false);
  EXPECT_EQ(none.handle, nullptr);
  EXPECT_NE(none.error.find("NCCL not found (tried: /nonexistent/libnccl.so.2)"), std::string::npos) << none.error;
  EXPECT_NE(none.error.find("STEPFUSE_NCCL_PATH"), std::string::npos) << none.error;
  const std::string why = error_of([&] { detail::nccl_communicator_with(none, nullptr, nullptr); }, ErrorCode::device_error);
  EXPECT_NE(why.find("nccl: NCCL not found"), std::string::npos) << why;

  // A library without one of the entry points, then the complete one: the second is taken.
  const NcclLibrary two = open_nccl({STEPFUSE_FAKE_NCCL_INCOMPLETE, STEPFUSE_FAKE_NCCL}, false);
  EXPECT_EQ(two.error, "");
  EXPECT_EQ(two.path, STEPFUSE_FAKE_NCCL);
  const NcclLibrary incomplete = open_nccl({STEPFUSE_FAKE_NCCL_INCOMPLETE}, false);
  EXPECT_NE(incomplete.error.find("[no ncclReduceScatter]"), std::string::npos) << incomplete.error;

  ::setenv("FAKE_NCCL_VERSION", "20905", 1);
  const NcclLibrary old = open_nccl({STEPFUSE_FAKE_NCCL}, false);
  ::unsetenv("FAKE_NCCL_VERSION");
  EXPECT_NE(old.error.find("[NCCL 2.9.5, older than 2.10]"), std::string::npos) << old.error;
}

TEST(NcclLoader, CandidatesFollowTheEnvironmentThenTheToolkit) {
  ::setenv("STEPFUSE_NCCL_PATH", "/opt/nccl/lib", 1);  // not a directory here: taken as a file
  ::setenv("CUDA_HOME", "/opt/cuda", 1);
  const std::vector<std::string> c = toolkit_candidates();
  ::unsetenv("STEPFUSE_NCCL_PATH");
  ::unsetenv("CUDA_HOME");
  ASSERT_GE(c.size(), 4u);
  EXPECT_EQ(c[0], "/opt/nccl/lib");
  EXPECT_EQ(c[1], "/opt/cuda/lib64/libnccl.so.2");
  EXPECT_EQ(c.back(), "libnccl.so.2");
  EXPECT_NE(std::find(c.begin(), c.end(), "/usr/local/cuda/lib64/libnccl.so.2"), c.end());
}

// The library the process has loaded comes first (a comm from PyTorch's NCCL must meet the
// same NCCL), whatever the candidates say; nccl_library() names it. (The fake's SONAME is
// libnccl.so.2; the cases above may have loaded it, or the toolkit's, already.)
TEST(NcclLoader, PrefersTheLibraryTheProcessHasLoaded) {
  void* loaded = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (loaded == nullptr) loaded = dlopen(STEPFUSE_FAKE_NCCL, RTLD_NOW | RTLD_GLOBAL);
  ASSERT_NE(loaded, nullptr) << dlerror();
  auto get_version = reinterpret_cast<int (*)(int*)>(dlsym(loaded, "ncclGetVersion"));
  ASSERT_NE(get_version, nullptr);
  int version = 0;
  ASSERT_EQ(get_version(&version), 0);
  const NcclLibrary lib = open_nccl({"/nonexistent/libnccl.so.2"}, /*prefer_loaded=*/true);
  EXPECT_EQ(lib.error, "");
  EXPECT_EQ(lib.path, "libnccl.so.2");
  EXPECT_EQ(lib.version, version);
  const std::string named = nccl_library();
  EXPECT_EQ(named.rfind("libnccl.so.2 2.", 0), 0u) << named;
  if (version == 22899) {
    EXPECT_EQ(named, "libnccl.so.2 2.28.99");
  }
}

TEST(NcclCommunicator, CallsNcclWithItsTypesOpsAndStream) {
  Fake f = open_fake();
  ASSERT_NE(f.create, nullptr);
  ncclComm_t comm = f.create(0, 1, 3, 0);
  auto* stream = reinterpret_cast<CUstream>(std::uintptr_t{0x5000});
  const auto c = detail::nccl_communicator_with(f.lib, comm, stream);
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->device(), Device::cuda(3));
  EXPECT_EQ(c->name(), "nccl");

  std::vector<float> send = {1.5f, -2.0f, 3.25f}, recv(3, 0.0f);
  c->all_gather(send.data(), recv.data(), 3, CommType::f32);
  EXPECT_EQ(recv, send);
  const FakeNcclCall& last = *f.last();
  EXPECT_STREQ(last.name, "ncclAllGather");
  EXPECT_EQ(last.send, send.data());
  EXPECT_EQ(last.recv, recv.data());
  EXPECT_EQ(last.count, 3u);
  EXPECT_EQ(last.type, 7);  // ncclFloat32
  EXPECT_EQ(last.stream, reinterpret_cast<void*>(stream));

  const std::pair<CommType, int> types[] = {{CommType::u8, 1},  {CommType::i32, 2},  {CommType::i64, 4}, {CommType::f16, 6},
                                            {CommType::bf16, 9}, {CommType::f32, 7}, {CommType::f64, 8}};
  const std::pair<ReduceOp, int> ops[] = {{ReduceOp::sum, 0}, {ReduceOp::max, 2}, {ReduceOp::min, 3}};
  std::vector<unsigned char> data(64, 1), out(64, 0);
  for (const auto& [type, code] : types)
    for (const auto& [op, op_code] : ops) {
      c->all_reduce(data.data(), 4, type, op);
      EXPECT_STREQ(last.name, "ncclAllReduce");
      EXPECT_EQ(last.send, data.data());  // in place
      EXPECT_EQ(last.recv, data.data());
      EXPECT_EQ(last.type, code) << comm_type_name(type);
      EXPECT_EQ(last.op, op_code);
      c->reduce_scatter(data.data(), out.data(), 2, type, op);
      EXPECT_STREQ(last.name, "ncclReduceScatter");
      EXPECT_EQ(last.count, 2u);
      EXPECT_EQ(last.type, code) << comm_type_name(type);
      EXPECT_EQ(last.op, op_code);
    }

  // Nothing is enqueued for a count of 0, nor for a refused call.
  const int calls = last.calls;
  c->all_gather(nullptr, nullptr, 0, CommType::f32);
  c->all_reduce(nullptr, 0, CommType::f32, ReduceOp::sum);
  c->reduce_scatter(nullptr, nullptr, 0, CommType::f32, ReduceOp::sum);
  const std::string null = error_of([&] { c->all_reduce(nullptr, 1, CommType::f32, ReduceOp::sum); }, ErrorCode::invalid_argument);
  EXPECT_NE(null.find("all_reduce: a null buffer"), std::string::npos) << null;
  error_of([&] { c->all_gather(data.data(), out.data(), 1, static_cast<CommType>(99)); }, ErrorCode::invalid_argument);
  error_of([&] { c->all_reduce(data.data(), 1, CommType::f32, static_cast<ReduceOp>(99)); }, ErrorCode::invalid_argument);
  EXPECT_EQ(last.calls, calls);
  f.free(comm);
}

TEST(NcclCommunicator, NcclErrorsNameTheCallAndNcclsWords) {
  Fake f = open_fake();
  ASSERT_NE(f.create, nullptr);
  ncclComm_t internal = f.create(0, 1, 0, 3);  // ncclInternalError
  const auto c = detail::nccl_communicator_with(f.lib, internal, nullptr);
  std::vector<float> data(8, 1.0f);
  const std::string why = error_of([&] { c->all_reduce(data.data(), 8, CommType::f32, ReduceOp::sum); }, ErrorCode::device_error);
  EXPECT_EQ(why, "stepfuse: nccl: ncclAllReduce (8 f32 per rank) failed: fake internal error (the fake's last error)");
  ncclComm_t invalid = f.create(0, 1, 0, 4);  // ncclInvalidArgument
  const auto d = detail::nccl_communicator_with(f.lib, invalid, nullptr);
  const std::string bad = error_of([&] { d->all_gather(data.data(), data.data(), 2, CommType::bf16); }, ErrorCode::invalid_argument);
  EXPECT_NE(bad.find("ncclAllGather (2 bf16 per rank) failed: fake invalid argument"), std::string::npos) << bad;

  const std::string null = error_of([&] { detail::nccl_communicator_with(f.lib, nullptr, nullptr); }, ErrorCode::invalid_argument);
  EXPECT_NE(null.find("comm is null"), std::string::npos) << null;
  ncclComm_t odd = f.create(2, 2, 0, 0);  // rank 2 of 2
  const std::string rank = error_of([&] { detail::nccl_communicator_with(f.lib, odd, nullptr); }, ErrorCode::invalid_argument);
  EXPECT_NE(rank.find("NCCL reports rank 2 of 2"), std::string::npos) << rank;
  for (ncclComm_t comm : {internal, invalid, odd}) f.free(comm);
}

// ---- on a GPU: the real NCCL, one rank, device memory, the communicator's stream ----

// The real NCCL on GPU 0: one rank (ncclCommInitAll), a non-blocking stream of the
// primary context. Skips where there is no GPU.
class NcclOnGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    cu = cuda::driver();
    if (cu == nullptr) GTEST_SKIP() << "no GPU: " << cuda::driver_status().reason;
    int devices = 0;
    if (cu->cuDeviceGetCount(&devices) != cuda::CUDA_SUCCESS || devices == 0) GTEST_SKIP() << "no GPU";
    lib = open_nccl(toolkit_candidates(), false);
    ASSERT_EQ(lib.error, "");
    using InitAll = int (*)(ncclComm_t*, int, const int*);
    auto init_all = reinterpret_cast<InitAll>(dlsym(lib.handle, "ncclCommInitAll"));
    destroy = reinterpret_cast<Destroy>(dlsym(lib.handle, "ncclCommDestroy"));
    ASSERT_TRUE(init_all && destroy);
    cuda::CUdevice dev = 0;
    cuda::CUcontext ctx = nullptr;
    cuda::check(cu->cuDeviceGet(&dev, 0), "cuDeviceGet");
    cuda::check(cu->cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    cuda::check(cu->cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    const int device_list[] = {0};
    ASSERT_EQ(init_all(&comm, 1, device_list), 0);
    cuda::check(cu->cuStreamCreate(&stream, cuda::CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  }
  void TearDown() override {
    if (stream != nullptr) cu->cuStreamDestroy(stream);
    if (comm != nullptr) destroy(comm);
  }
  std::shared_ptr<Communicator> communicator() const {
    return detail::nccl_communicator_with(lib, comm, reinterpret_cast<CUstream>(stream));
  }

  using Destroy = int (*)(ncclComm_t);
  const cuda::DriverApi* cu = nullptr;
  NcclLibrary lib;
  Destroy destroy = nullptr;
  ncclComm_t comm = nullptr;
  cuda::CUstream stream = nullptr;
};

TEST_F(NcclOnGpu, OneRankCollectivesOnTheStream) {
  const auto c = communicator();
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->device(), Device::cuda(0));

  const std::size_t n = 1000;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i) * 0.5f - 7.0f;
  cuda::CUdeviceptr a = 0, b = 0;
  cuda::check(cu->cuMemAlloc(&a, n * sizeof(float)), "cuMemAlloc");
  cuda::check(cu->cuMemAlloc(&b, n * sizeof(float)), "cuMemAlloc");
  cuda::check(cu->cuMemcpyHtoD(a, host.data(), n * sizeof(float)), "cuMemcpyHtoD");
  auto* pa = reinterpret_cast<void*>(static_cast<std::uintptr_t>(a));
  auto* pb = reinterpret_cast<void*>(static_cast<std::uintptr_t>(b));
  c->all_gather(pa, pb, n, CommType::f32);  // one rank: a copy
  c->all_reduce(pb, n, CommType::f32, ReduceOp::max);
  c->reduce_scatter(pb, pa, n, CommType::f32, ReduceOp::sum);
  cuda::check(cu->cuStreamSynchronize(stream), "cuStreamSynchronize");
  std::vector<float> got(n, 0.0f);
  cuda::check(cu->cuMemcpyDtoH(got.data(), a, n * sizeof(float)), "cuMemcpyDtoH");
  EXPECT_EQ(got, host);
  cu->cuMemFree(a);
  cu->cuMemFree(b);
}

// A sharded CUDA optimizer over a one-rank NCCL communicator on the optimizer's stream
// (sf_reduce_shard, ncclAllGather, sf_shard_finalize) against the same optimizer without
// a communicator, bitwise: clipped steps at several loss scales, an inf, a refused loss
// scale, then a GradScaler keeping its scale on the device.
TEST_F(NcclOnGpu, OneRankShardedCudaStepIsTheLocalStepBitwise) {
  // Tensors of several chunks, odd sizes; f32 weights and grads.
  const std::vector<std::int64_t> sizes = {40000, 33, 70000, 5, 16384};
  std::int64_t total = 0;
  for (const std::int64_t n : sizes) total += n;
  const std::size_t bytes = static_cast<std::size_t>(total) * sizeof(float);
  std::vector<float> w0(static_cast<std::size_t>(total)), g(w0.size());
  std::uint32_t x = 12345u;
  const auto next = [&] {
    x = x * 1664525u + 1013904223u;
    return static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
  };
  for (float& v : w0) v = next();
  cuda::CUdeviceptr wa = 0, wb = 0, gd = 0;
  cuda::check(cu->cuMemAlloc(&wa, bytes), "cuMemAlloc");
  cuda::check(cu->cuMemAlloc(&wb, bytes), "cuMemAlloc");
  cuda::check(cu->cuMemAlloc(&gd, bytes), "cuMemAlloc");
  cuda::check(cu->cuMemcpyHtoD(wa, w0.data(), bytes), "cuMemcpyHtoD");
  cuda::check(cu->cuMemcpyHtoD(wb, w0.data(), bytes), "cuMemcpyHtoD");
  const auto params_at = [&](cuda::CUdeviceptr w) {
    std::vector<Param> params;
    std::int64_t at = 0;
    for (const std::int64_t n : sizes) {
      auto* wp = reinterpret_cast<float*>(static_cast<std::uintptr_t>(w)) + at;
      auto* gp = reinterpret_cast<float*>(static_cast<std::uintptr_t>(gd)) + at;
      params.push_back({{wp, n, DType::f32}, {gp, n, DType::f32}});
      at += n;
    }
    return params;
  };
  OptimizerOptions o;
  o.device = Device::cuda(0);
  o.cuda_stream = reinterpret_cast<void*>(stream);
  o.max_grad_norm = 1.0;
  const optim::AdamW config{.lr = 1e-3, .weight_decay = 0.01};
  {
    Optimizer local(config, params_at(wb), o);
    o.communicator = communicator();
    Optimizer sharded(config, params_at(wa), o);  // collective (one rank)

    const auto expect_same = [&](const std::string& when) {
      SCOPED_TRACE(when);
      const StepResult a = sharded.last_result(), b = local.last_result();
      EXPECT_EQ(a.applied, b.applied);
      EXPECT_EQ(a.found_inf, b.found_inf);
      EXPECT_EQ(std::memcmp(&a.grad_norm, &b.grad_norm, sizeof(double)), 0) << a.grad_norm << " vs " << b.grad_norm;
      EXPECT_EQ(std::memcmp(&a.clip_coef, &b.clip_coef, sizeof(double)), 0) << a.clip_coef << " vs " << b.clip_coef;
      std::vector<float> ha(w0.size()), hb(w0.size());
      cuda::check(cu->cuMemcpyDtoH(ha.data(), wa, bytes), "cuMemcpyDtoH");
      cuda::check(cu->cuMemcpyDtoH(hb.data(), wb, bytes), "cuMemcpyDtoH");
      EXPECT_EQ(std::memcmp(ha.data(), hb.data(), bytes), 0) << "weights differ";
    };
    const auto draw = [&](float scale, bool with_inf) {
      for (float& v : g) v = next() * scale;
      if (with_inf) g[40000 + 7] = INFINITY;
      cuda::check(cu->cuMemcpyHtoD(gd, g.data(), bytes), "cuMemcpyHtoD");
    };
    const double scales[] = {1024.0, 3000.5, 0.25, 65536.0};
    for (int k = 0; k < 4; ++k) {
      draw(static_cast<float>(scales[k]), k == 2);
      sharded.step_scaled(scales[k]);
      local.step_scaled(scales[k]);
      expect_same("step " + std::to_string(k + 1));
    }
    EXPECT_FALSE(sharded.last_result().applied) << "the inf step";
    // A refused loss scale: the rank throws (after the step's collective), nothing is written.
    EXPECT_THROW(sharded.step_scaled(NAN), Error);
    draw(512.0f, false);
    sharded.step_scaled(512.0);
    local.step_scaled(512.0);
    expect_same("after a refused step");
    // A GradScaler whose scale lives on the device: no host read in step or update.
    GradScaler sa("cuda", 256.0), sb("cuda", 256.0);
    for (int k = 0; k < 3; ++k) {
      draw(256.0f, k == 1);
      sa.step(sharded);
      sb.step(local);
      sa.update();
      sb.update();
      expect_same("scaler step " + std::to_string(k + 1));
      EXPECT_EQ(sa.get_scale(), sb.get_scale());
    }
    EXPECT_EQ(sharded.step_count(), local.step_count());
  }
  cu->cuMemFree(wa);
  cu->cuMemFree(wb);
  cu->cuMemFree(gd);
}

}  // namespace
}  // namespace stepfuse
