"""Host AdamW over pinned fp32 state with numba: the host half of a ZenFlow window (DESIGN §5, §6).

``host_adamw_`` is the numba twin of :func:`zenflow_triton.kernels.reference.host_adamw_`: masked AdamW on the
unselected columns (``slot[j] < 0``) of full ``[R, C]`` fp32 master/exp_avg/exp_avg_sq, gradient ``grad / count``
(fp32, bf16 or fp16 in), per-column bias correction from ``col_step``, and the updated master written to ``snapshot``
(fp32, bf16 or fp16) in the same pass. It streams 28 bytes per parameter, so memory bandwidth bounds it; the
arithmetic (one sqrt and one or two divides per element on a shared divider) must hide under the traffic.

Design: columns are cut into chunks; a plan (per call, O(C)) lists the runs of columns to visit in each chunk,
skipping blocks of selected columns, and notes whether a run's columns share one step count (then the bias
corrections are two scalars). Work items are (row, run), split statically over the threads, so each thread
streams a contiguous range of rows. Inside a run the loop has no branches: a run holding selected columns
computes them too and blends the old bits back with integer masks. Loops vectorize to 8-lane AVX2. With fp32
moments the memory traffic bounds the loop and software prefetch keeps every stream ahead of the arithmetic; with
bf16 moments the arithmetic does (hash, stochastic rounding), so their loops have no prefetch, and under the
common hyperparameter flags no branches on them (``_common_hyperparams``).

Rounding follows ``torch.optim.AdamW`` (foreach=False) op for op where that costs nothing: torch's x86 kernels
compute ``lerp_``, ``addcmul_`` and ``add(alpha=)`` with a fused multiply-add (checked on torch 2.13, AVX2, vector
body and scalar tail alike), so this kernel calls ``llvm.fma`` in the same places, and ``addcdiv_`` rounds as
``p + ((-step_size) * m) / denom``, the order used here: exp_avg and exp_avg_sq equal torch's bit for bit. Two
deliberate differences in the denominator, both deterministic: the IEEE ``sqrt`` (torch's AVX2 ``Tensor.sqrt`` is
not correctly rounded: 16% of inputs one ulp off, measured), and ``fma(sqrt(v), 1 / bc2, eps)`` in place of
``sqrt(v) / bc2 + eps``, which saves one of the two divides per element (divider throughput is what bounded
the bf16 path: 1.18 -> 1.07 ns/element in cache, one thread). The master then differs from torch's by about an
ulp of the step (tests/test_cpu_adamw.py bounds it).

``fastmath`` is off (IEEE semantics everywhere): it would allow reassociation, contraction elsewhere and
approximate reciprocals and square roots whose results differ between CPU models, so results would drift from
torch's and from machine to machine; its ``nnan`` flag would also fold away the NaN branches of the bf16/fp16
rounding. Results do not depend on the thread count: every element sees the same operations in the same order.

The element-wise pieces this shares with ``numba_device_ops.py`` (fma and bit casts, bf16/fp16 rounding, gradient
loads, snapshot stores, the moments, the packed scalar hyperparameters) are in ``_numba_utils.py``.
"""

from __future__ import annotations

import math
import threading

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload, register_jitable

from ._bf16_moments import (
    moment_noise,
    noise_key,
    run_step,
    sr_consts,
    store_moment,
    store_moment_masked,
    store_snapshot,
    store_snapshot_masked,
)
from ._checks import check_host_adamw_args
from ._numba_utils import (
    U16,
    U32,
    adamw_moments,
    blend,
    flat_view,
    fma,
    load_grad,
    scalar_hyperparams,
)
from .hyperparams import AdamHyperparams, require_hyperparams

__all__ = ["host_adamw_", "warmup"]

