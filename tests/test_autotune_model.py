"""The cost model and chooser on synthetic profiles: formulas, choice rules and their edge cases."""

from __future__ import annotations

import ast
import dataclasses
import math
import random
import re
from pathlib import Path

import pytest

from zenflow_triton import config
from zenflow_triton.autotune import chooser, model
from zenflow_triton.autotune.chooser import choose_threads, plan, stall_grid
from zenflow_triton.autotune.model import (
    ACC_BYTES,
    DEFAULT_SELECT_WINDOWS,
    Targets,
    Workload,
    predict,
    shapes_for_param_count,
)
from zenflow_triton.autotune.profile import BandwidthCurve, CpuAdamwRates, DeviceOpRates, GpuInfo, Profile
from zenflow_triton.autotune.quality import QualityTable
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


@pytest.mark.parametrize("n", [100, 4096, 421_000, 10_000_000, 125_000_000, 7_000_000_000])
def test_shapes_for_param_count_hold_exactly_the_count(n):
    shapes = shapes_for_param_count(n)
    assert sum(r * c for r, c in shapes) == n
    assert shapes[0] == ((4096, 4096) if n >= 4096 * 4096 else shapes[0])


@pytest.mark.parametrize(("n", "text"), [(421_000, "421k"), (418_000, "418k"), (10e6, "10M"), (125e6, "125M"),
                                         (1.3e9, "1.3B"), (7e9, "7B"), (999.9e6, "1B"), (12, "12"), (1e12, "1T")])
def test_human_counts(n, text):
    assert model.format_count(n) == text


def test_human_seconds():
    assert [model.format_seconds(x) for x in (2.5, 0.5, 0.0123, 4.2e-5, 0.0)] == ["2.50 s", "500 ms", "12.3 ms",
                                                                                   "42 us", "0 s"]


def test_shapes_for_param_count_covers_the_count():
    shapes = shapes_for_param_count(40_000_000)
    assert shapes[0] == (4096, 4096)
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
    assert p.step_s == pytest.approx(0.02 + dev + p.stall_s / 4)


def test_without_the_host_snapshot_the_fp32_master_makes_the_trip_back():
    """host_snapshot=False: 4 bytes per element cross PCIe instead of 2, and the merge reads them (4 + 2 bytes where
    it read 2 + 2); nothing else changes."""
    import dataclasses

    prof = make_profile(cpu_rate=1e9, pcie=20 * GB, overhead=1e-4)
    w = make_workload(params=4096 * 4096 * 10, step=0.02)
    lean = dataclasses.replace(w, host_snapshot=False)
    a = predict(prof, w, topk_ratio=0.25, update_interval=4, cpu_threads=15)
    b = predict(prof, lean, topk_ratio=0.25, update_interval=4, cpu_threads=15)
    n = w.numel
    assert b.h2d_s == pytest.approx(n * 4 / 20e9 + 1.5 * n / (3000e9 / 4))
    assert b.h2d_s - a.h2d_s == pytest.approx(n * 2 / 20e9 + 0.5 * n / (3000e9 / 4))
    assert (b.cpu_s, b.d2h_s, b.device_step_s) == (a.cpu_s, a.d2h_s, a.device_step_s)


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


def test_overlap_steps_gives_each_job_that_many_steps_to_hide_in():
    prof, w = make_profile(), make_workload()
    full = predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=15)
    assert predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=15, overlap_steps=4) == full
    one = predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=15, overlap_steps=1)
    step = w.step_time_s + one.device_step_s
    s = one.select_interval // 4  # windows per selection: one flush (the job had one step) and s - 1 regular waits
    assert one.job_s == full.job_s and one.job_s > step  # this profile's job outlasts one step
    assert one.wait_s == pytest.approx(max(0.0, one.job_s - step))  # the regular waits are the flush's now
    assert full.wait_s == pytest.approx(((s - 1) * max(0.0, full.job_s - 4 * step) + (full.job_s - step)) / s)
    assert one.wait_s > full.wait_s
    for bad in (0, 5):
        with pytest.raises(ValueError, match="overlap_steps"):
            predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=15, overlap_steps=bad)
    # plan() then only considers windows at least that long.
    assert plan(prof, w, overlap_steps=3).update_interval >= 3


