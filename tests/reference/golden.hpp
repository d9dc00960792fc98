// Golden traces made by PyTorch itself (tests/golden/make_golden.py, make_golden_scaler.py):
// reading them and comparing what stepfuse computes with them, step by step. Used by
// tests/golden_test.cpp and tests/grad_scaler_golden_test.cpp (which link nlohmann_json).
//
// Tolerance (docs/architecture.md §8: fp32 paths within 1e-5 relative of the reference per step).
// An element passes when |got - want| <= 1e-5 * |want| + atol, where atol is an absolute
// floor tied to the magnitude of the tensor: atol = 1e-6 * max(max|want| over the tensor, 1e-3).
// Why a floor at all: torch and stepfuse legitimately round differently (torch multiplies
// g * (1/S) and then by the clip coefficient; stepfuse may multiply once by clip/S; torch's
// CPU kernels may contract multiply-adds into FMAs; bias corrections and the clip
// coefficient are computed in different precisions). Those are ulp-level differences in
// the operands, and when an update cancels (a parameter or a momentum crossing zero, a
// centered RMSprop variance), an ulp of the operands is a large *relative* error of a
// small result. The operands of every update are of the order of the largest element of
// the same tensor (parameters: the previous parameters; moments: the previous moments and
// the gradients feeding them), so an ulp of the operands is ~6e-8 * max|tensor|; the
// floor allows ~16 of those, i.e. a few roundings per step accumulated over a trace's
// 6-7 steps, so the library's state is never re-seeded from the trace. (The 1e-3 keeps
// the floor from vanishing for a tensor of tiny values.) Observed: at most ~0.16 of the
// allowed error (a float64 replay of the traces is within ~0.1 of it: torch's own fp32
// rounding is of the same size), while a 0.1% change of lr, +1e-4 on beta2 or alpha, or
// +0.001 on dampening already fails.
//
// The parameters are also checked by the change each step made (see expect_update_close),
// which sees update errors far below 1e-5 * |param| (e.g. AdamW's default decay).
//
// Skipped steps (inf/NaN in the scaled gradients) must leave the parameters and the state
// bit-for-bit as they were (expect_unchanged).
//
// load_params, load_options, expect_state_names and TraceReplay::start stop with a fatal failure (ASSERT_*) on
// a trace the test cannot replay: call them through ASSERT_NO_FATAL_FAILURE.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "stepfuse/stepfuse.hpp"

