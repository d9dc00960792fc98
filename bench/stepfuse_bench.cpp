// stepfuse-bench: times the fused optimizer step against the unfused baseline and the bandwidth measured in the same run.
//
// Phases, in this order on purpose:
//   1. fused only: build the fused optimizer, take a few steps, read the peak RSS (before
//      anything else of model size exists, so the figure is the fused step's own);
//   2. verify: fresh fused and unfused optimizers over separate buffers with identical
//      contents take one step each; every weight, master and state value must agree
//      within fp32 rounding (exit code 2 otherwise) — nothing is timed before this;
//   3. measure: warm-up, then timed iterations of [bandwidth probes, fused step, fused
//      update pass alone, unfused step], interleaved so that drift in the machine affects
//      all of them alike.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bandwidth.hpp"
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

constexpr int kExitOk = 0;
constexpr int kExitUsage = 1;   // bad arguments, or a combination the library rejects
constexpr int kExitVerify = 2;  // fused and unfused disagree, or a step was skipped
constexpr int kExitError = 3;   // anything else (an unexpected library error, out of memory)

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct VerifyError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Args {
  std::string preset = "gpt2-124m";
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
};

// PyTorch's defaults for each optimizer (DESIGN §4).
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

// Phase messages on stderr, one line rewritten in place, only when stderr is a terminal
// (so logs and pipes get the report alone).
class Progress {
 public:
  Progress() : tty_(isatty(STDERR_FILENO) == 1) {}
  ~Progress() { done(); }
  void say(const std::string& s) {
    if (!tty_) return;
    std::fprintf(stderr, "\r\033[Kstepfuse-bench: %s", s.c_str());
    std::fflush(stderr);
    shown_ = true;
  }
  void done() {
    if (tty_ && shown_) std::fprintf(stderr, "\r\033[K");
    shown_ = false;
  }

 private:
  bool tty_;
  bool shown_ = false;
};

std::string with_commas(std::int64_t n) {
  const std::string digits = std::to_string(n);
  std::string s;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && digits[i - 1] != '-' && (digits.size() - i) % 3 == 0) s += ',';
    s += digits[i];
  }
  return s;
}

