"""The machine profile: what the probes measured, as frozen dataclasses that read and write plain dicts.

:class:`Profile` holds one machine's figures: host AdamW rates per thread count and gradient dtype
(:class:`CpuAdamwRates`), copy bandwidth against copy size (:class:`BandwidthCurve`), the device-side ops on CPU
tensors (:class:`DeviceOpRates`) and, with CUDA, the GPU's memory and PCIe figures (:class:`GpuInfo`). Each has
``to_dict``/``from_dict``; :mod:`.cache` wraps them in the versioned JSON file. The cost model (:mod:`.model`)
reads a profile and never touches hardware; :mod:`.probes` fills one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BandwidthCurve", "CpuAdamwRates", "DeviceOpRates", "GpuInfo", "Profile"]


@dataclass(frozen=True)
class BandwidthCurve:
    """Measured copy time against copy size: ``points`` are ``(bytes, bytes_per_second)``, ascending in bytes.

    ``kind`` says what was measured: ``"pcie-h2d"``, ``"pcie-d2h"`` (pinned slabs, copy stream) or
    ``"memcpy"`` (host to host: the copy a run on CPU tensors makes instead of crossing PCIe).
    """

    kind: str
    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError(f"BandwidthCurve {self.kind!r} has no points")
        for n, bw in self.points:
            if n <= 0 or not (bw > 0 and math.isfinite(bw)):
                raise ValueError(f"BandwidthCurve {self.kind!r}: invalid point ({n}, {bw})")
        sizes = [n for n, _ in self.points]
        if sizes != sorted(sizes):
            raise ValueError(f"BandwidthCurve {self.kind!r}: sizes must ascend, got {sizes}")

    @property
    def peak(self) -> float:
        return max(bw for _, bw in self.points)

    def seconds(self, nbytes: float) -> float:
        """Predicted time of one copy of ``nbytes``: piecewise linear in time between measured sizes.

        Below the smallest size the smallest size's bandwidth applies, above the largest the largest's:
        small copies are latency-bound and must not borrow the bandwidth of large ones.
        """
        if nbytes <= 0:
            return 0.0
        pts = self.points
        if nbytes <= pts[0][0]:
            return nbytes / pts[0][1]
        if nbytes >= pts[-1][0]:
            return nbytes / pts[-1][1]
        for (n0, b0), (n1, b1) in zip(pts, pts[1:]):
            if n0 <= nbytes <= n1:
                t0, t1 = n0 / b0, n1 / b1
                return t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0)
        raise AssertionError("unreachable: sizes ascend")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "points": [[int(n), float(bw)] for n, bw in self.points]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BandwidthCurve:
        return cls(kind=str(d["kind"]), points=tuple((int(n), float(bw)) for n, bw in d["points"]))


@dataclass(frozen=True)
class CpuAdamwRates:
    """Throughput of the host AdamW kernel, per landing dtype and thread count, on buffers beyond the LLC."""

    kernel: str
    """``"numba"`` (kernels.cpu_adamw) or ``"torch-reference"`` (kernels.reference, where numba is missing)."""
    numel: int
    """Elements per timed call (chosen larger than the last-level cache)."""
    rates: Mapping[str, Mapping[int, float]]
    """``rates[grad_dtype][threads]``: parameters per second."""
    call_overhead_s: Mapping[int, float]
    """``call_overhead_s[threads]``: fixed cost of one call (checks, column plan, waking the thread pool), paid
    once per parameter per window."""

    @staticmethod
    def _at(table: Mapping[int, float], threads: int) -> float:
        # The measured count nearest below ``threads`` (or the smallest): never credit unmeasured scaling.
        below = [t for t in table if t <= threads]
        return table[max(below)] if below else table[min(table)]

    def rate(self, grad_dtype: str, threads: int) -> float:
        """Params/s at ``threads`` threads."""
        table = self.rates.get(grad_dtype)
        if not table:
            raise ValueError(f"profile has no host AdamW rate for grad dtype {grad_dtype!r}")
        return self._at(table, threads)

    def overhead(self, threads: int) -> float:
        """Seconds of fixed cost per call at ``threads`` threads."""
        return self._at(self.call_overhead_s, threads) if self.call_overhead_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        # JSON object keys are strings; thread counts go back to ints in from_dict.
        return {
            "kernel": self.kernel,
            "numel": self.numel,
            "rates": {dt: {str(t): r for t, r in sorted(tab.items())} for dt, tab in self.rates.items()},
            "call_overhead_s": {str(t): s for t, s in sorted(self.call_overhead_s.items())},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CpuAdamwRates:
        rates = {str(dt): {int(t): float(r) for t, r in tab.items()} for dt, tab in d["rates"].items()}
        for dt, tab in rates.items():
            if not tab or any(t < 1 or not (r > 0 and math.isfinite(r)) for t, r in tab.items()):
                raise ValueError(f"invalid host AdamW rates for {dt!r}: {tab}")
        overhead = {int(t): float(s) for t, s in d["call_overhead_s"].items()}
        if any(t < 1 or not (s >= 0 and math.isfinite(s)) for t, s in overhead.items()):
            raise ValueError(f"invalid host AdamW call overheads: {overhead}")
        return cls(kernel=str(d["kernel"]), numel=int(d["numel"]), rates=rates, call_overhead_s=overhead)


@dataclass(frozen=True)
class DeviceOpRates:
    """Rates (elements/s) of the device-side optimizer work: the fused pass and Adam on selected columns."""

    source: str
    """How they were obtained: ``"measured: torch backend on CPU tensors"`` or derived from GPU bandwidth."""
    pass_rate: float
    """Elements/s of the fused pass over every gradient element (scores, accumulate)."""
    adam_rate: float
    """Extra elements/s of the Adam update on a selected column's elements."""
    merge_rate: float
    """Elements/s of writing a host result into the parameter's unselected columns (once per window)."""

    def __post_init__(self) -> None:
        for name in ("pass_rate", "adam_rate", "merge_rate"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"invalid device {name}: {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "pass_rate": self.pass_rate, "adam_rate": self.adam_rate,
                "merge_rate": self.merge_rate}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceOpRates:
        return cls(source=str(d["source"]), pass_rate=float(d["pass_rate"]), adam_rate=float(d["adam_rate"]),
                   merge_rate=float(d["merge_rate"]))


