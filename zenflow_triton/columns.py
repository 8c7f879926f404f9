"""The columns of an offloaded parameter (DESIGN §3, §4): which parameters offload, their matrix view, top-k
selection by score, the Adam state that moves with a column when it changes sides, and the masks each side reads.

Everything here is stateless beyond the tensors it is handed; the optimizer decides when a selection happens, this
module decides what it does. Per parameter (:func:`reselect_`, :func:`migrate_columns`: the definitions, a dozen
blocking device round trips each) or for all parameters at once (:func:`reselect_many_`,
:func:`migrate_columns_many`: the same results bit for bit, with two synchronizations in all).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ColumnMasks",
    "ColumnMove",
    "Reselection",
    "is_offloaded",
    "matrix_shape",
    "migrate_columns",
    "migrate_columns_many",
    "reselect_",
    "reselect_many_",
    "select_columns",
]

Compact = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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
    return _select(score, k)[0]


def _select(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`select_columns`, and the chosen columns in increasing order (None when k = 0). No device sync."""
    cols = score.numel()
    slot = torch.full((cols,), -1, dtype=torch.int32, device=score.device)
    if k >= cols:
        idx = torch.arange(cols, device=score.device)
        slot.copy_(idx)
        return slot, idx
    if k > 0:
        idx = torch.topk(score, k, sorted=False).indices.sort().values
        slot[idx] = torch.arange(k, dtype=torch.int32, device=score.device)
        return slot, idx
    return slot, None


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
        self.refresh_from_host(slot, slot)

    def refresh_from_host(self, slot: torch.Tensor, host_slot: torch.Tensor) -> None:
        """:meth:`refresh` from the slot map and a host copy of it already made (no device round trip)."""
        self.selected.copy_((slot >= 0).to(torch.int32))
        self.host_slot.copy_(host_slot)
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


# ------------------------------------------------------------------------------------------ all parameters at once


@dataclass(frozen=True, eq=False)
class ColumnMove:
    """One parameter's share of :func:`migrate_columns_many`: the arguments of :func:`migrate_columns`."""

    old_slot: torch.Tensor
    new_slot: torch.Tensor
    compact: Compact
    col_step: torch.Tensor
    host: Compact
    host_col_step: torch.Tensor


def migrate_columns_many(moves: Sequence[ColumnMove]) -> list[tuple[Compact, int, int, int]]:
    """:func:`migrate_columns` for every move at once, with identical results (pure data movement, bit for bit).

    All parameters must be on one device. With CUDA: one device-to-host copy of every slot map (a synchronization),
    then for all parameters together one gather of the leaving columns on the device and one copy of it to pinned
    host memory, one gather of the joining columns on the host into pinned memory and one copy of it to the device,
    each ``non_blocking``, then one synchronization before the leaving columns are written into the host arrays.
    (Two synchronizations, not one: what to gather depends on the new slot maps, which the host must read first.)
    """
    if not moves:
        return []
    slots = _to_host([t for m in moves for t in (m.old_slot, m.new_slot)])
    return _migrate_many(moves, slots[0::2], slots[1::2])


def reselect_many_(items: Sequence[tuple[dict[str, Any], ColumnMasks, int]]) -> list[Reselection]:
    """:func:`reselect_` for every ``(state, masks, k)`` at once: the same new state, masks and
    :class:`Reselection`\\ s, bit for bit, with two synchronizations in all instead of a dozen per parameter
    (see :func:`migrate_columns_many`). Host work on these parameters must be quiescent (the caller flushed)."""
    if not items:
        return []
    device = items[0][0]["score"].device
    chosen_slots, energies = [], []
    for st, _, k in items:
        score = st["score"]
        new_slot, chosen = _select(score, k)
        chosen_slots.append(new_slot)
        # The same reductions as reselect_ (score[new_slot >= 0] holds the chosen columns in increasing order, as
        # index_select gives them here, without the device sync of a boolean mask), kept on the device until the
        # one copy below.
        selected = score.index_select(0, chosen).sum() if chosen is not None else torch.zeros((), device=device)
        energies.append(torch.stack([score.sum(), selected]).view(torch.int32))
    fetched = _to_host(energies + [st["slot"] for st, _, _ in items] + chosen_slots)
    n = len(items)
    old_host, new_host = fetched[n : 2 * n], fetched[2 * n :]
    moves = [ColumnMove(old_slot=st["slot"], new_slot=new_slot, compact=(st["master"], st["exp_avg"], st["exp_avg_sq"]),
                        col_step=st["col_step"], host=(st["host_master"], st["host_exp_avg"], st["host_exp_avg_sq"]),
                        host_col_step=st["host_col_step"])
             for (st, _, _), new_slot in zip(items, chosen_slots)]
    migrated = _migrate_many(moves, old_host, new_host)
    out = []
    for (st, masks, k), new_slot, slot_host, energy, (compact, d2h, h2d, changed) in zip(
            items, chosen_slots, new_host, fetched[:n], migrated):
        energy_all, energy_sel = (float(e) for e in energy.view(torch.float32))
        st["master"], st["exp_avg"], st["exp_avg_sq"] = compact
        st["slot"] = new_slot
        st["score"].zero_()
        masks.refresh_from_host(new_slot, slot_host)
        out.append(Reselection(energy_selected=energy_sel if k else 0.0, energy_all=energy_all,
                               columns_changed=changed, d2h_bytes=d2h, h2d_bytes=h2d))
    return out


