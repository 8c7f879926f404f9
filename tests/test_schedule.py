"""One schedule for all parameters (DESIGN §3): window ends and selections follow the optimizer's steps, also for
parameters that miss their gradient on some steps; and ``flush()`` ends the open window, so every gradient given to
``step()`` is in the parameters. Both against the dense simulation of tests/test_optimizer.py."""

from __future__ import annotations

import pytest
import torch
from test_optimizer import BACKENDS, MIN_OFFLOAD, Net, Simulation, _skip_unavailable, loss_fn, offloaded

from zenflow_triton import ZenFlowAdamW

HP = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
ATOL, RTOL = 2e-5, 1e-5  # fp32: the simulation computes the same math in another order


def _missing(step: int, index: int) -> bool:
    """Whether offloaded parameter ``index`` misses its gradient at ``step``: about one step in five for each
    parameter but the first (which always has one, as some parameter always does in a real model)."""
    return index > 0 and (step * 7 + index * 3) % 5 == 0


def _run(*, backend: str, overlap: bool, steps: int, interval: int, select: int, warmup: int = 0,
         flush_at: tuple[int, ...] = ()) -> ZenFlowAdamW:
    """Train Net with some offloaded parameters missing gradients, checking every parameter against its simulation
    after every step and after each ``flush()`` (called after the steps in ``flush_at``)."""
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.25, update_interval=interval, select_interval=select,
                       warmup_steps=warmup, overlap=overlap, min_offload_numel=MIN_OFFLOAD, backend=backend,
                       overlap_steps=None)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    weights = offloaded(model)
    sims = [Simulation(p.detach(), r=0.25, interval=interval, select=select, warmup=warmup, overlap=overlap)
            for p in weights]
    b1, b2 = HP["betas"]
    for i in range(steps):
        opt.zero_grad()
        loss_fn(model, i).backward()
        for j, p in enumerate(weights):
            if _missing(i, j):
                p.grad = None
        lr = opt.param_groups[0]["lr"]
        opt.step()
        for j, (p, sim) in enumerate(zip(weights, sims)):
            sim.step(p.grad, lr, b1, b2, HP["eps"], HP["weight_decay"])
            torch.testing.assert_close(p.detach().view(sim.rows, sim.cols), sim.w, atol=ATOL, rtol=RTOL,
                                       msg=lambda m, i=i, j=j: f"step {i + 1}, weight {j}: {m}")
        if i + 1 in flush_at:
            opt.flush()
            for j, (p, sim) in enumerate(zip(weights, sims)):
                sim.flush_all(lr, b1, b2, HP["eps"], HP["weight_decay"])
                torch.testing.assert_close(p.detach().view(sim.rows, sim.cols), sim.w, atol=ATOL, rtol=RTOL,
                                           msg=lambda m, i=i, j=j: f"flush after step {i + 1}, weight {j}: {m}")
        sched.step()
    return opt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.slow
def test_missing_gradients_follow_one_schedule(backend: str, overlap: bool) -> None:
    _skip_unavailable(backend)
    steps, interval, select = 32, 4, 8
    assert any(_missing(i, j) for i in range(steps) for j in (1, 2))
    opt = _run(backend=backend, overlap=overlap, steps=steps, interval=interval, select=select, warmup=2)
    stats = opt.stats()
    # Per-parameter counting drifted out of phase: more windows, and a drained pipeline at each extra selection.
    assert stats["windows"] == 2 + (steps - 2) // interval  # two warm-up windows, then one per window end
    assert stats["selections"] == -(-(steps - 2) // select)
    opt.close()


def test_bias_correction_counts_the_parameters_own_steps() -> None:
    """A parameter's step count (torch's bias correction) counts the steps in which it had a gradient."""
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.25, update_interval=2, min_offload_numel=MIN_OFFLOAD)
    weights = offloaded(model)
    for i in range(6):
        opt.zero_grad()
        loss_fn(model, i).backward()
        if i % 3 == 0:
            weights[1].grad = None
        opt.step()
    assert opt.state[weights[0]]["step"] == 6
    assert opt.state[weights[1]]["step"] == 4
    opt.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_flush_ends_the_open_window(overlap: bool) -> None:
    """flush() after 1, 2 and 3 steps of 4-step windows applies every gradient; training then goes on as the
    simulation of an early window end says, with later windows ending on the schedule."""
    _run(backend="numba", overlap=overlap, steps=20, interval=4, select=8, flush_at=(1, 6, 11, 16))


def test_flush_leaves_nothing_out() -> None:
    """After flush(), each parameter equals its dense master: no column waits for a later window."""
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.1, update_interval=4, min_offload_numel=MIN_OFFLOAD)
    for i in range(7):  # ends mid-window: 3 steps of the second window are only in acc
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
    opt.flush()
    for p in offloaded(model):
        st = opt.state[p]
        assert st["acc_count"] == 0 and not st["pending"]
        host = st["host_master"].clone()
        host[:, st["slot"] >= 0] = st["master"]
        torch.testing.assert_close(p.detach().view_as(host), host, atol=0, rtol=0)
    opt.close()
