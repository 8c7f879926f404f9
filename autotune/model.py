"""The autotuner's cost model: pure arithmetic on a measured :class:`Profile`, no hardware touched.

Per *window* (``U`` steps; DESIGN §5) the model predicts, for an offloaded parameter count ``P``:

- ``cpu_s  = n_params * call_overhead + (1 - r) * P / cpu_rate(threads, grad dtype)``: the host AdamW job;
- ``d2h_s`` / ``h2d_s``: the accumulated gradients down (in the landing dtype) and the snapshot back up (in
  the model dtype), one copy per parameter, each timed on the measured bandwidth-versus-size curve, plus the
  merge into the unselected columns (``P / merge_rate``). On CPU tensors the way down is a host ``memcpy`` and
  the way back is the merge alone;
- ``host_s = cpu_s + d2h_s + h2d_s``: one window's round trip of host work (the issue's formula);
- ``job_s``: what the worker does per window: ``cpu_s``, plus on CUDA the wait for the D2H it reads;
- ``wait_s``: how long ``step()`` blocks on the host job, averaged over windows (what ``stats()`` counts as
  stall). With ``overlap=True`` a job runs while the next ``U`` steps compute, so it is exposed by
  ``max(0, job_s - U * (T + dev_s))``; the flush at each selection step (every ``S`` steps) waits for a job
  that has had one step to run, exposing ``max(0, job_s - (T + dev_s))`` once per ``S / U`` windows. With
  ``overlap=False`` every window waits for all of ``job_s``.
- ``copy_s``: copy time on the training side that nothing hides: on CUDA the H2D (it runs on the compute
  stream before the merge) and whatever of the D2H outlasts one step (the next fused kernel overwrites
  ``acc``); on CPU tensors both copies (the training thread makes them);
- ``stall_s = wait_s + copy_s``; the *stall fraction* is ``stall_s / (U * T)``;
- device memory for the optimizer's device state: ``P * (acc_bytes + 12 * r)``;
- device optimizer time per step: ``P / pass_rate + r * P / adam_rate`` (the fused pass over every gradient,
  plus Adam on the selected columns).

:func:`plan` picks ``topk_ratio`` first as the largest ratio that fits the device-memory budget and keeps
the device-side Adam under a fraction of the step time (neither depends on ``U``), then the smallest
``update_interval`` whose stall fraction is under the target, and the host thread count with the best
measured rate that leaves one core to the training process.

The module is pure: it imports only :mod:`.profile`, never the optimizer's package. What it needs from the
optimizer's configuration (the number of windows between reselections) comes in as an argument
(``Targets.select_windows``, ``select_windows=``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .profile import BandwidthCurve, DeviceOpRates, GpuInfo, Profile

__all__ = [
    "ACC_BYTES",
    "GRAD_BYTES",
    "STATE_BYTES",
    "DEFAULT_SELECT_WINDOWS",
    "Workload",
    "Targets",
    "Prediction",
    "Plan",
    "shapes_for_param_count",
    "predict",
    "plan",
    "choose_threads",
    "stall_grid",
]

# Bytes per element of the landing buffer on the host, by ZenFlowConfig.grad_dtype.
GRAD_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}
# The device accumulator for unselected columns is fp32 (DESIGN §4).
ACC_BYTES = 4
# Compact fp32 master, exp_avg, exp_avg_sq of a selected element on the device (DESIGN §4).
STATE_BYTES = 12
# Device traffic per element of the fused pass (read the gradient, read and write acc) and per selected
# element of the device Adam (read and write master, m, v; write the param). Used only to turn a measured
# device copy bandwidth into op rates on a GPU: the Triton kernels stream, so they run near copy bandwidth.
_PASS_BYTES_FIXED = 2 * ACC_BYTES
_ADAM_BYTES_FIXED = 2 * STATE_BYTES

# Windows between reselections when select_interval is not fixed. The optimizer's value is
# zenflow_triton.config.DEFAULT_SELECT_WINDOWS, which callers planning for the optimizer (the bridge, the CLI)
# pass explicitly: this module imports nothing from the optimizer's package. The default only serves callers of
# the bare model; tests/test_autotune_model.py checks that it agrees with the config's.
DEFAULT_SELECT_WINDOWS = 8

DeviceKind = Literal["cuda", "cpu"]


# -------------------------------------------------------------------------------------------- workload


def shapes_for_param_count(num_params: int, *, block: tuple[int, int] = (4096, 4096)) -> tuple[tuple[int, int], ...]:
    """Offloaded shapes for a model known only by its parameter count: ``block``-sized matrices plus a remainder.

    The shapes matter only through per-copy sizes and per-call overheads; 4096x4096 is a typical
    projection of a 7B-class model.
    """
    if num_params < 1:
        raise ValueError(f"Invalid parameter count: {num_params}")
    rows, cols = block
    per = rows * cols
    full, rest = divmod(int(num_params), per)
    shapes = [(rows, cols)] * full
    if rest:
        shapes.append((max(1, rest // cols), cols) if rest >= cols else (1, rest))
    return tuple(shapes)


@dataclass(frozen=True)
class Workload:
    """What is being planned for: the offloaded matrices, their dtypes, the step time and the memory budget."""

    shapes: tuple[tuple[int, int], ...]
    """``[R, C]`` of every offloaded parameter."""
    step_time_s: float
    """Seconds per training step outside ``step()`` (forward, backward, data): the time host work can hide in."""
    param_bytes: int = 2
    """Bytes per element of the model dtype (the snapshot sent back)."""
    grad_dtype: str = "float32"
    """Landing dtype of the gradients on the host (ZenFlowConfig.grad_dtype)."""
    device: DeviceKind = "cuda"
    memory_budget_bytes: float | None = None
    """Device memory the optimizer's device state may use; None: no limit (CPU tensors)."""

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("Workload needs at least one offloaded shape")
        if any(r < 1 or c < 1 for r, c in self.shapes):
            raise ValueError(f"Invalid offloaded shapes: {self.shapes}")
        if not (self.step_time_s > 0 and math.isfinite(self.step_time_s)):
            raise ValueError(f"Invalid step_time_s: {self.step_time_s!r}")
        if self.grad_dtype not in GRAD_BYTES:
            raise ValueError(f"Invalid grad_dtype: {self.grad_dtype!r} (one of {sorted(GRAD_BYTES)})")
        if self.param_bytes not in (2, 4):
            raise ValueError(f"Invalid param_bytes: {self.param_bytes!r} (2 or 4)")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"Invalid device kind: {self.device!r}")
        if self.memory_budget_bytes is not None and not self.memory_budget_bytes >= 0:
            raise ValueError(f"Invalid memory_budget_bytes: {self.memory_budget_bytes!r}")

    @property
    def numel(self) -> int:
        return sum(r * c for r, c in self.shapes)


