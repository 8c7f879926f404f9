"""Triton: one pass over a gradient for the device side of a ZenFlow step (DESIGN §3, §4, §6).

Per gradient element read once: (a) per-column squared norms into ``score``, (b) AdamW on the selected columns
against the compact fp32 state addressed through ``slot``, result written into the model param in its own dtype,
(c) ``acc`` overwrite-or-add on the unselected columns (none with ``acc=None``: HAS_ACC=False compiles the acc loads
and stores away). Semantics: ``reference.fused_step_``.

Two launchers: ``fused_step_`` for one parameter, ``fused_steps_`` for many at once (one launch per parameter dtype,
the calls' tensors reached through a table of addresses), with bit-identical results.
"""

from __future__ import annotations

import array
import functools
import math
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ._checks import check_fused_step_args, check_slot_range
from ._triton_utils import (
    ADD_PARTIALS_BLOCK,
    FINISH_ADD_SCORES,
    FINISH_COUNT_STEPS,
    FINISH_FIELDS,
    INT32_MAX,
    RowSplitPlan,
    adam_tile,
    bias_corrections,
    check_launch_device,
    check_sides,
    column_sums,
    compact_block,
    compact_columns,
    device_guard,
    finish_steps_,
    finish_steps_grouped_,
    interpreting,
    load_steps,
    packed_adam,
    plan_row_splits,
    store_column_sums,
    stream_tile,
    tl,
    triton,
)
from .hyperparams import AdamHyperparams, require_hyperparams

if TYPE_CHECKING:  # device_ops imports the backends lazily; no cycle at run time
    from .step_args import FusedStepArgs

__all__ = ["fused_step_", "fused_steps_"]

