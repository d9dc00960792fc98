// fuzz_checkpoint: the input becomes a checkpoint file, loaded with Optimizer::load(path)
// and Optimizer::load(path, scaler) into a small AdamW optimizer (two param groups, f32
// and bf16 weights) that has taken one step.
//
// Input: byte 0 picks the mode. Odd: "wrapped": the rest is a safetensors header (JSON
// text), a NUL, then the data section (without the NUL: the reference checkpoint's
// data). When the JSON parses and describes tensors and string metadata, the harness
// recomputes the "checksum" metadata entry (the library's own safetensors_checksum,
// runtime/safetensors.hpp) and writes the 8-byte length prefix, so the file
// passes the integrity checks and reaches the parser behind them. Even: the rest is the
// file, byte for byte.
//
// Oracle: a load that throws (it must throw stepfuse::Error, nothing else) leaves every
// state tensor, master, group lr and config, the step counts and the scaler's
// state_dict() byte-identical; a load that succeeds keeps every state tensor's size,
// and one more step afterwards must run (and keep the sizes).
//
// STEPFUSE_FUZZ_WRITE_SEEDS=<dir>: writes the seed corpus into <dir> and exits.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/safetensors.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/grad_scaler.hpp"
#include "stepfuse/optimizer.hpp"

namespace sf = stepfuse;

namespace {

[[noreturn]] void oracle_failed(const std::string& what) {
  std::fprintf(stderr, "fuzz_checkpoint: ORACLE FAILED: %s\n", what.c_str());
  std::abort();
}

std::uint16_t bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<std::uint16_t>(u >> 16);
}

// Caller-owned tensors and an optimizer over them that has taken one step.
struct Model {
  std::vector<float> w0{0.5f, -1.0f, 2.0f, 0.25f, -0.75f}, g0{0.1f, -0.2f, 0.3f, 0.0f, 1.0f};
  std::vector<std::uint16_t> w1, g1;
  std::vector<float> w2{1.0f, 2.0f, 3.0f}, g2{-0.5f, 0.5f, 0.125f};
  std::unique_ptr<sf::Optimizer> opt;
  sf::GradScaler scaler{"cpu", 256.0, 2.0, 0.5, 3};

  Model() {
    for (int i = 0; i < 7; ++i) {
      w1.push_back(bf16(0.1f * static_cast<float>(i) - 0.3f));
      g1.push_back(bf16(0.05f * static_cast<float>(i % 3) - 0.02f));
    }
    const sf::Param p0{{w0.data(), 5, sf::DType::f32}, {g0.data(), 5, sf::DType::f32}};
    const sf::Param p1{{w1.data(), 7, sf::DType::bf16}, {g1.data(), 7, sf::DType::bf16}};
    const sf::Param p2{{w2.data(), 3, sf::DType::f32}, {g2.data(), 3, sf::DType::f32}};
    sf::OptimizerOptions options;
    options.num_threads = 1;
    options.cpu_backend = sf::CpuBackend::highway;
    std::vector<sf::ParamGroup> groups;
    groups.push_back({{p0, p1}, sf::optim::AdamW{.lr = 1e-2}});
    groups.push_back({{p2}, sf::optim::AdamW{.lr = 5e-3, .weight_decay = 0.0, .amsgrad = true}});
    opt = std::make_unique<sf::Optimizer>(std::move(groups), options);
    opt->step_scaled(256.0);
  }
};

void append_bits(std::string& out, const void* p, std::size_t n) { out.append(static_cast<const char*>(p), n); }
void append_double(std::string& out, double v) { append_bits(out, &v, sizeof v); }

// A param's state of that name; empty where its group's variant keeps none (state_names()
// lists every group's: amsgrad's max_exp_avg_sq only exists in group 1).
std::span<const float> state_or_empty(const sf::Optimizer& o, std::size_t p, std::string_view name) {
  try {
    return o.state(p, name);
  } catch (const sf::Error&) {
    return {};
  }
}

// Everything a failed load must leave as it was, as bytes.
std::string snapshot(const Model& m) {
  const sf::Optimizer& o = *m.opt;
  std::string s;
  for (std::size_t p = 0; p < o.num_params(); ++p) {
    for (std::string_view name : o.state_names()) {
      const auto st = state_or_empty(o, p, name);
      s += std::string(name) + ":" + std::to_string(st.size()) + ":";
      append_bits(s, st.data(), st.size_bytes());
    }
    const auto master = o.master(p);
    s += "master:" + std::to_string(master.size()) + ":";
    append_bits(s, master.data(), master.size_bytes());
  }
  for (std::size_t g = 0; g < o.num_groups(); ++g) {
    append_double(s, o.lr(g));
    const auto& c = std::get<sf::optim::AdamW>(o.config(g));
    for (double v : {c.lr, c.beta1, c.beta2, c.eps, c.weight_decay}) append_double(s, v);
    s += c.amsgrad ? 'A' : 'a';
    s += c.maximize ? 'M' : 'm';
    const std::int64_t t = o.group_step_count(g);
    append_bits(s, &t, sizeof t);
  }
  const std::int64_t t = o.step_count();
  append_bits(s, &t, sizeof t);
  for (const auto& [k, v] : m.scaler.state_dict()) {
    s += k + "=";
    append_double(s, v);
  }
  return s;
}

std::vector<std::size_t> state_sizes(const sf::Optimizer& o) {
  std::vector<std::size_t> sizes;
  for (std::size_t p = 0; p < o.num_params(); ++p) {
    for (std::string_view name : o.state_names()) sizes.push_back(state_or_empty(o, p, name).size());
    sizes.push_back(o.master(p).size());
  }
  return sizes;
}

