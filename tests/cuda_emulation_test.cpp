// The generated CUDA kernels, compiled as host C++ and run on the CPU with one
// std::thread per CUDA thread (tests/cuda_emulation), against the CPU backend:
// weights, every state tensor, masters, the step count and the step's result must
// be bit for bit the same, step after step (docs/architecture.md §5). No GPU needed: this is
// the CI guard on the kernels' logic (reduce order, last-block finalize, skip
// rules, update dispatch, vector paths, GradScaler kernels).
//
// EmulatedOptimizer mirrors CudaBackend (runtime/cuda/cuda_backend.cpp): the same
// layout (plan_cuda_layout), the same launches with the same arguments and grids;
// only device memory is host memory and a launch is emulate().
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "jit/builtins.hpp"
#include "jit/cuda/cuda_layout.hpp"
#include "jit/program_analysis.hpp"
#include "jit/update_program_rules.hpp"
#include "runtime/cpu/kernels.hpp"
#include "runtime/cpu/q8.hpp"
#include "runtime/scale_tensors.hpp"
#include "runtime/shard.hpp"
#include "runtime/thread_pool.hpp"
#include "stepfuse/stepfuse.hpp"
#include "tests/cuda_emulation/emulated_kernels.hpp"
#include "tests/reference/lars_program.hpp"
#include "tests/cuda_emulation/emulated_specs.hpp"
#include "tests/local_communicator.hpp"
#include "tests/cuda_emulation/cuda_shim.hpp"  // last: it defines CUDA's qualifiers as macros

namespace stepfuse {
namespace {

constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();
// Room after every buffer the device writes: a kernel writing past the end (one
// update block, say) changes it, which the Release build sees too (ASan sees more).
constexpr std::size_t kSlackBytes = SF_UPDATE_ELEMS * 4;

// ---- storage ----

float load(DType t, const void* base, std::int64_t i) {
  if (t == DType::f32) return static_cast<const float*>(base)[i];
  const std::uint16_t h = static_cast<const std::uint16_t*>(base)[i];
  return t == DType::f16 ? f16_to_float(h) : bf16_to_float(h);
}
void store(DType t, void* base, std::int64_t i, float v) {
  if (t == DType::f32) static_cast<float*>(base)[i] = v;
  else static_cast<std::uint16_t*>(base)[i] = t == DType::f16 ? float_to_f16(v) : float_to_bf16(v);
}

// Equal bits, or both NaN: NaN payloads are not part of the numerics (a GPU's are canonical).
bool same(float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) || (a != a && b != b); }
bool same(double a, double b) { return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b) || (a != a && b != b); }

std::string hex(float v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g (0x%08X)", static_cast<double>(v), std::bit_cast<std::uint32_t>(v));
  return buf;
}

// Adds a failure naming the first difference, when `n` values differ.
template <class Get>
void expect_same_values(std::int64_t n, Get get, const std::string& what) {
  std::int64_t bad = 0, first = -1;
  for (std::int64_t i = 0; i < n; ++i)
    if (const auto [cpu, dev] = get(i); !same(cpu, dev)) bad++, first = first < 0 ? i : first;
  if (bad > 0) {
    const auto [cpu, dev] = get(first);
    ADD_FAILURE() << what << ": " << bad << " of " << n << " elements differ; first [" << first << "]: cpu " << hex(cpu)
                  << ", emulated device " << hex(dev);
  }
}

struct TensorShape {
  std::int64_t numel;
  DType weight, grad;
};

// A model's caller-owned tensors: the CPU optimizer's weights, the emulated
// device's weights (same values), and one set of gradients both read (neither
// writes them). flat: tensors back to back in each arena (the flat layout);
// otherwise each on its own 64-byte boundary with a gap. shift: every tensor
// moved by that many elements (misaligned for vector accesses).
class Model {
 public:
  Model(std::vector<TensorShape> shapes, bool flat, int shift, std::mt19937& rng) : shapes_(std::move(shapes)) {
    std::size_t wat = 0, gat = 0;
    for (const TensorShape& s : shapes_) {
      const std::size_t wsize = dtype_size(s.weight), gsize = dtype_size(s.grad);
      if (!flat) wat = (wat + 63) / 64 * 64 + 64, gat = (gat + 63) / 64 * 64 + 64;
      woff_.push_back(wat + static_cast<std::size_t>(shift) * wsize);
      goff_.push_back(gat + static_cast<std::size_t>(shift) * gsize);
      wat += static_cast<std::size_t>(s.numel) * wsize;
      gat += static_cast<std::size_t>(s.numel) * gsize;
    }
    // + alignment, + slack in which a write past the last tensor is seen
    for (auto* arena : {&cpu_weights_, &dev_weights_, &grads_}) arena->resize((std::max(wat, gat) + 64 + kSlackBytes) / 8);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t t = 0; t < shapes_.size(); ++t)
      for (std::int64_t i = 0; i < shapes_[t].numel; ++i) {
        store(shapes_[t].weight, weight(false, t), i, normal(rng));
        store(shapes_[t].weight, weight(true, t), i, load(shapes_[t].weight, weight(false, t), i));
      }
    draw_grads(rng, 1.0);
  }
  Model(const Model&) = delete;

  std::size_t size() const { return shapes_.size(); }
  const TensorShape& shape(std::size_t t) const { return shapes_[t]; }
  void* weight(bool device, std::size_t t) const { return base(device ? dev_weights_ : cpu_weights_) + woff_[t]; }
  void* grad(std::size_t t) const { return base(grads_) + goff_[t]; }

  std::vector<Param> params(bool device) const {
    std::vector<Param> out;
    for (std::size_t t = 0; t < shapes_.size(); ++t)
      out.push_back({{weight(device, t), shapes_[t].numel, shapes_[t].weight}, {grad(t), shapes_[t].numel, shapes_[t].grad}});
    return out;
  }
  // Gradients N(0, sigma), rounded to their storage.
  void draw_grads(std::mt19937& rng, float sigma) {
    std::normal_distribution<float> normal(0.0f, sigma);
    for (std::size_t t = 0; t < shapes_.size(); ++t)
      for (std::int64_t i = 0; i < shapes_[t].numel; ++i) store(shapes_[t].grad, grad(t), i, normal(rng));
  }
  void set_grad(std::size_t t, std::int64_t i, float v) { store(shapes_[t].grad, grad(t), i, v); }

  // Adds a failure if the device wrote a weight byte outside every tensor (the
  // gaps and the slack of the arena, which the CPU never writes either).
  void expect_nothing_written_outside() const {
    std::vector<bool> inside(cpu_weights_.size() * 8 - 64, false);  // (the base is at most 56 bytes in)
    for (std::size_t t = 0; t < shapes_.size(); ++t)
      std::fill_n(inside.begin() + static_cast<std::ptrdiff_t>(woff_[t]), shapes_[t].numel * dtype_size(shapes_[t].weight), true);
    const std::byte* cpu = base(cpu_weights_);
    const std::byte* dev = base(dev_weights_);
    for (std::size_t i = 0; i < inside.size(); ++i)
      if (!inside[i] && cpu[i] != dev[i]) {
        ADD_FAILURE() << "the device wrote weight byte " << i << ", outside every tensor";
        return;
      }
  }

 private:
  static std::byte* base(const std::vector<std::uint64_t>& arena) {  // 64-byte aligned
    const auto p = reinterpret_cast<std::uintptr_t>(arena.data());
    return const_cast<std::byte*>(reinterpret_cast<const std::byte*>(arena.data())) + ((64 - p % 64) % 64);
  }
  std::vector<TensorShape> shapes_;
  std::vector<std::size_t> woff_, goff_;  // byte offsets from the arena's aligned base
  std::vector<std::uint64_t> cpu_weights_, dev_weights_, grads_;
};

// Tensor t of a mixed list takes combination t % combos.size() of the spec.
std::vector<TensorShape> shapes_for(const std::vector<std::int64_t>& sizes, const std::vector<jit::DtypeCombo>& combos) {
  std::vector<TensorShape> out;
  for (std::size_t t = 0; t < sizes.size(); ++t) out.push_back({sizes[t], combos[t % combos.size()].weight, combos[t % combos.size()].grad});
  return out;
}

// Several reduce chunks (16384) and update blocks (4096), odd sizes, an empty tensor.
const std::vector<std::int64_t> kSizes = {1, 4097, 3, 16385, 0, 40000, 33, 5, 4096, 17, 2};

// ---- the emulated device ----

unsigned grid_for(std::int64_t n, unsigned block) {  // as runtime/cuda/cuda_backend.cpp
  const std::int64_t blocks = (n + block - 1) / block;
  return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, 65535 * 8));
}

// CudaBackend (+ the CUDA branch of StepEngine) on host memory, kernels emulated.
class EmulatedOptimizer {
 public:
  // order_seed != 0: every launch runs its blocks in a shuffled order.
  EmulatedOptimizer(const OptimizerConfig& config, std::vector<Param> params, const OptimizerOptions& options,
                    std::uint32_t order_seed = 0)
      : EmulatedOptimizer(nullptr, &config, std::move(params), options, order_seed) {}
  // A custom program (StepEngine's custom branch: its rules and its streams' init values).
  EmulatedOptimizer(const UpdateProgram& program, std::vector<Param> params, const OptimizerOptions& options,
                    std::uint32_t order_seed = 0)
      : EmulatedOptimizer(&program, nullptr, std::move(params), options, order_seed) {}
  // Param groups (as StepEngine's and CudaBackend's): groups[g] has group_sizes[g]
  // consecutive params; each group runs its own variant of the program.
  EmulatedOptimizer(const std::vector<OptimizerConfig>& groups, const std::vector<std::size_t>& group_sizes,
                    std::vector<Param> params, const OptimizerOptions& options, std::uint32_t order_seed = 0)
      : EmulatedOptimizer(nullptr, groups.data(), std::move(params), options, order_seed, groups.size(), group_sizes) {}

  // Optimizer::set_lr(group, lr) on a built-in: new rules in device memory, in
  // effect at the next launch; the launches' sf_hyper (captured once, as a CUDA
  // graph holds its kernels' arguments) does not change.
  void set_lr(std::size_t group, double lr) {
    std::visit([&](auto& c) { c.lr = lr; }, configs_[group]);
    set_config(group, configs_[group], 0.0);
  }
  // Optimizer::set_config(group, config) on a built-in, its rules carrying `offset` as
  // NAdam's product offset (sf_scalar_rule.d: what the CPU's StepEngine computed).
  void set_config(std::size_t group, const OptimizerConfig& config, double offset) {
    configs_[group] = config;
    sf_scalar_rule rules[kMaxScalars] = {};
    jit::scalar_rules(configs_[group], *group_programs_[group], rules);
    for (int k = 0; k < kMaxScalars; ++k) {
      if (rules[k].kind == SF_RULE_NADAM_GRAD_COEF || rules[k].kind == SF_RULE_NADAM_MOMENTUM_COEF) rules[k].d = offset;
      group_rules_[group].rules[k] = rules[k];
    }
  }

 private:
  EmulatedOptimizer(const UpdateProgram* custom, const OptimizerConfig* config, std::vector<Param> params,
                    const OptimizerOptions& options, std::uint32_t order_seed, std::size_t num_groups = 1,
                    std::vector<std::size_t> group_sizes = {})
      : params_(std::move(params)), options_(options), seed_(order_seed) {
    if (group_sizes.empty()) group_sizes = {params_.size()};
    group_rules_.resize(num_groups);
    if (custom != nullptr) {
      custom_ = *custom;
      program_ = &custom_->program();
      for (int k = 0; k < program_->num_scalars; ++k)
        group_rules_[0].rules[k] = jit::device_rule(custom_->scalars()[k].rule);
    } else {
      program_ = &jit::builtin_program(jit::select_builtin(config[0]));
      for (std::size_t g = 0; g < num_groups; ++g) {
        configs_.push_back(config[g]);
        group_programs_.push_back(&jit::builtin_program(jit::select_builtin(config[g])));
        sf_scalar_rule rules[kMaxScalars] = {};
        jit::scalar_rules(config[g], *group_programs_[g], rules);
        for (int k = 0; k < kMaxScalars; ++k) group_rules_[g].rules[k] = rules[k];
      }
    }
    if (custom != nullptr) group_programs_.push_back(program_);
    std::vector<std::uint32_t> group_of;
    for (std::size_t g = 0; g < group_sizes.size(); ++g)
      group_of.insert(group_of.end(), group_sizes[g], static_cast<std::uint32_t>(g));
    // State stored as bf16 or q8: packed, the table layout (as CudaBackend).
    std::vector<std::array<StateFormat, kMaxStreams>> formats;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      formats.push_back(sf_emu::state_formats_of(*group_programs_[group_of[i]], params_[i].weight.numel, options_));
      for (const StateFormat f : formats.back()) packed_ = packed_ || f != StateFormat::f32;
    }
    layout_ = jit::plan_cuda_layout(*program_, params_, options_, /*allow_flat=*/num_groups == 1 && !packed_);
    layout_.spec.sharded = options_.communicator != nullptr;  // as CudaBackend
    group_variant_ = jit::assign_groups(layout_, group_programs_, group_of);
    jit::assign_state_formats(layout_, formats, options_.stochastic_state_rounding);  // (as CudaBackend)
    slots_ = jit::cuda_stream_slots(layout_.spec);
    // Group g's initial value of state buffer b (0 when its variant has no such stream).
    const auto init = [&](int b, std::size_t g) {
      const int s = stream_of(g, b);
      if (s < 0) return 0.0f;
      return custom != nullptr ? program_->streams[s].init : jit::initial_state_value(config[g], *group_programs_[g], s);
    };
    group_scalars_.assign(num_groups * SF_MAX_SCALARS, kPoison);
    hyper_.groups = group_rules_.data();
    hyper_.scalars = group_scalars_.data();
    hyper_.num_groups = static_cast<int>(num_groups);
    hyper_.max_grad_norm = options_.max_grad_norm ? *options_.max_grad_norm : 0.0;
    hyper_.seed = options_.seed;
    const std::string canonical = jit::canonical_text(layout_.spec);
    for (const sf_emu::StepKernels* k : sf_emu::step_kernels())
      if (canonical == k->canonical) kernels_ = k;
    if (kernels_ == nullptr)
      throw std::runtime_error("no emulated kernels for this spec (add it to tests/cuda_emulation/emulated_specs.hpp):\n" +
                               canonical);
    const sf_emu::UtilityKernels& util = sf_emu::utility_kernels();

