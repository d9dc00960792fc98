// The generated CUDA code, checked where CI runs (no GPU needed):
//  - NVRTC compiles every built-in program's kernels (the update and reduce sources
//    that cuda_step_images() compiles), in every layout class, to CUBIN (sm_80, sm_90)
//    and PTX (compute_90), with the kernels exported and no contracted multiply-add;
//    the utility module likewise; compile times are printed;
//  - the canonical texts (the cache keys' core) tell every spec apart and cover what
//    the sources depend on; the emitter is deterministic and self-contained; a compile
//    error reports cleanly;
//  - the element functions, compiled here as host C++ (emitted at build time by
//    tests/tools/emit_elements.cpp), wrapped in the loads and stores sf_update does,
//    are bitwise the CPU backend's fused kernels and within the tolerances (docs/architecture.md §8)
//    of the float64 reference;
//  - the scalar rules evaluate to PyTorch's formulas (std::pow bias corrections)
//    within one fp32 ulp.
// Without NVRTC the compile tests skip; the host-side tests always run.
#include <elf.h>
#include <time.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "jit/builtin/adam.hpp"
#include "jit/builtin/registry.hpp"
#include "jit/builtins.hpp"
#include "jit/cuda/emit_cuda.hpp"
#include "jit/cuda/nvrtc_compile.hpp"
#include "jit/program_analysis.hpp"
#include "reference/dtypes.hpp"
#include "reference/elf_reader.hpp"
#include "reference/harness.hpp"
#include "reference/reference.hpp"
#include "reference/test_util.hpp"
#include "runtime/cpu/kernels.hpp"
#include "stepfuse/cuda.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/program.hpp"

// The element functions of every built-in program (sf_gen_<program>::sf_body),
// the device prelude they use (sf_load_*, sf_store_*), and the table sf_gen::kPrograms.
#include "cuda_element_functions.inc"

namespace stepfuse {
namespace {

using jit::Builtin;
using jit::DtypeCombo;
using jit::CudaNorm;
using jit::CudaOutput;
using jit::CudaSpec;
using jit::CudaTarget;
using jit::StreamUse;
using jit::stream_use;

#define REQUIRE_NVRTC()                                                                      \
  do {                                                                                       \
    const CudaStatus nvrtc_status_ = nvrtc_available();                                      \
    if (!nvrtc_status_.available) GTEST_SKIP() << "NVRTC not available: " << nvrtc_status_.reason; \
  } while (0)

// ---------------------------------------------------------------------------
// Specs

// Every valid dtype combination, weight-major (15): masters only for f16/bf16 weights.
std::vector<DtypeCombo> all_combos() {
  std::vector<DtypeCombo> out;
  for (DType w : {DType::f32, DType::f16, DType::bf16})
    for (DType g : {DType::f32, DType::f16, DType::bf16})
      for (bool m : {false, true})
        if (w != DType::f32 || !m) out.push_back({w, g, m});
  return out;
}

std::string combo_name(const DtypeCombo& c) {
  return std::string(dtype_name(c.weight)) + "/" + std::string(dtype_name(c.grad)) + (c.master ? "/master" : "");
}

const Program& program_of(int b) { return jit::builtin_program(static_cast<Builtin>(b)); }

bool has_op(const Program& p, Op op) {
  for (int i = 0; i < p.num_instrs; ++i)
    if (p.code[i].op == op) return true;
  return false;
}

// The layout classes the emitter distinguishes.
enum class Layout { table, flat, unaligned, inf_norm };
constexpr Layout kLayouts[] = {Layout::table, Layout::flat, Layout::unaligned, Layout::inf_norm};

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::table: return "table/aligned16/all-15-combos";
    case Layout::flat: return "flat/bf16-bf16-master";
    case Layout::unaligned: return "table/unaligned";
    case Layout::inf_norm: return "table/inf-norm";
  }
  return "?";
}

CudaSpec make_spec(int b, Layout l) {
  CudaSpec s;
  s.program = program_of(b);
  switch (l) {
    case Layout::table:
      s.combos = all_combos();
      s.aligned16 = true;
      break;
    case Layout::flat:
      s.combos = {{DType::bf16, DType::bf16, true}};
      s.flat = !jit::is_two_phase(s.program);  // two phases need the table (one combination here)
      s.aligned16 = true;
      break;
    case Layout::unaligned:
      s.combos = {{DType::f32, DType::f32, false}, {DType::bf16, DType::bf16, true}, {DType::f16, DType::f32, true}};
      s.aligned16 = false;
      break;
    case Layout::inf_norm:
      s.combos = {{DType::f32, DType::f32, false}, {DType::f16, DType::f16, true}, {DType::bf16, DType::f16, false}};
      s.norm = CudaNorm::inf;
      s.aligned16 = true;
      break;
  }
  return s;
}

// ---------------------------------------------------------------------------
// NVRTC compile jobs, run on two threads (NVRTC is thread-safe)

struct CompileJob {
  std::string label;
  std::string source;
  std::string name;  // NVRTC program name
  CudaTarget target;
  std::vector<std::string> entries;  // kernels the image must export
  bool may_fuse_f32 = false;         // the program has an fma op
  // Results.
  std::string image;
  std::string error;
  double ms = 0;      // wall time
  double cpu_ms = 0;  // this thread's CPU time (meaningful on a loaded machine)
};

double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

CompileJob make_job(std::string label, std::string source, std::string name, CudaTarget target,
                    std::vector<std::string> entries, bool may_fuse_f32) {
  CompileJob j;
  j.label = std::move(label);
  j.source = std::move(source);
  j.name = std::move(name);
  j.target = target;
  j.entries = std::move(entries);
  j.may_fuse_f32 = may_fuse_f32;
  return j;
}

