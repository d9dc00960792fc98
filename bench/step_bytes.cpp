// The bytes an optimizer step must move: the figure of merit's numerator (docs/architecture.md §1, §8).
#include "step_bytes.hpp"

#include <cstdio>

namespace stepfuse::bench {

StepBytes step_bytes(DType weights, DType grads, bool masters, int state_streams, bool reduce_pass) {
  const double g = static_cast<double>(dtype_size(grads));
  const double w = static_cast<double>(dtype_size(weights));
  const bool keep_masters = masters && weights != DType::f32;
  StepBytes b;
  b.reduce = reduce_pass ? g : 0.0;
  b.update = g                                    // read the gradient
             + (keep_masters ? 4.0 + 4.0 + w      // read + write the fp32 master, write the weight
                             : w + w)             // read + write the weight
             + 8.0 * state_streams;               // read + write each fp32 state stream
  return b;
}

std::string StepBytes::breakdown() const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "reduce %g + update %g = %g B/param", reduce, update, per_param());
  return buf;
}

}  // namespace stepfuse::bench
