"""peers.py's command line: the arguments, their checks and the defaults derived from them."""

import argparse
import os

from .config import ALL_PEERS, LOWP_PEERS, LOWP_REF, REPO


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="peers.py",
        description="Time stepfuse's fused step (unscale + inf/NaN check + clip + AdamW), through its C++ "
        "binding and through stepfuse.torch (the torch.optim drop-in), beside PyTorch eager fused/foreach AdamW "
        "with torch.amp.GradScaler, torch.compile of the whole step, and JAX/optax under jax.jit, on the same "
        "tensor list, interleaved in one process. Each peer's one-step result is checked against stepfuse's "
        "before anything is timed. --dtype bf16 times the low-precision peers instead (bf16 weights and "
        "gradients: stepfuse.torch's masters, stochastic rounding and compensated weights, with fp32, bf16 or q8 "
        "state; torchao, bitsandbytes). "
        "Needs the stepfuse Python package (pip install .) and torch; jax and optax for jax-optax; torchao and "
        "bitsandbytes for their peers.",
        epilog="The ratio column is peer time / stepfuse time (median over median): 2.0x means the peer takes "
        "twice as long as stepfuse. GB/s uses stepfuse's byte model (bench/step_bytes.cpp), the bytes any "
        "implementation must move, so the figures compare across peers. With --dtype bf16 the ratio is over "
        "stepfuse.torch-masters, and each row has its own bytes per parameter (B/param: what it stores, read "
        "and written once per step), so its GB/s is the bandwidth it reaches for its own storage. "
        "OpenMP: torch's worker threads sleep "
        "as soon as they are idle (OMP_WAIT_POLICY=PASSIVE unless --omp-wait-policy or the environment says "
        "otherwise), so that none spins while another peer steps. Exit codes: 0 ok (even if a non-stepfuse "
        "peer failed: the table says why), 1 bad arguments, 2 stepfuse itself failed, 3 other errors.",
    )
    p.add_argument("--preset", default=None,
                   help="tensor list, as stepfuse-bench knows it: gpt2-124m (default), llama7b-layer, resnet50, "
                   "many-small, flat:N (default with --overhead: many-small)")
    p.add_argument("--shapes", metavar="FILE",
                   help="your own tensor list instead of a preset: stepfuse-bench's --shapes format ('[NAME] COUNT' "
                   "per line)")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"],
                   help="weight and gradient dtype. f32 (default): the peers above, each checked against stepfuse. "
                   "bf16: the low-precision peers instead, each keeping its bf16 params its own way (so none "
                   "is the exact answer; each is checked against a step computed in fp64, to a stated tolerance): "
                   "stepfuse.torch.AdamW with fp32 masters (master_weights=True; the ratios' reference), with "
                   "stochastic rounding (master_weights=False, stochastic_rounding=True, seed=--seed) and with "
                   "compensated weights (compensated_weights=True), and with compressed state (state_format='q8' "
                   "with stochastic rounding and with masters, state_format='bf16' with stochastic rounding: "
                   "stepfuse.torch-sr-q8, -masters-q8, -sr-bf16s, -sr-bf16n); torchao's AdamW and AdamW8bit with "
                   "bf16_stochastic_round=True and bitsandbytes' AdamW8bit on the CPU, behind torch.amp.GradScaler "
                   "+ clip_grad_norm_ (pip install torchao bitsandbytes; a peer whose package is missing is "
                   "skipped, saying so). torch.optim's AdamW is not among them: on bf16 params it keeps bf16 state "
                   "and rounds each weight to nearest, with neither masters nor stochastic rounding")
    p.add_argument("--threads", type=int, default=2,
                   help="threads for every peer: torch.set_num_threads, XLA_FLAGS (--xla_cpu_multi_thread_eigen, "
                   "intra_op_parallelism_threads), stepfuse's num_threads (default 2)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per peer (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up rounds after verification (default 3)")
    p.add_argument("--loss-scale", type=float, default=1024.0,
                   help="loss scale S: the gradients are stored multiplied by S (default 1024)")
    p.add_argument("--peers", default=None,
                   help="comma-separated subset of: " + ", ".join(ALL_PEERS) + " (stepfuse is always included); "
                   "with --dtype bf16 of: " + ", ".join(LOWP_PEERS) + f" ({LOWP_REF} is always included)")
    p.add_argument("--overhead", action="store_true",
                   help="measure the per-step fixed overhead instead: plain AdamW step of stepfuse and torch fused "
                   "AdamW on the preset's tensors vs one flat tensor of the same total size")
    p.add_argument("--gap-ms", type=float, default=10.0,
                   help="idle time before each timed step, so threads still at work after the previous peer (XLA's "
                   "pool, stepfuse's pool; OpenMP's unless PASSIVE) have gone to sleep: at least this long, and "
                   "longer while the process used more than 10%% of a CPU over the last GAP_MS (default 10)")
    p.add_argument("--omp-wait-policy", choices=["PASSIVE", "ACTIVE", "unset"],
                   default=os.environ.get("OMP_WAIT_POLICY", "PASSIVE").upper() or "PASSIVE",
                   help="OMP_WAIT_POLICY for torch's OpenMP threads, set before torch is imported; unset: the OpenMP "
                   "runtime's default (libgomp: spin a while, then sleep) (default $OMP_WAIT_POLICY, else PASSIVE: idle "
                   "workers sleep at once instead of spinning for milliseconds after each parallel region, which would "
                   "take a core from the peer timed next)")
    p.add_argument("--compile-max-tensors", type=int, default=2000,
                   help="skip torch.compile (with --dtype bf16: the torchao peers, which call a compiled update per "
                   "tensor) above this many tensors (its compile time grows with the tensor count; default 2000)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for the weights and gradients, and stepfuse's stochastic rounding (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write every figure and sample to FILE as JSON")
    p.add_argument("--build-dir", default=os.environ.get("STEPFUSE_BUILD_DIR", os.path.join(REPO, "build", "release")),
                   help="where stepfuse-bench was built (default $STEPFUSE_BUILD_DIR or build/release); JAX's "
                   "compilation cache goes to BUILD_DIR/peers-jax-cache")
    p.add_argument("--bench", help="path of stepfuse-bench (default BUILD_DIR/bench/stepfuse-bench)")
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
    if a.overhead and a.dtype != "f32":
        p.error("--overhead times fp32 weights only (--dtype f32)")
    known, ref = (LOWP_PEERS, LOWP_REF) if a.dtype == "bf16" else (ALL_PEERS, "stepfuse")
    a.peer_list = [s.strip() for s in (a.peers or ",".join(known)).split(",") if s.strip()]
    for s in a.peer_list:
        if s not in known:
            p.error(f"--peers: unknown peer '{s}' with --dtype {a.dtype} (expected some of {', '.join(known)})")
    if ref not in a.peer_list:
        a.peer_list.insert(0, ref)
    a.bench = a.bench or os.path.join(a.build_dir, "bench", "stepfuse-bench")
    return a
