// What the checkpoint tests share (checkpoint_test, checkpoint_io_test, safetensors_test):
// caller-owned tensors, a bitwise snapshot of an optimizer, a temporary directory, files
// as bytes, errors by code.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string_view>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "f16_oracle.hpp"
#include "runtime/safetensors.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse::ckpt_test {

namespace fs = std::filesystem;

// Caller-owned buffers for a list of tensors of mixed dtypes.
struct Model {
  struct Tensor {
    DType wtype, gtype;
    std::vector<unsigned char> weight, grad;
    std::int64_t numel;
  };
  std::vector<Tensor> tensors;

  Model() = default;
  Model(const Model& other) : tensors(other.tensors) {}  // deep copy: new buffers
  Model& operator=(const Model& other) = default;        // (the tensors' buffers copied: values, not views)

  static Model make(const std::vector<std::tuple<std::int64_t, DType, DType>>& spec, std::uint32_t seed) {
    Model m;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto [n, w, g] : spec) {
      Tensor t{w, g, std::vector<unsigned char>(n * dtype_size(w)), std::vector<unsigned char>(n * dtype_size(g)), n};
      m.tensors.push_back(std::move(t));
    }
    for (Tensor& t : m.tensors) fill(t.weight.data(), t.wtype, t.numel, rng, normal, 1.0f);
    return m;
  }
  static void fill(unsigned char* p, DType t, std::int64_t n, std::mt19937& rng, std::normal_distribution<float>& d,
                   float scale) {
    for (std::int64_t i = 0; i < n; ++i) {
      const float v = d(rng) * scale;
      if (t == DType::f32) {
        std::memcpy(p + 4 * i, &v, 4);
      } else {  // truncation is fine for test data: any bit pattern of a finite value
        std::uint32_t bits;
        std::memcpy(&bits, &v, 4);
        std::uint16_t h;
        if (t == DType::bf16) {
          h = static_cast<std::uint16_t>(bits >> 16);
        } else {
          h = test::oracle_float_to_f16(v);
        }
        std::memcpy(p + 2 * i, &h, 2);
      }
    }
  }
  // Deterministic scaled gradients for step k (inf in one element when `poison`).
  void set_grads(int k, double scale, bool poison = false) {
    std::mt19937 rng(1000 + k);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (Tensor& t : tensors) fill(t.grad.data(), t.gtype, t.numel, rng, normal, static_cast<float>(scale) / 64);
    if (poison) {
      Tensor& t = tensors.back();
      const float inf = INFINITY;
      if (t.gtype == DType::f32) {
        std::memcpy(t.grad.data(), &inf, 4);
      } else {
        const std::uint16_t h = t.gtype == DType::f16 ? 0x7C00 : 0x7F80;
        std::memcpy(t.grad.data(), &h, 2);
      }
    }
  }
  std::vector<Param> params(std::size_t begin = 0, std::size_t end = SIZE_MAX) {
    std::vector<Param> p;
    for (std::size_t i = begin; i < std::min(end, tensors.size()); ++i) {
      Tensor& t = tensors[i];
      p.push_back({{t.weight.data(), t.numel, t.wtype}, {t.grad.data(), t.numel, t.gtype}});
    }
    return p;
  }
};

inline const std::vector<std::tuple<std::int64_t, DType, DType>> kSpec = {
    {1, DType::f32, DType::f32}, {33, DType::bf16, DType::bf16}, {40000, DType::f32, DType::bf16},
    {1000, DType::f16, DType::f16}, {7, DType::bf16, DType::f32}};

// Everything an optimizer holds, as bytes, for bitwise comparison: weights, every
// param's state (those its group has) and master, step counts, every group's lr.
struct Snapshot {
  std::vector<std::vector<unsigned char>> weights;
  std::vector<std::vector<float>> state, masters;
  std::int64_t step_count;
  std::vector<std::int64_t> group_steps;
  std::vector<double> lrs;

  Snapshot(const Optimizer& opt, const Model& m) : step_count(opt.step_count()) {
    for (const auto& t : m.tensors) weights.push_back(t.weight);
    for (std::size_t g = 0; g < opt.num_groups(); ++g) {
      group_steps.push_back(opt.group_step_count(g));
      try {
        lrs.push_back(opt.lr(g));
      } catch (const Error&) {  // a custom program without a fixed "lr"
        lrs.push_back(0.0);
      }
    }
    for (std::size_t i = 0; i < opt.num_params(); ++i) {
      for (auto name : opt.state_names()) {
        try {
          auto s = opt.state(i, name);
          state.emplace_back(s.begin(), s.end());
        } catch (const Error&) {  // not a state of this param's group
          state.emplace_back();
        }
      }
      auto ms = opt.master(i);
      masters.emplace_back(ms.begin(), ms.end());
    }
  }
  static bool same(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
  bool operator==(const Snapshot& o) const {
    if (weights != o.weights || step_count != o.step_count || group_steps != o.group_steps) return false;
    if (lrs.size() != o.lrs.size() || std::memcmp(lrs.data(), o.lrs.data(), lrs.size() * sizeof(double)) != 0) return false;
    if (state.size() != o.state.size() || masters.size() != o.masters.size()) return false;
    for (std::size_t i = 0; i < state.size(); ++i)
      if (!same(state[i], o.state[i])) return false;
    for (std::size_t i = 0; i < masters.size(); ++i)
      if (!same(masters[i], o.masters[i])) return false;
    return true;
  }
};

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("stepfuse_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }
  std::size_t entries() const { return static_cast<std::size_t>(std::distance(fs::directory_iterator(path_), {})); }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

inline std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
inline void write_bytes(const std::string& path, const std::vector<unsigned char>& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

// The code of the stepfuse::Error `f` throws (and its message in `message`).
inline ErrorCode code_of(const std::function<void()>& f, std::string* message = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (message) *message = e.what();
    return e.code();
  }
  ADD_FAILURE() << "expected a stepfuse::Error";
  return ErrorCode::unsupported;
}

// One GradScaler iteration of step k.
inline void iterate(Model& m, Optimizer& o, GradScaler& s, int k) {
  m.set_grads(k, s.get_scale(), /*poison=*/k == 4);
  s.step(o);
  s.update();
}

// Rewrites a version-3 checkpoint with `edit` applied to its metadata (and `retype`, when
// given, to each tensor's dtype: the same bytes under another dtype), through the
// library's writer, so that the checksum is that of the new content.
inline void rewrite_metadata(const std::string& path, const std::function<void(std::map<std::string, std::string>&)>& edit,
                      const std::function<std::string_view(const detail::SafetensorsTensor&)>& retype = {}) {
  std::map<std::string, std::string> meta;
  std::vector<std::vector<unsigned char>> data;
  std::vector<std::string> dtypes;
  std::vector<detail::SafetensorsSource> sources;
  {
    const detail::SafetensorsFile f{detail::MappedFile(path)};
    meta = f.metadata();
    data.reserve(f.tensors().size());
    dtypes.reserve(f.tensors().size());
    for (const detail::SafetensorsTensor& t : f.tensors()) {
      const auto bytes = f.data(t);
      data.emplace_back(bytes.begin(), bytes.end());
      dtypes.emplace_back(retype ? retype(t) : std::string_view(t.dtype));
      const std::uint64_t size = dtypes.back() == "BF16" ? 2 : 4;
      sources.push_back({t.name, data.back().data(), data.back().size() / size, dtypes.back()});
    }
  }
  meta.erase("checksum");
  edit(meta);
  detail::write_safetensors(path, meta, sources);
}

}  // namespace stepfuse::ckpt_test
