// Checkpoints: Optimizer::save/load (with and without a GradScaler) and
// LossScaleOptimizer::save/load. A resumed run continues bit for bit; a bad file
// is a clear Error and changes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

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
          const _Float16 f = static_cast<_Float16>(v);
          std::memcpy(&h, &f, 2);
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
  std::vector<Param> params() {
    std::vector<Param> p;
    for (Tensor& t : tensors) p.push_back({{t.weight.data(), t.numel, t.wtype}, {t.grad.data(), t.numel, t.gtype}});
    return p;
  }
};

const std::vector<std::tuple<std::int64_t, DType, DType>> kSpec = {
    {1, DType::f32, DType::f32}, {33, DType::bf16, DType::bf16}, {40000, DType::f32, DType::bf16},
    {1000, DType::f16, DType::f16}, {7, DType::bf16, DType::f32}};

// Everything an optimizer holds, as bytes, for bitwise comparison.
struct Snapshot {
  std::vector<std::vector<unsigned char>> weights;
  std::vector<std::vector<float>> state, masters;
  std::int64_t step_count;
  double lr;

  Snapshot(const Optimizer& opt, const Model& m) : step_count(opt.step_count()), lr(opt.lr()) {
    for (const auto& t : m.tensors) weights.push_back(t.weight);
    for (std::size_t i = 0; i < opt.num_params(); ++i) {
      for (auto name : opt.state_names()) {
        auto s = opt.state(i, name);
        state.emplace_back(s.begin(), s.end());
      }
      auto ms = opt.master(i);
      masters.emplace_back(ms.begin(), ms.end());
    }
  }
  static bool same(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
  bool operator==(const Snapshot& o) const {
    if (weights != o.weights || step_count != o.step_count || lr != o.lr) return false;
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
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::size_t entries() const { return static_cast<std::size_t>(std::distance(fs::directory_iterator(path_), {})); }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
void write_bytes(const std::string& path, const std::vector<unsigned char>& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

ErrorCode code_of(const std::function<void()>& f, std::string* message = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (message) *message = e.what();
    return e.code();
  }
  ADD_FAILURE() << "expected a stepfuse::Error";
  return ErrorCode::unsupported;
}

struct Case {
  const char* name;
  OptimizerConfig config;
  Fusion fusion;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class Resume : public ::testing::TestWithParam<Case> {};

// Steps 0..2, save (optimizer + scaler), steps 3..8 -> A. A fresh optimizer and
// scaler on the weights as saved, load, steps 3..8 -> B. A == B bit for bit.
TEST_P(Resume, ContinuesBitForBitLikeAnUninterruptedRun) {
  const Case& c = GetParam();
  TempDir dir;
  const std::string path = dir.file("run.ckpt");
  OptimizerOptions options;
  options.max_grad_norm = 5.0;
  options.fusion = c.fusion;
  Model model = Model::make(kSpec, 7);
  Optimizer opt(c.config, model.params(), options);
  GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 2);
  const auto iterate = [](Model& m, Optimizer& o, GradScaler& s, int k) {
    m.set_grads(k, s.get_scale(), /*poison=*/k == 4);
    s.step(o);
    s.update();
  };
  for (int k = 0; k < 3; ++k) iterate(model, opt, scaler, k);
  opt.save(path, scaler);
  Model saved_weights = model;  // what the user's model checkpoint would hold
  for (int k = 3; k < 9; ++k) iterate(model, opt, scaler, k);

  Model resumed_model = saved_weights;
  Optimizer resumed(c.config, resumed_model.params(), options);
  GradScaler resumed_scaler("cpu");
  resumed.load(path, resumed_scaler);
  EXPECT_EQ(resumed.step_count(), 3);
  for (int k = 3; k < 9; ++k) iterate(resumed_model, resumed, resumed_scaler, k);

  EXPECT_TRUE(Snapshot(opt, model) == Snapshot(resumed, resumed_model));
  EXPECT_EQ(scaler.state_dict(), resumed_scaler.state_dict());
  EXPECT_EQ(dir.entries(), 1u) << "no temporary files are left behind";
}

INSTANTIATE_TEST_SUITE_P(
    Checkpoint, Resume,
    ::testing::Values(Case{"sgd_momentum", optim::SGD{.lr = 0.1, .momentum = 0.9}, Fusion::fused},
                      Case{"adam", optim::Adam{.lr = 1e-2, .weight_decay = 0.01}, Fusion::fused},
                      Case{"adamw_amsgrad", optim::AdamW{.lr = 1e-2, .amsgrad = true}, Fusion::fused},
                      Case{"adamw_unfused", optim::AdamW{.lr = 1e-2}, Fusion::unfused},
                      Case{"adamw_interpreted", optim::AdamW{.lr = 1e-2}, Fusion::interpreted},
                      Case{"adagrad", optim::Adagrad{.lr = 0.05, .lr_decay = 0.01}, Fusion::fused},
                      Case{"rmsprop_centered", optim::RMSprop{.lr = 0.01, .momentum = 0.5, .centered = true},
                           Fusion::fused},
                      Case{"lion", optim::Lion{.lr = 1e-3, .weight_decay = 0.1}, Fusion::fused}),
    [](const auto& info) { return std::string(info.param.name); });

// A trained optimizer, a checkpoint of it, and a snapshot to compare against.
struct Fixture {
  TempDir dir;
  std::string path = dir.file("opt.ckpt");
  Model model = Model::make(kSpec, 3);
  Optimizer opt{optim::AdamW{.lr = 1e-2}, model.params()};
  GradScaler scaler{"cpu", 256.0, 2.0, 0.5, 3};

  Fixture() {
    for (int k = 0; k < 2; ++k) {
      model.set_grads(k, scaler.get_scale());
      scaler.step(opt);
      scaler.update();
    }
    opt.save(path, scaler);
    // Move on so that a successful load would visibly change things.
    model.set_grads(5, scaler.get_scale());
    scaler.step(opt);
    scaler.update();
    opt.set_lr(0.5);
  }
};

TEST(Checkpoint, LoadRestoresHyperparametersStepCountAndScaler) {
  Fixture f;
  const auto before = f.scaler.state_dict();
  f.opt.load(f.path, f.scaler);
  EXPECT_EQ(f.opt.lr(), 1e-2);
  EXPECT_EQ(f.opt.step_count(), 2);
  EXPECT_NE(f.scaler.state_dict(), before);
  EXPECT_EQ(f.scaler.growth_tracker(), 2);
}

TEST(Checkpoint, TruncatedFileIsAnIoErrorAndChangesNothing) {
  Fixture f;
  const auto bytes = read_bytes(f.path);
  const Snapshot before(f.opt, f.model);
  const auto scaler_before = f.scaler.state_dict();
  for (std::size_t keep : {std::size_t{0}, std::size_t{5}, std::size_t{20}, std::size_t{40}, bytes.size() / 2,
                           bytes.size() - 9, bytes.size() - 1}) {
    SCOPED_TRACE("kept " + std::to_string(keep) + " of " + std::to_string(bytes.size()) + " bytes");
    write_bytes(f.path, std::vector<unsigned char>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(keep)));
    std::string message;
    EXPECT_EQ(code_of([&] { f.opt.load(f.path, f.scaler); }, &message), ErrorCode::io_error);
    EXPECT_NE(message.find(f.path), std::string::npos) << message;
    EXPECT_TRUE(keep < 8 ? message.find("not a stepfuse checkpoint") != std::string::npos
                         : message.find("truncated") != std::string::npos)
        << message;
    EXPECT_TRUE(Snapshot(f.opt, f.model) == before);
    EXPECT_EQ(f.scaler.state_dict(), scaler_before);
  }
}

TEST(Checkpoint, CorruptByteAnywhereIsDetected) {
  Fixture f;
  const auto bytes = read_bytes(f.path);
  ASSERT_EQ(bytes[8], 2) << "written as format version 2 (XXH3_64 checksum)";
  const Snapshot before(f.opt, f.model);
  // Every byte of the metadata region and a sample of the data region.
  for (std::size_t at = 24; at < bytes.size() - 8; at += at < 600 ? 1 : 997) {
    auto bad = bytes;
    bad[at] ^= 0x10;
    write_bytes(f.path, bad);
    std::string message;
    ASSERT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error) << "byte " << at;
    ASSERT_NE(message.find("checksum"), std::string::npos) << message;
  }
  EXPECT_TRUE(Snapshot(f.opt, f.model) == before);
}

TEST(Checkpoint, OtherFormatVersionAndForeignFilesAreRejected) {
  Fixture f;
  auto bytes = read_bytes(f.path);
  bytes[8] = 3;  // format version 3
  write_bytes(f.path, bytes);
  std::string message;
  EXPECT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("format version 3"), std::string::npos) << message;
  EXPECT_NE(message.find("reads versions 1 to 2"), std::string::npos) << message;
  EXPECT_NE(message.find("newer"), std::string::npos) << message;
  bytes[8] = 0;
  write_bytes(f.path, bytes);
  EXPECT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("format version 0"), std::string::npos) << message;
  EXPECT_EQ(message.find("newer"), std::string::npos) << message;

  write_bytes(f.path, std::vector<unsigned char>(100, 'x'));
  EXPECT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("not a stepfuse checkpoint"), std::string::npos) << message;

  EXPECT_EQ(code_of([&] { f.opt.load(f.dir.file("missing.ckpt")); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("missing.ckpt"), std::string::npos) << message;
}

// Format version 1's checksum, written out here from its description (the container
// header in runtime/checkpoint_file.hpp) rather than taken from the library: FNV-1a over
// 8-byte little-endian words, the tail zero-padded, then the byte count, then the
// murmur3 finalizer. Versions 1 and 2 differ only in the checksum.
std::uint64_t format1_checksum(const unsigned char* p, std::size_t n) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t at = 0; at < n; at += 8) {
    std::uint64_t w = 0;
    for (std::size_t b = 0; b < 8 && at + b < n; ++b) w |= std::uint64_t{p[at + b]} << (8 * b);
    h = (h ^ w) * 0x100000001b3ull;
  }
  h = (h ^ n) * 0x100000001b3ull;
  h ^= h >> 33, h *= 0xff51afd7ed558ccdull, h ^= h >> 33, h *= 0xc4ceb9fe1a85ec53ull, h ^= h >> 33;
  return h;
}

