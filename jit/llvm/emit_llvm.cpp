// The LLVM emitter (see emit_llvm.hpp): IR written with IRBuilder, explicit
// vectors of the target's width (the loops need no auto-vectorizer, and the
// order of every operation is the one written here), optimized with the O3
// pipeline for the target and compiled to object code.
#include "jit/llvm/emit_llvm.hpp"

#include <llvm/ADT/SmallVector.h>
#include <llvm/ADT/StringMap.h>
#include <llvm/Analysis/CGSCCPassManager.h>
#include <llvm/Analysis/LoopAnalysisManager.h>
#include <llvm/Config/llvm-config.h>
#include <llvm/IR/Constants.h>
#include <llvm/IR/IRBuilder.h>
#include <llvm/IR/Intrinsics.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/LegacyPassManager.h>
#include <llvm/IR/Module.h>
#include <llvm/IR/PassManager.h>
#include <llvm/IR/Verifier.h>
#include <llvm/MC/MCSubtargetInfo.h>
#include <llvm/MC/TargetRegistry.h>
#include <llvm/Passes/OptimizationLevel.h>
#include <llvm/Passes/PassBuilder.h>
#include <llvm/Support/Host.h>
#include <llvm/Support/TargetSelect.h>
#include <llvm/Support/raw_ostream.h>
#include <llvm/Target/TargetMachine.h>
#include <llvm/Target/TargetOptions.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "jit/llvm/cpu_abi.h"
#include "jit/program_analysis.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::jit {
namespace {

// Bumped whenever the generated code changes for the same spec (the cache key has it).
constexpr int kEmitterVersion = 10;  // 3: two-phase programs (sf_cpu_phase1_*, sf_cpu_update_args::norms);
                                    // 4: the inf-norm reduce ignores NaNs (as the CUDA kernels);
                                    // 5-7: stochastic rounding of bf16 weights with the random bits the
                                    //    caller drew (jit/stochastic_round.h, sf_cpu_update_args::sr_*);
                                    // 8: compensated bf16 weights (the master slot holds the compensations)
                                    // 9, 10: functions with bf16 state streams (CpuSpec::bf16_state, `_bs`),
                                    //    stochastically rounded in stochastic combos (sr_stride)
// The reduce's canonical lanes (runtime/cpu/reduce.cpp, the GPU's warp).
constexpr unsigned kLanes = 32;
// Byte offsets of the update functions' argument struct (jit/llvm/cpu_abi.h).
constexpr unsigned kArgsGrad = offsetof(sf_cpu_update_args, grad), kArgsWeight = offsetof(sf_cpu_update_args, weight),
                   kArgsMaster = offsetof(sf_cpu_update_args, master), kArgsState = offsetof(sf_cpu_update_args, state),
                   kArgsScalars = offsetof(sf_cpu_update_args, scalars), kArgsNorms = offsetof(sf_cpu_update_args, norms),
                   kArgsSrBits = offsetof(sf_cpu_update_args, sr_bits),
                   kArgsSrStride = offsetof(sf_cpu_update_args, sr_stride);
static_assert(SF_CPU_MAX_STREAMS == kMaxStreams, "state[] holds every program stream");
static_assert(SF_CPU_MAX_NORM_SLOTS == kMaxNormSlots, "norms[] holds every reduction slot");

void init_llvm() {
  static std::once_flag once;
  std::call_once(once, [] {
    llvm::InitializeNativeTarget();
    llvm::InitializeNativeTargetAsmPrinter();
    llvm::InitializeNativeTargetAsmParser();
  });
}

[[noreturn]] void llvm_failed(const std::string& what) {
  throw Error(ErrorCode::compile_failed, "LLVM: " + what);
}

// `for_jit`: code that ORC links into this process, whose sections RuntimeDyld may place
// more than 2 GiB apart: the large code model with static relocations (absolute 64-bit
// addresses for constants and calls). Otherwise: position-independent code, small model,
// for a program's own link.
std::unique_ptr<llvm::TargetMachine> target_machine(const CpuTarget& t, bool for_jit = false) {
  init_llvm();
  std::string err;
  const llvm::Target* target = llvm::TargetRegistry::lookupTarget(t.triple, err);
  if (target == nullptr) llvm_failed("no target for triple '" + t.triple + "' (" + err + ")");
  llvm::TargetOptions options;  // IEEE: no unsafe math; fusing only what the IR marks `contract`
  options.AllowFPOpFusion = llvm::FPOpFusion::Standard;
  std::unique_ptr<llvm::TargetMachine> tm(target->createTargetMachine(
      t.triple, t.cpu, t.features, options, for_jit ? llvm::Reloc::Static : llvm::Reloc::PIC_,
      for_jit ? llvm::Optional<llvm::CodeModel::Model>(llvm::CodeModel::Large) : llvm::None,
      llvm::CodeGenOpt::Aggressive));
  if (!tm) llvm_failed("cannot create a target machine for " + t.describe());
  return tm;
}

int vector_width_of(const llvm::TargetMachine& tm) {
  const llvm::MCSubtargetInfo* sti = tm.getMCSubtargetInfo();
  const llvm::Triple triple(tm.getTargetTriple());
  if (!triple.isX86()) return 4;  // NEON, and the rest: 128-bit vectors
  if (sti->checkFeatures("+avx512f")) return 16;
  if (sti->checkFeatures("+avx")) return 8;
  return 4;
}

// ---- IR for one spec ---------------------------------------------------------------

class Emitter {
 public:
  Emitter(llvm::Module& m, const CpuTarget& target, bool contract, bool nearest_state)
      : ctx_(m.getContext()), mod_(m), b_(ctx_), target_(target), contract_(contract), nearest_state_(nearest_state) {}

  // bf16_state: the `_bs` variant, with the program's stored state streams as bf16.
  void update_function(const Program& p, const DtypeCombo& c, bool bf16_state);
  void phase1_function(const Program& p, const DtypeCombo& c, bool bf16_state);
  void reduce_function(DType g, bool inf_norm);