def _to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of int32 device tensors: one copy of all of them into pinned memory, one synchronization.
    CPU tensors are returned as they are (they are only read)."""
    if not tensors or tensors[0].device.type == "cpu":
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    # The host reads these right away: the slot maps decide what is gathered next.
    torch.cuda.current_stream(flat.device).synchronize()
    out, start = [], 0
    for t in tensors:
        out.append(host[start : start + t.numel()].view(t.shape))
        start += t.numel()
    return out


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` (itself on the CPU); with CUDA an asynchronous copy, so ``host`` must be pinned and stay
    untouched until the stream passed it (the caller synchronizes before returning)."""
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def _staging(numel: int, device: torch.device) -> torch.Tensor:
    """fp32 host memory for one packed transfer: pinned (from torch's caching host allocator, which also keeps a
    block from being reused while an asynchronous copy still reads it) when the other side is a GPU."""
    return torch.empty(numel, dtype=torch.float32, pin_memory=device.type == "cuda")


def _migrate_many(moves: Sequence[ColumnMove], old_host: Sequence[torch.Tensor],
                  new_host: Sequence[torch.Tensor]) -> list[tuple[Compact, int, int, int]]:
    """The body of :func:`migrate_columns_many`, given host copies of the slot maps.

    Each side's columns of all parameters travel packed in one fp32 buffer: per parameter its three compact tensors
    ``[rows, n]`` in turn, then its ``n`` step counts as int32 bit patterns (a view, never a conversion)."""
    device = moves[0].old_slot.device
    if any(m.old_slot.device != device for m in moves):
        raise ValueError("migrate_columns_many: all parameters must be on one device")
    plans, index_parts = [], []
    for old, new in zip(old_host, new_host):
        old_sel, new_sel = old >= 0, new >= 0
        leaving = torch.nonzero(old_sel & ~new_sel).squeeze(1)
        joining = torch.nonzero(new_sel & ~old_sel).squeeze(1)
        staying = torch.nonzero(old_sel & new_sel).squeeze(1)
        parts = (old[leaving].long(), leaving, new[staying].long(), old[staying].long(), new[joining].long(), joining)
        index_parts += parts
        plans.append((int(new_sel.sum()), leaving, joining, parts))
    # Every index the device needs, in one host-to-device copy.
    flat_host = torch.cat(index_parts)
    if device.type == "cuda":
        flat_host = flat_host.pin_memory()
    flat_dev = _to_device(flat_host, device)
    dev_parts, start = [], 0
    for part in index_parts:
        dev_parts.append(flat_dev[start : start + part.numel()])
        start += part.numel()

    # Leaving columns: gathered on the device into one buffer, copied to the host in one go.
    leave_total = sum(plan[1].numel() * (3 * m.compact[0].shape[0] + 1) for m, plan in zip(moves, plans))
    leave_dev = torch.empty(leave_total, dtype=torch.float32, device=device)
    # Joining columns: gathered on the host into one buffer, copied to the device in one go.
    join_total = sum(plan[2].numel() * (3 * m.compact[0].shape[0] + 1) for m, plan in zip(moves, plans))
    join_host = _staging(join_total, device)
    lo = jo = 0
    for i, (m, (_, leaving, joining, _)) in enumerate(zip(moves, plans)):
        rows = m.compact[0].shape[0]
        leave_src, leaving_dev = dev_parts[6 * i], dev_parts[6 * i + 1]
        n = leaving.numel()
        if n:
            for t in m.compact:
                torch.index_select(t, 1, leave_src, out=leave_dev[lo : lo + rows * n].view(rows, n))
                lo += rows * n
            torch.index_select(m.col_step, 0, leaving_dev, out=leave_dev[lo : lo + n].view(torch.int32))
            lo += n
        n = joining.numel()
        if n:
            for t in m.host:
                torch.index_select(t, 1, joining, out=join_host[jo : jo + rows * n].view(rows, n))
                jo += rows * n
            torch.index_select(m.host_col_step, 0, joining, out=join_host[jo : jo + n].view(torch.int32))
            jo += n
    if device.type == "cuda":
        leave_host = _staging(leave_total, device)
        leave_host.copy_(leave_dev, non_blocking=True)
    else:
        leave_host = leave_dev
    join_dev = _to_device(join_host, device)

    out: list[tuple[Compact, int, int, int]] = []
    jo = 0
    for i, (m, (k_new, leaving, joining, _)) in enumerate(zip(moves, plans)):
        rows = m.compact[0].shape[0]
        stay_dst, stay_src, join_dst, joining_dev = dev_parts[6 * i + 2 : 6 * i + 6]
        new_compact = tuple(torch.empty((rows, k_new), dtype=torch.float32, device=device) for _ in range(3))
        if stay_dst.numel():
            for new_t, old_t in zip(new_compact, m.compact):
                new_t[:, stay_dst] = old_t.index_select(1, stay_src)
        n = joining.numel()
        if n:
            for new_t in new_compact:
                new_t[:, join_dst] = join_dev[jo : jo + rows * n].view(rows, n)
                jo += rows * n
            m.col_step[joining_dev] = join_dev[jo : jo + n].view(torch.int32)
            jo += n
        per_column = 3 * rows * 4 + 4
        out.append((new_compact, leaving.numel() * per_column, n * per_column, leaving.numel() + n))

    if device.type == "cuda":
        # Once, for everything above: the leaving columns must have reached the host before they are written into
        # the host arrays below, and the pinned buffers must outlive the copies that read them.
        torch.cuda.current_stream(device).synchronize()
    lo = 0
    for m, (_, leaving, _, _) in zip(moves, plans):
        rows, n = m.compact[0].shape[0], leaving.numel()
        if n:
            for host_t in m.host:
                host_t[:, leaving] = leave_host[lo : lo + rows * n].view(rows, n)
                lo += rows * n
            m.host_col_step[leaving] = leave_host[lo : lo + n].view(torch.int32)
            lo += n
    return out
