// Every optimizer, option, dtype combination, clipping mode and loss scale against the float64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "reference/dtypes.hpp"
#include "reference/harness.hpp"
#include "reference/reference.hpp"
#include "reference/test_data.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse::ref {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---- the matrix -----------------------------------------------------------------

struct NamedConfig {
  std::string name;
  OptimizerConfig config;
};

// Every option of every optimizer, with learning rates large enough that updates
// show in bf16 weights, and non-default betas/eps/alpha in some to catch constants
// baked in where a hyperparameter belongs.
std::vector<NamedConfig> all_configs() {
  std::vector<NamedConfig> c;
  auto sgd = [](double momentum, double dampening, double wd, bool nesterov, bool maximize) {
    return optim::SGD{.lr = 0.1, .momentum = momentum, .dampening = dampening, .weight_decay = wd,
                      .nesterov = nesterov, .maximize = maximize};
  };
  c.push_back({"SGD", sgd(0, 0, 0, false, false)});
  c.push_back({"SGD_wd", sgd(0, 0, 0.05, false, false)});
  c.push_back({"SGD_maximize", sgd(0, 0, 0, false, true)});
  c.push_back({"SGD_wd_maximize", sgd(0, 0, 0.05, false, true)});
  c.push_back({"SGD_momentum", sgd(0.9, 0, 0, false, false)});
  c.push_back({"SGD_momentum_dampening", sgd(0.9, 0.3, 0, false, false)});
  c.push_back({"SGD_nesterov", sgd(0.9, 0, 0, true, false)});
  c.push_back({"SGD_nesterov_wd_maximize", sgd(0.9, 0, 0.05, true, true)});
  c.push_back({"SGD_momentum_dampening_wd_maximize", sgd(0.8, 0.5, 0.05, false, true)});

  for (int kind = 0; kind < 2; ++kind)
    for (int amsgrad = 0; amsgrad < 2; ++amsgrad)
      for (int maximize = 0; maximize < 2; ++maximize)
        for (int wd = 0; wd < 2; ++wd) {
          const std::string name = std::string(kind == 0 ? "Adam" : "AdamW") + (amsgrad ? "_amsgrad" : "") +
                                   (maximize ? "_maximize" : "") + (wd ? "_wd" : "");
          auto fill = [&](auto o) {
            o.lr = 0.01;
            o.amsgrad = amsgrad;
            o.maximize = maximize;
            o.weight_decay = wd ? 0.1 : 0.0;
            if (wd) {  // non-default betas and eps in half of them
              o.beta1 = 0.8;
              o.beta2 = 0.95;
              o.eps = 1e-6;
            }
            return o;
          };
          if (kind == 0) c.push_back({name, fill(optim::Adam{})});
          else c.push_back({name, fill(optim::AdamW{})});
        }

  // A large eps makes its placement (outside the square root, after bias correction) visible.
  c.push_back({"Adam_amsgrad_large_eps", optim::Adam{.lr = 0.01, .eps = 0.05, .amsgrad = true}});
  c.push_back({"AdamW_large_eps_large_wd", optim::AdamW{.lr = 0.01, .eps = 0.05, .weight_decay = 0.5}});

  auto adagrad = [](double lr_decay, double init, double wd, double eps, bool maximize) {
    return optim::Adagrad{.lr = 0.1, .lr_decay = lr_decay, .weight_decay = wd, .initial_accumulator_value = init,
                          .eps = eps, .maximize = maximize};
  };
  c.push_back({"Adagrad", adagrad(0, 0, 0, 1e-10, false)});
  c.push_back({"Adagrad_lr_decay", adagrad(0.1, 0, 0, 1e-10, false)});
  c.push_back({"Adagrad_initial_accumulator", adagrad(0, 0.5, 0, 1e-10, false)});
  c.push_back({"Adagrad_wd_maximize", adagrad(0, 0, 0.05, 1e-10, true)});
  c.push_back({"Adagrad_all", adagrad(0.05, 0.2, 0.05, 1e-6, true)});
  c.push_back({"Adagrad_large_eps", adagrad(0, 0, 0, 0.1, false)});

  for (int centered = 0; centered < 2; ++centered)
    for (int momentum = 0; momentum < 2; ++momentum)
      for (int wd = 0; wd < 2; ++wd) {
        optim::RMSprop o;
        o.lr = 0.01;
        o.centered = centered;
        o.momentum = momentum ? 0.9 : 0.0;
        o.weight_decay = wd ? 0.05 : 0.0;
        o.maximize = wd != 0 && momentum != 0;
        if (wd) {
          o.alpha = 0.9;
          o.eps = 1e-6;
        }
        c.push_back({std::string("RMSprop") + (centered ? "_centered" : "") + (momentum ? "_momentum" : "") +
                         (wd ? "_wd" : "") + (o.maximize ? "_maximize" : ""),
                     o});
      }

  c.push_back({"RMSprop_centered_large_eps", optim::RMSprop{.lr = 0.01, .eps = 0.1, .centered = true}});

  auto lion = [](double wd, double b1, double b2, bool maximize) {
    return optim::Lion{.lr = 0.01, .beta1 = b1, .beta2 = b2, .weight_decay = wd, .maximize = maximize};
  };
  c.push_back({"Lion", lion(0, 0.9, 0.99, false)});
  c.push_back({"Lion_wd", lion(0.5, 0.95, 0.98, false)});
  c.push_back({"Lion_wd_maximize", lion(0.1, 0.9, 0.99, true)});

  // NAdam and RAdam: both weight decays; non-default betas, eps (and momentum decay) in some.
  for (int wd = 0; wd < 3; ++wd)  // none, L2, decoupled
    for (int maximize = 0; maximize < 2; ++maximize) {
      const std::string suffix = std::string(wd == 1 ? "_wd" : wd == 2 ? "_decoupled_wd" : "") + (maximize ? "_maximize" : "");
      optim::NAdam nadam{.lr = 0.01, .weight_decay = wd ? 0.1 : 0.0, .decoupled_weight_decay = wd == 2,
                         .maximize = maximize != 0};
      optim::RAdam radam{.lr = 0.01, .weight_decay = wd ? 0.1 : 0.0, .decoupled_weight_decay = wd == 2,
                         .maximize = maximize != 0};
      if (maximize) {
        nadam.beta1 = radam.beta1 = 0.8;
        nadam.beta2 = radam.beta2 = 0.95;
        nadam.eps = radam.eps = 1e-6;
        nadam.momentum_decay = 0.05;
      }
      c.push_back({"NAdam" + suffix, nadam});
      c.push_back({"RAdam" + suffix, radam});
    }
  c.push_back({"NAdam_large_eps_no_momentum_decay", optim::NAdam{.lr = 0.01, .eps = 0.05, .momentum_decay = 0}});

  c.push_back({"Adamax", optim::Adamax{.lr = 0.01}});
  c.push_back({"Adamax_wd_maximize", optim::Adamax{.lr = 0.01, .weight_decay = 0.05, .maximize = true}});
  c.push_back({"Adamax_betas_large_eps", optim::Adamax{.lr = 0.01, .beta1 = 0.8, .beta2 = 0.9, .eps = 0.1}});

  c.push_back({"Adadelta", optim::Adadelta{}});
  c.push_back({"Adadelta_wd_maximize", optim::Adadelta{.lr = 0.5, .weight_decay = 0.05, .maximize = true}});
  c.push_back({"Adadelta_rho_large_eps", optim::Adadelta{.rho = 0.5, .eps = 1e-3}});
  c.push_back({"Adadelta_rho_1", optim::Adadelta{.lr = 0.1, .rho = 1.0}});

  // Rprop: the clamps are hit from the second step on (0.02 * 1.3 > 0.024, 0.02 * 0.3 < 0.015).
  c.push_back({"Rprop", optim::Rprop{}});
  c.push_back({"Rprop_etas_clamped", optim::Rprop{.lr = 0.02, .eta_minus = 0.3, .eta_plus = 1.3,
                                                  .step_size_min = 0.015, .step_size_max = 0.024}});
  c.push_back({"Rprop_maximize", optim::Rprop{.lr = 0.01, .step_size_max = 0.011, .maximize = true}});

  // ASGD: t0 = 0 averages from the third step on (mu = 1 / (t - 1)); the default t0 only copies.
  c.push_back({"ASGD", optim::ASGD{}});
  c.push_back({"ASGD_t0_0", optim::ASGD{.lr = 0.05, .lambd = 0.1, .alpha = 0.5, .t0 = 0}});
  c.push_back({"ASGD_wd_maximize_negative_t0",
               optim::ASGD{.lr = 0.02, .lambd = 0.01, .t0 = -1.5, .weight_decay = 0.05, .maximize = true}});
  return c;
}

