"""The low-precision peers (--dtype bf16): bf16 weights and bf16 gradients, the same step (unscale,
inf/NaN check and skip, clip to 1.0, AdamW, GradScaler update), each peer storing the parameter
and the AdamW state its own way:

  stepfuse.torch-masters      stepfuse.torch.AdamW(..., max_grad_norm=1.0, master_weights=True): fp32
                              masters, the bf16 weight rounded to nearest from its master (the
                              reference point of the ratios);
  stepfuse.torch-sr           master_weights=False, stochastic_rounding=True, seed=--seed: the bf16
                              weight is the only copy, rounded stochastically;
  stepfuse.torch-compensated  master_weights=False, compensated_weights=True: a bf16 compensation
                              per weight (Kahan), rounded to nearest;
  stepfuse.torch-sr-q8        stepfuse.torch-sr with state_format="q8": exp_avg and exp_avg_sq stored as
                              8-bit codes in 256-element blocks with an fp32 absmax each (the dynamic map
                              of bitsandbytes: signed for exp_avg, unsigned for exp_avg_sq), fp32 state for
                              tensors under min_q8_numel=4096 elements: the fewest bytes (about 12 B/param),
                              the row to set beside torchao's AdamW8bit and bitsandbytes' AdamW8bit;
  stepfuse.torch-sr-bf16s     stepfuse.torch-sr with state_format="bf16": bf16 state, rounded stochastically
                              as the weights (each stream with bits of its own);
  stepfuse.torch-sr-bf16n     the same with stochastic_state_rounding=False: bf16 state rounded to nearest
                              even (as torchao's AdamW keeps it);
  stepfuse.torch-masters-q8   stepfuse.torch-masters with state_format="q8";
    (each with stepfuse.torch.GradScaler('cpu'), step(opt), update(), as the stepfuse.torch peer; a step
    decodes stored state to fp32, updates it and stores it encoded again; lowp_result() reads q8 state
    back decoded by the library, stepfuse.Optimizer.state_values);
  torchao-adamw-sr            torchao's AdamW with bf16_stochastic_round=True (torchao.optim._AdamW;
                              its state is allocated like the param: bf16);
  torchao-adamw8bit-sr        torchao.optim.AdamW8bit(bf16_stochastic_round=True): 8-bit block-wise
                              state (tensors of >= 4096 elements divisible by 256; bf16 state below);
  bnb-adamw8bit               bitsandbytes.optim.AdamW8bit on its CPU backend: 8-bit block-wise state
                              (tensors of >= 4096 elements; fp32 state below), the weight rounded to
                              nearest;
    (each with torch.amp.GradScaler('cpu'): unscale_, clip_grad_norm_(foreach=True), step, update,
    as the torch eager peers).

Every peer also gives lowp_result() (its weights, its state as fp32, the block size of 8-bit state,
the parameter it keeps beside the weight) for lowp_verify.py, storage() (the bytes per parameter it
stores, for the byte model), grad_tol (the relative error its gradients may carry: config.py), the
stepfuse rows state_tol (that of their fp32 or bf16 state, where it is not grad_tol) and rounding (how
it rounds the bf16 weight: "stochastic" or "nearest")."""

import logging
import time

from .config import HYPER, LOWP_BF16_STATE_TOL, LOWP_GRAD_TOL, VERIFY_TOL
from .peer import SkipPeer
from .stepfuse_peer import StepfuseTorchPeer, adamw_config
from .torch_peers import TorchEagerPeer


def numel(ctx):
    return sum(w.numel() for w in ctx.weights)


def nbytes(t):
    return t.numel() * t.element_size()


