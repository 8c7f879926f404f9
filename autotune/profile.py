"""The machine profile: what the probes measured, as frozen dataclasses that read and write plain dicts.

:class:`Profile` holds one machine's figures: host AdamW rates per thread count and gradient dtype
(:class:`CpuAdamwRates`), copy bandwidth against copy size (:class:`BandwidthCurve`), the device-side ops on CPU
tensors (:class:`DeviceOpRates`) and, with CUDA, the GPU's memory and PCIe figures (:class:`GpuInfo`). Each has
``to_dict``/``from_dict``; the host add of ``accumulate="host"`` (:class:`HostAddRates`, optional: profiles from before
schema 3 have none); :mod:`.cache` wraps them in the versioned JSON file. The cost model (:mod:`.model`)
reads a profile and never touches hardware; :mod:`.probes` fills one.

``from_dict`` is the one place a profile's schema is checked: every field's type and range (finite numbers, positive
rates and sizes, objects where objects belong), so a file no probe wrote fails here with a :class:`ProfileError`
naming the field (``cpu_adamw.rates.float32.2: -1.0 is not a positive finite number``), never later in the planner.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NOISY_SPREAD", "BandwidthCurve", "CpuAdamwRates", "DeviceOpRates", "GpuInfo", "HostAddRates", "Profile",
           "ProfileError"]

# A profile whose figures' median spread (Profile.noise) passes this was measured on a busy machine. On the 2-core
# CI VM at load average 4.7-4.9 (other test suites running) three quick probes measured median spreads of 15%, 31%
# and 99% (single figures up to 990%), while an undisturbed figure's repeats agreed within 1% (memcpy 1-64 MiB in
# the same runs); 10% sits well above calm and below every busy run.
NOISY_SPREAD = 0.10
# A median hides one figure measured while something else ran: on that VM at load ~7 a run with a 10% median had the
# host add at 2 threads at 0.6-1.1 GB/s against 57-64 at one thread, and a 256 KiB memcpy at 0.06 GB/s. So the
# widest figure counts too: repeats whose slowest took more than twice the fastest (a spread over 100%) were not
# measured alone. Latency-bound small copies spread more than large ones when calm, hence a bound ten times the
# median's.
NOISY_WIDEST_SPREAD = 1.0
# A figure a quarter or less of its neighbours' (the next smaller and larger copy, the next fewer threads) is not
# the machine's curve: more bytes or more threads never cost 4x less throughput on an idle machine; the busy run
# above had both at 1/50 to 1/100.
OUTLIER_FACTOR = 4.0


class ProfileError(ValueError):
    """A profile file is missing, unreadable, of another schema or version, or has an invalid field (named)."""


# ------------------------------------------------------------------------------------- schema readers
# Each takes the value and its dotted path in the file, and returns the value typed or raises ProfileError.


def _bad(where: str, what: str) -> ProfileError:
    return ProfileError(f"{where}: {what}")


def _get(d: Any, key: str, where: str) -> Any:
    obj = _object(d, where)
    if key not in obj:
        raise _bad(f"{where}.{key}" if where else key, "missing")
    return obj[key]


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(where or "profile", f"must be a JSON object, got {type(value).__name__}")
    return value


def _text(value: Any, where: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise _bad(where, f"must be a string, got {value!r}")
    return value


def _number(value: Any, where: str, *, zero: bool = False) -> float:
    """A finite number > 0 (>= 0 with ``zero``); bools are not numbers here."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        value > 0 or (zero and value == 0))
    if not ok:
        raise _bad(where, f"{value!r} is not a {'non-negative' if zero else 'positive'} finite number")
    return float(value)


def _whole(value: Any, where: str, *, zero: bool = False) -> int:
    """An integer >= 1 (>= 0 with ``zero``), as JSON writes it (``4`` or ``4.0``)."""
    number = _number(value, where, zero=zero)
    if number != int(number):
        raise _bad(where, f"{value!r} is not a whole number")
    return int(number)


