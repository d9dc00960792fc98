// LAMB (optim::LAMB, a two-phase built-in): against the float64 reference for every
// dtype case, clipping mode and loss scale; bitwise the same on every Highway target,
// for any thread count, with the LLVM kernels and with the interpreter; the unfused
// baseline within fp32 rounding; its hyperparameter checks.
#include <gmock/gmock-matchers.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "hwy/targets.h"
#include "jit/builtins.hpp"
#include "jit/llvm/emit_llvm.hpp"
#include "jit/program_analysis.hpp"
#include "reference/harness.hpp"
#include "reference/reference.hpp"
#include "reference/test_util.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse::ref {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct NamedConfig {
  std::string name;
  optim::LAMB config;
};

// The defaults, no weight decay (no trust ratio, as Apex), maximize, other betas,
// a large eps (its place shows), a large weight decay (the trust ratio dominates).
std::vector<NamedConfig> lamb_configs() {
  return {
      {"LAMB", optim::LAMB{.lr = 0.01}},
      {"LAMB_no_weight_decay", optim::LAMB{.lr = 0.01, .weight_decay = 0}},
      {"LAMB_maximize", optim::LAMB{.lr = 0.01, .weight_decay = 0.05, .maximize = true}},
      {"LAMB_betas_large_eps", optim::LAMB{.lr = 0.02, .beta1 = 0.8, .beta2 = 0.95, .eps = 0.05}},
      {"LAMB_large_weight_decay", optim::LAMB{.lr = 0.005, .beta1 = 0.5, .weight_decay = 0.9}},
  };
}

struct DtypeCase {
  DType weight, grad;
  bool master;
};
// The 15 storage cases: every grad dtype with f32 weights, and f16/bf16 weights with and without masters.
std::vector<DtypeCase> dtype_cases() {
  std::vector<DtypeCase> d;
  for (DType g : {DType::f32, DType::f16, DType::bf16}) {
    d.push_back({DType::f32, g, true});
    for (DType w : {DType::f16, DType::bf16})
      for (bool master : {true, false}) d.push_back({w, g, master});
  }
  return d;
}
std::string case_name(const DtypeCase& d) {
  return std::string("w_") + std::string(dtype_name(d.weight)) +
         (d.weight == DType::f32 ? "" : d.master ? "_master" : "_nomaster") + "_g_" + std::string(dtype_name(d.grad));
}

enum class Clip { none, l2, inf };

RigSetup setup_for(const optim::LAMB& config, const DtypeCase& dt, Clip clip) {
  RigSetup s;
  s.config = config;
  s.weight_dtype = dt.weight;
  s.grad_dtype = dt.grad;
  s.master_weights = dt.master;
  if (clip == Clip::l2) s.max_grad_norm = 5.0;
  if (clip == Clip::inf) s.max_grad_norm = 1.0, s.norm_type = kInf;
  return s;
}

// Clipping (max norm 5 for L2, 1 for the inf norm) is active in steps 1 and 3, not in step 2.
constexpr double kStepFactors[3] = {1.0, 0.05, 2.0};

// ---- against the float64 reference ------------------------------------------------

class LambReference : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(LambReference, EveryStepMatchesReference) {
  const auto [config_index, dtype_index] = GetParam();
  const NamedConfig nc = lamb_configs()[static_cast<std::size_t>(config_index)];
  const DtypeCase dt = dtype_cases()[static_cast<std::size_t>(dtype_index)];
  struct ScaleMode {
    StepMode mode;
    double scale;
    const char* name;
  };
  const ScaleMode modes[] = {{StepMode::plain, 1.0, "step()"},
                             {StepMode::scaled, 1.0, "step_scaled(1)"},
                             {StepMode::scaled, 1024.0, "step_scaled(1024)"}};
  int variant = 0;
  for (const ScaleMode& sm : modes)
    for (Clip clip : {Clip::none, Clip::l2, Clip::inf}) {
      ++variant;
      RigSetup s = setup_for(nc.config, dt, clip);
      // Several chunks in one tensor in some variants; an empty tensor and odd sizes in all.
      s.sizes = variant % 3 == 0 ? std::vector<std::int64_t>{7, 40000, 0, 1, 33, 1000}
                                 : std::vector<std::int64_t>{0, 1, 7, 31, 33, 1000};
      s.flat = variant % 2 == 0;
      s.seed = 7919ull * static_cast<std::uint64_t>(config_index) + 101ull * static_cast<std::uint64_t>(dtype_index) +
               static_cast<std::uint64_t>(variant);
      SCOPED_TRACE(std::string(sm.name) + ", clip " + std::to_string(static_cast<int>(clip)));
      Rig rig(s);
      check_initial_state(rig);
      for (int k = 0; k < 3; ++k) {
        SCOPED_TRACE("step " + std::to_string(k + 1));
        check_step(rig, sm.mode, sm.scale, kStepFactors[k]);
        if (::testing::Test::HasFailure()) return;
      }
    }
}

