"""grads_in_backward beyond the plain loop (issue 30 items 1-3; zenflow_triton/capture.py): AMP's GradScaler refused
at its first step, hooks that follow the model (a meta build materialized by swapping tensors, a weight unfrozen after
the optimizer was built, a hook lost otherwise: warned), and a layer shared by reentrant checkpoints scored on its
summed gradient. Every case against the default mode (grads_in_backward=False), bit for bit."""

from __future__ import annotations

import logging

import pytest
import torch
from test_grads_in_backward import DELAY_CYCLES, KNOBS, STEPS, _assert_same, _bits_equal, _pair
from test_optimizer import Net, batch, loss_fn, offloaded
from torch import nn
from torch.utils.checkpoint import checkpoint

from zenflow_triton import ZenFlowAdamW

# ---------------------------------------------------------------------------------------------- 1. AMP's GradScaler


def _scaled_backward(model: nn.Module, scaler: torch.amp.GradScaler, i: int, *, overflow: bool = False) -> None:
    loss = loss_fn(model, i)
    if overflow:  # every gradient non-finite, as a real fp16 overflow makes them
        loss = loss * float("inf")
    scaler.scale(loss).backward()


@pytest.mark.parametrize("unscale_first", [False, True])
@pytest.mark.parametrize("overflow", [False, True])
def test_grad_scaler_is_refused_at_its_first_step_and_nothing_changes(overflow: bool, unscale_first: bool) -> None:
    """The scaler cannot see the captured gradients (it unscales and inf-checks .grad), so scaler.step() raises,
    naming the combination and the fix, before anything changes; the optimizer then trains as the default mode does
    (bit for bit), the scaler's attributes gone from it."""
    models, opts = _pair()
    before = [p.detach().clone() for p in models[1].parameters()]
    scaler = torch.amp.GradScaler("cpu")
    opts[1].zero_grad()
    _scaled_backward(models[1], scaler, 0, overflow=overflow)
    if unscale_first:  # the clip_grad_norm_ recipe: unscale_ touches only the resident .grads, step() refuses
        scaler.unscale_(opts[1])
    with pytest.raises(RuntimeError, match=r"grads_in_backward=True with AMP's GradScaler.*bfloat16.*"
                                           r"grads_in_backward=False"):
        scaler.step(opts[1])
    assert all(_bits_equal(a, b) for a, b in zip(before, models[1].parameters()))
    assert opts[1].stats()["steps"] == 0
    assert not hasattr(opts[1], "found_inf") and not hasattr(opts[1], "grad_scale")
    for i in range(8):  # without the scaler: the default mode's run
        for m, o in zip(models, opts):
            o.zero_grad()
            loss_fn(m, i).backward()
            o.step()
        _assert_same(*models, f"step {i + 1}")
    for o in opts:
        o.close()


def test_a_disabled_grad_scaler_steps_as_without_one() -> None:
    """GradScaler(enabled=False) (AMP switched off by a flag) calls step() plainly: the default mode's run."""
    models, opts = _pair()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for i in range(8):
        for m, o in zip(models, opts):
            o.zero_grad()
            scaler.scale(loss_fn(m, i)).backward()
            scaler.step(o)
            scaler.update()
        _assert_same(*models, f"step {i + 1}")
    for o in opts:
        o.close()


def test_the_default_mode_keeps_the_scaler_protocol() -> None:
    """The fix the refusal names: grads_in_backward=False with the scaler is the run without one (the scale is a
    power of two: unscaling is exact) and an overflow skips the step and halves the scale."""
    models = [Net(), Net()]
    opts = [ZenFlowAdamW(m.parameters(), **KNOBS) for m in models]
    assert not getattr(opts[0], "_step_supports_amp_scaling", False)  # the scaler's own .grad path
    scaler = torch.amp.GradScaler("cpu")
    for i in range(8):
        opts[0].zero_grad()
        loss_fn(models[0], i).backward()
        opts[0].step()
        opts[1].zero_grad()
        _scaled_backward(models[1], scaler, i)
        scaler.step(opts[1])
        scaler.update()
        _assert_same(*models, f"step {i + 1}")
    scale = scaler.get_scale()
    opts[1].zero_grad()
    _scaled_backward(models[1], scaler, 8, overflow=True)
    scaler.step(opts[1])
    scaler.update()
    assert scaler.get_scale() == scale / 2 and opts[1].stats()["steps"] == 8
    _assert_same(*models, "after the skipped step")
    for o in opts:
        o.close()


# ---------------------------------------------------------------------------------------------- 2. hooks that follow


@pytest.fixture
def swap_params():
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(previous)


