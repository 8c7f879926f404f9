"""``overlap_steps``: with overlap, a window's host result merged K steps after the window end (DESIGN §3)."""

from __future__ import annotations

import pytest
import torch
from test_optimizer import (
    BACKENDS,
    MIN_OFFLOAD,
    Net,
    _skip_unavailable,
    check_against_simulation,
    loss_fn,
    run_with_checkpoint,
)

from zenflow_triton import ZenFlowAdamW


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("steps_late", [1, 2])
def test_matches_simulation_every_step(backend: str, steps_late: int) -> None:
    _skip_unavailable(backend)
    # U = 3, two selections (S = 6) and a warm-up: merges at tau = 1 (the selection step, which drains anyway) and
    # between window ends, with the resident parameters and the selected columns stepping beside them.
    opt = check_against_simulation(backend=backend, overlap=True, warmup=2, r=0.25, interval=3, select=6, steps=16,
                                   overlap_steps=steps_late)
    assert opt.stats()["windows"] >= 4
    opt.close()


def test_host_lr_scale_and_bf16_landing_match_simulation_too() -> None:
    check_against_simulation(backend="numba", overlap=True, warmup=0, r=0.1, interval=4, select=8, steps=13,
                             overlap_steps=1, host_lr_scale=0.5, grad_dtype="bfloat16")


def _trajectory(**knobs) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    out = []
    with ZenFlowAdamW(model.parameters(), lr=2e-2, min_offload_numel=MIN_OFFLOAD, topk_ratio=0.2, update_interval=3,
                      select_interval=6, warmup_steps=1, **knobs) as opt:
        for i in range(13):
            opt.zero_grad()
            loss_fn(model, i).backward()
            opt.step()
            out.append([p.detach().clone() for p in model.parameters()])
    return out


def test_update_interval_steps_late_is_none_and_fewer_train_otherwise() -> None:
    default = _trajectory(overlap_steps=None)
    same = _trajectory(overlap_steps=3)
    assert all(torch.equal(a, b) for x, y in zip(default, same) for a, b in zip(x, y))
    early = _trajectory(overlap_steps=1)
    sequential = _trajectory(overlap=False)
    # tau = t - 1: the first window ends at step 4. Its result reaches the parameters at step 5 with overlap_steps=1,
    # at step 7 by default; without overlap at step 4.
    weight = 0  # the first offloaded matrix
    assert all(torch.equal(early[i][weight], default[i][weight]) for i in range(4))  # same up to the merge
    assert not torch.equal(early[4][weight], default[4][weight])
    assert not torch.equal(early[4][weight], early[3][weight])
    assert not any(torch.equal(e[weight], s[weight]) for e, s in zip(early[3:], sequential[3:]))


@pytest.mark.parametrize("steps_late", [1, 2])
def test_resume_is_bitwise(steps_late: int) -> None:
    knobs = dict(topk_ratio=0.2, update_interval=3, select_interval=6, warmup_steps=2, overlap=True,
                 overlap_steps=steps_late)
    total = 16
    straight, straight_sd = run_with_checkpoint(total, None, **knobs)
    # window ends at steps 5, 8, 11 and 14: a checkpoint with the job in flight (5, 8), one right after its merge
    # (6 or 9), mid-window after the merge (7, 10)
    for at in (5, 6, 7, 8, 9, 10):
        resumed, resumed_sd = run_with_checkpoint(total, at, **knobs)
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed)), f"checkpoint after step {at}"
        assert resumed_sd["zenflow"] == straight_sd["zenflow"]


@pytest.mark.parametrize(("knobs", "match"), [
    (dict(overlap_steps=0), "Invalid overlap_steps: 0"),
    (dict(overlap_steps=2.0), "Invalid overlap_steps: 2.0"),
    (dict(overlap_steps=True), "Invalid overlap_steps: True"),
    (dict(overlap_steps=5), "5 is more than update_interval=4"),
    (dict(overlap_steps=2, overlap=False), "overlap_steps=2 with overlap=False"),
    (dict(overlap_steps=1, update_interval="auto"), "overlap_steps=1 with update_interval='auto'"),
])
def test_bad_values_are_refused_by_name(knobs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ZenFlowAdamW(Net().parameters(), min_offload_numel=MIN_OFFLOAD, **knobs)


def test_auto_is_one_on_cpu_tensors_without_a_plan_and_survives_checkpoints(planned_with_synthetic_profile) -> None:
    # On CPU tensors overlap_steps="auto" with r and U fixed is 1 at once (config.without_planning); on CUDA it is
    # planned after the warm-up (tests/test_autotune_model.py and the chooser cover the choice of K).
    knobs = dict(topk_ratio=0.2, update_interval=3, select_interval=6, overlap_steps="auto", warmup_steps=2)
    with ZenFlowAdamW(Net().parameters(), lr=2e-2, min_offload_numel=MIN_OFFLOAD, **knobs) as opt:
        assert opt.stats()["overlap_steps"] == 1
    total = 14
    straight, sd = run_with_checkpoint(total, None, **knobs)
    assert planned_with_synthetic_profile == []  # no plan
    k = sd["zenflow"]["overlap_steps"]
    assert k == 1
    # Saved during the warm-up or after it: 1 either way, and both continue bit for bit.
    for at in (2, 9):
        resumed, resumed_sd = run_with_checkpoint(total, at, **knobs)
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed)), f"checkpoint after step {at}"
        assert resumed_sd["zenflow"]["overlap_steps"] == k
    # A fixed value and a checkpoint from before the knob existed (None: U).
    fixed, fixed_sd = run_with_checkpoint(8, None, **dict(knobs, overlap_steps=2))
    assert fixed_sd["zenflow"]["overlap_steps"] == 2
    old = {**fixed_sd, "zenflow": {k2: v for k2, v in fixed_sd["zenflow"].items() if k2 != "overlap_steps"}}
    with ZenFlowAdamW(Net().parameters(), lr=2e-2, min_offload_numel=MIN_OFFLOAD, **dict(knobs, overlap_steps=2)) as o:
        o.load_state_dict(old)
        assert o.stats()["overlap_steps"] is None


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", ["device", "host"])
def test_cuda_matches_simulation_every_step(accumulate: str) -> None:
    """The merge K steps after the window end on the CUDA path: staging ring, copy streams, and the next job waiting
    for the merges' H2D copies before it rewrites the snapshot (with accumulate="host" also the adder's slots)."""
    for k in (1, 2):
        check_against_simulation(backend="triton", overlap=True, warmup=2, r=0.25, interval=3, select=6, steps=17,
                                 device="cuda", accumulate=accumulate, overlap_steps=k)
    check_against_simulation(backend="triton", overlap=True, warmup=0, r=0.3, interval=2, select=4, steps=12,
                             dtype=torch.bfloat16, device="cuda", accumulate=accumulate, overlap_steps=1)