namespace stepfuse::ref::golden {

namespace fs = std::filesystem;
using json = nlohmann::json;

inline constexpr double kRtol = 1e-5;        // docs/architecture.md §8, per step
inline constexpr double kAtolFactor = 1e-6;  // times max(max|tensor|, kAtolMinScale)
inline constexpr double kAtolMinScale = 1e-3;
inline constexpr double kNormRtol = 1e-5;

// The stems of the *.json traces in `dir`, sorted.
inline std::vector<std::string> trace_names(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.is_regular_file() && entry.path().extension() == ".json")
      names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

inline json load_trace(const fs::path& dir, const std::string& name) {
  std::ifstream in(dir / (name + ".json"));
  if (!in) throw std::runtime_error("cannot open trace " + name);
  return json::parse(in);
}

// Trace floats: numbers (fp32 values written so that float(double(text)) is exact) or the
// strings "inf", "-inf", "nan".
inline float to_f32(const json& v) {
  if (v.is_string()) {
    const auto s = v.get<std::string>();
    if (s == "inf") return std::numeric_limits<float>::infinity();
    if (s == "-inf") return -std::numeric_limits<float>::infinity();
    if (s == "nan") return std::numeric_limits<float>::quiet_NaN();
    throw std::runtime_error("bad float in trace: " + s);
  }
  return static_cast<float>(v.get<double>());
}

inline std::vector<float> to_vec(const json& arr) {
  std::vector<float> out;
  out.reserve(arr.size());
  for (const auto& v : arr) out.push_back(to_f32(v));
  return out;
}

// torch.optim constructor arguments -> stepfuse::optim config. Every key in the trace must
// be understood (a hyperparameter silently ignored would make the comparison meaningless);
// absent keys keep the defaults, which are PyTorch's.
inline stepfuse::OptimizerConfig make_config(const json& trace) {
  const std::string kind = trace.at("optimizer").get<std::string>();
  const json& hp = trace.at("hyperparameters");
  std::set<std::string> used;
  auto num = [&](const char* key, double& field) {
    if (hp.contains(key)) field = hp.at(key).get<double>();
    used.insert(key);
  };
  auto flag = [&](const char* key, bool& field) {
    if (hp.contains(key)) field = hp.at(key).get<bool>();
    used.insert(key);
  };
  // A pair of PyTorch's ("betas", Rprop's "etas" and "step_sizes"): two stepfuse fields.
  auto pair = [&](const char* key, double& first, double& second) {
    if (hp.contains(key)) {
      first = hp.at(key).at(0).get<double>();
      second = hp.at(key).at(1).get<double>();
    }
    used.insert(key);
  };
  auto betas = [&](double& b1, double& b2) { pair("betas", b1, b2); };
  stepfuse::OptimizerConfig config;
  if (kind == "SGD") {
    stepfuse::optim::SGD c;
    num("lr", c.lr), num("momentum", c.momentum), num("dampening", c.dampening);
    num("weight_decay", c.weight_decay), flag("nesterov", c.nesterov), flag("maximize", c.maximize);
    config = c;
  } else if (kind == "Adam" || kind == "AdamW") {
    auto fill = [&](auto c) {
      num("lr", c.lr), betas(c.beta1, c.beta2), num("eps", c.eps);
      num("weight_decay", c.weight_decay), flag("amsgrad", c.amsgrad), flag("maximize", c.maximize);
      config = c;
    };
    if (kind == "Adam") fill(stepfuse::optim::Adam{});
    else fill(stepfuse::optim::AdamW{});
  } else if (kind == "Adagrad") {
    stepfuse::optim::Adagrad c;
    num("lr", c.lr), num("lr_decay", c.lr_decay), num("weight_decay", c.weight_decay);
    num("initial_accumulator_value", c.initial_accumulator_value), num("eps", c.eps);
    flag("maximize", c.maximize);
    config = c;
  } else if (kind == "RMSprop") {
    stepfuse::optim::RMSprop c;
    num("lr", c.lr), num("alpha", c.alpha), num("eps", c.eps), num("weight_decay", c.weight_decay);
    num("momentum", c.momentum), flag("centered", c.centered), flag("maximize", c.maximize);
    config = c;
  } else if (kind == "NAdam") {
    stepfuse::optim::NAdam c;
    num("lr", c.lr), betas(c.beta1, c.beta2), num("eps", c.eps), num("weight_decay", c.weight_decay);
    num("momentum_decay", c.momentum_decay), flag("decoupled_weight_decay", c.decoupled_weight_decay);
    flag("maximize", c.maximize);
    config = c;
  } else if (kind == "RAdam") {
    stepfuse::optim::RAdam c;
    num("lr", c.lr), betas(c.beta1, c.beta2), num("eps", c.eps), num("weight_decay", c.weight_decay);
    flag("decoupled_weight_decay", c.decoupled_weight_decay), flag("maximize", c.maximize);
    config = c;
  } else if (kind == "Adamax") {
    stepfuse::optim::Adamax c;
    num("lr", c.lr), betas(c.beta1, c.beta2), num("eps", c.eps), num("weight_decay", c.weight_decay);
    flag("maximize", c.maximize);
    config = c;
  } else if (kind == "Adadelta") {
    stepfuse::optim::Adadelta c;
    num("lr", c.lr), num("rho", c.rho), num("eps", c.eps), num("weight_decay", c.weight_decay);
    flag("maximize", c.maximize);
    config = c;
  } else if (kind == "Rprop") {
    stepfuse::optim::Rprop c;
    num("lr", c.lr), pair("etas", c.eta_minus, c.eta_plus), pair("step_sizes", c.step_size_min, c.step_size_max);
    flag("maximize", c.maximize);
    config = c;
  } else if (kind == "ASGD") {
    stepfuse::optim::ASGD c;
    num("lr", c.lr), num("lambd", c.lambd), num("alpha", c.alpha), num("t0", c.t0);
    num("weight_decay", c.weight_decay), flag("maximize", c.maximize);
    config = c;
  } else {
    throw std::runtime_error("unknown optimizer in trace: " + kind);
  }
  for (auto it = hp.begin(); it != hp.end(); ++it) {
    if (!used.count(it.key()))
      throw std::runtime_error("trace hyperparameter not understood by the test: " + it.key());
  }
  return config;
}

// A trace's parameters in caller-owned fp32 buffers: the weights from "initial_params"
// (one tensor per entry of "shapes"), zero gradients, and the stepfuse::Param list over them.
struct TraceParams {
  std::vector<std::vector<float>> weights;
  std::vector<std::vector<float>> grads;
  std::vector<stepfuse::Param> params;
};

inline void load_params(const json& trace, TraceParams& out) {
  const auto shapes = trace.at("shapes").get<std::vector<std::int64_t>>();
  const std::size_t n = shapes.size();
  out.weights.assign(n, {});
  out.grads.assign(n, {});
  out.params.clear();
  const json& init = trace.at("initial_params");
  ASSERT_EQ(init.size(), n);
  for (std::size_t i = 0; i < n; ++i) {
    out.weights[i] = to_vec(init.at(i));
    ASSERT_EQ(static_cast<std::int64_t>(out.weights[i].size()), shapes[i]);
    out.grads[i].assign(out.weights[i].size(), 0.0f);
    out.params.push_back({{out.weights[i].data(), shapes[i], stepfuse::DType::f32},
                          {out.grads[i].data(), shapes[i], stepfuse::DType::f32}});
  }
}

// The trace's clipping ("max_grad_norm": a number or null, "norm_type": a number or "inf")
// with the given fusion mode.
inline void load_options(const json& trace, stepfuse::Fusion fusion, stepfuse::OptimizerOptions& out) {
  out.fusion = fusion;
  if (!trace.at("max_grad_norm").is_null()) out.max_grad_norm = trace.at("max_grad_norm").get<double>();
  const json& norm_type = trace.at("norm_type");
  ASSERT_TRUE(norm_type.is_string() ? norm_type.get<std::string>() == "inf" : true);
  out.norm_type = norm_type.is_string() ? INFINITY : norm_type.get<double>();
}

// The library keeps every state tensor the trace has.
inline void expect_state_names(const stepfuse::Optimizer& opt, const std::vector<std::string>& state_names) {
  const auto names = opt.state_names();
  const std::set<std::string_view> have(names.begin(), names.end());
  for (const auto& s : state_names)
    ASSERT_TRUE(have.count(s)) << "the library keeps no state named \"" << s << "\"";
}

// The elements of one tensor checked against their tolerance: the worst error as a
// fraction of the allowed error, and one failure message listing the first 8 that fail.
class ElementTally {
 public:
  // ratio: error / allowed (inf for a value that is not finite); describe(os) writes the
  // element's line of the message.
  template <class Describe>
  void add(double ratio, Describe&& describe) {
    worst_ = std::max(worst_, ratio);
    if (ratio <= 1.0) return;  // (NaN fails)
    if (bad_ < 8) {
      msg_.precision(9);
      describe(msg_);
    }
    ++bad_;
  }
  // One expectation for the tensor (`what`, n elements); returns the worst ratio.
  double finish(const std::string& what, std::size_t n) const {
    EXPECT_EQ(bad_, 0u) << what << ": " << bad_ << " of " << n << " elements out of tolerance" << msg_.str();
    return worst_;
  }