# Tile on CUDA. No GPU was available to measure, so this is reasoning, to be replaced by a measurement: a tile of
# 8 x 128 with 4 warps is 8 elements per thread of each of grad, acc, master, m, v plus their offsets.
# Compiled for sm_90a on a CPU (triton 3.9 + its ptxas, no GPU), the variants with compact state (k > 0) used 140-184
# registers per thread, no spills; without state 21-56. With 32-bit offsets where R*C allows (WIDE=False) the
# per-parameter variants with state take 145-152 (from 168), the grouped ones 158-181 and 48-54 without state
# (tests/triton_sm90_compile.py reports them per variant). Without an acc (HAS_ACC=False, accumulate="host") ptxas
# allocates more, not fewer: per-parameter 141-164 with state, grouped 188-192 (not analysed; presumably more of the
# state loads scheduled early without the acc's); no spills, but the grouped bf16 kernel drops from 3 to 2 programs per
# SM by registers: to be measured on a GPU. So 2-3 resident programs per SM, not the ~6 first assumed:
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
# Registers per thread for the variants with compact state (Triton's maxnreg, ptxas's .maxnreg): 168 is the most
# that lets an SM (65536 registers) hold 3 programs of 4 warps instead of 2, i.e. 3072 tile elements in flight per SM
# instead of 2048, at the same tile. Left to itself ptxas takes more than it needs: sm_90a, compiled on a CPU
# (tests/triton_sm90_compile.py, `pytest -rA tests/test_triton_compile.py` prints each variant), uncapped -> capped,
# registers/spill bytes, with state: triton 3.9 (ptxas 13.4) per-parameter 141-168 -> 149-168/0, grouped 160-230/0
# -> 166-168/0-48; triton 3.6 (ptxas 12.8, the lent H200's) per-parameter 185-223 -> 166-168/0-12, grouped 184-211/0
# -> 168/0-72, and 168/0-12 (bf16, fp16: 0; WIDE 88) since the acc tile is read and written whole (the spills: values
# parked across the loop). Where it spills the cap trades a few bytes of local memory (L1) per thread for the third
# program, and it costs 2-4% more instructions per tile (SASS of the loop, triton 3.6: per-parameter bf16 928 -> 954,
# grouped bf16 987 -> 1026); a cap of 128 (4 programs) spills inside the loop. Not measured on a GPU yet, so
# bench_device_kernels times the grouped launch both ways (None: no cap). The results do not change with it.
STATE_MAXNREG: int | None = 168
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
def _fused_step_kernel(
    param_ptr, grad_ptr, score_ptr, partial_ptr, slot_ptr, col_step_ptr,
    master_ptr, exp_avg_ptr, exp_avg_sq_ptr, acc_ptr,
    R, C, K, rows_per_split,
    lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo,
    decay, weight_decay, lerp_w, lerp_w_rest, beta2, beta2_rest, eps,
    SCORE_MODE: tl.constexpr, ACCUMULATE: tl.constexpr, DECOUPLED: tl.constexpr, HAS_STATE: tl.constexpr,
    COUNT_STEPS: tl.constexpr, WIDE: tl.constexpr, PARAM_BF16: tl.constexpr, HAS_ACC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Grid: (column blocks, row splits); each program streams its rows [row0, row0 + rows_per_split) in BLOCK_R tiles.
    # COUNT_STEPS: 0 col_step is read as it is; 1 this update's counts are col_step + 1 on the selected columns, and
    # this program (the only split) stores them; 2 the same counts, stored after the launch (finish_steps_), since
    # every split reads them. WIDE: R*C may pass 2^31, so offsets are 64-bit (else 32-bit: half the registers).
    # HAS_ACC=False (acc=None, accumulate="host"): acc_ptr is a stand-in, never read or written. A block with at most
    # BLOCK_K selected columns runs Adam on them alone, packed (compact_columns); with more, on the whole tile,
    # masked. The same operations on the same values either way.
    pid_c = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    slot = tl.load(slot_ptr + cols, mask=col_mask, other=-1)
    unsel = col_mask & (slot < 0)
    row0 = split * rows_per_split
    n_rows = tl.minimum(rows_per_split, R - row0)
    sq = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)  # the squares' sums (unused, so compiled away, without scores)
    if HAS_STATE:
        sel = col_mask & (slot >= 0)
        steps = load_steps(col_step_ptr, cols, sel, COUNT_STEPS != 0)
        if COUNT_STEPS == 1:
            tl.store(col_step_ptr + cols, steps, mask=sel)
        slot_i = tl.where(sel, slot, 0)
        if WIDE:
            slot_i = slot_i.to(tl.int64)
        # torch's lerp switches formula at weight 0.5 for accuracy; same switch here.
        lerp_small = lerp_w < 0.5
        n_sel, c_mask, c_col, c_slot, c_steps = compact_columns(sel, cols, slot_i, steps, BLOCK_K)
        # One loop per path, so that neither holds the other's per-column values through it (registers).
        if n_sel <= BLOCK_K:
            c_size, c_bc2 = bias_corrections(c_steps, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo, BLOCK_K)
            for r in range(0, n_rows, BLOCK_R):
                rows, row_mask, offs, g, sq = stream_tile(grad_ptr, acc_ptr, sq, r, row0, R, C, cols, col_mask, unsel,
                                                          ACCUMULATE, HAS_ACC, WIDE, BLOCK_R)
                packed_adam(grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, param_ptr, rows, row_mask, C, K, c_mask,
                            c_col, c_slot, c_size, c_bc2, decay, weight_decay, lerp_small, lerp_w, lerp_w_rest, beta2,
                            beta2_rest, eps, DECOUPLED, PARAM_BF16)
        else:
            step_size, bc2_sqrt = bias_corrections(steps, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo,
                                                    BLOCK_C)
            for r in range(0, n_rows, BLOCK_R):
                rows, row_mask, offs, g, sq = stream_tile(grad_ptr, acc_ptr, sq, r, row0, R, C, cols, col_mask, unsel,
                                                          ACCUMULATE, HAS_ACC, WIDE, BLOCK_R)
                adam_tile(master_ptr, exp_avg_ptr, exp_avg_sq_ptr, param_ptr, rows[:, None] * K + slot_i[None, :],
                          offs, row_mask[:, None] & sel[None, :], g, step_size, bc2_sqrt, decay, weight_decay,
                          lerp_small, lerp_w, lerp_w_rest, beta2, beta2_rest, eps, DECOUPLED, PARAM_BF16)
    else:
        for r in range(0, n_rows, BLOCK_R):
            rows, row_mask, offs, g, sq = stream_tile(grad_ptr, acc_ptr, sq, r, row0, R, C, cols, col_mask, unsel,
                                                      ACCUMULATE, HAS_ACC, WIDE, BLOCK_R)
    if SCORE_MODE != 0:
        # A fixed summation order, whatever the layout (column_sums says why): the grouped kernel gets the same bits.
        store_column_sums(score_ptr, partial_ptr, split, cols, col_mask, C, column_sums(sq, BLOCK_R, BLOCK_C),
                          SCORE_MODE)


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
    _block_r: int | None = None,
    _block_c: int | None = None,
    _rows_per_split: int | None = None,
    _block_k: int | None = None,
) -> None:
    """One pass over ``grad [R, C]``, in place; same arguments and meaning as ``reference.fused_step_``.

    (a) if ``update_score``: ``score += colsumsq(grad)``;
    (b) selected columns (``slot >= 0``): AdamW on the compact fp32 ``master``/``exp_avg``/``exp_avg_sq [R, k]``
        with bias correction from ``col_step`` (already incremented, and then only read; with ``count_step=True``
        first incremented here, on the selected columns); the result is written into ``param`` in its own dtype
        (bf16 and fp16 rounded to nearest even);
    (c) unselected columns: ``acc = grad`` (``accumulate=False``) or ``acc += grad``; with ``acc=None`` nothing (no
        accumulation target: ``accumulate=True`` is then a ValueError). Selected columns of ``acc`` keep their bits,
        and nothing of ``param``/compact state outside the selected columns is touched.
    Tensors are CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``), contiguous, checked like the reference.
    Selected slots must be distinct and in ``[0, k)``; ``check_slots=True`` verifies the range (a device sync),
    otherwise a bad slot is an out-of-bounds access. Hyperparameters are runtime scalars: changing them never
    recompiles. Deterministic: identical inputs give bit-identical outputs (no atomics, fixed summation order).
    The underscored keywords override block sizes, the row split and the packed Adam's width (tests only).
    """
    rows, cols, k = check_fused_step_args(
        param, grad, score=score, slot=slot, col_step=col_step, master=master, exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq, acc=acc, accumulate=accumulate,
    )
    require_hyperparams(hp)
    check_sides("param", param, rows, cols, "fused_step_")
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
    count = 0 if not count_step or k == 0 else (1 if plan.splits == 1 else 2)

    param_bits = param.view(torch.uint16) if param.dtype == torch.bfloat16 else param
    with device_guard(param):
        _fused_step_kernel[plan.grid](
            param_bits, grad, score, score if partials is None else partials, slot, col_step,
            master, exp_avg, exp_avg_sq, score if acc is None else acc,  # score: a stand-in, never touched
            rows, cols, k, plan.rows_per_split,
            *_scalars(hp),
            SCORE_MODE=score_mode, ACCUMULATE=bool(accumulate), DECOUPLED=hp.decoupled, HAS_STATE=k > 0,
            COUNT_STEPS=count, WIDE=_wide(rows, cols, block_r), PARAM_BF16=param.dtype == torch.bfloat16,
            HAS_ACC=acc is not None, BLOCK_R=block_r, BLOCK_C=block_c,
            BLOCK_K=_block_k or compact_block(k / cols, block_c),
            # No FMA contraction: the GPU then does the same IEEE operations as the interpreter, and results do not
            # change with Triton's default (which flips in 3.10).
            num_warps=_NUM_WARPS, enable_fp_fusion=False, maxnreg=STATE_MAXNREG if k > 0 else None,
        )
        if partials is not None or count == 2:
            finish_steps_(score, partials, slot, col_step if count == 2 else None)


