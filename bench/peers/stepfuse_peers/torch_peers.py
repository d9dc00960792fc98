"""The PyTorch peers: eager AdamW (fused and foreach) with torch.amp.GradScaler, and torch.compile of
the whole step."""

import time

from .config import BACKOFF_FACTOR, GROWTH_FACTOR, GROWTH_INTERVAL, HYPER, MAX_NORM
from .peer import Peer, SkipPeer


class TorchEagerPeer(Peer):
    writes_torch_grads = True

    def __init__(self, ctx, impl):
        self.ctx, self.impl = ctx, impl
        self.name = "torch-" + impl
        self.what = (f"torch.amp.GradScaler('cpu'): unscale_(opt), clip_grad_norm_(params, 1.0, foreach=True), "
                     f"step(opt), update(), with torch.optim.AdamW({impl}=True)")

    def make_optimizer(self):
        """The optimizer over the shared weights (the low-precision peers bring torchao's and bitsandbytes')."""
        kw = {"fused": True} if self.impl == "fused" else {"foreach": True}
        return self.ctx.torch.optim.AdamW(self.ctx.weights, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                          eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], **kw)

    def setup(self):
        torch = self.ctx.torch
        self.opt = self.make_optimizer()
        self.scaler = torch.amp.GradScaler("cpu", init_scale=self.ctx.args.loss_scale, growth_factor=GROWTH_FACTOR,
                                           backoff_factor=BACKOFF_FACTOR, growth_interval=GROWTH_INTERVAL)
        # GradScaler creates its scale tensor in the first scale() call (a training loop's
        # scaler.scale(loss)); the scale then lives on across iterations.
        self.scaler.scale(torch.ones(()))

    def step(self):
        self.scaler.unscale_(self.opt)
        self.ctx.torch.nn.utils.clip_grad_norm_(self.ctx.weights, MAX_NORM, foreach=True)
        self.scaler.step(self.opt)
        self.scaler.update()

    def check_applied(self):
        # GradScaler.update() halves the scale after a skipped step (and only then, within
        # growth_interval steps); the scale lives in a tensor, so read it outside the timing.
        if self.scaler.get_scale() < self.ctx.expected_scale:
            raise RuntimeError(f"{self.name} skipped a step although every gradient is finite")

    def result(self):
        st = [self.opt.state[w] for w in self.ctx.weights]
        return ([w.detach().clone() for w in self.ctx.weights], [s["exp_avg"].clone() for s in st],
                [s["exp_avg_sq"].clone() for s in st])


def make_compiled_step(torch, lr, beta1, beta2, eps, weight_decay, max_norm, growth_factor, backoff_factor,
                       growth_interval):
    """The whole step as one function of tensors, for torch.compile: GradScaler's unscale and
    inf/NaN check, clip_grad_norm_, AdamW as torch.optim's foreach implementation writes it,
    and GradScaler.update. A skipped step is a select (torch.where), not a branch, so the
    graph has no host synchronization. The gradients are unscaled out of place (the compiler
    fuses that into its consumers), so they are not written.

    The bias corrections come in as 0-d tensors computed by bias_corrections() just before
    the call: computed inside the graph, inductor (torch 2.15) inlines their pow() into the
    update loop and evaluates it once per vector, which made the step 3x slower."""

    def bias_corrections(step):
        with torch.no_grad():
            new_step = step + 1
            return lr / (1 - beta1 ** new_step), (1 - beta2 ** new_step).sqrt()

    def step_fn(params, grads, exp_avgs, exp_avg_sqs, step, scale, growth_tracker, step_size, bias_correction2_sqrt):
        with torch.no_grad():
            inv_scale = scale.double().reciprocal().float()  # as GradScaler.unscale_
            g = torch._foreach_mul(grads, inv_scale)
            finite = torch.stack([torch.isfinite(x).all() for x in g]).all()
            total_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(g, 2.0)), 2.0)
            clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # clip_grad_norm_
            new_step = step + 1
            for p, gi, m, v in zip(params, g, exp_avgs, exp_avg_sqs):
                gc = gi * clip_coef
                m_new = m.lerp(gc, 1 - beta1)
                v_new = v * beta2 + gc * gc * (1 - beta2)
                denom = v_new.sqrt() / bias_correction2_sqrt + eps
                p_new = p * (1 - lr * weight_decay) - step_size * m_new / denom
                p.copy_(torch.where(finite, p_new, p))
                m.copy_(torch.where(finite, m_new, m))
                v.copy_(torch.where(finite, v_new, v))
            step.copy_(torch.where(finite, new_step, step))
            # GradScaler.update (torch._amp_update_scale_).
            tracker = torch.where(finite, growth_tracker + 1, torch.zeros_like(growth_tracker))
            grown = scale * growth_factor
            grow = tracker >= growth_interval
            scale.copy_(torch.where(finite, torch.where(grow & torch.isfinite(grown), grown, scale),
                                    scale * backoff_factor))
            growth_tracker.copy_(torch.where(grow, torch.zeros_like(tracker), tracker))

    return bias_corrections, step_fn


class TorchCompilePeer(Peer):
    name = "torch-compile"
    what = ("torch.compile(fullgraph=True) of one function doing unscale + inf/NaN check + clip_grad_norm_ + AdamW "
            "(torch.optim's foreach math, skip by torch.where) + GradScaler.update, after 4 eager 0-d ops for the "
            "bias corrections; gradients not written")

    def __init__(self, ctx):
        self.ctx = ctx
        self.compile_s = None

    def setup(self):
        torch = self.ctx.torch
        ws = self.ctx.weights
        if len(ws) > self.ctx.args.compile_max_tensors:
            raise SkipPeer(f"skipped: {len(ws)} tensors > --compile-max-tensors {self.ctx.args.compile_max_tensors} "
                           "(inductor's compile time grows with the tensor count)")
        self.m = [torch.zeros_like(w, requires_grad=False) for w in ws]
        self.v = [torch.zeros_like(w, requires_grad=False) for w in ws]
        self.step_t = torch.zeros((), dtype=torch.float32)
        self.scale = torch.full((), self.ctx.args.loss_scale, dtype=torch.float32)
        self.tracker = torch.zeros((), dtype=torch.int32)
        self.bias_corrections, fn = make_compiled_step(torch, HYPER["lr"], HYPER["beta1"], HYPER["beta2"],
                                                       HYPER["eps"], HYPER["weight_decay"], MAX_NORM, GROWTH_FACTOR,
                                                       BACKOFF_FACTOR, GROWTH_INTERVAL)
        self.fn = torch.compile(fn, fullgraph=True, dynamic=False)
        # Compile now (the first call), so the verification step and the timing see the
        # compiled code; this first step is the verification step.
        self.first_call = True

    def step(self):
        if self.first_call:
            t0 = time.perf_counter()
        self.fn(self.ctx.weights, self.ctx.grads, self.m, self.v, self.step_t, self.scale, self.tracker,
                *self.bias_corrections(self.step_t))
        if self.first_call:
            self.compile_s = time.perf_counter() - t0
            self.first_call = False

    def check_applied(self):
        if self.scale.item() < self.ctx.expected_scale:
            raise RuntimeError("torch-compile skipped a step although every gradient is finite")

    def result(self):
        return [w.detach().clone() for w in self.ctx.weights], [m.clone() for m in self.m], [v.clone() for v in self.v]

    def extra(self):
        return dict(compile_and_first_step_s=self.compile_s)
