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

from .host_memory import HostSlab

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
            host_t[:, leaving_cpu] = dev_t.index_select(1, src).cpu().to(host_t.dtype)
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
            new_t[:, dst] = host_t.index_select(1, joining_cpu).to(device, torch.float32)
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
    then per parameter one gather of its leaving columns on the device and one copy of it into a pinned host buffer
    shared by all, one gather of its joining columns on the host into another and one copy of that to the device,
    each ``non_blocking``, then one synchronization before the leaving columns are written into the host arrays.
    (Two synchronizations, not one: what to gather depends on the new slot maps, which the host must read first.)

    Device memory beyond the compact state: one parameter's changed columns at a time and a chunk of at most
    ``_INPLACE_CHUNK_BYTES`` (16 MiB). Where k is unchanged (the usual selection step) the returned compact tensors
    are the move's own, permuted in place in row chunks, so the migration builds no second compact state beside the
    first (12r B/param); where every new slot is a joining column (the first selection) they are filled from the host
    directly; where k changes otherwise (``set_knobs(topk_ratio=...)``) they are new tensors.
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
    """fp32 host memory for one packed transfer: pinned when the other side is a GPU. A small one from torch's
    caching host allocator (it also keeps a block from being reused while an asynchronous copy still reads it); a
    large one (a first selection stages all k columns: 12r bytes per parameter, 8.4 GB for 7B at r = 0.1) in a
    :class:`HostSlab` of exactly its size, as the optimizer's own host state: the caching allocator would round it
    up to a power of two and keep it page-locked, and uncounted, for the rest of the process. The caller
    synchronizes before the stage goes (the slab unregisters when its last view dies)."""
    if device.type != "cuda":
        return torch.empty(numel, dtype=torch.float32)
    if 4 * numel <= _CACHED_STAGING_BYTES:
        return torch.empty(numel, dtype=torch.float32, pin_memory=True)
    return HostSlab([((numel,), torch.float32)], pin=True, device=device).views[0]


# Staging above this many bytes gets a slab of its own (see _staging).
_CACHED_STAGING_BYTES = 256 << 20


# The in-place permutation of a selection step with k unchanged (:func:`_permute_in_place`) goes through a temporary
# of at most this many bytes: the migration's extra device memory beyond the changed columns' packed buffers. 16 MiB
# is nothing beside the compact state it replaces (12r B/param: 1.2 GB for a 1B model at r = 0.1) and keeps a chunk's
# two copies (64 MiB of traffic, ~15 us at an H200's ~4.8 TB/s, estimated, not measured) above the ~5 us a launch
# costs the host, so the launches stay hidden behind the copies; and every compact tensor of a 1B model but its
# embedding's ([2048 | 8192, 205 | 819] fp32: <= 6.7 MB) is one chunk, the embedding's ([128256, 205]: 105 MB) 7.
_INPLACE_CHUNK_BYTES = 16 << 20
_PARTS = 7  # device index tensors per parameter in _migrate_many's packed copy (see the plan there)
_NOTHING = torch.empty(0, dtype=torch.long)  # no in-place source (the compact tensors are not permuted in place)

# How _migrate_many builds a parameter's new compact state:
_KEEP = 0  # the same columns in the same slots: nothing moves, the tensors stay
_DIRECT = 1  # every new slot is a joining column, in slot order (the first selection): from the host straight in
_IN_PLACE = 2  # k unchanged: permuted in place (staying columns), joining ones from the packed buffer
_ALLOCATE = 3  # k changes: new tensors, staying columns gathered from the old ones, joining ones from the buffer


