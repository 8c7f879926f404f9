"""accumulate="host" (DESIGN §4, §5): the window sums in host memory, as the ZenFlow paper keeps them.

Every step the offloaded gradients land on the host (a device-to-host copy on the pipeline's copy stream; a plain
copy on CPU tensors), in pieces, in a bounded ring of pinned chunks (:class:`.LandingRing`), or with
grads_in_backward in each parameter's one capture slot, filled in backward; a second worker thread, the *adder*,
adds each into the open window's fp32 host sum (``kernels/host_accumulate.py``): the same fp32 additions in the same
order as the device's ``acc`` (a piece of a sum is added elementwise, as the whole is), so the parameters are
bit-identical to accumulate="device". A window end then ships nothing; its AdamW job waits for the adder's last add.
With one window sum (:func:`.staging.window_sums`) a window's first add waits, in the adder, for the previous
window's job, which reads the same sum. :class:`HostSums` is that machinery for one :class:`.Pipeline`, which owns
the records, the streams and the waits it is given.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .staging import RING_CHUNKS, LandingRing, ring_chunk_bytes
from .state import OffloadedParam
from .worker import HostWorker

__all__ = ["AddItem", "HostSums", "compile_accumulate_kernel", "run_add_job"]

State = MutableMapping[torch.Tensor, dict[str, Any]]
# (parameter, its gradient this step, whether the window sum already holds a step: add, else overwrite); the
# gradient None: captured in backward (grads_in_backward), already in the slot that capture_slot gave
Landed = Sequence[tuple[torch.Tensor, torch.Tensor | None, bool]]


@dataclass
class AddItem:
    """One parameter's share of one step's add job, ``dst (+)= src`` (``accumulate``)."""

    dst: torch.Tensor  # the open window's fp32 sum (host), or a piece of it
    src: torch.Tensor  # this step's landed gradient (host), or the same piece of it
    accumulate: bool
    # CUDA: the event after the copy that fills ``src`` (None: filled already, or by the job's ``ready``).
    landed: torch.cuda.Event | None = None
    # One window sum: the previous window's job, which reads ``dst``; a window's first add (``dst = src``) waits
    # for it.
    after: Future | None = None


def run_add_job(items: list[AddItem], ready: torch.cuda.Event | None, num_threads: int) -> float:
    """The adder's body for one job: each landed gradient (or piece) into its window sum. Returns seconds spent."""
    from .kernels.host_accumulate import host_accumulate_

    start = time.perf_counter()
    if ready is not None:
        ready.synchronize()  # the capture slots are filled by an asynchronous device-to-host copy
    for it in items:
        if it.after is not None:
            it.after.result()  # the previous window's job has read the sum this add overwrites
        if it.landed is not None:
            it.landed.synchronize()  # this piece's chunk is filled by an asynchronous device-to-host copy
        host_accumulate_(it.dst, it.src, accumulate=it.accumulate, num_threads=num_threads)
    return time.perf_counter() - start


def compile_accumulate_kernel() -> None:
    """The adder's first job: load the add kernel (numba compiles it on a machine's first use)."""
    from .kernels.host_accumulate import host_accumulate_

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        host_accumulate_(torch.zeros(1), torch.zeros(1, dtype=dtype), accumulate=True, num_threads=1)


