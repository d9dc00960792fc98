// Compiled with the jit layer's include root by the layering tests (tests/CMakeLists.txt):
// the control case, a header of the layer itself and of the bottom layer, must compile.
#include "jit/base/warning.hpp"
#include "jit/layout.hpp"
