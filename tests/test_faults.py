"""Faults that must leave no damage (issue 20): a host job finishing after its timeout, close() after a hung job,
running out of memory while state is built or loaded, parameter storage replaced, an unusable resident gradient,
and an optimizer built over meta parameters. Each case: a clear error (or a working retry), nothing changed that
the error does not report, and close() always returns."""

from __future__ import annotations

import copy
import logging
import threading
import time

import pytest
import torch
from test_optimizer import MIN_OFFLOAD, Net, loss_fn, train_steps
from torch import nn

import zenflow_triton.checkpoint as zckpt
import zenflow_triton.optimizer as zopt
import zenflow_triton.pipeline as zpipe
from zenflow_triton import ZenFlowAdamW

KNOBS = dict(lr=2e-2, topk_ratio=0.2, update_interval=2, select_interval=4, min_offload_numel=MIN_OFFLOAD,
             warmup_steps=0, overlap_steps=None)


@pytest.fixture(autouse=True)
def _host_kernels_loaded():
    """Load the numba host kernels first, so that no short worker_timeout below is spent on their loading."""
    zpipe.compile_host_kernels()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same_tensors(a, b) -> bool:
    """Whether two nested structures of tensors and plain values are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same_tensors, a, b))
    return a == b


# ------------------------------------------------------------------------------------------- timeouts (1, 2)


def _timeout_then_restore(wait_s: float) -> tuple[nn.Module, ZenFlowAdamW, dict]:
    """A first step whose host job overruns worker_timeout=0.3 s, on CPU fp32 tensors without overlap (every
    offloaded parameter is its own host master); the model restored as a user would after any failed step; then
    ``wait_s`` seconds for the late work to finish."""
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **{**KNOBS, "update_interval": 1, "select_interval": 4},
                       overlap=False, worker_timeout=0.3)
    saved = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="worker_timeout"):
        train_steps(model, opt, range(1))
    assert any(rec.master_is_param for rec in opt._pipeline.records.values()), "the test would prove nothing"
    model.load_state_dict(saved)
    time.sleep(wait_s)
    return model, opt, saved


@pytest.mark.slow
def test_a_job_finishing_after_its_timeout_writes_nothing_into_the_parameters(monkeypatch) -> None:
    """The job starts after its timeout: it writes nothing (it checks before each item)."""
    original = zpipe.run_host_job

    def late(*args):
        time.sleep(1.0)
        return original(*args)

    monkeypatch.setattr(zpipe, "run_host_job", late)
    model, opt, saved = _timeout_then_restore(1.5)
    assert _same_tensors(model.state_dict(), saved), "a job cancelled by its timeout wrote into the parameters"
    opt.close()


@pytest.mark.slow
def test_an_item_being_written_at_the_timeout_writes_nothing_into_the_parameters(monkeypatch) -> None:
    """The job is inside an item's kernel when its timeout passes, and finishes that item later: its writes land in
    the storage the parameter had (its own master), which the parameter no longer uses, not in the restored model."""
    import zenflow_triton.kernels.cpu_adamw as cpu_adamw

    original = cpu_adamw.host_adamw_
    inside = threading.Event()

    def slow(master, *args, **kwargs):
        if master.numel() > 256:  # an item of the window, not the kernels' warm-up on tiny arrays
            inside.set()
            time.sleep(1.0)
        return original(master, *args, **kwargs)

    monkeypatch.setattr(cpu_adamw, "host_adamw_", slow)
    monkeypatch.setattr(zpipe, "_host_kernels_requested", True)  # loaded by the fixture: no warm-up job first
    model, opt, saved = _timeout_then_restore(2.5)
    assert inside.is_set()
    assert _same_tensors(model.state_dict(), saved), "an item written past the timeout reached the parameters"
    opt.close()


def _hang_host_jobs(monkeypatch) -> threading.Event:
    """Every host job hangs until the returned event is set (30 s at most)."""
    release = threading.Event()

    def hang(*args):
        release.wait(30)
        return 0.0

    monkeypatch.setattr(zpipe, "run_host_job", hang)
    return release


def test_close_after_a_hung_job_returns_within_the_timeout_and_says_so(monkeypatch, caplog) -> None:
    release = _hang_host_jobs(monkeypatch)
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS, worker_timeout=0.5)
    train_steps(model, opt, range(2))  # overlap: the window's job is in flight, hung
    worker = opt._pipeline.worker
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        opt.close()
    assert time.perf_counter() - start < 0.5 + 1.5
    assert "hung" in caplog.text and "worker_timeout" in caplog.text
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    opt.close()  # a second close is a no-op
    release.set()
    worker._thread.join(5)
    assert not worker.alive


def test_close_after_a_step_timed_out_returns_at_once(monkeypatch) -> None:
    release = _hang_host_jobs(monkeypatch)
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS, overlap=False, worker_timeout=0.5)
    with pytest.raises(RuntimeError, match="worker_timeout"):
        train_steps(model, opt, range(2))
    start = time.perf_counter()
    opt.close()
    assert time.perf_counter() - start < 1.5
    release.set()


# ---------------------------------------------------------------------------------- out of memory (3, 4)


def _oom_on_call(n: int, original, partial=None):
    """A wrapper of ``original`` that raises torch.OutOfMemoryError at its ``n``-th call (after ``partial``)."""
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            if partial is not None:
                partial(*args)
            raise torch.OutOfMemoryError("injected: out of memory")
        return original(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("where", ["offloaded", "resident"])
def test_out_of_memory_while_state_is_built_changes_nothing_and_a_retry_works(monkeypatch, where: str) -> None:
    reference = Net()
    ref_opt = ZenFlowAdamW(reference.parameters(), **KNOBS)
    train_steps(reference, ref_opt, range(5))
    ref_opt.flush()

    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS)
    before = _params(model)
    if where == "offloaded":
        # The second parameter's device state fails half-built.
        partial = lambda p, st, rec: st.update(score=torch.zeros(rec.cols))  # noqa: E731
        monkeypatch.setattr(zpipe, "init_offloaded", _oom_on_call(2, zpipe.init_offloaded, partial))
    else:
        monkeypatch.setattr(zopt, "init_resident", _oom_on_call(2, zopt.init_resident))
    opt.zero_grad()
    loss_fn(model, 0).backward()
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    assert not opt.state and not opt._pipeline.records and not opt._pipeline.slabs
    assert opt.stats()["steps"] == 0 and opt.state_dict()["zenflow"]["step"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    monkeypatch.undo()  # memory was freed: the retry succeeds and trains as if nothing had happened
    opt.step()
    train_steps(model, opt, range(1, 5))
    opt.flush()
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    opt.close()
    ref_opt.close()


def test_out_of_memory_at_the_first_step_still_closes(monkeypatch) -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS)
    monkeypatch.setattr(zpipe, "init_offloaded", _oom_on_call(1, zpipe.init_offloaded))
    opt.zero_grad()
    loss_fn(model, 0).backward()
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    worker = opt._pipeline.worker
    opt.close()
    worker._thread.join(5)
    assert not worker.alive


@pytest.mark.parametrize("where", ["offloaded", "resident", "slab"])
@pytest.mark.parametrize("overlap", [True, False])
def test_out_of_memory_inside_load_state_dict_changes_nothing(monkeypatch, where: str, overlap: bool) -> None:
    source = Net()
    src_opt = ZenFlowAdamW(source.parameters(), **KNOBS, overlap=overlap)
    train_steps(source, src_opt, range(5))  # mid-window
    sd = copy.deepcopy(src_opt.state_dict())
    model_sd = copy.deepcopy(source.state_dict())

    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS, overlap=overlap)
    train_steps(model, opt, range(20, 23))  # its own, different state
    before_sd = copy.deepcopy(opt.state_dict())
    before_params = _params(model)
    before_groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    if where == "offloaded":
        monkeypatch.setattr(zpipe, "load_offloaded", _oom_on_call(2, zpipe.load_offloaded))
    elif where == "resident":
        monkeypatch.setattr(zckpt, "load_resident", _oom_on_call(2, zckpt.load_resident))
    else:
        monkeypatch.setattr(zpipe, "allocate", _oom_on_call(1, zpipe.allocate))
    sd["param_groups"][0]["lr"] = 1e-3  # the load would change the groups too
    with pytest.raises(torch.OutOfMemoryError):
        opt.load_state_dict(sd)
    monkeypatch.undo()
    assert _same_tensors(opt.state_dict(), before_sd)
    assert all(torch.equal(a, b) for a, b in zip(before_params, model.parameters()))
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before_groups
    # After freeing memory the load works and training continues as the source's.
    sd["param_groups"][0]["lr"] = KNOBS["lr"]
    model.load_state_dict(model_sd)
    opt.load_state_dict(sd)
    train_steps(model, opt, range(5, 9))
    train_steps(source, src_opt, range(5, 9))
    opt.flush()
    src_opt.flush()
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), model.parameters()))
    opt.close()
    src_opt.close()


# ------------------------------------------------------------------------------- replaced storage (5)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("new_shape", [(32, 48), (50, 32), (40, 32), (50,)],
                         ids=["same-numel", "bigger", "smaller", "resident-bias"])
def test_replaced_parameter_storage_is_a_clear_error_at_the_step_and_close_works(new_shape, overlap: bool) -> None:
    model = Net()
    opt = ZenFlowAdamW(model.named_parameters(), **KNOBS, overlap=overlap)
    train_steps(model, opt, range(3))
    name = "fc1.bias" if len(new_shape) == 1 else "fc1.weight"
    p = dict(model.named_parameters())[name]
    saved_shape = tuple(p.shape)
    steps = opt.stats()["steps"]
    p.data = torch.randn(new_shape)
    opt.zero_grad()
    for q in model.parameters():
        q.grad = torch.randn_like(q)
    with pytest.raises(RuntimeError, match=rf"'{name}'.*{list(saved_shape)}.*{list(new_shape)}".replace("[", r"\[")
                       .replace("]", r"\]")):
        opt.step()
    assert opt.stats()["steps"] == steps
    with pytest.raises(RuntimeError, match=name):
        opt.state_dict()
    worker = opt._pipeline.worker
    opt.close()
    opt.close()
    worker._thread.join(5)
    assert not worker.alive


# ------------------------------------------------------------------------ resident gradients (6)


def test_an_unusable_resident_gradient_is_refused_before_anything_changes() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.named_parameters(), **KNOBS)
    train_steps(model, opt, range(3))
    before_sd = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    loss_fn(model, 3).backward()
    before = _params(model)
    model.fc1.bias.grad_dtype = None  # torch refuses a gradient of another dtype unless told otherwise
    model.fc1.bias.grad = model.fc1.bias.grad.double()
    with pytest.raises(RuntimeError, match=r"'fc1.bias'.*float64.*float32"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert _same_tensors(opt.state_dict(), before_sd)
    model.fc1.bias.grad = model.fc1.bias.grad.float()
    opt.step()  # usable afterwards
    opt.close()


def test_unnamed_parameters_are_named_by_group_and_index() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS)
    opt.zero_grad()
    loss_fn(model, 0).backward()
    model.norm.weight.grad_dtype = None
    model.norm.weight.grad = model.norm.weight.grad.double()
    with pytest.raises(RuntimeError, match=r"parameter 3 of param group 0 \(shape \(48,\)\)"):
        opt.step()
    opt.close()


# ------------------------------------------------------------------------------------- meta device (8)


@pytest.fixture
def swap_params_on_conversion():
    """module.to_empty keeps the parameters (swapping their contents) instead of making new ones."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(previous)


