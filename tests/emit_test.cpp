// The emit API (stepfuse/emit.hpp): the source, the binary and the ABI description of a
// spec's kernels, checked against what the emitter generates and the runtime plans:
//  - the ABI's parameter lists are the generated kernels' signatures, name for name;
//  - its struct sizes and field offsets are the C structs' (stepfuse/device_abi.h);
//  - the ABI header is the installed stepfuse/device_abi.h, byte for byte;
//  - plan_kernel_tables() gives the runtime's own layout for the same sizes;
//  - with NVRTC (no GPU needed), a CUBIN and PTX that hold both kernels;
//  - bad requests are errors that say why;
//  - a CPU target (LLVM backend): the IR defines the functions, the object is an ELF
//    relocatable whose symbol table has them, the ABI's layouts are cpu::UpdateArgs',
//    the header declares what the ABI lists, and (with a C compiler to link it) the
//    object, loaded as a shared library, steps bitwise as the library's own CPU step;
//    without LLVM, Error(unsupported) that says what to install.
// examples/run_emitted_cpu (a CTest test) links an emitted object into a C program.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <dlfcn.h>
#include <elf.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/cpu/kernels.hpp"
#include "reference/elf_reader.hpp"
#include "jit/cuda/cuda_layout.hpp"
#include "stepfuse/stepfuse.h"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

// A user's program: SGD without momentum, plus a convert (exercises every emitter path it needs).
UpdateProgram user_program() {
  ProgramBuilder b("rounded_sgd");
  const Stream g = b.stream("grad", StreamRole::grad), p = b.stream("param", StreamRole::param);
  const Value gs = b.scalar("gscale");
  const Value lr = b.scalar("lr");
  const Value step = b.mul(lr, b.mul(b.load(g), gs));
  b.store(p, b.convert(b.sub(b.load(p), step), DType::bf16));
  return UpdateProgram(b.build(), {UpdateProgram::gscale(), UpdateProgram::fixed("lr", 0.1)});
}

EmitRequest request(bool compile = false) {
  return EmitRequest{.program = user_program(),
                     .tensors = {{DType::bf16, DType::bf16, true}, {DType::f32, DType::f32, false}, {DType::bf16, DType::bf16, true}},
                     .aligned16 = true,
                     .target = EmitTarget::cubin(90),
                     .compile = compile};
}

// The parameter names of `kernel` as the generated source declares them.
std::vector<std::string> source_params(const std::string& source, const std::string& kernel) {
  const std::size_t at = source.find("\n" + kernel + "(");
  EXPECT_NE(at, std::string::npos) << kernel;
  const std::size_t open = source.find('(', at), close = source.find(')', open);
  std::string list = source.substr(open + 1, close - open - 1);
  std::vector<std::string> names;
  std::stringstream ss(list);
  for (std::string decl; std::getline(ss, decl, ',');) {
    const std::size_t end = decl.find_last_not_of(" \n");
    const std::size_t begin = decl.find_last_of(" *", end) + 1;
    names.push_back(decl.substr(begin, end - begin + 1));
  }
  return names;
}

