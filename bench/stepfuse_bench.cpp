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
//      (unfused, or fused when unfused is not timed): every weight, master (with
//      --masters compensated: weight + compensation) and state value must agree within
//      fp32 rounding, and the fused step on LLVM code must equal the one on Highway's bit
//      for bit (compensations too); a fused step that rounds the weights
//      stochastically (--rounding stochastic) must be the one rounding to nearest except
//      for which of the two bf16 values around each updated weight it stores, and bitwise
//      the same on both CPU backends; a fused step storing its state as bf16 or q8 (--state)
//      must be bitwise the unfused step storing it alike, weights and stored state (exit code
//      2 otherwise) — nothing is timed before this;
//   3. measure: warm-up, then timed iterations of [bandwidth probes, then each mode of
//      --fusion in the order fused (once per --cpu-backend, --rounding and --state, with the
//      fused update pass alone), unfused, interpreted], interleaved so that drift in the
//      machine affects all of them alike.
// --groups on builds every optimizer with two param groups (bench/param_groups.hpp);
// --groups compare builds each timed mode twice, with one group and with two, verifies
// both (phase 2 runs once for each) and times them back to back in phase 3, in
// alternating order, so that "two groups / one group" is a ratio of one run.
// --ranks N (the sharded step across MPI processes) is ranks.cpp's, from main.
// Each phase is a function below; run() calls them in order. The report (the table and
// the JSON) is stepfuse_bench_report.cpp's; what the phases hand each other is declared
// in stepfuse_bench.hpp.

#include "stepfuse_bench.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bandwidth.hpp"
#include "cli_support.hpp"
#include "cuda_bench.hpp"
#include "default_configs.hpp"
#include "model_buffers.hpp"
#include "param_groups.hpp"
#include "presets.hpp"
#include "ranks.hpp"
#include "rss.hpp"
#include "stats.hpp"
#include "step_bytes.hpp"
#include "stepfuse/stepfuse.hpp"
#include "verify.hpp"

namespace sf = stepfuse;
namespace sb = stepfuse::bench;

