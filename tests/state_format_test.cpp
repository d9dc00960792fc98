// Optimizer state stored as bf16 or q8 (OptimizerOptions::state_format): each
// optimizer's trajectory against an fp32-state optimizer whose state is encoded
// and decoded by the scalar reference codec after every step; the results bitwise
// equal across Highway targets, thread counts, the interpreter, the unfused
// baseline and the LLVM backend; skipped steps; choosing formats (per stream, per
// group, the q8 size threshold) and the refusals; param groups; checkpoints
// loading bit for bit and converting between formats when asked.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "cpu_paths.hpp"
#include "jit/stochastic_round.h"
#include "runtime/cpu/kernels.hpp"
#include "runtime/cpu/q8.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

struct Tensor {
  std::int64_t numel;
  DType weight, grad;
};

// A list of tensors of any dtypes, random weights and (loss-scaled) gradients.
struct Model {
  std::vector<std::vector<std::uint8_t>> weights, grads;
  std::vector<Param> params;
  explicit Model(const std::vector<Tensor>& tensors, unsigned seed = 5) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (const Tensor& t : tensors) {
      std::vector<float> w(static_cast<std::size_t>(t.numel)), g(w.size());
      for (float& x : w) x = dist(rng);
      for (float& x : g) x = 64.0f * dist(rng);
      weights.emplace_back(w.size() * dtype_size(t.weight));
      grads.emplace_back(g.size() * dtype_size(t.grad));
      cpu::narrow(w.data(), t.weight, weights.back().data(), w.size());
      cpu::narrow(g.data(), t.grad, grads.back().data(), g.size());
    }
    for (std::size_t i = 0; i < tensors.size(); ++i)
      params.push_back({{weights[i].data(), tensors[i].numel, tensors[i].weight},
                        {grads[i].data(), tensors[i].numel, tensors[i].grad}});
  }
  // New gradients (the same for every model of the same seed and step).
  void regrad(int step) {
    std::mt19937 rng(1000u + static_cast<unsigned>(step));
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (Param& p : params) {
      std::vector<float> g(static_cast<std::size_t>(p.grad.numel));
      for (float& x : g) x = 64.0f * dist(rng);
      cpu::narrow(g.data(), p.grad.dtype, p.grad.data, g.size());
    }
  }
  std::vector<std::uint8_t> flat() const {
    std::vector<std::uint8_t> out;
    for (const auto& w : weights) out.insert(out.end(), w.begin(), w.end());
    return out;
  }
};

// Sizes around the q8 block (256) and the chunk (16384), weights with and without masters.
const std::vector<Tensor> kTensors = {{1, DType::f32, DType::f32},
                                      {7, DType::bf16, DType::bf16},
                                      {255, DType::f32, DType::bf16},
                                      {257, DType::f16, DType::f16},
                                      {1031, DType::bf16, DType::f32},
                                      {16384 + 300, DType::f32, DType::f32}};

OptimizerOptions format_options(StateFormat f) {
  OptimizerOptions o;
  o.state_format = f;
  o.min_q8_numel = 0;  // every tensor, the small ones too
  o.max_grad_norm = 10.0;
  o.cpu_backend = CpuBackend::highway;
  return o;
}

std::vector<OptimizerConfig> every_kind() {
  return {optim::AdamW{.lr = 1e-2, .weight_decay = 0.1},
          optim::Adam{.lr = 1e-2, .amsgrad = true},
          optim::SGD{.lr = 0.1, .momentum = 0.9, .nesterov = true},
          optim::Lion{.weight_decay = 0.1},
          optim::RMSprop{.lr = 1e-2, .momentum = 0.9, .centered = true},
          optim::Adagrad{.lr = 0.1, .initial_accumulator_value = 0.1},
          optim::NAdam{.lr = 1e-2},
          optim::RAdam{.lr = 1e-2},
          optim::Adamax{.lr = 1e-2},
          optim::Adadelta{},
          optim::Rprop{}};
}

