// Internal: reading a checkpoint's file — a read-only mapping of it, and the reader of
// the STEPFUSE container of format versions 1 and 2 (version 3 files are safetensors
// files: runtime/safetensors.hpp; both are described in docs/architecture.md §9).
//
// The STEPFUSE container (versions 1 and 2, read only):
//
//   offset 0   "STEPFUSE"            magic, 8 bytes
//          8   u32 format version    1 or 2
//         12   u32 0x01020304        byte-order mark (files are little-endian)
//         16   u64 payload bytes     P
//         24   payload               sections: u32 tag, u32 0, u64 size, body
//     24 + P   u64 checksum          of bytes [0, 24 + P)
//
// Section bodies are sequences of little-endian integers, IEEE doubles and floats,
// and strings (u32 length + bytes). Version 2 checksums with XXH3_64 (seed 0);
// version 1 with FNV-1a over 8-byte little-endian words (the tail zero-padded), then
// the byte count, then the murmur3 finalizer.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace stepfuse::detail {

// The format version save() writes (a safetensors file), and the oldest one load() reads.
inline constexpr std::uint32_t kCheckpointFormat = 3;
inline constexpr std::uint32_t kOldestCheckpointFormat = 1;
// The last version of the STEPFUSE container.
inline constexpr std::uint32_t kLastContainerFormat = 2;

// A whole file, mapped read-only: a load reads the tensors straight from the page
// cache into the optimizer's state, and never holds a second copy of a file that can
// be as large as the state itself. The mapping stays valid when the file is replaced
// by a rename (as save() does); truncating the file in place while it is mapped would
// fault the reader (SIGBUS), which no stepfuse writer does.
class MappedFile {
 public:
  // Error(io_error) "cannot read checkpoint '<path>': <reason>".
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&&) = delete;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const unsigned char> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

constexpr std::uint32_t section_tag(const char (&s)[5]) {
  return static_cast<std::uint32_t>(static_cast<unsigned char>(s[0])) |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[1])) << 8 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[2])) << 16 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[3])) << 24;
}

// Reads a section body; every read is bounds-checked (Error(io_error): corrupt).
class SectionReader {
 public:
  SectionReader(std::span<const unsigned char> body, std::string what) : body_(body), what_(std::move(what)) {}
  std::uint8_t u8();
  std::uint32_t u32();
  std::int64_t i64();
  double f64();
  std::string str();
  std::span<const unsigned char> bytes(std::size_t n);
  bool done() const { return pos_ == body_.size(); }

 private:
  std::span<const unsigned char> body_;
  std::size_t pos_ = 0;
  std::string what_;
};

// Whether a file's first bytes are the STEPFUSE container's.
bool is_container_file(std::span<const unsigned char> bytes);

// A STEPFUSE container, checked (magic, version, size, checksum) before any section
// is handed out. Error(io_error) naming the path and what is wrong.
class CheckpointFile {
 public:
  explicit CheckpointFile(MappedFile file);
  // The section with `tag`, or null.
  std::optional<std::span<const unsigned char>> find(std::uint32_t tag) const;
  const std::string& path() const { return file_.path(); }
  std::uint32_t version() const { return version_; }

 private:
  MappedFile file_;
  std::uint32_t version_ = 0;
  std::vector<std::pair<std::uint32_t, std::span<const unsigned char>>> sections_;
};

}  // namespace stepfuse::detail
