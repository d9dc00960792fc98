// What every built-in optimizer definition needs: the IR and a scalar writer.
#pragma once

#include <string_view>

#include "stepfuse/optim.hpp"
#include "stepfuse/program.hpp"

namespace stepfuse::jit {

// Writes a per-step scalar by name into the program's scalar slots, rounding the
// double (as PyTorch rounds a Python float to the tensor's fp32). Names the
// program does not declare are ignored, so one scalar stage serves every variant.
struct ScalarWriter {
  const Program& program;
  float* out;
  void set(std::string_view name, double value) const {
    const int s = program.find_scalar(name);
    if (s >= 0) out[s] = static_cast<float>(value);
  }
};

}  // namespace stepfuse::jit
