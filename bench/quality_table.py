"""Measure the quality side of the autotuner: held-out loss of ZenFlowAdamW over AdamW's, at equal steps.

The task is the demo's fine-tune (:mod:`zenflow_triton.demo.charlm`): the byte-level transformer (CharLMConfig
defaults: 0.14M parameters, 99% of them offloaded) pretrained 800 steps on standard-library source, then fine-tuned
on the pydoc topics from the same weights with AdamW and with ZenFlowAdamW at every ``(topk_ratio, update_interval)``
of the grid (``overlap=True``, the default ``select_interval = 8 U``), on the same batches, with the same
hyperparameters (lr 1e-3, weight decay 0.01, batch 8, 200 steps: tests/test_convergence.py's run). The entry is the
held-out loss after ``flush()`` over AdamW's held-out loss, for each batch seed. The pretrained weights are the
same for every seed: a seed changes the order and choice of the fine-tuning batches only.

Everything runs on one core (``torch.set_num_threads(1)``, ``cpu_threads=1``): the losses do not depend on thread
counts (DESIGN §3), and the machine this was written on has two cores shared with other work. Measured there: 3 s
per fine-tune on an idle core, 4-6 s with other jobs on the machine; the default grid (5 x 5 points, 5 seeds, plus
AdamW per seed: 130 fine-tunes) took 599 s at load averages 1.3-4.1::

    nice -n 10 python bench/quality_table.py --out autotune/quality_charlm.json --seeds 1 2 3 4 5

The result is the table :mod:`zenflow_triton.autotune.quality` ships and the autotuner plans with; pass your own
with ``python -m zenflow_triton.autotune --quality-table PATH`` (format: that module's docstring).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.autotune.quality import SCHEMA_VERSION, QualityTable
from zenflow_triton.demo.charlm import (
    CharLMConfig,
    evaluate,
    load_corpora,
    make_model,
    offloadable_numel,
    pretrained_state,
    train,
)

__all__ = ["main", "measure"]

LR = 1e-3
WEIGHT_DECAY = 0.01


def _finetune(state: dict[str, torch.Tensor] | None, cfg: CharLMConfig, *, steps: int, batch: int, seed: int,
              topk_ratio: float | None, update_interval: int | None, lr: float = LR) -> float:
    """Held-out loss after fine-tuning from ``state`` (None: from the fresh initialisation of ``seed``); AdamW when
    ``topk_ratio`` is None."""
    corpora = load_corpora()
    model = make_model(cfg, seed=seed if state is None else 0)
    if state is not None:
        model.load_state_dict(state)
    if topk_ratio is None:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
        train(model, opt, corpora.finetune_train, steps=steps, batch=batch, seed=seed)
        return evaluate(model, corpora.finetune_val)
    # The table is ZenFlow's steady state from step 1 (no warm-up, merged at the next window end), as measured.
    zen = ZenFlowAdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, topk_ratio=topk_ratio,
                       update_interval=update_interval, overlap=True, cpu_threads=1, warmup_steps=0,
                       overlap_steps=None)
    try:
        train(model, zen, corpora.finetune_train, steps=steps, batch=batch, seed=seed)
        zen.flush()  # overlap=True: the last window's host result reaches the model one window late
        return evaluate(model, corpora.finetune_val)
    finally:
        zen.close()


def _revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def measure(*, topk_ratios: list[float], update_intervals: list[int], seeds: list[int], steps: int, batch: int,
            pretrain_steps: int, command: str, progress=print, lr: float = LR) -> dict:
    """Run the grid and return the table as a plain dict (the JSON shipped in ``autotune/``); ``pretrain_steps``
    0: from scratch (the ``scratch`` regime: each seed also picks the initialisation)."""
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    cfg = CharLMConfig()
    offloaded, total = offloadable_numel(make_model(cfg))
    state = pretrained_state(cfg, steps=pretrain_steps) if pretrain_steps else None
    progress(f"pretrained ({pretrain_steps} steps) in {time.perf_counter() - started:.0f} s")
    adamw: list[float] = []
    losses = [[[0.0] * len(seeds) for _ in update_intervals] for _ in topk_ratios]
    for k, seed in enumerate(seeds):
        adamw.append(_finetune(state, cfg, steps=steps, batch=batch, seed=seed, topk_ratio=None,
                               update_interval=None, lr=lr))
        for i, r in enumerate(topk_ratios):
            for j, u in enumerate(update_intervals):
                losses[i][j][k] = _finetune(state, cfg, steps=steps, batch=batch, seed=seed, topk_ratio=r,
                                            update_interval=u, lr=lr)
            progress(f"seed {seed}: AdamW {adamw[k]:.4f}; r={r:g}: "
                     + " ".join(f"U={u}:{losses[i][j][k] / adamw[k]:.3f}" for j, u in enumerate(update_intervals))
                     + f"  [{time.perf_counter() - started:.0f} s]")
    wall = time.perf_counter() - started
    start = (f"pretrained {pretrain_steps} steps on stdlib source, fine-tuned" if pretrain_steps
             else "from scratch (each seed its own initialisation),")
    return {
        "schema": SCHEMA_VERSION,
        "task": (f"demo {'fine-tune' if pretrain_steps else 'model from scratch'}: CharLM {cfg.n_layer}x{cfg.d_model} "
                 f"({total / 1e6:.2f}M params, {offloaded / total:.0%} offloaded), {start} {steps} steps x batch "
                 f"{batch} on pydoc topics, lr {lr:g}, AdamW weight decay {WEIGHT_DECAY:g}; overlap=True, "
                 "select_interval=8U, no warm-up"),
        "metric": "held-out loss after flush() / AdamW's held-out loss, same steps, same batches",
        "command": command,
        "topk_ratios": topk_ratios,
        "update_intervals": update_intervals,
        "seeds": seeds,
        "adamw_loss": adamw,
        "loss": losses,
        "measured": {
            "date": datetime.date.today().isoformat(),
            "revision": _revision(),
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "wall_s": round(wall, 1),
            "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)],
            "threads": "torch.set_num_threads(1), ZenFlowAdamW(cpu_threads=1)",
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the table (JSON)")
    parser.add_argument("--topk-ratios", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.25, 0.5])
    parser.add_argument("--update-intervals", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5],
                        help="fine-tuning batch seeds (default 1-5)")
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps per run (default 200)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pretrain-steps", type=int, default=800)
    parser.add_argument("--regime", choices=["finetune", "scratch"], default="finetune",
                        help="finetune: the table's top level (pretrained --pretrain-steps); scratch: its "
                             "regimes.scratch entry, from a fresh initialisation at --lr (default 2e-3 there, AdamW's "
                             "best on that task in bench/quality_fair.py)")
    parser.add_argument("--lr", type=float, help=f"default {LR:g} (finetune), 2e-3 (scratch)")
    args = parser.parse_args(argv)
    scratch = args.regime == "scratch"
    lr = args.lr if args.lr is not None else 2e-3 if scratch else LR
    torch.set_num_threads(1)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    command = "nice -n 10 python bench/quality_table.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    doc = measure(topk_ratios=sorted(args.topk_ratios), update_intervals=sorted(args.update_intervals),
                  seeds=args.seeds, steps=args.steps, batch=args.batch,
                  pretrain_steps=0 if scratch else args.pretrain_steps, command=command, progress=progress, lr=lr)
    if scratch:
        # The from-scratch grid is one regime of the table at --out: its other entries stay as they are.
        whole = json.loads(args.out.read_text())
        whole.setdefault("regimes", {})["scratch"] = {k: v for k, v in doc.items() if k != "schema"}
        QualityTable.from_dict(whole, source=str(args.out))
        args.out.write_text(json.dumps(whole, indent=1) + "\n")
        print(QualityTable.from_dict(doc).render())
        return 0
    if args.out.exists():
        # The host_lr_scale entries come from bench/quality_fair.py --table, not from this grid: keep them.
        old = json.loads(args.out.read_text())
        for key in ("host_lr_scale", "regimes"):  # measured by other runs (quality_fair.py --table, --regime)
            if old.get(key):
                doc[key] = old[key]
    table = QualityTable.from_dict(doc, source=str(args.out))  # validates what is about to be shipped
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table.render())
    rs = [table.ratio_spread(r, u) for r in table.topk_ratios for u in table.update_intervals]
    print(f"median spread (max - min over seeds): {statistics.median(hi - lo for lo, hi in rs):.4f}; "
          f"wall {doc['measured']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
