"""Triton: one pass over a gradient for the device side of a ZenFlow step (DESIGN §3, §4, §6).

Per gradient element read once: (a) per-column squared norms into ``score``, (b) AdamW on the selected columns
against the compact fp32 state addressed through ``slot``, result written into the model param in its own dtype,
(c) ``acc`` overwrite-or-add on the unselected columns. Semantics: ``reference.fused_step_``.
"""

from __future__ import annotations

import math
import struct

import torch

from ._checks import check_fused_step_args, check_slot_range
from ._triton_utils import (
    add_partials_,
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

__all__ = ["fused_step_"]

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
    plan = plan_row_splits(rows, cols, block_r=block_r, block_c=block_c, rows_per_split=_rows_per_split)
    partials = None
    if update_score and plan.splits > 1:
        partials = torch.empty((plan.splits, cols), dtype=torch.float32, device=param.device)
    score_mode = 0 if not update_score else (1 if partials is None else 2)

    # Scalars the reference rounds to fp32 before fp32 math are rounded here, once, so that the GPU and the
    # interpreter (which keeps Python floats as doubles) see the same values; the three the reference uses in
    # fp64 (bias corrections) travel as hi + lo fp32 pairs.
    lr, beta1, beta2 = float(hp.lr), float(hp.beta1), float(hp.beta2)
    eps, weight_decay = float(hp.eps), float(hp.weight_decay)
    lerp_w = _f32(1.0 - beta1)
    param_bits = param.view(torch.uint16) if param.dtype == torch.bfloat16 else param
    with device_guard(param):
        _fused_step_kernel[plan.grid](
            param_bits, grad, score, score if partials is None else partials, slot, col_step,
            master, exp_avg, exp_avg_sq, acc,
            rows, cols, k, plan.rows_per_split,
            *_split(lr), *_split(beta1), *_split(beta2),
            _f32(1.0 - lr * weight_decay), _f32(weight_decay), lerp_w, _f32(1.0 - lerp_w), _f32(beta2),
            _f32(1.0 - beta2), _f32(eps),
            SCORE_MODE=score_mode, ACCUMULATE=bool(accumulate), DECOUPLED=hp.decoupled, HAS_STATE=k > 0,
            PARAM_BF16=param.dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_C=block_c,
            # No FMA contraction: the GPU then does the same IEEE operations as the interpreter, and results do not
            # change with Triton's default (which flips in 3.10).
            num_warps=_NUM_WARPS, enable_fp_fusion=False,
        )
        if partials is not None:
            add_partials_(score, partials)
