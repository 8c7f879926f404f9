"""Device kernels on a GPU, [8192, 8192]: the fused step and the merge against a device-to-device copy of the same
bytes (the bandwidth ceiling) and against ``torch.optim.AdamW(fused=True)`` on a same-size parameter.

GPU only: every test is marked ``gpu`` and skipped cleanly without CUDA. Run:
``python -m pytest bench/bench_device_kernels.py -p no:cacheprovider -o python_files='bench_*.py'``.
``benchmark.extra_info`` holds ``bytes`` (what the op actually moves), ``GB/s``, ``params/s``, ``copy_GB/s`` (a
``copy_`` of the same byte count, timed in the same test) and ``ratio_to_copy`` (1.0 = as fast as a copy).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from common import make_slot
from providers import HP, OPTIMIZER_HP

pytestmark = pytest.mark.gpu

ROWS = COLS = 8192
RATIOS = [0.05, 0.1, 0.25]  # selected fraction r; 0.1 is the library's default
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ROUNDS, WARMUP = 30, 3


def _fused_step_bytes(rows: int, cols: int, k: int, elem: int, *, acc: bool = True) -> int:
    """Bytes a steady-state fused step (scores on) moves: with ``acc`` (accumulate="device"), the unselected columns'
    fp32 sums are read and written; without (accumulate="host", grads_in_backward), they are not on the device."""
    n, sel = rows * cols, rows * k
    grad = n * elem  # read once, every column
    acc = (n - sel) * 4 * 2 if acc else 0  # unselected columns: read + write fp32
    param = sel * elem  # selected columns: write only (the master is the source)
    state = sel * 3 * 4 * 2  # compact master, exp_avg, exp_avg_sq: read + write fp32
    per_column = cols * (4 + 4 * 2) + k * 4  # slot, score read + write, col_step of selected columns
    return grad + acc + param + state + per_column


def _merge_bytes(rows: int, cols: int, k: int, elem: int) -> int:
    return rows * (cols - k) * elem * 2 + cols * 4  # snapshot read + param write on unselected columns, slot


def _adamw_bytes(numel: int, elem: int) -> int:
    return numel * elem * 7  # param r/w, grad r, exp_avg r/w, exp_avg_sq r/w (state in the param's dtype)


def _timed(fn):
    """The timed function: the launch plus a synchronize, so the benchmark measures the kernel, not the enqueue."""

    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


@functools.cache
def _copy_seconds(nbytes: int) -> float:
    """Median seconds of a device-to-device copy moving ``nbytes`` in total (half read, half written)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(WARMUP):
        dst.copy_(src)
    times = []
    for _ in range(ROUNDS):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _record(benchmark, nbytes: int, numel: int) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: nothing was timed
        return
    seconds = stats.stats.median
    copy_s = _copy_seconds(nbytes)
    benchmark.extra_info.update({
        "bytes": nbytes,
        "GB/s": nbytes / seconds / 1e9,
        "params/s": numel / seconds,
        "copy_GB/s": nbytes / copy_s / 1e9,
        "ratio_to_copy": copy_s / seconds,
    })


@pytest.mark.benchmark(group="fused_step")
@pytest.mark.parametrize("r", RATIOS, ids=lambda r: f"r{r}")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_fused_step(benchmark, dtype, r):
    from zenflow_triton.kernels.fused_step import fused_step_

    torch.manual_seed(0)
    dt = DTYPES[dtype]
    slot = make_slot(COLS, r).cuda()
    k = int((slot >= 0).sum())
    dev = "cuda"
    param = torch.randn(ROWS, COLS, device=dev).mul_(0.02).to(dt)
    grad = torch.randn(ROWS, COLS, device=dev).mul_(1e-3).to(dt)
    state = dict(
        score=torch.zeros(COLS, device=dev), slot=slot, col_step=torch.full((COLS,), 10, dtype=torch.int32, device=dev),
        master=torch.randn(ROWS, k, device=dev).mul_(0.02), exp_avg=torch.randn(ROWS, k, device=dev).mul_(1e-3),
        exp_avg_sq=torch.rand(ROWS, k, device=dev).mul_(1e-6), acc=torch.zeros(ROWS, COLS, device=dev),
    )
    fn = _timed(lambda: fused_step_(param, grad, **state, hp=OPTIMIZER_HP, accumulate=True))
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record(benchmark, _fused_step_bytes(ROWS, COLS, k, param.element_size()), ROWS * COLS)


