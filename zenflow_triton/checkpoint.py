"""The checkpoint format (DESIGN §4): what ``state_dict()`` holds for each parameter, and the conversions from the
formats ``load_state_dict()`` also accepts (this library's first format, and ``torch.optim.AdamW``'s).

Format 2 depends on nothing but the parameters: an offloaded parameter's entry holds full-size tensors of the
parameter's shape (``master``, ``exp_avg``, ``exp_avg_sq``, ``acc``, with the selected columns' device state
scattered in) and per-column vectors of length C (``col_step``, ``score``, ``selected``), whatever ``topk_ratio``
is and whether a selection was made yet. So a checkpoint loads with another ``topk_ratio``, and tools that check
shapes against the parameters (torch.distributed.checkpoint) accept it. A resident parameter's entry is
``torch.optim.AdamW``'s (``step``, ``exp_avg``, ``exp_avg_sq``).

The live layout (slab views, compact device state) is :mod:`.state`'s; this module only converts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from . import retune
from .columns import matrix_shape
from .params import check_group
from .sharding import is_sharded, to_local_rows, to_saved
from .state import OffloadedParam, load_resident

__all__ = [
    "FORMAT",
    "pack",
    "plan_load",
    "schedule_step",
    "to_adamw_state_dict",
    "OFFLOADED_KEYS",
    "check_offloaded",
    "check_resident",
    "from_adamw",
    "is_adamw_entry",
    "localize",
    "save_offloaded",
    "save_resident",
    "to_adamw",
    "upgrade_v1",
]

FORMAT = 2
OFFLOADED_KEYS = ("step", "master", "exp_avg", "exp_avg_sq", "col_step", "score", "selected", "acc", "acc_count",
                  "pending")
_V1_KEYS = ("host_master", "host_exp_avg", "host_exp_avg_sq", "host_col_step", "score", "slot", "col_step", "master",
            "exp_avg", "exp_avg_sq", "acc", "step", "acc_count", "pending")
_ADAMW_KEYS = {"step", "exp_avg", "exp_avg_sq"}


# ---------------------------------------------------------------------------------------------------- saving


def save_offloaded(p: torch.Tensor, st: Mapping[str, Any], rec: OffloadedParam) -> dict[str, Any]:
    """An offloaded parameter's live state as a format-2 entry: new CPU tensors (host work must be quiescent). For a
    sharded (FSDP2) parameter they are DTensors with its placement (this rank's rows; vectors replicated: they are
    the same on every rank)."""
    selected = rec.masks.host_slot >= 0
    cols = torch.nonzero(selected).squeeze(1)
    shape = (rec.rows, *p.shape[1:])  # this rank's rows (all of them when not sharded)
    sharded = is_sharded(p)

    def rows(t: torch.Tensor) -> torch.Tensor:
        t = t.view(shape)
        return to_saved(t, p, per_column=False) if sharded else t

    def vector(t: torch.Tensor) -> torch.Tensor:
        return to_saved(t, p, per_column=True) if sharded else t

    def full(host: torch.Tensor, compact: torch.Tensor) -> torch.Tensor:
        out = host.to(torch.float32, copy=True)  # bf16 moments (state_dtype) are saved as fp32, as AdamW keeps them
        if cols.numel():
            out[:, cols] = compact.cpu()  # the compact state is in column order: slot = rank among the selected
        return rows(out)

    col_step = st["host_col_step"].clone()
    col_step[cols] = st["col_step"].cpu()[cols]
    return {
        "step": st["step"],
        "master": full(st["host_master"], st["master"]),
        "exp_avg": full(st["host_exp_avg"], st["exp_avg"]),
        "exp_avg_sq": full(st["host_exp_avg_sq"], st["exp_avg_sq"]),
        "col_step": vector(col_step),
        "score": vector(st["score"].cpu().clone()),
        "selected": vector(selected.clone()),
        "acc": rows(st["acc"].cpu().clone()),
        "acc_count": st["acc_count"],
        "pending": st["pending"],
    }


def localize(p: torch.Tensor, entry: Mapping[str, Any]) -> dict[str, Any]:
    """A checked format-2 entry as :func:`.state.load_offloaded` takes it: plain tensors of this rank's rows (a
    sharded parameter's entry may hold DTensors of any placement, or whole tensors)."""
    out = dict(entry)
    for key in ("master", "exp_avg", "exp_avg_sq", "acc"):
        out[key] = to_local_rows(entry[key], p, per_column=False)
    for key in ("col_step", "score", "selected"):
        out[key] = to_local_rows(entry[key], p, per_column=True)
    return out


