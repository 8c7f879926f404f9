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
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["HostWorker", "WorkerError", "host_thread_limit", "host_thread_share"]

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


def host_thread_share() -> int:
    """This process's share of :func:`host_thread_limit`: all of it, unless several processes of one job share the
    node without being bound to cores of their own (``LOCAL_WORLD_SIZE`` > 1, as torchrun sets it, and an affinity
    that covers every core); then an equal split, so that the ranks' host jobs do not oversubscribe the node."""
    limit = host_thread_limit()
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    if local <= 1:
        return limit
    try:
        bound = len(os.sched_getaffinity(0)) < (os.cpu_count() or 1)
    except AttributeError:  # not on Linux: no affinity to tell
        bound = False
    return limit if bound else max(1, limit // local)


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
        # Set when a job overran its timeout (the optimizer then stops): jobs check it before writing anything
        # (run_host_job, before each parameter), queued jobs no longer run, and close() does not wait for the thread.
        self.cancelled = threading.Event()
        self._device: Any = None  # the CUDA device jobs run on (use_device), None: whatever the thread has
        self._thread_device: Any = None  # the device set in the worker thread so far
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            # Dropped before the job runs, and the job's own references right after it: a thread waiting for its
            # next job must hold nothing of the last one (host buffers from a slab replaced since, by
            # load_state_dict or close, would otherwise stay pinned until the next window).
            del item
            if self.cancelled.is_set():
                future.set_exception(WorkerError("the host worker was stopped by a timeout; this job did not run"))
            elif future.set_running_or_notify_cancel():
                self._run(future, fn, args)
            del future, fn, args

    def _run(self, future: Future, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._enter_device()
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the training thread
            # The optimizer keeps the exception to re-raise, and its traceback holds the job's frames, which link
            # back to this one: the job's frames keep their lines but drop their locals (host buffers), and this
            # frame drops the job's arguments.
            del fn, args
            traceback.clear_frames(exc.__traceback__)
            future.set_exception(exc)
        else:
            future.set_result(result)

    def use_device(self, device: Any) -> None:
        """Run the following jobs with ``device`` (a CUDA ``torch.device``) as this thread's current device.

        A thread starts on CUDA's device 0; a job's first CUDA call (an event wait) would create a context there,
        on every rank of a one-process-per-GPU job (hundreds of MB of GPU 0 each, as the DataLoader's pin-memory
        thread once did). Jobs then run as if started on the parameters' device.
        """
        self._device = device

    def _enter_device(self) -> None:
        device = self._device
        if device is not None and device != self._thread_device:
            import torch  # only here: the worker itself needs no torch

            torch.cuda.set_device(device)
            self._thread_device = device

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
                # Declared hung: whatever the job still does must not reach memory the user may reuse now (a model
                # restored from a checkpoint into the parameters it would have written).
                self.cancelled.set()
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
        """Finish queued jobs, then stop the thread, waiting at most ``timeout`` seconds (none after a job overran
        its timeout: the thread is then left to end on its own, a daemon that writes nothing more). Safe to call
        more than once."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            hung = self.cancelled.is_set()
            self._thread.join(0.0 if hung else timeout)
            if self._thread.is_alive():
                logger.warning("zenflow_triton: the host worker thread %s; it is left to end on its own (a daemon "
                               "thread: nothing it computes is applied, and it does not keep the process alive)",
                               "is hung in a job that overran worker_timeout" if hung
                               else f"did not stop within {timeout:g} s")