    // State (sf_fill) and masters (sf_widen), on poisoned memory.
    if (packed_) init_packed_state(group_of, init);
    const long long total = layout_.layout.state_elems;
    for (int s = 0; s < (packed_ ? 0 : kMaxStreams); ++s) {  // s: a buffer (an sf_streams slot)
      bool used = false;
      for (std::size_t g = 0; g < num_groups; ++g) used = used || stream_of(g, s) >= 0;
      if (!used) continue;
      state_[s].assign(static_cast<std::size_t>(std::max<long long>(total, 1)) + kSlack, kPoison);
      if (num_groups == 1) {
        run(util.fill, launch(grid_for(total, 256), 256, true), state_[s].data(), total, init(s, 0));
        continue;
      }
      for (std::size_t i = 0; i < params_.size(); ++i) {  // each tensor its group's initial value
        const long long n = params_[i].weight.numel;
        if (n > 0)
          run(util.fill, launch(grid_for(n, 256), 256, true), state_[s].data() + layout_.layout.offsets[i], n,
                  init(s, group_of[i]));
      }
    }
    // (compensated weights: the master buffer holds bf16 compensations, zeros to start)
    const bool comps = layout_.layout.master_elem_bytes == 2;
    masters_.assign(static_cast<std::size_t>((layout_.layout.master_bytes() + 3) / 4) + kSlack, kPoison);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (layout_.layout.master_offsets[i] < 0) continue;
      layout_.tensors[i].master = reinterpret_cast<float*>(reinterpret_cast<char*>(masters_.data()) +
                                                           layout_.layout.master_offsets[i] * layout_.layout.master_elem_bytes);
      const long long n = params_[i].weight.numel;
      if (comps) {
        std::fill_n(reinterpret_cast<std::uint16_t*>(layout_.tensors[i].master), n, std::uint16_t{0});
        continue;
      }
      run(util.widen[static_cast<int>(params_[i].weight.dtype)], launch(grid_for(n, 256), 256, true),
              static_cast<const void*>(params_[i].weight.data), layout_.tensors[i].master, n);
    }
    // The tables, each at least one element long (as the backend's device copies).
    num_chunks_ = static_cast<int>(layout_.chunks.size());
    if (layout_.chunks.empty()) layout_.chunks.push_back({0, 0, 0});
    partials_.resize(layout_.chunks.size());
    tensor_sums_.resize(params_.size());
    std::memset(&st_, 0, sizeof st_);
    if (kernels_->phase1 != nullptr) {  // a two-phase program's chunk sums and tensor norms
      norm_sums_.assign(layout_.chunks.size() * SF_MAX_NORM_SLOTS, kPoison);
      norms_.assign(std::max<std::size_t>(params_.size(), 1) * SF_MAX_NORM_SLOTS, kPoison);
    }
    if (options_.communicator) connect_shard();
  }

  // CudaBackend::init_packed_state: each tensor's state in its own format, where
  // sf_tensor.state says; bf16 and q8 initial values encoded as the CPU encodes them.
  template <class Init>
  void init_packed_state(const std::vector<std::uint32_t>& group_of, const Init& init) {
    const jit::PackedState& plan = packed_state_ = jit::plan_packed_state(layout_);
    for (std::size_t b = 0; b < kMaxStreams; ++b) {
      if (plan.bytes[b] > 0) state_[b].assign(static_cast<std::size_t>(plan.bytes[b]) / sizeof(float) + kSlack, kPoison);
      if (plan.absmaxes[b] > 0) absmax_[b].assign(static_cast<std::size_t>(plan.absmaxes[b]) + kSlack, kPoison);
    }
    tensor_state_.assign(params_.size(), sf_tensor_state{});
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto k = static_cast<std::size_t>(layout_.tensors[i].combo);
      const long long n = params_[i].weight.numel;
      for (std::size_t s = 0; s < kMaxStreams; ++s) {
        const int b = plan.buffer[i][s];
        if (b < 0) continue;
        const StateFormat f = layout_.spec.combo_formats[k][s];
        auto* data = reinterpret_cast<char*>(state_[static_cast<std::size_t>(b)].data()) + plan.at[i][s];
        tensor_state_[i].data[s] = data;
        float* absmax = f == StateFormat::q8 ? absmax_[static_cast<std::size_t>(b)].data() + plan.absmax_at[i][s] : nullptr;
        tensor_state_[i].absmax[s] = absmax;
        const float value = init(b, group_of[i]);
        if (n == 0) continue;
        if (f == StateFormat::f32) {
          run(sf_emu::utility_kernels().fill, launch(grid_for(n, 256), 256, true), reinterpret_cast<float*>(data), n, value);
          continue;
        }
        const std::vector<float> values(static_cast<std::size_t>(n), value);
        if (f == StateFormat::bf16) {
          cpu::narrow(values.data(), DType::bf16, data, values.size());
        } else {
          const bool nonnegative = group_programs_[group_of[i]]->streams[s].values == StateValues::nonnegative;
          cpu::q8_quantize(values.data(), reinterpret_cast<std::uint8_t*>(data), absmax, values.size(),
                           nonnegative ? cpu::Q8Map::unsigned_dynamic : cpu::Q8Map::signed_dynamic);
        }
      }
      layout_.tensors[i].state = &tensor_state_[i];
    }
    q8_maps_.resize(4 * SF_Q8_BLOCK);
    cpu::q8_device_maps(q8_maps_.data());
    hyper_.q8_maps = q8_maps_.data();
  }

  // StepEngine::connect_shard (collective: every rank builds its optimizer at once),
  // then CudaBackend::set_shard.
  void connect_shard() {
    std::vector<bool> two_phase;
    for (std::size_t i = 0; i < params_.size(); ++i)
      two_phase.push_back(jit::is_two_phase(*group_programs_[static_cast<std::size_t>(layout_.tensors[i].group)]));
    shard_ = std::make_unique<detail::Shard>(options_, params_, two_phase);
    plan_ = shard_->device_plan();
    send_.assign(plan_.stride, static_cast<double>(kPoison));
    recv_.assign(plan_.stride * plan_.ranks, static_cast<double>(kPoison));
    model_sums_.assign(std::max<std::size_t>(plan_.tensor_begin.size() - 1, 1), static_cast<double>(kPoison));
    sf_shard& a = shard_args_;
    a.send_at = plan_.send_at.data();
    a.send_whole = plan_.send_whole.data();
    a.send = send_.data();
    a.recv = recv_.data();
    a.order = plan_.order.data();
    a.tensor_begin = plan_.tensor_begin.data();
    a.local_tensor = plan_.local_tensor.data();
    a.model_sums = model_sums_.data();
    a.refused = &refused_;
    a.stride = static_cast<long long>(plan_.stride);
    a.num_model_tensors = static_cast<int>(plan_.tensor_begin.size() - 1);
    a.ranks = static_cast<int>(plan_.ranks);
    if (options_.stochastic_rounding)  // the rounding counts elements by their index in the whole model
      for (std::size_t i = 0; i < params_.size(); ++i) layout_.tensors[i].model_index = shard_->model_index_of(i);
  }

 public:

  // StepEngine::step(loss_scale, scaled) then CudaBackend::step.
  void step(double loss_scale, bool scaled) { launch_step(loss_scale, nullptr, nullptr, scaled); }
  // StepEngine::step_device_scale: the scale read on the device, found_inf recorded in the scaler.
  void step_device_scale(const float* scale, sf_scaler_state* scaler) { launch_step(1.0, scale, scaler, true); }

  // CudaBackend::refuse_shard_step (StepEngine::step on a bad loss scale, sharded).
  void refuse_step() {
    std::fill(send_.begin(), send_.end(), 0.0);
    send_.back() = 1.0;
    shard_->device_communicator().all_gather(send_.data(), recv_.data(), send_.size(), CommType::f64);
  }
  // The first rank that refused the last step (sf_shard.refused), or -1.
  int refused_rank() const { return refused_; }

  // CudaBackend::read_result.
  StepResult result(std::vector<double>* tensor_norms) const {
    if (shard_ && refused_ >= 0) detail::Shard::throw_refused(static_cast<std::size_t>(refused_));
    StepResult r;
    r.applied = st_.applied != 0;
    r.found_inf = st_.found_inf != 0;
    r.grad_norm = st_.grad_norm;
    r.clip_coef = st_.clip_coef;
    tensor_norms->assign(params_.size(), NAN);
    if (!std::isnan(st_.grad_norm) && st_.loss_scale > 0) {
      const bool inf_norm = options_.norm_type == INFINITY;
      for (std::size_t t = 0; t < params_.size(); ++t)
        (*tensor_norms)[t] = (inf_norm ? tensor_sums_[t] : std::sqrt(tensor_sums_[t])) / st_.loss_scale;
    }
    return r;
  }
  std::int64_t step_count() const { return st_.step; }
  const sf_step_state& step_state() const { return st_; }
  std::string spec_name() const { return kernels_->name; }
  const jit::CudaLayout& layout() const { return layout_; }
  bool has_state(std::size_t t, std::string_view name) const {
    return group_programs_[static_cast<std::size_t>(layout_.tensors[t].group)]->find_stream(name) >= 0;
  }
  // Packed state: tensor t's stream as stored (values, bit patterns or codes) and its absmaxes.
  StateFormat state_format(std::size_t t, std::string_view name) const {
    if (!packed_) return StateFormat::f32;
    const int s = group_programs_[static_cast<std::size_t>(layout_.tensors[t].group)]->find_stream(name);
    return layout_.spec.combo_formats[static_cast<std::size_t>(layout_.tensors[t].combo)][static_cast<std::size_t>(s)];
  }
  const std::byte* state_storage(std::size_t t, std::string_view name) const {
    const int s = group_programs_[static_cast<std::size_t>(layout_.tensors[t].group)]->find_stream(name);
    return static_cast<const std::byte*>(tensor_state_[t].data[s]);
  }
  const float* state_absmax(std::size_t t, std::string_view name) const {
    const int s = group_programs_[static_cast<std::size_t>(layout_.tensors[t].group)]->find_stream(name);
    return tensor_state_[t].absmax[s];
  }
  const float* state(std::size_t t, std::string_view name) const {
    if (packed_) return reinterpret_cast<const float*>(state_storage(t, name));
    const std::size_t g = static_cast<std::size_t>(layout_.tensors[t].group);
    const int s = group_programs_[g]->find_stream(name);
    return state_[slots_[static_cast<std::size_t>(group_variant_[g])][static_cast<std::size_t>(s)]].data() +
           layout_.layout.offsets[t];
  }
  const float* master(std::size_t t) const {
    if (layout_.layout.master_offsets[t] < 0 || layout_.layout.master_elem_bytes != 4) return nullptr;
    return masters_.data() + layout_.layout.master_offsets[t];
  }
  const std::uint16_t* compensation(std::size_t t) const {
    if (layout_.layout.master_offsets[t] < 0 || layout_.layout.master_elem_bytes != 2) return nullptr;
    return reinterpret_cast<const std::uint16_t*>(masters_.data()) + layout_.layout.master_offsets[t];
  }
  // Adds a failure if a kernel wrote past the end of the state or master buffer.
  void expect_slack_untouched() const {
    const auto untouched = [](const std::vector<float>& b) {
      const auto poison = [](float x) { return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(kPoison); };
      return b.empty() || std::all_of(b.end() - kSlack, b.end(), poison);
    };
    for (const std::vector<float>& b : state_) EXPECT_TRUE(untouched(b)) << "a kernel wrote past the end of a state buffer";
    for (const std::vector<float>& b : absmax_) EXPECT_TRUE(untouched(b)) << "a kernel wrote past the end of an absmax buffer";
    EXPECT_TRUE(untouched(masters_)) << "a kernel wrote past the end of the master buffer";
  }

 private:
  // Group g's program stream that is state buffer b, or -1.
  int stream_of(std::size_t g, int b) const {
    const auto& slot = slots_[static_cast<std::size_t>(group_variant_[g])];
    const auto it = std::find(slot.begin(), slot.end(), b);
    return it == slot.end() ? -1 : static_cast<int>(it - slot.begin());
  }

  // emulate(), one launch at a time in the process: the emulation's shared memory and
  // thread pool are the process's (ranks of a sharded test run on threads of their own).
  // (One mutex for every instantiation: a static inside the template would be one per kernel.)
  static std::mutex& launch_mutex() {
    static std::mutex mu;
    return mu;
  }
  template <class... Params, class... Args>
  static void run(void (*kernel)(Params...), EmuLaunch l, Args&&... args) {
    std::lock_guard lock(launch_mutex());
    emulate(kernel, l, std::forward<Args>(args)...);
  }

  EmuLaunch launch(unsigned grid, unsigned block, bool sequential = false) {
    return {grid, block, seed_ ? seed_ + ++launches_ : 0, sequential};
  }

  void launch_step(double loss_scale, const float* scale_ptr, sf_scaler_state* scaler, bool scaled) {
    // Whatever a previous step left in the scratch tables must not matter.
    std::fill(partials_.begin(), partials_.end(), sf_partial{kPoison, kPoison, -1});
    std::fill(tensor_sums_.begin(), tensor_sums_.end(), static_cast<double>(kPoison));
    std::fill(group_scalars_.begin(), group_scalars_.end(), kPoison);
    const sf_hyper hyper = hyper_;  // the same arguments every step: what a captured graph replays
    const bool clip = options_.max_grad_norm.has_value();
    const bool reduce = scaled || clip || options_.track_grad_norm || scale_ptr != nullptr;
    if (shard_ && !reduce) refused_ = -1;
    if (reduce && shard_) {
      // The sharded step: this rank's values, the all_gather (outside the emulation's
      // lock: the other ranks' kernels run meanwhile), the model's combine.
      std::fill(send_.begin(), send_.end(), static_cast<double>(kPoison));
      std::fill(recv_.begin(), recv_.end(), static_cast<double>(kPoison));
      std::fill(model_sums_.begin(), model_sums_.end(), static_cast<double>(kPoison));
      refused_ = -7;
      const unsigned grid = static_cast<unsigned>(std::max((num_chunks_ + SF_REDUCE_WARPS - 1) / SF_REDUCE_WARPS, 1));
      run(kernels_->reduce_shard, launch(grid, 32 * SF_REDUCE_WARPS), layout_.tensors.data(),
          static_cast<int>(params_.size()), layout_.chunks.data(), num_chunks_, partials_.data(), &st_, shard_args_);
      shard_->device_communicator().all_gather(send_.data(), recv_.data(), plan_.stride, CommType::f64);
      run(kernels_->shard_finalize, launch(1, SF_SHARD_THREADS), shard_args_, tensor_sums_.data(),
          static_cast<int>(params_.size()), &st_, hyper, scale_ptr, loss_scale, scaled || clip ? 1 : 0, scaler);
    } else if (reduce) {
      const unsigned grid = static_cast<unsigned>(std::max((num_chunks_ + SF_REDUCE_WARPS - 1) / SF_REDUCE_WARPS, 1));
      EXPECT_EQ(static_cast<int>(grid), layout_.reduce_grid());
      run(kernels_->reduce, launch(grid, 32 * SF_REDUCE_WARPS), layout_.tensors.data(), static_cast<int>(params_.size()),
              layout_.chunks.data(), num_chunks_, partials_.data(), tensor_sums_.data(), &st_, hyper, scale_ptr,
              loss_scale, scaled || clip ? 1 : 0, scaler);
    }
    sf_streams streams{};
    for (int s = 0; s < kMaxStreams; ++s) streams.s[s] = state_[s].empty() ? nullptr : state_[s].data();
    if (kernels_->phase1 != nullptr) {
      // A two-phase program (as CudaBackend::step): phase 1 over the reduce chunks, the
      // tensors' norms, then sf_update runs phase 2 with them.
      std::fill(norm_sums_.begin(), norm_sums_.end(), kPoison);
      std::fill(norms_.begin(), norms_.end(), kPoison);
      const unsigned grid = static_cast<unsigned>(std::max((num_chunks_ + SF_REDUCE_WARPS - 1) / SF_REDUCE_WARPS, 1));
      run(kernels_->phase1, launch(grid, 32 * SF_REDUCE_WARPS), layout_.tensors.data(), layout_.chunks.data(),
              num_chunks_, streams, norm_sums_.data(), &st_, hyper, reduce ? 0 : 1);
      run(kernels_->combine, launch(1, 256), layout_.tensors.data(), static_cast<int>(params_.size()),
              norm_sums_.data(), norms_.data(), &st_, reduce ? 0 : 1);
      run(kernels_->update_norms, launch(static_cast<unsigned>(layout_.num_update_blocks), SF_UPDATE_THREADS),
              layout_.tensors.data(), layout_.blocks.data(), static_cast<long long>(layout_.flat_numel()), streams, &st_,
              hyper, reduce ? 0 : 1, static_cast<const float*>(norms_.data()));
      return;
    }
    run(kernels_->update, launch(static_cast<unsigned>(layout_.num_update_blocks), SF_UPDATE_THREADS),
            layout_.tensors.data(), layout_.blocks.data(), static_cast<long long>(layout_.flat_numel()), streams, &st_, hyper,
            reduce ? 0 : 1);
  }

  static constexpr std::size_t kSlack = kSlackBytes / sizeof(float);
  std::vector<Param> params_;
  OptimizerOptions options_;
  std::uint32_t seed_, launches_ = 0;
  int num_chunks_ = 0;
  const Program* program_;
  std::vector<OptimizerConfig> configs_;         // per group (built-ins)
  std::vector<const Program*> group_programs_;   // per group: its variant of the program
  std::vector<int> group_variant_;               // per group: its variant's index in the spec
  std::vector<std::array<int, kMaxStreams>> slots_;  // per variant, per program stream: its buffer
  std::vector<sf_group_rules> group_rules_;      // "device memory": sf_hyper.groups
  std::vector<float> group_scalars_;             // "device memory": sf_hyper.scalars
  sf_hyper hyper_{};
  jit::CudaLayout layout_;
  const sf_emu::StepKernels* kernels_ = nullptr;
  std::vector<float> state_[kMaxStreams], masters_;
  // Packed state (bf16 or q8): the plan, each buffer's absmaxes, the tensors' sf_tensor_state, the q8 maps.
  bool packed_ = false;
  jit::PackedState packed_state_;
  std::vector<float> absmax_[kMaxStreams], q8_maps_;
  std::vector<sf_tensor_state> tensor_state_;
  std::optional<UpdateProgram> custom_;       // a custom program (program_ points into it)
  std::vector<float> norm_sums_, norms_;      // a two-phase program's
  std::vector<sf_partial> partials_;
  std::vector<double> tensor_sums_;
  sf_step_state st_;
  // A sharded step's (connect_shard): the plan, its "device" tables and buffers.
  std::unique_ptr<detail::Shard> shard_;
  detail::Shard::DevicePlan plan_;
  std::vector<double> send_, recv_, model_sums_;
  int refused_ = -1;
  sf_shard shard_args_{};
};

