// Replays the golden GradScaler traces made by torch.amp.GradScaler(device="cpu") itself
// (tests/golden/make_golden_scaler.py; the format is described there) through
// stepfuse::GradScaler and stepfuse::Optimizer, and compares every iteration with torch:
//
//   - the scale before the step (get_scale()), exactly;
//   - the skip decision: step()'s return value, last_step_result().applied / found_inf;
//   - the scaler's state_dict() after update(), all five entries, exactly;
//   - the optimizer's step_count();
//   - the gradient norm and clip coefficient, the parameters (values and per-step change)
//     and every optimizer state tensor, within the tolerance of tests/golden_test.cpp
//     (the constants and the comparison helpers below are the same; see the comment at the
//     top of that file for why they are what they are);
//   - on skipped steps: parameters and state bit for bit as they were.
//
// One test per trace, GradScaler path and fusion mode:
//   step          scaler.step(opt) alone: the fused unscale + check + clip + update;
//                 the caller's (scaled) gradients must be left bit for bit as they were.
//   unscale_step  scaler.unscale_(opt), then scaler.step(opt): unscale_ must leave
//                 g * fp32(1 / double(S)) in the gradient buffers, bit for bit, as
//                 torch's unscale_ does (make_golden_scaler.py asserts that of torch).
// × Fusion::fused, Fusion::unfused, Fusion::interpreted. Every iteration ends with
// scaler.update().

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
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "stepfuse/stepfuse.hpp"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using stepfuse::Fusion;

// As in tests/golden_test.cpp.
constexpr double kRtol = 1e-5;        // DESIGN §5, per step
constexpr double kAtolFactor = 1e-6;  // times max(max|tensor|, kAtolMinScale)
constexpr double kAtolMinScale = 1e-3;
constexpr double kNormRtol = 1e-5;
constexpr double kUpdateRtol = 1e-4;

fs::path traces_dir() { return fs::path(STEPFUSE_SOURCE_DIR) / "tests" / "golden" / "scaler_traces"; }

std::vector<std::string> trace_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(traces_dir(), ec)) {
    if (entry.is_regular_file() && entry.path().extension() == ".json")
      names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

json load_trace(const std::string& name) {
  std::ifstream in(traces_dir() / (name + ".json"));
  if (!in) throw std::runtime_error("cannot open trace " + name);
  return json::parse(in);
}

// Trace floats: numbers (fp32 values written so that float(double(text)) is exact) or the
// strings "inf", "-inf", "nan".
float to_f32(const json& v) {
  if (v.is_string()) {
    const auto s = v.get<std::string>();
    if (s == "inf") return std::numeric_limits<float>::infinity();
    if (s == "-inf") return -std::numeric_limits<float>::infinity();
    if (s == "nan") return std::numeric_limits<float>::quiet_NaN();
    throw std::runtime_error("bad float in trace: " + s);
  }
  return static_cast<float>(v.get<double>());
}

std::vector<float> to_vec(const json& arr) {
  std::vector<float> out;
  out.reserve(arr.size());
  for (const auto& v : arr) out.push_back(to_f32(v));
  return out;
}

// torch.optim constructor arguments -> stepfuse::optim config. Every key in the trace must
// be understood; absent keys keep the defaults, which are PyTorch's.
stepfuse::OptimizerConfig make_config(const json& trace) {
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
  auto betas = [&](double& b1, double& b2) {
    if (hp.contains("betas")) {
      b1 = hp.at("betas").at(0).get<double>();
      b2 = hp.at("betas").at(1).get<double>();
    }
    used.insert("betas");
  };
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
  } else {
    throw std::runtime_error("unknown optimizer in trace: " + kind);
  }
  for (auto it = hp.begin(); it != hp.end(); ++it) {
    if (!used.count(it.key()))
      throw std::runtime_error("trace hyperparameter not understood by the test: " + it.key());
  }
  return config;
}

