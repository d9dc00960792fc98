// The fused optimizer step: Optimizer and its options.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "stepfuse/distributed.hpp"
#include "stepfuse/optim.hpp"
#include "stepfuse/types.hpp"
#include "stepfuse/update_program.hpp"

namespace stepfuse {

enum class Fusion {
  fused,    // one reduce pass + one update pass per step (one pass for a plain step)
  unfused,  // the eager baseline: unscale, finite check, norm and clip as separate
            // passes over an fp32 gradient temporary (the caller's gradients are never
            // written), then one pass per program op over all tensors, with temporaries
  interpreted,  // the fused pipeline with the update program run by the blocked
                // interpreter (the path of programs known only at run time)
};

// The code that runs a fused step on the CPU. Every choice computes bitwise the
// same results (unless OptimizerOptions::llvm_contract), so switching is invisible.
enum class CpuBackend : std::uint8_t {
  // LLVM-compiled code once it is compiled, Highway until then: the compile runs
  // on a background thread (a spec in the kernel cache loads at once) and a step
  // never waits for it. Highway alone when the build has no LLVM.
  automatic,
  highway,  // Highway SIMD kernels for built-ins; the blocked interpreter for custom programs
  llvm,     // LLVM-compiled code, compiled (or loaded) at construction; Error(unsupported) without LLVM
};
std::string_view cpu_backend_name(CpuBackend backend);  // "auto", "highway", "llvm"

struct OptimizerOptions {
  // Where the weights, gradients and the optimizer's state live. With
  // Device::cuda(i), every Param's pointers are device memory of GPU i, and the
  // state and fp32 masters are allocated there (see README "On a GPU").
  Device device = Device::cpu();
  // CUDA: the stream steps are enqueued on (a CUstream / cudaStream_t); null is
  // the default stream. Steps never wait for the device, so they can be captured
  // in a CUDA graph; reading results (last_result(), step_count(), state()) waits.
  void* cuda_stream = nullptr;
  std::optional<double> max_grad_norm = std::nullopt;  // clip_grad_norm_ on the unscaled grads, inside the step
  double norm_type = 2.0;               // 2.0 or INFINITY
  bool master_weights = true;           // fp32 masters for f16/bf16 weights
  // bf16 weights without masters (master_weights = false): round each updated
  // weight to bf16 stochastically instead of to nearest even, so that updates
  // smaller than half a bf16 ulp still move the weight on average. The random
  // bits are Philox4x32-10 keyed by `seed`, counted by the step and the element's
  // index in the model (docs/low-precision.md): bitwise the same on every backend,
  // thread count and device, and run to run. Needs at least one bf16 weight and
  // no f16 weights; f32 weights in the list are unaffected. A bf16 weight's state
  // stored as bf16 (state_format) rounds stochastically too, each stream with bits of
  // its own, so that a second moment decaying by 0.999 a step still decays (unless
  // stochastic_state_rounding is off).
  bool stochastic_rounding = false;
  std::uint64_t seed = 0;
  // With stochastic_rounding: whether the bf16 state of the stochastically rounded
  // weights rounds stochastically too (the default), or to nearest even, as
  // torchao's bf16 optimizer state does. Nearest draws no random bits for the state
  // (faster where drawing them costs more than the memory traffic, as on a few CPU
  // cores), but a second moment that moves by less than half a bf16 ulp a step
  // stalls there (docs/low-precision.md). Without stochastic_rounding it changes nothing.
  bool stochastic_state_rounding = true;
  // bf16 weights without masters (master_weights = false): keep beside each bf16
  // weight a bf16 compensation, the part of the parameter that rounding the
  // weight to bf16 lost (Kahan-compensated summation). The update reads the
  // parameter as weight + compensation and writes back the nearest bf16 weight
  // and the rest: 2 bytes per parameter instead of fp32 masters' 4, with accuracy
  // close to masters (docs/low-precision.md). Needs at least one bf16 weight and
  // no f16 weights; excludes stochastic_rounding; f32 weights are unaffected.
  bool compensated_weights = false;
  // How the optimizer state is stored between steps (docs/low-precision.md): every
  // state stream in `state_format`, except the streams named in `state_formats`
  // (by the program's stream names: "exp_avg", "exp_avg_sq", ...), and a group's
  // streams in ParamGroup::state_format when it has one. The update computes in
  // fp32 either way, decoding each stream as it loads it and encoding it as it
  // stores it, in the same single pass. A stream the program marks full precision
  // (StateValues::full_precision, e.g. ASGD's "ax") keeps f32 under the blanket
  // formats and is an Error when named. q8 applies to tensors of at least
  // min_q8_numel elements; smaller ones keep f32 (bitsandbytes' min_8bit_size).
  // Every format is bitwise the same on every CPU backend, thread count and on
  // CUDA.
  StateFormat state_format = StateFormat::f32;
  std::vector<std::pair<std::string, StateFormat>> state_formats = {};
  std::int64_t min_q8_numel = 4096;
  Fusion fusion = Fusion::fused;
  // Threads for the CPU backend; 0 = STEPFUSE_NUM_THREADS, else the machine's cores,
  // but no more than one per 256 K elements (small lists run faster on fewer).
  // Results are bitwise identical for every thread count.
  int num_threads = 0;
  // Compute the gradient norm even on a plain step (no loss scale, no clipping),
  // which otherwise needs no reduce pass. Costs one read of the gradients.
  bool track_grad_norm = false;
  // CPU, Fusion::fused: which code runs the step. Unset: the environment variable
  // STEPFUSE_CPU_BACKEND (auto, highway or llvm), else CpuBackend::automatic.
  std::optional<CpuBackend> cpu_backend = std::nullopt;
  // LLVM backend: let LLVM fuse the update's multiply-add pairs into FMAs where the
  // CPU has them. Faster for some programs; results then equal Highway's within
  // fp32 rounding instead of bit for bit (the gradient norm is unaffected).
  bool llvm_contract = false;

