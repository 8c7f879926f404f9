"""Pieces shared by the Triton kernels: the guarded import, the device check, the row-split plan, bf16 rounding.

Importing this module imports Triton; ``zenflow_triton.kernels`` itself never does, so the package works without it.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - only where Triton is missing
    raise ImportError(
        "zenflow_triton's Triton kernels need Triton: pip install triton, or use backend='torch'"
    ) from exc

__all__ = [
    "ADD_PARTIALS_BLOCK",
    "RowSplitPlan",
    "FINISH_ADD_SCORES",
    "FINISH_COUNT_STEPS",
    "FINISH_FIELDS",
    "adam_columns",
    "adam_tile",
    "add_partials_",
    "bias_corrections",
    "INT32_MAX",
    "check_launch_device",
    "check_sides",
    "column_sums",
    "compact_block",
    "compact_columns",
    "count_selected_steps",
    "device_guard",
    "finish_steps_",
    "finish_steps_grouped_",
    "fp32_to_bf16_bits",
    "interpreting",
    "load_steps",
    "packed_adam",
    "plan_row_splits",
    "store_column_sums",
    "stream_tile",
    "tl",
    "triton",
]

# Programs a launch aims for. No GPU was available when this was written, so it is reasoning, not a measurement:
# an H100/H200 has 132 SMs. colnorm and merge (40-76 registers per thread) keep ~6-12 of their 4-warp programs
# resident per SM, so ~1024 programs is about one wave for them; the fused step with compact state uses 145-181
# registers per thread (ptxas for sm_90a, compiled on a CPU), so only 2-3 per SM and ~1024 programs is 3-4 waves.
# It depends on the shape only, never on the device: the per-column score sums are added in an order fixed by the
# split plan and, within a tile, by column_sums, so the same shape gives bit-identical scores from run to run and
# on every GPU.
TARGET_PROGRAMS = 1024
# Fewest rows one split streams. A split pays a fixed cost (per-column metadata loads, the bias-correction powers,
# one [BLOCK_C] partial-sum store and its re-read in add_partials_); at 256 rows x 128 columns it streams >= 64 KiB
# of gradient alone, so that fixed cost stays around 1% (reasoning, not a measurement).
MIN_ROWS_PER_SPLIT = 256
# Small matrices: fewer programs than this (two per SM of an H100/H200's 132, about what the fused step's register use
# lets an SM hold) and the rows are cut into shorter splits, down to SMALL_ROWS_PER_SPLIT, rather than leave SMs idle:
# a [2048, 2048] weight gets 256 programs of 128 rows instead of 128 programs of 256 rows. The fixed cost per split
# then rises to ~2% of its stream (same reasoning as above, no GPU measurement). Shape-only, so still reproducible.
# In a grouped launch (fused_steps_) many matrices share one grid and fill the GPU together anyway.
MIN_PROGRAMS = 264
SMALL_ROWS_PER_SPLIT = 64


def interpreting(kernel: object) -> bool:
    """Whether ``kernel`` was built by Triton's interpreter (``TRITON_INTERPRET=1`` when its module was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


# The kernels hold row and column indices and sizes in int32 (offsets go 64-bit where R*C may pass 2^31): a side must
# stay below 2^31, or a program's first row (split * rows_per_split) or column wraps negative and passes the mask.
INT32_MAX = 2**31 - 1


def check_sides(name: str, t: torch.Tensor, rows: int, cols: int, module: str) -> None:
    """Raise ``ValueError`` when a side of ``t`` (viewed as ``[rows, cols]``) is 2^31 or more."""
    if max(rows, cols) > INT32_MAX:
        raise ValueError(f"{module}: {name} of shape {tuple(t.shape)} has a side of 2^31 or more ([{rows}, {cols}]); "
                         f"the Triton kernels index rows and columns in int32: use backend='torch'")


