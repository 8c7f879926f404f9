"""``cpu_threads``' default: every core of this process's share but the training thread's, and on CUDA also autograd's
device thread's (both launch kernels); a value the user sets is kept as it is."""

from __future__ import annotations

import pytest
import torch

from zenflow_triton import ZenFlowAdamW, auto
from zenflow_triton.auto import Knobs, default_cpu_threads
from zenflow_triton.config import ZenFlowConfig


@pytest.mark.parametrize(("share", "cpu", "cuda"), [(16, 15, 14), (3, 2, 1), (2, 1, 1), (1, 1, 1)])
def test_default_leaves_one_core_on_cpu_and_two_on_cuda(monkeypatch, share, cpu, cuda) -> None:
    monkeypatch.setattr(auto, "host_thread_share", lambda: share)
    assert default_cpu_threads(None) == default_cpu_threads(torch.device("cpu")) == cpu
    assert default_cpu_threads(torch.device("cuda", 1)) == cuda
    assert Knobs(ZenFlowConfig(), device=torch.device("cuda")).resolved.cpu_threads == cuda
    assert Knobs(ZenFlowConfig(), device=torch.device("cpu")).resolved.cpu_threads == cpu
    assert Knobs(ZenFlowConfig(cpu_threads=1), device=torch.device("cuda")).resolved.cpu_threads == 1


def test_optimizer_resolves_it_for_its_parameters_device(monkeypatch) -> None:
    monkeypatch.setattr(auto, "host_thread_share", lambda: 6)
    w = torch.nn.Parameter(torch.randn(64, 64))
    with ZenFlowAdamW([w], min_offload_numel=16, warmup_steps=0) as opt:
        assert opt.stats()["cpu_threads"] == 5  # CPU parameters: one core left to the training thread


@pytest.mark.gpu
def test_optimizer_on_cuda_leaves_two_cores(monkeypatch) -> None:
    monkeypatch.setattr(auto, "host_thread_share", lambda: 6)
    w = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
    with ZenFlowAdamW([w], min_offload_numel=16, warmup_steps=0) as opt:
        assert opt.stats()["cpu_threads"] == 4