TEST(Emit, SourceAndAbiDescribeTheSameKernels) {
  const EmittedKernel k = emit(request());
  EXPECT_TRUE(k.binary.empty());
  EXPECT_EQ(k.arch, "sm_90");
  EXPECT_EQ(k.kernel_names, (std::vector<std::string>{"sf_reduce", "sf_update"}));
  EXPECT_THAT(k.source, HasSubstr("extern \"C\" __global__"));
  const json abi = json::parse(k.abi);
  EXPECT_EQ(abi["format"], "stepfuse.kernel_abi");
  EXPECT_EQ(abi["format_version"], 1);
  EXPECT_EQ(abi["stepfuse_version"], version());
  ASSERT_EQ(abi["kernels"].size(), 2u);
  for (const json& kernel : abi["kernels"]) {
    std::vector<std::string> names;
    for (const json& p : kernel["params"]) names.push_back(p["name"]);
    EXPECT_EQ(names, source_params(k.source, kernel["name"])) << kernel["name"];
  }
  EXPECT_EQ(abi["kernels"][0]["block_threads"], 32 * SF_REDUCE_WARPS);
  EXPECT_EQ(abi["kernels"][1]["block_threads"], SF_UPDATE_THREADS);

  // The program and its rules; the spec.
  EXPECT_EQ(abi["program"]["name"], "rounded_sgd");
  EXPECT_EQ(abi["program"]["text"], to_string(user_program().program()));
  ASSERT_EQ(abi["program"]["scalars"].size(), 2u);
  EXPECT_EQ(abi["program"]["scalars"][0]["name"], "gscale");
  EXPECT_EQ(abi["program"]["scalars"][0]["kind"], SF_RULE_GSCALE);
  EXPECT_EQ(abi["program"]["scalars"][1]["rule"], "fixed");
  EXPECT_EQ(abi["program"]["scalars"][1]["a"], 0.1);
  EXPECT_EQ(abi["spec"]["tensor_combos"], json::parse("[0, 1, 0]"));
  EXPECT_EQ(abi["spec"]["combos"][0]["weight"], "bf16");
  EXPECT_EQ(abi["spec"]["combos"][0]["master"], true);
  EXPECT_EQ(abi["spec"]["aligned16"], true);
  EXPECT_EQ(abi["spec"]["norm"], "l2");
  EXPECT_EQ(abi["target"]["arch"], "sm_90");
  EXPECT_EQ(abi["target"]["nvrtc_options"][1], "--fmad=false");
  EXPECT_EQ(abi["constants"]["SF_CHUNK_ELEMS"], SF_CHUNK_ELEMS);

  // Struct layouts: the C structs' own.
  const json& types = abi["types"];
  EXPECT_EQ(types["sf_tensor"]["size"], sizeof(sf_tensor));
  EXPECT_EQ(types["sf_span"]["size"], sizeof(sf_span));
  EXPECT_EQ(types["sf_hyper"]["size"], sizeof(sf_hyper));
  EXPECT_EQ(types["sf_streams"]["size"], sizeof(sf_streams));
  EXPECT_EQ(types["sf_step_state"]["size"], sizeof(sf_step_state));
  const auto offset = [&](const char* type, const char* field) {
    for (const json& f : types[type]["fields"])
      if (f["name"] == field) return f["offset"].get<std::size_t>();
    ADD_FAILURE() << type << "." << field;
    return std::size_t{0};
  };
  EXPECT_EQ(offset("sf_tensor", "state_offset"), offsetof(sf_tensor, state_offset));
  EXPECT_EQ(offset("sf_tensor", "combo"), offsetof(sf_tensor, combo));
  EXPECT_EQ(offset("sf_span", "len"), offsetof(sf_span, len));
  EXPECT_EQ(offset("sf_hyper", "max_grad_norm"), offsetof(sf_hyper, max_grad_norm));
  EXPECT_EQ(offset("sf_step_state", "grad_norm"), offsetof(sf_step_state, grad_norm));
  EXPECT_EQ(offset("sf_tensor", "group"), offsetof(sf_tensor, group));
  EXPECT_EQ(offset("sf_hyper", "groups"), offsetof(sf_hyper, groups));
  EXPECT_EQ(offset("sf_hyper", "num_groups"), offsetof(sf_hyper, num_groups));
  EXPECT_EQ(offset("sf_group_rules", "step_base"), offsetof(sf_group_rules, step_base));
}

TEST(Emit, AbiHeaderIsThePublicDeviceAbiHeader) {
  const EmittedKernel k = emit(request());
  std::ifstream in(STEPFUSE_BINARY_DIR "/generated/include/stepfuse/device_abi.h", std::ios::binary);
  ASSERT_TRUE(in) << "the generated public header";
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(k.abi_header, text.str());
  // And the kernels embed the very same structs.
  EXPECT_THAT(k.source, HasSubstr("typedef struct sf_tensor {"));
}

TEST(Emit, BuiltinsEmitFromTheirConfig) {
  EmitRequest r = request();
  r.program = UpdateProgram::from_config(optim::AdamW{.lr = 3e-4});
  r.norm_type = INFINITY;
  r.flat = true;
  r.tensors = {{DType::f32, DType::f16, false}};
  const EmittedKernel k = emit(r);
  const json abi = json::parse(k.abi);
  EXPECT_EQ(abi["program"]["name"], "adam");
  EXPECT_EQ(abi["spec"]["flat"], true);
  EXPECT_EQ(abi["spec"]["norm"], "inf");
  EXPECT_THAT(k.source, HasSubstr("sf_update_span_0(&tensors[0], begin"));  // the flat dispatch
  bool found = false;
  for (const json& s : abi["program"]["scalars"])
    if (s["name"] == "step_size") found = s["rule"] == "div_one_minus_pow" && s["a"] == 3e-4 && s["b"] == 0.9;
  EXPECT_TRUE(found);
}

