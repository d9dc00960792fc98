"""The machinery every stepfuse.torch optimizer shares.

A stepfuse.torch optimizer is a ``torch.optim.Optimizer``: ``param_groups`` are
torch's list of dicts, ``state`` is torch's per-param dict, and ``state_dict()``
is torch's format. Underneath, one ``stepfuse.Optimizer`` (the engine) runs the
whole step — unscale, inf/NaN check, global-norm clip, update — over every param
that has a gradient.

The engine is planned lazily, at the first step, over the params whose ``.grad``
is set, and re-planned only when that set changes, a group is added, a program
flag changes (amsgrad, nesterov, centered, momentum on/off) or a state dict is
loaded. Everything else is cheap per step:

* new gradient tensors (``zero_grad(set_to_none=True)``) are re-pointed with
  ``set_grads``, without re-planning;
* hyperparameters written into ``param_groups`` (by a scheduler or by hand) are
  pushed into the engine with ``set_config`` at the next step, without
  recompiling.

On the CPU, ``state[p]["exp_avg"]`` and friends are zero-copy views of the
engine's state. On CUDA they are snapshots, refreshed by ``state_dict()``.

Sharded (``communicator=``, see stepfuse.torch.distributed): each rank's optimizer
holds its own shard of the model's params, and construction and every step are
collective. Before each step the ranks exchange a few flags (one small all_gather),
so that they always agree: a gradient refused on one rank raises on every rank; a
step torch.amp.GradScaler found non-finite on one rank is skipped on every rank; and
when one rank's plan changes (its set of params with gradients, say), every rank
re-plans at that step, since building an engine is collective. The model's tensors,
for the one-process step a sharded step equals, are the engines' params: rank 0's
params with gradients (group after group; within a group, params of equal step
counts together), then rank 1's, and so on. State dicts stay per rank.
"""

from __future__ import annotations

import functools
import math
import operator
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import stepfuse as _sf

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _as_float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


# torch.compile's "do not trace this": torch._disable_dynamo imports Dynamo only when the
# function is first called (torch.compiler.disable imports it here, at import time).
_run_as_is = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


def _take_written_elements(master: torch.Tensor, p: torch.Tensor) -> None:
    """The fp32 master of a 16-bit weight written from outside takes the written elements: those
    where the weight is no longer the master rounded to the weight's format (the step stores
    every element so). Elements left as they were keep their master, the bits below the
    weight's precision included (a mask written every step keeps the masters of the others)."""
    flat = master.reshape(-1)
    w = p.detach().reshape(-1).to(flat.device)
    written = w != flat.to(p.dtype)
    if bool(written.any()):
        flat[written] = w[written].to(torch.float32)


# The result of a step skipped before the engine (the loss scale backed off to 0), as a
# StepResult reads.
_SKIPPED_STEP = types.SimpleNamespace(applied=False, found_inf=True, grad_norm=math.inf, clip_coef=1.0, pending=False)


def _dummy_param() -> torch.Tensor:
    return torch.zeros(1, requires_grad=True)


def _as_seed(seed: Any) -> int:
    """The stochastic rounding's seed: an int in [0, 2**64), as stepfuse.Optimizer takes it."""
    try:
        value = operator.index(seed)
    except TypeError:
        raise TypeError(f"Invalid seed: {seed!r} (must be an int in [0, 2**64))") from None
    if value < 0:
        raise ValueError(f"Invalid seed: {value} is negative (must be an int in [0, 2**64))")
    if value >= 1 << 64:
        raise OverflowError(f"Invalid seed: {value} does not fit in 64 bits (must be an int in [0, 2**64))")
    return value


_FORMAT_NAMES = ("f32", "bf16", "q8")


def _as_format(value: Any, what: str, none: Optional[str] = "f32") -> Optional[str]:
    """A state format's name ('f32', 'bf16', 'q8'), from a name or a stepfuse.StateFormat;
    None gives `none`."""
    if value is None:
        return none
    if isinstance(value, _sf.StateFormat):
        return value.name
    if isinstance(value, str):
        if value in _FORMAT_NAMES:
            return value
        raise ValueError(f"Invalid {what}: {value!r} (use 'f32', 'bf16' or 'q8', or a stepfuse.StateFormat)")
    raise TypeError(f"Invalid {what}: {value!r} (use 'f32', 'bf16' or 'q8', or a stepfuse.StateFormat)")


def _as_formats(value: Any) -> Dict[str, str]:
    """state_formats: None or a dict {stream name: format}, names normalized."""
    if value is None:
        return {}
    items = value.items() if hasattr(value, "items") else value
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise TypeError(f"Invalid state_formats: {value!r} (use a dict {{stream name: format}}, e.g. "
                        "{'exp_avg_sq': 'bf16'})") from None
    out: Dict[str, str] = {}
    for k, v in pairs:
        if not isinstance(k, str):
            raise TypeError(f"Invalid state_formats: the key {k!r} is not a stream name (a str such as 'exp_avg')")
        out[k] = _as_format(v, f"state_formats[{k!r}]")
    return out


def _as_communicator(communicator: Any) -> Optional[Any]:
    if communicator is None or isinstance(communicator, _sf.Communicator):
        return communicator
    from .distributed import as_communicator  # imports torch.distributed only when asked
    return as_communicator(communicator)


def _exchange(communicator: Any, flags: Sequence[int]) -> List[List[int]]:
    """Every rank's flags (the same number on each), by rank: one all_gather."""
    send = np.asarray(flags, dtype=np.int64)
    n = communicator.size()
    recv = np.zeros(n * send.size, dtype=np.int64)
    communicator.all_gather(send, recv)
    return recv.reshape(n, send.size).tolist()


def _failed_ranks(rows: List[List[int]]) -> List[int]:
    return [r for r, row in enumerate(rows) if row[0]]


def _collective_init(init: Callable[..., None]) -> Callable[..., None]:
    """A subclass's __init__, made collective when it is given a communicator: the
    ranks exchange whether their construction succeeded, so that a construction
    refused on one rank (a bad param, a bad hyperparameter) raises on every rank
    instead of leaving the others waiting at their first step."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("communicator") is None or self.__dict__.get("_sf_constructing"):
            init(self, *args, **kwargs)  # not sharded, or inside the outermost __init__
            return
        communicator = kwargs["communicator"] = _as_communicator(kwargs["communicator"])
        self.__dict__["_sf_constructing"] = True
        try:
            try:
                init(self, *args, **kwargs)
            except BaseException:
                _exchange(communicator, [1])
                raise
            failed = _failed_ranks(_exchange(communicator, [0]))
            if failed:
                raise RuntimeError(f"stepfuse.torch: constructing the optimizer failed on rank(s) {failed} (which "
                                   f"raise their own errors); every rank raises, so that none waits for the others")
        finally:
            self.__dict__.pop("_sf_constructing", None)

    __init__._sf_collective = True  # type: ignore[attr-defined]
    return __init__


def _copy_into(view: Any, src: torch.Tensor) -> None:
    """Copies a saved state tensor into an engine view (a NumPy array; None: nothing to fill)."""
    if view is not None:
        view.reshape(-1)[:] = src.detach().to(torch.float32).reshape(-1).cpu().numpy()


def _copy_bytes_into(view: Any, src: torch.Tensor) -> None:
    """Copies a saved tensor's bytes as they are (bfloat16 bit patterns, q8 codes) into an engine
    view of a stream's storage (a flat uint8 NumPy array)."""
    flat = src.detach().reshape(-1).cpu().contiguous()
    view[:] = flat.view(torch.uint8).numpy()


