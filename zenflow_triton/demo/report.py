"""The demo's output: each run's record, the comparison table (stdout) and, with ``--plot``, the loss curves."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunResult", "format_table", "format_legend", "plot"]


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
    """Leading steps of the timed run left out of :attr:`mean_step_ms` (state allocation, worker start-up)."""
    warmup_run_steps: int = 0
    """Steps of the untimed warm-up run on a throwaway copy of the model that preceded the timed run (0: none)."""
    warmup_run_s: float = 0.0
    """Wall time of that warm-up run: on a first run it includes compiling ZenFlow's numba kernels."""

    @property
    def mean_step_ms(self) -> float:
        """Mean wall time per step after the warm-up steps (all steps when there are no others)."""
        steady = self.step_seconds[self.warmup_steps :] or self.step_seconds
        return 1000.0 * statistics.fmean(steady)

    @property
    def one_time_s(self) -> float:
        """How much longer the warm-up run took than its steps at :attr:`mean_step_ms`: one-time set-up (on a
        first run, mostly numba compiling ZenFlow's kernels), never negative."""
        return max(0.0, self.warmup_run_s - self.warmup_run_steps * self.mean_step_ms / 1000.0)


# The table's column headers, and what each one means (the legend under the table says it).
LOSS = "held-out loss"
STEP_MS = "ms/step"
STALL = "stall s"
HOST_JOB = "host job s"
SELECTED = "selected cols"
ENERGY = "selected energy"
HOST_BYTES = "host B/param"
D2H = "D2H MB"


def format_table(results: Sequence[RunResult]) -> str:
    """The comparison table: one row per optimizer, "-" where a column does not apply (AdamW's offload columns).

    The first row is the baseline of the "loss / <first optimizer> loss" column; :func:`format_legend` explains the
    columns.
    """
    headers = [
        "optimizer",
        LOSS,
        _ratio_header(results),
        STEP_MS,
        STALL,
        HOST_JOB,
        SELECTED,
        ENERGY,
        HOST_BYTES,
        D2H,
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


def _ratio_header(results: Sequence[RunResult]) -> str:
    # "loss / AdamW loss": says it is a ratio of losses, where "vs AdamW" read like a speed-up.
    return f"loss / {results[0].name} loss" if results else "loss ratio"


def format_legend(results: Sequence[RunResult]) -> str:
    """What each column of :func:`format_table` means, one line per column (or pair), for under the table."""
    base = results[0].name if results else "the first row"
    skipped = sorted({r.warmup_steps for r in results})
    skipped_text = "step" if skipped == [1] else f"{'/'.join(str(n) for n in skipped) or '0'} steps"
    lines = [
        f"{LOSS}: next-byte cross-entropy (nats/byte, lower is better) on held-out pydoc text, after flush()",
        f"{_ratio_header(results)}: held-out loss over {base}'s (1.050 = a 5% higher loss); a loss ratio, not a speed "
        "ratio",
        f"{STEP_MS}: mean wall time of forward + backward + step(), leaving out the first {skipped_text} "
        "(state set-up, worker start)",
    ]
    warmed = [r for r in results if r.warmup_run_steps]
    if warmed:
        runs = ", ".join(f"{r.name} {r.warmup_run_s:.1f} s" for r in warmed)
        lines.append(
            f"  before timing, each optimizer ran {warmed[0].warmup_run_steps} untimed warm-up steps on a throwaway "
            f"copy: {runs}"
        )
        one_time = ", ".join(f"{r.name} {r.one_time_s:.1f} s" for r in warmed if r.one_time_s >= 0.5)
        if one_time:
            lines.append(
                f"  of which one-time set-up: {one_time} (loading ZenFlow's numba kernels; compiling on a first run)"
            )
        else:
            lines.append("  where one-time set-up falls (loading ZenFlow's numba kernels; compiling on a first run)")
    lines += [
        f"{STALL}: total time step() waited for the host worker; {HOST_JOB}: total time of the host's CPU Adam jobs",
        f"{SELECTED}: fraction of the offloaded weights' columns updated on the device every step (topk_ratio,",
        "  rounded up per weight); the host updates the other columns once per window (update_interval steps)",
        f"{ENERGY}: share of the gradient's squared norm that falls in the selected columns, at the last selection",
        f"{HOST_BYTES}: host memory per offloaded parameter; {D2H}: megabytes copied device to host; -: does not apply",
    ]
    return "\n".join(lines)


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
