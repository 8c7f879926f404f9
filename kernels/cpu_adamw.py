"""Host AdamW over pinned fp32 state with numba: the host half of a ZenFlow window (DESIGN §5, §6).

``host_adamw_`` is the numba twin of :func:`zenflow_triton.kernels.reference.host_adamw_`: masked AdamW on the
unselected columns (``slot[j] < 0``) of full ``[R, C]`` fp32 master/exp_avg/exp_avg_sq, gradient ``grad / count``
(fp32 or bf16 in), per-column bias correction from ``col_step``, and the updated master written to ``snapshot``
(fp32, bf16 or fp16) in the same pass. The kernel streams 28 bytes per parameter (fp32 state and grad), so it is
bound by memory bandwidth; everything below is arranged so that the arithmetic hides under the memory traffic.

Rounding follows ``torch.optim.AdamW`` (foreach=False) op for op: torch's x86 CPU kernels compute ``lerp_``,
``addcmul_`` and ``add(alpha=)`` with a fused multiply-add (checked on torch 2.13, AVX2, vector body and scalar
tail alike), so this kernel calls ``llvm.fma`` in the same places, and ``addcdiv_`` rounds as
``p + ((-step_size) * m) / denom``, the order used here. The moments then equal torch's bit for bit. The master
can differ by an ulp: torch's AVX2 ``Tensor.sqrt`` is not correctly rounded (16% of inputs one ulp off, max
error 0.75 ulp, measured), while this kernel takes the IEEE ``sqrt``.

``fastmath`` is off (IEEE semantics everywhere): it would allow reassociation, FMA contraction elsewhere and
reciprocal approximations (results would drift from torch's and could change with the compiler's vector/scalar
split, so with the thread count), and its ``nnan`` flag would fold away the NaN branches of the bf16/fp16
rounding. It would not buy speed: the kernel waits on memory, not arithmetic (bench/report_host.py).
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

from ._checks import check_host_adamw_args, check_hyperparams

__all__ = ["host_adamw_", "warmup"]

# Columns per work item. Long runs of columns are cut into pieces of at most this length so that a matrix with
# few rows (R = 1 included) still splits over the threads, and the work items stay equal in size for numba's
# static schedule. Measured (bench/report_host.py, 2-core EPYC, 64M fp32 params, 2 threads): 1024 to 16384
# columns all land within 1% of each other for R x C = 4096 x 16384 and 1 x 64M; 4096 keeps per-item overhead
# (one integer division, loop set-up) below 0.1% of the item's ~3 us of streaming.
_CHUNK_COLS = 4096
# A run of this many selected columns or more between updated columns is skipped; shorter runs are computed
# and discarded by a per-column select (the "mixed" path), which keeps the loop vectorized. A skipped run saves
# memory traffic only when it covers whole 64-byte lines (16 fp32 columns), and starting a new run costs a
# loop set-up plus a scalar remainder (up to 7 elements of sqrt+div), about as much as blending through 64
# columns. Measured: 10% random selection runs at the speed of 0% with the mixed path and ~40% slower when
# every selected column splits a run (bench/report_host.py).
_MIN_SKIP_COLS = 64
# Software prefetch: every _BLOCK elements, each stream's lines _PREFETCH_AHEAD elements ahead are requested.
# The hardware prefetcher alone leaves the kernel at 0.86x the ceiling (1 thread, 64M fp32, thread CPU time: a
# plain AdamW loop 60.9 ms vs ceiling 51.9 ms); with 1 KiB ahead it reaches 1.0x (51.3 ms). Measured distances
# (ms): 128 el. 55.6, 192 el. 53.1, 256 el. 51.3-54.3, 384 el. 51.6, 512 el. 53.1, 1024 el. 62.2 (too far: lines
# are evicted from L1 before use). _BLOCK = 64 elements = 4 lines of fp32: one prefetch per line and stream.
_BLOCK = 64
_BLOCK_U = np.uint64(_BLOCK)  # index arithmetic stays uint64 (uint64 + int64 is float64 in numba)
_LINE_F32 = 16
_PREFETCH_AHEAD = np.uint64(256)
# Below this many elements a job runs on one thread: waking numba's pool costs more than it saves.
_MIN_PARALLEL_ELEMS = 1 << 15


# --- intrinsics: fma and bit casts, which numba does not expose as scalar operations -------------------------------


@intrinsic
def _fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (``llvm.fma.f32``, one ``vfmadd`` per 8 lanes when the loop vectorizes)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE bits of a float32 as uint32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _bits_f32(typingctx, u):
    """The float32 whose IEEE bits are the low 32 bits of the integer ``u``."""
    if not isinstance(u, types.Integer):
        return None
    sig = types.float32(u)

    def codegen(context, builder, signature, args):
        (x,) = args
        width = signature.args[0].bitwidth
        if width > 32:
            x = builder.trunc(x, ir.IntType(32))
        elif width < 32:
            x = builder.zext(x, ir.IntType(32))
        return builder.bitcast(x, ir.FloatType())

    return sig, codegen


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


# --- conversions ------------------------------------------------------------------------------------------------------
# All arithmetic stays in uint32 (every constant typed) so the vectorized loop runs 8 lanes per AVX2 op, not 4.
# Helpers are register_jitable (numba overloads): callable from jitted code only, so numba builds no Python or
# cfunc wrapper for them, which is a third of the compile time of an njit helper.

_U32 = np.uint32  # numba widens uint32 arithmetic to 64 bits; truncating every step lets LLVM keep 8 lanes
_U1 = _U32(1)
_U13 = _U32(13)
_U16 = _U32(16)
_BF16_QNAN = _U32(0x7FC0)  # c10::BFloat16's NaN (torch's scalar path; its AVX2 path gives 0xFFFF)


@register_jitable
def _bf16_round(x):
    """float32 -> bf16 bits (uint32), round to nearest even by integer arithmetic; NaN -> 0x7FC0."""
    u = _f32_bits(x)
    r = _U32(_U32(u + _U32(_U32(u >> _U16) & _U1)) + _U32(0x7FFF)) >> _U16
    return _BF16_QNAN if x != x else _U32(r)


@register_jitable
def _f16_round(x):
    """float32 -> IEEE fp16 bits (uint32), round to nearest even, as ``vcvtps2ph`` / ``torch.Tensor.half()``.

    Normal results round the mantissa by integer arithmetic (a carry rolls into the exponent, up to inf at
    65520); subnormal results let the FPU round: ``|x| + 0.5`` has a ulp of 2^-24, the fp16 subnormal step.
    NaN keeps its sign and top payload bits and becomes quiet, like the hardware conversion.
    """
    u = _f32_bits(x)
    sign = _U32(u >> _U16) & _U32(0x8000)
    a = u & _U32(0x7FFFFFFF)
    t = _U32(a - _U32(0x38000000))  # rebias the exponent 127 -> 15 (garbage when a is small: not selected then)
    normal = _U32(_U32(t + _U32(_U32(t >> _U13) & _U1)) + _U32(0x0FFF)) >> _U13
    sub = _U32(_f32_bits(_bits_f32(a) + np.float32(0.5)) - _U32(0x3F000000))
    h = _U32(normal) if a >= _U32(0x38800000) else sub  # 0x38800000 = 2^-14, the smallest normal fp16
    h = _U32(0x7C00) if a >= _U32(0x47800000) else h  # |x| >= 65536 (from 65520 the carry gives inf)
    h = _U32(_U32(0x7E00) | _U32(a >> _U13)) & _U32(0x7FFF) if a > _U32(0x7F800000) else h
    return _U32(sign | h)


@njit(nogil=True, cache=True)
def _bf16_bits_array(x):
    """bf16 bits (uint16) of a float32 array, by the kernel's rounding (for tests)."""
    out = np.empty(x.shape[0], np.uint16)
    for i in range(x.shape[0]):
        out[i] = np.uint16(_bf16_round(x[i]))
    return out


