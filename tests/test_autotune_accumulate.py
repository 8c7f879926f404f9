"""The autotuner and accumulate="host": the step-time model's per-step copies and host adds, device and host bytes
per mode, the placement in the plan (reason, JSON, table) and the CLI's memory table. Synthetic profiles only."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from autotune_profiles import synthetic_profile, with_schema_3

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.autotune import __main__ as cli
from zenflow_triton.autotune.cache import save_profile
from zenflow_triton.autotune.chooser import plan, plan_accumulate
from zenflow_triton.autotune.model import (
    ACC_BYTES,
    DEFAULT_PLACEMENT_RATIO,
    Workload,
    device_bytes_per_param,
    host_add_bytes_per_s,
    host_add_seconds,
    host_assumptions,
    host_bytes_per_param,
    predict,
)
from zenflow_triton.autotune.placement import place_accumulation
from zenflow_triton.autotune.profile import BandwidthCurve
from zenflow_triton.config import ZenFlowConfig

SHAPES = ((4096, 4096),) * 4
N = 4 * 4096 * 4096
PCIE = 20e9
MEMCPY = 8e9  # the synthetic profile's memcpy peak


def gpu_profile(pcie: float = PCIE):
    prof = synthetic_profile(gpu=True, key="host__cpu__gpu")
    flat = ((1 << 20, pcie), (1 << 30, pcie))
    gpu = dataclasses.replace(prof.gpu, h2d=BandwidthCurve("pcie-h2d", flat), d2h=BandwidthCurve("pcie-d2h", flat))
    return dataclasses.replace(prof, gpu=gpu)


def workload(step: float = 0.05, *, device: str = "cuda", param_bytes: int = 2, grad_dtype: str = "float32",
             budget: float | None = None) -> Workload:
    return Workload(shapes=SHAPES, step_time_s=step, param_bytes=param_bytes, grad_dtype=grad_dtype, device=device,
                    memory_budget_bytes=budget)


def test_the_host_add_runs_at_twice_the_memcpy_peak():
    assert host_add_bytes_per_s(synthetic_profile()) == pytest.approx(2 * MEMCPY)


@pytest.mark.parametrize("step", [0.001, 0.05])
def test_host_prediction_on_cuda_matches_the_formulas(step):
    prof, w = gpu_profile(), workload(step)
    dev = predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=3)
    host = predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=3, accumulate="host")
    # Unchanged by default, and the same AdamW job and way back in both modes.
    assert dev == predict(prof, w, topk_ratio=0.1, update_interval=4, cpu_threads=3, accumulate="device")
    assert dev.accumulate == "device" and dev.add_s == 0 and host.accumulate == "host"
    assert host.cpu_s == dev.cpu_s and host.h2d_s == dev.h2d_s
    # "host"'s device pass is the fused step without acc: it reads the bf16 gradient only (2 B, not 2 + 8).
    bw = prof.gpu.mem_bandwidth
    assert dev.device_step_s == pytest.approx(N / (bw / 10) + 0.1 * N / (bw / 26))
    assert host.device_step_s == pytest.approx(N / (bw / 2) + 0.1 * N / (bw / 26))
    # A bf16 gradient lands as it is (2 B) every step; the add reads the fp32 sum and the slot, writes the sum.
    land = N * 2 / PCIE
    add = N * (2 * ACC_BYTES + 2) / (2 * MEMCPY)
    assert host.d2h_s == pytest.approx(4 * land) and host.add_s == pytest.approx(4 * add)
    assert host.job_s == pytest.approx(land + add + host.cpu_s)  # the last step's copy and add, then AdamW
    period = step + host.device_step_s
    assert host.copy_s == pytest.approx(host.h2d_s + 4 * max(0.0, max(land, add) - period))
    assert host.host_s == pytest.approx(host.cpu_s + host.d2h_s + host.h2d_s + host.add_s)
    assert host.stall_s == pytest.approx(host.wait_s + host.copy_s)
    assert dev.device_bytes == pytest.approx(N * (4 + 12 * 0.1)) and host.device_bytes == pytest.approx(N * 1.2)
    assert host.to_dict()["add_s"] == host.add_s and host.to_dict()["accumulate"] == "host"


def test_host_prediction_on_cpu_tensors_exposes_every_copy():
    prof = synthetic_profile()
    w = workload(0.5, device="cpu", param_bytes=4, grad_dtype="bfloat16")
    host = predict(prof, w, topk_ratio=0.1, update_interval=2, cpu_threads=3, accumulate="host")
    # grad_dtype="bfloat16" lands in bf16, by host memcpy on the training thread: the measured curve, per tensor.
    land = 4 * prof.memcpy.seconds(4096 * 4096 * 2)
    add = N * (8 + 2) / (2 * MEMCPY)
    assert host.d2h_s == pytest.approx(2 * land) and host.add_s == pytest.approx(2 * add)
    assert host.job_s == pytest.approx(add + host.cpu_s)
    assert host.copy_s == pytest.approx(host.h2d_s + 2 * (land + max(0.0, add - 0.5 - host.device_step_s)))
    # The synthetic profile predates schema 3: no pass without acc measured, so "host" is priced with the acc pass.
    dev = predict(prof, w, topk_ratio=0.1, update_interval=2, cpu_threads=3)
    assert host.device_step_s == dev.device_step_s


def test_measured_host_add_and_pass_without_acc_replace_the_assumptions():
    """A schema 3 profile: the add is timed on its measured curve at the landing dtype and the measured thread count
    at or below cpu_threads; the device pass of "host" on CPU tensors is the measured acc=None one."""
    w = workload(0.5, device="cpu", param_bytes=4, grad_dtype="bfloat16")
    prof = with_schema_3(synthetic_profile(), add_rate=30e9, no_acc_rate=2e9)
    host = predict(prof, w, topk_ratio=0.1, update_interval=2, cpu_threads=3, accumulate="host")
    per_step = 4 * (4096 * 4096 * (8 + 2)) / 30e9  # four calls, bf16 landing, at the 2-thread curve
    assert host_add_seconds(prof, SHAPES, 2, 3) == pytest.approx(per_step)
    assert host.add_s == pytest.approx(2 * per_step)
    assert host_add_seconds(prof, SHAPES, 2, 1) == pytest.approx(2 * per_step)  # the 1-thread curve
    assert host_add_seconds(prof, SHAPES, 4, 2) == pytest.approx(per_step * 12 / 10)  # fp32 landing, 12 B
    assert host.device_step_s == pytest.approx(N / 2e9 + 0.1 * N / prof.cpu_device.adam_rate)
    dev = predict(prof, w, topk_ratio=0.1, update_interval=2, cpu_threads=3)
    assert dev.device_step_s == pytest.approx(N / prof.cpu_device.pass_rate + 0.1 * N / prof.cpu_device.adam_rate)
    assert dev.add_s == 0


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_host_step_falls_as_the_measured_add_rate_rises(device):
    """Monotone: a faster measured add never makes "host"'s predicted step slower, and makes it faster while the add
    is what the step waits for; "device" does not depend on it."""
    base = gpu_profile() if device == "cuda" else synthetic_profile()
    w = workload(0.001, device=device)
    kw = dict(topk_ratio=0.1, update_interval=4, cpu_threads=2)
    rates = [1e8, 1e9, 4e9, 16e9, 64e9, 256e9]
    steps = [predict(with_schema_3(base, add_rate=a), w, accumulate="host", **kw).step_s for a in rates]
    assert all(b <= a for a, b in zip(steps, steps[1:])), steps
    assert steps[0] > steps[1] > steps[2]  # the add dominates at these rates
    devs = {predict(with_schema_3(base, add_rate=a), w, **kw).step_s for a in rates}
    assert len(devs) == 1


def test_a_plan_names_the_host_assumptions_when_the_profile_lacks_the_figures():
    old, new = synthetic_profile(), with_schema_3(synthetic_profile())
    w = workload(0.5, device="cpu", param_bytes=4)
    old_plan = plan(old, w, accumulate="host")
    assert "host adds ASSUMED at 16.0 GB/s, twice the measured memcpy peak" in old_plan.reason
    assert "priced at the with-acc fused step" in old_plan.reason
    new_plan = plan(new, w, accumulate="host")
    assert "ASSUMED" not in new_plan.reason and "with-acc" not in new_plan.reason
    assert new_plan.cpu_threads == 3  # the add was measured at 1 and 2 threads: the 2-thread curve stands for 3
    assert "host adds at the measured 16.0 GB/s peak (float32 landing, 2 threads, numba kernel)" in new_plan.reason
    # A "device" plan only shows "host" in its comparison line, and names the assumptions there.
    dev_plan = plan_accumulate(old, w)
    assert dev_plan.accumulate == "device" and dev_plan.reason.count("ASSUMED") == 1
    assert plan(old, w).reason.count("ASSUMED") == 0  # plan() in "device" mode says nothing of "host"
    host_plan = plan_accumulate(old, w, accumulate="host")
    assert host_plan.reason.count("ASSUMED") == 1  # said once, by the host plan itself
    # CUDA: the pass without acc is derived from the device bandwidth.
    gpu = plan(gpu_profile(), workload(0.5), accumulate="host", topk_ratio=0.1)
    assert "ASSUMED" in gpu.reason and "with-acc" not in gpu.reason


def test_no_offloading_has_no_per_step_copies_and_bad_modes_are_refused():
    prof, w = gpu_profile(), workload()
    full = predict(prof, w, topk_ratio=1.0, update_interval=1, cpu_threads=3, accumulate="host")
    assert full.d2h_s == full.add_s == full.copy_s == 0
    for bad in ("auto", "gpu"):
        with pytest.raises(ValueError, match="accumulate"):
            predict(prof, w, topk_ratio=0.1, update_interval=1, cpu_threads=3, accumulate=bad)
        with pytest.raises(ValueError, match="accumulate"):
            device_bytes_per_param(0.1, bad)
    with pytest.raises(ValueError, match="accumulate"):
        plan_accumulate(prof, w, accumulate="gpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", ["device", "host"])
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_bytes_per_param_are_what_the_optimizer_holds(dtype, accumulate, grad_dtype):
    # The oracle: the optimizer's own stats() on CPU tensors (its per-column vectors add under 0.1 B/param here).
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 128, bias=False).to(dtype)
    with ZenFlowAdamW(model.parameters(), accumulate=accumulate, topk_ratio=0.25, grad_dtype=grad_dtype,
                      warmup_steps=0) as opt:
        for _ in range(2):
            model(torch.randn(4, 64, dtype=dtype)).sum().backward()
            opt.step()
            opt.zero_grad()
        st = opt.stats()
    param_bytes = 4 if dtype == torch.float32 else 2
    assert st["accumulate"] == accumulate
    # accumulate="host" here: one window sum (overlap_steps="auto" is 1 on CPU tensors) and the landing ring, four
    # chunks of the whole gradient on a model this small.
    want = host_bytes_per_param(param_bytes, grad_dtype, accumulate, sums=1, shapes=((128, 64),))
    assert st["host_bytes_per_param"] == pytest.approx(want, abs=0.1)
    # Every dtype: a bf16 "host" holds no device buffer for the unselected columns either (the fused step's acc=None).
    assert st["device_bytes_per_param"] == pytest.approx(device_bytes_per_param(0.25, accumulate), abs=0.1)


def test_a_host_plan_budgets_no_device_sum():
    prof = gpu_profile()
    w = workload(0.5, budget=N * 12 * 0.5)  # room for r = 0.5 without the sum, r = 1/6 with it
    host = plan(prof, w, accumulate="host")
    dev = plan(prof, w)
    assert host.accumulate == "host" and dev.accumulate == "device"
    assert host.topk_ratio <= 0.5 and host.prediction.device_bytes <= w.memory_budget_bytes
    assert dev.topk_ratio <= 1 / 6 and dev.prediction.device_bytes <= w.memory_budget_bytes
    assert host.device_bytes_per_param == pytest.approx({"device": 4 + 12 * host.topk_ratio,
                                                         "host": 12 * host.topk_ratio})
    assert "keeps no device sum" in host.reason


def test_the_default_placement_ratio_is_the_configs():
    assert DEFAULT_PLACEMENT_RATIO == ZenFlowConfig().topk_ratio


@pytest.mark.parametrize(("room", "expected"), [(1.01, "device"), (0.99, "host")])
def test_auto_places_by_the_rule_at_the_default_ratio(room, expected):
    prof = gpu_profile()
    need = N * (4 + 12 * DEFAULT_PLACEMENT_RATIO)
    w = workload(0.5, budget=need * room)
    got = plan_accumulate(prof, w)
    rule = place_accumulation(device="cuda", offloaded_numel=N, topk_ratio=DEFAULT_PLACEMENT_RATIO,
                              available_bytes=need * room, fraction=1.0)
    assert got.accumulate == rule.accumulate == expected
    # The plan is the one made in that mode, with the choice and the per-mode step added to its reason.
    alone = plan(prof, w, accumulate=expected)
    assert (got.topk_ratio, got.update_interval, got.prediction) == (alone.topk_ratio, alone.update_interval,
                                                                     alone.prediction)
    lines = got.reason.splitlines()
    assert lines[:len(alone.reason.splitlines())] == alone.reason.splitlines()
    choice, modes, *assumed = lines[len(alone.reason.splitlines()):]
    assert choice.startswith(f'accumulate="{expected}": at topk_ratio=0.1') and got.accumulate_reason in choice
    assert ("does not fit" in choice) == (expected == "host") and "device memory budget" in choice
    assert modes.startswith('predicted step at this setting: "device"') and '"host"' in modes
    # The synthetic profile has no add probe: a "device" plan names what its "host" figures assumed ("host"'s own
    # reason already does).
    assert assumed == (host_assumptions(prof, w, got.cpu_threads) if expected == "device" else [])
    assert expected == "device" or any("ASSUMED" in line for line in alone.reason.splitlines())
    d = got.to_dict()
    assert d["accumulate"] == expected and d["accumulate_reason"] == got.accumulate_reason
    assert d["device_bytes_per_param"]["host"] == pytest.approx(12 * got.topk_ratio)


def test_auto_on_cpu_tensors_keeps_the_device_path_and_a_fixed_mode_says_so():
    prof = synthetic_profile()
    w = workload(0.5, device="cpu")
    got = plan_accumulate(prof, w)
    assert got.accumulate == "device" and "no device memory to save" in got.accumulate_reason
    fixed = plan_accumulate(prof, w, accumulate="host", topk_ratio=0.1, update_interval=4)
    assert fixed.accumulate == "host" and fixed.accumulate_reason == "fixed by the caller"
    assert fixed.prediction.add_s > 0
    # A fixed ratio is the one placed by.
    tight = workload(0.5, budget=N * (4 + 12 * 0.2) * 0.99)
    assert plan_accumulate(gpu_profile(), tight, topk_ratio=0.2).accumulate == "host"
    assert plan_accumulate(gpu_profile(), tight, topk_ratio=0.1).accumulate == "device"


# ---------------------------------------------------------------------------------------------------- CLI


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def profiles(tmp_path):
    paths = SimpleNamespace(cpu=tmp_path / "cpu.json", gpu=tmp_path / "gpu.json")
    save_profile(synthetic_profile(), paths.cpu)
    save_profile(synthetic_profile(gpu=True, key="host__cpu__gpu"), paths.gpu)
    return paths


def memory_table(out: str) -> list[list[str]]:
    block = out.split("  device memory per accumulate mode", 1)[1].split("\n\n", 1)[0].splitlines()
    assert block[1].split() == ["accumulate", "device", "B/param", "device", "GiB", "for", block[1].split()[6],
                                "params", "host", "B/param"]
    return [line.split() for line in block[2:]]


def test_cli_on_cpu_tensors_shows_both_modes_and_says_why_device(profiles, capsys):
    argv = ["--load", str(profiles.cpu), "--params", "125M", "--step-time", "0.5"]
    code, out, err = run([*argv, "--json"], capsys)
    assert code == cli.EXIT_OK, err
    (p,) = json.loads(out)["plans"]
    assert p["accumulate"] == "device" and "no device memory to save" in p["accumulate_reason"]
    r = p["topk_ratio"]
    assert [(m["accumulate"], m["chosen"]) for m in p["memory"]] == [("device", True), ("host", False)]
    assert p["memory"][1]["device_bytes"] == pytest.approx(125e6 * 12 * r)
    # "host": master, moments, snapshot 14, two window sums 8, and the landing ring (at most 1/16 of a step's bf16
    # gradients: 0.125 B/param).
    assert p["memory"][0]["host_bytes_per_param"] == 18.0
    assert p["memory"][1]["host_bytes_per_param"] == pytest.approx(22.125, abs=1e-3)
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_OK, err
    assert "CPU tensors: no device memory figure" in out
    rows = memory_table(out)
    assert rows[0][:2] == ["device", f"{4 + 12 * r:.2f}"] and rows[0][-1] == "(chosen)"
    assert rows[1][:4] == ["host", f"{12 * r:.2f}", f"{125e6 * 12 * r / 2**30:.2f}", "22.1"]
    assert f'accumulate="device": {p["accumulate_reason"]}' in out
    assert 'accumulate="host"' not in out.split("to train with this choice", 1)[1]


def test_cli_moves_the_sum_to_the_host_when_the_budget_is_short(profiles, capsys):
    # 7B at r = 0.1 needs 33.9 GiB with the sum on the device, 7.8 GiB without.
    argv = ["--load", str(profiles.gpu), "--params", "7B", "--step-time", "0.5", "--memory-budget", "20"]
    code, out, err = run([*argv, "--json"], capsys)
    assert code == cli.EXIT_OK, err
    (p,) = json.loads(out)["plans"]
    assert p["accumulate"] == "host" and "does not fit" in p["accumulate_reason"]
    assert p["prediction"]["accumulate"] == "host" and p["prediction"]["add_s"] > 0
    assert p["prediction"]["device_bytes"] <= 20 * 2**30
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_OK, err
    assert out.split("to train with this choice", 1)[1].count('accumulate="host"') == 1
    assert [row[0] for row in memory_table(out) if row[-1] == "(chosen)"] == ["host"]
    assert "device memory budget: 20.00 GiB" in out
    header, row = out.split("would choose", 1)[1].splitlines()[1:3]
    assert header.split()[-1] == "accumulate" and row[len(header) - 10:len(header)].strip() == "host"
    # The flag fixes the mode.
    code, out, err = run([*argv, "--accumulate", "device", "--json"], capsys)
    (p,) = json.loads(out)["plans"]
    assert p["accumulate"] == "device" and p["accumulate_reason"] == "fixed by the caller"
    assert "expect out-of-memory" in p["reason"]  # 28 GB of sum alone


# ------------------------------------------------------------------------------------------ the optimizer


def test_the_bridge_budgets_the_sum_only_where_the_optimizer_holds_it(monkeypatch):
    from zenflow_triton.autotune import bridge

    free = 64 * 2**30
    seen = []
    real_plan = bridge.plan

    def capture(profile, workload, **kw):
        seen.append((workload.memory_budget_bytes, kw["accumulate"]))
        return real_plan(profile, workload, **kw)

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(bridge, "plan", capture)
    for mode in ("device", "host"):
        got = bridge.plan_for_optimizer(offloaded_shapes=SHAPES, param_dtype=torch.bfloat16, grad_dtype="float32",
                                        step_time_s=0.5, device="cuda", topk_ratio=None, update_interval=None,
                                        profile=gpu_profile(), accumulate=mode)
        assert got.accumulate == got.prediction.accumulate == mode
    # With "device" the optimizer already holds the sums when it plans, so they count as free for its state.
    assert seen == [(0.9 * free + 4 * N, "device"), (0.9 * free, "host")]


@pytest.mark.parametrize("mode", ["device", "host"])
def test_the_optimizers_auto_plan_predicts_the_mode_it_placed(planned_with_synthetic_profile, mode):
    calls = planned_with_synthetic_profile
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 128, bias=False)
    with ZenFlowAdamW(model.parameters(), accumulate=mode, topk_ratio="auto", update_interval="auto",
                      warmup_steps=0) as opt:
        for _ in range(7):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
        plan = opt._knobs.plan
        assert opt.stats()["accumulate"] == mode
    assert plan is not None and [c["accumulate"] for c in calls] == [mode]
    assert plan.accumulate == plan.prediction.accumulate == mode
