"""Per-parameter pieces of the ZenFlow update: which params offload, column selection, state migration,
and the host job the worker runs. The optimizer class only orders these calls (DESIGN §3-§5).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = [
    "HostItem",
    "is_offloaded",
    "matrix_shape",
    "select_columns",
    "migrate_columns",
    "run_host_job",
]


def is_offloaded(p: torch.Tensor, min_offload_numel: int) -> bool:
    """DESIGN §3: ndim >= 2 and numel >= min_offload_numel; everything else stays resident."""
    return p.dim() >= 2 and p.numel() >= min_offload_numel


def matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    """The ``[R, C]`` matrix view: rows are ``shape[0]``, the columns (channels) are the rest flattened."""
    rows = p.shape[0]
    return rows, p.numel() // rows


def select_columns(score: torch.Tensor, k: int) -> torch.Tensor:
    """The slot map of the top-k columns by score: slot[j] = rank of j among the selected in column
    order (so the compact state stays in column order), -1 elsewhere."""
    cols = score.numel()
    slot = torch.full((cols,), -1, dtype=torch.int32, device=score.device)
    if k >= cols:
        slot.copy_(torch.arange(cols, dtype=torch.int32, device=score.device))
    elif k > 0:
        idx = torch.topk(score, k, sorted=False).indices.sort().values
        slot[idx] = torch.arange(k, dtype=torch.int32, device=score.device)
    return slot


def migrate_columns(
    *,
    old_slot: torch.Tensor,
    new_slot: torch.Tensor,
    compact: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    col_step: torch.Tensor,
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    host_col_step: torch.Tensor,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], int, int, int]:
    """Move Adam state (master, m, v and the per-column step count) of columns that change sides.

    Columns leaving the selection write their compact state back to the host arrays; columns joining
    gather theirs from the host; staying columns are re-slotted on the device. Only changed columns
    cross PCIe. Host work must be quiescent (the caller flushed). Updates ``col_step`` and the host
    arrays in place and returns ``(new_compact, d2h_bytes, h2d_bytes, columns_changed)``.
    """
    device = old_slot.device
    rows = compact[0].shape[0]
    k_new = int((new_slot >= 0).sum())
    old_sel, new_sel = old_slot >= 0, new_slot >= 0
    leaving = torch.nonzero(old_sel & ~new_sel).squeeze(1)
    joining = torch.nonzero(new_sel & ~old_sel).squeeze(1)
    staying = torch.nonzero(old_sel & new_sel).squeeze(1)
    d2h = h2d = 0
    if leaving.numel():
        src = old_slot[leaving].long()
        leaving_cpu = leaving.cpu()
        for dev_t, host_t in zip(compact, host):
            host_t[:, leaving_cpu] = dev_t.index_select(1, src).cpu()
        host_col_step[leaving_cpu] = col_step[leaving].cpu()
        d2h = leaving.numel() * (3 * rows * 4 + 4)
    new_compact = tuple(torch.empty((rows, k_new), dtype=torch.float32, device=device) for _ in range(3))
    if staying.numel():
        dst, src = new_slot[staying].long(), old_slot[staying].long()
        for new_t, old_t in zip(new_compact, compact):
            new_t[:, dst] = old_t.index_select(1, src)
    if joining.numel():
        dst = new_slot[joining].long()
        joining_cpu = joining.cpu()
        for new_t, host_t in zip(new_compact, host):
            new_t[:, dst] = host_t.index_select(1, joining_cpu).to(device)
        col_step[joining] = host_col_step[joining_cpu].to(device)
        h2d = joining.numel() * (3 * rows * 4 + 4)
    return new_compact, d2h, h2d, int(leaving.numel() + joining.numel())


@dataclass
class HostItem:
    """One parameter's share of a host job: buffers (CPU tensors, slab views) and the hyperparameters
    captured at the window end."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    slot: torch.Tensor
    unselected: torch.Tensor
    col_step: torch.Tensor
    snapshot: torch.Tensor | None
    count: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool


def run_host_job(items: list[HostItem], ready: torch.cuda.Event | None, num_threads: int) -> float:
    """The worker's body for one window: Adam on every item's unselected columns. Returns seconds spent."""
    from zenflow_triton.kernels.cpu_adamw import host_adamw_

    start = time.perf_counter()
    if ready is not None:
        # The gradient landing buffers are filled by an asynchronous device-to-host copy; reading them
        # before it completes would see the previous window's bytes.
        ready.synchronize()
    for it in items:
        # Each column's bias correction counts its own updates: one more for every column updated here.
        it.col_step.add_(it.unselected)
        host_adamw_(
            it.master, it.exp_avg, it.exp_avg_sq, it.grad, count=it.count, slot=it.slot, col_step=it.col_step,
            lr=it.lr, beta1=it.beta1, beta2=it.beta2, eps=it.eps, weight_decay=it.weight_decay,
            decoupled=it.decoupled, snapshot=it.snapshot, num_threads=num_threads,
        )
    return time.perf_counter() - start
