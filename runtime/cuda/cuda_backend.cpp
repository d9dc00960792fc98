// The CUDA backend: device memory, layout tables, kernel loading and launches.
#include "runtime/cuda/cuda_backend.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "jit/base/warning.hpp"
#include "jit/cuda/cuda_kernels.hpp"
#include "jit/cuda/cuda_layout.hpp"
#include "jit/program_analysis.hpp"
#include "runtime/cpu/kernels.hpp"
#include "runtime/cpu/q8.hpp"
#include "runtime/cuda/cuda_scaler.hpp"
#include "runtime/shard.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::detail {

namespace {

const cuda::DriverApi& api() {
  const cuda::DriverApi* a = cuda::driver();
  if (a == nullptr)
    throw Error(ErrorCode::unsupported, "the CUDA backend cannot run here: " + cuda::driver_status().reason +
                                            " (use Device::cpu(), or check stepfuse::cuda_available())");
  return *a;
}

}  // namespace

// ---- context, modules, memory ----

CudaContext::CudaContext(int device) : device_(device) {
  const cuda::DriverApi& a = api();
  int count = 0;
  cuda::check(a.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (device < 0 || device >= count)
    throw Error(ErrorCode::invalid_argument, "OptimizerOptions::device = cuda:" + std::to_string(device) + ", but there " +
                                                 (count == 1 ? "is 1 CUDA device" : "are " + std::to_string(count) + " CUDA devices") +
                                                 " (use cuda:0 .. cuda:" + std::to_string(std::max(count - 1, 0)) + ")");
  cuda::check(a.cuDeviceGet(&dev_, device), "cuDeviceGet");
  cuda::check(a.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
  make_current();
  int major = 0, minor = 0;
  cuda::check(a.cuDeviceGetAttribute(&major, cuda::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev_), "cuDeviceGetAttribute");
  cuda::check(a.cuDeviceGetAttribute(&minor, cuda::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev_), "cuDeviceGetAttribute");
  sm_ = major * 10 + minor;
}

// Destructors never throw: a failing driver call is reported (cuda::report) and the
// release goes on (jit/base/cuda_api.hpp).
CudaContext::~CudaContext() {
  if (ctx_ != nullptr) cuda::report(cuda::driver()->cuDevicePrimaryCtxRelease(dev_), "cuDevicePrimaryCtxRelease");
}

void CudaContext::make_current() const { cuda::check(api().cuCtxSetCurrent(ctx_), "cuCtxSetCurrent"); }

CudaModule::CudaModule(const std::string& image, const char* what) {
  char error_log[8192] = {};
  int options[] = {cuda::CU_JIT_ERROR_LOG_BUFFER, cuda::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[] = {error_log, reinterpret_cast<void*>(static_cast<std::uintptr_t>(sizeof error_log))};
  const cuda::CUresult r = api().cuModuleLoadDataEx(&module_, image.data(), 2, options, values);
  if (r != cuda::CUDA_SUCCESS) {
    try {
      cuda::check(r, (std::string("loading the ") + what + " kernels").c_str());
    } catch (const Error& e) {
      throw Error(ErrorCode::device_error, std::string(e.what()) + (error_log[0] ? std::string("\n") + error_log : ""));
    }
  }
}

CudaModule::~CudaModule() {
  if (module_ != nullptr) cuda::report(cuda::driver()->cuModuleUnload(module_), "cuModuleUnload");
}

cuda::CUfunction CudaModule::get(const char* name) const {
  cuda::CUfunction fn = nullptr;
  cuda::check(api().cuModuleGetFunction(&fn, module_, name), (std::string("cuModuleGetFunction ") + name).c_str());
  return fn;
}

DeviceBuffer::DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const cuda::CUresult r = api().cuMemAlloc(&ptr_, bytes);
  if (r != cuda::CUDA_SUCCESS) cuda::check(r, ("cuMemAlloc of " + std::to_string(bytes) + " bytes").c_str());
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != 0) cuda::report(cuda::driver()->cuMemFree(ptr_), "cuMemFree");
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != 0) cuda::report(cuda::driver()->cuMemFree(ptr_), "cuMemFree");
    ptr_ = o.ptr_, bytes_ = o.bytes_;
    o.ptr_ = 0, o.bytes_ = 0;
  }
  return *this;
}

void launch(cuda::CUfunction fn, const char* name, unsigned grid, unsigned block, cuda::CUstream stream, void** args) {
  const cuda::CUresult r = api().cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, stream, args, nullptr);
  if (r != cuda::CUDA_SUCCESS) cuda::check(r, (std::string("launching ") + name).c_str());
}

