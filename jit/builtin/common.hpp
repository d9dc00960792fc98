// What every built-in optimizer definition needs: the IR and a scalar writer.
#pragma once

#include <string_view>

#include "jit/step_scalars.h"
#include "stepfuse/optim.hpp"
#include "stepfuse/program.hpp"

namespace stepfuse::jit {

// Writes the rule of a per-step scalar by name into the program's scalar slots.
// Names the program does not declare are ignored, so one definition serves
// every variant. Evaluating a rule (jit/step_scalars.h) gives a double that is
// rounded once to fp32, as PyTorch rounds a Python float to a tensor's fp32.
struct ScalarWriter {
  const Program& program;
  sf_scalar_rule* out;
  void set(std::string_view name, double value) const { rule(name, SF_RULE_FIXED, value, 0.0); }
  void rule(std::string_view name, sf_rule_kind kind, double a, double b = 0.0) const {
    const int s = program.find_scalar(name);
    if (s >= 0) out[s] = sf_scalar_rule{kind, 0, a, b};
  }
  // gscale, the gradient multiplier of this step; negated to maximize.
  void gscale(bool maximize) const { rule("gscale", SF_RULE_GSCALE, maximize ? -1.0 : 1.0); }
};

}  // namespace stepfuse::jit
