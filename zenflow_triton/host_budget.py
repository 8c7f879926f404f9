"""Host memory before it is taken (DESIGN §4): the bytes a configuration will hold on the host, what this machine
can give, and the pre-flight that compares them before any host allocation.

- :func:`host_need`: the exact bytes of the slab :func:`.state.allocate` will map for these parameters, from the one
  formula of the layout (:func:`zenflow_triton.autotune.placement.host_views`), with its per-parameter breakdown.
- :func:`host_room`: the tightest of ``/proc/meminfo``'s ``MemAvailable``, the cgroup memory limit less its usage
  (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, up the hierarchy), and ``RLIMIT_AS`` less the address space in
  use. ``RLIMIT_MEMLOCK`` bounds pinned memory, which only a CUDA run takes; a pin that fails leaves the slab in
  pageable memory (host_memory.py), so that bound warns instead of refusing.
- :func:`preflight`: called by the pipeline before each allocation (the first step, a parameter's first step,
  ``load_state_dict``). It raises :class:`HostMemoryError` when the need exceeds the room: nothing allocated, nothing
  decided, and a retry after fixing works. An allocation that fails anyway (``mmap``) raises the same error
  (:func:`allocation_failed`), never a bare ``OSError``.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

try:
    import resource
except ImportError:  # not POSIX (Windows): no rlimits to read
    resource = None

from .autotune.placement import HOST_COLUMN_BYTES, host_views, layout_of, ring_bytes
from .sharding import local_matrix_shape

__all__ = ["HostMemoryError", "HostNeed", "HostRoom", "allocation_failed", "host_need", "host_room", "preflight",
           "report"]

logger = logging.getLogger("zenflow_triton")

_ALIGN = 64  # host_memory.ALIGN_BYTES: every view of a slab starts on a multiple of it
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
_CGROUP = "/sys/fs/cgroup"


def _gib(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# ------------------------------------------------------------------------------------------------ the need


@dataclass(frozen=True)
class HostNeed:
    """The host slab a configuration maps: ``total`` bytes (what ``stats()["host_bytes"]`` will say), whether it is
    pinned (CUDA), the offloaded elements, and the mean bytes per element by buffer (``per_element``); the rest of
    ``total`` is the per-column step counts and the 64-byte padding of each view."""

    total: int
    pinned: bool
    numel: int
    accumulate: str
    per_element: dict[str, float] = field(default_factory=dict)

    def breakdown(self) -> str:
        parts = " + ".join(f"{name} {b:g}" for name, b in self.per_element.items())
        return f"{parts} = {sum(self.per_element.values()):g} B per parameter"


def host_need(params: Sequence[torch.Tensor], config: Any, accumulate: str) -> HostNeed:
    """The host bytes :func:`.state.allocate` maps for ``params`` (this process's rows of a sharded parameter) under
    ``config`` (a :class:`~zenflow_triton.config.ZenFlowConfig`, or anything with its fields) in mode ``accumulate``,
    to the byte."""
    total = numel = 0
    per: dict[str, float] = {}
    for p in params:
        rows, cols = local_matrix_shape(p)
        own_master = p.device.type == "cpu" and p.dtype == torch.float32 and not getattr(config, "overlap", True)
        views = host_views(accumulate=accumulate, param_bytes=p.element_size(), own_master=own_master,
                           **layout_of(config, p.device.type))
        n = rows * cols
        for name, each in views.items():
            total += sum(_round_up(n * b) for b in each)
            per[name] = per.get(name, 0) + n * sum(each)
        total += _round_up(cols * HOST_COLUMN_BYTES)
        numel += n
    pinned = any(p.device.type == "cuda" for p in params)
    return HostNeed(total, pinned, numel, accumulate, {k: v / numel for k, v in per.items()} if numel else {})


# ------------------------------------------------------------------------------------------------ the room


@dataclass(frozen=True)
class HostRoom:
    """What the machine can give now: ``bytes`` (None: nothing could be read) under ``bound``, the tightest of
    ``bounds`` (every figure read, by name); ``pinned_bytes`` the locked-memory limit left (None: unlimited)."""

    bytes: int | None
    bound: str
    bounds: dict[str, int]
    pinned_bytes: int | None = None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _fields(text: str | None) -> dict[str, int]:
    """``key value`` lines (/proc/meminfo, memory.stat, /proc/self/status) as ints, "kB" values in bytes."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1)
    return out


def _mem_available() -> int | None:
    return _fields(_read("/proc/meminfo")).get("MemAvailable")


def _cgroup_rooms() -> dict[str, int]:
    """Each cgroup memory limit of this process less its usage (reclaimable page cache not counted as used), from
    its own cgroup up to the root, v2 and v1."""
    rooms: dict[str, int] = {}
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        base = _CGROUP if v2 else f"{_CGROUP}/memory"
        limit_file, usage_file = ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes",
                                                                               "memory.usage_in_bytes")
        parts = [x for x in path.strip().split("/") if x]
        # In a cgroup namespace (a container) /proc/self/cgroup may name a path the mount does not show: the mount's
        # root is then this process's cgroup, so the levels that exist are read.
        for depth in range(len(parts), -1, -1):
            folder = "/".join([base, *parts[:depth]])
            limit = (_read(f"{folder}/{limit_file}") or "").strip()
            if not limit.isdigit() or int(limit) >= _UNLIMITED:
                continue
            usage = int((_read(f"{folder}/{usage_file}") or "0").strip() or 0)
            cache = _fields(_read(f"{folder}/memory.stat")).get("inactive_file" if v2 else "total_inactive_file", 0)
            name = f"cgroup {'v2 memory.max' if v2 else 'v1 memory.limit_in_bytes'} of {folder}"
            rooms[name] = max(0, int(limit) - max(0, usage - cache))
    return rooms