struct DtypeCase {
  DType weight, grad;
  bool master;
};
std::vector<DtypeCase> all_dtype_cases() {
  std::vector<DtypeCase> d;
  for (DType g : {DType::f32, DType::f16, DType::bf16}) {
    d.push_back({DType::f32, g, true});
    for (DType w : {DType::f16, DType::bf16})
      for (bool master : {true, false}) d.push_back({w, g, master});
  }
  return d;
}
std::string dtype_case_name(const DtypeCase& d) {
  return std::string("w_") + std::string(dtype_name(d.weight)) +
         (d.weight == DType::f32 ? "" : d.master ? "_master" : "_nomaster") + "_g_" + std::string(dtype_name(d.grad));
}

const std::vector<NamedConfig>& configs() {
  static const std::vector<NamedConfig> c = all_configs();
  return c;
}
const std::vector<DtypeCase>& dtype_cases() {
  static const std::vector<DtypeCase> d = all_dtype_cases();
  return d;
}

enum class Clip { none, l2, inf };
const char* clip_name(Clip c) { return c == Clip::none ? "no clipping" : c == Clip::l2 ? "L2 clipping" : "inf-norm clipping"; }

// Clipping at max norm 5 (L2) or 1 (inf norm): see kStepFactors.
void set_clip(RigSetup& s, Clip clip) {
  if (clip == Clip::l2) s.max_grad_norm = 5.0;
  if (clip == Clip::inf) {
    s.max_grad_norm = 1.0;
    s.norm_type = kInf;
  }
}

// `config` with the dtypes of `dt` and clipping `clip`; the sizes and the seed are the caller's.
RigSetup setup_for(const OptimizerConfig& config, const DtypeCase& dt, Clip clip) {
  RigSetup s;
  s.config = config;
  s.weight_dtype = dt.weight;
  s.grad_dtype = dt.grad;
  s.master_weights = dt.master;
  set_clip(s, clip);
  return s;
}

// The gradients of the three steps are drawn at these magnitudes, so that with
// max_grad_norm 5 (L2, norm ~33 at factor 1 over ~1000 elements) or 1 (inf norm,
// max |g| ~3.5) clipping is active in steps 1 and 3 and inactive in step 2.
constexpr double kStepFactors[3] = {1.0, 0.05, 2.0};

class ReferenceMatrix : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ReferenceMatrix, EveryStepMatchesReference) {
  const auto [config_index, dtype_index] = GetParam();
  const NamedConfig& nc = configs()[static_cast<std::size_t>(config_index)];
  const DtypeCase& dt = dtype_cases()[static_cast<std::size_t>(dtype_index)];
  // A subset also has a tensor larger than a CPU chunk (16384 elements).
  const bool big = dtype_index % 5 == config_index % 5;

