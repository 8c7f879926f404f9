"""The cost model and chooser on synthetic profiles: formulas, choice rules and their edge cases."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from zenflow_triton import config
from zenflow_triton.autotune import model
from zenflow_triton.autotune.model import (
    ACC_BYTES,
    DEFAULT_SELECT_WINDOWS,
    Targets,
    Workload,
    choose_threads,
    plan,
    predict,
    shapes_for_param_count,
    stall_grid,
)
from zenflow_triton.autotune.profile import BandwidthCurve, CpuAdamwRates, DeviceOpRates, GpuInfo, Profile
from zenflow_triton.config import ZenFlowConfig

GB = 1e9


def flat(kind: str, bw: float) -> BandwidthCurve:
    """A bandwidth curve that does not depend on size."""
    return BandwidthCurve(kind=kind, points=((1 << 20, bw), (256 << 20, bw)))


def make_profile(
    *,
    cpu_rate: float = 2e9,
    cores: int = 16,
    pcie: float = 25 * GB,
    memcpy: float = 10 * GB,
    gpu: bool = True,
    mem_bw: float = 3000 * GB,
    free: float = 80 * 2**30,
    overhead: float = 0.0,
    cpu_device: tuple[float, float, float] = (1e9, 2e8, 1e9),
) -> Profile:
    """A machine whose host AdamW scales linearly with threads up to ``cpu_rate`` at ``cores - 1``."""
    per_thread = cpu_rate / max(1, cores - 1)
    rates = {t: per_thread * min(t, max(1, cores - 1)) for t in range(1, cores + 1)}
    return Profile(
        machine_key="test__cpu__gpu",
        hostname="test",
        cpu_model="Test CPU",
        cpu_cores=cores,
        llc_bytes=32 << 20,
        cpu_adamw=CpuAdamwRates(kernel="numba", numel=16 << 20, rates={"float32": rates, "bfloat16": dict(rates)},
                                call_overhead_s={t: overhead for t in rates}),
        memcpy=flat("memcpy", memcpy),
        cpu_device=DeviceOpRates(source="synthetic", pass_rate=cpu_device[0], adam_rate=cpu_device[1],
                                 merge_rate=cpu_device[2]),
        gpu=GpuInfo(name="Test GPU", total_bytes=int(96 * 2**30), free_bytes=int(free), mem_bandwidth=mem_bw,
                    h2d=flat("pcie-h2d", pcie), d2h=flat("pcie-d2h", pcie)) if gpu else None,
        gpu_unavailable=None if gpu else "no CUDA (synthetic)",
    )


def make_workload(params: float = 1e9, step: float = 0.5, *, budget: float | None | str = "r=0.1",
                  device: str = "cuda", grad_dtype: str = "float32") -> Workload:
    """By default the device memory holds the accumulator and a tenth of the columns' state."""
    if budget == "r=0.1":
        budget = params * (ACC_BYTES + 12 * 0.1) if device == "cuda" else None
    return Workload(shapes=shapes_for_param_count(int(params)), step_time_s=step, param_bytes=2,
                    grad_dtype=grad_dtype, device=device, memory_budget_bytes=budget)


# ------------------------------------------------------------------------------------------- shapes


def test_shapes_for_param_count_covers_the_count():
    shapes = shapes_for_param_count(40_000_000)
    assert shapes[0] == (4096, 4096)
    assert sum(r * c for r, c in shapes) == pytest.approx(40_000_000, rel=1e-3)
    assert shapes_for_param_count(100) == ((1, 100),)
    with pytest.raises(ValueError):
        shapes_for_param_count(0)


# ------------------------------------------------------------------------------------------ predict


def test_predict_matches_the_formulas_on_cuda():
    prof = make_profile(cpu_rate=1e9, pcie=20 * GB, overhead=1e-4)
    w = make_workload(params=4096 * 4096 * 10, step=0.02)
    p = predict(prof, w, topk_ratio=0.25, update_interval=4, cpu_threads=15)
    n = w.numel
    assert p.cpu_s == pytest.approx(10 * 1e-4 + 0.75 * n / 1e9)
    assert p.d2h_s == pytest.approx(n * 4 / 20e9)  # fp32 landing, whole tensors
    assert p.h2d_s == pytest.approx(n * 2 / 20e9 + n / (3000e9 / 4))  # bf16 snapshot over PCIe, then the merge
    assert p.host_s == pytest.approx(p.cpu_s + p.d2h_s + p.h2d_s)  # the host time
    assert p.job_s == pytest.approx(p.cpu_s + p.d2h_s)  # the worker waits for the D2H first
    assert p.copy_s == pytest.approx(p.h2d_s + max(0.0, p.d2h_s - 0.02))
    dev = n / (3000e9 / 10) + 0.25 * n / (3000e9 / 26)
    assert p.device_step_s == pytest.approx(dev)
    regular = max(0.0, p.job_s - 4 * (0.02 + dev))
    flush = max(0.0, p.job_s - (0.02 + dev))  # a flush every 8 windows exposes a job one step after its start
    assert regular > 0
    assert p.wait_s == pytest.approx((7 * regular + flush) / 8)
    assert p.stall_s == pytest.approx(p.wait_s + p.copy_s)
    assert p.device_bytes == pytest.approx(n * (ACC_BYTES + 12 * 0.25))
    assert p.stall_fraction == pytest.approx(p.stall_s / (4 * 0.02))


