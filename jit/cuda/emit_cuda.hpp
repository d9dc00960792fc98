// The CUDA emitter: (update program, spec) -> self-contained CUDA C++.
//
// The generated source includes nothing (NVRTC has no CUDA headers built in):
// it starts with the element math (jit/cuda/device_prelude.cuh), the scalar
// rules (jit/step_scalars.h) and the device ABI (jit/cuda/device_abi.h),
// then the program's element function and the kernels (see device_abi.h for
// the kernels and their launch shapes). Hyperparameters, pointers and sizes are
// never in the code: one compiled kernel serves every tensor list with the
// same spec, and changing the learning rate never recompiles.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "jit/layout.hpp"
#include "stepfuse/program.hpp"
#include "stepfuse/types.hpp"

namespace stepfuse::jit {

enum class CudaNorm { l2, inf };

// Everything a generated CUDA kernel depends on (docs/architecture.md §6), except the
// target arch, which the compiler adds to the cache key.
struct CudaSpec {
  Program program;
  std::vector<DtypeCombo> combos;  // the combinations present, in first-use order
  // Param groups whose flags pick other variants of the program (amsgrad in some groups
  // only): variants[v - 1] is variant v, `program` variant 0. combo_variant[k] is the
  // variant combination k runs; a kernel combination is then a (dtypes, variant) pair,
  // and combos may repeat dtypes. Both empty: every combination runs `program`. A
  // variant's state stream uses the buffer of `program`'s stream of the same name, or
  // one of its own after them (cuda_stream_slots). One-phase programs only.
  std::vector<Program> variants;
  std::vector<int> combo_variant;
  // State stored as bf16 or q8 (OptimizerOptions::state_format): combo_formats[k][s] is
  // how combination k stores its program's (variant's) stream s, so a kernel combination
  // is then also a choice of formats. Empty: every stream f32, at sf_tensor.state_offset
  // in the buffers of sf_streams; else each tensor's state is where sf_tensor.state says
  // (the table layout only). q8 streams use the map their StateValues pick (unsigned for
  // nonnegative); a two-phase program takes bf16 only.
  std::vector<std::array<StateFormat, kMaxStreams>> combo_formats;
  CudaNorm norm = CudaNorm::l2;
  bool flat = false;       // every stream is one contiguous buffer, one combo: no span table
  bool aligned16 = false;  // every stream base 16-byte aligned, state offsets multiples of 4:
                           // the update uses 16-byte (f32) / 8-byte (f16, bf16) vector accesses
  bool sharded = false;    // OptimizerOptions::communicator: the reduce module also has the sharded
                           // step's sf_reduce_shard and sf_shard_finalize (kernels/shard_kernel.cuh)
  // OptimizerOptions::stochastic_state_rounding: the bf16 state of stochastically rounded
  // weights rounds stochastically (else to nearest even, as other bf16 state does).
  bool stochastic_state = true;
};

// Canonical text of a spec: stable across runs and compilers (the cache key's core).
std::string canonical_text(const CudaSpec& spec);

// The programs of a spec: `program`, then its variants.
std::vector<const Program*> spec_programs(const CudaSpec& spec);
// Per program of the spec (spec_programs order), per program stream: the index of its
// buffer in sf_streams, or -1 for the grad and param streams. Variant 0's state streams
// keep their own index; a variant's stream named like one of them shares that buffer,
// other names get the next free indices. Error(unsupported) past SF_MAX_STREAMS buffers.
std::vector<std::array<int, kMaxStreams>> cuda_stream_slots(const CudaSpec& spec);

// The generated source of a spec's step, both kernels (extern "C"): sf_reduce, sf_update.
std::string emit_cuda(const CudaSpec& spec);

// The same two kernels as separate sources, which the runtime compiles in
// parallel and caches apart: the reduce kernel depends only on the grad dtypes,
// the norm and the number of scalars, so every optimizer over such a list
// shares it. reduce_canonical_text() is what it depends on.
std::string emit_cuda_reduce(const CudaSpec& spec);
std::string emit_cuda_update(const CudaSpec& spec);
std::string reduce_canonical_text(const CudaSpec& spec);
// The kernels of the update source, in order: sf_update, and before it a two-phase
// program's sf_phase1 and sf_phase_combine (jit/cuda/kernels/phase1_kernel.cuh). A
// two-phase spec needs the table layout (flat: Error(invalid_argument)).
std::vector<std::string> cuda_update_kernel_names(const Program& program);

// The utility kernels, the same for every spec (device_abi.h): sf_update_scale,
// sf_scale_<dtype>, sf_widen_<dtype>, sf_fill. Compiled once per arch.
std::string emit_cuda_utilities();

// Only the program's element function (prelude included), the same for every
// combination, for compiling on the host in tests:
//   void sf_body(const float* sc, float g, float* p, float* st)
// sc: the program's scalars; g: the gradient (widened, not yet multiplied by
// gscale); p: the parameter's fp32 value in/out; st: state values indexed by
// program stream, in/out. A two-phase program has two:
//   void sf_body1(const float* sc, float g, float* p, float* st, float* red)   phase 1;
//                 red[slot]: the values it reduces (their squares are summed)
//   void sf_body(const float* sc, float g, float* p, float* st, const float* nm)  phase 2;
//                 nm[slot]: the tensor's norms
std::string emit_element_functions(const CudaSpec& spec);

// Text of the headers embedded into every generated source (element math,
// scalar rules, device ABI), in that order.
const std::string& cuda_embedded_headers();

}  // namespace stepfuse::jit
