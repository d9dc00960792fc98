// ShardedOptimizer (include/stepfuse/sharded_optimizer.hpp): ZeRO-2 over the sharded
// step. Construction: local checks, one all_gather of every rank's model summary
// and status, the partition (the same on every rank: it depends on the model only),
// then the inner Optimizer over this rank's pieces (collective itself). A step:
// stage + reduce_scatter + divide, the inner step, and the weights' all_gather.
#include "stepfuse/sharded_optimizer.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

// Header-only, as in runtime/safetensors.cpp: nothing to link.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "jit/builtins.hpp"
#include "jit/program_analysis.hpp"
#include "runtime/cpu/kernels.hpp"
#include "runtime/detail_access.hpp"
#include "runtime/shard.hpp"
#include "runtime/thread_pool.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/grad_scaler.hpp"
#include "stepfuse/update_program.hpp"

namespace stepfuse {

namespace {

[[noreturn]] void bad_argument(const std::string& message) {
  throw Error(ErrorCode::invalid_argument, "ShardedOptimizer: " + message);
}

// The most elements one tensor may have (as an Optimizer's limit).
constexpr std::int64_t kMaxNumel = std::int64_t{1} << 48;
// Copies are split into pieces of at most this many elements, spread over the threads.
constexpr std::int64_t kCopyBlock = std::int64_t{1} << 16;

bool valid_dtype(DType t) { return static_cast<unsigned>(t) <= static_cast<unsigned>(DType::bf16); }

DType wire_dtype(CommType t) { return t == CommType::f16 ? DType::f16 : t == CommType::bf16 ? DType::bf16 : DType::f32; }

// A summary of a model that every rank computes the same way: XXH3-64 of its fields.
struct Hash {
  Hash() {
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
  }
  XXH3_state_t state;
  std::uint64_t digest() const { return XXH3_64bits_digest(&state); }
  void bytes(const void* p, std::size_t n) { XXH3_64bits_update(&state, p, n); }
  template <class T>
  void value(T v) {
    bytes(&v, sizeof(v));
  }
  void text(std::string_view s) {
    value(static_cast<std::uint64_t>(s.size()));
    bytes(s.data(), s.size());
  }
};

// Round 1: one rank's status and its model's summary. Plain bytes, zero-filled.
struct Summary {
  detail::RankStatus status;  // this rank's own checks
  std::uint64_t layout = 0;   // groups, tensor sizes and dtypes
  std::uint64_t configs = 0;  // every group's program, scalar rules and initial state
  std::int64_t groups = 0, tensors = 0, elements = 0;
  std::int32_t grad_type = 0;
  std::int32_t unused = 0;
};
static_assert(sizeof(Summary) % 8 == 0);

// This rank's own checks of the whole model (what an Optimizer over it would
// reject, checked here because the inner Optimizer sees this rank's part only).
void check_model(const std::vector<ParamGroup>& groups, const OptimizerOptions& options, const ShardedOptions& sharded) {
  if (options.communicator)
    bad_argument("OptimizerOptions::communicator is set (pass the communicator as the constructor's argument; the "
                 "ShardedOptimizer sets the inner Optimizer's)");
  if (!options.slices.empty())
    bad_argument("OptimizerOptions::slices is set (the ShardedOptimizer partitions the model itself)");
  if (options.device.kind != Device::Kind::cpu)
    throw Error(ErrorCode::unsupported,
                "ShardedOptimizer: OptimizerOptions::device is a GPU, but the ShardedOptimizer stages gradients and "
                "weights in host memory (CPU only in this version); on GPUs, build a sharded Optimizer "
                "(OptimizerOptions::communicator = stepfuse::nccl_communicator(...)) over each rank's shard, and "
                "reduce-scatter the gradients and all-gather the weights as your framework does");
  if (sharded.grad_type != CommType::f32 && sharded.grad_type != CommType::bf16 && sharded.grad_type != CommType::f16)
    bad_argument("ShardedOptions::grad_type = " + std::string(comm_type_name(sharded.grad_type)) +
                 " (the gradients travel as f32, bf16 or f16)");
  if (groups.empty()) bad_argument("no param groups (pass at least one ParamGroup)");
  struct Extent {
    std::uintptr_t begin, end;
    std::string what;
  };
  std::vector<Extent> extents;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::string gname = groups.size() == 1 ? std::string() : "groups[" + std::to_string(g) + "].";
    if (groups[g].params.empty()) bad_argument(gname + "params is empty (pass at least one Param)");
    if (groups[g].config.index() != groups[0].config.index())
      bad_argument(gname + "config is " + std::string(optimizer_name(groups[g].config)) + " but groups[0].config is " +
                   std::string(optimizer_name(groups[0].config)) + " (every group has the same optimizer kind)");
    try {
      jit::validate_config(groups[g].config);
    } catch (const Error& e) {
      throw Error(e.code(), "ShardedOptimizer: " + gname + "config: " + detail::message_of(e));
    }
    for (std::size_t i = 0; i < groups[g].params.size(); ++i) {
      const Param& p = groups[g].params[i];
      const std::string at = gname + "params[" + std::to_string(i) + "]";
      for (const auto& [view, field] : {std::pair{&p.weight, ".weight"}, std::pair{&p.grad, ".grad"}}) {
        if (!valid_dtype(view->dtype))
          bad_argument(at + field + ".dtype = " + std::to_string(static_cast<int>(view->dtype)) + " is not a DType");
        if (view->numel < 0 || view->numel > kMaxNumel)
          bad_argument(at + field + ".numel = " + std::to_string(view->numel) + " (0 to 2^48)");
        if (view->numel > 0 && view->data == nullptr)
          bad_argument(at + field + ".data is null with numel = " + std::to_string(view->numel));
        if (view->numel > 0) {
          const auto b = reinterpret_cast<std::uintptr_t>(view->data);
          extents.push_back({b, b + static_cast<std::uintptr_t>(view->numel) * dtype_size(view->dtype), at + field});
        }
      }
      if (p.weight.numel != p.grad.numel)
        bad_argument(at + ".weight.numel = " + std::to_string(p.weight.numel) + " but .grad.numel = " +
                     std::to_string(p.grad.numel) + " (they must match)");
    }
  }
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  for (std::size_t k = 1, last = 0; k < extents.size(); ++k) {
    if (extents[k].begin < extents[last].end)
      bad_argument(extents[k].what + " shares memory with " + extents[last].what + " (tensors must not share memory)");
    if (extents[k].end > extents[last].end) last = k;
  }
}

Summary summarize(const std::vector<ParamGroup>& groups, const ShardedOptions& sharded) {
  Summary s;
  Hash layout, configs;
  layout.value(static_cast<std::uint64_t>(groups.size()));
  for (const ParamGroup& g : groups) {
    layout.value(static_cast<std::uint64_t>(g.params.size()));
    for (const Param& p : g.params) {
      layout.value(p.weight.numel);
      layout.value(static_cast<std::uint8_t>(p.weight.dtype));
      layout.value(static_cast<std::uint8_t>(p.grad.dtype));
      s.elements += p.weight.numel;
      ++s.tensors;
    }
    const Program& program = jit::builtin_program(jit::select_builtin(g.config));
    configs.text(to_string(program));
    const UpdateProgram update = UpdateProgram::from_config(g.config);  // kept alive for the loop
    for (const ScalarDef& d : update.scalars()) {
      configs.text(d.name);
      configs.value(static_cast<std::uint8_t>(d.rule.kind));
      configs.value(d.rule.a);
      configs.value(d.rule.b);
      configs.value(d.rule.c);
    }
    for (int k = 0; k < program.num_streams; ++k)
      if (program.streams[k].role == StreamRole::state) configs.value(jit::initial_state_value(g.config, program, k));
  }
  s.layout = layout.digest();
  s.configs = configs.digest();
  s.groups = static_cast<std::int64_t>(groups.size());
  s.grad_type = static_cast<std::int32_t>(sharded.grad_type);
  return s;
}

std::string describe(const Summary& s) {
  return std::to_string(s.groups) + (s.groups == 1 ? " group, " : " groups, ") + std::to_string(s.tensors) +
         " tensors, " + std::to_string(s.elements) + " elements";
}

// Every rank's summary checked together: the same Error on every rank (the rank
// whose own checks failed rethrows its own).
void check_summaries(const std::vector<Summary>& all, const std::exception_ptr& mine) {
  detail::throw_if_any_failed(all, mine, "ShardedOptimizer", "refused its model, so no rank builds one");
  const Summary& a = all[0];
  for (std::size_t r = 1; r < all.size(); ++r) {
    const Summary& b = all[r];
    std::string what;
    if (a.groups != b.groups || a.tensors != b.tensors || a.elements != b.elements)
      what = "rank 0 has " + describe(a) + ", rank " + std::to_string(r) + " " + describe(b);
    else if (a.layout != b.layout)
      what = "the tensors' sizes or dtypes, or the groups they are in, differ";
    else if (a.configs != b.configs)
      what = "the groups' configs (hyperparameters) differ";
    else if (a.grad_type != b.grad_type)
      what = "ShardedOptions::grad_type differs (rank 0: " +
             std::string(comm_type_name(static_cast<CommType>(a.grad_type))) + ", rank " + std::to_string(r) + ": " +
             std::string(comm_type_name(static_cast<CommType>(b.grad_type))) + ")";
    if (!what.empty())
      bad_argument("rank " + std::to_string(r) + "'s model differs from rank 0's: " + what +
                   " (every rank passes the whole model: the same groups, tensors, sizes, dtypes and configs, in the "
                   "same order)");
  }
}

// Cuts the model's elements [0, n) into `ranks` ranges at the allowed positions
// `cuts` (sorted, unique, from 0 to n): cut r is the allowed position nearest to
// r * n / ranks (the lower one on a tie), never before cut r - 1.
std::vector<std::int64_t> balance(const std::vector<std::int64_t>& cuts, std::int64_t n, int ranks) {
  std::vector<std::int64_t> at(static_cast<std::size_t>(ranks) + 1, 0);
  at.back() = n;
  for (int r = 1; r < ranks; ++r) {
    const auto target = static_cast<__int128>(r) * n;  // compared with position * ranks
    const auto it = std::lower_bound(cuts.begin(), cuts.end(), target, [&](std::int64_t pos, __int128 t) {
      return static_cast<__int128>(pos) * ranks < t;
    });
    std::int64_t pick = it == cuts.end() ? n : *it;
    if (it != cuts.begin()) {
      const std::int64_t lo = *(it - 1);
      if (target - static_cast<__int128>(lo) * ranks <= static_cast<__int128>(pick) * ranks - target) pick = lo;
    }
    at[static_cast<std::size_t>(r)] = std::max(pick, at[static_cast<std::size_t>(r) - 1]);
  }
  return at;
}

}  // namespace


