// stepfuse-bench's CPU path: the command line, the variants it times, and what each phase hands the next.
// stepfuse_bench.cpp runs the phases; stepfuse_bench_report.cpp turns their results into the table and the JSON.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bandwidth.hpp"
#include "model_buffers.hpp"
#include "presets.hpp"
#include "stats.hpp"
#include "stepfuse/stepfuse.hpp"
#include "verify.hpp"

namespace stepfuse::bench::tool {

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
  bool no_masters = false;  // --masters off or compensated, or --no-masters (a synonym of --masters off)
  bool compensated = false;  // --masters compensated: bf16 compensations instead of fp32 masters
  std::vector<std::string> rounding = {"nearest"};  // --rounding: nearest, stochastic
  std::string state_rounding = "stochastic";         // --state-rounding: the -sr rows' bf16 state
  std::vector<std::string> state = {"f32"};  // --state: f32, bf16, q8 (how the fused rows store the optimizer state)
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
  std::string groups = "off";      // --groups: off, on or compare (GroupsMode)
  bool fusion_given = false;       // --fusion was on the command line
  bool cpu_backend_given = false;  // --cpu-backend was on the command line
  bool state_given = false;        // --state was on the command line
  int ranks = 0;                   // --ranks N: the sharded step across N MPI processes (bench/ranks.hpp); 0: off
  std::string shard = "slices";    // --shard: how --ranks cuts the model (slices or whole)
  bool shard_given = false;        // --shard was on the command line
};

// The modes --fusion can time, in the order they are verified, timed and reported.
// Indexed by Fusion's value.
inline constexpr std::array<Fusion, 3> kAllModes = {Fusion::fused, Fusion::unfused, Fusion::interpreted};
inline const char* mode_name(Fusion f) {
  return f == Fusion::fused ? "fused" : f == Fusion::unfused ? "unfused" : "interpreted";
}

