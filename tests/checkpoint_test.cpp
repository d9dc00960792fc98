// Checkpoints: Optimizer::save/load (with and without a GradScaler), LossScaleOptimizer::
// save/load, param groups, every built-in optimizer, the files of format versions 1 and
// 2, and the atomic writer's guarantees. A resumed run continues bit for bit; a bad
// file is a clear Error and changes nothing.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "checkpoint_support.hpp"
#include "jit/config_fields.hpp"
#include "runtime/checkpoint_file.hpp"
#include "runtime/detail_access.hpp"
#include "runtime/safetensors.hpp"

namespace stepfuse {
namespace {

using namespace ckpt_test;

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

// Every optimizer of the registry, with its defaults, through the field lists: the
// file names every hyperparameter, and a resumed run matches the uninterrupted one.
TEST(Checkpoint, EveryBuiltInOptimizerResumesBitForBitAndNamesEveryHyperparameter) {
  for (std::size_t kind = 0; kind < jit::kNumOptimizers; ++kind) {
    const OptimizerConfig config = jit::default_config(kind);
    SCOPED_TRACE(std::string(optimizer_name(config)));
    TempDir dir;
    const std::string path = dir.file("opt.ckpt");
    Model model = Model::make(kSpec, 5);
    Optimizer opt(config, model.params());
    GradScaler scaler("cpu", 256.0, 2.0, 0.5, 2);
    for (int k = 0; k < 3; ++k) iterate(model, opt, scaler, k);
    opt.save(path, scaler);
    Model saved = model;
    for (int k = 3; k < 6; ++k) iterate(model, opt, scaler, k);

    Model resumed_model = saved;
    Optimizer resumed(config, resumed_model.params());
    GradScaler resumed_scaler("cpu");
    resumed.load(path, resumed_scaler);
    for (int k = 3; k < 6; ++k) iterate(resumed_model, resumed, resumed_scaler, k);
    EXPECT_TRUE(Snapshot(opt, model) == Snapshot(resumed, resumed_model));

    const detail::SafetensorsFile file{detail::MappedFile(path)};
    EXPECT_EQ(*file.meta("optimizer"), optimizer_name(config));
    const detail::JsonValue fields = detail::parse_json(*file.meta("group.0.hyperparameters"));
    std::vector<std::string> names, saved_names;
    std::visit([&](const auto& c) { jit::for_each_field(c, [&](std::string_view n, const auto&) { names.emplace_back(n); }); },
               config);
    for (const auto& [name, value] : fields.members) saved_names.push_back(name);
    EXPECT_EQ(saved_names, names);
  }
}

// A trained optimizer, a checkpoint of it, and a snapshot to compare against.
struct Fixture {
  TempDir dir;
  std::string path = dir.file("opt.ckpt");
  Model model;
  Optimizer opt;
  GradScaler scaler{"cpu", 256.0, 2.0, 0.5, 3};

  explicit Fixture(const std::vector<std::tuple<std::int64_t, DType, DType>>& spec = kSpec)
      : model(Model::make(spec, 3)), opt(optim::AdamW{.lr = 1e-2}, model.params()) {
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
  std::uint64_t header;
  std::memcpy(&header, bytes.data(), 8);
  const Snapshot before(f.opt, f.model);
  const auto scaler_before = f.scaler.state_dict();
  for (std::size_t keep : {std::size_t{0}, std::size_t{5}, std::size_t{8}, std::size_t{20}, std::size_t{8 + header / 2},
                           std::size_t{8 + header}, bytes.size() / 2, bytes.size() - 9, bytes.size() - 1}) {
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
  Fixture f({{1, DType::f32, DType::f32}, {33, DType::bf16, DType::bf16}, {700, DType::f32, DType::bf16}});
  const auto bytes = read_bytes(f.path);
  std::uint64_t header;
  std::memcpy(&header, bytes.data(), 8);
  ASSERT_EQ(bytes[8], '{') << "a safetensors file: the JSON header follows its length";
  const Snapshot before(f.opt, f.model);
  // Every byte of the header (its length, the JSON, the padding) and a sample of the
  // data: some error of the file every time; in the data (and in the metadata's values),
  // the checksum's.
  for (std::size_t at = 0; at < bytes.size(); at += at < 8 + header ? 1 : 97) {
    auto bad = bytes;
    bad[at] ^= 0x10;
    write_bytes(f.path, bad);
    std::string message;
    ASSERT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error) << "byte " << at;
    if (at >= 8 + header) {
      ASSERT_NE(message.find("checksum"), std::string::npos) << message;
    }
  }
  // A digit of a hyperparameter: valid JSON still, caught by the checksum.
  const std::string text(bytes.begin(), bytes.end());
  const std::size_t lr = text.find("\\\"lr\\\":0.01");
  ASSERT_NE(lr, std::string::npos);
  auto bad = bytes;
  bad[lr + 10] = '2';  // 0.01 -> 0.02
  write_bytes(f.path, bad);
  std::string message;
  EXPECT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("checksum"), std::string::npos) << message;
  EXPECT_TRUE(Snapshot(f.opt, f.model) == before);
}

// Replaces `from` by `to` (of the same length) in the file's header.
void patch_header(const std::string& path, const std::string& from, const std::string& to) {
  ASSERT_EQ(from.size(), to.size());
  auto bytes = read_bytes(path);
  std::string text(bytes.begin(), bytes.end());
  const std::size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  std::copy(to.begin(), to.end(), bytes.begin() + static_cast<std::ptrdiff_t>(at));
  write_bytes(path, bytes);
}


TEST(Checkpoint, OtherFormatVersionAndForeignFilesAreRejected) {
  Fixture f;
  const auto bytes = read_bytes(f.path);
  std::string message;
  patch_header(f.path, "\"format_version\":\"3\"", "\"format_version\":\"4\"");
  EXPECT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("format version 4"), std::string::npos) << message;
  EXPECT_NE(message.find("reads versions 1 to 3"), std::string::npos) << message;
  EXPECT_NE(message.find("newer"), std::string::npos) << message;
  write_bytes(f.path, bytes);
  patch_header(f.path, "\"format_version\":\"3\"", "\"format_version\":\"2\"");
  EXPECT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("format version 2"), std::string::npos) << message;
  EXPECT_EQ(message.find("newer"), std::string::npos) << message;