// ---- CPU vs emulated device ----

struct Pair {
  // `what`: a built-in's OptimizerConfig, or a custom UpdateProgram.
  template <class What>
  Pair(const Model& m, const What& config, OptimizerOptions options, std::uint32_t order_seed = 0)
      : model(m), cpu(config, m.params(false), cpu_options(options)), dev(config, m.params(true), options, order_seed) {}
  // Param groups: configs[g] over sizes[g] consecutive tensors of the model.
  Pair(const Model& m, const std::vector<OptimizerConfig>& configs, const std::vector<std::size_t>& sizes,
       OptimizerOptions options, std::uint32_t order_seed = 0)
      : model(m), cpu(groups_of(m.params(false), configs, sizes), cpu_options(options)),
        dev(configs, sizes, m.params(true), options, order_seed) {}
  static std::vector<ParamGroup> groups_of(const std::vector<Param>& params, const std::vector<OptimizerConfig>& configs,
                                           const std::vector<std::size_t>& sizes) {
    std::vector<ParamGroup> out;
    std::size_t at = 0;
    for (std::size_t g = 0; g < configs.size(); ++g, at += sizes[g - 1])
      out.push_back({std::vector<Param>(params.begin() + static_cast<std::ptrdiff_t>(at),
                                        params.begin() + static_cast<std::ptrdiff_t>(at + sizes[g])),
                     configs[g]});
    return out;
  }
  static OptimizerOptions cpu_options(OptimizerOptions o) {
    o.device = Device::cpu();
    o.fusion = Fusion::fused;
    return o;
  }
  // Optimizer::step_scaled(S) / step() on both.
  void step_scaled(double s) { cpu.step_scaled(s), dev.step(s, true); }
  void step() { cpu.step(), dev.step(1.0, false); }
  // A plain step for scale 1, else a scaled one.
  void step_at(double s) { s == 1.0 ? step() : step_scaled(s); }

  // Everything a step leaves behind.
  // results = false: before the first step (the device's result is then not defined).
  void expect_same(const std::string& when, bool results = true) const {
    SCOPED_TRACE(when);
    EXPECT_EQ(cpu.step_count(), dev.step_count());
    if (results) expect_same_results();
    expect_same_tensors();
  }
  void expect_same_results() const {
    std::vector<double> dev_norms;
    const StepResult c = cpu.last_result(), d = dev.result(&dev_norms);
    EXPECT_EQ(c.applied, d.applied);
    EXPECT_EQ(c.found_inf, d.found_inf);
    EXPECT_TRUE(same(c.grad_norm, d.grad_norm)) << "grad_norm: cpu " << c.grad_norm << ", device " << d.grad_norm;
    EXPECT_TRUE(same(c.clip_coef, d.clip_coef)) << "clip_coef: cpu " << c.clip_coef << ", device " << d.clip_coef;
    const std::vector<double>& cpu_norms = cpu.last_tensor_grad_norms();
    for (std::size_t t = 0; t < model.size(); ++t)
      EXPECT_TRUE(same(cpu_norms[t], dev_norms[t])) << "tensor " << t << " norm: cpu " << cpu_norms[t] << ", device " << dev_norms[t];
  }
  void expect_same_tensors() const {
    model.expect_nothing_written_outside();
    dev.expect_slack_untouched();
    for (std::size_t t = 0; t < model.size(); ++t) {
      const TensorShape& s = model.shape(t);
      const std::string name = "tensor " + std::to_string(t) + " (" + std::string(dtype_name(s.weight)) + "/" +
                               std::string(dtype_name(s.grad)) + ", " + std::to_string(s.numel) + ")";
      expect_same_values(s.numel, [&](std::int64_t i) {
        return std::pair{load(s.weight, model.weight(false, t), i), load(s.weight, model.weight(true, t), i)};
      }, name + " weights");
      for (std::string_view state : cpu.state_names()) {
        if (!dev.has_state(t, state)) {  // a stream of another group's variant only: refused on both
          EXPECT_THROW(static_cast<void>(cpu.state(t, state)), Error) << name << " " << state;
          continue;
        }
        const StateFormat format = cpu.state_format(t, state);
        EXPECT_EQ(format, dev.state_format(t, state)) << name << " " << state;
        if (format != StateFormat::f32) {  // as stored: bit patterns or codes, and absmaxes
          const std::span<const std::byte> cb = cpu.state_storage(t, state);
          EXPECT_EQ(0, std::memcmp(cb.data(), dev.state_storage(t, state), cb.size())) << name << " " << state << " as stored";
          const std::span<const float> ca = cpu.state_absmax(t, state);
          const float* da = dev.state_absmax(t, state);
          expect_same_values(static_cast<std::int64_t>(ca.size()),
                             [&](std::int64_t i) { return std::pair{ca[static_cast<std::size_t>(i)], da[i]}; },
                             name + " " + std::string(state) + " absmax");
          continue;
        }
        const std::span<const float> cs = cpu.state(t, state);
        const float* ds = dev.state(t, state);
        expect_same_values(s.numel, [&](std::int64_t i) { return std::pair{cs[static_cast<std::size_t>(i)], ds[i]}; },
                           name + " " + std::string(state));
      }
      const std::span<const float> cm = cpu.master(t);
      const float* dm = dev.master(t);
      EXPECT_EQ(cm.empty(), dm == nullptr || s.numel == 0) << name << " master";
      if (!cm.empty() && dm != nullptr)
        expect_same_values(s.numel, [&](std::int64_t i) { return std::pair{cm[static_cast<std::size_t>(i)], dm[i]}; },
                           name + " master");
      const std::span<const std::uint16_t> cc = cpu.compensation(t);
      const std::uint16_t* dc = dev.compensation(t);
      EXPECT_EQ(cc.empty(), dc == nullptr || s.numel == 0) << name << " compensation";
      if (!cc.empty() && dc != nullptr)
        expect_same_values(s.numel, [&](std::int64_t i) {
          return std::pair{load(DType::bf16, cc.data(), i), load(DType::bf16, dc, i)};
        }, name + " compensation");
    }
  }

