"""Ctrl-C (KeyboardInterrupt) and SystemExit while step() or flush() waits for the host: they propagate as
themselves once the call has finished its work, the optimizer stays usable, and a checkpoint saved in the handler
resumes into the uninterrupted run, bit for bit. Only a real worker failure stops the optimizer."""

from __future__ import annotations

import _thread
import copy
import signal
import threading
import time

import pytest
import torch
from test_optimizer import MIN_OFFLOAD, Net, loss_fn

import zenflow_triton.worker as zworker
from zenflow_triton import ZenFlowAdamW

KNOBS = dict(lr=2e-2, topk_ratio=0.2, update_interval=2, select_interval=4, min_offload_numel=MIN_OFFLOAD,
             warmup_steps=0, overlap_steps=None)
STEPS = 10
INTERRUPT_AT = 3  # the 4th step() ends a window and waits for a host job
GATE_TIMEOUT_S = 60.0  # only a broken test waits this long


@pytest.fixture
def default_sigint():
    """The default SIGINT handler for the test, restored after: a shell starts a background job (``pytest > log &``)
    with SIGINT ignored, and then ``_thread.interrupt_main`` raises nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class Gate:
    """Holds the main thread inside ``HostWorker.wait`` (so inside step()'s or flush()'s wait for the host) until
    ``signals`` interrupts have reached it there, whatever the machine's load: the test's thread sends each one only
    once the main thread is in the wait (``waiting``), and the wait lets it through (raises it) only then. Armed by
    :meth:`interrupt` for the next call; the real wait follows, so the job's result is what an uninterrupted wait
    returns."""

    def __init__(self) -> None:
        self.pending = 0
        self.waiting = threading.Event()
        self.seen = 0

    def interrupt(self, times: int = 1, signum: int = signal.SIGINT) -> None:
        self.pending = times

        def fire() -> None:
            for _ in range(times):
                assert self.waiting.wait(GATE_TIMEOUT_S), "the main thread never waited for the host"
                self.waiting.clear()
                _thread.interrupt_main(signum)

        threading.Thread(target=fire, daemon=True).start()

    def hold(self) -> None:
        if self.pending == 0 or threading.current_thread() is not threading.main_thread():
            return
        self.pending -= 1
        self.waiting.set()
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while time.monotonic() < deadline:  # the interrupt is raised here, inside the optimizer's wait
            time.sleep(0.005)
        raise AssertionError("the interrupt never reached the main thread's wait")


@pytest.fixture
def gate(monkeypatch) -> Gate:
    g = Gate()
    original = zworker.HostWorker.wait

    def wait(self, future, timeout):
        g.hold()
        return original(self, future, timeout)

    monkeypatch.setattr(zworker.HostWorker, "wait", wait)
    return g


def _make(model: Net, overlap: bool) -> tuple[ZenFlowAdamW, torch.optim.lr_scheduler.LRScheduler]:
    opt = ZenFlowAdamW(model.parameters(), overlap=overlap, **KNOBS)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)


def _train(model: Net, opt: ZenFlowAdamW, sched, steps: range) -> None:
    for i in steps:
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
        sched.step()


def _straight(overlap: bool) -> list[torch.Tensor]:
    model = Net()
    opt, sched = _make(model, overlap)
    _train(model, opt, sched, range(STEPS))
    opt.flush()
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("overlap", [True, False])
def test_ctrl_c_in_step_propagates_and_a_checkpoint_from_the_handler_resumes_exactly(default_sigint, gate,
                                                                                     overlap: bool) -> None:
    straight = _straight(overlap)
    model = Net()
    opt, sched = _make(model, overlap)
    _train(model, opt, sched, range(INTERRUPT_AT))
    opt.zero_grad()
    loss_fn(model, INTERRUPT_AT).backward()
    gate.interrupt()
    returned = False
    with pytest.raises(KeyboardInterrupt):
        opt.step()
        returned = True  # the gate raises the interrupt inside step()'s wait, so this line never runs
    assert not returned, "step() swallowed the interrupt"
    # The handler: save a checkpoint (model first, as `{"model": ..., "opt": ...}` evaluates it).
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    sched.step()  # the loop's remaining work for this step, as after a completed step()
    ckpt["sched"] = copy.deepcopy(sched.state_dict())

    # The same optimizer goes on...
    _train(model, opt, sched, range(INTERRUPT_AT + 1, STEPS))
    opt.flush()
    for a, b in zip(straight, model.parameters()):
        assert torch.equal(a, b.detach()), "training on after the interrupt differs from the uninterrupted run"
    opt.close()

    # ...and so does a fresh process resumed from the handler's checkpoint.
    model = Net()
    model.load_state_dict(ckpt["model"])
    opt, sched = _make(model, overlap)
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    _train(model, opt, sched, range(INTERRUPT_AT + 1, STEPS))
    opt.flush()
    for a, b in zip(straight, model.parameters()):
        assert torch.equal(a, b.detach()), "the run resumed from the handler's checkpoint differs"
    opt.close()


def test_system_exit_in_flush_propagates_and_the_optimizer_goes_on(gate) -> None:
    def exit_handler(signum, frame):
        raise SystemExit(3)

    previous = signal.signal(signal.SIGTERM, exit_handler)
    try:
        straight = _straight(True)
        model = Net()
        opt, sched = _make(model, True)
        _train(model, opt, sched, range(INTERRUPT_AT))  # a host job is in flight
        gate.interrupt(signum=signal.SIGTERM)
        with pytest.raises(SystemExit):
            opt.flush()
        _train(model, opt, sched, range(INTERRUPT_AT, STEPS))
        opt.flush()
        # flush() ends the open window early, so the trajectory is that of a flush after INTERRUPT_AT steps.
        model2 = Net()
        opt2, sched2 = _make(model2, True)
        _train(model2, opt2, sched2, range(INTERRUPT_AT))
        opt2.flush()
        _train(model2, opt2, sched2, range(INTERRUPT_AT, STEPS))
        opt2.flush()
        for a, b in zip(model2.parameters(), model.parameters()):
            assert torch.equal(a, b)
        assert any(not torch.equal(a, b.detach()) for a, b in zip(straight, model.parameters()))
        opt.close()
        opt2.close()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_second_interrupt_propagates_at_once_and_the_optimizer_stays_usable(default_sigint, gate) -> None:
    # Both interrupts land in the wait (the gate holds the main thread there for each): the first is held, the
    # second propagates at once.
    model = Net()
    opt, sched = _make(model, True)
    _train(model, opt, sched, range(INTERRUPT_AT))
    opt.zero_grad()
    loss_fn(model, INTERRUPT_AT).backward()
    gate.interrupt(times=2)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert gate.pending == 0
    # Not necessarily the uninterrupted trajectory (the step was cut short), but nothing is refused or lost.
    opt.flush()
    sd = opt.state_dict()
    _train(model, opt, sched, range(INTERRUPT_AT + 1, STEPS))
    opt.flush()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sd["zenflow"]["step"] >= INTERRUPT_AT
    opt.close()
