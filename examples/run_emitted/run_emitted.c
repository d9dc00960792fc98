/* stepfuse-run-emitted: a program that launches kernels emitted by stepfuse-emit-kernel
 * without stepfuse at run time, the way a compiler's generated code would. It does not
 * link stepfuse: everything comes from the files the emitter wrote (emitted_kernel.h
 * embeds the CUBIN, the PTX, the scalar rules and the tables; stepfuse_device_abi.h
 * declares the structs), and the CUDA driver is loaded with dlopen.
 *
 * Without a GPU it checks what it can on the host (its own tables, computed from the
 * sizes by the rules the ABI states, against the embedded ones), prints "no GPU:
 * skipping the launch" and exits 0. On a GPU it runs loss-scaled, clipped steps of the
 * emitted Lion variant (and one with an inf gradient, which must write nothing) and
 * checks the weights and state against a float64 reference. Exit status 1 on any mismatch. */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepfuse_device_abi.h"
#include "emitted_kernel.h"

/* ---- The driver API, by dlopen (no cuda.h, no link to libcuda) -------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUstream;
typedef unsigned long long CUdeviceptr;
enum { kComputeCapabilityMajor = 75, kComputeCapabilityMinor = 76 };

static struct {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t);
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t);
  CUresult (*cuMemsetD32)(CUdeviceptr, unsigned, size_t);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                             void**, void**);
  CUresult (*cuCtxSynchronize)(void);
  CUresult (*cuGetErrorString)(CUresult, const char**);
} cu;

/* Loads the entry points (the versioned names cuda.h's macros would pick). 0 on success. */
static int load_driver(char* why, size_t cap) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    snprintf(why, cap, "no CUDA driver (%s)", dlerror());
    return 1;
  }
  struct {
    const char* name;
    void* slot;
  } syms[] = {{"cuInit", &cu.cuInit},
              {"cuDeviceGetCount", &cu.cuDeviceGetCount},
              {"cuDeviceGet", &cu.cuDeviceGet},
              {"cuDeviceGetAttribute", &cu.cuDeviceGetAttribute},
              {"cuDevicePrimaryCtxRetain", &cu.cuDevicePrimaryCtxRetain},
              {"cuDevicePrimaryCtxRelease_v2", &cu.cuDevicePrimaryCtxRelease},
              {"cuCtxSetCurrent", &cu.cuCtxSetCurrent},
              {"cuModuleLoadData", &cu.cuModuleLoadData},
              {"cuModuleUnload", &cu.cuModuleUnload},
              {"cuModuleGetFunction", &cu.cuModuleGetFunction},
              {"cuMemAlloc_v2", &cu.cuMemAlloc},
              {"cuMemFree_v2", &cu.cuMemFree},
              {"cuMemcpyHtoD_v2", &cu.cuMemcpyHtoD},
              {"cuMemcpyDtoH_v2", &cu.cuMemcpyDtoH},
              {"cuMemsetD32_v2", &cu.cuMemsetD32},
              {"cuLaunchKernel", &cu.cuLaunchKernel},
              {"cuCtxSynchronize", &cu.cuCtxSynchronize},
              {"cuGetErrorString", &cu.cuGetErrorString}};
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; ++i) {
    void* f = dlsym(lib, syms[i].name);
    if (f == NULL) {
      snprintf(why, cap, "the CUDA driver has no %s", syms[i].name);
      return 1;
    }
    memcpy(syms[i].slot, &f, sizeof f); /* POSIX: a data pointer holds a function's address */
  }
  return 0;
}

static void cu_check(CUresult r, const char* what) {
  if (r == 0) return;
  const char* s = "?";
  if (cu.cuGetErrorString != NULL) cu.cuGetErrorString(r, &s);
  fprintf(stderr, "stepfuse-run-emitted: %s failed: %d (%s)\n", what, r, s);
  exit(1);
}
#define CU(call) cu_check((call), #call)

/* ---- Host checks: the tables, recomputed from the sizes by the ABI's rules ---------- */

