// The sharded step's plan and its one collective per step (runtime/shard.hpp).
//
// Construction, round 1: every rank's status (its own construction succeeded, or
// its Error's code and message) and the options that must agree. Round 2 (when
// every rank succeeded): every rank's tensors, as (model tensor, offset, numel,
// two-phase). From these each rank builds the same plan of the whole model.
//
// A step: one all_gather, then each rank combines what it got in the canonical
// order (fp64; chunks in order within a tensor, then tensors in order) — the
// one-process combine over the whole model, bit for bit. Each rank sends, per
// param in its order: for a whole model tensor, the tensor's own combine of its
// chunks (one value: the same additions in the same order as one process makes);
// for a slice of a split tensor, one value per chunk (the chunk's sum of squares,
// or its max |g| for the inf-norm), since the tensor's sum runs across ranks. Then
// its found_inf flag and a refused flag; padded to the largest rank's count.
#include "runtime/shard.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "jit/base/format.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::detail {

namespace {

// Round 1: one rank's status and the options every rank must share. Plain bytes,
// zero-filled, so every rank's copy compares and prints the same.
struct Header {
  RankStatus status;  // this rank's construction
  std::int64_t params = 0;
  std::int32_t slices = 0;  // 1: OptimizerOptions::slices given
  std::int32_t fusion = 0;
  std::int32_t track_grad_norm = 0;
  std::int32_t device = 0;
  double max_grad_norm = 0;  // 0: no clipping
  double norm_type = 0;
  std::int32_t master_weights = 0;
  std::int32_t stochastic_rounding = 0;  // 0: off; 1: on; 2: on, and this rank has a bf16 weight
  std::uint64_t seed = 0;
  std::int32_t compensated_weights = 0;  // 0: off; 1: on; 2: on, and this rank has a bf16 weight
  std::int32_t state_format = 0;
  std::int64_t min_q8_numel = 0;
  std::uint64_t state_formats = 0;  // a hash of OptimizerOptions::state_formats, in its order
  std::int32_t stochastic_state_rounding = 0;  // with stochastic_rounding only
  std::int32_t zero = 0;                       // (the struct's tail, sent as zero)
};
static_assert(sizeof(Header) == sizeof(RankStatus) + 24 + 16 + 16 + 8 + 16 + 8, "no padding: every byte sent is set");

// Round 2: one param.
struct Entry {
  std::int64_t tensor, offset, numel, two_phase;
};
static_assert(sizeof(Entry) == 4 * sizeof(std::int64_t));

std::int64_t chunks_of(std::int64_t numel) { return (numel + jit::kChunkElems - 1) / jit::kChunkElems; }

std::vector<Header> exchange_headers(Communicator& comm, const Header& mine) {
  std::vector<Header> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather(&mine, all.data(), sizeof(Header), CommType::u8);
  return all;
}

std::string rank_param(std::size_t rank, std::int64_t param) {
  return "rank " + std::to_string(rank) + " params[" + std::to_string(param) + "]";
}

std::string describe_max_norm(double v) { return v > 0 ? format_number(v) : std::string("none"); }

// The options every rank must share, or the Error (the same on every rank).
void check_same_options(const std::vector<Header>& all) {
  const Header& a = all[0];
  for (std::size_t r = 1; r < all.size(); ++r) {
    const Header& b = all[r];
    std::string what;
    if (std::memcmp(&a.max_grad_norm, &b.max_grad_norm, sizeof(double)) != 0)
      what = "max_grad_norm (rank 0: " + describe_max_norm(a.max_grad_norm) + ", rank " + std::to_string(r) + ": " +
             describe_max_norm(b.max_grad_norm) + ")";
    else if (a.norm_type != b.norm_type)
      what = "norm_type (rank 0: " + format_number(a.norm_type) + ", rank " + std::to_string(r) + ": " +
             format_number(b.norm_type) + ")";
    else if (a.fusion != b.fusion)
      what = "fusion";
    else if (a.track_grad_norm != b.track_grad_norm)
      what = "track_grad_norm";
    else if (a.device != b.device)
      what = "device";
    else if (a.master_weights != b.master_weights)
      what = "master_weights";
    else if ((a.stochastic_rounding != 0) != (b.stochastic_rounding != 0))
      what = "stochastic_rounding";
    else if ((a.compensated_weights != 0) != (b.compensated_weights != 0))
      what = "compensated_weights";
    else if (a.stochastic_state_rounding != b.stochastic_state_rounding)
      what = "stochastic_state_rounding";
    else if (a.seed != b.seed)
      what = "seed (rank 0: " + std::to_string(a.seed) + ", rank " + std::to_string(r) + ": " + std::to_string(b.seed) +
             "; stochastic rounding draws every rank's bits from one seed)";
    else if (a.state_format != b.state_format)
      what = "state_format (rank 0: " + std::string(state_format_name(static_cast<StateFormat>(a.state_format))) +
             ", rank " + std::to_string(r) + ": " + std::string(state_format_name(static_cast<StateFormat>(b.state_format))) +
             ")";
    else if (a.state_formats != b.state_formats)
      what = "state_formats (the per-stream formats: the same names and formats, in the same order, on every rank)";
    else if (a.min_q8_numel != b.min_q8_numel)
      what = "min_q8_numel (rank 0: " + std::to_string(a.min_q8_numel) + ", rank " + std::to_string(r) + ": " +
             std::to_string(b.min_q8_numel) + ")";
    else if (a.slices != b.slices)
      what = "slices (given on rank " + std::to_string(a.slices ? 0 : r) + ", empty on rank " +
             std::to_string(a.slices ? r : 0) + ")";
    if (!what.empty())
      throw Error(ErrorCode::invalid_argument, "sharded Optimizer: OptimizerOptions::" + what +
                                                   " differs between ranks (every rank's step must be the same; pass "
                                                   "the same options on every rank)");
  }
  // Stochastic rounding needs a bf16 weight on some rank (a rank may hold f32 weights only).
  if (a.stochastic_rounding != 0 &&
      std::none_of(all.begin(), all.end(), [](const Header& h) { return h.stochastic_rounding == 2; }))
    throw Error(ErrorCode::invalid_argument,
                "sharded Optimizer: OptimizerOptions::stochastic_rounding is set but no rank has a bf16 weight (f32 "
                "weights are stored exactly; there is nothing to round: leave stochastic_rounding off)");
  if (a.compensated_weights != 0 &&
      std::none_of(all.begin(), all.end(), [](const Header& h) { return h.compensated_weights == 2; }))
    throw Error(ErrorCode::invalid_argument,
                "sharded Optimizer: OptimizerOptions::compensated_weights is set but no rank has a bf16 weight (f32 "
                "weights are stored exactly; there is nothing to compensate: leave compensated_weights off)");
}

Header local_header(const OptimizerOptions& o) {
  Header h;
  h.slices = o.slices.empty() ? 0 : 1;
  h.fusion = static_cast<std::int32_t>(o.fusion);
  h.track_grad_norm = o.track_grad_norm ? 1 : 0;
  h.device = static_cast<std::int32_t>(o.device.kind);
  h.max_grad_norm = o.max_grad_norm.value_or(0.0);
  h.norm_type = o.norm_type;
  h.master_weights = o.master_weights ? 1 : 0;
  h.stochastic_rounding = o.stochastic_rounding ? 1 : 0;
  h.seed = o.stochastic_rounding ? o.seed : 0;
  h.stochastic_state_rounding = o.stochastic_rounding && o.stochastic_state_rounding ? 1 : 0;
  h.compensated_weights = o.compensated_weights ? 1 : 0;
  h.state_format = static_cast<std::int32_t>(o.state_format);
  h.min_q8_numel = o.min_q8_numel;
  std::uint64_t hash = 14695981039346656037ull;  // FNV-1a over each name, its terminator and its format
  const auto mix = [&hash](unsigned char byte) { hash = (hash ^ byte) * 1099511628211ull; };
  for (const auto& [name, format] : o.state_formats) {
    for (char c : name) mix(static_cast<unsigned char>(c));
    mix(0);
    mix(static_cast<unsigned char>(format));
  }
  h.state_formats = hash;
  return h;
}

}  // namespace

