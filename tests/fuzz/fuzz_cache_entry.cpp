// fuzz_cache_entry: kernel cache entries (jit/kernel_cache.cpp) read from disk.
//
// Input: byte 0 odd: the rest is an entry file whose last 8 bytes the harness replaces
// with the XXH3_64 of the bytes before them (the entry's checksum), so corrupt lengths,
// keys and flags get past the checksum; even: the rest is the entry file as it is. The
// file is written under a fixed key (mode 0600) into a fresh cache directory, and a new
// KernelCache over that directory is asked for the key.
//
// Oracle: the result is exactly the payload of the entry when the harness's own reading
// of the documented layout finds it well formed (magic, format version 1, flags 0, the
// key's length and text, lengths that add up to the file's size, the checksum), else
// exactly what the compile callback returned (and then the callback ran). A well-formed
// entry may also be recompiled, never turned into other bytes. A second cache over the
// same directory afterwards returns the same bytes (the entry written back is sound).
//
// STEPFUSE_FUZZ_WRITE_SEEDS=<dir>: writes the seed corpus into <dir> and exits.
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "jit/kernel_cache.hpp"
#include "stepfuse/error.hpp"

namespace sf = stepfuse;
namespace fs = std::filesystem;

namespace {

[[noreturn]] void oracle_failed(const std::string& what) {
  std::fprintf(stderr, "fuzz_cache_entry: ORACLE FAILED: %s\n", what.c_str());
  std::abort();
}

const std::string kKey = "fuzz-key: spec=adamw f32/f32; compiler=fuzz 1.0; target=x86_64";
const std::string kCompiled = "fresh compile: not a payload any entry holds";

fs::path g_dir;

std::uint64_t get_u64(const std::string& s, std::size_t at) {
  std::uint64_t v = 0;
  std::memcpy(&v, s.data() + at, 8);
  return v;
}

// The payload of a well-formed entry for kKey, per the layout documented in
// jit/kernel_cache.cpp; std::nullopt otherwise.
std::optional<std::string> well_formed_payload(const std::string& e) {
  if (e.size() < 40 || e.compare(0, 8, "SFKCACHE") != 0) return std::nullopt;
  std::uint32_t version, flags;
  std::memcpy(&version, e.data() + 8, 4);
  std::memcpy(&flags, e.data() + 12, 4);
  if (version != 1 || flags != 0) return std::nullopt;
  const std::uint64_t k = get_u64(e, 16), p = get_u64(e, 24);
  if (k != kKey.size() || p > e.size() || 32 + k + p + 8 != e.size()) return std::nullopt;
  if (e.compare(32, k, kKey) != 0) return std::nullopt;
  if (XXH3_64bits(e.data(), e.size() - 8) != get_u64(e, e.size() - 8)) return std::nullopt;
  return e.substr(32 + k, p);
}

std::string entry(const std::string& payload) {
  std::string e = "SFKCACHE";
  const std::uint32_t version = 1, flags = 0;
  const std::uint64_t k = kKey.size(), p = payload.size();
  e.append(reinterpret_cast<const char*>(&version), 4);
  e.append(reinterpret_cast<const char*>(&flags), 4);
  e.append(reinterpret_cast<const char*>(&k), 8);
  e.append(reinterpret_cast<const char*>(&p), 8);
  e += kKey + payload;
  const std::uint64_t sum = XXH3_64bits(e.data(), e.size());
  e.append(reinterpret_cast<const char*>(&sum), 8);
  return e;
}

void write_seeds(const char* dir) {
  const auto put = [&](const char* name, char mode, const std::string& body) {
    std::ofstream(std::string(dir) + "/" + name, std::ios::binary) << std::string(1, mode) + body;
  };
  const std::string good = entry(std::string("\x7f" "ELF object bytes\0\1\2", 21));
  put("well_formed", 0, good);
  put("well_formed_resummed", 1, good);
  put("empty_payload", 1, entry(""));
  std::string wrong_key = good;
  wrong_key[40] ^= 1;
  put("wrong_key_resummed", 1, wrong_key);
  put("truncated", 0, good.substr(0, good.size() - 3));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  sf::set_warning_handler([](std::string_view) {});
  if (const char* dir = std::getenv("STEPFUSE_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  const char* tmp = std::getenv("TMPDIR");
  g_dir = fs::path(tmp && *tmp ? tmp : "/tmp") / ("stepfuse_fuzz_cache." + std::to_string(::getpid()));
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(g_dir, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  std::string e(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) != 0 && e.size() >= 8) {
    const std::uint64_t sum = XXH3_64bits(e.data(), e.size() - 8);
    std::memcpy(e.data() + e.size() - 8, &sum, 8);
  }
  std::error_code ec;
  fs::remove_all(g_dir, ec);
  fs::create_directory(g_dir);
  fs::permissions(g_dir, fs::perms::owner_all, ec);
  const std::optional<std::string> payload = well_formed_payload(e);

  std::string path;
  {
    sf::jit::KernelCache probe(g_dir);
    path = probe.entry_path(kKey).string();
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || ::write(fd, e.data(), e.size()) != static_cast<ssize_t>(e.size())) oracle_failed("cannot write the entry");
  ::close(fd);

  bool compiled = false;
  std::string got;
  {
    sf::jit::KernelCache cache(g_dir);
    const auto bytes = cache.get(kKey, [&] {
      compiled = true;
      return kCompiled;
    });
    if (!bytes) oracle_failed("get() returned no bytes");
    got = *bytes;
  }
  if (compiled) {
    if (got != kCompiled) oracle_failed("the compile ran but get() returned other bytes");
  } else {
    if (!payload) oracle_failed("get() used an entry that is not well formed");
    if (got != *payload) oracle_failed("get() returned bytes other than the entry's payload");
  }
  // The entry now on disk (the one read, or the one written back after the compile).
  sf::jit::KernelCache again(g_dir);
  bool compiled_again = false;
  const auto bytes = again.get(kKey, [&] {
    compiled_again = true;
    return std::string("second compile");
  });
  if (!bytes || (*bytes != got && !compiled_again))
    oracle_failed("a second cache read bytes other than those the first returned");
  return 0;
}