@dataclass(frozen=True)
class Targets:
    """The chooser's goals."""

    stall_fraction: float = 0.05
    """Largest acceptable stall per step, as a fraction of the step time."""
    device_fraction: float = 0.05
    """Largest acceptable device-side Adam time on the selected columns, as a fraction of the step time."""
    max_update_interval: int = 64
    """Largest U considered: longer windows mean staler host updates."""
    select_windows: int = DEFAULT_SELECT_WINDOWS
    """Windows between reselections when select_interval is not fixed; planning for the optimizer passes
    ``zenflow_triton.config.DEFAULT_SELECT_WINDOWS``."""

    def __post_init__(self) -> None:
        if not 0 < self.stall_fraction < 1:
            raise ValueError(f"Invalid stall_fraction target: {self.stall_fraction!r}")
        if not 0 < self.device_fraction <= 1:
            raise ValueError(f"Invalid device_fraction target: {self.device_fraction!r}")
        if self.max_update_interval < 1 or self.select_windows < 1:
            raise ValueError("max_update_interval and select_windows must be >= 1")


# ------------------------------------------------------------------------------------------ prediction


@dataclass(frozen=True)
class Prediction:
    """Predicted costs of one setting. Times ending in ``_s`` are per window unless the name says per step."""

    topk_ratio: float
    update_interval: int
    select_interval: int
    cpu_threads: int
    step_time_s: float
    cpu_s: float
    d2h_s: float
    h2d_s: float
    host_s: float
    job_s: float
    wait_s: float
    copy_s: float
    stall_s: float
    device_step_s: float
    """Device-side optimizer time per step (fused pass plus Adam on the selected columns)."""
    device_bytes: float
    """Device memory of the optimizer's device state (acc plus compact state of the selected columns)."""

    @property
    def stall_fraction(self) -> float:
        """Stall per step over the step time."""
        return self.stall_s / (self.update_interval * self.step_time_s)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["stall_fraction"] = self.stall_fraction
        return d