std::string message_of(const std::exception& e) {
  std::string_view m = e.what();
  if (m.starts_with("stepfuse: ")) m.remove_prefix(10);
  return std::string(m);
}

RankStatus RankStatus::of(const std::exception_ptr& error) {
  RankStatus s;
  if (!error) {
    s.ok = 1;
    return s;
  }
  s.code = static_cast<std::int32_t>(ErrorCode::invalid_state);
  std::string msg = "unknown error";
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    s.code = static_cast<std::int32_t>(e.code());
    msg = message_of(e);
  } catch (const std::exception& e) {
    msg = message_of(e);
  } catch (...) {
  }
  std::strncpy(s.message, msg.c_str(), sizeof(s.message) - 1);
  return s;
}

void throw_rank_failed(const RankStatus& status, std::size_t rank, std::size_t ranks, std::string_view who,
                       std::string_view failed) {
  throw Error(static_cast<ErrorCode>(status.code),
              std::string(who) + ": rank " + std::to_string(rank) + " of " + std::to_string(ranks) + " " +
                  std::string(failed) + ": " + std::string(status.message, strnlen(status.message, sizeof(status.message))));
}

void Shard::refuse(const OptimizerOptions& options, const std::exception_ptr& error) {
  Header h = local_header(options);
  h.status = RankStatus::of(error);
  // The others throw; the caller rethrows `error`. When the exchange itself cannot be
  // made (a communicator of a device this process cannot use, a failing transport),
  // `error` is still the one to report: the others' collective fails or times out on
  // their side, as with a rank that died.
  try {
    exchange_headers(*host_communicator(options.communicator), h);
  } catch (const std::exception&) {
  }
}

