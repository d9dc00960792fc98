// The emit API (stepfuse/emit.hpp): the source, the binary and the ABI description of a
// spec's kernels, checked against what the emitter generates and the runtime plans:
//  - the ABI's parameter lists are the generated kernels' signatures, name for name;
//  - its struct sizes and field offsets are the C structs' (stepfuse/device_abi.h);
//  - the ABI header is the installed stepfuse/device_abi.h, byte for byte;
//  - plan_kernel_tables() gives the runtime's own layout for the same sizes;
//  - with NVRTC (no GPU needed), a CUBIN and PTX that hold both kernels;
//  - bad requests and a CPU target are errors that say why.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstddef>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/cuda/cuda_layout.hpp"
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
  EXPECT_EQ(offset("sf_step_state", "scalars"), offsetof(sf_step_state, scalars));
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

TEST(Emit, BadRequestsSayWhy) {
  const auto message = [](const EmitRequest& r, ErrorCode code) {
    try {
      (void)emit(r);
    } catch (const Error& e) {
      EXPECT_EQ(error_code_name(e.code()), error_code_name(code)) << e.what();
      return std::string(e.what());
    }
    ADD_FAILURE() << "no Error";
    return std::string();
  };
  EmitRequest r = request();
  r.target = EmitTarget::cpu();
  EXPECT_THAT(message(r, ErrorCode::unsupported), HasSubstr("needs the LLVM backend (not built)"));
  r = request();
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
  const detail::CudaLayout l = detail::plan_cuda_layout(user_program().program(), params, o);
  ASSERT_EQ(with_master.tensors.size(), l.tensors.size());
  for (std::size_t i = 0; i < l.tensors.size(); ++i) {
    EXPECT_EQ(with_master.tensors[i].state_offset, l.tensors[i].state_offset) << i;
    EXPECT_EQ(with_master.tensors[i].first_chunk, l.tensors[i].first_chunk) << i;
    EXPECT_EQ(with_master.tensors[i].num_chunks, l.tensors[i].num_chunks) << i;
    EXPECT_EQ(with_master.tensors[i].combo, l.tensors[i].combo) << i;
    EXPECT_EQ(with_master.tensors[i].grad, nullptr);
  }
  EXPECT_EQ(with_master.master_offsets, l.master_offsets);
  ASSERT_EQ(with_master.chunks.size(), l.chunks.size());
  for (std::size_t c = 0; c < l.chunks.size(); ++c)
    EXPECT_TRUE(with_master.chunks[c].begin == l.chunks[c].begin && with_master.chunks[c].len == l.chunks[c].len &&
                with_master.chunks[c].tensor == l.chunks[c].tensor);
  EXPECT_EQ(with_master.blocks.size(), l.blocks.size());
  EXPECT_EQ(with_master.state_elems, l.state_elems);
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

}  // namespace
}  // namespace stepfuse