# Tuning constants. Measurements: bench/report_host.py --tune (2-core AMD EPYC VM, shared with other jobs, so
# medians of 11 interleaved rounds; differences under ~10% are within that noise).
#
# Columns per chunk: a work item is one chunk of one row, so a matrix with few rows (R = 1 included) still splits
# over the threads, and items stay equal in size for numba's static schedule. 64M fp32, 2 threads, ms per step:
# 4096 x 16384: chunk 1024 43.7, 4096 42.0, 16384 42.7, 65536 41.2 (flat); 1 x 64M: 84.6 / 88.8 / 84.0 / 70.7
# (the per-chunk plan shows for R = 1). Kept small enough that R = 3, C = 16384 still balances over 2 threads.
_CHUNK_COLS = 4096
# A block of this many columns that are all selected is skipped; other selected columns are computed and
# discarded by a per-column blend, which keeps the loop vectorized (the traffic is the same: a partly selected
# 64-byte line is read and written whole). 10% random, 50% random, 10% in runs of 32: same time for blocks of
# 16, 64, 256 and 4096 columns; 10% contiguous: skipped at every size (41.0-42.5 ms vs 42.0 with nothing selected
# in that sweep). 64 = four lines of fp32, and the plan counts 64 columns at a time.
_SKIP_BLOCK = 64
# Software prefetch: every _BLOCK elements, each stream's lines _PREFETCH_AHEAD elements ahead are requested.
# Without it the hardware prefetcher leaves AdamW at 0.87x (1 thread, thread CPU time, 60.9 vs 51.9 ms for the
# ceiling) and 0.92x (2 threads, median of 41 interleaved rounds) of the ceiling; with it, 1.0x and 0.96-0.98x.
# Distances of 128 to 512 elements are within noise with 2 threads; 1024 falls back to 0.85x with 1 thread.
_BLOCK = 64  # 4 lines of fp32: one prefetch per line and stream
_BLOCK_U = np.uint64(_BLOCK)  # index arithmetic stays uint64 (uint64 + int64 is float64 in numba)
_LINE_F32 = 16
_PREFETCH_AHEAD = np.uint64(256)
# bf16 moments: no software prefetch, and one loop per run (each loop entry pays LLVM's run-time alias checks
# between the six streams, ~90 instructions). Their loop is arithmetic-bound, and the prefetches and block
# boundaries cost more than they hide: 16M params, 2 threads, 0.56-0.57 -> 0.65-0.73 of the ceiling
# (bench/results/host-bf16-moments-loops-2026-12-07.md).
_RUN_COLS_U = np.uint64(_CHUNK_COLS)  # a run never crosses a chunk
# Below this many elements a job runs on one thread. Per call, bf16 grad and snapshot, 1 vs 2 threads (us):
# 4096 el. 87.7 vs 95.8, 16384 el. 111.5 vs 101.7, 65536 el. 138.8 vs 124.9 (~70 us of it is Python).
_MIN_PARALLEL_ELEMS = 1 << 14
# Planning on several threads pays off only for very wide matrices: the plan costs ~1.7 us per chunk on one
# thread (256 chunks: 0.44 ms), while waking a second thread on a busy machine can take milliseconds.
_PARALLEL_PLAN_CHUNKS = 256


# --- prefetch, an intrinsic numba does not expose (fma, bit casts and the bf16/fp16 conversions: _numba_utils.py) ---


@intrinsic
def _prefetch(typingctx, arr, i):
    """Hint the line holding ``arr[i]`` into the cache (``llvm.prefetch``; never faults, even past the end)."""
    if not isinstance(arr, types.Array) or not isinstance(i, types.Integer):
        return None
    sig = types.void(arr, i)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.gep(data, [args[1]])  # not inbounds: the address may lie past the array, which is fine
        ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]), "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all cache levels, data
        return context.get_dummy_value()

    return sig, codegen


def _prefetch_opt(arr, i):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(_prefetch_opt)
def _prefetch_opt_impl(arr, i):
    """``_prefetch`` that accepts ``None`` (no snapshot) and does nothing for it."""
    if isinstance(arr, types.NoneType):
        return lambda arr, i: None
    return lambda arr, i: _prefetch(arr, i)


