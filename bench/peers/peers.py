#!/usr/bin/env python3
"""peers.py: times stepfuse's fused optimizer step beside the steps users would pick
instead (PyTorch eager fused and foreach AdamW, torch.compile, JAX/optax), in one process.

Every peer does the same math on the same tensor list: unscale the gradients by 1/S,
check them for inf/NaN (skipping the step if any), clip their global L2 norm to 1.0,
AdamW(lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 1e-2), with GradScaler semantics
(the scale backs off after a skipped step, grows after 2000 good ones).

Order of work, on purpose:
  1. allocate the weights and gradients once, as torch fp32 tensors (the torch peers and
     stepfuse share them; JAX gets its own copies);
  2. verify: each peer takes one step from the same weights, gradients and zero state,
     and its weight update and AdamW state are compared with stepfuse's (a peer that
     disagrees beyond fp32 rounding is reported and not timed);
  3. time: warm-up, then rounds in which every peer takes one step, round-robin (the
     starting peer rotates each round) so that drift in the machine affects all alike.
     Restoring the gradients that PyTorch's eager path unscales and clips in place is
     done between steps, outside the timed region.

--overhead times the per-step fixed cost instead: a plain AdamW step (no loss scale, no
clipping) of stepfuse and of torch fused AdamW, on a many-tensor list (many-small by
default) and on one flat tensor with the same element count.

Run it through bench/peers/run.sh, which builds stepfuse-bench and the ctypes shim
(libstepfuse_peer_shim.so) and sets up a virtual environment with torch, jax and optax.
"""

import argparse
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# The step every peer performs.
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
MAX_NORM = 1.0
GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0, 0.5, 2000  # torch.amp.GradScaler's defaults

# Verification of each peer's one-step result against stepfuse's:
#  - clip coefficient: the factor r by which the peer's clipped gradients differ from
#    stepfuse's, fitted from exp_avg = (1 - beta1) * clipped grad (least squares over every
#    element); |r - 1| <= NORM_TOL. It is separate because PyTorch's CPU norm kernels
#    accumulate in fp32: on GPT-2's 38.6 M-element embedding gradient their norm is ~2e-3
#    off the exact one (torch.sum is exact there, stepfuse and XLA are within ~1e-7).
#  - exp_avg / r and exp_avg_sq / r^2: max_i |peer_i - stepfuse_i| / max(|stepfuse_i|,
#    VERIFY_FLOOR * max|stepfuse|), the worst tensor; <= VERIFY_TOL.
#  - the weight update w1 - w0: max |peer - stepfuse| / max |stepfuse|, the worst tensor
#    (normwise: the update is a difference of two weights, whose rounding is the weights'
#    ulp); <= VERIFY_TOL + |r - 1| (through eps, the first AdamW update moves by at most
#    |r - 1| relative when the clip coefficient does).
# fp32 rounding (operation order, optax's clip without torch's +1e-6) stays well below
# these; a wrong lr, beta, bias correction or clip does not.
VERIFY_TOL = 1e-4
VERIFY_FLOOR = 1e-3
NORM_TOL = 1e-2

ALL_PEERS = ["stepfuse", "torch-fused", "torch-foreach", "torch-compile", "jax-optax"]


def step_bytes(weight_bytes=4, grad_bytes=4, state_streams=2, reduce_pass=True):
    """Bytes per parameter a step must move: mirrors bench/step_bytes.cpp for fp32 weights
    (no masters). Reduce pass: read the gradient. Update pass: read the gradient, read and
    write the weight and every fp32 state stream. Must match step_bytes() there."""
    reduce = grad_bytes if reduce_pass else 0
    update = grad_bytes + 2 * weight_bytes + 8 * state_streams
    return reduce, update


