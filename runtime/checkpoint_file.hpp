// Internal: the checkpoint container — a versioned, checksummed list of tagged
// sections, written atomically.
//
//   offset 0   "STEPFUSE"            magic, 8 bytes
//          8   u32 format version    kCheckpointFormat
//         12   u32 0x01020304        byte-order mark (files are little-endian)
//         16   u64 payload bytes     P
//         24   payload               sections: u32 tag, u32 0, u64 size, body
//     24 + P   u64 checksum          of bytes [0, 24 + P): XXH3_64, seed 0
//
// Section bodies are sequences of little-endian integers, IEEE doubles and
// floats, and strings (u32 length + bytes).
//
// Versions: 2 (written) checksums with XXH3_64. 1 differed only in the checksum
// (FNV-1a over 8-byte little-endian words, the tail zero-padded, then the byte
// count, then the murmur3 finalizer); it is still read. Bump kCheckpointFormat when
// the layout, a section's meaning or the checksum changes, and keep reading the
// older versions while their sections can still be understood.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace stepfuse::detail {

inline constexpr std::uint32_t kCheckpointFormat = 2;
// The oldest version this build reads (see the versions above).
inline constexpr std::uint32_t kOldestCheckpointFormat = 1;

constexpr std::uint32_t section_tag(const char (&s)[5]) {
  return static_cast<std::uint32_t>(static_cast<unsigned char>(s[0])) |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[1])) << 8 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[2])) << 16 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[3])) << 24;
}

// One section's body, built in memory (small metadata) plus large arrays that
// are streamed from where they live.
class SectionWriter {
 public:
  void u8(std::uint8_t v) { raw(&v, 1); }
  void u32(std::uint32_t v) { raw(&v, 4); }
  void i64(std::int64_t v) { raw(&v, 8); }
  void f64(double v) { raw(&v, 8); }
  void str(std::string_view s);
  void floats(const float* data, std::size_t n);  // streamed at write time, not copied

  std::uint64_t size() const;

 private:
  friend void write_checkpoint(const std::string&, std::span<const std::pair<std::uint32_t, const SectionWriter*>>);
  void raw(const void* p, std::size_t n);
  struct Piece {
    std::size_t meta_end;  // bytes of meta_ before this array
    const float* data;
    std::size_t n;
  };
  std::vector<unsigned char> meta_;
  std::vector<Piece> arrays_;
};

// Writes the sections to `path` atomically (jit/base/atomic_file.hpp: a temporary
// file in the same directory, synced, renamed over `path`). Error(io_error) naming the
// path, the step and the system's reason on failure; the old file is then untouched.
void write_checkpoint(const std::string& path, std::span<const std::pair<std::uint32_t, const SectionWriter*>> sections);

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

// The whole file in memory, checked (magic, version, size, checksum) before any
// section is handed out. Error(io_error) naming the path and what is wrong.
class CheckpointFile {
 public:
  explicit CheckpointFile(const std::string& path);
  // The section with `tag`, or null.
  std::optional<std::span<const unsigned char>> find(std::uint32_t tag) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<unsigned char> data_;
  std::vector<std::pair<std::uint32_t, std::span<const unsigned char>>> sections_;
};

}  // namespace stepfuse::detail
