// The kernel cache (docs/architecture.md §6): compile once per key, entries on disk that survive a new cache
// and are rejected when torn, corrupt, stale or another key's, a directory that is refused
// with one warning unless it is private (and not a symlink), opened once and never followed
// again by path, entry files refused unless private regular files, eviction, the size cap
// and the removal of stale temporary files.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock-matchers.h>  // header-only matchers: HasSubstr
#include <gtest/gtest.h>

// The test decodes entries by itself, from the format documented in kernel_cache.cpp.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <latch>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "jit/kernel_cache.hpp"
#include "jit/base/warning.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::jit {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

// ---- helpers ---------------------------------------------------------------------------------

std::mutex g_warnings_mutex;
std::vector<std::string> g_warnings;

void capture_warning(std::string_view message) {
  std::lock_guard lock(g_warnings_mutex);
  g_warnings.emplace_back(message);
}

std::vector<std::string> warnings() {
  std::lock_guard lock(g_warnings_mutex);
  return g_warnings;
}

// A fresh private directory, removed (whatever a test did to its permissions) afterwards.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "stepfuse-kernel-cache-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed: " + pattern);
    path_ = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path_, fs::perms::owner_all, ec);
    for (const auto& e : fs::recursive_directory_iterator(path_, ec)) {
      if (e.is_directory(ec)) fs::permissions(e.path(), fs::perms::owner_all, ec);
    }
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// Names in `dir`, sorted.
std::vector<std::string> list_dir(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> list_dir_or_empty(const fs::path& dir) {
  return fs::is_directory(dir) ? list_dir(dir) : std::vector<std::string>{};
}

// Binary bytes, NULs included, different for each seed.
std::string make_payload(std::size_t size, std::uint64_t seed) {
  std::string bytes(size, '\0');
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::size_t i = 0; i < size; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    bytes[i] = static_cast<char>(i % 7 == 0 ? 0 : x >> 56);
  }
  return bytes;
}

// A key shaped like the real ones: a few hundred bytes of spec and compiler text.
std::string make_key(const std::string& tag, std::size_t size = 600) {
  std::string key = "stepfuse-kernel format=1 compiler=\"nvrtc 13.0\" arch=sm_90 options=-O3 spec=" + tag + ";";
  while (key.size() < size) key += "param f32 " + std::to_string(key.size()) + ";";
  return key;
}

void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>(v >> (8 * i));
}

// An entry file written from the documented format, independent of the cache's writer.
std::string build_entry(const std::string& key, const std::string& payload, std::uint32_t version = 1,
                        std::uint32_t flags = 0) {
  std::string entry = "SFKCACHE";
  put_le(entry, version, 4);
  put_le(entry, flags, 4);
  put_le(entry, key.size(), 8);
  put_le(entry, payload.size(), 8);
  entry += key;
  entry += payload;
  put_le(entry, XXH3_64bits(entry.data(), entry.size()), 8);
  return entry;
}

std::string expected_name(const std::string& key) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, XXH3_128bits(key.data(), key.size()));
  std::string name;
  char hex[3];
  for (unsigned char byte : canonical.digest) {
    std::snprintf(hex, sizeof hex, "%02x", byte);
    name += hex;
  }
  return name + ".sfk";
}

// A compile function that counts its calls.
struct Compiler {
  std::string bytes;
  std::atomic<int> calls{0};
  std::function<std::string()> fn() {
    return [this] {
      ++calls;
      return bytes;
    };
  }
};

std::function<std::string()> must_not_compile() {
  return [] {
    ADD_FAILURE() << "compile() ran although the entry should have come from the cache";
    return std::string("wrong");
  };
}

class KernelCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    detail::reset_warnings_for_testing();
    {
      std::lock_guard lock(g_warnings_mutex);
      g_warnings.clear();
    }
    previous_handler_ = set_warning_handler(&capture_warning);
  }
  void TearDown() override { set_warning_handler(previous_handler_); }

  // Writes the entry for `key` through a cache of its own and returns its bytes.
  std::string store(const std::string& key, const std::string& payload) {
    KernelCache cache(dir_.path());
    Compiler compiler{payload};
    EXPECT_EQ(*cache.get(key, compiler.fn()), payload);
    EXPECT_EQ(cache.stats().disk_writes, 1u);
    return read_file(cache.entry_path(key));
  }

  // A fresh cache finds `entry_bytes` (written at the entry path) unusable: it counts a
  // reject, compiles, and rewrites the entry, which then equals `clean_entry`. A second
  // fresh cache gets a clean disk hit.
  void expect_rejected_and_rewritten(const std::string& key, const std::string& payload,
                                     const std::string& entry_bytes, const std::string& clean_entry,
                                     const std::string& what) {
    SCOPED_TRACE(what);
    KernelCache probe(dir_.path());
    const fs::path path = probe.entry_path(key);
    write_file(path, entry_bytes);
    {
      KernelCache cache(dir_.path());
      Compiler compiler{payload};
      EXPECT_EQ(*cache.get(key, compiler.fn()), payload);
      EXPECT_EQ(compiler.calls, 1);
      const CacheStats s = cache.stats();
      EXPECT_EQ(s.disk_rejects, 1u);
      EXPECT_EQ(s.disk_hits, 0u);
      EXPECT_EQ(s.compiles, 1u);
      EXPECT_EQ(s.disk_writes, 1u);
      EXPECT_TRUE(cache.disk_enabled());
    }
    EXPECT_TRUE(read_file(path) == clean_entry) << "the rejected entry was not rewritten";
    KernelCache again(dir_.path());
    EXPECT_EQ(*again.get(key, must_not_compile()), payload);
    EXPECT_EQ(again.stats().disk_hits, 1u);
    EXPECT_EQ(again.stats().disk_rejects, 0u);
  }

  TempDir dir_;
  WarningHandler previous_handler_ = nullptr;
};

bool running_as_root() { return ::geteuid() == 0; }

// ---- memory and disk hits --------------------------------------------------------------------

