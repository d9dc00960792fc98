// What the kernel ABI descriptions (JSON, format "stepfuse.kernel_abi") of every emit
// target share: the JSON writer, the header, the program and scalar rule sections, and
// the shape of a type and of a function's parameters. The CUDA description is
// jit/cuda/kernel_abi.cpp, the CPU one jit/llvm/kernel_abi.cpp.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "stepfuse/update_program.hpp"

namespace stepfuse::jit {

// The descriptions' format version. Bump it when a key is removed or renamed or its
// meaning changes, on every target (include/stepfuse/emit.hpp documents "version 1").
inline constexpr int kKernelAbiVersion = 1;

// Builds a JSON document (nlohmann::ordered_json, private to jit/abi_json.cpp) in the
// order it is written: objects and arrays, keys in insertion order. An empty key adds a
// bare value (an array's element, or the top-level object). finish() prints it with
// two-space indentation, one value a line.
class JsonWriter {
 public:
  JsonWriter();
  ~JsonWriter();
  JsonWriter(const JsonWriter&) = delete;
  JsonWriter& operator=(const JsonWriter&) = delete;

  JsonWriter& begin_object(std::string_view key = {});
  JsonWriter& end_object();
  JsonWriter& begin_array(std::string_view key = {});
  JsonWriter& end_array();
  JsonWriter& str(std::string_view key, std::string_view v);
  // The shortest text that reads back as `v`; null when not finite (not reached: rules
  // and inits are finite).
  JsonWriter& num(std::string_view key, double v);
  JsonWriter& integer(std::string_view key, long long v);
  JsonWriter& boolean(std::string_view key, bool v);
  // The document and a final newline; call once every container is closed. Bytes that
  // are not UTF-8 are replaced by U+FFFD.
  std::string finish() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
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