# ---- Arguments ------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="peers.py",
        description="Time stepfuse's fused step (unscale + inf/NaN check + clip + AdamW) beside PyTorch "
        "eager fused/foreach AdamW with torch.amp.GradScaler, torch.compile of the whole step, and "
        "JAX/optax under jax.jit, on the same tensor list, interleaved in one process. Each peer's one-step "
        "result is checked against stepfuse's before anything is timed.",
        epilog="The ratio column is peer time / stepfuse time (median over median): 2.0x means the peer takes "
        "twice as long as stepfuse. GB/s uses stepfuse's byte model (bench/step_bytes.cpp), the bytes any "
        "implementation must move, so the figures compare across peers. Exit codes: 0 ok (even if a non-stepfuse "
        "peer failed: the table says why), 1 bad arguments, 2 stepfuse itself failed, 3 other errors.",
    )
    p.add_argument("--preset", default=None,
                   help="tensor list, as stepfuse-bench knows it: gpt2-124m (default), llama7b-layer, resnet50, "
                   "many-small, flat:N (default with --overhead: many-small)")
    p.add_argument("--shapes", metavar="FILE",
                   help="your own tensor list instead of a preset: stepfuse-bench's --shapes format ('[NAME] COUNT' "
                   "per line)")
    p.add_argument("--dtype", default="f32", choices=["f32"],
                   help="weight and gradient dtype (fp32 only: with bf16 weights PyTorch keeps bf16 state and no "
                   "fp32 masters, JAX does what the user writes, and the peers would no longer do the same math)")
    p.add_argument("--threads", type=int, default=2,
                   help="threads for every peer: torch.set_num_threads, XLA_FLAGS (--xla_cpu_multi_thread_eigen, "
                   "intra_op_parallelism_threads), stepfuse's num_threads (default 2)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per peer (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up rounds after verification (default 3)")
    p.add_argument("--loss-scale", type=float, default=1024.0,
                   help="loss scale S: the gradients are stored multiplied by S (default 1024)")
    p.add_argument("--peers", default=",".join(ALL_PEERS),
                   help="comma-separated subset of: " + ", ".join(ALL_PEERS) + " (stepfuse is always included)")
    p.add_argument("--overhead", action="store_true",
                   help="measure the per-step fixed overhead instead: plain AdamW step of stepfuse and torch fused "
                   "AdamW on the preset's tensors vs one flat tensor of the same total size")
    p.add_argument("--gap-ms", type=float, default=10.0,
                   help="idle time before each timed step, so threads still spinning after the previous peer "
                   "(OpenMP, XLA's pool, stepfuse's pool) have gone to sleep (default 10)")
    p.add_argument("--compile-max-tensors", type=int, default=2000,
                   help="skip torch.compile above this many tensors (its compile time grows with the tensor count; "
                   "default 2000)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and gradients (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write every figure and sample to FILE as JSON")
    p.add_argument("--build-dir", default=os.environ.get("STEPFUSE_BUILD_DIR", os.path.join(REPO, "build", "release")),
                   help="where stepfuse-bench and the shim were built (default $STEPFUSE_BUILD_DIR or build/release); "
                   "JAX's compilation cache goes to BUILD_DIR/peers-jax-cache")
    p.add_argument("--bench", help="path of stepfuse-bench (default BUILD_DIR/bench/stepfuse-bench)")
    p.add_argument("--shim", help="path of libstepfuse_peer_shim.so (default BUILD_DIR/bench/libstepfuse_peer_shim.so)")
    a = p.parse_args(argv)
    if a.preset is not None and a.shapes is not None:
        p.error("--preset and --shapes exclude each other")
    if a.preset is None and a.shapes is None:
        a.preset = "many-small" if a.overhead else "gpt2-124m"
    a.list_name = a.preset if a.shapes is None else "shapes file " + a.shapes
    if a.threads < 1:
        p.error("--threads must be >= 1")
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if not (a.loss_scale > 0) or a.loss_scale == float("inf"):
        p.error("--loss-scale must be finite and > 0")
    a.peer_list = [s.strip() for s in a.peers.split(",") if s.strip()]
    for s in a.peer_list:
        if s not in ALL_PEERS:
            p.error(f"--peers: unknown peer '{s}' (expected some of {', '.join(ALL_PEERS)})")
    if "stepfuse" not in a.peer_list:
        a.peer_list.insert(0, "stepfuse")
    a.bench = a.bench or os.path.join(a.build_dir, "bench", "stepfuse-bench")
    a.shim = a.shim or os.path.join(a.build_dir, "bench", "libstepfuse_peer_shim.so")
    return a


def progress(msg):
    """One status line on stderr, rewritten in place, only on a terminal."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[Kpeers: " + msg if msg else "\r\033[K")
        sys.stderr.flush()


def commas(n):
    return f"{n:,}"


# ---- Tensor lists ---------------------------------------------------------------------------


def load_shapes(args):
    """([(name, numel)], source): the tensor list of --preset (or --shapes FILE), as
    `stepfuse-bench ... --print-shapes` prints it ('NAME COUNT' per line), so the peers
    time exactly stepfuse-bench's lists."""
    if not os.path.exists(args.bench):
        raise RuntimeError(f"{args.bench} not found: build it first (bench/peers/run.sh does), or pass --bench")
    select = ["--shapes", args.shapes] if args.shapes else ["--preset", args.preset]
    cmd = ["stepfuse-bench", *select, "--print-shapes"]
    r = subprocess.run([args.bench, *cmd[1:]], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {r.returncode}): " + (r.stderr or r.stdout).strip())
    shapes = []
    for line in r.stdout.splitlines():
        f = line.split("#", 1)[0].split()
        if len(f) == 2 and f[1].isdigit():
            shapes.append((f[0], int(f[1])))
        elif f:
            raise RuntimeError(f"{' '.join(cmd)}: unexpected line '{line}' (expected 'NAME COUNT')")
    if not shapes:
        raise RuntimeError(f"{' '.join(cmd)} printed no tensors")
    return shapes, " ".join(cmd)


# ---- Statistics -----------------------------------------------------------------------------


def quantile(sorted_s, f):
    """Linear interpolation between order statistics (numpy's default), as bench/stats.cpp."""
    pos = f * (len(sorted_s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_s) - 1)
    return sorted_s[lo] + (sorted_s[hi] - sorted_s[lo]) * (pos - lo)


def summarize(samples):
    s = sorted(samples)
    if not s:
        return None
    return dict(count=len(s), min=s[0], p25=quantile(s, 0.25), median=quantile(s, 0.5), p75=quantile(s, 0.75),
                max=s[-1])


def scaled_summary(summary, k):
    return {key: (v * k if key != "count" else v) for key, v in summary.items()}


# ---- The stepfuse shim (ctypes) -------------------------------------------------------------


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


# ---- Peers ----------------------------------------------------------------------------------
#
# A peer sets itself up (optimizer, state), takes one full step per step() call (returning
# only when the step's results are in memory), reports its weights and AdamW state for the
# verification, and says whether the step it just took was applied (checked outside the
# timed region).


