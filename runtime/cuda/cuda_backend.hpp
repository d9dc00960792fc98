// The CUDA backend of the step pipeline: device memory for state, masters and
// the layout tables; the generated kernels loaded into the device's primary
// context; steps enqueued on the caller's stream with no host synchronization.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "jit/cuda/cuda_layout.hpp"
#include "jit/cuda/emit_cuda.hpp"
#include "jit/layout.hpp"
#include "runtime/aligned_buffer.hpp"
#include "runtime/backend.hpp"
#include "jit/step_scalars.h"
#include "jit/base/cuda_api.hpp"
#include "stepfuse/optimizer.hpp"
#include "stepfuse/program.hpp"

extern "C" {
#include "jit/cuda/device_abi.h"
#include "jit/cuda/shard_abi.h"
}

namespace stepfuse::detail {

// A device's primary context, made current on the calling thread for the scope.
class CudaContext {
 public:
  explicit CudaContext(int device);  // retains the primary context (Error if unusable)
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;
  void make_current() const;
  int device() const { return device_; }
  int sm() const { return sm_; }  // compute capability, major*10 + minor

 private:
  int device_;
  cuda::CUdevice dev_ = 0;
  cuda::CUcontext ctx_ = nullptr;
  int sm_ = 0;
};

// The kernels of one module, loaded into the current context.
class CudaModule {
 public:
  CudaModule(const std::string& image, const char* what);
  ~CudaModule();
  CudaModule(const CudaModule&) = delete;
  CudaModule& operator=(const CudaModule&) = delete;
  cuda::CUfunction get(const char* name) const;

 private:
  cuda::CUmodule module_ = nullptr;
};

// Device memory, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = 0, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  cuda::CUdeviceptr get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const { return reinterpret_cast<T*>(ptr_); }

 private:
  cuda::CUdeviceptr ptr_ = 0;
  std::size_t bytes_ = 0;
};

// Launches a kernel; throws Error(device_error) naming it on failure.
void launch(cuda::CUfunction fn, const char* name, unsigned grid, unsigned block, cuda::CUstream stream, void** args);

// The utility kernels (one module per device, loaded once per process).
struct CudaUtilities {
  cuda::CUfunction update_scale, scale[3], widen[3], fill;
};
const CudaUtilities& cuda_utilities(const CudaContext& ctx);

// The CUDA backend: the step's state, masters and tables on the device, the
// reduce and update kernels generated for its spec. Steps are enqueued on the
// stream and never wait; results, counts and the host copies of the state wait.
class CudaBackend final : public Backend {
 public:
  // `params` hold device pointers. Allocates and initializes state (`state_init`
  // per program stream) and masters on the device, compiles (or finds in the
  // cache) and loads the kernels.
  CudaBackend(const StepPrograms& programs, const std::vector<Param>& params, const OptimizerOptions& options);
  ~CudaBackend() override;

  // Enqueues a step on the stream (copying a host copy of the state that was
  // handed out back first). Nothing waits for the device: the result is pending.
  StepResult step(const StepRequest& request, std::vector<double>& tensor_norms) override;
  // These wait for the stream.
  StepResult read_result(std::vector<double>* tensor_norms) const override;
  std::int64_t step_count() const override;
  void set_step_count(std::int64_t n) override;
  void set_rules(const GroupRules* groups) override;
  const jit::Layout& layout() const override { return layout_; }
  float* state_data(int buffer) const override;
  float* masters_data() const override;
  // Packed state (some tensor stores some stream as bf16 or q8): where the host copy
  // keeps the tensor's values, codes and absmaxes.
  StateSlot state_slot(int buffer, std::size_t tensor) const override;
  std::string_view name() const override { return "cuda"; }
  int threads() const override { return 1; }
  // Checks the new gradients are device memory of this GPU and fit the kernels
  // (a flat or 16-byte-aligned spec needs them so), then copies the tensor table's
  // new pointers to the device, ordered on the stream.
  void set_grads(const std::vector<Param>& params) override;
  // A sharded step (runtime/shard.hpp; the spec was made sharded at construction):
  // uploads the step's plan and allocates the collective's buffers. Each step then
  // runs sf_reduce_shard, the communicator's all_gather (enqueued on its stream,
  // which must be this optimizer's), and sf_shard_finalize: no host sync.
  void set_shard(Shard* shard) override;
  // This rank refuses its step: the step's all_gather with the refused flag set, so
  // every other rank's step applies nothing and its result raises the Error.
  void refuse_shard_step();