// printf into a std::string.
template <class... T>
std::string format(const char* fmt, T... args) {
  char buf[256];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
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

// An optimizer over `buf`; a configuration the library rejects is a usage error (exit code 1).
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

int run(const Args& a) {
  Progress progress;
  const auto t_start = std::chrono::steady_clock::now();

  // ---- Arguments -----------------------------------------------------------------------------
  sb::Preset preset;
  try {
    preset = sb::make_preset(a.preset);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--preset: ") + e.what());
  }
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
  std::ofstream json_out;
  if (!a.json_path.empty()) {
    json_out.open(a.json_path);
    if (!json_out) throw UsageError("--json: cannot write '" + a.json_path + "'");
  }

  sf::OptimizerOptions fused_opts;
  if (a.clip > 0) fused_opts.max_grad_norm = a.clip;
  fused_opts.norm_type = a.norm_type == "inf" ? INFINITY : 2.0;
  fused_opts.master_weights = !a.no_masters;
  fused_opts.num_threads = a.threads;
  fused_opts.fusion = sf::Fusion::fused;
  sf::OptimizerOptions unfused_opts = fused_opts;
  unfused_opts.fusion = sf::Fusion::unfused;
  const double S = a.loss_scale;
  const std::int64_t n = preset.total_numel();

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
  {
    std::optional<sf::Optimizer> opt0 = make_optimizer(config, fb, fused_opts);
    threads = opt0->num_threads();
    for (auto name : opt0->state_names()) state_names.emplace_back(name);
    state_streams = static_cast<int>(state_names.size());
    for (std::size_t t = 0; t < opt0->num_params(); ++t) {
      for (const auto& name : state_names) state_bytes += 4.0 * static_cast<double>(opt0->state(t, name).size());
      master_bytes += 4.0 * static_cast<double>(opt0->master(t).size());
    }
    for (int i = 0; i < a.rss_steps; ++i) {
      progress.say("fused-only phase (peak RSS): step " + std::to_string(i + 1) + "/" + std::to_string(a.rss_steps));
      check_applied(opt0->step_scaled(S), "fused", i);
    }
    rss_peak = sb::peak_rss_bytes();
    rss_after = sb::current_rss_bytes();
  }
  const double model_bytes =
      static_cast<double>(fb.weight_bytes() + fb.grad_bytes()) + state_bytes + master_bytes;

  // ---- Phase 2: verify fused against unfused before timing anything --------------------------
  progress.say("verifying fused against unfused");
  fb.fill_weights(threads);
  fb.fill_grads(S, threads);
  sb::ModelBuffers ub(preset.tensors, wt, gt);
  ub.fill_weights(threads);
  ub.fill_grads(S, threads);
  sf::Optimizer fused = make_optimizer(config, fb, fused_opts);
  sf::Optimizer unfused = make_optimizer(config, ub, unfused_opts);
  const sf::StepResult vf = fused.step_scaled(S);
  const sf::StepResult vu = unfused.step_scaled(S);
  const sb::VerifyReport vr = sb::compare_one_step(fused, fb, vf, unfused, ub, vu, S, threads);
  if (!vr.ok()) {
    std::string msg = "fused and unfused steps disagree:";
    for (const auto& p : vr.problems) msg += "\n  " + p;
    if (vr.mismatches > 0)
      msg += "\n  " + with_commas(vr.mismatches) + " of " + with_commas(vr.values_checked) +
             " values outside the tolerance; worst: " + vr.worst;
    throw VerifyError(msg);
  }

  // ---- Phase 3: interleaved timing -----------------------------------------------------------
  // The update pass alone, to split the fused step's time between its two passes: a third
  // fused optimizer over the same buffers, without clipping, taking plain steps (no reduce
  // pass). It has its own state; the weights it moves are the fused optimizer's, which
  // changes nothing that is timed.
  std::optional<sf::Optimizer> update_only;
  if (a.breakdown) {
    sf::OptimizerOptions o = fused_opts;
    o.max_grad_norm.reset();
    o.track_grad_norm = false;
    update_only.emplace(make_optimizer(config, fb, o));
  }
  progress.say("allocating the bandwidth probe (" + with_commas(n) + " floats x 4)");
  sb::BandwidthProbe probe(n, threads);
  std::map<sb::Pattern, std::vector<double>> bw_s;
  std::vector<double> fused_s, unfused_s, update_s;
  const int iterations = a.warmup + a.steps;
  for (int it = 0; it < iterations; ++it) {
    const bool timed = it >= a.warmup;
    progress.say((timed ? "timing " + std::to_string(it - a.warmup + 1) + "/" + std::to_string(a.steps)
                        : "warm-up " + std::to_string(it + 1) + "/" + std::to_string(a.warmup)) +
                 (fused_s.empty() ? std::string()
                                  : format("  (last: fused %.1f ms, unfused %.1f ms)", fused_s.back() * 1e3,
                                           unfused_s.back() * 1e3)));
    for (sb::Pattern p : sb::kAllPatterns) {
      const double s = probe.run(p);
      if (timed) bw_s[p].push_back(s);
    }
    auto t0 = std::chrono::steady_clock::now();
    const sf::StepResult rf = fused.step_scaled(S);
    const double tf = seconds_since(t0);
    check_applied(rf, "fused", it);
    if (update_only) {
      t0 = std::chrono::steady_clock::now();
      update_only->step();
      if (timed) update_s.push_back(seconds_since(t0));
    }
    // The unfused baseline unscales and clips the gradients in place: restore them, untimed.
    ub.copy_grads_from(fb, threads);
    t0 = std::chrono::steady_clock::now();
    const sf::StepResult ru = unfused.step_scaled(S);
    const double tu = seconds_since(t0);
    check_applied(ru, "unfused", it);
    if (timed) fused_s.push_back(tf), unfused_s.push_back(tu);
  }
  progress.done();

  // ---- Report --------------------------------------------------------------------------------
  const sb::StepBytes bytes =
      sb::step_bytes(wt, gt, !a.no_masters, state_streams, /*reduce_pass=*/true);  // step_scaled always reduces
  const double step_bytes = bytes.per_param() * static_cast<double>(n);
  const sb::Summary sf_ = sb::summarize(fused_s), su = sb::summarize(unfused_s);
  std::map<sb::Pattern, double> bw_gbs;  // median GB/s per pattern
  std::map<sb::Pattern, sb::Summary> bw_sum;
  for (sb::Pattern p : sb::kAllPatterns) {
    bw_sum[p] = sb::summarize(bw_s[p]);
    bw_gbs[p] = probe.bytes(p) / bw_sum[p].median * 1e-9;
  }
  const double ref_gbs = bw_gbs[sb::Pattern::adam_like];
  const double fused_gbs = step_bytes / sf_.median * 1e-9, unfused_gbs = step_bytes / su.median * 1e-9;
  const double ratio = su.median / sf_.median;
  // The same figures from each iteration's own samples (probe, fused, unfused taken back to
  // back), whose median is less sensitive to drift between iterations.
  std::vector<double> paired_frac, paired_ratio;
  for (std::size_t i = 0; i < fused_s.size(); ++i) {
    const double ref_i = probe.bytes(sb::Pattern::adam_like) / bw_s[sb::Pattern::adam_like][i];
    paired_frac.push_back(step_bytes / fused_s[i] / ref_i);
    paired_ratio.push_back(unfused_s[i] / fused_s[i]);
  }
  const sb::Summary pf = sb::summarize(paired_frac), pr = sb::summarize(paired_ratio);
  // Update pass alone (plain step: no reduce pass), and the reduce pass by difference.
  const sb::StepBytes plain_bytes = sb::step_bytes(wt, gt, !a.no_masters, state_streams, /*reduce_pass=*/false);
  const sb::Summary uo = sb::summarize(update_s);
  const double update_gbs = update_only ? plain_bytes.per_param() * static_cast<double>(n) / uo.median * 1e-9 : 0.0;
  const double reduce_s = sf_.median - uo.median;
  const double reduce_gbs = update_only && reduce_s > 0 ? bytes.reduce * static_cast<double>(n) / reduce_s * 1e-9 : 0.0;

  const std::string norm = a.norm_type == "inf" ? "inf" : "2";
  const bool masters = !a.no_masters && wt != sf::DType::f32;
  std::printf("stepfuse-bench %s · CPU target %s · %d thread%s\n", sf::version(), sf::cpu_target(), threads,
              threads == 1 ? "" : "s");
  std::printf("preset %s: %zu tensors, %s parameters\n", preset.name.c_str(), preset.tensors.size(),
              with_commas(n).c_str());
  const std::string clip = a.clip > 0 ? format("%g (L%s norm)", a.clip, norm.c_str()) : "off";
  std::printf("%s · weights %s%s · grads %s · clip %s · loss scale %g\n",
              std::string(sf::optimizer_name(config)).c_str(), a.weights.c_str(), masters ? " + fp32 masters" : "",
              a.grads.c_str(), clip.c_str(), S);
  std::printf("bytes the step must move: %s (%d state stream%s) = %.3f GB per step\n", bytes.breakdown().c_str(),
              state_streams, state_streams == 1 ? "" : "s", step_bytes * 1e-9);
  std::printf("verified before timing: one fused and one unfused step agree on %s values (%.1f%% bitwise, worst "
              "%.2f of the tolerance, rel %.0e); grad norm %.6g, clip coef %.6g\n",
              with_commas(vr.values_checked).c_str(),
              100.0 * static_cast<double>(vr.identical) / static_cast<double>(std::max<std::int64_t>(vr.values_checked, 1)),
              vr.worst_ratio, vr.rel_tol, vf.grad_norm, vf.clip_coef);
  std::printf("\nmemory bandwidth, same run, %d thread%s, %s floats per array (median of %d, min-max):\n", threads,
              threads == 1 ? "" : "s", with_commas(n).c_str(), a.steps);
  for (sb::Pattern p : sb::kAllPatterns) {
    const double b = probe.bytes(p) * 1e-9;
    std::printf("  %-10s %2d B/elem  %6.1f GB/s  (%.1f-%.1f)\n", std::string(sb::pattern_name(p)).c_str(),
                sb::pattern_bytes_per_element(p), bw_gbs[p], b / bw_sum[p].max, b / bw_sum[p].min);
  }
  std::printf("\n%d timed steps per mode after %d warm-up, interleaved (fused, unfused, ...):\n", a.steps, a.warmup);
  std::printf("  %-8s %10s %9s %9s %9s %8s %12s\n", "mode", "median ms", "min", "max", "IQR", "GB/s", "% adam_like");
  auto row = [&](const char* name, const sb::Summary& s, double gbs) {
    std::printf("  %-8s %10.2f %9.2f %9.2f %9.2f %8.1f %11.1f%%\n", name, s.median * 1e3, s.min * 1e3, s.max * 1e3,
                (s.p75 - s.p25) * 1e3, gbs, 100.0 * gbs / ref_gbs);
  };
  row("fused", sf_, fused_gbs);
  row("unfused", su, unfused_gbs);
  if (update_only) {
    row("update", uo, update_gbs);
    std::printf("  (update: the fused update pass alone, a plain step() without reduce pass, %g B/param; the reduce\n"
                "   pass then takes the rest of the fused step: %.2f ms, %.1f GB/s for %g B/param = %.1f%% of read)\n",
                plain_bytes.per_param(), reduce_s * 1e3, reduce_gbs, bytes.reduce,
                100.0 * reduce_gbs / bw_gbs[sb::Pattern::read]);
  }
  std::printf("  fused/unfused speed ratio: %.2fx (median unfused time / median fused time)\n", ratio);
  std::printf("  per iteration (median, min-max): fused at %.1f%% of adam_like (%.1f-%.1f), fused/unfused %.2fx "
              "(%.2f-%.2f)\n",
              100.0 * pf.median, 100.0 * pf.min, 100.0 * pf.max, pr.median, pr.min, pr.max);
  std::printf("\npeak RSS, fused-only phase (%d steps, before any other buffer of model size existed):\n",
              a.rss_steps);
  std::printf("  %.3f GiB peak vs %.3f GiB weights+grads+state%s = %.2f%% (%+.2f%% above it; process before "
              "allocating: %.1f MiB)\n",
              gib(static_cast<double>(rss_peak)), gib(model_bytes), master_bytes > 0 ? "+masters" : "",
              100.0 * static_cast<double>(rss_peak) / model_bytes,
              100.0 * (static_cast<double>(rss_peak) / model_bytes - 1.0),
              static_cast<double>(rss_start) / (1024.0 * 1024.0));
  std::printf("total run time %.1f s\n", seconds_since(t_start));

  if (json_out.is_open()) {
    json j;
    j["tool"] = "stepfuse-bench";
    j["version"] = sf::version();
    j["cpu_target"] = sf::cpu_target();
    j["threads"] = threads;
    j["config"] = {{"preset", preset.name},
                   {"tensors", preset.tensors.size()},
                   {"params", n},
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
    auto mode = [&](const sb::Summary& s, const std::vector<double>& samples, double gbs) {
      return json{{"ms", summary_json(s, 1e3)},
                  {"samples_ms", scaled(samples, 1e3)},
                  {"gbs", gbs},
                  {"fraction_of_adam_like", gbs / ref_gbs}};
    };
    j["fused"] = mode(sf_, fused_s, fused_gbs);
    j["unfused"] = mode(su, unfused_s, unfused_gbs);
    j["fused_over_unfused_speed"] = ratio;
    if (update_only) {
      j["fused_update_only"] = mode(uo, update_s, update_gbs);
      j["fused_update_only"]["bytes_per_param"] = plain_bytes.per_param();
      j["fused_reduce_by_difference"] = {{"ms", reduce_s * 1e3},
                                         {"gbs", reduce_gbs},
                                         {"fraction_of_read", reduce_gbs / bw_gbs[sb::Pattern::read]}};
    }
    j["per_iteration"] = {{"fused_fraction_of_adam_like", summary_json(pf, 1.0)},
                          {"fused_over_unfused_speed", summary_json(pr, 1.0)}};
    j["verification"] = {{"ok", true},
                         {"values_checked", vr.values_checked},
                         {"values_bitwise_equal", vr.identical},
                         {"worst_fraction_of_tolerance", vr.worst_ratio},
                         {"rel_tol", vr.rel_tol},
                         {"worst", vr.worst},
                         {"grad_norm", vf.grad_norm},
                         {"clip_coef", vf.clip_coef}};
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
    json_out << j.dump(2) << "\n";
    if (!json_out) throw std::runtime_error("--json: writing '" + a.json_path + "' failed");
  }
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"stepfuse-bench: the fused optimizer step against the unfused baseline and the memory bandwidth "
               "measured in the same run.\nVerifies fused == unfused (within fp32 rounding) before timing; times "
               "interleaved steps; reports medians, spread, bytes moved, GB/s, % of bandwidth, the speed ratio and "
               "peak RSS.",
               "stepfuse-bench"};
  std::string presets = "\nPresets:\n";
  for (const auto& [name, desc] : sb::preset_catalog()) presets += "  " + name + std::string(16 - name.size(), ' ') + desc + "\n";
  app.footer(presets +
             "\nExit codes: 0 ok, 1 bad arguments (or a configuration the library rejects), 2 verification "
             "failed (fused and unfused disagree, or a step was skipped), 3 other errors.");
  app.set_version_flag("--version", std::string(sf::version()));
  app.add_option("--preset", a.preset, "tensor list: gpt2-124m, llama7b-layer, many-small or flat:N")
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
  app.add_option("--json", a.json_path, "also write every figure to FILE as JSON");
  try {
    app.parse(argc, argv);
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
