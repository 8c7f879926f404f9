"""max_grad_norm (zenflow_triton/gradients.py): clipping inside step() equals torch.nn.utils.clip_grad_norm_ over
the same parameters followed by step(), bit for bit, in every mode."""

from __future__ import annotations

import pytest
import torch
from test_optimizer import MIN_OFFLOAD, Net, loss_fn

from zenflow_triton import ZenFlowAdamW, ZenFlowConfig


@pytest.mark.parametrize("accumulate", ["device", "host"])
@pytest.mark.parametrize("overlap", [True, False])
def test_max_grad_norm_equals_clip_grad_norm_then_step(accumulate: str, overlap: bool) -> None:
    models = [Net(), Net()]
    knobs = dict(lr=2e-2, topk_ratio=0.25, update_interval=2, warmup_steps=1, overlap=overlap,
                 min_offload_numel=MIN_OFFLOAD, accumulate=accumulate)
    inside = ZenFlowAdamW(models[0].parameters(), max_grad_norm=0.05, **knobs)
    outside = ZenFlowAdamW(models[1].parameters(), **knobs)
    norms = []
    for i in range(9):
        for m, o in zip(models, (inside, outside)):
            o.zero_grad()
            loss_fn(m, i).backward()
            if o is outside:
                norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
            o.step()
        for a, b in zip(*(m.parameters() for m in models)):
            assert torch.equal(a, b), f"step {i + 1}"
        assert inside.stats()["last_grad_norm"] == norms[-1]
    assert max(norms) > 0.05  # the bound was active
    for o in (inside, outside):
        o.close()


def test_a_parameter_listed_twice_is_clipped_once() -> None:
    w = torch.nn.Parameter(torch.ones(64, 64))
    with pytest.warns(UserWarning, match="duplicate"):
        opt = ZenFlowAdamW([w, w], max_grad_norm=1.0, topk_ratio=0.1, warmup_steps=0)
    with opt:
        w.grad = torch.full((64, 64), 3.0)  # norm 3 * 64 = 192
        ref = w.grad.clone()
        opt._gradients.clip_(opt.param_groups)
        assert float(opt._gradients._last_norm) == pytest.approx(192.0)
        assert torch.allclose(w.grad, ref * (1.0 / (192.0 + 1e-6)))


def test_max_grad_norm_config() -> None:
    assert ZenFlowConfig().max_grad_norm is None
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="max_grad_norm"):
            ZenFlowConfig(max_grad_norm=bad)
    model = Net()
    with ZenFlowAdamW(model.parameters(), min_offload_numel=MIN_OFFLOAD, warmup_steps=0) as opt:
        loss_fn(model, 0).backward()
        opt.step()
        assert opt.stats()["last_grad_norm"] is None and opt.stats()["max_grad_norm"] is None
