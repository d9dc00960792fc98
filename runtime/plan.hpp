// The work plan for a tensor list: fixed-size chunks and per-thread ranges,
// computed once when an optimizer is built.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace stepfuse::detail {

struct Chunk {
  std::uint32_t tensor = 0;
  std::int64_t begin = 0;  // first element within the tensor
  std::int64_t len = 0;
};

struct Plan {
  std::vector<Chunk> chunks;                   // tensor order, then element order
  std::vector<std::size_t> tensor_chunks;      // tensor t owns chunks [tensor_chunks[t], tensor_chunks[t+1])
  std::vector<std::size_t> thread_chunks;      // thread t runs chunks [thread_chunks[t], thread_chunks[t+1])
  std::int64_t total_elems = 0;
  int threads() const { return static_cast<int>(thread_chunks.size()) - 1; }
};

// Splits every tensor into chunks of `chunk_elems` (the last one shorter), and
// gives each thread a contiguous run of chunks with about the same number of
// elements. The chunks, not the threads, fix the reduction order, so results do
// not depend on the thread count.
Plan make_plan(const std::vector<std::int64_t>& numels, std::int64_t chunk_elems, int threads);

}  // namespace stepfuse::detail
