"""Shared set-up for the benches: sizes, buffer factories, the memory-bandwidth ceiling, timing helpers.

Sizes: ``ZENFLOW_BENCH_NUMEL`` (default 64M parameters, 1.8 GB of AdamW traffic per step: far past the 32 MiB
last-level cache of the machine the README quotes) and ``ZENFLOW_BENCH_SMOKE=1`` (64K parameters, a couple of
rounds: checks that every provider runs, measures nothing). Threads: ``ZENFLOW_BENCH_THREADS`` (default 2), for
numba and torch alike. Rounds: ``ZENFLOW_BENCH_ROUNDS`` (default 9).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba import njit, prange

__all__ = [
    "BYTES_PER_PARAM",
    "SMOKE",
    "HostBuffers",
    "Provider",
    "bench_numel",
    "bench_rounds",
    "bench_shape",
    "bench_threads",
    "ceiling_",
    "deepspeed_cpu_adam",
    "make_host_buffers",
    "make_providers",
    "make_slot",
    "median_seconds",
]

SMOKE = os.environ.get("ZENFLOW_BENCH_SMOKE", "0") not in ("", "0")

# Bytes each provider must move per parameter (GB/s figures use these; write-allocate reads are not counted).
# AdamW reads master, m, v, grad and writes master, m, v: fp32 grad 4 * 4 + 3 * 4 = 28. bf16 grad in and bf16
# snapshot out: 12 + 2 read, 12 + 2 written = 28 as well. torch fused AdamW (fp32 grad) then a separate
# fp32 -> bf16 copy of the weights: 28 + 4 read + 2 written = 34.
BYTES_PER_PARAM = {"fp32": 28, "bf16": 28, "torch+copy": 34, "ceiling": 28}

_COLS = 16384  # a 4096 x 16384 matrix at 64M: the shape of a large MLP weight; rows give the parallelism


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
    """Slot map with ``round(selected * cols)`` selected columns: ``random`` (as top-k picks them) or ``block``."""
    k = round(selected * cols)
    slot = torch.full((cols,), -1, dtype=torch.int32)
    if k == 0:
        return slot
    if pattern == "random":
        cols_sel = torch.randperm(cols, generator=torch.Generator().manual_seed(seed))[:k]
    elif pattern == "block":
        cols_sel = torch.arange(k)
    else:
        raise ValueError(f"unknown pattern {pattern!r}")
    slot[cols_sel] = torch.arange(k, dtype=torch.int32)
    return slot


# No cache=True here: numba's cache records the importing module's name, and this file is imported both as
# `common` (pytest, scripts) and possibly as `bench.common`; a cache written under one name breaks the other.
@njit(nogil=True)
def _ceiling_run(p, m, v, g, a, b):  # pragma: no cover - numba
    # Its own function with unsigned indices so that LLVM vectorizes it (see kernels/cpu_adamw.py).
    for i in range(a, b):
        gi = g[i]
        p[i] = p[i] + gi
        m[i] = m[i] + gi
        v[i] = v[i] + gi


@njit(parallel=True, nogil=True)
def _ceiling_kernel(p, m, v, g, chunk):  # pragma: no cover - numba
    n = p.shape[0]
    for c in prange((n + chunk - 1) // chunk):
        a = c * chunk
        _ceiling_run(p, m, v, g, np.uint64(a), np.uint64(min(a + chunk, n)))


def ceiling_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
    """Same traffic as fp32 AdamW (read 4 fp32 arrays, write 3), trivial math: the memory-bandwidth ceiling.

    A plain streaming loop, as the issue defines it (no software prefetch): host_adamw_'s prefetching can
    take it slightly past this "ceiling" on a quiet machine.
    """
    # Work items of 16384 elements; the item size makes no measurable difference from 1024 to 65536 (the same
    # sweep for host_adamw_'s _CHUNK_COLS).
    _ceiling_kernel(p.view(-1).numpy(), m.view(-1).numpy(), v.view(-1).numpy(), g.view(-1).numpy(), 16384)


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


@dataclass
class Provider:
    """One way of doing a host AdamW step on a ``[R, C]`` parameter; ``step()`` runs it once, in place."""

    name: str
    step: Callable[[], object]
    numel: int
    bytes_per_param: int
    updated_fraction: float = 1.0
    group: str = "fp32"  # providers in a group are compared with each other: "fp32" or "bf16"


def _host_kwargs(b: HostBuffers, slot: torch.Tensor, threads: int) -> dict:
    return dict(count=1, slot=slot, col_step=b.col_step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.01, snapshot=b.snapshot, num_threads=threads)


def deepspeed_cpu_adam() -> type | None:
    """DeepSpeed's ``DeepSpeedCPUAdam`` when deepspeed imports and its C++ op builds, else None."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # ImportError, or deepspeed's own errors when its accelerator or op builder is unusable
        return None
    return DeepSpeedCPUAdam


