"""grads_in_backward (DESIGN §3, §5; zenflow_triton/capture.py): the offloaded gradients consumed in backward hooks.

Against the default accumulate="host" mode bit for bit (one backward per step, over selections that migrate the
captured gradient; every backend, fp32 and bf16, overlap on and off), against the dense simulation of
tests/test_optimizer.py, micro-batches, zero_grad(), clipping against clip_grad_norm_, checkpoints, close(), copies
and the refusals."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from test_optimizer import BACKENDS, MIN_OFFLOAD, Net, Simulation, _skip_unavailable, loss_fn, offloaded

import zenflow_triton.capture as zcapture
from zenflow_triton import ZenFlowAdamW, ZenFlowConfig

KNOBS = dict(lr=2e-2, weight_decay=0.05, topk_ratio=0.25, update_interval=3, select_interval=6, warmup_steps=2,
             min_offload_numel=MIN_OFFLOAD, accumulate="host", overlap_steps=None)
# warm-up 2, then selections at tau = 1 (step 3: the ordinary path), 7 and 13 (steps 9, 15: captured and migrated)
STEPS = 16


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))


def _assert_same(m0: torch.nn.Module, m1: torch.nn.Module, what: str) -> None:
    for (name, a), b in zip(m0.named_parameters(), m1.parameters()):
        assert _bits_equal(a, b), f"{what}: {name}"


def _pair(dtype=torch.float32, **knobs):
    models = [Net(dtype), Net(dtype)]
    opts = [ZenFlowAdamW(m.parameters(), **{**KNOBS, **knobs}, grads_in_backward=g)
            for m, g in zip(models, (False, True))]
    return models, opts


def _train_pair(models, opts, steps: int, *, micro: int = 1, before=None, between=None, sync: bool = False) -> None:
    """``steps`` steps of each (model, optimizer) pair: ``before(i, model)``, zero_grad, ``micro`` backward() calls,
    ``between(i, optimizer)``, step(); after each step both models' parameters bit for bit."""
    for i in range(steps):
        for m, o in zip(models, opts):
            if before is not None:
                before(i, m)
            o.zero_grad()
            for j in range(micro):
                loss_fn(m, micro * i + j).backward()
            if between is not None:
                between(i, o)
            o.step()
        if sync:
            torch.cuda.synchronize()
        _assert_same(*models, f"step {i + 1}")


# Triton (interpreted) with fp32 only: each interpreted case is slow, and its 16-bit casts are test_fused_step's.
CASES = [(b, d) for b in BACKENDS for d in (torch.float32, torch.bfloat16) if b != "triton" or d == torch.float32]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("backend,dtype", CASES)
def test_equals_default_host_mode_bitwise_every_step(backend: str, dtype: torch.dtype, overlap: bool) -> None:
    _skip_unavailable(backend)
    models, opts = _pair(dtype, backend=backend, overlap=overlap)
    for i in range(STEPS):
        for m, o in zip(models, opts):
            o.zero_grad()
            loss_fn(m, i).backward()
            if o.config.grads_in_backward:
                # From the first backward on (warm-up and the first selection included), the offloaded gradients
                # are gone after backward; the resident ones (biases, LayerNorm) keep .grad.
                assert all(p.grad is None for p in offloaded(m)), f"step {i + 1}"
                assert m.fc1.bias.grad is not None and m.norm.weight.grad is not None
            o.step()
        _assert_same(*models, f"step {i + 1}")
        for p0, p1 in zip(offloaded(models[0]), offloaded(models[1])):
            for key in ("score", "col_step", "slot"):
                assert torch.equal(opts[0].state[p0][key], opts[1].state[p1][key]), f"step {i + 1}: {key}"
    assert opts[1].stats()["selections"] == 3
    for o in opts:
        o.flush()
    _assert_same(*models, "after flush")
    for o in opts:
        o.close()


