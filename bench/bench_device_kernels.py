"""Device kernels on a GPU: one step's grouped fused step over the weights of 8 layers of a 1B decoder (the goal
rows, first), then the fused step and the merge on [8192, 8192], each against a device-to-device copy of the same
bytes (the bandwidth ceiling) and against ``torch.optim.AdamW(fused=True)`` on the same weights.

GPU only: every test is marked ``gpu`` and skipped cleanly without CUDA. Run:
``python -m pytest bench/bench_device_kernels.py -p no:cacheprovider -o python_files='bench_*.py'``.

Two clocks. pytest-benchmark's own figure (``median_s``, kept as ``wall_s``) is host wall time around the launches
and a synchronize, from an idle GPU: it includes the host's work to issue them. Every rate and ratio in
``benchmark.extra_info`` is on ``device_s`` instead, CUDA events around the launches queued behind a sleep kernel
that outlasts that host work, so the GPU runs them back to back: ``GB/s``, ``params/s``, ``copy_GB/s`` (a ``copy_``
of the same byte count, timed the same way) and ``ratio_to_copy`` (1.0 = as fast as a copy). ``bytes`` is what
DRAM moves at the least: whole 32-byte sectors, so a write to a few selected columns of a row costs the sectors they
touch (with 10% of the columns selected at random, ~81% of a bf16 row's sectors), not their own bytes.

With ``$ZENFLOW_BENCH_ROWS`` set, each test appends its row (name, ``median_s`` and ``extra_info``) to that JSON
Lines file as soon as it is measured: the suite keeps the rows of a phase stopped at its time limit, which
pytest-benchmark's ``--benchmark-json`` (written at the session's end) would lose.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import statistics
import time

import pytest
import torch
from common import make_slot
from providers import HP, OPTIMIZER_HP

pytestmark = pytest.mark.gpu

ROWS = COLS = 8192
RATIOS = [0.05, 0.1, 0.25]  # selected fraction r; 0.1 is the library's default
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ROUNDS, WARMUP = 30, 3


SECTOR = 32  # bytes: the unit DRAM and L2 move


def _sectors_touched(slot: torch.Tensor, rows: int, elem: int, *, selected: bool) -> int:
    """Bytes of the 32-byte sectors of an ``[rows, C]`` tensor that hold a selected (or unselected) column: what a
    write to those columns only moves. Rows start on a sector (``C * elem`` a multiple of 32, as in every shape
    here), so one row's count times ``rows``."""
    cols = slot.numel()
    per = SECTOR // elem
    if (cols * elem) % SECTOR:
        raise ValueError(f"C * elem = {cols * elem} is not a multiple of {SECTOR}: rows would not start on a sector")
    hit = (slot.cpu() >= 0) if selected else (slot.cpu() < 0)
    return rows * int(hit.view(-1, per).any(dim=1).sum()) * SECTOR


def _fused_step_bytes(rows: int, slot: torch.Tensor, elem: int, *, acc: bool = True) -> int:
    """Bytes a steady-state fused step (scores on, accumulating) moves through DRAM, by 32-byte sectors: with ``acc``
    (accumulate="device") the fp32 sums' whole tile is read and written (the kernel writes the selected columns back
    as read, for 128-bit accesses); without (accumulate="host", grads_in_backward) they are not on the device."""
    cols = slot.numel()
    n, k = rows * cols, int((slot >= 0).sum())
    grad = n * elem  # read once, every column
    sums = n * 4 * 2 if acc else 0
    param = _sectors_touched(slot, rows, elem, selected=True)  # selected columns: written (the master is the source)
    state = rows * k * 3 * 4 * 2  # compact master, exp_avg, exp_avg_sq (slots in column order): read + write fp32
    per_column = cols * (4 + 4 * 2) + k * 4 * 2  # slot, score read + write, col_step of selected columns r + w
    return grad + sums + param + state + per_column


def _merge_bytes(rows: int, slot: torch.Tensor, elem: int) -> int:
    """The snapshot read and the param written on the unselected columns, by sectors, and the slot."""
    return 2 * _sectors_touched(slot, rows, elem, selected=False) + slot.numel() * 4


def _adamw_bytes(numel: int, elem: int) -> int:
    return numel * elem * 7  # param r/w, grad r, exp_avg r/w, exp_avg_sq r/w (state in the param's dtype)


def _timed(fn):
    """pytest-benchmark's timed function (``wall_s``): the launches plus a synchronize, from an idle GPU, so the host's
    work to issue them counts too. The rates use ``_device_seconds``."""

    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


@functools.cache
def _sleep_cycles_per_second() -> float:
    """The rate of ``torch.cuda._sleep``'s cycle count, measured once with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / (start.elapsed_time(end) / 1e3)


def _device_seconds(fn, rounds: int = ROUNDS) -> float:
    """Median device seconds of ``fn``'s launches: CUDA events around them, queued behind a sleep kernel three times
    as long as the host takes to issue them (and at least 1 ms), so the GPU never waits for the host in between and
    no host time is counted. The same clock for the kernels, the copy and torch's step."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    cycles = int(max(3 * host_s, 1e-3) * _sleep_cycles_per_second())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