const CudaUtilities& cuda_utilities(const CudaContext& ctx) {
  // One module per device for the process; modules live as long as the process.
  static std::mutex mu;
  // Each entry holds its own reference to the primary context, which would
  // otherwise be reset (and the module with it) once the last optimizer is gone.
  struct Loaded {
    std::unique_ptr<CudaContext> ctx;
    std::unique_ptr<CudaModule> module;
    CudaUtilities fns{};
  };
  static std::map<int, Loaded> loaded;
  std::lock_guard lock(mu);
  Loaded& slot = loaded[ctx.device()];
  if (!slot.module) {
    slot.ctx = std::make_unique<CudaContext>(ctx.device());
    ctx.make_current();
    const jit::CudaImage image = jit::cuda_utility_image(jit::target_for_device(ctx.sm() / 10, ctx.sm() % 10));
    auto module = std::make_unique<CudaModule>(*image.bytes, "utility");
    CudaUtilities u{};
    u.update_scale = module->get("sf_update_scale");
    const char* scale[] = {"sf_scale_f32", "sf_scale_f16", "sf_scale_bf16"};
    const char* widen[] = {"sf_widen_f32", "sf_widen_f16", "sf_widen_bf16"};
    for (int d = 0; d < 3; ++d) u.scale[d] = module->get(scale[d]), u.widen[d] = module->get(widen[d]);
    u.fill = module->get("sf_fill");
    slot.module = std::move(module);
    slot.fns = u;
  }
  return slot.fns;
}

// ---- the backend ----

namespace {

// Host pointers would fault in the kernels (an illegal address that poisons the
// context): say which one is wrong instead.
void check_device_pointers(const std::vector<Param>& params, int device_index, bool grads_only) {
  for (std::size_t i = 0; i < params.size(); ++i) {
    for (const auto& [view, field] : {std::pair{&params[i].weight, "weight"}, std::pair{&params[i].grad, "grad"}}) {
      if (view->numel == 0 || (grads_only && view == &params[i].weight)) continue;
      int device = -1;
      if (!is_device_pointer(view->data, &device) || device != device_index)
        throw Error(ErrorCode::invalid_argument,
                    "params[" + std::to_string(i) + "]." + field + ".data is not memory of cuda:" +
                        std::to_string(device_index) +
                        (device >= 0 ? " (it is on cuda:" + std::to_string(device) + ")" : " (it is host memory)") +
                        "; with Device::cuda, weights and gradients must be device allocations of that GPU");
    }
  }
}

template <class T>
DeviceBuffer upload_table(const std::vector<T>& v, cuda::CUstream stream) {
  DeviceBuffer b(std::max<std::size_t>(v.size(), 1) * sizeof(T));
  if (!v.empty()) cuda::check(api().cuMemcpyHtoDAsync(b.get(), v.data(), v.size() * sizeof(T), stream), "cuMemcpyHtoDAsync");
  return b;
}

unsigned grid_for(std::int64_t n, unsigned block) {
  const std::int64_t blocks = (n + block - 1) / block;
  return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, 65535 * 8));
}

}  // namespace

