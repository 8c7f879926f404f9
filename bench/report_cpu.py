"""The optimizer step on CPU tensors against torch's fused AdamW: every optimizer timed in ONE process on the same
weights, with the verdicts on the project's CPU goals.

Run: ``python bench/report_cpu.py [--params N] [--rounds R] [--out DIR] [--profile PROVIDER]``, or
``python bench/report_cpu.py --ops`` for the single-thread cost of each operation of a ZenFlow step.

The weights are ``[2048, 2048]`` fp32 matrices (about 33M parameters by default, eight of them) plus one resident
bias per matrix; each step's gradients come from a few precomputed random sets with a fixed per-column scale (so
top-k selection has stable, realistic structure). There is no forward or backward: this measures ``step()``.
The weights, the gradients (``common.py``) and the optimizers (``providers.py``) are the ones every optimizer
bench uses.

One *round* of a provider is one selection period of ZenFlow (``select_interval`` steps, 8 windows by default),
so it contains exactly one selection step; a ZenFlow round ends with ``flush()`` inside the timed region, so
every window's host job is paid inside the round that submitted it (the pipeline starts and ends each round
empty, which is exactly what the selection step at the start of the next period would force anyway). Rounds
of all providers are interleaved (rotated order) so that load from other processes hits every provider alike;
each figure is the median over rounds.

Reported per ZenFlow provider:
- ``step incl. selection``: (all step times + the closing flush) / steps of the round: whole windows, including
  the selection window and the pipeline drain it forces;
- ``step excl. selection``: the mean over the windows that hold no selection step (steady state);
- stall per step (``stats()['stall_s']``) and host bytes per offloaded parameter
  (``stats()['host_bytes_per_param']``).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import gc
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import BENCH_DIR, SMOKE, gradient_sets, load_average, machine_info, make_weights
from providers import (
    HP,
    OPTIMIZER_HP,
    OptimizerProvider,
    auto_unavailable_reason,
    close_optimizer,
    optimizer_memory,
    optimizer_providers,
    steps_before_selection,
)

from zenflow_triton.kernels import load_device_ops

__all__ = ["main"]

DEFAULT_PARAMS = 33_554_432  # 8 x [2048, 2048]: the size of docs/performance.md's table


# ----------------------------------------------------------------------------------------------------- timing


@dataclass
class RoundResult:
    """One round of one provider: per-step wall times and what the closing flush cost."""

    step_s: list[float]
    flush_s: float
    stall_s: float


@dataclass
class ProviderRun:
    """A provider's live optimizer, its weights, and the rounds measured so far."""

    provider: OptimizerProvider
    params: list[torch.Tensor]
    opt: Any
    round_steps: int
    update_interval: int
    select_interval: int = 0
    rounds: list[RoundResult] = field(default_factory=list)
    step_counter: int = 0


def _stats(opt: Any) -> dict[str, Any]:
    stats = getattr(opt, "stats", None)
    return stats() if callable(stats) else {}


def _set_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g


def _steps(run: ProviderRun, grad_sets: list[list[torch.Tensor]], n: int) -> list[float]:
    times = []
    for _ in range(n):
        _set_grads(run.params, grad_sets[run.step_counter % len(grad_sets)])
        run.step_counter += 1
        t0 = time.perf_counter()
        run.opt.step()
        times.append(time.perf_counter() - t0)
    return times