# ---------------------------------------------------------------------------------------------- many parameters

# One row of the grouped launch's call table (int64), in this order (the kernel reads the fields by these positions):
#   0-9 the addresses of param, grad, score, partials (score's own when unused), slot, col_step, master, exp_avg,
#       exp_avg_sq, acc (0 for acc=None: such calls go to a launch of their own, HAS_ACC=False, that never reads it)
#   10-15 R, C, k, rows per split, column blocks, flags
# The hyperparameters are the launch's arguments, not table fields: a launch covers the calls of one (dtype, hp,
# whether they have an acc).
_FIELDS = 16  # a power of two keeps a row on aligned 128-byte boundaries
# Flags: bits 0-1 the score mode (0 none, 1 straight into score, 2 into the partials), bit 2 accumulate, bit 3 count
# this step on the selected columns (use col_step + 1), bit 4 and store the counts here (the call has one split; with
# more, the finishing launch stores them, since every split reads them).
_ACCUMULATE, _COUNT, _COUNT_HERE = 4, 8, 16
# The param dtypes as the kernel's PARAM_KIND.
_PARAM_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The program map (one int64 per program of the launch): the program's call in the high 32 bits, its index among that
# call's programs in the low 32. One load per program instead of a binary search over the calls' first programs
# (~log2(calls) dependent loads, 7 for a 1B decoder's 56 weights + 1 for the row address).
_CALL_SHIFT = 32
# The alignment the host checks before it tells the compiler (tl.multiple_of): 16 bytes is what a 128-bit load needs;
# torch's caching allocators hand out 512-byte aligned blocks, so every tensor but a sliced view qualifies.
_ALIGN = 16