 private:
  double worst_ = 0;
  std::size_t bad_ = 0;
  std::ostringstream msg_;
};

// Compares one tensor with the trace; one failure message listing the worst elements.
// Returns the worst error as a fraction of the allowed error (for the summary line).
inline double expect_close(const std::string& what, std::span<const float> got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size()) << what;
  if (got.size() != want.size()) return INFINITY;
  double scale = kAtolMinScale;
  for (float w : want) scale = std::max(scale, std::fabs(static_cast<double>(w)));
  const double atol = kAtolFactor * scale;
  ElementTally tally;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = got[i], w = want[i];
    const double allowed = kRtol * std::fabs(w) + atol;
    const double err = std::fabs(g - w);
    tally.add(std::isfinite(g) ? err / allowed : INFINITY, [&](std::ostream& os) {
      os << "\n  [" << i << "] got " << g << " want " << w << " (|diff| " << err << ", allowed " << allowed << ")";
    });
  }
  return tally.finish(what, want.size());
}

// A sharper check of the parameters: the change one step made (after - before, exact in
// double) against the change torch made, each from its own "before". Comparing values alone
// cannot see an update error smaller than 1e-5 * |param| (with lr = 1e-3 that is 1% of an
// Adam update, and all of AdamW's default decay p *= 1 - 1e-5); comparing updates sees it.
// Legitimate differences: the update is computed with different roundings (~1e-6 relative,
// the state having drifted by a few ulps), and each "after" is rounded to the parameter's
// ulp. Allowed: kUpdateRtol * |torch's change| + 4 * FLT_EPSILON * max(|before|, |after|)
// (>= 2 ulps of the parameter, per element).
inline constexpr double kUpdateRtol = 1e-4;