// The scalar reference codec: what a stored stream holds after a step stores `v`.
std::vector<float> round_trip(const std::vector<float>& v, StateFormat f, bool nonnegative) {
  std::vector<float> out(v.size());
  if (f == StateFormat::bf16) {
    std::vector<std::uint16_t> h(v.size());
    cpu::narrow(v.data(), DType::bf16, h.data(), v.size());
    cpu::widen(DType::bf16, h.data(), out.data(), v.size());
    return out;
  }
  const cpu::Q8Map map = nonnegative ? cpu::Q8Map::unsigned_dynamic : cpu::Q8Map::signed_dynamic;
  std::vector<std::uint8_t> codes(v.size());
  std::vector<float> absmax((v.size() + cpu::kQ8Block - 1) / cpu::kQ8Block);
  cpu::q8_quantize_scalar(v.data(), codes.data(), absmax.data(), v.size(), map);
  cpu::q8_dequantize_scalar(codes.data(), absmax.data(), out.data(), v.size(), map);
  return out;
}

// Whether the program listing marks `stream` non-negative (q8: the unsigned code).
bool is_nonnegative(const Optimizer& opt, std::string_view stream) {
  const std::string text = opt.program_text(), head = "stream " + std::string(stream) + " : state";
  const std::size_t at = text.find(head);
  if (at == std::string::npos) return false;
  const std::string line = text.substr(at, text.find('\n', at) - at);
  return line.find("(nonnegative)") != std::string::npos;
}

// A stored stream computes as an f32 stream whose values are encoded and decoded
// after every step: so it equals an f32-state optimizer whose state is replaced by
// its round trip (the scalar reference codec) after every step. (One-phase programs:
// a two-phase program's phase 2 reads phase 1's stores as stored.)
TEST(StateFormats, FollowTheFp32StepEncodedAfterEveryStep) {
  for (StateFormat f : {StateFormat::bf16, StateFormat::q8}) {
    for (const OptimizerConfig& config : every_kind()) {
      const std::string what = std::string(optimizer_name(config)) + " " + std::string(state_format_name(f));
      Model a(kTensors), b(kTensors);
      OptimizerOptions ro = format_options(StateFormat::f32);
      Optimizer ref(config, a.params, ro), opt(config, b.params, format_options(f));
      const auto encode_ref = [&] {  // the reference's state, as stored
        for (std::string_view s : ref.state_names())
          for (std::size_t p = 0; p < ref.num_params(); ++p) {
            const std::span<float> v = ref.mutable_state(p, s);
            const std::vector<float> rt = round_trip({v.begin(), v.end()}, f, is_nonnegative(ref, s));
            std::copy(rt.begin(), rt.end(), v.begin());
          }
      };
      encode_ref();  // (the initial state is stored encoded too: Adagrad's initial_accumulator_value)
      for (int step = 1; step <= 4; ++step) {
        a.regrad(step);
        b.regrad(step);
        const StepResult ra = ref.step_scaled(64.0), rb = opt.step_scaled(64.0);
        ASSERT_EQ(ra.grad_norm, rb.grad_norm) << what;
        encode_ref();
        for (std::string_view s : ref.state_names()) {
          for (std::size_t p = 0; p < ref.num_params(); ++p) {
            ASSERT_EQ(opt.state_format(p, s), f) << what << " " << s;
            const std::span<const float> want = ref.state(p, s);
            const std::vector<float> got = opt.state_values(p, s);
            ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size_bytes()), 0)
                << what << " step " << step << " param " << p << " " << s;
          }
        }
        ASSERT_EQ(a.flat(), b.flat()) << what << " step " << step;
      }
    }
  }
}

// bf16 and f32 weights only (stochastic rounding refuses f16 ones).
const std::vector<Tensor> kNoF16 = {{7, DType::bf16, DType::bf16},
                                    {255, DType::f32, DType::bf16},
                                    {1031, DType::bf16, DType::f32},
                                    {16384 + 300, DType::bf16, DType::f16}};

// The weights and every stream's stored bytes and absmaxes, concatenated.
std::vector<std::uint8_t> train(const OptimizerConfig& config, const OptimizerOptions& o, int steps = 3,
                                const std::vector<Tensor>& tensors = kTensors) {
  Model m(tensors);
  Optimizer opt(config, m.params, o);
  for (int i = 1; i <= steps; ++i) {
    m.regrad(i);
    EXPECT_TRUE(opt.step_scaled(64.0).applied);
  }
  std::vector<std::uint8_t> out = m.flat();
  for (std::size_t p = 0; p < opt.num_params(); ++p)
    for (std::string_view s : opt.state_names()) {
      const std::span<const std::byte> bytes = opt.state_storage(p, s);
      const std::span<const float> absmax = opt.state_absmax(p, s);
      const auto* b = reinterpret_cast<const std::uint8_t*>(bytes.data());
      const auto* a = reinterpret_cast<const std::uint8_t*>(absmax.data());
      out.insert(out.end(), b, b + bytes.size());
      out.insert(out.end(), a, a + absmax.size_bytes());
    }
  return out;
}

