"""The device-side ops in Triton (backend ``"triton"``): the launchers, gathered in one module.

As a module this satisfies :class:`zenflow_triton.kernels.device_ops.DeviceOps`, like ``reference`` (backend
``"torch"``) and ``numba_device_ops`` (backend ``"numba"``). Each op lives in its own file: ``colnorm.py``
(``column_sumsq_``), ``fused_step.py`` (``fused_step_``, and ``fused_steps_`` for many parameters at once) and
``merge.py`` (``merge_``). Importing this module imports Triton.
"""

from __future__ import annotations

from .colnorm import column_sumsq_
from .fused_step import fused_step_, fused_steps_
from .merge import merge_

__all__ = ["column_sumsq_", "fused_step_", "fused_steps_", "merge_"]