TEST_F(KernelCacheTest, MissThenMemoryHit) {
  KernelCache cache(dir_.path());
  EXPECT_TRUE(cache.disk_enabled());
  Compiler compiler{"cubin bytes"};
  const std::string key = make_key("adam");
  auto first = cache.get(key, compiler.fn());
  auto second = cache.get(key, compiler.fn());
  EXPECT_EQ(*first, "cubin bytes");
  EXPECT_EQ(first, second) << "a memory hit returns the same shared bytes";
  EXPECT_EQ(compiler.calls, 1);
  const CacheStats s = cache.stats();
  EXPECT_EQ(s.compiles, 1u);
  EXPECT_EQ(s.memory_hits, 1u);
  EXPECT_EQ(s.disk_hits, 0u);
  EXPECT_EQ(s.disk_writes, 1u);
  EXPECT_EQ(s.disk_rejects, 0u);
  EXPECT_GE(s.compile_ms, 0.0);
  EXPECT_EQ(s.compile_ms, s.last_compile_ms);
  struct stat st {};
  ASSERT_EQ(::stat(cache.entry_path(key).c_str(), &st), 0) << "the entry was written";
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "entries are private like their directory";
  EXPECT_EQ(list_dir(dir_.path()), std::vector<std::string>{expected_name(key)}) << "no temporary file is left";
  EXPECT_TRUE(warnings().empty());
}

TEST_F(KernelCacheTest, NewCacheOnSameDirectoryLoadsFromDiskByteForByte) {
  const std::vector<std::pair<std::string, std::string>> entries = {
      {make_key("small"), make_payload(1000, 1)},
      {make_key("one-megabyte", 20000), make_payload(1 << 20, 2)},
      {make_key("nuls"), std::string("\0\0\x01\xff\0ELF\0", 9)},
      {make_key("empty"), std::string()},
      {std::string("k\0with\0nuls", 11), make_payload(77, 3)},
  };
  {
    KernelCache cache(dir_.path());
    for (const auto& [key, payload] : entries) {
      const std::string copy = payload;
      EXPECT_EQ(*cache.get(key, [&] { return copy; }), payload);
    }
    EXPECT_EQ(cache.stats().disk_writes, entries.size());
  }
  KernelCache cache(dir_.path());
  for (const auto& [key, payload] : entries) {
    auto bytes = cache.get(key, must_not_compile());
    EXPECT_TRUE(*bytes == payload) << "size " << bytes->size() << " vs " << payload.size();
    EXPECT_GE(cache.stats().last_disk_load_ms, 0.0);
  }
  const CacheStats s = cache.stats();
  EXPECT_EQ(s.disk_hits, entries.size());
  EXPECT_EQ(s.compiles, 0u);
  EXPECT_EQ(s.disk_writes, 0u);
  // Now in memory: no second load.
  for (const auto& [key, payload] : entries) EXPECT_TRUE(*cache.get(key, must_not_compile()) == payload);
  EXPECT_EQ(cache.stats().memory_hits, entries.size());
  EXPECT_EQ(cache.stats().disk_hits, entries.size());
}

TEST_F(KernelCacheTest, EntryFileHasTheDocumentedFormatAndName) {
  const std::string key = make_key("format");
  const std::string payload = make_payload(4097, 9);
  const std::string entry = store(key, payload);
  KernelCache cache(dir_.path());
  EXPECT_EQ(cache.entry_path(key), dir_.path() / expected_name(key));
  EXPECT_EQ(cache.entry_path(key).filename().string().size(), 32u + 4u);
  EXPECT_TRUE(entry == build_entry(key, payload)) << "the writer and the documented format disagree";
  EXPECT_NE(cache.entry_path(key), cache.entry_path(key + " "));
  EXPECT_EQ(KernelCache(std::nullopt).entry_path(key), fs::path());
}

TEST_F(KernelCacheTest, ClearMemoryForgetsEntriesAndCounters) {
  KernelCache cache(dir_.path());
  Compiler compiler{"bytes"};
  const std::string key = make_key("clear");
  cache.get(key, compiler.fn());
  cache.get(key, compiler.fn());
  cache.clear_memory();
  const CacheStats zero = cache.stats();
  EXPECT_EQ(zero.memory_hits + zero.disk_hits + zero.compiles + zero.disk_writes + zero.disk_rejects, 0u);
  EXPECT_EQ(*cache.get(key, must_not_compile()), "bytes");
  EXPECT_EQ(cache.stats().disk_hits, 1u);
  EXPECT_EQ(compiler.calls, 1);
}

TEST_F(KernelCacheTest, MemoryOnlyCacheCompilesOnceAndWritesNothing) {
  KernelCache cache(std::nullopt);
  EXPECT_FALSE(cache.disk_enabled());
  EXPECT_FALSE(cache.dir().has_value());
  Compiler compiler{"bytes"};
  EXPECT_EQ(*cache.get("k", compiler.fn()), "bytes");
  EXPECT_EQ(*cache.get("k", compiler.fn()), "bytes");
  EXPECT_EQ(compiler.calls, 1);
  EXPECT_EQ(cache.stats().disk_writes, 0u);
  EXPECT_TRUE(warnings().empty()) << "no directory asked for, nothing to warn about";
}

// ---- bad entries -----------------------------------------------------------------------------

TEST_F(KernelCacheTest, EntryWithAnyByteFlippedIsRejectedAndRewritten) {
  const std::string key = make_key("flip", 300);
  const std::string payload = make_payload(1000, 4);
  const std::string clean = store(key, payload);
  const std::size_t k = key.size(), p = payload.size(), size = clean.size();
  ASSERT_EQ(size, 32 + k + p + 8);
  const std::vector<std::size_t> offsets = {
      0, 7,              // magic
      8, 11,             // version
      12, 15,            // flags
      16, 23,            // key length
      24, 31,            // payload length
      32, 32 + k / 2, 32 + k - 1,               // key
      32 + k, 32 + k + p / 2, 32 + k + p - 1,   // payload
      size - 8, size - 1};                      // checksum
  for (std::size_t offset : offsets) {
    for (unsigned char mask : {0x01, 0x80}) {
      std::string bad = clean;
      bad[offset] = static_cast<char>(bad[offset] ^ mask);
      expect_rejected_and_rewritten(key, payload, bad, clean,
                                    "byte " + std::to_string(offset) + " ^ " + std::to_string(mask));
    }
  }
  EXPECT_TRUE(warnings().empty());
}

