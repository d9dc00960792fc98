"""The ctypes binding of libstepfuse_peer_shim.so (bench/peers/shim.cpp): stepfuse's optimizer and
GradScaler over the torch tensors' memory. The argument types mirror shim.cpp's sf_peer_* functions."""

import ctypes
import os

from .config import BACKOFF_FACTOR, GROWTH_FACTOR, GROWTH_INTERVAL, HYPER


class Shim:
    """libstepfuse_peer_shim.so: bench/peers/shim.cpp. Every call returns a status (0 = ok)."""

    def __init__(self, path):
        if not os.path.exists(path):
            raise RuntimeError(f"{path} not found: build the target stepfuse_peer_shim (bench/peers/run.sh does), "
                               "or pass --shim")
        lib = ctypes.CDLL(path)
        c = ctypes
        vp, i64, dbl, cint = c.c_void_p, c.c_int64, c.c_double, c.c_int
        lib.sf_peer_last_error.restype = c.c_char_p
        lib.sf_peer_version.restype = c.c_char_p
        lib.sf_peer_cpu_target.restype = c.c_char_p
        lib.sf_peer_optimizer_create.argtypes = [c.c_char_p, c.POINTER(c.c_char_p), c.POINTER(dbl), cint, i64,
                                                 c.POINTER(vp), c.POINTER(vp), c.POINTER(i64), c.POINTER(cint),
                                                 c.POINTER(cint), dbl, cint, cint, c.POINTER(vp)]
        lib.sf_peer_optimizer_destroy.argtypes = [vp]
        lib.sf_peer_optimizer_destroy.restype = None
        lib.sf_peer_optimizer_num_threads.argtypes = [vp]
        lib.sf_peer_optimizer_step.argtypes = [vp, dbl, c.POINTER(cint)]
        lib.sf_peer_optimizer_last_result.argtypes = [vp, c.POINTER(cint), c.POINTER(cint), c.POINTER(dbl),
                                                      c.POINTER(dbl)]
        lib.sf_peer_optimizer_copy_state.argtypes = [vp, i64, c.c_char_p, vp, i64]
        lib.sf_peer_scaler_create.argtypes = [dbl, dbl, dbl, i64, c.POINTER(vp)]
        lib.sf_peer_scaler_destroy.argtypes = [vp]
        lib.sf_peer_scaler_destroy.restype = None
        lib.sf_peer_scaler_get_scale.argtypes = [vp]
        lib.sf_peer_scaler_get_scale.restype = dbl
        lib.sf_peer_scaler_step_and_update.argtypes = [vp, vp, c.POINTER(cint)]
        self.lib = lib
        self.version = lib.sf_peer_version().decode()
        self.cpu_target = lib.sf_peer_cpu_target().decode()

    def check(self, status, what):
        if status != 0:
            raise RuntimeError(f"stepfuse {what}: {self.lib.sf_peer_last_error().decode()} (status {status})")

    def optimizer(self, weights, grads, max_grad_norm, threads):
        """A fused AdamW (HYPER) over torch tensors' memory; returns the handle."""
        c = ctypes
        n = len(weights)
        names = [k.encode() for k in HYPER]
        h = c.c_void_p()
        self.check(self.lib.sf_peer_optimizer_create(
            b"adamw", (c.c_char_p * len(names))(*names), (c.c_double * len(names))(*HYPER.values()), len(names), n,
            (c.c_void_p * n)(*[w.data_ptr() for w in weights]), (c.c_void_p * n)(*[g.data_ptr() for g in grads]),
            (c.c_int64 * n)(*[w.numel() for w in weights]), (c.c_int * n)(*([0] * n)), (c.c_int * n)(*([0] * n)),
            float(max_grad_norm), threads, 0, c.byref(h)), "optimizer_create")
        return h

    def scaler(self, init_scale):
        h = ctypes.c_void_p()
        self.check(self.lib.sf_peer_scaler_create(init_scale, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL,
                                                  ctypes.byref(h)), "scaler_create")
        return h

    def copy_states(self, h, weights, torch):
        """{"exp_avg": [...], "exp_avg_sq": [...]}: optimizer h's AdamW state, copied into new fp32 torch
        tensors, one per weight."""
        states = {}
        for name in ("exp_avg", "exp_avg_sq"):
            states[name] = []
            for i, w in enumerate(weights):
                out = torch.empty(w.numel(), dtype=torch.float32)
                self.check(self.lib.sf_peer_optimizer_copy_state(h, i, name.encode(), out.data_ptr(), out.numel()),
                           "copy_state")
                states[name].append(out)
        return states
