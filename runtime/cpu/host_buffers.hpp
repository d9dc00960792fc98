// What every CPU backend holds for a step: HostBuffers (the layout of the tensor
// list, its split among the threads, the state streams and fp32 masters, each
// tensor's kernel arguments, and the reduce pass that combines chunk partials in
// the canonical order, docs/architecture.md §5), and HostBackend, the CPU
// backends' common base over them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "jit/layout.hpp"
#include "runtime/aligned_buffer.hpp"
#include "runtime/backend.hpp"
#include "runtime/cpu/kernels.hpp"
#include "runtime/thread_pool.hpp"
#include "stepfuse/optimizer.hpp"
#include "stepfuse/program.hpp"

namespace stepfuse::detail {
class Shard;
}

namespace stepfuse::cpu {

// The streams a program stores, as masks by stream index: in a two-phase
// program's phase 1, and in the update (phase 2, or the whole of a one-phase
// program). What HostBuffers::stage() encodes back after each.
struct StoredStreams {
  unsigned phase1 = 0, update = 0;
};
StoredStreams stored_streams(const Program& p);

// How a step's store rounds a bf16 state stream: to nearest even, or (the state of a
// tensor whose weights round stochastically, under
// OptimizerOptions::stochastic_state_rounding) stochastically, with the bits of
// sf_sr_state_step(step, stream) for model elements first, first + 1, ...
struct StateRounding {
  bool stochastic = false;
  std::uint64_t seed = 0, step = 0, first = 0;
};

class HostBuffers {
 public:
  // Plans the list, picks the thread count (OptimizerOptions::num_threads, or
  // fewer threads for small lists), allocates the state buffers (each tensor's
  // filled with its group's initial value) and the masters (widened from the
  // weights), in parallel, by the threads that will use them. Each tensor's args
  // point into them, and their scalars at scalars[its group].
  HostBuffers(const detail::StepPrograms& programs, const std::vector<Param>& params, const OptimizerOptions& options,
              const float (*scalars)[kMaxScalars]);

  const jit::Layout& layout() const { return layout_; }
  detail::ThreadPool& pool() const { return *pool_; }
  float* state(int buffer) const { return state_[buffer].data(); }  // by StepPrograms::state_names
  // Where tensor t keeps buffer b, and how (StepPrograms::formats).
  const detail::StateSlot& slot(int buffer, std::size_t t) const { return slots_[static_cast<std::size_t>(buffer)][t]; }
  float* masters() const { return masters_.data(); }
  const std::vector<UpdateArgs>& args() const { return args_; }
  // Points every tensor's args at its (moved) gradient.
  void set_grads(const std::vector<Param>& params) {
    for (std::size_t i = 0; i < args_.size(); ++i) args_[i].grad = params[i].grad.data;
  }

