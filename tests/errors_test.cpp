// Bad input (docs/architecture.md §4) throws stepfuse::Error naming the argument and the value, before anything is written.
#include <gmock/gmock-matchers.h>  // header-only matchers: HasSubstr, AnyOf
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "reference/harness.hpp"
#include "reference/test_data.hpp"
#include "reference/test_util.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse::ref {
namespace {

using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Matcher;

// How a value should appear in a message: "-0.5", "1.5", "nan", "inf", "-inf".
std::string shown(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::string s = std::to_string(v);  // "-0.500000"
  s.erase(s.find_last_not_of('0') + 1);
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;  // "-0.5": found in "-0.5", "-0.50" and "-0.500000" alike
}

// A small valid parameter list (caller-owned buffers).
struct Params {
  HostTensors weights{DType::f32, {5, 3, 8}, false};
  HostTensors grads{DType::f32, {5, 3, 8}, false};
  Params() {
    Random rng(1);
    fill_weights(weights, rng);
    fill_grads(grads, rng, 1.0, 1.0);
  }
  std::vector<Param> list() const { return make_params(weights, grads); }
};

// One bad hyperparameter: the config, the field's name and its value.
struct BadConfig {
  OptimizerConfig config;
  Matcher<const std::string&> names;  // the argument's name
  double value;
};

Matcher<const std::string&> field(const char* name) { return HasSubstr(name); }
Matcher<const std::string&> beta(int i) {
  // "beta1" (our field), or PyTorch's "betas" (with the index).
  return i == 1 ? AnyOf(HasSubstr("beta1"), HasSubstr("betas")) : AnyOf(HasSubstr("beta2"), HasSubstr("betas"));
}

// A default C with each listed field set to v in turn, one BadConfig each.
template <class C>
void add_each(std::vector<BadConfig>& bad, double v,
              std::initializer_list<std::pair<Matcher<const std::string&>, double C::*>> fields) {
  for (const auto& [names, member] : fields) {
    C c;
    c.*member = v;
    bad.push_back({c, names, v});
  }
}

std::vector<BadConfig> bad_configs() {
  using namespace optim;
  std::vector<BadConfig> bad;
  // Values PyTorch's __init__ checks reject (negative, NaN, betas outside [0, 1)),
  // and infinities (docs/architecture.md §4: non-finite hyperparameters).
  for (double v : {-0.5, kNaN, kInf}) {
    add_each<SGD>(bad, v, {{field("lr"), &SGD::lr}, {field("momentum"), &SGD::momentum},
                           {field("weight_decay"), &SGD::weight_decay}});
    add_each<Adam>(bad, v, {{field("lr"), &Adam::lr}, {field("eps"), &Adam::eps},
                            {field("weight_decay"), &Adam::weight_decay}});
    add_each<AdamW>(bad, v, {{field("lr"), &AdamW::lr}, {field("eps"), &AdamW::eps},
                             {field("weight_decay"), &AdamW::weight_decay}});
    add_each<Adagrad>(bad, v, {{field("lr"), &Adagrad::lr}, {field("eps"), &Adagrad::eps},
                               {field("weight_decay"), &Adagrad::weight_decay}});
    add_each<RMSprop>(bad, v, {{field("lr"), &RMSprop::lr}, {field("eps"), &RMSprop::eps},
                               {field("weight_decay"), &RMSprop::weight_decay},
                               {field("momentum"), &RMSprop::momentum}});
    add_each<Lion>(bad, v, {{field("lr"), &Lion::lr}, {field("weight_decay"), &Lion::weight_decay}});
  }
  // PyTorch checks these only for being >= 0 (so NaN fails too).
  for (double v : {-0.5, kNaN}) {
    add_each<Adagrad>(bad, v, {{field("lr_decay"), &Adagrad::lr_decay},
                               {field("initial_accumulator_value"), &Adagrad::initial_accumulator_value}});
    add_each<RMSprop>(bad, v, {{field("alpha"), &RMSprop::alpha}});
  }
  // Betas outside [0, 1) (Adam's "Invalid beta parameter at index i").
  for (double v : {-0.1, 1.0, 1.5, kNaN, kInf}) {
    add_each<Adam>(bad, v, {{beta(1), &Adam::beta1}, {beta(2), &Adam::beta2}});
    add_each<AdamW>(bad, v, {{beta(1), &AdamW::beta1}, {beta(2), &AdamW::beta2}});
  }
  // Lion's betas: the paper's reference code asserts 0 <= beta <= 1.
  for (double v : {-0.1, 1.5, kNaN}) add_each<Lion>(bad, v, {{beta(1), &Lion::beta1}, {beta(2), &Lion::beta2}});

  // NAdam, RAdam, Adamax, Adadelta, Rprop, ASGD: PyTorch's checks (>= 0, betas in [0, 1),
  // Adadelta's rho in [0, 1], Rprop's 0 < eta_minus < 1 < eta_plus), and finiteness.
  for (double v : {-0.5, kNaN, kInf}) {
    add_each<NAdam>(bad, v, {{field("lr"), &NAdam::lr}, {field("eps"), &NAdam::eps},
                             {field("weight_decay"), &NAdam::weight_decay},
                             {field("momentum_decay"), &NAdam::momentum_decay}});
    add_each<RAdam>(bad, v, {{field("lr"), &RAdam::lr}, {field("eps"), &RAdam::eps},
                             {field("weight_decay"), &RAdam::weight_decay}});
    add_each<Adamax>(bad, v, {{field("lr"), &Adamax::lr}, {field("eps"), &Adamax::eps},
                              {field("weight_decay"), &Adamax::weight_decay}});
    add_each<Adadelta>(bad, v, {{field("lr"), &Adadelta::lr}, {field("eps"), &Adadelta::eps},
                                {field("weight_decay"), &Adadelta::weight_decay}, {field("rho"), &Adadelta::rho}});
    add_each<Rprop>(bad, v, {{field("lr"), &Rprop::lr}});
    add_each<ASGD>(bad, v, {{field("lr"), &ASGD::lr}, {field("lambd"), &ASGD::lambd}, {field("alpha"), &ASGD::alpha},
                            {field("weight_decay"), &ASGD::weight_decay}});
  }
  for (double v : {-0.1, 1.0, 1.5, kNaN, kInf}) {
    add_each<NAdam>(bad, v, {{beta(1), &NAdam::beta1}, {beta(2), &NAdam::beta2}});
    add_each<RAdam>(bad, v, {{beta(1), &RAdam::beta1}, {beta(2), &RAdam::beta2}});
    add_each<Adamax>(bad, v, {{beta(1), &Adamax::beta1}, {beta(2), &Adamax::beta2}});
  }
  add_each<Adadelta>(bad, 1.5, {{field("rho"), &Adadelta::rho}});
  for (double v : {0.0, 1.0, 1.5, -0.5, kNaN, kInf}) add_each<Rprop>(bad, v, {{field("eta_minus"), &Rprop::eta_minus}});
  for (double v : {1.0, 0.5, -2.0, kNaN, kInf}) add_each<Rprop>(bad, v, {{field("eta_plus"), &Rprop::eta_plus}});
  for (double v : {kNaN, kInf, -kInf}) {
    add_each<Rprop>(bad, v, {{field("step_size_min"), &Rprop::step_size_min},
                             {field("step_size_max"), &Rprop::step_size_max}});
    add_each<ASGD>(bad, v, {{field("t0"), &ASGD::t0}});
  }
  return bad;
}

std::string describe(const BadConfig& b) {
  return std::string(optimizer_name(b.config)) + " with value " + shown(b.value);
}

// ---- construction -------------------------------------------------------------------

TEST(Errors, BadHyperparametersAreRejectedAtConstruction) {
  for (const BadConfig& b : bad_configs()) {
    SCOPED_TRACE(describe(b));
    Params p;
    const auto weights_before = p.weights.snapshot();
    const std::string msg = error_message([&] { Optimizer opt(b.config, p.list()); });
    EXPECT_THAT(msg, b.names);
    EXPECT_THAT(msg, HasSubstr(shown(b.value)));
    EXPECT_EQ(p.weights.snapshot(), weights_before) << "a failed construction wrote the weights";
  }
}

TEST(Errors, NesterovNeedsMomentumAndNoDampening) {
  Params p;
  const optim::SGD no_momentum{.nesterov = true};
  EXPECT_THAT(error_message([&] { Optimizer opt(no_momentum, p.list()); }),
              AllOf(HasSubstr("nesterov"), HasSubstr("momentum")));
  const optim::SGD dampened{.momentum = 0.9, .dampening = 0.25, .nesterov = true};
  EXPECT_THAT(error_message([&] { Optimizer opt(dampened, p.list()); }),
              AllOf(HasSubstr("nesterov"), HasSubstr("dampening"), HasSubstr("0.25")));
}

// The boundaries PyTorch accepts are accepted: zero lr, eps, momentum, betas, decay.
TEST(Errors, BoundaryValuesAreAccepted) {
  Params p;
  const optim::SGD sgd{.lr = 0};
  const std::vector<OptimizerConfig> boundary = {
      sgd,
      optim::Adam{.lr = 0, .beta1 = 0, .beta2 = 0, .eps = 0},
      optim::AdamW{.weight_decay = 0},
      optim::Adagrad{.eps = 0},
      optim::RMSprop{.alpha = 0},
      optim::Lion{.beta1 = 0, .beta2 = 0},
      optim::NAdam{.lr = 0, .beta1 = 0, .beta2 = 0, .eps = 0, .momentum_decay = 0},
      optim::RAdam{.beta1 = 0, .beta2 = 0, .eps = 0},
      optim::Adamax{.beta1 = 0, .beta2 = 0, .eps = 0},
      optim::Adadelta{.rho = 1, .eps = 0},
      optim::Adadelta{.rho = 0},
      optim::Rprop{.eta_minus = 0.999, .eta_plus = 1.001, .step_size_min = -1, .step_size_max = 0},
      optim::ASGD{.lambd = 0, .alpha = 0, .t0 = -5}};
  for (const OptimizerConfig& c : boundary) {
    SCOPED_TRACE(std::string(optimizer_name(c)));
    EXPECT_NO_THROW({ Optimizer opt(c, p.list()); });
  }
  // lr = 0 leaves the weights as they are.
  const auto before = p.weights.snapshot();
  Optimizer opt(sgd, p.list());
  opt.step();
  EXPECT_EQ(p.weights.snapshot(), before);
}

TEST(Errors, NullDataWithElementsIsRejected) {
  for (bool weight : {true, false}) {
    SCOPED_TRACE(weight ? "weight" : "grad");
    Params p;
    auto list = p.list();
    (weight ? list[2].weight : list[2].grad).data = nullptr;
    const auto weights_before = p.weights.snapshot();
    const std::string msg = error_message([&] { Optimizer opt(optim::Adam{}, list); });
    EXPECT_THAT(msg, HasSubstr(weight ? "weight" : "grad"));
    EXPECT_THAT(msg, AnyOf(HasSubstr("null"), HasSubstr("nil"), HasSubstr("0x0")));
    EXPECT_THAT(msg, HasSubstr("2"));  // the parameter's index
    EXPECT_EQ(p.weights.snapshot(), weights_before);
  }
  // Null data is fine for an empty tensor.
  Params p;
  auto list = p.list();
  list.push_back({{nullptr, 0, DType::f32}, {nullptr, 0, DType::f32}});
  EXPECT_NO_THROW({ Optimizer opt(optim::Adam{}, list); });
}

TEST(Errors, SizeMismatchAndNegativeSizesAreRejected) {
  Params p;
  HostTensors big(DType::f32, {9}, false);
  auto list = p.list();
  list[1].grad = big[0];  // weight has 3 elements
  std::string msg = error_message([&] { Optimizer opt(optim::SGD{}, list); });
  EXPECT_THAT(msg, AnyOf(HasSubstr("numel"), HasSubstr("size"), HasSubstr("element")));
  EXPECT_THAT(msg, AllOf(HasSubstr("3"), HasSubstr("9")));

  list = p.list();
  list[0].weight.numel = -5;
  list[0].grad.numel = -5;
  msg = error_message([&] { Optimizer opt(optim::SGD{}, list); });
  EXPECT_THAT(msg, AllOf(HasSubstr("numel"), HasSubstr("-5")));
}

// All nine weight x grad dtype pairs are supported; a value outside the enum is not.
TEST(Errors, UnknownDtypeIsRejected) {
  for (bool weight : {true, false}) {
    SCOPED_TRACE(weight ? "weight" : "grad");
    Params p;
    auto list = p.list();
    (weight ? list[1].weight : list[1].grad).dtype = static_cast<DType>(7);
    const std::string msg = error_message([&] { Optimizer opt(optim::AdamW{}, list); });
    EXPECT_THAT(msg, HasSubstr("dtype"));
    EXPECT_THAT(msg, HasSubstr("7"));
    EXPECT_THAT(msg, HasSubstr(weight ? "weight" : "grad"));
  }
  for (DType w : {DType::f32, DType::f16, DType::bf16})
    for (DType g : {DType::f32, DType::f16, DType::bf16}) {
      HostTensors weights(w, {4}, false), grads(g, {4}, false);
      EXPECT_NO_THROW({ Optimizer opt(optim::AdamW{}, make_params(weights, grads)); })
          << dtype_name(w) << " x " << dtype_name(g);
    }
}

TEST(Errors, BadOptionsAreRejected) {
  Params p;
  for (double norm_type : {1.0, 3.0, -kInf, kNaN, 0.0}) {
    SCOPED_TRACE("norm_type " + shown(norm_type));
    OptimizerOptions o;
    o.norm_type = norm_type;
    o.max_grad_norm = 1.0;
    const std::string msg = error_message([&] { Optimizer opt(optim::SGD{}, p.list(), o); });
    EXPECT_THAT(msg, HasSubstr("norm_type"));
    EXPECT_THAT(msg, HasSubstr(shown(norm_type)));
  }
  for (double max_norm : {0.0, -1.0, kNaN}) {
    SCOPED_TRACE("max_grad_norm " + shown(max_norm));
    OptimizerOptions o;
    o.max_grad_norm = max_norm;
    const std::string msg = error_message([&] { Optimizer opt(optim::SGD{}, p.list(), o); });
    EXPECT_THAT(msg, HasSubstr("max_grad_norm"));
    EXPECT_THAT(msg, HasSubstr(shown(max_norm)));
  }
  {
    OptimizerOptions o;
    o.fusion = static_cast<Fusion>(9);
    const std::string msg = error_message([&] { Optimizer opt(optim::SGD{}, p.list(), o); });
    EXPECT_THAT(msg, AllOf(HasSubstr("fusion"), HasSubstr("9")));
  }
  {
    OptimizerOptions o;
    o.num_threads = -2;
    const std::string msg = error_message([&] { Optimizer opt(optim::SGD{}, p.list(), o); });
    EXPECT_THAT(msg, AllOf(HasSubstr("num_threads"), HasSubstr("-2")));
  }
}

// A device that does not exist is an error (unlike GradScaler's "cuda" string, which
// falls back to the CPU). On a machine with a GPU, cuda(0) is valid: skip that half.
TEST(Errors, UnavailableDeviceIsUnsupported) {
  Params p;
  OptimizerOptions o;
  o.device = Device::cuda(1000);
  std::string msg = error_message([&] { Optimizer opt(optim::Adam{}, p.list(), o); }, ErrorCode::unsupported);
  EXPECT_THAT(msg, HasSubstr("cuda"));
  EXPECT_THAT(msg, HasSubstr("1000"));

  o.device = Device::cuda(0);
  try {
    Optimizer opt(optim::Adam{}, p.list(), o);
  } catch (const Error& e) {
    EXPECT_EQ(error_code_name(e.code()), error_code_name(ErrorCode::unsupported)) << e.what();
    EXPECT_THAT(lower(e.what()), HasSubstr("cuda"));
    return;
  }
  GTEST_SKIP() << "a CUDA device is available here; cuda(0) is valid";
}

// ---- calls on a built optimizer ---------------------------------------------------------

// A built optimizer and a twin built the same way: the bad calls go to the first,
// after which both must behave identically, bit for bit.
struct Twins {
  explicit Twins(OptimizerConfig config) {
    RigSetup s;
    s.config = config;
    s.weight_dtype = DType::bf16;
    s.grad_dtype = DType::f16;
    s.sizes = {5, 1000, 33};
    s.seed = 11;
    s.max_grad_norm = 3.0;
    a = std::make_unique<Rig>(s);
    b = std::make_unique<Rig>(s);
  }
  // One identical scaled step on both.
  void step() {
    fill_grads(a->grads, a->rng, 1.0, 64.0);
    fill_grads(b->grads, b->rng, 1.0, 64.0);
    a->opt.step_scaled(64.0);
    b->opt.step_scaled(64.0);
  }
  void expect_identical() const {
    EXPECT_TRUE(snapshot(a->opt, a->weights) == snapshot(b->opt, b->weights));
    EXPECT_EQ(a->opt.lr(), b->opt.lr());
  }
  std::unique_ptr<Rig> a, b;
};

TEST(Errors, BadLossScaleIsRejectedBeforeAnythingIsWritten) {
  optim::Adam adam;
  adam.lr = 0.05;
  Twins t(adam);
  t.step();
  for (double scale : {0.0, -1.0, -kInf, kInf, kNaN}) {
    SCOPED_TRACE("loss_scale " + shown(scale));
    fill_grads(t.a->grads, t.a->rng, 1.0, 64.0);  // fresh grads, so a bad write would show
    const Snapshot before = snapshot(t.a->opt, t.a->weights);
    const auto grads_before = t.a->grads.snapshot();
    const std::string msg = error_message([&] { t.a->opt.step_scaled(scale); });
    EXPECT_THAT(msg, HasSubstr("scale"));
    EXPECT_THAT(msg, HasSubstr(shown(scale)));
    EXPECT_TRUE(snapshot(t.a->opt, t.a->weights) == before);
    EXPECT_EQ(t.a->grads.snapshot(), grads_before);
    t.a->grads.restore(grads_before);
  }
  // a's generator advanced by the refills above; resynchronize and compare.
  t.b->rng = t.a->rng;
  t.step();
  t.expect_identical();
  EXPECT_EQ(t.a->opt.step_count(), 2);
}

TEST(Errors, SetLrRejectsBadValuesAndKeepsTheOldOne) {
  optim::Lion lion;
  lion.lr = 0.02;
  Twins t(lion);
  t.step();
  for (double lr : {-1.0, kNaN, kInf}) {
    SCOPED_TRACE("lr " + shown(lr));
    const std::string msg = error_message([&] { t.a->opt.set_lr(lr); });
    EXPECT_THAT(msg, HasSubstr("lr"));
    EXPECT_THAT(msg, HasSubstr(shown(lr)));
    EXPECT_EQ(t.a->opt.lr(), 0.02);
    EXPECT_EQ(learning_rate(t.a->opt.config()), 0.02);
  }
  t.step();
  t.expect_identical();
}

TEST(Errors, SetConfigRejectsAnotherKindFlagsAndBadValues) {
  optim::Adam adam;
  adam.lr = 0.05;
  Twins t(adam);
  t.step();

  std::string msg = error_message([&] { t.a->opt.set_config(optim::SGD{}); });
  EXPECT_THAT(msg, AllOf(HasSubstr("sgd"), HasSubstr("adam")));
  msg = error_message([&] { t.a->opt.set_config(optim::AdamW{}); });
  EXPECT_THAT(msg, AllOf(HasSubstr("adamw"), HasSubstr("adam")));

  optim::Adam amsgrad = adam;
  amsgrad.amsgrad = true;
  msg = error_message([&] { t.a->opt.set_config(amsgrad); });
  EXPECT_THAT(msg, HasSubstr("amsgrad"));

  for (const BadConfig& b : bad_configs()) {
    if (!std::holds_alternative<optim::Adam>(b.config)) continue;
    SCOPED_TRACE(describe(b));
    msg = error_message([&] { t.a->opt.set_config(b.config); });
    EXPECT_THAT(msg, b.names);
    EXPECT_THAT(msg, HasSubstr(shown(b.value)));
  }
  EXPECT_EQ(std::get<optim::Adam>(t.a->opt.config()).lr, 0.05);
  EXPECT_EQ(std::get<optim::Adam>(t.a->opt.config()).beta1, 0.9);
  t.step();
  t.expect_identical();

  // Program-shaping flags of the other optimizers.
  struct FlagChange {
    OptimizerConfig from, to;
    const char* name;
  };
  optim::SGD sgd_m;
  sgd_m.momentum = 0.9;
  optim::SGD sgd_plain;
  optim::SGD sgd_nesterov = sgd_m;
  sgd_nesterov.nesterov = true;
  optim::RMSprop rms;
  optim::RMSprop rms_centered;
  rms_centered.centered = true;
  optim::RMSprop rms_momentum;
  rms_momentum.momentum = 0.5;
  const FlagChange changes[] = {{sgd_m, sgd_plain, "momentum"},
                                {sgd_plain, sgd_m, "momentum"},
                                {sgd_m, sgd_nesterov, "nesterov"},
                                {rms, rms_centered, "centered"},
                                {rms, rms_momentum, "momentum"}};
  for (const FlagChange& c : changes) {
    SCOPED_TRACE(c.name);
    Params p;
    Optimizer opt(c.from, p.list());
    EXPECT_THAT(error_message([&] { opt.set_config(c.to); }), HasSubstr(c.name));
  }
}

}  // namespace
}  // namespace stepfuse::ref
