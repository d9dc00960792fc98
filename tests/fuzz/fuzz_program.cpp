// fuzz_program: custom update programs, through the C ABI's program builder and as raw
// stepfuse::Program structs.
//
// Byte 0 even: "builder" mode (with bits 1 and 2 both set, the LLVM backend's steps too). The rest is a sequence of sf_program_builder_* calls
// (decoded by Reader below: a command byte, then its arguments). Every call must return
// SF_OK or SF_INVALID_ARGUMENT. A program that builds is
//   - stepped twice with SF_FUSION_INTERPRETED and twice with SF_FUSION_UNFUSED on the
//     same tensors (f32, bf16 with masters, f16 weights with f32 gradients) and the same
//     gradients, with a loss scale of 1 and no clipping (the gradient multiplier is then
//     exactly 1 in both; otherwise the unfused baseline agrees only within fp32 rounding,
//     docs/architecture.md): applied/found_inf, weights, masters and every state must be
//     bitwise equal (both run the same scalar ops; NaNs compare by bits);
//   - a quarter of the time (byte 0's bits 1 and 2), stepped with the LLVM backend
//     (SF_CPU_BACKEND_LLVM, compiled by ORC): bitwise equal to the interpreted steps;
//   - emitted as an LLVM module (jit::cpu_module_ir, which runs LLVM's verifier on what
//     the emitter wrote): it must be accepted.
// Byte 0 odd: "raw" mode. The rest fills a stepfuse::Program (counts, roles, ops,
// attributes and operands as raw bytes, enums out of range included; names from a
// fixed table) that goes to find_problem(), validate() and UpdateProgram's constructor:
// validate() and the constructor throw stepfuse::Error (nothing else) exactly when
// find_problem() finds a problem, and never crash.
//
// STEPFUSE_FUZZ_WRITE_SEEDS=<dir>: writes the seed corpus into <dir> and exits.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "jit/kernel_cache.hpp"
#include "jit/llvm/emit_llvm.hpp"
#include "runtime/c_api_support.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/program.hpp"
#include "stepfuse/stepfuse.h"
#include "stepfuse/update_program.hpp"

namespace sf = stepfuse;

