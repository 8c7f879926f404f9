"""``python -m zenflow_triton.autotune``: measure this machine, save its profile, show what would be chosen.

Progress goes to stderr; the table (or ``--json``) to stdout. Exit codes, for scripts:

- 0: success
- 2: bad command line (argparse)
- 3: a measurement failed
- 4: no usable profile (``--load`` found none or an invalid one; planning for a GPU the profile lacks)
- 5: could not write the profile or the plot
- 6: an optional dependency is missing (``--plot`` needs matplotlib: ``pip install 'zenflow_triton[plot]'``)
- 7: the quality table (``--quality-table``) cannot be read or is malformed

The choice weighs the predicted step time against the predicted loss ratio vs AdamW (``--max-loss-ratio``) from a
quality table: the shipped one (:mod:`.quality`) or yours (``--quality-table``).

The output says what was measured (sizes, repeats, each figure's spread), warns when the machine was busy, where
the profile went and whether ``"auto"`` will read it from there, and, for one model (``--params``), the constructor
call with the chosen knobs. A saved profile measured calmer than this run (lower median spread) is kept unless
``--force``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zenflow_triton.config import DEFAULT_SELECT_WINDOWS

from .bridge import MEMORY_BUDGET_FRACTION, QUALITY_ENV_VAR, quality_table_for
from .cache import ENV_VAR, ProfileError, default_profile_path, load_profile, save_profile
from .model import (
    ACCUMULATE_MODES,
    DEFAULT_MAX_LOSS_RATIO,
    GRAD_BYTES,
    Plan,
    Targets,
    Workload,
    device_bytes_per_param,
    format_count,
    format_seconds,
    host_bytes_per_param,
    plan_accumulate,
    predict,
    shapes_for_param_count,
)
from .profile import Profile
from .quality import QualityTable, QualityTableError

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_PROBE_FAILED", "EXIT_NO_PROFILE", "EXIT_WRITE_FAILED",
           "EXIT_MISSING_DEPENDENCY", "EXIT_BAD_QUALITY_TABLE"]

EXIT_OK = 0
EXIT_PROBE_FAILED = 3
EXIT_NO_PROFILE = 4
EXIT_WRITE_FAILED = 5
EXIT_MISSING_DEPENDENCY = 6
EXIT_BAD_QUALITY_TABLE = 7

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


def _ratio_bound(text: str) -> float:
    value = _positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]: {text!r}")
    return value


def _loss_budget(text: str) -> float:
    value = _positive(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (1 is AdamW's loss): {text!r}")
    return value


def _interval(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zenflow_triton.autotune",
        description="Measure this machine's PCIe, host AdamW and device figures for zenflow_triton, save the "
                    "profile, and show the topk_ratio / update_interval it would choose.",
        epilog=f"The profile goes to ${ENV_VAR} if set, else the per-user cache folder. Exit codes: 0 ok, "
               "2 usage, 3 measurement failed, 4 no usable profile, 5 write failed, 6 missing optional "
               "dependency (matplotlib for --plot), 7 unreadable quality table.",
    )
    parser.add_argument("--quick", action="store_true", help="a few seconds of measuring instead of a full run")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--output", "-o", metavar="PATH", type=Path,
                     help=f"write the profile here (default: ${ENV_VAR}, else the per-user cache)")
    out.add_argument("--no-save", action="store_true", help="do not write the profile")
    parser.add_argument("--force", action="store_true",
                        help="replace the saved profile even when it was measured calmer (lower spread) than this run")
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
    plan_group.add_argument("--accumulate", choices=("auto", *ACCUMULATE_MODES), default="auto",
                            help="where the window sum lives (ZenFlowAdamW's accumulate): auto (default) places it "
                                 "as the optimizer does, on the device when its state fits the memory budget, else "
                                 "on the host; always the device for CPU tensors")
    plan_group.add_argument("--max-loss-ratio", type=_loss_budget, default=DEFAULT_MAX_LOSS_RATIO, metavar="X",
                            help="quality budget: largest predicted held-out loss over AdamW's at equal steps "
                                 "(default %(default)s); raise it to trade quality for speed")
    plan_group.add_argument("--max-update-interval", type=_interval, default=Targets().max_update_interval,
                            metavar="U", help="never choose a longer window (default %(default)s; the quality "
                                              "table's range limits it further)")
    plan_group.add_argument("--min-topk-ratio", type=_ratio_bound, default=None, metavar="R",
                            help="never choose a smaller ratio (default: the quality table's smallest)")
    plan_group.add_argument("--quality-table", metavar="PATH",
                            help=f"loss ratios vs AdamW measured on your task (JSON; format: "
                                 f"zenflow_triton.autotune.quality; default ${QUALITY_ENV_VAR}, else the shipped "
                                 "table of the demo's fine-tune)")
    plan_group.add_argument("--target-stall", type=_fraction, default=Targets().stall_fraction, metavar="F",
                            help="stall, as a fraction of the step time, up to which host work counts as hidden "
                                 "(default %(default)s)")
    parser.add_argument("--plot", type=Path, metavar="PATH",
                        help="PNG of the predicted step time over (update_interval, topk_ratio), with the region "
                             "within the loss budget and the choice marked (matplotlib)")
    parser.add_argument("--json", action="store_true", help="print JSON (profile and plans) instead of the table")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    adv = parser.add_argument_group("advanced (smaller measurements)")
    adv.add_argument("--adamw-numel", type=_count, metavar="N", help="elements per timed host AdamW call")
    adv.add_argument("--max-copy-bytes", type=_count, metavar="N", help="largest copy size measured")
    return parser


def probe_machine(*args: Any, **kwargs: Any) -> Profile:
    """:func:`.probes.probe_machine`, imported here on first use: it imports torch, which ``--help`` never needs."""
    from .probes import probe_machine as measure

    return measure(*args, **kwargs)


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


def _targets(args: argparse.Namespace) -> Targets:
    return Targets(max_loss_ratio=args.max_loss_ratio, stall_fraction=args.target_stall,
                   max_update_interval=args.max_update_interval, min_topk_ratio=args.min_topk_ratio or 0.0,
                   select_windows=DEFAULT_SELECT_WINDOWS)


def _plans(profile: Profile, args: argparse.Namespace, quality: QualityTable) -> list[tuple[Workload, Plan]]:
    targets = _targets(args)
    if args.params is not None:
        models = [(float(args.params), float(args.step_time))]
    else:
        kind = args.device if args.device != "auto" else ("cuda" if profile.gpu is not None else "cpu")
        models = _EXAMPLES[kind]
    out = []
    for params, step_time in models:
        w = _workload(profile, args, params, step_time)
        out.append((w, plan_accumulate(profile, w, accumulate=args.accumulate, targets=targets, quality=quality)))
    return out


def _memory_rows(workload: Workload, plan: Plan) -> list[dict[str, Any]]:
    """Per accumulate mode, at the plan's topk_ratio: the optimizer's device bytes per offloaded parameter (beyond
    the weight and its gradient), in all for the workload, and the pinned host bytes per parameter."""
    return [{"accumulate": m, "device_bytes_per_param": device_bytes_per_param(plan.topk_ratio, m),
             "device_bytes": workload.numel * device_bytes_per_param(plan.topk_ratio, m),
             "host_bytes_per_param": host_bytes_per_param(workload.param_bytes, workload.grad_dtype, m),
             "chosen": m == plan.accumulate} for m in ACCUMULATE_MODES]


def _memory_table(workload: Workload, plan: Plan) -> list[str]:
    n = _count_str(workload.numel)
    if workload.device == "cuda":
        budget = workload.memory_budget_bytes
        whose = "" if budget is None else f"; the optimizer's device memory budget: {budget / 2**30:.2f} GiB"
    else:
        whose = ("; CPU tensors: no device memory figure (device and host memory are one), so both modes are "
                 'shown and "device" is chosen: nothing to save')
    head = f"device GiB for {n} params"
    width = len(head)
    lines = [f"  device memory per accumulate mode at topk_ratio={plan.topk_ratio:g} (beyond the weights and their "
             f"gradients{whose}):",
             f"    {'accumulate':<10}  {'device B/param':>14}  {head}  {'host B/param':>12}"]
    for row in _memory_rows(workload, plan):
        lines.append(f"    {row['accumulate']:<10}  {row['device_bytes_per_param']:>14.2f}  "
                     f"{row['device_bytes'] / 2**30:>{width}.2f}  {row['host_bytes_per_param']:>12.1f}"
                     + ("  (chosen)" if row["chosen"] else ""))
    return lines


# ----------------------------------------------------------------------------------------------- table


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _size(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.4g} MiB"
    return f"{n / 1024:.4g} KiB"


_time = format_seconds
_count_str = format_count


def _probe_size(n: int) -> str:
    """A copy size as the probes name its spread entry (``memcpy 1 MiB``)."""
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 1024:g} KiB"


def _loss(x: float | None) -> str:
    return "unknown" if x is None else f"{x:.3f}"


def _with_spread(text: str, profile: Profile, name: str, width: int) -> str:
    """A table cell: the figure, and its spread in parentheses when the profile recorded one."""
    spread = profile.spread.get(name)
    return f"{text + ('' if spread is None else f' ({spread:.0%})'):>{width}}"


def _measured(profile: Profile) -> str:
    """What the profile's run measured, read from the profile itself (so --load says it too)."""
    curve = profile.memcpy if profile.gpu is None else profile.gpu.h2d
    sizes = [n for n, _ in curve.points]
    span = _size(sizes[0]) + (f"-{_size(sizes[-1])}" if len(sizes) > 1 else "")
    threads = sorted({t for tab in profile.cpu_adamw.rates.values() for t in tab})
    reps = profile.repeats
    copy_reps = f" x {reps['copy']} repeats" if "copy" in reps else ""
    adamw_reps = f" x {reps['host_adamw']} repeats" if "host_adamw" in reps else ""
    total = profile.durations.get("total")
    compiled = profile.durations.get("compile", 0.0)
    # A first run on a machine compiles the numba kernels (seconds; later runs load them): said apart, so a quick
    # first run taking longer than a full second one reads as what it is.
    took = "" if not total else f"; measured in {total:.1f} s" + (
        f", {compiled:.1f} s of it preparing the host kernels (numba compiles them on a machine's first run)"
        if compiled >= 0.5 else "")
    plural = "s" if len(sizes) > 1 else ""
    return (f"{'quick' if profile.quick else 'full'}: copies at {len(sizes)} size{plural} ({span}){copy_reps}; "
            f"host AdamW on {_count_str(profile.cpu_adamw.numel)} params at {', '.join(map(str, threads))} "
            f"threads{adamw_reps}"
            + took)


