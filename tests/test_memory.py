"""Device bytes per parameter (issue 18's bounds), measured as bench/report_memory.py measures them: on CPU tensors
torch's allocations are what a GPU run holds on the device (host slabs are mmap'd, not torch allocations), summed
in time order from torch.profiler's allocation events. And ``stats()["device_bytes_per_param"]``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.staging import ring_bytes

_BENCH = Path(__file__).parents[1] / "bench"
_spec = importlib.util.spec_from_file_location("report_memory", _BENCH / "report_memory.py")
report_memory = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("report_memory", report_memory)  # its dataclass looks its module up by name
_spec.loader.exec_module(report_memory)

# 5 steps at U = 4: a selection, a window end and a step of the next window; the held figure is the same as over
# the 13 steps of the README's table (python bench/report_memory.py --steps 5 and --steps 13 give 9.30 / 13.30 for
# host / device on the fp32 model), at a third of the time.
STEPS = 5


def test_host_accumulation_holds_at_most_9_6_bytes_per_param() -> None:
    host = report_memory.measure(report_memory.optimizers()["ZenFlow host"], steps=STEPS)
    # weights 4 + grads 4 + compact selected state 12r = 1.2, plus per-column vectors and the input batch
    assert host.held <= 9.6
    assert host.held >= 9.2  # the harness sees the weights, the gradients and the compact state
    # python bench/report_memory.py: 9.36. The first selection fills the compact state from the host in place; it
    # peaked at 10.51 while its packed joining columns (1.2) lay on the device beside the new compact state.
    assert host.peak <= 9.5


@pytest.mark.slow
def test_host_accumulation_of_a_bf16_model_holds_no_device_buffer_for_the_sum() -> None:
    """bf16 "host": weights 2 + grads 2 + compact state 1.2 + vectors and the batch (python bench/report_memory.py:
    5.26 held). Before the fused step took acc=None, an fp32 scratch of the largest weight added 1 B/param (6.26)."""
    host = report_memory.measure(report_memory.optimizers()["ZenFlow host"], dtype=torch.bfloat16, steps=STEPS)
    assert 5.2 <= host.held <= 5.5
    assert host.peak <= 5.5  # 5.36 (6.48 before the first selection filled the compact state directly)


def test_device_accumulation_holds_the_window_sum() -> None:
    """The same harness sees the device path's fp32 acc: 4 bytes per parameter more than "host"."""
    device = report_memory.measure(report_memory.optimizers()["ZenFlow device"], steps=STEPS)
    assert 13.2 <= device.held <= 13.6
    assert device.peak <= 13.5  # 13.36 (14.51 before, as for "host")


@pytest.mark.parametrize("dtype,peak", [(torch.float32, 10.1), (torch.bfloat16, 6.05)])
def test_a_selection_step_migrates_without_a_second_compact_state(dtype: torch.dtype, peak: float) -> None:
    """A selection every window (S = U = 4): steps 1 and 5 select, the second with k unchanged and ~90 of each
    weight's 103 columns changing sides (random data). The compact state is permuted in place and the changed columns
    are staged one parameter at a time: this harness gives 9.97 / 5.93 peak (fp32 / bf16; held 9.30 / 5.26), where
    building the new compact state beside the old, with every parameter's leaving and joining columns on the device
    at once, peaked at 12.71 / 8.67 (13 steps)."""
    make = lambda m: ZenFlowAdamW(m.parameters(), lr=1e-3, accumulate="host", topk_ratio=0.1,  # noqa: E731
                                  update_interval=4, select_interval=4, warmup_steps=0)
    fig = report_memory.measure(make, dtype=dtype, steps=STEPS)
    assert fig.peak <= peak


@pytest.mark.parametrize("mode,acc_bytes", [("device", 4.0), ("host", 0.0)])
def test_stats_device_bytes_per_param(mode: str, acc_bytes: float) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 100))
    with ZenFlowAdamW([w], topk_ratio=0.1, update_interval=2, accumulate=mode, warmup_steps=0) as opt:
        for _ in range(3):
            w.grad = torch.randn(64, 100)
            opt.step()
        st = opt.stats()
        k = 10
        # acc, the compact fp32 master/m/v of k of 100 columns, and score/slot/col_step (12 bytes per column)
        want = acc_bytes + 12 * k / 100 + 12 / 64
        assert st["accumulate"] == mode
        assert st["device_bytes_per_param"] == pytest.approx(want)


def test_grads_in_backward_holds_at_most_6_and_peaks_at_most_7_5_bytes_per_param() -> None:
    """fp32 "host" + grads_in_backward (python bench/report_memory.py: 5.31 held / 6.71 peak over 13 steps): weights
    4 + compact state 1.2 + vectors and the batch held, no gradient between steps; the peak is within backward, one
    layer's fp32 gradient (1.0 B/param here) in flight before its hook takes it (the selection steps peak lower:
    6.13 at the first, 6.53 at a same-k selection)."""
    fig = report_memory.measure(report_memory.optimizers()["ZenFlow host + grads_in_backward"], steps=STEPS)
    assert 5.2 <= fig.held <= 6.0
    assert fig.peak <= 6.8


