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
  ``max(0, job_s - U * (T + dev_s))`` (``overlap_steps`` K < U: ``K * (T + dev_s)``, the steps before its result is
  merged); the flush at each selection step (every ``S`` steps) waits for a job
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
  one sum per window: ``d2h_s`` is ``U`` per-step copies of the whole gradients into the landing ring (bf16 with
  ``grad_dtype="bfloat16"``, else the gradient's own dtype), ``add_s`` the ``U`` host adds into the fp32 window sum
  (read the sum and the landed gradient, write the sum: ``8 + slot_bytes`` bytes per element, one add per parameter)
  timed on the profile's measured add curve (:attr:`Profile.host_add`: bytes streamed against size, at the landing
  dtype and the measured thread count at or below ``cpu_threads``; :func:`host_add_seconds`). A profile from before
  schema 3 has no add probe: the add is then ASSUMED to stream at :func:`host_add_bytes_per_s`, twice the host
  ``memcpy`` peak (a copy reads and writes each byte it counts), and the plan says so (:func:`host_assumptions`).
  The device-side pass of "host" is the fused step without a window sum (``acc=None``: ``P / pass_no_acc_rate``,
  measured on CPU tensors, derived from the device bandwidth on CUDA; an old CPU profile without it prices the
  with-acc pass, and says so). The window end ships nothing, so the job is the last
  step's copy and add, then the AdamW; each step's copy (on CUDA a stream of its own, overlapping the next step)
  and add (a second host thread) are double-buffered, so the slower of the two is exposed by what it exceeds one
  step (``T + dev_s``) by; on CPU tensors the training thread makes the copies, all exposed. The adds share the
  host's cores and memory bandwidth with the window's AdamW job, which the model ignores;
- device optimizer time per step: ``P / pass_rate + r * P / adam_rate`` (the fused pass over every gradient,
  plus Adam on the selected columns; "host" runs the pass without ``acc``, above);
- the time per training step: ``step_s = T + dev_s + stall_s / U`` (what the chooser minimises).

