"""plan_for_optimizer: its choice of profile (env var, cache, one quick probe), its checks, the config's defaults."""

from __future__ import annotations

import inspect
import json
import logging

import pytest
import torch
from autotune_profiles import BAD_PROFILES, synthetic_profile

from zenflow_triton.autotune import bridge, machine
from zenflow_triton.autotune.bridge import QUALITY_ENV_VAR, plan_for_optimizer
from zenflow_triton.autotune.cache import ENV_VAR, cache_dir, default_profile_path, profile_to_json, save_profile
from zenflow_triton.autotune.model import DEFAULT_MAX_LOSS_RATIO, Plan
from zenflow_triton.autotune.quality import QualityTableError
from zenflow_triton.config import ZenFlowConfig


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Never touch the real user cache, and start every test without a profile."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(QUALITY_ENV_VAR, raising=False)
    monkeypatch.setattr(bridge, "_probed", {})
    return tmp_path


def _plan(**kw) -> Plan:
    args = dict(offloaded_shapes=[(256, 1024)] * 4, param_dtype=torch.float32, grad_dtype="float32",
                step_time_s=0.05, device=torch.device("cpu"), topk_ratio=None, update_interval=None)
    args.update(kw)
    return plan_for_optimizer(**args)


def test_plan_for_optimizer_reads_the_env_var_profile(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env.json"))
    save_profile(synthetic_profile(), tmp_path / "env.json")
    monkeypatch.setattr("zenflow_triton.autotune.probes.probe_machine",
                        lambda *a, **k: pytest.fail("must not probe when a profile exists"))
    plan = _plan()
    assert isinstance(plan, Plan)
    assert plan.profile_source == str(tmp_path / "env.json")
    assert plan.cpu_threads == 3  # the best rate among 1..cores-1
    assert plan.predicted_stall_s >= 0 and plan.predicted_host_s > 0 and plan.reason
    ZenFlowConfig(**plan.config_fields())


def test_plan_for_optimizer_probes_once_and_hints_at_the_cli(monkeypatch, caplog):
    calls = []

    def fake_probe(settings=None, **kw):
        calls.append(settings)
        return synthetic_profile()

    monkeypatch.setattr("zenflow_triton.autotune.probes.probe_machine", fake_probe)
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        first = _plan()
        second = _plan(step_time_s=0.1)
    assert len(calls) == 1 and calls[0].quick  # a quick probe, memoized for the process
    assert "python -m zenflow_triton.autotune" in caplog.text
    assert first.profile_source == second.profile_source == "quick probe (this process)"
    assert not (cache_dir()).exists()  # nothing written to the user's cache implicitly


def test_the_quick_probe_measures_the_parameters_device(monkeypatch):
    """A rank whose parameters are on cuda:1 without set_device: the probe (and its pinned slab) must use cuda:1,
    not the current device (a context on GPU 0 in every rank, and every rank measuring one GPU)."""
    devices = []

    def fake_probe(settings=None, *, device=None, **kw):
        devices.append(device)
        return synthetic_profile()

    monkeypatch.setattr("zenflow_triton.autotune.probes.probe_machine", fake_probe)
    profile, source = bridge._profile_for(torch.device("cuda", 1), "float32")
    assert devices == [torch.device("cuda", 1)] and source == "quick probe (this process)"
    monkeypatch.setattr(bridge, "_probed", {})
    bridge._profile_for(torch.device("cpu"), "float32")
    assert devices[1] is None  # CPU tensors: the probe's own choice (no GPU figures are needed)


def test_the_quick_probe_for_cuda_skips_the_cpu_tensor_device_step(monkeypatch):
    """The CPU-tensor device step (numba's device ops, seconds to compile cold) is measured only for a plan for CPU
    tensors: a CUDA plan never reads it. The two probes are memoized apart, so neither serves the other's plan."""
    import dataclasses

    settings_seen = []

    def fake_probe(settings=None, *, device=None, **kw):
        settings_seen.append(settings)
        prof = synthetic_profile(gpu=device is not None)
        return prof if settings.cpu_device_ops else dataclasses.replace(prof, cpu_device=None)

    monkeypatch.setattr("zenflow_triton.autotune.probes.probe_machine", fake_probe)
    cuda_profile, _ = bridge._profile_for(torch.device("cuda", 0), "float32")
    assert not settings_seen[0].cpu_device_ops and cuda_profile.cpu_device is None
    cpu_profile, _ = bridge._profile_for(torch.device("cpu"), "float32")
    assert settings_seen[1].cpu_device_ops and cpu_profile.cpu_device is not None
    bridge._profile_for(torch.device("cuda", 0), "float32")
    bridge._profile_for(torch.device("cpu"), "float32")
    assert len(settings_seen) == 2  # each memoized


def test_a_profile_without_cpu_tensor_rates_cannot_plan_cpu_tensors(tmp_path, monkeypatch):
    import dataclasses

    cuda_only = dataclasses.replace(synthetic_profile(), cpu_device=None)
    with pytest.raises(ValueError, match="no device-step rates for CPU tensors"):
        _plan(profile=cuda_only)
    # Saved and found in the cache, it is refused for CPU tensors with one message, and a quick probe runs.
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env.json"))
    save_profile(cuda_only, tmp_path / "env.json")
    monkeypatch.setattr("zenflow_triton.autotune.probes.probe_machine", lambda *a, **k: synthetic_profile())
    profile, source = bridge._profile_for(torch.device("cpu"), "float32")
    assert profile.cpu_device is not None and source == "quick probe (this process)"


def test_plan_for_optimizer_keeps_fixed_values_and_handles_a_zero_step_time(caplog):
    prof = synthetic_profile()
    fixed = _plan(profile=prof, topk_ratio=0.3, update_interval=2)
    assert (fixed.topk_ratio, fixed.update_interval) == (0.3, 2)
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        zero = _plan(profile=prof, step_time_s=0.0)
    assert "step time" in caplog.text
    assert zero.update_interval >= 1


def test_plan_for_optimizer_validates_its_inputs():
    prof = synthetic_profile()
    with pytest.raises(ValueError, match="grad_dtype"):
        _plan(profile=prof, grad_dtype="float16")
    with pytest.raises(ValueError, match="param_dtype"):
        _plan(profile=prof, param_dtype=torch.int8)
    with pytest.raises(ValueError, match="offloaded shape"):
        _plan(profile=prof, offloaded_shapes=[])


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("zenflow_triton") and r.levelno >= logging.WARNING]