def make_providers(
    numel: int | None = None, *, threads: int | None = None, selected: tuple[float, ...] = (0.0, 0.1, 0.5),
    patterns: tuple[str, ...] = ("random",), names: tuple[str, ...] | None = None,
) -> dict[str, Provider]:
    """Every provider the README table compares, each on its own buffers (a provider never sees another's data).

    Providers: ``ceiling``; ``host_adamw fp32 <sel>``; ``torch fused``; ``host_adamw bf16 <sel>`` (bf16 grad in,
    bf16 snapshot out); ``torch fused + bf16 copy`` (fp32 grad, then ``snapshot.copy_(param)``); ``deepspeed``
    (``DeepSpeedCPUAdam``, when importable). ``names`` restricts the set (to keep memory down).
    Sets torch's and numba's thread counts for the process to ``threads``.
    """
    from zenflow_triton.kernels.cpu_adamw import host_adamw_

    threads = bench_threads() if threads is None else threads
    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    rows, cols = bench_shape(numel)
    n = rows * cols
    out: dict[str, Provider] = {}

    def want(name: str) -> bool:
        return names is None or name in names

    if want("ceiling"):
        c = make_host_buffers(rows, cols)
        out["ceiling"] = Provider("ceiling", lambda: ceiling_(c.master, c.exp_avg, c.exp_avg_sq, c.grad), n,
                                  BYTES_PER_PARAM["ceiling"])
    for group, gdt, sdt in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, torch.bfloat16)):
        todo = [(s, p) for s in selected for p in (patterns if s else ("random",))]
        labels = {(s, p): f"host_adamw {group} {s:.0%}" + ("" if not s or p == "random" else f" {p}")
                  for s, p in todo}
        if not any(want(v) for v in labels.values()):
            continue
        b = make_host_buffers(rows, cols, grad_dtype=gdt, snapshot_dtype=sdt, seed=1)
        for (s, p), label in labels.items():
            if not want(label):
                continue
            kw = _host_kwargs(b, make_slot(cols, s, pattern=p), threads)
            out[label] = Provider(
                label, lambda b=b, kw=kw: host_adamw_(b.master, b.exp_avg, b.exp_avg_sq, b.grad, **kw), n,
                BYTES_PER_PARAM[group], 1.0 - round(s * cols) / cols, group)
    for label, copy in (("torch fused", False), ("torch fused + bf16 copy", True)):
        if not want(label):
            continue
        t = make_host_buffers(rows, cols, snapshot_dtype=torch.bfloat16 if copy else None, seed=2)
        param = torch.nn.Parameter(t.master)
        param.grad = t.grad
        opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
        if copy:
            def step(opt=opt, param=param, snap=t.snapshot):
                opt.step()
                snap.copy_(param.detach())
        else:
            step = opt.step
        out[label] = Provider(label, step, n, BYTES_PER_PARAM["torch+copy" if copy else "fp32"], 1.0,
                              "bf16" if copy else "fp32")
    cpu_adam = deepspeed_cpu_adam() if want("deepspeed") else None
    if cpu_adam is not None:
        d = make_host_buffers(rows, cols, seed=3)
        dparam = torch.nn.Parameter(d.master)
        dparam.grad = d.grad
        dopt = cpu_adam([dparam], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw_mode=True)
        out["deepspeed"] = Provider("deepspeed", dopt.step, n, BYTES_PER_PARAM["fp32"])
    return out
