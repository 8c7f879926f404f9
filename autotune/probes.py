"""Hardware probes: measure this machine once, so the cost model can plan without touching hardware again.

What is measured (DESIGN §8):

- pinned host-to-device and device-to-host bandwidth over a range of sizes, through the optimizer's own
  :class:`~zenflow_triton.host_memory.HostSlab` and a side copy stream;
- the host AdamW kernel's throughput at each thread count, fp32 and bf16 gradient landing, on buffers
  larger than the last-level cache;
- the host add of ``accumulate="host"`` (``kernels.host_accumulate``: ``sum += g``) at each thread count, fp32 and
  bf16 landing, over a few sizes up to beyond the last-level cache;
- device memory bandwidth, free memory and name (the CPU model, core count and last-level cache, which the
  system states without timing, come from :mod:`.machine`);
- host ``memcpy`` bandwidth and the torch backend's device-side ops on CPU tensors: on a machine without a
  GPU these stand in for PCIe and the Triton kernels (labelled as such; GPU figures are never invented).

Every figure is the best of several timed repeats (other processes only ever slow a run down), and its *spread*,
the median repeat's time over the best's minus one, goes into the profile (``Profile.spread``) so a reader can
tell a calm measurement from one taken on a busy machine. The host probes interleave their repeats (one pass over
every size or thread count, then the next), so the repeats of one figure lie seconds apart, not microseconds: a
burst of load then shows as spread instead of deciding one figure alone.

Nothing here runs at import: numba (compiling) and CUDA are touched only inside the probe functions.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .host_probes import measure_host_adamw, measure_host_add, probe_hyperparams
from .machine import host_description, machine_key
from .profile import BandwidthCurve, DeviceOpRates, GpuInfo, Profile
from .timing import MiB, Progress, best_seconds, fmt_bytes, interleaved, say, spread_of

__all__ = [
    "ProbeSettings",
    "probe_machine",
    "measure_memcpy",
    "measure_pcie",
    "measure_host_adamw",
    "measure_host_add",
    "measure_cpu_device_ops",
    "measure_gpu_memory",
]

# Bytes the AdamW probe streams per element: fp32 master, m, v read and written, fp32 grad read, bf16
# snapshot written. Buffers are sized from it to be several times the last-level cache, so the rate is the
# memory-bound one the optimizer sees on real models, not a cache-resident one.
_ADAMW_BYTES_PER_ELEM = 3 * 4 * 2 + 4 + 2


@dataclass(frozen=True)
class ProbeSettings:
    """How much to measure. ``quick()`` takes a few seconds; ``full()`` some tens of seconds."""

    copy_sizes: tuple[int, ...]
    """Bytes per copy for the bandwidth curves (ascending)."""
    copy_repeats: int
    adamw_numel: int | None
    """Elements per AdamW call; None: several times the last-level cache."""
    adamw_repeats: int
    thread_counts: tuple[int, ...] | None
    """Host thread counts to time; None: every count from 1 to the cores available (quick: a spread)."""
    device_ops_numel: int | None
    """Elements of the CPU-tensor device-step probe; None: beyond the last-level cache like the AdamW probe."""
    gpu_bandwidth_bytes: int
    quick: bool
    add_numels: tuple[int, ...] | None = None
    """Elements per host add call (the sizes of its curve); None: 64K (one thread: below the kernel's parallel
    threshold), 1M, and beyond the last-level cache (16M and 4M too for the full probe)."""
    cpu_device_ops: bool = True
    """Measure the device step on CPU tensors. False (the optimizer's quick probe for CUDA parameters, whose plan
    never reads it) leaves ``Profile.cpu_device`` None and skips compiling the numba device ops (seconds, cold)."""

    @classmethod
    def quick_settings(cls) -> ProbeSettings:
        return cls(copy_sizes=(1 * MiB, 16 * MiB, 64 * MiB), copy_repeats=3, adamw_numel=None, adamw_repeats=3,
                   thread_counts=None, device_ops_numel=None, gpu_bandwidth_bytes=64 * MiB, quick=True)

    @classmethod
    def full_settings(cls) -> ProbeSettings:
        return cls(copy_sizes=(256 * 1024, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB), copy_repeats=5,
                   adamw_numel=None, adamw_repeats=5, thread_counts=None, device_ops_numel=None,
                   gpu_bandwidth_bytes=256 * MiB, quick=False)

    @property
    def add_repeats(self) -> int:
        """Rounds of the host add probe: one round takes tens of ms, so more repeats than AdamW's cost little."""
        return max(5, self.adamw_repeats)

    def describe(self) -> str:
        """What a run with these settings measures, in a line (the CLI prints it, so quick and full differ visibly)."""
        sizes = sorted(self.copy_sizes)
        span = fmt_bytes(sizes[0]) + (f"-{fmt_bytes(sizes[-1])}" if len(sizes) > 1 else "")
        threads = ("every thread count" if self.thread_counts is None and not self.quick else
                   "a spread of thread counts" if self.thread_counts is None else
                   f"{', '.join(map(str, self.thread_counts))} threads")
        numel = (f"{self.adamw_numel:,} params" if self.adamw_numel else
                 f"{'2' if self.quick else '4'}x the last-level cache")
        plural = "s" if len(sizes) > 1 else ""
        adds = len(self.add_numels) if self.add_numels is not None else 3 if self.quick else 5  # _add_numels
        return (f"{'quick' if self.quick else 'full'}: copies at {len(sizes)} size{plural} ({span}) x "
                f"{self.copy_repeats} repeats; host AdamW on {numel} at {threads} x {self.adamw_repeats} repeats; "
                f"host add at {adds} sizes x {self.add_repeats} repeats")

    def with_overrides(self, *, adamw_numel: int | None = None, max_copy_bytes: int | None = None) -> ProbeSettings:
        """Smaller runs (tests, small machines): cap the AdamW buffer and the largest copy."""
        s = self
        if adamw_numel is not None:
            dev = min(s.device_ops_numel or adamw_numel, adamw_numel)
            adds = tuple(sorted({min(n, adamw_numel) for n in s.add_numels or (1 << 16, adamw_numel)}))
            s = replace(s, adamw_numel=adamw_numel, device_ops_numel=dev, add_numels=adds)
        if max_copy_bytes is not None:
            sizes = tuple(n for n in s.copy_sizes if n <= max_copy_bytes) or (max_copy_bytes,)
            s = replace(s, copy_sizes=sizes, gpu_bandwidth_bytes=min(s.gpu_bandwidth_bytes, max_copy_bytes))
        return s