def test_a_broken_cached_profile_falls_back_to_a_probe_with_one_message(monkeypatch, caplog):
    key = machine.current_machine_key()
    path = default_profile_path(key)
    path.parent.mkdir(parents=True)
    path.write_text("{broken")
    monkeypatch.setattr("zenflow_triton.autotune.probes.probe_machine", lambda *a, **k: synthetic_profile())
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        plan = _plan()
    (message,) = _warnings(caplog)
    assert "ignoring unusable profile" in message and str(path) in message and "quick probe" in message
    assert plan.profile_source.startswith("quick probe")


# What "auto" does with a profile it cannot use is what it does with none: one quick probe (not written anywhere),
# announced in one warning that says why the file was refused.
@pytest.mark.parametrize(("mutate", "field"), [pytest.param(m, f, id=i) for i, m, f in BAD_PROFILES[:8]])
def test_an_invalid_profile_falls_back_to_the_quick_probe_naming_the_field(tmp_path, monkeypatch, caplog, mutate,
                                                                            field):
    data = profile_to_json(synthetic_profile())
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv(ENV_VAR, str(path))
    monkeypatch.setattr("zenflow_triton.autotune.probes.probe_machine", lambda *a, **k: synthetic_profile())
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        plan = _plan()
    (message,) = _warnings(caplog)
    assert field in message and "quick probe" in message
    assert plan.profile_source == "quick probe (this process)"


