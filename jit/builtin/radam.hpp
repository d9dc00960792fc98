// RAdam (torch.optim.RAdam): the update program and the optimizer's traits.
#pragma once

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// PyTorch (single-tensor path): g = ±grad + l2*p (L2 weight decay); p *= decay
// (decoupled_weight_decay: 1 - lr*wd); m = b1*m + (1-b1)*g; v = v*b2 + ((1-b2)*g)*g;
// step = (m / bias_correction1) * lr; while rho_t > 5 (rect != 0):
// p -= ((step * (1 / (sqrt(v) + eps) * sqrt(bias_correction2))) * rect, else p -= step.
// `1 / x * s` is Python's `s / tensor` (reciprocal, then multiply); rho_t's switch is
// the rule's value (radam_rect is 0 until rho_t > 5), taken by a select.
constexpr Program make_radam() {
  ProgramBuilder b("radam");
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
  const Value step = b.mul(b.div(m, b.scalar("bias_correction1")), b.scalar("lr"));
  const Value inv_denom = b.div(b.constant(1.0f), b.add(b.sqrt(v), b.scalar("eps")));
  const Value adaptive = b.mul(inv_denom, b.scalar("bias_correction2_sqrt"));
  const Value rect = b.scalar("rect");
  const Value rectified = b.mul(b.mul(step, adaptive), rect);
  b.store(param, b.sub(decayed, b.select(rect, rectified, step)));
  return b.build();
}

inline constexpr Program kRAdam = make_radam();

template <>
struct OptimizerTraits<optim::RAdam> : TraitsDefaults {
  static constexpr std::string_view name = "RAdam";
  static constexpr const Program* programs[] = {&kRAdam};

  static void validate(const optim::RAdam& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.at_least("eps", c.eps, 0.0);
    ck.unit_interval("beta1", c.beta1);
    ck.unit_interval("beta2", c.beta2);
    ck.at_least("weight_decay", c.weight_decay, 0.0);
  }

  static void scalars(const optim::RAdam& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("l2", c.decoupled_weight_decay ? 0.0 : c.weight_decay);
    w.set("decay", c.decoupled_weight_decay ? 1.0 - c.lr * c.weight_decay : 1.0);
    w.set("beta1", c.beta1);
    w.set("one_minus_beta1", 1.0 - c.beta1);
    w.set("beta2", c.beta2);
    w.set("one_minus_beta2", 1.0 - c.beta2);
    w.rule("bias_correction1", SF_RULE_ONE_MINUS_POW, 0.0, c.beta1);
    w.set("lr", c.lr);
    w.set("eps", c.eps);
    w.rule("bias_correction2_sqrt", SF_RULE_SQRT_ONE_MINUS_POW, 0.0, c.beta2);
    w.rule("rect", SF_RULE_RADAM_RECT, 0.0, c.beta2);
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("beta1", c.beta1), f("beta2", c.beta2), f("eps", c.eps), f("weight_decay", c.weight_decay);
    f("decoupled_weight_decay", c.decoupled_weight_decay), f("maximize", c.maximize);
  }
  static constexpr std::array<KerasHyper, 0> keras_hypers = {};
};

}  // namespace stepfuse::jit
