#!/usr/bin/env python3
"""peers.py: times stepfuse's fused optimizer step beside the steps users would pick
instead (PyTorch eager fused and foreach AdamW, torch.compile, JAX/optax), in one process.
stepfuse is timed through its Python package: the C++ API's binding (stepfuse.Optimizer +
stepfuse.GradScaler, the reference) and stepfuse.torch (the torch.optim drop-in, with the
same .grad tensors every step and with new ones).

Every peer does the same math on the same tensor list: unscale the gradients by 1/S,
check them for inf/NaN (skipping the step if any), clip their global L2 norm to 1.0,
AdamW(lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 1e-2), with GradScaler semantics
(the scale backs off after a skipped step, grows after 2000 good ones).

Order of work, on purpose:
  1. allocate the weights and gradients once, as torch fp32 tensors (the torch peers and
     stepfuse share them, zero-copy; JAX gets its own copies);
  2. verify: each peer takes one step from the same weights, gradients and zero state,
     and its weight update and AdamW state are compared with stepfuse's (a peer that
     disagrees beyond fp32 rounding is reported and not timed);
  3. time: warm-up, then rounds in which every peer takes one step, each round in another
     order (a Williams design: every peer directly follows every other equally often), so
     that drift in the machine and what a peer leaves behind affect all alike. Before each
     step the process waits until it is idle (--gap-ms at least).
     Restoring the gradients that PyTorch's eager path unscales and clips in place is
     done between steps, outside the timed region. torch's OpenMP threads do not spin
     while another peer steps: OMP_WAIT_POLICY=PASSIVE is set before torch is imported
     (--omp-wait-policy).

--dtype bf16 times the low-precision peers instead: bf16 weights and gradients, the same step,
each peer keeping its bf16 params its own way: stepfuse.torch with fp32 masters (the ratios'
reference), with stochastic rounding and with compensated weights, and with compressed state
(state_format: stochastic rounding with q8 state, -sr-q8, the fewest bytes, and with bf16 state,
-sr-bf16s, and rounded to nearest, -sr-bf16n; fp32 masters with q8 state, -masters-q8); torchao's
AdamW (bf16_stochastic_round) and AdamW8bit, and bitsandbytes' AdamW8bit on the CPU, behind torch.amp.GradScaler + clip_grad_norm_
(the 8-bit ones also set beside stepfuse.torch-sr-q8, torchao's AdamW beside stepfuse.torch-sr-bf16s and -sr-bf16n).
None of them is the exact answer, so each is verified
against a step computed in fp64 from the same inputs, to a tolerance stated per figure
(config.py): the clip coefficient and skip decision, the state (fp32, bf16 or 8-bit), every
weight within one bf16 ulp (half of one where it rounds to nearest), the update and the weight
decay fitted over all weights (no bias), and the master or compensated parameter. Each row's
GB/s is for its own bytes per parameter (what it stores).

--overhead times the per-step fixed cost instead: a plain AdamW step (no loss scale, no
clipping) of stepfuse and of torch fused AdamW, on a many-tensor list (many-small by
default) and on one flat tensor with the same element count.

Run it through bench/peers/run.sh, which builds stepfuse-bench (for the tensor lists) and
sets up a virtual environment with torch, jax, optax, torchao, bitsandbytes and the stepfuse
package (pip install .).

The code is the package stepfuse_peers beside this file; this file is the command line and
the exit codes:
  config.py        the step's hyperparameters, the verification's tolerances, the byte model
  cli.py           the arguments
  tensors.py       the tensor lists (from stepfuse-bench --print-shapes) and the shared tensors
  peer.py          the interface every peer implements
  stepfuse_peer.py (stepfuse, stepfuse.torch, stepfuse.torch-fresh), torch_peers.py,
  jax_peer.py: the peers
  verify.py        each peer's one-step result against stepfuse's
  lowp_peers.py, lowp_verify.py, lowp_report.py: --dtype bf16's peers, verification against the
                   fp64 reference step, and report
  timing.py        the interleaved timing
  compare.py       the peers mode; overhead.py: the --overhead mode
  report.py        the tables and the JSON
"""

import os
import platform
import sys
import time
import traceback

from stepfuse_peers.cli import parse_args
from stepfuse_peers.compare import run_peers
from stepfuse_peers.console import progress
from stepfuse_peers.lowp_report import report_lowp
from stepfuse_peers.overhead import run_overhead
from stepfuse_peers.report import report_peers
from stepfuse_peers.tensors import load_shapes


def main(argv):
    """Runs the peers mode or --overhead; returns the exit code (--help's epilog lists them)."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    # libgomp reads its policy when torch loads it: set it before torch is imported.
    if args.omp_wait_policy == "unset":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    # XLA reads its flags when JAX creates the CPU client: set them before jax is imported.
    if not args.overhead and "jax-optax" in args.peer_list:
        flags = os.environ.get("XLA_FLAGS", "")
        flags += (f" --xla_cpu_multi_thread_eigen={'true' if args.threads > 1 else 'false'}"
                  f" intra_op_parallelism_threads={args.threads}")
        os.environ["XLA_FLAGS"] = flags.strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        import stepfuse as sf
    except ImportError as e:
        print(f"peers: the stepfuse Python package is not importable ({e}): pip install . at the repository root "
              "(bench/peers/run.sh does)", file=sys.stderr)
        return 1
    try:
        shapes, shapes_source = load_shapes(args)
    except RuntimeError as e:
        print(f"peers: {e}", file=sys.stderr)
        return 1

    import torch
    torch.set_num_threads(args.threads)
    versions = {"stepfuse": sf.__version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        if args.overhead:
            return run_overhead(args, sf, torch, shapes, shapes_source, versions, t_start)
        if "jax-optax" in args.peer_list:
            try:
                import jax
                import jaxlib
                import optax
                versions.update(jax=jax.__version__, jaxlib=jaxlib.__version__, optax=optax.__version__)
            except ImportError as e:
                versions["jax"] = f"not importable ({e})"
        ctx, peers, status, samples = run_peers(args, sf, torch, shapes)
        ctx.versions = {**versions, **ctx.versions}
        (report_lowp if args.dtype == "bf16" else report_peers)(args, sf, shapes, shapes_source, ctx, peers, status,
                                                                samples, t_start)
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
