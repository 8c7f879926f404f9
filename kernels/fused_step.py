"""Triton: one pass over a gradient for the device side of a ZenFlow step (DESIGN §3, §4, §6).

Per gradient element read once: (a) per-column squared norms into ``score``, (b) AdamW on the selected columns
against the compact fp32 state addressed through ``slot``, result written into the model param in its own dtype,
(c) ``acc`` overwrite-or-add on the unselected columns. Semantics: ``reference.fused_step_``.

Two launchers: ``fused_step_`` for one parameter, ``fused_steps_`` for many at once (one launch per parameter dtype,
the calls' tensors reached through a table of addresses), with bit-identical results.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ._checks import check_fused_step_args, check_slot_range
from ._triton_utils import (
    ADD_PARTIALS_BLOCK,
    RowSplitPlan,
    add_partials_,
    add_partials_grouped_,
    check_launch_device,
    device_guard,
    fp32_to_bf16_bits,
    interpreting,
    plan_row_splits,
    store_column_sums,
    tl,
    triton,
)
from .hyperparams import AdamHyperparams, require_hyperparams

if TYPE_CHECKING:  # device_ops imports the backends lazily; no cycle at run time
    from .step_args import FusedStepArgs

__all__ = ["fused_step_", "fused_steps_"]

# Tile on CUDA. No GPU was available to measure, so this is reasoning, to be replaced by a measurement: a tile of
# 8 x 128 with 4 warps is 8 elements per thread of each of grad, acc, master, m, v plus their 64-bit offsets.
# Compiled for sm_90a on a CPU (triton 3.9 + its ptxas, no GPU), the variants with compact state (k > 0) use 140-184
# registers per thread, no spills; without state 21-56. So 2-3 resident programs per SM, not the ~6 first assumed:
# ~20 registers per element in flight, and 8 x 128 with 8 warps or 4 x 128 with 4 warps (106-112 registers, half the
# elements per thread) keep the same ~20 per element, so they put no more bytes in flight; 16 x 128 reaches 255.
# In flight per program: 1024 elements of grad + acc (6-8 KiB) and, on selected columns, up to 12 KiB of compact
# state; at 2-3 programs per SM that is ~15-25 KiB per SM, about (not well above) the ~20 KiB per SM Little's law
# asks of an H100/H200 (~3.4-4.8 TB/s x ~0.7 us / 132 SMs). Measure before tuning.
# 128 columns = 256-512 contiguous bytes per row: whole 128-byte lines. Fixed, never autotuned: BLOCK_R sets the
# score summation order, and scores must be bitwise reproducible from run to run (resume must continue bit for bit).
_BLOCK_R = 8
_BLOCK_C = 128
_NUM_WARPS = 4
# Under the interpreter each tl op costs ~0.3 ms whatever the tile size (measured here: 2-core CPU, triton 3.9),
# so fewer, taller tiles are what makes it fast.
_INTERP_BLOCK_R = 64


def _f32(x: float) -> float:
    """x rounded to fp32 (nearest even), as a Python float; torch rounds a scalar the same way before fp32 math."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _split(x: float) -> tuple[float, float]:
    """x as hi + lo, two fp32 values: the kernel rebuilds ~48 bits of the double (a float kernel argument is fp32)."""
    hi = _f32(x)
    return hi, _f32(x - hi)


@functools.lru_cache(maxsize=64)
def _scalars(hp: AdamHyperparams) -> tuple[float, ...]:
    """The kernel's 13 float arguments for ``hp``: lr, beta1, beta2 as hi + lo pairs, then decay, weight_decay,
    lerp_w, 1 - lerp_w, beta2, 1 - beta2, eps, each rounded to fp32.

    Scalars the reference rounds to fp32 before fp32 math are rounded here, once, so that the GPU and the interpreter
    (which keeps Python floats as doubles) see the same values; the three the reference uses in fp64 (bias
    corrections) travel as hi + lo fp32 pairs. Cached: a step's parameters share a few records.
    """
    lr, beta1, beta2 = float(hp.lr), float(hp.beta1), float(hp.beta2)
    eps, weight_decay = float(hp.eps), float(hp.weight_decay)
    lerp_w = _f32(1.0 - beta1)
    return (*_split(lr), *_split(beta1), *_split(beta2), _f32(1.0 - lr * weight_decay), _f32(weight_decay), lerp_w,
            _f32(1.0 - lerp_w), _f32(beta2), _f32(1.0 - beta2), _f32(eps))