// The index of `stream` among the program's streams (its listing's order).
int stream_index(const Optimizer& opt, std::string_view stream) {
  const std::string text = opt.program_text();
  int index = 0;
  for (std::size_t at = text.find("  stream "); at != std::string::npos; at = text.find("  stream ", at + 1), ++index)
    if (text.compare(at + 9, stream.size() + 3, std::string(stream) + " : ") == 0) return index;
  ADD_FAILURE() << "no stream " << stream << " in\n" << text;
  return -1;
}

// bf16 state beside bf16 weights rounded stochastically rounds stochastically too,
// each stream with bits of its own (sf_sr_state_step); beside f32 weights, to nearest.
// So it equals an f32-state optimizer (with the same weights' rounding) whose state is
// rounded so after every step, with the reference bits.
// With stochastic_state_rounding off, that state rounds to nearest even instead.
static void run_bf16_state_beside_stochastic_weights(const std::vector<OptimizerConfig>& configs, bool stochastic_state) {
  for (const OptimizerConfig& config : configs) {
    const std::string what = std::string(optimizer_name(config)) + (stochastic_state ? "" : ", nearest state");
    Model a(kNoF16), b(kNoF16);
    OptimizerOptions ro = format_options(StateFormat::f32);
    ro.master_weights = false;
    ro.stochastic_rounding = true;
    ro.seed = 0x5EED0000ABCDull;
    OptimizerOptions bo = ro;
    bo.state_format = StateFormat::bf16;
    bo.stochastic_state_rounding = stochastic_state;
    Optimizer ref(config, a.params, ro), opt(config, b.params, bo);
    for (int step = 1; step <= 4; ++step) {
      a.regrad(step);
      b.regrad(step);
      ASSERT_TRUE(ref.step_scaled(64.0).applied);
      ASSERT_TRUE(opt.step_scaled(64.0).applied);
      std::uint64_t base = 0;  // the model index of the param's element 0
      for (std::size_t p = 0; p < ref.num_params(); ++p) {
        const bool stochastic = stochastic_state && kNoF16[p].weight == DType::bf16;
        for (std::string_view s : ref.state_names()) {
          const int k = stream_index(ref, s);
          const std::span<float> v = ref.mutable_state(p, s);
          std::vector<std::uint16_t> h(v.size());
          if (stochastic) {
            for (std::size_t j = 0; j < v.size(); ++j)
              h[j] = sf_bf16_round_stochastic(
                  v[j], sf_sr_bits(ro.seed, sf_sr_state_step(static_cast<std::uint64_t>(step), k), base + j));
          } else {
            cpu::narrow(v.data(), DType::bf16, h.data(), v.size());
          }
          cpu::widen(DType::bf16, h.data(), v.data(), v.size());
          const std::vector<float> got = opt.state_values(p, s);
          ASSERT_EQ(std::memcmp(got.data(), v.data(), v.size_bytes()), 0)
              << what << " step " << step << " param " << p << " " << s;
        }
        base += static_cast<std::uint64_t>(kNoF16[p].numel);
      }
      ASSERT_EQ(a.flat(), b.flat()) << what << " step " << step;
    }
  }
}

TEST(StateFormats, Bf16StateBesideStochasticWeightsRoundsStochastically) {
  const std::vector<OptimizerConfig> configs = {optim::AdamW{.lr = 1e-2, .weight_decay = 0.1},
                                                optim::SGD{.lr = 0.1, .momentum = 0.9},
                                                optim::RMSprop{.lr = 1e-2, .momentum = 0.9, .centered = true}};
  for (const bool stochastic_state : {true, false}) {
    SCOPED_TRACE(stochastic_state ? "stochastic state" : "nearest state");
    run_bf16_state_beside_stochastic_weights(configs, stochastic_state);
  }
}