static int check_tables(void) {
  long long offset = 0, chunk = 0, block = 0;
  int bad = 0;
  for (int t = 0; t < EMITTED_NUM_TENSORS; ++t) {
    const sf_tensor* x = &emitted_tensors[t];
    const long long n = emitted_numel[t];
    const long long chunks = (n + SF_CHUNK_ELEMS - 1) / SF_CHUNK_ELEMS;
    bad |= x->state_offset != offset || x->numel != n || x->first_chunk != chunk || x->num_chunks != chunks;
    for (long long b = 0; b < n; b += SF_CHUNK_ELEMS, ++chunk) {
      const sf_span* c = &emitted_chunks[chunk];
      bad |= c->begin != b || c->tensor != t || c->len != (n - b < SF_CHUNK_ELEMS ? n - b : SF_CHUNK_ELEMS);
    }
    for (long long b = 0; b < n; b += SF_UPDATE_ELEMS, ++block) {
      const sf_span* s = &emitted_blocks[block];
      bad |= s->begin != b || s->tensor != t || s->len != (n - b < SF_UPDATE_ELEMS ? n - b : SF_UPDATE_ELEMS);
    }
    offset += (n + 15) / 16 * 16; /* the table layout pads each tensor to 16 elements */
  }
  bad |= chunk != EMITTED_NUM_CHUNKS || block != EMITTED_NUM_BLOCKS || offset != emitted_state_elems;
  bad |= emitted_reduce_grid != (unsigned)((chunk + SF_REDUCE_WARPS - 1) / SF_REDUCE_WARPS) ||
         emitted_reduce_block != 32 * SF_REDUCE_WARPS || emitted_update_grid != (unsigned)block ||
         emitted_update_block != SF_UPDATE_THREADS;
  printf("tables: %d tensors, %d chunks, %d blocks, %lld state elements: %s\n", EMITTED_NUM_TENSORS, EMITTED_NUM_CHUNKS,
         EMITTED_NUM_BLOCKS, emitted_state_elems, bad ? "MISMATCH" : "as the ABI says");
  return bad;
}

/* ---- The float64 reference of the emitted program (Lion with a soft sign) ------------ */

static int scalar_index(const char* name) {
  for (int s = 0; s < EMITTED_NUM_SCALARS; ++s)
    if (strcmp(emitted_scalar_names[s], name) == 0) return s;
  fprintf(stderr, "stepfuse-run-emitted: the program has no scalar %s\n", name);
  exit(1);
}

/* One element: g is the unscaled, clipped gradient; *ambiguous when |c| is within fp32
 * rounding of tau (the kernel may take either branch). */
static void reference(const sf_scalar_rule* rules, double g, double* p, double* m, int* ambiguous) {
  const double beta1 = rules[scalar_index("beta1")].a, beta2 = rules[scalar_index("beta2")].a;
  const double tau = rules[scalar_index("tau")].a, lr = rules[scalar_index("lr")].a;
  const double decay = rules[scalar_index("decay")].a;
  const double c = beta1 * *m + (1 - beta1) * g;
  if (fabs(fabs(c) - tau) < 1e-4 * tau) *ambiguous = 1;
  const double u = fabs(c) > tau ? (c > 0 ? 1.0 : -1.0) : c / tau;
  *p = *p * decay - lr * u;
  *m = beta2 * *m + (1 - beta2) * g;
}

/* ---- The launch ------------------------------------------------------------------- */

static double uniform(unsigned long long* s) {
  *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
  return (double)(*s >> 11) * (1.0 / 9007199254740992.0);
}

