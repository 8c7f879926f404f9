"""The device-side ops for CPU tensors, in numba: fused step, column norms and merge (backend ``"numba"``).

As a module this satisfies :class:`zenflow_triton.kernels.device_ops.DeviceOps`, like ``reference`` (backend
``"torch"``) and ``triton_device_ops`` (backend ``"triton"``).

When the "device" is the CPU (no GPU; tests, the demo, CPU-only fine-tuning), the plain-torch twins in
``reference.py`` are correct but slow: the fused step's masked gathers and scatters over a row-major
matrix cost about 17x a fused AdamW step at 8M parameters. These kernels do the same work in one pass
over the gradient per row: a vectorized loop adds every column into ``acc`` (a selected column's ``acc``
carries no meaning, so writing it costs nothing and keeps the loop branch-free) and into a per-row-block
partial score; then the row's selected columns are gathered, stepped with AdamW in a vectorized loop over the
contiguous compact state, and scattered into the param while the row is still in cache.

Scores are summed in a fixed order that depends only on the shape (row blocks of ``_ROWS_PER_BLOCK``, then
blocks in order), so results are bitwise reproducible for any thread count. Signatures and semantics are
those of :mod:`zenflow_triton.kernels.reference`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload, register_jitable

from ._checks import (
    check_column_sumsq_args,
    check_fused_step_args,
    check_merge_args,
    check_slot_range,
)
from ._numba_utils import U32, adamw_elem, bf16_round, f16_round, flat_view, load_grad, scalar_hyperparams, store_snap
from .hyperparams import AdamHyperparams, require_hyperparams

if TYPE_CHECKING:  # device_ops imports the backends lazily; no cycle at run time
    from .step_args import FusedStepArgs

__all__ = ["column_sumsq_", "fused_step_", "fused_steps_", "merge_"]

# Rows summed into one partial score before the blocks are combined. The partial buffer holds R/64 rows of C
# floats (1/64 of the gradient's size in fp32), and each block is a work item of 64 rows: even a 128-row
# matrix splits over two threads, and a 4096 x 2048 weight makes 64 items for numba's static schedule.
_ROWS_PER_BLOCK = 64
# Below this many elements a launch runs serially on the calling thread: waking numba's thread pool costs tens
# of microseconds, while 2^16 fp32 elements stream in ~20 us on one core.
_MIN_PARALLEL_ELEMS = 1 << 16


def _launch(kernels, numel: int, items: int, *args) -> None:
    """Run ``items`` work items with the (parallel, serial) pair: serial when the job is too small to pay for
    the thread pool or the calling thread asked numba for one thread."""
    parallel, serial = kernels
    if numel < _MIN_PARALLEL_ELEMS or items < 2 or numba.get_num_threads() == 1:
        serial(items, *args)
    else:
        parallel(items, *args)


def _adam_scalars(hp: AdamHyperparams) -> tuple:
    """The trailing scalar arguments of ``adamw_elem`` (decay, l2, coupled, w, base_is_m, beta2, 1 - beta2, eps),
    rounded to fp32 where torch rounds them: the host kernel's own, without its count terms."""
    return scalar_hyperparams(1, hp)[3:11]


# One branch-free loop per (accumulate, update_score) case, each its own function with unsigned indices: a
# flag tested inside the loop, or a signed index numba must wrap, keeps LLVM from vectorizing it (measured:
# the single loop with both flags ran at 1.9x the time of a fused AdamW step at 8M params; split, ~0.9x).


@register_jitable
def _row_add_score(grad, acc, partial, base, pbase, cols):
    for j in range(cols):
        g = load_grad(grad, base + j)
        partial[pbase + j] += g * g
        acc[base + j] += g


@register_jitable
def _row_copy_score(grad, acc, partial, base, pbase, cols):
    for j in range(cols):
        g = load_grad(grad, base + j)
        partial[pbase + j] += g * g
        acc[base + j] = g


@register_jitable
def _row_add(grad, acc, base, cols):
    for j in range(cols):
        acc[base + j] += load_grad(grad, base + j)


@register_jitable
def _row_copy(grad, acc, base, cols):
    for j in range(cols):
        acc[base + j] = load_grad(grad, base + j)


