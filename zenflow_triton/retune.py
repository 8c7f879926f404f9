"""Changing the knobs of a running optimizer (DESIGN §4): what a checkpoint's knobs change when it loads, and
:meth:`ZenFlowAdamW.set_knobs`, which changes them afterwards.

A checkpoint's knobs win over the constructor's, as a torch state_dict's group values win over the constructor's
(the run continues as it was saved, bit for bit); the load says in one line which knobs it changed. ``set_knobs``
is the way to run a resumed run with other knobs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from .auto import Knobs, announce
from .config import DEFAULT_SELECT_WINDOWS, ZenFlowConfig

__all__ = ["SCHEDULE_KNOBS", "describe_changes", "load_knobs", "retuned", "set_knobs"]

logger = logging.getLogger("zenflow_triton")

# The knobs a checkpoint carries that shape the run (cpu_threads stays this machine's: it changes no result).
SCHEDULE_KNOBS = ("topk_ratio", "update_interval", "select_interval", "host_lr_scale", "overlap_steps")

# set_knobs' "not given" (None is a value of overlap_steps: merge at the next window end).
KEEP: Any = type("Keep", (), {"__repr__": lambda self: "KEEP"})()


def describe_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """``"topk_ratio 0.5 -> 0.1, update_interval 8 -> 4"`` for the knobs of :data:`SCHEDULE_KNOBS` that differ
    ("" if none)."""
    return ", ".join(f"{k} {_fmt(k, before.get(k))} -> {_fmt(k, after.get(k))}" for k in SCHEDULE_KNOBS
                     if before.get(k) != after.get(k))


def _fmt(name: str, v: Any) -> str:
    if v is None:  # a knob still waiting for "auto"; overlap_steps' None is its default, update_interval
        return "None" if name == "overlap_steps" else "auto"
    return f"{v:g}" if isinstance(v, float) else str(v)


def retuned(resolved: ZenFlowConfig, *, topk_ratio: float | None = None, update_interval: int | None = None,
            select_interval: int | None = None, host_lr_scale: float | None = None,
            overlap_steps: int | None = KEEP) -> ZenFlowConfig:
    """``resolved`` (concrete knobs) with the given ones changed, validated as the constructor validates them.
    Without ``select_interval``, S follows a new U where it was the default (8 windows), and otherwise stays, if it
    is a multiple of the new U. ``overlap_steps=None`` sets it back to U (its default); not given, it stays."""
    u_old, s_old = resolved.update_interval, resolved.select_interval
    u = u_old if update_interval is None else update_interval
    if select_interval is not None:
        s = select_interval
    elif s_old == DEFAULT_SELECT_WINDOWS * u_old and isinstance(u, int) and not isinstance(u, bool):
        s = DEFAULT_SELECT_WINDOWS * u
    else:
        s = s_old
    changes: dict[str, Any] = {"update_interval": u, "select_interval": s}
    if topk_ratio is not None:
        changes["topk_ratio"] = float(topk_ratio) if _real(topk_ratio) else topk_ratio
    if host_lr_scale is not None:
        changes["host_lr_scale"] = float(host_lr_scale) if _real(host_lr_scale) else host_lr_scale
    if overlap_steps is not KEEP:
        changes["overlap_steps"] = overlap_steps
    for name, value in changes.items():
        if value == "auto":
            raise ValueError(f"Invalid {name}: 'auto' (set_knobs takes concrete values)")
    return resolved.replace(**changes)  # ZenFlowConfig's checks: "Invalid update_interval: 0 ..."


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) or type(x).__module__ == "numpy"


def load_knobs(knobs: Knobs, saved: Mapping[str, Any]) -> None:
    """A checkpoint's knobs into ``knobs``: they win (as a torch state_dict's group values do), and one line says
    which ones they changed."""
    before = knobs.state_dict()
    knobs.load_state_dict(saved)
    changed = describe_changes(before, knobs.state_dict())
    if changed:
        announce(f"load_state_dict: the checkpoint's knobs replace this optimizer's: {changed}; "
                 "opt.set_knobs(...) after the load changes them", logger)


def set_knobs(knobs: Knobs, flush: Callable[[], None], *, topk_ratio: float | None = None,
              update_interval: int | None = None, select_interval: int | None = None,
              host_lr_scale: float | None = None, overlap_steps: int | None = KEEP) -> None:
    """:meth:`ZenFlowAdamW.set_knobs`: validate the new knobs (nothing changes when that raises), ``flush()`` when
    the windows restart, then change them and log one line. ``host_lr_scale`` applies from the next window end;
    ``overlap_steps`` from the next merge (a result already merged stays merged, one pending is merged at the new
    K or at the next window end)."""
    if not knobs.ready:
        raise RuntimeError("set_knobs: the 'auto' knobs are not chosen yet (they are at the first step after "
                           "warm-up); call it after that, or build the optimizer with fixed knobs")
    resolved = knobs.resolved
    new = retuned(resolved, topk_ratio=topk_ratio, update_interval=update_interval, select_interval=select_interval,
                  host_lr_scale=host_lr_scale, overlap_steps=overlap_steps)
    before = knobs.state_dict()
    if (new.update_interval, new.select_interval) != (resolved.update_interval, resolved.select_interval):
        flush()  # the windows restart: none may hold gradients of the old schedule (DESIGN §3 step 2)
    knobs.resolved = new
    changed = describe_changes(before, knobs.state_dict())
    if changed:
        logger.info("zenflow_triton: set_knobs: %s", changed)