void compile_all(std::vector<CompileJob>& jobs, int threads = 2) {
  std::atomic<std::size_t> next{0};
  auto worker = [&] {
    for (std::size_t i = next++; i < jobs.size(); i = next++) {
      CompileJob& j = jobs[i];
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = thread_cpu_ms();
      try {
        j.image = jit::nvrtc_compile(j.source, j.name, j.target);
      } catch (const std::exception& e) {
        j.error = e.what();
      }
      j.cpu_ms = thread_cpu_ms() - c0;
      j.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
  };
  std::vector<std::future<void>> running;
  for (int t = 0; t < threads; ++t) running.push_back(std::async(std::launch::async, worker));
  for (auto& f : running) f.get();
}

void print_times(const std::vector<CompileJob>& jobs, const char* what, double wall_ms) {
  double total = 0, total_cpu = 0;
  std::printf("NVRTC compile times, %s (2 threads; wall / CPU):\n", what);
  for (const CompileJob& j : jobs) {
    std::printf("  %8.1f / %8.1f ms  %s (%zu bytes)\n", j.ms, j.cpu_ms, j.label.c_str(), j.image.size());
    total += j.ms;
    total_cpu += j.cpu_ms;
  }
  const double n = jobs.empty() ? 1.0 : static_cast<double>(jobs.size());
  std::printf("  %zu compiles in %.1f ms wall; per compile %.1f ms wall, %.1f ms CPU on average\n", jobs.size(), wall_ms,
              total / n, total_cpu / n);
}

// The compile log part of an nvrtc_compile error (without the numbered source).
std::string log_part(const std::string& error) {
  const std::size_t at = error.find("--- source ---");
  return at == std::string::npos ? error.substr(0, 4000) : error.substr(0, std::min<std::size_t>(at, 4000));
}

void check_image(const CompileJob& j) {
  SCOPED_TRACE(j.label);
  if (!j.error.empty()) {
    ADD_FAILURE() << j.label << " does not compile:\n" << log_part(j.error);
    return;
  }
  if (j.target.output == CudaOutput::cubin) {
    const ref::ElfImage elf = ref::read_elf(j.image);
    ASSERT_TRUE(elf.problem.empty()) << j.label << ": " << elf.problem << " (" << j.image.size() << " bytes)";
    EXPECT_EQ(elf.machine, EM_CUDA);
    const std::vector<std::string> functions = elf.global_functions();
    for (const std::string& e : j.entries) {
      EXPECT_NE(std::find(functions.begin(), functions.end(), e), functions.end())
          << j.label << ": kernel " << e << " is not a global function of the CUBIN";
      EXPECT_NE(j.image.find(e), std::string::npos) << e;
    }
  } else {
    const std::string& ptx = j.image;
    EXPECT_FALSE(ptx.rfind("\x7f" "ELF", 0) == 0) << j.label << ": PTX expected";
    EXPECT_NE(ptx.find(".target sm_" + std::to_string(j.target.sm)), std::string::npos) << j.label;
    for (const std::string& e : j.entries)
      EXPECT_NE(ptx.find(".entry " + e + "("), std::string::npos) << j.label << ": no .entry " << e;
    // --fmad=false end to end: no multiply-add unless the program asks for one.
    if (!j.may_fuse_f32) {
      const std::size_t at = ptx.find("fma.rn.f32");
      EXPECT_EQ(at, std::string::npos) << j.label << ": contracted multiply-add in the PTX: "
                                       << ptx.substr(at == std::string::npos ? 0 : (at > 200 ? at - 200 : 0), 400);
    }
  }
}

// ---------------------------------------------------------------------------
// 1a. Every built-in program compiles, in every layout class, for every target kind

// What the runtime compiles for a spec (jit::cuda_step_images): the update kernel and
// the reduce kernel as two sources; the reduce source depends only on the grad dtypes,
// the norm and the number of scalars, so many specs share it.
//
// A CUBIN of a 15-combination update kernel costs several seconds of CPU here (~0.5 s
// per combination, mostly ptxas), so by default each program's table is compiled for
// one CUBIN arch (alternating: both archs see tables) and each other layout class for
// one target kind (alternating: every program and every class sees both kinds, and
// both CUBIN archs). STEPFUSE_CODEGEN_FULL_MATRIX=1 compiles every table for sm_80 and
// sm_90 and every other class as PTX and as CUBIN (several minutes of CPU).
bool full_matrix() {
  const char* e = std::getenv("STEPFUSE_CODEGEN_FULL_MATRIX");
  return e != nullptr && *e != '\0' && std::strcmp(e, "0") != 0;
}

std::vector<CudaTarget> targets_for(int b, Layout l, bool full) {
  const int c = static_cast<int>(l);
  if (l == Layout::table) {
    if (full) return {{80, CudaOutput::cubin}, {90, CudaOutput::cubin}};
    return {{b % 2 ? 80 : 90, CudaOutput::cubin}};
  }
  const CudaTarget cubin{((b + c) / 2) % 2 ? 80 : 90, CudaOutput::cubin}, ptx{90, CudaOutput::ptx};
  if (full) return {cubin, ptx};
  return {(b + c) % 2 ? ptx : cubin};
}

const char* kind_name(CudaOutput k) { return k == CudaOutput::ptx ? "PTX" : "CUBIN"; }

TEST(CudaCodegenCompile, EveryBuiltinInEveryLayoutForCubinAndPtx) {
  REQUIRE_NVRTC();
  const bool full = full_matrix();
  std::vector<CompileJob> updates, reduces;
  // One reduce kernel per layout class and arch: within a class the reduce sources
  // differ only in the number of scalars (a loop bound), and a table's costs ~4 s.
  std::set<std::pair<int, std::string>> reduce_seen;  // (layout, arch)
  // (program, layout, kind) of the update kernels compiled, to check the plan's coverage.
  std::set<std::tuple<int, int, CudaOutput>> covered;
  std::set<int> table_sms;
  for (int b = 0; b < jit::kNumBuiltins; ++b) {
    const Program& prog = program_of(b);
    for (Layout l : kLayouts) {
      const CudaSpec spec = make_spec(b, l);
      const std::string update = jit::emit_cuda_update(spec), reduce = jit::emit_cuda_reduce(spec);
      for (const CudaTarget& t : targets_for(b, l, full)) {
        covered.insert({b, static_cast<int>(l), t.output});
        if (l == Layout::table) table_sms.insert(t.sm);
        const std::string what = std::string(prog.name) + " " + layout_name(l) + " ";
        updates.push_back(make_job(what + "update " + jit::arch_name(t), update, std::string(prog.name) + "_update.cu",
                                   t, jit::cuda_update_kernel_names(prog), has_op(prog, Op::fma)));
        if (reduce_seen.insert({static_cast<int>(l), jit::arch_name(t)}).second)
          reduces.push_back(make_job(what + "reduce " + jit::arch_name(t), reduce, "stepfuse_reduce.cu", t,
                                     {"sf_reduce"}, false));
      }
    }
  }
  // The table's update kernel once as PTX too, for the program with the most streams;
  // and both kernels in one source (emit_cuda) once.
  const int biggest = static_cast<int>(jit::builtin_named("rmsprop_centered_momentum"));
  covered.insert({biggest, static_cast<int>(Layout::table), CudaOutput::ptx});
  updates.push_back(make_job(std::string(program_of(biggest).name) + " " + layout_name(Layout::table) +
                                 " update compute_90",
                             jit::emit_cuda_update(make_spec(biggest, Layout::table)), "big_update.cu",
                             {90, CudaOutput::ptx}, {"sf_update"}, has_op(program_of(biggest), Op::fma)));
  const int adam = static_cast<int>(jit::builtin_named("adam"));
  updates.push_back(make_job("adam unaligned step kernels (emit_cuda) sm_90", jit::emit_cuda(make_spec(adam, Layout::unaligned)),
                             "adam_step.cu", {90, CudaOutput::cubin}, {"sf_reduce", "sf_update"}, false));
  // Stochastic rounding of bf16 weights (jit/stochastic_round.h in the device code): the
  // unaligned table (one-element stores) as CUBIN, the aligned flat range (4-element
  // stores) as PTX.
  {
    CudaSpec table = make_spec(adam, Layout::unaligned), flat = make_spec(adam, Layout::flat);
    table.combos[1] = {DType::bf16, DType::bf16, false, true};
    flat.combos[0] = {DType::bf16, DType::bf16, false, true};
    updates.push_back(make_job("adam unaligned stochastic update sm_90", jit::emit_cuda_update(table),
                               "adam_stochastic_update.cu", {90, CudaOutput::cubin}, {"sf_update"}, false));
    updates.push_back(make_job("adam flat stochastic update compute_90", jit::emit_cuda_update(flat),
                               "adam_flat_stochastic_update.cu", {90, CudaOutput::ptx}, {"sf_update"}, false));
  }
  // Compensated bf16 weights (the bf16 compensation in the master slot): the unaligned
  // table as CUBIN, the aligned flat range (4-element loads and stores) as PTX, and
  // LAMB's phase 1, which reads the parameter.
  {
    const DtypeCombo comp{DType::bf16, DType::bf16, false, false, true};
    CudaSpec table = make_spec(adam, Layout::unaligned), flat = make_spec(adam, Layout::flat);
    table.combos[1] = comp;
    flat.combos[0] = comp;
    updates.push_back(make_job("adam unaligned compensated update sm_90", jit::emit_cuda_update(table),
                               "adam_compensated_update.cu", {90, CudaOutput::cubin}, {"sf_update"}, false));
    updates.push_back(make_job("adam flat compensated update compute_90", jit::emit_cuda_update(flat),
                               "adam_flat_compensated_update.cu", {90, CudaOutput::ptx}, {"sf_update"}, false));
    const int lamb = static_cast<int>(jit::builtin_named("lamb"));
    CudaSpec two_phase = make_spec(lamb, Layout::unaligned);
    two_phase.combos[1] = comp;
    updates.push_back(make_job("lamb unaligned compensated update sm_90", jit::emit_cuda_update(two_phase),
                               "lamb_compensated_update.cu", {90, CudaOutput::cubin}, {"sf_update"}, false));
  }
  // State stored as bf16 or q8 (per-combination formats, sf_tensor.state): Adam's table
  // aligned as CUBIN (three combinations: f32 state, q8 with bf16 weights rounded
  // stochastically, q8 + bf16) and unaligned as PTX, and LAMB's two phases with bf16 state.
  {
    const auto formats = [](const Program& p, StateFormat first, StateFormat second) {
      std::array<StateFormat, kMaxStreams> f;
      f.fill(StateFormat::f32);
      int k = 0;
      for (int s = 0; s < p.num_streams; ++s)
        if (p.streams[s].role == StreamRole::state) f[static_cast<std::size_t>(s)] = k++ == 0 ? first : second;
      return f;
    };
    const Program& adam_program = program_of(adam);
    for (const Layout l : {Layout::table, Layout::unaligned}) {
      CudaSpec packed = make_spec(adam, l);
      packed.combos.resize(3);  // (each q8 combination compiles in ~1 s)
      packed.combos[1] = {DType::bf16, DType::bf16, false, true};
      packed.combo_formats.assign(packed.combos.size(), formats(adam_program, StateFormat::q8, StateFormat::q8));
      packed.combo_formats[0] = formats(adam_program, StateFormat::f32, StateFormat::f32);
      packed.combo_formats.back() = formats(adam_program, StateFormat::q8, StateFormat::bf16);
      const CudaTarget t = l == Layout::table ? CudaTarget{90, CudaOutput::cubin} : CudaTarget{90, CudaOutput::ptx};
      updates.push_back(make_job(std::string("adam ") + layout_name(l) + " q8 state update " + jit::arch_name(t),
                                 jit::emit_cuda_update(packed), "adam_q8_update.cu", t, {"sf_update"}, false));
    }
    const int lamb = static_cast<int>(jit::builtin_named("lamb"));
    CudaSpec two_phase = make_spec(lamb, Layout::unaligned);
    two_phase.combo_formats.assign(two_phase.combos.size(), formats(program_of(lamb), StateFormat::bf16, StateFormat::bf16));
    updates.push_back(make_job("lamb unaligned bf16 state update sm_90", jit::emit_cuda_update(two_phase),
                               "lamb_bf16_state_update.cu", {90, CudaOutput::cubin}, jit::cuda_update_kernel_names(program_of(lamb)),
                               false));
    // bf16 state rounded stochastically beside stochastically rounded bf16 weights (both
    // phases' stores, and Adam's 4-element ones).
    CudaSpec lamb_sr = make_spec(lamb, Layout::unaligned);
    lamb_sr.combos.resize(2);
    lamb_sr.combos[1] = {DType::bf16, DType::bf16, false, true};
    lamb_sr.combo_formats.assign(lamb_sr.combos.size(), formats(program_of(lamb), StateFormat::bf16, StateFormat::bf16));
    updates.push_back(make_job("lamb unaligned stochastic bf16 state update sm_90", jit::emit_cuda_update(lamb_sr),
                               "lamb_sr_bf16_state_update.cu", {90, CudaOutput::cubin},
                               jit::cuda_update_kernel_names(program_of(lamb)), false));
    CudaSpec adam_sr = make_spec(adam, Layout::table);
    adam_sr.combos.resize(2);
    adam_sr.combos[1] = {DType::bf16, DType::bf16, false, true};
    adam_sr.combo_formats.assign(adam_sr.combos.size(), formats(adam_program, StateFormat::bf16, StateFormat::bf16));
    updates.push_back(make_job("adam table stochastic bf16 state update sm_90", jit::emit_cuda_update(adam_sr),
                               "adam_sr_bf16_state_update.cu", {90, CudaOutput::cubin}, {"sf_update"}, false));
    // q8 state in both phases (phase 1's strided blocks), beside an f32-state combination.
    two_phase.combo_formats.assign(two_phase.combos.size(), formats(program_of(lamb), StateFormat::q8, StateFormat::q8));
    two_phase.combo_formats[0] = formats(program_of(lamb), StateFormat::f32, StateFormat::f32);
    updates.push_back(make_job("lamb unaligned q8 state update sm_90", jit::emit_cuda_update(two_phase),
                               "lamb_q8_state_update.cu", {90, CudaOutput::cubin}, jit::cuda_update_kernel_names(program_of(lamb)),
                               false));
  }
  // The sharded step's reduce module (sf_reduce_shard, sf_shard_finalize beside sf_reduce),
  // L2 as CUBIN and the inf-norm as PTX.
  for (const Layout l : {Layout::unaligned, Layout::inf_norm}) {
    CudaSpec sharded = make_spec(adam, l);
    sharded.sharded = true;
    const CudaTarget t = l == Layout::inf_norm ? CudaTarget{90, CudaOutput::ptx} : CudaTarget{90, CudaOutput::cubin};
    reduces.push_back(make_job(std::string("adam ") + layout_name(l) + " sharded reduce " + jit::arch_name(t),
                               jit::emit_cuda_reduce(sharded), "stepfuse_reduce_shard.cu", t,
                               {"sf_reduce", "sf_reduce_shard", "sf_shard_finalize"}, false));
  }

  // The plan covers every program's table as CUBIN, both archs with tables, and both
  // target kinds for every program and every layout class.
  for (int b = 0; b < jit::kNumBuiltins; ++b) {
    EXPECT_TRUE(covered.count({b, static_cast<int>(Layout::table), CudaOutput::cubin})) << program_of(b).name;
    for (CudaOutput kind : {CudaOutput::cubin, CudaOutput::ptx}) {
      bool has = false;
      for (Layout l : kLayouts) has |= covered.count({b, static_cast<int>(l), kind}) > 0;
      EXPECT_TRUE(has) << program_of(b).name << " is never compiled to " << kind_name(kind);
    }
  }
  EXPECT_EQ(table_sms, (std::set<int>{80, 90}));
  for (Layout l : kLayouts)
    for (CudaOutput kind : {CudaOutput::cubin, CudaOutput::ptx}) {
      bool has = false;
      for (int b = 0; b < jit::kNumBuiltins; ++b) has |= covered.count({b, static_cast<int>(l), kind}) > 0;
      EXPECT_TRUE(has) << layout_name(l) << " is never compiled to " << kind_name(kind);
    }

  // The big table CUBINs first, so that the two threads finish together.
  std::vector<CompileJob> jobs = std::move(updates);
  for (CompileJob& j : reduces) jobs.push_back(std::move(j));
  std::stable_partition(jobs.begin(), jobs.end(), [](const CompileJob& j) {
    return j.label.find("all-15-combos") != std::string::npos && j.target.output == CudaOutput::cubin;
  });
  const auto t0 = std::chrono::steady_clock::now();
  compile_all(jobs);
  print_times(jobs, full ? "step kernels, full matrix" : "step kernels (STEPFUSE_CODEGEN_FULL_MATRIX=1 for all)",
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  for (const CompileJob& j : jobs) check_image(j);

  // CUBINs of one source for two archs are different images.
  for (std::size_t i = 0; i < jobs.size(); ++i)
    for (std::size_t k = i + 1; k < jobs.size(); ++k)
      if (jobs[i].source == jobs[k].source && jobs[i].target.output == CudaOutput::cubin &&
          jobs[k].target.output == CudaOutput::cubin && jobs[i].target.sm != jobs[k].target.sm &&
          jobs[i].error.empty() && jobs[k].error.empty()) {
        EXPECT_NE(jobs[i].image, jobs[k].image) << jobs[i].label << " vs " << jobs[k].label;
      }
}

TEST(CudaCodegenCompile, UtilityModuleForSm80Sm90AndPtx) {
  REQUIRE_NVRTC();
  const std::string source = jit::emit_cuda_utilities();
  const std::vector<std::string> kernels = {"sf_update_scale", "sf_scale_f32", "sf_scale_f16", "sf_scale_bf16",
                                            "sf_widen_f32",    "sf_widen_f16", "sf_widen_bf16", "sf_fill"};
  std::vector<CompileJob> jobs;
  for (const CudaTarget& t : {CudaTarget{80, CudaOutput::cubin}, CudaTarget{90, CudaOutput::cubin},
                              CudaTarget{90, CudaOutput::ptx}})
    jobs.push_back(make_job("utilities " + jit::arch_name(t), source, "stepfuse_utilities.cu", t, kernels, false));
  const auto t0 = std::chrono::steady_clock::now();
  compile_all(jobs);
  print_times(jobs, "utility module", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  for (const CompileJob& j : jobs) check_image(j);
  EXPECT_NE(jobs[0].image, jobs[1].image) << "sm_80 and sm_90 gave the same CUBIN";
}

// The cold compile time of one typical spec (NVRTC has no cache: every call compiles):
// each kernel alone, and both side by side as cuda_step_images() compiles them.
TEST(CudaCodegenCompile, TypicalSpecColdCompileTime) {
  REQUIRE_NVRTC();
  CudaSpec spec;
  spec.program = jit::builtin_program(jit::select_builtin(optim::AdamW{}));
  spec.combos = {{DType::bf16, DType::bf16, true}};
  spec.aligned16 = true;
  const std::string update = jit::emit_cuda_update(spec), reduce = jit::emit_cuda_reduce(spec);
  const CudaTarget sm90{90, CudaOutput::cubin};
  constexpr int kRuns = 3;
  auto timed = [&](const std::string& source, const char* name, double* cpu_ms) {
    const double c0 = thread_cpu_ms();
    const std::string cubin = jit::nvrtc_compile(source, name, sm90);
    *cpu_ms += thread_cpu_ms() - c0;
    EXPECT_TRUE(ref::read_elf(cubin).problem.empty());
  };
  auto wall_since = [](std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  double update_wall = 0, update_cpu = 0, reduce_wall = 0, reduce_cpu = 0, both_wall = 0, scratch = 0;
  for (int r = 0; r < kRuns; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    timed(update, "adamw_update.cu", &update_cpu);
    update_wall += wall_since(t0);
    t0 = std::chrono::steady_clock::now();
    timed(reduce, "stepfuse_reduce.cu", &reduce_cpu);
    reduce_wall += wall_since(t0);
    t0 = std::chrono::steady_clock::now();
    auto other = std::async(std::launch::async, [&] { timed(reduce, "stepfuse_reduce.cu", &scratch); });
    timed(update, "adamw_update.cu", &scratch);
    other.get();
    both_wall += wall_since(t0);
  }
  std::printf("AdamW, 1 combo bf16/bf16/master, aligned16, sm_90 CUBIN, mean of %d cold compiles: update kernel "
              "%.1f ms wall / %.1f ms CPU (%zu lines); reduce kernel %.1f / %.1f ms (%zu lines); both side by side "
              "(as cuda_step_images) %.1f ms wall\n",
              kRuns, update_wall / kRuns, update_cpu / kRuns,
              static_cast<std::size_t>(std::count(update.begin(), update.end(), '\n')), reduce_wall / kRuns,
              reduce_cpu / kRuns, static_cast<std::size_t>(std::count(reduce.begin(), reduce.end(), '\n')),
              both_wall / kRuns);
  RecordProperty("adamw_bf16_master_sm90_step_ms", std::to_string(both_wall / kRuns));
}

// ---------------------------------------------------------------------------
// 1b. Canonical texts and the emitter's output

TEST(CudaCodegenSpec, CanonicalTextTellsEverySpecApart) {
  CudaSpec base;
  base.program = jit::builtin_program(jit::builtin_named("adam"));
  base.combos = {{DType::f32, DType::f32, false}, {DType::bf16, DType::bf16, true}};

  std::vector<std::pair<std::string, CudaSpec>> specs = {{"base", base}};
  auto variant = [&](const std::string& what, auto&& change) {
    CudaSpec s = base;
    change(s);
    specs.emplace_back(what, std::move(s));
  };
  for (int b = 0; b < jit::kNumBuiltins; ++b)
    if (static_cast<Builtin>(b) != jit::builtin_named("adam"))
      variant(std::string("program ") + std::string(program_of(b).name), [&](CudaSpec& s) { s.program = program_of(b); });
  variant("sharded", [](CudaSpec& s) { s.sharded = true; });
  variant("combo weight", [](CudaSpec& s) { s.combos[1].weight = DType::f16; });
  variant("combo grad", [](CudaSpec& s) { s.combos[1].grad = DType::f32; });
  variant("combo master", [](CudaSpec& s) { s.combos[1].master = false; });
  variant("combo stochastic", [](CudaSpec& s) { s.combos[1].master = false, s.combos[1].stochastic = true; });
  variant("combo compensated", [](CudaSpec& s) { s.combos[1].master = false, s.combos[1].compensated = true; });
  variant("combo order", [](CudaSpec& s) { std::swap(s.combos[0], s.combos[1]); });
  variant("one combo more", [](CudaSpec& s) { s.combos.push_back({DType::f16, DType::f16, true}); });
  variant("one combo less", [](CudaSpec& s) { s.combos.pop_back(); });
  variant("no combos", [](CudaSpec& s) { s.combos.clear(); });
  variant("norm inf", [](CudaSpec& s) { s.norm = CudaNorm::inf; });
  // Compressed state: Adam's exp_avg (stream 2) and exp_avg_sq (3), per combination.
  const auto state = [](StateFormat first, StateFormat second) {
    std::array<StateFormat, kMaxStreams> f;
    f.fill(StateFormat::f32);
    f[2] = first, f[3] = second;
    return f;
  };
  variant("state bf16", [&](CudaSpec& s) { s.combo_formats.assign(2, state(StateFormat::bf16, StateFormat::bf16)); });
  variant("state q8", [&](CudaSpec& s) { s.combo_formats.assign(2, state(StateFormat::q8, StateFormat::q8)); });
  variant("state q8 + bf16", [&](CudaSpec& s) { s.combo_formats.assign(2, state(StateFormat::q8, StateFormat::bf16)); });
  variant("state q8 in one combo", [&](CudaSpec& s) {
    s.combo_formats = {state(StateFormat::f32, StateFormat::f32), state(StateFormat::q8, StateFormat::q8)};
  });
  variant("flat", [](CudaSpec& s) { s.flat = true; });
  variant("aligned16", [](CudaSpec& s) { s.aligned16 = true; });
  variant("flat + aligned16", [](CudaSpec& s) { s.flat = s.aligned16 = true; });
  // Programs that differ from Adam in one detail each.
  variant("an op", [](CudaSpec& s) {
    for (int i = 0; i < s.program.num_instrs; ++i)
      if (s.program.code[i].op == Op::sub) {
        s.program.code[i].op = Op::add;
        break;
      }
  });
  variant("an operand", [](CudaSpec& s) {
    for (int i = 0; i < s.program.num_instrs; ++i)
      if (s.program.code[i].op == Op::mul && s.program.code[i].a != s.program.code[i].b) {
        std::swap(s.program.code[i].a, s.program.code[i].b);
        break;
      }
  });
  variant("a scalar's name", [](CudaSpec& s) { s.program.scalars[0] = "gscale2"; });
  variant("a stream's name", [](CudaSpec& s) { s.program.streams[2].name = "exp_avg2"; });
  variant("the program's name", [](CudaSpec& s) { s.program.name = "adam2"; });
  // A program with a constant, and the same program with the next float as the constant.
  auto with_constant = [](float c) {
    ProgramBuilder b("scaled_sgd");
    const Stream g = b.stream("grad", StreamRole::grad), p = b.stream("param", StreamRole::param);
    const Value pv = b.load(p);
    const Value lr = b.scalar("lr");
    const Value k = b.constant(c);
    const Value gv = b.load(g);
    b.store(p, b.sub(pv, b.mul(k, b.mul(lr, gv))));
    return b.build();
  };
  variant("constant 0.1", [&](CudaSpec& s) { s.program = with_constant(0.1f); });
  variant("constant next after 0.1", [&](CudaSpec& s) { s.program = with_constant(std::nextafter(0.1f, 1.0f)); });
  variant("state init", [](CudaSpec& s) { s.program.streams[3].init = 0.5f; });

  std::map<std::string, std::string> seen;  // canonical text -> which spec
  for (const auto& [what, spec] : specs) {
    const std::string text = jit::canonical_text(spec);
    const auto [it, fresh] = seen.emplace(text, what);
    EXPECT_TRUE(fresh) << "'" << what << "' has the same canonical text as '" << it->second << "':\n" << text;
  }
  // Each key covers everything its source depends on: equal texts, equal sources.
  // (For the reduce kernel this is what makes sharing it between specs sound.)
  std::map<std::string, std::pair<std::string, std::string>> update_of, reduce_of, step_of;
  for (const auto& [what, spec] : specs) {
    for (auto [map, text, src] :
         {std::tuple{&update_of, jit::canonical_text(spec), jit::emit_cuda_update(spec)},
          std::tuple{&step_of, jit::canonical_text(spec), jit::emit_cuda(spec)},
          std::tuple{&reduce_of, jit::reduce_canonical_text(spec), jit::emit_cuda_reduce(spec)}}) {
      const auto [it, fresh] = map->emplace(text, std::pair{what, src});
      if (!fresh) {
        EXPECT_EQ(it->second.second, src) << "'" << what << "' and '" << it->second.first
                                          << "' have one key but different sources";
      }
    }
  }
  // The reduce key tells apart what the reduce kernel depends on (norm, the grad dtype
  // of each combination in order, the number of scalars, sharded), and nothing else.
  const std::string r = jit::reduce_canonical_text(base);
  for (const char* what : {"norm inf", "combo grad", "combo order", "one combo more", "one combo less", "no combos", "sharded"}) {
    const auto it = std::find_if(specs.begin(), specs.end(), [&](const auto& v) { return v.first == what; });
    ASSERT_NE(it, specs.end());
    EXPECT_NE(jit::reduce_canonical_text(it->second), r) << what;
  }
  for (const auto& [what, spec] : specs) {
    const CudaSpec& s = spec;
    bool same_grads = s.norm == base.norm && s.combos.size() == base.combos.size() &&
                      s.program.num_scalars == base.program.num_scalars && s.sharded == base.sharded;
    for (std::size_t k = 0; same_grads && k < s.combos.size(); ++k) same_grads = s.combos[k].grad == base.combos[k].grad;
    EXPECT_EQ(jit::reduce_canonical_text(s) == r, same_grads) << what;
  }
}

// Compressed state's specs the emitter refuses: formats for another number of
// combinations, the flat layout (packed state is per tensor); and q8 in a two-phase
// program, which it emits.
TEST(CudaCodegenSpec, PackedStateSpecsItRefusesAndTwoPhaseQ8) {
  std::array<StateFormat, kMaxStreams> q8, bf16;
  q8.fill(StateFormat::f32), bf16.fill(StateFormat::f32);
  q8[2] = q8[3] = StateFormat::q8;
  bf16[2] = bf16[3] = StateFormat::bf16;
  CudaSpec adam;
  adam.program = jit::builtin_program(jit::builtin_named("adam"));
  adam.combos = {{DType::f32, DType::f32, false}, {DType::bf16, DType::bf16, true}};
  adam.combo_formats = {q8};
  const auto code = [](const CudaSpec& spec) {
    try {
      static_cast<void>(jit::emit_cuda_update(spec));
    } catch (const Error& e) {
      return std::pair{e.code(), std::string(e.what())};
    }
    return std::pair{static_cast<ErrorCode>(-1), std::string("no error")};
  };
  EXPECT_EQ(code(adam).first, ErrorCode::invalid_argument) << code(adam).second;
  adam.combo_formats = {q8, q8};
  adam.flat = true;
  EXPECT_EQ(code(adam).first, ErrorCode::invalid_argument) << code(adam).second;
  adam.flat = false;
  EXPECT_NE(jit::emit_cuda_update(adam).find("sf_q8_store8"), std::string::npos);
  // A two-phase program whose phase 1 stores its state (LAMB's stores in phase 2), with
  // LAMB's streams: with q8 state phase 1 requantizes its blocks strided, and only a q8
  // combination's chunk function takes the shared maps.
  ProgramBuilder b("phase1_stores");
  const Stream grad = b.stream("grad", StreamRole::grad);
  const Stream param = b.stream("param", StreamRole::param);
  const Stream m_stream = b.stream("exp_avg", StreamRole::state);
  const Stream v_stream = b.stream("exp_avg_sq", StreamRole::state, 0.0f, StateValues::nonnegative);
  const Value g = b.mul(b.load(grad), b.scalar("gscale"));
  const Value m = b.add(b.mul(b.load(m_stream), b.scalar("beta1")), g);
  b.store(m_stream, m);
  b.store(v_stream, b.add(b.load(v_stream), b.mul(g, g)));
  b.reduce_sumsq(0, m);
  b.phase();
  b.store(param, b.sub(b.load(param), b.mul(b.tensor_norm(0), b.div(b.load(m_stream), b.load(v_stream)))));
  CudaSpec lamb = adam;
  lamb.program = b.build();
  lamb.combo_formats = {bf16, q8};
  const std::string two_phase = jit::emit_cuda_update(lamb);
  EXPECT_NE(two_phase.find("sf_q8_store_strided(t->state->data[2]"), std::string::npos);
  EXPECT_NE(two_phase.find("sf_phase1_chunk_1(t, ch.begin, ch.len, lane, &streams, sc, acc, hyper.seed, sr_step, q8s)"), std::string::npos);
  EXPECT_NE(two_phase.find("sf_phase1_chunk_0(t, ch.begin, ch.len, lane, &streams, sc, acc, hyper.seed, sr_step)"), std::string::npos);
  lamb.combo_formats = {bf16, bf16};
  EXPECT_EQ(jit::emit_cuda_update(lamb).find("sf_q8_store_strided"), std::string::npos);
  EXPECT_NE(jit::emit_cuda_update(lamb).find("sf_load_bf16(t->state->data[2]"), std::string::npos);
  // The built-in LAMB stores its moments in phase 2 (the update), as a one-phase program.
  lamb.program = jit::builtin_program(jit::builtin_named("lamb"));
  lamb.combo_formats = {bf16, q8};
  const std::string builtin = jit::emit_cuda_update(lamb);
  EXPECT_EQ(builtin.find("sf_q8_store_strided(t->state->data["), std::string::npos);
  EXPECT_NE(builtin.find("sf_q8_store8"), std::string::npos);
}

TEST(CudaCodegenSpec, EqualSpecsHaveEqualTextAndTheEmitterIsDeterministic) {
  // The same spec built twice, the second from the program built again (at compile
  // time, as the built-in is: ProgramBuilder's nested calls are unsequenced, and g++
  // orders them differently at run time, which gives the same math in another order).
  static constexpr Program kRebuilt = jit::make_adam(/*amsgrad=*/true);
  CudaSpec a, b;
  a.program = jit::builtin_program(jit::builtin_named("adam_amsgrad"));
  b.program = kRebuilt;
  a.combos = b.combos = all_combos();
  a.aligned16 = b.aligned16 = true;
  EXPECT_EQ(jit::canonical_text(a), jit::canonical_text(b));
  EXPECT_EQ(jit::emit_cuda_update(a), jit::emit_cuda_update(b));

  for (int p = 0; p < jit::kNumBuiltins; ++p)
    for (Layout l : kLayouts) {
      SCOPED_TRACE(std::string(program_of(p).name) + " " + layout_name(l));
      const CudaSpec spec = make_spec(p, l);
      EXPECT_EQ(jit::canonical_text(spec), jit::canonical_text(make_spec(p, l)));
      EXPECT_EQ(jit::reduce_canonical_text(spec), jit::reduce_canonical_text(make_spec(p, l)));
      for (const auto& [what, emit] : {std::pair{"emit_cuda", &jit::emit_cuda}, std::pair{"emit_cuda_update", &jit::emit_cuda_update},
                                       std::pair{"emit_cuda_reduce", &jit::emit_cuda_reduce}}) {
        const std::string src = emit(spec);
        EXPECT_EQ(src, emit(spec)) << what << " is not deterministic";
        EXPECT_EQ(src.find("#include"), std::string::npos) << what << ": NVRTC has no headers, the source must include nothing";
      }
      // The key heads the source, so a cached image names its spec.
      EXPECT_NE(jit::emit_cuda_update(spec).find(jit::canonical_text(spec)), std::string::npos);
      EXPECT_NE(jit::emit_cuda_reduce(spec).find(jit::reduce_canonical_text(spec)), std::string::npos);
      const std::string elements = jit::emit_element_functions(spec);
      EXPECT_EQ(elements.find("#include"), std::string::npos);
      // One element function for every combination.
      EXPECT_NE(elements.find("void sf_body("), std::string::npos);
      EXPECT_EQ(elements.find("void sf_body(", elements.find("void sf_body(") + 1), std::string::npos);
    }
  const std::string util = jit::emit_cuda_utilities();
  EXPECT_EQ(util, jit::emit_cuda_utilities());
  EXPECT_EQ(util.find("#include"), std::string::npos);
}

// ---------------------------------------------------------------------------
// 1c. A compile error carries the log and the numbered source

TEST(CudaCodegenCompile, BrokenSourceFailsWithLogAndNumberedSource) {
  REQUIRE_NVRTC();
  const std::string good = jit::emit_cuda_update(make_spec(static_cast<int>(jit::builtin_named("adam")), Layout::flat));
  const std::size_t garbage_line = static_cast<std::size_t>(std::count(good.begin(), good.end(), '\n')) + 2;
  const std::string bad = good + "\nsf_not_a_type garbage_here = ;\n";
  try {
    jit::nvrtc_compile(bad, "broken_update.cu", {90, CudaOutput::cubin});
    FAIL() << "garbage compiled";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::compile_failed);
    const std::string msg = e.what();
    char numbered[64];
    std::snprintf(numbered, sizeof numbered, "%4zu| sf_not_a_type garbage_here = ;\n", garbage_line);
    EXPECT_NE(msg.find("NVRTC failed to compile broken_update.cu for sm_90"), std::string::npos) << log_part(msg);
    EXPECT_NE(msg.find("broken_update.cu(" + std::to_string(garbage_line) + ")"), std::string::npos) << log_part(msg);
    EXPECT_NE(msg.find("--- source ---\n   1| " + good.substr(0, good.find('\n') + 1)), std::string::npos);
    EXPECT_NE(msg.find(numbered), std::string::npos) << "no line " << garbage_line << " in the numbered source";
  }
}

// ---------------------------------------------------------------------------
// 2. The element functions on the host

const sf_gen::GenProgram* generated(const Program& p) {
  for (const sf_gen::GenProgram& g : sf_gen::kPrograms)
    if (p.name == g.name) return &g;
  return nullptr;
}

// Two-phase built-ins (LAMB) have no entry: their kernels run in cuda_emulation_test.
int one_phase_builtins() {
  int n = 0;
  for (int b = 0; b < jit::kNumBuiltins; ++b) n += !jit::is_two_phase(program_of(b));
  return n;
}

TEST(CudaElementFunctions, OneGeneratedSetPerBuiltinWithEveryCombo) {
  ASSERT_EQ(std::size(sf_gen::kPrograms), static_cast<std::size_t>(one_phase_builtins()));
  const std::vector<DtypeCombo> combos = all_combos();
  for (int b = 0; b < jit::kNumBuiltins; ++b) {
    if (jit::is_two_phase(program_of(b))) continue;
    const sf_gen::GenProgram* g = generated(program_of(b));
    ASSERT_NE(g, nullptr) << program_of(b).name;
    ASSERT_EQ(g->num_combos, static_cast<int>(combos.size()));
    for (std::size_t k = 0; k < combos.size(); ++k) {
      EXPECT_EQ(g->combos[k].weight, combos[k].weight);
      EXPECT_EQ(g->combos[k].grad, combos[k].grad);
      EXPECT_EQ(g->combos[k].master, combos[k].master);
      EXPECT_NE(g->bodies[k], nullptr);
    }
  }
}

float load_as(DType t, const void* base, std::size_t i) {
  const auto j = static_cast<long long>(i);
  return t == DType::f32 ? sf_load_f32(base, j) : t == DType::f16 ? sf_load_f16(base, j) : sf_load_bf16(base, j);
}
void store_as(DType t, void* base, std::size_t i, float v) {
  const auto j = static_cast<long long>(i);
  if (t == DType::f32) sf_store_f32(base, j, v);
  else if (t == DType::f16) sf_store_f16(base, j, v);
  else sf_store_bf16(base, j, v);
}

std::uint32_t bits(float f) { return ref::float_bits(f); }
float from_bits(std::uint32_t u) { return ref::float_from_bits(u); }

// Stored 16-bit pattern of x, correctly rounded (the tests' own RNE, reference/dtypes.hpp).
std::uint16_t narrow16(double x, DType t) { return ref::bits16(x, t); }

// One tensor's streams in host memory, as a kernel sees them.
struct Tensor {
  DtypeCombo combo;
  std::size_t n = 0;
  std::vector<std::uint8_t> grad, weight;
  std::vector<float> master;
  std::vector<float> state[kMaxStreams];

  Tensor(const DtypeCombo& c, std::size_t count) : combo(c), n(count) {
    grad.resize(n * dtype_size(c.grad));
    weight.resize(n * dtype_size(c.weight));
    if (c.master) master.resize(n);
  }
  void set_grad(std::size_t i, float x) { set(combo.grad, grad.data(), i, x); }
  void set_weight(std::size_t i, float x) { set(combo.weight, weight.data(), i, x); }
  float grad_value(std::size_t i) const { return load_as(combo.grad, grad.data(), i); }
  float weight_value(std::size_t i) const { return load_as(combo.weight, weight.data(), i); }
  std::uint32_t weight_bits(std::size_t i) const {
    if (combo.weight == DType::f32) return bits(weight_value(i));
    std::uint16_t h;
    std::memcpy(&h, weight.data() + 2 * i, 2);
    return h;
  }
  void set_weight_bits16(std::size_t i, std::uint16_t h) { std::memcpy(weight.data() + 2 * i, &h, 2); }
  // The value the update reads as its parameter.
  float param_in(std::size_t i) const { return combo.master ? master[i] : weight_value(i); }
  // The same values decoded by the tests' own conversions (reference/dtypes.hpp), for
  // the reference: a wrong widening in the prelude must not reach the oracle's input.
  double ref_grad(std::size_t i) const { return ref_value(combo.grad, grad.data(), i); }
  double ref_param(std::size_t i) const { return combo.master ? master[i] : ref_value(combo.weight, weight.data(), i); }

  cpu::UpdateArgs args(const float* scalars) {
    cpu::UpdateArgs a{};
    a.grad = grad.data();
    a.weight = weight.data();
    a.master = combo.master ? master.data() : nullptr;
    for (int s = 0; s < kMaxStreams; ++s) a.state[s] = state[s].empty() ? nullptr : state[s].data();
    a.scalars = scalars;
    return a;
  }

 private:
  static double ref_value(DType t, const std::uint8_t* base, std::size_t i) {
    if (t == DType::f32) {
      float x;
      std::memcpy(&x, base + 4 * i, 4);
      return x;
    }
    std::uint16_t h;
    std::memcpy(&h, base + 2 * i, 2);
    return ref::value16(h, t);
  }
  // x stored exactly in f32, correctly rounded in f16/bf16 (never through the prelude's narrowing).
  static void set(DType t, std::uint8_t* base, std::size_t i, float x) {
    if (t == DType::f32) {
      std::memcpy(base + 4 * i, &x, 4);
    } else {
      const std::uint16_t h = narrow16(x, t);
      std::memcpy(base + 2 * i, &h, 2);
    }
  }
};

// What sf_update_span_<k> does around sf_body for one element
// (jit/cuda/kernels/update_span.cuh): widen the stored gradient; the parameter from the fp32 master, else
// widened from the weight; the state values; after the body, the master and the
// weight rounded to its dtype, and the state the program stores.
void run_generated(const Program& prog, sf_gen::BodyFn body, Tensor& t, const float* sc) {
  const StreamUse use = stream_use(prog);
  const int gs = prog.grad_stream(), ps = prog.param_stream();
  for (std::size_t i = 0; i < t.n; ++i) {
    float g = 0.0f, p = 0.0f, st[kMaxStreams] = {};
    if (use.loads[gs]) g = t.grad_value(i);
    if (use.loads[ps]) p = t.combo.master ? sf_load_f32(t.master.data(), static_cast<long long>(i)) : t.weight_value(i);
    for (int s = 0; s < prog.num_streams; ++s)
      if (prog.streams[s].role == StreamRole::state && use.loads[s])
        st[s] = sf_load_f32(t.state[s].data(), static_cast<long long>(i));
    body(sc, g, &p, st);
    if (t.combo.master) sf_store_f32(t.master.data(), static_cast<long long>(i), p);
    store_as(t.combo.weight, t.weight.data(), i, p);
    for (int s = 0; s < prog.num_streams; ++s)
      if (prog.streams[s].role == StreamRole::state && use.stores[s])
        sf_store_f32(t.state[s].data(), static_cast<long long>(i), st[s]);
  }
}

struct NamedConfig {
  std::string label;
  OptimizerConfig config;
};

// Configurations that run each built-in program: maximize, weight decay, the
// variants' own options, and lr = 0 (the parameter passes through unchanged, so
// master values on a rounding tie reach the weight's rounding).
std::vector<NamedConfig> configs_for(Builtin b) {
  if (b == jit::builtin_named("sgd"))
    return {{"SGD lr=0.1", optim::SGD{.lr = 0.1}},
            {"SGD wd maximize", optim::SGD{.lr = 0.05, .weight_decay = 0.01, .maximize = true}},
            {"SGD lr=0", optim::SGD{.lr = 0}}};
  if (b == jit::builtin_named("sgd_momentum"))
    return {{"SGD momentum dampening", optim::SGD{.lr = 0.1, .momentum = 0.9, .dampening = 0.1}},
            {"SGD momentum wd maximize", optim::SGD{.lr = 0.01, .momentum = 0.5, .weight_decay = 0.01, .maximize = true}}};
  if (b == jit::builtin_named("sgd_nesterov"))
    return {{"SGD nesterov", optim::SGD{.lr = 0.1, .momentum = 0.9, .nesterov = true}},
            {"SGD nesterov wd maximize",
             optim::SGD{.lr = 0.01, .momentum = 0.99, .weight_decay = 0.1, .nesterov = true, .maximize = true}}};
  if (b == jit::builtin_named("adam"))
    return {{"Adam", optim::Adam{}},
            {"Adam wd maximize", optim::Adam{.lr = 1e-2, .weight_decay = 0.1, .maximize = true}},
            {"AdamW", optim::AdamW{}},
            {"AdamW lr=0", optim::AdamW{.lr = 0}}};
  if (b == jit::builtin_named("adam_amsgrad"))
    return {{"Adam amsgrad", optim::Adam{.amsgrad = true}},
            {"AdamW amsgrad wd maximize",
             optim::AdamW{.lr = 3e-3, .weight_decay = 0.1, .amsgrad = true, .maximize = true}}};
  if (b == jit::builtin_named("adagrad"))
    return {{"Adagrad", optim::Adagrad{}},
            {"Adagrad lr_decay wd init maximize",
             optim::Adagrad{.lr = 0.1, .lr_decay = 0.01, .weight_decay = 0.1, .initial_accumulator_value = 0.1,
                            .maximize = true}}};
  if (b == jit::builtin_named("rmsprop"))
    return {{"RMSprop", optim::RMSprop{}}, {"RMSprop wd maximize", optim::RMSprop{.weight_decay = 0.1, .maximize = true}}};
  if (b == jit::builtin_named("rmsprop_centered"))
    return {{"RMSprop centered", optim::RMSprop{.centered = true}},
            {"RMSprop centered wd maximize",
             optim::RMSprop{.alpha = 0.9, .weight_decay = 0.01, .centered = true, .maximize = true}}};
  if (b == jit::builtin_named("rmsprop_momentum"))
    return {{"RMSprop momentum", optim::RMSprop{.momentum = 0.9}},
            {"RMSprop momentum wd maximize",
             optim::RMSprop{.lr = 1e-3, .weight_decay = 0.01, .momentum = 0.5, .maximize = true}}};
  if (b == jit::builtin_named("rmsprop_centered_momentum"))
    return {{"RMSprop centered momentum", optim::RMSprop{.momentum = 0.9, .centered = true}},
            {"RMSprop centered momentum eps wd maximize",
             optim::RMSprop{.alpha = 0.95, .eps = 1e-6, .weight_decay = 0.1, .momentum = 0.5, .centered = true,
                            .maximize = true}}};
  if (b == jit::builtin_named("lion"))
    return {{"Lion", optim::Lion{}},
            {"Lion wd maximize", optim::Lion{.lr = 1e-3, .weight_decay = 0.1, .maximize = true}},
            {"Lion lr=0", optim::Lion{.lr = 0}}};
  if (b == jit::builtin_named("nadam"))
    return {{"NAdam", optim::NAdam{}},
            {"NAdam wd maximize", optim::NAdam{.lr = 1e-2, .weight_decay = 0.1, .momentum_decay = 0.01, .maximize = true}},
            {"NAdam decoupled wd betas", optim::NAdam{.beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1,
                                                      .decoupled_weight_decay = true}},
            {"NAdam lr=0", optim::NAdam{.lr = 0}}};
  if (b == jit::builtin_named("radam"))
    return {{"RAdam", optim::RAdam{}},
            {"RAdam beta2 0.9 wd maximize", optim::RAdam{.lr = 1e-2, .beta2 = 0.9, .weight_decay = 0.1, .maximize = true}},
            {"RAdam decoupled wd", optim::RAdam{.beta1 = 0.8, .beta2 = 0.9, .eps = 1e-6, .weight_decay = 0.1,
                                                .decoupled_weight_decay = true}},
            {"RAdam lr=0", optim::RAdam{.lr = 0}}};
  if (b == jit::builtin_named("adamax"))
    return {{"Adamax", optim::Adamax{}},
            {"Adamax wd maximize betas", optim::Adamax{.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6,
                                                       .weight_decay = 0.1, .maximize = true}},
            {"Adamax lr=0", optim::Adamax{.lr = 0}}};
  if (b == jit::builtin_named("adadelta"))
    return {{"Adadelta", optim::Adadelta{}},
            {"Adadelta rho wd maximize", optim::Adadelta{.lr = 0.5, .rho = 0.8, .eps = 1e-4, .weight_decay = 0.1,
                                                         .maximize = true}},
            {"Adadelta lr=0", optim::Adadelta{.lr = 0}}};
  if (b == jit::builtin_named("rprop"))
    return {{"Rprop", optim::Rprop{}},
            {"Rprop etas clamps maximize", optim::Rprop{.lr = 0.02, .eta_minus = 0.3, .eta_plus = 1.3,
                                                        .step_size_min = 0.015, .step_size_max = 0.024, .maximize = true}}};
  if (b == jit::builtin_named("asgd"))
    return {{"ASGD", optim::ASGD{}},
            {"ASGD t0=0 wd maximize", optim::ASGD{.lr = 0.05, .lambd = 0.1, .alpha = 0.5, .t0 = 0, .weight_decay = 0.1,
                                                  .maximize = true}},
            {"ASGD lr=0", optim::ASGD{.lr = 0}}};
  return {};
}

// (step, gscale) pairs: a first step at gscale 1, a later one with an inexact gscale
// (a clip coefficient over a loss scale).
struct StepPoint {
  std::int64_t step;
  double gscale;
};
constexpr StepPoint kSteps[] = {{1, 1.0}, {7, 0.3 / 64}};

// Second moments and accumulators are never negative in a real run.
bool nonnegative_state(std::string_view name) {
  return name == "exp_avg_sq" || name == "max_exp_avg_sq" || name == "sum" || name == "square_avg" ||
         name == "exp_inf" || name == "acc_delta" || name == "step_size";
}

// Awkward fp32 values: zeros of both signs, f32 and f16 subnormals, values near the
// top of the storage format, exact ties between adjacent bf16 or f16 values, and
// ordinary values over several decades. Never inf or NaN.
class Tricky {
 public:
  explicit Tricky(std::uint32_t seed) : rng_(seed) {}

  float draw(DType storage) {
    const int r = std::uniform_int_distribution<int>(0, 99)(rng_);
    const float sign = coin() ? -1.0f : 1.0f;
    if (r < 50) return static_cast<float>(normal() * std::pow(10.0, uniform(-3.0, 1.0)));
    if (r < 54) return sign * 0.0f;
    if (r < 59) return sign * from_bits(std::uniform_int_distribution<std::uint32_t>(1, 0x00FFFFFFu)(rng_));
    if (r < 64) return sign * static_cast<float>(uniform(0.0, 6.2e-5));  // f16 subnormals and the first normals
    if (r < 70) {  // near the top of the storage range
      if (storage == DType::f16) return sign * static_cast<float>(uniform(6.0e4, 65504.0));
      return sign * static_cast<float>(std::pow(10.0, uniform(20.0, 38.0)));
    }
    if (r < 85) {  // halfway between two bf16 values
      const std::uint32_t hi = bits(static_cast<float>(normal() * std::pow(10.0, uniform(-8.0, 8.0)))) & 0xFFFF0000u;
      return from_bits(hi | 0x8000u);
    }
    // Halfway between two f16 values (exact in fp32), subnormals and 65520 included.
    const auto h = static_cast<std::uint16_t>(std::uniform_int_distribution<int>(0, 0x7BFF)(rng_));
    return sign * static_cast<float>((ref::f16_value(h) + ref::f16_value(static_cast<std::uint16_t>(h + 1))) / 2);
  }
  // A value that stays finite when stored as `storage`.
  float draw_storable(DType storage) {
    for (;;) {
      const float x = draw(storage);
      if (storage == DType::f32 || std::isfinite(ref::value16(narrow16(x, storage), storage))) return x;
    }
  }
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(rng_); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng_); }
  bool coin() { return (rng_() & 1u) != 0; }
  std::mt19937& rng() { return rng_; }

 private:
  std::mt19937 rng_;
};

// The f16 and bf16 poison a weight holds before an update that must write it: a
// signalling NaN, which no rounding produces (a rounded NaN is quiet).
std::uint16_t poison16(DType t) { return t == DType::f16 ? 0x7C01 : 0x7F81; }

bool same_f32(float a, float b) { return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b)); }
bool same_weight(const Tensor& t, std::uint32_t a, std::uint32_t b) {
  if (a == b) return true;
  if (t.combo.weight == DType::f32) return std::isnan(from_bits(a)) && std::isnan(from_bits(b));
  return std::isnan(ref::value16(static_cast<std::uint16_t>(a), t.combo.weight)) &&
         std::isnan(ref::value16(static_cast<std::uint16_t>(b), t.combo.weight));
}

