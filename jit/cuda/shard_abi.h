/* The sharded step's kernel argument (jit/cuda/kernels/shard_kernel.cuh): C, shared
 * by the host and the generated source of a sharded spec, whose text embeds it.
 * Internal: not part of the emit API's stepfuse/device_abi.h. */
#ifndef STEPFUSE_JIT_CUDA_SHARD_ABI_H_
#define STEPFUSE_JIT_CUDA_SHARD_ABI_H_

#define SF_SHARD_THREADS 256 /* sf_shard_finalize's block (one block) */

/* A sharded step's tables and buffers (OptimizerOptions::communicator), passed to
 * sf_reduce_shard and sf_shard_finalize by value; every pointer is device memory.
 * Built by the CUDA backend from the step's plan (runtime/shard.hpp). */
typedef struct sf_shard {
  const long long* send_at;      /* per local tensor: its first value in send */
  const int* send_whole;         /* per local tensor: 1: one value (its chunks' combine), 0: one per chunk */
  double* send;                  /* this rank's values, then found_inf, then refused: stride doubles */
  const double* recv;            /* every rank's send, in rank order: ranks * stride doubles */
  const unsigned int* order;     /* positions in recv: the model's values in the canonical order */
  const long long* tensor_begin; /* model tensor t: order[tensor_begin[t] .. tensor_begin[t + 1]) */
  const int* local_tensor;       /* local tensor i: its model tensor */
  double* model_sums;            /* per model tensor (scratch) */
  int* refused;                  /* out: the first rank that refused the step, else -1 */
  long long stride;
  int num_model_tensors;
  int ranks;
} sf_shard;

#endif /* STEPFUSE_JIT_CUDA_SHARD_ABI_H_ */