TEST_F(KernelCacheTest, TruncatedOrExtendedEntryIsRejectedAndRewritten) {
  const std::string key = make_key("truncate", 300);
  const std::string payload = make_payload(5000, 5);
  const std::string clean = store(key, payload);
  for (std::size_t length : {std::size_t{0}, std::size_t{1}, std::size_t{8}, std::size_t{31}, std::size_t{32},
                             std::size_t{39}, std::size_t{40}, 32 + key.size(), 32 + key.size() + 100,
                             clean.size() - 8, clean.size() - 1}) {
    expect_rejected_and_rewritten(key, payload, clean.substr(0, length), clean,
                                  "truncated to " + std::to_string(length));
  }
  expect_rejected_and_rewritten(key, payload, clean + '\0', clean, "one byte appended");
  expect_rejected_and_rewritten(key, payload, clean + clean, clean, "written twice");
}

TEST_F(KernelCacheTest, GarbageFileIsRejectedAndRewritten) {
  const std::string key = make_key("garbage", 300);
  const std::string payload = make_payload(3000, 6);
  const std::string clean = store(key, payload);
  std::mt19937_64 rng(std::random_device{}());
  for (std::size_t size : {std::size_t{7}, std::size_t{40}, std::size_t{4096}, clean.size()}) {
    std::string garbage(size, '\0');
    for (auto& c : garbage) c = static_cast<char>(rng());
    expect_rejected_and_rewritten(key, payload, garbage, clean, "garbage of " + std::to_string(size) + " bytes");
  }
  // A plausible header with absurd lengths must not make the reader allocate them.
  std::string huge = clean.substr(0, 16);
  put_le(huge, key.size(), 8);
  put_le(huge, std::uint64_t{1} << 62, 8);
  huge += key;
  expect_rejected_and_rewritten(key, payload, huge, clean, "payload length 2^62");
  std::string huge_key = clean.substr(0, 16);
  put_le(huge_key, ~std::uint64_t{0}, 8);
  put_le(huge_key, payload.size(), 8);
  expect_rejected_and_rewritten(key, payload, huge_key + key + payload, clean, "key length 2^64-1");
}

TEST_F(KernelCacheTest, OtherFormatVersionOrFlagsIsRejected) {
  const std::string key = make_key("version", 300);
  const std::string payload = make_payload(2000, 7);
  const std::string clean = store(key, payload);
  // Well-formed, with a correct checksum: rejected for the version or flags alone.
  expect_rejected_and_rewritten(key, payload, build_entry(key, payload, 2), clean, "format version 2");
  expect_rejected_and_rewritten(key, payload, build_entry(key, payload, 0), clean, "format version 0");
  expect_rejected_and_rewritten(key, payload, build_entry(key, payload, 1, 1), clean, "flags 1");
  // The independent encoder agrees with the cache on version 1.
  EXPECT_TRUE(build_entry(key, payload) == clean);
}

TEST_F(KernelCacheTest, ChangedKeyTextIsADifferentEntry) {
  std::string old_key = make_key("adam");
  std::string new_key = old_key;
  new_key.replace(new_key.find("nvrtc 13.0"), 10, "nvrtc 13.1");
  ASSERT_NE(old_key, new_key);
  store(old_key, "old compiler's bytes");
  KernelCache cache(dir_.path());
  EXPECT_NE(cache.entry_path(old_key), cache.entry_path(new_key));
  Compiler compiler{"new compiler's bytes"};
  EXPECT_EQ(*cache.get(new_key, compiler.fn()), "new compiler's bytes");
  EXPECT_EQ(compiler.calls, 1);
  EXPECT_EQ(cache.stats().disk_rejects, 0u) << "a different key is a plain miss";
  EXPECT_EQ(*cache.get(old_key, must_not_compile()), "old compiler's bytes");
  EXPECT_EQ(list_dir(dir_.path()).size(), 2u);
}

TEST_F(KernelCacheTest, EntryHoldingAnotherKeyIsRejected) {
  // A hash collision, simulated: key B's file holds key A's (valid) entry.
  const std::string key_a = make_key("collision-a");
  const std::string key_b = make_key("collision-b");
  ASSERT_EQ(key_a.size(), key_b.size()) << "same lengths, so only the key bytes differ";
  const std::string entry_a = store(key_a, "bytes of A");
  const std::string entry_b = build_entry(key_b, "bytes of B");
  expect_rejected_and_rewritten(key_b, "bytes of B", entry_a, entry_b, "A's entry at B's path");
  // A key of another length, too.
  const std::string entry_short = build_entry("short key", "bytes of A");
  expect_rejected_and_rewritten(key_b, "bytes of B", entry_short, entry_b, "a shorter key at B's path");
  // A's own entry is untouched.
  KernelCache cache(dir_.path());
  EXPECT_EQ(*cache.get(key_a, must_not_compile()), "bytes of A");
}

// ---- the directory ---------------------------------------------------------------------------

// A refused directory: one warning naming it and saying what to do, compiles in memory,
// a second lookup is a memory hit, nothing written there.
void expect_refused(const fs::path& dir, const std::string& reason) {
  SCOPED_TRACE(dir.string());
  const auto before = list_dir_or_empty(dir);
  KernelCache cache(dir);
  EXPECT_FALSE(cache.disk_enabled());
  Compiler compiler{"bytes"};
  EXPECT_EQ(*cache.get("key", compiler.fn()), "bytes");
  EXPECT_EQ(*cache.get("key", compiler.fn()), "bytes");
  EXPECT_EQ(compiler.calls, 1);
  EXPECT_EQ(cache.stats().memory_hits, 1u);
  EXPECT_EQ(cache.stats().disk_writes, 0u);
  KernelCache another(dir);  // the same directory again: no second warning in this process
  EXPECT_FALSE(another.disk_enabled());
  const auto w = warnings();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_THAT(w[0], HasSubstr(dir.string()));
  EXPECT_THAT(w[0], HasSubstr(reason));
  EXPECT_THAT(w[0], HasSubstr("in memory only"));
  EXPECT_THAT(w[0], HasSubstr("STEPFUSE_CACHE_DIR"));
  EXPECT_EQ(list_dir_or_empty(dir), before);
}