def test_predict_on_cpu_tensors_uses_memcpy_and_exposes_both_copies():
    prof = make_profile(gpu=False, memcpy=5 * GB, cpu_device=(1e9, 2e8, 4e8))
    w = make_workload(params=1e7, step=0.1, device="cpu")
    p = predict(prof, w, topk_ratio=0.1, update_interval=2, cpu_threads=4)
    assert p.d2h_s == pytest.approx(w.numel * 4 / 5e9)
    assert p.h2d_s == pytest.approx(w.numel / 4e8)  # the merge reads host memory directly
    assert p.copy_s == pytest.approx(p.d2h_s + p.h2d_s)
    assert p.job_s == pytest.approx(p.cpu_s)


def test_overlap_false_waits_for_every_job_and_topk_one_has_no_host_work():
    prof = make_profile()
    w = make_workload()
    p = predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=15, overlap=False)
    assert p.wait_s == pytest.approx(p.job_s)
    full = predict(prof, w, topk_ratio=1.0, update_interval=1, cpu_threads=15)
    assert full.cpu_s == full.copy_s == full.stall_s == 0.0


def test_predict_validates_its_arguments():
    prof, w = make_profile(), make_workload()
    with pytest.raises(ValueError, match="multiple"):
        predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=1, select_interval=6)
    with pytest.raises(ValueError):
        predict(prof, w, topk_ratio=1.5, update_interval=4, cpu_threads=1)
    with pytest.raises(ValueError):
        Workload(shapes=((4, 4),), step_time_s=0.0)


# ------------------------------------------------------------------------------------------- choice


def _assert_smallest(prof: Profile, w: Workload, result, target: float = 0.05) -> None:
    """The chosen U meets the target and U - 1 does not."""
    assert result.target_met
    assert result.prediction.stall_fraction <= target
    if result.update_interval > 1:
        worse = predict(prof, w, topk_ratio=result.topk_ratio, update_interval=result.update_interval - 1,
                        cpu_threads=result.cpu_threads)
        assert worse.stall_fraction > target


def test_cpu_bound_machine_gets_a_long_window():
    prof = make_profile(cpu_rate=1e9, pcie=50 * GB)
    w = make_workload(params=7e9, step=1.0)
    result = plan(prof, w)
    _assert_smallest(prof, w, result)
    assert result.prediction.cpu_s > 10 * result.prediction.copy_s
    assert result.update_interval >= 8


def test_pcie_bound_machine_is_limited_by_copies_not_by_the_cpu():
    prof = make_profile(cpu_rate=1e11, pcie=5 * GB)
    w = make_workload(params=1e9, step=0.5)
    result = plan(prof, w)
    _assert_smallest(prof, w, result)
    pred = result.prediction
    assert pred.copy_s > pred.wait_s
    assert result.update_interval >= 8
    # A yet faster CPU changes nothing: the copies decide.
    faster = plan(make_profile(cpu_rate=1e12, pcie=5 * GB), w)
    assert faster.update_interval == result.update_interval


def test_memory_bound_machine_gets_the_largest_ratio_that_fits():
    w = make_workload(params=1e9, step=1.0, budget=1e9 * (ACC_BYTES + 12 * 0.0537))
    prof = make_profile(mem_bw=1e15)  # device time never binds
    result = plan(prof, w)
    assert result.topk_ratio == pytest.approx(0.053)
    assert result.prediction.device_bytes <= w.memory_budget_bytes
    assert "memory budget" in result.reason


def test_budget_below_the_accumulator_gives_ratio_zero_and_says_so():
    w = make_workload(params=1e9, step=1.0, budget=1e9)
    result = plan(make_profile(), w)
    assert result.topk_ratio == 0.0
    assert "out-of-memory" in result.reason


def test_device_time_limits_the_ratio():
    prof = make_profile(mem_bw=100 * GB)  # adam_rate = 100e9 / 26 elements/s
    w = make_workload(params=1e9, step=0.5, budget=None)
    result = plan(prof, w)
    limit = 0.05 * 0.5 * (100e9 / 26) / 1e9
    assert 0.9 * limit <= result.topk_ratio <= limit
    assert "device-side Adam" in result.reason