class Peer:
    name = ""
    what = ""                 # one line: what a timed step contains
    reads_torch_grads = True  # reads the shared torch gradients
    writes_torch_grads = False  # unscales/clips them in place (they are restored before the next reader)

    def setup(self):
        pass

    def step(self):
        raise NotImplementedError

    def check_applied(self):
        pass

    def result(self):
        """(weights, exp_avg, exp_avg_sq): lists of torch tensors (or numpy arrays), one per tensor."""
        raise NotImplementedError

    def extra(self):
        return {}


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
        torch = self.ctx.torch
        lib = self.ctx.shim.lib
        states = {}
        for name in ("exp_avg", "exp_avg_sq"):
            states[name] = []
            for i, w in enumerate(self.ctx.weights):
                out = torch.empty(w.numel(), dtype=torch.float32)
                self.ctx.shim.check(lib.sf_peer_optimizer_copy_state(self.opt, i, name.encode(), out.data_ptr(),
                                                                     out.numel()), "copy_state")
                states[name].append(out)
        return [w.detach().clone() for w in self.ctx.weights], states["exp_avg"], states["exp_avg_sq"]

    def last_result(self):
        a, f, n, c = ctypes.c_int(), ctypes.c_int(), ctypes.c_double(), ctypes.c_double()
        self.ctx.shim.check(self.ctx.shim.lib.sf_peer_optimizer_last_result(self.opt, ctypes.byref(a), ctypes.byref(f),
                                                                            ctypes.byref(n), ctypes.byref(c)),
                            "last_result")
        return dict(applied=bool(a.value), found_inf=bool(f.value), grad_norm=n.value, clip_coef=c.value)

    def extra(self):
        return dict(threads=getattr(self, "threads", None))


class TorchEagerPeer(Peer):
    writes_torch_grads = True

    def __init__(self, ctx, impl):
        self.ctx, self.impl = ctx, impl
        self.name = "torch-" + impl
        self.what = (f"torch.amp.GradScaler('cpu'): unscale_(opt), clip_grad_norm_(params, 1.0, foreach=True), "
                     f"step(opt), update(), with torch.optim.AdamW({impl}=True)")

    def setup(self):
        torch = self.ctx.torch
        kw = {"fused": True} if self.impl == "fused" else {"foreach": True}
        self.opt = torch.optim.AdamW(self.ctx.weights, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                     eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], **kw)
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