inline double expect_update_close(const std::string& what, const std::vector<float>& got_before,
                                  std::span<const float> got_after, const std::vector<float>& want_before,
                                  const std::vector<float>& want_after) {
  EXPECT_EQ(got_after.size(), want_after.size()) << what;
  if (got_after.size() != want_after.size()) return INFINITY;
  constexpr double kEps = std::numeric_limits<float>::epsilon();
  ElementTally tally;
  for (std::size_t i = 0; i < want_after.size(); ++i) {
    const double got = double(got_after[i]) - double(got_before[i]);
    const double want = double(want_after[i]) - double(want_before[i]);
    const double mag = std::max(std::fabs(double(want_before[i])), std::fabs(double(want_after[i])));
    const double allowed = kUpdateRtol * std::fabs(want) + 4 * kEps * mag;
    const double err = std::fabs(got - want);
    tally.add(std::isfinite(got) ? err / allowed : INFINITY, [&](std::ostream& os) {
      os << "\n  [" << i << "] changed by " << got << ", torch by " << want << " (|diff| " << err << ", allowed "
         << allowed << ")";
    });
  }
  return tally.finish(what, want_after.size());
}

inline bool bitwise_equal(std::span<const float> a, const std::vector<float>& b) {
  return a.size() == b.size() && (b.empty() || std::memcmp(a.data(), b.data(), b.size() * sizeof(float)) == 0);
}

// Copies of the optimizer's state tensors, by name, then by parameter.
using StateCopy = std::map<std::string, std::vector<std::vector<float>>>;

inline StateCopy copy_state(const stepfuse::Optimizer& opt, const std::vector<std::string>& state_names) {
  StateCopy copy;
  for (const auto& s : state_names)
    for (std::size_t i = 0; i < opt.num_params(); ++i) {
      const auto st = opt.state(i, s);
      copy[s].emplace_back(st.begin(), st.end());
    }
  return copy;
}

// A skipped step: the parameters and every state tensor bit for bit as they were before it.
inline void expect_unchanged(const stepfuse::Optimizer& opt, const std::vector<std::vector<float>>& weights,
                             const std::vector<std::vector<float>>& weights_before,
                             const std::vector<std::string>& state_names, const StateCopy& state_before) {
  for (std::size_t i = 0; i < weights.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(weights[i], weights_before[i])) << "skipped step wrote param " << i;
    for (const auto& s : state_names)
      EXPECT_TRUE(bitwise_equal(opt.state(i, s), state_before.at(s)[i]))
          << "skipped step wrote state " << s << "[" << i << "]";
  }
}