def _simulated():
    """A model with an in-backward optimizer (r = 0.25, U = 3, S = 6, two warm-up steps), a twin model that computes
    the gradients the capture consumes, the hyperparameters, and the dense oracle of each offloaded parameter."""
    model, twin = Net(), Net()
    hp = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    opt = ZenFlowAdamW(model.parameters(), **hp, topk_ratio=0.25, update_interval=3, select_interval=6,
                       warmup_steps=2, min_offload_numel=MIN_OFFLOAD, accumulate="host", grads_in_backward=True,
                       overlap_steps=None)
    sims = {p: Simulation(p.detach(), r=0.25, interval=3, select=6, warmup=2, overlap=True) for p in offloaded(model)}
    return model, twin, hp, opt, sims


def test_matches_simulation_every_step() -> None:
    """The dense oracle, fed the gradients a twin model computes (the captured ones are gone after backward)."""
    model, twin, hp, opt, sims = _simulated()
    twin_params = dict(zip(model.parameters(), twin.parameters()))
    for i in range(STEPS):
        with torch.no_grad():
            for p, q in twin_params.items():
                q.copy_(p)
                q.grad = None
        loss_fn(twin, i).backward()
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
        for p, sim in sims.items():
            sim.step(twin_params[p].grad, hp["lr"], *hp["betas"], hp["eps"], hp["weight_decay"])
            torch.testing.assert_close(p.detach().view(sim.rows, sim.cols), sim.w, atol=2e-5, rtol=1e-5,
                                       msg=lambda m, i=i: f"step {i + 1}: {m}")
    opt.close()


@pytest.mark.parametrize("r", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_micro_batches_sum_as_grad_does(r: float, dtype: torch.dtype) -> None:
    """Three backward() calls per step, with a selection that the scores cannot change (nothing, or every column:
    per-micro-batch scores may choose otherwise than the summed gradient's): the parameters are the default mode's
    bit for bit, the host part (r = 0) and the compact part (r = 1) summing in the parameter's dtype as .grad does."""
    models, opts = _pair(dtype, topk_ratio=r)
    _train_pair(models, opts, 12, micro=3)
    for o in opts:
        o.close()


@pytest.mark.slow
def test_micro_batches_match_simulation_with_per_micro_batch_scores() -> None:
    """Two backward() calls per step at r = 0.25 over three selections: the dense oracle, given the summed gradient
    for the update and the micro-batches' summed column norms for the scores (what the capture documents)."""
    model, twin, hp, opt, sims = _simulated()
    twin_params = dict(zip(model.parameters(), twin.parameters()))
    for i in range(STEPS):
        total = {p: 0.0 for p in sims}
        norms = {p: 0.0 for p in sims}
        opt.zero_grad()
        for j in range(2):
            with torch.no_grad():
                for p, q in twin_params.items():
                    q.copy_(p)
                    q.grad = None
            loss_fn(twin, 2 * i + j).backward()
            for p in sims:
                g = twin_params[p].grad.view(sims[p].rows, sims[p].cols)
                total[p] = total[p] + g
                norms[p] = norms[p] + g.double().pow(2).sum(0)
            loss_fn(model, 2 * i + j).backward()
        opt.step()
        for p, sim in sims.items():
            # The simulation adds the summed gradient's column norms itself: give it the micro-batches' instead.
            sim.score += norms[p] - total[p].double().pow(2).sum(0)
            sim.step(total[p], hp["lr"], *hp["betas"], hp["eps"], hp["weight_decay"])
            torch.testing.assert_close(p.detach().view(sim.rows, sim.cols), sim.w, atol=2e-5, rtol=1e-5,
                                       msg=lambda m, i=i: f"step {i + 1}: {m}")
    assert opt.stats()["selections"] == 3
    opt.close()


def test_micro_batch_scores_are_summed_per_micro_batch() -> None:
    """With several backward() calls the scores add each micro-batch's column sums of squares (the selection may then
    differ from the default mode's, which scores the summed gradient)."""
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS, grads_in_backward=True)
    twin = Net()
    p, q = model.fc1.weight, twin.fc1.weight
    for i in range(6):
        want = opt.state[p]["score"].clone() if p in opt.state else torch.zeros(32)
        opt.zero_grad()
        parts = []
        for j in range(2):
            with torch.no_grad():
                for a, b in zip(model.parameters(), twin.parameters()):
                    b.copy_(a)
                    b.grad = None
            loss_fn(twin, 2 * i + j).backward()
            parts.append(q.grad.clone())
            loss_fn(model, 2 * i + j).backward()
        captured = p.grad is None
        opt.step()
        assert captured
        if i + 1 != 3:  # not the selection step (it reselects and zeroes the scores)
            expect = want + sum(g.pow(2).sum(0) for g in parts)
            torch.testing.assert_close(opt.state[p]["score"], expect, rtol=1e-6, atol=0)
    opt.close()