@pytest.mark.parametrize("step", [0.05, 0.5, 5.0])
def test_auto_overlap_steps_is_the_fewest_that_cost_no_speed(step: float):
    prof, w = make_profile(), make_workload(step=step)
    chosen = plan(prof, w, topk_ratio=0.1, update_interval=4, overlap_steps="auto")
    k = chosen.overlap_steps
    assert k is not None and 1 <= k <= 4 and chosen.prediction.update_interval == 4
    base = predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=chosen.cpu_threads)
    tol = Targets().speed_tolerance

    def step_s(kk: int) -> float:
        return predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=chosen.cpu_threads,
                       overlap_steps=kk).step_s

    assert step_s(k) <= base.step_s * (1 + tol) and all(step_s(j) > base.step_s * (1 + tol) for j in range(1, k))
    assert chosen.predicted_step_s == pytest.approx(step_s(k))  # the plan's figures are K's
    assert f"overlap_steps={k}" in chosen.reason
    assert chosen.config_fields()["overlap_steps"] == k == chosen.summary()["overlap_steps"]
    # A long model step hides the whole job in one step; a short one needs the whole window.
    if step == 5.0:
        assert k == 1
    if step == 0.05:
        assert k == 4
    assert plan(prof, w, topk_ratio=0.1, update_interval=4, overlap=False, overlap_steps="auto").overlap_steps is None
    assert plan(prof, w, topk_ratio=0.1, update_interval=4).overlap_steps is None


def test_predict_validates_its_arguments():
    prof, w = make_profile(), make_workload()
    with pytest.raises(ValueError, match="multiple"):
        predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=1, select_interval=6)
    with pytest.raises(ValueError):
        predict(prof, w, topk_ratio=1.5, update_interval=4, cpu_threads=1)
    with pytest.raises(ValueError):
        Workload(shapes=((4, 4),), step_time_s=0.0)


# ------------------------------------------------------------------------------------------- choice

RS = (0.02, 0.05, 0.1, 0.25, 0.5)
US = (1, 2, 4, 8, 16)


def make_quality(scale: float = 0.01) -> QualityTable:
    """Loss ratio 1 + scale * (1 + log2 U) * sqrt(0.1 / r): worse with longer windows and smaller ratios."""
    ratios = tuple(tuple((1 + scale * (1 + math.log2(u)) * math.sqrt(0.1 / r),) for u in US) for r in RS)
    return QualityTable(topk_ratios=RS, update_intervals=US, ratios=ratios, source="synthetic")


Q = make_quality()


def candidates(prof: Profile, w: Workload, result, targets: Targets, quality: QualityTable = Q):
    """Every (r, U) the chooser could have taken, with its prediction and predicted loss."""
    for r in (*chooser._RATIO_STEPS, *quality.topk_ratios):
        if r < targets.min_topk_ratio or (w.memory_budget_bytes is not None
                                          and w.numel * (ACC_BYTES + 12 * r) > w.memory_budget_bytes):
            continue
        for u in range(1, targets.max_update_interval + 1):
            yield predict(prof, w, topk_ratio=r, update_interval=u, cpu_threads=result.cpu_threads), \
                quality.predict(r, u)


def assert_fastest_within_budget(prof: Profile, w: Workload, result, targets: Targets | None = None) -> None:
    """The choice meets the loss budget, and no setting within it is faster by more than the speed tolerance."""
    targets = targets or Targets()
    assert result.loss_budget_met
    assert result.predicted_loss_ratio <= targets.max_loss_ratio
    for pred, loss in candidates(prof, w, result, targets):
        if loss is not None and loss <= targets.max_loss_ratio:
            assert pred.step_s >= result.predicted_step_s / (1 + targets.speed_tolerance) - 1e-12, \
                (pred.topk_ratio, pred.update_interval)