def save_resident(st: Mapping[str, Any]) -> dict[str, Any]:
    """A resident parameter's state, as torch.optim.AdamW returns it (references to the live tensors)."""
    return dict(st)


# ---------------------------------------------------------------------------------------------------- checking


def _check_tensor(where: str, key: str, value: Any, shape: tuple[int, ...], kind: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}: saved state '{key}' is a {type(value).__name__}, expected a tensor of shape "
                         f"{shape}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{where}: saved state '{key}' has shape {tuple(value.shape)}, expected {shape}")
    ok = {"float": value.is_floating_point(), "bool": value.dtype == torch.bool,
          "int": not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)}[kind]
    if not ok:
        what = {"float": "a floating-point", "bool": "a bool", "int": "an integer"}[kind]
        raise ValueError(f"{where}: saved state '{key}' has dtype {value.dtype}, expected {what} dtype")


def _check_count(where: str, key: str, value: Any) -> None:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: saved state '{key}' is {value!r}, expected an int >= 0")


def _require(where: str, saved: Any, keys: tuple[str, ...] | set[str]) -> None:
    if not isinstance(saved, Mapping):
        raise ValueError(f"{where}: saved state is a {type(saved).__name__}, expected a dict")
    missing = [k for k in keys if k not in saved]
    if missing:
        raise ValueError(f"{where}: saved state lacks {missing} (saved by another optimizer or version?)")


def check_offloaded(p: torch.Tensor, saved: Any, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``saved`` is a format-2 offloaded entry for ``p``. Floating-point
    entries in another float dtype are accepted (converted to fp32 on load, as torch converts)."""
    _require(where, saved, OFFLOADED_KEYS)
    cols = matrix_shape(p)[1]
    shape = tuple(p.shape)
    for key in ("master", "exp_avg", "exp_avg_sq", "acc"):
        _check_tensor(where, key, saved[key], shape, "float")
    _check_tensor(where, "col_step", saved["col_step"], (cols,), "int")
    _check_tensor(where, "score", saved["score"], (cols,), "float")
    _check_tensor(where, "selected", saved["selected"], (cols,), "bool")
    _check_count(where, "step", saved["step"])
    _check_count(where, "acc_count", saved["acc_count"])
    if not isinstance(saved["pending"], bool):
        raise ValueError(f"{where}: saved state 'pending' is {saved['pending']!r}, expected a bool")


def check_resident(p: torch.Tensor, saved: Any, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``saved`` is AdamW state for ``p`` (``step`` an int or a
    one-element tensor, as torch.optim.AdamW saves it)."""
    _require(where, saved, ("step", "exp_avg", "exp_avg_sq"))
    for key in ("exp_avg", "exp_avg_sq"):
        _check_tensor(where, key, saved[key], tuple(p.shape), "float")
    step = saved["step"]
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"{where}: saved state 'step' has shape {tuple(step.shape)}, expected one element")
        step = step.item()
        if float(step) != int(step):
            raise ValueError(f"{where}: saved state 'step' is {step!r}, expected a whole number")
        step = int(step)
    _check_count(where, "step", step)


# ---------------------------------------------------------------------------------------------------- conversions


def upgrade_v1(p: torch.Tensor, saved: Any, where: str) -> dict[str, Any]:
    """A format-1 offloaded entry (the live layout: host arrays, the slot map and the compact selected state) as a
    format-2 entry; ``ValueError`` naming ``where`` if it is not one for ``p``."""
    _require(where, saved, _V1_KEYS)
    rows, cols = matrix_shape(p)
    for key in ("host_master", "host_exp_avg", "host_exp_avg_sq", "acc"):
        _check_tensor(where, key, saved[key], (rows, cols), "float")
    for key in ("host_col_step", "slot", "col_step"):
        _check_tensor(where, key, saved[key], (cols,), "int")
    _check_tensor(where, "score", saved["score"], (cols,), "float")
    slot = saved["slot"].detach().cpu().long()
    selected = slot >= 0
    k = int(selected.sum())
    if not torch.equal(slot[selected], torch.arange(k)) or bool((slot < -1).any()):
        raise ValueError(f"{where}: saved state 'slot' is not a selection (-1, or the selected columns' ranks 0..k-1 "
                         "in column order)")
    for key in ("master", "exp_avg", "exp_avg_sq"):
        _check_tensor(where, key, saved[key], (rows, k), "float")
    idx = torch.nonzero(selected).squeeze(1)

    def full(host: str, compact: str) -> torch.Tensor:
        out = saved[host].detach().cpu().float().clone()
        out[:, idx] = saved[compact].detach().cpu().float()
        return out.view(p.shape)

    col_step = saved["host_col_step"].detach().cpu().to(torch.int32).clone()
    col_step[idx] = saved["col_step"].detach().cpu().to(torch.int32)[idx]
    return {
        "step": saved["step"], "master": full("host_master", "master"), "exp_avg": full("host_exp_avg", "exp_avg"),
        "exp_avg_sq": full("host_exp_avg_sq", "exp_avg_sq"), "col_step": col_step,
        "score": saved["score"].detach().cpu(), "selected": selected,
        "acc": saved["acc"].detach().cpu().view(p.shape), "acc_count": saved["acc_count"],
        "pending": saved["pending"],
    }