// What is timed: a mode of --fusion and, for fused, the CPU code that runs it (--cpu-backend),
// how it stores bf16 weights (--rounding; "-sr": rounded stochastically) and how it stores the
// optimizer state (--state; "-bf16s": bf16 state, "-q8": 8-bit blockwise-quantized state, no
// suffix: f32). In the order they are verified, timed and reported: for each CPU backend, each
// rounding, each state format; indexed by idx(). Each fused variant that rounds to nearest is
// followed by the same step storing its state as bf16, then as q8, then rounding
// stochastically (the same three), so that a step and its twins run close together. The
// unfused and interpreted modes are timed with f32 state only; unfused-bf16s and unfused-q8
// exist for phase 2, as the reference of the fused steps storing their state so.
// Every variant runs its CPU backend explicitly, so that STEPFUSE_CPU_BACKEND changes nothing.
enum class Kind : std::uint8_t { fused, fused_sr, fused_llvm, fused_llvm_sr, unfused, interpreted };
inline constexpr std::array<StateFormat, 3> kAllStates = {StateFormat::f32, StateFormat::bf16, StateFormat::q8};
struct Variant {
  Kind kind = Kind::fused;
  StateFormat state = StateFormat::f32;
  // The variants with f32 state, by their names before --state: Variant::fused, ...
  static const Variant fused, fused_sr, fused_llvm, fused_llvm_sr, unfused, interpreted;
  constexpr bool operator==(const Variant&) const = default;
  // The same step, storing its state as `f`.
  constexpr Variant with_state(StateFormat f) const { return {kind, f}; }
};
inline constexpr Variant Variant::fused{Kind::fused, StateFormat::f32};
inline constexpr Variant Variant::fused_sr{Kind::fused_sr, StateFormat::f32};
inline constexpr Variant Variant::fused_llvm{Kind::fused_llvm, StateFormat::f32};
inline constexpr Variant Variant::fused_llvm_sr{Kind::fused_llvm_sr, StateFormat::f32};
inline constexpr Variant Variant::unfused{Kind::unfused, StateFormat::f32};
inline constexpr Variant Variant::interpreted{Kind::interpreted, StateFormat::f32};
constexpr std::size_t idx(Variant v) {
  return static_cast<std::size_t>(v.kind) * kAllStates.size() + static_cast<std::size_t>(v.state);
}
inline constexpr std::array<Variant, 6 * kAllStates.size()> kAllVariants = [] {
  std::array<Variant, 6 * kAllStates.size()> all{};
  for (std::size_t k = 0; k < 6; ++k)
    for (StateFormat f : kAllStates) {
      const Variant v{static_cast<Kind>(k), f};
      all[idx(v)] = v;
    }
  return all;
}();
// The state suffix of a row name: "" (f32), "-bf16s", "-q8".
inline const char* state_suffix(StateFormat f) {
  return f == StateFormat::f32 ? "" : f == StateFormat::bf16 ? "-bf16s" : "-q8";
}
inline const char* kind_name(Kind k) {
  switch (k) {
    case Kind::fused: return "fused";
    case Kind::fused_sr: return "fused-sr";
    case Kind::fused_llvm: return "fused-llvm";
    case Kind::fused_llvm_sr: return "fused-llvm-sr";
    case Kind::unfused: return "unfused";
    case Kind::interpreted: return "interpreted";
  }
  return "?";
}
// The name in the table, the progress line and messages: "fused", "fused-llvm-sr-q8", ...
inline const char* variant_name(Variant v) {
  static const std::array<std::string, kAllVariants.size()> names = [] {
    std::array<std::string, kAllVariants.size()> n;
    for (Variant x : kAllVariants) n[idx(x)] = std::string(kind_name(x.kind)) + state_suffix(x.state);
    return n;
  }();
  return names[idx(v)].c_str();
}
// The name in JSON keys ("fused_llvm", "fused_llvm_over_fused_speed", "fused_sr_over_fused_time",
// "fused_q8_over_fused_time").
inline std::string variant_key(Variant v) {
  std::string k = variant_name(v);
  for (char& ch : k)
    if (ch == '-') ch = '_';
  return k;
}
inline Fusion fusion_of(Variant v) {
  return v.kind == Kind::unfused ? Fusion::unfused : v.kind == Kind::interpreted ? Fusion::interpreted : Fusion::fused;
}
inline bool is_fused(Variant v) { return fusion_of(v) == Fusion::fused; }
inline CpuBackend cpu_backend_of(Variant v) {
  return v.kind == Kind::fused_llvm || v.kind == Kind::fused_llvm_sr ? CpuBackend::llvm : CpuBackend::highway;
}
// --rounding: how the step stores updated bf16 weights kept without fp32 masters. The fused
// "-sr" variants round stochastically (OptimizerOptions::stochastic_rounding, seed
// kStochasticSeed); every other variant rounds to nearest even.
enum class Rounding : std::uint8_t { nearest, stochastic };
inline constexpr std::uint64_t kStochasticSeed = 1;
inline const char* rounding_name(Rounding r) { return r == Rounding::nearest ? "nearest" : "stochastic"; }
inline Rounding rounding_of(Variant v) {
  return v.kind == Kind::fused_sr || v.kind == Kind::fused_llvm_sr ? Rounding::stochastic : Rounding::nearest;
}
// --state: how the step stores the optimizer state (OptimizerOptions::state_format, with the
// library's min_q8_numel: q8 only for tensors of at least 4096 elements).
inline StateFormat state_of(Variant v) { return v.state; }
inline std::size_t state_idx(StateFormat f) { return static_cast<std::size_t>(f); }
inline bool have_llvm() { return llvm_version()[0] != '\0'; }

