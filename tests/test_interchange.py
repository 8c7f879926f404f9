"""The checkpoint format (zenflow_triton/checkpoint.py): shapes that depend on nothing but the parameters, so
torch.distributed.checkpoint loads it whatever the selection; interchange with torch.optim.AdamW both ways; and
checkpoints in the first format still load."""

from __future__ import annotations

import copy

import pytest
import torch
from test_optimizer import MIN_OFFLOAD, Net, loss_fn, offloaded

from zenflow_triton import ZenFlowAdam, ZenFlowAdamW

HP = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
# AdamW and ZenFlow's device kernels compute the same math in another order (fused multiply-adds); over 10 steps the
# difference stays at a few fp32 ulps of the parameters (|p| ~ 1).
ATOL, RTOL = 2e-6, 1e-5


def _train(model: Net, opt: torch.optim.Optimizer, steps: range, sched=None) -> None:
    for i in steps:
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
        if sched is not None:
            sched.step()


def _close(opt: torch.optim.Optimizer) -> None:
    if isinstance(opt, ZenFlowAdamW):
        opt.close()


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("cls,ref_cls", [(ZenFlowAdamW, torch.optim.AdamW), (ZenFlowAdam, torch.optim.Adam)])
def test_adamw_to_zenflow_to_adamw_at_topk_1_is_adamw(backend: str, cls, ref_cls) -> None:
    """Start with AdamW, continue offloaded, finish with AdamW: at topk_ratio=1 (every column on the device) the
    trajectory is AdamW's, because every column starts from AdamW's step count and leaves with it."""
    reference = Net()
    ref = ref_cls(reference.parameters(), **HP, foreach=False)
    _train(reference, ref, range(12))

    model = Net()
    first = ref_cls(model.parameters(), **HP, foreach=False)
    _train(model, first, range(4))
    middle = cls(model.parameters(), **HP, topk_ratio=1.0, update_interval=2, min_offload_numel=MIN_OFFLOAD,
                 backend=backend)
    middle.load_state_dict(first.state_dict())
    _train(model, middle, range(4, 8))
    last = ref_cls(model.parameters(), **HP, foreach=False)
    last.load_state_dict(middle.adamw_state_dict())
    middle.close()
    _train(model, last, range(8, 12))
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL)
    for p in model.parameters():
        assert last.state[p]["step"] == ref.state[next(q for q in reference.parameters() if q.shape == p.shape)][
            "step"]


def test_interchange_mid_run_with_offloading() -> None:
    """The same moves at topk_ratio=0.1 with overlap: the step counts carry over (AdamW gets each parameter's own),
    the schedule starts over after the import (a selection at the first step), and training goes on."""
    model = Net()
    first = torch.optim.AdamW(model.parameters(), **HP)
    _train(model, first, range(3))
    middle = ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.1, update_interval=4, min_offload_numel=MIN_OFFLOAD,
                         warmup_steps=0)
    middle.load_state_dict(first.state_dict())
    weights = offloaded(model)
    assert all(int(middle.state[p]["host_col_step"][0]) == 3 for p in weights)
    _train(model, middle, range(3, 13))
    assert middle.stats()["selections"] == 1  # at the first step after the import (select_interval is 32)
    for p in weights:
        st = middle.state[p]
        assert st["step"] == 13
        selected = st["slot"] >= 0
        assert bool((st["col_step"][selected] == 13).all())  # selected since the import: every step
    last = torch.optim.AdamW(model.parameters(), **HP)
    last.load_state_dict(middle.adamw_state_dict())
    middle.close()
    assert all(float(last.state[p]["step"]) == 13 for p in model.parameters())
    losses = []
    for i in range(13, 20):
        last.zero_grad()
        loss = loss_fn(model, i)
        loss.backward()
        last.step()
        losses.append(float(loss))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("steps", [1, 3, 6])
