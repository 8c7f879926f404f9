"""Fine-tune a small byte-level transformer with AdamW and with ZenFlowAdamW, side by side.

Run ``python -m zenflow_triton.demo`` (``--help`` for the flags). It pretrains the model of
:mod:`zenflow_triton.demo.charlm` on standard-library source (on the CPU, about 10 s), then fine-tunes a copy of
the pretrained weights on the pydoc help topics with each optimizer in turn, on the same batches, on the default
device (CUDA when present, else the CPU). Progress goes to stderr; the comparison table goes to stdout. With
``--plot [PATH]`` (default path ``zenflow_demo.png``) it also draws the training-loss curves, which needs
matplotlib; no plot is written unless asked for. ``--quick`` is a smoke run of a few seconds.

Every flag is checked before any training (a bad one is a usage error, exit code 2), including whether
``--backend`` can run on ``--device`` (triton on CPU tensors needs ``TRITON_INTERPRET=1``). Before its timed run,
each optimizer runs a few untimed warm-up steps on a throwaway copy of the model, so that one-time costs (on a
first run, numba compiling ZenFlow's kernels) stay out of the table's step times and stall.

The final losses are measured on held-out pydoc text after ``ZenFlowAdamW.flush()``: with ``overlap=True`` the
last window's host update reaches the model one window late (DESIGN §2).

This module holds the flags, the fine-tuning runs and :func:`main`; the run record, the table and the plot are in
:mod:`.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.kernels.device_ops import load_device_ops
from zenflow_triton.worker import host_thread_limit

from . import charlm
from .report import RunResult, format_legend, format_table
from .report import plot as _plot

__all__ = ["main", "build_parser", "RunResult"]

DEFAULT_PLOT = "zenflow_demo.png"


BACKENDS = ("auto", "triton", "numba", "torch")
QUICK_STEPS, QUICK_PRETRAIN_STEPS = 40, 150
# ZenFlowAdamW's warm-up (exact AdamW on everything) with --quick: the optimizer's default 100 would outlast the run.
QUICK_WARMUP_STEPS = 8
DEFAULT_STEPS, DEFAULT_PRETRAIN_STEPS = 200, 800


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every flag's help, except where the help already says its default in words
    (flags whose default depends on another flag or on the machine)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def _float_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    bounds = f"{'(' if low_open else '['}{low:g}, " + ("inf)" if math.isinf(high) else f"{high:g}]")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {bounds}, got {text!r}") from None
        if not math.isfinite(value) or not ((value > low if low_open else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"expected a number in {bounds}, got {text}")
        return value

    parse.__name__ = f"number in {bounds}"
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The demo's command-line parser (``--help`` shows every flag's default and choices)."""
    parser = argparse.ArgumentParser(
        prog="python -m zenflow_triton.demo",
        description="Fine-tune a small byte-level transformer with AdamW and ZenFlowAdamW and compare them. "
        "Progress goes to stderr, the comparison table to stdout.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--steps",
        type=_int_at_least(1),
        default=None,
        metavar="N",
        help=f"fine-tuning steps per optimizer (default: {DEFAULT_STEPS}, or {QUICK_STEPS} with --quick)",
    )
    parser.add_argument(
        "--pretrain-steps",
        type=_int_at_least(1),
        default=None,
        metavar="N",
        help="AdamW pretraining steps on stdlib source, batch 8 "
        f"(default: {DEFAULT_PRETRAIN_STEPS}, or {QUICK_PRETRAIN_STEPS} with --quick)",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="device to fine-tune on: cpu, cuda or cuda:N (default: cuda if available, else cpu)",
    )
    parser.add_argument(
        "--topk-ratio",
        type=_float_in(0.0, 1.0),
        default=0.1,
        metavar="R",
        help="ZenFlow: fraction of each weight's columns updated on the device every step, in [0, 1]",
    )
    parser.add_argument(
        "--update-interval",
        type=_int_at_least(1),
        default=4,
        metavar="U",
        help="ZenFlow: steps per host window (the other columns get one CPU Adam update per window)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=_int_at_least(0),
        default=None,
        metavar="W",
        help="ZenFlow: steps of exact AdamW before selection starts (default: ZenFlowAdamW's, 100, or "
        f"{QUICK_WARMUP_STEPS} with --quick)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="ZenFlow's device-side kernels, ZenFlowAdamW(backend=...): auto = triton on CUDA, numba on CPU; "
        "triton on CPU needs TRITON_INTERPRET=1",
    )
    parser.add_argument(
        "--lr", type=_float_in(0.0, math.inf, low_open=True), default=1e-3, help="fine-tuning learning rate, > 0"
    )
    parser.add_argument(
        "--batch", type=_int_at_least(1), default=8, metavar="B", help="fine-tuning sequences per batch (64 bytes each)"
    )
    parser.add_argument(
        "--seed", type=_int_at_least(0), default=0, help="seed of the model initialisation and of the batches"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run of a few seconds: {QUICK_PRETRAIN_STEPS} pretraining and {QUICK_STEPS} fine-tuning steps "
        "unless --pretrain-steps / --steps say otherwise (default: off)",
    )
    parser.add_argument(
        "--plot",
        nargs="?",
        const=DEFAULT_PLOT,
        default=None,
        metavar="PATH",
        help=f"write the training-loss curves as a PNG to PATH ({DEFAULT_PLOT} if --plot is given without PATH); "
        "needs matplotlib: pip install -e '.[plot]' from the checkout (default: no plot)",
    )
    return parser


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and check every flag, so that a bad one is a usage error (exit 2) before any training."""
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
    if args.warmup_steps is None and args.quick:
        args.warmup_steps = QUICK_WARMUP_STEPS
    if args.pretrain_steps is None:
        args.pretrain_steps = QUICK_PRETRAIN_STEPS if args.quick else DEFAULT_PRETRAIN_STEPS
    args.device = _check_device(parser, args.device)
    _check_backend(parser, args)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install -e '.[plot]' from the checkout)")
    return args


def _check_device(parser: argparse.ArgumentParser, name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: expected cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"argument --device: {name!r} asked for, but no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(
                f"argument --device: {name!r} asked for, but there are {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def _check_backend(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject a backend that cannot run on the device now, not at ZenFlow's first step after minutes of training.

    ``load_device_ops`` is what the optimizer itself calls at its first step (it raises for triton on CPU tensors
    without ``TRITON_INTERPRET=1`` and for numba on CUDA); constructing a ZenFlowAdamW over one probe parameter
    with the demo's settings runs every check its constructor makes.
    """
    try:
        load_device_ops(args.backend, args.device)
    except (ValueError, ImportError) as exc:
        hint = ""
        if args.backend == "triton" and args.device.type == "cpu":
            hint = " (here: --backend auto, numba or torch; or TRITON_INTERPRET=1 with --backend triton, slowly)"
        parser.error(f"argument --backend: {args.backend!r} cannot run on {args.device}: {exc}{hint}")
    try:
        probe = torch.zeros(64, 64, device=args.device)
        ZenFlowAdamW([probe], **_zenflow_kwargs(args, cpu_threads=None)).close()
    except (ValueError, TypeError, RuntimeError) as exc:
        parser.error(f"ZenFlowAdamW rejects these settings on {args.device}: {exc}")


