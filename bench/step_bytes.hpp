// The bytes an optimizer step must move: the figure of merit's numerator (docs/architecture.md §1, §8).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "stepfuse/optimizer.hpp"
#include "stepfuse/program.hpp"
#include "stepfuse/types.hpp"

namespace stepfuse::bench {

// Bytes per parameter that any implementation of the step has to read and write at least
// once: the reduce pass reads the gradient; the update pass reads the gradient, the fp32
// parameter (the master when masters are kept), every state stream, and writes the
// parameter, every state stream and, with masters, the low-precision weight. A compensated
// bf16 parameter (OptimizerOptions::compensated_weights) is its weight and its bf16
// compensation: both are read and written, 2 + 2 bytes each way. Temporaries,
// write-allocate traffic and gradient write-backs (unscale_) are not counted: this is the
// minimum, so achieved GB/s = these bytes / step time, for fused and unfused alike.
struct StepBytes {
  double reduce = 0;  // per parameter, reduce pass
  double update = 0;  // per parameter, update pass (both of a two-phase program's, summed)
  double phase1 = 0;  // of `update`: a two-phase program's phase 1 (0 for one pass)
  int update_passes = 1;  // 2 for a two-phase program (per-tensor norms: LAMB)
  double per_param() const { return reduce + update; }
  // "reduce 4 + update 28 = 32 B/param"; two passes: "reduce 4 + update 24 + 16 = 44 B/param"
  std::string breakdown() const;
};

// `masters` is ignored for f32 weights. `reduce_pass`: true for a step with a loss scale
// or clipping (step_scaled, or step() with max_grad_norm), false for a plain step().
// `compensated`: compensated bf16 weights (OptimizerOptions::compensated_weights, which
// keeps no masters); ignored for other weights and with masters.
StepBytes step_bytes(DType weights, DType grads, bool masters, int state_streams, bool reduce_pass,
                     bool compensated = false);

// The same from what `program` reads and writes, pass by pass: each update pass reads
// the gradient if it loads it, the parameter (master) if it loads it, each state stream
// it loads, and writes what it stores (the parameter: master and weight, weight and
// compensation, or the weight).
// For a program that loads and stores every stream this is the formula above; a
// two-phase program (docs/update-programs.md: LAMB's trust ratio) has two update passes,
// each counted by what its phase loads and stores (phase 2 reads again what it needs).
StepBytes step_bytes(const Program& program, DType weights, DType grads, bool masters, bool reduce_pass,
                     bool compensated = false);

// Each state stream's bytes per parameter as stored (OptimizerOptions::state_format): 4 for
// f32, 2 for bf16, 1 + 4/256 for q8 (a code per element, an fp32 absmax per block of 256).
// By stream name; a stream not named is f32.
using StateWidths = std::vector<std::pair<std::string, double>>;
// The same as the overload above, each state stream loaded and stored at its width.
StepBytes step_bytes(const Program& program, DType weights, DType grads, bool masters, bool reduce_pass,
                     bool compensated, const StateWidths& widths);

// The bytes `opt` stores a state stream in, over every param: state_storage() (fp32 values,
// bf16 bits or q8 codes) and state_absmax() (q8). Tensors under the q8 threshold
// (OptimizerOptions::min_q8_numel) count as the f32 they are stored as.
double stored_state_bytes(const Optimizer& opt, std::string_view name);
// Every state stream's width in `opt`, over `params` parameters (the model's: stored bytes /
// params), for step_bytes().
StateWidths stored_state_widths(const Optimizer& opt, std::int64_t params);

}  // namespace stepfuse::bench
