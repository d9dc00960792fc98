"""stepfuse.torch: fused drop-ins for torch.optim and torch.amp.GradScaler.

Change one import line::

    from stepfuse.torch import AdamW, GradScaler

    opt = AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)
    scaler = GradScaler("cpu")            # or "cuda"
    ...
    scaler.scale(loss).backward()
    scaler.step(opt)                      # unscale + inf/NaN check + clip + AdamW, fused
    scaler.update()
    opt.zero_grad(set_to_none=True)

Every optimizer is a ``torch.optim.Optimizer`` with torch's arguments, defaults,
``param_groups``, schedulers and ``state_dict`` format, plus ``max_grad_norm`` /
``norm_type`` (``clip_grad_norm_`` over all groups, fused into the step) and
``master_weights`` (fp32 masters for float16/bfloat16 params), ``stochastic_rounding`` /
``seed`` (bfloat16 params without masters rounded stochastically, reproducibly from the
seed; their bfloat16 state too unless ``stochastic_state_rounding=False``), ``compensated_weights`` (bfloat16 params without masters, each with a bfloat16
compensation: 2 bytes per param instead of a master's 4) and ``state_format`` /
``state_formats`` / ``min_q8_numel`` (optimizer state stored as bf16 or block-wise 8-bit q8
between steps, also per param group as ``"state_format"``; CPU and CUDA).
``opt.last_grad_norm`` is the total gradient norm of the last step.
"""

from ._base import StepfuseOptimizer
from ._optimizers import (LAMB, SGD, ASGD, Adadelta, Adagrad, Adam, Adamax, AdamW, Lion, NAdam, RAdam, RMSprop,
                          Rprop)
from ._scaler import GradScaler

__all__ = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "Rprop", "ASGD",
           "Lion", "LAMB", "GradScaler", "StepfuseOptimizer"]
