// Lion (Chen et al. 2023): the update program and the optimizer's traits.
#pragma once

#include <cstdint>

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// p *= 1 - lr*wd; c = b1*m + (1-b1)*g; p -= lr*sign(c); m = b2*m + (1-b2)*g.
constexpr Program make_lion() {
  ProgramBuilder b("lion");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream exp_avg = b.stream("exp_avg", StreamRole::state);
  const Value g = b.mul(b.load(grad), b.scalar("gscale"));
  const Value m = b.load(exp_avg);
  const Value decayed = b.mul(b.load(param), b.scalar("decay"));
  const Value c = b.add(b.mul(b.scalar("beta1"), m), b.mul(b.scalar("one_minus_beta1"), g));
  b.store(param, b.sub(decayed, b.mul(b.scalar("lr"), b.sign(c))));
  b.store(exp_avg, b.add(b.mul(b.scalar("beta2"), m), b.mul(b.scalar("one_minus_beta2"), g)));
  return b.build();
}

inline constexpr Program kLion = make_lion();

template <>
struct OptimizerTraits<optim::Lion> : TraitsDefaults {
  static constexpr std::string_view name = "Lion";
  static constexpr const Program* programs[] = {&kLion};

  static void validate(const optim::Lion& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.at_least("weight_decay", c.weight_decay, 0.0);
    ck.unit_interval("beta1", c.beta1);
    ck.unit_interval("beta2", c.beta2);
  }

  static void scalars(const optim::Lion& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("decay", 1.0 - c.lr * c.weight_decay);
    w.set("lr", c.lr);
    w.set("beta1", c.beta1);
    w.set("one_minus_beta1", 1.0 - c.beta1);
    w.set("beta2", c.beta2);
    w.set("one_minus_beta2", 1.0 - c.beta2);
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("beta1", c.beta1), f("beta2", c.beta2), f("weight_decay", c.weight_decay);
    f("maximize", c.maximize);
  }
  static constexpr std::array keras_hypers = {KerasHyper{"beta_1", "beta1"}, KerasHyper{"beta_2", "beta2"}};
};

}  // namespace stepfuse::jit
