#!/usr/bin/env python3
"""Train a small character-level GPT on the CPU twice, once with stepfuse and once with
PyTorch's own fused AdamW (or torchao's 8-bit AdamW), and compare the losses and the
optimizer step.

Both runs start from the same initial weights and see the same batches in the same order.
They train under ``torch.autocast("cpu", dtype=torch.bfloat16)`` with two parameter groups
(weight decay only on the Linear weights: none on biases, LayerNorms and embeddings), a
loss scaler and global-norm clipping at 1.0:

A (stepfuse)
    ``stepfuse.torch.AdamW(groups, ..., max_grad_norm=1.0)`` and
    ``stepfuse.torch.GradScaler("cpu")``: ``scaler.scale(loss).backward()``,
    ``scaler.step(opt)``, ``scaler.update()``. Unscaling, the inf/NaN check, the clip and
    the AdamW update are one fused step.
B (PyTorch)
    ``torch.optim.AdamW(groups, ..., fused=True)`` and ``torch.amp.GradScaler("cpu")``:
    ``scaler.scale(loss).backward()``, ``scaler.unscale_(opt)``,
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``, ``scaler.step(opt)``,
    ``scaler.update()``.

``--state {f32,bf16,q8}`` sets run A's ``state_format``: the optimizer state (``exp_avg``,
``exp_avg_sq``) kept in fp32 (the default), bf16, or q8 (block-wise 8-bit: one fp32 absmax
per 256 elements, bitsandbytes' dynamic maps; tensors under 4096 elements stay fp32).
``--baseline torchao-adamw8bit`` makes run B ``torchao.optim.AdamW8bit`` (8-bit block-wise
state, block 256) with the same groups, lr, betas, eps and weight decay, behind the same
``torch.amp.GradScaler`` + ``unscale_`` + ``clip_grad_norm_`` as above (``pip install
torchao``). With either option the labels say which state and baseline ran, the script
prints and writes the bytes of optimizer state per parameter of each run (counted from the
state tensors, step counters left out), and the plot and summary go to their own names
(``train_gpt_q8_torchao.png`` / ``.md`` for ``--state q8 --baseline torchao-adamw8bit``,
say), so the default ``train_gpt.png`` and ``train_gpt.md`` stay as they are.

The two runs are interleaved step by step (which one goes first alternates), so a busy
moment on the machine costs both. The optimizer-step time is everything after
``backward()``: ``step`` + ``update`` for A, ``unscale_`` + clip + ``step`` + ``update``
for B. The script prints the medians and writes a plot of the losses and a markdown
summary (``train_gpt.png`` and ``train_gpt.md`` in ``--out-dir``, ``docs/`` by default).
When it rewrites a summary that holds the line ``<!-- train_gpt.py keeps what follows -->``,
that line and what follows it are kept (hand-written sections about other runs).

Run ``pip install .`` at the repository root first, then::

    python examples/python/train_gpt.py            # the full comparison, a few minutes
    python examples/python/train_gpt.py --quick    # a smoke test: a few steps, tiny model
    python examples/python/train_gpt.py --only torch   # run B only, stepfuse not needed
    python examples/python/train_gpt.py --state q8 --baseline torchao-adamw8bit
                                                       # 8-bit state, against torchao's
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    sys.exit("train_gpt.py needs PyTorch: pip install torch")

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
DEFAULT_DATA = HERE / "data" / "tinyshakespeare.txt"
DEFAULT_OUT = REPO_ROOT / "docs"
STATE_FORMATS = ("f32", "bf16", "q8")
BASELINES = ("torch", "torchao-adamw8bit")
KEEP_MARKER = "<!-- train_gpt.py keeps what follows -->"


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Train a small character-level GPT on the CPU (bf16 autocast, loss scaler, "
            "clipping at 1.0) with stepfuse.torch.AdamW + stepfuse.torch.GradScaler (run A) "
            "and with torch.optim.AdamW(fused=True) (or torchao.optim.AdamW8bit, see "
            "--baseline) + torch.amp.GradScaler + clip_grad_norm_ (run B), from the same "
            "initial weights and on the same batches, and compare the losses and the "
            "optimizer-step time."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per run (default: 800, or 20 with --quick)")
    p.add_argument("--layers", type=int, default=None,
                   help="transformer blocks (default: 4, or 2 with --quick)")
    p.add_argument("--d-model", type=int, default=None,
                   help="embedding width (default: 64, or 32 with --quick)")
    p.add_argument("--heads", type=int, default=None,
                   help="attention heads; must divide --d-model (default: 4, or 2 with --quick)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="context length in characters (default: 64, or 32 with --quick)")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per batch (default: 16, or 4 with --quick)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="peak learning rate (linear warm-up, then cosine decay to lr/10)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps (default: 5%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="weight decay of the Linear weights (the other group has none)")
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="global gradient-norm clip")
    p.add_argument("--eval-every", type=int, default=None,
                   help="held-out loss every N steps (default: 50, or 10 with --quick)")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="batches in each held-out estimate (default: 8, or 2 with --quick)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: leave PyTorch's setting)")
    p.add_argument("--seed", type=int, default=1337,
                   help="seed of the initial weights and of the batch order")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="a text file; the first 90%% trains, the last 10%% is held out")
    p.add_argument("--state", choices=STATE_FORMATS, default="f32",
                   help="run A's state_format: the AdamW state (exp_avg, exp_avg_sq) in fp32, "
                        "bf16, or q8 (block-wise 8-bit, 256-element blocks with an fp32 "
                        "absmax; tensors under 4096 elements stay fp32)")
    p.add_argument("--baseline", choices=BASELINES, default="torch",
                   help="run B's optimizer: torch.optim.AdamW(fused=True), or "
                        "torchao.optim.AdamW8bit (8-bit block-wise state, block 256; needs "
                        "pip install torchao); either behind torch.amp.GradScaler + unscale_ "
                        "+ clip_grad_norm_")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT,
                   help="where the plot and the summary go: train_gpt.png and train_gpt.md, "
                        "or train_gpt[_<state>][_torchao].png / .md with a --state or "
                        "--baseline other than the default")
    p.add_argument("--write", action=argparse.BooleanOptionalAction, default=None,
                   help="write the plot and the summary (default: yes, but no with --quick)")
    p.add_argument("--note", action="append", default=[],
                   help="a line to add to the summary (about the machine, say); repeatable")
    p.add_argument("--only", choices=("both", "stepfuse", "torch"), default="both",
                   help="run A (stepfuse), B (torch) or both; 'torch' needs no stepfuse")
    p.add_argument("--stand-in", action="store_true",
                   help="development aid: run A with torch.optim.AdamW (foreach) clipping "
                        "inside its step and torch.amp.GradScaler instead of stepfuse.torch, "
                        "so the whole script runs without stepfuse; its timings say nothing "
                        "about stepfuse and the summary says so")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: a few steps of a tiny model, nothing written unless --write")
    p.add_argument("--log-every", type=int, default=None,
                   help="print the losses every N steps (default: --eval-every)")
    args = p.parse_args(argv)

    q = args.quick
    defaults = dict(steps=(20, 800), layers=(2, 4), d_model=(32, 64), heads=(2, 4),
                    seq_len=(32, 64), batch=(4, 16), eval_every=(10, 50),
                    eval_batches=(2, 8))
    for name, (quick_value, full_value) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick_value if q else full_value)
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    if args.log_every is None:
        args.log_every = args.eval_every
    if args.write is None:
        args.write = not q
    if args.d_model % args.heads:
        p.error(f"--heads {args.heads} does not divide --d-model {args.d_model}")
    for name in ("steps", "layers", "d_model", "heads", "seq_len", "batch", "eval_every",
                 "eval_batches", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if args.stand_in and args.only == "torch":
        p.error("--stand-in replaces run A, which --only torch does not run")
    if args.stand_in and args.state != "f32":
        p.error("--stand-in (torch's AdamW) keeps its state in fp32: no --state "
                f"{args.state}")
    if args.state != "f32" and args.only == "torch":
        p.error("--state sets run A's state format; --only torch does not run A")
    if args.baseline != "torch" and args.only == "stepfuse":
        p.error("--baseline chooses run B; --only stepfuse does not run B")
    return args


def variant_suffix(args) -> str:
    """'' for the default comparison, else '_<state>' and/or '_torchao' (file names)."""
    suffix = "" if args.state == "f32" else f"_{args.state}"
    if args.baseline == "torchao-adamw8bit":
        suffix += "_torchao"
    return suffix


def import_torchao_optim():
    """torchao.optim, or a clear message and exit status 2."""
    try:
        import torchao.optim as tao
    except ImportError as e:
        if getattr(e, "name", None) not in (None, "torchao", "torchao.optim"):
            traceback.print_exc()
        sys.stderr.write(
            "train_gpt.py: --baseline torchao-adamw8bit needs the Python package 'torchao'.\n"
            "Install it with\n\n"
            "    pip install torchao\n\n"
            "then run this script again (or use --baseline torch).\n")
        sys.exit(2)
    if not hasattr(tao, "AdamW8bit"):
        version = getattr(sys.modules.get("torchao"), "__version__", "?")
        sys.exit(f"train_gpt.py: this torchao ({version}) has no torchao.optim.AdamW8bit; "
                 "pip install -U torchao")
    return tao


def import_stepfuse_torch():
    """stepfuse.torch, or a clear message and exit status 2."""
    try:
        import stepfuse  # noqa: F401
    except ImportError as e:
        if getattr(e, "name", None) not in (None, "stepfuse"):
            traceback.print_exc()
        sys.stderr.write(
            "train_gpt.py: the Python package 'stepfuse' is not installed.\n"
            "Install it from the repository root with\n\n"
            "    pip install .\n\n"
            "then run this script again (or run only PyTorch's optimizer with --only torch).\n")
        sys.exit(2)
    try:
        import stepfuse.torch as sft
    except Exception:
        traceback.print_exc()
        sys.stderr.write(
            "train_gpt.py: 'stepfuse' is installed but 'stepfuse.torch' failed to import "
            "(traceback above).\n")
        sys.exit(2)
    return sft


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------

@dataclass
class Corpus:
    chars: list[str]
    train: torch.Tensor  # int64 character ids
    held_out: torch.Tensor


def load_corpus(path: Path) -> Corpus:
    text = path.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(ids))
    return Corpus(chars, ids[:n], ids[n:])


def batch_at(ids: torch.Tensor, starts: torch.Tensor, seq_len: int):
    x = torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
    y = torch.stack([ids[s + 1:s + 1 + seq_len] for s in starts.tolist()])
    return x, y


# --------------------------------------------------------------------------------------
# Model: a nanoGPT-style decoder (pre-LayerNorm, GELU MLP, learned positions)
# --------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, heads: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual outputs
            if name.endswith(("proj.weight", "fc_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's split: decay the Linear weights; not biases, LayerNorms or embeddings."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, nn.Linear) and name == "weight":
                decay.append(p)
            else:
                no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


# --------------------------------------------------------------------------------------
# The two optimizer set-ups
# --------------------------------------------------------------------------------------

@dataclass
class Run:
    key: str  # "A" or "B"
    label: str
    model: nn.Module
    opt: object
    scaler: object
    step_fn: object  # (run) -> None: everything after backward()
    train_loss: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    skipped: int = 0
    state_bytes: int = 0  # optimizer state at the end (see state_bytes())


def make_run_a(model, args, sft=None) -> Run:
    groups = param_groups(model, args.weight_decay)
    if sft is None:  # --stand-in
        opt = _StandInAdamW(groups, lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm)
        scaler = torch.amp.GradScaler("cpu")
        label = "A: stand-in (torch AdamW foreach, clip in step)"
    else:
        opt = sft.AdamW(groups, lr=args.lr, betas=(0.9, 0.95),
                        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                        state_format=args.state)
        scaler = sft.GradScaler("cpu")
        state = "" if args.state == "f32" else f" ({args.state} state)"
        label = f"A: stepfuse.torch AdamW{state} + GradScaler (fused clip)"

    def step(run: Run) -> None:
        run.scaler.step(run.opt)
        run.scaler.update()

    return Run("A", label, model, opt, scaler, step)


class _StandInAdamW(torch.optim.AdamW):
    """--stand-in only: torch's AdamW that clips the (unscaled) gradients inside step()."""

    def __init__(self, params, max_grad_norm: float, **kwargs):
        super().__init__(params, foreach=True, **kwargs)
        self.max_grad_norm = max_grad_norm

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        return super().step(closure)