  const Model& model;
  Optimizer cpu;
  EmulatedOptimizer dev;
};

// Fresh gradients of magnitude `magnitude` * S in `model`, a step at S on both sides
// (Pair::step_at), and everything compared.
void draw_step_compare(Model& model, std::mt19937& rng, Pair& p, double magnitude, double s, const std::string& when) {
  model.draw_grads(rng, static_cast<float>(magnitude * s));
  p.step_at(s);
  p.expect_same(when);
}

// A fresh random seed per test, in every failure message (the test's data depend on it;
// EmptyTensorsOnly and ReductionCombinesInTheCanonicalOrder draw theirs from a fixed one).
// STEPFUSE_TEST_SEED=<seed> replays a failure's seed.
std::uint32_t test_seed() {
  if (const char* s = std::getenv("STEPFUSE_TEST_SEED"); s != nullptr && *s != '\0')
    return static_cast<std::uint32_t>(std::strtoul(s, nullptr, 10));
  return std::random_device{}();
}
class Seeded : public ::testing::Test {
 protected:
  const std::uint32_t seed = test_seed();
  const ::testing::ScopedTrace seed_trace{__FILE__, __LINE__, "seed " + std::to_string(seed)};
  std::mt19937 rng{seed};
};
class EmulatedStep : public Seeded {};
class EmulatedGradScaler : public Seeded {};
class EmulatedScaleKernels : public Seeded {};

// ---- every program ----

struct ProgramCase {
  const char* name;
  OptimizerConfig config;
};
void PrintTo(const ProgramCase& c, std::ostream* os) { *os << c.name; }  // gtest's name for the parameter

std::vector<ProgramCase> program_cases() {
  return {
      {"sgd", optim::SGD{.lr = 0.01, .weight_decay = 0.01}},
      {"sgd_momentum", optim::SGD{.lr = 0.01, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01, .maximize = true}},
      {"sgd_nesterov", optim::SGD{.lr = 0.01, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true}},
      {"adamw", optim::AdamW{.lr = 1e-3, .weight_decay = 0.1}},
      {"adam_l2_maximize", optim::Adam{.lr = 1e-3, .weight_decay = 0.01, .maximize = true}},
      {"adam_amsgrad", optim::Adam{.lr = 1e-3, .weight_decay = 0.01, .amsgrad = true}},
      {"adamw_amsgrad", optim::AdamW{.lr = 1e-3, .amsgrad = true}},
      {"adagrad", optim::Adagrad{.lr = 0.01, .lr_decay = 0.01, .weight_decay = 0.01, .initial_accumulator_value = 0.1}},
      {"rmsprop", optim::RMSprop{.lr = 0.01, .weight_decay = 0.01}},
      {"rmsprop_centered", optim::RMSprop{.lr = 0.01, .centered = true}},
      {"rmsprop_momentum", optim::RMSprop{.lr = 0.01, .momentum = 0.9}},
      {"rmsprop_centered_momentum", optim::RMSprop{.lr = 0.01, .weight_decay = 0.01, .momentum = 0.9, .centered = true}},
      {"lion", optim::Lion{.lr = 1e-3, .weight_decay = 0.1}},
      {"nadam", optim::NAdam{.lr = 1e-3, .weight_decay = 0.01}},
      {"nadam_decoupled", optim::NAdam{.lr = 1e-3, .weight_decay = 0.01, .decoupled_weight_decay = true}},
      {"radam", optim::RAdam{.lr = 1e-3, .beta2 = 0.9, .weight_decay = 0.01, .maximize = true}},
      {"adamax", optim::Adamax{.lr = 1e-3, .weight_decay = 0.01}},
      {"adadelta", optim::Adadelta{.weight_decay = 0.01}},
      {"rprop", optim::Rprop{.lr = 1e-3, .step_size_max = 1.1e-3}},
      {"asgd", optim::ASGD{.lr = 1e-2, .lambd = 0.1, .t0 = 0, .weight_decay = 0.01}},
      {"lamb", optim::LAMB{.lr = 1e-3, .weight_decay = 0.05}},
      {"lamb_no_weight_decay_maximize", optim::LAMB{.lr = 1e-3, .weight_decay = 0, .maximize = true}},
  };
}

class EveryProgram : public Seeded, public ::testing::WithParamInterface<ProgramCase> {};

// Steps of one program on a model of `sizes` (mixed dtypes, masters) with `options`, its
// kernels the spec named `spec`: scaled and plain steps alternating (the step count
// advances in the reduce's finalize, then in the plain update), blocks in shuffled
// order, every step compared.
void every_program_steps(const OptimizerConfig& config, const std::vector<std::int64_t>& sizes,
                         const OptimizerOptions& options, const std::string& spec, std::mt19937& rng, std::uint32_t seed) {
  Model model(shapes_for(sizes, sf_emu::kMixedMasters), false, 0, rng);
  Pair p(model, config, options, seed | 1);
  EXPECT_EQ(p.dev.spec_name(), spec);
  p.expect_same("after construction", false);
  const double scales[] = {1024.0, 1.0, 3000.5, 1.0, 0.25};
  // RAdam's rectified update starts where rho_t > 5 (step 6 with beta2 = 0.9): 7 steps for it.
  const int steps = std::holds_alternative<optim::RAdam>(config) ? 7 : 5;
  for (int k = 0; k < steps; ++k) {
    draw_step_compare(model, rng, p, 0.5, scales[k % 5], "step " + std::to_string(k + 1));
    EXPECT_TRUE(p.dev.step_state().applied);
  }
  EXPECT_EQ(p.dev.step_count(), steps);
}
std::string program_name(const OptimizerConfig& config) {
  return std::string(jit::builtin_program(jit::select_builtin(config)).name);
}

TEST_P(EveryProgram, StepsMatchTheCpuBitwise) {
  every_program_steps(GetParam().config, kSizes, {}, program_name(GetParam().config), rng, seed);
}

INSTANTIATE_TEST_SUITE_P(Emulated, EveryProgram, ::testing::ValuesIn(program_cases()),
                         [](const ::testing::TestParamInfo<ProgramCase>& info) { return std::string(info.param.name); });

// ---- two-phase programs (per-tensor norms: sf_phase1, sf_phase_combine, sf_update) ----

// LAMB, unaligned (shift 1: scalar accesses) and with the inf-norm clipping, plain and
// scaled steps; and a skipped step (inf gradient) that runs neither phase.
TEST_F(EmulatedStep, LambUnalignedWithInfNormClipping) {
  Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 1, rng);
  Pair p(model, optim::LAMB{.lr = 1e-3, .weight_decay = 0.1}, {.max_grad_norm = 0.75, .norm_type = INFINITY}, seed | 1);
  EXPECT_EQ(p.dev.spec_name(), "lamb_unaligned_inf");
  const double scales[] = {2048.0, 1.0, 3.0, 1.0};
  for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "step " + std::to_string(k + 1));
  model.set_grad(3, 16384, INFINITY);
  p.step_scaled(1024.0);
  p.expect_same("a skipped step");
  EXPECT_FALSE(p.dev.step_state().applied);
  EXPECT_EQ(p.dev.step_count(), 4);
}

// A user's two-phase program (LARS, tests/reference/lars_program.hpp): its kernels
// generated for a custom program, bitwise the CPU's, with clipping and plain steps.
TEST_F(EmulatedStep, CustomTwoPhaseProgramLars) {
  Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
  Pair p(model, ref::lars(), {.max_grad_norm = 5.0}, seed | 1);
  EXPECT_EQ(p.dev.spec_name(), "lars");
  const double scales[] = {1024.0, 1.0, 3000.5, 1.0};
  for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "step " + std::to_string(k + 1));
  EXPECT_EQ(p.dev.step_count(), 4);
}

// ---- param groups and device-resident schedules ----

// Three groups with their own hyperparameters (one global clip): bitwise the CPU's
// groups, scaled and plain steps; per-group initial state (Adagrad's accumulator).
TEST_F(EmulatedStep, ParamGroupsMatchTheCpu) {
  Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
  const std::vector<std::size_t> sizes = {4, 2, 5};
  Pair p(model,
         {optim::AdamW{.lr = 1e-3, .weight_decay = 0.1}, optim::AdamW{.lr = 3e-3, .weight_decay = 0.0},
          optim::AdamW{.lr = 2e-4, .beta1 = 0.8, .weight_decay = 0.01}},
         sizes, {.max_grad_norm = 2.0}, seed | 1);
  const double scales[] = {1024.0, 1.0, 3000.5, 1.0};
  for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "step " + std::to_string(k + 1));
  EXPECT_LT(p.dev.step_state().clip_coef, 1.0);

  Model m2(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
  Pair q(m2, {optim::Adagrad{.lr = 0.1, .initial_accumulator_value = 0.5}, optim::Adagrad{.lr = 0.01}}, {6, 5}, {},
         seed | 1);
  q.expect_same("after construction", false);
  for (int k = 0; k < 3; ++k) draw_step_compare(m2, rng, q, 0.5, scales[k], "adagrad step " + std::to_string(k + 1));
}

// Groups whose flags pick other variants of the program run them in the same kernels,
// bitwise the CPU's: amsgrad in one group (its own state buffer), RMSprop plain, centered
// with momentum (two buffers of its own) and plain again, SGD with momentum, without (no
// state at all) and nesterov (the same buffer as the first group's).
TEST_F(EmulatedStep, ProgramVariantsPerGroupMatchTheCpu) {
  const double scales[] = {1024.0, 1.0, 3000.5, 1.0};
  {
    Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
    Pair p(model,
           {optim::Adam{.lr = 1e-3}, optim::Adam{.lr = 2e-3, .weight_decay = 0.01, .amsgrad = true},
            optim::Adam{.lr = 5e-4, .beta1 = 0.8}},
           {4, 3, 4}, {.max_grad_norm = 2.0}, seed | 1);
    EXPECT_EQ(p.dev.spec_name(), "adam_groups");
    for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "adam step " + std::to_string(k + 1));
  }
  {
    Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
    Pair p(model,
           {optim::RMSprop{.lr = 1e-3}, optim::RMSprop{.lr = 2e-3, .momentum = 0.9, .centered = true},
            optim::RMSprop{.lr = 5e-4, .alpha = 0.9}},
           {5, 3, 3}, {}, seed | 2);
    EXPECT_EQ(p.dev.spec_name(), "rmsprop_groups");
    for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "rmsprop step " + std::to_string(k + 1));
  }
  {
    Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
    Pair p(model,
           {optim::SGD{.lr = 0.1, .momentum = 0.9}, optim::SGD{.lr = 0.05},
            optim::SGD{.lr = 0.01, .momentum = 0.8, .nesterov = true}},
           {4, 4, 3}, {.max_grad_norm = 1.0}, seed | 3);
    EXPECT_EQ(p.dev.spec_name(), "sgd_groups");
    for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "sgd step " + std::to_string(k + 1));
  }
}

// PyTorch's capturable=True with a tensor lr: the launches' arguments stay those of
// the first step (as a captured CUDA graph's do), the rules change in device memory
// between steps, and every step uses the lr of its time: bitwise the CPU's set_lr.
TEST_F(EmulatedStep, AScheduleReachesReplayedLaunches) {
  Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
  Pair p(model, {optim::AdamW{.lr = 1e-3, .weight_decay = 0.1}, optim::AdamW{.lr = 1e-3, .weight_decay = 0.0}}, {6, 5},
         {.max_grad_norm = 1.0}, seed | 1);
  for (int k = 0; k < 6; ++k) {
    const double lr0 = 1e-3 * (k + 1) / 6.0, lr1 = 2e-3 / (k + 1);  // warmup and decay
    p.cpu.set_lr(0, lr0), p.dev.set_lr(0, lr0);
    p.cpu.set_lr(1, lr1), p.dev.set_lr(1, lr1);
    draw_step_compare(model, rng, p, 0.5, k % 2 ? 1.0 : 512.0, "step " + std::to_string(k + 1));
  }
}

// NAdam with beta1 and momentum_decay changed between steps (OneCycleLR's cycle_momentum):
// the rules' carried product offset (sf_scalar_rule.d) reaches the device's scalar stage,
// on scaled and plain steps, bitwise the CPU's.
TEST_F(EmulatedStep, NadamUnderABeta1ScheduleMatchesTheCpu) {
  Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
  Pair p(model, OptimizerConfig{optim::NAdam{.lr = 1e-2}}, {.max_grad_norm = 1.0}, seed | 1);
  for (int k = 0; k < 6; ++k) {
    const OptimizerConfig c = optim::NAdam{.lr = 1e-2, .beta1 = 0.85 + 0.02 * (k % 4), .momentum_decay = 4e-3 * (k + 1)};
    p.cpu.set_config(0, c);
    p.dev.set_config(0, c, p.cpu.nadam_mu_product_offset(0));
    if (k > 0) {
      EXPECT_NE(p.cpu.nadam_mu_product_offset(0), 0.0);
    }
    draw_step_compare(model, rng, p, 0.5, k % 2 ? 1.0 : 512.0, "step " + std::to_string(k + 1));
  }
}

