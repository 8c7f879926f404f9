"""What the benches compare, built in one place: host AdamW kernels and whole optimizers.

Host AdamW providers (``bench_host_adamw.py``, ``report_host.py``): the memory-bandwidth ceiling, ``host_adamw_``
(fp32 grad, or bf16 grad in and bf16 snapshot out, at several selected fractions), ``torch.optim.AdamW(fused=True)``
with and without a separate fp32 -> bf16 copy of the weights, and DeepSpeed's ``DeepSpeedCPUAdam`` when it imports.

Optimizer providers (``bench_optimizer.py``, ``report_cpu.py``, ``gpu_suite.py``): torch's AdamW (fused and
default), synchronous offload, ZenFlowAdamW at fixed knobs and ``"auto"``, and torchao's ``CPUOffloadOptimizer``;
plus what every optimizer bench needs around them (memory held, closing, the steps before the first selection).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
from common import HostBuffers, bench_shape, bench_threads, make_host_buffers, make_slot
from numba import njit, prange

from zenflow_triton.kernels import AdamHyperparams

__all__ = [
    "BYTES_PER_PARAM",
    "HOST_HP",
    "HOST_TORCH_HP",
    "HP",
    "OPTIMIZER_HP",
    "HostAdamWProvider",
    "OptimizerProvider",
    "adam_hyperparams",
    "auto_unavailable_reason",
    "ceiling_",
    "close_optimizer",
    "deepspeed_cpu_adam",
    "host_adamw_providers",
    "optimizer_memory",
    "optimizer_providers",
    "steps_before_selection",
]


def adam_hyperparams(torch_kwargs: dict[str, Any]) -> AdamHyperparams:
    """The kernels' hyperparameter record for the keyword arguments of ``torch.optim.AdamW``."""
    beta1, beta2 = torch_kwargs["betas"]
    return AdamHyperparams(lr=torch_kwargs["lr"], beta1=beta1, beta2=beta2, eps=torch_kwargs["eps"],
                           weight_decay=torch_kwargs["weight_decay"])


# The same hyperparameters for every optimizer provider (``torch.optim.AdamW``'s keywords, which ZenFlowAdamW shares)
# and for the device-kernel benches; lr small enough that weights stay sane over hundreds of steps.
HP: dict[str, Any] = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
OPTIMIZER_HP = adam_hyperparams(HP)
# The host-kernel benches' hyperparameters: one step per call on fixed buffers, any sane values do.
HOST_TORCH_HP: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
HOST_HP = adam_hyperparams(HOST_TORCH_HP)


# ----------------------------------------------------------------------------------------------------- host AdamW

# Bytes each provider must move per parameter (GB/s figures use these; write-allocate reads are not counted).
# AdamW reads master, m, v, grad and writes master, m, v: fp32 grad 4 * 4 + 3 * 4 = 28. bf16 grad in and bf16
# snapshot out: 12 + 2 read, 12 + 2 written = 28 as well. torch fused AdamW (fp32 grad) then a separate
# fp32 -> bf16 copy of the weights: 28 + 4 read + 2 written = 34.
# "bf16 moments" (state_dtype="bfloat16"): master 4 + 4, m and v 2 + 2 each, bf16 grad 2, bf16 snapshot 2.
# The bf16-moment rows' step counts: one for every column (the kernel's uniform loops), or "per-column steps" (col_step
# 10 + 0..5 at random): what training runs once the selection has moved, since selected columns count their steps
# on the device; the kernel's general loop, with per-column bias corrections and noise keys.
STEP_VARIANTS = ("", " per-column steps")
BYTES_PER_PARAM = {"fp32": 28, "bf16": 28, "torch+copy": 34, "ceiling": 28, "bf16 moments": 20}


# No cache=True here: numba's cache records the importing module's name, and this file is imported both as
# `providers` (pytest, scripts) and possibly as `bench.providers`; a cache written under one name breaks the other.
@njit(nogil=True)
def _ceiling_run(p, m, v, g, a, b):  # pragma: no cover - numba
    # Its own function with unsigned indices so that LLVM vectorizes it (see kernels/cpu_adamw.py).
    for i in range(a, b):
        gi = g[i]
        p[i] = p[i] + gi
        m[i] = m[i] + gi
        v[i] = v[i] + gi