class StepfuseTorchLowpPeer(StepfuseTorchPeer):
    """stepfuse.torch.AdamW on the bf16 params with one of its three ways to keep them (VARIANTS: fp32
    masters, stochastic rounding, or compensated weights) and one of its state formats (STATES: fp32,
    bf16 or q8). The peer's name is stepfuse.torch-VARIANT, or stepfuse.torch-VARIANT-STATE for stored
    state other than fp32."""

    required = True
    grad_tol = VERIFY_TOL  # the gradients are read as stored and unscaled and clipped in fp32
    VARIANTS = {
        "masters": (dict(master_weights=True),
                    "master_weights=True: fp32 masters, each bf16 weight rounded to nearest from its master"),
        "sr": (dict(master_weights=False, stochastic_rounding=True),
               "master_weights=False, stochastic_rounding=True, seed=SEED: no masters, the bf16 weight rounded "
               "stochastically (Philox bits keyed by the seed)"),
        "compensated": (dict(master_weights=False, compensated_weights=True),
                        "master_weights=False, compensated_weights=True: no masters, a bf16 compensation per weight "
                        "(what rounding it to nearest lost, Kahan)"),
    }
    # How the AdamW state is stored between steps (the name's suffix: its state_format and what it is).
    # A step decodes it to fp32, updates it in fp32 and stores it encoded again, so the weights of the
    # first step are those of fp32 state; only the stored state differs (its tolerance: state_tol).
    STATES = {
        "": ("f32", "fp32 state"),
        "bf16s": ("bf16", "state_format='bf16': exp_avg and exp_avg_sq stored as bf16 (rounded stochastically "
                          "beside stochastically rounded weights, else to nearest even)"),
        "bf16n": ("bf16", "state_format='bf16', stochastic_state_rounding=False: exp_avg and exp_avg_sq stored "
                          "as bf16 rounded to nearest even"),
        "q8": ("q8", "state_format='q8': exp_avg and exp_avg_sq stored as 8-bit codes in 256-element blocks with "
                     "an fp32 absmax each (bitsandbytes' dynamic map: signed for exp_avg, unsigned for exp_avg_sq), "
                     "fp32 for tensors under min_q8_numel=4096 elements"),
    }

    def __init__(self, ctx, name):
        super().__init__(ctx)
        variant, _, state = name.partition("-")
        self.variant, self.state = variant, state
        self.state_format = self.STATES[state][0]
        self.name = "stepfuse.torch-" + name
        self.rounding = "stochastic" if variant == "sr" else "nearest"  # of the bf16 weight
        # fp32 and q8 state: the fp32 step's tolerance (q8's blocks get + its code books' step, in
        # lowp_verify.py); bf16 state: + one rounding to bf16, which the clip coef fitted from it carries
        # too (config.py).
        self.state_tol = LOWP_BF16_STATE_TOL if self.state_format == "bf16" else VERIFY_TOL
        self.what = ("stepfuse.torch.GradScaler('cpu'): step(opt), update(), with stepfuse.torch.AdamW(params, lr, "
                     "betas, eps, weight_decay, max_grad_norm=1.0, " +
                     self.VARIANTS[variant][1].replace("SEED", str(ctx.args.seed)) + "); " + self.STATES[state][1])

    def options(self):
        kw = dict(self.VARIANTS[self.variant][0])
        if kw.get("stochastic_rounding"):
            kw["seed"] = self.ctx.args.seed
        if self.state_format != "f32":
            kw["state_format"] = self.state_format
        if self.state == "bf16n":
            kw["stochastic_state_rounding"] = False
        return kw

    def stored_state(self, w):
        """Param w's AdamW state tensors as stored in opt.state: exp_avg and exp_avg_sq (fp32, bfloat16, or
        uint8 q8 codes), and the fp32 absmax scales of those stored as q8."""
        st = self.opt.state[w]
        return [st[k] for k in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax") if k in st]

    def q8_code_step(self):
        """The largest step between two neighbouring codes of the q8 code books (exp_avg's signed map and
        exp_avg_sq's unsigned one), read from the library: a 256-element stream stored as q8 with the codes
        0..255 and an absmax of 1, decoded by the library (stepfuse.Optimizer.state_values)."""
        import numpy as np
        sf = self.ctx.sf
        n = 256
        dec = sf.Optimizer(adamw_config(sf), [(np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.float32))],
                           state_format="q8", min_q8_numel=0, num_threads=1)
        step = 0.0
        for name in ("exp_avg", "exp_avg_sq"):
            dec.state_storage(0, name)[:] = np.arange(n, dtype=np.uint8)
            dec.state_absmax(0, name)[:] = 1.0
            book = np.sort(dec.state_values(0, name).astype(np.float64))
            step = max(step, float(np.diff(book).max()))
        return step

    def lowp_result(self):
        ws = self.ctx.weights
        st = [self.opt.state[w] for w in ws]
        param = None
        if self.variant == "masters":
            param = [s["master_param"].double() for s in st]
        elif self.variant == "compensated":
            # weight + compensation, exactly (in fp64): the parameter the step continues from.
            param = [w.detach().double() + s["compensation"].double() for w, s in zip(ws, st)]
        torch, engine = self.ctx.torch, self.opt._engine
        index = {id(p): i for i, p in enumerate(self.opt._active)}  # the engine's param order
        state = dict(exp_avg=[], exp_avg_sq=[])
        blocks = []
        for w, s in zip(ws, st):
            for key, out in state.items():
                if s[key].dtype == torch.uint8:  # q8: decoded to fp32 by the library
                    out.append(torch.from_numpy(engine.state_values(index[id(w)], key).copy()))
                else:  # fp32, or bf16 widened exactly
                    out.append(s[key].detach().float().reshape(-1).clone())
            blocks.append(256 if "exp_avg_absmax" in s else None)  # q8's blocks (fp32 below min_q8_numel)
        code_step = self.q8_code_step() if any(blocks) else None
        return dict(weights=[w.detach().clone() for w in ws], exp_avg=state["exp_avg"],
                    exp_avg_sq=state["exp_avg_sq"], blocks=blocks, param=param, code_step=code_step)

    def storage(self):
        # The state's real bytes: fp32 4 B, bf16 2 B, or q8's 1 B codes + a 4 B absmax per 256 elements
        # (fp32 for tensors under min_q8_numel), both streams.
        state = sum(nbytes(t) for w in self.ctx.weights for t in self.stored_state(w)) / numel(self.ctx)
        if self.variant == "masters":
            return dict(param_read=4.0, param_write=4.0 + 2.0, state=state)  # read the master; write it and the weight
        if self.variant == "compensated":
            return dict(param_read=2.0 + 2.0, param_write=2.0 + 2.0, state=state)
        return dict(param_read=2.0, param_write=2.0, state=state)