def test_meta_construction_follows_the_parameters_to_their_device(swap_params_on_conversion) -> None:
    torch.manual_seed(7)
    extra_init = torch.randn(24, 40) * 0.1
    reference = Net()
    with torch.device("meta"):
        model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS, backend="numba")  # a CPU backend, checked at the first step
    params = list(model.parameters())
    model.to_empty(device="cpu")
    assert all(a is b for a, b in zip(params, model.parameters()))
    model.load_state_dict(reference.state_dict())
    extra, ref_extra = nn.Parameter(extra_init.clone()), nn.Parameter(extra_init.clone())
    opt.add_param_group({"params": [extra], "lr": 1e-2})
    ref_opt = ZenFlowAdamW(reference.parameters(), **KNOBS, backend="numba")
    ref_opt.add_param_group({"params": [ref_extra], "lr": 1e-2})
    for m, o, e in ((model, opt, extra), (reference, ref_opt, ref_extra)):
        for i in range(6):
            o.zero_grad()
            (loss_fn(m, i) + e.pow(2).sum() * 1e-3 * (i + 1)).backward()
            o.step()
        o.flush()
    for a, b in zip([*reference.parameters(), ref_extra], [*model.parameters(), extra]):
        assert torch.equal(a, b)
    opt.close()
    ref_opt.close()


def test_an_optimizer_left_with_meta_parameters_says_what_happened() -> None:
    with torch.device("meta"):
        model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS)
    model.to_empty(device="cpu")  # new parameters: the optimizer still holds the meta ones
    with pytest.raises(ValueError, match="set_swap_module_params_on_conversion"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    loss_fn(model, 0).backward()
    with pytest.raises(RuntimeError, match="meta device.*build it after materializing"):
        opt.step()
    opt.close()