// The same checkpoint in format version 1: version field 1 and the FNV-1a trailer.
std::vector<unsigned char> as_format1(std::vector<unsigned char> bytes) {
  bytes[8] = 1;
  const std::size_t body = bytes.size() - 8;
  const std::uint64_t sum = format1_checksum(bytes.data(), body);
  for (int b = 0; b < 8; ++b) bytes[body + b] = static_cast<unsigned char>(sum >> (8 * b));
  return bytes;
}

TEST(Checkpoint, Format1FilesWithTheirOwnChecksumStillLoad) {
  Fixture f;
  const std::string v1 = f.dir.file("v1.ckpt");
  write_bytes(v1, as_format1(read_bytes(f.path)));
  // The same state comes back from either version.
  const auto load = [&](const std::string& path) {
    Model m = f.model;
    Optimizer o(optim::AdamW{.lr = 0.5}, m.params());
    GradScaler s("cpu");
    o.load(path, s);
    EXPECT_EQ(o.step_count(), 2);
    EXPECT_EQ(o.lr(), 1e-2);
    return std::make_pair(Snapshot(o, m), s.state_dict());
  };
  const auto from_v2 = load(f.path), from_v1 = load(v1);
  EXPECT_TRUE(from_v1.first == from_v2.first);
  EXPECT_EQ(from_v1.second, from_v2.second);

  // Each version is checked with its own checksum: a version-2 trailer under version 1
  // (or the reverse), or a changed byte in a version-1 file, is corrupt.
  std::string message;
  auto relabelled = read_bytes(f.path);
  relabelled[8] = 1;
  write_bytes(v1, relabelled);
  EXPECT_EQ(code_of([&] { f.opt.load(v1); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("checksum"), std::string::npos) << message;
  auto v1_bytes = as_format1(read_bytes(f.path));
  v1_bytes[8] = 2;
  write_bytes(v1, v1_bytes);
  EXPECT_EQ(code_of([&] { f.opt.load(v1); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("checksum"), std::string::npos) << message;
  v1_bytes = as_format1(read_bytes(f.path));
  v1_bytes[v1_bytes.size() / 2] ^= 0x04;
  write_bytes(v1, v1_bytes);
  EXPECT_EQ(code_of([&] { f.opt.load(v1); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("checksum"), std::string::npos) << message;
  EXPECT_EQ(f.opt.lr(), 0.5) << "a refused file changes nothing";
}

TEST(Checkpoint, MismatchedOptimizerIsAnInvalidArgumentNamingTheDifference) {
  Fixture f;
  const auto expect_mismatch = [&](Optimizer& other, const std::string& words) {
    std::string message;
    EXPECT_EQ(code_of([&] { other.load(f.path); }, &message), ErrorCode::invalid_argument);
    EXPECT_NE(message.find(words), std::string::npos) << message;
    EXPECT_EQ(other.step_count(), 0);
  };
  Model m = Model::make(kSpec, 3);
  Optimizer adam(optim::Adam{}, m.params());
  expect_mismatch(adam, "AdamW");
  Optimizer amsgrad(optim::AdamW{.amsgrad = true}, m.params());
  expect_mismatch(amsgrad, "update program");
  OptimizerOptions no_masters;
  no_masters.master_weights = false;
  Optimizer plain(optim::AdamW{}, m.params(), no_masters);
  expect_mismatch(plain, "master");
  auto spec = kSpec;
  std::get<0>(spec[2]) = 40001;
  Model bigger = Model::make(spec, 3);
  Optimizer sized(optim::AdamW{}, bigger.params());
  expect_mismatch(sized, "params[2]");
  spec = kSpec;
  std::get<2>(spec[0]) = DType::bf16;
  Model retyped = Model::make(spec, 3);
  Optimizer typed(optim::AdamW{}, retyped.params());
  expect_mismatch(typed, "params[0]");
  spec = kSpec;
  spec.pop_back();
  Model fewer = Model::make(spec, 3);
  Optimizer shorter(optim::AdamW{}, fewer.params());
  expect_mismatch(shorter, "parameters");
}

TEST(Checkpoint, ScalerStateIsRequiredOnlyWhenAsked) {
  Fixture f;
  const std::string plain = f.dir.file("plain.ckpt");
  f.opt.save(plain);
  f.opt.load(plain);  // fine
  const auto scaler_before = f.scaler.state_dict();
  const Snapshot before(f.opt, f.model);
  std::string message;
  EXPECT_EQ(code_of([&] { f.opt.load(plain, f.scaler); }, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("no GradScaler state"), std::string::npos) << message;
  EXPECT_EQ(f.scaler.state_dict(), scaler_before);

  // Saved with a disabled scaler: loading into an enabled one is the load_state_dict({}) error.
  const std::string disabled = f.dir.file("disabled.ckpt");
  f.opt.save(disabled, GradScaler("cpu", 65536.0, 2.0, 0.5, 2000, false));
  f.opt.set_lr(0.25);
  EXPECT_EQ(code_of([&] { f.opt.load(disabled, f.scaler); }, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("disabled"), std::string::npos) << message;
  EXPECT_EQ(f.opt.lr(), 0.25) << "the optimizer is untouched when the scaler part fails";
  GradScaler off("cpu", 65536.0, 2.0, 0.5, 2000, false);
  f.opt.load(disabled, off);  // a disabled scaler loads nothing
  EXPECT_EQ(off.get_scale(), 1.0);
}

TEST(Checkpoint, SaveIsAtomicAndReportsUnwritableLocations) {
  Fixture f;
  const auto first = read_bytes(f.path);
  // Overwriting replaces the file as a whole and leaves no temporaries.
  f.opt.save(f.path, f.scaler);
  EXPECT_NE(read_bytes(f.path), first);
  EXPECT_EQ(f.dir.entries(), 1u);
  std::string message;
  const std::string nowhere = f.dir.file("no/such/dir/opt.ckpt");
  EXPECT_EQ(code_of([&] { f.opt.save(nowhere); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find(nowhere), std::string::npos) << message;
  EXPECT_EQ(f.dir.entries(), 1u);
  EXPECT_EQ(code_of([&] { f.opt.save(""); }), ErrorCode::invalid_argument);
}

TEST(Checkpoint, LossScaleOptimizerResumesBitForBit) {
  TempDir dir;
  const std::string path = dir.file("lso.ckpt");
  Model model = Model::make(kSpec, 11);
  Optimizer inner(optim::Adam{.lr = 1e-2}, model.params());
  LossScaleOptimizer lso(inner, true, 512.0, 2);
  const auto iterate = [](Model& m, LossScaleOptimizer& l, int k) {
    l.minimize([&](double scale) { m.set_grads(k, scale, k == 5); });
  };
  for (int k = 0; k < 3; ++k) iterate(model, lso, k);
  lso.save(path);
  Model saved = model;
  for (int k = 3; k < 8; ++k) iterate(model, lso, k);

  Model resumed_model = saved;
  Optimizer resumed_inner(optim::Adam{.lr = 1e-2}, resumed_model.params());
  LossScaleOptimizer resumed(resumed_inner, true, 512.0, 2);
  resumed.load(path);
  for (int k = 3; k < 8; ++k) iterate(resumed_model, resumed, k);
  EXPECT_TRUE(Snapshot(inner, model) == Snapshot(resumed_inner, resumed_model));
  EXPECT_EQ(lso.loss_scale(), resumed.loss_scale());
  EXPECT_EQ(lso.dynamic_counter(), resumed.dynamic_counter());

  const std::string plain = dir.file("plain.ckpt");
  inner.save(plain);
  std::string message;
  EXPECT_EQ(code_of([&] { resumed.load(plain); }, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("no LossScaleOptimizer state"), std::string::npos) << message;
}

}  // namespace
}  // namespace stepfuse
