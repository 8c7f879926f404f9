"""Training quality at each optimizer's best learning rate: AdamW against ZenFlowAdamW configurations, three tasks.

A loss ratio at one untuned lr says little (issue 21): a configuration that takes smaller effective steps looks
worse at an lr that rewards bigger ones and better at one that punishes them. So every optimizer gets the same lr
grid, several batch seeds, and is judged by its best lr (the lowest mean held-out loss over the seeds):

- **best-to-best**: a configuration's best mean loss over AdamW's best mean loss, with the (min, max) over seeds
  of the per-seed ratio, each optimizer at its own best lr;
- **equal lr**: at each lr of the grid, the mean (min, max) over seeds of the per-seed ratio;
- **spike**: the loss curve's largest relative rise above its running minimum after the first 10% of the steps
  (training loss smoothed over ``max(5, steps // 50)`` steps): an unstable run shows here before its end does.

Tasks (the demo's byte-level transformer, :mod:`zenflow_triton.demo.charlm`, default CharLMConfig, 99% of its
parameters offloaded; batch 8 x 64 bytes, AdamW weight decay 0.01 everywhere, constant lr unless said):

- ``finetune``: the demo's fine-tune (``python -m zenflow_triton.demo``; bench/quality_table.py's task): pretrained
  800 steps on standard-library source, 200 steps on the pydoc topics, held-out pydoc loss;
- ``scratch``: from a fresh initialisation, 200 steps on the pydoc topics, held-out pydoc loss;
- ``long``: from a fresh initialisation, 1000 steps on standard-library source (the first 90%; held out: the last
  10%), linear warm-up over 5% of the steps, then cosine decay to 0.1x: a run long enough that Adam's bias
  correction is no longer what the loss is about.

ZenFlow configurations: ``topk_ratio`` and ``update_interval`` as given (default 0.1 / 4), ``overlap`` on and off
(``--overlaps``), each with every ``host_lr_scale`` of ``--scales`` (DESIGN §3: the host windows step with lr x s),
``warmup_steps`` of ``--warmups`` (default 0), ``select_interval`` of ``--select-intervals`` (default 8 U) and, with
overlap, ``overlap_steps`` of ``--overlap-steps`` (default U); a knob at its default is left out of a configuration's
name. ``--late`` adds a reference: torch AdamW with the offloadable matrices one update late
(:mod:`late_adamw`, the staleness of ``overlap=True`` alone). Held-out loss after ``flush()``. One core:
``torch.set_num_threads(1)``, ``cpu_threads=1`` (results do not depend on thread counts, DESIGN §3). The run
writes its JSON after every task and seed, so a run cut short keeps what it measured; ``--report JSON`` rebuilds the
Markdown from it. ``--add-to JSON`` runs only what JSON lacks: new configurations, or known ones at lrs added with
``--add-lrs`` (``--at-lrs``: only there; ``--tasks``: only those tasks); each configuration is then judged at the
lrs it was run at (docs/quality.md has the commands)::

    nice -n 10 python bench/quality_fair.py --out bench/results/quality-fair-2026-12-01
    nice -n 10 python bench/quality_fair.py --out OUT --add-to bench/results/quality-fair-2026-12-01.json \
        --tasks scratch --scales 1 --warmups 50 --overlaps on --add-lrs 8e-3

``ZENFLOW_BENCH_SMOKE=1`` (or ``--smoke``) shrinks everything to seconds (bench/bench_quality_fair.py, in CI).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from late_adamw import LateAdamW

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.autotune.quality import QualityTable
from zenflow_triton.config import ZenFlowConfig
from zenflow_triton.demo.charlm import (
    CharLMConfig,
    encode,
    evaluate,
    load_corpora,
    make_model,
    pretrain,
    pretrained_state,
    train,
)

__all__ = ["Task", "Config", "tasks", "configs", "measure", "add_runs", "summarize", "render", "spike", "main"]

WEIGHT_DECAY = 0.01
BATCH = 8
LATE = "AdamW one update late"  # the name of the --late reference
SMOKE = os.environ.get("ZENFLOW_BENCH_SMOKE", "0") not in ("", "0")


@dataclass(frozen=True)
class Task:
    name: str
    what: str
    steps: int
    pretrain_steps: int  # 0: from a fresh initialisation
    corpus: str  # "pydoc" or "stdlib"
    schedule: bool  # warm-up 5% + cosine to 0.1x
    lrs: tuple[float, ...]
    clip: float = 0.0  # > 0: clip the gradients' total norm to this before every step (both optimizers)
    pretrain_corpus: str = "stdlib"  # what pretrain_steps train on (AdamW, charlm.pretrain's schedule)


@dataclass(frozen=True)
class Config:
    name: str
    overlap: bool | None = None  # None: torch.optim.AdamW
    host_lr_scale: float = 1.0
    warmup_steps: int = 0
    select_interval: int | None = None  # None: 8 U (the default)
    late: bool = False  # torch AdamW with the offloadable matrices one update late (bench/late_adamw.py)
    overlap_steps: int | None = None  # None: U (the default)
    topk_ratio: float | None = None  # None: the run's --topk-ratio

    @property
    def is_adamw(self) -> bool:
        """The baseline: torch.optim.AdamW as it is."""
        return self.overlap is None and not self.late


def tasks(*, smoke: bool = False, lrs: Sequence[float] = (5e-4, 1e-3, 2e-3, 4e-3),
          long_lrs: Sequence[float] = (1e-3, 2e-3, 4e-3), long_steps: int = 1000,
          arith_lrs: Sequence[float] = (1e-3, 2e-3, 4e-3, 8e-3),
          shift_lrs: Sequence[float] = (5e-4, 1e-3, 2e-3, 4e-3)) -> list[Task]:
    if smoke:
        return [Task("finetune", "smoke fine-tune", 8, 8, "pydoc", False, tuple(lrs[:2])),
                Task("scratch", "smoke from scratch", 8, 0, "pydoc", False, tuple(lrs[:2])),
                Task("long", "smoke long run", 24, 0, "stdlib", True, tuple(long_lrs[:2])),
                Task("arith", "smoke arithmetic", 12, 0, "arith", True, tuple(arith_lrs[:2]), clip=1.0),
                Task("shift", "smoke shift", 8, 8, "stdlib", True, tuple(shift_lrs[:2]), clip=1.0,
                     pretrain_corpus="pydoc")]
    return [
        Task("finetune", "demo fine-tune: pretrained 800 steps on stdlib source, 200 steps on pydoc topics", 200, 800,
             "pydoc", False, tuple(lrs)),
        Task("scratch", "from scratch: 200 steps on pydoc topics", 200, 0, "pydoc", False, tuple(lrs)),
        Task("long", f"long run from scratch: {long_steps} steps on stdlib source (90/10 split), warm-up 5% + cosine "
             "to 0.1x", long_steps, 0, "stdlib", True, tuple(long_lrs)),
        Task("arith", "from scratch on generated arithmetic strings (`123+45=168`, 90/10 split), 300 steps, warm-up 5% "
             "+ cosine to 0.1x, gradient norm clipped to 1.0", 300, 0, "arith", True, tuple(arith_lrs), clip=1.0),
        Task("shift", "domain shift: pretrained 800 steps on pydoc topics (English), 200 steps on stdlib source "
             "(code), warm-up 5% + cosine to 0.1x, gradient norm clipped to 1.0", 200, 800, "stdlib", True,
             tuple(shift_lrs), clip=1.0, pretrain_corpus="pydoc"),
    ]


def arith_corpus(n_bytes: int = 200_000, seed: int = 0) -> torch.Tensor:
    """Generated arithmetic lines (``a+b=c``, ``a-b=c``, ``a*b=c``; operands up to 4 digits, products of up to 2),
    ``n_bytes`` of them as a byte tensor: the algorithmic text a newcomer trains on first."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < n_bytes:
        op = rng.choice("+-*")
        hi = 99 if op == "*" else 9999
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        line = f"{a}{op}{b}={a + b if op == '+' else a - b if op == '-' else a * b}\n"
        lines.append(line)
        size += len(line)
    return encode("".join(lines)[:n_bytes])