def make_run_b(model, args, tao=None) -> Run:
    groups = param_groups(model, args.weight_decay)
    if tao is None:
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95),
                                weight_decay=args.weight_decay, fused=True)
        label = "B: torch AdamW(fused=True) + GradScaler + clip_grad_norm_"
    else:  # --baseline torchao-adamw8bit; eps is torch's default 1e-8, as for A and fused AdamW
        opt = tao.AdamW8bit(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=args.weight_decay)
        label = "B: torchao AdamW8bit + GradScaler + clip_grad_norm_"
    scaler = torch.amp.GradScaler("cpu")

    def step(run: Run) -> None:
        run.scaler.unscale_(run.opt)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), args.max_grad_norm)
        run.scaler.step(run.opt)
        run.scaler.update()

    return Run("B", label, model, opt, scaler, step)


def lr_at(step: int, args) -> float:
    """Linear warm-up to --lr, then cosine decay to --lr / 10 (step counts from 0)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def state_bytes(opt) -> int:
    """Bytes of optimizer state, counted from the state tensors (the step counters left out):
    plain tensors by their size; a tensor subclass such as torchao's OptimState8bit by the
    tensors it holds (codes, block scales, its 256-entry map). Shared storage counts once."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None and type(t) is not torch.Tensor:
            for name in flatten()[0]:
                add(getattr(t, name))
            return
        nbytes = t.numel() * t.element_size()
        key = (t.data_ptr(), nbytes)
        if nbytes and key not in seen:
            seen.add(key)
            total += nbytes

    for st in opt.state.values():
        for name, value in st.items():
            if name != "step" and isinstance(value, torch.Tensor):
                add(value)
    return total