Shard::Shard(const OptimizerOptions& options, const std::vector<Param>& params, const std::vector<bool>& two_phase)
    : comm_(options.communicator), host_comm_(host_communicator(options.communicator)) {
  Communicator& comm = *host_comm_;
  const int self = comm.rank();
  const auto ranks = static_cast<std::size_t>(comm.size());

  Header mine = local_header(options);
  mine.status = RankStatus::of(nullptr);
  mine.params = static_cast<std::int64_t>(params.size());
  const bool any_bf16 =
      std::any_of(params.begin(), params.end(), [](const Param& p) { return p.weight.dtype == DType::bf16; });
  if (options.stochastic_rounding && any_bf16) mine.stochastic_rounding = 2;
  if (options.compensated_weights && any_bf16) mine.compensated_weights = 2;
  const std::vector<Header> all = exchange_headers(comm, mine);
  throw_if_any_failed(all, nullptr, "sharded Optimizer", "could not build its shard, so no rank builds one");
  check_same_options(all);

  // Round 2: every rank's tensors.
  std::size_t max_params = 0;
  std::vector<std::int64_t> first_tensor(ranks + 1, 0);  // without slices: rank r's params are tensors first_tensor[r] + i
  for (std::size_t r = 0; r < ranks; ++r) {
    max_params = std::max(max_params, static_cast<std::size_t>(all[r].params));
    first_tensor[r + 1] = first_tensor[r] + all[r].params;
  }
  std::vector<Entry> entries(max_params, Entry{0, 0, 0, 0});
  for (std::size_t i = 0; i < params.size(); ++i) {
    const bool sliced = !options.slices.empty();
    entries[i] = Entry{sliced ? options.slices[i].tensor : first_tensor[static_cast<std::size_t>(self)] + static_cast<std::int64_t>(i),
                       sliced ? options.slices[i].offset : 0, params[i].weight.numel, two_phase[i] ? 1 : 0};
  }
  std::vector<Entry> every(ranks * max_params);
  if (max_params > 0) comm.all_gather(entries.data(), every.data(), max_params * 4, CommType::i64);

  // The model: every rank's params, ordered by (tensor, offset).
  struct Piece {
    Entry e;
    std::size_t rank;
    std::int64_t param;
    std::size_t first_chunk;  // within its rank's layout
  };
  std::vector<Piece> pieces;
  for (std::size_t r = 0; r < ranks; ++r) {
    std::size_t chunk = 0;
    for (std::int64_t i = 0; i < all[r].params; ++i) {
      const Entry& e = every[r * max_params + static_cast<std::size_t>(i)];
      pieces.push_back({e, r, i, chunk});
      chunk += static_cast<std::size_t>(chunks_of(e.numel));
    }
  }
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.e.tensor != b.e.tensor ? a.e.tensor < b.e.tensor : a.e.offset < b.e.offset;
  });
  // Whole model tensors send one value; slices of split ones one per chunk.
  const auto whole = [&](std::size_t k) {
    return (k == 0 || pieces[k - 1].e.tensor != pieces[k].e.tensor) &&
           (k + 1 == pieces.size() || pieces[k + 1].e.tensor != pieces[k].e.tensor);
  };
  std::vector<std::vector<std::size_t>> values_at(ranks);  // per rank, per param: its first value in the rank's send
  std::vector<std::size_t> values(ranks, 0);
  for (std::size_t r = 0; r < ranks; ++r) values_at[r].assign(static_cast<std::size_t>(all[r].params), 0);
  {
    std::vector<std::vector<std::size_t>> count(ranks);  // per rank, per param
    for (std::size_t r = 0; r < ranks; ++r) count[r].assign(static_cast<std::size_t>(all[r].params), 0);
    for (std::size_t k = 0; k < pieces.size(); ++k)
      count[pieces[k].rank][static_cast<std::size_t>(pieces[k].param)] =
          whole(k) ? 1 : static_cast<std::size_t>(chunks_of(pieces[k].e.numel));
    for (std::size_t r = 0; r < ranks; ++r)
      for (std::size_t i = 0; i < count[r].size(); ++i) {
        values_at[r][i] = values[r];
        values[r] += count[r][i];
      }
  }
  stride_ = *std::max_element(values.begin(), values.end()) + 2;
  send_.assign(stride_, 0.0);
  recv_.assign(stride_ * ranks, 0.0);
  send_plan_.assign(params.size(), SendPlan{});
  {
    std::size_t chunk = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      send_plan_[i].first_chunk = chunk;
      send_plan_[i].chunks = static_cast<std::size_t>(chunks_of(params[i].weight.numel));
      send_plan_[i].at = values_at[static_cast<std::size_t>(self)][i];
      chunk += send_plan_[i].chunks;
    }
  }
  std::vector<std::size_t> model_tensor_of(pieces.size());
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const Piece& p = pieces[k];
    const bool first = k == 0 || pieces[k - 1].e.tensor != p.e.tensor;
    const std::string where = "sharded Optimizer: model tensor " + std::to_string(p.e.tensor) + ": " + rank_param(p.rank, p.param);
    if (p.e.offset < 0 || p.e.offset % kShardAlign != 0)
      throw Error(ErrorCode::invalid_argument, where + " starts at element " + std::to_string(p.e.offset) +
                                                   " (a slice must start at a multiple of " + std::to_string(kShardAlign) +
                                                   " elements, the reduce pass's chunk)");
    if (first) {
      if (p.e.offset != 0)
        throw Error(ErrorCode::invalid_argument, where + " starts at element " + std::to_string(p.e.offset) +
                                                     " but no rank holds elements [0, " + std::to_string(p.e.offset) +
                                                     ") of that tensor (its slices must tile it)");
      tensor_begin_.push_back(order_.size());
      tensors_.push_back({p.e.tensor, 0});
    } else {
      const Piece& q = pieces[k - 1];
      const std::int64_t end = q.e.offset + q.e.numel;
      if (p.e.offset < end)
        throw Error(ErrorCode::invalid_argument, where + " (elements [" + std::to_string(p.e.offset) + ", " +
                                                     std::to_string(p.e.offset + p.e.numel) + ")) overlaps " +
                                                     rank_param(q.rank, q.param) + " ([" + std::to_string(q.e.offset) +
                                                     ", " + std::to_string(end) + "))");
      if (p.e.offset > end)
        throw Error(ErrorCode::invalid_argument, where + " starts at element " + std::to_string(p.e.offset) +
                                                     " but no rank holds elements [" + std::to_string(end) + ", " +
                                                     std::to_string(p.e.offset) + ") of that tensor (its slices must tile it)");
      if ((p.e.two_phase || q.e.two_phase) && p.e.numel > 0 && end > 0)  // (empty pieces split nothing)
        throw Error(ErrorCode::unsupported,
                    where + ": the tensor is split across ranks, but its program has two phases (a per-tensor "
                            "norm inside the update, as LAMB's trust ratio): give each rank whole tensors for it");
    }
    model_tensor_of[k] = tensor_begin_.size() - 1;
    tensors_.back().numel = p.e.offset + p.e.numel;
    const std::size_t at = p.rank * stride_ + values_at[p.rank][static_cast<std::size_t>(p.param)];
    if (whole(k)) {
      order_.push_back(static_cast<std::uint32_t>(at));
      if (p.rank == static_cast<std::size_t>(self)) send_plan_[static_cast<std::size_t>(p.param)].whole = true;
    } else {
      for (std::int64_t c = 0; c < chunks_of(p.e.numel); ++c) order_.push_back(static_cast<std::uint32_t>(at + static_cast<std::size_t>(c)));
    }
  }
  tensor_begin_.push_back(order_.size());
  tensor_norms_.assign(tensor_begin_.size() - 1, 0.0);
  local_tensor_.assign(params.size(), 0);
  local_offset_.assign(params.size(), 0);
  for (std::size_t k = 0; k < pieces.size(); ++k)
    if (pieces[k].rank == static_cast<std::size_t>(self)) {
      local_tensor_[static_cast<std::size_t>(pieces[k].param)] = model_tensor_of[k];
      local_offset_[static_cast<std::size_t>(pieces[k].param)] = pieces[k].e.offset;
    }
}

