"""Triton: write the host snapshot into the unselected columns of the model param (DESIGN §5).

``param[:, j] = snapshot[:, j]`` wherever ``slot[j] < 0``; selected columns, which the device updated itself, are
left untouched. The snapshot is in the param's dtype (bits copied), or the fp32 master (``host_snapshot=False``),
rounded to a bf16/fp16 param's dtype to nearest even here. Semantics: ``reference.merge_``.
"""

from __future__ import annotations

import torch

from ._checks import check_merge_args
from ._triton_utils import check_launch_device, check_sides, device_guard, interpreting, plan_row_splits, tl, triton

__all__ = ["merge_"]

# Tile on CUDA. No GPU was available to measure, so this is reasoning: a pure masked copy, 16 x 128 with 4 warps is
# 16 elements per thread, 4-8 KiB of snapshot in flight per program; with ~8-16 resident programs per SM that is
# well above the ~20 KiB per SM Little's law asks of an H100/H200. 128 columns = whole 128-byte lines per row.
_BLOCK_R = 16
_BLOCK_C = 128
_NUM_WARPS = 4
# Under the interpreter each tl op costs ~0.3 ms whatever the tile size (measured here: 2-core CPU, triton 3.9).
_INTERP_BLOCK_R = 64

# The copy moves bits, never values: viewing both tensors as integers of the element's width makes one kernel per
# width serve every model dtype and keeps NaN payloads and -0.0 exactly as the host wrote them.
_BITS_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


# ROUND: how the source's bits become the param's. An fp32 source of a 16-bit param is rounded by integer
# arithmetic, the host kernel's own rule (kernels/_numba_utils.py bf16_round, f16_round), so the param gets the bits
# the host snapshot would have held, NaN included. int32 arithmetic: where a sum wraps (NaN inputs) its result is
# replaced, and an arithmetic shift leaves the low 16 bits a logical one would.
_COPY, _TO_BF16, _TO_F16 = 0, 1, 2


@triton.jit
def _rounded(u, ROUND: tl.constexpr):
    """The 16-bit result (in int32) of fp32 bits ``u`` (int32) rounded to nearest even."""
    a = u & 0x7FFFFFFF
    if ROUND == 1:
        r = ((u + ((u >> 16) & 1) + 0x7FFF) >> 16) & 0xFFFF
        r = tl.where(a > 0x7F800000, 0x7FC0, r)
    else:
        sign = (u >> 16) & 0x8000
        t = a - 0x38000000  # rebias the exponent 127 -> 15 (not selected when a is below fp16's normal range)
        normal = (t + ((t >> 13) & 1) + 0x0FFF) >> 13
        sub = (a.to(tl.float32, bitcast=True) + 0.5).to(tl.int32, bitcast=True) - 0x3F000000
        h = tl.where(a >= 0x38800000, normal, sub)
        h = tl.where(a >= 0x47800000, 0x7C00, h)
        h = tl.where(a > 0x7F800000, (0x7E00 | (a >> 13)) & 0x7FFF, h)
        r = sign | h
    return r


@triton.jit
def _merge_kernel(
    param_ptr, snapshot_ptr, slot_ptr,
    R, C, rows_per_split,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROUND: tl.constexpr,
):
    pid_c = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(slot_ptr + cols, mask=cols < C, other=0)
    take = (cols < C) & (slot < 0)
    # A block whose columns are all selected has nothing to copy: skip its row loop (uniform branch, no divergence).
    if tl.max(take.to(tl.int32), axis=0) > 0:
        row0 = split * rows_per_split
        n_rows = tl.minimum(rows_per_split, R - row0)
        for r in range(0, n_rows, BLOCK_R):
            rows = row0 + r + tl.arange(0, BLOCK_R)
            mask = (rows < R)[:, None] & take[None, :]
            offs = rows.to(tl.int64)[:, None] * C + cols[None, :]  # R*C may pass 2^31
            value = tl.load(snapshot_ptr + offs, mask=mask)
            if ROUND != 0:
                value = _rounded(value, ROUND).to(tl.int16)
            tl.store(param_ptr + offs, value, mask=mask)


def merge_(
    param: torch.Tensor,
    snapshot: torch.Tensor,
    slot: torch.Tensor,
    *,
    _block_r: int | None = None,
    _block_c: int | None = None,
    _rows_per_split: int | None = None,
) -> None:
    """``param[:, j] = snapshot[:, j]`` for every unselected column j (``slot[j] < 0``), in place, bit for bit, or
    rounded to nearest even where ``snapshot`` is fp32 (the master) and ``param`` bf16/fp16.

    ``param``/``snapshot``: shape ``[R, C]``, ``param`` fp32, bf16 or fp16, ``snapshot`` its dtype or fp32;
    ``slot``: int32 ``[C]``. CUDA
    tensors (or CPU tensors under ``TRITON_INTERPRET=1``), contiguous. Selected columns of ``param`` are not touched.
    The underscored keywords override block sizes and the row split (tests only).
    """
    rows, cols = check_merge_args(param, snapshot, slot)
    check_sides("param", param, rows, cols, "merge_")
    check_launch_device("param", param, _merge_kernel, __name__)
    if rows == 0 or cols == 0:
        return
    block_r = _block_r or (_INTERP_BLOCK_R if interpreting(_merge_kernel) else _BLOCK_R)
    block_c = _block_c or _BLOCK_C
    plan = plan_row_splits(rows, cols, block_r=block_r, block_c=block_c, rows_per_split=_rows_per_split)
    rounding = _COPY if snapshot.dtype == param.dtype else _TO_BF16 if param.dtype == torch.bfloat16 else _TO_F16
    with device_guard(param):
        _merge_kernel[plan.grid](
            param.view(_BITS_VIEW[param.dtype]), snapshot.view(_BITS_VIEW[snapshot.dtype]), slot,
            rows, cols, plan.rows_per_split,
            BLOCK_R=block_r, BLOCK_C=block_c, ROUND=rounding, num_warps=_NUM_WARPS, enable_fp_fusion=False,
        )