def _copy_bf16_into(view: Any, src: torch.Tensor) -> None:
    """Copies a saved bfloat16 tensor (a compensation) into an engine view of its bits (a uint16
    NumPy array; None: nothing to fill)."""
    if view is not None:
        view.reshape(-1)[:] = src.detach().to(torch.bfloat16).reshape(-1).cpu().view(torch.uint16).numpy()


# State keys that follow the engine's plan (not carried over from an older plan).
_ENGINE_KEYS = frozenset(("step", "master_param", "compensation"))


def _check_state_size(name: str, src: torch.Tensor, p: torch.Tensor) -> bool:
    """True when a state tensor has the param's shape; else a RuntimeError (torch's own step
    fails on such a state too, with the sizes of some operation)."""
    if src.shape == p.shape:
        return True
    raise RuntimeError(f"stepfuse.torch: the optimizer state '{name}' of a param of shape {tuple(p.shape)} has shape "
                       f"{tuple(src.shape)}: the state dict loaded was saved for other params (check that the "
                       "params are given in the order they were when it was saved)")


def _check_state_tensor(name: str, src: Any, p: torch.Tensor) -> None:
    """A state stream of param p as a plan takes it: a tensor of p's shape (else an error)."""
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"stepfuse.torch: state '{name}' of a param is a {type(src).__name__}, not a tensor of the "
                        f"param's shape {tuple(p.shape)}")
    _check_state_size(name, src, p)


class _CppGroup:
    """One engine group: params of one torch group with one step count."""

    __slots__ = ("torch_group", "params", "step")

    def __init__(self, torch_group: int, params: List[torch.Tensor], step: int):
        self.torch_group = torch_group
        self.params = params
        self.step = step


