// Multiplying caller tensors in place by a loss-scale factor, chunked and threaded.
#include "runtime/scale_tensors.hpp"

#include <atomic>
#include <string>
#include <vector>

#include "runtime/cpu/kernels.hpp"
#include "runtime/thread_pool.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::detail {

void validate_views(std::span<const TensorView> tensors, const char* what) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& v = tensors[i];
    const std::string name = std::string(what) + "[" + std::to_string(i) + "]";
    if (static_cast<unsigned>(v.dtype) > static_cast<unsigned>(DType::bf16))
      throw Error(ErrorCode::invalid_argument, name + ".dtype = " + std::to_string(static_cast<int>(v.dtype)) +
                                                   " is not a DType (use DType::f32, f16 or bf16)");
    if (v.numel < 0) throw Error(ErrorCode::invalid_argument, name + ".numel = " + std::to_string(v.numel) + " is negative");
    if (v.numel > 0 && v.data == nullptr)
      throw Error(ErrorCode::invalid_argument, name + ".data is null with numel = " + std::to_string(v.numel));
  }
}

bool scale_tensors(std::span<const TensorView> tensors, float s, bool check_finite, ThreadPool& pool) {
  struct Piece {
    const TensorView* view;
    std::int64_t begin, len;
  };
  std::vector<Piece> pieces;
  for (const TensorView& v : tensors)
    for (std::int64_t b = 0; b < v.numel; b += static_cast<std::int64_t>(cpu::kChunkElems))
      pieces.push_back({&v, b, std::min<std::int64_t>(static_cast<std::int64_t>(cpu::kChunkElems), v.numel - b)});
  std::atomic<bool> found{false};
  const std::size_t threads = static_cast<std::size_t>(pool.size());
  pool.run([&](int t) {
    const std::size_t lo = pieces.size() * static_cast<std::size_t>(t) / threads;
    const std::size_t hi = pieces.size() * static_cast<std::size_t>(t + 1) / threads;
    bool nonfinite = false;
    for (std::size_t i = lo; i < hi; ++i) {
      const Piece& p = pieces[i];
      char* data = static_cast<char*>(p.view->data) + p.begin * static_cast<std::int64_t>(dtype_size(p.view->dtype));
      const std::size_t n = static_cast<std::size_t>(p.len);
      if (check_finite) nonfinite |= cpu::reduce_kernel(p.view->dtype, cpu::NormKind::inf)(data, n).nonfinite;
      if (s != 1.0f) cpu::scale_inplace(p.view->dtype, data, n, s);
    }
    if (nonfinite) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

}  // namespace stepfuse::detail
