// The consumer of stepfuse::nccl: links it and loads NCCL as an application would (no GPU
// is needed to load libnccl.so.2; a machine without NCCL gets the Error that says so).
#include <cstdio>
#include <string>

#include <stepfuse/error.hpp>
#include <stepfuse/nccl.hpp>

int main() {
  try {
    std::printf("nccl: %s\n", stepfuse::nccl_library().c_str());
  } catch (const stepfuse::Error& e) {
    std::printf("nccl: not loadable here: %s\n", e.what());
  }
  try {
    stepfuse::nccl_communicator(nullptr, nullptr);
    std::puts("nccl_communicator accepted a null comm");
    return 1;
  } catch (const stepfuse::Error& e) {
    std::printf("nccl_communicator(nullptr): %s\n", e.what());
  }
  std::puts("consumer OK");
  return 0;
}