std::string hex32(std::uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08X", u);
  return buf;
}

// (i) The generated element math, loaded and stored as sf_update does, against the
// CPU backend's fused Highway kernels: bitwise, every output of every element. NaN
// results (0 * inf and the like, from the huge values) must be NaN on both sides;
// their payloads are not compared.
TEST(CudaElementFunctions, BitwiseEqualToTheCpuFusedKernels) {
  constexpr std::size_t kElems = 2053;  // odd: the CPU kernel's vector tail runs too
  std::int64_t runs = 0, elements = 0, nan_outputs = 0;
  for (int b = 0; b < jit::kNumBuiltins; ++b) {
    const Builtin builtin = static_cast<Builtin>(b);
    const Program& prog = program_of(b);
    if (jit::is_two_phase(prog)) continue;  // cuda_emulation_test runs its kernels
    const sf_gen::GenProgram* gen = generated(prog);
    ASSERT_NE(gen, nullptr) << prog.name;
    const StreamUse use = stream_use(prog);
    const std::vector<NamedConfig> configs = configs_for(builtin);
    for (std::size_t ci = 0; ci < configs.size(); ++ci) {
      const NamedConfig& nc = configs[ci];
      ASSERT_EQ(jit::select_builtin(nc.config), builtin) << nc.label;
      for (const StepPoint& sp : kSteps) {
        float sc[kMaxScalars];
        jit::fill_scalars(nc.config, prog, sp.step, sp.gscale, sc);
        for (int k = 0; k < gen->num_combos; ++k) {
          const DtypeCombo combo{gen->combos[k].weight, gen->combos[k].grad, gen->combos[k].master};
          const std::string what = std::string(prog.name) + " [" + nc.label + "] step " + std::to_string(sp.step) +
                                   " " + combo_name(combo);
          SCOPED_TRACE(what);
          const cpu::UpdateFn fused = cpu::fused_update_kernel(builtin, combo);
          ASSERT_NE(fused, nullptr);

          Tricky draw(static_cast<std::uint32_t>(10000 * b + 1000 * ci + 10 * k + sp.step));
          Tensor in(combo, kElems);
          for (std::size_t i = 0; i < kElems; ++i) {
            in.set_grad(i, draw.draw_storable(combo.grad));
            if (combo.master) {
              in.master[i] = draw.draw(combo.weight);
              in.set_weight_bits16(i, poison16(combo.weight));
            } else {
              in.set_weight(i, draw.draw_storable(combo.weight));
            }
          }
          for (int s = 0; s < prog.num_streams; ++s) {
            if (prog.streams[s].role != StreamRole::state) continue;
            in.state[s].resize(kElems);
            for (float& x : in.state[s]) {
              x = draw.draw(DType::f32);
              if (nonnegative_state(prog.streams[s].name)) x = std::fabs(x);
            }
          }

          Tensor cpu_out = in, gen_out = in;
          fused(cpu_out.args(sc), 0, kElems);
          run_generated(prog, gen->bodies[k], gen_out, sc);
          ++runs;
          elements += kElems;

          ref::Reporter rep(what);
          auto describe_inputs = [&](std::ostream& os, std::size_t i) {
            os << " at element " << i << ": g = " << in.grad_value(i) << " (stored " << dtype_name(combo.grad)
               << "), p = " << in.param_in(i) << " (" << hex32(bits(in.param_in(i))) << ")";
            for (int s = 0; s < prog.num_streams; ++s)
              if (!in.state[s].empty()) os << ", " << prog.streams[s].name << " = " << in.state[s][i];
          };
          for (std::size_t i = 0; i < kElems; ++i) {
            const std::uint32_t wc = cpu_out.weight_bits(i), wg = gen_out.weight_bits(i);
            if (!same_weight(in, wc, wg))
              rep.fail([&](auto& os) {
                os << "weight: CPU " << hex32(wc) << " (" << cpu_out.weight_value(i) << "), generated " << hex32(wg)
                   << " (" << gen_out.weight_value(i) << ")";
                describe_inputs(os, i);
              });
            if (combo.master && wg == poison16(combo.weight))
              rep.fail([&](auto& os) { os << "weight not written at element " << i; });
            if (combo.master && !same_f32(cpu_out.master[i], gen_out.master[i]))
              rep.fail([&](auto& os) {
                os << "master: CPU " << cpu_out.master[i] << " (" << hex32(bits(cpu_out.master[i])) << "), generated "
                   << gen_out.master[i] << " (" << hex32(bits(gen_out.master[i])) << ")";
                describe_inputs(os, i);
              });
            nan_outputs += std::isnan(gen_out.param_in(i));
            for (int s = 0; s < prog.num_streams; ++s) {
              if (in.state[s].empty()) continue;
              const float c = cpu_out.state[s][i], g = gen_out.state[s][i];
              if (!same_f32(c, g))
                rep.fail([&](auto& os) {
                  os << prog.streams[s].name << ": CPU " << c << " (" << hex32(bits(c)) << "), generated " << g << " ("
                     << hex32(bits(g)) << ")";
                  describe_inputs(os, i);
                });
              // A stream the program does not store keeps its bits.
              if (!use.stores[s] && bits(g) != bits(in.state[s][i]))
                rep.fail([&](auto& os) { os << prog.streams[s].name << " changed but is never stored"; });
            }
          }
          EXPECT_EQ(cpu_out.grad, in.grad) << "the CPU kernel wrote the gradient";
          EXPECT_EQ(gen_out.grad, in.grad);
        }
      }
    }
  }
  std::printf("bitwise: %lld runs, %lld elements, %lld NaN parameters (both sides NaN)\n", static_cast<long long>(runs),
              static_cast<long long>(elements), static_cast<long long>(nan_outputs));
}