// ---- loss scales, clipping, norms ----

const OptimizerConfig kAdamW = optim::AdamW{.lr = 1e-3, .weight_decay = 0.1};

// Clipping on scaled and plain steps (a plain step with clipping reduces and
// checks), a loss scale that is not an fp32 value, and clipping that does not clip.
TEST_F(EmulatedStep, ClippingAndLossScales) {
  Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
  Pair clipped(model, kAdamW, {.max_grad_norm = 0.5});  // |g| ~ 0.02 * sqrt(70 K): every step clips
  const double scales[] = {1024.0, 1.0, 65536.0, 1.0, 1000.1};
  for (int k = 0; k < 5; ++k) {
    // (f16 gradients stay finite)
    draw_step_compare(model, rng, clipped, 0.02, scales[k], "clipped step " + std::to_string(k + 1));
    EXPECT_TRUE(clipped.dev.step_state().applied);
    EXPECT_LT(clipped.dev.step_state().clip_coef, 1.0);
  }
  Pair loose(model, kAdamW, {.max_grad_norm = 1e9});
  for (int k = 0; k < 3; ++k) {
    model.draw_grads(rng, 256.0f);
    loose.step_scaled(512.0);
    loose.expect_same("unclipped step " + std::to_string(k + 1));
    EXPECT_EQ(loose.dev.step_state().clip_coef, 1.0);
  }
}

TEST_F(EmulatedStep, InfNormWithClipping) {
  Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
  Pair p(model, kAdamW, {.max_grad_norm = 0.75, .norm_type = INFINITY}, seed | 1);
  EXPECT_EQ(p.dev.spec_name(), "adam_inf");
  const double scales[] = {2048.0, 1.0, 3.0};
  for (int k = 0; k < 3; ++k) {
    draw_step_compare(model, rng, p, 0.5, scales[k], "step " + std::to_string(k + 1));
    EXPECT_LT(p.dev.step_state().clip_coef, 1.0);
  }
}

// track_grad_norm: a plain step that reduces but does not check; non-finite
// gradients are then applied (as PyTorch's plain step applies them).
TEST_F(EmulatedStep, TrackGradNormOnPlainSteps) {
  Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
  OptimizerOptions options;
  options.track_grad_norm = true;
  Pair p(model, optim::SGD{.lr = 0.01, .momentum = 0.9}, options);
  for (int k = 0; k < 3; ++k) {
    model.draw_grads(rng, 1.0f);
    p.step();
    p.expect_same("step " + std::to_string(k + 1));
    EXPECT_TRUE(std::isfinite(p.dev.step_state().grad_norm));
  }
  model.set_grad(5, 39999, INFINITY);
  p.step();
  p.expect_same("a plain step with an inf gradient");
  EXPECT_TRUE(p.dev.step_state().applied && p.dev.step_state().found_inf);
  EXPECT_EQ(p.dev.step_count(), 4);
}

// plain = 1: one kernel; its last block counts the step.
TEST_F(EmulatedStep, PlainStepsCountOnTheDevice) {
  Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
  Pair p(model, optim::Adam{.lr = 1e-3}, {}, seed | 1);
  for (int k = 1; k <= 4; ++k) {
    model.draw_grads(rng, 1.0f);
    p.step();
    p.expect_same("plain step " + std::to_string(k));
    EXPECT_EQ(p.dev.step_count(), k);
    EXPECT_TRUE(std::isnan(p.dev.step_state().grad_norm));
    EXPECT_EQ(p.dev.step_state().update_blocks_done, 0u);
  }
}

// Only empty tensors: no chunks, one idle update block, which still counts the step.
TEST_F(EmulatedStep, EmptyTensorsOnly) {
  std::mt19937 rng(1);
  Model model(shapes_for({0, 0, 0, 0, 0}, sf_emu::kMixedMasters), false, 0, rng);
  Pair p(model, kAdamW, {});
  p.step();
  p.step_scaled(8.0);
  p.expect_same("two steps");
  EXPECT_EQ(p.dev.step_count(), 2);
}

// Sums of very different sizes, so that another combination order (of the chunks
// of a tensor, or of the tensors, in fp64) gives another norm: 2^54 + 1.81 rounds
// to 2^54 each time, but 2^54 + 4 * 1.81 to 2^54 + 8, whose square root is not 2^27.
TEST_F(EmulatedStep, ReductionCombinesInTheCanonicalOrder) {
  std::mt19937 rng(1);
  Model model(shapes_for({4 * 16384 + 5, 3000, 2000, 1000, 7}, sf_emu::kMixedMasters), false, 0, rng);
  for (std::size_t t = 0; t < model.size(); ++t)
    for (std::int64_t i = 0; i < model.shape(t).numel; ++i) model.set_grad(t, i, 0.0f);
  const auto small = [&](std::size_t t, std::int64_t at) {  // a sum of squares of 1.81
    model.set_grad(t, at, 1.0f);
    model.set_grad(t, at + 1, 0.9f);
  };
  model.set_grad(0, 5, 0x1p27f);  // tensor 0, chunk 0: 2^54
  for (std::int64_t c = 1; c <= 4; ++c) small(0, c * 16384 + 1);  // its chunks 1..4
  for (std::size_t t = 1; t <= 4; ++t) small(t, model.shape(t).numel - 2);  // tensors 1..4
  for (const std::uint32_t order : {0u, 7u}) {
    Pair p(model, kAdamW, {.max_grad_norm = 1.0}, order);
    p.step_scaled(1.0);
    p.expect_same(order ? "blocks in a shuffled order" : "blocks in order");
    EXPECT_EQ(p.dev.step_state().grad_norm, 0x1p27);
  }
}

// The finalize adds each tensor's partials in chains of SF_FIN_WINDOW (64) per round
// (jit/cuda/emit_cuda.cpp): tensors of 66 chunks span two rounds, small and empty
// tensors sit at the cuts between chains and at the end. Tensors 0 and 6 hold 2^54
// in their first chunk, then sums of 1.81 (one rounding away each) at round edges:
// a chain that dropped its sum at a round, or added out of order, changes a norm.
TEST_F(EmulatedStep, FinalizeChainsAcrossRounds) {
  const std::int64_t k = 16384;
  Model model(shapes_for({65 * k + 3, 1, 0, 5 * k, 0, 3, 65 * k + 1, 0}, sf_emu::kMixedMasters), false, 0, rng);
  const auto small = [&](std::size_t t, std::int64_t at) {  // a sum of squares of 1.81
    model.set_grad(t, at, 1.0f);
    model.set_grad(t, at + 1, 0.9f);
  };
  for (std::size_t t = 0; t < model.size(); ++t)
    for (std::int64_t i = 0; i < model.shape(t).numel; ++i) model.set_grad(t, i, 0.0f);
  model.set_grad(0, 7, 0x1p27f);  // tensor 0 (f32 grads), chunk 0
  model.set_grad(6, 0, 0x1p27f);  // tensor 6 (bf16 grads), chunk 0
  for (const std::int64_t c : {63, 64, 65}) small(0, c * k + 1);
  small(3, 4 * k);
  for (const std::int64_t c : {1, 63, 64, 65}) small(6, c * k);
  Pair p(model, kAdamW, {.max_grad_norm = 1.0}, 11);
  p.step_scaled(1.0);
  p.expect_same("order-sensitive sums");
  std::vector<double> norms;
  p.dev.result(&norms);
  EXPECT_EQ(norms[0], 0x1p27);
  EXPECT_EQ(norms[6], 0x1p27);
  EXPECT_EQ(p.dev.step_state().grad_norm, std::sqrt(0x1p55));  // 2^54 + 1.81 + 2^54, in order
  model.draw_grads(rng, 0.01f);  // random sums: every tensor's norm bitwise
  p.step_scaled(4.0);
  p.expect_same("random gradients");
}

// The reduce reads 16-byte-aligned gradients with vector loads and others one by one
// (the layout's aligned16 asks only 8 bytes of f16/bf16): shift 4 puts every
// 16-bit gradient 8 bytes off (scalar reads) and keeps f32 gradients aligned (vector
// reads), in the same spec as shift 0 (vector reads throughout). Sizes with tails
// after the vector steps (1024 elements of 16 bits, 512 of f32), inf/NaN in both.
TEST_F(EmulatedStep, ReduceVectorAndScalarReads) {
  const std::vector<std::int64_t> sizes = {1023, 1024, 1025, 16384 + 1000, 513, 511, 3000, 40000, 2047, 7};
  for (const int shift : {0, 4}) {
    SCOPED_TRACE("shift " + std::to_string(shift));
    Model model(shapes_for(sizes, sf_emu::kMixedMasters), false, shift, rng);
    for (const bool inf_norm : {false, true}) {
      Pair p(model, kAdamW, {.max_grad_norm = 3.0, .norm_type = inf_norm ? INFINITY : 2.0}, seed | 1);
      EXPECT_EQ(p.dev.spec_name(), inf_norm ? "adam_inf" : "adam");
      for (int step = 0; step < 2; ++step) {
        model.draw_grads(rng, 0.5f);
        p.step_scaled(16.0);
        p.expect_same("step " + std::to_string(step + 1));
      }
      const struct {
        std::size_t tensor;
        std::int64_t index;
        float value;
      } bad[] = {{1, 1000, NAN}, {7, 32768 + 5, INFINITY}, {3, 16384 + 999, -INFINITY}, {4, 300, NAN}};
      for (const auto& b : bad) {  // bf16 (vector), f32 (vector), bf16 (tail), f32 (tail after a vector step)
        SCOPED_TRACE("grad " + std::to_string(b.index) + " of tensor " + std::to_string(b.tensor) + " is " +
                     std::to_string(b.value) + (inf_norm ? ", inf-norm" : ", L2 norm"));
        model.draw_grads(rng, 0.5f);
        model.set_grad(b.tensor, b.index, b.value);
        p.step_scaled(16.0);
        p.expect_same("a skipped step");
        EXPECT_TRUE(p.dev.step_state().found_inf);
      }
    }
  }
}

// ---- non-finite gradients ----

TEST_F(EmulatedStep, NonFiniteGradientsSkipThenContinue) {
  Model model(shapes_for(kSizes, sf_emu::kMixedMasters), false, 0, rng);
  for (const bool clip : {false, true}) {
    SCOPED_TRACE(clip ? "with clipping" : "without clipping");
    Pair p(model, optim::Adam{.lr = 1e-3, .amsgrad = true}, {.max_grad_norm = clip ? std::optional(1.0) : std::nullopt}, seed | 1);
    model.draw_grads(rng, 64.0f);
    p.step_scaled(128.0);
    p.expect_same("a finite step");
    const struct {
      std::size_t tensor;
      std::int64_t index;
      float value;
    } bad[] = {{5, 39999, INFINITY}, {3, 0, NAN}, {1, 4096, -INFINITY}, {0, 0, NAN}};
    for (const auto& b : bad) {  // f32, f32, bf16 and f32 gradients: the last chunk, a first element, a block edge
      model.draw_grads(rng, 64.0f);
      model.set_grad(b.tensor, b.index, b.value);
      p.step_scaled(128.0);
      p.expect_same("a skipped step: " + std::to_string(b.value) + " in tensor " + std::to_string(b.tensor));
      EXPECT_FALSE(p.dev.step_state().applied);
      EXPECT_TRUE(p.dev.step_state().found_inf);
      EXPECT_EQ(p.dev.step_state().grad_norm, INFINITY);
      EXPECT_EQ(p.dev.step_count(), 1);
    }
    if (clip) {  // a plain step with clipping checks too
      model.set_grad(7, 4, NAN);
      p.step();
      p.expect_same("a skipped plain step with clipping");
      EXPECT_EQ(p.dev.step_count(), 1);
    }
    model.draw_grads(rng, 64.0f);
    p.step_scaled(128.0);
    p.expect_same("the next finite step");
    EXPECT_EQ(p.dev.step_count(), 2);
  }
}