def _thread_table(value: Any, where: str, *, zero: bool) -> dict[int, float]:
    """``{"threads": number}`` with thread counts >= 1 (JSON object keys are strings)."""
    out = {}
    for key, number in _object(value, where).items():
        if not (isinstance(key, str) and key.isdigit() and int(key) >= 1):
            raise _bad(where, f"key {key!r} is not a thread count >= 1")
        out[int(key)] = _number(number, f"{where}.{key}", zero=zero)
    return out


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
    def from_dict(cls, d: Mapping[str, Any], where: str = "curve") -> BandwidthCurve:
        kind = _text(_get(d, "kind", where), f"{where}.kind")
        points = _get(d, "points", where)
        if not isinstance(points, list) or not points:
            raise _bad(f"{where}.points", f"must be a non-empty list of [bytes, bytes_per_second], got {points!r}")
        parsed = []
        for i, point in enumerate(points):
            if not (isinstance(point, list) and len(point) == 2):
                raise _bad(f"{where}.points", f"entry {i} is not [bytes, bytes_per_second]: {point!r}")
            parsed.append((_whole(point[0], f"{where}.points[{i}] bytes"),
                           _number(point[1], f"{where}.points[{i}] bytes_per_second")))
        try:
            return cls(kind=str(kind), points=tuple(parsed))
        except ValueError as exc:  # sizes out of order
            raise _bad(f"{where}.points", str(exc)) from None


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
            raise ProfileError(f"profile has no host AdamW rate for grad dtype {grad_dtype!r} "
                               f"(measured: {sorted(self.rates)})")
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
    def from_dict(cls, d: Mapping[str, Any], where: str = "cpu_adamw") -> CpuAdamwRates:
        table = _object(_get(d, "rates", where), f"{where}.rates")
        if not table:
            raise _bad(f"{where}.rates", "empty: no host AdamW rate was measured")
        rates = {}
        for dt, tab in table.items():
            rates[str(dt)] = _thread_table(tab, f"{where}.rates.{dt}", zero=False)
            if not rates[str(dt)]:
                raise _bad(f"{where}.rates.{dt}", "empty: no thread count was measured")
        overhead = _thread_table(_get(d, "call_overhead_s", where), f"{where}.call_overhead_s", zero=True)
        return cls(kernel=str(_text(_get(d, "kernel", where), f"{where}.kernel")),
                   numel=_whole(_get(d, "numel", where), f"{where}.numel"), rates=rates, call_overhead_s=overhead)


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
    pass_no_acc_rate: float | None = None
    """Elements/s of the fused pass without a window sum (``acc=None``: scores only, what ``accumulate="host"`` runs
    each step); None in profiles from before schema 3 (not measured)."""

    def __post_init__(self) -> None:
        for name in ("pass_rate", "adam_rate", "merge_rate", "pass_no_acc_rate"):
            value = getattr(self, name)
            if name == "pass_no_acc_rate" and value is None:
                continue
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"invalid device {name}: {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "pass_rate": self.pass_rate, "adam_rate": self.adam_rate,
                "merge_rate": self.merge_rate, "pass_no_acc_rate": self.pass_no_acc_rate}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "cpu_device") -> DeviceOpRates:
        rates = {name: _number(_get(d, name, where), f"{where}.{name}")
                 for name in ("pass_rate", "adam_rate", "merge_rate")}
        no_acc = _object(d, where).get("pass_no_acc_rate")  # optional: schema 3
        return cls(source=str(_text(_get(d, "source", where), f"{where}.source")), **rates,
                   pass_no_acc_rate=None if no_acc is None else _number(no_acc, f"{where}.pass_no_acc_rate"))


