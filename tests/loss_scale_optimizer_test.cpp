// LossScaleOptimizer: the behaviour of Keras's tf.keras.mixed_precision.LossScaleOptimizer
// (TF 2.x), the examples of its documentation exactly, and
// include/stepfuse/loss_scale_optimizer.hpp. Each test quotes the sentence of that
// documentation it pins.
//
// Keras's dynamic loss scale (TF 2.x): on a non-finite step scale = max(scale / 2, 1)
// and counter = 0; on a finite step, if counter + 1 >= growth_steps the scale doubles
// (kept only if finite) and counter = 0, else counter += 1. The scale is fp32.
#include <gmock/gmock-matchers.h>  // header-only matchers: HasSubstr
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "jit/config_fields.hpp"
#include "reference/dtypes.hpp"
#include "reference/harness.hpp"
#include "reference/test_data.hpp"
#include "reference/test_util.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse::ref {
namespace {

using ::testing::HasSubstr;

// Every field of a configuration, as text (the optim structs have no operator==), in
// the order the library lists them (jit/config_fields.hpp; the registry checks at compile
// time that the list names every member).
std::string describe(const OptimizerConfig& config) {
  std::ostringstream os;
  os.precision(17);
  os << optimizer_name(config);
  std::visit([&](const auto& c) { jit::for_each_field(c, [&](std::string_view, const auto& v) { os << " " << v; }); },
             config);
  return os.str();
}

// The model of these tests (reference/test_util.hpp), with gradients clamped to
// |g| <= 1.9: g * S then stays finite in f16 for every S up to 32768 (grad_scale_for).
struct Net : TestNet {
  using TestNet::TestNet;
  std::vector<std::vector<double>> set_grads(std::uint64_t seed, double S) const {
    return TestNet::set_grads(seed, S, 1.9);
  }
};

// The loss scale to store gradients with: S itself when g * S is exact in every dtype
// used here, else 1 (the values then only need to be finite).
double grad_scale_for(double S) {
  int e = 0;
  return (std::frexp(S, &e) == 0.5 && S <= 32768.0) ? S : 1.0;
}

// One finite step through minimize(): backward writes g * loss_scale.
bool finite_step(LossScaleOptimizer& lso, const Net& n, std::uint64_t seed) {
  return lso.minimize([&](double S) { n.set_grads(seed, grad_scale_for(S)); });
}
// One step whose gradients hold `bad` (inf, -inf or NaN).
bool bad_step(LossScaleOptimizer& lso, const Net& n, std::uint64_t seed, double bad = kInf) {
  return lso.minimize([&](double) {
    n.set_grads(seed, 1.0);
    n.g.set(n.g.size() - 1, n.g[n.g.size() - 1].numel - 1, bad);
  });
}

// Weights, every state tensor, masters and the step count, as bytes.
std::vector<std::vector<unsigned char>> capture(const Net& n) {
  auto out = n.w.snapshot();
  for (std::string_view name : n.opt.state_names())
    for (std::size_t i = 0; i < n.opt.num_params(); ++i) out.push_back(bytes_of(n.opt.state(i, name)));
  for (std::size_t i = 0; i < n.opt.num_params(); ++i) out.push_back(bytes_of(n.opt.master(i)));
  const std::int64_t steps = n.opt.step_count();
  out.emplace_back(reinterpret_cast<const unsigned char*>(&steps), reinterpret_cast<const unsigned char*>(&steps) + 8);
  return out;
}

optim::SGD sgd(double lr, double momentum = 0) {
  optim::SGD c;
  c.lr = lr;
  c.momentum = momentum;
  return c;
}
optim::Adam adam() {
  optim::Adam c;
  c.lr = 1e-2;
  c.weight_decay = 0.01;
  c.amsgrad = true;
  return c;
}

const std::vector<std::int64_t> kSizes = {37, 1000, 2051};

// A one-variable model for the document's examples: var and its gradient, f32.
struct Scalar {
  float var = 1.0f;
  float grad = 0.0f;
  TensorView var_view() { return {&var, 1, DType::f32}; }
  TensorView grad_view() { return {&grad, 1, DType::f32}; }
};

// ---------------------------------------------------------------------------
// The document's examples

// "opt = tf.keras.optimizers.SGD(0.25); opt = LossScaleOptimizer(opt); var = tf.Variable(1.);
//  loss_fn = lambda: var ** 2; opt.minimize(loss_fn, var_list=var); var.numpy() → 0.5"
// "Метод minimize автоматически масштабирует потери, не масштабирует градиенты и обновляет
//  масштаб потерь" (minimize scales the loss, unscales the gradients, updates the scale).
TEST(LossScaleOptimizerDoc, ExampleMinimizeGivesHalf) {
  Scalar m;
  Optimizer opt(sgd(0.25), {{m.var_view(), m.grad_view()}});
  LossScaleOptimizer lso(opt);
  int calls = 0;
  double seen_scale = 0;
  // backward of loss * S with loss = var^2: d/dvar = 2 * var * S.
  const bool applied = lso.minimize([&](double loss_scale) {
    ++calls;
    seen_scale = loss_scale;
    m.grad = static_cast<float>(2.0 * m.var * loss_scale);
  });
  EXPECT_TRUE(applied);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen_scale, 32768.0);
  EXPECT_EQ(m.var, 0.5f);
  EXPECT_EQ(m.grad, 65536.0f);  // the fused step does not write the caller's gradients
  EXPECT_EQ(lso.loss_scale(), 32768.0);
  EXPECT_EQ(lso.dynamic_counter(), 1);  // the loss scale was updated: one finite step
  EXPECT_EQ(lso.iterations(), 1);
}