std::string g_path;            // this process's checkpoint file
std::string g_ref_header;      // the reference checkpoint's JSON header
std::string g_ref_data;        // and its data section

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) std::abort();
}

// The checksum the format uses (runtime/safetensors.hpp), or false when the header
// does not describe tensors and string metadata the way the checksum needs.
bool set_checksum(nlohmann::json& root, const std::string& data) {
  if (!root.is_object()) return false;
  std::map<std::string, std::string> metadata;
  std::vector<stepfuse::detail::SafetensorsTensor> tensors;
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return false;
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) return false;
        metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const nlohmann::json& v = *it;
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets")) return false;
    const auto& dtype = v["dtype"];
    const auto& shape = v["shape"];
    const auto& offsets = v["data_offsets"];
    if (!dtype.is_string() || !shape.is_array() || !offsets.is_array() || offsets.size() != 2) return false;
    stepfuse::detail::SafetensorsTensor t{it.key(), dtype.get<std::string>(), {}, 0, 0};
    for (const auto& d : shape) {
      if (!d.is_number_unsigned()) return false;
      t.shape.push_back(d.get<std::uint64_t>());
    }
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) return false;
    t.begin = offsets[0].get<std::uint64_t>();
    t.end = offsets[1].get<std::uint64_t>();
    tensors.push_back(std::move(t));
  }
  std::stable_sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  root["__metadata__"]["checksum"] = stepfuse::detail::safetensors_checksum(metadata, tensors, data);
  return true;
}

std::string safetensors_file(std::string header, const std::string& data) {
  while ((8 + header.size()) % 8 != 0) header += ' ';
  std::string file(8, '\0');
  const std::uint64_t n = header.size();
  std::memcpy(file.data(), &n, 8);
  return file + header + data;
}

// The file a wrapped input stands for.
std::string wrap(const std::string& body) {
  const std::size_t nul = body.find('\0');
  std::string header = body.substr(0, nul);
  const std::string data = nul == std::string::npos ? g_ref_data : body.substr(nul + 1);
  nlohmann::json root = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (!root.is_discarded() && set_checksum(root, data)) {
    try {
      header = root.dump();
    } catch (const nlohmann::json::exception&) {  // a string that is not UTF-8: keep the text
    }
  }
  return safetensors_file(header, data);
}

void check_load(bool with_scaler) {
  Model m;
  const std::string before = snapshot(m);
  const std::vector<std::size_t> sizes = state_sizes(*m.opt);
  try {
    if (with_scaler)
      m.opt->load(g_path, m.scaler);
    else
      m.opt->load(g_path);
  } catch (const sf::Error& e) {
    if (std::getenv("STEPFUSE_FUZZ_DEBUG")) std::fprintf(stderr, "load: %s\n", e.what());
    if (snapshot(m) != before) oracle_failed("a failed load changed the optimizer or the scaler");
    return;
  } catch (const std::exception& e) {
    oracle_failed(std::string("load threw something other than stepfuse::Error: ") + e.what());
  }
  if (std::getenv("STEPFUSE_FUZZ_DEBUG")) std::fprintf(stderr, "load: loaded\n");
  if (state_sizes(*m.opt) != sizes) oracle_failed("a successful load changed a state tensor's size");
  try {
    m.opt->step_scaled(m.scaler.get_scale());
  } catch (const sf::Error&) {
    // A loaded hyperparameter can make a step refuse to run; it must not crash.
  }
  if (state_sizes(*m.opt) != sizes) oracle_failed("a step after a load changed a state tensor's size");
}

void write_seeds(const char* dir) {
  const std::string raw = read_file(g_path);
  const auto put = [&](const char* name, char mode, const std::string& body) {
    write_file(std::string(dir) + "/" + name, std::string(1, mode) + body);
  };
  put("raw_reference", 0, raw);
  put("raw_truncated", 0, raw.substr(0, raw.size() / 2));
  put("wrapped_reference", 1, g_ref_header + std::string(1, '\0') + g_ref_data);
  put("wrapped_reference_header_only", 1, g_ref_header);
  std::string small_scale = g_ref_header;
  if (const auto at = small_scale.find("\"lr\""); at != std::string::npos) small_scale.insert(at + 5, "1");
  put("wrapped_other_lr", 1, small_scale);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  sf::set_warning_handler([](std::string_view) {});
  const char* tmp = std::getenv("TMPDIR");
  g_path = std::string(tmp && *tmp ? tmp : "/tmp") + "/stepfuse_fuzz_checkpoint." + std::to_string(::getpid()) +
           ".safetensors";
  {
    Model m;
    m.opt->save(g_path, m.scaler);
  }
  const std::string ref = read_file(g_path);
  std::uint64_t n = 0;
  if (ref.size() < 8) std::abort();
  std::memcpy(&n, ref.data(), 8);
  g_ref_header = ref.substr(8, n);
  while (!g_ref_header.empty() && g_ref_header.back() == ' ') g_ref_header.pop_back();
  g_ref_data = ref.substr(8 + n);
  // The reference, re-wrapped by the harness, must load: the checksum here is the format's.
  write_file(g_path, wrap(g_ref_header));
  {
    Model m;
    m.opt->load(g_path, m.scaler);
  }
  if (const char* dir = std::getenv("STEPFUSE_FUZZ_WRITE_SEEDS")) {
    write_file(g_path, ref);
    write_seeds(dir);
    std::remove(g_path.c_str());
    std::exit(0);
  }
  std::atexit([] { std::remove(g_path.c_str()); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  write_file(g_path, (data[0] & 1) != 0 ? wrap(body) : body);
  check_load(false);
  check_load(true);
  return 0;
}
