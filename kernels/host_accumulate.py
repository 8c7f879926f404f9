"""The host window sum of ``accumulate="host"`` (DESIGN §4, §5): ``dst (+)= src`` in fp32, one step's gradient at a
time, in the worker.

``host_accumulate_`` is the numba twin of :func:`zenflow_triton.kernels.reference.host_accumulate_`: ``dst = src``
(the first step of a window) or ``dst += src``, with ``src`` fp32, bf16 or fp16 (widened exactly to fp32) and ``dst``
fp32. These are the operations the device's fused step applies to ``acc`` (``acc = g`` at a window's first step, not
``0 + g``, which would turn -0.0 into +0.0; then ``acc += g``), in the same order, so a window sum made here equals
``acc`` bit for bit. It streams 12 bytes per element with fp32 ``src`` (10 with 16-bit), so memory bandwidth bounds
it; the loop is one add per element and vectorizes.

Work is cut into fixed chunks of elements split statically over the threads; the result never depends on the
thread count (each element sees one operation).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from ._checks import _check_tensor
from ._numba_utils import flat_view, load_grad

__all__ = ["host_accumulate_"]

# Elements per work item. A memory-bound loop with no per-item set-up: the size only has to be large enough that
# scheduling is negligible and small enough that 2 threads balance on small matrices (measured with
# bench/report_host.py --accumulate: see docs/performance.md's host table; 16K-256K elements within noise).
_CHUNK = 1 << 16
# Below this many elements a call runs on one thread (waking numba's pool costs more than the add: 64K fp32
# elements take ~20 us on one core).
_MIN_PARALLEL_ELEMS = 1 << 17


# Separate functions with unsigned bounds so that LLVM vectorizes each loop (as in cpu_adamw.py).
@njit(nogil=True, cache=True)
def _add_run(dst, src, a, b):  # pragma: no cover - numba
    for i in range(a, b):
        dst[i] += load_grad(src, i)


@njit(nogil=True, cache=True)
def _copy_run(dst, src, a, b):  # pragma: no cover - numba
    for i in range(a, b):
        dst[i] = load_grad(src, i)


@njit(parallel=True, nogil=True, cache=True)
def _accumulate_parallel(dst, src, accumulate, chunk):  # pragma: no cover - numba
    n = dst.shape[0]
    for c in prange((n + chunk - 1) // chunk):
        a = c * chunk
        b = min(a + chunk, n)
        if accumulate:
            _add_run(dst, src, np.uint64(a), np.uint64(b))
        else:
            _copy_run(dst, src, np.uint64(a), np.uint64(b))


@njit(nogil=True, cache=True)
def _accumulate_serial(dst, src, accumulate):  # pragma: no cover - numba
    if accumulate:
        _add_run(dst, src, np.uint64(0), np.uint64(dst.shape[0]))
    else:
        _copy_run(dst, src, np.uint64(0), np.uint64(dst.shape[0]))


def host_accumulate_(dst: torch.Tensor, src: torch.Tensor, *, accumulate: bool, num_threads: int | None = None) -> None:
    """``dst = src`` (``accumulate=False``) or ``dst += src``, in place; ``dst`` a contiguous fp32 CPU tensor,
    ``src`` a contiguous CPU tensor of the same shape in fp32, bf16 or fp16.

    ``num_threads``: at most this many numba threads (default: the calling thread's numba setting); restored on
    return.
    """
    cpu = torch.device("cpu")
    _check_tensor("dst", dst, dtypes=(torch.float32,), device=cpu)
    _check_tensor("src", src, dtypes=(torch.float32, torch.bfloat16, torch.float16), shape=tuple(dst.shape),
                  device=cpu)
    limit = numba.config.NUMBA_NUM_THREADS
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or not 1 <= num_threads <= limit):
        raise ValueError(f"num_threads must be an int in [1, {limit}] (numba's pool size), got {num_threads!r}")
    n = dst.numel()
    if n == 0:
        return
    d, s = flat_view(dst), flat_view(src)
    if n < _MIN_PARALLEL_ELEMS or num_threads == 1:
        _accumulate_serial(d, s, bool(accumulate))
        return
    previous = numba.get_num_threads()
    threads = previous if num_threads is None else num_threads
    try:
        if threads != previous:
            numba.set_num_threads(threads)
        _accumulate_parallel(d, s, bool(accumulate), _CHUNK)
    finally:
        if numba.get_num_threads() != previous:
            numba.set_num_threads(previous)