// The message of the Error emit(r) throws, checking its code ("" and a failure if none).
std::string message(const EmitRequest& r, ErrorCode code) {
  try {
    (void)emit(r);
  } catch (const Error& e) {
    EXPECT_EQ(error_code_name(e.code()), error_code_name(code)) << e.what();
    return std::string(e.what());
  }
  ADD_FAILURE() << "no Error";
  return std::string();
}

TEST(Emit, BadRequestsSayWhy) {
  EmitRequest r = request();
  r.flat = true;
  EXPECT_THAT(message(r, ErrorCode::invalid_argument), HasSubstr("flat = true needs every tensor"));
  r = request();
  r.tensors[1].master = true;
  EXPECT_THAT(message(r, ErrorCode::invalid_argument), HasSubstr("tensors[1].master is set with f32 weights"));
  r = request();
  r.tensors.clear();
  EXPECT_THAT(message(r, ErrorCode::invalid_argument), HasSubstr("tensors is empty"));
  r = request();
  r.norm_type = 1.0;
  EXPECT_THAT(message(r, ErrorCode::invalid_argument), HasSubstr("norm_type"));
  r = request();
  r.target.sm = 5;
  EXPECT_THAT(message(r, ErrorCode::invalid_argument), HasSubstr("target.sm = 5"));
}

TEST(Emit, TablesAreTheRuntimesLayout) {
  const std::vector<std::int64_t> numels = {40000, 5, 0, 16384};
  EmitRequest r = request();
  r.tensors.push_back({DType::f16, DType::f32, false});
  const KernelTables t = plan_kernel_tables(r, numels);

  // The runtime's planner over tensors with these sizes and storages (fake, aligned addresses).
  std::vector<Param> params;
  alignas(64) static char fake[4][64];
  for (std::size_t i = 0; i < numels.size(); ++i)
    params.push_back({{fake[i], numels[i], r.tensors[i].weight}, {fake[i] + 32, numels[i], r.tensors[i].grad}});
  OptimizerOptions o;
  o.master_weights = true;  // bf16 tensors have masters, f16 (index 3) would too: set it off by storage
  r.tensors[3].master = true;
  const KernelTables with_master = plan_kernel_tables(r, numels);
  const jit::CudaLayout l = jit::plan_cuda_layout(user_program().program(), params, o);
  ASSERT_EQ(with_master.tensors.size(), l.tensors.size());
  for (std::size_t i = 0; i < l.tensors.size(); ++i) {
    EXPECT_EQ(with_master.tensors[i].state_offset, l.tensors[i].state_offset) << i;
    EXPECT_EQ(with_master.tensors[i].first_chunk, l.tensors[i].first_chunk) << i;
    EXPECT_EQ(with_master.tensors[i].num_chunks, l.tensors[i].num_chunks) << i;
    EXPECT_EQ(with_master.tensors[i].combo, l.tensors[i].combo) << i;
    EXPECT_EQ(with_master.tensors[i].grad, nullptr);
  }
  EXPECT_EQ(with_master.master_offsets, l.layout.master_offsets);
  ASSERT_EQ(with_master.chunks.size(), l.chunks.size());
  for (std::size_t c = 0; c < l.chunks.size(); ++c)
    EXPECT_TRUE(with_master.chunks[c].begin == l.chunks[c].begin && with_master.chunks[c].len == l.chunks[c].len &&
                with_master.chunks[c].tensor == l.chunks[c].tensor);
  EXPECT_EQ(with_master.blocks.size(), l.blocks.size());
  EXPECT_EQ(with_master.state_elems, l.layout.state_elems);
  EXPECT_EQ(with_master.update_grid, static_cast<unsigned>(l.num_update_blocks));
  EXPECT_EQ(with_master.reduce_grid, static_cast<unsigned>(l.reduce_grid()));

  // Without the f16 master: its master offset is -1 and the master buffer is smaller.
  EXPECT_EQ(t.master_offsets[3], -1);
  EXPECT_EQ(t.master_elems, 40000 + 0);  // tensor 0 (40000) and tensor 2 (0 elements)
  EXPECT_EQ(t.partials_bytes, t.chunks.size() * sizeof(sf_partial));
  EXPECT_EQ(t.step_state_bytes, sizeof(sf_step_state));

  EmitRequest bad = request();
  EXPECT_THROW(plan_kernel_tables(bad, numels), Error);  // 3 tensors, 4 sizes
}