def check_launch_device(name: str, t: torch.Tensor, kernel: object, module: str) -> None:
    """Raise ``ValueError`` unless ``kernel`` can run on ``t``'s device.

    CUDA tensors always can; CPU tensors only in Triton's interpreter, i.e. with ``TRITON_INTERPRET=1`` set in the
    environment before ``module`` was imported (the ``@triton.jit`` decorator reads it once, at import).
    """
    dev = t.device
    if dev.type == "cuda":
        return
    if dev.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"{name} is a CPU tensor ({dev}) but TRITON_INTERPRET is not '1': the Triton kernels run on CUDA "
                f"tensors, or on CPU tensors in Triton's interpreter (set TRITON_INTERPRET=1 before importing triton "
                f"and {module}); otherwise use backend='torch'"
            )
        if not interpreting(kernel):
            raise ValueError(
                f"{name} is a CPU tensor and TRITON_INTERPRET=1, but it was set after {module} was imported, so its "
                f"kernels were compiled for a GPU: set TRITON_INTERPRET=1 before importing it, or use backend='torch'"
            )
        return
    raise ValueError(
        f"{name} is on device {dev}: the Triton kernels run on CUDA tensors (or on CPU tensors with "
        f"TRITON_INTERPRET=1 set before importing triton and {module}); use backend='torch' for other devices"
    )


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device; make it ``t``'s (a tensor on cuda:1 must not launch on cuda:0)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class RowSplitPlan:
    """Grid of a column-block x row-split launch: ``grid = (col_blocks, splits)``; split s owns rows
    ``[s * rows_per_split, (s + 1) * rows_per_split)``."""

    col_blocks: int
    splits: int
    rows_per_split: int

    @property
    def grid(self) -> tuple[int, int]:
        return (self.col_blocks, self.splits)