  // The step across processes (docs/distributed.md). Each rank builds its
  // Optimizer over its own shard of the model's parameters, with the same options
  // and the same program (the same optimizer kind and flags) as the others, and a
  // communicator of the ranks. Every rank then gets the same StepResult (the
  // global norm, clip coefficient, found_inf and skip decision), and each shard's
  // update is bitwise the update a one-process step over the whole model would
  // make. Construction is collective: every rank validates its shard, and when any
  // rank's fails, every rank throws (the failing rank its own Error, the others an
  // Error naming it). A step with a reduce pass (loss-scaled, clipping, or
  // track_grad_norm) makes one collective of a few values per chunk. A CUDA
  // optimizer needs a communicator of device memory on its device (nccl_communicator
  // on the optimizer's cuda_stream): the step's collective is enqueued on the stream
  // between the reduce and update kernels, and a rank that refused the step makes the
  // others throw when they read its result.
  std::shared_ptr<Communicator> communicator = nullptr;
  // Sharded steps: where each param (params() order) lies in the model. Empty:
  // every param is a whole tensor, and the model's tensors are rank 0's params, then
  // rank 1's, and so on. Otherwise one TensorSlice per param; the model's tensors are
  // ordered by TensorSlice::tensor, and a tensor's slices (on any ranks) must tile
  // it, each starting at a multiple of kShardAlign elements.
  std::vector<TensorSlice> slices = {};
};

// What one step did.
struct StepResult {
  bool applied = false;    // false: non-finite gradients, nothing was written
  bool found_inf = false;  // some gradient element was inf or NaN
  double grad_norm = NAN;  // norm of the unscaled gradients (NaN when not computed)
  double clip_coef = 1.0;  // multiplier applied to the unscaled gradients by clipping
  // CUDA: the step is enqueued and its outcome is decided on the device; the
  // other fields are not known yet. Optimizer::last_result() waits and tells.
  bool pending = false;
};

// A parameter group, as a torch.optim param group: tensors with their own
// hyperparameters. Every group of one Optimizer has the same optimizer kind
// (all AdamW, say); any hyperparameter or flag may differ (weight_decay 0 for
// biases and norms, another lr for embeddings, amsgrad for some).
struct ParamGroup {
  std::vector<Param> params;
  OptimizerConfig config;
  // This group's state storage (OptimizerOptions::state_format), instead of the
  // options' blanket format; streams named in OptimizerOptions::state_formats
  // still take theirs.
  std::optional<StateFormat> state_format = std::nullopt;
};

// How Optimizer::load treats a checkpoint.
struct LoadOptions {
  // A state stream saved in another format (f32, bf16, q8) than this optimizer
  // stores it: converted (decoded to fp32, then encoded as a step stores it) when
  // set; else an Error(invalid_argument) naming the param, the stream and both
  // formats. Streams saved in this optimizer's format load bit for bit either way.
  bool convert_state = false;
};

namespace detail {
class StepEngine;
}
class GradScaler;

// A fused optimizer over a fixed list of caller-owned parameters.
//
// Construction validates everything, allocates the optimizer state (and fp32
// masters for f16/bf16 weights), and plans the work (chunk schedule, per-thread
// ranges). A step allocates nothing.
class Optimizer {
 public:
  // Each Param may have its own weight and grad dtypes (bf16 matrices beside f32
  // norms, say); every tensor gets the kernel for its combination.
  // Throws Error(invalid_argument) for a bad hyperparameter, a null pointer with
  // numel > 0, a weight/grad size mismatch, or an unsupported dtype combination;
  // Error(unsupported) for a device this build or machine cannot use.
  // One group: Optimizer({{params, config}}, options).
  Optimizer(OptimizerConfig config, std::vector<Param> params, OptimizerOptions options = {});
  // Parameter groups. One step still has one reduce pass, one global gradient norm
  // over every group (max_grad_norm clips it, as clip_grad_norm_ over all
  // parameters), one skip decision and one update pass; each tensor runs its
  // group's hyperparameters, and a group whose flags change the program (amsgrad,
  // nesterov, centered, momentum on/off) runs its own kernel variant in that same
  // pass. params() lists every group's params, group after group; per-param
  // indices (state(), master(), last_tensor_grad_norms()) index that list.
  // Throws Error(invalid_argument) for no group, an empty group, groups of
  // different optimizer kinds, a bad hyperparameter (naming the group), a tensor
  // in two groups or twice in one (naming both places), and everything the
  // one-group constructor rejects.
  Optimizer(std::vector<ParamGroup> groups, OptimizerOptions options = {});
  // A custom update program (update_program.hpp; docs/update-programs.md), with the
  // same pipeline as the built-ins: unscale, inf/NaN check, clipping, GradScaler and
  // LossScaleOptimizer work unchanged. On the CPU the blocked interpreter runs the
  // program inside the fused pipeline (Fusion::fused and Fusion::interpreted are the
  // same path here; Fusion::unfused is the eager baseline, as for built-ins); on
  // CUDA, kernels generated for it. State streams start at their StreamDecl::init.
  // Throws as the other constructor does (the program was validated when built).
  Optimizer(UpdateProgram program, std::vector<Param> params, OptimizerOptions options = {});
  ~Optimizer();
  Optimizer(Optimizer&&) noexcept;
  Optimizer& operator=(Optimizer&&) noexcept;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One step on gradients that are already unscaled (plain, non-AMP use).
  // With max_grad_norm set, clips them first (without writing them) and skips
  // the step if they are not finite. Reads grads, writes weights and state.
  void step();

