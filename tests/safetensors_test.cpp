// Checkpoints as safetensors files: the header's JSON (parser and exact doubles), the
// layout the format prescribes, the reader's checks, the checksum, and a checkpoint
// opened by the safetensors Python package (skipped where it is not installed).
#include <gtest/gtest.h>

#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "checkpoint_support.hpp"
#include "jit/base/format.hpp"
#include "jit/config_fields.hpp"
#include "runtime/safetensors.hpp"

namespace stepfuse {
namespace {

using namespace ckpt_test;
using detail::JsonValue;

// ---- JSON ----

std::string json_error(std::string_view text) {
  try {
    detail::parse_json(text);
  } catch (const detail::JsonError& e) {
    return e.what();
  }
  return "";
}

TEST(SafetensorsJson, ParsesWhatJsonAllows) {
  const JsonValue v = detail::parse_json(
      " {\"a\": [1, -0, 0.5E-3, 1e5, true, false, null], \"s\": \"\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00\", "
      "\"\xc3\xa9\": {}} ");
  ASSERT_EQ(v.kind, JsonValue::Kind::object);
  ASSERT_EQ(v.members.size(), 3u);
  const JsonValue& a = *v.find("a");
  ASSERT_EQ(a.items.size(), 7u);
  EXPECT_EQ(a.items[1].text, "-0");
  EXPECT_EQ(detail::json_double(a.items[2]), 0.5e-3);
  EXPECT_EQ(detail::json_uint(a.items[3]), std::nullopt) << "an exponent is not an integer";
  EXPECT_EQ(detail::json_uint(a.items[0]), 1u);
  EXPECT_TRUE(a.items[4].boolean);
  EXPECT_EQ(a.items[6].kind, JsonValue::Kind::null);
  EXPECT_EQ(v.find("s")->text, "\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_NE(v.find("\xc3\xa9"), nullptr);
}

TEST(SafetensorsJson, RefusesWhatJsonDoesNot) {
  for (const char* bad : {"", "{", "{} x", "[1,]", "{\"a\":1,}", "01", "1.", ".5", "+1", "-", "1e", "NaN", "tru",
                          "\"a", "\"\\x\"", "\"\\u12\"", "\"\\ud800\"", "\"\\udc00\"", "\"\x01\"", "\"\xff\"",
                          "\"\xc0\xaf\"", "{\"a\":1,\"a\":2}", "{1:2}", "[1 2]"}) {
    EXPECT_NE(json_error(bad), "") << bad;
  }
  EXPECT_NE(json_error(std::string(65, '[') + std::string(65, ']')), "") << "nesting is bounded";
  EXPECT_EQ(json_error(std::string(63, '[') + std::string(63, ']')), "");
  EXPECT_NE(json_error("{\"a\":1,\"a\":2}").find("duplicate"), std::string::npos);
}

TEST(SafetensorsJson, DoublesRoundTripBitForBit) {
  std::vector<double> values = {0.0, -0.0, 1.0, 0.1, 1e-8, 3e-4, 2000.0, 1e300, -1e-300, 5e-324, 2.2250738585072014e-308,
                                1.7976931348623157e308, 0.9, 0.999, INFINITY, -INFINITY, NAN};
  std::mt19937_64 rng(42);
  for (int i = 0; i < 2000; ++i) {
    const double d = std::bit_cast<double>(rng());
    if (std::isfinite(d)) values.push_back(d);
  }
  for (const double v : values) {
    std::string text = "[";
    detail::append_json_double(text, v);
    text += "]";
    const auto back = detail::json_double(detail::parse_json(text).items.at(0));
    ASSERT_TRUE(back.has_value()) << text;
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(*back)) << text;
    } else {
      EXPECT_EQ(std::bit_cast<std::uint64_t>(*back), std::bit_cast<std::uint64_t>(v)) << text;
    }
  }
  std::string one;
  detail::append_json_double(one, 2000.0);
  EXPECT_EQ(one, "2000.0");
}

// ---- the file ----

// A file: the 8-byte length, `header` as it is, then `data`.
std::vector<unsigned char> file_with(const std::string& header, const std::vector<unsigned char>& data) {
  std::vector<unsigned char> out(8 + header.size() + data.size());
  const std::uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  if (!header.empty()) std::memcpy(out.data() + 8, header.data(), header.size());
  if (!data.empty()) std::memcpy(out.data() + 8 + header.size(), data.data(), data.size());
  return out;
}

std::string read_error(const std::string& path) {
  try {
    detail::SafetensorsFile f{detail::MappedFile(path)};
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io_error) << e.what();
    return e.what();
  }
  return "";
}

