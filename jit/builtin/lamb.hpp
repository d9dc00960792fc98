// LAMB (You et al. 2020, as NVIDIA Apex's FusedLAMB with adam_w_mode, bias correction
// and grad averaging, without NVLAMB): the two-phase update program and the traits.
#pragma once

#include <cstdint>

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// The Adam direction with decoupled weight decay, u = m̂ / (sqrt(v̂) + eps) + wd * p,
// as Apex's stage 1 computes it (m̂ = m / bc1, v̂ = v / bc2; here times the rounded
// reciprocals 1 / bc1, 1 / bc2, the scalar rules there are). Both phases compute it
// from the same values with the same ops, so phase 2's u is phase 1's, bit for bit.
constexpr Value lamb_direction(ProgramBuilder& b, Value p, Value m, Value v) {
  const Value m_hat = b.mul(m, b.scalar("inv_bias_correction1"));
  const Value v_hat = b.mul(v, b.scalar("inv_bias_correction2"));
  const Value denom = b.add(b.sqrt(v_hat), b.scalar("eps"));
  return b.add(b.div(m_hat, denom), b.mul(b.scalar("weight_decay"), p));
}

// Phase 1: g = ±grad (unscaled, clipped); m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
// the per-tensor sums of squares of p (slot 0) and of u (slot 1). It stores nothing.
// Phase 2: the same m and v again, from the same loads with the same ops (bitwise phase
// 1's), stored; ratio = ‖p‖ / ‖u‖ when weight_decay != 0 and neither norm is 0, else 1
// (Apex's rule; skip_trust_ratio is 1 when weight_decay = 0); p -= (lr * ratio) * u.
// Phase 2 recomputes the moments rather than reading them as phase 1 stored them: with
// state stored as bf16 or q8 the stored moments are not the values phase 1 took its
// norms over (a second moment that quantizes to 0 would make u = m / eps there, a step
// of lr / eps), so both phases compute u from the same values, as bitsandbytes' two-pass
// 8-bit optimizers do. It costs phase 2 a second read of the gradients.
constexpr Program make_lamb() {
  ProgramBuilder b("lamb");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream exp_avg = b.stream("exp_avg", StreamRole::state);
  const Stream exp_avg_sq = b.stream("exp_avg_sq", StreamRole::state, 0.0f, StateValues::nonnegative);
  const auto first = [&](Value g) {
    return b.add(b.mul(b.load(exp_avg), b.scalar("beta1")), b.mul(b.scalar("one_minus_beta1"), g));
  };
  const auto second = [&](Value g) {
    return b.add(b.mul(b.load(exp_avg_sq), b.scalar("beta2")), b.mul(b.mul(b.scalar("one_minus_beta2"), g), g));
  };
  const Value g = b.mul(b.load(grad), b.scalar("gscale"));
  const Value p = b.load(param);
  const Value m = first(g);
  const Value v = second(g);
  b.reduce_sumsq(0, p);
  b.reduce_sumsq(1, lamb_direction(b, p, m, v));
  b.phase();
  const Value g2 = b.mul(b.load(grad), b.scalar("gscale"));
  const Value p2 = b.load(param);
  const Value m2 = first(g2);
  b.store(exp_avg, m2);
  const Value v2 = second(g2);
  b.store(exp_avg_sq, v2);
  const Value u = lamb_direction(b, p2, m2, v2);
  const Value param_norm = b.tensor_norm(0);
  const Value update_norm = b.tensor_norm(1);
  const Value zero = b.constant(0.0f);
  const Value skip = b.max(b.max(b.eq(param_norm, zero), b.eq(update_norm, zero)), b.scalar("skip_trust_ratio"));
  const Value ratio = b.select(skip, b.constant(1.0f), b.div(param_norm, update_norm));
  b.store(param, b.sub(p2, b.mul(b.mul(b.scalar("lr"), ratio), u)));
  return b.build();
}

inline constexpr Program kLamb = make_lamb();

template <>
struct OptimizerTraits<optim::LAMB> : TraitsDefaults {
  static constexpr std::string_view name = "LAMB";
  static constexpr const Program* programs[] = {&kLamb};

  static void validate(const optim::LAMB& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.at_least("eps", c.eps, 0.0);
    ck.unit_interval("beta1", c.beta1);
    ck.unit_interval("beta2", c.beta2);
    ck.at_least("weight_decay", c.weight_decay, 0.0);
  }

  static void scalars(const optim::LAMB& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("beta1", c.beta1);
    w.set("one_minus_beta1", 1.0 - c.beta1);
    w.set("beta2", c.beta2);
    w.set("one_minus_beta2", 1.0 - c.beta2);
    w.rule("inv_bias_correction1", SF_RULE_DIV_ONE_MINUS_POW, 1.0, c.beta1);
    w.rule("inv_bias_correction2", SF_RULE_DIV_ONE_MINUS_POW, 1.0, c.beta2);
    w.set("eps", c.eps);
    w.set("weight_decay", c.weight_decay);
    w.set("skip_trust_ratio", c.weight_decay == 0.0 ? 1.0 : 0.0);
    w.set("lr", c.lr);
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("beta1", c.beta1), f("beta2", c.beta2), f("eps", c.eps), f("weight_decay", c.weight_decay);
    f("maximize", c.maximize);
  }
  static constexpr std::array keras_hypers = {KerasHyper{"beta_1", "beta1"}, KerasHyper{"beta_2", "beta2"}};
};

}  // namespace stepfuse::jit