# The selected columns of a row go through three loops: gather their gradients into a contiguous buffer, AdamW
# over that buffer and the row's compact state (contiguous when the slots are 0 .. n-1 in the order visited; the new
# master goes into a second buffer, already rounded to the param's dtype), then scatter that buffer into the param.
# In one loop the indexed load and store kept the arithmetic scalar. Whole fused step, r = 0.1, one thread, ns per
# element (min of 11): 64 x 2048 fp32 in cache 0.55 -> 0.35 (0.27 without the scatter); the op table's 33.6M
# params in bf16, from memory, 31.4 -> 24.9 ms. In fp32 it stays at ~31 ms (r = 0: ~15): memory bound, not compute
# bound. Most of the gap is the param's read-modify-write, 81% of its lines touched at 10% random columns (2048 x
# 2048: 0.85 ns/el, 0.53 without the scatter; the scatter alone costs as much as a dense read-modify-write of the
# param). Prefetching the param row (whole rows ahead, per 64-column block, per selected column) and staging it in
# a row buffer gained nothing beyond noise, or lost in cache.


@register_jitable
def _gather_cols(grad, gbuf, base, slot_cols, nsel):
    for q in range(nsel):
        gbuf[q] = load_grad(grad, base + np.uint64(slot_cols[q]))


@register_jitable
def _scatter_cols(param, pbuf, base, slot_cols, nsel):
    for q in range(nsel):
        param[base + np.uint64(slot_cols[q])] = pbuf[q]


@register_jitable(error_model="numpy")
def _adamw_cols_contig(master, exp_avg, exp_avg_sq, gbuf, pbuf, cbase, nsel, step_size, bc2_sqrt, decay, l2,
                       coupled, w, base_is_m, b2, omb2, eps):
    """Slots ``0 .. nsel-1`` of the row at ``cbase`` in the compact state: contiguous, so the loop vectorizes.
    The rounding into the param's dtype (``store_snap`` into ``pbuf``) runs here too, 8 lanes at a time."""
    for q in range(nsel):
        c = cbase + q
        p, m, v = adamw_elem(master[c], exp_avg[c], exp_avg_sq[c], gbuf[q], step_size[q], bc2_sqrt[q], decay, l2,
                              coupled, w, base_is_m, b2, omb2, eps)
        master[c] = p
        exp_avg[c] = m
        exp_avg_sq[c] = v
        store_snap(pbuf, q, p)


@register_jitable(error_model="numpy")
def _adamw_cols_mapped(param, grad, master, exp_avg, exp_avg_sq, base, cbase, nsel, slot_cols, slot_ids, step_size,
                       bc2_sqrt, decay, l2, coupled, w, base_is_m, b2, omb2, eps):
    """Any other slot map (unused or repeated slots): the state is indexed, so the AdamW loop stays scalar, and one
    loop that also loads and stores at the columns beats gather, indexed AdamW, scatter (whole step, r = 0.1, ns per
    element: 64 x 2048 fp32 in cache 0.55 vs 0.67; 2048 x 2048 from memory 0.81 vs 1.07)."""
    for q in range(nsel):
        j = base + np.uint64(slot_cols[q])
        c = cbase + np.uint64(slot_ids[q])
        p, m, v = adamw_elem(master[c], exp_avg[c], exp_avg_sq[c], load_grad(grad, j), step_size[q], bc2_sqrt[q],
                              decay, l2, coupled, w, base_is_m, b2, omb2, eps)
        master[c] = p
        exp_avg[c] = m
        exp_avg_sq[c] = v
        store_snap(param, j, p)