  // data *= factor, in place on the device, rounded to each tensor's storage
  // format (LossScaleOptimizer::get_unscaled_gradients). Enqueued.
  void scale_tensors(const std::vector<TensorView>& tensors, float factor);

  cuda::CUstream stream() const { return stream_; }
  const CudaContext& context() const { return *ctx_; }
  const jit::CudaSpec& spec() const { return spec_; }
  void synchronize() const;

 private:
  const Program& program_;
  std::vector<Param> params_;
  OptimizerOptions options_;
  int num_groups_ = 1;
  std::vector<int> stream_of_buffer_;  // per state buffer (StepPrograms::state_names): its sf_streams slot
  std::unique_ptr<CudaContext> ctx_;
  cuda::CUstream stream_ = nullptr;
  jit::CudaSpec spec_;
  std::unique_ptr<CudaModule> reduce_module_, update_module_;
  cuda::CUfunction reduce_ = nullptr, update_ = nullptr;
  jit::Layout layout_;
  std::vector<sf_tensor> host_tensors_;  // the tensor table as uploaded (set_grads changes its grads)
  // Packed state (jit::CudaSpec::combo_formats): each state buffer holds every tensor's
  // values in its own format, q8 absmaxes in absmax_; the tensors' addresses in tensor_state_.
  bool packed_ = false;
  jit::PackedState packed_state_;
  std::vector<StateFormat> tensor_format_[kMaxStreams];  // packed: per buffer slot, per tensor (f32 where it has none)
  bool nonnegative_[kMaxStreams] = {};                     // per buffer slot: q8 uses the unsigned map
  std::size_t state_bytes(int slot) const;                 // of a state buffer
  // Allocates the packed buffers, points the tensors' sf_tensor.state at their
  // addresses (uploaded) and writes their initial values.
  void init_packed_state(const StepPrograms& programs, std::vector<sf_tensor>& tensors);
  // The host copy of the state and masters, allocated on first use.
  mutable AlignedBuffer host_state_[kMaxStreams], host_absmax_[kMaxStreams], host_masters_;
  mutable bool host_current_ = false;  // the host copy equals the device's
  mutable bool host_touched_ = false;  // the host copy was handed out since the last step
  void host_view() const;              // makes the host copy current and marks it handed out
  int num_chunks_ = 0, num_update_blocks_ = 0;
  DeviceBuffer factor_;  // scale_tensors()' factor
  DeviceBuffer group_rules_, group_scalars_;  // sf_hyper.groups and .scalars (device_abi.h)
  DeviceBuffer state_[kMaxStreams], masters_, step_state_, tensors_, chunks_, blocks_, partials_, tensor_sums_;
  DeviceBuffer absmax_[kMaxStreams], tensor_state_, q8_maps_;  // packed state (q8_maps_: sf_hyper.q8_maps)
  // A two-phase program (jit/cuda/kernels/phase1_kernel.cuh): its phase-1 and combine
  // kernels, each chunk's sums and each tensor's norms (SF_MAX_NORM_SLOTS floats apiece).
  cuda::CUfunction phase1_ = nullptr, combine_ = nullptr;
  DeviceBuffer norm_sums_, norms_;
  // A sharded step (set_shard): its kernels, tables and buffers (jit/cuda/shard_abi.h).
  Shard* shard_ = nullptr;
  cuda::CUfunction reduce_shard_ = nullptr, shard_finalize_ = nullptr;
  DeviceBuffer shard_tables_[5], shard_send_, shard_recv_, shard_sums_, shard_refused_;
  DeviceBuffer shard_refusal_;  // what a refusing rank sends: zeros, then the refused flag
  sf_shard shard_args_{};
};

}  // namespace stepfuse::detail