 private:
  llvm::Type* f32() { return b_.getFloatTy(); }
  llvm::Type* i32() { return b_.getInt32Ty(); }
  llvm::Type* i64() { return b_.getInt64Ty(); }
  llvm::Type* i8p() { return b_.getInt8PtrTy(); }
  static llvm::Type* vec(llvm::Type* t, unsigned w) { return w == 1 ? t : llvm::FixedVectorType::get(t, w); }
  llvm::Type* storage(DType t) { return t == DType::f32 ? f32() : b_.getInt16Ty(); }
  llvm::Constant* fconst(float x, unsigned w) { return llvm::ConstantFP::get(vec(f32(), w), x); }
  llvm::Constant* uconst(std::uint32_t x, unsigned w) { return llvm::ConstantInt::get(vec(i32(), w), x); }
  llvm::Value* splat(llvm::Value* s, unsigned w) { return w == 1 ? s : b_.CreateVectorSplat(w, s); }
  llvm::Value* as_int(llvm::Value* v) { return b_.CreateBitCast(v, vec(i32(), width(v))); }
  llvm::Value* as_float(llvm::Value* v) { return b_.CreateBitCast(v, vec(f32(), width(v))); }
  static unsigned width(llvm::Value* v) {
    auto* vt = llvm::dyn_cast<llvm::FixedVectorType>(v->getType());
    return vt ? vt->getNumElements() : 1;
  }
  llvm::Value* select(llvm::Value* mask, llvm::Value* t, llvm::Value* f) { return b_.CreateSelect(mask, t, f); }
  llvm::Value* fmul(llvm::Value* a, llvm::Value* x) { return fp_op(b_.CreateFMul(a, x)); }
  llvm::Value* fadd(llvm::Value* a, llvm::Value* x) { return fp_op(b_.CreateFAdd(a, x)); }
  llvm::Value* fsub(llvm::Value* a, llvm::Value* x) { return fp_op(b_.CreateFSub(a, x)); }
  llvm::Value* fp_op(llvm::Value* v) {  // `contract` on the update's multiplies and adds when asked
    if (contract_ && in_update_)
      if (auto* inst = llvm::dyn_cast<llvm::Instruction>(v)) inst->setHasAllowContract(true);
    return v;
  }

  // Stored elements: `w` elements of type `t` at element `i` of `base` (any alignment).
  llvm::Value* load(llvm::Value* base, DType t, llvm::Value* i, unsigned w) {
    llvm::Value* p = b_.CreateInBoundsGEP(storage(t), b_.CreatePointerCast(base, storage(t)->getPointerTo()), i);
    p = b_.CreatePointerCast(p, vec(storage(t), w)->getPointerTo());
    return b_.CreateAlignedLoad(vec(storage(t), w), p, llvm::Align(1));
  }
  void store(llvm::Value* v, llvm::Value* base, DType t, llvm::Value* i) {
    const unsigned w = width(v);
    llvm::Value* p = b_.CreateInBoundsGEP(storage(t), b_.CreatePointerCast(base, storage(t)->getPointerTo()), i);
    p = b_.CreatePointerCast(p, vec(storage(t), w)->getPointerTo());
    b_.CreateAlignedStore(v, p, llvm::Align(1));
  }
  llvm::Value* load_as_f32(llvm::Value* base, DType t, llvm::Value* i, unsigned w) {
    llvm::Value* raw = load(base, t, i, w);
    return t == DType::f32 ? raw : widen(t, b_.CreateZExt(raw, vec(i32(), w)));
  }
  void store_from_f32(llvm::Value* v, llvm::Value* base, DType t, llvm::Value* i) {
    if (t == DType::f32) return store(v, base, t, i);
    store(b_.CreateTrunc(narrow(t, v), vec(b_.getInt16Ty(), width(v))), base, t, i);
  }

  // The conversions of runtime/cpu/convert-inl.h, step for step. `h`: 16-bit patterns in i32 lanes.
  llvm::Value* widen(DType t, llvm::Value* h) {
    const unsigned w = width(h);
    if (t == DType::bf16) return as_float(b_.CreateShl(h, 16));
    llvm::Value* sign = b_.CreateShl(b_.CreateAnd(h, uconst(0x8000u, w)), 16);
    llvm::Value* em = b_.CreateAnd(h, uconst(0x7FFFu, w));
    llvm::Value* shifted = b_.CreateShl(em, 13);
    llvm::Value* finite = b_.CreateFMul(as_float(shifted), fconst(0x1.0p112f, w));
    llvm::Value* inf_nan = b_.CreateOr(shifted, uconst(0x7F800000u, w));
    llvm::Value* is_inf_nan = b_.CreateICmpSGT(em, uconst(0x7BFF, w));
    return as_float(b_.CreateOr(select(is_inf_nan, inf_nan, as_int(finite)), sign));
  }
  llvm::Value* narrow(DType t, llvm::Value* v) {  // 16-bit patterns in i32 lanes
    const unsigned w = width(v);
    llvm::Value* u = as_int(v);
    llvm::Value* is_nan = b_.CreateFCmpUNO(v, v);
    if (t == DType::bf16) {
      llvm::Value* lsb = b_.CreateAnd(b_.CreateLShr(u, 16), uconst(1, w));
      llvm::Value* rounded = b_.CreateLShr(b_.CreateAdd(u, b_.CreateAdd(uconst(0x7FFFu, w), lsb)), 16);
      llvm::Value* quiet_nan = b_.CreateOr(b_.CreateLShr(u, 16), uconst(0x40u, w));
      return select(is_nan, quiet_nan, rounded);
    }
    llvm::Value* base = b_.CreateFMul(b_.CreateFMul(abs(v), fconst(0x1.0p112f, w)), fconst(0x1.0p-110f, w));
    llvm::Value* exp_w = b_.CreateAnd(u, uconst(0x7F800000u, w));
    llvm::Value* floor = uconst(0x38800000u, w);
    llvm::Value* bias = b_.CreateAdd(select(b_.CreateICmpSGT(exp_w, floor), exp_w, floor), uconst(0x07800000u, w));
    llvm::Value* bits = as_int(b_.CreateFAdd(as_float(bias), base));
    llvm::Value* exp_bits = b_.CreateAnd(b_.CreateLShr(bits, 13), uconst(0x7C00u, w));
    llvm::Value* mantissa_bits = b_.CreateAnd(bits, uconst(0x0FFFu, w));
    llvm::Value* magnitude = select(is_nan, uconst(0x7E00u, w), b_.CreateAdd(exp_bits, mantissa_bits));
    return b_.CreateOr(magnitude, b_.CreateLShr(b_.CreateAnd(u, uconst(0x80000000u, w)), 16));
  }
  // The bf16 bits of `v` rounded stochastically with the random 16-bit values `r` (i32 lanes):
  // sf_bf16_round_stochastic (jit/stochastic_round.h), 16-bit patterns in i32 lanes.
  llvm::Value* narrow_stochastic(llvm::Value* v, llvm::Value* r) {
    const unsigned w = width(v);
    llvm::Value* u = as_int(v);
    llvm::Value* rounded = b_.CreateLShr(b_.CreateAdd(u, r), 16);  // inf stays inf
    llvm::Value* quiet_nan = b_.CreateOr(b_.CreateLShr(u, 16), uconst(0x40u, w));
    return select(b_.CreateFCmpUNO(v, v), quiet_nan, rounded);
  }
  llvm::Value* round_to(DType t, llvm::Value* v) { return t == DType::f32 ? v : widen(t, narrow(t, v)); }
  llvm::Value* abs(llvm::Value* v) { return b_.CreateUnaryIntrinsic(llvm::Intrinsic::fabs, v); }

