// stepfuse-bench --backend cuda (see cuda_bench.hpp). Phases, in this order on purpose:
//   0. the library's answer to the configuration, from a 16-element CPU optimizer (the same
//      validation as on the GPU, and nothing compiled for it);
//   1. buffers: weights and gradients filled on the host with the CPU path's values
//      (model_buffers.hpp) and copied to one device allocation per tensor, as a framework
//      holds a model;
//   2. the optimizer on GPU 0 with a non-blocking stream, and the kernel cache's costs
//      around its construction: what the first construction did (cold compile or a
//      disk-cache hit), then a disk-cache hit and a memory-cache hit of its step modules;
//   3. verify: its first step against one CPU fused step over the same values (every
//      weight, master and state value within fp32 rounding, exit code 2 otherwise; the
//      share that is bitwise equal is reported: docs/architecture.md §5 promises all of it);
//   4. measure: one step captured into a CUDA graph (not run) counts the kernels a step
//      launches; then, per iteration, a 1 GiB device-to-device copy, the fused step and
//      (unless --no-breakdown) the update pass alone, each between two CUDA events on the
//      stream. Nothing waits for the device until the last iteration is enqueued.
#include "cuda_bench.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli_support.hpp"
#include "jit/cuda/cuda_kernels.hpp"
#include "jit/kernel_cache.hpp"
#include "model_buffers.hpp"
#include "jit/base/cuda_api.hpp"
#include "runtime/cuda/cuda_backend.hpp"
#include "runtime/detail_access.hpp"
#include "stats.hpp"
#include "step_bytes.hpp"
#include "stepfuse/stepfuse.hpp"
#include "verify.hpp"

namespace stepfuse::bench {
namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// The bytes the copy probe copies (read once and written once per copy).
constexpr std::size_t kCopyBytes = std::size_t{1} << 30;

const cuda::DriverApi& api() { return *cuda::driver(); }  // loaded: require_cuda_backend() passed
void check(cuda::CUresult r, const char* what) { cuda::check(r, what); }

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
double ms_since(Clock::time_point t0) { return seconds_since(t0) * 1e3; }

// One device allocation per tensor for the weights and one for the gradients (none for an
// empty tensor, whose pointers stay null), as a framework holds a model's parameters.
class DeviceModel {
 public:
  explicit DeviceModel(const ModelBuffers& like) {
    for (std::size_t t = 0; t < like.num_tensors(); ++t) {
      w_.emplace_back(static_cast<std::size_t>(like.numel(t)) * dtype_size(like.weight_dtype()));
      g_.emplace_back(static_cast<std::size_t>(like.numel(t)) * dtype_size(like.grad_dtype()));
      views_.push_back({{w_.back().as<void>(), like.numel(t), like.weight_dtype()},
                        {g_.back().as<void>(), like.numel(t), like.grad_dtype()}});
    }
  }
  // Copies `host`'s weights and gradients in; the device has them when this returns.
  void upload_from(const ModelBuffers& host) {
    for (std::size_t t = 0; t < w_.size(); ++t) {
      if (w_[t].bytes() == 0) continue;
      check(api().cuMemcpyHtoD(w_[t].get(), host.weight(t).data, w_[t].bytes()), "cuMemcpyHtoD");
      check(api().cuMemcpyHtoD(g_[t].get(), host.grad(t).data, g_[t].bytes()), "cuMemcpyHtoD");
    }
    check(api().cuCtxSynchronize(), "cuCtxSynchronize");  // pageable copies may still be in flight
  }
  // Copies the weights and gradients out into `host` (same shapes), after all device work.
  void download_to(ModelBuffers& host) const {
    check(api().cuCtxSynchronize(), "cuCtxSynchronize");
    for (std::size_t t = 0; t < w_.size(); ++t) {
      if (w_[t].bytes() == 0) continue;
      check(api().cuMemcpyDtoH(host.weight(t).data, w_[t].get(), w_[t].bytes()), "cuMemcpyDtoH");
      check(api().cuMemcpyDtoH(host.grad(t).data, g_[t].get(), g_[t].bytes()), "cuMemcpyDtoH");
    }
  }
  const std::vector<Param>& params() const { return views_; }

