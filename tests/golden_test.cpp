// Replays the golden traces made by PyTorch itself (tests/golden/make_golden.py) through
// stepfuse::Optimizer::step_scaled and compares every step with what torch computed:
// the skip decision, the gradient norm, the clip coefficient, the parameters and every
// optimizer state tensor. One test per trace and fusion mode (fused, unfused).
//
// Tolerance (docs/architecture.md §8: fp32 paths within 1e-5 relative of the reference per step, with an
// absolute floor tied to the magnitude of each tensor), the check of the parameters by the
// change each step made, and why they are what they are: see tests/reference/golden.hpp,
// which holds the comparison helpers shared with grad_scaler_golden_test.cpp.
//
// Skipped steps (inf/NaN in the scaled gradients) must leave the parameters and the state
// bit-for-bit as they were, and not advance step_count.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "reference/golden.hpp"
#include "stepfuse/stepfuse.hpp"

namespace {

using namespace stepfuse::ref::golden;
using stepfuse::Fusion;

fs::path traces_dir() { return fs::path(STEPFUSE_SOURCE_DIR) / "tests" / "golden" / "traces"; }

struct GoldenCase {
  std::string trace;
  Fusion fusion;
};

void PrintTo(const GoldenCase& c, std::ostream* os) {
  *os << c.trace << (c.fusion == Fusion::fused ? " (fused)" : " (unfused)");
}

std::string case_name(const testing::TestParamInfo<GoldenCase>& info) {
  return info.param.trace + (info.param.fusion == Fusion::fused ? "_fused" : "_unfused");
}

std::vector<GoldenCase> all_cases() {
  std::vector<GoldenCase> cases;
  for (const auto& name : trace_names(traces_dir())) {
    cases.push_back({name, Fusion::fused});
    cases.push_back({name, Fusion::unfused});
  }
  return cases;
}

class GoldenTrace : public TraceReplay<GoldenCase> {};

TEST_P(GoldenTrace, MatchesPyTorch) {
  ASSERT_NO_FATAL_FAILURE(start(traces_dir(), GetParam().trace, GetParam().fusion));
  const double loss_scale = trace.at("loss_scale").get<double>();
  stepfuse::Optimizer& opt = *optimizer;

  WorstError worst;
  std::vector<std::vector<float>> torch_before = weights;  // torch's params before each step
  const json& steps = trace.at("steps");
  for (std::size_t k = 0; k < steps.size(); ++k) {
    SCOPED_TRACE("step " + std::to_string(k + 1));
    const json& step = steps.at(k);
    const json& g = step.at("grads");
    ASSERT_EQ(g.size(), n);
    for (std::size_t i = 0; i < n; ++i) {
      const auto v = to_vec(g.at(i));
      ASSERT_EQ(v.size(), grads[i].size());
      std::copy(v.begin(), v.end(), grads[i].begin());  // fresh: unfused unscales in place
    }

    // What the library holds before the step, for the skipped-step check.
    const auto weights_before = weights;
    const StateCopy state_before = copy_state(opt, state_names);

    const stepfuse::StepResult r = opt.step_scaled(loss_scale);
    const bool skipped = step.at("skipped").get<bool>();
    EXPECT_EQ(opt.step_count(), step.at("step_count").get<std::int64_t>());

    if (skipped) {
      EXPECT_FALSE(r.applied);
      EXPECT_TRUE(r.found_inf);
      expect_unchanged(opt, weights, weights_before, state_names, state_before);
      continue;
    }

    EXPECT_TRUE(r.applied);
    EXPECT_FALSE(r.found_inf);
    const double want_norm = step.at("grad_norm").get<double>();
    // The unfused baseline does what eager PyTorch does: without clipping there is no
    // norm pass, and the norm is documented as NaN ("not computed"). Everywhere else the
    // step computes it (the fused reduce pass always does).
    const bool norm_optional = options.fusion == Fusion::unfused && !options.max_grad_norm;
    if (!(norm_optional && std::isnan(r.grad_norm))) {
      EXPECT_NEAR(r.grad_norm, want_norm, kNormRtol * want_norm) << "grad_norm";
      EXPECT_NEAR(opt.last_grad_norm(), want_norm, kNormRtol * want_norm) << "last_grad_norm()";
    }
    expect_clip_coef(step, r.clip_coef, "clip_coef");

    expect_step_matches(step, opt, weights, weights_before, torch_before, state_names, worst);
  }
  record_worst(case_name({GetParam(), 0}), worst);
}

INSTANTIATE_TEST_SUITE_P(PyTorch, GoldenTrace, testing::ValuesIn(all_cases()), case_name);

TEST(GoldenTraces, Present) {
  // Every optimizer that torch has is covered, so a lost traces/ directory cannot pass silently.
  std::set<std::string> kinds;
  for (const auto& name : trace_names(traces_dir())) kinds.insert(load_trace(traces_dir(), name).at("optimizer"));
  EXPECT_EQ(kinds, (std::set<std::string>{"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax",
                                           "Adadelta", "Rprop", "ASGD"}))
      << "traces in " << traces_dir();
}

}  // namespace
