// Internal: emitting warnings through the user's handler.
#pragma once

#include <string_view>

namespace stepfuse::detail {

// Sends `message` to the warning handler the first time `key` is seen in this
// process; later calls with the same key do nothing. Thread-safe.
void warn_once(std::string_view key, std::string_view message);
// Forgets which keys were seen (tests).
void reset_warnings_for_testing();

}  // namespace stepfuse::detail