def _spread_line(profile: Profile) -> str:
    load = "" if profile.load_average is None else (f"; load average {profile.load_average:.1f} on "
                                                     f"{profile.cpu_cores} cores")
    if profile.noise is None:
        return "  spread        not recorded (a profile from before schema 2)" + load
    worst = max(profile.spread, key=lambda k: profile.spread[k])
    return (f"  spread        median {profile.noise:.0%} over {len(profile.spread)} figures (median repeat over the "
            f"best), widest {profile.spread[worst]:.0%} ({worst}){load}")


def _constructor(plan: Plan, grad_dtype: str) -> str:
    """The call that builds the optimizer with this plan's knobs, ready to paste."""
    extra = "" if grad_dtype == "float32" else f', grad_dtype="{grad_dtype}"'
    if plan.accumulate == "host":
        extra += ', accumulate="host"'
    return (f"optimizer = ZenFlowAdamW(model.parameters(), lr=1e-4, topk_ratio={plan.topk_ratio:g}, "
            f"update_interval={plan.update_interval}, cpu_threads={plan.cpu_threads}{extra})")


def _render(profile: Profile, plans: list[tuple[Workload, Plan]], saved: Path | None, single: bool,
            quality: QualityTable, where: Sequence[str] = ()) -> str:
    lines: list[str] = []
    add = lines.append
    add(f"zenflow_triton machine profile ({_measured(profile)})")
    busy = profile.busy()
    if busy:
        add(f"  WARNING: the machine was busy while measuring ({busy}): figures and the choice below may swing "
            "between runs; measure again when it is idle (a saved profile is replaced only by a calmer one)")
    add(_spread_line(profile))
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
    add("  copy bandwidth, GB/s (spread)")
    add("    size       " + "".join(f"{name:>16}" for name, _ in curves))
    sizes = sorted({n for _, c in curves for n, _ in c.points})
    spread_names = {"memcpy": "memcpy", "pcie-h2d": "PCIe H2D", "pcie-d2h": "PCIe D2H"}
    for n in sizes:
        row = [next((_with_spread(_gb(bw), profile, f"{spread_names.get(c.kind, c.kind)} {_probe_size(n)}", 16)
                     for m, bw in c.points if m == n), f"{'-':>16}") for _, c in curves]
        add(f"    {_size(n):<11}" + "".join(row))
    add("")
    a = profile.cpu_adamw
    dtypes = list(a.rates)
    add(f"  host AdamW ({a.kernel}), M params/s (spread) on {_count_str(a.numel)} params, and fixed cost per call")
    add("    threads    " + "".join(f"{dt + ' grad':>20}" for dt in dtypes) + f"{'per call':>12}")
    for t in sorted({t for dt in dtypes for t in a.rates[dt]}):
        add(f"    {t:<11}" + "".join(_with_spread(f"{a.rates[dt][t] / 1e6:.0f}" if t in a.rates[dt] else "-", profile,
                                                  f"host AdamW {dt} {t} threads", 20) for dt in dtypes)
            + f"{_time(a.call_overhead_s[t]) if t in a.call_overhead_s else '-':>12}")
    d = profile.cpu_device
    add(f"  device step on CPU tensors ({d.source.removeprefix('measured: ')}): pass {d.pass_rate / 1e6:.0f} M elem/s, "
        f"Adam on selected {d.adam_rate / 1e6:.0f} M elem/s, merge {d.merge_rate / 1e6:.0f} M elem/s")
    add("")
    if where:
        lines.extend("  " + line for line in where)
        add("")
    elif saved is not None:
        add(f"  profile written to {saved}")
        add("")
    add(quality.render())
    add("")
    kind = plans[0][0].device
    quality_source = plans[0][1].quality_source
    budget = plans[0][1].max_loss_ratio
    add(f"would choose ({'CUDA tensors' if kind == 'cuda' else 'CPU tensors: copies are host memcpy, no PCIe'}"
        f"{'' if single else '; example models, pass --params and --step-time for yours'}), fastest within the "
        f"loss budget {budget:g}x AdamW ({quality_source}):")
    add(f"    {'params':>8} {'step':>9} {'topk_ratio':>10} {'U':>3} {'threads':>7} {'loss ratio':>10} "
        f"{'pred step':>10} {'stall/window':>12} {'stall':>6} {'device mem':>11} {'accumulate':>10}")
    for w, p in plans:
        s = p.summary()
        flags = ([] if s["loss_budget_met"] else ["loss budget missed"]) + (
            [] if s["hides_host_work"] else ["host work not hidden"])
        add(f"    {_count_str(w.numel):>8} {_time(w.step_time_s):>9} {s['topk_ratio']:>10.3g} "
            f"{s['update_interval']:>3} {s['cpu_threads']:>7} {_loss(s['predicted_loss_ratio']):>10} "
            f"{_time(s['predicted_time_per_step_s']):>10} {_time(s['predicted_stall_per_window_s']):>12} "
            f"{s['predicted_stall_fraction']:>6.1%} {_size(p.prediction.device_bytes):>11} {p.accumulate:>10}"
            + (f"  ({'; '.join(flags)})" if flags else ""))
    add("    pred step = model step + device-side optimizer + stall per step; stall = waiting on the host job plus "
        "copies not hidden")
    if any(p.topk_ratio >= 1 for _, p in plans):
        add("    topk_ratio 1 (update_interval 1): no offloading, plain AdamW on the device; chosen where offloading "
            "would not make the step faster than the 1% tie" + (" (why: below)" if single else ""))
    if single:
        add("")
        lines.extend(_memory_table(*plans[0]))
        add("")
        add("  why:")
        lines.extend("    " + line for line in plans[0][1].reason.splitlines())
        add("")
        add("  to train with this choice (lr: yours):")
        add("    from zenflow_triton import ZenFlowAdamW")
        add("    " + _constructor(plans[0][1], plans[0][0].grad_dtype))
    add("")
    add('  or let "auto" choose at the first steps from the saved profile and your measured step time:')
    add('    optimizer = ZenFlowAdamW(model.parameters(), lr=1e-4, topk_ratio="auto", update_interval="auto")')
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ plot


