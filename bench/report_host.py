"""Time every host AdamW provider in one process and print the markdown table docs/performance.md quotes.

    python bench/report_host.py [--rounds 15] [--numel 67108864] [--threads 2] [--names "ceiling,torch fused"]
    python bench/report_host.py --tune   # the sweeps behind the tuning constants of kernels/cpu_adamw.py
    python bench/report_host.py --accumulate   # accumulate="host"'s add kernel against the bandwidth ceiling

Rounds are interleaved (round i runs every provider once, in a rotated order), so that load from other processes
or a change of clock speed hits every provider alike; the table shows medians. Ratios: ``vs ceiling`` and
``vs torch`` compare seconds per step of the same matrix (> 1 = faster than the ceiling/torch; ``vs ceiling, same
round`` is the median of the per-round ratios, steadier where the machine's speed moves: ``same_round``), where
"torch" is ``torch fused`` for the fp32 group and ``torch fused + bf16 copy`` for the bf16 group (bf16 grad in,
bf16 snapshot out); the "bf16 moments" group (state_dtype="bfloat16", 20 B/param; ``... per-column steps``: step counts
that differ between columns, as in training) is compared with ``ceiling bf16 moments``, a loop with its traffic,
and the "bf16 moments, no snapshot" group (the host job with no snapshot output, 18 B/param: ``host_adamw bf16
moments no snapshot <sel>``) with ``ceiling bf16 moments no snapshot``. ``Mparam/s`` counts every parameter of the
matrix, selected or not.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numba
import torch
from common import bench_numel, bench_rounds, bench_shape, bench_threads, make_host_buffers, make_slot
from providers import (
    BYTES_PER_PARAM,
    HOST_HP,
    HostAdamWProvider,
    ceiling_,
    ceiling_bf16_moments_,
    host_adamw_providers,
    host_adamw_step,
)

from zenflow_triton.kernels import cpu_adamw


def _cpu_busy_fraction(interval: float = 0.2) -> float:
    """Fraction of all CPUs busy over ``interval`` seconds (/proc/stat), to flag a noisy machine."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]

    try:
        t0, i0 = read()
        time.sleep(interval)
        t1, i1 = read()
    except OSError:
        return float("nan")
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


# The host job with bf16 moments and no snapshot output (the merge reads the fp32 master): master 4 + 4, m and v
# 2 + 2 each, bf16 grad 2 = 18 B/param. Its providers live here, not in providers.py; its ceiling is
# providers.ceiling_bf16_moments_ without the snapshot stream.
NO_SNAPSHOT = "bf16 moments, no snapshot"
_NO_SNAPSHOT_BYTES = 18


def no_snapshot_providers(numel: int, threads: int, names: tuple[str, ...] | None,
                          selected: tuple[float, ...] = (0.0, 0.1)) -> dict[str, HostAdamWProvider]:
    """``ceiling bf16 moments no snapshot`` and ``host_adamw bf16 moments no snapshot <sel>`` (bf16 grad in, no
    snapshot out), the ones ``names`` asks for (all of them when it is None)."""
    rows, cols = bench_shape(numel)
    n = rows * cols
    out: dict[str, HostAdamWProvider] = {}

    def buffers(seed: int):
        b = make_host_buffers(rows, cols, grad_dtype=torch.bfloat16, seed=seed)
        return dataclasses.replace(b, exp_avg=b.exp_avg.to(torch.bfloat16), exp_avg_sq=b.exp_avg_sq.to(torch.bfloat16))

    label = "ceiling bf16 moments no snapshot"
    if names is None or label in names:
        c = buffers(0)
        out[label] = HostAdamWProvider(label, lambda: ceiling_bf16_moments_(c.master, c.exp_avg, c.exp_avg_sq, c.grad,
                                                                            None),
                                       n, _NO_SNAPSHOT_BYTES, 1.0, NO_SNAPSHOT)
    for sel in selected:
        label = f"host_adamw bf16 moments no snapshot {sel:.0%}"
        if names is None or label in names:
            out[label] = HostAdamWProvider(label, host_adamw_step(buffers(6), make_slot(cols, sel), threads), n,
                                           _NO_SNAPSHOT_BYTES, 1.0 - round(sel * cols) / cols, NO_SNAPSHOT)
    return out


def measure(providers: dict[str, HostAdamWProvider], rounds: int, pause: float = 0.05) -> dict[str, list[float]]:
    """Seconds per call for each provider over ``rounds`` interleaved rounds, after one untimed call each."""
    names = list(providers)
    for name in names:
        providers[name].step()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            # Let the other runtime's OpenMP threads (torch's or numba's) stop spinning before the clock starts.
            time.sleep(pause)
            t0 = time.perf_counter()
            providers[name].step()
            times[name].append(time.perf_counter() - t0)
    return times