// "with tf.GradientTape() as tape: loss = loss_fn(); scaled_loss = opt.get_scaled_loss(loss)
//  scaled_grad = tape.gradient(scaled_loss, var)
//  (grad,) = opt.get_unscaled_gradients([scaled_grad])
//  opt.apply_gradients([(grad, var)])  # Loss scale is updated here
//  var.numpy() → 0.25"
TEST(LossScaleOptimizerDoc, ExampleManualScalingGivesQuarter) {
  Scalar m;
  Optimizer opt(sgd(0.25), {{m.var_view(), m.grad_view()}});
  LossScaleOptimizer lso(opt);
  lso.minimize([&](double loss_scale) { m.grad = static_cast<float>(2.0 * m.var * loss_scale); });
  ASSERT_EQ(m.var, 0.5f);
  const double loss = static_cast<double>(m.var) * m.var;  // loss_fn()
  const double scaled_loss = lso.get_scaled_loss(loss);
  EXPECT_EQ(scaled_loss, 0.25 * 32768.0);
  // tape.gradient(scaled_loss, var): d(var^2 * S)/dvar = 2 * var * S.
  m.grad = static_cast<float>(2.0 * m.var * lso.loss_scale());
  EXPECT_EQ(m.grad, 32768.0f);
  lso.get_unscaled_gradients({m.grad_view()});
  EXPECT_EQ(m.grad, 1.0f);
  EXPECT_TRUE(lso.apply_gradients());
  EXPECT_EQ(m.var, 0.25f);
  EXPECT_EQ(lso.dynamic_counter(), 2);  // "Loss scale is updated here"
  EXPECT_EQ(lso.loss_scale(), 32768.0);
  EXPECT_EQ(lso.iterations(), 2);
}

// "Масштабирует потерю на масштаб потерь." (get_scaled_loss scales the loss by the loss scale.)
TEST(LossScaleOptimizerDoc, GetScaledLossMultipliesByLossScale) {
  Scalar m;
  Optimizer opt(sgd(0.1), {{m.var_view(), m.grad_view()}});
  LossScaleOptimizer lso(opt);
  EXPECT_EQ(lso.get_scaled_loss(2.0), 65536.0);
  EXPECT_EQ(lso.get_scaled_loss(0.1), 0.1 * 32768.0);
  EXPECT_EQ(lso.get_scaled_loss(-1.5), -1.5 * 32768.0);
  LossScaleOptimizer fixed(opt, false, 3.0);
  EXPECT_EQ(fixed.get_scaled_loss(0.7), 0.7 * 3.0);
  // It follows the current (dynamic) scale.
  m.grad = INFINITY;
  lso.get_unscaled_gradients({m.grad_view()});
  EXPECT_FALSE(lso.apply_gradients());
  EXPECT_EQ(lso.get_scaled_loss(2.0), 32768.0);
}

// ---------------------------------------------------------------------------
// Hyperparameters

// "opt = tf.keras.optimizers.Adam(beta_1=0.8, epsilon=1e-5); opt = LossScaleOptimizer(opt)
//  opt.beta_1 → 0.8;  opt.beta_1 = 0.7;  opt.beta_1 → 0.7;  opt.inner_optimizer.beta_1 → 0.7"
TEST(LossScaleOptimizerDoc, HyperBeta1IsDelegated) {
  Net n(optim::Adam{.lr = 1e-3, .beta1 = 0.8, .eps = 1e-5}, DType::f32, DType::f32, {8});
  LossScaleOptimizer lso(n.opt);
  EXPECT_EQ(lso.get_hyper("beta_1"), 0.8);
  lso.set_hyper("beta_1", 0.7);
  EXPECT_EQ(lso.get_hyper("beta_1"), 0.7);
  EXPECT_EQ(std::get<optim::Adam>(lso.inner_optimizer().config()).beta1, 0.7);
  EXPECT_EQ(std::get<optim::Adam>(n.opt.config()).beta1, 0.7);
  // Nothing else changed.
  EXPECT_EQ(std::get<optim::Adam>(n.opt.config()).eps, 1e-5);
  EXPECT_EQ(std::get<optim::Adam>(n.opt.config()).beta2, 0.999);
  EXPECT_EQ(n.opt.lr(), 1e-3);
  // Changes on the inner optimizer are seen through the wrapper.
  optim::Adam c = std::get<optim::Adam>(n.opt.config());
  c.beta1 = 0.6;
  n.opt.set_config(c);
  EXPECT_EQ(lso.get_hyper("beta_1"), 0.6);
}

// "Однако доступ к негиперпараметрам или их установка не делегируется LossScaleOptimizer. В
//  оптимизаторе Adam, beta_1 является гиперпараметром, но epsilon не является"
// "opt.inner_optimizer.epsilon → 1e-5; opt.epsilon → AttributeError;
//  opt.epsilon = 1e-4  # This does NOT set epsilon on `opt.inner_optimizer`;
//  opt.inner_optimizer.epsilon → 1e-5"
TEST(LossScaleOptimizerDoc, HyperEpsilonIsNotDelegated) {
  Net n(optim::Adam{.lr = 1e-3, .beta1 = 0.8, .eps = 1e-5}, DType::f32, DType::f32, {8});
  LossScaleOptimizer lso(n.opt);
  EXPECT_EQ(std::get<optim::Adam>(lso.inner_optimizer().config()).eps, 1e-5);
  EXPECT_THAT(error_message([&] { (void)lso.get_hyper("epsilon"); }, ErrorCode::invalid_argument),
              HasSubstr("epsilon"));
  EXPECT_THAT(error_message([&] { lso.set_hyper("epsilon", 1e-4); }, ErrorCode::invalid_argument),
              HasSubstr("epsilon"));
  EXPECT_EQ(std::get<optim::Adam>(lso.inner_optimizer().config()).eps, 1e-5);
  // PyTorch's field name is not a Keras hyperparameter name either.
  error_message([&] { (void)lso.get_hyper("eps"); }, ErrorCode::invalid_argument);
  error_message([&] { lso.set_hyper("eps", 1e-4); }, ErrorCode::invalid_argument);
  EXPECT_EQ(std::get<optim::Adam>(n.opt.config()).eps, 1e-5);
}

