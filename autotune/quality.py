"""The quality side of the autotuner: how much worse than AdamW training gets at a given ``(topk_ratio, U)``.

ZenFlow trades quality for speed: the unselected columns get one host step per window of ``U`` steps, one window
late (DESIGN §3), so at equal steps the loss degrades as ``U`` rises and ``topk_ratio`` falls. How much depends on
the task; the speed side of the choice cannot see it. This module holds a *quality table*, held-out loss of
ZenFlowAdamW over AdamW's at equal steps, measured over a grid of ``(r, U)`` for several seeds, and predicts the
ratio between grid points.

**The shipped table** (``quality_charlm.json`` next to this file) is the demo's fine-tune, with the same model
trained from scratch as its ``scratch`` regime (below): a 0.14M parameter byte-level transformer, 200 steps,
``overlap=True``, ``select_interval = 8 U``, no warm-up, 5 batch seeds (2 from scratch); its ``command`` field
regenerates it (``bench/quality_table.py``, 10 minutes on one shared core). A larger model, a longer
run or another task may degrade more or less: treat the table as a measured prior, not a guarantee, and measure
your own task when the budget matters (same format, ``--quality-table PATH`` on the command line,
``quality=`` in :func:`~zenflow_triton.autotune.plan` and ``plan_for_optimizer``).

**The model** is interpolation, no fit: the mean over seeds at the grid points, bilinear in ``(log r, log U)``
between them, plus one exact anchor: ``r = 1`` is plain AdamW (DESIGN §3's degenerate case), ratio 1 at every
``U``. Outside the measured range (``r`` below the smallest measured ratio, ``U`` outside the measured intervals)
:meth:`QualityTable.predict` returns None and the chooser does not go there: it never extrapolates.

**Format** (JSON): ``topk_ratios`` (ascending, in (0, 1)), ``update_intervals`` (ascending ints >= 1), and either
``ratio`` (``[r][U]`` numbers, or ``[r][U]`` lists, one per seed) or ``loss`` (``[r][U][seed]``) with
``adamw_loss`` (``[seed]``); optional ``schema`` (1), ``task``, ``metric``, ``command``, ``seeds`` and
``measured`` (free-form record of where and how); optional ``host_lr_scale``: a list of measured entries, each
``{"topk_ratio", "update_interval", "overlap" (bool), "host_lr_scale" (> 0, not 1), "ratio" ([task]: the best loss
over an lr grid with this scale over the best loss with 1.0, the default), "stable" (bool: no loss spike over the
long run), optional "equal_lr_worst" ([task]: the largest ratio of this scale's mean loss over 1.0's at one lr of the
grid), "tasks" ([task] names), "source"}`` (``bench/quality_fair.py`` measures them).

**The host step's scale** (``host_lr_scale``, DESIGN §3) is chosen from those entries alone, never interpolated:
:meth:`QualityTable.host_lr_scale` answers a scale only at an exactly measured ``(r, U, overlap)`` where it gave a
lower best loss on every task, stayed stable and, where ``equal_lr_worst`` is given, was nowhere worse than 1.0 at
equal lr (the tuner does not choose the lr: a scale that only pays off after the user retunes it is no gain), and
1.0 (Adam's step) everywhere else.

**Regimes** (optional ``regimes``: ``{"scratch": {...}}``, each a table of the same format without ``regimes``):
the top level is the fine-tune; ``regimes.scratch`` the same grid measured from a fresh initialisation
(``bench/quality_table.py --regime scratch``). :meth:`QualityTable.for_regime` picks what the tuner plans with
(``quality_regime`` of the optimizer, ``--quality-regime`` of the CLI): ``"finetune"``, ``"scratch"``, or
``"worst"`` (the default), which predicts the higher ratio of the two at each ``(r, U)``. A table without regimes
(the user's own task) answers itself for every regime.

The table has no entries for ``warmup_steps`` or ``select_interval``: ``bench/quality_fair.py`` measured both at
0.1 / 4 (``bench/results/quality-fair-2026-12-02.md``): a warm-up of 50-100 steps helps the 200-step tasks at lrs up
to AdamW's best but not the 1000-step run, and hurts above that lr; ``select_interval`` 8 is inside the seed spread.
Neither is a gain at every equal lr, and the tuner plans at the end of the warm-up, so it could not lengthen it.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA_VERSION", "DEFAULT_TABLE", "HostScaleEntry", "QualityTable", "QualityTableError",
           "load_quality_table", "default_quality_table"]

SCHEMA_VERSION = 1
# File name of the shipped table inside this package.
DEFAULT_TABLE = "quality_charlm.json"


class QualityTableError(ValueError):
    """A quality table that cannot be read or is malformed; the message says which and where."""


def _grid(values: Any, name: str, kind: type) -> tuple:
    if not isinstance(values, list) or not values:
        raise QualityTableError(f"{name} must be a non-empty list")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
            raise QualityTableError(f"{name} holds {v!r}, not a{'n int' if kind is int else ' number'}")
        out.append(kind(v))
    if any(b <= a for a, b in zip(out, out[1:])):
        raise QualityTableError(f"{name} must be strictly ascending: {out}")
    return tuple(out)


@dataclass(frozen=True)
class HostScaleEntry:
    """One measured ``host_lr_scale`` at one ``(r, U, overlap)``: its best loss over the default's, per task."""

    topk_ratio: float
    update_interval: int
    overlap: bool
    host_lr_scale: float
    ratio: tuple[float, ...]
    """Per task: best loss (over an lr grid, mean over seeds) with this scale / the same with 1.0."""
    stable: bool
    tasks: tuple[str, ...] = ()
    source: str = ""
    equal_lr_worst: tuple[float, ...] = ()
    """Per task: the largest ratio of this scale's loss over 1.0's at one lr of the grid (empty: not measured)."""

    @property
    def helps(self) -> bool:
        """Lower best loss than the default on every task, no instability, and nowhere worse at equal lr."""
        return self.stable and all(x < 1.0 for x in self.ratio) and all(x <= 1.0 for x in self.equal_lr_worst)

    @classmethod
    def from_dict(cls, doc: Any) -> HostScaleEntry:
        if not isinstance(doc, dict):
            raise QualityTableError(f"host_lr_scale entries must be objects, got {doc!r}")
        try:
            r, u, s = float(doc["topk_ratio"]), doc["update_interval"], float(doc["host_lr_scale"])
            overlap, stable = doc["overlap"], doc["stable"]
            ratio = tuple(float(x) for x in doc["ratio"])
        except KeyError as exc:
            raise QualityTableError(f"host_lr_scale entry lacks {exc}") from None
        if isinstance(u, bool) or not isinstance(u, int) or u < 1 or not 0 < r < 1:
            raise QualityTableError(f"host_lr_scale entry at topk_ratio={r!r}, update_interval={u!r}: r must lie in "
                                    "(0, 1) and U be an int >= 1")
        if not isinstance(overlap, bool) or not isinstance(stable, bool):
            raise QualityTableError("host_lr_scale entry: 'overlap' and 'stable' must be true or false")
        if not (math.isfinite(s) and s > 0) or s == 1.0:
            raise QualityTableError(f"host_lr_scale entry: scale {s!r} must be finite, > 0 and not 1 (the default)")
        if not ratio or any(not (math.isfinite(x) and x > 0) for x in ratio):
            raise QualityTableError(f"host_lr_scale entry: 'ratio' must be positive numbers, got {doc['ratio']!r}")
        tasks = tuple(str(t) for t in doc.get("tasks", ()))
        if tasks and len(tasks) != len(ratio):
            raise QualityTableError(f"host_lr_scale entry: {len(tasks)} tasks but {len(ratio)} ratios")
        try:
            worst = tuple(float(x) for x in doc.get("equal_lr_worst", ()))
        except (TypeError, ValueError):
            worst = (math.nan,)
        if worst and (len(worst) != len(ratio) or any(not (math.isfinite(x) and x > 0) for x in worst)):
            raise QualityTableError(f"host_lr_scale entry: 'equal_lr_worst' must be {len(ratio)} positive numbers, "
                                    f"got {doc['equal_lr_worst']!r}")
        return cls(topk_ratio=r, update_interval=u, overlap=overlap, host_lr_scale=s, ratio=ratio, stable=stable,
                   tasks=tasks, source=str(doc.get("source", "")), equal_lr_worst=worst)

    def to_dict(self) -> dict[str, Any]:
        return {"topk_ratio": self.topk_ratio, "update_interval": self.update_interval, "overlap": self.overlap,
                "host_lr_scale": self.host_lr_scale, "ratio": list(self.ratio), "stable": self.stable,
                "tasks": list(self.tasks), "source": self.source, "equal_lr_worst": list(self.equal_lr_worst)}


