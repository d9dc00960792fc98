// Compiled with the jit layer's include root by the layering tests (tests/CMakeLists.txt):
// jit/ must not see runtime/, so this include must fail to resolve.
#include "runtime/step_engine.hpp"
