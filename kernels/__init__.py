"""Kernels of zenflow_triton, installed as ``zenflow_triton.kernels``.

- ``hyperparams``: ``AdamHyperparams``, the validated record of lr, betas, eps, weight decay that every op takes.
- ``device_ops``: ``DeviceOps``, the interface of the device-side ops, ``FusedStepArgs`` (one call of the batched fused
  step, ``fused_steps_``), and ``load_device_ops`` (backends).
- ``reference``: plain-torch twins of every op (the oracle; backend ``"torch"``).
- ``numba_device_ops``: numba, the device-side ops for CPU tensors (backend ``"numba"``).
- ``triton_device_ops``: the Triton launchers below, gathered (backend ``"triton"``).
- ``fused_step``: Triton, one pass over a gradient (scores, AdamW on selected columns, accumulate the rest); for one
  parameter, or for many in one launch.
- ``colnorm``: Triton, per-column squared norms alone (selection steps).
- ``merge``: Triton, write the host snapshot into unselected columns.
- ``cpu_adamw``: numba, masked AdamW over host buffers with a model-dtype snapshot in the same pass.
- ``host_accumulate``: numba, the host window sum of ``accumulate="host"`` (one step's gradient added in fp32).
- private: ``_checks`` (tensor checks shared by every op), ``_triton_utils`` and ``_numba_utils`` (pieces shared
  by the Triton kernels, and by the two numba modules).

Triton and numba modules are imported on use (``load_device_ops`` imports them lazily), so
``import zenflow_triton.kernels`` needs neither.
"""

from . import reference
from ._checks import MODEL_DTYPES
from .device_ops import DeviceOps, FusedStepArgs, load_device_ops
from .hyperparams import AdamHyperparams

__all__ = ["MODEL_DTYPES", "AdamHyperparams", "DeviceOps", "FusedStepArgs", "load_device_ops", "reference"]
