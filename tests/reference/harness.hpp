// Test harness: a library Optimizer over random host tensors, stepped and checked against the reference.
//
// check_step() does one step of the library and of the float64 reference, the
// reference starting from the library's own previous weights (masters) and state,
// so every step is judged on its own and errors do not accumulate; then it checks
// every element written, the StepResult and the counters.
//
// Tolerances (docs/architecture.md §8):
//  - fp32 values (f32 weights, masters, all state): |lib - ref| <= 1e-5 * |ref| + floor + sens.
//    floor: elements where a sum cancels to near zero carry fp32 errors of a few ulps of
//      the terms, not of the result:
//        weights/masters: 1e-5 * the largest |p_new - p_old| of the step over all tensors,
//          i.e. 1e-5 of the step size, about lr * 1e-5 for Adam/RMSprop/Lion-like updates;
//        state: 1e-6 * the largest |value| of that state (before or after) over all tensors.
//    sens: the reference's own sensitivity, max |ref(g * (1 +- 1e-6)) - ref(g)| with g the
//      effective gradient. An element whose gradient cancels (g + wd * p ~ 0) and is then
//      normalized (g / (|g| + eps), Adam's and RMSprop's first steps) amplifies the fp32
//      rounding of g (a few ulps, < 1e-6 relative) far beyond 1e-5 of the result; the
//      library must still give what the reference gives for a gradient within 1e-6.
//    The clip coefficient is checked on its own (1e-5 relative, against the reference's
//    float64 norm); the elementwise check then uses the library's coefficient, so an fp32
//    norm's rounding (~1e-6, scaling every gradient alike) is not charged to every element.
//  - f16/bf16 stored weights: within one unit in the last place of the storage format
//    of the correctly rounded reference value, or (where the fp32 tolerance above spans
//    more than an ulp, near zero after cancellation) the rounding of a value within it.
//    With masters, exactly the master rounded to nearest even.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "reference/dtypes.hpp"
#include "reference/reference.hpp"
#include "reference/test_data.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse::ref {

inline constexpr double kRtol = 1e-5;
inline constexpr double kParamFloor = 1e-5;  // times the largest step |p_new - p_old|
inline constexpr double kStateFloor = 1e-6;  // times the largest |state| of that stream

// Largest error/tolerance ratios seen, printed at the end to show the margin.
struct Margins {
  double param = 0, state = 0, norm = 0;
  std::int64_t one_ulp = 0, checked16 = 0, cancelled16 = 0, lion_ambiguous = 0;
};
inline Margins& margins() {
  static Margins m;
  return m;
}

struct RigSetup {
  OptimizerConfig config;
  DType weight_dtype = DType::f32;
  DType grad_dtype = DType::f32;
  bool master_weights = true;
  std::optional<double> max_grad_norm;
  double norm_type = 2.0;
  std::vector<std::int64_t> sizes;
  bool flat = false;
  std::uint64_t seed = 1;
  Fusion fusion = Fusion::fused;
  int num_threads = 0;
  bool track_grad_norm = false;
  double weight_scale = 1.0;  // initial weights are N(0, weight_scale^2)

  OptimizerOptions options() const {
    OptimizerOptions o;
    o.max_grad_norm = max_grad_norm;
    o.norm_type = norm_type;
    o.master_weights = master_weights;
    o.fusion = fusion;
    o.num_threads = num_threads;
    o.track_grad_norm = track_grad_norm;
    return o;
  }
  bool has_masters() const { return weight_dtype != DType::f32 && master_weights; }
};

inline std::vector<Param> make_params(const HostTensors& w, const HostTensors& g) {
  std::vector<Param> p;
  for (std::size_t i = 0; i < w.size(); ++i) p.push_back({w[i], g[i]});
  return p;
}

// Random N(0, scale^2) weights rounded to their dtype.
inline void fill_weights(const HostTensors& w, Random& rng, double scale = 1.0) {
  for (std::size_t i = 0; i < w.size(); ++i)
    for (std::int64_t j = 0; j < w[i].numel; ++j) w.set(i, j, rng.normal() * scale);
}

