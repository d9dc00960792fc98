// The CPU backends' shared memory of a step, and the reduce pass's combine.
#include "runtime/cpu/host_buffers.hpp"

#include <algorithm>
#include <cmath>

#include "jit/program_analysis.hpp"
#include "jit/stochastic_round.h"
#include "runtime/cpu/q8.hpp"
#include "runtime/shard.hpp"

namespace stepfuse::cpu {

StoredStreams stored_streams(const Program& p) {
  const jit::PhaseStreamUse use = jit::phase_stream_use(p);
  StoredStreams out;
  for (int s = 0; s < kMaxStreams; ++s) {
    if (use.part[0].stores[s]) out.phase1 |= 1u << s;
    if (use.part[1].stores[s]) out.update |= 1u << s;
  }
  return out;
}

HostBuffers::HostBuffers(const detail::StepPrograms& programs, const std::vector<Param>& params,
                         const OptimizerOptions& options, const float (*scalars)[kMaxScalars]) {
  std::vector<jit::TensorShape> shapes;
  std::int64_t elements = 0;
  for (const Param& p : params) {
    shapes.push_back({p.weight.numel, jit::param_combo(p.weight.dtype, p.grad.dtype, options.master_weights, options.stochastic_rounding,
                                                               options.compensated_weights)});
    elements += p.weight.numel;
  }
  layout_ = jit::plan_layout(shapes);
  stochastic_state_ = options.stochastic_state_rounding;
  int threads = options.num_threads > 0 ? options.num_threads : detail::ThreadPool::default_threads();
  if (options.num_threads == 0) {
    // Small lists: waking threads costs more than it saves below ~256 K elements a
    // thread (measured with stepfuse-bench flat:N). Results do not depend on it.
    constexpr std::int64_t kMinElementsPerThread = std::int64_t{1} << 18;
    threads = static_cast<int>(std::clamp<std::int64_t>(elements / kMinElementsPerThread, 1, threads));
  }
  pool_ = &detail::ThreadPool::shared(threads);
  thread_chunks_ = jit::split_chunks(layout_.chunks, threads);
  partials_.resize(layout_.chunks.size());

  allocate_state(programs, params);
  if (layout_.master_elems > 0) masters_ = detail::AlignedBuffer(static_cast<std::size_t>((layout_.master_bytes() + 3) / 4));
  for_chunks([&](std::size_t c, int) {  // the masters, filled by the threads that will use them (first touch)
    const jit::Chunk& ch = layout_.chunks[c];
    if (layout_.master_offsets[ch.tensor] < 0) return;
    if (layout_.master_elem_bytes == 2) {  // compensations start at 0: the weights are the parameters
      std::fill_n(reinterpret_cast<std::uint16_t*>(masters_.data()) + layout_.master_offsets[ch.tensor] + ch.begin,
                  ch.len, std::uint16_t{0});
    } else {
      const TensorView& w = params[ch.tensor].weight;
      widen(w.dtype, static_cast<const char*>(w.data) + ch.begin * static_cast<std::int64_t>(dtype_size(w.dtype)),
            masters_.data() + layout_.master_offsets[ch.tensor] + ch.begin, static_cast<std::size_t>(ch.len));
    }
  });

  args_.resize(params.size());
  std::uint64_t model_index = 0;  // stochastic rounding: the tensor's first element in the model (unsharded)
  for (std::size_t i = 0; i < params.size(); ++i) {
    UpdateArgs& a = args_[i];
    a.sr_seed = options.seed;
    a.sr_base = model_index;
    model_index += static_cast<std::uint64_t>(params[i].weight.numel);
    a.grad = params[i].grad.data;
    a.weight = params[i].weight.data;
    // (a compensated tensor's bf16 compensations, as UpdateArgs::master says)
    if (layout_.master_offsets[i] >= 0)
      a.master = reinterpret_cast<float*>(reinterpret_cast<char*>(masters_.data()) +
                                          layout_.master_offsets[i] * layout_.master_elem_bytes);
    const std::uint32_t g = programs.tensor_group[i];
    for (int s = 0; s < programs.groups[g].program->num_streams; ++s) {
      const int b = programs.state_slot[g][static_cast<std::size_t>(s)];
      if (b < 0) continue;
      const detail::StateSlot& slot = slots_[static_cast<std::size_t>(b)][i];
      if (slot.format == StateFormat::f32) {
        a.state[s] = static_cast<float*>(slot.data);
        continue;
      }
      staged_[i].push_back({s, slot});
      // A bf16 stream's bit patterns, for the kernels that read them in registers
      // (fused_update_kernel's bf16_state); q8 ones only through stage().
      if (slot.format == StateFormat::bf16) a.state[s] = static_cast<float*>(slot.data);
    }
    a.scalars = scalars[g];
  }
}

// Every state buffer spans every tensor (a tensor whose group's program lacks a
// stream keeps f32 zeros there, unused). A buffer all of whose tensors keep f32
// is laid out by layout_.offsets; one with bf16 or q8 tensors packs each tensor's
// bytes 64-byte aligned, and its q8 tensors' absmaxes in absmax_. Allocated once,
// filled by the threads that will use them (first touch).
void HostBuffers::allocate_state(const detail::StepPrograms& programs, const std::vector<Param>& params) {
  const std::size_t nb = programs.state_names.size(), nt = params.size();
  state_.resize(nb);
  absmax_.resize(nb);
  slots_.assign(nb, std::vector<detail::StateSlot>(nt));
  staged_.assign(nt, {});
  const auto round64 = [](std::int64_t bytes) { return (bytes + 63) / 64 * 64; };
  for (std::size_t b = 0; b < nb; ++b) {
    bool all_f32 = true;
    for (std::size_t t = 0; t < nt; ++t) all_f32 &= programs.formats[t][b] == StateFormat::f32;
    if (all_f32) {
      state_[b] = detail::AlignedBuffer(static_cast<std::size_t>(layout_.state_elems));
      for (std::size_t t = 0; t < nt; ++t) slots_[b][t] = {StateFormat::f32, state_[b].data() + layout_.offsets[t], nullptr, false};
      continue;
    }
    std::vector<std::int64_t> at(nt), block_at(nt);
    std::int64_t bytes = 0, blocks = 0;
    for (std::size_t t = 0; t < nt; ++t) {
      const StateFormat f = programs.formats[t][b];
      const std::int64_t n = params[t].weight.numel;
      at[t] = bytes;
      bytes += round64(n * static_cast<std::int64_t>(state_format_size(f)));
      block_at[t] = blocks;
      if (f == StateFormat::q8) blocks += round64(static_cast<std::int64_t>(q8_blocks(static_cast<std::size_t>(n))) * 4) / 4;
    }
    state_[b] = detail::AlignedBuffer(static_cast<std::size_t>(bytes / 4));
    if (blocks > 0) absmax_[b] = detail::AlignedBuffer(static_cast<std::size_t>(blocks));
    const bool nonnegative = programs.state_values[b] == StateValues::nonnegative;
    for (std::size_t t = 0; t < nt; ++t) {
      const StateFormat f = programs.formats[t][b];
      slots_[b][t] = {f, reinterpret_cast<char*>(state_[b].data()) + at[t],
                      f == StateFormat::q8 ? absmax_[b].data() + block_at[t] : nullptr, nonnegative};
    }
  }
  std::vector<float> init(programs.groups.size() * nb, 0.0f);  // per group, per buffer
  for (std::size_t g = 0; g < programs.groups.size(); ++g)
    for (int s = 0; s < programs.groups[g].program->num_streams; ++s)
      if (const int b = programs.state_slot[g][static_cast<std::size_t>(s)]; b >= 0)
        init[g * nb + static_cast<std::size_t>(b)] = programs.groups[g].state_init[s];
  std::size_t max_staged = 0;
  for (std::size_t t = 0; t < nt; ++t) {
    std::size_t k = 0;
    for (std::size_t b = 0; b < nb; ++b) k += programs.formats[t][b] != StateFormat::f32;
    max_staged = std::max(max_staged, k);
  }
  scratch_per_thread_ = max_staged * kChunkElems;
  if (max_staged > 0) scratch_ = detail::AlignedBuffer(scratch_per_thread_ * static_cast<std::size_t>(pool_->size()));
  for_chunks([&](std::size_t c, int thread) {
    const jit::Chunk& ch = layout_.chunks[c];
    const std::size_t g = programs.tensor_group[ch.tensor];
    const auto len = static_cast<std::size_t>(ch.len), begin = static_cast<std::size_t>(ch.begin);
    for (std::size_t b = 0; b < nb; ++b) {
      const detail::StateSlot& s = slots_[b][ch.tensor];
      const float v = init[g * nb + b];
      if (s.format == StateFormat::f32) {
        std::fill_n(static_cast<float*>(s.data) + begin, len, v);
      } else {  // (the init value encoded as the step's stores encode it)
        float* tmp = scratch_.data() + static_cast<std::size_t>(thread) * scratch_per_thread_;
        std::fill_n(tmp, len, v);
        encode(tmp, s, begin, len);
      }
    }
  });
}

void HostBuffers::decode(const detail::StateSlot& s, std::size_t at, std::size_t n, float* dst) {
  if (s.format == StateFormat::bf16) {
    widen(DType::bf16, static_cast<const std::uint16_t*>(s.data) + at, dst, n);
  } else {
    q8_dequantize(static_cast<const std::uint8_t*>(s.data) + at, s.absmax + at / kQ8Block, dst, n,
                  s.nonnegative ? Q8Map::unsigned_dynamic : Q8Map::signed_dynamic);
  }
}

StateRounding HostBuffers::rounding(std::size_t t, std::size_t at, int stream) const {
  if (!stochastic_state_ || !layout_.combos[static_cast<std::size_t>(layout_.tensor_combo[t])].stochastic) return {};
  const UpdateArgs& a = args_[t];
  return {true, a.sr_seed, sf_sr_state_step(a.sr_step, stream), a.sr_base + at};
}

void HostBuffers::encode(const float* src, const detail::StateSlot& s, std::size_t at, std::size_t n,
                         const StateRounding& rounding) {
  if (s.format == StateFormat::bf16 && rounding.stochastic) {
    narrow_bf16_stochastic(src, static_cast<std::uint16_t*>(s.data) + at, n, rounding.seed, rounding.step,
                           rounding.first);
  } else if (s.format == StateFormat::bf16) {
    narrow(src, DType::bf16, static_cast<std::uint16_t*>(s.data) + at, n);
  } else {
    q8_quantize(src, static_cast<std::uint8_t*>(s.data) + at, s.absmax + at / kQ8Block, n,
                s.nonnegative ? Q8Map::unsigned_dynamic : Q8Map::signed_dynamic);
  }
}

UpdateArgs HostBuffers::advanced(const UpdateArgs& a, std::size_t t, std::size_t at, std::size_t grad_size) const {
  const jit::DtypeCombo& c = layout_.combos[static_cast<std::size_t>(layout_.tensor_combo[t])];
  UpdateArgs r = a;
  for (const StagedStream& s : staged_[t]) r.state[s.stream] = nullptr;  // (stage() points them at its copies)
  r.grad = static_cast<const char*>(a.grad) + at * grad_size;
  r.weight = static_cast<char*>(a.weight) + at * dtype_size(c.weight);
  if (a.master != nullptr)
    r.master = reinterpret_cast<float*>(reinterpret_cast<char*>(a.master) + at * static_cast<std::size_t>(layout_.master_elem_bytes));
  for (float*& s : r.state)
    if (s != nullptr) s += at;
  r.sr_base += at;
  return r;
}

void HostBuffers::set_shard(detail::Shard* shard) {
  shard_ = shard;
  if (shard != nullptr)
    for (std::size_t i = 0; i < args_.size(); ++i) args_[i].sr_base = static_cast<std::uint64_t>(shard->model_index_of(i));
}

HostBuffers::Reduction HostBuffers::combine(bool inf_norm, std::vector<double>& tensor_norms) const {
  if (shard_ != nullptr) {
    const detail::Shard::Reduction s = shard_->combine(partials_, inf_norm, tensor_norms);
    return {s.found_inf, s.norm};
  }
  Reduction r;
  double total = 0;
  tensor_norms.resize(layout_.tensor_chunks.size() - 1);
  for (std::size_t t = 0; t + 1 < layout_.tensor_chunks.size(); ++t) {
    double acc = 0;
    for (std::size_t c = layout_.tensor_chunks[t]; c < layout_.tensor_chunks[t + 1]; ++c) {
      r.found_inf |= partials_[c].nonfinite;
      acc = inf_norm ? std::max(acc, static_cast<double>(partials_[c].maxabs)) : acc + partials_[c].sumsq;
    }
    tensor_norms[t] = inf_norm ? acc : std::sqrt(acc);
    total = inf_norm ? std::max(total, acc) : total + acc;
  }
  r.norm = inf_norm ? total : std::sqrt(total);
  return r;
}

}  // namespace stepfuse::cpu
