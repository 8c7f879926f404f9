"""The GPU suite's logic, checked on CPU (its ``--dry-run``), so a broken suite is found before a GPU is booked.

Runs in the bench smoke job in a few seconds: the end-to-end phase with a tiny decoder and three providers in this
process, the parsers of the subprocess phases on hand-written files, the out-of-memory path with a provider that
raises, and the refusal without CUDA.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gpu_suite
import pytest
import torch
from providers import OptimizerProvider


def test_dry_run_end_to_end(tmp_path: Path) -> None:
    providers = ["torch_adamw_fused", "sync_offload", "zenflow"]
    rc = gpu_suite.main([str(tmp_path), "--dry-run", "--skip-tests", "--skip-kernels", "--providers", *providers])
    assert rc == 0
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    rows = {r["name"]: r for r in report["e2e"]}
    assert set(providers) <= set(rows)
    for name in providers:
        r = rows[name]
        assert "error" not in r, r.get("traceback")
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["timed_steps"] >= 1
    assert rows["zenflow"]["timed_steps"] % rows["zenflow"]["update_interval"] == 0  # whole windows
    assert rows["sync_offload"]["host_bytes_per_param"] > 0
    md = (tmp_path / "gpu_suite.md").read_text()
    assert "ZenFlow r=0.1, U=4" in md and "sync offload" in md


def test_oom_is_recorded_not_fatal() -> None:
    def build(params: object) -> object:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    provider = OptimizerProvider("boom", "boom", build)
    settings = gpu_suite.e2e_settings(quick=False, dry_run=True)
    res = gpu_suite.run_provider(provider, settings, torch.device("cpu"), deadline=float("inf"))
    assert res["error"] == "out of memory"
    assert "80.00 GiB" in res["message"]


def test_subprocess_result_parsers(tmp_path: Path) -> None:
    (tmp_path / "t.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_a" name="test_skip"><skipped/></testcase>'
        "</testsuite></testsuites>")
    s = gpu_suite.junit_summary(tmp_path / "t.xml")
    assert (s["tests"], s["failures"], s["skipped"], s["failed"]) == (3, 1, 1, ["tests.test_a::test_bad"])
    (tmp_path / "b.json").write_text(json.dumps(
        {"benchmarks": [{"name": "test_merge[bf16-r0.1]", "stats": {"median": 1e-4}, "extra_info": {"GB/s": 4000}}]}))
    assert gpu_suite.kernel_bench_rows(tmp_path / "b.json")[0]["GB/s"] == 4000
    (tmp_path / "empty.json").write_text("")  # what --benchmark-disable leaves
    assert gpu_suite.kernel_bench_rows(tmp_path / "empty.json") == []
    r = gpu_suite.run_subprocess("echo", [sys.executable, "-c", "print('hello')"], tmp_path, timeout=60)
    assert r["returncode"] == 0 and "hello" in (tmp_path / "echo.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_suite.main([str(tmp_path / "out")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_stress_line_says_what_happened() -> None:
    assert gpu_suite.stress_line(None) == "not run"
    assert gpu_suite.stress_line({"tests": 3, "skipped": 3}) == "all skipped (no CUDA device)"
    assert gpu_suite.stress_line({"tests": 3, "skipped": 0, "seconds": 61.2}).startswith("passed: 3 of 3")
    assert "FAILED: a::b" in gpu_suite.stress_line({"tests": 3, "failures": 1, "failed": ["a::b"]})
    assert "timed out" in gpu_suite.stress_line({"error": "timed out after 84 s"})


def test_kernel_goals_are_judged_from_the_grouped_bench() -> None:
    rows = [{"name": "test_fused_steps_grouped", "median_s": 1e-3, "ratio_to_copy": 0.85,
             "ratio_to_torch_fused": 1.6, "enqueue_us_per_param": 4.0}, {"name": "test_copy", "ratio_to_copy": 1.0}]
    goals = {g["figure"]: g for g in gpu_suite.kernel_goals(rows)}
    assert (goals["ratio_to_copy"]["met"], goals["ratio_to_torch_fused"]["met"],
            goals["enqueue_us_per_param"]["met"]) == (True, False, True)
    md = gpu_suite.goals_markdown(list(goals.values()))
    assert "| NO |" in md and "1.60" in md
    assert all(g["met"] is None for g in gpu_suite.kernel_goals([]))  # not measured (no GPU), not failed
