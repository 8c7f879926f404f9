"""Staging (DESIGN §4, §5): accumulate="host"'s landing ring, its back-pressure, one window sum where the schedule
allows it, and the host bytes each mode holds. Bit for bit against accumulate="device" at every step, whatever the
ring's size (a parameter many chunks long, the ring wrapping several times a step), and across modes at a resume."""

from __future__ import annotations

import io
import time
from concurrent.futures import Future

import pytest
import torch
from test_optimizer import MIN_OFFLOAD, Net, loss_fn

import zenflow_triton.host_sums as zsums
import zenflow_triton.pipeline as zpipe
import zenflow_triton.staging as staging
from zenflow_triton import ZenFlowAdamW
from zenflow_triton.autotune import placement
from zenflow_triton.staging import RING_CHUNKS, LandingRing, ring_bytes, ring_chunk_bytes, window_sums


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))


# ---------------------------------------------------------------------------------------------- the ring alone


def test_chunk_size_follows_the_budget() -> None:
    kib, mib = 1 << 10, 1 << 20
    assert ring_chunk_bytes(64 * mib, 8 * mib) == mib  # 1/64 of a step's gradient bytes
    assert ring_chunk_bytes(4 * mib, 4 * mib) == 256 * kib  # never below 256 KiB...
    assert ring_chunk_bytes(4 * mib, 100 * kib) == 100 * kib  # ...unless the largest gradient is smaller
    assert ring_chunk_bytes(100, 10) == 64  # 64-byte aligned (any dtype's view)
    assert ring_chunk_bytes(1 << 40, 1 << 34) == 16 * mib  # 16 MiB at most
    assert ring_bytes(64 * mib, 8 * mib) == RING_CHUNKS * mib


@pytest.mark.parametrize("total,largest", [(1, 1), (100, 10), (4 << 20, 100 << 10), (64 << 20, 8 << 20),
                                           (3 << 30, 1 << 28), (1 << 40, 1 << 34), (12345678, 1234567)])
def test_the_autotuner_sizes_the_ring_as_the_optimizer(total, largest) -> None:
    assert placement.ring_bytes(total, largest) == ring_bytes(total, largest)


@pytest.mark.parametrize("overlap,u,k,want", [
    (False, 4, None, 1), (True, 4, 1, 1), (True, 1, None, 1), (True, 4, None, 2), (True, 4, 2, 2),
    (True, 4, "auto", 2), (True, "auto", "auto", 2), (True, "auto", None, 2),
])
def test_one_window_sum_where_the_schedule_allows(overlap, u, k, want) -> None:
    assert window_sums(overlap, u, k) == want


def test_pieces_cover_a_parameter_larger_than_a_chunk() -> None:
    ring = LandingRing(64, pin=False)
    assert list(ring.pieces(40, 4)) == [(0, 16), (16, 32), (32, 40)]
    assert list(ring.pieces(32, 2)) == [(0, 32)]
    assert ring.view(1, torch.bfloat16, 5).shape == (5,) and ring.nbytes == RING_CHUNKS * 64


def test_the_ring_wraps_around_and_waits_for_the_oldest_add() -> None:
    ring = LandingRing(64, pin=False)
    waited, flushed = [], []
    jobs = [Future() for _ in range(RING_CHUNKS)]
    order = []
    for i in range(RING_CHUNKS):
        c = ring.claim(waited.append, lambda: flushed.append(True))
        ring.hold([c], jobs[i])
        order.append(c)
    assert order == list(range(RING_CHUNKS)) and not waited and not flushed
    # The fifth claim wraps to chunk 0: back-pressure waits for the add that reads it, then hands it out.
    assert ring.claim(waited.append, lambda: flushed.append(True)) == 0
    assert waited == [jobs[0]] and not flushed
    # A chunk whose piece is still being gathered (its add not submitted) is flushed first.
    for _ in range(RING_CHUNKS - 1):
        ring.claim(waited.append, lambda: flushed.append(True))
    ring.claim(waited.append, lambda: flushed.append(True))
    assert flushed == [True]


# ------------------------------------------------------------------------------------ bit for bit, every mode


SCHEDULE = ("overlap", "overlap_steps", "update_interval", "select_interval")