@dataclass(frozen=True)
class GpuInfo:
    """What the probes measured on the CUDA device."""

    name: str
    total_bytes: int
    free_bytes: int
    mem_bandwidth: float
    """Device-to-device copy bandwidth (bytes read plus written per second)."""
    h2d: BandwidthCurve
    d2h: BandwidthCurve

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "total_bytes": self.total_bytes, "free_bytes": self.free_bytes,
                "mem_bandwidth": self.mem_bandwidth, "h2d": self.h2d.to_dict(), "d2h": self.d2h.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GpuInfo:
        return cls(name=str(d["name"]), total_bytes=int(d["total_bytes"]), free_bytes=int(d["free_bytes"]),
                   mem_bandwidth=float(d["mem_bandwidth"]), h2d=BandwidthCurve.from_dict(d["h2d"]),
                   d2h=BandwidthCurve.from_dict(d["d2h"]))


@dataclass(frozen=True)
class Profile:
    """Everything the probes measured on one machine; the cost model's only hardware input."""

    machine_key: str
    hostname: str
    cpu_model: str
    cpu_cores: int
    """Cores this process may run on (its affinity mask)."""
    llc_bytes: int
    cpu_adamw: CpuAdamwRates
    memcpy: BandwidthCurve
    """Host-to-host copy bandwidth: the "copy" of a run on CPU tensors, where there is no PCIe."""
    cpu_device: DeviceOpRates
    """Device-side ops on CPU tensors (the torch backend), measured."""
    gpu: GpuInfo | None = None
    gpu_unavailable: str | None = None
    """Why ``gpu`` is None (said, never invented)."""
    quick: bool = False
    created: str = ""
    versions: Mapping[str, str] = field(default_factory=dict)
    durations: Mapping[str, float] = field(default_factory=dict)
    """Seconds each probe took."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "machine_key": self.machine_key,
            "hostname": self.hostname,
            "cpu_model": self.cpu_model,
            "cpu_cores": self.cpu_cores,
            "llc_bytes": self.llc_bytes,
            "quick": self.quick,
            "created": self.created,
            "versions": dict(self.versions),
            "durations": dict(self.durations),
            "cpu_adamw": self.cpu_adamw.to_dict(),
            "memcpy": self.memcpy.to_dict(),
            "cpu_device": self.cpu_device.to_dict(),
            "gpu": None if self.gpu is None else self.gpu.to_dict(),
            "gpu_unavailable": self.gpu_unavailable,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        return cls(
            machine_key=str(d["machine_key"]),
            hostname=str(d["hostname"]),
            cpu_model=str(d["cpu_model"]),
            cpu_cores=int(d["cpu_cores"]),
            llc_bytes=int(d["llc_bytes"]),
            quick=bool(d.get("quick", False)),
            created=str(d.get("created", "")),
            versions={str(k): str(v) for k, v in d.get("versions", {}).items()},
            durations={str(k): float(v) for k, v in d.get("durations", {}).items()},
            cpu_adamw=CpuAdamwRates.from_dict(d["cpu_adamw"]),
            memcpy=BandwidthCurve.from_dict(d["memcpy"]),
            cpu_device=DeviceOpRates.from_dict(d["cpu_device"]),
            gpu=None if d.get("gpu") is None else GpuInfo.from_dict(d["gpu"]),
            gpu_unavailable=d.get("gpu_unavailable"),
        )

