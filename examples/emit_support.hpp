// What the two emit examples (emit_kernel.cpp for CUDA, emit_cpu_kernel.cpp for a CPU)
// do the same way: the command line's exit codes, main's error report, files, numbers as
// C literals, and the C tables of an update program's scalars and streams that both
// generated headers carry. Header-only: copy it with the example.
#pragma once

#include <stepfuse/stepfuse.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>

namespace emit_support {

// Parses the command line into `app`'s options. An exit code when the program stops
// there (--help: 0, after the help; a bad command line: 1, after CLI11's message),
// nothing when it goes on.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;
  }
  return std::nullopt;
}

// main's body: run(argc, argv), or "<program>: <what>" on stderr and exit code 1 when it throws.
inline int run_main(const char* program, int (*run)(int, char**), int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << program << ": " << e.what() << "\n";
    return 1;
  }
}

// Writes `bytes` to `path` (replacing it); throws std::runtime_error when that fails.
inline void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

// A C literal that reads back as exactly `v`.
inline std::string c_double(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// C definitions of the program's scalars and streams, in the ABI's order (the ABI
// JSON's program.scalars and program.streams): emitted_scalar_names, emitted_rules
// (sf_scalar_rule {kind, 0, a, b, c, 0} per scalar, what the step's scalar stage evaluates),
// emitted_stream_role and emitted_stream_init. Sized by EMITTED_NUM_SCALARS and
// EMITTED_NUM_STREAMS, which the including header defines.
inline std::string c_program_tables(const stepfuse::UpdateProgram& program) {
  const stepfuse::Program& p = program.program();
  std::string h = "static const char* const emitted_scalar_names[EMITTED_NUM_SCALARS] = {";
  for (int s = 0; s < p.num_scalars; ++s) h += std::string(s ? ", " : "") + "\"" + std::string(p.scalars[s]) + "\"";
  h += "};\n/* the scalar rules: {kind, 0, a, b, c, 0} per scalar (ABI: program.scalars) */\n";
  h += "static const sf_scalar_rule emitted_rules[EMITTED_NUM_SCALARS] = {\n";
  for (const stepfuse::ScalarDef& d : program.scalars())
    h += "  {" + std::to_string(static_cast<int>(d.rule.kind)) + ", 0, " + c_double(d.rule.a) + ", " +
         c_double(d.rule.b) + ", " + c_double(d.rule.c) + ", 0.0}, /* " + d.name + " */\n";
  h += "};\n/* per program stream: role (0 grad, 1 param, 2 state) and initial value */\n";
  h += "static const int emitted_stream_role[EMITTED_NUM_STREAMS] = {";
  for (int s = 0; s < p.num_streams; ++s) h += std::string(s ? ", " : "") + std::to_string(static_cast<int>(p.streams[s].role));
  h += "};\nstatic const float emitted_stream_init[EMITTED_NUM_STREAMS] = {";
  for (int s = 0; s < p.num_streams; ++s) h += std::string(s ? ", " : "") + "(float)" + c_double(p.streams[s].init);
  h += "};\n";
  return h;
}

}  // namespace emit_support