@triton.jit
def _bias_corrections(steps, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo, BLOCK_C: tl.constexpr):
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
def _fused_step_kernel(
    param_ptr, grad_ptr, score_ptr, partial_ptr, slot_ptr, col_step_ptr,
    master_ptr, exp_avg_ptr, exp_avg_sq_ptr, acc_ptr,
    R, C, K, rows_per_split,
    lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo,
    decay, weight_decay, lerp_w, lerp_w_rest, beta2, beta2_rest, eps,
    SCORE_MODE: tl.constexpr, ACCUMULATE: tl.constexpr, DECOUPLED: tl.constexpr, HAS_STATE: tl.constexpr,
    PARAM_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # Grid: (column blocks, row splits); each program streams its rows [row0, row0 + rows_per_split) in BLOCK_R tiles.
    pid_c = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    slot = tl.load(slot_ptr + cols, mask=col_mask, other=-1)
    unsel = col_mask & (slot < 0)
    row0 = split * rows_per_split
    n_rows = tl.minimum(rows_per_split, R - row0)
    if SCORE_MODE != 0:
        sq = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    if HAS_STATE:
        sel = col_mask & (slot >= 0)
        # Unselected lanes get step 1, not 0: keeps 1 - beta^s away from 0 (no inf/NaN on lanes that are masked anyway).
        steps = tl.load(col_step_ptr + cols, mask=sel, other=1)
        step_size, bc2_sqrt = _bias_corrections(steps, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo, BLOCK_C)
        slot64 = tl.where(sel, slot, 0).to(tl.int64)
        # torch's lerp switches formula at weight 0.5 for accuracy; same switch here.
        lerp_small = lerp_w < 0.5
    for r in range(0, n_rows, BLOCK_R):
        rows = row0 + r + tl.arange(0, BLOCK_R)
        row_mask = rows < R
        rows64 = rows.to(tl.int64)  # R*C (and R*K) may pass 2^31
        offs = rows64[:, None] * C + cols[None, :]
        g = tl.load(grad_ptr + offs, mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        if SCORE_MODE != 0:
            sq += g * g
        # acc only on unselected columns: its selected columns carry no meaning, so skipping them saves bandwidth.
        acc_mask = row_mask[:, None] & unsel[None, :]
        if ACCUMULATE:
            a = tl.load(acc_ptr + offs, mask=acc_mask, other=0.0) + g
        else:
            a = g  # first step of a window: acc is not read (it may hold anything)
        tl.store(acc_ptr + offs, a, mask=acc_mask)
        if HAS_STATE:
            st_mask = row_mask[:, None] & sel[None, :]
            st_offs = rows64[:, None] * K + slot64[None, :]
            p = tl.load(master_ptr + st_offs, mask=st_mask, other=0.0)
            m = tl.load(exp_avg_ptr + st_offs, mask=st_mask, other=0.0)
            v = tl.load(exp_avg_sq_ptr + st_offs, mask=st_mask, other=1.0)
            # Op for op as reference.adam_update_ (torch.optim.AdamW, single tensor): same operations, same order,
            # IEEE division and square root (Triton's plain fp32 '/' and sqrt are approximate on GPUs).
            if DECOUPLED:
                p = p * decay
            else:
                g = g + weight_decay * p
            m = tl.where(lerp_small, m + lerp_w * (g - m), g - (g - m) * lerp_w_rest)
            v = v * beta2 + beta2_rest * g * g
            denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt[None, :]) + eps
            p = p - tl.div_rn(m * step_size[None, :], denom)  # reference: param.sub_(m.mul(step_size).div_(denom))
            tl.store(master_ptr + st_offs, p, mask=st_mask)
            tl.store(exp_avg_ptr + st_offs, m, mask=st_mask)
            tl.store(exp_avg_sq_ptr + st_offs, v, mask=st_mask)
            if PARAM_BF16:
                tl.store(param_ptr + offs, fp32_to_bf16_bits(p), mask=st_mask)  # param_ptr is a uint16 view
            else:
                tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=st_mask)
    if SCORE_MODE != 0:
        store_column_sums(score_ptr, partial_ptr, split, cols, col_mask, C, tl.sum(sq, axis=0), SCORE_MODE)


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
    acc: torch.Tensor,
    hp: AdamHyperparams,
    accumulate: bool,
    update_score: bool = True,
    check_slots: bool = False,
    _block_r: int | None = None,
    _block_c: int | None = None,
    _rows_per_split: int | None = None,
) -> None:
    """One pass over ``grad [R, C]``, in place; same arguments and meaning as ``reference.fused_step_``.

    (a) if ``update_score``: ``score += colsumsq(grad)``;
    (b) selected columns (``slot >= 0``): AdamW on the compact fp32 ``master``/``exp_avg``/``exp_avg_sq [R, k]``
        with bias correction from ``col_step`` (already incremented; read, never written); the result is written
        into ``param`` in its own dtype (bf16 and fp16 rounded to nearest even);
    (c) unselected columns: ``acc = grad`` (``accumulate=False``) or ``acc += grad``. Selected columns of ``acc``
        are not written, and nothing of ``param``/compact state outside the selected columns is touched.
    Tensors are CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``), contiguous, checked like the reference.
    Selected slots must be distinct and in ``[0, k)``; ``check_slots=True`` verifies the range (a device sync),
    otherwise a bad slot is an out-of-bounds access. Hyperparameters are runtime scalars: changing them never
    recompiles. Deterministic: identical inputs give bit-identical outputs (no atomics, fixed summation order).
    The underscored keywords override block sizes and the row split (tests only).
    """
    rows, cols, k = check_fused_step_args(
        param, grad, score=score, slot=slot, col_step=col_step, master=master, exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq, acc=acc,
    )
    require_hyperparams(hp)
    check_launch_device("param", param, _fused_step_kernel, __name__)
    if check_slots:
        check_slot_range(slot, k)
    if rows == 0 or cols == 0:
        return
    block_r = _block_r or (_INTERP_BLOCK_R if interpreting(_fused_step_kernel) else _BLOCK_R)
    block_c = _block_c or _BLOCK_C
    if _rows_per_split is None:
        plan = _plan(rows, cols, block_r, block_c)
    else:
        plan = plan_row_splits(rows, cols, block_r=block_r, block_c=block_c, rows_per_split=_rows_per_split)
    partials = None
    if update_score and plan.splits > 1:
        partials = torch.empty((plan.splits, cols), dtype=torch.float32, device=param.device)
    score_mode = 0 if not update_score else (1 if partials is None else 2)

    param_bits = param.view(torch.uint16) if param.dtype == torch.bfloat16 else param
    with device_guard(param):
        _fused_step_kernel[plan.grid](
            param_bits, grad, score, score if partials is None else partials, slot, col_step,
            master, exp_avg, exp_avg_sq, acc,
            rows, cols, k, plan.rows_per_split,
            *_scalars(hp),
            SCORE_MODE=score_mode, ACCUMULATE=bool(accumulate), DECOUPLED=hp.decoupled, HAS_STATE=k > 0,
            PARAM_BF16=param.dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_C=block_c,
            # No FMA contraction: the GPU then does the same IEEE operations as the interpreter, and results do not
            # change with Triton's default (which flips in 3.10).
            num_warps=_NUM_WARPS, enable_fp_fusion=False,
        )
        if partials is not None:
            add_partials_(score, partials)