namespace stepfuse::bench::tool {

bool Case::timed_mode(sf::Fusion f) const { return std::find(modes.begin(), modes.end(), f) != modes.end(); }
bool Case::timed(Variant v) const { return std::find(variants.begin(), variants.end(), v) != variants.end(); }
bool Case::timed_state(sf::StateFormat f) const {
  return std::any_of(variants.begin(), variants.end(), [&](Variant v) { return v.state == f; });
}
sf::OptimizerOptions Case::options_for(Variant v) const {
  sf::OptimizerOptions o = options;
  o.fusion = fusion_of(v);
  o.cpu_backend = cpu_backend_of(v);
  if (rounding_of(v) == Rounding::stochastic) o.stochastic_rounding = true, o.seed = kStochasticSeed;
  o.state_format = state_of(v);  // min_q8_numel: the library's default (4096)
  return o;
}

namespace {

// The progress line appears only when the timed phase is expected to take longer than this.
constexpr double kProgressAfterSeconds = 3.0;

// PyTorch's defaults for each optimizer.
sf::OptimizerConfig make_config(const std::string& name) {
  if (std::optional<sf::OptimizerConfig> config = sb::default_config_named(name)) return *config;
  throw UsageError("--optimizer: unknown optimizer '" + name + "'");
}

void check_applied(const sf::StepResult& r, const char* mode, int iteration) {
  if (!r.applied)
    throw VerifyError(std::string("the ") + mode + " step " + std::to_string(iteration) +
                      " was skipped (found_inf=" + (r.found_inf ? "true" : "false") +
                      ") although every gradient is finite");
}

// An optimizer over `buf` on the CPU, with c.config: one group, or (grouped) the decay
// group of tensors [0, split) and the no-decay group of the rest (bench/param_groups.hpp).
// A configuration the library rejects is a usage error (exit code 1). (--backend cuda takes
// its own path: cuda_bench.cpp.)
sf::Optimizer make_optimizer(const Case& c, bool grouped, std::size_t split, const sb::ModelBuffers& buf,
                             const sf::OptimizerOptions& opts) {
  try {
    if (grouped) return sf::Optimizer(sb::decay_groups(buf.params(), split, c.config), opts);
    return sf::Optimizer(c.config, buf.params(), opts);
  } catch (const sf::Error& e) {
    if (e.code() == sf::ErrorCode::invalid_argument || e.code() == sf::ErrorCode::unsupported)
      throw UsageError((opts.state_format != sf::StateFormat::f32
                            ? "--state " + std::string(sf::state_format_name(opts.state_format)) + ": "
                            : std::string()) +
                       "the library rejects this configuration: " + e.what());
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

// The roundings --rounding names, each once, nearest first (the order of kAllVariants).
std::vector<Rounding> selected_roundings(const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (n != "nearest" && n != "stochastic")
      throw UsageError("--rounding: unknown rounding '" + n + "' (expected nearest or stochastic, comma-separated)");
  std::vector<Rounding> roundings;
  for (Rounding r : {Rounding::nearest, Rounding::stochastic})
    if (std::find(names.begin(), names.end(), rounding_name(r)) != names.end()) roundings.push_back(r);
  if (roundings.empty()) throw UsageError("--rounding: name at least one of nearest, stochastic");
  return roundings;
}

// The state formats --state names, each once, in kAllStates order (f32 first).
std::vector<sf::StateFormat> selected_states(const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (n != "f32" && n != "bf16" && n != "q8")
      throw UsageError("--state: unknown state format '" + n + "' (expected f32, bf16 or q8, comma-separated)");
  std::vector<sf::StateFormat> states;
  for (sf::StateFormat f : kAllStates)
    if (std::find(names.begin(), names.end(), sf::state_format_name(f)) != names.end()) states.push_back(f);
  if (states.empty()) throw UsageError("--state: name at least one of f32, bf16, q8");
  return states;
}

// The variants to time, in kAllVariants order: the fused mode once per CPU backend, rounding
// and state format; the other modes with f32 state.
std::vector<Variant> selected_variants(const std::vector<sf::Fusion>& modes,
                                       const std::vector<sf::CpuBackend>& backends,
                                       const std::vector<Rounding>& roundings,
                                       const std::vector<sf::StateFormat>& states) {
  std::vector<Variant> variants;
  for (Variant v : kAllVariants) {
    if (std::find(modes.begin(), modes.end(), fusion_of(v)) == modes.end()) continue;
    if (is_fused(v) &&
        (std::find(backends.begin(), backends.end(), cpu_backend_of(v)) == backends.end() ||
         std::find(roundings.begin(), roundings.end(), rounding_of(v)) == roundings.end() ||
         std::find(states.begin(), states.end(), state_of(v)) == states.end()))
      continue;
    if (!is_fused(v) && state_of(v) != sf::StateFormat::f32) continue;
    variants.push_back(v);
  }
  return variants;
}

GroupsMode parse_groups(const std::string& s) {
  if (s == "off") return GroupsMode::off;
  if (s == "on") return GroupsMode::on;
  if (s == "compare") return GroupsMode::compare;
  throw UsageError("--groups: unknown mode '" + s + "' (expected off, on or compare)");
}

// ---- Phase 0: the arguments ----------------------------------------------------------------

// The tensor list of --shapes FILE, or else of --preset; a bad one is a usage error.
sb::Preset load_preset(const Args& a, bool from_file) {
  try {
    return from_file ? sb::load_shapes_file(a.shapes_path) : sb::make_preset(a.preset);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string(from_file ? "--shapes: " : "--preset: ") + e.what());
  }
}

// Checks every argument that can be checked without building anything (usage errors, in
// this order) and resolves them into the case to run.
Case resolve_case(const Args& a, sb::Preset preset, bool from_file) {
  Case c;
  c.preset = std::move(preset);
  c.from_file = from_file;
  c.modes = selected_modes(a.fusion);
  c.cpu_backends = selected_cpu_backends(a);
  c.roundings = selected_roundings(a.rounding);
  c.states = selected_states(a.state);
  c.variants = selected_variants(c.modes, c.cpu_backends, c.roundings, c.states);
  c.config = make_config(a.optimizer);
  c.weights = parse_dtype("--weights", a.weights);
  c.grads = parse_dtype("--grads", a.grads);
  check_loss_scale_and_clip(a, c.grads);
  if (a.backend != "cpu" && a.backend != "cuda")
    throw UsageError("--backend: unknown backend '" + a.backend + "' (expected cpu or cuda)");
  if (a.cpu_backend_given && a.backend == "cuda")
    throw UsageError("--cpu-backend: chooses the code of the fused step on the CPU; --backend cuda times the GPU's "
                     "(leave --cpu-backend out)");
  if (a.cpu_backend_given && !c.timed_mode(sf::Fusion::fused))
    throw UsageError("--cpu-backend: chooses the code of the fused step, and --fusion times no fused step");
  const bool stochastic = std::find(c.roundings.begin(), c.roundings.end(), Rounding::stochastic) != c.roundings.end();
  // Compensated weights: the library's conditions (bf16 weights, no stochastic rounding) said
  // as the flags that meet them (--ranks refuses it in main; the CUDA path sets it as well).
  if (a.compensated) {
    if (c.weights != sf::DType::bf16)
      throw UsageError("--masters compensated: keeps a bf16 compensation beside each bf16 weight in place of its fp32 "
                       "master, and the weights are " + a.weights + "; pass --weights bf16");
    if (stochastic)
      throw UsageError("--masters compensated and --rounding stochastic exclude each other (the compensation keeps "
                       "what rounding the weights to nearest loses; stochastic rounding keeps it on average): leave "
                       "--rounding out, or pass --masters off to time stochastic rounding");
  }
  // Stochastic rounding: the library's conditions (bf16 weights, no masters) said as the flags
  // that meet them, and what this tool times it on (the CPU; --ranks refuses it in ranks.cpp).
  if (stochastic) {
    if (a.backend == "cuda")
      throw UsageError("--rounding stochastic: --backend cuda does not time it yet (stepfuse-bench's CUDA path "
                       "times the step rounding to nearest); pass --backend cpu, or leave --rounding out");
    if (c.weights != sf::DType::bf16 || !a.no_masters)
      throw UsageError("--rounding stochastic: rounds bf16 weights kept without fp32 masters; pass --weights bf16 "
                       "--masters off");
    if (!c.timed_mode(sf::Fusion::fused))
      throw UsageError("--rounding stochastic: rounds the fused step's weights, and --fusion times no fused step "
                       "(add fused to --fusion)");
  }
  // Optimizer state stored as bf16 or q8: the fused rows only, on the CPU.
  if (c.states != std::vector<sf::StateFormat>{sf::StateFormat::f32}) {
    std::string named;  // the formats other than f32, as given
    for (sf::StateFormat f : c.states)
      if (f != sf::StateFormat::f32) named += (named.empty() ? "" : ",") + std::string(sf::state_format_name(f));
    std::string named_all;  // every format, as given
    for (sf::StateFormat f : c.states) named_all += (named_all.empty() ? "" : ",") + std::string(sf::state_format_name(f));
    if (a.backend == "cuda" && c.states.size() != 1)
      throw UsageError("--state " + named_all + ": --backend cuda times one state format per run (the CPU path "
                       "interleaves several); pass one, e.g. --state q8, and compare the runs' fractions of the "
                       "device-to-device copy");
    if (!c.timed_mode(sf::Fusion::fused))
      throw UsageError("--state " + named + ": stores the fused step's state, and --fusion times no fused step "
                       "(add fused to --fusion)");
  }
  // The bf16 state of stochastically rounded weights: rounded stochastically (the library's
  // default) or to nearest (--state-rounding, one of the two: CLI11 checks it).
  if (a.state_rounding == "nearest" &&
      (!stochastic || std::find(c.states.begin(), c.states.end(), sf::StateFormat::bf16) == c.states.end()))
    throw UsageError("--state-rounding nearest: rounds the bf16 state of stochastically rounded weights (the -sr-bf16s "
                     "rows); pass --rounding stochastic (with --weights bf16 --masters off) and --state bf16");
  c.groups = parse_groups(a.groups);
  if (c.groups != GroupsMode::off) {
    if (a.backend == "cuda")
      throw UsageError("--groups: stepfuse-bench times param groups on the CPU only (leave --groups out with "
                       "--backend cuda)");
    c.split = sb::to_group_order(c.preset.tensors);
    for (std::size_t t = 0; t < c.split; ++t) c.split_params += c.preset.tensors[t].numel;
    if (c.split == 0 || c.split == c.preset.tensors.size())
      throw UsageError(std::string("--groups: splits the tensors into matrices (weight decay) and 1-D tensors (none), "
                                   "but every tensor of ") +
                       (from_file ? "the shapes file" : "preset " + c.preset.name) + " is " +
                       (c.split == 0 ? "1-D" : "a matrix") +
                       (from_file && c.split == 0 ? " (a tensor given by its element count is 1-D: give the dims of "
                                                    "matrices, e.g. 'wte 50257x768')"
                                                  : "") +
                       "; use a list with both");
    c.no_decay_config = sb::without_weight_decay(c.config);
  }

  sf::OptimizerOptions& opts = c.options;
  if (a.clip > 0) opts.max_grad_norm = a.clip;
  opts.norm_type = a.norm_type == "inf" ? INFINITY : 2.0;
  opts.master_weights = !a.no_masters;
  opts.compensated_weights = a.compensated;
  opts.stochastic_state_rounding = a.state_rounding == "stochastic";
  opts.num_threads = a.threads;
  // Explicit, so that STEPFUSE_CPU_BACKEND changes nothing (and CpuBackend::automatic
  // never swaps code under a timed loop); options_for() sets each variant's own.
  opts.cpu_backend = sf::CpuBackend::highway;
  c.loss_scale = a.loss_scale;
  c.n = c.preset.total_numel();
  const auto first = std::find_if(c.variants.begin(), c.variants.end(), is_fused);
  c.first_fused = first != c.variants.end() ? *first : Variant::fused;
  return c;
}

// --backend cuda: the rest of the run is cuda_bench.cpp's (no GPU: a usage error saying why).
int run_cuda(const Args& a, const Case& c, std::chrono::steady_clock::time_point t_start) {
  sb::require_cuda_backend();  // no GPU: a usage error saying why, before anything else
  if (a.fusion_given && c.modes != std::vector<sf::Fusion>{sf::Fusion::fused})
    throw UsageError("--fusion: --backend cuda times the fused step only (the unfused baseline on a GPU is "
                     "PyTorch's: bench/peers/torch_cuda_step.py); pass --fusion fused or leave --fusion out");
  sf::OptimizerOptions options = c.options;
  options.state_format = c.states.front();  // (one format: checked with the arguments)
  return sb::run_cuda_bench({.preset = c.preset, .from_file = c.from_file, .config = c.config, .weights = c.weights,
                             .grads = c.grads, .weights_name = a.weights, .grads_name = a.grads,
                             .norm_name = a.norm_type == "inf" ? "inf" : "2", .options = options, .clip = a.clip,
                             .loss_scale = a.loss_scale, .steps = a.steps, .warmup = a.warmup, .threads = a.threads,
                             .breakdown = a.breakdown, .json_path = a.json_path, .json_only = a.json_only,
                             .start = t_start});
}

// Builds every variant's optimizer over 16 elements (and, with q8 state, one tensor of 4096,
// the library's min_q8_numel, so that q8 state is built too): what the library rejects (the
// backend, a hyperparameter, the dtypes, a state format) it rejects for these as for the
// whole model, so it fails now, before the model is allocated. The LLVM kernels depend on the
// dtypes, the rounding, the state formats and the program, not on the sizes: each LLVM
// optimizer here compiles them (or loads them from the kernel cache), the ones of model size
// find them linked. Returns the first LLVM optimizer's construction time in ms (0 when no LLVM
// variant is timed).
double probe_configuration(const Case& c, Progress& progress) {
  double llvm_first_ms = 0;
  // With --groups, a matrix and a 1-D tensor, so that the two groups are built too.
  const bool groups = c.groups != GroupsMode::off;
  std::vector<sb::TensorShape> shapes =
      groups ? std::vector<sb::TensorShape>{{"probe", 16, {4, 4}}, {"probe_1d", 16, {16}}}
             : std::vector<sb::TensorShape>{{"probe", 16}};
  if (c.timed_state(sf::StateFormat::q8)) shapes.push_back({"probe_q8", 4096, {4096}});
  sb::ModelBuffers tiny(shapes, c.weights, c.grads);
  tiny.fill_weights(1);
  tiny.fill_grads(c.loss_scale, 1);
  // Every variant phase 2 may build: those that round to nearest on Highway always (with a
  // state format other than f32: fused and unfused when it is timed), LLVM's and the stochastic
  // ones when timed (and fused-sr when fused-llvm-sr is: its reference).
  for (Variant v : kAllVariants) {
    const bool llvm = cpu_backend_of(v) == sf::CpuBackend::llvm;
    if ((llvm || rounding_of(v) == Rounding::stochastic) && !c.timed(v) &&
        !(v.kind == Kind::fused_sr && c.timed(Variant{Kind::fused_llvm_sr, v.state})))
      continue;
    if (v.state != sf::StateFormat::f32 && (!c.timed_state(v.state) || v.kind == Kind::interpreted) && !c.timed(v))
      continue;
    if (llvm) progress.say(std::string("compiling (or loading) the LLVM kernels of ") + variant_name(v));
    const auto t0 = std::chrono::steady_clock::now();
    make_optimizer(c, groups, 1, tiny, c.options_for(v));
    if (llvm && llvm_first_ms == 0) llvm_first_ms = seconds_since(t0) * 1e3;
    if (c.groups == GroupsMode::compare) make_optimizer(c, false, 0, tiny, c.options_for(v));
  }
  return llvm_first_ms;
}

// --json FILE, opened before anything of model size is built (a path that cannot be
// written is a usage error); not open without --json.
std::ofstream open_json(const Args& a) {
  std::ofstream json_out;
  if (!a.json_path.empty()) {
    json_out.open(a.json_path);
    if (!json_out) throw UsageError("--json: cannot write '" + a.json_path + "'");
  }
  return json_out;
}

// ---- Phase 1: fused only, peak RSS ---------------------------------------------------------

// Allocates and fills the model's buffers, builds the fused optimizer over them, takes
// --rss-steps steps and reads the peak RSS, before anything else of model size exists.
FusedOnly fused_only_phase(const Args& a, const Case& c, Progress& progress) {
  FusedOnly fo;
  fo.rss_start = sb::current_rss_bytes();
  fo.peak_start = sb::peak_rss_bytes();
  progress.say("allocating and filling " + with_commas(c.n) + " parameters");
  fo.buffers = std::make_unique<sb::ModelBuffers>(c.preset.tensors, c.weights, c.grads);
  sb::ModelBuffers& fb = *fo.buffers;
  const int fill_threads = a.threads > 0 ? a.threads : static_cast<int>(std::thread::hardware_concurrency());
  fb.fill_weights(fill_threads);
  fb.fill_grads(c.loss_scale, fill_threads);

  std::vector<std::string> state_names;
  {
    std::optional<sf::Optimizer> opt0 =
        make_optimizer(c, c.primary_grouped(), c.split, fb, c.options_for(c.first_fused));
    fo.threads = opt0->num_threads();
    for (auto name : opt0->state_names()) state_names.emplace_back(name);
    fo.state_streams = static_cast<int>(state_names.size());
    // The state as stored (--state: f32, bf16 or q8 codes and their absmaxes).
    for (const auto& name : state_names) fo.state_bytes += sb::stored_state_bytes(*opt0, name);
    for (std::size_t t = 0; t < opt0->num_params(); ++t) {
      fo.master_bytes += 4.0 * static_cast<double>(opt0->master(t).size());
      fo.compensation_bytes += 2.0 * static_cast<double>(opt0->compensation(t).size());
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < a.rss_steps; ++i) {
      progress.say("fused-only phase (peak RSS): step " + std::to_string(i + 1) + "/" + std::to_string(a.rss_steps));
      check_applied(opt0->step_scaled(c.loss_scale), "fused", i);
    }
    fo.step_s = seconds_since(t0) / a.rss_steps;
    fo.rss_peak = sb::peak_rss_bytes();
    fo.rss_after = sb::current_rss_bytes();
  }
  fo.model_bytes = static_cast<double>(fb.weight_bytes() + fb.grad_bytes()) + fo.state_bytes + fo.master_bytes +
                   fo.compensation_bytes;
  return fo;
}

// ---- Phase 2: verify every timed variant before timing anything ----------------------------

// Builds each variant's optimizer in `runs` over buffers with identical contents (the first
// timed fused variant: the phase-1 buffers, refilled), takes one step with each and compares
// them; a disagreement is a VerifyError. With f32 state, against a reference within fp32
// rounding: unfused when it is timed, else fused. A mode that is the only one timed is still
// checked: fused (or unfused) against the other, built for the check alone. The fused step on
// Highway's code that rounds to nearest ("fused") takes part whenever a fused step with f32
// state is timed, as the reference or checked against it; LLVM's ("fused-llvm") must equal it
// bit for bit, and so agrees with the reference too. A step that rounds stochastically
// legitimately stores other weights than the reference: fused-sr is checked against fused
// instead, as the same step but for the weights' rounding (compare_rounding: everything else
// bitwise, every weight finite and fused's or its bf16 neighbour), and fused-llvm-sr must equal
// fused-sr bit for bit (built for that check alone when not timed).
// A state format other than f32 (--state bf16, q8), when any variant storing it is timed:
// every CPU path stores it bitwise alike, so the fused step on Highway's code that rounds to
// nearest (fused-bf16s, fused-q8; built for the check alone when not timed) must equal the
// unfused baseline storing its state the same way (unfused-bf16s, unfused-q8, built for this
// check alone) bit for bit: every weight, master, compensation, and the state as stored (bf16
// bits; q8 codes and block absmaxes). Its LLVM, "-sr" and LLVM "-sr" twins are then checked
// against it as the f32-state ones are against fused. What was built for the checks alone is
// freed before returning.
// `grouped`: the optimizers have two param groups. `share` (--groups compare's second pass,
// with two groups): the first pass's runs, whose buffers a variant timed there reuses
// (refilled; the first pass is verified already and only timed from here on).
Verification verify_variants(const Case& c, FusedOnly& fo, Runs& runs, Progress& progress, bool grouped,
                             const Runs* share = nullptr) {
  const std::string label = c.groups == GroupsMode::compare ? (grouped ? " (two groups)" : " (one group)") : "";
  const double S = c.loss_scale;
  const int threads = fo.threads;
  constexpr sf::StateFormat f32 = sf::StateFormat::f32;
  Verification ver;
  Variant& ref = ver.ref;
  ref = c.timed(Variant::unfused) ? Variant::unfused : Variant::fused;
  // Checked against ref: unfused and interpreted when timed, and fused when any fused
  // variant with f32 state is (the others are checked against fused, or fused-sr, below).
  const bool any_fused = std::any_of(c.variants.begin(), c.variants.end(),
                                     [](Variant v) { return is_fused(v) && v.state == sf::StateFormat::f32; });
  std::vector<Variant> checked;
  for (Variant v : {Variant::fused, Variant::unfused, Variant::interpreted})
    if (v != ref && (v == Variant::fused ? any_fused : c.timed(v))) checked.push_back(v);
  if (checked.empty() && c.timed_state(f32)) {  // only fused variants, or only unfused, are timed with f32 state
    ref = Variant::unfused;
    checked = {Variant::fused};
  }
  // Per state format: whether a "-sr" variant storing it is timed (fused-sr, of that state, is
  // then built as its reference).
  auto sr = [&](sf::StateFormat f) {
    return c.timed(Variant{Kind::fused_sr, f}) || c.timed(Variant{Kind::fused_llvm_sr, f});
  };
  auto built = [&](Variant v) {
    if (v.state == f32)
      return (!checked.empty() && v == ref) || std::find(checked.begin(), checked.end(), v) != checked.end() ||
             c.timed(v) || (v == Variant::fused_sr && sr(f32));
    return c.timed_state(v.state) && (c.timed(v) || v.kind == Kind::fused || v.kind == Kind::unfused ||
                                      (v.kind == Kind::fused_sr && sr(v.state)));
  };
  for (Variant v : kAllVariants) {
    if (!built(v)) continue;
    progress.say(std::string("verifying: one ") + variant_name(v) + " step" + label);
    ModeRun& r = runs[idx(v)];
    if (v == c.first_fused) {
      r.buf = fo.buffers.get();
    } else if (share != nullptr && (*share)[idx(v)].buf != nullptr) {
      r.buf = (*share)[idx(v)].buf;
    } else {
      r.own = std::make_unique<sb::ModelBuffers>(c.preset.tensors, c.weights, c.grads);
      r.buf = r.own.get();
    }
    r.buf->fill_weights(threads);
    r.buf->fill_grads(S, threads);
    const auto t0 = std::chrono::steady_clock::now();
    r.opt.emplace(make_optimizer(c, grouped, c.split, *r.buf, c.options_for(v)));
    r.construct_ms = seconds_since(t0) * 1e3;
    if ((cpu_backend_of(v) == sf::CpuBackend::llvm) != (r.opt->backend() == "llvm"))  // the option took effect
      throw std::runtime_error(std::string("the ") + variant_name(v) + " optimizer runs '" +
                               std::string(r.opt->backend()) + "' code");
    r.verify_result = r.opt->step_scaled(S);
  }
  for (Variant v : checked) {
    progress.say(std::string("verifying ") + variant_name(v) + " against " + variant_name(ref) + label);
    const ModeRun &r = runs[idx(v)], &rr = runs[idx(ref)];
    sb::VerifyReport vr = sb::compare_one_step(*r.opt, *r.buf, r.verify_result, *rr.opt, *rr.buf, rr.verify_result,
                                               S, threads, variant_name(v), variant_name(ref));
    check_verified(vr, std::string(variant_name(v)) + " and " + variant_name(ref) + " steps" + label + " disagree:",
                   "values outside the tolerance; worst");
    ver.verified.push_back({v, std::move(vr)});
  }
  // Two steps that must be the same bit for bit: `a` against `b`.
  auto check_bitwise = [&](Variant a, Variant b, const std::string& what, const std::string& step,
                           const char* a_label, const char* b_label) {
    progress.say(std::string("verifying ") + variant_name(a) + " against " + variant_name(b) + what + label);
    const ModeRun &ra = runs[idx(a)], &rb = runs[idx(b)];
    sb::VerifyReport vr = sb::compare_bitwise(*ra.opt, *ra.buf, ra.verify_result, *rb.opt, *rb.buf, rb.verify_result,
                                              S, threads, a_label, b_label);
    check_verified(vr, step, "values differ in their bits; largest difference");
    return vr;
  };
  for (sf::StateFormat f : kAllStates) {
    if (!c.timed_state(f)) continue;
    const std::size_t k = state_idx(f);
    const std::string in_state = f == f32 ? "" : format(" (%s state)", std::string(sf::state_format_name(f)).c_str());
    const Variant fused{Kind::fused, f}, fused_sr{Kind::fused_sr, f}, llvm{Kind::fused_llvm, f},
        llvm_sr{Kind::fused_llvm_sr, f}, unfused{Kind::unfused, f};
    // bf16 or q8 state: the fused step against the unfused one storing its state alike.
    if (f != f32)
      ver.unfused_check[k] = check_bitwise(fused, unfused, ", bit for bit",
                                           "the fused step" + in_state + label +
                                               " is not bitwise the unfused one storing its state alike:",
                                           variant_name(fused), variant_name(unfused));
    // LLVM's fused step against Highway's, bit for bit.
    if (c.timed(llvm))
      ver.llvm_check[k] = check_bitwise(
          llvm, fused, " (Highway), bit for bit",
          "the fused step" + in_state + label + " on LLVM code is not bitwise the one on Highway's:", "llvm",
          "highway");
    if (sr(f)) {
      progress.say(std::string("verifying ") + variant_name(fused_sr) + " against " + variant_name(fused) +
                   ": the same step but for the rounding of the weights" + label);
      const ModeRun &rs = runs[idx(fused_sr)], &rn = runs[idx(fused)];
      sb::VerifyReport vr = sb::compare_rounding(*rs.opt, *rs.buf, rs.verify_result, *rn.opt, *rn.buf, rn.verify_result,
                                                 S, threads, variant_name(fused_sr), variant_name(fused));
      check_verified(vr, "the fused step" + in_state + label + " rounding stochastically is not the one rounding to "
                     "nearest but for the rounding:", "values differ; first");
      ver.rounding_check[k] = std::move(vr);
    }
    if (c.timed(llvm_sr))
      ver.llvm_sr_check[k] = check_bitwise(
          llvm_sr, fused_sr, " (Highway), bit for bit",
          format("the fused step%s rounding stochastically (seed %llu)%s on LLVM code is not bitwise the one on "
                 "Highway's:",
                 in_state.c_str(), static_cast<unsigned long long>(kStochasticSeed), label.c_str()),
          "llvm", "highway");
  }
  // The verification step's norm and clip coefficient, for the report: the reference's, or
  // another mode's when the reference computed no norm (unfused without clipping), or, when no
  // variant with f32 state is timed, the first one built.
  if (!checked.empty()) {
    ver.ref_result = runs[idx(ref)].verify_result;
    for (Variant v : checked)
      if (std::isnan(ver.ref_result.grad_norm)) ver.ref_result = runs[idx(v)].verify_result;
  } else {
    for (Variant v : kAllVariants)
      if (is_fused(v) && runs[idx(v)].opt) {
        ver.ref_result = runs[idx(v)].verify_result;
        break;
      }
  }
  for (Variant v : kAllVariants)  // built for the check alone: free them before timing
    if (!c.timed(v)) runs[idx(v)].opt.reset(), runs[idx(v)].own.reset(), runs[idx(v)].buf = nullptr;
  return ver;
}

// ---- Phase 3: interleaved timing -----------------------------------------------------------

// The update pass alone, to split the fused step's time between its two passes: another
// fused optimizer (on the first timed backend) over the same buffers, without clipping,
// taking plain steps (no reduce pass). It has its own state; the weights it moves are the
// fused optimizer's, which changes nothing that is timed. Empty with --no-breakdown or
// when no fused step is timed.
std::optional<sf::Optimizer> make_update_only(const Args& a, const Case& c, const Runs& runs) {
  std::optional<sf::Optimizer> update_only;
  if (a.breakdown && c.timed(c.first_fused)) {
    sf::OptimizerOptions o = c.options_for(c.first_fused);
    o.max_grad_norm.reset();
    o.track_grad_norm = false;
    update_only.emplace(make_optimizer(c, c.primary_grouped(), c.split, *runs[idx(c.first_fused)].buf, o));
  }
  return update_only;
}

// Warm-up, then timed iterations of [the bandwidth probes, then each timed variant (and
// after the first fused one, `update_only` when given)], interleaved so that drift in the
// machine affects all of them alike. Each variant's samples go to its ModeRun. With
// `grouped` (--groups compare), each variant's two-group step runs right after its
// one-group step on even iterations and right before it on odd ones.
Timing time_interleaved(const Args& a, const Case& c, const FusedOnly& fo, Runs& runs, GroupedRuns* grouped,
                        sf::Optimizer* update_only, sb::BandwidthProbe& probe, Progress& progress) {
  const double S = c.loss_scale;
  const int threads = fo.threads;
  const std::vector<Variant>& variants = c.variants;
  Timing timing;
  timing.update_only = update_only != nullptr;
  const int iterations = a.warmup + a.steps;
  // A first guess at one iteration's length, in fused steps (good to a factor of two; the
  // measured time replaces it after the first iteration): the probes move ~1.6x a step's
  // bytes, each fused variant takes ~1x the fused step, the unfused ~5x, the interpreted ~2x.
  const double runs_per_variant = grouped ? 2.0 : 1.0;
  const auto fused_variants = std::count_if(variants.begin(), variants.end(), is_fused);
  double iteration_s =
      fo.step_s * (2.0 + (update_only ? 1.0 : 0.0) +
                   runs_per_variant * (static_cast<double>(fused_variants) + (c.timed(Variant::unfused) ? 5.0 : 0.0) +
                                       (c.timed(Variant::interpreted) ? 2.0 : 0.0)));
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
      if (timed_it) timing.bandwidth_s[p].push_back(s);
    }
    // The fused variants (the first ones, in kAllVariants order) run in reverse order every
    // other iteration, so that none always runs right after the same thing (the probes
    // leave the caches in a different state than a step does); a "-sr" variant and the
    // same step rounding to nearest stay back to back.
    std::vector<Variant> order = variants;
    if (it % 2 == 1) std::reverse(order.begin(), order.begin() + fused_variants);
    for (Variant v : order) {
      for (int k = 0; k < (grouped ? 2 : 1); ++k) {
        const bool two = grouped && (k == 0) == (it % 2 == 1);  // --groups compare: one group first on even iterations
        ModeRun& r = two ? grouped->runs[idx(v)] : runs[idx(v)];
        // The library's unfused mode unscales into an fp32 temporary and leaves the caller's
        // gradients alone; restoring them anyway (untimed) keeps every iteration's input the
        // same should a baseline ever write them in place, as eager PyTorch's unscale_ does.
        if (v == Variant::unfused) r.buf->copy_grads_from(*fo.buffers, threads);
        auto t0 = std::chrono::steady_clock::now();
        const sf::StepResult res = r.opt->step_scaled(S);
        const double t = seconds_since(t0);
        check_applied(res, two ? (std::string(variant_name(v)) + " (two groups)").c_str() : variant_name(v), it);
        if (timed_it) r.samples.push_back(t);
        if (v == c.first_fused && update_only && !two) {
          t0 = std::chrono::steady_clock::now();
          update_only->step();
          if (timed_it) timing.update_s.push_back(seconds_since(t0));
        }
      }
    }
  }
  progress.done();
  return timing;
}

// The phases in order; returns the exit code (errors are exceptions: main maps them).
int run(const Args& a) {
  Progress progress(!a.json_only);
  const auto t_start = std::chrono::steady_clock::now();

  const bool from_file = !a.shapes_path.empty();
  sb::Preset preset = load_preset(a, from_file);
  if (a.print_shapes) {  // with --groups, the dims of matrices (what --groups reads back)
    std::fputs(sb::format_shapes(preset.tensors, a.groups != "off").c_str(), stdout);
    return std::fflush(stdout) == 0 && !std::ferror(stdout) ? kExitOk : kExitError;
  }
  const Case c = resolve_case(a, std::move(preset), from_file);
  if (a.backend == "cuda") return run_cuda(a, c, t_start);
  const double llvm_first_ms = probe_configuration(c, progress);
  std::ofstream json_out = open_json(a);

  FusedOnly fo = fused_only_phase(a, c, progress);
  Runs runs;
  const Verification ver = verify_variants(c, fo, runs, progress, c.primary_grouped());
  std::optional<GroupedRuns> grouped;  // --groups compare: each variant again, with two groups
  if (c.groups == GroupsMode::compare) {
    grouped.emplace();
    grouped->ver = verify_variants(c, fo, grouped->runs, progress, true, &runs);
  }

  std::optional<sf::Optimizer> update_only = make_update_only(a, c, runs);
  progress.say("allocating the bandwidth probe (" + with_commas(c.n) + " floats x 4)");
  sb::BandwidthProbe probe(c.n, fo.threads);
  progress.done();
  GroupedRuns* g = grouped ? &*grouped : nullptr;
  const Timing timing = time_interleaved(a, c, fo, runs, g, update_only ? &*update_only : nullptr, probe, progress);

  report(a, c, fo, ver, runs, g, timing, probe, llvm_first_ms, t_start, json_out);
  return kExitOk;
}

}  // namespace

