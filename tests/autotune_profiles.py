"""A small synthetic machine profile shared by the autotuner's cache, bridge and CLI tests."""

from __future__ import annotations

from zenflow_triton.autotune.profile import BandwidthCurve, CpuAdamwRates, DeviceOpRates, GpuInfo, Profile


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
