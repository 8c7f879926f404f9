"""accumulate="host" (DESIGN §4, §5): the window sum kept in host memory, one step's gradient added at a time by the
adder thread. Against the dense simulation of tests/test_optimizer.py, and against accumulate="device" bit for bit
at every step (same fp32 sums in the same order), with overlap on and off, for every backend and model dtype."""

from __future__ import annotations

import pytest
import torch
from test_optimizer import BACKENDS, MIN_OFFLOAD, Net, _skip_unavailable, check_against_simulation, loss_fn

from zenflow_triton import ZenFlowAdamW, ZenFlowConfig


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_host_matches_simulation_every_step(backend: str, overlap: bool) -> None:
    _skip_unavailable(backend)
    opt = check_against_simulation(backend=backend, overlap=overlap, warmup=3, r=0.25, interval=3, select=6,
                                   steps=27, accumulate="host")
    st = opt.stats()
    assert st["accumulate"] == "host" and st["selections"] == 4
    assert all(opt.state[p]["acc"].device.type == "cpu" for p in opt._pipeline.records)
    opt.close()


def test_host_bf16_landing_rounds_each_step() -> None:
    """grad_dtype="bfloat16" with accumulate="host" rounds each step's gradient (not the window sum): the window sum
    is the fp32 sum of the bf16-rounded gradients."""
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=4, min_offload_numel=MIN_OFFLOAD,
                       accumulate="host", grad_dtype="bfloat16", warmup_steps=0)
    p = model.fc1.weight
    want = None
    for i in range(3):  # mid-window: the sum holds three steps
        opt.zero_grad()
        loss_fn(model, i).backward()
        g = p.grad.detach().to(torch.bfloat16).float()
        want = g.clone() if want is None else want + g
        opt.step()
    opt._pipeline._wait_adds()
    unsel = opt._pipeline.records[p].masks.unselected.bool()
    assert torch.equal(opt.state[p]["acc"][:, unsel], want.view(48, 32)[:, unsel])
    opt.close()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))


def _pair(dtype, backend, overlap, **knobs):
    models = [Net(dtype), Net(dtype)]
    # fp16 overflows Net's forward at larger steps.
    lr = 1e-3 if dtype == torch.float16 else 2e-2
    opts = [ZenFlowAdamW(m.parameters(), lr=lr, weight_decay=0.05, topk_ratio=0.25, update_interval=3,
                         select_interval=6, warmup_steps=2, overlap=overlap, min_offload_numel=MIN_OFFLOAD,
                         backend=backend, accumulate=mode, **knobs)
            for m, mode in zip(models, ("device", "host"))]
    return models, opts


# Triton (interpreted) with fp32 only: its 16-bit casts are test_fused_step's, and each interpreted case is slow.
CASES = [(b, d) for b in BACKENDS for d in (torch.float32, torch.bfloat16, torch.float16)
         if b != "triton" or d == torch.float32]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("backend,dtype", CASES)
def test_host_equals_device_bitwise_every_step(backend: str, dtype: torch.dtype, overlap: bool) -> None:
    _skip_unavailable(backend)
    models, opts = _pair(dtype, backend, overlap)
    for i in range(14):  # warm-up, two selections, four windows
        for m, o in zip(models, opts):
            o.zero_grad()
            loss_fn(m, i).backward()
            o.step()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert _bits_equal(a, b), f"step {i + 1}"
            # (fp16's resident LayerNorm leaves the range with eps=1e-8, as under torch's AdamW: not checked there)
            assert dtype == torch.float16 or torch.isfinite(a).all()
    for o in opts:
        o.flush()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert _bits_equal(a, b), "after flush"
    assert opts[1].stats()["stall_s"] >= 0
    for o in opts:
        o.close()


def test_config_and_stats() -> None:
    assert ZenFlowConfig().accumulate == "auto"
    with pytest.raises(ValueError, match="accumulate"):
        ZenFlowConfig(accumulate="gpu")
    model = Net()
    with ZenFlowAdamW(model.parameters(), min_offload_numel=MIN_OFFLOAD, warmup_steps=0) as opt:
        loss_fn(model, 0).backward()
        opt.step()
        st = opt.stats()
        # "auto" on CPU tensors: the device path, unchanged.
        assert st["accumulate"] == "device" and "CPU tensors" in st["accumulate_reason"]
        assert opt.config.to_dict()["accumulate"] == "auto"


