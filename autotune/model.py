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
- ``stall_s = wait_s + copy_s``: all the time a window loses to host-side work; the *stall fraction* is
  ``stall_s / (U * T)``;
- device memory for the optimizer's device state: ``P * (acc_bytes + 12 * r)``, where ``acc_bytes`` is 4 with
  ``accumulate="device"`` and 0 with ``"host"`` (:func:`device_bytes_per_param`);
- with ``accumulate="host"`` (:func:`predict`'s ``accumulate``) every step's gradient crosses to the host instead of
  one sum per window: ``d2h_s`` is ``U`` per-step copies of the whole gradients into the landing slots (bf16 with
  ``grad_dtype="bfloat16"``, else the gradient's own dtype), ``add_s`` the ``U`` host adds into the fp32 window sum
  (read the sum and the landed gradient, write the sum: ``8 + slot_bytes`` bytes per element) at
  :func:`host_add_bytes_per_s`: twice the profile's host ``memcpy`` peak, since a copy reads and writes each byte it
  counts (an assumption: the profile holds no figure of the add kernel itself, which streams at >= 0.9x the
  machine's bandwidth ceiling in ``bench/report_host.py``). The window end ships nothing, so the job is the last
  step's copy and add, then the AdamW; each step's copy (on CUDA a stream of its own, overlapping the next step)
  and add (a second host thread) are double-buffered, so the slower of the two is exposed by what it exceeds one
  step (``T + dev_s``) by; on CPU tensors the training thread makes the copies, all exposed. The adds share the
  host's cores and memory bandwidth with the window's AdamW job, which the model ignores;
- device optimizer time per step: ``P / pass_rate + r * P / adam_rate`` (the fused pass over every gradient,
  plus Adam on the selected columns);
- the time per training step: ``step_s = T + dev_s + stall_s / U`` (what the chooser minimises).

:func:`plan` weighs speed against quality: the predicted time per training step
(``step_s = T + dev_s + stall_s / U``) against the predicted loss ratio vs AdamW from a measured quality table
(:mod:`.quality`). Among the ``(r, U)`` within the loss budget (``Targets.max_loss_ratio``), the device-memory
budget and the user's bounds, it takes the fastest, ties within ``Targets.speed_tolerance`` going to the lower
loss; then the host thread count with the best measured rate that leaves one core to the training process.

The module is pure: it imports only :mod:`.profile`, :mod:`.quality`, :mod:`.results` and :mod:`.placement`, never
the optimizer's package. What it needs from the optimizer's configuration (the number of windows between
reselections) comes in as an argument (``Targets.select_windows``, ``select_windows=``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .profile import BandwidthCurve, DeviceOpRates, GpuInfo, Profile
from .quality import QualityTable, default_quality_table
from .results import Plan, Prediction, format_bytes, format_count, format_seconds

__all__ = [
    "ACC_BYTES",
    "ACCUMULATE_MODES",
    "DEFAULT_PLACEMENT_RATIO",
    "device_bytes_per_param",
    "host_add_bytes_per_s",
    "host_bytes_per_param",
    "plan_accumulate",
    "GRAD_BYTES",
    "STATE_BYTES",
    "DEFAULT_SELECT_WINDOWS",
    "DEFAULT_MAX_LOSS_RATIO",
    "Workload",
    "Targets",
    "Prediction",
    "Plan",
    "shapes_for_param_count",
    "predict",
    "plan",
    "choose_threads",
    "stall_grid",
    "format_count",
    "format_seconds",
]

# Bytes per element of the landing buffer on the host, by ZenFlowConfig.grad_dtype.
GRAD_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}
# The device accumulator for unselected columns is fp32 (DESIGN §4).
ACC_BYTES = 4
# Compact fp32 master, exp_avg, exp_avg_sq of a selected element on the device (DESIGN §4).
STATE_BYTES = 12
# Where the unselected columns' window sum lives (ZenFlowConfig.accumulate without "auto"; DESIGN §4).
ACCUMULATE_MODES = ("device", "host")
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

# The loss budget: predicted held-out loss at most 5% above AdamW's at equal steps. On the shipped table the demo's
# fixed topk_ratio=0.1, update_interval=4 lands at about 1.04, so the default allows what the project already
# recommends and rules out the long windows and tiny ratios a speed-only choice drifts to (U=62, r=0.0015).
DEFAULT_MAX_LOSS_RATIO = 1.05

# Candidate ratios besides the quality table's own: two significant digits, 1.3-1.5x apart, so a choice can land
# between measured ratios without claiming a precision the table does not have.
_RATIO_STEPS = (0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.07, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0)

# The ratio accumulate="auto" places the window sum by when topk_ratio is "auto" too (the optimizer places before
# its plan): ZenFlowConfig's default topk_ratio, passed in by nothing since this module imports nothing from the
# optimizer's package; tests/test_autotune_model.py checks that the two agree.
DEFAULT_PLACEMENT_RATIO = 0.1

DeviceKind = Literal["cuda", "cpu"]


# -------------------------------------------------------------------------------------------- workload


def shapes_for_param_count(num_params: int, *, block: tuple[int, int] = (4096, 4096)) -> tuple[tuple[int, int], ...]:
    """Offloaded shapes for a model known only by its parameter count: ``block``-sized matrices plus a remainder.

    The shapes matter only through per-copy sizes and per-call overheads; 4096x4096 is a typical
    projection of a 7B-class model. The shapes hold exactly ``num_params`` elements (the remainder is a
    ``[q, cols]`` block and one ``[1, rest]`` row), so the count a user gives is the count every output prints.
    """
    if num_params < 1:
        raise ValueError(f"Invalid parameter count: {num_params}")
    rows, cols = block
    full, rest = divmod(int(num_params), rows * cols)
    q, rem = divmod(rest, cols)
    shapes = [(rows, cols)] * full + ([(q, cols)] if q else []) + ([(1, rem)] if rem else [])
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
    """The chooser's goals and the user's bounds."""

    max_loss_ratio: float = DEFAULT_MAX_LOSS_RATIO
    """Quality budget: largest predicted held-out loss over AdamW's at equal steps (1 is AdamW itself)."""
    stall_fraction: float = 0.05
    """Stall per step, as a fraction of the step time, up to which the host work counts as hidden."""
    max_update_interval: int = 64
    """Largest U considered; the quality table's measured range limits it further."""
    min_topk_ratio: float = 0.0
    """Smallest r considered; the quality table's measured range limits it further."""
    speed_tolerance: float = 0.01
    """Predicted step times within this fraction of the fastest feasible one count as equal, and the lowest
    predicted loss among them wins: a step 0.5% faster is not worth a worse model."""
    select_windows: int = DEFAULT_SELECT_WINDOWS
    """Windows between reselections when select_interval is not fixed; planning for the optimizer passes
    ``zenflow_triton.config.DEFAULT_SELECT_WINDOWS``."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_loss_ratio) and self.max_loss_ratio >= 1.0):
            raise ValueError(f"Invalid max_loss_ratio: {self.max_loss_ratio!r} (>= 1; 1 is AdamW)")
        if not 0 < self.stall_fraction < 1:
            raise ValueError(f"Invalid stall_fraction target: {self.stall_fraction!r}")
        if not 0 <= self.min_topk_ratio <= 1:
            raise ValueError(f"Invalid min_topk_ratio: {self.min_topk_ratio!r} (in [0, 1])")
        if not 0 <= self.speed_tolerance < 1:
            raise ValueError(f"Invalid speed_tolerance: {self.speed_tolerance!r}")
        if self.max_update_interval < 1 or self.select_windows < 1:
            raise ValueError("max_update_interval and select_windows must be >= 1")


# ------------------------------------------------------------------------------------------ prediction


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
    accumulate: str = "device",
) -> Prediction:
    """Predicted per-window costs of running ``workload`` with these settings (formulas: module docstring);
    ``accumulate``: where the window sum lives, "device" or "host"."""
    if accumulate not in ACCUMULATE_MODES:
        raise ValueError(f"Invalid accumulate: {accumulate!r} (one of {ACCUMULATE_MODES})")
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
    add_s = 0.0
    if accumulate == "host" and r < 1.0:
        job_s, copy_s, d2h_s, add_s = _host_sums(profile, workload, u, t + device_step_s, cpu_s, h2d_s)
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
        host_s=cpu_s + d2h_s + h2d_s + add_s,
        job_s=job_s,
        wait_s=wait_s,
        copy_s=copy_s,
        stall_s=wait_s + copy_s,
        device_step_s=device_step_s,
        device_bytes=p * device_bytes_per_param(r, accumulate),
        accumulate=accumulate,
        add_s=add_s,
    )


def device_bytes_per_param(topk_ratio: float, accumulate: str = "device") -> float:
    """The optimizer's device state per offloaded element beyond the weight and its gradient: the compact fp32
    master and moments of the selected columns, plus the fp32 window sum with ``accumulate="device"``."""
    if accumulate not in ACCUMULATE_MODES:
        raise ValueError(f"Invalid accumulate: {accumulate!r} (one of {ACCUMULATE_MODES})")
    return (ACC_BYTES if accumulate == "device" else 0) + STATE_BYTES * topk_ratio


def _slot_bytes(param_bytes: int, grad_dtype: str) -> int:
    """accumulate="host"'s landing slot per element: bf16 with grad_dtype="bfloat16", else the gradient's own dtype
    (a bf16 gradient widens to fp32 exactly, so it lands as it is; state.allocate)."""
    return GRAD_BYTES["bfloat16"] if grad_dtype == "bfloat16" else param_bytes


def host_bytes_per_param(param_bytes: int, grad_dtype: str, accumulate: str = "device") -> float:
    """Pinned host bytes per offloaded element (state.allocate's slab): fp32 master and moments, a snapshot in the
    model dtype unless fp32, and with "device" one landing buffer in ``grad_dtype``, with "host" two fp32 window sums
    and two landing slots (:func:`_slot_bytes`). An fp32 CPU parameter with overlap=False is its own master (4 less)."""
    if accumulate not in ACCUMULATE_MODES:
        raise ValueError(f"Invalid accumulate: {accumulate!r} (one of {ACCUMULATE_MODES})")
    snapshot = 0 if param_bytes == 4 else param_bytes
    if accumulate == "device":
        return STATE_BYTES + GRAD_BYTES[grad_dtype] + snapshot
    return STATE_BYTES + 2 * ACC_BYTES + 2 * _slot_bytes(param_bytes, grad_dtype) + snapshot


def host_add_bytes_per_s(profile: Profile) -> float:
    """Memory traffic per second of accumulate="host"'s add: the profile has no figure of the add kernel, so twice
    its host memcpy's peak (a copy of n bytes reads n and writes n; the add streams the same way)."""
    return 2.0 * profile.memcpy.peak


def _host_sums(profile: Profile, workload: Workload, u: int, period_s: float, cpu_s: float,
               h2d_s: float) -> tuple[float, float, float, float]:
    """accumulate="host"'s window: ``(job_s, copy_s, d2h_s, add_s)`` (formulas: module docstring). ``period_s``:
    one step, model and device-side optimizer."""
    gbytes = _slot_bytes(workload.param_bytes, workload.grad_dtype)
    d2h_curve, _ = _copy_curves(profile, workload)
    land_s = _copy_seconds(d2h_curve, workload.shapes, gbytes)  # one step's gradients, whole tensors
    add_step_s = workload.numel * (2 * ACC_BYTES + gbytes) / host_add_bytes_per_s(profile)
    if workload.device == "cuda":
        # The copy stream and the adder each have two landing slots: the slower stage sets the pace.
        job_s = land_s + add_step_s + cpu_s
        copy_s = h2d_s + u * max(0.0, max(land_s, add_step_s) - period_s)
    else:
        # CPU tensors: the training thread copies each step's gradient itself.
        job_s = add_step_s + cpu_s
        copy_s = h2d_s + u * (land_s + max(0.0, add_step_s - period_s))
    return job_s, copy_s, u * land_s, u * add_step_s


# ---------------------------------------------------------------------------------------------- choice


def choose_threads(profile: Profile, grad_dtype: str) -> int:
    """Measured thread count with the best host AdamW rate among those leaving one core to the training process.

    The plain maximum (not "fewest within x% of the best"): a faster CPU must never make the plan worse.
    """
    table = profile.cpu_adamw.rates.get(grad_dtype)
    if not table:
        profile.cpu_adamw.rate(grad_dtype, 1)  # raises the ProfileError that names what was measured
    allowed = [t for t in table if t <= max(1, profile.cpu_cores - 1)] or [min(table)]
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
    :func:`plan_accumulate` chooses it), for the memory budget and the predictions.
    """
    targets = targets or Targets()
    table = quality if quality is not None else default_quality_table()
    threads = cpu_threads if cpu_threads is not None else choose_threads(profile, workload.grad_dtype)
    notes: list[str] = []

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
        intervals = [u for u in range(1, targets.max_update_interval + 1)
                     if select_interval is None or select_interval % u == 0] or [1]

    points = [
        _Point(pred, table.predict(r, u) if r > 0 else None)
        for r in ratios for u in intervals
        for pred in [predict(profile, workload, topk_ratio=r, update_interval=u, cpu_threads=threads,
                             select_interval=select_interval, overlap=overlap, select_windows=targets.select_windows,
                             accumulate=accumulate)]
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
    scale, scale_line = _host_scale(table, pred.topk_ratio, u, overlap, host_lr_scale)
    if scale_line:
        lines.append(scale_line)
    lines.append(f"loss ratios: {table.source or 'quality table'}, one task on a small model: a prior, "
                 "not a guarantee (pass your own table)")
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
    )


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
                                       available_bytes=budget, grad_bytes=_slot_bytes(workload.param_bytes,
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
                        overlap=kwargs.get("overlap", True), select_windows=targets.select_windows, accumulate=m)
             for m in ACCUMULATE_MODES}
    host = modes["host"]
    u = pr.update_interval
    lines = [
        f'accumulate="{choice}": {why}',
        f'predicted step at this setting: "device" {format_seconds(modes["device"].step_s)} '
        f'({format_bytes(modes["device"].device_bytes)} of device state), "host" {format_seconds(host.step_s)} '
        f"({format_bytes(host.device_bytes)}; per step {format_seconds(host.d2h_s / u)} of gradient copies "
        f"and {format_seconds(host.add_s / u)} of host adds at {host_add_bytes_per_s(profile) / 1e9:.0f} GB/s, "
        "taken as twice the measured memcpy)",
    ]
    return dataclasses.replace(chosen, accumulate_reason=why, reason=chosen.reason + "\n" + "\n".join(lines))