@register_jitable
def _prefetch_stream(arr, k):
    """Prefetch ``_BLOCK`` elements of one stream from ``k``: one request per line (16-bit streams hold twice as many
    elements per line)."""
    step = _LINE_F32 if arr.itemsize == 4 else 2 * _LINE_F32
    for line in range(_BLOCK // step):
        _prefetch(arr, k + np.uint64(line * step))


# --- the plan: per-column constants and the runs of columns to update --------------------------------------------
# Columns are cut into chunks of _CHUNK_COLS; runs never cross a chunk boundary, so chunks are planned
# independently (in parallel for very wide matrices: with R = 1 the plan touches as many columns as the kernel).


@register_jitable(error_model="numpy")
def _bias(step, lr, beta1, beta2):
    """(lr / (1 - beta1^step), 1 / sqrt(1 - beta2^step)), each computed in float64 and rounded once to float32
    (torch rounds its step size the same way; it divides by sqrt(1 - beta2^step) where this kernel multiplies)."""
    s = np.float64(step)
    return np.float32(lr / (1.0 - beta1**s)), np.float32(1.0 / math.sqrt(1.0 - beta2**s))


# Each loop of the plan is its own small function, so that LLVM vectorizes it (see the run functions below).


@register_jitable
def _scan_steps(slot, col_step, a, b, s0):
    """(updated columns whose step count is not ``s0``, selected columns) in ``[a, b)``, branch-free."""
    differ = 0
    nsel = 0
    for j in range(a, b):
        upd = np.int64(slot[j] < 0)
        differ += upd & np.int64(col_step[j] != s0)
        nsel += 1 - upd
    return differ, nsel


@register_jitable
def _count_updated(slot, a, b):
    n = 0
    for j in range(a, b):
        n += np.int64(slot[j] < 0)
    return n


@register_jitable(error_model="numpy")
def _plan_chunk(slot, col_step, a, b, lr, beta1, beta2, block, step_size, inv_bc2, starts, stops, mixed, k0):
    """Plan columns ``[a, b)``: runs of ``block``-column blocks to visit, written from index ``k0``.

    A block whose columns are all selected is skipped; a run is a maximal sequence of other blocks, "mixed" when
    any of its columns is selected (the kernel computes those and discards them). The updated columns are
    "uniform" when they share one step count; only a non-uniform chunk writes the per-column step size and bias
    correction (the kernel reads per-run scalars otherwise).

    Returns (runs, uniform, step size, 1 / sqrt(bias correction 2) of the first updated column).
    """
    a = np.uint64(a)  # unsigned indices: no negative-index wrapping, so the loops below vectorize
    b = np.uint64(b)
    f = a
    while f < b and slot[f] >= 0:
        f += np.uint64(1)
    if f == b:
        return 0, True, np.float32(0.0), np.float32(0.0)
    s0 = col_step[f]
    differ, nsel = _scan_steps(slot, col_step, f, b, s0)
    uniform = differ == 0
    ss0, ib0 = _bias(s0, lr, beta1, beta2)
    if not uniform:
        prev = s0
        ss, ib = ss0, ib0
        for j in range(a, b):
            s = col_step[j]
            if s != prev:  # neighbouring columns mostly share a count: one pow per change, not per column
                prev = s
                ss, ib = _bias(s, lr, beta1, beta2)
            step_size[j] = ss
            inv_bc2[j] = ib
    n = 0
    open_run = False
    for lo in range(a, b, np.uint64(block)):
        hi = min(lo + np.uint64(block), b)
        nupd = _count_updated(slot, lo, hi)
        if nupd == 0:
            if open_run:
                stops[k0 + n] = lo
                n += 1
                open_run = False
            continue
        if not open_run:
            starts[k0 + n] = lo
            mixed[k0 + n] = False
            open_run = True
        if nupd < np.int64(hi - lo):
            mixed[k0 + n] = True
    if open_run:
        stops[k0 + n] = b
        n += 1
    return n, uniform, ss0, ib0


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def _plan(slot, col_step, lr, beta1, beta2, chunk, block):
    """Per-column constants and the runs of columns to visit, chunk by chunk.

    Returns the per-column step size and 1 / sqrt(bias correction 2) (written only for non-uniform chunks, see
    ``_plan_chunk``), the runs (start, stop, mixed, uniform, and the step size and bias correction of a
    uniform run) and the number of columns the runs cover. Run it on one thread unless there are many chunks.
    """
    cols = slot.shape[0]
    nchunk = (cols + chunk - 1) // chunk
    cap = (chunk + block - 1) // block // 2 + 1  # most runs a chunk can hold: blocks alternate visit / skip
    # np.empty: pages are touched only where written (a wide uniform matrix writes no per-column array).
    step_size = np.empty(cols, np.float32)
    inv_bc2 = np.empty(cols, np.float32)
    c_starts = np.empty(nchunk * cap, np.int64)
    c_stops = np.empty(nchunk * cap, np.int64)
    c_mixed = np.empty(nchunk * cap, np.bool_)
    counts = np.empty(nchunk, np.int64)
    c_uniform = np.empty(nchunk, np.bool_)
    c_ss = np.empty(nchunk, np.float32)
    c_ib = np.empty(nchunk, np.float32)
    for c in prange(nchunk):
        a = c * chunk
        counts[c], c_uniform[c], c_ss[c], c_ib[c] = _plan_chunk(
            slot, col_step, a, min(a + chunk, cols), lr, beta1, beta2, block, step_size, inv_bc2, c_starts, c_stops,
            c_mixed, c * cap)
    total = counts.sum()
    starts = np.empty(total, np.int64)
    stops = np.empty(total, np.int64)
    mixed = np.empty(total, np.bool_)
    uniform = np.empty(total, np.bool_)
    run_ss = np.empty(total, np.float32)
    run_ib = np.empty(total, np.float32)
    k = 0
    visited = 0
    for c in range(nchunk):
        for q in range(c * cap, c * cap + counts[c]):
            starts[k] = c_starts[q]
            stops[k] = c_stops[q]
            mixed[k] = c_mixed[q]
            uniform[k] = c_uniform[c]
            run_ss[k] = c_ss[c]
            run_ib[k] = c_ib[c]
            visited += c_stops[q] - c_starts[q]
            k += 1
    return step_size, inv_bc2, starts, stops, mixed, uniform, run_ss, run_ib, visited


# --- the kernel -----------------------------------------------------------------------------------------------------

def _adamw_step(p, m, v, g, ss, inv_bc2, hp):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(_adamw_step, jit_options={"error_model": "numpy"})
def _adamw_step_impl(p, m, v, g, ss, inv_bc2, hp):
    """One element of this kernel's AdamW: ``g`` is the raw gradient sum, ``hp`` the tuple of ``scalar_hyperparams``
    or its short form ``_common_hyperparams``, and the denominator is ``fma(sqrt(v), 1 / bc2, eps)`` (module
    docstring)."""
    if len(hp) == len(_COMMON_FIELDS):

        def common(p, m, v, g, ss, inv_bc2, hp):
            # adamw_moments with coupled and divide False, base_is_m True: the same operations, no branches
            scale, decay, w, b2, omb2, eps, _ = hp
            g = g * scale
            p = p * decay
            m = fma(w, g - m, m)
            v = fma(omb2 * g, g, v * b2)
            denom = fma(math.sqrt(v), inv_bc2, eps)
            return p - (ss * m) / denom, m, v

        return common

    def general(p, m, v, g, ss, inv_bc2, hp):
        scale, count, divide, decay, l2, coupled, w, base_is_m, b2, omb2, eps, _ = hp
        g = g * scale  # 1 / count where that is exact (count a power of two), else 1
        g = g / count if divide else g  # other counts: divide, as torch does
        p, m, v = adamw_moments(p, m, v, g, decay, l2, coupled, w, base_is_m, b2, omb2)
        denom = fma(math.sqrt(v), inv_bc2, eps)  # torch: sqrt(v) / bc2 + eps
        return p - (ss * m) / denom, m, v  # addcdiv_(m, denom, value=-step_size)

    return general


# scalar_hyperparams' fields that _common_hyperparams keeps (``ones``, 0xFFFFFFFF at run time, last in both forms)
_COMMON_FIELDS = (0, 3, 6, 8, 9, 10, 11)


def _common_hyperparams(hp: tuple) -> tuple | None:
    """``scalar_hyperparams`` without its three flags, where they take the common values (no divide, decoupled or no
    weight decay, lerp from ``m``: beta1 > 0.5), else None. The loops compiled for this form have no branches on
    the flags, which matters where the arithmetic bounds the loop: with bf16 moments (bench/results/
    host-bf16-moments-loops-2026-12-07.md); with fp32 moments the memory traffic hides the branches."""
    _, _, divide, _, _, coupled, _, base_is_m = hp[:8]
    if divide or coupled or not base_is_m:
        return None
    return tuple(hp[k] for k in _COMMON_FIELDS)


def _col(src, j):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(_col)
def _col_impl(src, j):
    """A per-column value: ``src[j]`` for an array, ``src`` itself for a scalar (a uniform run)."""
    if isinstance(src, types.Array):
        return lambda src, j: src[j]
    return lambda src, j: src


@register_jitable
def _prefetch_ahead(master, exp_avg, exp_avg_sq, grad, snapshot, i):
    """Prefetch one block (``_BLOCK`` elements) of every stream, ``_PREFETCH_AHEAD`` elements ahead of ``i``."""
    k = i + _PREFETCH_AHEAD
    for line in range(_BLOCK // _LINE_F32):
        _prefetch(master, k + np.uint64(line * _LINE_F32))
    _prefetch_stream(exp_avg, k)
    _prefetch_stream(exp_avg_sq, k)
    for line in range(_BLOCK // (2 * _LINE_F32)):  # 16-bit streams hold twice as many elements per line
        q = k + np.uint64(line * 2 * _LINE_F32)
        _prefetch(grad, q)
        _prefetch_opt(snapshot, q)
    if grad.itemsize == 4:
        for line in range(_BLOCK // (2 * _LINE_F32), _BLOCK // _LINE_F32):
            _prefetch(grad, k + np.uint64(line * _LINE_F32))


def _prefetch_block(master, exp_avg, exp_avg_sq, grad, snapshot, i):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(_prefetch_block)
def _prefetch_block_impl(master, exp_avg, exp_avg_sq, grad, snapshot, i):
    """Prefetch the block of columns a run function's loop visits next (``_block_cols``), ahead of ``i``; nothing
    for bf16 moments."""
    if exp_avg.dtype == types.uint16:
        return lambda master, exp_avg, exp_avg_sq, grad, snapshot, i: None
    return lambda master, exp_avg, exp_avg_sq, grad, snapshot, i: _prefetch_ahead(master, exp_avg, exp_avg_sq, grad,
                                                                                  snapshot, i)


def _block_cols(exp_avg):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(_block_cols)
def _block_cols_impl(exp_avg):
    """Columns per loop of a run function: ``_BLOCK``, or the whole run for bf16 moments."""
    if exp_avg.dtype == types.uint16:
        return lambda exp_avg: _RUN_COLS_U
    return lambda exp_avg: _BLOCK_U


# The run functions are separate functions with unsigned indices because LLVM then vectorizes them: numba wraps
# negative signed indices (the address becomes a select LLVM cannot bound: "cannot identify array bounds"), and
# loop values that live on after a loop inside a bigger function block the vectorizer ("value ... used outside the
# loop"). Both checked with -pass-remarks-analysis=loop-vectorize; the loops compile to 8-lane AVX2.


@register_jitable(error_model="numpy")
def _run_dense(master, exp_avg, exp_avg_sq, grad, snapshot, base, a, b, steps, step_size, inv_bc2, hp):
    """Columns ``[a, b)`` of the row at flat offset ``base``, all updated, in prefetched blocks.

    ``steps`` (the step counts), ``step_size`` and ``inv_bc2`` are per-column arrays, or scalars when the run is
    uniform (``_col``).
    """
    c = sr_consts(exp_avg, hp[-1])  # the bf16 moments' rounding constants, as run-time values
    j0 = a
    while j0 < b:
        _prefetch_block(master, exp_avg, exp_avg_sq, grad, snapshot, base + j0)
        j1 = min(j0 + _block_cols(exp_avg), b)
        # The hash's index (mod 2^32) is a uint32 counter of its own: taken from the uint64 ``i``, LLVM built its
        # vector lane by lane (8 lea, 8 vmovq and 6 shuffles per 8 elements); a uint32 induction is one vpaddd.
        q = U32(base + j0)
        for j in range(j0, j1):
            i = base + j
            p, m, v = _adamw_step(master[i], load_grad(exp_avg, i), load_grad(exp_avg_sq, i), load_grad(grad, i),
                                  _col(step_size, j), _col(inv_bc2, j), hp)
            noise = moment_noise(exp_avg, q, noise_key(exp_avg, _col(steps, j)), c)
            q = U32(q + U32(1))
            master[i] = p
            store_moment(exp_avg, i, m, U32(noise & U32(0xFFFF)), c)
            store_moment(exp_avg_sq, i, v, U32(noise >> U16), c)
            store_snapshot(exp_avg, snapshot, i, p, c)
        j0 = j1


@register_jitable(error_model="numpy")
def _run_mixed(master, exp_avg, exp_avg_sq, grad, snapshot, base, a, b, slot, steps, step_size, inv_bc2, hp):
    """Like ``_run_dense``, but only columns with ``slot[j] < 0`` change; the rest are computed and discarded."""
    c = sr_consts(exp_avg, hp[-1])
    j0 = a
    while j0 < b:
        _prefetch_block(master, exp_avg, exp_avg_sq, grad, snapshot, base + j0)
        j1 = min(j0 + _block_cols(exp_avg), b)
        q = U32(base + j0)  # the hash's index (see _run_dense)
        for j in range(j0, j1):
            i = base + j
            p0 = master[i]
            m0 = exp_avg[i]  # raw: float32, or bf16 bits
            v0 = exp_avg_sq[i]
            p, m, v = _adamw_step(p0, load_grad(exp_avg, i), load_grad(exp_avg_sq, i), load_grad(grad, i),
                                  _col(step_size, j), _col(inv_bc2, j), hp)
            noise = moment_noise(exp_avg, q, noise_key(exp_avg, _col(steps, j)), c)
            q = U32(q + U32(1))
            # All ones for an unselected column (slot < 0), else 0. The AND with ``ones`` (0xFFFFFFFF, but a runtime
            # value) hides that the mask is a sign splat, or LLVM would turn the blends below into masked stores.
            mask = U32(U32(np.int32(slot[j]) >> np.int32(31)) & hp[-1])
            master[i] = blend(p, p0, mask)
            store_moment_masked(exp_avg, i, m, m0, U32(noise & U32(0xFFFF)), mask, c)
            store_moment_masked(exp_avg_sq, i, v, v0, U32(noise >> U16), mask, c)
            store_snapshot_masked(exp_avg, snapshot, i, p, mask, c)
        j0 = j1


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def _host_adamw_kernel(master, exp_avg, exp_avg_sq, grad, snapshot, cols, slot, col_step, step_size, inv_bc2, starts,
                       stops, mixed, uniform, run_ss, run_ib, hp):
    """Flat row-major buffers; one work item is one run of one row (rows outer: each thread streams through
    a contiguous range of rows under numba's static schedule)."""
    nrun = starts.shape[0]
    rows = master.shape[0] // cols
    for item in prange(rows * nrun):
        r = item // nrun
        k = item - r * nrun
        base = np.uint64(r * cols)
        a = np.uint64(starts[k])
        b = np.uint64(stops[k])
        # Three loop variants; _col dispatches on the argument type. A run whose columns have several step counts
        # takes the general (mixed, per-column) loop even without selected columns: rarer, and one variant fewer
        # to compile (each costs ~1 s per dtype combination). A uniform run passes its step count as a scalar, so
        # that the bf16 moments' noise key is loop-invariant; its selected columns may count other steps, but their
        # results are discarded.
        if not uniform[k]:
            _run_mixed(master, exp_avg, exp_avg_sq, grad, snapshot, base, a, b, slot, col_step, step_size, inv_bc2, hp)
        elif mixed[k]:
            step = run_step(exp_avg, slot, col_step, a)
            _run_mixed(master, exp_avg, exp_avg_sq, grad, snapshot, base, a, b, slot, step, run_ss[k], run_ib[k], hp)
        else:
            step = run_step(exp_avg, slot, col_step, a)
            _run_dense(master, exp_avg, exp_avg_sq, grad, snapshot, base, a, b, step, run_ss[k], run_ib[k], hp)


# --- launcher ---------------------------------------------------------------------------------------------------------


def _check_num_threads(num_threads: int | None) -> None:
    if num_threads is None:
        return
    limit = numba.config.NUMBA_NUM_THREADS
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or not 1 <= num_threads <= limit:
        raise ValueError(f"num_threads must be an int in [1, {limit}] (numba's pool size), got {num_threads!r}")


def host_adamw_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    count: int,
    slot: torch.Tensor,
    col_step: torch.Tensor,
    hp: AdamHyperparams,
    snapshot: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """Host AdamW on the unselected columns (``slot < 0``) of full ``[R, C]`` fp32 CPU state, in place.

    Same arguments and results as :func:`zenflow_triton.kernels.reference.host_adamw_`: the gradient is
    ``grad / count`` (``grad`` fp32, bf16 or fp16, the sum of ``count`` gradients); bias correction uses the
    per-column, already incremented ``col_step`` (read only); ``decoupled=False`` is Adam with L2 weight decay.
    Updated columns of ``master`` are also written to ``snapshot`` (fp32, bf16 or fp16; round to nearest even)
    when given. Selected columns of every buffer keep their bits. All tensors must be contiguous CPU tensors
    (pinned or not); nothing is copied. Results do not depend on the thread count.

    ``num_threads``: at most this many numba threads for this call (default: the calling thread's numba setting;
    jobs under 16K elements run on one thread). Numba's setting belongs to the calling thread and is restored
    on return. The kernel releases the GIL, but call it from one thread at a time (numba's thread pools are not
    made for concurrent parallel launches).
    """
    rows, cols = check_host_adamw_args(master, exp_avg, exp_avg_sq, grad, slot=slot, col_step=col_step,
                                       snapshot=snapshot, count=count)
    require_hyperparams(hp)
    _check_num_threads(num_threads)
    if rows == 0 or cols == 0:
        return
    previous = numba.get_num_threads()
    threads = previous if num_threads is None else num_threads
    try:
        plan_threads = threads if cols >= _PARALLEL_PLAN_CHUNKS * _CHUNK_COLS else 1
        if plan_threads != previous:
            numba.set_num_threads(plan_threads)
        slot_np = slot.numpy()
        step_np = col_step.numpy()
        plan = _plan(slot_np, step_np, float(hp.lr), float(hp.beta1), float(hp.beta2), _CHUNK_COLS,
                     _SKIP_BLOCK)
        visited = plan[-1]
        if visited == 0:
            return
        kernel_threads = 1 if rows * visited < _MIN_PARALLEL_ELEMS else threads
        if kernel_threads != numba.get_num_threads():
            numba.set_num_threads(kernel_threads)
        snap = None if snapshot is None else flat_view(snapshot)
        hpt = scalar_hyperparams(count, hp)
        if exp_avg.dtype == torch.bfloat16:
            hpt = _common_hyperparams(hpt) or hpt
        _host_adamw_kernel(flat_view(master), flat_view(exp_avg), flat_view(exp_avg_sq), flat_view(grad), snap,
                           cols, slot_np, step_np, *plan[:-1], hpt)
    finally:
        if numba.get_num_threads() != previous:
            numba.set_num_threads(previous)


_GRAD_DTYPES = (torch.float32, torch.bfloat16)
_SNAPSHOT_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
_warm_lock = threading.Lock()
_warmed: set[tuple[torch.dtype, torch.dtype | None, torch.dtype]] = set()
_WARMUP_HP = AdamHyperparams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def warmup(
    grad_dtypes: tuple[torch.dtype, ...] = _GRAD_DTYPES,
    snapshot_dtypes: tuple[torch.dtype | None, ...] = _SNAPSHOT_DTYPES,
    state_dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> None:
    """Compile (or load from numba's on-disk cache) the kernels for these gradient, snapshot and moment dtypes.

    By default all eight fp32-moment kernels (fp32 or bf16 grad x no/fp32/bf16/fp16 snapshot): 3-5 s of compilation
    each on a cold cache (the first run on a machine), ~0.1 s each when numba's cache is warm; bf16 moments compile
    two kernels per dtype combination (the common flags' and the general one: ``_common_hyperparams``). An optimizer
    passes just the dtypes it will use. Safe to call from several threads and more than once.
    """
    with _warm_lock:
        slot = torch.tensor([-1, 0], dtype=torch.int32)
        col_step = torch.ones(2, dtype=torch.int32)
        z = torch.zeros
        for key in ((g, s, m) for g in grad_dtypes for s in snapshot_dtypes for m in state_dtypes):
            if key in _warmed:
                continue
            gdt, sdt, mdt = key
            snap = None if sdt is None else z(1, 2, dtype=sdt)
            for count in (1, 3) if mdt == torch.bfloat16 else (1,):  # 3: a divided count, the general form
                host_adamw_(z(1, 2), z(1, 2, dtype=mdt), z(1, 2, dtype=mdt), z(1, 2, dtype=gdt), count=count,
                            slot=slot, col_step=col_step, hp=_WARMUP_HP, snapshot=snap)
            _warmed.add(key)
