// Adam and AdamW (torch.optim.Adam / AdamW): one update program, two weight decays.
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
  const Stream exp_avg_sq = b.stream("exp_avg_sq", StreamRole::state);
  const Value p = b.load(param);
  Value g = b.mul(b.load(grad), b.scalar("gscale"));
  g = b.add(g, b.mul(b.scalar("l2"), p));
  const Value decayed = b.mul(p, b.scalar("decay"));
  const Value m = b.add(b.mul(b.scalar("beta1"), b.load(exp_avg)), b.mul(b.scalar("one_minus_beta1"), g));
  Value v = b.add(b.mul(b.scalar("beta2"), b.load(exp_avg_sq)), b.mul(b.scalar("one_minus_beta2"), b.mul(g, g)));
  b.store(exp_avg, m);
  b.store(exp_avg_sq, v);
  if (amsgrad) {
    const Stream max_sq = b.stream("max_exp_avg_sq", StreamRole::state);
    v = b.max(b.load(max_sq), v);
    b.store(max_sq, v);
  }
  const Value denom = b.add(b.div(b.sqrt(v), b.scalar("bias_correction2_sqrt")), b.scalar("eps"));
  b.store(param, b.sub(decayed, b.mul(b.scalar("step_size"), b.div(m, denom))));
  return b.build();
}

inline constexpr Program kAdam = make_adam(false);
inline constexpr Program kAdamAmsgrad = make_adam(true);

template <class AdamConfig>
void adam_scalars(const AdamConfig& c, bool decoupled, const Program& p, sf_scalar_rule* out) {
  ScalarWriter w{p, out};
  w.gscale(c.maximize);
  w.set("l2", decoupled ? 0.0 : c.weight_decay);
  w.set("decay", decoupled ? 1.0 - c.lr * c.weight_decay : 1.0);
  w.set("beta1", c.beta1);
  w.set("one_minus_beta1", 1.0 - c.beta1);
  w.set("beta2", c.beta2);
  w.set("one_minus_beta2", 1.0 - c.beta2);
  w.rule("bias_correction2_sqrt", SF_RULE_SQRT_ONE_MINUS_POW, 0.0, c.beta2);
  w.rule("step_size", SF_RULE_DIV_ONE_MINUS_POW, c.lr, c.beta1);
  w.set("eps", c.eps);
}

}  // namespace stepfuse::jit
