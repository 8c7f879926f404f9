"""The demo's output: each run's record, the comparison table (stdout) and, with ``--plot``, the loss curves."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunResult", "format_table", "plot"]


@dataclass
class RunResult:
    """One optimizer's fine-tuning run."""

    name: str
    final_loss: float
    """Held-out fine-tuning loss after the last step (nats per byte)."""
    train_losses: list[float]
    step_seconds: list[float]
    """Wall time of each step: forward, backward, optimizer step (synchronised on CUDA)."""
    stats: dict[str, Any] | None = field(default=None)
    """``ZenFlowAdamW.stats()`` at the end; None for AdamW."""
    warmup_steps: int = 1
    """Leading steps left out of :attr:`mean_step_ms` (one-time set-up, not the steady state)."""

    @property
    def mean_step_ms(self) -> float:
        """Mean wall time per step after the warm-up steps (all steps when there are no others)."""
        steady = self.step_seconds[self.warmup_steps :] or self.step_seconds
        return 1000.0 * statistics.fmean(steady)


def format_table(results: Sequence[RunResult]) -> str:
    """The comparison table: one row per optimizer, "-" where a column does not apply (AdamW's offload columns).

    The first row is the baseline of the "vs <first optimizer>" loss-ratio column.
    """
    headers = [
        "optimizer",
        "final loss",
        f"vs {results[0].name}" if results else "ratio",
        "ms/step",
        "stall s",
        "host job s",
        "selected",
        "sel. energy",
        "host B/param",
        "D2H MB",
    ]
    base = results[0].final_loss if results else float("nan")
    rows = []
    for r in results:
        s = r.stats
        rows.append(
            [
                r.name,
                f"{r.final_loss:.4f}",
                f"{r.final_loss / base:.3f}",
                f"{r.mean_step_ms:.2f}",
                "-" if s is None else f"{s['stall_s']:.3f}",
                "-" if s is None else f"{s['host_job_s']:.3f}",
                "-" if s is None else f"{s['selected_fraction']:.3f}",
                "-" if s is None else f"{s['selected_energy_fraction']:.3f}",
                "-" if s is None else f"{s['host_bytes_per_param']:.1f}",
                "-" if s is None else f"{s['d2h_bytes'] / 1e6:.1f}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        # Name column left-aligned, numbers right-aligned so the decimal points line up.
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def plot(path: str, results: Sequence[RunResult], pretrained_loss: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for r in results:
        # Per-step losses on random batches are noisy; an exponential moving average shows the trend.
        smooth, ema = [], r.train_losses[0]
        for value in r.train_losses:
            ema = 0.9 * ema + 0.1 * value
            smooth.append(ema)
        steps = range(1, len(smooth) + 1)
        (curve,) = ax.plot(steps, smooth, label=f"{r.name} (train, EMA)")
        ax.axhline(r.final_loss, color=curve.get_color(), linestyle=":", label=f"{r.name} held-out {r.final_loss:.3f}")
    ax.axhline(pretrained_loss, color="grey", linestyle="--", label=f"pretrained held-out {pretrained_loss:.3f}")
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