TEST_F(KernelCacheTest, MissingDirectoryIsCreatedWithMode0700) {
  const fs::path dir = dir_.path() / "a" / "b" / "cache";
  KernelCache cache(dir);
  EXPECT_TRUE(cache.disk_enabled());
  ASSERT_TRUE(fs::is_directory(dir));
  for (const fs::path& d : {dir_.path() / "a", dir_.path() / "a" / "b", dir}) {
    struct stat st {};
    ASSERT_EQ(::stat(d.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u) << d;
  }
  cache.get("key", [] { return std::string("bytes"); });
  EXPECT_TRUE(fs::exists(cache.entry_path("key")));
  EXPECT_TRUE(warnings().empty());
}

TEST_F(KernelCacheTest, RelativeDirectoryIsMadeAbsoluteOnce) {
  const fs::path old_cwd = fs::current_path();
  fs::current_path(dir_.path());
  KernelCache cache(fs::path("relative") / "cache");
  fs::current_path(old_cwd);
  EXPECT_TRUE(cache.disk_enabled());
  ASSERT_TRUE(cache.dir().has_value());
  EXPECT_TRUE(cache.dir()->is_absolute());
  EXPECT_TRUE(fs::equivalent(*cache.dir(), dir_.path() / "relative" / "cache"));
  cache.get("key", [] { return std::string("bytes"); });
  EXPECT_TRUE(fs::exists(dir_.path() / "relative" / "cache" / expected_name("key"))) << "not under the new cwd";
}

TEST_F(KernelCacheTest, EmptyPathIsRefused) { expect_refused(fs::path(), "empty path"); }

TEST_F(KernelCacheTest, RegularFileAsDirectoryIsRefused) {
  const fs::path file = dir_.path() / "not-a-dir";
  write_file(file, "x");
  expect_refused(file, "not a directory");
  EXPECT_EQ(read_file(file), "x");
}

TEST_F(KernelCacheTest, UncreatableDirectoryIsRefused) {
  const fs::path file = dir_.path() / "file";
  write_file(file, "x");
  expect_refused(file / "cache", "cannot be created");
}

TEST_F(KernelCacheTest, DirectoryWritableByOthersIsRefused) {
  for (fs::perms extra : {fs::perms::group_write, fs::perms::others_write,
                          fs::perms::group_all | fs::perms::others_all}) {
    detail::reset_warnings_for_testing();
    {
      std::lock_guard lock(g_warnings_mutex);
      g_warnings.clear();
    }
    const fs::path dir = dir_.path() / ("mode-" + std::to_string(static_cast<int>(extra)));
    fs::create_directory(dir);
    fs::permissions(dir, fs::perms::owner_all | extra);  // not subject to the umask
    expect_refused(dir, "writable by other users");
  }
}

TEST_F(KernelCacheTest, DirectoryOfAnotherUserIsRefused) {
  if (running_as_root()) {
    const fs::path dir = dir_.path() / "nobody";
    fs::create_directory(dir);
    fs::permissions(dir, fs::perms::owner_all);
    ASSERT_EQ(::chown(dir.c_str(), 65534, 65534), 0) << std::strerror(errno);
    expect_refused(dir, "owned by uid 65534");
  } else {
    // "/" belongs to root; refusing it means nothing is ever written there.
    struct stat st {};
    ASSERT_EQ(::stat("/", &st), 0);
    if (st.st_uid == ::geteuid()) GTEST_SKIP() << "this user owns /, and cannot chown a directory away";
    expect_refused("/", "owned by uid " + std::to_string(st.st_uid));
  }
}

TEST_F(KernelCacheTest, UnwritableDirectoryIsRefused) {
  if (running_as_root()) {
    GTEST_SKIP() << "root writes through mode 0500; the ownership and mode checks are tested instead";
  }
  const fs::path dir = dir_.path() / "read-only";
  fs::create_directory(dir);
  fs::permissions(dir, fs::perms::owner_read | fs::perms::owner_exec);
  expect_refused(dir, "not writable");
}

TEST_F(KernelCacheTest, WriteFailureWarnsOnceAndTurnsTheDiskOff) {
  const fs::path dir = dir_.path() / "vanishing";
  KernelCache cache(dir);
  ASSERT_TRUE(cache.disk_enabled());
  cache.get("first", [] { return std::string("one"); });
  EXPECT_EQ(cache.stats().disk_writes, 1u);
  fs::remove_all(dir);  // every write fails from now on, as on a full disk
  EXPECT_EQ(*cache.get("second", [] { return std::string("two"); }), "two");
  EXPECT_FALSE(cache.disk_enabled());
  EXPECT_EQ(*cache.get("third", [] { return std::string("three"); }), "three");
  EXPECT_EQ(*cache.get("second", must_not_compile()), "two");
  EXPECT_EQ(*cache.get("first", must_not_compile()), "one");
  EXPECT_EQ(cache.stats().disk_writes, 1u);
  const auto w = warnings();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_THAT(w[0], HasSubstr(dir.string()));
  EXPECT_THAT(w[0], HasSubstr("failed"));
  EXPECT_THAT(w[0], HasSubstr("in memory only"));
  EXPECT_FALSE(fs::exists(dir)) << "a failed write must not recreate the directory";
}

TEST_F(KernelCacheTest, DefaultDirFollowsTheEnvironment) {
  // Restores the three variables, set or unset, whatever the test does.
  struct Saved {
    const char* name;
    std::optional<std::string> value;
  };
  std::vector<Saved> saved;
  for (const char* name : {"STEPFUSE_CACHE_DIR", "XDG_CACHE_HOME", "HOME"}) {
    const char* v = std::getenv(name);
    saved.push_back({name, v ? std::optional<std::string>(v) : std::nullopt});
  }
  struct Restore {
    std::vector<Saved>& saved;
    ~Restore() {
      for (const auto& s : saved) {
        if (s.value) ::setenv(s.name, s.value->c_str(), 1);
        else ::unsetenv(s.name);
      }
    }
  } restore{saved};
  const auto set = [](const char* name, const char* value) {
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  };
  struct Case {
    const char* cache_dir;
    const char* xdg;
    const char* home;
    std::optional<fs::path> expected;
  };
  const std::vector<Case> cases = {
      {"/srv/kernels", "/xdg", "/home/u", fs::path("/srv/kernels")},
      {"relative/kernels", nullptr, nullptr, fs::path("relative/kernels")},
      {"off", "/xdg", "/home/u", std::nullopt},
      {"", "/xdg", "/home/u", std::nullopt},
      {nullptr, "/xdg/cache", "/home/u", fs::path("/xdg/cache/stepfuse")},
      {nullptr, "relative/cache", "/home/u", fs::path("/home/u/.cache/stepfuse")},
      {nullptr, "", "/home/u", fs::path("/home/u/.cache/stepfuse")},
      {nullptr, nullptr, "/home/u", fs::path("/home/u/.cache/stepfuse")},
      {nullptr, "relative/cache", nullptr, std::nullopt},
      {nullptr, nullptr, "", std::nullopt},
      {nullptr, nullptr, nullptr, std::nullopt},
  };
  for (const Case& c : cases) {
    set("STEPFUSE_CACHE_DIR", c.cache_dir);
    set("XDG_CACHE_HOME", c.xdg);
    set("HOME", c.home);
    SCOPED_TRACE(std::string("STEPFUSE_CACHE_DIR=") + (c.cache_dir ? c.cache_dir : "(unset)") +
                 " XDG_CACHE_HOME=" + (c.xdg ? c.xdg : "(unset)") + " HOME=" + (c.home ? c.home : "(unset)"));
    EXPECT_EQ(KernelCache::default_dir(), c.expected);
  }
}

TEST_F(KernelCacheTest, SharedCacheIsOneObjectOnTheDefaultDirectory) {
  const fs::path dir = dir_.path() / "shared";
  const char* old = std::getenv("STEPFUSE_CACHE_DIR");
  const std::optional<std::string> saved = old ? std::optional<std::string>(old) : std::nullopt;
  ::setenv("STEPFUSE_CACHE_DIR", dir.c_str(), 1);
  KernelCache& shared = KernelCache::shared();
  if (saved) ::setenv("STEPFUSE_CACHE_DIR", saved->c_str(), 1);
  else ::unsetenv("STEPFUSE_CACHE_DIR");
  EXPECT_EQ(&shared, &KernelCache::shared());
  EXPECT_EQ(shared.dir(), std::optional<fs::path>(dir)) << "the first call decides (no other test calls shared())";
  EXPECT_TRUE(shared.disk_enabled());
}

// ---- what the cache trusts: its directory, opened once, and each entry file ------------------

// The directory that a path names is decided once, at construction: the cache keeps it
// open and does every later open, rename and unlink relative to it.

TEST_F(KernelCacheTest, SymlinkAsTheDirectoryIsRefused) {
  const fs::path real = dir_.path() / "real";
  fs::create_directory(real);
  fs::permissions(real, fs::perms::owner_all);
  const fs::path link = dir_.path() / "link";
  fs::create_directory_symlink(real, link);
  expect_refused(link, "is a symbolic link");
  EXPECT_TRUE(list_dir(real).empty());
}

// Someone able to rename a parent swaps the cache directory for their own after the
// cache was made, holding a well-formed entry under the predictable name. The cache
// neither loads from nor writes to it.
TEST_F(KernelCacheTest, DirectorySwappedAfterConstructionIsNotFollowed) {
  const std::string key = make_key("swapped");
  for (const bool as_symlink : {true, false}) {
    SCOPED_TRACE(as_symlink ? "replaced by a symlink" : "replaced by another directory");
    const fs::path dir = dir_.path() / (as_symlink ? "cache-a" : "cache-b");
    const fs::path moved = dir_.path() / (as_symlink ? "moved-a" : "moved-b");
    const fs::path theirs = dir_.path() / (as_symlink ? "theirs-a" : "theirs-b");
    KernelCache cache(dir);
    ASSERT_TRUE(cache.disk_enabled());
    EXPECT_EQ(*cache.get(key, [] { return std::string("good"); }), "good");
    cache.clear_memory();
    fs::rename(dir, moved);
    fs::create_directory(theirs);
    fs::permissions(theirs, fs::perms::owner_all);
    write_file(theirs / expected_name(key), build_entry(key, "evil"));
    if (as_symlink) fs::create_directory_symlink(theirs, dir);
    else fs::rename(theirs, dir);
    EXPECT_EQ(*cache.get(key, must_not_compile()), "good") << "loaded from the directory it opened";
    EXPECT_EQ(*cache.get(key + " other", [] { return std::string("new"); }), "new");
    EXPECT_TRUE(fs::exists(moved / expected_name(key + " other"))) << "written where it was opened";
    const fs::path now = as_symlink ? theirs : dir;
    EXPECT_EQ(list_dir(now), std::vector<std::string>{expected_name(key)}) << "nothing written to theirs";
    EXPECT_EQ(read_file(now / expected_name(key)), build_entry(key, "evil"));
  }
  EXPECT_TRUE(warnings().empty());
}

// An entry file the cache did not write as it writes them: loaded never, warned about
// once per directory, recompiled and replaced by a private regular file.
void expect_entry_refused(const fs::path& dir, const std::string& key, const std::string& reason) {
  SCOPED_TRACE(reason);
  KernelCache cache(dir);
  ASSERT_TRUE(cache.disk_enabled());
  Compiler compiler{"compiled"};
  EXPECT_EQ(*cache.get(key, compiler.fn()), "compiled");
  EXPECT_EQ(compiler.calls, 1);
  EXPECT_EQ(cache.stats().disk_rejects, 1u);
  EXPECT_EQ(cache.stats().disk_hits, 0u);
  const auto w = warnings();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_THAT(w[0], HasSubstr(cache.entry_path(key).string()));
  EXPECT_THAT(w[0], HasSubstr(reason));
  EXPECT_THAT(w[0], HasSubstr("not loaded"));
  struct stat st {};
  ASSERT_EQ(::lstat(cache.entry_path(key).c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_uid, ::geteuid());
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  KernelCache again(dir);
  EXPECT_EQ(*again.get(key, must_not_compile()), "compiled");
}

TEST_F(KernelCacheTest, EntryThatIsASymlinkIsRefused) {
  const std::string key = make_key("symlinked-entry");
  const fs::path elsewhere = dir_.path() / "elsewhere";
  fs::create_directory(elsewhere);
  write_file(elsewhere / "entry", build_entry(key, "evil"));
  const fs::path dir = dir_.path() / "cache";
  KernelCache(dir).get("unrelated", [] { return std::string("x"); });  // creates the directory
  fs::create_symlink(elsewhere / "entry", dir / expected_name(key));
  expect_entry_refused(dir, key, "symbolic link");
  EXPECT_EQ(read_file(elsewhere / "entry"), build_entry(key, "evil")) << "the link's target is left alone";
}

TEST_F(KernelCacheTest, EntryWritableByOthersIsRefused) {
  for (const fs::perms extra : {fs::perms::group_write, fs::perms::others_write}) {
    detail::reset_warnings_for_testing();
    {
      std::lock_guard lock(g_warnings_mutex);
      g_warnings.clear();
    }
    const std::string key = make_key("writable-entry-" + std::to_string(static_cast<int>(extra)));
    KernelCache probe(dir_.path());
    write_file(probe.entry_path(key), build_entry(key, "evil"));
    fs::permissions(probe.entry_path(key), fs::perms::owner_read | fs::perms::owner_write | extra);
    expect_entry_refused(dir_.path(), key, "writable by group or others");
  }
}

TEST_F(KernelCacheTest, EntryOfAnotherUserIsRefused) {
  if (!running_as_root()) GTEST_SKIP() << "only root can give a file to another user";
  const std::string key = make_key("foreign-entry");
  KernelCache probe(dir_.path());
  write_file(probe.entry_path(key), build_entry(key, "evil"));
  fs::permissions(probe.entry_path(key), fs::perms::owner_read | fs::perms::owner_write);
  ASSERT_EQ(::chown(probe.entry_path(key).c_str(), 65534, 65534), 0) << std::strerror(errno);
  expect_entry_refused(dir_.path(), key, "owned by uid 65534");
}

TEST_F(KernelCacheTest, EntryThatIsNotARegularFileIsRefused) {
  const std::string key = make_key("fifo-entry");
  KernelCache probe(dir_.path());
  ASSERT_EQ(::mkfifo(probe.entry_path(key).c_str(), 0600), 0) << std::strerror(errno);  // would block a plain open
  expect_entry_refused(dir_.path(), key, "not a regular file");
}

// ---- eviction, the size cap, stale temporary files -------------------------------------------

// Sets an environment variable for one scope (restored, set or unset, afterwards).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Sets a file's modification time to `age` before now.
void age_file(const fs::path& path, std::chrono::seconds age) {
  struct timespec times[2];
  ::clock_gettime(CLOCK_REALTIME, &times[0]);
  times[0].tv_sec -= static_cast<time_t>(age.count());
  times[1] = times[0];
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, AT_SYMLINK_NOFOLLOW), 0) << path;
}

