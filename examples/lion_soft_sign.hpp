// The examples' custom update program, Lion with a soft sign: stepfuse-emit-kernel emits it, tests/custom_program_test.cpp checks it.
//
// Lion (Chen et al. 2023) with a soft sign: where |c| <= tau the update is c / tau
// instead of sign(c), so small, uncertain directions take small steps.
//   g = grad * gscale;  c = beta1*m + (1-beta1)*g;  u = tau < |c| ? sign(c) : c / tau
//   p = p*decay - lr*u;  m = beta2*m + (1-beta2)*g
// Header-only: copy it with the example.
#pragma once

#include <stepfuse/stepfuse.hpp>

namespace examples {

// The program, built at compile time (so a malformed one does not compile).
constexpr stepfuse::Program make_lion_soft_sign() {
  using stepfuse::Stream, stepfuse::StreamRole, stepfuse::Value;
  stepfuse::ProgramBuilder b("lion_soft_sign");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream exp_avg = b.stream("exp_avg", StreamRole::state);
  const Value g = b.mul(b.load(grad), b.scalar("gscale"));
  const Value m = b.load(exp_avg);
  const Value c = b.add(b.mul(b.scalar("beta1"), m), b.mul(b.scalar("one_minus_beta1"), g));
  const Value tau = b.scalar("tau");
  const Value u = b.select(b.lt(tau, b.abs(c)), b.sign(c), b.div(c, tau));
  const Value p = b.mul(b.load(param), b.scalar("decay"));
  b.store(param, b.sub(p, b.mul(b.scalar("lr"), u)));
  b.store(exp_avg, b.add(b.mul(b.scalar("beta2"), m), b.mul(b.scalar("one_minus_beta2"), g)));
  return b.build();
}
inline constexpr stepfuse::Program kLionSoftSign = make_lion_soft_sign();

// The hyperparameters; the program's scalars are computed from them once (fixed rules).
struct LionSoftSignHyper {
  double lr = 0.01, beta1 = 0.9, beta2 = 0.99, weight_decay = 0.1, tau = 0.02;
};

inline stepfuse::UpdateProgram lion_soft_sign(const LionSoftSignHyper& h = {}) {
  using stepfuse::UpdateProgram;
  return UpdateProgram(kLionSoftSign, {UpdateProgram::gscale("gscale"), UpdateProgram::fixed("beta1", h.beta1),
                                       UpdateProgram::fixed("one_minus_beta1", 1.0 - h.beta1),
                                       UpdateProgram::fixed("tau", h.tau),
                                       UpdateProgram::fixed("decay", 1.0 - h.lr * h.weight_decay),
                                       UpdateProgram::fixed("lr", h.lr), UpdateProgram::fixed("beta2", h.beta2),
                                       UpdateProgram::fixed("one_minus_beta2", 1.0 - h.beta2)});
}

}  // namespace examples
