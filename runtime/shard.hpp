// The sharded step (OptimizerOptions::communicator): how each rank's reduce pass
// joins the others' into the one-process step's reduction, and the collective
// checks at construction. docs/distributed.md explains the design.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/cpu/kernels.hpp"
#include "stepfuse/distributed.hpp"
#include "stepfuse/optimizer.hpp"

namespace stepfuse::detail {

// `comm` for host buffers: itself when its device is the CPU, else a communicator
// that copies host buffers to its device and back around each collective (and
// waits for it): for the few small collectives of construction and checkpoints,
// never a step's (runtime/cuda/cuda_staging.cpp).
std::shared_ptr<Communicator> host_communicator(std::shared_ptr<Communicator> comm);

// An exception's message without the "stepfuse: " an Error's starts with (to quote
// it in another message).
std::string message_of(const std::exception& e);

// A rank's outcome of its own part of a collective operation (its checks), sent in
// that operation's all_gather, before anything changes: plain bytes, zero-filled, so
// every rank's copy prints the same. The first member of the operation's record.
struct RankStatus {
  std::int32_t ok = 0;    // 1: this rank's part succeeded
  std::int32_t code = 0;  // else its Error's ErrorCode (invalid_state for another exception)
  char message[440] = {};
  // ok when `error` is null, else its code and message.
  static RankStatus of(const std::exception_ptr& error);
};
static_assert(sizeof(RankStatus) == 448);

// After the all_gather of every rank's record (`status` its RankStatus): returns when
// every rank succeeded. Otherwise every rank throws: a rank that failed rethrows its
// own `error`; the others throw an Error with the code of the first rank that failed,
// "<who>: rank r of n <failed>: <that rank's message>".
template <class Record>
void throw_if_any_failed(const std::vector<Record>& all, const std::exception_ptr& error, std::string_view who,
                         std::string_view failed);
[[noreturn]] void throw_rank_failed(const RankStatus& status, std::size_t rank, std::size_t ranks, std::string_view who,
                                    std::string_view failed);
template <class Record>
void throw_if_any_failed(const std::vector<Record>& all, const std::exception_ptr& error, std::string_view who,
                         std::string_view failed) {
  if (error) std::rethrow_exception(error);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (!all[r].status.ok) throw_rank_failed(all[r].status, r, all.size(), who, failed);
}

// One rank's view of the model: where its chunks' partials go in the canonical
// order. Every rank holds the same plan of the whole model (its tensors in order,
// each tensor's chunks in order, wherever they live), so every rank combines the
// gathered partials exactly as one process combines its own: the same bits.
class Shard {
 public:
  // Construction is collective: every rank calls exactly one of these two, once.
  // refuse(): this rank's own construction threw `error`; tells the others (they
  // throw an Error naming this rank), then returns so the caller rethrows `error`.
  static void refuse(const OptimizerOptions& options, const std::exception_ptr& error);
  // This rank's construction succeeded: exchanges every rank's status, options and
  // tensors, and checks them together. Throws the same Error on every rank when
  // any rank refused, the options differ, or the slices do not tile the model.
  // two_phase[i]: param i runs a two-phase program (its tensor cannot be split).
  Shard(const OptimizerOptions& options, const std::vector<Param>& params, const std::vector<bool>& two_phase);

  struct Reduction {
    bool found_inf = false;  // on any rank
    double norm = 0;         // of the whole model's gradients as stored
  };
  // The step's collective: this rank's chunk partials (its layout's chunks, in
  // order) in; the model's reduction out, and each local param's model-tensor norm
  // in tensor_norms. Throws Error(invalid_argument) on every rank when some rank
  // refused its step (refuse_step) — before anything was written anywhere.
  Reduction combine(std::span<const cpu::ReducePartial> partials, bool inf_norm, std::vector<double>& tensor_norms);
  // This rank refuses the step's input: it makes the step's collective with a
  // flag that makes every other rank throw, so none of them waits for it.
  void refuse_step();
  // What every other rank throws when rank `rank` refused its step.
  [[noreturn]] static void throw_refused(std::size_t rank);

  // The step's plan as tables, for a backend that combines on the device (CUDA,
  // jit/cuda/kernels/shard_kernel.cuh): the same sends and the same order as combine().
  struct DevicePlan {
    std::vector<long long> send_at;       // per local param: its first value in the send
    std::vector<int> send_whole;          // per local param: 1: one value, its chunks' combine
    std::vector<std::uint32_t> order;     // positions in the gathered values, in canonical order
    std::vector<long long> tensor_begin;  // per model tensor, and one past the last
    std::vector<int> local_tensor;        // per local param: its model tensor
    std::size_t stride = 0;               // doubles per rank; the last two: found_inf, refused
    std::size_t ranks = 0;
  };
  DevicePlan device_plan() const;

  // The communicator for host buffers (construction, checkpoints): the step's own,
  // or for a communicator of device memory, one that stages through it.
  Communicator& communicator() const { return *host_comm_; }
  // The step's own communicator (device memory for a CUDA step's).
  Communicator& device_communicator() const { return *comm_; }
  // Bytes each rank contributes to the step's collective (all ranks get size() times it).
  std::size_t bytes_per_step() const { return stride_ * sizeof(double); }
  std::size_t model_tensors() const { return tensor_begin_.size() - 1; }

  // Checkpoints (runtime/checkpoint.cpp): the model's tensors in order (each one's
  // id, as the ranks named it, and its element count), and where local param i lies.
  struct ModelTensor {
    std::int64_t id = 0, numel = 0;
  };
  const std::vector<ModelTensor>& tensors() const { return tensors_; }
  const ModelTensor& tensor_of(std::size_t param) const { return tensors_[local_tensor_[param]]; }
  std::int64_t offset_of(std::size_t param) const { return local_offset_[param]; }
  // Local param i's first element in the whole model (every model tensor's elements in order).
  std::int64_t model_index_of(std::size_t param) const;

 private:
  // What a local param sends: its tensor's combined value (a whole model tensor)
  // or each of its chunks' partials (a slice of a split one), at send_[at...].
  struct SendPlan {
    std::size_t first_chunk = 0, chunks = 0;  // in this rank's layout
    std::size_t at = 0;
    bool whole = false;
  };
  std::shared_ptr<Communicator> comm_;       // the step's collective
  std::shared_ptr<Communicator> host_comm_;  // host buffers (communicator())
  std::vector<SendPlan> send_plan_;            // per local param
  std::size_t stride_ = 0;                    // doubles per rank: the most values a rank sends, found_inf, refused
  std::vector<double> send_, recv_;
  std::vector<std::uint32_t> order_;          // positions in recv_, the model's chunks in canonical order
  std::vector<std::size_t> tensor_begin_;     // model tensor t: order_[tensor_begin_[t], tensor_begin_[t + 1])
  std::vector<std::size_t> local_tensor_;     // local param i: its model tensor
  std::vector<double> tensor_norms_;          // per model tensor (scratch)
  std::vector<ModelTensor> tensors_;          // per model tensor
  std::vector<std::int64_t> local_offset_;    // local param i: its first element in its model tensor
};

}  // namespace stepfuse::detail