  // One step on gradients scaled by `loss_scale` (finite and above 2^-128, so that its
  // fp32 reciprocal is finite; else Error(invalid_argument)): unscale, check
  // for inf/NaN, clip, update, in one reduce pass and one update pass. On
  // non-finite gradients nothing is written and step_count() does not advance.
  // This is the entry GradScaler and LossScaleOptimizer use.
  StepResult step_scaled(double loss_scale);

  // Built-in optimizers only: on a custom-program optimizer config() and
  // set_config() throw Error(invalid_state) (use scalar() / set_scalar()).
  // config() is group 0's (the only group's, with one group).
  const OptimizerConfig& config() const;
  // Sets every group's config. Same optimizer kind (Error otherwise); takes effect
  // at the next step, no recompilation. Changing a flag that changes the program
  // (amsgrad, nesterov, centered, momentum on/off) is an Error: build a new
  // Optimizer (or add a param group) for that.
  void set_config(const OptimizerConfig& config);
  // The learning rate: the config's lr; for a custom program, its scalar "lr",
  // which must have the fixed rule (Error(invalid_state) otherwise; scalars whose
  // rules use a learning rate, such as a bias-corrected step size, are changed
  // with set_scalar_rule()). A negative or non-finite lr is Error(invalid_argument).
  // set_lr(lr) sets every group's lr; lr() is group 0's.
  void set_lr(double lr);
  double lr() const;

