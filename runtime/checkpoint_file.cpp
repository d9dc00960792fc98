// The checkpoint container: checksums, atomic write, checked read.
#include "runtime/checkpoint_file.hpp"

#include <bit>
#include <cerrno>
#include <cstring>
#include <memory>

// Header-only, as in jit/kernel_cache.cpp: nothing to link (see the find_path in CMakeLists.txt).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "jit/base/atomic_file.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::detail {

static_assert(std::endian::native == std::endian::little,
              "the checkpoint format is little-endian; a big-endian port needs byte swaps here");

namespace {

constexpr char kMagic[8] = {'S', 'T', 'E', 'P', 'F', 'U', 'S', 'E'};
constexpr std::uint32_t kByteOrderMark = 0x01020304;
constexpr std::size_t kHeaderBytes = 24, kTrailerBytes = 8;

[[noreturn]] void io_error(const std::string& message) { throw Error(ErrorCode::io_error, message); }

std::string system_reason() { return std::strerror(errno); }

}  // namespace

// ---- checksums ----

namespace {

// Format 2's checksum: XXH3_64 (seed 0), streamed so the arrays are not copied.
class Xxh3Checksum {
 public:
  Xxh3Checksum() {
    XXH3_INITSTATE(&state_);
    XXH3_64bits_reset(&state_);
  }
  void update(const void* data, std::size_t n) { XXH3_64bits_update(&state_, data, n); }
  std::uint64_t finish() const { return XXH3_64bits_digest(&state_); }

 private:
  XXH3_state_t state_;
};

// Format 1's checksum, kept to read its files: FNV-1a over 8-byte little-endian
// words (the tail zero-padded), then the byte count, then the murmur3 finalizer.
std::uint64_t fnv1a_checksum(std::span<const unsigned char> bytes) {
  constexpr std::uint64_t kPrime = 0x100000001b3ull;
  std::uint64_t h = 0xcbf29ce484222325ull;
  std::size_t at = 0;
  for (; bytes.size() - at >= 8; at += 8) {
    std::uint64_t w;
    std::memcpy(&w, bytes.data() + at, 8);
    h = (h ^ w) * kPrime;
  }
  if (at < bytes.size()) {
    unsigned char last[8] = {};
    std::memcpy(last, bytes.data() + at, bytes.size() - at);
    std::uint64_t w;
    std::memcpy(&w, last, 8);
    h = (h ^ w) * kPrime;
  }
  h = (h ^ bytes.size()) * kPrime;
  h ^= h >> 33, h *= 0xff51afd7ed558ccdull, h ^= h >> 33, h *= 0xc4ceb9fe1a85ec53ull, h ^= h >> 33;
  return h;
}

}  // namespace

// ---- writing ----

void SectionWriter::raw(const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  meta_.insert(meta_.end(), b, b + n);
}

void SectionWriter::str(std::string_view s) {
  u32(static_cast<std::uint32_t>(s.size()));
  raw(s.data(), s.size());
}

void SectionWriter::floats(const float* data, std::size_t n) { arrays_.push_back({meta_.size(), data, n}); }

std::uint64_t SectionWriter::size() const {
  std::uint64_t total = meta_.size();
  for (const Piece& a : arrays_) total += a.n * sizeof(float);
  return total;
}

void write_checkpoint(const std::string& path,
                      std::span<const std::pair<std::uint32_t, const SectionWriter*>> sections) {
  if (path.empty()) throw Error(ErrorCode::invalid_argument, "checkpoint path is empty");
  std::uint64_t payload = 0;
  for (const auto& [tag, s] : sections) payload += 16 + s->size();
  const auto failure = write_file_atomically(path, 0644, [&](AtomicFileSink& out) {
    Xxh3Checksum checksum;
    const auto put = [&](const void* data, std::size_t n) {
      checksum.update(data, n);
      out.write(data, n);
    };
    const std::uint32_t version = kCheckpointFormat, bom = kByteOrderMark;
    put(kMagic, 8);
    put(&version, 4);
    put(&bom, 4);
    put(&payload, 8);
    for (const auto& [tag, s] : sections) {
      const std::uint32_t zero = 0;
      const std::uint64_t size = s->size();
      put(&tag, 4);
      put(&zero, 4);
      put(&size, 8);
      std::size_t at = 0;
      for (const SectionWriter::Piece& a : s->arrays_) {
        put(s->meta_.data() + at, a.meta_end - at);
        at = a.meta_end;
        put(a.data, a.n * sizeof(float));
      }
      put(s->meta_.data() + at, s->meta_.size() - at);
    }
    const std::uint64_t sum = checksum.finish();
    out.write(&sum, 8);
  });
  if (failure) io_error("cannot write checkpoint '" + path + "': " + failure->describe());
}

