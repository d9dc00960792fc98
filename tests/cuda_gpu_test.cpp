// The CUDA backend on a GPU, against the CPU backend (every test skips without a GPU, saying why):
//  - every built-in optimizer x dtype combination x {plain, loss-scaled, clipped} step, in
//    separate, flat, misaligned and mixed-dtype tensor lists with odd and zero sizes, is bit
//    for bit the CPU backend after 1 and 4 steps: weights, gradients (never written), state,
//    masters, step count, the step's result and the per-tensor norms (docs/architecture.md §5);
//  - inf/NaN gradients skip the step and write nothing; the next finite step proceeds;
//  - GradScaler("cuda").step + update captured in a CUDA graph and replayed over changing
//    gradients (some not finite) equals the same iterations run eagerly, and the capture
//    itself shows that a step never waits for the device (a sync during capture is an error);
//  - two runs are bitwise identical; a device GradScaler with unscale_ follows
//    GradScaler("cpu") exactly; a checkpoint resumes bit for bit; set_lr and set_config
//    compile nothing; a second optimizer with the same spec compiles nothing (the cache's
//    costs are printed); an optimizer made after the primary context was reset still runs.
//
// STEPFUSE_GPU_TEST_ON_CPU=1 runs the tests that do not need the device itself with the CPU
// backend standing in for the GPU (host memory for device memory): a check of this file's
// own logic where no GPU exists. The device-only tests still skip then.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "jit/builtins.hpp"
#include "jit/cuda/cuda_kernels.hpp"
#include "jit/cuda/emit_cuda.hpp"
#include "jit/cuda/nvrtc_compile.hpp"
#include "jit/kernel_cache.hpp"
#include "jit/base/cuda_api.hpp"
#include "runtime/cuda/cuda_backend.hpp"
#include "jit/cuda/cuda_layout.hpp"
#include "reference/builtin_configs.hpp"
#include "runtime/detail_access.hpp"
#include "stepfuse/stepfuse.hpp"

extern char** environ;  // POSIX: copied into the child process's environment

namespace stepfuse {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// ---- Where the side under test runs ------------------------------------------------------

constexpr const char* kOnCpuEnv = "STEPFUSE_GPU_TEST_ON_CPU";
// Set in the child process of OptimizerWorksAfterThePrimaryContextWasReset.
constexpr const char* kChildEnv = "STEPFUSE_GPU_TEST_CHILD";

enum class Mode { skip, gpu, cpu_stand_in };
struct Where {
  Mode mode = Mode::skip;
  std::string why_skipped;
  // The primary context, retained for the whole run so that it is not reset between tests
  // (a reset is tested on its own, in a child process).
  std::unique_ptr<detail::CudaContext> context;
};
Where& where() {
  static Where w;
  return w;
}
bool on_gpu() { return where().mode == Mode::gpu; }
Device test_device() { return on_gpu() ? Device::cuda(0) : Device::cpu(); }

const cuda::DriverApi& drv() { return *cuda::driver(); }
void check(cuda::CUresult r, const char* what) { cuda::check(r, what); }
void sync_device() {
  if (on_gpu()) check(drv().cuCtxSynchronize(), "cuCtxSynchronize");
}

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

// ---- Memory ------------------------------------------------------------------------------

// Host memory, 256-byte aligned like cuMemAlloc's.
class HostBuffer {
 public:
  explicit HostBuffer(std::size_t bytes)
      : bytes_(bytes), p_(static_cast<std::byte*>(std::aligned_alloc(256, round_up(std::max<std::size_t>(bytes, 1), 256)))) {
    if (p_ == nullptr) throw std::bad_alloc();
  }
  ~HostBuffer() { std::free(p_); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  std::byte* data() const { return p_; }
  std::size_t size() const { return bytes_; }

 private:
  std::size_t bytes_;
  std::byte* p_;
};

// Memory of the side under test: device memory from the driver table on the GPU, host
// memory for the CPU stand-in. Copies wait for the whole device before and after, so they
// are ordered with steps on any stream.
class TestBuffer {
 public:
  explicit TestBuffer(std::size_t bytes) : bytes_(bytes) {
    if (on_gpu())
      check(drv().cuMemAlloc(&dev_, std::max<std::size_t>(bytes, 1)), "cuMemAlloc");
    else
      host_ = std::make_unique<HostBuffer>(bytes);
  }
  ~TestBuffer() {
    if (dev_ != 0) drv().cuMemFree(dev_);
  }
  TestBuffer(const TestBuffer&) = delete;
  TestBuffer& operator=(const TestBuffer&) = delete;

  // The device address as a pointer (what a TensorView holds), or the host pointer.
  std::byte* data() const { return dev_ != 0 ? reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(dev_)) : host_->data(); }
  cuda::CUdeviceptr address() const { return dev_; }
  std::size_t size() const { return bytes_; }

  void upload(const std::vector<std::byte>& src) {
    EXPECT_EQ(src.size(), bytes_);
    if (src.empty()) return;
    if (dev_ != 0) {
      sync_device();
      check(drv().cuMemcpyHtoD(dev_, src.data(), src.size()), "cuMemcpyHtoD");
      sync_device();
    } else {
      std::memcpy(host_->data(), src.data(), src.size());
    }
  }
  std::vector<std::byte> bytes() const {
    std::vector<std::byte> out(bytes_);
    if (bytes_ == 0) return out;
    if (dev_ != 0) {
      sync_device();
      check(drv().cuMemcpyDtoH(out.data(), dev_, bytes_), "cuMemcpyDtoH");
    } else {
      std::memcpy(out.data(), host_->data(), bytes_);
    }
    return out;
  }

 private:
  std::size_t bytes_;
  cuda::CUdeviceptr dev_ = 0;
  std::unique_ptr<HostBuffer> host_;
};

// ---- Tensor lists ------------------------------------------------------------------------

enum class Layout { separate, flat, misaligned };
const char* layout_name(Layout l) {
  return l == Layout::separate ? "separate" : l == Layout::flat ? "flat" : "misaligned";
}

struct TensorType {
  DType weight, grad;
};

// A tensor list's sizes, dtypes and placement: byte offsets of each tensor's weight and
// gradient in two arenas. separate: each tensor 256-byte aligned with a gap after it (not
// flat); misaligned: the same shifted by one element, so no tensor allows vector accesses;
// flat: back to back, the layout of views of one buffer. A zero-size tensor gets null
// pointers in the separate layout and a pointer into its arena otherwise.
struct ListLayout {
  std::vector<std::int64_t> sizes;
  std::vector<TensorType> types;
  Layout layout = Layout::separate;
  std::vector<std::size_t> w_off, g_off;
  std::vector<bool> null_data;
  std::size_t w_bytes = 0, g_bytes = 0;

  std::size_t size() const { return sizes.size(); }
  std::vector<Param> params(std::byte* w, std::byte* g) const {
    std::vector<Param> p;
    for (std::size_t t = 0; t < size(); ++t)
      p.push_back({{null_data[t] ? nullptr : w + w_off[t], sizes[t], types[t].weight},
                   {null_data[t] ? nullptr : g + g_off[t], sizes[t], types[t].grad}});
    return p;
  }
};

ListLayout make_layout(const std::vector<std::int64_t>& sizes, const std::vector<TensorType>& cycle, Layout layout) {
  ListLayout L;
  L.sizes = sizes;
  L.layout = layout;
  std::size_t w = 0, g = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const TensorType ty = cycle[t % cycle.size()];
    L.types.push_back(ty);
    const auto n = static_cast<std::size_t>(sizes[t]);
    const std::size_t ws = dtype_size(ty.weight), gs = dtype_size(ty.grad);
    if (layout == Layout::flat) {
      L.w_off.push_back(w);
      L.g_off.push_back(g);
      L.null_data.push_back(false);
      w += n * ws;
      g += n * gs;
    } else {
      const bool shift = layout == Layout::misaligned;
      w = round_up(w, 256) + (shift ? ws : 0);
      g = round_up(g, 256) + (shift ? gs : 0);
      L.w_off.push_back(w);
      L.g_off.push_back(g);
      L.null_data.push_back(n == 0 && layout == Layout::separate);
      w += n * ws + 256;
      g += n * gs + 256;
    }
  }
  L.w_bytes = w;
  L.g_bytes = g;
  return L;
}