  // Parameter groups (an optimizer built from one config has one group).
  // A group index out of range is Error(invalid_argument).
  std::size_t num_groups() const;
  const OptimizerConfig& config(std::size_t group) const;
  // As set_config(config), for one group: the same kind and the same program
  // variant as that group runs now; no recompilation.
  void set_config(std::size_t group, const OptimizerConfig& config);
  double lr(std::size_t group) const;
  void set_lr(std::size_t group, double lr);
  // As torch's add_param_group: appends a group (its params follow the existing
  // ones in params()), with fresh state and its own step count starting at 0 (so
  // bias corrections start over for it, as in PyTorch). The existing groups keep
  // their state, masters and step counts. Validated like the constructor's groups
  // against every existing tensor; on an Error nothing changes. Replans the step
  // (kernels for new dtype combinations or variants are compiled or found in the
  // cache); call it between steps.
  void add_param_group(ParamGroup group);
  // The group of params()[param], and a group's params (a view into params()).
  std::size_t group_of(std::size_t param) const;
  std::span<const Param> group_params(std::size_t group) const;
  // Steps the group has applied: step_count() minus the steps taken before it was added.
  std::int64_t group_step_count(std::size_t group) const;
  // The group's ParamGroup::state_format as it was created: nullopt when it takes
  // OptimizerOptions::state_format. state_format() gives each stream's storage.
  std::optional<StateFormat> group_state_format(std::size_t group) const;
  // NAdam: the group's mu_product after its steps so far, as PyTorch keeps it (state
  // "mu_product", fp32): the product of every applied step's mu_t = beta1 * (1 - 0.5 *
  // 0.96^(t * momentum_decay)) under the beta1 and momentum_decay that step ran with
  // (set_config() changes them for the later steps only, as in PyTorch).
  // Error(invalid_state) for a group whose optimizer is not NAdam.
  double nadam_mu_product(std::size_t group = 0) const;
  // NAdam: the group's later steps multiply onto `mu_product` (finite, in [0, 1]) as the
  // product so far, as when restoring PyTorch's state; set the group's step count first
  // (set_group_step_count). Error(invalid_argument) for another value, and
  // Error(invalid_state) for a group whose optimizer is not NAdam; nothing changes then.
  void set_nadam_mu_product(std::size_t group, double mu_product);
  // NAdam: how the group's mu_product departs from the closed form of its current beta1 and
  // momentum_decay, as the log of their ratio: 0 while neither has changed since step 0
  // (and no mu_product was set), so the product is the closed form's. Error(invalid_state)
  // for a group whose optimizer is not NAdam.
  double nadam_mu_product_offset(std::size_t group = 0) const;

  // Points the optimizer at new gradient buffers, one per param in params() order,
  // of the same sizes and dtypes (a framework that allocates fresh gradients each
  // iteration, as PyTorch does after zero_grad(set_to_none=True)). No re-planning,
  // no allocation on the CPU; on CUDA one small table copy, ordered on the stream.
  // Validated as at construction (count, numel, dtype, null data, memory shared with
  // a weight or another gradient): Error(invalid_argument), and nothing changes. On
  // CUDA, Error(unsupported) when the new buffers lack the alignment or the single
  // contiguous layout the kernels were specialized for (build a new Optimizer then).
  void set_grads(std::span<const TensorView> grads);
  // Sets a group's step count (what bias corrections and schedules see), as when
  // restoring a framework's checkpoint that stores steps itself (torch's
  // state[p]["step"]). count >= 0, else Error(invalid_argument); nothing else changes.
  void set_group_step_count(std::size_t group, std::int64_t count);

