// The LLVM emitter and compiler for the CPU: (update program, spec) -> one LLVM
// module with the spec's fused update loops (one per dtype combination) and
// reduce loops (one per grad dtype), vectorized for a target CPU, optimized and
// compiled to object code (docs/architecture.md §3, §5).
//
// The generated code computes bitwise what the Highway kernels compute: every op
// is written with the same IEEE operations (no fast-math; max/min/sign/select
// with compares; f16/bf16 conversions with the same integer and fp32 steps), the
// reduce accumulates element i of a chunk into lane i mod 32 and combines the 32
// lanes with the same fixed tree. Only `contract` (off by default) lets LLVM fuse
// a multiply and an add of the update into one FMA: faster where the program has
// such pairs, equal to Highway within fp32 rounding instead of bitwise.
//
// The functions' C ABI (also what the emit API documents):
//   void  sf_cpu_update_<w>_<g>[_m|_sr|_kc][_bs](const sf_cpu_update_args* args, uint64_t begin, uint64_t n);
//       elements [begin, begin + n) of one tensor: reads grad, weight (or master),
//       state; writes weight, master, state (layout of cpu::UpdateArgs). `_bs`:
//       the program's state streams (but those it keeps in full precision) are
//       bf16 (uint16_t bit patterns behind the state[] pointers), loaded to fp32
//       and stored rounded to nearest even, as runtime/cpu/convert-inl.h does.
//   void  sf_cpu_phase1_<w>_<g>[_m|_sr|_kc][_bs](const sf_cpu_update_args* args, uint64_t begin, uint64_t n, float* sums);
//       a two-phase program only (then the update function is its phase 2, reading
//       args->norms): phase 1 over one reduce chunk [begin, begin + n) (begin a
//       multiple of 32 within the tensor, n <= SF_CPU_CHUNK_ELEMS); writes state and
//       sums[r] = the chunk's canonical fp32 sum of squares of slot r (0 if unused).
//   float sf_cpu_reduce_l2_<g>(const void* grad, uint64_t n);
//       the canonical fp32 sum of squares of n gradients (not finite: an inf/NaN
//       element or squares overflowing fp32; the caller rescans, see reduce.cpp).
//   float sf_cpu_reduce_inf_<g>(const void* grad, uint64_t n, uint32_t* nonfinite);
//       max |g| of n gradients; *nonfinite = 1 when one is inf or NaN.
//
// This header needs no LLVM headers; the implementation is built only when LLVM
// is found (STEPFUSE_HAVE_LLVM), else every function here throws
// Error(unsupported) and llvm_built() is false.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "jit/layout.hpp"
#include "stepfuse/program.hpp"
#include "stepfuse/types.hpp"

namespace stepfuse::jit {

// Everything the generated module depends on, except the target CPU.
struct CpuSpec {
  Program program;                // names unused (they are not part of the code)
  std::vector<DtypeCombo> combos;   // update functions: the combinations present, in first-use order
  // Combos (of `combos`) that also get update (and phase-1) functions with bf16 state
  // streams (the `_bs` symbols), for the tensors whose stored state is all bf16.
  std::vector<DtypeCombo> bf16_state;
  // The `_bs` functions of stochastically rounded weights round their bf16 state to
  // nearest even (OptimizerOptions::stochastic_state_rounding off); else stochastically,
  // with the bits of the state streams (sf_cpu_update_args::sr_stride).
  bool nearest_state = false;
  std::vector<DType> reduce_grads;  // reduce functions: the grad dtypes present
  bool inf_norm = false;          // reduce functions for the inf-norm (else L2)
  bool contract = false;          // let LLVM fuse mul+add pairs of the update into FMAs
};

// The CPU code is generated for: an LLVM target triple, CPU name and feature
// string ("+avx2,+fma,-avx512f,..."), and the vector width in fp32 lanes the
// loops are written with (the widest the features allow: 16, 8 or 4).
struct CpuTarget {
  std::string triple;
  std::string cpu;
  std::string features;
  int vector_width = 4;
  // This machine (what the JIT compiles for).
  static CpuTarget host();
  // A named CPU of this machine's architecture, with its default features
  // ("x86-64-v3", "skylake-avx512", "znver3"; empty features: the CPU's own).
  static CpuTarget named(const std::string& triple, const std::string& cpu, const std::string& features = "");
  std::string describe() const;  // "x86_64-pc-linux-gnu haswell (8 fp32 lanes)"
};

bool llvm_built();           // false when stepfuse was built without LLVM
std::string llvm_version();  // "14.0.6", or "" when not built

std::string cpu_update_symbol(const DtypeCombo& combo, bool bf16_state = false);
std::string cpu_phase1_symbol(const DtypeCombo& combo, bool bf16_state = false);  // two-phase programs
std::string cpu_reduce_symbol(DType grad, bool inf_norm);

// Stable across runs and compilers; with the target and versions, the cache key.
std::string cpu_canonical_text(const CpuSpec& spec);
std::string cpu_cache_key(const CpuSpec& spec, const CpuTarget& target);  // of the jit object

// The module as LLVM IR text: before optimization (what the emitter wrote) or
// after the O3 pipeline for the target.
std::string cpu_module_ir(const CpuSpec& spec, const CpuTarget& target, bool optimized);
// The optimized module compiled to a relocatable object file (ELF on Linux).
// Error(invalid_argument) for a spec the emitter cannot handle, Error(compile_failed)
// when LLVM fails (the target is unknown, say).
// relocatable: position-independent, small code model, for a program's own link (the
// emit API). jit: the large code model with static relocations, for ORC to link into this
// process wherever its memory manager puts the sections (what the kernel cache holds).
enum class CpuObjectKind { relocatable, jit };
std::string cpu_compile_object(const CpuSpec& spec, const CpuTarget& target,
                               CpuObjectKind kind = CpuObjectKind::relocatable);

}  // namespace stepfuse::jit