 private:
  std::vector<detail::DeviceBuffer> w_, g_;
  std::vector<Param> views_;
};

class Stream {
 public:
  Stream() { check(api().cuStreamCreate(&s_, cuda::CU_STREAM_NON_BLOCKING), "cuStreamCreate"); }
  ~Stream() {
    api().cuStreamSynchronize(s_);
    api().cuStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cuda::CUstream get() const { return s_; }

 private:
  cuda::CUstream s_ = nullptr;
};

class Events {
 public:
  explicit Events(std::size_t n) : e_(n, nullptr) {
    for (cuda::CUevent& e : e_) check(api().cuEventCreate(&e, 0), "cuEventCreate");
  }
  ~Events() {
    for (cuda::CUevent e : e_)
      if (e) api().cuEventDestroy(e);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  void record(std::size_t i, cuda::CUstream s) { check(api().cuEventRecord(e_[i], s), "cuEventRecord"); }
  void wait(std::size_t i) { check(api().cuEventSynchronize(e_[i]), "cuEventSynchronize"); }
  double seconds(std::size_t from, std::size_t to) const {
    float ms = 0;
    check(api().cuEventElapsedTime(&ms, e_[from], e_[to]), "cuEventElapsedTime");
    return ms * 1e-3;
  }

 private:
  std::vector<cuda::CUevent> e_;
};

// The work one call enqueues on `stream`, counted: the call is captured into a CUDA graph
// (not run) and the graph's nodes (kernel launches, copies) are counted. -1 when that cannot
// be done: no cuGraphGetNodes, or the call broke the capture (a step must never wait for the
// device, so it would not). cuGraphGetNodes is not in the library's driver table; it comes
// from the libcuda.so.1 the library has already loaded.
int nodes_enqueued_by(cuda::CUstream stream, const std::function<void()>& call) {
  using GetNodes = cuda::CUresult (*)(cuda::CUgraph graph, void** nodes, std::size_t* count);
  static const GetNodes get_nodes = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return lib != nullptr ? reinterpret_cast<GetNodes>(dlsym(lib, "cuGraphGetNodes")) : nullptr;
  }();
  if (get_nodes == nullptr) return -1;
  if (api().cuStreamBeginCapture(stream, cuda::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) != cuda::CUDA_SUCCESS) return -1;
  bool threw = false;
  try {
    call();
  } catch (const std::exception&) {
    threw = true;
  }
  cuda::CUgraph graph = nullptr;
  const cuda::CUresult end = api().cuStreamEndCapture(stream, &graph);
  std::size_t count = 0;
  const bool ok = !threw && end == cuda::CUDA_SUCCESS && graph != nullptr &&
                  get_nodes(graph, nullptr, &count) == cuda::CUDA_SUCCESS;
  if (graph != nullptr) api().cuGraphDestroy(graph);
  return ok ? static_cast<int>(count) : -1;
}

// An optimizer over `params`; a configuration the library rejects is a usage error.
Optimizer make_optimizer(const OptimizerConfig& config, const std::vector<Param>& params, const OptimizerOptions& o) {
  try {
    return Optimizer(config, params, o);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::invalid_argument || e.code() == ErrorCode::unsupported)
      throw UsageError(std::string("the library rejects this configuration: ") + e.what());
    throw;
  }
}

// What the kernel cache cost around the timed optimizer's construction.
struct CacheFigures {
  std::string first;                  // "cold compile", "disk-cache hit" or "memory-cache hit"
  double construct_ms = 0;            // the optimizer's construction, wall clock
  std::uint64_t modules_compiled = 0; // by that construction (reduce, update, the utilities)
  double nvrtc_ms = 0;                // time in NVRTC then, summed (the step modules compile side by side)
  double disk_hit_ms = NAN;           // both step modules from the disk cache; NaN with the disk cache off
  double memory_hit_us = 0;           // both step modules found in memory
  bool disk_enabled = false;
  std::string dir;
};

struct DeviceInfo {
  std::string name;
  int sm = 0, multiprocessors = 0;
  std::size_t memory = 0;
};

DeviceInfo device_info(int index) {
  DeviceInfo d;
  cuda::CUdevice dev = 0;
  check(api().cuDeviceGet(&dev, index), "cuDeviceGet");
  char name[256] = {};
  check(api().cuDeviceGetName(name, sizeof name, dev), "cuDeviceGetName");
  d.name = name;
  int major = 0, minor = 0;
  check(api().cuDeviceGetAttribute(&major, cuda::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute");
  check(api().cuDeviceGetAttribute(&minor, cuda::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute");
  check(api().cuDeviceGetAttribute(&d.multiprocessors, cuda::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
        "cuDeviceGetAttribute");
  check(api().cuDeviceTotalMem(&d.memory, dev), "cuDeviceTotalMem");
  d.sm = major * 10 + minor;
  return d;
}

json summary_json(const Summary& s, double scale) {
  return json{{"median", s.median * scale}, {"min", s.min * scale}, {"p25", s.p25 * scale},
              {"p75", s.p75 * scale},       {"max", s.max * scale}, {"count", s.count}};
}

std::vector<double> scaled(const std::vector<double>& v, double k) {
  std::vector<double> r;
  for (double x : v) r.push_back(x * k);
  return r;
}

json number_or_null(double x) { return std::isfinite(x) ? json(x) : json(nullptr); }

}  // namespace

void require_cuda_backend() {
  const CudaStatus s = cuda_available();
  if (!s) throw UsageError("--backend cuda: the CUDA backend cannot run here: " + s.reason + "; use --backend cpu");
}

int run_cuda_bench(const CudaBenchArgs& a) {
  require_cuda_backend();
  Progress progress(!a.json_only);
  const double S = a.loss_scale;
  const std::int64_t n = a.preset.total_numel();
  const int host_threads = a.threads > 0 ? a.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const bool masters = a.options.master_weights && a.weights != DType::f32;
  const bool compensations = a.options.compensated_weights && a.weights == DType::bf16;  // --masters compensated
  const bool compressed = a.options.state_format != StateFormat::f32 || !a.options.state_formats.empty();
  OptimizerOptions cpu_options = a.options;
  cpu_options.device = Device::cpu();
  cpu_options.cuda_stream = nullptr;
  cpu_options.fusion = Fusion::fused;

  // ---- Phase 0: the library's answer, for 16 elements ---------------------------------------
  {
    ModelBuffers tiny(std::vector<TensorShape>{{"probe", 16}}, a.weights, a.grads);
    tiny.fill_weights(1);
    tiny.fill_grads(S, 1);
    make_optimizer(a.config, tiny.params(), cpu_options);
  }
  std::ofstream json_out;
  if (!a.json_path.empty()) {
    json_out.open(a.json_path);
    if (!json_out) throw UsageError("--json: cannot write '" + a.json_path + "'");
  }
  const detail::CudaContext context(0);  // GPU 0's primary context, current on this thread
  const DeviceInfo dev = device_info(0);
  const CudaStatus status = cuda_available();
  Stream stream;

  // ---- Phase 1: buffers ----------------------------------------------------------------------
  progress.say("allocating and filling " + with_commas(n) + " parameters on the host and on " + dev.name);
  std::optional<ModelBuffers> host(std::in_place, a.preset.tensors, a.weights, a.grads);
  host->fill_weights(host_threads);
  host->fill_grads(S, host_threads);
  DeviceModel model(*host);
  model.upload_from(*host);

  // ---- Phase 2: the optimizer, and the kernel cache's costs ---------------------------------
  progress.say("building the optimizer (compiling its kernels unless cached)");
  OptimizerOptions gpu_options = a.options;
  gpu_options.device = Device::cuda(0);
  gpu_options.cuda_stream = stream.get();
  gpu_options.fusion = Fusion::fused;
  jit::KernelCache& cache = jit::KernelCache::shared();
  CacheFigures cf;
  const jit::CacheStats s0 = cache.stats();
  auto t0 = Clock::now();
  std::optional<Optimizer> opt(make_optimizer(a.config, model.params(), gpu_options));
  cf.construct_ms = ms_since(t0);
  const jit::CacheStats s1 = cache.stats();
  cf.modules_compiled = s1.compiles - s0.compiles;
  cf.nvrtc_ms = s1.compile_ms - s0.compile_ms;
  cf.first = cf.modules_compiled > 0 ? "cold compile" : s1.disk_hits > s0.disk_hits ? "disk-cache hit" : "memory-cache hit";
  {
    const detail::CudaBackend& backend = *detail_access::engine(*opt).cuda();
    const jit::CudaTarget target = jit::target_for_device(backend.context().sm() / 10, backend.context().sm() % 10);
    constexpr int kHits = 1000;
    t0 = Clock::now();
    for (int i = 0; i < kHits; ++i) jit::cuda_step_images(backend.spec(), target);
    cf.memory_hit_us = ms_since(t0) * 1e3 / kHits;
    cf.disk_enabled = cache.disk_enabled();
    if (cache.dir()) cf.dir = cache.dir()->string();
    if (cf.disk_enabled) {
      cache.clear_memory();  // forgets the entries: the next lookups read the disk
      t0 = Clock::now();
      jit::cuda_step_images(backend.spec(), target);
      cf.disk_hit_ms = ms_since(t0);
      if (cache.stats().disk_hits != 2) cf.disk_hit_ms = NAN;  // not both from the disk: no figure
    }
  }
  std::vector<std::string> state_names;
  for (auto s : opt->state_names()) state_names.emplace_back(s);
  const int state_streams = static_cast<int>(state_names.size());

  // ---- Phase 3: verify one GPU step against one CPU step -------------------------------------
  progress.say("verifying: one cuda step against one cpu step");
  opt->step_scaled(S);
  const StepResult gpu_result = opt->last_result();  // waits for the device
  VerifyReport vr;
  StepResult cpu_result;
  {
    Optimizer cpu_opt = make_optimizer(a.config, host->params(), cpu_options);  // steps the host copy
    cpu_result = cpu_opt.step_scaled(S);
    ModelBuffers after(a.preset.tensors, a.weights, a.grads);
    model.download_to(after);
    // State stored as bf16 or q8 is compared as stored: the GPU's codes are the CPU's, bit for bit.
    vr = compressed ? compare_bitwise(*opt, after, gpu_result, cpu_opt, *host, cpu_result, S, host_threads, "cuda", "cpu")
                    : compare_one_step(*opt, after, gpu_result, cpu_opt, *host, cpu_result, S, host_threads, "cuda", "cpu");
  }
  host.reset();
  check_verified(vr, "cuda and cpu steps disagree:",
                 compressed ? "values differ in their bits; largest difference" : "values outside the tolerance; worst");

  // One more step, untimed: it uploads the host copy of the state the check read. Then the
  // work of one step, counted in a captured graph (which is not run).
  opt->step_scaled(S);
  const int launches = nodes_enqueued_by(stream.get(), [&] { opt->step_scaled(S); });
  int update_launches = 0;
  // The update pass alone: another optimizer over the same buffers taking plain steps (no
  // reduce pass), with its own state. The weights it moves are the timed one's, which
  // changes nothing that is timed.
  std::optional<Optimizer> update_only;
  if (a.breakdown) {
    OptimizerOptions o = gpu_options;
    o.max_grad_norm.reset();
    o.track_grad_norm = false;
    update_only.emplace(make_optimizer(a.config, model.params(), o));
    update_launches = nodes_enqueued_by(stream.get(), [&] { update_only->step(); });
  }

  // ---- Phase 4: timing -----------------------------------------------------------------------
  progress.say("timing");
  detail::DeviceBuffer copy_src(kCopyBytes), copy_dst(kCopyBytes);
  check(api().cuMemsetD8Async(copy_src.get(), 0x5a, kCopyBytes, stream.get()), "cuMemsetD8Async");
  check(api().cuMemsetD8Async(copy_dst.get(), 0, kCopyBytes, stream.get()), "cuMemsetD8Async");
  const int iterations = a.warmup + a.steps;
  constexpr std::size_t kPerIteration = 6;  // copy, step, update-only: a start and an end each
  Events ev(static_cast<std::size_t>(iterations) * kPerIteration);
  const cuda::CUstream s = stream.get();
  for (int it = 0; it < iterations; ++it) {
    const std::size_t e = static_cast<std::size_t>(it) * kPerIteration;
    ev.record(e + 0, s);
    check(api().cuMemcpyDtoDAsync(copy_dst.get(), copy_src.get(), kCopyBytes, s), "cuMemcpyDtoDAsync");
    ev.record(e + 1, s);
    ev.record(e + 2, s);
    opt->step_scaled(S);
    ev.record(e + 3, s);
    if (update_only) {
      ev.record(e + 4, s);
      update_only->step();
      ev.record(e + 5, s);
    }
  }
  ev.wait(static_cast<std::size_t>(iterations) * kPerIteration - (update_only ? 1 : 3));
  std::vector<double> copy_s, step_s, update_s;
  for (int it = a.warmup; it < iterations; ++it) {
    const std::size_t e = static_cast<std::size_t>(it) * kPerIteration;
    copy_s.push_back(ev.seconds(e + 0, e + 1));
    step_s.push_back(ev.seconds(e + 2, e + 3));
    if (update_only) update_s.push_back(ev.seconds(e + 4, e + 5));
  }
  const std::int64_t expected_steps = 2 + iterations;  // the checked step, the untimed one, the loop
  if (opt->step_count() != expected_steps || !opt->last_result().applied)
    throw VerifyError(format("%lld of %lld fused steps were skipped although every gradient is finite",
                             static_cast<long long>(expected_steps - opt->step_count()),
                             static_cast<long long>(expected_steps)));
  progress.done();

  // ---- Report --------------------------------------------------------------------------------
  const UpdateProgram update_program = UpdateProgram::from_config(a.config);  // a two-phase program: two passes
  const StateWidths widths = stored_state_widths(*opt, n);  // (each stream's bytes as stored: bf16, q8)
  const StepBytes bytes =
      step_bytes(update_program.program(), a.weights, a.grads, a.options.master_weights, true, compensations, widths);
  const StepBytes plain_bytes =
      step_bytes(update_program.program(), a.weights, a.grads, a.options.master_weights, false, compensations, widths);
  const double step_bytes_total = bytes.per_param() * static_cast<double>(n);
  const double copy_moved = 2.0 * static_cast<double>(kCopyBytes);  // read + write, STREAM's convention
  const Summary cs = summarize(copy_s), ss = summarize(step_s), us = summarize(update_s);
  const double copy_gbs = copy_moved / cs.median * 1e-9;
  const double step_gbs = step_bytes_total / ss.median * 1e-9;
  const double update_gbs = update_only ? plain_bytes.per_param() * static_cast<double>(n) / us.median * 1e-9 : 0.0;
  const double reduce_s = update_only ? ss.median - us.median : 0.0;
  const double reduce_gbs = update_only && reduce_s > 0 ? bytes.reduce * static_cast<double>(n) / reduce_s * 1e-9 : 0.0;
  std::vector<double> frac, update_frac;  // each iteration's step against its own copy
  for (std::size_t i = 0; i < step_s.size(); ++i) {
    const double copy_i = copy_moved / copy_s[i];
    frac.push_back(step_bytes_total / step_s[i] / copy_i);
    if (update_only) update_frac.push_back(plain_bytes.per_param() * static_cast<double>(n) / update_s[i] / copy_i);
  }
  const Summary pf = summarize(frac), puf = summarize(update_frac);
  const std::string clip = a.clip > 0 ? format("%g (L%s norm)", a.clip, a.norm_name.c_str()) : std::string("off");

  std::string out;
  out += format("stepfuse-bench %s · backend cuda · GPU 0: %s (sm_%d, %d SMs, %.0f GiB) · driver %d.%d · NVRTC %d.%d\n",
                version(), dev.name.c_str(), dev.sm, dev.multiprocessors,
                static_cast<double>(dev.memory) / (1024.0 * 1024.0 * 1024.0), status.driver_version / 1000,
                status.driver_version % 1000 / 10, status.nvrtc_major, status.nvrtc_minor);
  out += format("%s %s: %zu tensor%s, %s parameters\n", a.from_file ? "shapes file" : "preset", a.preset.name.c_str(),
                a.preset.tensors.size(), a.preset.tensors.size() == 1 ? "" : "s", with_commas(n).c_str());
  out += format("%s · weights %s%s · grads %s · state %s · clip %s · loss scale %g\n",
                std::string(optimizer_name(a.config)).c_str(), a.weights_name.c_str(),
                masters         ? " + fp32 masters"
                : compensations ? " + bf16 compensations (--masters compensated)"
                                : "",
                a.grads_name.c_str(), std::string(state_format_name(a.options.state_format)).c_str(), clip.c_str(), S);
  out += format("bytes the step must move: %s (%d state stream%s) = %.3f GB per step\n", bytes.breakdown().c_str(),
                state_streams, state_streams == 1 ? "" : "s", step_bytes_total * 1e-9);
  out += format("verified before timing: one cuda and one cpu step agree on %s values (%.1f%% bitwise, worst %.2f "
                "of the tolerance, rel %.0e)\n",
                with_commas(vr.values_checked).c_str(),
                100.0 * static_cast<double>(vr.identical) / static_cast<double>(std::max<std::int64_t>(vr.values_checked, 1)),
                vr.worst_ratio, vr.rel_tol);
  out += format("  (grad norm %.6g, clip coef %.6g)\n", gpu_result.grad_norm, gpu_result.clip_coef);
  out += format("kernel cache (%s): the first optimizer was a %s, constructed in %.1f ms (%llu module%s compiled, "
                "%.0f ms in NVRTC);\n  then a disk-cache hit of its two step modules took %.2f ms, a memory-cache hit %.2f us\n",
                cf.disk_enabled ? cf.dir.c_str() : "memory only", cf.first.c_str(), cf.construct_ms,
                static_cast<unsigned long long>(cf.modules_compiled), cf.modules_compiled == 1 ? "" : "s", cf.nvrtc_ms,
                cf.disk_hit_ms, cf.memory_hit_us);
  out += format("\ndevice-to-device copy, same run: %.0f MiB copied (read + write counted), %.1f GB/s (median of %d, %.1f-%.1f)\n",
                static_cast<double>(kCopyBytes) / (1024.0 * 1024.0), copy_gbs, cs.count, copy_moved / cs.max * 1e-9,
                copy_moved / cs.min * 1e-9);
  out += format("%d timed iterations after %d warm-up, CUDA events on one stream, each: copy, fused step%s:\n", a.steps,
                a.warmup, update_only ? ", update pass alone" : "");
  out += format("  %-8s %10s %9s %9s %9s %9s %11s %8s\n", "mode", "median ms", "min", "max", "IQR", "GB/s", "% d2d copy",
                "kernels");
  const auto row = [&](const char* name, const Summary& x, double gbs, int k) {
    out += format("  %-8s %10.3f %9.3f %9.3f %9.3f %9.1f %10.1f%% %8d\n", name, x.median * 1e3, x.min * 1e3, x.max * 1e3,
                  (x.p75 - x.p25) * 1e3, gbs, 100.0 * gbs / copy_gbs, k);
  };
  row("fused", ss, step_gbs, launches);
  if (update_only) {
    row("update", us, update_gbs, update_launches);
    out += format("  (update: the fused update pass alone, a plain step() without reduce pass, %g B/param; the reduce\n"
                  "   pass then takes the rest of the fused step: %.3f ms, %.1f GB/s for %g B/param)\n",
                  plain_bytes.per_param(), reduce_s * 1e3, reduce_gbs, bytes.reduce);
  }
  out += format("  per iteration (median, min-max): fused at %.1f%% of the copy's bandwidth (%.1f-%.1f)\n", 100.0 * pf.median,
                100.0 * pf.min, 100.0 * pf.max);
  out += format("total run time %.1f s\n", seconds_since(a.start));
  if (!a.json_only) std::fputs(out.c_str(), stdout);

  if (json_out.is_open() || a.json_only) {
    json j;
    j["tool"] = "stepfuse-bench";
    j["version"] = version();
    j["backend"] = "cuda";
    j["device"] = {{"index", 0},
                   {"name", dev.name},
                   {"sm", dev.sm},
                   {"multiprocessors", dev.multiprocessors},
                   {"memory_bytes", dev.memory},
                   {"driver_version", status.driver_version},
                   {"nvrtc", format("%d.%d", status.nvrtc_major, status.nvrtc_minor)}};
    j["config"] = {{"preset", a.from_file ? json(nullptr) : json(a.preset.name)},
                   {"shapes_file", a.from_file ? json(a.preset.name) : json(nullptr)},
                   {"tensors", a.preset.tensors.size()},
                   {"params", n},
                   {"backend", "cuda"},
                   {"fusion", json::array({"fused"})},
                   {"optimizer", std::string(optimizer_name(a.config))},
                   {"weights", a.weights_name},
                   {"grads", a.grads_name},
                   {"master_weights", masters},
                   {"compensated_weights", compensations},
                   {"state_format", std::string(state_format_name(a.options.state_format))},
                   {"clip", a.clip},
                   {"norm_type", a.norm_name},
                   {"loss_scale", S},
                   {"steps", a.steps},
                   {"warmup", a.warmup}};
    j["step_bytes"] = {{"reduce_per_param", bytes.reduce},
                       {"update_per_param", bytes.update},
                       {"per_param", bytes.per_param()},
                       {"state_streams", state_streams},
                       {"per_step", step_bytes_total}};
    j["d2d_copy"] = {{"bytes", kCopyBytes},
                     {"bytes_moved", copy_moved},
                     {"gbs_median", copy_gbs},
                     {"gbs_min", copy_moved / cs.max * 1e-9},
                     {"gbs_max", copy_moved / cs.min * 1e-9},
                     {"samples_ms", scaled(copy_s, 1e3)}};
    j["fused"] = {{"ms", summary_json(ss, 1e3)},
                  {"samples_ms", scaled(step_s, 1e3)},
                  {"gbs", step_gbs},
                  {"fraction_of_d2d_copy", step_gbs / copy_gbs},
                  {"kernel_launches_per_step", launches}};
    if (update_only) {
      j["fused_update_only"] = {{"ms", summary_json(us, 1e3)},
                                {"samples_ms", scaled(update_s, 1e3)},
                                {"gbs", update_gbs},
                                {"fraction_of_d2d_copy", update_gbs / copy_gbs},
                                {"bytes_per_param", plain_bytes.per_param()},
                                {"kernel_launches_per_step", update_launches}};
      j["fused_reduce_by_difference"] = {{"ms", reduce_s * 1e3}, {"gbs", reduce_gbs}};
    }
    json per_it = {{"fused_fraction_of_d2d_copy", summary_json(pf, 1.0)}};
    if (update_only) per_it["update_only_fraction_of_d2d_copy"] = summary_json(puf, 1.0);
    j["per_iteration"] = per_it;
    j["kernel_cache"] = {{"first_construction", cf.first},
                         {"construct_ms", cf.construct_ms},
                         {"modules_compiled", cf.modules_compiled},
                         {"nvrtc_ms", cf.nvrtc_ms},
                         {"cold_compile_ms", cf.modules_compiled > 0 ? json(cf.construct_ms) : json(nullptr)},
                         {"disk_hit_ms", number_or_null(cf.disk_hit_ms)},
                         {"memory_hit_us", cf.memory_hit_us},
                         {"disk_enabled", cf.disk_enabled},
                         {"dir", cf.dir}};
    j["verification"] = {{"ok", true},
                         {"reference", "cpu"},
                         {"values_checked", vr.values_checked},
                         {"values_bitwise_equal", vr.identical},
                         {"worst_fraction_of_tolerance", vr.worst_ratio},
                         {"rel_tol", vr.rel_tol},
                         {"worst", vr.worst},
                         {"grad_norm", gpu_result.grad_norm},
                         {"clip_coef", gpu_result.clip_coef}};
    j["total_seconds"] = seconds_since(a.start);
    write_json_report(j.dump(2) + "\n", json_out, a.json_path, a.json_only);
  }
  return kExitOk;
}

}  // namespace stepfuse::bench
