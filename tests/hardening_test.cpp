// Inputs that a careless or hostile caller (or disk) can make: enum fields outside their
// enumerators wherever a program enters (Program/find_problem, UpdateProgram, the LLVM
// emitter, the C ABI), C ABI bool fields holding bytes other than 0 and 1, and a cached
// LLVM object that passes the cache's checks but does not link.
#include <gmock/gmock-matchers.h>  // header-only matchers: HasSubstr
#include <gtest/gtest.h>

#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "jit/kernel_cache.hpp"
#include "jit/llvm/cpu_jit.hpp"
#include "jit/llvm/emit_llvm.hpp"
#include "reference/test_util.hpp"
#include "stepfuse/stepfuse.h"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// This process's kernel cache is a fresh directory of its own, set before anything asks
// for the shared cache, and removed at exit.
struct PrivateCacheDir {
  std::filesystem::path path;
  PrivateCacheDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "stepfuse-hardening-XXXXXX").string();
    if (::mkdtemp(pattern.data()) != nullptr) {
      path = pattern;
      ::setenv("STEPFUSE_CACHE_DIR", (path / "cache").c_str(), 1);
    }
  }
  ~PrivateCacheDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
} g_cache_dir;

// ---- Enum fields of a program ---------------------------------------------------------

// SGD with a state stream and a convert, so that every enum-carrying field is present:
// stream roles, ops, a convert's dtype, scalar indexes.
Program sgd_with_state() {
  ProgramBuilder b("hard");
  const Stream g = b.stream("grad", StreamRole::grad);
  const Stream p = b.stream("param", StreamRole::param);
  const Stream m = b.stream("m", StreamRole::state);
  const Value gs = b.scalar("gscale");
  const Value lr = b.scalar("lr");
  const Value grad = b.mul(b.load(g), gs);
  const Value mo = b.convert(b.add(b.load(m), grad), DType::bf16);
  b.store(m, mo);
  b.store(p, b.sub(b.load(p), b.mul(lr, mo)));
  return b.build();
}
std::vector<ScalarDef> sgd_defs() { return {UpdateProgram::gscale(), UpdateProgram::fixed("lr", 0.1)}; }

int find_op(const Program& p, Op op) {
  for (int i = 0; i < p.num_instrs; ++i)
    if (p.code[i].op == op) return i;
  return -1;
}

// One program per bad enum field, and what the message must say about it.
struct BadProgram {
  const char* what;
  Program program;
  std::vector<const char*> says;
};

std::vector<BadProgram> bad_programs() {
  std::vector<BadProgram> out;
  const auto role_byte = [](std::uint8_t v) {
    StreamRole r;
    std::memcpy(&r, &v, 1);
    return r;
  };
  const auto op_byte = [](std::uint8_t v) {
    Op o;
    std::memcpy(&o, &v, 1);
    return o;
  };
  {
    Program p = sgd_with_state();
    p.streams[2].role = role_byte(7);
    out.push_back({"a state stream's role 7", p, {"unknown role", "stream 2 'm'", "role 7"}});
  }
  {
    Program p = sgd_with_state();
    p.streams[0].role = role_byte(3);  // the grad stream: also leaves no grad stream
    out.push_back({"the grad stream's role 3", p, {"unknown role", "stream 0 'grad'", "role 3"}});
  }
  {
    Program p = sgd_with_state();
    p.code[find_op(p, Op::add)].op = op_byte(kNumOps);
    out.push_back({"op kNumOps", p, {"unknown op"}});
  }
  {
    Program p = sgd_with_state();
    p.code[find_op(p, Op::add)].op = op_byte(255);
    out.push_back({"op 255", p, {"unknown op"}});
  }
  {
    Program p = sgd_with_state();
    p.code[find_op(p, Op::convert)].attr = 3;
    out.push_back({"convert to dtype 3", p, {"unknown dtype", "dtype 3"}});
  }
  {
    Program p = sgd_with_state();
    p.code[find_op(p, Op::add)].attr = 5;  // add takes no stream, scalar or dtype
    out.push_back({"attr 5 on add", p, {"attr is not 0", "(attr 5;"}});
  }
  {
    Program p = sgd_with_state();
    p.code[find_op(p, Op::sub)].attr = 1;
    out.push_back({"attr 1 on sub", p, {"attr is not 0", "(attr 1;"}});
  }
  return out;
}

TEST(EnumValidation, FindProblemRejectsEveryBadEnumField) {
  for (const BadProgram& bad : bad_programs()) {
    SCOPED_TRACE(bad.what);
    int where = -2;
    EXPECT_NE(find_problem(bad.program, &where), nullptr);
    const std::string msg = ref::thrown_text([&] { validate(bad.program); }, ErrorCode::invalid_argument);
    for (const char* s : bad.says) EXPECT_THAT(msg, HasSubstr(s));
  }
}

