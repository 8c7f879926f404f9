"""The host worker: one thread per optimizer that runs the deferred Adam jobs in submission order.

The numba kernels release the GIL (``nogil=True``), so a job runs while the training thread keeps issuing
device work. Jobs are plain callables; their exceptions travel back through a ``Future`` and are re-raised
by the optimizer's next ``step()``. A job that never finishes, or a thread that died, becomes a
``RuntimeError`` after a timeout instead of a hang.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["HostWorker", "WorkerError", "host_thread_limit"]

logger = logging.getLogger("zenflow_triton")

# How often a waiter checks that the worker thread is still alive. Short enough that a dead worker is
# reported within a fraction of a second, long enough to cost nothing measurable (a wait is one syscall).
_POLL_S = 0.05


def host_thread_limit() -> int:
    """The most threads a host job can use: the cores this process may run on (its CPU affinity: a container or a
    batch job often gets fewer than ``os.cpu_count()``), capped by numba's thread pool (``NUMBA_NUM_THREADS``)."""
    import numba

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, numba.config.NUMBA_NUM_THREADS))


class WorkerError(RuntimeError):
    """The host worker failed, died or hung; the optimizer cannot continue."""


class HostWorker:
    """A single daemon thread executing submitted callables one at a time, in order."""

    def __init__(self, name: str = "zenflow-host") -> None:
        self._queue: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the training thread
                future.set_exception(exc)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._closed:
            raise WorkerError("the host worker is closed; create a new optimizer")
        if not self._thread.is_alive():
            raise WorkerError("the host worker thread has died")
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def wait(self, future: Future, timeout: float) -> Any:
        """The job's result; its exception re-raised; ``WorkerError`` if the worker died or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(
                    f"the host worker did not finish a job within worker_timeout={timeout:g} s; "
                    "it is hung or far slower than expected (raise worker_timeout if that is normal)"
                )
            try:
                return future.result(timeout=min(_POLL_S, remaining))
            except TimeoutError:
                if not self._thread.is_alive() and not future.done():
                    raise WorkerError("the host worker thread died before finishing its job") from None

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued jobs, then stop the thread. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("zenflow_triton host worker did not stop within %.0f s", timeout)