def start_provider(provider: OptimizerProvider, weights: Sequence[torch.Tensor], grad_sets: list[list[torch.Tensor]],
                   *, torch_round_steps: int) -> ProviderRun:
    """Copy the weights, build the optimizer, and run it to the start of a selection period (untimed): the
    ``"auto"`` warm-up, then one whole period (compiles numba, touches every buffer), then a flush."""
    params = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    opt = provider.build(params)
    run = ProviderRun(provider, params, opt, torch_round_steps, 1)
    if not provider.zenflow:
        _steps(run, grad_sets, 3)
        return run
    _steps(run, grad_sets, steps_before_selection(opt))
    _steps(run, grad_sets, 1)  # the first selection step: resolves "auto", fixes U and S
    s = opt.stats()
    run.update_interval, run.select_interval = int(s["update_interval"]), int(s["select_interval"])
    _steps(run, grad_sets, run.select_interval - 1)
    opt.flush()
    # Whole selection periods, at least as many steps as a torch round (sync offload's period is 8 steps).
    run.round_steps = run.select_interval * max(1, -(-torch_round_steps // run.select_interval))
    return run


def time_round(run: ProviderRun, grad_sets: list[list[torch.Tensor]]) -> RoundResult:
    """One selection period (ZenFlow) or ``round_steps`` steps (torch), flush included for ZenFlow."""
    stall0 = _stats(run.opt).get("stall_s", 0.0)
    times = _steps(run, grad_sets, run.round_steps)
    flush = 0.0
    if run.provider.zenflow:
        t0 = time.perf_counter()
        run.opt.flush()
        flush = time.perf_counter() - t0
    stall = _stats(run.opt).get("stall_s", 0.0) - stall0
    result = RoundResult(times, flush, stall)
    run.rounds.append(result)
    return result


def summarize(run: ProviderRun) -> dict[str, Any]:
    """Medians over rounds of the per-step figures (see the module docstring)."""
    u, n = run.update_interval, run.round_steps
    incl, excl, sel_window, stall, flush = [], [], [], [], []
    for r in run.rounds:
        incl.append((sum(r.step_s) + r.flush_s) / n)
        stall.append(r.stall_s / n)
        flush.append(r.flush_s)
        if run.provider.zenflow and run.select_interval > u:
            # Rounds start at a selection period's first step, so the selection steps open windows w*U % S == 0.
            windows = [sum(r.step_s[w * u:(w + 1) * u]) / u for w in range(n // u)]
            sel = [w for w in range(len(windows)) if (w * u) % run.select_interval == 0]
            sel_window.append(statistics.mean(windows[w] for w in sel))
            excl.append(statistics.mean(x for w, x in enumerate(windows) if w not in sel))
    out: dict[str, Any] = {
        "name": run.provider.name,
        "label": run.provider.label,
        "rounds": len(run.rounds),
        "steps_per_round": n,
        "update_interval": u,
        "step_s": statistics.median(incl),
        "step_s_all_rounds": incl,
        "stall_s_per_step": statistics.median(stall),
    }
    if run.provider.zenflow:
        s = run.opt.stats()
        out.update({
            "step_s_excl_selection": statistics.median(excl) if excl else None,
            "selection_window_step_s": statistics.median(sel_window) if sel_window else None,
            "flush_s": statistics.median(flush),
            "host_job_s_per_window": s["host_job_s"] / s["windows"] if s["windows"] else 0.0,
            "topk_ratio": s["topk_ratio"],
            "select_interval": s["select_interval"],
            "cpu_threads": s["cpu_threads"],
            # Which device-side ops ran ("auto" picks per device): the module the optimizer's backend resolves to
            # on these parameters' device, asked of the same public loader the optimizer uses.
            "backend": load_device_ops(run.opt.config.backend, run.params[0].device).__name__,
        })
        if "auto_reason" in s:
            out["auto_reason"] = s["auto_reason"]
    out.update(optimizer_memory(run.opt, run.params))
    return out


# ----------------------------------------------------------------------------------------------------- reporting


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.1f}"


def markdown(results: list[dict[str, Any]], baseline: str = "torch_adamw_fused") -> str:
    base = next(r["step_s"] for r in results if r["name"] == baseline)
    lines = [
        "| provider | ms/step (whole windows, incl. selection) | × fused | ms/step excl. selection | × fused "
        "| stall ms/step | host B/param | pinned MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        excl = r.get("step_s_excl_selection")
        bpp = r.get("host_bytes_per_param")
        lines.append(
            f"| {r['label']} | {_ms(r['step_s'])} | {r['step_s'] / base:.2f} | {_ms(excl)} | "
            f"{'–' if excl is None else f'{excl / base:.2f}'} | {_ms(r['stall_s_per_step'])} | "
            f"{'–' if bpp is None else f'{bpp:.2f}'} | {r.get('pinned_bytes', 0) / 2**20:.0f} |"
        )
    return "\n".join(lines)


def goals(results: list[dict[str, Any]], bf16_bytes_per_param: float | None) -> list[dict[str, Any]]:
    """The project's goals for CPU tensors (step time against torch fused AdamW, host bytes per parameter), each with
    the measured figure and a verdict."""
    by = {r["name"]: r for r in results}
    base = by["torch_adamw_fused"]["step_s"]
    out = []
    if "sync_offload" in by:
        ratio = by["sync_offload"]["step_s"] / base
        out.append({"goal": "sync offload ≤ 1.3× torch fused", "value": ratio, "met": ratio <= 1.3})
    if "zenflow" in by:
        incl = by["zenflow"]["step_s"] / base
        out.append({"goal": "r=0.1, U=4 ≤ 0.9× torch fused (whole windows incl. selection)", "value": incl,
                    "met": incl <= 0.9})
        excl = by["zenflow"].get("step_s_excl_selection")
        if excl is not None:
            out.append({"goal": "r=0.1, U=4 ≤ 0.9× torch fused (windows excl. selection)", "value": excl / base,
                        "met": excl / base <= 0.9})
        bpp = by["zenflow"]["host_bytes_per_param"]
        out.append({"goal": "host bytes/offloaded param ≤ 18 (fp32 params, fp32 grad landing)", "value": bpp,
                    "met": bpp <= 18})
    if bf16_bytes_per_param is not None:
        out.append({"goal": "host bytes/offloaded param ≤ 18 (bf16 params, fp32 grad landing)",
                    "value": bf16_bytes_per_param, "met": bf16_bytes_per_param <= 18})
    return out


def goals_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| goal | measured | met |", "|---|---:|:---:|"]
    for g in rows:
        # Bytes need three decimals: the per-column step counts add 4 / rows bytes to the 12 + 4 (+ 2) per element.
        value = f"{g['value']:.3f}" if "bytes" in g["goal"] else f"{g['value']:.2f}×"
        lines.append(f"| {g['goal']} | {value} | {'yes' if g['met'] else '**no**'} |")
    return "\n".join(lines)


def bf16_host_bytes_per_param(weights: Sequence[torch.Tensor]) -> float:
    """``stats()['host_bytes_per_param']`` for bf16 copies of the weights (adds the 2-byte snapshot), one step."""
    from zenflow_triton import ZenFlowAdamW

    params = [torch.nn.Parameter(w.detach().to(torch.bfloat16)) for w in weights]
    for p in params:
        p.grad = torch.zeros_like(p)
    with ZenFlowAdamW(params, **HP, topk_ratio=0.1, update_interval=4, warmup_steps=0) as opt:
        opt.step()
        return float(opt.stats()["host_bytes_per_param"])


def op_costs(num_params: int, *, reps: int = 9, threads: int = 1) -> list[dict[str, Any]]:
    """Cost of each operation a ZenFlow step is made of on CPU tensors, next to torch's fused AdamW and plain
    copies of the same bytes (what each op would cost at memory speed).

    One thread for torch and numba alike by default: a single-thread figure is the op's own cost, and it stays
    meaningful on a shared 2-core machine where a parallel region stalls whenever another process holds one of its
    cores; ``threads`` sets another count for both. Sets the calling thread's torch and numba thread counts (a CLI
    mode; nothing runs after it).
    """
    import numba

    from zenflow_triton.kernels import numba_device_ops as dev
    from zenflow_triton.kernels.cpu_adamw import host_adamw_

    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    weights = [w for w in make_weights(num_params) if w.dim() == 2]
    rows, cols = weights[0].shape
    k = -(-cols // 10)
    n = sum(w.numel() for w in weights)
    gen = torch.Generator().manual_seed(0)

    def mats(scale: float = 1.0) -> list[torch.Tensor]:
        return [torch.randn(rows, cols, generator=gen).mul_(scale) for _ in weights]

    grads, accs, params, snaps = mats(1e-3), mats(0.0), mats(0.02), mats(0.02)
    slot10 = torch.full((cols,), -1, dtype=torch.int32)
    slot10[torch.randperm(cols, generator=gen)[:k].sort().values] = torch.arange(k, dtype=torch.int32)
    slot0 = torch.full((cols,), -1, dtype=torch.int32)
    col_step = torch.full((cols,), 10, dtype=torch.int32)
    compact = [[torch.zeros(rows, k) for _ in weights] for _ in range(3)]
    empty = [torch.zeros(rows, 0) for _ in weights]
    scores = [torch.zeros(cols) for _ in weights]
    torch_params = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    for p, g in zip(torch_params, grads):
        p.grad = g
    torch_opt = torch.optim.AdamW(torch_params, **HP, fused=True)

    def fused(slot: torch.Tensor, state: list[list[torch.Tensor]], **kw: Any) -> Callable[[], None]:
        def run() -> None:
            for i in range(len(weights)):
                dev.fused_step_(params[i], grads[i], score=scores[i], slot=slot, col_step=col_step,
                                master=state[0][i], exp_avg=state[1][i], exp_avg_sq=state[2][i], acc=accs[i],
                                hp=OPTIMIZER_HP, **kw)
        return run

    def host(slot: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for i in range(len(weights)):
                host_adamw_(snaps[i], accs[i], params[i], grads[i], count=4, slot=slot, col_step=col_step,
                            hp=OPTIMIZER_HP, num_threads=threads)
        return run

    # (name, bytes per parameter the op must move at least, function)
    ops: list[tuple[str, int, Callable[[], object]]] = [
        ("torch AdamW fused step", 28, torch_opt.step),
        ("torch copy_ (acc -> landing buffer)", 8, lambda: [s_.copy_(a) for s_, a in zip(snaps, accs)]),
        ("torch add_ (acc += g)", 12, lambda: [a.add_(g) for a, g in zip(accs, grads)]),
        ("numba fused_step_ r=0.1, acc += g, scores", 12, fused(slot10, compact, accumulate=True)),
        ("numba fused_step_ r=0.1, acc += g, no scores", 12,
         fused(slot10, compact, accumulate=True, update_score=False)),
        ("numba fused_step_ r=0, acc += g, scores", 12, fused(slot0, [empty] * 3, accumulate=True)),
        ("numba fused_step_ r=0, acc = g, scores", 8, fused(slot0, [empty] * 3, accumulate=False)),
        ("numba merge_ 90% unselected", 8, lambda: [dev.merge_(p, s_, slot10) for p, s_ in zip(params, snaps)]),
        ("numba merge_ 100% unselected", 8, lambda: [dev.merge_(p, s_, slot0) for p, s_ in zip(params, snaps)]),
        ("numba host_adamw_ 90% unselected", 28, host(slot10)),
        ("numba host_adamw_ 100%", 28, host(slot0)),
    ]
    out = []
    for name, nbytes, fn in ops:
        fn()  # compile / first touch
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best = min(times)
        out.append({"op": name, "bytes_per_param": nbytes, "min_s": best, "median_s": statistics.median(times),
                    "GB/s": nbytes * n / best / 1e9, "params": n, "threads": threads})
    return out


def ops_markdown(rows: list[dict[str, Any]]) -> str:
    n = rows[0]["params"] / 1e6
    t = rows[0]["threads"]
    lines = [f"| op ({t} thread{'s' if t > 1 else ''}, {n:.1f}M fp32) | B/param | min ms | median ms | GB/s at min |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['bytes_per_param']} | {r['min_s'] * 1e3:.1f} | {r['median_s'] * 1e3:.1f} "
                     f"| {r['GB/s']:.1f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=(1 << 16) if SMOKE else DEFAULT_PARAMS,
                    help="total weight-matrix parameters (default: 33.5M, 8 x [2048, 2048])")
    ap.add_argument("--rounds", type=int, default=1 if SMOKE else 5, help="timed rounds per provider (median)")
    ap.add_argument("--out", type=Path, default=BENCH_DIR / "results", help="folder for the JSON and markdown")
    ap.add_argument("--only", nargs="*", default=None, help="provider names to run (torch_adamw_fused is always)")
    ap.add_argument("--cpu-threads", type=int, default=None, help="ZenFlowAdamW cpu_threads (default: library's)")
    ap.add_argument("--ops", action="store_true",
                    help="instead: the cost of each operation of a ZenFlow step (the profile's breakdown)")
    ap.add_argument("--threads", type=int, default=1, help="with --ops: torch and numba threads (default 1)")
    ap.add_argument("--max-round-s", type=float, default=60.0,
                    help="a provider whose rounds take longer than this stops after two rounds")
    ap.add_argument("--profile", default=None, metavar="PROVIDER",
                    help="also run cProfile over two extra rounds of this provider and print the top functions")
    args = ap.parse_args(argv)
    if args.ops:
        print(f"# load {load_average()}")
        print(ops_markdown(op_costs(args.params, threads=args.threads)))
        print(f"# load {load_average()}")
        return 0

    info = machine_info()
    print(f"# machine: {info['nproc']} x {info['cpu_model']}, torch {info['torch']} ({info['torch_threads']} "
          f"threads), numba {info['numba']}, git {info['git_rev']}, load {info['load_average']}", flush=True)
    weights = make_weights(args.params)
    grads = gradient_sets(weights)
    offloadable = sum(w.numel() for w in weights if w.dim() >= 2)
    providers = optimizer_providers(cpu_threads=args.cpu_threads)
    if args.only:
        providers = {k: v for k, v in providers.items() if k in args.only or k == "torch_adamw_fused"}
    auto_reason = auto_unavailable_reason()
    if auto_reason:
        print(f"# zenflow_auto skipped: {auto_reason}", flush=True)

    runs: list[ProviderRun] = []
    for p in providers.values():
        t0 = time.perf_counter()
        # torch rounds: as many steps as ZenFlow's default period, so both average over the same number of steps.
        runs.append(start_provider(p, weights, grads, torch_round_steps=32))
        print(f"# warmed up {p.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    for i in range(args.rounds):
        k = i % len(runs)
        for run in runs[k:] + runs[:k]:  # rotate, so drift in the machine's load does not favour one provider
            last = run.rounds[-1] if run.rounds else None
            if last is not None and len(run.rounds) >= 2 and sum(last.step_s) + last.flush_s > args.max_round_s:
                continue  # a long selection period ("auto" may choose one): two rounds of it will do
            r = time_round(run, grads)
            print(f"# round {i + 1}/{args.rounds} {run.provider.name}: "
                  f"{(sum(r.step_s) + r.flush_s) / len(r.step_s) * 1e3:.1f} ms/step", flush=True)

    if args.profile:
        run = next(r for r in runs if r.provider.name == args.profile)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2):
            time_round(run, grads)
        prof.disable()
        run.rounds = run.rounds[:args.rounds]  # profiled rounds run slower; keep them out of the figures
        print(f"\n# cProfile, 2 rounds of {args.profile} (main thread only; the worker shows up as waiting)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)

    results = [summarize(r) for r in runs]
    for run in runs:
        close_optimizer(run.opt)
    del runs
    gc.collect()
    bf16_bpp = bf16_host_bytes_per_param(weights) if "zenflow" in providers else None
    info["load_average_end"] = load_average()
    goal_rows = goals(results, bf16_bpp)

    command = "python bench/report_cpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = (f"{offloadable / 1e6:.1f}M offloaded parameters ({len(weights) // 2} x {list(weights[0].shape)} fp32 "
              f"+ resident biases), {args.rounds} rounds, medians. Load average at start {info['load_average']}, "
              f"at end {info['load_average_end']}.")
    md = "\n\n".join([header, markdown(results), goals_markdown(goal_rows)])
    print("\n" + md)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.date.today().isoformat()
    payload = {"machine": info, "command": command, "params": offloadable, "rounds": args.rounds,
               "results": results, "goals": goal_rows, "bf16_host_bytes_per_param": bf16_bpp}
    (args.out / f"report_cpu-{stamp}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (args.out / f"report_cpu-{stamp}.md").write_text(
        f"# report_cpu {stamp}\n\nMachine: {info['nproc']} x {info['cpu_model']}; torch {info['torch']}, "
        f"numba {info['numba']}; git {info['git_rev']}\n\nCommand: `{command}`\n\n{md}\n")
    print(f"\n# wrote {args.out}/report_cpu-{stamp}.json and .md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