TEST_F(KernelCacheTest, EvictForgetsTheKeyInMemoryAndOnDisk) {
  KernelCache cache(dir_.path());
  const std::string key = make_key("evict");
  Compiler compiler{"bytes"};
  cache.get(key, compiler.fn());
  cache.get("other", [] { return std::string("kept"); });
  ASSERT_TRUE(fs::exists(cache.entry_path(key)));
  cache.evict(key);
  EXPECT_FALSE(fs::exists(cache.entry_path(key)));
  EXPECT_EQ(cache.find(key), nullptr);
  EXPECT_EQ(*cache.get(key, compiler.fn()), "bytes");
  EXPECT_EQ(compiler.calls, 2);
  EXPECT_EQ(cache.stats().disk_evictions, 1u);
  EXPECT_EQ(*cache.get("other", must_not_compile()), "kept");
  cache.evict("never stored");  // nothing to do, no error
  KernelCache(std::nullopt).evict(key);
}

TEST_F(KernelCacheTest, SizeCapEvictsTheLeastRecentlyUsedEntries) {
  const ScopedEnv cap("STEPFUSE_CACHE_MAX_SIZE", "16K");
  const auto key = [](char c) { return make_key(std::string("lru-") + c); };
  const std::string payload = make_payload(4000, 11);  // entries of about 4.6 KiB: three fit in 16 KiB
  {
    KernelCache cache(dir_.path());
    EXPECT_EQ(cache.max_disk_bytes(), 16u << 10);
    for (char c : {'a', 'b', 'c'}) cache.get(key(c), [&] { return payload; });
    EXPECT_EQ(cache.stats().disk_evictions, 0u);
  }
  KernelCache probe(dir_.path());
  age_file(probe.entry_path(key('a')), 3000s);
  age_file(probe.entry_path(key('b')), 2000s);
  age_file(probe.entry_path(key('c')), 1000s);
  KernelCache cache(dir_.path());
  EXPECT_EQ(*cache.get(key('b'), must_not_compile()), payload);  // a disk hit makes b the most recent
  cache.get(key('d'), [&] { return payload; });
  const auto present = [&](char c) { return fs::exists(cache.entry_path(key(c))); };
  EXPECT_FALSE(present('a')) << "the least recently used entry goes first";
  EXPECT_TRUE(present('b'));
  EXPECT_TRUE(present('c'));
  EXPECT_TRUE(present('d'));
  cache.get(key('e'), [&] { return payload; });
  EXPECT_FALSE(present('c'));
  EXPECT_TRUE(present('b'));
  EXPECT_TRUE(present('d'));
  EXPECT_TRUE(present('e'));
  EXPECT_EQ(cache.stats().disk_evictions, 2u);
  // An entry larger than the cap is still written (and kept until the next write).
  cache.get(key('f'), [] { return make_payload(20000, 12); });
  EXPECT_TRUE(present('f'));
  EXPECT_TRUE(warnings().empty());
}