namespace {

[[noreturn]] void oracle_failed(const std::string& what) {
  std::fprintf(stderr, "fuzz_program: ORACLE FAILED: %s\n", what.c_str());
  std::abort();
}

void expect_status(sf_status s, const char* call) {
  if (s != SF_OK && s != SF_INVALID_ARGUMENT)
    oracle_failed(std::string(call) + " returned " + sf_status_name(s) + ": " + sf_last_error());
}

struct Reader {
  const std::uint8_t* p;
  std::size_t n;
  bool empty() const { return n == 0; }
  std::uint8_t u8() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
  float f32() {
    static constexpr float kTable[] = {0.0f, 1.0f, -1.0f, 0.5f, 0.9f, 0.999f, 1e-8f, 2.0f,
                                       -0.0f, 1e30f, INFINITY, NAN, 3.0f, 0.1f, 1e-3f, 100.0f};
    const std::uint8_t b = u8();
    if (b < 240) return kTable[b % 16];
    std::uint32_t bits = 0;
    for (int i = 0; i < 4; ++i) bits = bits << 8 | u8();
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  double f64() { return f32(); }
};

constexpr const char* kNames[] = {"g", "p", "m", "v", "lr", "gscale", "beta", "eps", "x1", "", "1bad", "a-b"};
const char* name(Reader& r) { return kNames[r.u8() % std::size(kNames)]; }

// Decodes builder calls; returns the built program or null.
sf_program* build(Reader& r) {
  sf_program_builder* b = nullptr;
  expect_status(sf_program_builder_create("fuzz", &b), "sf_program_builder_create");
  if (b == nullptr) oracle_failed("sf_program_builder_create gave no builder");
  std::vector<sf_value> values;
  const auto value = [&]() -> sf_value {
    const std::uint8_t v = r.u8();
    if (v >= 250 || values.empty()) return v;  // possibly undefined: the builder must refuse it
    return values[v % values.size()];
  };
  for (int calls = 0; !r.empty() && calls < 200; ++calls) {
    const std::uint8_t cmd = r.u8();
    sf_value out = 0;
    sf_status s = SF_OK;
    switch (cmd % 10) {
      case 0: {
        int stream = -1;
        const char* n = name(r);
        const auto role = static_cast<sf_stream_role>(r.u8() % 4);  // 3: out of range
        expect_status(sf_program_builder_stream(b, n, role, r.f32(), &stream), "sf_program_builder_stream");
        s = SF_INVALID_ARGUMENT;  // no value
        break;
      }
      case 1: {
        const char* n = name(r);
        const auto rule = static_cast<sf_scalar_rule_kind>(r.u8() % 14);  // 13: out of range
        const double a = r.f64(), bb = r.f64(), c = r.f64();
        s = sf_program_builder_scalar3(b, n, rule, a, bb, c, &out);
        expect_status(s, "sf_program_builder_scalar3");
        break;
      }
      case 2:
        s = sf_program_builder_load(b, static_cast<int>(r.u8() % 10) - 1, &out);
        expect_status(s, "sf_program_builder_load");
        break;
      case 3: {
        const int stream = static_cast<int>(r.u8() % 10) - 1;
        s = sf_program_builder_store(b, stream, value());
        expect_status(s, "sf_program_builder_store");
        s = SF_INVALID_ARGUMENT;  // no value
        break;
      }
      case 4:
        s = sf_program_builder_constant(b, r.f32(), &out);
        expect_status(s, "sf_program_builder_constant");
        break;
      case 5: {
        const auto op = static_cast<sf_op>(r.u8() % 18 + 2);  // 2, 3 and 19: not value ops
        const sf_value x = value(), y = value(), z = value();
        s = sf_program_builder_op(b, op, x, y, z, &out);
        expect_status(s, "sf_program_builder_op");
        break;
      }
      case 6: {
        const sf_value x = value();
        s = sf_program_builder_convert(b, x, static_cast<sf_dtype>(r.u8() % 4), &out);
        expect_status(s, "sf_program_builder_convert");
        break;
      }
      case 7:
        expect_status(sf_program_builder_phase(b), "sf_program_builder_phase");
        s = SF_INVALID_ARGUMENT;
        break;
      case 8: {
        const int slot = static_cast<int>(r.u8() % 6) - 1;
        expect_status(sf_program_builder_reduce_sumsq(b, slot, value()), "sf_program_builder_reduce_sumsq");
        s = SF_INVALID_ARGUMENT;
        break;
      }
      case 9:
        s = sf_program_builder_tensor_norm(b, static_cast<int>(r.u8() % 6) - 1, &out);
        expect_status(s, "sf_program_builder_tensor_norm");
        break;
    }
    if (s == SF_OK) values.push_back(out);
  }
  sf_program* program = nullptr;
  const sf_status s = sf_program_builder_build(b, &program);
  expect_status(s, "sf_program_builder_build");
  if (std::getenv("STEPFUSE_FUZZ_DEBUG")) std::fprintf(stderr, "build: %s\n", s == SF_OK ? "built" : sf_last_error());
  sf_program_builder_destroy(b);
  if (s == SF_OK && program == nullptr) oracle_failed("sf_program_builder_build: SF_OK without a program");
  return s == SF_OK ? program : nullptr;
}

// Tensors of three storage kinds with fixed contents.
struct Tensors {
  std::vector<float> w0{0.5f, -1.0f, 2.0f, 0.0f, -0.25f, 3.0f, 1e-3f}, g0{0.25f, -0.5f, 1.0f, 0.0f, 8.0f, -3.0f, 0.1f};
  std::vector<std::uint16_t> w1, g1, w2;
  std::vector<float> g2{1.0f, -2.0f, 0.5f};
  Tensors() {
    for (int i = 0; i < 9; ++i) {
      w1.push_back(sf_float_to_bf16(0.1f * static_cast<float>(i) - 0.4f));
      g1.push_back(sf_float_to_bf16(0.3f * static_cast<float>(i % 4) - 0.5f));
    }
    for (int i = 0; i < 3; ++i) w2.push_back(sf_float_to_f16(0.75f * static_cast<float>(i) - 1.0f));
  }
  std::vector<sf_param> params() {
    return {{{w0.data(), 7, SF_F32}, {g0.data(), 7, SF_F32}},
            {{w1.data(), 9, SF_BF16}, {g1.data(), 9, SF_BF16}},
            {{w2.data(), 3, SF_F16}, {g2.data(), 3, SF_F32}}};
  }
};

// The results' bytes, with every NaN written as one canonical NaN of its format: the
// numerics contract (docs/architecture.md §5) leaves a NaN's sign and payload open (x86
// makes 0/0 a negative NaN, CUDA a positive one, and LLVM folds NaN constants its own
// way), and every other bit equal.
void append_f32(std::string& out, const float* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, p + i, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) bits = 0x7fc00000u;
    out.append(reinterpret_cast<const char*>(&bits), 4);
  }
}
void append_16(std::string& out, const std::uint16_t* p, std::size_t n, sf_dtype dtype) {
  const std::uint16_t inf = dtype == SF_BF16 ? 0x7f80 : 0x7c00, nan = dtype == SF_BF16 ? 0x7fc0 : 0x7e00;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t bits = p[i];
    if ((bits & 0x7fff) > inf) bits = nan;
    out.append(reinterpret_cast<const char*>(&bits), 2);
  }
}