// Random gradients g ~ N(0, (factor * f_i)^2), f_i in {0.5, 1, 1.5, 2} by tensor,
// stored as g * loss_scale rounded to the gradient dtype.
inline void fill_grads(const HostTensors& g, Random& rng, double factor, double loss_scale) {
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double f = factor * (0.5 + 0.5 * static_cast<double>(i % 4));
    for (std::int64_t j = 0; j < g[i].numel; ++j) g.set(i, j, rng.normal() * f * loss_scale);
  }
}

// A library optimizer over freshly drawn host tensors.
struct Rig {
  explicit Rig(const RigSetup& s)
      : setup(s),
        weights(s.weight_dtype, s.sizes, s.flat),
        grads(s.grad_dtype, s.sizes, s.flat),
        rng(s.seed),
        opt((fill_weights(weights, rng, s.weight_scale), s.config), make_params(weights, grads), s.options()) {}

  RigSetup setup;
  HostTensors weights;
  HostTensors grads;
  Random rng;
  Optimizer opt;
};

// The reference's view of the library's current weights and state.
inline std::vector<RefTensor> ref_from_library(const Optimizer& opt, const HostTensors& weights,
                                               const OptimizerConfig& config) {
  std::vector<RefTensor> out;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    RefTensor t;
    const auto master = opt.master(i);
    if (!master.empty()) t.param.assign(master.begin(), master.end());
    else t.param = weights.values(i);
    for (const std::string& name : state_names(config)) {
      const auto s = opt.state(i, name);
      t.state[name].assign(s.begin(), s.end());
    }
    if (std::holds_alternative<optim::NAdam>(config)) t.mu_product = opt.nadam_mu_product(opt.group_of(i));
    out.push_back(std::move(t));
  }
  return out;
}

// Caps the failure messages of one check so a broken kernel does not flood the log.
class Reporter {
 public:
  explicit Reporter(std::string what) : what_(std::move(what)) {}
  ~Reporter() {
    if (count_ > kMax) ADD_FAILURE() << what_ << ": " << count_ << " mismatches in all (first " << kMax << " shown)";
  }
  template <class F>
  void fail(F&& message) {
    if (++count_ <= kMax) {
      std::ostringstream os;
      os.precision(17);
      message(os);
      ADD_FAILURE() << what_ << ": " << os.str();
    }
  }
  int count() const { return count_; }

 private:
  static constexpr int kMax = 6;
  std::string what_;
  int count_ = 0;
};

// Maps a 16-bit float pattern to an integer that orders like the values (+0 = -0 = 0).
inline std::int64_t ordered16(std::uint16_t v) {
  return (v & 0x8000) ? -static_cast<std::int64_t>(v & 0x7FFF) : static_cast<std::int64_t>(v);
}

inline bool same_or_both_nan(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || a == b;
}

enum class StepMode { plain, scaled };

// Checks the library's state_names(), state sizes, initial state values and masters
// of a freshly built optimizer.
inline void check_initial_state(const Rig& rig) {
  const Optimizer& opt = rig.opt;
  std::vector<std::string> names;
  for (std::string_view n : opt.state_names()) names.emplace_back(n);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, state_names(rig.setup.config));
  EXPECT_EQ(opt.step_count(), 0);
  EXPECT_EQ(opt.num_params(), rig.weights.size());
  Reporter rep("initial state");
  for (std::size_t i = 0; i < rig.weights.size(); ++i) {
    const std::int64_t n = rig.weights[i].numel;
    for (const std::string& name : names) {
      const auto s = opt.state(i, name);
      if (static_cast<std::int64_t>(s.size()) != n) {
        rep.fail([&](auto& os) { os << "state " << name << " of tensor " << i << " has " << s.size() << " elements, expected " << n; });
        continue;
      }
      const double init = initial_state_value(rig.setup.config, name);
      for (std::int64_t j = 0; j < n; ++j)
        if (s[j] != static_cast<float>(init))
          rep.fail([&](auto& os) { os << name << "[" << i << "][" << j << "] = " << s[j] << ", expected " << init; });
    }
    const auto m = opt.master(i);
    if (!rig.setup.has_masters()) {
      if (!m.empty()) rep.fail([&](auto& os) { os << "tensor " << i << " has a master copy but should not"; });
    } else if (static_cast<std::int64_t>(m.size()) != n) {
      rep.fail([&](auto& os) { os << "master of tensor " << i << " has " << m.size() << " elements, expected " << n; });
    } else {
      for (std::int64_t j = 0; j < n; ++j)
        if (static_cast<double>(m[j]) != rig.weights.get(i, j))
          rep.fail([&](auto& os) { os << "master[" << i << "][" << j << "] = " << m[j] << ", weight is " << rig.weights.get(i, j); });
    }
  }
}