// What stochastic rounding of the state is for: a second moment decaying by
// beta2 = 0.999 a step moves by less than half a bf16 ulp (2^-9 of it), so rounded to
// nearest it never decays; rounded stochastically it follows 0.999^t on average.
TEST(StateFormats, StochasticBf16StateKeepsDecaying) {
  constexpr std::size_t kN = 8192;
  constexpr int kSteps = 600;
  const auto run = [&](bool stochastic, bool stochastic_state = true) {
    std::vector<std::uint16_t> w(kN), g(kN);
    const std::vector<float> ones(kN, 1.0f);
    cpu::narrow(ones.data(), DType::bf16, w.data(), kN);
    cpu::narrow(ones.data(), DType::bf16, g.data(), kN);
    std::vector<Param> params = {{{w.data(), kN, DType::bf16}, {g.data(), kN, DType::bf16}}};
    OptimizerOptions o;
    o.master_weights = false;
    o.stochastic_rounding = stochastic;
    o.stochastic_state_rounding = stochastic_state;
    o.state_format = StateFormat::bf16;
    Optimizer opt(optim::Adam{.lr = 1e-6}  /* betas 0.9, 0.999 */, params, o);
    opt.step();  // exp_avg_sq = 0.001
    std::fill(g.begin(), g.end(), std::uint16_t{0});
    for (int t = 1; t < kSteps; ++t) opt.step();
    double mean = 0;
    for (float v : opt.state_values(0, "exp_avg_sq")) mean += v;
    return mean / kN;
  };
  const double expected = 1e-3 * std::pow(0.999, kSteps - 1);  // 0.000549
  const double nearest = run(false), stochastic = run(true), nearest_state = run(true, false);
  EXPECT_GT(nearest, 0.99e-3) << "round to nearest was expected to stall";
  EXPECT_EQ(nearest_state, nearest) << "stochastic weights, state rounded to nearest: the same stall";
  EXPECT_NEAR(stochastic, expected, 0.02 * expected);
}

TEST(StateFormats, BitwiseIdenticalAcrossTargetsThreadsAndModes) {
  std::vector<OptimizerConfig> configs = {optim::AdamW{.lr = 1e-2, .weight_decay = 0.1}, optim::LAMB{},
                                          optim::SGD{.lr = 0.1, .momentum = 0.9}, optim::Adagrad{.lr = 0.1}};
  for (StateFormat f : {StateFormat::bf16, StateFormat::q8})
    for (const OptimizerConfig& config : configs)
      test::expect_same_on_every_cpu_path(
          format_options(f), [&](const OptimizerOptions& o) { return train(config, o); },
          std::string(optimizer_name(config)) + " " + std::string(state_format_name(f)));
  // One stream of each format, and bf16 weights rounded stochastically beside them.
  OptimizerOptions mixed = format_options(StateFormat::f32);
  mixed.state_formats = {{"exp_avg", StateFormat::q8}, {"exp_avg_sq", StateFormat::bf16}};
  test::expect_same_on_every_cpu_path(
      mixed, [&](const OptimizerOptions& o) { return train(optim::AdamW{.lr = 1e-2}, o); }, "AdamW q8 + bf16");
  OptimizerOptions sr = format_options(StateFormat::q8);
  sr.master_weights = false;
  sr.stochastic_rounding = true;
  sr.seed = 3;
  test::expect_same_on_every_cpu_path(
      sr, [&](const OptimizerOptions& o) { return train(optim::AdamW{.lr = 1e-2}, o, 3, kNoF16); },
      "AdamW q8, stochastic rounding");
  // bf16 state beside bf16 weights without masters: Highway's kernels read and write it in
  // registers (the other paths stage it).
  sr.state_format = StateFormat::bf16;
  test::expect_same_on_every_cpu_path(
      sr, [&](const OptimizerOptions& o) { return train(optim::AdamW{.lr = 1e-2}, o, 3, kNoF16); },
      "AdamW bf16 state, stochastic rounding");
  sr.stochastic_state_rounding = false;  // (Highway's and LLVM's kernels of that choice)
  test::expect_same_on_every_cpu_path(
      sr, [&](const OptimizerOptions& o) { return train(optim::AdamW{.lr = 1e-2}, o, 3, kNoF16); },
      "AdamW bf16 state rounded to nearest, stochastic rounding");
  test::expect_same_on_every_cpu_path(
      sr, [&](const OptimizerOptions& o) { return train(optim::LAMB{}, o, 3, kNoF16); },
      "LAMB bf16 state rounded to nearest, stochastic rounding");
  OptimizerOptions comp = format_options(StateFormat::bf16);
  comp.master_weights = false;
  comp.compensated_weights = true;
  test::expect_same_on_every_cpu_path(
      comp, [&](const OptimizerOptions& o) { return train(optim::LAMB{}, o, 3, kNoF16); },
      "LAMB bf16 state, compensated weights");
}