def _wide(rows: int, cols: int, block_r: int) -> bool:
    """Whether a call needs 64-bit offsets: the last tile's rows (past R, masked) times C may pass 2^31."""
    return (rows + block_r) * cols > INT32_MAX


@triton.jit
def _fused_steps_kernel(
    table_ptr, programs_ptr,
    lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo,
    decay, weight_decay, lerp_w, lerp_w_rest, beta2, beta2_rest, eps,
    PARAM_KIND: tl.constexpr, HAS_STATE: tl.constexpr, DECOUPLED: tl.constexpr, ALIGNED: tl.constexpr,
    WIDE: tl.constexpr, HAS_ACC: tl.constexpr, FIELDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # _fused_step_kernel for every call of the table, each over its own (column blocks x row splits) programs of this
    # 1-D grid. What were constexprs there (score mode, accumulate, whether this call has compact state, step counting)
    # are per-call values here; each branch does the same operations in the same order, so results are bit-identical.
    # HAS_STATE=False (no call has compact state: warm-up, r = 0, synchronous offload) reads no state pointer, no slot
    # and no step count. ALIGNED: the host checked that every call's tensors start on 16 bytes and C % 16 == 0, which
    # the table's addresses cannot tell the compiler (a kernel argument's divisibility is specialized, a loaded one's
    # is not): with it the gradient tiles load 128 bits per instruction. HAS_ACC=False: every call of the launch has
    # acc=None (accumulate="host"); the acc field is not loaded and nothing is summed.
    pid = tl.program_id(0)
    code = tl.load(programs_ptr + pid)
    row = table_ptr + (code >> 32) * FIELDS  # _CALL_SHIFT
    local = (code & 0xFFFFFFFF).to(tl.int32)
    if PARAM_KIND == 1:  # bf16: written as bits (uint16), see fp32_to_bf16_bits
        param_ptr = tl.load(row + 0).to(tl.pointer_type(tl.uint16))
        grad_ptr = tl.load(row + 1).to(tl.pointer_type(tl.bfloat16))
    elif PARAM_KIND == 2:
        param_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float16))
        grad_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float16))
    else:
        param_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float32))
        grad_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    acc_ptr = grad_ptr  # HAS_ACC=False: a stand-in, never read or written
    if HAS_ACC:
        acc_ptr = tl.load(row + 9).to(tl.pointer_type(tl.float32))
    R = tl.load(row + 10).to(tl.int32)
    C = tl.load(row + 11).to(tl.int32)
    rows_per_split = tl.load(row + 13).to(tl.int32)
    col_blocks = tl.load(row + 14).to(tl.int32)
    flags = tl.load(row + 15).to(tl.int32)
    if ALIGNED:
        param_ptr = tl.multiple_of(param_ptr, 16)
        grad_ptr = tl.multiple_of(grad_ptr, 16)
        if HAS_ACC:
            acc_ptr = tl.multiple_of(acc_ptr, 16)
        C = tl.multiple_of(C, 16)
    score_mode = flags & 3
    accumulate = (flags & 4) != 0  # _ACCUMULATE

    pid_c = local % col_blocks
    split = local // col_blocks
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    row0 = split * rows_per_split
    n_rows = tl.minimum(rows_per_split, R - row0)
    sq = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    if HAS_STATE:
        slot_ptr = tl.load(row + 4).to(tl.pointer_type(tl.int32))
        col_step_ptr = tl.load(row + 5).to(tl.pointer_type(tl.int32))
        K = tl.load(row + 12).to(tl.int32)
        if ALIGNED:
            slot_ptr = tl.multiple_of(slot_ptr, 16)
            col_step_ptr = tl.multiple_of(col_step_ptr, 16)
        slot = tl.load(slot_ptr + cols, mask=col_mask, other=-1)
        unsel = col_mask & (slot < 0)
        # A call without compact state (K = 0) has every slot -1, so `sel` is empty and the state code is skipped.
        sel = col_mask & (slot >= 0)
        any_sel = (tl.max(sel.to(tl.int32), axis=0) > 0) & (K > 0)
        steps = tl.full([BLOCK_C], 1, dtype=tl.int32)
        if any_sel:
            # As load_steps: col_step (+ 1 when this call counts the step) on selected lanes, 1 elsewhere.
            stored = tl.load(col_step_ptr + cols, mask=sel, other=0)
            steps = tl.where(sel, stored + ((flags >> 3) & 1), 1)  # _COUNT
            # (tl.where, not sel & scalar: the interpreter cannot mask with a tensor & scalar of bools)
            tl.store(col_step_ptr + cols, steps, mask=tl.where((flags & 16) != 0, sel, False))  # _COUNT_HERE
        slot_i = tl.where(sel, slot, 0)
        if WIDE:
            slot_i = slot_i.to(tl.int64)
        lerp_small = lerp_w < 0.5
        n_sel, c_mask, c_col, c_slot, c_steps = compact_columns(sel, cols, slot_i, steps, BLOCK_K)
    else:
        unsel = col_mask
    # As _fused_step_kernel: one loop per path. The state addresses are read in the loop, once per tile (a table row
    # the SM has just read: an L1 hit), not held across it: 6 fewer registers live through it (ptxas sm_90a, grouped
    # fp32 181 -> 160 with triton 3.9, 214 -> 198 with 3.6; the score addresses, read after the loop, likewise).
    if HAS_STATE:
        if any_sel & (n_sel <= BLOCK_K):
            c_size, c_bc2 = bias_corrections(c_steps, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo, BLOCK_K)
            for r in range(0, n_rows, BLOCK_R):
                rows, row_mask, offs, g, sq = stream_tile(grad_ptr, acc_ptr, sq, r, row0, R, C, cols, col_mask, unsel,
                                                          accumulate, HAS_ACC, WIDE, BLOCK_R)
                packed_adam(grad_ptr, tl.load(row + 6).to(tl.pointer_type(tl.float32)),
                            tl.load(row + 7).to(tl.pointer_type(tl.float32)),
                            tl.load(row + 8).to(tl.pointer_type(tl.float32)), param_ptr, rows, row_mask, C, K, c_mask,
                            c_col, c_slot, c_size, c_bc2, decay, weight_decay, lerp_small, lerp_w, lerp_w_rest, beta2,
                            beta2_rest, eps, DECOUPLED, PARAM_KIND == 1)
        elif any_sel:
            step_size, bc2_sqrt = bias_corrections(steps, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo,
                                                    BLOCK_C)
            for r in range(0, n_rows, BLOCK_R):
                rows, row_mask, offs, g, sq = stream_tile(grad_ptr, acc_ptr, sq, r, row0, R, C, cols, col_mask, unsel,
                                                          accumulate, HAS_ACC, WIDE, BLOCK_R)
                adam_tile(tl.load(row + 6).to(tl.pointer_type(tl.float32)),
                          tl.load(row + 7).to(tl.pointer_type(tl.float32)),
                          tl.load(row + 8).to(tl.pointer_type(tl.float32)), param_ptr,
                          rows[:, None] * K + slot_i[None, :], offs, row_mask[:, None] & sel[None, :], g, step_size,
                          bc2_sqrt, decay, weight_decay, lerp_small, lerp_w, lerp_w_rest, beta2, beta2_rest, eps,
                          DECOUPLED, PARAM_KIND == 1)
        else:
            for r in range(0, n_rows, BLOCK_R):
                rows, row_mask, offs, g, sq = stream_tile(grad_ptr, acc_ptr, sq, r, row0, R, C, cols, col_mask, unsel,
                                                          accumulate, HAS_ACC, WIDE, BLOCK_R)
    else:
        for r in range(0, n_rows, BLOCK_R):
            rows, row_mask, offs, g, sq = stream_tile(grad_ptr, acc_ptr, sq, r, row0, R, C, cols, col_mask, unsel,
                                                      accumulate, HAS_ACC, WIDE, BLOCK_R)
    sums = column_sums(sq, BLOCK_R, BLOCK_C)
    score_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    partial_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        score_ptr = tl.multiple_of(score_ptr, 16)
        partial_ptr = tl.multiple_of(partial_ptr, 16)
    if score_mode == 1:
        old = tl.load(score_ptr + cols, mask=col_mask, other=0.0)
        tl.store(score_ptr + cols, old + sums, mask=col_mask)
    elif score_mode == 2:
        tl.store(partial_ptr + split.to(tl.int64) * C + cols, sums, mask=col_mask)


