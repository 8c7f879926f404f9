"""Where ``accumulate="auto"`` keeps the window's gradient sum (DESIGN §4, §8): a pure rule, unit-tested with
synthetic numbers; :mod:`zenflow_triton.auto` gathers the figures and calls it before any device buffer exists.

The two placements cost the same compact selected state on the device (fp32 master and moments of the k selected
columns, ``12·r`` bytes per offloaded parameter); ``"device"`` adds the fp32 window sum (4 bytes per parameter) and
copies one sum per window to the host, ``"host"`` copies every step's gradient instead (``grad_bytes`` per
parameter per step) and adds it on the host. So: ``"device"`` whenever its state fits in the device memory left at
the step's peak with a margin (the fewer PCIe bytes win when memory allows), else ``"host"``; on CPU tensors always
``"device"`` (device and host memory are one: nothing to save).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["HOST_COLUMN_BYTES", "PLACEMENT_FRACTION", "RING_CHUNKS", "Placement", "host_bytes_per_element",
           "host_views", "layout_of", "place_accumulation", "planless_overlap_steps", "ring_bytes", "ring_chunk_bytes",
           "window_sums"]

# Share of the memory left at the step's peak that the optimizer's device state may take with accumulate="device":
# the rest absorbs allocator fragmentation and later growth (longer sequences, a larger evaluation batch). The same
# margin as the autotuner's memory budget (bridge.MEMORY_BUDGET_FRACTION).
PLACEMENT_FRACTION = 0.9


# The host slab's per-column entry of every offloaded parameter: ``host_col_step`` (int32 [C]).
HOST_COLUMN_BYTES = 4


# accumulate="host"'s landing ring (zenflow_triton.staging.LandingRing): four chunks, one being filled by the copy,
# one being added, two slack for the copy and the adder to run at different paces within a step. A chunk is at most
# 1/64 of one step's landed gradient bytes (the ring at most 1/16 of them), never below 256 KiB (each piece is one
# copy and one add call: smaller pieces would spend a large model's step on their overheads) unless the largest
# gradient is smaller, never above 16 MiB (the ring then costs 64 MiB at most, 0.01 B/param on a 7B model).
RING_CHUNKS = 4
RING_FRACTION = 64
RING_MIN_CHUNK_BYTES = 256 << 10
RING_MAX_CHUNK_BYTES = 16 << 20


def ring_chunk_bytes(total_bytes: int, largest_bytes: int, *, fraction: int = RING_FRACTION,
                     min_chunk: int = RING_MIN_CHUNK_BYTES, max_chunk: int = RING_MAX_CHUNK_BYTES) -> int:
    """The ring's chunk for a step that lands ``total_bytes`` of gradient, the largest parameter's being
    ``largest_bytes``: ``min(largest, max(total / 64, 256 KiB), 16 MiB)``, rounded up to 64 bytes (any dtype's
    view). The keywords exist for tests that shrink the ring."""
    share = max(-(-total_bytes // fraction), min_chunk)
    return -(-max(1, min(largest_bytes, share, max_chunk)) // 64) * 64


def ring_bytes(total_bytes: int, largest_bytes: int) -> int:
    """Host bytes of the landing ring for those gradients (:func:`ring_chunk_bytes` × :data:`RING_CHUNKS`)."""
    return RING_CHUNKS * ring_chunk_bytes(total_bytes, largest_bytes)


def planless_overlap_steps(config: Any, device_type: str | None) -> Any:
    """``overlap_steps`` as it is without a plan: the config's own value unless "auto"; "auto" is None without
    overlap, 1 when the other knobs are fixed and the offloaded tensors are on the CPU (``device_type`` "cpu", or
    None for none: no GPU to keep busy, and the quality measurements that chose it ran there), else still "auto"
    (the autotuner plans it). ``config``: a ZenFlowConfig or anything with its fields (absent ones: its defaults)."""
    k = getattr(config, "overlap_steps", "auto")
    if k != "auto":
        return k
    if not getattr(config, "overlap", True):
        return None
    knobs = (getattr(config, "topk_ratio", 0.1), getattr(config, "update_interval", 4),
             getattr(config, "host_lr_scale", 1.0))
    return 1 if "auto" not in knobs and device_type in (None, "cpu") else "auto"


def window_sums(overlap: bool, update_interval: Any, overlap_steps: Any) -> int:
    """fp32 window sums accumulate="host" keeps per parameter: one where the schedule waits for a window's job
    within the next window's first step (``overlap=False``; ``overlap_steps=1``; ``overlap_steps`` None with
    ``update_interval=1``): the next window's first add waits (in the adder, its gradient in staging) until that
    job has read the sum. Else two, alternating by window, so the job reads one while the next window sums into the
    other. "auto" values count as two (either count is exact; one only costs stall where the job runs longer)."""
    if not overlap or overlap_steps == 1 or (overlap_steps is None and update_interval == 1):
        return 1
    return 2


def host_views(*, accumulate: str, param_bytes: int, grad_dtype: str = "float32", state_dtype: str = "float32",
               own_master: bool = False, sums: int = 2, capture: bool = False,
               snapshot: bool = True) -> dict[str, list[int]]:
    """THE host layout of :func:`zenflow_triton.state.allocate`'s slab: per buffer, the bytes per offloaded element
    of each of its views. One place: the pre-flight, the autotuner and the capacity table read it; a change to the
    layout changes this function, and tests/test_host_budget.py checks it against ``stats()`` byte for byte.

    ``param_bytes``: the model dtype's element size; ``own_master``: an fp32 CPU parameter with ``overlap=False``
    (its own master, no host copy); ``state_dtype``: the moments' dtype. Per element, in the slab's order: fp32
    ``master``, ``exp_avg``, ``exp_avg_sq``; with "device" one ``landing`` buffer in ``grad_dtype``; with "host"
    ``sums`` fp32 ``window_sums`` (:func:`window_sums`) and, with ``capture`` (grads_in_backward), one
    ``capture_slot`` (bf16 with grad_dtype bfloat16, else the gradient's own dtype); a ``snapshot`` in the model
    dtype unless fp32 or ``snapshot`` is False (host_snapshot: the merge reads the master). Plus
    :data:`HOST_COLUMN_BYTES` per column, and each view padded to 64 bytes. Without ``capture``, "host" lands
    gradients in the pipeline's ring (:func:`ring_bytes`), not in the slab."""
    if accumulate not in ("device", "host"):
        raise ValueError(f"Invalid accumulate: {accumulate!r} (one of ('device', 'host'))")
    moment = 2 if state_dtype == "bfloat16" else 4
    views = {"master": [] if own_master else [4], "exp_avg": [moment], "exp_avg_sq": [moment]}
    if accumulate == "device":
        views["landing"] = [2 if grad_dtype == "bfloat16" else 4]
    else:
        views["window_sums"] = [4] * sums
        views["capture_slot"] = [2 if grad_dtype == "bfloat16" else param_bytes] if capture else []
    views["snapshot"] = [param_bytes] if snapshot and param_bytes != 4 else []
    return {k: v for k, v in views.items() if v}


def layout_of(config: Any, device_type: str | None = "cuda") -> dict[str, Any]:
    """:func:`host_views`' keywords for a :class:`~zenflow_triton.config.ZenFlowConfig` (or anything with its
    fields; absent ones take the config's defaults) on ``device_type``'s tensors: the window sums of the schedule
    without a plan (:func:`planless_overlap_steps`; a planned "auto" counts as two), the capture slot and the
    snapshot."""
    sums = window_sums(getattr(config, "overlap", True), getattr(config, "update_interval", 4),
                       planless_overlap_steps(config, device_type))
    return {"grad_dtype": getattr(config, "grad_dtype", "float32"),
            "state_dtype": getattr(config, "state_dtype", "float32"),
            "sums": sums, "capture": bool(getattr(config, "grads_in_backward", False)),
            "snapshot": bool(getattr(config, "host_snapshot", True))}


def host_bytes_per_element(config: Any, accumulate: str, param_bytes: int, *, own_master: bool = False,
                           device_type: str | None = "cuda") -> int:
    """Host bytes per offloaded element for a :class:`~zenflow_triton.config.ZenFlowConfig` (or anything with its
    fields) in mode ``accumulate`` on ``device_type``'s tensors (:func:`host_views` summed; the per-column step
    counts, padding and the landing ring aside)."""
    views = host_views(accumulate=accumulate, param_bytes=param_bytes, own_master=own_master,
                       **layout_of(config, device_type))
    return sum(sum(each) for each in views.values())


@dataclass(frozen=True)
class Placement:
    """The choice, why, and the device bytes of the optimizer's state in each mode (for ``stats()`` and the plan)."""

    accumulate: str
    reason: str
    device_bytes: dict[str, float]
    host_step_s: float | None = None  # "host"'s per-step copy and add, when the rates are known
    bound: str | None = None  # the memory that decided: "device", "host", or None (both fit: the fewer PCIe bytes)


def place_accumulation(
    *, device: str, offloaded_numel: int, topk_ratio: float, available_bytes: float | None, grad_bytes: int = 4,
    d2h_bytes_per_s: float | None = None, host_add_bytes_per_s: float | None = None,
    fraction: float = PLACEMENT_FRACTION, what: str = "left at the step's peak",
    host_bytes: dict[str, float] | None = None, host_available: float | None = None,
    host_what: str = "available on the host",
) -> Placement:
    """``device``: "cuda" or "cpu"; ``offloaded_numel``: offloaded elements (this process's); ``topk_ratio``: r;
    ``available_bytes``: device memory left at the step's peak before the optimizer's state (None: unknown, then
    "device", today's path); ``grad_bytes``: bytes per element of a landed gradient; the rates (bytes per second)
    only add the per-step cost of "host" to the reason. ``what`` names ``available_bytes`` in the reason (the
    autotuner's plan passes its memory budget, which holds its margin already, with ``fraction=1``).

    ``host_bytes`` (per mode, what the host slab would hold) and ``host_available`` weigh host memory too: the mode
    that fits both memories, "device" first (fewer PCIe bytes); when none does, the one that fits the host (the
    pre-flight would refuse the other before allocating), else "host". ``Placement.bound`` says which memory
    decided."""
    if offloaded_numel < 0 or not 0.0 <= topk_ratio <= 1.0:
        raise ValueError(f"Invalid placement inputs: offloaded_numel={offloaded_numel}, topk_ratio={topk_ratio}")
    compact = 12.0 * topk_ratio * offloaded_numel
    sizes = {"device": compact + 4.0 * offloaded_numel, "host": compact}
    step_s = None
    if d2h_bytes_per_s and host_add_bytes_per_s:
        step_s = (offloaded_numel * grad_bytes / d2h_bytes_per_s
                  + offloaded_numel * (8 + grad_bytes) / host_add_bytes_per_s)

    def gib(x: float) -> str:
        return f"{x / 2**30:.2f} GiB"

    if device != "cuda":
        return Placement("device", "CPU tensors: device and host memory are one, so there is no device memory to save",
                         sizes, step_s)
    if available_bytes is None:
        return Placement("device", "device memory unknown: the window sum stays on the device", sizes, step_s)
    budget = fraction * available_bytes
    cost = "" if step_s is None else f"; host would cost {step_s * 1e3:.2f} ms per step of copies and adds"
    room = (f"{fraction:.0%} of " if fraction < 1 else "") + f"the {gib(available_bytes)} {what}"
    on_host = host_bytes is not None and host_available is not None

    def host_fits(mode: str) -> bool:
        return not on_host or host_bytes[mode] <= host_available

    def host_says(mode: str) -> str:
        if not on_host:
            return ""
        verb = "fits in" if host_fits(mode) else "does not fit in"
        return f"; its host state ({gib(host_bytes[mode])}) {verb} the {gib(host_available)} {host_what}"

    device_fits = sizes["device"] <= budget
    said = f"the device state with the window sum ({gib(sizes['device'])})"
    if device_fits and host_fits("device"):
        return Placement("device", f"{said} fits in {room}{host_says('device')}{cost}", sizes, step_s)
    if not device_fits and host_fits("host"):
        return Placement("host", f"{said} does not fit in {room}; without it {gib(sizes['host'])}"
                         f"{host_says('host')}{cost}", sizes, step_s, bound="device")
    if host_fits("device"):  # "host" would not fit the host; "device" does, though not the device's budget
        return Placement("device", f'"host"{host_says("host")}; "device"{host_says("device")}, but {said} does '
                         f"not fit in {room}: decided by host memory, device memory may run out", sizes, step_s,
                         bound="host")
    if device_fits:
        return Placement("device", f"{said} fits in {room}{host_says('device')} (nor would \"host\"'s: decided by "
                         "host memory)", sizes, step_s, bound="host")
    return Placement("host", f"{said} does not fit in {room}; without it {gib(sizes['host'])}{host_says('host')} "
                     "(neither mode fits both memories)", sizes, step_s, bound="device")