@register_jitable(error_model="numpy")
def _fused_step_blocks(lo, hi, param, grad, partial, slot_cols, slot_ids, contig, master, exp_avg, exp_avg_sq, acc,
                       cols, k, step_size, bc2_sqrt, has_acc, accumulate, update_score, decay, l2, coupled, w,
                       base_is_m, b2, omb2, eps):
    """Row blocks ``[lo, hi)``: every column into acc (unless ``has_acc`` is False: acc=None) and the block's partial
    score, then AdamW on the row's selected columns while the row is still in cache. ``contig``: ``slot_ids`` is
    ``0 .. nsel-1``."""
    rows = grad.shape[0] // cols
    nsel = np.uint64(slot_cols.shape[0])
    # Scratch for the selected columns, one pair per call: per work item under prange (each thread its own, so
    # any thread count gives the same bits), once for all blocks in the serial kernel.
    gbuf = np.empty(slot_cols.shape[0], np.float32)
    pbuf = np.empty(slot_cols.shape[0], param.dtype)
    for blk in range(lo, hi):
        pbase = np.uint64(blk * cols)
        for r in range(blk * _ROWS_PER_BLOCK, min(rows, (blk + 1) * _ROWS_PER_BLOCK)):
            base = np.uint64(r * cols)
            if not has_acc:  # acc=None (accumulate="host"): no accumulation target, only the scores
                if update_score:
                    _row_score(grad, partial, base, pbase, np.uint64(cols))
            elif update_score:
                if accumulate:
                    _row_add_score(grad, acc, partial, base, pbase, np.uint64(cols))
                else:
                    _row_copy_score(grad, acc, partial, base, pbase, np.uint64(cols))
            elif accumulate:
                _row_add(grad, acc, base, np.uint64(cols))
            else:
                _row_copy(grad, acc, base, np.uint64(cols))
            if nsel == 0:
                continue
            cbase = np.uint64(r * k)
            if contig:
                _gather_cols(grad, gbuf, base, slot_cols, nsel)
                _adamw_cols_contig(master, exp_avg, exp_avg_sq, gbuf, pbuf, cbase, nsel, step_size, bc2_sqrt, decay,
                                   l2, coupled, w, base_is_m, b2, omb2, eps)
                _scatter_cols(param, pbuf, base, slot_cols, nsel)
            else:
                _adamw_cols_mapped(param, grad, master, exp_avg, exp_avg_sq, base, cbase, nsel, slot_cols, slot_ids,
                                   step_size, bc2_sqrt, decay, l2, coupled, w, base_is_m, b2, omb2, eps)


@register_jitable
def _row_score(grad, partial, base, pbase, cols):
    for j in range(cols):
        g = load_grad(grad, base + j)
        partial[pbase + j] += g * g


@register_jitable(error_model="numpy")
def _column_sumsq_blocks(lo, hi, grad, partial, cols):
    rows = grad.shape[0] // cols
    for blk in range(lo, hi):
        pbase = np.uint64(blk * cols)
        for r in range(blk * _ROWS_PER_BLOCK, min(rows, (blk + 1) * _ROWS_PER_BLOCK)):
            _row_score(grad, partial, np.uint64(r * cols), pbase, np.uint64(cols))


@register_jitable
def _add_partials_cols(lo, hi, score, partial, cols):
    """score += sum over blocks, block 0 first: the same order whatever the thread count."""
    nblocks = partial.shape[0] // cols
    for j in range(lo, hi):
        total = np.float32(0.0)
        for b in range(nblocks):
            total += partial[b * cols + j]
        score[j] += total


# Merge blends every column of a row with a per-column mask (all ones where slot < 0) on the raw bits, rather than
# copying a list of columns: the dense loop vectorizes, and with the unselected columns scattered it touches the
# same cache lines anyway. 33.6M params, 90% unselected at random, one thread (min of 21): fp32 25.9 -> 13.0 ms
# (param.copy_ of the whole snapshot: ~14), bf16 24.8 -> 7.0. and/or rather than a select, which LLVM would turn
# into a masked store (slow on AMD Zen: see cpu_adamw._blend).


@register_jitable
def _merge_row(param, snapshot, mask, base, cols):
    for j in range(cols):
        _merge_elem(param, snapshot, base + j, mask[j])


def _merge_elem(param, snapshot, i, m):  # pragma: no cover - typing stub, replaced by the overload below
    raise NotImplementedError