def _device_rates(profile: Profile, workload: Workload) -> DeviceOpRates:
    if workload.device == "cpu":
        return profile.cpu_device
    if profile.gpu is None:
        raise ValueError(
            "the profile has no GPU figures (" + (profile.gpu_unavailable or "measured without CUDA") + "); "
            "run `python -m zenflow_triton.autotune` on the GPU machine"
        )
    return _gpu_device_rates(profile.gpu, workload.param_bytes)


def _gpu_device_rates(gpu: GpuInfo, param_bytes: int) -> DeviceOpRates:
    """Op rates of the Triton kernels, taken as streaming at the measured copy bandwidth."""
    return DeviceOpRates(
        source=f"derived from {gpu.mem_bandwidth / 1e9:.0f} GB/s device bandwidth",
        pass_rate=gpu.mem_bandwidth / (param_bytes + _PASS_BYTES_FIXED),
        adam_rate=gpu.mem_bandwidth / (param_bytes + _ADAM_BYTES_FIXED),
        merge_rate=gpu.mem_bandwidth / (2 * param_bytes),  # read the staged snapshot, write the param
    )


def _copy_curves(profile: Profile, workload: Workload) -> tuple[BandwidthCurve, BandwidthCurve]:
    if workload.device == "cpu":
        return profile.memcpy, profile.memcpy
    _device_rates(profile, workload)  # raises the explanatory error when the GPU figures are missing
    assert profile.gpu is not None
    return profile.gpu.d2h, profile.gpu.h2d


@functools.lru_cache(maxsize=256)
def _copy_seconds(curve: BandwidthCurve, shapes: tuple[tuple[int, int], ...], itemsize: int) -> float:
    # Cached: the chooser evaluates dozens of (U, r) for one workload, and a 70B model has hundreds of matrices.
    return sum(curve.seconds(r * c * itemsize) for r, c in shapes)


def predict(
    profile: Profile,
    workload: Workload,
    *,
    topk_ratio: float,
    update_interval: int,
    cpu_threads: int,
    select_interval: int | None = None,
    overlap: bool = True,
    select_windows: int = DEFAULT_SELECT_WINDOWS,
) -> Prediction:
    """Predicted per-window costs of running ``workload`` with these settings (formulas: module docstring)."""
    if not 0.0 <= topk_ratio <= 1.0:
        raise ValueError(f"Invalid topk_ratio: {topk_ratio!r}")
    if update_interval < 1:
        raise ValueError(f"Invalid update_interval: {update_interval!r}")
    if cpu_threads < 1:
        raise ValueError(f"Invalid cpu_threads: {cpu_threads!r}")
    s = select_interval if select_interval is not None else select_windows * update_interval
    if s < update_interval or s % update_interval:
        raise ValueError(f"select_interval={s} is not a multiple of update_interval={update_interval}")
    r, u, t = float(topk_ratio), int(update_interval), workload.step_time_s
    p = workload.numel
    rates = _device_rates(profile, workload)
    d2h_curve, h2d_curve = _copy_curves(profile, workload)

    if r >= 1.0:
        # Nothing is left for the host: no job, no copies (DESIGN §3: topk_ratio=1 is plain device AdamW).
        cpu_s = d2h_s = h2d_s = 0.0
    else:
        rate = profile.cpu_adamw.rate(workload.grad_dtype, cpu_threads)
        cpu_s = len(workload.shapes) * profile.cpu_adamw.overhead(cpu_threads) + (1.0 - r) * p / rate
        # Whole [R, C] tensors travel: a column subset is strided, and one dense copy beats a gather.
        gbytes, pbytes = GRAD_BYTES[workload.grad_dtype], workload.param_bytes
        d2h_s = _copy_seconds(d2h_curve, workload.shapes, gbytes)
        # The way back ends in the merge into the unselected columns. On CPU tensors the merge reads the host
        # buffer directly and is all there is; on CUDA the snapshot first crosses PCIe into a staging buffer.
        h2d_s = p / rates.merge_rate
        if workload.device == "cuda":
            h2d_s += _copy_seconds(h2d_curve, workload.shapes, pbytes)

    device_step_s = p / rates.pass_rate + r * p / rates.adam_rate
    if workload.device == "cuda":
        # The job starts by waiting for the D2H on the copy stream, which overlaps the next step's forward and
        # backward; the device waits for it only before that step's fused kernel overwrites acc. The H2D of the
        # snapshot runs on the compute stream ahead of the merge, so it is never hidden.
        job_s = d2h_s + cpu_s
        copy_s = h2d_s + max(0.0, d2h_s - t)
    else:
        # CPU tensors: the training thread copies acc to the landing buffer and merges the snapshot itself.
        job_s = cpu_s
        copy_s = d2h_s + h2d_s
    if overlap:
        # A job overlaps the U steps (model compute plus the device-side optimizer) of the next window ...
        hidden = u * (t + device_step_s)
        regular = max(0.0, job_s - hidden)
        # ... except at a selection step, whose flush waits for the job submitted one step earlier, which has had
        # one step to run. That happens once every S/U windows, and the window end after it finds no job to wait
        # for, so a cycle of S/U window ends holds S/U - 1 regular waits and one flush.
        flush = max(0.0, job_s - (t + device_step_s))
        windows_per_selection = s // u
        wait_s = ((windows_per_selection - 1) * regular + flush) / windows_per_selection
    else:
        wait_s = job_s
    return Prediction(
        topk_ratio=r,
        update_interval=u,
        select_interval=s,
        cpu_threads=cpu_threads,
        step_time_s=t,
        cpu_s=cpu_s,
        d2h_s=d2h_s,
        h2d_s=h2d_s,
        host_s=cpu_s + d2h_s + h2d_s,
        job_s=job_s,
        wait_s=wait_s,
        copy_s=copy_s,
        stall_s=wait_s + copy_s,
        device_step_s=device_step_s,
        device_bytes=p * (ACC_BYTES + STATE_BYTES * r),
    )


