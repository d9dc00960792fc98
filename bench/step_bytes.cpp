// The bytes an optimizer step must move: the figure of merit's numerator (docs/architecture.md §1, §8).
#include "step_bytes.hpp"

#include <cstdio>

namespace stepfuse::bench {

StepBytes step_bytes(DType weights, DType grads, bool masters, int state_streams, bool reduce_pass,
                     bool compensated) {
  const double g = static_cast<double>(dtype_size(grads));
  const double w = static_cast<double>(dtype_size(weights));
  const bool keep_masters = masters && weights != DType::f32;
  // The parameter as stored: the weight, and its bf16 compensation when compensated.
  const double p = w + (compensated && !keep_masters && weights == DType::bf16 ? 2.0 : 0.0);
  StepBytes b;
  b.reduce = reduce_pass ? g : 0.0;
  b.update = g                                    // read the gradient
             + (keep_masters ? 4.0 + 4.0 + w      // read + write the fp32 master, write the weight
                             : p + p)             // read + write the weight (and its compensation)
             + 8.0 * state_streams;               // read + write each fp32 state stream
  return b;
}

StepBytes step_bytes(const Program& program, DType weights, DType grads, bool masters, bool reduce_pass,
                     bool compensated) {
  const double g = static_cast<double>(dtype_size(grads));
  const double w = static_cast<double>(dtype_size(weights));
  const bool keep_masters = masters && weights != DType::f32;
  const double p = w + (compensated && !keep_masters && weights == DType::bf16 ? 2.0 : 0.0);  // weight (+ compensation)
  // The instructions of each pass: [0, marker) and (marker, end), or all of them in one.
  int marker = -1;
  for (int i = 0; i < program.num_instrs; ++i)
    if (program.code[i].op == Op::phase) marker = i;
  const auto pass_bytes = [&](int from, int to) {
    bool loads[kMaxStreams] = {}, stores[kMaxStreams] = {};
    for (int i = from; i < to; ++i) {
      if (program.code[i].op == Op::load) loads[program.code[i].attr] = true;
      if (program.code[i].op == Op::store) stores[program.code[i].attr] = true;
    }
    double bytes = 0;
    for (int s = 0; s < program.num_streams; ++s) {
      switch (program.streams[s].role) {
        case StreamRole::grad: bytes += loads[s] ? g : 0.0; break;
        case StreamRole::param:
          bytes += loads[s] ? (keep_masters ? 4.0 : p) : 0.0;
          bytes += stores[s] ? (keep_masters ? 4.0 + w : p) : 0.0;
          break;
        case StreamRole::state: bytes += (loads[s] ? 4.0 : 0.0) + (stores[s] ? 4.0 : 0.0); break;
      }
    }
    return bytes;
  };
  StepBytes b;
  b.reduce = reduce_pass ? g : 0.0;
  if (marker < 0) {
    b.update = pass_bytes(0, program.num_instrs);
  } else {
    b.phase1 = pass_bytes(0, marker);
    b.update = b.phase1 + pass_bytes(marker + 1, program.num_instrs);
    b.update_passes = 2;
  }
  return b;
}

std::string StepBytes::breakdown() const {
  char buf[128];
  if (update_passes == 2)
    std::snprintf(buf, sizeof buf, "reduce %g + update %g + %g (two passes) = %g B/param", reduce, phase1,
                  update - phase1, per_param());
  else
    std::snprintf(buf, sizeof buf, "reduce %g + update %g = %g B/param", reduce, update, per_param());
  return buf;
}

}  // namespace stepfuse::bench