def test_adder_failure_surfaces_at_next_step(monkeypatch) -> None:
    import zenflow_triton.host_sums as zsums

    model = Net()
    opt = ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=4, min_offload_numel=MIN_OFFLOAD,
                       accumulate="host", warmup_steps=0)

    def broken(items, ready, num_threads):
        raise OSError("disk on fire")

    monkeypatch.setattr(zsums, "run_add_job", broken)
    loss_fn(model, 0).backward()
    opt.step()
    opt._pipeline._sums.last.exception(timeout=10)  # let the failing add finish
    with pytest.raises(RuntimeError, match="adder") as info:
        opt.step()
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(RuntimeError, match="stopped"):
        opt.step()
    opt.close()


def test_close_stops_the_adder_and_state_dict_waits_for_it() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=4, min_offload_numel=MIN_OFFLOAD,
                       accumulate="host", warmup_steps=0)
    p = model.fc1.weight
    want = None
    for i in range(2):
        opt.zero_grad()
        loss_fn(model, i).backward()
        want = p.grad.clone() if want is None else want + p.grad
        opt.step()
    saved = opt.state_dict()["state"][1]  # fc1.weight: the second parameter
    unsel = opt._pipeline.records[p].masks.unselected.bool()
    assert saved["acc_count"] == 2
    assert torch.equal(saved["acc"].view(48, 32)[:, unsel], want.view(48, 32)[:, unsel])
    adder = opt._pipeline._sums.adder
    opt.close()
    assert not adder.alive and opt._pipeline._sums is None


def _run(total: int, at: int | None, before: str, after: str, overlap: bool):
    """Train ``total`` steps with accumulate=``before``; with ``at``, checkpoint after step ``at`` (torch.save) and
    finish on a fresh model and optimizer with accumulate=``after``, loaded from it."""
    import io

    def make(model, mode):
        return ZenFlowAdamW(model.parameters(), lr=2e-2, topk_ratio=0.2, update_interval=3, select_interval=6,
                            warmup_steps=2, overlap=overlap, min_offload_numel=MIN_OFFLOAD, accumulate=mode)

    model = Net()
    opt = make(model, before)
    for i in range(total):
        if i == at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            opt.close()
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=True)
            model = Net()
            model.load_state_dict(ckpt["model"])
            opt = make(model, after)
            opt.load_state_dict(ckpt["opt"])
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    sd = opt.state_dict()
    assert opt.stats()["accumulate"] == (after if at is not None else before)
    opt.close()
    return params, sd


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("before,after", [("host", "host"), ("device", "host"), ("host", "device")])
def test_resume_in_and_across_modes_is_bitwise(before: str, after: str, overlap: bool) -> None:
    """The checkpoint format does not depend on the mode: right after a window end (after step 5: tau = 3, the job
    in flight with overlap) and mid-window (7: two steps into the next one), the run continues bit for bit in either
    mode, and the final state matches."""
    total = 14
    straight, straight_sd = _run(total, None, "device", "device", overlap)
    for at in (5, 7):
        resumed, resumed_sd = _run(total, at, before, after, overlap)
        for a, b in zip(straight, resumed):
            assert torch.equal(a, b), f"checkpoint after step {at}: parameters differ"
        for sid, st in straight_sd["state"].items():
            for key, value in st.items():
                other = resumed_sd["state"][sid][key]
                if key == "acc" and st.get("acc_count", 1) == 0:
                    continue  # an empty window's sum holds stale values that nothing reads
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, other), f"checkpoint after step {at}: state {key} differs"
                else:
                    assert value == other, f"checkpoint after step {at}: state {key} differs"


def test_deepcopy_and_pickle_keep_the_mode_mid_window() -> None:
    """A copy (deepcopy or pickle, of the model and the optimizer together, so the copy steps the copied
    parameters) keeps accumulate="host" and its open window's host sum, and trains on bit for bit."""
    import copy
    import pickle

    model = Net()
    opt = ZenFlowAdamW(model.parameters(), lr=2e-2, topk_ratio=0.25, update_interval=4,
                       min_offload_numel=MIN_OFFLOAD, accumulate="host", warmup_steps=0)
    for i in range(6):  # two steps into the second window
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
    copies = [copy.deepcopy({"model": model, "opt": opt}), pickle.loads(pickle.dumps({"model": model, "opt": opt}))]
    runs = [(model, opt)] + [(c["model"], c["opt"]) for c in copies]
    for i in range(6, 10):
        for m, o in runs:
            o.zero_grad()
            loss_fn(m, i).backward()
            o.step()
        for m, o in runs[1:]:
            assert o.config.accumulate == "host" and o.stats()["accumulate"] == "host"
            for a, b in zip(model.parameters(), m.parameters()):
                assert torch.equal(a, b), f"step {i + 1}"
    for _, o in runs[1:]:
        o.close()
    opt.close()