TEST(StateFormats, CustomProgramsAsBuiltIns) {
  const UpdateProgram program = UpdateProgram::from_config(optim::AdamW{.lr = 1e-2});
  Model a(kTensors), b(kTensors);
  Optimizer builtin(optim::AdamW{.lr = 1e-2}, a.params, format_options(StateFormat::q8));
  Optimizer custom(program, b.params, format_options(StateFormat::q8));
  for (int i = 1; i <= 3; ++i) {
    a.regrad(i);
    b.regrad(i);
    builtin.step_scaled(64.0);
    custom.step_scaled(64.0);
  }
  EXPECT_EQ(a.flat(), b.flat());
  for (std::size_t p = 0; p < builtin.num_params(); ++p)
    for (std::string_view s : builtin.state_names()) {
      EXPECT_TRUE(std::ranges::equal(builtin.state_storage(p, s), custom.state_storage(p, s))) << p << " " << s;
      EXPECT_TRUE(std::ranges::equal(builtin.state_absmax(p, s), custom.state_absmax(p, s))) << p << " " << s;
    }
}

TEST(StateFormats, SkippedStepsLeaveTheStoredStateUntouched) {
  for (Fusion fusion : {Fusion::fused, Fusion::unfused}) {
    Model m(kTensors);
    OptimizerOptions o = format_options(StateFormat::q8);
    o.fusion = fusion;
    Optimizer opt(optim::AdamW{.lr = 1e-2}, m.params, o);
    opt.step_scaled(64.0);
    const auto snapshot = [&] {
      std::vector<std::byte> out;
      for (std::size_t p = 0; p < opt.num_params(); ++p)
        for (std::string_view s : opt.state_names()) {
          const auto b = opt.state_storage(p, s);
          const auto a = std::as_bytes(opt.state_absmax(p, s));
          out.insert(out.end(), b.begin(), b.end());
          out.insert(out.end(), a.begin(), a.end());
        }
      return out;
    };
    const std::vector<std::byte> before = snapshot();
    const std::vector<std::uint8_t> weights = m.flat();
    static_cast<float*>(m.params.back().grad.data)[16384 + 7] = INFINITY;
    EXPECT_FALSE(opt.step_scaled(64.0).applied);
    EXPECT_EQ(snapshot(), before);
    EXPECT_EQ(m.flat(), weights);
  }
}

// Rprop's step_size starts at the lr of the first step, as PyTorch's: an lr set after
// construction but before any applied step (a warmup, a first step skipped) is where it
// starts, in every state format; once stepped, the state is its own.
TEST(StateFormats, RpropStepSizeStartsAtTheLrOfTheFirstAppliedStep) {
  for (StateFormat format : {StateFormat::f32, StateFormat::bf16, StateFormat::q8}) {
    SCOPED_TRACE(std::string(state_format_name(format)));
    Model a(kTensors), b(kTensors);
    Optimizer late(optim::Rprop{.lr = 1e-2}, a.params, format_options(format));
    Optimizer fresh(optim::Rprop{.lr = 2e-3}, b.params, format_options(format));
    static_cast<float*>(a.params.back().grad.data)[3] = INFINITY;
    EXPECT_FALSE(late.step_scaled(64.0).applied);  // skipped: no step yet
    static_cast<float*>(a.params.back().grad.data)[3] = static_cast<float*>(b.params.back().grad.data)[3];
    late.set_lr(2e-3);
    for (std::size_t p = 0; p < late.num_params(); ++p) {
      const auto x = late.state_storage(p, "step_size"), y = fresh.state_storage(p, "step_size");
      EXPECT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << "param " << p;
    }
    for (int step = 0; step < 3; ++step) {
      a.regrad(step);
      b.regrad(step);
      late.step_scaled(64.0);
      fresh.step_scaled(64.0);
      late.set_lr(0.5);  // after a step: the state is the step's
      fresh.set_lr(0.5);
    }
    EXPECT_EQ(a.flat(), b.flat());
    for (std::size_t p = 0; p < late.num_params(); ++p)
      EXPECT_EQ(late.state_values(p, "step_size"), fresh.state_values(p, "step_size")) << "param " << p;
  }
}

