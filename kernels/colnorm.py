"""Triton: per-column squared L2 norms of a gradient, ``score += colsumsq(grad)``.

Used on selection steps (DESIGN §3), where the scores must be known before the fused step runs; other steps get
their scores from ``fused_step_`` in the same pass as the update. Semantics: ``reference.column_sumsq_``.
"""

from __future__ import annotations

import torch

from ._checks import check_column_sumsq_args
from ._triton_utils import (
    add_partials_,
    check_launch_device,
    check_sides,
    device_guard,
    interpreting,
    plan_row_splits,
    tl,
    triton,
)
from ._triton_utils import column_sums as _column_sums
from ._triton_utils import store_column_sums as _store_column_sums

__all__ = ["column_sumsq_"]

# Tile on CUDA. No GPU was available to measure, so this is reasoning: 32 x 128 with 4 warps is 32 elements per
# thread; one tile of bf16 gradient is 8 KiB in flight per program and ~8 resident programs give ~64 KiB per SM,
# above the ~20 KiB per SM that Little's law asks of an H100/H200 (~3.4-4.8 TB/s x ~0.7 us latency / 132 SMs).
# 128 columns = 256-512 contiguous bytes per row, whole 128-byte lines. Fixed, never autotuned: BLOCK_R sets the
# summation order, and scores must be bitwise reproducible from run to run.
_BLOCK_R = 32
_BLOCK_C = 128
_NUM_WARPS = 4
# Under the interpreter each tl op costs ~0.3 ms whatever the tile size (measured here: 2-core CPU, triton 3.9),
# so fewer, taller tiles are what makes it fast.
_INTERP_BLOCK_R = 64


@triton.jit
def _column_sumsq_kernel(
    score_ptr, partial_ptr, grad_ptr,
    R, C, rows_per_split,
    SCORE_MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_c = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    row0 = split * rows_per_split
    n_rows = tl.minimum(rows_per_split, R - row0)
    # A 2-D accumulator reduced once at the end: fewer cross-thread reductions and a shorter summation chain.
    sq = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r in range(0, n_rows, BLOCK_R):
        rows = row0 + r + tl.arange(0, BLOCK_R)
        mask = (rows < R)[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]  # R*C may pass 2^31
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sq += g * g
    # A fixed summation order, whatever the layout the compiler picks (column_sums says why).
    sums = _column_sums(sq, BLOCK_R, BLOCK_C)
    _store_column_sums(score_ptr, partial_ptr, split, cols, col_mask, C, sums, SCORE_MODE)


def column_sumsq_(
    score: torch.Tensor,
    grad: torch.Tensor,
    *,
    _block_r: int | None = None,
    _block_c: int | None = None,
    _rows_per_split: int | None = None,
) -> None:
    """``score[j] += sum_i grad[i, j]**2`` in fp32, in place, for ``grad [R, C]`` (fp32, bf16 or fp16).

    Tensors must be CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``), contiguous, ``score`` fp32 ``[C]``.
    Deterministic: the same inputs on the same shape give bit-identical scores (no atomics; row splits are summed in
    a fixed order). The underscored keywords override block sizes and the row split (tests only).
    """
    rows, cols = check_column_sumsq_args(score, grad)
    check_sides("grad", grad, rows, cols, "column_sumsq_")
    check_launch_device("grad", grad, _column_sumsq_kernel, __name__)
    if rows == 0 or cols == 0:
        return
    interp = interpreting(_column_sumsq_kernel)
    block_r = _block_r or (_INTERP_BLOCK_R if interp else _BLOCK_R)
    block_c = _block_c or _BLOCK_C
    plan = plan_row_splits(rows, cols, block_r=block_r, block_c=block_c, rows_per_split=_rows_per_split)
    partials = None
    if plan.splits > 1:
        partials = torch.empty((plan.splits, cols), dtype=torch.float32, device=grad.device)
    with device_guard(grad):
        _column_sumsq_kernel[plan.grid](
            score, score if partials is None else partials, grad,
            rows, cols, plan.rows_per_split,
            SCORE_MODE=1 if partials is None else 2, BLOCK_R=block_r, BLOCK_C=block_c,
            # No FMA contraction: the GPU then does the same IEEE operations as the interpreter, and results do not
            # change with Triton's default (which flips in 3.10).
            num_warps=_NUM_WARPS, enable_fp_fusion=False,
        )
        if partials is not None:
            add_partials_(score, partials)
