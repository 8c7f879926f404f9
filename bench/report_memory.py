"""Device and host bytes per parameter held and at peak over training steps (forward, backward, step), per optimizer.

    python bench/report_memory.py [--steps 13] [--device cpu|cuda] [--layers 4] [--width 1024] [--out PATH] [--host]

The model is an MLP of ``--layers`` square ``[width, width]`` linear layers (weights offloaded, biases resident),
trained at r = 0.1, U = 4 for ``--steps`` steps; device figures are bytes divided by the model's parameter count.

- On CUDA: ``torch.cuda.memory_allocated`` at the end of each step (held: the largest, with the gradients still
  there, as before the next ``zero_grad``) and ``torch.cuda.max_memory_allocated`` over the run (peak), the model's
  weights included.
- On CPU tensors, where torch's allocations are what a GPU run holds on the device (the optimizer's host slabs are
  mmap'd, not torch allocations): ``torch.profiler.profile(profile_memory=True)``'s allocation events summed in
  time order from a fresh model (its weights, allocated before, added), held at each step's end and the peak.
- Host, measured from the process after the last step: the pages of the optimizer's host slabs that are resident
  (``/proc/self/pagemap``'s present bit, page by page over each slab's address range) and, of those, the pinned
  ones (slabs whose memory CUDA reports as page-locked host memory), per offloaded parameter; beside
  ``stats()["host_bytes_per_param"]`` (the bytes the slabs were sized for), which they match up to page rounding
  once every buffer has been written.

With ``--host``: instead, the host bytes per offloaded parameter that ``stats()["host_bytes_per_param"]`` counts
(the slabs and the landing ring) after ``--steps`` steps, for every ZenFlowAdamW mode, also at ``overlap_steps=1``
(one window sum with accumulate="host").

Rows: ``torch AdamW`` (moments in the model dtype, on the device), ZenFlowAdamW ``accumulate="device"`` and
``"host"``, and ``"host"`` with ``grads_in_backward`` (the offloaded gradients consumed in backward), each also with
bf16 moments where the optimizer has ``state_dtype``, for fp32 and bf16 models; for a bf16 model also ``"host"`` at
``overlap_steps=1`` and each mode at its leanest with ``host_snapshot=False`` (:func:`bf16_optimizers`). This file
imports nothing else from bench/, so tests load it by path.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import mmap
import os
import platform
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.config import ZenFlowConfig

__all__ = ["MemoryFigures", "host_bytes_per_param", "host_pages", "measure", "mlp", "optimizers"]


@dataclass(frozen=True)
class MemoryFigures:
    """Device bytes per model parameter: held at the end of a step (the largest over the run) and at peak. Host
    bytes per offloaded parameter after the last step (None for an optimizer without host slabs): resident and
    pinned, measured from the process, and ``stats()``'s ``host_bytes_per_param``."""

    held: float
    peak: float
    host_resident: float | None = None
    host_pinned: float | None = None
    host_stats: float | None = None