:func:`plan` weighs speed against quality: the predicted time per training step
(``step_s = T + dev_s + stall_s / U``) against the predicted loss ratio vs AdamW from a measured quality table
(:mod:`.quality`). Among the ``(r, U)`` within the loss budget (``Targets.max_loss_ratio``), the device-memory
budget and the user's bounds, it takes the fastest, ties within ``Targets.speed_tolerance`` going to the lower
loss; then the host thread count with the best measured rate that leaves one core to the training process (two on
CUDA, for autograd's device thread).

The module is pure: it imports only :mod:`.profile`, :mod:`.quality`, :mod:`.results` and :mod:`.placement`, never
the optimizer's package. What it needs from the optimizer's configuration (the number of windows between
reselections) comes in as an argument (``Targets.select_windows``, ``select_windows=``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

from .placement import host_views, ring_bytes
from .profile import BandwidthCurve, DeviceOpRates, GpuInfo, Profile
from .results import Plan, Prediction, format_count, format_seconds

__all__ = [
    "ACC_BYTES",
    "ACCUMULATE_MODES",
    "DEFAULT_PLACEMENT_RATIO",
    "device_bytes_per_param",
    "host_add_bytes_per_s",
    "host_add_seconds",
    "host_assumptions",
    "host_bytes_per_param",
    "slot_bytes",
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
# The same pass without acc (accumulate="host"): it reads the gradient only (the column scores it writes are [C]).
_PASS_NO_ACC_BYTES_FIXED = 0
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
    host_snapshot: bool = True
    """ZenFlowConfig.host_snapshot: False sends the fp32 master back instead (4 bytes per element), the merge
    rounding it."""
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
        if profile.cpu_device is None:
            raise ValueError("the profile has no device-step rates for CPU tensors (its probe measured for CUDA "
                             "parameters only); run `python -m zenflow_triton.autotune` on this machine")
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
        pass_no_acc_rate=gpu.mem_bandwidth / (param_bytes + _PASS_NO_ACC_BYTES_FIXED),
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
    overlap_steps: int | None = None,
) -> Prediction:
    """Predicted per-window costs of running ``workload`` with these settings (formulas: module docstring);
    ``accumulate``: where the window sum lives, "device" or "host"; ``overlap_steps``: with overlap, the steps a job
    has before its result is merged (None: ``update_interval``)."""
    if accumulate not in ACCUMULATE_MODES:
        raise ValueError(f"Invalid accumulate: {accumulate!r} (one of {ACCUMULATE_MODES})")
    if not 0.0 <= topk_ratio <= 1.0:
        raise ValueError(f"Invalid topk_ratio: {topk_ratio!r}")
    if update_interval < 1:
        raise ValueError(f"Invalid update_interval: {update_interval!r}")
    if cpu_threads < 1:
        raise ValueError(f"Invalid cpu_threads: {cpu_threads!r}")
    if overlap_steps is not None and not 1 <= overlap_steps <= update_interval:
        raise ValueError(f"Invalid overlap_steps: {overlap_steps!r} (1 to update_interval={update_interval})")
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
        # Without a host snapshot the fp32 master travels and the merge reads it: 4 + pbytes bytes where the
        # merge rate was for 2 * pbytes.
        back = pbytes if workload.host_snapshot else 4
        h2d_s = p / rates.merge_rate * (back + pbytes) / (2 * pbytes)
        if workload.device == "cuda":
            h2d_s += _copy_seconds(h2d_curve, workload.shapes, back)

    # "host" keeps no device sum: its pass is the fused step with acc=None, where the profile has that figure.
    pass_rate = rates.pass_no_acc_rate if accumulate == "host" and rates.pass_no_acc_rate else rates.pass_rate
    device_step_s = p / pass_rate + r * p / rates.adam_rate
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
        job_s, copy_s, d2h_s, add_s = _host_sums(profile, workload, u, t + device_step_s, cpu_s, h2d_s, cpu_threads)
    if overlap:
        # A job overlaps the U steps (model compute plus the device-side optimizer) of the next window (the first
        # overlap_steps of them, when its result is merged then) ...
        hidden = (overlap_steps or u) * (t + device_step_s)
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


def slot_bytes(param_bytes: int, grad_dtype: str) -> int:
    """accumulate="host"'s landing slot per element: bf16 with grad_dtype="bfloat16", else the gradient's own dtype
    (a bf16 gradient widens to fp32 exactly, so it lands as it is; state.allocate)."""
    return GRAD_BYTES["bfloat16"] if grad_dtype == "bfloat16" else param_bytes


def host_bytes_per_param(param_bytes: int, grad_dtype: str, accumulate: str = "device", *, sums: int = 2,
                         grads_in_backward: bool = False, shapes: tuple[tuple[int, int], ...] = (),
                         state_dtype: str = "float32", snapshot: bool = True) -> float:
    """Pinned host bytes per offloaded element: state.allocate's slab (:func:`.placement.host_views` summed, the one
    formula of the host layout; ``sums`` window sums with "host", a capture slot with ``grads_in_backward``, the
    model-dtype snapshot unless ``snapshot`` is False) and,
    with "host" without ``grads_in_backward``, the landing ring's bytes spread over ``shapes`` (none given: the ring
    is left out, its share of a large model). The per-column step counts (4 bytes per column) are left out."""
    if accumulate not in ACCUMULATE_MODES:
        raise ValueError(f"Invalid accumulate: {accumulate!r} (one of {ACCUMULATE_MODES})")
    views = host_views(accumulate=accumulate, param_bytes=param_bytes, grad_dtype=grad_dtype, state_dtype=state_dtype,
                       sums=sums, capture=grads_in_backward, snapshot=snapshot)
    ring = 0.0
    if accumulate == "host" and shapes and not grads_in_backward:
        slot = slot_bytes(param_bytes, grad_dtype)
        sizes = [r * c * slot for r, c in shapes]
        ring = ring_bytes(sum(sizes), max(sizes)) / sum(r * c for r, c in shapes)
    return float(sum(sum(each) for each in views.values())) + ring


def host_add_bytes_per_s(profile: Profile) -> float:
    """The ASSUMED memory traffic per second of accumulate="host"'s add, for a profile without the add probe
    (before schema 3): twice its host memcpy's peak (a copy of n bytes reads n and writes n; the add streams the
    same way)."""
    return 2.0 * profile.memcpy.peak


def _landing(slot: int) -> str:
    # The add probe measures fp32 and bf16 landings; an fp16 slot streams the bf16 bytes.
    return "float32" if slot == 4 else "bfloat16"


def host_add_seconds(profile: Profile, shapes: tuple[tuple[int, int], ...], slot: int, threads: int) -> float:
    """One step's host adds of accumulate="host" (``sum += g``, one call per parameter of ``shapes``), ``slot``
    bytes per landed element, at ``threads`` threads: on the profile's measured add curve, else at the assumed
    :func:`host_add_bytes_per_s`."""
    per_elem = 2 * ACC_BYTES + slot
    if profile.host_add is None:
        return sum(r * c for r, c in shapes) * per_elem / host_add_bytes_per_s(profile)
    return _copy_seconds(profile.host_add.curve(_landing(slot), threads), shapes, per_elem)


def host_assumptions(profile: Profile, workload: Workload, threads: int) -> list[str]:
    """What the prediction of accumulate="host" takes from the profile, in words: the host add's rate (measured, or
    assumed where the profile has no add probe) and the device-side pass (without acc, or the with-acc figure
    where the profile did not measure it). For the plan's reason."""
    slot = slot_bytes(workload.param_bytes, workload.grad_dtype)
    if profile.host_add is None:
        lines = [f'accumulate="host": host adds ASSUMED at {host_add_bytes_per_s(profile) / 1e9:.1f} GB/s, twice the '
                 "measured memcpy peak (this profile has no host add probe; `python -m zenflow_triton.autotune` "
                 "measures one)"]
    else:
        dt, t = profile.host_add.measured_at(_landing(slot), threads)
        lines = [f'accumulate="host": host adds at the measured {profile.host_add.curves[dt][t].peak / 1e9:.1f} GB/s '
                 f"peak ({dt} landing, {t} thread{'s' if t > 1 else ''}, {profile.host_add.kernel} kernel)"]
    rates = _device_rates(profile, workload)
    if rates.pass_no_acc_rate is None:
        lines.append('accumulate="host": its device pass priced at the with-acc fused step (this profile did not '
                     "measure the pass without acc; `python -m zenflow_triton.autotune` does)")
    return lines


def _host_sums(profile: Profile, workload: Workload, u: int, period_s: float, cpu_s: float,
               h2d_s: float, threads: int) -> tuple[float, float, float, float]:
    """accumulate="host"'s window: ``(job_s, copy_s, d2h_s, add_s)`` (formulas: module docstring). ``period_s``:
    one step, model and device-side optimizer; ``threads``: the adder's (it runs with cpu_threads)."""
    gbytes = slot_bytes(workload.param_bytes, workload.grad_dtype)
    d2h_curve, _ = _copy_curves(profile, workload)
    land_s = _copy_seconds(d2h_curve, workload.shapes, gbytes)  # one step's gradients, whole tensors
    add_step_s = host_add_seconds(profile, workload.shapes, gbytes, threads)
    if workload.device == "cuda":
        # The copy stream and the adder work through the landing ring chunk by chunk: the slower stage sets the pace.
        job_s = land_s + add_step_s + cpu_s
        copy_s = h2d_s + u * max(0.0, max(land_s, add_step_s) - period_s)
    else:
        # CPU tensors: the training thread copies each step's gradient itself.
        job_s = add_step_s + cpu_s
        copy_s = h2d_s + u * (land_s + max(0.0, add_step_s - period_s))
    return job_s, copy_s, u * land_s, u * add_step_s


# ---------------------------------------------------------------------------------------------- choice