// Header: ""learning_rate" (alias "lr") for every optimizer".
TEST(LossScaleOptimizerDoc, HyperLearningRateAndLrAlias) {
  const OptimizerConfig configs[] = {sgd(0.3), adam(), optim::AdamW{}, optim::Adagrad{}, optim::RMSprop{},
                                     optim::Lion{}};
  for (const OptimizerConfig& c : configs) {
    SCOPED_TRACE(std::string(optimizer_name(c)));
    Net n(c, DType::f32, DType::f32, {8});
    LossScaleOptimizer lso(n.opt);
    EXPECT_EQ(lso.get_hyper("learning_rate"), n.opt.lr());
    EXPECT_EQ(lso.get_hyper("lr"), n.opt.lr());
    lso.set_hyper("learning_rate", 0.125);
    EXPECT_EQ(n.opt.lr(), 0.125);
    EXPECT_EQ(lso.get_hyper("lr"), 0.125);
    lso.set_hyper("lr", 0.0625);
    EXPECT_EQ(n.opt.lr(), 0.0625);
    EXPECT_EQ(lso.get_hyper("learning_rate"), 0.0625);
  }
}

// Header: ""momentum" for SGD and RMSprop; "rho" for RMSprop (PyTorch's alpha)".
TEST(LossScaleOptimizerDoc, HyperMomentumAndRho) {
  {
    Net n(sgd(0.1, 0.9), DType::f32, DType::f32, {8});
    LossScaleOptimizer lso(n.opt);
    EXPECT_EQ(lso.get_hyper("momentum"), 0.9);
    lso.set_hyper("momentum", 0.5);
    EXPECT_EQ(std::get<optim::SGD>(n.opt.config()).momentum, 0.5);
    EXPECT_EQ(lso.get_hyper("momentum"), 0.5);
  }
  {
    optim::RMSprop c;
    c.alpha = 0.9;
    c.momentum = 0.8;
    Net n(c, DType::f32, DType::f32, {8});
    LossScaleOptimizer lso(n.opt);
    EXPECT_EQ(lso.get_hyper("rho"), 0.9);
    EXPECT_EQ(lso.get_hyper("momentum"), 0.8);
    lso.set_hyper("rho", 0.95);
    lso.set_hyper("momentum", 0.25);
    const auto& r = std::get<optim::RMSprop>(n.opt.config());
    EXPECT_EQ(r.alpha, 0.95);
    EXPECT_EQ(r.momentum, 0.25);
    EXPECT_EQ(r.eps, 1e-8);
    EXPECT_EQ(lso.get_hyper("rho"), 0.95);
    // "alpha" is PyTorch's name, not Keras's.
    error_message([&] { (void)lso.get_hyper("alpha"); }, ErrorCode::invalid_argument);
  }
}

// Header: ""beta_1", "beta_2" for Adam, AdamW and Lion".
TEST(LossScaleOptimizerDoc, HyperBeta2AndOtherOptimizers) {
  {
    Net n(adam(), DType::f32, DType::f32, {8});
    LossScaleOptimizer lso(n.opt);
    EXPECT_EQ(lso.get_hyper("beta_2"), 0.999);
    lso.set_hyper("beta_2", 0.99);
    EXPECT_EQ(std::get<optim::Adam>(n.opt.config()).beta2, 0.99);
    EXPECT_EQ(std::get<optim::Adam>(n.opt.config()).beta1, 0.9);
  }
  {
    Net n(optim::AdamW{}, DType::f32, DType::f32, {8});
    LossScaleOptimizer lso(n.opt);
    lso.set_hyper("beta_1", 0.85);
    lso.set_hyper("beta_2", 0.95);
    EXPECT_EQ(std::get<optim::AdamW>(n.opt.config()).beta1, 0.85);
    EXPECT_EQ(std::get<optim::AdamW>(n.opt.config()).beta2, 0.95);
  }
  {
    Net n(optim::Lion{}, DType::f32, DType::f32, {8});
    LossScaleOptimizer lso(n.opt);
    EXPECT_EQ(lso.get_hyper("beta_1"), 0.9);
    EXPECT_EQ(lso.get_hyper("beta_2"), 0.99);
    lso.set_hyper("beta_2", 0.98);
    EXPECT_EQ(std::get<optim::Lion>(n.opt.config()).beta2, 0.98);
  }
}

