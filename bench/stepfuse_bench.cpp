// stepfuse-bench: times the fused optimizer step against the unfused baseline and the bandwidth measured in the same run.
//
// Phases, in this order on purpose:
//   0. arguments: the tensor list (a preset or a shapes file; --print-shapes stops here),
//      then a 16-element optimizer with the requested options, so that anything the
//      library rejects fails in milliseconds, before buffers of model size exist (the
//      first LLVM optimizer compiles its kernels, or loads them from the kernel cache,
//      here: its construction time is reported);
//      --backend cuda goes on in cuda_bench.cpp from here (no GPU: exit code 1, saying why);
//   1. fused only: build the fused optimizer, take a few steps, read the peak RSS (before
//      anything else of model size exists, so the figure is the fused step's own);
//   2. verify: fresh optimizers, one per mode, over separate buffers with identical
//      contents take one step each; every timed mode is compared against a reference
//      (unfused, or fused when unfused is not timed): every weight, master and state
//      value must agree within fp32 rounding, and the fused step on LLVM code must equal
//      the one on Highway's bit for bit (exit code 2 otherwise) — nothing is timed
//      before this;
//   3. measure: warm-up, then timed iterations of [bandwidth probes, then each mode of
//      --fusion in the order fused (once per --cpu-backend, with the fused update pass
//      alone), unfused, interpreted], interleaved so that drift in the machine affects
//      all of them alike.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bandwidth.hpp"
#include "cli_support.hpp"
#include "cuda_bench.hpp"
#include "model_buffers.hpp"
#include "presets.hpp"
#include "rss.hpp"
#include "stats.hpp"
#include "step_bytes.hpp"
#include "stepfuse/stepfuse.hpp"
#include "verify.hpp"

namespace sf = stepfuse;
namespace sb = stepfuse::bench;
using json = nlohmann::ordered_json;