class _Clipped:
    """``opt`` whose ``step()`` first clips the model's gradient norm to ``clip`` (torch.nn.utils.clip_grad_norm_),
    as a training loop does before its optimizer step."""

    def __init__(self, opt: torch.optim.Optimizer, params: list[torch.Tensor], clip: float) -> None:
        self.opt, self.params, self.clip = opt, params, clip

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)


def configs(scales: Sequence[float], warmups: Sequence[int] = (0,),
            select_intervals: Sequence[int | None] = (None,), overlaps: Sequence[bool] = (True, False),
            late: bool = False, overlap_steps: Sequence[int | None] = (None,),
            topk_ratios: Sequence[float | None] = (None,)) -> list[Config]:
    """AdamW (and with ``late`` AdamW one update late), then ZenFlow at every overlap x scale x warm-up x
    select_interval x overlap_steps (overlap only); a knob at its default is left out of the name (so names match
    older results)."""
    out = [Config("AdamW")] + ([Config(LATE, late=True)] if late else [])
    for overlap, s, w, sel, r in itertools.product(overlaps, scales, warmups, select_intervals, topk_ratios):
        for k in overlap_steps if overlap else (None,):
            name = (f"ZenFlow {'overlap' if overlap else 'sequential'} s={s:g}" + (f" warm={w}" if w else "")
                    + (f" S={sel}" if sel else "") + (f" K={k}" if k else "") + (f" r={r:g}" if r else ""))
            out.append(Config(name, overlap, float(s), int(w), sel or None, overlap_steps=k or None,
                              topk_ratio=r or None))
    return out