struct ShardedOptimizer::Impl {
  struct Tensor {
    TensorView weight, grad;
    std::int64_t start = 0;  // its first element in the model's list
  };
  // Elements [offset, offset + numel) of a tensor, to or from position `at` of a
  // buffer (in elements for gradients, in bytes for weights).
  struct Copy {
    std::size_t tensor;
    std::int64_t offset, numel;
    std::size_t at;
  };

  std::shared_ptr<Communicator> comm;
  int rank = 0, ranks = 1;
  ShardedOptions sharded;
  std::vector<Tensor> tensors;
  std::int64_t elements = 0;
  std::vector<Range> ranges;
  std::int64_t count = 0;             // the largest range: each rank's block of the reduce_scatter
  std::size_t weight_block = 0;       // the largest range's weight bytes: each rank's block of the all_gather
  std::vector<unsigned char> staging;  // R gradient blocks; after the step, R weight blocks
  std::vector<unsigned char> recv16;   // a 16-bit reduce_scatter's result
  std::vector<float> avg;              // the averaged gradients of this rank's range
  std::vector<unsigned char> weight_send;
  std::vector<Copy> grad_copies;     // the caller's gradients -> staging (avg with one rank)
  std::vector<Copy> weight_packs;    // this rank's weights -> weight_send
  std::vector<Copy> weight_unpacks;  // staging -> the other ranks' ranges of the weights
  std::vector<Copy> avg_blocks;      // this rank's range, in blocks (the average)
  std::vector<TensorSlice> slices;
  int threads = 1;
  std::unique_ptr<Optimizer> inner;