sf::DType parse_dtype(const std::string& opt, const std::string& s) {
  if (s == "f32") return sf::DType::f32;
  if (s == "f16") return sf::DType::f16;
  if (s == "bf16") return sf::DType::bf16;
  throw UsageError(opt + ": unknown dtype '" + s + "' (expected f32, f16 or bf16)");
}

void check_loss_scale_and_clip(const Args& a, sf::DType grads) {
  if (!(a.loss_scale > 0) || !std::isfinite(a.loss_scale))
    throw UsageError(format("--loss-scale: must be finite and > 0, got %g", a.loss_scale));
  if (!std::isfinite(sb::round_to(grads, static_cast<float>(a.loss_scale * 1e-3))))
    throw UsageError(format("--loss-scale: %g is too large for %s gradients (scaled gradients up to %g overflow)",
                            a.loss_scale, a.grads.c_str(), a.loss_scale * 1e-3));
  if (!(a.clip >= 0) || !std::isfinite(a.clip))
    throw UsageError(format("--clip: must be finite and >= 0 (0 = off), got %g", a.clip));
}

}  // namespace stepfuse::bench::tool

int main(int argc, char** argv) {
  sb::tool::Args a;
  CLI::App app{"stepfuse-bench: the fused optimizer step against the unfused baseline and the memory bandwidth "
               "measured in the same run.\nVerifies every timed mode against the unfused one (or the fused one) "
               "within fp32 rounding, the fused step on LLVM code against Highway's bit for bit, and a fused step "
               "rounding bf16 weights stochastically against the one rounding to nearest, and a fused step storing "
               "its state as bf16 or q8 against the unfused one storing it alike bit for bit, before timing; times "
               "interleaved steps; reports medians, spread, bytes moved, GB/s, % of bandwidth, the speed ratios, "
               "the cost of stochastic rounding, the gain of low-precision state and peak RSS.",
               "stepfuse-bench"};
  std::string presets = "\nPresets (--preset):\n";
  for (const auto& [name, desc] : sb::preset_catalog())
    presets += "  " + name + std::string(name.size() < 16 ? 16 - name.size() : 1, ' ') + desc + "\n";
  app.footer(presets +
             "\nShapes files (--shapes FILE), the format --print-shapes writes: one tensor per line,\n"
             "  [NAME] COUNT      e.g.  transformer.wte.weight 38597376   or   4096   or   mlp 10M\n"
             "  [NAME] D0xD1...   e.g.  transformer.wte.weight 50257x768  (the dims of a matrix)\n"
             "COUNT is an element count >= 0, optionally with a k/M/G suffix (powers of 1000): a 1-D\n"
             "tensor as far as --groups is concerned; dims (2 or more, joined by 'x') give a matrix or a\n"
             "convolution's weight. A tensor without a NAME is named t<index> (from 0). Names are unique,\n"
             "without whitespace. Blank lines and everything after a '#' are ignored. The list must hold\n"
             "at least one element. --print-shapes writes COUNTs; with --groups, the dims of matrices.\n"
             "\nParam groups (--groups on|compare), as transformer recipes make them: a decay group of the\n"
             "matrices (the optimizer's weight_decay) and a no-decay group of the 1-D tensors (biases and\n"
             "norms: weight_decay 0), the tensors in that order; one step has one global norm and clip over\n"
             "both. 'compare' times every mode with one group and with two, back to back in alternating\n"
             "order, and prints two groups / one group as the median of per-iteration time ratios.\n"
             "\nStochastic rounding (--rounding nearest,stochastic --weights bf16 --masters off): the fused step\n"
             "is timed once storing updated bf16 weights rounded to nearest even and once rounded\n"
             "stochastically (OptimizerOptions::stochastic_rounding, Philox random bits, seed " +
             std::to_string(sb::tool::kStochasticSeed) + ": rows fused-sr\n"
             "and, on LLVM code, fused-llvm-sr), each back to back with the step rounding to nearest. Both move\n"
             "the same bytes; 'stochastic / nearest' gives the ratio of their step times. Before timing, fused-sr\n"
             "is checked against fused: the grad norm, clip coefficient and optimizer state bitwise equal, every\n"
             "weight finite and either fused's or the bf16 value next to it (the count of those is reported);\n"
             "and fused-llvm-sr against fused-sr, bit for bit. The other modes round to nearest. Not with\n"
             "--backend cuda or --ranks (stepfuse-bench does not time it there yet).\n"
             "\nOptimizer state formats (--state f32,bf16,q8): the fused step is timed once per format of its state\n"
             "(OptimizerOptions::state_format, every state stream; min_q8_numel left at the library's 4096): f32\n"
             "(no suffix), bf16 (rows -bf16s: 2 bytes per element, rounded to nearest even) and q8 (rows -q8: a\n"
             "byte per element and an fp32 absmax per block of 256, bitsandbytes-style blockwise dynamic\n"
             "quantization; tensors under 4096 elements keep f32). Each combines with --cpu-backend and --rounding:\n"
             "fused-q8, fused-llvm-q8, fused-sr-q8, fused-llvm-sr-bf16s, ... Each row's bytes, GB/s and %\n"
             "adam_like count its own state as stored (the q8 absmaxes included; a B/param column appears), and\n"
             "'state / f32 state' gives each row's step time over that of the same step with f32 state. Before\n"
             "timing, fused-bf16s (fused-q8) is checked bit for bit against the unfused step storing its state\n"
             "alike (weights, masters and the stored bits: bf16 values, q8 codes and absmaxes), and its LLVM and\n"
             "stochastic twins against it as the f32 ones are against fused (the -sr rows' bf16 state may also be\n"
             "the bf16 value next to it: it rounds stochastically, unless --state-rounding nearest). The other\n"
             "modes store f32 state. A\n"
             "format the optimizer cannot take is an error (ASGD keeps its state, 'ax', in full precision).\n"
             "--backend cuda and --ranks take one format per run.\n"
             "\nCompensated bf16 weights (--masters compensated --weights bf16): no fp32 masters; beside each\n"
             "bf16 weight, a bf16 compensation (OptimizerOptions::compensated_weights): the parameter is\n"
             "weight + compensation, and each step stores the nearest bf16 weight and the nearest bf16 to\n"
             "the rest. 2 bytes per parameter instead of the masters' 4; the step reads and writes both\n"
             "(counted in its bytes), and every mode is verified on weight + compensation as on masters\n"
             "(fused-llvm bitwise, compensations too). Not with --rounding stochastic or --ranks.\n"
             "\nThe sharded step (--ranks N): stepfuse-bench starts itself under mpiexec -n N (or runs on\n"
             "every rank when started under mpiexec -n N). Each rank takes one of N contiguous, balanced parts\n"
             "of the tensor list, cut at 16,384-element chunk boundaries (--shard slices: a tensor may be\n"
             "split) or at tensor boundaries only (--shard whole), and times, interleaved, the sharded step\n"
             "(OptimizerOptions::communicator: MPI) against the local step over the same shard, a bare\n"
             "all_gather of the step's own size and a bare 128-byte all_reduce; it reports every rank's\n"
             "medians and the slowest rank's, the overhead, and the bytes the step's one collective sends.\n"
             "Also used: --preset/--shapes, --optimizer, --weights, --grads, --masters (on or off), --clip,\n"
             "--norm-type, --loss-scale, --threads (0: the cores divided among the ranks of a node), --steps,\n"
             "--warmup, --fusion, --cpu-backend and --state (one each), --json, --json-only. Needs a build with\n"
             "MPI.\n"
             "\nExit codes: 0 ok, 1 bad arguments (a bad shapes file, a configuration or backend the library "
             "rejects, --cpu-backend llvm without LLVM, --ranks in a build without MPI), 2 verification failed (a "
             "mode disagrees with the reference, the LLVM fused step is not bitwise Highway's, the stochastically "
             "rounded step is not the round-to-nearest one but for the rounding, a fused step storing bf16 or q8 "
             "state is not bitwise the unfused one, or a step was skipped), 3 other errors.");
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
      ->default_str(sb::tool::have_llvm() ? "highway,llvm" : "highway");
  app.add_option("--backend", a.backend,
                 "where the step runs: cpu, or cuda (GPU 0: device buffers, the fused step timed with CUDA events "
                 "against a device-to-device copy, verified against the CPU first)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--optimizer", a.optimizer, "optimizer, with PyTorch's default hyperparameters (lamb: Apex's)")
      ->check(CLI::IsMember({"adamw", "adam", "sgd", "adagrad", "rmsprop", "lion", "nadam", "radam", "adamax",
                             "adadelta", "rprop", "asgd", "lamb"}))
      ->capture_default_str();
  app.add_option("--weights", a.weights,
                 "weight dtype (f16/bf16 keep fp32 masters unless --masters off; bf16 also --masters compensated)")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}))
      ->capture_default_str();
  app.add_option("--grads", a.grads, "gradient dtype")->check(CLI::IsMember({"f32", "f16", "bf16"}))->capture_default_str();
  std::string masters = "on";  // --masters, into a.no_masters and a.compensated after parsing
  CLI::Option* masters_opt =
      app.add_option("--masters", masters,
                     "fp32 master copies of f16/bf16 weights (f32 weights have none): on, off, or compensated "
                     "(bf16 weights: a bf16 compensation beside each weight instead, 2 bytes per parameter rather "
                     "than 4; see below)")
          ->check(CLI::IsMember({"on", "off", "compensated"}))
          ->capture_default_str();
  CLI::Option* no_masters_opt =
      app.add_flag("--no-masters", a.no_masters, "the same as --masters off (older command lines; not with --masters)");
  masters_opt->excludes(no_masters_opt);
  app.add_option("--rounding", a.rounding,
                 "how the fused step stores updated weights, each timed as its own fused row, comma-separated: "
                 "nearest (to nearest even), stochastic (bf16 weights without masters rounded with Philox random "
                 "bits, seed " +
                     std::to_string(sb::tool::kStochasticSeed) +
                     ": rows fused-sr, fused-llvm-sr; needs --weights bf16 --masters off; the other modes round to "
                     "nearest)")
      ->delimiter(',')
      ->check(CLI::IsMember({"nearest", "stochastic"}))
      ->type_name("LIST")
      ->default_str("nearest");
  app.add_option("--state-rounding", a.state_rounding,
                 "how the -sr rows store bf16 state (--state bf16): stochastic (bits of its own per stream, the "
                 "library's default) or nearest (to nearest even: OptimizerOptions::stochastic_state_rounding off)")
      ->check(CLI::IsMember({"stochastic", "nearest"}))
      ->capture_default_str();
  app.add_option("--state", a.state,
                 "how the fused step stores the optimizer state, each timed as its own fused row, comma-separated: "
                 "f32, bf16 (rows -bf16s), q8 (8-bit blockwise quantization, tensors of at least 4096 elements: "
                 "rows -q8); each row counts its own bytes (see below; with --backend cuda one format per run)")
      ->delimiter(',')
      ->check(CLI::IsMember({"f32", "bf16", "q8"}))
      ->type_name("LIST")
      ->default_str("f32");
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
  app.add_option("--groups", a.groups,
                 "param groups: off (one group), on (two: matrices with weight decay, 1-D tensors without, for "
                 "every timed mode) or compare (one group and two, timed alternately; prints the ratio)")
      ->check(CLI::IsMember({"off", "on", "compare"}))
      ->type_name("MODE")
      ->capture_default_str();
  app.add_option("--ranks", a.ranks,
                 std::string("the sharded step across N MPI processes (starts mpiexec -n N itself; see below)") +
                     (sb::tool::ranks_supported() ? "" : " [this build has no MPI]"))
      ->check(CLI::Range(1, 1 << 20))
      ->type_name("N");
  app.add_option("--shard", a.shard,
                 "--ranks: how the model is cut among the ranks: slices (at 16,384-element chunk boundaries, "
                 "tensors may be split) or whole (whole tensors only)")
      ->check(CLI::IsMember({"slices", "whole"}))
      ->type_name("MODE")
      ->capture_default_str();
  app.add_option("--json", a.json_path, "also write every figure to FILE as JSON")->type_name("FILE");
  app.add_flag("--json-only", a.json_only,
               "print the JSON report to stdout instead of the table (no progress line on stderr)");
  try {
    app.parse(argc, argv);
    a.fusion_given = app.get_option("--fusion")->count() > 0;
    a.cpu_backend_given = app.get_option("--cpu-backend")->count() > 0;
    a.state_given = app.get_option("--state")->count() > 0;
    if (masters_opt->count() > 0) a.no_masters = masters != "on", a.compensated = masters == "compensated";
    a.shard_given = app.get_option("--shard")->count() > 0;
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help/version (rc 0) or the error
    return rc == 0 ? sb::kExitOk : sb::kExitUsage;
  }
  try {
    if (a.ranks > 0 && a.compensated)
      throw sb::UsageError("--masters compensated: --ranks does not time the sharded step with compensated weights "
                           "yet (pass --masters on or off, or leave --ranks out to time it on one process)");
    if (a.ranks > 0) return sb::tool::run_ranks(a, argc, argv);
    if (a.shard_given) throw sb::UsageError("--shard: says how --ranks cuts the model; pass --ranks N");
    return sb::tool::run(a);
  } catch (const sb::UsageError& e) {
    std::fprintf(stderr, "stepfuse-bench: %s\n", e.what());
    return sb::kExitUsage;
  } catch (const sb::VerifyError& e) {
    std::fprintf(stderr, "stepfuse-bench: VERIFICATION FAILED: %s\n", e.what());
    return sb::kExitVerify;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stepfuse-bench: error: %s\n", e.what());
    return sb::kExitError;
  }
}