Shard::Reduction Shard::combine(std::span<const cpu::ReducePartial> partials, bool inf_norm,
                                std::vector<double>& tensor_norms) {
  bool local_inf = false;
  for (const cpu::ReducePartial& p : partials) local_inf |= p.nonfinite;
  const auto value = [&](std::size_t c) { return inf_norm ? static_cast<double>(partials[c].maxabs) : partials[c].sumsq; };
  for (const SendPlan& p : send_plan_) {
    if (p.whole) {  // the tensor's combine, as below
      double acc = 0;
      for (std::size_t c = p.first_chunk; c < p.first_chunk + p.chunks; ++c) acc = inf_norm ? std::max(acc, value(c)) : acc + value(c);
      send_[p.at] = acc;
    } else {
      for (std::size_t c = 0; c < p.chunks; ++c) send_[p.at + c] = value(p.first_chunk + c);
    }
  }
  const std::size_t flags = stride_ - 2;
  send_[flags] = local_inf ? 1.0 : 0.0;
  send_[flags + 1] = 0.0;
  comm_->all_gather(send_.data(), recv_.data(), stride_, CommType::f64);

  Reduction r;
  const std::size_t ranks = recv_.size() / stride_;
  for (std::size_t k = 0; k < ranks; ++k) {
    if (recv_[k * stride_ + flags + 1] != 0.0) throw_refused(k);
    r.found_inf |= recv_[k * stride_ + flags] != 0.0;
  }
  double total = 0;
  for (std::size_t t = 0; t + 1 < tensor_begin_.size(); ++t) {
    double acc = 0;
    for (std::size_t k = tensor_begin_[t]; k < tensor_begin_[t + 1]; ++k)
      acc = inf_norm ? std::max(acc, recv_[order_[k]]) : acc + recv_[order_[k]];
    tensor_norms_[t] = inf_norm ? acc : std::sqrt(acc);
    total = inf_norm ? std::max(total, acc) : total + acc;
  }
  r.norm = inf_norm ? total : std::sqrt(total);
  tensor_norms.resize(local_tensor_.size());
  for (std::size_t i = 0; i < local_tensor_.size(); ++i) tensor_norms[i] = tensor_norms_[local_tensor_[i]];
  return r;
}