// ... but a step_size written before it (a restored state) stays as written; Adagrad's
// sum, which PyTorch sets at construction, does not follow initial_accumulator_value.
TEST(StateFormats, WrittenStateDoesNotFollowTheLr) {
  for (StateFormat format : {StateFormat::f32, StateFormat::bf16, StateFormat::q8}) {
    SCOPED_TRACE(std::string(state_format_name(format)));
    Model a(kTensors);
    Optimizer opt(optim::Rprop{.lr = 1e-2}, a.params, format_options(format));
    const std::size_t big = opt.num_params() - 1;
    const std::vector<float> written(static_cast<std::size_t>(a.params[big].weight.numel), 0.125f);
    opt.set_state_values(big, "step_size", written);
    const std::vector<float> before = opt.state_values(big, "step_size");
    opt.set_lr(0.5);
    EXPECT_EQ(opt.state_values(big, "step_size"), before);
    EXPECT_EQ(opt.state_values(0, "step_size"), std::vector<float>(1, 0.5f));  // not written: follows
    Optimizer ada(optim::Adagrad{.lr = 1e-2, .initial_accumulator_value = 0.25}, a.params, format_options(format));
    ada.set_config(optim::Adagrad{.lr = 1e-2, .initial_accumulator_value = 2.0});
    for (float x : ada.state_values(big, "sum")) ASSERT_EQ(x, 0.25f);
  }
}