// (ii) The generated element math against the float64 reference (tests/reference), with
// the tolerances of reference/harness.hpp (docs/architecture.md §8): fp32 values within 1e-5 relative
// plus the floors and the reference's own sensitivity to a 1e-6 change of the gradient;
// f16/bf16 weights within one unit in the last place of the correctly rounded
// reference (more only where the fp32 tolerance spans more), and with masters exactly
// the master rounded to nearest even.
struct RefTally {
  std::int64_t elements = 0, one_ulp = 0, cancelled16 = 0, lion_ambiguous = 0;
  double param_margin = 0, state_margin = 0;
};

void check_against_reference(const Program& prog, const sf_gen::GenProgram& gen, int k, const NamedConfig& nc,
                             const StepPoint& sp, std::uint32_t seed, RefTally& tally) {
  constexpr std::size_t kElems = 1000;
  constexpr double kLossScale = 64;
  const DtypeCombo combo{gen.combos[k].weight, gen.combos[k].grad, gen.combos[k].master};
  const std::string what = std::string(prog.name) + " [" + nc.label + "] step " + std::to_string(sp.step) + " " +
                           combo_name(combo);
  SCOPED_TRACE(what);

  // Ordinary training values: N(0, 1) weights, gradients stored multiplied by the
  // loss scale, plausible optimizer state (initial values on step 1).
  Tricky draw(seed);
  Tensor t(combo, kElems);
  for (std::size_t i = 0; i < kElems; ++i) {
    t.set_grad(i, static_cast<float>(draw.normal() * (0.5 + draw.uniform(0, 2)) * kLossScale));
    const float w = static_cast<float>(draw.normal());
    if (combo.master) {
      t.master[i] = w;
      t.set_weight_bits16(i, poison16(combo.weight));
    } else {
      t.set_weight(i, w);
    }
  }
  std::map<std::string, int> stream_of;
  for (int s = 0; s < prog.num_streams; ++s) {
    if (prog.streams[s].role != StreamRole::state) continue;
    const std::string name(prog.streams[s].name);
    stream_of[name] = s;
    t.state[s].resize(kElems);
    for (float& x : t.state[s]) {
      if (sp.step == 1) {
        x = static_cast<float>(ref::initial_state_value(nc.config, name));
      } else if (nonnegative_state(name)) {
        x = static_cast<float>(std::pow(draw.normal() * 0.3, 2) + draw.uniform(1e-6, 1e-2));
      } else {
        x = static_cast<float>(draw.normal() * 0.1);
      }
    }
  }
  // Centered RMSprop's running mean square covers the square of the running mean.
  if (sp.step != 1 && stream_of.count("grad_avg") && stream_of.count("square_avg"))
    for (std::size_t i = 0; i < kElems; ++i) {
      const float ga = t.state[stream_of["grad_avg"]][i];
      t.state[stream_of["square_avg"]][i] += ga * ga;
    }

  // The reference starts from exactly these values.
  ref::RefTensor before;
  std::vector<double> effective(kElems);
  for (std::size_t i = 0; i < kElems; ++i) {
    before.param.push_back(t.ref_param(i));
    effective[i] = t.ref_grad(i) * sp.gscale;
  }
  for (const std::string& name : ref::state_names(nc.config)) {
    ASSERT_TRUE(stream_of.count(name)) << "the program has no state stream " << name;
    const std::vector<float>& s = t.state[stream_of[name]];
    before.state[name].assign(s.begin(), s.end());
  }
  ASSERT_EQ(stream_of.size(), before.state.size()) << "the program keeps state the reference does not";

  float sc[kMaxScalars];
  jit::fill_scalars(nc.config, prog, sp.step, sp.gscale, sc);
  run_generated(prog, gen.bodies[k], t, sc);
  const ref::Expected expected = ref::make_expected(nc.config, {before}, {effective}, sp.step);
  const ref::RefTensor& after = expected.after[0];

  // As compare_with_reference() in reference/harness.hpp, for one tensor.
  const auto* lion = std::get_if<optim::Lion>(&nc.config);
  auto lion_ambiguous = [&](std::size_t j) {
    if (lion == nullptr) return false;
    const double m = before.state.at("exp_avg")[j];
    const double g = lion->maximize ? -effective[j] : effective[j];
    const double c = lion->beta1 * m + (1 - lion->beta1) * g;
    return std::fabs(c) <= 1e-5 * (lion->beta1 * std::fabs(m) + (1 - lion->beta1) * std::fabs(g));
  };
  double max_step = 0;
  for (std::size_t j = 0; j < kElems; ++j) max_step = std::max(max_step, std::fabs(after.param[j] - before.param[j]));
  const double param_floor = ref::kParamFloor * max_step;

  ref::Reporter rep(what);
  for (std::size_t j = 0; j < kElems; ++j) {
    ++tally.elements;
    if (lion_ambiguous(j)) {
      ++tally.lion_ambiguous;
      continue;
    }
    const double want = after.param[j];
    const double tol = ref::kRtol * std::fabs(want) + param_floor + expected.param_sens[0][j];
    auto check_fp32 = [&](double got, const char* which) {
      const double err = std::fabs(got - want);
      if (!(err <= tol))
        rep.fail([&](auto& os) {
          os << which << "[" << j << "] = " << got << ", reference " << want << " (from " << before.param[j]
             << ", g " << effective[j] << "), error " << err << " > tolerance " << tol;
        });
      else if (tol > 0) tally.param_margin = std::max(tally.param_margin, err / tol);
    };
    if (combo.weight == DType::f32) {
      check_fp32(t.weight_value(j), "weight");
      continue;
    }
    const auto got = static_cast<std::uint16_t>(t.weight_bits(j));
    if (combo.master) {
      check_fp32(t.master[j], "master");
      const std::uint16_t rounded = narrow16(t.master[j], combo.weight);
      if (got != rounded)
        rep.fail([&](auto& os) {
          os << "weight[" << j << "] bits " << hex32(got) << " != master " << t.master[j] << " rounded to nearest even ("
             << hex32(rounded) << ")";
        });
    }
    const std::uint16_t expect = narrow16(want, combo.weight);
    const std::int64_t ulps = ref::ulp_distance16(got, expect, combo.weight);
    if (ulps == 1) ++tally.one_ulp;
    if (ulps > 1) {
      const std::int64_t lo = ref::ordered16(narrow16(want - tol, combo.weight));
      const std::int64_t hi = ref::ordered16(narrow16(want + tol, combo.weight));
      const std::int64_t g = ref::ordered16(got);
      if (!std::isfinite(ref::value16(got, combo.weight)) || g < std::min(lo, ref::ordered16(expect) - 1) ||
          g > std::max(hi, ref::ordered16(expect) + 1))
        rep.fail([&](auto& os) {
          os << "weight[" << j << "] = " << ref::value16(got, combo.weight) << ", reference " << want << " rounds to "
             << ref::value16(expect, combo.weight) << ": " << ulps << " ulps apart (from " << before.param[j] << ")";
        });
      else
        ++tally.cancelled16;
    }
  }
  for (const auto& [name, s] : stream_of) {
    const std::vector<double>& want = after.state.at(name);
    const std::vector<double>& from = before.state.at(name);
    double scale = 0;
    for (std::size_t j = 0; j < kElems; ++j) scale = std::max({scale, std::fabs(want[j]), std::fabs(from[j])});
    const double floor = ref::kStateFloor * scale;
    const std::vector<double>& sens = expected.state_sens.at(name)[0];
    for (std::size_t j = 0; j < kElems; ++j) {
      const double got = t.state[s][j];
      const double err = std::fabs(got - want[j]);
      const double tol = ref::kRtol * std::fabs(want[j]) + floor + sens[j];
      if (!(err <= tol))
        rep.fail([&](auto& os) {
          os << name << "[" << j << "] = " << got << ", reference " << want[j] << " (from " << from[j] << "), error "
             << err << " > tolerance " << tol;
        });
      else if (tol > 0) tally.state_margin = std::max(tally.state_margin, err / tol);
    }
  }
}