// Finite gradients whose fp32 squares overflow (|g| ~ 1e20: a huge loss scale with
// f32 or bf16 gradients): the chunk is summed again, scaled by a power of two.
TEST_F(EmulatedStep, HugeGradientsUseTheRescaledSum) {
  // No f16 gradients (they cannot hold 1e20): the f16 combination's tensor is empty.
  Model model(shapes_for({1000, 20000, 0, 4097, 3, 17000, 5}, sf_emu::kMixedMasters), false, 0, rng);
  const double scale = std::ldexp(1.0, 70);
  for (const bool inf_norm : {false, true}) {
    Pair p(model, kAdamW, {.max_grad_norm = 2.0, .norm_type = inf_norm ? INFINITY : 2.0});
    for (int k = 0; k < 3; ++k) {
      model.draw_grads(rng, 1e20f);
      model.set_grad(1, 3, 3e38f);  // one square far beyond fp32, others near its edge
      model.set_grad(6, 0, 1.0f);
      p.step_scaled(scale);
      p.expect_same(std::string(inf_norm ? "inf-norm" : "L2") + " step " + std::to_string(k + 1));
      EXPECT_TRUE(p.dev.step_state().applied);
      EXPECT_TRUE(std::isfinite(p.dev.step_state().grad_norm));
    }
  }
}

// ---- layouts ----

// One buffer for all weights, one for all grads, one combination; sizes that keep
// every tensor 8-byte aligned, and an empty tensor in the middle.
TEST_F(EmulatedStep, FlatLayout) {
  Model model(shapes_for({4096, 16388, 0, 40000, 4, 12}, sf_emu::kBf16Masters), true, 0, rng);
  Pair p(model, kAdamW, {.max_grad_norm = 10.0}, seed | 1);
  EXPECT_EQ(p.dev.spec_name(), "adam_flat");
  const double scales[] = {1024.0, 1.0, 100.0};
  for (int k = 0; k < 3; ++k) {
    draw_step_compare(model, rng, p, 0.05, scales[k], "step " + std::to_string(k + 1));
  }
  OptimizerOptions options;
  options.norm_type = INFINITY;
  options.track_grad_norm = true;
  Pair lion(model, optim::Lion{.lr = 1e-3, .weight_decay = 0.1}, options);
  EXPECT_EQ(lion.dev.spec_name(), "lion_flat_inf");
  for (int k = 0; k < 3; ++k) {
    model.draw_grads(rng, 1.0f);
    lion.step();
    lion.expect_same("lion step " + std::to_string(k + 1));
  }
}

// Every buffer one element off its alignment: the scalar paths.
TEST_F(EmulatedStep, UnalignedPointers) {
  Model flat(shapes_for({4097, 1, 16385, 3}, sf_emu::kF16Masters), true, 1, rng);
  Pair pf(flat, kAdamW, {}, seed | 1);
  EXPECT_EQ(pf.dev.spec_name(), "adam_flat_unaligned");
  Model table(shapes_for(kSizes, sf_emu::kMixedMasters), false, 1, rng);
  Pair pt(table, kAdamW, {.max_grad_norm = 5.0});
  EXPECT_EQ(pt.dev.spec_name(), "adam_unaligned");
  const double scales[] = {256.0, 1.0, 8.0};
  for (int k = 0; k < 3; ++k) {
    flat.draw_grads(rng, static_cast<float>(0.5 * scales[k]));
    table.draw_grads(rng, static_cast<float>(0.5 * scales[k]));
    pf.step_at(scales[k]);
    pt.step_at(scales[k]);
    pf.expect_same("flat step " + std::to_string(k + 1));
    pt.expect_same("table step " + std::to_string(k + 1));
  }
}

TEST_F(EmulatedStep, NoMasters) {
  Model model(shapes_for(kSizes, sf_emu::kMixedNoMasters), false, 0, rng);
  OptimizerOptions options;
  options.master_weights = false;
  Pair p(model, kAdamW, options);
  EXPECT_EQ(p.dev.spec_name(), "adam_no_masters");
  for (int k = 0; k < 3; ++k) {
    model.draw_grads(rng, 0.5f);
    k == 1 ? p.step() : p.step_scaled(1.0);
    p.expect_same("step " + std::to_string(k + 1));
  }
}

// Stochastic rounding of bf16 weights (jit/stochastic_round.h): the table layout aligned
// and not (the 4-element stores and the scalar ones), after a reduce and on plain steps,
// and the flat layout, each element with the bits of its index in the model.
TEST_F(EmulatedStep, StochasticRounding) {
  OptimizerOptions options;
  options.master_weights = false;
  options.stochastic_rounding = true;
  options.seed = 0xC0FFEE;
  Model table(shapes_for(kSizes, sf_emu::kMixedStochastic), false, 0, rng);
  Model unaligned(shapes_for(kSizes, sf_emu::kMixedStochastic), false, 1, rng);
  Model flat(shapes_for({4096, 16388, 0, 40000, 4, 12}, sf_emu::kBf16Stochastic), true, 0, rng);
  Pair pt(table, kAdamW, options), pf(flat, kAdamW, options);
  OptimizerOptions clipped = options;
  clipped.max_grad_norm = 5.0;
  Pair pu(unaligned, kAdamW, clipped);
  EXPECT_EQ(pt.dev.spec_name(), "adam_stochastic");
  EXPECT_EQ(pu.dev.spec_name(), "adam_stochastic_unaligned");
  EXPECT_EQ(pf.dev.spec_name(), "adam_flat_stochastic");
  const double scales[] = {256.0, 1.0, 8.0, 1.0};
  for (int k = 0; k < 4; ++k) {
    for (Model* m : {&table, &unaligned, &flat}) m->draw_grads(rng, static_cast<float>(0.5 * scales[k]));
    for (Pair* p : {&pt, &pu, &pf}) {
      p->step_at(scales[k]);
      p->expect_same("step " + std::to_string(k + 1));
    }
  }
}

// ---- state stored as bf16 or q8 (OptimizerOptions::state_format) ----

// Every snapshot of a packed state: each tensor's streams as stored and their absmaxes.
std::vector<std::vector<std::byte>> packed_snapshot(const Optimizer& cpu) {
  std::vector<std::vector<std::byte>> out;
  for (std::size_t t = 0; t < cpu.num_params(); ++t)
    for (std::string_view name : cpu.state_names()) {
      const std::span<const std::byte> bytes = cpu.state_storage(t, name);
      const std::span<const float> absmax = cpu.state_absmax(t, name);
      out.emplace_back(bytes.begin(), bytes.end());
      const auto* a = reinterpret_cast<const std::byte*>(absmax.data());
      out.back().insert(out.back().end(), a, a + absmax.size_bytes());
    }
  return out;
}

std::vector<ProgramCase> q8_program_cases() {
  std::vector<ProgramCase> out;
  const std::vector<jit::Builtin> q8 = sf_emu::q8_builtins();
  for (const ProgramCase& c : program_cases())
    if (std::find(q8.begin(), q8.end(), jit::select_builtin(c.config)) != q8.end()) out.push_back(c);
  return out;
}
class EveryProgramQ8 : public Seeded, public ::testing::WithParamInterface<ProgramCase> {};

// Every one-phase built-in with q8 state: the tensors of at least min_q8_numel (4096)
// elements keep their state as 8-bit codes and block absmaxes (the others f32), with
// masters, mixed dtypes, blocks in shuffled order; the first state as encoded at
// construction, and after each step the codes and absmaxes bitwise the CPU's.
TEST_P(EveryProgramQ8, StepsMatchTheCpuBitwise) {
  every_program_steps(GetParam().config, sf_emu::kPackedSizes, sf_emu::state_options(StateFormat::q8),
                      program_name(GetParam().config) + "_q8", rng, seed);
}

INSTANTIATE_TEST_SUITE_P(Emulated, EveryProgramQ8, ::testing::ValuesIn(q8_program_cases()),
                         [](const ::testing::TestParamInfo<ProgramCase>& info) { return std::string(info.param.name); });

// bf16 state (round to nearest even): Adam with clipping, and LAMB, whose two phases
// read and write their state one element a lane.
TEST_F(EmulatedStep, Bf16State) {
  const double scales[] = {512.0, 1.0, 40.0, 1.0};
  {
    Model model(shapes_for(sf_emu::kPackedSizes, sf_emu::kMixedMasters), false, 0, rng);
    OptimizerOptions options = sf_emu::state_options(StateFormat::bf16);
    options.max_grad_norm = 3.0;
    Pair p(model, kAdamW, options, seed | 1);
    EXPECT_EQ(p.dev.spec_name(), "adam_bf16_state");
    p.expect_same("after construction", false);
    for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "adam step " + std::to_string(k + 1));
  }
  {
    Model model(shapes_for(sf_emu::kPackedSizes, sf_emu::kMixedMasters), false, 0, rng);
    Pair p(model, optim::LAMB{.lr = 1e-3, .weight_decay = 0.05}, sf_emu::state_options(StateFormat::bf16), seed | 2);
    EXPECT_EQ(p.dev.spec_name(), "lamb_bf16_state");
    for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "lamb step " + std::to_string(k + 1));
  }
}

// bf16 state beside bf16 weights rounded stochastically rounds stochastically too
// (jit/stochastic_round.h, sf_sr_state_step): every store of it, the 4-element and the
// one-element ones and LAMB's phase 1, bitwise the CPU's; with clipping and changing scales.
TEST_F(EmulatedStep, Bf16StateWithStochasticRounding) {
  OptimizerOptions options = sf_emu::state_options(StateFormat::bf16);
  options.master_weights = false;
  options.stochastic_rounding = true;
  options.seed = 0x5EED0000ABCDull;
  options.max_grad_norm = 2.0;
  const double scales[] = {1024.0, 1.0, 77.0, 1.0};
  for (const int misalign : {0, 1}) {
    Model model(shapes_for(sf_emu::kPackedSizes, sf_emu::kMixedStochastic), false, misalign, rng);
    Pair p(model, kAdamW, options, seed | 1);
    EXPECT_EQ(p.dev.spec_name(), misalign ? "adam_bf16_state_stochastic_unaligned" : "adam_bf16_state_stochastic");
    for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "adam step " + std::to_string(k + 1));
  }
  Model model(shapes_for(sf_emu::kPackedSizes, sf_emu::kMixedStochastic), false, 0, rng);
  Pair p(model, optim::LAMB{.lr = 1e-3, .weight_decay = 0.05}, options, seed | 2);
  EXPECT_EQ(p.dev.spec_name(), "lamb_bf16_state_stochastic");
  for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "lamb step " + std::to_string(k + 1));
  // The same weights with their bf16 state rounded to nearest (stochastic_state_rounding off).
  options.stochastic_state_rounding = false;
  Model nearest(shapes_for(sf_emu::kPackedSizes, sf_emu::kMixedStochastic), false, 0, rng);
  Pair q(nearest, kAdamW, options, seed | 3);
  EXPECT_EQ(q.dev.spec_name(), "adam_bf16_state_nearest_beside_stochastic");
  for (int k = 0; k < 4; ++k) draw_step_compare(nearest, rng, q, 0.5, scales[k], "nearest-state step " + std::to_string(k + 1));
}

// LAMB with q8 state: its phase 1 decodes and requantizes the moments a strided block at a
// time, phase 2 decodes them again; with clipping and changing loss scales.
TEST_F(EmulatedStep, Q8StateTwoPhases) {
  OptimizerOptions options = sf_emu::state_options(StateFormat::q8);
  options.max_grad_norm = 2.0;
  Model model(shapes_for(sf_emu::kPackedSizes, sf_emu::kMixedMasters), false, 0, rng);
  Pair p(model, optim::LAMB{.lr = 1e-3, .weight_decay = 0.05}, options, seed | 3);
  EXPECT_EQ(p.dev.spec_name(), "lamb_q8");
  const double scales[] = {512.0, 1.0, 40.0, 1.0};
  for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "lamb step " + std::to_string(k + 1));
}

// The fewest bytes per parameter: bf16 weights rounded stochastically (no masters) with
// q8 state, clipped. A step with an inf gradient is skipped: weights, codes and absmaxes
// bitwise untouched, and the next step goes on as the CPU's.
TEST_F(EmulatedStep, Q8StateWithStochasticRoundingSkipsNonFiniteSteps) {
  OptimizerOptions options = sf_emu::state_options(StateFormat::q8);
  options.max_grad_norm = 1.0;
  options.master_weights = false;
  options.stochastic_rounding = true;
  options.seed = 0xBEEF;
  Model model(shapes_for(sf_emu::kPackedSizes, sf_emu::kMixedStochastic), false, 0, rng);
  Pair p(model, kAdamW, options, seed | 1);
  EXPECT_EQ(p.dev.spec_name(), "adam_q8_stochastic");
  for (int k = 0; k < 3; ++k) draw_step_compare(model, rng, p, 0.5, 1024.0, "step " + std::to_string(k + 1));
  const std::vector<std::vector<std::byte>> before = packed_snapshot(p.cpu);
  model.draw_grads(rng, 512.0f);
  model.set_grad(5, 39999, -INFINITY);
  p.step_scaled(1024.0);
  p.expect_same("a skipped step");
  EXPECT_FALSE(p.dev.step_state().applied);
  EXPECT_TRUE(packed_snapshot(p.cpu) == before) << "a skipped step changed the compressed state";
  draw_step_compare(model, rng, p, 0.5, 1024.0, "the step after");
  EXPECT_EQ(p.dev.step_count(), 4);
}

