// What the kernel ABI descriptions (JSON, format "stepfuse.kernel_abi") of every emit
// target share: the JSON writer, the header, the program and scalar rule sections, and
// the shape of a type and of a function's parameters. The CUDA description is
// jit/cuda/kernel_abi.cpp, the CPU one runtime/emit.cpp.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "stepfuse/update_program.hpp"

namespace stepfuse::jit {

// The descriptions' format version. Bump it when a key is removed or renamed or its
// meaning changes, on every target (include/stepfuse/emit.hpp documents "version 1").
inline constexpr int kKernelAbiVersion = 1;

// A small JSON writer: objects and arrays, two-space indentation, one value a line.
// An empty key writes a bare value (an array's element, or the top-level object).
// Keys are written as given; string values are escaped. Writes only to its own buffer.
class JsonWriter {
 public:
  JsonWriter& begin_object(std::string_view key = {}) { return open(key, '{'); }
  JsonWriter& end_object() { return close('}'); }
  JsonWriter& begin_array(std::string_view key = {}) { return open(key, '['); }
  JsonWriter& end_array() { return close(']'); }
  JsonWriter& str(std::string_view key, std::string_view v) { return raw(key, quote(v)); }
  // "%.17g" (round-trips a double); null when not finite (not reached: rules and inits are finite).
  JsonWriter& num(std::string_view key, double v);
  JsonWriter& integer(std::string_view key, long long v) { return raw(key, std::to_string(v)); }
  JsonWriter& boolean(std::string_view key, bool v) { return raw(key, v ? "true" : "false"); }
  // The text written so far and a final newline; call once every container is closed.
  std::string finish() const { return out_ + "\n"; }

 private:
  static std::string quote(std::string_view s);
  void item(std::string_view key);
  void newline();
  JsonWriter& raw(std::string_view key, const std::string& text);
  JsonWriter& open(std::string_view key, char bracket);
  JsonWriter& close(char bracket);

  std::string out_;
  std::vector<bool> first_;  // per open container: nothing written in it yet
};

// Opens the top-level object and writes format, format_version and stepfuse_version.
void begin_kernel_abi(JsonWriter& j);

// Writes "program" (name, text, streams with their roles, inits and whether the code
// loads or stores them, scalars with their rules) and "scalar_rule_kinds".
void write_abi_program(JsonWriter& j, const UpdateProgram& program);

// A field of a C struct the kernels read: name, C type, byte offset, description.
struct AbiField {
  const char* name;
  const char* type;
  std::size_t offset;
  const char* what;
};

// Writes "<name>": {description, size, align, fields: [{name, type, offset, description}]}.
void write_type(JsonWriter& j, const char* name, std::size_t size, std::size_t align, const char* what,
                std::initializer_list<AbiField> fields);

// A parameter of a generated function: name, C type, description.
struct AbiParam {
  const char* name;
  const char* type;
  const char* what;
};

// Writes "params": [{index, name, type, description}], indices from 0.
void write_params(JsonWriter& j, std::span<const AbiParam> params);

// A buffer the caller provides: name, element type, how many, how it is initialized.
struct AbiMemory {
  const char* name;
  const char* type;
  const char* count;
  const char* initialize;
};

// Writes "<key>": [{name, type, count, initialize}].
void write_memory(JsonWriter& j, const char* key, std::initializer_list<AbiMemory> buffers);

}  // namespace stepfuse::jit
