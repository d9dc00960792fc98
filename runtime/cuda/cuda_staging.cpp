// host_communicator (runtime/shard.hpp): host buffers over a communicator of device
// memory (NCCL), for the sharded step's construction and checkpoints. Each
// collective copies its input to the device, runs, and copies the result back, all
// on the communicator's stream, then waits for that stream: a few small collectives
// per optimizer, never on the step's path.
#include <memory>
#include <string>

#include "runtime/cuda/cuda_backend.hpp"
#include "runtime/shard.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::detail {

namespace {

class StagedCommunicator final : public Communicator {
 public:
  explicit StagedCommunicator(std::shared_ptr<Communicator> device)
      : device_(std::move(device)), ctx_(device_->device().index), name_(std::string(device_->name()) + " (staged)") {}

  int rank() const override { return device_->rank(); }
  int size() const override { return device_->size(); }
  std::string_view name() const override { return name_; }

  void all_gather(const void* send, void* recv, std::size_t count, CommType type) override {
    const std::size_t bytes = count * comm_type_size(type);
    if (bytes == 0) return;  // (the same count on every rank: every rank skips it)
    ctx_.make_current();  // the buffers are the communicator's device's
    DeviceBuffer s(bytes), r(bytes * static_cast<std::size_t>(size()));
    to_device(s, send, bytes);
    device_->all_gather(s.as<void>(), r.as<void>(), count, type);
    to_host(recv, r, r.bytes());
  }
  void all_reduce(void* data, std::size_t count, CommType type, ReduceOp op) override {
    const std::size_t bytes = count * comm_type_size(type);
    if (bytes == 0) return;
    ctx_.make_current();  // the buffers are the communicator's device's
    DeviceBuffer d(bytes);
    to_device(d, data, bytes);
    device_->all_reduce(d.as<void>(), count, type, op);
    to_host(data, d, bytes);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, CommType type, ReduceOp op) override {
    const std::size_t bytes = count * comm_type_size(type);
    if (bytes == 0) return;
    ctx_.make_current();  // the buffers are the communicator's device's
    DeviceBuffer s(bytes * static_cast<std::size_t>(size())), r(bytes);
    to_device(s, send, s.bytes());
    device_->reduce_scatter(s.as<void>(), r.as<void>(), count, type, op);
    to_host(recv, r, bytes);
  }

 private:
  // Both copies on the communicator's stream, so that the collective between them is
  // ordered after the first and before the second; the host waits for the stream.
  void to_device(DeviceBuffer& dst, const void* src, std::size_t bytes) const {
    const cuda::DriverApi& a = *cuda::driver();
    cuda::check(a.cuMemcpyHtoDAsync(dst.get(), src, bytes, stream()), "cuMemcpyHtoDAsync");
  }
  void to_host(void* dst, const DeviceBuffer& src, std::size_t bytes) const {
    const cuda::DriverApi& a = *cuda::driver();
    cuda::check(a.cuMemcpyDtoHAsync(dst, src.get(), bytes, stream()), "cuMemcpyDtoHAsync");
    cuda::check(a.cuStreamSynchronize(stream()), "cuStreamSynchronize (waiting for the communicator's collective)");
  }
  cuda::CUstream stream() const { return static_cast<cuda::CUstream>(device_->cuda_stream()); }

  std::shared_ptr<Communicator> device_;
  CudaContext ctx_;
  std::string name_;
};

}  // namespace

std::shared_ptr<Communicator> host_communicator(std::shared_ptr<Communicator> comm) {
  if (comm == nullptr || comm->device().kind == Device::Kind::cpu) return comm;
  return std::make_shared<StagedCommunicator>(std::move(comm));
}

}  // namespace stepfuse::detail
