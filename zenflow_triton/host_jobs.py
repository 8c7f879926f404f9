"""What the host worker runs for a window (DESIGN §5): the job's items and its body, AdamW on the unselected
columns (the numba kernel of ``kernels/cpu_adamw.py``), and the first job, which loads that kernel. The
:class:`.Pipeline` builds the items and submits the jobs."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kernels import AdamHyperparams

__all__ = ["HostItem", "Window", "compile_host_kernels", "run_host_job"]


@dataclass(frozen=True)
class Window:
    """One parameter's window ending at this step: its group's hyperparameters now, and the gradient to apply when
    the host reads this step's gradient in place (:meth:`Pipeline.takes_gradient`), else None (the sum is in acc)."""

    param: torch.Tensor
    hp: AdamHyperparams
    grad: torch.Tensor | None = None


@dataclass
class HostItem:
    """One parameter's share of a host job: host buffers and the hyperparameters captured at the window end."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    slot: torch.Tensor
    unselected: torch.Tensor
    col_step: torch.Tensor
    snapshot: torch.Tensor | None
    count: int
    hp: AdamHyperparams
    cancelled: threading.Event | None = None  # the worker's: set when the job overran its timeout


def compile_host_kernels() -> float:
    """The worker's first job: load the host kernels (numba compiles them on first use on a machine, ~15 s, then
    loads them from its cache). Returns seconds spent."""
    start = time.perf_counter()
    from .kernels import cpu_adamw

    cpu_adamw.host_adamw_(*(torch.zeros(1, 1) for _ in range(4)), count=1, slot=torch.full((1,), -1, dtype=torch.int32),
                          col_step=torch.ones(1, dtype=torch.int32),
                          hp=AdamHyperparams(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0),
                          num_threads=1)
    return time.perf_counter() - start


def run_host_job(items: list[HostItem], ready: Sequence[torch.cuda.Event], num_threads: int) -> float:
    """The worker's body for one window: AdamW on every item's unselected columns. Returns seconds spent.
    ``ready``: CUDA events to wait for first (the window sums' device-to-host copies, and the last merge's
    host-to-device copies, which read the host arrays this job writes). Once an item's ``cancelled`` is set (the
    job overran worker_timeout) it writes nothing more: it stops before its next item, so a parameter that the user
    restored after the timeout stays as restored (an item being written finishes, into a parameter's old storage
    where the parameter is its own master: ``Pipeline._detach_own_masters``)."""
    # Imported here, not at the top: ``import zenflow_triton`` stays free of numba until a window runs.
    from .kernels.cpu_adamw import host_adamw_

    start = time.perf_counter()
    for event in ready:
        # The gradient landing buffers are filled by an asynchronous device-to-host copy; reading them before it
        # completes would see the previous window's bytes. And the snapshot (or master) this job writes is the
        # source of the last merge's host-to-device copies, which must have read it first.
        event.synchronize()
    for it in items:
        if it.cancelled is not None and it.cancelled.is_set():
            break
        # Each column's bias correction counts its own updates: one more for every column updated here.
        it.col_step.add_(it.unselected)
        host_adamw_(it.master, it.exp_avg, it.exp_avg_sq, it.grad, count=it.count, slot=it.slot,
                    col_step=it.col_step, hp=it.hp, snapshot=it.snapshot, num_threads=num_threads)
    return time.perf_counter() - start
