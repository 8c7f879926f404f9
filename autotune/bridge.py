"""The optimizer's way into the autotuner: :func:`plan_for_optimizer`, what ``ZenFlowAdamW``'s ``"auto"`` calls.

It finds this machine's profile (``$ZENFLOW_TRITON_PROFILE``, else the per-user cache, else a quick probe once
per process and device type) and the quality table (``$ZENFLOW_TRITON_QUALITY_TABLE``, else the shipped one), sets the
device-memory budget from the memory free now, and asks the cost model (:mod:`.model`) for a plan, passing the
optimizer's defaults from :mod:`zenflow_triton.config`. The autotuner never imports the
optimizer: the optimizer calls this function with plain values.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zenflow_triton.config import DEFAULT_SELECT_WINDOWS

from .cache import ProfileError, default_profile_path, find_profile
from .chooser import plan
from .machine import current_machine_key
from .model import DEFAULT_MAX_LOSS_RATIO, GRAD_BYTES, Plan, Targets, Workload
from .profile import Profile
from .quality import QualityTable, default_quality_table, load_quality_table

if TYPE_CHECKING:  # torch is imported where it is used: the CLI's --help starts without it
    import torch

__all__ = ["MEMORY_BUDGET_FRACTION", "QUALITY_ENV_VAR", "plan_for_optimizer", "quality_table_for"]

# Names a quality table measured on the user's own task (format: .quality), for "auto" as for the CLI.
QUALITY_ENV_VAR = "ZENFLOW_TRITON_QUALITY_TABLE"

logger = logging.getLogger("zenflow_triton")

# Share of the device's free memory the optimizer's device state may take: the rest absorbs allocator
# fragmentation and the transient buffers of the device step (bf16 casts for the D2H, staging for the H2D).
MEMORY_BUDGET_FRACTION = 0.9

# Profiles measured by this process when none was on disk, by machine key and device type (a probe for CUDA
# parameters skips the device step on CPU tensors, which only a plan for CPU tensors reads): several optimizers in
# one process probe once. Nothing is written to the user's cache implicitly; the CLI does that.
_probed: dict[tuple[str, str], Profile] = {}
_probe_lock = threading.Lock()


def _profile_for(device: torch.device, grad_dtype: str) -> tuple[Profile, str]:
    """This machine's saved profile, else one quick probe per process and device type, of ``device`` (the
    parameters': a rank whose GPU is not the current device must not measure, or make a context on, GPU 0). A saved
    profile that cannot serve this plan (invalid, no GPU figures for CUDA tensors, no CPU-tensor device step for CPU
    tensors, no rate for the config's gradient dtype) is treated as no profile: the same quick probe, announced in
    one warning that says why the file was refused, and each later refusal of a file warns again."""
    device_type = device.type
    key = current_machine_key()
    path = default_profile_path(key)
    why = f"no machine profile at {path}"
    try:
        found = find_profile(key)
    except ProfileError as exc:
        why = f"ignoring unusable profile: {exc}"
        found = None
    if found is not None:
        profile, path = found
        if device_type == "cuda" and profile.gpu is None:
            why = f"ignoring unusable profile {path}: no GPU figures ({profile.gpu_unavailable})"
        elif device_type != "cuda" and profile.cpu_device is None:
            why = f"ignoring unusable profile {path}: no device-step rates for CPU tensors (measured for CUDA only)"
        elif grad_dtype not in profile.cpu_adamw.rates:
            why = (f"ignoring unusable profile {path}: no host AdamW rate for {grad_dtype} gradients "
                   f"(measured: {', '.join(sorted(profile.cpu_adamw.rates))})")
        else:
            if profile.machine_key != key:
                logger.warning("zenflow_triton autotune: profile %s was measured on %s, this machine is %s",
                               path, profile.machine_key, key)
            return profile, str(path)
    with _probe_lock:
        cuda = device_type == "cuda"
        profile = _probed.get((key, "cuda" if cuda else "cpu"))
        reuse = profile is not None and not (cuda and profile.gpu is None)
        if reuse and why.startswith("ignoring"):
            # A file refused again (the one named by $ZENFLOW_TRITON_PROFILE, perhaps set after the first probe):
            # said each time, not only with a new probe, or the user's profile would be ignored silently.
            logger.warning("zenflow_triton autotune: %s; using this process's quick probe instead", why)
        if not reuse:
            from .probes import ProbeSettings, probe_machine

            logger.warning(
                "zenflow_triton autotune: %s; running a quick probe instead (a few seconds, not saved). "
                "Run `python -m zenflow_triton.autotune` once for a full, saved profile.", why
            )
            settings = dataclasses.replace(ProbeSettings.quick_settings(), cpu_device_ops=not cuda)
            profile = probe_machine(settings, device=device if cuda else None)
            _probed[(key, "cuda" if cuda else "cpu")] = profile
    return profile, "quick probe (this process)"


def quality_table_for(path: str | Path | None = None) -> QualityTable:
    """The quality table at ``path``, else the one ``$ZENFLOW_TRITON_QUALITY_TABLE`` names, else the shipped one.

    Raises :class:`~zenflow_triton.autotune.quality.QualityTableError` for a table that cannot be read.
    """
    path = path or os.environ.get(QUALITY_ENV_VAR) or None
    return default_quality_table() if path is None else load_quality_table(path)


def _dtype_bytes(param_dtype: Any) -> int:
    size = getattr(param_dtype, "itemsize", None)
    if size not in (2, 4):
        raise ValueError(f"Invalid param_dtype: {param_dtype!r} (float32, bfloat16 or float16)")
    return int(size)


def plan_for_optimizer(
    *,
    offloaded_shapes: Sequence[tuple[int, int]],
    param_dtype: Any,
    grad_dtype: str,
    step_time_s: float,
    device: Any,
    topk_ratio: float | None,
    update_interval: int | None,
    select_interval: int | None = None,
    overlap: bool = True,
    cpu_threads: int | None = None,
    profile: Profile | None = None,
    targets: Targets | None = None,
    max_loss_ratio: float = DEFAULT_MAX_LOSS_RATIO,
    quality: QualityTable | str | Path | None = None,
    accumulate: str = "device",
    host_lr_scale: float | None = None,
    overlap_steps: int | None = None,
    quality_regime: str = "worst",
    host_snapshot: bool = True,
) -> Plan:
    """Choose what the user left to ``"auto"`` (None here), from this machine's profile and the measured step time.

    ``offloaded_shapes``: ``[R, C]`` of every offloaded parameter; ``param_dtype``: their torch dtype;
    ``step_time_s``: seconds per training step spent outside ``step()`` (forward, backward, the rest of the
    loop), e.g. the median over the warm-up; ``device``: the parameters' torch device. ``topk_ratio`` /
    ``update_interval``: the user's fixed values, or None to choose. ``select_interval`` (None: the config's
    ``DEFAULT_SELECT_WINDOWS`` windows), ``overlap`` and ``cpu_threads`` (None: choose) refine the prediction
    when the user set them. ``targets``: the chooser's goals and bounds (None: :class:`Targets` with the config's
    ``DEFAULT_SELECT_WINDOWS``); ``max_loss_ratio``, the quality budget (predicted held-out loss over AdamW's at
    equal steps), replaces ``targets.max_loss_ratio``. ``quality``: a quality table or its path (None:
    ``$ZENFLOW_TRITON_QUALITY_TABLE``, else the shipped table). ``host_lr_scale``: the user's, or None to choose
    (from the quality table's measured entries, DESIGN §8). ``accumulate``: where the optimizer placed the window
    sums ("device" or "host"), which it decides before it plans: the prediction and the memory budget follow.
    ``overlap_steps``: the user's (None: U), the steps each host job has to hide in. ``quality_regime``: which of the
    table's regimes predicts the loss (:meth:`~.quality.QualityTable.for_regime`: "worst" of fine-tune and scratch).
    ``host_snapshot``: the config's (False: the merge's copies carry the fp32 master).

    The profile is ``profile`` if given, else the file named by ``$ZENFLOW_TRITON_PROFILE``, else this
    machine's file in the user cache, else a quick probe (a few seconds, logged with a hint to run
    ``python -m zenflow_triton.autotune``). The device-memory budget on CUDA is ``MEMORY_BUDGET_FRACTION`` of
    the memory free now plus the fp32 accumulators, which the optimizer holds already when it plans (none with
    accumulate="host"); CPU tensors have no budget.
    """
    import torch

    device = torch.device(device)
    if grad_dtype not in GRAD_BYTES:
        raise ValueError(f"Invalid grad_dtype: {grad_dtype!r} (one of {sorted(GRAD_BYTES)})")
    if not offloaded_shapes:
        raise ValueError("plan_for_optimizer needs at least one offloaded shape")
    if not (step_time_s > 0):
        # A step time of zero (no samples) would make every window look unhideable; a tiny positive one
        # gives the same answer (the host work is exposed) without dividing by zero.
        logger.warning("zenflow_triton autotune: measured step time %r s; planning with 1 ms", step_time_s)
        step_time_s = 1e-3
    shapes = tuple((int(r), int(c)) for r, c in offloaded_shapes)
    if profile is not None:
        source = "given profile"
    else:
        profile, source = _profile_for(device, grad_dtype)
    budget: float | None = None
    kind = "cuda" if device.type == "cuda" else "cpu"
    if kind == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        acc_held = sum(r * c for r, c in shapes) * 4 if accumulate == "device" else 0
        budget = MEMORY_BUDGET_FRACTION * free + acc_held
    workload = Workload(shapes=shapes, step_time_s=float(step_time_s), param_bytes=_dtype_bytes(param_dtype),
                        grad_dtype=grad_dtype, device=kind, memory_budget_bytes=budget, host_snapshot=host_snapshot)
    if targets is None:
        targets = Targets(select_windows=DEFAULT_SELECT_WINDOWS)
    targets = dataclasses.replace(targets, max_loss_ratio=max_loss_ratio)
    table = (quality if isinstance(quality, QualityTable) else quality_table_for(quality)).for_regime(quality_regime)
    result = plan(profile, workload, topk_ratio=topk_ratio, update_interval=update_interval,
                  cpu_threads=cpu_threads, select_interval=select_interval, overlap=overlap, targets=targets,
                  quality=table, profile_source=source, host_lr_scale=host_lr_scale, accumulate=accumulate,
                  overlap_steps=overlap_steps,
                  relax_hint="fix topk_ratio and update_interval yourself to trade quality for speed "
                             "(`python -m zenflow_triton.autotune --max-loss-ratio` shows the trade)")
    logger.debug("zenflow_triton autotune plan (%s):\n%s", source, result.reason)
    return result