@overload(_merge_elem)
def _merge_elem_impl(param, snapshot, i, m):
    # Same integer views: the bits as they are. An fp32 source (the master, host_snapshot=False) into a 16-bit
    # parameter: rounded to nearest even as the host kernel rounds the snapshot it writes (store_snap), so the
    # parameter gets the same bits either way; bf16 arrives as uint16, fp16 as int16 (flat_view's convention).
    if snapshot.dtype == param.dtype:

        def copy_bits(param, snapshot, i, m):
            param[i] = (param[i] & ~m) | (snapshot[i] & m)

        return copy_bits
    if snapshot.dtype == types.float32 and param.dtype == types.uint16:

        def round_bf16(param, snapshot, i, m):
            param[i] = np.uint16(U32(U32(param[i]) & U32(~m)) | U32(bf16_round(snapshot[i]) & U32(m)))

        return round_bf16
    if snapshot.dtype == types.float32 and param.dtype == types.int16:

        def round_f16(param, snapshot, i, m):
            param[i] = np.int16(U32(U32(np.uint16(param[i])) & U32(np.uint16(~m))) | U32(f16_round(snapshot[i])
                                                                                          & U32(np.uint16(m))))

        return round_f16
    return None


@register_jitable
def _merge_rows(lo, hi, param, snapshot, mask):
    cols = mask.shape[0]
    for r in range(lo, hi):
        _merge_row(param, snapshot, mask, np.uint64(r * cols), np.uint64(cols))


# Each op has a parallel kernel (one work item per prange iteration) and a serial one for small jobs. The serial
# ones never enter numba's OpenMP runtime: after every parallel region its threads spin-wait for more work, and
# two runtimes spinning on the same cores (numba's, for this thread and the host worker, and torch's own) starve
# the training thread. Measured on the demo (14 weights of 4K-16K elements, 2 cores): 190 ms per step with
# single-thread parallel launches, 16 ms with OMP_WAIT_POLICY=PASSIVE, which a library must not set for its user.


@njit(parallel=True, nogil=True, cache=True)
def _fused_step_parallel(n, *args):
    for it in prange(n):
        _fused_step_blocks(it, it + 1, *args)


@njit(nogil=True, cache=True)
def _fused_step_serial(n, *args):
    _fused_step_blocks(0, n, *args)


@njit(parallel=True, nogil=True, cache=True)
def _column_sumsq_parallel(n, *args):
    for it in prange(n):
        _column_sumsq_blocks(it, it + 1, *args)


@njit(nogil=True, cache=True)
def _column_sumsq_serial(n, *args):
    _column_sumsq_blocks(0, n, *args)


@njit(parallel=True, nogil=True, cache=True)
def _add_partials_parallel(n, *args):
    for it in prange(n):
        _add_partials_cols(it, it + 1, *args)


@njit(nogil=True, cache=True)
def _add_partials_serial(n, *args):
    _add_partials_cols(0, n, *args)


@njit(parallel=True, nogil=True, cache=True)
def _merge_parallel(n, *args):
    for it in prange(n):
        _merge_rows(it, it + 1, *args)


@njit(nogil=True, cache=True)
def _merge_serial(n, *args):
    _merge_rows(0, n, *args)


def _check_cpu(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the numba kernels run on CPU tensors; got a tensor on {t.device} "
                             "(use backend='triton' or 'torch' for device tensors)")


_FUSED_STEP = (_fused_step_parallel, _fused_step_serial)
_COLUMN_SUMSQ = (_column_sumsq_parallel, _column_sumsq_serial)
_ADD_PARTIALS = (_add_partials_parallel, _add_partials_serial)
_MERGE = (_merge_parallel, _merge_serial)


# The kernel's acc when the call has none (acc=None): never indexed (has_acc=False), one dtype for one compilation.
_NO_ACC = np.zeros(0, dtype=np.float32)


def _nblocks(rows: int) -> int:
    return (rows + _ROWS_PER_BLOCK - 1) // _ROWS_PER_BLOCK


def _partials(rows: int, cols: int) -> np.ndarray:
    return np.zeros(_nblocks(rows) * cols, dtype=np.float32)


def column_sumsq_(score: torch.Tensor, grad: torch.Tensor) -> None:
    """``score[j] += sum_i grad[i, j]**2`` in fp32, deterministic in the summation order."""
    rows, cols = check_column_sumsq_args(score, grad)
    _check_cpu(grad)
    if rows == 0 or cols == 0:
        return
    partial = _partials(rows, cols)
    _launch(_COLUMN_SUMSQ, rows * cols, _nblocks(rows), flat_view(grad), partial, cols)
    _launch(_ADD_PARTIALS, partial.size, cols, score.numpy(), partial, cols)


