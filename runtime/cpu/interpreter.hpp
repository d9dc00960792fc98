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
  ExecSrc src[4];
};
using ExecFn = void (*)(const ExecCall& call, std::size_t n);

class Interpreter {
 public:
  // Elements per block in blocked mode: ~1024 keeps all temporaries in L1/L2
  // (measured best on the machines this was tuned on).
  static constexpr std::size_t kBlock = 1024;

  Interpreter(const Program& program, DType weight, DType grad, bool masters);

  int num_slots() const { return lowered_.num_slots; }
  int num_ops() const { return static_cast<int>(lowered_.code.size()); }

  // All ops over elements [begin, begin + n) of one tensor, kBlock at a time.
  // `scratch` holds num_slots() * kBlock floats. Writes weight, master, state.
  void run_blocked(const UpdateArgs& args, std::size_t begin, std::size_t n, float* scratch) const;

  // Op k over elements [begin, begin + n); slots[s] points at element `begin`
  // of temporary s. Used by the unfused baseline.
  void run_op(int k, const UpdateArgs& args, std::size_t begin, std::size_t n, float* const* slots) const;

 private:
  ExecCall resolve(const jit::LInstr& li, const UpdateArgs& args, std::size_t begin, float* const* slots) const;

  jit::LoweredProgram lowered_;
  DType weight_, grad_;
  ExecFn exec_;
};

// The interpreters of a tensor list: one per dtype combination present (tensors
// with different dtypes run different lowered programs). f32_grads: every
// gradient is read as fp32 (the unfused baseline reads its fp32 temporary).
class InterpreterSet {
 public:
  InterpreterSet(const Program& program, const jit::Layout& layout, bool f32_grads);
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