TEST(Safetensors, TheWriterFollowsTheFormat) {
  TempDir dir;
  const std::string path = dir.file("t.safetensors");
  const std::vector<float> a = {1.0f, -2.0f, 3.5f}, b = {0.25f};
  detail::write_safetensors(path, {{"k", "v \"quoted\"\n"}, {"n\xc3\xa9", "{\"x\":1}"}},
                            {{"z.first", a.data(), a.size()}, {"empty", nullptr, 0}, {"a.last", b.data(), b.size()}});
  const auto bytes = read_bytes(path);
  std::uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "the data section starts 8-byte aligned";
  EXPECT_EQ(bytes[8], '{');
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  EXPECT_EQ(header.find("{\"__metadata__\":{"), 0u) << "the metadata first, as the reference writer puts it";
  const JsonValue root = detail::parse_json(header);  // the padding is spaces
  ASSERT_EQ(root.members.size(), 4u);
  EXPECT_EQ(root.members[1].first, "z.first");  // the tensors in the order given, laid out in that order
  EXPECT_EQ(root.members[2].first, "empty");
  EXPECT_EQ(root.members[3].first, "a.last");
  EXPECT_EQ(bytes.size(), 8 + n + 16);

  const detail::SafetensorsFile f{detail::MappedFile(path)};
  EXPECT_EQ(*f.meta("k"), "v \"quoted\"\n");
  EXPECT_EQ(*f.meta("n\xc3\xa9"), "{\"x\":1}");
  EXPECT_EQ(f.meta("checksum")->size(), 8u + 16u);
  const detail::SafetensorsTensor* z = f.find("z.first");
  const detail::SafetensorsTensor* e = f.find("empty");
  ASSERT_TRUE(z && e);
  EXPECT_EQ(z->begin, 0u);
  EXPECT_EQ(z->end, 12u);
  EXPECT_EQ(e->begin, 12u);
  EXPECT_EQ(e->end, 12u);
  EXPECT_EQ(e->shape, std::vector<std::uint64_t>{0});
  EXPECT_EQ(std::memcmp(f.data(*z).data(), a.data(), 12), 0);
  f.verify_checksum();

  // Checked before anything is written.
  const auto refused = [&](const std::map<std::string, std::string>& meta, const std::vector<detail::SafetensorsSource>& t) {
    std::string message;
    EXPECT_EQ(code_of([&] { detail::write_safetensors(dir.file("bad"), meta, t); }, &message), ErrorCode::invalid_argument);
    EXPECT_FALSE(fs::exists(dir.file("bad")));
    return message;
  };
  EXPECT_NE(refused({{"k", "\xff"}}, {}).find("UTF-8"), std::string::npos);
  EXPECT_NE(refused({}, {{"x", a.data(), 1}, {"x", a.data(), 1}}).find("twice"), std::string::npos);
  EXPECT_NE(refused({{"checksum", "x"}}, {}).find("checksum"), std::string::npos);
}