class TorchLowpPeer(TorchEagerPeer):
    """A torch.optim-style low-precision optimizer behind torch.amp.GradScaler('cpu') unscale_ +
    clip_grad_norm_ + step + update, as the torch eager peers: the gradients are unscaled and
    clipped in place, in bf16. The first step (the verification's) is timed on its own (torchao
    compiles there) and reported, untimed."""

    grad_tol = LOWP_GRAD_TOL
    rounding = "stochastic"  # of the bf16 weight
    first_step_s = None

    def __init__(self, ctx, name, what):
        TorchEagerPeer.__init__(self, ctx, "lowp")
        self.name = name
        self.what = ("torch.amp.GradScaler('cpu'): unscale_(opt), clip_grad_norm_(params, 1.0, foreach=True), "
                     "step(opt), update(), with " + what)

    def step(self):
        if self.first_step_s is None:
            t0 = time.perf_counter()
            TorchEagerPeer.step(self)
            self.first_step_s = time.perf_counter() - t0
        else:
            TorchEagerPeer.step(self)

    def state_tensors(self, w):
        """(exp_avg, exp_avg_sq, block size or None, [code books]) of param w, as fp32 tensors."""
        raise NotImplementedError

    def lowp_result(self):
        m, v, blocks, steps = [], [], [], []
        for w in self.ctx.weights:
            a, b, block, books = self.state_tensors(w)
            m.append(a)
            v.append(b)
            blocks.append(block)
            for book in books:
                steps.append(float(book.float().sort().values.diff().max()))
        return dict(weights=[w.detach().clone() for w in self.ctx.weights], exp_avg=m, exp_avg_sq=v, blocks=blocks,
                    param=None, code_step=max(steps) if steps else None)

    def extra(self):
        return dict(first_step_s=self.first_step_s)