def _zenflow_kwargs(args: argparse.Namespace, *, cpu_threads: int | None) -> dict[str, Any]:
    warmup = {} if args.warmup_steps is None else {"warmup_steps": args.warmup_steps}
    return dict(
        lr=args.lr,
        weight_decay=0.01,
        topk_ratio=args.topk_ratio,
        update_interval=args.update_interval,
        cpu_threads=cpu_threads,
        backend=args.backend,
        **warmup,
    )


def _progress(message: str) -> None:
    # The table on stdout stays clean for piping; progress is for the person watching.
    print(message, file=sys.stderr, flush=True)


def _progress_printer(name: str, steps: int) -> Callable[[int, float, float], None]:
    """A train() ``on_step`` that prints about 10 lines: step, loss, mean ms/step since the last line, elapsed s."""
    every = max(1, steps // 10)
    window: list[float] = []
    started = time.perf_counter()

    def on_step(step: int, loss: float, seconds: float) -> None:
        window.append(seconds)
        if step % every == 0 or step == steps:
            ms = 1000.0 * statistics.fmean(window)
            elapsed = time.perf_counter() - started
            _progress(
                f"  {name:<12} step {step:>{len(str(steps))}}/{steps}  loss {loss:.4f}  {ms:7.1f} ms/step  "
                f"{elapsed:6.1f} s"
            )
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


def _warmup_run_steps(args: argparse.Namespace) -> int:
    """Steps of the untimed warm-up run: ZenFlow's first step runs the device-side kernels, its first window end
    (step U) starts a host job and step 2U waits for it and merges its result, so 2U + 1 steps reach every kernel
    (measured with an empty numba cache: about 3 s of compiling at step 1 and 5 s at step 2U, nothing later)."""
    return 2 * args.update_interval + 1


def _run_copy(
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    *,
    cfg: charlm.CharLMConfig,
    state: dict[str, torch.Tensor],
    corpora: charlm.Corpora,
    args: argparse.Namespace,
    steps: int,
    on_step: Callable[[int, float, float], None] | None,
    evaluate: bool,
) -> tuple[list[float], dict[str, Any] | None, float]:
    """Fine-tune a fresh copy of the pretrained model: (training losses, ZenFlow's stats or None, held-out loss or
    NaN when not ``evaluate``)."""
    model = charlm.make_model(cfg, device=args.device)
    model.load_state_dict(state)
    opt = make_optimizer(model)
    try:
        losses = charlm.train(
            model, opt, corpora.finetune_train, steps=steps, batch=args.batch, seed=args.seed + 1, on_step=on_step
        )
        stats = None
        if isinstance(opt, ZenFlowAdamW):
            # Evaluate current weights: the last host window is still one window behind in the model.
            opt.flush()
            stats = opt.stats()
        final = charlm.evaluate(model, corpora.finetune_val) if evaluate else math.nan
    finally:
        if isinstance(opt, ZenFlowAdamW):
            opt.close()
    return losses, stats, final


def _finetune(
    name: str,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    *,
    make_throwaway: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
    cfg: charlm.CharLMConfig,
    state: dict[str, torch.Tensor],
    corpora: charlm.Corpora,
    args: argparse.Namespace,
) -> RunResult:
    common = dict(cfg=cfg, state=state, corpora=corpora, args=args)
    # Untimed warm-up on a throwaway copy, so that one-time costs stay out of the timed run's ms/step and stall:
    # on a first run numba compiles ZenFlow's kernels (seconds; cached on disk afterwards). Same batches, own
    # model and optimizer: the timed run below starts from the same state as without it.
    warm_steps = _warmup_run_steps(args)
    _progress(f"  {name:<12} untimed warm-up: {warm_steps} steps on a throwaway copy of the model")
    t0 = time.perf_counter()
    _run_copy(make_throwaway or make_optimizer, **common, steps=warm_steps, on_step=None, evaluate=False)
    warm_s = time.perf_counter() - t0
    if warm_s >= 2.0:
        _progress(f"  {name:<12} warm-up took {warm_s:.1f} s (one-time: compiling kernels; not in the table's times)")

    seconds: list[float] = []
    show = _progress_printer(name, args.steps)

    def on_step(step: int, loss: float, dt: float) -> None:
        seconds.append(dt)
        show(step, loss, dt)

    losses, stats, final = _run_copy(make_optimizer, **common, steps=args.steps, on_step=on_step, evaluate=True)
    # The first step allocates optimizer state; ZenFlow's first two windows also start its worker (measured before
    # the warm-up run existed: one ~0.25 s step at the first wait on the worker, a 15 ms step otherwise). Neither is
    # the steady state, so both optimizers' means skip the same 2 windows of steps when the run is long enough.
    warmup = 2 * args.update_interval if args.steps > 4 * args.update_interval else 1
    return RunResult(
        name=name,
        final_loss=final,
        train_losses=losses,
        step_seconds=seconds,
        stats=stats,
        warmup_steps=warmup,
        warmup_run_steps=warm_steps,
        warmup_run_s=warm_s,
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
        # Pretraining keeps its own batch size: --batch changes the fine-tuning only, not the starting point.
        cached = charlm.is_pretrained(cfg, steps=args.pretrain_steps, seed=args.seed)
        _progress(
            f"pretraining on {len(corpora.pretrain) / 1e3:.0f} KB of stdlib source: {args.pretrain_steps} steps"
            + (" (already done in this process)" if cached else "")
        )
        t0 = time.perf_counter()
        show = _progress_printer("pretraining", args.pretrain_steps)
        state = charlm.pretrained_state(cfg, steps=args.pretrain_steps, seed=args.seed, on_step=show)
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
                lambda m: ZenFlowAdamW(m.parameters(), **_zenflow_kwargs(args, cpu_threads=worker_threads)),
                # The throwaway copy selects from step 1, so that its 2U + 1 steps reach every kernel.
                make_throwaway=lambda m: ZenFlowAdamW(
                    m.parameters(), **{**_zenflow_kwargs(args, cpu_threads=worker_threads), "warmup_steps": 0}),
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
    print(format_legend(results))
    if args.plot is not None:
        title = f"fine-tuning from stdlib-pretrained weights ({args.device}, {args.steps} steps)"
        _plot(args.plot, results, pretrained_loss, title)
        print(f"loss curves written to {os.path.abspath(args.plot)}")
    _progress(f"total {time.perf_counter() - started:.1f} s")
    return 0