  // The STEPFUSE container holds versions 1 and 2 only.
  auto container = bytes;
  std::memcpy(container.data(), "STEPFUSE\x03\x00\x00\x00\x04\x03\x02\x01", 16);
  write_bytes(f.path, container);
  EXPECT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("format version 3 in the STEPFUSE container"), std::string::npos) << message;

  write_bytes(f.path, std::vector<unsigned char>(100, 'x'));
  EXPECT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("not a stepfuse checkpoint"), std::string::npos) << message;

  // Somebody's model weights: a safetensors file, not an optimizer checkpoint.
  const std::vector<float> weights(16, 1.0f);
  detail::write_safetensors(f.path, {{"format", "pt"}}, {{"embed.weight", weights.data(), weights.size()}});
  EXPECT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("not a stepfuse checkpoint"), std::string::npos) << message;

  EXPECT_EQ(code_of([&] { f.opt.load(f.dir.file("missing.ckpt")); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("missing.ckpt"), std::string::npos) << message;
  EXPECT_EQ(code_of([&] { f.opt.load(f.dir.path().string()); }, &message), ErrorCode::io_error);
  EXPECT_EQ(f.opt.lr(), 0.5) << "a refused file changes nothing";
}

// Metadata that passes the checksum but does not make sense is corrupt (io_error), and
// changes nothing.
TEST(Checkpoint, InconsistentMetadataIsCorrupt) {
  Fixture f;
  const Snapshot before(f.opt, f.model);
  const auto bytes = read_bytes(f.path);
  const std::vector<std::pair<std::string, std::function<void(std::map<std::string, std::string>&)>>> edits = {
      {"no \"step_count\"", [](auto& m) { m.erase("step_count"); }},
      {"\"step_count\" is not", [](auto& m) { m["step_count"] = "-1"; }},
      {"not valid JSON", [](auto& m) { m["group.0.params"] = "[{"; }},
      {"lists 4 params, not 5", [](auto& m) { m["group.0.params"] = m["group.0.params"].substr(0, m["group.0.params"].rfind(",{")) + "]"; }},
      {"more than the optimizer's", [](auto& m) { m["group.0.step_count"] = "3"; }},
      {"belongs to no NAdam group", [](auto& m) { m["group.0.mu_product_offset"] = "-1"; }},
      {"\"group.0.mu_product_offset\" is not a number", [](auto& m) { m["group.0.mu_product_offset"] = "x"; }},
      {"\"beta1\" that is a number", [](auto& m) {
         auto& h = m["group.0.hyperparameters"];
         h.replace(h.find("\"beta1\":0.9"), 11, "\"beta1\":\"x\"");
       }},
  };
  for (const auto& [words, edit] : edits) {
    write_bytes(f.path, bytes);
    rewrite_metadata(f.path, edit);
    std::string message;
    EXPECT_EQ(code_of([&] { f.opt.load(f.path); }, &message), ErrorCode::io_error) << words;
    EXPECT_NE(message.find(words), std::string::npos) << message;
  }
  // A tensor the optimizer has no place for.
  write_bytes(f.path, bytes);
  {
    std::map<std::string, std::string> meta;
    std::vector<std::vector<float>> data;
    std::vector<detail::SafetensorsSource> sources;
    const detail::SafetensorsFile file{detail::MappedFile(f.path)};
    meta = file.metadata();
    meta.erase("checksum");
    data.reserve(file.tensors().size() + 1);
    for (const detail::SafetensorsTensor& t : file.tensors()) {
      const auto b = file.data(t);
      data.emplace_back(b.size() / sizeof(float));
      if (!b.empty()) std::memcpy(data.back().data(), b.data(), b.size());
      sources.push_back({t.name, data.back().data(), data.back().size()});
    }
    data.emplace_back(3, 1.0f);
    sources.push_back({"group.0.param.9.exp_avg", data.back().data(), 3});
    detail::write_safetensors(f.dir.file("extra.ckpt"), meta, sources);
  }
  std::string message;
  EXPECT_EQ(code_of([&] { f.opt.load(f.dir.file("extra.ckpt")); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("group.0.param.9.exp_avg"), std::string::npos) << message;
  EXPECT_TRUE(Snapshot(f.opt, f.model) == before);
}

// ---- format versions 1 and 2 ----
//
// Written here from their layout (runtime/checkpoint_file.hpp, and the sections in the
// header of runtime/checkpoint.cpp) rather than by the library, which only reads them.

struct Bytes {
  std::vector<unsigned char> b;
  template <class T>
  void put(T v) {
    const auto* p = reinterpret_cast<const unsigned char*>(&v);
    b.insert(b.end(), p, p + sizeof v);
  }
  void str(std::string_view s) {
    put(static_cast<std::uint32_t>(s.size()));
    b.insert(b.end(), s.begin(), s.end());
  }
  void floats(std::span<const float> f) {
    const auto* p = reinterpret_cast<const unsigned char*>(f.data());
    b.insert(b.end(), p, p + f.size_bytes());
  }
};

struct Format2Extras {
  const GradScaler* scaler = nullptr;
  const LossScaleOptimizer* lso = nullptr;
  std::optional<double> loss_scale = std::nullopt;  // instead of the LossScaleOptimizer's
};

// A format-2 checkpoint of a one-group optimizer.
std::vector<unsigned char> format2_file(const Optimizer& opt, const Format2Extras& x = {}) {
  const detail::StepEngine& e = detail_access::engine(opt);
  Bytes optm;
  const UpdateProgram* custom = e.custom_program();
  optm.str(custom ? "custom" : optimizer_name(opt.config()));
  optm.str(e.program().name);
  std::vector<std::pair<std::string_view, double>> fields;
  if (!custom)
    std::visit([&](const auto& c) { jit::for_each_field(c, [&](std::string_view n, const auto& v) { fields.emplace_back(n, double(v)); }); },
               opt.config());
  optm.put(static_cast<std::uint32_t>(fields.size()));
  for (const auto& [n, v] : fields) optm.str(n), optm.put(v);
  optm.put(opt.step_count());
  optm.put(static_cast<std::int64_t>(opt.num_params()));
  for (std::size_t i = 0; i < opt.num_params(); ++i) {
    optm.put(opt.params()[i].weight.numel);
    optm.put(static_cast<std::uint8_t>(opt.params()[i].weight.dtype));
    optm.put(static_cast<std::uint8_t>(opt.params()[i].grad.dtype));
    optm.put(static_cast<std::uint8_t>(e.master_data(i) != nullptr));
  }
  optm.put(static_cast<std::uint32_t>(opt.state_names().size()));
  for (auto n : opt.state_names()) optm.str(n);
  for (std::size_t i = 0; i < opt.num_params(); ++i) {
    for (auto n : opt.state_names()) optm.floats(opt.state(i, n));
    if (e.master_data(i) != nullptr) optm.floats(opt.master(i));
  }
  std::vector<std::pair<std::uint32_t, Bytes>> sections = {{detail::section_tag("OPTM"), optm}};
  if (custom) {
    Bytes prog;
    prog.str(to_string(custom->program()));
    prog.put(static_cast<std::uint32_t>(custom->scalars().size()));
    for (const ScalarDef& d : custom->scalars()) {
      prog.str(d.name);
      prog.put(static_cast<std::uint8_t>(d.rule.kind));
      prog.put(d.rule.a);
      prog.put(d.rule.b);
    }
    sections.emplace_back(detail::section_tag("UPRG"), prog);
  }
  if (x.scaler) {
    Bytes s;
    const auto state = x.scaler->state_dict();
    s.put(static_cast<std::uint32_t>(state.size()));
    for (const auto& [k, v] : state) s.str(k), s.put(v);
    sections.emplace_back(detail::section_tag("GSCL"), s);
  }
  if (x.lso) {
    Bytes s;
    s.put(static_cast<std::uint8_t>(x.lso->dynamic()));
    s.put(x.loss_scale.value_or(x.lso->loss_scale()));
    s.put(x.lso->dynamic_growth_steps());
    s.put(x.lso->dynamic_counter());
    sections.emplace_back(detail::section_tag("LSOP"), s);
  }
  Bytes payload;
  for (const auto& [tag, body] : sections) {
    payload.put(tag);
    payload.put(std::uint32_t{0});
    payload.put(static_cast<std::uint64_t>(body.b.size()));
    payload.b.insert(payload.b.end(), body.b.begin(), body.b.end());
  }
  Bytes file;
  file.b.assign({'S', 'T', 'E', 'P', 'F', 'U', 'S', 'E'});
  file.put(std::uint32_t{2});
  file.put(std::uint32_t{0x01020304});
  file.put(static_cast<std::uint64_t>(payload.b.size()));
  file.b.insert(file.b.end(), payload.b.begin(), payload.b.end());
  file.put(static_cast<std::uint64_t>(XXH3_64bits(file.b.data(), file.b.size())));
  return file.b;
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

TEST(Checkpoint, Format2And1FilesStillLoad) {
  TempDir dir;
  Model model = Model::make(kSpec, 3);
  Optimizer opt(optim::AdamW{.lr = 1e-2, .weight_decay = 0.05}, model.params());
  GradScaler scaler("cpu", 256.0, 2.0, 0.5, 3);
  for (int k = 0; k < 3; ++k) iterate(model, opt, scaler, k);
  const std::string v3 = dir.file("v3.ckpt"), v2 = dir.file("v2.ckpt"), v1 = dir.file("v1.ckpt");
  opt.save(v3, scaler);
  write_bytes(v2, format2_file(opt, {.scaler = &scaler}));
  write_bytes(v1, as_format1(format2_file(opt, {.scaler = &scaler})));
  // The same state comes back from every version.
  const auto load = [&](const std::string& path) {
    Model m = model;
    Optimizer o(optim::AdamW{.lr = 0.5}, m.params());
    GradScaler s("cpu");
    o.load(path, s);
    EXPECT_EQ(o.step_count(), 3);
    EXPECT_EQ(o.lr(), 1e-2);
    return std::make_pair(Snapshot(o, m), s.state_dict());
  };
  const auto from_v3 = load(v3), from_v2 = load(v2), from_v1 = load(v1);
  EXPECT_TRUE(from_v2.first == from_v3.first);
  EXPECT_TRUE(from_v1.first == from_v3.first);
  EXPECT_EQ(from_v2.second, from_v3.second);
  EXPECT_EQ(from_v1.second, from_v3.second);
  EXPECT_TRUE(from_v3.first == Snapshot(opt, model));

  // Each version is checked with its own checksum: a version-2 trailer under version 1
  // (or the reverse), or a changed byte in a version-1 file, is corrupt.
  std::string message;
  auto relabelled = read_bytes(v2);
  relabelled[8] = 1;
  write_bytes(v1, relabelled);
  EXPECT_EQ(code_of([&] { opt.load(v1); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("checksum"), std::string::npos) << message;
  auto v1_bytes = as_format1(read_bytes(v2));
  v1_bytes[8] = 2;
  write_bytes(v1, v1_bytes);
  EXPECT_EQ(code_of([&] { opt.load(v1); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("checksum"), std::string::npos) << message;
  const auto good_v1 = as_format1(read_bytes(v2));
  for (std::size_t at = 24; at < good_v1.size(); at += good_v1.size() / 37) {
    auto bad = good_v1;
    bad[at] ^= 0x04;
    write_bytes(v1, bad);
    EXPECT_EQ(code_of([&] { opt.load(v1); }, &message), ErrorCode::io_error);
    EXPECT_NE(message.find("checksum"), std::string::npos) << message;
  }
  EXPECT_EQ(opt.step_count(), 3) << "a refused file changes nothing";
}

TEST(Checkpoint, Format2CustomProgramsAndLossScaleOptimizersStillLoad) {
  TempDir dir;
  const std::string path = dir.file("v2.ckpt");
  const UpdateProgram program = UpdateProgram::from_config(optim::Adam{.lr = 1e-2});
  Model model = Model::make(kSpec, 9);
  Optimizer opt(program, model.params());
  LossScaleOptimizer lso(opt, true, 512.0, 2);
  for (int k = 0; k < 3; ++k) lso.minimize([&](double scale) { model.set_grads(k, scale); });
  write_bytes(path, format2_file(opt, {.lso = &lso}));
  Model m = model;
  Optimizer o(program, m.params());
  LossScaleOptimizer l(o, true, 8.0, 2);
  l.load(path);
  EXPECT_TRUE(Snapshot(o, m) == Snapshot(opt, model));
  EXPECT_EQ(l.loss_scale(), lso.loss_scale());
  EXPECT_EQ(l.dynamic_counter(), lso.dynamic_counter());
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
  expect_mismatch(typed, "params[0]: saved with weight/grad dtypes f32/f32, here f32/bf16");
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
  EXPECT_EQ(code_of([&] { f.opt.save(f.dir.file("")); }, &message), ErrorCode::io_error);
}

TEST(Checkpoint, LossScaleOptimizerResumesBitForBit) {
  TempDir dir;
  const std::string path = dir.file("lso.ckpt");
  Model model = Model::make(kSpec, 11);
  Optimizer inner(optim::Adam{.lr = 1e-2}, model.params());
  LossScaleOptimizer lso(inner, true, 512.0, 2);
  const auto step = [](Model& m, LossScaleOptimizer& l, int k) {
    l.minimize([&](double scale) { m.set_grads(k, scale, k == 5); });
  };
  for (int k = 0; k < 3; ++k) step(model, lso, k);
  lso.save(path);
  Model saved = model;
  for (int k = 3; k < 8; ++k) step(model, lso, k);

  Model resumed_model = saved;
  Optimizer resumed_inner(optim::Adam{.lr = 1e-2}, resumed_model.params());
  LossScaleOptimizer resumed(resumed_inner, true, 512.0, 2);
  resumed.load(path);
  for (int k = 3; k < 8; ++k) step(resumed_model, resumed, k);
  EXPECT_TRUE(Snapshot(inner, model) == Snapshot(resumed_inner, resumed_model));
  EXPECT_EQ(lso.loss_scale(), resumed.loss_scale());
  EXPECT_EQ(lso.dynamic_counter(), resumed.dynamic_counter());

  const std::string plain = dir.file("plain.ckpt");
  inner.save(plain);
  std::string message;
  EXPECT_EQ(code_of([&] { resumed.load(plain); }, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("no LossScaleOptimizer state"), std::string::npos) << message;
}

// A loss scale is kept in fp32: a saved value that is finite and > 0 as a double but
// not as the float it would become (1e39 -> inf, 1e-46 -> 0) is refused, in either
// format, as the constructors refuse it, and nothing changes.
TEST(Checkpoint, LossScalesOutsideTheFp32RangeAreRefused) {
  TempDir dir;
  const std::string path = dir.file("lso.ckpt");
  Model model = Model::make(kSpec, 11);
  Optimizer inner(optim::Adam{.lr = 1e-2}, model.params());
  LossScaleOptimizer lso(inner, true, 512.0, 2);
  lso.minimize([&](double scale) { model.set_grads(0, scale); });
  GradScaler scaler("cpu", 128.0, 2.0, 0.5, 2);
  for (const char* bad : {"1e39", "1e-46", "1e-39", "0", "-2", "\"inf\"", "\"nan\""}) {
    SCOPED_TRACE(bad);
    std::string message;
    lso.save(path);
    rewrite_metadata(path, [&](auto& m) {
      m["loss_scale_optimizer"] = "{\"dynamic\":true,\"loss_scale\":" + std::string(bad) +
                                  ",\"dynamic_growth_steps\":2,\"dynamic_counter\":0}";
    });
    EXPECT_EQ(code_of([&] { lso.load(path); }, &message), ErrorCode::io_error);
    EXPECT_NE(message.find("loss scale"), std::string::npos) << message;
    EXPECT_EQ(lso.loss_scale(), 512.0);

    inner.save(path, scaler);
    rewrite_metadata(path, [&](auto& m) {
      m["grad_scaler"] = "{\"_growth_tracker\":0,\"backoff_factor\":0.5,\"growth_factor\":2.0,\"growth_interval\":2,"
                         "\"scale\":" + std::string(bad) + "}";
    });
    if (std::string(bad) == "0" || std::string(bad) == "1e-39") {  // a GradScaler's scale backed off that far
      inner.load(path, scaler);                                          // (its steps skip): it loads
      EXPECT_EQ(scaler.get_scale(), static_cast<float>(std::stod(bad)));
      scaler.update(128.0);
      continue;
    }
    EXPECT_EQ(code_of([&] { inner.load(path, scaler); }, &message), ErrorCode::invalid_argument);
    EXPECT_NE(message.find("scale"), std::string::npos) << message;
    EXPECT_EQ(scaler.get_scale(), 128.0);
  }
  for (double bad : {1e39, 1e-46}) {
    std::string message;
    write_bytes(path, format2_file(inner, {.lso = &lso, .loss_scale = bad}));
    EXPECT_EQ(code_of([&] { lso.load(path); }, &message), ErrorCode::io_error);
    EXPECT_NE(message.find("loss scale"), std::string::npos) << message;
    EXPECT_EQ(lso.loss_scale(), 512.0);
  }
  EXPECT_EQ(inner.step_count(), 1);
}

// ---- param groups ----

// Two groups of AdamW: decay and no amsgrad in group 0, amsgrad and another lr in group 1.
std::vector<ParamGroup> two_groups(Model& m) {
  return {{m.params(0, 3), optim::AdamW{.lr = 1e-2, .weight_decay = 0.1}},
          {m.params(3), optim::AdamW{.lr = 3e-3, .weight_decay = 0.0, .amsgrad = true}}};
}

TEST(Checkpoint, ParamGroupsWithDifferentVariantsResumeBitForBit) {
  TempDir dir;
  const std::string path = dir.file("groups.ckpt");
  Model model = Model::make(kSpec, 21);
  OptimizerOptions options;
  options.max_grad_norm = 5.0;
  Optimizer opt(two_groups(model), options);
  GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 2);
  for (int k = 0; k < 3; ++k) iterate(model, opt, scaler, k);
  opt.save(path, scaler);
  Model saved = model;
  for (int k = 3; k < 7; ++k) iterate(model, opt, scaler, k);

  Model resumed_model = saved;
  std::vector<ParamGroup> groups = two_groups(resumed_model);
  for (ParamGroup& g : groups) std::visit([](auto& c) { c.lr = 0.5; }, g.config);  // the file's lrs come back
  Optimizer resumed(groups, options);
  GradScaler resumed_scaler("cpu");
  resumed.load(path, resumed_scaler);
  EXPECT_EQ(resumed.lr(0), 1e-2);
  EXPECT_EQ(resumed.lr(1), 3e-3);
  for (int k = 3; k < 7; ++k) iterate(resumed_model, resumed, resumed_scaler, k);
  EXPECT_TRUE(Snapshot(opt, model) == Snapshot(resumed, resumed_model));

  // Names by group and index within it; amsgrad's buffer only in group 1.
  const detail::SafetensorsFile file{detail::MappedFile(path)};
  EXPECT_NE(file.find("group.0.param.2.exp_avg"), nullptr);
  EXPECT_EQ(file.find("group.0.param.2.max_exp_avg_sq"), nullptr);
  EXPECT_NE(file.find("group.1.param.1.max_exp_avg_sq"), nullptr);
  EXPECT_NE(file.find("group.1.param.0.master"), nullptr);  // f16 weights
  EXPECT_EQ(file.find("group.0.param.0.master"), nullptr);  // f32 weights
}

// A group added with add_param_group at step 3 has its own step count; a checkpoint
// brings it back into an optimizer built with both groups from the start.
TEST(Checkpoint, AGroupAddedLaterKeepsItsStepCount) {
  TempDir dir;
  const std::string path = dir.file("added.ckpt");
  Model model = Model::make(kSpec, 23);
  std::vector<ParamGroup> groups = two_groups(model);
  Optimizer opt({groups[0]});
  GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 2);
  for (int k = 0; k < 3; ++k) iterate(model, opt, scaler, k);
  opt.add_param_group(groups[1]);
  for (int k = 3; k < 6; ++k) iterate(model, opt, scaler, k);  // step 4 is skipped (inf)
  ASSERT_EQ(opt.step_count(), 5);
  ASSERT_EQ(opt.group_step_count(1), 2);
  opt.save(path, scaler);
  Model saved = model;
  for (int k = 6; k < 9; ++k) iterate(model, opt, scaler, k);

  Model resumed_model = saved;
  Optimizer resumed(two_groups(resumed_model));
  GradScaler resumed_scaler("cpu");
  resumed.load(path, resumed_scaler);
  EXPECT_EQ(resumed.step_count(), 5);
  EXPECT_EQ(resumed.group_step_count(0), 5);
  EXPECT_EQ(resumed.group_step_count(1), 2);
  for (int k = 6; k < 9; ++k) iterate(resumed_model, resumed, resumed_scaler, k);
  EXPECT_TRUE(Snapshot(opt, model) == Snapshot(resumed, resumed_model));
}

// NAdam under a beta1 schedule (OneCycleLR's cycle_momentum changes it every step): the
// carried mu_product is saved, loads bit for bit (into an optimizer that has stepped with
// other values first), and survives add_param_group; its offset is in the metadata only
// where it is not 0.
TEST(Checkpoint, NadamUnderABeta1ScheduleResumesBitForBit) {
  TempDir dir;
  const std::string path = dir.file("nadam.ckpt");
  const auto config_at = [](int k) {
    return optim::NAdam{.lr = 1e-2, .beta1 = 0.85 + 0.02 * (k % 4), .momentum_decay = k < 5 ? 4e-3 : 8e-3};
  };
  const auto run = [&](Model& m, Optimizer& o, GradScaler& s, int from, int to) {
    for (int k = from; k < to; ++k) {
      o.set_config(0, config_at(k));
      iterate(m, o, s, k);  // k = 4 is skipped (inf)
    }
  };
  Model model = Model::make(kSpec, 29);
  Optimizer opt(config_at(0), model.params(0, 3));
  GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 2);
  // A fresh optimizer's file has no offset.
  opt.save(path, scaler);
  EXPECT_EQ(detail::SafetensorsFile{detail::MappedFile(path)}.meta("group.0.mu_product_offset"), nullptr);
  run(model, opt, scaler, 0, 6);
  ASSERT_NE(opt.nadam_mu_product_offset(0), 0.0);
  opt.save(path, scaler);
  EXPECT_NE(detail::SafetensorsFile{detail::MappedFile(path)}.meta("group.0.mu_product_offset"), nullptr);
  const double product = opt.nadam_mu_product(0);
  Model saved = model;
  run(model, opt, scaler, 6, 10);

  Model resumed_model = saved;
  Optimizer resumed(config_at(0), resumed_model.params(0, 3));
  GradScaler resumed_scaler("cpu", 1024.0, 2.0, 0.5, 2);
  run(resumed_model, resumed, resumed_scaler, 0, 2);  // steps and a product of its own, overwritten by the load
  resumed_model = saved;
  resumed.load(path, resumed_scaler);
  EXPECT_EQ(resumed.nadam_mu_product(0), product);
  run(resumed_model, resumed, resumed_scaler, 6, 10);
  EXPECT_TRUE(Snapshot(opt, model) == Snapshot(resumed, resumed_model));
  EXPECT_EQ(resumed.nadam_mu_product(0), opt.nadam_mu_product(0));

  // An offset that would make the product leave [0, 1] (or is NaN) is a corrupt file.
  const auto bytes = read_bytes(path);
  for (const char* bad : {"1e6", "inf", "nan"}) {
    write_bytes(path, bytes);
    rewrite_metadata(path, [&](auto& m) { m["group.0.mu_product_offset"] = bad; });
    std::string message;
    EXPECT_EQ(code_of([&] { resumed.load(path, resumed_scaler); }, &message), ErrorCode::io_error) << bad;
    EXPECT_NE(message.find(std::string(bad) == "nan" ? "is not a number" : "outside [0, 1]"), std::string::npos)
        << message;
  }
  EXPECT_EQ(resumed.nadam_mu_product(0), opt.nadam_mu_product(0)) << "a refused file changed nothing";

  // add_param_group keeps the first group's product; the new group's starts at 1.
  const double before = opt.nadam_mu_product(0);
  opt.add_param_group({model.params(3), config_at(0)});
  EXPECT_EQ(opt.nadam_mu_product(0), before);
  EXPECT_EQ(opt.nadam_mu_product(1), 1.0);
}

TEST(Checkpoint, AnotherGroupStructureIsRefusedNamingTheDifference) {
  TempDir dir;
  const std::string path = dir.file("groups.ckpt");
  Model model = Model::make(kSpec, 25);
  Optimizer opt(two_groups(model));
  GradScaler scaler("cpu");
  iterate(model, opt, scaler, 0);
  opt.save(path);
  const auto expect_refused = [&](Optimizer& other, const std::string& words) {
    std::string message;
    EXPECT_EQ(code_of([&] { other.load(path); }, &message), ErrorCode::invalid_argument);
    EXPECT_NE(message.find(words), std::string::npos) << message;
    EXPECT_EQ(other.step_count(), 0);
  };
  Model m = Model::make(kSpec, 25);
  Optimizer one(optim::AdamW{}, m.params());
  expect_refused(one, "it holds 2 param groups, this optimizer has 1");
  Optimizer regrouped({{m.params(0, 2), optim::AdamW{}}, {m.params(2), optim::AdamW{.amsgrad = true}}});
  expect_refused(regrouped, "group 0 has 2 params, the checkpoint's group 0 has 3");
  Optimizer variant({{m.params(0, 3), optim::AdamW{}}, {m.params(3), optim::AdamW{}}});
  expect_refused(variant, "group 1: it was saved from update program");
  std::vector<ParamGroup> retyped_groups = two_groups(m);
  OptimizerOptions no_masters;
  no_masters.master_weights = false;
  Optimizer masterless(retyped_groups, no_masters);
  expect_refused(masterless, "groups[0].params[1]: saved with an fp32 master");

  // A format-2 file holds one group.
  Optimizer single(optim::AdamW{}, m.params());
  const std::string v2 = dir.file("v2.ckpt");
  write_bytes(v2, format2_file(single));
  Optimizer grouped(two_groups(m));
  std::string message;
  EXPECT_EQ(code_of([&] { grouped.load(v2); }, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("one param group; this optimizer has 2"), std::string::npos) << message;
}

// ---- compensated bf16 weights ----

// bf16 weights, one f32 among them (which keeps no compensation).
const std::vector<std::tuple<std::int64_t, DType, DType>> kCompensatedSpec = {
    {33, DType::bf16, DType::bf16}, {7, DType::f32, DType::f32}, {1000, DType::bf16, DType::f32},
    {40000, DType::bf16, DType::bf16}};

OptimizerOptions compensated() {
  OptimizerOptions o;
  o.master_weights = false;
  o.compensated_weights = true;
  return o;
}

// Every param's compensation (bit patterns; empty for those without one).
std::vector<std::vector<std::uint16_t>> compensations(const Optimizer& opt) {
  std::vector<std::vector<std::uint16_t>> out;
  for (std::size_t p = 0; p < opt.num_params(); ++p) {
    const std::span<const std::uint16_t> c = opt.compensation(p);
    out.emplace_back(c.begin(), c.end());
  }
  return out;
}

// Steps 0..2, save, steps 3..5 -> A; a fresh compensated optimizer on the weights as
// saved, load, steps 3..5 -> B: weights, state and compensations bitwise equal.
TEST(Checkpoint, CompensatedWeightsResumeBitForBit) {
  TempDir dir;
  const std::string path = dir.file("compensated.ckpt");
  const optim::AdamW config{.lr = 1e-3, .weight_decay = 0.01};
  Model model = Model::make(kCompensatedSpec, 31);
  Optimizer opt(config, model.params(), compensated());
  GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 2);
  for (int k = 0; k < 3; ++k) iterate(model, opt, scaler, k);
  const auto saved_compensations = compensations(opt);
  ASSERT_TRUE(saved_compensations[1].empty()) << "f32 weights keep no compensation";
  bool nonzero = false;
  for (std::size_t p : {0u, 2u, 3u}) {
    ASSERT_EQ(saved_compensations[p].size(), static_cast<std::size_t>(model.tensors[p].numel));
    for (std::uint16_t c : saved_compensations[p]) nonzero |= c != 0;
  }
  ASSERT_TRUE(nonzero) << "every compensation is still 0: the test could not tell them from a fresh optimizer's";
  opt.save(path, scaler);
  Model saved = model;
  for (int k = 3; k < 6; ++k) iterate(model, opt, scaler, k);

  Model resumed_model = saved;
  Optimizer resumed(config, resumed_model.params(), compensated());
  GradScaler resumed_scaler("cpu");
  resumed.load(path, resumed_scaler);
  EXPECT_EQ(compensations(resumed), saved_compensations);
  for (int k = 3; k < 6; ++k) iterate(resumed_model, resumed, resumed_scaler, k);
  EXPECT_TRUE(Snapshot(opt, model) == Snapshot(resumed, resumed_model));
  EXPECT_EQ(compensations(resumed), compensations(opt));

  // The file: BF16 [numel] tensors of the bit patterns, after every F32 tensor (which
  // so stay 4-byte aligned); "compensation" in every params entry.
  const detail::SafetensorsFile file{detail::MappedFile(path)};
  const detail::SafetensorsTensor* c0 = file.find("group.0.param.0.compensation");
  ASSERT_NE(c0, nullptr);
  EXPECT_EQ(c0->dtype, "BF16");
  EXPECT_EQ(c0->shape, std::vector<std::uint64_t>{33});
  const auto bytes = file.data(*c0);
  ASSERT_EQ(bytes.size(), 66u);
  EXPECT_EQ(std::memcmp(bytes.data(), saved_compensations[0].data(), bytes.size()), 0);
  EXPECT_EQ(file.find("group.0.param.1.compensation"), nullptr);
  EXPECT_EQ(file.find("group.0.param.0.master"), nullptr);
  bool in_bf16 = false;
  for (const detail::SafetensorsTensor& t : file.tensors()) {
    in_bf16 |= t.dtype == "BF16";
    EXPECT_EQ(t.dtype, in_bf16 ? "BF16" : "F32") << t.name;
    if (t.dtype == "F32") {
      EXPECT_EQ(t.begin % 4, 0u) << t.name;
    }
  }
  const std::string params = *file.meta("group.0.params");
  EXPECT_NE(params.find(R"("grad_dtype":"bf16","master":false,"compensation":true)"), std::string::npos) << params;
  EXPECT_NE(params.find(R"("grad_dtype":"f32","master":false,"compensation":false)"), std::string::npos) << params;
}

// A file whose params keep something else than this optimizer's (a compensation, an
// fp32 master, neither) is refused naming the option, and nothing changes.
TEST(Checkpoint, CompensationsMustMatchTheOptimizers) {
  TempDir dir;
  Model m = Model::make(kCompensatedSpec, 33);
  OptimizerOptions plain_options;
  plain_options.master_weights = false;
  const auto trained = [&](Model& model, const OptimizerOptions& o) {
    auto opt = std::make_unique<Optimizer>(optim::AdamW{.lr = 1e-3}, model.params(), o);
    GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 2);
    for (int k = 0; k < 2; ++k) iterate(model, *opt, scaler, k);
    return opt;
  };
  Model cm = m, mm = m, pm = m;
  const auto comp = trained(cm, compensated()), masters = trained(mm, OptimizerOptions{}), plain = trained(pm, plain_options);
  const std::string comp_file = dir.file("compensated.ckpt"), masters_file = dir.file("masters.ckpt"),
                    plain_file = dir.file("plain.ckpt");
  comp->save(comp_file);
  masters->save(masters_file);
  plain->save(plain_file);
  const auto expect_refused = [&](Optimizer& o, const Model& model, const std::string& path, const std::string& words) {
    SCOPED_TRACE(path);
    const Snapshot before(o, model);
    const auto comps = compensations(o);
    std::string message;
    EXPECT_EQ(code_of([&] { o.load(path); }, &message), ErrorCode::invalid_argument);
    EXPECT_NE(message.find(words), std::string::npos) << message;
    EXPECT_TRUE(Snapshot(o, model) == before);
    EXPECT_EQ(compensations(o), comps);
  };
  expect_refused(*masters, mm, comp_file,
                 "params[0]: saved with a bf16 compensation, this optimizer keeps an fp32 master instead "
                 "(OptimizerOptions::master_weights and compensated_weights differ)");
  expect_refused(*comp, cm, masters_file,
                 "params[0]: saved with an fp32 master, this optimizer keeps a bf16 compensation instead "
                 "(OptimizerOptions::master_weights and compensated_weights differ)");
  expect_refused(*plain, pm, comp_file,
                 "params[0]: saved with a bf16 compensation, this optimizer keeps none "
                 "(OptimizerOptions::compensated_weights differs)");
  expect_refused(*comp, cm, plain_file,
                 "params[0]: saved without a bf16 compensation, this optimizer keeps one "
                 "(OptimizerOptions::compensated_weights differs)");
  // Format 2 holds no compensations.
  const std::string v2 = dir.file("v2.ckpt");
  write_bytes(v2, format2_file(*plain));
  expect_refused(*comp, cm, v2,
                 "params[0]: this optimizer keeps a bf16 compensation (OptimizerOptions::compensated_weights), which "
                 "a format-2 checkpoint does not hold");
  plain->load(v2);

  // A version-3 file written before "compensation" existed: none, as before.
  rewrite_metadata(plain_file, [](auto& meta) {
    std::string& params = meta["group.0.params"];
    for (std::size_t at; (at = params.find(",\"compensation\":false")) != std::string::npos;)
      params.erase(at, std::string_view(",\"compensation\":false").size());
  });
  ASSERT_EQ(detail::SafetensorsFile(detail::MappedFile(plain_file)).meta("group.0.params")->find("compensation"),
            std::string::npos);
  plain->load(plain_file);
  expect_refused(*comp, cm, plain_file, "params[0]: saved without a bf16 compensation, this optimizer keeps one");

  // A compensation of another dtype is corrupt.
  rewrite_metadata(comp_file, [](auto&) {}, [](const detail::SafetensorsTensor& t) {
    return t.name == "group.0.param.2.compensation" ? "F32" : std::string_view(t.dtype);
  });
  const Snapshot before(*comp, cm);
  std::string message;
  EXPECT_EQ(code_of([&] { comp->load(comp_file); }, &message), ErrorCode::io_error);
  EXPECT_NE(message.find("tensor 'group.0.param.2.compensation' is not BF16 of shape [1000]"), std::string::npos) << message;
  EXPECT_TRUE(Snapshot(*comp, cm) == before);
}

// ---- the atomic writer ----

mode_t mode_of(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

// A checkpoint holds the optimizer's state and masters: a new one is readable by its
// owner only, and saving over an existing one keeps that file's permissions.
TEST(Checkpoint, NewFilesArePrivateAndAnExistingFilesModeIsKept) {
  Fixture f;
  const mode_t old_umask = ::umask(022);
  const std::string fresh = f.dir.file("fresh.ckpt");
  f.opt.save(fresh);
  EXPECT_EQ(mode_of(fresh), 0600u);
  ASSERT_EQ(::chmod(fresh.c_str(), 0640), 0);
  f.opt.save(fresh);
  EXPECT_EQ(mode_of(fresh), 0640u);
  ASSERT_EQ(::chmod(fresh.c_str(), 0600), 0);
  f.opt.save(fresh, f.scaler);
  EXPECT_EQ(mode_of(fresh), 0600u);
  ::umask(old_umask);
}

// A temporary file that a writer which died left (old, and nobody holds its lock) is
// removed by the next save to the same target; others are left alone: a fresh one (a
// writer that may be running), a locked one (a writer that is running), another
// target's.
TEST(Checkpoint, StaleTemporaryFilesOfTheTargetAreRemoved) {
  Fixture f;
  const auto make = [&](const std::string& name, bool old) {
    const std::string p = f.dir.file(name);
    write_bytes(p, std::vector<unsigned char>(100, 'x'));
    if (old) {
      const timespec times[2] = {{::time(nullptr) - 3600, 0}, {::time(nullptr) - 3600, 0}};
      EXPECT_EQ(::utimensat(AT_FDCWD, p.c_str(), times, 0), 0);
    }
    return p;
  };
  const std::string dead = make(".opt.ckpt.tmp-4242-00000000deadbeef", true);
  const std::string fresh = make(".opt.ckpt.tmp-4243-00000000deadbeef", false);
  const std::string locked = make(".opt.ckpt.tmp-4244-00000000deadbeef", true);
  const std::string other = make(".other.ckpt.tmp-4245-00000000deadbeef", true);
  const int holder = ::open(locked.c_str(), O_RDONLY | O_CLOEXEC);  // a live writer's lock
  ASSERT_GE(holder, 0);
  ASSERT_EQ(::flock(holder, LOCK_EX), 0);
  f.opt.save(f.path);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(fresh));
  EXPECT_TRUE(fs::exists(locked));
  EXPECT_TRUE(fs::exists(other));
  ::close(holder);
  f.opt.load(f.path);
}

// A restarted process that got its predecessor's pid (as in a container) finds that
// process's temporary file names taken: the save still succeeds.
TEST(Checkpoint, TemporaryNamesOfAReusedPidDoNotBlockTheSave) {
  Fixture f;
  const std::string prefix = ".opt.ckpt.tmp-" + std::to_string(::getpid()) + "-";
  for (int n = 0; n < 1000; ++n) write_bytes(f.dir.file(prefix + std::to_string(n)), {});
  f.opt.save(f.path, f.scaler);
  f.opt.load(f.path, f.scaler);
  EXPECT_EQ(f.dir.entries(), 1001u);
}

// A write that fails part-way (the file size limit here; a full disk alike) is an
// io_error naming the step and the reason, and leaves the old checkpoint as it was and
// no temporary file.
TEST(Checkpoint, AWriteThatFailsPartWayLeavesTheOldFile) {
  Fixture f;
  const auto old = read_bytes(f.path);
  rlimit saved_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved_limit), 0);
  const auto saved_handler = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal
  rlimit limit = saved_limit;
  limit.rlim_cur = old.size() / 2;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  std::string message;
  const ErrorCode code = code_of([&] { f.opt.save(f.path, f.scaler); }, &message);
  ::setrlimit(RLIMIT_FSIZE, &saved_limit);
  std::signal(SIGXFSZ, saved_handler);
  EXPECT_EQ(code, ErrorCode::io_error);
  EXPECT_NE(message.find("writing"), std::string::npos) << message;
  EXPECT_NE(message.find(std::strerror(EFBIG)), std::string::npos) << message;
  EXPECT_EQ(read_bytes(f.path), old);
  EXPECT_EQ(f.dir.entries(), 1u) << "the temporary file is removed";
  f.opt.load(f.path, f.scaler);
}

}  // namespace
}  // namespace stepfuse