@functools.lru_cache(maxsize=1024)
def _plan(rows: int, cols: int, block_r: int, block_c: int) -> RowSplitPlan:
    """The split plan of a shape (the same as fused_step_'s, which is what makes the scores bit-identical)."""
    return plan_row_splits(rows, cols, block_r=block_r, block_c=block_c)


def _quick_check(c: FusedStepArgs, device: torch.device) -> tuple | None:
    """``(c, R, C, k, addresses of FusedStepArgs' tensors in field order (acc None: 0), aligned: all and C multiples of
    _ALIGN)`` when every tensor has the dtype, shape, device and layout the kernel needs, else None: the full check
    then raises the error that says what is wrong (so does anything unexpected here: not a tensor, a sparse one).
    ``check_fused_step_args``'s checks with each tensor read once (``bench/launch_overhead.py`` times it)."""
    try:
        p, m, acc = c.param, c.master, c.acc
        dtype, shape, mshape = p.dtype, p.shape, m.shape
        if len(shape) != 2 or len(mshape) != 2 or dtype not in _PARAM_KIND or type(c.hp) is not AdamHyperparams:
            return None
        rows, cols = shape
        if mshape[0] != rows or mshape[1] > cols or rows > INT32_MAX or cols > INT32_MAX:
            return None
        if acc is None and c.accumulate:
            return None  # the full check raises
        vec = (cols,)
        f32, i32 = torch.float32, torch.int32
        ptrs, bits = [], 0
        for i, (t, want_dtype, want) in enumerate(((p, dtype, shape), (c.grad, dtype, shape), (c.score, f32, vec),
                                                   (c.slot, i32, vec), (c.col_step, i32, vec), (m, f32, mshape),
                                                   (c.exp_avg, f32, mshape), (c.exp_avg_sq, f32, mshape),
                                                   (acc, f32, shape))):
            if t is None and i == 8:  # acc only: any other None fails below and goes to the full check
                ptrs.append(0)
                continue
            # is_contiguous() is False for strided tensors that are not, and raises for sparse ones.
            if t.dtype != want_dtype or t.shape != want or not t.is_contiguous() or t.device != device:
                return None
            ptrs.append(t.data_ptr())
            bits |= ptrs[-1]
    except Exception:  # noqa: BLE001 - the full check says what is wrong
        return None
    return c, rows, cols, mshape[1], tuple(ptrs), cols % 16 == 0 and bits % _ALIGN == 0


