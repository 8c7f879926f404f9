""""auto" as the optimizer sees it: the plan is announced in one line, once, and stats() keeps its fields and reason."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from autotune_profiles import BAD_PROFILES, synthetic_profile

from zenflow_triton.auto import Knobs, announce
from zenflow_triton.autotune.model import DEFAULT_MAX_LOSS_RATIO
from zenflow_triton.config import ZenFlowConfig

SHAPES = [(256, 1024)] * 4


def stats(windows: int = 0, stall_s: float = 0.0) -> SimpleNamespace:
    """What Knobs.report reads of the optimizer's counters (zenflow_triton.telemetry.Stats)."""
    return SimpleNamespace(windows=windows, stall_s=stall_s, windows_at_plan=0, stall_at_plan=0.0)


def resolved_knobs(**config) -> Knobs:
    knobs = Knobs(ZenFlowConfig(topk_ratio="auto", update_interval="auto", **config))
    for t in (0.0, 0.05, 0.10):  # three steps of 50 ms between step() calls
        knobs.sample_step_time(t, torch.device("cpu"))
        knobs.step_ended(t)
    knobs.resolve(offloaded_shapes=SHAPES, param_dtype=torch.float32, device=torch.device("cpu"))
    return knobs


def test_auto_announces_its_choice_once_and_stats_keep_the_reason(planned_with_synthetic_profile, caplog):
    with caplog.at_level(logging.INFO, logger="zenflow_triton.auto"):
        knobs = resolved_knobs()
        knobs.resolve(offloaded_shapes=SHAPES, param_dtype=torch.float32, device=torch.device("cpu"))  # no-op now
    records = [r for r in caplog.records if r.name == "zenflow_triton.auto"]
    assert len(records) == 1
    line = records[0].getMessage()
    plan = knobs.plan
    assert "\n" not in line
    assert line.startswith(f"chose topk_ratio={plan.topk_ratio:g} update_interval={plan.update_interval} ")
    assert f"predicted loss {plan.predicted_loss_ratio:.3f}x AdamW (budget {DEFAULT_MAX_LOSS_RATIO:g})" in line
    # The optimizer plans with the default budget: ZenFlowAdamW's constructor has no such argument.
    assert "max_loss_ratio" not in planned_with_synthetic_profile[0]
    report = knobs.report(stats(windows=4, stall_s=0.02))
    assert report["auto_reason"] == plan.reason and len(plan.reason.splitlines()) >= 3
    assert report["predicted_loss_ratio"] == plan.predicted_loss_ratio <= DEFAULT_MAX_LOSS_RATIO
    assert report["predicted_stall_per_window_s"] == plan.predicted_stall_s
    assert report["measured_stall_per_window_s"] == pytest.approx(0.005)
    assert report["measured_step_time_s"] == pytest.approx(0.05)
    assert "topk_ratio" not in report  # the knobs in use come from the optimizer's own entries


def test_fixed_knobs_make_no_plan_and_say_nothing(caplog):
    knobs = Knobs(ZenFlowConfig(topk_ratio=0.1, update_interval=4))
    with caplog.at_level(logging.DEBUG, logger="zenflow_triton"):
        knobs.resolve(offloaded_shapes=SHAPES, param_dtype=torch.float32, device=torch.device("cpu"))
    assert knobs.plan is None and knobs.report(stats()) == {} and not caplog.records


def test_announce_writes_to_stderr_only_when_logging_is_not_configured():
    # A fresh interpreter: pytest's own handlers would hide the case that matters, an unconfigured application.
    script = textwrap.dedent("""
        import logging, sys
        from zenflow_triton.auto import announce
        announce("one")                                   # nothing configured: one line on stderr
        logging.getLogger("zenflow_triton").setLevel(logging.WARNING)
        announce("silenced by the library's level")
        logging.getLogger("zenflow_triton").setLevel(logging.NOTSET)
        logging.disable(logging.INFO)
        announce("silenced by logging.disable")
        logging.disable(logging.NOTSET)
        logging.basicConfig(level=logging.WARNING, format="LOG %(name)s %(message)s", stream=sys.stdout)
        announce("below the application's level")        # configured: the application decides
        logging.getLogger().setLevel(logging.INFO)
        announce("two")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "zenflow_triton.auto: one\n"
    assert proc.stdout == "LOG zenflow_triton.auto two\n"


def test_announce_goes_through_a_configured_logger(caplog):
    log = logging.getLogger("zenflow_triton.auto")
    with caplog.at_level(logging.INFO, logger="zenflow_triton.auto"):
        announce("through logging", log)
    assert [r.getMessage() for r in caplog.records] == ["through logging"]


@pytest.mark.parametrize("bad", ["binary", "versions-list", "rates-empty", "llc-inf"])
def test_auto_with_an_unusable_profile_trains_on_the_quick_probe(tmp_path, monkeypatch, caplog, bad):
    from zenflow_triton import ZenFlowAdamW
    from zenflow_triton.autotune import bridge
    from zenflow_triton.autotune.cache import ENV_VAR, profile_to_json

    path = tmp_path / "profile.json"
    if bad == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\xff")
    else:
        data = profile_to_json(synthetic_profile())
        next(m for i, m, _ in BAD_PROFILES if i == bad)(data)
        path.write_text(json.dumps(data))
    monkeypatch.setenv(ENV_VAR, str(path))
    monkeypatch.setattr(bridge, "_probed", {})
    monkeypatch.setattr("zenflow_triton.autotune.probes.probe_machine", lambda *a, **k: synthetic_profile())
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio="auto", update_interval="auto", min_offload_numel=512,
                       warmup_steps=0)
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        for _ in range(8):
            opt.zero_grad()
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
    # (The pipeline's compile notice may come too, on a machine that has not cached the numba kernels yet.)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "autotune" in r.getMessage()]
    assert len(warnings) == 1 and "ignoring unusable profile" in warnings[0] and str(path) in warnings[0]
    assert opt.stats()["update_interval"] >= 1 and "quick probe" in opt.stats()["auto_reason"] + warnings[0]
    opt.close()


def test_on_cuda_a_warmup_step_is_stamped_after_its_queued_merge(monkeypatch):
    """A warm-up step returns with its merge (the host-to-device copy of every snapshot) still queued: step_ended
    waits for the device before it stamps the step's end, so the next sample is the forward and backward alone."""
    import time

    clock = iter([1.3, 2.0, 2.9])  # the merge ends at 1.3; the next step() is entered at 2.0 with the device idle
    synced = []
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    knobs = Knobs(ZenFlowConfig(topk_ratio="auto", update_interval="auto"))
    cuda = torch.device("cuda", 0)
    knobs.sample_step_time(0.0, cuda)  # the first step: nothing to sample yet
    knobs.step_ended(1.0)  # step() returned at 1.0, its merge still queued
    knobs.sample_step_time(2.0, cuda)
    assert knobs.step_time_samples == [pytest.approx(0.7)]  # 2.0 - 1.3, not 2.0 - 1.0
    knobs.step_ended(2.5)
    assert synced == [cuda, cuda, cuda]
    # CPU tensors merge before step() returns: nothing to wait for, the stamps are used as they are.
    cpu_knobs = Knobs(ZenFlowConfig(topk_ratio="auto", update_interval="auto"))
    for t in (0.0, 1.0):
        cpu_knobs.sample_step_time(t, torch.device("cpu"))
        cpu_knobs.step_ended(t + 0.25)
    assert cpu_knobs.step_time_samples == [pytest.approx(0.75)] and len(synced) == 3