CudaBackend::CudaBackend(const StepPrograms& programs, const std::vector<Param>& params, const OptimizerOptions& options)
    : program_(*programs.groups[0].program), params_(params), options_(options),
      num_groups_(static_cast<int>(programs.groups.size())) {
  const Program& program = program_;
  ctx_ = std::make_unique<CudaContext>(options.device.index);
  stream_ = static_cast<cuda::CUstream>(options.cuda_stream);
  const cuda::DriverApi& a = api();
  check_device_pointers(params_, options.device.index, /*grads_only=*/false);
  // Several groups: per-tensor blocks (a block's scalars are its tensor's group's), never the flat layout.
  // Groups whose flags pick other variants of the program run them in the same kernels.
  // State stored as bf16 or q8 is packed, each tensor's own (never the flat layout).
  packed_ = programs.compressed();
  jit::CudaLayout layout = jit::plan_cuda_layout(program, params_, options, /*allow_flat=*/num_groups_ == 1 && !packed_);
  layout.spec.sharded = options.communicator != nullptr;
  std::vector<const Program*> group_programs;
  for (const StepPrograms::Group& g : programs.groups) group_programs.push_back(g.program);
  const std::vector<int> group_variant = jit::assign_groups(layout, group_programs, programs.tensor_group);
  if (packed_) {
    // Each tensor's format per stream of its group's program.
    std::vector<std::array<StateFormat, kMaxStreams>> formats(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i) {
      formats[i].fill(StateFormat::f32);
      const auto& slot = programs.state_slot[programs.tensor_group[i]];
      for (std::size_t s = 0; s < kMaxStreams; ++s)
        if (slot[s] >= 0) formats[i][s] = programs.formats[i][static_cast<std::size_t>(slot[s])];
    }
    jit::assign_state_formats(layout, formats, options.stochastic_state_rounding);
    packed_state_ = jit::plan_packed_state(layout);
  }
  spec_ = layout.spec;
  // The state buffers: sf_streams slots, shared by name between the variants.
  const std::vector<const Program*> variants = jit::spec_programs(spec_);
  const std::vector<std::array<int, kMaxStreams>> slots = jit::cuda_stream_slots(spec_);
  for (const std::string_view name : programs.state_names) {
    std::size_t v = 0;  // the first variant with the stream (every variant that has it shares its slot)
    while (variants[v]->find_stream(name) < 0) ++v;
    stream_of_buffer_.push_back(slots[v][static_cast<std::size_t>(variants[v]->find_stream(name))]);
  }
  layout_ = layout.layout;
  const std::int64_t total = layout_.state_elems;
  num_chunks_ = static_cast<int>(layout.chunks.size());
  num_update_blocks_ = layout.num_update_blocks;
  std::vector<sf_tensor>& tensors = layout.tensors;

  // Kernels: compile (or find in the cache) before allocating anything large.
  // A cached image the driver refuses (it passed the cache's checks, yet does not
  // load) is evicted and compiled once more, instead of failing every later run.
  const jit::CudaTarget target = jit::target_for_device(ctx_->sm() / 10, ctx_->sm() % 10);
  for (int attempt = 0;; ++attempt) {
    const jit::CudaStepImages images = jit::cuda_step_images(spec_, target);
    try {
      reduce_module_ = std::make_unique<CudaModule>(*images.reduce.bytes, "reduce");
      update_module_ = std::make_unique<CudaModule>(*images.update.bytes, "update");
      break;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::device_error || attempt > 0) throw;
      detail::warn_once(std::string("cuda_image_load:") + e.what(),
                        std::string("stepfuse: a cached CUDA kernel image did not load; evicted and recompiled: ") +
                            e.what());
      reduce_module_.reset(), update_module_.reset();
      jit::evict_cuda_step_images(spec_, target);
    }
  }
  reduce_ = reduce_module_->get("sf_reduce");
  if (spec_.sharded) {
    reduce_shard_ = reduce_module_->get("sf_reduce_shard");
    shard_finalize_ = reduce_module_->get("sf_shard_finalize");
  }
  update_ = update_module_->get("sf_update");
  if (jit::is_two_phase(program)) {
    phase1_ = update_module_->get("sf_phase1");
    combine_ = update_module_->get("sf_phase_combine");
  }
  const CudaUtilities& util = cuda_utilities(*ctx_);
  ctx_->make_current();

  // State and masters.
  if (packed_) init_packed_state(programs, tensors);
  for (const int s : packed_ ? std::vector<int>{} : stream_of_buffer_) {
    state_[s] = DeviceBuffer(static_cast<std::size_t>(std::max<std::int64_t>(total, 1)) * sizeof(float));
    // Each tensor starts at its group's initial value (Adagrad's initial_accumulator_value,
    // Rprop's lr, ... may differ between groups): one fill, or one per tensor when they differ.
    // A group whose variant has no such stream never reads it: 0.
    const auto init_of = [&](std::size_t g) {
      const auto& slot = slots[static_cast<std::size_t>(group_variant[g])];
      const auto it = std::find(slot.begin(), slot.end(), s);
      return it == slot.end() ? 0.0f : programs.groups[g].state_init[it - slot.begin()];
    };
    bool same = true;
    for (std::size_t g = 1; g < programs.groups.size(); ++g) same = same && init_of(g) == init_of(0);
    for (std::size_t i = 0; i < (same ? 1 : params_.size()); ++i) {
      float value = init_of(same ? 0 : programs.tensor_group[i]);
      long long n = same ? total : params_[i].weight.numel;
      if (n == 0) continue;
      cuda::CUdeviceptr dst = state_[s].get() + (same ? 0 : layout_.offsets[i] * sizeof(float));
      void* args[] = {&dst, &n, &value};
      launch(util.fill, "sf_fill", grid_for(n, 256), 256, stream_, args);
    }
  }
  if (layout_.master_elems > 0) masters_ = DeviceBuffer(static_cast<std::size_t>(layout_.master_bytes()));
  if (layout_.master_elem_bytes == 2 && layout_.master_elems > 0)  // compensations start at 0
    cuda::check(api().cuMemsetD8Async(masters_.get(), 0, static_cast<std::size_t>(layout_.master_bytes()), stream_),
                "cuMemsetD8Async");
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (layout_.master_offsets[i] < 0) continue;
    tensors[i].master = reinterpret_cast<float*>(masters_.get() + static_cast<std::size_t>(layout_.master_offsets[i] *
                                                                                        layout_.master_elem_bytes));
    if (layout_.master_elem_bytes == 2) continue;
    const void* src = params_[i].weight.data;
    float* dst = tensors[i].master;
    long long n = params_[i].weight.numel;
    void* args[] = {&src, &dst, &n};
    launch(util.widen[static_cast<int>(params_[i].weight.dtype)], "sf_widen", grid_for(n, 256), 256, stream_, args);
  }
  host_tensors_ = tensors;
  tensors_ = upload_table(host_tensors_, stream_);
  chunks_ = upload_table(layout.chunks, stream_);
  blocks_ = upload_table(layout.blocks, stream_);
  partials_ = DeviceBuffer(static_cast<std::size_t>(std::max(num_chunks_, 1)) * sizeof(sf_partial));
  tensor_sums_ = DeviceBuffer(params_.size() * sizeof(double));
  if (phase1_ != nullptr) {
    norm_sums_ = DeviceBuffer(static_cast<std::size_t>(std::max(num_chunks_, 1)) * SF_MAX_NORM_SLOTS * sizeof(float));
    norms_ = DeviceBuffer(std::max<std::size_t>(params_.size(), 1) * SF_MAX_NORM_SLOTS * sizeof(float));
  }
  group_rules_ = DeviceBuffer(static_cast<std::size_t>(num_groups_) * sizeof(sf_group_rules));
  group_scalars_ = DeviceBuffer(static_cast<std::size_t>(num_groups_) * SF_MAX_SCALARS * sizeof(float));
  step_state_ = DeviceBuffer(sizeof(sf_step_state));
  cuda::check(a.cuMemsetD8Async(step_state_.get(), 0, sizeof(sf_step_state), stream_), "cuMemsetD8Async");
  // The host tables must outlive their asynchronous copies.
  synchronize();
}