def _chunk_rows(rows: int, k: int) -> int:
    """Rows of one chunk of a ``[rows, k]`` fp32 compact tensor permuted in place: all of them under the cap."""
    return max(1, min(rows, _INPLACE_CHUNK_BYTES // (4 * max(k, 1))))


def _reusable(compact: Compact, k_new: int) -> bool:
    """Whether the new compact state can live in the old tensors: the same width k_new > 0, and three separate
    contiguous fp32 tensors (aliased ones would each be rewritten thrice)."""
    rows, k_old = compact[0].shape
    if k_new != k_old or k_new == 0:
        return False
    if any(t.dtype != torch.float32 or t.shape != (rows, k_old) or not t.is_contiguous() for t in compact):
        return False
    return len({t.untyped_storage().data_ptr() for t in compact}) == 3


def _plan_mode(compact: Compact, k_new: int, parts: tuple[torch.Tensor, ...]) -> tuple[int, torch.Tensor]:
    """One parameter's way (``_KEEP`` ...) and, for ``_IN_PLACE``, the gather that permutes its compact tensors: per
    new slot the old slot its staying column comes from (0 for a joining column, written after). ``parts``: the host
    index plan of :func:`_migrate_many`."""
    leave_src, _, stay_dst, stay_src, join_dst, _ = parts
    if not leave_src.numel() and not join_dst.numel() and torch.equal(stay_dst, stay_src):
        return _KEEP, _NOTHING  # no column changes sides, and slots are ranks: the same slots
    if k_new and join_dst.numel() == k_new and torch.equal(join_dst, torch.arange(k_new)):
        return _DIRECT, _NOTHING
    if not _reusable(compact, k_new):
        return _ALLOCATE, _NOTHING
    src = torch.zeros(k_new, dtype=torch.long)
    src[stay_dst] = stay_src
    return _IN_PLACE, src


def _permute_in_place(t: torch.Tensor, src: torch.Tensor, chunk: torch.Tensor, join_dst: torch.Tensor,
                      joined: torch.Tensor | None) -> None:
    """A compact tensor ``[rows, k]`` in its new layout, in place: per chunk of rows (rows are independent) the staying
    columns gathered by ``src`` into ``chunk`` and copied back, then the joining columns ``joined`` into their slots
    ``join_dst`` (slots no staying column takes, so the order is free). Pure data movement: the bits of the
    allocating path. Launches: two per chunk (one chunk under :data:`_INPLACE_CHUNK_BYTES`) and one for the joining
    columns, about what the allocating path costs (an allocation, a gather, two scatters); no synchronization."""
    rows, k = t.shape
    step = _chunk_rows(rows, k)
    for r0 in range(0, rows, step):
        part = t[r0 : r0 + step]
        tmp = chunk[: part.shape[0] * k].view(part.shape[0], k)
        torch.index_select(part, 1, src, out=tmp)
        part.copy_(tmp)
    if joined is not None:
        t.index_copy_(1, join_dst, joined)


def _write_leaving(m: ColumnMove, leaving: torch.Tensor, packed: torch.Tensor) -> None:
    """The leaving columns' packed state (three ``[rows, n]`` blocks, then ``n`` int32 step counts) into the host
    arrays."""
    rows, n = m.compact[0].shape[0], leaving.numel()
    for j, host_t in enumerate(m.host):
        host_t[:, leaving] = packed[j * rows * n : (j + 1) * rows * n].view(rows, n).to(host_t.dtype)
    m.host_col_step[leaving] = packed[3 * rows * n :].view(torch.int32)


def _migrate_many(moves: Sequence[ColumnMove], old_host: Sequence[torch.Tensor],
                  new_host: Sequence[torch.Tensor]) -> list[tuple[Compact, int, int, int]]:
    """The body of :func:`migrate_columns_many`, given host copies of the slot maps.

    Each side's changed columns travel packed in fp32: per parameter its three compact tensors ``[rows, n]`` in turn,
    then its ``n`` step counts as int32 bit patterns (a view, never a conversion); with CUDA all parameters' shares
    lie in one pinned buffer per side. Each parameter's way is one of ``_KEEP``, ``_DIRECT`` (its compact columns go
    from the host straight into the new tensors, one copy per tensor, so the device never holds them twice),
    ``_IN_PLACE`` and ``_ALLOCATE``."""
    device = moves[0].old_slot.device
    if any(m.old_slot.device != device for m in moves):
        raise ValueError("migrate_columns_many: all parameters must be on one device")
    plans, index_parts = [], []
    for m, old, new in zip(moves, old_host, new_host):
        old_sel, new_sel = old >= 0, new >= 0
        leaving = torch.nonzero(old_sel & ~new_sel).squeeze(1)
        joining = torch.nonzero(new_sel & ~old_sel).squeeze(1)
        staying = torch.nonzero(old_sel & new_sel).squeeze(1)
        parts = (old[leaving].long(), leaving, new[staying].long(), old[staying].long(), new[joining].long(), joining)
        k_new = int(new_sel.sum())
        mode, src = _plan_mode(m.compact, k_new, parts)
        index_parts += parts + (src,)
        plans.append((k_new, leaving, joining, mode))
    # Every index the device needs, in one host-to-device copy.
    flat_host = torch.cat(index_parts)
    if device.type == "cuda":
        flat_host = flat_host.pin_memory()
    flat_dev = _to_device(flat_host, device)
    dev_parts, start = [], 0
    for part in index_parts:
        dev_parts.append(flat_dev[start : start + part.numel()])
        start += part.numel()

    def packed(m: ColumnMove, plan: tuple) -> int:  # the packed columns' elements per column changing sides
        # (_DIRECT on CPU tensors: the step counts alone, the compact columns are gathered straight into place)
        return 1 + (0 if plan[3] == _DIRECT and device.type == "cpu" else 3 * m.compact[0].shape[0])

    # The changed columns of all parameters in one pinned buffer each way; on the device each parameter's share in a
    # buffer of its own, dropped once its copy is enqueued (the caching allocator reuses a block freed on this stream
    # only for work queued after the copy), so the device holds one parameter's changed columns at a time, not all.
    # With CUDA one device-to-host and one host-to-device copy per parameter with changed columns.
    leave_total = sum(plan[1].numel() * (3 * m.compact[0].shape[0] + 1) for m, plan in zip(moves, plans))
    join_total = sum(plan[2].numel() * packed(m, plan) for m, plan in zip(moves, plans))
    # (On CPU tensors each parameter's share is staged alone: nothing is packed for a transfer there.)
    leave_host = _staging(leave_total, device) if device.type == "cuda" else None
    join_host = _staging(join_total, device) if device.type == "cuda" else None
    # The chunk buffer of the in-place permutations, shared by all of them (they run one after another on one stream).
    chunk_numel = max((_chunk_rows(*m.compact[0].shape) * m.compact[0].shape[1]
                       for m, plan in zip(moves, plans) if plan[3] == _IN_PLACE), default=0)
    chunk = torch.empty(chunk_numel, dtype=torch.float32, device=device) if chunk_numel else None
    out: list[tuple[Compact, int, int, int]] = []
    lo = jo = 0
    for i, (m, (k_new, leaving, joining, mode)) in enumerate(zip(moves, plans)):
        rows = m.compact[0].shape[0]
        leave_src, leaving_dev, stay_dst, stay_src, join_dst, joining_dev, inplace_src = \
            dev_parts[_PARTS * i : _PARTS * (i + 1)]
        # Leaving columns first: gathered before anything below rewrites the compact tensors (stream order).
        n = leaving.numel()
        if n:
            size = n * (3 * rows + 1)
            leave_dev = torch.empty(size, dtype=torch.float32, device=device)
            for j, t in enumerate(m.compact):
                torch.index_select(t, 1, leave_src, out=leave_dev[j * rows * n : (j + 1) * rows * n].view(rows, n))
            torch.index_select(m.col_step, 0, leaving_dev, out=leave_dev[3 * rows * n :].view(torch.int32))
            if leave_host is not None:
                leave_host[lo : lo + size].copy_(leave_dev, non_blocking=True)
                lo += size
            else:  # CPU: the host arrays are written now (the joining columns read below are other columns)
                _write_leaving(m, leaving, leave_dev)
            del leave_dev
        # Joining columns: gathered on the host (a pinned slice with CUDA), copied to the device.
        n = joining.numel()
        joined: list[torch.Tensor] = []
        if n:
            size = n * packed(m, (k_new, leaving, joining, mode))
            stage = join_host[jo : jo + size] if join_host is not None else _staging(size, device)
            jo += size
            # The compact blocks are staged unless only the step counts are (as packed() decides); with no local row
            # (an empty FSDP shard) they are empty views, which the CUDA fill below still reads.
            staged = mode != _DIRECT or device.type != "cpu"
            blocks = [stage[j * rows * n : (j + 1) * rows * n].view(rows, n) for j in range(3 if staged else 0)]
            for block, t in zip(blocks, m.host):
                _gather_columns(t, joining, block)
            torch.index_select(m.host_col_step, 0, joining, out=stage[size - n :].view(torch.int32))
            if mode == _DIRECT:  # the step counts alone to the device; the blocks go straight into place below
                m.col_step[joining_dev] = _to_device(stage[size - n :], device).view(torch.int32)
            else:
                join_dev = _to_device(stage, device)
                joined = [join_dev[j * rows * n : (j + 1) * rows * n].view(rows, n) for j in range(len(blocks))]
                m.col_step[joining_dev] = join_dev[size - n :].view(torch.int32)
                del join_dev
        if mode == _KEEP:
            new_compact = m.compact
        elif mode == _IN_PLACE:
            new_compact = m.compact
            for t, join_t in zip(new_compact, joined or (None,) * 3):
                _permute_in_place(t, inplace_src, chunk, join_dst, join_t)
        elif mode == _DIRECT:
            # The old tensors are read no more (their leaving columns are gathered): reuse them when k is unchanged.
            new_compact = m.compact if _reusable(m.compact, k_new) else tuple(
                torch.empty((rows, k_new), dtype=torch.float32, device=device) for _ in range(3))
            for j, (new_t, host_t) in enumerate(zip(new_compact, m.host)):
                if device.type == "cpu":
                    _gather_columns(host_t, joining, new_t)
                else:  # from the pinned stage, which outlives the copy (the synchronization below)
                    new_t.copy_(blocks[j], non_blocking=True)
        else:
            new_compact = tuple(torch.empty((rows, k_new), dtype=torch.float32, device=device) for _ in range(3))
            if stay_dst.numel():
                for new_t, old_t in zip(new_compact, m.compact):
                    new_t[:, stay_dst] = old_t.index_select(1, stay_src)
            for new_t, join_t in zip(new_compact, joined):
                new_t[:, join_dst] = join_t
        del joined
        per_column = 3 * rows * 4 + 4
        out.append((new_compact, leaving.numel() * per_column, n * per_column, leaving.numel() + n))

    if leave_host is not None:
        # Once, for everything above: the leaving columns must have reached the host before they are written into
        # the host arrays below, and the pinned buffers must outlive the copies that read them.
        torch.cuda.current_stream(device).synchronize()
        lo = 0
        for m, (_, leaving, _, _) in zip(moves, plans):
            size = leaving.numel() * (3 * m.compact[0].shape[0] + 1)
            if size:
                _write_leaving(m, leaving, leave_host[lo : lo + size])
                lo += size
    return out


def _gather_columns(host_t: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """``out = host_t[:, index]`` into fp32 ``out``; bf16 host moments (state_dtype) widen exactly."""
    if host_t.dtype == out.dtype:
        torch.index_select(host_t, 1, index, out=out)
    else:
        out.copy_(host_t.index_select(1, index))