// Creates an optimizer with `fusion`, steps it twice and returns everything it wrote as
// bytes; empty when the optimizer refuses the program (then both modes must refuse it).
std::string run(const sf_program* program, sf_fusion fusion, sf_status* created,
                sf_cpu_backend backend = SF_CPU_BACKEND_HIGHWAY) {
  Tensors t;
  const std::vector<sf_param> params = t.params();
  sf_optimizer_options o;
  sf_optimizer_options_init(&o);
  o.fusion = fusion;
  o.cpu_backend = backend;
  o.num_threads = 1;
  sf_optimizer* opt = nullptr;
  *created = sf_optimizer_create_custom(program, params.data(), params.size(), &o, &opt);
  if (*created != SF_OK) {
    if (*created != SF_INVALID_ARGUMENT)
      oracle_failed(std::string("sf_optimizer_create_custom: ") + sf_status_name(*created) + ": " + sf_last_error());
    return {};
  }
  std::string out;
  // A loss scale of 1 and no clipping: the gradient multiplier is exactly 1 in both
  // modes. (With another scale or clipping the unfused baseline rounds its multipliers
  // separately and agrees only within fp32 rounding, docs/architecture.md; so does the
  // gradient norm it computes in a pass of its own, which is not compared.)
  for (int step = 0; step < 2; ++step) {
    sf_step_result r;
    sf_step_result_init(&r);
    const sf_status s = sf_optimizer_step_scaled(opt, 1.0, &r);
    if (s != SF_OK) oracle_failed(std::string("sf_optimizer_step_scaled: ") + sf_status_name(s) + ": " + sf_last_error());
    out += r.applied ? 'A' : 'a';
    out += r.found_inf ? 'I' : 'i';
  }
  append_f32(out, t.w0.data(), t.w0.size());
  append_16(out, t.w1.data(), t.w1.size(), SF_BF16);
  append_16(out, t.w2.data(), t.w2.size(), SF_F16);
  size_t names = 0;
  if (sf_optimizer_state_names(opt, &names) != SF_OK) oracle_failed("sf_optimizer_state_names");
  for (size_t p = 0; p < params.size(); ++p) {
    for (size_t i = 0; i < names; ++i) {
      const char* n = nullptr;
      if (sf_optimizer_state_name(opt, i, &n) != SF_OK) oracle_failed("sf_optimizer_state_name");
      const float* data = nullptr;
      int64_t numel = 0;
      if (sf_optimizer_state(opt, p, n, &data, &numel) != SF_OK) oracle_failed("sf_optimizer_state");
      out += n;
      append_f32(out, data, static_cast<std::size_t>(numel));
    }
    const float* data = nullptr;
    int64_t numel = 0;
    if (sf_optimizer_master(opt, p, &data, &numel) != SF_OK) oracle_failed("sf_optimizer_master");
    append_f32(out, data, static_cast<std::size_t>(numel));
  }
  sf_optimizer_destroy(opt);
  return out;
}

// Before an oracle failure on two results: the program's text and the first byte where
// the results differ (of the layout run() writes), to start the triage from.
void report_difference(const sf_program* program, const std::string& a, const std::string& b) {
  std::size_t needed = 0;
  std::string text;
  if (sf_program_text(program, nullptr, 0, &needed) == SF_OK) {
    text.resize(needed);
    if (sf_program_text(program, text.data(), text.size(), &needed) != SF_OK) text.clear();
  }
  std::size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  std::fprintf(stderr, "fuzz_program: program:\n%s\nfuzz_program: results of %zu and %zu bytes, first difference at byte %zu\n",
               text.c_str(), a.size(), b.size(), i);
  // The 4 bytes around it as f32 (most of the results are f32; the layout is run()'s).
  for (std::size_t at = i & ~std::size_t{3}; at + 4 <= a.size() && at + 4 <= b.size() && at < i + 8; at += 4) {
    float x, y;
    std::memcpy(&x, a.data() + at, 4);
    std::memcpy(&y, b.data() + at, 4);
    std::fprintf(stderr, "fuzz_program:   bytes %zu..%zu as f32: %.9g vs %.9g\n", at, at + 3, x, y);
  }
}

