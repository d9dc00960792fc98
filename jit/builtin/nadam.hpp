// NAdam (torch.optim.NAdam): the update program and the optimizer's traits.
#pragma once

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// PyTorch (single-tensor path): g = ±grad + l2*p (L2 weight decay); p *= decay
// (decoupled_weight_decay: 1 - lr*wd); m = b1*m + (1-b1)*g; v = v*b2 + ((1-b2)*g)*g;
// denom = sqrt(v / bias_correction2) + eps;
// p = p + (grad_coef*g)/denom, then p = p + (momentum_coef*m)/denom (addcdiv's order),
// the coefficients -lr*(1-mu_t)/(1-P_t) and -lr*mu_{t+1}/(1-P_t*mu_{t+1}) from the
// step count (jit/step_scalars.h: PyTorch's mu_product is P_t, its only scalar state;
// the rules' offset d carries it across changes of beta1 and momentum_decay).
constexpr Program make_nadam() {
  ProgramBuilder b("nadam");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream exp_avg = b.stream("exp_avg", StreamRole::state);
  const Stream exp_avg_sq = b.stream("exp_avg_sq", StreamRole::state, 0.0f, StateValues::nonnegative);
  const Value p = b.load(param);
  Value g = b.mul(b.load(grad), b.scalar("gscale"));
  g = l2_decayed(b, g, p, "l2");
  const Value decayed = b.mul(p, b.scalar("decay"));
  const Value m = b.add(b.mul(b.scalar("beta1"), b.load(exp_avg)), b.mul(b.scalar("one_minus_beta1"), g));
  const Value v = b.add(b.mul(b.load(exp_avg_sq), b.scalar("beta2")), b.mul(b.mul(b.scalar("one_minus_beta2"), g), g));
  b.store(exp_avg, m);
  b.store(exp_avg_sq, v);
  const Value denom = b.add(b.sqrt(b.div(v, b.scalar("bias_correction2"))), b.scalar("eps"));
  const Value stepped = b.add(decayed, b.div(b.mul(b.scalar("grad_coef"), g), denom));
  b.store(param, b.add(stepped, b.div(b.mul(b.scalar("momentum_coef"), m), denom)));
  return b.build();
}

inline constexpr Program kNAdam = make_nadam();

template <>
struct OptimizerTraits<optim::NAdam> : TraitsDefaults {
  static constexpr std::string_view name = "NAdam";
  static constexpr const Program* programs[] = {&kNAdam};

  static void validate(const optim::NAdam& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.at_least("eps", c.eps, 0.0);
    ck.unit_interval("beta1", c.beta1);
    ck.unit_interval("beta2", c.beta2);
    ck.at_least("weight_decay", c.weight_decay, 0.0);
    ck.at_least("momentum_decay", c.momentum_decay, 0.0);
  }

  static void scalars(const optim::NAdam& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("l2", c.decoupled_weight_decay ? 0.0 : c.weight_decay);
    w.set("decay", c.decoupled_weight_decay ? 1.0 - c.lr * c.weight_decay : 1.0);
    w.set("beta1", c.beta1);
    w.set("one_minus_beta1", 1.0 - c.beta1);
    w.set("beta2", c.beta2);
    w.set("one_minus_beta2", 1.0 - c.beta2);
    w.rule("bias_correction2", SF_RULE_ONE_MINUS_POW, 0.0, c.beta2);
    w.set("eps", c.eps);
    w.rule("grad_coef", SF_RULE_NADAM_GRAD_COEF, c.lr, c.beta1, c.momentum_decay);
    w.rule("momentum_coef", SF_RULE_NADAM_MOMENTUM_COEF, c.lr, c.beta1, c.momentum_decay);
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("beta1", c.beta1), f("beta2", c.beta2), f("eps", c.eps), f("weight_decay", c.weight_decay);
    f("momentum_decay", c.momentum_decay), f("decoupled_weight_decay", c.decoupled_weight_decay);
    f("maximize", c.maximize);
  }
  // Keras's Nadam registers beta_1 and beta_2.
  static constexpr std::array keras_hypers = {KerasHyper{"beta_1", "beta1"}, KerasHyper{"beta_2", "beta2"}};
};

}  // namespace stepfuse::jit