INSTANTIATE_TEST_SUITE_P(All, LambReference,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(lamb_configs().size())),
                                            ::testing::Range(0, static_cast<int>(dtype_cases().size()))),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return lamb_configs()[static_cast<std::size_t>(std::get<0>(info.param))].name + "__" +
                                  case_name(dtype_cases()[static_cast<std::size_t>(std::get<1>(info.param))]);
                         });

// ---- bitwise identity across implementations ----------------------------------------

// Three steps (scaled at 1024, with clipping) over tensors of several chunks; everything
// the optimizer owns afterwards.
Snapshot run(const optim::LAMB& config, const DtypeCase& dt, Clip clip, Fusion fusion, int threads,
             std::optional<CpuBackend> backend) {
  RigSetup s = setup_for(config, dt, clip);
  s.sizes = {20000, 1, 35011, 0, 16384, 70000, 33};
  s.seed = 4242;
  s.fusion = fusion;
  s.num_threads = threads;
  OptimizerOptions o = s.options();
  o.cpu_backend = backend;
  HostTensors weights(s.weight_dtype, s.sizes, s.flat), grads(s.grad_dtype, s.sizes, s.flat);
  Random rng(s.seed);
  fill_weights(weights, rng);
  Optimizer opt(s.config, make_params(weights, grads), o);
  for (int k = 0; k < 3; ++k) {
    fill_grads(grads, rng, kStepFactors[k], 1024.0);
    EXPECT_TRUE(opt.step_scaled(1024.0).applied);
  }
  return snapshot(opt, weights);
}

TEST(LambBitwise, EveryCpuImplementationAndThreadCountGivesTheSameBits) {
  const bool llvm = jit::llvm_built();
  for (const NamedConfig& nc : {lamb_configs()[0], lamb_configs()[2]})
    for (const DtypeCase& dt : dtype_cases())
      for (Clip clip : {Clip::l2, Clip::inf}) {
        SCOPED_TRACE(nc.name + " " + case_name(dt) + (clip == Clip::l2 ? " L2" : " inf"));
        const Snapshot highway = run(nc.config, dt, clip, Fusion::fused, 1, CpuBackend::highway);
        EXPECT_TRUE(run(nc.config, dt, clip, Fusion::fused, 3, CpuBackend::highway) == highway) << "Highway, 3 threads";
        EXPECT_TRUE(run(nc.config, dt, clip, Fusion::interpreted, 2, CpuBackend::highway) == highway) << "interpreter";
        if (llvm) {
          EXPECT_TRUE(run(nc.config, dt, clip, Fusion::fused, 4, CpuBackend::llvm) == highway) << "LLVM";
        }
      }
}

TEST(LambBitwise, EveryHighwayTargetGivesTheSameBits) {
  const DtypeCase cases[] = {{DType::f32, DType::f32, true}, {DType::bf16, DType::f16, true}, {DType::f16, DType::bf16, false}};
  for (const DtypeCase& dt : cases) {
    SCOPED_TRACE(case_name(dt));
    std::optional<Snapshot> first;
    for (std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
      SCOPED_TRACE(hwy::TargetName(target));
      hwy::SetSupportedTargetsForTest(target);
      const Snapshot a = run(lamb_configs()[0].config, dt, Clip::l2, Fusion::fused, 2, CpuBackend::highway);
      const Snapshot b = run(lamb_configs()[0].config, dt, Clip::l2, Fusion::interpreted, 2, CpuBackend::highway);
      hwy::SetSupportedTargetsForTest(0);
      EXPECT_TRUE(a == b) << "the interpreter differs from the fused kernels";
      if (!first) first = a;
      else EXPECT_TRUE(a == *first) << "differs from " << hwy::TargetName(hwy::SupportedAndGeneratedTargets()[0]);
    }
  }
}

// ---- param groups ------------------------------------------------------------------