TEST(CudaElementFunctions, WithinToleranceOfTheFloat64Reference) {
  RefTally tally;
  for (int b = 0; b < jit::kNumBuiltins; ++b) {
    const Program& prog = program_of(b);
    if (jit::is_two_phase(prog)) continue;  // cuda_emulation_test runs its kernels
    const sf_gen::GenProgram* gen = generated(prog);
    ASSERT_NE(gen, nullptr) << prog.name;
    std::uint32_t seed = 100000u * static_cast<std::uint32_t>(b);
    for (const NamedConfig& nc : configs_for(static_cast<Builtin>(b)))
      for (const StepPoint& sp : kSteps)
        for (int k = 0; k < gen->num_combos; ++k) check_against_reference(prog, *gen, k, nc, sp, ++seed, tally);
  }
  std::printf("reference: %lld elements; largest error/tolerance: weights %.3f, state %.3f; 16-bit weights 1 ulp "
              "off: %lld, more (within the fp32 tolerance): %lld; Lion elements skipped (sign within rounding of 0): %lld\n",
              static_cast<long long>(tally.elements), tally.param_margin, tally.state_margin,
              static_cast<long long>(tally.one_ulp), static_cast<long long>(tally.cancelled16),
              static_cast<long long>(tally.lion_ambiguous));
}