def is_adamw_entry(saved: Any) -> bool:
    """Whether a state entry is torch.optim.AdamW's (or Adam's) rather than this library's."""
    return isinstance(saved, Mapping) and set(saved) == _ADAMW_KEYS


def from_adamw(p: torch.Tensor, saved: Mapping[str, Any], *, offloaded: bool) -> dict[str, Any]:
    """A torch.optim.AdamW entry (checked by :func:`check_resident`) as this library's: the parameter's value is the
    master; every column starts from AdamW's step count; nothing is selected and no window is open."""
    step = saved["step"]
    step = int(step.item()) if isinstance(step, torch.Tensor) else int(step)
    if not offloaded:
        return {"step": step, "exp_avg": saved["exp_avg"], "exp_avg_sq": saved["exp_avg_sq"]}
    cols = matrix_shape(p)[1]
    return {
        "step": step,
        "master": p.detach().cpu().float().clone(),
        "exp_avg": saved["exp_avg"].detach().cpu().float(),
        "exp_avg_sq": saved["exp_avg_sq"].detach().cpu().float(),
        "col_step": torch.full((cols,), step, dtype=torch.int32),
        "score": torch.zeros(cols, dtype=torch.float32),
        "selected": torch.zeros(cols, dtype=torch.bool),
        "acc": torch.zeros(tuple(p.shape), dtype=torch.float32),
        "acc_count": 0,
        "pending": False,
    }


def to_adamw(p: torch.Tensor, saved: Mapping[str, Any]) -> dict[str, Any]:
    """This library's entry for ``p`` (format 2, or resident) as torch.optim.AdamW's, on ``p``'s device and dtype
    (as AdamW keeps its moments). AdamW has one step count per parameter: it gets the parameter's own (the steps in
    which it had a gradient), which is every selected column's count; a column the host updated had one update
    per window, so its moments are bias-corrected as if older than they are (negligible once beta2**step is)."""
    step = int(saved["step"].item()) if isinstance(saved["step"], torch.Tensor) else int(saved["step"])
    return {
        "step": torch.tensor(float(step)),
        "exp_avg": saved["exp_avg"].to(device=p.device, dtype=p.dtype).view(p.shape).clone(),
        "exp_avg_sq": saved["exp_avg_sq"].to(device=p.device, dtype=p.dtype).view(p.shape).clone(),
    }


# ---------------------------------------------------------------------------------------------------- whole state_dicts

Plan = list[tuple[Any, Any, bool | None]]  # (parameter, entry, offloaded); a hook's key: (key, value, None)


