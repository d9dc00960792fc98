// The CPU backends' shared memory of a step, and the reduce pass's combine.
#include "runtime/cpu/host_buffers.hpp"

#include <algorithm>
#include <cmath>

#include "runtime/shard.hpp"

namespace stepfuse::cpu {

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

  // Allocated once; filled by the threads that will use them (first touch).
  // Every buffer spans every tensor; a tensor whose group's program lacks a
  // stream keeps zeros there, unused.
  const std::size_t nb = programs.state_names.size();
  state_.resize(nb);
  for (detail::AlignedBuffer& b : state_) b = detail::AlignedBuffer(static_cast<std::size_t>(layout_.state_elems));
  if (layout_.master_elems > 0) masters_ = detail::AlignedBuffer(static_cast<std::size_t>((layout_.master_bytes() + 3) / 4));
  std::vector<float> init(programs.groups.size() * nb, 0.0f);  // per group, per buffer
  for (std::size_t g = 0; g < programs.groups.size(); ++g)
    for (int s = 0; s < programs.groups[g].program->num_streams; ++s)
      if (const int b = programs.state_slot[g][static_cast<std::size_t>(s)]; b >= 0)
        init[g * nb + static_cast<std::size_t>(b)] = programs.groups[g].state_init[s];
  for_chunks([&](std::size_t c, int) {
    const jit::Chunk& ch = layout_.chunks[c];
    const std::int64_t at = layout_.offsets[ch.tensor] + ch.begin;
    const std::size_t g = programs.tensor_group[ch.tensor];
    for (std::size_t b = 0; b < nb; ++b) std::fill_n(state_[b].data() + at, ch.len, init[g * nb + b]);
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
      a.state[s] = b >= 0 ? state_[static_cast<std::size_t>(b)].data() + layout_.offsets[i] : nullptr;
    }
    a.scalars = scalars[g];
  }
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
