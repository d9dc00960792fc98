// Build-time generator for cuda_codegen_test: writes the CUDA emitter's element
// functions of every built-in program as one host C++ include file.
//
// Output layout (one file, included once by tests/cuda_codegen_test.cpp):
//   the embedded headers (element math, scalar rules, device ABI), once, at global scope;
//   per built-in program, namespace sf_gen_<program> { sf_body }, the text
//     emit_element_functions() produces after those headers, for a spec holding all
//     15 dtype combinations (one element function serves them all);
//   sf_gen::kPrograms: per program its name, combinations and body function pointers
//     (sf_body for each).
// The headers are emitted once, outside any namespace: step_scalars.h and device_abi.h
// carry include guards, so a second copy (or one inside a namespace, after the test has
// included jit/step_scalars.h itself) would silently be empty.
//
// Usage: stepfuse_emit_elements <output.inc>. Writes a temporary file and renames it,
// so an interrupted build never leaves a truncated include behind. Exit status 1 on error.
#include <cstdio>
#include <exception>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "jit/builtins.hpp"
#include "jit/cuda/emit_cuda.hpp"
#include "jit/program_analysis.hpp"

namespace {

using stepfuse::DType;
using stepfuse::jit::DtypeCombo;
using stepfuse::jit::CudaSpec;

// Weight-major: every weight x grad dtype, masters only for 16-bit weights (15 in all).
// cuda_codegen_test checks the emitted list against its own enumeration.
std::vector<DtypeCombo> all_combos() {
  std::vector<DtypeCombo> out;
  for (DType w : {DType::f32, DType::f16, DType::bf16})
    for (DType g : {DType::f32, DType::f16, DType::bf16})
      for (bool m : {false, true})
        if (!(w == DType::f32 && m)) out.push_back({w, g, m});
  return out;
}

const char* dtype_enum(DType t) {
  return t == DType::f32 ? "stepfuse::DType::f32" : t == DType::f16 ? "stepfuse::DType::f16" : "stepfuse::DType::bf16";
}

std::string generate() {
  const std::string& headers = stepfuse::jit::cuda_embedded_headers();
  const std::vector<DtypeCombo> combos = all_combos();
  std::string out =
      "// Generated at build time by tests/tools/emit_elements.cpp from the CUDA emitter\n"
      "// (jit/cuda/emit_cuda.cpp): do not edit. Included by tests/cuda_codegen_test.cpp.\n";
  out += headers;
  // Written for NVRTC, where an element function that ignores its state (plain SGD)
  // is normal; the host build's -Wextra would call it an unused parameter.
  out += "#pragma GCC diagnostic push\n#pragma GCC diagnostic ignored \"-Wunused-parameter\"\n";
  std::string table =
      "namespace sf_gen {\n"
      "using BodyFn = void (*)(const float*, float, float*, float*);\n"
      "struct GenCombo { stepfuse::DType weight, grad; bool master; };\n"
      "struct GenProgram { const char* name; int num_combos; GenCombo combos[" +
      std::to_string(combos.size()) + "]; BodyFn bodies[" + std::to_string(combos.size()) +
      "]; };\n"
      "inline constexpr GenProgram kPrograms[] = {\n";
  for (int b = 0; b < stepfuse::jit::kNumBuiltins; ++b) {
    CudaSpec spec;
    spec.program = stepfuse::jit::builtin_program(static_cast<stepfuse::jit::Builtin>(b));
    // A two-phase program's element functions (sf_body1, and sf_body with the norms)
    // run inside kernels that cuda_emulation_test runs: no entry here.
    if (stepfuse::jit::is_two_phase(spec.program)) continue;
    spec.combos = combos;
    spec.aligned16 = true;
    const std::string text = stepfuse::jit::emit_element_functions(spec);
    if (text.compare(0, headers.size(), headers) != 0)
      throw std::runtime_error("emit_element_functions() no longer starts with cuda_embedded_headers(); "
                               "update tests/tools/emit_elements.cpp");
    const std::string ns = "sf_gen_" + std::string(spec.program.name);
    out += "namespace " + ns + " {\n" + text.substr(headers.size()) + "}  // namespace " + ns + "\n";
    table += "  {\"" + std::string(spec.program.name) + "\", " + std::to_string(combos.size()) + ",\n   {";
    for (const DtypeCombo& c : combos)
      table += std::string("{") + dtype_enum(c.weight) + ", " + dtype_enum(c.grad) + ", " + (c.master ? "true" : "false") +
               "}, ";
    table += "},\n   {";
    // One element function serves every combination (the span functions do the storage).
    for (std::size_t k = 0; k < combos.size(); ++k) table += "&" + ns + "::sf_body, ";
    table += "}},\n";
  }
  out += "#pragma GCC diagnostic pop\n";
  table += "};\n}  // namespace sf_gen\n";
  return out + table;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <output.inc>\n", argv[0]);
    return 1;
  }
  try {
    const std::string text = generate();
    const std::string path = argv[1], tmp = path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f << text;
      if (!f.flush()) throw std::runtime_error("cannot write " + tmp);
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot rename " + tmp + " to " + path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emit_elements: %s\n", e.what());
    return 1;
  }
  return 0;
}
