"""The columns of an offloaded parameter (DESIGN §3, §4): which parameters offload, their matrix view, top-k
selection by score, the Adam state that moves with a column when it changes sides, and the masks each side reads.

Everything here is per parameter and stateless beyond the tensors it is handed; the optimizer decides when a
selection happens, this module decides what it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ColumnMasks",
    "Reselection",
    "is_offloaded",
    "matrix_shape",
    "migrate_columns",
    "reselect_",
    "select_columns",
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
class ColumnMasks:
    """The selection as each side reads it, derived from the device slot map (``state["slot"]``) by
    :meth:`refresh` after every selection and load: the fused step adds ``selected`` to the per-column step
    counts, the host job reads ``host_slot`` and adds ``unselected`` to the host's."""

    selected: torch.Tensor  # device int32 [C]: 1 where the device updates the column
    host_slot: torch.Tensor  # CPU int32 [C]: the slot map, for the host kernel
    unselected: torch.Tensor  # CPU int32 [C]: 1 where the host updates the column
    num_unselected: int

    @classmethod
    def empty(cls, cols: int, device: torch.device) -> ColumnMasks:
        return cls(selected=torch.empty(cols, dtype=torch.int32, device=device),
                   host_slot=torch.empty(cols, dtype=torch.int32), unselected=torch.empty(cols, dtype=torch.int32),
                   num_unselected=cols)

    def refresh(self, slot: torch.Tensor) -> None:
        self.selected.copy_((slot >= 0).to(torch.int32))
        self.host_slot.copy_(slot)
        self.unselected.copy_((self.host_slot < 0).to(torch.int32))
        self.num_unselected = int(self.unselected.sum())


@dataclass(frozen=True)
class Reselection:
    """What one parameter's selection step did, for telemetry."""

    energy_selected: float  # summed score of the chosen columns
    energy_all: float  # summed score of all columns
    columns_changed: int  # columns that changed sides
    d2h_bytes: int
    h2d_bytes: int


def reselect_(st: dict[str, Any], masks: ColumnMasks, k: int) -> Reselection:
    """DESIGN §3 step 2 for one parameter: the top-k columns of ``st["score"]`` become the selection, the Adam state
    of columns that change sides migrates, the scores restart from zero and ``masks`` follow. Host work on this
    parameter must be quiescent (the caller flushed)."""
    score = st["score"]
    new_slot = select_columns(score, k)
    energy_all = float(score.sum())
    energy_sel = float(score[new_slot >= 0].sum()) if k else 0.0
    compact, d2h, h2d, changed = migrate_columns(
        old_slot=st["slot"], new_slot=new_slot, compact=(st["master"], st["exp_avg"], st["exp_avg_sq"]),
        col_step=st["col_step"], host=(st["host_master"], st["host_exp_avg"], st["host_exp_avg_sq"]),
        host_col_step=st["host_col_step"],
    )
    st["master"], st["exp_avg"], st["exp_avg_sq"] = compact
    st["slot"] = new_slot
    score.zero_()
    masks.refresh(new_slot)
    return Reselection(energy_selected=energy_sel, energy_all=energy_all, columns_changed=changed, d2h_bytes=d2h,
                       h2d_bytes=h2d)
