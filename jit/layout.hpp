// Layout planning, written once for every backend and the emit API: the dtype
// combinations of a tensor list, where each tensor's state and master weights
// live, and the canonical reduce chunks (docs/architecture.md §5).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "stepfuse/types.hpp"

namespace stepfuse::jit {

// Elements per reduce chunk, on every backend: part of the numerics (a chunk's
// partial is summed in the canonical order, then chunks in order), so it must
// match SF_CHUNK_ELEMS (jit/cuda/device_abi.h) and SF_CPU_CHUNK_ELEMS in the
// emitted CPU ABI; static_asserts say so where they meet.
inline constexpr std::int64_t kChunkElems = 16384;

// A tensor's storage: what an update kernel is specialized for.
struct DtypeCombo {
  DType weight = DType::f32;
  DType grad = DType::f32;
  bool master = false;  // fp32 master weights (weight is f16/bf16)
  // bf16 weights without masters, stored with stochastic rounding (jit/stochastic_round.h)
  bool stochastic = false;
  // bf16 weights without masters, each with a bf16 compensation in the master
  // buffer: the parameter is weight + compensation (docs/low-precision.md)
  bool compensated = false;
  bool operator==(const DtypeCombo&) const = default;
  // A dense index for kernel tables, below kNumComboIndices (some are unused:
  // f32 weights have no masters): weight-major, then grad, then masters; the
  // stochastic combos (bf16 weights, no masters) by grad, then the compensated
  // ones by grad.
  constexpr int index() const {
    if (stochastic) return 18 + static_cast<int>(grad);
    if (compensated) return 21 + static_cast<int>(grad);
    return static_cast<int>(weight) * 6 + static_cast<int>(grad) * 2 + (master ? 1 : 0);
  }
  // Whether the tensor has a slot in the master buffer (its masters or its compensations).
  constexpr bool has_master_slot() const { return master || compensated; }
};
inline constexpr int kNumComboIndices = 24;

// The combos whose Highway kernels also come with state streams stored as bf16
// (read and written in registers; the others stage it, runtime/cpu/host_buffers.hpp):
// their index among those, or -1. Kernel tables put them after the kNumComboIndices.
// The stochastic combo has two: its state rounded stochastically (5), or to nearest
// even (7: nearest_state, OptimizerOptions::stochastic_state_rounding off).
inline constexpr int kNumBf16StateCombos = 8;
constexpr int bf16_state_index(const DtypeCombo& c, bool nearest_state = false) {
  if (c.weight == DType::f32) return c.grad == DType::f32 ? 0 : c.grad == DType::bf16 ? 1 : -1;
  if (c.weight != DType::bf16 || c.grad == DType::f16) return -1;
  if (c.master) return c.grad == DType::f32 ? 2 : 3;
  if (c.grad != DType::bf16) return -1;
  return c.stochastic ? (nearest_state ? 7 : 5) : c.compensated ? 6 : 4;
}

// The combo of a tensor with these dtypes under OptimizerOptions::master_weights,
// ::stochastic_rounding and ::compensated_weights: masters for f16/bf16 weights
// when kept; stochastic rounding or a compensation for bf16 weights without them.
constexpr DtypeCombo param_combo(DType weight, DType grad, bool master_weights, bool stochastic_rounding,
                                 bool compensated_weights = false) {
  const bool master = master_weights && weight != DType::f32;
  const bool bf16_alone = !master && weight == DType::bf16;
  return {weight, grad, master, stochastic_rounding && bf16_alone, compensated_weights && bf16_alone};
}

// One tensor of a list, without its pointers.
struct TensorShape {
  std::int64_t numel = 0;
  DtypeCombo combo;
};

// A span of one tensor: a reduce chunk.
struct Chunk {
  std::uint32_t tensor = 0;
  std::int64_t begin = 0;  // first element within the tensor
  std::int64_t len = 0;
};

struct Layout {
  std::vector<DtypeCombo> combos;  // the combinations present, in first-use order
  std::vector<int> tensor_combo;   // per tensor: its index in combos
  std::vector<DType> reduce_grads;  // the grad dtypes present, in first-use order
  std::vector<int> tensor_reduce;   // per tensor: its index in reduce_grads
  std::vector<std::int64_t> offsets;         // per tensor: element offset in every state buffer
  std::vector<std::int64_t> master_offsets;  // per tensor: element offset in the master buffer, or -1
  std::int64_t state_elems = 0;   // elements of each state buffer
  std::int64_t master_elems = 0;  // elements of the master buffer
  // Bytes per element of the master buffer: 4 for fp32 masters, 2 for bf16
  // compensations (one list never has both: they are options of one optimizer).
  std::int64_t master_elem_bytes = 4;
  std::int64_t master_bytes() const { return master_elems * master_elem_bytes; }
  std::vector<Chunk> chunks;                // kChunkElems per chunk (the last of a tensor shorter), tensor order
  std::vector<std::size_t> tensor_chunks;  // tensor t owns chunks [tensor_chunks[t], tensor_chunks[t + 1])
};

// Plans a tensor list. flat: the state and master buffers are the exact
// concatenation of the tensors (one index serves every stream, as when the
// tensors are views of one buffer); otherwise each tensor starts on a multiple
// of 16 elements (64 bytes of fp32), which keeps vector accesses aligned.
Layout plan_layout(const std::vector<TensorShape>& tensors, bool flat = false);

// Splits chunks among `threads` threads: thread t runs chunks
// [result[t], result[t + 1]), contiguous runs of about the same work. The chunks,
// not the threads, fix the reduction order, so results do not depend on this.
std::vector<std::size_t> split_chunks(const std::vector<Chunk>& chunks, int threads);

}  // namespace stepfuse::jit