  struct ScaleMode {
    StepMode mode;
    double scale;
    const char* name;
  };
  const ScaleMode scale_modes[] = {
      {StepMode::plain, 1.0, "step()"}, {StepMode::scaled, 1.0, "step_scaled(1)"}, {StepMode::scaled, 1024.0, "step_scaled(1024)"}};
  int variant = 0;
  for (const ScaleMode& sm : scale_modes)
    for (Clip clip : {Clip::none, Clip::l2, Clip::inf}) {
      ++variant;
      RigSetup s = setup_for(nc.config, dt, clip);
      s.sizes = {0, 1, 7, 31, 33, 1000};
      if (big && sm.scale == 1024.0 && static_cast<int>(clip) == config_index % 3)
        s.sizes = {7, 40000, 0, 1, 33, 1000, 31};
      s.flat = variant % 2 == 0;
      s.seed = 1000003ull * static_cast<std::uint64_t>(config_index) + 1009ull * static_cast<std::uint64_t>(dtype_index) +
               static_cast<std::uint64_t>(variant);
      SCOPED_TRACE(std::string(sm.name) + ", " + clip_name(clip) + (s.flat ? ", one flat buffer" : ", separate buffers"));
      Rig rig(s);
      check_initial_state(rig);
      // RAdam rectifies from the step where rho_t > 5 (the 6th or later): 7 steps for it.
      const int steps = std::holds_alternative<optim::RAdam>(nc.config) ? 7 : 3;
      for (int k = 0; k < steps; ++k) {
        SCOPED_TRACE("step " + std::to_string(k + 1));
        check_step(rig, sm.mode, sm.scale, kStepFactors[k % 3]);
        if (::testing::Test::HasFailure()) return;  // one broken variant is enough to read
      }
    }
}

INSTANTIATE_TEST_SUITE_P(
    All, ReferenceMatrix,
    ::testing::Combine(::testing::Range(0, static_cast<int>(all_configs().size())),
                       ::testing::Range(0, static_cast<int>(all_dtype_cases().size()))),
    [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
      return configs()[static_cast<std::size_t>(std::get<0>(info.param))].name + "__" +
             dtype_case_name(dtype_cases()[static_cast<std::size_t>(std::get<1>(info.param))]);
    });

// ---- a representative config with every state stream of each optimizer ----------

std::vector<NamedConfig> stateful_configs() {
  return {{"SGD", optim::SGD{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true}},
          {"Adam", optim::Adam{.lr = 0.01, .weight_decay = 0.01, .amsgrad = true}},
          {"AdamW", optim::AdamW{.lr = 0.01}},
          {"Adagrad", optim::Adagrad{.lr = 0.1, .lr_decay = 0.1, .initial_accumulator_value = 0.1}},
          {"RMSprop", optim::RMSprop{.momentum = 0.9, .centered = true}},
          {"Lion", optim::Lion{.lr = 0.01, .weight_decay = 0.1}},
          {"NAdam", optim::NAdam{.lr = 0.01, .weight_decay = 0.01, .decoupled_weight_decay = true}},
          {"RAdam", optim::RAdam{.lr = 0.01, .weight_decay = 0.01}},
          {"Adamax", optim::Adamax{.lr = 0.01, .weight_decay = 0.01}},
          {"Adadelta", optim::Adadelta{.weight_decay = 0.01}},
          {"Rprop", optim::Rprop{.lr = 0.02, .step_size_max = 0.03}},
          {"ASGD", optim::ASGD{.lr = 0.05, .lambd = 0.1, .t0 = 0, .weight_decay = 0.01}}};
}

// ---- non-finite gradients -------------------------------------------------------

// An inf, -inf or NaN anywhere (first tensor, a middle one, the last; the first
// element, one in a vector tail, the last element of a chunk tail) skips the
// step: applied=false, found_inf=true, weights, masters and state bitwise
// unchanged, step_count unchanged. The next finite step then is step 2, not 3.
TEST(NonFinite, SkipsTheStepAndWritesNothing) {
  const std::vector<std::int64_t> sizes = {7, 1000, 33, 40000};
  struct Where {
    std::size_t tensor;
    std::int64_t element;
  };
  const Where places[] = {{0, 0}, {1, 500}, {2, 32}, {3, 39999}};
  struct Mode {
    DType weight, grad;
    bool master;
  };
  const Mode modes[] = {{DType::f32, DType::f32, true}, {DType::bf16, DType::f16, true}, {DType::f16, DType::bf16, false}};
  const double bad_values[] = {kInf, -kInf, kNaN};
  int index = 0;
  for (const NamedConfig& nc : stateful_configs())
    for (const Mode& m : modes)
      for (double bad : bad_values)
        for (const Where& w : places) {
          ++index;
          SCOPED_TRACE(nc.name + " w=" + std::string(dtype_name(m.weight)) + (m.master ? "+master" : "") +
                       " g=" + std::string(dtype_name(m.grad)) + " bad=" + std::to_string(bad) + " at tensor " +
                       std::to_string(w.tensor) + " element " + std::to_string(w.element));
          RigSetup s = setup_for(nc.config, {m.weight, m.grad, m.master}, static_cast<Clip>(index % 3));
          s.sizes = sizes;
          s.seed = 77 + static_cast<std::uint64_t>(index);
          Rig rig(s);
          fill_grads(rig.grads, rig.rng, 1.0, 1024.0);  // one step first: non-zero state
          ASSERT_TRUE(rig.opt.step_scaled(1024.0).applied);

          fill_grads(rig.grads, rig.rng, 1.0, 1024.0);
          rig.grads.set(w.tensor, w.element, bad);
          ASSERT_FALSE(std::isfinite(rig.grads.get(w.tensor, w.element)));
          const Snapshot before = snapshot(rig.opt, rig.weights);
          const auto grads_before = rig.grads.snapshot();
          const StepResult r = rig.opt.step_scaled(1024.0);
          EXPECT_EQ(rig.grads.snapshot(), grads_before) << "the fused step wrote the gradients";
          EXPECT_FALSE(r.applied);
          EXPECT_TRUE(r.found_inf);
          EXPECT_FALSE(rig.opt.last_result().applied);
          EXPECT_TRUE(rig.opt.last_result().found_inf);
          EXPECT_EQ(rig.opt.step_count(), 1);
          EXPECT_TRUE(snapshot(rig.opt, rig.weights) == before) << "a skipped step wrote something";

          // A finite step afterwards is applied as step 2 (bias corrections, lr decay).
          if (&w == &places[0]) {
            check_step(rig, StepMode::scaled, 1024.0, 1.0);
            EXPECT_EQ(rig.opt.step_count(), 2);
          }
          if (::testing::Test::HasFailure()) return;
        }
}

