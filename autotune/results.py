"""What the autotuner's model returns (:class:`Prediction` per setting, :class:`Plan` for the choice) and the units
every output prints them in. The model itself is :mod:`.model`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Plan", "Prediction", "format_bytes", "format_count", "format_seconds"]


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
    accumulate: str = "device"
    """Where the window sum lives: "device" (acc above) or "host" (no acc; every step's gradient to the host)."""
    add_s: float = 0.0
    """accumulate="host": the window's host adds of the landed gradients into the fp32 sum."""

    @property
    def stall_fraction(self) -> float:
        """Stall per step over the step time."""
        return self.stall_s / (self.update_interval * self.step_time_s)

    @property
    def step_s(self) -> float:
        """Predicted time per training step: the model's step, the device-side optimizer, the stall per step."""
        return self.step_time_s + self.device_step_s + self.stall_s / self.update_interval

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["stall_fraction"] = self.stall_fraction
        d["step_s"] = self.step_s
        return d


@dataclass(frozen=True)
class Plan:
    """The chosen settings, their predicted cost and quality, and why they were chosen.

    Per window of ``update_interval`` steps: ``predicted_stall_s`` is all the time the window loses to host-side
    work, ``predicted_wait_s`` (``step()`` waiting on the host job, selection flushes included: what ``stats()``
    measures as ``measured_stall_per_window_s``) plus ``predicted_copy_s`` (copies and the merge that nothing
    hides; ``stats()`` counts them in ``device_opt_s``). :meth:`summary` is what every output shows.
    """

    topk_ratio: float
    update_interval: int
    cpu_threads: int
    grad_dtype: str
    predicted_loss_ratio: float | None
    """Held-out loss over AdamW's at equal steps, from the quality table; None outside its measured range."""
    max_loss_ratio: float
    loss_budget_met: bool
    hides_host_work: bool
    """Predicted stall at most ``Targets.stall_fraction`` of the step time."""
    predicted_step_s: float
    """Predicted time per training step: the model's step time, the device-side optimizer and the stall."""
    predicted_stall_s: float
    predicted_wait_s: float
    predicted_copy_s: float
    predicted_host_s: float
    reason: str
    """A few short lines, separated by newlines."""
    prediction: Prediction
    profile_source: str = ""
    quality_source: str = ""
    predicted_loss_spread: tuple[float, float] | None = None
    """(min, max) of the loss ratio over the quality table's seeds, interpolated like the ratio."""
    accumulate: str = "device"
    """Where the window sum lives (ZenFlowConfig.accumulate) in this plan's prediction."""
    accumulate_reason: str = ""
    """Why (:func:`.chooser.plan_accumulate`: the placement rule's reason); empty when the caller fixed it."""
    device_bytes_per_param: dict[str, float] | None = None
    """The optimizer's device bytes per offloaded element, per accumulate mode, at this plan's ``topk_ratio``."""
    host_lr_scale: float = 1.0
    """The host step's lr scale (DESIGN §3): 1.0 unless the quality table measured a better one at this setting."""
    overlap_steps: int | None = None
    """With overlap, the steps after a window end at which its result is merged (DESIGN §3); None: U."""

    def config_fields(self) -> dict[str, Any]:
        """The choice as ZenFlowConfig fields: ``config.replace(**plan.config_fields())``."""
        return {"topk_ratio": self.topk_ratio, "update_interval": self.update_interval,
                "cpu_threads": self.cpu_threads, "grad_dtype": self.grad_dtype, "host_lr_scale": self.host_lr_scale,
                "overlap_steps": self.overlap_steps}

    def summary(self) -> dict[str, Any]:
        """The plan as every output carries it, under the same names: the CLI's table and ``--json``, the plot and
        ``ZenFlowAdamW.stats()`` (which names ``reason`` ``auto_reason``). Times per window unless named per step."""
        p = self.prediction
        return {
            "topk_ratio": self.topk_ratio,
            "update_interval": self.update_interval,
            "select_interval": p.select_interval,
            "cpu_threads": self.cpu_threads,
            "host_lr_scale": self.host_lr_scale,
            "overlap_steps": self.overlap_steps,
            "predicted_loss_ratio": self.predicted_loss_ratio,
            "max_loss_ratio": self.max_loss_ratio,
            "loss_budget_met": self.loss_budget_met,
            "predicted_time_per_step_s": self.predicted_step_s,
            "predicted_stall_fraction": p.stall_fraction,
            "hides_host_work": self.hides_host_work,
            "predicted_stall_per_window_s": self.predicted_stall_s,
            "predicted_wait_per_window_s": self.predicted_wait_s,
            "predicted_copy_per_window_s": self.predicted_copy_s,
            "predicted_host_per_window_s": self.predicted_host_s,
            "quality_table": self.quality_source,
            "reason": self.reason,
        }

    def headline(self) -> str:
        """One line: the choice and its predicted quality and speed (what ``"auto"`` logs)."""
        loss = "unknown" if self.predicted_loss_ratio is None else f"{self.predicted_loss_ratio:.3f}x AdamW"
        return (f"topk_ratio={self.topk_ratio:g} update_interval={self.update_interval} "
                f"cpu_threads={self.cpu_threads}: predicted loss {loss} (budget {self.max_loss_ratio:g}), "
                f"step {format_seconds(self.predicted_step_s)}, stall {self.prediction.stall_fraction:.1%}"
                + ("" if self.hides_host_work else " (host work not hidden)"))

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary(), "grad_dtype": self.grad_dtype, "profile_source": self.profile_source,
                "predicted_loss_spread": None if self.predicted_loss_spread is None
                else list(self.predicted_loss_spread), "prediction": self.prediction.to_dict(),
                "accumulate": self.accumulate, "accumulate_reason": self.accumulate_reason,
                "device_bytes_per_param": self.device_bytes_per_param}


def format_seconds(x: float) -> str:
    """``0.5`` -> ``500 ms``: seconds in the unit a person reads."""
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    if x > 0:
        return f"{x * 1e6:.3g} us"
    return "0 s"


def format_count(n: float) -> str:
    """``421_000`` -> ``421k``, ``1.25e8`` -> ``125M``, ``7e9`` -> ``7B``: three significant digits at most."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= 0.9995 * div:  # 999.9M prints as 1B, not 1e+03M
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}"


def format_bytes(x: float) -> str:
    return f"{x / 2**30:.1f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"