std::int64_t Shard::model_index_of(std::size_t param) const {
  std::int64_t index = local_offset_[param];
  for (std::size_t t = 0; t < local_tensor_[param]; ++t) index += tensors_[t].numel;
  return index;
}

void Shard::refuse_step() {
  std::fill(send_.begin(), send_.end(), 0.0);
  send_[stride_ - 1] = 1.0;
  comm_->all_gather(send_.data(), recv_.data(), stride_, CommType::f64);
}

void Shard::throw_refused(std::size_t rank) {
  throw Error(ErrorCode::invalid_argument,
              "sharded step: rank " + std::to_string(rank) +
                  " refused its input to this step (its own Error says why), so no rank took the step: nothing was "
                  "written");
}

Shard::DevicePlan Shard::device_plan() const {
  DevicePlan p;
  for (const SendPlan& s : send_plan_) {
    p.send_at.push_back(static_cast<long long>(s.at));
    p.send_whole.push_back(s.whole ? 1 : 0);
  }
  p.order = order_;
  p.tensor_begin.assign(tensor_begin_.begin(), tensor_begin_.end());
  p.local_tensor.assign(local_tensor_.begin(), local_tensor_.end());
  p.stride = stride_;
  p.ranks = recv_.size() / stride_;
  return p;
}

}  // namespace stepfuse::detail
