// ShardedOptimizer: data-parallel training with the optimizer state, the fp32
// masters and the averaged gradients partitioned over the ranks (ZeRO stage 2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "stepfuse/distributed.hpp"
#include "stepfuse/optimizer.hpp"

namespace stepfuse {

class GradScaler;

struct ShardedOptions {
  // The type the gradients travel in through the reduce_scatter:
  //  - CommType::f32 (the default): each rank's gradients are widened to fp32 (exact)
  //    and summed in fp32. With a communicator that sums in a fixed order (the
  //    in-process one of the tests; MPI libraries with a fixed algorithm for a given
  //    size and count) the result is identical run to run, and it is the one-process
  //    step on the fp32 average (see ShardedOptimizer).
  //  - CommType::bf16 or CommType::f16: DeepSpeed's default (its
  //    communication_data_type is the training dtype: fp16 or bf16), half the bytes.
  //    Gradients are rounded to that type (exact when they are stored in it), and the
  //    communicator rounds every partial sum to it (MPI: each pairwise add is done in
  //    fp32 and rounded once). The sum is divided by size() in fp32 afterwards (DeepSpeed
  //    divides before it): an f16 sum beyond 65504 is inf, so the step is skipped as an
  //    overflow, and a GradScaler backs off, as for any overflow.
  // With one rank nothing travels: the gradients are widened, never rounded.
  // Any other type is Error(invalid_argument). Every rank must pass the same.
  CommType grad_type = CommType::f32;
};

// ZeRO-2 data parallelism for the common case: every rank holds the full model (all
// weights) and computes its own full local gradients (its micro-batch); each rank
// keeps the optimizer state, fp32 masters and averaged gradients of its part of the
// model only, and steps that part.
//
//   auto comm = stepfuse::mpi_communicator(MPI_COMM_WORLD);  // or any Communicator
//   stepfuse::ShardedOptimizer opt(stepfuse::optim::AdamW{}, params, comm, options);
//   for (...) {
//     ... forward, backward: this rank's gradients in params[i].grad ...
//     opt.step();  // or opt.step_scaled(S), or opt.step(scaler)
//   }
//
// The partition. The model is every tensor of every group, in order, as one list
// of elements. It is cut into size() contiguous ranges, balanced by element count,
// at chunk boundaries (multiples of kShardAlign elements within a tensor) or at
// tensor boundaries; a tensor of a two-phase program (LAMB) is never cut. Rank r
// owns range r (range(), ranges()): when the model has fewer chunks than there are
// ranks, some ranks own nothing and only join the collectives. Inside, each rank has
// an Optimizer (shard()) over its pieces: the weights are slices of the caller's
// weight tensors (updated in place), the gradients slices of a buffer of this rank
// holding the averaged fp32 gradient of its range. That Optimizer is sharded
// (OptimizerOptions::communicator, ::slices), so the gradient norm, clipping and the
// inf/NaN skip are those of the whole model, on every rank.
//
// A step:
//  1. each rank's gradients are copied (widened or rounded to ShardedOptions::grad_type)
//     into a staging buffer in range order, and one reduce_scatter (sum) gives rank r
//     the sum over the ranks of range r; it is divided by size() in fp32
//     (avg[i] = float(sum[i]) / float(size()), correctly rounded);
//  2. the inner Optimizer steps the range: one reduce pass whose collective is one
//     all_gather of a value per tensor (per chunk of a tensor cut between ranks) and
//     found_inf, giving the global norm and skip decision, then one update pass writing
//     the owned weights (and masters, state) in place;
//  3. if the step was applied, one all_gather of the owned ranges' updated weights, in
//     their own dtypes, as bytes: every rank's weights become the owners'. A skipped
//     step (inf/NaN anywhere) moves no weights, and writes nothing anywhere.
// With size() == 1 there is no reduce_scatter and no all_gather: the gradients are
// widened straight into the averaged buffer.
//
// What a step computes. With grad_type f32 and a communicator whose sum is
// deterministic, the result is bit for bit the one-process Optimizer stepped on the
// fp32 gradients avg = (g_0 + g_1 + ... + g_{R-1}) / R, summed in the communicator's
// order (the in-process test communicator: rank order) and divided once: weights,
// masters, state and StepResult (norm, clip coefficient, found_inf, applied). Summing
// in fp32 and then dividing is within fp32 rounding of the exact average; for a power
// of two R the division is exact. Every rank's weights are identical after every step.
//
// Construction is collective: every rank passes the whole model — the same number
// of groups and tensors, the same sizes and dtypes, the same configs — and the same
// options; its own weight and gradient pointers. The ranks first all_gather a summary
// of their models (sizes, dtypes, group structure, each config's update program and
// scalar rules) and their own local checks; when any rank's model differs from rank
// 0's or any rank's checks fail, every rank throws (naming the rank and what differs)
// and none waits. Then the inner Optimizer is built, collectively as well.
//
// Steps are collective: every rank calls the same step function in the same order.
// A rank that refuses its step's input (a bad loss_scale) makes every rank throw,
// before anything is written. Weights, gradients and the communicator must stay
// valid for the optimizer's lifetime; the caller's gradients are never written.
//
// Memory per rank, beyond the caller's model: a staging buffer of R blocks of the
// largest range, in grad_type (about 4 bytes per model element with f32; none with one
// rank; the weights' all_gather receives into it too), the averaged fp32 gradients of
// its range, the inner Optimizer's state and masters for its range, and a send
// buffer of its range's weight bytes.
//
// Bytes per parameter per step that each rank sends (and receives), with
// bandwidth-optimal (ring) collectives, R ranks, bf16 weights and gradients (traffic()
// gives the exact numbers of a model; tests/sharded_optimizer_test.cpp prints them):
//   this, grad_type f32:   reduce_scatter 4(R-1)/R + all_gather 2(R-1)/R + partials ~0 = 6(R-1)/R
//   this, grad_type bf16:  reduce_scatter 2(R-1)/R + all_gather 2(R-1)/R + partials ~0 = 4(R-1)/R
//   ZeRO-2 as the ZeRO paper counts it (bf16 reduce-scatter + bf16 all-gather):      4(R-1)/R
//   DeepSpeed's ZeRO-2 as configured by default (communication_data_type = the training
//   dtype; each gradient bucket, divided by R first, all-reduced by every rank, which
//   keeps its own part: use_multi_rank_bucket_allreduce): 4(R-1)/R + 2(R-1)/R = 6(R-1)/R;
//   with use_multi_rank_bucket_allreduce off (a reduce to each owner): 4(R-1)/R;
//   with communication_data_type fp32: 8(R-1)/R or 6(R-1)/R.
// The partials are the inner step's all_gather: one 8-byte value per model tensor
// held whole, per 16384-element chunk of a tensor cut between ranks, plus two (under
// 0.001 bytes per parameter for a model of large tensors); both systems also reduce
// a few scalars for the norm and the overflow check. The ranges are padded to the
// largest, which is within one chunk (or one uncut tensor) of N / R.
//
// Not thread-safe: one thread per rank drives it. CPU only: its collectives move host
// memory (a CUDA ZeRO-2 step, over NCCL, is not built yet).
class ShardedOptimizer {
 public:
  // One group. options: as for an Optimizer, except that communicator and slices
  // must be left empty (the ShardedOptimizer sets them: comm, and its partition).
  // Throws (on every rank) Error(invalid_argument) for a null comm, communicator or
  // slices set in options, an invalid ShardedOptions::grad_type, anything an Optimizer
  // over the whole model would reject (an empty list, a null pointer with numel > 0,
  // weight/grad sizes that differ, tensors that share memory, a bad hyperparameter),
  // a model or options that differ between ranks; Error(unsupported) where the
  // sharded step cannot run (a CUDA device or communicator).
  ShardedOptimizer(OptimizerConfig config, std::vector<Param> params, std::shared_ptr<Communicator> comm,
                   OptimizerOptions options = {}, ShardedOptions sharded = {});
  // Parameter groups (as Optimizer's): the model is every group's tensors, group
  // after group. shard()'s groups are these groups, with the same indices (a group
  // this rank owns nothing of holds one empty param there).
  ShardedOptimizer(std::vector<ParamGroup> groups, std::shared_ptr<Communicator> comm, OptimizerOptions options = {},
                   ShardedOptions sharded = {});
  ~ShardedOptimizer();
  ShardedOptimizer(ShardedOptimizer&&) noexcept;
  ShardedOptimizer& operator=(ShardedOptimizer&&) noexcept;
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  // One step on unscaled gradients: as Optimizer::step() on the averaged gradients
  // (with max_grad_norm, clipped by the global norm and skipped when they are not
  // finite; without it, a plain step that checks nothing). Returns the StepResult,
  // the same on every rank.
  StepResult step();
  // One step on gradients scaled by loss_scale (finite, above 2^-128; the same on every rank):
  // as Optimizer::step_scaled on the averaged gradients. Inf/NaN in any rank's
  // gradients (or in the sum) skips the step on every rank: nothing is written.
  StepResult step_scaled(double loss_scale);
  // The step driven by a GradScaler (each rank its own scaler, kept in step by the
  // identical results): reduce_scatter at the scaler's scale, then
  // scaler.step(shard()) (so the scaler records found_inf and its update() backs off
  // or grows as usual), then the all_gather if applied. Returns whether it was applied.
  // Note: scaler.step(opt.shard()) by itself would be wrong (it would step the averaged
  // gradients of the previous step: the gradients must be reduce-scattered first),
  // and so is scaler.unscale_(opt.shard()) — unscale_ is not supported: use
  // max_grad_norm for clipping, which the step does on the unscaled averaged gradients.
  // The scaler's own errors (a second step() before update()) are thrown after the
  // reduce_scatter and before any other collective: every rank must drive its scaler
  // the same way.
  bool step(GradScaler& scaler);

