// Replays the param-group golden traces made by PyTorch itself (tests/golden/group_traces/,
// tests/golden/make_golden.py with torch 2): one torch optimizer over several param groups
// with their own hyperparameters and program variants (AdamW: the matrices with weight decay,
// the 1-D tensors without it and with amsgrad), a per-step lr for each group from an lr
// schedule, and one torch.nn.utils.clip_grad_norm_ over every group's params. Each step sets
// each group's lr (set_lr(g, lr)) as the trace records it, then calls step_scaled, and
// compares the skip decision, the global gradient norm, the clip coefficient, the parameters
// and every state tensor a group keeps, as golden_test does, with the same tolerances
// (tests/reference/golden.hpp). A state a group's variant does not keep (max_exp_avg_sq
// without amsgrad) is null in the trace, and Optimizer::state() must refuse it.
//
// The trace format is golden_test's (format 1, described in make_golden.py) with two more
// keys: "groups" (each group's tensor indices and its hyperparameters over the top-level
// ones) and each step's "lrs" (one lr per group). The tensors are listed in group order, as
// Optimizer::params() lists them.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "reference/golden.hpp"
#include "stepfuse/stepfuse.hpp"

namespace {

using namespace stepfuse::ref::golden;
using stepfuse::Fusion;

fs::path traces_dir() { return fs::path(STEPFUSE_SOURCE_DIR) / "tests" / "golden" / "group_traces"; }

struct GroupCase {
  std::string trace;
  Fusion fusion;
};

const char* fusion_name(Fusion f) {
  return f == Fusion::fused ? "fused" : f == Fusion::unfused ? "unfused" : "interpreted";
}

void PrintTo(const GroupCase& c, std::ostream* os) { *os << c.trace << " (" << fusion_name(c.fusion) << ")"; }

std::string case_name(const testing::TestParamInfo<GroupCase>& info) {
  return info.param.trace + "_" + fusion_name(info.param.fusion);
}

std::vector<GroupCase> all_cases() {
  std::vector<GroupCase> cases;
  for (const auto& name : trace_names(traces_dir()))
    for (const Fusion f : {Fusion::fused, Fusion::unfused, Fusion::interpreted}) cases.push_back({name, f});
  return cases;
}

// A group's config: the trace's optimizer with the top-level hyperparameters, the group's
// own replacing them (what torch.optim does with a param group's keys).
stepfuse::OptimizerConfig group_config(const json& trace, const json& group) {
  json merged = {{"optimizer", trace.at("optimizer")}, {"hyperparameters", trace.at("hyperparameters")}};
  for (auto it = group.at("hyperparameters").begin(); it != group.at("hyperparameters").end(); ++it)
    merged["hyperparameters"][it.key()] = it.value();
  return make_config(merged);
}

// The state tensors the trace has for tensor i: name -> whether i's group keeps it (its
// entry is an array, not null), taken from the first applied step.
bool trace_keeps(const json& steps, const std::string& name, std::size_t i) {
  for (const json& step : steps)
    if (!step.at("skipped").get<bool>()) return !step.at("state").at(name).at(i).is_null();
  return false;
}

class GoldenGroupTrace : public testing::TestWithParam<GroupCase> {};

TEST_P(GoldenGroupTrace, MatchesPyTorch) {
  const json trace = load_trace(traces_dir(), GetParam().trace);
  ASSERT_EQ(trace.at("format").get<int>(), 1);
  const auto state_names = trace.at("state_names").get<std::vector<std::string>>();
  TraceParams p;
  ASSERT_NO_FATAL_FAILURE(load_params(trace, p));
  const std::size_t n = p.weights.size();
  stepfuse::OptimizerOptions options;
  ASSERT_NO_FATAL_FAILURE(load_options(trace, GetParam().fusion, options));

  // The groups, over consecutive tensors in trace order (so that params() is the trace's order).
  const json& groups = trace.at("groups");
  std::vector<stepfuse::ParamGroup> param_groups;
  std::size_t next = 0;
  for (const json& g : groups) {
    stepfuse::ParamGroup pg;
    for (const json& idx : g.at("params")) {
      ASSERT_EQ(idx.get<std::size_t>(), next) << "the trace's groups must list its tensors in order";
      pg.params.push_back(p.params[next++]);
    }
    pg.config = group_config(trace, g);
    param_groups.push_back(std::move(pg));
  }
  ASSERT_EQ(next, n);
  stepfuse::Optimizer opt(std::move(param_groups), options);
  ASSERT_EQ(opt.num_groups(), groups.size());
  ASSERT_NO_FATAL_FAILURE(expect_state_names(opt, state_names));

  // Which (state, tensor) pairs exist: torch's and the library's must agree.
  const json& steps = trace.at("steps");
  std::vector<std::vector<bool>> keeps(state_names.size(), std::vector<bool>(n));
  for (std::size_t s = 0; s < state_names.size(); ++s)
    for (std::size_t i = 0; i < n; ++i) {
      keeps[s][i] = trace_keeps(steps, state_names[s], i);
      if (!keeps[s][i]) {
        EXPECT_THROW((void)opt.state(i, state_names[s]), stepfuse::Error)
            << state_names[s] << "[" << i << "]: torch's group keeps none, the library's must refuse it";
      }
    }
  auto copy_kept_state = [&] {
    std::vector<std::vector<std::vector<float>>> copy(state_names.size(), std::vector<std::vector<float>>(n));
    for (std::size_t s = 0; s < state_names.size(); ++s)
      for (std::size_t i = 0; i < n; ++i)
        if (keeps[s][i]) {
          const auto st = opt.state(i, state_names[s]);
          copy[s][i].assign(st.begin(), st.end());
        }
    return copy;
  };

  const double loss_scale = trace.at("loss_scale").get<double>();
  WorstError worst;
  std::vector<std::vector<float>> torch_before = p.weights;  // torch's params before each step
  for (std::size_t k = 0; k < steps.size(); ++k) {
    SCOPED_TRACE("step " + std::to_string(k + 1));
    const json& step = steps.at(k);
    const json& lrs = step.at("lrs");
    ASSERT_EQ(lrs.size(), groups.size());
    for (std::size_t g = 0; g < lrs.size(); ++g) {
      opt.set_lr(g, lrs.at(g).get<double>());
      EXPECT_EQ(opt.lr(g), lrs.at(g).get<double>()) << "group " << g;
    }
    const json& gr = step.at("grads");
    ASSERT_EQ(gr.size(), n);
    for (std::size_t i = 0; i < n; ++i) {
      const auto v = to_vec(gr.at(i));
      ASSERT_EQ(v.size(), p.grads[i].size());
      std::copy(v.begin(), v.end(), p.grads[i].begin());
    }
    const auto weights_before = p.weights;
    const auto state_before = copy_kept_state();

    const stepfuse::StepResult r = opt.step_scaled(loss_scale);
    const auto want_count = step.at("step_count").get<std::int64_t>();
    EXPECT_EQ(opt.step_count(), want_count);
    for (std::size_t g = 0; g < groups.size(); ++g) EXPECT_EQ(opt.group_step_count(g), want_count) << "group " << g;

    if (step.at("skipped").get<bool>()) {  // one global decision: nothing of any group is written
      EXPECT_FALSE(r.applied);
      EXPECT_TRUE(r.found_inf);
      const auto state_after = copy_kept_state();
      for (std::size_t i = 0; i < n; ++i) EXPECT_TRUE(bitwise_equal(p.weights[i], weights_before[i])) << "param " << i;
      for (std::size_t s = 0; s < state_names.size(); ++s)
        for (std::size_t i = 0; i < n; ++i)
          EXPECT_TRUE(bitwise_equal(state_after[s][i], state_before[s][i]))
              << "skipped step wrote " << state_names[s] << "[" << i << "]";
      continue;
    }

    EXPECT_TRUE(r.applied);
    EXPECT_FALSE(r.found_inf);
    const double want_norm = step.at("grad_norm").get<double>();  // over every group
    EXPECT_NEAR(r.grad_norm, want_norm, kNormRtol * want_norm) << "grad_norm";
    expect_clip_coef(step, r.clip_coef, "clip_coef");

    const json& want_params = step.at("params");
    for (std::size_t i = 0; i < n; ++i) {
      const auto want = to_vec(want_params.at(i));
      worst.values = std::max(worst.values, expect_close("param " + std::to_string(i), p.weights[i], want));
      worst.updates = std::max(worst.updates, expect_update_close("update of param " + std::to_string(i),
                                                                  weights_before[i], p.weights[i], torch_before[i], want));
      torch_before[i] = want;
    }
    const json& want_state = step.at("state");
    for (std::size_t s = 0; s < state_names.size(); ++s)
      for (std::size_t i = 0; i < n; ++i) {
        const json& w = want_state.at(state_names[s]).at(i);
        ASSERT_EQ(w.is_null(), !keeps[s][i]) << state_names[s] << "[" << i << "]";
        if (!w.is_null()) {
          worst.values = std::max(worst.values, expect_close(state_names[s] + "[" + std::to_string(i) + "]",
                                                             opt.state(i, state_names[s]), to_vec(w)));
        }
      }
  }
  record_worst(case_name({GetParam(), 0}), worst);
}

INSTANTIATE_TEST_SUITE_P(PyTorch, GoldenGroupTrace, testing::ValuesIn(all_cases()), case_name);

TEST(GoldenGroupTraces, Present) {
  // At least one trace, with two groups, an lr per group on every step and clipping, so that
  // a lost group_traces/ directory cannot pass silently.
  const auto names = trace_names(traces_dir());
  ASSERT_FALSE(names.empty()) << "no traces in " << traces_dir();
  for (const auto& name : names) {
    const json t = load_trace(traces_dir(), name);
    EXPECT_GE(t.at("groups").size(), 2u) << name;
    EXPECT_FALSE(t.at("max_grad_norm").is_null()) << name;
    for (const json& step : t.at("steps")) EXPECT_EQ(step.at("lrs").size(), t.at("groups").size()) << name;
  }
}

}  // namespace