TEST(Emit, CompilesToCubinAndPtxWithoutAGpu) {
  if (const CudaStatus s = nvrtc_available(); !s) GTEST_SKIP() << "NVRTC not available: " << s.reason;
  const EmittedKernel cubin = emit(request(true));
  ASSERT_GE(cubin.binary.size(), 4u);
  EXPECT_EQ(cubin.binary.substr(0, 4), std::string("\x7f" "ELF"));
  EXPECT_NE(cubin.binary.find("sf_reduce"), std::string::npos);
  EXPECT_NE(cubin.binary.find("sf_update"), std::string::npos);
  EXPECT_NE(json::parse(cubin.abi)["target"]["nvrtc_version"], "");

  EmitRequest r = request(true);
  r.target = EmitTarget::ptx(80);
  const EmittedKernel ptx = emit(r);
  EXPECT_EQ(ptx.arch, "compute_80");
  EXPECT_THAT(ptx.binary, HasSubstr(".target sm_80"));
  EXPECT_THAT(ptx.binary, HasSubstr(".entry sf_reduce"));
  EXPECT_THAT(ptx.binary, HasSubstr(".entry sf_update"));
}

// ---- CPU targets (the LLVM backend) ---------------------------------------------------

bool have_llvm() { return llvm_version()[0] != '\0'; }

EmitRequest cpu_request(bool compile = true) {
  EmitRequest r = request(compile);
  r.target = EmitTarget::cpu();
  return r;
}