class JaxPeer(Peer):
    name = "jax-optax"
    what = "jax.jit of jmp loss scaling + optax.chain(clip_by_global_norm, adamw)"  # refined in setup()
    reads_torch_grads = False

    def __init__(self, ctx):
        self.ctx = ctx
        self.compile_s = None

    def setup(self):
        import jax
        import jax.numpy as jnp
        import optax
        try:
            import jmp
            self.jmp_version = getattr(jmp, "__version__", "installed")
        except ImportError:
            jmp = _InlineJmp(jax, jnp)
            self.jmp_version = None
        self.jax, self.jnp = jax, jnp
        # XLA takes minutes to compile this step for a GPT-2-sized list on a small machine;
        # keep the executable for the next run (the key covers the program, flags and version).
        jax.config.update("jax_compilation_cache_dir", os.path.join(self.ctx.args.build_dir, "peers-jax-cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        self.what = ("jax.jit(donate params and state) of: " + ("jmp" if self.jmp_version else "jmp-equivalent") +
                     " DynamicLossScale unscale + all_finite + adjust, optax.chain(clip_by_global_norm(1.0), "
                     "adamw(...)), apply_updates, select_tree(finite, new, old); own copies of the arrays")
        self.ctx.versions["jmp"] = self.jmp_version or "not installed (inline equivalent)"
        tx = optax.chain(optax.clip_by_global_norm(MAX_NORM),
                         optax.adamw(learning_rate=HYPER["lr"], b1=HYPER["beta1"], b2=HYPER["beta2"],
                                     eps=HYPER["eps"], weight_decay=HYPER["weight_decay"]))

        def train_step(params, opt_state, loss_scale, grads):
            grads = loss_scale.unscale(grads)
            finite = jmp.all_finite(grads)
            loss_scale = loss_scale.adjust(finite)
            updates, new_opt_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            params = jmp.select_tree(finite, new_params, params)
            opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
            return params, opt_state, loss_scale

        # Own copies (jnp.array copies): the params are donated, so they must not alias torch memory.
        self.params = [jnp.array(w.detach().numpy(), copy=True) for w in self.ctx.weights0]
        self.grads = [jnp.array(g.numpy(), copy=True) for g in self.ctx.grads_backup]
        self.opt_state = tx.init(self.params)
        self.loss_scale = jmp.DynamicLossScale(jnp.asarray(self.ctx.args.loss_scale, jnp.float32),
                                               period=GROWTH_INTERVAL, factor=int(GROWTH_FACTOR))
        self.fn = jax.jit(train_step, donate_argnums=(0, 1))
        self.optax = optax
        self.first_call = True

    def step(self):
        if self.first_call:
            t0 = time.perf_counter()
        self.params, self.opt_state, self.loss_scale = self.fn(self.params, self.opt_state, self.loss_scale,
                                                               self.grads)
        # Dispatch is asynchronous: the step is over when its outputs are.
        self.jax.block_until_ready((self.params, self.opt_state, self.loss_scale))
        if self.first_call:
            self.compile_s = time.perf_counter() - t0
            self.first_call = False

    def check_applied(self):
        if float(self.loss_scale.loss_scale) < self.ctx.expected_scale:
            raise RuntimeError("jax-optax skipped a step although every gradient is finite")

    def result(self):
        import numpy as np
        leaves = self.jax.tree_util.tree_leaves(self.opt_state,
                                                is_leaf=lambda x: isinstance(x, self.optax.ScaleByAdamState))
        adam = [x for x in leaves if isinstance(x, self.optax.ScaleByAdamState)]
        if len(adam) != 1:
            raise RuntimeError("could not find optax's ScaleByAdamState in the optimizer state")
        torch = self.ctx.torch
        conv = lambda xs: [torch.from_numpy(np.array(x)) for x in xs]  # noqa: E731
        return conv(self.params), conv(adam[0].mu), conv(adam[0].nu)

    def extra(self):
        return dict(compile_and_first_step_s=self.compile_s, xla_flags=os.environ.get("XLA_FLAGS", ""))


class _InlineJmp:
    """What the jax peer uses of jmp (DeepMind's mixed-precision library, jmp 0.0.4), for
    when it is not installed: DynamicLossScale, all_finite, select_tree, the same math."""

    def __init__(self, jax, jnp):
        import dataclasses
        import functools

        self.all_finite = lambda tree: jnp.stack(
            [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]).all()
        self.select_tree = lambda pred, a, b: jax.tree_util.tree_map(functools.partial(jax.lax.select, pred), a, b)

        @jax.tree_util.register_pytree_node_class
        @dataclasses.dataclass(frozen=True)
        class DynamicLossScale:
            loss_scale: object
            counter: object = None
            period: int = 2000
            factor: int = 2

            def __post_init__(self):
                if self.counter is None:
                    object.__setattr__(self, "counter", jnp.zeros([], jnp.int32))

            def unscale(self, tree):
                inv = 1 / self.loss_scale
                return jax.tree_util.tree_map(lambda x: x * inv, tree)

            def adjust(self, finite):
                grown = self.loss_scale * self.factor
                scale = jax.lax.select(
                    finite,
                    jax.lax.select(self.counter == self.period - 1,
                                   jax.lax.select(jnp.isfinite(grown), grown, self.loss_scale), self.loss_scale),
                    jnp.maximum(jnp.ones([], jnp.float32), self.loss_scale / self.factor))
                counter = ((self.counter + 1) % self.period) * finite
                return DynamicLossScale(scale, counter, self.period, self.factor)

            def tree_flatten(self):
                return (self.loss_scale, self.counter), (self.period, self.factor)

            @classmethod
            def tree_unflatten(cls, meta, data):
                return cls(data[0], data[1], meta[0], meta[1])

        self.DynamicLossScale = DynamicLossScale


class SkipPeer(Exception):
    """A peer that does not apply to this run (the message says why)."""


# ---- Context: the shared tensors ------------------------------------------------------------


class Context:
    def __init__(self, args, shim, torch):
        self.args, self.shim, self.torch = args, shim, torch
        self.expected_scale = args.loss_scale
        self.versions = {}
        self.grads_dirty = False

    def allocate(self, shapes):
        """Weights ~ U(-0.1, 0.1), gradients ~ U(-1e-3, 1e-3) * S, fp32, one tensor each;
        a pristine copy of both (the verification's starting point and the restore source)."""
        torch = self.torch
        gen = torch.Generator().manual_seed(self.args.seed)
        self.weights, self.grads = [], []
        for _, n in shapes:
            w = torch.nn.Parameter(torch.empty(n, dtype=torch.float32).uniform_(-0.1, 0.1, generator=gen))
            g = torch.empty(n, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=gen).mul_(self.args.loss_scale)
            w.grad = g
            self.weights.append(w)
            self.grads.append(g)
        self.weights0 = [w.detach().clone() for w in self.weights]
        self.grads_backup = [g.clone() for g in self.grads]

    def restore_grads(self):
        self.torch._foreach_copy_(self.grads, self.grads_backup)
        self.grads_dirty = False

    def restore_weights(self):
        with self.torch.no_grad():
            self.torch._foreach_copy_(self.weights, self.weights0)


def rel_diff(peer, ref, elementwise=True):
    """The worst tensor's max_i |peer_i - ref_i| / max(|ref_i|, VERIFY_FLOOR * max|ref|)
    (elementwise), or max_i |peer_i - ref_i| / max|ref| (not elementwise)."""
    worst = 0.0
    for a, b in zip(peer, ref):
        a = a.reshape(-1).float()
        b = b.reshape(-1).float()
        if a.numel() != b.numel():
            return float("inf")
        if a.numel() == 0:
            continue
        top = float(b.abs().max())
        if elementwise:
            floor = max(top * VERIFY_FLOOR, 1e-30)
            worst = max(worst, float(((a - b).abs() / b.abs().clamp(min=floor)).max()))
        else:
            worst = max(worst, float((a - b).abs().max()) / max(top, 1e-30))
    return worst


def compare_step(dw, m, v, ref):
    """Verification figures of one peer's step against stepfuse's (ref = (dw, m, v)); see VERIFY_TOL."""
    num = sum(float(a.double().reshape(-1).dot(b.double().reshape(-1))) for a, b in zip(m, ref[1]))
    den = sum(float(b.double().reshape(-1).dot(b.double().reshape(-1))) for b in ref[1])
    r = num / den if den > 0 else 1.0
    d = dict(clip_coef=r - 1.0, weight_update=rel_diff(dw, ref[0], elementwise=False),
             exp_avg=rel_diff([a / r for a in m], ref[1]), exp_avg_sq=rel_diff([a / (r * r) for a in v], ref[2]))
    d["ok"] = (abs(d["clip_coef"]) <= NORM_TOL and d["weight_update"] <= VERIFY_TOL + abs(d["clip_coef"])
               and d["exp_avg"] <= VERIFY_TOL and d["exp_avg_sq"] <= VERIFY_TOL)
    return d


# ---- The comparison -------------------------------------------------------------------------


def run_peers(args, shim, torch, shapes, shapes_source):
    ctx = Context(args, shim, torch)
    n = sum(c for _, c in shapes)
    progress(f"allocating {commas(n)} parameters")
    ctx.allocate(shapes)

    makers = {"stepfuse": lambda: StepfusePeer(ctx), "torch-fused": lambda: TorchEagerPeer(ctx, "fused"),
              "torch-foreach": lambda: TorchEagerPeer(ctx, "foreach"), "torch-compile": lambda: TorchCompilePeer(ctx),
              "jax-optax": lambda: JaxPeer(ctx)}
    peers = [makers[name]() for name in args.peer_list]
    status = {p.name: {"status": "ok"} for p in peers}

    # ---- Verification: one step each from the same start; stepfuse's result is the reference.
    ref = None
    active = []
    for p in peers:
        progress(f"verifying {p.name} (one step from the starting point)")
        try:
            ctx.restore_weights()
            ctx.restore_grads()
            p.setup()
            p.step()
            p.check_applied()
            w, m, v = p.result()
            if p.name == "stepfuse":
                ref = ([a - b for a, b in zip(w, ctx.weights0)], m, v)
                status[p.name]["first_step"] = p.last_result()
                status[p.name]["verify"] = {"reference": True}
            else:
                d = compare_step([torch.as_tensor(a) - b for a, b in zip(w, ctx.weights0)], m, v, ref)
                status[p.name]["verify"] = d
                if not d["ok"]:
                    raise RuntimeError("one-step result differs from stepfuse's beyond fp32 rounding: " +
                                       ", ".join(f"{k} {v:.2e}" for k, v in d.items() if k != "ok"))
            del w, m, v
            if p.writes_torch_grads:
                ctx.grads_dirty = True
            active.append(p)
        except SkipPeer as e:
            status[p.name] = {"status": "skipped", "error": str(e)}
        except Exception as e:  # a peer failing is a result, reported in the table
            if p.name == "stepfuse":
                raise
            status[p.name].update(status="failed", error=first_lines(e), traceback=traceback.format_exc())
    del ref
    ctx.restore_weights()
    ctx.weights0 = None  # the verification's snapshot is not needed any more
    gc.collect()

    # ---- Timing: round-robin, the starting peer rotating each round.
    samples = {p.name: [] for p in active}
    gap = args.gap_ms / 1000.0
    rounds = args.warmup + args.steps
    for it in range(rounds):
        timed = it >= args.warmup
        progress(("timing %d/%d" % (it - args.warmup + 1, args.steps)) if timed
                 else ("warm-up %d/%d" % (it + 1, args.warmup)))
        k = it % len(active)
        for p in active[k:] + active[:k]:
            if p not in active:
                continue
            try:
                if p.reads_torch_grads and ctx.grads_dirty:
                    ctx.restore_grads()  # untimed: PyTorch's eager path unscaled and clipped them in place
                time.sleep(gap)
                t0 = time.perf_counter()
                p.step()
                t = time.perf_counter() - t0
                if p.writes_torch_grads:
                    ctx.grads_dirty = True
                p.check_applied()
                if timed:
                    samples[p.name].append(t)
            except Exception as e:
                if p.name == "stepfuse":
                    raise
                status[p.name].update(status="failed", error="during timing: " + first_lines(e),
                                      traceback=traceback.format_exc())
                active.remove(p)
    progress("")

    for p in peers:
        status[p.name]["what"] = p.what
        status[p.name].update(p.extra())
    return ctx, peers, status, samples


def first_lines(e, limit=300):
    s = f"{type(e).__name__}: {e}".strip()
    s = " ".join(s.split())
    return s if len(s) <= limit else s[:limit - 3] + "..."


def report_peers(args, shim, torch, shapes, shapes_source, ctx, peers, status, samples, t_start):
    n = sum(c for _, c in shapes)
    red, upd = step_bytes()
    per_param = red + upd
    step_total = per_param * n
    ref = summarize(samples["stepfuse"])
    print(f"stepfuse peers · {args.list_name}: {len(shapes)} tensors, {commas(n)} parameters "
          f"(tensor list from {shapes_source}) · fp32 weights and gradients · {args.threads} thread"
          f"{'s' if args.threads != 1 else ''} per peer")
    print(f"the step: unscale by 1/S (S = {args.loss_scale:g}), inf/NaN check (skip), clip global L2 norm to "
          f"{MAX_NORM:g}, AdamW(lr {HYPER['lr']:g}, betas {HYPER['beta1']:g}/{HYPER['beta2']:g}, eps "
          f"{HYPER['eps']:g}, weight decay {HYPER['weight_decay']:g}), GradScaler update")
    print(f"bytes the step must move (bench/step_bytes.cpp): reduce {red} + update {upd} = {per_param} B/param = "
          f"{step_total * 1e-9:.3f} GB per step, the same figure for every peer")
    print("versions: " + " · ".join(f"{k} {v}" for k, v in ctx.versions.items()))
    print(f"CPU: {cpu_model()} · {os.cpu_count()} logical CPUs · stepfuse kernels {shim.cpu_target}")
    sf_threads = status["stepfuse"].get("threads")
    print(f"threads: torch.set_num_threads({args.threads}) (eager and compiled); stepfuse num_threads {args.threads} "
          f"(uses {sf_threads})" + (f"; XLA_FLAGS='{os.environ.get('XLA_FLAGS', '')}' (XLA's CPU client sizes its "
                                     "pool from the CPUs the process may use, which these flags may not bind)"
                                     if "jax-optax" in args.peer_list else ""))
    print()
    fr = status["stepfuse"].get("first_step", {})
    print("verified before timing: one step of each peer from the same weights, gradients and zero state, against "
          f"stepfuse's (grad norm {fr.get('grad_norm', float('nan')):.6g}, clip coef "
          f"{fr.get('clip_coef', float('nan')):.6g}):")
    print(f"  clip coef: peer's / stepfuse's - 1, fitted from exp_avg (tolerance {NORM_TOL:g}); exp_avg, exp_avg_sq: "
          f"with that factor divided out, max_i |peer_i - sf_i| / max(|sf_i|, {VERIFY_FLOOR:g} max|sf|)")
    print(f"  (tolerance {VERIFY_TOL:g}); weight update w1 - w0: max|peer - sf| / max|sf| (tolerance {VERIFY_TOL:g} "
          "+ |clip coef|); the worst tensor of each")
    print(f"  {'peer':<14} {'clip coef':>10} {'exp_avg':>10} {'exp_avg_sq':>10} {'w update':>10}")
    for p in peers:
        v = status[p.name].get("verify")
        if p.name == "stepfuse":
            print(f"  {'stepfuse':<14} {'(the reference)':>10}")
        elif v is not None and "weight_update" in v:
            print(f"  {p.name:<14} {v['clip_coef']:>10.1e} {v['exp_avg']:>10.1e} {v['exp_avg_sq']:>10.1e} "
                  f"{v['weight_update']:>10.1e}{'' if v['ok'] else '  MISMATCH: not timed'}")
        else:
            print(f"  {p.name:<14} {'-':>10} {'-':>10} {'-':>10} {'-':>10}  ({status[p.name]['status']})")
    print()
    print(f"{args.steps} timed steps per peer after {args.warmup} warm-up rounds, interleaved round-robin (the first "
          f"peer rotates each round), {args.gap_ms:g} ms idle before each step;")
    print("gradients that PyTorch's eager path unscales and clips in place are restored between steps, OUTSIDE the "
          "timed region")
    print(f"  {'peer':<14} {'median ms':>10} {'min':>9} {'IQR':>9} {'GB/s':>8} {'peer/stepfuse':>14}")
    for p in peers:
        st = status[p.name]
        s = summarize(samples.get(p.name, []))
        if st["status"] != "ok" or s is None:
            print(f"  {p.name:<14} {st['status']}: {st.get('error', '')}")
            continue
        gbs = step_total / s["median"] * 1e-9
        ratio = s["median"] / ref["median"]
        st["ms"] = scaled_summary(s, 1e3)
        st["samples_ms"] = [x * 1e3 for x in samples[p.name]]
        st["gbs"] = gbs
        st["time_over_stepfuse"] = ratio
        print(f"  {p.name:<14} {s['median'] * 1e3:>10.2f} {s['min'] * 1e3:>9.2f} {(s['p75'] - s['p25']) * 1e3:>9.2f} "
              f"{gbs:>8.1f} {ratio:>13.2f}x")
    print("  (peer/stepfuse: the peer's median step time over stepfuse's; 2.00x = the peer takes twice as long. "
          "GB/s: the bytes above / median time)")
    print()
    print("what each timed step contains:")
    for p in peers:
        extra = ""
        cs = status[p.name].get("compile_and_first_step_s")
        if cs is not None:
            extra = f" [compile + first step: {cs:.1f} s, untimed]"
        print(f"  {p.name:<14} {status[p.name].get('what', p.what)}{extra}")
    print(f"total run time {time.perf_counter() - t_start:.1f} s")

    if args.json:
        j = dict(tool="bench/peers/peers.py", mode="peers", preset=args.preset, shapes_file=args.shapes,
                 shapes_source=shapes_source,
                 tensors=len(shapes), params=n, dtype=args.dtype, threads=args.threads, steps=args.steps,
                 warmup=args.warmup, gap_ms=args.gap_ms, loss_scale=args.loss_scale, seed=args.seed,
                 step=dict(max_grad_norm=MAX_NORM, optimizer="AdamW", **HYPER, growth_factor=GROWTH_FACTOR,
                           backoff_factor=BACKOFF_FACTOR, growth_interval=GROWTH_INTERVAL),
                 step_bytes=dict(reduce_per_param=red, update_per_param=upd, per_param=per_param, per_step=step_total),
                 grads_restore="outside the timed region (torch eager peers write the gradients)",
                 verify=dict(tolerance=VERIFY_TOL, floor=VERIFY_FLOOR, clip_coef_tolerance=NORM_TOL,
                             clip_coef="peer's clip coefficient / stepfuse's - 1, least-squares fit of exp_avg",
                             states="exp_avg / r, exp_avg_sq / r^2 (r = 1 + clip_coef): max_i |peer_i - stepfuse_i| "
                                    "/ max(|stepfuse_i|, floor * max|stepfuse|), worst tensor",
                             weight_update="max |peer - stepfuse| / max |stepfuse|, worst tensor; tolerance "
                                           "tolerance + |clip_coef|"),
                 versions=ctx.versions, machine=machine_info(), stepfuse_cpu_target=shim.cpu_target,
                 argv=sys.argv[1:], peers={p.name: status[p.name] for p in peers})
        write_json(args.json, j)


# ---- --overhead -----------------------------------------------------------------------------


def run_overhead(args, shim, torch, shapes, shapes_source, versions, t_start):
    """Plain AdamW step (no loss scale, no clipping) of stepfuse and torch fused AdamW on
    `shapes` ("many") and on one tensor of the same total size ("flat"), interleaved."""
    n = sum(c for _, c in shapes)
    lists = {"many": [c for _, c in shapes], "flat": [n]}
    gen = torch.Generator().manual_seed(args.seed)
    configs = []  # (peer, layout, step function)
    start = {}
    for layout, sizes in lists.items():
        w0 = [torch.empty(c).uniform_(-0.1, 0.1, generator=gen) for c in sizes]
        g0 = [torch.empty(c).uniform_(-1e-3, 1e-3, generator=gen) for c in sizes]
        start[layout] = (w0, g0)
    states = {}
    progress("building the optimizers")
    for peer in ("stepfuse", "torch-fused"):
        for layout in lists:
            w0, g0 = start[layout]
            ws = [torch.nn.Parameter(w.clone()) for w in w0]
            gs = [g.clone() for g in g0]
            for w, g in zip(ws, gs):
                w.grad = g
            if peer == "stepfuse":
                h = shim.optimizer(ws, gs, 0.0, args.threads)
                applied = ctypes.c_int()

                def step(h=h, applied=applied):
                    shim.check(shim.lib.sf_peer_optimizer_step(h, 0.0, ctypes.byref(applied)), "step")
                states[(peer, layout)] = (ws, h)
            else:
                opt = torch.optim.AdamW(ws, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                                        weight_decay=HYPER["weight_decay"], fused=True)
                step = opt.step
                states[(peer, layout)] = (ws, opt)
            configs.append((peer, layout, step))

    # Verify: the first step of each (stepfuse, torch fused) pair from the same start must agree.
    progress("verifying one step of each against each other")
    verify = {}
    for peer, layout, step in configs:
        step()
    for layout in lists:
        w0 = start[layout][0]
        ws_sf, h = states[("stepfuse", layout)]
        ws_t, opt = states[("torch-fused", layout)]
        ref = [[a.detach() - b for a, b in zip(ws_sf, w0)]]
        for name in ("exp_avg", "exp_avg_sq"):
            ref.append([])
            for i, w in enumerate(ws_sf):
                out = torch.empty(w.numel())
                shim.check(shim.lib.sf_peer_optimizer_copy_state(h, i, name.encode(), out.data_ptr(), out.numel()),
                           "copy_state")
                ref[-1].append(out)
        d = compare_step([a.detach() - b for a, b in zip(ws_t, w0)], [opt.state[w]["exp_avg"] for w in ws_t],
                         [opt.state[w]["exp_avg_sq"] for w in ws_t], ref)
        verify[layout] = d
        if not d["ok"]:
            print(f"peers: VERIFICATION FAILED ({layout}): torch fused AdamW and stepfuse disagree: {d}",
                  file=sys.stderr)
            return 2
    del start
    threads_sf = shim.lib.sf_peer_optimizer_num_threads(states[("stepfuse", "many")][1])

    samples = {(p, l): [] for p, l, _ in configs}
    gap = args.gap_ms / 1000.0
    for it in range(args.warmup + args.steps):
        timed = it >= args.warmup
        progress(("timing %d/%d" % (it - args.warmup + 1, args.steps)) if timed
                 else ("warm-up %d/%d" % (it + 1, args.warmup)))
        k = it % len(configs)
        for peer, layout, step in configs[k:] + configs[:k]:
            time.sleep(gap)
            t0 = time.perf_counter()
            step()
            t = time.perf_counter() - t0
            if timed:
                samples[(peer, layout)].append(t)
    progress("")

    _, upd = step_bytes(reduce_pass=False)
    print(f"stepfuse peers --overhead · per-step fixed cost: {args.list_name} ({len(shapes)} tensors, "
          f"{commas(n)} parameters, from {shapes_source}) vs flat (1 tensor of {commas(n)}) · {args.threads} thread"
          f"{'s' if args.threads != 1 else ''} (stepfuse uses {threads_sf})")
    print(f"the step: plain AdamW (lr {HYPER['lr']:g}, betas {HYPER['beta1']:g}/{HYPER['beta2']:g}, eps "
          f"{HYPER['eps']:g}, wd {HYPER['weight_decay']:g}), no loss scale, no clipping: stepfuse Optimizer::step() "
          f"and torch.optim.AdamW(fused=True).step(); {upd} B/param")
    print("versions: " + " · ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"CPU: {cpu_model()} · {os.cpu_count()} logical CPUs · stepfuse kernels {shim.cpu_target}")
    print("verified before timing: one step of torch fused AdamW against stepfuse's from the same start (figures "
          "as in the peers mode): " +
          "; ".join(f"{layout}: exp_avg {d['exp_avg']:.1e}, exp_avg_sq {d['exp_avg_sq']:.1e}, weight update "
                    f"{d['weight_update']:.1e}" for layout, d in verify.items()))
    print()
    print(f"{args.steps} timed steps per configuration after {args.warmup} warm-up rounds, interleaved round-robin:")
    print(f"  {'peer':<12} {'layout':<7} {'median ms':>10} {'min':>9} {'IQR':>9} {'GB/s':>8}")
    summ = {}
    for peer, layout, _ in configs:
        s = summarize(samples[(peer, layout)])
        summ[(peer, layout)] = s
        gbs = upd * n / s["median"] * 1e-9
        print(f"  {peer:<12} {layout:<7} {s['median'] * 1e3:>10.2f} {s['min'] * 1e3:>9.2f} "
              f"{(s['p75'] - s['p25']) * 1e3:>9.2f} {gbs:>8.1f}")
    print()
    print(f"fixed overhead = median(many) - median(flat), per step and per tensor ({len(shapes)} tensors):")
    print(f"  {'peer':<12} {'us/step':>10} {'us/tensor':>10}   (paired: median over rounds of many - flat)")
    result = {}
    for peer in ("stepfuse", "torch-fused"):
        d = summ[(peer, "many")]["median"] - summ[(peer, "flat")]["median"]
        paired = sorted(a - b for a, b in zip(samples[(peer, "many")], samples[(peer, "flat")]))
        pm = quantile(paired, 0.5)
        result[peer] = dict(us_per_step=d * 1e6, us_per_tensor=d * 1e6 / len(shapes), paired_us_per_step=pm * 1e6,
                            paired_us_per_tensor=pm * 1e6 / len(shapes))
        print(f"  {peer:<12} {d * 1e6:>10.0f} {d * 1e6 / len(shapes):>10.3f}   (paired {pm * 1e6:.0f} us/step, "
              f"{pm * 1e6 / len(shapes):.3f} us/tensor)")
    print(f"total run time {time.perf_counter() - t_start:.1f} s")
    if args.json:
        j = dict(tool="bench/peers/peers.py", mode="overhead", preset=args.preset, shapes_file=args.shapes,
                 shapes_source=shapes_source,
                 tensors=len(shapes), params=n, dtype=args.dtype, threads=args.threads, stepfuse_threads=threads_sf,
                 steps=args.steps, warmup=args.warmup, gap_ms=args.gap_ms, seed=args.seed,
                 step=dict(optimizer="AdamW", **HYPER, loss_scale=None, max_grad_norm=None),
                 step_bytes=dict(per_param=upd, per_step=upd * n), versions=versions, machine=machine_info(),
                 stepfuse_cpu_target=shim.cpu_target, argv=sys.argv[1:], verify=verify,
                 configs={f"{p}/{l}": dict(peer=p, layout=l, ms=scaled_summary(summ[(p, l)], 1e3),
                                           samples_ms=[x * 1e3 for x in samples[(p, l)]],
                                           gbs=upd * n / summ[(p, l)]["median"] * 1e-9) for p, l, _ in configs},
                 overhead=result)
        write_json(args.json, j)
    return 0


# ---- Helpers --------------------------------------------------------------------------------


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info():
    info = dict(cpu=cpu_model(), logical_cpus=os.cpu_count(), platform=platform.platform())
    if hasattr(os, "sched_getaffinity"):
        info["cpus_allowed"] = len(os.sched_getaffinity(0))
    return info


def write_json(path, j):
    with open(path, "w") as f:
        json.dump(j, f, indent=2)
        f.write("\n")


def main(argv):
    args = parse_args(argv)
    t_start = time.perf_counter()
    # XLA reads its flags when JAX creates the CPU client: set them before jax is imported.
    if not args.overhead and "jax-optax" in args.peer_list:
        flags = os.environ.get("XLA_FLAGS", "")
        flags += (f" --xla_cpu_multi_thread_eigen={'true' if args.threads > 1 else 'false'}"
                  f" intra_op_parallelism_threads={args.threads}")
        os.environ["XLA_FLAGS"] = flags.strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        shim = Shim(args.shim)
        shapes, shapes_source = load_shapes(args)
    except RuntimeError as e:
        print(f"peers: {e}", file=sys.stderr)
        return 1

    import torch
    torch.set_num_threads(args.threads)
    versions = {"stepfuse": shim.version, "torch": torch.__version__, "python": platform.python_version()}
    try:
        if args.overhead:
            return run_overhead(args, shim, torch, shapes, shapes_source, versions, t_start)
        if "jax-optax" in args.peer_list:
            try:
                import jax
                import jaxlib
                import optax
                versions.update(jax=jax.__version__, jaxlib=jaxlib.__version__, optax=optax.__version__)
            except ImportError as e:
                versions["jax"] = f"not importable ({e})"
        ctx, peers, status, samples = run_peers(args, shim, torch, shapes, shapes_source)
        ctx.versions = {**versions, **ctx.versions}
        report_peers(args, shim, torch, shapes, shapes_source, ctx, peers, status, samples, t_start)
        return 0
    except RuntimeError as e:
        progress("")
        if str(e).startswith("stepfuse"):
            print(f"peers: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        progress("")
        sys.exit(130)
    except Exception:
        progress("")
        traceback.print_exc()
        sys.exit(3)