def test_state_shapes_depend_only_on_the_parameters(steps: int) -> None:
    """In warm-up, before and after selections, at any topk_ratio: the same shapes (DCP checks them)."""
    shapes = set()
    for r in (0.0, 0.1, 0.5, 1.0):
        model = Net()
        opt = ZenFlowAdamW(model.parameters(), **HP, topk_ratio=r, update_interval=2, warmup_steps=2,
                           min_offload_numel=MIN_OFFLOAD)
        _train(model, opt, range(steps))
        sd = opt.state_dict()
        shapes.add(tuple((sid, key, tuple(v.shape)) for sid, st in sorted(sd["state"].items())
                         for key, v in sorted(st.items()) if isinstance(v, torch.Tensor)))
        opt.close()
    assert len(shapes) == 1


def test_checkpoint_loads_with_another_topk_ratio() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.1, update_interval=4, min_offload_numel=MIN_OFFLOAD,
                         warmup_steps=0)
    _train(model, opt, range(6))  # mid-window, one selection made
    sd = copy.deepcopy(opt.state_dict())
    opt.close()
    other = ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.5, update_interval=4, min_offload_numel=MIN_OFFLOAD,
                         warmup_steps=0)
    other.load_state_dict(sd)
    assert other.config.topk_ratio == 0.5 and other.stats()["topk_ratio"] == 0.1  # the checkpoint's knobs resume
    _train(model, other, range(6, 12))
    other.flush()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    other.close()


def _v1_state_dict(opt: ZenFlowAdamW) -> dict:
    """A state_dict as the first format wrote it: each offloaded parameter's live layout (host arrays, slot map,
    compact selected state) copied, and no format number."""
    sd = opt.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    for p, st in opt.state.items():
        if "host_master" in st:
            sd["state"][index[id(p)]] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
    del sd["zenflow"]["format"]
    for g in sd["param_groups"]:
        del g["zenflow"]
    return sd


@pytest.mark.parametrize("overlap", [True, False])
def test_first_format_checkpoints_still_resume_exactly(overlap: bool) -> None:
    knobs = dict(**HP, topk_ratio=0.2, update_interval=3, select_interval=6, overlap=overlap,
                 min_offload_numel=MIN_OFFLOAD)
    straight = Net()
    straight_opt = ZenFlowAdamW(straight.parameters(), **knobs)
    _train(straight, straight_opt, range(14))
    straight_opt.flush()

    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **knobs)
    _train(model, opt, range(8))
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": _v1_state_dict(opt)})
    opt.close()
    resumed = Net()
    resumed.load_state_dict(ckpt["model"])
    opt = ZenFlowAdamW(resumed.parameters(), **knobs)
    opt.load_state_dict(ckpt["opt"])
    _train(resumed, opt, range(8, 14))
    opt.flush()
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    opt.close()
    straight_opt.close()


def test_distributed_checkpoint_saved_in_warmup_loads_after_selection(tmp_path) -> None:
    """torch.distributed.checkpoint's own flow (get/set_optimizer_state_dict, dcp.save/load into a template): a
    checkpoint saved during warm-up loads into an optimizer past its first selection (it failed with a [128, 0] vs
    [128, 7] size mismatch), and the knobs and the schedule travel in the param groups, which DCP keeps."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    knobs = dict(**HP, topk_ratio=0.25, update_interval=2, warmup_steps=3, min_offload_numel=MIN_OFFLOAD)
    straight = Net()
    straight_opt = ZenFlowAdamW(straight.parameters(), **knobs)
    _train(straight, straight_opt, range(10))
    straight_opt.flush()

    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **knobs)
    _train(model, opt, range(2))  # in warm-up: nothing selected yet
    dcp.save({"opt": get_optimizer_state_dict(model, opt), "model": model.state_dict()},
             checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    opt.close()

    resumed = Net()
    opt = ZenFlowAdamW(resumed.parameters(), **knobs)
    _train(resumed, opt, range(7))  # the template comes from an optimizer past warm-up, with a selection
    template = {"opt": get_optimizer_state_dict(resumed, opt), "model": resumed.state_dict()}
    dcp.load(template, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    resumed.load_state_dict(template["model"])
    set_optimizer_state_dict(resumed, opt, template["opt"])
    assert opt.state_dict()["zenflow"]["step"] == 2
    _train(resumed, opt, range(2, 10))
    opt.flush()
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    opt.close()
    straight_opt.close()