TEST(StateFormats, ChoosingFormats) {
  Model m(kTensors);
  // The blanket format, a per-stream override, and q8 only from min_q8_numel elements.
  OptimizerOptions o;
  o.state_format = StateFormat::q8;
  o.state_formats = {{"exp_avg_sq", StateFormat::bf16}};
  Optimizer opt(optim::AdamW{}, m.params, o);
  for (std::size_t p = 0; p < opt.num_params(); ++p) {
    const auto n = static_cast<std::size_t>(m.params[p].weight.numel);
    const StateFormat first = n >= 4096 ? StateFormat::q8 : StateFormat::f32;
    EXPECT_EQ(opt.state_format(p, "exp_avg"), first) << p;
    EXPECT_EQ(opt.state_format(p, "exp_avg_sq"), StateFormat::bf16) << p;
    EXPECT_EQ(opt.state_storage(p, "exp_avg").size(), first == StateFormat::q8 ? n : 4 * n);
    EXPECT_EQ(opt.state_absmax(p, "exp_avg").size(), first == StateFormat::q8 ? (n + 255) / 256 : 0);
    EXPECT_EQ(opt.state_storage(p, "exp_avg_sq").size(), 2 * n);
    EXPECT_EQ(opt.state_absmax(p, "exp_avg_sq").size(), 0u);
    if (first == StateFormat::f32) EXPECT_EQ(opt.state(p, "exp_avg").size(), n);
    else EXPECT_THROW(opt.state(p, "exp_avg"), Error);
    EXPECT_THROW(opt.state(p, "exp_avg_sq"), Error);
  }
  // The initial state, encoded: Adagrad's accumulator starts at its initial value.
  Optimizer adagrad(optim::Adagrad{.initial_accumulator_value = 0.25}, m.params, format_options(StateFormat::q8));
  for (std::size_t p = 0; p < adagrad.num_params(); ++p)
    for (float v : adagrad.state_values(p, "sum")) ASSERT_EQ(v, 0.25f);
  // A group's own format.
  std::vector<Param> first(m.params.begin(), m.params.begin() + 3), rest(m.params.begin() + 3, m.params.end());
  OptimizerOptions none;
  none.min_q8_numel = 0;
  Optimizer groups({{first, optim::AdamW{}, StateFormat::bf16}, {rest, optim::AdamW{}}}, none);
  EXPECT_EQ(groups.state_format(0, "exp_avg"), StateFormat::bf16);
  EXPECT_EQ(groups.state_format(5, "exp_avg"), StateFormat::f32);
  EXPECT_EQ(groups.group_state_format(0), StateFormat::bf16);
  EXPECT_EQ(groups.group_state_format(1), std::nullopt);
  EXPECT_THROW(groups.group_state_format(2), Error);
  // set_state_values stores as a step would; state_values reads it back.
  std::vector<float> values(static_cast<std::size_t>(m.params[4].weight.numel));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.001f * static_cast<float>(i) - 0.3f;
  Optimizer q8(optim::AdamW{}, m.params, format_options(StateFormat::q8));
  q8.set_state_values(4, "exp_avg", values);
  EXPECT_EQ(q8.state_values(4, "exp_avg"), round_trip(values, StateFormat::q8, false));
  EXPECT_THROW(q8.set_state_values(4, "exp_avg", std::span<const float>(values).first(3)), Error);

  const auto message = [&](const OptimizerConfig& config, const OptimizerOptions& options) {
    try {
      Optimizer bad(config, m.params, options);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    ADD_FAILURE() << "no Error";
    return std::string();
  };
  // ASGD keeps its average of the weights in full precision.
  EXPECT_NE(message(optim::ASGD{}, format_options(StateFormat::q8)).find("'ax'"), std::string::npos);
  OptimizerOptions named;
  named.state_formats = {{"ax", StateFormat::bf16}};
  const std::string ax = message(optim::ASGD{}, named);
  EXPECT_NE(ax.find("ASGD"), std::string::npos) << ax;
  EXPECT_NE(ax.find("bf16"), std::string::npos) << ax;
  EXPECT_NE(ax.find("full precision"), std::string::npos) << ax;
  OptimizerOptions unknown;
  unknown.state_formats = {{"exp_avg_sqq", StateFormat::q8}};
  EXPECT_NE(message(optim::AdamW{}, unknown).find("'exp_avg', 'exp_avg_sq'"), std::string::npos);
  OptimizerOptions twice;
  twice.state_formats = {{"exp_avg", StateFormat::q8}, {"exp_avg", StateFormat::bf16}};
  EXPECT_NE(message(optim::AdamW{}, twice).find("second time"), std::string::npos);
  OptimizerOptions bad_enum;
  bad_enum.state_format = static_cast<StateFormat>(7);
  EXPECT_NE(message(optim::AdamW{}, bad_enum).find("not a StateFormat"), std::string::npos);
  OptimizerOptions negative;
  negative.min_q8_numel = -1;
  EXPECT_NE(message(optim::AdamW{}, negative).find("min_q8_numel"), std::string::npos);
  // Plain SGD keeps no state: nothing to store, nothing refused.
  EXPECT_NO_THROW(Optimizer(optim::SGD{}, m.params, format_options(StateFormat::q8)));
}

TEST(StateFormats, AddParamGroupKeepsTheStoredState) {
  Model m(kTensors), more({{3000, DType::f32, DType::f32}}, 9);
  Optimizer opt(optim::AdamW{.lr = 1e-2}, m.params, format_options(StateFormat::q8));
  opt.step_scaled(64.0);
  std::vector<std::vector<std::byte>> before;
  for (std::size_t p = 0; p < opt.num_params(); ++p)
    for (std::string_view s : opt.state_names()) {
      const auto b = opt.state_storage(p, s);
      const auto a = std::as_bytes(opt.state_absmax(p, s));
      before.emplace_back(b.begin(), b.end());
      before.back().insert(before.back().end(), a.begin(), a.end());
    }
  opt.add_param_group({more.params, optim::AdamW{.lr = 1e-3}});
  std::size_t k = 0;
  for (std::size_t p = 0; p + 1 < opt.num_params(); ++p)
    for (std::string_view s : opt.state_names()) {
      const auto b = opt.state_storage(p, s);
      const auto a = std::as_bytes(opt.state_absmax(p, s));
      std::vector<std::byte> now(b.begin(), b.end());
      now.insert(now.end(), a.begin(), a.end());
      EXPECT_EQ(now, before[k++]) << p << " " << s;
    }
  EXPECT_EQ(opt.state_format(opt.num_params() - 1, "exp_avg"), StateFormat::q8);
}

TEST(StateFormats, CheckpointsLoadBitForBitAndConvertWhenAsked) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "stepfuse_state_format_test";
  std::filesystem::create_directories(dir);
  const std::string q8_path = (dir / "q8.safetensors").string(), f32_path = (dir / "f32.safetensors").string();
  Model m(kTensors);
  OptimizerOptions mixed = format_options(StateFormat::q8);
  mixed.state_formats = {{"exp_avg_sq", StateFormat::bf16}};
  Optimizer saved(optim::AdamW{.lr = 1e-2}, m.params, mixed);
  for (int i = 1; i <= 2; ++i) {
    m.regrad(i);
    saved.step_scaled(64.0);
  }
  saved.save(q8_path);

  // The same formats: bit for bit, and training goes on identically.
  Model m2(kTensors);
  Optimizer loaded(optim::AdamW{.lr = 1e-2}, m2.params, mixed);
  loaded.load(q8_path);
  for (std::size_t p = 0; p < saved.num_params(); ++p)
    for (std::string_view s : saved.state_names()) {
      EXPECT_TRUE(std::ranges::equal(saved.state_storage(p, s), loaded.state_storage(p, s))) << p << " " << s;
      EXPECT_TRUE(std::ranges::equal(saved.state_absmax(p, s), loaded.state_absmax(p, s))) << p << " " << s;
    }

  // Another format: refused unless asked, naming the stream and both formats.
  Model m3(kTensors);
  Optimizer f32(optim::AdamW{.lr = 1e-2}, m3.params, format_options(StateFormat::f32));
  try {
    f32.load(q8_path);
    ADD_FAILURE() << "loaded q8 state into f32 without convert_state";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'exp_avg' was saved as q8"), std::string::npos) << msg;
    EXPECT_NE(msg.find("convert_state"), std::string::npos) << msg;
  }
  f32.load(q8_path, LoadOptions{.convert_state = true});
  for (std::size_t p = 0; p < saved.num_params(); ++p)
    for (std::string_view s : saved.state_names()) {
      const std::vector<float> want = saved.state_values(p, s);
      EXPECT_TRUE(std::ranges::equal(f32.state(p, s), want)) << p << " " << s;
    }
  EXPECT_EQ(f32.step_count(), 2);

  // And back: f32 state into q8, encoded as a step stores it.
  f32.save(f32_path);
  Model m4(kTensors);
  Optimizer q8(optim::AdamW{.lr = 1e-2}, m4.params, format_options(StateFormat::q8));
  EXPECT_THROW(q8.load(f32_path), Error);
  q8.load(f32_path, LoadOptions{.convert_state = true});
  for (std::size_t p = 0; p < saved.num_params(); ++p)
    for (std::string_view s : saved.state_names()) {
      const std::span<const float> v = f32.state(p, s);
      EXPECT_EQ(q8.state_values(p, s), round_trip({v.begin(), v.end()}, StateFormat::q8, s == "exp_avg_sq"))
          << p << " " << s;
    }
  std::filesystem::remove_all(dir);
}