  // Custom update programs.
  bool is_custom() const;
  // The update program and its current scalar rules (built-ins: UpdateProgram::from_config(config())).
  UpdateProgram update_program() const;
  // The value of a fixed scalar (the rule's a). Error(invalid_argument) naming the
  // scalar if the program has none of that name or its rule is not fixed.
  double scalar(std::string_view name) const;
  // Custom programs: sets a fixed scalar's value (must be finite), or replaces a
  // scalar's rule; in effect at the next step, never recompiling (scalars are kernel
  // arguments). Error(invalid_state) on a built-in (use set_config()), nothing changes
  // on an Error.
  void set_scalar(std::string_view name, double value);
  void set_scalar_rule(std::string_view name, ScalarRule rule);

  std::int64_t step_count() const;  // steps applied (skipped steps do not count)
  // Norm of the unscaled grads seen by the last step; +inf when the step was skipped for
  // non-finite ones (a loss-scaled or clipping step); a plain step with track_grad_norm,
  // which does not check, reports their norm as it is (inf, or NaN for a NaN gradient,
  // as torch.nn.utils.clip_grad_norm_ returns it); NaN when the step computed none (a plain step without clipping or track_grad_norm,
  // or an unfused step without clipping: the eager baseline runs no norm pass then).
  double last_grad_norm() const;
  const StepResult& last_result() const;
  const OptimizerOptions& options() const;
  int num_threads() const;
  // What runs the next step's update: "llvm", "highway" (built-in Highway kernels),
  // "interpreter" (a custom program, or Fusion::interpreted), "unfused" or "cuda".
  // With CpuBackend::automatic it turns from "highway"/"interpreter" to "llvm" once
  // the background compile is done.
  std::string_view backend() const;

  // Introspection (tests, checkpoints, debugging).
  std::size_t num_params() const;
  const std::vector<Param>& params() const;
  std::vector<std::string_view> state_names() const;  // e.g. {"exp_avg", "exp_avg_sq"}
  // A state stream of a param, stored as f32 (state_format() says so); a stream
  // stored as bf16 or q8 is an Error(invalid_state): read it with state_values()
  // or state_storage().
  std::span<const float> state(std::size_t param, std::string_view name) const;
  std::span<float> mutable_state(std::size_t param, std::string_view name);
  // How a param's state stream is stored (OptimizerOptions::state_format).
  StateFormat state_format(std::size_t param, std::string_view name) const;
  // Any format: the values the next step loads (decoded: exact for f32 and bf16,
  // code * absmax for q8), and writing values as a step stores them (rounded to
  // bf16, or quantized block by block). values.size() must be the param's numel.
  std::vector<float> state_values(std::size_t param, std::string_view name) const;
  void set_state_values(std::size_t param, std::string_view name, std::span<const float> values);
  // The stored bytes as they are: fp32 values, bf16 bit patterns or q8 codes (one
  // byte per element), and for q8 the fp32 absmax of each block of 256 elements
  // (empty for f32 and bf16). Writable: restoring state saved in these formats.
  std::span<const std::byte> state_storage(std::size_t param, std::string_view name) const;
  std::span<const float> state_absmax(std::size_t param, std::string_view name) const;
  std::span<std::byte> mutable_state_storage(std::size_t param, std::string_view name);
  std::span<float> mutable_state_absmax(std::size_t param, std::string_view name);
  // fp32 master copy of a parameter; empty when the weights are f32 or masters are off.
  std::span<const float> master(std::size_t param) const;
  // Writable, as mutable_state(): restoring masters saved by a framework's own
  // checkpoint format. CUDA: a host copy, copied back before the next step.
  std::span<float> mutable_master(std::size_t param);
  // bf16 compensation of a parameter (OptimizerOptions::compensated_weights), as
  // bf16 bit patterns: the parameter is weight + compensation. Empty for f32
  // weights or without compensated weights. Writable as mutable_master().
  std::span<const std::uint16_t> compensation(std::size_t param) const;
  std::span<std::uint16_t> mutable_compensation(std::size_t param);
  // The update program this optimizer runs, as text.
  std::string program_text() const;
  // Per-tensor gradient norms (unscaled) from the last reduce pass.
  const std::vector<double>& last_tensor_grad_norms() const;