# ---------------------------------------------------------------------------------------------- many parameters

# One row of the grouped launch's call table (int64), in this order (the kernel reads the fields by these positions):
#   0 the call's first program in the launch's 1-D grid (rows in increasing order of it)
#   1-10 the addresses of param, grad, score, partials (score's own when unused), slot, col_step, master, exp_avg,
#        exp_avg_sq, acc
#   11-16 R, C, k, rows per split, column blocks, flags
#   17-29 the 13 float scalars of _scalars(hp), as fp32 bit patterns
_FIELDS = 32  # 30 used; a power of two keeps a row on aligned 256-byte boundaries
# Flags: bits 0-1 the score mode (0 none, 1 straight into score, 2 into the partials), bit 2 accumulate, bit 3 AdamW's
# decoupled decay.
_ACCUMULATE, _DECOUPLED = 4, 8
# The param dtypes as the kernel's PARAM_KIND.
_PARAM_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# A row index or size must stay below 2^31: the kernel holds them as int32 (offsets are computed in int64).
_INT32_MAX = 2**31 - 1


@triton.jit
def _table_f32(row, field):
    return tl.load(row + field).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _find_call(table_ptr, n_calls, pid, FIELDS: tl.constexpr):
    """The call a program belongs to: binary search of the calls' first programs (column 0, increasing)."""
    lo = pid * 0
    hi = lo + n_calls
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(table_ptr + mid.to(tl.int64) * FIELDS) <= pid:
            lo = mid
        else:
            hi = mid
    return table_ptr + lo.to(tl.int64) * FIELDS


