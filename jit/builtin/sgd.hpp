// SGD (torch.optim.SGD): the update program and its per-step scalars.
#pragma once

#include <cstdint>

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// PyTorch: g = ±grad + wd*p; buf = momentum*buf + (1-dampening)*g (buf = g on the
// first step); g = nesterov ? g + momentum*buf : buf; p -= lr*g.
constexpr Program make_sgd(bool momentum, bool nesterov) {
  ProgramBuilder b(!momentum ? "sgd" : nesterov ? "sgd_nesterov" : "sgd_momentum");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Value p = b.load(param);
  Value g = b.mul(b.load(grad), b.scalar("gscale"));
  g = b.add(g, b.mul(b.scalar("weight_decay"), p));
  if (momentum) {
    const Stream buf_stream = b.stream("momentum_buffer", StreamRole::state);
    // On the first step buf_momentum = 0 and buf_grad_coef = 1, so buf = g exactly.
    const Value buf = b.add(b.mul(b.scalar("buf_momentum"), b.load(buf_stream)), b.mul(b.scalar("buf_grad_coef"), g));
    b.store(buf_stream, buf);
    g = nesterov ? b.add(g, b.mul(b.scalar("momentum"), buf)) : buf;
  }
  b.store(param, b.sub(p, b.mul(b.scalar("lr"), g)));
  return b.build();
}

inline constexpr Program kSgd = make_sgd(false, false);
inline constexpr Program kSgdMomentum = make_sgd(true, false);
inline constexpr Program kSgdNesterov = make_sgd(true, true);

inline void sgd_scalars(const optim::SGD& c, const Program& p, sf_scalar_rule* out) {
  ScalarWriter w{p, out};
  w.gscale(c.maximize);
  w.set("weight_decay", c.weight_decay);
  w.set("lr", c.lr);
  w.set("momentum", c.momentum);
  // The momentum buffer starts as a copy of the gradient on the first step.
  w.rule("buf_momentum", SF_RULE_FIRST_STEP, 0.0, c.momentum);
  w.rule("buf_grad_coef", SF_RULE_FIRST_STEP, 1.0, 1.0 - c.dampening);
}

}  // namespace stepfuse::jit