  // One op of the update IR (runtime/cpu/vector_ops-inl.h).
  llvm::Value* op(const Instr& in, llvm::Value* a, llvm::Value* x, llvm::Value* c) {
    const unsigned w = width(a);
    switch (in.op) {
      case Op::neg: return b_.CreateFNeg(a);
      case Op::abs: return abs(a);
      case Op::sqrt: return b_.CreateUnaryIntrinsic(llvm::Intrinsic::sqrt, a);
      case Op::sign: {
        llvm::Value* one_signed = b_.CreateBinaryIntrinsic(llvm::Intrinsic::copysign, fconst(1.0f, w), a);
        llvm::Value* zero_or_one = select(b_.CreateFCmpOEQ(a, fconst(0.0f, w)), fconst(0.0f, w), one_signed);
        return select(b_.CreateFCmpUNO(a, a), a, zero_or_one);
      }
      case Op::convert: return round_to(static_cast<DType>(in.attr), a);
      case Op::add: return fadd(a, x);
      case Op::sub: return fsub(a, x);
      case Op::mul: return fmul(a, x);
      case Op::div: return b_.CreateFDiv(a, x);
      case Op::max: return select(b_.CreateFCmpOLT(a, x), x, a);
      case Op::min: return select(b_.CreateFCmpOLT(x, a), x, a);
      case Op::cmp_lt: return select(b_.CreateFCmpOLT(a, x), fconst(1.0f, w), fconst(0.0f, w));
      case Op::cmp_le: return select(b_.CreateFCmpOLE(a, x), fconst(1.0f, w), fconst(0.0f, w));
      case Op::cmp_eq: return select(b_.CreateFCmpOEQ(a, x), fconst(1.0f, w), fconst(0.0f, w));
      case Op::fma: return b_.CreateIntrinsic(llvm::Intrinsic::fma, {a->getType()}, {a, x, c});
      case Op::select: return select(b_.CreateFCmpOEQ(a, fconst(0.0f, w)), c, x);  // NaN selects x, as in C
      default: break;
    }
    throw std::logic_error("LLVM emitter: unexpected op " + std::string(op_name(in.op)));
  }

  struct Streams {
    llvm::Value* grad;
    llvm::Value* weight;
    llvm::Value* master;
    llvm::Value* state[kMaxStreams];
    llvm::Value* scalars[kMaxScalars];
    llvm::Value* norms[kMaxNormSlots];  // phase 2 of a two-phase program: the tensor's norms
    llvm::Value *sr_bits, *sr_begin;  // stochastic combos: element i's bits are sr_bits[i - sr_begin]
    DType state_dtype[kMaxStreams];   // how each state stream is stored: f32, or bf16 (the `_bs` functions)
    // `_bs` functions of stochastic combos (one-phase programs, the state rounded stochastically:
    // not CpuSpec::nearest_state): the offset of each stored bf16 stream's random bits from the
    // weights' (sr_bits[place * sr_stride + i - sr_begin]), else null
    llvm::Value* sr_state_offset[kMaxStreams];
  };
  Streams args_streams(const Program& p, const DtypeCombo& c, bool bf16_state, llvm::Value* args, llvm::Value* begin);

  // Stores `v` as bf16 at element i of the weights, rounded stochastically with the
  // random bits the caller drew for the elements (UpdateArgs::sr_bits): the vector
  // loop and the scalar tail alike, so every element rounds as the reference.
  void store_bf16_stochastic(llvm::Value* v, const Streams& s, llvm::Value* i) {
    const unsigned w = width(v);
    llvm::Value* r = b_.CreateZExt(load(s.sr_bits, DType::bf16, b_.CreateSub(i, s.sr_begin), w), vec(i32(), w));
    store(b_.CreateTrunc(narrow_stochastic(v, r), vec(b_.getInt16Ty(), w)), s.weight, DType::bf16, i);
  }

  // Stores `v` at element i of bf16 state stream k, rounded stochastically with the stream's
  // random bits (after the weights' in sr_bits, UpdateArgs::sr_stride).
  void store_state_stochastic(llvm::Value* v, const Streams& s, int k, llvm::Value* i) {
    const unsigned w = width(v);
    llvm::Value* at = b_.CreateAdd(s.sr_state_offset[k], b_.CreateSub(i, s.sr_begin));
    llvm::Value* r = b_.CreateZExt(load(s.sr_bits, DType::bf16, at, w), vec(i32(), w));
    store(b_.CreateTrunc(narrow_stochastic(v, r), vec(b_.getInt16Ty(), w)), s.state[k], DType::bf16, i);
  }

  // Compensated bf16 weights (runtime/cpu/convert-inl.h LoadCompensated and
  // StoreCompensated, step for step): the parameter is weight + compensation; it is
  // stored as the nearest bf16 weight and the nearest bf16 to the rest (0 where
  // the rest is not finite). Plain fadd/fsub: never contracted with the program's ops.
  llvm::Value* load_compensated(const Streams& s, llvm::Value* i, unsigned w) {
    return b_.CreateFAdd(load_as_f32(s.weight, DType::bf16, i, w), load_as_f32(s.master, DType::bf16, i, w));
  }
  void store_compensated(llvm::Value* v, const Streams& s, llvm::Value* i) {
    const unsigned w = width(v);
    llvm::Value* hi = narrow(DType::bf16, v);
    llvm::Value* rest = b_.CreateFSub(v, widen(DType::bf16, hi));
    llvm::Value* finite = b_.CreateFCmpONE(abs(rest), fconst(INFINITY, w));
    llvm::Value* lo = narrow(DType::bf16, select(finite, rest, fconst(0.0f, w)));
    store(b_.CreateTrunc(hi, vec(b_.getInt16Ty(), w)), s.weight, DType::bf16, i);
    store(b_.CreateTrunc(lo, vec(b_.getInt16Ty(), w)), s.master, DType::bf16, i);
  }