  Impl(std::vector<ParamGroup> groups, std::shared_ptr<Communicator> c, const OptimizerOptions& options,
       const ShardedOptions& s);
  void plan(const std::vector<ParamGroup>& groups, const OptimizerOptions& options, std::vector<ParamGroup>& inner_groups);

  template <class F>
  void for_copies(const std::vector<Copy>& copies, F&& body) const {
    if (copies.empty()) return;
    detail::ThreadPool& pool = detail::ThreadPool::shared(threads);
    const auto n = static_cast<std::size_t>(pool.size());
    pool.run([&](int t) {
      for (auto i = static_cast<std::size_t>(t); i < copies.size(); i += n) body(copies[i]);
    });
  }
  void reduce_grads();
  void gather_weights();
  StepResult finish(const StepResult& result) {
    if (result.applied && ranks > 1) gather_weights();
    return result;
  }
};

namespace {

// dst[0, n) = src[0, n) converted (widening exact; narrowing to nearest even).
void convert(DType from, const void* src, DType to, void* dst, std::int64_t count) {
  const auto n = static_cast<std::size_t>(count);
  if (from == to) {
    std::memcpy(dst, src, n * dtype_size(from));
  } else if (to == DType::f32) {
    cpu::widen(from, src, static_cast<float*>(dst), n);
  } else if (from == DType::f32) {
    cpu::narrow(static_cast<const float*>(src), to, dst, n);
  } else {  // f16 <-> bf16, through fp32
    float tmp[1024];
    for (std::size_t i = 0; i < n; i += 1024) {
      const std::size_t m = std::min<std::size_t>(1024, n - i);
      cpu::widen(from, static_cast<const std::uint16_t*>(src) + i, tmp, m);
      cpu::narrow(tmp, to, static_cast<std::uint16_t*>(dst) + i, m);
    }
  }
}

// Appends the copy of [offset, offset + numel) of `tensor` to `at`, in blocks of kCopyBlock
// elements; `unit` is the bytes (or 1 element) per element at the buffer's side.
template <class Copies>
void add_copies(Copies& out, std::size_t tensor, std::int64_t offset,
                std::int64_t numel, std::size_t at, std::size_t unit) {
  for (std::int64_t k = 0; k < numel; k += kCopyBlock)
    out.push_back({tensor, offset + k, std::min(kCopyBlock, numel - k), at + static_cast<std::size_t>(k) * unit});
}

}  // namespace

