// Inputs that a careless or hostile caller (or disk) can make: enum fields outside their
// enumerators wherever a program enters (Program/find_problem, UpdateProgram, the LLVM
// emitter, the C ABI), and a cached LLVM object that passes the cache's checks but does not
// link.
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