def _rlimit(kind: int | None) -> int | None:
    if kind is None:
        return None
    soft, _hard = resource.getrlimit(kind)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _status(key: str) -> int:
    return _fields(_read("/proc/self/status")).get(key, 0)


def host_room(*, pinned: bool = False) -> HostRoom:
    """What this machine can give the optimizer's host state now (see the module's docstring)."""
    bounds: dict[str, int] = {}
    available = _mem_available()
    if available is not None:
        bounds["MemAvailable"] = available
    bounds.update(_cgroup_rooms())
    limit = _rlimit(getattr(resource, "RLIMIT_AS", None))
    if limit is not None:
        bounds["RLIMIT_AS (ulimit -v)"] = max(0, limit - _status("VmSize"))
    pinned_left = None
    if pinned:
        lock = _rlimit(getattr(resource, "RLIMIT_MEMLOCK", None))
        pinned_left = None if lock is None else max(0, lock - _status("VmLck"))
    if not bounds:
        return HostRoom(None, "unknown (no /proc/meminfo, cgroup or rlimit figure)", bounds, pinned_left)
    bound = min(bounds, key=bounds.__getitem__)
    return HostRoom(bounds[bound], bound, bounds, pinned_left)


# ------------------------------------------------------------------------------------------------ the check


class HostMemoryError(RuntimeError):
    """The optimizer's host state does not fit this machine: ``needed`` bytes, ``available`` bytes under ``bound``.
    Raised before anything is allocated (or when an allocation fails anyway); fix and call again."""

    def __init__(self, message: str, *, needed: int, available: int | None, bound: str) -> None:
        super().__init__(message)
        self.needed, self.available, self.bound = needed, available, bound


def _cuts(params: Sequence[torch.Tensor], config: Any, need: HostNeed) -> list[str]:
    """The knobs that would shrink ``need``, each with the bytes it would take instead."""
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    fields.setdefault("state_dtype", "float32")
    changes: list[tuple[str, dict[str, Any], str]] = []
    if need.accumulate == "host":
        extra = ", grads_in_backward=False" if fields.get("grads_in_backward") else ""
        changes.append((f'accumulate="device"{extra}', {}, "device"))
    if fields.get("grad_dtype") != "bfloat16":
        changes.append(('grad_dtype="bfloat16"', {"grad_dtype": "bfloat16"}, need.accumulate))
    if fields.get("state_dtype") != "bfloat16" and "state_dtype" in _config_fields():
        changes.append(('state_dtype="bfloat16"', {"state_dtype": "bfloat16"}, need.accumulate))
    if fields.get("overlap", True) and fields.get("overlap_steps") != 1:
        changes.append(("overlap_steps=1", {"overlap_steps": 1}, need.accumulate))
    if fields.get("host_snapshot", True):  # offered where it cuts: a bf16/fp16 model's (the totals are compared)
        changes.append(("host_snapshot=False", {"host_snapshot": False}, need.accumulate))
    out = []
    for label, change, mode in changes:
        other = host_need(params, SimpleNamespace(**{**fields, **change}), mode)
        if other.total < need.total:
            out.append(f"{label}: {_gib(other.total)} ({sum(other.per_element.values()):g} B/param)")
    return out


def _config_fields() -> set[str]:
    import dataclasses

    from .config import ZenFlowConfig

    return {f.name for f in dataclasses.fields(ZenFlowConfig)}


def _ring_need(pipeline: Any, params: Sequence[torch.Tensor], mode: str) -> int:
    """accumulate="host" without grads_in_backward: the landing ring's bytes once ``params`` land beside the
    parameters already offloaded (:func:`.placement.ring_bytes`; 0 where the ring made already is large enough)."""
    if mode != "host" or getattr(pipeline.config, "grads_in_backward", False) or not params:
        return 0
    bf16 = getattr(pipeline.config, "grad_dtype", "float32") == "bfloat16"
    sizes = [rec.rows * rec.cols * rec.slot_dtype.itemsize for rec in pipeline.records.values()]
    sizes += [math.prod(local_matrix_shape(p)) * (2 if bf16 else p.element_size()) for p in params]
    want = ring_bytes(sum(sizes), max(sizes))
    sums = getattr(pipeline, "_sums", None)
    have = sums.ring.nbytes if sums is not None and sums.ring is not None else 0
    return 0 if have >= want else want


