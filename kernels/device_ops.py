"""The device-side ops of a ZenFlow step, as one interface with three implementations (DESIGN §6).

:class:`DeviceOps` is the interface the optimizer calls; :func:`load_device_ops` picks the implementation for a
backend and a device. Each implementation is a module whose functions satisfy the protocol structurally:

- ``"torch"``: ``reference`` (kernels/reference.py): plain torch on any device, the oracle of the other two;
- ``"numba"``: ``numba_device_ops`` (kernels/numba_device_ops.py): CPU tensors, and ``"auto"``'s choice there;
- ``"triton"``: ``triton_device_ops``, re-exporting the launchers of kernels/colnorm.py, kernels/fused_step.py and
  kernels/merge.py: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.

The host half of a step (AdamW on the unselected columns) is not a device op: ``cpu_adamw.host_adamw_``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from . import reference
from .hyperparams import AdamHyperparams
from .step_args import FusedStepArgs

__all__ = ["DeviceOps", "FusedStepArgs", "load_device_ops"]


@runtime_checkable
class DeviceOps(Protocol):
    """The device-side ops (``fused_steps_`` is ``fused_step_`` for many parameters at once). Implementations
    (modules, matched structurally; same arguments, same errors):

    - backend ``"torch"``: ``zenflow_triton.kernels.reference`` (kernels/reference.py);
    - backend ``"numba"``: ``zenflow_triton.kernels.numba_device_ops`` (kernels/numba_device_ops.py), CPU tensors;
    - backend ``"triton"``: ``zenflow_triton.kernels.triton_device_ops``, which re-exports the launchers of
      kernels/colnorm.py, kernels/fused_step.py and kernels/merge.py.
    """

    def column_sumsq_(self, score: torch.Tensor, grad: torch.Tensor) -> None:
        """``score[j] += sum_i grad[i, j]**2`` in fp32, in place (selection steps, before the fused step).

        Implementations: ``reference.column_sumsq_`` (torch), ``numba_device_ops.column_sumsq_`` (numba),
        ``colnorm.column_sumsq_`` (triton). The numba and Triton ones are deterministic for a given shape.
        """
        ...

    def fused_step_(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        *,
        score: torch.Tensor,
        slot: torch.Tensor,
        col_step: torch.Tensor,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        acc: torch.Tensor | None,
        hp: AdamHyperparams,
        accumulate: bool,
        update_score: bool = True,
        check_slots: bool = False,
        count_step: bool = False,
    ) -> None:
        """One pass over ``grad [R, C]``: scores, AdamW (``hp``) on the selected columns' compact state written into
        ``param``, ``acc`` overwritten (``accumulate=False``) or added to on the rest (``acc=None``: neither read nor
        written, accumulate="host"); ``count_step=True`` first adds 1 to ``col_step`` on the selected columns. Full
        contract: ``reference.fused_step_``.

        Implementations: ``reference.fused_step_`` (torch), ``numba_device_ops.fused_step_`` (numba),
        ``fused_step.fused_step_`` (triton).
        """
        ...

    def fused_steps_(self, calls: Sequence[FusedStepArgs]) -> None:
        """``fused_step_`` for every call, with the same results bit for bit as calling it once per call in order.
        The calls must not share a tensor that one of them writes (``param``, ``score``, compact state, ``acc``).

        Implementations: ``reference.fused_steps_`` and ``numba_device_ops.fused_steps_`` (a loop),
        ``fused_step.fused_steps_`` (triton: one launch per parameter dtype for all calls, plus one for the scores of
        tall matrices; the per-call Python cost is a fraction of ``fused_step_``'s).
        """
        ...

    def merge_(self, param: torch.Tensor, snapshot: torch.Tensor, slot: torch.Tensor) -> None:
        """``param[:, j] = snapshot[:, j]`` for every unselected column j (``slot[j] < 0``), in place; ``snapshot``
        in ``param``'s dtype, or the fp32 master (``host_snapshot=False``), rounded to nearest even.

        Implementations: ``reference.merge_`` (torch), ``numba_device_ops.merge_`` (numba), ``merge.merge_``
        (triton); the numba and Triton ones copy bits exactly, and round by the host kernel's integer rule.
        """
        ...


def load_device_ops(backend: str, device: torch.device) -> DeviceOps:
    """The device-side ops for ``backend`` (``"auto"``, ``"torch"``, ``"numba"`` or ``"triton"``) on ``device``.

    ``"auto"`` picks numba for CPU tensors, Triton for CUDA tensors when Triton imports, else torch. The numba and
    Triton modules are imported here, on first use, so that ``import zenflow_triton.kernels`` needs neither.
    Raises ``ValueError`` for numba on a non-CPU device, and for Triton on a non-CUDA device unless
    ``TRITON_INTERPRET=1`` is set.
    """
    name = backend
    if name == "auto":
        if device.type == "cpu":
            name = "numba"
        else:
            name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "torch":
        return reference
    if name == "numba":
        if device.type != "cpu":
            raise ValueError(f"backend='numba' runs the device-side ops on CPU tensors; the parameters are on {device}")
        from . import numba_device_ops

        return numba_device_ops
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to run "
            f"the kernels on {device} tensors; use backend='torch' for {device} tensors"
        )
    from . import triton_device_ops

    return triton_device_ops


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