def _plot(path: Path, profile: Profile, workload: Workload, chosen: Plan, quality: QualityTable,
          targets: Targets) -> None:
    """Predicted step time over (U, r), the region within the loss budget, the stall target and the choice."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt
    import numpy as np

    u_top = max(quality.update_intervals[-1], chosen.update_interval)
    us = list(range(1, u_top + 1))
    r_low = min(quality.topk_ratios[0], chosen.topk_ratio) if chosen.topk_ratio > 0 else quality.topk_ratios[0]
    rs = [float(x) for x in np.geomspace(r_low, 1.0, 25)]
    step = np.empty((len(rs), len(us)))
    stall = np.empty_like(step)
    loss = np.full_like(step, np.nan)
    for i, r in enumerate(rs):
        for j, u in enumerate(us):
            pr = predict(profile, workload, topk_ratio=r, update_interval=u, cpu_threads=chosen.cpu_threads,
                         select_windows=targets.select_windows, accumulate=chosen.accumulate)
            step[i, j] = pr.step_s / workload.step_time_s
            stall[i, j] = pr.stall_fraction
            q = quality.predict(r, u)
            loss[i, j] = np.nan if q is None else q
    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=110)
    mesh = ax.pcolormesh(us, rs, step, shading="nearest", cmap="viridis_r")
    fig.colorbar(mesh, ax=ax, label="predicted step time / model step time")
    # Outside the budget (or outside the quality table's range): greyed out, so the feasible region stands out.
    outside = np.where(np.isnan(loss) | (loss > chosen.max_loss_ratio), 1.0, np.nan)
    ax.pcolormesh(us, rs, outside, shading="nearest", cmap="Greys", vmin=0, vmax=1.6, alpha=0.75)
    handles = []
    for field, level, style, label in ((loss, chosen.max_loss_ratio, "-", f"loss ratio {chosen.max_loss_ratio:g}"),
                                       (stall, targets.stall_fraction, "--",
                                        f"stall {targets.stall_fraction:.0%} of step")):
        try:
            cs = ax.contour(us, rs, np.nan_to_num(field, nan=np.inf) if field is loss else field, levels=[level],
                            colors="white", linestyles=style, linewidths=1.2)
            handles.append((cs.legend_elements()[0][0], label))
        except (ValueError, IndexError):  # no contour on a flat grid
            pass
    star = ax.plot([chosen.update_interval], [chosen.topk_ratio], marker="*", color="red", markersize=15,
                   linestyle="none")[0]
    handles.append((star, "chosen"))
    ax.legend([h for h, _ in handles], [lbl for _, lbl in handles], loc="lower right", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("update_interval U (steps)")
    ax.set_ylabel("topk_ratio r")
    loss_text = "unknown" if chosen.predicted_loss_ratio is None else f"{chosen.predicted_loss_ratio:.3f}"
    plural = "" if chosen.cpu_threads == 1 else "s"
    ax.set_title(f"{_count_str(workload.numel)} params, model step {_time(workload.step_time_s)}, "
                 f"{workload.device} tensors, {chosen.cpu_threads} host thread{plural}; grey: loss ratio over "
                 f"{chosen.max_loss_ratio:g} or unmeasured\n"
                 f"chosen r={chosen.topk_ratio:g}, U={chosen.update_interval}: "
                 f"loss {loss_text}x AdamW, step {_time(chosen.predicted_step_s)}, stall "
                 f"{chosen.prediction.stall_fraction:.1%}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main


def _calmer_saved(target: Path, profile: Profile) -> Profile | None:
    """The profile saved at ``target`` if it is this machine's and was measured calmer (a lower median spread,
    :attr:`Profile.noise`) than ``profile``; None when there is none, it cannot be read, or nothing says it is calmer
    (a schema-1 file recorded no spread)."""
    try:
        saved = load_profile(target)
    except ProfileError:
        return None
    if saved.machine_key != profile.machine_key or saved.noise is None or profile.noise is None:
        return None
    return saved if saved.noise < profile.noise else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.params is None) != (args.step_time is None):
        parser.error("--params and --step-time go together")
    if args.load is not None and (args.output is not None or args.no_save or args.quick or args.force):
        parser.error("--load reads a saved profile; --quick, --output, --no-save and --force apply to measuring")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _err("--plot needs matplotlib: pip install 'zenflow_triton[plot]'")
            return EXIT_MISSING_DEPENDENCY

    try:
        quality = quality_table_for(args.quality_table)
    except QualityTableError as exc:
        _err(str(exc))
        return EXIT_BAD_QUALITY_TABLE

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
        from .probes import ProbeSettings

        settings = ProbeSettings.quick_settings() if args.quick else ProbeSettings.full_settings()
        settings = settings.with_overrides(adamw_numel=args.adamw_numel, max_copy_bytes=args.max_copy_bytes)
        progress(f"measuring ({settings.describe()}"
                 + ("; --quick measures less, in a few seconds)" if not args.quick else ")"))
        try:
            profile = probe_machine(settings, progress=progress)
        except (RuntimeError, OSError, ValueError, ImportError) as exc:
            _err(f"measurement failed: {exc}")
            return EXIT_PROBE_FAILED
        progress(f"measured in {time.perf_counter() - started:.1f} s")

    try:
        plans = _plans(profile, args, quality)
    except ProfileError as exc:
        _err(str(exc))
        return EXIT_NO_PROFILE

    single = args.params is not None
    auto_reads = default_profile_path(profile.machine_key)  # where "auto" looks on this machine
    where: list[str] = []
    if args.load is not None:
        where.append(f"profile loaded from {path}")
    elif args.no_save:
        where.append(f'profile not saved (--no-save); "auto" reads {auto_reads} if it exists, else measures quickly')
    else:
        target = args.output if args.output is not None else auto_reads
        calmer = None if args.force else _calmer_saved(target, profile)
        if calmer is not None:
            where.append(f"profile not saved: {target} holds one measured calmer (median spread {calmer.noise:.0%}, "
                         f"this run {profile.noise:.0%}), which stays; --force replaces it")
            _err(where[-1])
        else:
            extra: dict[str, Any] = {}
            if single:
                extra["plan"] = plans[0][1].to_dict()
            try:
                saved = save_profile(profile, target, extra=extra)
            except OSError as exc:
                _err(f"cannot write the profile to {target}: {exc.strerror or exc}")
                return EXIT_WRITE_FAILED
            progress(f"profile written to {saved}")
            where.append(f"profile written to {saved}")
        if Path(target).expanduser().resolve() == auto_reads.expanduser().resolve():
            named = f" (named by ${ENV_VAR})" if os.environ.get(ENV_VAR) else ""
            where.append(f'"auto" (topk_ratio="auto", update_interval="auto") reads it from there{named}')
        else:
            where.append(f'"auto" reads {auto_reads}, not this file: run training with '
                         f"{ENV_VAR}={Path(target).expanduser().resolve()} in its environment to use it")

    if args.plot is not None:
        # The plot needs one model: the one given, else the middle example.
        workload, chosen = plans[0] if single else plans[len(plans) // 2]
        try:
            _plot(args.plot, profile, workload, chosen, quality, _targets(args))
        except OSError as exc:
            _err(f"cannot write the plot to {args.plot}: {exc.strerror or exc}")
            return EXIT_WRITE_FAILED
        progress(f"plot written to {args.plot}")

    if args.json:
        doc = {
            "profile_path": None if saved is None else str(saved),
            "profile_note": where,
            "busy": profile.busy(),
            "profile": profile.to_dict(),
            "quality_table": {"source": quality.source, "task": quality.task, "command": quality.command},
            "plans": [dict(p.to_dict(), params=w.numel, step_time_s=w.step_time_s, device=w.device,
                           memory=_memory_rows(w, p)) for w, p in plans],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(_render(profile, plans, saved, single, quality, where))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