// Unaligned weights and gradients (every access one element; the codes' 8-byte stores
// still whole), and a plain step.
TEST_F(EmulatedStep, Q8StateUnaligned) {
  Model model(shapes_for(sf_emu::kPackedSizes, sf_emu::kMixedMasters), false, 1, rng);
  Pair p(model, kAdamW, sf_emu::state_options(StateFormat::q8), seed | 1);
  EXPECT_EQ(p.dev.spec_name(), "adam_q8_unaligned");
  const double scales[] = {64.0, 1.0, 2.0};
  for (int k = 0; k < 3; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "step " + std::to_string(k + 1));
}

// Formats per stream (OptimizerOptions::state_formats: the second moment bf16, the first
// q8), and param groups running different variants of Adam (amsgrad's third stream q8 too).
TEST_F(EmulatedStep, Q8StatePerStreamFormatsAndGroups) {
  const double scales[] = {1024.0, 1.0, 3000.5, 1.0};
  {
    Model model(shapes_for(sf_emu::kPackedSizes, sf_emu::kMixedMasters), false, 0, rng);
    OptimizerOptions options = sf_emu::state_options(StateFormat::q8, {{"exp_avg_sq", StateFormat::bf16}});
    options.max_grad_norm = 2.0;
    Pair p(model, kAdamW, options, seed | 1);
    EXPECT_EQ(p.dev.spec_name(), "adam_q8_bf16_second_moment");
    for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "step " + std::to_string(k + 1));
  }
  {
    Model model(shapes_for(sf_emu::kPackedSizes, sf_emu::kMixedMasters), false, 0, rng);
    Pair p(model,
           {optim::Adam{.lr = 1e-3}, optim::Adam{.lr = 2e-3, .weight_decay = 0.01, .amsgrad = true},
            optim::Adam{.lr = 5e-4, .beta1 = 0.8}},
           {4, 4, 4}, sf_emu::state_options(StateFormat::q8), seed | 2);
    EXPECT_EQ(p.dev.spec_name(), "adam_groups_q8");
    for (int k = 0; k < 4; ++k) draw_step_compare(model, rng, p, 0.5, scales[k], "groups step " + std::to_string(k + 1));
  }
}

// Compensated bf16 weights (the master buffer holds bf16 compensations): the table
// layout aligned and not (the 4-element loads and stores and the scalar ones), after a
// reduce and on plain steps, the flat layout, and LAMB's two phases (which read the
// parameter in phase 1).
TEST_F(EmulatedStep, CompensatedWeights) {
  OptimizerOptions options;
  options.master_weights = false;
  options.compensated_weights = true;
  Model table(shapes_for(kSizes, sf_emu::kMixedCompensated), false, 0, rng);
  Model unaligned(shapes_for(kSizes, sf_emu::kMixedCompensated), false, 1, rng);
  Model flat(shapes_for({4096, 16388, 0, 40000, 4, 12}, sf_emu::kBf16Compensated), true, 0, rng);
  Model lamb(shapes_for(kSizes, sf_emu::kMixedCompensated), false, 1, rng);
  Pair pt(table, kAdamW, options), pf(flat, kAdamW, options), pl(lamb, OptimizerConfig{optim::LAMB{.lr = 1e-3, .weight_decay = 0.1}}, options);
  OptimizerOptions clipped = options;
  clipped.max_grad_norm = 5.0;
  Pair pu(unaligned, kAdamW, clipped);
  EXPECT_EQ(pt.dev.spec_name(), "adam_compensated");
  EXPECT_EQ(pu.dev.spec_name(), "adam_compensated_unaligned");
  EXPECT_EQ(pf.dev.spec_name(), "adam_flat_compensated");
  EXPECT_EQ(pl.dev.spec_name(), "lamb_compensated_unaligned");
  const double scales[] = {256.0, 1.0, 8.0, 1.0};
  for (int k = 0; k < 4; ++k) {
    for (Model* m : {&table, &unaligned, &flat, &lamb}) m->draw_grads(rng, static_cast<float>(0.5 * scales[k]));
    for (Pair* p : {&pt, &pu, &pf, &pl}) {
      p->step_at(scales[k]);
      p->expect_same("step " + std::to_string(k + 1));
    }
  }
}

// ---- the sharded step (OptimizerOptions::communicator, jit/cuda/kernels/shard_kernel.cuh) ----

// Rank r's params: pieces of the model's tensors (whole, or a slice on a chunk boundary).
struct Piece {
  std::size_t tensor;
  std::int64_t offset, numel;
};
using Partition = std::vector<std::vector<Piece>>;

// f32 tensors and bf16 ones with masters, alternating (kShardCombos): several chunks in
// the large ones, odd sizes, an empty one.
const std::vector<std::int64_t> kShardSizes = {40000, 33, 16385, 4097, 70000, 5, 0, 17};

Partition whole_tensors(const std::vector<std::vector<std::size_t>>& ranks) {
  Partition out;
  for (const auto& tensors : ranks) {
    out.emplace_back();
    for (const std::size_t t : tensors) out.back().push_back({t, 0, kShardSizes[t]});
  }
  return out;
}

// 1, 2 and 3 ranks, tensors 0 and 4 split across ranks (each rank's list starts with an
// f32 tensor and holds a bf16 one: every rank's spec is the same).
std::vector<Partition> split_partitions() {
  constexpr std::int64_t A = kShardAlign;
  return {
      whole_tensors({{0, 1, 2, 3, 4, 5, 6, 7}}),
      {{{0, 0, A}, {1, 0, 33}, {2, 0, 16385}, {3, 0, 4097}}, {{0, A, 40000 - A}, {4, 0, 70000}, {5, 0, 5}, {6, 0, 0}, {7, 0, 17}}},
      {{{0, 0, 2 * A}, {1, 0, 33}, {4, 0, A}},
       {{0, 2 * A, 40000 - 2 * A}, {2, 0, 16385}, {3, 0, 4097}, {4, A, 2 * A}},
       {{4, 3 * A, 70000 - 3 * A}, {5, 0, 5}, {6, 0, 0}, {7, 0, 17}}},
  };
}

// One CPU optimizer over the whole model against one emulated sharded CUDA optimizer
// per rank (each on its own thread, with an in-process communicator), over the same
// model: every rank's slices of the weights, state and masters, and every rank's
// result, must be the one process's, bit for bit.
class ShardedRun {
 public:
  ShardedRun(Model& model, const OptimizerConfig& config, const OptimizerOptions& options, Partition partition,
             std::uint32_t order_seed)
      : model_(model), partition_(std::move(partition)), group_(static_cast<int>(partition_.size())),
        cpu_(config, model.params(false), Pair::cpu_options(options)), dev_(partition_.size()) {
    all([&](std::size_t r, const std::shared_ptr<Communicator>& comm) {
      OptimizerOptions o = options;
      o.communicator = comm;
      std::vector<Param> params;
      for (const Piece& p : partition_[r]) {
        const TensorShape& s = model_.shape(p.tensor);
        std::byte* w = static_cast<std::byte*>(model_.weight(true, p.tensor)) + p.offset * std::int64_t(dtype_size(s.weight));
        std::byte* g = static_cast<std::byte*>(model_.grad(p.tensor)) + p.offset * std::int64_t(dtype_size(s.grad));
        params.push_back({{w, p.numel, s.weight}, {g, p.numel, s.grad}});
        o.slices.push_back({static_cast<std::int64_t>(p.tensor), p.offset});
      }
      dev_[r] = std::make_unique<EmulatedOptimizer>(config, std::move(params), o, order_seed + static_cast<std::uint32_t>(r));
    });
  }

  std::size_t ranks() const { return dev_.size(); }
  EmulatedOptimizer& dev(std::size_t r) { return *dev_[r]; }
  Optimizer& cpu() { return cpu_; }

  // For each scale: grads drawn at half of it, a step at it (step_at), then expect_same.
  void steps_at(std::mt19937& rng, std::initializer_list<double> scales) {
    int k = 0;
    for (const double s : scales) {
      model_.draw_grads(rng, static_cast<float>(0.5 * s));
      step_at(s);
      expect_same("step " + std::to_string(++k));
    }
  }
  // A plain step for scale 1, else a scaled one, on the CPU and on every rank.
  void step_at(double s) {
    if (s == 1.0)
      cpu_.step();
    else
      cpu_.step_scaled(s);
    all([&](std::size_t r, const std::shared_ptr<Communicator>&) { dev_[r]->step(s, s != 1.0); });
  }
  // Every rank steps at scale s, but rank `refuser` refuses its step (StepEngine's bad loss scale).
  void step_refused_by(std::size_t refuser, double s) {
    all([&](std::size_t r, const std::shared_ptr<Communicator>&) {
      if (r == refuser)
        dev_[r]->refuse_step();
      else
        dev_[r]->step(s, true);
    });
  }

  void expect_same(const std::string& when) const {
    SCOPED_TRACE(when);
    const StepResult c = cpu_.last_result();
    const std::vector<double>& cpu_norms = cpu_.last_tensor_grad_norms();
    for (std::size_t r = 0; r < ranks(); ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(ranks()));
      const EmulatedOptimizer& d = *dev_[r];
      EXPECT_EQ(cpu_.step_count(), d.step_count());
      std::vector<double> norms;
      const StepResult g = d.result(&norms);
      EXPECT_EQ(c.applied, g.applied);
      EXPECT_EQ(c.found_inf, g.found_inf);
      EXPECT_TRUE(same(c.grad_norm, g.grad_norm)) << "grad_norm: one process " << c.grad_norm << ", rank " << g.grad_norm;
      EXPECT_TRUE(same(c.clip_coef, g.clip_coef)) << "clip_coef: one process " << c.clip_coef << ", rank " << g.clip_coef;
      for (std::size_t i = 0; i < partition_[r].size(); ++i) {
        const Piece& p = partition_[r][i];
        EXPECT_TRUE(same(cpu_norms[p.tensor], norms[i])) << "param " << i << " (tensor " << p.tensor << ") norm";
        const std::string name = "param " + std::to_string(i) + " (tensor " + std::to_string(p.tensor) + " at " +
                                 std::to_string(p.offset) + ")";
        for (std::string_view state : cpu_.state_names()) {
          const StateFormat format = cpu_.state_format(p.tensor, state);
          EXPECT_EQ(format, d.state_format(i, state)) << name << " " << state;
          if (format != StateFormat::f32) {  // the slice of the stored bytes, and of the absmaxes (slices start on blocks)
            const std::size_t size = state_format_size(format);
            const std::span<const std::byte> cb = cpu_.state_storage(p.tensor, state);
            EXPECT_EQ(0, std::memcmp(cb.data() + static_cast<std::size_t>(p.offset) * size, d.state_storage(i, state),
                                     static_cast<std::size_t>(p.numel) * size))
                << name << " " << state << " as stored";
            if (format == StateFormat::q8)
              expect_same_values(jit::q8_blocks(p.numel), [&](std::int64_t k) {
                return std::pair{cpu_.state_absmax(p.tensor, state)[static_cast<std::size_t>(p.offset / SF_Q8_BLOCK + k)],
                                 d.state_absmax(i, state)[k]};
              }, name + " " + std::string(state) + " absmax");
            continue;
          }
          const std::span<const float> cs = cpu_.state(p.tensor, state);
          const float* ds = d.state(i, state);
          expect_same_values(p.numel, [&](std::int64_t k) {
            return std::pair{cs[static_cast<std::size_t>(p.offset + k)], ds[k]};
          }, name + " " + std::string(state));
        }
        const std::span<const float> cm = cpu_.master(p.tensor);
        const float* dm = d.master(i);
        if (!cm.empty() && dm != nullptr)
          expect_same_values(p.numel, [&](std::int64_t k) { return std::pair{cm[static_cast<std::size_t>(p.offset + k)], dm[k]}; },
                             name + " master");
        const std::span<const std::uint16_t> cc = cpu_.compensation(p.tensor);
        const std::uint16_t* dc = d.compensation(i);
        if (!cc.empty() && dc != nullptr)
          expect_same_values(p.numel, [&](std::int64_t k) {
            return std::pair{load(DType::bf16, cc.data(), p.offset + k), load(DType::bf16, dc, k)};
          }, name + " compensation");
      }
      d.expect_slack_untouched();
    }
    model_.expect_nothing_written_outside();
    for (std::size_t t = 0; t < model_.size(); ++t) {
      const TensorShape& s = model_.shape(t);
      expect_same_values(s.numel, [&](std::int64_t i) {
        return std::pair{load(s.weight, model_.weight(false, t), i), load(s.weight, model_.weight(true, t), i)};
      }, "tensor " + std::to_string(t) + " weights");
    }
  }

 private:
  // fn(rank, communicator) on every rank's thread; a rank's exception fails the test.
  void all(const std::function<void(std::size_t, const std::shared_ptr<Communicator>&)>& fn) {
    const std::vector<std::exception_ptr> errors =
        group_.run([&](int r, const std::shared_ptr<Communicator>& comm) { fn(static_cast<std::size_t>(r), comm); });
    for (std::size_t r = 0; r < errors.size(); ++r)
      if (errors[r]) {
        try {
          std::rethrow_exception(errors[r]);
        } catch (const std::exception& e) {
          ADD_FAILURE() << "rank " << r << ": " << e.what();
        }
      }
  }

  Model& model_;
  Partition partition_;
  testing::LocalGroup group_;
  Optimizer cpu_;
  std::vector<std::unique_ptr<EmulatedOptimizer>> dev_;
};

