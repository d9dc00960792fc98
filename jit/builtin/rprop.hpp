// Rprop (torch.optim.Rprop): the update program and the optimizer's traits.
#pragma once

#include "jit/builtin/common.hpp"

namespace stepfuse::jit {

// PyTorch (single-tensor path): g = ±grad; s = sign(g*prev); factor = eta_plus where
// s > 0, eta_minus where s < 0, 1 where s == 0; step_size = clamp(step_size*factor,
// step_size_min, step_size_max); g = 0 where s < 0; p -= sign(g)*step_size; prev = g.
// `step_size` starts at lr. torch.sign(NaN) is 0 (the IR's sign keeps NaN), so the signs
// here are (0 < x) - (x < 0): a NaN gradient moves neither its weight nor its step size,
// and is kept in prev, as in torch.
constexpr Program make_rprop() {
  ProgramBuilder b("rprop");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream prev = b.stream("prev", StreamRole::state);
  const Stream step_size = b.stream("step_size", StreamRole::state, 0.0f, StateValues::nonnegative);
  const Value p = b.load(param);
  const Value g = b.mul(b.load(grad), b.scalar("gscale"));
  const Value zero = b.constant(0.0f);
  const Value gp = b.mul(g, b.load(prev));
  const Value positive = b.lt(zero, gp), negative = b.lt(gp, zero);
  const Value factor =
      b.select(positive, b.scalar("eta_plus"), b.select(negative, b.scalar("eta_minus"), b.constant(1.0f)));
  const Value stepped = b.mul(b.load(step_size), factor);
  const Value clamped = b.min(b.max(stepped, b.scalar("step_size_min")), b.scalar("step_size_max"));
  b.store(step_size, clamped);
  const Value kept = b.select(negative, zero, g);
  b.store(prev, kept);
  const Value direction = b.sub(b.lt(zero, kept), b.lt(kept, zero));  // torch.sign: NaN -> 0
  b.store(param, b.sub(p, b.mul(direction, clamped)));
  return b.build();
}

inline constexpr Program kRprop = make_rprop();

template <>
struct OptimizerTraits<optim::Rprop> : TraitsDefaults {
  static constexpr std::string_view name = "Rprop";
  static constexpr const Program* programs[] = {&kRprop};

  static void validate(const optim::Rprop& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.finite("eta_minus", c.eta_minus);
    ck.finite("eta_plus", c.eta_plus);
    if (!(0.0 < c.eta_minus && c.eta_minus < 1.0))
      ck.fail("eta_minus", c.eta_minus, "requires 0 < eta_minus < 1 < eta_plus; eta_plus = " + Checker::text(c.eta_plus));
    if (!(1.0 < c.eta_plus))
      ck.fail("eta_plus", c.eta_plus, "requires 0 < eta_minus < 1 < eta_plus; eta_minus = " + Checker::text(c.eta_minus));
    ck.finite("step_size_min", c.step_size_min);
    ck.finite("step_size_max", c.step_size_max);
  }

  static void scalars(const optim::Rprop& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("eta_plus", c.eta_plus);
    w.set("eta_minus", c.eta_minus);
    w.set("step_size_min", c.step_size_min);
    w.set("step_size_max", c.step_size_max);
  }

  // Every element's step size starts at lr (PyTorch: torch.full_like(grad, lr)).
  static constexpr bool kInitialStateAtFirstStep = true;  // torch sets step_size at the first step
  static float initial_state(const optim::Rprop& c, const Program& program, int stream) {
    if (program.streams[stream].name == "step_size") return static_cast<float>(c.lr);
    return program.streams[stream].init;
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("eta_minus", c.eta_minus), f("eta_plus", c.eta_plus), f("step_size_min", c.step_size_min);
    f("step_size_max", c.step_size_max), f("maximize", c.maximize);
  }
  static constexpr std::array<KerasHyper, 0> keras_hypers = {};
};

}  // namespace stepfuse::jit