static_assert(SF_Q8_BLOCK == cpu::kQ8Block, "the kernels' q8 blocks are the CPU's");

void CudaBackend::init_packed_state(const StepPrograms& programs, std::vector<sf_tensor>& tensors) {
  const CudaUtilities& util = cuda_utilities(*ctx_);
  ctx_->make_current();
  const jit::PackedState& plan = packed_state_;
  for (int b = 0; b < kMaxStreams; ++b) {
    tensor_format_[b].assign(params_.size(), StateFormat::f32);  // (a buffer of empty tensors only has no bytes)
    if (plan.bytes[static_cast<std::size_t>(b)] == 0) continue;
    state_[b] = DeviceBuffer(static_cast<std::size_t>(plan.bytes[static_cast<std::size_t>(b)]));
    if (plan.absmaxes[static_cast<std::size_t>(b)] > 0)
      absmax_[b] = DeviceBuffer(static_cast<std::size_t>(plan.absmaxes[static_cast<std::size_t>(b)]) * sizeof(float));
  }
  // Host tables copied on the stream (ordered before the first step, whatever kind of
  // stream it is), kept until a synchronize: every 64 MiB, and at the end.
  std::vector<std::shared_ptr<const void>> pending;
  std::size_t pending_bytes = 0;
  const auto upload = [&]<class T>(cuda::CUdeviceptr dst, std::vector<T> table) {
    const auto held = std::make_shared<const std::vector<T>>(std::move(table));
    const std::size_t bytes = held->size() * sizeof(T);
    cuda::check(api().cuMemcpyHtoDAsync(dst, held->data(), bytes, stream_), "cuMemcpyHtoDAsync");
    pending.push_back(held);
    if ((pending_bytes += bytes) > (std::size_t{64} << 20)) synchronize(), pending.clear(), pending_bytes = 0;
  };
  // Every tensor's addresses, and its state's initial values: f32 filled on the device;
  // bf16 and q8 as the CPU encodes them, a constant encoding to one bit pattern, or to one
  // code and one absmax (the codes a memset, the bf16 patterns and absmaxes copied).
  std::vector<sf_tensor_state> table(params_.size());
  bool q8 = false;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto k = static_cast<std::size_t>(tensors[i].combo);
    const Program& prog = *programs.groups[programs.tensor_group[i]].program;
    const long long n = tensors[i].numel;
    for (int s = 0; s < kMaxStreams; ++s) {
      const int b = plan.buffer[i][static_cast<std::size_t>(s)];
      if (b < 0) continue;
      const StateFormat f = spec_.combo_formats[k][static_cast<std::size_t>(s)];
      const bool nonnegative = prog.streams[s].values == StateValues::nonnegative;
      tensor_format_[b][i] = f;
      nonnegative_[b] = nonnegative;
      cuda::CUdeviceptr data = state_[b].get() + static_cast<std::size_t>(plan.at[i][static_cast<std::size_t>(s)]);
      table[i].data[s] = reinterpret_cast<void*>(data);
      cuda::CUdeviceptr absmax = 0;
      if (f == StateFormat::q8) {
        q8 = true;
        absmax = absmax_[b].get() + static_cast<std::size_t>(plan.absmax_at[i][static_cast<std::size_t>(s)]) * sizeof(float);
        table[i].absmax[s] = reinterpret_cast<float*>(absmax);
      }
      float value = programs.groups[programs.tensor_group[i]].state_init[s];
      if (n == 0) continue;
      if (f == StateFormat::f32) {
        long long count = n;
        void* args[] = {&data, &count, &value};
        launch(util.fill, "sf_fill", grid_for(n, 256), 256, stream_, args);
        continue;
      }
      std::uint8_t one[2] = {};
      float one_absmax = 0.0f;
      if (f == StateFormat::bf16) {
        cpu::narrow(&value, DType::bf16, one, 1);
        std::uint16_t bits = 0;
        std::memcpy(&bits, one, sizeof bits);
        upload(data, std::vector<std::uint16_t>(static_cast<std::size_t>(n), bits));
        continue;
      }
      cpu::q8_quantize(&value, one, &one_absmax, 1, nonnegative ? cpu::Q8Map::unsigned_dynamic : cpu::Q8Map::signed_dynamic);
      cuda::check(api().cuMemsetD8Async(data, one[0], static_cast<std::size_t>(n), stream_), "cuMemsetD8Async");
      upload(absmax, std::vector<float>(static_cast<std::size_t>(jit::q8_blocks(n)), one_absmax));
    }
  }
  tensor_state_ = upload_table(table, stream_);
  for (std::size_t i = 0; i < params_.size(); ++i) tensors[i].state = tensor_state_.as<const sf_tensor_state>() + i;
  if (q8) {  // the maps, as sf_hyper.q8_maps holds them
    std::vector<float> maps(4 * SF_Q8_BLOCK);
    cpu::q8_device_maps(maps.data());
    q8_maps_ = upload_table(maps, stream_);
  }
  synchronize();  // the host tables above may go
}