@pytest.mark.slow
def test_a_slow_adder_is_waited_for_as_stall_and_changes_nothing(monkeypatch) -> None:
    """step() waits only for a landing slot whose add (two steps ago) still reads it, and counts the wait as stall;
    the results stay bit for bit those of accumulate="device"."""
    import time

    import zenflow_triton.host_sums as zsums

    models, opts = _pair(torch.float32, "numba", True)
    steps = 7  # two warm-up steps (one-step windows read the gradient in place: no add), then five adds
    want = []
    for i in range(steps):
        opts[0].zero_grad()
        loss_fn(models[0], i).backward()
        opts[0].step()
        want.append([p.detach().clone() for p in models[0].parameters()])
    real = zsums.run_add_job
    delay = 0.6  # several times a step of this model (~0.1 s here)

    def slow(items, ready, num_threads):
        time.sleep(delay)
        return real(items, ready, num_threads)

    monkeypatch.setattr(zsums, "run_add_job", slow)
    for i in range(steps):
        opts[1].zero_grad()
        loss_fn(models[1], i).backward()
        opts[1].step()
        for a, b in zip(want[i], models[1].parameters()):
            assert torch.equal(a, b), f"step {i + 1}"
    # The third and later adds each find their slot's add of two steps before still running: step() waits for
    # most of each delay (a quarter of it is plenty of margin for a slow step).
    stall = opts[1].stats()["stall_s"]
    assert stall >= 0.25 * delay * (steps - 2 - 2), stall
    for o in opts:
        o.close()


def test_a_checkpoint_carries_its_placement_and_auto_takes_it_at_a_load_before_the_first_step() -> None:
    """A load before the first step cannot see the step's peak (no forward has run), so accumulate="auto" would find
    the device roomier than the run that saved the checkpoint did at its first step: on CUDA it takes the saved
    placement. A given mode, grads_in_backward and CPU tensors (where "auto" is always "device") keep their own."""
    from types import SimpleNamespace

    from zenflow_triton.auto import place_sums

    model = Net()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.2, update_interval=2,
                       min_offload_numel=MIN_OFFLOAD, accumulate="host", warmup_steps=0)
    assert opt.state_dict()["zenflow"]["accumulate"] is None  # not placed before the first step
    opt.zero_grad()
    loss_fn(model, 0).backward()
    opt.step()
    sd = opt.state_dict()
    opt.close()
    assert sd["zenflow"]["accumulate"] == "host" and all(g["zenflow"]["accumulate"] == "host"
                                                           for g in sd["param_groups"])
    cuda = [SimpleNamespace(device=torch.device("cuda", 0))]  # place_sums reads nothing else before it decides
    auto = ZenFlowConfig(accumulate="auto")
    assert place_sums(cuda, auto, "host")[0] == "host" and place_sums(cuda, auto, "device")[0] == "device"
    assert "checkpoint" in place_sums(cuda, auto, "host")[1]
    assert place_sums(cuda, ZenFlowConfig(accumulate="device"), "host")[0] == "device"
    assert place_sums(cuda, ZenFlowConfig(accumulate="auto", grads_in_backward=True), "device")[0] == "host"
    fresh = ZenFlowAdamW(Net().parameters(), lr=1e-2, topk_ratio=0.2, update_interval=2,
                         min_offload_numel=MIN_OFFLOAD,
                         warmup_steps=0)  # "auto" on CPU tensors: "device", whatever was saved
    fresh.load_state_dict(sd)
    assert fresh.stats()["accumulate"] == "device"
    fresh.close()


@pytest.mark.gpu
def test_cuda_auto_resumes_in_the_checkpoints_placement() -> None:
    """On CUDA, "auto" loaded before its first step takes the checkpoint's "host" (a roomy GPU would place "device")."""
    torch.manual_seed(0)
    model = Net().cuda()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.2, update_interval=2,
                       min_offload_numel=MIN_OFFLOAD, accumulate="host", warmup_steps=0)
    opt.zero_grad()
    loss_fn(model, 0).backward()
    opt.step()
    sd = opt.state_dict()
    opt.close()
    fresh = ZenFlowAdamW(Net().cuda().parameters(), lr=1e-2, topk_ratio=0.2, update_interval=2,
                         min_offload_numel=MIN_OFFLOAD, accumulate="auto", warmup_steps=0)
    fresh.load_state_dict(sd)
    stats = fresh.stats()
    assert stats["accumulate"] == "host" and "checkpoint" in stats["accumulate_reason"]
    fresh.close()