def mlp(layers: int, width: int, dtype: torch.dtype, device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(device=device, dtype=dtype)


def _zen(**kw: object) -> Callable[[nn.Module], object]:
    return lambda m: ZenFlowAdamW(m.parameters(), lr=1e-3, **kw)


def optimizers(topk_ratio: float = 0.1, update_interval: int = 4, overlap_steps: int | None = None, *,
               state_dtypes: bool = False, host_snapshot: bool = True) -> dict[str, Callable[[nn.Module], object]]:
    """The optimizers compared, each built over a model's parameters, in the steady state (``warmup_steps=0``);
    ``overlap_steps`` None merges at the next window end (two window sums with accumulate="host", 1: one);
    ``state_dtypes``: also each ZenFlowAdamW mode with bf16 moments, where the optimizer has the ``state_dtype``
    knob; ``host_snapshot`` the ZenFlowAdamW knob."""
    zen = dict(topk_ratio=topk_ratio, update_interval=update_interval, warmup_steps=0, overlap_steps=overlap_steps)
    if not host_snapshot:
        zen["host_snapshot"] = False
    out = {"torch AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)}
    has_state_dtype = "state_dtype" in {f.name for f in dataclasses.fields(ZenFlowConfig)}
    for suffix, extra in [("", {})] + ([(", bf16 moments", {"state_dtype": "bfloat16"})]
                                       if state_dtypes and has_state_dtype else []):
        kw = {**zen, **extra}
        out[f"ZenFlow device{suffix}"] = _zen(accumulate="device", **kw)
        out[f"ZenFlow host{suffix}"] = _zen(accumulate="host", **kw)
        out[f"ZenFlow host + grads_in_backward{suffix}"] = _zen(accumulate="host", grads_in_backward=True, **kw)
    return out


def bf16_optimizers() -> dict[str, Callable[[nn.Module], object]]:
    """The rows of a bf16 model: :func:`optimizers` with bf16 moments, accumulate="host" also at overlap_steps=1
    (one window sum), and each mode at its leanest without the host snapshot (2 bytes per parameter)."""
    out = optimizers(state_dtypes=True)
    one = optimizers(overlap_steps=1, state_dtypes=True)
    out.update({f"{name}, overlap_steps=1": make for name, make in one.items() if name.startswith("ZenFlow host")})
    for steps in (None, 1):
        lean = optimizers(overlap_steps=steps, state_dtypes=True, host_snapshot=False)
        out.update({name + (", overlap_steps=1" if steps else "") + ", host_snapshot=False": make
                    for name, make in lean.items()
                    if name.startswith("ZenFlow host" if steps else "ZenFlow device")})
    return out


def host_pages(opt: object) -> tuple[int, int] | None:
    """(resident, pinned) bytes of ``opt``'s host allocations (its slabs and the landing ring), read from the
    process: each slab's pages present in ``/proc/self/pagemap`` (bit 63 of a page's entry), and those of the slabs
    CUDA reports page-locked. None for an optimizer without host slabs."""
    pipeline = getattr(opt, "_pipeline", None)
    if pipeline is None:
        return None
    page = mmap.PAGESIZE
    resident = pinned = 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        for slab in pipeline.host_slabs():
            start = slab._storage.data_ptr()
            pages = -(-max(slab.nbytes, 1) // page)
            pagemap.seek(start // page * 8)
            entries = struct.unpack(f"{pages}Q", pagemap.read(8 * pages))
            here = sum(e >> 63 & 1 for e in entries) * page
            resident += here
            if slab.views and slab.views[0].is_pinned():
                pinned += here
    return resident, pinned


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
            figures = MemoryFigures(held[0] / numel, (torch.cuda.max_memory_allocated() - base) / numel)
        else:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        profile_memory=True) as prof:
                _train(model, opt, steps, batch, _mark_step_end)
            figures = _from_events(prof, weights, numel)
        if not hasattr(opt, "flush"):
            return figures
        # The host job in flight writes the snapshot (and may be the first to touch its pages): read the pages once
        # no host work is pending, as they are at every later step.
        opt.flush()
        host = host_pages(opt)
        stats = opt.stats()
        offloaded = stats["host_bytes"] / stats["host_bytes_per_param"]
        return dataclasses.replace(figures, host_resident=host[0] / offloaded, host_pinned=host[1] / offloaded,
                                   host_stats=stats["host_bytes_per_param"])
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
    ap.add_argument("--host", action="store_true", help="only stats()' host bytes per parameter per mode, also at "
                    "overlap_steps=1")
    ap.add_argument("--out", type=str, default=None, help="also write the table to this Markdown record")
    args = ap.parse_args(argv)
    if args.host:
        _print_host(args)
        return
    command = "python bench/report_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"- command: `{command.strip()}`",
             f"- machine: {platform.node()}: {os.cpu_count()} cores, device {args.device}, torch {torch.__version__}",
             f"- model: {args.layers} x [{args.width}, {args.width}] MLP (biases resident), r = 0.1, U = 4, "
             f"{args.steps} steps; device bytes per model parameter, host bytes per offloaded parameter (resident "
             "and pinned: the slabs' pages read from /proc/self/pagemap after the last step; stats: "
             'stats()["host_bytes_per_param"])', "",
             "| optimizer | model | device held B/param | device peak B/param | host resident B/param | "
             "host pinned B/param | host stats() B/param |", "|---|---|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)

    def host(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}"

    for dtype in (torch.float32, torch.bfloat16):
        for name, make in (bf16_optimizers() if dtype == torch.bfloat16 else optimizers(state_dtypes=True)).items():
            fig = measure(make, dtype=dtype, device=args.device, steps=args.steps, layers=args.layers,
                          width=args.width)
            lines.append(f"| {name} | {str(dtype).removeprefix('torch.')} | {fig.held:.2f} | {fig.peak:.2f} | "
                         f"{host(fig.host_resident)} | {host(fig.host_pinned)} | {host(fig.host_stats)} |")
            print(lines[-1], flush=True)
    if args.out:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(f"# Device and host memory per mode, measured (bench/report_memory.py), {date}\n\n")
            f.write("\n".join(lines) + "\n")



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
