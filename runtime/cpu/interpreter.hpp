// The blocked interpreter: runs an update program known only at run time, op
// by op over blocks of elements, with ops reading and writing the streams in
// place and common op chains fused into superinstructions. Also the engine of
// the unfused baseline (one op at a time over whole tensors).
#pragma once

#include <cstddef>
#include <string>

#include <memory>
#include <vector>

#include "jit/layout.hpp"
#include "jit/program_analysis.hpp"
#include "runtime/cpu/kernels.hpp"

namespace stepfuse::cpu {

// One lowered op with its operands resolved to memory (Highway side).
struct ExecSrc {
  const float* p = nullptr;  // null: broadcast `s`
  float s = 0.0f;
};
struct ExecCall {
  jit::LKind kind = jit::LKind::copy;
  Op op = Op::add;
  std::uint8_t attr = 0;
  DType lp_type = DType::f32;  // widen/narrow: the stored dtype
  float* dst = nullptr;
  const void* lp_src = nullptr;  // widen
  void* lp_dst = nullptr;        // narrow
  // narrow with stochastic rounding: the key, and the model index of lp_dst's element 0
  bool stochastic = false;
  std::uint64_t sr_seed = 0, sr_step = 0, sr_first = 0;
  // widen/narrow of compensated bf16 weights: the compensations of lp_src's / lp_dst's element 0
  std::uint16_t* comp = nullptr;
  float* lanes = nullptr;        // reduce: the slot's 32 canonical accumulator lanes, in/out
  ExecSrc src[4];
};
using ExecFn = void (*)(const ExecCall& call, std::size_t n);

class Interpreter {
 public:
  // Elements per block in blocked mode: ~1024 keeps all temporaries in L1/L2
  // (measured best on the machines this was tuned on).
  static constexpr std::size_t kBlock = 1024;

  // stochastic: bf16 weights without masters, rounded stochastically when stored;
  // compensated: bf16 weights without masters, with compensations in args.master.
  Interpreter(const Program& program, DType weight, DType grad, bool masters, bool stochastic = false,
              bool compensated = false);

  int num_slots() const { return lowered_.num_slots; }
  int num_ops() const { return static_cast<int>(lowered_.code.size()); }
  // A two-phase program: ops [0, phase2_begin()) are phase 1, the rest phase 2.
  bool two_phase() const { return lowered_.two_phase; }
  int phase2_begin() const { return lowered_.phase2_begin; }

  // The update (phase 2 of a two-phase program, whose args.norms are set) over
  // elements [begin, begin + n) of one tensor, kBlock at a time. `scratch` holds
  // num_slots() * kBlock floats. Writes weight, master, state.
  void run_blocked(const UpdateArgs& args, std::size_t begin, std::size_t n, float* scratch) const;
  // Phase 1 of a two-phase program over one chunk, elements [begin, begin + n) (begin
  // a multiple of 32 within the tensor, n <= kChunkElems), kBlock at a time: writes
  // state, and sums[r] = the chunk's canonical fp32 sum of squares of reduction slot r
  // (docs/architecture.md §5; 0 for slots it does not reduce), r < kMaxNormSlots.
  void run_phase1_blocked(const UpdateArgs& args, std::size_t begin, std::size_t n, float* scratch, float* sums) const;

  // Op k over elements [begin, begin + n); slots[s] points at element `begin`
  // of temporary s. Used by the unfused baseline. A reduce op (phase 1) adds into
  // lanes[attr * 32 .. attr * 32 + 31], the slot's accumulator lanes of the chunk
  // (element i into lane i mod 32; begin a multiple of 32 within the chunk).
  void run_op(int k, const UpdateArgs& args, std::size_t begin, std::size_t n, float* const* slots,
              float* lanes = nullptr) const;

 private:
  ExecCall resolve(const jit::LInstr& li, const UpdateArgs& args, std::size_t begin, float* const* slots,
                   float* lanes = nullptr) const;

  jit::LoweredProgram lowered_;
  DType weight_, grad_;
  bool stochastic_ = false;
  bool compensated_ = false;
  ExecFn exec_;
};

// The interpreters of a tensor list: one per dtype combination present (tensors
// with different dtypes run different lowered programs). f32_grads: every
// gradient is read as fp32 (the unfused baseline reads its fp32 temporary).
// The fixed pairwise tree over a chunk's 32 accumulator lanes (lanes[j] += lanes[j + w]
// for w = 16, 8, 4, 2, 1; the reduce pass's, docs/architecture.md §5): lanes[0].
float canonical_lane_tree(float* lanes);

class InterpreterSet {
 public:
  // tensor_programs[t]: the program tensor t runs (its param group's). One
  // interpreter per distinct (program, dtype combination).
  InterpreterSet(const std::vector<const Program*>& tensor_programs, const jit::Layout& layout, bool f32_grads);
  std::size_t size() const { return interpreters_.size(); }
  const Interpreter& operator[](std::size_t group) const { return *interpreters_[group]; }
  // The group (index above) of tensor t.
  std::size_t group_of(std::size_t tensor) const { return group_of_tensor_[tensor]; }
  int max_slots() const { return max_slots_; }

 private:
  std::vector<std::unique_ptr<Interpreter>> interpreters_;
  std::vector<std::size_t> group_of_tensor_;
  int max_slots_ = 0;
};

}  // namespace stepfuse::cpu
