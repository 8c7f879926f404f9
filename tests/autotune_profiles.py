"""A small synthetic machine profile shared by the autotuner's cache, bridge and CLI tests."""

from __future__ import annotations

import dataclasses

from zenflow_triton.autotune.profile import BandwidthCurve, CpuAdamwRates, DeviceOpRates, GpuInfo, HostAddRates, Profile


def synthetic_profile(*, gpu: bool = False, key: str = "host__cpu__nogpu") -> Profile:
    curve = BandwidthCurve(kind="memcpy", points=((1 << 20, 5e9), (64 << 20, 8e9)))
    return Profile(
        machine_key=key,
        hostname="host",
        cpu_model="cpu",
        cpu_cores=4,
        llc_bytes=32 << 20,
        cpu_adamw=CpuAdamwRates(kernel="numba", numel=1 << 22,
                                rates={"float32": {1: 3e8, 2: 5e8, 3: 6e8, 4: 6.1e8},
                                       "bfloat16": {1: 3.5e8, 2: 6e8, 3: 7e8, 4: 7e8}},
                                call_overhead_s={1: 2e-5, 2: 3e-5, 3: 3e-5, 4: 4e-5}),
        memcpy=curve,
        cpu_device=DeviceOpRates(source="synthetic", pass_rate=5e8, adam_rate=1e8, merge_rate=5e8),
        gpu=GpuInfo(name="GPU", total_bytes=80 << 30, free_bytes=70 << 30, mem_bandwidth=2e12,
                    h2d=BandwidthCurve(kind="pcie-h2d", points=((1 << 20, 2e10),)),
                    d2h=BandwidthCurve(kind="pcie-d2h", points=((1 << 20, 2e10),))) if gpu else None,
        gpu_unavailable=None if gpu else "synthetic: no CUDA",
        quick=True,
        created="2025-01-01T00:00:00+00:00",
        versions={"torch": "x"},
        durations={"total": 1.0},
    )


def with_schema_3(profile: Profile, *, add_rate: float = 16e9, no_acc_rate: float = 1e9) -> Profile:
    """``profile`` with schema 3's measured figures: a host add curve flat at ``add_rate`` bytes/s (fp32 and bf16
    landing, 1 and 2 threads; 2 threads twice as fast) and the CPU-tensor pass without acc at ``no_acc_rate``."""
    def flat(dt: str, rate: float) -> BandwidthCurve:
        per_elem = 12 if dt == "float32" else 10  # bytes streamed per element, as the probe counts them
        return BandwidthCurve(kind=f"host-add-{dt}", points=((per_elem << 16, rate), (per_elem << 22, rate)))

    add = HostAddRates(kernel="numba", curves={dt: {1: flat(dt, add_rate / 2), 2: flat(dt, add_rate)}
                                               for dt in ("float32", "bfloat16")})
    return dataclasses.replace(profile, host_add=add,
                               cpu_device=dataclasses.replace(profile.cpu_device, pass_no_acc_rate=no_acc_rate))


def _set(path: str, value):
    """A mutation of a profile's JSON: ``path`` is dotted (``cpu_adamw.rates``), the last key gets ``value``."""
    def mutate(data: dict) -> None:
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[last] = value
    return mutate


# Profiles a user's disk can hold that no probe wrote: (id, mutation of profile_to_json's dict, the field the
# error must name). Each ended in a traceback (AttributeError, ValueError, OverflowError) before validation.
BAD_PROFILES = [
    ("versions-list", _set("versions", ["torch", "x"]), "versions"),
    ("rates-list", _set("cpu_adamw.rates", [1e8, 2e8]), "cpu_adamw.rates"),
    ("rates-empty", _set("cpu_adamw.rates", {}), "cpu_adamw.rates"),
    ("rates-dtype-empty", _set("cpu_adamw.rates.float32", {}), "cpu_adamw.rates.float32"),
    ("rate-negative", _set("cpu_adamw.rates.float32.1", -1.0), "cpu_adamw.rates.float32.1"),
    ("rate-nan", _set("cpu_adamw.rates.bfloat16.2", float("nan")), "cpu_adamw.rates.bfloat16.2"),
    ("thread-key", _set("cpu_adamw.call_overhead_s", {"two": 1e-5}), "cpu_adamw.call_overhead_s"),
    ("llc-inf", _set("llc_bytes", float("inf")), "llc_bytes"),
    ("llc-negative", _set("llc_bytes", -5), "llc_bytes"),
    ("cores-fraction", _set("cpu_cores", 2.5), "cpu_cores"),
    ("cores-string", _set("cpu_cores", "4"), "cpu_cores"),
    ("memcpy-points-dict", _set("memcpy.points", {"1": 2}), "memcpy.points"),
    ("memcpy-point-inf", _set("memcpy.points", [[1048576, float("inf")]]), "memcpy.points[0] bytes_per_second"),
    ("device-rate-zero", _set("cpu_device.adam_rate", 0), "cpu_device.adam_rate"),
    ("durations-inf", _set("durations", {"total": float("inf")}), "durations.total"),
    ("quick-string", _set("quick", "no"), "quick"),
    ("cpu-adamw-missing", lambda d: d.pop("cpu_adamw"), "cpu_adamw"),
    ("hostname-number", _set("hostname", 7), "hostname"),
]