  // Checkpoints. save() writes the hyperparameters, the step count, every state
  // tensor and the fp32 masters (with a GradScaler: its state_dict() too) to `path`
  // atomically: a temporary file in the same directory, flushed, then renamed over
  // `path`, so a crash leaves the old file or the new one, never a mix. The file
  // is a safetensors file (tensors "group.{g}.param.{i}.{state}" and ".master", the
  // rest in its metadata: README "Checkpoints") with a format version and a
  // checksum; files of the previous formats still load. The weights themselves are the
  // caller's (save them with the model).
  //
  // Custom programs: the file holds the program's text and scalar rules; load()
  // requires the same program text and restores the rules.
  //
  // load() reads a file written by save() for an optimizer of the same kind, update
  // program, tensor sizes and dtypes, and restores all of it (hyperparameters
  // included), so the next step is bit for bit the one the saved optimizer would
  // have taken, given the same weights. A missing, truncated, corrupt or
  // mismatched file is an Error (io_error for the file, invalid_argument for a
  // mismatch, naming what differs) and leaves the optimizer (and scaler) as they were.
  //
  // Sharded (OptimizerOptions::communicator): save() writes this rank's shard, in the
  // same format, with where each param lies in the model (its model tensor, offset
  // and the tensor's element count) and the rank and number of ranks in the metadata
  // (README "Checkpoints"). It is not collective, but every rank must call it, each
  // with its own path (say "step-1000.rank3.safetensors"): the ranks' files together
  // are the checkpoint. load() of such a file restores this rank's shard when the
  // ranks cut the model as they did when it was saved (it checks each param's place);
  // otherwise use load_shards().
  void save(const std::string& path) const;
  void save(const std::string& path, const GradScaler& scaler) const;
  void load(const std::string& path);
  void load(const std::string& path, GradScaler& scaler);
  // The same, converting state saved in another format (LoadOptions::convert_state).
  void load(const std::string& path, const LoadOptions& options);
  void load(const std::string& path, GradScaler& scaler, const LoadOptions& options);

  // Re-sharding: loads a checkpoint saved by any number of ranks R (the files every
  // rank's save() wrote, in any order; an unsharded save is one file of one rank)
  // into this optimizer, whatever its own cut of the model: R' ranks with other
  // whole tensors or slices, or one unsharded optimizer (whose params are then model
  // tensors 0, 1, ... in params() order). Each rank takes from the files the state
  // and fp32 masters of exactly the elements its params cover, each group's
  // hyperparameters and step count from the saved groups its elements come from, and
  // the step count. Sharded, the call is collective: every rank calls it at the same
  // point, with the same list; files are read by each rank itself (a filesystem every
  // rank sees is assumed), and only those it takes data from are checksummed.
  //
  // Checked before anything changes: every file opens and is a checkpoint of this
  // optimizer's kind (custom: the same program and scalar rules in every file); the
  // files are one save's (the same number of ranks, each rank's file once, the same
  // step count); their params tile every model tensor exactly (a gap or an overlap is
  // an Error naming the tensor, the elements and the files), and the model's tensors
  // are this one's (the same ids and element counts); each piece taken has this
  // param's program variant, weight/grad dtypes and master; the hyperparameters and
  // group step counts a group takes agree (and are valid for it). A file that cannot
  // be read or is corrupt is Error(io_error); anything else Error(invalid_argument).
  // Sharded, the ranks then agree: when any rank's checks failed, that rank throws its
  // own Error and every other rank an Error (with its code) naming that rank, and no
  // rank changes anything; otherwise every rank commits.
  // With a scaler: every file must hold a GradScaler state (save(path, scaler)), the
  // same in all of them, and the scaler takes it.
  void load_shards(const std::vector<std::string>& paths);
  void load_shards(const std::vector<std::string>& paths, GradScaler& scaler);
  void load_shards(const std::vector<std::string>& paths, const LoadOptions& options);
  void load_shards(const std::vector<std::string>& paths, GradScaler& scaler, const LoadOptions& options);

 private:
  friend struct detail_access;
  // The state buffer of a param's stream `name`, or Error(invalid_argument) saying why not.
  int state_buffer(std::size_t param, std::string_view name) const;
  std::unique_ptr<detail::StepEngine> engine_;
};

}  // namespace stepfuse