def spike(losses: Sequence[float]) -> float:
    """Largest relative rise of the smoothed loss above its running minimum after the first 10% of the steps."""
    n = len(losses)
    w = max(5, n // 50)
    if n < 2 * w:
        return 0.0
    sm = [statistics.fmean(losses[i:i + w]) for i in range(n - w + 1)]
    if not all(math.isfinite(x) for x in sm):
        return math.inf
    start = max(1, n // 10)
    low = min(sm[:start])
    worst = 0.0
    for x in sm[start:]:
        worst = max(worst, x / low - 1.0)
        low = min(low, x)
    return worst


def _schedule(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warm = max(1, steps // 20)

    def factor(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * (i - warm) / max(1, steps - warm)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _run(task: Task, config: Config, *, lr: float, seed: int, start: dict[str, torch.Tensor] | None,
         data: tuple[torch.Tensor, torch.Tensor], cfg: CharLMConfig, topk_ratio: float,
         update_interval: int) -> tuple[float, list[float]]:
    """(held-out loss, training losses) of one run."""
    model = make_model(cfg, seed=seed)  # from scratch: the seed also picks the initialisation
    if start is not None:
        model.load_state_dict(start)
    if config.is_adamw:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    elif config.late:
        opt = LateAdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    else:
        opt = ZenFlowAdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY,
                           topk_ratio=config.topk_ratio or topk_ratio,
                           update_interval=update_interval, overlap=config.overlap, cpu_threads=1,
                           host_lr_scale=config.host_lr_scale, warmup_steps=config.warmup_steps,
                           select_interval=config.select_interval, overlap_steps=config.overlap_steps)
    try:
        sched = _schedule(opt, task.steps) if task.schedule else None
        stepper: Any = _Clipped(opt, list(model.parameters()), task.clip) if task.clip > 0 else opt
        losses = train(model, stepper, data[0], steps=task.steps, batch=BATCH, seed=seed, scheduler=sched)
        if isinstance(opt, (ZenFlowAdamW, LateAdamW)):
            opt.flush()  # overlap=True: the last window's host result reaches the model one window late
        return evaluate(model, data[1]), losses
    finally:
        if isinstance(opt, ZenFlowAdamW):
            opt.close()


def _revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    rev = out.stdout.strip()
    return (rev + ("+uncommitted" if dirty.stdout.strip() else "")) or None


def _downsample(losses: Sequence[float], points: int = 50) -> list[float]:
    if len(losses) <= points:
        return [round(x, 4) for x in losses]
    size = len(losses) / points
    return [round(statistics.fmean(losses[int(i * size):int((i + 1) * size)]), 4) for i in range(points)]


def measure(*, task_list: Sequence[Task], config_list: Sequence[Config], seeds: dict[str, list[int]], topk_ratio: float,
            update_interval: int, command: str, save: Callable[[dict], None] | None = None,
            progress: Callable[[str], None] = print,
            skip: Callable[[str, str, float, int], bool] | None = None) -> dict:
    """Run every task x seed (``seeds[task.name]``) x lr x config, except where ``skip(task, config, lr, seed)``;
    returns (and after every task and seed passes to ``save``) the results as a plain dict:
    ``runs[task][config][str(lr)][str(seed)] = {"loss", "spike", "curve"}``."""
    started = time.perf_counter()
    cfg = CharLMConfig()
    corpora = load_corpora()
    cut = int(len(corpora.pretrain) * 0.9)
    data = {"pydoc": (corpora.finetune_train, corpora.finetune_val),
            "stdlib": (corpora.pretrain[:cut], corpora.pretrain[cut:])}
    arith = arith_corpus()
    data["arith"] = (arith[:int(len(arith) * 0.9)], arith[int(len(arith) * 0.9):])
    doc: dict[str, Any] = {
        "what": "held-out loss after flush(), per task, optimizer, lr and batch seed (bench/quality_fair.py)",
        "command": command,
        "topk_ratio": topk_ratio, "update_interval": update_interval, "select_interval": 8 * update_interval,
        "batch": BATCH, "weight_decay": WEIGHT_DECAY, "seeds": sorted({x for t in task_list for x in seeds[t.name]}),
        "tasks": [dict(t.__dict__, lrs=list(t.lrs)) for t in task_list],
        "configs": [dict(c.__dict__) for c in config_list],
        "runs": {t.name: {c.name: {} for c in config_list} for t in task_list},
        "measured": {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "revision": _revision(),
            "machine": f"{platform.node()}: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
                       "shared with other work",
            "python": platform.python_version(), "torch": torch.__version__,
            "threads": "torch.set_num_threads(1), ZenFlowAdamW(cpu_threads=1)",
            "load_average": [round(os.getloadavg()[0], 2)],
        },
    }
    for task in task_list:
        todo = [(seed, lr, config) for seed in seeds[task.name] for lr in task.lrs for config in config_list
                if skip is None or not skip(task.name, config.name, lr, seed)]
        if not todo:
            continue
        start = _pretrained(cfg, task, corpora.finetune_train)
        for seed in seeds[task.name]:
            if not any(s == seed for s, _, _ in todo):
                continue
            for lr in task.lrs:
                line = []
                for config in (c for s, x, c in todo if s == seed and x == lr):
                    loss, losses = _run(task, config, lr=lr, seed=seed, start=start, data=data[task.corpus], cfg=cfg,
                                        topk_ratio=topk_ratio, update_interval=update_interval)
                    doc["runs"][task.name][config.name].setdefault(f"{lr:g}", {})[str(seed)] = {
                        "loss": loss if math.isfinite(loss) else None, "spike": round(spike(losses), 4),
                        "curve": _downsample(losses),
                    }
                    line.append(f"{config.name}: {loss:.4f}")
                if not line:
                    continue
                progress(f"{task.name} seed {seed} lr {lr:g}: " + "; ".join(line)
                         + f"  [{time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f}]")
            doc["measured"]["wall_s"] = round(time.perf_counter() - started, 1)
            doc["measured"]["load_average"].append(round(os.getloadavg()[0], 2))
            if save is not None:
                save(doc)
    return doc


def _pretrained(cfg: CharLMConfig, task: Task, pydoc: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The task's starting weights: None from scratch, else pretrained with AdamW on its pretrain corpus."""
    if not task.pretrain_steps:
        return None
    if task.pretrain_corpus == "stdlib":
        return pretrained_state(cfg, steps=task.pretrain_steps)
    model = make_model(cfg, seed=0)
    pretrain(model, pydoc, steps=task.pretrain_steps, seed=0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------- summary


def _loss(doc: dict, task: str, config: str, lr: str, seed: str) -> float:
    run = doc["runs"][task][config].get(lr, {}).get(seed)
    if run is None:
        return math.nan
    return math.inf if run["loss"] is None else run["loss"]


def _mean_loss(doc: dict, task: str, config: str, lr: str, seeds: list[int]) -> float:
    return statistics.fmean(_loss(doc, task, config, lr, str(s)) for s in seeds)


def _best(doc: dict, task: str, config: str, lrs: list[str], seeds: list[str]) -> tuple[str, float]:
    """(lr, mean loss over seeds) at the lr of the lowest mean."""
    means = {lr: statistics.fmean(_loss(doc, task, config, lr, s) for s in seeds) for lr in lrs}
    lr = min(lrs, key=means.__getitem__)
    return lr, means[lr]


def summarize(doc: dict) -> dict:
    """Per task and configuration: best lr, best mean loss, best-to-best ratio (mean, min, max over seeds), the
    ratio at every lr, and the largest spike (at the best lr, and over the grid). Only complete seeds count."""
    adamw = doc["configs"][0]["name"]
    out: dict[str, Any] = {}
    for task in doc["tasks"]:
        t = task["name"]
        lrs = [f"{lr:g}" for lr in task["lrs"]]
        # Each configuration over the lrs it was run at (runs added later may cover only part of the grid);
        # configurations never run on this task are left out of it.
        own = {c["name"]: [lr for lr in lrs if doc["runs"].get(t, {}).get(c["name"], {}).get(lr)]
               for c in doc["configs"]}
        own = {name: x for name, x in own.items() if x}
        seeds = [str(s) for s in doc["seeds"]
                 if all(not math.isnan(_loss(doc, t, name, lr, str(s))) for name, x in own.items() for lr in x)]
        if not seeds or adamw not in own:
            continue

        a_lr, a_best = _best(doc, t, adamw, own[adamw], seeds)
        rows = {}
        for name, mine in own.items():
            lr, mean = _best(doc, t, name, mine, seeds)
            per_seed = [_loss(doc, t, name, lr, s) / _loss(doc, t, adamw, a_lr, s) for s in seeds]
            at_lr = {}
            for k in mine:
                if k in own[adamw]:
                    rs = [_loss(doc, t, name, k, s) / _loss(doc, t, adamw, k, s) for s in seeds]
                    at_lr[k] = [statistics.fmean(rs), min(rs), max(rs)]
            spikes_best = [doc["runs"][t][name][lr][s]["spike"] for s in seeds]
            spikes_all = [doc["runs"][t][name][k][s]["spike"] for k in mine for s in seeds]
            rows[name] = {"best_lr": float(lr), "best_loss": mean, "best_to_best": mean / a_best,
                          "best_to_best_seeds": [min(per_seed), max(per_seed)], "equal_lr": at_lr,
                          "spike_at_best": max(spikes_best), "spike_any_lr": max(spikes_all),
                          "best_at_grid_edge": lr in (mine[0], mine[-1])}
        out[t] = {"seeds": [int(s) for s in seeds], "adamw_best_lr": float(a_lr), "configs": rows}
    return out


# A scale is "stable" when its long run's spike at its best lr is at most this much above Adam's host step's at its
# best lr (same overlap). Measured at 0.1 / 4 (bench/results/quality-fair-2026-12-01.md): batch noise alone puts the
# spike of every optimizer's long run within a few hundredths of AdamW's.
SPIKE_TOLERANCE = 0.02


def host_scale_entries(doc: dict, summary: dict) -> list[dict]:
    """The quality table's ``host_lr_scale`` entries (:mod:`zenflow_triton.autotune.quality`): per overlap mode and
    scale s != 1, each task's best loss with s over the best loss with 1.0, the largest ratio of their mean losses
    at one lr of the grid, and whether it stayed stable (every run finite, and the long task's spike within
    :data:`SPIKE_TOLERANCE` of 1.0's)."""
    entries = []
    tasks = [t["name"] for t in doc["tasks"] if t["name"] in summary]
    plain = [c for c in doc["configs"]
             if not c.get("warmup_steps") and not c.get("select_interval") and not c.get("overlap_steps")]
    for c in plain:
        if c["overlap"] is None or c["host_lr_scale"] == 1.0:
            continue
        base = next((b["name"] for b in plain if b["overlap"] == c["overlap"] and b["host_lr_scale"] == 1.0), None)
        if base is None or not tasks or any(n not in summary[t]["configs"] for t in tasks for n in (c["name"], base)):
            continue
        rows = [summary[t]["configs"] for t in tasks]
        finite = all(run["loss"] is not None for t in tasks for by_seed in doc["runs"][t][c["name"]].values()
                     for run in by_seed.values())
        spiky = any(r[c["name"]]["spike_at_best"] > r[base]["spike_at_best"] + SPIKE_TOLERANCE
                    for t, r in zip(tasks, rows) if t == "long")
        entries.append({
            "topk_ratio": doc["topk_ratio"], "update_interval": doc["update_interval"], "overlap": c["overlap"],
            "host_lr_scale": c["host_lr_scale"],
            "ratio": [round(r[c["name"]]["best_loss"] / r[base]["best_loss"], 4) for r in rows],
            "equal_lr_worst": [round(max(_mean_loss(doc, t, c["name"], lr, summary[t]["seeds"])
                                         / _mean_loss(doc, t, base, lr, summary[t]["seeds"])
                                         for lr in summary[t]["configs"][c["name"]]["equal_lr"]
                                         if lr in summary[t]["configs"][base]["equal_lr"]), 4)
                               for t, task in ((t["name"], t) for t in doc["tasks"] if t["name"] in summary)],
            "stable": finite and not spiky, "tasks": tasks,
            "source": f"bench/quality_fair.py, {_dates(doc)}: best held-out loss over lrs "
                      f"{sorted({float(k) for t in tasks for k, v in doc['runs'][t][c['name']].items() if v})}, "
                      "mean over seeds",
        })
    return entries


def _added_where(a: dict) -> str:
    parts = []
    if a.get("lrs"):
        parts.append(f" at lrs {', '.join(f'{x:g}' for x in a['lrs'])}")
    if a.get("tasks"):
        parts.append(f" on {', '.join(a['tasks'])}")
    return "".join(parts)


def _dates(doc: dict) -> str:
    first, last = doc["measured"]["date"], ([a.get("date") for a in doc["measured"].get("added", [])] or [None])[-1]
    return first if last in (None, first) else f"{first} to {last}"


def is_defaults(doc: dict, c: dict) -> bool:
    """Whether configuration ``c`` of ``doc`` is ``ZenFlowAdamW(params, lr=...)``'s defaults on CPU tensors (where
    ``overlap_steps="auto"`` is 1)."""
    cfg = ZenFlowConfig()
    cpu = cfg.without_planning("cpu")
    u = doc["update_interval"]
    return (c.get("overlap") is cfg.overlap and not c.get("late") and c["host_lr_scale"] == cfg.host_lr_scale
            and (c.get("topk_ratio") or doc["topk_ratio"]) == cfg.topk_ratio and u == cfg.update_interval
            and c.get("warmup_steps", 0) == cfg.warmup_steps and (c.get("overlap_steps") or u) == cpu.overlap_steps
            and (c.get("select_interval") or 8 * u) == cfg.resolved_select_interval())


def defaults_lines(doc: dict, summary: dict) -> list[str]:
    """One line per task: the defaults' best mean loss over AdamW's best, each at its best lr of the grid."""
    name = next((c["name"] for c in doc["configs"] if is_defaults(doc, c)), None)
    out = []
    for t in (t["name"] for t in doc["tasks"]):
        row = summary.get(t, {}).get("configs", {}).get(name or "")
        if row is None:
            continue
        lo, hi = row["best_to_best_seeds"]
        out.append(f"- {t}: {row['best_to_best']:.3f} ({lo:.3f}-{hi:.3f} over seeds), lr {row['best_lr']:g} vs "
                   f"AdamW's {summary[t]['adamw_best_lr']:g}")
    return out


def render(doc: dict, summary: dict) -> str:
    m = doc["measured"]
    loads = m.get("load_average", [])
    lines = [
        "# Training quality at each optimizer's best lr (bench/quality_fair.py)",
        "",
        f"- date: {m['date']}; revision {m.get('revision')}; {m.get('machine')}; torch {m.get('torch')}, "
        f"python {m.get('python')}; {m.get('threads')}",
        f"- wall {m.get('wall_s', 0):.0f} s; load average (1 min) from {min(loads, default=0):.1f} to "
        f"{max(loads, default=0):.1f} over the run",
        f"- command: `{doc['command']}`",
        *(f"- added {', '.join(a['configs']) or 'runs'}{_added_where(a)}: {a.get('date')}, revision "
          f"{a.get('revision')}, wall "
          f"{a.get('wall_s') or 0:.0f} s, load average {min(a.get('load_average') or [0]):.1f}-"
          f"{max(a.get('load_average') or [0]):.1f}; "
          + ("AdamW's runs reused (a rerun reproduced them exactly)" if a.get("adamw_rerun_equal", True)
             else "a run of its own, at the same time, joined with --merge")
          for a in m.get("added", [])),
        f"- ZenFlow: topk_ratio {doc['topk_ratio']:g}, update_interval {doc['update_interval']}, select_interval "
        f"{doc['select_interval']} (in a name, S=N: select_interval N; warm=N: warmup_steps N); batch {doc['batch']}, "
        f"weight decay {doc['weight_decay']:g}",
        "- best-to-best: a configuration's lowest mean held-out loss over the lr grid / AdamW's, (min-max) over seeds "
        "of the per-seed ratio, each at its own best lr. Equal lr: mean (min-max) of the per-seed ratio at that lr. "
        "Spike: the smoothed training loss's largest relative rise above its running minimum after the first 10% "
        "of the steps (max over seeds; at the best lr / over the whole grid). `*`: the best lr is at an edge of "
        "the grid.",
        "",
    ]
    ours = defaults_lines(doc, summary)
    if ours:
        lines += ["## The defaults: best loss over AdamW's best, each at its best lr", "",
                  f"`{next(c['name'] for c in doc['configs'] if is_defaults(doc, c))}` is `ZenFlowAdamW(params, "
                  "lr=...)` on CPU tensors (`overlap_steps=\"auto\"` is 1 there)", "", *ours, ""]
    for task in doc["tasks"]:
        t = task["name"]
        if t not in summary:
            continue
        s = summary[t]
        lrs = [f"{lr:g}" for lr in task["lrs"]]
        lines += [f"## {t}: {task['what']}", "",
                  f"seeds {s['seeds']}; AdamW's best lr {s['adamw_best_lr']:g}", "",
                  "| optimizer | best lr | best loss | best-to-best | " + " | ".join(f"ratio @ {k}" for k in lrs)
                  + " | spike best / any |",
                  "|---|---|---|---|" + "---|" * len(lrs) + "---|"]
        for name, r in s["configs"].items():
            lo, hi = r["best_to_best_seeds"]
            cells = [f"{v[0]:.3f} ({v[1]:.3f}-{v[2]:.3f})" if v else "-" for v in (r["equal_lr"].get(k) for k in lrs)]
            lines.append(f"| {name} | {r['best_lr']:g}{'*' if r['best_at_grid_edge'] else ''} | {r['best_loss']:.4f}"
                         f" | {r['best_to_best']:.3f} ({lo:.3f}-{hi:.3f}) | " + " | ".join(cells)
                         + f" | {r['spike_at_best']:.3f} / {r['spike_any_lr']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write OUT.json (after every task and seed) and OUT.md")
    parser.add_argument("--report", type=Path, help="only rebuild the Markdown from this JSON (to stdout)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="join runs on different tasks (same configurations, e.g. run in parallel) into --out")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--long-seeds", type=int, default=2, help="seeds of the long task (the first N of --seeds)")
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 2.0], help="host_lr_scale values")
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3, 4e-3])
    parser.add_argument("--long-lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3])
    parser.add_argument("--long-steps", type=int, default=1000)
    parser.add_argument("--arith-lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3, 8e-3])
    parser.add_argument("--shift-lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3, 4e-3])
    parser.add_argument("--tasks", nargs="+", choices=["finetune", "scratch", "long", "arith", "shift"],
                        help="default: all five (with --add-to: its tasks)")
    parser.add_argument("--topk-ratio", type=float, default=0.1)
    parser.add_argument("--update-interval", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (also ZENFLOW_BENCH_SMOKE=1)")
    parser.add_argument("--table", type=Path, metavar="QUALITY_JSON",
                        help="write the measured host_lr_scale entries into this quality table (the autotuner's; "
                             "with --report: from that JSON)")
    parser.add_argument("--warmups", type=int, nargs="+", default=[0], help="warmup_steps values")
    parser.add_argument("--select-intervals", type=int, nargs="+", default=[0],
                        help="select_interval values (0: the default, 8 U)")
    parser.add_argument("--overlaps", nargs="+", choices=["on", "off"], default=["on", "off"])
    parser.add_argument("--overlap-steps", type=int, nargs="+", default=[0],
                        help="overlap_steps values for the overlap configurations (0: the default, U; in a name K=N)")
    parser.add_argument("--topk-ratios", type=float, nargs="+", default=[0],
                        help="per-configuration topk_ratio values (0: --topk-ratio; in a name r=X)")
    parser.add_argument("--late", action="store_true",
                        help=f"also run '{LATE}': torch AdamW whose offloadable matrices hold the master of one update "
                             "before (bench/late_adamw.py), the staleness of overlap=True alone")
    parser.add_argument("--add-to", type=Path, metavar="JSON",
                        help="measure only the runs of AdamW and the configurations given (--scales x --warmups x "
                             "--select-intervals x --overlaps x --overlap-steps, and --late) that JSON lacks, on its "
                             "seeds and on --tasks (default its tasks) at its lrs plus --add-lrs (or at --at-lrs only),"
                             " and write JSON plus them to --out (its AdamW runs are reused: they are deterministic, "
                             "which one rerun checks)")
    parser.add_argument("--add-lrs", type=float, nargs="+", default=[], help="with --add-to: lrs added to the grid")
    parser.add_argument("--at-lrs", type=float, nargs="+", help="with --add-to: run only at these lrs")
    parser.add_argument("--skip-adamw", action="store_true",
                        help="with --add-to: no AdamW runs at the new lrs (where its best is inside the old grid)")
    args = parser.parse_args(argv)
    if args.report is not None:
        doc = json.loads(args.report.read_text())
        print(render(doc, summarize(doc)))
        if args.table is not None:
            _write_table(args.table, doc)
        return 0
    if args.out is None:
        parser.error("--out is required unless --report is given")
    if args.merge:
        doc = merge([json.loads(p.read_text()) for p in args.merge])
        args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(render(doc, summarize(doc)) + "\n")
        print(render(doc, summarize(doc)))
        return 0
    torch.set_num_threads(1)
    smoke = args.smoke or SMOKE
    task_list = [t for t in tasks(smoke=smoke, lrs=args.lrs, long_lrs=args.long_lrs, long_steps=args.long_steps,
                                  arith_lrs=args.arith_lrs, shift_lrs=args.shift_lrs)
                 if args.tasks is None or t.name in args.tasks]
    seeds = args.seeds[:1] if smoke else args.seeds
    command = "nice -n 10 python bench/quality_fair.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    json_path, md_path = args.out.with_suffix(".json"), args.out.with_suffix(".md")

    def save(doc: dict) -> None:
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
        md_path.write_text(render(doc, summarize(doc)) + "\n")

    wanted = configs(args.scales, args.warmups, args.select_intervals, [x == "on" for x in args.overlaps], args.late,
                     args.overlap_steps, args.topk_ratios)
    if args.add_to is not None:
        doc = add_runs(json.loads(args.add_to.read_text()), wanted, command=command, task_names=args.tasks,
                       add_lrs=args.add_lrs, at_lrs=args.at_lrs, adamw_runs=not args.skip_adamw, save=save)
    else:
        # The long task runs fewer seeds: it costs 5x a short one.
        per_task = {t.name: seeds[:args.long_seeds] if t.name == "long" else seeds for t in task_list}
        doc = measure(task_list=task_list, config_list=wanted, seeds=per_task,
                      topk_ratio=args.topk_ratio, update_interval=args.update_interval, command=command, save=save,
                      progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(render(doc, summarize(doc)))
    if args.table is not None:
        _write_table(args.table, doc)
    return 0


def merge(docs: Sequence[dict]) -> dict:
    """The first of ``docs`` with the tasks of the others (same configurations, ZenFlow knobs and seeds; disjoint
    tasks), each other's record listed as an addition."""
    doc = json.loads(json.dumps(docs[0]))
    for other in docs[1:]:
        if ([c["name"] for c in other["configs"]] != [c["name"] for c in doc["configs"]]
                or (other["topk_ratio"], other["update_interval"]) != (doc["topk_ratio"], doc["update_interval"])):
            raise ValueError("merge: the runs differ in configurations or knobs")
        names = [t["name"] for t in other["tasks"]]
        if set(names) & {t["name"] for t in doc["tasks"]}:
            raise ValueError(f"merge: tasks {names} are in both")
        doc["tasks"] += other["tasks"]
        doc["runs"].update(other["runs"])
        doc["seeds"] = sorted(set(doc["seeds"]) | set(other["seeds"]))
        doc["command"] += f" ; {other['command']}"
        m = other["measured"]
        doc["measured"].setdefault("added", []).append({
            "configs": [c["name"] for c in other["configs"]], "tasks": names, "date": m["date"],
            "adamw_rerun_equal": False,
            "revision": m["revision"], "wall_s": m.get("wall_s"), "load_average": m["load_average"]})
    return doc


def _write_table(path: Path, doc: dict) -> None:
    """Replace the quality table's host_lr_scale entries with this run's (validated as the autotuner reads them)."""
    table = json.loads(path.read_text())
    table["host_lr_scale"] = host_scale_entries(doc, summarize(doc))
    QualityTable.from_dict(table, source=str(path))
    path.write_text(json.dumps(table, indent=1) + "\n")


def add_runs(prev: dict, wanted: Sequence[Config], *, command: str, task_names: Sequence[str] | None = None,
             add_lrs: Sequence[float] = (), at_lrs: Sequence[float] | None = None, adamw_runs: bool = True,
             save: Callable[[dict], None] | None = None) -> dict:
    """``prev`` plus the runs of ``wanted`` (and AdamW) it lacks, on its seeds: on ``task_names`` (default: all of
    its tasks), whose lr grids gain ``add_lrs``, at ``at_lrs`` only if given. Configurations of ``prev`` not in
    ``wanted`` are not run at the new lrs (the summary judges each at the lrs it has), nor is AdamW unless
    ``adamw_runs``. AdamW's runs are reused (CPU, one thread: deterministic), which one rerun checks."""
    names = task_names or [t["name"] for t in prev["tasks"]]
    doc = json.loads(json.dumps(prev))
    known = {c["name"] for c in doc["configs"]}
    doc["configs"] += [dict(c.__dict__) for c in wanted if c.name not in known and not c.is_adamw]
    for t in doc["tasks"]:
        if t["name"] in names:
            t["lrs"] = sorted(set(t["lrs"]) | {float(x) for x in add_lrs})
        for c in doc["configs"]:
            doc["runs"].setdefault(t["name"], {}).setdefault(c["name"], {})
    task_list = [Task(**dict(t, lrs=tuple(t["lrs"]))) for t in doc["tasks"] if t["name"] in names]
    adamw = doc["configs"][0]["name"]
    # An lr AdamW was run at (the grid may have gained lrs it was skipped at: --skip-adamw).
    old_lr = {t["name"]: next(k for k in (f"{x:g}" for x in t["lrs"]) if prev["runs"][t["name"]][adamw].get(k))
              for t in prev["tasks"]}
    seeds = {t.name: sorted(int(s) for s in prev["runs"][t.name][adamw][old_lr[t.name]]) for t in task_list}
    run_names = {c.name for c in wanted if adamw_runs or not c.is_adamw}
    at = None if at_lrs is None else {f"{x:g}" for x in at_lrs}

    def skip(task: str, config: str, lr: float, seed: int) -> bool:
        key = f"{lr:g}"
        return (config not in run_names or (at is not None and key not in at)
                or str(seed) in doc["runs"][task][config].get(key, {}))

    # AdamW reproduces: rerun its cheapest old cell (the first task without pretraining if any).
    check_task = min(task_list, key=lambda t: (t.pretrain_steps > 0, t.steps))
    lr, seed = old_lr[check_task.name], seeds[check_task.name][0]
    check = measure(task_list=[dataclasses.replace(check_task, lrs=(float(lr),))], config_list=[Config(adamw)],
                    seeds={check_task.name: [seed]}, topk_ratio=doc["topk_ratio"],
                    update_interval=doc["update_interval"], command=command, progress=lambda m: None)
    again = check["runs"][check_task.name][adamw][lr][str(seed)]["loss"]
    before = prev["runs"][check_task.name][adamw][lr][str(seed)]["loss"]
    if again != before:
        raise RuntimeError(f"AdamW does not reproduce {before} ({again}): cannot reuse its runs")
    doc["command"] = f"{prev['command']} && {command}"
    all_configs = [Config(**c) for c in doc["configs"]]
    measured = [c.name for c in all_configs
                if any(not skip(t.name, c.name, x, s) for t in task_list for x in t.lrs for s in seeds[t.name])]
    added = {"configs": measured, "adamw_rerun_equal": True, "tasks": list(names),
             "lrs": sorted({x for t in task_list for x in t.lrs if at is None or f"{x:g}" in at})}
    doc["measured"].setdefault("added", []).append(added)

    def merge(part: dict) -> None:
        for t, by_config in part["runs"].items():
            for name, runs in by_config.items():
                for k, by_seed in runs.items():
                    doc["runs"][t][name].setdefault(k, {}).update(by_seed)
        added.update(revision=part["measured"]["revision"], date=part["measured"]["date"],
                     wall_s=part["measured"].get("wall_s"), load_average=part["measured"]["load_average"])
        if save is not None:
            save(doc)

    measure(task_list=task_list, config_list=[c for c in all_configs if c.name in measured], seeds=seeds,
            topk_ratio=doc["topk_ratio"], update_interval=doc["update_interval"], command=command, save=merge,
            progress=lambda msg: print(msg, file=sys.stderr, flush=True), skip=skip)
    return doc


if __name__ == "__main__":
    sys.exit(main())
