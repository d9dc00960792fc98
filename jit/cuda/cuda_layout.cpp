// The CUDA kernels' tables, from the layout plan.
#include "jit/cuda/cuda_layout.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "jit/program_analysis.hpp"

namespace stepfuse::jit {

namespace {

std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

bool vector_aligned(const std::vector<Param>& params) {
  for (const Param& p : params) {
    const std::uintptr_t wa = dtype_size(p.weight.dtype) * 4, ga = dtype_size(p.grad.dtype) * 4;
    if (address(p.weight.data) % wa != 0 || address(p.grad.data) % ga != 0) return false;
  }
  return true;
}

bool is_flat(const std::vector<Param>& params) {
  for (std::size_t i = 1; i < params.size(); ++i) {
    const Param& a = params[i - 1];
    const Param& b = params[i];
    if (a.weight.dtype != b.weight.dtype || a.grad.dtype != b.grad.dtype) return false;
    const auto end = [](const TensorView& v) {
      return address(v.data) + static_cast<std::uintptr_t>(v.numel) * dtype_size(v.dtype);
    };
    if (end(a.weight) != address(b.weight.data) || end(a.grad) != address(b.grad.data)) return false;
  }
  return true;
}

}  // namespace

CudaLayout plan_cuda_layout(const Program& program, const std::vector<Param>& params, const OptimizerOptions& options,
                            bool allow_flat) {
  std::vector<TensorShape> shapes;
  shapes.reserve(params.size());
  for (const Param& p : params)
    shapes.push_back({p.weight.numel, param_combo(p.weight.dtype, p.grad.dtype, options.master_weights, options.stochastic_rounding,
                                                           options.compensated_weights)});
  // A two-phase program's phase 2 reads each tensor's norms by its index in the block
  // table: never the flat layout (jit/cuda/emit_cuda.hpp). Nor does a sharded step that
  // rounds stochastically: its params' model indices need not be contiguous.
  const bool sharded_rounding = options.stochastic_rounding && options.communicator != nullptr;
  CudaLayout l = plan_cuda_layout(program, shapes, options.norm_type == INFINITY ? CudaNorm::inf : CudaNorm::l2,
                                  allow_flat && is_flat(params) && !is_two_phase(program) && !sharded_rounding,
                                  vector_aligned(params));
  for (std::size_t i = 0; i < params.size(); ++i) {
    l.tensors[i].grad = params[i].grad.data;
    l.tensors[i].weight = params[i].weight.data;
  }
  return l;
}

CudaLayout plan_cuda_layout(const Program& program, const std::vector<TensorShape>& tensors, CudaNorm norm, bool flat,
                            bool aligned16) {
  CudaLayout l;
  l.layout = plan_layout(tensors, flat);
  l.spec.program = program;
  l.spec.norm = norm;
  l.spec.aligned16 = aligned16;
  l.spec.flat = flat;
  l.spec.combos = l.layout.combos;
  l.tensors.resize(tensors.size());
  long long model_index = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::int64_t numel = tensors[i].numel;
    sf_tensor& t = l.tensors[i];
    t.grad = nullptr;
    t.weight = nullptr;
    t.master = nullptr;
    t.state_offset = l.layout.offsets[i];
    t.numel = numel;
    t.first_chunk = static_cast<long long>(l.layout.tensor_chunks[i]);
    t.num_chunks = static_cast<int>(l.layout.tensor_chunks[i + 1] - l.layout.tensor_chunks[i]);
    t.combo = l.layout.tensor_combo[i];
    t.group = 0;  // the caller sets param groups
    t.pad_ = 0;
    t.model_index = model_index;  // unsharded: the params' elements in order (a sharded optimizer's come later)
    model_index += numel;
    for (std::int64_t b = 0; b < numel; b += SF_UPDATE_ELEMS)
      l.blocks.push_back({b, static_cast<int>(i), static_cast<int>(std::min<std::int64_t>(SF_UPDATE_ELEMS, numel - b))});
  }
  l.chunks.reserve(l.layout.chunks.size());
  for (const Chunk& c : l.layout.chunks) l.chunks.push_back({c.begin, static_cast<int>(c.tensor), static_cast<int>(c.len)});
  if (l.blocks.empty()) l.blocks.push_back({0, 0, 0});  // one idle block still counts a plain step
  l.num_update_blocks =
      flat ? static_cast<int>(std::max<std::int64_t>((l.layout.state_elems + SF_UPDATE_ELEMS - 1) / SF_UPDATE_ELEMS, 1))
           : static_cast<int>(l.blocks.size());
  return l;
}