TEST(EmitCpu, IrObjectAbiAndHeaderDescribeTheSameFunctions) {
  if (!have_llvm()) GTEST_SKIP() << "built without LLVM";
  const EmittedKernel k = emit(cpu_request());
  // Combinations in first-use order, then grad dtypes in first-use order.
  const std::vector<std::string> names = {"sf_cpu_update_bf16_bf16_m", "sf_cpu_update_f32_f32", "sf_cpu_reduce_l2_bf16",
                                          "sf_cpu_reduce_l2_f32"};
  EXPECT_EQ(k.kernel_names, names);
  EXPECT_EQ(k.arch, llvm_cpu());
  EXPECT_THAT(k.source, HasSubstr("define void @sf_cpu_update_bf16_bf16_m(i8* "));
  EXPECT_THAT(k.source, HasSubstr("define void @sf_cpu_update_f32_f32(i8* "));
  EXPECT_THAT(k.source, HasSubstr("define float @sf_cpu_reduce_l2_bf16(i8* "));
  EXPECT_THAT(k.source, HasSubstr("define float @sf_cpu_reduce_l2_f32(i8* "));
  EXPECT_THAT(k.source, HasSubstr("\"target-cpu\"=\"" + k.arch + "\""));

  // The object: an ELF64 relocatable defining every function.
  const ref::ElfImage object = ref::read_elf(k.binary);
  ASSERT_EQ(object.problem, "") << k.binary.size() << " bytes";
  EXPECT_EQ(object.type, ET_REL);
  std::vector<std::string> defined = object.global_functions();
  std::sort(defined.begin(), defined.end());
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(defined, sorted);
  for (const std::string& u : object.undefined())  // libm's fmaf where the CPU has no FMA, nothing else
    EXPECT_TRUE(u == "fmaf") << "the object needs " << u;

  // The ABI: the functions in order, with declarations the header has verbatim.
  const json abi = json::parse(k.abi);
  EXPECT_EQ(abi["format"], "stepfuse.kernel_abi");
  EXPECT_EQ(abi["format_version"], 1);
  EXPECT_EQ(abi["target"]["kind"], "cpu");
  EXPECT_EQ(abi["target"]["cpu"], k.arch);
  EXPECT_EQ(abi["target"]["llvm_version"], llvm_version());
  EXPECT_THAT(abi["target"]["vector_width"].get<int>(), ::testing::AnyOf(4, 8, 16));
  ASSERT_EQ(abi["kernels"].size(), names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    const json& f = abi["kernels"][i];
    EXPECT_EQ(f["name"], names[i]);
    EXPECT_THAT(k.abi_header, HasSubstr(f["c_declaration"].get<std::string>()));
    EXPECT_EQ(f["params"].size(), 3u - (f["role"] == "reduce_l2"));
  }
  EXPECT_EQ(abi["kernels"][0]["c_declaration"],
            "void sf_cpu_update_bf16_bf16_m(const sf_cpu_update_args* args, uint64_t begin, uint64_t n);");
  EXPECT_EQ(abi["kernels"][3]["c_declaration"], "float sf_cpu_reduce_l2_f32(const void* grad, uint64_t n);");
  EXPECT_EQ(abi["spec"]["tensor_combos"], json::parse("[0, 1, 0]"));
  EXPECT_EQ(abi["spec"]["tensors"][1]["update"], "sf_cpu_update_f32_f32");
  EXPECT_EQ(abi["spec"]["tensors"][2]["reduce"], "sf_cpu_reduce_l2_bf16");
  EXPECT_EQ(abi["constants"]["SF_CPU_CHUNK_ELEMS"], cpu::kChunkElems);
  EXPECT_EQ(abi["program"]["scalars"][0]["kind"], SF_RULE_GSCALE);
  // The args struct: cpu::UpdateArgs, which the generated code reads.
  const json& args = abi["types"]["sf_cpu_update_args"];
  EXPECT_EQ(args["size"], sizeof(cpu::UpdateArgs));
  std::vector<std::size_t> offsets;
  for (const json& f : args["fields"]) offsets.push_back(f["offset"]);
  EXPECT_EQ(offsets, (std::vector<std::size_t>{offsetof(cpu::UpdateArgs, grad), offsetof(cpu::UpdateArgs, weight),
                                               offsetof(cpu::UpdateArgs, master), offsetof(cpu::UpdateArgs, state),
                                               offsetof(cpu::UpdateArgs, scalars), offsetof(cpu::UpdateArgs, norms),
                                               offsetof(cpu::UpdateArgs, sr_seed), offsetof(cpu::UpdateArgs, sr_step),
                                               offsetof(cpu::UpdateArgs, sr_base), offsetof(cpu::UpdateArgs, sr_bits)}));
  EXPECT_THAT(abi["reduce"]["combine"].get<std::string>(), HasSubstr("chunk order"));
  EXPECT_THAT(abi["threading"].get<std::string>(), HasSubstr("Chunks are independent"));
  EXPECT_THAT(k.abi_header, HasSubstr("typedef struct sf_cpu_update_args {"));
  EXPECT_THAT(k.abi_header, HasSubstr("#define SF_CPU_CHUNK_ELEMS 16384"));
  EXPECT_THAT(k.abi_header, HasSubstr("sf_eval_rule(const sf_scalar_rule* r"));

  // Without compile: the IR and the ABI only. The inf-norm has its own reduce functions.
  EmitRequest r = cpu_request(false);
  r.norm_type = INFINITY;
  const EmittedKernel ir_only = emit(r);
  EXPECT_TRUE(ir_only.binary.empty());
  EXPECT_THAT(ir_only.source, HasSubstr("define float @sf_cpu_reduce_inf_f32(i8* "));
  EXPECT_THAT(ir_only.abi_header, HasSubstr("float sf_cpu_reduce_inf_f32(const void* grad, uint64_t n, uint32_t* nonfinite);"));
}

TEST(EmitCpu, NamedCpusAndFeaturesSetTheVectorWidth) {
  if (!have_llvm()) GTEST_SKIP() << "built without LLVM";
#if !defined(__x86_64__)
  GTEST_SKIP() << "the CPU names below are x86-64's";
#endif
  const auto width = [](const EmittedKernel& k) { return json::parse(k.abi)["target"]["vector_width"].get<int>(); };
  EmitRequest r = cpu_request(false);
  r.target = EmitTarget::cpu("x86-64-v2");
  EmittedKernel k = emit(r);
  EXPECT_EQ(k.arch, "x86-64-v2");
  EXPECT_EQ(width(k), 4);
  EXPECT_THAT(k.source, HasSubstr("<4 x float>"));
  r.target = EmitTarget::cpu("haswell", "x86_64-pc-linux-gnu");
  k = emit(r);
  EXPECT_EQ(width(k), 8);
  EXPECT_EQ(json::parse(k.abi)["target"]["triple"], "x86_64-pc-linux-gnu");
  r.target = EmitTarget::cpu("skylake-avx512");
  r.compile = true;  // a CPU this machine may not have: compiling for it still works
  k = emit(r);
  EXPECT_EQ(width(k), 16);
  EXPECT_EQ(k.binary.substr(0, 4), std::string("\x7f" "ELF"));
  r.target = EmitTarget::cpu("skylake-avx512", "", "-avx512f");  // features over the CPU's own
  EXPECT_EQ(width(emit(r)), 8);
  r.target = EmitTarget::cpu("", "", "-avx");  // over the host's
  EXPECT_EQ(width(emit(r)), 4);

  // A program's fma on a CPU without FMA: a call to libm's fmaf, the one symbol an
  // object may need (the ABI says to link with -lm).
  ProgramBuilder b("fma_sgd");
  const Stream g = b.stream("grad", StreamRole::grad), p = b.stream("param", StreamRole::param);
  b.store(p, b.fma(b.load(g), b.scalar("neg_lr_gscale"), b.load(p)));
  r.program = UpdateProgram(b.build(), {UpdateProgram::gscale("neg_lr_gscale", -0.1)});
  r.target = EmitTarget::cpu("x86-64");
  EXPECT_EQ(ref::read_elf(emit(r).binary).undefined(), std::vector<std::string>{"fmaf"});
  r.target = EmitTarget::cpu("x86-64-v3");
  EXPECT_EQ(ref::read_elf(emit(r).binary).undefined(), std::vector<std::string>{});
}