ShardedOptimizer::Impl::Impl(std::vector<ParamGroup> groups, std::shared_ptr<Communicator> c,
                             const OptimizerOptions& options, const ShardedOptions& s)
    : comm(std::move(c)), sharded(s) {
  // Without a valid communicator nothing can be told to the other ranks.
  if (!comm) bad_argument("the communicator is null");
  rank = comm->rank();
  ranks = comm->size();
  if (ranks < 1 || rank < 0 || rank >= ranks)
    bad_argument("communicator '" + std::string(comm->name()) + "': rank " + std::to_string(rank) + " of size " +
                 std::to_string(ranks) + " (need 0 <= rank < size)");

  // Its collectives pass host memory: a communicator of device memory fails on every rank alike.
  if (comm->device().kind != Device::Kind::cpu)
    throw Error(ErrorCode::unsupported, "ShardedOptimizer: communicator '" + std::string(comm->name()) +
                                            "' works on device memory, but the ShardedOptimizer's collectives pass host "
                                            "memory (use a CPU communicator: MPI, or torch.distributed's gloo)");

  // Round 1: every rank's checks and model summary.
  Summary mine;
  std::exception_ptr error;
  try {
    check_model(groups, options, sharded);
    mine = summarize(groups, sharded);
  } catch (...) {
    error = std::current_exception();
    mine = Summary{};
  }
  mine.status = detail::RankStatus::of(error);
  std::vector<Summary> all(static_cast<std::size_t>(ranks));
  comm->all_gather(&mine, all.data(), sizeof(Summary), CommType::u8);
  check_summaries(all, error);

  // The same model everywhere: the same partition everywhere. Then the inner
  // Optimizer, whose construction is collective (a rank failing before it tells the others).
  OptimizerOptions inner_options = options;
  inner_options.communicator = comm;
  std::vector<ParamGroup> inner_groups;
  try {
    plan(groups, options, inner_groups);
    inner_options.slices = slices;
  } catch (...) {
    detail::Shard::refuse(inner_options, std::current_exception());
    throw;
  }
  inner = std::make_unique<Optimizer>(std::move(inner_groups), inner_options);
}