// ---------------------------------------------------------------------------
// The scalar rules against PyTorch's formulas

// A per-step scalar by name, in double, written from PyTorch's algorithms (bias
// corrections with std::pow), independently of jit/builtin/*.hpp; nullopt for a name
// this table does not know (a new scalar must be added here).
std::optional<double> pytorch_scalar(const OptimizerConfig& config, std::string_view name, std::int64_t step,
                                     double gscale) {
  return std::visit(
      [&](const auto& c) -> std::optional<double> {
        using T = std::decay_t<decltype(c)>;
        const auto t = static_cast<double>(step);
        if (name == "gscale") return c.maximize ? -gscale : gscale;
        if (name == "lr") return c.lr;
        if constexpr (std::is_same_v<T, optim::SGD>) {
          if (name == "weight_decay") return c.weight_decay;
          if (name == "momentum") return c.momentum;
          if (name == "buf_momentum") return step == 1 ? 0.0 : c.momentum;  // buf = g on the first step
          if (name == "buf_grad_coef") return step == 1 ? 1.0 : 1.0 - c.dampening;
        } else if constexpr (std::is_same_v<T, optim::Adam> || std::is_same_v<T, optim::AdamW>) {
          constexpr bool decoupled = std::is_same_v<T, optim::AdamW>;
          if (name == "l2") return decoupled ? 0.0 : c.weight_decay;
          if (name == "decay") return decoupled ? 1.0 - c.lr * c.weight_decay : 1.0;
          if (name == "beta1") return c.beta1;
          if (name == "one_minus_beta1") return 1.0 - c.beta1;
          if (name == "beta2") return c.beta2;
          if (name == "one_minus_beta2") return 1.0 - c.beta2;
          if (name == "eps") return c.eps;
          if (name == "step_size") return c.lr / (1.0 - std::pow(c.beta1, t));
          if (name == "bias_correction2_sqrt") return std::sqrt(1.0 - std::pow(c.beta2, t));
        } else if constexpr (std::is_same_v<T, optim::Adagrad>) {
          if (name == "weight_decay") return c.weight_decay;
          if (name == "eps") return c.eps;
          if (name == "clr") return c.lr / (1.0 + (t - 1.0) * c.lr_decay);
        } else if constexpr (std::is_same_v<T, optim::RMSprop>) {
          if (name == "weight_decay") return c.weight_decay;
          if (name == "alpha") return c.alpha;
          if (name == "one_minus_alpha") return 1.0 - c.alpha;
          if (name == "eps") return c.eps;
          if (name == "momentum") return c.momentum;
        } else if constexpr (std::is_same_v<T, optim::Lion>) {
          if (name == "decay") return 1.0 - c.lr * c.weight_decay;
          if (name == "beta1") return c.beta1;
          if (name == "one_minus_beta1") return 1.0 - c.beta1;
          if (name == "beta2") return c.beta2;
          if (name == "one_minus_beta2") return 1.0 - c.beta2;
        } else if constexpr (std::is_same_v<T, optim::NAdam> || std::is_same_v<T, optim::RAdam>) {
          if (name == "l2") return c.decoupled_weight_decay ? 0.0 : c.weight_decay;
          if (name == "decay") return c.decoupled_weight_decay ? 1.0 - c.lr * c.weight_decay : 1.0;
          if (name == "beta1") return c.beta1;
          if (name == "one_minus_beta1") return 1.0 - c.beta1;
          if (name == "beta2") return c.beta2;
          if (name == "one_minus_beta2") return 1.0 - c.beta2;
          if (name == "eps") return c.eps;
          if constexpr (std::is_same_v<T, optim::NAdam>) {
            // torch/optim/nadam.py: mu = beta1 * (1 - 0.5 * 0.96^(step * momentum_decay)); mu_product
            // is the product of the mus (an fp32 tensor in PyTorch: here the exact product rounded
            // to fp32 once; NadamMomentumCache below bounds the difference).
            const auto mu = [&](double i) { return c.beta1 * (1.0 - 0.5 * std::pow(0.96, i * c.momentum_decay)); };
            double product = 1;
            for (std::int64_t i = 1; i <= step; ++i) product *= mu(static_cast<double>(i));
            const double mu_product = static_cast<float>(product);
            if (name == "bias_correction2") return 1.0 - std::pow(c.beta2, t);
            if (name == "grad_coef") return -c.lr * (1.0 - mu(t)) / (1.0 - mu_product);
            if (name == "momentum_coef") return -c.lr * mu(t + 1) / (1.0 - mu_product * mu(t + 1));
          } else {
            // torch/optim/radam.py
            const double bias_correction2 = 1.0 - std::pow(c.beta2, t);
            const double rho_inf = 2.0 / (1.0 - c.beta2) - 1.0;
            const double rho_t = rho_inf - 2.0 * t * std::pow(c.beta2, t) / bias_correction2;
            if (name == "lr") return c.lr;
            if (name == "bias_correction1") return 1.0 - std::pow(c.beta1, t);
            if (name == "bias_correction2_sqrt") return std::pow(bias_correction2, 0.5);
            if (name == "rect")
              return rho_t > 5.0 ? std::pow((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t), 0.5)
                                 : 0.0;
          }
        } else if constexpr (std::is_same_v<T, optim::Adamax>) {
          if (name == "weight_decay") return c.weight_decay;
          if (name == "beta1") return c.beta1;
          if (name == "one_minus_beta1") return 1.0 - c.beta1;
          if (name == "beta2") return c.beta2;
          if (name == "eps") return c.eps;
          if (name == "clr") return c.lr / (1.0 - std::pow(c.beta1, t));
        } else if constexpr (std::is_same_v<T, optim::Adadelta>) {
          if (name == "weight_decay") return c.weight_decay;
          if (name == "rho") return c.rho;
          if (name == "one_minus_rho") return 1.0 - c.rho;
          if (name == "eps") return c.eps;
        } else if constexpr (std::is_same_v<T, optim::Rprop>) {
          if (name == "eta_plus") return c.eta_plus;
          if (name == "eta_minus") return c.eta_minus;
          if (name == "step_size_min") return c.step_size_min;
          if (name == "step_size_max") return c.step_size_max;
        } else if constexpr (std::is_same_v<T, optim::ASGD>) {
          // torch/optim/asgd.py: eta and mu are fp32 tensors, set after each step from the step
          // count (eta = lr and mu = 1 before the first).
          const double done = t - 1.0;
          const double eta = static_cast<float>(c.lr / std::pow(1.0 + c.lambd * c.lr * done, c.alpha));
          if (name == "weight_decay") return c.weight_decay;
          if (name == "eta") return eta;
          if (name == "decay") return 1.0 - c.lambd * eta;
          if (name == "mu") return step == 1 ? 1.0 : 1.0 / std::max(1.0, done - c.t0);
        }
        return std::nullopt;
      },
      config);
}