// step() with clipping checks the (unscaled) gradients too; so does the unfused
// baseline. Neither writes weights or state on a non-finite gradient.
TEST(NonFinite, PlainStepWithClippingAndUnfusedSkip) {
  int index = 0;
  for (const NamedConfig& nc : stateful_configs())
    for (Fusion fusion : {Fusion::fused, Fusion::unfused})
      for (bool plain : {true, false}) {
        ++index;
        SCOPED_TRACE(nc.name + (fusion == Fusion::fused ? " fused" : " unfused") + (plain ? " step()" : " step_scaled(8)"));
        RigSetup s;
        s.config = nc.config;
        s.weight_dtype = DType::bf16;
        s.grad_dtype = DType::f32;
        s.sizes = {31, 20000, 5};
        s.seed = 500 + static_cast<std::uint64_t>(index);
        s.max_grad_norm = 2.0;
        s.fusion = fusion;
        Rig rig(s);
        check_step(rig, plain ? StepMode::plain : StepMode::scaled, plain ? 1.0 : 8.0, 1.0);
        fill_grads(rig.grads, rig.rng, 1.0, plain ? 1.0 : 8.0);
        rig.grads.set(1, 17001, kNaN);
        const Snapshot before = snapshot(rig.opt, rig.weights);
        if (plain) rig.opt.step();
        else rig.opt.step_scaled(8.0);
        EXPECT_FALSE(rig.opt.last_result().applied);
        EXPECT_TRUE(rig.opt.last_result().found_inf);
        EXPECT_TRUE(snapshot(rig.opt, rig.weights) == before) << "a skipped step wrote something";
      }
}

// ---- the edges of the storage formats --------------------------------------------------

// f16 subnormal weights and gradients, bf16 values in fp32's subnormal range (no
// flush-to-zero anywhere), and f16 weights that overflow to inf: SGD with lr 1 makes
// the update p - g, exact in fp32, so the only rounding is the final store.
TEST(Dtypes, SubnormalsAndOverflow) {
  struct Case {
    const char* name;
    DType weight, grad;
    double weight_scale, grad_scale;
  };
  const Case cases[] = {
      {"f16 subnormals", DType::f16, DType::f16, 2e-5, 2e-5},
      {"bf16 in fp32's subnormal range", DType::bf16, DType::bf16, 1e-39, 1e-39},
      {"f16 overflow to inf", DType::f16, DType::f32, 1.5e4, 6e4},
  };
  for (const Case& c : cases)
    for (bool master : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + (master ? " with masters" : ""));
      optim::SGD sgd;
      sgd.lr = 1.0;
      RigSetup s;
      s.config = sgd;
      s.weight_dtype = c.weight;
      s.grad_dtype = c.grad;
      s.master_weights = master;
      s.weight_scale = c.weight_scale;
      s.sizes = {1000, 33};
      s.seed = 123;
      Rig rig(s);
      for (std::size_t i = 0; i < rig.weights.size(); ++i)
        for (std::int64_t j = 0; j < rig.weights[i].numel; ++j)
          ASSERT_TRUE(std::isfinite(rig.weights.get(i, j))) << "the test drew a weight that does not fit";
      check_step(rig, StepMode::plain, 1.0, c.grad_scale);
      int infinite = 0, subnormal = 0;
      for (std::size_t i = 0; i < rig.weights.size(); ++i)
        for (std::int64_t j = 0; j < rig.weights[i].numel; ++j) {
          const double w = rig.weights.get(i, j);
          infinite += std::isinf(w);
          subnormal += w != 0 && std::fabs(w) < (c.weight == DType::f16 ? 0x1p-14 : 0x1p-126);
        }
      EXPECT_GT(c.weight_scale > 1 ? infinite : subnormal, 10) << "the case is not exercised";
    }
}

// ---- thread counts ----------------------------------------------------------------