// |got - want| <= kRtol * |want| + kAtolFactor * max(max|want|, kAtolMinScale), per element.
// Returns the worst error as a fraction of the allowed error.
double expect_close(const std::string& what, std::span<const float> got,
                    const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size()) << what;
  if (got.size() != want.size()) return INFINITY;
  double scale = kAtolMinScale;
  for (float w : want) scale = std::max(scale, std::fabs(static_cast<double>(w)));
  const double atol = kAtolFactor * scale;
  double worst = 0;
  std::size_t bad = 0;
  std::ostringstream msg;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = got[i], w = want[i];
    const double allowed = kRtol * std::fabs(w) + atol;
    const double err = std::fabs(g - w);
    const double ratio = std::isfinite(g) ? err / allowed : INFINITY;
    worst = std::max(worst, ratio);
    if (!(ratio <= 1.0)) {
      if (bad < 8) {
        msg.precision(9);
        msg << "\n  [" << i << "] got " << g << " want " << w << " (|diff| " << err << ", allowed "
            << allowed << ")";
      }
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << want.size()
                     << " elements out of tolerance" << msg.str();
  return worst;
}

// The change one step made to the parameters (after - before, each side from its own
// "before") against torch's change: sees update errors far below 1e-5 * |param|.
double expect_update_close(const std::string& what, const std::vector<float>& got_before,
                           std::span<const float> got_after, const std::vector<float>& want_before,
                           const std::vector<float>& want_after) {
  EXPECT_EQ(got_after.size(), want_after.size()) << what;
  if (got_after.size() != want_after.size()) return INFINITY;
  constexpr double kEps = std::numeric_limits<float>::epsilon();
  double worst = 0;
  std::size_t bad = 0;
  std::ostringstream msg;
  for (std::size_t i = 0; i < want_after.size(); ++i) {
    const double got = double(got_after[i]) - double(got_before[i]);
    const double want = double(want_after[i]) - double(want_before[i]);
    const double mag = std::max(std::fabs(double(want_before[i])), std::fabs(double(want_after[i])));
    const double allowed = kUpdateRtol * std::fabs(want) + 4 * kEps * mag;
    const double err = std::fabs(got - want);
    const double ratio = std::isfinite(got) ? err / allowed : INFINITY;
    worst = std::max(worst, ratio);
    if (!(ratio <= 1.0)) {
      if (bad < 8) {
        msg.precision(9);
        msg << "\n  [" << i << "] changed by " << got << ", torch by " << want << " (|diff| " << err
            << ", allowed " << allowed << ")";
      }
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << want_after.size()
                     << " elements out of tolerance" << msg.str();
  return worst;
}

bool bitwise_equal(std::span<const float> a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), b.size() * sizeof(float)) == 0;
}

// Index of the first element whose bits differ, or -1. With nan_equal, any NaN matches any
// NaN (the payload of a computed NaN is not part of the contract).
std::int64_t first_bit_difference(std::span<const float> a, const std::vector<float>& b,
                                  bool nan_equal = false) {
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (nan_equal && std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return static_cast<std::int64_t>(i);
  }
  return a.size() == b.size() ? -1 : static_cast<std::int64_t>(std::min(a.size(), b.size()));
}

enum class Path { step, unscale_step };

struct ScalerCase {
  std::string trace;
  Path path;
  Fusion fusion;
};

const char* path_name(Path p) { return p == Path::step ? "step" : "unscale_step"; }
const char* fusion_name(Fusion f) {
  return f == Fusion::fused ? "fused" : f == Fusion::unfused ? "unfused" : "interpreted";
}

std::string case_label(const ScalerCase& c) {
  return c.trace + "_" + path_name(c.path) + "_" + fusion_name(c.fusion);
}

void PrintTo(const ScalerCase& c, std::ostream* os) { *os << case_label(c); }

std::string case_name(const testing::TestParamInfo<ScalerCase>& info) { return case_label(info.param); }

std::vector<ScalerCase> all_cases() {
  std::vector<ScalerCase> cases;
  for (const auto& name : trace_names())
    for (Path path : {Path::step, Path::unscale_step})
      for (Fusion fusion : {Fusion::fused, Fusion::unfused, Fusion::interpreted})
        cases.push_back({name, path, fusion});
  return cases;
}

class GradScalerGolden : public testing::TestWithParam<ScalerCase> {};

