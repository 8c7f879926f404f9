"""Shapes that break a Triton kernel's block assumptions, shared by the kernel test files."""

from __future__ import annotations

from types import ModuleType
from typing import Any

Shape = tuple[str, int, int, dict[str, Any]]


def edge_shapes(kernel_module: ModuleType, *, narrow: int = 20, short: int = 3) -> list[Shape]:
    """``(id, rows, cols, launcher overrides)``: 1x1, 1xC, Rx1, primes, BLOCK-1/BLOCK+1 of the module's CUDA tile
    (forced) and interpreter tile, a wide and a tall matrix, and a launch spanning several row splits."""
    gpu_r, gpu_c, int_r = kernel_module._BLOCK_R, kernel_module._BLOCK_C, kernel_module._INTERP_BLOCK_R
    gpu_tile = dict(_block_r=gpu_r, _block_c=gpu_c)
    return [
        ("1x1", 1, 1, {}),
        ("1xC", 1, 130, {}),
        ("Rx1", 130, 1, {}),
        ("prime", 37, 53, {}),
        ("gpu_R-1", gpu_r - 1, narrow, gpu_tile),
        ("gpu_R+1", gpu_r + 1, narrow, gpu_tile),
        ("gpu_C-1", short, gpu_c - 1, gpu_tile),
        ("gpu_C+1", short, gpu_c + 1, gpu_tile),
        ("int_R-1", int_r - 1, 9, {}),
        ("int_R+1", int_r + 1, 9, {}),
        ("wide", 3, 700, {}),
        ("tall", 700, 3, {}),  # default plan: 2 row splits
        ("splits", 70, 20, dict(_block_r=8, _block_c=8, _rows_per_split=16)),  # 5 splits x 3 column blocks
    ]
