"""The one-shot GPU suite: GPU tests, device-kernel benches and an end-to-end fine-tuning step comparison.

Run on a machine with one CUDA GPU (sized for an H200, under 8 minutes; ``--quick`` for about half)::

    python bench/gpu_suite.py OUTDIR [--quick]

and on any machine, to check the script's logic with a tiny decoder on CPU (a few seconds)::

    python bench/gpu_suite.py OUTDIR --dry-run

Without CUDA (and without ``--dry-run``) it exits at once with status 2 and "needs a CUDA GPU".

On a bare machine (the package not installed, no network), the same command first makes this tree's
``zenflow_triton`` importable: ``pip install -e`` without an index where setuptools >= 77, else run from the tree
(``tree_install.py``).

Phases, each with its own time limit, so one that hangs or fails does not take the others with it:

1. ``pytest -m gpu tests`` in a subprocess (JUnit XML and log in OUTDIR), all but the stress tests;
2. the stress tests, ``pytest -m gpu tests/test_gpu_stress.py``, in a subprocess with a time limit of their own:
   [8192, 8192] parameters, no synchronization between steps, delays injected on the copy and compute streams,
   checked against the dense simulation after every step (is the CUDA pipeline correct under stress?);
3. ``pytest bench/bench_device_kernels.py --benchmark-json ...`` in a subprocess: the kernels' bandwidth against a
   device copy, a step's launches for 56 matrices of a ~1B decoder (one grouped launch, and one launch per matrix)
   against ``torch.optim.AdamW(fused=True)`` on the same shapes, and the host time to issue them per parameter;
   the report judges the kernel goals on the grouped launch, with and without the device sums
   (``suite_report.KERNEL_GOALS``: ``ratio_to_copy`` >= 0.8, ``ratio_to_torch_fused`` >= 2,
   ``enqueue_us_per_param`` <= 10; the second is out of the device sums' reach by their bytes);
4. end to end, in this process: a plain-torch Llama-style decoder (``decoder.py``: 1.37B parameters by default,
   random init, bf16, no positional encoding: positions do not change the cost) fine-tuned for some steps with each
   provider, in this order (the last ones get what is left of the budget): no offload
   (``torch.optim.AdamW(fused=True)``, bf16 state on the GPU), synchronous offload (ZenFlowAdamW with
   ``topk_ratio=0, update_interval=1, overlap=False, accumulate="host"``: the ZeRO-Offload schedule, each step's bf16
   gradient to the host), ZenFlowAdamW (fixed ``0.1 / 4``, ``"auto"`` when the autotuner imports,
   ``accumulate="host"`` with and without ``grads_in_backward``) and torchao's ``CPUOffloadOptimizer`` (when torchao
   imports). Per provider: seconds per step over whole selection intervals (whole windows where one is longer than
   the cap), the
   optimizer's share of the step, the stall fraction (``stats()['stall_s']`` over the timed wall time), peak GPU memory
   (``torch.cuda.max_memory_allocated``), pinned host memory (the optimizer's own figure, and what torch's caching
   host allocator holds: it rounds every ``pin_memory=True`` block up to a power of two), the growth of the
   process's resident host memory, and tokens per second.
   An out-of-memory error in one provider is recorded and the suite goes on; GPU and pinned memory are released
   between providers.

Writes ``OUTDIR/gpu_suite.json`` and ``OUTDIR/gpu_suite.md``, the three subprocess logs and the device kernels'
``--benchmark-json``: 6 files (``OUTPUT_FILES``; the device tool returns 8), the report rewritten after every
phase and provider, so whatever stops the run leaves what it measured. A test still running after
``TEST_STACKS_AFTER_S`` has every thread's stack in its phase's log. A provider that runs past its share of the budget
by ``PROVIDER_GRACE_S`` ("hung"), or still running at the suite's hard limit (``HARD_LIMIT_S``, 8 minutes: "time
limit"), is recorded with every thread's stack (``watchdog.py``), and the suite ends there. Exit status: 0 when every
phase ran (out-of-memory results included), 1 when a GPU test failed or a provider raised another error, 2 without
CUDA, 3 when a provider was stopped (rerun the rest with ``--providers``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from common import BENCH_DIR, load_average, machine_info
from decoder import Decoder, DecoderConfig
from suite_report import GOALS_BENCHES, kernel_goals, report_markdown
from watchdog import Watchdog

# Run as the device command on a bare machine: make this tree's zenflow_triton importable (installed, or run from the
# tree) before providers imports it, and before the pytest phases start (tree_install.py says how).
INSTALL: dict[str, str] = {"how": "imported as a module"}
if __name__ == "__main__":
    from tree_install import ensure_importable

    INSTALL = ensure_importable(BENCH_DIR.parent)
    print(f"# zenflow_triton: {INSTALL['how']}" + (f" ({INSTALL['why']})" if INSTALL["why"] else ""), flush=True)

from providers import (  # noqa: E402
    OptimizerProvider,
    auto_unavailable_reason,
    close_optimizer,
    optimizer_memory,
    optimizer_providers,
    steps_before_selection,
)

REPO = BENCH_DIR.parent
STRESS_TESTS = "tests/test_gpu_stress.py"

NEEDS_GPU = "gpu_suite: needs a CUDA GPU (torch.cuda.is_available() is False); use --dry-run to check the script on CPU"
# The whole suite must finish in 8 minutes on one H200; the phases share this budget, and the margin covers
# start-up, a provider's warm-up that overruns it (checked only between windows) and writing the report.
BUDGET_S = 420.0
BUDGET_QUICK_S = 210.0
# What the suite promises, hung or not: past it, the provider still running is recorded with every thread's stack,
# the report is written and the process exits (status 3), so a device lease gets its report back in time.
HARD_LIMIT_S = 480.0
HARD_LIMIT_QUICK_S = 270.0
# How far a provider may overrun its share of the budget before it counts as hung (its warm-up is not bounded by
# the share, and a hung host job raises by itself after worker_timeout, 120 s).
PROVIDER_GRACE_S = 150.0
# A test still running after this long has every thread's stack written to its phase's log (pytest's faulthandler,
# which only writes: the phase's own time limit ends it), so a phase that times out says where it hung.
TEST_STACKS_AFTER_S = 60
# The device tool returns at most 8 files from its output folder: the suite writes only these there (JUnit XML goes
# to a scratch folder and is summarized in the report), which leaves room for the caller's own log.
OUTPUT_FILES = ("gpu_suite.json", "gpu_suite.md", "gpu_tests.log", "stress_tests.log", "device_kernels.log",
                "device_kernels.json")


# ----------------------------------------------------------------------------------------------------- the decoder


# ----------------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class E2ESettings:
    """What the end-to-end phase runs."""

    model: DecoderConfig
    batch: int
    seq: int
    dtype: str
    timed_steps: int
    """Timed steps per provider, rounded up to whole selection intervals of a ZenFlow provider (whole windows when
    an interval is longer than ``max_timed_steps``; the row then says that no selection step was timed)."""
    sync_timed_steps: int
    """Timed steps of the providers that do a full host AdamW every step (seconds each at 1B+ parameters)."""
    max_timed_steps: int
    """Cap when an "auto" plan chooses long windows."""


def e2e_settings(*, quick: bool, dry_run: bool) -> E2ESettings:
    if dry_run:
        return E2ESettings(DecoderConfig(vocab=256, d_model=64, n_layer=2, n_head=4, ffn=128), batch=2, seq=32,
                           dtype="bfloat16", timed_steps=4, sync_timed_steps=2, max_timed_steps=8)
    # B x T = 16 x 1024 makes forward+backward of the 1.37B decoder a few hundred ms on an H200 (about 6 * 1.37e9
    # * 16384 = 135 TFLOP at a few hundred TFLOP/s), so one ZenFlow window of host work has something to hide
    # behind; activations stay near 30 GB without checkpointing.
    if quick:
        return E2ESettings(DecoderConfig(), batch=8, seq=1024, dtype="bfloat16", timed_steps=16, sync_timed_steps=3,
                           max_timed_steps=32)
    return E2ESettings(DecoderConfig(), batch=16, seq=1024, dtype="bfloat16", timed_steps=32, sync_timed_steps=5,
                       max_timed_steps=64)


# ----------------------------------------------------------------------------------------------------- subprocesses


def run_subprocess(name: str, cmd: list[str], out: Path, timeout: float,
                   extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` in the repository root with a time limit; the log goes to ``OUTDIR/<name>.log``."""
    start = time.perf_counter()
    env = {**os.environ, **(extra_env or {})}
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")  # --dry-run: the Triton kernels run in the interpreter
    result: dict[str, Any] = {"command": " ".join(cmd), "timeout_s": round(timeout)}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
        result["returncode"] = proc.returncode
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        result["returncode"] = None
        result["error"] = f"timed out after {timeout:.0f} s"
        log = _text(exc.stdout) + _text(exc.stderr)
    result["seconds"] = round(time.perf_counter() - start, 1)
    (out / f"{name}.log").write_text(log)
    result["tail"] = log[-1500:]
    return result