// 1, 2 and 3 threads give bitwise identical weights, masters, state and norms over
// tensors spanning many chunks (docs/architecture.md §5: fixed chunks, fixed combination order).
TEST(Threads, ResultsAreBitwiseIdenticalForAnyThreadCount) {
  struct Case {
    int config;  // index into stateful_configs()
    DType weight, grad;
    bool master;
    double max_norm, norm_type;
  };
  const Case cases[] = {
      {2, DType::f32, DType::f32, true, 50.0, 2.0},  {0, DType::bf16, DType::f16, true, 2.0, kInf},
      {5, DType::f16, DType::bf16, false, 50.0, 2.0}, {4, DType::f32, DType::bf16, true, 2.0, kInf},
      {3, DType::bf16, DType::f32, true, 50.0, 2.0},  {1, DType::f16, DType::f16, true, 50.0, 2.0},
      {6, DType::f32, DType::f32, true, 2.0, kInf},   {7, DType::bf16, DType::f16, true, 50.0, 2.0},
      {8, DType::f16, DType::bf16, false, 2.0, kInf}, {9, DType::f32, DType::bf16, true, 50.0, 2.0},
      {10, DType::bf16, DType::bf16, true, 2.0, kInf}, {11, DType::f16, DType::f32, true, 50.0, 2.0},
  };
  const auto cfgs = stateful_configs();
  for (const Case& c : cases) {
    SCOPED_TRACE(cfgs[static_cast<std::size_t>(c.config)].name);
    const auto setup = [&](std::uint64_t seed, int threads) {
      RigSetup s;
      s.config = cfgs[static_cast<std::size_t>(c.config)].config;
      s.weight_dtype = c.weight;
      s.grad_dtype = c.grad;
      s.master_weights = c.master;
      s.max_grad_norm = c.max_norm;
      s.norm_type = c.norm_type;
      s.sizes = {20000, 35011, 50000, 64999, 70000};
      s.seed = seed;
      s.num_threads = threads;
      return s;
    };
    Snapshot first;
    std::vector<double> first_norms;
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE("num_threads " + std::to_string(threads));
      Rig rig(setup(4242, threads));
      EXPECT_EQ(rig.opt.num_threads(), threads);
      std::vector<double> norms;
      for (int k = 0; k < 3; ++k) {
        fill_grads(rig.grads, rig.rng, kStepFactors[k], 1024.0);
        const StepResult r = rig.opt.step_scaled(1024.0);
        EXPECT_TRUE(r.applied);
        norms.push_back(r.grad_norm);
        norms.push_back(r.clip_coef);
        for (double t : rig.opt.last_tensor_grad_norms()) norms.push_back(t);
      }
      const Snapshot snap = snapshot(rig.opt, rig.weights);
      if (threads == 1) {
        first = snap;
        first_norms = norms;
      } else {
        EXPECT_TRUE(snap == first) << "weights/masters/state differ from the 1-thread run";
        ASSERT_EQ(norms.size(), first_norms.size());
        for (std::size_t i = 0; i < norms.size(); ++i)
          EXPECT_EQ(norms[i], first_norms[i]) << "norm/clip value " << i << " differs from the 1-thread run";
      }
    }
    // And the single-thread run agrees with the reference (checked step by step).
    Rig rig(setup(4243, 3));
    check_step(rig, StepMode::scaled, 1024.0, 1.0);
  }
}

// ---- fused vs unfused ---------------------------------------------------------------

// Fusion::unfused (the eager baseline) gives the fused results within fp32 rounding.
// Both are checked against the reference at every step (each from its own previous
// state; check_step also checks that neither writes the caller's gradients: unfused
// unscales and clips into an fp32 temporary). After the first step, which starts from
// identical state, they are compared directly: rtol 1e-6 plus a tiny floor (1e-6 of the
// largest step for weights, 1e-7 of the largest value for state) plus twice the
// reference's sensitivity (see harness.hpp: where g + wd * p cancels and is normalized).
TEST(Unfused, MatchesFusedWithinFp32Rounding) {
  struct Mode {
    DType weight;
    bool master;
  };
  const Mode modes[] = {{DType::f32, true}, {DType::bf16, true}, {DType::f16, true}, {DType::bf16, false}};
  const DType grad_dtypes[] = {DType::f32, DType::f16, DType::bf16};
  int index = 0;
  for (const NamedConfig& nc : stateful_configs())
    for (const Mode& m : modes)
      for (Clip clip : {Clip::none, Clip::l2, Clip::inf}) {
        ++index;
        RigSetup s = setup_for(nc.config, {m.weight, grad_dtypes[index % 3], m.master}, clip);
        SCOPED_TRACE(nc.name + " w=" + std::string(dtype_name(m.weight)) + (m.master ? "+master" : "") +
                     " g=" + std::string(dtype_name(s.grad_dtype)) + " " + clip_name(clip));
        s.sizes = {1, 33, 1000, 20001};
        s.seed = 9000 + static_cast<std::uint64_t>(index);
        Rig fused(s);
        s.fusion = Fusion::unfused;
        Rig unfused(s);  // same seed: same weights and the same gradient draws
        EXPECT_EQ(unfused.opt.options().fusion, Fusion::unfused);
        for (int k = 0; k < 3; ++k) {
          SCOPED_TRACE("step " + std::to_string(k + 1));
          const double scale = 1024.0;
          const StepOutcome of = check_step(fused, StepMode::scaled, scale, kStepFactors[k]);
          const StepOutcome ou = check_step(unfused, StepMode::scaled, scale, kStepFactors[k]);
          ASSERT_EQ(of.scaled_grads, ou.scaled_grads);
          EXPECT_EQ(unfused.opt.step_count(), fused.opt.step_count());
          EXPECT_NEAR(ou.lib.clip_coef, of.lib.clip_coef, 1e-6 * of.lib.clip_coef);
          if (s.max_grad_norm || !std::isnan(ou.lib.grad_norm)) {
            EXPECT_NEAR(ou.lib.grad_norm, of.lib.grad_norm, 1e-6 * of.lib.grad_norm);
          }
          if (k > 0) continue;

          const auto a = ref_from_library(fused.opt, fused.weights, s.config);
          const auto b = ref_from_library(unfused.opt, unfused.weights, s.config);
          const Expected& e = of.expected;
          double max_step = 0;
          for (std::size_t i = 0; i < a.size(); ++i)
            for (std::size_t j = 0; j < a[i].param.size(); ++j)
              max_step = std::max(max_step, std::fabs(a[i].param[j] - of.before[i].param[j]));
          Reporter rep("unfused vs fused");
          for (std::size_t i = 0; i < a.size(); ++i) {
            for (std::size_t j = 0; j < a[i].param.size(); ++j) {
              const double tol = 1e-6 * std::fabs(a[i].param[j]) + 1e-6 * max_step + 2 * e.param_sens[i][j];
              bool ok = std::fabs(a[i].param[j] - b[i].param[j]) <= tol;
              if (!ok && m.weight != DType::f32 && !m.master)  // the stored weights themselves
                ok = ulp_distance16(load_bits16(fused.weights[i], static_cast<std::int64_t>(j)),
                                    load_bits16(unfused.weights[i], static_cast<std::int64_t>(j)), m.weight) <= 1;
              if (!ok)
                rep.fail([&](auto& os) {
                  os << "param[" << i << "][" << j << "]: fused " << a[i].param[j] << ", unfused " << b[i].param[j]
                     << ", tolerance " << tol;
                });
            }
            for (const auto& entry : a[i].state) {
              const std::string& name = entry.first;  // not a structured binding: the lambda below captures it
              const auto& va = entry.second;
              double scale_s = 0;
              for (std::size_t t = 0; t < a.size(); ++t)
                for (double x : a[t].state.at(name)) scale_s = std::max(scale_s, std::fabs(x));
              const auto& vb = b[i].state.at(name);
              const auto& sens = e.state_sens.at(name)[i];
              for (std::size_t j = 0; j < va.size(); ++j) {
                const double tol = 1e-6 * std::fabs(va[j]) + 1e-7 * scale_s + 2 * sens[j];
                if (!(std::fabs(va[j] - vb[j]) <= tol))
                  rep.fail([&](auto& os) {
                    os << name << "[" << i << "][" << j << "]: fused " << va[j] << ", unfused " << vb[j] << ", tolerance " << tol;
                  });
              }
            }
          }
          if (::testing::Test::HasFailure()) return;
        }
      }
}

