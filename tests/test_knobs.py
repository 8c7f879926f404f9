"""The knobs of a resumed run (issue 20 item 12): the checkpoint's win (torch's rule for what a state_dict holds),
the load logs each knob it changed, and ``set_knobs`` changes them afterwards, from the next window (the open one
ends, as at flush()) and, for topk_ratio, the next selection."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from test_optimizer import MIN_OFFLOAD, Net, train_steps

from zenflow_triton import ZenFlowAdamW

BASE = dict(lr=2e-2, min_offload_numel=MIN_OFFLOAD, warmup_steps=0)


def _knobs(opt) -> tuple:
    st = opt.stats()
    return st["topk_ratio"], st["update_interval"], st["select_interval"]


def test_the_checkpoints_knobs_win_and_the_load_logs_each_change(caplog) -> None:
    source = Net()
    src = ZenFlowAdamW(source.parameters(), **BASE, topk_ratio=0.1, update_interval=4)
    train_steps(source, src, range(6))
    sd, model_sd = copy.deepcopy(src.state_dict()), copy.deepcopy(source.state_dict())

    model = Net()
    model.load_state_dict(model_sd)
    opt = ZenFlowAdamW(model.parameters(), **BASE, topk_ratio=0.5, update_interval=8)
    with caplog.at_level(logging.DEBUG, logger="zenflow_triton"):
        opt.load_state_dict(sd)
    records = [r for r in caplog.records if r.name.startswith("zenflow_triton")]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    message = records[0].getMessage()
    for change in ("topk_ratio 0.5 -> 0.1", "update_interval 8 -> 4", "select_interval 64 -> 32"):
        assert change in message
    assert "set_knobs" in message  # says how to change them
    assert _knobs(opt) == (0.1, 4, 32)
    train_steps(model, opt, range(6, 14))
    train_steps(source, src, range(6, 14))
    opt.flush()
    src.flush()
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), model.parameters()))

    caplog.clear()
    again = ZenFlowAdamW(Net().parameters(), **BASE, topk_ratio=0.1, update_interval=4)
    with caplog.at_level(logging.DEBUG, logger="zenflow_triton"):
        again.load_state_dict(sd)
    assert not [r for r in caplog.records if r.name.startswith("zenflow_triton")]  # nothing changed, nothing said
    for o in (opt, src, again):
        o.close()


@pytest.mark.parametrize(("changes", "overlap"), [
    (dict(topk_ratio=0.5, update_interval=2), True), (dict(topk_ratio=0.5, update_interval=2), False),
    (dict(update_interval=3), True), (dict(topk_ratio=0.05), True), (dict(update_interval=2, select_interval=6), True),
], ids=["r-and-U", "r-and-U-sync", "U", "r", "U-and-S"])
def test_set_knobs_takes_effect_at_the_next_window_and_selection(changes, overlap: bool) -> None:
    """Oracle: the same steps, a flush() where set_knobs was called, a checkpoint whose knobs are edited to the new
    values (the checkpoint's knobs win), loaded into a fresh optimizer that trains on."""
    knobs = dict(**BASE, topk_ratio=0.1, update_interval=4, overlap=overlap)
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **knobs)
    train_steps(model, opt, range(6))  # mid-window (two steps of a four-step window open)
    opt.set_knobs(**changes)

    ref_model = Net()
    ref = ZenFlowAdamW(ref_model.parameters(), **knobs)
    train_steps(ref_model, ref, range(6))
    if "update_interval" in changes:
        ref.flush()  # set_knobs ends the open window when U changes
    sd = copy.deepcopy(ref.state_dict())
    u = changes.get("update_interval", 4)
    new = dict(topk_ratio=changes.get("topk_ratio", 0.1), update_interval=u,
               select_interval=changes.get("select_interval", 8 * u))
    for entry in (sd["zenflow"], *(g["zenflow"] for g in sd["param_groups"])):
        entry.update(new)
    model_sd = copy.deepcopy(ref_model.state_dict())
    ref.close()
    ref_model = Net()
    ref_model.load_state_dict(model_sd)
    ref = ZenFlowAdamW(ref_model.parameters(), **knobs)
    ref.load_state_dict(sd)

    assert _knobs(opt) == tuple(new.values())
    windows = opt.stats()["windows"]
    steps = range(6, 7 + new["select_interval"])  # schedule steps 7 .. S + 7: one selection at least
    train_steps(model, opt, steps)
    train_steps(ref_model, ref, steps)
    # The new U is the window length, the new r the selected fraction.
    assert opt.stats()["windows"] - windows == sum((i + 1) % u == 0 for i in steps)
    opt.flush()
    ref.flush()
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))
    cols = [32, 32, 48]
    expected = sum(math.ceil(new["topk_ratio"] * c) for c in cols) / sum(cols)
    assert opt.stats()["selected_fraction"] == pytest.approx(expected)
    assert opt.state_dict()["zenflow"]["update_interval"] == u  # and a checkpoint carries them
    opt.close()
    ref.close()


