"""What the autotuner's CLI prints and draws: the measured profile with its spreads, the plan table and its
reason, device bytes per accumulate mode, the constructor call to paste, and the ``--plot`` PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .model import (
    ACCUMULATE_MODES,
    Plan,
    Targets,
    Workload,
    device_bytes_per_param,
    format_count,
    format_seconds,
    host_add_bytes_per_s,
    host_bytes_per_param,
    predict,
)
from .profile import Profile
from .quality import QualityTable

__all__ = ["constructor", "memory_rows", "plot", "render"]

_time = format_seconds
_count_str = format_count


def memory_rows(workload: Workload, plan: Plan) -> list[dict[str, Any]]:
    """Per accumulate mode, at the plan's topk_ratio: the optimizer's device bytes per offloaded parameter (beyond
    the weight and its gradient), in all for the workload, and the pinned host bytes per parameter."""
    return [{"accumulate": m, "device_bytes_per_param": device_bytes_per_param(plan.topk_ratio, m),
             "device_bytes": workload.numel * device_bytes_per_param(plan.topk_ratio, m),
             "host_bytes_per_param": host_bytes_per_param(workload.param_bytes, workload.grad_dtype, m,
                                                          shapes=workload.shapes, snapshot=workload.host_snapshot),
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
    for row in memory_rows(workload, plan):
        lines.append(f"    {row['accumulate']:<10}  {row['device_bytes_per_param']:>14.2f}  "
                     f"{row['device_bytes'] / 2**30:>{width}.2f}  {row['host_bytes_per_param']:>12.1f}"
                     + ("  (chosen)" if row["chosen"] else ""))
    return lines


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _size(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.4g} MiB"
    return f"{n / 1024:.4g} KiB"


def _probe_size(n: int) -> str:
    """A copy size as the probes name its spread entry (``memcpy 1 MiB``)."""
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 1024:g} KiB"


def _loss(x: float | None) -> str:
    return "unknown" if x is None else f"{x:.3f}"


def _with_spread(text: str, profile: Profile, name: str, width: int) -> str:
    """A table cell: the figure, and its spread in parentheses when the profile recorded one."""
    spread = profile.spread.get(name)
    return f"{text + ('' if spread is None else f' ({spread:.0%})'):>{width}}"


def _host_add_table(profile: Profile) -> list[str]:
    """accumulate="host"'s host add as measured (GB/s streamed: the fp32 sum read and written, the landed gradient
    read) per thread count, landing dtype and size (elements per call), or what the model assumes without it."""
    h = profile.host_add
    if h is None:
        return [f'  host add (accumulate="host"): not measured (a profile from before schema 3); the model assumes '
                f"{host_add_bytes_per_s(profile) / 1e9:.1f} GB/s, twice the memcpy peak"]
    per_elem = {"float32": 12, "bfloat16": 10}  # bytes streamed per element: the probe's accounting
    cells = {(t, dt): {n // per_elem.get(dt, 12): bw for n, bw in curve.points}
             for dt, tab in h.curves.items() for t, curve in tab.items()}
    sizes = sorted({n for row in cells.values() for n in row})
    out = [f'  host add of accumulate="host" ({h.kernel}), GB/s streamed (spread): sum read and written, gradient read',
           f"    {'threads':<8} {'landing':<9}" + "".join(f"{_count_str(n) + ' elem':>14}" for n in sizes)]
    for (t, dt), row in sorted(cells.items()):
        out.append(f"    {t:<8} {dt:<9}" + "".join(
            _with_spread("-" if n not in row else f"{row[n] / 1e9:.1f}", profile,
                         f"host add {dt} {t} threads {_probe_size(4 * n)}", 14) for n in sizes))
    return out


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
    compiled = profile.durations.get("compile", 0.0) + profile.durations.get("compile_add", 0.0)
    # A first run on a machine compiles the numba kernels (seconds; later runs load them): said apart, so a quick
    # first run taking longer than a full second one reads as what it is.
    took = "" if not total else f"; measured in {total:.1f} s" + (
        f", {compiled:.1f} s of it preparing the host kernels (numba compiles them on a machine's first run)"
        if compiled >= 0.5 else "")
    plural = "s" if len(sizes) > 1 else ""
    adds = ""
    if profile.host_add is not None:  # every curve holds one point per size
        some = next(iter(next(iter(profile.host_add.curves.values())).values()))
        adds = f"; host add at {len(some.points)} sizes" + (
            f" x {reps['host_add']} repeats" if "host_add" in reps else "")
    return (f"{'quick' if profile.quick else 'full'}: copies at {len(sizes)} size{plural} ({span}){copy_reps}; "
            f"host AdamW on {_count_str(profile.cpu_adamw.numel)} params at {', '.join(map(str, threads))} "
            f"threads{adamw_reps}{adds}"
            + took)


def _spread_line(profile: Profile) -> str:
    load = "" if profile.load_average is None else (f"; load average {profile.load_average:.1f} on "
                                                     f"{profile.cpu_cores} cores")
    if profile.noise is None:
        return "  spread        not recorded (a profile from before schema 2)" + load
    worst = max(profile.spread, key=lambda k: profile.spread[k])
    return (f"  spread        median {profile.noise:.0%} over {len(profile.spread)} figures (median repeat over the "
            f"best), widest {profile.spread[worst]:.0%} ({worst}){load}")


def constructor(plan: Plan, grad_dtype: str) -> str:
    """The call that builds the optimizer with this plan's knobs, ready to paste: ``lr=lr`` takes the user's own
    learning rate (a NameError until one is set, never a value the tuner made up)."""
    extra = "" if grad_dtype == "float32" else f', grad_dtype="{grad_dtype}"'
    if plan.accumulate == "host":
        extra += ', accumulate="host"'
    return (f"optimizer = ZenFlowAdamW(model.parameters(), lr=lr, topk_ratio={plan.topk_ratio:g}, "
            f"update_interval={plan.update_interval}, cpu_threads={plan.cpu_threads}{extra})")


def render(profile: Profile, plans: list[tuple[Workload, Plan]], saved: Path | None, single: bool,
            quality: QualityTable, where: Sequence[str] = (), show_profile: bool = True) -> str:
    """The CLI's table. ``show_profile=False`` (``--load`` without ``--show-profile``) prints the profile's figures
    as one line, not the tables it printed when it was measured."""
    lines: list[str] = []
    add = lines.append
    add(f"zenflow_triton machine profile ({_measured(profile)})")
    busy = profile.busy()
    if busy:
        add(f"  WARNING: the machine was busy while measuring ({busy}): figures and the choice below may swing "
            "between runs; measure again when it is idle (a saved profile is replaced only by a calmer one)")
    add(_spread_line(profile))
    if not show_profile:
        add(f"  machine       {profile.machine_key} (--show-profile prints the measured figures)")
        add("")
        lines.extend("  " + line for line in where)
        add("")
        return "\n".join(lines) + "\n" + _choice(plans, single, quality)
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
    lines.extend(_host_add_table(profile))
    d = profile.cpu_device
    if d is None:
        add("  device step on CPU tensors: not measured (a probe for CUDA parameters)")
    else:
        no_acc = "" if d.pass_no_acc_rate is None else f" ({d.pass_no_acc_rate / 1e6:.0f} without acc)"
        add(f"  device step on CPU tensors ({d.source.removeprefix('measured: ')}): pass "
            f"{d.pass_rate / 1e6:.0f} M elem/s{no_acc}, Adam on selected {d.adam_rate / 1e6:.0f} M elem/s, "
            f"merge {d.merge_rate / 1e6:.0f} M elem/s")
    add("")
    if where:
        lines.extend("  " + line for line in where)
        add("")
    elif saved is not None:
        add(f"  profile written to {saved}")
        add("")
    return "\n".join(lines) + "\n" + _choice(plans, single, quality)


def _choice(plans: list[tuple[Workload, Plan]], single: bool, quality: QualityTable) -> str:
    """The quality table, the plan table and the calls to paste."""
    lines: list[str] = []
    add = lines.append
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
        add("  to train with this choice (lr: your learning rate, which the tuner does not choose):")
        add("    from zenflow_triton import ZenFlowAdamW")
        add("    " + constructor(plans[0][1], plans[0][0].grad_dtype))
    add("")
    add('  or let "auto" choose at the first steps from the saved profile and your measured step time:')
    add('    optimizer = ZenFlowAdamW(model.parameters(), lr=lr, topk_ratio="auto", update_interval="auto")')
    return "\n".join(lines)


def plot(path: Path, profile: Profile, workload: Workload, chosen: Plan, quality: QualityTable,
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