// Fusion::interpreted (the fused pipeline with the update program run by the blocked
// interpreter, the path of run-time programs) agrees with the reference for every
// optimizer option, and is bitwise identical to the compile-time fused loop: the same
// program, the same IEEE operations in the same order (docs/architecture.md §5).
TEST(Interpreted, MatchesReferenceAndFusedBitwise) {
  const DtypeCase dtypes[] = {{DType::f32, DType::f32, true}, {DType::bf16, DType::f16, true},
                              {DType::f16, DType::bf16, false}, {DType::bf16, DType::bf16, false}};
  int index = 0;
  for (const NamedConfig& nc : configs())
    for (const DtypeCase& dt : dtypes) {
      ++index;
      const Clip clip = static_cast<Clip>(index % 3);
      SCOPED_TRACE(nc.name + " " + dtype_case_name(dt) + " " + clip_name(clip));
      RigSetup s = setup_for(nc.config, dt, clip);
      s.sizes = {0, 1, 7, 31, 1000, index % 4 == 0 ? 17000 : 33};
      s.flat = index % 2 == 0;
      s.seed = 70000 + static_cast<std::uint64_t>(index);
      Rig fused(s);
      s.fusion = Fusion::interpreted;
      Rig interpreted(s);
      for (int k = 0; k < 3; ++k) {
        SCOPED_TRACE("step " + std::to_string(k + 1));
        const StepMode mode = k == 1 ? StepMode::plain : StepMode::scaled;
        const double scale = k == 1 ? 1.0 : 512.0;
        const StepOutcome of = check_step(fused, mode, scale, kStepFactors[k]);
        const StepOutcome oi = check_step(interpreted, mode, scale, kStepFactors[k]);
        EXPECT_TRUE(same_or_both_nan(of.lib.grad_norm, oi.lib.grad_norm));
        EXPECT_EQ(of.lib.clip_coef, oi.lib.clip_coef);
        EXPECT_TRUE(snapshot(fused.opt, fused.weights) == snapshot(interpreted.opt, interpreted.weights))
            << "interpreted and fused results differ bitwise";
        if (::testing::Test::HasFailure()) return;
      }
    }
}

// ---- hyperparameter changes between steps -----------------------------------------

