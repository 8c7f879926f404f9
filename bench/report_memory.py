"""Device bytes per parameter held and at peak over training steps (forward, backward, step), per optimizer.

    python bench/report_memory.py [--steps 13] [--device cpu|cuda] [--layers 4] [--width 1024] [--host]

The model is an MLP of ``--layers`` square ``[width, width]`` linear layers (weights offloaded, biases resident),
trained at r = 0.1, U = 4 for ``--steps`` steps; figures are bytes divided by the model's parameter count.

- On CUDA: ``torch.cuda.memory_allocated`` at the end of each step (held: the largest, with the gradients still
  there, as before the next ``zero_grad``) and ``torch.cuda.max_memory_allocated`` over the run (peak), the model's
  weights included.
- On CPU tensors, where torch's allocations are what a GPU run holds on the device (the optimizer's host slabs are
  mmap'd, not torch allocations): ``torch.profiler.profile(profile_memory=True)``'s allocation events summed in
  time order from a fresh model (its weights, allocated before, added), held at each step's end and the peak.

With ``--host``: instead, the host bytes per offloaded parameter that ``stats()["host_bytes_per_param"]`` counts
(the slabs and the landing ring) after ``--steps`` steps, for every ZenFlowAdamW mode, also at ``overlap_steps=1``
(one window sum with accumulate="host").

Rows: ``torch AdamW`` (moments in the model dtype, on the device), ZenFlowAdamW ``accumulate="device"`` and
``"host"``, and ``"host"`` with ``grads_in_backward`` (the offloaded gradients consumed in backward), for fp32 and
bf16 models. This file imports nothing else from bench/, so tests load it by path.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zenflow_triton import ZenFlowAdamW

__all__ = ["MemoryFigures", "host_bytes_per_param", "measure", "mlp", "optimizers"]


@dataclass(frozen=True)
class MemoryFigures:
    """Device bytes per model parameter: held at the end of a step (the largest over the run) and at peak."""

    held: float
    peak: float


def mlp(layers: int, width: int, dtype: torch.dtype, device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(device=device, dtype=dtype)


def optimizers(topk_ratio: float = 0.1, update_interval: int = 4,
               overlap_steps: int | None = None) -> dict[str, Callable[[nn.Module], object]]:
    """The optimizers compared, each built over a model's parameters."""
    # warmup_steps=0: the steady state.
    zen = dict(topk_ratio=topk_ratio, update_interval=update_interval, warmup_steps=0, overlap_steps=overlap_steps)
    return {
        "torch AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False),
        "ZenFlow device": lambda m: ZenFlowAdamW(m.parameters(), lr=1e-3, accumulate="device", **zen),
        "ZenFlow host": lambda m: ZenFlowAdamW(m.parameters(), lr=1e-3, accumulate="host", **zen),
        "ZenFlow host + grads_in_backward": lambda m: ZenFlowAdamW(m.parameters(), lr=1e-3, accumulate="host",
                                                                   grads_in_backward=True, **zen),
    }


def host_bytes_per_param(make_opt: Callable[[nn.Module], object], *, dtype: torch.dtype, device: str, steps: int,
                         layers: int, width: int, batch: int = 8) -> float:
    """``stats()["host_bytes_per_param"]`` of the optimizer ``make_opt`` builds, after ``steps`` steps."""
    model = mlp(layers, width, dtype, device)
    opt = make_opt(model)
    _train(model, opt, steps, batch, lambda: None)
    figure = opt.stats()["host_bytes_per_param"]
    opt.close()
    return figure


