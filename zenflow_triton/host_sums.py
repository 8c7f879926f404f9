"""accumulate="host" (DESIGN §4, §5): the window sums in host memory, as the ZenFlow paper keeps them.

Every step the offloaded gradients land in one of two pinned slots per parameter (a device-to-host copy on the
pipeline's copy stream; a plain copy on CPU tensors), and a second worker thread, the *adder*, adds each into the
open window's fp32 host sum (``kernels/host_accumulate.py``): the same fp32 additions in the same order as the
device's ``acc``, so the parameters are bit-identical to accumulate="device". A window end then ships nothing; its
AdamW job waits for the adder's last add. :class:`HostSums` is that machinery for one :class:`.Pipeline`, which
owns the records, the streams and the waits it is given.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .state import OffloadedParam
from .worker import HostWorker

__all__ = ["AddItem", "HostSums", "compile_accumulate_kernel", "run_add_job"]

State = MutableMapping[torch.Tensor, dict[str, Any]]
# (parameter, its gradient this step, whether the window sum already holds a step: add, else overwrite); the
# gradient None: captured in backward (grads_in_backward), already in the slot that claim_slot gave
Landed = Sequence[tuple[torch.Tensor, torch.Tensor | None, bool]]


@dataclass
class AddItem:
    """One parameter's share of one step's add job, ``dst (+)= src`` (``accumulate``)."""

    dst: torch.Tensor  # the open window's fp32 sum (host)
    src: torch.Tensor  # this step's landed gradient (host)
    accumulate: bool


def run_add_job(items: list[AddItem], ready: torch.cuda.Event | None, num_threads: int) -> float:
    """The adder's body for one step: each landed gradient into its window sum. Returns seconds spent."""
    from .kernels.host_accumulate import host_accumulate_

    start = time.perf_counter()
    if ready is not None:
        ready.synchronize()  # the landing slots are filled by an asynchronous device-to-host copy
    for it in items:
        host_accumulate_(it.dst, it.src, accumulate=it.accumulate, num_threads=num_threads)
    return time.perf_counter() - start


def compile_accumulate_kernel() -> None:
    """The adder's first job: load the add kernel (numba compiles it on a machine's first use)."""
    from .kernels.host_accumulate import host_accumulate_

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        host_accumulate_(torch.zeros(1), torch.zeros(1, dtype=dtype), accumulate=True, num_threads=1)