def torchao_optim():
    """(module, version): torchao's low-bit optimizers (torchao.optim; torchao.prototype.low_bit_optim
    in older releases); SkipPeer saying what to do where torchao is missing."""
    try:
        import torchao
    except Exception as e:  # ImportError, or an error of a torchao built for another torch
        raise SkipPeer(f"torchao is not importable ({type(e).__name__}: {e}): pip install torchao into the "
                       "venv (bench/peers/run.sh does)")
    for mod_name in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            mod = __import__(mod_name, fromlist=["AdamW8bit"])
        except ImportError:
            continue
        if hasattr(mod, "AdamW8bit"):
            return mod, torchao.__version__
    raise SkipPeer(f"torchao {torchao.__version__} has neither torchao.optim nor "
                   "torchao.prototype.low_bit_optim with AdamW8bit: pip install --upgrade torchao")


class TorchaoPeer(TorchLowpPeer):
    """torchao's AdamW (bf16 state) or AdamW8bit on the bf16 params, bf16_stochastic_round=True. torchao
    runs each param's update as a torch.compile'd function (one compile per distinct shape and state
    kind, in the first step, which the verification takes)."""

    def __init__(self, ctx, kind):
        self.kind = kind
        self.default_cls = {"adamw-sr": "torchao.optim._AdamW", "adamw8bit-sr": "torchao.optim.AdamW8bit"}[kind]
        what = {"adamw-sr": "{cls}(params, lr, betas, eps, weight_decay, bf16_stochastic_round=True) "
                            "(bf16 state, as torchao allocates it like the param; a torch.compile'd update per param)",
                "adamw8bit-sr": "{cls}(params, lr, betas, eps, weight_decay, "
                                "bf16_stochastic_round=True) (8-bit state in 256-element blocks for tensors of >= 4096 "
                                "elements divisible by 256, bf16 state for the others; a torch.compile'd update per "
                                "param)"}[kind].replace("{cls}", self.default_cls)
        super().__init__(ctx, "torchao-" + kind, what)

    def setup(self):
        ctx = self.ctx
        mod, version = torchao_optim()
        ctx.versions["torchao"] = version
        if self.kind == "adamw-sr":
            # torchao 0.18 names it _AdamW (its base class's bf16_stochastic_round, without quantized
            # state); AdamW is tried after it, for a release that names it so.
            self.cls = getattr(mod, "_AdamW", None) or getattr(mod, "AdamW", None)
            if self.cls is None:
                raise SkipPeer(f"torchao {version} has no _AdamW (nor AdamW) in {mod.__name__}: the AdamW "
                               "with bf16_stochastic_round this peer times")
        else:
            self.cls = mod.AdamW8bit
        self.what = self.what.replace(self.default_cls, f"{mod.__name__}.{self.cls.__name__}")
        if len(ctx.weights) > ctx.args.compile_max_tensors:
            raise SkipPeer(f"{len(ctx.weights)} tensors > --compile-max-tensors {ctx.args.compile_max_tensors} "
                           "(torchao's step calls a torch.compile'd update once per tensor; inductor compiles it once "
                           "per distinct shape)")
        super().setup()

    def extra(self):
        return dict(compile_and_first_step_s=self.first_step_s)

    def make_optimizer(self):
        try:
            return self.cls(self.ctx.weights, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], bf16_stochastic_round=True)
        except TypeError as e:
            raise SkipPeer(f"{self.cls.__module__}.{self.cls.__name__} takes no bf16_stochastic_round in "
                           f"this torchao ({e}): pip install --upgrade torchao")

    def state_tensors(self, w):
        st = self.opt.state[w]
        out, block, books = [], None, []
        for key in ("exp_avg", "exp_avg_sq"):
            x = st[key]
            if hasattr(x, "codes") and hasattr(x, "dequantize"):  # OptimState8bit: codes, scale per block, qmap
                out.append(x.dequantize().float().reshape(-1))
                block = x.block_size
                books.append(x.qmap)
            else:
                out.append(x.detach().float().reshape(-1).clone())
        return out[0], out[1], block, books

    def storage(self):
        state = 0
        for w in self.ctx.weights:
            for key in ("exp_avg", "exp_avg_sq"):
                x = self.opt.state[w][key]
                state += nbytes(x.codes) + nbytes(x.scale) if hasattr(x, "codes") else nbytes(x)
        return dict(param_read=2.0, param_write=2.0, state=state / numel(self.ctx))