@functools.cache
def _copy_seconds(nbytes: int) -> float:
    """Median device seconds of a device-to-device copy moving ``nbytes`` in total (half read, half written)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _device_seconds(lambda: dst.copy_(src))


def _record(benchmark, fn, nbytes: int, numel: int) -> float | None:
    """The rates of ``fn`` (undecorated: not ``_timed``) on the device clock; returns its device seconds."""
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: nothing was timed
        return None
    seconds = _device_seconds(fn)
    copy_s = _copy_seconds(nbytes)
    benchmark.extra_info.update({
        "bytes": nbytes,
        "device_s": seconds,
        "wall_s": stats.stats.median,
        "GB/s": nbytes / seconds / 1e9,
        "params/s": numel / seconds,
        "copy_GB/s": nbytes / copy_s / 1e9,
        "ratio_to_copy": copy_s / seconds,
    })
    return seconds


@pytest.fixture(autouse=True)
def _row_file(request):
    """Append the test's row to ``$ZENFLOW_BENCH_ROWS`` once it is measured (see the module's docstring)."""
    yield
    path = os.environ.get("ZENFLOW_BENCH_ROWS")
    benchmark = request.node.funcargs.get("benchmark")
    if not path or benchmark is None or getattr(benchmark, "stats", None) is None:
        return
    row = {"name": request.node.name, "median_s": benchmark.stats.stats.median, **benchmark.extra_info}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------- one step's launches (the goal rows: run first)

# The offloaded weights of 8 layers of a ~1B Llama-style decoder (d_model 2048, ffn 5632): q, k, v, o and gate, up,
# down per layer, 56 matrices and 411M parameters in all, bf16, r = 0.1. What one optimizer step launches.
LAYER = [(2048, 2048)] * 4 + [(5632, 2048), (5632, 2048), (2048, 5632)]
GROUP_SHAPES = LAYER * 8
GROUP_R = 0.1
GROUP_STEPS = 10  # col_step at the start of every grouped test (each counts its own steps, as the optimizer does)


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
            col_step=torch.full((cols,), GROUP_STEPS, dtype=torch.int32, device=dev),
            master=torch.randn(rows, k, device=dev).mul_(0.02), exp_avg=torch.randn(rows, k, device=dev).mul_(1e-3),
            exp_avg_sq=torch.rand(rows, k, device=dev).mul_(1e-6), acc=torch.zeros(rows, cols, device=dev),
            hp=OPTIMIZER_HP, accumulate=True, count_step=True))  # as the optimizer calls it: counts its own steps
    return calls


@pytest.fixture
def group() -> list:
    """``_group()`` with its step counts reset: every grouped test starts from the same counts (the bias
    corrections' loop runs bit_length(step) times), whatever ran before it."""
    calls = _group()
    for c in calls:
        c.col_step.fill_(GROUP_STEPS)
    return calls


def _group_bytes(*, acc: bool = True) -> int:
    return sum(_fused_step_bytes(c.param.shape[0], c.slot, 2, acc=acc) for c in _group())


def _no_acc_group() -> list:
    """The same calls as accumulate="host" issues them (and grads_in_backward, on its compact gradient): no device
    sums, so the unselected columns cost only their gradient read."""
    return [dataclasses.replace(c, acc=None, accumulate=False) for c in _group()]


@functools.cache
def _torch_group_seconds() -> float:
    """Median device seconds of torch.optim.AdamW(fused=True).step() over parameters of the same shapes (bf16, state
    on the device): what a step costs without offload, on the same clock as the fused steps."""
    params = [torch.nn.Parameter(c.param.clone()) for c in _group()]
    for p, c in zip(params, _group()):
        p.grad = c.grad.clone()
    opt = torch.optim.AdamW(params, **HP, fused=True)
    for _ in range(WARMUP):
        opt.step()
    return _device_seconds(opt.step)


def _enqueue_seconds(fn, rounds: int = 10, repeats: int = 5) -> float:
    """Host seconds to issue ``fn`` (launches only, the GPU still busy): the per-step CPU overhead. The median of
    ``repeats`` means over ``rounds`` calls, with the garbage collector off while timing.

    Warmed up with as many calls as are timed: each call's call tables go through pinned blocks of torch's caching
    host allocator, held until their copies have run, so ``rounds`` calls queued back to back need ``rounds`` blocks.
    With one call of warm-up the timed calls would pay ``cudaHostAlloc`` for the rest (a training run pays it in
    its first steps only)."""
    means = []
    gc_was_on = gc.isenabled()
    try:
        for _ in range(repeats):
            for _ in range(rounds):
                fn()
            torch.cuda.synchronize()
            gc.disable()
            t0 = time.perf_counter()
            for _ in range(rounds):
                fn()
            means.append((time.perf_counter() - t0) / rounds)
            if gc_was_on:
                gc.enable()
            torch.cuda.synchronize()
    finally:
        if gc_was_on:
            gc.enable()
    return statistics.median(means)


def _record_group(benchmark, fn, *, acc: bool = True) -> None:
    numel = sum(c.param.numel() for c in _group())
    nbytes = _group_bytes(acc=acc)
    seconds = _record(benchmark, fn, nbytes, numel)
    if seconds is None:
        return
    from zenflow_triton.kernels import fused_step

    benchmark.extra_info.update({
        "params": len(GROUP_SHAPES),
        "bytes_per_param": nbytes / numel,
        # The ratio_to_torch_fused this byte count allows when both run at the same share of the bandwidth: torch's
        # step moves 14 bytes per bf16 parameter (_adamw_bytes), the fused step with fp32 sums about as many at
        # r = 0.1 by sectors (README, Performance).
        "torch_fused_byte_ratio": _adamw_bytes(numel, 2) / nbytes,
        "state_maxnreg": fused_step.STATE_MAXNREG,
        "torch_fused_s": _torch_group_seconds(),
        "ratio_to_torch_fused": _torch_group_seconds() / seconds,
        "enqueue_us_per_param": _enqueue_seconds(fn) / len(GROUP_SHAPES) * 1e6,
    })


@pytest.mark.benchmark(group="grouped")
def test_fused_steps_grouped(benchmark, group):
    """One fused_steps_ call for all 56 matrices: one launch (plus one for the split scores)."""
    from zenflow_triton.kernels.fused_step import fused_steps_

    fn = functools.partial(fused_steps_, group)
    benchmark.pedantic(_timed(fn), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record_group(benchmark, fn)


@pytest.mark.benchmark(group="grouped")
def test_fused_steps_grouped_no_acc(benchmark, group):
    """test_fused_steps_grouped as accumulate="host" runs it (acc=None): the device step's traffic without the sums."""
    from zenflow_triton.kernels.fused_step import fused_steps_

    fn = functools.partial(fused_steps_, _no_acc_group())
    benchmark.pedantic(_timed(fn), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record_group(benchmark, fn, acc=False)


@pytest.mark.benchmark(group="grouped")
def test_fused_steps_grouped_uncapped(benchmark, monkeypatch, group):
    """test_fused_steps_grouped without the register cap of the variants with compact state (fused_step.STATE_MAXNREG):
    ptxas's own allocation, 2 programs per SM instead of 3 (see STATE_MAXNREG). The pair decides the cap."""
    from zenflow_triton.kernels import fused_step

    monkeypatch.setattr(fused_step, "STATE_MAXNREG", None)
    fn = functools.partial(fused_step.fused_steps_, group)
    benchmark.pedantic(_timed(fn), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record_group(benchmark, fn)


@pytest.mark.benchmark(group="grouped")
def test_fused_step_per_parameter(benchmark, group):
    """The same work as 56 fused_step_ launches, as the optimizer issued it before fused_steps_."""
    from zenflow_triton.kernels.fused_step import fused_step_

    def fn() -> None:
        for c in group:
            c.apply(fused_step_)

    benchmark.pedantic(_timed(fn), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record_group(benchmark, fn)


# ----------------------------------------------------------------------------------------------- one [8192, 8192]


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

    def fn() -> None:  # col_step is not counted here (count_step=False): every round does the same work
        fused_step_(param, grad, **state, hp=OPTIMIZER_HP, accumulate=True)

    benchmark.pedantic(_timed(fn), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record(benchmark, fn, _fused_step_bytes(ROWS, slot, param.element_size()), ROWS * COLS)


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

    def fn() -> None:
        merge_(param, snapshot, slot)

    benchmark.pedantic(_timed(fn), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record(benchmark, fn, _merge_bytes(ROWS, slot, param.element_size()), ROWS * (COLS - k))


@pytest.mark.benchmark(group="baselines")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_torch_adamw_fused(benchmark, dtype):
    """What one step costs when the whole [8192, 8192] parameter and its state live on the device."""
    dt = DTYPES[dtype]
    p = torch.nn.Parameter(torch.randn(ROWS, COLS, device="cuda").mul_(0.02).to(dt))
    p.grad = torch.randn(ROWS, COLS, device="cuda").mul_(1e-3).to(dt)
    opt = torch.optim.AdamW([p], **HP, fused=True)
    benchmark.pedantic(_timed(opt.step), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record(benchmark, opt.step, _adamw_bytes(p.numel(), p.element_size()), p.numel())


@pytest.mark.benchmark(group="baselines")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_copy(benchmark, dtype):
    """The ceiling: a device-to-device copy of one [8192, 8192] tensor (its ratio_to_copy checks the clock: ~1.0)."""
    src = torch.randn(ROWS, COLS, device="cuda").to(DTYPES[dtype])
    dst = torch.empty_like(src)

    def fn() -> None:
        dst.copy_(src)

    benchmark.pedantic(_timed(fn), rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _record(benchmark, fn, 2 * src.numel() * src.element_size(), src.numel())
