// ASGD (torch.optim.ASGD): the update program and the optimizer's traits.
#pragma once

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// PyTorch (single-tensor path): g = ±grad + wd*p; p = p*(1 - lambd*eta) - eta*g;
// ax = p if mu == 1, else ax + (p - ax)*mu. PyTorch's per-parameter scalars eta
// (fp32) and mu (fp32) are the rules asgd_eta, asgd_decay and asgd_mu of the step
// count (jit/step_scalars.h): eta_t = lr / (1 + lambd*lr*(t-1))^alpha, mu_t =
// 1 / max(1, t-1-t0), with eta = lr and mu = 1 on the first step.
constexpr Program make_asgd() {
  ProgramBuilder b("asgd");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream ax = b.stream("ax", StreamRole::state, 0.0f, StateValues::full_precision);
  const Value p = b.load(param);
  Value g = b.mul(b.load(grad), b.scalar("gscale"));
  g = l2_decayed(b, g, p, "weight_decay");
  const Value updated = b.sub(b.mul(p, b.scalar("decay")), b.mul(b.scalar("eta"), g));
  b.store(param, updated);
  const Value a = b.load(ax);
  const Value mu = b.scalar("mu");
  const Value averaged = b.add(a, b.mul(b.sub(updated, a), mu));
  b.store(ax, b.select(b.eq(mu, b.constant(1.0f)), updated, averaged));
  return b.build();
}

inline constexpr Program kASGD = make_asgd();

template <>
struct OptimizerTraits<optim::ASGD> : TraitsDefaults {
  static constexpr std::string_view name = "ASGD";
  static constexpr const Program* programs[] = {&kASGD};

  static void validate(const optim::ASGD& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.at_least("lambd", c.lambd, 0.0);
    ck.at_least("alpha", c.alpha, 0.0);
    ck.finite("t0", c.t0);
    ck.at_least("weight_decay", c.weight_decay, 0.0);
  }

  static void scalars(const optim::ASGD& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("weight_decay", c.weight_decay);
    w.rule("decay", SF_RULE_ASGD_DECAY, c.lr, c.lambd, c.alpha);
    w.rule("eta", SF_RULE_ASGD_ETA, c.lr, c.lambd, c.alpha);
    w.rule("mu", SF_RULE_ASGD_MU, c.t0);
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("lambd", c.lambd), f("alpha", c.alpha), f("t0", c.t0), f("weight_decay", c.weight_decay);
    f("maximize", c.maximize);
  }
  static constexpr std::array<KerasHyper, 0> keras_hypers = {};
};

}  // namespace stepfuse::jit
