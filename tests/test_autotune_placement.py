"""autotune/placement.py: accumulate="auto"'s rule, with synthetic numbers."""

from __future__ import annotations

import pytest

from zenflow_triton.autotune.placement import PLACEMENT_FRACTION, place_accumulation

GIB = 2**30
P = 7_000_000_000  # a 7B model's offloaded elements


def test_cpu_tensors_always_keep_the_sum_on_the_device() -> None:
    got = place_accumulation(device="cpu", offloaded_numel=P, topk_ratio=0.1, available_bytes=0)
    assert got.accumulate == "device" and "CPU tensors" in got.reason


def test_fits_with_margin_keeps_the_device_path() -> None:
    need = (4 + 12 * 0.1) * P  # 36.4 GB
    got = place_accumulation(device="cuda", offloaded_numel=P, topk_ratio=0.1, available_bytes=need / 0.89)
    assert got.accumulate == "device"
    assert got.device_bytes == pytest.approx({"device": need, "host": 12 * 0.1 * P})


def test_too_little_memory_moves_the_sum_to_the_host() -> None:
    need = (4 + 12 * 0.1) * P
    got = place_accumulation(device="cuda", offloaded_numel=P, topk_ratio=0.1, available_bytes=need / 0.91)
    assert got.accumulate == "host" and "does not fit" in got.reason
    # the boundary is the margin
    at = place_accumulation(device="cuda", offloaded_numel=P, topk_ratio=0.1,
                            available_bytes=need / PLACEMENT_FRACTION)
    assert at.accumulate == "device"


def test_unknown_memory_keeps_the_device_path_and_rates_give_the_host_cost() -> None:
    got = place_accumulation(device="cuda", offloaded_numel=1000, topk_ratio=0.5, available_bytes=None)
    assert got.accumulate == "device" and got.host_step_s is None
    got = place_accumulation(device="cuda", offloaded_numel=10**9, topk_ratio=0.1, available_bytes=1 * GIB,
                             grad_bytes=2, d2h_bytes_per_s=25e9, host_add_bytes_per_s=20e9)
    # 2 GB over PCIe at 25 GB/s, 10 GB through host memory at 20 GB/s
    assert got.accumulate == "host" and got.host_step_s == pytest.approx(0.08 + 0.5)
    assert "ms per step" in got.reason


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        place_accumulation(device="cuda", offloaded_numel=-1, topk_ratio=0.1, available_bytes=1)
    with pytest.raises(ValueError):
        place_accumulation(device="cuda", offloaded_numel=1, topk_ratio=1.5, available_bytes=1)


def test_optimizer_auto_reports_the_choice_on_cpu_tensors() -> None:
    import torch

    from zenflow_triton import ZenFlowAdamW

    w = torch.nn.Parameter(torch.randn(64, 64))
    with ZenFlowAdamW([w], accumulate="auto", warmup_steps=0) as opt:
        w.grad = torch.randn(64, 64)
        opt.step()
        st = opt.stats()
        assert st["accumulate"] == "device"
        assert "no device memory to save" in st["accumulate_reason"]
