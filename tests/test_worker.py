"""HostWorker: jobs in order, failures to the caller, nothing of a finished job kept alive, the CUDA device set in the
worker thread (stood in for on a machine without a GPU)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from zenflow_triton.worker import HostWorker, WorkerError


class Buffer:
    """An argument object a weak reference can watch (a stand-in for a host slab view)."""


def _settle(worker: HostWorker) -> None:
    """Wait until the worker has gone back to waiting for its next job."""
    worker.wait(worker.submit(lambda: None), timeout=10)


def test_jobs_run_in_order_and_return() -> None:
    worker = HostWorker()
    seen: list[int] = []
    futures = [worker.submit(seen.append, i) for i in range(5)]
    assert [worker.wait(f, timeout=10) for f in futures] == [None] * 5
    assert seen == list(range(5))
    worker.close()
    with pytest.raises(WorkerError, match="closed"):
        worker.submit(seen.append, 9)


def test_the_worker_keeps_no_reference_to_a_finished_jobs_arguments() -> None:
    worker = HostWorker()
    arg = Buffer()
    ref = weakref.ref(arg)
    worker.wait(worker.submit(lambda b: None, arg), timeout=10)
    del arg
    gc.collect()
    # The thread now waits for the next job; before the fix it still held the last one's arguments.
    assert ref() is None
    worker.close()


def test_a_failed_jobs_exception_keeps_its_message_but_not_the_arguments() -> None:
    worker = HostWorker()
    arg = Buffer()
    ref = weakref.ref(arg)

    def job(b: Buffer) -> None:
        local = b  # noqa: F841 - a frame local holding the argument, as run_host_job's items do
        raise ValueError("boom")

    future = worker.submit(job, arg)
    with pytest.raises(ValueError, match="boom") as info:
        worker.wait(future, timeout=10)
    del arg
    gc.collect()
    assert ref() is None, "the exception's traceback keeps the job's arguments alive"
    assert any(entry.name == "job" for entry in info.traceback)  # the job's frame is still in the traceback
    worker.close()


def test_jobs_run_on_the_device_given(monkeypatch) -> None:
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append((threading.current_thread().name, dev)))
    worker = HostWorker(name="zf-test")
    _settle(worker)
    assert calls == []  # no device given: the thread's is left alone (CPU runs never touch CUDA)
    dev = torch.device("cuda", 1)
    worker.use_device(dev)
    for _ in range(3):
        _settle(worker)
    assert calls == [("zf-test", dev)]  # once, in the worker thread, before its first job on that device
    worker.close()


def test_dead_thread_and_timeout_become_errors() -> None:
    worker = HostWorker()
    gate = threading.Event()
    future = worker.submit(gate.wait)
    with pytest.raises(WorkerError, match="worker_timeout=0.2"):
        worker.wait(future, timeout=0.2)
    gate.set()
    worker.wait(future, timeout=10)
    worker.close()