@pytest.mark.slow
def test_zero_grad_discards_a_capture() -> None:
    """backward, zero_grad(), backward, step equals backward, step (in the default mode)."""
    models, opts = _pair()
    for i in range(10):
        m, o = models[1], opts[1]
        o.zero_grad()
        loss_fn(m, 100 + i).backward()  # discarded below
        o.zero_grad()
        loss_fn(m, i).backward()
        o.step()
        opts[0].zero_grad()
        loss_fn(models[0], i).backward()
        opts[0].step()
        _assert_same(*models, f"step {i + 1}")
    # A step() with nothing captured and no .grad is no step (as in torch): nothing changes, the schedule stays.
    before = [p.detach().clone() for p in models[1].parameters()]
    steps = opts[1].stats()["steps"]
    loss_fn(models[1], 0).backward()
    opts[1].zero_grad()
    opts[1].step()
    assert opts[1].stats()["steps"] == steps
    assert all(_bits_equal(a, b) for a, b in zip(before, models[1].parameters()))
    for o in opts:
        o.close()


def test_a_parameter_without_gradient_gets_nothing() -> None:
    """A parameter that gets no gradient in some steps (frozen for them): as in the default mode."""
    models, opts = _pair()
    _train_pair(models, opts, 12, before=lambda i, m: m.emb.weight.requires_grad_(i % 4 != 2))
    for o in opts:
        o.close()


def test_clipping_equals_clip_grad_norm() -> None:
    """max_grad_norm over the captured gradients (the host slots), the resident .grads; equal to clip_grad_norm_ then
    step() in the default mode, to fp32 rounding; and clipping does act here (skipping it changes the result)."""
    models = [Net(), Net(), Net()]
    clip = 0.05
    plain = ZenFlowAdamW(models[0].parameters(), **KNOBS)
    inside = ZenFlowAdamW(models[1].parameters(), **KNOBS, grads_in_backward=True, max_grad_norm=clip)
    unclipped = ZenFlowAdamW(models[2].parameters(), **KNOBS, grads_in_backward=True)
    norms = []
    for i in range(STEPS):
        for m, o in zip(models, (plain, inside, unclipped)):
            o.zero_grad()
            loss_fn(m, i).backward()
            if o is plain:
                norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), clip)))
            o.step()
        assert inside.stats()["last_grad_norm"] == pytest.approx(norms[-1], rel=1e-6)
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=lambda m, i=i: f"step {i + 1}: {m}")
    assert min(norms) > clip  # every step clipped
    assert not torch.allclose(models[2].fc1.weight, models[0].fc1.weight, rtol=1e-3)
    for o in (plain, inside, unclipped):
        o.close()


