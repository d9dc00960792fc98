// The tables of a tensor list for the CUDA kernels, computed once per optimizer
// on the host from the layout plan (jit/layout.hpp): the spec (dtype
// combinations, layout class), the tensor table, the reduce chunks and update
// blocks. Pure host code (no driver), so it is tested without a GPU.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "jit/cuda/emit_cuda.hpp"
#include "jit/layout.hpp"
#include "jit/step_scalars.h"
#include "stepfuse/optimizer.hpp"

extern "C" {
#include "jit/cuda/device_abi.h"
}

namespace stepfuse::jit {

struct CudaLayout {
  CudaSpec spec;
  Layout layout;                   // offsets, master offsets, combinations, chunks
  std::vector<sf_tensor> tensors;  // master = null here: the backend points it into its master buffer
  std::vector<sf_span> chunks;     // reduce: layout.chunks as the kernels read them
  std::vector<sf_span> blocks;     // update (table layout): SF_UPDATE_ELEMS per block; one idle block if empty
  int num_update_blocks = 0;       // the update grid
  long long flat_numel() const { return layout.state_elems; }  // elements of the flat layout
  int reduce_grid() const {
    return static_cast<int>(std::max<std::size_t>((chunks.size() + SF_REDUCE_WARPS - 1) / SF_REDUCE_WARPS, 1));
  }
};

// Flat: the tensors are consecutive views of one weight and one grad buffer with
// one dtype combination (state and masters are then laid out exactly alike, so
// one index serves every stream). aligned16: every weight and grad base is
// aligned for 4-element vector accesses (16 bytes for f32, 8 for f16/bf16).
// allow_flat: false keeps per-tensor update blocks even for a flat list (param groups
// read each block's tensor's group).
CudaLayout plan_cuda_layout(const Program& program, const std::vector<Param>& params, const OptimizerOptions& options,
                            bool allow_flat = true);

// The same from sizes and storage only, for a spec whose layout class (flat,
// aligned16) and norm the caller has decided: the tables' pointers (grad, weight,
// master) are null, for the caller to fill. What the emit API gives a compiler
// that launches the kernels itself (stepfuse/emit.hpp). The caller checks that a
// flat spec has one combination.
CudaLayout plan_cuda_layout(const Program& program, const std::vector<TensorShape>& tensors, CudaNorm norm, bool flat,
                            bool aligned16);

// Param groups (the table layout): sets each tensor's group (tensor_group[i]) and, when
// the groups run different programs (flags that pick another variant: amsgrad or
// momentum in some groups only), the spec's variants, its kernel combinations as
// (dtypes, variant) pairs in first-use order, and each tensor's combination. Programs
// are told apart by value. Returns each group's variant (0: the spec's program, which
// becomes group 0's).
std::vector<int> assign_groups(CudaLayout& l, const std::vector<const Program*>& group_programs,
                               const std::vector<std::uint32_t>& tensor_group);

// State stored as bf16 or q8 (OptimizerOptions::state_format): formats[i][s] is how
// tensor i stores stream s of its group's program. Splits the spec's combinations by
// those formats (CudaSpec::combo_formats, after assign_groups: a combination is then
// dtypes, variant and formats) and renumbers the tensors' combos. Nothing changes when
// every format is f32. The layout must be the table layout (flat = false).
// stochastic_state: OptimizerOptions::stochastic_state_rounding, kept in the spec
// (CudaSpec::stochastic_state) only where it matters, a stochastic combination with bf16
// state: other specs keep the default, one key.
void assign_state_formats(CudaLayout& l, const std::vector<std::array<StateFormat, kMaxStreams>>& formats,
                          bool stochastic_state = true);

// Where packed state lives (a spec with combo_formats): every state buffer (sf_streams
// slot) holds each tensor's values in the tensor's format, 256-byte aligned, and a q8
// buffer's absmaxes are in a buffer of their own. Per buffer its bytes and absmaxes; per
// tensor, per program stream of its combination, the stream's buffer, its byte offset
// there and its first absmax (-1 where it has no such stream, or it is not q8).
struct PackedState {
  std::array<std::int64_t, kMaxStreams> bytes{}, absmaxes{};
  std::vector<std::array<int, kMaxStreams>> buffer;
  std::vector<std::array<std::int64_t, kMaxStreams>> at, absmax_at;
};
PackedState plan_packed_state(const CudaLayout& l);
// The q8 blocks of n elements.
constexpr std::int64_t q8_blocks(std::int64_t n) { return (n + SF_Q8_BLOCK - 1) / SF_Q8_BLOCK; }

}  // namespace stepfuse::jit