  // ---- state stored as bf16 or q8 ----
  // Whether tensor t keeps some state stream as bf16 or q8. Its args then point at
  // the bf16 streams' bit patterns and have null for the q8 ones, and its updates run
  // through stage() unless a kernel reads that storage itself.
  bool staged(std::size_t t) const { return !staged_[t].empty(); }
  struct StagedStream {
    int stream = 0;  // the program's stream index
    detail::StateSlot slot;
  };
  const std::vector<StagedStream>& staged_streams(std::size_t t) const { return staged_[t]; }  // in stream order
  // Runs fn(args, n) over elements [begin, begin + len) of tensor t (begin a
  // multiple of kQ8Block) in runs of at most `run` elements (a multiple of kQ8Block,
  // at most kChunkElems): each run's args are `a` with every pointer advanced to the
  // run's first element (so fn works on elements [0, n); sr_base advanced too; the
  // gradient by grad_size bytes an element, as `a` holds it), and each bf16 or q8
  // stream decoded into fp32 scratch of thread `thread`. After fn, the streams in
  // the `stored` mask (by program stream index) are encoded back: a stream only
  // loaded keeps its bytes exactly.
  template <class F>
  void stage(const UpdateArgs& a, std::size_t t, std::size_t begin, std::size_t len, std::size_t run, unsigned stored,
             std::size_t grad_size, int thread, F&& fn) const {
    float* scratch = scratch_.data() + static_cast<std::size_t>(thread) * scratch_per_thread_;
    const std::vector<StagedStream>& streams = staged_[t];
    for (std::size_t at = begin; at < begin + len; at += run) {
      const std::size_t n = std::min(run, begin + len - at);
      UpdateArgs r = advanced(a, t, at, grad_size);
      for (std::size_t k = 0; k < streams.size(); ++k) {
        decode(streams[k].slot, at, n, scratch + k * kChunkElems);
        r.state[streams[k].stream] = scratch + k * kChunkElems;
      }
      fn(r, n);
      for (std::size_t k = 0; k < streams.size(); ++k)
        if (stored & (1u << streams[k].stream))
          encode(scratch + k * kChunkElems, streams[k].slot, at, n, rounding(t, at, streams[k].stream));
    }
  }
  // Tensor t's rounding of `stream` for a store from its element `at` on.
  StateRounding rounding(std::size_t t, std::size_t at, int stream) const;
  // Elements [at, at + n) of a bf16 or q8 slot to fp32 and back (at a multiple of kQ8Block).
  static void decode(const detail::StateSlot& s, std::size_t at, std::size_t n, float* dst);
  static void encode(const float* src, const detail::StateSlot& s, std::size_t at, std::size_t n,
                     const StateRounding& rounding = {});

  // Calls body(chunk, thread) for every chunk of the layout, each thread its own
  // run of them.
  template <class F>
  void for_chunks(F&& body) const {
    pool_->run([&](int t) {
      const auto u = static_cast<std::size_t>(t);
      for (std::size_t c = thread_chunks_[u]; c < thread_chunks_[u + 1]; ++c) body(c, t);
    });
  }

  // The reduce pass: partial(c) for every chunk c, then the combine in the
  // canonical order (fp64, chunks in order within a tensor, then tensors in
  // order). Writes each tensor's norm of the gradients as stored to tensor_norms.
  // Sharded (set_shard): the combine is over every rank's partials, the whole
  // model's (runtime/shard.hpp), one collective; tensor_norms are then the norms
  // of the model tensors the local params are slices of.
  struct Reduction {
    bool found_inf = false;
    double norm = 0;  // of the gradients as stored (not yet divided by the loss scale)
  };
  template <class Partial>
  Reduction reduce(Partial&& partial, bool inf_norm, std::vector<double>& tensor_norms) {
    return reduce_groups(
        [&](std::size_t c, std::size_t, ReducePartial* out) {
          out[0] = partial(c);
          return std::size_t{1};
        },
        inf_norm, tensor_norms);
  }
  // The same, where group(c, end, out) takes chunks c, c + 1, ... (all before `end`,
  // the end of this thread's run) at once: it writes their partials to out[0], out[1],
  // ... and returns how many it took (at least 1).
  template <class Group>
  Reduction reduce_groups(Group&& group, bool inf_norm, std::vector<double>& tensor_norms) {
    pool_->run([&](int t) {
      const auto u = static_cast<std::size_t>(t);
      for (std::size_t c = thread_chunks_[u], end = thread_chunks_[u + 1]; c < end;)
        c += group(c, end, &partials_[c]);
    });
    return combine(inf_norm, tensor_norms);
  }
  // Sharded: the combine is every rank's, and stochastic rounding counts elements
  // by their index in the whole model.
  void set_shard(detail::Shard* shard);
  // Stochastic rounding: tensor t's step (its group's, the Philox counter's high half).
  void set_rounding_step(std::size_t t, std::int64_t step) { args_[t].sr_step = static_cast<std::uint64_t>(step); }
  // The first stored gradient of a chunk.
  const void* grad_at(const jit::Chunk& ch, const std::vector<Param>& params) const {
    const TensorView& g = params[ch.tensor].grad;
    return static_cast<const char*>(g.data) + ch.begin * static_cast<std::int64_t>(dtype_size(g.dtype));
  }