@dataclass(frozen=True)
class HostAddRates:
    """The host add of ``accumulate="host"`` (``kernels.host_accumulate``: ``sum += g``, fp32 sum), measured per
    landing dtype and thread count over a few sizes.

    ``curves[landing dtype][threads]`` is a :class:`BandwidthCurve` of bytes streamed per call (read the fp32 sum
    and the landed gradient, write the sum: ``(8 + landing bytes)`` per element) against bytes per second, so
    ``seconds(numel * (8 + landing bytes))`` is one add's predicted time. Landing dtypes are ``"float32"`` and
    ``"bfloat16"`` (an fp16 landing streams the bf16 bytes).
    """

    kernel: str
    """``"numba"`` (kernels.host_accumulate) or ``"torch-reference"`` (kernels.reference, where numba is missing)."""
    curves: Mapping[str, Mapping[int, BandwidthCurve]]

    def __post_init__(self) -> None:
        if not self.curves or any(not table for table in self.curves.values()):
            raise ValueError("HostAddRates has no measured curve")

    def measured_at(self, landing: str, threads: int) -> tuple[str, int]:
        """The measured ``(landing, threads)`` that stands for these: the thread count nearest below ``threads``
        (or the smallest), as :meth:`CpuAdamwRates.rate`; the first measured dtype where ``landing`` is absent."""
        dt = landing if self.curves.get(landing) else next(iter(self.curves))
        below = [t for t in self.curves[dt] if t <= threads]
        return dt, max(below) if below else min(self.curves[dt])

    def curve(self, landing: str, threads: int) -> BandwidthCurve:
        """The curve that stands for ``(landing, threads)`` (:meth:`measured_at`)."""
        dt, t = self.measured_at(landing, threads)
        return self.curves[dt][t]

    def to_dict(self) -> dict[str, Any]:
        curves = {dt: {str(t): c.to_dict() for t, c in sorted(tab.items())} for dt, tab in self.curves.items()}
        return {"kernel": self.kernel, "curves": curves}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "host_add") -> HostAddRates:
        table = _object(_get(d, "curves", where), f"{where}.curves")
        if not table:
            raise _bad(f"{where}.curves", "empty: no host add was measured")
        curves: dict[str, dict[int, BandwidthCurve]] = {}
        for dt, tab in table.items():
            at = f"{where}.curves.{dt}"
            curves[str(dt)] = {}
            for key, curve in _object(tab, at).items():
                if not (isinstance(key, str) and key.isdigit() and int(key) >= 1):
                    raise _bad(at, f"key {key!r} is not a thread count >= 1")
                curves[str(dt)][int(key)] = BandwidthCurve.from_dict(curve, f"{at}.{key}")
            if not curves[str(dt)]:
                raise _bad(at, "empty: no thread count was measured")
        return cls(kernel=str(_text(_get(d, "kernel", where), f"{where}.kernel")), curves=curves)


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
    def from_dict(cls, d: Mapping[str, Any], where: str = "gpu") -> GpuInfo:
        return cls(name=str(_text(_get(d, "name", where), f"{where}.name")),
                   total_bytes=_whole(_get(d, "total_bytes", where), f"{where}.total_bytes"),
                   free_bytes=_whole(_get(d, "free_bytes", where), f"{where}.free_bytes", zero=True),
                   mem_bandwidth=_number(_get(d, "mem_bandwidth", where), f"{where}.mem_bandwidth"),
                   h2d=BandwidthCurve.from_dict(_get(d, "h2d", where), f"{where}.h2d"),
                   d2h=BandwidthCurve.from_dict(_get(d, "d2h", where), f"{where}.d2h"))


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
    cpu_device: DeviceOpRates | None
    """Device-side ops on CPU tensors, measured; None when the probe skipped them (``ProbeSettings.cpu_device_ops``:
    the optimizer's quick probe for CUDA parameters), and a plan for CPU tensors then refuses the profile."""
    gpu: GpuInfo | None = None
    gpu_unavailable: str | None = None
    """Why ``gpu`` is None (said, never invented)."""
    quick: bool = False
    created: str = ""
    versions: Mapping[str, str] = field(default_factory=dict)
    durations: Mapping[str, float] = field(default_factory=dict)
    """Seconds each probe took."""
    spread: Mapping[str, float] = field(default_factory=dict)
    """Per measured figure (``"memcpy 1 MiB"``, ``"host AdamW float32 3 threads"``, ...), the slowest of its timed
    repeats over the fastest, minus one: 0.05 means the repeats agreed within 5%. Empty in profiles written before
    schema 2 (not recorded)."""
    repeats: Mapping[str, int] = field(default_factory=dict)
    """Timed repeats per probe (``"copy"``, ``"host_adamw"``, ``"device_ops"``); empty before schema 2."""
    load_average: float | None = None
    """The 1-minute load average when probing ended (None: not recorded, or the system does not say)."""
    host_add: HostAddRates | None = None
    """accumulate="host"'s host add, measured; None in profiles from before schema 3 (the model then assumes it
    streams at twice the memcpy peak, and says so)."""

    @property
    def noise(self) -> float | None:
        """The median of :attr:`spread` over the figures: how calm the machine was while measuring (lower is
        calmer; None when not recorded). The median, so one latency-bound small copy does not decide it."""
        return statistics.median(self.spread.values()) if self.spread else None

    def busy(self) -> str | None:
        """Why this profile looks measured on a busy machine (None: it does not): a load average above the cores,
        a median spread (:attr:`noise`) above :data:`NOISY_SPREAD`, a widest spread above
        :data:`NOISY_WIDEST_SPREAD`, or figures out of line with their neighbours (:meth:`outliers`)."""
        reasons = []
        if self.load_average is not None and self.load_average > self.cpu_cores:
            reasons.append(f"load average {self.load_average:.1f} on {self.cpu_cores} cores")
        noise = self.noise
        if noise is not None and noise > NOISY_SPREAD:
            reasons.append(f"the repeats of a typical figure disagree by {noise:.0%} (calm: under {NOISY_SPREAD:.0%})")
        if self.spread:
            worst = max(self.spread, key=lambda k: self.spread[k])
            if self.spread[worst] > NOISY_WIDEST_SPREAD:
                reasons.append(f"the repeats of {worst} disagree by {self.spread[worst]:.0%} "
                               f"(calm: under {NOISY_WIDEST_SPREAD:.0%})")
        out = self.outliers()
        if out:
            reasons.append(f"figures out of line with their neighbours: {'; '.join(out)}")
        return "; ".join(reasons) or None

    def outliers(self) -> list[str]:
        """Figures at most 1/:data:`OUTLIER_FACTOR` of both neighbouring copy sizes on their curve, or of the next
        fewer threads' at the same dtype (and size, for the host add), each as ``"name: value against value"``."""
        out: list[str] = []

        def dips(name: str, curve: BandwidthCurve) -> None:
            pts = sorted(curve.points)
            for (_, lo), (n, bw), (_, hi) in zip(pts, pts[1:], pts[2:]):
                if bw * OUTLIER_FACTOR <= min(lo, hi):
                    out.append(f"{name} {n} B at {bw / 1e9:.2g} GB/s against {lo / 1e9:.2g} and {hi / 1e9:.2g}")

        dips("memcpy", self.memcpy)
        if self.gpu is not None:
            dips("H2D", self.gpu.h2d)
            dips("D2H", self.gpu.d2h)
        for dt, tab in self.cpu_adamw.rates.items():
            ts = sorted(tab)
            for fewer, t in zip(ts, ts[1:]):
                if tab[t] * OUTLIER_FACTOR <= tab[fewer]:
                    out.append(f"host AdamW {dt} at {t} threads {tab[t] / 1e6:.3g} M/s against "
                               f"{tab[fewer] / 1e6:.3g} at {fewer}")
        if self.host_add is not None:
            for dt, curves in self.host_add.curves.items():
                ts = sorted(curves)
                for t in ts:
                    dips(f"host add {dt} {t} threads", curves[t])
                for fewer, t in zip(ts, ts[1:]):
                    base = dict(curves[fewer].points)
                    for n, bw in curves[t].points:
                        if n in base and bw * OUTLIER_FACTOR <= base[n]:
                            out.append(f"host add {dt} {n} B at {t} threads {bw / 1e9:.2g} GB/s against "
                                       f"{base[n] / 1e9:.2g} at {fewer}")
        return out

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
            "spread": dict(self.spread),
            "repeats": dict(self.repeats),
            "load_average": self.load_average,
            "cpu_adamw": self.cpu_adamw.to_dict(),
            "memcpy": self.memcpy.to_dict(),
            "cpu_device": None if self.cpu_device is None else self.cpu_device.to_dict(),
            "gpu": None if self.gpu is None else self.gpu.to_dict(),
            "gpu_unavailable": self.gpu_unavailable,
            "host_add": None if self.host_add is None else self.host_add.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        """The profile in ``d`` (``to_dict``'s form), every field checked; raises :class:`ProfileError` naming the
        first invalid one. Fields added after schema 1 (``spread``, ``repeats``, ``load_average``; schema 3's
        ``host_add`` and ``cpu_device.pass_no_acc_rate``) are optional."""
        d = _object(d, "")

        def optional(key: str, default: Any) -> Any:
            return d.get(key, default)

        quick = optional("quick", False)
        if not isinstance(quick, bool):
            raise _bad("quick", f"must be true or false, got {quick!r}")
        versions = _object(optional("versions", {}), "versions")
        load = optional("load_average", None)
        gpu = optional("gpu", None)
        host_add = optional("host_add", None)
        cpu_device = _get(d, "cpu_device", "")
        return cls(
            machine_key=str(_text(_get(d, "machine_key", ""), "machine_key")),
            hostname=str(_text(_get(d, "hostname", ""), "hostname")),
            cpu_model=str(_text(_get(d, "cpu_model", ""), "cpu_model")),
            cpu_cores=_whole(_get(d, "cpu_cores", ""), "cpu_cores"),
            llc_bytes=_whole(_get(d, "llc_bytes", ""), "llc_bytes"),
            quick=quick,
            created=str(_text(optional("created", ""), "created")),
            versions={str(k): str(_text(v, f"versions.{k}")) for k, v in versions.items()},
            durations={str(k): _number(v, f"durations.{k}", zero=True)
                       for k, v in _object(optional("durations", {}), "durations").items()},
            spread={str(k): _number(v, f"spread.{k}", zero=True)
                    for k, v in _object(optional("spread", {}), "spread").items()},
            repeats={str(k): _whole(v, f"repeats.{k}") for k, v in _object(optional("repeats", {}), "repeats").items()},
            load_average=None if load is None else _number(load, "load_average", zero=True),
            cpu_adamw=CpuAdamwRates.from_dict(_get(d, "cpu_adamw", ""), "cpu_adamw"),
            memcpy=BandwidthCurve.from_dict(_get(d, "memcpy", ""), "memcpy"),
            cpu_device=None if cpu_device is None else DeviceOpRates.from_dict(cpu_device, "cpu_device"),
            gpu=None if gpu is None else GpuInfo.from_dict(gpu, "gpu"),
            gpu_unavailable=_text(optional("gpu_unavailable", None), "gpu_unavailable", optional=True),
            host_add=None if host_add is None else HostAddRates.from_dict(host_add, "host_add"),
        )
