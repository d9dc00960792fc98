// Resident memory of this process: the current figure and the peak (high-water mark).
#pragma once

#include <cstdint>

namespace stepfuse::bench {

// Peak resident set size so far, in bytes (getrusage's ru_maxrss). It never decreases,
// so a phase whose peak must be attributed to it has to run before bigger ones.
std::int64_t peak_rss_bytes();

// Current resident set size in bytes (/proc/self/statm); 0 where unavailable.
std::int64_t current_rss_bytes();

}  // namespace stepfuse::bench
