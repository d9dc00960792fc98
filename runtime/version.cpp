// The runtime version query.
#include "stepfuse/version.hpp"

#define STEPFUSE_STR2(x) #x
#define STEPFUSE_STR(x) STEPFUSE_STR2(x)

namespace stepfuse {
const char* version() {
  return STEPFUSE_STR(STEPFUSE_VERSION_MAJOR) "." STEPFUSE_STR(STEPFUSE_VERSION_MINOR) "." STEPFUSE_STR(
      STEPFUSE_VERSION_PATCH);
}
}  // namespace stepfuse