@njit(parallel=True, nogil=True)
def _ceiling_kernel(p, m, v, g, chunk):  # pragma: no cover - numba
    n = p.shape[0]
    for c in prange((n + chunk - 1) // chunk):
        a = c * chunk
        _ceiling_run(p, m, v, g, np.uint64(a), np.uint64(min(a + chunk, n)))


@njit(nogil=True)
def _ceiling16_run(p, m, v, g, s, a, b):  # pragma: no cover - numba
    # The bf16-moment kernel's traffic: fp32 p read and written, 16-bit m, v read and written, g read, s written.
    for i in range(a, b):
        gi = g[i]
        p[i] = p[i] + np.float32(1.0)
        m[i] = m[i] + gi
        v[i] = v[i] + gi
        s[i] = gi


@njit(parallel=True, nogil=True)
def _ceiling16_kernel(p, m, v, g, s, chunk):  # pragma: no cover - numba
    n = p.shape[0]
    for c in prange((n + chunk - 1) // chunk):
        a = c * chunk
        _ceiling16_run(p, m, v, g, s, np.uint64(a), np.uint64(min(a + chunk, n)))


def ceiling_bf16_moments_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          s: torch.Tensor | None) -> None:
    """:func:`ceiling_` for state_dtype="bfloat16" with bf16 grad and snapshot: 20 B/param, trivial math (the 16-bit
    streams as int16 bits); ``s`` None: no snapshot stream, 18 B/param (the fp32 ceiling loop over 16-bit m, v, g)."""
    def bits(t: torch.Tensor):
        return t.view(-1).view(torch.int16).numpy()

    if s is None:
        _ceiling_kernel(p.view(-1).numpy(), bits(m), bits(v), bits(g), 16384)
    else:
        _ceiling16_kernel(p.view(-1).numpy(), bits(m), bits(v), bits(g), bits(s), 16384)


def ceiling_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
    """Same traffic as fp32 AdamW (read 4 fp32 arrays, write 3), trivial math: the memory-bandwidth ceiling.

    A plain streaming loop (no software prefetch), so a pure measure of what the memory moves: host_adamw_'s
    prefetching can take it slightly past this "ceiling" on a quiet machine.
    """
    # Work items of 16384 elements; the item size makes no measurable difference from 1024 to 65536 (the same
    # sweep for host_adamw_'s _CHUNK_COLS).
    _ceiling_kernel(p.view(-1).numpy(), m.view(-1).numpy(), v.view(-1).numpy(), g.view(-1).numpy(), 16384)


@dataclass
class HostAdamWProvider:
    """One way of doing a host AdamW step on a ``[R, C]`` parameter; ``step()`` runs it once, in place."""

    name: str
    step: Callable[[], object]
    numel: int
    bytes_per_param: int
    updated_fraction: float = 1.0
    group: str = "fp32"  # providers in a group are compared with each other: "fp32" or "bf16"


def host_adamw_step(b: HostBuffers, slot: torch.Tensor, threads: int) -> Callable[[], None]:
    """One ``host_adamw_`` call on ``b`` (count 1, ``HOST_HP``), as the worker makes it at a window end."""
    from zenflow_triton.kernels.cpu_adamw import host_adamw_

    def step() -> None:
        host_adamw_(b.master, b.exp_avg, b.exp_avg_sq, b.grad, count=1, slot=slot, col_step=b.col_step, hp=HOST_HP,
                    snapshot=b.snapshot, num_threads=threads)

    return step


def _bf16_moments(b: HostBuffers) -> HostBuffers:
    return dataclasses.replace(b, exp_avg=b.exp_avg.to(torch.bfloat16), exp_avg_sq=b.exp_avg_sq.to(torch.bfloat16))


def deepspeed_cpu_adam() -> type | None:
    """DeepSpeed's ``DeepSpeedCPUAdam`` when deepspeed imports and its C++ op builds, else None."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # ImportError, or deepspeed's own errors when its accelerator or op builder is unusable
        return None
    return DeepSpeedCPUAdam


def host_adamw_providers(
    numel: int | None = None, *, threads: int | None = None, selected: tuple[float, ...] = (0.0, 0.1, 0.5),
    patterns: tuple[str, ...] = ("random",), names: tuple[str, ...] | None = None,
) -> dict[str, HostAdamWProvider]:
    """Each provider docs/performance.md's table compares, on its own buffers (never another's data).

    Providers: ``ceiling``; ``host_adamw fp32 <sel>``; ``torch fused``; ``host_adamw bf16 <sel>`` (bf16 grad in,
    bf16 snapshot out); ``torch fused + bf16 copy`` (fp32 grad, then ``snapshot.copy_(param)``); ``ceiling bf16
    moments`` and ``host_adamw bf16 moments <sel>[ per-column steps]`` (state_dtype="bfloat16", bf16 grad and
    snapshot; ``STEP_VARIANTS``); ``deepspeed``
    (``DeepSpeedCPUAdam``, when importable). ``names`` restricts the set (to keep memory down).
    Sets torch's and numba's thread counts for the process to ``threads``.
    """
    threads = bench_threads() if threads is None else threads
    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    rows, cols = bench_shape(numel)
    n = rows * cols
    out: dict[str, HostAdamWProvider] = {}

    def want(name: str) -> bool:
        return names is None or name in names

    if want("ceiling"):
        c = make_host_buffers(rows, cols)
        out["ceiling"] = HostAdamWProvider("ceiling", lambda: ceiling_(c.master, c.exp_avg, c.exp_avg_sq, c.grad), n,
                                           BYTES_PER_PARAM["ceiling"])
    for group, gdt, sdt in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, torch.bfloat16)):
        todo = [(s, p) for s in selected for p in (patterns if s else ("random",))]
        labels = {(s, p): f"host_adamw {group} {s:.0%}" + ("" if not s or p == "random" else f" {p}")
                  for s, p in todo}
        if not any(want(v) for v in labels.values()):
            continue
        b = make_host_buffers(rows, cols, grad_dtype=gdt, snapshot_dtype=sdt, seed=1)
        for (s, p), label in labels.items():
            if not want(label):
                continue
            out[label] = HostAdamWProvider(label, host_adamw_step(b, make_slot(cols, s, pattern=p), threads), n,
                                           BYTES_PER_PARAM[group], 1.0 - round(s * cols) / cols, group)
    for label, copy in (("torch fused", False), ("torch fused + bf16 copy", True)):
        if not want(label):
            continue
        t = make_host_buffers(rows, cols, snapshot_dtype=torch.bfloat16 if copy else None, seed=2)
        param = torch.nn.Parameter(t.master)
        param.grad = t.grad
        opt = torch.optim.AdamW([param], **HOST_TORCH_HP, fused=True)
        if copy:
            def step(opt=opt, param=param, snap=t.snapshot):
                opt.step()
                snap.copy_(param.detach())
        else:
            step = opt.step
        out[label] = HostAdamWProvider(label, step, n, BYTES_PER_PARAM["torch+copy" if copy else "fp32"], 1.0,
                                       "bf16" if copy else "fp32")
    if want("ceiling bf16 moments"):
        c16 = _bf16_moments(make_host_buffers(rows, cols, grad_dtype=torch.bfloat16, snapshot_dtype=torch.bfloat16))
        out["ceiling bf16 moments"] = HostAdamWProvider(
            "ceiling bf16 moments",
            lambda: ceiling_bf16_moments_(c16.master, c16.exp_avg, c16.exp_avg_sq, c16.grad, c16.snapshot),
            n, BYTES_PER_PARAM["bf16 moments"], 1.0, "bf16 moments")
    for s, label in ((s, f"host_adamw bf16 moments {s:.0%}{steps}") for s in selected for steps in STEP_VARIANTS):
        if want(label):
            b = _bf16_moments(make_host_buffers(rows, cols, grad_dtype=torch.bfloat16, snapshot_dtype=torch.bfloat16,
                                                seed=5))
            if label.endswith(STEP_VARIANTS[1]):
                gen = torch.Generator().manual_seed(7)
                b.col_step.add_(torch.randint(0, 6, (cols,), dtype=torch.int32, generator=gen))
            out[label] = HostAdamWProvider(label, host_adamw_step(b, make_slot(cols, s), threads), n,
                                           BYTES_PER_PARAM["bf16 moments"], 1.0 - round(s * cols) / cols,
                                           "bf16 moments")
    cpu_adam = deepspeed_cpu_adam() if want("deepspeed") else None
    if cpu_adam is not None:
        d = make_host_buffers(rows, cols, seed=3)
        dparam = torch.nn.Parameter(d.master)
        dparam.grad = d.grad
        dopt = cpu_adam([dparam], **HOST_TORCH_HP, adamw_mode=True)
        out["deepspeed"] = HostAdamWProvider("deepspeed", dopt.step, n, BYTES_PER_PARAM["fp32"])
    return out


# ----------------------------------------------------------------------------------------------------- optimizers


@dataclass(frozen=True)
class OptimizerProvider:
    """One way to optimize a list of parameters; ``build(params)`` returns a ready ``torch.optim`` optimizer."""

    name: str
    label: str
    build: Callable[[Sequence[torch.Tensor]], Any]
    zenflow: bool = False
    note: str = ""


def auto_unavailable_reason() -> str | None:
    """None when ZenFlowAdamW's ``"auto"`` knobs can run here, else why not (the autotuner does not import)."""
    try:
        from zenflow_triton.autotune import plan_for_optimizer  # noqa: F401
    except Exception as exc:  # ImportError, or the package's own import-time errors
        return f"zenflow_triton.autotune.plan_for_optimizer unavailable: {type(exc).__name__}: {exc}"
    return None


