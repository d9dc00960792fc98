// The emit API: a fused optimizer step's kernels as artifacts a compiler links
// into its own executable and launches without stepfuse at run time.
//
// Given a spec (update program with its scalar rules, the storage of each
// tensor, the layout class, the norm, the target), emit() returns the CUDA C++
// source of the step (kernels sf_reduce and sf_update), the CUBIN or PTX NVRTC
// made of it, and a description of the kernel ABI: argument order and C types,
// grid and block, the device memory the caller allocates, the table formats, and
// how the scalar stage runs. plan_kernel_tables() gives the tables of a concrete
// tensor list (sizes only; the caller fills in device addresses).
// docs/update-programs.md walks through it; examples/emit_kernel.cpp and
// examples/run_emitted/ are a complete emitter and launcher.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "stepfuse/device_abi.h"  // sf_tensor, sf_span, sf_hyper, ...: the kernels' C ABI
#include "stepfuse/types.hpp"
#include "stepfuse/update_program.hpp"

namespace stepfuse {

struct EmitTarget {
  enum class Kind : std::uint8_t {
    cuda_cubin,  // machine code for one architecture, sm_XY
    cuda_ptx,    // PTX for compute_XY: the driver compiles it for that or any newer GPU
    cpu,         // LLVM IR / object code: needs the LLVM backend (not built: Error(unsupported))
  };
  Kind kind = Kind::cuda_cubin;
  int sm = 90;  // compute capability major*10 + minor (CUDA targets)

  static EmitTarget cubin(int sm) { return {Kind::cuda_cubin, sm}; }
  static EmitTarget ptx(int sm) { return {Kind::cuda_ptx, sm}; }
  static EmitTarget cpu() { return {Kind::cpu, 0}; }
};

// The storage of one tensor: what a kernel is specialized for (sizes are not).
struct EmitTensor {
  DType weight = DType::f32;
  DType grad = DType::f32;
  bool master = false;  // fp32 master weights beside f16/bf16 weights (the update reads and writes the master)
};

struct EmitRequest {
  // The program and its scalar rules (UpdateProgram::from_config(cfg) for a
  // built-in). The rules are not compiled in: the ABI lists them and they are
  // passed to every launch (sf_hyper), so they can change without recompiling.
  UpdateProgram program;
  // One entry per tensor, in order. The kernels handle every combination present.
  std::vector<EmitTensor> tensors;
  // All tensors are consecutive views of one weight buffer and one grad buffer (one
  // combination; masters and state then laid out alike): sf_update indexes one
  // flat range instead of reading a block table.
  bool flat = false;
  // Every weight and grad base address allows 4-element vector accesses (16 bytes
  // for f32, 8 for f16/bf16): the update uses vector loads and stores.
  bool aligned16 = false;
  double norm_type = 2.0;  // 2.0 or INFINITY: the norm clipping and the reported norm use
  EmitTarget target;
  // false: the source and the ABI only (no NVRTC needed); binary stays empty.
  bool compile = true;
};

struct EmittedKernel {
  std::string source;  // self-contained CUDA C++ (no #include), both kernels, extern "C"
  std::string binary;  // CUBIN (binary) or PTX (text), per target; empty when !compile
  std::string arch;    // "sm_90" or "compute_90"
  std::vector<std::string> kernel_names;  // {"sf_reduce", "sf_update"}
  // The kernel ABI as JSON (format "stepfuse.kernel_abi", version 1): program,
  // streams and scalar rules, spec, target and NVRTC options, constants, every
  // struct with its field offsets, the kernels with their parameters in order (C
  // types), grids and blocks, the device memory to allocate, the tables and the
  // step sequence. Human-readable (indented) and machine-readable.
  std::string abi;
  // The C declarations the ABI names (sf_tensor, sf_span, sf_hyper, sf_step_state,
  // the scalar rules, the constants): the text of stepfuse/device_abi.h, for code
  // generated elsewhere.
  std::string abi_header;
};

// Generates (and with request.compile, compiles with NVRTC; no GPU needed) the
// step kernels of a spec. Allocates; touches no GPU; uses no cache.
// Throws Error(invalid_argument) for a bad request (no tensors, an invalid dtype, a
// master beside f32 weights, flat with more than one dtype combination, a norm
// other than 2 or inf, an impossible sm), Error(unsupported) for a CPU target
// (needs the LLVM backend, not built) or when NVRTC is not available,
// Error(compile_failed) with the log and numbered source if NVRTC rejects it.
EmittedKernel emit(const EmitRequest& request);

// The tables and launch shapes for a concrete tensor list of the request's spec.
struct KernelTables {
  // sf_reduce's and sf_update's tensor table. grad, weight and master are null:
  // set every tensor's to its device addresses (master: the master buffer plus
  // master_offsets[i] floats, or null). In the flat layout the tensors are
  // consecutive views, and sf_update indexes the whole range from tensor 0's.
  std::vector<sf_tensor> tensors;
  std::vector<std::int64_t> master_offsets;  // per tensor: element offset in the master buffer, or -1
  std::vector<sf_span> chunks;  // sf_reduce: one per SF_CHUNK_ELEMS gradients of a tensor, in order
  std::vector<sf_span> blocks;  // sf_update (table layout): one per SF_UPDATE_ELEMS elements; unused when flat
  std::int64_t state_elems = 0;   // floats in each state buffer (one buffer per state stream)
  std::int64_t master_elems = 0;  // floats in the master buffer
  std::int64_t flat_numel = 0;    // sf_update's flat_numel argument
  unsigned reduce_grid = 1, reduce_block = 0;  // sf_reduce <<<reduce_grid, reduce_block>>>
  unsigned update_grid = 1, update_block = 0;  // sf_update <<<update_grid, update_block>>>
  std::size_t partials_bytes = 0;     // device scratch: sf_partial per chunk (at least one)
  std::size_t tensor_sums_bytes = 0;  // device scratch: one double per tensor
  std::size_t step_state_bytes = 0;   // sizeof(sf_step_state), zeroed once before the first step
};

// `numels[i]` is tensor i's element count (request.tensors.size() of them).
// Host only; allocates. Error(invalid_argument) as emit(), or for a size mismatch
// or a negative count.
KernelTables plan_kernel_tables(const EmitRequest& request, std::span<const std::int64_t> numels);

}  // namespace stepfuse