def _make(model, mode: str, **knobs) -> ZenFlowAdamW:
    """``mode``: "device", "host", or "capture" (accumulate="host" with grads_in_backward)."""
    base = dict(lr=2e-2, weight_decay=0.05, topk_ratio=0.25, update_interval=3, select_interval=6, warmup_steps=2,
                min_offload_numel=MIN_OFFLOAD, accumulate="device" if mode == "device" else "host",
                grads_in_backward=mode == "capture", overlap_steps=None)
    return ZenFlowAdamW(model.parameters(), **{**base, **knobs})


def _pair(dtype=torch.float32, **knobs):
    """accumulate="device" and "host" (with every knob), on the same schedule."""
    models = [Net(dtype), Net(dtype)]
    host = "capture" if knobs.pop("grads_in_backward", False) else "host"
    schedule = {k: v for k, v in knobs.items() if k in SCHEDULE}
    return models, [_make(models[0], "device", **schedule), _make(models[1], host, **knobs)]


def _run_pair(models, opts, steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        # The host mode first: the device mode's waits for its own host jobs would otherwise give the host mode's
        # jobs time to finish between its steps, and hide a missing wait.
        for m, o in reversed(list(zip(models, opts))):
            o.zero_grad()
            loss_fn(m, i).backward()
            o.step()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert _bits_equal(a, b), f"step {i + 1}"


@pytest.fixture
def tiny_ring(monkeypatch):
    """Chunks of 64 bytes (16 fp32 elements): every offloaded gradient spans many, and the ring wraps many times a
    step."""
    monkeypatch.setattr(staging, "_MIN_CHUNK_BYTES", 64)
    monkeypatch.setattr(staging, "_RING_FRACTION", 1 << 30)


MODES = [
    dict(),  # two sums (K = U = 3)
    dict(overlap_steps=1),  # one sum
    dict(overlap=False),  # one sum
    dict(update_interval=1, select_interval=6),  # one sum, every step a window
    dict(overlap_steps=2),  # two sums
    dict(grads_in_backward=True),
    dict(grads_in_backward=True, overlap_steps=1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("knobs", MODES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_host_equals_device_bitwise_with_pieces_many_chunks_long(tiny_ring, knobs, dtype) -> None:
    models, opts = _pair(dtype, **knobs)
    _run_pair(models, opts, 14)  # warm-up, two selections, several windows
    sums = opts[1]._pipeline._sums
    if not knobs.get("grads_in_backward"):
        assert sums.ring.chunk_bytes == 64
    rec = next(iter(opts[1]._pipeline.records.values()))
    want = window_sums(knobs.get("overlap", True), knobs.get("update_interval", 3), knobs.get("overlap_steps"))
    assert len(rec.sums) == want
    for o in opts:
        o.close()


def test_back_pressure_is_stall_and_changes_nothing(tiny_ring, monkeypatch) -> None:
    """A slow adder: every chunk is still read by an add when the ring comes round, so step() waits (stall)."""
    models, opts = _pair()
    real = zsums.run_add_job
    delay = 0.02

    def slow(items, ready, num_threads):
        time.sleep(delay)
        return real(items, ready, num_threads)

    monkeypatch.setattr(zsums, "run_add_job", slow)
    _run_pair(models, opts, 2)  # warm-up: one-step windows read the gradient in place (no landing)
    before = opts[1].stats()["stall_s"]
    steps = 3
    _run_pair(models, opts, steps, start=2)
    # 64-byte chunks, batches of two pieces, 4352 fp32 elements a step: 136 add jobs a step, of which all but the
    # two batches the ring holds are waited for.
    jobs = sum(p.numel() for p in opts[1]._pipeline.records) * 4 // 64 // (RING_CHUNKS // 2)
    assert opts[1].stats()["stall_s"] - before >= 0.5 * delay * steps * (jobs - 2)
    for o in opts:
        o.close()


@pytest.mark.parametrize("knobs", [dict(overlap_steps=1), dict(update_interval=1, select_interval=6)])
def test_one_sum_waits_for_the_job_that_reads_it(knobs, monkeypatch) -> None:
    """With one window sum, a window's first add overwrites the sum the previous window's job reads: a slow job
    shows whether the add waits for it (it must, or the job would read the next window's gradient)."""
    real = zpipe.run_host_job

    def slow(items, ready, num_threads):
        time.sleep(0.05)
        return real(items, ready, num_threads)

    monkeypatch.setattr(zpipe, "run_host_job", slow)
    models, opts = _pair(**knobs)
    _run_pair(models, opts, 14)
    assert len(next(iter(opts[1]._pipeline.records.values())).sums) == 1
    for o in opts:
        o.close()


@pytest.mark.parametrize("before,after", [("host", "host"), ("host", "device"), ("device", "host"),
                                          ("capture", "host"), ("host", "capture")])
@pytest.mark.parametrize("schedule", [dict(overlap_steps=1), dict(), dict(overlap=False)],
                         ids=["one-sum", "two-sums", "no-overlap"])
@pytest.mark.parametrize("at", [4, 6])  # mid-window; right after a window end
def test_resume_across_modes_and_sum_counts_is_bitwise(before, after, schedule, at) -> None:
    """A checkpoint's format does not depend on the layout (one or two sums, ring or capture slot): it resumes in
    any mode, and the run goes on as the uninterrupted one, bit for bit."""
    ref_model, model = Net(), Net()
    ref, opt = _make(ref_model, before, **schedule), _make(model, before, **schedule)
    for i in range(11):
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            loss_fn(m, i).backward()
            o.step()
        if i + 1 == at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            opt.close()
            buf.seek(0)
            saved = torch.load(buf, weights_only=False)
            model = Net()
            model.load_state_dict(saved["model"])
            opt = _make(model, after, **schedule)
            opt.load_state_dict(saved["opt"])
        for a, b in zip(ref_model.parameters(), model.parameters()):
            assert _bits_equal(a, b), f"step {i + 1}"
    ref.close()
    opt.close()


# ------------------------------------------------------------------------------------------------ host bytes


def _host_bytes(dtype, **knobs) -> tuple[float, object]:
    torch.manual_seed(0)
    width = 256
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))).to(dtype)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, **{**dict(topk_ratio=0.1, update_interval=4, warmup_steps=0,
                                                                overlap_steps=None), **knobs})
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, width, dtype=dtype)).float().pow(2).mean().backward()
        opt.step()
    st = opt.stats()
    opt.close()
    return st, model


