"""Fine-tune a small byte-level transformer with AdamW and with ZenFlowAdamW, side by side.

Run ``python -m zenflow_triton.demo`` (``--help`` for the flags). It pretrains the model of
:mod:`zenflow_triton.demo.charlm` on standard-library source (on the CPU, about 10 s), then fine-tunes a copy of
the pretrained weights on the pydoc help topics with each optimizer in turn, on the same batches, on the default
device (CUDA when present, else the CPU). Progress goes to stderr; the comparison table goes to stdout. With
``--plot [PATH]`` (default path ``zenflow_demo.png``) it also draws the training-loss curves, which needs
matplotlib; no plot is written unless asked for. ``--quick`` is a smoke run of a few seconds.

The final losses are measured on held-out pydoc text after ``ZenFlowAdamW.flush()``: with ``overlap=True`` the
last window's host update reaches the model one window late (DESIGN §2).

This module holds the flags, the fine-tuning runs and :func:`main`; the run record, the table and the plot are in
:mod:`.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.worker import host_thread_limit

from . import charlm
from .report import RunResult, format_table
from .report import plot as _plot

__all__ = ["main", "RunResult"]

DEFAULT_PLOT = "zenflow_demo.png"


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m zenflow_triton.demo",
        description="Fine-tune a small byte-level transformer with AdamW and ZenFlowAdamW and compare them.",
    )
    parser.add_argument("--steps", type=int, default=None, help="fine-tuning steps per optimizer (default 200)")
    parser.add_argument(
        "--pretrain-steps", type=int, default=None, help="AdamW pretraining steps on stdlib source (default 800)"
    )
    parser.add_argument("--device", default=None, help="device to fine-tune on (default: cuda if available, else cpu)")
    parser.add_argument("--topk-ratio", type=float, default=0.1, help="ZenFlow: fraction of columns on the device")
    parser.add_argument("--update-interval", type=int, default=4, help="ZenFlow: steps per host window")
    parser.add_argument(
        "--backend", default="auto", help="ZenFlow's device-side kernels: ZenFlowAdamW(backend=...) (default auto)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate for both optimizers")
    parser.add_argument("--batch", type=int, default=8, help="fine-tuning sequences per batch (64 bytes each)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model initialisation and the batches")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 150 pretraining and 40 fine-tuning steps (seconds)"
    )
    parser.add_argument(
        "--plot",
        nargs="?",
        const=DEFAULT_PLOT,
        default=None,
        metavar="PATH",
        help=f"write the loss curves as a PNG (needs matplotlib; PATH defaults to {DEFAULT_PLOT})",
    )
    args = parser.parse_args(argv)

    if args.steps is None:
        args.steps = 40 if args.quick else 200
    if args.pretrain_steps is None:
        args.pretrain_steps = 150 if args.quick else 800
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.pretrain_steps < 1:
        parser.error(f"--pretrain-steps must be >= 1, got {args.pretrain_steps}")
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    if not 0.0 <= args.topk_ratio <= 1.0:
        parser.error(f"--topk-ratio must be in [0, 1], got {args.topk_ratio}")
    if args.update_interval < 1:
        parser.error(f"--update-interval must be >= 1, got {args.update_interval}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    args.device = device
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install 'zenflow_triton[plot]')")
    return args


def _progress(message: str) -> None:
    # The table on stdout stays clean for piping; progress is for the person watching.
    print(message, file=sys.stderr, flush=True)


def _progress_printer(name: str, steps: int) -> Callable[[int, float, float], None]:
    every = max(1, steps // 10)
    window: list[float] = []

    def on_step(step: int, loss: float, seconds: float) -> None:
        window.append(seconds)
        if step % every == 0 or step == steps:
            ms = 1000.0 * statistics.fmean(window)
            _progress(f"  {name:<12} step {step:>{len(str(steps))}}/{steps}  loss {loss:.4f}  {ms:7.1f} ms/step")
            window.clear()

    return on_step


def _cpu_split(device: torch.device) -> tuple[int | None, int | None]:
    """(torch threads, ZenFlow host-worker threads) for a run on ``device``; None keeps the default.

    On the CPU the model's compute and ZenFlow's host worker share the cores, so each gets half (one each on a
    2-core machine). Left alone, the worker's default (all cores but one) and torch's (all cores) oversubscribe
    them; measured on 2 cores, two torch threads next to the worker or any other load made steps several times
    slower, because OpenMP's threads wait on each other at every op. AdamW runs under the same torch setting, so
    the step times compare.
    """
    if device.type != "cpu":
        return None, None
    cores = host_thread_limit()
    torch_threads = max(1, cores // 2)
    return torch_threads, max(1, cores - torch_threads)


@contextlib.contextmanager
def _torch_threads(count: int | None) -> Iterator[None]:
    """Set torch's intra-op thread count for the block (unchanged when None) and restore it afterwards."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _finetune(
    name: str,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    *,
    cfg: charlm.CharLMConfig,
    state: dict[str, torch.Tensor],
    corpora: charlm.Corpora,
    args: argparse.Namespace,
) -> RunResult:
    model = charlm.make_model(cfg, device=args.device)
    model.load_state_dict(state)
    opt = make_optimizer(model)
    seconds: list[float] = []
    show = _progress_printer(name, args.steps)

    def on_step(step: int, loss: float, dt: float) -> None:
        seconds.append(dt)
        show(step, loss, dt)

    try:
        losses = charlm.train(
            model, opt, corpora.finetune_train, steps=args.steps, batch=args.batch, seed=args.seed + 1, on_step=on_step
        )
        stats = None
        if isinstance(opt, ZenFlowAdamW):
            # Evaluate current weights: the last host window is still one window behind in the model.
            opt.flush()
            stats = opt.stats()
        final = charlm.evaluate(model, corpora.finetune_val)
    finally:
        if isinstance(opt, ZenFlowAdamW):
            opt.close()
    # The first step allocates optimizer state; ZenFlow's first two windows also start its worker and load the host
    # kernels (measured: one ~0.25 s step at the first wait on the worker, a 15 ms step otherwise). Neither is the
    # steady state, so both optimizers' means skip the same 2 windows of steps when the run is long enough.
    warmup = 2 * args.update_interval if args.steps > 4 * args.update_interval else 1
    return RunResult(
        name=name, final_loss=final, train_losses=losses, step_seconds=seconds, stats=stats, warmup_steps=warmup
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo with command-line arguments ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args = _parse_args(argv)
    cfg = charlm.CharLMConfig()
    started = time.perf_counter()

    torch_threads, worker_threads = _cpu_split(args.device)
    with _torch_threads(torch_threads):
        corpora = charlm.load_corpora()
        offloaded, total = charlm.offloadable_numel(charlm.make_model(cfg))
        _progress(f"pretraining on {len(corpora.pretrain) / 1e3:.0f} KB of stdlib source: {args.pretrain_steps} steps")
        t0 = time.perf_counter()
        # Pretraining keeps its own batch size: --batch changes the fine-tuning only, not the starting point.
        state = charlm.pretrained_state(cfg, steps=args.pretrain_steps, seed=args.seed)
        _progress(f"  done in {time.perf_counter() - t0:.1f} s")

        base = charlm.make_model(cfg, device=args.device)
        base.load_state_dict(state)
        pretrained_loss = charlm.evaluate(base, corpora.finetune_val)
        del base

        _progress(f"fine-tuning on {len(corpora.finetune_train) / 1e3:.0f} KB of pydoc topics: {args.steps} steps each")
        common = dict(cfg=cfg, state=state, corpora=corpora, args=args)
        results = [
            _finetune(
                "AdamW",
                lambda m: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01),
                **common,
            ),
            _finetune(
                "ZenFlowAdamW",
                lambda m: ZenFlowAdamW(
                    m.parameters(),
                    lr=args.lr,
                    weight_decay=0.01,
                    topk_ratio=args.topk_ratio,
                    update_interval=args.update_interval,
                    cpu_threads=worker_threads,
                    backend=args.backend,
                ),
                **common,
            ),
        ]

    zen = results[1].stats or {}
    print(
        f"model: {total:,} parameters, {offloaded:,} in offloaded weight matrices; device {args.device}"
        + (f" (threads: torch {torch_threads}, ZenFlow worker {worker_threads})" if torch_threads else "")
    )
    print(
        f"fine-tuning: {args.steps} steps, batch {args.batch} x {cfg.seq_len} bytes, lr {args.lr:g}; ZenFlow "
        f"topk_ratio {args.topk_ratio:g}, update_interval {args.update_interval}, "
        f"{zen.get('windows', '?')} windows"
    )
    print(f"held-out fine-tuning loss of the pretrained model: {pretrained_loss:.4f}")
    print()
    print(format_table(results))
    print()
    print("final loss: on held-out pydoc text, after flush(); stall s: time step() waited on host work")
    print(
        "ms/step: mean wall time of forward + backward + step, leaving out the first "
        f"{results[0].warmup_steps} step(s) (one-time set-up)"
    )
    if args.plot is not None:
        title = f"fine-tuning from stdlib-pretrained weights ({args.device}, {args.steps} steps)"
        _plot(args.plot, results, pretrained_loss, title)
        print(f"loss curves written to {os.path.abspath(args.plot)}")
    _progress(f"total {time.perf_counter() - started:.1f} s")
    return 0