std::size_t CudaBackend::state_bytes(int slot) const {
  return packed_ ? static_cast<std::size_t>(packed_state_.bytes[static_cast<std::size_t>(slot)])
                 : static_cast<std::size_t>(layout_.state_elems) * sizeof(float);
}

void CudaBackend::set_grads(const std::vector<Param>& params) {
  check_device_pointers(params, options_.device.index, /*grads_only=*/true);
  // The kernels were specialized for the old pointers' layout class: a flat spec reads
  // one contiguous gradient buffer, an aligned one uses vector loads.
  const jit::CudaLayout probe = jit::plan_cuda_layout(program_, params, options_, /*allow_flat=*/num_groups_ == 1);
  if ((spec_.flat && !probe.spec.flat) || (spec_.aligned16 && !probe.spec.aligned16))
    throw Error(ErrorCode::unsupported,
                std::string("set_grads: the new gradients are not ") +
                    (spec_.flat && !probe.spec.flat ? "one contiguous buffer in parameter order"
                                                    : "aligned to 4 elements") +
                    " as the old ones were, and this optimizer's CUDA kernels were specialized for that; build a new "
                    "Optimizer over the new gradients");
  ctx_->make_current();
  std::vector<sf_tensor> table = host_tensors_;
  for (std::size_t i = 0; i < params.size(); ++i) table[i].grad = params[i].grad.data;
  // Pageable memory: the driver has staged the copy when the call returns.
  if (!table.empty())
    cuda::check(api().cuMemcpyHtoDAsync(tensors_.get(), table.data(), table.size() * sizeof(sf_tensor), stream_),
                "cuMemcpyHtoDAsync");
  host_tensors_ = std::move(table);
  params_ = params;
}

CudaBackend::~CudaBackend() {
  // Kernels still running use our buffers: wait for them. Never throws: a failure is
  // reported (cuda::report), and the buffers are freed all the same.
  const cuda::DriverApi* a = cuda::driver();
  if (a == nullptr || !ctx_) return;
  try {
    ctx_->make_current();
  } catch (const std::exception& e) {
    cuda::report_exception(e);
    return;
  }
  cuda::report(a->cuStreamSynchronize(stream_), "cuStreamSynchronize");
}

void CudaBackend::synchronize() const {
  ctx_->make_current();
  cuda::check(api().cuStreamSynchronize(stream_), "cuStreamSynchronize");
}

