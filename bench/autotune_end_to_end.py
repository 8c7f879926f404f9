"""The autotuner end to end: ``"auto"`` against the fixed default (0.1, 4) and AdamW on the demo's fine-tune.

The task is the one the shipped quality table was measured on (``bench/quality_table.py``): the demo's byte-level
transformer, pretrained 800 steps, fine-tuned 200 steps x batch 8 with a real forward and backward, from the same
weights on the same batches for every optimizer. For each batch seed it runs AdamW, ZenFlowAdamW(topk_ratio=0.1,
update_interval=4) and ZenFlowAdamW("auto", "auto"), in rotating order, and reports per optimizer: the held-out
loss ratio vs AdamW (mean and range over seeds), the median wall time per step (forward, backward and ``step()``)
and per ``step()`` call, both after the first 10 steps (the warm-up "auto" adds), and for "auto" what it chose and
what it predicted (``stats()``: ``predicted_loss_ratio``; ``predicted_time_per_step_s`` less the measured model
step, ``measured_step_time_s``, is the predicted ``step()`` time). On a shared 2-core machine the whole step varies
by several ms between runs; the ``step()`` time is the steadier comparison.

Torch runs on one thread and ZenFlow's host worker on one (the default on a 2-core machine: cores - 1), so the
worker has a core of its own. The profile is ``--profile`` (from ``python -m zenflow_triton.autotune -o PATH``),
else a quick probe now::

    nice -n 10 python bench/autotune_end_to_end.py --profile /tmp/zf_profile.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.autotune import ENV_VAR, ProbeSettings, load_profile, probe_machine, save_profile
from zenflow_triton.demo.charlm import CharLMConfig, evaluate, load_corpora, make_model, pretrained_state, train

__all__ = ["main"]

LR = 1e-3
WEIGHT_DECAY = 0.01
STEPS = 200
BATCH = 8


SKIP = 10  # steps not timed: "auto" runs 5 synchronous warm-up steps and plans at the 6th


class Timed:
    """The optimizer as train() uses it, timing each step() call."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt, self.times = opt, []

    def step(self) -> None:
        t0 = time.perf_counter()
        self.opt.step()
        self.times.append(time.perf_counter() - t0)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)


def run(name: str, cfg: CharLMConfig, state: dict, seed: int) -> dict:
    corpora = load_corpora()
    model = make_model(cfg)
    model.load_state_dict(state)
    times: list[float] = []

    def on_step(step: int, loss: float, seconds: float) -> None:
        times.append(seconds)

    if name == "AdamW":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        knobs = ({"topk_ratio": "auto", "update_interval": "auto"} if name == "auto"
                 else {"topk_ratio": 0.1, "update_interval": 4})
        knobs["warmup_steps"] = 0  # no warm-up: the steady state, the same steps for every optimizer
        opt = ZenFlowAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **knobs)
    timed = Timed(opt)
    try:
        train(model, timed, corpora.finetune_train, steps=STEPS, batch=BATCH, seed=seed, on_step=on_step)
        stats = None
        if isinstance(opt, ZenFlowAdamW):
            opt.flush()
            stats = opt.stats()
        return {"loss": evaluate(model, corpora.finetune_val), "step_s": statistics.median(times[SKIP:]),
                "opt_s": statistics.median(timed.times[SKIP:]), "stats": stats}
    finally:
        if isinstance(opt, ZenFlowAdamW):
            opt.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="machine profile (default: a quick probe now)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--d-model", type=int, default=CharLMConfig.d_model,
                        help="a wider model than the table's task (default: the demo's, the table's own task)")
    parser.add_argument("--n-layer", type=int, default=CharLMConfig.n_layer)
    args = parser.parse_args(argv)
    cfg = CharLMConfig(d_model=args.d_model, n_layer=args.n_layer)
    torch.set_num_threads(1)
    if args.profile:
        load_profile(args.profile)
        os.environ[ENV_VAR] = args.profile
    else:
        path = os.path.join(tempfile.mkdtemp(prefix="zf-e2e-"), "profile.json")
        save_profile(probe_machine(ProbeSettings.quick_settings()), path)
        os.environ[ENV_VAR] = path
    load0 = os.getloadavg()[0]
    started = time.perf_counter()
    state = pretrained_state(cfg)
    names = ["AdamW", "fixed 0.1 / 4", "auto"]
    results: dict[str, list[dict]] = {n: [] for n in names}
    for k, seed in enumerate(args.seeds):
        for name in names[k % 3:] + names[:k % 3]:  # rotate the order: no optimizer always runs first
            results[name].append(run(name, cfg, state, seed))
            r = results[name][-1]
            print(f"seed {seed} {name}: loss {r['loss']:.4f}, {r['step_s'] * 1e3:.2f} ms/step, "
                  f"step() {r['opt_s'] * 1e3:.2f} ms", file=sys.stderr)
    adamw = [r["loss"] for r in results["AdamW"]]
    total = sum(p.numel() for p in make_model(cfg).parameters())
    print(f"CharLM d_model={cfg.d_model} n_layer={cfg.n_layer} ({total / 1e6:.2f}M params); "
          f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; "
          f"{time.perf_counter() - started:.0f} s; seeds {args.seeds}; torch {torch.__version__}")
    print()
    print("| optimizer | topk_ratio | U | loss ratio vs AdamW, mean (min-max) | predicted | ms/step | "
          "step() ms | predicted step() ms |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for name in names:
        ratios = [r["loss"] / a for r, a in zip(results[name], adamw)]
        ms = statistics.median(r["step_s"] for r in results[name]) * 1e3
        opt_ms = statistics.median(r["opt_s"] for r in results[name]) * 1e3
        st = results[name][0]["stats"] or {}
        r_, u_ = st.get("topk_ratio", "-"), st.get("update_interval", "-")
        pred_loss = st.get("predicted_loss_ratio")
        pred_opt = (st["predicted_time_per_step_s"] - st["measured_step_time_s"]) * 1e3 if pred_loss else None
        print(f"| {name} | {r_} | {u_} | {statistics.mean(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
              f"{'-' if pred_loss is None else f'{pred_loss:.3f}'} | {ms:.2f} | {opt_ms:.2f} | "
              f"{'-' if pred_opt is None else f'{pred_opt:.2f}'} |")
    print("ms/step: median wall time of forward, backward and step(); step(): median time in step(); medians over "
          f"the steps after the first {SKIP}, then over seeds")
    auto = results["auto"][0]["stats"]
    print()
    print("auto_reason:")
    print("\n".join("    " + line for line in auto["auto_reason"].splitlines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