def _checked(c: FusedStepArgs, device: torch.device | None) -> tuple:
    """``_quick_check``'s record after the full check, which raises for a call the quick check turned down."""
    rows, cols, k = check_fused_step_args(c.param, c.grad, score=c.score, slot=c.slot, col_step=c.col_step,
                                          master=c.master, exp_avg=c.exp_avg, exp_avg_sq=c.exp_avg_sq, acc=c.acc,
                                          accumulate=c.accumulate)
    require_hyperparams(c.hp)
    if c.param.device != device:
        raise ValueError(f"fused_steps_: every call must be on one device; param is on {c.param.device}, "
                         f"the first call's on {device}")
    check_sides("param", c.param, rows, cols, "fused_steps_")
    tensors = (c.param, c.grad, c.score, c.slot, c.col_step, c.master, c.exp_avg, c.exp_avg_sq, c.acc)
    ptrs = tuple(0 if t is None else t.data_ptr() for t in tensors)
    return c, rows, cols, k, ptrs, cols % 16 == 0 and not any(ptr % _ALIGN for ptr in ptrs)


def fused_steps_(
    calls: Sequence[FusedStepArgs],
    *,
    _block_r: int | None = None,
    _block_c: int | None = None,
    _block_k: int | None = None,
) -> None:
    """``fused_step_`` for every call, bit-identical to calling it for each in turn, in one launch per parameter dtype,
    hyperparameter record and presence of ``acc`` (two where some calls' tensors are not 16-byte aligned), plus one
    more for the scores and step counts of matrices tall enough to split their rows.

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
    # Launches per hyperparameter record (equal records share one; compared, not hashed: hashing one costs more than
    # the rest of this loop), then per (dtype, has acc: HAS_ACC=False compiles no acc traffic, aligned) -> calls.
    groups: list[tuple[AdamHyperparams, dict[tuple[torch.dtype, bool, bool], list[tuple]]]] = []
    hp = launches = None
    for c in calls:
        checked = _quick_check(c, device) or _checked(c, device)
        if not (checked[1] and checked[2]):
            continue
        if c.hp is not hp:
            hp = c.hp
            launches = next((g for h, g in groups if h == hp), None)
            if launches is None:
                launches = {}
                groups.append((hp, launches))
        launches.setdefault((c.param.dtype, c.acc is not None, checked[5]), []).append(checked)
    if not groups:
        return
    check_launch_device("param", first, _fused_steps_kernel, __name__)
    interp = interpreting(_fused_steps_kernel)
    block_r = _block_r or (_INTERP_BLOCK_R if interp else _BLOCK_R)
    block_c = _block_c or _BLOCK_C
    with device_guard(first):
        for hp, launches in groups:
            for (dtype, has_acc, aligned), items in launches.items():
                _launch_group(dtype, hp, has_acc, items, aligned, device, block_r, block_c, _block_k)


@functools.lru_cache(maxsize=32)
def _program_map(shapes: tuple[tuple[int, int], ...], block_r: int, block_c: int,
                 device: torch.device) -> tuple[torch.Tensor, tuple[RowSplitPlan, ...]]:
    """The launch's program map on ``device`` (see ``_CALL_SHIFT``) and the calls' plans, for calls of these shapes in
    this order: built and copied once per set of shapes (a training run repeats a few of them every step)."""
    plans = tuple(_plan(rows, cols, block_r, block_c) for rows, cols in shapes)
    codes = torch.cat([torch.arange(plan.col_blocks * plan.splits, dtype=torch.int64) + (i << _CALL_SHIFT)
                       for i, plan in enumerate(plans)])
    # A blocking copy (once per set of shapes): later launches may run on other streams, which must not race it.
    return codes.to(device), plans


def _launch_group(dtype: torch.dtype, hp: AdamHyperparams, has_acc: bool, items: list[tuple], aligned: bool,
                  device: torch.device, block_r: int, block_c: int, block_k: int | None) -> None:
    programs, plans = _program_map(tuple((rows, cols) for _, rows, cols, _, _, _ in items), block_r, block_c, device)
    if device.type == "cuda":
        # The cached map outlives this launch and may serve launches on other streams: once evicted, the allocator must
        # not hand its memory out again (in its own stream's order) before every stream that read it is done.
        programs.record_stream(torch.cuda.current_stream(device))
    partial_offsets, n_partial = [], 0
    for (c, _, cols, _, _, _), plan in zip(items, plans):
        split_scores = c.update_score and plan.splits > 1
        partial_offsets.append(n_partial if split_scores else -1)
        n_partial += plan.splits * cols if split_scores else 0
    partials = torch.empty(n_partial, dtype=torch.float32, device=device) if n_partial else None
    base = partials.data_ptr() if partials is not None else 0
    table: list[int] = []
    finish: list[int] = []  # the finishing launch's table (FINISH_FIELDS per call)
    finish_program = 0
    has_state = wide = False
    share = 0.0  # the largest k / C: the packed Adam's width (compact_block)
    for (c, rows, cols, k, ptrs, _), plan, offset in zip(items, plans, partial_offsets):
        mode = 0 if not c.update_score else (1 if offset < 0 else 2)
        param, grad, score, slot, col_step, master, exp_avg, exp_avg_sq, acc = ptrs
        partial = base + 4 * offset if offset >= 0 else score
        count = bool(c.count_step) and k > 0
        flags = (mode | (_ACCUMULATE if c.accumulate else 0) | (_COUNT if count else 0)
                 | (_COUNT_HERE if count and plan.splits == 1 else 0))
        table += (param, grad, score, partial, slot, col_step, master, exp_avg, exp_avg_sq, acc,
                  rows, cols, k, plan.rows_per_split, plan.col_blocks, flags)
        has_state |= k > 0
        share = max(share, k / cols)
        wide |= _wide(rows, cols, block_r)
        count_after = count and plan.splits > 1
        if mode == 2 or count_after:
            finish += (finish_program, score, partial, slot, col_step, cols, plan.splits,
                       (FINISH_ADD_SCORES if mode == 2 else 0) | (FINISH_COUNT_STEPS if count_after else 0))
            finish_program += triton.cdiv(cols, ADD_PARTIALS_BLOCK)
    _fused_steps_kernel[(programs.numel(),)](
        _to_device(table, device), programs, *_scalars(hp),
        PARAM_KIND=_PARAM_KIND[dtype], HAS_STATE=has_state, DECOUPLED=hp.decoupled, ALIGNED=aligned, WIDE=wide,
        HAS_ACC=has_acc, FIELDS=_FIELDS, BLOCK_R=block_r, BLOCK_C=block_c,
        BLOCK_K=block_k or (compact_block(share, block_c) if has_state else 16),
        # As fused_step_: no FMA contraction, the same warps and register cap.
        num_warps=_NUM_WARPS, enable_fp_fusion=False, maxnreg=STATE_MAXNREG if has_state else None,
    )
    if finish:
        finish_steps_grouped_(_to_device(finish, device), len(finish) // FINISH_FIELDS, finish_program)
    # `partials` is freed on return while both launches may still be queued: safe without record_stream, since it was
    # allocated on this stream and the caching allocator hands it out again only in this stream's order.


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 table on ``device``, copied from pinned memory without blocking the host (the caching host allocator
    keeps the block until the copy has read it); through an int64 ``array``: twice as fast as ``torch.tensor``."""
    host = torch.frombuffer(array.array("q", values), dtype=torch.int64)  # keeps the array alive
    return host if device.type != "cuda" else host.pin_memory().to(device, non_blocking=True)