StepResult CudaBackend::step(const StepRequest& request, std::vector<double>&) {
  ctx_->make_current();
  if (host_touched_) {  // a host copy handed out since the last step may have changed: copy it back
    for (int s = 0; s < kMaxStreams; ++s) {
      if (state_[s].get() != 0 && host_state_[s].size() > 0)
        cuda::check(api().cuMemcpyHtoDAsync(state_[s].get(), host_state_[s].data(), state_bytes(s), stream_),
                    "cuMemcpyHtoDAsync");
      if (absmax_[s].get() != 0 && host_absmax_[s].size() > 0)
        cuda::check(api().cuMemcpyHtoDAsync(absmax_[s].get(), host_absmax_[s].data(), absmax_[s].bytes(), stream_),
                    "cuMemcpyHtoDAsync");
    }
    if (layout_.master_elems > 0)
      cuda::check(api().cuMemcpyHtoDAsync(masters_.get(), host_masters_.data(),
                                          static_cast<std::size_t>(layout_.master_bytes()), stream_),
                  "cuMemcpyHtoDAsync");
    synchronize();  // done before the host copy can change again
    host_touched_ = false;
  }
  // The rules are on the device already (set_rules): a graph captured here reads them at each replay.
  sf_hyper hyper{};
  hyper.groups = group_rules_.as<const sf_group_rules>();
  hyper.scalars = group_scalars_.as<float>();
  hyper.num_groups = num_groups_;
  hyper.max_grad_norm = options_.max_grad_norm ? *options_.max_grad_norm : 0.0;
  hyper.seed = options_.seed;
  hyper.q8_maps = q8_maps_.as<const float>();
  const bool clip = options_.max_grad_norm.has_value();
  const bool reduce = request.scaled || clip || options_.track_grad_norm || request.device_scale != nullptr;
  cuda::CUdeviceptr tensors = tensors_.get(), chunks = chunks_.get(), blocks = blocks_.get();
  cuda::CUdeviceptr partials = partials_.get(), sums = tensor_sums_.get(), st = step_state_.get();
  if (reduce) {
    int num_tensors = static_cast<int>(params_.size());
    int num_chunks = num_chunks_;
    const float* scale_ptr = request.device_scale;
    double scale_value = request.loss_scale;  // a double: must match sf_reduce (jit/cuda/kernels/reduce_kernel.cuh)
    int check_finite = request.scaled || request.device_scale != nullptr || clip ? 1 : 0;
    sf_scaler_state* scaler = request.scaler;
    const unsigned grid = static_cast<unsigned>(std::max((num_chunks_ + SF_REDUCE_WARPS - 1) / SF_REDUCE_WARPS, 1));
    if (shard_ != nullptr) {
      // The sharded step: this rank's values, every rank's (the step's one collective,
      // on the communicator's stream: the optimizer's), then the model's combine.
      sf_shard shard = shard_args_;
      void* reduce_args[] = {&tensors, &num_tensors, &chunks, &num_chunks, &partials, &st, &shard};
      launch(reduce_shard_, "sf_reduce_shard", grid, 32 * SF_REDUCE_WARPS, stream_, reduce_args);
      shard_->device_communicator().all_gather(shard_send_.as<void>(), shard_recv_.as<void>(),
                                               static_cast<std::size_t>(shard.stride), CommType::f64);
      void* finalize_args[] = {&shard, &sums, &num_tensors, &st, &hyper, &scale_ptr, &scale_value, &check_finite, &scaler};
      launch(shard_finalize_, "sf_shard_finalize", 1, SF_SHARD_THREADS, stream_, finalize_args);
    } else {
      void* args[] = {&tensors, &num_tensors, &chunks,      &num_chunks,   &partials, &sums,
                      &st,      &hyper,       &scale_ptr,   &scale_value,  &check_finite, &scaler};
      launch(reduce_, "sf_reduce", grid, 32 * SF_REDUCE_WARPS, stream_, args);
    }
  }
  if (shard_ != nullptr && !reduce)  // a plain step has no collective: no rank refused it
    cuda::check(api().cuMemsetD8Async(shard_refused_.get(), 0xff, sizeof(int), stream_), "cuMemsetD8Async");
  sf_streams streams{};
  for (int s = 0; s < kMaxStreams; ++s) streams.s[s] = state_[s].as<float>();
  long long flat_numel = layout_.state_elems;  // the flat layout's elements (jit::CudaLayout::flat_numel)
  int plain = reduce ? 0 : 1;
  // A two-phase program: phase 1 over the reduce chunks, each tensor's norms, then
  // sf_update runs phase 2, reading them (its last parameter; a one-phase sf_update has
  // none, and the driver reads only as many parameters as the kernel has).
  cuda::CUdeviceptr norms = norms_.get();
  if (phase1_ != nullptr) {
    cuda::CUdeviceptr norm_sums = norm_sums_.get();
    int num_chunks = num_chunks_, num_tensors = static_cast<int>(params_.size());
    void* phase1_args[] = {&tensors, &chunks, &num_chunks, &streams, &norm_sums, &st, &hyper, &plain};
    const unsigned grid = static_cast<unsigned>(std::max((num_chunks_ + SF_REDUCE_WARPS - 1) / SF_REDUCE_WARPS, 1));
    launch(phase1_, "sf_phase1", grid, 32 * SF_REDUCE_WARPS, stream_, phase1_args);
    void* combine_args[] = {&tensors, &num_tensors, &norm_sums, &norms, &st, &plain};
    launch(combine_, "sf_phase_combine", 1, 256, stream_, combine_args);  // SF_COMBINE_THREADS
  }
  void* args[] = {&tensors, &blocks, &flat_numel, &streams, &st, &hyper, &plain, &norms};
  launch(update_, "sf_update", static_cast<unsigned>(num_update_blocks_), SF_UPDATE_THREADS, stream_, args);
  host_current_ = false;
  StepResult pending;
  pending.pending = true;
  return pending;
}