# ------------------------------------------------------------------------------------------- bandwidth


def measure_memcpy(sizes: Sequence[int], *, repeats: int = 3, progress: Progress | None = None,
                   spread: dict[str, float] | None = None) -> BandwidthCurve:
    """Host-to-host ``Tensor.copy_`` bandwidth: the copy a run on CPU tensors makes where a GPU run crosses PCIe.

    ``spread``, when given, receives each size's spread (``"memcpy 1 MiB"``: median time over best, minus one)."""
    from zenflow_triton.host_memory import HostSlab

    top = max(sizes)
    slab = HostSlab([((top,), torch.uint8), ((top,), torch.uint8)], pin=False)
    src, dst = slab.views
    src.fill_(1)
    dst.copy_(src)  # first touch: page faults belong to allocation, not to copying
    ordered = sorted(sizes)
    times = interleaved([lambda n=n: dst[:n].copy_(src[:n]) for n in ordered], repeats)
    points = []
    for n, ts in zip(ordered, times):
        t = min(ts)  # the best, as best_seconds
        points.append((int(n), n / t))
        if spread is not None:
            spread[f"memcpy {fmt_bytes(n)}"] = spread_of(ts)
        say(progress, f"memcpy {fmt_bytes(n)}: {n / t / 1e9:.2f} GB/s (spread {spread_of(ts):.0%} over "
                       f"{len(ts)} repeats)")
    return BandwidthCurve(kind="memcpy", points=tuple(points))


