"""The stepfuse.torch optimizers: torch's arguments, defaults, checks and state names."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

import stepfuse as _sf

from ._base import StepfuseOptimizer, _as_float, _dummy_param

__all__ = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "Rprop", "ASGD",
           "Lion", "LAMB"]

_EXTRA = ("max_grad_norm", "norm_type", "master_weights", "stochastic_rounding", "seed", "stochastic_state_rounding",
          "compensated_weights", "state_format", "state_formats", "min_q8_numel", "num_threads", "communicator")


def _torch_defaults(torch_class: type, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """torch's own argument checks (the same ValueErrors, in any torch version) and
    its defaults dict, from a throwaway torch optimizer over a dummy param."""
    if kwargs.get("differentiable"):
        raise ValueError("stepfuse.torch optimizers are not differentiable (differentiable=True): the fused step runs "
                         "outside autograd; use torch.optim for higher-order optimization")
    return dict(torch_class([_dummy_param()], **kwargs).defaults)


def _split(kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    ours = {k: kwargs.pop(k) for k in _EXTRA if k in kwargs}
    return kwargs, ours


class _TorchLike(StepfuseOptimizer):
    """An optimizer with a torch.optim counterpart of the same arguments."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        torch_kwargs, ours = _split(kwargs)
        defaults = _torch_defaults(self._torch_class, torch_kwargs)
        super().__init__(params, defaults, **ours)


def _betas(group: Dict[str, Any]) -> Tuple[float, float]:
    b1, b2 = group["betas"]
    return _as_float(b1), _as_float(b2)


class SGD(_TorchLike):
    """torch.optim.SGD, fused: ``SGD(params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
    maximize=False, max_grad_norm=None, norm_type=2.0, master_weights=True, stochastic_rounding=False, seed=0,
    stochastic_state_rounding=True, compensated_weights=False, state_format=None, state_formats=None, min_q8_numel=4096, num_threads=None,
    communicator=None)``."""

    _torch_class = torch.optim.SGD

    def __init__(self, params: Any, lr: Any = 1e-3, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False, fused: Optional[bool] = None,
                 **extra: Any) -> None:
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                         fused=fused, **extra)

    def _config(self, g: Dict[str, Any]) -> Any:
        return _sf.SGD(lr=_as_float(g["lr"]), momentum=_as_float(g["momentum"]), dampening=_as_float(g["dampening"]),
                       weight_decay=_as_float(g["weight_decay"]), nesterov=bool(g["nesterov"]),
                       maximize=bool(g["maximize"]))

    def _program_key(self, g: Dict[str, Any]) -> Tuple[Any, ...]:
        return (_as_float(g["momentum"]) != 0, bool(g["nesterov"]))

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        return ("momentum_buffer",) if _as_float(g["momentum"]) != 0 else ()

    def _has_step(self) -> bool:
        return False  # torch's SGD keeps no step


class Adam(_TorchLike):
    """torch.optim.Adam, fused (``decoupled_weight_decay=True`` is AdamW)."""

    _torch_class = torch.optim.Adam

    def __init__(self, params: Any, lr: Any = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: bool = False, **extra: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=decoupled_weight_decay, **extra)

    def _config(self, g: Dict[str, Any]) -> Any:
        b1, b2 = _betas(g)
        cls = _sf.AdamW if g.get("decoupled_weight_decay", False) else _sf.Adam
        return cls(lr=_as_float(g["lr"]), beta1=b1, beta2=b2, eps=_as_float(g["eps"]),
                   weight_decay=_as_float(g["weight_decay"]), amsgrad=bool(g["amsgrad"]), maximize=bool(g["maximize"]))

    def _program_key(self, g: Dict[str, Any]) -> Tuple[Any, ...]:
        return (bool(g["amsgrad"]), bool(g.get("decoupled_weight_decay", False)))

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if g["amsgrad"] else ("exp_avg", "exp_avg_sq")


class AdamW(Adam):
    """torch.optim.AdamW, fused: decoupled weight decay (``p *= 1 - lr * weight_decay``)."""

    _torch_class = torch.optim.AdamW

    def __init__(self, params: Any, lr: Any = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, **extra: Any) -> None:
        _TorchLike.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                            maximize=maximize, foreach=foreach, capturable=capturable,
                            differentiable=differentiable, fused=fused, **extra)

    def _config(self, g: Dict[str, Any]) -> Any:
        b1, b2 = _betas(g)
        return _sf.AdamW(lr=_as_float(g["lr"]), beta1=b1, beta2=b2, eps=_as_float(g["eps"]),
                         weight_decay=_as_float(g["weight_decay"]), amsgrad=bool(g["amsgrad"]),
                         maximize=bool(g["maximize"]))


