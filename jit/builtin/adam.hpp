// Adam and AdamW (torch.optim.Adam / AdamW): one set of update programs, two weight decays, two traits.
#pragma once

#include <cmath>
#include <cstdint>

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// PyTorch: g = ±grad + l2*p (Adam's weight decay); p *= decay (AdamW's, 1 - lr*wd);
// m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g²; [vmax = max(vmax, v)];
// p -= step_size * m / (sqrt(v)/sqrt(bc2) + eps), step_size = lr/bc1.
// Adam has decay = 1, AdamW has l2 = 0: both multiplications are then exact.
constexpr Program make_adam(bool amsgrad) {
  ProgramBuilder b(amsgrad ? "adam_amsgrad" : "adam");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream exp_avg = b.stream("exp_avg", StreamRole::state);
  const Stream exp_avg_sq = b.stream("exp_avg_sq", StreamRole::state, 0.0f, StateValues::nonnegative);
  const Value p = b.load(param);
  Value g = b.mul(b.load(grad), b.scalar("gscale"));
  g = l2_decayed(b, g, p, "l2");
  const Value decayed = b.mul(p, b.scalar("decay"));
  const Value m = b.add(b.mul(b.scalar("beta1"), b.load(exp_avg)), b.mul(b.scalar("one_minus_beta1"), g));
  Value v = b.add(b.mul(b.scalar("beta2"), b.load(exp_avg_sq)), b.mul(b.scalar("one_minus_beta2"), b.mul(g, g)));
  b.store(exp_avg, m);
  b.store(exp_avg_sq, v);
  if (amsgrad) {
    const Stream max_sq = b.stream("max_exp_avg_sq", StreamRole::state, 0.0f, StateValues::nonnegative);
    v = b.max(b.load(max_sq), v);
    b.store(max_sq, v);
  }
  const Value denom = b.add(b.div(b.sqrt(v), b.scalar("bias_correction2_sqrt")), b.scalar("eps"));
  b.store(param, b.sub(decayed, b.mul(b.scalar("step_size"), b.div(m, denom))));
  return b.build();
}

inline constexpr Program kAdam = make_adam(false);
inline constexpr Program kAdamAmsgrad = make_adam(true);

// Adam's and AdamW's traits: the same programs (one set of fused kernels) and
// fields; `Decoupled` picks the weight decay.
template <class Config, bool Decoupled>
struct AdamTraits : TraitsDefaults {
  static constexpr const Program* programs[] = {&kAdam, &kAdamAmsgrad};
  static int variant(const Config& c) { return c.amsgrad ? 1 : 0; }

  static void validate(const Config& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.at_least("weight_decay", c.weight_decay, 0.0);
    ck.at_least("eps", c.eps, 0.0);
    ck.unit_interval("beta1", c.beta1);
    ck.unit_interval("beta2", c.beta2);
  }

  static void scalars(const Config& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("l2", Decoupled ? 0.0 : c.weight_decay);
    w.set("decay", Decoupled ? 1.0 - c.lr * c.weight_decay : 1.0);
    w.set("beta1", c.beta1);
    w.set("one_minus_beta1", 1.0 - c.beta1);
    w.set("beta2", c.beta2);
    w.set("one_minus_beta2", 1.0 - c.beta2);
    w.rule("bias_correction2_sqrt", SF_RULE_SQRT_ONE_MINUS_POW, 0.0, c.beta2);
    w.rule("step_size", SF_RULE_DIV_ONE_MINUS_POW, c.lr, c.beta1);
    w.set("eps", c.eps);
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("beta1", c.beta1), f("beta2", c.beta2), f("eps", c.eps), f("weight_decay", c.weight_decay);
    f("amsgrad", c.amsgrad), f("maximize", c.maximize);
  }
  static constexpr std::array keras_hypers = {KerasHyper{"beta_1", "beta1"}, KerasHyper{"beta_2", "beta2"}};
};

template <>
struct OptimizerTraits<optim::Adam> : AdamTraits<optim::Adam, false> {
  static constexpr std::string_view name = "Adam";
};
template <>
struct OptimizerTraits<optim::AdamW> : AdamTraits<optim::AdamW, true> {
  static constexpr std::string_view name = "AdamW";
};

}  // namespace stepfuse::jit