TEST_F(KernelCacheTest, SizeCapSettings) {
  struct Case {
    const char* value;
    std::uint64_t expected;
    bool warns;
  };
  const std::uint64_t def = KernelCache::kDefaultMaxDiskBytes;
  for (const Case& c : {Case{nullptr, def, false}, Case{"", def, false}, Case{"0", 0, false},
                        Case{"12345", 12345, false}, Case{"64K", 64u << 10, false}, Case{"3M", 3u << 20, false},
                        Case{"2G", std::uint64_t{2} << 30, false}, Case{"2g", std::uint64_t{2} << 30, false},
                        Case{"lots", def, true}, Case{"-1", def, true}, Case{"1.5G", def, true},
                        Case{"99999999999999999999", def, true}, Case{"5T", def, true}}) {
    SCOPED_TRACE(c.value ? c.value : "(unset)");
    detail::reset_warnings_for_testing();
    {
      std::lock_guard lock(g_warnings_mutex);
      g_warnings.clear();
    }
    const ScopedEnv cap("STEPFUSE_CACHE_MAX_SIZE", c.value);
    KernelCache cache(dir_.path());
    EXPECT_EQ(cache.max_disk_bytes(), c.expected);
    const auto w = warnings();
    EXPECT_EQ(w.size(), c.warns ? 1u : 0u);
    if (c.warns && !w.empty()) {
      EXPECT_THAT(w[0], HasSubstr("STEPFUSE_CACHE_MAX_SIZE"));
    }
  }
}