class Adagrad(_TorchLike):
    """torch.optim.Adagrad, fused."""

    _torch_class = torch.optim.Adagrad

    def __init__(self, params: Any, lr: Any = 1e-2, lr_decay: float = 0, weight_decay: float = 0,
                 initial_accumulator_value: float = 0, eps: float = 1e-10, foreach: Optional[bool] = None, *,
                 maximize: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
                 **extra: Any) -> None:
        super().__init__(params, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                         initial_accumulator_value=initial_accumulator_value, eps=eps, foreach=foreach,
                         maximize=maximize, differentiable=differentiable, fused=fused, **extra)
        # As torch's Adagrad: every param's state exists from construction. torch fills "sum"
        # with the constructor's initial_accumulator_value, in every group (a group's own
        # value is not read), and a param added later with it too (self.defaults').
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                 "sum": torch.full_like(p, _as_float(initial_accumulator_value),
                                                        memory_format=torch.preserve_format)}

    def share_memory(self) -> None:
        """torch.optim.Adagrad.share_memory() (Hogwild training across processes): not possible here."""
        raise NotImplementedError("stepfuse.torch.Adagrad: share_memory() is not supported: the state lives in the "
                                  "engine's buffers, which cannot move to shared memory (Hogwild-style training "
                                  "across processes needs torch.optim.Adagrad)")

    def _config(self, g: Dict[str, Any]) -> Any:
        return _sf.Adagrad(lr=_as_float(g["lr"]), lr_decay=_as_float(g["lr_decay"]),
                           weight_decay=_as_float(g["weight_decay"]),
                           initial_accumulator_value=_as_float(self.defaults["initial_accumulator_value"]),
                           eps=_as_float(g["eps"]), maximize=bool(g["maximize"]))

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        return ("sum",)


class RMSprop(_TorchLike):
    """torch.optim.RMSprop, fused."""

    _torch_class = torch.optim.RMSprop

    def __init__(self, params: Any, lr: Any = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0,
                 momentum: float = 0, centered: bool = False, capturable: bool = False,
                 foreach: Optional[bool] = None, maximize: bool = False, differentiable: bool = False,
                 **extra: Any) -> None:
        super().__init__(params, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                         centered=centered, capturable=capturable, foreach=foreach, maximize=maximize,
                         differentiable=differentiable, **extra)

    def _config(self, g: Dict[str, Any]) -> Any:
        return _sf.RMSprop(lr=_as_float(g["lr"]), alpha=_as_float(g["alpha"]), eps=_as_float(g["eps"]),
                           weight_decay=_as_float(g["weight_decay"]), momentum=_as_float(g["momentum"]),
                           centered=bool(g["centered"]), maximize=bool(g["maximize"]))

    def _program_key(self, g: Dict[str, Any]) -> Tuple[Any, ...]:
        return (_as_float(g["momentum"]) > 0, bool(g["centered"]))

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        keys = ["square_avg"]
        if _as_float(g["momentum"]) > 0:
            keys.append("momentum_buffer")
        if g["centered"]:
            keys.append("grad_avg")
        return keys


_MU_PRODUCTS: Dict[Tuple[float, float], list] = {}


def _nadam_mu_product_value(beta1: float, momentum_decay: float, step: int) -> float:
    # torch: mu_product (fp32) *= beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay)), for t = 1..step.
    # The prefix products are kept per (beta1, momentum_decay): each export extends them.
    prefix = _MU_PRODUCTS.setdefault((beta1, momentum_decay), [np.float32(1.0)])
    while len(prefix) <= step:
        t = len(prefix)
        prefix.append(np.float32(prefix[-1] * np.float32(beta1 * (1.0 - 0.5 * (0.96 ** (t * momentum_decay))))))
    return float(prefix[max(step, 0)])


def _nadam_mu_product(beta1: float, momentum_decay: float, step: int) -> torch.Tensor:
    return torch.tensor(_nadam_mu_product_value(beta1, momentum_decay, step), dtype=torch.float32)


