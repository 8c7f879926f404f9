"""The pipeline of host windows (DESIGN §5): everything between a window's gradient sum on the device and its
AdamW result back in the parameter.

One :class:`Pipeline` per optimizer owns the host worker thread, the host slabs and each offloaded parameter's
record (landing buffer, snapshot, masks), the copy streams and their events, the device staging buffers, and the
one host job in flight. The optimizer's schedule calls it at four points: :meth:`Pipeline.begin_step` before a
parameter's step, :meth:`Pipeline.takes_gradient` at a one-step window, :meth:`Pipeline.end_windows` at a window
end, :meth:`Pipeline.wait` where host results must be visible (a selection step, ``flush()``, ``state_dict()``);
with accumulate="host" also :meth:`Pipeline.land` after every step's fused kernels (each gradient to the host, where
the adder thread sums it).

On CPU tensors (no GPU) "device" and host memory are one, and three copies are skipped behind this interface:
a one-step window that ``step()`` waits for reads the gradient where it is and writes the parameter directly
(:meth:`takes_gradient`); ``acc`` and the landing buffer trade places at each window end; and an fp32 parameter
with ``overlap=False`` is its own host master (:func:`state.allocate`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import weakref
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from .auto import place_sums
from .autotune.placement import layout_of
from .config import ZenFlowConfig
from .host_budget import preflight
from .host_jobs import HostItem, Window, compile_host_kernels, run_host_job
from .host_memory import HostSlab
from .host_sums import HostSums
from .kernels import DeviceOps, load_device_ops
from .sharding import local
from .staging import MergeStaging
from .state import OffloadedParam, allocate, device_state_bytes, init_offloaded, load_offloaded, rehome
from .telemetry import Stats
from .worker import HostWorker, WorkerError, host_thread_share

# HostItem, Window, Stats and run_host_job live in rooms of their own (host_jobs, telemetry); named here too, as
# before.
__all__ = ["HostItem", "Pipeline", "Stats", "Window", "compile_host_kernels", "run_host_job"]

State = MutableMapping[torch.Tensor, dict[str, Any]]

logger = logging.getLogger("zenflow_triton")

# A first host job slower than this compiled the numba kernels (a cached load takes well under a second).
_COMPILE_NOTICE_S = 2.0
# Whether a worker of this process was already asked to load the host kernels (they load once per process).
_host_kernels_requested = False


def run_host_job_after(after: Future, items: list[HostItem], ready: Sequence[torch.cuda.Event],
                       num_threads: int) -> float:
    """accumulate="host": :func:`run_host_job` once ``after``, the adder's last job, has completed the window
    sums it reads (an exception there fails this job too, and surfaces at the next ``step()``)."""
    after.result()
    return run_host_job(items, ready, num_threads)


class Pipeline:
    """The host side of one optimizer: worker, slabs, records, copy streams, staging and the job in flight.

    ``config`` is the user's (``overlap``, ``grad_dtype``, ``backend``, ``cpu_threads``, ``worker_timeout`` are
    read); ``stats`` the optimizer's counters. State dicts are passed in by each call (the optimizer's ``state``).
    """

    def __init__(self, config: ZenFlowConfig, stats: Stats) -> None:
        self.config = config
        self.stats = stats
        self.records: dict[torch.Tensor, OffloadedParam] = {}
        self.slabs: list[HostSlab] = []
        self.failure: BaseException | None = None
        self.closed = False
        self._ops: DeviceOps | None = None
        # CUDA only: the device buffers the merge's host-to-device copies land in (see _merge).
        self._staging = MergeStaging()
        # CUDA only, grad_dtype="bfloat16": the one device buffer every window sum is rounded into before its copy
        # to the host (see _ship_sums).
        self._bf16_landing: torch.Tensor | None = None
        # CUDA only: device-to-host copies (window sums, accumulate="host"'s per-step gradients) and host-to-device
        # copies (the merge's) on streams of their own, so that the link carries both directions at once; events
        # order them wherever they share a buffer. And whether a merge copy was queued since the last host job.
        self._d2h_stream: torch.cuda.Stream | None = None
        self._h2d_stream: torch.cuda.Stream | None = None
        self._h2d_queued = False
        self._device: torch.device | None = None  # the CUDA device of the parameters, once known
        # Tests only (tests/test_gpu_stress.py): torch.cuda._sleep cycles injected on the copy stream before the
        # window's device-to-host copies ("d2h") and before each merge copy ("h2d"), and on the compute stream
        # before each merge kernel ("merge"), so that a missing event shows as wrong numbers. Empty in training.
        self.test_delays: dict[str, int] = {}
        self._job: Future | None = None  # the host job in flight
        self._job_compiles = False  # the job in flight is compile_host_kernels
        # A KeyboardInterrupt or SystemExit that arrived while waiting for the host: the call it interrupted
        # finishes its work first (see deferred_interrupts).
        self.interrupt: BaseException | None = None
        self.worker = HostWorker()
        # The worker stops when the optimizer is collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, self.worker.close)
        # accumulate="host" (DESIGN §4, §5): "device" or "host" once the parameters' device is known (None before),
        # why, and the adder and its per-step state (:class:`.HostSums`), made then.
        self.accumulate: str | None = None
        self.accumulate_reason = ""
        self._sums: HostSums | None = None

    # ------------------------------------------------------------------ lifecycle

    def device_ops(self, device: torch.device) -> DeviceOps:
        """The device-side kernels of ``config.backend`` for ``device``, loaded at first use."""
        if self._ops is None:
            self._ops = load_device_ops(self.config.backend, device)
        return self._ops

    def check_usable(self) -> None:
        if self.closed:
            raise RuntimeError("this ZenFlowAdamW was closed; create a new optimizer")
        if self.failure is not None:
            raise RuntimeError("this ZenFlowAdamW stopped after a host worker failure") from self.failure

    @contextlib.contextmanager
    def deferred_interrupts(self) -> Iterator[None]:
        """Around a public call (``step``, ``flush``, ``state_dict``...): a KeyboardInterrupt or SystemExit that
        arrives while the call waits for the host job is held until the call has finished its work, then raised as
        itself; so the optimizer is never left halfway through a step, and a checkpoint saved by the handler is the
        one an uninterrupted run would have. A second interrupt during that wait propagates at once."""
        try:
            yield
        finally:
            held, self.interrupt = self.interrupt, None
        if held is not None:  # only reached when the call itself succeeded
            raise held

    def raise_finished_job_error(self) -> None:
        """Re-raise, at the next ``step()``, an exception that the job in flight ended with."""
        job = self._job
        if job is not None and job.done() and job.exception() is not None:
            self._job = None
            exc = job.exception()
            self.failure = exc
            raise RuntimeError("the host worker failed during an earlier window") from exc
        add = self._sums.last if self._sums is not None else None
        if add is not None and add.done() and add.exception() is not None:
            self._sums.last = None
            self.failure = add.exception()
            raise RuntimeError("the host adder failed during an earlier step") from self.failure

    def close(self, state: State) -> None:
        """Apply host work still in flight (unless the worker failed), stop the worker, and release everything
        large: ``state`` (the optimizer's, cleared: slab views, ``acc``, the compact device state), the slabs, the
        records and the device buffers."""
        if self.closed:
            return
        try:
            if self.failure is None:
                self.wait(state, merge=True)
                self._wait_adds()
        except Exception as exc:  # close() always closes: what could not be applied is reported, not raised
            logger.warning("zenflow_triton: close() could not apply the host work in flight (%s: %s); the "
                           "parameters lack its update", type(exc).__name__, exc)
        finally:
            self.closed = True
            self.worker.close(self.config.worker_timeout)
            self._finalizer.detach()
            if self._sums is not None:
                self._sums.close(self.config.worker_timeout)
                self._sums = None
            if self._device is not None:
                # Queued copies read and write slab pages (copy stream) and merges read staging (compute stream):
                # the pages may be unregistered and unmapped only once no queued work can touch them. Every stream
                # of the device, not just those two: close() is rare, and the user may have queued work of their own
                # on a side stream that reads a state tensor.
                torch.cuda.synchronize(self._device)
            state.clear()
            self.slabs.clear()
            self.records.clear()
            self._staging.clear()
            self._bf16_landing = None
            self._d2h_stream = self._h2d_stream = None
            self._job = None

    def device_bytes(self, state: State) -> int:
        """Bytes this optimizer holds on the device for its offloaded parameters, beyond the weights and their
        ``.grad``: the device state entries (``acc`` unless accumulate="host", the compact selected state, the
        per-column vectors) and the pipeline's buffers (staging, bf16 rounding, score deltas)."""
        total = device_state_bytes(self.records, state)
        buffers = self._staging.buffers() + [self._bf16_landing] + (self._sums.buffers() if self._sums else [])
        return total + sum(t.numel() * t.element_size() for t in buffers if t is not None)

    def host_slabs(self) -> list[HostSlab]:
        """The host allocations it holds: the parameters' slabs and accumulate="host"'s landing ring."""
        ring = self._sums.ring if self._sums is not None else None
        return self.slabs + ([ring.slab] if ring is not None else [])

    # ------------------------------------------------------------------ host state

    def add(self, params: Sequence[torch.Tensor], state: State) -> None:
        """Host state for parameters stepping for the first time: one slab, fresh state. All or nothing: when an
        allocation fails (out of host or device memory) nothing is kept, and a later step() can retry."""
        staged: dict[torch.Tensor, dict[str, Any]] = {}
        slab, records = self._allocate(params, staged)
        for p, rec in records.items():
            init_offloaded(p, staged[p], rec)
        self.slabs.append(slab)
        self.records.update(records)
        state.update(staged)
        self._start_compile()

    def _start_compile(self) -> None:
        """Load (or compile, on a machine's first run) the host kernels in the worker while the device works."""
        global _host_kernels_requested
        if self._job is None and not _host_kernels_requested:
            _host_kernels_requested = True
            self._job, self._job_compiles = self.worker.submit(compile_host_kernels), True

    def stage_load(self, saved: Sequence[tuple[torch.Tensor, Mapping[str, Any]]], placement: str | None = None) -> Any:
        """The first half of ``load_state_dict``: a new slab and state for every offloaded parameter, filled from
        ``saved``, with nothing of this pipeline changed (an allocation that fails leaves it as it was). The
        parameters are not written either: a parameter that is its own master gets the saved master at
        :meth:`commit_load`. ``placement``: the checkpoint's accumulate, for "auto" not yet decided (preflight)."""
        if not saved:
            return None
        staged: dict[torch.Tensor, dict[str, Any]] = {}
        slab, records = self._allocate([p for p, _ in saved], staged, placement)
        for p, entries in saved:
            load_offloaded(p, staged[p], records[p], entries, write_own_master=False)
        return slab, records, staged, saved

    def commit_load(self, loaded: Any, state: State) -> None:
        """The second half: replace all host state by what :meth:`stage_load` made (``state`` already cleared);
        the old slabs go. Allocates nothing."""
        if self._device is not None:
            # The old slabs die here: queued copies from or into their pages (a merge's, after a synchronous window
            # that nothing waited for on the device) must have finished first. See close().
            torch.cuda.synchronize(self._device)
        self.records.clear()
        self.slabs.clear()
        if loaded is None:
            return
        slab, records, staged, saved = loaded
        self.slabs.append(slab)
        self.records.update(records)
        state.update(staged)
        for p, entries in saved:
            rec = records[p]
            if rec.master_is_param:
                rec.host["host_master"].copy_(entries["master"].detach().reshape(rec.rows, rec.cols))
        self._start_compile()

    def _allocate(self, params: Sequence[torch.Tensor], state: State,
                  placement: str | None = None) -> tuple[HostSlab, dict[torch.Tensor, OffloadedParam]]:
        grad_dtype = torch.bfloat16 if self.config.grad_dtype == "bfloat16" else torch.float32
        device = params[0].device
        if device.type == "cuda":
            self._device = device
            # The worker's jobs wait on CUDA events: on the parameters' device, not on a context of device 0.
            self.worker.use_device(device)
        # cudaHostRegister acts in the current device's context (a thread with none set would create one on GPU 0).
        # Decided once, before any device buffer exists (acc is allocated by init/load after this); the pre-flight
        # refuses (HostMemoryError) before anything is decided or allocated when the host cannot hold the slab.
        self.accumulate, self.accumulate_reason = preflight(self, params, place_sums, placement)
        if self.accumulate == "host" and self._sums is None:
            self._sums = HostSums(device, capture=self.config.grads_in_backward)
        cfg = self.config
        # The layout the pre-flight counted (placement.layout_of): one window sum where overlap_steps is 1 without a
        # plan ("auto" on CPU tensors), two where "auto" waits for one.
        layout = layout_of(cfg, device.type)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return allocate(params, state, grad_dtype=grad_dtype, overlap=cfg.overlap, host_sums=self.host_sums,
                            sums=layout["sums"], capture=layout["capture"], state_dtype=cfg.state_dtype,
                            snapshot=layout["snapshot"])

    @property
    def host_sums(self) -> bool:
        """accumulate="host": each step's gradient goes to the host (:meth:`land`), there is no device ``acc``."""
        return self.accumulate == "host"

    def step_sum(self, st: dict[str, Any]) -> tuple[torch.Tensor | None, bool]:
        """What the fused step writes a parameter's unselected columns into, ``(acc, accumulate)``: on the device
        path ``state["acc"]``, added into after a window's first step; with accumulate="host" nothing (``acc=None``:
        the kernel neither reads nor writes a sum, which is the host's, :meth:`land`)."""
        if self._sums is not None:
            return None, False
        return st["acc"], st["acc_count"] > 0

    def land(self, landed: Sequence[tuple[torch.Tensor, torch.Tensor, bool]], state: State, *,
             cpu_threads: int) -> None:
        """accumulate="host", after this step's fused kernels: each ``(p, grad, accumulate)``'s gradient to the host
        and its add into the window sum (:meth:`.HostSums.land`; a wait for a chunk of the landing ring counts as
        stall). With one window sum a window's first add waits for the job in flight, which reads that sum."""
        try:
            self._sums.land(landed, self.records, state, self.stats, cpu_threads=cpu_threads,
                            wait=lambda job, worker: self._wait_job(job, worker, stall=True), copy_stream=self._d2h,
                            test_delays=self.test_delays, after=self._job)
        except WorkerError as exc:
            self.failure = exc
            raise

    def capture_slot(self, p: torch.Tensor) -> torch.Tensor:
        """grads_in_backward: ``p``'s capture slot, once the last step's add no longer reads it (a wait counted as
        stall); a gradient captured in backward lands there directly."""
        try:
            return self._sums.capture_slot(self.records[p], lambda job, worker: self._wait_job(job, worker, stall=True))
        except WorkerError as exc:
            self.failure = exc
            raise

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        """CUDA: the device-to-host stream (window sums, per-step gradients, captured gradients)."""
        return self._d2h(device)

    def release_gradients(self) -> None:
        """Before gradients are changed in place (``zero_grad(set_to_none=False)``): see
        :meth:`.HostSums.release_gradients`."""
        if self._sums is not None:
            self._sums.release_gradients(self._device)

    def _d2h(self, device: torch.device) -> torch.cuda.Stream:
        if self._d2h_stream is None:
            self._d2h_stream = torch.cuda.Stream(device=device)
        return self._d2h_stream

    def _h2d(self, device: torch.device) -> torch.cuda.Stream:
        if self._h2d_stream is None:
            self._h2d_stream = torch.cuda.Stream(device=device)
        return self._h2d_stream

    def _merges_read(self, device: torch.device) -> tuple[torch.cuda.Event, ...]:
        """An event after every merge copy queued since the last host job (none when none was): the next job writes
        the host arrays those copies read."""
        if not self._h2d_queued:
            return ()
        self._h2d_queued = False
        event = torch.cuda.Event(blocking=True)
        event.record(self._h2d(device))
        return (event,)

    def _wait_adds(self) -> None:
        """accumulate="host": wait for every add submitted so far (stall)."""
        if self._sums is not None:
            self._sums.wait_all(lambda job, worker: self._wait_job(job, worker, stall=True))

    def _wait_job(self, job: Future, worker: HostWorker, *, stall: bool) -> None:
        start = time.perf_counter()
        try:
            self._wait_for(job, worker)
        finally:
            if stall:
                self.stats.stall_s += time.perf_counter() - start

    # ------------------------------------------------------------------ the schedule's calls

    def rehome(self, state: State) -> None:
        """Undo what state movers did (:func:`.state.rehome`)."""
        rehome(self.records, state)

    def begin_step(self, p: torch.Tensor, st: dict[str, Any]) -> None:
        """Before ``p`` steps: make its buffers safe to use for this step."""
        rec = self.records[p]
        if rec.d2h_done is not None and st["acc_count"] == 0:
            # This step overwrites acc, which the copy stream may still be reading for the host job.
            torch.cuda.current_stream(p.device).wait_event(rec.d2h_done)
            rec.d2h_done = None

    def takes_gradient(self, p: torch.Tensor, st: dict[str, Any], *, waited: bool) -> bool:
        """Whether a window of this step alone, with nothing selected, can hand ``p.grad`` itself to the host job:
        on CPU tensors, when ``step()`` waits for the window anyway (``waited``), the host kernel reads the
        gradient where it is and writes the parameter, which skips the device pass (acc = g) and the landing copy:
        7 streams instead of 13. With a bf16 landing buffer only bf16 gradients qualify (others would skip the
        rounding a GPU run applies, and CPU and GPU runs of one configuration would part ways)."""
        rec = self.records[p]
        lands_exactly = self.config.grad_dtype == "float32" or p.dtype == torch.bfloat16
        return (p.device.type == "cpu" and waited and st["acc_count"] == 0 and rec.masks.num_unselected == rec.cols
                and lands_exactly)

    def end_windows(self, windows: Sequence[Window], state: State, *, sync: bool, cpu_threads: int,
                    lr_scale: float = 1.0) -> None:
        """DESIGN §5: wait for the previous job and apply it, ship this window's sums, submit the next job (and,
        with ``sync``, wait for it and apply it too). The host steps with each window's lr times ``lr_scale``
        (``host_lr_scale`` after warm-up, DESIGN §3)."""
        device = windows[0].param.device
        ship = device.type == "cuda" and not self.host_sums
        # The sums' copies need this step's fused kernels (they wrote acc), not the merges queued next: marked here,
        # so that window w's sums cross PCIe while window w-1's results come back, not after them.
        acc_written = torch.cuda.current_stream(device).record_event() if ship else None
        self.wait(state, merge=True)
        ready = self._ship_sums(windows, state, acc_written) if acc_written is not None else None
        if lr_scale != 1.0:  # 1.0 passes the group's lr through untouched (an int lr stays an int, as in torch)
            windows = [dataclasses.replace(w, hp=dataclasses.replace(w.hp, lr=w.hp.lr * lr_scale)) for w in windows]
        items = [self._host_item(w, state[w.param], ready) for w in windows]
        events = ((ready,) if ready is not None else ()) + (self._merges_read(device) if device.type == "cuda" else ())
        self.stats.windows += 1
        # A synchronous window is waited for anyway, so its job may use every core unless the user chose a count.
        threads = cpu_threads
        if sync and self.config.cpu_threads is None:
            threads = max(threads, host_thread_share())
        try:
            last_add = self._sums.last if self._sums is not None else None
            if last_add is not None:
                future = self.worker.submit(run_host_job_after, last_add, items, events, threads)
            else:
                future = self.worker.submit(run_host_job, items, events, threads)
        except WorkerError as exc:
            self.failure = exc
            raise
        self._job = future
        if sync:
            self.wait(state, merge=True)

    def open_windows(self, state: State, hp_of: Any, *, skip: Any = ()) -> list[Window]:
        """Windows that hold gradients and are not in ``skip``, to end now (at the schedule's window end for a
        parameter without a gradient this step, or early at ``flush()``), each with its parameter's hyperparameters
        now (``hp_of(p)``). A window with no unselected column (or no local row) has nothing for the host: it is
        just emptied."""
        windows = []
        for p, rec in self.records.items():
            st = state[p]
            if p in skip or st["acc_count"] == 0:
                continue
            if rec.rows and rec.masks.num_unselected:
                windows.append(Window(p, hp_of(p)))
            else:
                st["acc_count"] = 0
        return windows

    def _ship_sums(self, windows: Sequence[Window], state: State, acc_written: torch.cuda.Event) -> torch.cuda.Event:
        """Start the device-to-host copies of the windows' sums on the copy stream once the compute stream is past
        ``acc_written`` (this step's fused kernels); the event returned marks their end."""
        device = windows[0].param.device
        copy = self._d2h(device)
        rounds = self.config.grad_dtype == "bfloat16"
        copy.wait_event(acc_written)
        with torch.cuda.stream(copy):
            if self.test_delays.get("d2h"):
                torch.cuda._sleep(self.test_delays["d2h"])
            for w in windows:
                acc = state[w.param]["acc"]
                landing = self.records[w.param].landing
                if rounds:
                    # Rounded to bf16 on this stream, into one buffer that every parameter reuses: stream order puts
                    # each rounding after the copy out of the buffer before it, so no event is needed, and one
                    # parameter's bf16 sum exists at a time (acc.to(bfloat16) for all of them at once peaked at
                    # 2 bytes per offloaded parameter). Rounding reads HBM at ~100x the PCIe rate it feeds, so
                    # serializing the two costs ~1%. Allocated on this stream, the only one that uses it.
                    numel = acc.numel()
                    if self._bf16_landing is None or self._bf16_landing.numel() < numel:
                        self._bf16_landing = None  # freed first: the allocator may reuse it, in this stream's order
                        self._bf16_landing = torch.empty(numel, dtype=torch.bfloat16, device=device)
                    src = self._bf16_landing[:numel].view(acc.shape)
                    src.copy_(acc)  # the same rounding as acc.to(torch.bfloat16): to nearest even
                else:
                    src = acc
                landing.copy_(src, non_blocking=True)
                # acc is read on this stream: if it is freed (close, load_state_dict), the allocator must not hand
                # its memory out again before this stream is past the read.
                acc.record_stream(copy)
            # blocking=True: the host job waits on it with the thread asleep instead of spinning a core that the
            # host AdamW running next to it needs.
            ready = torch.cuda.Event(blocking=True)
            ready.record(copy)
        return ready

    def _host_item(self, w: Window, st: dict[str, Any], ready: torch.cuda.Event | None) -> HostItem:
        p, rec = w.param, self.records[w.param]
        snapshot = rec.snapshot
        if w.grad is not None:
            grad, count = w.grad, 1
            # The kernel writes the parameter: through the master itself, or as the snapshot it rounds into.
            snapshot = None if rec.master_is_param else local(p).detach().view(rec.rows, rec.cols)
        elif rec.sums is not None:
            # accumulate="host": the window's sum is already on the host (the job waits for the adder); nothing
            # ships, and the next window sums into the other buffer.
            grad, count = st["acc"], st["acc_count"]
            rec.flip_sum(st)
        elif ready is not None:
            grad, count = rec.landing, st["acc_count"]
            rec.d2h_done = ready
        elif rec.landing.dtype == st["acc"].dtype:
            # CPU tensors: acc and the landing buffer are both host memory, so they trade places instead of
            # copying (12 bytes per parameter and window saved); the next window overwrites the other one.
            st["acc"], rec.landing = rec.landing, st["acc"]
            grad, count = rec.landing, st["acc_count"]
        else:
            rec.landing.copy_(st["acc"])
            grad, count = rec.landing, st["acc_count"]
        if rec.sums is None:  # accumulate="host" counts its copies per step (land)
            self.stats.d2h_bytes += grad.numel() * grad.element_size()
        st["acc_count"] = 0
        # A result written straight into the parameter needs no merge.
        st["pending"] = not (w.grad is not None or rec.master_is_param)
        return HostItem(master=st["host_master"], exp_avg=st["host_exp_avg"], exp_avg_sq=st["host_exp_avg_sq"],
                        grad=grad, slot=rec.masks.host_slot, unselected=rec.masks.unselected,
                        col_step=st["host_col_step"], snapshot=snapshot, count=count, hp=w.hp,
                        cancelled=self.worker.cancelled)

    def wait(self, state: State, *, merge: bool) -> None:
        """Wait for the job in flight (time counted as stall); with ``merge``, write every pending host result into
        its parameter's unselected columns."""
        job = self._job
        if job is not None:
            start = time.perf_counter()
            try:
                seconds = self._wait_for(job, self.worker)
            finally:
                waited = time.perf_counter() - start
                if self._job_compiles:
                    self.stats.compile_s += waited
                else:
                    self.stats.stall_s += waited
            self._job = None
            if self._job_compiles:
                self._job_compiles = False
                if seconds > _COMPILE_NOTICE_S:
                    logger.warning("zenflow_triton: compiled the numba host kernels in %.1f s (first use on this "
                                   "machine; later runs load them from numba's cache)", seconds)
            else:
                self.stats.host_job_s += seconds
        if not merge:
            # A checkpoint's wait (state_dict, load_state_dict): with accumulate="host" the window sum it saves or
            # replaces must be complete.
            self._wait_adds()
        if merge:
            with torch.no_grad():
                for p, rec in self.records.items():
                    st = state[p]
                    if st.get("pending"):
                        self._merge(p, st, rec)

    def _wait_for(self, job: Future, worker: HostWorker) -> float:
        """The job's result. A failure of the job or the worker stops the optimizer; a KeyboardInterrupt or
        SystemExit in this (the waiting) thread is held (see :meth:`deferred_interrupts`) while the wait goes on,
        and a second one propagates with the job still in flight, so a later call waits for it again."""
        while True:
            try:
                return worker.wait(job, self.config.worker_timeout)
            except WorkerError as exc:
                self.failure, self._job = exc, None
                if worker.cancelled.is_set():
                    self._detach_own_masters()
                raise
            except BaseException as exc:
                if job.done() and job.exception() is exc:
                    self.failure, self._job = exc, None
                    raise RuntimeError("the host worker failed during a window") from exc
                if not isinstance(exc, (KeyboardInterrupt, SystemExit)) or self.interrupt is not None:
                    raise
                self.interrupt = exc

    def _detach_own_masters(self) -> None:
        """After a job overran worker_timeout: each parameter that is its own host master (fp32 on CPU tensors
        without overlap) gets storage of its own, holding what the job had written by then, so the item the hung job
        may still be writing lands in memory nothing reads, not in a model the user restores from a checkpoint."""
        with torch.no_grad():
            for p, rec in self.records.items():
                if rec.master_is_param:
                    p.data = p.data.clone()

    def _merge(self, p: torch.Tensor, st: dict[str, Any], rec: OffloadedParam) -> None:
        source = rec.snapshot if rec.snapshot is not None else st["host_master"]
        w2 = local(p).view(rec.rows, rec.cols)
        ops = self.device_ops(p.device)
        if p.device.type == "cuda":
            numel = source.numel()
            compute = torch.cuda.current_stream(p.device)
            copy = self._h2d(p.device)
            # The host-to-device copy runs on its own stream, so the compute stream is not blocked by it (the kernels
            # queued before the merge keep running while it crosses PCIe); the compute stream waits for it only just
            # before the merge kernel. Buffers rotate through a ring of two (MergeStaging).
            entry = self._staging.take(source.dtype, p.device, numel, compute)
            buffer, filled, free = entry
            view = buffer[:numel].view(rec.rows, rec.cols)
            with torch.cuda.stream(copy):
                # The merge kernel that read this buffer last (compute stream) must be done before it is overwritten.
                copy.wait_event(free)
                if self.test_delays.get("h2d"):
                    torch.cuda._sleep(self.test_delays["h2d"])
                view.copy_(source, non_blocking=True)
                filled.record(copy)
            self._h2d_queued = True
            # The merge reads the buffer only once the copy has landed. The host source stays intact until then: the
            # next host job first waits for an event recorded after this copy on this stream (_merges_read), and a
            # selection step's migration first synchronizes the compute stream, which waits here.
            compute.wait_event(filled)
            if self.test_delays.get("merge"):
                torch.cuda._sleep(self.test_delays["merge"])
            ops.merge_(w2, view, st["slot"])
            free.record(compute)
            self._staging.put(source.dtype, entry)
        else:
            ops.merge_(w2, source, st["slot"])
        self.stats.h2d_bytes += source.numel() * source.element_size()
        st["pending"] = False