TEST_P(GradScalerGolden, MatchesTorchAmpGradScaler) {
  const ScalerCase& param = GetParam();
  const json trace = load_trace(param.trace);
  ASSERT_EQ(trace.at("format").get<int>(), 1);

  const auto shapes = trace.at("shapes").get<std::vector<std::int64_t>>();
  const auto state_names = trace.at("state_names").get<std::vector<std::string>>();
  const std::size_t n = shapes.size();

  std::vector<std::vector<float>> weights(n), grads(n);
  const json& init = trace.at("initial_params");
  ASSERT_EQ(init.size(), n);
  std::vector<stepfuse::Param> params;
  for (std::size_t i = 0; i < n; ++i) {
    weights[i] = to_vec(init.at(i));
    ASSERT_EQ(static_cast<std::int64_t>(weights[i].size()), shapes[i]);
    grads[i].assign(weights[i].size(), 0.0f);
    params.push_back({{weights[i].data(), shapes[i], stepfuse::DType::f32},
                      {grads[i].data(), shapes[i], stepfuse::DType::f32}});
  }

  stepfuse::OptimizerOptions options;
  options.fusion = param.fusion;
  if (!trace.at("max_grad_norm").is_null())
    options.max_grad_norm = trace.at("max_grad_norm").get<double>();
  const json& norm_type = trace.at("norm_type");
  ASSERT_TRUE(norm_type.is_string() ? norm_type.get<std::string>() == "inf" : true);
  options.norm_type = norm_type.is_string() ? INFINITY : norm_type.get<double>();

  stepfuse::Optimizer opt(make_config(trace), params, options);
  {
    const auto names = opt.state_names();
    const std::set<std::string_view> have(names.begin(), names.end());
    for (const auto& s : state_names)
      ASSERT_TRUE(have.count(s)) << "the library keeps no state named \"" << s << "\"";
  }

  const json& sc = trace.at("scaler");
  stepfuse::GradScaler scaler("cpu", sc.at("init_scale").get<double>(), sc.at("growth_factor").get<double>(),
                              sc.at("backoff_factor").get<double>(),
                              sc.at("growth_interval").get<std::int64_t>());

  double worst = 0, worst_update = 0;
  std::vector<std::vector<float>> torch_before = weights;  // torch's params before each step
  const json& steps = trace.at("steps");
  for (std::size_t k = 0; k < steps.size(); ++k) {
    SCOPED_TRACE("step " + std::to_string(k + 1) + " of " + std::to_string(steps.size()));
    const json& step = steps.at(k);

    // The scale this iteration's gradients were multiplied by. Everything after depends
    // on it, so a mismatch ends the test.
    const double want_scale = step.at("scale").get<double>();
    ASSERT_EQ(scaler.get_scale(), want_scale) << "get_scale() before the step";

    const json& g = step.at("grads");
    ASSERT_EQ(g.size(), n);
    std::vector<std::vector<float>> scaled(n);
    for (std::size_t i = 0; i < n; ++i) {
      scaled[i] = to_vec(g.at(i));
      ASSERT_EQ(scaled[i].size(), grads[i].size());
      std::copy(scaled[i].begin(), scaled[i].end(), grads[i].begin());
    }

    const auto weights_before = weights;
    std::map<std::string, std::vector<std::vector<float>>> state_before;
    for (const auto& s : state_names)
      for (std::size_t i = 0; i < n; ++i) {
        const auto st = opt.state(i, s);
        state_before[s].emplace_back(st.begin(), st.end());
      }

    if (param.path == Path::unscale_step) {
      scaler.unscale_(opt);
      // torch: grad * fp32(1 / double(S)), in place, inf/NaN included.
      const float inv = static_cast<float>(1.0 / want_scale);
      for (std::size_t i = 0; i < n; ++i) {
        std::vector<float> want(scaled[i].size());
        for (std::size_t j = 0; j < want.size(); ++j) want[j] = scaled[i][j] * inv;
        const auto at = first_bit_difference(grads[i], want, /*nan_equal=*/true);
        EXPECT_EQ(at, -1) << "unscale_ left grad " << i << " different from g * fp32(1/S): [" << at
                          << "] got " << (at >= 0 ? grads[i][at] : 0.0f) << " want "
                          << (at >= 0 ? want[at] : 0.0f);
      }
    }

    const bool skipped = step.at("skipped").get<bool>();
    const bool applied = scaler.step(opt);
    const stepfuse::StepResult r = scaler.last_step_result();
    EXPECT_EQ(applied, !skipped) << "step() return value";
    EXPECT_EQ(r.applied, !skipped) << "last_step_result().applied";
    EXPECT_EQ(r.found_inf, skipped) << "last_step_result().found_inf";

    if (param.path == Path::step) {
      for (std::size_t i = 0; i < n; ++i) {
        const auto at = first_bit_difference(grads[i], scaled[i]);
        EXPECT_EQ(at, -1) << "step() wrote the caller's grad " << i << " at [" << at << "]";
      }
    }

    scaler.update();

    // state_dict() after update(): exactly torch's.
    const json& want_sd = step.at("scaler_state");
    const std::map<std::string, double> sd = scaler.state_dict();
    EXPECT_EQ(sd.size(), 5u);
    for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
      const auto it = sd.find(key);
      if (it == sd.end()) {
        ADD_FAILURE() << "state_dict() has no \"" << key << "\"";
        continue;
      }
      EXPECT_EQ(it->second, want_sd.at(key).get<double>()) << "state_dict()[\"" << key << "\"] after update()";
    }
    EXPECT_EQ(scaler.get_scale(), want_sd.at("scale").get<double>()) << "get_scale() after update()";
    EXPECT_EQ(scaler.growth_tracker(), want_sd.at("_growth_tracker").get<std::int64_t>());

    EXPECT_EQ(opt.step_count(), step.at("step_count").get<std::int64_t>()) << "step_count()";

    if (skipped) {
      for (std::size_t i = 0; i < n; ++i) {
        EXPECT_TRUE(bitwise_equal(weights[i], weights_before[i])) << "skipped step wrote param " << i;
        for (const auto& s : state_names)
          EXPECT_TRUE(bitwise_equal(opt.state(i, s), state_before[s][i]))
              << "skipped step wrote state " << s << "[" << i << "]";
      }
      continue;
    }

    // Without clipping the norm is optional (NaN: "not computed") where no reduce pass is
    // needed: the unfused baseline runs none, and after unscale_() the step is a plain step
    // on unscaled gradients (Optimizer::last_grad_norm() documents both).
    const double want_norm = step.at("grad_norm").get<double>();
    const bool norm_optional =
        (param.fusion == Fusion::unfused || param.path == Path::unscale_step) && !options.max_grad_norm;
    if (!(norm_optional && std::isnan(r.grad_norm))) {
      EXPECT_NEAR(r.grad_norm, want_norm, kNormRtol * want_norm) << "last_step_result().grad_norm";
    }
    if (step.contains("clip_coef")) {
      const double want_coef = step.at("clip_coef").get<double>();
      EXPECT_NEAR(r.clip_coef, want_coef, kNormRtol * want_coef) << "last_step_result().clip_coef";
    } else {
      EXPECT_EQ(r.clip_coef, 1.0) << "clip_coef without clipping";
    }

    const json& want_params = step.at("params");
    for (std::size_t i = 0; i < n; ++i) {
      const auto want = to_vec(want_params.at(i));
      worst = std::max(worst, expect_close("param " + std::to_string(i), weights[i], want));
      worst_update = std::max(worst_update, expect_update_close("update of param " + std::to_string(i),
                                                                weights_before[i], weights[i],
                                                                torch_before[i], want));
      torch_before[i] = want;
    }
    const json& want_state = step.at("state");
    for (const auto& s : state_names)
      for (std::size_t i = 0; i < n; ++i)
        worst = std::max(worst, expect_close(s + "[" + std::to_string(i) + "]", opt.state(i, s),
                                             to_vec(want_state.at(s).at(i))));
  }
  RecordProperty("worst_error_over_tolerance", std::to_string(worst));
  RecordProperty("worst_update_error_over_tolerance", std::to_string(worst_update));
  std::printf("  %s: worst error %.3g of the tolerance (values), %.3g (updates)\n",
              case_label(param).c_str(), worst, worst_update);
}

INSTANTIATE_TEST_SUITE_P(TorchAmp, GradScalerGolden, testing::ValuesIn(all_cases()), case_name);

TEST(GradScalerGoldenTraces, Present) {
  // Every optimizer torch has, and no clipping / L2 / inf-norm clipping, are covered, so a
  // lost scaler_traces/ directory (or a trimmed one) cannot pass silently.
  std::set<std::string> kinds, clips;
  for (const auto& name : trace_names()) {
    const json t = load_trace(name);
    kinds.insert(t.at("optimizer").get<std::string>());
    clips.insert(t.at("max_grad_norm").is_null() ? "none"
                 : t.at("norm_type").is_string() ? "inf"
                                                 : "2");
  }
  EXPECT_EQ(kinds, (std::set<std::string>{"SGD", "Adam", "AdamW", "Adagrad", "RMSprop"}))
      << "traces in " << traces_dir();
  EXPECT_EQ(clips, (std::set<std::string>{"none", "2", "inf"})) << "traces in " << traces_dir();
}

}  // namespace