TEST(EmitCpu, BadTargetsSayWhy) {
  EmitRequest r = cpu_request();
  if (!have_llvm()) {
    const std::string m = message(r, ErrorCode::unsupported);
    EXPECT_THAT(m, HasSubstr("needs the LLVM backend (not built)"));
    EXPECT_THAT(m, HasSubstr("install llvm-14-dev and rebuild"));
    return;
  }
  r.target = EmitTarget::cpu("no-such-cpu");
  EXPECT_THAT(message(r, ErrorCode::invalid_argument), HasSubstr("'no-such-cpu' is not a CPU LLVM knows"));
  r.target = EmitTarget::cpu("", "x86_64-pc-linux-gnu");
  EXPECT_THAT(message(r, ErrorCode::invalid_argument), HasSubstr("without a target.cpu_name"));
  r.target = EmitTarget::cpu("generic", "no-such-triple");
  EXPECT_THAT(message(r, ErrorCode::invalid_argument), HasSubstr("no target for triple 'no-such-triple'"));
  r = cpu_request();
  r.tensors[1].master = true;  // the request's own checks come first, as for CUDA
  EXPECT_THAT(message(r, ErrorCode::invalid_argument), HasSubstr("tensors[1].master is set with f32 weights"));
}

TEST(EmitCpu, CApiTakesTheCpuFields) {
  sf_emit_tensor tensors[2] = {{SF_BF16, SF_BF16, true}, {SF_F32, SF_F32, false}};
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_ADAMW);
  sf_emit_request req;
  sf_emit_request_init(&req);
  EXPECT_EQ(req.cpu_name, nullptr);
  req.config = &cfg;
  req.tensors = tensors;
  req.num_tensors = 2;
  req.target = SF_EMIT_CPU;
  req.compile = false;
  sf_emitted_kernel* k = nullptr;
  if (!have_llvm()) {
    EXPECT_EQ(sf_emit(&req, &k), SF_UNSUPPORTED);
    EXPECT_THAT(sf_last_error(), HasSubstr("install llvm-14-dev"));
    return;
  }
#if defined(__x86_64__)
  req.cpu_name = "x86-64-v3";
#endif
  ASSERT_EQ(sf_emit(&req, &k), SF_OK) << sf_last_error();
  const char* data = nullptr;
  std::size_t size = 0;
  ASSERT_EQ(sf_emitted_kernel_part(k, SF_EMITTED_KERNEL_NAMES, &data, &size), SF_OK);
  EXPECT_EQ(std::string(data, size),
            "sf_cpu_update_bf16_bf16_m\nsf_cpu_update_f32_f32\nsf_cpu_reduce_l2_bf16\nsf_cpu_reduce_l2_f32\n");
  ASSERT_EQ(sf_emitted_kernel_part(k, SF_EMITTED_ARCH, &data, &size), SF_OK);
#if defined(__x86_64__)
  EXPECT_STREQ(data, "x86-64-v3");
