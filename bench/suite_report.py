"""The GPU suite's report (``gpu_suite.md``) from its JSON, and the device kernels' goals it judges.

Pure functions of the report's dictionaries: no torch, no GPU, so they are tested on hand-written results.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["GOALS_BENCH", "GOALS_BENCHES", "KERNEL_GOALS", "e2e_markdown", "goals_markdown", "kernel_goals",
           "report_markdown", "stress_line"]

# The device kernels' goals, judged on one step's grouped fused step over the weights of 8 layers of a 1B decoder
# (bench_device_kernels.py's test_fused_steps_grouped): (figure, at least or at most, target, what it means).
# ratio_to_torch_fused >= 2 asks for at most 7 bytes per bf16 parameter at torch's share of the bandwidth: by 32-byte
# sectors the step with device sums (accumulate="device") moves 14.0 at r = 0.1, so it reaches at best 1.0
# ("torch_fused_byte_ratio"); without them (accumulate="host", grads_in_backward) 6.0, at best 2.3. Both are judged,
# each against its bound.
KERNEL_GOALS = (
    ("ratio_to_copy", "min", 0.8, "streams at >= 80% of the bandwidth of a device copy of the same bytes"),
    ("ratio_to_torch_fused", "min", 2.0, "costs <= 0.5x torch.optim.AdamW(fused=True).step() on the same weights"),
    ("enqueue_us_per_param", "max", 10.0, "<= 10 us of host time per parameter to issue the step's launches"),
)
GOALS_BENCH = "test_fused_steps_grouped"
GOALS_BENCHES = (GOALS_BENCH, "test_fused_steps_grouped_no_acc")


def kernel_goals(rows: list[dict[str, Any]], bench: str = GOALS_BENCH) -> list[dict[str, Any]]:
    """Each goal of ``KERNEL_GOALS`` with the figure ``bench`` measured and whether it is met (None when not
    measured)."""
    row = next((r for r in rows if r.get("name") == bench), {})
    out = []
    for key, sense, target, what in KERNEL_GOALS:
        value = row.get(key)
        met = None if value is None else (value >= target if sense == "min" else value <= target)
        out.append({"figure": key, "value": value, "target": target, "sense": sense, "goal": what, "met": met})
    return out


def goals_markdown(goals: list[dict[str, Any]], bench: str = GOALS_BENCH) -> str:
    lines = [f"Goals, from `{bench}`:", "", "| goal | figure | measured | target | met |", "|---|---|---:|---:|---|"]
    for g in goals:
        value = "–" if g["value"] is None else f"{g['value']:.2f}"
        met = {None: "not measured", True: "yes", False: "NO"}[g["met"]]
        bound = ">=" if g["sense"] == "min" else "<="
        lines.append(f"| {g['goal']} | `{g['figure']}` | {value} | {bound} {g['target']:g} | {met} |")
    return "\n".join(lines)


def _gib(x: float | None) -> str:
    return "–" if x is None else f"{x / 2**30:.1f}"


def e2e_markdown(rows: list[dict[str, Any]]) -> str:
    base = next((r["step_s"] for r in rows if r["name"] == "torch_adamw_fused" and "step_s" in r), None)
    lines = ["| provider | ms/step | tokens/s | × no-offload | optimizer share | stall | GPU peak GiB "
             "| pinned GiB (optimizer) | pinned GiB (torch allocator) | host RSS growth GiB | r / U | sums "
             "| timed steps (selections) | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|"]
    for r in rows:
        if "step_s" not in r:
            what = r.get("error", r.get("skipped"))
            if "stacks" in r:
                what = f"STOPPED ({what}): every thread's stack is in gpu_suite.json (its 'stacks')"
            lines.append(f"| {r['label']} | – | – | – | – | – | – | – | – | – | – | – | – | {what} |")
            continue
        ratio = f"{r['step_s'] / base:.2f}" if base else "–"
        stall = f"{r['stall_fraction']:.0%}" if "stall_fraction" in r else "–"
        ru = f"{r['topk_ratio']:.3g} / {r['update_interval']}" if "topk_ratio" in r else "–"
        timed = f"{r['timed_steps']}" + (f" ({r['selections_timed']})" if "selections_timed" in r else "")
        lines.append(
            f"| {r['label']} | {r['step_s'] * 1e3:.0f} | {r['tokens_per_s']:.0f} | {ratio} | {r['opt_share']:.0%} "
            f"| {stall} | {_gib(r.get('gpu_peak_bytes'))} | {_gib(r.get('pinned_bytes'))} "
            f"| {_gib(r.get('pinned_allocator_bytes'))} | {_gib(r.get('host_rss_growth_bytes'))} | {ru} "
            f"| {r.get('accumulate', '–')} | {timed} | {r.get('note', '')} |")
    return "\n".join(lines)


def stress_line(r: dict[str, Any] | None) -> str:
    """One sentence: did the stress tests pass, fail, or not run."""
    if not r:
        return "not run"
    if r.get("error"):
        return f"did not finish: {r['error']} (see stress_tests.log)"
    if r.get("failures") or r.get("errors"):
        return f"FAILED: {', '.join(r.get('failed', []))} (see stress_tests.log)"
    ran = r.get("tests", 0) - r.get("skipped", 0)
    return f"passed: {ran} of {r.get('tests', 0)} tests ran and passed in {r.get('seconds', 0):.0f} s" if ran else (
        "all skipped (no CUDA device)")


def report_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    s = report["e2e_settings"]
    parts = [
        f"# gpu_suite {m['date']}",
        f"GPU: {m.get('gpu', 'none (dry run)')}; host: {m['nproc']} x {m['cpu_model']}; torch {m['torch']}; "
        f"git {m['git_rev']}; mode: {report['mode']}; wall {report['wall_s']:.0f} s",
        "## GPU tests",
        "```\n" + json.dumps({k: v for k, v in report.get("gpu_tests", {}).items() if k != "tail"}, indent=1)
        + "\n```",
        "## Stress tests (correct under stress?)",
        stress_line(report.get("stress_tests")),
        "## Device kernels",
    ]
    rows = report.get("device_kernels", {}).get("rows", [])
    if rows:
        nan = float("nan")
        # The rates are on the device clock (device_s); wall µs is pytest-benchmark's median, host issue included.
        parts.append("| bench | device µs | wall µs | GB/s | × copy | × torch fused (faster > 1) | its byte bound "
                     "| enqueue µs/param |\n|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(
            f"| {r['name']} | {r.get('device_s', nan) * 1e6:.0f} | {r['median_s'] * 1e6:.0f} "
            f"| {r.get('GB/s', nan):.0f} "
            f"| {r.get('ratio_to_copy', nan):.2f} | {r.get('ratio_to_torch_fused', nan):.2f} "
            f"| {r.get('torch_fused_byte_ratio', nan):.2f} | {r.get('enqueue_us_per_param', nan):.1f} |"
            for r in rows))
    else:
        parts.append(f"no results ({report.get('device_kernels', {}).get('error', 'see the log')})")
    parts += [goals_markdown(kernel_goals(rows, bench), bench) for bench in GOALS_BENCHES]
    d = s["model"]
    parts += [
        "## End to end",
        f"Decoder {d['n_layer']} x d{d['d_model']}, vocab {d['vocab']} ({report.get('e2e_params', 0) / 1e9:.2f}B "
        f"params, {s['dtype']}), batch {s['batch']} x {s['seq']} tokens.",
        e2e_markdown(report.get("e2e", [])),
    ]
    return "\n\n".join(parts) + "\n"
