// Safetensors files: the header's JSON, the checked reader, the streamed atomic writer and the checksum.
#include "runtime/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <system_error>
#include <tuple>

// Header-only, as in jit/kernel_cache.cpp: nothing to link (see the find_path in CMakeLists.txt).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "jit/base/atomic_file.hpp"
#include "jit/base/warning.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::detail {

static_assert(std::endian::native == std::endian::little,
              "safetensors files are little-endian; a big-endian port needs byte swaps here");

namespace {

// The reference implementation's limit on the header (a reader refuses more).
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
constexpr std::size_t kMaxJsonDepth = 64;
constexpr std::string_view kChecksumKey = "checksum";
constexpr std::string_view kChecksumPrefix = "xxh3_64:";

[[noreturn]] void io_error(const std::string& message) { throw Error(ErrorCode::io_error, message); }

// ---- JSON parsing ----

class JsonParser {
 public:
  explicit JsonParser(std::string_view text) : s_(text) {}

  JsonValue document() {
    if (!is_valid_utf8(s_)) fail("the text is not valid UTF-8");
    skip_space();
    JsonValue v = value(0);
    skip_space();
    if (at_ != s_.size()) fail("unexpected text after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw JsonError(what, at_); }
  void skip_space() {
    while (at_ < s_.size() && (s_[at_] == ' ' || s_[at_] == '\t' || s_[at_] == '\n' || s_[at_] == '\r')) ++at_;
  }
  bool eat(char c) {
    if (at_ < s_.size() && s_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }

  JsonValue value(std::size_t depth) {
    if (depth >= kMaxJsonDepth) fail("nested too deeply");
    if (at_ >= s_.size()) fail("unexpected end of text");
    JsonValue v;
    const char c = s_[at_];
    if (c == '{') {
      v.kind = JsonValue::Kind::object;
      ++at_;
      skip_space();
      if (eat('}')) return v;
      while (true) {
        skip_space();
        if (at_ >= s_.size() || s_[at_] != '"') fail("expected a string key");
        std::string key = string();
        for (const auto& m : v.members)
          if (m.first == key) fail("duplicate key \"" + key + "\"");
        skip_space();
        expect(':');
        skip_space();
        JsonValue member = value(depth + 1);
        v.members.emplace_back(std::move(key), std::move(member));
        skip_space();
        if (eat('}')) return v;
        expect(',');
      }
    }
    if (c == '[') {
      v.kind = JsonValue::Kind::array;
      ++at_;
      skip_space();
      if (eat(']')) return v;
      while (true) {
        skip_space();
        v.items.push_back(value(depth + 1));
        skip_space();
        if (eat(']')) return v;
        expect(',');
      }
    }
    if (c == '"') {
      v.kind = JsonValue::Kind::string;
      v.text = string();
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = JsonValue::Kind::number;
      v.text = number();
      return v;
    }
    for (const auto& [word, kind, b] : {std::tuple{std::string_view("true"), JsonValue::Kind::boolean, true},
                                        std::tuple{std::string_view("false"), JsonValue::Kind::boolean, false},
                                        std::tuple{std::string_view("null"), JsonValue::Kind::null, false}}) {
      if (s_.substr(at_, word.size()) == word) {
        at_ += word.size();
        v.kind = kind;
        v.boolean = b;
        return v;
      }
    }
    fail("expected a value");
  }

  std::string number() {
    const std::size_t begin = at_;
    const auto digits = [&] {
      const std::size_t from = at_;
      while (at_ < s_.size() && s_[at_] >= '0' && s_[at_] <= '9') ++at_;
      if (at_ == from) fail("expected a digit");
    };
    eat('-');
    if (eat('0')) {
      if (at_ < s_.size() && s_[at_] >= '0' && s_[at_] <= '9') fail("a number with a leading zero");
    } else {
      digits();
    }
    if (eat('.')) digits();
    if (eat('e') || eat('E')) {
      if (!eat('+')) eat('-');
      digits();
    }
    return std::string(s_.substr(begin, at_ - begin));
  }

  unsigned hex4() {
    unsigned v = 0;
    for (int i = 0; i < 4; ++i, ++at_) {
      if (at_ >= s_.size()) fail("unexpected end of text in a \\u escape");
      const char c = s_[at_];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) fail("a \\u escape needs four hex digits");
      v = v * 16 + static_cast<unsigned>(d);
    }
    return v;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (at_ >= s_.size()) fail("unterminated string");
      const char c = s_[at_];
      if (c == '"') {
        ++at_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character in a string (it must be escaped)");
      if (c != '\\') {
        out += c;  // UTF-8 already checked for the whole text
        ++at_;
        continue;
      }
      ++at_;
      if (at_ >= s_.size()) fail("unterminated escape");
      const char e = s_[at_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("a lone low surrogate in a \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (!(eat('\\') && eat('u'))) fail("a high surrogate without its low surrogate");
            const unsigned low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("a high surrogate without its low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: --at_; fail(std::string("an unknown escape \\") + e);
      }
    }
  }

  std::string_view s_;
  std::size_t at_ = 0;
};

// ---- the checksum ----

class Checksum {
 public:
  Checksum() {
    XXH3_INITSTATE(&state_);
    XXH3_64bits_reset(&state_);
  }
  void bytes(const void* data, std::size_t n) { XXH3_64bits_update(&state_, data, n); }
  void u64(std::uint64_t v) { bytes(&v, 8); }
  void str(std::string_view s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  // The canonical header bytes (see safetensors.hpp).
  void header(const std::map<std::string, std::string>& metadata, const std::vector<SafetensorsTensor>& tensors) {
    std::uint64_t n = 0;
    for (const auto& [key, value] : metadata) n += key != kChecksumKey;
    u64(n);
    for (const auto& [key, value] : metadata)  // std::map: byte-wise key order
      if (key != kChecksumKey) str(key), str(value);
    u64(tensors.size());
    for (const SafetensorsTensor& t : tensors) {
      str(t.name);
      str(t.dtype);
      u64(t.shape.size());
      for (std::uint64_t d : t.shape) u64(d);
      u64(t.begin);
      u64(t.end);
    }
  }
  std::string finish() const {
    const std::uint64_t h = XXH3_64bits_digest(&state_);
    static constexpr char kHex[] = "0123456789abcdef";
    std::string s(kChecksumPrefix);
    for (int i = 15; i >= 0; --i) s += kHex[(h >> (4 * i)) & 0xf];
    return s;
  }

 private:
  XXH3_state_t state_;
};

// Bits per element of the format's dtypes (sub-byte ones included, so a foreign file's
// layout can be checked), or 0 for a name the format does not have.
std::uint64_t dtype_bits(std::string_view dtype) {
  static constexpr std::pair<std::string_view, std::uint64_t> kBits[] = {
      {"BOOL", 8},     {"U8", 8},        {"I8", 8},        {"F8_E5M2", 8},  {"F8_E4M3", 8}, {"F8_E8M0", 8},
      {"I16", 16},     {"U16", 16},      {"F16", 16},      {"BF16", 16},    {"I32", 32},    {"U32", 32},
      {"F32", 32},     {"C64", 64},      {"F64", 64},      {"I64", 64},     {"U64", 64},    {"F4", 4},
      {"F6_E2M3", 6},  {"F6_E3M2", 6}};
  for (const auto& [name, bits] : kBits)
    if (name == dtype) return bits;
  return 0;
}

std::string json_quoted(std::string_view s) {
  std::string out;
  append_json_string(out, is_valid_utf8(s) ? s : std::string_view("?"));
  return out;
}

}  // namespace

// ---- JSON ----

const JsonValue* JsonValue::find(std::string_view key) const {
  for (const auto& [k, v] : members)
    if (k == key) return &v;
  return nullptr;
}

JsonValue parse_json(std::string_view text) { return JsonParser(text).document(); }

bool is_valid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t len;
    unsigned cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i < len) return false;
    for (std::size_t k = 1; k < len; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      cp = cp << 6 | (b & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are not UTF-8.
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += len;
  }
  return true;
}

void append_json_string(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += "\\u00";
          out += kHex[static_cast<unsigned char>(c) >> 4];
          out += kHex[c & 0xf];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void append_json_double(std::string& out, double v) {
  if (std::isnan(v)) {
    out += "\"nan\"";
  } else if (std::isinf(v)) {
    out += v > 0 ? "\"inf\"" : "\"-inf\"";
  } else {
    char buf[32];  // the longest shortest form, "-2.2250738585072014e-308", is 24 characters
    const std::to_chars_result r = std::to_chars(buf, buf + sizeof buf, v);
    out.append(buf, r.ptr);  // e.g. "0.001", "1e-08", "2000", "-0": JSON numbers, read back exactly
    // "2000.0": a float to JSON readers that tell integers apart (Python's json).
    if (std::find_if(buf, r.ptr, [](char c) { return c == '.' || c == 'e'; }) == r.ptr) out += ".0";
  }
}

std::optional<std::uint64_t> json_uint(const JsonValue& v) {
  if (v.kind != JsonValue::Kind::number || v.text.empty()) return std::nullopt;
  std::uint64_t n = 0;
  const char* end = v.text.data() + v.text.size();
  const auto r = std::from_chars(v.text.data(), end, n);
  if (r.ec != std::errc{} || r.ptr != end) return std::nullopt;  // a sign, fraction, exponent or overflow
  return n;
}

std::optional<double> json_double(const JsonValue& v) {
  if (v.kind == JsonValue::Kind::string) {
    if (v.text == "inf") return INFINITY;
    if (v.text == "-inf") return -INFINITY;
    if (v.text == "nan") return NAN;
    return std::nullopt;
  }
  if (v.kind != JsonValue::Kind::number) return std::nullopt;
  double d = 0;
  const char* end = v.text.data() + v.text.size();
  const auto r = std::from_chars(v.text.data(), end, d);  // correctly rounded: exact for what to_chars wrote
  if (r.ec != std::errc{} || r.ptr != end) return std::nullopt;
  return d;
}

// ---- reading ----

SafetensorsFile::SafetensorsFile(MappedFile file) : file_(std::move(file)) {
  const std::string what = "checkpoint '" + file_.path() + "'";
  const std::span<const unsigned char> bytes = file_.bytes();
  const auto not_ours = [&](const std::string& why) {
    io_error(what + " is not a stepfuse checkpoint (" + why + ")");
  };
  if (bytes.size() < 8)
    not_ours(std::to_string(bytes.size()) + " bytes: too short for a safetensors header; a torn or partial write?");
  std::uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  if (n > kMaxHeaderBytes)
    not_ours("it starts with neither \"STEPFUSE\" nor a safetensors header length: read as one, it says " +
             std::to_string(n) + " bytes, more than the format's " + std::to_string(kMaxHeaderBytes));
  if (n > bytes.size() - 8)
    io_error(what + " is truncated: " + std::to_string(bytes.size()) + " bytes, less than its " + std::to_string(n) +
             "-byte safetensors header needs (a torn or partial write?)");
  const std::string_view header(reinterpret_cast<const char*>(bytes.data() + 8), static_cast<std::size_t>(n));
  const std::size_t first = header.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos || header[first] != '{')
    not_ours("it starts with neither \"STEPFUSE\" nor a safetensors header");
  JsonValue root;
  try {
    root = parse_json(header);
  } catch (const JsonError& e) {
    io_error(what + " is corrupt: its safetensors header is not valid JSON (" + e.what() + ", at byte " +
             std::to_string(8 + e.offset) + ")");
  }
  const auto corrupt = [&](const std::string& why) { io_error(what + " is corrupt: " + why); };
  if (root.kind != JsonValue::Kind::object) corrupt("its safetensors header is not a JSON object");
  for (auto& [name, v] : root.members) {
    if (name == "__metadata__") {
      if (v.kind != JsonValue::Kind::object) corrupt("its \"__metadata__\" is not a JSON object");
      for (auto& [key, value] : v.members) {
        if (value.kind != JsonValue::Kind::string)
          corrupt("its \"__metadata__\" entry " + json_quoted(key) + " is not a string (the format allows strings only)");
        metadata_[key] = std::move(value.text);
      }
      continue;
    }
    const std::string at = "tensor " + json_quoted(name);
    if (v.kind != JsonValue::Kind::object) corrupt(at + " is not described by a JSON object");
    SafetensorsTensor t;
    t.name = name;
    const JsonValue* dtype = v.find("dtype");
    const JsonValue* shape = v.find("shape");
    const JsonValue* offsets = v.find("data_offsets");
    if (dtype == nullptr || dtype->kind != JsonValue::Kind::string) corrupt(at + " has no \"dtype\" string");
    if (shape == nullptr || shape->kind != JsonValue::Kind::array) corrupt(at + " has no \"shape\" array");
    if (offsets == nullptr || offsets->kind != JsonValue::Kind::array || offsets->items.size() != 2)
      corrupt(at + " has no \"data_offsets\" pair");
    t.dtype = dtype->text;
    for (const JsonValue& d : shape->items) {
      const auto dim = json_uint(d);
      if (!dim) corrupt(at + " has a shape entry that is not a non-negative integer");
      t.shape.push_back(*dim);
    }
    const auto begin = json_uint(offsets->items[0]), end = json_uint(offsets->items[1]);
    if (!begin || !end) corrupt(at + " has data_offsets that are not non-negative integers");
    t.begin = *begin;
    t.end = *end;
    tensors_.push_back(std::move(t));
  }
  // As the reference reader: in data order, covering [0, end) exactly, each range the
  // size of its elements.
  std::stable_sort(tensors_.begin(), tensors_.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t start = 0;
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const SafetensorsTensor& t = tensors_[i];
    const std::string at = "tensor " + json_quoted(t.name);
    if (t.begin != start || t.end < t.begin)
      corrupt(at + " has data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
              "] where the data section's next range starts at " + std::to_string(start) +
              " (the tensors must cover it in order, without holes or overlaps)");
    const std::uint64_t bits = dtype_bits(t.dtype);
    if (bits == 0) corrupt(at + " has dtype " + json_quoted(t.dtype) + ", which is not a safetensors dtype");
    std::uint64_t elements = 1;
    bool overflow = false;
    for (std::uint64_t d : t.shape) overflow |= __builtin_mul_overflow(elements, d, &elements);
    std::uint64_t total_bits = 0;
    overflow |= __builtin_mul_overflow(elements, bits, &total_bits);
    if (overflow || total_bits % 8 != 0 || total_bits / 8 != t.end - t.begin)
      corrupt(at + "'s data_offsets span " + std::to_string(t.end - t.begin) + " bytes, not the size of its " +
              t.dtype + " elements");
    start = t.end;
    by_name_.emplace(t.name, i);
  }
  const std::uint64_t present = bytes.size() - 8 - n;  // the data section's bytes in the file
  if (start != present)
    io_error(what + " is " + (start > present ? "truncated" : "longer than its header says") + ": its data section holds " +
             std::to_string(present) + " bytes, its safetensors header describes " + std::to_string(start) +
             " (a torn or partial write?)");
  data_ = bytes.subspan(static_cast<std::size_t>(8 + n));
}

const std::string* SafetensorsFile::meta(std::string_view key) const {
  const auto it = metadata_.find(std::string(key));
  return it == metadata_.end() ? nullptr : &it->second;
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

std::string safetensors_checksum(const std::map<std::string, std::string>& metadata,
                                 const std::vector<SafetensorsTensor>& tensors, std::string_view data) {
  Checksum sum;
  sum.header(metadata, tensors);
  sum.bytes(data.data(), data.size());
  return sum.finish();
}

void SafetensorsFile::verify_checksum() const {
  const std::string what = "checkpoint '" + file_.path() + "'";
  const std::string* stored = meta(kChecksumKey);
  if (stored == nullptr) io_error(what + " is corrupt: its metadata has no \"checksum\" entry");
  if (safetensors_checksum(metadata_, tensors_, {reinterpret_cast<const char*>(data_.data()), data_.size()}) != *stored)
    io_error(what + " is corrupt: its checksum does not match its contents");
}

// ---- writing ----

void write_safetensors(const std::string& path, const std::map<std::string, std::string>& metadata,
                       const std::vector<SafetensorsSource>& sources) {
  const auto bad = [](const std::string& why) { throw Error(ErrorCode::invalid_argument, why); };
  if (path.empty()) bad("checkpoint path is empty");
  for (const auto& [key, value] : metadata) {
    if (key == kChecksumKey) bad("checkpoint metadata may not set \"checksum\" (the writer computes it)");
    if (!is_valid_utf8(key) || !is_valid_utf8(value))
      bad("checkpoint metadata " + json_quoted(key) + " is not valid UTF-8, which a safetensors header must be");
  }
  // The table, in the order given, and the canonical header's checksum.
  std::vector<SafetensorsTensor> table;
  std::map<std::string_view, bool> names;
  std::uint64_t offset = 0;
  for (const SafetensorsSource& s : sources) {
    if (!is_valid_utf8(s.name)) bad("a checkpoint tensor name is not valid UTF-8, which a safetensors header must be");
    if (s.name == "__metadata__" || !names.emplace(s.name, true).second)
      bad("checkpoint tensor name " + json_quoted(s.name) + " is used twice (or is \"__metadata__\")");
    if (s.dtype != "F32" && s.dtype != "BF16" && s.dtype != "U8")
      bad("checkpoint tensor " + json_quoted(s.name) + " has dtype " + json_quoted(s.dtype) +
          " (the writer writes F32, BF16 and U8)");
    const std::uint64_t size = s.dtype == "F32" ? 4 : s.dtype == "BF16" ? 2 : 1;
    if (s.numel > (~std::uint64_t{0} - offset) / size) bad("checkpoint tensors exceed 2^64 bytes");
    table.push_back({s.name, std::string(s.dtype), {s.numel}, offset, offset + s.numel * size});
    offset = table.back().end;
  }
  Checksum sum;
  sum.header(metadata, table);

  // The header: "__metadata__" (with the checksum's placeholder, whose place is kept to
  // fill in once the data is written), then the tensors in data order.
  std::map<std::string_view, std::string_view> all(metadata.begin(), metadata.end());
  const std::string placeholder = std::string(kChecksumPrefix) + std::string(16, '0');
  all.emplace(kChecksumKey, placeholder);
  std::string header = "{\"__metadata__\":{";
  std::size_t checksum_at = 0;
  for (const auto& [key, value] : all) {
    if (header.back() != '{') header += ',';
    append_json_string(header, key);
    header += ':';
    if (key == kChecksumKey) checksum_at = header.size() + 1;  // after the opening quote
    append_json_string(header, value);
  }
  header += '}';
  for (const SafetensorsTensor& t : table) {
    header += ',';
    append_json_string(header, t.name);
    header += ":{\"dtype\":\"" + t.dtype + "\",\"shape\":[" + std::to_string(t.shape[0]) + "],\"data_offsets\":[" +
              std::to_string(t.begin) + "," + std::to_string(t.end) + "]}";
  }
  header += '}';
  header.resize((header.size() + 7) / 8 * 8, ' ');  // the data section 8-byte aligned, as the reference writer pads
  if (header.size() > kMaxHeaderBytes)
    bad("the checkpoint's safetensors header would be " + std::to_string(header.size()) +
        " bytes, more than the format's " + std::to_string(kMaxHeaderBytes) + " (too many tensors)");

  const AtomicWriteResult result = write_file_atomically(path, 0600, [&](AtomicFileSink& out) {
    const std::uint64_t n = header.size();
    out.write(&n, 8);
    out.write(header.data(), header.size());
    // In pieces that stay in cache between the checksum's read and the write's.
    constexpr std::size_t kPiece = std::size_t{1} << 20;
    for (std::size_t i = 0; i < sources.size(); ++i) {
      const auto* p = static_cast<const unsigned char*>(sources[i].data);
      for (std::uint64_t left = table[i].end - table[i].begin; left > 0 && out.error() == 0;) {
        const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(left, kPiece));
        sum.bytes(p, k);
        out.write(p, k);
        p += k;
        left -= k;
      }
    }
    const std::string digest = sum.finish();
    out.write_at(8 + checksum_at, digest.data(), digest.size());
  });
  if (result.failure) io_error("cannot write checkpoint '" + path + "': " + result.failure->describe());
  if (result.directory_sync)
    warn_once("checkpoint.directory_sync:" + result.directory_sync->temp_path.string(),
              "checkpoint '" + path + "' was written, but " + result.directory_sync->describe() +
                  ", so after a crash the file there before may come back (this is said once per directory)");
}

}  // namespace stepfuse::detail