def _selected(slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """(selected columns, their slots, whether the slots are exactly 0 .. n-1), in slot order: any permutation of
    0 .. k-1 then reads the compact state contiguously (the optimizer's slots already are in column order:
    offload.select_columns). The sort is stable, so a repeated slot still sees its columns' updates in column order
    in the indexed loop it takes."""
    cols = np.flatnonzero(slot >= 0)
    ids = slot[cols]
    ascending = True
    if ids.size > 1 and not (ids[1:] > ids[:-1]).all():
        order = np.argsort(ids, kind="stable")
        cols = cols[order]
        ids = ids[order]
        ascending = bool((ids[1:] > ids[:-1]).all())
    # Strictly ascending from 0 to n - 1 is exactly 0 .. n-1 (unused slots or a repeated one break it).
    return cols, ids, ascending and bool(ids.size == 0 or (ids[0] == 0 and ids[-1] == ids.size - 1))


def fused_step_(
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
    """Numba twin of :func:`zenflow_triton.kernels.reference.fused_step_` for CPU tensors (same arguments)."""
    rows, cols, k = check_fused_step_args(
        param, grad, score=score, slot=slot, col_step=col_step, master=master, exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq, acc=acc, accumulate=accumulate,
    )
    require_hyperparams(hp)
    _check_cpu(param)
    if check_slots:
        check_slot_range(slot, k)
    if rows == 0 or cols == 0:
        return
    slot_cols, slot_ids, contig = _selected(slot.numpy())
    if count_step and k > 0:
        col_step.numpy()[slot_cols] += 1  # the selected columns, each once (slots are distinct)
    # Per selected column, in float64 and rounded once, like the reference (and torch's scalar path).
    steps = col_step.numpy()[slot_cols].astype(np.float64)
    step_size = (hp.lr / (1.0 - hp.beta1**steps)).astype(np.float32)
    bc2_sqrt = np.sqrt(1.0 - hp.beta2**steps).astype(np.float32)
    partial = _partials(rows, cols) if update_score else np.zeros(0, dtype=np.float32)
    _launch(
        _FUSED_STEP, rows * cols, _nblocks(rows), flat_view(param), flat_view(grad), partial, slot_cols, slot_ids,
        contig, master.numpy().reshape(-1), exp_avg.numpy().reshape(-1), exp_avg_sq.numpy().reshape(-1),
        _NO_ACC if acc is None else acc.numpy().reshape(-1), cols, k, step_size, bc2_sqrt, acc is not None,
        bool(accumulate), bool(update_score),
        *_adam_scalars(hp),
    )
    if update_score:
        _launch(_ADD_PARTIALS, partial.size, cols, score.numpy(), partial, cols)


def fused_steps_(calls: Sequence[FusedStepArgs]) -> None:
    """:func:`fused_step_` for each call, in order. On CPU tensors there is no launch to save: each call already
    runs its rows in parallel, and a loop costs what the per-parameter calls cost."""
    for c in calls:
        c.apply(fused_step_)


def merge_(param: torch.Tensor, snapshot: torch.Tensor, slot: torch.Tensor) -> None:
    """``param[:, j] = snapshot[:, j]`` for unselected columns, bits copied exactly; an fp32 ``snapshot`` of a
    bf16/fp16 ``param`` rounded to nearest even (``_numba_utils.bf16_round`` / ``f16_round``)."""
    rows, cols = check_merge_args(param, snapshot, slot)
    _check_cpu(param)
    unsel = slot.numpy() < 0
    nunsel = int(np.count_nonzero(unsel))
    if rows == 0 or nunsel == 0:
        return
    rounds = snapshot.dtype != param.dtype
    if nunsel == cols and not rounds:
        param.copy_(snapshot)
        return
    # Moved as raw 16/32-bit integers: a float copy could quiet a signalling NaN.
    itype = torch.int32 if param.element_size() == 4 else torch.int16
    mask = -unsel.astype(np.int32 if param.element_size() == 4 else np.int16)  # -1: all ones
    target = flat_view(param) if rounds else param.view(itype).numpy().reshape(-1)
    source = snapshot.numpy().reshape(-1) if rounds else snapshot.view(itype).numpy().reshape(-1)
    _launch(_MERGE, rows * cols, rows, target, source, mask)