def table(providers: dict[str, HostAdamWProvider], times: dict[str, list[float]], stat: str = "median") -> str:
    """Markdown table; ``stat`` picks the statistic the rates and ratios use: ``median`` or ``min``."""
    pick = statistics.median if stat == "median" else min
    med = {name: pick(ts) for name, ts in times.items()}
    base = {"fp32": med.get("torch fused"), "bf16": med.get("torch fused + bf16 copy")}
    # each group against a ceiling of its own traffic
    ceilings = {"bf16 moments": "ceiling bf16 moments", NO_SNAPSHOT: "ceiling bf16 moments no snapshot"}
    lines = [
        f"| provider | updated | ms ({stat}) | ms (min / max) | Mparam/s | GB/s | vs ceiling | vs ceiling, same round "
        "| vs torch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in providers.items():
        t = med[name]
        ref = base.get(p.group)
        ceiling = times.get(ceilings.get(p.group, "ceiling")) or times.get("ceiling")
        lines.append(
            f"| {name} | {p.updated_fraction:.0%} | {t * 1e3:.1f} | {min(times[name]) * 1e3:.1f} / "
            f"{max(times[name]) * 1e3:.1f} | {p.numel / t / 1e6:.0f} | {p.numel * p.bytes_per_param / t / 1e9:.1f} | "
            f"{(pick(ceiling) / t) if ceiling else float('nan'):.3f} | "
            f"{same_round(ceiling, times[name]) if ceiling else float('nan'):.3f} | "
            f"{(ref / t) if ref else float('nan'):.3f} |"
        )
    return "\n".join(lines)


def same_round(ceiling: list[float], row: list[float]) -> float:
    """Median over rounds of ``ceiling / row``, each pair timed in the same round (under a second apart). The CPU's
    share on a shared machine can move by 1.5x between rounds independently of the memory's, and a ratio of medians
    may then pair a slow ceiling with a fast row; this ratio follows each row's own rounds."""
    return statistics.median(c / x for c, x in zip(ceiling, row, strict=True))


def tune(numel: int, threads: int, rounds: int) -> None:
    """Sweep kernels/cpu_adamw.py's tuning constants (module globals, read per call); rounds are interleaved.

    Prints ms per step (median and min over rounds) for each setting.
    """
    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    saved = {k: getattr(cpu_adamw, k) for k in ("_CHUNK_COLS", "_SKIP_BLOCK", "_MIN_PARALLEL_ELEMS")}

    def case(b, slot, n_threads=threads, repeat=1, **consts) -> HostAdamWProvider:
        kw = dict(count=1, slot=slot, col_step=b.col_step, hp=HOST_HP, snapshot=b.snapshot, num_threads=n_threads)

        def step() -> None:
            for k, v in {**saved, **consts}.items():
                setattr(cpu_adamw, k, v)
            for _ in range(repeat):
                cpu_adamw.host_adamw_(b.master, b.exp_avg, b.exp_avg_sq, b.grad, **kw)

        return HostAdamWProvider("", step, b.numel, 28)

    def report(title: str, cases: dict[str, HostAdamWProvider], scale: float = 1e3, unit: str = "ms") -> None:
        times = measure(cases, rounds, pause=0.01)
        print(f"\n{title}\n\n| setting | {unit} (median) | {unit} (min) |\n|---|---:|---:|")
        for name, ts in times.items():
            print(f"| {name} | {statistics.median(ts) * scale:.1f} | {min(ts) * scale:.1f} |")

    try:
        wide = make_host_buffers(max(1, numel // 16384), min(numel, 16384))
        flat = make_host_buffers(1, numel)
        cols = wide.master.shape[1]
        report("_CHUNK_COLS (fp32, nothing selected)", {
            f"{shape} chunk {c}": case(b, make_slot(b.master.shape[1], 0.0), _CHUNK_COLS=c)
            for c in (1024, 4096, 16384, 65536) for shape, b in (("R x 16384", wide), ("1 x numel", flat))})
        del flat
        runs32 = torch.full((cols,), -1, dtype=torch.int32)
        for j in range(0, cols, 320):  # 10% selected in runs of 32 columns
            runs32[j:j + 32] = 0
        patterns = {"10% random": make_slot(cols, 0.1), "50% random": make_slot(cols, 0.5),
                    "10% in runs of 32": runs32, "10% block": make_slot(cols, 0.1, pattern="block")}
        report("_SKIP_BLOCK (fp32; 4096 = skip only whole work items)", {
            f"{name}, block {k}": case(wide, slot, _SKIP_BLOCK=k)
            for name, slot in patterns.items() for k in (16, 64, 256, 4096)})
        del wide
        small = {}
        for n in (1 << 12, 1 << 14, 1 << 15, 1 << 16, 1 << 18):
            b = make_host_buffers(max(1, n // 1024), min(n, 1024), grad_dtype=torch.bfloat16,
                                  snapshot_dtype=torch.bfloat16)
            for t in (1, threads):
                small[f"{n} elements, {t} thread(s)"] = case(b, make_slot(b.master.shape[1], 0.0), t, repeat=100,
                                                             _MIN_PARALLEL_ELEMS=0)
        report("_MIN_PARALLEL_ELEMS (bf16 grad and snapshot; per call, 100 calls back to back)", small, 1e4, "us")
    finally:
        for k, v in saved.items():
            setattr(cpu_adamw, k, v)


def accumulate_report(numel: int, threads: int, rounds: int) -> str:
    """accumulate="host"'s per-step add (``host_accumulate_``: ``sum += g``, fp32 sum, fp32 or bf16 g) against the
    memory-bandwidth ceiling, interleaved with it in one run: ``vs ceiling`` is the add's GB/s over the ceiling's
    (AdamW's 4 reads and 3 writes per element); ``torch copy_`` is a second ceiling with the add's own mix of reads
    and writes."""
    from zenflow_triton.kernels.host_accumulate import host_accumulate_

    numba.set_num_threads(threads)
    rows, cols = bench_shape(numel)
    n = rows * cols
    c = make_host_buffers(rows, cols)
    providers = {"ceiling": HostAdamWProvider("ceiling", lambda: ceiling_(c.master, c.exp_avg, c.exp_avg_sq, c.grad),
                                              n, BYTES_PER_PARAM["ceiling"]),
                 # A second ceiling with the add's own read/write mix: torch's threaded copy (read 4 B, write 4 B).
                 "torch copy_ fp32": HostAdamWProvider("torch copy_ fp32", lambda: c.exp_avg.copy_(c.grad), n, 8)}
    torch.set_num_threads(threads)
    for label, dtype, nbytes in (("accumulate fp32", torch.float32, 12), ("accumulate bf16", torch.bfloat16, 10)):
        b = make_host_buffers(rows, cols, grad_dtype=dtype, seed=4)

        def step(b=b) -> None:
            host_accumulate_(b.exp_avg, b.grad, accumulate=True, num_threads=threads)

        providers[label] = HostAdamWProvider(label, step, n, nbytes)
    times = measure(providers, rounds)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    gbps = {name: p.numel * p.bytes_per_param / med[name] / 1e9 for name, p in providers.items()}
    lines = [f"numel {n}, threads {threads}, {rounds} interleaved rounds (medians)", "",
             "| provider | bytes/param | ms | GB/s | vs ceiling (GB/s) |", "|---|---:|---:|---:|---:|"]
    for name, p in providers.items():
        lines.append(f"| {name} | {p.bytes_per_param} | {med[name] * 1e3:.2f} | {gbps[name]:.1f} | "
                     f"{gbps[name] / gbps['ceiling']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: ZENFLOW_BENCH_ROUNDS or 9)")
    ap.add_argument("--numel", type=int, default=None, help="parameters (default: ZENFLOW_BENCH_NUMEL or 64M)")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: ZENFLOW_BENCH_THREADS or 2)")
    ap.add_argument("--names", default=None, help="comma-separated provider names (default: all)")
    ap.add_argument("--patterns", default="random,block", help="selection patterns for 10%%/50%%: random,block")
    ap.add_argument("--tune", action="store_true", help="sweep the kernel's tuning constants instead")
    ap.add_argument("--accumulate", action="store_true",
                    help="time accumulate='host''s add kernel against the bandwidth ceiling instead")
    args = ap.parse_args(argv)
    numel = bench_numel() if args.numel is None else args.numel
    threads = bench_threads() if args.threads is None else args.threads
    rounds = bench_rounds() if args.rounds is None else args.rounds
    if args.tune:
        tune(numel, threads, rounds)
        return
    if args.accumulate:
        print(accumulate_report(numel, threads, rounds))
        return
    names = None if args.names is None else tuple(n.strip() for n in args.names.split(","))
    providers = host_adamw_providers(numel, threads=threads, names=names, patterns=tuple(args.patterns.split(",")))
    providers.update(no_snapshot_providers(numel, threads, names))
    busy_before = _cpu_busy_fraction()
    times = measure(providers, rounds)
    busy_after = _cpu_busy_fraction()
    print(f"numel {numel}, threads {threads}, {rounds} interleaved rounds; "
          f"CPU busy before/after (other processes): {busy_before:.0%} / {busy_after:.0%}")
    print(table(providers, times, "median"))
    print()
    print("Best round of each provider (the round least disturbed by other processes):")
    print(table(providers, times, "min"))


if __name__ == "__main__":
    main()