void check_program(const sf_program* program, bool with_llvm) {
  sf_status ci = SF_OK, cu = SF_OK;
  const std::string interpreted = run(program, SF_FUSION_INTERPRETED, &ci);
  const std::string unfused = run(program, SF_FUSION_UNFUSED, &cu);
  if (ci != cu) oracle_failed("the interpreted and the unfused optimizer disagree on whether the program is usable");
  if (interpreted != unfused) {
    report_difference(program, interpreted, unfused);
    oracle_failed("interpreted and unfused steps differ");
  }
  if (with_llvm) {
    // The LLVM backend computes bitwise what the interpreter computes (without
    // llvm_contract). Compiled anew for each program: the process-wide kernel cache is
    // emptied after each, so a long run does not fill memory with objects.
    sf_status cl = SF_OK;
    const std::string llvm = run(program, SF_FUSION_FUSED, &cl, SF_CPU_BACKEND_LLVM);
    sf::jit::KernelCache::shared().clear_memory();
    if (cl != ci) oracle_failed("the LLVM backend and the interpreter disagree on whether the program is usable");
    if (llvm != interpreted) {
      report_difference(program, llvm, interpreted);
      oracle_failed("LLVM-compiled and interpreted steps differ");
    }
  }

  sf::jit::CpuSpec spec;
  spec.program = program->program.program();
  spec.combos = {{sf::DType::f32, sf::DType::f32, false},
                 {sf::DType::bf16, sf::DType::bf16, true},
                 {sf::DType::f16, sf::DType::f32, false}};
  spec.reduce_grads = {sf::DType::f32, sf::DType::bf16};
  try {
    const std::string ir = sf::jit::cpu_module_ir(spec, sf::jit::CpuTarget::host(), /*optimized=*/false);
    if (ir.empty()) oracle_failed("the LLVM emitter wrote an empty module");
  } catch (const std::exception& e) {
    oracle_failed(std::string("the LLVM emitter refused a valid program: ") + e.what());
  }
}

void check_raw(Reader& r) {
  static constexpr std::string_view kRawNames[] = {"g", "p", "m", "lr", "gscale", "", "1x", "a b", "m"};
  sf::Program p;
  p.name = kRawNames[r.u8() % 3];
  p.num_streams = r.u8();
  p.num_scalars = r.u8();
  p.num_instrs = static_cast<std::uint16_t>(r.u8() | (r.u8() << 8));
  for (auto& s : p.streams) {
    s.name = kRawNames[r.u8() % std::size(kRawNames)];
    const std::uint8_t role = r.u8();
    std::memcpy(&s.role, &role, 1);
    s.init = r.f32();
  }
  for (auto& s : p.scalars) s = kRawNames[r.u8() % std::size(kRawNames)];
  for (auto& in : p.code) {
    if (r.empty()) break;
    const std::uint8_t op = r.u8();
    std::memcpy(&in.op, &op, 1);
    in.attr = r.u8();
    in.a = r.u8();
    in.b = r.u8();
    in.c = r.u8();
    in.imm = r.f32();
  }
  int where = -2;
  const char* problem = sf::find_problem(p, &where);
  bool threw = false;
  try {
    sf::validate(p);
  } catch (const sf::Error&) {
    threw = true;
  }
  if (threw != (problem != nullptr)) oracle_failed("validate() and find_problem() disagree");
  std::vector<sf::ScalarDef> defs;
  const int scalars = p.num_scalars <= sf::kMaxScalars ? p.num_scalars : 0;
  for (int i = 0; i < scalars; ++i) {
    const bool gs = p.scalars[i] == "gscale";
    defs.push_back(gs ? sf::UpdateProgram::gscale("gscale") : sf::UpdateProgram::fixed(std::string(p.scalars[i]), 0.5));
  }
  try {
    const sf::UpdateProgram program(p, defs);
    if (problem != nullptr) oracle_failed(std::string("UpdateProgram accepted a program with a problem: ") + problem);
  } catch (const sf::Error&) {
  }
}

// ---- the seed corpus ----

struct Encoder {
  std::string s;
  Encoder& b(int v) {
    s += static_cast<char>(v);
    return *this;
  }
  Encoder& stream(int name, int role, int init) { return b(0).b(name).b(role).b(init); }
  Encoder& scalar(int name, int rule, int a, int bb, int c) { return b(1).b(name).b(rule).b(a).b(bb).b(c); }
  Encoder& load(int stream) { return b(2).b(stream + 1); }
  Encoder& store(int stream, int value) { return b(3).b(stream + 1).b(value); }
  Encoder& op(int op, int x, int y, int z) { return b(5).b(op - 2).b(x).b(y).b(z); }
};

