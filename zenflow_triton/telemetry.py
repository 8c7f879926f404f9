"""The counters behind ``ZenFlowAdamW.stats()`` (DESIGN §7), shared by the optimizer and its pipeline."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Stats", "stats_of"]


@dataclass
class Stats:
    """Counters behind ``ZenFlowAdamW.stats()`` (DESIGN §7), shared by the optimizer and its pipeline."""

    steps: int = 0
    windows: int = 0
    selections: int = 0
    stall_s: float = 0.0
    host_job_s: float = 0.0
    device_opt_s: float = 0.0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    selected_energy_fraction: float = float("nan")
    columns_changed_last_selection: int = 0
    stall_at_plan: float = 0.0
    windows_at_plan: int = 0
    compile_s: float = 0.0  # the host kernels' first load (numba compiles them once per machine), not stall

    def counters(self) -> dict[str, Any]:
        """The counters as ``stats()`` names them."""
        return {
            "steps": self.steps, "windows": self.windows, "selections": self.selections, "stall_s": self.stall_s,
            "host_job_s": self.host_job_s, "device_opt_s": self.device_opt_s, "compile_s": self.compile_s,
            "d2h_bytes": self.d2h_bytes, "h2d_bytes": self.h2d_bytes,
            "selected_energy_fraction": self.selected_energy_fraction,
            "columns_changed_last_selection": self.columns_changed_last_selection,
            "measured_stall_per_window_s": self.stall_s / self.windows if self.windows else 0.0,
        }

    def per_step(self) -> dict[str, float]:
        """Per-step views: the mean time a ``step()`` call took (all of it: device work or its launches, and the
        wait for the host) and the part of it that was waiting."""
        n = self.steps
        return {"ms_per_step": 1e3 * (self.device_opt_s + self.stall_s) / n if n else 0.0,
                "stall_ms_per_step": 1e3 * self.stall_s / n if n else 0.0}

    def mark_plan(self) -> None:
        """The "auto" plan was made now: its measured stall counts from here (warm-up windows wait synchronously by
        design; the prediction is about the windows that follow)."""
        self.stall_at_plan, self.windows_at_plan = self.stall_s, self.windows

    def record_selection(self, picks: Sequence[Any], *, measured: bool) -> None:
        """Count one selection step from its per-parameter :class:`~zenflow_triton.columns.Reselection`\\ s
        (``measured``: whether scores were kept; with topk_ratio=0 nothing is selected, whatever the energy)."""
        self.selections += 1
        self.d2h_bytes += sum(sel.d2h_bytes for sel in picks)
        self.h2d_bytes += sum(sel.h2d_bytes for sel in picks)
        energy_all = sum(sel.energy_all for sel in picks)
        energy_sel = sum(sel.energy_selected for sel in picks)
        if not measured:
            self.selected_energy_fraction = 0.0
        else:
            self.selected_energy_fraction = energy_sel / energy_all if energy_all > 0 else float("nan")
        self.columns_changed_last_selection = sum(sel.columns_changed for sel in picks)


def stats_of(opt: Any) -> dict[str, Any]:
    """``ZenFlowAdamW.stats()`` (every key in docs/telemetry.md's table): the counters, where the offloaded state
    lives and how big it is, the per-step figures, the knobs ("auto" resolved) and their plan, clipping, and whether
    gradients are captured in backward (and how many offloaded ones were, for the last step). Host bytes are this
    process's (a sharded parameter's rows here); ``offloaded_params`` counts whole parameters."""
    from .host_budget import report as host_report

    pipeline, s = opt._pipeline, opt._stats
    records, slabs = pipeline.records, pipeline.host_slabs()
    total_cols = sum(rec.cols for rec in records.values())
    selected_cols = sum(rec.cols - rec.masks.num_unselected for rec in records.values())
    local_numel = sum(rec.rows * rec.cols for rec in records.values())
    host_bytes = sum(slab.nbytes for slab in slabs)
    device_bytes = pipeline.device_bytes(opt.state) + opt._capture.device_bytes(records)
    return {
        **s.counters(),
        "selected_fraction": selected_cols / total_cols if total_cols else 0.0,
        "pinned_bytes": sum(slab.nbytes for slab in slabs if slab.pinned),
        "host_bytes": host_bytes,
        "host_bytes_per_param": host_bytes / local_numel if local_numel else 0.0,
        **host_report(pipeline),
        "offloaded_params": sum(p.numel() for p in records),
        "accumulate": pipeline.accumulate,
        "accumulate_reason": pipeline.accumulate_reason,
        "device_bytes_per_param": device_bytes / local_numel if local_numel else 0.0,
        **s.per_step(), **opt._knobs.state_dict(), **opt._knobs.report(s), **opt._gradients.report(),
        "grads_in_backward": opt.config.grads_in_backward,
        "captured_last_step": opt._capture.last_captured,
    }