// Units in the last place between two fp32 values (+0 and -0 are 0 apart).
std::int64_t ulp_distance32(float a, float b) {
  auto ordered = [](float x) -> std::int64_t {
    const std::uint32_t u = bits(x);
    return (u & 0x80000000u) ? -static_cast<std::int64_t>(u & 0x7FFFFFFFu) : static_cast<std::int64_t>(u);
  };
  return std::llabs(ordered(a) - ordered(b));
}

TEST(CudaScalarRules, EvaluateToPyTorchFormulasWithinOneUlp) {
  std::int64_t checked = 0, inexact = 0;
  for (int b = 0; b < jit::kNumBuiltins; ++b) {
    const Builtin builtin = static_cast<Builtin>(b);
    const Program& prog = program_of(b);
    std::vector<NamedConfig> configs = configs_for(builtin);
    // Betas near 1, where the bias corrections cancel most.
    if (builtin == jit::builtin_named("adam")) configs.push_back({"Adam betas near 1", optim::Adam{.beta1 = 0.99, .beta2 = 0.99999}});
    if (builtin == jit::builtin_named("nadam"))
      configs.push_back({"NAdam betas near 1", optim::NAdam{.beta1 = 0.99, .beta2 = 0.99999, .momentum_decay = 0.1}});
    if (builtin == jit::builtin_named("radam"))
      configs.push_back({"RAdam beta2 near 1", optim::RAdam{.beta1 = 0.99, .beta2 = 0.99999}});
    if (builtin == jit::builtin_named("asgd"))
      configs.push_back({"ASGD large lambd", optim::ASGD{.lr = 0.1, .lambd = 0.5, .alpha = 0.9, .t0 = 3}});
    for (const NamedConfig& nc : configs) {
      sf_scalar_rule rules[kMaxScalars];
      jit::scalar_rules(nc.config, prog, rules);
      for (std::int64_t step : {1, 2, 10, 1000})
        for (double gscale : {1.0, 1.0 / 65536, 0.37 / 1024, 3.0}) {
          float evaluated[kMaxScalars], filled[kMaxScalars];
          jit::eval_scalars(rules, prog.num_scalars, step, gscale, evaluated);
          jit::fill_scalars(nc.config, prog, step, gscale, filled);
          for (int s = 0; s < prog.num_scalars; ++s) {
            const std::string_view name = prog.scalars[s];
            SCOPED_TRACE(std::string(prog.name) + " [" + nc.label + "] step " + std::to_string(step) + " " +
                         std::string(name));
            EXPECT_EQ(bits(evaluated[s]), bits(filled[s]));
            const std::optional<double> want = pytorch_scalar(nc.config, name, step, gscale);
            ASSERT_TRUE(want.has_value()) << "no PyTorch formula for scalar " << name;
            const float expect = static_cast<float>(*want);
            ++checked;
            inexact += bits(expect) != bits(filled[s]);
            EXPECT_LE(ulp_distance32(filled[s], expect), 1)
                << "library " << filled[s] << ", PyTorch's formula " << *want << " -> " << expect;
          }
        }
    }
  }
  std::printf("scalars: %lld checked, %lld round differently from PyTorch's formula (all within 1 ulp)\n",
              static_cast<long long>(checked), static_cast<long long>(inexact));
}

// The bias corrections use powers by repeated squaring (the same rounding on every
// device); they must round to the fp32 that std::pow gives nearly always, and never
// be more than one fp32 ulp away.
TEST(CudaScalarRules, RepeatedSquaringRoundsLikeStdPow) {
  std::vector<double> betas = {0.0, 0.1, 0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9995, 0.9999, 0.99999, 0.999999};
  std::mt19937 rng(2024);
  for (int i = 0; i < 100; ++i) betas.push_back(std::uniform_real_distribution<double>(0.0, 1.0)(rng));
  for (int i = 0; i < 100; ++i) betas.push_back(1.0 - std::pow(10.0, std::uniform_real_distribution<double>(-7.0, -1.0)(rng)));
  std::vector<std::int64_t> steps;
  for (std::int64_t s = 1; s <= 2000; ++s) steps.push_back(s);
  for (std::int64_t s : {4096, 5000, 10000, 12345, 65535, 100000, 999999, 1000000, 10000000}) steps.push_back(s);

  std::int64_t total = 0, mismatches = 0, worst = 0;
  std::string first;
  for (double beta : betas)
    for (std::int64_t step : steps) {
      const double t = static_cast<double>(step);
      const sf_scalar_rule rules[2] = {{SF_RULE_DIV_ONE_MINUS_POW, 0, 1e-3, beta, 0.0, 0.0},
                                       {SF_RULE_SQRT_ONE_MINUS_POW, 0, 0.0, beta, 0.0, 0.0}};
      float got[2];
      jit::eval_scalars(rules, 2, step, 1.0, got);
      const float want[2] = {static_cast<float>(1e-3 / (1.0 - std::pow(beta, t))),
                             static_cast<float>(std::sqrt(1.0 - std::pow(beta, t)))};
      for (int r = 0; r < 2; ++r) {
        ++total;
        const std::int64_t d = ulp_distance32(got[r], want[r]);
        worst = std::max(worst, d);
        if (d != 0 && ++mismatches == 1) {
          std::ostringstream os;
          os.precision(17);
          os << (r == 0 ? "lr/(1-beta^t)" : "sqrt(1-beta^t)") << " beta " << beta << " t " << step << ": " << got[r]
             << " vs std::pow " << want[r];
          first = os.str();
        }
      }
    }
  std::printf("powers: %lld of %lld scalars round differently from std::pow (%.4f%%), at most %lld ulp%s%s\n",
              static_cast<long long>(mismatches), static_cast<long long>(total),
              100.0 * static_cast<double>(mismatches) / static_cast<double>(total), static_cast<long long>(worst),
              first.empty() ? "" : "; first: ", first.c_str());
  EXPECT_LE(worst, 1);
  EXPECT_LE(static_cast<double>(mismatches), 1e-3 * static_cast<double>(total));
}

