// Reading checkpoint files: the read-only mapping, and the STEPFUSE container of format versions 1 and 2.
#include "runtime/checkpoint_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <utility>

// Header-only, as in jit/kernel_cache.cpp: nothing to link (see the find_path in CMakeLists.txt).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "jit/base/fd.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::detail {

static_assert(std::endian::native == std::endian::little,
              "the checkpoint formats are little-endian; a big-endian port needs byte swaps here");

namespace {

constexpr char kMagic[8] = {'S', 'T', 'E', 'P', 'F', 'U', 'S', 'E'};
constexpr std::uint32_t kByteOrderMark = 0x01020304;
constexpr std::size_t kHeaderBytes = 24, kTrailerBytes = 8;

[[noreturn]] void io_error(const std::string& message) { throw Error(ErrorCode::io_error, message); }

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

// ---- the mapping ----

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const auto fail = [&] { io_error("cannot read checkpoint '" + path + "': " + std::strerror(errno)); };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail();
  Fd file(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) fail();
  if (!S_ISREG(st.st_mode)) {
    errno = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
    fail();
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ == 0) return;  // nothing to map (mmap refuses a length of 0)
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) fail();
  data_ = static_cast<const unsigned char*>(p);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

// ---- the STEPFUSE container ----

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

bool is_container_file(std::span<const unsigned char> bytes) {
  return bytes.size() >= 8 && std::memcmp(bytes.data(), kMagic, 8) == 0;
}

CheckpointFile::CheckpointFile(MappedFile file) : file_(std::move(file)) {
  const std::string what = "checkpoint '" + file_.path() + "'";
  const std::span<const unsigned char> data = file_.bytes();
  if (!is_container_file(data)) io_error(what + " is not a stepfuse checkpoint (it does not start with \"STEPFUSE\")");
  if (data.size() < kHeaderBytes + kTrailerBytes)
    io_error(what + " is truncated: " + std::to_string(data.size()) + " bytes, less than a header and checksum");
  std::uint32_t bom;
  std::uint64_t payload;
  std::memcpy(&version_, data.data() + 8, 4);
  std::memcpy(&bom, data.data() + 12, 4);
  std::memcpy(&payload, data.data() + 16, 8);
  if (bom != kByteOrderMark) io_error(what + " has a byte order this build cannot read");
  if (version_ < kOldestCheckpointFormat || version_ > kLastContainerFormat)
    io_error(what + " has format version " + std::to_string(version_) +
             " in the STEPFUSE container, which holds versions " + std::to_string(kOldestCheckpointFormat) + " to " +
             std::to_string(kLastContainerFormat) + " (version " + std::to_string(kLastContainerFormat + 1) +
             " and later are safetensors files); it is not a checkpoint this build of stepfuse can read");
  const std::uint64_t expected = kHeaderBytes + payload + kTrailerBytes;
  if (payload > data.size() || expected != data.size())
    io_error(what + " is " + (data.size() < expected ? "truncated" : "longer than its header says") + ": " +
             std::to_string(data.size()) + " bytes, expected " + std::to_string(expected) +
             " (a torn or partial write?)");
  const std::span<const unsigned char> summed = data.first(data.size() - kTrailerBytes);
  const std::uint64_t sum = version_ == 1 ? fnv1a_checksum(summed) : XXH3_64bits(summed.data(), summed.size());
  std::uint64_t stored;
  std::memcpy(&stored, data.data() + data.size() - kTrailerBytes, 8);
  if (sum != stored) io_error(what + " is corrupt: its checksum does not match its contents");

  SectionReader r(data.subspan(kHeaderBytes, payload), what);
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