// Header: "Anything else ... is Error(invalid_argument)" — a name the inner optimizer lacks.
TEST(LossScaleOptimizerDoc, HyperNameTheInnerOptimizerLacksThrows) {
  struct Case {
    OptimizerConfig config;
    const char* name;
  };
  const Case cases[] = {{adam(), "momentum"},           {adam(), "rho"},       {adam(), "weight_decay"},
                        {adam(), "beta1"},              {adam(), ""},          {sgd(0.1, 0.9), "beta_1"},
                        {sgd(0.1, 0.9), "rho"},         {sgd(0.1), "nesterov"}, {optim::Adagrad{}, "momentum"},
                        {optim::Adagrad{}, "beta_1"},   {optim::Lion{}, "momentum"}, {optim::RMSprop{}, "beta_2"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(optimizer_name(c.config)) + " \"" + c.name + "\"");
    Net n(c.config, DType::f32, DType::f32, {8});
    LossScaleOptimizer lso(n.opt);
    const std::string before = describe(n.opt.config());
    error_message([&] { (void)lso.get_hyper(c.name); }, ErrorCode::invalid_argument);
    error_message([&] { lso.set_hyper(c.name, 0.5); }, ErrorCode::invalid_argument);
    EXPECT_EQ(describe(n.opt.config()), before);
  }
}

// Header: "set_hyper validates as Optimizer::set_config does" — nothing changes on an Error.
TEST(LossScaleOptimizerDoc, HyperSetInvalidValueThrowsAndChangesNothing) {
  Net n(adam(), DType::f32, DType::f32, {8});
  LossScaleOptimizer lso(n.opt);
  const std::string before = describe(n.opt.config());
  for (double v : {1.0, 1.5, -0.1, kNaN}) {
    SCOPED_TRACE(v);
    error_message([&] { lso.set_hyper("beta_1", v); }, ErrorCode::invalid_argument);
    error_message([&] { lso.set_hyper("beta_2", v); }, ErrorCode::invalid_argument);
  }
  for (double v : {-1.0, kNaN, kInf}) {
    SCOPED_TRACE(v);
    error_message([&] { lso.set_hyper("learning_rate", v); }, ErrorCode::invalid_argument);
  }
  EXPECT_EQ(describe(n.opt.config()), before);
  EXPECT_EQ(lso.get_hyper("beta_1"), 0.9);
}

