// The emit API: a fused optimizer step's kernels as artifacts a compiler links
// into its own executable and launches without stepfuse at run time.
//
// Given a spec (update program with its scalar rules, the storage of each
// tensor, the layout class, the norm, the target), emit() returns, for a CUDA
// target, the CUDA C++ source of the step (kernels sf_reduce and sf_update), the
// CUBIN or PTX NVRTC made of it, and a description of the kernel ABI: argument
// order and C types, grid and block, the device memory the caller allocates, the
// table formats, and how the scalar stage runs. plan_kernel_tables() gives the
// tables of a concrete tensor list (sizes only; the caller fills in device
// addresses). For a CPU target (needs the LLVM backend) it returns the LLVM IR of
// the step's plain C-callable functions (sf_cpu_update_*, sf_cpu_reduce_*), the
// ELF object file compiled from it, the ABI (JSON) and a C header declaring them;
// the caller runs the chunk loop, the fp64 combine and the scalar stage itself.
// docs/update-programs.md walks through both; examples/emit_kernel.cpp with
// examples/run_emitted/ (CUDA) and examples/emit_cpu_kernel.cpp with
// examples/run_emitted_cpu/ (CPU) are complete emitters and callers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stepfuse/device_abi.h"  // sf_tensor, sf_span, sf_hyper, ...: the kernels' C ABI
#include "stepfuse/types.hpp"
#include "stepfuse/update_program.hpp"

namespace stepfuse {

struct EmitTarget {
  enum class Kind : std::uint8_t {
    cuda_cubin,  // machine code for one architecture, sm_XY
    cuda_ptx,    // PTX for compute_XY: the driver compiles it for that or any newer GPU
    cpu,         // LLVM IR and an ELF object: needs the LLVM backend (not built: Error(unsupported))
  };
  Kind kind = Kind::cuda_cubin;
  int sm = 90;  // compute capability major*10 + minor (CUDA targets)
  // CPU targets. cpu_name: an LLVM CPU name ("x86-64-v3", "skylake-avx512",
  // "znver3"); empty or "native": this machine's CPU with its features. triple: an
  // LLVM target triple of this machine's architecture (the build initializes only
  // the native LLVM target); empty: this machine's. features: LLVM feature
  // flags added to the CPU's own ("-avx512f" caps the vectors at 256 bits); empty:
  // the CPU's. The vector width of the generated loops follows from them.
  // (Default member initializers keep {kind, sm} free of -Wmissing-field-initializers.)
  std::string cpu_name = {};
  std::string triple = {};
  std::string features = {};

  static EmitTarget cubin(int sm) { return {Kind::cuda_cubin, sm}; }
  static EmitTarget ptx(int sm) { return {Kind::cuda_ptx, sm}; }
  // This machine's CPU (what the stepfuse LLVM backend itself compiles for).
  static EmitTarget cpu() { return {Kind::cpu, 0}; }
  // A named CPU, for code that runs elsewhere: cpu("x86-64-v3") runs on any x86-64
  // with AVX2 and FMA.
  static EmitTarget cpu(std::string cpu_name, std::string triple = "", std::string features = "") {
    return {Kind::cpu, 0, std::move(cpu_name), std::move(triple), std::move(features)};
  }
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
  // flat range instead of reading a block table. CUDA only: the CPU functions take
  // any element range of any tensor, so for a CPU target flat is checked (one
  // combination) and otherwise ignored.
  bool flat = false;
  // Every weight and grad base address allows 4-element vector accesses (16 bytes
  // for f32, 8 for f16/bf16): the update uses vector loads and stores. CUDA only:
  // the CPU functions use unaligned vector accesses, so a CPU target ignores it.
  bool aligned16 = false;
  double norm_type = 2.0;  // 2.0 or INFINITY: the norm clipping and the reported norm use
  EmitTarget target;
  // false: the source and the ABI only (CUDA: no NVRTC needed); binary stays empty.
  bool compile = true;
};

struct EmittedKernel {
  // CUDA: self-contained CUDA C++ (no #include), both kernels, extern "C".
  // CPU: the LLVM IR module as text, as the emitter wrote it (before optimization:
  // one readable function per symbol, with the target's vector width, target-cpu
  // and target-features attributes); binary is the O3-optimized module compiled.
  std::string source;
  // CUBIN (binary) or PTX (text), or for a CPU target the ELF relocatable object
  // (position-independent) defining kernel_names; empty when !compile.
  std::string binary;
  std::string arch;  // "sm_90", "compute_90", or the CPU name ("znver3", "x86-64-v3")
  // CUDA: {"sf_reduce", "sf_update"}. CPU: the function symbols, the update
  // functions (one per dtype combination, first-use order) then the reduce
  // functions (one per grad dtype, first-use order).
  std::vector<std::string> kernel_names;
  // The kernel ABI as JSON (format "stepfuse.kernel_abi", version 1): program,
  // streams and scalar rules, spec, target (NVRTC options, or triple, CPU,
  // features, vector width and LLVM version), constants, every struct with its
  // field offsets, the kernels with their parameters in order (C types; for a CPU
  // target also each C declaration), grids and blocks (CUDA), the memory to
  // allocate, the tables or the chunking, the step sequence and the threading
  // contract (CPU). Human-readable (indented) and machine-readable.
  std::string abi;
  // CUDA: the C declarations the ABI names (sf_tensor, sf_span, sf_hyper,
  // sf_step_state, the scalar rules, the constants): the text of
  // stepfuse/device_abi.h, for code generated elsewhere. CPU: a self-contained C
  // header (only <stdint.h>): SF_CPU_CHUNK_ELEMS, sf_cpu_update_args, the scalar
  // rules with sf_eval_rule (jit/step_scalars.h, as in device_abi.h) and the
  // spec's functions.
  std::string abi_header;
};

// Generates (and with request.compile, compiles with NVRTC, no GPU needed, or
// with LLVM for a CPU target) the step kernels of a spec. Allocates; touches no
// GPU; uses no cache.
// Throws Error(invalid_argument) for a bad request (no tensors, an invalid dtype, a
// master beside f32 weights, flat with more than one dtype combination, a norm
// other than 2 or inf, an impossible sm, a CPU name or triple LLVM does not know
// here, a triple without a CPU name), Error(unsupported) for a CPU target without
// the LLVM backend (not built: install llvm-14-dev and rebuild) or a CUDA target
// without NVRTC, Error(compile_failed) with the log and numbered source if NVRTC
// rejects it, or if LLVM fails.
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

// `numels[i]` is tensor i's element count (request.tensors.size() of them). The
// tables are the CUDA kernels' (for any target; a CPU caller needs none: it walks
// each tensor in SF_CPU_CHUNK_ELEMS chunks itself).
// Host only; allocates. Error(invalid_argument) as emit(), or for a size mismatch
// or a negative count.
KernelTables plan_kernel_tables(const EmitRequest& request, std::span<const std::int64_t> numels);

}  // namespace stepfuse