// A LossScaleOptimizer's checkpoint: the inner optimizer's stored state converts on
// load as Optimizer::load's does, and the loss scale comes back either way.
TEST(StateFormats, LossScaleOptimizerCheckpointsConvertWhenAsked) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "stepfuse_state_format_lso_test";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "lso.safetensors").string();
  Model m(kTensors);
  Optimizer saved_inner(optim::AdamW{.lr = 1e-2}, m.params, format_options(StateFormat::q8));
  LossScaleOptimizer saved(saved_inner, true, 512.0, 2);
  for (int i = 1; i <= 3; ++i) {
    m.regrad(i);
    saved.apply_gradients();
  }
  saved.save(path);

  Model m2(kTensors);
  Optimizer inner(optim::AdamW{.lr = 1e-2}, m2.params, format_options(StateFormat::f32));
  LossScaleOptimizer loaded(inner, true, 8.0, 2);
  EXPECT_THROW(loaded.load(path), Error);
  EXPECT_EQ(loaded.loss_scale(), 8.0);  // nothing changed on the Error
  loaded.load(path, LoadOptions{.convert_state = true});
  EXPECT_EQ(loaded.loss_scale(), saved.loss_scale());
  EXPECT_EQ(saved_inner.step_count(), 3);
  EXPECT_EQ(inner.step_count(), saved_inner.step_count());
  for (std::size_t p = 0; p < saved_inner.num_params(); ++p)
    for (std::string_view s : saved_inner.state_names())
      EXPECT_TRUE(std::ranges::equal(inner.state(p, s), saved_inner.state_values(p, s))) << p << " " << s;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace stepfuse