def test_grads_in_backward_of_a_bf16_model_holds_at_most_2_plus_14r() -> None:
    """bf16: weights 2 + compact state 12r + the compact selected gradient 2r = 2 + 14r = 3.4 B/param at r = 0.1
    (python bench/report_memory.py: 3.28 held, the compact gradient freed at the step's end)."""
    fig = report_memory.measure(report_memory.optimizers()["ZenFlow host + grads_in_backward"], dtype=torch.bfloat16,
                                steps=STEPS)
    assert 3.2 <= fig.held <= 2 + 14 * 0.1
    # The peak, 4.02 (4.49 while the first selection's joining columns lay on the device beside the new compact state),
    # is within backward: the held state, the batch's activations and the compact gradients captured so far, plus one
    # layer's bf16 gradient in flight (0.5) and the mm's temporaries; the goal's 2 + 14r + 0.5 = 3.9 counts no
    # activations and is not met in this harness by those 0.12.
    assert fig.peak <= 4.1


def test_stats_device_bytes_per_param_with_grads_in_backward() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 100))
    x = torch.randn(8, 64)
    with ZenFlowAdamW([w], topk_ratio=0.1, update_interval=2, grads_in_backward=True, warmup_steps=0) as opt:
        for _ in range(3):
            opt.zero_grad()
            (x @ w).pow(2).sum().backward()
            assert w.grad is None
            opt.step()
        st = opt.stats()
        k = 10
        # the "host" figure (12 bytes per selected element and per column), the compact fp32 gradient of k columns,
        # and per column the step score (4 bytes) and per selected column its indices (16 bytes)
        want = 12 * k / 100 + 12 / 64 + 4 * k / 100 + (4 * 100 + 16 * k) / (64 * 100)
        assert st["grads_in_backward"] and st["accumulate"] == "host"
        assert st["device_bytes_per_param"] == pytest.approx(want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,held,peak", [(torch.float32, 6.0, 7.5), (torch.bfloat16, 2 + 14 * 0.1, 4.9)])
def test_grads_in_backward_on_cuda(dtype: torch.dtype, held: float, peak: float) -> None:
    """The same bounds from torch.cuda.memory_allocated / max_memory_allocated (the CPU harness's bf16 peak is 4.02,
    within backward: the held 3.28, activations, and one layer's gradient in flight)."""
    fig = report_memory.measure(report_memory.optimizers()["ZenFlow host + grads_in_backward"], dtype=dtype,
                                device="cuda", steps=STEPS)
    assert fig.held <= held
    assert fig.peak <= peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["ZenFlow device", "ZenFlow host", "ZenFlow host + grads_in_backward"])
def test_host_bytes_measured_from_the_process_are_what_stats_says(name: str, dtype: torch.dtype) -> None:
    """The slabs' resident pages (/proc/self/pagemap) after the steps are the bytes stats() counts, up to the last
    page of each slab: every host buffer is written by then, and nothing else is mapped for them. None pinned on CPU
    tensors. Per mode (fp32 / bf16 model, two window sums: report_memory merges at the window end): "device" 16 / 18,
    "host" 20 / 22 (+ the landing ring: 4 chunks of 256 KiB on a model this small), with grads_in_backward 24 / 24."""
    fig = report_memory.measure(report_memory.optimizers()[name], dtype=dtype, steps=STEPS, layers=2, width=512)
    offloaded = 2 * 512 * 512
    assert 0 <= fig.host_resident - fig.host_stats < 4096 / offloaded
    assert fig.host_pinned == 0.0
    want = {("ZenFlow device", torch.float32): 16, ("ZenFlow device", torch.bfloat16): 18}.get((name, dtype))
    size = 512 * 512 * dtype.itemsize  # each weight's gradient, landed in the ring in its own dtype
    ring = ring_bytes(2 * size, size) / offloaded if name == "ZenFlow host" else 0.0
    want = want or (24 if "grads_in_backward" in name else 20 if dtype == torch.float32 else 22)
    assert want + ring <= fig.host_stats < want + ring + 0.01  # + the per-column step counts (4 B per column)


@pytest.mark.parametrize(("name", "bound"), [
    ("ZenFlow device, host_snapshot=False", 16), ("ZenFlow device, bf16 moments, host_snapshot=False", 12),
    ("ZenFlow host + grads_in_backward, overlap_steps=1, host_snapshot=False", 18),
    ("ZenFlow host + grads_in_backward, bf16 moments, overlap_steps=1, host_snapshot=False", 14),
])
def test_issue_29_host_bounds_of_a_bf16_model_measured_from_the_process(name: str, bound: int) -> None:
    """Issue 29's bounds for a bf16 model, read from the slabs' resident pages: "device" <= 18 (16 without the
    snapshot), the lean mode ("host" + grads_in_backward, one window sum) <= 18, and 4 less each with bf16 moments."""
    fig = report_memory.measure(report_memory.bf16_optimizers()[name], dtype=torch.bfloat16, steps=STEPS, layers=2,
                                width=512)
    assert fig.host_resident <= bound + 4096 / (2 * 512 * 512)  # + the last page of a slab
    assert bound <= fig.host_stats < bound + 0.01  # + the per-column step counts