@triton.jit
def _fused_steps_kernel(
    table_ptr, n_calls,
    PARAM_KIND: tl.constexpr, FIELDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # _fused_step_kernel for every call of the table, each over its own (column blocks x row splits) programs of this
    # 1-D grid. What were constexprs there (score mode, accumulate, decoupled, whether there is compact state) are
    # per-call values here; each branch does the same operations in the same order, so results are bit-identical.
    pid = tl.program_id(0)
    row = _find_call(table_ptr, n_calls, pid, FIELDS)
    if PARAM_KIND == 1:  # bf16: written as bits (uint16), see fp32_to_bf16_bits
        param_ptr = tl.load(row + 1).to(tl.pointer_type(tl.uint16))
        grad_ptr = tl.load(row + 2).to(tl.pointer_type(tl.bfloat16))
    elif PARAM_KIND == 2:
        param_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float16))
        grad_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float16))
    else:
        param_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        grad_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    score_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    partial_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    slot_ptr = tl.load(row + 5).to(tl.pointer_type(tl.int32))
    col_step_ptr = tl.load(row + 6).to(tl.pointer_type(tl.int32))
    master_ptr = tl.load(row + 7).to(tl.pointer_type(tl.float32))
    exp_avg_ptr = tl.load(row + 8).to(tl.pointer_type(tl.float32))
    exp_avg_sq_ptr = tl.load(row + 9).to(tl.pointer_type(tl.float32))
    acc_ptr = tl.load(row + 10).to(tl.pointer_type(tl.float32))
    R = tl.load(row + 11).to(tl.int32)
    C = tl.load(row + 12).to(tl.int32)
    K = tl.load(row + 13).to(tl.int32)
    rows_per_split = tl.load(row + 14).to(tl.int32)
    col_blocks = tl.load(row + 15).to(tl.int32)
    flags = tl.load(row + 16).to(tl.int32)
    score_mode = flags & 3
    accumulate = (flags & 4) != 0
    decoupled = (flags & 8) != 0
    lr_hi = _table_f32(row, 17)
    lr_lo = _table_f32(row, 18)
    beta1_hi = _table_f32(row, 19)
    beta1_lo = _table_f32(row, 20)
    beta2_hi = _table_f32(row, 21)
    beta2_lo = _table_f32(row, 22)
    decay = _table_f32(row, 23)
    weight_decay = _table_f32(row, 24)
    lerp_w = _table_f32(row, 25)
    lerp_w_rest = _table_f32(row, 26)
    beta2 = _table_f32(row, 27)
    beta2_rest = _table_f32(row, 28)
    eps = _table_f32(row, 29)

    local = pid - tl.load(row).to(tl.int32)
    pid_c = local % col_blocks
    split = local // col_blocks
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    slot = tl.load(slot_ptr + cols, mask=col_mask, other=-1)
    unsel = col_mask & (slot < 0)
    row0 = split * rows_per_split
    n_rows = tl.minimum(rows_per_split, R - row0)
    sq = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    # Without compact state (K = 0) every slot is -1, so `sel` is empty and the state code below is skipped.
    sel = col_mask & (slot >= 0)
    any_sel = (tl.max(sel.to(tl.int32), axis=0) > 0) & (K > 0)
    steps = tl.load(col_step_ptr + cols, mask=sel, other=1)
    step_size, bc2_sqrt = _bias_corrections(steps, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo, BLOCK_C)
    slot64 = tl.where(sel, slot, 0).to(tl.int64)
    lerp_small = lerp_w < 0.5
    for r in range(0, n_rows, BLOCK_R):
        rows = row0 + r + tl.arange(0, BLOCK_R)
        row_mask = rows < R
        rows64 = rows.to(tl.int64)
        offs = rows64[:, None] * C + cols[None, :]
        g = tl.load(grad_ptr + offs, mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        sq += g * g
        acc_mask = row_mask[:, None] & unsel[None, :]
        # (tl.where, not acc_mask & accumulate: the interpreter cannot mask with a tensor & scalar of bools)
        a = tl.load(acc_ptr + offs, mask=tl.where(accumulate, acc_mask, False), other=0.0) + g
        a = tl.where(accumulate, a, g)  # not 0 + g: that would turn -0.0 into +0.0
        tl.store(acc_ptr + offs, a, mask=acc_mask)
        if any_sel:
            st_mask = row_mask[:, None] & sel[None, :]
            st_offs = rows64[:, None] * K + slot64[None, :]
            p = tl.load(master_ptr + st_offs, mask=st_mask, other=0.0)
            m = tl.load(exp_avg_ptr + st_offs, mask=st_mask, other=0.0)
            v = tl.load(exp_avg_sq_ptr + st_offs, mask=st_mask, other=1.0)
            g = tl.where(decoupled, g, g + weight_decay * p)
            p = tl.where(decoupled, p * decay, p)
            m = tl.where(lerp_small, m + lerp_w * (g - m), g - (g - m) * lerp_w_rest)
            v = v * beta2 + beta2_rest * g * g
            denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt[None, :]) + eps
            p = p - tl.div_rn(m * step_size[None, :], denom)
            tl.store(master_ptr + st_offs, p, mask=st_mask)
            tl.store(exp_avg_ptr + st_offs, m, mask=st_mask)
            tl.store(exp_avg_sq_ptr + st_offs, v, mask=st_mask)
            if PARAM_KIND == 1:
                tl.store(param_ptr + offs, fp32_to_bf16_bits(p), mask=st_mask)
            else:
                tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=st_mask)
    sums = tl.sum(sq, axis=0)
    if score_mode == 1:
        old = tl.load(score_ptr + cols, mask=col_mask, other=0.0)
        tl.store(score_ptr + cols, old + sums, mask=col_mask)
    elif score_mode == 2:
        tl.store(partial_ptr + split.to(tl.int64) * C + cols, sums, mask=col_mask)