// Header: "hyper_names(): the names get_hyper accepts, without aliases".
TEST(LossScaleOptimizerDoc, HyperNames) {
  auto names = [](const OptimizerConfig& c) {
    Net n(c, DType::f32, DType::f32, {4});
    LossScaleOptimizer lso(n.opt);
    auto v = lso.hyper_names();
    std::sort(v.begin(), v.end());
    for (const std::string& name : v) EXPECT_NO_THROW((void)lso.get_hyper(name)) << name;
    return v;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(names(adam()), (V{"beta_1", "beta_2", "learning_rate"}));
  EXPECT_EQ(names(optim::AdamW{}), (V{"beta_1", "beta_2", "learning_rate"}));
  EXPECT_EQ(names(optim::Lion{}), (V{"beta_1", "beta_2", "learning_rate"}));
  EXPECT_EQ(names(sgd(0.1, 0.9)), (V{"learning_rate", "momentum"}));
  EXPECT_EQ(names(optim::RMSprop{}), (V{"learning_rate", "momentum", "rho"}));
  EXPECT_EQ(names(optim::Adagrad{}), (V{"learning_rate"}));
  EXPECT_EQ(names(optim::NAdam{}), (V{"beta_1", "beta_2", "learning_rate"}));  // Keras's Nadam
  EXPECT_EQ(names(optim::Adamax{}), (V{"beta_1", "beta_2", "learning_rate"}));
  EXPECT_EQ(names(optim::Adadelta{}), (V{"learning_rate", "rho"}));
  EXPECT_EQ(names(optim::RAdam{}), (V{"learning_rate"}));  // Keras has no RAdam, Rprop or ASGD
  EXPECT_EQ(names(optim::Rprop{}), (V{"learning_rate"}));
  EXPECT_EQ(names(optim::ASGD{}), (V{"learning_rate"}));
}

// "LossScaleOptimizer делегирует все общедоступные методы Optimizer внутреннему оптимизатору."
// (delegates all public Optimizer methods to the inner optimizer): lr, set_lr, iterations.
TEST(LossScaleOptimizerDoc, DelegatesLrAndIterations) {
  Net n(sgd(0.1), DType::f32, DType::f32, {16});
  LossScaleOptimizer lso(n.opt, true, 1024.0);
  EXPECT_EQ(&lso.inner_optimizer(), &n.opt);
  EXPECT_EQ(lso.lr(), 0.1);
  lso.set_lr(0.05);
  EXPECT_EQ(n.opt.lr(), 0.05);
  EXPECT_EQ(lso.lr(), 0.05);
  EXPECT_EQ(lso.get_hyper("learning_rate"), 0.05);
  n.opt.set_lr(0.02);
  EXPECT_EQ(lso.lr(), 0.02);
  error_message([&] { lso.set_lr(-1.0); }, ErrorCode::invalid_argument);
  EXPECT_EQ(lso.lr(), 0.02);
  EXPECT_EQ(lso.iterations(), 0);
  EXPECT_TRUE(finite_step(lso, n, 1));
  EXPECT_EQ(lso.iterations(), 1);
  EXPECT_FALSE(bad_step(lso, n, 2));
  EXPECT_EQ(lso.iterations(), 1);  // a skipped step is not an iteration of the inner optimizer
  EXPECT_TRUE(finite_step(lso, n, 3));
  EXPECT_EQ(lso.iterations(), 2);
  EXPECT_EQ(n.opt.step_count(), 2);
  // The new learning rate is the one used.
  const auto g = n.set_grads(4, 1.0);  // already unscaled, for apply_gradients
  const auto w_before = n.w.values(0);
  EXPECT_TRUE(lso.apply_gradients());
  for (std::int64_t j = 0; j < 16; ++j) {
    const double expected = w_before[static_cast<std::size_t>(j)] - 0.02 * g[0][static_cast<std::size_t>(j)];
    EXPECT_NEAR(n.w.get(0, j), expected, 1e-6 * (std::fabs(expected) + 1e-3)) << j;
  }
}

// ---------------------------------------------------------------------------
// Construction

// Signature defaults: dynamic=True, initial_scale=2**15, dynamic_growth_steps=2000.
TEST(LossScaleOptimizerDoc, ConstructorDefaults) {
  Net n(sgd(0.1), DType::f32, DType::f32, {4});
  LossScaleOptimizer lso(n.opt);
  EXPECT_TRUE(lso.dynamic());
  EXPECT_EQ(lso.loss_scale(), 32768.0);
  EXPECT_EQ(lso.dynamic_growth_steps(), 2000);
  EXPECT_EQ(lso.dynamic_counter(), 0);
  LossScaleOptimizer fixed(n.opt, false, 128.0, 7);
  EXPECT_FALSE(fixed.dynamic());
  EXPECT_EQ(fixed.loss_scale(), 128.0);
  LossScaleOptimizer other(n.opt, true, 0.1, 7);
  EXPECT_EQ(other.loss_scale(), f32(0.1));  // an fp32 value, as in Keras
  EXPECT_EQ(other.dynamic_growth_steps(), 7);
}

// Header: "Throws Error(invalid_argument) for initial_scale not finite and above 2^-128 or
// dynamic_growth_steps < 1." (2^-128 and 1e-39: their fp32 reciprocals overflow.)
TEST(LossScaleOptimizerDoc, ConstructorRejectsInvalidValues) {
  Net n(sgd(0.1), DType::f32, DType::f32, {4});
  for (bool dynamic : {true, false})
    for (double v : {0.0, -1.0, kNaN, kInf, -kInf, 0x1p-128, 1e-39}) {
      SCOPED_TRACE(std::to_string(v) + (dynamic ? " dynamic" : " fixed"));
      EXPECT_THAT(error_message([&] { LossScaleOptimizer l(n.opt, dynamic, v); }, ErrorCode::invalid_argument),
                  HasSubstr("initial_scale"));
    }
  for (std::int64_t v : {std::int64_t{0}, std::int64_t{-1}, std::numeric_limits<std::int64_t>::min()}) {
    SCOPED_TRACE(v);
    EXPECT_THAT(error_message([&] { LossScaleOptimizer l(n.opt, true, 1024.0, v); }, ErrorCode::invalid_argument),
                HasSubstr("growth_steps"));
  }
}

// ---------------------------------------------------------------------------
// Dynamic loss scale

// Header: the scale "halves (never below 1) when a step's gradients are not finite, and
// resets the counter".
// Document: "пропускает применение градиентов, если какой-либо градиент имеет бесконечное
// значение" (skips applying the gradients if any gradient is not finite) — inf, -inf, NaN.
TEST(LossScaleOptimizerDoc, DynamicHalvesOnEveryKindOfNonFinite) {
  Net n(sgd(0.1), DType::f32, DType::f32, kSizes);
  LossScaleOptimizer lso(n.opt, true, 1024.0, 3);
  EXPECT_TRUE(finite_step(lso, n, 1));
  EXPECT_TRUE(finite_step(lso, n, 2));
  EXPECT_EQ(lso.dynamic_counter(), 2);
  double expected = 1024.0;
  for (double bad : {kInf, -kInf, kNaN}) {
    SCOPED_TRACE(bad);
    EXPECT_FALSE(bad_step(lso, n, 3, bad));
    expected /= 2;
    EXPECT_EQ(lso.loss_scale(), expected);
    EXPECT_EQ(lso.dynamic_counter(), 0);
    EXPECT_FALSE(lso.last_result().applied);
    EXPECT_TRUE(lso.last_result().found_inf);
  }
  // Through apply_gradients too.
  n.set_grads(4, 1.0);
  n.g.set(1, 500, kNaN);
  EXPECT_FALSE(lso.apply_gradients());
  EXPECT_EQ(lso.loss_scale(), 64.0);
  EXPECT_EQ(n.opt.step_count(), 2);
}

// "halves ... (not below 1)": scale = max(scale / 2, 1).
TEST(LossScaleOptimizerDoc, DynamicNeverBelowOne) {
  Net n(sgd(0.1), DType::f32, DType::f32, {16});
  LossScaleOptimizer lso(n.opt, true, 2.0, 3);
  EXPECT_FALSE(bad_step(lso, n, 1));
  EXPECT_EQ(lso.loss_scale(), 1.0);
  for (int k = 0; k < 3; ++k) {
    EXPECT_FALSE(bad_step(lso, n, 2 + k));
    EXPECT_EQ(lso.loss_scale(), 1.0);
    EXPECT_EQ(lso.dynamic_counter(), 0);
  }
  LossScaleOptimizer odd(n.opt, true, 3.0, 3);
  EXPECT_FALSE(bad_step(odd, n, 5));
  EXPECT_EQ(odd.loss_scale(), 1.5);
  EXPECT_FALSE(bad_step(odd, n, 6));
  EXPECT_EQ(odd.loss_scale(), 1.0);  // max(0.75, 1)
  // Growth from 1 works as usual.
  for (int k = 0; k < 3; ++k) EXPECT_TRUE(finite_step(lso, n, 10 + k));
  EXPECT_EQ(lso.loss_scale(), 2.0);
}

// Header: "doubles after dynamic_growth_steps finite steps in a row"; Keras: counter + 1 >=
// growth_steps -> double and counter = 0, else counter += 1.
TEST(LossScaleOptimizerDoc, DynamicDoublesAfterGrowthSteps) {
  Net n(sgd(0.01), DType::f32, DType::f32, kSizes);
  LossScaleOptimizer lso(n.opt, true, 1024.0, 3);
  const std::int64_t counters[] = {1, 2, 0, 1, 2, 0, 1};
  const double scales[] = {1024, 1024, 2048, 2048, 2048, 4096, 4096};
  for (int k = 0; k < 7; ++k) {
    SCOPED_TRACE(k);
    EXPECT_TRUE(finite_step(lso, n, k));
    EXPECT_EQ(lso.dynamic_counter(), counters[k]);
    EXPECT_EQ(lso.loss_scale(), scales[k]);
  }
  // A skip in between resets the count.
  EXPECT_TRUE(finite_step(lso, n, 20));
  EXPECT_EQ(lso.dynamic_counter(), 2);
  EXPECT_FALSE(bad_step(lso, n, 21));
  EXPECT_EQ(lso.loss_scale(), 2048.0);
  EXPECT_EQ(lso.dynamic_counter(), 0);
  EXPECT_TRUE(finite_step(lso, n, 22));
  EXPECT_TRUE(finite_step(lso, n, 23));
  EXPECT_EQ(lso.loss_scale(), 2048.0);
  EXPECT_TRUE(finite_step(lso, n, 24));
  EXPECT_EQ(lso.loss_scale(), 4096.0);
  // growth_steps = 1: every finite step doubles.
  LossScaleOptimizer every(n.opt, true, 4.0, 1);
  for (int k = 0; k < 3; ++k) EXPECT_TRUE(finite_step(every, n, 30 + k));
  EXPECT_EQ(every.loss_scale(), 32.0);
  EXPECT_EQ(every.dynamic_counter(), 0);
}

// Keras: the doubled scale is assigned only if finite; the fp32 scale never becomes inf.
TEST(LossScaleOptimizerDoc, DynamicGrowthToInfIsNotKept) {
  Net n(sgd(0.0), DType::f32, DType::f32, {16});
  LossScaleOptimizer lso(n.opt, true, 0x1p127, 1);
  for (int k = 0; k < 3; ++k) {
    EXPECT_TRUE(finite_step(lso, n, k));
    EXPECT_EQ(lso.loss_scale(), 0x1p127);
    EXPECT_EQ(lso.dynamic_counter(), 0);
  }
  LossScaleOptimizer m(n.opt, true, FLT_MAX, 2);
  for (int k = 0; k < 4; ++k) EXPECT_TRUE(finite_step(m, n, k));
  EXPECT_EQ(m.loss_scale(), static_cast<double>(FLT_MAX));
  EXPECT_EQ(m.dynamic_counter(), 0);
}

// README: "`dynamic = false` keeps it fixed" — through skipped and finite steps.
TEST(LossScaleOptimizerDoc, FixedScaleStaysThroughSkipsAndFiniteSteps) {
  Net n(adam(), DType::f32, DType::f32, kSizes);
  LossScaleOptimizer lso(n.opt, false, 256.0, 2);
  for (int k = 0; k < 5; ++k) {
    SCOPED_TRACE(k);
    EXPECT_TRUE(finite_step(lso, n, k));
    EXPECT_EQ(lso.loss_scale(), 256.0);
    EXPECT_EQ(lso.dynamic_counter(), 0);
  }
  const auto before = capture(n);
  EXPECT_FALSE(bad_step(lso, n, 9));  // "skips applying gradients if any is not finite"
  EXPECT_TRUE(before == capture(n));
  EXPECT_EQ(lso.loss_scale(), 256.0);
  EXPECT_EQ(lso.dynamic_counter(), 0);
  EXPECT_EQ(lso.iterations(), 5);
  EXPECT_FALSE(lso.dynamic());
}

// "LossScaleOptimizer время от времени будет пропускать применение градиентов к переменным, в
//  этом случае изменяемые переменные не будут изменены на этом шаге." (variables are not
// changed on a skipped step). Header: "A step with inf/NaN gradients is skipped: nothing is
// written." — weights, state, masters, step count; by minimize and by apply_gradients.
TEST(LossScaleOptimizerDoc, SkippedStepWritesNothing) {
  struct Combo {
    DType weight, grad;
  };
  for (const Combo& c : {Combo{DType::f32, DType::f32}, Combo{DType::f16, DType::bf16}, Combo{DType::bf16, DType::f16}})
    for (bool via_minimize : {true, false})
      for (double bad : {kInf, -kInf, kNaN}) {
        SCOPED_TRACE(std::string(dtype_name(c.weight)) + "/" + std::string(dtype_name(c.grad)) +
                     (via_minimize ? " minimize " : " apply_gradients ") + std::to_string(bad));
        Net n(adam(), c.weight, c.grad, kSizes, 3);
        LossScaleOptimizer lso(n.opt, true, 1024.0, 100);
        ASSERT_TRUE(finite_step(lso, n, 1));
        const auto before_iterations = lso.iterations();
        std::vector<std::vector<unsigned char>> before;
        bool applied = true;
        if (via_minimize) {
          applied = lso.minimize([&](double S) {
            n.set_grads(2, S);
            n.g.set(1, 333, bad);
            before = capture(n);
          });
        } else {
          n.set_grads(2, 1.0);
          n.g.set(0, 0, bad);
          before = capture(n);
          applied = lso.apply_gradients();
        }
        EXPECT_FALSE(applied);
        EXPECT_TRUE(before == capture(n));
        EXPECT_EQ(lso.iterations(), before_iterations);
        EXPECT_EQ(lso.loss_scale(), 512.0);
      }
}

// "В методах minimize и apply_gradients, он дополнительно обновляет масштаб потерь и
//  пропускает применение градиентов" — the realistic case: g * S overflows f16 to inf, the
// step is skipped and the scale halves until g * S fits.
TEST(LossScaleOptimizerDoc, F16OverflowSkipsThenFits) {
  Net n(sgd(0.5), DType::f32, DType::f16, {3});
  LossScaleOptimizer lso(n.opt);  // 32768
  const auto w0 = n.w.values(0);
  std::vector<double> seen;
  auto backward = [&](double S) {
    seen.push_back(S);
    for (std::int64_t j = 0; j < 3; ++j) n.g.set(0, j, 3.0 * S);  // 98304 > 65504: inf in f16
  };
  EXPECT_FALSE(lso.minimize(backward));
  EXPECT_EQ(n.w.values(0), w0);
  EXPECT_EQ(lso.loss_scale(), 16384.0);
  EXPECT_TRUE(lso.minimize(backward));  // 49152 fits
  EXPECT_EQ(seen, (std::vector<double>{32768.0, 16384.0}));
  for (std::int64_t j = 0; j < 3; ++j) EXPECT_EQ(n.w.get(0, j), f32(w0[static_cast<std::size_t>(j)] - 1.5));
  EXPECT_EQ(lso.dynamic_counter(), 1);
}

// "Обычно первые 2-15 шагов модели пропускаются, так как начальный масштаб потерь очень
//  высок, но после этого шаги пропускаются в среднем в 0,05% случаев (доля пропущенных
//  шагов — 1 / dynamic_growth_steps)." (the first 2-15 steps are usually skipped because the
// initial scale is very high; after that the fraction of skipped steps is about
// 1 / dynamic_growth_steps.) Gradients of 100 in f16 overflow for S >= 1024: from 2^15, 6
// skips down to 512, then one skip (the growth to 1024) per 10 finite steps.
TEST(LossScaleOptimizerDoc, SkipRateIsAboutOneOverGrowthSteps) {
  Net n(sgd(1e-6), DType::f32, DType::f16, {64});
  LossScaleOptimizer lso(n.opt, true, 32768.0, 10);
  auto step = [&] {
    return lso.minimize([&](double S) {
      for (std::int64_t j = 0; j < 64; ++j) n.g.set(0, j, 100.0 * S);
    });
  };
  for (int k = 0; k < 6; ++k) EXPECT_FALSE(step()) << k;
  EXPECT_EQ(lso.loss_scale(), 512.0);
  int skipped = 0;
  for (int k = 0; k < 110; ++k) {
    if (!step()) ++skipped;
    EXPECT_TRUE(lso.loss_scale() == 512.0 || lso.loss_scale() == 1024.0) << lso.loss_scale();
  }
  EXPECT_EQ(skipped, 10);  // 1 / (growth_steps + 1) of the steps
  EXPECT_EQ(lso.iterations(), 100);
}

// ---------------------------------------------------------------------------
// get_unscaled_gradients

// "Рассмасштабирует градиенты на масштаб потерь." (unscales the gradients by the loss
// scale) — in place, every storage dtype; exact for a power-of-two scale.
TEST(LossScaleOptimizerDoc, GetUnscaledGradientsEachDtype) {
  Net n(sgd(0.1), DType::f32, DType::f32, {4});
  LossScaleOptimizer lso(n.opt);  // 32768
  HostTensors a(DType::f32, {1000}, false), b(DType::f16, {333, 0}, false), c(DType::bf16, {77}, false);
  Random rng(5);
  std::vector<std::vector<double>> expected;
  for (const HostTensors* t : {&a, &b, &c})
    for (std::size_t i = 0; i < t->size(); ++i) {
      expected.emplace_back();
      for (std::int64_t j = 0; j < (*t)[i].numel; ++j) {
        t->set(i, j, std::clamp(0.5 * rng.normal(), -1.9, 1.9));
        expected.back().push_back(t->get(i, j));
        t->set(i, j, t->get(i, j) * 32768.0);
      }
    }
  lso.get_unscaled_gradients({a[0], b[0], b[1], c[0]});
  std::size_t k = 0;
  for (const HostTensors* t : {&a, &b, &c})
    for (std::size_t i = 0; i < t->size(); ++i, ++k) {
      SCOPED_TRACE(std::string(dtype_name(t->dtype())) + " tensor " + std::to_string(i));
      EXPECT_EQ(t->values(i), expected[k]);
    }
  // Non-finite values stay non-finite (the step that follows then skips).
  a.set(0, 7, kInf);
  b.set(0, 8, kNaN);
  lso.get_unscaled_gradients({a[0], b[0]});
  EXPECT_TRUE(std::isinf(a.get(0, 7)));
  EXPECT_TRUE(std::isnan(b.get(0, 8)));
  lso.get_unscaled_gradients({});  // nothing to do
  EXPECT_EQ(lso.loss_scale(), 32768.0);  // unscaling does not update the scale
  EXPECT_EQ(lso.dynamic_counter(), 0);
}

// Header: "Divides each tensor in place by loss_scale() (multiplies by its fp32
// reciprocal), rounding to the storage dtype."
TEST(LossScaleOptimizerDoc, GetUnscaledGradientsUsesFp32Reciprocal) {
  Net n(sgd(0.1), DType::f32, DType::f32, {4});
  LossScaleOptimizer lso(n.opt, false, 3.0);
  const float inv = static_cast<float>(1.0 / 3.0);
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    HostTensors t(dt, {257}, false);
    Random rng(9);
    std::vector<double> before;
    for (std::int64_t j = 0; j < 257; ++j) {
      t.set(0, j, rng.normal() * 3.0);
      before.push_back(t.get(0, j));
    }
    lso.get_unscaled_gradients({t[0]});
    int bad = 0;
    for (std::int64_t j = 0; j < 257; ++j) {
      const float p = static_cast<float>(before[static_cast<std::size_t>(j)]) * inv;
      const double expected = round_to_dtype(p, dt);
      if (t.get(0, j) != expected && ++bad <= 5)
        ADD_FAILURE() << "element " << j << ": " << t.get(0, j) << ", expected " << expected;
    }
  }
}

