// Adamax (torch.optim.Adamax): the update program and the optimizer's traits.
#pragma once

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// PyTorch (single-tensor path): g = ±grad + wd*p; m = b1*m + (1-b1)*g;
// u = max(u*b2, |g| + eps); p -= (clr*m)/u (addcdiv's order), clr = lr / (1 - b1^t).
// The max takes |g| + eps first: a NaN gradient (a plain step) propagates into u as
// torch.maximum propagates it.
constexpr Program make_adamax() {
  ProgramBuilder b("adamax");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream exp_avg = b.stream("exp_avg", StreamRole::state);
  const Stream exp_inf = b.stream("exp_inf", StreamRole::state, 0.0f, StateValues::nonnegative);
  const Value p = b.load(param);
  Value g = b.mul(b.load(grad), b.scalar("gscale"));
  g = l2_decayed(b, g, p, "weight_decay");
  const Value m = b.add(b.mul(b.scalar("beta1"), b.load(exp_avg)), b.mul(b.scalar("one_minus_beta1"), g));
  const Value u = b.max(b.add(b.abs(g), b.scalar("eps")), b.mul(b.load(exp_inf), b.scalar("beta2")));
  b.store(exp_avg, m);
  b.store(exp_inf, u);
  b.store(param, b.sub(p, b.div(b.mul(b.scalar("clr"), m), u)));
  return b.build();
}

inline constexpr Program kAdamax = make_adamax();

template <>
struct OptimizerTraits<optim::Adamax> : TraitsDefaults {
  static constexpr std::string_view name = "Adamax";
  static constexpr const Program* programs[] = {&kAdamax};

  static void validate(const optim::Adamax& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.at_least("eps", c.eps, 0.0);
    ck.unit_interval("beta1", c.beta1);
    ck.unit_interval("beta2", c.beta2);
    ck.at_least("weight_decay", c.weight_decay, 0.0);
  }

  static void scalars(const optim::Adamax& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("weight_decay", c.weight_decay);
    w.set("beta1", c.beta1);
    w.set("one_minus_beta1", 1.0 - c.beta1);
    w.set("eps", c.eps);
    w.set("beta2", c.beta2);
    w.rule("clr", SF_RULE_DIV_ONE_MINUS_POW, c.lr, c.beta1);
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("beta1", c.beta1), f("beta2", c.beta2), f("eps", c.eps), f("weight_decay", c.weight_decay);
    f("maximize", c.maximize);
  }
  // Keras's Adamax registers beta_1 and beta_2.
  static constexpr std::array keras_hypers = {KerasHyper{"beta_1", "beta1"}, KerasHyper{"beta_2", "beta2"}};
};

}  // namespace stepfuse::jit