@functools.lru_cache(maxsize=1024)
def _plan(rows: int, cols: int, block_r: int, block_c: int) -> RowSplitPlan:
    """The split plan of a shape (the same as fused_step_'s, which is what makes the scores bit-identical)."""
    return plan_row_splits(rows, cols, block_r=block_r, block_c=block_c)


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


@functools.lru_cache(maxsize=64)
def _scalar_bits(hp: AdamHyperparams) -> tuple[int, ...]:
    return tuple(_f32_bits(x) for x in _scalars(hp))


def _quick_check(c: FusedStepArgs, device: torch.device) -> tuple[int, int, int] | None:
    """(R, C, k) when every tensor of the call has the dtype, shape, device and layout the kernel needs, else None
    (the caller then runs the full check, which raises the error that says what is wrong). The checks of
    ``check_fused_step_args`` with the fewest attribute reads (~5 us per call instead of ~18); anything unexpected
    (not a tensor, a sparse one) raises here and is left to the full check too."""
    try:
        p, m = c.param, c.master
        dtype, shape, mshape = p.dtype, p.shape, m.shape
        if len(shape) != 2 or len(mshape) != 2 or dtype not in _PARAM_KIND:
            return None
        rows, cols = shape
        if mshape[0] != rows or mshape[1] > cols or rows > _INT32_MAX or cols > _INT32_MAX:
            return None
        vec = (cols,)
        f32, i32 = torch.float32, torch.int32
        for t, want_dtype, want in ((p, dtype, shape), (c.grad, dtype, shape), (c.acc, f32, shape),
                                    (c.score, f32, vec), (c.slot, i32, vec), (c.col_step, i32, vec), (m, f32, mshape),
                                    (c.exp_avg, f32, mshape), (c.exp_avg_sq, f32, mshape)):
            # is_contiguous() is False for strided tensors that are not, and raises for sparse ones.
            if t.dtype != want_dtype or t.shape != want or not t.is_contiguous() or t.device != device:
                return None
        if type(c.hp) is not AdamHyperparams:
            return None
    except Exception:  # noqa: BLE001 - the full check says what is wrong
        return None
    return rows, cols, mshape[1]