def test_set_knobs_refuses_bad_values_and_changes_nothing() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **BASE, topk_ratio=0.1, update_interval=4, select_interval=8)
    train_steps(model, opt, range(3))
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="Invalid update_interval"):
        opt.set_knobs(update_interval=0)
    with pytest.raises(ValueError, match="Invalid topk_ratio"):
        opt.set_knobs(topk_ratio=1.5)
    with pytest.raises(ValueError, match="Invalid select_interval: 8 is not a multiple of update_interval=3"):
        opt.set_knobs(update_interval=3)  # an explicit select_interval stays unless it is given too
    with pytest.raises(TypeError):
        opt.set_knobs(warmup_steps=3)  # only the knobs a window or a selection reads
    after = opt.state_dict()
    assert after["zenflow"] == before["zenflow"]
    assert all(torch.equal(a["acc"], b["acc"]) for a, b in zip(after["state"].values(), before["state"].values())
               if "acc" in a)
    opt.set_knobs(update_interval=2)  # 8 is a multiple of 2: S stays the user's 8
    assert _knobs(opt) == (0.1, 2, 8)
    opt.close()


def test_set_knobs_waits_for_auto_to_choose() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **BASE, topk_ratio="auto", update_interval=4)
    with pytest.raises(RuntimeError, match="auto"):
        opt.set_knobs(topk_ratio=0.2)
    opt.close()


def test_a_load_logs_host_lr_scale_and_overlap_steps(caplog) -> None:
    """Issue 30 item 5: every knob a load changes is named, the host step's scale and the merge delay included."""
    source = Net()
    src = ZenFlowAdamW(source.parameters(), **BASE, update_interval=4, host_lr_scale=0.5, overlap_steps=2)
    train_steps(source, src, range(6))
    opt = ZenFlowAdamW(Net().parameters(), **BASE, update_interval=4, overlap_steps=None)
    with caplog.at_level(logging.DEBUG, logger="zenflow_triton"):
        opt.load_state_dict(copy.deepcopy(src.state_dict()))
    records = [r for r in caplog.records if r.name.startswith("zenflow_triton")]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    message = records[0].getMessage()
    assert "host_lr_scale 1 -> 0.5" in message and "overlap_steps None -> 2" in message, message
    assert "topk_ratio" not in message and "update_interval" not in message  # only what changed
    assert (opt.stats()["host_lr_scale"], opt.stats()["overlap_steps"]) == (0.5, 2)
    src.close()
    opt.close()


@pytest.mark.parametrize("changes", [dict(host_lr_scale=0.5, overlap_steps=2), dict(overlap_steps=1),
                                     dict(host_lr_scale=2.0)], ids=["both", "K", "s"])
def test_set_knobs_host_lr_scale_and_overlap_steps_equal_a_checkpoint_that_carries_them(changes, caplog) -> None:
    """Oracle: a checkpoint saved at the same step with the new values written into it, loaded into a fresh
    optimizer; neither knob restarts the window, so no flush."""
    knobs = dict(**BASE, topk_ratio=0.25, update_interval=4, overlap_steps=None)
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **knobs)
    train_steps(model, opt, range(6))  # mid-window, the last window's result still pending
    sd = copy.deepcopy(opt.state_dict())
    model_sd = copy.deepcopy(model.state_dict())
    with caplog.at_level(logging.INFO, logger="zenflow_triton"):
        opt.set_knobs(**changes)
    message = " ".join(r.getMessage() for r in caplog.records if r.name.startswith("zenflow_triton"))
    for name, value in changes.items():
        assert f"{name} " in message and f"-> {value:g}" in message, message

    for entry in (sd["zenflow"], *(g["zenflow"] for g in sd["param_groups"])):
        entry.update(changes)
    ref_model = Net()
    ref_model.load_state_dict(model_sd)
    ref = ZenFlowAdamW(ref_model.parameters(), **knobs)
    ref.load_state_dict(sd)
    for o in (opt, ref):
        assert {k: o.stats()[k] for k in changes} == changes
    steps = range(6, 22)
    train_steps(model, opt, steps)
    train_steps(ref_model, ref, steps)
    opt.flush()
    ref.flush()
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))
    opt.set_knobs(host_lr_scale=1.0, overlap_steps=None)  # and back to the start
    assert (opt.stats()["host_lr_scale"], opt.stats()["overlap_steps"]) == (1.0, None)
    opt.close()
    ref.close()


def test_set_knobs_checks_host_lr_scale_and_overlap_steps_as_the_constructor_does() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), **BASE, update_interval=4)
    train_steps(model, opt, range(3))
    before = copy.deepcopy(opt.state_dict()["zenflow"])
    for bad, match in [(dict(host_lr_scale=0.0), "Invalid host_lr_scale"),
                       (dict(host_lr_scale=math.inf), "Invalid host_lr_scale"),
                       (dict(host_lr_scale=True), "Invalid host_lr_scale"),
                       (dict(host_lr_scale="auto"), "Invalid host_lr_scale: 'auto'"),
                       (dict(overlap_steps=5), "Invalid overlap_steps: 5 is more than update_interval=4"),
                       (dict(overlap_steps=0), "Invalid overlap_steps"),
                       (dict(overlap_steps="auto"), "Invalid overlap_steps: 'auto'"),
                       (dict(host_lr_scale=0.5, overlap_steps=9), "Invalid overlap_steps")]:
        with pytest.raises(ValueError, match=match):
            opt.set_knobs(**bad)
        assert opt.state_dict()["zenflow"] == before, bad  # nothing half-applied
    opt.close()
    sync = ZenFlowAdamW(Net().parameters(), **BASE, update_interval=4, overlap=False)
    with pytest.raises(ValueError, match="overlap=False"):
        sync.set_knobs(overlap_steps=2)
    sync.close()
