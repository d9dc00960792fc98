"""stepfuse: the whole mixed-precision optimizer step, fused.

Unscale the gradients, check them for inf/NaN, clip their global norm and apply the
optimizer update in one reduce pass and one update pass, on tensors taken zero-copy
over DLPack (torch tensors, NumPy arrays, anything with ``__dlpack__``), on the CPU and
on CUDA GPUs::

    import stepfuse
    opt = stepfuse.Optimizer(stepfuse.AdamW(lr=1e-3), [(w, w.grad) for w in weights],
                             max_grad_norm=1.0)
    scaler = stepfuse.GradScaler("cpu")
    ...
    scaler.step(opt)
    scaler.update()

Everything here comes from the C++ extension ``stepfuse._stepfuse``. This module does
not import torch (``stepfuse.torch`` is the PyTorch integration).
"""

from . import _stepfuse
from ._stepfuse import *  # noqa: F401,F403
from ._stepfuse import __version__

__all__ = [name for name in dir(_stepfuse) if not name.startswith("_")]
