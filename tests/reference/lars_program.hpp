// Test-only: a user's two-phase update program, LARS (You, Gitman and Ginsburg 2017)
// with momentum, built with the C++ builder as docs/update-programs.md shows it; shared
// by two_phase_program_test and the CUDA emulation suite.
#pragma once

#include "stepfuse/program.hpp"
#include "stepfuse/update_program.hpp"

namespace stepfuse::ref {

//   phase 1: the norms of the weights (slot 0) and of the gradients (slot 1);
//   phase 2: trust = eta ||w|| / (||g|| + wd ||w||), 1 when either norm is 0;
//            v = mu v + (lr trust) (g + wd w);  w = w - v.
// One op per statement (C++ leaves the order of function arguments unspecified): the
// same instructions in the same order as the C builder makes in two_phase_program_test.
constexpr Program make_lars() {
  ProgramBuilder b("lars");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream momentum = b.stream("momentum_buffer", StreamRole::state);
  const Value raw = b.load(grad);
  const Value gscale = b.scalar("gscale");
  const Value g1 = b.mul(raw, gscale);
  const Value p1 = b.load(param);
  b.reduce_sumsq(0, p1);
  b.reduce_sumsq(1, g1);
  b.phase();
  const Value w = b.load(param);
  const Value raw2 = b.load(grad);
  const Value gscale2 = b.scalar("gscale");
  const Value g = b.mul(raw2, gscale2);
  const Value w_norm = b.tensor_norm(0);
  const Value g_norm = b.tensor_norm(1);
  const Value wd = b.scalar("weight_decay");
  const Value eta = b.scalar("eta");
  const Value num = b.mul(eta, w_norm);
  const Value wd_w_norm = b.mul(wd, w_norm);
  const Value den = b.add(g_norm, wd_w_norm);
  const Value raw_trust = b.div(num, den);
  const Value zero = b.constant(0.0f);
  const Value w_zero = b.eq(w_norm, zero);
  const Value g_zero = b.eq(g_norm, zero);
  const Value either = b.max(w_zero, g_zero);
  const Value one = b.constant(1.0f);
  const Value trust = b.select(either, one, raw_trust);
  const Value wd_w = b.mul(wd, w);
  const Value d = b.add(g, wd_w);
  const Value mu = b.scalar("momentum");
  const Value v_old = b.load(momentum);
  const Value mu_v = b.mul(mu, v_old);
  const Value lr = b.scalar("lr");
  const Value step = b.mul(lr, trust);
  const Value step_d = b.mul(step, d);
  const Value v = b.add(mu_v, step_d);
  b.store(momentum, v);
  const Value w_new = b.sub(w, v);
  b.store(param, w_new);
  return b.build();
}
inline constexpr Program kLars = make_lars();  // a malformed program would not compile

struct LarsHyper {
  double lr = 0.1, momentum = 0.9, weight_decay = 1e-3, eta = 0.01;
};

inline UpdateProgram lars(const LarsHyper& h = LarsHyper{}) {
  return UpdateProgram(kLars, {UpdateProgram::gscale(), UpdateProgram::fixed("weight_decay", h.weight_decay),
                               UpdateProgram::fixed("eta", h.eta), UpdateProgram::fixed("momentum", h.momentum),
                               UpdateProgram::fixed("lr", h.lr)});
}

}  // namespace stepfuse::ref