def test_a_profile_without_the_configs_grad_dtype_falls_back_too(tmp_path, monkeypatch, caplog):
    data = profile_to_json(synthetic_profile())
    del data["cpu_adamw"]["rates"]["bfloat16"]
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "fp32.json"))
    (tmp_path / "fp32.json").write_text(json.dumps(data))
    monkeypatch.setattr("zenflow_triton.autotune.probes.probe_machine", lambda *a, **k: synthetic_profile())
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        plan = _plan(grad_dtype="bfloat16")
    (message,) = _warnings(caplog)
    assert "bfloat16" in message and "quick probe" in message
    assert plan.profile_source == "quick probe (this process)"
    assert _plan().profile_source == str(tmp_path / "fp32.json")  # usable for float32 gradients


def test_plan_for_optimizer_passes_the_configs_select_windows(monkeypatch):
    monkeypatch.setattr(bridge, "DEFAULT_SELECT_WINDOWS", 3)  # as if the optimizer's config said 3
    plan = _plan(profile=synthetic_profile(), update_interval=2)
    assert plan.prediction.select_interval == 3 * 2


def test_the_loss_budget_and_the_quality_table_reach_the_plan(tmp_path, monkeypatch):
    prof = synthetic_profile()
    assert inspect.signature(plan_for_optimizer).parameters["max_loss_ratio"].default == DEFAULT_MAX_LOSS_RATIO
    default = _plan(profile=prof)
    assert default.max_loss_ratio == DEFAULT_MAX_LOSS_RATIO and default.quality_source.startswith("shipped: ")
    assert _plan(profile=prof, max_loss_ratio=1.2).max_loss_ratio == 1.2
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"topk_ratios": [0.1, 0.5], "update_intervals": [1, 4], "ratio": [[1.2, 1.2],
                                                                                                  [1.01, 1.2]]}))
    assert _plan(profile=prof, quality=mine).quality_source == str(mine)
    monkeypatch.setenv(QUALITY_ENV_VAR, str(mine))
    from_env = _plan(profile=prof)
    assert from_env.quality_source == str(mine)
    # Only U = 1 with a ratio near 0.5 (or above, toward AdamW's r = 1) is within 1.05 on that table.
    assert from_env.update_interval == 1 and from_env.topk_ratio >= 0.4 and from_env.predicted_loss_ratio <= 1.05
    mine.write_text("[]")
    with pytest.raises(QualityTableError):
        _plan(profile=prof)


def test_the_optimizer_path_hints_at_what_an_optimizer_user_can_change(monkeypatch):
    # ZenFlowAdamW has no loss-budget argument, so a stall hint naming --max-loss-ratio would point nowhere.
    seen = {}
    real = bridge.plan

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(bridge, "plan", spy)
    _plan(profile=synthetic_profile())
    assert seen["relax_hint"].startswith("fix topk_ratio and update_interval yourself")


def test_a_profile_refused_after_the_process_probed_is_warned_about_each_time(tmp_path, monkeypatch, caplog):
    """Issue 30 item 7: once the process has probed, an unusable $ZENFLOW_TRITON_PROFILE used to be ignored
    silently (the warning came only with a new probe)."""
    probes = []
    monkeypatch.setattr("zenflow_triton.autotune.probes.probe_machine",
                        lambda *a, **k: probes.append(1) or synthetic_profile())
    _plan()  # no profile anywhere: this process probes
    data = profile_to_json(synthetic_profile())
    del data["cpu_adamw"]["rates"]["float32"]
    path = tmp_path / "unusable.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv(ENV_VAR, str(path))
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
            plan = _plan()
        (message,) = _warnings(caplog)
        assert "ignoring unusable profile" in message and str(path) in message and "quick probe" in message
        assert plan.profile_source == "quick probe (this process)"
    assert len(probes) == 1  # the probe is not repeated, only the warning