class EmulatedSharded : public Seeded {};

// AdamW with L2 clipping on 1, 2 and 3 ranks, tensors split across ranks: scaled and
// plain steps, then an inf on the last rank only (every rank skips), then on.
TEST_F(EmulatedSharded, EveryRankStepsAsOneProcessBitwise) {
  for (const Partition& partition : split_partitions()) {
    SCOPED_TRACE(std::to_string(partition.size()) + " ranks");
    Model model(shapes_for(kShardSizes, sf_emu::kShardCombos), false, 0, rng);
    ShardedRun run(model, optim::AdamW{.lr = 1e-3, .weight_decay = 0.01}, {.max_grad_norm = 1.0}, partition, seed | 1);
    for (std::size_t r = 0; r < run.ranks(); ++r) EXPECT_EQ(run.dev(r).spec_name(), "adam_sharded");
    run.steps_at(rng, {1024.0, 1.0, 3000.5, 0.25});
    model.draw_grads(rng, 512.0f);
    model.set_grad(7, 3, INFINITY);  // the last rank's tensor
    run.step_at(1024.0);
    run.expect_same("an inf on one rank");
    EXPECT_FALSE(run.dev(0).step_state().applied);
    model.draw_grads(rng, 512.0f);
    run.step_at(1024.0);
    run.expect_same("after the skip");
    EXPECT_EQ(run.dev(0).step_count(), 5);
  }
}

// Stochastic rounding keys each element by its index in the whole model: every rank's
// bf16 weights are the one process's bitwise, split tensors included.
TEST_F(EmulatedSharded, StochasticRoundingCountsElementsInTheWholeModel) {
  Model model(shapes_for(kShardSizes, sf_emu::kShardStochastic), false, 0, rng);
  OptimizerOptions options;
  options.max_grad_norm = 1.0;
  options.master_weights = false;
  options.stochastic_rounding = true;
  options.seed = 99;
  ShardedRun run(model, optim::AdamW{.lr = 1e-3}, options, split_partitions()[2], seed | 1);
  for (std::size_t r = 0; r < run.ranks(); ++r) EXPECT_EQ(run.dev(r).spec_name(), "adam_sharded_stochastic");
  run.steps_at(rng, {1024.0, 1.0, 3000.5});
}

// q8 state on every rank (min_q8_numel = 0: every tensor and every slice), split tensors
// included: each rank's codes and absmaxes are the one process's slice of them, bitwise.
TEST_F(EmulatedSharded, Q8StateIsTheOneProcessesSlice) {
  Model model(shapes_for(kShardSizes, sf_emu::kShardCombos), false, 0, rng);
  OptimizerOptions options = sf_emu::state_options(StateFormat::q8);
  options.min_q8_numel = 0;
  options.max_grad_norm = 1.0;
  ShardedRun run(model, optim::AdamW{.lr = 1e-3, .weight_decay = 0.01}, options, split_partitions()[2], seed | 1);
  for (std::size_t r = 0; r < run.ranks(); ++r) EXPECT_EQ(run.dev(r).spec_name(), "adam_sharded_q8");
  run.steps_at(rng, {1024.0, 1.0, 3000.5});
}

// The inf-norm, clipping, on 3 ranks with split tensors.
TEST_F(EmulatedSharded, InfNormClipping) {
  Model model(shapes_for(kShardSizes, sf_emu::kShardCombos), false, 0, rng);
  ShardedRun run(model, optim::Adam{.lr = 1e-3}, {.max_grad_norm = 0.75, .norm_type = INFINITY}, split_partitions()[2],
                 seed | 1);
  EXPECT_EQ(run.dev(2).spec_name(), "adam_inf_sharded");
  run.steps_at(rng, {2048.0, 1.0, 3.0});
}

// A split tensor whose chunks' sums differ by 16 orders of magnitude: adding its small
// chunks in any order but the model's (chunk 0 first, then 1, 2, 3, 4, wherever they
// live) gives other bits, so this fails if a rank's values are combined out of order.
TEST_F(EmulatedSharded, ASplitTensorsChunksAreCombinedInTheModelsOrder) {
  Model model(shapes_for(kShardSizes, sf_emu::kShardCombos), false, 0, rng);
  ASSERT_EQ(model.shape(4).grad, DType::f32);
  ShardedRun run(model, optim::Adam{.lr = 1e-3}, {.max_grad_norm = 1.0}, split_partitions()[2], seed | 1);
  for (int k = 0; k < 3; ++k) {
    model.draw_grads(rng, 1.0f);
    auto* g = static_cast<float*>(model.grad(4));  // 70000 elements: chunk 0 on rank 0, 1-2 on rank 1, 3-4 on rank 2
    for (std::int64_t i = 0; i < kShardSizes[4]; ++i) g[i] *= i < kShardAlign ? 1e4f : 1e-4f * static_cast<float>(k + 1);
    run.step_at(1.0);
    run.expect_same("step " + std::to_string(k + 1));
  }
}

// LAMB (two phases: each tensor's trust ratio inside the update) over whole tensors.
TEST_F(EmulatedSharded, TwoPhaseProgramOverWholeTensors) {
  Model model(shapes_for(kShardSizes, sf_emu::kShardCombos), false, 0, rng);
  ShardedRun run(model, optim::LAMB{.lr = 1e-3, .weight_decay = 0.1}, {.max_grad_norm = 5.0},
                 whole_tensors({{0, 1}, {2, 3}, {4, 5, 6, 7}}), seed | 1);
  EXPECT_EQ(run.dev(1).spec_name(), "lamb_sharded");
  run.steps_at(rng, {1024.0, 1.0, 3000.5});
}

// A rank that refuses its step (a bad loss scale): the others apply nothing, and their
// result raises the Error naming that rank; the next step goes on as one process's.
TEST_F(EmulatedSharded, ARefusedStepAppliesNothing) {
  Model model(shapes_for(kShardSizes, sf_emu::kShardCombos), false, 0, rng);
  ShardedRun run(model, optim::AdamW{.lr = 1e-3}, {.max_grad_norm = 1.0}, split_partitions()[2], seed | 1);
  model.draw_grads(rng, 512.0f);
  run.step_at(1024.0);
  run.expect_same("step 1");
  model.draw_grads(rng, 512.0f);
  run.step_refused_by(1, 1024.0);
  for (const std::size_t r : {0u, 2u}) {
    EXPECT_EQ(run.dev(r).refused_rank(), 1);
    EXPECT_FALSE(run.dev(r).step_state().applied);
    EXPECT_EQ(run.dev(r).step_count(), 1);
    std::vector<double> norms;
    try {
      static_cast<void>(run.dev(r).result(&norms));
      ADD_FAILURE() << "rank " << r << ": no Error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("rank 1 refused its input"), std::string::npos) << e.what();
    }
  }
  // Nothing was written: the weights are still the one process's after one step.
  for (std::size_t t = 0; t < model.size(); ++t) {
    const TensorShape& s = model.shape(t);
    expect_same_values(s.numel, [&](std::int64_t i) {
      return std::pair{load(s.weight, model.weight(false, t), i), load(s.weight, model.weight(true, t), i)};
    }, "tensor " + std::to_string(t) + " weights after the refused step");
  }
  run.step_at(1024.0);
  run.expect_same("the step after");
}

// ---- the GradScaler on the device ----

// Device steps reading the scale from an sf_scaler_state and recording found_inf
// there, then sf_update_scale, against the CPU GradScaler driven the same way.
// Growth by 2^8 from 2^100 overflows fp32 (and is not kept) after a few growths.
TEST_F(EmulatedGradScaler, MatchesTheCpuGradScaler) {
  // Two reduce blocks: a finalize run by any but the last would record a found_inf.
  Model model(shapes_for({3000, 40000, 0, 4097, 17}, sf_emu::kMixedMasters), false, 0, rng);
  const double init = std::ldexp(1.0, 100), growth = 256.0, backoff = 0.5;
  GradScaler cpu_scaler("cpu", init, growth, backoff, 3);
  Pair p(model, kAdamW, {.max_grad_norm = 1.0}, seed | 1);
  sf_scaler_state dev_scaler{};
  dev_scaler.scale = static_cast<float>(init);
  dev_scaler.growth_factor = growth;
  dev_scaler.backoff_factor = backoff;
  dev_scaler.growth_interval = 3;
  const char* pattern = "ffffffiffffffnfff";  // f: finite, i: an inf, n: a NaN
  int skipped = 0;
  for (int k = 0; pattern[k] != 0; ++k) {
    SCOPED_TRACE("iteration " + std::to_string(k) + " (" + pattern[k] + ")");
    model.draw_grads(rng, static_cast<float>(cpu_scaler.get_scale() * 1e-3));
    if (pattern[k] == 'i') model.set_grad(3, 4096, INFINITY);
    if (pattern[k] == 'n') model.set_grad(0, 7, NAN);
    cpu_scaler.step(p.cpu);
    p.dev.step_device_scale(&dev_scaler.scale, &dev_scaler);
    EXPECT_EQ(dev_scaler.recorded, 1);
    EXPECT_EQ(dev_scaler.found_inf, pattern[k] == 'i' || pattern[k] == 'n' ? 1 : 0);
    p.expect_same("the step");
    skipped += !p.dev.step_state().applied;
    cpu_scaler.update();
    emulate(sf_emu::utility_kernels().update_scale, EmuLaunch{1, 1}, &dev_scaler);
    EXPECT_TRUE(same(static_cast<float>(cpu_scaler.get_scale()), dev_scaler.scale))
        << "scale: cpu " << cpu_scaler.get_scale() << ", device " << dev_scaler.scale;
    EXPECT_EQ(cpu_scaler.growth_tracker(), dev_scaler.growth_tracker);
    EXPECT_EQ(dev_scaler.found_inf, 0);
    EXPECT_EQ(dev_scaler.recorded, 0);
  }
  EXPECT_EQ(skipped, 2);
  // 2^100 -> 2^108 -> 2^116, inf: 2^115 -> 2^123, 2^131 not kept, NaN: 2^122, 2^130 not kept.
  EXPECT_EQ(dev_scaler.scale, std::ldexp(1.0f, 122));
}

// sf_scale_<dtype>: unscale_ (reciprocal = 1: x * fp32(1 / double(S))) and scale_
// (x * S), rounded to storage, found_inf iff any input was inf/NaN.
TEST_F(EmulatedScaleKernels, MatchTheCpuAndTheDefinition) {
  std::normal_distribution<float> normal(0.0f, 1000.0f);
  const sf_emu::UtilityKernels& util = sf_emu::utility_kernels();
  for (const DType t : {DType::f32, DType::f16, DType::bf16}) {
    for (const float s : {65536.0f, 3000.7f, 0.125f}) {
      for (const int non_finite : {0, 1, 2}) {  // none, an inf, a NaN
        for (const int reciprocal : {1, 0}) {
          SCOPED_TRACE(std::string(dtype_name(t)) + " S = " + std::to_string(s) + " non_finite " + std::to_string(non_finite) +
                       " reciprocal " + std::to_string(reciprocal));
          const long long n = 3001;  // several blocks, a partial last one
          std::vector<std::uint64_t> dev(static_cast<std::size_t>(n)), cpu(dev.size()), before(dev.size());
          for (long long i = 0; i < n; ++i) store(t, dev.data(), i, normal(rng));
          if (non_finite) store(t, dev.data(), n - 2, non_finite == 1 ? -INFINITY : NAN);
          cpu = before = dev;
          int found = 0;
          const unsigned grid = static_cast<unsigned>(std::clamp<long long>((n + 255) / 256, 1, 65535 * 8));
          emulate(util.scale[static_cast<int>(t)], EmuLaunch{grid, 256}, static_cast<void*>(dev.data()), n, &s, reciprocal,
                  reciprocal ? &found : nullptr);
          const float factor = reciprocal ? static_cast<float>(1.0 / static_cast<double>(s)) : s;
          const TensorView view{cpu.data(), n, t};
          const bool cpu_found = detail::scale_tensors({&view, 1}, factor, reciprocal != 0, detail::ThreadPool::shared(1));
          EXPECT_EQ(found, reciprocal && non_finite ? 1 : 0);
          EXPECT_EQ(cpu_found, reciprocal && non_finite);
          expect_same_values(n, [&](long long i) { return std::pair{load(t, cpu.data(), i), load(t, dev.data(), i)}; },
                             "vs the CPU");
          expect_same_values(n, [&](long long i) {
            float expect = 0.0f;
            store(t, &expect, 0, load(t, before.data(), i) * factor);
            return std::pair{load(t, &expect, 0), load(t, dev.data(), i)};
          }, "vs the definition");
        }
      }
    }
  }
}

}  // namespace
}  // namespace stepfuse