// A decay group and a no-decay group (no trust ratio) in one optimizer, without clipping,
// are bitwise two separate optimizers: each tensor's norms are its own; on every CPU path.
TEST(LambGroups, UnclippedGroupsEqualSeparateOptimizers) {
  const std::vector<std::int64_t> decay_sizes = {20000, 33, 0}, plain_sizes = {7, 16385};
  const optim::LAMB decay{.lr = 0.01, .weight_decay = 0.1}, no_decay{.lr = 0.01, .weight_decay = 0};
  for (const auto& [fusion, backend] : {std::pair{Fusion::fused, CpuBackend::highway},
                                        std::pair{Fusion::interpreted, CpuBackend::highway},
                                        std::pair{Fusion::fused, CpuBackend::llvm}}) {
    if (backend == CpuBackend::llvm && !jit::llvm_built()) continue;
    SCOPED_TRACE(std::string(fusion == Fusion::fused ? "fused " : "interpreted ") +
                 (backend == CpuBackend::llvm ? "llvm" : "highway"));
    OptimizerOptions o;
    o.fusion = fusion;
    o.cpu_backend = backend;
    HostTensors wa(DType::bf16, decay_sizes, false), ga(DType::f32, decay_sizes, false);
    HostTensors wb(DType::f32, plain_sizes, false), gb(DType::f32, plain_sizes, false);
    HostTensors wa2(DType::bf16, decay_sizes, false), wb2(DType::f32, plain_sizes, false);
    Random rng(5);
    fill_weights(wa, rng), fill_weights(wb, rng);
    for (std::size_t i = 0; i < wa.size(); ++i)
      for (std::int64_t j = 0; j < wa[i].numel; ++j) wa2.set(i, j, wa.get(i, j));
    for (std::size_t i = 0; i < wb.size(); ++i)
      for (std::int64_t j = 0; j < wb[i].numel; ++j) wb2.set(i, j, wb.get(i, j));
    Optimizer grouped({ParamGroup{make_params(wa, ga), decay}, ParamGroup{make_params(wb, gb), no_decay}}, o);
    Optimizer a(decay, make_params(wa2, ga), o), b(no_decay, make_params(wb2, gb), o);
    for (int k = 0; k < 3; ++k) {
      fill_grads(ga, rng, kStepFactors[k], 1024.0), fill_grads(gb, rng, kStepFactors[k], 1024.0);
      ASSERT_TRUE(grouped.step_scaled(1024.0).applied);
      ASSERT_TRUE(a.step_scaled(1024.0).applied);
      ASSERT_TRUE(b.step_scaled(1024.0).applied);
    }
    EXPECT_EQ(wa.snapshot(), wa2.snapshot());
    EXPECT_EQ(wb.snapshot(), wb2.snapshot());
    for (std::size_t i = 0; i < wa.size(); ++i)
      for (std::string_view name : {"exp_avg", "exp_avg_sq"}) {
        const auto x = grouped.state(i, name), y = a.state(i, name);
        EXPECT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << name << " of tensor " << i;
      }
  }
}

// ---- the unfused baseline -----------------------------------------------------------

// Fusion::unfused unscales and clips into an fp32 temporary with separately rounded
// multipliers: checked against the reference step by step, as the fused step is.
TEST(LambUnfused, MatchesTheReference) {
  for (const DtypeCase& dt : {DtypeCase{DType::f32, DType::f32, true}, DtypeCase{DType::bf16, DType::bf16, true}})
    for (Clip clip : {Clip::none, Clip::l2}) {
      SCOPED_TRACE(case_name(dt));
      RigSetup s = setup_for(lamb_configs()[0].config, dt, clip);
      s.sizes = {7, 40000, 0, 33, 1000};
      s.fusion = Fusion::unfused;
      s.seed = 99;
      Rig rig(s);
      for (int k = 0; k < 3; ++k) check_step(rig, StepMode::scaled, 1024.0, kStepFactors[k]);
    }
}

// ---- the program and the configuration ----------------------------------------------

TEST(LambProgram, IsTwoPhaseWithTwoNormsAndFitsTheIr) {
  const Program& p = jit::builtin_program(jit::select_builtin(optim::LAMB{}));
  EXPECT_EQ(p.name, "lamb");
  EXPECT_TRUE(jit::is_two_phase(p));
  EXPECT_EQ(jit::reduced_slots(p), 3u);  // ||p|| and ||u||
  EXPECT_LE(p.num_instrs, kMaxInstrs);
  const UpdateProgram up = UpdateProgram::from_config(optim::LAMB{.lr = 0.002, .weight_decay = 0});
  EXPECT_EQ(up.scalar("lr").rule.a, 0.002);
  EXPECT_EQ(up.scalar("skip_trust_ratio").rule.a, 1.0);  // no weight decay: no trust ratio
  EXPECT_EQ(UpdateProgram::from_config(optim::LAMB{}).scalar("skip_trust_ratio").rule.a, 0.0);
  EXPECT_EQ(optimizer_name(optim::LAMB{}), "LAMB");
}

TEST(LambConfig, RejectsWhatApexRejectsAndNonFiniteValues) {
  struct Bad {
    optim::LAMB config;
    const char* says;
  };
  const Bad bad[] = {
      {{.lr = -1e-3}, "invalid lr = -0.001"},
      {{.beta1 = 1.0}, "invalid beta1 = 1 (must be in [0, 1))"},
      {{.beta2 = -0.1}, "invalid beta2 = -0.1"},
      {{.eps = -1e-6}, "invalid eps = -1e-06"},
      {{.weight_decay = -0.01}, "invalid weight_decay = -0.01"},
      {{.lr = std::numeric_limits<double>::quiet_NaN()}, "invalid lr = nan"},
      {{.weight_decay = kInf}, "invalid weight_decay = inf"},
  };
  std::vector<float> w(4), g(4);
  const std::vector<Param> params = {{{w.data(), 4, DType::f32}, {g.data(), 4, DType::f32}}};
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.says);
    const std::string msg = thrown_text([&] { Optimizer(b.config, params); }, ErrorCode::invalid_argument);
    EXPECT_THAT(msg, ::testing::HasSubstr("LAMB: "));
    EXPECT_THAT(msg, ::testing::HasSubstr(b.says));
  }
}

}  // namespace
}  // namespace stepfuse::ref