def measure_pcie(
    sizes: Sequence[int], *, device: torch.device, repeats: int = 3, progress: Progress | None = None,
    spread: dict[str, float] | None = None,
) -> tuple[BandwidthCurve, BandwidthCurve]:
    """Pinned H2D and D2H bandwidth through a :class:`HostSlab` and a side stream, as the optimizer copies."""
    from zenflow_triton.host_memory import HostSlab

    top = max(sizes)
    slab = HostSlab([((top,), torch.uint8)], pin=True, device=device)  # registered on the measured device
    host = slab.views[0]
    host.fill_(1)
    dev = torch.empty(top, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    curves = {}
    with torch.cuda.device(device):
        for name in ("h2d", "d2h"):
            curves[name] = _pcie_curve(name, sizes, host, dev, stream, repeats, progress, spread)
    return curves["h2d"], curves["d2h"]


def _pcie_curve(name: str, sizes: Sequence[int], host: torch.Tensor, dev: torch.Tensor, stream: torch.cuda.Stream,
                repeats: int, progress: Progress | None, spread: dict[str, float] | None = None) -> BandwidthCurve:
    points = []
    for n in sorted(sizes):
        src, dst = (host[:n], dev[:n]) if name == "h2d" else (dev[:n], host[:n])
        times = []
        for i in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                _queue_ahead()
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            # The event's timestamp is valid only once the copy has completed.
            end.synchronize()
            if i:  # the first copy pays for mapping and driver warm-up
                times.append(start.elapsed_time(end) / 1e3)
        t = min(times)  # best of the repeats, as best_seconds
        points.append((int(n), n / t))
        if spread is not None:
            spread[f"PCIe {name.upper()} {fmt_bytes(n)}"] = spread_of(times)
        say(progress, f"PCIe {name.upper()} pinned {fmt_bytes(n)}: {n / t / 1e9:.2f} GB/s (spread "
                       f"{spread_of(times):.0%} over {len(times)} repeats)")
    return BandwidthCurve(kind=f"pcie-{name}", points=tuple(points))


# Cycles of torch.cuda._sleep queued ahead of each timed copy (~0.5 ms at 2 GHz, far more than a launch takes): an
# event recorded on an idle stream is stamped at once, before the host has even launched the copy behind it, and
# those 5-10 us of host time would count as copy time (15-25% of a 64 MiB device copy at ~4 TB/s; 25-35% of a
# 1 MiB PCIe copy). With the stream busy, the event, the copy and the end event all wait their turn on the device.
_QUEUE_AHEAD_CYCLES = 1_000_000


def _queue_ahead() -> None:
    sleep = getattr(torch.cuda, "_sleep", None)  # private, but in every torch this project supports
    if sleep is not None:
        sleep(_QUEUE_AHEAD_CYCLES)


def measure_gpu_memory(
    device: torch.device, *, nbytes: int, repeats: int = 3, progress: Progress | None = None,
    spread: dict[str, float] | None = None,
) -> tuple[str, int, int, float]:
    """``(name, total_bytes, free_bytes, bandwidth)``; bandwidth counts bytes read plus written per second."""
    name = torch.cuda.get_device_name(device)
    free, total = torch.cuda.mem_get_info(device)
    times = []
    with torch.cuda.device(device):  # events and the current stream belong to the measured device
        a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        a.fill_(1)
        for i in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _queue_ahead()
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()  # elapsed_time needs the end event completed
            if i:
                times.append(start.elapsed_time(end) / 1e3)
    bw = 2 * nbytes / min(times)
    if spread is not None:
        spread["device copy"] = spread_of(times)
    say(progress, f"{name}: {bw / 1e9:.0f} GB/s device copy, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    return name, int(total), int(free), bw


# ------------------------------------------------------------------------------------- host probe sizes


def _thread_counts(cores: int, settings: ProbeSettings) -> list[int]:
    try:
        import numba

        cores = min(cores, numba.config.NUMBA_NUM_THREADS)  # numba cannot run more threads than its pool
    except ImportError:
        pass
    if settings.thread_counts is not None:
        return sorted({t for t in settings.thread_counts if 1 <= t <= cores}) or [1]
    if not settings.quick:
        return list(range(1, cores + 1))
    # A spread is enough to find where the memory-bound kernel stops scaling; the planner uses at most cores-1
    # (cores-2 on CUDA).
    counts = {1, cores, max(1, cores - 1), max(1, cores - 2)}
    counts.update(2**i for i in range(1, int(math.log2(cores)) + 1))
    return sorted(counts)


def _add_numels(settings: ProbeSettings, llc: int) -> list[int]:
    if settings.add_numels is not None:
        return sorted(set(settings.add_numels))
    # The largest: sum and fp32 gradient (8 bytes per element) at 2x (quick) or 4x the last-level cache, the
    # memory-bound rate of a large matrix; the smaller ones show what a matrix that stays in cache, or a call too
    # small to wake the thread pool, costs.
    floor, multiple = (4 << 20, 2) if settings.quick else (16 << 20, 4)
    big = max(floor, multiple * llc // 8)
    sizes = {1 << 16, 1 << 20, big} if settings.quick else {1 << 16, 1 << 18, 1 << 20, 1 << 22, big}
    return sorted(n for n in sizes if n <= big)


def measure_cpu_device_ops(*, numel: int, repeats: int = 3, progress: Progress | None = None,
                           spread: dict[str, float] | None = None) -> DeviceOpRates:
    """Rates of the device-side work on CPU tensors, with the ops the optimizer's default backend runs there
    (``load_device_ops("auto", cpu)``: numba; the torch backend if numba cannot load): the pass over every
    gradient element (with the window sum, and without it as accumulate="host" runs it), the extra cost per
    element of Adam on selected columns (timed with none and with all selected), and the merge of a host result
    into the unselected columns.

    Not the torch backend whatever the optimizer runs: on the 2-core CI VM the torch backend's Adam on selected
    columns measured 16-29 M elem/s, several times slower than the numba ops the optimizer uses there, and a plan
    from it priced every selected column far too high (it chose r = 0.02 for the demo's model).
    """
    from zenflow_triton.kernels.device_ops import load_device_ops

    try:
        reference = load_device_ops("auto", torch.device("cpu"))
    except ImportError:  # numba missing or broken: the optimizer would then need backend="torch" too
        reference = load_device_ops("torch", torch.device("cpu"))
    backend = reference.__name__.rsplit(".", 1)[-1]

    cols = 1024 if numel >= 1024 else numel
    rows = max(1, numel // cols)
    n = rows * cols
    param = torch.full((rows, cols), 0.5)
    grad = torch.full((rows, cols), 1e-3)
    acc = torch.zeros(rows, cols)
    score = torch.zeros(cols)
    col_step = torch.full((cols,), 10, dtype=torch.int32)
    unselected = torch.full((cols,), -1, dtype=torch.int32)
    hp = probe_hyperparams()

    def call(k: int, with_acc: bool = True) -> Callable[[], object]:
        slot = torch.arange(cols, dtype=torch.int32) if k else unselected
        state = [torch.zeros(rows, k) for _ in range(3)]
        return lambda: reference.fused_step_(
            param, grad, score=score, slot=slot, col_step=col_step, master=state[0], exp_avg=state[1],
            exp_avg_sq=state[2], acc=acc if with_acc else None, hp=hp, accumulate=with_acc)

    # The pass with the window sum and accumulate="host"'s without it (scores only; no acc read or written), in
    # interleaved rounds: their difference is small on CPU tensors (the numba pass on the 2-core VM: 7.99 against
    # 7.78 ms on a [2048, 1024] gradient, best of 15 interleaved), so timed one after the other, load decided it
    # (235 against 394 M elem/s at load 4.7).
    both = interleaved([call(0), call(0, with_acc=False)], repeats)
    for name, ts in zip(("device pass", "device pass without acc"), both):
        if spread is not None:
            spread[name] = spread_of(ts)
    t_pass, t_pass_no_acc = (min(ts) for ts in both)
    t_all = best_seconds(call(cols), repeats, spread=spread, name="device pass + Adam")
    # Noise can make the difference tiny or negative; never let it claim Adam is free.
    t_adam = max(t_all - t_pass, 0.05 * t_pass)
    t_merge = best_seconds(lambda: reference.merge_(param, acc, unselected), repeats, spread=spread,
                            name="device merge")
    threads = "" if backend != "reference" else f", {torch.get_num_threads()} torch threads"
    rates = DeviceOpRates(source=f"measured: {backend} on CPU tensors{threads}",
                          pass_rate=n / t_pass, adam_rate=n / t_adam, merge_rate=n / t_merge,
                          pass_no_acc_rate=n / t_pass_no_acc)
    say(progress, f"CPU-tensor device step ({backend}): pass {rates.pass_rate / 1e6:.0f} M elem/s "
                   f"({rates.pass_no_acc_rate / 1e6:.0f} without acc), "
                   f"Adam {rates.adam_rate / 1e6:.0f} M elem/s, merge {rates.merge_rate / 1e6:.0f} M elem/s")
    return rates


# -------------------------------------------------------------------------------------------------- all


def probe_machine(
    settings: ProbeSettings | None = None,
    *,
    device: torch.device | str | None = None,
    progress: Progress | None = None,
) -> Profile:
    """Measure this machine; ``settings`` defaults to the full probe.

    ``device``: the CUDA device to measure (default: the current one, if CUDA is available). Without CUDA
    the profile carries ``gpu=None`` and says why in ``gpu_unavailable``.
    """
    settings = settings or ProbeSettings.full_settings()
    durations: dict[str, float] = {}
    t_all = time.perf_counter()
    host = host_description()
    cores = int(host["cpu_cores"])  # type: ignore[call-overload]
    llc = int(host["llc_bytes"])  # type: ignore[call-overload]
    say(progress, f"host: {host['cpu_model']}, {cores} cores, last-level cache {fmt_bytes(llc)}")

    gpu: GpuInfo | None = None
    gpu_unavailable: str | None = None
    cuda_device: torch.device | None = None
    if not torch.cuda.is_available():
        gpu_unavailable = "CUDA is not available (torch.cuda.is_available() is False): no GPU or PCIe figures"
        say(progress, f"GPU: unavailable: {gpu_unavailable}")
    else:
        cuda_device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if cuda_device.type != "cuda":
            cuda_device = None
            gpu_unavailable = f"device {device} is not a CUDA device: no GPU or PCIe figures"

    spread: dict[str, float] = {}
    start = time.perf_counter()
    memcpy = measure_memcpy(settings.copy_sizes, repeats=settings.copy_repeats, progress=progress, spread=spread)
    durations["memcpy"] = time.perf_counter() - start

    if cuda_device is not None:
        # Device memory first: free memory is read before this probe's own buffers sit in torch's cache.
        start = time.perf_counter()
        name, total, free, bw = measure_gpu_memory(cuda_device, nbytes=settings.gpu_bandwidth_bytes,
                                                   repeats=settings.copy_repeats, progress=progress, spread=spread)
        durations["gpu_memory"] = time.perf_counter() - start
        start = time.perf_counter()
        h2d, d2h = measure_pcie(settings.copy_sizes, device=cuda_device, repeats=settings.copy_repeats,
                                progress=progress, spread=spread)
        durations["pcie"] = time.perf_counter() - start
        gpu = GpuInfo(name=name, total_bytes=total, free_bytes=free, mem_bandwidth=bw, h2d=h2d, d2h=d2h)

    # Working sets of 2x the LLC at the least (4x for the full probe).
    floor, multiple = (4 << 20, 2) if settings.quick else (16 << 20, 4)
    numel = settings.adamw_numel or max(floor, multiple * llc // _ADAMW_BYTES_PER_ELEM)
    start = time.perf_counter()
    cpu_adamw = measure_host_adamw(numel=numel, thread_counts=_thread_counts(cores, settings),
                                   repeats=settings.adamw_repeats, progress=progress, spread=spread,
                                   durations=durations)
    durations["host_adamw"] = time.perf_counter() - start

    start = time.perf_counter()
    add_repeats = settings.add_repeats
    host_add = measure_host_add(numels=_add_numels(settings, llc), thread_counts=_thread_counts(cores, settings),
                                repeats=add_repeats, progress=progress, spread=spread, durations=durations)
    durations["host_add"] = time.perf_counter() - start

    start = time.perf_counter()
    # Parameter, gradient and accumulator (12 bytes per element) at twice the cache: the torch ops are slow
    # enough (about 1 s per call at 4x on the 2-core CI VM) that a larger size buys nothing but time.
    dev_numel = settings.device_ops_numel or max(1 << 20, 2 * llc // 12)
    device_repeats = min(3, settings.adamw_repeats)
    cpu_device = None
    if settings.cpu_device_ops:
        cpu_device = measure_cpu_device_ops(numel=dev_numel, repeats=device_repeats, progress=progress,
                                            spread=spread)
        durations["cpu_device_ops"] = time.perf_counter() - start
    durations["total"] = time.perf_counter() - t_all
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on this system
        load = None

    import numpy

    from zenflow_triton import __version__

    versions = {"zenflow_triton": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
                "python": platform.python_version()}
    try:
        import numba

        versions["numba"] = numba.__version__
    except ImportError:
        pass
    return Profile(
        machine_key=machine_key(str(host["hostname"]), str(host["cpu_model"]), None if gpu is None else gpu.name),
        hostname=str(host["hostname"]),
        cpu_model=str(host["cpu_model"]),
        cpu_cores=cores,
        llc_bytes=llc,
        cpu_adamw=cpu_adamw,
        memcpy=memcpy,
        cpu_device=cpu_device,
        gpu=gpu,
        gpu_unavailable=gpu_unavailable,
        quick=settings.quick,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        versions=versions,
        durations=durations,
        spread=spread,
        repeats={"copy": settings.copy_repeats, "host_adamw": settings.adamw_repeats, "host_add": add_repeats,
                 **({"device_ops": device_repeats} if settings.cpu_device_ops else {})},
        load_average=load,
        host_add=host_add,
    )