// The relative perturbation of the effective gradients that measures the reference's
// sensitivity (see the tolerances above): ~16 fp32 ulps.
inline constexpr double kGradPerturbation = 1e-6;

// The reference result of one update, and its sensitivity to the gradients.
struct Expected {
  std::vector<RefTensor> after;
  std::vector<std::vector<double>> param_sens;                   // per tensor, per element
  std::map<std::string, std::vector<std::vector<double>>> state_sens;  // per name, tensor, element
};

// Applies update() to `before` with `effective_grads` (g / S * clip, per tensor) as
// step `step`, and again with the gradients scaled by 1 +- kGradPerturbation.
inline Expected make_expected(const OptimizerConfig& config, const std::vector<RefTensor>& before,
                              const std::vector<std::vector<double>>& effective_grads, std::int64_t step) {
  Expected e;
  e.after = before;
  for (std::size_t i = 0; i < before.size(); ++i) update(config, e.after[i], effective_grads[i], step);
  for (std::size_t i = 0; i < before.size(); ++i) e.param_sens.emplace_back(before[i].param.size(), 0.0);
  for (const auto& [name, v] : before.empty() ? std::map<std::string, std::vector<double>>{} : before[0].state) {
    auto& sens = e.state_sens[name];
    for (std::size_t i = 0; i < before.size(); ++i) sens.emplace_back(before[i].param.size(), 0.0);
  }
  for (double sign : {1.0, -1.0}) {
    std::vector<RefTensor> moved = before;
    for (std::size_t i = 0; i < before.size(); ++i) {
      std::vector<double> g = effective_grads[i];
      for (double& x : g) x *= 1 + sign * kGradPerturbation;
      update(config, moved[i], g, step);
      for (std::size_t j = 0; j < g.size(); ++j) {
        double& ps = e.param_sens[i][j];
        ps = std::max(ps, std::fabs(moved[i].param[j] - e.after[i].param[j]));
      }
      for (auto& [name, sens] : e.state_sens) {
        const std::vector<double>& a = moved[i].state.at(name);
        const std::vector<double>& b = e.after[i].state.at(name);
        std::vector<double>& out = sens[i];
        for (std::size_t j = 0; j < g.size(); ++j) out[j] = std::max(out[j], std::fabs(a[j] - b[j]));
      }
    }
  }
  return e;
}