TEST_F(KernelCacheTest, StaleTemporaryFilesAreRemoved) {
  const std::string key = make_key("temporaries");
  const std::string name = expected_name(key);
  const fs::path stale = dir_.path() / ("." + name + ".tmp-12345-0");
  const fs::path fresh = dir_.path() / ("." + name + ".tmp-12345-1");
  const fs::path other = dir_.path() / "notes.txt";
  const fs::path old_other = dir_.path() / ".other.tmp-1-1";
  for (const fs::path& p : {stale, fresh, other, old_other}) write_file(p, "partial");
  age_file(stale, 3600s);
  age_file(other, 3600s);
  age_file(old_other, 3600s);
  KernelCache cache(dir_.path());
  EXPECT_FALSE(fs::exists(stale)) << "a temporary file an hour old is from a writer that died";
  EXPECT_TRUE(fs::exists(fresh)) << "a recent one may still be being written";
  EXPECT_TRUE(fs::exists(other)) << "files that are not the cache's are left alone";
  EXPECT_TRUE(fs::exists(old_other));
  EXPECT_TRUE(warnings().empty());
}

// ---- threads ---------------------------------------------------------------------------------

TEST_F(KernelCacheTest, ConcurrentGetsOfOneKeyCompileOnce) {
  KernelCache cache(dir_.path());
  const std::string payload = make_payload(100000, 8);
  std::atomic<int> calls{0};
  const auto compile = [&] {
    ++calls;
    std::this_thread::sleep_for(50ms);
    return payload;
  };
  constexpr int kThreads = 8;
  std::latch start(kThreads);
  std::vector<std::shared_ptr<const std::string>> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      results[t] = cache.get("one key", compile);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(calls, 1);
  for (const auto& r : results) {
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(r, results[0]);
    EXPECT_TRUE(*r == payload);
  }
  const CacheStats s = cache.stats();
  EXPECT_EQ(s.compiles, 1u);
  EXPECT_EQ(s.memory_hits, kThreads - 1u) << "threads that waited count as memory hits";
  EXPECT_EQ(s.disk_writes, 1u);
}

TEST_F(KernelCacheTest, DifferentKeysCompileConcurrently) {
  KernelCache cache(dir_.path());
  std::mutex mu;
  std::condition_variable cv;
  int in_progress = 0;
  int most_in_progress = 0;
  // Each compile waits (up to 30 s, far beyond any scheduling delay) until the other
  // one is running too: with the cache's lock held during compile, they never would be.
  const auto compile = [&](std::string bytes) {
    std::unique_lock lock(mu);
    ++in_progress;
    most_in_progress = std::max(most_in_progress, in_progress);
    cv.notify_all();
    cv.wait_for(lock, 30s, [&] { return most_in_progress >= 2; });
    --in_progress;
    return bytes;
  };
  std::thread a([&] { EXPECT_EQ(*cache.get("key a", [&] { return compile("a"); }), "a"); });
  std::thread b([&] { EXPECT_EQ(*cache.get("key b", [&] { return compile("b"); }), "b"); });
  a.join();
  b.join();
  EXPECT_EQ(most_in_progress, 2) << "the two compiles never overlapped";
  EXPECT_EQ(cache.stats().compiles, 2u);
}