  // The program over `w` elements starting at element i. Phase 1 of a two-phase
  // program: reduced[slot] receives the values its reduce_sumsq ops reduce.
  void body(const Program& p, const DtypeCombo& c, const Streams& s, llvm::Value* i, unsigned w,
            llvm::Value** reduced = nullptr) {
    std::vector<llvm::Value*> v(p.num_instrs, nullptr);
    for (int k = 0; k < p.num_instrs; ++k) {
      const Instr& in = p.code[k];
      if (in.op == Op::load || in.op == Op::store) {
        const StreamRole role = p.streams[in.attr].role;
        if (in.op == Op::load) {
          if (role == StreamRole::grad) v[k] = load_as_f32(s.grad, c.grad, i, w);
          else if (role == StreamRole::param && c.master) v[k] = load(s.master, DType::f32, i, w);
          else if (role == StreamRole::param && c.compensated) v[k] = load_compensated(s, i, w);
          else if (role == StreamRole::param) v[k] = load_as_f32(s.weight, c.weight, i, w);
          else v[k] = load_as_f32(s.state[in.attr], s.state_dtype[in.attr], i, w);
        } else if (role == StreamRole::param) {
          if (c.master) store(v[in.a], s.master, DType::f32, i);
          if (c.compensated) store_compensated(v[in.a], s, i);
          else if (c.stochastic) store_bf16_stochastic(v[in.a], s, i);
          else store_from_f32(v[in.a], s.weight, c.weight, i);
        } else {
          if (s.sr_state_offset[in.attr] != nullptr) store_state_stochastic(v[in.a], s, in.attr, i);
          else store_from_f32(v[in.a], s.state[in.attr], s.state_dtype[in.attr], i);
        }
        continue;
      }
      if (in.op == Op::reduce_sumsq) {
        reduced[in.attr] = v[in.a];
        continue;
      }
      if (in.op == Op::constant) v[k] = fconst(in.imm, w);
      else if (in.op == Op::scalar) v[k] = splat(s.scalars[in.attr], w);
      else if (in.op == Op::tensor_norm) v[k] = splat(s.norms[in.attr], w);
      else {
        const int n = op_arity(in.op);
        v[k] = op(in, v[in.a], n > 1 ? v[in.b] : nullptr, n > 2 ? v[in.c] : nullptr);
      }
    }
  }

  llvm::Function* function(const std::string& name, llvm::Type* ret, std::vector<llvm::Type*> params) {
    auto* f = llvm::Function::Create(llvm::FunctionType::get(ret, params, false), llvm::Function::ExternalLinkage,
                                     name, mod_);
    f->addFnAttr(llvm::Attribute::NoUnwind);
    f->addFnAttr("target-cpu", target_.cpu);
    if (!target_.features.empty()) f->addFnAttr("target-features", target_.features);
    if (target_.vector_width > 8) {  // keep the 512-bit vectors the loops are written with
      f->addFnAttr("prefer-vector-width", std::to_string(32 * target_.vector_width));
      f->addFnAttr("min-legal-vector-width", std::to_string(32 * target_.vector_width));
    }
    return f;
  }