def _index(param_groups: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """torch's numbering of the parameters in a state_dict: order of first appearance across the groups."""
    index: dict[int, int] = {}
    for group in param_groups:
        for p in group["params"]:
            index.setdefault(id(p), len(index))
    return index


def pack(param_groups: Sequence[Mapping[str, Any]], state: Mapping[torch.Tensor, Mapping[str, Any]],
         records: Mapping[torch.Tensor, OffloadedParam], zenflow: Mapping[str, Any]) -> dict[str, Any]:
    """A state_dict as torch.optim packs one (parameters numbered by first appearance), entries in format 2, and
    ``zenflow`` (knobs, schedule step) with the format number at the top and in every group."""
    index = _index(param_groups)
    zenflow = {**zenflow, "format": FORMAT}
    groups = []
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [index[id(p)] for p in group["params"]]
        packed["zenflow"] = dict(zenflow)
        groups.append(packed)
    # A key that is no parameter (a state_dict pre-hook's ``optimizer.state["test"] = 1``) is kept as it is, as
    # torch.optim packs it.
    entries = {(index[id(p)] if isinstance(p, torch.Tensor) else p):
               (st if not isinstance(p, torch.Tensor) else
                save_offloaded(p, st, records[p]) if p in records else save_resident(st))
               for p, st in state.items()}
    return {"state": entries, "param_groups": groups, "zenflow": zenflow}


def plan_load(state_dict: Any, *, param_groups: Sequence[Mapping[str, Any]],
              check_group: Callable[[Mapping[str, Any], str], Any], offloads: Callable[[torch.Tensor], bool],
              min_offload_numel: int, knobs: Any) -> tuple[Mapping[str, Any] | None, Plan]:
    """Validate ``state_dict`` against an optimizer (its groups, its group check, its offload decision, its
    :class:`~zenflow_triton.auto.Knobs`) without changing anything. Returns its "zenflow" entry (None for
    torch.optim.AdamW's) and, per state entry, (parameter, entry in format 2 or AdamW's, offloaded), where a key
    that is no parameter's id keeps its entry as it is, with ``offloaded`` None."""
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("not an optimizer state_dict (it needs 'state' and 'param_groups')")
    saved_groups = state_dict["param_groups"]
    if len(param_groups) != len(saved_groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, optimizer has "
                         f"{len(param_groups)}")
    zenflow = state_dict.get("zenflow")
    if zenflow is None and saved_groups and isinstance(saved_groups[0], Mapping):
        zenflow = saved_groups[0].get("zenflow")  # torch.distributed.checkpoint keeps the groups, not extra keys
    adamw = zenflow is None
    if adamw and not all(is_adamw_entry(st) for sid, st in state_dict["state"].items() if isinstance(sid, int)):
        raise ValueError("this state_dict was saved neither by a ZenFlowAdamW (it has no 'zenflow' entry) nor by "
                         "torch.optim.AdamW (its entries are not step/exp_avg/exp_avg_sq)")
    id_map, where_of = {}, {}
    for gi, (g, sg) in enumerate(zip(param_groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(f"loaded state dict's group {gi} has {len(sg['params'])} parameters, the optimizer's has "
                             f"{len(g['params'])}")
        check_group(sg, f"loaded state dict's group {gi}")
        for pi, (sid, p) in enumerate(zip(sg["params"], g["params"])):
            id_map[sid] = p
            where_of[sid] = f"parameter {pi} of group {gi} (shape {tuple(p.shape)})"
    fmt = None if adamw else zenflow.get("format", 1)
    if fmt not in (None, 1, FORMAT):
        raise ValueError(f"loaded state dict has checkpoint format {fmt!r}; this version reads formats 1 and {FORMAT}")
    plan: Plan = []
    for sid, saved in state_dict["state"].items():
        if not isinstance(sid, int) and sid not in id_map:
            # No parameter's id (a hook's key, ``optimizer.state["test"] = 1``): kept as it is, as torch keeps it.
            plan.append((sid, saved, None))
            continue
        if sid not in id_map:
            raise ValueError(f"loaded state dict has state for parameter id {sid!r}, which no group lists")
        p, where = id_map[sid], where_of[sid]
        offloaded = offloads(p)
        if adamw:
            check_resident(p, saved, where)
            plan.append((p, from_adamw(p, saved, offloaded=offloaded), offloaded))
            continue
        saved_offloaded = isinstance(saved, Mapping) and ("host_master" in saved or "selected" in saved)
        if offloaded != saved_offloaded:
            this = "offloads" if offloaded else "keeps resident"
            saved_as = "an offloaded" if saved_offloaded else "a resident"
            raise ValueError(f"{where}: this optimizer {this} it (min_offload_numel={min_offload_numel}) but the "
                             f"saved state is {saved_as} one: saved with another min_offload_numel?")
        if offloaded:
            entry = upgrade_v1(p, saved, where) if fmt == 1 else saved
            check_offloaded(p, entry, where)
        else:
            check_resident(p, saved, where)
            entry = saved
        plan.append((p, entry, offloaded))
    if zenflow is not None:
        copy.copy(knobs).load_state_dict(zenflow)  # raises on invalid knobs, changing nothing here
        step = zenflow.get("step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"loaded state dict's 'zenflow' step is {step!r}, expected an int >= 0")
    return zenflow, plan


def schedule_step(zenflow: Mapping[str, Any], plan: Plan) -> int:
    """The schedule's step count of a checkpoint; format 1 before it was recorded counted each parameter's own
    steps, so its offloaded parameters' largest count is the schedule's."""
    step = zenflow.get("step")
    if step is not None:
        return int(step)
    return max((int(saved["step"]) for _, saved, offloaded in plan if offloaded), default=0)


def to_adamw_state_dict(sd: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A state_dict of this library (format 2, after a flush) as torch.optim.AdamW's (see :func:`to_adamw`)."""
    index = _index(param_groups)
    by_index = {index[id(p)]: p for group in param_groups for p in group["params"]}
    groups: list[MutableMapping[str, Any]] = [{k: v for k, v in g.items() if k != "zenflow"}
                                              for g in sd["param_groups"]]
    return {"state": {i: to_adamw(by_index[i], entry) if i in by_index else entry for i, entry in sd["state"].items()},
            "param_groups": groups}


def split_plan(plan: Sequence[tuple[Any, Mapping[str, Any], bool | None]]) -> tuple[
        list[tuple[torch.Tensor, Mapping[str, Any]]], dict[Any, Any]]:
    """A :func:`plan_load` plan in two: the offloaded parameters' entries (local rows) for the pipeline to stage,
    and the new state of every resident parameter (loaded now) and of every key that is no parameter's (a hook's,
    kept as it is, as torch keeps it)."""
    offloaded, new_state = [], {}
    for p, saved, is_offloaded in plan:
        if is_offloaded is None:
            new_state[p] = saved
        elif is_offloaded:
            offloaded.append((p, localize(p, saved)))
        else:
            new_state[p] = load_resident(p, saved)
    return offloaded, new_state


def restore(opt: Any, state_dict: Mapping[str, Any]) -> None:
    """The body of ``ZenFlowAdamW.load_state_dict`` between its hooks, once host work is quiescent: check
    everything (:func:`plan_load`), allocate and fill all the new state (``opt``'s pipeline stages it), and only then
    change the optimizer: knobs, schedule, group values, state. On an error nothing has changed."""
    zenflow, plan = plan_load(
        state_dict, param_groups=opt.param_groups,
        check_group=lambda g, where: check_group({**opt.defaults, **g}, decoupled=opt._decoupled, where=where),
        offloads=opt._offloads, min_offload_numel=opt.config.min_offload_numel, knobs=opt._knobs,
    )
    # Everything new is allocated and filled first; the optimizer and the parameters change only once all of it
    # exists, so running out of host or device memory here leaves them as they were.
    offloaded, new_state = split_plan(plan)
    note_state_dtype(zenflow, opt.config.state_dtype, bool(offloaded))
    loaded = opt._pipeline.stage_load(offloaded, zenflow.get("accumulate") if zenflow is not None else None)
    group_values = [{k: copy.deepcopy(v) for k, v in sg.items() if k not in ("params", "zenflow")}
                    for sg in state_dict["param_groups"]]
    # Nothing below raises or allocates.
    if zenflow is not None:
        retune.load_knobs(opt._knobs, zenflow)
        opt._schedule.step = schedule_step(zenflow, plan)
    else:
        # torch.optim.AdamW's: the knobs stay this optimizer's and its schedule starts over (warm-up, then a
        # selection at the next step), while every column's bias correction continues from AdamW's count.
        opt._schedule.step = 0
    for g, values in zip(opt.param_groups, group_values):
        g.update(values)
    opt.state.clear()
    opt.state.update(new_state)
    opt._pipeline.commit_load(loaded, opt.state)


def pickled(opt: Any) -> dict[str, Any]:
    """What ``copy.deepcopy`` and pickle keep of an optimizer: the constructor's arguments and a ``state_dict()``.
    Hooks are not kept, as in torch, except grads_in_backward's own (the copy hooks its parameters); gradients
    captured since the last step are not copied."""
    return {"defaults": opt.defaults, "param_groups": opt.param_groups, "config": opt.config.to_dict(),
            "saved": opt.state_dict()}


def unpickle(opt: Any, state: Mapping[str, Any]) -> None:
    """Rebuild ``opt`` (uninitialized, of the pickled class) from :func:`pickled`'s dict."""
    groups = [dict(g) for g in state["param_groups"]]
    type(opt).__init__(opt, groups, **{**state["defaults"], **state["config"]})
    opt.load_state_dict(state["saved"])


def note_state_dtype(zenflow: Mapping[str, Any] | None, state_dtype: str, offloaded: bool) -> None:
    """One INFO line when a checkpoint's host moments were kept in another dtype than this optimizer keeps them
    (``state_dtype``; an AdamW state dict's are fp32): the saved fp32 values are converted on load."""
    saved = (zenflow or {}).get("state_dtype") or "float32"
    if offloaded and saved != state_dtype:
        how = "rounded to nearest even" if state_dtype == "bfloat16" else "exactly"
        retune.logger.info("zenflow_triton: load_state_dict: the checkpoint's host moments were kept in %s, this "
                           "optimizer keeps them in %s: converted (%s)", saved, state_dtype, how)
