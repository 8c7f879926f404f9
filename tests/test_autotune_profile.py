"""The measured profile's parts: bandwidth curves, host AdamW rate tables, and their dict round trip."""

from __future__ import annotations

import dataclasses
import math

import pytest

from zenflow_triton.autotune.profile import BandwidthCurve, CpuAdamwRates, DeviceOpRates, GpuInfo, Profile


def test_bandwidth_curve_interpolates_time_and_clamps_bandwidth_at_the_ends():
    c = BandwidthCurve(kind="pcie-h2d", points=((1000, 1e6), (3000, 3e6)))
    assert c.seconds(1000) == pytest.approx(1e-3)
    assert c.seconds(3000) == pytest.approx(1e-3)
    assert c.seconds(2000) == pytest.approx(1e-3)  # time is linear between measured sizes
    assert c.seconds(500) == pytest.approx(500 / 1e6)  # below: the smallest size's bandwidth, not the peak's
    assert c.seconds(6000) == pytest.approx(6000 / 3e6)
    assert c.seconds(0) == 0.0
    assert c.peak == 3e6


@pytest.mark.parametrize("points", [(), ((10, 0.0),), ((10, 1.0), (5, 1.0)), ((0, 1.0),), ((10, math.nan),)])
def test_bandwidth_curve_rejects_invalid_points(points):
    with pytest.raises(ValueError):
        BandwidthCurve(kind="x", points=points)


def test_rates_use_the_measured_thread_count_at_or_below():
    a = CpuAdamwRates(kernel="numba", numel=1, rates={"float32": {1: 1.0, 4: 4.0}}, call_overhead_s={1: 1e-5, 4: 2e-5})
    assert a.rate("float32", 3) == 1.0
    assert a.rate("float32", 9) == 4.0
    assert a.overhead(4) == 2e-5
    with pytest.raises(ValueError, match="bfloat16"):
        a.rate("bfloat16", 1)


def test_to_dict_and_from_dict_round_trip_with_and_without_a_gpu():
    curve = BandwidthCurve(kind="memcpy", points=((1 << 20, 5e9), (64 << 20, 8e9)))
    gpu = GpuInfo(name="GPU", total_bytes=80 << 30, free_bytes=70 << 30, mem_bandwidth=2e12,
                  h2d=BandwidthCurve(kind="pcie-h2d", points=((1 << 20, 2e10),)),
                  d2h=BandwidthCurve(kind="pcie-d2h", points=((1 << 20, 2e10),)))
    base = dict(machine_key="k", hostname="h", cpu_model="c", cpu_cores=2, llc_bytes=1 << 20,
                cpu_adamw=CpuAdamwRates(kernel="numba", numel=64, rates={"float32": {1: 1e8, 2: 2e8}},
                                        call_overhead_s={1: 1e-5, 2: 2e-5}),
                memcpy=curve, cpu_device=DeviceOpRates(source="s", pass_rate=1e9, adam_rate=1e8, merge_rate=1e9))
    for prof in (Profile(**base, gpu=gpu), Profile(**base, gpu_unavailable="no CUDA")):
        assert Profile.from_dict(prof.to_dict()) == prof


def test_device_op_rates_must_be_positive():
    with pytest.raises(ValueError, match="adam_rate"):
        DeviceOpRates(source="s", pass_rate=1.0, adam_rate=0.0, merge_rate=1.0)


def test_noise_is_the_median_spread_and_busy_says_why():
    from autotune_profiles import synthetic_profile

    from zenflow_triton.autotune.profile import NOISY_SPREAD

    calm = dataclasses.replace(synthetic_profile(), spread={"a": 0.01, "b": 0.02, "c": 0.6}, load_average=1.0)
    assert calm.noise == 0.02 and calm.busy() is None  # one latency-bound figure at 60% does not make a run noisy
    wild = dataclasses.replace(calm, spread={"a": 0.01, "b": 0.02, "c": 3.0})
    assert wild.noise == 0.02 and wild.busy() == "the repeats of c disagree by 300% (calm: under 100%)"  # issue 30
    noisy = dataclasses.replace(calm, spread={"a": 0.3, "b": 0.5})
    assert noisy.noise == pytest.approx(0.4) and noisy.noise > NOISY_SPREAD
    assert "disagree by 40%" in noisy.busy()
    loaded = dataclasses.replace(calm, load_average=9.5)  # the synthetic machine has 4 cores
    assert loaded.busy() == "load average 9.5 on 4 cores"
    unknown = synthetic_profile()  # schema 1: nothing recorded, nothing claimed
    assert unknown.noise is None and unknown.busy() is None