def _torchao_offload() -> type | None:
    """torchao's ``CPUOffloadOptimizer`` (its import path moved out of ``prototype`` in 2025), or None."""
    for module in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            mod = __import__(module, fromlist=["CPUOffloadOptimizer"])
            return mod.CPUOffloadOptimizer
        except Exception:  # ImportError, or torchao failing on this torch build: either way, not usable
            continue
    return None


def optimizer_providers(
    *, cpu_threads: int | None = None, extra: Sequence[str] = (), auto: bool = True,
    zenflow_kwargs: dict[str, Any] | None = None,
) -> dict[str, OptimizerProvider]:
    """The providers every optimizer bench compares, in a stable order.

    Always: ``torch_adamw_fused`` (the baseline), ``torch_adamw`` (torch's default implementation),
    ``sync_offload`` (ZenFlowAdamW with ``topk_ratio=0, update_interval=1, overlap=False``: the ZeRO-Offload
    schedule), ``zenflow`` (``topk_ratio=0.1, update_interval=4``), and ``zenflow_auto`` when ``auto`` and the
    autotuner imports. ``extra`` adds ``torchao_offload`` (when torchao imports; CUDA only), ``zenflow_host``
    (``zenflow`` with ``accumulate="host"``: the window sum in host memory, for the device-memory rows) and
    ``zenflow_host_gib`` (that with ``grads_in_backward=True``: the offloaded gradients consumed during backward)
    and ``sync_offload_host`` (``sync_offload`` with ``accumulate="host"``: each step's gradient copied to the host in
    its own dtype, as ZeRO-Offload ships half-precision gradients, where "auto" on a GPU would sum it into an fp32
    device buffer and copy that).
    ``cpu_threads`` is passed to every ZenFlowAdamW (None: the library's default, all cores but one), and so are
    ``zenflow_kwargs`` (e.g. a short ``worker_timeout`` for a suite that must not hang).
    """
    from zenflow_triton import ZenFlowAdamW

    def zen(**kw: Any) -> Callable[[Sequence[torch.Tensor]], Any]:
        kw.setdefault("cpu_threads", cpu_threads)
        kw.setdefault("warmup_steps", 0)  # the steady state is what is timed (the default warm-up is 100 steps)
        kw = {**(zenflow_kwargs or {}), **kw}
        return lambda params: ZenFlowAdamW(params, **HP, **kw)

    out: dict[str, OptimizerProvider] = {}

    def add(p: OptimizerProvider) -> None:
        out[p.name] = p

    add(OptimizerProvider("torch_adamw_fused", "torch AdamW fused",
                          lambda params: torch.optim.AdamW(params, **HP, fused=True)))
    add(OptimizerProvider("torch_adamw", "torch AdamW (default impl.)", lambda params: torch.optim.AdamW(params, **HP)))
    add(OptimizerProvider("sync_offload", "sync offload (r=0, U=1, no overlap)",
                          zen(topk_ratio=0.0, update_interval=1, overlap=False), zenflow=True))
    add(OptimizerProvider("zenflow", "ZenFlow r=0.1, U=4", zen(topk_ratio=0.1, update_interval=4), zenflow=True))
    if auto and auto_unavailable_reason() is None:
        add(OptimizerProvider("zenflow_auto", "ZenFlow auto", zen(topk_ratio="auto", update_interval="auto"),
                              zenflow=True))
    if "sync_offload_host" in extra:
        add(OptimizerProvider("sync_offload_host", "sync offload (r=0, U=1, no overlap, gradients to host as they are)",
                              zen(topk_ratio=0.0, update_interval=1, overlap=False, accumulate="host"), zenflow=True))
    if "zenflow_host" in extra:
        add(OptimizerProvider("zenflow_host", "ZenFlow r=0.1, U=4, accumulate=host",
                              zen(topk_ratio=0.1, update_interval=4, accumulate="host"), zenflow=True))
    if "zenflow_host_gib" in extra:
        add(OptimizerProvider("zenflow_host_gib", "ZenFlow r=0.1, U=4, accumulate=host, grads_in_backward",
                              zen(topk_ratio=0.1, update_interval=4, accumulate="host", grads_in_backward=True),
                              zenflow=True))
    if "torchao_offload" in extra:
        cls = _torchao_offload()
        if cls is not None:
            # torchao keeps host copies in the parameter's own dtype (bf16 master and moments for bf16 params).
            add(OptimizerProvider("torchao_offload", "torchao CPUOffloadOptimizer",
                                  lambda params: cls(params, torch.optim.AdamW, **HP, fused=True)))
    return out