void ShardedOptimizer::Impl::plan(const std::vector<ParamGroup>& groups, const OptimizerOptions& options,
                                  std::vector<ParamGroup>& inner_groups) {
  // The model's tensors, and where a range may end: at a tensor's end, or at a
  // multiple of kShardAlign within it (not within a two-phase program's tensor).
  std::vector<std::size_t> group_begin;
  std::vector<std::int64_t> cuts{0};
  for (const ParamGroup& g : groups) {
    group_begin.push_back(tensors.size());
    const bool whole = jit::is_two_phase(jit::builtin_program(jit::select_builtin(g.config)));
    for (const Param& p : g.params) {
      tensors.push_back({p.weight, p.grad, elements});
      if (!whole)
        for (std::int64_t o = kShardAlign; o < p.weight.numel; o += kShardAlign) cuts.push_back(elements + o);
      elements += p.weight.numel;
      if (cuts.back() != elements) cuts.push_back(elements);
    }
  }
  group_begin.push_back(tensors.size());
  const std::vector<std::int64_t> at = balance(cuts, elements, ranks);
  for (int r = 0; r < ranks; ++r) {
    ranges.push_back({at[static_cast<std::size_t>(r)], at[static_cast<std::size_t>(r) + 1]});
    count = std::max(count, ranges.back().size());
  }

  // Each rank's pieces, in model order (every rank knows everyone's).
  struct Piece {
    std::size_t tensor;
    std::int64_t offset, numel;
  };
  std::vector<std::vector<Piece>> pieces(static_cast<std::size_t>(ranks));
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const std::int64_t s = tensors[t].start, n = tensors[t].weight.numel;
    if (n == 0) {  // an empty tensor: the rank whose range starts at or before it, last
      const auto k = std::upper_bound(at.begin() + 1, at.end() - 1, s) - (at.begin() + 1);
      pieces[static_cast<std::size_t>(k)].push_back({t, 0, 0});
      continue;
    }
    for (int r = 0; r < ranks; ++r) {
      const std::int64_t lo = std::max(s, at[static_cast<std::size_t>(r)]);
      const std::int64_t hi = std::min(s + n, at[static_cast<std::size_t>(r) + 1]);
      if (lo < hi) pieces[static_cast<std::size_t>(r)].push_back({t, lo - s, hi - lo});
    }
  }

  // The copies of a step, and the buffers. Each rank's block of the weights'
  // all_gather holds its pieces' weight bytes, in order.
  const std::size_t grad_unit = ranks == 1 ? sizeof(float) : comm_type_size(sharded.grad_type);
  for (const std::vector<Piece>& list : pieces) {
    std::size_t bytes = 0;
    for (const Piece& p : list) bytes += static_cast<std::size_t>(p.numel) * dtype_size(tensors[p.tensor].weight.dtype);
    weight_block = std::max(weight_block, bytes);
  }
  for (int r = 0; r < ranks; ++r) {
    const auto ru = static_cast<std::size_t>(r);
    std::size_t bytes = ru * weight_block;  // in staging; in weight_send (own) from 0
    if (r == rank) bytes = 0;
    for (const Piece& p : pieces[ru]) {
      const Tensor& x = tensors[p.tensor];
      const auto pos = static_cast<std::size_t>(x.start + p.offset - at[ru]);
      add_copies(grad_copies, p.tensor, p.offset, p.numel, ru * static_cast<std::size_t>(count) + pos, 1);
      const std::size_t ws = dtype_size(x.weight.dtype);
      add_copies(r == rank ? weight_packs : weight_unpacks, p.tensor, p.offset, p.numel, bytes, ws);
      bytes += static_cast<std::size_t>(p.numel) * ws;
    }
  }
  avg.assign(static_cast<std::size_t>(count), 0.0f);
  add_copies(avg_blocks, 0, 0, ranges[static_cast<std::size_t>(rank)].size(), 0, 1);
  if (ranks > 1) {
    const auto ur = static_cast<std::size_t>(ranks);
    staging.assign(std::max(ur * static_cast<std::size_t>(count) * grad_unit, ur * weight_block), 0);
    weight_send.assign(weight_block, 0);
    if (grad_unit == 2) recv16.assign(static_cast<std::size_t>(count) * 2, 0);
  }
  const int wanted = options.num_threads > 0 ? options.num_threads : detail::ThreadPool::default_threads();
  threads = static_cast<int>(std::clamp<std::int64_t>(elements / (std::int64_t{1} << 18), 1, wanted));

  // The inner Optimizer's groups: this rank's pieces of each group, then one empty
  // param, on every rank, of model tensor num_tensors() + g: the group's place when the
  // rank owns none of it, and in checkpoints the group's step count and hyperparameters
  // for any rank count (the ids do not depend on the cut, so load_shards re-shards).
  const std::vector<Piece>& own = pieces[static_cast<std::size_t>(rank)];
  const std::int64_t range_begin = ranges[static_cast<std::size_t>(rank)].begin;
  std::size_t k = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    ParamGroup pg;
    pg.config = groups[g].config;
    pg.state_format = groups[g].state_format;
    for (; k < own.size() && own[k].tensor < group_begin[g + 1]; ++k) {
      const Piece& p = own[k];
      const Tensor& x = tensors[p.tensor];
      Param q;
      q.weight = {p.numel == 0 ? nullptr : static_cast<char*>(x.weight.data) + p.offset * static_cast<std::int64_t>(dtype_size(x.weight.dtype)),
                  p.numel, x.weight.dtype};
      q.grad = {p.numel == 0 ? nullptr : avg.data() + (x.start + p.offset - range_begin), p.numel, DType::f32};
      pg.params.push_back(q);
      slices.push_back({static_cast<std::int64_t>(p.tensor), p.offset});
    }
    pg.params.push_back(Param{TensorView{nullptr, 0, DType::f32}, TensorView{nullptr, 0, DType::f32}});
    slices.push_back({static_cast<std::int64_t>(tensors.size() + g), 0});
    inner_groups.push_back(std::move(pg));
  }
}

