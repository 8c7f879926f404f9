"""Shared set-up for the benches: sizes and knobs, workload factories, timing helpers, machine description.

What the benches *compare* (host AdamW kernels, optimizers) is built in ``providers.py``; this module builds what
they run on. Benches import both by their bare names (``from common import ...``): a script run as
``python bench/x.py`` has ``bench/`` first on ``sys.path``, and so does pytest (``bench/`` holds a ``conftest.py``
and no ``__init__.py``).

Sizes: ``ZENFLOW_BENCH_NUMEL`` (default 64M parameters, 1.8 GB of AdamW traffic per step: far past the 32 MiB
last-level cache of the machine the README quotes) and ``ZENFLOW_BENCH_SMOKE=1`` (64K parameters, a couple of
rounds: checks that every provider runs, measures nothing). Threads: ``ZENFLOW_BENCH_THREADS`` (default 2), for
numba and torch alike. Rounds: ``ZENFLOW_BENCH_ROUNDS`` (default 9).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch

__all__ = [
    "BENCH_DIR",
    "GRAD_SETS",
    "MATRIX_DIM",
    "SMOKE",
    "HostBuffers",
    "bench_numel",
    "bench_rounds",
    "bench_shape",
    "bench_threads",
    "gradient_sets",
    "load_average",
    "machine_info",
    "make_host_buffers",
    "make_slot",
    "make_weights",
    "median_seconds",
]

BENCH_DIR = Path(__file__).resolve().parent

SMOKE = os.environ.get("ZENFLOW_BENCH_SMOKE", "0") not in ("", "0")

_COLS = 16384  # a 4096 x 16384 matrix at 64M: the shape of a large MLP weight; rows give the parallelism

MATRIX_DIM = 2048  # the optimizer benches' weight matrices are [2048, 2048]
GRAD_SETS = 4  # distinct gradients cycled through the steps: enough that no step reuses its predecessor's


# ----------------------------------------------------------------------------------------------------- knobs


def bench_numel() -> int:
    if "ZENFLOW_BENCH_NUMEL" in os.environ:
        return int(os.environ["ZENFLOW_BENCH_NUMEL"])
    return 1 << 16 if SMOKE else 1 << 26


def bench_shape(numel: int | None = None) -> tuple[int, int]:
    """``[R, C]`` with ``C = min(numel, 16384)``; numel is rounded down to a multiple of C."""
    n = bench_numel() if numel is None else numel
    cols = min(n, _COLS)
    return max(1, n // cols), cols


def bench_threads() -> int:
    return min(int(os.environ.get("ZENFLOW_BENCH_THREADS", "2")), numba.config.NUMBA_NUM_THREADS)


def bench_rounds() -> int:
    return 2 if SMOKE else int(os.environ.get("ZENFLOW_BENCH_ROUNDS", "9"))


# ----------------------------------------------------------------------------------------------------- host buffers


@dataclass
class HostBuffers:
    """The host state of one offloaded parameter, as the optimizer holds it (DESIGN §4)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    col_step: torch.Tensor
    snapshot: torch.Tensor | None

    @property
    def numel(self) -> int:
        return self.master.numel()


def make_host_buffers(
    rows: int, cols: int, *, grad_dtype: torch.dtype = torch.float32, snapshot_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> HostBuffers:
    """Realistic magnitudes (weights ~0.02, small moments), step count 10 on every column; pages touched."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(rows, cols, generator=gen).mul_(0.02)
    exp_avg = torch.randn(rows, cols, generator=gen).mul_(1e-3)
    exp_avg_sq = torch.rand(rows, cols, generator=gen).mul_(1e-6)
    grad = torch.randn(rows, cols, generator=gen).mul_(1e-3).to(grad_dtype)
    col_step = torch.full((cols,), 10, dtype=torch.int32)
    snapshot = None if snapshot_dtype is None else master.to(snapshot_dtype)
    return HostBuffers(master, exp_avg, exp_avg_sq, grad, col_step, snapshot)


def make_slot(cols: int, selected: float, *, pattern: str = "random", seed: int = 0) -> torch.Tensor:
    """Slot map with ``round(selected * cols)`` selected columns: ``random`` (as top-k picks them) or ``block``,
    slots numbered in column order either way."""
    k = round(selected * cols)
    slot = torch.full((cols,), -1, dtype=torch.int32)
    if k == 0:
        return slot
    if pattern == "random":
        # Slots in column order, as the optimizer hands them out (columns.py sorts the top-k indices), so the compact
        # state of neighbouring selected columns is contiguous; a random order would make its loads a scattered gather.
        cols_sel = torch.randperm(cols, generator=torch.Generator().manual_seed(seed))[:k].sort().values
    elif pattern == "block":
        cols_sel = torch.arange(k)
    else:
        raise ValueError(f"unknown pattern {pattern!r}")
    slot[cols_sel] = torch.arange(k, dtype=torch.int32)
    return slot


# ------------------------------------------------------------------------------------------ optimizer workload


def make_weights(num_params: int, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """``[2048, 2048]`` weight matrices (smaller squares below 4M parameters) totalling about ``num_params``,
    each followed by its resident ``[rows]`` bias, initialized like a Linear layer (std 0.02)."""
    dim = MATRIX_DIM if num_params >= 4 * MATRIX_DIM**2 else max(64, int((num_params / 4) ** 0.5) // 64 * 64)
    count = max(1, round(num_params / dim**2))
    gen = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    for _ in range(count):
        out.append(torch.nn.Parameter(torch.randn(dim, dim, generator=gen).mul_(0.02).to(dtype)))
        out.append(torch.nn.Parameter(torch.zeros(dim, dtype=dtype)))
    return out


def gradient_sets(params: Sequence[torch.Tensor], count: int = GRAD_SETS, *, seed: int = 1) -> list[list[torch.Tensor]]:
    """``count`` gradient lists for ``params``; matrices get a fixed log-normal scale per column, as real
    gradients concentrate their energy in a few input channels (what ZenFlow's top-k selection exploits)."""
    gen = torch.Generator().manual_seed(seed)
    scales = [torch.randn(p.shape[-1], generator=gen).exp_() if p.dim() >= 2 else None for p in params]
    sets = []
    for _ in range(count):
        grads = []
        for p, s in zip(params, scales):
            g = torch.randn(p.shape, generator=gen).mul_(1e-3)
            if s is not None:
                g.mul_(s)
            grads.append(g.to(p.dtype))
        sets.append(grads)
    return sets


# ----------------------------------------------------------------------------------------------------- timing


def median_seconds(fn: Callable[[], object], *, rounds: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``rounds`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------------- machine


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, library versions and git revision: what a results file must state."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR, capture_output=True, text=True,
                             timeout=10).stdout.strip() or "unknown"
        # Library files changed since that commit make the revision alone an incomplete description of the code.
        status = subprocess.run(["git", "status", "--porcelain", "--", "zenflow_triton", "kernels", "autotune"],
                                cwd=BENCH_DIR, capture_output=True, text=True, timeout=10).stdout.split("\n")
        dirty = [line[3:] for line in status if line.strip()]
    except (OSError, subprocess.SubprocessError):
        rev, dirty = "unknown", []

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "numba_threads": numba.config.NUMBA_NUM_THREADS,
        "git_rev": rev,
        "library_files_changed_since_rev": dirty,
        "load_average": load_average(),
    }