  llvm::LLVMContext& ctx_;
  llvm::Module& mod_;
  llvm::IRBuilder<> b_;
  const CpuTarget& target_;
  bool contract_;
  bool nearest_state_;  // CpuSpec::nearest_state
  bool in_update_ = false;
};

// The streams and scalars of `args` (a const sf_cpu_update_args*), loaded in the
// current block: what `p` uses of them for combination c.
Emitter::Streams Emitter::args_streams(const Program& p, const DtypeCombo& c, bool bf16_state, llvm::Value* args,
                                       llvm::Value* begin) {
  const auto load_at = [&](llvm::Type* t, unsigned offset, const char* name) {  // an 8-byte field
    llvm::Value* p8 = b_.CreateConstInBoundsGEP1_64(b_.getInt8Ty(), args, offset);
    return b_.CreateAlignedLoad(t, b_.CreatePointerCast(p8, t->getPointerTo()), llvm::Align(8), name);
  };
  const auto field = [&](unsigned offset, const char* name) { return load_at(i8p(), offset, name); };
  Streams s{};
  s.grad = field(kArgsGrad, "grad");
  s.weight = field(kArgsWeight, "weight");
  s.master = c.master || c.compensated ? field(kArgsMaster, "master") : nullptr;
  if (c.stochastic) s.sr_bits = field(kArgsSrBits, "sr_bits"), s.sr_begin = begin;
  llvm::Value* stride =
      c.stochastic && bf16_state && !nearest_state_ ? load_at(i64(), kArgsSrStride, "sr_stride") : nullptr;
  std::uint64_t place = 0;  // (runtime/cpu/fused_update-inl.h SrStatePlace)
  const StreamUse use = stream_use(p);
  for (int k = 0; k < p.num_streams; ++k) {
    if (p.streams[k].role != StreamRole::state) continue;
    s.state[k] = field(kArgsState + 8 * k, "state");
    s.state_dtype[k] = bf16_state && p.streams[k].values != StateValues::full_precision ? DType::bf16 : DType::f32;
    if (stride != nullptr && s.state_dtype[k] == DType::bf16 && use.stores[k])
      s.sr_state_offset[k] = b_.CreateMul(stride, b_.getInt64(++place));
  }
  if (p.num_scalars > 0) {
    llvm::Value* sc = b_.CreatePointerCast(field(kArgsScalars, "scalars"), f32()->getPointerTo());
    for (int k = 0; k < p.num_scalars; ++k)
      s.scalars[k] = b_.CreateAlignedLoad(f32(), b_.CreateConstInBoundsGEP1_64(f32(), sc, k), llvm::Align(4));
  }
  bool norms = false;
  for (int k = 0; k < p.num_instrs; ++k) norms |= p.code[k].op == Op::tensor_norm;
  if (norms) {
    llvm::Value* nm = b_.CreatePointerCast(field(kArgsNorms, "norms"), f32()->getPointerTo());
    for (int r = 0; r < kMaxNormSlots; ++r)
      s.norms[r] = b_.CreateAlignedLoad(f32(), b_.CreateConstInBoundsGEP1_64(f32(), nm, r), llvm::Align(4));
  }
  return s;
}

// void sf_cpu_update_<combo>(const sf_cpu_update_args* args, uint64_t begin, uint64_t n):
// a vector loop over whole vectors, then a scalar loop over the rest. Every
// element gets the same IEEE operations (and, stochastic combos, the same random
// word: its model element's) either way, so the split is invisible.
// `p`: a one-phase program, or the phase-2 part of a two-phase one.
void Emitter::update_function(const Program& p, const DtypeCombo& c, bool bf16_state) {
  in_update_ = true;
  const unsigned W = static_cast<unsigned>(target_.vector_width);
  llvm::Function* f = function(cpu_update_symbol(c, bf16_state), b_.getVoidTy(), {i8p(), i64(), i64()});
  llvm::Value* args = f->getArg(0);
  llvm::Value* begin = f->getArg(1);
  llvm::Value* n = f->getArg(2);
  args->setName("args"), begin->setName("begin"), n->setName("n");
  auto* entry = llvm::BasicBlock::Create(ctx_, "entry", f);
  auto* vhead = llvm::BasicBlock::Create(ctx_, "vector.head", f);
  auto* vbody = llvm::BasicBlock::Create(ctx_, "vector.body", f);
  auto* shead = llvm::BasicBlock::Create(ctx_, "scalar.head", f);
  auto* sbody = llvm::BasicBlock::Create(ctx_, "scalar.body", f);
  auto* done = llvm::BasicBlock::Create(ctx_, "done", f);

  b_.SetInsertPoint(entry);
  const Streams s = args_streams(p, c, bf16_state, args, begin);
  llvm::Value* end = b_.CreateAdd(begin, n, "end");
  llvm::Value* vend = b_.CreateAdd(begin, b_.CreateAnd(n, ~std::uint64_t{W - 1}), "vend");
  b_.CreateBr(vhead);

  // for (i = from; i < to; i += w) body(i): `head` tests, `loop` runs the body; exits to `exit`.
  const auto counted_loop = [&](llvm::BasicBlock* head, llvm::BasicBlock* loop, llvm::BasicBlock* exit,
                                llvm::BasicBlock* pred, llvm::Value* from, llvm::Value* to, unsigned w) {
    b_.SetInsertPoint(head);
    llvm::PHINode* i = b_.CreatePHI(i64(), 2, w == 1 ? "j" : "i");
    i->addIncoming(from, pred);
    b_.CreateCondBr(b_.CreateICmpULT(i, to), loop, exit);
    b_.SetInsertPoint(loop);
    body(p, c, s, i, w);
    i->addIncoming(b_.CreateAdd(i, b_.getInt64(w)), b_.GetInsertBlock());
    b_.CreateBr(head);
    return i;
  };
  llvm::PHINode* vi = counted_loop(vhead, vbody, shead, entry, begin, vend, W);
  counted_loop(shead, sbody, done, vhead, vi, end, 1);

  b_.SetInsertPoint(done);
  b_.CreateRetVoid();
  in_update_ = false;
}

// void sf_cpu_phase1_<combo>(const sf_cpu_update_args* args, uint64_t begin, uint64_t n, float* sums):
// phase 1 of a two-phase program (`p`: its phase-1 part) over one chunk. The
// values and stores per element as the update's; the reduced values' squares
// summed in the reduce pass's canonical order: element i (from begin) into lane
// i mod 32 of a 32-lane accumulator per slot, 32 elements a step (the body at width
// 32), the rest one by one into their lanes (skipping a lane adds what a zero pad
// adds: nothing); then the fixed tree. sums[r] for every slot (0 when not reduced).
void Emitter::phase1_function(const Program& p, const DtypeCombo& c, bool bf16_state) {
  in_update_ = true;
  llvm::Function* f =
      function(cpu_phase1_symbol(c, bf16_state), b_.getVoidTy(), {i8p(), i64(), i64(), f32()->getPointerTo()});
  llvm::Value* args = f->getArg(0);
  llvm::Value* begin = f->getArg(1);
  llvm::Value* n = f->getArg(2);
  llvm::Value* sums = f->getArg(3);
  args->setName("args"), begin->setName("begin"), n->setName("n"), sums->setName("sums");
  auto* entry = llvm::BasicBlock::Create(ctx_, "entry", f);
  auto* vhead = llvm::BasicBlock::Create(ctx_, "group.head", f);
  auto* vbody = llvm::BasicBlock::Create(ctx_, "group.body", f);
  auto* shead = llvm::BasicBlock::Create(ctx_, "scalar.head", f);
  auto* sbody = llvm::BasicBlock::Create(ctx_, "scalar.body", f);
  auto* done = llvm::BasicBlock::Create(ctx_, "done", f);
  const unsigned slots = reduced_slots(p);
  llvm::Type* acc_t = vec(f32(), kLanes);
  llvm::Constant* zero = fconst(0.0f, kLanes);

  b_.SetInsertPoint(entry);
  const Streams s = args_streams(p, c, bf16_state, args, begin);
  llvm::Value* end = b_.CreateAdd(begin, n, "end");
  llvm::Value* gend = b_.CreateAdd(begin, b_.CreateAnd(n, ~std::uint64_t{kLanes - 1}), "gend");
  b_.CreateBr(vhead);

  // acc + x * x per reduced slot (no contraction: the sum is part of the numerics).
  const auto loop = [&](llvm::BasicBlock* head, llvm::BasicBlock* body_block, llvm::BasicBlock* exit,
                        llvm::BasicBlock* pred, llvm::Value* from, llvm::Value* to, llvm::Value* const* acc_in,
                        unsigned w, llvm::PHINode** acc_out) {
    b_.SetInsertPoint(head);
    llvm::PHINode* i = b_.CreatePHI(i64(), 2, w == 1 ? "j" : "i");
    i->addIncoming(from, pred);
    for (int r = 0; r < kMaxNormSlots; ++r) {
      if (!(slots & (1u << r))) continue;
      acc_out[r] = b_.CreatePHI(acc_t, 2, "acc");
      acc_out[r]->addIncoming(acc_in[r], pred);
    }
    b_.CreateCondBr(b_.CreateICmpULT(i, to), body_block, exit);
    b_.SetInsertPoint(body_block);
    llvm::Value* reduced[kMaxNormSlots] = {};
    body(p, c, s, i, w, reduced);
    for (int r = 0; r < kMaxNormSlots; ++r) {
      if (!(slots & (1u << r))) continue;
      llvm::Value* x = reduced[r];
      llvm::Value* next;
      if (w == kLanes) {
        next = b_.CreateFAdd(acc_out[r], b_.CreateFMul(x, x));
      } else {
        llvm::Value* lane = b_.CreateTrunc(b_.CreateAnd(b_.CreateSub(i, begin), b_.getInt64(kLanes - 1)), i32());
        llvm::Value* old = b_.CreateExtractElement(acc_out[r], lane);
        next = b_.CreateInsertElement(acc_out[r], b_.CreateFAdd(old, b_.CreateFMul(x, x)), lane);
      }
      acc_out[r]->addIncoming(next, b_.GetInsertBlock());
    }
    i->addIncoming(b_.CreateAdd(i, b_.getInt64(w)), b_.GetInsertBlock());
    b_.CreateBr(head);
    return i;
  };
  llvm::Value* zeros[kMaxNormSlots] = {zero, zero, zero, zero};
  llvm::PHINode* gacc[kMaxNormSlots] = {};
  llvm::PHINode* gi = loop(vhead, vbody, shead, entry, begin, gend, zeros, kLanes, gacc);
  llvm::Value* from_groups[kMaxNormSlots] = {gacc[0], gacc[1], gacc[2], gacc[3]};
  llvm::PHINode* sacc[kMaxNormSlots] = {};
  loop(shead, sbody, done, vhead, gi, end, from_groups, 1, sacc);

  b_.SetInsertPoint(done);
  for (int r = 0; r < kMaxNormSlots; ++r) {
    llvm::Value* total = llvm::ConstantFP::get(f32(), 0.0);
    if (slots & (1u << r)) {
      // lanes[j] += lanes[j + width] for width = 16, 8, 4, 2, then lanes[0] + lanes[1] (as the reduce).
      llvm::Value* lanes = sacc[r];
      for (unsigned width = kLanes / 2; width >= 2; width /= 2) {
        llvm::SmallVector<int, 16> lo, hi;
        for (unsigned k = 0; k < width; ++k) lo.push_back(static_cast<int>(k)), hi.push_back(static_cast<int>(k + width));
        lanes = b_.CreateFAdd(b_.CreateShuffleVector(lanes, lo), b_.CreateShuffleVector(lanes, hi));
      }
      total = b_.CreateFAdd(b_.CreateExtractElement(lanes, std::uint64_t{0}), b_.CreateExtractElement(lanes, std::uint64_t{1}));
    }
    b_.CreateAlignedStore(total, b_.CreateConstInBoundsGEP1_64(f32(), sums, static_cast<std::uint64_t>(r)), llvm::Align(4));
  }
  b_.CreateRetVoid();
  in_update_ = false;
}

// The reduce of one chunk in the canonical order: element i into lane i mod 32,
// 32 elements a step, the last partial step zero-padded; then the fixed tree
// (L2) or the lanes in order (inf-norm), as runtime/cpu/reduce.cpp does.
void Emitter::reduce_function(DType g, bool inf_norm) {
  llvm::Function* f = inf_norm ? function(cpu_reduce_symbol(g, true), f32(), {i8p(), i64(), i32()->getPointerTo()})
                               : function(cpu_reduce_symbol(g, false), f32(), {i8p(), i64()});
  llvm::Value* grad = f->getArg(0);
  llvm::Value* n = f->getArg(1);
  grad->setName("grad"), n->setName("n");
  auto* entry = llvm::BasicBlock::Create(ctx_, "entry", f);
  auto* head = llvm::BasicBlock::Create(ctx_, "head", f);
  auto* loop = llvm::BasicBlock::Create(ctx_, "body", f);
  auto* tail_check = llvm::BasicBlock::Create(ctx_, "tail.check", f);
  auto* tail_head = llvm::BasicBlock::Create(ctx_, "tail.head", f);
  auto* tail_gather = llvm::BasicBlock::Create(ctx_, "tail.gather", f);
  auto* tail_add = llvm::BasicBlock::Create(ctx_, "tail.add", f);
  auto* finish = llvm::BasicBlock::Create(ctx_, "finish", f);

  llvm::Type* acc_t = vec(f32(), kLanes);
  llvm::Constant* zero = fconst(0.0f, kLanes);
  // acc: sums of squares (L2) or running max |g| (inf); poison: sum of g * 0, NaN on any inf/NaN (inf).
  const auto accumulate = [&](llvm::Value* x, llvm::Value* acc, llvm::Value* poison, llvm::Value** acc_out,
                              llvm::Value** poison_out) {
    if (!inf_norm) {
      *acc_out = b_.CreateFAdd(acc, b_.CreateFMul(x, x));
      *poison_out = poison;
      return;
    }
    llvm::Value* a = abs(x);
    *acc_out = select(b_.CreateFCmpOLT(acc, a), a, acc);  // NaNs ignored, as Highway's kernels and CUDA's sf_max
    *poison_out = b_.CreateFAdd(poison, b_.CreateFMul(x, zero));
  };

  b_.SetInsertPoint(entry);
  llvm::Value* full = b_.CreateAnd(n, ~std::uint64_t{kLanes - 1}, "full");
  b_.CreateBr(head);

  b_.SetInsertPoint(head);
  llvm::PHINode* i = b_.CreatePHI(i64(), 2, "i");
  llvm::PHINode* acc = b_.CreatePHI(acc_t, 2, "acc");
  llvm::PHINode* poison = b_.CreatePHI(acc_t, 2, "poison");
  i->addIncoming(b_.getInt64(0), entry), acc->addIncoming(zero, entry), poison->addIncoming(zero, entry);
  b_.CreateCondBr(b_.CreateICmpULT(i, full), loop, tail_check);
  b_.SetInsertPoint(loop);
  llvm::Value *acc_next, *poison_next;
  accumulate(load_as_f32(grad, g, i, kLanes), acc, poison, &acc_next, &poison_next);
  i->addIncoming(b_.CreateAdd(i, b_.getInt64(kLanes)), loop);
  acc->addIncoming(acc_next, loop), poison->addIncoming(poison_next, loop);
  b_.CreateBr(head);

  // The last (n mod 32) elements, gathered one by one into a zero vector (zeros add
  // nothing to either result). No library call (memcpy) in the generated code.
  b_.SetInsertPoint(tail_check);
  llvm::Type* raw_t = vec(storage(g), kLanes);
  b_.CreateCondBr(b_.CreateICmpULT(full, n), tail_head, finish);
  b_.SetInsertPoint(tail_head);
  llvm::PHINode* j = b_.CreatePHI(i64(), 2, "j");
  llvm::PHINode* raw = b_.CreatePHI(raw_t, 2, "raw");
  j->addIncoming(b_.getInt64(0), tail_check), raw->addIncoming(llvm::Constant::getNullValue(raw_t), tail_check);
  b_.CreateCondBr(b_.CreateICmpULT(b_.CreateAdd(full, j), n), tail_gather, tail_add);
  b_.SetInsertPoint(tail_gather);
  llvm::Value* one = load(grad, g, b_.CreateAdd(full, j), 1);
  raw->addIncoming(b_.CreateInsertElement(raw, one, j), tail_gather);
  j->addIncoming(b_.CreateAdd(j, b_.getInt64(1)), tail_gather);
  b_.CreateBr(tail_head);
  b_.SetInsertPoint(tail_add);
  llvm::Value* x = g == DType::f32 ? static_cast<llvm::Value*>(raw) : widen(g, b_.CreateZExt(raw, vec(i32(), kLanes)));
  llvm::Value *acc_tail, *poison_tail;
  accumulate(x, acc, poison, &acc_tail, &poison_tail);
  b_.CreateBr(finish);

  b_.SetInsertPoint(finish);
  llvm::PHINode* acc_end = b_.CreatePHI(acc_t, 2, "acc.end");
  llvm::PHINode* poison_end = b_.CreatePHI(acc_t, 2, "poison.end");
  acc_end->addIncoming(acc, tail_check), acc_end->addIncoming(acc_tail, tail_add);
  poison_end->addIncoming(poison, tail_check), poison_end->addIncoming(poison_tail, tail_add);
  if (!inf_norm) {
    // lanes[j] += lanes[j + width] for width = 16, 8, 4, 2, then lanes[0] + lanes[1].
    llvm::Value* lanes = acc_end;
    for (unsigned width = kLanes / 2; width >= 2; width /= 2) {
      llvm::SmallVector<int, 16> lo, hi;
      for (unsigned k = 0; k < width; ++k) lo.push_back(static_cast<int>(k)), hi.push_back(static_cast<int>(k + width));
      lanes = b_.CreateFAdd(b_.CreateShuffleVector(lanes, lo), b_.CreateShuffleVector(lanes, hi));
    }
    b_.CreateRet(b_.CreateFAdd(b_.CreateExtractElement(lanes, std::uint64_t{0}),
                               b_.CreateExtractElement(lanes, std::uint64_t{1})));
    return;
  }
  llvm::Value* m = llvm::ConstantFP::get(f32(), 0.0);
  for (unsigned lane = 0; lane < kLanes; ++lane) {
    llvm::Value* e = b_.CreateExtractElement(acc_end, std::uint64_t{lane});
    m = select(b_.CreateFCmpOGT(e, m), e, m);
  }
  llvm::Value* bad = b_.CreateOrReduce(b_.CreateFCmpUNE(poison_end, zero));
  b_.CreateAlignedStore(b_.CreateZExt(bad, i32()), f->getArg(2), llvm::Align(4));
  b_.CreateRet(m);
}

void check_spec(const CpuSpec& spec) {
  int where = -1;
  if (const char* problem = find_problem(spec.program, &where))
    throw Error(ErrorCode::invalid_argument, "LLVM emitter: invalid program (instruction " + std::to_string(where) +
                                                 "): " + problem);
  for (const DtypeCombo& c : spec.bf16_state)
    if (std::find(spec.combos.begin(), spec.combos.end(), c) == spec.combos.end())
      throw Error(ErrorCode::invalid_argument, "LLVM emitter: a bf16-state combo that is not among the spec's combos");
    else if (c.stochastic && !spec.nearest_state && is_two_phase(spec.program))
      throw Error(ErrorCode::invalid_argument,
                  "LLVM emitter: stochastically rounded bf16 state is for one-phase programs (a two-phase "
                  "program's state is staged, unless it rounds to nearest: nearest_state)");
  for (const DtypeCombo& c : spec.combos) {
    if (c.master && c.weight == DType::f32)
      throw Error(ErrorCode::invalid_argument, "LLVM emitter: f32 weights have no fp32 master copy");
    if (c.stochastic && (c.weight != DType::bf16 || c.master))
      throw Error(ErrorCode::invalid_argument,
                  "LLVM emitter: stochastic rounding is for bf16 weights without masters");
    if (c.compensated && (c.weight != DType::bf16 || c.master || c.stochastic))
      throw Error(ErrorCode::invalid_argument,
                  "LLVM emitter: compensated weights are bf16 weights without masters or stochastic rounding");
  }
}

std::unique_ptr<llvm::Module> build_module(llvm::LLVMContext& ctx, const CpuSpec& spec, const CpuTarget& target,
                                           const llvm::TargetMachine& tm) {
  check_spec(spec);
  auto m = std::make_unique<llvm::Module>("stepfuse_cpu_step", ctx);
  m->setTargetTriple(target.triple);
  m->setDataLayout(tm.createDataLayout());
  Emitter e(*m, target, spec.contract, spec.nearest_state);
  if (is_two_phase(spec.program)) {
    const Program phase1 = phase_program(spec.program, 0), phase2 = phase_program(spec.program, 1);
    for (const bool bf16_state : {false, true}) {
      for (const DtypeCombo& c : bf16_state ? spec.bf16_state : spec.combos) e.update_function(phase2, c, bf16_state);
      for (const DtypeCombo& c : bf16_state ? spec.bf16_state : spec.combos) e.phase1_function(phase1, c, bf16_state);
    }
  } else {
    for (const DtypeCombo& c : spec.combos) e.update_function(spec.program, c, false);
    for (const DtypeCombo& c : spec.bf16_state) e.update_function(spec.program, c, true);
  }
  for (DType g : spec.reduce_grads) e.reduce_function(g, spec.inf_norm);
  std::string problems;
  llvm::raw_string_ostream os(problems);
  if (llvm::verifyModule(*m, &os))
    throw std::logic_error("LLVM emitter: the generated module is invalid: " + os.str());
  return m;
}

void optimize(llvm::Module& m, llvm::TargetMachine& tm) {
  llvm::LoopAnalysisManager lam;
  llvm::FunctionAnalysisManager fam;
  llvm::CGSCCAnalysisManager cgam;
  llvm::ModuleAnalysisManager mam;
  llvm::PassBuilder pb(&tm);  // the target's cost model: vector widths, FMA, ...
  pb.registerModuleAnalyses(mam);
  pb.registerCGSCCAnalyses(cgam);
  pb.registerFunctionAnalyses(fam);
  pb.registerLoopAnalyses(lam);
  pb.crossRegisterProxies(lam, fam, cgam, mam);
  pb.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O3).run(m, mam);
}