def scale_of(scaler) -> float:
    s = scaler.get_scale()
    return float(s.item() if isinstance(s, torch.Tensor) else s)


def train_step(run: Run, x, y, lr: float) -> None:
    for g in run.opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):  # torchao's optimizers keep lr as a tensor
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr
    run.opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = run.model(x, y)
    run.scaler.scale(loss).backward()
    before = scale_of(run.scaler)
    t0 = time.perf_counter()
    run.step_fn(run)
    run.step_s.append(time.perf_counter() - t0)
    if scale_of(run.scaler) < before:  # the scaler backs off after a skipped step
        run.skipped += 1
    run.train_loss.append(loss.item())


@torch.no_grad()
def held_out_loss(model: nn.Module, batches) -> float:
    model.eval()
    total = 0.0
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total += model(x, y).item()
    model.train()
    return total / len(batches)


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------

def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def quantile_ms(values: list[float], q: float) -> float:
    s = sorted(values)
    return 1e3 * s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line(argv: list[str]) -> str:
    cmd = "python examples/python/train_gpt.py"
    if argv:
        cmd += " " + shlex.join(argv)
    nice = os.nice(0)
    return f"nice -n {nice} {cmd}" if nice > 0 else cmd


def moving_average(values: list[float], window: int) -> list[float]:
    """Centred moving average; the window shrinks at the ends (no lag, unlike an EMA)."""
    half = max(0, window // 2)
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def write_plot(path: Path, runs: list[Run], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    style = {"A": dict(color="tab:blue", linewidth=3.0, linestyle="-", marker="o"),
             "B": dict(color="tab:orange", linewidth=1.4, linestyle="--", marker="x")}
    window = max(1, len(runs[0].train_loss) // 40) | 1
    fig, (ax, ax_t) = plt.subplots(2, 1, figsize=(9, 7.5), dpi=120, sharex=True,
                                   gridspec_kw={"height_ratios": [3, 1.3]})
    for r in runs:
        st = style[r.key]
        steps = range(1, len(r.train_loss) + 1)
        ax.plot(steps, r.train_loss, color=st["color"], alpha=0.15, linewidth=0.7)
        ax.plot(steps, moving_average(r.train_loss, window), color=st["color"],
                linewidth=st["linewidth"], linestyle=st["linestyle"],
                label=f"{r.label}: train" + (f" (mean of {window} steps)" if window > 1 else ""))
        ax.plot(r.eval_steps, r.eval_loss, color=st["color"], marker=st["marker"],
                markersize=6, linestyle="none", label=f"{r.key}: held-out")
        ax_t.plot(steps, [1e3 * t for t in r.step_s], color=st["color"], marker=".",
                  markersize=2, linestyle="none", alpha=0.5)
        ax_t.axhline(median_ms(r.step_s), color=st["color"], linewidth=1.4,
                     linestyle=st["linestyle"], label=f"{r.key}: median {median_ms(r.step_s):.2f} ms")
    ax.set_ylabel("cross-entropy (nats / character)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_t.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_t.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_t.set_xlabel("step")
    ax_t.set_ylabel("optimizer step (ms)")
    ax_t.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_summary(path: Path, png_name: str | None, runs: list[Run], args, n_params: int,
                  corpus: Corpus, argv: list[str], wall_s: float, versions: str,
                  loads: list[float]) -> None:
    by = {r.key: r for r in runs}
    variant = bool(variant_suffix(args))
    if not variant:
        lines = ["# Training a small GPT: stepfuse.torch vs PyTorch's fused AdamW", ""]
    else:
        a_name = "stepfuse.torch" + ("" if args.state == "f32" else f" ({args.state} state)")
        b_name = ("torchao's AdamW8bit" if args.baseline == "torchao-adamw8bit"
                  else "PyTorch's fused AdamW")
        lines = [f"# Training a small GPT: {a_name} vs {b_name}", ""]
    lines += [
        "`examples/python/train_gpt.py` trains a character-level GPT on Tiny Shakespeare "
        "on the CPU, twice from the same initial weights and on the same batches, "
        "interleaved step by step: bf16 autocast, two parameter groups (weight decay "
        f"{args.weight_decay} on the Linear weights, none on biases, LayerNorms and "
        f"embeddings), AdamW with betas (0.9, 0.95), a loss scaler and a global-norm clip "
        f"at {args.max_grad_norm}.", ""]
    for r in runs:
        lines.append(f"- **{r.label}**")
    lines.append("")
    if variant and "A" in by and args.state != "f32":
        lines += [f"Run A keeps its AdamW state (`exp_avg`, `exp_avg_sq`) as {args.state} "
                  "between steps (`state_format=\"" + args.state + "\"`)" + (
                      ": block-wise 8-bit, one fp32 absmax per 256 elements and "
                      "bitsandbytes' dynamic maps (signed for `exp_avg`, unsigned for "
                      "`exp_avg_sq`); tensors under 4096 elements stay fp32"
                      if args.state == "q8" else "") + ".", ""]
    if "B" in by and args.baseline == "torchao-adamw8bit":
        lines += ["Run B is `torchao.optim.AdamW8bit` with the same groups, lr, betas, eps "
                  "(1e-8) and weight decay: 8-bit block-wise state (block 256, dynamic maps); "
                  "torchao keeps fp32 state for tensors under 4096 elements and for those "
                  "whose size is not a multiple of 256. The weights are fp32, so its "
                  "`bf16_stochastic_round` does not apply. Its step is `torch.compile`d, "
                  "which the first step pays for.", ""]
    if "A" in by and args.stand_in:
        lines += ["> Run A here is the `--stand-in` (torch's own AdamW), not stepfuse: its "
                  "figures say nothing about stepfuse.", ""]
    lines += ["The optimizer-step time is everything after `backward()`: `scaler.step(opt)` + "
              "`scaler.update()` for A; `scaler.unscale_(opt)` + `clip_grad_norm_` + "
              "`scaler.step(opt)` + `scaler.update()` for B.", ""]
    if png_name:
        lines += [f"![training and held-out loss]({png_name})", ""]
    lines += [
        "| | |", "|---|---|",
        f"| model | {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
        f"context {args.seq_len}, vocabulary {len(corpus.chars)}: {n_params:,} parameters |",
        f"| data | {len(corpus.train):,} training / {len(corpus.held_out):,} held-out "
        "characters (90/10 split) |",
        f"| training | {args.steps} steps of {args.batch} × {args.seq_len} characters, lr "
        f"{args.lr:g} ({args.warmup} warm-up steps, cosine to {args.lr / 10:g}), seed "
        f"{args.seed} |",
        f"| held-out loss | every {args.eval_every} steps, the same {args.eval_batches} "
        f"batches for both runs |",
        f"| machine | {cpu_name()}, {os.cpu_count()} logical CPUs; PyTorch threads: "
        f"{torch.get_num_threads()}" + (
            f"; 1-minute load average {min(loads):.1f} to {max(loads):.1f} "
            f"(median {statistics.median(loads):.1f}) during the run" if loads else "") + " |",
        f"| software | {versions} |",
        f"| wall time | {wall_s:.0f} s for the whole script |", ""]
    lines += ["| run | final train loss (mean of last 20 steps) | final held-out loss | "
              "skipped steps | final scale | median optimizer step | p10 / p90 | first step |"
              + (" optimizer state |" if variant else ""),
              "|---|---|---|---|---|---|---|---|" + ("---|" if variant else "")]
    for r in runs:
        tail = r.train_loss[-20:]
        lines.append(
            f"| {r.label} | {sum(tail) / len(tail):.4f} | {r.eval_loss[-1]:.4f} | "
            f"{r.skipped} | {scale_of(r.scaler):g} | {median_ms(r.step_s):.3f} ms | "
            f"{quantile_ms(r.step_s, 0.1):.3f} / {quantile_ms(r.step_s, 0.9):.3f} ms | "
            f"{1e3 * r.step_s[0]:.1f} ms |"
            + (f" {r.state_bytes / n_params:.2f} bytes / parameter ({r.state_bytes:,} "
               "bytes) |" if variant else ""))
    lines.append("")
    if "A" in by and "B" in by:
        a, b = by["A"], by["B"]
        ratio = statistics.median(b.step_s) / statistics.median(a.step_s)
        diff = max(abs(u - v) for u, v in zip(a.train_loss, b.train_loss))
        lines += [
            f"Median optimizer step: A {median_ms(a.step_s):.3f} ms, B "
            f"{median_ms(b.step_s):.3f} ms; B / A = **{ratio:.2f}×**. The largest "
            f"difference between the two runs' training losses at the same step is "
            f"{diff:.4f}; final held-out losses A {a.eval_loss[-1]:.4f}, B "
            f"{b.eval_loss[-1]:.4f}.", ""]
    lines += ["Produced by", "", "```sh", command_line(argv), "```", ""]
    for note in args.note:
        lines += [note, ""]
    text = "\n".join(lines)
    kept = path.read_text(encoding="utf-8") if path.exists() else ""
    if KEEP_MARKER in kept:  # hand-written sections about other runs
        text += "\n" + kept[kept.index(KEEP_MARKER):]
    path.write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)

    sft = None
    if args.only in ("both", "stepfuse") and not args.stand_in:
        sft = import_stepfuse_torch()
    tao = None
    if args.only in ("both", "torch") and args.baseline == "torchao-adamw8bit":
        tao = import_torchao_optim()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    corpus = load_corpus(args.data)
    if len(corpus.held_out) <= args.seq_len + 1:
        sys.exit(f"train_gpt.py: {args.data} is too short for --seq-len {args.seq_len}")

    torch.manual_seed(args.seed)
    base = GPT(len(corpus.chars), args.seq_len, args.d_model, args.heads, args.layers)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, context "
          f"{args.seq_len}, vocabulary {len(corpus.chars)}: {n_params:,} parameters")
    print(f"data: {args.data.name}, {len(corpus.train):,} training / "
          f"{len(corpus.held_out):,} held-out characters")
    print(f"{args.steps} steps, batch {args.batch}, {torch.get_num_threads()} PyTorch threads")

    runs: list[Run] = []
    if args.only in ("both", "stepfuse"):
        runs.append(make_run_a(copy.deepcopy(base), args, sft))
    if args.only in ("both", "torch"):
        runs.append(make_run_b(copy.deepcopy(base), args, tao))
    for r in runs:
        r.model.train()
        print(f"  {r.label}")

    # The batch order and the held-out batches come from their own generator, so both runs
    # see the same data whatever else draws random numbers.
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    n_train = len(corpus.train) - args.seq_len - 1
    eval_starts = torch.randint(len(corpus.held_out) - args.seq_len - 1,
                                (args.eval_batches, args.batch), generator=data_gen)
    eval_batches = [batch_at(corpus.held_out, s, args.seq_len) for s in eval_starts]

    loads: list[float] = []  # the 1-minute load average at each evaluation

    def evaluate(step: int) -> None:
        if hasattr(os, "getloadavg"):
            loads.append(os.getloadavg()[0])
        for r in runs:
            r.eval_steps.append(step)
            r.eval_loss.append(held_out_loss(r.model, eval_batches))

    t_start = time.perf_counter()
    evaluate(0)
    for step in range(args.steps):
        x, y = batch_at(corpus.train,
                        torch.randint(n_train, (args.batch,), generator=data_gen), args.seq_len)
        lr = lr_at(step, args)
        order = runs if step % 2 == 0 else runs[::-1]
        for r in order:
            train_step(r, x, y, lr)
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            evaluate(done)
        if done % args.log_every == 0 or done == args.steps:
            parts = []
            for r in runs:
                held = f" held-out {r.eval_loss[-1]:.4f}" if r.eval_steps[-1] == done else ""
                parts.append(f"{r.key} train {r.train_loss[-1]:.4f}{held} "
                             f"step {median_ms(r.step_s):.3f} ms")
            print(f"step {done:5d}  " + "  |  ".join(parts), flush=True)
    wall_s = time.perf_counter() - t_start
    variant = bool(variant_suffix(args))
    for r in runs:
        r.state_bytes = state_bytes(r.opt)

    for r in runs:
        if not all(math.isfinite(v) for v in r.train_loss):
            print(f"{r.key}: non-finite training loss", file=sys.stderr)
    print()
    for r in runs:
        print(f"{r.label}")
        print(f"  held-out loss {r.eval_loss[0]:.4f} -> {r.eval_loss[-1]:.4f}, last train loss "
              f"{r.train_loss[-1]:.4f}, skipped steps {r.skipped}, final scale "
              f"{scale_of(r.scaler):g}")
        print(f"  optimizer step: median {median_ms(r.step_s):.3f} ms (p10 "
              f"{quantile_ms(r.step_s, 0.1):.3f}, p90 {quantile_ms(r.step_s, 0.9):.3f}, first "
              f"{1e3 * r.step_s[0]:.1f} ms)")
        if variant:
            print(f"  optimizer state: {r.state_bytes / n_params:.2f} bytes / parameter "
                  f"({r.state_bytes:,} bytes, step counters left out)")
    by = {r.key: r for r in runs}
    if "A" in by and "B" in by:
        ratio = statistics.median(by["B"].step_s) / statistics.median(by["A"].step_s)
        print(f"median optimizer step B / A = {ratio:.2f}x")
    print(f"wall time {wall_s:.1f} s" + (
        f", 1-minute load average {min(loads):.1f} to {max(loads):.1f}" if loads else ""))

    if args.write:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        png = args.out_dir / f"train_gpt{variant_suffix(args)}.png"
        md = args.out_dir / f"train_gpt{variant_suffix(args)}.md"
        title = (f"char-level GPT, {args.layers}x{args.d_model}, {n_params / 1e6:.2f}M params, "
                 f"Tiny Shakespeare, bf16 autocast, clip {args.max_grad_norm}")
        write_plot(png, runs, title)
        versions = f"PyTorch {torch.__version__}, Python {platform.python_version()}"
        if sft is not None:
            import stepfuse
            versions += f", stepfuse {getattr(stepfuse, '__version__', '(no __version__)')}"
        if tao is not None:
            import torchao
            versions += f", torchao {getattr(torchao, '__version__', '(no __version__)')}"
        write_summary(md, png.name, runs, args, n_params, corpus, argv, wall_s, versions, loads)
        print(f"wrote {png} and {md}")

    falling = all(r.eval_loss[-1] < r.eval_loss[0] for r in runs)
    if not falling:
        print("the held-out loss did not fall", file=sys.stderr)
    return 0 if falling else 1


if __name__ == "__main__":
    sys.exit(main())
