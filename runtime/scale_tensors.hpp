// Internal: multiplying caller tensors in place by a loss-scale factor.
#pragma once

#include <span>

#include "stepfuse/types.hpp"

namespace stepfuse::detail {

class ThreadPool;

// x *= s for every element of every tensor (computed in fp32, rounded to the
// storage dtype), in parallel on `pool`. Returns whether any element was inf or
// NaN before the multiplication (what GradScaler.unscale_ records), when
// `check_finite` is set; false otherwise.
bool scale_tensors(std::span<const TensorView> tensors, float s, bool check_finite, ThreadPool& pool);

// Throws Error(invalid_argument), naming `what`, for a view with a bad dtype, a
// negative size, or null data with numel > 0.
void validate_views(std::span<const TensorView> tensors, const char* what);

}  // namespace stepfuse::detail