@pytest.mark.parametrize("into", [True, False])
def test_checkpoint_mid_window_resumes_bitwise(into: bool) -> None:
    """A checkpoint after step 10 (mid-window) resumed with grads_in_backward (``into``) or without continues as the
    uninterrupted run, bit for bit."""
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS, grads_in_backward=True)
    for i in range(10):
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    resumed = Net()
    resumed.load_state_dict(model.state_dict())
    opt2 = ZenFlowAdamW(resumed.parameters(), **KNOBS, grads_in_backward=into)
    opt2.load_state_dict(saved)
    for i in range(10, STEPS + 2):
        for m, o in ((model, opt), (resumed, opt2)):
            o.zero_grad()
            loss_fn(m, i).backward()
            o.step()
        _assert_same(model, resumed, f"step {i + 1}")
    # load_state_dict() between backward and step is refused (the capture was split by the state it replaces).
    opt.zero_grad()
    loss_fn(model, 0).backward()
    with pytest.raises(RuntimeError, match="between backward"):
        opt.load_state_dict(saved)
    opt.close()
    opt2.close()


def test_flush_and_state_dict_between_backward_and_step() -> None:
    """flush() and state_dict() between a backward and its step leave the capture for the step, as .grad is left in
    the default mode: the same parameters bit for bit."""
    def between(i: int, o: ZenFlowAdamW) -> None:
        if i % 5 == 4:
            o.flush()
        if i % 3 == 1:
            o.state_dict()

    models, opts = _pair()
    _train_pair(models, opts, STEPS, between=between)
    for o in opts:
        o.close()


def test_close_removes_the_hooks() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS, grads_in_backward=True)
    for i in range(5):
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
    loss_fn(model, 5).backward()
    assert model.fc1.weight.grad is None  # captured
    opt.close()
    model.zero_grad()
    loss_fn(model, 6).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_hook_their_own_parameters(how: str) -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS, grads_in_backward=True)
    for i in range(6):
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
    pair = (model, opt)
    model2, opt2 = copy.deepcopy(pair) if how == "deepcopy" else pickle.loads(pickle.dumps(pair))
    assert opt2.config.grads_in_backward
    for i in range(6, 14):
        for m, o in ((model, opt), (model2, opt2)):
            o.zero_grad()
            loss_fn(m, i).backward()
            assert m.fc1.weight.grad is None  # each optimizer captured its own model's gradient
            o.step()
        _assert_same(model, model2, f"step {i + 1}")
    opt.close()
    opt2.close()


def test_refusals(monkeypatch) -> None:
    assert ZenFlowConfig().grads_in_backward is False
    with pytest.raises(ValueError, match="'host'"):
        ZenFlowConfig(accumulate="device", grads_in_backward=True)
    with pytest.raises(ValueError, match="grads_in_backward"):
        ZenFlowConfig(grads_in_backward=1)
    with pytest.raises(ValueError, match="bfloat16"):
        ZenFlowAdamW(Net(torch.float16).parameters(), min_offload_numel=MIN_OFFLOAD, grads_in_backward=True,
                     warmup_steps=0)
    w = torch.nn.Parameter(torch.randn(32, 32))
    with pytest.raises(ValueError, match="listed twice"):
        ZenFlowAdamW([w, w], min_offload_numel=MIN_OFFLOAD, grads_in_backward=True, warmup_steps=0)
    with pytest.raises(ValueError, match="grad_dtype='float32'"):
        ZenFlowAdamW([w], min_offload_numel=MIN_OFFLOAD, grads_in_backward=True, grad_dtype="bfloat16", warmup_steps=0)
    monkeypatch.setattr(zcapture, "is_sharded", lambda p: True)
    with pytest.raises(ValueError, match="DTensor"):
        ZenFlowAdamW([w], min_offload_numel=MIN_OFFLOAD, grads_in_backward=True, warmup_steps=0)