def _message(need: HostNeed, room: HostRoom, cuts: Sequence[str], what: str, ring: int = 0) -> str:
    count = f"{need.numel / 1e9:.3g} B" if need.numel >= 10**7 else f"{need.numel}"
    others = "; ".join(f"{k} {_gib(v)}" for k, v in room.bounds.items() if k != room.bound)
    total = need.total + ring
    text = (f"zenflow_triton: {what}: the optimizer's host state needs {_gib(total)} ({total} bytes) for "
            f"{count} offloaded parameters with accumulate={need.accumulate!r}: {need.breakdown()}, plus step "
            "counts and padding" + (f" and the landing ring ({_gib(ring)})" if ring else "") + "; "
            f"available {_gib(room.bytes or 0)} ({room.bytes} bytes, {room.bound}"
            + (f"; also {others}" if others else "") + "). Nothing was allocated.")
    if cuts:
        text += " Knobs that cut it: " + "; ".join(cuts) + "."
    return text + (" Or offload fewer parameters per process (min_offload_numel, FSDP2 sharding), or free host "
                   "memory; then call again.")


# The pre-flight's last figures per pipeline (for stats()), and this thread's need of the allocation about to be
# made (so that an mmap failing anyway names the same figures).
_checks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_pending = threading.local()
_warned_memlock = False


def preflight(pipeline: Any, params: Sequence[torch.Tensor], place: Callable[..., tuple[str, str]],
              placement: str | None = None) -> tuple[str, str]:
    """Decide where the window sums live (once: ``place``, :func:`.auto.place_sums`, which weighs host memory too,
    called with ``params``, the config and ``placement``), compute
    the host bytes of ``params``' slab and compare them with :func:`host_room`; return ``(accumulate, reason)``
    for the pipeline to keep. Raises :class:`HostMemoryError` before anything is decided or allocated."""
    global _warned_memlock
    if pipeline.accumulate is not None:
        mode, why = pipeline.accumulate, pipeline.accumulate_reason
    else:
        mode, why = place(params, pipeline.config, placement)
    need = host_need(params, pipeline.config, mode)
    room = host_room(pinned=need.pinned)
    _checks[pipeline] = (need, room)
    _pending.need = (need, room, _cuts(params, pipeline.config, need))
    ring = _ring_need(pipeline, params, mode)
    if room.bytes is not None and need.total + ring > room.bytes:
        raise HostMemoryError(_message(need, room, _pending.need[2], "refused before allocating", ring),
                              needed=need.total + ring, available=room.bytes, bound=room.bound)
    if room.pinned_bytes is not None and need.total > room.pinned_bytes and not _warned_memlock:
        _warned_memlock = True
        logger.warning("zenflow_triton: the optimizer's pinned host state (%s) exceeds the locked-memory limit left "
                       "(RLIMIT_MEMLOCK, %s): if pinning fails the buffers stay pageable and copies are slower; "
                       "raise `ulimit -l` (in a container --ulimit memlock=-1)", _gib(need.total),
                       _gib(room.pinned_bytes))
    return mode, why


def allocation_failed(nbytes: int, exc: OSError) -> HostMemoryError:
    """The error for a host allocation of ``nbytes`` that failed (``mmap``'s ``OSError``): the pre-flight's figures
    when they are this allocation's, else this machine's room now."""
    pending = getattr(_pending, "need", None)
    why = f"mapping {_gib(nbytes)} failed ({exc.strerror or exc})"
    if pending is not None and pending[0].total == nbytes:
        need, room, cuts = pending
        return HostMemoryError(_message(need, room, cuts, why), needed=nbytes, available=room.bytes, bound=room.bound)
    room = host_room()
    return HostMemoryError(f"zenflow_triton: {why}; available {_gib(room.bytes or 0)} ({room.bound}). Nothing was "
                           "allocated; free host memory or shrink the optimizer's host state (docs/memory.md)",
                           needed=nbytes, available=room.bytes, bound=room.bound)


def report(pipeline: Any) -> Mapping[str, Any]:
    """``stats()``'s entries of the last pre-flight: the host bytes it found available and the bound that set them
    (None before the first allocation)."""
    need_room = _checks.get(pipeline)
    if need_room is None:
        return {"host_available_bytes": None, "host_available_bound": None}
    return {"host_available_bytes": need_room[1].bytes, "host_available_bound": need_room[1].bound}