TEST(Safetensors, TheReaderChecksTheLayoutAsTheFormatRequires) {
  TempDir dir;
  const std::string path = dir.file("t.safetensors");
  const std::vector<unsigned char> data(12, 0);
  const auto t = [](const char* name, const char* dtype, int n, int begin, int end) {
    return "\"" + std::string(name) + "\":{\"dtype\":\"" + dtype + "\",\"shape\":[" + std::to_string(n) +
           "],\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(end) + "]}";
  };
  // Fine: keys in any order (the data order is the offsets'), padded, a zero-element tensor.
  write_bytes(path, file_with("{" + t("b", "F32", 2, 4, 12) + "," + t("a", "F32", 1, 0, 4) + "," + t("e", "BF16", 0, 12, 12) +
                                  ",\"__metadata__\":{\"x\":\"y\"}}    ",
                              data));
  EXPECT_EQ(read_error(path), "");
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{" + t("a", "F32", 1, 0, 4) + "," + t("b", "F32", 1, 8, 12) + "}", "without holes"},   // a hole
      {"{" + t("a", "F32", 2, 0, 8) + "," + t("b", "F32", 2, 4, 12) + "}", "without holes"},   // an overlap
      {"{" + t("a", "F32", 2, 0, 12) + "}", "not the size"},                                    // 8 bytes of elements
      {"{" + t("a", "F32", 2, 0, 8) + "}", "longer than its header says"},                      // 4 bytes left over
      {"{" + t("a", "F32", 4, 0, 16) + "}", "truncated"},                                       // 4 bytes missing
      {"{" + t("a", "Q32", 3, 0, 12) + "}", "not a safetensors dtype"},
      {"{\"__metadata__\":{\"x\":1}," + t("a", "F32", 3, 0, 12) + "}", "not a string"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-3],\"data_offsets\":[0,12]}}", "non-negative"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3]}}", "data_offsets"},
      {"{" + t("a", "F32", 3, 0, 12) + "} x", "not valid JSON"},
      {"[1]", "not a stepfuse checkpoint"},
  };
  for (const auto& [header, words] : bad) {
    write_bytes(path, file_with(header, data));
    const std::string message = read_error(path);
    EXPECT_NE(message.find(words), std::string::npos) << header << "\n" << message;
  }
  // A header length longer than the file, and one past the format's limit.
  write_bytes(path, file_with("{}", {}));
  auto bytes = read_bytes(path);
  bytes[0] = 200;
  write_bytes(path, bytes);
  EXPECT_NE(read_error(path).find("truncated"), std::string::npos);
  bytes[5] = 1;  // 2^40 + 200
  write_bytes(path, bytes);
  EXPECT_NE(read_error(path).find("not a stepfuse checkpoint"), std::string::npos);
}

// Writes `v` as JSON with the members of every object in reverse order and spaces
// around everything: the same content, spelled differently.
void respell(std::string& out, const JsonValue& v) {
  switch (v.kind) {
    case JsonValue::Kind::object:
      out += "{ ";
      for (auto it = v.members.rbegin(); it != v.members.rend(); ++it) {
        if (it != v.members.rbegin()) out += " ,\n ";
        detail::append_json_string(out, it->first);
        out += " : ";
        respell(out, it->second);
      }
      out += " }";
      return;
    case JsonValue::Kind::array:
      out += "[ ";
      for (std::size_t i = 0; i < v.items.size(); ++i) {
        if (i > 0) out += " , ";
        respell(out, v.items[i]);
      }
      out += " ]";
      return;
    case JsonValue::Kind::string: detail::append_json_string(out, v.text); return;
    default: out += v.kind == JsonValue::Kind::number ? v.text : v.kind == JsonValue::Kind::null ? "null" : v.boolean ? "true" : "false";
  }
}

// The checksum covers what the header says, not how its JSON is spelled, and the data.
TEST(Safetensors, TheChecksumCoversTheHeadersContentAndTheData) {
  TempDir dir;
  const std::string path = dir.file("t.safetensors");
  const std::vector<float> a = {1.0f, 2.0f};
  detail::write_safetensors(path, {{"k", "v"}}, {{"a", a.data(), a.size()}});
  const auto bytes = read_bytes(path);
  std::uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  const JsonValue root = detail::parse_json(std::string(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n)));
  const auto rewritten = [&](const JsonValue& header) {
    std::string text;
    respell(text, header);
    return file_with(text, std::vector<unsigned char>(bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n), bytes.end()));
  };
  write_bytes(path, rewritten(root));
  detail::SafetensorsFile(detail::MappedFile(path)).verify_checksum();

  JsonValue changed = root;
  for (auto& [key, v] : changed.members)
    if (key == "__metadata__") v.members.push_back({"extra", JsonValue{JsonValue::Kind::string, false, "x", {}, {}}});
  write_bytes(path, rewritten(changed));
  std::string message;
  EXPECT_EQ(code_of([&] { detail::SafetensorsFile(detail::MappedFile(path)).verify_checksum(); }, &message),
            ErrorCode::io_error);
  EXPECT_NE(message.find("checksum"), std::string::npos) << message;
}

