// stepfuse-bench's report: the figures derived from the samples, the table on stdout and the JSON (--json, --json-only).

#include <algorithm>
#include <array>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bandwidth.hpp"
#include "cli_support.hpp"
#include "param_groups.hpp"
#include "stats.hpp"
#include "step_bytes.hpp"
#include "stepfuse/stepfuse.hpp"
#include "stepfuse_bench.hpp"

namespace sf = stepfuse;
namespace sb = stepfuse::bench;
using json = nlohmann::ordered_json;

namespace stepfuse::bench::tool {
namespace {

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

// A pair of timed variants' speeds.
struct Ratio {
  RatioPair pair;
  double median_ratio;        // median time of b / median time of a
  sb::Summary per_iteration;  // the same from each iteration's own pair of samples
};
std::string ratio_name(const RatioPair& p) { return std::string(variant_name(p.a)) + "/" + variant_name(p.b); }
std::string ratio_key(const RatioPair& p) { return variant_key(p.a) + "_over_" + variant_key(p.b) + "_speed"; }

// The cost of stochastic rounding: each "-sr" variant (b) against the same step rounding to
// nearest (a), with the same state format, as a time ratio: median time of b / median time of
// a, the Ratio of the pair.
std::vector<RatioPair> rounding_pairs() {
  std::vector<RatioPair> pairs;
  for (sf::StateFormat f : kAllStates) {
    pairs.push_back({Variant{Kind::fused, f}, Variant{Kind::fused_sr, f}});
    pairs.push_back({Variant{Kind::fused_llvm, f}, Variant{Kind::fused_llvm_sr, f}});
  }
  return pairs;
}
// The gain of low-precision state: each fused variant storing bf16 or q8 state (b) against the
// same step storing f32 state (a), as a time ratio likewise.
std::vector<RatioPair> state_pairs(const Case& c) {
  std::vector<RatioPair> pairs;
  for (Variant v : c.variants)
    if (v.state != sf::StateFormat::f32) pairs.push_back({v.with_state(sf::StateFormat::f32), v});
  return pairs;
}
// "fused-sr / fused", "fused-q8 / fused"; "fused_sr_over_fused_time", "fused_q8_over_fused_time".
std::string rounding_ratio_name(const RatioPair& p) {
  return std::string(variant_name(p.b)) + " / " + variant_name(p.a);
}
std::string rounding_ratio_key(const RatioPair& p) { return variant_key(p.b) + "_over_" + variant_key(p.a) + "_time"; }

// The first timed LLVM variant, whose construction the report gives (none: nullopt).
std::optional<Variant> first_llvm(const Case& c) {
  for (Variant v : c.variants)
    if (cpu_backend_of(v) == sf::CpuBackend::llvm) return v;
  return std::nullopt;
}
// The same step on Highway's code.
Variant highway_of(Variant v) {
  return v.kind == Kind::fused_llvm      ? Variant{Kind::fused, v.state}
         : v.kind == Kind::fused_llvm_sr ? Variant{Kind::fused_sr, v.state}
                                         : v;
}

std::string norm_name(const Args& a) { return a.norm_type == "inf" ? "inf" : "2"; }
// Whether the optimizer keeps fp32 master weights (16-bit weights without --masters off).
bool has_masters(const Args& a, const Case& c) { return !a.no_masters && c.weights != sf::DType::f32; }
// Whether --state names a format other than f32 (rows -bf16s, -q8).
bool low_precision_state(const Case& c) { return c.states != std::vector<sf::StateFormat>{sf::StateFormat::f32}; }
// Whether it keeps a bf16 compensation beside each bf16 weight instead (--masters compensated).
bool has_compensations(const Args& a, const Case& c) { return a.compensated && c.weights == sf::DType::bf16; }

// What the table and the JSON share, derived from the samples.
struct Figures {
  sb::StepBytes bytes;  // what the fused step must move (with f32 state)
  double step_bytes = 0;  // per step
  std::map<sb::Pattern, double> bw_gbs;  // median GB/s per pattern
  std::map<sb::Pattern, sb::Summary> bw_sum;
  double ref_gbs = 0;  // adam_like's median GB/s: the 100% of the table's last column
  std::vector<Ratio> ratios;  // the pairs of kRatioPairs both timed
  std::vector<Ratio> rounding_ratios;  // the pairs of rounding_pairs() both timed
  std::array<sb::Summary, kAllVariants.size()> paired_frac;  // each variant's share of adam_like, per iteration
  sb::StepBytes plain_bytes;  // what the update pass alone must move (with the first fused variant's state)
  sb::Summary uo;  // the update pass alone
  double update_gbs = 0, reduce_s = 0, reduce_gbs = 0;
  // --groups compare, per timed variant: median two-group time / median one-group time, and
  // the same from each iteration's own pair of samples (taken back to back).
  std::array<double, kAllVariants.size()> groups_median_ratio{};
  std::array<sb::Summary, kAllVariants.size()> groups_per_iteration{};
  // Per state format (state_idx), for the timed ones: what a step storing its state so must
  // move (state_bytes[0] = bytes, for f32), per step, and the share of the parameters whose
  // state is stored so (q8: the tensors of at least min_q8_numel elements).
  std::array<sb::StepBytes, kAllStates.size()> state_bytes{};
  std::array<double, kAllStates.size()> state_step_bytes{};
  std::array<double, kAllStates.size()> stored_fraction{};
  std::vector<Ratio> state_ratios{};  // the pairs of state_pairs() both timed
  const sb::StepBytes& bytes_of(Variant v) const { return state_bytes[state_idx(v.state)]; }
  double step_bytes_of(Variant v) const { return state_step_bytes[state_idx(v.state)]; }
};

// The figures, and each timed variant's summary and GB/s in `runs` (and grouped->runs).
Figures compute_figures(const Args& a, const Case& c, const FusedOnly& /*fo*/, Runs& runs, GroupedRuns* grouped,
                        const Timing& timing, const sb::BandwidthProbe& probe) {
  const sf::DType wt = c.weights, gt = c.grads;
  const std::int64_t n = c.n;
  const std::vector<Variant>& variants = c.variants;
  auto timed = [&](Variant v) { return c.timed(v); };
  const auto& bw_s = timing.bandwidth_s;
  const std::vector<double>& update_s = timing.update_s;
  const bool update_only = timing.update_only;
  const Variant first_fused = c.first_fused;
  // What every variant must move: a step rounding stochastically reads and writes what the one
  // rounding to nearest does (both without masters), only its arithmetic differs; compensated
  // weights add their compensations' 2 bytes each way.
  const sb::StepBytes bytes =
      sb::step_bytes(sf::UpdateProgram::from_config(c.config).program(), wt, gt, !a.no_masters,
                     /*reduce_pass=*/true,  // step_scaled always reduces; a two-phase program's two passes
                     a.compensated);
  const double step_bytes = bytes.per_param() * static_cast<double>(n);
  // Each timed state format's bytes: its streams as one of its optimizers stores them (q8: codes
  // and absmaxes; tensors under min_q8_numel in f32), read and written as the program does.
  std::array<sb::StepBytes, kAllStates.size()> state_bytes{};
  std::array<sb::StateWidths, kAllStates.size()> widths{};
  std::array<double, kAllStates.size()> stored_fraction{};
  state_bytes[0] = bytes;
  stored_fraction[0] = 1.0;
  for (sf::StateFormat fmt : kAllStates) {
    if (fmt == sf::StateFormat::f32 || !c.timed_state(fmt)) continue;
    const auto v = std::find_if(variants.begin(), variants.end(), [&](Variant x) { return x.state == fmt; });
    const sf::Optimizer& opt = *runs[idx(*v)].opt;
    const std::size_t k = state_idx(fmt);
    widths[k] = sb::stored_state_widths(opt, n);
    state_bytes[k] = sb::step_bytes(sf::UpdateProgram::from_config(c.config).program(), wt, gt, !a.no_masters,
                                    /*reduce_pass=*/true, a.compensated, widths[k]);
    std::int64_t stored = 0;  // parameters with some stream stored in `fmt`
    for (std::size_t p = 0; p < opt.num_params(); ++p)
      for (std::string_view name : opt.state_names())
        if (opt.state_format(p, name) == fmt) {
          stored += opt.params()[p].weight.numel;
          break;
        }
    stored_fraction[k] = n > 0 ? static_cast<double>(stored) / static_cast<double>(n) : 0.0;
  }
  auto step_bytes_of = [&](Variant v) { return state_bytes[state_idx(v.state)].per_param() * static_cast<double>(n); };
  std::map<sb::Pattern, double> bw_gbs;  // median GB/s per pattern
  std::map<sb::Pattern, sb::Summary> bw_sum;
  for (sb::Pattern p : sb::kAllPatterns) {
    bw_sum[p] = sb::summarize(bw_s.at(p));
    bw_gbs[p] = probe.bytes(p) / bw_sum[p].median * 1e-9;
  }
  const double ref_gbs = bw_gbs[sb::Pattern::adam_like];
  for (Variant v : variants) {
    ModeRun& r = runs[idx(v)];
    r.summary = sb::summarize(r.samples);
    r.gbs = step_bytes_of(v) / r.summary.median * 1e-9;
  }
  auto ratio = [&](const RatioPair& p) {
    const ModeRun &ra = runs[idx(p.a)], &rb = runs[idx(p.b)];
    std::vector<double> paired;
    for (std::size_t i = 0; i < ra.samples.size(); ++i) paired.push_back(rb.samples[i] / ra.samples[i]);
    return Ratio{p, rb.summary.median / ra.summary.median, sb::summarize(paired)};
  };
  std::vector<Ratio> ratios, rounding_ratios, state_ratios;
  for (const RatioPair& p : kRatioPairs)
    if (timed(p.a) && timed(p.b)) ratios.push_back(ratio(p));
  for (const RatioPair& p : rounding_pairs())
    if (timed(p.a) && timed(p.b)) rounding_ratios.push_back(ratio(p));
  for (const RatioPair& p : state_pairs(c))
    if (timed(p.a) && timed(p.b)) state_ratios.push_back(ratio(p));
  // Each mode's share of the bandwidth from each iteration's own samples (probe and step
  // taken back to back), whose median is less sensitive to drift between iterations.
  std::array<sb::Summary, kAllVariants.size()> paired_frac;
  for (Variant v : variants) {
    std::vector<double> frac;
    const auto& samples = runs[idx(v)].samples;
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const double ref_i = probe.bytes(sb::Pattern::adam_like) / bw_s.at(sb::Pattern::adam_like)[i];
      frac.push_back(step_bytes_of(v) / samples[i] / ref_i);
    }
    paired_frac[idx(v)] = sb::summarize(frac);
  }
  // Update pass alone (plain step: no reduce pass), and the reduce pass by difference.
  const sb::StepBytes plain_bytes =
      sb::step_bytes(sf::UpdateProgram::from_config(c.config).program(), wt, gt, !a.no_masters, /*reduce_pass=*/false,
                     a.compensated, widths[state_idx(first_fused.state)]);
  const sb::Summary uo = sb::summarize(update_s);
  const double update_gbs = update_only ? plain_bytes.per_param() * static_cast<double>(n) / uo.median * 1e-9 : 0.0;
  const double reduce_s = update_only ? runs[idx(first_fused)].summary.median - uo.median : 0.0;
  const double reduce_gbs = update_only && reduce_s > 0 ? bytes.reduce * static_cast<double>(n) / reduce_s * 1e-9 : 0.0;
  Figures f{bytes,       step_bytes,  std::move(bw_gbs), std::move(bw_sum), ref_gbs,  std::move(ratios),
            std::move(rounding_ratios),   paired_frac, plain_bytes,       uo,                update_gbs, reduce_s,
            reduce_gbs};
  f.state_bytes = state_bytes;
  for (std::size_t k = 0; k < kAllStates.size(); ++k)
    f.state_step_bytes[k] = state_bytes[k].per_param() * static_cast<double>(n);
  f.stored_fraction = stored_fraction;
  f.state_ratios = std::move(state_ratios);
  if (grouped) {
    for (Variant v : variants) {
      ModeRun &one = runs[idx(v)], &two = grouped->runs[idx(v)];
      two.summary = sb::summarize(two.samples);
      two.gbs = step_bytes_of(v) / two.summary.median * 1e-9;
      std::vector<double> paired;
      for (std::size_t i = 0; i < one.samples.size(); ++i) paired.push_back(two.samples[i] / one.samples[i]);
      f.groups_median_ratio[idx(v)] = two.summary.median / one.summary.median;
      f.groups_per_iteration[idx(v)] = sb::summarize(paired);
    }
  }
  return f;
}

// The two groups as the report describes them (--groups on or compare): decay, then no decay.
struct GroupLine {
  std::size_t tensors;
  std::int64_t params;
  double weight_decay;
};
std::array<GroupLine, 2> group_lines(const Case& c) {
  return {GroupLine{c.split, c.split_params, sb::weight_decay_of(c.config)},
          GroupLine{c.preset.tensors.size() - c.split, c.n - c.split_params, sb::weight_decay_of(c.no_decay_config)}};
}
// The row name of a variant's two-group run (--groups compare).
std::string two_groups_name(Variant v) { return std::string(variant_name(v)) + "-2g"; }

// The table, printed unless --json-only.
std::string format_table(const Args& a, const Case& c, const FusedOnly& fo, const Verification& ver, const Runs& runs,
                         const GroupedRuns* grouped, const Timing& timing, const Figures& f,
                         const sb::BandwidthProbe& probe, double llvm_first_ms,
                         std::chrono::steady_clock::time_point t_start) {
  const double S = c.loss_scale;
  const std::int64_t n = c.n;
  const int threads = fo.threads;
  const std::string norm = norm_name(a);
  const bool masters = has_masters(a, c);
  std::string mode_list;
  for (Variant v : c.variants) mode_list += (mode_list.empty() ? "" : ", ") + std::string(variant_name(v));
  const std::string llvm_desc = have_llvm() ? format(" · LLVM %s (%s)", sf::llvm_version(), sf::llvm_cpu()) : "";

  std::string out;  // the table, printed at the end unless --json-only
  out += format("stepfuse-bench %s · backend %s · CPU target %s%s · %d thread%s\n", sf::version(), a.backend.c_str(),
                sf::cpu_target(), llvm_desc.c_str(), threads, threads == 1 ? "" : "s");
  out += format("%s %s: %zu tensor%s, %s parameters\n", c.from_file ? "shapes file" : "preset", c.preset.name.c_str(),
                c.preset.tensors.size(), c.preset.tensors.size() == 1 ? "" : "s", with_commas(n).c_str());
  const std::string clip = a.clip > 0 ? format("%g (L%s norm)", a.clip, norm.c_str()) : "off";
  std::string states;  // --state, when it names more than f32
  if (low_precision_state(c))
    for (sf::StateFormat fmt : c.states)
      states += (states.empty() ? " · state " : ", ") + std::string(sf::state_format_name(fmt));
  out += format("%s · weights %s%s · grads %s%s · clip %s · loss scale %g\n",
                std::string(sf::optimizer_name(c.config)).c_str(), a.weights.c_str(),
                masters                   ? " + fp32 masters"
                : has_compensations(a, c) ? " + bf16 compensations (--masters compensated)"
                                          : "",
                a.grads.c_str(), states.c_str(), clip.c_str(), S);
  if (c.groups != GroupsMode::off) {
    const auto g = group_lines(c);
    out += format("param groups (--groups %s): decay: %s tensors of rank >= 2, %s parameters, weight_decay %g; "
                  "no decay: %s 1-D tensors, %s parameters, weight_decay %g (tensors in that order)%s\n",
                  groups_mode_name(c.groups), with_commas(static_cast<std::int64_t>(g[0].tensors)).c_str(),
                  with_commas(g[0].params).c_str(), g[0].weight_decay,
                  with_commas(static_cast<std::int64_t>(g[1].tensors)).c_str(), with_commas(g[1].params).c_str(),
                  g[1].weight_decay,
                  c.groups == GroupsMode::compare ? "; each mode timed with one group and with these two" : "");
  }
  out += format("bytes the step must move: %s (%d state stream%s%s) = %.3f GB per step\n", f.bytes.breakdown().c_str(),
                fo.state_streams, fo.state_streams == 1 ? "" : "s", low_precision_state(c) ? ", f32" : "",
                f.step_bytes * 1e-9);
  for (sf::StateFormat fmt : c.states) {  // --state bf16, q8: their rows' own bytes
    if (fmt == sf::StateFormat::f32) continue;
    const std::size_t k = state_idx(fmt);
    const std::string share =
        fmt == sf::StateFormat::q8
            ? format("; q8 in the tensors of at least 4,096 elements, %.1f%% of the parameters, absmaxes counted",
                     100.0 * f.stored_fraction[k])
            : "";
    out += format("  with %s state (the %s rows): %s = %.3f GB per step (%.3fx the f32 state's%s)\n",
                  std::string(sf::state_format_name(fmt)).c_str(), state_suffix(fmt),
                  f.state_bytes[k].breakdown().c_str(), f.state_step_bytes[k] * 1e-9,
                  f.state_bytes[k].per_param() / f.bytes.per_param(), share.c_str());
  }
  // The verification lines of one configuration; `label` says which with --groups compare.
  auto verified_lines = [&](const Verification& vs, const char* label) {
    for (const Verified& v : vs.verified) {
      const sb::VerifyReport& vr = v.report;
      out += format("verified before timing%s: one %s and one %s step agree on %s values (%.1f%% bitwise, worst "
                    "%.2f of the tolerance, rel %.0e)\n",
                    label, variant_name(v.mode), variant_name(vs.ref), with_commas(vr.values_checked).c_str(),
                    100.0 * static_cast<double>(vr.identical) /
                        static_cast<double>(std::max<std::int64_t>(vr.values_checked, 1)),
                    vr.worst_ratio, vr.rel_tol);
    }
    for (sf::StateFormat fmt : kAllStates) {  // f32 state first, as before; then bf16 and q8 (--state)
      const std::size_t k = state_idx(fmt);
      const Variant fused{Kind::fused, fmt}, fused_sr{Kind::fused_sr, fmt};
      if (vs.unfused_check[k])
        out += format("verified before timing%s: one %s and one %s step are bitwise equal: %s values (weights%s, "
                      "and the state as stored: %s), the grad norm and the clip coefficient\n",
                      label, variant_name(fused), variant_name(Variant{Kind::unfused, fmt}),
                      with_commas(vs.unfused_check[k]->values_checked).c_str(),
                      masters ? ", fp32 masters" : has_compensations(a, c) ? ", compensations" : "",
                      fmt == sf::StateFormat::q8 ? "q8 codes and block absmaxes, f32 under 4,096 elements"
                                                 : "bf16 values");
      if (vs.llvm_check[k])
        out += format("verified before timing%s: one %s and one %s (Highway) step are bitwise equal: %s "
                      "values, the grad norm and the clip coefficient\n",
                      label, variant_name(Variant{Kind::fused_llvm, fmt}), variant_name(fused),
                      with_commas(vs.llvm_check[k]->values_checked).c_str());
      if (vs.rounding_check[k]) {
        const sb::VerifyReport& vr = *vs.rounding_check[k];
        out += format("verified before timing%s: one %s step (stochastic rounding, seed %llu) is the %s step "
                      "but for the rounding: the grad norm, clip coefficient and f32 or q8 state bitwise equal, every "
                      "weight (and bf16 state value) finite and %s's or the bf16 value next to it (%s of %s values "
                      "bitwise equal, %s weights (%.1f%% of them) rounded the other way)\n",
                      label, variant_name(fused_sr), static_cast<unsigned long long>(kStochasticSeed),
                      variant_name(fused), variant_name(fused), with_commas(vr.identical).c_str(),
                      with_commas(vr.values_checked).c_str(), with_commas(vr.rounded_apart).c_str(),
                      100.0 * static_cast<double>(vr.rounded_apart) /
                          static_cast<double>(std::max<std::int64_t>(n, 1)));
      }
      if (vs.llvm_sr_check[k])
        out += format("verified before timing%s: one %s and one %s (Highway) step are bitwise equal: "
                      "%s values, the grad norm and the clip coefficient\n",
                      label, variant_name(Variant{Kind::fused_llvm_sr, fmt}), variant_name(fused_sr),
                      with_commas(vs.llvm_sr_check[k]->values_checked).c_str());
    }
    out += format("  (grad norm %.6g, clip coef %.6g)\n", vs.ref_result.grad_norm, vs.ref_result.clip_coef);
  };
  verified_lines(ver, grouped ? " (one group)" : "");
  if (grouped) verified_lines(grouped->ver, " (two groups)");
  out += format("\nmemory bandwidth, same run, %d thread%s, %s floats per array (median of %d, min-max):\n", threads,
                threads == 1 ? "" : "s", with_commas(n).c_str(), a.steps);
  for (sb::Pattern p : sb::kAllPatterns) {
    const double b = probe.bytes(p) * 1e-9;
    out += format("  %-10s %2d B/elem  %6.1f GB/s  (%.1f-%.1f)\n", std::string(sb::pattern_name(p)).c_str(),
                  sb::pattern_bytes_per_element(p), f.bw_gbs.at(p), b / f.bw_sum.at(p).max, b / f.bw_sum.at(p).min);
  }
  // What the fused rows' names mean, and their order (time_interleaved reverses it on odd iterations).
  std::string fused_legend;
  const auto fused_rows = std::count_if(c.variants.begin(), c.variants.end(), is_fused);
  const bool any_highway = std::any_of(c.variants.begin(), c.variants.end(), [](Variant v) {
    return is_fused(v) && cpu_backend_of(v) == sf::CpuBackend::highway;
  });
  const bool any_sr = std::any_of(c.variants.begin(), c.variants.end(),
                                  [](Variant v) { return rounding_of(v) == Rounding::stochastic; });
  if (first_llvm(c))
    fused_legend += any_highway ? "; the -llvm rows run LLVM's code, the other fused rows Highway's"
                                : "; the -llvm rows run LLVM's code";
  if (any_sr)
    fused_legend += format("; the -sr rows store the bf16 weights rounded stochastically (seed %llu), the others "
                           "rounded to nearest (the same bytes)",
                           static_cast<unsigned long long>(kStochasticSeed));
  if (low_precision_state(c))
    fused_legend += std::string("; the ") + (c.timed_state(sf::StateFormat::bf16) ? "-bf16s rows store the optimizer "
                                                                                    "state as bf16, the "
                                                                                  : "") +
                    (c.timed_state(sf::StateFormat::q8) ? "-q8 rows as q8 (8-bit blockwise), the " : "") +
                    "others as f32 (each row's GB/s and % adam_like count its own bytes: B/param)";
  if (fused_rows > 1) fused_legend += "; the fused rows in reverse order on odd iterations";
  out += format("\n%d timed steps per mode after %d warm-up, interleaved (%s%s%s):\n", a.steps, a.warmup,
                mode_list.c_str(), fused_legend.c_str(),
                grouped ? "; -2g: the same mode with two param groups, right after the one-group step on even "
                          "iterations, right before it on odd ones"
                        : "");
  // The mode column is 11 wide, wider for longer names ("fused-llvm-sr", and the "-2g" rows of
  // --groups compare); variant_w is the widest variant name (at least 11), for the ratio lines.
  int variant_w = 11;
  for (Variant v : c.variants) variant_w = std::max(variant_w, static_cast<int>(std::string(variant_name(v)).size()));
  const int name_w = grouped ? std::max(14, variant_w + 3) : variant_w;
  // With --state bf16 or q8 the rows move different bytes: a B/param column says each row's.
  const bool per_row_bytes = low_precision_state(c);
  out += format("  %-*s %10s %9s %9s %9s%s %8s %12s\n", name_w, "mode", "median ms", "min", "max", "IQR",
                per_row_bytes ? "  B/param" : "", "GB/s", "% adam_like");
  auto row = [&](const char* name, const sb::Summary& s, double gbs, double bytes_per_param) {
    out += format("  %-*s %10.2f %9.2f %9.2f %9.2f%s %8.1f %11.1f%%\n", name_w, name, s.median * 1e3, s.min * 1e3,
                  s.max * 1e3, (s.p75 - s.p25) * 1e3,
                  per_row_bytes ? format(" %8.2f", bytes_per_param).c_str() : "", gbs, 100.0 * gbs / f.ref_gbs);
  };
  for (Variant v : c.variants) {
    row(variant_name(v), runs[idx(v)].summary, runs[idx(v)].gbs, f.bytes_of(v).per_param());
    if (grouped)
      row(two_groups_name(v).c_str(), grouped->runs[idx(v)].summary, grouped->runs[idx(v)].gbs,
          f.bytes_of(v).per_param());
    if (v == c.first_fused && timing.update_only) row("update", f.uo, f.update_gbs, f.plain_bytes.per_param());
  }
  if (timing.update_only)
    out += format("  (update: the fused update pass alone, a plain step() without reduce pass, %g B/param; the reduce\n"
                  "   pass then takes the rest of the fused step: %.2f ms, %.1f GB/s for %g B/param = %.1f%% of read)\n",
                  f.plain_bytes.per_param(), f.reduce_s * 1e3, f.reduce_gbs, f.bytes.reduce,
                  100.0 * f.reduce_gbs / f.bw_gbs.at(sb::Pattern::read));
  for (const Ratio& r : f.ratios) {
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
    const Variant v0 = c.variants.front();
    const sb::Summary& pf = f.paired_frac[idx(v0)];
    out += format("  per iteration (median, min-max): %s at %.1f%% of adam_like (%.1f-%.1f)", variant_name(v0),
                  100.0 * pf.median, 100.0 * pf.min, 100.0 * pf.max);
    for (const Ratio& r : f.ratios)
      out += format(", %s %.2fx (%.2f-%.2f)", ratio_name(r.pair).c_str(), r.per_iteration.median,
                    r.per_iteration.min, r.per_iteration.max);
    out += "\n";
  }
  if (!f.rounding_ratios.empty()) {
    // Per iteration: each iteration's two steps ran back to back, as with --groups compare.
    out += "  stochastic / nearest rounding, step time (median of per-iteration ratios, min-max; ratio of median "
           "times):\n";
    int w = 0;
    for (const Ratio& r : f.rounding_ratios) w = std::max(w, static_cast<int>(rounding_ratio_name(r.pair).size()));
    for (const Ratio& r : f.rounding_ratios) {
      const sb::Summary& pi = r.per_iteration;
      out += format("    %-*s %.3fx (%.3f-%.3f; %.3fx)\n", w, rounding_ratio_name(r.pair).c_str(), pi.median, pi.min,
                    pi.max, r.median_ratio);
    }
  }
  if (!f.state_ratios.empty()) {
    // Per iteration: each iteration's two steps ran close together, as with --rounding.
    out += "  state / f32 state, step time (median of per-iteration ratios, min-max; ratio of median times) and "
           "bytes:\n";
    int w = 0;
    for (const Ratio& r : f.state_ratios) w = std::max(w, static_cast<int>(rounding_ratio_name(r.pair).size()));
    for (const Ratio& r : f.state_ratios) {
      const sb::Summary& pi = r.per_iteration;
      const double bb = f.bytes_of(r.pair.b).per_param(), ba = f.bytes_of(r.pair.a).per_param();
      out += format("    %-*s %.3fx (%.3f-%.3f; %.3fx); bytes %.4g / %.4g = %.3fx\n", w,
                    rounding_ratio_name(r.pair).c_str(), pi.median, pi.min, pi.max, r.median_ratio, bb, ba, bb / ba);
    }
  }
  if (grouped) {
    // Per iteration: each iteration's one- and two-group steps ran back to back, so their
    // ratio is what a busy machine disturbs least.
    out += "  two groups / one group, step time (median of per-iteration ratios, min-max; ratio of median times):\n";
    for (Variant v : c.variants) {
      const sb::Summary& pi = f.groups_per_iteration[idx(v)];
      out += format("    %-*s %.3fx (%.3f-%.3f; %.3fx)\n", variant_w, variant_name(v), pi.median, pi.min, pi.max,
                    f.groups_median_ratio[idx(v)]);
    }
  }
  // At model size, most of the construction time is allocating and filling state and masters.
  if (const std::optional<Variant> l = first_llvm(c))
    out += format("  LLVM optimizer construction: %.1f ms for the first (16 elements: its kernels compiled now, or "
                  "loaded from the kernel cache); at model size %.1f ms (%s), Highway's %.1f ms\n",
                  llvm_first_ms, runs[idx(*l)].construct_ms, variant_name(*l), runs[idx(highway_of(*l))].construct_ms);
  out += format("\npeak RSS, fused-only phase (%d steps, before any other buffer of model size existed):\n",
                a.rss_steps);
  out += format("  %.3f GiB peak vs %.3f GiB weights+grads+%sstate%s = %.2f%% (%+.2f%% above it; process before "
                "allocating: %.1f MiB)\n",
                gib(static_cast<double>(fo.rss_peak)), gib(fo.model_bytes),
                c.first_fused.state == sf::StateFormat::f32
                    ? ""
                    : (std::string(sf::state_format_name(c.first_fused.state)) + " ").c_str(),
                fo.master_bytes > 0 ? "+masters" : fo.compensation_bytes > 0 ? "+compensations" : "",
                100.0 * static_cast<double>(fo.rss_peak) / fo.model_bytes,
                100.0 * (static_cast<double>(fo.rss_peak) / fo.model_bytes - 1.0),
                static_cast<double>(fo.rss_start) / (1024.0 * 1024.0));
  out += format("total run time %.1f s\n", seconds_since(t_start));
  return out;
}

// The JSON report.
json make_json(const Args& a, const Case& c, const FusedOnly& fo, const Verification& ver, const Runs& runs,
               const GroupedRuns* grouped, const Timing& timing, const Figures& f, const sb::BandwidthProbe& probe,
               double llvm_first_ms) {
  const double S = c.loss_scale;
  const std::int64_t n = c.n;
  const int threads = fo.threads;
  const std::string norm = norm_name(a);
  const bool masters = has_masters(a, c);
  json j;
  j["tool"] = "stepfuse-bench";
  j["version"] = sf::version();
  j["cpu_target"] = sf::cpu_target();
  j["llvm_version"] = sf::llvm_version();  // "" without LLVM
  j["llvm_cpu"] = sf::llvm_cpu();
  j["threads"] = threads;
  json fusion = json::array();
  for (sf::Fusion m : c.modes) fusion.push_back(mode_name(m));
  json cpu_backend_names = json::array();  // of the fused mode
  for (sf::CpuBackend b : c.cpu_backends) cpu_backend_names.push_back(std::string(sf::cpu_backend_name(b)));
  json rounding_names = json::array();  // of the fused mode
  for (Rounding r : c.roundings) rounding_names.push_back(rounding_name(r));
  const bool stochastic = std::find(c.roundings.begin(), c.roundings.end(), Rounding::stochastic) != c.roundings.end();
  json state_names = json::array();  // of the fused mode (--state)
  for (sf::StateFormat fmt : c.states) state_names.push_back(std::string(sf::state_format_name(fmt)));
  j["config"] = {{"preset", c.from_file ? json(nullptr) : json(c.preset.name)},
                 {"shapes_file", c.from_file ? json(a.shapes_path) : json(nullptr)},
                 {"tensors", c.preset.tensors.size()},
                 {"params", n},
                 {"backend", a.backend},
                 {"fusion", fusion},
                 {"cpu_backends", cpu_backend_names},
                 {"optimizer", std::string(sf::optimizer_name(c.config))},
                 {"weights", a.weights},
                 {"grads", a.grads},
                 {"master_weights", masters},
                 {"compensated_weights", has_compensations(a, c)},
                 {"rounding", rounding_names},
                 {"stochastic_rounding_seed", stochastic ? json(kStochasticSeed) : json(nullptr)},
                 {"state_rounding",  // --state-rounding: the -sr rows' bf16 state
                  stochastic ? json(c.options.stochastic_state_rounding ? "stochastic" : "nearest") : json(nullptr)},
                 {"state", state_names},
                 {"min_q8_numel", c.options.min_q8_numel},
                 {"clip", a.clip},
                 {"norm_type", norm},
                 {"loss_scale", S},
                 {"steps", a.steps},
                 {"warmup", a.warmup},
                 {"rss_steps", a.rss_steps},
                 {"groups", groups_mode_name(c.groups)}};
  if (c.groups != GroupsMode::off) {  // the two groups, in params() order
    const auto g = group_lines(c);
    j["config"]["param_groups"] = json::array(
        {{{"name", "decay"}, {"tensors", g[0].tensors}, {"params", g[0].params}, {"weight_decay", g[0].weight_decay}},
         {{"name", "no_decay"}, {"tensors", g[1].tensors}, {"params", g[1].params}, {"weight_decay", g[1].weight_decay}}});
  }
  j["step_bytes"] = {{"reduce_per_param", f.bytes.reduce},
                     {"update_per_param", f.bytes.update},
                     {"per_param", f.bytes.per_param()},
                     {"state_streams", fo.state_streams},
                     {"per_step", f.step_bytes}};
  // --state: what the rows storing their state in each format must move ("f32" is "step_bytes"
  // when f32 state is timed). q8: "stored_fraction" is the share of the parameters in tensors
  // of at least min_q8_numel elements, whose state is stored as q8 (the rest keep f32).
  json by_state = json::object();
  for (sf::StateFormat fmt : c.states) {
    const std::size_t k = state_idx(fmt);
    by_state[std::string(sf::state_format_name(fmt))] = {{"reduce_per_param", f.state_bytes[k].reduce},
                                                         {"update_per_param", f.state_bytes[k].update},
                                                         {"per_param", f.state_bytes[k].per_param()},
                                                         {"per_step", f.state_step_bytes[k]},
                                                         {"stored_fraction", f.stored_fraction[k]},
                                                         {"over_f32_state", f.state_bytes[k].per_param() /
                                                                                f.bytes.per_param()}};
  }
  j["step_bytes_by_state"] = by_state;
  json bw = json::object();
  for (sb::Pattern p : sb::kAllPatterns) {
    const double b = probe.bytes(p) * 1e-9;
    bw[std::string(sb::pattern_name(p))] = {{"bytes_per_element", sb::pattern_bytes_per_element(p)},
                                             {"gbs_median", f.bw_gbs.at(p)},
                                             {"gbs_min", b / f.bw_sum.at(p).max},
                                             {"gbs_max", b / f.bw_sum.at(p).min},
                                             {"seconds", timing.bandwidth_s.at(p)}};
  }
  j["bandwidth"] = bw;
  auto mode_json = [&](const sb::Summary& s, const std::vector<double>& samples, double gbs) {
    return json{{"ms", summary_json(s, 1e3)},
                {"samples_ms", scaled(samples, 1e3)},
                {"gbs", gbs},
                {"fraction_of_adam_like", gbs / f.ref_gbs}};
  };
  // One key per timed variant ("fused" (Highway's code), "fused_sr", "fused_llvm",
  // "fused_llvm_sr", "unfused", "interpreted", and with --state "fused_q8", "fused_llvm_bf16s",
  // ...), with the bytes it moves per param, how it rounds the weights and how it stores the
  // state; one per pair of timed variants ("fused_over_unfused_speed" = median unfused time /
  // median fused time, "fused_llvm_over_fused_speed", ...); one per "-sr" variant timed beside
  // the same step rounding to nearest ("fused_sr_over_fused_time" = median fused-sr time /
  // median fused time); and one per bf16- or q8-state variant timed beside the same step with
  // f32 state ("fused_q8_over_fused_time").
  auto variant_json = [&](Variant v, const ModeRun& r) {
    json m = mode_json(r.summary, r.samples, r.gbs);
    m["bytes_per_param"] = f.bytes_of(v).per_param();
    m["rounding"] = rounding_name(rounding_of(v));
    m["state"] = std::string(sf::state_format_name(v.state));
    return m;
  };
  for (Variant v : c.variants) j[variant_key(v)] = variant_json(v, runs[idx(v)]);
  for (const Ratio& r : f.ratios) j[ratio_key(r.pair)] = r.median_ratio;
  for (const Ratio& r : f.rounding_ratios) j[rounding_ratio_key(r.pair)] = r.median_ratio;
  for (const Ratio& r : f.state_ratios) j[rounding_ratio_key(r.pair)] = r.median_ratio;
  if (timing.update_only) {
    j["fused_update_only"] = mode_json(f.uo, timing.update_s, f.update_gbs);
    j["fused_update_only"]["bytes_per_param"] = f.plain_bytes.per_param();
    j["fused_update_only"]["cpu_backend"] = std::string(sf::cpu_backend_name(cpu_backend_of(c.first_fused)));
    j["fused_update_only"]["rounding"] = rounding_name(rounding_of(c.first_fused));
    j["fused_update_only"]["state"] = std::string(sf::state_format_name(c.first_fused.state));
    j["fused_reduce_by_difference"] = {{"ms", f.reduce_s * 1e3},
                                       {"gbs", f.reduce_gbs},
                                       {"fraction_of_read", f.reduce_gbs / f.bw_gbs.at(sb::Pattern::read)}};
  }
  json per_it = json::object();
  for (Variant v : c.variants)
    per_it[variant_key(v) + "_fraction_of_adam_like"] = summary_json(f.paired_frac[idx(v)], 1.0);
  for (const Ratio& r : f.ratios) per_it[ratio_key(r.pair)] = summary_json(r.per_iteration, 1.0);
  for (const Ratio& r : f.rounding_ratios) per_it[rounding_ratio_key(r.pair)] = summary_json(r.per_iteration, 1.0);
  for (const Ratio& r : f.state_ratios) per_it[rounding_ratio_key(r.pair)] = summary_json(r.per_iteration, 1.0);
  // --groups compare: "<variant>_two_groups" (the mode with two groups) and
  // "<variant>_two_groups_over_one_group_time" (median two-group time / median one-group
  // time; per_iteration: the same from each iteration's pair).
  if (grouped)
    for (Variant v : c.variants) {
      const ModeRun& r = grouped->runs[idx(v)];
      j[variant_key(v) + "_two_groups"] = variant_json(v, r);
      j[variant_key(v) + "_two_groups_over_one_group_time"] = f.groups_median_ratio[idx(v)];
      per_it[variant_key(v) + "_two_groups_over_one_group_time"] = summary_json(f.groups_per_iteration[idx(v)], 1.0);
    }
  j["per_iteration"] = per_it;
  // The top-level figures are the first pair's (fused against unfused by default; none when
  // only bf16- or q8-state rows are timed: null); "pairs" has every pair checked.
  const sb::VerifyReport none;
  const sb::VerifyReport& v0 = ver.verified.empty() ? none : ver.verified.front().report;
  const bool any_pair = !ver.verified.empty();
  json pairs = json::array();
  for (const Verified& v : ver.verified)
    pairs.push_back({{"mode", variant_name(v.mode)},
                     {"reference", variant_name(ver.ref)},
                     {"values_checked", v.report.values_checked},
                     {"values_bitwise_equal", v.report.identical},
                     {"worst_fraction_of_tolerance", v.report.worst_ratio},
                     {"rel_tol", v.report.rel_tol},
                     {"worst", v.report.worst}});
  j["verification"] = {{"ok", true},
                       {"values_checked", any_pair ? json(v0.values_checked) : json(nullptr)},
                       {"values_bitwise_equal", any_pair ? json(v0.identical) : json(nullptr)},
                       {"worst_fraction_of_tolerance", any_pair ? json(v0.worst_ratio) : json(nullptr)},
                       {"rel_tol", any_pair ? json(v0.rel_tol) : json(nullptr)},
                       {"worst", any_pair ? json(v0.worst) : json(nullptr)},
                       {"grad_norm", ver.ref_result.grad_norm},
                       {"clip_coef", ver.ref_result.clip_coef},
                       {"reference", variant_name(ver.ref)},
                       {"pairs", pairs}};
  if (ver.llvm_check[0])  // fused_llvm against fused (Highway's code), bit for bit
    j["verification"]["llvm_vs_highway"] = {{"bitwise_equal", true},
                                            {"values_checked", ver.llvm_check[0]->values_checked},
                                            {"values_bitwise_equal", ver.llvm_check[0]->identical},
                                            {"grad_norm", runs[idx(Variant::fused_llvm)].verify_result.grad_norm},
                                            {"clip_coef", runs[idx(Variant::fused_llvm)].verify_result.clip_coef}};
  // fused_sr against fused: the same step but for the rounding of the weights (every value
  // bitwise equal but the weights, each fused's or the bf16 value next to it).
  if (ver.rounding_check[0])
    j["verification"]["stochastic_vs_nearest"] = {{"ok", true},
                                                  {"mode", "fused-sr"},
                                                  {"reference", "fused"},
                                                  {"seed", kStochasticSeed},
                                                  {"values_checked", ver.rounding_check[0]->values_checked},
                                                  {"values_bitwise_equal", ver.rounding_check[0]->identical},
                                                  {"weights_rounded_apart", ver.rounding_check[0]->rounded_apart}};
  if (ver.llvm_sr_check[0])  // fused_llvm_sr against fused_sr, bit for bit
    j["verification"]["llvm_vs_highway_stochastic"] = {{"bitwise_equal", true},
                                                       {"values_checked", ver.llvm_sr_check[0]->values_checked},
                                                       {"values_bitwise_equal", ver.llvm_sr_check[0]->identical}};
  // --state bf16, q8: "state_bf16", "state_q8": fused-<state> against unfused-<state> bit for bit
  // (weights, masters or compensations, and the state as stored), and the LLVM and "-sr" checks
  // of that state as above (null when not made).
  auto checked_json = [](const std::optional<sb::VerifyReport>& vr) {
    return vr ? json{{"bitwise_equal", true},
                     {"values_checked", vr->values_checked},
                     {"values_bitwise_equal", vr->identical}}
              : json(nullptr);
  };
  for (sf::StateFormat fmt : c.states) {
    if (fmt == sf::StateFormat::f32) continue;
    const std::size_t k = state_idx(fmt);
    json st = {{"mode", variant_name(Variant{Kind::fused, fmt})},
               {"reference", variant_name(Variant{Kind::unfused, fmt})},
               {"unfused", checked_json(ver.unfused_check[k])},
               {"llvm_vs_highway", checked_json(ver.llvm_check[k])},
               {"stochastic_vs_nearest", nullptr},
               {"llvm_vs_highway_stochastic", checked_json(ver.llvm_sr_check[k])}};
    if (ver.rounding_check[k])
      st["stochastic_vs_nearest"] = {{"ok", true},
                                     {"mode", variant_name(Variant{Kind::fused_sr, fmt})},
                                     {"reference", variant_name(Variant{Kind::fused, fmt})},
                                     {"seed", kStochasticSeed},
                                     {"values_checked", ver.rounding_check[k]->values_checked},
                                     {"values_bitwise_equal", ver.rounding_check[k]->identical},
                                     {"weights_rounded_apart", ver.rounding_check[k]->rounded_apart}};
    j["verification"]["state_" + std::string(sf::state_format_name(fmt))] = st;
  }
  if (grouped) {  // the two-group optimizers' own check, as "verification" is the one-group ones'
    const Verification& gv = grouped->ver;
    json gpairs = json::array();
    for (const Verified& v : gv.verified)
      gpairs.push_back({{"mode", variant_name(v.mode)},
                        {"reference", variant_name(gv.ref)},
                        {"values_checked", v.report.values_checked},
                        {"values_bitwise_equal", v.report.identical},
                        {"worst_fraction_of_tolerance", v.report.worst_ratio},
                        {"rel_tol", v.report.rel_tol},
                        {"worst", v.report.worst}});
    j["verification_two_groups"] = {{"ok", true},
                                    {"grad_norm", gv.ref_result.grad_norm},
                                    {"clip_coef", gv.ref_result.clip_coef},
                                    {"reference", variant_name(gv.ref)},
                                    {"pairs", gpairs},
                                    {"llvm_vs_highway_bitwise_equal", gv.llvm_check[0] ? json(true) : json(nullptr)},
                                    {"stochastic_vs_nearest_weights_rounded_apart",
                                     gv.rounding_check[0] ? json(gv.rounding_check[0]->rounded_apart) : json(nullptr)},
                                    {"llvm_vs_highway_stochastic_bitwise_equal",
                                     gv.llvm_sr_check[0] ? json(true) : json(nullptr)}};
    for (sf::StateFormat fmt : c.states)  // "state_q8_unfused_bitwise_equal", ...
      if (fmt != sf::StateFormat::f32)
        j["verification_two_groups"]["state_" + std::string(sf::state_format_name(fmt)) + "_unfused_bitwise_equal"] =
            gv.unfused_check[state_idx(fmt)] ? json(true) : json(nullptr);
  }
  if (const std::optional<Variant> l = first_llvm(c))  // model_*: of the first LLVM variant and its Highway twin
    j["llvm"] = {{"version", sf::llvm_version()},
                 {"cpu", sf::llvm_cpu()},
                 {"first_construction_ms", llvm_first_ms},
                 {"model_construction_variant", variant_key(*l)},
                 {"model_construction_ms", runs[idx(*l)].construct_ms},
                 {"highway_model_construction_ms", runs[idx(highway_of(*l))].construct_ms}};
  j["rss"] = {{"phase", "fused only, before any other buffer of model size"},
              {"peak_bytes", fo.rss_peak},
              {"peak_before_bytes", fo.peak_start},
              {"current_before_bytes", fo.rss_start},
              {"current_after_bytes", fo.rss_after},
              {"weights_bytes", fo.buffers->weight_bytes()},
              {"grads_bytes", fo.buffers->grad_bytes()},
              {"state_bytes", fo.state_bytes},
              {"master_bytes", fo.master_bytes},
              {"compensation_bytes", fo.compensation_bytes},
              {"model_bytes", fo.model_bytes},
              {"peak_over_model", static_cast<double>(fo.rss_peak) / fo.model_bytes}};
  return j;
}

}  // namespace

void report(const Args& a, const Case& c, const FusedOnly& fo, const Verification& ver, Runs& runs,
            GroupedRuns* grouped, const Timing& timing, const BandwidthProbe& probe, double llvm_first_ms,
            std::chrono::steady_clock::time_point t_start, std::ofstream& json_out) {
  const Figures f = compute_figures(a, c, fo, runs, grouped, timing, probe);
  const std::string out = format_table(a, c, fo, ver, runs, grouped, timing, f, probe, llvm_first_ms, t_start);
  if (!a.json_only) std::fputs(out.c_str(), stdout);

  if (json_out.is_open() || a.json_only) {
    const json j = make_json(a, c, fo, ver, runs, grouped, timing, f, probe, llvm_first_ms);
    write_json_report(j.dump(2) + "\n", json_out, a.json_path, a.json_only);
  }
}

}  // namespace stepfuse::bench::tool