def _check_block(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 1, got {value!r}")


def plan_row_splits(
    rows: int, cols: int, *, block_r: int, block_c: int, rows_per_split: int | None = None
) -> RowSplitPlan:
    """Split ``rows`` so that tall and wide matrices both give about ``TARGET_PROGRAMS`` programs.

    A wide matrix has enough column blocks on its own and gets one split (scores added straight into ``score``); a
    tall one is cut into splits of at least ``MIN_ROWS_PER_SPLIT`` rows, each a multiple of ``block_r``, or of at
    least ``SMALL_ROWS_PER_SPLIT`` rows while that leaves fewer than ``MIN_PROGRAMS`` programs. The plan
    depends on the shape and block sizes only, which is what makes the score reduction order reproducible.
    ``rows_per_split`` (tests) overrides the policy; it must be a positive multiple of ``block_r``.
    """
    _check_block("block_r", block_r)
    _check_block("block_c", block_c)
    col_blocks = triton.cdiv(cols, block_c)
    if rows_per_split is None:
        wanted = triton.cdiv(TARGET_PROGRAMS, col_blocks)
        splits = max(1, min(wanted, rows // MIN_ROWS_PER_SPLIT))
        if col_blocks * splits < MIN_PROGRAMS:
            splits = max(splits, min(triton.cdiv(MIN_PROGRAMS, col_blocks), rows // SMALL_ROWS_PER_SPLIT))
        rows_per_split = triton.cdiv(triton.cdiv(rows, splits), block_r) * block_r
    elif isinstance(rows_per_split, bool) or not isinstance(rows_per_split, int) or rows_per_split < 1 or (
        rows_per_split % block_r
    ):
        raise ValueError(f"rows_per_split must be a positive multiple of block_r={block_r}, got {rows_per_split!r}")
    return RowSplitPlan(col_blocks, max(1, triton.cdiv(rows, rows_per_split)), rows_per_split)


@triton.jit
def fp32_to_bf16_bits(x):
    """fp32 -> bf16 bit pattern (uint16), rounded to nearest even exactly like torch's ``.to(torch.bfloat16)``.

    Integer arithmetic because Triton's interpreter rounds a bf16 cast toward zero (a GPU rounds to nearest even);
    this is exact in both. NaN gets its own branch (the rounding add could carry it into infinity); 0x7FC0 is the
    quiet NaN torch's scalar conversion writes.
    """
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def store_column_sums(score_ptr, partial_ptr, split, cols, col_mask, C, sums, SCORE_MODE: tl.constexpr):
    """Finish a split's per-column sums: SCORE_MODE 1 adds them into ``score`` (the only split of its columns),
    SCORE_MODE 2 writes them to row ``split`` of the ``[splits, C]`` partials that ``add_partials_`` reduces."""
    if SCORE_MODE == 1:
        old = tl.load(score_ptr + cols, mask=col_mask, other=0.0)
        tl.store(score_ptr + cols, old + sums, mask=col_mask)
    elif SCORE_MODE == 2:
        tl.store(partial_ptr + split.to(tl.int64) * C + cols, sums, mask=col_mask)


@triton.jit
def column_sums(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``x [ROWS, COLS]`` summed over its rows in a fixed pairwise order: rows (0 + 1), (2 + 3), ... then those pairs
    pairwise, down to one row (``ROWS`` a power of two, at most 1024).

    ``tl.sum(x, axis=0)`` adds in an order set by the tensor's layout (how many rows each thread holds, then a
    butterfly across threads and warps), which the compiler picks per kernel: the per-parameter and the grouped fused
    step compiled to different layouts for the same [8, 128] tile (TTGIR ``warpsPerCTA`` [4, 1] against [1, 4]), so
    their scores, and so their selections, could differ in the last bit. Here every addition is an elementwise add of
    two named halves, so the result is the same whatever the layout: in every kernel, on every GPU and in the
    interpreter (given the same tile height and split plan)."""
    t = tl.trans(x)
    for i in tl.static_range(10):
        if (ROWS >> i) > 1:
            t = tl.reshape(t, [COLS, ROWS >> (i + 1), 2])
            even, odd = tl.split(t)
            t = even + odd
    return tl.reshape(t, [COLS])


@triton.jit
def count_selected_steps(slot_ptr, col_step_ptr, cols, col_mask):
    """``col_step += 1`` on the selected columns (``slot >= 0``) among ``cols``."""
    slot = tl.load(slot_ptr + cols, mask=col_mask, other=-1)
    sel = col_mask & (slot >= 0)
    steps = tl.load(col_step_ptr + cols, mask=sel, other=0)
    tl.store(col_step_ptr + cols, steps + 1, mask=sel)


@triton.jit
def _add_partials_block(score_ptr, partial_ptr, cols, C, SPLITS):
    # Split order is fixed (0, 1, ...): this is what makes the cross-split reduction deterministic, unlike atomics.
    mask = cols < C
    ptrs = partial_ptr + cols
    total = tl.load(ptrs, mask=mask, other=0.0)
    for _ in range(1, SPLITS):
        # Advancing the (64-bit) pointers row by row: splits * C may not fit in int32.
        ptrs += C
        total += tl.load(ptrs, mask=mask, other=0.0)
    old = tl.load(score_ptr + cols, mask=mask, other=0.0)
    tl.store(score_ptr + cols, old + total, mask=mask)


@triton.jit
def _add_partials_kernel(score_ptr, partial_ptr, C, SPLITS, BLOCK: tl.constexpr):
    _add_partials_block(score_ptr, partial_ptr, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), C, SPLITS)


# Columns per program of the partial-sum reduction: it reads splits x 4 bytes per column and is tiny next to the
# main pass; 1024 columns keeps a [8192]-column reduction at 8 programs (reasoning, no GPU measurement).
ADD_PARTIALS_BLOCK = 1024


def add_partials_(score: torch.Tensor, partials: torch.Tensor) -> None:
    """``score += partials.sum(0)`` for fp32 ``partials [splits, C]``, adding the splits in order (deterministic)."""
    splits, cols = partials.shape
    grid = (triton.cdiv(cols, ADD_PARTIALS_BLOCK),)
    _add_partials_kernel[grid](score, partials, cols, splits, BLOCK=ADD_PARTIALS_BLOCK, num_warps=4,
                                  enable_fp_fusion=False)


@triton.jit
def _finish_steps_kernel(score_ptr, partial_ptr, slot_ptr, col_step_ptr, C, SPLITS, ADD_SCORES: tl.constexpr,
                         COUNT_STEPS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if ADD_SCORES:
        _add_partials_block(score_ptr, partial_ptr, cols, C, SPLITS)
    if COUNT_STEPS:
        count_selected_steps(slot_ptr, col_step_ptr, cols, cols < C)


def finish_steps_(score: torch.Tensor, partials: torch.Tensor | None, slot: torch.Tensor,
                  col_step: torch.Tensor | None) -> None:
    """After a fused step whose rows were split: ``score += partials.sum(0)`` (splits in order) unless ``partials`` is
    None, and ``col_step += 1`` on the selected columns unless ``col_step`` is None (the step's programs all read the
    counts, so none of them may write them)."""
    cols = score.shape[0]
    grid = (triton.cdiv(cols, ADD_PARTIALS_BLOCK),)
    _finish_steps_kernel[grid](score, score if partials is None else partials, slot,
                               slot if col_step is None else col_step, cols,
                               1 if partials is None else partials.shape[0], ADD_SCORES=partials is not None,
                               COUNT_STEPS=col_step is not None, BLOCK=ADD_PARTIALS_BLOCK, num_warps=4,
                               enable_fp_fusion=False)


# One row of the grouped finishing launch's table (int64): the call's first program, then the addresses of score,
# partials, slot and col_step, C, splits, flags (bit 0: add the partials into score, bit 1: count the selected steps).
FINISH_FIELDS = 8
FINISH_ADD_SCORES, FINISH_COUNT_STEPS = 1, 2


@triton.jit
def _finish_steps_grouped_kernel(table_ptr, n_calls, BLOCK: tl.constexpr):
    # _finish_steps_kernel for each row of the table: the same block functions, so the same sums bit for bit.
    pid = tl.program_id(0)
    lo = pid * 0
    hi = lo + n_calls
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(table_ptr + mid.to(tl.int64) * 8) <= pid:
            lo = mid
        else:
            hi = mid
    row = table_ptr + lo.to(tl.int64) * 8
    score_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    partial_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    slot_ptr = tl.load(row + 3).to(tl.pointer_type(tl.int32))
    col_step_ptr = tl.load(row + 4).to(tl.pointer_type(tl.int32))
    C = tl.load(row + 5).to(tl.int32)
    SPLITS = tl.load(row + 6).to(tl.int32)
    flags = tl.load(row + 7).to(tl.int32)
    cols = (pid - tl.load(row).to(tl.int32)) * BLOCK + tl.arange(0, BLOCK)
    if (flags & 1) != 0:
        _add_partials_block(score_ptr, partial_ptr, cols, C, SPLITS)
    if (flags & 2) != 0:
        count_selected_steps(slot_ptr, col_step_ptr, cols, cols < C)


def finish_steps_grouped_(table: torch.Tensor, n_calls: int, programs: int) -> None:
    """``finish_steps_`` for ``n_calls`` calls in one launch. ``table``: int64 ``[n_calls, FINISH_FIELDS]`` rows (see
    ``FINISH_FIELDS``), first programs increasing, each call owning ``cdiv(C, ADD_PARTIALS_BLOCK)`` programs;
    ``programs`` in all. Used by ``fused_steps_``."""
    _finish_steps_grouped_kernel[(programs,)](table, n_calls, BLOCK=ADD_PARTIALS_BLOCK, num_warps=4,
                                              enable_fp_fusion=False)


@triton.jit
def bias_corrections(steps, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo, BLOCK_C: tl.constexpr):
    """The fused steps' per-column Adam bias corrections, ``(step_size, bc2_sqrt)``."""
    # Per column, in fp64 and then rounded to fp32, as the reference does: step_size = lr / (1 - beta1^s) and
    # bc2_sqrt = sqrt(1 - beta2^s). fp32 would lose ~1e-5 relative to cancellation in 1 - beta2^s at small s.
    # beta^s by binary powering (fp64 multiplies only, so it lowers the same on every GPU and in the interpreter);
    # the loop runs bit_length(max step) times.
    lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
    base1 = tl.zeros([BLOCK_C], dtype=tl.float64) + (tl.cast(beta1_hi, tl.float64) + tl.cast(beta1_lo, tl.float64))
    base2 = tl.zeros([BLOCK_C], dtype=tl.float64) + (tl.cast(beta2_hi, tl.float64) + tl.cast(beta2_lo, tl.float64))
    pow1 = tl.full([BLOCK_C], 1.0, dtype=tl.float64)
    pow2 = tl.full([BLOCK_C], 1.0, dtype=tl.float64)
    e = steps
    # The loop bound is reduced once, not once per iteration: on a GPU each tl.max is a cross-warp reduction (shared
    # memory + barrier, ~17 of them at step ~1e5). x -> x >> 1 is monotone, so max(e >> i) == max(e) >> i and the
    # loop runs exactly as many times as `while tl.max(e, axis=0) > 0` would: same results, bit for bit.
    e_max = tl.max(e, axis=0)
    while e_max > 0:
        odd = (e & 1) != 0
        pow1 = tl.where(odd, pow1 * base1, pow1)
        pow2 = tl.where(odd, pow2 * base2, pow2)
        base1 = base1 * base1
        base2 = base2 * base2
        e = e >> 1
        e_max = e_max >> 1
    step_size = (lr / (1.0 - pow1)).to(tl.float32)
    bc2_sqrt = tl.sqrt(1.0 - pow2).to(tl.float32)
    return step_size, bc2_sqrt


@triton.jit
def load_steps(col_step_ptr, cols, sel, COUNT):
    """The fused steps' per-column step counts for this update."""
    # This update's per-column step counts: col_step as stored ("already incremented"), or col_step + 1 when this
    # call counts the step itself. Unselected lanes get step 1, not 0: keeps 1 - beta^s away from 0 (no inf/NaN on
    # lanes that are masked anyway).
    if COUNT:
        return tl.load(col_step_ptr + cols, mask=sel, other=0) + 1
    return tl.load(col_step_ptr + cols, mask=sel, other=1)


@triton.jit
def adam_columns(p, m, v, g, step_size, bc2_sqrt, decay, weight_decay, lerp_small, lerp_w, lerp_w_rest, beta2,
                 beta2_rest, eps, DECOUPLED: tl.constexpr):
    """The fused steps' AdamW on a tile of selected elements: the new ``(master, exp_avg, exp_avg_sq)``.

    Op for op as reference.adam_update_ (torch.optim.AdamW, single tensor): same operations, same order, IEEE
    division and square root (Triton's plain fp32 '/' and sqrt are approximate on GPUs). ``step_size`` and
    ``bc2_sqrt`` are per column (:func:`bias_corrections`)."""
    if DECOUPLED:
        p = p * decay
    else:
        g = g + weight_decay * p
    m = tl.where(lerp_small, m + lerp_w * (g - m), g - (g - m) * lerp_w_rest)
    v = v * beta2 + beta2_rest * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt[None, :]) + eps
    p = p - tl.div_rn(m * step_size[None, :], denom)  # reference: param.sub_(m.mul(step_size).div_(denom))
    return p, m, v


@triton.jit
def adam_tile(master_ptr, exp_avg_ptr, exp_avg_sq_ptr, param_ptr, st_offs, p_offs, mask, g, step_size, bc2_sqrt,
              decay, weight_decay, lerp_small, lerp_w, lerp_w_rest, beta2, beta2_rest, eps, DECOUPLED: tl.constexpr,
              PARAM_BITS: tl.constexpr):
    """The fused steps' AdamW on a tile of selected elements: the compact state at ``st_offs`` read, updated
    (:func:`adam_columns`, per-column ``step_size`` and ``bc2_sqrt``) and written, and the param at ``p_offs`` written
    from the new master (PARAM_BITS: ``param_ptr`` is a uint16 view of a bf16 param, rounded as torch rounds)."""
    p = tl.load(master_ptr + st_offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + st_offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + st_offs, mask=mask, other=1.0)
    p, m, v = adam_columns(p, m, v, g, step_size, bc2_sqrt, decay, weight_decay, lerp_small, lerp_w, lerp_w_rest,
                           beta2, beta2_rest, eps, DECOUPLED)
    tl.store(master_ptr + st_offs, p, mask=mask)
    tl.store(exp_avg_ptr + st_offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + st_offs, v, mask=mask)
    if PARAM_BITS:
        tl.store(param_ptr + p_offs, fp32_to_bf16_bits(p), mask=mask)
    else:
        tl.store(param_ptr + p_offs, p.to(param_ptr.dtype.element_ty), mask=mask)


@triton.jit
def compact_columns(sel, cols, slot_i, steps, BLOCK_K: tl.constexpr):
    """The selected columns of a column block, packed: ``(n_sel, mask, column, slot, step count)`` of the first
    ``BLOCK_K`` of them in column order (a prefix sum over ``sel`` ranks them), for the fused steps' compact Adam:
    a [rows, BLOCK_K] sub-tile instead of the whole [rows, BLOCK_C] one, where at r = 0.1 nine lanes in ten would
    compute Adam for nothing. Lanes past ``n_sel`` get column 0, slot 0 and step 1 (masked anyway). Exact integer
    sums: each lane picks one column's values."""
    n_sel = tl.sum(sel.to(tl.int32), axis=0)
    rank = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    kk = tl.arange(0, BLOCK_K)
    match = sel[None, :] & (rank[None, :] == kk[:, None])
    c_mask = kk < n_sel
    c_col = tl.sum(tl.where(match, cols[None, :], 0), axis=1)
    c_slot = tl.sum(tl.where(match, slot_i[None, :], 0), axis=1)
    c_steps = tl.where(c_mask, tl.sum(tl.where(match, steps[None, :], 0), axis=1), 1)
    return n_sel, c_mask, c_col, c_slot, c_steps


def compact_block(share: float, block_c: int) -> int:
    """``BLOCK_K`` for calls that select ``share`` of their columns (``k / C``, the largest of a launch's): the
    smallest power of two (16 at least, half of ``block_c`` at most) that holds twice a column block's expected
    selection, so blocks rarely overflow it; one that does takes the whole-tile path (same results, more work)."""
    want = triton.next_power_of_2(max(1, math.ceil(2 * block_c * min(max(share, 0.0), 1.0))))
    return min(max(16, want), max(16, block_c // 2))


@triton.jit
def stream_tile(grad_ptr, acc_ptr, sq, r, row0, R, C, cols, col_mask, unsel, accumulate, HAS_ACC: tl.constexpr,
                WIDE: tl.constexpr, BLOCK_R: tl.constexpr):
    """One [BLOCK_R, BLOCK_C] tile of the fused steps' streaming loop, Adam aside: the gradient read once, its squares
    added into ``sq`` (the scores), and ``acc`` updated on the unselected columns. ``accumulate``: the whole tile read
    and written, its selected columns written back as read (128-bit accesses, where a per-column mask made them 8
    scalar ones a thread, 32 bytes apart across a warp; nearly every 32-byte sector holds an unselected column, so
    DRAM moves hardly more); else (a window's first step: acc may hold anything) its unselected columns written.
    Returns ``(rows, row_mask, offs, g, sq)``."""
    rows = row0 + r + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    if WIDE:
        rows = rows.to(tl.int64)  # R*C (and R*K) pass 2^31
    offs = rows[:, None] * C + cols[None, :]
    tile_mask = row_mask[:, None] & col_mask[None, :]
    g = tl.load(grad_ptr + offs, mask=tile_mask, other=0.0).to(tl.float32)
    sq += g * g
    if HAS_ACC:
        if accumulate:
            old = tl.load(acc_ptr + offs, mask=tile_mask, other=0.0)
            tl.store(acc_ptr + offs, tl.where(unsel[None, :], old + g, old), mask=tile_mask)
        else:
            tl.store(acc_ptr + offs, g, mask=row_mask[:, None] & unsel[None, :])
    return rows, row_mask, offs, g, sq


@triton.jit
def packed_adam(grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, param_ptr, rows, row_mask, C, K, c_mask, c_col,
                c_slot, c_size, c_bc2, decay, weight_decay, lerp_small, lerp_w, lerp_w_rest, beta2, beta2_rest, eps,
                DECOUPLED: tl.constexpr, PARAM_BITS: tl.constexpr):
    """:func:`adam_tile` on a block's selected columns packed (:func:`compact_columns`): their gradient re-read (the
    tile just loaded it: L1), their state and param at their slots and columns, masked past the block's count."""
    c_m2 = row_mask[:, None] & c_mask[None, :]
    c_offs = rows[:, None] * C + c_col[None, :]
    gc = tl.load(grad_ptr + c_offs, mask=c_m2, other=0.0).to(tl.float32)
    adam_tile(master_ptr, exp_avg_ptr, exp_avg_sq_ptr, param_ptr, rows[:, None] * K + c_slot[None, :], c_offs, c_m2,
              gc, c_size, c_bc2, decay, weight_decay, lerp_small, lerp_w, lerp_w_rest, beta2, beta2_rest, eps,
              DECOUPLED, PARAM_BITS)
