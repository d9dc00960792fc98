"""stepfuse.torch.distributed: the sharded step over a torch.distributed process group.

Each process (rank) builds its stepfuse.torch optimizer over its own shard of the
model's params, with the same arguments on every rank, and passes the process group::

    import torch.distributed as dist
    from stepfuse.torch import AdamW

    dist.init_process_group("gloo")
    opt = AdamW(my_shard_of_the_params, lr=3e-4, max_grad_norm=1.0,
                communicator=dist.group.WORLD)   # or a ProcessGroupCommunicator

Every rank then clips with the global gradient norm (``opt.last_grad_norm``), and
skips together when any rank's gradients are not finite; each shard's update is
bitwise the one a single process stepping every param would make (the model's
tensors ordered as rank 0's params, then rank 1's, and so on).

From Python the sharded step takes CPU params: the group needs a backend that takes CPU
tensors (gloo, or a ``"cpu:gloo,cuda:nccl"`` group). CUDA params over an nccl group are
not supported yet (the C++ library's CUDA sharded step runs over its NCCL communicator).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

import stepfuse as _sf

__all__ = ["ProcessGroupCommunicator", "as_communicator"]

_OPS = {_sf.ReduceOp.sum: dist.ReduceOp.SUM, _sf.ReduceOp.max: dist.ReduceOp.MAX,
        _sf.ReduceOp.min: dist.ReduceOp.MIN} if dist.is_available() else {}


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A torch tensor over a collective's NumPy buffer, zero-copy (uint16 buffers hold bfloat16)."""
    if not array.flags.writeable:
        # A send buffer, read-only: torch warns that it cannot mark the tensor so. The
        # collectives only read it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(array)
    else:
        t = torch.from_numpy(array)
    return t.view(torch.bfloat16) if t.dtype == torch.uint16 else t


def _unsupported(e: Exception) -> bool:
    msg = str(e).lower()
    return any(s in msg for s in ("not supported", "no support", "does not support", "unsupported",
                                  "not implemented", "unimplemented"))


class ProcessGroupCommunicator(_sf.Communicator):
    """A ``stepfuse.Communicator`` over a torch.distributed process group (None: the
    default group, every process), for the ``communicator=`` argument of the
    stepfuse.torch optimizers and of ``stepfuse.Optimizer``.

    The collectives run on CPU tensors over the engine's buffers (zero-copy): the
    group's backend must take CPU tensors (gloo; NCCL alone does not). They are
    ``dist.all_gather_into_tensor``, ``dist.all_reduce`` and
    ``dist.reduce_scatter_tensor``; where a backend lacks the first or the last (gloo
    before torch 2.x had neither), ``dist.all_gather`` into a list and an
    ``all_reduce`` of a copy of the send buffer, of which each rank keeps its block.
    """

    def __init__(self, group: Optional[Any] = None) -> None:
        super().__init__()
        if not dist.is_available():
            raise RuntimeError("ProcessGroupCommunicator: this torch was built without torch.distributed")
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupCommunicator: torch.distributed is not initialized (call "
                               "torch.distributed.init_process_group first)")
        self.group = group
        self._rank = dist.get_rank(group)
        if self._rank < 0:
            raise ValueError("ProcessGroupCommunicator: this process is not a member of the group")
        self._size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        backends = [b.split(":")[-1] for b in self.backend.split(",")]
        cpu_capable = [b for b in self.backend.split(",") if not b.startswith("cuda:")]
        if not cpu_capable or backends == ["nccl"]:
            raise NotImplementedError(
                f"ProcessGroupCommunicator: the group's backend is {self.backend}, which cannot run collectives on CPU "
                "tensors, and from Python the sharded step takes CPU params (CUDA params over nccl are not supported "
                "yet): use a "
                "gloo group, e.g. torch.distributed.new_group(backend='gloo')")
        self._gather_fallback = False
        self._scatter_fallback = False

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def name(self) -> str:
        return f"torch.distributed({self.backend})"

    def all_gather(self, send: np.ndarray, recv: np.ndarray) -> None:
        s, r = _tensor(send), _tensor(recv)
        if not self._gather_fallback:
            try:
                dist.all_gather_into_tensor(r, s, group=self.group)
                return
            except (RuntimeError, NotImplementedError) as e:
                if not _unsupported(e):
                    raise
                self._gather_fallback = True  # every rank's backend refuses it alike
        dist.all_gather(list(r.chunk(self._size)), s, group=self.group)

    def all_reduce(self, data: np.ndarray, op: Any) -> None:
        dist.all_reduce(_tensor(data), op=_OPS[op], group=self.group)

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, op: Any) -> None:
        s, r = _tensor(send), _tensor(recv)
        if not self._scatter_fallback:
            try:
                dist.reduce_scatter_tensor(r, s, op=_OPS[op], group=self.group)
                return
            except (RuntimeError, NotImplementedError) as e:
                if not _unsupported(e):
                    raise
                self._scatter_fallback = True
        full = s.clone()  # send is the engine's, read-only: reduce a copy
        dist.all_reduce(full, op=_OPS[op], group=self.group)
        n = r.numel()
        r.copy_(full[self._rank * n:(self._rank + 1) * n])

    def __repr__(self) -> str:
        return f"ProcessGroupCommunicator({self.name()}, rank={self._rank}, size={self._size})"

    def __reduce__(self) -> Any:
        raise TypeError("a ProcessGroupCommunicator cannot be pickled or copied (it is a live connection to the other "
                        "ranks)")


def as_communicator(communicator: Any) -> Optional[_sf.Communicator]:
    """``communicator=`` as the engine takes it: None, a ``stepfuse.Communicator``
    (kept as it is), or a torch.distributed ``ProcessGroup`` (wrapped in a
    ProcessGroupCommunicator)."""
    if communicator is None or isinstance(communicator, _sf.Communicator):
        return communicator
    if dist.is_available() and isinstance(communicator, dist.ProcessGroup):
        return ProcessGroupCommunicator(communicator)
    raise TypeError(f"communicator must be a stepfuse.Communicator or a torch.distributed.ProcessGroup, not "
                    f"{type(communicator).__name__}")