def test_the_choice_is_the_fastest_setting_within_the_loss_budget():
    prof = make_profile(cpu_rate=1e9, pcie=50 * GB)
    w = make_workload(params=7e9, step=1.0, budget=None)
    result = plan(prof, w, quality=Q)
    assert_fastest_within_budget(prof, w, result)
    assert result.predicted_loss_ratio == pytest.approx(Q.predict(result.topk_ratio, result.update_interval))
    assert result.hides_host_work
    # A looser budget never makes the predicted step slower, nor a tighter one the predicted loss worse.
    loose = plan(prof, w, quality=Q, targets=Targets(max_loss_ratio=1.2))
    tight = plan(prof, w, quality=Q, targets=Targets(max_loss_ratio=1.02))
    assert loose.predicted_step_s <= result.predicted_step_s * 1.01
    assert tight.predicted_loss_ratio <= result.predicted_loss_ratio <= 1.05
    assert tight.loss_budget_met and "within the budget 1.02" in tight.reason


def test_equal_speeds_go_to_the_lower_loss():
    # A fast machine hides everything at any setting and the device-side Adam costs next to nothing: every point is
    # equally fast, so quality decides, and r = 1 (plain AdamW on the device) fits the memory.
    prof = make_profile(cpu_rate=1e12, pcie=1000 * GB, mem_bw=1e16)
    w = make_workload(params=1e8, step=1.0, budget=None)
    result = plan(prof, w, quality=Q)
    assert (result.topk_ratio, result.update_interval) == (1.0, 1)
    assert result.predicted_loss_ratio == 1.0 and result.predicted_stall_s == 0.0
    ZenFlowConfig(**result.config_fields())  # expressible as config fields


def test_stall_that_no_setting_within_the_budget_hides_is_reported_not_traded_for_quality():
    # The memory holds r <= 0.1; within the loss budget that allows U <= 5, which cannot hide a 10 s host job
    # behind 2 s steps, while U = 14 would (at a worse loss).
    steep = make_quality(0.015)
    prof = make_profile(cpu_rate=6.3e8, cores=2, pcie=50 * GB)
    w = make_workload(params=7e9, step=2.0)
    result = plan(prof, w, quality=steep)
    assert result.loss_budget_met and result.predicted_loss_ratio <= 1.05  # the budget is kept
    assert not result.hides_host_work
    assert (result.topk_ratio, result.update_interval) == (0.1, 5)
    stall = f"expect {result.prediction.stall_fraction:.0%} stall"
    assert f"this machine cannot hide the host work at this quality: {stall}; raise --max-loss-ratio" in result.reason
    # The hint is true: the setting it names hides the host work, faster, at the loss it states.
    r, u, loss = re.search(r"\(topk_ratio=([\d.]+), update_interval=(\d+): ([\d.]+)x AdamW", result.reason).groups()
    alt = predict(prof, w, topk_ratio=float(r), update_interval=int(u), cpu_threads=result.cpu_threads)
    assert alt.stall_fraction <= 0.05 and alt.step_s < result.predicted_step_s
    assert float(loss) == pytest.approx(steep.predict(float(r), int(u)), abs=5e-4) and float(loss) > 1.05
    looser = Targets(max_loss_ratio=steep.predict(float(r), int(u)))
    assert plan(prof, w, quality=steep, targets=looser).hides_host_work


def test_stall_that_nothing_in_the_table_hides_says_so():
    prof = make_profile(cpu_rate=1e7, cores=2, pcie=50 * GB)
    w = make_workload(params=7e9, step=0.1)
    result = plan(prof, w, quality=Q, relax_hint="HINT")
    assert not result.hides_host_work and result.loss_budget_met
    assert "cannot hide the host work within the bounds and the quality table's range" in result.reason
    assert "HINT" not in result.reason