#endif
  ASSERT_EQ(sf_emitted_kernel_part(k, SF_EMITTED_SOURCE, &data, &size), SF_OK);
  EXPECT_THAT(data, HasSubstr("define void @sf_cpu_update_f32_f32("));
  ASSERT_EQ(sf_emitted_kernel_part(k, SF_EMITTED_ABI_HEADER, &data, &size), SF_OK);
  EXPECT_THAT(data, HasSubstr("typedef struct sf_cpu_update_args"));
  sf_emitted_kernel_destroy(k);

  // A request from the stepfuse.h before the cpu_* fields: read without them (host CPU).
  req.cpu_name = "no-such-cpu";  // beyond the old struct: not read
  req.struct_size = SF_EMIT_REQUEST_SIZE_V1;
  ASSERT_EQ(sf_emit(&req, &k), SF_OK) << sf_last_error();
  ASSERT_EQ(sf_emitted_kernel_part(k, SF_EMITTED_ARCH, &data, &size), SF_OK);
  EXPECT_STREQ(data, llvm_cpu());
  sf_emitted_kernel_destroy(k);
  req.struct_size = SF_EMIT_REQUEST_SIZE_V1 + 8;
  EXPECT_EQ(sf_emit(&req, &k), SF_INVALID_ARGUMENT);
  EXPECT_THAT(sf_last_error(), HasSubstr("struct_size"));
  req.struct_size = sizeof req;
  EXPECT_EQ(sf_emit(&req, &k), SF_INVALID_ARGUMENT);
  EXPECT_THAT(sf_last_error(), HasSubstr("'no-such-cpu' is not a CPU LLVM knows"));
}