# ---------------------------------------------------------------------------------------------- choice


@dataclass(frozen=True)
class Plan:
    """The chosen settings, their predicted costs and why they were chosen.

    ``predicted_stall_s`` is what the optimizer's ``stats()`` measures as stall (time ``step()`` waits on the
    host job, per window, selection flushes included); ``predicted_copy_s`` is the copy time per window on top.
    """

    topk_ratio: float
    update_interval: int
    cpu_threads: int
    grad_dtype: str
    predicted_stall_s: float
    predicted_host_s: float
    predicted_copy_s: float
    reason: str
    prediction: Prediction
    target_met: bool
    profile_source: str = ""

    def config_fields(self) -> dict[str, Any]:
        """The choice as ZenFlowConfig fields: ``config.replace(**plan.config_fields())``."""
        return {"topk_ratio": self.topk_ratio, "update_interval": self.update_interval,
                "cpu_threads": self.cpu_threads, "grad_dtype": self.grad_dtype}

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "prediction"}
        d["prediction"] = self.prediction.to_dict()
        return d


def choose_threads(profile: Profile, grad_dtype: str) -> int:
    """Measured thread count with the best host AdamW rate among those leaving one core to the training process.

    The plain maximum (not "fewest within x% of the best"): a faster CPU must never make the plan worse.
    """
    table = profile.cpu_adamw.rates.get(grad_dtype)
    if not table:
        raise ValueError(f"profile has no host AdamW rate for grad dtype {grad_dtype!r}")
    allowed = [t for t in table if t <= max(1, profile.cpu_cores - 1)] or [min(table)]
    return max(allowed, key=lambda t: (table[t], -t))


def _floor_2sig(x: float) -> float:
    """Round down to two significant digits, so a printed ratio reads cleanly and never exceeds a limit."""
    if x <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(x)) - 1)
    return math.floor(round(x / scale, 9)) * scale if x < 1 else 1.0


def _fmt_s(x: float) -> str:
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} us"