// Random damage to a checkpoint's header (bytes changed, removed or inserted, the length
// changed to match) is an io_error from load, never a crash or another exception, and
// changes nothing; or, where it changed only the JSON's spelling (a space), the file
// still loads, as the same content.
TEST(Safetensors, RandomDamageToTheHeaderIsAnIoError) {
  TempDir dir;
  const std::string path = dir.file("opt.ckpt");
  Model model = Model::make({{3, DType::f32, DType::f32}, {5, DType::bf16, DType::bf16}, {0, DType::f16, DType::f16}}, 1);
  Optimizer opt({{model.params(0, 1), optim::AdamW{}}, {model.params(1), optim::AdamW{.amsgrad = true}}});
  GradScaler scaler("cpu");
  iterate(model, opt, scaler, 0);
  opt.save(path, scaler);
  const auto bytes = read_bytes(path);
  std::uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  const Snapshot before(opt, model);
  const unsigned seed = ::testing::UnitTest::GetInstance()->random_seed();
  std::mt19937 rng(seed);
  const std::string specials = "{}[]\":,\\ 0123456789-.eE\x01\xff\xc3";
  for (int trial = 0; trial < 400; ++trial) {
    std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
    for (int k = 0, edits = 1 + static_cast<int>(rng() % 4); k < edits; ++k) {
      const std::size_t at = rng() % header.size();
      const char c = rng() % 2 ? specials[rng() % specials.size()] : static_cast<char>(rng());
      switch (rng() % 3) {
        case 0: header[at] = c; break;
        case 1: header.erase(at, 1 + rng() % 8); break;
        default: header.insert(at, 1, c);
      }
      if (header.empty()) header.push_back('{');
    }
    write_bytes(path, file_with(header, std::vector<unsigned char>(bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n),
                                                                   bytes.end())));
    try {
      opt.load(path, scaler);
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), ErrorCode::io_error) << "seed " << seed << " trial " << trial << ": " << e.what();
    }
  }
  EXPECT_TRUE(Snapshot(opt, model) == before);
}

// ---- the safetensors Python package ----

std::string shell_quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// A Python that has the safetensors package and NumPy: $STEPFUSE_PYTHON, the venv that
// scripts/install_deps.sh makes (build/pyvenv), or python3 on the PATH.
std::optional<std::string> python_with_safetensors() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("STEPFUSE_PYTHON"); env && *env) candidates.emplace_back(env);
  candidates.push_back(std::string(STEPFUSE_SOURCE_DIR) + "/build/pyvenv/bin/python3");
  candidates.emplace_back("python3");
  for (const std::string& py : candidates) {
    const std::string probe = shell_quoted(py) + " -c 'import safetensors.numpy, numpy' >/dev/null 2>&1";
    if (std::system(probe.c_str()) == 0) return py;
  }
  return std::nullopt;
}

