// The CPU backend's kernels as plain function pointers, picked once per
// optimizer by Highway's dynamic dispatch (the best target this CPU supports).
#pragma once

#include <cstddef>
#include <cstdint>

#include "jit/builtins.hpp"
#include "jit/layout.hpp"
#include "jit/llvm/cpu_abi.h"
#include "stepfuse/program.hpp"
#include "stepfuse/types.hpp"

namespace stepfuse::cpu {

// Elements per reduce/update chunk: the canonical chunk (jit/layout.hpp). Reduction
// order is fixed per chunk (docs/architecture.md §5), so this is part of the numerics.
// A multiple of 32 (the interleaved accumulator lanes).
inline constexpr std::size_t kChunkElems = static_cast<std::size_t>(jit::kChunkElems);
static_assert(kChunkElems % 32 == 0, "the reduce's 32 interleaved lanes");

// ---- conversions (whole arrays; any length) ----
void widen(DType type, const void* src, float* dst, std::size_t n);    // exact
void narrow(const float* src, DType type, void* dst, std::size_t n);   // round to nearest even
// Stochastic rounding (jit/stochastic_round.h): the random bits of model elements
// first .. first + n - 1 at step `step` under `seed` (sf_sr_bits of each), and
// f32 -> bf16 rounded stochastically, src[i] with the bits of model element first + i.
void rounding_bits(std::uint64_t seed, std::uint64_t step, std::uint64_t first, std::size_t n, std::uint16_t* bits);
void narrow_bf16_stochastic(const float* src, std::uint16_t* dst, std::size_t n, std::uint64_t seed,
                            std::uint64_t step, std::uint64_t first);
// Compensated bf16 weights (docs/low-precision.md): dst[i] = weight[i] + comp[i]
// (bf16 bit patterns, one fp32 addition), and its inverse: weight[i] = the bf16
// nearest src[i], comp[i] = the bf16 nearest src[i] - weight[i] (0 where the weight
// is not finite).
void widen_compensated(const std::uint16_t* weight, const std::uint16_t* comp, float* dst, std::size_t n);
void narrow_compensated(const float* src, std::uint16_t* weight, std::uint16_t* comp, std::size_t n);

// ---- reduce pass ----
// Partial results of one chunk of gradients (as stored, still loss-scaled).
struct ReducePartial {
  double sumsq = 0;    // sum of squares in the canonical order: 32 interleaved fp32 lanes, fixed tree
  float maxabs = 0;    // max |g| (inf-norm mode only)
  bool nonfinite = false;
};
enum class NormKind : std::uint8_t { l2, inf };
using ReduceFn = ReducePartial (*)(const void* grad, std::size_t n);
ReduceFn reduce_kernel(DType grad_type, NormKind kind);
// `ways` chunks at once (2 to kReduceWays), their loads interleaved: out[j] exactly
// as ReduceFn's of grad[j], n[j]. Many short tensors, each the caller's own
// allocation, then make as many streams for the hardware prefetchers at a time: with
// 10,000 tensors of 1-4 K elements, reducing 4 at once took about 1.25x less time than
// one after the other (2 threads, AMD EPYC; 2 at once: 1.2x; 6 or 8: no better than 4).
inline constexpr std::size_t kReduceWays = 4;
using ReduceGroupFn = void (*)(const void* const* grad, const std::size_t* n, ReducePartial* out);
ReduceGroupFn reduce_group_kernel(DType grad_type, NormKind kind, std::size_t ways);

// ---- update pass ----
// Base pointers of one tensor's streams: `state` is indexed by the program's
// stream index, `scalars` holds the program's per-step scalars. The struct the
// LLVM-compiled and emitted CPU functions read (jit/llvm/cpu_abi.h); value-initialize
// it (UpdateArgs a{}).
using UpdateArgs = sf_cpu_update_args;
// Updates elements [begin, begin + n) of one tensor. Writes weight, master and state.
using UpdateFn = void (*)(const UpdateArgs& args, std::size_t begin, std::size_t n);

// Phase 1 of a two-phase program over one chunk of one tensor, elements
// [begin, begin + n) (begin a multiple of 32 within the tensor, n <= kChunkElems):
// writes the state phase 1 stores, and sums[r] (r < kMaxNormSlots) = the chunk's
// canonical fp32 sum of squares of reduction slot r (0 for slots not reduced).
using Phase1Fn = void (*)(const UpdateArgs& args, std::size_t begin, std::size_t n, float* sums);

// How a fused kernel keeps the program's state streams: as fp32 (bf16 and q8 storage
// staged), or (but those it keeps in full precision) as bf16, read and written in
// registers; bf16_nearest: so, and with stochastically rounded weights rounded to
// nearest even (OptimizerOptions::stochastic_state_rounding off), where bf16 rounds
// that state stochastically.
enum class StateKernel : std::uint8_t { f32, bf16, bf16_nearest };
// The fused loop generated at compile time for a built-in program, or null (a
// two-phase program's: its phase 2). A bf16 variant is null for the combos without one
// (jit::bf16_state_index); bf16_nearest differs from bf16 only for stochastic combos.
UpdateFn fused_update_kernel(jit::Builtin program, const jit::DtypeCombo& combo, StateKernel state = StateKernel::f32);
// A two-phase built-in's phase-1 loop; null for a one-phase program.
Phase1Fn fused_phase1_kernel(jit::Builtin program, const jit::DtypeCombo& combo, StateKernel state = StateKernel::f32);
// The fused kernels are compiled in this many translation units, each a slice of
// the built-in programs (runtime/cpu/update_kernels_<k>.cpp).
inline constexpr int kUpdateSlices = 5;

// Name of the Highway target the kernels dispatch to ("AVX2", "SSE4", ...).
const char* dispatch_target_name();

}  // namespace stepfuse::cpu

namespace stepfuse::cpu {
// data[i] *= s for n elements stored as `type` (rounded back to nearest even).
// The unfused baseline's unscale and clip passes.
void scale_inplace(DType type, void* data, std::size_t n, float s);
// dst[i] = float(src[i]) * s: the unfused baseline's unscale pass into its fp32 temporary.
void widen_scaled(DType type, const void* src, float* dst, std::size_t n, float s);
}  // namespace stepfuse::cpu
