// Adagrad (torch.optim.Adagrad): the update program and the optimizer's traits.
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
  const Stream sum_stream = b.stream("sum", StreamRole::state, 0.0f, StateValues::nonnegative);
  const Value p = b.load(param);
  Value g = b.mul(b.load(grad), b.scalar("gscale"));
  g = l2_decayed(b, g, p, "weight_decay");
  const Value sum = b.add(b.load(sum_stream), b.mul(g, g));
  b.store(sum_stream, sum);
  const Value std_dev = b.add(b.sqrt(sum), b.scalar("eps"));
  b.store(param, b.sub(p, b.mul(b.scalar("clr"), b.div(g, std_dev))));
  return b.build();
}

inline constexpr Program kAdagrad = make_adagrad();

template <>
struct OptimizerTraits<optim::Adagrad> : TraitsDefaults {
  static constexpr std::string_view name = "Adagrad";
  static constexpr const Program* programs[] = {&kAdagrad};

  static void validate(const optim::Adagrad& c, const Checker& ck) {
    ck.at_least("lr", c.lr, 0.0);
    ck.at_least("weight_decay", c.weight_decay, 0.0);
    ck.at_least("lr_decay", c.lr_decay, 0.0);
    ck.at_least("initial_accumulator_value", c.initial_accumulator_value, 0.0);
    ck.at_least("eps", c.eps, 0.0);
  }

  static void scalars(const optim::Adagrad& c, const ScalarWriter& w) {
    w.gscale(c.maximize);
    w.set("weight_decay", c.weight_decay);
    w.rule("clr", SF_RULE_DIV_LINEAR, c.lr, c.lr_decay);
    w.set("eps", c.eps);
  }

  static float initial_state(const optim::Adagrad& c, const Program& program, int stream) {
    if (program.streams[stream].name == "sum") return static_cast<float>(c.initial_accumulator_value);
    return program.streams[stream].init;
  }

  template <class C, class F>
  static constexpr void fields(C& c, F&& f) {
    f("lr", c.lr), f("lr_decay", c.lr_decay), f("weight_decay", c.weight_decay);
    f("initial_accumulator_value", c.initial_accumulator_value), f("eps", c.eps), f("maximize", c.maximize);
  }
  static constexpr std::array<KerasHyper, 0> keras_hypers = {};
};

}  // namespace stepfuse::jit
