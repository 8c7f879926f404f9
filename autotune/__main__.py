"""``python -m zenflow_triton.autotune``: measure this machine, save its profile, show what would be chosen.

Progress goes to stderr; the table (or ``--json``) to stdout. Exit codes, for scripts:

- 0: success
- 2: bad command line (argparse)
- 3: a measurement failed
- 4: no usable profile (``--load`` found none or an invalid one; planning for a GPU the profile lacks)
- 5: could not write the profile or the plot
- 6: an optional dependency is missing (``--plot`` needs matplotlib: ``pip install 'zenflow_triton[plot]'``)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zenflow_triton.config import DEFAULT_SELECT_WINDOWS

from .bridge import MEMORY_BUDGET_FRACTION
from .cache import ENV_VAR, ProfileError, default_profile_path, load_profile, save_profile
from .model import GRAD_BYTES, Plan, Targets, Workload, plan, shapes_for_param_count, stall_grid
from .probes import ProbeSettings, probe_machine
from .profile import Profile

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_PROBE_FAILED", "EXIT_NO_PROFILE", "EXIT_WRITE_FAILED",
           "EXIT_MISSING_DEPENDENCY"]

EXIT_OK = 0
EXIT_PROBE_FAILED = 3
EXIT_NO_PROFILE = 4
EXIT_WRITE_FAILED = 5
EXIT_MISSING_DEPENDENCY = 6

_PARAM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Example models for the "would choose" table when --params is not given: sizes one fine-tunes on such a machine.
_EXAMPLES = {
    "cuda": [(1.3e9, 0.25), (1.3e9, 1.0), (7e9, 0.25), (7e9, 1.0), (13e9, 1.0)],
    "cpu": [(10e6, 0.05), (10e6, 0.5), (100e6, 0.5), (100e6, 2.0), (1e9, 5.0)],
}


def _count(text: str) -> int:
    """A positive count; accepts 7e9, 7_000_000_000, 125M, 7B."""
    t = text.strip().replace("_", "")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}.get(t[-1:].lower(), 1)
    try:
        value = float(t[:-1] if scale != 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r}") from None
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return int(value)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _positive(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1): {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zenflow_triton.autotune",
        description="Measure this machine's PCIe, host AdamW and device figures for zenflow_triton, save the "
                    "profile, and show the topk_ratio / update_interval it would choose.",
        epilog=f"The profile goes to ${ENV_VAR} if set, else the per-user cache folder. Exit codes: 0 ok, "
               "2 usage, 3 measurement failed, 4 no usable profile, 5 write failed, 6 missing optional "
               "dependency (matplotlib for --plot).",
    )
    parser.add_argument("--quick", action="store_true", help="a few seconds of measuring instead of a full run")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--output", "-o", metavar="PATH", type=Path,
                     help=f"write the profile here (default: ${ENV_VAR}, else the per-user cache)")
    out.add_argument("--no-save", action="store_true", help="do not write the profile")
    parser.add_argument("--load", nargs="?", const="", metavar="PATH",
                        help="plan from a saved profile instead of measuring (default: the usual location)")
    plan_group = parser.add_argument_group("planning for a model")
    plan_group.add_argument("--params", type=_count, metavar="N",
                            help="offloaded parameter count (7e9, 7B, 125M); needs --step-time")
    plan_group.add_argument("--step-time", type=_positive, metavar="S",
                            help="seconds per training step outside the optimizer; needs --params")
    plan_group.add_argument("--param-dtype", choices=sorted(_PARAM_BYTES), default="bfloat16")
    plan_group.add_argument("--grad-dtype", choices=sorted(GRAD_BYTES), default="float32")
    plan_group.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                            help="plan for CUDA or CPU tensors (auto: CUDA when the profile has a GPU)")
    plan_group.add_argument("--memory-budget", type=_positive, metavar="GIB",
                            help="device memory (GiB) the optimizer's device state may use (default: "
                                 f"{MEMORY_BUDGET_FRACTION * 100:.0f}%% of free memory less the model's weights "
                                 "and grads)")
    plan_group.add_argument("--target-stall", type=_fraction, default=Targets().stall_fraction, metavar="F",
                            help="acceptable stall as a fraction of the step time (default %(default)s)")
    parser.add_argument("--plot", type=Path, metavar="PATH",
                        help="PNG of the predicted stall over a (update_interval, topk_ratio) grid (matplotlib)")
    parser.add_argument("--json", action="store_true", help="print JSON (profile and plans) instead of the table")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    adv = parser.add_argument_group("advanced (smaller measurements)")
    adv.add_argument("--adamw-numel", type=_count, metavar="N", help="elements per timed host AdamW call")
    adv.add_argument("--max-copy-bytes", type=_count, metavar="N", help="largest copy size measured")
    return parser


def _err(msg: str) -> None:
    print(f"zenflow_triton.autotune: {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------- plans


def _workload(profile: Profile, args: argparse.Namespace, params: float, step_time: float) -> Workload:
    kind = args.device if args.device != "auto" else ("cuda" if profile.gpu is not None else "cpu")
    param_bytes = _PARAM_BYTES[args.param_dtype]
    budget: float | None = None
    if kind == "cuda":
        if profile.gpu is None:
            raise ProfileError(f"cannot plan for CUDA: the profile has no GPU figures ({profile.gpu_unavailable})")
        if args.memory_budget is not None:
            budget = args.memory_budget * 2**30
        else:
            # The offloaded weights and their gradients stay on the device; activations are not known here.
            budget = max(0.0, MEMORY_BUDGET_FRACTION * profile.gpu.free_bytes - 2 * param_bytes * params)
    return Workload(shapes=shapes_for_param_count(int(params)), step_time_s=step_time, param_bytes=param_bytes,
                    grad_dtype=args.grad_dtype, device=kind, memory_budget_bytes=budget)


def _plans(profile: Profile, args: argparse.Namespace) -> list[tuple[Workload, Plan]]:
    targets = Targets(stall_fraction=args.target_stall, select_windows=DEFAULT_SELECT_WINDOWS)
    if args.params is not None:
        models = [(float(args.params), float(args.step_time))]
    else:
        kind = args.device if args.device != "auto" else ("cuda" if profile.gpu is not None else "cpu")
        models = _EXAMPLES[kind]
    out = []
    for params, step_time in models:
        w = _workload(profile, args, params, step_time)
        out.append((w, plan(profile, w, targets=targets)))
    return out


# ----------------------------------------------------------------------------------------------- table


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _size(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.4g} MiB"
    return f"{n / 1024:.4g} KiB"


def _time(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else (f"{x * 1e3:.1f} ms" if x >= 1e-3 else f"{x * 1e6:.0f} us")


def _count_str(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= 0.9995 * div:  # 999.9M prints as 1B, not 1e+03M
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}"


def _render(profile: Profile, plans: list[tuple[Workload, Plan]], saved: Path | None, single: bool) -> str:
    lines: list[str] = []
    add = lines.append
    total = profile.durations.get("total")
    add(f"zenflow_triton machine profile ({'quick' if profile.quick else 'full'}"
        + (f", measured in {total:.1f} s" if total else "") + ")")
    add(f"  machine       {profile.machine_key}")
    add(f"  CPU           {profile.cpu_model}: {profile.cpu_cores} cores, last-level cache {_size(profile.llc_bytes)}")
    if profile.gpu is None:
        add(f"  GPU           unavailable: {profile.gpu_unavailable}")
        add("  PCIe          unavailable; runs on CPU tensors copy by host memcpy (measured below)")
    else:
        g = profile.gpu
        add(f"  GPU           {g.name}: {_size(g.total_bytes)} total, {_size(g.free_bytes)} free, "
            f"{g.mem_bandwidth / 1e9:.0f} GB/s device copy")
    add("")
    curves = [("memcpy", profile.memcpy)]
    if profile.gpu is not None:
        curves = [("H2D pinned", profile.gpu.h2d), ("D2H pinned", profile.gpu.d2h), *curves]
    add("  copy bandwidth, GB/s")
    add("    size       " + "".join(f"{name:>12}" for name, _ in curves))
    sizes = sorted({n for _, c in curves for n, _ in c.points})
    for n in sizes:
        row = [next((f"{_gb(bw):>12}" for m, bw in c.points if m == n), f"{'-':>12}") for _, c in curves]
        add(f"    {_size(n):<11}" + "".join(row))
    add("")
    a = profile.cpu_adamw
    dtypes = list(a.rates)
    add(f"  host AdamW ({a.kernel}), M params/s on {_count_str(a.numel)} params, and fixed cost per call")
    add("    threads    " + "".join(f"{dt + ' grad':>16}" for dt in dtypes) + f"{'per call':>12}")
    for t in sorted({t for dt in dtypes for t in a.rates[dt]}):
        add(f"    {t:<11}" + "".join(f"{a.rates[dt].get(t, float('nan')) / 1e6:>16.0f}" for dt in dtypes)
            + f"{_time(a.call_overhead_s[t]) if t in a.call_overhead_s else '-':>12}")
    d = profile.cpu_device
    add(f"  device step on CPU tensors ({d.source.removeprefix('measured: ')}): pass {d.pass_rate / 1e6:.0f} M elem/s, "
        f"Adam on selected {d.adam_rate / 1e6:.0f} M elem/s, merge {d.merge_rate / 1e6:.0f} M elem/s")
    add("")
    if saved is not None:
        add(f"  profile written to {saved}")
        add("")
    kind = plans[0][0].device
    add(f"would choose ({'CUDA tensors' if kind == 'cuda' else 'CPU tensors: copies are host memcpy, no PCIe'}"
        f"{'' if single else '; example models, pass --params and --step-time for yours'}):")
    header = (f"    {'params':>8} {'step':>9} {'U':>4} {'topk_ratio':>10} {'threads':>7} {'host/window':>12} "
              f"{'stall/step':>11} {'of step':>8} {'device mem':>11}")
    add(header)
    for w, p in plans:
        pr = p.prediction
        add(f"    {_count_str(w.numel):>8} {_time(w.step_time_s):>9} {p.update_interval:>4} {p.topk_ratio:>10.3g} "
            f"{p.cpu_threads:>7} {_time(p.predicted_host_s):>12} {_time(pr.stall_s / p.update_interval):>11} "
            f"{pr.stall_fraction:>8.1%} {_size(pr.device_bytes):>11}" + ("" if p.target_met else "  (target missed)"))
    if single:
        add("")
        add("  why: " + plans[0][1].reason)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ plot


def _plot(path: Path, profile: Profile, workload: Workload, chosen: Plan, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    us = list(range(1, max(32, 2 * chosen.update_interval) + 1))  # the chosen U always inside, with room past it
    r_top = max(0.5, min(1.0, 2 * chosen.topk_ratio))
    rs = [r_top * i / 20 for i in range(21)]
    grid = stall_grid(profile, workload, update_intervals=us, topk_ratios=rs, cpu_threads=chosen.cpu_threads,
                      select_windows=DEFAULT_SELECT_WINDOWS)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    pct = [[100 * v for v in row] for row in grid]
    top = max(10.0, min(100.0, max(map(max, pct))))
    mesh = ax.pcolormesh(us, rs, pct, shading="nearest", cmap="viridis", vmin=0, vmax=top)
    fig.colorbar(mesh, ax=ax, label="predicted stall, % of step time")
    try:
        ax.contour(us, rs, pct, levels=[100 * target], colors="white", linewidths=1)
    except ValueError:  # a flat grid has no contour
        pass
    ax.plot([chosen.update_interval], [chosen.topk_ratio], marker="*", color="red", markersize=14, label="chosen")
    ax.set_xlabel("update_interval U (steps)")
    ax.set_ylabel("topk_ratio r")
    ax.set_title(f"{_count_str(workload.numel)} params, step {_time(workload.step_time_s)}, "
                 f"{workload.device} tensors, {chosen.cpu_threads} host threads\n"
                 f"white line: the {target:.0%} stall target", fontsize=10)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.params is None) != (args.step_time is None):
        parser.error("--params and --step-time go together")
    if args.load is not None and (args.output is not None or args.no_save or args.quick):
        parser.error("--load reads a saved profile; --quick, --output and --no-save apply to measuring")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _err("--plot needs matplotlib: pip install 'zenflow_triton[plot]'")
            return EXIT_MISSING_DEPENDENCY

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - started:6.1f} s] {msg}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    saved: Path | None = None
    if args.load is not None:
        try:
            path = Path(args.load).expanduser() if args.load else default_profile_path()
            profile = load_profile(path)
        except ProfileError as exc:
            _err(f"{exc}; run `python -m zenflow_triton.autotune` to measure one")
            return EXIT_NO_PROFILE
        progress(f"loaded {path}")
    else:
        settings = ProbeSettings.quick_settings() if args.quick else ProbeSettings.full_settings()
        settings = settings.with_overrides(adamw_numel=args.adamw_numel, max_copy_bytes=args.max_copy_bytes)
        progress(f"measuring ({'quick' if args.quick else 'full'}; --quick takes a few seconds)")
        try:
            profile = probe_machine(settings, progress=progress)
        except (RuntimeError, OSError, ValueError, ImportError) as exc:
            _err(f"measurement failed: {exc}")
            return EXIT_PROBE_FAILED
        progress(f"measured in {time.perf_counter() - started:.1f} s")

    try:
        plans = _plans(profile, args)
    except ProfileError as exc:
        _err(str(exc))
        return EXIT_NO_PROFILE

    single = args.params is not None
    if args.load is None and not args.no_save:
        target = args.output if args.output is not None else default_profile_path(profile.machine_key)
        extra: dict[str, Any] = {}
        if single:
            extra["plan"] = plans[0][1].to_dict()
        try:
            saved = save_profile(profile, target, extra=extra)
        except OSError as exc:
            _err(f"cannot write the profile to {target}: {exc.strerror or exc}")
            return EXIT_WRITE_FAILED
        progress(f"profile written to {saved}")

    if args.plot is not None:
        # The plot needs one model: the one given, else the middle example.
        workload, chosen = plans[0] if single else plans[len(plans) // 2]
        try:
            _plot(args.plot, profile, workload, chosen, args.target_stall)
        except OSError as exc:
            _err(f"cannot write the plot to {args.plot}: {exc.strerror or exc}")
            return EXIT_WRITE_FAILED
        progress(f"plot written to {args.plot}")

    if args.json:
        doc = {
            "profile_path": None if saved is None else str(saved),
            "profile": profile.to_dict(),
            "plans": [dict(p.to_dict(), params=w.numel, step_time_s=w.step_time_s, device=w.device)
                      for w, p in plans],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(_render(profile, plans, saved, single))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