def _fmt_bytes(x: float) -> str:
    return f"{x / 2**30:.1f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def _largest_ratio(profile: Profile, workload: Workload, targets: Targets) -> tuple[float, str]:
    p = workload.numel
    rates = _device_rates(profile, workload)
    limits: list[tuple[float, str]] = [(1.0, "every column fits on the device")]
    dev_limit = targets.device_fraction * workload.step_time_s * rates.adam_rate / p
    limits.append((dev_limit, f"device-side Adam under {targets.device_fraction:.0%} of the step time "
                              f"({rates.adam_rate:.3g} params/s, {rates.source})"))
    budget = workload.memory_budget_bytes
    if budget is not None:
        mem_limit = (budget / p - ACC_BYTES) / STATE_BYTES
        limits.append((mem_limit, f"device memory budget {_fmt_bytes(budget)} "
                                  f"({ACC_BYTES} B acc + {STATE_BYTES} B per selected element)"))
    limit, why = min(limits, key=lambda x: x[0])
    if limit < 0:
        return 0.0, (f"the device memory budget ({_fmt_bytes(budget or 0)}) cannot even hold the fp32 "
                     f"accumulator ({_fmt_bytes(p * ACC_BYTES)}); expect out-of-memory")
    return _floor_2sig(min(1.0, limit)), why


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
    profile_source: str = "",
) -> Plan:
    """Choose the settings the caller left as None; predict and explain the result.

    Rule: ``topk_ratio`` = the largest ratio (two significant digits, at most 1) that fits
    ``workload.memory_budget_bytes`` and keeps the device-side Adam under ``targets.device_fraction`` of the
    step time; ``update_interval`` = the smallest U (a divisor of ``select_interval`` when that is fixed) whose
    stall fraction is at most ``targets.stall_fraction``, else the U with the least stall; ``cpu_threads`` =
    :func:`choose_threads`.
    """
    targets = targets or Targets()
    parts: list[str] = []
    threads = cpu_threads if cpu_threads is not None else choose_threads(profile, workload.grad_dtype)
    if topk_ratio is None:
        r, why = _largest_ratio(profile, workload, targets)
        parts.append(f"topk_ratio={r:g}: the largest ratio within {why}")
    else:
        r = float(topk_ratio)
        parts.append(f"topk_ratio={r:g}: fixed by the caller")

    def at(u: int) -> Prediction:
        return predict(profile, workload, topk_ratio=r, update_interval=u, cpu_threads=threads,
                       select_interval=select_interval, overlap=overlap, select_windows=targets.select_windows)

    if update_interval is None:
        candidates = [u for u in range(1, targets.max_update_interval + 1)
                      if select_interval is None or select_interval % u == 0] or [1]
        pred = next((p for p in map(at, candidates) if p.stall_fraction <= targets.stall_fraction), None)
        if pred is not None:
            parts.append(f"update_interval={pred.update_interval}: the smallest U with predicted stall at most "
                         f"{targets.stall_fraction:.0%} of the step time")
        else:
            pred = min(map(at, candidates), key=lambda p: (p.stall_fraction, p.update_interval))
            parts.append(f"update_interval={pred.update_interval}: no U up to {candidates[-1]} keeps the stall under "
                         f"{targets.stall_fraction:.0%} of the step time; this U stalls least")
    else:
        pred = at(int(update_interval))
        parts.append(f"update_interval={pred.update_interval}: fixed by the caller")

    rate = profile.cpu_adamw.rate(workload.grad_dtype, threads)
    parts.append(f"cpu_threads={threads}: " + ("fixed by the caller" if cpu_threads is not None else
                 f"the fastest measured count leaving a core to training ({rate:.3g} params/s, "
                 f"{workload.grad_dtype} gradients, {profile.cpu_adamw.kernel} kernel)"))
    where = ("host memcpy and merge (CPU tensors: no PCIe)" if workload.device == "cpu"
             else "PCIe copies and merge")
    parts.append(
        f"per window: host AdamW {_fmt_s(pred.cpu_s)} on {(1 - r) * workload.numel:.3g} params, unhidden "
        f"{where} {_fmt_s(pred.copy_s)}, host work hidden behind {pred.update_interval} x "
        f"{_fmt_s(workload.step_time_s)} steps -> stall {_fmt_s(pred.stall_s)} "
        f"({pred.stall_fraction:.1%} of step time, {_fmt_s(pred.wait_s)} waiting on the host job incl. a flush "
        f"every {pred.select_interval} steps)"
    )
    if workload.device == "cpu":
        parts.append("CPU tensors: the training compute and the host worker share cores, which the model ignores")
    if profile.quick:
        parts.append("from a quick profile; `python -m zenflow_triton.autotune` measures a full one")
    return Plan(
        topk_ratio=r,
        update_interval=pred.update_interval,
        cpu_threads=threads,
        grad_dtype=workload.grad_dtype,
        predicted_stall_s=pred.wait_s,
        predicted_host_s=pred.host_s,
        predicted_copy_s=pred.copy_s,
        reason="; ".join(parts),
        prediction=pred,
        target_met=pred.stall_fraction <= targets.stall_fraction,
        profile_source=profile_source,
    )


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