std::string module_text(const llvm::Module& m) {
  std::string out;
  llvm::raw_string_ostream os(out);
  m.print(os, nullptr);
  return os.str();
}

std::string feature_string(const llvm::StringMap<bool>& features) {
  std::vector<std::string> list;
  for (const auto& f : features) {
    std::string item(1, f.getValue() ? '+' : '-');
    item.append(f.getKey().data(), f.getKey().size());
    list.push_back(std::move(item));
  }
  std::sort(list.begin(), list.end());  // a stable order: part of the cache key
  std::string out;
  for (const std::string& f : list) {
    if (!out.empty()) out.push_back(',');
    out.append(f);
  }
  return out;
}

}  // namespace

bool llvm_built() { return true; }
std::string llvm_version() { return LLVM_VERSION_STRING; }

CpuTarget CpuTarget::host() {
  static const CpuTarget host = [] {
    init_llvm();
    CpuTarget t;
    t.triple = llvm::sys::getProcessTriple();
    t.cpu = llvm::sys::getHostCPUName().str();
    llvm::StringMap<bool> features;
    if (llvm::sys::getHostCPUFeatures(features)) t.features = feature_string(features);
    t.vector_width = vector_width_of(*target_machine(t));
    return t;
  }();
  return host;
}

CpuTarget CpuTarget::named(const std::string& triple, const std::string& cpu, const std::string& features) {
  CpuTarget t;
  t.triple = triple.empty() ? llvm::sys::getProcessTriple() : triple;
  t.cpu = cpu;
  t.features = features;
  init_llvm();
  std::string err;
  const llvm::Target* target = llvm::TargetRegistry::lookupTarget(t.triple, err);
  if (target == nullptr) throw Error(ErrorCode::invalid_argument, "LLVM: no target for triple '" + t.triple + "' (" + err + ")");
  const std::unique_ptr<llvm::MCSubtargetInfo> sti(target->createMCSubtargetInfo(t.triple, "", ""));
  if (!sti || !sti->isCPUStringValid(cpu))
    throw Error(ErrorCode::invalid_argument, "LLVM: '" + cpu + "' is not a CPU LLVM knows for " + t.triple +
                                                 " (try 'x86-64-v3', 'skylake-avx512' or 'znver3')");
  t.vector_width = vector_width_of(*target_machine(t));
  return t;
}

