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
//     (the same constants and comparison helpers, from tests/reference/golden.hpp, which
//     says why they are what they are);
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
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "reference/golden.hpp"
#include "stepfuse/stepfuse.hpp"

namespace {

using namespace stepfuse::ref::golden;
using stepfuse::Fusion;

fs::path traces_dir() { return fs::path(STEPFUSE_SOURCE_DIR) / "tests" / "golden" / "scaler_traces"; }

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
  for (const auto& name : trace_names(traces_dir()))
    for (Path path : {Path::step, Path::unscale_step})
      for (Fusion fusion : {Fusion::fused, Fusion::unfused, Fusion::interpreted})
        cases.push_back({name, path, fusion});
  return cases;
}

class GradScalerGolden : public TraceReplay<ScalerCase> {};

TEST_P(GradScalerGolden, MatchesTorchAmpGradScaler) {
  const ScalerCase& param = GetParam();
  ASSERT_NO_FATAL_FAILURE(start(traces_dir(), param.trace, param.fusion));
  stepfuse::Optimizer& opt = *optimizer;

  const json& sc = trace.at("scaler");
  stepfuse::GradScaler scaler("cpu", sc.at("init_scale").get<double>(), sc.at("growth_factor").get<double>(),
                              sc.at("backoff_factor").get<double>(),
                              sc.at("growth_interval").get<std::int64_t>());

  WorstError worst;
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
    const StateCopy state_before = copy_state(opt, state_names);

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
      expect_unchanged(opt, weights, weights_before, state_names, state_before);
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
    expect_clip_coef(step, r.clip_coef, "last_step_result().clip_coef");

    expect_step_matches(step, opt, weights, weights_before, torch_before, state_names, worst);
  }
  record_worst(case_label(param), worst);
}

INSTANTIATE_TEST_SUITE_P(TorchAmp, GradScalerGolden, testing::ValuesIn(all_cases()), case_name);

TEST(GradScalerGoldenTraces, Present) {
  // Every optimizer torch has, and no clipping / L2 / inf-norm clipping, are covered, so a
  // lost scaler_traces/ directory (or a trimmed one) cannot pass silently.
  std::set<std::string> kinds, clips;
  for (const auto& name : trace_names(traces_dir())) {
    const json t = load_trace(traces_dir(), name);
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
