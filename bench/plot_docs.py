"""The figures and generated tables of README.md and docs/: memory per mode and the quality bench's loss curves.

    python bench/plot_docs.py memory --out bench/results/memory-DATE [--png docs/memory.png] [--steps 13]
    python bench/plot_docs.py quality --json bench/results/quality-fair-2026-12-02.json [--png docs/quality.png]

``memory`` measures, on CPU tensors (or CUDA where present), each mode's device bytes per parameter held and at
peak (``report_memory.measure``: the same 4 x [1024, 1024] MLP, r = 0.1, U = 4) and its host bytes per parameter
(``stats()["host_bytes_per_param"]`` after the same steps), writes OUT.json and OUT.md (the memory table and the
largest model per machine, ours beside the peers' host bytes) and draws the bf16 rows beside the peers.
``quality`` reads a ``bench/quality_fair.py`` JSON (every run keeps a 50-point training-loss curve), draws, per
task, AdamW, the defaults and the tuned settings, each at its own best lr, mean over seeds, and prints the
best-to-best table of docs/quality.md. Needs matplotlib (the
``plot`` extra).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

# The peers' host bytes per parameter, the machines of the largest-model table and the usable shares of each memory
# are the autotuner's capacity answer's (autotune/capacity.py): one table, one rule.
from zenflow_triton.autotune.capacity import GPU_USABLE, HOST_USABLE, MACHINES, PEERS_HOST, largest

ROOT = Path(__file__).resolve().parent.parent

# The curves drawn per task: AdamW, ZenFlowAdamW's defaults on CPU tensors (warmup_steps=100, overlap_steps="auto"
# = 1), and the selection from step 1 merged at the next window end (warmup_steps=0, overlap_steps=None), as
# quality_fair.py names them.
CURVES = {"AdamW": "AdamW", "ZenFlow overlap s=1 warm=100 K=1": "ZenFlowAdamW defaults",
          "ZenFlow overlap s=1": "warmup_steps=0, overlap_steps=None"}
# report_memory's optimizer names as the docs' tables show them, so a table pastes from the record unchanged; a
# variant's suffixes (", bf16 moments", ", overlap_steps=1") as the knobs that make it.
DISPLAY = {"torch AdamW": "`torch.optim.AdamW`", "ZenFlow device": 'ZenFlowAdamW `accumulate="device"`',
           "ZenFlow host": 'ZenFlowAdamW `accumulate="host"`',
           "ZenFlow host + grads_in_backward": 'ZenFlowAdamW `"host"` + `grads_in_backward`',
           "bf16 moments": '`state_dtype="bfloat16"`', "overlap_steps=1": "`overlap_steps=1`",
           "host_snapshot=False": "`host_snapshot=False`"}


def display(name: str) -> str:
    return ", ".join(DISPLAY.get(part, part) for part in name.split(", "))
# Column and panel titles of the tasks (others: "NAME, STEPS steps").
TASK_TITLES = {"finetune": "fine-tune, 200 steps", "scratch": "from scratch, 200 steps",
               "long": "from scratch, 1000 steps", "arith": "arithmetic from scratch, 300 steps",
               "shift": "domain shift, 200 steps"}


def _revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit("bench/plot_docs.py needs matplotlib: pip install -e \".[plot]\"")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------------- memory


def measure_memory(*, steps: int, device: str) -> list[dict]:
    """One row per (model dtype, optimizer): device held/peak B/param and host B/param. For a bf16 model also each
    ZenFlowAdamW mode with bf16 moments, accumulate="host" at overlap_steps=1 (one window sum), and each mode at its
    leanest without the host snapshot (report_memory.bf16_optimizers)."""
    import torch
    from report_memory import bf16_optimizers, measure, mlp, optimizers

    bf16 = bf16_optimizers()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, make in (bf16 if dtype == torch.bfloat16 else optimizers()).items():
            fig = measure(make, dtype=dtype, device=device, steps=steps)
            model = mlp(4, 1024, dtype, device)
            opt = make(model)
            host = 0.0
            if hasattr(opt, "stats"):
                for _ in range(5):
                    opt.zero_grad()
                    model(torch.randn(64, 1024, device=device, dtype=dtype)).float().pow(2).mean().backward()
                    opt.step()
                host = opt.stats()["host_bytes_per_param"]
                opt.close()
            rows.append({"optimizer": name, "model": str(dtype).removeprefix("torch."), "device_held": fig.held,
                         "device_peak": fig.peak, "host": host})
    return rows


def largest_models(rows: list[dict]) -> list[dict]:
    """Billions of bf16 parameters whose training state fits both memories (:func:`capacity.largest`: min over GPU
    and host), from the measured rows; the peers from their host bytes."""
    out = []
    for r in rows:
        if r["model"] != "bfloat16":
            continue
        fits = [largest(r["device_held"], r["host"], gpu, host) for _, gpu, host in MACHINES]
        out.append({"optimizer": display(r["optimizer"]),
                    "fits": [(n / 1e9, why) for n, why in fits]})
    for name, host_b in PEERS_HOST.items():
        out.append({"optimizer": f"{name} ({host_b:g} host B/param)",
                    "fits": [(n / 1e9, why) for n, why in (largest(0.0, host_b, gpu, host)
                                                          for _, gpu, host in MACHINES)]})
    return out


def render_memory(doc: dict) -> str:
    lines = [f"# Memory per mode (bench/plot_docs.py memory), {doc['date']}", "",
             f"- command: `{doc['command']}`", f"- machine: {doc['machine']}; revision {doc['revision']}",
             f"- model: {doc['model']}", "", "| optimizer | model | device held B/param | device peak B/param | "
             "host B/param |", "|---|---|---:|---:|---:|"]
    for r in doc["rows"]:
        host = f"{r['host']:.1f}" if r["host"] else "–"
        name = display(r["optimizer"])
        lines.append(f"| {name} | {r['model']} | {r['device_held']:.2f} | {r['device_peak']:.2f} | {host} |")
    lines += ["", f"Largest bf16 model whose training state fits, billions of parameters ({GPU_USABLE:.0%} of the "
              f"GPU and {HOST_USABLE:.0%} of the host usable; ours from the held figures above, the peers from "
              "their host bytes only; the bound that binds in brackets):", "",
              "| optimizer | " + " | ".join(m[0] for m in MACHINES) + " |", "|---|" + "---:|" * len(MACHINES)]
    for row in largest_models(doc["rows"]):
        lines.append(f"| {row['optimizer']} | " + " | ".join(f"{b:.1f} ({why})" for b, why in row["fits"]) + " |")
    return "\n".join(lines) + "\n"


def plot_memory(rows: list[dict], png: Path) -> None:
    plt = _pyplot()
    bf16 = [r for r in rows if r["model"] == "bfloat16"]
    # The knobs' names shortened for the axis; the tables spell them out.
    names = [display(r["optimizer"]).replace("`", "").replace("ZenFlowAdamW ", "ZenFlow ")
             .replace('state_dtype="bfloat16"', "bf16 moments") for r in bf16]
    names += [name.replace("`", "") for name in PEERS_HOST]
    device = [r["device_held"] for r in bf16] + [0.0] * len(PEERS_HOST)
    host = [r["host"] for r in bf16] + list(PEERS_HOST.values())
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.26 * len(names)), dpi=90)
    ys = range(len(names))
    ax.barh([y - 0.2 for y in ys], device, height=0.4, label="device, held (measured)", color="#1f77b4")
    ax.barh([y + 0.2 for y in ys], host, height=0.4, color="#ff7f0e",
            label="host (ours: stats(); peers: from their code, device not drawn)")
    for y, d, h in zip(ys, device, host):
        if d:
            ax.text(d + 0.3, y - 0.2, f"{d:.1f}", va="center", fontsize=7)
        if h:
            ax.text(h + 0.3, y + 0.2, f"{h:.1f}", va="center", fontsize=7)
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("bytes per parameter, bf16 model (r = 0.1)")
    ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Memory per mode: ZenFlowAdamW beside torch AdamW and the offloading peers", fontsize=9)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- quality


def best_curve(doc: dict, task: str, config: str) -> tuple[str, list[float]]:
    """The config's best lr on the task (lowest mean held-out loss over its seeds) and its mean training curve."""
    runs = doc["runs"][task][config]
    best = min(runs, key=lambda lr: statistics.fmean(r["loss"] for r in runs[lr].values()))
    curves = [r["curve"] for r in runs[best].values()]
    return best, [statistics.fmean(points) for points in zip(*curves)]