@pytest.mark.parametrize("zero_grad_first", [True, False])
def test_meta_build_materialized_by_swapping_is_captured(swap_params, zero_grad_first: bool) -> None:
    """A model built on the meta device, the optimizer over it, then ``to_empty`` and ``load_state_dict`` (both swap
    the parameters' tensors): the hooks move to the new tensors at the first zero_grad() (or step()), the offloaded
    gradients are captured from then on, and the run is the default mode's bit for bit."""
    reference = Net()
    with torch.device("meta"):
        model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS, grads_in_backward=True)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    plain = ZenFlowAdamW(reference.parameters(), **KNOBS)
    for i in range(STEPS):
        for m, o in ((reference, plain), (model, opt)):
            if zero_grad_first:
                o.zero_grad()
            loss_fn(m, i).backward()
            if o is opt:
                # zero_grad() before the first backward re-hooks at once; after it, step() does (the first
                # gradient then steps from .grad, as in the default mode).
                captured = zero_grad_first or i > 0
                assert all((p.grad is None) == captured for p in offloaded(model)), f"step {i + 1}"
            o.step()
            if not zero_grad_first:
                o.zero_grad()
        _assert_same(reference, model, f"step {i + 1}")
        assert opt.stats()["captured_last_step"] == (3 if zero_grad_first or i > 0 else 0)
    assert plain.stats()["captured_last_step"] == 0
    for o in (plain, opt):
        o.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_tensors_swapped_mid_training_are_hooked_again(overlap: bool) -> None:
    """``torch.utils.swap_tensors`` on every offloaded parameter after step 5 (what ``to()`` does with swapped module
    params): still captured from the next backward, and the default mode's run (same swap) bit for bit."""
    models, opts = _pair(overlap=overlap)
    for i in range(12):
        for m, o in zip(models, opts):
            if i == 5:
                for p in offloaded(m):
                    torch.utils.swap_tensors(p, nn.Parameter(p.detach().clone()))
            o.zero_grad()
            loss_fn(m, i).backward()
            if o.config.grads_in_backward:
                assert all(p.grad is None for p in offloaded(m)), f"step {i + 1}"
            o.step()
        _assert_same(*models, f"step {i + 1}")
    assert opts[1].stats()["captured_last_step"] == 3
    for o in opts:
        o.close()


def test_a_weight_unfrozen_after_construction_is_captured() -> None:
    """The embedding frozen when the optimizer is built, unfrozen at step 5: from its first gradient on it is
    captured (``.grad`` None after backward), its state made then, as in the default mode, bit for bit."""
    models, opts = [Net(), Net()], []
    for m, g in zip(models, (False, True)):
        m.emb.weight.requires_grad_(False)
        opts.append(ZenFlowAdamW(m.parameters(), **KNOBS, grads_in_backward=g))
    assert not models[1].emb.weight.requires_grad  # the hook's registration left the flag as it was
    for i in range(STEPS):
        for m, o in zip(models, opts):
            if i == 4:
                m.emb.weight.requires_grad_(True)
            o.zero_grad()
            loss_fn(m, i).backward()
            if o.config.grads_in_backward:
                assert all(p.grad is None for p in offloaded(m)), f"step {i + 1}"
            o.step()
        _assert_same(*models, f"step {i + 1}")
        assert opts[1].stats()["captured_last_step"] == (2 if i < 4 else 3)
    assert models[1].emb.weight in opts[1].state
    for o in opts:
        o.close()


def test_a_gradient_the_hooks_missed_is_warned_once_by_name(caplog) -> None:
    """A hook removed behind the optimizer's back: the gradient steps from .grad (the default mode's step) and one
    warning names the parameter; stats() counts the captured ones."""
    model = Net()
    groups = [{"params": [p for _, p in model.named_parameters()],
               "param_names": [n for n, _ in model.named_parameters()]}]
    opt = ZenFlowAdamW(groups, **KNOBS, grads_in_backward=True)
    opt._capture._hooks[model.fc1.weight].remove()
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        for i in range(4):
            opt.zero_grad()
            loss_fn(model, i).backward()
            opt.step()
            assert opt.stats()["captured_last_step"] == 2
    warnings = [r.getMessage() for r in caplog.records if "left in .grad" in r.getMessage()]
    assert len(warnings) == 1 and "parameter 'fc1.weight'" in warnings[0] and "emb" not in warnings[0]
    opt.close()


# ------------------------------------------------------------------------------------------ 3. reentrant checkpoints