static int run_on_gpu(void) {
  char why[512] = "";
  if (load_driver(why, sizeof why) != 0 || cu.cuInit(0) != 0) {
    printf("no GPU: skipping the launch (%s)\n", why[0] ? why : "cuInit failed");
    return 0;
  }
  int count = 0;
  if (cu.cuDeviceGetCount(&count) != 0 || count == 0) {
    printf("no GPU: skipping the launch (no device)\n");
    return 0;
  }
  if (!EMITTED_HAVE_BINARY) {
    printf("no kernel image (NVRTC was not available when emitting): skipping the launch\n");
    return 0;
  }
  CUdevice dev;
  CUcontext ctx;
  int major = 0, minor = 0;
  CU(cu.cuDeviceGet(&dev, 0));
  CU(cu.cuDeviceGetAttribute(&major, kComputeCapabilityMajor, dev));
  CU(cu.cuDeviceGetAttribute(&minor, kComputeCapabilityMinor, dev));
  const int sm = major * 10 + minor;
  const void* image = sm == EMITTED_CUBIN_SM ? (const void*)emitted_cubin : sm >= EMITTED_PTX_SM ? (const void*)emitted_ptx : NULL;
  if (image == NULL) {
    printf("the GPU is sm_%d, older than the emitted compute_%d PTX: skipping the launch\n", sm, EMITTED_PTX_SM);
    return 0;
  }
  CU(cu.cuDevicePrimaryCtxRetain(&ctx, dev));
  CU(cu.cuCtxSetCurrent(ctx));
  CUmodule module;
  CUfunction reduce, update;
  CU(cu.cuModuleLoadData(&module, image));
  CU(cu.cuModuleGetFunction(&reduce, module, "sf_reduce"));
  CU(cu.cuModuleGetFunction(&update, module, "sf_update"));
  printf("loaded %s for sm_%d\n", image == (const void*)emitted_cubin ? "the CUBIN" : "the PTX", sm);

  /* Weights and gradients (f32), the caller's; state, scratch and tables, per the ABI. */
  unsigned long long seed = 12345;
  float* w[EMITTED_NUM_TENSORS];
  float* g[EMITTED_NUM_TENSORS];
  double* ref_p[EMITTED_NUM_TENSORS];
  double* ref_m[EMITTED_NUM_TENSORS];
  int* ambiguous[EMITTED_NUM_TENSORS];
  CUdeviceptr dw[EMITTED_NUM_TENSORS], dg[EMITTED_NUM_TENSORS];
  sf_tensor tensors[EMITTED_NUM_TENSORS];
  for (int t = 0; t < EMITTED_NUM_TENSORS; ++t) {
    const size_t n = (size_t)emitted_numel[t];
    w[t] = malloc(n * sizeof(float) + 4), g[t] = malloc(n * sizeof(float) + 4);
    ref_p[t] = malloc(n * sizeof(double) + 8), ref_m[t] = calloc(n + 1, sizeof(double));
    ambiguous[t] = calloc(n + 1, sizeof(int));
    for (size_t i = 0; i < n; ++i) w[t][i] = (float)(uniform(&seed) * 2 - 1), ref_p[t][i] = w[t][i];
    CU(cu.cuMemAlloc(&dw[t], n * sizeof(float) + 4));
    CU(cu.cuMemAlloc(&dg[t], n * sizeof(float) + 4));
    CU(cu.cuMemcpyHtoD(dw[t], w[t], n * sizeof(float)));
    tensors[t] = emitted_tensors[t];
    tensors[t].grad = (const void*)(uintptr_t)dg[t];
    tensors[t].weight = (void*)(uintptr_t)dw[t];
    tensors[t].master = NULL; /* f32 weights: no masters */
  }
  sf_streams streams;
  memset(&streams, 0, sizeof streams);
  CUdeviceptr state[EMITTED_NUM_STREAMS] = {0};
  int exp_avg = -1;
  for (int s = 0; s < EMITTED_NUM_STREAMS; ++s) {
    if (emitted_stream_role[s] != 2) continue;
    CU(cu.cuMemAlloc(&state[s], (size_t)emitted_state_elems * sizeof(float)));
    unsigned bits;
    memcpy(&bits, &emitted_stream_init[s], 4);
    CU(cu.cuMemsetD32(state[s], bits, (size_t)emitted_state_elems)); /* every element = init */
    streams.s[s] = (float*)(uintptr_t)state[s];
    exp_avg = s;
  }
  CUdeviceptr d_tensors, d_chunks, d_blocks, d_partials, d_sums, d_st;
  CU(cu.cuMemAlloc(&d_tensors, sizeof tensors));
  CU(cu.cuMemAlloc(&d_chunks, sizeof emitted_chunks));
  CU(cu.cuMemAlloc(&d_blocks, sizeof emitted_blocks));
  CU(cu.cuMemAlloc(&d_partials, (EMITTED_NUM_CHUNKS > 0 ? EMITTED_NUM_CHUNKS : 1) * sizeof(sf_partial)));
  CU(cu.cuMemAlloc(&d_sums, EMITTED_NUM_TENSORS * sizeof(double)));
  CU(cu.cuMemAlloc(&d_st, sizeof(sf_step_state)));
  CU(cu.cuMemcpyHtoD(d_tensors, tensors, sizeof tensors));
  CU(cu.cuMemcpyHtoD(d_chunks, emitted_chunks, sizeof emitted_chunks));
  CU(cu.cuMemcpyHtoD(d_blocks, emitted_blocks, sizeof emitted_blocks));
  CU(cu.cuMemsetD32(d_st, 0, sizeof(sf_step_state) / 4)); /* zeroed once */

  /* The hyperparameters: the rules of the one param group in device memory, which
   * every launch reads (a captured graph too), and sf_hyper pointing at them, passed
   * by value to every launch. */
  sf_group_rules rules;
  memset(&rules, 0, sizeof rules);
  memcpy(rules.rules, emitted_rules, sizeof emitted_rules);
  CUdeviceptr d_rules, d_scalars;
  CU(cu.cuMemAlloc(&d_rules, sizeof rules));
  CU(cu.cuMemAlloc(&d_scalars, SF_MAX_SCALARS * sizeof(float)));
  CU(cu.cuMemcpyHtoD(d_rules, &rules, sizeof rules));
  sf_hyper hyper;
  memset(&hyper, 0, sizeof hyper);
  hyper.groups = (const sf_group_rules*)(uintptr_t)d_rules;
  hyper.scalars = (float*)(uintptr_t)d_scalars;
  hyper.num_groups = 1;
  hyper.max_grad_norm = 5.0;
  const double S = 1024.0;

  int failures = 0;
  for (int step = 1; step <= 4; ++step) {
    if (step == 3) { /* a new lr: copied into the rules the launches read; no recompile, the same arguments */
      rules.rules[scalar_index("lr")].a = 0.005;
      CU(cu.cuMemcpyHtoD(d_rules, &rules, sizeof rules));
    }
    const int poison = step == 4;
    double sumsq = 0;
    for (int t = 0; t < EMITTED_NUM_TENSORS; ++t) {
      for (long long i = 0; i < emitted_numel[t]; ++i) {
        g[t][i] = (float)((uniform(&seed) - 0.5) * S); /* the gradients of loss * S */
        sumsq += ((double)g[t][i] / S) * ((double)g[t][i] / S);
      }
      if (poison && emitted_numel[t] > 7) g[t][7] = INFINITY;
      CU(cu.cuMemcpyHtoD(dg[t], g[t], (size_t)emitted_numel[t] * sizeof(float)));
    }
    /* sf_reduce then sf_update (plain = 0), in order on the default stream. */
    int num_tensors = EMITTED_NUM_TENSORS, num_chunks = EMITTED_NUM_CHUNKS, check_finite = 1, plain = 0;
    const float* scale_ptr = NULL;
    double scale_value = S;
    sf_scaler_state* scaler = NULL;
    long long flat_numel = emitted_flat_numel;
    /* The parameters in the ABI's order (abi.json: kernels[].params). */
    void* reduce_args[] = {&d_tensors, &num_tensors, &d_chunks,  &num_chunks,  &d_partials,   &d_sums,
                           &d_st,      &hyper,       &scale_ptr, &scale_value, &check_finite, &scaler};
    void* update_args[] = {&d_tensors, &d_blocks, &flat_numel, &streams, &d_st, &hyper, &plain};
    CU(cu.cuLaunchKernel(reduce, emitted_reduce_grid, 1, 1, emitted_reduce_block, 1, 1, 0, NULL, reduce_args, NULL));
    CU(cu.cuLaunchKernel(update, emitted_update_grid, 1, 1, emitted_update_block, 1, 1, 0, NULL, update_args, NULL));
    CU(cu.cuCtxSynchronize());
    sf_step_state st;
    CU(cu.cuMemcpyDtoH(&st, d_st, sizeof st));

    const double norm = sqrt(sumsq);
    const double clip = fmin(1.0, hyper.max_grad_norm / (norm + 1e-6));
    if (poison) {
      failures += st.applied != 0 || st.found_inf != 1 || st.step != 3;
    } else {
      failures += st.applied != 1 || st.step != step || fabs(st.grad_norm - norm) > 1e-6 * norm;
      for (int t = 0; t < EMITTED_NUM_TENSORS; ++t)
        for (long long i = 0; i < emitted_numel[t]; ++i)
          reference(rules.rules, (double)g[t][i] / S * clip, &ref_p[t][i], &ref_m[t][i], &ambiguous[t][i]);
    }
    /* Weights and state against the reference (unchanged after the skipped step). */
    int bad = 0;
    for (int t = 0; t < EMITTED_NUM_TENSORS; ++t) {
      const size_t n = (size_t)emitted_numel[t];
      float* m = malloc(n * sizeof(float) + 4);
      CU(cu.cuMemcpyDtoH(w[t], dw[t], n * sizeof(float)));
      CU(cu.cuMemcpyDtoH(m, state[exp_avg] + (CUdeviceptr)emitted_tensors[t].state_offset * sizeof(float), n * sizeof(float)));
      for (size_t i = 0; i < n; ++i) {
        if (ambiguous[t][i]) continue;
        bad += !(fabs(w[t][i] - ref_p[t][i]) <= 1e-5 + 1e-5 * fabs(ref_p[t][i]));
        bad += !(fabs(m[i] - ref_m[t][i]) <= 1e-6 + 1e-5 * fabs(ref_m[t][i]));
      }
      free(m);
    }
    printf("step %d: applied %d, found_inf %d, grad norm %.6f (expected %.6f), clip %.4f, %d mismatches\n", step,
           st.applied, st.found_inf, st.grad_norm, poison ? INFINITY : norm, st.clip_coef, bad);
    failures += bad != 0;
  }

  for (int t = 0; t < EMITTED_NUM_TENSORS; ++t) {
    cu.cuMemFree(dw[t]), cu.cuMemFree(dg[t]);
    free(w[t]), free(g[t]), free(ref_p[t]), free(ref_m[t]), free(ambiguous[t]);
  }
  for (int s = 0; s < EMITTED_NUM_STREAMS; ++s)
    if (state[s]) cu.cuMemFree(state[s]);
  cu.cuMemFree(d_tensors), cu.cuMemFree(d_chunks), cu.cuMemFree(d_blocks);
  cu.cuMemFree(d_partials), cu.cuMemFree(d_sums), cu.cuMemFree(d_st);
  cu.cuMemFree(d_rules), cu.cuMemFree(d_scalars);
  cu.cuModuleUnload(module);
  cu.cuDevicePrimaryCtxRelease(dev);
  printf("%s\n", failures ? "FAILED" : "the emitted kernels agree with the float64 reference");
  return failures ? 1 : 0;
}

int main(void) {
  printf("stepfuse-run-emitted: program '%s', %d tensors, %d scalars\n", emitted_program_name, EMITTED_NUM_TENSORS,
         EMITTED_NUM_SCALARS);
  if (check_tables() != 0) return 1;
  return run_on_gpu();
}