def test_an_impossible_loss_budget_gives_the_lowest_loss_and_says_so():
    # The memory holds at most r = 0.2, and the budget asks for AdamW's own loss.
    w = make_workload(params=1e9, step=1.0, budget=1e9 * (ACC_BYTES + 12 * 0.2))
    result = plan(make_profile(), w, quality=Q, targets=Targets(max_loss_ratio=1.0))
    assert not result.loss_budget_met
    assert result.topk_ratio == 0.2 and result.update_interval == 1
    assert result.predicted_loss_ratio == pytest.approx(Q.predict(0.2, 1))
    assert "no setting within the bounds meets the loss budget 1" in result.reason
    assert "memory budget" in result.reason


@pytest.mark.parametrize(("bounds", "check"), [
    (dict(max_update_interval=2), lambda p: p.update_interval <= 2),
    (dict(min_topk_ratio=0.3), lambda p: p.topk_ratio >= 0.3),
    (dict(max_update_interval=3, min_topk_ratio=0.07), lambda p: p.update_interval <= 3 and p.topk_ratio >= 0.07),
])
def test_bounds_restrict_the_choice(bounds, check):
    prof = make_profile(cpu_rate=2e9, pcie=50 * GB, mem_bw=300 * GB)  # the device-side Adam matters
    w = make_workload(params=1e9, step=0.2, budget=None)
    free = plan(prof, w, quality=Q)
    assert not check(free)  # the bound binds
    targets = Targets(**bounds)
    bounded = plan(prof, w, quality=Q, targets=targets)
    assert check(bounded) and bounded.loss_budget_met
    assert_fastest_within_budget(prof, w, bounded, targets)


def test_nothing_outside_the_quality_table_is_chosen_while_something_inside_exists():
    prof = make_profile(cpu_rate=1e8, cores=2, pcie=50 * GB)
    w = make_workload(params=7e9, step=0.05, budget=None)
    result = plan(prof, w, quality=Q)
    assert Q.covers(result.topk_ratio, result.update_interval)
    assert result.update_interval <= US[-1]


def test_memory_bound_machine_keeps_the_ratio_within_the_budget():
    w = make_workload(params=1e9, step=1.0, budget=1e9 * (ACC_BYTES + 12 * 0.0537))
    result = plan(make_profile(mem_bw=1e15), w, quality=Q, targets=Targets(max_loss_ratio=1.2))
    assert result.topk_ratio <= 0.053
    assert result.prediction.device_bytes <= w.memory_budget_bytes
    assert "topk_ratio at most 0.053: the device memory budget" in result.reason


def test_budget_below_the_accumulator_gives_ratio_zero_and_says_so():
    w = make_workload(params=1e9, step=1.0, budget=1e9)
    result = plan(make_profile(), w, quality=Q)
    assert result.topk_ratio == 0.0
    assert result.predicted_loss_ratio is None and not result.loss_budget_met
    assert "out-of-memory" in result.reason and "loss is unknown" in result.reason


def test_no_gpu_profile_plans_for_cpu_tensors_and_refuses_cuda():
    prof = make_profile(gpu=False)
    result = plan(prof, make_workload(params=5e7, step=0.2, device="cpu"), quality=Q)
    assert result.update_interval >= 1
    assert "CPU tensors" in result.reason and "memcpy" in result.reason
    with pytest.raises(ValueError, match="no GPU figures"):
        plan(prof, make_workload(device="cuda"), quality=Q)