  // The inner Optimizer over this rank's pieces: its params() are the pieces (weights:
  // slices of the caller's; gradients: the averaged buffer), its state() and master()
  // those of the owned elements, its config/lr setters apply to this rank (call them
  // on every rank alike; its groups have the model's indices). Do not step it directly.
  // Checkpoints: every rank's shard().save(path_r) together are one (the ranks' files
  // of a sharded Optimizer); shard().load(path_r) resumes on the same number of ranks,
  // and shard().load_shards(all paths) on any number of ranks, with any groups.
  Optimizer& shard();
  const Optimizer& shard() const;
  // Where each of shard().params() lies in the model (tensor index in the model's
  // order, offset). Each group ends, on every rank, with one empty param of tensor
  // num_tensors() + g: it holds the group's place where the rank owns nothing of it,
  // and carries the group's step count and hyperparameters in checkpoints.
  std::span<const TensorSlice> shard_slices() const;

  // Elements [begin, end) of the model's element list (every tensor in order).
  struct Range {
    std::int64_t begin = 0, end = 0;
    std::int64_t size() const { return end - begin; }
  };
  Range range() const;                      // this rank's
  const std::vector<Range>& ranges() const;  // every rank's, in rank order
  std::size_t num_tensors() const;          // the model's
  std::int64_t num_elements() const;        // the model's (the sum of every tensor's numel)
  Communicator& communicator() const;

  // The bytes this rank sends per step, per collective, with bandwidth-optimal (ring)
  // algorithms: a reduce_scatter or an all_gather of `count` elements per rank sends
  // (and receives) (R - 1) * count elements. count is the largest range (ranges are
  // padded to it). Zero with one rank.
  struct Traffic {
    std::size_t grad_reduce_scatter = 0;  // (R-1) * max range * sizeof(grad_type), every step
    std::size_t weight_all_gather = 0;    // (R-1) * max range's weight bytes, applied steps
    std::size_t step_partials = 0;        // (R-1) * the inner step's per-rank values (8 bytes each),
                                          // steps with a reduce pass (scaled, clipping, track_grad_norm)
    std::size_t total() const { return grad_reduce_scatter + weight_all_gather + step_partials; }
  };
  Traffic traffic() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace stepfuse
