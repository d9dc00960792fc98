// Two-phase programs on the CPU backends: chunk sums, the canonical combine, the norms.
#include "runtime/cpu/two_phase.hpp"

#include <algorithm>
#include <cmath>

#include "jit/program_analysis.hpp"
#include "runtime/cpu/interpreter.hpp"

namespace stepfuse::cpu {

TwoPhase::TwoPhase(const std::vector<const Program*>& tensor_programs, const jit::Layout& layout, bool lanes)
    : layout_(&layout) {
  for (const Program* p : tensor_programs) {
    tensor_two_phase_.push_back(jit::is_two_phase(*p));
    any_ |= tensor_two_phase_.back();
  }
  if (!any_) return;
  const std::size_t chunks = std::max<std::size_t>(layout.chunks.size(), 1);
  sums_ = detail::AlignedBuffer(chunks * kMaxNormSlots);
  norms_ = detail::AlignedBuffer(std::max<std::size_t>(tensor_programs.size(), 1) * kMaxNormSlots);
  std::fill_n(norms_.data(), norms_.size(), 0.0f);
  if (lanes) lanes_ = detail::AlignedBuffer(chunks * kMaxNormSlots * 32);
  args_.resize(tensor_programs.size());  // args() copies into it without allocating
}

void TwoPhase::clear_lanes() { std::fill_n(lanes_.data(), lanes_.size(), 0.0f); }

void TwoPhase::lanes_to_sums(std::size_t chunk) {
  for (int r = 0; r < kMaxNormSlots; ++r) sums(chunk)[r] = canonical_lane_tree(lanes(chunk) + 32 * r);
}

void TwoPhase::combine() {
  const std::vector<std::size_t>& first = layout_->tensor_chunks;  // tensor t: chunks [first[t], first[t + 1])
  for (std::size_t t = 0; t + 1 < first.size(); ++t) {
    if (!tensor_two_phase_[t]) continue;
    for (int r = 0; r < kMaxNormSlots; ++r) {
      double acc = 0.0;
      for (std::size_t c = first[t]; c < first[t + 1]; ++c) acc += static_cast<double>(sums(c)[r]);
      norms_.data()[t * kMaxNormSlots + static_cast<std::size_t>(r)] = static_cast<float>(std::sqrt(acc));
    }
  }
}

const std::vector<UpdateArgs>& TwoPhase::args(const std::vector<UpdateArgs>& host) {
  args_ = host;
  for (std::size_t t = 0; t < args_.size(); ++t)
    if (tensor_two_phase_[t]) args_[t].norms = norms(t);
  return args_;
}

}  // namespace stepfuse::cpu
