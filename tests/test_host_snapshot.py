"""``host_snapshot=False`` (DESIGN §4, §5): no model-dtype copy of a bf16/fp16 weight on the host; the merge reads
the fp32 master and rounds it as the host kernel rounds the snapshot it writes. Oracle: the same run with the
snapshot, bit for bit at every step, in every mode and backend, across a resume from one to the other with a host
result pending; and 2 bytes per offloaded parameter less on the host."""

from __future__ import annotations

import io

import pytest
import torch
from test_optimizer import MIN_OFFLOAD, Net, _skip_unavailable, loss_fn

from zenflow_triton import ZenFlowAdamW

# Windows of 2 steps, a reselection every 4, selection from step 3: every path (warm-up, window ends, merges,
# reselection with columns changing sides) within 12 steps.
SCHEDULE = dict(lr=3e-2, topk_ratio=0.25, update_interval=2, select_interval=4, warmup_steps=2,
                min_offload_numel=MIN_OFFLOAD)
MODES = {
    "device": {"accumulate": "device", "overlap_steps": None},
    "device-K1": {"accumulate": "device", "overlap_steps": 1},
    "host": {"accumulate": "host", "overlap_steps": None},
    "host-K1": {"accumulate": "host", "overlap_steps": 1},
    "in-backward-clipped": {"accumulate": "host", "grads_in_backward": True, "max_grad_norm": 0.05, "overlap_steps": 1},
    "no-overlap": {"accumulate": "device", "overlap": False, "overlap_steps": None},
    "bf16-moments": {"accumulate": "host", "state_dtype": "bfloat16", "overlap_steps": 1},
}


def _run(dtype: torch.dtype, snapshot: bool, steps: int, device: str = "cpu", **knobs):
    model = Net(dtype).to(device)
    opt = ZenFlowAdamW(model.parameters(), host_snapshot=snapshot, **SCHEDULE, **knobs)
    trace = []
    for i in range(steps):
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
        trace.append([p.detach().clone() for p in model.parameters()])
    return model, opt, trace


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for s, t in zip(a, b) for x, y in zip(s, t))


# grads_in_backward refuses fp16 weights (AMP's GradScaler reads .grad): bf16 only there.
CASES = [(dtype, mode) for dtype in (torch.bfloat16, torch.float16) for mode in MODES
         if dtype == torch.bfloat16 or not MODES[mode].get("grads_in_backward")]


@pytest.mark.parametrize("backend", ["numba", "torch", "triton"])
@pytest.mark.parametrize(("dtype", "mode"), CASES, ids=[f"{str(d)[6:]}-{m}" for d, m in CASES])
def test_every_step_is_the_snapshots_bit_for_bit(dtype, mode, backend) -> None:
    knobs = MODES[mode]
    _skip_unavailable(backend)
    _, with_snap, a = _run(dtype, True, 12, backend=backend, **knobs)
    _, without, b = _run(dtype, False, 12, backend=backend, **knobs)
    assert _same(a, b)
    offloaded = sum(rec.rows * rec.cols for rec in without._pipeline.records.values())
    assert all(rec.snapshot is None for rec in without._pipeline.records.values())
    assert with_snap.stats()["host_bytes"] - without.stats()["host_bytes"] == 2 * offloaded
    with_snap.close()
    without.close()


@pytest.mark.parametrize("mode", ["device", "host"])
def test_resume_from_a_snapshot_run_with_a_result_pending(mode) -> None:
    """Saved at a window end with its host result still to merge (overlap, merged at the next window end), loaded
    into an optimizer without the snapshot (and back): the run goes on as the uninterrupted one, bit for bit."""
    knobs = MODES[mode]
    _, full, trace = _run(torch.bfloat16, True, 12, **knobs)
    full.close()
    for first, second in ((True, False), (False, True)):
        # Step 8 ends a window (no reselection: that would drain the pipeline), merged at step 10: pending at 9.
        model, opt, head = _run(torch.bfloat16, first, 9, **knobs)
        assert any(opt.state[p].get("pending") for p in opt._pipeline.records)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        opt.close()
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        model = Net(torch.bfloat16)
        model.load_state_dict(saved["model"])
        opt = ZenFlowAdamW(model.parameters(), host_snapshot=second, **SCHEDULE, **knobs)
        opt.load_state_dict(saved["opt"])
        tail = []
        for i in range(9, 12):
            opt.zero_grad()
            loss_fn(model, i).backward()
            opt.step()
            tail.append([p.detach().clone() for p in model.parameters()])
        assert _same(head + tail, trace), (first, second)
        opt.close()


def test_an_fp32_model_has_no_snapshot_either_way() -> None:
    _, a, ta = _run(torch.float32, True, 6)
    _, b, tb = _run(torch.float32, False, 6)
    assert _same(ta, tb) and a.stats()["host_bytes"] == b.stats()["host_bytes"]
    a.close()
    b.close()


def test_not_a_bool_is_refused() -> None:
    with pytest.raises(ValueError, match="host_snapshot"):
        ZenFlowAdamW(Net().parameters(), host_snapshot="no")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["device", "host", "in-backward-clipped"])
def test_on_cuda_the_staged_master_merges_as_the_snapshot(mode) -> None:
    """CUDA: the merge's copies carry the fp32 master into fp32 staging buffers and the Triton merge rounds it."""
    _, a, ta = _run(torch.bfloat16, True, 12, device="cuda", **MODES[mode])
    _, b, tb = _run(torch.bfloat16, False, 12, device="cuda", **MODES[mode])
    assert _same([[t.cpu() for t in s] for s in ta], [[t.cpu() for t in s] for s in tb])
    a.close()
    b.close()
