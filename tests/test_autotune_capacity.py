"""autotune/capacity.py and the CLI's capacity answer (--params alone, --max-params): the bytes per mode from the
layout formulas, the largest model as the tighter memory, and the machines table bench/plot_docs.py shares."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from zenflow_triton.autotune import __main__ as cli
from zenflow_triton.autotune import capacity
from zenflow_triton.autotune.capacity import fit_report, largest, machines_table, max_report, modes

ROOT = Path(__file__).resolve().parent.parent
# A machine as this_machine() reports it: 80 GB GPU, 256 GB of host memory available now.
MACHINE = (80e9, "test GPU", 256e9, "MemAvailable")


def test_bytes_per_mode_bf16() -> None:
    """A bf16 model at r = 0.1: weight 2 + gradient 2 (none with grads_in_backward) + the device state (4 + 1.2 or
    1.2) on the GPU; the host slab (18; "host" 22 with two window sums, 18 with one; 24 and 20 with the capture
    slot of grads_in_backward)."""
    got = {m.label: (m.device, m.host) for m in modes()}
    assert got['accumulate="device"'] == (pytest.approx(9.2), 18.0)
    assert got['accumulate="host"'] == (pytest.approx(5.2), 22.0)
    assert got['accumulate="host", overlap_steps=1'] == (pytest.approx(5.2), 18.0)
    assert got['"host" + grads_in_backward'] == (pytest.approx(3.2), 24.0)
    assert got['"host" + grads_in_backward, overlap_steps=1'] == (pytest.approx(3.2), 20.0)
    assert got['"host" + grads_in_backward, state_dtype="bfloat16", overlap_steps=1'] == (pytest.approx(3.2), 16.0)
    # host_snapshot=False: the bf16 model's snapshot goes (2 B), on top of overlap_steps=1 where that cuts
    assert got['accumulate="device", host_snapshot=False'] == (pytest.approx(9.2), 16.0)
    assert got['"host" + grads_in_backward, overlap_steps=1, host_snapshot=False'] == (pytest.approx(3.2), 18.0)
    assert got['"host" + grads_in_backward, state_dtype="bfloat16", overlap_steps=1, host_snapshot=False'] == (
        pytest.approx(3.2), 14.0)
    assert not any("host_snapshot" in m.label for m in modes(param_bytes=4))  # an fp32 model has no snapshot


def test_the_issue_bar_per_machine() -> None:
    """Issue 29's done-when, from the formulas: on each machine the best mode fits at least FSDP2 offload's largest
    model with bf16 moments and at least ZeRO-Offload's with fp32 moments."""
    for _, gpu, host in capacity.MACHINES:
        best = {state: max(largest(m.device, m.host, gpu, host)[0] for m in modes()
                           if ('state_dtype="bfloat16"' in m.label) == (state == "bfloat16"))
                for state in ("float32", "bfloat16")}
        assert best["bfloat16"] >= largest(0.0, capacity.PEERS_HOST["FSDP2 `CPUOffloadPolicy`"], gpu, host)[0]
        assert best["float32"] >= largest(0.0, capacity.PEERS_HOST["ZeRO-Offload stage 2"], gpu, host)[0]


def test_largest_is_the_tighter_memory() -> None:
    assert largest(8.0, 16.0, 24e9, 64e9) == (pytest.approx(0.8 * 24e9 / 8), "GPU")
    assert largest(8.0, 16.0, 141e9, 128 * 2**30) == (pytest.approx(0.9 * 128 * 2**30 / 16), "host")
    assert largest(0.0, 16.0, 80e9, 256e9) == (pytest.approx(0.9 * 256e9 / 16), "host")  # a peer: host bytes only
    assert largest(8.0, 0.0, None, 1e9) == (math.inf, "GPU")


def test_fit_report_says_which_memory_refuses() -> None:
    text = fit_report(7e9, machine=MACHINE)
    rows = {line.split("  ")[1].strip(): line for line in text.splitlines()[3:]}
    # "device": 9.2 × 7e9 = 64.4 GB > 80% of 80 GB; "host": 5.2 × 7e9 on the GPU, 22 × 7e9 = 154 GB on the host
    assert rows['accumulate="device"'].endswith("no (GPU memory)")
    assert rows['accumulate="host"'].endswith("yes")
    assert "test GPU" in text and "MemAvailable" in text


def test_max_report_numbers() -> None:
    text = max_report(machine=MACHINE)
    line = next(x for x in text.splitlines() if x.strip().startswith('accumulate="host"'))
    assert f"{256e9 / 22 / 1e9:.2f}B" in line and line.endswith("host")
    line = next(x for x in text.splitlines() if x.strip().startswith('accumulate="device"'))
    assert f"{0.8 * 80e9 / 9.2 / 1e9:.2f}B" in line and line.endswith("GPU")


def test_cpu_tensors_count_both_against_the_host() -> None:
    text = max_report(machine=(None, "no CUDA device", 27e9, "MemAvailable"))
    line = next(x for x in text.splitlines() if x.strip().startswith('accumulate="device"'))
    assert f"{27e9 / (9.2 + 18) / 1e9:.2f}B" in line


def test_plot_docs_shares_the_rule_and_the_peers() -> None:
    spec = importlib.util.spec_from_file_location("plot_docs", ROOT / "bench" / "plot_docs.py")
    plot_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_docs)
    assert plot_docs.largest is capacity.largest and plot_docs.PEERS_HOST is capacity.PEERS_HOST
    assert plot_docs.MACHINES is capacity.MACHINES
    # The peers' rows of the machines table are the record's (the docs' table) verbatim.
    record = (ROOT / "bench/results/memory-2026-12-07.md").read_text(encoding="utf-8").splitlines()
    peers = [line for line in machines_table().splitlines()
             if "host B/param) |" in line and not line.startswith("| ZenFlowAdamW")]
    assert len(peers) == len(capacity.PEERS_HOST) and all(line in record for line in peers)


def test_cli_params_alone_and_max_params(capsys) -> None:
    assert cli.main(["--params", "7B"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("7B parameters") and 'accumulate="host"' in out and "fits" in out
    assert cli.main(["--max-params", "--param-dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "largest model per mode (4 B per parameter" in out and "16 " in out  # fp32 "device": 16 host B/param


def test_module_prints_the_machines_table(capsys) -> None:
    assert capacity.main() == 0
    out = capsys.readouterr().out
    assert "| 24 GB GPU / 64 GB host |" in out and "FSDP2 `CPUOffloadPolicy` (16 host B/param)" in out


def test_a_layout_leaner_at_overlap_steps_1_gets_its_own_row(monkeypatch) -> None:
    """Rows follow the formula: where host_views holds less with overlap_steps=1 (one window sum: "host"), that
    setting is a row of its own; where it holds the same ("device"), there is none."""
    rows = {m.label: m.host for m in modes()}
    assert rows['accumulate="host", overlap_steps=1'] == 18.0 and rows['accumulate="host"'] == 22.0
    assert not any(label.startswith('accumulate="device"') and "overlap_steps" in label for label in rows)
    real = capacity.host_bytes_per_element

    def leaner(knobs, mode, param_bytes):  # a layout where "device" too held less at overlap_steps=1
        return real(knobs, mode, param_bytes) - (1 if mode == "device" and knobs.overlap_steps == 1 else 0)

    monkeypatch.setattr(capacity, "host_bytes_per_element", leaner)
    rows = {m.label: m.host for m in modes()}
    assert rows['accumulate="device", overlap_steps=1'] == 17.0 and rows['accumulate="device"'] == 18.0