TEST(EnumValidation, UpdateProgramRejectsEveryBadEnumField) {
  for (const BadProgram& bad : bad_programs()) {
    SCOPED_TRACE(bad.what);
    const std::string msg =
        ref::thrown_text([&] { UpdateProgram(bad.program, sgd_defs()); }, ErrorCode::invalid_argument);
    for (const char* s : bad.says) EXPECT_THAT(msg, HasSubstr(s));
  }
  // A scalar rule kind outside ScalarRule::Kind.
  ScalarRule rule;
  const std::uint8_t bad_kind = 200;
  std::memcpy(&rule.kind, &bad_kind, 1);
  EXPECT_THAT(ref::thrown_text([&] { UpdateProgram(sgd_with_state(), {UpdateProgram::gscale(), {"lr", rule}}); },
                               ErrorCode::invalid_argument),
              AllOf(HasSubstr("'lr'"), HasSubstr("unknown rule kind 200")));
}

TEST(EnumValidation, LlvmEmitterRejectsEveryBadEnumField) {
  if (!jit::llvm_built()) GTEST_SKIP() << "this build has no LLVM backend";
  for (const BadProgram& bad : bad_programs()) {
    SCOPED_TRACE(bad.what);
    jit::CpuSpec spec;
    spec.program = bad.program;
    spec.combos = {{DType::f32, DType::f32, false}};
    spec.reduce_grads = {DType::f32};
    EXPECT_THAT(ref::thrown_text([&] { (void)jit::cpu_module_ir(spec, jit::CpuTarget::host(), false); },
                                 ErrorCode::invalid_argument),
                HasSubstr("LLVM emitter: invalid program"));
  }
}

// The C ABI reads every enum argument through its bytes and checks it at the call.
TEST(EnumValidation, CApiRejectsEveryBadEnumArgument) {
  sf_program_builder* b = nullptr;
  ASSERT_EQ(sf_program_builder_create("hard", &b), SF_OK);
  int stream = -1;
  sf_value v = 0;
  const auto as = [](int x, auto e) {
    std::memcpy(&e, &x, sizeof x);
    return e;
  };
  EXPECT_EQ(sf_program_builder_stream(b, "m", as(7, SF_ROLE_GRAD), 0.0f, &stream), SF_INVALID_ARGUMENT);
  EXPECT_THAT(sf_last_error(), AllOf(HasSubstr("role = 7"), HasSubstr("sf_stream_role")));
  EXPECT_EQ(sf_program_builder_stream(b, "m", as(-1, SF_ROLE_GRAD), 0.0f, &stream), SF_INVALID_ARGUMENT);
  EXPECT_THAT(sf_last_error(), HasSubstr("role = -1"));
  EXPECT_EQ(sf_program_builder_scalar(b, "lr", as(99, SF_SCALAR_FIXED), 0.1, 0.0, &v), SF_INVALID_ARGUMENT);
  EXPECT_THAT(sf_last_error(), AllOf(HasSubstr("rule = 99"), HasSubstr("sf_scalar_rule_kind")));
  ASSERT_EQ(sf_program_builder_stream(b, "grad", SF_ROLE_GRAD, 0.0f, &stream), SF_OK);
  sf_value g = 0;
  ASSERT_EQ(sf_program_builder_load(b, stream, &g), SF_OK);
  EXPECT_EQ(sf_program_builder_op(b, as(99, SF_OP_ADD), g, g, 0, &v), SF_INVALID_ARGUMENT);
  EXPECT_THAT(sf_last_error(), AllOf(HasSubstr("op = 99"), HasSubstr("sf_op")));
  EXPECT_EQ(sf_program_builder_op(b, as(0, SF_OP_ADD), g, g, 0, &v), SF_INVALID_ARGUMENT);  // SF_OP_ADD - 4: load
  EXPECT_THAT(sf_last_error(), HasSubstr("op = 0"));
  EXPECT_EQ(sf_program_builder_convert(b, g, as(3, SF_F32), &v), SF_INVALID_ARGUMENT);
  EXPECT_THAT(sf_last_error(), AllOf(HasSubstr("to = 3"), HasSubstr("sf_dtype")));
  sf_program_builder_destroy(b);
}

// ---- C ABI bools ---------------------------------------------------------------------------

// Stores `byte` in a bool field as a C caller can (memset, a char pointer, another
// compiler's bool): loading it as a C++ bool would be undefined.
void set_byte(bool& field, unsigned char byte) { std::memcpy(&field, &byte, 1); }

// A status and message: SF_INVALID_ARGUMENT naming "<field> = <byte>" and saying it is not a bool.
void expect_not_a_bool(sf_status status, const std::string& field, int byte) {
  EXPECT_EQ(status, SF_INVALID_ARGUMENT) << field;
  if (status != SF_OK) {
    EXPECT_THAT(sf_last_error(), AllOf(HasSubstr(field + " = " + std::to_string(byte)), HasSubstr("not a bool")));
  }
}

