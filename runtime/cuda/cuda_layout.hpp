// The layout of a tensor list for the CUDA kernels, computed once per
// optimizer on the host: the spec (dtype combinations, layout class), the
// tensor table, the reduce chunks and update blocks, and where each tensor's
// state and master live. Pure host code (no driver), so it is tested without a GPU.
#pragma once

#include <cstdint>
#include <vector>

#include "jit/cuda/emit_cuda.hpp"
#include "jit/step_scalars.h"
#include "stepfuse/optimizer.hpp"

extern "C" {
#include "jit/cuda/device_abi.h"
}

namespace stepfuse::detail {

struct CudaLayout {
  jit::CudaSpec spec;
  std::vector<sf_tensor> tensors;  // master = null here: the backend points it into its master buffer
  std::vector<sf_span> chunks;     // reduce: SF_CHUNK_ELEMS per chunk, per tensor, in order
  std::vector<sf_span> blocks;     // update (table layout): SF_UPDATE_ELEMS per block; one idle block if empty
  std::vector<std::int64_t> offsets;         // element offset of each tensor in the state buffers
  std::vector<std::int64_t> master_offsets;  // in the master buffer, or -1
  std::int64_t state_elems = 0;
  std::int64_t master_elems = 0;
  std::int64_t flat_numel = 0;  // elements of the flat layout
  int num_update_blocks = 0;    // the update grid
  int reduce_grid() const {
    return static_cast<int>(std::max<std::size_t>((chunks.size() + SF_REDUCE_WARPS - 1) / SF_REDUCE_WARPS, 1));
  }
};

// Flat: the tensors are consecutive views of one weight and one grad buffer with
// one dtype combination (state and masters are then laid out exactly alike, so
// one index serves every stream). aligned16: every weight and grad base is
// aligned for 4-element vector accesses (16 bytes for f32, 8 for f16/bf16).
CudaLayout plan_cuda_layout(const Program& program, const std::vector<Param>& params, const OptimizerOptions& options);

// One tensor as the kernels see it, without its pointers.
struct CudaTensorShape {
  std::int64_t numel = 0;
  jit::CudaCombo combo;
};
// The same layout from sizes and storage only, for a spec whose layout class
// (flat, aligned16) and norm the caller has decided: the tables' pointers (grad,
// weight, master) are null, for the caller to fill. What the emit API gives a
// compiler that launches the kernels itself (stepfuse/emit.hpp). The caller checks
// that a flat spec has one combination.
CudaLayout plan_cuda_layout(const Program& program, const std::vector<CudaTensorShape>& tensors, jit::CudaNorm norm,
                            bool flat, bool aligned16);

}  // namespace stepfuse::detail