void ShardedOptimizer::Impl::reduce_grads() {
  const DType wire = ranks == 1 ? DType::f32 : wire_dtype(sharded.grad_type);
  auto* base = ranks == 1 ? reinterpret_cast<unsigned char*>(avg.data()) : staging.data();
  const std::size_t unit = dtype_size(wire);
  for_copies(grad_copies, [&](const Copy& c) {
    const Tensor& x = tensors[c.tensor];
    convert(x.grad.dtype, static_cast<const char*>(x.grad.data) + c.offset * static_cast<std::int64_t>(dtype_size(x.grad.dtype)),
            wire, base + c.at * unit, c.numel);
  });
  if (ranks == 1 || count == 0) return;
  const auto n = static_cast<std::size_t>(count);
  if (wire == DType::f32) {
    comm->reduce_scatter(staging.data(), avg.data(), n, CommType::f32, ReduceOp::sum);
  } else {
    comm->reduce_scatter(staging.data(), recv16.data(), n, sharded.grad_type, ReduceOp::sum);
  }
  // The average: widened (16-bit sums) and divided by R in fp32, correctly rounded.
  const float r = static_cast<float>(ranks);
  for_copies(avg_blocks, [&](const Copy& c) {
    float* a = avg.data() + c.offset;
    if (wire != DType::f32) cpu::widen(wire, recv16.data() + c.offset * 2, a, static_cast<std::size_t>(c.numel));
    for (std::int64_t i = 0; i < c.numel; ++i) a[i] = a[i] / r;
  });
}

