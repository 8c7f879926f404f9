"""One call of the grouped fused step (:meth:`~zenflow_triton.kernels.DeviceOps.fused_steps_`): its own module, so
that the interface (device_ops.py) and its implementations import it without importing each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .hyperparams import AdamHyperparams

__all__ = ["FusedStepArgs"]


@dataclass(frozen=True, eq=False, slots=True)
class FusedStepArgs:
    """One parameter's fused step, as :meth:`DeviceOps.fused_steps_` takes a batch of them: the arguments of
    :meth:`DeviceOps.fused_step_`, same names and meaning (``check_slots`` is not offered: it syncs the device)."""

    param: torch.Tensor
    grad: torch.Tensor
    score: torch.Tensor
    slot: torch.Tensor
    col_step: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    acc: torch.Tensor | None  # None: no accumulation target (accumulate must be False)
    hp: AdamHyperparams
    accumulate: bool
    update_score: bool = True
    count_step: bool = False

    def apply(self, fused_step: Callable[..., None]) -> None:
        """Run this call through a per-parameter launcher (a backend's ``fused_step_``)."""
        fused_step(self.param, self.grad, score=self.score, slot=self.slot, col_step=self.col_step,
                   master=self.master, exp_avg=self.exp_avg, exp_avg_sq=self.exp_avg_sq, acc=self.acc, hp=self.hp,
                   accumulate=self.accumulate, update_score=self.update_score, count_step=self.count_step)
