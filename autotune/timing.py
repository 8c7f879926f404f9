"""Timing for the hardware probes (:mod:`.probes`, :mod:`.host_probes`): best-of-repeats, interleaved rounds and
the *spread* (median repeat over best, minus one) that tells a calm measurement from one taken on a busy machine."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

__all__ = ["MiB", "Progress", "best_seconds", "fmt_bytes", "interleaved", "say", "spread_of", "timed"]

Progress = Callable[[str], None]

MiB = 2**20


def spread_of(times: Sequence[float]) -> float:
    """The median time over the best, minus one: 0.04 means the typical repeat ran 4% slower than the best.

    The median, not the slowest: the slowest of n repeats grows with n, so a full run (more repeats) would look
    noisier than a quick one on the same calm machine.
    """
    best = min(times)
    return statistics.median(times) / best - 1 if best > 0 else 0.0


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1,
                 spread: dict[str, float] | None = None, name: str = "") -> float:
    times = timed(fn, repeats, warmup)
    if spread is not None:
        spread[name] = spread_of(times)
    # The best time: it measures what the hardware can do. Other processes on the machine only ever slow a run
    # down, and on a shared machine they did so by 2-4x at random moments of a few milliseconds (2-core CI VM,
    # load average 5): the median of a handful of short calls followed the neighbours, not the hardware.
    return min(times)


def interleaved(fns: Sequence[Callable[[], object]], repeats: int) -> list[list[float]]:
    """Times of ``repeats`` rounds, each calling every function once (after one untimed warm-up round)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(max(1, repeats)):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return times


def fmt_bytes(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n / 1024:g} KiB"


def say(progress: Progress | None, msg: str) -> None:
    if progress is not None:
        progress(msg)