def steps_before_selection(opt: Any) -> int:
    """Steps a ZenFlowAdamW takes before its first selection step: its warm-up, which the ``"auto"`` knobs extend
    to measure the step time. The step after them resolves ``"auto"`` and fixes U and S."""
    from zenflow_triton.auto import AUTO_WARMUP_STEPS

    knobs = getattr(opt, "_knobs", None)  # overlap_steps="auto" alone plans nothing on CPU tensors (auto.Knobs)
    if knobs is not None:
        return knobs.warmup
    cfg = opt.config
    return max(cfg.warmup_steps, AUTO_WARMUP_STEPS) if cfg.is_auto else cfg.warmup_steps


def close_optimizer(opt: Any) -> None:
    """Stop ZenFlow's worker and release its host slabs; other optimizers need nothing."""
    close = getattr(opt, "close", None)
    if callable(close):
        close()


def optimizer_memory(opt: Any, params: Sequence[torch.Tensor]) -> dict[str, float]:
    """Bytes the optimizer holds: ZenFlow's own telemetry, or the state tensors of a torch optimizer."""
    stats = getattr(opt, "stats", None)
    if callable(stats):
        s = stats()
        return {"host_bytes": s["host_bytes"], "pinned_bytes": s["pinned_bytes"],
                "host_bytes_per_param": s["host_bytes_per_param"], "offloaded_params": s["offloaded_params"]}
    held = pinned = 0
    # torchao's CPUOffloadOptimizer keeps one inner optimizer per parameter; torch's keep `state` directly.
    inner = list(getattr(opt, "optim_dict", {}).values()) or [opt]
    for o in inner:
        for st in o.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    held += v.numel() * v.element_size()
                    pinned += v.numel() * v.element_size() if v.is_pinned() else 0
    for p_host in getattr(opt, "param_d2h_map", {}).values():  # torchao: pinned host param and its grad
        for t in (p_host, p_host.grad):
            if t is not None:
                held += t.numel() * t.element_size()
                pinned += t.numel() * t.element_size() if t.is_pinned() else 0
    n = sum(p.numel() for p in params)
    return {"state_bytes": held, "pinned_bytes": pinned, "state_bytes_per_param": held / n if n else 0.0}
