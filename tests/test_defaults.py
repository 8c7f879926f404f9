"""The defaults a user gets from ``ZenFlowAdamW(params, lr=...)`` (issue 31): 100 steps of warm-up (synchronous
AdamW on every element), then ZenFlow with ``overlap_steps="auto"``, which on CPU tensors is 1 without a plan and is
recorded in the checkpoint, so a resumed run continues bit for bit. Checked against the dense simulation of
tests/test_optimizer.py."""

from __future__ import annotations

import io

import pytest
import torch
from test_optimizer import MIN_OFFLOAD, Net, Simulation, loss_fn, offloaded, train_steps

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.config import ZenFlowConfig

HP = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def _defaults(model: torch.nn.Module) -> ZenFlowAdamW:
    # Only what the test model needs (its matrices are smaller than the default min_offload_numel) and the backend.
    return ZenFlowAdamW(model.parameters(), **HP, min_offload_numel=MIN_OFFLOAD, backend="numba")


def test_the_defaults_are_warmup_100_and_overlap_steps_auto() -> None:
    cfg = ZenFlowConfig()
    assert (cfg.warmup_steps, cfg.overlap_steps, cfg.quality_regime) == (100, "auto", "worst")
    assert (cfg.topk_ratio, cfg.update_interval, cfg.select_interval, cfg.overlap) == (0.1, 4, None, True)
    # "auto" overlap_steps alone needs no plan on CPU tensors, nor without overlap.
    assert cfg.without_planning("cpu").overlap_steps == 1
    assert cfg.without_planning(None).overlap_steps == 1
    assert cfg.without_planning("cuda") is None
    assert ZenFlowConfig(overlap=False).without_planning("cuda").overlap_steps is None
    assert not ZenFlowConfig(overlap=False).is_auto
    assert ZenFlowConfig(topk_ratio="auto").without_planning("cpu") is None


@pytest.mark.parametrize("bad", ["best", None, 1])
def test_quality_regime_is_checked(bad) -> None:
    with pytest.raises(ValueError, match="quality_regime"):
        ZenFlowConfig(quality_regime=bad)


def test_defaults_match_the_simulation_with_warmup_100_and_overlap_steps_1() -> None:
    """Warm-up: steps 1-100 are AdamW on every element; then r = 0.1, U = 4, S = 32, each window's host result
    merged one step after its window end."""
    model = Net()
    opt = _defaults(model)
    sims = {p: Simulation(p.detach(), r=0.1, interval=4, select=32, warmup=100, overlap=True, overlap_steps=1)
            for p in offloaded(model)}
    steps = 100 + 32 + 6  # warm-up, one selection period, and the next selection's first window and merge
    for i in range(steps):
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
        for p, sim in sims.items():
            sim.step(p.grad, HP["lr"], *HP["betas"], HP["eps"], HP["weight_decay"])
            torch.testing.assert_close(p.detach().view(sim.rows, sim.cols), sim.w, atol=2e-5, rtol=1e-5,
                                       msg=lambda m, i=i: f"step {i + 1}: {m}")
    assert opt.stats()["overlap_steps"] == 1
    opt.flush()
    for p, sim in sims.items():
        sim.flush_all(HP["lr"], *HP["betas"], HP["eps"], HP["weight_decay"])  # flush() ends the open window too
        torch.testing.assert_close(p.detach().view(sim.rows, sim.cols), sim.w, atol=2e-5, rtol=1e-5)
    opt.close()


def test_warmup_is_torch_adamw_on_every_element() -> None:
    model, twin = Net(), Net()
    opt = _defaults(model)
    ref = torch.optim.AdamW(twin.parameters(), **HP, foreach=False)
    train_steps(model, opt, range(100))
    train_steps(twin, ref, range(100))
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=2e-5, rtol=1e-5)
    opt.close()


@pytest.mark.parametrize("cut", [50, 106])  # in the warm-up; after it, between a window end and its merge
def test_resume_across_the_defaults_is_bit_for_bit(cut: int) -> None:
    steps = 112
    model = Net()
    opt = _defaults(model)
    train_steps(model, opt, range(cut))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert saved["opt"]["zenflow"]["overlap_steps"] == 1  # recorded: a resume needs no plan to merge alike
    train_steps(model, opt, range(cut, steps))
    opt.flush()

    again = Net()
    again.load_state_dict(saved["model"])
    opt2 = _defaults(again)
    opt2.load_state_dict(saved["opt"])
    train_steps(again, opt2, range(cut, steps))
    opt2.flush()
    for p, q in zip(model.parameters(), again.parameters()):
        assert torch.equal(p.detach(), q.detach())
    opt.close()
    opt2.close()