std::string CpuTarget::describe() const {
  return triple + " " + cpu + " (" + std::to_string(vector_width) + " fp32 lanes)";
}

std::string cpu_canonical_text(const CpuSpec& spec) {
  std::ostringstream o;
  o << "stepfuse llvm emitter " << kEmitterVersion << "\nnorm " << (spec.inf_norm ? "inf" : "l2") << "\ncontract "
    << spec.contract << (spec.nearest_state ? "\nnearest state" : "") << "\ncombos";
  for (const DtypeCombo& c : spec.combos)
    o << " " << dtype_name(c.weight) << "/" << dtype_name(c.grad) << (c.master ? "/master" : "")
      << (c.stochastic ? "/stochastic" : "") << (c.compensated ? "/compensated" : "");
  o << "\nbf16 state";
  for (const DtypeCombo& c : spec.bf16_state) o << " " << cpu_update_symbol(c);
  o << "\nreduce";
  for (DType g : spec.reduce_grads) o << " " << dtype_name(g);
  o << "\nstreams";
  for (int s = 0; s < spec.program.num_streams; ++s)
    o << " " << static_cast<int>(spec.program.streams[s].role) << "/" << static_cast<int>(spec.program.streams[s].values);
  o << "\nscalars " << static_cast<int>(spec.program.num_scalars) << "\ncode\n";
  for (int k = 0; k < spec.program.num_instrs; ++k) {
    const Instr& in = spec.program.code[k];
    o << op_name(in.op) << " " << static_cast<int>(in.attr) << " " << in.a << " " << in.b << " " << in.c << " "
      << std::hexfloat << in.imm << std::defaultfloat << "\n";
  }
  return o.str();
}