// Element i of an image as its stored bits (T: float or std::uint16_t), at any alignment.
template <class T>
T element_bits(const std::byte* base, std::int64_t i) {
  T x;
  std::memcpy(&x, base + static_cast<std::int64_t>(sizeof(T)) * i, sizeof(T));
  return x;
}
template <class T>
void set_element_bits(std::byte* base, std::int64_t i, T x) {
  std::memcpy(base + static_cast<std::int64_t>(sizeof(T)) * i, &x, sizeof(T));
}

// Through the library's conversions, as the backends store and widen (NaN payloads kept).
void store(DType t, std::byte* base, std::int64_t i, float x) {
  if (t == DType::f32) return set_element_bits(base, i, x);
  set_element_bits(base, i, t == DType::f16 ? float_to_f16(x) : float_to_bf16(x));
}
float load(DType t, const std::byte* base, std::int64_t i) {
  if (t == DType::f32) return element_bits<float>(base, i);
  const auto h = element_bits<std::uint16_t>(base, i);
  return t == DType::f16 ? f16_to_float(h) : bf16_to_float(h);
}

// Initial weights: 0.5 * uniform(-1, 1), every 13th element 8 times larger.
std::vector<std::byte> weight_image(const ListLayout& L, std::uint32_t seed) {
  std::vector<std::byte> img(L.w_bytes);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t t = 0; t < L.size(); ++t)
    for (std::int64_t i = 0; i < L.sizes[t]; ++i)
      store(L.types[t].weight, img.data() + L.w_off[t], i, 0.5f * u(rng) * (i % 13 == 5 ? 8.0f : 1.0f));
  return img;
}

enum class Poison { none, inf, nan, inf_and_nan };

// Gradients as computed with loss scale `scale`: scale * 0.05 * uniform(-1, 1), with exact
// zeros (every 97th element) and tiny values (every 89th: +-1e-9, below f16's range unless
// scaled). Poison puts +inf in the middle of the largest tensor and/or NaN at the end of
// the last non-empty one.
std::vector<std::byte> grad_image(const ListLayout& L, std::uint32_t seed, float scale, Poison poison = Poison::none) {
  std::vector<std::byte> img(L.g_bytes);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t t = 0; t < L.size(); ++t) {
    for (std::int64_t i = 0; i < L.sizes[t]; ++i) {
      float x = 0.05f * u(rng);
      if (i % 97 == 3) x = 0.0f;
      else if (i % 89 == 7) x = x < 0 ? -1e-9f : 1e-9f;
      store(L.types[t].grad, img.data() + L.g_off[t], i, x * scale);
    }
  }
  std::size_t largest = 0, last = 0;
  for (std::size_t t = 0; t < L.size(); ++t) {
    if (L.sizes[t] > L.sizes[largest]) largest = t;
    if (L.sizes[t] > 0) last = t;
  }
  if (poison == Poison::inf || poison == Poison::inf_and_nan)
    store(L.types[largest].grad, img.data() + L.g_off[largest], L.sizes[largest] / 2, INFINITY);
  if (poison == Poison::nan || poison == Poison::inf_and_nan) {
    if (poison == Poison::inf_and_nan && last == largest) last = 0;  // another tensor than the inf's
    store(L.types[last].grad, img.data() + L.g_off[last], L.sizes[last] - 1, NAN);
  }
  return img;
}

// A tensor list in host memory: what the CPU backend steps.
struct HostList {
  explicit HostList(const ListLayout& L) : w(L.w_bytes), g(L.g_bytes), params(L.params(w.data(), g.data())) {}
  void set_weights(const std::vector<std::byte>& img) { copy_in(w, img); }
  void set_grads(const std::vector<std::byte>& img) { copy_in(g, img); }
  std::vector<std::byte> weights() const { return {w.data(), w.data() + w.size()}; }
  std::vector<std::byte> grads() const { return {g.data(), g.data() + g.size()}; }
  static void copy_in(HostBuffer& b, const std::vector<std::byte>& img) {
    EXPECT_EQ(img.size(), b.size());
    if (!img.empty()) std::memcpy(b.data(), img.data(), img.size());
  }
  HostBuffer w, g;
  std::vector<Param> params;
};

// The same list on the side under test (the GPU).
struct TestList {
  explicit TestList(const ListLayout& L) : w(L.w_bytes), g(L.g_bytes), params(L.params(w.data(), g.data())) {}
  void set_weights(const std::vector<std::byte>& img) { w.upload(img); }
  void set_grads(const std::vector<std::byte>& img) { g.upload(img); }
  std::vector<std::byte> weights() const { return w.bytes(); }
  std::vector<std::byte> grads() const { return g.bytes(); }
  TestBuffer w, g;
  std::vector<Param> params;
};

// ---- Optimizers and steps ----------------------------------------------------------------

using NamedConfig = ref::NamedBuiltin;
const std::vector<NamedConfig>& configs() { return ref::one_config_per_program(); }
const OptimizerConfig& config_named(std::string_view name) {
  for (const NamedConfig& c : configs())
    if (name == c.name) return c.config;
  throw std::invalid_argument("no config named " + std::string(name));
}

// Dtype combinations; a list's tensors take the set's types in turn.
struct DtypeSet {
  const char* name;
  std::vector<TensorType> cycle;
  bool masters;
  bool stochastic = false;  // bf16 weights without masters, rounded stochastically
  bool compensated = false; // bf16 weights without masters, with bf16 compensations
  StateFormat state = StateFormat::f32;  // OptimizerOptions::state_format
};
const std::vector<DtypeSet>& dtype_sets() {
  static const std::vector<DtypeSet> all = {
      {"f32", {{DType::f32, DType::f32}}, true},
      {"bf16_masters", {{DType::bf16, DType::bf16}}, true},
      {"f16_masters", {{DType::f16, DType::f16}}, true},
      {"f16_no_masters", {{DType::f16, DType::f16}}, false},
      {"f32w_bf16g", {{DType::f32, DType::bf16}}, true},
      {"mixed", {{DType::f32, DType::f32}, {DType::bf16, DType::bf16}, {DType::f16, DType::f16}, {DType::f32, DType::bf16}}, true},
      {"bf16_stochastic", {{DType::bf16, DType::bf16}, {DType::f32, DType::f32}, {DType::bf16, DType::f32}}, false, true},
      {"bf16_compensated", {{DType::bf16, DType::bf16}, {DType::f32, DType::f32}, {DType::bf16, DType::f16}}, false, false, true},
      // Compressed state (tensors below min_q8_numel keep f32).
      {"f32_q8", {{DType::f32, DType::f32}}, true, false, false, StateFormat::q8},
      {"mixed_q8", {{DType::f32, DType::f32}, {DType::bf16, DType::bf16}, {DType::f16, DType::f16}}, true, false, false,
       StateFormat::q8},
      {"bf16_stochastic_q8", {{DType::bf16, DType::bf16}, {DType::f32, DType::f32}, {DType::bf16, DType::f32}}, false, true,
       false, StateFormat::q8},
      {"bf16_masters_bf16_state", {{DType::bf16, DType::bf16}}, true, false, false, StateFormat::bf16},
  };
  return all;
}
const DtypeSet& dtype_set(std::string_view name) {
  for (const DtypeSet& d : dtype_sets())
    if (name == d.name) return d;
  throw std::invalid_argument("no dtype set named " + std::string(name));
}

enum class StepKind { plain, scaled, clipped, scaled_clipped_inf };
const char* kind_name(StepKind k) {
  return k == StepKind::plain ? "plain" : k == StepKind::scaled ? "scaled" : k == StepKind::clipped ? "clipped" : "scaled_clipped_inf";
}

constexpr float kLossScale = 1000.0f;  // not a power of two: 1/S is rounded
constexpr double kMaxNorm = 1.0;       // below the gradients' L2 norm (about 7 for kSizes): clipping acts
constexpr double kMaxNormInf = 0.02;   // below their largest |g| (about 0.05)

// Odd sizes spanning several reduce chunks (16384) and update blocks (4096), one exactly one
// chunk, tiny ones and an empty one.
const std::vector<std::int64_t> kSizes = {32771, 4097, 0, 3, 16384, 12289, 1};