class HostSums:
    """The adder thread and the per-step state of accumulate="host" for one pipeline: the add job of each landing
    slot (two slots, alternating by step) and the last one, and on CUDA the bf16 rounding buffer and the event after the
    last gradient copy."""

    def __init__(self, device: torch.device) -> None:
        self.adder = HostWorker(name="zenflow-add")
        self._finalizer = weakref.finalize(self, self.adder.close)
        if device.type == "cuda":
            self.adder.use_device(device)
        # Load (or compile, on a machine's first run) the add kernel while the first steps run; the adder runs jobs
        # in order, so the first add waits for it.
        self.adder.submit(compile_accumulate_kernel)
        self.adds: list[Future | None] = [None, None]
        self.slot = 0
        self.last: Future | None = None
        # CUDA, grad_dtype="bfloat16": the one device buffer each step's gradient is rounded into before its copy.
        self.bf16_landing: torch.Tensor | None = None
        # CUDA: the event after the last per-step gradient copy. The model may reuse a gradient's memory in place
        # (zero_grad(set_to_none=False), then backward), on the compute stream, which must wait for that copy first
        # (release_gradients).
        self.grads_read: torch.cuda.Event | None = None

    def land(self, landed: Landed, records: Mapping[torch.Tensor, OffloadedParam], state: State, stats: Any, *,
             cpu_threads: int, wait: Callable[[Future, HostWorker], None],
             copy_stream: Callable[[torch.device], torch.cuda.Stream], test_delays: Mapping[str, int]) -> None:
        """After this step's fused kernels: copy each ``(p, grad, accumulate)``'s gradient into the next landing
        slot (device-to-host on ``copy_stream``; a plain copy on CPU tensors) and submit the add into its window sum
        to the adder. ``wait`` (the pipeline's, counted as stall) runs only when the slot's previous add, two steps
        ago, still reads it."""
        slot = self.claim_slot(wait)
        self.slot ^= 1
        device = landed[0][0].device
        ready = None
        if device.type == "cuda":
            ready = self._land_on_copy_stream(landed, records, slot, copy_stream(device), test_delays)
        else:
            # The training thread copies: the gradient may change (zero_grad, the next backward) before the adder
            # runs, and a copy here costs one read and one write, like the device-to-host copy it stands for.
            for p, grad, _ in landed:
                if grad is not None:
                    records[p].slots[slot].view(grad.shape).copy_(grad)
        items = []
        for p, _, accumulate in landed:
            src = records[p].slots[slot]
            items.append(AddItem(dst=state[p]["acc"], src=src, accumulate=accumulate))
            stats.d2h_bytes += src.numel() * src.element_size()
        self.adds[slot] = self.last = self.adder.submit(run_add_job, items, ready, cpu_threads)

    def claim_slot(self, wait: Callable[[Future, HostWorker], None]) -> int:
        """The slot the next :meth:`land` fills, after waiting (``wait``) for its previous add, two steps ago."""
        previous = self.adds[self.slot]
        if previous is not None:
            wait(previous, self.adder)
            self.adds[self.slot] = None
        return self.slot

    def _land_on_copy_stream(self, landed: Landed, records: Mapping[torch.Tensor, OffloadedParam], slot: int,
                             copy: torch.cuda.Stream, test_delays: Mapping[str, int]) -> torch.cuda.Event:
        """CUDA: this step's gradients to landing slot ``slot`` on the copy stream, after the compute stream's fused
        kernels (with grad_dtype="bfloat16", each rounded first into one reused buffer, as the window sums are in
        the pipeline's _ship_sums). The event marks their end."""
        device = landed[0][0].device
        copy.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(copy):
            if test_delays.get("d2h"):
                torch.cuda._sleep(test_delays["d2h"])
            for p, grad, _ in landed:
                if grad is None:  # captured: its copies were queued on this stream in backward, before this event
                    continue
                dst = records[p].slots[slot]
                src = grad
                if dst.dtype != grad.dtype:  # grad_dtype="bfloat16": this step's gradient rounded to bf16
                    numel = grad.numel()
                    if self.bf16_landing is None or self.bf16_landing.numel() < numel:
                        self.bf16_landing = None
                        self.bf16_landing = torch.empty(numel, dtype=torch.bfloat16, device=device)
                    src = self.bf16_landing[:numel].view(grad.shape)
                    src.copy_(grad)
                dst.view(grad.shape).copy_(src, non_blocking=True)
                # The gradient is read on this stream: if the model frees it (zero_grad), its memory must not be
                # handed out again before this stream is past the read.
                grad.record_stream(copy)
            ready = torch.cuda.Event(blocking=True)
            ready.record(copy)
        if any(grad is not None and grad._base is not None for _, grad, _ in landed):
            # A gradient that views a larger buffer (DDP's gradient_as_bucket_view=True) is written in place by the
            # next backward, which record_stream cannot see: the compute stream waits for the copies instead (the
            # copies then overlap nothing of the next step, but read this step's gradient).
            torch.cuda.current_stream(device).wait_event(ready)
        self.grads_read = ready
        return ready

    def release_gradients(self, device: torch.device | None) -> None:
        """Before gradients are changed in place (``zero_grad(set_to_none=False)``): on CUDA, the compute stream
        waits for the last per-step copy that reads them. A gradient set to None needs nothing (the copy stream
        holds its memory: record_stream)."""
        event, self.grads_read = self.grads_read, None
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)

    def wait_all(self, wait: Callable[[Future, HostWorker], None]) -> None:
        """Wait for every add submitted so far (the adder runs its jobs in order)."""
        last = self.last
        if last is not None:
            wait(last, self.adder)
            self.last = None
            self.adds = [None, None]

    def buffers(self) -> list[torch.Tensor | None]:
        """The device buffers it holds (for ``device_bytes_per_param``)."""
        return [self.bf16_landing]

    def close(self, timeout: float) -> None:
        """Stop the adder (at most ``timeout`` seconds) and drop every buffer and job."""
        self.adder.close(timeout)
        self._finalizer.detach()
        self.adds, self.last, self.bf16_landing, self.grads_read = [None, None], None, None, None