struct CModel {
  float w[5] = {1, 2, 3, 4, 5}, g[5] = {1, 1, 1, 1, 1};
  sf_param param{{w, 5, SF_F32}, {g, 5, SF_F32}};
};

TEST(CApiBools, OptionsBoolsAreReadAsBytesAndChecked) {
  struct Field {
    const char* name;
    bool sf_optimizer_options::*member;
  };
  const Field fields[] = {{"has_max_grad_norm", &sf_optimizer_options::has_max_grad_norm},
                          {"master_weights", &sf_optimizer_options::master_weights},
                          {"track_grad_norm", &sf_optimizer_options::track_grad_norm},
                          {"llvm_contract", &sf_optimizer_options::llvm_contract},
                          {"stochastic_rounding", &sf_optimizer_options::stochastic_rounding}};
  CModel m;
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_ADAMW);
  for (const Field& f : fields) {
    for (const unsigned char byte : {2, 255}) {
      SCOPED_TRACE(f.name);
      sf_optimizer_options o;
      sf_optimizer_options_init(&o);
      o.max_grad_norm = 1.0;
      set_byte(o.*f.member, byte);
      sf_optimizer* opt = nullptr;
      expect_not_a_bool(sf_optimizer_create(&cfg, &m.param, 1, &o, &opt), std::string("options->") + f.name, byte);
      EXPECT_EQ(opt, nullptr);
      sf_optimizer_destroy(opt);
    }
  }
  // 0 and 1 are fine, as always.
  sf_optimizer_options o;
  sf_optimizer_options_init(&o);
  set_byte(o.track_grad_norm, 1);
  set_byte(o.master_weights, 0);
  sf_optimizer* opt = nullptr;
  EXPECT_EQ(sf_optimizer_create(&cfg, &m.param, 1, &o, &opt), SF_OK) << sf_last_error();
  sf_optimizer_destroy(opt);
}

TEST(CApiBools, ConfigBoolsAreReadAsBytesAndChecked) {
  struct Case {
    sf_optimizer_kind kind;
    const char* name;
    bool sf_optimizer_config::*member;
  };
  const Case cases[] = {{SF_ADAM, "amsgrad", &sf_optimizer_config::amsgrad},
                        {SF_SGD, "nesterov", &sf_optimizer_config::nesterov},
                        {SF_RMSPROP, "centered", &sf_optimizer_config::centered},
                        {SF_ADAMW, "maximize", &sf_optimizer_config::maximize},
                        {SF_SGD, "amsgrad", &sf_optimizer_config::amsgrad},     // not SGD's: must be 0
                        {SF_ADAM, "centered", &sf_optimizer_config::centered}};  // not Adam's: must be 0
  CModel m;
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(sf_optimizer_kind_name(c.kind)) + "." + c.name);
    sf_optimizer_config cfg;
    sf_optimizer_config_init(&cfg, c.kind);
    if (c.kind == SF_SGD) cfg.momentum = 0.9;  // so nesterov = true would be valid
    set_byte(cfg.*c.member, 2);
    sf_optimizer* opt = nullptr;
    expect_not_a_bool(sf_optimizer_create(&cfg, &m.param, 1, nullptr, &opt), std::string("config->") + c.name, 2);
    sf_optimizer_destroy(opt);
  }
}

TEST(CApiBools, ScalerAndLossScaleBoolsAreReadAsBytesAndChecked) {
  sf_grad_scaler_options so;
  sf_grad_scaler_options_init(&so);
  so.device = "cpu";
  set_byte(so.enabled, 2);
  sf_grad_scaler* scaler = nullptr;
  expect_not_a_bool(sf_grad_scaler_create(&so, &scaler), "options->enabled", 2);
  sf_grad_scaler_destroy(scaler);
  scaler = nullptr;

  sf_grad_scaler_options_init(&so);
  so.device = "cpu";
  ASSERT_EQ(sf_grad_scaler_create(&so, &scaler), SF_OK) << sf_last_error();
  sf_grad_scaler_state st;
  sf_grad_scaler_state_init(&st);
  ASSERT_EQ(sf_grad_scaler_state_dict(scaler, &st), SF_OK) << sf_last_error();
  set_byte(st.empty, 3);
  expect_not_a_bool(sf_grad_scaler_load_state_dict(scaler, &st), "state->empty", 3);
  sf_grad_scaler_destroy(scaler);

  CModel m;
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_SGD);
  sf_optimizer* opt = nullptr;
  ASSERT_EQ(sf_optimizer_create(&cfg, &m.param, 1, nullptr, &opt), SF_OK) << sf_last_error();
  sf_loss_scale_optimizer_options lo;
  sf_loss_scale_optimizer_options_init(&lo);
  set_byte(lo.dynamic, 2);
  sf_loss_scale_optimizer* lso = nullptr;
  expect_not_a_bool(sf_loss_scale_optimizer_create(opt, &lo, &lso), "options->dynamic", 2);
  sf_loss_scale_optimizer_destroy(lso);
  sf_optimizer_destroy(opt);
}

