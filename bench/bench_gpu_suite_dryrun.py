"""The GPU suite's logic, checked on CPU (its ``--dry-run``), so a broken suite is found before a GPU is booked.

Runs in the bench smoke job in a few seconds: the end-to-end phase with a tiny decoder and three providers in this
process, the parsers of the subprocess phases on hand-written files, the out-of-memory path with a provider that
raises, a provider that hangs (in a subprocess: the suite ends itself there), and the refusal without CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gpu_suite
import pytest
import suite_report
import torch
from common import BENCH_DIR
from providers import OptimizerProvider


def test_dry_run_end_to_end(tmp_path: Path) -> None:
    providers = ["torch_adamw_fused", "sync_offload", "zenflow"]
    rc = gpu_suite.main([str(tmp_path), "--dry-run", "--providers", *providers])
    assert rc == 0
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    # Every phase ran (its GPU tests collected and skipped) and was summarized from its JUnit XML, which stays out of
    # OUTDIR: the device tool returns 8 files, and the suite's own leave room for the caller's log.
    for phase in ("gpu_tests", "stress_tests", "device_kernels"):
        assert report[phase]["returncode"] in (0, 5) and report[phase]["tests"] >= 1, report[phase]
    assert {f.name for f in tmp_path.iterdir()} <= set(gpu_suite.OUTPUT_FILES)
    assert len(gpu_suite.OUTPUT_FILES) <= 6
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
    # A phase stopped at its limit leaves no --benchmark-json; the rows the bench appended as it went stand in,
    # marked partial, without the line the kill cut short.
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text(json.dumps({"name": "test_fused_steps_grouped", "median_s": 2e-3, "ratio_to_copy": 0.9})
                         + "\n" + '{"name": "test_fused_steps_grou')
    assert gpu_suite.kernel_bench_rows(tmp_path / "missing.json", rows_file) == [
        {"name": "test_fused_steps_grouped", "median_s": 2e-3, "ratio_to_copy": 0.9, "partial": True}]
    assert gpu_suite.kernel_bench_rows(tmp_path / "b.json", rows_file)[0]["name"] == "test_merge[bf16-r0.1]"
    r = gpu_suite.run_subprocess("echo", [sys.executable, "-c", "print('hello')"], tmp_path, timeout=60)
    assert r["returncode"] == 0 and "hello" in (tmp_path / "echo.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_suite.main([str(tmp_path / "out")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_stress_line_says_what_happened() -> None:
    assert suite_report.stress_line(None) == "not run"
    assert suite_report.stress_line({"tests": 3, "skipped": 3}) == "all skipped (no CUDA device)"
    assert suite_report.stress_line({"tests": 3, "skipped": 0, "seconds": 61.2}).startswith("passed: 3 of 3")
    assert "FAILED: a::b" in suite_report.stress_line({"tests": 3, "failures": 1, "failed": ["a::b"]})
    assert "timed out" in suite_report.stress_line({"error": "timed out after 84 s"})


def test_kernel_goals_are_judged_from_the_grouped_bench() -> None:
    rows = [{"name": "test_fused_steps_grouped", "median_s": 1e-3, "ratio_to_copy": 0.85,
             "ratio_to_torch_fused": 1.6, "enqueue_us_per_param": 4.0}, {"name": "test_copy", "ratio_to_copy": 1.0}]
    goals = {g["figure"]: g for g in suite_report.kernel_goals(rows)}
    assert (goals["ratio_to_copy"]["met"], goals["ratio_to_torch_fused"]["met"],
            goals["enqueue_us_per_param"]["met"]) == (True, False, True)
    md = suite_report.goals_markdown(list(goals.values()))
    assert "| NO |" in md and "1.60" in md
    assert all(g["met"] is None for g in suite_report.kernel_goals([]))  # not measured (no GPU), not failed
    # The step without device sums is judged on its own row.
    rows.append({"name": "test_fused_steps_grouped_no_acc", "ratio_to_copy": 0.7, "ratio_to_torch_fused": 2.5,
                 "enqueue_us_per_param": 4.0})
    no_acc = {g["figure"]: g["met"] for g in suite_report.kernel_goals(rows, "test_fused_steps_grouped_no_acc")}
    assert no_acc == {"ratio_to_copy": False, "ratio_to_torch_fused": True, "enqueue_us_per_param": True}
    assert set(suite_report.GOALS_BENCHES) == {"test_fused_steps_grouped", "test_fused_steps_grouped_no_acc"}


# A provider whose build never returns, in a suite whose hard limit is 3 s; numba's warm-up (a compile on a fresh
# machine) skipped, so that the limit falls inside the provider.
_HANGING_SUITE = """
import sys, time
sys.path.insert(0, {bench!r})
import gpu_suite
from providers import OptimizerProvider
import zenflow_triton.kernels.cpu_adamw as cpu_adamw

def never_returns(params):
    time.sleep(600)

cpu_adamw.warmup = lambda *a, **k: None
gpu_suite.HARD_LIMIT_S = 3.0
gpu_suite.e2e_providers = lambda quick: {{"stuck": OptimizerProvider("stuck", "stuck", never_returns),
                                         "after": OptimizerProvider("after", "after", never_returns)}}
gpu_suite.auto_unavailable_reason = lambda: None
sys.exit(gpu_suite.main([{out!r}, "--dry-run", "--skip-tests", "--skip-kernels"]))
"""


def test_a_provider_past_the_time_limit_is_recorded_with_its_stack_and_ends_the_suite(tmp_path: Path) -> None:
    script = _HANGING_SUITE.format(bench=str(BENCH_DIR), out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "STOPPED (time limit): stuck" in proc.stdout
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    rows = {r["name"]: r for r in report["e2e"]}
    assert report["stopped_at"] == "stuck" and rows["stuck"]["error"] == "time limit"
    # The main thread's stack shows where it waited: inside the provider's build.
    main = rows["stuck"]["stacks"].split("--- thread MainThread")[1]
    assert "provider.build(params)" in main and "in never_returns" in main
    assert rows["after"]["skipped"] == "not run: stuck stopped the suite (time limit)"
    assert "STOPPED (time limit)" in (tmp_path / "gpu_suite.md").read_text()


def test_watchdog_backstop_dumps_stacks_when_the_timer_cannot_act() -> None:
    # on_hang that itself hangs stands for a timer thread that never gets to run: faulthandler's thread, which needs
    # no GIL, then writes every stack to stderr and exits with status 1.
    script = (f"import sys, time; sys.path.insert(0, {str(BENCH_DIR)!r}); from watchdog import Watchdog\n"
              "def stuck_here():\n    time.sleep(600)\n"
              "with Watchdog(lambda stacks: time.sleep(600), backstop=1.0).armed(0.2):\n    stuck_here()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "stuck_here" in proc.stderr and "Timeout" in proc.stderr


def test_watchdog_disarmed_in_time_does_nothing() -> None:
    from watchdog import Watchdog

    fired = []
    with Watchdog(fired.append, backstop=1.0).armed(5.0):
        pass
    import time

    time.sleep(0.2)
    assert fired == []