// ---------------------------------------------------------------------------
// minimize == get_scaled_loss + get_unscaled_gradients + apply_gradients

// "Если для вычисления градиентов используется tf.GradientTape, а не minimize, вы должны
//  вручную масштабировать потери и градиенты." (with a tape instead of minimize, scale the
// loss and unscale the gradients by hand) — both ways give the same training run.
TEST(LossScaleOptimizerDoc, MinimizeEqualsManualPath) {
  struct Combo {
    DType weight, grad;
  };
  for (const Combo& c : {Combo{DType::f32, DType::f32}, Combo{DType::f16, DType::bf16}, Combo{DType::f32, DType::f16}}) {
    SCOPED_TRACE(std::string(dtype_name(c.weight)) + "/" + std::string(dtype_name(c.grad)));
    Net fused(adam(), c.weight, c.grad, kSizes, 7);
    Net manual(adam(), c.weight, c.grad, kSizes, 7);
    LossScaleOptimizer a(fused.opt, true, 1024.0, 2);
    LossScaleOptimizer b(manual.opt, true, 1024.0, 2);
    const bool finite[] = {true, true, false, true, true, true, false, true};
    int it = 0;
    for (bool ok : finite) {
      SCOPED_TRACE(it);
      ++it;
      const bool ra = a.minimize([&](double S) {
        fused.set_grads(100 + it, S);
        if (!ok) fused.g.set(2, 7, kInf);
      });
      manual.set_grads(100 + it, b.loss_scale());
      if (!ok) manual.g.set(2, 7, kInf);
      b.get_unscaled_gradients(manual.grad_views());
      const bool rb = b.apply_gradients();
      EXPECT_EQ(ra, ok);
      EXPECT_EQ(rb, ok);
      EXPECT_EQ(a.loss_scale(), b.loss_scale());
      EXPECT_EQ(a.dynamic_counter(), b.dynamic_counter());
      expect_nets_close(fused, manual);
    }
    EXPECT_EQ(fused.opt.step_count(), 6);
    // 1024: +,+ -> 2048; inf -> 1024; +,+ -> 2048; +; inf -> 1024; +
    EXPECT_EQ(a.loss_scale(), 1024.0);
    EXPECT_EQ(a.dynamic_counter(), 1);
  }
}