// Compares the library's weights, masters and state after a step with the reference.
// `before` is the reference input (the library's state before the step), `expected`
// the reference output, `effective_grads` the reference's g / S * clip.
inline void compare_with_reference(const Rig& rig, const std::vector<RefTensor>& before,
                                   const Expected& expected,
                                   const std::vector<std::vector<double>>& effective_grads) {
  const std::vector<RefTensor>& after = expected.after;
  const RigSetup& s = rig.setup;
  const Optimizer& opt = rig.opt;
  // Lion takes the sign of c = beta1 * m + (1 - beta1) * g: where c is within rounding of
  // zero, fp32 and fp64 may legitimately pick different signs; such elements are skipped.
  const auto* lion = std::get_if<optim::Lion>(&s.config);
  std::vector<const double*> lion_m;
  if (lion != nullptr)
    for (const RefTensor& t : before) lion_m.push_back(t.state.at("exp_avg").data());
  auto lion_ambiguous = [&](std::size_t i, std::size_t j) {
    if (lion == nullptr) return false;
    const double m = lion_m[i][j];
    const double g = lion->maximize ? -effective_grads[i][j] : effective_grads[i][j];
    const double c = lion->beta1 * m + (1 - lion->beta1) * g;
    return std::fabs(c) <= 1e-5 * (lion->beta1 * std::fabs(m) + (1 - lion->beta1) * std::fabs(g));
  };

  double max_step = 0;
  for (std::size_t i = 0; i < after.size(); ++i)
    for (std::size_t j = 0; j < after[i].param.size(); ++j)
      max_step = std::max(max_step, std::fabs(after[i].param[j] - before[i].param[j]));
  const double param_floor = kParamFloor * max_step;

  Reporter rep("weights");
  for (std::size_t i = 0; i < after.size(); ++i) {
    const auto master = opt.master(i);
    for (std::size_t j = 0; j < after[i].param.size(); ++j) {
      if (lion_ambiguous(i, j)) {
        ++margins().lion_ambiguous;
        continue;
      }
      const double want = after[i].param[j];
      const double tol = kRtol * std::fabs(want) + param_floor + expected.param_sens[i][j];
      auto check_fp32 = [&](double got, const char* what) {
        const double err = std::fabs(got - want);
        if (!(err <= tol))
          rep.fail([&](auto& os) {
            os << what << "[" << i << "][" << j << "] = " << got << ", reference " << want << " (from "
               << before[i].param[j] << "), error " << err << " > tolerance " << tol;
          });
        else if (tol > 0) margins().param = std::max(margins().param, err / tol);
      };
      if (s.weight_dtype == DType::f32) {
        check_fp32(rig.weights.get(i, static_cast<std::int64_t>(j)), "weight");
        continue;
      }
      const std::uint16_t got = load_bits16(rig.weights[i], static_cast<std::int64_t>(j));
      if (s.has_masters()) {
        check_fp32(master[j], "master");
        const std::uint16_t rounded = bits16(master[j], s.weight_dtype);
        if (got != rounded)
          rep.fail([&](auto& os) {
            os << "weight[" << i << "][" << j << "] bits 0x" << std::hex << got << " != master " << std::dec
               << master[j] << " rounded to nearest even (0x" << std::hex << rounded << ")";
          });
      }
      const std::uint16_t expect = bits16(want, s.weight_dtype);
      const std::int64_t ulps = ulp_distance16(got, expect, s.weight_dtype);
      ++margins().checked16;
      if (ulps == 1) ++margins().one_ulp;
      if (ulps > 1) {
        // Allowed: [round(want - tol), round(want + tol)], at least want's rounding +- 1 ulp.
        const std::int64_t lo = ordered16(bits16(want - tol, s.weight_dtype));
        const std::int64_t hi = ordered16(bits16(want + tol, s.weight_dtype));
        const std::int64_t g = ordered16(got);
        const bool finite = std::isfinite(value16(got, s.weight_dtype));
        if (!finite || g < std::min(lo, ordered16(expect) - 1) || g > std::max(hi, ordered16(expect) + 1))
          rep.fail([&](auto& os) {
            os << "weight[" << i << "][" << j << "] = " << value16(got, s.weight_dtype) << ", reference " << want
               << " rounds to " << value16(expect, s.weight_dtype) << ": " << ulps << " ulps apart, outside [round("
               << want - tol << "), round(" << want + tol << ")] (from " << before[i].param[j] << ")";
          });
        else
          ++margins().cancelled16;
      }
    }
  }

  for (const std::string& name : state_names(s.config)) {
    double scale = 0;
    for (std::size_t i = 0; i < after.size(); ++i) {
      const std::vector<double>& a = after[i].state.at(name);
      const std::vector<double>& b = before[i].state.at(name);
      for (std::size_t j = 0; j < a.size(); ++j) scale = std::max({scale, std::fabs(a[j]), std::fabs(b[j])});
    }
    const double floor = kStateFloor * scale;
    Reporter srep("state " + name);
    for (std::size_t i = 0; i < after.size(); ++i) {
      const auto got = opt.state(i, name);
      const std::vector<double>& want = after[i].state.at(name);
      const std::vector<double>& sens = expected.state_sens.at(name)[i];
      if (got.size() != want.size()) {
        srep.fail([&](auto& os) { os << "tensor " << i << " has " << got.size() << " elements, expected " << want.size(); });
        continue;
      }
      for (std::size_t j = 0; j < want.size(); ++j) {
        const double err = std::fabs(got[j] - want[j]);
        const double tol = kRtol * std::fabs(want[j]) + floor + sens[j];
        if (!(err <= tol))
          srep.fail([&](auto& os) {
            os << name << "[" << i << "][" << j << "] = " << got[j] << ", reference " << want[j] << " (from "
               << before[i].state.at(name)[j] << "), error " << err << " > tolerance " << tol;
          });
        else if (tol > 0) margins().state = std::max(margins().state, err / tol);
      }
    }
  }
}