def fused_steps_(
    calls: Sequence[FusedStepArgs],
    *,
    _block_r: int | None = None,
    _block_c: int | None = None,
) -> None:
    """``fused_step_`` for every call, bit-identical to calling it for each in turn, in one launch per parameter dtype
    (plus one more for the scores of matrices tall enough to split their rows).

    Each call keeps its own split plan, tile and summation order; the launch covers all of their programs, so many
    small matrices fill the GPU together where each alone would leave SMs idle, and the per-call Python cost is
    the table row and a lean check (the launch cost is paid once). Calls must not share a tensor that one of them
    writes. Tensors are CUDA tensors on one device (or CPU tensors under ``TRITON_INTERPRET=1``), checked like
    ``fused_step_``'s. The underscored keywords override block sizes (tests only).
    """
    if not calls:
        return
    first = calls[0].param
    device = first.device if isinstance(first, torch.Tensor) else None
    groups: dict[torch.dtype, list[tuple[FusedStepArgs, int, int, int]]] = {}
    for c in calls:
        shape = _quick_check(c, device)
        if shape is None:
            shape = check_fused_step_args(c.param, c.grad, score=c.score, slot=c.slot, col_step=c.col_step,
                                          master=c.master, exp_avg=c.exp_avg, exp_avg_sq=c.exp_avg_sq, acc=c.acc)
            require_hyperparams(c.hp)
            if c.param.device != device:
                raise ValueError(f"fused_steps_: every call must be on one device; param is on {c.param.device}, "
                                 f"the first call's on {device}")
            if max(shape[:2]) > _INT32_MAX:
                raise ValueError(f"fused_steps_: a matrix side must stay below 2^31, got shape {shape[:2]}")
        if shape[0] and shape[1]:
            groups.setdefault(c.param.dtype, []).append((c, *shape))
    if not groups:
        return
    check_launch_device("param", first, _fused_steps_kernel, __name__)
    interp = interpreting(_fused_steps_kernel)
    block_r = _block_r or (_INTERP_BLOCK_R if interp else _BLOCK_R)
    block_c = _block_c or _BLOCK_C
    with device_guard(first):
        for dtype, items in groups.items():
            _launch_group(dtype, items, device, block_r, block_c)


def _launch_group(dtype: torch.dtype, items: list[tuple[FusedStepArgs, int, int, int]], device: torch.device,
                  block_r: int, block_c: int) -> None:
    plans = [_plan(rows, cols, block_r, block_c) for _, rows, cols, _ in items]
    partial_offsets, n_partial = [], 0
    for (c, _, cols, _), plan in zip(items, plans):
        split_scores = c.update_score and plan.splits > 1
        partial_offsets.append(n_partial if split_scores else -1)
        n_partial += plan.splits * cols if split_scores else 0
    partials = torch.empty(n_partial, dtype=torch.float32, device=device) if n_partial else None
    base = partials.data_ptr() if partials is not None else 0
    table: list[int] = []
    sums: list[int] = []  # the add-partials launch's table: first program, score, partials, C, splits
    program = sum_program = 0
    for (c, rows, cols, k), plan, offset in zip(items, plans, partial_offsets):
        mode = 0 if not c.update_score else (1 if offset < 0 else 2)
        partial = base + 4 * offset if offset >= 0 else c.score.data_ptr()
        flags = mode | (_ACCUMULATE if c.accumulate else 0) | (_DECOUPLED if c.hp.decoupled else 0)
        table += (program, c.param.data_ptr(), c.grad.data_ptr(), c.score.data_ptr(), partial, c.slot.data_ptr(),
                  c.col_step.data_ptr(), c.master.data_ptr(), c.exp_avg.data_ptr(), c.exp_avg_sq.data_ptr(),
                  c.acc.data_ptr(), rows, cols, k, plan.rows_per_split, plan.col_blocks, flags,
                  *_scalar_bits(c.hp), 0, 0)
        program += plan.col_blocks * plan.splits
        if mode == 2:
            sums += (sum_program, c.score.data_ptr(), partial, cols, plan.splits)
            sum_program += triton.cdiv(cols, ADD_PARTIALS_BLOCK)
    table_dev = _to_device(table, device)
    _fused_steps_kernel[(program,)](
        table_dev, len(items),
        PARAM_KIND=_PARAM_KIND[dtype], FIELDS=_FIELDS, BLOCK_R=block_r, BLOCK_C=block_c,
        # As fused_step_: no FMA contraction, the same warps (they fix the in-tile reduction tree of the scores).
        num_warps=_NUM_WARPS, enable_fp_fusion=False,
    )
    if sums:
        add_partials_grouped_(_to_device(sums, device), len(sums) // 5, sum_program)
    # `partials` is freed on return while both launches may still be queued: safe without record_stream, since it was
    # allocated on this stream and the caching allocator hands it out again only in this stream's order.


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 table on ``device``: built in pinned memory and copied without blocking the host (the caching host
    allocator keeps the block until the copy has read it)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