class NAdam(_TorchLike):
    """torch.optim.NAdam, fused."""

    _torch_class = torch.optim.NAdam
    _has_derived_state = True

    def __init__(self, params: Any, lr: Any = 2e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, momentum_decay: float = 4e-3, decoupled_weight_decay: bool = False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, **extra: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         momentum_decay=momentum_decay, decoupled_weight_decay=decoupled_weight_decay,
                         foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                         **extra)

    def _config(self, g: Dict[str, Any]) -> Any:
        b1, b2 = _betas(g)
        return _sf.NAdam(lr=_as_float(g["lr"]), beta1=b1, beta2=b2, eps=_as_float(g["eps"]),
                         weight_decay=_as_float(g["weight_decay"]), momentum_decay=_as_float(g["momentum_decay"]),
                         decoupled_weight_decay=bool(g["decoupled_weight_decay"]), maximize=bool(g["maximize"]))

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        return ("exp_avg", "exp_avg_sq")

    def _derived_state(self, g: Dict[str, Any], step: int, p: torch.Tensor,
                       engine_group: int) -> Dict[str, torch.Tensor]:
        engine = self._engine
        if engine is None or not step:
            return {"mu_product": _nadam_mu_product(_betas(g)[0], _as_float(g["momentum_decay"]), step)}
        if engine.nadam_mu_product_offset(engine_group) != 0.0:
            # beta1 or momentum_decay changed between steps (OneCycleLR's cycle_momentum, say),
            # or a loaded mu_product said so: the engine's product of each step's mu_t.
            return {"mu_product": torch.tensor(engine.nadam_mu_product(engine_group), dtype=torch.float32)}
        # Else every step so far ran with the engine's values (not the group's, which may have
        # changed since the last step): torch's own fp32 product for them, bit for bit.
        c = engine.config(engine_group)
        return {"mu_product": _nadam_mu_product(c.beta1, c.momentum_decay, step)}

    def _plan_split(self, g: Dict[str, Any], p: torch.Tensor) -> Any:
        # Params of one step count whose products differ (beta1 changed between steps in which
        # they did not all have gradients, or states loaded from different runs) need engine
        # groups of their own: an engine group carries one product.
        st = self.state.get(p)
        saved = st.get("mu_product") if st else None
        return _as_float(saved) if isinstance(saved, (torch.Tensor, float)) else None

    def _restore_derived_state(self, engine: Any, engine_group: int, cg: Any) -> None:
        # An engine group's params share their step count and their mu_product (_plan_split):
        # its first param's is the group's.
        st = self.state.get(cg.params[0]) if cg.step else None
        saved = st.get("mu_product") if st else None
        if not isinstance(saved, (torch.Tensor, float)):
            return
        g = self.param_groups[cg.torch_group]
        value = _as_float(saved)
        # The product of the current values' mu_t is the engine's own; another one (a state
        # saved after beta1 or momentum_decay changed) is where later steps continue from.
        if value != _nadam_mu_product_value(_betas(g)[0], _as_float(g["momentum_decay"]), cg.step):
            engine.set_nadam_mu_product(engine_group, value)


class RAdam(_TorchLike):
    """torch.optim.RAdam, fused."""

    _torch_class = torch.optim.RAdam

    def __init__(self, params: Any, lr: Any = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, decoupled_weight_decay: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 **extra: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=decoupled_weight_decay, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, **extra)

    def _config(self, g: Dict[str, Any]) -> Any:
        b1, b2 = _betas(g)
        return _sf.RAdam(lr=_as_float(g["lr"]), beta1=b1, beta2=b2, eps=_as_float(g["eps"]),
                         weight_decay=_as_float(g["weight_decay"]),
                         decoupled_weight_decay=bool(g["decoupled_weight_decay"]), maximize=bool(g["maximize"]))

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        return ("exp_avg", "exp_avg_sq")


class Adamax(_TorchLike):
    """torch.optim.Adamax, fused."""

    _torch_class = torch.optim.Adamax

    def __init__(self, params: Any, lr: Any = 2e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, foreach: Optional[bool] = None, *, maximize: bool = False,
                 differentiable: bool = False, capturable: bool = False, **extra: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach,
                         maximize=maximize, differentiable=differentiable, capturable=capturable, **extra)

    def _config(self, g: Dict[str, Any]) -> Any:
        b1, b2 = _betas(g)
        return _sf.Adamax(lr=_as_float(g["lr"]), beta1=b1, beta2=b2, eps=_as_float(g["eps"]),
                          weight_decay=_as_float(g["weight_decay"]), maximize=bool(g["maximize"]))

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        return ("exp_avg", "exp_inf")


class Adadelta(_TorchLike):
    """torch.optim.Adadelta, fused."""

    _torch_class = torch.optim.Adadelta

    def __init__(self, params: Any, lr: Any = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0,
                 foreach: Optional[bool] = None, *, capturable: bool = False, maximize: bool = False,
                 differentiable: bool = False, **extra: Any) -> None:
        super().__init__(params, lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, foreach=foreach,
                         capturable=capturable, maximize=maximize, differentiable=differentiable, **extra)

    def _config(self, g: Dict[str, Any]) -> Any:
        return _sf.Adadelta(lr=_as_float(g["lr"]), rho=_as_float(g["rho"]), eps=_as_float(g["eps"]),
                            weight_decay=_as_float(g["weight_decay"]), maximize=bool(g["maximize"]))

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        return ("square_avg", "acc_delta")