class StepfuseOptimizer(torch.optim.Optimizer):
    """Base class of the stepfuse.torch optimizers (not used directly).

    Subclasses set ``_torch_class`` (the torch.optim class whose arguments,
    defaults and checks they share, or None), and implement ``_config(group)``
    (a stepfuse config for one param group), ``_program_key(group)`` (the group
    flags that pick the update program) and ``_state_keys(group)`` (torch's names
    of the per-param state tensors; they are the engine's names too).
    """

    _torch_class: Optional[type] = None
    # torch.amp.GradScaler hands its scale and found_inf to the step (grad_scale /
    # found_inf attributes) instead of unscaling the gradients itself.
    _step_supports_amp_scaling = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_sf_collective", False):
            cls.__init__ = _collective_init(init)  # type: ignore[method-assign]

    def __init__(
        self,
        params: Any,
        defaults: Dict[str, Any],
        *,
        max_grad_norm: Optional[float] = None,
        norm_type: float = 2.0,
        master_weights: bool = True,
        stochastic_rounding: bool = False,
        seed: int = 0,
        stochastic_state_rounding: bool = True,
        compensated_weights: bool = False,
        state_format: Any = None,
        state_formats: Optional[Dict[str, Any]] = None,
        min_q8_numel: int = 4096,
        num_threads: Optional[int] = None,
        communicator: Any = None,
    ) -> None:
        if max_grad_norm is not None:
            max_grad_norm = float(max_grad_norm)
            if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
                raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (must be finite and > 0, or None)")
        norm_type = float(norm_type)
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"Invalid norm_type: {norm_type} (stepfuse clips with the 2-norm or the inf-norm: use 2.0 or "
                             "float('inf'))")
        seed = _as_seed(seed)
        if stochastic_rounding and master_weights:
            raise ValueError("stepfuse.torch: stochastic_rounding=True needs master_weights=False (with fp32 masters "
                             "each weight is rounded to nearest from its master; stochastic rounding is the "
                             "alternative to masters, for bfloat16 params)")
        if compensated_weights and master_weights:
            raise ValueError("stepfuse.torch: compensated_weights=True needs master_weights=False (a bfloat16 "
                             "compensation replaces the fp32 master: it is the alternative to masters, for bfloat16 "
                             "params)")
        if compensated_weights and stochastic_rounding:
            raise ValueError("stepfuse.torch: compensated_weights=True and stochastic_rounding=True together (the "
                             "compensation keeps what rounding to nearest loses; choose one of the two)")
        state_format = _as_format(state_format, "state_format")
        state_formats = _as_formats(state_formats)
        try:
            min_q8_numel = operator.index(min_q8_numel)
        except TypeError:
            raise TypeError(f"Invalid min_q8_numel: {min_q8_numel!r} (must be an int >= 0)") from None
        if min_q8_numel < 0:
            raise ValueError(f"Invalid min_q8_numel: {min_q8_numel} (must be >= 0: q8 applies to tensors of at least "
                             "that many elements)")
        if num_threads is not None and not (0 <= int(num_threads) <= 1024):
            raise ValueError(f"Invalid num_threads: {num_threads} (use None for torch.get_num_threads(), or 1 to 1024)")
        self.max_grad_norm = max_grad_norm
        self.norm_type = norm_type
        self.master_weights = bool(master_weights)
        # bfloat16 params without masters: rounded stochastically (Philox keyed by seed,
        # counted by the engine's applied step and the element's index in its params).
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = seed
        # Their bfloat16 state: rounded stochastically too (each stream with bits of its
        # own), or to nearest even.
        self.stochastic_state_rounding = bool(stochastic_state_rounding)
        # bfloat16 params without masters: each with a bfloat16 compensation (the engine's,
        # state[p]["compensation"]), the part of the parameter rounding to bfloat16 lost.
        self.compensated_weights = bool(compensated_weights)
        # How the engine stores each state stream between steps ('f32', 'bf16', 'q8'): the
        # blanket format, per-stream overrides, and the size below which q8 keeps f32. A
        # param group may carry its own "state_format".
        self.state_format = state_format
        self.state_formats = state_formats
        self.min_q8_numel = min_q8_numel
        self.num_threads = num_threads
        # A sharded step (stepfuse.torch.distributed): a stepfuse.Communicator, or a
        # torch.distributed ProcessGroup wrapped in a ProcessGroupCommunicator.
        self.communicator = _as_communicator(communicator)
        self._device: Optional[torch.device] = None
        self._reset_engine()
        # The state formats are checked once every group is in (a stream named in
        # state_formats may belong to a later group's program), then at each added group.
        self.__dict__["_sf_defer_format_check"] = True
        try:
            super().__init__(params, defaults)
        finally:
            self.__dict__.pop("_sf_defer_format_check", None)
        self._check_state_formats()
        # (Sharded, a rank's shard may hold float32 params alone: the model's bfloat16 ones
        # are then on other ranks, and this rank's engines are planned without rounding.)
        if (self.stochastic_rounding and self.communicator is None
                and not any(p.dtype == torch.bfloat16 for g in self.param_groups for p in g["params"])):
            raise ValueError("stepfuse.torch: stochastic_rounding=True but no param is bfloat16 (float32 params are "
                             "stored exactly; there is nothing to round: leave stochastic_rounding off)")
        if (self.compensated_weights and self.communicator is None
                and not any(p.dtype == torch.bfloat16 for g in self.param_groups for p in g["params"])):
            raise ValueError("stepfuse.torch: compensated_weights=True but no param is bfloat16 (float32 params are "
                             "stored exactly; there is nothing to compensate: leave compensated_weights off)")
        if self.communicator is not None and self._device is not None and self._device.type != "cpu":
            raise NotImplementedError(f"stepfuse.torch: a sharded step (communicator=) takes CPU params so far; these "
                                      f"params are on {self._device} (an nccl process group is not wrapped yet; from "
                                      f"C++, a CUDA optimizer steps sharded over stepfuse::nccl_communicator)")

    def _reset_engine(self) -> None:
        self._engine: Optional[_sf.Optimizer] = None
        self._engine_key: Any = None
        self._cpp_groups: List[_CppGroup] = []
        self._active: List[torch.Tensor] = []  # the engine's params, in its order
        self._grad_ptrs: List[int] = []
        # This step's contiguous copies of non-contiguous gradients (p.grad is left as it is).
        self._flat_grads: Dict[torch.Tensor, torch.Tensor] = {}
        self._active_in_scan_order = True  # the engine's params are the params with grads, in group order
        self._group_values: List[Any] = []  # per engine group: the hyperparameters pushed
        self._steps: Optional[torch.Tensor] = None  # every active param's step count (state[p]["step"] are views)
        self._views_missing = False  # some active param has no state yet (no step applied to it)
        self._derived_buffers: Dict[str, torch.Tensor] = {}  # derived state key -> every active param's
        # Params whose weight is not the whole truth (16-bit weights with an fp32 master or a
        # compensation): their (data_ptr, _version) when the engine last took them, to see a
        # write from outside (model.load_state_dict, p.zero_(), ...).
        self._weight_marks: Dict[torch.Tensor, Tuple[int, int]] = {}
        self._active_index: Dict[torch.Tensor, int] = {}  # the marked params the engine has: their index
        self._last_grad_norm = math.nan
        self._norm_pending = False  # CUDA: the last step's norm is still on the device

    # torch pickles (and deep-copies) an optimizer as defaults, state and param_groups:
    # keep the options too; the engine is re-planned from the state at the next step.
    _OPTIONS = ("max_grad_norm", "norm_type", "master_weights", "stochastic_rounding", "seed", "compensated_weights",
                "state_format", "state_formats", "min_q8_numel", "num_threads", "_device", "stochastic_state_rounding")

    def __getstate__(self) -> Dict[str, Any]:
        if getattr(self, "communicator", None) is not None:
            # A copy would be an unsharded optimizer over one shard (clipping with that
            # shard's norm alone) or a second user of the same connection: neither is safe.
            raise TypeError("stepfuse.torch: an optimizer with a communicator (a sharded step) cannot be pickled or "
                            "copied: its communicator is a live connection to the other ranks. Save its "
                            "state_dict() (each rank's own shard) instead, and load it into an optimizer built with "
                            "a communicator.")
        self._export_state()
        state = super().__getstate__()
        state.update({k: getattr(self, k) for k in self._OPTIONS})
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._complete_older_state()
        for k, default in zip(self._OPTIONS, (None, 2.0, True, False, 0, False, "f32", None, 4096, None, None, True)):
            if not hasattr(self, k):
                setattr(self, k, default)
        if self.state_formats is None:
            self.state_formats = {}
        if not hasattr(self, "communicator"):
            self.communicator = None  # never pickled (see __getstate__); torch's load_state_dict keeps it
        self._reset_engine()
        # The masters in the state go with the weights as they are now (as after a load).
        self._mark_weights([p for g in self.param_groups for p in g["params"]])

    def _complete_older_state(self) -> None:
        """What torch's own optimizers' __setstate__ do for a state saved by an older torch
        (a checkpoint loaded, or an optimizer unpickled): a group key added since (amsgrad,
        maximize, foreach, decoupled_weight_decay, ...) takes its default, and scalar state
        saved as a Python number (step, ASGD's eta and mu, NAdam's mu_product) becomes a
        0-dim tensor."""
        torch_class = getattr(self, "_torch_class", None)
        if torch_class is not None:
            # torch's class fills the keys it adds, with its own values (its fused=False where
            # its constructor's default is None, say): its __setstate__, run on an empty
            # instance over this one's groups and state, which it completes in place.
            try:
                torch_class.__setstate__(torch_class.__new__(torch_class), {
                    "defaults": self.defaults, "state": self.state, "param_groups": self.param_groups})
            except Exception:  # noqa: BLE001 (a torch whose __setstate__ needs more: the defaults below)
                pass
        defaults = self.__dict__.get("defaults") or {}
        for group in self.param_groups:
            for k, v in defaults.items():
                group.setdefault(k, v)
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for st in self.state.values():
            if not isinstance(st, dict):
                continue
            for k in ("step", "eta", "mu", "mu_product"):
                v = st.get(k)
                if v is not None and not isinstance(v, torch.Tensor):
                    st[k] = torch.tensor(float(v), dtype=dtype)

    # ---- torch.optim.Optimizer's interface ----

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                            "tensors in sets will change between runs. Please use a list instead.")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # Refuse before torch records anything: nothing changes on an error. A named
        # param (name, tensor) is checked as its tensor.
        for p in params:
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], torch.Tensor):
                p = p[1]
            if not isinstance(p, torch.Tensor):
                continue  # torch's own message for what is not a tensor
            if not p.is_floating_point() and not p.is_complex():
                raise TypeError(f"stepfuse.torch: a param of dtype {p.dtype} cannot be optimized (params must be "
                                "floating point: float32, float16 or bfloat16)")
            if p.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"stepfuse.torch: params of dtype {p.dtype} are not supported (use float32, float16 "
                                "or bfloat16; the step computes in fp32, with fp32 masters for 16-bit params)")
            if p.layout != torch.strided:
                raise TypeError(f"stepfuse.torch: {p.layout} params are not supported (dense tensors only)")
            if not p.is_contiguous():
                raise ValueError("stepfuse.torch: a param is not contiguous (the fused step reads params as flat "
                                 "buffers; make it contiguous before creating the optimizer)")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"stepfuse.torch: a param is on {p.device} (the CPU and CUDA devices are supported)")
            if p.dtype == torch.float16 and getattr(self, "stochastic_rounding", False):
                raise ValueError("stepfuse.torch: a param is float16 but stochastic_rounding=True (stochastic rounding "
                                 "is for bfloat16 params: keep fp32 masters for float16 params, or store them as "
                                 "bfloat16)")
            if p.dtype == torch.float16 and getattr(self, "compensated_weights", False):
                raise ValueError("stepfuse.torch: a param is float16 but compensated_weights=True (compensated weights "
                                 "are for bfloat16 params: keep fp32 masters for float16 params, or store them as "
                                 "bfloat16)")
            device = self._device or (self._first_device() if hasattr(self, "param_groups") else None)
            if device is not None and p.device != device:
                raise ValueError(f"stepfuse.torch: a param is on {p.device} but the optimizer's other params are on "
                                 f"{device} (one optimizer steps the params of one device)")
            self._device = self._device or p.device
        # The group is the dict given, as torch keeps it (a caller may hold it and edit it).
        param_group["params"] = params
        if "state_format" in param_group:
            param_group["state_format"] = _as_format(param_group["state_format"], 'param group "state_format"',
                                                     none=None)
        super().add_param_group(param_group)
        # The library's own checks of the group's hyperparameters (and state formats), now
        # rather than at the first step; a refused group is not kept.
        try:
            _sf.UpdateProgram.from_config(self._config(self.param_groups[-1]))
            if not self.__dict__.get("_sf_defer_format_check"):
                self._check_state_formats()
        except Exception:
            self.param_groups.pop()
            raise
        self._engine_key = None  # re-plan at the next step

    def _first_device(self) -> Optional[torch.device]:
        for g in self.param_groups:
            for p in g["params"]:
                return p.device
        return None

    # The step is the library's (C++), not PyTorch operations: torch.compile runs it as it
    # is rather than tracing it (which would trace the re-planning).
    @_run_as_is
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One fused step; returns the closure's loss when a closure is given.

        Under torch.amp.GradScaler, the scaler's ``grad_scale`` and ``found_inf``
        are honoured: the gradients are unscaled inside the step, and a step with
        non-finite gradients writes nothing. Sharded, a found_inf on any rank skips
        the step on every rank.
        """
        try:
            return self._step(closure)
        finally:
            if self._flat_grads:
                self._flat_grads = {}  # (the copies of non-contiguous gradients: not kept past the step)

    def _step(self, closure: Optional[Callable[[], Any]]) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fused_scale = self.__dict__.get("_sf_fused_scale")
        if fused_scale is not None:
            # stepfuse.torch.GradScaler.step: the fused step on gradients scaled by it; the
            # scaler reads the result (None: no param has a gradient).
            self.__dict__["_sf_fused_result"] = self._step_scaled(fused_scale)
            return loss
        found_inf = getattr(self, "found_inf", None)
        found_inf = found_inf is not None and _as_float(found_inf) != 0.0
        if found_inf and self.communicator is None:
            # torch's scaler found inf/NaN: skip, as torch's own optimizers do (the norm of
            # such gradients is not finite, as the engine reports for a step it skips).
            # Sharded, the ranks decide together (_prepare).
            self._last_grad_norm, self._norm_pending = math.inf, False
            return loss
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None:
            self._step_scaled(_as_float(grad_scale), found_inf)
        else:
            engine = self._prepare(found_inf)
            if engine is not None:
                engine.step()
                if self._active[0].device.type == "cuda":
                    self._norm_pending = True  # enqueued: reading the result would wait for the device
                else:
                    self._finish(engine.last_result)
        return loss

    def _step_scaled(self, scale: float, found_inf: bool = False) -> Optional[Any]:
        """A step on gradients scaled by ``scale``; returns the engine's StepResult (None: no grads,
        or sharded, a step skipped for a ``found_inf`` of some rank)."""
        with np.errstate(over="ignore"):
            reciprocal_overflows = 0.0 <= scale < math.inf and (scale == 0.0 or not np.isfinite(np.float32(1.0 / scale)))
        if reciprocal_overflows:
            # A scale that backed off to 2^-128 or below, or to 0 (144 non-finite steps in a row
            # from 65536): its fp32 reciprocal overflows, every gradient would unscale to inf
            # or NaN, so the step is skipped (found_inf), writing nothing. Sharded, every rank
            # agrees. (A NaN, inf or negative scale goes on to the engine's error.)
            if self.communicator is not None:
                self._prepare(True, scale)
            elif not any(p.grad is not None for group in self.param_groups for p in group["params"]):
                return None
            self._last_grad_norm, self._norm_pending = math.inf, False
            return _SKIPPED_STEP
        engine = self._prepare(found_inf, scale)
        if engine is None:
            return None
        result = engine.step_scaled(scale)
        self._finish(result)
        return result

    @property
    def last_grad_norm(self) -> torch.Tensor:
        """The total norm of the unscaled gradients of the last step, over every group
        (what ``torch.nn.utils.clip_grad_norm_`` would have returned): inf when they
        were not finite, NaN when the step computed none (no clipping and no scaler).
        On CUDA reading it waits for the step."""
        if self._norm_pending and self._engine is not None:
            self._last_grad_norm = self._engine.last_grad_norm
            self._norm_pending = False
        return torch.tensor(self._last_grad_norm, dtype=torch.float32)

    def state_dict(self) -> Dict[str, Any]:
        self._export_state()
        self._normalize_group_formats()
        return super().state_dict()

    def _normalize_group_formats(self) -> None:
        """A group's "state_format" set by hand (a stepfuse.StateFormat, say) as its name, as
        add_param_group keeps it: a state dict then holds only plain values."""
        for group in self.param_groups:
            fmt = group.get("state_format")
            if fmt is not None and not isinstance(fmt, str):
                group["state_format"] = _as_format(fmt, 'param group "state_format"', none=None)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        # The state dict as the load pre-hooks left it (a hook may return another one) is
        # recorded by a last pre-hook added for this load; a first post-hook takes its
        # tensors at full precision, before the caller's post-hooks see the state.
        seen: Dict[str, Any] = {}

        def record(optimizer: Any, loaded: Dict[str, Any]) -> None:
            seen["state_dict"] = loaded

        def retake(optimizer: Any) -> None:
            self._take_loaded_precisely(seen.get("state_dict", state_dict))

        handles = [self.register_load_state_dict_pre_hook(record),
                   self.register_load_state_dict_post_hook(retake, prepend=True)]
        try:
            super().load_state_dict(state_dict)
        finally:
            for handle in handles:
                handle.remove()
        # torch's load replaced self.state with the loaded tensors: the next step
        # re-plans and copies them into the engine. The loaded masters go with the weights
        # as they are now (model.load_state_dict before or after this load: the resume
        # order); a weight written after this load is seen as written.
        self._engine = None
        self._engine_key = None
        self._weight_marks = {}
        self._active_index = {}
        self._mark_weights([p for g in self.param_groups for p in g["params"]])

    def _take_loaded_precisely(self, state_dict: Dict[str, Any]) -> None:
        # torch casts every state tensor to a floating param's dtype; the engine keeps fp32
        # state (and fp32 masters for 16-bit params): take the saved tensors at full
        # precision. What is saved in a stored form is taken as it is, so that it loads bit
        # for bit: a bfloat16 compensation, a stream stored as bf16 (a bfloat16 tensor), a
        # stream stored as q8 (uint8 codes; its "<name>_absmax" scales are float32).
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for sid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(sid)
            if not saved:
                continue
            st = self.state[p]
            for k, v in saved.items():
                if k == "step" or not isinstance(v, torch.Tensor):
                    continue
                if k == "compensation" or v.dtype == torch.bfloat16:
                    dtype = torch.bfloat16
                elif v.is_floating_point():
                    dtype = torch.float32
                elif v.dtype == torch.uint8:  # q8 codes
                    dtype = v.dtype
                else:
                    continue  # (other integers: torch's cast to the param's dtype stands)
                loaded = st.get(k)
                if not isinstance(loaded, torch.Tensor) or loaded.dtype != dtype:
                    st[k] = v.detach().to(device=p.device, dtype=dtype, copy=True)

    # ---- for subclasses ----

    def _config(self, group: Dict[str, Any]) -> Any:
        raise NotImplementedError

    def _program_key(self, group: Dict[str, Any]) -> Tuple[Any, ...]:
        return ()

    def _state_keys(self, group: Dict[str, Any]) -> Sequence[str]:
        raise NotImplementedError

    def _has_step(self) -> bool:
        return True

    def _derived_state(self, group: Dict[str, Any], step: int, p: torch.Tensor,
                       engine_group: int) -> Dict[str, torch.Tensor]:
        """Per-param scalar state torch keeps and the engine derives from the step
        count (NAdam's mu_product, ASGD's eta and mu) of param p of `group`, which is in
        the engine's group `engine_group`."""
        return {}

    # Whether _derived_state gives anything: then each applied step refreshes it in state[p].
    _has_derived_state = False

    def _refresh_derived_state(self) -> None:
        """After an applied step (and for state_dict()): the derived state of every active
        param, in place (as torch's own tensors change), one fill per engine group, whose
        params share it."""
        start = 0
        for g, cg in enumerate(self._cpp_groups):
            end = start + len(cg.params)
            if cg.params and cg.torch_group < len(self.param_groups):
                values = self._derived_state(self.param_groups[cg.torch_group], cg.step, cg.params[0], g)
                for k, v in values.items():
                    buf = self._derived_buffers.get(k)
                    if buf is not None:
                        buf[start:end] = v
            start = end

    def _restore_derived_state(self, engine: Any, engine_group: int, cg: "_CppGroup") -> None:
        """Gives a new engine's group the scalar state self.state holds for its params
        (NAdam's mu_product), after its step count."""

    def _plan_split(self, group: Dict[str, Any], p: torch.Tensor) -> Any:
        """Beside the step count, what puts params of one torch group into different engine
        groups (params whose engine configs differ: ASGD's, whose eta comes from the lr of
        each param's own last step)."""
        return None

    def _engine_config(self, cg: "_CppGroup") -> Any:
        """The config of one engine group (by default its torch group's)."""
        return self._config(self.param_groups[cg.torch_group])

    def _engine_values_key(self, cg: "_CppGroup") -> Tuple[Any, ...]:
        """What an engine group's config is made of: when it changes, set_config at the next step."""
        return self._group_values_key(self.param_groups[cg.torch_group])

    # ---- planning ----

    def _scan(self) -> Tuple[Tuple[Any, ...], List[int]]:
        """One pass over every param: checks each gradient (before anything is planned or
        written), and returns the plan key — which params have gradients, where their
        storage is (p.data = ... moves it), the flags that pick each group's update
        program — and the gradients' data pointers in that order."""
        key: List[Any] = []
        ptrs: List[int] = []
        self._flat_grads = {}
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if (g.dtype is not p.dtype or g.shape != p.shape or g.is_cuda is not p.is_cuda or g.is_sparse
                        or not g.is_contiguous() or not p.is_contiguous()
                        or (p.is_cuda and g.get_device() != p.get_device())):
                    g = self._check_grad(p)
                ids.append((id(p), p.data_ptr()))
                ptrs.append(g.data_ptr())
            key.append((tuple(ids), self._program_key(group), group.get("state_format")))
        # CUDA: the step runs on the current stream; another stream is another plan.
        if self._device is not None and self._device.type == "cuda":
            key.append(torch.cuda.current_stream(self._device).cuda_stream)
        return tuple(key), ptrs

    def _prepare(self, found_inf: bool = False, scale: Optional[float] = None) -> Optional[Any]:
        """The engine for this step, pointed at the current gradients with the current
        hyperparameters; None when no param has a gradient. Sharded: None also when
        the ranks skip the step (``found_inf``, torch.amp.GradScaler's, on some rank)."""
        if self.communicator is None:
            key, ptrs = self._scan()
            replan = key != self._engine_key or self._engine is None
        else:
            agreed = self._agree_on_step(found_inf, scale)
            if agreed is None:
                return None
            key, ptrs, replan = agreed
        if replan:
            self._replan(key)
        if self._engine is None:
            return None
        if self._weight_marks:
            self._sync_written_weights()
        if not self._active_in_scan_order:
            ptrs = [self._grad_of(p).data_ptr() for p in self._active]
        if ptrs != self._grad_ptrs:
            # Checked by the scan: only the pointers move (no import of each tensor, no reference kept).
            self._engine.set_grad_pointers(ptrs)
            self._grad_ptrs = ptrs
        self._push_hyperparameters()
        return self._engine

    def _check_state_for_plan(self) -> None:
        """Sharded, before the ranks agree to re-plan: what the plan would refuse in the state
        of this rank's params with gradients (a loaded state without 'step', a stream that is
        not a tensor of the param's shape), so that it raises on every rank rather than on
        this one inside the collective construction."""
        for group in self.param_groups:
            names = tuple(self._state_keys(group))
            for p in group["params"]:
                st = self.state.get(p) if p.grad is not None else None
                if not st:
                    continue
                self._param_step(p)
                for name in names:
                    if st.get(name) is not None:
                        _check_state_tensor(name, st[name], p)
                for name in ("master_param", "compensation"):
                    if isinstance(st.get(name), torch.Tensor):
                        _check_state_size(name, st[name], p)

    def _agree_on_step(self, found_inf: bool, scale: Optional[float]) -> Optional[Tuple[Any, List[int], bool]]:
        """Sharded: the scan, then one exchange of flags with the other ranks (before
        anything collective or written), so that every rank takes the same path:
        a gradient refused on any rank raises on every rank; a found_inf on any rank
        skips the step on every rank (None); ranks stepping with different loss
        scales (``scale``; None: a plain step) raise; when any rank's plan changed,
        every rank re-plans (building an engine is collective). Returns the scan's
        key and pointers and whether to re-plan; None when the step is skipped, or
        when no rank has a gradient."""
        error: Optional[BaseException] = None
        key: Any = None
        ptrs: List[int] = []
        try:
            key, ptrs = self._scan()
            if key != self._engine_key or self._engine is None:
                self._check_state_for_plan()
        except Exception as e:  # raised below, once every rank knows
            error = e
        replan = error is None and (key != self._engine_key or self._engine is None)
        scale_bits = -1 if scale is None else int(np.float64(scale).view(np.int64))
        rows = _exchange(self.communicator, [error is not None, replan, found_inf, bool(ptrs), scale_bits])
        failed = _failed_ranks(rows)
        if failed:
            if error is not None:
                raise error
            raise RuntimeError(f"stepfuse.torch: the step was refused on rank(s) {failed} (which raise their own "
                               "errors); every rank raises, so that none waits for the others")
        without = [r for r, row in enumerate(rows) if not row[3]]
        if len(without) == len(rows):
            return None  # no gradients anywhere: no step, as unsharded
        if without:
            raise RuntimeError(f"stepfuse.torch: rank(s) {without} have no param with a gradient but the others "
                               "have: a sharded step needs gradients on every rank (give the params of those ranks "
                               "gradients, zeros if need be)")
        if any(row[2] for row in rows):
            if not found_inf:
                # torch.amp.GradScaler.update() reads the found_inf it computed from this
                # rank's gradients alone: its scale does not back off here.
                warnings.warn("stepfuse.torch: a sharded step is skipped on every rank for the non-finite gradients of "
                              f"rank(s) {[r for r, row in enumerate(rows) if row[2]]}, but torch.amp.GradScaler on "
                              f"rank {self.communicator.rank()} saw only its own and will not back off its scale, so "
                              "the next scaled step raises (the ranks' scales differ): use stepfuse.torch.GradScaler, "
                              "which backs off on every rank", RuntimeWarning,
                              stacklevel=4)
            self._last_grad_norm, self._norm_pending = math.inf, False
            return None
        if len({row[4] for row in rows}) > 1:
            scales = ["none" if row[4] == -1 else float(np.int64(row[4]).view(np.float64)) for row in rows]
            raise RuntimeError(f"stepfuse.torch: the ranks step with different loss scales (by rank: {scales}); a "
                               "sharded step needs the same on every rank. torch.amp.GradScaler backs off only on a "
                               "rank whose own gradients were not finite: use stepfuse.torch.GradScaler, which backs "
                               "off on every rank")
        return key, ptrs, any(row[1] for row in rows)

    def _check_grad(self, p: torch.Tensor) -> torch.Tensor:
        """A gradient the fast check did not pass: the precise error, or a contiguous copy of
        it for this step (p.grad stays the caller's tensor, as torch leaves it)."""
        g = p.grad
        if g.is_sparse:
            raise RuntimeError("stepfuse.torch does not support sparse gradients")
        if g.dtype != p.dtype:
            raise TypeError(f"stepfuse.torch: a grad of dtype {g.dtype} belongs to a param of dtype {p.dtype} "
                            "(they must match, as autograd makes them)")
        if g.device != p.device:
            raise ValueError(f"stepfuse.torch: a grad on {g.device} belongs to a param on {p.device} "
                             "(they must be on one device)")
        if g.shape != p.shape:
            raise ValueError(f"stepfuse.torch: a grad of shape {tuple(g.shape)} belongs to a param of shape "
                             f"{tuple(p.shape)}")
        if not p.is_contiguous():
            raise ValueError("stepfuse.torch: a param is not contiguous (the fused step reads params as flat "
                             "buffers)")
        if not g.is_contiguous():
            g = self._flat_grads[p] = g.contiguous()  # the fused step reads flat buffers
        return g

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor:
        """The gradient the engine reads for p this step (a contiguous copy made by the scan, or p.grad)."""
        return self._flat_grads.get(p, p.grad) if self._flat_grads else p.grad

    def _replan(self, key: Any) -> None:
        """Builds the engine over the params that have gradients, carrying every
        param's state (and step count) over from ``self.state``."""
        self._export_state()  # the old engine's state into self.state (CUDA: snapshots; written weights taken)
        self._normalize_group_formats()
        old = self._engine
        self._engine = None
        self._engine_key = None
        cpp_groups: List[_CppGroup] = []
        for gi, group in enumerate(self.param_groups):
            by_step: Dict[Tuple[int, Any], List[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                by_step.setdefault((self._param_step(p), self._plan_split(group, p)), []).append(p)
            for (step, _), params in by_step.items():
                cpp_groups.append(_CppGroup(gi, params, step))
        if not cpp_groups:
            self._cpp_groups, self._active, self._grad_ptrs, self._group_values = [], [], [], []
            self._engine_key = key
            return
        groups = [([(p.detach(), self._grad_of(p)) for p in g.params], self._engine_config(g),
                   self.param_groups[g.torch_group].get("state_format")) for g in cpp_groups]
        device = cpp_groups[0].params[0].device
        # Stochastic rounding needs a bfloat16 param among the engine's: a step whose only
        # gradients are float32 params' rounds nothing (float32 weights are stored exactly).
        # Sharded, every rank passes the same options (a rank may hold float32 params only).
        # Compensated weights likewise.
        # The formats of streams the engine's programs have: a stream named for a program
        # not planned now (Adam's max_exp_avg_sq while no group has amsgrad, SGD's
        # momentum_buffer at momentum 0) waits for one (the constructor checked the names).
        planned = {k for cg in cpp_groups for k in self._state_keys(self.param_groups[cg.torch_group])}
        state_formats = {k: v for k, v in self.state_formats.items() if k in planned}
        any_bf16 = self.communicator is not None or any(p.dtype == torch.bfloat16 for g in cpp_groups for p in g.params)
        rounding = self.stochastic_rounding and any_bf16
        compensated = self.compensated_weights and any_bf16
        options: Dict[str, Any] = dict(max_grad_norm=self.max_grad_norm, norm_type=self.norm_type,
                                       master_weights=self.master_weights, stochastic_rounding=rounding,
                                       seed=self.seed, stochastic_state_rounding=self.stochastic_state_rounding,
                                       compensated_weights=compensated,
                                       state_format=self.state_format, state_formats=state_formats,
                                       min_q8_numel=self.min_q8_numel, communicator=self.communicator,
                                       num_threads=self.num_threads if self.num_threads is not None
                                       else (torch.get_num_threads() if device.type == "cpu" else 0))
        if device.type == "cuda":
            options["cuda_stream"] = torch.cuda.current_stream(device).cuda_stream
        engine = _sf.Optimizer.from_groups(groups, **options)
        # The params own their gradients: the engine keeping them too would hold a whole
        # extra set alive through backward after zero_grad(set_to_none=True).
        engine.release_grads()
        del old
        active = [p for g in cpp_groups for p in g.params]
        owners = [self.param_groups[g.torch_group] for g in cpp_groups for _ in g.params]
        # State: what self.state holds (a loaded state dict, or the old engine's), else the engine's initial values.
        for i, p in enumerate(active):
            st = self.state.get(p)
            if st:
                for name in engine.state_names():
                    self._restore_stream(engine, i, p, name, st, owners[i])
                # (A weight written since: its master and compensation in self.state were
                # brought to it by _sync_written_weights, before.)
                master = st.get("master_param")
                if isinstance(master, torch.Tensor) and _check_state_size("master_param", master, p):
                    _copy_into(engine.master(i), master)
                # A param without one (a state dict saved without compensated weights) starts
                # from the engine's: zero, the weight alone, as a missing master starts from it.
                compensation = st.get("compensation")
                if isinstance(compensation, torch.Tensor) and _check_state_size("compensation", compensation, p):
                    _copy_bf16_into(engine.compensation(i), compensation)
        for g, cg in enumerate(cpp_groups):
            if cg.step:
                engine.set_group_step_count(g, cg.step)
            self._restore_derived_state(engine, g, cg)
        self._engine = engine
        self._cpp_groups = cpp_groups
        self._active = active
        scan_order = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        self._active_in_scan_order = len(scan_order) == len(active) and all(a is b for a, b in zip(scan_order, active))
        self._grad_ptrs = [self._grad_of(p).data_ptr() for p in active]
        self._group_values = [None] * len(cpp_groups)
        self._engine_key = key
        self._import_views()
        self._mark_weights(active)
        self._active_index = {p: i for i, p in enumerate(active) if p in self._weight_marks}

    def _mark_weights(self, params: Sequence[torch.Tensor]) -> None:
        """Records, of `params`, the 16-bit weights kept with a master or a compensation as
        they are now; the marks of other params stay. (Sharded, each rank marks its own
        params, whose masters and compensations it holds.)"""
        if not (self.master_weights or self.compensated_weights):
            return
        for p in params:
            if p.dtype in (torch.float16, torch.bfloat16):
                self._weight_marks[p] = (p.data_ptr(), p._version)

    def _sync_written_weights(self) -> None:
        """A 16-bit weight written since it was marked (in place: its version moved, which
        the engine's own writes do not do; or p.data = ...): its master becomes the weight
        and its compensation 0, in the engine or, for a param the engine does not have now,
        in self.state. So the step, a re-plan and state_dict() go on from what was written,
        as torch's would."""
        for p, old in self._weight_marks.items():
            mark = (p.data_ptr(), p._version)
            if mark == old:
                continue
            self._weight_marks[p] = mark
            i = self._active_index.get(p) if self._engine is not None else None
            if i is not None:
                master, compensation = self._engine.master(i), self._engine.compensation(i)
                if master is not None and master.size == p.numel():
                    _take_written_elements(torch.from_numpy(master), p)
                if compensation is not None and compensation.size == p.numel():
                    compensation[...] = 0
            st = self.state.get(p)
            if st and (i is None or p.device.type != "cpu"):  # (on the CPU the views are the engine's)
                master, compensation = st.get("master_param"), st.get("compensation")
                if isinstance(master, torch.Tensor) and master.numel() == p.numel():
                    _take_written_elements(master, p)
                if isinstance(compensation, torch.Tensor) and compensation.numel() == p.numel():
                    compensation.zero_()

    def _param_step(self, p: torch.Tensor) -> int:
        st = self.state.get(p)
        if not st:
            return 0
        step = st.get("step")
        if step is None:
            stepped = any(isinstance(v, torch.Tensor) for v in st.values())
            if stepped and self._has_step():
                # (torch's step fails on such a state too: KeyError 'step')
                raise KeyError(f"stepfuse.torch: the state of a param has {sorted(st)} but no 'step' (a "
                               f"{type(self).__name__} state counts its steps: the state dict loaded lacks them)")
            # SGD keeps no step: a momentum buffer means the first step is behind it.
            return 1 if stepped else 0
        return int(_as_float(step))

    @staticmethod
    def _engine_format(engine: Any, i: int, name: str) -> Optional[str]:
        """How the engine stores param i's stream `name` ('f32', 'bf16', 'q8'), or None when
        the param's program has no such stream (a group without amsgrad, say)."""
        try:
            return engine.state_format(i, name).name
        except ValueError:
            return None

    def _restore_stream(self, engine: Any, i: int, p: torch.Tensor, name: str, st: Dict[str, Any],
                        group: Dict[str, Any]) -> None:
        """Fills the engine's stream `name` of param i from st[name] (a loaded state dict, or
        the old engine's views): bit for bit when it is in the engine's stored form (a float
        tensor for f32, bfloat16 for bf16, uint8 codes with st[name + "_absmax"] for q8);
        otherwise its values, decoded when stored as q8, encoded as a step stores them."""
        src = st.get(name)
        if src is None:
            return
        _check_state_tensor(name, src, p)
        fmt = self._engine_format(engine, i, name)
        if fmt is None:
            return
        if src.dtype == torch.uint8:  # q8 codes
            absmax = st.get(name + "_absmax")
            blocks = (p.numel() + 255) // 256
            if not isinstance(absmax, torch.Tensor) or not absmax.is_floating_point() or absmax.numel() != blocks:
                raise ValueError(f"stepfuse.torch: state '{name}' of a param of {p.numel()} elements is uint8 (q8 "
                                 f"codes) without its '{name}_absmax' ({blocks} float32 scales, one per block of "
                                 "256 elements)")
            if fmt == "q8":
                _copy_bytes_into(engine.state_storage(i, name), src)
                engine.state_absmax(i, name)[:] = absmax.detach().reshape(-1).to(torch.float32).cpu().numpy()
                return
            values = self._decode_q8(group, name, src, absmax)
        elif src.is_floating_point():
            if fmt == "f32":
                _copy_into(engine.state(i, name), src)
                return
            if fmt == "bf16" and src.dtype == torch.bfloat16:
                _copy_bytes_into(engine.state_storage(i, name), src)
                return
            values = src.detach().to(torch.float32).reshape(-1).cpu().numpy()
        elif src.dtype != torch.bool and not src.is_complex():  # integers: their values, as torch casts them
            values = src.detach().to(torch.float32).reshape(-1).cpu().numpy()
        else:
            raise TypeError(f"stepfuse.torch: state '{name}' of a param has dtype {src.dtype} (a state tensor is "
                            "floating point, or uint8 q8 codes with their '_absmax' scales)")
        engine.set_state_values(i, name, values)

    def _decode_q8(self, group: Dict[str, Any], name: str, codes: torch.Tensor, absmax: torch.Tensor) -> Any:
        """The fp32 values of a stream stored as q8 (codes and scales, as a q8 engine keeps
        them), decoded by the library itself: a throwaway engine of the group's program with
        that stream in q8 takes them as stored and gives its values (the stream's code, signed
        or unsigned, is the program's)."""
        n = codes.numel()
        weight, grad = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.float32)
        decoder = _sf.Optimizer(self._config(group), [(weight, grad)], state_formats={name: "q8"}, min_q8_numel=0,
                                fusion="unfused", num_threads=1)
        _copy_bytes_into(decoder.state_storage(0, name), codes)
        decoder.state_absmax(0, name)[:] = absmax.detach().reshape(-1).to(torch.float32).cpu().numpy()
        return decoder.state_values(0, name)

    def _uses_state_formats(self) -> bool:
        return (self.state_format != "f32" or bool(self.state_formats)
                or any(g.get("state_format") is not None for g in self.param_groups))

    def _check_state_formats(self) -> None:
        """The library's checks of the state formats, now rather than at the first step: an
        unknown stream name in state_formats, a format for a stream its program keeps in full
        precision (ASGD's 'ax'), a blanket format no stream can take (ValueError, from a
        throwaway engine of one tiny param per group)."""
        if not self.param_groups or not self._uses_state_formats():
            return
        groups = [([(np.zeros(1, dtype=np.float32), np.zeros(1, dtype=np.float32))], self._config(g),
                   g.get("state_format")) for g in self.param_groups]
        # min_q8_numel=0: the formats tensors of any size get.
        _sf.Optimizer.from_groups(groups, state_format=self.state_format, state_formats=self.state_formats,
                                  min_q8_numel=0, fusion="unfused", num_threads=1)

    def _import_views(self) -> None:
        """Points self.state at the engine's state, in torch's key order: zero-copy
        views on the CPU, snapshots on CUDA."""
        engine = self._engine
        names = set(engine.state_names())
        steps = self._steps = torch.zeros(len(self._active), dtype=torch.float32)
        members = [(g, cg, p) for g, cg in enumerate(self._cpp_groups) for p in cg.params]  # self._active's order
        self._views_missing = False
        derived: Dict[str, torch.Tensor] = {}
        self._derived_buffers = derived
        for i, (g, cg, p) in enumerate(members):
            group = self.param_groups[cg.torch_group]
            if not cg.step and p not in self.state and p.device.type == "cpu":
                # As torch: a param gets its state at the first step applied to it (a step the
                # scaler skipped applies none). _finish() imports it then. (CUDA: a step's
                # outcome is known later; the state is snapshots from the plan on.)
                self._views_missing = True
                continue
            st: Dict[str, Any] = {}
            if self._has_step():
                # Each param's step is its own 0-dim tensor, a view into one buffer of every
                # active param's count: advancing them all is one add, not one per param.
                steps[i] = float(cg.step)
                st["step"] = steps[i]
            # The derived state (NAdam's mu_product, ASGD's eta and mu): each param's a view into
            # one buffer per key, so that an applied step rewrites it with one fill per group.
            for k, v in self._derived_state(group, cg.step, p, g).items():
                buf = derived.get(k)
                if buf is None:
                    buf = derived[k] = torch.zeros(len(members), dtype=v.dtype, device=v.device)
                buf[i] = v
                st[k] = buf[i]
            for name in self._state_keys(group):
                if name not in names:
                    continue
                fmt = self._engine_format(engine, i, name)
                if fmt is None:
                    continue
                if fmt == "f32":
                    t = torch.from_numpy(engine.state(i, name)).view(p.shape)
                    st[name] = t if p.device.type == "cpu" else t.to(p.device)
                    continue
                # Stored as bf16 or q8: the stored bytes as torch tensors, bfloat16 values or
                # uint8 codes with their float32 scales (zero-copy on the CPU, copies on CUDA).
                raw = torch.from_numpy(engine.state_storage(i, name))
                t = (raw.view(torch.bfloat16) if fmt == "bf16" else raw).view(p.shape)
                st[name] = t if p.device.type == "cpu" else t.to(p.device)
                if fmt == "q8":
                    absmax = torch.from_numpy(engine.state_absmax(i, name))
                    st[name + "_absmax"] = absmax if p.device.type == "cpu" else absmax.to(p.device)
            master = engine.master(i)
            if master is not None:
                t = torch.from_numpy(master).view(p.shape)
                st["master_param"] = t if p.device.type == "cpu" else t.to(p.device)
            compensation = engine.compensation(i)
            if compensation is not None:
                # NumPy has no bfloat16: the engine's bits (uint16), viewed as bfloat16.
                t = torch.from_numpy(compensation).view(torch.bfloat16).view(p.shape)
                st["compensation"] = t if p.device.type == "cpu" else t.to(p.device)
            old = self.state.get(p)
            if old and old is not st:
                # What this program does not keep (SGD's momentum_buffer while momentum is 0,
                # Adam's max_exp_avg_sq while amsgrad is off) stays, as torch leaves it, for
                # when the flag comes back: copied, so as not to hold the old engine's memory.
                produced = set(st)
                for k, v in old.items():
                    scales_of_produced = k.endswith("_absmax") and k[:-len("_absmax")] in produced
                    if k in produced or k in _ENGINE_KEYS or scales_of_produced:
                        continue
                    st[k] = v.clone() if isinstance(v, torch.Tensor) else v
            if st:
                self.state[p] = st
            elif p in self.state:
                del self.state[p]

    def _export_state(self) -> None:
        """Brings self.state up to date with the engine: step counts, the scalar state
        torch keeps (NAdam's mu_product, ASGD's eta and mu), and on CUDA fresh copies."""
        if self._weight_marks:
            self._sync_written_weights()
        engine = self._engine
        if engine is None:
            return
        on_cuda = self._active and self._active[0].device.type == "cuda"
        for g, cg in enumerate(self._cpp_groups):
            cg.step = engine.group_step_count(g)
        if on_cuda or self._views_missing:
            self._import_views()
        for cg in self._cpp_groups:
            for p in cg.params:
                st = self.state.get(p)
                if st is None:
                    continue
                if self._has_step():
                    if "step" in st:
                        st["step"].fill_(float(cg.step))
                    else:
                        st["step"] = torch.tensor(float(cg.step), dtype=torch.float32)
        if self._has_derived_state:
            self._refresh_derived_state()

    def _push_hyperparameters(self) -> None:
        engine = self._engine
        for g, cg in enumerate(self._cpp_groups):
            values = self._engine_values_key(cg)
            if values == self._group_values[g]:
                continue
            engine.set_config(self._engine_config(cg), g)
            self._group_values[g] = values

    def _group_values_key(self, group: Dict[str, Any]) -> Tuple[Any, ...]:
        """What a group's config is made of: when it changes, set_config at the next step."""
        # Tensors as their values, inside tuples too (Adam's betas may be tensors): a tensor
        # changed in place is a new value.
        # Lists (betas=[0.9, 0.999], Rprop's etas) and NumPy scalars count as their values too.
        def value(v: Any) -> Any:
            if isinstance(v, (tuple, list)):
                return tuple(value(x) for x in v)
            if isinstance(v, (int, float, torch.Tensor, np.number)) and not isinstance(v, bool):
                return _as_float(v)
            return v

        return tuple(value(v) for k, v in group.items()
                     if k not in ("params", "param_names")
                     and isinstance(v, (int, float, bool, tuple, list, torch.Tensor, np.generic)))

    def _after_applied(self) -> None:
        """Called after every applied step (the CPU: known at once)."""

    def _finish(self, result: Any) -> None:
        if result.pending:  # CUDA: known when read
            self._norm_pending = True
            return
        self._norm_pending = False
        self._last_grad_norm = result.grad_norm
        if result.applied:
            self._after_applied()
        if result.applied:
            if self._has_step() and self._steps is not None:
                self._steps.add_(1.0)
            for cg in self._cpp_groups:
                cg.step += 1
            if self._views_missing:
                self._import_views()
            elif self._has_derived_state:
                self._refresh_derived_state()