// set_lr and set_config take effect at the next step, as the reference says; they
// do not touch the state, and step_count/last_grad_norm keep counting.
TEST(SetConfig, SetLrAndSetConfigTakeEffectNextStep) {
  for (const NamedConfig& nc : stateful_configs()) {
    SCOPED_TRACE(nc.name);
    RigSetup s;
    s.config = nc.config;
    s.weight_dtype = DType::f32;
    s.grad_dtype = DType::f32;
    s.sizes = {7, 1000, 33};
    s.max_grad_norm = 5.0;
    s.seed = 99;
    Rig rig(s);
    check_step(rig, StepMode::scaled, 16.0, 1.0);

    const double new_lr = learning_rate(nc.config) * 0.3;
    rig.opt.set_lr(new_lr);
    EXPECT_EQ(rig.opt.lr(), new_lr);
    EXPECT_EQ(learning_rate(rig.opt.config()), new_lr);
    std::visit([&](auto& c) { c.lr = new_lr; }, rig.setup.config);
    check_step(rig, StepMode::scaled, 16.0, 1.0);

    // Change every value hyperparameter (not the program-shaping flags).
    OptimizerConfig changed = rig.setup.config;
    std::visit(
        [](auto& c) {
          using C = std::decay_t<decltype(c)>;
          c.lr *= 2;
          if constexpr (requires { c.weight_decay; }) c.weight_decay = c.weight_decay == 0 ? 0.02 : c.weight_decay * 3;
          c.maximize = !c.maximize;
          if constexpr (std::is_same_v<C, optim::SGD>) c.momentum = 0.5;
          if constexpr (std::is_same_v<C, optim::Adam> || std::is_same_v<C, optim::AdamW>) {
            c.beta1 = 0.5;
            c.beta2 = 0.9;
            c.eps = 1e-3;
          }
          if constexpr (std::is_same_v<C, optim::Adagrad>) {
            c.lr_decay = 0.5;
            c.eps = 1e-3;
            c.initial_accumulator_value = 7;  // only affects fresh state
          }
          if constexpr (std::is_same_v<C, optim::RMSprop>) {
            c.alpha = 0.5;
            c.eps = 1e-3;
            c.momentum = 0.3;
          }
          if constexpr (std::is_same_v<C, optim::Lion>) {
            c.beta1 = 0.5;
            c.beta2 = 0.7;
          }
          if constexpr (std::is_same_v<C, optim::NAdam> || std::is_same_v<C, optim::RAdam> ||
                        std::is_same_v<C, optim::Adamax>) {
            c.beta1 = 0.5;
            c.beta2 = 0.9;
            c.eps = 1e-3;
          }
          if constexpr (std::is_same_v<C, optim::NAdam>) c.momentum_decay = 0.1;
          if constexpr (std::is_same_v<C, optim::Adadelta>) {
            c.rho = 0.5;
            c.eps = 1e-3;
          }
          if constexpr (std::is_same_v<C, optim::Rprop>) {
            c.eta_minus = 0.2;
            c.eta_plus = 1.5;
            c.step_size_min = 0.01;
            c.step_size_max = 0.1;  // only affects later steps: the state keeps its step sizes
          }
          if constexpr (std::is_same_v<C, optim::ASGD>) {
            c.lambd = 0.2;
            c.alpha = 0.9;
            c.t0 = 1;
          }
        },
        changed);
    rig.opt.set_config(changed);
    rig.setup.config = changed;
    EXPECT_EQ(rig.opt.lr(), learning_rate(changed));
    check_step(rig, StepMode::scaled, 16.0, 1.0);
    EXPECT_EQ(rig.opt.step_count(), 3);
  }
}

// NAdam's mu_product multiplies in each applied step's own mu_t, as torch's does: with beta1
// and momentum_decay changed before every step (OneCycleLR's cycle_momentum), every step
// matches the reference (which takes the product so far and multiplies in this step's
// mu_t), a skipped step multiplies in nothing, and the product stays within an ulp or two
// of torch's fp32 one. (Not carried, the product was 1.2% off torch's at the first failing check.)
TEST(SetConfig, NadamMuProductTakesEachStepsOwnBeta1) {
  RigSetup s;
  optim::NAdam start;
  start.lr = 0.01;
  s.config = start;
  s.sizes = {7, 1000, 33};
  s.max_grad_norm = 5.0;
  s.seed = 5;
  Rig rig(s);
  EXPECT_EQ(rig.opt.nadam_mu_product(0), 1.0);
  EXPECT_EQ(rig.opt.nadam_mu_product_offset(0), 0.0);
  float torch_product = 1.0f;  // torch: state["mu_product"] (fp32) *= mu_t
  std::int64_t applied = 0;
  for (int k = 1; k <= 14; ++k) {
    SCOPED_TRACE("iteration " + std::to_string(k));
    optim::NAdam next = std::get<optim::NAdam>(rig.setup.config);
    next.beta1 = 0.85 + 0.01 * (k % 5);
    next.momentum_decay = k < 8 ? 4e-3 : 0.05;
    rig.opt.set_config(next);
    rig.setup.config = next;
    if (k == 6) {  // a skipped step: the product is unchanged
      const double before = rig.opt.nadam_mu_product(0);
      fill_grads(rig.grads, rig.rng, 1.0, 16.0);
      rig.grads.set(1, 3, kInf);
      ASSERT_FALSE(rig.opt.step_scaled(16.0).applied);
      EXPECT_EQ(rig.opt.nadam_mu_product(0), before);
      continue;
    }
    check_step(rig, StepMode::scaled, 16.0, 1.0);
    ++applied;
    const double mu = next.beta1 * (1 - 0.5 * std::pow(0.96, static_cast<double>(applied) * next.momentum_decay));
    torch_product *= static_cast<float>(mu);
    const double got = rig.opt.nadam_mu_product(0);
    EXPECT_EQ(got, static_cast<double>(static_cast<float>(got))) << "mu_product is kept in fp32, as torch keeps it";
    EXPECT_NEAR(got, torch_product, 2 * std::ldexp(1.0, std::ilogb(torch_product) - 23));
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_EQ(rig.opt.step_count(), applied);
  EXPECT_NE(rig.opt.nadam_mu_product_offset(0), 0.0);

  // Set from outside (a loaded torch state): later steps multiply onto it.
  rig.opt.set_nadam_mu_product(0, 0.25);
  EXPECT_EQ(rig.opt.nadam_mu_product(0), 0.25);
  check_step(rig, StepMode::scaled, 16.0, 1.0);
  // A product that reached 0 stays 0 (torch: 0 * mu), whatever beta1 becomes.
  rig.opt.set_nadam_mu_product(0, 0.0);
  optim::NAdam other = std::get<optim::NAdam>(rig.setup.config);
  other.beta1 = 0.5;
  rig.opt.set_config(other);
  rig.setup.config = other;
  check_step(rig, StepMode::scaled, 16.0, 1.0);
  EXPECT_EQ(rig.opt.nadam_mu_product(0), 0.0);

  // beta1 set to 0 and back with no step between keeps the product (torch's is untouched);
  // a step taken at beta1 0 makes it 0 for good (mu_t = 0).
  rig.opt.set_nadam_mu_product(0, 0.25);
  other.beta1 = 0.0;
  rig.opt.set_config(other);
  EXPECT_EQ(rig.opt.nadam_mu_product(0), 0.25);
  other.beta1 = 0.9;
  rig.opt.set_config(other);
  EXPECT_EQ(rig.opt.nadam_mu_product(0), 0.25);
  other.beta1 = 0.0;
  rig.opt.set_config(other);
  rig.setup.config = other;
  check_step(rig, StepMode::scaled, 16.0, 1.0);
  EXPECT_EQ(rig.opt.nadam_mu_product(0), 0.0);
  other.beta1 = 0.9;
  rig.opt.set_config(other);
  rig.setup.config = other;
  EXPECT_EQ(rig.opt.nadam_mu_product(0), 0.0);
  rig.opt.set_nadam_mu_product(0, 0.5);  // set while beta1 is 0: kept for when it is not
  other.beta1 = 0.0;
  rig.opt.set_config(other);
  rig.opt.set_nadam_mu_product(0, 0.125);
  EXPECT_EQ(rig.opt.nadam_mu_product(0), 0.125);
  other.beta1 = 0.9;
  rig.opt.set_config(other);
  rig.setup.config = other;
  EXPECT_EQ(rig.opt.nadam_mu_product(0), 0.125);

  EXPECT_THROW(rig.opt.set_nadam_mu_product(0, 1.5), Error);
  EXPECT_THROW(rig.opt.set_nadam_mu_product(0, kNaN), Error);
  EXPECT_THROW(rig.opt.set_nadam_mu_product(1, 0.5), Error);
  EXPECT_EQ(rig.opt.nadam_mu_product(0), 0.125) << "a refused value changes nothing";
  RigSetup a;
  a.config = optim::AdamW{};
  a.sizes = {8};
  Rig adamw(a);
  try {
    (void)adamw.opt.nadam_mu_product(0);
    ADD_FAILURE() << "AdamW has no mu_product";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_state);
    EXPECT_NE(std::string(e.what()).find("runs AdamW, not NAdam"), std::string::npos) << e.what();
  }
}

