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
  return step_bytes(program, weights, grads, masters, reduce_pass, compensated, {});
}

StepBytes step_bytes(const Program& program, DType weights, DType grads, bool masters, bool reduce_pass,
                     bool compensated, const StateWidths& widths) {
  const auto width = [&](std::string_view name) {
    for (const auto& [n, w] : widths)
      if (n == name) return w;
    return 4.0;
  };
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
        case StreamRole::state: {
          const double sw = width(program.streams[s].name);
          bytes += (loads[s] ? sw : 0.0) + (stores[s] ? sw : 0.0);
          break;
        }
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

double stored_state_bytes(const Optimizer& opt, std::string_view name) {
  double bytes = 0;
  for (std::size_t p = 0; p < opt.num_params(); ++p)
    bytes += static_cast<double>(opt.state_storage(p, name).size() + opt.state_absmax(p, name).size_bytes());
  return bytes;
}

StateWidths stored_state_widths(const Optimizer& opt, std::int64_t params) {
  StateWidths widths;
  for (std::string_view name : opt.state_names())
    widths.emplace_back(std::string(name),
                        params > 0 ? stored_state_bytes(opt, name) / static_cast<double>(params) : 4.0);
  return widths;
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