TEST(CApiBools, EmitRequestBoolsAreReadAsBytesAndChecked) {
  sf_optimizer_config cfg;
  sf_optimizer_config_init(&cfg, SF_ADAMW);
  sf_emit_tensor tensor{SF_BF16, SF_BF16, true};
  const auto request = [&] {
    sf_emit_request r;
    sf_emit_request_init(&r);
    r.config = &cfg;
    r.tensors = &tensor;
    r.num_tensors = 1;
    r.compile = false;  // source and ABI only: no NVRTC needed
    return r;
  };
  {
    sf_emit_request r = request();
    set_byte(r.flat, 2);
    sf_emitted_kernel* k = nullptr;
    expect_not_a_bool(sf_emit(&r, &k), "request->flat", 2);
    sf_emitted_kernel_destroy(k);
  }
  {
    sf_emit_request r = request();
    set_byte(r.aligned16, 4);
    sf_emitted_kernel* k = nullptr;
    expect_not_a_bool(sf_emit(&r, &k), "request->aligned16", 4);
    sf_emitted_kernel_destroy(k);
  }
  {
    sf_emit_request r = request();
    set_byte(r.compile, 2);
    sf_emitted_kernel* k = nullptr;
    expect_not_a_bool(sf_emit(&r, &k), "request->compile", 2);
    sf_emitted_kernel_destroy(k);
  }
  {
    sf_emit_request r = request();
    set_byte(tensor.master, 2);
    sf_emitted_kernel* k = nullptr;
    expect_not_a_bool(sf_emit(&r, &k), "request->tensors[0].master", 2);
    sf_emitted_kernel_destroy(k);
    tensor.master = true;
  }
  sf_emit_request r = request();
  sf_emitted_kernel* k = nullptr;
  EXPECT_EQ(sf_emit(&r, &k), SF_OK) << sf_last_error();
  sf_emitted_kernel_destroy(k);
}

// ---- Cached objects that do not link ---------------------------------------------------

jit::CpuSpec spec_of(const Program& p, DType weight) {
  jit::CpuSpec spec;
  spec.program = p;
  spec.combos = {{weight, weight, weight != DType::f32}};
  spec.reduce_grads = {weight};
  return spec;
}

// An entry whose checksum and key are right but whose bytes do not link (a garbage
// object, or another spec's object without this spec's symbols): before, every later
// cpu_kernels() loaded it again and failed, so CpuBackend::llvm failed for good.
TEST(CacheEviction, CachedObjectThatDoesNotLinkIsEvictedAndRecompiled) {
  if (!jit::llvm_built()) GTEST_SKIP() << "this build has no LLVM backend";
  jit::KernelCache& cache = jit::KernelCache::shared();
  ASSERT_TRUE(cache.disk_enabled());
  ASSERT_TRUE(cache.dir().has_value());
  const jit::CpuTarget host = jit::CpuTarget::host();
  Program p = sgd_with_state();
  struct Case {
    const char* what;
    std::string bytes;
    DType weight;
  };
  const jit::CpuSpec other = spec_of(p, DType::bf16);  // other symbols: sf_cpu_update_bf16_bf16_m
  const std::vector<Case> cases = {{"not an object", "not an object at all", DType::f32},
                                   {"another spec's object", jit::cpu_compile_object(other, host, jit::CpuObjectKind::jit),
                                    DType::f16}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const jit::CpuSpec spec = spec_of(p, c.weight);
    const std::string key = jit::cpu_cache_key(spec, host);
    {
      jit::KernelCache planter(*cache.dir());  // written as the cache writes entries
      planter.get(key, [&] { return c.bytes; });
    }
    std::shared_ptr<const jit::CpuKernels> k;
    EXPECT_NO_THROW(k = jit::cpu_kernels(spec));
    ASSERT_NE(k, nullptr);
    EXPECT_EQ(k->source, jit::CpuKernels::Source::compiled);
    EXPECT_EQ(k->update.size(), 1u);
    jit::KernelCache reader(*cache.dir());
    const auto now = reader.find_or_load(key);
    ASSERT_NE(now, nullptr) << "the recompiled object is cached again";
    EXPECT_EQ(now->compare(0, 4, "\x7f" "ELF"), 0) << "the entry now holds an object file";
  }
}

}  // namespace
}  // namespace stepfuse
