"""load_state_dict is all-or-nothing and refuses what it cannot use; state movers (Lightning moves every tensor of
``optimizer.state`` after loading a checkpoint) change nothing."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from test_optimizer import MIN_OFFLOAD, Net, train_steps

import zenflow_triton.pipeline as zpipe
from zenflow_triton import ZenFlowAdamW

KNOBS = dict(lr=2e-2, topk_ratio=0.2, update_interval=3, select_interval=6, min_offload_numel=MIN_OFFLOAD)


def _snapshot(model: Net, opt: ZenFlowAdamW) -> tuple[list[torch.Tensor], dict]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _assert_same(a: tuple[list[torch.Tensor], dict], b: tuple[list[torch.Tensor], dict]) -> None:
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert a[1]["zenflow"] == b[1]["zenflow"]
    assert [{k: v for k, v in g.items()} for g in a[1]["param_groups"]] == b[1]["param_groups"]
    for sid, st in a[1]["state"].items():
        for key, value in st.items():
            other = b[1]["state"][sid][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


def _bad_state_dicts(good: dict) -> list[tuple[str, dict]]:
    """Ways a checkpoint can be unusable, each with the words its error must contain."""
    out = []
    sgd_model = Net()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    train_steps(sgd_model, sgd, range(2))
    out.append(("saved neither by a ZenFlowAdamW", sgd.state_dict()))
    other = Net()
    other_opt = ZenFlowAdamW(other.parameters(), **{**KNOBS, "min_offload_numel": 10**6})
    train_steps(other, other_opt, range(2))
    out.append(("min_offload_numel", other_opt.state_dict()))
    other_opt.close()
    last = max(good["state"])  # the last parameter's state is bad: the earlier ones must not have been loaded
    first_offloaded = min(sid for sid, st in good["state"].items() if "selected" in st)
    shape = copy.deepcopy(good)
    shape["state"][first_offloaded]["exp_avg"] = torch.zeros(3, 3)
    out.append(("exp_avg' has shape", shape))
    missing = copy.deepcopy(good)
    del missing["state"][first_offloaded]["col_step"]
    out.append(("lacks ['col_step']", missing))
    resident = copy.deepcopy(good)
    resident["state"][last]["exp_avg"] = torch.zeros(2)
    out.append(("exp_avg' has shape", resident))
    dtype = copy.deepcopy(good)
    dtype["state"][first_offloaded]["selected"] = dtype["state"][first_offloaded]["selected"].float()
    out.append(("expected a bool dtype", dtype))
    fmt = copy.deepcopy(good)
    fmt["zenflow"]["format"] = 99
    out.append(("checkpoint format 99", fmt))
    hyper = copy.deepcopy(good)
    hyper["param_groups"][0]["lr"] = -1.0
    out.append(("Invalid lr", hyper))
    amsgrad = copy.deepcopy(good)
    amsgrad["param_groups"][0]["amsgrad"] = True
    out.append(("amsgrad", amsgrad))
    knobs = copy.deepcopy(good)
    knobs["zenflow"]["topk_ratio"] = 7.0
    out.append(("topk_ratio", knobs))
    groups = copy.deepcopy(good)
    groups["param_groups"][0]["params"] = groups["param_groups"][0]["params"][:-1]
    out.append(("parameters", groups))
    return out


@pytest.mark.parametrize("overlap", [True, False])
def test_failed_load_changes_nothing_and_training_goes_on(overlap: bool) -> None:
    """overlap=False makes fp32 parameters their own host master: a partial load used to write into the model."""
    donor = Net()
    donor_opt = ZenFlowAdamW(donor.parameters(), overlap=overlap, **KNOBS)
    train_steps(donor, donor_opt, range(5))
    good = copy.deepcopy(donor_opt.state_dict())
    donor_opt.close()
    # Different values than the optimizer under test, so that a partial load would show.
    for st in good["state"].values():
        for key, value in st.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                st[key] = value + 0.5
    for group in good["param_groups"]:
        group.pop("zenflow")  # the top-level entry is read first; keep one copy to corrupt

    reference = Net()
    ref_opt = ZenFlowAdamW(reference.parameters(), overlap=overlap, **KNOBS)
    train_steps(reference, ref_opt, range(7))

    model = Net()
    opt = ZenFlowAdamW(model.parameters(), overlap=overlap, **KNOBS)
    train_steps(model, opt, range(4))
    for words, bad in _bad_state_dicts(good):
        before = _snapshot(model, opt)
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            opt.load_state_dict(bad)
        _assert_same(before, _snapshot(model, opt))
    train_steps(model, opt, range(4, 7))
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()
    ref_opt.close()


def test_moments_saved_in_another_float_dtype_are_converted() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **KNOBS)
    train_steps(model, opt, range(4))
    sd = copy.deepcopy(opt.state_dict())
    wide = copy.deepcopy(sd)
    for st in wide["state"].values():
        for key in ("exp_avg", "exp_avg_sq", "master"):
            if key in st:
                st[key] = st[key].double()
    runs = []
    for saved in (sd, wide):
        m = Net()
        o = ZenFlowAdamW(m.parameters(), **KNOBS)
        m.load_state_dict(model.state_dict())
        o.load_state_dict(saved)
        for st in o.state.values():
            assert st["exp_avg"].dtype == torch.float32
            assert st.get("host_exp_avg", st["exp_avg"]).dtype == torch.float32
        train_steps(m, o, range(4, 8))
        runs.append([p.detach().clone() for p in m.parameters()])
        o.close()
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    opt.close()


def _move_state(opt: ZenFlowAdamW) -> None:
    """What Lightning's optimizer-state mover does: every tensor in ``optimizer.state`` replaced by a copy."""
    for st in opt.state.values():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                st[key] = value.clone()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.slow
def test_state_mover_changes_nothing(overlap: bool, monkeypatch) -> None:
    """A mover while a host job is still writing the slab (its copies are stale by the time the job ends), and
    again right after loading a checkpoint: training continues bit for bit."""
    original = zpipe.run_host_job

    def slow(*args):
        time.sleep(0.3)
        return original(*args)

    monkeypatch.setattr(zpipe, "run_host_job", slow)
    straight = Net()
    straight_opt = ZenFlowAdamW(straight.parameters(), overlap=overlap, **KNOBS)
    train_steps(straight, straight_opt, range(12))
    straight_opt.close()  # applies the last window's host result

    model = Net()
    opt = ZenFlowAdamW(model.parameters(), overlap=overlap, **KNOBS)
    train_steps(model, opt, range(3))  # a window end: with overlap its host job is still running
    _move_state(opt)
    train_steps(model, opt, range(3, 7))
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    opt.close()

    resumed = Net()
    resumed.load_state_dict(ckpt["model"])
    opt = ZenFlowAdamW(resumed.parameters(), overlap=overlap, **KNOBS)
    opt.load_state_dict(ckpt["opt"])
    _move_state(opt)  # after loading a checkpoint, as Lightning does
    train_steps(resumed, opt, range(7, 12))
    opt.close()
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
