// Lion (Chen et al. 2023): the update program and its per-step scalars.
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

inline void lion_scalars(const optim::Lion& c, const Program& p, sf_scalar_rule* out) {
  ScalarWriter w{p, out};
  w.gscale(c.maximize);
  w.set("decay", 1.0 - c.lr * c.weight_decay);
  w.set("lr", c.lr);
  w.set("beta1", c.beta1);
  w.set("one_minus_beta1", 1.0 - c.beta1);
  w.set("beta2", c.beta2);
  w.set("one_minus_beta2", 1.0 - c.beta2);
}

}  // namespace stepfuse::jit
