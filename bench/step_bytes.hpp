// The bytes an optimizer step must move: the figure of merit's numerator (docs/architecture.md §1, §8).
#pragma once

#include <string>

#include "stepfuse/types.hpp"

namespace stepfuse::bench {

// Bytes per parameter that any implementation of the step has to read and write at least
// once: the reduce pass reads the gradient; the update pass reads the gradient, the fp32
// parameter (the master when masters are kept), every state stream, and writes the
// parameter, every state stream and, with masters, the low-precision weight. Temporaries,
// write-allocate traffic and gradient write-backs (unscale_) are not counted: this is the
// minimum, so achieved GB/s = these bytes / step time, for fused and unfused alike.
struct StepBytes {
  double reduce = 0;  // per parameter, reduce pass
  double update = 0;  // per parameter, update pass
  double per_param() const { return reduce + update; }
  std::string breakdown() const;  // e.g. "reduce 4 + update 28 = 32 B/param"
};

// `masters` is ignored for f32 weights. `reduce_pass`: true for a step with a loss scale
// or clipping (step_scaled, or step() with max_grad_norm), false for a plain step().
StepBytes step_bytes(DType weights, DType grads, bool masters, int state_streams, bool reduce_pass);

}  // namespace stepfuse::bench