// Compares a norm or coefficient with a relative tolerance.
inline void expect_rel(double got, double want, double rtol, const char* what) {
  const double err = std::fabs(got - want);
  const double tol = rtol * std::fabs(want) + 1e-300;
  EXPECT_LE(err, tol) << what << " = " << got << ", reference " << want;
  if (err <= tol) margins().norm = std::max(margins().norm, err / tol / (rtol / kRtol));
}

struct StepOutcome {
  RefStepResult ref;  // the reference's own norm and clip coefficient
  StepResult lib;
  std::vector<std::vector<double>> scaled_grads;  // the gradients as drawn, before the step
  std::vector<RefTensor> before;                  // the library's state before the step
  Expected expected;                              // the reference's update of `before`
};

// Draws new gradients (scaled by `loss_scale`), steps the library (step() for
// StepMode::plain, else step_scaled(loss_scale)) and the reference from the
// library's previous state, and checks everything the step wrote and returned.
inline StepOutcome check_step(Rig& rig, StepMode mode, double loss_scale, double grad_factor) {
  const RigSetup& s = rig.setup;
  Optimizer& opt = rig.opt;
  fill_grads(rig.grads, rig.rng, grad_factor, loss_scale);

  StepOutcome out;
  out.before = ref_from_library(opt, rig.weights, s.config);
  out.scaled_grads = rig.grads.all_values();
  const std::int64_t count = opt.step_count();

  const auto grads_before = rig.grads.snapshot();
  if (mode == StepMode::plain) {
    opt.step();
    out.lib = opt.last_result();
  } else {
    out.lib = opt.step_scaled(loss_scale);
    const StepResult& last = opt.last_result();
    EXPECT_EQ(last.applied, out.lib.applied);
    EXPECT_TRUE(same_or_both_nan(last.grad_norm, out.lib.grad_norm));
  }
  EXPECT_TRUE(out.lib.applied);
  EXPECT_FALSE(out.lib.found_inf);
  EXPECT_EQ(opt.step_count(), count + 1);
  EXPECT_TRUE(same_or_both_nan(opt.last_grad_norm(), out.lib.grad_norm))
      << "last_grad_norm() " << opt.last_grad_norm() << " vs StepResult " << out.lib.grad_norm;

  // The reference's own norm and clip coefficient.
  RefStepInput in;
  in.loss_scale = loss_scale;
  in.max_grad_norm = s.max_grad_norm;
  in.norm_type = s.norm_type;
  in.step = count + 1;
  std::vector<RefTensor> scratch = out.before;
  out.ref = step(s.config, scratch, out.scaled_grads, in);
  EXPECT_FALSE(out.ref.found_inf) << "the test drew a non-finite gradient";

  // The norm is computed whenever the step has a reduce pass: always for a fused
  // (or interpreted) scaled step (inf check), for a plain one when clipping or tracking.
  // The unfused baseline, like PyTorch eager, needs a norm only to clip: not pinned.
  const bool norm_computed = s.fusion != Fusion::unfused
                                 ? mode == StepMode::scaled || s.max_grad_norm || s.track_grad_norm
                                 : s.max_grad_norm || s.track_grad_norm;
  if (norm_computed) {
    // fp32 sums of squares vs double: 1e-5; max |g| is exact up to the final division by S.
    expect_rel(out.lib.grad_norm, out.ref.grad_norm, std::isinf(s.norm_type) ? 1e-6 : 1e-5, "grad_norm");
    const auto& per_tensor = opt.last_tensor_grad_norms();
    if (per_tensor.size() != out.scaled_grads.size()) {
      ADD_FAILURE() << "last_tensor_grad_norms() has " << per_tensor.size() << " entries, expected "
                    << out.scaled_grads.size();
    } else {
      for (std::size_t i = 0; i < out.scaled_grads.size(); ++i) {
        std::vector<std::vector<double>> one{out.scaled_grads[i]};
        for (double& x : one[0]) x /= loss_scale;
        expect_rel(per_tensor[i], total_norm(one, s.norm_type), 1e-5, "tensor grad norm");
      }
    }
  }
  bool clip_ok = true;
  if (s.max_grad_norm) {
    expect_rel(out.lib.clip_coef, out.ref.clip_coef, 1e-5, "clip_coef");
    clip_ok = std::fabs(out.lib.clip_coef - out.ref.clip_coef) <= 1e-5 * out.ref.clip_coef;
  } else {
    EXPECT_EQ(out.lib.clip_coef, 1.0);
  }

  // A step never writes the caller's gradients (the unfused baseline unscales and
  // clips into an fp32 temporary).
  if (rig.grads.snapshot() != grads_before) ADD_FAILURE() << "the step modified the gradients";

  // The update, judged with the library's (checked) clip coefficient.
  std::vector<std::vector<double>> effective = out.scaled_grads;
  const double clip = s.max_grad_norm && clip_ok ? out.lib.clip_coef : out.ref.clip_coef;
  for (auto& g : effective)
    for (double& x : g) x = x / loss_scale * clip;  // as step() does: unscale, then clip
  out.expected = make_expected(s.config, out.before, effective, count + 1);
  compare_with_reference(rig, out.before, out.expected, effective);
  return out;
}