# Per offloaded element, without the ring and the per-column step counts: fp32 master and moments 12, the bf16
# snapshot 2, 4 per fp32 window sum, and with grads_in_backward the capture slot in the parameter's dtype.
@pytest.mark.parametrize("dtype,knobs,per_element", [
    (torch.bfloat16, dict(accumulate="device"), 18),
    (torch.bfloat16, dict(accumulate="host"), 22),
    (torch.bfloat16, dict(accumulate="host", overlap_steps=1), 18),
    (torch.bfloat16, dict(accumulate="host", overlap_steps="auto"), 18),  # the default: 1 on CPU tensors
    (torch.bfloat16, dict(accumulate="host", grads_in_backward=True), 24),
    (torch.bfloat16, dict(accumulate="host", grads_in_backward=True, overlap_steps=1), 20),
    (torch.float32, dict(accumulate="device"), 16),
    (torch.float32, dict(accumulate="host"), 20),
    (torch.float32, dict(accumulate="host", overlap_steps=1), 16),
    (torch.float32, dict(accumulate="host", grads_in_backward=True), 24),
    (torch.float32, dict(accumulate="host", grads_in_backward=True, overlap_steps=1), 20),
])
def test_host_bytes_per_param(dtype, knobs, per_element) -> None:
    st, model = _host_bytes(dtype, **knobs)
    weights = [p for p in model.parameters() if p.ndim == 2]
    numel = sum(p.numel() for p in weights)
    ring = 0
    if knobs["accumulate"] == "host" and not knobs.get("grads_in_backward"):
        size = weights[0].numel() * weights[0].element_size()
        ring = ring_bytes(size * len(weights), size)
        assert ring <= max(size * len(weights) / 16, RING_CHUNKS * (256 << 10))
    col_steps = 4 * sum(p.shape[1] for p in weights)
    assert st["host_bytes"] == per_element * numel + ring + col_steps