@njit(nogil=True, cache=True)
def _f16_bits_array(x):
    """fp16 bits (uint16) of a float32 array, by the kernel's rounding (for tests)."""
    out = np.empty(x.shape[0], np.uint16)
    for i in range(x.shape[0]):
        out[i] = np.uint16(_f16_round(x[i]))
    return out


# Gradient and snapshot dtypes arrive as numpy views: fp32 as float32, bf16 as uint16, fp16 as int16 (numba has no
# float16 on the CPU; the two 16-bit formats are told apart by the signedness of their integer view).


def _load_grad(grad, i):  # pragma: no cover - typing stub, replaced by the overload below inside numba
    raise NotImplementedError


@overload(_load_grad)
def _load_grad_impl(grad, i):
    if grad.dtype == types.float32:
        return lambda grad, i: grad[i]
    if grad.dtype == types.uint16:
        return lambda grad, i: _bits_f32(_U32(_U32(grad[i]) << _U16))
    return None


def _store_snap(snap, i, p):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(_store_snap)
def _store_snap_impl(snap, i, p):
    if isinstance(snap, types.NoneType):
        return lambda snap, i, p: None
    if snap.dtype == types.float32:

        def store_f32(snap, i, p):
            snap[i] = p

        return store_f32
    if snap.dtype == types.uint16:

        def store_bf16(snap, i, p):
            snap[i] = np.uint16(_bf16_round(p))

        return store_bf16
    if snap.dtype == types.int16:

        def store_f16(snap, i, p):
            snap[i] = np.int16(_f16_round(p))

        return store_f16
    return None


