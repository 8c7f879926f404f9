"""Host probes (DESIGN §8): the host AdamW kernel's throughput and ``accumulate="host"``'s add, each at every thread
count and landing dtype, on buffers sized against the last-level cache; repeats interleaved (:mod:`.timing`).
:mod:`.probes` runs them inside :func:`~.probes.probe_machine`. Nothing runs at import: numba compiles inside the
probe functions."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .profile import BandwidthCurve, CpuAdamwRates, HostAddRates
from .timing import Progress, best_seconds, fmt_bytes, interleaved, say, spread_of

if TYPE_CHECKING:
    from zenflow_triton.kernels import AdamHyperparams

__all__ = ["measure_host_adamw", "measure_host_add", "probe_hyperparams"]

_ADAMW_COLS = 4096
# Bytes the host add streams per element beyond the landed gradient: the fp32 sum read and written.
_ADD_SUM_BYTES = 2 * 4
# Landed gradient bytes per element, by landing dtype.
_LANDING_BYTES = {"float32": 4, "bfloat16": 2}

def probe_hyperparams() -> AdamHyperparams:
    """Typical fine-tuning values; the kernels' speed does not depend on them."""
    from zenflow_triton.kernels import AdamHyperparams

    return AdamHyperparams(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def measure_host_adamw(
    *,
    numel: int,
    thread_counts: Sequence[int],
    repeats: int = 3,
    grad_dtypes: Sequence[str] = ("float32", "bfloat16"),
    progress: Progress | None = None,
    spread: dict[str, float] | None = None,
    durations: dict[str, float] | None = None,
) -> CpuAdamwRates:
    """Params/s of the host AdamW kernel at each thread count and landing dtype (bf16 snapshot written).

    Uses ``kernels.cpu_adamw`` (numba); falls back to ``kernels.reference`` (torch threads) if that cannot be
    imported. The first call may compile the numba kernel (cached on disk afterwards). ``spread``, when given,
    receives each rate's spread (``"host AdamW float32 2 threads"``), ``durations`` the seconds spent compiling
    (``"compile"``), which a first run pays and later runs do not.
    """
    from zenflow_triton.host_memory import HostSlab

    try:
        from zenflow_triton.kernels.cpu_adamw import host_adamw_

        kernel = "numba"
    except ImportError:
        from zenflow_triton.kernels.reference import host_adamw_

        kernel = "torch-reference"
    rows = max(1, -(-numel // _ADAMW_COLS))
    cols = _ADAMW_COLS if numel >= _ADAMW_COLS else numel
    shape = (rows, cols)
    slab = HostSlab([(shape, torch.float32)] * 4 + [(shape, torch.bfloat16)] * 2, pin=False)
    master, exp_avg, exp_avg_sq, grad32, grad16, snapshot = slab.views
    master.fill_(0.5)
    exp_avg.zero_()
    exp_avg_sq.zero_()
    grad32.fill_(1e-3)
    grad16.fill_(1e-3)
    slot = torch.full((cols,), -1, dtype=torch.int32)  # every column is the host's, as with topk_ratio=0
    col_step = torch.full((cols,), 10, dtype=torch.int32)
    hp = probe_hyperparams()

    big = (master, exp_avg, exp_avg_sq, snapshot, slot, col_step)

    def call(grad: torch.Tensor, threads: int, bufs: tuple[torch.Tensor, ...]) -> None:
        m, v, s, snap, sl, cs = bufs
        # count=4: a window's gradient is a sum, so the division path is the one that runs in practice.
        kwargs = dict(count=4, slot=sl, col_step=cs, hp=hp, snapshot=snap)
        if kernel == "numba":
            host_adamw_(m, v, s, grad, num_threads=threads, **kwargs)
        else:
            host_adamw_(m, v, s, grad, **kwargs)

    # Compile (or load from numba's disk cache) both specializations first, so no timing below includes it.
    tiny = (torch.zeros(1, 64), torch.zeros(1, 64), torch.zeros(1, 64), torch.zeros(1, 64, dtype=torch.bfloat16),
            torch.full((64,), -1, dtype=torch.int32), torch.ones(64, dtype=torch.int32))
    tiny_grads = {"float32": torch.zeros(1, 64), "bfloat16": torch.zeros(1, 64, dtype=torch.bfloat16)}
    start = time.perf_counter()
    for dt in grad_dtypes:
        call(tiny_grads[dt], 1, tiny)
    compile_s = time.perf_counter() - start
    if durations is not None:
        durations["compile"] = compile_s
    if compile_s > 0.5:
        say(progress, f"host AdamW ({kernel}): compiled in {compile_s:.1f} s (cached for later runs)")

    def at(grad: torch.Tensor, threads: int) -> None:
        if kernel != "numba":
            torch.set_num_threads(threads)
        call(grad, threads, big)

    rates: dict[str, dict[int, float]] = {}
    overhead: dict[int, float] = {}
    total = rows * cols
    torch_threads = torch.get_num_threads()
    try:
        for t in thread_counts:
            if kernel != "numba":
                torch.set_num_threads(t)
            # Fixed per-call cost (checks, column plan, waking t threads), paid once per parameter per window.
            overhead[int(t)] = best_seconds(lambda t=t: call(tiny_grads["float32"], t, tiny), repeats=10, warmup=2)
        for dt in grad_dtypes:
            grad = grad32 if dt == "float32" else grad16
            rates[dt] = {}
            # Rounds over the thread counts: the repeats of one count lie a whole round apart.
            times = interleaved([lambda t=t, g=grad: at(g, t) for t in thread_counts], repeats)
            for t, ts in zip(thread_counts, times):
                sec = min(ts)
                rates[dt][int(t)] = total / sec
                if spread is not None:
                    spread[f"host AdamW {dt} {t} threads"] = spread_of(ts)
                say(progress, f"host AdamW ({kernel}) {dt} grad, {t} thread(s): {total / sec / 1e6:.0f} M params/s "
                               f"(spread {spread_of(ts):.0%} over {len(ts)} repeats)")
    finally:
        torch.set_num_threads(torch_threads)
    say(progress, "host AdamW call overhead: " + ", ".join(f"{t} thread(s) {s * 1e6:.0f} us"
                                                            for t, s in overhead.items()))
    return CpuAdamwRates(kernel=kernel, numel=total, rates=rates, call_overhead_s=overhead)


def measure_host_add(
    *,
    numels: Sequence[int],
    thread_counts: Sequence[int],
    repeats: int = 5,
    landings: Sequence[str] = ("float32", "bfloat16"),
    progress: Progress | None = None,
    spread: dict[str, float] | None = None,
    durations: dict[str, float] | None = None,
) -> HostAddRates:
    """Bytes streamed per second by accumulate="host"'s add (``kernels.host_accumulate``: fp32 ``sum += g``), at each
    landing dtype, thread count and size in ``numels``. A call of n elements streams ``n * (8 + landing bytes)``
    (the sum read and written, the landed gradient read).

    Uses the numba kernel the optimizer's adder runs, with the adder's ``num_threads``; falls back to
    ``kernels.reference`` (torch) where numba cannot be imported. Every (dtype, threads, size) is timed once per
    round, ``repeats`` rounds after a warm-up round; the best time of each goes into its curve and its spread into
    ``spread`` (``"host add float32 2 threads 1 MiB"``, the size in bytes of the fp32 sum); ``durations`` receives
    the seconds spent compiling (``"compile_add"``).
    """
    from zenflow_triton.host_memory import HostSlab

    try:
        from zenflow_triton.kernels.host_accumulate import host_accumulate_

        kernel = "numba"
    except ImportError:
        from zenflow_triton.kernels.reference import host_accumulate_

        kernel = "torch-reference"
    sizes = sorted({int(n) for n in numels})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"Invalid host add sizes: {numels!r}")
    top = sizes[-1]
    slab = HostSlab([((top,), torch.float32), ((top,), torch.float32), ((top,), torch.bfloat16)], pin=False)
    total, grad32, grad16 = slab.views
    total.zero_()
    grad32.fill_(1e-3)  # the sum stays finite over any number of rounds
    grad16.fill_(1e-3)
    grads = {"float32": grad32, "bfloat16": grad16}

    def call(dt: str, threads: int, n: int) -> None:
        if kernel == "numba":
            host_accumulate_(total[:n], grads[dt][:n], accumulate=True, num_threads=threads)
        else:
            host_accumulate_(total[:n], grads[dt][:n], accumulate=True)

    start = time.perf_counter()
    for dt in landings:  # compile (or load from numba's disk cache) the serial and parallel specializations
        call(dt, 1, 1)
        call(dt, max(thread_counts), top)
    compile_s = time.perf_counter() - start
    if durations is not None:
        durations["compile_add"] = compile_s
    if compile_s > 0.5:
        say(progress, f"host add ({kernel}): compiled in {compile_s:.1f} s (cached for later runs)")

    keys = [(dt, int(t), n) for dt in landings for t in thread_counts for n in sizes]
    torch_threads = torch.get_num_threads()

    def timed(dt: str, t: int, n: int) -> None:
        if kernel != "numba":
            torch.set_num_threads(t)
        call(dt, t, n)

    try:
        # Rounds over every (dtype, threads, size): the repeats of one figure lie a whole round apart.
        times = interleaved([lambda k=k: timed(*k) for k in keys], repeats)
    finally:
        torch.set_num_threads(torch_threads)
    points: dict[str, dict[int, list[tuple[int, float]]]] = {}
    for (dt, t, n), ts in zip(keys, times):
        nbytes = n * (_ADD_SUM_BYTES + _LANDING_BYTES[dt])
        points.setdefault(dt, {}).setdefault(t, []).append((nbytes, nbytes / min(ts)))
        if spread is not None:
            spread[f"host add {dt} {t} threads {fmt_bytes(4 * n)}"] = spread_of(ts)
    curves = {dt: {t: BandwidthCurve(kind=f"host-add-{dt}", points=tuple(pts)) for t, pts in tab.items()}
              for dt, tab in points.items()}
    for dt, tab in curves.items():
        for t, curve in tab.items():
            say(progress, f"host add ({kernel}) {dt} landing, {t} thread(s): "
                           + ", ".join(f"{fmt_bytes(4 * n)} sum {bw / 1e9:.1f} GB/s"
                                       for n, (_, bw) in zip(sizes, curve.points)))
    return HostAddRates(kernel=kernel, curves=curves)

