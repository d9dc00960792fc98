// Internal: an UpdateProgram's scalar rules as the backends use them.
#pragma once

#include <string>
#include <string_view>

#include "jit/step_scalars.h"
#include "stepfuse/update_program.hpp"

namespace stepfuse::jit {

// The rule as the kernels evaluate it (jit/step_scalars.h).
sf_scalar_rule device_rule(const ScalarRule& rule);

// "0.0001", "gscale * 1", "0.001 / (1 - 0.9^step)", ...
std::string rule_text(const ScalarRule& rule);

// Throws Error(invalid_argument) naming the program, the scalar and the problem
// when a rule's parameters are out of range (not finite, a power base outside
// [0, 1), a zero gradient multiplier, an unknown kind).
void check_rule(std::string_view program, std::string_view scalar, const ScalarRule& rule);

}  // namespace stepfuse::jit