void CudaBackend::scale_tensors(const std::vector<TensorView>& tensors, float factor) {
  ctx_->make_current();
  if (factor_.get() == 0) factor_ = DeviceBuffer(sizeof(float));
  // From pageable memory: the copy is staged before the call returns, so `factor` may go.
  cuda::check(api().cuMemcpyHtoDAsync(factor_.get(), &factor, sizeof factor, stream_), "cuMemcpyHtoDAsync");
  const CudaUtilities& util = cuda_utilities(*ctx_);
  for (const TensorView& t : tensors) {
    if (t.numel == 0) continue;
    void* data = t.data;
    long long n = t.numel;
    const float* scale = factor_.as<float>();
    int reciprocal = 0;
    int* found_inf = nullptr;
    void* args[] = {&data, &n, &scale, &reciprocal, &found_inf};
    launch(util.scale[static_cast<int>(t.dtype)], "sf_scale", grid_for(n, 256), 256, stream_, args);
  }
}

StepResult CudaBackend::read_result(std::vector<double>* tensor_norms) const {
  synchronize();
  if (shard_ != nullptr) {  // a rank refused this step: nothing was applied anywhere
    int refused = -1;
    cuda::check(api().cuMemcpyDtoH(&refused, shard_refused_.get(), sizeof refused), "cuMemcpyDtoH");
    if (refused >= 0) Shard::throw_refused(static_cast<std::size_t>(refused));
  }
  sf_step_state st{};
  cuda::check(api().cuMemcpyDtoH(&st, step_state_.get(), sizeof st), "cuMemcpyDtoH");
  StepResult r;
  r.applied = st.applied != 0;
  r.found_inf = st.found_inf != 0;
  r.grad_norm = st.grad_norm;
  r.clip_coef = st.clip_coef;
  if (tensor_norms != nullptr) {
    tensor_norms->assign(params_.size(), NAN);
    if (!std::isnan(st.grad_norm) && st.loss_scale > 0) {
      std::vector<double> sums(params_.size());
      cuda::check(api().cuMemcpyDtoH(sums.data(), tensor_sums_.get(), sums.size() * sizeof(double)), "cuMemcpyDtoH");
      const bool inf_norm = options_.norm_type == INFINITY;
      for (std::size_t t = 0; t < sums.size(); ++t)
        (*tensor_norms)[t] = (inf_norm ? sums[t] : std::sqrt(sums[t])) / st.loss_scale;
    }
  }
  return r;
}

std::int64_t CudaBackend::step_count() const {
  synchronize();
  long long step = 0;
  cuda::check(api().cuMemcpyDtoH(&step, step_state_.get() + offsetof(sf_step_state, step), sizeof step), "cuMemcpyDtoH");
  return step;
}

void CudaBackend::set_rules(const GroupRules* groups) {
  ctx_->make_current();
  int capturing = cuda::CU_STREAM_CAPTURE_STATUS_NONE;
  cuda::check(api().cuStreamIsCapturing(stream_, &capturing), "cuStreamIsCapturing");
  if (capturing != cuda::CU_STREAM_CAPTURE_STATUS_NONE)
    throw Error(ErrorCode::invalid_state,
                "hyperparameters changed (set_lr, set_config, a checkpoint load) while the optimizer's stream is being "
                "captured into a CUDA graph; change them between replays: the captured steps read them from device "
                "memory at every replay");
  std::vector<sf_group_rules> rules(static_cast<std::size_t>(num_groups_));
  for (std::size_t g = 0; g < rules.size(); ++g) {
    for (int k = 0; k < SF_MAX_SCALARS; ++k) rules[g].rules[k] = groups[g].rules[k];
    rules[g].step_base = groups[g].step_base;
  }
  // Ordered after the steps already enqueued and before the next; from pageable memory
  // the copy is staged before the call returns, so `rules` may go.
  cuda::check(api().cuMemcpyHtoDAsync(group_rules_.get(), rules.data(), rules.size() * sizeof(sf_group_rules), stream_),
              "cuMemcpyHtoDAsync");
}

void CudaBackend::set_step_count(std::int64_t n) {
  synchronize();
  const long long step = n;
  cuda::check(api().cuMemcpyHtoDAsync(step_state_.get() + offsetof(sf_step_state, step), &step, sizeof step, stream_),
              "cuMemcpyHtoDAsync");
  synchronize();  // `step` goes out of scope
}

void CudaBackend::host_view() const {
  if (!host_current_) {
    synchronize();
    for (int s = 0; s < kMaxStreams; ++s) {
      if (state_[s].get() == 0) continue;
      const std::size_t bytes = state_bytes(s);
      if (host_state_[s].size() == 0) host_state_[s] = AlignedBuffer(std::max<std::size_t>((bytes + 3) / 4, 1));
      if (bytes > 0) cuda::check(api().cuMemcpyDtoH(host_state_[s].data(), state_[s].get(), bytes), "cuMemcpyDtoH");
      if (absmax_[s].get() == 0) continue;
      if (host_absmax_[s].size() == 0) host_absmax_[s] = AlignedBuffer(absmax_[s].bytes() / sizeof(float));
      cuda::check(api().cuMemcpyDtoH(host_absmax_[s].data(), absmax_[s].get(), absmax_[s].bytes()), "cuMemcpyDtoH");
    }
    if (layout_.master_elems > 0) {
      if (host_masters_.size() == 0) host_masters_ = AlignedBuffer(static_cast<std::size_t>((layout_.master_bytes() + 3) / 4));
      cuda::check(api().cuMemcpyDtoH(host_masters_.data(), masters_.get(),
                                     static_cast<std::size_t>(layout_.master_bytes())),
                  "cuMemcpyDtoH");
    }
    host_current_ = true;
  }
  host_touched_ = true;
}