void write_seeds(const char* dir) {
  const auto put = [&](const std::string& name, const std::string& body) {
    std::ofstream(std::string(dir) + "/" + name, std::ios::binary) << body;
    if (name.starts_with("builder_")) {  // the same with the LLVM backend
      std::string llvm = body;
      llvm[0] = 6;
      std::ofstream(std::string(dir) + "/" + name + "_llvm", std::ios::binary) << llvm;
    }
  };
  // Names: 0 g, 1 p, 2 m, 4 lr, 5 gscale. Floats (table): 0 0.0, 1 1.0, 4 0.9, 14 1e-3.
  // Value ids below are indexes into the values made so far.
  Encoder sgd;
  sgd.b(0)
      .stream(0, SF_ROLE_GRAD, 0)
      .stream(1, SF_ROLE_PARAM, 0)
      .scalar(5, SF_SCALAR_GSCALE, 1, 0, 0)   // v0
      .scalar(4, SF_SCALAR_FIXED, 14, 0, 0)   // v1
      .load(0)                                // v2 g
      .op(SF_OP_MUL, 2, 0, 0)                 // v3 g * gscale
      .load(1)                                // v4 p
      .op(SF_OP_MUL, 3, 1, 0)                 // v5 lr * g
      .op(SF_OP_SUB, 4, 5, 0)                 // v6 p - lr g
      .store(1, 6);
  put("builder_sgd", sgd.s);
  Encoder momentum;
  momentum.b(0)
      .stream(0, SF_ROLE_GRAD, 0)
      .stream(1, SF_ROLE_PARAM, 0)
      .stream(2, SF_ROLE_STATE, 0)
      .scalar(5, SF_SCALAR_GSCALE, 1, 0, 0)   // v0
      .scalar(4, SF_SCALAR_FIXED, 14, 0, 0)   // v1
      .load(0)                                // v2
      .op(SF_OP_MUL, 2, 0, 0)                 // v3 g
      .load(2)                                // v4 m
      .b(4).b(4)                              // v5 0.9
      .op(SF_OP_FMA, 4, 5, 3)                 // v6 m' = 0.9 m + g
      .store(2, 6)
      .load(1)                                // v7 p
      .op(SF_OP_MUL, 6, 1, 0)                 // v8
      .op(SF_OP_SUB, 7, 8, 0)                 // v9
      .op(SF_OP_SIGN, 9, 0, 0)                // v10
      .b(6).b(10).b(2)                        // v11 convert(v10, bf16)
      .op(SF_OP_SELECT, 10, 9, 11)            // v12
      .store(1, 12);
  put("builder_momentum", momentum.s);
  Encoder two_phase;
  two_phase.b(0)
      .stream(0, SF_ROLE_GRAD, 0)
      .stream(1, SF_ROLE_PARAM, 0)
      .scalar(5, SF_SCALAR_GSCALE, 1, 0, 0)   // v0
      .load(0)                                // v1
      .op(SF_OP_MUL, 1, 0, 0)                 // v2
      .b(8).b(1).b(2)                         // reduce_sumsq(slot 0, v2)
      .b(7)                                   // phase
      .b(9).b(1)                              // v3 tensor_norm(0)
      .load(1)                                // v4
      .scalar(4, SF_SCALAR_FIXED, 14, 0, 0)   // v5
      .op(SF_OP_MUL, 3, 5, 0)                 // v6
      .op(SF_OP_SUB, 4, 6, 0)                 // v7
      .store(1, 7);
  put("builder_two_phase", two_phase.s);
  std::string raw(1, '\1');
  raw += std::string("\0\2\1\4\0", 5);  // name, 2 streams, 1 scalar, 4 instructions
  for (int s = 0; s < sf::kMaxStreams; ++s) raw += std::string{static_cast<char>(s % 2), static_cast<char>(s % 2), 0};
  for (int s = 0; s < sf::kMaxScalars; ++s) raw += '\4';
  raw += std::string("\0\0\0\0\0\0", 6);  // load g
  raw += std::string("\3\0\0\0\0\0", 6);  // scalar 0
  raw += std::string("\6\0\0\1\0\0", 6);  // mul
  raw += std::string("\1\1\2\0\0\0", 6);  // store p
  put("raw_program", raw);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  sf::set_warning_handler([](std::string_view) {});
  ::setenv("STEPFUSE_CACHE_DIR", "off", 1);  // compiled programs in memory only
  if (const char* dir = std::getenv("STEPFUSE_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  Reader r{data + 1, size - 1};
  if ((data[0] & 1) != 0) {
    check_raw(r);
    return 0;
  }
  if (sf_program* program = build(r)) {
    check_program(program, (data[0] & 6) == 6);
    sf_program_destroy(program);
  }
  return 0;
}
