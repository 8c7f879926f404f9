"""What the optimizer holds and for how long: after ``close()`` nothing large (host slabs, ``acc``, the compact device
state), and after a mid-run ``load_state_dict()`` not the old slab (weak references on CPU tensors)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from zenflow_triton import ZenFlowAdamW


def _train(opt: ZenFlowAdamW, params: list[nn.Parameter], steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(64, 96)), nn.Parameter(torch.randn(32, 80)), nn.Parameter(torch.randn(7))]


@pytest.mark.parametrize("overlap", [True, False])
def test_close_releases_everything_large(overlap: bool) -> None:
    params = _params()
    opt = ZenFlowAdamW(params, lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=4, warmup_steps=1,
                       overlap=overlap, min_offload_numel=512, backend="numba")
    _train(opt, params, 5)  # a window just ended: with overlap its host job is in flight, its result pending
    assert opt.stats()["host_bytes"] > 0
    slabs = [weakref.ref(slab._owner) for slab in opt._pipeline.slabs]
    tensors = [weakref.ref(opt.state[p][key]) for p in params[:2]
               for key in ("acc", "master", "exp_avg", "exp_avg_sq", "score", "host_exp_avg")]
    tensors.append(weakref.ref(opt.state[params[2]]["exp_avg"]))  # resident state goes too
    pending = [bool(opt.state[p]["pending"]) for p in params[:2]]
    before = [p.detach().clone() for p in params]
    opt.close()
    gc.collect()
    assert all(ref() is None for ref in slabs), "a host slab outlived close()"
    assert all(ref() is None for ref in tensors), "optimizer state outlived close()"
    st = opt.stats()
    assert st["host_bytes"] == 0 and st["pinned_bytes"] == 0 and st["offloaded_params"] == 0
    assert len(opt.state) == 0
    assert not opt._pipeline.worker.alive
    # close() applied the host work in flight first: a pending result reached the parameters.
    assert pending == [overlap, overlap]
    if overlap:
        assert all(not torch.equal(a, p.detach()) for a, p in zip(before[:2], params[:2]))
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


def test_load_state_dict_mid_run_drops_the_old_slab() -> None:
    params = _params()
    opt = ZenFlowAdamW(params, lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=4, warmup_steps=1,
                       overlap=True, min_offload_numel=512, backend="numba")
    _train(opt, params, 5)
    old = [weakref.ref(slab._owner) for slab in opt._pipeline.slabs]
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    del sd
    gc.collect()
    # Before the worker dropped its last job's arguments, the old slab stayed alive (pinned, on a GPU) until the
    # next window's job replaced them.
    assert all(ref() is None for ref in old), "the replaced slab is still alive"
    assert len(opt._pipeline.slabs) == 1
    _train(opt, params, 3, seed=1)
    opt.close()