class BnbPeer(TorchLowpPeer):
    """bitsandbytes' AdamW8bit on its CPU backend (torch ops around libbitsandbytes_cpu's block-wise
    quantization): the weight is rounded to nearest (bitsandbytes has no stochastic rounding).
    libbitsandbytes_cpu's OpenMP loops run in torch's libgomp (the same soname, loaded first), so
    torch.set_num_threads sizes them too."""

    rounding = "nearest"

    def __init__(self, ctx):
        super().__init__(ctx, "bnb-adamw8bit",
                         "bitsandbytes.optim.AdamW8bit(params, lr, betas, eps, weight_decay) on its CPU backend (8-bit "
                         "state in 256-element blocks for tensors of >= 4096 elements, fp32 state for the others; the "
                         "bf16 weight rounded to nearest)")

    def setup(self):
        # Importing bitsandbytes logs that a 4-bit matmul kernel from the `kernels` package is
        # missing; the 8-bit optimizer does not use it.
        log = logging.getLogger("bitsandbytes")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            import bitsandbytes as bnb
            import bitsandbytes.functional
        except Exception as e:
            raise SkipPeer(f"bitsandbytes is not importable ({type(e).__name__}: {e}): pip install "
                           "bitsandbytes into the venv (its PyPI wheel has the CPU backend; 0.50.2 runs here)")
        finally:
            log.setLevel(level)
        self.bnb = bnb
        self.ctx.versions["bitsandbytes"] = bnb.__version__
        super().setup()

    def make_optimizer(self):
        return self.bnb.optim.AdamW8bit(self.ctx.weights, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                        eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])

    def state_tensors(self, w):
        st = self.opt.state[w]
        out, block, books = [], None, []
        for i in (1, 2):
            x = st[f"state{i}"]
            if x.dtype == self.ctx.torch.uint8:
                absmax, code = st[f"absmax{i}"], st[f"qmap{i}"]
                block = 256  # the CPU backend's block size (backends/cpu/ops.py); check it against absmax
                if absmax.numel() != -(-x.numel() // block):
                    raise RuntimeError(f"bnb-adamw8bit: {absmax.numel()} absmax values for {x.numel()} elements: not "
                                       f"blocks of {block}")
                deq = self.bnb.functional.dequantize_blockwise(x, absmax=absmax, code=code, blocksize=block)
                out.append(deq.float().reshape(-1))
                books.append(code)
            else:
                out.append(x.detach().float().reshape(-1).clone())
        return out[0], out[1], block, books

    def storage(self):
        state = 0
        for w in self.ctx.weights:
            st = self.opt.state[w]
            for i in (1, 2):
                state += nbytes(st[f"state{i}"]) + (nbytes(st[f"absmax{i}"]) if f"absmax{i}" in st else 0)
        return dict(param_read=2.0, param_write=2.0, state=state / numel(self.ctx))


def make_lowp_peer(ctx, name):
    if name.startswith("stepfuse.torch-"):
        return StepfuseTorchLowpPeer(ctx, name[len("stepfuse.torch-"):])
    if name.startswith("torchao-"):
        return TorchaoPeer(ctx, name[len("torchao-"):])
    if name == "bnb-adamw8bit":
        return BnbPeer(ctx)
    raise ValueError(name)
