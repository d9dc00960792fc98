// Chunk schedule and per-thread ranges.
#include "runtime/plan.hpp"

namespace stepfuse::detail {

Plan make_plan(const std::vector<std::int64_t>& numels, std::int64_t chunk_elems, int threads) {
  Plan plan;
  plan.tensor_chunks.reserve(numels.size() + 1);
  for (std::size_t t = 0; t < numels.size(); ++t) {
    plan.tensor_chunks.push_back(plan.chunks.size());
    for (std::int64_t b = 0; b < numels[t]; b += chunk_elems)
      plan.chunks.push_back({static_cast<std::uint32_t>(t), b, numels[t] - b < chunk_elems ? numels[t] - b : chunk_elems});
    plan.total_elems += numels[t];
  }
  plan.tensor_chunks.push_back(plan.chunks.size());

  // Thread t starts at the first chunk whose starting element count reaches
  // t/threads of the total (a fixed cost per chunk is counted as 256 elements,
  // so lists of many tiny tensors are split by count too).
  constexpr std::int64_t kChunkCost = 256;
  std::int64_t total = 0;
  for (const Chunk& c : plan.chunks) total += c.len + kChunkCost;
  plan.thread_chunks.assign(threads + 1, plan.chunks.size());
  plan.thread_chunks[0] = 0;
  std::int64_t seen = 0;
  int t = 1;
  for (std::size_t c = 0; c < plan.chunks.size() && t < threads; ++c) {
    while (t < threads && seen * threads >= total * t) plan.thread_chunks[t++] = c;
    seen += plan.chunks[c].len + kChunkCost;
  }
  return plan;
}

}  // namespace stepfuse::detail
