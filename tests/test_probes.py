"""Hardware probes on tiny sizes: positive figures on CPU, GPU figures reported unavailable without CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zenflow_triton.autotune import host_probes, machine, probes, timing
from zenflow_triton.autotune.cache import load_profile, save_profile
from zenflow_triton.autotune.probes import ProbeSettings, probe_machine

MiB = 2**20
TINY = ProbeSettings(copy_sizes=(64 * 1024, MiB), copy_repeats=2, adamw_numel=1 << 16, adamw_repeats=2,
                     thread_counts=None, device_ops_numel=1 << 14, gpu_bandwidth_bytes=MiB, quick=True,
                     add_numels=(1 << 12, 1 << 16))


@pytest.fixture(scope="module")
def tiny_profile():
    return probe_machine(TINY)


def test_memcpy_curve_is_positive_and_labelled():
    curve = probes.measure_memcpy([4096, 64 * 1024], repeats=2)
    assert curve.kind == "memcpy"
    assert [n for n, _ in curve.points] == [4096, 64 * 1024]
    assert all(bw > 0 for _, bw in curve.points)


def test_host_adamw_rates_cover_both_landing_dtypes_and_each_thread_count():
    messages: list[str] = []
    rates = host_probes.measure_host_adamw(numel=1 << 14, thread_counts=[1, 2], repeats=1, progress=messages.append)
    assert rates.kernel in ("numba", "torch-reference")
    assert set(rates.rates) == {"float32", "bfloat16"}
    assert all(set(tab) == {1, 2} and min(tab.values()) > 0 for tab in rates.rates.values())
    assert set(rates.call_overhead_s) == {1, 2} and min(rates.call_overhead_s.values()) > 0
    assert any("params/s" in m for m in messages)


def test_cpu_device_op_rates_are_positive():
    rates = probes.measure_cpu_device_ops(numel=1 << 12, repeats=1)
    assert rates.pass_rate > 0 and rates.adam_rate > 0 and rates.merge_rate > 0
    assert rates.pass_no_acc_rate is not None and rates.pass_no_acc_rate > 0  # accumulate="host"'s pass
    assert "CPU tensors" in rates.source


def test_host_add_curves_cover_each_landing_thread_count_and_size():
    """The add probe: a curve per landing dtype and thread count, a point per size, in bytes streamed (the fp32 sum
    read and written plus the landed gradient), each with its spread; the compile time recorded."""
    messages: list[str] = []
    spread: dict[str, float] = {}
    durations: dict[str, float] = {}
    rates = host_probes.measure_host_add(numels=[1 << 16, 1 << 10], thread_counts=[1, 2], repeats=2,
                                    progress=messages.append, spread=spread, durations=durations)
    assert rates.kernel in ("numba", "torch-reference")
    assert set(rates.curves) == {"float32", "bfloat16"}
    for dt, per_elem in (("float32", 12), ("bfloat16", 10)):
        assert set(rates.curves[dt]) == {1, 2}
        for t, curve in rates.curves[dt].items():
            assert curve.kind == f"host-add-{dt}"
            assert [n for n, _ in curve.points] == [(1 << 10) * per_elem, (1 << 16) * per_elem]
            assert curve.peak > 0
            assert {f"host add {dt} {t} threads 4 KiB", f"host add {dt} {t} threads 256 KiB"} <= set(spread)
    assert rates.curve("float32", 8) is rates.curves["float32"][2]  # nearest measured count below
    assert rates.curve("float16", 1) is rates.curves["float32"][1]  # an unmeasured landing: the first measured
    assert durations["compile_add"] >= 0
    assert any("host add" in m and "GB/s" in m for m in messages)
    with pytest.raises(ValueError, match="sizes"):
        host_probes.measure_host_add(numels=[0], thread_counts=[1])


def test_default_add_sizes_reach_beyond_the_cache():
    llc = 32 * MiB
    quick = probes._add_numels(ProbeSettings.quick_settings(), llc)
    full = probes._add_numels(ProbeSettings.full_settings(), llc)
    assert quick[0] == 1 << 16 and quick[-1] * 8 >= 2 * llc and len(quick) == 3
    assert full[-1] * 8 >= 4 * llc and len(full) == 5
    assert probes._add_numels(TINY, llc) == [1 << 12, 1 << 16]


def test_quick_thread_counts_are_a_spread_within_the_cores():
    quick = ProbeSettings.quick_settings()
    full = ProbeSettings.full_settings()
    counts = probes._thread_counts(64, quick)
    assert counts[0] == 1 and max(counts) <= 64 and len(counts) < 12
    assert probes._thread_counts(1, full) == [1]


def test_overrides_shrink_the_run():
    s = ProbeSettings.full_settings().with_overrides(adamw_numel=1000, max_copy_bytes=3 * MiB)
    assert s.adamw_numel == 1000 and s.device_ops_numel == 1000 and max(s.add_numels) == 1000
    assert max(s.copy_sizes) <= 3 * MiB and s.gpu_bandwidth_bytes <= 3 * MiB


def test_probe_machine_on_this_host(tiny_profile, tmp_path):
    prof = tiny_profile
    assert prof.cpu_cores == machine.available_cores()
    assert prof.memcpy.peak > 0
    assert min(min(t.values()) for t in prof.cpu_adamw.rates.values()) > 0
    assert prof.durations["total"] > 0
    if not torch.cuda.is_available():
        assert prof.gpu is None
        assert "CUDA" in prof.gpu_unavailable
        assert prof.machine_key.endswith("__nogpu")
    assert load_profile(save_profile(prof, tmp_path / "p.json")) == prof


def test_a_probe_without_the_cpu_tensor_device_step_never_runs_it(monkeypatch, tmp_path):
    """cpu_device_ops=False (the quick probe for CUDA parameters): no device-op probe, no numba device-op compile;
    the profile says so (cpu_device None), and saves and loads."""
    monkeypatch.setattr(probes, "measure_cpu_device_ops", lambda **kw: pytest.fail("must not measure"))
    prof = probe_machine(dataclasses.replace(TINY, cpu_device_ops=False))
    assert prof.cpu_device is None and "cpu_device_ops" not in prof.durations and "device_ops" not in prof.repeats
    assert load_profile(save_profile(prof, tmp_path / "p.json")) == prof


@pytest.mark.gpu
def test_pcie_and_gpu_probes_measure_the_device():
    device = torch.device("cuda", torch.cuda.current_device())
    h2d, d2h = probes.measure_pcie([MiB, 4 * MiB], device=device, repeats=2)
    assert h2d.kind == "pcie-h2d" and d2h.kind == "pcie-d2h"
    assert h2d.peak > 1e8 and d2h.peak > 1e8
    name, total, free, bw = probes.measure_gpu_memory(device, nbytes=8 * MiB, repeats=2)
    assert name and 0 < free <= total and bw > 1e9


@pytest.mark.gpu
def test_probe_machine_with_a_gpu(tiny_profile):
    assert tiny_profile.gpu is not None and tiny_profile.gpu_unavailable is None
    assert {"PCIe H2D 64 KiB", "PCIe D2H 1 MiB", "device copy"} <= set(tiny_profile.spread)
    assert not tiny_profile.machine_key.endswith("__nogpu")


def test_spread_is_the_median_repeat_over_the_best():
    assert timing.spread_of([1.0, 1.1, 2.0]) == pytest.approx(0.1)
    assert timing.spread_of([2.0, 2.0]) == 0.0
    # The slowest repeat does not decide it: more repeats on a calm machine must not read as noisier.
    assert timing.spread_of([1.0, 1.0, 1.0, 1.0, 9.0]) == 0.0


def test_every_figure_records_its_spread_and_the_repeats(tiny_profile):
    prof = tiny_profile
    assert prof.repeats == {"copy": TINY.copy_repeats, "host_adamw": TINY.adamw_repeats, "device_ops": 2,
                            "host_add": 5}
    names = set(prof.spread)
    assert {"memcpy 64 KiB", "memcpy 1 MiB", "device pass", "device pass without acc", "device pass + Adam",
            "device merge"} <= names
    threads = {t for tab in prof.cpu_adamw.rates.values() for t in tab}
    assert {f"host AdamW {dt} {t} threads" for dt in ("float32", "bfloat16") for t in threads} <= names
    assert {f"host add {dt} {t} threads 256 KiB" for dt in ("float32", "bfloat16") for t in threads} <= names
    assert prof.host_add is not None and set(prof.host_add.curves["float32"]) == threads
    assert prof.cpu_device.pass_no_acc_rate > 0
    assert 0 <= prof.durations["compile_add"] <= prof.durations["host_add"]
    assert all(v >= 0 for v in prof.spread.values()) and prof.noise is not None
    assert 0 <= prof.durations["compile"] <= prof.durations["host_adamw"]
    assert prof.load_average is None or prof.load_average >= 0


def test_interleaved_repeats_run_every_function_each_round():
    calls: list[str] = []
    times = timing.interleaved([lambda: calls.append("a"), lambda: calls.append("b")], repeats=3)
    assert calls == ["a", "b"] * 4  # one warm-up round, then three timed rounds
    assert [len(t) for t in times] == [3, 3]


def test_quick_and_full_say_what_they_measure():
    quick, full = ProbeSettings.quick_settings().describe(), ProbeSettings.full_settings().describe()
    assert quick.startswith("quick: copies at 3 sizes (1 MiB-64 MiB) x 3 repeats")
    assert full.startswith("full: copies at 6 sizes (256 KiB-256 MiB) x 5 repeats")
    assert "every thread count" in full and "x 5 repeats" in full and "x 3 repeats" in quick