TEST_F(KernelCacheTest, CompileErrorReachesEveryWaiterAndIsNotCached) {
  KernelCache cache(dir_.path());
  constexpr int kThreads = 6;
  std::atomic<int> arrived{0};
  std::atomic<int> calls{0};
  // The first compile waits until every thread has called get() (and then a little, for
  // them to reach the wait), so all of them share its one exception.
  const auto failing = [&]() -> std::string {
    const int n = ++calls;
    while (arrived < kThreads) std::this_thread::sleep_for(1ms);
    std::this_thread::sleep_for(200ms);
    throw std::runtime_error("nvrtc failed #" + std::to_string(n));
  };
  std::vector<std::string> messages(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ++arrived;
      try {
        cache.get("bad key", failing);
        messages[t] = "(no exception)";
      } catch (const std::runtime_error& e) {
        messages[t] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(calls, 1);
  for (const auto& m : messages) EXPECT_EQ(m, "nvrtc failed #1");
  EXPECT_FALSE(fs::exists(cache.entry_path("bad key")));
  EXPECT_EQ(cache.stats().memory_hits, 0u);
  EXPECT_EQ(cache.stats().disk_writes, 0u);
  // Tried again, and this time it works.
  Compiler compiler{"fixed"};
  EXPECT_EQ(*cache.get("bad key", compiler.fn()), "fixed");
  EXPECT_EQ(*cache.get("bad key", compiler.fn()), "fixed");
  EXPECT_EQ(compiler.calls, 1);
  EXPECT_TRUE(fs::exists(cache.entry_path("bad key")));
  EXPECT_EQ(cache.stats().compiles, 2u);
}

TEST_F(KernelCacheTest, CompileErrorLeavesNoTraceSingleThreaded) {
  KernelCache cache(dir_.path());
  int calls = 0;
  for (int i = 0; i < 3; ++i) {
    EXPECT_THROW(cache.get("k", [&]() -> std::string {
      ++calls;
      throw std::logic_error("boom");
    }),
                 std::logic_error);
  }
  EXPECT_EQ(calls, 3);
  EXPECT_TRUE(list_dir(dir_.path()).empty()) << "no entry and no temporary file";
}

// ---- processes -------------------------------------------------------------------------------

// Runs in a forked child: no gtest assertions, a status code instead.
int child_fills_cache(const fs::path& dir, int start_fd, const std::vector<std::string>& keys) {
  char byte;
  if (::read(start_fd, &byte, 1) != 0) return 10;  // EOF: every child starts at once
  KernelCache cache(dir);
  if (!cache.disk_enabled()) return 11;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    std::shared_ptr<const std::string> bytes;
    try {
      bytes = cache.get(keys[i], [i] {
        std::this_thread::sleep_for(20ms);
        return make_payload(4 << 20, 100 + i);
      });
    } catch (...) {
      return 12;
    }
    if (*bytes != make_payload(4 << 20, 100 + i)) return 13;
  }
  // Read again while the other children may still be renaming their copies over the
  // entries: every load must find a whole entry.
  for (int round = 0; round < 10; ++round) {
    cache.clear_memory();
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const auto bytes = cache.get(keys[i], [i] { return make_payload(4 << 20, 100 + i); });
      if (*bytes != make_payload(4 << 20, 100 + i)) return 15;
    }
    if (cache.stats().disk_rejects != 0) return 16;
  }
  return cache.disk_enabled() ? 0 : 14;
}

TEST_F(KernelCacheTest, ProcessesWritingTheSameKeysLeaveWholeEntries) {
  const std::vector<std::string> keys = {make_key("process-a"), make_key("process-b")};
  int start[2];
  ASSERT_EQ(::pipe(start), 0);
  std::vector<pid_t> children;
  for (int c = 0; c < 4; ++c) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << std::strerror(errno);
    if (pid == 0) {
      ::close(start[1]);
      ::_exit(child_fills_cache(dir_.path(), start[0], keys));
    }
    children.push_back(pid);
  }
  ::close(start[0]);
  ::close(start[1]);  // go
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status)) << "child " << pid << " did not exit normally";
    EXPECT_EQ(WEXITSTATUS(status), 0) << "child " << pid;
  }
  std::vector<std::string> expected = {expected_name(keys[0]), expected_name(keys[1])};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(list_dir(dir_.path()), expected) << "two entries, no temporary files";
  KernelCache cache(dir_.path());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    EXPECT_TRUE(*cache.get(keys[i], must_not_compile()) == make_payload(4 << 20, 100 + i));
  }
  EXPECT_EQ(cache.stats().disk_hits, 2u);
  EXPECT_EQ(cache.stats().disk_rejects, 0u);
  EXPECT_TRUE(warnings().empty());
}

// ---- cost (printed, not asserted) ------------------------------------------------------------

TEST_F(KernelCacheTest, MemoryHitCost) {
  KernelCache cache(dir_.path());
  const std::string key = make_key("hot", 1024);
  cache.get(key, [] { return make_payload(50000, 1); });
  constexpr int kHits = 100000;
  const auto compile = must_not_compile();
  std::size_t sink = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kHits; ++i) sink += cache.get(key, compile)->size();
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / kHits;
  EXPECT_EQ(sink, std::size_t{50000} * kHits);
  EXPECT_EQ(cache.stats().memory_hits, std::uint64_t{kHits});
  std::cout << "[ cost     ] memory hit, " << key.size() << "-byte key: " << ns << " ns\n";
  RecordProperty("memory_hit_ns", std::to_string(ns));
}

TEST_F(KernelCacheTest, DiskHitCost) {
  KernelCache cache(dir_.path());
  for (std::size_t size : {std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{4} << 20}) {
    const std::string key = make_key("disk-" + std::to_string(size), 2000);
    cache.get(key, [size] { return make_payload(size, 2); });
    constexpr int kLoads = 50;
    double total_ms = 0;
    for (int i = 0; i < kLoads; ++i) {
      cache.clear_memory();
      const auto start = std::chrono::steady_clock::now();
      cache.get(key, must_not_compile());
      total_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      ASSERT_EQ(cache.stats().disk_hits, 1u);
    }
    std::cout << "[ cost     ] disk hit (page cache warm), " << (size >> 10) << " KiB: " << total_ms / kLoads
              << " ms\n";
    RecordProperty("disk_hit_ms_" + std::to_string(size >> 10) + "KiB", std::to_string(total_ms / kLoads));
  }
}

}  // namespace
}  // namespace stepfuse::jit
