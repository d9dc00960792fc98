"""The stepfuse peer: GradScaler step + update over a fused AdamW, through the ctypes shim."""

import ctypes

from .config import MAX_NORM
from .peer import Peer


class StepfusePeer(Peer):
    name = "stepfuse"
    what = ("stepfuse::GradScaler step + update over a fused AdamW with max_grad_norm 1.0 (one reduce pass, one "
            "update pass; the gradients are not written), via the ctypes shim on the torch tensors' memory")

    def __init__(self, ctx):
        self.ctx = ctx

    def setup(self):
        ctx = self.ctx
        self.opt = ctx.shim.optimizer(ctx.weights, ctx.grads, MAX_NORM, ctx.args.threads)
        self.scaler = ctx.shim.scaler(ctx.args.loss_scale)
        self.threads = ctx.shim.lib.sf_peer_optimizer_num_threads(self.opt)
        self._applied = ctypes.c_int(0)

    def step(self):
        self.ctx.shim.check(self.ctx.shim.lib.sf_peer_scaler_step_and_update(self.scaler, self.opt,
                                                                             ctypes.byref(self._applied)),
                            "GradScaler step")

    def check_applied(self):
        if not self._applied.value:
            raise RuntimeError("stepfuse skipped a step although every gradient is finite")

    def result(self):
        states = self.ctx.shim.copy_states(self.opt, self.ctx.weights, self.ctx.torch)
        return [w.detach().clone() for w in self.ctx.weights], states["exp_avg"], states["exp_avg_sq"]

    def last_result(self):
        a, f, n, c = ctypes.c_int(), ctypes.c_int(), ctypes.c_double(), ctypes.c_double()
        self.ctx.shim.check(self.ctx.shim.lib.sf_peer_optimizer_last_result(self.opt, ctypes.byref(a), ctypes.byref(f),
                                                                            ctypes.byref(n), ctypes.byref(c)),
                            "last_result")
        return dict(applied=bool(a.value), found_inf=bool(f.value), grad_norm=n.value, clip_coef=c.value)

    def extra(self):
        return dict(threads=getattr(self, "threads", None))