// The emitted object, linked into a shared library by the system C compiler and
// loaded, run the way the ABI says (chunks, fp64 combine, scalar stage here), steps
// bitwise as the library's own CPU step. Needs a C compiler at test time (else skipped).
TEST(EmitCpu, LinkedObjectStepsBitwiseAsTheLibrary) {
  if (!have_llvm()) GTEST_SKIP() << "built without LLVM";
  if (std::system("cc --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "no C compiler (cc) to link the object";
  const optim::AdamW config{.lr = 1e-2, .weight_decay = 0.1};
  struct Tensor {
    std::int64_t numel;
    EmitTensor storage;
  };
  const std::vector<Tensor> list = {{40003, {DType::f32, DType::f32, false}},
                                    {16384 + 5, {DType::bf16, DType::bf16, true}},
                                    {37, {DType::f32, DType::f16, false}},
                                    {3, {DType::f16, DType::bf16, true}}};
  EmitRequest r{.program = UpdateProgram::from_config(config), .tensors = {}, .target = EmitTarget::cpu()};
  for (const Tensor& t : list) r.tensors.push_back(t.storage);
  const EmittedKernel k = emit(r);

  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("stepfuse_emit_test_" + std::to_string(std::random_device{}()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "step.o", std::ios::binary) << k.binary;
  const std::string so = (dir / "step.so").string();
  ASSERT_EQ(std::system(("cc -shared -o " + so + " " + (dir / "step.o").string() + " -lm").c_str()), 0);
  void* lib = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  using UpdateFn = void (*)(const cpu::UpdateArgs*, std::uint64_t, std::uint64_t);
  using ReduceFn = float (*)(const void*, std::uint64_t);
  const json abi = json::parse(k.abi);
  std::vector<UpdateFn> update;
  std::vector<ReduceFn> reduce;
  for (const json& t : abi["spec"]["tensors"]) {
    update.push_back(reinterpret_cast<UpdateFn>(dlsym(lib, t["update"].get<std::string>().c_str())));
    reduce.push_back(reinterpret_cast<ReduceFn>(dlsym(lib, t["reduce"].get<std::string>().c_str())));
    ASSERT_TRUE(update.back() && reduce.back()) << t;
  }

  // Two copies of every tensor: one the library steps, one the emitted functions step.
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<std::vector<char>> w_lib, w_emit, grads;
  std::vector<Param> params;
  for (const Tensor& t : list) {
    const std::size_t n = static_cast<std::size_t>(t.numel);
    std::vector<float> wf(n), gf(n);
    for (std::size_t i = 0; i < n; ++i) wf[i] = dist(rng), gf[i] = dist(rng) * 64.0f;
    w_lib.emplace_back(n * dtype_size(t.storage.weight));
    grads.emplace_back(n * dtype_size(t.storage.grad));
    from_float(wf, {w_lib.back().data(), t.numel, t.storage.weight});
    from_float(gf, {grads.back().data(), t.numel, t.storage.grad});
    w_emit.push_back(w_lib.back());
    params.push_back({{w_lib.back().data(), t.numel, t.storage.weight}, {grads.back().data(), t.numel, t.storage.grad}});
  }
  const double max_norm = 20.0, loss_scale = 64.0;
  Optimizer opt(config, params, OptimizerOptions{.max_grad_norm = max_norm, .cpu_backend = CpuBackend::highway});

  // The emitted side's memory: masters (the weights widened), state (init), scalars.
  const Program& p = r.program.program();
  std::vector<std::vector<float>> masters, states;
  std::vector<cpu::UpdateArgs> args(list.size());
  std::vector<float> scalars(kMaxScalars, NAN);
  for (std::size_t i = 0; i < list.size(); ++i) {
    const std::size_t n = static_cast<std::size_t>(list[i].numel);
    masters.emplace_back(list[i].storage.master ? n : 0);
    if (list[i].storage.master) to_float({w_emit[i].data(), list[i].numel, list[i].storage.weight}, masters[i]);
    args[i] = cpu::UpdateArgs{};
    args[i].grad = grads[i].data();
    args[i].weight = w_emit[i].data();
    args[i].master = list[i].storage.master ? masters[i].data() : nullptr;
    args[i].scalars = scalars.data();
    for (int s = 0; s < p.num_streams; ++s)
      if (p.streams[s].role == StreamRole::state) {
        states.emplace_back(n, p.streams[s].init);
        args[i].state[s] = states.back().data();
      }
  }
  std::vector<sf_scalar_rule> rules;
  for (const ScalarDef& d : r.program.scalars())
    rules.push_back({static_cast<int>(d.rule.kind), 0, d.rule.a, d.rule.b, d.rule.c, 0.0});

  for (int step = 1; step <= 3; ++step) {
    for (std::size_t i = 0; i < list.size(); ++i) {  // fresh gradients, the same for both sides
      std::vector<float> gf(static_cast<std::size_t>(list[i].numel));
      for (float& x : gf) x = dist(rng) * 64.0f;
      from_float(gf, {grads[i].data(), list[i].numel, list[i].storage.grad});
    }
    const StepResult lib_result = opt.step_scaled(loss_scale);
    ASSERT_TRUE(lib_result.applied);
    double total = 0;
    for (std::size_t i = 0; i < list.size(); ++i) {
      double acc = 0;  // chunks in order, then tensors in order
      for (std::int64_t b = 0; b < list[i].numel; b += cpu::kChunkElems) {
        const std::size_t len = static_cast<std::size_t>(std::min<std::int64_t>(cpu::kChunkElems, list[i].numel - b));
        const float partial = reduce[i](grads[i].data() + b * dtype_size(list[i].storage.grad), len);
        ASSERT_TRUE(std::isfinite(partial));
        acc += partial;
      }
      total += acc;
    }
    const double norm = std::sqrt(total) / loss_scale;
    EXPECT_EQ(norm, lib_result.grad_norm) << "step " << step;
    const double clip = std::min(1.0, max_norm / (norm + 1e-6));
    EXPECT_EQ(clip, lib_result.clip_coef);
    for (int s = 0; s < p.num_scalars; ++s) scalars[s] = static_cast<float>(sf_eval_rule(&rules[s], step, clip / loss_scale));
    for (std::size_t i = 0; i < list.size(); ++i)  // any split: here 1000 elements a call
      for (std::int64_t b = 0; b < list[i].numel; b += 1000)
        update[i](&args[i], static_cast<std::uint64_t>(b), static_cast<std::uint64_t>(std::min<std::int64_t>(1000, list[i].numel - b)));
    for (std::size_t i = 0; i < list.size(); ++i) {
      EXPECT_EQ(std::memcmp(w_lib[i].data(), w_emit[i].data(), w_lib[i].size()), 0) << "weights of " << i << ", step " << step;
      if (list[i].storage.master) {
        const std::span<const float> m = opt.master(i);
        ASSERT_EQ(m.size(), masters[i].size());
        EXPECT_EQ(std::memcmp(m.data(), masters[i].data(), m.size_bytes()), 0) << "masters of " << i;
      }
      for (const char* name : {"exp_avg", "exp_avg_sq"}) {
        const std::span<const float> v = opt.state(i, name);
        ASSERT_EQ(v.size(), static_cast<std::size_t>(list[i].numel));
        EXPECT_EQ(std::memcmp(v.data(), args[i].state[p.find_stream(name)], v.size_bytes()), 0) << name << " of " << i;
      }
    }
  }
  dlclose(lib);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace stepfuse