std::string cpu_cache_key(const CpuSpec& spec, const CpuTarget& target) {
  return "stepfuse cpu object for the jit (large code model, static relocations)\nllvm " + llvm_version() +
         "\ntarget " + target.triple + "\ncpu " + target.cpu +
         "\nfeatures " + target.features + "\nlanes " + std::to_string(target.vector_width) + "\n" +
         cpu_canonical_text(spec);
}

namespace {
std::string combo_suffix(const DtypeCombo& c, bool bf16_state) {
  return std::string(dtype_name(c.weight)) + "_" + std::string(dtype_name(c.grad)) + (c.master ? "_m" : "") +
         (c.stochastic ? "_sr" : "") + (c.compensated ? "_kc" : "") + (bf16_state ? "_bs" : "");
}
}  // namespace

std::string cpu_update_symbol(const DtypeCombo& c, bool bf16_state) { return "sf_cpu_update_" + combo_suffix(c, bf16_state); }
std::string cpu_phase1_symbol(const DtypeCombo& c, bool bf16_state) { return "sf_cpu_phase1_" + combo_suffix(c, bf16_state); }

std::string cpu_reduce_symbol(DType grad, bool inf_norm) {
  return std::string(inf_norm ? "sf_cpu_reduce_inf_" : "sf_cpu_reduce_l2_") + std::string(dtype_name(grad));
}

std::string cpu_module_ir(const CpuSpec& spec, const CpuTarget& target, bool optimized) {
  const auto tm = target_machine(target);
  llvm::LLVMContext ctx;
  const auto m = build_module(ctx, spec, target, *tm);
  if (optimized) optimize(*m, *tm);
  return module_text(*m);
}

std::string cpu_compile_object(const CpuSpec& spec, const CpuTarget& target, CpuObjectKind kind) {
  const auto tm = target_machine(target, kind == CpuObjectKind::jit);
  llvm::LLVMContext ctx;
  const auto m = build_module(ctx, spec, target, *tm);
  optimize(*m, *tm);
  llvm::SmallVector<char, 0> object;
  llvm::raw_svector_ostream os(object);
  llvm::legacy::PassManager pm;
  if (tm->addPassesToEmitFile(pm, os, nullptr, llvm::CGFT_ObjectFile))
    llvm_failed("the target " + target.describe() + " cannot emit object files");
  pm.run(*m);
  return std::string(object.begin(), object.end());
}

}  // namespace stepfuse::jit