@pytest.mark.benchmark(group="merge")
@pytest.mark.parametrize("r", RATIOS, ids=lambda r: f"r{r}")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_merge(benchmark, dtype, r):
    from zenflow_triton.kernels.merge import merge_

    dt = DTYPES[dtype]
    slot = make_slot(COLS, r).cuda()
    k = int((slot >= 0).sum())
    param = torch.randn(ROWS, COLS, device="cuda").to(dt)
    snapshot = torch.randn(ROWS, COLS, device="cuda").to(dt)
    benchmark.pedantic(_timed(lambda: merge_(param, snapshot, slot)), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record(benchmark, _merge_bytes(ROWS, COLS, k, param.element_size()), ROWS * (COLS - k))


@pytest.mark.benchmark(group="baselines")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_torch_adamw_fused(benchmark, dtype):
    """What one step costs when the whole [8192, 8192] parameter and its state live on the device."""
    dt = DTYPES[dtype]
    p = torch.nn.Parameter(torch.randn(ROWS, COLS, device="cuda").mul_(0.02).to(dt))
    p.grad = torch.randn(ROWS, COLS, device="cuda").mul_(1e-3).to(dt)
    opt = torch.optim.AdamW([p], **HP, fused=True)
    benchmark.pedantic(_timed(opt.step), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record(benchmark, _adamw_bytes(p.numel(), p.element_size()), p.numel())


@pytest.mark.benchmark(group="baselines")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_copy(benchmark, dtype):
    """The ceiling: a device-to-device copy of one [8192, 8192] tensor."""
    src = torch.randn(ROWS, COLS, device="cuda").to(DTYPES[dtype])
    dst = torch.empty_like(src)
    benchmark.pedantic(_timed(lambda: dst.copy_(src)), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record(benchmark, 2 * src.numel() * src.element_size(), src.numel())


# ------------------------------------------------------------------------------ many parameters: one step's launches

# The offloaded weights of 8 layers of a ~1B Llama-style decoder (d_model 2048, ffn 5632): q, k, v, o and gate, up,
# down per layer, 56 matrices and 411M parameters in all, bf16, r = 0.1. What one optimizer step launches.
LAYER = [(2048, 2048)] * 4 + [(5632, 2048), (5632, 2048), (2048, 5632)]
GROUP_SHAPES = LAYER * 8
GROUP_R = 0.1


@functools.cache
def _group() -> list:
    from zenflow_triton.kernels.device_ops import FusedStepArgs

    torch.manual_seed(0)
    calls = []
    for i, (rows, cols) in enumerate(GROUP_SHAPES):
        slot = make_slot(cols, GROUP_R, seed=i).cuda()
        k = int((slot >= 0).sum())
        dev = "cuda"
        calls.append(FusedStepArgs(
            param=torch.randn(rows, cols, device=dev).mul_(0.02).bfloat16(),
            grad=torch.randn(rows, cols, device=dev).mul_(1e-3).bfloat16(),
            score=torch.zeros(cols, device=dev), slot=slot,
            col_step=torch.full((cols,), 10, dtype=torch.int32, device=dev),
            master=torch.randn(rows, k, device=dev).mul_(0.02), exp_avg=torch.randn(rows, k, device=dev).mul_(1e-3),
            exp_avg_sq=torch.rand(rows, k, device=dev).mul_(1e-6), acc=torch.zeros(rows, cols, device=dev),
            hp=OPTIMIZER_HP, accumulate=True, count_step=True))  # as the optimizer calls it: counts its own steps
    return calls


def _group_bytes(*, acc: bool = True) -> int:
    return sum(_fused_step_bytes(c.param.shape[0], c.param.shape[1], c.master.shape[1], 2, acc=acc) for c in _group())


def _no_acc_group() -> list:
    """The same calls as accumulate="host" issues them (and grads_in_backward, on its compact gradient): no device
    sums, so the unselected columns cost only their gradient read."""
    return [dataclasses.replace(c, acc=None, accumulate=False) for c in _group()]


@functools.cache
def _torch_group_seconds() -> float:
    """Median seconds of torch.optim.AdamW(fused=True).step() over parameters of the same shapes (bf16, state on the
    device): what a step costs without offload, measured with CUDA events."""
    params = [torch.nn.Parameter(c.param.clone()) for c in _group()]
    for p, c in zip(params, _group()):
        p.grad = c.grad.clone()
    opt = torch.optim.AdamW(params, **HP, fused=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(WARMUP):
        opt.step()
    times = []
    for _ in range(ROUNDS):
        start.record()
        opt.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _enqueue_seconds(fn, rounds: int = 10) -> float:
    """Host seconds to issue ``fn`` (launches only, the GPU still busy): the per-step CPU overhead.

    Warmed up with as many calls as are timed: each call's call tables go through pinned blocks of torch's caching
    host allocator, held until their copies have run, so ``rounds`` calls queued back to back need ``rounds`` blocks.
    With one call of warm-up the timed calls would pay ``cudaHostAlloc`` for the rest (a training run pays it in
    its first steps only)."""
    import time

    for _ in range(rounds):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    seconds = (time.perf_counter() - t0) / rounds
    torch.cuda.synchronize()
    return seconds


def _record_group(benchmark, fn, *, acc: bool = True) -> None:
    numel = sum(c.param.numel() for c in _group())
    nbytes = _group_bytes(acc=acc)
    _record(benchmark, nbytes, numel)
    if getattr(benchmark, "stats", None) is None:
        return
    from zenflow_triton.kernels import fused_step

    benchmark.extra_info.update({
        "params": len(GROUP_SHAPES),
        "bytes_per_param": nbytes / numel,
        # The ratio_to_torch_fused this byte count allows when both run at the same share of the bandwidth: torch's
        # step moves 14 bytes per bf16 parameter (_adamw_bytes), the fused step with fp32 sums about 11.8 at r = 0.1.
        "torch_fused_byte_ratio": _adamw_bytes(numel, 2) / nbytes,
        "state_maxnreg": fused_step.STATE_MAXNREG,
        "torch_fused_s": _torch_group_seconds(),
        "ratio_to_torch_fused": _torch_group_seconds() / benchmark.stats.stats.median,
        "enqueue_us_per_param": _enqueue_seconds(fn) / len(GROUP_SHAPES) * 1e6,
    })


@pytest.mark.benchmark(group="grouped")
def test_fused_steps_grouped(benchmark):
    """One fused_steps_ call for all 56 matrices: one launch (plus one for the split scores)."""
    from zenflow_triton.kernels.fused_step import fused_steps_

    calls = _group()
    fn = functools.partial(fused_steps_, calls)
    benchmark.pedantic(_timed(fn), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record_group(benchmark, fn)


@pytest.mark.benchmark(group="grouped")
def test_fused_steps_grouped_no_acc(benchmark):
    """test_fused_steps_grouped as accumulate="host" runs it (acc=None): the device step's traffic without the sums."""
    from zenflow_triton.kernels.fused_step import fused_steps_

    fn = functools.partial(fused_steps_, _no_acc_group())
    benchmark.pedantic(_timed(fn), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record_group(benchmark, fn, acc=False)


@pytest.mark.benchmark(group="grouped")
def test_fused_steps_grouped_uncapped(benchmark, monkeypatch):
    """test_fused_steps_grouped without the register cap of the variants with compact state (fused_step.STATE_MAXNREG):
    ptxas's own allocation, 2 programs per SM instead of 3 (see STATE_MAXNREG). The pair decides the cap."""
    from zenflow_triton.kernels import fused_step

    monkeypatch.setattr(fused_step, "STATE_MAXNREG", None)
    calls = _group()
    fn = functools.partial(fused_step.fused_steps_, calls)
    benchmark.pedantic(_timed(fn), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record_group(benchmark, fn)


@pytest.mark.benchmark(group="grouped")
def test_fused_step_per_parameter(benchmark):
    """The same work as 56 fused_step_ launches, as the optimizer issued it before fused_steps_."""
    from zenflow_triton.kernels.fused_step import fused_step_

    def fn() -> None:
        for c in _group():
            c.apply(fused_step_)

    benchmark.pedantic(_timed(fn), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record_group(benchmark, fn)
