// Adadelta (torch.optim.Adadelta): the update program and the optimizer's traits.
#pragma once

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// PyTorch (single-tensor path): g = ±grad + wd*p; sq = sq*rho + ((1-rho)*g)*g;
// delta = (sqrt(acc + eps) / sqrt(sq + eps)) * g; acc = acc*rho + ((1-rho)*delta)*delta;
// p -= lr*delta. (addcmul's order: (value * t1) * t2.)
constexpr Program make_adadelta() {
  ProgramBuilder b("adadelta");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream square_avg = b.stream("square_avg", StreamRole::state, 0.0f, StateValues::nonnegative);
  const Stream acc_delta = b.stream("acc_delta", StreamRole::state, 0.0f, StateValues::nonnegative);
  const Value p = b.load(param);
  Value g = b.mul(b.load(grad), b.scalar("gscale"));
  g = l2_decayed(b, g, p, "weight_decay");
  const Value rho = b.scalar("rho"), one_minus_rho = b.scalar("one_minus_rho"), eps = b.scalar("eps");
  const Value sq = b.add(b.mul(b.load(square_avg), rho), b.mul(b.mul(one_minus_rho, g), g));
  b.store(square_avg, sq);
  const Value acc = b.load(acc_delta);
  const Value delta = b.mul(b.div(b.sqrt(b.add(acc, eps)), b.sqrt(b.add(sq, eps))), g);
  b.store(acc_delta, b.add(b.mul(acc, rho), b.mul(b.mul(one_minus_rho, delta), delta)));
  b.store(param, b.sub(p, b.mul(b.scalar("lr"), delta)));
  return b.build();
}

inline constexpr Program kAdadelta = make_adadelta();

template <>
struct OptimizerTraits<optim::Adadelta> : TraitsDefaults {
  static constexpr std::string_view name = "Adadelta";
  static constexpr const Program* programs[] = {&kAdadelta};

  static void validate(const optim::Adadelta& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.closed_unit_interval("rho", c.rho);
    ck.at_least("eps", c.eps, 0.0);
    ck.at_least("weight_decay", c.weight_decay, 0.0);
  }

  static void scalars(const optim::Adadelta& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("weight_decay", c.weight_decay);
    w.set("rho", c.rho);
    w.set("one_minus_rho", 1.0 - c.rho);
    w.set("eps", c.eps);
    w.set("lr", c.lr);
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("rho", c.rho), f("eps", c.eps), f("weight_decay", c.weight_decay), f("maximize", c.maximize);
  }
  // Keras's Adadelta registers rho.
  static constexpr std::array keras_hypers = {KerasHyper{"rho", "rho"}};
};

}  // namespace stepfuse::jit
