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


# Host memory weighed too (issue 29): a bf16 7B model's host slab per mode, today's layout (18 and 26 B/param).
HOST = {"device": 18.0 * P, "host": 26.0 * P}
DEVICE_NEED = (4 + 12 * 0.1) * P


@pytest.mark.parametrize(("device_room", "host_room", "want", "bound"), [
    (DEVICE_NEED / 0.89, 1e15, "device", None),          # both fit: the fewer PCIe bytes
    (DEVICE_NEED / 0.91, 27.0 * P, "host", "device"),    # device memory decides, the host holds "host"
    (DEVICE_NEED / 0.91, 20.0 * P, "device", "host"),    # "host" would not fit the host: host memory decides
    (DEVICE_NEED / 0.89, 10.0 * P, "device", "host"),    # nothing fits the host: the pre-flight will refuse
    (DEVICE_NEED / 0.91, 10.0 * P, "host", "device"),    # neither fits: today's rule
])
def test_the_mode_that_fits_both_memories(device_room, host_room, want, bound) -> None:
    got = place_accumulation(device="cuda", offloaded_numel=P, topk_ratio=0.1, available_bytes=device_room,
                             host_bytes=HOST, host_available=host_room, host_what="available on the host (test)")
    assert (got.accumulate, got.bound) == (want, bound), got.reason
    assert "host state" in got.reason and "available on the host (test)" in got.reason


def test_without_host_figures_the_rule_is_the_device_one() -> None:
    got = place_accumulation(device="cuda", offloaded_numel=P, topk_ratio=0.1, available_bytes=DEVICE_NEED / 0.91,
                             host_bytes=HOST, host_available=None)
    assert got.accumulate == "host" and got.bound == "device" and "host state" not in got.reason