class HostSums:
    """The adder thread and the per-step state of accumulate="host" for one pipeline: the landing ring (made at the
    first :meth:`land`, sized by the offloaded gradients) or, with grads_in_backward, the add job that reads the
    capture slots; the last add; and on CUDA the bf16 rounding buffer and the event after the last gradient copy."""

    def __init__(self, device: torch.device, *, capture: bool = False) -> None:
        self.capture = capture  # grads_in_backward: per-parameter capture slots instead of the ring
        self.adder = HostWorker(name="zenflow-add")
        self._finalizer = weakref.finalize(self, self.adder.close)
        if device.type == "cuda":
            self.adder.use_device(device)
        # Load (or compile, on a machine's first run) the add kernel while the first steps run; the adder runs jobs
        # in order, so the first add waits for it.
        self.adder.submit(compile_accumulate_kernel)
        self.ring: LandingRing | None = None
        self._ring_for = -1  # the number of records the ring was sized for
        self.slot_add: Future | None = None  # grads_in_backward: the last add that reads the capture slots
        self.last: Future | None = None
        # CUDA, grad_dtype="bfloat16": the one device buffer each step's gradient is rounded into before its copy.
        self.bf16_landing: torch.Tensor | None = None
        # CUDA: the event after the last per-step gradient copy. The model may reuse a gradient's memory in place
        # (zero_grad(set_to_none=False), then backward), on the compute stream, which must wait for that copy first
        # (release_gradients).
        self.grads_read: torch.cuda.Event | None = None

    def land(self, landed: Landed, records: Mapping[torch.Tensor, OffloadedParam], state: State, stats: Any, *,
             cpu_threads: int, wait: Callable[[Future, HostWorker], None],
             copy_stream: Callable[[torch.device], torch.cuda.Stream], test_delays: Mapping[str, int],
             after: Future | None = None) -> None:
        """After this step's fused kernels: copy each ``(p, grad, accumulate)``'s gradient to the host (device-to-host
        on ``copy_stream``; a plain copy on CPU tensors) and submit its add into its window sum to the adder.
        ``wait`` (the pipeline's, counted as stall) runs when a chunk of the ring (or a capture slot) is still read
        by an earlier add. ``after``: with one window sum, the job in flight, which a window's first add waits for."""
        device = landed[0][0].device
        cuda = device.type == "cuda"
        copy = copy_stream(device) if cuda else None
        if cuda:
            copy.wait_stream(torch.cuda.current_stream(device))
            if test_delays.get("d2h"):
                with torch.cuda.stream(copy):
                    torch.cuda._sleep(test_delays["d2h"])
        if self.capture:
            self._land_in_slots(landed, records, state, stats, cpu_threads, wait, copy, after)
        else:
            self._land_in_ring(landed, records, state, stats, cpu_threads, wait, copy, after)
        if cuda:
            ready = torch.cuda.Event(blocking=True)
            ready.record(copy)
            if any(grad is not None and grad._base is not None for _, grad, _ in landed):
                # A gradient that views a larger buffer (DDP's gradient_as_bucket_view=True) is written in place by
                # the next backward, which record_stream cannot see: the compute stream waits for the copies instead
                # (the copies then overlap nothing of the next step, but read this step's gradient).
                torch.cuda.current_stream(device).wait_event(ready)
            self.grads_read = ready

    def _land_in_ring(self, landed: Landed, records: Mapping[torch.Tensor, OffloadedParam], state: State, stats: Any,
                      cpu_threads: int, wait: Callable[[Future, HostWorker], None], copy: torch.cuda.Stream | None,
                      after: Future | None) -> None:
        """Each gradient in pieces through the ring: a piece's add is gathered into a batch, submitted when a chunk
        it holds comes round again, at half a ring (so one batch is copied while the one before is added) and at
        the end."""
        ring = self._ring(records, landed[0][0].device, wait)
        batch: list[AddItem] = []
        chunks: list[int] = []

        def flush() -> None:
            if batch:
                self.last = self.adder.submit(run_add_job, list(batch), None, cpu_threads)
                ring.hold(chunks, self.last)
                batch.clear()
                chunks.clear()

        for p, grad, accumulate in landed:
            rec = records[p]
            dst = state[p]["acc"].view(-1)
            src = grad.reshape(-1)
            dtype = rec.slot_dtype
            for start, stop in ring.pieces(dst.numel(), dtype.itemsize):
                i = ring.claim(lambda job: wait(job, self.adder), flush)
                piece = ring.view(i, dtype, stop - start)
                event = None
                if copy is not None:
                    event = self._copy(piece, src[start:stop], copy)
                else:
                    # The training thread copies: the gradient may change (zero_grad, the next backward) before the
                    # adder runs, and a copy here costs one read and one write, like the device-to-host copy it
                    # stands for.
                    piece.copy_(src[start:stop])
                batch.append(AddItem(dst=dst[start:stop], src=piece, accumulate=accumulate, landed=event,
                                     after=None if accumulate or len(rec.sums) == 2 else after))
                chunks.append(i)
                stats.d2h_bytes += piece.numel() * piece.element_size()
                if len(batch) == RING_CHUNKS // 2:
                    flush()
            if copy is not None:
                # The gradient is read on the copy stream: if the model frees it (zero_grad), its memory must not be
                # handed out again before that stream is past the read.
                grad.record_stream(copy)
        flush()

    def _land_in_slots(self, landed: Landed, records: Mapping[torch.Tensor, OffloadedParam], state: State,
                       stats: Any, cpu_threads: int, wait: Callable[[Future, HostWorker], None],
                       copy: torch.cuda.Stream | None, after: Future | None) -> None:
        """grads_in_backward: the captured gradients are in their slots already; one that was not captured is
        copied into its slot now. One add job for the step."""
        self._claim_slots(wait)
        items = []
        for p, grad, accumulate in landed:
            rec = records[p]
            src = rec.slots[0]
            if grad is not None:
                if copy is not None:
                    self._copy(src.view(-1), grad.reshape(-1), copy)
                    grad.record_stream(copy)
                else:
                    src.view(grad.shape).copy_(grad)
            items.append(AddItem(dst=state[p]["acc"], src=src, accumulate=accumulate,
                                 after=None if accumulate or len(rec.sums) == 2 else after))
            stats.d2h_bytes += src.numel() * src.element_size()
        ready = None
        if copy is not None:  # after every capture copy (queued on this stream in backward) and those above
            ready = torch.cuda.Event(blocking=True)
            ready.record(copy)
        self.slot_add = self.last = self.adder.submit(run_add_job, items, ready, cpu_threads)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, copy: torch.cuda.Stream) -> torch.cuda.Event:
        """CUDA: ``dst`` (host) = ``src`` on the copy stream (with grad_dtype="bfloat16" rounded first into one reused
        device buffer, as the window sums are in the pipeline's _ship_sums). The event marks its end."""
        with torch.cuda.stream(copy):
            if dst.dtype != src.dtype:  # grad_dtype="bfloat16": this step's gradient rounded to bf16
                numel = src.numel()
                if self.bf16_landing is None or self.bf16_landing.numel() < numel:
                    self.bf16_landing = None
                    self.bf16_landing = torch.empty(numel, dtype=torch.bfloat16, device=src.device)
                rounded = self.bf16_landing[:numel]
                rounded.copy_(src)
                src = rounded
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)
            event.record(copy)
        return event

    def _ring(self, records: Mapping[torch.Tensor, OffloadedParam], device: torch.device,
              wait: Callable[[Future, HostWorker], None]) -> LandingRing:
        """The landing ring, sized for the offloaded gradients (made again, once the adds reading it are done, when
        parameters that step for the first time need larger chunks)."""
        if self._ring_for != len(records):
            sizes = [rec.rows * rec.cols * rec.slot_dtype.itemsize for rec in records.values()]
            chunk = ring_chunk_bytes(sum(sizes), max(sizes))
            if self.ring is None or self.ring.chunk_bytes < chunk:
                if self.last is not None:
                    wait(self.last, self.adder)  # no add still reads the ring being replaced
                self.ring = None
                self.ring = LandingRing(chunk, pin=device.type == "cuda", device=device)
            self._ring_for = len(records)
        return self.ring

    def capture_slot(self, rec: OffloadedParam, wait: Callable[[Future, HostWorker], None]) -> torch.Tensor:
        """grads_in_backward: ``rec``'s capture slot, once the add of the last step no longer reads it."""
        self._claim_slots(wait)
        return rec.slots[0]

    def _claim_slots(self, wait: Callable[[Future, HostWorker], None]) -> None:
        previous = self.slot_add
        if previous is not None:
            wait(previous, self.adder)
            self.slot_add = None

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
            self.last = self.slot_add = None
            if self.ring is not None:
                self.ring.drained()

    def buffers(self) -> list[torch.Tensor | None]:
        """The device buffers it holds (for ``device_bytes_per_param``)."""
        return [self.bf16_landing]

    def host_bytes(self) -> int:
        """Host bytes it holds beyond the parameters' slabs: the landing ring."""
        return self.ring.nbytes if self.ring is not None else 0

    def close(self, timeout: float) -> None:
        """Stop the adder (at most ``timeout`` seconds) and drop every buffer and job."""
        self.adder.close(timeout)
        self._finalizer.detach()
        self.slot_add, self.last, self.bf16_landing, self.grads_read, self.ring = None, None, None, None, None