def test_several_processes_are_refused(monkeypatch) -> None:
    """DDP's all-reduce reads .grad after the hooks: a job of several processes is refused (at construction, and at
    the first backward when the process group came later)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(RuntimeError, match="several processes"):
        ZenFlowAdamW(Net().parameters(), min_offload_numel=MIN_OFFLOAD, grads_in_backward=True, warmup_steps=0)


def test_zenflow_adam_equals_its_default_mode() -> None:
    from zenflow_triton import ZenFlowAdam

    models = [Net(), Net()]
    opts = [ZenFlowAdam(m.parameters(), **KNOBS, grads_in_backward=g) for m, g in zip(models, (False, True))]
    _train_pair(models, opts, 10)
    for o in opts:
        o.close()


def test_auto_places_the_sums_on_the_host_and_stats() -> None:
    model = Net()
    with ZenFlowAdamW(model.parameters(), min_offload_numel=MIN_OFFLOAD, grads_in_backward=True, warmup_steps=0) as opt:
        loss_fn(model, 0).backward()
        opt.step()
        st = opt.stats()
        assert st["accumulate"] == "host" and st["accumulate_reason"] == "grads_in_backward"
        assert st["grads_in_backward"] is True


def test_a_bad_captured_gradient_is_named() -> None:
    """The hook checks the gradient as step() would and names the parameter (autograd's accumulation keeps .grad in
    the parameter's layout, so the bad gradient is handed to the hook's body directly)."""
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS, grads_in_backward=True)
    for i in range(4):
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
    p = model.fc1.weight
    p.grad = torch.randn(32, 48).t()
    named = r"grads_in_backward: parameter 1 of param group 0 \(shape \(48, 32\)\).*not contiguous"
    with pytest.raises(RuntimeError, match=named):
        opt._capture.capture(p)
    p.grad = None
    opt.close()


# ---------------------------------------------------------------------------------------------- CUDA (skipped here)

DELAY_CYCLES = 20_000_000  # ~10 ms on an H100/H200 (tests/test_gpu_stress.py): a missing wait shows as wrong numbers


def _cuda_pair(dtype, backend, **knobs):
    models = [Net(dtype).cuda(), Net(dtype).cuda()]
    opts = [ZenFlowAdamW(m.parameters(), **{**KNOBS, **knobs}, backend=backend, grads_in_backward=g,
                         worker_timeout=120.0) for m, g in zip(models, (False, True))]
    for o in opts:
        o._pipeline.test_delays = {"d2h": DELAY_CYCLES, "h2d": DELAY_CYCLES, "merge": DELAY_CYCLES}
    return models, opts


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equals_default_host_mode_bitwise(backend: str, dtype: torch.dtype) -> None:
    """On CUDA, with the copy streams delayed: the capture's device-to-host copies, the adder's event after them, the
    migration's reads of the slot and the compact fused step give the default mode's bits at every step."""
    models, opts = _cuda_pair(dtype, backend)
    _train_pair(models, opts, STEPS, sync=True)
    assert all(p.grad is None for p in offloaded(models[1]))
    for o in opts:
        o.close()


@pytest.mark.gpu
@pytest.mark.parametrize("r", [0.0, 1.0])
def test_cuda_micro_batches_sum_as_grad_does(r: float) -> None:
    """On CUDA a later micro-batch's gradient goes through the pinned scratch and a host add (delayed copies)."""
    models, opts = _cuda_pair(torch.bfloat16, "triton", topk_ratio=r)
    _train_pair(models, opts, 10, micro=3, sync=True)
    for o in opts:
        o.close()


@pytest.mark.gpu
def test_cuda_clipping_equals_clip_grad_norm() -> None:
    """The norm of the captured parts is taken on the host (the slots): equal to clip_grad_norm_ on the device to
    fp32 rounding of the norm."""
    models, opts = _cuda_pair(torch.float32, "triton")
    inside = ZenFlowAdamW(models[1].parameters(), **KNOBS, backend="triton", grads_in_backward=True, max_grad_norm=0.05)
    opts[1].close()
    for i in range(STEPS):
        opts[0].zero_grad()
        loss_fn(models[0], i).backward()
        torch.nn.utils.clip_grad_norm_(models[0].parameters(), 0.05)
        opts[0].step()
        inside.zero_grad()
        loss_fn(models[1], i).backward()
        inside.step()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"step {i + 1}: {m}")
    opts[0].close()
    inside.close()
