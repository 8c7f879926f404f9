"""The chooser (pure, DESIGN §8): from the cost model's predictions (:mod:`.model`) and the quality table, the
``(topk_ratio, update_interval)`` a user gets (:func:`plan`), the host thread count, where the window sums live
(:func:`plan_accumulate`), and the predicted step-time grid the CLI draws (:func:`stall_grid`). Like the model it
imports nothing outside the autotuner."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .model import (
    ACC_BYTES,
    ACCUMULATE_MODES,
    DEFAULT_PLACEMENT_RATIO,
    DEFAULT_SELECT_WINDOWS,
    STATE_BYTES,
    Targets,
    Workload,
    device_bytes_per_param,
    host_assumptions,
    predict,
    slot_bytes,
)
from .profile import Profile
from .quality import QualityTable, default_quality_table
from .results import Plan, Prediction, format_bytes, format_count, format_seconds

__all__ = ["choose_threads", "plan", "plan_accumulate", "stall_grid"]

# Candidate ratios besides the quality table's own: two significant digits, 1.3-1.5x apart, so a choice can land
# between measured ratios without claiming a precision the table does not have.
_RATIO_STEPS = (0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.07, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0)


def choose_threads(profile: Profile, grad_dtype: str, *, device: str = "cpu") -> int:
    """Measured thread count with the best host AdamW rate among those leaving one core to the training process,
    two on CUDA (``device``), where autograd's device thread launches the backward's kernels beside it (as the
    optimizer's own default, ``zenflow_triton.auto.default_cpu_threads``).

    The plain maximum (not "fewest within x% of the best"): a faster CPU must never make the plan worse.
    """
    table = profile.cpu_adamw.rates.get(grad_dtype)
    if not table:
        profile.cpu_adamw.rate(grad_dtype, 1)  # raises the ProfileError that names what was measured
    reserved = 2 if device == "cuda" else 1
    allowed = [t for t in table if t <= max(1, profile.cpu_cores - reserved)] or [min(table)]
    return max(allowed, key=lambda t: (table[t], -t))


def _floor_2sig(x: float) -> float:
    """Round down to two significant digits, so a printed ratio reads cleanly and never exceeds a limit."""
    if x <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(x)) - 1)
    return math.floor(round(x / scale, 9)) * scale if x < 1 else 1.0


def _memory_limit(workload: Workload, accumulate: str = "device") -> tuple[float | None, str]:
    """The largest ratio whose device state fits the memory budget (None: no budget), and its explanation."""
    budget = workload.memory_budget_bytes
    if budget is None:
        return None, ""
    p = workload.numel
    if accumulate == "host":  # no device sum: only the compact state counts
        limit = budget / p / STATE_BYTES
        return _floor_2sig(min(1.0, limit)), (f"device memory budget {format_bytes(budget)} ({STATE_BYTES} B per "
                                              'selected element; accumulate="host" keeps no device sum)')
    limit = (budget / p - ACC_BYTES) / STATE_BYTES
    if limit < 0:
        return -1.0, (f"the device memory budget ({format_bytes(budget)}) cannot even hold the fp32 accumulator "
                      f"({format_bytes(p * ACC_BYTES)}); expect out-of-memory")
    return _floor_2sig(min(1.0, limit)), (f"device memory budget {format_bytes(budget)} ({ACC_BYTES} B acc + "
                                          f"{STATE_BYTES} B per selected element)")


@dataclass(frozen=True)
class _Point:
    pred: Prediction
    loss: float | None

    @property
    def step_s(self) -> float:
        return self.pred.step_s

    def key(self) -> tuple[float, float, int, float]:
        """Quality first, then speed, then the shorter window and the larger ratio (fresher updates)."""
        return (math.inf if self.loss is None else self.loss, self.step_s, self.pred.update_interval,
                -self.pred.topk_ratio)

    def where(self) -> str:
        return f"topk_ratio={self.pred.topk_ratio:g}, update_interval={self.pred.update_interval}"


def _why_no_offloading(chosen: _Point, feasible: Sequence[_Point], tolerance: float, fixed: bool) -> list[str]:
    """What r = 1 means, in words, and why it was chosen: what the best offloading setting would have saved."""
    what = (f"topk_ratio=1 means no offloading: plain AdamW, every column updated on the device each step "
            f"(update_interval does nothing then); no host work, no stall, all optimizer state on the device "
            f"({format_bytes(chosen.pred.device_bytes)})")
    if fixed:
        return [what]
    offloading = [p for p in feasible if p.pred.topk_ratio < 1]
    if not offloading:
        return [what, "why no offloading: no setting with topk_ratio < 1 meets the loss budget within the bounds"]
    alt = min(offloading, key=lambda p: p.step_s)
    saved = chosen.step_s - alt.step_s
    if saved <= 0:
        why = (f"why no offloading: it would not make the step faster ({alt.where()} predicts "
               f"{format_seconds(alt.step_s)} against {format_seconds(chosen.step_s)})")
    else:
        why = (f"why no offloading: the fastest offloading setting ({alt.where()}, {alt.loss:.3f}x AdamW) saves "
               f"{format_seconds(saved)} per step ({saved / chosen.step_s:.2%}): within the {tolerance:.0%} tie, "
               "which goes to the lower loss")
    return [what, why]


def plan(
    profile: Profile,
    workload: Workload,
    *,
    topk_ratio: float | None = None,
    update_interval: int | None = None,
    cpu_threads: int | None = None,
    select_interval: int | None = None,
    overlap: bool = True,
    targets: Targets | None = None,
    quality: QualityTable | None = None,
    profile_source: str = "",
    relax_hint: str = "raise --max-loss-ratio to trade quality for speed",
    accumulate: str = "device",
    host_lr_scale: float | None = None,
    overlap_steps: int | str | None = None,
) -> Plan:
    """Choose the settings the caller left as None; predict and explain the result.

    Rule: among the ``(r, U)`` whose predicted loss ratio (``quality``, default the shipped table) is within
    ``targets.max_loss_ratio``, that fit ``workload.memory_budget_bytes`` and the bounds
    (``targets.min_topk_ratio``, ``targets.max_update_interval``; ``U`` a divisor of ``select_interval`` when that
    is fixed), take those whose predicted step time (:attr:`Prediction.step_s`) is within
    ``targets.speed_tolerance`` of the fastest, and of these the lowest predicted loss ratio. Settings outside the
    quality table's measured range are never chosen while one inside exists. When nothing meets the budget, the
    lowest predicted loss ratio is chosen and the plan says so (``loss_budget_met`` False); when the choice leaves
    the host work exposed, the reason says how much stall to expect and whether a looser budget would hide it
    (``relax_hint`` is how to loosen it). ``cpu_threads`` = :func:`choose_threads`. ``host_lr_scale`` (None: choose)
    is the table's :meth:`~.quality.QualityTable.host_lr_scale` at the chosen ``(r, U, overlap)``, else 1.0; a scale
    is only taken where it measured a lower loss than 1.0 on every task, so the predicted loss ratio (1.0's) stays
    an upper bound and the budget holds. ``accumulate``: where the window sum lives ("device" or "host";
    :func:`plan_accumulate` chooses it), for the memory budget and the predictions. ``overlap_steps``: the user's
    (DESIGN §3), which gives each job that many steps to hide in; only ``U >= overlap_steps`` is considered;
    ``"auto"``: chosen after ``(r, U)``, the fewest steps K whose predicted step time stays within
    ``targets.speed_tolerance`` of merging at the next window end (:func:`_overlap_steps`).
    """
    targets = targets or Targets()
    table = quality if quality is not None else default_quality_table()
    threads = cpu_threads if cpu_threads is not None else choose_threads(profile, workload.grad_dtype,
                                                                         device=workload.device)
    notes: list[str] = []
    fixed_k = overlap_steps if overlap_steps != "auto" else None

    r_mem, mem_why = _memory_limit(workload, accumulate)
    if topk_ratio is not None:
        ratios = [float(topk_ratio)]
    elif r_mem is not None and r_mem < 0:
        ratios = [0.0]
        notes.append(mem_why)
    else:
        hi = 1.0 if r_mem is None else r_mem
        lo = targets.min_topk_ratio
        ratios = sorted({r for r in (*_RATIO_STEPS, *table.topk_ratios, lo, hi) if lo <= r <= hi})
        if not ratios:
            ratios = [hi]
            notes.append(f"min_topk_ratio={lo:g} does not fit the {mem_why}: topk_ratio={hi:g}")
        elif hi < 1.0:
            notes.append(f"topk_ratio at most {hi:g}: the {mem_why}")
    if update_interval is not None:
        intervals = [int(update_interval)]
    else:
        intervals = [u for u in range(fixed_k or 1, targets.max_update_interval + 1)
                     if select_interval is None or select_interval % u == 0] or [fixed_k or 1]

    points = [
        _Point(pred, table.predict(r, u) if r > 0 else None)
        for r in ratios for u in intervals
        for pred in [predict(profile, workload, topk_ratio=r, update_interval=u, cpu_threads=threads,
                             select_interval=select_interval, overlap=overlap, select_windows=targets.select_windows,
                             accumulate=accumulate, overlap_steps=fixed_k)]
    ]
    budget = targets.max_loss_ratio
    known = [p for p in points if p.loss is not None]
    feasible = [p for p in known if p.loss <= budget + 1e-12]
    fixed = [name for name, v in (("topk_ratio", topk_ratio), ("update_interval", update_interval)) if v is not None]
    fixed_note = f" ({' and '.join(fixed)} fixed by the caller)" if fixed else ""
    def hidden(p: _Point) -> bool:
        return p.pred.stall_fraction <= targets.stall_fraction

    if feasible:
        fastest = min(p.step_s for p in feasible)
        # Ties within the tolerance go to a setting that hides the host work, then to the lower loss.
        chosen = min((p for p in feasible if p.step_s <= fastest * (1 + targets.speed_tolerance)),
                     key=lambda p: (not hidden(p), *p.key()))
        first = (f"{chosen.where()}: predicted loss {chosen.loss:.3f}x AdamW, within the budget {budget:g}; the "
                 f"fastest such setting (ties within {targets.speed_tolerance:.0%} go to the lower loss){fixed_note}")
    elif known:
        chosen = min(known, key=_Point.key)
        first = (f"{chosen.where()}: no setting within the bounds meets the loss budget {budget:g}; this one has the "
                 f"lowest predicted loss, {chosen.loss:.3f}x AdamW{fixed_note}")
    else:
        chosen = min(points, key=lambda p: (p.step_s, p.pred.update_interval, -p.pred.topk_ratio))
        first = (f"{chosen.where()}: outside the quality table's measured range (r >= {table.topk_ratios[0]:g}, "
                 f"U <= {table.update_intervals[-1]}), so its loss is unknown; the fastest setting{fixed_note}")
    k_line = ""
    if overlap_steps == "auto" and overlap and chosen.pred.topk_ratio < 1:
        fixed_k, k_pred, k_line = _overlap_steps(profile, workload, chosen.pred, accumulate=accumulate,
                                                 select_windows=targets.select_windows,
                                                 tolerance=targets.speed_tolerance)
        chosen = _Point(k_pred, chosen.loss)
    pred = chosen.pred
    hides = hidden(chosen)
    u, t = pred.update_interval, workload.step_time_s
    lines = [
        first,
        f"predicted step {format_seconds(pred.step_s)}: {format_seconds(t)} model, "
        f"{format_seconds(pred.device_step_s)} device-side optimizer, {format_seconds(pred.stall_s / u)} stall "
        f"({pred.stall_fraction:.1%} of the model step)",
        f"per {u}-step window: host AdamW {format_seconds(pred.cpu_s)} on "
        f"{format_count((1 - pred.topk_ratio) * workload.numel)} params, {format_seconds(pred.wait_s)} waiting on it "
        f"(a flush every {pred.select_interval} steps included), {format_seconds(pred.copy_s)} of "
        + ("host memcpy and merge" if workload.device == "cpu" else "PCIe copies and merge") + " not hidden",
    ]
    if not hides:
        stall = f"expect {pred.stall_fraction:.0%} stall"
        tol = 1 + targets.speed_tolerance
        faster = [p for p in known if p.loss > budget + 1e-12 and p.step_s * tol < chosen.step_s]
        slower = [p for p in feasible if hidden(p)]
        if faster and chosen.loss is not None:
            # What a looser budget buys: the lowest-loss setting that hides the host work, else the fastest.
            alt = min((p for p in faster if hidden(p)), key=_Point.key, default=None) or min(
                faster, key=lambda p: p.step_s)
            lines.append(f"this machine cannot hide the host work at this quality: {stall}; {relax_hint} "
                         f"({alt.where()}: {alt.loss:.3f}x AdamW, step {format_seconds(alt.step_s)}, "
                         f"{alt.pred.stall_fraction:.0%} stall)")
        elif slower:
            alt = min(slower, key=lambda p: p.step_s)
            lines.append(f"{stall}: hiding the host work within the budget ({alt.where()}) would make the step slower, "
                         f"{format_seconds(alt.step_s)}")
        else:
            least = min(points, key=lambda p: p.pred.stall_fraction)
            lines.append(f"this machine cannot hide the host work within the bounds and the quality table's range: "
                         f"{stall} (the least: {least.pred.stall_fraction:.0%} at {least.where()})")
    if pred.topk_ratio >= 1:
        lines.extend(_why_no_offloading(chosen, feasible, targets.speed_tolerance, topk_ratio is not None))
    rate = profile.cpu_adamw.rate(workload.grad_dtype, threads)
    lines.append(f"cpu_threads={threads}: " + ("fixed by the caller" if cpu_threads is not None else
                 f"the fastest measured count leaving a core to training ({format_count(rate)} params/s, "
                 f"{workload.grad_dtype} gradients)"))
    lines.extend(notes)
    if accumulate == "host" and pred.topk_ratio < 1:
        lines.extend(host_assumptions(profile, workload, threads))
    scale, scale_line = _host_scale(table, pred.topk_ratio, u, overlap, host_lr_scale)
    if scale_line:
        lines.append(scale_line)
    if k_line:
        lines.append(k_line)
    lines.append(f"loss ratios: {table.source or 'quality table'}, measured on a small model: a prior, not a "
                 "guarantee (pass your own table, or quality_regime='finetune' / 'scratch': docs/quality.md)")
    if workload.device == "cpu":
        lines.append("CPU tensors: the training compute and the host worker share cores, which the model ignores")
    if profile.quick:
        lines.append("from a quick profile; `python -m zenflow_triton.autotune` measures a full one")
    spread = table.predict_spread(pred.topk_ratio, u) if pred.topk_ratio > 0 else None
    return Plan(
        topk_ratio=pred.topk_ratio,
        update_interval=u,
        cpu_threads=threads,
        grad_dtype=workload.grad_dtype,
        predicted_loss_ratio=chosen.loss,
        max_loss_ratio=budget,
        loss_budget_met=chosen.loss is not None and chosen.loss <= budget + 1e-12,
        hides_host_work=hides,
        predicted_step_s=pred.step_s,
        predicted_stall_s=pred.stall_s,
        predicted_wait_s=pred.wait_s,
        predicted_copy_s=pred.copy_s,
        predicted_host_s=pred.host_s,
        reason="\n".join(lines),
        prediction=pred,
        profile_source=profile_source,
        quality_source=table.source,
        predicted_loss_spread=spread,
        accumulate=accumulate,
        device_bytes_per_param={m: device_bytes_per_param(pred.topk_ratio, m) for m in ACCUMULATE_MODES},
        host_lr_scale=scale,
        overlap_steps=fixed_k,
    )


def _overlap_steps(profile: Profile, workload: Workload, base: Prediction, *, accumulate: str,
                   select_windows: int, tolerance: float) -> tuple[int, Prediction, str]:
    """``overlap_steps="auto"`` at the chosen ``(r, U)`` with overlap and host work: the fewest steps K after a
    window end whose merge keeps the predicted step within ``tolerance`` of merging at the next window end (``base``,
    K = U), its prediction and the plan's line. Fewer steps leave fewer stale gradients (docs/quality.md)."""
    u = base.update_interval
    for k in range(1, u + 1):
        pk = predict(profile, workload, topk_ratio=base.topk_ratio, update_interval=u, cpu_threads=base.cpu_threads,
                     select_interval=base.select_interval, overlap=True, select_windows=select_windows,
                     accumulate=accumulate, overlap_steps=k)
        if pk.step_s <= base.step_s * (1 + tolerance):
            break
    if k == u:
        line = f"overlap_steps={u}: the host job needs the whole window to hide (merged earlier, it would stall)"
    else:
        line = (f"overlap_steps={k}: each result merged {k} step{'s' if k > 1 else ''} after its window end, not "
                f"{u}, within {tolerance:.0%} of the step time (fewer stale gradients: docs/quality.md)")
    return k, pk, line


def _host_scale(table: QualityTable, r: float, u: int, overlap: bool, fixed: float | None) -> tuple[float, str]:
    """(host_lr_scale, the reason's line about it, "" when there is nothing to say)."""
    if fixed is not None:
        return float(fixed), ("" if fixed == 1.0 else f"host_lr_scale={fixed:g}: fixed by the caller")
    entry = table.host_lr_scale(r, u, overlap) if 0 < r < 1 else None
    if entry is not None:
        ratios = "/".join(f"{x:.3f}" for x in entry.ratio)
        return entry.host_lr_scale, (f"host_lr_scale={entry.host_lr_scale:g}: best loss {ratios} of Adam's host "
                                     f"step's on {len(entry.ratio)} measured tasks at this setting, stable; the "
                                     "predicted loss ratio is Adam's step's, an upper bound")
    tried = [e for e in table.host_scales if e.overlap == overlap and e.update_interval == u
             and math.isclose(e.topk_ratio, r, rel_tol=1e-9)]
    if tried:
        seen = "; ".join(f"s={e.host_lr_scale:g}: best {'/'.join(f'{x:.3f}' for x in e.ratio)}"
                         + (f", equal lr up to {max(e.equal_lr_worst):.3f}" if e.equal_lr_worst else "")
                         + ("" if e.stable else ", unstable") for e in tried)
        return 1.0, f"host_lr_scale=1 (Adam's step): no measured scale was better on every task here ({seen})"
    return 1.0, ""


def stall_grid(
    profile: Profile,
    workload: Workload,
    *,
    update_intervals: Sequence[int],
    topk_ratios: Sequence[float],
    cpu_threads: int,
    overlap: bool = True,
    select_windows: int = DEFAULT_SELECT_WINDOWS,
) -> list[list[float]]:
    """Predicted stall fraction for every ``(r, U)``: ``grid[i][j]`` is ``topk_ratios[i]`` x ``update_intervals[j]``."""
    return [
        [predict(profile, workload, topk_ratio=r, update_interval=u, cpu_threads=cpu_threads, overlap=overlap,
                 select_windows=select_windows).stall_fraction for u in update_intervals]
        for r in topk_ratios
    ]


def plan_accumulate(profile: Profile, workload: Workload, *, accumulate: str = "auto",
                    placement_ratio: float | None = None, **kwargs: Any) -> Plan:
    """:func:`plan` (``kwargs`` are its arguments) with the window sum placed, the choice in the plan.

    ``accumulate``: "device" or "host" as given, or "auto": the optimizer's rule,
    :func:`.placement.place_accumulation`, on the workload's memory budget (which holds its margin already), at
    ``placement_ratio`` (default: the caller's fixed ``topk_ratio``, else :data:`DEFAULT_PLACEMENT_RATIO`), the ratio
    the optimizer places by, since it places before its plan: "device" when that state fits, else "host"; "device"
    on CPU tensors (nothing to save) or without a budget. The plan is then made in that mode (with "host" the budget
    holds no sum). The reason gains two lines: the choice and why, and the predicted step and device state of each
    mode at the chosen setting.
    """
    from .placement import place_accumulation

    p = workload.numel
    if accumulate == "auto":
        budget = workload.memory_budget_bytes
        fixed = kwargs.get("topk_ratio")
        ratio = float(placement_ratio if placement_ratio is not None else
                      fixed if fixed is not None else DEFAULT_PLACEMENT_RATIO)
        placement = place_accumulation(device=workload.device, offloaded_numel=p, topk_ratio=ratio,
                                       available_bytes=budget, grad_bytes=slot_bytes(workload.param_bytes,
                                                                                      workload.grad_dtype),
                                       fraction=1.0, what="device memory budget")
        choice = placement.accumulate
        why = placement.reason
        if workload.device == "cuda" and budget is not None:
            by = "the caller's" if placement_ratio is None and fixed is not None else "the default ratio"
            why = f"at topk_ratio={ratio:g} ({by}: the optimizer places the sum before it plans) " + why
    elif accumulate in ACCUMULATE_MODES:
        choice, why = accumulate, "fixed by the caller"
    else:
        raise ValueError(f"Invalid accumulate: {accumulate!r} (one of {('auto', *ACCUMULATE_MODES)})")
    chosen = plan(profile, workload, accumulate=choice, **kwargs)
    pr = chosen.prediction
    targets = kwargs.get("targets") or Targets()
    modes = {m: predict(profile, workload, topk_ratio=pr.topk_ratio, update_interval=pr.update_interval,
                        cpu_threads=pr.cpu_threads, select_interval=pr.select_interval,
                        overlap=kwargs.get("overlap", True), select_windows=targets.select_windows, accumulate=m,
                        overlap_steps=kwargs.get("overlap_steps"))
             for m in ACCUMULATE_MODES}
    host = modes["host"]
    u = pr.update_interval
    lines = [
        f'accumulate="{choice}": {why}',
        f'predicted step at this setting: "device" {format_seconds(modes["device"].step_s)} '
        f'({format_bytes(modes["device"].device_bytes)} of device state), "host" {format_seconds(host.step_s)} '
        f"({format_bytes(host.device_bytes)}; per step {format_seconds(host.d2h_s / u)} of gradient copies "
        f"and {format_seconds(host.add_s / u)} of host adds)",
    ]
    if choice != "host" and pr.topk_ratio < 1:  # a "host" plan's reason says it already
        lines.extend(host_assumptions(profile, workload, pr.cpu_threads))
    return dataclasses.replace(chosen, accumulate_reason=why, reason=chosen.reason + "\n" + "\n".join(lines))