// Everything the optimizer owns or writes, as raw bytes, for bitwise comparisons.
struct Snapshot {
  std::vector<std::vector<unsigned char>> weights;
  std::vector<std::vector<float>> masters;
  std::vector<std::vector<float>> state;  // per tensor, per state name in state_names() order
  std::int64_t step_count = 0;
  bool operator==(const Snapshot& o) const {
    auto bits_equal = [](const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
      if (a.size() != b.size()) return false;
      for (std::size_t i = 0; i < a.size(); ++i)
        if (a[i].size() != b[i].size() ||
            (!a[i].empty() && std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0))
          return false;
      return true;
    };
    return weights == o.weights && bits_equal(masters, o.masters) && bits_equal(state, o.state) &&
           step_count == o.step_count;
  }
};

inline Snapshot snapshot(const Optimizer& opt, const HostTensors& weights) {
  Snapshot s;
  s.weights = weights.snapshot();
  for (std::size_t i = 0; i < opt.num_params(); ++i) {
    const auto m = opt.master(i);
    s.masters.emplace_back(m.begin(), m.end());
    for (std::string_view name : opt.state_names()) {
      const auto st = opt.state(i, name);
      s.state.emplace_back(st.begin(), st.end());
    }
  }
  s.step_count = opt.step_count();
  return s;
}

}  // namespace stepfuse::ref
