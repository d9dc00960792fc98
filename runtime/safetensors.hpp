// Internal: safetensors files (checkpoint format version 3) — the JSON of the header (a
// strict parser and the writer's escaping), checked reading of a mapped file, and an
// atomic, streamed write with stepfuse's checksum.
//
// The format (Hugging Face's safetensors): an 8-byte little-endian u64 N, N bytes of
// UTF-8 JSON (the header, padded with spaces so the data starts 8-byte aligned), then
// the data section. The header maps each tensor's name to {"dtype", "shape",
// "data_offsets": [begin, end]} (offsets relative to the data section; the tensors
// cover it exactly, in order, without holes or overlaps) and may hold "__metadata__",
// a map of strings to strings. Both are read as the format's reference implementation
// reads them (header at most 100,000,000 bytes, duplicate keys refused).
//
// The checksum (stepfuse's; docs/architecture.md §9): the metadata entry
// "checksum" = "xxh3_64:" + 16 lowercase hex digits, XXH3_64 (seed 0) of the canonical
// header bytes followed by the data section. The canonical bytes are, with every
// integer a u64 little-endian and every string its byte count then its bytes: the
// number of metadata entries other than "checksum", then each (key, value) in byte-wise
// key order; the number of tensors, then each tensor in data order: name, dtype, rank,
// each dimension, begin, end. So the checksum covers everything the header says, not
// how its JSON is spelled: a file rewritten by another safetensors writer with the same
// content still checks.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/checkpoint_file.hpp"

namespace stepfuse::detail {

// ---- JSON ----

struct JsonMember;

struct JsonValue {
  enum class Kind : std::uint8_t { null, boolean, number, string, array, object };
  Kind kind = Kind::null;
  bool boolean = false;
  std::string text;  // number: as written; string: decoded (UTF-8)
  std::vector<JsonValue> items;     // array
  std::vector<JsonMember> members;  // object, in order; keys unique

  // An object's member, or null.
  const JsonValue* find(std::string_view key) const;
};

// An object's member: a (key, value) pair. Not a std::pair, which clang with libstdc++
// cannot instantiate inside JsonValue's own implicit constructor (JsonValue would be
// incomplete there).
struct JsonMember {
  std::string first;
  JsonValue second;
  JsonMember(std::string key, JsonValue value) : first(std::move(key)), second(std::move(value)) {}
};

// A syntax error, at byte `offset` of the text.
struct JsonError : std::runtime_error {
  std::size_t offset;
  JsonError(const std::string& what, std::size_t at) : std::runtime_error(what), offset(at) {}
};

// Parses RFC 8259 JSON: one value with optional whitespace around it, valid UTF-8,
// nesting at most 64 deep, no duplicate keys in an object. Throws JsonError.
JsonValue parse_json(std::string_view text);

// `s` as a JSON string (quoted, escaped), appended to `out`. `s` must be valid UTF-8.
void append_json_string(std::string& out, std::string_view s);
// A double exactly: its shortest round-trip decimal text as a JSON number ("0.001",
// "1e-08", "2000.0": with a ".0" where it would read as an integer), or the JSON string
// "inf", "-inf" or "nan" for a value JSON numbers cannot hold.
void append_json_double(std::string& out, double v);
bool is_valid_utf8(std::string_view s);

// A number that is a non-negative integer within u64 (no sign, fraction or exponent).
std::optional<std::uint64_t> json_uint(const JsonValue& v);
// A number, or the strings "inf", "-inf", "nan": the double append_json_double wrote.
std::optional<double> json_double(const JsonValue& v);

// ---- reading ----

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // "F32", ...
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0, end = 0;  // in the data section
};

// The "checksum" metadata value ("xxh3_64:" + hex) of a file with this metadata (its own
// "checksum" entry left out), these tensors, in this order, and this data section.
std::string safetensors_checksum(const std::map<std::string, std::string>& metadata,
                                 const std::vector<SafetensorsTensor>& tensors, std::string_view data);

// A safetensors file, mapped and checked as a whole before anything is handed out:
// the header length, the JSON, the metadata's string values, every tensor's dtype,
// shape and offsets (contiguous from 0, in order, each exactly its elements' size) and
// the file's length. Error(io_error) naming the path and what is wrong.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(MappedFile file);

  const std::string& path() const { return file_.path(); }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // A metadata value, or null.
  const std::string* meta(std::string_view key) const;
  // The tensors in data order.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // A tensor by name, or null.
  const SafetensorsTensor* find(std::string_view name) const;
  std::span<const unsigned char> data(const SafetensorsTensor& t) const {
    return data_.subspan(static_cast<std::size_t>(t.begin), static_cast<std::size_t>(t.end - t.begin));
  }
  // Reads the whole data section: Error(io_error) unless the "checksum" metadata entry
  // matches (see the header of this file).
  void verify_checksum() const;

 private:
  MappedFile file_;
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsTensor> tensors_;  // in data order
  std::map<std::string, std::size_t, std::less<>> by_name_;
  std::span<const unsigned char> data_;
};

// ---- writing ----

// One tensor of shape [numel], read from `data` at write time (not copied): dtype "F32"
// (floats) or "BF16" (bf16 bit patterns, 2 bytes an element), the two a checkpoint holds.
struct SafetensorsSource {
  std::string name;
  const void* data = nullptr;
  std::uint64_t numel = 0;
  std::string_view dtype = "F32";
};

// Writes a safetensors file to `path` atomically (jit/base/atomic_file.hpp; mode 0600
// for a new file, an existing file's permission bits otherwise): "__metadata__"
// (`metadata` plus the "checksum" entry) first, then the tensors in the order given,
// laid out in that order. The header is built and checked before anything is written:
// Error(invalid_argument) for a name or value that is not valid UTF-8, a duplicate
// tensor name, a dtype other than F32 and BF16, or a header over the format's
// 100,000,000 bytes. Error(io_error) naming the path, the step and the system's reason
// when the write fails; `path` is then as it was. A directory that cannot be synced
// after the rename is a warning (the warning handler), not an error: the new file is
// complete.
void write_safetensors(const std::string& path, const std::map<std::string, std::string>& metadata,
                       const std::vector<SafetensorsSource>& tensors);

}  // namespace stepfuse::detail