// ---- reading ----

std::span<const unsigned char> SectionReader::bytes(std::size_t n) {
  if (n > body_.size() - pos_) io_error(what_ + " is corrupt: a field runs past the end of its section");
  const auto out = body_.subspan(pos_, n);
  pos_ += n;
  return out;
}

namespace {
template <class T>
T read_as(SectionReader& r) {
  T v;
  std::memcpy(&v, r.bytes(sizeof v).data(), sizeof v);
  return v;
}
}  // namespace

std::uint8_t SectionReader::u8() { return read_as<std::uint8_t>(*this); }
std::uint32_t SectionReader::u32() { return read_as<std::uint32_t>(*this); }
std::int64_t SectionReader::i64() { return read_as<std::int64_t>(*this); }
double SectionReader::f64() { return read_as<double>(*this); }
std::string SectionReader::str() {
  const std::uint32_t n = u32();
  const auto b = bytes(n);
  return std::string(b.begin(), b.end());
}

CheckpointFile::CheckpointFile(const std::string& path) : path_(path) {
  const std::string what = "checkpoint '" + path + "'";
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) io_error("cannot read " + what + ": " + system_reason());
  if (std::fseek(f.get(), 0, SEEK_END) != 0) io_error("cannot read " + what + ": " + system_reason());
  const long size = std::ftell(f.get());
  if (size < 0) io_error("cannot read " + what + ": " + system_reason());
  std::rewind(f.get());
  data_.resize(static_cast<std::size_t>(size));
  if (size > 0 && std::fread(data_.data(), 1, data_.size(), f.get()) != data_.size())
    io_error("cannot read " + what + ": " + system_reason());

  if (data_.size() < 8 || std::memcmp(data_.data(), kMagic, 8) != 0)
    io_error(what + " is not a stepfuse checkpoint (it does not start with \"STEPFUSE\")");
  if (data_.size() < kHeaderBytes + kTrailerBytes)
    io_error(what + " is truncated: " + std::to_string(data_.size()) + " bytes, less than a header and checksum");
  std::uint32_t version, bom;
  std::uint64_t payload;
  std::memcpy(&version, data_.data() + 8, 4);
  std::memcpy(&bom, data_.data() + 12, 4);
  std::memcpy(&payload, data_.data() + 16, 8);
  if (bom != kByteOrderMark) io_error(what + " has a byte order this build cannot read");
  if (version < kOldestCheckpointFormat || version > kCheckpointFormat)
    io_error(what + " has format version " + std::to_string(version) + "; this build of stepfuse reads versions " +
             std::to_string(kOldestCheckpointFormat) + " to " + std::to_string(kCheckpointFormat) +
             (version > kCheckpointFormat ? " (it was written by a newer stepfuse)" : ""));
  const std::uint64_t expected = kHeaderBytes + payload + kTrailerBytes;
  if (payload > data_.size() || expected != data_.size())
    io_error(what + " is " + (data_.size() < expected ? "truncated" : "longer than its header says") + ": " +
             std::to_string(data_.size()) + " bytes, expected " + std::to_string(expected) +
             " (a torn or partial write?)");
  const std::span<const unsigned char> summed(data_.data(), data_.size() - kTrailerBytes);
  std::uint64_t sum;
  if (version == 1)
    sum = fnv1a_checksum(summed);
  else
    sum = XXH3_64bits(summed.data(), summed.size());  // the same as Xxh3Checksum streamed
  std::uint64_t stored;
  std::memcpy(&stored, data_.data() + data_.size() - kTrailerBytes, 8);
  if (sum != stored) io_error(what + " is corrupt: its checksum does not match its contents");

  SectionReader r(std::span<const unsigned char>(data_).subspan(kHeaderBytes, payload), what);
  while (!r.done()) {
    const std::uint32_t tag = r.u32();
    r.u32();
    const std::int64_t size = r.i64();
    if (size < 0) io_error(what + " is corrupt: a negative section size");
    sections_.emplace_back(tag, r.bytes(static_cast<std::size_t>(size)));
  }
}

std::optional<std::span<const unsigned char>> CheckpointFile::find(std::uint32_t tag) const {
  for (const auto& [t, body] : sections_)
    if (t == tag) return body;
  return std::nullopt;
}

}  // namespace stepfuse::detail