OptimizerOptions options_for(StepKind k, bool masters, Device d, bool stochastic = false, bool compensated = false,
                             StateFormat state = StateFormat::f32) {
  OptimizerOptions o;
  o.device = d;
  o.state_format = state;
  o.master_weights = masters;
  o.compensated_weights = compensated;
  o.stochastic_rounding = stochastic;
  o.seed = stochastic ? 0x5EED0000000Full : 0;
  if (k == StepKind::clipped) o.max_grad_norm = kMaxNorm;
  if (k == StepKind::scaled_clipped_inf) o.max_grad_norm = kMaxNormInf, o.norm_type = INFINITY;
  return o;
}
bool is_scaled(StepKind k) { return k == StepKind::scaled || k == StepKind::scaled_clipped_inf; }
float grad_scale(StepKind k) { return is_scaled(k) ? kLossScale : 1.0f; }
void take_step(Optimizer& o, StepKind k) {
  if (is_scaled(k))
    o.step_scaled(kLossScale);
  else
    o.step();
}

// ---- Comparisons -------------------------------------------------------------------------

// What an optimizer shows after a step, copied: its result, per-tensor norms, the caller's
// weights and gradients, every state tensor and every master. (On the GPU this waits for
// the device and downloads the state; the next step uploads it back.)
struct Snapshot {
  std::int64_t step_count = 0;
  StepResult result;
  std::vector<double> tensor_norms;
  std::vector<std::byte> weights, grads;
  std::vector<std::string> state_names;
  std::vector<std::vector<std::vector<float>>> state;  // [stream][tensor]
  std::vector<std::vector<float>> masters;             // [tensor], empty without one
  std::vector<std::vector<float>> compensations;       // [tensor], widened; empty without one
};

Snapshot snapshot(const Optimizer& o, std::vector<std::byte> weights, std::vector<std::byte> grads) {
  Snapshot s;
  s.result = o.last_result();
  s.step_count = o.step_count();
  s.tensor_norms = o.last_tensor_grad_norms();
  s.weights = std::move(weights);
  s.grads = std::move(grads);
  for (std::string_view name : o.state_names()) {
    s.state_names.emplace_back(name);
    auto& per_tensor = s.state.emplace_back();
    for (std::size_t t = 0; t < o.num_params(); ++t) {
      try {  // (the values, decoded when stored as bf16 or q8, then a q8 stream's absmaxes)
        std::vector<float> v = o.state_values(t, name);
        const std::span<const float> absmax = o.state_absmax(t, name);
        v.insert(v.end(), absmax.begin(), absmax.end());
        per_tensor.push_back(std::move(v));
      } catch (const Error&) {  // a state of other groups' program variants only: none here
        per_tensor.emplace_back();
      }
    }
  }
  for (std::size_t t = 0; t < o.num_params(); ++t) {
    const std::span<const float> m = o.master(t);
    s.masters.emplace_back(m.begin(), m.end());
    auto& c = s.compensations.emplace_back();
    for (std::uint16_t h : o.compensation(t)) c.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16));
  }
  return s;
}
Snapshot snapshot(const Optimizer& o, const TestList& l) { return snapshot(o, l.weights(), l.grads()); }
Snapshot snapshot(const Optimizer& o, const HostList& l) { return snapshot(o, l.weights(), l.grads()); }

bool same_double(double a, double b) {
  return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b) || (std::isnan(a) && std::isnan(b));
}

std::string describe(float x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g (0x%08x)", static_cast<double>(x), std::bit_cast<std::uint32_t>(x));
  return buf;
}

// Index of the first element whose bits differ (any NaN equals any NaN when
// `nan_is_nan`: GPUs make canonical NaNs, CPUs keep payloads), or -1.
std::int64_t first_difference(DType t, const std::byte* a, const std::byte* b, std::int64_t n, bool nan_is_nan) {
  const std::size_t es = dtype_size(t);
  for (std::int64_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i * es, b + i * es, es) == 0) continue;
    if (nan_is_nan && std::isnan(load(t, a, i)) && std::isnan(load(t, b, i))) continue;
    return i;
  }
  return -1;
}

struct CompareOptions {
  bool results = true;       // step count, the step's result and per-tensor norms
  bool grads = true;
  bool nan_is_nan = false;   // in the gradients (after unscale_)
};

// Expects `a` and `b`, snapshots of two optimizers over lists laid out by `L`, to be bit
// for bit equal. Reports at most a few differences, each naming the tensor and element.
void expect_identical(const Snapshot& a, const Snapshot& b, const ListLayout& L, const std::string& where,
                      CompareOptions opt = {}) {
  int failures = 0;
  const auto fail = [&](const std::string& what) {
    if (++failures <= 6) ADD_FAILURE() << where << ": " << what;
  };
  if (opt.results) {
    if (a.step_count != b.step_count)
      fail("step_count " + std::to_string(a.step_count) + " vs " + std::to_string(b.step_count));
    const StepResult &ra = a.result, &rb = b.result;
    if (ra.pending || rb.pending) fail("a result is still pending after last_result()");
    if (ra.applied != rb.applied) fail(std::string("applied ") + (ra.applied ? "true" : "false") + " vs " + (rb.applied ? "true" : "false"));
    if (ra.found_inf != rb.found_inf) fail(std::string("found_inf ") + (ra.found_inf ? "true" : "false") + " vs " + (rb.found_inf ? "true" : "false"));
    if (!same_double(ra.grad_norm, rb.grad_norm)) fail("grad_norm " + std::to_string(ra.grad_norm) + " vs " + std::to_string(rb.grad_norm));
    if (!same_double(ra.clip_coef, rb.clip_coef)) fail("clip_coef " + std::to_string(ra.clip_coef) + " vs " + std::to_string(rb.clip_coef));
    if (ra.applied && rb.applied) {
      if (a.tensor_norms.size() != b.tensor_norms.size()) fail("different numbers of per-tensor norms");
      for (std::size_t t = 0; t < std::min(a.tensor_norms.size(), b.tensor_norms.size()); ++t)
        if (!same_double(a.tensor_norms[t], b.tensor_norms[t]))
          fail("tensor " + std::to_string(t) + " grad norm " + std::to_string(a.tensor_norms[t]) + " vs " +
               std::to_string(b.tensor_norms[t]));
    }
  }
  if (a.state_names != b.state_names) fail("different state streams");
  for (std::size_t t = 0; t < L.size(); ++t) {
    const std::int64_t n = L.sizes[t];
    const std::string at = "tensor " + std::to_string(t) + " (" + std::to_string(n) + " elements)";
    if (n == 0) continue;
    const DType wt = L.types[t].weight, gt = L.types[t].grad;
    const std::byte* aw = a.weights.data() + L.w_off[t];
    const std::byte* bw = b.weights.data() + L.w_off[t];
    if (const std::int64_t i = first_difference(wt, aw, bw, n, false); i >= 0)
      fail(at + " weight[" + std::to_string(i) + "] " + describe(load(wt, aw, i)) + " vs " + describe(load(wt, bw, i)));
    if (opt.grads) {
      const std::byte* ag = a.grads.data() + L.g_off[t];
      const std::byte* bg = b.grads.data() + L.g_off[t];
      if (const std::int64_t i = first_difference(gt, ag, bg, n, opt.nan_is_nan); i >= 0)
        fail(at + " grad[" + std::to_string(i) + "] " + describe(load(gt, ag, i)) + " vs " + describe(load(gt, bg, i)));
    }
    const auto floats = [&](const std::vector<float>& x, const std::vector<float>& y, const std::string& what) {
      if (x.size() != y.size()) return fail(at + " " + what + " sizes " + std::to_string(x.size()) + " vs " + std::to_string(y.size()));
      const auto* xb = reinterpret_cast<const std::byte*>(x.data());
      const auto* yb = reinterpret_cast<const std::byte*>(y.data());
      if (const std::int64_t i = first_difference(DType::f32, xb, yb, static_cast<std::int64_t>(x.size()), false); i >= 0)
        fail(at + " " + what + "[" + std::to_string(i) + "] " + describe(x[i]) + " vs " + describe(y[i]));
    };
    floats(a.masters[t], b.masters[t], "master");
    floats(a.compensations[t], b.compensations[t], "compensation");
    for (std::size_t s = 0; s < std::min(a.state.size(), b.state.size()); ++s) floats(a.state[s][t], b.state[s][t], a.state_names[s]);
  }
  if (failures > 6) ADD_FAILURE() << where << ": ... and " << failures - 6 << " more differences";
}

// ---- Fixtures ----------------------------------------------------------------------------

class CudaGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (where().mode == Mode::skip) GTEST_SKIP() << where().why_skipped;
    if (where().context) where().context->make_current();
  }
};
#define REQUIRE_THE_DEVICE()                                                                          \
  if (!on_gpu()) GTEST_SKIP() << "needs the GPU itself (the CPU stand-in of " << kOnCpuEnv << "=1 " \
                                 "runs only the tests that compare results)"

// One case of the CPU-identity matrix.
struct Case {
  const char* config;
  const char* dtypes;
  Layout layout;
  StepKind kind;
};
std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.config) + "_" + c.dtypes + "_" + layout_name(c.layout) + "_" + kind_name(c.kind);
}
void PrintTo(const Case& c, std::ostream* os) {  // gtest's name for a failing case's parameter
  *os << c.config << " " << c.dtypes << " " << layout_name(c.layout) << " " << kind_name(c.kind);
}
ListLayout case_layout(const Case& c) { return make_layout(kSizes, dtype_set(c.dtypes).cycle, c.layout); }

// A case on both sides: the same weights (weight_image(L, seed)) in host memory and on the
// side under test, and an optimizer over each with the case's options (the CPU backend's
// and the tested device's).
struct SideBySide {
  SideBySide(const Case& c, std::uint32_t seed) : kind(c.kind), L(case_layout(c)), host(L), dev(L) {
    const std::vector<std::byte> w0 = weight_image(L, seed);
    host.set_weights(w0);
    dev.set_weights(w0);
    const OptimizerConfig& config = config_named(c.config);
    const DtypeSet& set = dtype_set(c.dtypes);
    ho.emplace(config, host.params, options_for(kind, set.masters, Device::cpu(), set.stochastic, set.compensated, set.state));
    go.emplace(config, dev.params, options_for(kind, set.masters, test_device(), set.stochastic, set.compensated, set.state));
  }
  // The same gradients on both sides, then a step of each.
  void step(const std::vector<std::byte>& g) {
    host.set_grads(g);
    dev.set_grads(g);
    take_step(*ho, kind);
    take_step(*go, kind);
  }
  Snapshot cpu() const { return snapshot(*ho, host); }
  Snapshot tested() const { return snapshot(*go, dev); }

  StepKind kind;
  ListLayout L;
  HostList host;
  TestList dev;
  std::optional<Optimizer> ho, go;  // declared after the buffers: destroyed first
};

std::vector<Case> every_optimizer_cases() {
  std::vector<Case> cases;
  for (const NamedConfig& c : configs())
    for (const char* d : {"f32", "bf16_masters", "f16_masters", "f16_no_masters", "f32w_bf16g"})
      for (StepKind k : {StepKind::plain, StepKind::scaled, StepKind::clipped}) cases.push_back({c.name, d, Layout::separate, k});
  return cases;
}
std::vector<Case> layout_cases() {
  std::vector<Case> cases;
  for (const char* c : {"SGD_momentum", "AdamW", "Adagrad", "RMSprop_centered", "Lion"})
    for (const char* d : {"f32", "bf16_masters"})
      for (Layout l : {Layout::flat, Layout::misaligned})
        for (StepKind k : {StepKind::plain, StepKind::scaled, StepKind::clipped}) cases.push_back({c, d, l, k});
  for (const char* c : {"SGD_momentum", "AdamW", "RMSprop_centered_momentum", "Lion"})
    for (StepKind k : {StepKind::plain, StepKind::scaled, StepKind::clipped}) cases.push_back({c, "mixed", Layout::separate, k});
  for (const char* c : {"AdamW", "Adagrad", "Lion"})
    for (const char* d : {"f32", "bf16_masters", "f16_no_masters"})
      cases.push_back({c, d, Layout::separate, StepKind::scaled_clipped_inf});
  cases.push_back({"AdamW", "bf16_masters", Layout::flat, StepKind::scaled_clipped_inf});
  // Stochastic rounding (jit/stochastic_round.h): every element's bits as the CPU's.
  for (const char* c : {"AdamW", "SGD_momentum", "Lion"})
    for (Layout l : {Layout::separate, Layout::misaligned})
      for (StepKind k : {StepKind::plain, StepKind::scaled, StepKind::clipped}) cases.push_back({c, "bf16_stochastic", l, k});
  // Compensated weights: the bf16 compensation beside each bf16 weight, bitwise the CPU's;
  // LAMB's phase 1 reads the parameter.
  for (const char* c : {"AdamW", "SGD_momentum", "Lion", "LAMB"})
    for (Layout l : {Layout::separate, Layout::misaligned})
      for (StepKind k : {StepKind::plain, StepKind::scaled, StepKind::clipped}) cases.push_back({c, "bf16_compensated", l, k});
  cases.push_back({"AdamW", "bf16_compensated", Layout::flat, StepKind::scaled_clipped_inf});
  // State stored as q8 (a warp per block of 256, codes and absmaxes as the CPU's; LAMB's
  // phase 1 a strided block per warp) and bf16 (LAMB's two phases too).
  for (const char* c : {"AdamW", "SGD_momentum", "Lion", "Adagrad", "RMSprop_centered_momentum", "LAMB"})
    for (const char* d : {"f32_q8", "bf16_stochastic_q8"})
      for (Layout l : {Layout::separate, Layout::misaligned})
        for (StepKind k : {StepKind::plain, StepKind::scaled, StepKind::clipped}) cases.push_back({c, d, l, k});
  for (StepKind k : {StepKind::scaled, StepKind::scaled_clipped_inf}) cases.push_back({"AdamW", "mixed_q8", Layout::separate, k});
  for (const char* c : {"AdamW", "LAMB"})
    for (StepKind k : {StepKind::plain, StepKind::clipped}) cases.push_back({c, "bf16_masters_bf16_state", Layout::separate, k});
  return cases;
}
std::vector<Case> non_finite_cases() {
  std::vector<Case> cases;
  for (const char* c : {"AdamW", "SGD_momentum", "Lion"})
    for (const char* d : {"f32", "bf16_masters", "f16_masters"})
      for (StepKind k : {StepKind::scaled, StepKind::clipped, StepKind::scaled_clipped_inf}) cases.push_back({c, d, Layout::separate, k});
  for (const char* c : {"AdamW", "Lion"})  // a skipped step leaves the codes and absmaxes as they were
    cases.push_back({c, "bf16_stochastic_q8", Layout::separate, StepKind::scaled});
  return cases;
}

// ---- The environment: mode, context, and the kernels compiled up front --------------------

// Compiles (or loads from the disk cache) the step module of every parameterized case at
// once on all cores, before the tests: NVRTC takes about a second per module on one core,
// and the tests then find them in the kernel cache. Errors are left for the tests to meet.
void prewarm_kernel_cache(int sm) {
  const auto t0 = Clock::now();
  std::map<std::string, jit::CudaSpec> specs;  // by canonical text
  std::vector<Case> cases = every_optimizer_cases();
  for (const auto& more : {layout_cases(), non_finite_cases()}) cases.insert(cases.end(), more.begin(), more.end());
  // Arena addresses as cuMemAlloc gives them (256-byte aligned): the spec depends only on
  // the layout class, which the offsets decide.
  auto* w = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
  auto* g = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 41);
  for (const Case& c : cases) {
    const OptimizerConfig& config = config_named(c.config);
    const ListLayout L = case_layout(c);
    const DtypeSet& set = dtype_set(c.dtypes);
    const OptimizerOptions o = options_for(c.kind, set.masters, Device::cuda(0), set.stochastic, set.compensated, set.state);
    const jit::CudaLayout layout =
        jit::plan_cuda_layout(jit::builtin_program(jit::select_builtin(config)), L.params(w, g), o);
    specs.emplace(jit::canonical_text(layout.spec), layout.spec);
  }
  std::vector<const jit::CudaSpec*> list;
  for (const auto& [key, spec] : specs) list.push_back(&spec);
  const jit::CudaTarget target = jit::target_for_device(sm / 10, sm % 10);
  std::atomic<std::size_t> next{0};
  const unsigned n = std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 64);
  std::vector<std::thread> pool;
  for (unsigned k = 0; k < n; ++k)
    pool.emplace_back([&, k] {
      // A module that does not compile is reported by the test that needs it.
      try {
        if (k == 0) jit::cuda_utility_image(target);
      } catch (const std::exception&) {
      }
      for (std::size_t i; (i = next++) < list.size();) {
        try {
          jit::cuda_step_images(*list[i], target);
        } catch (const std::exception&) {
        }
      }
    });
  for (std::thread& t : pool) t.join();
  const jit::CacheStats s = jit::KernelCache::shared().stats();
  std::printf("[ prewarm  ] %zu step modules for %s on %u threads in %.1f s (%llu compiled, %llu from the disk cache)\n",
              list.size(), jit::arch_name(target).c_str(), n, ms_since(t0) / 1e3,
              static_cast<unsigned long long>(s.compiles), static_cast<unsigned long long>(s.disk_hits));
  std::fflush(stdout);
}

class GpuEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    Where& w = where();
    const CudaStatus status = cuda_available();
    if (status) {
      w.mode = Mode::gpu;
      if (std::getenv(kChildEnv) != nullptr) return;  // the child makes and drops its own contexts
      w.context = std::make_unique<detail::CudaContext>(0);
      try {
        prewarm_kernel_cache(w.context->sm());
      } catch (const std::exception& e) {  // the tests meet the problem themselves
        std::printf("[ prewarm  ] failed: %s\n", e.what());
      }
    } else if (const char* v = std::getenv(kOnCpuEnv); v != nullptr && std::string_view(v) == "1") {
      w.mode = Mode::cpu_stand_in;
      std::printf("[ stand-in ] no GPU (%s): %s=1, the CPU backend stands in for it\n", status.reason.c_str(), kOnCpuEnv);
    } else {
      w.mode = Mode::skip;
      w.why_skipped = "no GPU: " + status.reason;
    }
  }
  void TearDown() override { where().context.reset(); }
};
[[maybe_unused]] ::testing::Environment* const kEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

// ---- Bitwise identity with the CPU backend ----------------------------------------------

class MatchesCpu : public CudaGpu, public ::testing::WithParamInterface<Case> {};

TEST_P(MatchesCpu, AfterOneAndFourSteps) {
  const Case& c = GetParam();
  SideBySide both(c, 1);
  for (int step = 1; step <= 4; ++step) {
    both.step(grad_image(both.L, 100 + step, grad_scale(c.kind)));
    if (step == 1 || step == 4) {  // steps 2-4 run back to back, without a host copy of the state
      const Snapshot a = both.tested(), b = both.cpu();
      expect_identical(a, b, both.L, "after step " + std::to_string(step));
      EXPECT_TRUE(a.result.applied) << "every gradient is finite";
      EXPECT_EQ(a.step_count, step);
      if (HasFailure()) return;
    }
  }
}
INSTANTIATE_TEST_SUITE_P(EveryOptimizer, MatchesCpu, ::testing::ValuesIn(every_optimizer_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Layouts, MatchesCpu, ::testing::ValuesIn(layout_cases()), case_name);

// ---- Non-finite gradients ------------------------------------------------------------------

class SkipsNonFinite : public CudaGpu, public ::testing::WithParamInterface<Case> {};

TEST_P(SkipsNonFinite, WritesNothingAndTheNextFiniteStepProceeds) {
  const Case& c = GetParam();
  SideBySide both(c, 2);
  const ListLayout& L = both.L;
  both.step(grad_image(L, 11, grad_scale(c.kind)));  // a finite step first: the state is not all zeros
  const Snapshot before = both.tested();
  ASSERT_TRUE(before.result.applied);

  for (Poison p : {Poison::inf_and_nan, Poison::inf, Poison::nan}) {
    const std::string what = p == Poison::inf_and_nan ? "inf and NaN" : p == Poison::inf ? "inf" : "NaN";
    both.step(grad_image(L, 12, grad_scale(c.kind), p));
    const Snapshot after = both.tested(), cpu = both.cpu();
    EXPECT_FALSE(after.result.applied) << what;
    EXPECT_TRUE(after.result.found_inf) << what;
    EXPECT_TRUE(std::isinf(after.result.grad_norm) && after.result.grad_norm > 0) << what << ": " << after.result.grad_norm;
    EXPECT_EQ(after.step_count, 1) << what;
    // Nothing written: weights, state and masters as before the step.
    expect_identical(after, before, L, what + " gradients: against the state before", {.results = false, .grads = false});
    expect_identical(after, cpu, L, what + " gradients: against the CPU");
    if (HasFailure()) return;
  }

  both.step(grad_image(L, 13, grad_scale(c.kind)));
  const Snapshot a = both.tested(), b = both.cpu();
  EXPECT_TRUE(a.result.applied);
  EXPECT_EQ(a.step_count, 2);
  expect_identical(a, b, L, "the finite step after the skipped ones");
}
INSTANTIATE_TEST_SUITE_P(Optimizers, SkipsNonFinite, ::testing::ValuesIn(non_finite_cases()), case_name);

// ---- CUDA graphs ---------------------------------------------------------------------------

// torch._amp_update_scale_ on the host: the scale and growth tracker after iterations whose
// gradients were finite or not.
std::pair<double, std::int64_t> expected_scale(double scale, std::int64_t interval, const std::vector<bool>& finite) {
  std::int64_t tracker = 0;
  for (bool f : finite) {
    if (!f) {
      scale = static_cast<float>(scale * 0.5), tracker = 0;
    } else if (tracker + 1 >= interval) {
      scale = static_cast<float>(scale * 2.0), tracker = 0;
    } else {
      ++tracker;
    }
  }
  return {scale, tracker};
}

// A stream and an instantiated graph, released (the stream after waiting for it) on scope exit.
struct OwnedStream {
  cuda::CUstream s = nullptr;
  ~OwnedStream() {
    if (s) drv().cuStreamSynchronize(s), drv().cuStreamDestroy(s);
  }
};
struct OwnedGraph {
  cuda::CUgraph graph = nullptr;
  cuda::CUgraphExec exec = nullptr;
  ~OwnedGraph() {
    if (exec) drv().cuGraphExecDestroy(exec);
    if (graph) drv().cuGraphDestroy(graph);
  }
};

TEST_F(CudaGpu, CapturedScalerIterationReplaysLikeEagerIterations) {
  REQUIRE_THE_DEVICE();
  const cuda::DriverApi& api = drv();
  OwnedStream stream;  // declared first: it outlives the optimizers, whose destructors wait for it
  check(api.cuStreamCreate(&stream.s, cuda::CU_STREAM_NON_BLOCKING), "cuStreamCreate");

  const ListLayout L = make_layout(kSizes, {{DType::bf16, DType::bf16}}, Layout::separate);
  TestList la(L), lb(L);  // la: stepped by the graph; lb: eagerly
  const std::vector<std::byte> w0 = weight_image(L, 3);
  la.set_weights(w0);
  lb.set_weights(w0);
  // The gradients of the warm-up (0) and of each replay (1..8), staged on the device; replay
  // 3 has an inf, replay 6 a NaN.
  const std::vector<bool> finite = {true, true, true, false, true, true, false, true, true};
  std::vector<std::unique_ptr<TestBuffer>> staged;
  for (std::size_t k = 0; k < finite.size(); ++k) {
    staged.push_back(std::make_unique<TestBuffer>(L.g_bytes));
    staged.back()->upload(grad_image(L, 20 + static_cast<std::uint32_t>(k), 1024.0f,
                                     finite[k] ? Poison::none : k == 3 ? Poison::inf : Poison::nan));
  }
  const auto load_grads = [&](std::size_t k) {  // enqueued on the stream, outside any capture
    check(api.cuMemcpyDtoDAsync(la.g.address(), staged[k]->address(), L.g_bytes, stream.s), "cuMemcpyDtoDAsync");
    check(api.cuMemcpyDtoDAsync(lb.g.address(), staged[k]->address(), L.g_bytes, stream.s), "cuMemcpyDtoDAsync");
  };

  OptimizerOptions o;
  o.device = Device::cuda(0);
  o.cuda_stream = stream.s;
  o.max_grad_norm = kMaxNorm;
  const OptimizerConfig& config = config_named("AdamW");
  Optimizer oa(config, la.params, o), ob(config, lb.params, o);
  GradScaler sa("cuda", 1024.0, 2.0, 0.5, 2), sb("cuda", 1024.0, 2.0, 0.5, 2);

  // Warm-up: moves the scale to the device (a synchronous copy, which capture would refuse).
  load_grads(0);
  sa.step(oa);
  sa.update();
  sb.step(ob);
  sb.update();
  check(api.cuStreamSynchronize(stream.s), "cuStreamSynchronize");
  ASSERT_EQ(sa.where_scale_lives(), Device::cuda(0));

  // Capture one iteration. Thread-local mode: any call that could synchronize is an error.
  check(api.cuStreamBeginCapture(stream.s, cuda::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
  std::string error;
  try {
    sa.step(oa);
    sa.update();
  } catch (const std::exception& e) {
    error = e.what();
  }
  int status = -1;
  const cuda::CUresult is_capturing = api.cuStreamIsCapturing(stream.s, &status);
  OwnedGraph g;
  const cuda::CUresult end = api.cuStreamEndCapture(stream.s, &g.graph);
  ASSERT_TRUE(error.empty()) << "GradScaler::step/update during stream capture threw: " << error;
  ASSERT_EQ(is_capturing, cuda::CUDA_SUCCESS);
  ASSERT_EQ(status, cuda::CU_STREAM_CAPTURE_STATUS_ACTIVE) << "the capture was invalidated inside the step";
  ASSERT_EQ(end, cuda::CUDA_SUCCESS) << "cuStreamEndCapture failed: a call inside the step broke the capture";
  check(api.cuGraphInstantiate(&g.exec, g.graph, 0), "cuGraphInstantiate");

  for (std::size_t k = 1; k < finite.size(); ++k) {
    load_grads(k);
    check(api.cuGraphLaunch(g.exec, stream.s), "cuGraphLaunch");
    sb.step(ob);
    sb.update();
  }
  check(api.cuStreamSynchronize(stream.s), "cuStreamSynchronize");

  const Snapshot a = snapshot(oa, la), b = snapshot(ob, lb);
  expect_identical(a, b, L, "graph replays against eager iterations");
  EXPECT_EQ(a.step_count, std::count(finite.begin(), finite.end(), true));
  EXPECT_NE(a.weights, w0) << "the replays changed nothing";
  EXPECT_EQ(sa.state_dict(), sb.state_dict());
  const auto [scale, tracker] = expected_scale(1024.0, 2, finite);
  EXPECT_EQ(sa.get_scale(), scale);
  EXPECT_EQ(sa.growth_tracker(), tracker);
}

// PyTorch's capturable=True with a tensor lr: two param groups, one iteration captured,
// and a per-group lr schedule changed with set_lr between replays. The replays use each
// step's lr (the rules live in device memory): bitwise the eager iterations.
TEST_F(CudaGpu, CapturedGroupsFollowAnLrScheduleBetweenReplays) {
  REQUIRE_THE_DEVICE();
  const cuda::DriverApi& api = drv();
  OwnedStream stream;
  check(api.cuStreamCreate(&stream.s, cuda::CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  const ListLayout L = make_layout(kSizes, {{DType::bf16, DType::bf16}}, Layout::separate);
  TestList la(L), lb(L);
  const std::vector<std::byte> w0 = weight_image(L, 5);
  la.set_weights(w0);
  lb.set_weights(w0);
  constexpr int kReplays = 6;
  std::vector<std::unique_ptr<TestBuffer>> staged;
  for (int k = 0; k <= kReplays; ++k) {
    staged.push_back(std::make_unique<TestBuffer>(L.g_bytes));
    staged.back()->upload(grad_image(L, 40 + static_cast<std::uint32_t>(k), 1024.0f, Poison::none));
  }
  const auto load_grads = [&](int k) {
    check(api.cuMemcpyDtoDAsync(la.g.address(), staged[static_cast<std::size_t>(k)]->address(), L.g_bytes, stream.s),
          "cuMemcpyDtoDAsync");
    check(api.cuMemcpyDtoDAsync(lb.g.address(), staged[static_cast<std::size_t>(k)]->address(), L.g_bytes, stream.s),
          "cuMemcpyDtoDAsync");
  };
  const auto groups = [](const std::vector<Param>& params) {
    const auto half = static_cast<std::ptrdiff_t>(params.size() / 2);
    return std::vector<ParamGroup>{{{params.begin(), params.begin() + half}, optim::AdamW{.lr = 1e-3, .weight_decay = 0.1}},
                                   {{params.begin() + half, params.end()}, optim::AdamW{.lr = 1e-3, .weight_decay = 0.0}}};
  };
  OptimizerOptions o;
  o.device = Device::cuda(0);
  o.cuda_stream = stream.s;
  o.max_grad_norm = kMaxNorm;
  Optimizer oa(groups(la.params), o), ob(groups(lb.params), o);
  GradScaler sa("cuda", 1024.0), sb("cuda", 1024.0);
  load_grads(0);
  sa.step(oa), sa.update(), sb.step(ob), sb.update();
  check(api.cuStreamSynchronize(stream.s), "cuStreamSynchronize");

  check(api.cuStreamBeginCapture(stream.s, cuda::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
  std::string error;
  try {
    sa.step(oa);
    sa.update();
  } catch (const std::exception& e) {
    error = e.what();
  }
  OwnedGraph g;
  ASSERT_EQ(api.cuStreamEndCapture(stream.s, &g.graph), cuda::CUDA_SUCCESS);
  ASSERT_TRUE(error.empty()) << error;
  check(api.cuGraphInstantiate(&g.exec, g.graph, 0), "cuGraphInstantiate");
  for (int k = 1; k <= kReplays; ++k) {
    const double lr0 = 1e-3 * k / kReplays, lr1 = 3e-3 / k;  // warmup in group 0, decay in group 1
    oa.set_lr(0, lr0), oa.set_lr(1, lr1);
    ob.set_lr(0, lr0), ob.set_lr(1, lr1);
    load_grads(k);
    check(api.cuGraphLaunch(g.exec, stream.s), "cuGraphLaunch");
    sb.step(ob);
    sb.update();
  }
  check(api.cuStreamSynchronize(stream.s), "cuStreamSynchronize");
  const Snapshot a = snapshot(oa, la), b = snapshot(ob, lb);
  expect_identical(a, b, L, "graph replays with an lr schedule against eager iterations");
  EXPECT_EQ(a.step_count, kReplays + 1);
}

// ---- Determinism ---------------------------------------------------------------------------

TEST_F(CudaGpu, RunsAreBitwiseIdentical) {
  // Large enough for many reduce blocks (their partials meet in the last block to finish).
  const ListLayout L = make_layout({1048579, 65536, 5, 300001, 0}, {{DType::bf16, DType::bf16}}, Layout::separate);
  TestList la(L), lb(L);
  HostList host(L);
  const std::vector<std::byte> w0 = weight_image(L, 4);
  la.set_weights(w0), lb.set_weights(w0), host.set_weights(w0);
  OptimizerOptions o = options_for(StepKind::clipped, true, test_device());
  const OptimizerConfig& config = config_named("AdamW");
  Optimizer oa(config, la.params, o), ob(config, lb.params, o);
  o.device = Device::cpu();
  Optimizer ho(config, host.params, o);
  for (int step = 1; step <= 5; ++step) {
    const std::vector<std::byte> g = grad_image(L, 30 + step, kLossScale);
    la.set_grads(g), lb.set_grads(g), host.set_grads(g);
    for (Optimizer* opt : {&oa, &ob, &ho}) opt->step_scaled(kLossScale);
    const StepResult ra = oa.last_result(), rb = ob.last_result();
    EXPECT_TRUE(ra.applied);
    EXPECT_TRUE(same_double(ra.grad_norm, rb.grad_norm) && same_double(ra.clip_coef, rb.clip_coef))
        << "step " << step << ": norms " << ra.grad_norm << " vs " << rb.grad_norm;
  }
  const Snapshot a = snapshot(oa, la);
  expect_identical(a, snapshot(ob, lb), L, "two runs");
  expect_identical(a, snapshot(ho, host), L, "against the CPU");
}

// ---- GradScaler on the device ------------------------------------------------------------------

TEST_F(CudaGpu, DeviceGradScalerWithUnscaleFollowsTheCpuScaler) {
  const ListLayout L = make_layout(kSizes, {{DType::f16, DType::f16}}, Layout::separate);
  HostList host(L);
  TestList dev(L);
  const std::vector<std::byte> w0 = weight_image(L, 5);
  host.set_weights(w0);
  dev.set_weights(w0);
  const OptimizerConfig& config = config_named("AdamW");
  Optimizer ho(config, host.params, options_for(StepKind::clipped, true, Device::cpu()));
  Optimizer go(config, dev.params, options_for(StepKind::clipped, true, test_device()));
  GradScaler hs("cpu", 1024.0, 2.0, 0.5, 2), gs("cuda", 1024.0, 2.0, 0.5, 2);
  struct Iteration {
    Poison poison;
    bool unscale;
  };
  const Iteration iterations[] = {{Poison::none, false}, {Poison::none, true}, {Poison::inf, false},
                                  {Poison::none, true},  {Poison::nan, true},  {Poison::none, false},
                                  {Poison::none, true},  {Poison::none, false}, {Poison::none, false}};
  int k = 0;
  for (const Iteration& it : iterations) {
    const std::string at = "iteration " + std::to_string(k);
    const std::vector<std::byte> g = grad_image(L, 50 + static_cast<std::uint32_t>(k++), 64.0f, it.poison);
    host.set_grads(g);
    dev.set_grads(g);
    if (it.unscale) {
      hs.unscale_(ho);
      gs.unscale_(go);
      const std::vector<std::byte> hg = host.grads(), dg = dev.grads();
      for (std::size_t t = 0; t < L.size(); ++t) {
        const std::int64_t i = first_difference(DType::f16, dg.data() + L.g_off[t], hg.data() + L.g_off[t], L.sizes[t], true);
        EXPECT_LT(i, 0) << at << ": unscale_ differs in tensor " << t << " element " << i;
      }
    }
    hs.step(ho);
    gs.step(go);
    const StepResult hr = hs.last_step_result(), gr = gs.last_step_result();
    EXPECT_EQ(hr.applied, it.poison == Poison::none) << at;
    EXPECT_EQ(gr.applied, hr.applied) << at;
    EXPECT_EQ(gr.found_inf, hr.found_inf) << at;
    if (hr.applied) {
      EXPECT_TRUE(same_double(gr.grad_norm, hr.grad_norm) && same_double(gr.clip_coef, hr.clip_coef))
          << at << ": norm " << gr.grad_norm << " vs " << hr.grad_norm;
    }
    hs.update();
    gs.update();
    EXPECT_EQ(gs.state_dict(), hs.state_dict()) << at;
    EXPECT_EQ(gs.get_scale(), hs.get_scale()) << at;
    EXPECT_EQ(gs.growth_tracker(), hs.growth_tracker()) << at;
  }
  if (on_gpu()) {
    EXPECT_EQ(gs.where_scale_lives(), Device::cuda(0));
  }
  expect_identical(snapshot(go, dev), snapshot(ho, host), L, "after the iterations");
}

// ---- Checkpoints and hyperparameters -------------------------------------------------------

class TempPath {
 public:
  explicit TempPath(const std::string& name)
      : path_(fs::temp_directory_path() / (name + "." + std::to_string(::getpid()) + ".sfckpt")) {}
  ~TempPath() {
    std::error_code ec;
    fs::remove(path_, ec);
  }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

TEST_F(CudaGpu, CheckpointResumesBitForBit) {
  const ListLayout L = make_layout(kSizes, {{DType::bf16, DType::bf16}}, Layout::separate);
  const OptimizerConfig& config = config_named("AdamW_amsgrad");
  const OptimizerOptions o = options_for(StepKind::clipped, true, test_device());
  const auto iterate = [&](Optimizer& opt, GradScaler& s, TestList& l, int k) {
    l.set_grads(grad_image(L, 60 + static_cast<std::uint32_t>(k), 256.0f, k == 2 ? Poison::inf : Poison::none));
    s.step(opt);
    s.update();
  };
  TempPath path("cuda_gpu_test_checkpoint");
  TestList la(L);
  la.set_weights(weight_image(L, 6));
  Optimizer oa(config, la.params, o);
  GradScaler sa("cuda", 1024.0, 2.0, 0.5, 2);
  for (int k = 0; k < 4; ++k) iterate(oa, sa, la, k);
  const std::vector<std::byte> saved_weights = la.weights();  // the caller saves the weights
  const auto saved_scaler = sa.state_dict();
  const std::int64_t saved_steps = oa.step_count();
  oa.save(path.str(), sa);
  for (int k = 4; k < 7; ++k) iterate(oa, sa, la, k);
  const Snapshot want = snapshot(oa, la);

  TestList lb(L);
  lb.set_weights(saved_weights);
  Optimizer ob(config, lb.params, o);
  GradScaler sb("cuda");  // its state comes from the file
  ob.load(path.str(), sb);
  EXPECT_EQ(ob.step_count(), saved_steps);
  EXPECT_EQ(sb.state_dict(), saved_scaler);
  for (int k = 4; k < 7; ++k) iterate(ob, sb, lb, k);
  expect_identical(snapshot(ob, lb), want, L, "resumed from the checkpoint");
  EXPECT_EQ(sb.state_dict(), sa.state_dict());
}

TEST_F(CudaGpu, SetLrAndSetConfigTakeEffectWithoutCompiling) {
  const ListLayout L = make_layout(kSizes, {{DType::bf16, DType::bf16}}, Layout::separate);
  HostList host(L);
  TestList dev(L), same(L);  // same: keeps the first hyperparameters
  const std::vector<std::byte> w0 = weight_image(L, 8);
  host.set_weights(w0), dev.set_weights(w0), same.set_weights(w0);
  const OptimizerConfig& config = config_named("AdamW");
  Optimizer ho(config, host.params, options_for(StepKind::scaled, true, Device::cpu()));
  Optimizer go(config, dev.params, options_for(StepKind::scaled, true, test_device()));
  Optimizer gs(config, same.params, options_for(StepKind::scaled, true, test_device()));
  const auto step_all = [&](int k) {
    const std::vector<std::byte> g = grad_image(L, 70 + static_cast<std::uint32_t>(k), kLossScale);
    host.set_grads(g), dev.set_grads(g), same.set_grads(g);
    for (Optimizer* opt : {&ho, &go, &gs}) opt->step_scaled(kLossScale);
  };
  step_all(0);
  step_all(1);
  const jit::CacheStats before = jit::KernelCache::shared().stats();
  for (Optimizer* opt : {&ho, &go}) opt->set_lr(7e-3);
  step_all(2);
  optim::AdamW changed = std::get<optim::AdamW>(config);
  changed.lr = 3e-3, changed.beta1 = 0.8, changed.beta2 = 0.99, changed.eps = 1e-6, changed.weight_decay = 0.2;
  for (Optimizer* opt : {&ho, &go}) opt->set_config(changed);
  step_all(3);
  const jit::CacheStats after = jit::KernelCache::shared().stats();
  EXPECT_EQ(after.compiles, before.compiles) << "set_lr/set_config compiled something";
  EXPECT_EQ(after.memory_hits + after.disk_hits, before.memory_hits + before.disk_hits) << "a step looked up a kernel";
  expect_identical(snapshot(go, dev), snapshot(ho, host), L, "after set_lr and set_config");
  EXPECT_NE(dev.weights(), same.weights()) << "set_lr/set_config changed nothing on the GPU";
}

// Param groups running different variants of a program in the same kernels (amsgrad in
// one group; SGD with momentum, without and nesterov): bitwise the CPU's, clipped steps.
TEST_F(CudaGpu, GroupsWithDifferentProgramVariantsMatchTheCpu) {
  const ListLayout L = make_layout(kSizes, {{DType::bf16, DType::bf16}, {DType::f32, DType::f32}}, Layout::separate);
  const std::vector<std::vector<OptimizerConfig>> mixes = {
      {optim::Adam{.lr = 1e-3}, optim::Adam{.lr = 2e-3, .weight_decay = 0.01, .amsgrad = true}, optim::Adam{.lr = 5e-4}},
      {optim::SGD{.lr = 0.1, .momentum = 0.9}, optim::SGD{.lr = 0.05},
       optim::SGD{.lr = 0.01, .momentum = 0.8, .nesterov = true}}};
  for (std::size_t m = 0; m < mixes.size(); ++m) {
    SCOPED_TRACE("mix " + std::to_string(m));
    const auto groups = [&](const std::vector<Param>& p) {  // thirds of the list
      const std::size_t third = p.size() / 3;
      std::vector<ParamGroup> out;
      for (std::size_t g = 0; g < 3; ++g)
        out.push_back({{p.begin() + static_cast<std::ptrdiff_t>(g * third),
                        g == 2 ? p.end() : p.begin() + static_cast<std::ptrdiff_t>((g + 1) * third)},
                       mixes[m][g]});
      return out;
    };
    HostList host(L);
    TestList dev(L);
    const std::vector<std::byte> w0 = weight_image(L, 12);
    host.set_weights(w0), dev.set_weights(w0);
    Optimizer ho(groups(host.params), options_for(StepKind::clipped, true, Device::cpu()));
    Optimizer go(groups(dev.params), options_for(StepKind::clipped, true, test_device()));
    for (int k = 0; k < 3; ++k) {
      const std::vector<std::byte> g = grad_image(L, 90 + static_cast<std::uint32_t>(k), kLossScale);
      host.set_grads(g), dev.set_grads(g);
      take_step(ho, StepKind::clipped), take_step(go, StepKind::clipped);
    }
    expect_identical(snapshot(go, dev), snapshot(ho, host), L, "after 3 clipped steps");
  }
}

// ---- The kernel cache ----------------------------------------------------------------------

TEST_F(CudaGpu, SecondOptimizerWithTheSameSpecCompilesNothing) {
  REQUIRE_THE_DEVICE();
  jit::KernelCache& cache = jit::KernelCache::shared();
  // A spec no other test here uses: RMSprop centered + momentum, f32 weights with f16
  // gradients, inf-norm clipping.
  optim::RMSprop config;
  config.centered = true, config.momentum = 0.9, config.lr = 1e-3;
  const ListLayout L = make_layout(kSizes, {{DType::f32, DType::f16}}, Layout::separate);
  const OptimizerOptions o = options_for(StepKind::scaled_clipped_inf, true, Device::cuda(0));
  TestList la(L), lb(L);
  const std::vector<std::byte> w0 = weight_image(L, 9), g0 = grad_image(L, 90, kLossScale);
  la.set_weights(w0), lb.set_weights(w0), la.set_grads(g0), lb.set_grads(g0);

  const jit::CacheStats s0 = cache.stats();
  auto t0 = Clock::now();
  Optimizer oa(config, la.params, o);
  const double first_ms = ms_since(t0);
  const jit::CacheStats s1 = cache.stats();
  const char* first = s1.compiles > s0.compiles ? "cold compile" : s1.disk_hits > s0.disk_hits ? "disk-cache hit" : "memory-cache hit";
  t0 = Clock::now();
  Optimizer ob(config, lb.params, o);
  const double second_ms = ms_since(t0);
  const jit::CacheStats s2 = cache.stats();
  EXPECT_EQ(s2.compiles, s1.compiles) << "the second optimizer compiled its kernels again";
  EXPECT_EQ(s2.disk_hits, s1.disk_hits) << "the second optimizer went to the disk cache";
  EXPECT_GT(s2.memory_hits, s1.memory_hits);
  oa.step_scaled(kLossScale);
  ob.step_scaled(kLossScale);
  expect_identical(snapshot(oa, la), snapshot(ob, lb), L, "two optimizers sharing the cached kernels");

  // The cache by itself, for the spec the optimizers run (two modules: reduce and update).
  const detail::CudaBackend& backend = *detail_access::engine(oa).cuda();
  const jit::CudaTarget target = jit::target_for_device(backend.context().sm() / 10, backend.context().sm() % 10);
  constexpr int kHits = 200;
  t0 = Clock::now();
  for (int i = 0; i < kHits; ++i) jit::cuda_step_images(backend.spec(), target);  // key texts + lookups
  const double memory_hit_us = ms_since(t0) * 1e3 / kHits;
  EXPECT_EQ(cache.stats().compiles, s2.compiles);
  // A cold miss pays NVRTC for both modules (side by side: the longer of the two).
  t0 = Clock::now();
  const std::string reduce_bin = jit::nvrtc_compile(jit::emit_cuda_reduce(backend.spec()), "cold_reduce.cu", target);
  const double cold_reduce_ms = ms_since(t0);
  t0 = Clock::now();
  const std::string update_bin = jit::nvrtc_compile(jit::emit_cuda_update(backend.spec()), "cold_update.cu", target);
  const double cold_update_ms = ms_since(t0);
  EXPECT_FALSE(reduce_bin.empty() || update_bin.empty());
  double disk_hit_ms = NAN;
  if (cache.disk_enabled()) {
    cache.clear_memory();  // forgets the entries (and the counters): the next lookups go to the disk
    t0 = Clock::now();
    jit::cuda_step_images(backend.spec(), target);
    disk_hit_ms = ms_since(t0);
    EXPECT_EQ(cache.stats().disk_hits, 2u);
    EXPECT_EQ(cache.stats().compiles, 0u);
  }
  std::printf("[ kernel cache ] first optimizer: %s, constructed in %.1f ms (last compile %.1f ms); second: %.2f ms; "
              "cold NVRTC compile: reduce %.1f ms, update %.1f ms; disk-cache hit: %.2f ms%s; memory-cache hit: %.2f us\n",
              first, first_ms, s1.last_compile_ms, second_ms, cold_reduce_ms, cold_update_ms, disk_hit_ms,
              cache.disk_enabled() ? "" : " (disk cache off)", memory_hit_us);
  std::fflush(stdout);
}

// ---- A fresh primary context ---------------------------------------------------------------

struct ChildResult {
  int status = -1;
  std::string out;
};

// Runs this binary again with `args` and kChildEnv set; returns its exit status and output.
ChildResult run_self(const std::vector<std::string>& args) {
  std::vector<std::string> argv_s = {"cuda_gpu_test"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<std::string> env_s = {std::string(kChildEnv) + "=1"};
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, kChildEnv, std::strlen(kChildEnv)) != 0) env_s.emplace_back(*e);
  std::vector<char*> argv, envp;
  for (std::string& s : argv_s) argv.push_back(s.data());
  for (std::string& s : env_s) envp.push_back(s.data());
  argv.push_back(nullptr);
  envp.push_back(nullptr);
  int fds[2];
  if (pipe(fds) != 0) return {};
  const pid_t pid = fork();
  if (pid == 0) {  // only async-signal-safe calls until exec
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    execve("/proc/self/exe", argv.data(), envp.data());
    _exit(127);
  }
  close(fds[1]);
  ChildResult r;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) r.out.append(buf, static_cast<std::size_t>(n));
  close(fds[0]);
  int status = 0;
  if (pid > 0 && waitpid(pid, &status, 0) == pid) r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// Run by the next test in a child process (disabled otherwise). Each round retains the
// primary context, steps an optimizer, and releases everything: the context is reset
// between the rounds, and the second round must not use anything the first one loaded.
TEST(CudaGpuChild, DISABLED_TwoRoundsEachWithAFreshPrimaryContext) {
  if (std::getenv(kChildEnv) == nullptr) GTEST_SKIP() << "run by CudaGpu.OptimizerWorksAfterThePrimaryContextWasReset";
  if (!on_gpu()) GTEST_SKIP() << "no GPU";
  for (int round = 0; round < 2; ++round) {
    const detail::CudaContext context(0);  // released last in the round
    const ListLayout L = make_layout({5000, 17}, {{DType::bf16, DType::bf16}}, Layout::separate);
    TestList dev(L);
    HostList host(L);
    const std::vector<std::byte> w0 = weight_image(L, 10), g = grad_image(L, 91, kLossScale);
    dev.set_weights(w0), host.set_weights(w0), dev.set_grads(g), host.set_grads(g);
    Optimizer go(config_named("AdamW"), dev.params, options_for(StepKind::scaled, true, Device::cuda(0)));
    Optimizer ho(config_named("AdamW"), host.params, options_for(StepKind::scaled, true, Device::cpu()));
    go.step_scaled(kLossScale);
    ho.step_scaled(kLossScale);
    expect_identical(snapshot(go, dev), snapshot(ho, host), L, "round " + std::to_string(round));
    std::printf("round %d done\n", round);
    std::fflush(stdout);
  }
}

TEST_F(CudaGpu, OptimizerWorksAfterThePrimaryContextWasReset) {
  REQUIRE_THE_DEVICE();
  const ChildResult r = run_self({"--gtest_filter=CudaGpuChild.DISABLED_TwoRoundsEachWithAFreshPrimaryContext",
                                  "--gtest_also_run_disabled_tests"});
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("round 1 done"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace stepfuse