def test_tiny_model_updates_everything_on_the_device_every_step():
    prof = make_profile()
    w = Workload(shapes=((64, 64),), step_time_s=0.01, device="cuda", memory_budget_bytes=1e9)
    result = plan(prof, w)
    assert result.topk_ratio == 1.0
    assert result.update_interval == 1
    assert result.predicted_stall_s == 0.0
    ZenFlowConfig(**result.config_fields())  # expressible as config fields


def test_no_gpu_profile_plans_for_cpu_tensors_and_refuses_cuda():
    prof = make_profile(gpu=False)
    result = plan(prof, make_workload(params=5e7, step=0.2, device="cpu"))
    assert result.update_interval >= 1
    assert "CPU tensors" in result.reason and "memcpy" in result.reason
    with pytest.raises(ValueError, match="no GPU figures"):
        plan(prof, make_workload(device="cuda"))


def test_unreachable_target_picks_the_least_stall_and_says_so():
    prof = make_profile(pcie=0.01 * GB)
    w = make_workload(params=1e9, step=0.01)
    result = plan(prof, w, targets=Targets(max_update_interval=8))
    assert not result.target_met
    assert result.update_interval == 8
    assert "no U up to 8" in result.reason


def test_fixed_values_are_kept_and_select_interval_restricts_u():
    prof = make_profile(cpu_rate=2e8)
    w = make_workload(params=7e9, step=1.0)
    fixed = plan(prof, w, topk_ratio=0.2, update_interval=3, cpu_threads=2)
    assert (fixed.topk_ratio, fixed.update_interval, fixed.cpu_threads) == (0.2, 3, 2)
    assert fixed.reason.count("fixed by the caller") == 3
    restricted = plan(prof, w, select_interval=60)
    assert 60 % restricted.update_interval == 0
    assert restricted.prediction.select_interval == 60


def test_threads_leave_a_core_for_training():
    assert choose_threads(make_profile(cores=16), "float32") == 15
    assert choose_threads(make_profile(cores=1), "float32") == 1
    # Memory-bound: the best rate wins; the fewest threads among equals.
    prof = make_profile(cores=8)
    table = {1: 1e8, 2: 2e8, 3: 3e8, 4: 3e8, 5: 2.9e8, 6: 2.8e8, 7: 2.8e8, 8: 5e8}
    prof = Profile(**{**prof.__dict__, "cpu_adamw": CpuAdamwRates(
        kernel="numba", numel=1, rates={"float32": table}, call_overhead_s={1: 0.0})})
    assert choose_threads(prof, "float32") == 3


def test_bf16_landing_moves_fewer_bytes():
    prof = make_profile(pcie=2 * GB)
    w32 = make_workload(params=1e9, grad_dtype="float32")
    w16 = make_workload(params=1e9, grad_dtype="bfloat16")
    p32 = predict(prof, w32, topk_ratio=0.1, update_interval=4, cpu_threads=15)
    p16 = predict(prof, w16, topk_ratio=0.1, update_interval=4, cpu_threads=15)
    assert p16.d2h_s == pytest.approx(p32.d2h_s / 2)


@pytest.mark.parametrize("seed", range(6))
def test_a_faster_cpu_never_raises_the_chosen_interval(seed):
    rng = random.Random(seed)
    base = dict(pcie=rng.uniform(1, 60) * GB, cores=rng.choice([2, 4, 16, 64]), mem_bw=rng.uniform(200, 5000) * GB,
                overhead=rng.uniform(0, 1e-3))
    w = make_workload(params=rng.uniform(1e7, 2e10), step=rng.uniform(0.01, 3.0),
                      budget=rng.choice([None, rng.uniform(10, 200) * 2**30]))
    previous = None
    for rate in sorted(rng.uniform(1e7, 1e11) for _ in range(12)):
        u = plan(make_profile(cpu_rate=rate, **base), w).update_interval
        if previous is not None:
            assert u <= previous, (rate, u, previous)
        previous = u


def test_stall_grid_matches_predict():
    prof, w = make_profile(cpu_rate=5e8), make_workload(params=2e9, step=0.3)
    grid = stall_grid(prof, w, update_intervals=[1, 4], topk_ratios=[0.0, 0.5], cpu_threads=15)
    assert grid[1][0] == pytest.approx(predict(prof, w, topk_ratio=0.5, update_interval=1,
                                               cpu_threads=15).stall_fraction)
    assert grid[0][0] >= grid[0][1]  # a longer window never stalls more per step here


# --------------------------------------------------------------------------------------------- purity


def test_the_models_default_select_windows_is_the_configs():
    # model.py may not import the config; its default (for bare-model callers) must still agree with it.
    assert DEFAULT_SELECT_WINDOWS == config.DEFAULT_SELECT_WINDOWS
    assert Targets().select_windows == config.DEFAULT_SELECT_WINDOWS


def test_the_model_imports_nothing_outside_the_autotuner():
    tree = ast.parse(Path(model.__file__).read_text())
    absolute = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    absolute |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    assert not {m for m in absolute if m and m.split(".")[0] == "zenflow_triton"}