@dataclass(frozen=True)
class QualityTable:
    """Loss ratio vs AdamW per ``(topk_ratio, update_interval)``: ``ratios[i][j]`` holds one value per seed."""

    topk_ratios: tuple[float, ...]
    update_intervals: tuple[int, ...]
    ratios: tuple[tuple[tuple[float, ...], ...], ...]
    """``ratios[i][j]``: the ratio at ``topk_ratios[i]`` x ``update_intervals[j]``, one entry per seed."""
    task: str = ""
    command: str = ""
    seeds: tuple[int, ...] = ()
    source: str = ""
    """Where the table came from (a path, or "shipped: <name>")."""
    measured: dict[str, Any] = field(default_factory=dict, compare=False)
    host_scales: tuple[HostScaleEntry, ...] = ()
    """Measured ``host_lr_scale`` entries (module docstring); empty: the table knows only Adam's step."""
    regimes: dict[str, QualityTable] = field(default_factory=dict, compare=False)
    """Other training regimes measured on the same grid (``"scratch"``); the top level is the fine-tune."""
    worse: QualityTable | None = field(default=None, compare=False)
    """Set by ``for_regime("worst")``: predictions are the higher of this table's and ``worse``'s."""

    def __post_init__(self) -> None:
        if any(not 0 < r < 1 for r in self.topk_ratios):
            raise QualityTableError(f"topk_ratios must lie in (0, 1): {self.topk_ratios}")
        if any(u < 1 for u in self.update_intervals):
            raise QualityTableError(f"update_intervals must be >= 1: {self.update_intervals}")
        if len(self.ratios) != len(self.topk_ratios) or any(len(row) != len(self.update_intervals)
                                                            for row in self.ratios):
            raise QualityTableError(f"ratio grid must be {len(self.topk_ratios)} x {len(self.update_intervals)} "
                                    "(topk_ratios x update_intervals)")
        for row in self.ratios:
            for cell in row:
                if not cell or any(not (math.isfinite(x) and x > 0) for x in cell):
                    raise QualityTableError(f"every cell needs positive finite ratios, got {cell}")

    # ------------------------------------------------------------------ reading

    @classmethod
    def from_dict(cls, doc: Any, *, source: str = "") -> QualityTable:
        """Validate and build a table from its JSON document (format: module docstring)."""
        if not isinstance(doc, dict):
            raise QualityTableError(f"{source or 'quality table'}: expected a JSON object")
        where = source or "quality table"
        try:
            schema = doc.get("schema", SCHEMA_VERSION)
            if schema != SCHEMA_VERSION:
                raise QualityTableError(f"schema {schema!r}, this version reads {SCHEMA_VERSION}")
            rs = _grid(doc.get("topk_ratios"), "topk_ratios", float)
            us = _grid(doc.get("update_intervals"), "update_intervals", int)
            if "ratio" in doc:
                cells = [[list(c) if isinstance(c, list) else [c] for c in row] for row in doc["ratio"]]
            elif "loss" in doc and "adamw_loss" in doc:
                base = [float(x) for x in doc["adamw_loss"]]
                if not base or any(not (math.isfinite(b) and b > 0) for b in base):
                    raise QualityTableError(f"adamw_loss must be positive numbers: {doc['adamw_loss']}")
                cells = [[[float(x) / b for x, b in zip(c, base, strict=True)] for c in row] for row in doc["loss"]]
            else:
                raise QualityTableError("needs 'ratio', or 'loss' with 'adamw_loss'")
            ratios = tuple(tuple(tuple(float(x) for x in c) for c in row) for row in cells)
            seeds = tuple(int(s) for s in doc.get("seeds", ()))
            scales = doc.get("host_lr_scale", [])
            if not isinstance(scales, list):
                raise QualityTableError("host_lr_scale must be a list of entries")
            regimes = doc.get("regimes", {})
            if not isinstance(regimes, dict) or set(regimes) - {"scratch"}:
                raise QualityTableError(f"regimes must be an object with at most 'scratch': {list(regimes)}")
            if any(not isinstance(r, dict) or "regimes" in r for r in regimes.values()):
                raise QualityTableError("a regime is a table of its own, without regimes")
            return cls(topk_ratios=rs, update_intervals=us, ratios=ratios, task=str(doc.get("task", "")),
                       command=str(doc.get("command", "")), seeds=seeds, source=source,
                       measured=dict(doc.get("measured", {})),
                       host_scales=tuple(HostScaleEntry.from_dict(e) for e in scales),
                       regimes={k: cls.from_dict(r, source=f"{where}, regime {k}") for k, r in regimes.items()})
        except QualityTableError as exc:
            raise QualityTableError(f"{where}: {exc}") from None
        except (TypeError, ValueError) as exc:  # ragged lists, strings where numbers belong, zip(strict=True)
            raise QualityTableError(f"{where}: malformed grid ({exc})") from None

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, "task": self.task, "command": self.command,
                "topk_ratios": list(self.topk_ratios), "update_intervals": list(self.update_intervals),
                "seeds": list(self.seeds), "ratio": [[list(c) for c in row] for row in self.ratios],
                "measured": self.measured, "host_lr_scale": [e.to_dict() for e in self.host_scales],
                **({"regimes": {k: t.to_dict() for k, t in self.regimes.items()}} if self.regimes else {})}

    def for_regime(self, regime: str) -> QualityTable:
        """The table the tuner plans with for ``regime`` ("finetune", "scratch" or "worst"; module docstring)."""
        if regime not in ("finetune", "scratch", "worst"):
            raise ValueError(f"Invalid quality regime: {regime!r} (one of 'worst', 'finetune', 'scratch')")
        scratch = self.regimes.get("scratch")
        if scratch is None or regime == "finetune":
            return self
        if regime == "scratch":
            return dataclasses.replace(scratch, host_scales=self.host_scales, source=f"{self.source}, regime scratch")
        return dataclasses.replace(self, worse=scratch, source=f"{self.source}, the worse of finetune and scratch")

    # ------------------------------------------------------------------ the model

    def mean(self, i: int, j: int) -> float:
        cell = self.ratios[i][j]
        return sum(cell) / len(cell)

    def spread(self, i: int, j: int) -> tuple[float, float]:
        """(min, max) over seeds at a grid point."""
        return min(self.ratios[i][j]), max(self.ratios[i][j])

    def covers(self, topk_ratio: float, update_interval: int) -> bool:
        """Whether ``(r, U)`` lies in the measured range (``r = 1``, plain AdamW, always does)."""
        if topk_ratio >= 1.0:
            return True
        return (self.topk_ratios[0] * (1 - 1e-9) <= topk_ratio
                and self.update_intervals[0] <= update_interval <= self.update_intervals[-1]
                and (self.worse is None or self.worse.covers(topk_ratio, update_interval)))

    def _interpolate(self, topk_ratio: float, update_interval: int, value) -> float | None:
        if not self.covers(topk_ratio, update_interval):
            return None
        if topk_ratio >= 1.0:
            return 1.0
        # r = 1 is plain AdamW (DESIGN §3), ratio 1 exactly: an anchor row above the measured ones.
        log_r = [math.log(r) for r in self.topk_ratios] + [0.0]
        log_u = [math.log(u) for u in self.update_intervals]

        def at(i: int, j: int) -> float:
            return 1.0 if i == len(self.topk_ratios) else value(i, j)

        def bracket(axis: list[float], x: float) -> tuple[int, int, float]:
            k = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 1)
            if k == len(axis) - 1 or axis[k + 1] == axis[k]:
                return k, k, 0.0
            return k, k + 1, min(1.0, max(0.0, (x - axis[k]) / (axis[k + 1] - axis[k])))

        i0, i1, a = bracket(log_r, math.log(max(topk_ratio, self.topk_ratios[0])))
        j0, j1, b = bracket(log_u, math.log(update_interval))
        return ((1 - a) * ((1 - b) * at(i0, j0) + b * at(i0, j1))
                + a * ((1 - b) * at(i1, j0) + b * at(i1, j1)))

    def predict(self, topk_ratio: float, update_interval: int) -> float | None:
        """Predicted loss ratio vs AdamW (mean over seeds, interpolated); None outside the measured range (of both
        tables, with ``worse``)."""
        mine = self._interpolate(topk_ratio, update_interval, self.mean)
        if self.worse is None or mine is None:
            return mine
        other = self.worse.predict(topk_ratio, update_interval)
        return None if other is None else max(mine, other)

    def predict_spread(self, topk_ratio: float, update_interval: int) -> tuple[float, float] | None:
        """(min, max) over seeds, interpolated like :meth:`predict`; None outside the measured range."""
        lo = self._interpolate(topk_ratio, update_interval, lambda i, j: self.spread(i, j)[0])
        hi = self._interpolate(topk_ratio, update_interval, lambda i, j: self.spread(i, j)[1])
        if lo is None or hi is None:
            return None
        if self.worse is not None:
            other = self.worse.predict_spread(topk_ratio, update_interval)
            return None if other is None else (max(lo, other[0]), max(hi, other[1]))
        return lo, hi

    def host_lr_scale(self, topk_ratio: float, update_interval: int, overlap: bool) -> HostScaleEntry | None:
        """The measured scale that helps most at exactly this ``(r, U, overlap)`` (lowest worst-task ratio among
        those with a lower best loss on every task and no instability), or None: use 1.0, Adam's step."""
        helping = [e for e in self.host_scales
                   if e.helps and e.overlap == overlap and e.update_interval == update_interval
                   and math.isclose(e.topk_ratio, topk_ratio, rel_tol=1e-9)]
        return min(helping, key=lambda e: (max(e.ratio), e.host_lr_scale), default=None)

    def ratio_spread(self, topk_ratio: float, update_interval: int) -> tuple[float, float]:
        """(min, max) over seeds at a grid point; KeyError if ``(r, U)`` is not one."""
        try:
            i, j = self.topk_ratios.index(topk_ratio), self.update_intervals.index(update_interval)
        except ValueError:
            raise KeyError((topk_ratio, update_interval)) from None
        return self.spread(i, j)

    @property
    def describe(self) -> str:
        """One line: what the table measured and where it came from."""
        n = len(self.ratios[0][0])
        return (f"{self.source or 'quality table'}: {len(self.topk_ratios)}x{len(self.update_intervals)} grid, "
                f"{n} seed{'s' if n != 1 else ''}" + (f"; {self.task}" if self.task else ""))

    def render(self) -> str:
        """The table as text: mean ratio and (min-max) over seeds, r down, U across."""
        lines = [f"loss ratio vs AdamW at equal steps, mean (min-max over {len(self.ratios[0][0])} seeds)"]
        if self.task:
            lines.append(f"  task: {self.task}")
        corner = "r \\ U"
        lines.append(f"  {corner:>7}" + "".join(f"{u:>20}" for u in self.update_intervals))
        for i, r in enumerate(self.topk_ratios):
            cells = []
            for j in range(len(self.update_intervals)):
                lo, hi = self.spread(i, j)
                cells.append(f"{self.mean(i, j):.3f} ({lo:.3f}-{hi:.3f})")
            lines.append(f"  {r:>7g}" + "".join(f"{c:>20}" for c in cells))
        if self.command:
            lines.append(f"  regenerate: {self.command}")
        for e in self.host_scales:
            verdict = "helps: the tuner takes it there" if e.helps else "not a gain everywhere: 1.0 stays"
            tasks = "/".join(e.tasks) if e.tasks else f"{len(e.ratio)} tasks"
            worst = (f", at equal lr up to {max(e.equal_lr_worst):.3f}x" if e.equal_lr_worst else "")
            lines.append(f"  host_lr_scale={e.host_lr_scale:g} at r={e.topk_ratio:g}, U={e.update_interval}, "
                         f"overlap={'on' if e.overlap else 'off'}: best loss "
                         f"{'/'.join(f'{x:.3f}' for x in e.ratio)} of 1.0's ({tasks}){worst}"
                         f"{'' if e.stable else ', unstable'}; {verdict}")
        return "\n".join(lines)


def load_quality_table(path: str | Path | None = None) -> QualityTable:
    """The table at ``path`` (JSON, format: module docstring), or the shipped one when ``path`` is None."""
    if path is None:
        try:
            text = resources.files(__package__).joinpath(DEFAULT_TABLE).read_text(encoding="utf-8")
        except OSError as exc:
            raise QualityTableError(f"the shipped quality table {DEFAULT_TABLE} is missing: {exc}") from None
        source = f"shipped: {DEFAULT_TABLE}"
    else:
        source = str(path)
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except OSError as exc:
            raise QualityTableError(f"cannot read quality table {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise QualityTableError(f"{source}: not UTF-8 text, so not JSON (a binary file?): {exc.reason}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QualityTableError(f"{source}: not JSON ({exc})") from None
    return QualityTable.from_dict(doc, source=source)


@functools.lru_cache(maxsize=1)
def default_quality_table() -> QualityTable:
    """The shipped table, read once per process."""
    return load_quality_table()