std::vector<int> assign_groups(CudaLayout& l, const std::vector<const Program*>& group_programs,
                               const std::vector<std::uint32_t>& tensor_group) {
  for (std::size_t i = 0; i < l.tensors.size(); ++i) l.tensors[i].group = static_cast<int>(tensor_group[i]);
  // Each group's variant: the first group with an equal program gives its index.
  std::vector<int> group_variant(group_programs.size(), 0);
  std::vector<std::string> texts;  // one per variant
  for (std::size_t g = 0; g < group_programs.size(); ++g) {
    const std::string text = to_string(*group_programs[g]);
    const auto same = std::find(texts.begin(), texts.end(), text);
    group_variant[g] = static_cast<int>(same - texts.begin());
    if (same == texts.end()) {
      texts.push_back(text);
      if (g > 0) l.spec.variants.push_back(*group_programs[g]);
    }
  }
  l.spec.program = *group_programs[0];
  if (texts.size() == 1) return group_variant;
  // (dtype combination, variant) pairs, in the tensors' order.
  const std::vector<DtypeCombo> dtypes = l.spec.combos;
  std::vector<std::pair<int, int>> pairs;
  l.spec.combos.clear();
  for (sf_tensor& t : l.tensors) {
    const std::pair<int, int> key{t.combo, group_variant[static_cast<std::size_t>(t.group)]};
    auto it = std::find(pairs.begin(), pairs.end(), key);
    if (it == pairs.end()) {
      pairs.push_back(key);
      l.spec.combos.push_back(dtypes[static_cast<std::size_t>(key.first)]);
      l.spec.combo_variant.push_back(key.second);
      it = pairs.end() - 1;
    }
    t.combo = static_cast<int>(it - pairs.begin());
  }
  return group_variant;
}

void assign_state_formats(CudaLayout& l, const std::vector<std::array<StateFormat, kMaxStreams>>& formats,
                          bool stochastic_state) {
  bool any = false;
  for (const auto& f : formats)
    for (const StateFormat x : f) any = any || x != StateFormat::f32;
  if (!any) return;
  // (combination, formats) pairs, in the tensors' order.
  const std::vector<DtypeCombo> combos = l.spec.combos;
  const std::vector<int> variants = l.spec.combo_variant;
  std::vector<std::pair<int, std::array<StateFormat, kMaxStreams>>> keys;
  l.spec.combos.clear();
  l.spec.combo_variant.clear();
  l.spec.combo_formats.clear();
  for (std::size_t i = 0; i < l.tensors.size(); ++i) {
    sf_tensor& t = l.tensors[i];
    const std::pair<int, std::array<StateFormat, kMaxStreams>> key{t.combo, formats[i]};
    auto it = std::find(keys.begin(), keys.end(), key);
    if (it == keys.end()) {
      keys.push_back(key);
      l.spec.combos.push_back(combos[static_cast<std::size_t>(key.first)]);
      if (!variants.empty()) l.spec.combo_variant.push_back(variants[static_cast<std::size_t>(key.first)]);
      l.spec.combo_formats.push_back(key.second);
      it = keys.end() - 1;
    }
    t.combo = static_cast<int>(it - keys.begin());
  }
  bool stochastic_bf16 = false;  // a stochastic combination that stores some state as bf16
  for (std::size_t k = 0; k < l.spec.combos.size(); ++k)
    for (const StateFormat f : l.spec.combo_formats[k])
      stochastic_bf16 = stochastic_bf16 || (l.spec.combos[k].stochastic && f == StateFormat::bf16);
  l.spec.stochastic_state = stochastic_state || !stochastic_bf16;
}

PackedState plan_packed_state(const CudaLayout& l) {
  PackedState p;
  const std::vector<std::array<int, kMaxStreams>> slots = cuda_stream_slots(l.spec);
  const std::vector<const Program*> programs = spec_programs(l.spec);
  const auto round = [](std::int64_t n, std::int64_t to) { return (n + to - 1) / to * to; };
  p.at.assign(l.tensors.size(), {});
  p.absmax_at.assign(l.tensors.size(), {});
  p.buffer.assign(l.tensors.size(), {});
  for (std::size_t i = 0; i < l.tensors.size(); ++i) {
    p.buffer[i].fill(-1);
    p.at[i].fill(-1);
    p.absmax_at[i].fill(-1);
    const auto k = static_cast<std::size_t>(l.tensors[i].combo);
    const std::size_t v = l.spec.combo_variant.empty() ? 0 : static_cast<std::size_t>(l.spec.combo_variant[k]);
    const Program& prog = *programs[v];
    const std::int64_t n = l.tensors[i].numel;
    for (int s = 0; s < prog.num_streams; ++s) {
      if (prog.streams[s].role != StreamRole::state) continue;
      const auto b = static_cast<std::size_t>(slots[v][static_cast<std::size_t>(s)]);
      const StateFormat f = l.spec.combo_formats.empty() ? StateFormat::f32 : l.spec.combo_formats[k][static_cast<std::size_t>(s)];
      p.buffer[i][static_cast<std::size_t>(s)] = static_cast<int>(b);
      p.at[i][static_cast<std::size_t>(s)] = p.bytes[b];
      p.bytes[b] += round(n * static_cast<std::int64_t>(state_format_size(f)), 256);
      if (f == StateFormat::q8) {
        p.absmax_at[i][static_cast<std::size_t>(s)] = p.absmaxes[b];
        p.absmaxes[b] += q8_blocks(n);
      }
    }
  }
  return p;
}

}  // namespace stepfuse::jit