class Rprop(_TorchLike):
    """torch.optim.Rprop, fused."""

    _torch_class = torch.optim.Rprop

    def __init__(self, params: Any, lr: Any = 1e-2, etas: Tuple[float, float] = (0.5, 1.2),
                 step_sizes: Tuple[float, float] = (1e-6, 50), *, capturable: bool = False,
                 foreach: Optional[bool] = None, maximize: bool = False, differentiable: bool = False,
                 **extra: Any) -> None:
        super().__init__(params, lr=lr, etas=etas, step_sizes=step_sizes, capturable=capturable, foreach=foreach,
                         maximize=maximize, differentiable=differentiable, **extra)

    def _config(self, g: Dict[str, Any]) -> Any:
        eta_minus, eta_plus = (_as_float(v) for v in g["etas"])
        smin, smax = (_as_float(v) for v in g["step_sizes"])
        return _sf.Rprop(lr=_as_float(g["lr"]), eta_minus=eta_minus, eta_plus=eta_plus, step_size_min=smin,
                         step_size_max=smax, maximize=bool(g["maximize"]))

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        return ("prev", "step_size")


def _asgd_eta(lr: float, lambd: float, alpha: float, step: int) -> float:
    """torch's ASGD eta after `step` steps, the last one with this lr (rounded to fp32, as torch keeps it)."""
    return float(np.float32(lr / ((1 + lambd * lr * step) ** alpha) if step else lr))


def _asgd_lr_of_eta(eta: float, lambd: float, alpha: float, step: int, guess: float) -> float:
    """The lr whose step `step` gave torch's ASGD this eta (eta = lr / (1 + lambd * lr * step) ** alpha):
    the lr the next step's eta comes from, which the engine takes. `guess` first (the group's lr)."""
    if _asgd_eta(guess, lambd, alpha, step) == eta:
        return guess
    if not step or lambd == 0 or alpha == 0 or not (eta > 0 and math.isfinite(eta)):
        return eta
    c = lambd * step

    def f(lr: float) -> float:
        return lr / ((1 + c * lr) ** alpha)

    # f(lr) <= lr: the lr is at least eta; f increases up to its peak (none for alpha <= 1).
    lo = hi = eta
    peak = math.inf if alpha <= 1 else 1 / (c * (alpha - 1))
    while f(hi) < eta and hi < peak and math.isfinite(hi):
        lo, hi = hi, min(hi * 2, peak)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if f(mid) < eta:
            lo = mid
        else:
            hi = mid
    return min((lo, hi), key=lambda x: abs(f(x) - eta))


