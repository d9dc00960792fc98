"""The stepfuse peers, all through the Python package (pip install .):

  stepfuse              the C++ API through its binding: stepfuse.GradScaler('cpu') step + update
                        over stepfuse.Optimizer(stepfuse.AdamW(...), [(w, g), ...], max_grad_norm=1.0),
                        zero-copy on the shared torch tensors (the reference of the verification);
  stepfuse.torch        what a PyTorch user gets by changing one import: stepfuse.torch.AdamW(...,
                        max_grad_norm=1.0) with stepfuse.torch.GradScaler('cpu'), scaler.step(opt),
                        scaler.update();
  stepfuse.torch-fresh  the same, with new gradient tensors assigned to every p.grad before each step
                        (outside the timed region), as autograd leaves them after
                        zero_grad(set_to_none=True): each timed step re-points the engine (set_grads)."""

from .config import BACKOFF_FACTOR, GROWTH_FACTOR, GROWTH_INTERVAL, HYPER, MAX_NORM
from .peer import Peer
from .torch_peers import TorchEagerPeer


def scaler_kwargs(args):
    return dict(init_scale=args.loss_scale, growth_factor=GROWTH_FACTOR, backoff_factor=BACKOFF_FACTOR,
                growth_interval=GROWTH_INTERVAL)


def adamw_config(sf):
    return sf.AdamW(lr=HYPER["lr"], beta1=HYPER["beta1"], beta2=HYPER["beta2"], eps=HYPER["eps"],
                    weight_decay=HYPER["weight_decay"])


def state_copies(opt, n, torch):
    """{"exp_avg": [...], "exp_avg_sq": [...]}: a stepfuse.Optimizer's AdamW state (zero-copy NumPy
    views), copied into torch tensors, one per param."""
    return {name: [torch.from_numpy(opt.state(i, name)).clone() for i in range(n)]
            for name in ("exp_avg", "exp_avg_sq")}


class StepfusePeer(Peer):
    name = "stepfuse"
    required = True
    what = ("stepfuse.GradScaler('cpu') step + update over stepfuse.Optimizer(stepfuse.AdamW(...), [(w, g), ...], "
            "max_grad_norm=1.0): the C++ API through the binding, zero-copy on the torch tensors (one reduce pass, "
            "one update pass; the gradients are not written)")

    def __init__(self, ctx):
        self.ctx = ctx

    def setup(self):
        ctx, sf = self.ctx, self.ctx.sf
        self.opt = sf.Optimizer(adamw_config(sf), [(w.detach(), g) for w, g in zip(ctx.weights, ctx.grads)],
                                max_grad_norm=MAX_NORM, num_threads=ctx.args.threads)
        self.scaler = sf.GradScaler("cpu", **scaler_kwargs(ctx.args))
        self.threads = self.opt.num_threads
        self.backend = self.opt.backend
        self._applied = False

    def step(self):
        self._applied = self.scaler.step(self.opt)
        self.scaler.update()

    def check_applied(self):
        if not self._applied:
            raise RuntimeError("stepfuse skipped a step although every gradient is finite")

    def result(self):
        states = state_copies(self.opt, len(self.ctx.weights), self.ctx.torch)
        return [w.detach().clone() for w in self.ctx.weights], states["exp_avg"], states["exp_avg_sq"]

    def last_result(self):
        r = self.opt.last_result
        return dict(applied=r.applied, found_inf=r.found_inf, grad_norm=r.grad_norm, clip_coef=r.clip_coef)

    def extra(self):
        return dict(threads=getattr(self, "threads", None), backend=getattr(self, "backend", None))


class StepfuseTorchPeer(Peer):
    """stepfuse.torch.AdamW + stepfuse.torch.GradScaler on the shared params and their .grad."""

    name = "stepfuse.torch"
    what = ("stepfuse.torch.GradScaler('cpu'): step(opt), update(), with stepfuse.torch.AdamW(params, lr, betas, eps, "
            "weight_decay, max_grad_norm=1.0) (torch.optim's interface over the fused step; the same .grad tensors "
            "every step)")

    def __init__(self, ctx):
        self.ctx = ctx

    def setup(self):
        import stepfuse.torch as sft
        ctx, torch = self.ctx, self.ctx.torch
        self.opt = sft.AdamW(ctx.weights, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                             weight_decay=HYPER["weight_decay"], max_grad_norm=MAX_NORM, **self.options())
        self.scaler = sft.GradScaler("cpu", **scaler_kwargs(ctx.args))
        # As TorchEagerPeer: the scale tensor is created by the first scale() call of a training loop.
        self.scaler.scale(torch.ones(()))

    def options(self):
        """stepfuse.torch's own keyword arguments beyond torch's (the low-precision peers' weights options)."""
        return {}

    def step(self):
        self.scaler.step(self.opt)
        self.scaler.update()

    # torch's optimizer interface: checked and read back as the eager torch peer's are.
    check_applied = TorchEagerPeer.check_applied
    result = TorchEagerPeer.result

    def extra(self):
        engine = getattr(getattr(self, "opt", None), "_engine", None)
        return dict(threads=engine.num_threads if engine is not None else None)


class StepfuseTorchFreshPeer(StepfuseTorchPeer):
    """stepfuse.torch with new .grad tensors before every step, as autograd allocates them after
    zero_grad(set_to_none=True). The new tensors are copies of the pristine gradients, made in
    prepare() (untimed); the timed step sees new data pointers and calls set_grads. The previous
    step's tensors, which the engine refers to until then, are kept alive here until finish(), so
    that freeing them (in a torch loop, zero_grad's cost) stays out of the timed step as it stays
    out of the torch peers' steps. finish() points every p.grad back at the shared
    gradients the other peers read."""

    name = "stepfuse.torch-fresh"
    what = ("stepfuse.torch as above, but every p.grad is a new tensor before each step (assigned outside the timed "
            "region, as autograd leaves them after zero_grad(set_to_none=True)): each timed step includes set_grads")
    reads_torch_grads = False  # its own fresh copies of the pristine gradients

    _current = _previous = None

    def prepare(self):
        ctx = self.ctx
        self._previous = self._current  # the engine's gradients until this step's set_grads
        self._current = [g.clone() for g in ctx.grads_backup]
        for w, g in zip(ctx.weights, self._current):
            w.grad = g

    def finish(self):
        # The engine must be reading this step's tensors (else the step did not include set_grads).
        engine_grads = [g for _, g in self.opt._engine.params()]
        if [g.data_ptr() for g in engine_grads] != [g.data_ptr() for g in self._current]:
            raise RuntimeError("stepfuse.torch-fresh: the engine was not pointed at the new gradients")
        for w, g in zip(self.ctx.weights, self.ctx.grads):
            w.grad = g
        self._previous = None
