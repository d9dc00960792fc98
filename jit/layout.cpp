// Layout planning: combinations, offsets, chunks, and the chunks' split among threads.
#include "jit/layout.hpp"

#include <algorithm>
#include <stdexcept>

#include "jit/step_scalars.h"
#include "jit/cuda/device_abi.h"  // after jit/step_scalars.h, which it needs
#include "stepfuse/program.hpp"

namespace stepfuse::jit {

// The constants the C headers share with C++ (jit/cuda/device_abi.h; jit/llvm/cpu_abi.h
// is checked in jit/llvm/kernel_abi.cpp).
static_assert(kChunkElems == SF_CHUNK_ELEMS, "the CPU and CUDA reduce chunks are the same numerics");
static_assert(SF_MAX_SCALARS == kMaxScalars && SF_MAX_STREAMS == kMaxStreams,
              "the CUDA ABI's limits are the update program's (stepfuse/program.hpp)");

namespace {

// The index of `x` in `list`, appended if absent (first-use order).
template <class T>
int index_of(std::vector<T>& list, const T& x) {
  auto it = std::find(list.begin(), list.end(), x);
  if (it == list.end()) it = list.insert(list.end(), x);
  return static_cast<int>(it - list.begin());
}

}  // namespace

Layout plan_layout(const std::vector<TensorShape>& tensors, bool flat) {
  Layout l;
  bool masters = false;
  l.tensor_chunks.reserve(tensors.size() + 1);
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const TensorShape& s = tensors[t];
    l.tensor_combo.push_back(index_of(l.combos, s.combo));
    l.tensor_reduce.push_back(index_of(l.reduce_grads, s.combo.grad));
    const std::int64_t padded = flat ? s.numel : (s.numel + 15) / 16 * 16;
    l.offsets.push_back(l.state_elems);
    l.state_elems += padded;
    l.master_offsets.push_back(s.combo.has_master_slot() ? l.master_elems : -1);
    if (s.combo.has_master_slot()) l.master_elems += padded;
    if (s.combo.compensated) l.master_elem_bytes = 2;
    if (s.combo.master) masters = true;
    l.tensor_chunks.push_back(l.chunks.size());
    for (std::int64_t b = 0; b < s.numel; b += kChunkElems)
      l.chunks.push_back({static_cast<std::uint32_t>(t), b, std::min(kChunkElems, s.numel - b)});
  }
  l.tensor_chunks.push_back(l.chunks.size());
  if (masters && l.master_elem_bytes != 4)
    throw std::logic_error("plan_layout: fp32 masters and bf16 compensations in one tensor list");
  return l;
}

std::vector<std::size_t> split_chunks(const std::vector<Chunk>& chunks, int threads) {
  // Thread t starts at the first chunk whose starting element count reaches
  // t/threads of the total (a fixed cost per chunk is counted as 256 elements,
  // so lists of many tiny tensors are split by count too).
  constexpr std::int64_t kChunkCost = 256;
  std::int64_t total = 0;
  for (const Chunk& c : chunks) total += c.len + kChunkCost;
  std::vector<std::size_t> starts(static_cast<std::size_t>(threads) + 1, chunks.size());
  starts[0] = 0;
  std::int64_t seen = 0;
  int t = 1;
  for (std::size_t c = 0; c < chunks.size() && t < threads; ++c) {
    while (t < threads && seen * threads >= total * t) starts[static_cast<std::size_t>(t++)] = c;
    seen += chunks[c].len + kChunkCost;
  }
  return starts;
}

}  // namespace stepfuse::jit