// The real powers, logarithms and exponentials of the rules (jit/step_scalars.h:
// sf_pow, sf_log, sf_exp, sf_expm1), written with + - * / and bit manipulation only so
// that host and device get the same bits: within about one double ulp of the true
// value, i.e. at most 2 ulps from glibc's (itself within half an ulp), over the ranges
// the rules use and far beyond; rounded to fp32 they nearly always equal std::pow's.
std::int64_t ulp_distance64(double a, double b) {
  auto ordered = [](double x) -> std::int64_t {
    std::uint64_t u;
    std::memcpy(&u, &x, 8);
    return (u >> 63) ? -static_cast<std::int64_t>(u & 0x7FFFFFFFFFFFFFFFull) : static_cast<std::int64_t>(u);
  };
  return std::llabs(ordered(a) - ordered(b));
}

TEST(CudaScalarRules, RealPowersLogsAndExpsAreWithinAnUlpOfTheLibm) {
  std::mt19937_64 rng(77);
  auto uniform = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  std::int64_t pow_worst = 0, pow_total = 0, pow_f32_differ = 0;
  double worst_x = 0, worst_y = 0;
  for (int i = 0; i < 400000; ++i) {
    double x = 0, y = 0;
    switch (i % 5) {
      case 0: x = std::exp(uniform(-700, 700)), y = uniform(-1, 1); break;          // any base, small exponents
      case 1: x = uniform(0, 2), y = uniform(-100, 100); break;
      case 2: x = 1 + uniform(-1e-3, 1e-3), y = uniform(-1e5, 1e5); break;       // ASGD's (1 + lambd lr t)^alpha
      case 3: x = 0.96, y = uniform(0, 1e4); break;                               // NAdam's 0.96^(t md)
      default: x = 1 + uniform(0, 1e3), y = uniform(0, 1); break;
    }
    const double want = std::pow(x, y), got = sf_pow(x, y);
    if (!std::isnormal(want)) continue;
    ++pow_total;
    const std::int64_t d = ulp_distance64(got, want);
    if (d > pow_worst) pow_worst = d, worst_x = x, worst_y = y;
    pow_f32_differ += static_cast<float>(got) != static_cast<float>(want);
  }
  std::int64_t log_worst = 0, exp_worst = 0, expm1_worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const double x = std::exp(uniform(-745, 709));
    log_worst = std::max(log_worst, ulp_distance64(sf_log(x), std::log(x)));
    const double e = uniform(-708, 709);
    exp_worst = std::max(exp_worst, ulp_distance64(sf_exp(e), std::exp(e)));
    const double m = uniform(-1, 1) * std::pow(10.0, -uniform(0, 12));
    expm1_worst = std::max(expm1_worst, ulp_distance64(sf_expm1(m), std::expm1(m)));
  }
  std::printf("sf_pow: %lld values, at most %lld ulps from std::pow (x %.17g, y %.17g), %lld round to another fp32; "
              "sf_log %lld, sf_exp %lld, sf_expm1 %lld ulps at most\n",
              static_cast<long long>(pow_total), static_cast<long long>(pow_worst), worst_x, worst_y,
              static_cast<long long>(pow_f32_differ), static_cast<long long>(log_worst), static_cast<long long>(exp_worst),
              static_cast<long long>(expm1_worst));
  EXPECT_LE(pow_worst, 2);
  EXPECT_LE(static_cast<double>(pow_f32_differ), 1e-4 * static_cast<double>(pow_total));
  EXPECT_LE(log_worst, 1);
  EXPECT_LE(exp_worst, 1);
  EXPECT_LE(expm1_worst, 4);  // exp(x) - 1 for |x| >= 0.3
  // Exact where PyTorch's are: ASGD's first step (1^alpha), x^0, and the special values.
  EXPECT_EQ(sf_pow(1.0, 0.75), 1.0);
  EXPECT_EQ(sf_pow(0.37, 0.0), 1.0);
  EXPECT_EQ(sf_pow(2.0, 10.0), 1024.0);
  EXPECT_EQ(sf_pow(0.0, 0.5), 0.0);
  EXPECT_TRUE(std::isinf(sf_pow(0.0, -0.5)));
  EXPECT_EQ(sf_pow(0.5, 2000.0), 0.0);
  EXPECT_TRUE(std::isinf(sf_pow(2.0, 2000.0)));
  EXPECT_TRUE(std::isnan(sf_pow(-2.0, 0.5)));
  EXPECT_EQ(sf_exp(0.0), 1.0);
  EXPECT_EQ(sf_log(1.0), 0.0);
  EXPECT_EQ(ulp_distance64(sf_pow(3e-320, 0.5), std::pow(3e-320, 0.5)), 0);  // a subnormal base
}

// NAdam's momentum cache product P_t = mu_1 ... mu_t in closed form (sf_nadam_mu_product)
// against the product itself: within an fp32 ulp of the double loop (both rounded to
// fp32), and within t fp32 ulps of PyTorch's own running product in an fp32 tensor.
TEST(CudaScalarRules, NadamMomentumCacheClosedFormMatchesTheProduct) {
  std::int64_t checked = 0, worst_loop = 0, worst_torch = 0;
  for (double beta1 : {0.0, 0.5, 0.9, 0.95, 0.99, 0.999})
    for (double md : {0.0, 1e-300, 1e-5, 4e-3, 0.1, 1.0, 30.0, 1e4}) {
      const auto mu = [&](std::int64_t i) { return beta1 * (1.0 - 0.5 * std::pow(0.96, static_cast<double>(i) * md)); };
      double product = 1;
      float torch_product = 1;  // mu_product *= mu: fp32 times the fp32 rounding of mu
      for (std::int64_t t = 1; t <= 3000; ++t) {
        product *= mu(t);
        torch_product *= static_cast<float>(mu(t));
        if (t > 100 && t % 97 != 0) continue;
        const auto got = static_cast<float>(sf_nadam_mu_product(beta1, md, t, 0.0));
        ++checked;
        const std::int64_t d_loop = ulp_distance32(got, static_cast<float>(product));
        const std::int64_t d_torch = ulp_distance32(got, torch_product);
        worst_loop = std::max(worst_loop, d_loop);
        worst_torch = std::max(worst_torch, d_torch);
        EXPECT_LE(d_loop, 1) << "beta1 " << beta1 << " md " << md << " t " << t << ": " << got << " vs " << product;
        EXPECT_LE(d_torch, t) << "beta1 " << beta1 << " md " << md << " t " << t << ": " << got << " vs " << torch_product;
      }
    }
  std::printf("NAdam mu_product: %lld checked; at most %lld fp32 ulps from the double product, %lld from PyTorch's fp32 "
              "running product\n",
              static_cast<long long>(checked), static_cast<long long>(worst_loop), static_cast<long long>(worst_torch));
}

// The new rule kinds through the public UpdateProgram: a built-in's rules with their
// third parameter, their text, their values (UpdateProgram's eval is sf_eval_rule), and
// the parameter checks a custom program's rules get.
TEST(CudaScalarRules, NewRuleKindsCheckTheirParametersAndPrint) {
  using Kind = ScalarRule::Kind;
  constexpr double kInf = std::numeric_limits<double>::infinity(), kNaN = std::numeric_limits<double>::quiet_NaN();
  const UpdateProgram nadam = UpdateProgram::from_config(optim::NAdam{.lr = 0.01, .momentum_decay = 0.02});
  EXPECT_EQ(nadam.scalar("grad_coef").rule, (ScalarRule{Kind::nadam_grad_coef, 0.01, 0.9, 0.02}));
  EXPECT_EQ(nadam.scalar("momentum_coef").rule, (ScalarRule{Kind::nadam_momentum_coef, 0.01, 0.9, 0.02}));
  EXPECT_EQ(nadam.scalar("bias_correction2").rule, (ScalarRule{Kind::one_minus_pow, 0.0, 0.999}));
  EXPECT_THAT(nadam.text(), ::testing::HasSubstr("  grad_coef = nadam_grad_coef(lr 0.01, beta1 0.9, momentum_decay 0.02)\n"));
  const UpdateProgram radam = UpdateProgram::from_config(optim::RAdam{.beta2 = 0.9});
  EXPECT_THAT(radam.text(), ::testing::HasSubstr("  rect = radam_rect(beta2 0.9)\n"));
  EXPECT_EQ(radam.scalar("rect").rule.eval(5, 1.0), 0.0);  // rho_5 = 4.6
  EXPECT_GT(radam.scalar("rect").rule.eval(6, 1.0), 0.0);  // rho_6 = 5.4
  const UpdateProgram asgd = UpdateProgram::from_config(optim::ASGD{.lr = 0.1, .lambd = 0.5, .t0 = 3});
  EXPECT_EQ(asgd.scalar("mu").rule, (ScalarRule{Kind::asgd_mu, 3.0}));
  EXPECT_THAT(asgd.text(), ::testing::HasSubstr("  mu = step == 1 ? 1 : 1 / max(1, step - 1 - 3)\n"));
  EXPECT_THAT(asgd.text(), ::testing::HasSubstr("  eta = 0.1 / (1 + 0.5 * 0.1 * (step - 1))^0.75\n"));
  EXPECT_EQ(asgd.scalar("mu").rule.eval(1, 1.0), 1.0);
  EXPECT_EQ(asgd.scalar("mu").rule.eval(5, 1.0), 1.0);  // max(1, 5 - 1 - 3)
  EXPECT_EQ(asgd.scalar("mu").rule.eval(7, 1.0), 1.0 / 3.0);
  EXPECT_EQ(asgd.scalar("eta").rule.eval(1, 1.0), 0.1);
  EXPECT_EQ(asgd.scalar("decay").rule.eval(1, 1.0), 1.0 - 0.5 * static_cast<double>(0.1f));
  for (Kind k : {Kind::one_minus_pow, Kind::nadam_grad_coef, Kind::nadam_momentum_coef, Kind::radam_rect, Kind::asgd_eta,
                 Kind::asgd_decay, Kind::asgd_mu})
    EXPECT_NE(scalar_rule_name(k), "?");

  const auto bad = [&](const UpdateProgram& p, const char* scalar, ScalarRule r) {
    return ref::thrown_text([&] { (void)p.with_rule(scalar, r); }, ErrorCode::invalid_argument);
  };
  using ::testing::HasSubstr;
  EXPECT_THAT(bad(nadam, "grad_coef", {Kind::nadam_grad_coef, 0.01, 1.0, 0.02}),
              HasSubstr("scalar 'grad_coef' (rule nadam_grad_coef): beta1 b = 1 must be in [0, 1)"));
  EXPECT_THAT(bad(nadam, "momentum_coef", {Kind::nadam_momentum_coef, 0.01, 0.9, -1.0}),
              HasSubstr("the momentum decay c = -1 must be finite and >= 0"));
  EXPECT_THAT(bad(nadam, "grad_coef", {Kind::nadam_grad_coef, kInf, 0.9, 0.0}), HasSubstr("the learning rate a = inf"));
  EXPECT_THAT(bad(radam, "rect", {Kind::radam_rect, 0.0, 1.5}), HasSubstr("the base b = 1.5 must be in [0, 1)"));
  EXPECT_THAT(bad(radam, "bias_correction1", {Kind::one_minus_pow, 0.0, -0.5}), HasSubstr("the base b = -0.5"));
  EXPECT_THAT(bad(asgd, "eta", {Kind::asgd_eta, 0.1, -1.0, 0.75}), HasSubstr("a * b = 0.1 * -1 must be >= 0"));
  EXPECT_THAT(bad(asgd, "decay", {Kind::asgd_decay, 0.1, 0.5, kNaN}), HasSubstr("the exponent c = nan is not finite"));
  EXPECT_THAT(bad(asgd, "mu", {Kind::asgd_mu, kInf}), HasSubstr("t0 a = inf is not finite"));
}

}  // namespace
}  // namespace stepfuse
