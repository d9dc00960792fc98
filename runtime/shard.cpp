// placeholder: the sharded step's plan (filled in next)
#include "runtime/shard.hpp"
