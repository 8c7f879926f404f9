"""The knobs an optimizer runs with, and ``"auto"`` (DESIGN §2, §8): the step time sampled over the warm-up, then
one plan from the machine profile that resolves every ``"auto"`` field.

:class:`Knobs` holds one :class:`ZenFlowConfig`, ``resolved``: the user's config with the library's defaults
filled in (``select_interval``, ``cpu_threads``) and, once planned, the autotuner's choices in place of ``"auto"``.

The choice is announced in one line on the ``zenflow_triton.auto`` logger (see :func:`announce`), and ``stats()``
keeps the plan's fields and its reason (:meth:`Knobs.report`).
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .agree import on_rank_zero
from .config import ZenFlowConfig
from .worker import host_thread_limit, host_thread_share

__all__ = ["AUTO_WARMUP_STEPS", "Knobs", "announce", "default_cpu_threads", "place_sums"]

logger = logging.getLogger("zenflow_triton")
# The logger of the one line "auto" writes about its choice: a child of the library's, so an application can route
# or silence it alone (logging.getLogger("zenflow_triton.auto").setLevel(logging.WARNING)).
choice_logger = logging.getLogger("zenflow_triton.auto")

# "auto" knobs measure the step time over the warm-up (synchronous, so every sample is a whole step);
# five steps give four intervals, enough for a median that ignores the first, slower, step.
AUTO_WARMUP_STEPS = 5

# state_dtype is saved for the record (a checkpoint's moments are fp32 whatever it is) and stays this optimizer's.
_CHECKPOINT_KEYS = ("topk_ratio", "update_interval", "select_interval", "cpu_threads", "host_lr_scale",
                    "overlap_steps", "state_dtype")


def announce(message: str, log: logging.Logger = choice_logger) -> None:
    """Log ``message`` at INFO on ``log``; when the application has configured no logging at all, write it to
    stderr anyway.

    A library must not configure logging (no handlers or levels set behind the application's back), yet an
    automatic choice that changes training should not pass unseen, and an INFO record with no handler anywhere is
    dropped (``logging.lastResort`` prints WARNING and above only; a warning would be wrong for a normal event).
    So: with any handler on the way to the root, the record goes through logging as usual and the application's
    levels and format decide; with none, this one record goes to stderr through a handler made for it, as
    ``lastResort`` would do for a warning. Nothing global changes, so configuring logging later takes effect. A
    level above INFO set on the library's loggers (``zenflow_triton`` or ``zenflow_triton.auto``) or
    ``logging.disable`` silences it in both cases.
    """
    if log.hasHandlers():
        log.info(message)
        return
    if log.disabled or log.manager.disable >= logging.INFO:
        return
    node: logging.Logger | None = log
    while node is not None and not isinstance(node, logging.RootLogger):
        if node.level:  # the nearest level set on the library's own loggers; the root's default does not count
            if node.level > logging.INFO:
                return
            break
        node = node.parent
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, message, None, None)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    handler.handle(record)


def default_cpu_threads(device: torch.device | None) -> int:
    """``cpu_threads`` when the user sets none: this process's share of the cores but one, left to the training
    thread; on CUDA but two, since autograd's device thread launches the backward's kernels next to it and a host
    AdamW thread on its core would delay every launch (the GPU then idles for the host)."""
    reserved = 2 if device is not None and device.type == "cuda" else 1
    return max(1, host_thread_share() - reserved)


def place_sums(params: Sequence[torch.Tensor], config: ZenFlowConfig, saved: str | None = None) -> tuple[str, str]:
    """Where the window sums live ("device" or "host") and why: ``config.accumulate``, or for "auto" "host" with
    ``grads_in_backward``, else the placement a checkpoint being loaded was trained with (``saved``, on CUDA), else
    the rule of :func:`zenflow_triton.autotune.placement.place_accumulation` on this device's and this host's
    figures (the mode that fits both memories; the reason says which decided). Called once,
    at the first step (the model is built and has run a forward and a backward), or at a load before it, before any
    device buffer of the optimizer exists. ``params``: the offloaded parameters stepping first."""
    choice = config.accumulate
    if choice != "auto":
        return choice, f"accumulate={choice!r} was given"
    if config.grads_in_backward:
        # A gradient captured in backward is held on the host until step() (config.py): only "host" can hold it.
        return "host", "grads_in_backward"
    if saved in ("device", "host") and params[0].device.type == "cuda":
        # A load before the first step sees no activations in the peak (no forward has run): the rule would think
        # the device roomier than the run that saved the checkpoint found it at its first step, with them.
        return saved, "the checkpoint's (decided at its run's first step; a load before this run's cannot see the peak)"
    # Decided on rank 0 and broadcast under torch.distributed: one placement for every rank (agree.py).
    return on_rank_zero(lambda: _placement_rule(params, config))


def _placement_rule(params: Sequence[torch.Tensor], config: ZenFlowConfig) -> tuple[str, str]:
    from .autotune.placement import place_accumulation
    from .sharding import local

    device = params[0].device
    numel = sum(local(p).numel() for p in params)
    r = config.topk_ratio
    # With topk_ratio="auto" the compact state's size is not known yet; the default ratio stands in for it.
    ratio = float(r) if r != "auto" else ZenFlowConfig.topk_ratio
    available = None
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # torch's cache holds memory a step can reuse: what is free at the step's peak so far is the driver's free
        # memory plus the cache, less the peak allocation (weights, gradients and the activations at their peak).
        available = max(0.0, float(free + torch.cuda.memory_reserved(device) - torch.cuda.max_memory_allocated(device)))
    grad_bytes = 2 if config.grad_dtype == "bfloat16" or params[0].dtype != torch.float32 else 4
    # Host memory too: the slab each mode would map, against what the machine can give now (host_budget).
    from .host_budget import host_need, host_room

    host = host_room()
    placement = place_accumulation(device=device.type, offloaded_numel=numel, topk_ratio=ratio,
                                   available_bytes=available, grad_bytes=grad_bytes,
                                   host_bytes={m: host_need(params, config, m).total for m in ("device", "host")},
                                   host_available=host.bytes, host_what=f"available on the host ({host.bound})")
    return placement.accumulate, placement.reason


class Knobs:
    """``topk_ratio``, ``update_interval``, ``select_interval``, ``cpu_threads`` and ``host_lr_scale`` as the optimizer
    uses them.

    ``config`` is the user's; ``warmup`` the warm-up steps (at least :data:`AUTO_WARMUP_STEPS` with ``"auto"``);
    ``plan`` the autotuner's :class:`~zenflow_triton.autotune.Plan` once made (None for fixed knobs).
    """

    def __init__(self, config: ZenFlowConfig, *, device: torch.device | None = None) -> None:
        limit = host_thread_limit()
        if config.cpu_threads is not None and config.cpu_threads > limit:
            raise ValueError(f"Invalid cpu_threads: {config.cpu_threads} (this process can run at most {limit} numba "
                             "threads: its CPU affinity, capped by NUMBA_NUM_THREADS)")
        self.config = config
        # overlap_steps="auto" (the default) needs no plan on CPU tensors or without overlap (config.py).
        fixed = config.without_planning(None if device is None else device.type)
        self._planned = (fixed or config).is_auto
        self.warmup = max(config.warmup_steps, AUTO_WARMUP_STEPS) if self._planned else config.warmup_steps
        r = config.topk_ratio
        self.resolved = (fixed or config).replace(
            topk_ratio=r if r == "auto" else float(r),
            select_interval=config.resolved_select_interval() if config.update_interval != "auto" else None,
            cpu_threads=config.cpu_threads or default_cpu_threads(device),
        )
        self.plan: Any = None
        self.step_time_samples: list[float] = []
        self._last_step_end: float | None = None
        self._sampled_on: torch.device | None = None  # the device of the last step sampled

    def value(self, name: str) -> Any:
        """A knob as ``stats()`` and checkpoints report it: None while it waits for "auto"."""
        if name == "select_interval" and self.resolved.update_interval == "auto":
            return None
        v = getattr(self.resolved, name)
        return None if v == "auto" else v

    @property
    def ready(self) -> bool:
        return (self.resolved.topk_ratio != "auto" and self.resolved.update_interval != "auto"
                and self.resolved.host_lr_scale != "auto" and self.resolved.overlap_steps != "auto")

    # ------------------------------------------------------------------ step time

    def sample_step_time(self, entered: float, device: torch.device | None) -> None:
        """Record the time between the end of the last ``step()`` and ``entered`` (the forward and backward),
        while "auto" still waits for its plan. ``device``: the offloaded parameters' (None: none stepped)."""
        if self.plan is not None or not self._planned or device is None:
            return
        self._sampled_on = device
        if self._last_step_end is None:
            return
        if device.type == "cuda":
            # The last step ended with the device idle (step_ended), so after this sync the interval since then is
            # exactly the forward and backward time on the device.
            torch.cuda.synchronize(device)
            entered = time.perf_counter()
        self.step_time_samples.append(entered - self._last_step_end)

    def step_ended(self, now: float) -> None:
        device = self._sampled_on
        if self.plan is None and device is not None and device.type == "cuda":
            # A warm-up step's host update is waited for, but its merge (the host-to-device copy of every offloaded
            # parameter's snapshot, and the kernel) is only queued: the next sample must not count it as forward
            # and backward time (for 7B in bf16, ~0.3 s of PCIe per step, which the plan counts once per window).
            torch.cuda.synchronize(device)
            now = time.perf_counter()
        self._last_step_end = now

    def measured_step_time(self) -> float:
        samples = self.step_time_samples
        return statistics.median(samples) if samples else 0.0

    # ------------------------------------------------------------------ resolution

    def resolve(self, *, offloaded_shapes: Sequence[tuple[int, int]], param_dtype: torch.dtype,
                device: torch.device, accumulate: str = "device") -> None:
        """Plan every knob still "auto" from the machine profile and the measured step time (no-op when none is);
        ``accumulate``: where the window sums live (:func:`place_sums`, decided before), which the plan predicts."""
        if self.ready:
            return
        from .autotune import plan_for_optimizer

        cfg = self.config
        # Planned on rank 0 and broadcast under torch.distributed: every rank runs one schedule (agree.py).
        plan = on_rank_zero(lambda: plan_for_optimizer(
            offloaded_shapes=offloaded_shapes, param_dtype=param_dtype, grad_dtype=cfg.grad_dtype,
            step_time_s=self.measured_step_time(), device=device, topk_ratio=self.value("topk_ratio"),
            update_interval=self.value("update_interval"), select_interval=cfg.select_interval,
            overlap=cfg.overlap, cpu_threads=cfg.cpu_threads, host_lr_scale=self.value("host_lr_scale"),
            accumulate=accumulate, overlap_steps=cfg.overlap_steps, quality_regime=cfg.quality_regime,
            host_snapshot=cfg.host_snapshot,
        ))
        self.plan = plan
        u = int(plan.update_interval)
        s = cfg.select_interval
        if s is None:
            select = cfg.replace(update_interval=u).resolved_select_interval()
        else:
            select = math.ceil(s / u) * u
            if select != s:
                logger.warning("select_interval=%d rounded up to %d, a multiple of the chosen update_interval=%d",
                               s, select, u)
        threads = self.resolved.cpu_threads
        if cfg.cpu_threads is None:
            threads = max(1, min(int(plan.cpu_threads), host_thread_share()))
        self.resolved = self.resolved.replace(topk_ratio=float(plan.topk_ratio), update_interval=u,
                                              select_interval=select, cpu_threads=threads,
                                              host_lr_scale=float(plan.host_lr_scale),
                                              overlap_steps=plan.overlap_steps)
        loss = "unknown" if plan.predicted_loss_ratio is None else f"{plan.predicted_loss_ratio:.3f}x AdamW"
        scale = "" if plan.host_lr_scale == 1.0 else f" host_lr_scale={plan.host_lr_scale:g}"
        k = self.resolved.overlap_steps
        scale += "" if cfg.overlap_steps != "auto" or k is None else f" overlap_steps={k}"
        announce(f"chose topk_ratio={self.resolved.topk_ratio:g} update_interval={u}{scale} cpu_threads={threads}: "
                 f"predicted loss {loss} (budget {plan.max_loss_ratio:g}), "
                 f"{plan.prediction.stall_fraction:.1%} stall"
                 + ("" if plan.hides_host_work else " (host work not hidden)")
                 + "; why: stats()['auto_reason']")

    def report(self, stats: Any) -> dict[str, Any]:
        """The "auto" entries of ``ZenFlowAdamW.stats()`` (none until a plan is made); ``stats`` is the optimizer's
        :class:`~zenflow_triton.pipeline.Stats`."""
        plan = self.plan
        if plan is None:
            return {}
        windows = stats.windows - stats.windows_at_plan
        # The plan's fields under the names the CLI's --json uses (the knobs themselves are already in stats(), as
        # in use); measured_stall_per_window_s (time step() waited on the host since the plan) compares with
        # predicted_wait_per_window_s, the copies counting in device_opt_s.
        out = {k: v for k, v in plan.summary().items() if k not in _CHECKPOINT_KEYS and k != "reason"}
        out.update(
            measured_stall_per_window_s=(stats.stall_s - stats.stall_at_plan) / windows if windows else 0.0,
            measured_step_time_s=self.measured_step_time(),
            auto_reason=plan.reason,
        )
        return out

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {name: self.value(name) for name in _CHECKPOINT_KEYS}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Take the checkpoint's ``topk_ratio``, ``update_interval``, ``select_interval`` (None: still "auto") and
        ``host_lr_scale`` (1.0 when it has none) and ``overlap_steps`` (None, the default, when it has none; still
        "auto" when this optimizer's is and the checkpoint was saved before the plan; None without overlap).
        ``cpu_threads`` stays this machine's: the thread count never changes results, and a checkpoint's may
        exceed what this process can run."""
        r = saved.get("topk_ratio", self.value("topk_ratio"))
        u = saved.get("update_interval", self.value("update_interval"))
        s = saved.get("select_interval", self.value("select_interval"))
        # A checkpoint from before host_lr_scale existed was trained with Adam's host step: 1.0.
        h = saved.get("host_lr_scale", 1.0)
        h = "auto" if h is None else h
        k = saved.get("overlap_steps")
        if k is None and self.config.overlap_steps == "auto" and saved.get("step", 0) <= self.warmup:
            k = self.resolved.overlap_steps  # saved before the plan: it is still to be made (or needs none)
        self.resolved = self.resolved.replace(
            topk_ratio="auto" if r is None else r, update_interval="auto" if u is None else u,
            select_interval=s if u is not None else self.config.select_interval, host_lr_scale=h,
            overlap_steps=k if self.config.overlap else None,
        )