// ---- the norm on plain steps --------------------------------------------------------

// A plain step without clipping needs no reduce pass: no norm unless track_grad_norm.
TEST(GradNorm, PlainStepComputesTheNormOnlyWhenTracked) {
  for (bool track : {false, true})
    for (double norm_type : {2.0, kInf}) {
      SCOPED_TRACE(std::string(track ? "tracked" : "untracked") + (std::isinf(norm_type) ? " inf" : " L2"));
      optim::AdamW adamw;
      adamw.lr = 0.01;
      RigSetup s;
      s.config = adamw;
      s.grad_dtype = DType::bf16;
      s.sizes = {5, 1000, 20000};
      s.norm_type = norm_type;
      s.track_grad_norm = track;
      s.seed = 3;
      Rig rig(s);
      const StepOutcome o = check_step(rig, StepMode::plain, 1.0, 1.0);
      if (!track) {
        EXPECT_TRUE(std::isnan(o.lib.grad_norm));
        EXPECT_TRUE(std::isnan(rig.opt.last_grad_norm()));
      }
      EXPECT_EQ(o.lib.clip_coef, 1.0);
    }
}

// A clipped step whose norm is below max_grad_norm leaves the gradients as they are
// (clip_coef exactly 1); with a loss scale that is not a power of two.
TEST(GradNorm, InactiveClippingAndOddLossScale) {
  optim::SGD sgd;
  sgd.lr = 0.5;
  RigSetup s;
  s.config = sgd;
  s.sizes = {100, 3};
  s.max_grad_norm = 1e6;
  s.seed = 5;
  Rig rig(s);
  const StepOutcome o = check_step(rig, StepMode::scaled, 1000.0, 1.0);
  EXPECT_EQ(o.lib.clip_coef, 1.0);
  check_step(rig, StepMode::scaled, 3.0, 1.0);
}

// clip_grad_norm_ divides by norm + 1e-6: visible only when the norm itself is tiny.
TEST(GradNorm, ClipEpsilonIsAddedToTheNorm) {
  for (double norm_type : {2.0, kInf}) {
    SCOPED_TRACE(std::isinf(norm_type) ? "inf" : "L2");
    optim::SGD sgd;
    sgd.lr = 1e5;  // so that the tiny clipped gradients move the weights visibly
    RigSetup s;
    s.config = sgd;
    s.sizes = {100, 7};
    s.max_grad_norm = 1e-7;
    s.norm_type = norm_type;
    s.seed = 8;
    Rig rig(s);
    const StepOutcome o = check_step(rig, StepMode::scaled, 64.0, 1e-8);  // norm ~1e-7
    EXPECT_LT(o.ref.clip_coef, 0.5);
  }
}

// Prints how close to the tolerances the library came (0 = exact, 1 = at the limit).
class MarginReport : public ::testing::Environment {
 public:
  void TearDown() override {
    const Margins& m = margins();
    std::printf(
        "[ margins  ] worst error/tolerance: fp32 weights %.3g, fp32 state %.3g, norms %.3g; "
        "f16/bf16 weights 1 ulp off in %lld of %lld, more (within the fp32 tolerance, after cancellation) in %lld; "
        "Lion sign-ambiguous elements skipped: %lld\n",
        m.param, m.state, m.norm, static_cast<long long>(m.one_ulp), static_cast<long long>(m.checked16),
        static_cast<long long>(m.cancelled16), static_cast<long long>(m.lion_ambiguous));
  }
};
const auto* const kMarginReport = ::testing::AddGlobalTestEnvironment(new MarginReport);

}  // namespace
}  // namespace stepfuse::ref