def _train(model: nn.Module, opt, steps: int, batch: int, on_step_end: Callable[[], None]) -> None:
    p0 = next(model.parameters())
    gen = torch.Generator().manual_seed(1)
    width = p0.shape[1]
    for _ in range(steps):
        x = torch.randn(batch, width, generator=gen).to(device=p0.device, dtype=p0.dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
        on_step_end()


def measure(make_opt: Callable[[nn.Module], object], *, dtype: torch.dtype = torch.float32, device: str = "cpu",
            steps: int = 13, layers: int = 4, width: int = 1024, batch: int = 64) -> MemoryFigures:
    """Held and peak device bytes per parameter for one optimizer over ``steps`` steps of a fresh MLP."""
    if device == "cuda":
        # cuBLAS takes a workspace (32 MiB on sm_90) from the caching allocator per handle and stream, at the first
        # matmul of each thread: the forward's (this thread) and the backward's (autograd's device thread). Made
        # here, before the baseline, or the first measurement of a process counts them as the optimizer's.
        mlp(1, 8, dtype, device)(torch.zeros(2, 8, dtype=dtype, device=device)).sum().backward()
        torch.cuda.synchronize()
        gc.collect()  # an earlier optimizer held only by a reference cycle must not be freed inside the measurement
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    model = mlp(layers, width, dtype, device)
    numel = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = make_opt(model)
    try:
        if device == "cuda":
            held = [0]

            def mark() -> None:
                torch.cuda.synchronize()
                held[0] = max(held[0], torch.cuda.memory_allocated() - base)

            _train(model, opt, steps, batch, mark)
            return MemoryFigures(held[0] / numel, (torch.cuda.max_memory_allocated() - base) / numel)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            _train(model, opt, steps, batch, _mark_step_end)
        return _from_events(prof, weights, numel)
    finally:
        close = getattr(opt, "close", None)
        if close is not None:
            close()


_STEP_END = "report_memory.step_end"


def _mark_step_end() -> None:
    with torch.profiler.record_function(_STEP_END):
        pass


def _from_events(prof: torch.profiler.profile, weights: int, numel: int) -> MemoryFigures:
    """Every CPU allocation and free the profiler saw (all threads; ``nbytes`` < 0 for a free), summed in time
    order: the running total at each step's end (held) and its maximum (peak), plus the weights allocated before."""
    events = prof.profiler.kineto_results.events()
    memory = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    ends = sorted(e.start_ns() for e in events if e.name() == _STEP_END)
    total = peak = held = 0
    i = 0
    for end in ends:
        while i < len(memory) and memory[i][0] <= end:
            total += memory[i][1]
            peak = max(peak, total)
            i += 1
        held = max(held, total)
    return MemoryFigures((weights + held) / numel, (weights + peak) / numel)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--host", action="store_true", help="host bytes per parameter per mode instead")
    args = ap.parse_args(argv)
    if args.host:
        _print_host(args)
        return
    print(f"{args.layers} x [{args.width}, {args.width}] MLP, r = 0.1, U = 4, {args.steps} steps, device "
          f"{args.device}; device bytes per parameter")
    print()
    print("| optimizer | model | held B/param | peak B/param |")
    print("|---|---|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for name, make in optimizers().items():
            fig = measure(make, dtype=dtype, device=args.device, steps=args.steps, layers=args.layers,
                          width=args.width)
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {fig.held:.2f} | {fig.peak:.2f} |")



def _print_host(args: argparse.Namespace) -> None:
    print(f"{args.layers} x [{args.width}, {args.width}] MLP, r = 0.1, U = 4, {args.steps} steps, device "
          f"{args.device}; host bytes per offloaded parameter, stats()['host_bytes_per_param']")
    print()
    print("| optimizer | model | host B/param | host B/param, overlap_steps=1 |")
    print("|---|---|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for name, make in optimizers().items():
            if not name.startswith("ZenFlow"):
                continue
            figures = [host_bytes_per_param(mk, dtype=dtype, device=args.device, steps=args.steps,
                                            layers=args.layers, width=args.width)
                       for mk in (make, optimizers(overlap_steps=1)[name])]
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {figures[0]:.3f} | {figures[1]:.3f} |")


if __name__ == "__main__":
    main()
