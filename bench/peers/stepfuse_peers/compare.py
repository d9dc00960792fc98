"""The peers mode: the shared tensors, the peers named by --peers, their verification and timing
(--dtype bf16: the low-precision peers, verified against an fp64 reference step)."""

from .console import commas, progress
from .jax_peer import JaxPeer
from .lowp_peers import make_lowp_peer
from .lowp_verify import verify_lowp_peers
from .stepfuse_peer import StepfusePeer, StepfuseTorchFreshPeer, StepfuseTorchPeer
from .tensors import Context
from .timing import time_peers
from .torch_peers import TorchCompilePeer, TorchEagerPeer
from .verify import verify_peers


def make_peers(ctx, names):
    """The peers named (ALL_PEERS' names; LOWP_PEERS' with --dtype bf16), in that order."""
    if ctx.args.dtype == "bf16":
        return [make_lowp_peer(ctx, name) for name in names]
    makers = {"stepfuse": lambda: StepfusePeer(ctx), "stepfuse.torch": lambda: StepfuseTorchPeer(ctx),
              "stepfuse.torch-fresh": lambda: StepfuseTorchFreshPeer(ctx),
              "torch-fused": lambda: TorchEagerPeer(ctx, "fused"),
              "torch-foreach": lambda: TorchEagerPeer(ctx, "foreach"), "torch-compile": lambda: TorchCompilePeer(ctx),
              "jax-optax": lambda: JaxPeer(ctx)}
    return [makers[name]() for name in names]


def run_peers(args, sf, torch, shapes):
    """(ctx, peers, status, samples): every peer verified against stepfuse (--dtype bf16: against the
    fp64 reference step), then the verified ones timed; status[name] holds each peer's outcome,
    figures and description for the report."""
    ctx = Context(args, sf, torch)
    n = sum(c for _, c in shapes)
    progress(f"allocating {commas(n)} parameters")
    ctx.allocate(shapes)

    peers = make_peers(ctx, args.peer_list)
    status = {p.name: {"status": "ok"} for p in peers}
    active = (verify_lowp_peers if args.dtype == "bf16" else verify_peers)(ctx, peers, status)
    samples = time_peers(args, ctx, active, status)

    for p in peers:
        status[p.name]["what"] = p.what
        status[p.name].update(p.extra())
    return ctx, peers, status, samples