def test_fixed_values_are_kept_and_select_interval_restricts_u():
    prof = make_profile(cpu_rate=2e8)
    w = make_workload(params=7e9, step=1.0)
    fixed = plan(prof, w, topk_ratio=0.2, update_interval=3, cpu_threads=2, quality=Q)
    assert (fixed.topk_ratio, fixed.update_interval, fixed.cpu_threads) == (0.2, 3, 2)
    assert "topk_ratio and update_interval fixed by the caller" in fixed.reason
    assert "cpu_threads=2: fixed by the caller" in fixed.reason
    assert fixed.predicted_loss_ratio == pytest.approx(Q.predict(0.2, 3))
    restricted = plan(prof, w, select_interval=60, quality=Q)
    assert 60 % restricted.update_interval == 0
    assert restricted.prediction.select_interval == 60
    outside = plan(prof, w, topk_ratio=0.01, quality=Q)
    assert outside.predicted_loss_ratio is None and "loss is unknown" in outside.reason


def test_the_stall_includes_the_copies_everywhere_it_is_shown():
    # PCIe-bound: the host job hides but the copies do not, which is the case the old output got wrong (a
    # predicted stall of 0.0 beside a reason counting the copies).
    prof = make_profile(cpu_rate=1e11, pcie=2 * GB)
    w = make_workload(params=1e9, step=0.5)
    result = plan(prof, w, quality=Q)
    pred = result.prediction
    assert pred.copy_s > 0
    assert result.predicted_stall_s == pytest.approx(pred.wait_s + pred.copy_s) == pytest.approx(pred.stall_s)
    assert result.predicted_wait_s == pred.wait_s and result.predicted_copy_s == pred.copy_s
    s = result.summary()
    assert s["predicted_stall_per_window_s"] == result.predicted_stall_s
    assert s["predicted_stall_fraction"] == pytest.approx(result.predicted_stall_s / (result.update_interval * 0.5))
    per_step = 0.5 + pred.device_step_s + pred.stall_s / pred.update_interval
    assert s["predicted_time_per_step_s"] == pytest.approx(per_step)
    assert f"{model.format_seconds(pred.stall_s / pred.update_interval)} stall" in result.reason
    assert f"({pred.stall_fraction:.1%} of the model step)" in result.reason


def test_the_reason_is_a_few_short_lines():
    prof = make_profile(cpu_rate=2e8, cores=2)
    result = plan(prof, make_workload(params=7e9, step=0.5, budget=None), quality=Q)
    lines = result.reason.splitlines()
    assert 3 <= len(lines) <= 8
    assert all(len(line) <= 200 for line in lines), lines
    assert result.headline().startswith(f"topk_ratio={result.topk_ratio:g} update_interval=")


def test_threads_leave_a_core_for_training():
    assert choose_threads(make_profile(cores=16), "float32") == 15
    assert choose_threads(make_profile(cores=1), "float32") == 1
    # On CUDA two: autograd's device thread launches the backward's kernels beside the training thread.
    assert choose_threads(make_profile(cores=16), "float32", device="cuda") == 14
    assert choose_threads(make_profile(cores=2), "float32", device="cuda") == 1
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
def test_a_faster_cpu_never_makes_the_chosen_step_slower(seed):
    rng = random.Random(seed)
    base = dict(pcie=rng.uniform(1, 60) * GB, cores=rng.choice([2, 4, 16, 64]), mem_bw=rng.uniform(200, 5000) * GB,
                overhead=rng.uniform(0, 1e-3))
    w = make_workload(params=rng.uniform(1e7, 2e10), step=rng.uniform(0.01, 3.0),
                      budget=rng.choice([None, rng.uniform(10, 200) * 2**30]))
    previous = None
    for rate in sorted(rng.uniform(1e7, 1e11) for _ in range(8)):
        result = plan(make_profile(cpu_rate=rate, **base), w, quality=Q)
        if previous is not None and result.loss_budget_met and previous.loss_budget_met:
            # The fastest feasible step can only get faster; the choice is within the tolerance of it.
            assert result.predicted_step_s <= previous.predicted_step_s * 1.01 + 1e-12, (rate, result, previous)
        previous = result


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