def _store_snap_masked(snap, i, p, mask):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(_store_snap_masked)
def _store_snap_masked_impl(snap, i, p, mask):
    # ``mask`` is 0xFFFFFFFF (store) or 0 (keep the old value). The 16-bit formats blend with integer and/or: a
    # select between 16-bit loads made LLVM's cost model refuse to vectorize the loop (5 ns/element instead of 1).
    if isinstance(snap, types.NoneType):
        return lambda snap, i, p, mask: None
    if snap.dtype == types.float32:

        def store_f32(snap, i, p, mask):
            snap[i] = _blend(p, snap[i], mask)

        return store_f32
    if snap.dtype == types.uint16:

        def store_bf16(snap, i, p, mask):
            snap[i] = np.uint16(_U32(_bf16_round(p) & mask) | _U32(_U32(snap[i]) & _U32(~mask)))

        return store_bf16
    if snap.dtype == types.int16:

        def store_f16(snap, i, p, mask):
            old = _U32(np.uint16(snap[i]))
            snap[i] = np.int16(np.uint16(_U32(_f16_round(p) & mask) | _U32(old & _U32(~mask))))

        return store_f16
    return None


# --- the plan: per-column constants and the runs of columns to update --------------------------------------------


@njit(nogil=True, cache=True, error_model="numpy")
def _plan(slot, col_step, lr, beta1, beta2, chunk, min_skip):
    """Per-column step size and sqrt(bias correction 2), the update mask, and the runs of columns to visit.

    Bias corrections are computed in float64 and rounded to float32, as torch does; neighbouring columns almost
    always share a step count, so each value is computed once per change of ``col_step``. Runs are ``[start, stop)``
    pieces of at most ``chunk`` columns that begin and end on an updated column; a run is "mixed" when it contains
    selected columns (fewer than ``min_skip`` in a row), which the kernel computes and then discards.
    """
    cols = slot.shape[0]
    step_size = np.empty(cols, np.float32)
    bc2_sqrt = np.empty(cols, np.float32)
    update = np.empty(cols, np.bool_)
    umask = np.empty(cols, np.uint32)
    prev = np.int64(-(1 << 40))
    ss = np.float32(0.0)
    b2 = np.float32(0.0)
    for j in range(cols):
        update[j] = slot[j] < 0
        umask[j] = np.uint32(0xFFFFFFFF) if update[j] else np.uint32(0)
        s = np.int64(col_step[j])
        if s != prev:
            prev = s
            sf = np.float64(s)
            ss = np.float32(lr / (1.0 - beta1**sf))
            b2 = np.float32(math.sqrt(1.0 - beta2**sf))
        step_size[j] = ss
        bc2_sqrt[j] = b2
    starts = np.empty(cols // 2 + 2 + cols // chunk, np.int64)
    stops = np.empty_like(starts)
    mixed = np.empty(starts.shape[0], np.bool_)
    nrun = 0
    j = 0
    while j < cols:
        while j < cols and not update[j]:
            j += 1
        if j == cols:
            break
        start = j
        last = j
        nsel = 0
        nsel_at_last = 0
        while j < cols and j - start < chunk:
            if update[j]:
                last = j
                nsel_at_last = nsel
            else:
                nsel += 1
                if j - last >= min_skip:
                    break
            j += 1
        starts[nrun] = start
        stops[nrun] = last + 1
        mixed[nrun] = nsel_at_last > 0
        nrun += 1
        j = last + 1
    visited = int(np.sum(stops[:nrun] - starts[:nrun]))
    return step_size, bc2_sqrt, umask, starts[:nrun], stops[:nrun], mixed[:nrun], visited


# --- the kernel -----------------------------------------------------------------------------------------------------
# The run functions are separate functions with unsigned indices because LLVM then vectorizes them: numba wraps
# negative signed indices (the address becomes a select LLVM cannot bound: "cannot identify array bounds"), and
# loop values that live on after a loop inside a bigger function block the vectorizer ("value ... used outside the
# loop"). Both checked with -pass-remarks-analysis=loop-vectorize; the kernel's loops compile to 8-lane AVX2.


@register_jitable(error_model="numpy")
def _adamw_elem(p, m, v, g, ss, bc2, decay, l2, coupled, w, base_is_m, b2, omb2, eps):
    """One element of torch.optim.AdamW, with torch's CPU rounding (fma where torch's kernels use one)."""
    p = p * decay  # decoupled decay; decay == 1 (exact) for Adam-L2 or weight_decay == 0
    g = _fma(l2, p, g) if coupled else g  # g.add(p, alpha=wd)
    # lerp_: torch computes fma(w, g - m, m) for w < 0.5, else fma(w - 1, g - m, g), w - 1 folded into ``w``.
    m = _fma(w, g - m, m if base_is_m else g)
    v = _fma(omb2 * g, g, v * b2)  # mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = math.sqrt(v) / bc2 + eps
    p = p - (ss * m) / denom  # addcdiv_(m, denom, value=-step_size)
    return p, m, v


@register_jitable
def _blend(new, old, mask):
    """``new`` where ``mask`` is all ones, else ``old``, bit for bit.

    Integer and/or rather than a select: LLVM turns ``a[i] = new if m else a[i]`` into a masked store
    (``vmaskmovps``), which is microcoded on AMD Zen; with the mask loaded from memory it cannot prove the
    and/or is a select and emits plain blends (mixed runs: 1.11 -> 0.9x ns/element in cache, 1 thread).
    """
    return _bits_f32(_U32(_U32(_f32_bits(new) & mask) | _U32(_f32_bits(old) & _U32(~mask))))


@register_jitable
def _prefetch_ahead(master, exp_avg, exp_avg_sq, grad, snapshot, i):
    """Prefetch one block (``_BLOCK`` elements) of every stream, ``_PREFETCH_AHEAD`` elements ahead of ``i``."""
    k = i + _PREFETCH_AHEAD
    for line in range(_BLOCK // _LINE_F32):
        q = k + np.uint64(line * _LINE_F32)
        _prefetch(master, q)
        _prefetch(exp_avg, q)
        _prefetch(exp_avg_sq, q)
    for line in range(_BLOCK // (2 * _LINE_F32)):  # 16-bit streams hold twice as many elements per line
        q = k + np.uint64(line * 2 * _LINE_F32)
        _prefetch(grad, q)
        _prefetch_opt(snapshot, q)
    if grad.itemsize == 4:
        for line in range(_BLOCK // (2 * _LINE_F32), _BLOCK // _LINE_F32):
            _prefetch(grad, k + np.uint64(line * _LINE_F32))


@register_jitable(error_model="numpy")
def _run_dense(master, exp_avg, exp_avg_sq, grad, snapshot, base, a, b, step_size, bc2_sqrt, count, divide, decay,
               l2, coupled, w, base_is_m, b2, omb2, eps):
    """Columns ``[a, b)`` of the row starting at flat offset ``base``, all updated; in prefetched blocks."""
    j0 = a
    while j0 < b:
        _prefetch_ahead(master, exp_avg, exp_avg_sq, grad, snapshot, base + j0)
        j1 = min(j0 + _BLOCK_U, b)
        for j in range(j0, j1):
            i = base + j
            g = _load_grad(grad, i)
            g = g / count if divide else g
            p, m, v = _adamw_elem(master[i], exp_avg[i], exp_avg_sq[i], g, step_size[j], bc2_sqrt[j], decay, l2,
                                  coupled, w, base_is_m, b2, omb2, eps)
            master[i] = p
            exp_avg[i] = m
            exp_avg_sq[i] = v
            _store_snap(snapshot, i, p)
        j0 = j1


@register_jitable(error_model="numpy")
def _run_mixed(master, exp_avg, exp_avg_sq, grad, snapshot, base, a, b, umask, step_size, bc2_sqrt, count, divide,
               decay, l2, coupled, w, base_is_m, b2, omb2, eps):
    """Like ``_run_dense``, but only columns with ``umask[j] != 0`` change; the rest are computed and discarded."""
    j0 = a
    while j0 < b:
        _prefetch_ahead(master, exp_avg, exp_avg_sq, grad, snapshot, base + j0)
        j1 = min(j0 + _BLOCK_U, b)
        for j in range(j0, j1):
            i = base + j
            g = _load_grad(grad, i)
            g = g / count if divide else g
            p0 = master[i]
            m0 = exp_avg[i]
            v0 = exp_avg_sq[i]
            p, m, v = _adamw_elem(p0, m0, v0, g, step_size[j], bc2_sqrt[j], decay, l2, coupled, w, base_is_m, b2,
                                  omb2, eps)
            mask = umask[j]
            master[i] = _blend(p, p0, mask)
            exp_avg[i] = _blend(m, m0, mask)
            exp_avg_sq[i] = _blend(v, v0, mask)
            _store_snap_masked(snapshot, i, p, mask)
        j0 = j1


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def _host_adamw_kernel(
    master, exp_avg, exp_avg_sq, grad, snapshot, cols, umask, step_size, bc2_sqrt, starts, stops, mixed,
    count, decay, l2, coupled, w, base_is_m, b2, omb2, eps,
):
    """Flat row-major buffers; one work item is one run of one row."""
    nrun = starts.shape[0]
    rows = master.shape[0] // cols
    divide = count != np.float32(1.0)  # x / 1 == x, so count == 1 skips the division
    for item in prange(rows * nrun):
        r = item // nrun
        k = item - r * nrun
        base = np.uint64(r * cols)
        a = np.uint64(starts[k])
        b = np.uint64(stops[k])
        if mixed[k]:
            _run_mixed(master, exp_avg, exp_avg_sq, grad, snapshot, base, a, b, umask, step_size, bc2_sqrt, count,
                       divide, decay, l2, coupled, w, base_is_m, b2, omb2, eps)
        else:
            _run_dense(master, exp_avg, exp_avg_sq, grad, snapshot, base, a, b, step_size, bc2_sqrt, count, divide,
                       decay, l2, coupled, w, base_is_m, b2, omb2, eps)


# --- launcher ---------------------------------------------------------------------------------------------------------


def _flat_view(t: torch.Tensor) -> np.ndarray:
    """Zero-copy 1-D numpy view; bf16 as uint16 bits, fp16 as int16 bits (see the overloads above)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy().reshape(-1)
    return t.numpy().reshape(-1)  # contiguous (checked), so numpy's reshape is a view


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
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool = True,
    snapshot: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """Host AdamW on the unselected columns (``slot < 0``) of full ``[R, C]`` fp32 CPU state, in place.

    Same arguments and results as :func:`zenflow_triton.kernels.reference.host_adamw_`: the gradient is
    ``grad / count`` (``grad`` fp32 or bf16, the sum of ``count`` gradients); bias correction uses the
    per-column, already incremented ``col_step`` (read only); ``decoupled=False`` is Adam with L2 weight decay.
    Updated columns of ``master`` are also written to ``snapshot`` (fp32, bf16 or fp16; round to nearest even)
    when given. Selected columns of every buffer keep their bits. All tensors must be contiguous CPU tensors
    (pinned or not); nothing is copied. Results do not depend on the thread count.

    ``num_threads``: at most this many numba threads for this call (default: the calling thread's numba setting;
    jobs under ~32K elements run on one thread). Numba's setting belongs to the calling thread and is restored
    on return. The kernel releases the GIL, but call it from one thread at a time (numba's thread pools are not
    made for concurrent parallel launches).
    """
    rows, cols = check_host_adamw_args(master, exp_avg, exp_avg_sq, grad, slot=slot, col_step=col_step,
                                       snapshot=snapshot, count=count)
    check_hyperparams(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    _check_num_threads(num_threads)
    if rows == 0 or cols == 0:
        return
    step_size, bc2_sqrt, umask, starts, stops, mixed, visited = _plan(
        slot.numpy(), col_step.numpy(), float(lr), float(beta1), float(beta2), _CHUNK_COLS, _MIN_SKIP_COLS)
    if visited == 0:
        return
    # Scalars are rounded to float32 exactly where torch rounds them (a Python scalar meets an fp32 tensor).
    w = np.float32(1.0 - beta1)
    base_is_m = bool(abs(w) < 0.5)  # torch's lerp switches formula at weight 0.5
    if not base_is_m:
        w = np.float32(w - np.float32(1.0))
    wd = float(weight_decay)
    coupled = bool(not decoupled and wd != 0.0)
    decay = np.float32(1.0 - lr * wd) if decoupled and wd != 0.0 else np.float32(1.0)
    snap = None if snapshot is None else _flat_view(snapshot)
    args = (
        _flat_view(master), _flat_view(exp_avg), _flat_view(exp_avg_sq), _flat_view(grad), snap, cols, umask,
        step_size, bc2_sqrt, starts, stops, mixed, np.float32(count), decay, np.float32(wd), coupled, w, base_is_m,
        np.float32(beta2), np.float32(1.0 - beta2), np.float32(eps),
    )
    previous = numba.get_num_threads()
    threads = 1 if rows * visited < _MIN_PARALLEL_ELEMS else (previous if num_threads is None else num_threads)
    if threads == previous:
        _host_adamw_kernel(*args)
        return
    numba.set_num_threads(threads)
    try:
        _host_adamw_kernel(*args)
    finally:
        numba.set_num_threads(previous)


_GRAD_DTYPES = (torch.float32, torch.bfloat16)
_SNAPSHOT_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
_warm_lock = threading.Lock()
_warmed: set[tuple[torch.dtype, torch.dtype | None]] = set()


def warmup(
    grad_dtypes: tuple[torch.dtype, ...] = _GRAD_DTYPES,
    snapshot_dtypes: tuple[torch.dtype | None, ...] = _SNAPSHOT_DTYPES,
) -> None:
    """Compile (or load from numba's on-disk cache) the kernels for these gradient and snapshot dtypes.

    By default all eight (fp32 or bf16 grad x no/fp32/bf16/fp16 snapshot): 3-5 s of compilation each on a cold
    cache (the first run on a machine), ~0.1 s each when numba's cache is warm. An optimizer passes just the
    dtypes it will use. Safe to call from several threads and more than once.
    """
    with _warm_lock:
        slot = torch.tensor([-1, 0], dtype=torch.int32)
        col_step = torch.ones(2, dtype=torch.int32)
        for gdt in grad_dtypes:
            for sdt in snapshot_dtypes:
                if (gdt, sdt) in _warmed:
                    continue
                z = torch.zeros
                snap = None if sdt is None else z(1, 2, dtype=sdt)
                host_adamw_(z(1, 2), z(1, 2), z(1, 2), z(1, 2, dtype=gdt), count=1, slot=slot, col_step=col_step,
                            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, snapshot=snap)
                _warmed.add((gdt, sdt))
