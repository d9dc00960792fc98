// RMSprop (torch.optim.RMSprop): centered and momentum variants, one definition, and its traits.
#pragma once

#include <cstdint>

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// PyTorch: g = ±grad + wd*p; sq = alpha*sq + (1-alpha)*g²;
// centered: ga = alpha*ga + (1-alpha)*g, avg = sqrt(sq - ga²) + eps; else avg = sqrt(sq) + eps;
// momentum: buf = momentum*buf + g/avg, p -= lr*buf; else p -= lr * g/avg.
constexpr Program make_rmsprop(bool centered, bool momentum) {
  ProgramBuilder b(centered ? (momentum ? "rmsprop_centered_momentum" : "rmsprop_centered")
                            : (momentum ? "rmsprop_momentum" : "rmsprop"));
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream square_avg = b.stream("square_avg", StreamRole::state, 0.0f, StateValues::nonnegative);
  const Value p = b.load(param);
  Value g = b.mul(b.load(grad), b.scalar("gscale"));
  g = l2_decayed(b, g, p, "weight_decay");
  const Value alpha = b.scalar("alpha"), one_minus_alpha = b.scalar("one_minus_alpha");
  const Value sq = b.add(b.mul(alpha, b.load(square_avg)), b.mul(one_minus_alpha, b.mul(g, g)));
  b.store(square_avg, sq);
  Value avg = sq;
  if (centered) {
    const Stream grad_avg = b.stream("grad_avg", StreamRole::state);
    const Value ga = b.add(b.mul(alpha, b.load(grad_avg)), b.mul(one_minus_alpha, g));
    b.store(grad_avg, ga);
    avg = b.sub(sq, b.mul(ga, ga));
  }
  avg = b.add(b.sqrt(avg), b.scalar("eps"));
  Value step = b.div(g, avg);
  if (momentum) {
    const Stream buf_stream = b.stream("momentum_buffer", StreamRole::state);
    step = b.add(b.mul(b.scalar("momentum"), b.load(buf_stream)), step);
    b.store(buf_stream, step);
  }
  b.store(param, b.sub(p, b.mul(b.scalar("lr"), step)));
  return b.build();
}

inline constexpr Program kRmsprop = make_rmsprop(false, false);
inline constexpr Program kRmspropCentered = make_rmsprop(true, false);
inline constexpr Program kRmspropMomentum = make_rmsprop(false, true);
inline constexpr Program kRmspropCenteredMomentum = make_rmsprop(true, true);

template <>
struct OptimizerTraits<optim::RMSprop> : TraitsDefaults {
  static constexpr std::string_view name = "RMSprop";
  static constexpr const Program* programs[] = {&kRmsprop, &kRmspropCentered, &kRmspropMomentum,
                                                &kRmspropCenteredMomentum};
  static int variant(const optim::RMSprop& c) { return (c.centered ? 1 : 0) + (c.momentum > 0 ? 2 : 0); }

  static void validate(const optim::RMSprop& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.at_least("weight_decay", c.weight_decay, 0.0);
    ck.at_least("eps", c.eps, 0.0);
    ck.at_least("momentum", c.momentum, 0.0);
    ck.at_least("alpha", c.alpha, 0.0);
  }

  static void scalars(const optim::RMSprop& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("weight_decay", c.weight_decay);
    w.set("alpha", c.alpha);
    w.set("one_minus_alpha", 1.0 - c.alpha);
    w.set("eps", c.eps);
    w.set("momentum", c.momentum);
    w.set("lr", c.lr);
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("alpha", c.alpha), f("eps", c.eps), f("weight_decay", c.weight_decay);
    f("momentum", c.momentum), f("centered", c.centered), f("maximize", c.maximize);
  }
  static constexpr std::array keras_hypers = {KerasHyper{"rho", "alpha"}, KerasHyper{"momentum", "momentum"}};
};

}  // namespace stepfuse::jit
