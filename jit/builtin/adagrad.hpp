// Adagrad (torch.optim.Adagrad): the update program and its per-step scalars.
#pragma once

#include <cstdint>

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// PyTorch: g = ±grad + wd*p; sum += g²; p -= clr * g / (sqrt(sum) + eps),
// clr = lr / (1 + (step-1) * lr_decay). `sum` starts at initial_accumulator_value.
constexpr Program make_adagrad() {
  ProgramBuilder b("adagrad");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream sum_stream = b.stream("sum", StreamRole::state);
  const Value p = b.load(param);
  Value g = b.mul(b.load(grad), b.scalar("gscale"));
  g = b.add(g, b.mul(b.scalar("weight_decay"), p));
  const Value sum = b.add(b.load(sum_stream), b.mul(g, g));
  b.store(sum_stream, sum);
  const Value std_dev = b.add(b.sqrt(sum), b.scalar("eps"));
  b.store(param, b.sub(p, b.mul(b.scalar("clr"), b.div(g, std_dev))));
  return b.build();
}

inline constexpr Program kAdagrad = make_adagrad();

inline void adagrad_scalars(const optim::Adagrad& c, const Program& p, sf_scalar_rule* out) {
  ScalarWriter w{p, out};
  w.gscale(c.maximize);
  w.set("weight_decay", c.weight_decay);
  w.rule("clr", SF_RULE_DIV_LINEAR, c.lr, c.lr_decay);
  w.set("eps", c.eps);
}

}  // namespace stepfuse::jit
