// Two-phase programs on the CPU backends (per-tensor reductions, docs/update-programs.md):
// the chunk sums phase 1 writes, their combine into each tensor's norms in the
// canonical order (docs/architecture.md §5), and the update arguments phase 2 reads
// them through. The backends run phase 1 over the chunks, combine(), then phase 2.
#pragma once

#include <cstddef>
#include <vector>

#include "jit/layout.hpp"
#include "runtime/aligned_buffer.hpp"
#include "runtime/cpu/kernels.hpp"
#include "stepfuse/program.hpp"

namespace stepfuse::cpu {

class TwoPhase {
 public:
  TwoPhase() = default;
  // tensor_programs[t]: the program tensor t runs. Allocates (only when one of them
  // has two phases) kMaxNormSlots sums per chunk and norms per tensor, and with
  // `lanes` (the unfused baseline) kMaxNormSlots * 32 accumulator lanes per chunk.
  TwoPhase(const std::vector<const Program*>& tensor_programs, const jit::Layout& layout, bool lanes = false);

  bool any() const { return any_; }
  bool two_phase(std::size_t tensor) const { return tensor_two_phase_[tensor]; }

  // Where phase 1 writes chunk c's sums (kMaxNormSlots floats).
  float* sums(std::size_t chunk) { return sums_.data() + chunk * kMaxNormSlots; }
  // The unfused baseline: chunk c's accumulator lanes (slot r: lanes(c) + 32 * r),
  // zeroed by clear_lanes(); lanes_to_sums(c) then writes sums(c) by the fixed tree.
  float* lanes(std::size_t chunk) { return lanes_.data() + chunk * kMaxNormSlots * 32; }
  void clear_lanes();
  void lanes_to_sums(std::size_t chunk);

  // Each two-phase tensor's norm of every slot: sqrt of its chunk sums added in
  // fp64 in chunk order from 0, rounded to fp32 (an empty tensor's are 0).
  void combine();
  const float* norms(std::size_t tensor) const { return norms_.data() + tensor * kMaxNormSlots; }

  // `host` with every two-phase tensor's norms pointer set: what phase 2 reads.
  // Refreshed on every call (the same size: no allocation).
  const std::vector<UpdateArgs>& args(const std::vector<UpdateArgs>& host);

 private:
  const jit::Layout* layout_ = nullptr;
  bool any_ = false;
  std::vector<bool> tensor_two_phase_;
  detail::AlignedBuffer sums_, norms_, lanes_;
  std::vector<UpdateArgs> args_;
};

}  // namespace stepfuse::cpu
