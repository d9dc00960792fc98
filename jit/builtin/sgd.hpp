// SGD (torch.optim.SGD): the update programs and the optimizer's traits.
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
  g = l2_decayed(b, g, p, "weight_decay");
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

template <>
struct OptimizerTraits<optim::SGD> : TraitsDefaults {
  static constexpr std::string_view name = "SGD";
  static constexpr const Program* programs[] = {&kSgd, &kSgdMomentum, &kSgdNesterov};
  static int variant(const optim::SGD& c) { return c.momentum == 0 ? 0 : c.nesterov ? 2 : 1; }

  static void validate(const optim::SGD& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.at_least("weight_decay", c.weight_decay, 0.0);
    ck.at_least("momentum", c.momentum, 0.0);
    ck.at_least("dampening", c.dampening, -INFINITY);
    if (c.nesterov && (c.momentum <= 0 || c.dampening != 0))
      ck.fail("nesterov", true, "Nesterov momentum requires momentum > 0 and dampening = 0; got momentum = " +
                                   Checker::text(c.momentum) + ", dampening = " + Checker::text(c.dampening));
  }

  static void scalars(const optim::SGD& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("weight_decay", c.weight_decay);
    w.set("lr", c.lr);
    w.set("momentum", c.momentum);
    // The momentum buffer starts as a copy of the gradient on the first step.
    w.rule("buf_momentum", SF_RULE_FIRST_STEP, 0.0, c.momentum);
    w.rule("buf_grad_coef", SF_RULE_FIRST_STEP, 1.0, 1.0 - c.dampening);
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("momentum", c.momentum), f("dampening", c.dampening), f("weight_decay", c.weight_decay);
    f("nesterov", c.nesterov), f("maximize", c.maximize);
  }
  static constexpr std::array keras_hypers = {KerasHyper{"momentum", "momentum"}};
};

}  // namespace stepfuse::jit