 private:
  Reduction combine(bool inf_norm, std::vector<double>& tensor_norms) const;

  // `a` with its pointers advanced to element `at` of tensor t (state streams that
  // are null stay null).
  UpdateArgs advanced(const UpdateArgs& a, std::size_t t, std::size_t at, std::size_t grad_size) const;
  void allocate_state(const detail::StepPrograms& programs, const std::vector<Param>& params);

  jit::Layout layout_;
  bool stochastic_state_ = true;                       // OptimizerOptions::stochastic_state_rounding
  std::vector<std::vector<detail::StateSlot>> slots_;  // per buffer, per tensor
  std::vector<detail::AlignedBuffer> absmax_;          // per buffer: its q8 tensors' absmaxes
  std::vector<std::vector<StagedStream>> staged_;      // per tensor: its bf16 and q8 streams
  detail::AlignedBuffer scratch_;                      // per thread: kChunkElems floats per staged stream
  std::size_t scratch_per_thread_ = 0;
  std::vector<std::size_t> thread_chunks_;  // thread t runs chunks [thread_chunks_[t], thread_chunks_[t + 1])
  detail::ThreadPool* pool_ = nullptr;
  std::vector<detail::AlignedBuffer> state_;  // by StepPrograms::state_names
  detail::AlignedBuffer masters_;
  std::vector<UpdateArgs> args_;
  std::vector<ReducePartial> partials_;  // one per chunk
  detail::Shard* shard_ = nullptr;       // the engine's, when sharded
};

// What the CPU backends have in common: the host buffers, the step's scalars
// per group (which every tensor's args point at), the step count, and the views
// of them.
class HostBackend : public detail::Backend {
 public:
  HostBackend(const detail::StepPrograms& programs, const std::vector<Param>& params, const OptimizerOptions& options)
      : params_(params), options_(options), programs_(programs),
        scalars_(std::make_unique<float[][kMaxScalars]>(programs.groups.size())),
        host_(programs, params, options, scalars_.get()) {}

  StepResult read_result(std::vector<double>*) const override { return {}; }  // never pending
  std::int64_t step_count() const override { return step_count_; }
  void set_step_count(std::int64_t n) override { step_count_ = n; }
  const jit::Layout& layout() const override { return host_.layout(); }
  float* state_data(int stream) const override { return host_.state(stream); }
  detail::StateSlot state_slot(int stream, std::size_t tensor) const override { return host_.slot(stream, tensor); }
  float* masters_data() const override { return host_.masters(); }
  int threads() const override { return host_.pool().size(); }
  // The reduce pass reads params_ (the engine's, already updated); the update, the args.
  void set_grads(const std::vector<Param>& params) override { host_.set_grads(params); }
  void set_shard(detail::Shard* shard) override { host_.set_shard(shard); }

 protected:
  // The scalar stage's last part: every group's scalars for applying global step
  // `step` with the gradient multiplier gscale (jit/step_scalars.h), and with
  // stochastic rounding, every tensor's step for its random bits (its group's step,
  // the t its scalars see).
  void eval_scalars(const detail::StepRequest& request, std::int64_t step, double gscale) {
    for (std::size_t g = 0; g < programs_.groups.size(); ++g)
      sf_eval_scalars(request.groups[g].rules, programs_.groups[g].program->num_scalars,
                      step - request.groups[g].step_base, gscale, scalars_[g]);
    if (options_.stochastic_rounding)
      for (std::size_t t = 0; t < params_.size(); ++t)
        host_.set_rounding_step(t, step - request.groups[programs_.tensor_group[t]].step_base);
  }

  const std::vector<Param>& params_;  // the engine's, which outlives the backend
  const OptimizerOptions& options_;
  const detail::StepPrograms& programs_;  // the engine's
  std::unique_ptr<float[][kMaxScalars]> scalars_;  // per group: the step's scalars
  HostBuffers host_;
  std::int64_t step_count_ = 0;
};

}  // namespace stepfuse::cpu