class ASGD(_TorchLike):
    """torch.optim.ASGD, fused."""

    _torch_class = torch.optim.ASGD
    _has_derived_state = True

    def __init__(self, params: Any, lr: Any = 1e-2, lambd: float = 1e-4, alpha: float = 0.75, t0: float = 1e6,
                 weight_decay: float = 0, foreach: Optional[bool] = None, maximize: bool = False,
                 differentiable: bool = False, capturable: bool = False, **extra: Any) -> None:
        # torch's ASGD steps each param with the eta its previous step computed from the lr
        # of that step (kept per param, state[p]["eta"]): a new lr takes effect one step
        # later, and a param that skipped steps keeps the eta of its own last step. Per
        # param: that lr (the engine's lr for it), known from its last step, or from its
        # "eta" once a state dict is loaded.
        self._eta_lrs: Dict[torch.Tensor, float] = {}
        super().__init__(params, lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay, foreach=foreach,
                         maximize=maximize, differentiable=differentiable, capturable=capturable, **extra)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._eta_lrs = {}  # recovered from each param's "eta"

    def _eta_lr(self, g: Dict[str, Any], p: torch.Tensor) -> float:
        """The lr param p's next eta comes from: its last step's, else (no step yet) the group's."""
        lrs = self.__dict__.setdefault("_eta_lrs", {})
        lr = lrs.get(p)
        if lr is not None:
            return lr
        cur = _as_float(g["lr"])
        st = self.state.get(p)
        step = self._param_step(p)
        eta = st.get("eta") if st else None
        if not step or not isinstance(eta, torch.Tensor):
            return cur
        lr = _asgd_lr_of_eta(_as_float(eta), _as_float(g["lambd"]), _as_float(g["alpha"]), step, cur)
        lrs[p] = lr
        return lr

    def _plan_split(self, g: Dict[str, Any], p: torch.Tensor) -> Any:
        return self._eta_lr(g, p)

    def _engine_config(self, cg: Any) -> Any:
        g = self.param_groups[cg.torch_group]
        return self._config(g, lr=self._eta_lr(g, cg.params[0]))

    def _config(self, g: Dict[str, Any], lr: Optional[float] = None) -> Any:
        return _sf.ASGD(lr=_as_float(g["lr"]) if lr is None else lr, lambd=_as_float(g["lambd"]), alpha=_as_float(g["alpha"]),
                        t0=_as_float(g["t0"]), weight_decay=_as_float(g["weight_decay"]),
                        maximize=bool(g["maximize"]))

    def _engine_values_key(self, cg: Any) -> Tuple[Any, ...]:
        g = self.param_groups[cg.torch_group]
        return self._group_values_key(g) + (self._eta_lr(g, cg.params[0]),)

    def _after_applied(self) -> None:
        lrs = self.__dict__.setdefault("_eta_lrs", {})
        for cg in self._cpp_groups:
            lr = _as_float(self.param_groups[cg.torch_group]["lr"])
            for p in cg.params:
                lrs[p] = lr

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._eta_lrs = {}  # from the loaded "eta"s

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        return ("ax",)

    def _derived_state(self, g: Dict[str, Any], step: int, p: torch.Tensor,
                       engine_group: int) -> Dict[str, torch.Tensor]:
        # torch keeps the next step's eta and mu (fp32), from the step count and the lr of
        # the param's last step.
        lambd, alpha, t0 = (_as_float(g[k]) for k in ("lambd", "alpha", "t0"))
        eta = _asgd_eta(self._eta_lr(g, p), lambd, alpha, step)
        mu = 1 / max(1, step - t0) if step else 1.0
        return {"eta": torch.tensor(eta, dtype=torch.float32), "mu": torch.tensor(mu, dtype=torch.float32)}


def _check_range(name: str, value: float, low: float, high: Optional[float] = None) -> None:
    ok = low <= value and (high is None or value < high)
    if not ok:
        raise ValueError(f"Invalid {name}: {value}")


class Lion(StepfuseOptimizer):
    """Lion (Chen et al. 2023), fused: ``c = b1*m + (1-b1)*g; p -= lr * sign(c)`` after
    ``p *= 1 - lr * weight_decay``; ``m = b2*m + (1-b2)*g``. State ``exp_avg``."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: Tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, **extra: Any) -> None:
        _check_range("learning rate", _as_float(lr), 0.0)
        _check_range("beta parameter at index 0", float(betas[0]), 0.0, 1.0)
        _check_range("beta parameter at index 1", float(betas[1]), 0.0, 1.0)
        _check_range("weight_decay value", float(weight_decay), 0.0)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, **extra)

    def _config(self, g: Dict[str, Any]) -> Any:
        b1, b2 = _betas(g)
        return _sf.Lion(lr=_as_float(g["lr"]), beta1=b1, beta2=b2, weight_decay=_as_float(g["weight_decay"]),
                        maximize=bool(g["maximize"]))

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        return ("exp_avg",)

    def _has_step(self) -> bool:
        return False


class LAMB(StepfuseOptimizer):
    """LAMB (You et al. 2020) as NVIDIA Apex's FusedLAMB, fused: Adam's moments with
    bias correction and decoupled weight decay, scaled per tensor by the trust ratio
    ``||p|| / ||update||`` when weight_decay != 0. Apex's global clipping is
    ``max_grad_norm`` here."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, *, maximize: bool = False, **extra: Any) -> None:
        _check_range("learning rate", _as_float(lr), 0.0)
        _check_range("epsilon value", float(eps), 0.0)
        _check_range("beta parameter at index 0", float(betas[0]), 0.0, 1.0)
        _check_range("beta parameter at index 1", float(betas[1]), 0.0, 1.0)
        _check_range("weight_decay value", float(weight_decay), 0.0)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, **extra)

    def _config(self, g: Dict[str, Any]) -> Any:
        b1, b2 = _betas(g)
        return _sf.LAMB(lr=_as_float(g["lr"]), beta1=b1, beta2=b2, eps=_as_float(g["eps"]),
                        weight_decay=_as_float(g["weight_decay"]), maximize=bool(g["maximize"]))

    def _state_keys(self, g: Dict[str, Any]) -> Sequence[str]:
        return ("exp_avg", "exp_avg_sq")