@pytest.mark.parametrize("module", [model, chooser], ids=["model", "chooser"])
def test_the_model_imports_nothing_outside_the_autotuner(module):
    tree = ast.parse(Path(module.__file__).read_text())
    absolute = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    absolute |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    assert not {m for m in absolute if m and m.split(".")[0] == "zenflow_triton"}


def test_a_choice_of_r_1_says_it_is_plain_adamw_and_what_offloading_would_have_saved():
    from autotune_profiles import synthetic_profile

    # 1M parameters behind a 1 s model step: offloading saves far less than the 1% tie, so the lower loss wins.
    w = Workload(shapes=shapes_for_param_count(1_000_000), step_time_s=1.0, param_bytes=4, device="cpu")
    p = plan(synthetic_profile(), w)
    assert (p.topk_ratio, p.update_interval, p.predicted_loss_ratio) == (1.0, 1, 1.0)
    lines = p.reason.splitlines()
    what = next(line for line in lines if line.startswith("topk_ratio=1 means no offloading"))
    assert "plain AdamW" in what and "update_interval" in what
    why = next(line for line in lines if line.startswith("why no offloading"))
    best = min((predict(synthetic_profile(), w, topk_ratio=r, update_interval=u, cpu_threads=p.cpu_threads)
                for r in (0.5, 0.25) for u in (1, 2, 4)), key=lambda q: q.step_s)
    assert best.step_s > p.predicted_step_s * (1 - 0.01)  # the saving is within the tie (checked independently)
    assert "within the 1% tie" in why
    assert all(len(line) <= 200 for line in lines), lines
    # An offloading choice carries no such line.
    big = plan(synthetic_profile(), Workload(shapes=shapes_for_param_count(10_000_000), step_time_s=0.5, device="cpu"))
    assert big.topk_ratio < 1 and "no offloading" not in big.reason


def test_the_host_lr_scale_is_taken_only_where_the_table_measured_a_gain():
    from zenflow_triton.autotune.quality import HostScaleEntry

    prof = make_profile()
    w = make_workload(params=1e9, step=0.5)
    base = plan(prof, w, quality=Q, topk_ratio=0.1, update_interval=4)
    assert base.host_lr_scale == 1.0 and "host_lr_scale" not in base.reason
    helps = HostScaleEntry(topk_ratio=0.1, update_interval=4, overlap=True, host_lr_scale=2.0,
                           ratio=(0.99, 0.98, 0.995), stable=True)
    worse = HostScaleEntry(topk_ratio=0.1, update_interval=4, overlap=False, host_lr_scale=2.0,
                           ratio=(0.97, 1.02, 0.99), stable=True)
    table = dataclasses.replace(Q, host_scales=(helps, worse))
    chosen = plan(prof, w, quality=table, topk_ratio=0.1, update_interval=4)
    assert chosen.host_lr_scale == 2.0
    assert chosen.summary()["host_lr_scale"] == 2.0 and chosen.config_fields()["host_lr_scale"] == 2.0
    assert "host_lr_scale=2: best loss 0.990/0.980/0.995 of Adam's host step's" in chosen.reason
    # The budget is judged on Adam's step's prediction, an upper bound: the scale changes no other choice.
    assert chosen.predicted_loss_ratio == base.predicted_loss_ratio
    seq = plan(prof, w, quality=table, topk_ratio=0.1, update_interval=4, overlap=False)
    assert seq.host_lr_scale == 1.0
    assert "no measured scale was better on every task here (s=2: best 0.970/1.020/0.990)" in seq.reason
    assert plan(prof, w, quality=table, topk_ratio=0.1, update_interval=8).host_lr_scale == 1.0  # not measured
    fixed = plan(prof, w, quality=table, topk_ratio=0.1, update_interval=4, host_lr_scale=1.0)
    assert fixed.host_lr_scale == 1.0
    assert plan(prof, w, quality=table, host_lr_scale=3.0).host_lr_scale == 3.0