namespace {

using sb::format;
using sb::kExitError;
using sb::kExitOk;
using sb::kExitUsage;
using sb::kExitVerify;
using sb::Progress;
using sb::UsageError;
using sb::VerifyError;
using sb::with_commas;

// The progress line appears only when the timed phase is expected to take longer than this.
constexpr double kProgressAfterSeconds = 3.0;

struct Args {
  std::string preset = "gpt2-124m";
  std::string shapes_path;  // --shapes: replaces the preset when given
  bool print_shapes = false;
  std::vector<std::string> fusion = {"fused", "unfused"};
  std::vector<std::string> cpu_backends;  // --cpu-backend; empty: highway, and llvm when the library has it
  std::string backend = "cpu";
  std::string optimizer = "adamw";
  std::string weights = "f32";
  std::string grads = "f32";
  bool no_masters = false;
  bool breakdown = true;
  double clip = 1.0;
  std::string norm_type = "2";
  int threads = 0;
  int steps = 10;
  int warmup = 2;
  int rss_steps = 3;
  double loss_scale = 1024.0;
  std::string json_path;
  bool json_only = false;
  bool fusion_given = false;       // --fusion was on the command line
  bool cpu_backend_given = false;  // --cpu-backend was on the command line
};

// The modes --fusion can time, in the order they are verified, timed and reported.
// Indexed by sf::Fusion's value.
constexpr std::array<sf::Fusion, 3> kAllModes = {sf::Fusion::fused, sf::Fusion::unfused, sf::Fusion::interpreted};
const char* mode_name(sf::Fusion f) {
  return f == sf::Fusion::fused ? "fused" : f == sf::Fusion::unfused ? "unfused" : "interpreted";
}

// What is timed: a mode of --fusion and, for fused, the CPU code that runs it (--cpu-backend).
// In the order they are verified, timed and reported; indexed by value. Every variant runs
// its CPU backend explicitly, so that STEPFUSE_CPU_BACKEND changes nothing here.
enum class Variant : std::uint8_t { fused, fused_llvm, unfused, interpreted };
constexpr std::array<Variant, 4> kAllVariants = {Variant::fused, Variant::fused_llvm, Variant::unfused,
                                                 Variant::interpreted};
constexpr std::size_t idx(Variant v) { return static_cast<std::size_t>(v); }
// The name in the table, the progress line and messages.
const char* variant_name(Variant v) {
  switch (v) {
    case Variant::fused: return "fused";
    case Variant::fused_llvm: return "fused-llvm";
    case Variant::unfused: return "unfused";
    case Variant::interpreted: return "interpreted";
  }
  return "?";
}
// The name in JSON keys ("fused_llvm", "fused_llvm_over_fused_speed").
std::string variant_key(Variant v) { return v == Variant::fused_llvm ? "fused_llvm" : variant_name(v); }
sf::Fusion fusion_of(Variant v) {
  return v == Variant::unfused ? sf::Fusion::unfused : v == Variant::interpreted ? sf::Fusion::interpreted : sf::Fusion::fused;
}
sf::CpuBackend cpu_backend_of(Variant v) {
  return v == Variant::fused_llvm ? sf::CpuBackend::llvm : sf::CpuBackend::highway;
}
bool have_llvm() { return sf::llvm_version()[0] != '\0'; }

// PyTorch's defaults for each optimizer.
sf::OptimizerConfig make_config(const std::string& name) {
  if (name == "adamw") return sf::optim::AdamW{};
  if (name == "adam") return sf::optim::Adam{};
  if (name == "sgd") return sf::optim::SGD{};
  if (name == "adagrad") return sf::optim::Adagrad{};
  if (name == "rmsprop") return sf::optim::RMSprop{};
  if (name == "lion") return sf::optim::Lion{};
  throw UsageError("--optimizer: unknown optimizer '" + name + "'");
}

sf::DType parse_dtype(const std::string& opt, const std::string& s) {
  if (s == "f32") return sf::DType::f32;
  if (s == "f16") return sf::DType::f16;
  if (s == "bf16") return sf::DType::bf16;
  throw UsageError(opt + ": unknown dtype '" + s + "' (expected f32, f16 or bf16)");
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double gib(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

json summary_json(const sb::Summary& s, double scale) {
  return json{{"median", s.median * scale}, {"min", s.min * scale}, {"p25", s.p25 * scale},
              {"p75", s.p75 * scale},       {"max", s.max * scale}, {"count", s.count}};
}

std::vector<double> scaled(const std::vector<double>& v, double k) {
  std::vector<double> r;
  r.reserve(v.size());
  for (double x : v) r.push_back(x * k);
  return r;
}

void check_applied(const sf::StepResult& r, const char* mode, int iteration) {
  if (!r.applied)
    throw VerifyError(std::string("the ") + mode + " step " + std::to_string(iteration) +
                      " was skipped (found_inf=" + (r.found_inf ? "true" : "false") +
                      ") although every gradient is finite");
}

// An optimizer over `buf` on the CPU; a configuration the library rejects is a usage error
// (exit code 1). (--backend cuda takes its own path: cuda_bench.cpp.)
sf::Optimizer make_optimizer(const sf::OptimizerConfig& config, const sb::ModelBuffers& buf,
                             const sf::OptimizerOptions& opts) {
  try {
    return sf::Optimizer(config, buf.params(), opts);
  } catch (const sf::Error& e) {
    if (e.code() == sf::ErrorCode::invalid_argument || e.code() == sf::ErrorCode::unsupported)
      throw UsageError(std::string("the library rejects this configuration: ") + e.what());
    throw;
  }
}

// The modes --fusion names, each once, in kAllModes order.
std::vector<sf::Fusion> selected_modes(const std::vector<std::string>& names) {
  std::vector<sf::Fusion> modes;
  for (sf::Fusion f : kAllModes)
    if (std::find(names.begin(), names.end(), mode_name(f)) != names.end()) modes.push_back(f);
  for (const auto& n : names)
    if (n != "fused" && n != "unfused" && n != "interpreted")
      throw UsageError("--fusion: unknown mode '" + n + "' (expected fused, unfused or interpreted)");
  if (modes.empty()) throw UsageError("--fusion: name at least one of fused, unfused, interpreted");
  return modes;
}

// The CPU backends --cpu-backend names, each once, highway first (the order they are timed
// in). Unset: highway, and llvm when the library was built with it.
std::vector<sf::CpuBackend> selected_cpu_backends(const Args& a) {
  if (!a.cpu_backend_given)
    return have_llvm() ? std::vector{sf::CpuBackend::highway, sf::CpuBackend::llvm}
                       : std::vector{sf::CpuBackend::highway};
  for (const auto& n : a.cpu_backends)
    if (n != "highway" && n != "llvm")
      throw UsageError("--cpu-backend: unknown CPU backend '" + n + "' (expected highway or llvm, comma-separated)");
  auto named = [&](const char* n) {
    return std::find(a.cpu_backends.begin(), a.cpu_backends.end(), n) != a.cpu_backends.end();
  };
  std::vector<sf::CpuBackend> backends;
  if (named("highway")) backends.push_back(sf::CpuBackend::highway);
  if (named("llvm")) backends.push_back(sf::CpuBackend::llvm);
  if (backends.empty()) throw UsageError("--cpu-backend: name at least one of highway, llvm");
  if (named("llvm") && !have_llvm())
    throw UsageError("--cpu-backend llvm: this stepfuse was built without LLVM (stepfuse::llvm_version() is empty), so "
                     "it has no LLVM backend to time; pass --cpu-backend highway, or rebuild stepfuse with LLVM 14 "
                     "or newer (apt install llvm-14-dev; cmake -DSTEPFUSE_LLVM=ON)");
  return backends;
}

// The variants to time, in kAllVariants order: the fused mode once per CPU backend.
std::vector<Variant> selected_variants(const std::vector<sf::Fusion>& modes,
                                       const std::vector<sf::CpuBackend>& backends) {
  std::vector<Variant> variants;
  for (sf::Fusion f : modes) {
    if (f != sf::Fusion::fused) {
      variants.push_back(f == sf::Fusion::unfused ? Variant::unfused : Variant::interpreted);
      continue;
    }
    for (sf::CpuBackend b : backends)
      variants.push_back(b == sf::CpuBackend::llvm ? Variant::fused_llvm : Variant::fused);
  }
  return variants;
}

// One variant's optimizer, over its own buffers (fused: the phase-1 buffers), and its samples.
struct ModeRun {
  std::unique_ptr<sb::ModelBuffers> own;  // null for fused, which steps the phase-1 buffers
  sb::ModelBuffers* buf = nullptr;
  std::optional<sf::Optimizer> opt;
  sf::StepResult verify_result;
  double construct_ms = 0;      // the optimizer's construction (allocates and fills its state and masters)
  std::vector<double> samples;  // seconds per timed step
  sb::Summary summary;
  double gbs = 0;
};

// A pair of variants whose speeds are compared: "a/b" = median time of b / median time of a.
// The last one, LLVM's fused step against Highway's, has a line of its own in the table.
struct RatioPair {
  Variant a, b;
};
constexpr RatioPair kRatioPairs[] = {{Variant::fused, Variant::unfused},
                                     {Variant::fused, Variant::interpreted},
                                     {Variant::interpreted, Variant::unfused},
                                     {Variant::fused_llvm, Variant::unfused},
                                     {Variant::fused_llvm, Variant::fused}};
constexpr bool is_llvm_over_highway(const RatioPair& p) { return p.a == Variant::fused_llvm && p.b == Variant::fused; }

int run(const Args& a) {
  Progress progress(!a.json_only);
  const auto t_start = std::chrono::steady_clock::now();

  // ---- Arguments -----------------------------------------------------------------------------
  sb::Preset preset;
  const bool from_file = !a.shapes_path.empty();
  try {
    preset = from_file ? sb::load_shapes_file(a.shapes_path) : sb::make_preset(a.preset);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string(from_file ? "--shapes: " : "--preset: ") + e.what());
  }
  if (a.print_shapes) {
    std::fputs(sb::format_shapes(preset.tensors).c_str(), stdout);
    return std::fflush(stdout) == 0 && !std::ferror(stdout) ? kExitOk : kExitError;
  }
  const std::vector<sf::Fusion> modes = selected_modes(a.fusion);
  auto timed_mode = [&](sf::Fusion f) { return std::find(modes.begin(), modes.end(), f) != modes.end(); };
  const std::vector<sf::CpuBackend> cpu_backends = selected_cpu_backends(a);
  const std::vector<Variant> variants = selected_variants(modes, cpu_backends);
  auto timed = [&](Variant v) { return std::find(variants.begin(), variants.end(), v) != variants.end(); };
  const sf::OptimizerConfig config = make_config(a.optimizer);
  const sf::DType wt = parse_dtype("--weights", a.weights), gt = parse_dtype("--grads", a.grads);
  if (!(a.loss_scale > 0) || !std::isfinite(a.loss_scale))
    throw UsageError(format("--loss-scale: must be finite and > 0, got %g", a.loss_scale));
  // The gradients are filled with magnitudes up to 1e-3 * S (model_buffers.hpp).
  if (!std::isfinite(sb::round_to(gt, static_cast<float>(a.loss_scale * 1e-3))))
    throw UsageError(format("--loss-scale: %g is too large for %s gradients (scaled gradients up to %g overflow)",
                            a.loss_scale, a.grads.c_str(), a.loss_scale * 1e-3));
  if (!(a.clip >= 0) || !std::isfinite(a.clip))
    throw UsageError(format("--clip: must be finite and >= 0 (0 = off), got %g", a.clip));
  if (a.backend != "cpu" && a.backend != "cuda")
    throw UsageError("--backend: unknown backend '" + a.backend + "' (expected cpu or cuda)");
  if (a.cpu_backend_given && a.backend == "cuda")
    throw UsageError("--cpu-backend: chooses the code of the fused step on the CPU; --backend cuda times the GPU's "
                     "(leave --cpu-backend out)");
  if (a.cpu_backend_given && !timed_mode(sf::Fusion::fused))
    throw UsageError("--cpu-backend: chooses the code of the fused step, and --fusion times no fused step");

  sf::OptimizerOptions opts;
  if (a.clip > 0) opts.max_grad_norm = a.clip;
  opts.norm_type = a.norm_type == "inf" ? INFINITY : 2.0;
  opts.master_weights = !a.no_masters;
  opts.num_threads = a.threads;
  // Explicit, so that STEPFUSE_CPU_BACKEND changes nothing (and CpuBackend::automatic
  // never swaps code under a timed loop); options_for() sets each variant's own.
  opts.cpu_backend = sf::CpuBackend::highway;
  if (a.backend == "cuda") {
    sb::require_cuda_backend();  // no GPU: a usage error saying why, before anything else
    if (a.fusion_given && modes != std::vector<sf::Fusion>{sf::Fusion::fused})
      throw UsageError("--fusion: --backend cuda times the fused step only (the unfused baseline on a GPU is "
                       "PyTorch's: bench/peers/torch_cuda_step.py); pass --fusion fused or leave --fusion out");
    sb::CudaBenchArgs c;
    c.preset = preset;
    c.from_file = from_file;
    c.config = config;
    c.weights = wt;
    c.grads = gt;
    c.weights_name = a.weights;
    c.grads_name = a.grads;
    c.norm_name = a.norm_type == "inf" ? "inf" : "2";
    c.options = opts;
    c.clip = a.clip;
    c.loss_scale = a.loss_scale;
    c.steps = a.steps;
    c.warmup = a.warmup;
    c.threads = a.threads;
    c.breakdown = a.breakdown;
    c.json_path = a.json_path;
    c.json_only = a.json_only;
    c.start = t_start;
    return sb::run_cuda_bench(c);
  }
  auto options_for = [&](Variant v) {
    sf::OptimizerOptions o = opts;
    o.fusion = fusion_of(v);
    o.cpu_backend = cpu_backend_of(v);
    return o;
  };
  // What the library rejects (the backend, a hyperparameter, the dtypes) it rejects for
  // 16 elements as for the whole model; ask it now, before allocating the model. The
  // LLVM kernels depend on the dtypes and the program, not on the sizes: the first LLVM
  // optimizer compiles them (or loads them from the kernel cache), the ones of model size
  // find them linked.
  double llvm_first_ms = 0;  // construction time of the first LLVM optimizer (16 elements)
  {
    sb::ModelBuffers tiny(std::vector<sb::TensorShape>{{"probe", 16}}, wt, gt);
    tiny.fill_weights(1);
    tiny.fill_grads(a.loss_scale, 1);
    for (Variant v : kAllVariants) {  // all on Highway (phase 2 may build any), LLVM's when timed
      if (v == Variant::fused_llvm && !timed(v)) continue;
      if (v == Variant::fused_llvm) progress.say("compiling (or loading) the LLVM kernels");
      const auto t0 = std::chrono::steady_clock::now();
      make_optimizer(config, tiny, options_for(v));
      if (v == Variant::fused_llvm) llvm_first_ms = seconds_since(t0) * 1e3;
    }
  }
  std::ofstream json_out;
  if (!a.json_path.empty()) {
    json_out.open(a.json_path);
    if (!json_out) throw UsageError("--json: cannot write '" + a.json_path + "'");
  }
  const double S = a.loss_scale;
  const std::int64_t n = preset.total_numel();
  // The fused variant phase 1 steps and the update pass alone is timed with: the first timed.
  const Variant first_fused =
      timed(Variant::fused) || !timed(Variant::fused_llvm) ? Variant::fused : Variant::fused_llvm;

  // ---- Phase 1: fused only, peak RSS ---------------------------------------------------------
  const std::int64_t rss_start = sb::current_rss_bytes(), peak_start = sb::peak_rss_bytes();
  progress.say("allocating and filling " + with_commas(n) + " parameters");
  sb::ModelBuffers fb(preset.tensors, wt, gt);
  const int fill_threads = a.threads > 0 ? a.threads : static_cast<int>(std::thread::hardware_concurrency());
  fb.fill_weights(fill_threads);
  fb.fill_grads(S, fill_threads);

  int threads = 0, state_streams = 0;
  std::vector<std::string> state_names;
  double state_bytes = 0, master_bytes = 0;
  std::int64_t rss_peak = 0, rss_after = 0;
  double rss_step_s = 0;  // mean fused step time in this phase: the first guess at the timed phase's length
  {
    std::optional<sf::Optimizer> opt0 = make_optimizer(config, fb, options_for(first_fused));
    threads = opt0->num_threads();
    for (auto name : opt0->state_names()) state_names.emplace_back(name);
    state_streams = static_cast<int>(state_names.size());
    for (std::size_t t = 0; t < opt0->num_params(); ++t) {
      for (const auto& name : state_names) state_bytes += 4.0 * static_cast<double>(opt0->state(t, name).size());
      master_bytes += 4.0 * static_cast<double>(opt0->master(t).size());
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < a.rss_steps; ++i) {
      progress.say("fused-only phase (peak RSS): step " + std::to_string(i + 1) + "/" + std::to_string(a.rss_steps));
      check_applied(opt0->step_scaled(S), "fused", i);
    }
    rss_step_s = seconds_since(t0) / a.rss_steps;
    rss_peak = sb::peak_rss_bytes();
    rss_after = sb::current_rss_bytes();
  }
  const double model_bytes =
      static_cast<double>(fb.weight_bytes() + fb.grad_bytes()) + state_bytes + master_bytes;

  // ---- Phase 2: verify every timed variant before timing anything ----------------------------
  // Against a reference within fp32 rounding: unfused when it is timed, else fused. A mode
  // that is the only one timed is still checked: fused (or unfused) against the other,
  // built for the check alone. The fused step on Highway's code ("fused") takes part
  // whenever a fused step is timed, as the reference or checked against it; LLVM's
  // ("fused-llvm") must equal it bit for bit, and so agrees with the reference too.
  Variant ref = timed(Variant::unfused) ? Variant::unfused : Variant::fused;
  std::vector<Variant> checked;
  for (Variant v : kAllVariants)
    if (v != ref && v != Variant::fused_llvm && (timed(v) || (v == Variant::fused && timed(Variant::fused_llvm))))
      checked.push_back(v);
  if (checked.empty()) {  // only fused (on one or both backends), or only unfused, is timed
    ref = Variant::unfused;
    checked = {Variant::fused};
  }
  auto built = [&](Variant v) {
    return v == ref || std::find(checked.begin(), checked.end(), v) != checked.end() ||
           (v == Variant::fused_llvm && timed(v));
  };
  std::array<ModeRun, kAllVariants.size()> runs;
  for (Variant v : kAllVariants) {
    if (!built(v)) continue;
    progress.say(std::string("verifying: one ") + variant_name(v) + " step");
    ModeRun& r = runs[idx(v)];
    if (v == Variant::fused) {
      r.buf = &fb;
    } else {
      r.own = std::make_unique<sb::ModelBuffers>(preset.tensors, wt, gt);
      r.buf = r.own.get();
    }
    r.buf->fill_weights(threads);
    r.buf->fill_grads(S, threads);
    const auto t0 = std::chrono::steady_clock::now();
    r.opt.emplace(make_optimizer(config, *r.buf, options_for(v)));
    r.construct_ms = seconds_since(t0) * 1e3;
    if ((v == Variant::fused_llvm) != (r.opt->backend() == "llvm"))  // the option must have taken effect
      throw std::runtime_error(std::string("the ") + variant_name(v) + " optimizer runs '" +
                               std::string(r.opt->backend()) + "' code");
    r.verify_result = r.opt->step_scaled(S);
  }
  struct Verified {
    Variant mode;
    sb::VerifyReport report;
  };
  std::vector<Verified> verified;
  const ModeRun& rr = runs[idx(ref)];
  for (Variant v : checked) {
    progress.say(std::string("verifying ") + variant_name(v) + " against " + variant_name(ref));
    const ModeRun& r = runs[idx(v)];
    sb::VerifyReport vr = sb::compare_one_step(*r.opt, *r.buf, r.verify_result, *rr.opt, *rr.buf, rr.verify_result,
                                               S, threads, variant_name(v), variant_name(ref));
    if (!vr.ok()) {
      std::string msg = std::string(variant_name(v)) + " and " + variant_name(ref) + " steps disagree:";
      for (const auto& p : vr.problems) msg += "\n  " + p;
      if (vr.mismatches > 0)
        msg += "\n  " + with_commas(vr.mismatches) + " of " + with_commas(vr.values_checked) +
               " values outside the tolerance; worst: " + vr.worst;
      throw VerifyError(msg);
    }
    verified.push_back({v, std::move(vr)});
  }
  std::optional<sb::VerifyReport> llvm_check;  // fused-llvm against fused, bit for bit
  if (timed(Variant::fused_llvm)) {
    progress.say("verifying fused-llvm against fused (Highway), bit for bit");
    const ModeRun &rl = runs[idx(Variant::fused_llvm)], &rh = runs[idx(Variant::fused)];
    sb::VerifyReport vr = sb::compare_bitwise(*rl.opt, *rl.buf, rl.verify_result, *rh.opt, *rh.buf, rh.verify_result,
                                              S, threads, "llvm", "highway");
    if (!vr.ok()) {
      std::string msg = "the fused step on LLVM code is not bitwise the one on Highway's:";
      for (const auto& p : vr.problems) msg += "\n  " + p;
      if (vr.mismatches > 0)
        msg += "\n  " + with_commas(vr.mismatches) + " of " + with_commas(vr.values_checked) +
               " values differ in their bits; largest difference: " + vr.worst;
      throw VerifyError(msg);
    }
    llvm_check = std::move(vr);
  }
  // The verification step's norm and clip coefficient, for the report: the reference's, or
  // another mode's when the reference computed no norm (unfused without clipping).
  sf::StepResult ref_result = rr.verify_result;
  for (Variant v : checked)
    if (std::isnan(ref_result.grad_norm)) ref_result = runs[idx(v)].verify_result;
  for (Variant v : kAllVariants)  // built for the check alone: free them before timing
    if (!timed(v)) runs[idx(v)].opt.reset(), runs[idx(v)].own.reset();

  // ---- Phase 3: interleaved timing -----------------------------------------------------------
  // The update pass alone, to split the fused step's time between its two passes: another
  // fused optimizer (on the first timed backend) over the same buffers, without clipping,
  // taking plain steps (no reduce pass). It has its own state; the weights it moves are the
  // fused optimizer's, which changes nothing that is timed.
  std::optional<sf::Optimizer> update_only;
  if (a.breakdown && timed(first_fused)) {
    sf::OptimizerOptions o = options_for(first_fused);
    o.max_grad_norm.reset();
    o.track_grad_norm = false;
    update_only.emplace(make_optimizer(config, *runs[idx(first_fused)].buf, o));
  }
  progress.say("allocating the bandwidth probe (" + with_commas(n) + " floats x 4)");
  sb::BandwidthProbe probe(n, threads);
  progress.done();
  std::map<sb::Pattern, std::vector<double>> bw_s;
  std::vector<double> update_s;
  const int iterations = a.warmup + a.steps;
  // A first guess at one iteration's length, in fused steps (good to a factor of two; the
  // measured time replaces it after the first iteration): the probes move ~1.6x a step's
  // bytes, the unfused step takes ~5x the fused one, the interpreted ~2x.
  double iteration_s =
      rss_step_s * (2.0 + (timed(Variant::fused) ? 1.0 : 0.0) + (timed(Variant::fused_llvm) ? 1.0 : 0.0) +
                    (update_only ? 1.0 : 0.0) + (timed(Variant::unfused) ? 5.0 : 0.0) +
                    (timed(Variant::interpreted) ? 2.0 : 0.0));
  const auto t_loop = std::chrono::steady_clock::now();
  for (int it = 0; it < iterations; ++it) {
    const bool timed_it = it >= a.warmup;
    if (it > 0) iteration_s = seconds_since(t_loop) / it;
    if (iteration_s * iterations > kProgressAfterSeconds) {
      std::string last;
      for (Variant v : variants)
        if (!runs[idx(v)].samples.empty())
          last += format("%s%s %.1f ms", last.empty() ? "  (last: " : ", ", variant_name(v),
                         runs[idx(v)].samples.back() * 1e3);
      progress.say((timed_it ? "timing: step " + std::to_string(it - a.warmup + 1) + "/" + std::to_string(a.steps)
                             : "warm-up: step " + std::to_string(it + 1) + "/" + std::to_string(a.warmup)) +
                   (last.empty() ? "" : last + ")"));
    }
    for (sb::Pattern p : sb::kAllPatterns) {
      const double s = probe.run(p);
      if (timed_it) bw_s[p].push_back(s);
    }
    // The two fused backends trade places every other iteration, so that neither always
    // runs right after the same thing (the probes leave the caches in a different state
    // than a step does).
    std::vector<Variant> order = variants;
    if (it % 2 == 1 && timed(Variant::fused) && timed(Variant::fused_llvm))
      std::swap(order[0], order[1]);  // fused, fused-llvm are the first two, in kAllVariants order
    for (Variant v : order) {
      ModeRun& r = runs[idx(v)];
      // The library's unfused mode unscales into an fp32 temporary and leaves the caller's
      // gradients alone; restoring them anyway (untimed) keeps every iteration's input the
      // same should a baseline ever write them in place, as eager PyTorch's unscale_ does.
      if (v == Variant::unfused) r.buf->copy_grads_from(fb, threads);
      auto t0 = std::chrono::steady_clock::now();
      const sf::StepResult res = r.opt->step_scaled(S);
      const double t = seconds_since(t0);
      check_applied(res, variant_name(v), it);
      if (timed_it) r.samples.push_back(t);
      if (v == first_fused && update_only) {
        t0 = std::chrono::steady_clock::now();
        update_only->step();
        if (timed_it) update_s.push_back(seconds_since(t0));
      }
    }
  }
  progress.done();

  // ---- Report --------------------------------------------------------------------------------
  const sb::StepBytes bytes =
      sb::step_bytes(wt, gt, !a.no_masters, state_streams, /*reduce_pass=*/true);  // step_scaled always reduces
  const double step_bytes = bytes.per_param() * static_cast<double>(n);
  std::map<sb::Pattern, double> bw_gbs;  // median GB/s per pattern
  std::map<sb::Pattern, sb::Summary> bw_sum;
  for (sb::Pattern p : sb::kAllPatterns) {
    bw_sum[p] = sb::summarize(bw_s[p]);
    bw_gbs[p] = probe.bytes(p) / bw_sum[p].median * 1e-9;
  }
  const double ref_gbs = bw_gbs[sb::Pattern::adam_like];
  for (Variant v : variants) {
    ModeRun& r = runs[idx(v)];
    r.summary = sb::summarize(r.samples);
    r.gbs = step_bytes / r.summary.median * 1e-9;
  }
  struct Ratio {
    RatioPair pair;
    double median_ratio;      // median time of b / median time of a
    sb::Summary per_iteration;  // the same from each iteration's own pair of samples
  };
  std::vector<Ratio> ratios;
  for (const RatioPair& p : kRatioPairs) {
    if (!timed(p.a) || !timed(p.b)) continue;
    const ModeRun &ra = runs[idx(p.a)], &rb = runs[idx(p.b)];
    std::vector<double> paired;
    for (std::size_t i = 0; i < ra.samples.size(); ++i) paired.push_back(rb.samples[i] / ra.samples[i]);
    ratios.push_back({p, rb.summary.median / ra.summary.median, sb::summarize(paired)});
  }
  auto ratio_name = [](const RatioPair& p) { return std::string(variant_name(p.a)) + "/" + variant_name(p.b); };
  auto ratio_key = [](const RatioPair& p) { return variant_key(p.a) + "_over_" + variant_key(p.b) + "_speed"; };
  // Each mode's share of the bandwidth from each iteration's own samples (probe and step
  // taken back to back), whose median is less sensitive to drift between iterations.
  std::array<sb::Summary, kAllVariants.size()> paired_frac;
  for (Variant v : variants) {
    std::vector<double> frac;
    const auto& samples = runs[idx(v)].samples;
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const double ref_i = probe.bytes(sb::Pattern::adam_like) / bw_s[sb::Pattern::adam_like][i];
      frac.push_back(step_bytes / samples[i] / ref_i);
    }
    paired_frac[idx(v)] = sb::summarize(frac);
  }
  // Update pass alone (plain step: no reduce pass), and the reduce pass by difference.
  const sb::StepBytes plain_bytes = sb::step_bytes(wt, gt, !a.no_masters, state_streams, /*reduce_pass=*/false);
  const sb::Summary uo = sb::summarize(update_s);
  const double update_gbs = update_only ? plain_bytes.per_param() * static_cast<double>(n) / uo.median * 1e-9 : 0.0;
  const double reduce_s = update_only ? runs[idx(first_fused)].summary.median - uo.median : 0.0;
  const double reduce_gbs = update_only && reduce_s > 0 ? bytes.reduce * static_cast<double>(n) / reduce_s * 1e-9 : 0.0;

  const std::string norm = a.norm_type == "inf" ? "inf" : "2";
  const bool masters = !a.no_masters && wt != sf::DType::f32;
  std::string mode_list;
  for (Variant v : variants) mode_list += (mode_list.empty() ? "" : ", ") + std::string(variant_name(v));
  const std::string llvm_desc = have_llvm() ? format(" · LLVM %s (%s)", sf::llvm_version(), sf::llvm_cpu()) : "";

  std::string out;  // the table, printed at the end unless --json-only
  out += format("stepfuse-bench %s · backend %s · CPU target %s%s · %d thread%s\n", sf::version(), a.backend.c_str(),
                sf::cpu_target(), llvm_desc.c_str(), threads, threads == 1 ? "" : "s");
  out += format("%s %s: %zu tensor%s, %s parameters\n", from_file ? "shapes file" : "preset", preset.name.c_str(),
                preset.tensors.size(), preset.tensors.size() == 1 ? "" : "s", with_commas(n).c_str());
  const std::string clip = a.clip > 0 ? format("%g (L%s norm)", a.clip, norm.c_str()) : "off";
  out += format("%s · weights %s%s · grads %s · clip %s · loss scale %g\n",
                std::string(sf::optimizer_name(config)).c_str(), a.weights.c_str(), masters ? " + fp32 masters" : "",
                a.grads.c_str(), clip.c_str(), S);
  out += format("bytes the step must move: %s (%d state stream%s) = %.3f GB per step\n", bytes.breakdown().c_str(),
                state_streams, state_streams == 1 ? "" : "s", step_bytes * 1e-9);
  for (const Verified& v : verified) {
    const sb::VerifyReport& vr = v.report;
    out += format("verified before timing: one %s and one %s step agree on %s values (%.1f%% bitwise, worst "
                  "%.2f of the tolerance, rel %.0e)\n",
                  variant_name(v.mode), variant_name(ref), with_commas(vr.values_checked).c_str(),
                  100.0 * static_cast<double>(vr.identical) /
                      static_cast<double>(std::max<std::int64_t>(vr.values_checked, 1)),
                  vr.worst_ratio, vr.rel_tol);
  }
  if (llvm_check)
    out += format("verified before timing: one fused-llvm and one fused (Highway) step are bitwise equal: %s values, "
                  "the grad norm and the clip coefficient\n",
                  with_commas(llvm_check->values_checked).c_str());
  out += format("  (grad norm %.6g, clip coef %.6g)\n", ref_result.grad_norm, ref_result.clip_coef);
  out += format("\nmemory bandwidth, same run, %d thread%s, %s floats per array (median of %d, min-max):\n", threads,
                threads == 1 ? "" : "s", with_commas(n).c_str(), a.steps);
  for (sb::Pattern p : sb::kAllPatterns) {
    const double b = probe.bytes(p) * 1e-9;
    out += format("  %-10s %2d B/elem  %6.1f GB/s  (%.1f-%.1f)\n", std::string(sb::pattern_name(p)).c_str(),
                  sb::pattern_bytes_per_element(p), bw_gbs[p], b / bw_sum[p].max, b / bw_sum[p].min);
  }
  out += format("\n%d timed steps per mode after %d warm-up, interleaved (%s%s):\n", a.steps, a.warmup,
                mode_list.c_str(),
                timed(Variant::fused) && timed(Variant::fused_llvm)
                    ? "; fused runs Highway's code, fused-llvm LLVM's, in alternating order"
                    : timed(Variant::fused_llvm) ? "; fused-llvm runs LLVM's code" : "");
  out += format("  %-11s %10s %9s %9s %9s %8s %12s\n", "mode", "median ms", "min", "max", "IQR", "GB/s", "% adam_like");
  auto row = [&](const char* name, const sb::Summary& s, double gbs) {
    out += format("  %-11s %10.2f %9.2f %9.2f %9.2f %8.1f %11.1f%%\n", name, s.median * 1e3, s.min * 1e3, s.max * 1e3,
                  (s.p75 - s.p25) * 1e3, gbs, 100.0 * gbs / ref_gbs);
  };
  for (Variant v : variants) {
    row(variant_name(v), runs[idx(v)].summary, runs[idx(v)].gbs);
    if (v == first_fused && update_only) row("update", uo, update_gbs);
  }
  if (update_only)
    out += format("  (update: the fused update pass alone, a plain step() without reduce pass, %g B/param; the reduce\n"
                  "   pass then takes the rest of the fused step: %.2f ms, %.1f GB/s for %g B/param = %.1f%% of read)\n",
                  plain_bytes.per_param(), reduce_s * 1e3, reduce_gbs, bytes.reduce,
                  100.0 * reduce_gbs / bw_gbs[sb::Pattern::read]);
  for (const Ratio& r : ratios) {
    if (is_llvm_over_highway(r.pair)) {
      // Per iteration: each iteration's two fused steps ran back to back, so their ratio
      // is less sensitive to a busy machine than the ratio of the medians.
      const sb::Summary& pi = r.per_iteration;
      out += format("  llvm / highway: %.2fx faster (median of per-iteration ratios, %.2f-%.2f; "
                    "median times %.2fx)%s\n",
                    pi.median, pi.min, pi.max, r.median_ratio, pi.median < 1.0 ? " -- LLVM is slower" : "");
      continue;
    }
    out += format("  %s speed ratio: %.2fx (median %s time / median %s time)\n", ratio_name(r.pair).c_str(),
                  r.median_ratio, variant_name(r.pair.b), variant_name(r.pair.a));
  }
  {
    const Variant v0 = variants.front();
    const sb::Summary& pf = paired_frac[idx(v0)];
    out += format("  per iteration (median, min-max): %s at %.1f%% of adam_like (%.1f-%.1f)", variant_name(v0),
                  100.0 * pf.median, 100.0 * pf.min, 100.0 * pf.max);
    for (const Ratio& r : ratios)
      out += format(", %s %.2fx (%.2f-%.2f)", ratio_name(r.pair).c_str(), r.per_iteration.median,
                    r.per_iteration.min, r.per_iteration.max);
    out += "\n";
  }
  if (timed(Variant::fused_llvm))  // at model size, most of the time is allocating and filling state and masters
    out += format("  LLVM optimizer construction: %.1f ms for the first (16 elements: its kernels compiled now, or "
                  "loaded from the kernel cache); at model size %.1f ms, Highway's %.1f ms\n",
                  llvm_first_ms, runs[idx(Variant::fused_llvm)].construct_ms, runs[idx(Variant::fused)].construct_ms);
  out += format("\npeak RSS, fused-only phase (%d steps, before any other buffer of model size existed):\n",
                a.rss_steps);
  out += format("  %.3f GiB peak vs %.3f GiB weights+grads+state%s = %.2f%% (%+.2f%% above it; process before "
                "allocating: %.1f MiB)\n",
                gib(static_cast<double>(rss_peak)), gib(model_bytes), master_bytes > 0 ? "+masters" : "",
                100.0 * static_cast<double>(rss_peak) / model_bytes,
                100.0 * (static_cast<double>(rss_peak) / model_bytes - 1.0),
                static_cast<double>(rss_start) / (1024.0 * 1024.0));
  out += format("total run time %.1f s\n", seconds_since(t_start));
  if (!a.json_only) std::fputs(out.c_str(), stdout);

  if (json_out.is_open() || a.json_only) {
    json j;
    j["tool"] = "stepfuse-bench";
    j["version"] = sf::version();
    j["cpu_target"] = sf::cpu_target();
    j["llvm_version"] = sf::llvm_version();  // "" without LLVM
    j["llvm_cpu"] = sf::llvm_cpu();
    j["threads"] = threads;
    json fusion = json::array();
    for (sf::Fusion f : modes) fusion.push_back(mode_name(f));
    json cpu_backend_names = json::array();  // of the fused mode
    for (sf::CpuBackend b : cpu_backends) cpu_backend_names.push_back(std::string(sf::cpu_backend_name(b)));
    j["config"] = {{"preset", from_file ? json(nullptr) : json(preset.name)},
                   {"shapes_file", from_file ? json(a.shapes_path) : json(nullptr)},
                   {"tensors", preset.tensors.size()},
                   {"params", n},
                   {"backend", a.backend},
                   {"fusion", fusion},
                   {"cpu_backends", cpu_backend_names},
                   {"optimizer", std::string(sf::optimizer_name(config))},
                   {"weights", a.weights},
                   {"grads", a.grads},
                   {"master_weights", masters},
                   {"clip", a.clip},
                   {"norm_type", norm},
                   {"loss_scale", S},
                   {"steps", a.steps},
                   {"warmup", a.warmup},
                   {"rss_steps", a.rss_steps}};
    j["step_bytes"] = {{"reduce_per_param", bytes.reduce},
                       {"update_per_param", bytes.update},
                       {"per_param", bytes.per_param()},
                       {"state_streams", state_streams},
                       {"per_step", step_bytes}};
    json bw = json::object();
    for (sb::Pattern p : sb::kAllPatterns) {
      const double b = probe.bytes(p) * 1e-9;
      bw[std::string(sb::pattern_name(p))] = {{"bytes_per_element", sb::pattern_bytes_per_element(p)},
                                               {"gbs_median", bw_gbs[p]},
                                               {"gbs_min", b / bw_sum[p].max},
                                               {"gbs_max", b / bw_sum[p].min},
                                               {"seconds", bw_s[p]}};
    }
    j["bandwidth"] = bw;
    auto mode_json = [&](const sb::Summary& s, const std::vector<double>& samples, double gbs) {
      return json{{"ms", summary_json(s, 1e3)},
                  {"samples_ms", scaled(samples, 1e3)},
                  {"gbs", gbs},
                  {"fraction_of_adam_like", gbs / ref_gbs}};
    };
    // One key per timed variant ("fused" (Highway's code), "fused_llvm", "unfused",
    // "interpreted"), and one per pair of timed variants ("fused_over_unfused_speed" =
    // median unfused time / median fused time, "fused_llvm_over_fused_speed", ...).
    for (Variant v : variants)
      j[variant_key(v)] = mode_json(runs[idx(v)].summary, runs[idx(v)].samples, runs[idx(v)].gbs);
    for (const Ratio& r : ratios) j[ratio_key(r.pair)] = r.median_ratio;
    if (update_only) {
      j["fused_update_only"] = mode_json(uo, update_s, update_gbs);
      j["fused_update_only"]["bytes_per_param"] = plain_bytes.per_param();
      j["fused_update_only"]["cpu_backend"] = std::string(sf::cpu_backend_name(cpu_backend_of(first_fused)));
      j["fused_reduce_by_difference"] = {{"ms", reduce_s * 1e3},
                                         {"gbs", reduce_gbs},
                                         {"fraction_of_read", reduce_gbs / bw_gbs[sb::Pattern::read]}};
    }
    json per_it = json::object();
    for (Variant v : variants)
      per_it[variant_key(v) + "_fraction_of_adam_like"] = summary_json(paired_frac[idx(v)], 1.0);
    for (const Ratio& r : ratios) per_it[ratio_key(r.pair)] = summary_json(r.per_iteration, 1.0);
    j["per_iteration"] = per_it;
    // The top-level figures are the first pair's (fused against unfused by default);
    // "pairs" has every pair checked.
    const sb::VerifyReport& v0 = verified.front().report;
    json pairs = json::array();
    for (const Verified& v : verified)
      pairs.push_back({{"mode", variant_name(v.mode)},
                       {"reference", variant_name(ref)},
                       {"values_checked", v.report.values_checked},
                       {"values_bitwise_equal", v.report.identical},
                       {"worst_fraction_of_tolerance", v.report.worst_ratio},
                       {"rel_tol", v.report.rel_tol},
                       {"worst", v.report.worst}});
    j["verification"] = {{"ok", true},
                         {"values_checked", v0.values_checked},
                         {"values_bitwise_equal", v0.identical},
                         {"worst_fraction_of_tolerance", v0.worst_ratio},
                         {"rel_tol", v0.rel_tol},
                         {"worst", v0.worst},
                         {"grad_norm", ref_result.grad_norm},
                         {"clip_coef", ref_result.clip_coef},
                         {"reference", variant_name(ref)},
                         {"pairs", pairs}};
    if (llvm_check)  // fused_llvm against fused (Highway's code), bit for bit
      j["verification"]["llvm_vs_highway"] = {{"bitwise_equal", true},
                                              {"values_checked", llvm_check->values_checked},
                                              {"values_bitwise_equal", llvm_check->identical},
                                              {"grad_norm", runs[idx(Variant::fused_llvm)].verify_result.grad_norm},
                                              {"clip_coef", runs[idx(Variant::fused_llvm)].verify_result.clip_coef}};
    if (timed(Variant::fused_llvm))
      j["llvm"] = {{"version", sf::llvm_version()},
                   {"cpu", sf::llvm_cpu()},
                   {"first_construction_ms", llvm_first_ms},
                   {"model_construction_ms", runs[idx(Variant::fused_llvm)].construct_ms},
                   {"highway_model_construction_ms", runs[idx(Variant::fused)].construct_ms}};
    j["rss"] = {{"phase", "fused only, before any other buffer of model size"},
                {"peak_bytes", rss_peak},
                {"peak_before_bytes", peak_start},
                {"current_before_bytes", rss_start},
                {"current_after_bytes", rss_after},
                {"weights_bytes", fb.weight_bytes()},
                {"grads_bytes", fb.grad_bytes()},
                {"state_bytes", state_bytes},
                {"master_bytes", master_bytes},
                {"model_bytes", model_bytes},
                {"peak_over_model", static_cast<double>(rss_peak) / model_bytes}};
    const std::string text = j.dump(2) + "\n";
    if (json_out.is_open()) {
      json_out << text;
      json_out.flush();
      if (!json_out) throw std::runtime_error("--json: writing '" + a.json_path + "' failed");
    }
    if (a.json_only) std::fputs(text.c_str(), stdout);
  }
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"stepfuse-bench: the fused optimizer step against the unfused baseline and the memory bandwidth "
               "measured in the same run.\nVerifies every timed mode against the unfused one (or the fused one) "
               "within fp32 rounding, and the fused step on LLVM code against Highway's bit for bit, before timing; times interleaved steps; reports medians, spread, bytes moved, GB/s, % of bandwidth, "
               "the speed ratios and peak RSS.",
               "stepfuse-bench"};
  std::string presets = "\nPresets (--preset):\n";
  for (const auto& [name, desc] : sb::preset_catalog())
    presets += "  " + name + std::string(name.size() < 16 ? 16 - name.size() : 1, ' ') + desc + "\n";
  app.footer(presets +
             "\nShapes files (--shapes FILE), the format --print-shapes writes: one tensor per line,\n"
             "  [NAME] COUNT      e.g.  transformer.wte.weight 38597376   or   4096   or   mlp 10M\n"
             "COUNT is an element count >= 0, optionally with a k/M/G suffix (powers of 1000); a tensor\n"
             "without a NAME is named t<index> (from 0). Names are unique, without whitespace. Blank\n"
             "lines and everything after a '#' are ignored. The list must hold at least one element.\n"
             "\nExit codes: 0 ok, 1 bad arguments (a bad shapes file, a configuration or backend the library "
             "rejects, --cpu-backend llvm without LLVM), 2 verification failed (a mode disagrees with the reference, "
             "the LLVM fused step is not bitwise Highway's, or a step was skipped), 3 other errors.");
  app.set_version_flag("--version", std::string(sf::version()));
  CLI::Option* preset_opt =
      app.add_option("--preset", a.preset, "tensor list: gpt2-124m, resnet50, llama7b-layer, many-small or flat:N")
          ->capture_default_str();
  CLI::Option* shapes_opt = app.add_option("--shapes", a.shapes_path,
                                           "tensor list from FILE: one '[NAME] COUNT' per line (see below)")
                                ->type_name("FILE");
  preset_opt->excludes(shapes_opt);
  app.add_flag("--print-shapes", a.print_shapes,
               "print the tensor list (NAME COUNT per line, the --shapes format) and exit");
  app.add_option("--fusion", a.fusion,
                 "modes to time, comma-separated: fused, unfused, interpreted (timed interleaved in that order)")
      ->delimiter(',')
      ->check(CLI::IsMember({"fused", "unfused", "interpreted"}))
      ->type_name("LIST")
      ->default_str("fused,unfused");
  app.add_option("--cpu-backend", a.cpu_backends,
                 "the CPU code the fused mode is timed with, once per backend, comma-separated: highway, llvm "
                 "(the LLVM step is verified bitwise equal to Highway's first; default: highway,llvm when "
                 "stepfuse has LLVM, else highway)")
      ->delimiter(',')
      ->type_name("LIST")
      ->default_str(have_llvm() ? "highway,llvm" : "highway");
  app.add_option("--backend", a.backend,
                 "where the step runs: cpu, or cuda (GPU 0: device buffers, the fused step timed with CUDA events "
                 "against a device-to-device copy, verified against the CPU first)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--optimizer", a.optimizer, "optimizer, with PyTorch's default hyperparameters")
      ->check(CLI::IsMember({"adamw", "adam", "sgd", "adagrad", "rmsprop", "lion"}))
      ->capture_default_str();
  app.add_option("--weights", a.weights, "weight dtype (f16/bf16 keep fp32 masters unless --no-masters)")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}))
      ->capture_default_str();
  app.add_option("--grads", a.grads, "gradient dtype")->check(CLI::IsMember({"f32", "f16", "bf16"}))->capture_default_str();
  app.add_flag("--no-masters", a.no_masters, "no fp32 master copies for f16/bf16 weights");
  app.add_flag("!--no-breakdown", a.breakdown,
               "skip timing the fused update pass alone (saves a third optimizer's state)");
  app.add_option("--clip", a.clip, "max gradient norm for clipping, on the unscaled gradients (0 = off)")
      ->capture_default_str();
  app.add_option("--norm-type", a.norm_type, "clipping norm: 2 or inf")->check(CLI::IsMember({"2", "inf"}))->capture_default_str();
  app.add_option("--threads", a.threads, "threads for the step and the bandwidth probe (0 = library default)")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  app.add_option("--steps", a.steps, "timed steps per mode")->check(CLI::Range(1, 1000000))->capture_default_str();
  app.add_option("--warmup", a.warmup, "untimed warm-up iterations")->check(CLI::Range(0, 1000000))->capture_default_str();
  app.add_option("--rss-steps", a.rss_steps, "fused steps in the peak-RSS phase")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--loss-scale", a.loss_scale, "loss scale S: gradients are stored multiplied by S")
      ->capture_default_str();
  app.add_option("--json", a.json_path, "also write every figure to FILE as JSON")->type_name("FILE");
  app.add_flag("--json-only", a.json_only,
               "print the JSON report to stdout instead of the table (no progress line on stderr)");
  try {
    app.parse(argc, argv);
    a.fusion_given = app.get_option("--fusion")->count() > 0;
    a.cpu_backend_given = app.get_option("--cpu-backend")->count() > 0;
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help/version (rc 0) or the error
    return rc == 0 ? kExitOk : kExitUsage;
  }
  try {
    return run(a);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "stepfuse-bench: %s\n", e.what());
    return kExitUsage;
  } catch (const VerifyError& e) {
    std::fprintf(stderr, "stepfuse-bench: VERIFICATION FAILED: %s\n", e.what());
    return kExitVerify;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stepfuse-bench: error: %s\n", e.what());
    return kExitError;
  }
}