// Runs `command`, returning its exit status and what it printed.
std::pair<int, std::string> run(const std::string& command) {
  std::string output;
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  while (std::size_t got = std::fread(buf, 1, sizeof buf, p)) output.append(buf, got);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

void append_json_strings(std::string& out, const std::map<std::string, std::string>& m) {
  out += "{";
  for (const auto& [k, v] : m) {
    if (out.back() != '{') out += ",";
    detail::append_json_string(out, k);
    out += ":";
    detail::append_json_string(out, v);
  }
  out += "}";
}

std::string number(double v) { return detail::format_number(v); }  // shortest round trip: Python reads it exactly

TEST(PythonSafetensors, OpensACheckpointWithItsTensorsAndMetadata) {
  const auto python = python_with_safetensors();
  if (!python)
    GTEST_SKIP() << "no Python with the safetensors package and NumPy (scripts/install_deps.sh puts them in build/pyvenv)";
  TempDir dir;
  const std::string path = dir.file("opt.safetensors"), expected_path = dir.file("expected.json");
  auto spec = kSpec;
  spec.push_back({0, DType::bf16, DType::bf16});  // zero elements: shape [0], an empty range
  Model model = Model::make(spec, 31);
  Optimizer opt({{model.params(0, 2), optim::AdamW{.lr = 1e-3, .weight_decay = 0.1}},
                 {model.params(2), optim::AdamW{.lr = 3e-4, .beta1 = 0.8, .beta2 = 0.99, .amsgrad = true}}});
  GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 3);
  for (int k = 0; k < 3; ++k) iterate(model, opt, scaler, k);
  opt.save(path, scaler);

  // What the optimizer holds, through its public API.
  std::string tensors = "{";
  std::map<std::string, std::string> meta = {{"format", "stepfuse-optimizer"},
                                             {"format_version", "3"},
                                             {"optimizer", "AdamW"},
                                             {"step_count", std::to_string(opt.step_count())},
                                             {"num_groups", "2"}};
  std::string json_meta = "{";
  const auto add_tensor = [&](const std::string& name, std::span<const float> values) {
    if (tensors.size() > 1) tensors += ",";
    detail::append_json_string(tensors, name);
    tensors += ":{\"shape\":[";
    tensors += std::to_string(values.size());
    tensors += "],\"bits\":[";
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (i > 0) tensors += ',';
      tensors += std::to_string(std::bit_cast<std::uint32_t>(values[i]));
    }
    tensors += "]}";
  };
  for (std::size_t g = 0; g < opt.num_groups(); ++g) {
    const std::string prefix = "group." + std::to_string(g) + ".";
    meta[prefix + "step_count"] = std::to_string(opt.group_step_count(g));
    meta[prefix + "num_params"] = std::to_string(opt.group_params(g).size());
    std::string hyper = "{";
    std::visit(
        [&](const auto& c) {
          jit::for_each_field(c, [&](std::string_view name, const auto& v) {
            if (hyper.size() > 1) hyper += ",";
            detail::append_json_string(hyper, name);
            hyper += ":";
            if constexpr (std::is_same_v<std::remove_cvref_t<decltype(v)>, bool>)
              hyper += v ? "true" : "false";
            else
              hyper += number(v);
          });
        },
        opt.config(g));
    json_meta += (json_meta.size() > 1 ? "," : "") + std::string("\"") + prefix + "hyperparameters\":" + hyper + "}";
    std::string params = "[";
    std::size_t first = 0;
    while (opt.group_of(first) != g) ++first;
    for (std::size_t i = 0; i < opt.group_params(g).size(); ++i) {
      const std::size_t p = first + i;
      const Param& param = opt.params()[p];
      params += std::string(i ? "," : "") + "{\"numel\":" + std::to_string(param.weight.numel) + ",\"weight_dtype\":\"" +
                std::string(dtype_name(param.weight.dtype)) + "\",\"grad_dtype\":\"" +
                std::string(dtype_name(param.grad.dtype)) + "\",\"master\":" +
                (param.weight.dtype != DType::f32 ? "true" : "false") + ",\"compensation\":false}";
      const std::string tensor = prefix + "param." + std::to_string(i) + ".";
      for (std::string_view s : opt.state_names()) {
        try {
          add_tensor(tensor + std::string(s), opt.state(p, s));
        } catch (const Error&) {  // not a state of this group
        }
      }
      if (param.weight.dtype != DType::f32) add_tensor(tensor + "master", opt.master(p));
    }
    json_meta += ",\"" + prefix + "params\":" + params + "]";
  }
  std::string scaler_state = "{";
  for (const auto& [k, v] : scaler.state_dict()) {
    if (scaler_state.size() > 1) scaler_state += ",";
    scaler_state += "\"" + k + "\":" + number(v);
  }
  json_meta += ",\"grad_scaler\":" + scaler_state + "}}";
  tensors += "}";
  // The program variants' names are the library's own: taken from the file.
  const detail::SafetensorsFile file{detail::MappedFile(path)};
  for (int g = 0; g < 2; ++g) {
    const std::string key = "group." + std::to_string(g) + ".program";
    ASSERT_NE(file.meta(key), nullptr);
    meta[key] = *file.meta(key);
  }
  std::string expected = "{\"tensors\":" + tensors + ",\"metadata\":";
  append_json_strings(expected, meta);
  expected += ",\"json_metadata\":" + json_meta + "}";
  std::vector<unsigned char> bytes(expected.begin(), expected.end());
  write_bytes(expected_path, bytes);

  const std::string script = std::string(STEPFUSE_SOURCE_DIR) + "/tests/checkpoint_py/check_checkpoint.py";
  const auto [status, output] = run(shell_quoted(*python) + " " + shell_quoted(script) + " " + shell_quoted(path) + " " +
                                    shell_quoted(expected_path));
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("ok"), std::string::npos) << output;
}

}  // namespace
}  // namespace stepfuse
