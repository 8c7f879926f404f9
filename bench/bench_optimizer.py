"""The optimizer step end to end on the default device (CUDA if present, else CPU), every provider in one run.

Providers (``providers.optimizer_providers``): ``torch.optim.AdamW(fused=True)`` (the baseline), torch's default
AdamW, synchronous offload (``ZenFlowAdamW(topk_ratio=0, update_interval=1, overlap=False)``: what ZeRO-Offload does
every step), ZenFlowAdamW with ``topk_ratio=0.1, update_interval=4``, and ZenFlowAdamW ``"auto"`` (skipped when the
autotuner does not import).

The model is ``zenflow_triton.demo.charlm.CharLM`` at ``d_model=1024, n_layer=4``: 51M parameters, every weight matrix
offloaded. One benchmark round is one whole window (``update_interval`` steps; 4 for the torch providers), and the
rounds cover ``select_interval / update_interval`` consecutive windows (one selection period, 64 steps at most), so
the mean includes exactly the share of selection steps that training sees. Two variants:

- ``fixed_grads``: ``step()`` alone, with precomputed gradients (two random sets, alternating);
- ``fwd_bwd``: zero_grad, forward, backward and step of the model on a small batch of random bytes, so that
  ZenFlow's asynchronous host work has compute to hide behind.

``extra_info``: ``step_s`` (mean per step over the rounds), ``stall_s_per_step`` (``stats()['stall_s']``),
``ratio_to_torch_fused`` (against the ``torch_adamw_fused`` case of the same variant in this run; measured here if
that case was deselected), ``host_bytes_per_param``, ``pinned_bytes``, ``device_max_memory_bytes`` (CUDA), and
``params/s``. ``ZENFLOW_BENCH_SMOKE=1`` shrinks everything to a few seconds.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from common import SMOKE, gradient_sets
from providers import (
    auto_unavailable_reason,
    close_optimizer,
    optimizer_memory,
    optimizer_providers,
    steps_before_selection,
)

from zenflow_triton.demo.charlm import CharLM, CharLMConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEVICE.type == "cuda"
MODEL = (CharLMConfig(d_model=64, n_layer=1, n_head=4, seq_len=16) if SMOKE
         else CharLMConfig(d_model=1024, n_layer=4, n_head=16, seq_len=64))
# CPU: 32 tokens make forward+backward of the 51M model cost about as much as one fused AdamW step on 2 cores,
# enough to show whether host work hides behind it without making the bench take many minutes.
BATCH, SEQ = (2, 16) if SMOKE else ((8, 64) if CUDA else (1, 32))
TORCH_WINDOW = 4  # torch providers have no windows; 4 steps per round keeps rounds comparable with U=4
MAX_TIMED_STEPS = 8 if SMOKE else 64  # an "auto" plan may choose long windows; cap the timed steps
PROVIDERS = ["torch_adamw_fused", "torch_adamw", "sync_offload", "zenflow", "zenflow_auto"]
VARIANTS = ["fixed_grads", "fwd_bwd"]

_BASELINE_STEP_S: dict[str, float] = {}  # variant -> torch fused seconds per step, measured in this run


def _sync() -> None:
    if CUDA:
        # The optimizer and the model enqueue asynchronously; a round ends when the device is done.
        torch.cuda.synchronize()


@dataclass
class _Session:
    """One provider on a fresh model, warmed up to a window boundary; a benchmark round is ``window`` calls of
    ``timed_step`` (pytest-benchmark's ``iterations``), so its statistics are per step, averaged over a window."""

    name: str
    variant: str
    model: CharLM
    opt: Any
    step: Callable[[], None]
    window: int
    rounds: int
    steps_done: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def timed_step(self) -> None:
        self.step()
        self.steps_done += 1
        _sync()

    def close(self) -> None:
        close_optimizer(self.opt)


def _open(name: str, variant: str) -> _Session:
    provider = optimizer_providers()[name]
    torch.manual_seed(0)
    model = CharLM(MODEL).to(DEVICE)
    params = list(model.parameters())
    opt = provider.build(params)
    if variant == "fixed_grads":
        grads = [[g.to(DEVICE) for g in gs] for gs in gradient_sets(params, 2)]
        counter = iter(range(1 << 62))

        def step() -> None:
            for p, g in zip(params, grads[next(counter) % 2]):
                p.grad = g
            opt.step()
    else:
        gen = torch.Generator().manual_seed(1)
        x = torch.randint(0, 256, (BATCH, SEQ), generator=gen).to(DEVICE)
        y = torch.randint(0, 256, (BATCH, SEQ), generator=gen).to(DEVICE)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            model.loss(x, y).backward()
            opt.step()

    session = _Session(name, variant, model, opt, step, TORCH_WINDOW, 1)
    if provider.zenflow:
        # The warm-up, then the first selection step, which resolves "auto".
        for _ in range(steps_before_selection(opt) + 1):
            step()
        s = opt.stats()
        session.window = int(s["update_interval"])
        windows = int(s["select_interval"]) // session.window
        if SMOKE:  # smoke checks that every provider runs: one short round, not whole windows
            session.window = min(session.window, 4)
        else:
            for _ in range(session.window - 1):  # finish the first window: its host job compiles / loads numba
                step()
        session.extra = {"topk_ratio": s["topk_ratio"], "update_interval": session.window,
                         "select_interval": s["select_interval"], "cpu_threads": s["cpu_threads"]}
    else:
        windows = 8
        for _ in range(TORCH_WINDOW):
            step()
    # One selection period, and at least 16 steps (sync offload's period is 8 one-step windows).
    session.rounds = max(1, min(max(windows, -(-16 // session.window)), MAX_TIMED_STEPS // session.window))
    if SMOKE:
        session.rounds = 1
    _sync()
    return session


def _baseline(variant: str) -> float:
    """Torch fused AdamW's seconds per step for this variant: from this run, or measured now."""
    if variant not in _BASELINE_STEP_S:
        s = _open("torch_adamw_fused", variant)
        try:
            t0 = time.perf_counter()
            for _ in range(s.rounds * s.window):
                s.timed_step()
            _BASELINE_STEP_S[variant] = (time.perf_counter() - t0) / (s.rounds * s.window)
        finally:
            s.close()
    return _BASELINE_STEP_S[variant]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", PROVIDERS)
def test_optimizer_step(benchmark: Any, name: str, variant: str) -> None:
    if name == "zenflow_auto" and (reason := auto_unavailable_reason()) is not None:
        pytest.skip(reason)
    benchmark.group = f"optimizer-{variant}-{DEVICE.type}"
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    session = _open(name, variant)
    try:
        stats0 = getattr(session.opt, "stats", dict)()
        benchmark.pedantic(session.timed_step, rounds=session.rounds, iterations=session.window, warmup_rounds=0)
        stats1 = getattr(session.opt, "stats", dict)()
        timed_steps = session.steps_done
        info: dict[str, Any] = {"device": DEVICE.type, "params": sum(p.numel() for p in session.model.parameters()),
                                "window_steps": session.window, "stats_steps": timed_steps, **session.extra}
        if stats1:
            info["stall_s_per_step"] = (stats1["stall_s"] - stats0["stall_s"]) / timed_steps
            info["selections_timed"] = stats1["selections"] - stats0["selections"]
        info.update(optimizer_memory(session.opt, list(session.model.parameters())))
        if CUDA:
            info["device_max_memory_bytes"] = torch.cuda.max_memory_allocated()
        if benchmark.stats is not None:  # None under --benchmark-disable: nothing was timed
            step_s = benchmark.stats.stats.mean  # per step: the rounds ran `window` iterations each
            if name == "torch_adamw_fused":
                _BASELINE_STEP_S[variant] = step_s
            info["step_s"] = step_s
            info["params/s"] = info["params"] / step_s
            info["ratio_to_torch_fused"] = step_s / _baseline(variant)
        benchmark.extra_info.update(info)
    finally:
        session.close()