// Header: "last_result(): What the last apply_gradients()/minimize() did (applied == false:
// skipped)."
TEST(LossScaleOptimizerDoc, LastResult) {
  Net n(sgd(0.1), DType::f32, DType::f32, kSizes);
  LossScaleOptimizer lso(n.opt, true, 1024.0);
  std::vector<std::vector<double>> g;
  EXPECT_TRUE(lso.minimize([&](double S) { g = n.set_grads(1, S); }));
  double sq = 0;
  for (const auto& t : g)
    for (double x : t) sq += x * x;
  EXPECT_TRUE(lso.last_result().applied);
  EXPECT_FALSE(lso.last_result().found_inf);
  EXPECT_NEAR(lso.last_result().grad_norm, std::sqrt(sq), 1e-5 * std::sqrt(sq));  // of the unscaled grads
  EXPECT_EQ(lso.last_result().clip_coef, 1.0);
  EXPECT_FALSE(bad_step(lso, n, 2, kNaN));
  EXPECT_FALSE(lso.last_result().applied);
  EXPECT_TRUE(lso.last_result().found_inf);
  n.set_grads(3, 1.0);
  EXPECT_TRUE(lso.apply_gradients());
  EXPECT_TRUE(lso.last_result().applied);
  EXPECT_FALSE(lso.last_result().found_inf);
}

// The inner optimizer's clipping (OptimizerOptions::max_grad_norm) applies to the
// unscaled gradients inside minimize's fused step.
TEST(LossScaleOptimizerDoc, MinimizeClipsUnscaledGradients) {
  OptimizerOptions o;
  o.max_grad_norm = 1.0;
  Net n(sgd(1.0), DType::f32, DType::f32, kSizes, 2, o);
  Net w0(sgd(1.0), DType::f32, DType::f32, kSizes, 2);
  LossScaleOptimizer lso(n.opt);
  std::vector<std::vector<double>> g;
  EXPECT_TRUE(lso.minimize([&](double S) { g = n.set_grads(4, S); }));
  const double coef = 1.0 / (l2_norm(g) + 1e-6);
  ASSERT_LT(coef, 0.5);
  EXPECT_NEAR(lso.last_result().clip_coef, coef, 1e-5 * coef);
  expect_clipped_sgd_step(n, w0, g, coef);
}

}  // namespace
}  // namespace stepfuse::ref