float* CudaBackend::state_data(int buffer) const {
  host_view();
  return host_state_[stream_of_buffer_[static_cast<std::size_t>(buffer)]].data();
}

StateSlot CudaBackend::state_slot(int buffer, std::size_t tensor) const {
  if (!packed_) return Backend::state_slot(buffer, tensor);
  host_view();
  const int b = stream_of_buffer_[static_cast<std::size_t>(buffer)];
  // (the tensor's program stream that is buffer b: its offsets are by program stream)
  const auto& buffers = packed_state_.buffer[tensor];
  const auto s = static_cast<std::size_t>(std::find(buffers.begin(), buffers.end(), b) - buffers.begin());
  if (s == buffers.size()) return {};  // the tensor's program has no such stream (the engine never asks)
  StateSlot slot;
  slot.format = tensor_format_[b][tensor];
  slot.data = reinterpret_cast<char*>(host_state_[b].data()) + packed_state_.at[tensor][s];
  if (slot.format == StateFormat::q8) slot.absmax = host_absmax_[b].data() + packed_state_.absmax_at[tensor][s];
  slot.nonnegative = nonnegative_[b];
  return slot;
}

float* CudaBackend::masters_data() const {
  host_view();
  return host_masters_.data();
}

// ---- the sharded step ----

void CudaBackend::set_shard(Shard* shard) {
  if (shard == nullptr) return;
  ctx_->make_current();
  const Shard::DevicePlan plan = shard->device_plan();
  shard_tables_[0] = upload_table(plan.send_at, stream_);
  shard_tables_[1] = upload_table(plan.send_whole, stream_);
  shard_tables_[2] = upload_table(plan.order, stream_);
  shard_tables_[3] = upload_table(plan.tensor_begin, stream_);
  shard_tables_[4] = upload_table(plan.local_tensor, stream_);
  shard_send_ = DeviceBuffer(plan.stride * sizeof(double));
  shard_recv_ = DeviceBuffer(plan.stride * plan.ranks * sizeof(double));
  shard_sums_ = DeviceBuffer(std::max<std::size_t>(plan.tensor_begin.size() - 1, 1) * sizeof(double));
  shard_refused_ = DeviceBuffer(sizeof(int));
  std::vector<double> refusal(plan.stride, 0.0);
  refusal.back() = 1.0;  // the refused flag (shard_kernel.cuh: send[stride - 1])
  shard_refusal_ = upload_table(refusal, stream_);
  cuda::check(api().cuMemsetD8Async(shard_refused_.get(), 0xff, sizeof(int), stream_), "cuMemsetD8Async");  // -1
  if (options_.stochastic_rounding) {  // the rounding counts elements by their index in the whole model
    for (std::size_t i = 0; i < host_tensors_.size(); ++i) host_tensors_[i].model_index = shard->model_index_of(i);
    cuda::check(api().cuMemcpyHtoDAsync(tensors_.get(), host_tensors_.data(), host_tensors_.size() * sizeof(sf_tensor),
                                        stream_),
                "cuMemcpyHtoDAsync");
  }
  cuda::check(api().cuStreamSynchronize(stream_), "cuStreamSynchronize");  // the host tables above may go
  sf_shard& a = shard_args_;
  a.send_at = shard_tables_[0].as<const long long>();
  a.send_whole = shard_tables_[1].as<const int>();
  a.send = shard_send_.as<double>();
  a.recv = shard_recv_.as<const double>();
  a.order = shard_tables_[2].as<const unsigned int>();
  a.tensor_begin = shard_tables_[3].as<const long long>();
  a.local_tensor = shard_tables_[4].as<const int>();
  a.model_sums = shard_sums_.as<double>();
  a.refused = shard_refused_.as<int>();
  a.stride = static_cast<long long>(plan.stride);
  a.num_model_tensors = static_cast<int>(plan.tensor_begin.size() - 1);
  a.ranks = static_cast<int>(plan.ranks);
  shard_ = shard;
}

void CudaBackend::refuse_shard_step() {
  ctx_->make_current();
  // A device-to-device copy: asynchronous, and legal while the stream is captured.
  const std::size_t stride = static_cast<std::size_t>(shard_args_.stride);
  cuda::check(api().cuMemcpyDtoDAsync(shard_send_.get(), shard_refusal_.get(), stride * sizeof(double), stream_),
              "cuMemcpyDtoDAsync");
  shard_->device_communicator().all_gather(shard_send_.as<void>(), shard_recv_.as<void>(), stride, CommType::f64);
}

}  // namespace stepfuse::detail