// --groups: one param group; two (a decay group of matrices and a no-decay group of 1-D
// tensors, bench/param_groups.hpp) for every timed variant; or both, timed alternately.
enum class GroupsMode : std::uint8_t { off, on, compare };
inline const char* groups_mode_name(GroupsMode g) {
  return g == GroupsMode::off ? "off" : g == GroupsMode::on ? "on" : "compare";
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Phase 0: the command line resolved into what is run. Every check the arguments allow
// without building anything has passed.
struct Case {
  Preset preset;
  bool from_file = false;  // preset.name is then the shapes file's path
  std::vector<Fusion> modes;               // --fusion, in kAllModes order
  std::vector<CpuBackend> cpu_backends;    // --cpu-backend, highway first
  std::vector<Rounding> roundings;         // --rounding, nearest first
  std::vector<StateFormat> states;         // --state, in kAllStates order (f32 first)
  std::vector<Variant> variants;           // what is timed, in kAllVariants order
  OptimizerConfig config;
  DType weights = DType::f32, grads = DType::f32;
  OptimizerOptions options;                // shared by every variant; options_for() adds its own
  double loss_scale = 0;
  std::int64_t n = 0;                      // parameters
  // The fused variant phase 1 steps and the update pass alone is timed with: the first timed
  // (fused when none is).
  Variant first_fused = Variant::fused;
  // --groups: with anything but off, preset.tensors is in group order (bench/param_groups.hpp):
  // the decay group is tensors [0, split) with `config`, the no-decay group the rest with
  // no_decay_config; split_params counts the decay group's parameters.
  GroupsMode groups = GroupsMode::off;
  std::size_t split = 0;
  std::int64_t split_params = 0;
  OptimizerConfig no_decay_config;
  // Whether the optimizers of `runs` (and phase 1's, and the update pass alone's) have two groups.
  bool primary_grouped() const { return groups == GroupsMode::on; }

  bool timed_mode(Fusion f) const;
  bool timed(Variant v) const;
  // Whether any timed variant stores its state as `f`.
  bool timed_state(StateFormat f) const;
  OptimizerOptions options_for(Variant v) const;
};

// Phase 1: the fused step alone, on the buffers the fused variant is later timed on.
struct FusedOnly {
  std::unique_ptr<ModelBuffers> buffers;
  int threads = 0;  // the fused optimizer's num_threads(): every later phase uses as many
  int state_streams = 0;
  double state_bytes = 0, master_bytes = 0;
  double compensation_bytes = 0;  // --masters compensated: the bf16 compensations
  std::int64_t rss_start = 0, peak_start = 0;  // before the buffers were allocated
  std::int64_t rss_peak = 0, rss_after = 0;    // after the steps
  double step_s = 0;  // mean fused step time: the first guess at the timed phase's length
  double model_bytes = 0;  // weights + grads + state + masters (or compensations)
};

// One variant's optimizer, over its own buffers (fused: the phase-1 buffers), and its samples.
struct ModeRun {
  std::unique_ptr<ModelBuffers> own;  // null for fused, which steps the phase-1 buffers
  ModelBuffers* buf = nullptr;
  std::optional<Optimizer> opt;
  StepResult verify_result;
  double construct_ms = 0;      // the optimizer's construction (allocates and fills its state and masters)
  std::vector<double> samples;  // seconds per timed step
  Summary summary;
  double gbs = 0;
};
using Runs = std::array<ModeRun, kAllVariants.size()>;

// Phase 2: every timed variant checked before anything is timed.
struct Verified {
  Variant mode;
  VerifyReport report;
};
// The bitwise checks of phase 2, per state format (indexed by state_idx()).
using PerState = std::array<std::optional<VerifyReport>, kAllStates.size()>;
struct Verification {
  Variant ref = Variant::unfused;           // the reference the others are compared with (f32 state)
  std::vector<Verified> verified;           // each variant checked against ref, in kAllVariants order
  PerState llvm_check;                      // fused-llvm[-bf16s|-q8] against fused[...], bit for bit
  // When a "-sr" variant is timed: fused-sr against fused, the same step but for the rounding
  // of the weights (compare_rounding), and fused-llvm-sr against fused-sr, bit for bit (each
  // with its state format).
  PerState rounding_check;
  PerState llvm_sr_check;
  // --state bf16 or q8: fused-bf16s (fused-q8) against unfused-bf16s (unfused-q8), bit for bit:
  // the weights and the state as stored (bf16 bits; q8 codes and absmaxes). [0] is empty: f32
  // state is checked against `ref` within fp32 rounding, as before.
  PerState unfused_check;
  StepResult ref_result;                    // the verification step's norm and clip coefficient
};

// --groups compare: every timed variant again with two param groups, over the same buffers
// as its one-group run (its own state), verified on its own, and its samples.
struct GroupedRuns {
  Runs runs;
  Verification ver;
};

// Phase 3: the samples besides each variant's own (ModeRun::samples).
struct Timing {
  std::map<Pattern, std::vector<double>> bandwidth_s;  // seconds per probe run
  std::vector<double> update_s;                        // the fused update pass alone
  bool update_only = false;                            // whether it was timed
};

// The report: the table on stdout (unless --json-only) and the JSON (--json, --json-only).
// Fills each timed variant's summary and GB/s in `runs` (and in grouped->runs, which is
// null unless --groups compare); throws std::runtime_error when writing json_out fails.
void report(const Args& a, const Case& c, const FusedOnly& fo, const Verification& ver, Runs& runs,
            GroupedRuns* grouped, const Timing& timing, const BandwidthProbe& probe, double llvm_first_ms,
            std::chrono::steady_clock::time_point t_start, std::ofstream& json_out);

// --weights / --grads: "f32", "f16" or "bf16", else UsageError naming `opt`.
DType parse_dtype(const std::string& opt, const std::string& s);
// --loss-scale and --clip, checked (UsageError) against the gradients' dtype: the
// gradients are filled with magnitudes up to 1e-3 * S (model_buffers.hpp).
void check_loss_scale_and_clip(const Args& a, DType grads);

}  // namespace stepfuse::bench::tool
