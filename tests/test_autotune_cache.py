"""Profile files (schema, versioning, location, machine key) and plan_for_optimizer's choice of profile."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from zenflow_triton.autotune import cache
from zenflow_triton.autotune.cache import (
    ENV_VAR,
    SCHEMA,
    SCHEMA_VERSION,
    ProfileError,
    cache_dir,
    default_profile_path,
    find_profile,
    load_profile,
    machine_key,
    plan_for_optimizer,
    profile_to_json,
    save_profile,
)
from zenflow_triton.autotune.model import (
    BandwidthCurve,
    CpuAdamwRates,
    DeviceOpRates,
    GpuInfo,
    Plan,
    Profile,
)
from zenflow_triton.config import ZenFlowConfig


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


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Never touch the real user cache, and start every test without a profile."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(cache, "_probed", {})
    return tmp_path


def test_machine_key_is_a_safe_file_name():
    key = machine_key("node-7.cluster", "Intel(R) Xeon(R) Platinum 8480+ @ 2.0GHz", "NVIDIA H100 80GB HBM3")
    assert key == "node-7.cluster__Intel-R-Xeon-R-Platinum-8480-2.0GHz__NVIDIA-H100-80GB-HBM3"
    assert machine_key("h", "c", None).endswith("__nogpu")
    assert "/" not in machine_key("a/b", "../..", "x y")


def test_cache_dir_follows_xdg_and_env_var_overrides_the_file(tmp_path, monkeypatch):
    assert cache_dir() == tmp_path / "xdg" / "zenflow_triton"
    assert default_profile_path("k") == tmp_path / "xdg" / "zenflow_triton" / "profile-k.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir().parts[-2:] == (".cache", "zenflow_triton")
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "mine.json"))
    assert default_profile_path("k") == tmp_path / "mine.json"


def test_save_and_load_round_trip(tmp_path):
    prof = synthetic_profile(gpu=True)
    path = save_profile(prof, tmp_path / "sub" / "p.json", extra={"plan": {"note": 1}})
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["schema_version"] == SCHEMA_VERSION
    assert data["machine_key"] == prof.machine_key
    assert load_profile(path) == prof
    assert not list(path.parent.glob(".*tmp"))  # the temporary file of the atomic write is gone


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"schema": "other"}', "not a zenflow_triton profile"),
        (json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION + 1}), "schema_version"),
        (json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "machine_key": "k"}), "malformed"),
    ],
)
def test_unusable_files_raise_profile_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message):
        load_profile(path)


def test_missing_file_and_invalid_rates_raise_profile_error(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "absent.json")
    data = profile_to_json(synthetic_profile())
    data["cpu_adamw"]["rates"]["float32"]["1"] = -1.0
    (tmp_path / "neg.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="malformed"):
        load_profile(tmp_path / "neg.json")


def test_find_profile_uses_the_env_var_then_the_cache(tmp_path, monkeypatch):
    assert find_profile("k") is None
    save_profile(synthetic_profile(key="k"), default_profile_path("k"))
    prof, path = find_profile("k")
    assert path.name == "profile-k.json" and prof.machine_key == "k"
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env.json"))
    assert find_profile("k") is None  # the env var names the file; the cache is not consulted
    save_profile(synthetic_profile(key="env"), tmp_path / "env.json")
    assert find_profile("k")[0].machine_key == "env"


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


def test_a_broken_cached_profile_falls_back_to_a_probe(monkeypatch, caplog):
    key = cache.current_machine_key()
    path = default_profile_path(key)
    path.parent.mkdir(parents=True)
    path.write_text("{broken")
    monkeypatch.setattr("zenflow_triton.autotune.probes.probe_machine", lambda *a, **k: synthetic_profile())
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        plan = _plan()
    assert "ignoring unusable profile" in caplog.text
    assert plan.profile_source.startswith("quick probe")