def _text(x: str | bytes | None) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts from a pytest JUnit XML file, and the names of failed tests."""
    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    out = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    out["failed"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s
                     if c.find("failure") is not None or c.find("error") is not None]
    return out


def kernel_bench_rows(path: Path, rows_file: Path | None = None) -> list[dict[str, Any]]:
    """name, median seconds and the bench's extra_info (GB/s, ratio_to_copy...) from a --benchmark-json file; when
    it is missing (the phase stopped at its time limit: pytest-benchmark writes it at the session's end), the rows
    the bench appended to ``rows_file`` as it measured them (``$ZENFLOW_BENCH_ROWS``), each marked ``partial``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, or empty (--benchmark-disable writes nothing)
        data = None
    if data is not None:
        return [{"name": b["name"], "median_s": b["stats"]["median"], **b.get("extra_info", {})}
                for b in data.get("benchmarks", [])]
    rows = []
    try:
        lines = rows_file.read_text().splitlines() if rows_file is not None else []
    except OSError:
        lines = []
    for line in lines:
        try:
            rows.append({**json.loads(line), "partial": True})
        except ValueError:  # a line cut short when the process was killed
            continue
    return rows


# ----------------------------------------------------------------------------------------------------- end to end


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        # Step boundaries: the compute stream must have finished this step's kernels before the clock is read (not
        # the whole device: ZenFlow's copy streams overlap the next step by design, and a training loop never waits).
        torch.cuda.current_stream(device).synchronize()


def _pinned_allocator_bytes() -> int | None:
    """Pinned bytes torch's caching host allocator holds now (``pin_memory=True`` tensors, rounded up to powers of
    two, cached blocks included). ZenFlow's slabs are page-locked in place instead and show in its own stats."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def _rss_bytes() -> int | None:
    """This process's resident host memory (pinned pages included), from /proc; None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # Return cached pinned blocks to the driver, so that the next provider's pinned figure is its own.
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and ("out of memory" in msg or "cannot allocate" in msg)


def _add_note(res: dict[str, Any], note: str) -> None:
    res["note"] = f"{res['note']}; {note}" if res.get("note") else note


def run_provider(provider: OptimizerProvider, s: E2ESettings, device: torch.device, deadline: float) -> dict[str, Any]:
    """Fine-tune the decoder with one provider; everything it allocates is local and freed when it returns."""
    res: dict[str, Any] = {"name": provider.name, "label": provider.label}
    if provider.note:
        res["note"] = provider.note
    opt = None
    try:
        torch.manual_seed(0)
        pinned0, rss0 = _pinned_allocator_bytes(), _rss_bytes()
        t0 = time.perf_counter()
        with torch.device(device):
            model = Decoder(s.model).to(getattr(torch, s.dtype))
        if device.type == "cuda":
            # After the fp32 init and its bf16 copy: the peak should be training's, not the model build's. What is
            # allocated now is the model (and anything an earlier provider left behind: recorded, to see it).
            torch.cuda.reset_peak_memory_stats(device)
            res["gpu_allocated_at_start_bytes"] = torch.cuda.memory_allocated(device)
        params = list(model.parameters())
        res["params"] = sum(p.numel() for p in params)
        opt = provider.build(params)
        gen = torch.Generator().manual_seed(1)
        x = torch.randint(0, s.model.vocab, (s.batch, s.seq), generator=gen).to(device)
        y = torch.randint(0, s.model.vocab, (s.batch, s.seq), generator=gen).to(device)
        res["setup_s"] = time.perf_counter() - t0
        step_log: list[tuple[float, float]] = []

        def train_step() -> None:
            t_start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model.loss(x, y).backward()
            # Fwd+bwd and the optimizer step timed apart: this sync changes no provider's overlap (ZenFlow's host
            # work runs on its own thread; torchao's step waits on its copy events anyway).
            _sync(device)
            t_mid = time.perf_counter()
            opt.step()
            _sync(device)
            step_log.append((t_mid - t_start, time.perf_counter() - t_mid))

        # Warm-up: ZenFlow's own warm-up ("auto" measures the step time there), then the first selection step
        # and the rest of that window, whose host job compiles or loads the numba kernel; others: 2 steps.
        window, unit, timed = 1, 1, s.timed_steps
        t0 = time.perf_counter()
        if provider.zenflow:
            for _ in range(steps_before_selection(opt) + 1):
                train_step()
            st = opt.stats()
            window = int(st["update_interval"])
            for _ in range(window - 1):
                train_step()
            res.update(topk_ratio=st["topk_ratio"], update_interval=window, select_interval=st["select_interval"],
                       cpu_threads=st["cpu_threads"], accumulate=st["accumulate"])
            # Whole selection intervals where the cap allows: each holds one selection step, which waits for the
            # host job in flight, so a timed loop without one would leave that wait out of ms/step (nothing is
            # selected at r = 0: whole windows there, and the synchronous baseline keeps its few timed steps).
            select = int(st["select_interval"] or window)
            if st["topk_ratio"] and select <= max(s.max_timed_steps, window):
                unit = select
            if st.get("auto_reason"):
                res["auto_reason"] = st["auto_reason"]
            if st["topk_ratio"] == 0 and window == 1:
                timed = s.sync_timed_steps
        else:
            for _ in range(2):
                train_step()
            if provider.name == "torchao_offload":
                timed = s.sync_timed_steps
        unit = max(unit, window)
        timed = min(max(timed, unit), max(s.max_timed_steps, unit))
        timed = math.ceil(timed / unit) * unit  # whole windows (whole selection intervals where they fit)
        res["warmup_s"] = time.perf_counter() - t0
        stats0 = getattr(opt, "stats", dict)()
        step_log.clear()
        t0 = time.perf_counter()
        for i in range(timed):
            if i % window == 0 and time.perf_counter() > deadline and i:
                _add_note(res, f"stopped after {i} of {timed} steps: suite time budget")
                break
            train_step()
        wall = time.perf_counter() - t0
        n = len(step_log)
        stats1 = getattr(opt, "stats", dict)()
        step_s = wall / n
        res.update({
            "timed_steps": n,
            "step_s": step_s,
            "fwd_bwd_s": sum(a for a, _ in step_log) / n,
            "opt_step_s": sum(b for _, b in step_log) / n,
            "tokens_per_s": s.batch * s.seq / step_s,
        })
        res["opt_share"] = res["opt_step_s"] / step_s
        if stats1:
            res["stall_fraction"] = (stats1["stall_s"] - stats0["stall_s"]) / wall
            res["selections_timed"] = stats1["selections"] - stats0["selections"]
            if res["selections_timed"] == 0 and res.get("topk_ratio"):
                _add_note(res, "no selection step timed: ms/step leaves out its wait for the host job")
        res.update(optimizer_memory(opt, params))
        if device.type == "cuda":
            res["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
            res["gpu_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        pinned1, rss1 = _pinned_allocator_bytes(), _rss_bytes()
        if pinned0 is not None and pinned1 is not None:
            res["pinned_allocator_bytes"] = pinned1 - pinned0
        if rss0 is not None and rss1 is not None:
            res["host_rss_growth_bytes"] = rss1 - rss0
    except Exception as exc:  # one provider's failure is a result, not the end of the suite
        res["error"] = "out of memory" if _is_oom(exc) else f"{type(exc).__name__}"
        res["message"] = str(exc)[:800]
        res["traceback"] = traceback.format_exc()[-3000:]
    finally:
        if opt is not None:
            try:
                close_optimizer(opt)
            except Exception as exc:  # a failed worker re-raises here; the result already says what happened
                res.setdefault("close_error", f"{type(exc).__name__}: {exc}"[:400])
    return res


def e2e_providers(*, quick: bool) -> dict[str, OptimizerProvider]:
    # A hung host worker must become an error within the suite's budget, not after the default 10 minutes.
    all_p = optimizer_providers(extra=("torchao_offload", "zenflow_host", "zenflow_host_gib", "sync_offload_host"),
                                zenflow_kwargs={"worker_timeout": 120.0})
    # The synchronous baseline as ZeRO-Offload runs it: the bf16 gradient to the host each step, not an fp32 device
    # sum of one step copied out (what accumulate="auto" picks on a GPU): half the PCIe bytes, no fp32 device buffer.
    all_p["sync_offload"] = dataclasses.replace(all_p.pop("sync_offload_host"), name="sync_offload")
    # What a row's figures rest on that its label does not say (the model is bf16).
    for name, note in (("torch_adamw_fused", "bf16 weights with bf16 moments and no fp32 master: 4 B/param of state"),
                       ("torchao_offload", "bf16 master and moments on the host (ZenFlow's are fp32)")):
        if name in all_p:
            all_p[name] = dataclasses.replace(all_p[name], note=note)
    # In the order that matters if the budget runs out (the last ones then get shorter timed loops, or none): the
    # two baselines, the default knobs, "auto" (what a user gets), then the other modes.
    names = ["torch_adamw_fused", "sync_offload", "zenflow", "zenflow_auto", "zenflow_host", "zenflow_host_gib",
             "torchao_offload"]
    if quick and "zenflow_auto" in all_p:
        names.remove("zenflow")
    return {n: all_p[n] for n in names if n in all_p}


# ----------------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--quick", action="store_true", help="smaller batch, fewer steps and providers (~4 minutes)")
    ap.add_argument("--dry-run", action="store_true", help="the whole pipeline on CPU with a tiny decoder")
    ap.add_argument("--skip-tests", action="store_true", help="skip phases 1-2 (pytest -m gpu tests, stress tests)")
    ap.add_argument("--skip-kernels", action="store_true", help="skip phase 3 (device kernel benches)")
    ap.add_argument("--providers", nargs="*", default=None, help="end-to-end providers to run (default: all)")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print(NEEDS_GPU, file=sys.stderr)
        return 2
    start = time.perf_counter()
    budget = BUDGET_QUICK_S if args.quick else BUDGET_S
    deadline = start + budget
    out: Path = args.outdir
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if cuda and not args.dry_run else "cpu")
    machine = machine_info()
    try:
        machine["host_memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    report: dict[str, Any] = {"machine": machine, "mode": "dry-run" if args.dry_run else ("quick" if args.quick
                                                                                          else "full")}
    report["install"] = INSTALL
    print("# " + ", ".join(f"{k} {machine.get(k)}" for k in ("python", "torch", "triton", "numba", "numpy", "git_rev")
                           if k in machine), flush=True)
    failed = False

    def remaining() -> float:
        return deadline - time.perf_counter()

    def save() -> None:
        report["wall_s"] = time.perf_counter() - start
        (out / "gpu_suite.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        (out / "gpu_suite.md").write_text(report_markdown(report))

    settings = e2e_settings(quick=args.quick, dry_run=args.dry_run)
    report["e2e_settings"] = asdict(settings)
    report["e2e_params"] = settings.model.num_params()
    py = sys.executable
    scratch = Path(tempfile.mkdtemp(prefix="gpu_suite_"))  # JUnit XML: summarized in the report, not left in OUTDIR

    def pytest_phase(name: str, pytest_args: list[str], timeout: float,
                     extra_env: dict[str, str] | None = None) -> dict[str, Any]:
        junit = scratch / f"{name}.xml"
        # -v: each test's name and outcome reach the log as it ends, which is what a phase killed at its limit
        # leaves (no JUnit XML then); --durations: what to shrink if a phase outgrows its share.
        r = run_subprocess(name, [py, "-m", "pytest", *pytest_args, "-v", "--durations=15", "-p", "no:cacheprovider",
                                  "-o", f"faulthandler_timeout={TEST_STACKS_AFTER_S}", f"--junitxml={junit}"], out,
                           timeout, extra_env)
        r.update(junit_summary(junit))
        return r

    # Phases 1-3 first, while this process holds no GPU memory. Their shares of the budget: measured on no
    # GPU yet, so generous; the end-to-end phase gets the rest and stops early (recorded) if it runs out.
    if not args.skip_tests:
        print("# phase 1: pytest -m gpu tests", flush=True)
        r = pytest_phase("gpu_tests", ["-m", "gpu", "tests", f"--ignore={STRESS_TESTS}"],
                         min(0.35 * budget, remaining() - 60))
        # pytest exits 5 when every test was deselected (no -m gpu tests): not a failure.
        failed |= r.get("returncode") not in (0, 5) or bool(r.get("failures") or r.get("errors"))
        report["gpu_tests"] = r
        save()
        # Its own phase and time limit: the checks against the dense simulation run on the host (~1-3 s per step at
        # these sizes, 16 cores; an estimate, never measured), and must not eat the other tests' time.
        print("# phase 2: stress tests", flush=True)
        r = pytest_phase("stress_tests", ["-m", "gpu", STRESS_TESTS], min(0.2 * budget, remaining() - 60))
        failed |= r.get("returncode") not in (0, 5) or bool(r.get("failures") or r.get("errors"))
        report["stress_tests"] = r
        save()
    if not args.skip_kernels:
        print("# phase 3: device kernel benches", flush=True)
        bjson = out / "device_kernels.json"
        bench_args = ["bench/bench_device_kernels.py", f"--benchmark-json={bjson}"]
        if args.dry_run:
            bench_args.append("--benchmark-disable")
        rows_file = scratch / "device_kernels.jsonl"  # each row as it is measured: kept if the phase is stopped
        r = pytest_phase("device_kernels", bench_args, min(0.15 * budget, remaining() - 60),
                         {"ZENFLOW_BENCH_ROWS": str(rows_file)})
        r["rows"] = kernel_bench_rows(bjson, rows_file)
        r["goals"] = {bench: kernel_goals(r["rows"], bench) for bench in GOALS_BENCHES}
        failed |= r.get("returncode") not in (0, 5)
        report["device_kernels"] = r
        save()

    print(f"# phase 4: end to end, {settings.model.num_params() / 1e9:.2f}B params on {device}", flush=True)
    if device.type == "cuda":
        # Only now: querying the device creates this process's CUDA context, which phases 1-2 did not need.
        props = torch.cuda.get_device_properties(device)
        machine.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    providers = e2e_providers(quick=args.quick)
    if args.providers:
        providers = {k: v for k, v in providers.items() if k in args.providers}
    rows: list[dict[str, Any]] = []
    skipped = {"torchao_offload": "torchao does not import (or is unusable here)"}
    if (reason := auto_unavailable_reason()) is not None:
        skipped["zenflow_auto"] = reason
    if device.type != "cuda":
        skipped["torchao_offload"] = "torchao's CPUOffloadOptimizer needs CUDA"
        providers.pop("torchao_offload", None)
    for name, why in skipped.items():
        if name not in providers and (args.providers is None or name in args.providers):
            rows.append({"name": name, "label": name, "skipped": why})
    try:
        from zenflow_triton.kernels.cpu_adamw import warmup

        t0 = time.perf_counter()
        warmup((torch.float32,), (None, torch.bfloat16))  # compile once, outside every provider's timing
        report["numba_warmup_s"] = time.perf_counter() - t0
    except Exception as exc:  # the ZenFlow providers will then fail and say why; the others still run
        report["numba_warmup_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import numba

        # Which layer runs the worker's and the adder's parallel regions side by side (omp or tbb: "threadsafe").
        report["numba_threading_layer"] = numba.threading_layer()
    except (ImportError, ValueError) as exc:  # ValueError: no parallel region has run yet
        report["numba_threading_layer"] = f"unknown ({exc})"
    hard_deadline = start + (HARD_LIMIT_QUICK_S if args.quick else HARD_LIMIT_S)
    running: dict[str, Any] = {}

    def on_hang(stacks: str) -> None:
        # "hung": PROVIDER_GRACE_S past its share; "time limit": the suite's hard limit came first (maybe just slow).
        p, since, why = running["provider"], running["since"], running["why"]
        rows.append({"name": p.name, "label": p.label, "error": why, "stacks": stacks, "message":
                     f"no result {time.perf_counter() - since:.0f} s after it started (its share of the budget: "
                     f"{running['share']:.0f} s); every thread's stack is in 'stacks'"})
        rows.extend({"name": q.name, "label": q.label, "skipped": f"not run: {p.name} stopped the suite ({why})"}
                    for q in providers.values() if all(r["name"] != q.name for r in rows))
        report["e2e"], report["stopped_at"] = rows, p.name
        save()
        print(f"#     STOPPED ({why}): {p.name}; report written to {out}, exiting with status 3", flush=True)
        os._exit(3)

    dog = Watchdog(on_hang)
    for p in providers.values():
        if remaining() < 20:
            rows.append({"name": p.name, "label": p.label, "skipped": "suite time budget exhausted"})
            continue
        print(f"#   {p.name} (load {load_average()[0]:.1f}, {remaining():.0f} s left)", flush=True)
        # The first providers may not use the last ones' share: each gets an equal part of what is left.
        left = [q for q in providers.values() if not any(r["name"] == q.name for r in rows)]
        now = time.perf_counter()
        share = remaining() / max(1, len(left))
        hung_after, limit_after = share + PROVIDER_GRACE_S, hard_deadline - now
        running.update(provider=p, since=now, share=share, why="hung" if hung_after <= limit_after else "time limit")
        with dog.armed(min(hung_after, limit_after)):
            res = run_provider(p, settings, device, now + share)
        _release_memory()
        rows.append(res)
        failed |= "error" in res and res["error"] != "out of memory"
        line = (f"{res['step_s'] * 1e3:.0f} ms/step, {res['tokens_per_s']:.0f} tok/s" if "step_s" in res
                else f"{res.get('error')}: {res.get('message', '')[:200]}")
        print(f"#     {line}", flush=True)
        report["e2e"] = rows
        save()
    report["e2e"] = rows
    save()
    shutil.rmtree(scratch, ignore_errors=True)
    print(report_markdown(report))
    print(f"# wrote {out / 'gpu_suite.json'} and {out / 'gpu_suite.md'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