// The clip coefficient of an applied step: the trace's "clip_coef" (within kNormRtol), or
// exactly 1 where the trace does not clip. `what` names the value in the failure message.
inline void expect_clip_coef(const json& step, double clip_coef, const std::string& what) {
  if (step.contains("clip_coef")) {
    const double want_coef = step.at("clip_coef").get<double>();
    EXPECT_NEAR(clip_coef, want_coef, kNormRtol * want_coef) << what;
  } else {
    EXPECT_EQ(clip_coef, 1.0) << "clip_coef without clipping";
  }
}

// The worst errors over a trace, as fractions of the allowed error.
struct WorstError {
  double values = 0;   // expect_close: parameters and state
  double updates = 0;  // expect_update_close: the change of the parameters
};

// An applied step: the parameters (values, and the change from weights_before against
// torch's change from torch_before, which then becomes the step's "params") and every
// state tensor against the trace's step.
inline void expect_step_matches(const json& step, const stepfuse::Optimizer& opt,
                                const std::vector<std::vector<float>>& weights,
                                const std::vector<std::vector<float>>& weights_before,
                                std::vector<std::vector<float>>& torch_before,
                                const std::vector<std::string>& state_names, WorstError& worst) {
  const std::size_t n = weights.size();
  const json& want_params = step.at("params");
  for (std::size_t i = 0; i < n; ++i) {
    const auto want = to_vec(want_params.at(i));
    worst.values = std::max(worst.values, expect_close("param " + std::to_string(i), weights[i], want));
    worst.updates = std::max(worst.updates, expect_update_close("update of param " + std::to_string(i),
                                                                weights_before[i], weights[i], torch_before[i], want));
    torch_before[i] = want;
  }
  const json& want_state = step.at("state");
  for (const auto& s : state_names)
    for (std::size_t i = 0; i < n; ++i)
      worst.values = std::max(worst.values, expect_close(s + "[" + std::to_string(i) + "]", opt.state(i, s),
                                                         to_vec(want_state.at(s).at(i))));
}

// What both golden tests start a replay with, as their fixture (Case: the test's
// parameter): the trace, its state names, its parameters in caller-owned fp32 buffers,
// the options and the optimizer over them.
template <class Case>
class TraceReplay : public testing::TestWithParam<Case> {
 protected:
  // Loads trace `name` from `dir` (format 1) and builds the optimizer with `fusion`. Stops
  // with a fatal failure on a trace the test cannot replay: call it through
  // ASSERT_NO_FATAL_FAILURE.
  void start(const fs::path& dir, const std::string& name, stepfuse::Fusion fusion) {
    trace = load_trace(dir, name);
    ASSERT_EQ(trace.at("format").get<int>(), 1);
    state_names = trace.at("state_names").get<std::vector<std::string>>();
    ASSERT_NO_FATAL_FAILURE(load_params(trace, p));
    n = p.weights.size();
    ASSERT_NO_FATAL_FAILURE(load_options(trace, fusion, options));
    optimizer.emplace(make_config(trace), p.params, options);
    ASSERT_NO_FATAL_FAILURE(expect_state_names(*optimizer, state_names));
  }

  json trace;
  std::vector<std::string> state_names;
  TraceParams p;
  std::vector<std::vector<float>>& weights = p.weights;
  std::vector<std::vector<float>>& grads = p.grads;
  std::size_t n = 0;  // tensors
  stepfuse::OptimizerOptions options;
  std::optional<stepfuse::Optimizer> optimizer;
};

// Records the margins as test properties and prints them with the case's label.
inline void record_worst(const std::string& label, const WorstError& worst) {
  testing::Test::RecordProperty("worst_error_over_tolerance", std::to_string(worst.values));
  testing::Test::RecordProperty("worst_update_error_over_tolerance", std::to_string(worst.updates));
  std::printf("  %s: worst error %.3g of the tolerance (values), %.3g (updates)\n", label.c_str(), worst.values,
              worst.updates);
}

}  // namespace stepfuse::ref::golden
