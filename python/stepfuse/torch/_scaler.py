"""stepfuse.torch.GradScaler: torch.amp.GradScaler whose step() is the fused step."""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ._base import StepfuseOptimizer, _exchange

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` (same constructor, ``scale``, ``update``,
    ``state_dict``) whose ``step(opt)`` with a stepfuse.torch optimizer is one fused
    step: the gradients are read once to unscale, check for inf/NaN and take the
    norm, and once more to update — no separate inf-check pass, no unscale pass.
    The step records found_inf where torch's ``update()`` reads it, so ``update()``
    is torch's own and the scale evolves exactly as torch's.

    ``scaler.unscale_(opt)`` (say, before ``clip_grad_norm_``) still works: the step
    is then torch's path, on the already unscaled gradients. Any other optimizer
    gets torch's behaviour unchanged.

    With a sharded optimizer (``communicator=``) the scale stays one on every rank,
    as torch's ``ShardedGradScaler`` does for FSDP: the fused step decides found_inf
    for the whole model, and ``unscale_`` combines its found_inf over the ranks
    (one small all_gather; call it on every rank).
    """

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        communicator = getattr(optimizer, "communicator", None)
        if not self._enabled or not isinstance(optimizer, StepfuseOptimizer) or communicator is None:
            return
        # torch recorded this rank's found_inf: make it the model's, so that every rank
        # skips the step and update() backs off everywhere.
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        mine = any(float(t.item()) != 0.0 for t in found.values())
        if any(row[0] for row in _exchange(communicator, [mine])):
            for t in found.values():
                t.fill_(1.0)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self._enabled or not isinstance(optimizer, StepfuseOptimizer):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.UNSCALED:
            # unscale_ ran (its found_inf is recorded): torch's path, which hands
            # found_inf to the optimizer's step.
            return super().step(optimizer, *args, **kwargs)
        scale = self._scale
        # Through optimizer.step(), as torch's scaler calls it: its hooks, an LR scheduler's
        # count of optimizer steps and any wrapper of it see the step. The step reads the
        # scale from the optimizer and leaves its result there.
        missing = object()
        optimizer.__dict__["_sf_fused_scale"] = float(scale.item())
        optimizer.__dict__["_sf_fused_result"] = missing
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            optimizer.__dict__.pop("_sf_fused_scale", None)
            result = optimizer.__dict__.pop("_sf_fused_result", missing)
        if result is missing or result is None:
            # No gradient was checked (no param has one, or a wrapper of step() did not
            # step): as torch's scaler, which records no inf check for such an optimizer.
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if result.pending:
            # CUDA: the step decided on the device; reading found_inf waits for it.
            result = optimizer._engine.last_result
            optimizer._finish(result)
        state["found_inf_per_device"] = {scale.device: torch.full((), float(result.found_inf), dtype=torch.float32,
                                                                  device=scale.device)}
        state["stage"] = OptState.STEPPED
        return retval