void ShardedOptimizer::Impl::gather_weights() {
  if (weight_block == 0) return;
  for_copies(weight_packs, [&](const Copy& c) {
    const TensorView& w = tensors[c.tensor].weight;
    const std::size_t ws = dtype_size(w.dtype);
    std::memcpy(weight_send.data() + c.at, static_cast<const char*>(w.data) + static_cast<std::size_t>(c.offset) * ws,
                static_cast<std::size_t>(c.numel) * ws);
  });
  comm->all_gather(weight_send.data(), staging.data(), weight_block, CommType::u8);
  for_copies(weight_unpacks, [&](const Copy& c) {
    const TensorView& w = tensors[c.tensor].weight;
    const std::size_t ws = dtype_size(w.dtype);
    std::memcpy(static_cast<char*>(w.data) + static_cast<std::size_t>(c.offset) * ws, staging.data() + c.at,
                static_cast<std::size_t>(c.numel) * ws);
  });
}

ShardedOptimizer::ShardedOptimizer(OptimizerConfig config, std::vector<Param> params, std::shared_ptr<Communicator> comm,
                                   OptimizerOptions options, ShardedOptions sharded)
    : impl_(std::make_unique<Impl>(std::vector<ParamGroup>{{std::move(params), std::move(config)}}, std::move(comm),
                                   options, sharded)) {}
ShardedOptimizer::ShardedOptimizer(std::vector<ParamGroup> groups, std::shared_ptr<Communicator> comm,
                                   OptimizerOptions options, ShardedOptions sharded)
    : impl_(std::make_unique<Impl>(std::move(groups), std::move(comm), options, sharded)) {}
ShardedOptimizer::~ShardedOptimizer() = default;
ShardedOptimizer::ShardedOptimizer(ShardedOptimizer&&) noexcept = default;
ShardedOptimizer& ShardedOptimizer::operator=(ShardedOptimizer&&) noexcept = default;

StepResult ShardedOptimizer::step() {
  impl_->reduce_grads();
  impl_->inner->step();
  return impl_->finish(impl_->inner->last_result());
}

StepResult ShardedOptimizer::step_scaled(double loss_scale) {
  impl_->reduce_grads();
  return impl_->finish(impl_->inner->step_scaled(loss_scale));
}

bool ShardedOptimizer::step(GradScaler& scaler) {
  impl_->reduce_grads();
  scaler.step(*impl_->inner);
  return impl_->finish(scaler.last_step_result()).applied;
}

Optimizer& ShardedOptimizer::shard() { return *impl_->inner; }
const Optimizer& ShardedOptimizer::shard() const { return *impl_->inner; }
std::span<const TensorSlice> ShardedOptimizer::shard_slices() const { return impl_->slices; }
ShardedOptimizer::Range ShardedOptimizer::range() const { return impl_->ranges[static_cast<std::size_t>(impl_->rank)]; }
const std::vector<ShardedOptimizer::Range>& ShardedOptimizer::ranges() const { return impl_->ranges; }
std::size_t ShardedOptimizer::num_tensors() const { return impl_->tensors.size(); }
std::int64_t ShardedOptimizer::num_elements() const { return impl_->elements; }
Communicator& ShardedOptimizer::communicator() const { return *impl_->comm; }

ShardedOptimizer::Traffic ShardedOptimizer::traffic() const {
  Traffic t;
  const auto others = static_cast<std::size_t>(impl_->ranks - 1);
  if (others == 0) return t;
  t.grad_reduce_scatter = others * static_cast<std::size_t>(impl_->count) * comm_type_size(impl_->sharded.grad_type);
  t.weight_all_gather = others * impl_->weight_block;
  if (const detail::Shard* s = detail_access::engine(*impl_->inner).shard()) t.step_partials = others * s->bytes_per_step();
  return t;
}

}  // namespace stepfuse