def _task_title(task: dict) -> str:
    return TASK_TITLES.get(task["name"], f"{task['name']}, {task['steps']} steps")


def plot_quality(doc: dict, png: Path) -> None:
    """One panel per task of the JSON (three to a row); a curve whose configuration did not run on a task is left
    out of that panel."""
    plt = _pyplot()
    tasks = [t for t in doc["tasks"] if t["name"] in doc["runs"]]
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(10, 3.2 * rows), dpi=90, squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        curves = []
        for config, label in CURVES.items():
            if not doc["runs"][task["name"]].get(config):
                continue
            lr, curve = best_curve(doc, task["name"], config)
            xs = [(i + 0.5) * task["steps"] / len(curve) for i in range(len(curve))]
            ax.plot(xs, curve, label=f"{label} (lr {float(lr):g})", linewidth=1.2)
            curves.append(curve)
        # Zoom past the first tenth of the run, where every optimizer drops fast: the gaps are in the tail.
        tenth = len(curves[0]) // 10
        ax.set_ylim(0.98 * min(min(c) for c in curves), max(c[tenth] for c in curves))
        ax.set_title(_task_title(task), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel("training loss (mean over seeds)", fontsize=8)
    fig.suptitle(f"Training loss at each optimizer's best lr (r = {doc['topk_ratio']:g}, U = "
                 f"{doc['update_interval']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def _config_label(doc: dict, c: dict) -> str:
    """A quality_fair.py configuration as the docs name it: its knobs as the run passed them."""
    from quality_fair import is_defaults

    if c.get("late"):
        return "AdamW one update late (`--late`: overlap's delay alone)"
    if c.get("overlap") is None:
        return "AdamW"
    parts = [f"ZenFlow {'overlap' if c['overlap'] else 'sequential'}, s = {c['host_lr_scale']:g}"]
    if is_defaults(doc, c):
        parts[0] += " (default)"
    parts += [f"`{k}={c[k]}`" for k in ("warmup_steps", "select_interval", "overlap_steps", "topk_ratio")
              if c.get(k)]
    return ", ".join(parts)


def quality_table(doc: dict) -> str:
    """The best-to-best table of docs/quality.md: per configuration and task, the best mean held-out loss over
    AdamW's best, (min-max) over seeds, and the best lr (`*`: at an edge of the lrs it ran at)."""
    from quality_fair import summarize

    summary = summarize(doc)
    titles = {t["name"]: _task_title(t) for t in doc["tasks"]}
    tasks = [t for t in titles if t in summary]
    lines = ["| optimizer | " + " | ".join(titles[t] for t in tasks) + " |", "|---|" + "---|" * len(tasks)]
    for c in doc["configs"]:
        cells = []
        for t in tasks:
            row = summary[t]["configs"].get(c["name"])
            if row is None:
                cells.append("-")
            elif c.get("overlap") is None and not c.get("late"):
                cells.append(f"1.000, lr {row['best_lr']:.0e}".replace("e-0", "e-"))
            else:
                lo, hi = row["best_to_best_seeds"]
                lr = f"{row['best_lr']:.0e}".replace("e-0", "e-") + ("*" if row["best_at_grid_edge"] else "")
                cells.append(f"{row['best_to_best']:.3f} ({lo:.3f}-{hi:.3f}), {lr}")
        lines.append(f"| {_config_label(doc, c)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    mem = sub.add_parser("memory", help="measure bytes per parameter per mode; write OUT.json, OUT.md and the PNG")
    mem.add_argument("--out", type=Path, required=True, help="record path without suffix (bench/results/memory-DATE)")
    mem.add_argument("--png", type=Path, default=ROOT / "docs" / "memory.png")
    mem.add_argument("--steps", type=int, default=13)
    mem.add_argument("--device", default=None, help="cpu or cuda (default: cuda where present)")
    qual = sub.add_parser("quality", help="draw the loss curves of a quality_fair.py JSON")
    qual.add_argument("--json", type=Path, required=True)
    qual.add_argument("--png", type=Path, default=ROOT / "docs" / "quality.png")
    args = ap.parse_args(argv)
    command = "python bench/plot_docs.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.what == "quality":
        doc = json.loads(args.json.read_text(encoding="utf-8"))
        plot_quality(doc, args.png)
        print(quality_table(doc))
        print(f"wrote {args.png}")
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    doc = {"what": "device and host bytes per parameter per mode (bench/plot_docs.py memory)", "command": command,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "revision": _revision(),
           "machine": f"{platform.node()}: {os.cpu_count()} cores, device {device}, torch {torch.__version__}",
           "model": f"4 x [1024, 1024] MLP (biases resident), r = 0.1, U = 4, batch 64, {args.steps} steps",
           "peers_host_bytes_per_param": PEERS_HOST, "rows": measure_memory(steps=args.steps, device=device)}
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(render_memory(doc), encoding="utf-8")
    plot_memory(doc["rows"], args.png)
    print(render_memory(doc))
    print(f"wrote {args.out}.json, {args.out}.md, {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