class SharedNet(nn.Module):
    """One square layer applied in two reentrant checkpoints (with ``nested``, the second inside a third): its hook
    fires once per recomputation, several times in one backward. The embedding and the head are offloaded too."""

    def __init__(self, nested: bool = False, vocab: int = 64) -> None:
        super().__init__()
        torch.manual_seed(99)
        self.emb = nn.Embedding(vocab, 32)
        self.shared = nn.Linear(32, 32)  # [32, 32]: 1024 elements, offloaded
        self.mid = nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, 16)
        self.nested = nested

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(h))

    def _outer(self, h: torch.Tensor) -> torch.Tensor:
        return self.mid(checkpoint(self._block, h, use_reentrant=True))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).mean(dim=1)
        h = checkpoint(self._block, h, use_reentrant=True)
        h = self.mid(h)
        h = checkpoint(self._outer if self.nested else self._block, h, use_reentrant=True)
        return self.head(h)


def _shared_loss(model: nn.Module, i: int) -> torch.Tensor:
    x, y = batch(i)
    return (model(x % model.emb.num_embeddings) - y).pow(2).mean()


@pytest.mark.parametrize("nested", [False, True])
def test_a_layer_shared_by_reentrant_checkpoints_is_scored_on_its_sum(nested: bool) -> None:
    """The shared layer's hook fires twice (nested: its checkpoint inside another) in each backward: its scores are
    |a + b|^2, the default mode's, so selection, state and parameters are bit-identical over 16 steps with three
    selections."""
    models = [SharedNet(nested), SharedNet(nested)]
    opts = [ZenFlowAdamW(m.parameters(), **KNOBS, grads_in_backward=g) for m, g in zip(models, (False, True))]
    fires = []
    models[1].shared.weight.register_post_accumulate_grad_hook(lambda p: fires.append(1))
    for i in range(STEPS):
        for m, o in zip(models, opts):
            o.zero_grad()
            _shared_loss(m, i).backward()
            o.step()
        _assert_same(*models, f"step {i + 1}")
        for p0, p1 in zip(offloaded(models[0]), offloaded(models[1])):
            for key in ("score", "col_step", "slot"):
                assert torch.equal(opts[0].state[p0][key], opts[1].state[p1][key]), f"step {i + 1}: {key}"
    assert len(fires) == 2 * STEPS  # two calls per backward: the case this covers
    assert opts[1].stats()["selections"] == 3 and opts[1].stats()["captured_last_step"] == 4
    for o in opts:
        o.close()


def test_a_shared_layer_with_micro_batches_is_scored_on_the_step_gradient() -> None:
    """Two backward() calls per step, the shared layer the only offloaded one trained (a small embedding and the head
    resident, ``mid`` frozen): a parameter called more than once in a backward is scored on its whole step's gradient
    (the slot), the default mode's scores (once-called ones add each backward's); so everything is bit-identical."""
    knobs = {**KNOBS, "min_offload_numel": 1000}
    models = [SharedNet(vocab=16), SharedNet(vocab=16)]
    for m in models:
        m.mid.weight.requires_grad_(False)
    opts = [ZenFlowAdamW(m.parameters(), **knobs, grads_in_backward=g) for m, g in zip(models, (False, True))]
    for i in range(STEPS):
        for m, o in zip(models, opts):
            o.zero_grad()
            for j in range(2):
                _shared_loss(m, 2 * i + j).backward()
            o.step()
        _assert_same(*models, f"step {i + 1}")
        p0, p1 = models[0].shared.weight, models[1].shared.weight
        assert torch.equal(opts[0].state[p0]["score"], opts[1].state[p1]["score"]), f"step {i + 1}"
        assert opts[1].stats()["captured_last_step"] == 1 and p1.grad is None
    for o in opts:
        o.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_shared_layer_in_reentrant_checkpoints_bitwise(backend: str) -> None:
    """On CUDA, with the copy streams delayed: the end of the outermost backward is seen from autograd's device
    thread, the slot (first copy on the device-to-host stream, later calls added on the host) is copied back and
    scored on the device as the default mode scores .grad: bit for bit, nested checkpoints included."""
    models = [SharedNet(nested=True).cuda(), SharedNet(nested=True).cuda()]
    opts = [ZenFlowAdamW(m.parameters(), **KNOBS, backend=backend, grads_in_backward=g, worker_timeout=120.0)
            for m, g in zip(models, (False, True))]
    for o in opts:
        o._pipeline.test_delays = {"d2h": DELAY_CYCLES, "h2d": DELAY_CYCLES, "merge": DELAY_CYCLES}
    for i in range(STEPS):
        for m, o in zip(models, opts):
            o.zero_grad()
            x, y = batch(i)
            (m(x.cuda()) - y.cuda()).pow(2).mean().backward()
            o.step()
        torch.cuda.synchronize()
        _assert_same(*models, f"step {i + 1}")
    assert all(p.grad is None for p in offloaded(models[1]))
    for o in opts:
        o.close()
