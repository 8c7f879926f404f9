"""What stats() reports and how it is documented (issue 20 item 14): per-step views, a docs/telemetry.md row for
every key, and one summary warning for the matrices that stay resident."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest
import torch
from test_optimizer import MIN_OFFLOAD, Net, train_steps
from torch import nn

import zenflow_triton.pipeline as zpipe
from zenflow_triton import ZenFlowAdamW

TELEMETRY = Path(__file__).resolve().parent.parent / "docs" / "telemetry.md"


def test_per_step_views(monkeypatch) -> None:
    original = zpipe.run_host_job
    delay = 0.05

    def slow(*args):
        time.sleep(delay)
        return original(*args)

    monkeypatch.setattr(zpipe, "run_host_job", slow)
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), topk_ratio=0.1, update_interval=2, overlap=False,
                       min_offload_numel=MIN_OFFLOAD, warmup_steps=0)
    assert opt.stats()["ms_per_step"] == 0.0 and opt.stats()["stall_ms_per_step"] == 0.0  # no step yet
    train_steps(model, opt, range(6))
    st = opt.stats()
    assert st["ms_per_step"] == pytest.approx(1e3 * (st["device_opt_s"] + st["stall_s"]) / st["steps"])
    assert st["stall_ms_per_step"] == pytest.approx(1e3 * st["stall_s"] / st["steps"])
    # overlap=False waits for every window's job: at least the injected delay per window, spread over the steps.
    assert st["stall_ms_per_step"] >= 1e3 * delay * st["windows"] / st["steps"] * 0.9
    assert st["ms_per_step"] >= st["stall_ms_per_step"]
    opt.close()


def _documented_keys() -> set[str]:
    text = TELEMETRY.read_text(encoding="utf-8")
    section = text.split("## What `stats()` reports", 1)[1].split("\n## ", 1)[0]
    first_cells = re.findall(r"^\| ([^|]+) \|", section, flags=re.M)
    return {key for cell in first_cells for key in re.findall(r"`([a-z_0-9]+)`", cell)}



def test_every_stats_key_is_in_the_telemetry_table() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), topk_ratio=0.1, update_interval=2, min_offload_numel=MIN_OFFLOAD,
                       warmup_steps=0)
    train_steps(model, opt, range(3))
    keys = set(opt.stats())
    missing = keys - _documented_keys()
    opt.close()
    assert not missing, f"stats() keys without a row in docs/telemetry.md's stats table: {sorted(missing)}"


def test_matrices_kept_resident_get_one_summary_warning(caplog) -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(32, 24, dtype=torch.float64)), nn.Parameter(torch.randn(24, 16).t()),
              nn.Parameter(torch.randn(40, 20, dtype=torch.float64)), nn.Parameter(torch.randn(32, 24)),
              nn.Parameter(torch.randn(7, dtype=torch.float64))]
    opt = ZenFlowAdamW(params, min_offload_numel=256, warmup_steps=0)
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
    records = [r for r in caplog.records if "resident" in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert message.startswith("zenflow_triton: 3 parameter matrices stay resident")
    for shape in ("(32, 24) float64", "(16, 24) float32 non-contiguous", "(40, 20) float64"):
        assert shape in message
    assert "(7,)" not in message and "model.float()" in message and "contiguous" in message
    opt.close()


def test_clipping_keys_are_there_and_none_without_clipping() -> None:
    """Issue 30 item 6: the table lists ``max_grad_norm`` and ``last_grad_norm`` as None without clipping."""
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), topk_ratio=0.1, update_interval=2, min_offload_numel=MIN_OFFLOAD)
    assert opt.stats()["max_grad_norm"] is None and opt.stats()["last_grad_norm"] is None
    train_steps(model, opt, range(3))
    st = opt.stats()
    assert st["max_grad_norm"] is None and st["last_grad_norm"] is None
    opt.close()
    clipped = ZenFlowAdamW(model.parameters(), topk_ratio=0.1, update_interval=2, min_offload_numel=MIN_OFFLOAD,
                           max_grad_norm=1.0)
    assert clipped.stats()["max_grad_norm"] == 1.0 and clipped.stats()["last_grad_norm"] is None  # no step yet
    train_steps(model, clipped, range(2))
    assert isinstance(clipped.stats()["last_grad_norm"], float)
    clipped.close()
