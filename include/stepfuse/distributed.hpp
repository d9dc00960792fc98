// The step across processes: the collectives a sharded step needs, as an
// interface (Communicator) that MPI (<stepfuse/mpi.hpp>), NCCL (<stepfuse/nccl.hpp>)
// and others (the Python package's torch.distributed one) implement.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "stepfuse/types.hpp"

namespace stepfuse {

// Element types of a collective's buffers.
enum class CommType : std::uint8_t { u8, i32, i64, f16, bf16, f32, f64 };
constexpr std::size_t comm_type_size(CommType t) {
  switch (t) {
    case CommType::u8: return 1;
    case CommType::f16:
    case CommType::bf16: return 2;
    case CommType::i32:
    case CommType::f32: return 4;
    case CommType::i64:
    case CommType::f64: return 8;
  }
  return 0;
}
std::string_view comm_type_name(CommType t);  // "u8", "i32", ...

enum class ReduceOp : std::uint8_t { sum, max, min };
std::string_view reduce_op_name(ReduceOp op);  // "sum", "max", "min"

// A group of `size()` processes (ranks) that run the same sequence of collectives.
// Every call is collective: each rank makes the same calls, in the same order,
// with the same counts, types and ops; a rank that skips one leaves the others
// waiting (the step's own calls are arranged so that a refused input on one rank
// still makes them all: see OptimizerOptions::communicator).
//
// Buffers live on device(): host memory for a CPU communicator (MPI, gloo), device
// memory for a CUDA one (NCCL), whose calls are enqueued on its stream and return
// without waiting. A failure is an Error(device_error) naming the engine's error.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;  // 0 <= rank() < size()
  virtual int size() const = 0;
  // Where the buffers live (Device::cpu() unless overridden).
  virtual Device device() const { return Device::cpu(); }
  // A CUDA communicator: the CUDA stream (a CUstream / cudaStream_t) its calls are
  // enqueued on; nullptr is the legacy default stream. A sharded CUDA optimizer
  // requires it to be its own OptimizerOptions::cuda_stream, so that the step's
  // collective is ordered between the step's kernels. Unused for a CPU communicator.
  virtual void* cuda_stream() const { return nullptr; }
  // A short description for messages and benchmarks: "mpi", "nccl", "torch.distributed(gloo)".
  virtual std::string_view name() const = 0;

  // recv (size() * count elements) = every rank's `count` elements of send, in
  // rank order: rank r's at recv + r * count.
  virtual void all_gather(const void* send, void* recv, std::size_t count, CommType type) = 0;
  // data[i] = op over the ranks of data[i], in place, on every rank. count elements.
  virtual void all_reduce(void* data, std::size_t count, CommType type, ReduceOp op) = 0;
  // recv (count elements) = op over the ranks of send[rank() * count + i]: each rank
  // gets its own block of the reduction of send (size() * count elements).
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, CommType type, ReduceOp op) = 0;
};

// Where a parameter lies in the model when an Optimizer holds only a shard of it
// (OptimizerOptions::slices): elements [offset, offset + numel) of the model's
// tensor number `tensor`. Across the ranks, a tensor's slices must tile it
// exactly, each starting at a multiple of kShardAlign elements (the reduce
// pass's chunk: the canonical reduction order then covers the whole tensor as one
// process would).
struct TensorSlice {
  std::int64_t tensor = 0;  // the model's tensor: ranks' tensors are ordered by this id
  std::int64_t offset = 0;  // first element of the slice within that tensor
};
inline constexpr std::int64_t kShardAlign = 16384;

}  // namespace stepfuse
