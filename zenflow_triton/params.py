"""What the optimizer accepts, checked where torch.optim would check it: parameters (add_param_group), their
gradients (step), and the per-group options of torch.optim.AdamW that change the math (refused by name)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .columns import is_offloaded
from .kernels import MODEL_DTYPES, AdamHyperparams
from .sharding import check_placement, local

__all__ = ["META_HINT", "check_betas_pair", "check_grad", "check_group", "check_new_group", "check_param",
           "check_unchanged", "describe", "gather_step", "hp_lookup", "hyperparams", "offloads", "warn_kept_resident"]

logger = logging.getLogger("zenflow_triton")

# torch.optim.AdamW's per-group options beyond the hyperparameters, with the one value each may take here. foreach
# and fused choose torch's implementation, not the math, so any value is accepted (and ignored) for them.
_REFUSED_OPTIONS = {
    "amsgrad": (False, "amsgrad=True is not supported (ZenFlow keeps no max of exp_avg_sq)"),
    "maximize": (False, "maximize=True is not supported; minimize the negated objective"),
    "capturable": (False, "capturable=True is not supported (the host half of a step cannot be graph-captured)"),
    "differentiable": (False, "differentiable=True is not supported"),
}


def _plain(x: Any) -> Any:
    """A numpy scalar (``np.float32(0.01)``, an element of a numpy array) as the Python number it holds, as
    torch.optim.AdamW computes with it; anything else as it is."""
    if type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0:
        return x.item()
    return x


def _beta(b: Any, i: int) -> Any:
    if isinstance(b, torch.Tensor):
        if b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
        return b.item()  # as a tensor lr: its value now (read once per group and step)
    return _plain(b)


def hyperparams(group: Mapping[str, Any], *, decoupled: bool) -> AdamHyperparams:
    """The group's :class:`AdamHyperparams`, reading what torch.optim.AdamW computes with: numpy scalars, ``betas``
    as a numpy array, 1-element tensor betas (and lr, :meth:`AdamHyperparams.from_group`). The group keeps them as
    given, as torch's does."""
    betas = group["betas"]
    if type(betas).__module__ == "numpy" and getattr(betas, "shape", None) == (2,):
        betas = tuple(betas)
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        betas = (_beta(betas[0], 0), _beta(betas[1], 1))
    plain = {"lr": _plain(group["lr"]), "betas": betas, "eps": _plain(group["eps"]),
             "weight_decay": _plain(group["weight_decay"])}
    return AdamHyperparams.from_group(plain, decoupled=decoupled)


def check_betas_pair(betas: Any) -> None:
    """torch.optim.AdamW's constructor check: both betas floats or both tensors (numpy float64 is a float)."""
    pair = tuple(betas) if isinstance(betas, (tuple, list)) or type(betas).__module__ == "numpy" else ()
    if len(pair) == 2 and not (all(isinstance(b, float) for b in pair) or all(isinstance(b, torch.Tensor)
                                                                             for b in pair)):
        raise ValueError("betas must be either both floats or both Tensors")


def check_group(group: Mapping[str, Any], *, decoupled: bool, where: str = "param group") -> AdamHyperparams:
    """The group's hyperparameters as a validated record; ``ValueError`` naming the option for an AdamW option that
    this optimizer does not implement (amsgrad, maximize, capturable, differentiable, the other weight decay)."""
    for name, (allowed, why) in _REFUSED_OPTIONS.items():
        value = group.get(name, allowed)
        if value is not None and value != allowed:
            raise ValueError(f"Invalid {name}: {value!r} in {where}: {why}")
    value = group.get("decoupled_weight_decay", decoupled)
    if value is not None and bool(value) != decoupled:
        other = "ZenFlowAdamW (AdamW's decoupled decay)" if value else "ZenFlowAdam (Adam's L2 decay)"
        raise ValueError(f"Invalid decoupled_weight_decay: {value!r} in {where}: this optimizer's weight decay is "
                         f"{'decoupled' if decoupled else 'L2'}; use {other}")
    return hyperparams(group, decoupled=decoupled)


def check_param(p: Any, i: int, device: torch.device | None) -> torch.device:
    """Check parameter ``i`` of a group being added; return the optimizer's device (``p``'s if none yet)."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"parameter {i} of the group is a {type(p).__name__}, not a torch.Tensor")
    if p.is_complex():
        raise ValueError(f"parameter {i} of shape {tuple(p.shape)} is complex ({p.dtype}); not supported")
    check_placement(p, f"parameter {i} of shape {tuple(p.shape)}")
    if device is not None and p.device != device and "meta" in (p.device.type, device.type):
        raise ValueError(f"parameter {i} of shape {tuple(p.shape)} is on {p.device} but earlier parameters are on "
                         f"{device}: {META_HINT}")
    if device is not None and p.device != device:
        raise ValueError(f"parameter {i} of shape {tuple(p.shape)} is on {p.device} but earlier parameters are on "
                         f"{device}; use one ZenFlowAdamW per device")
    return p.device


# What to do when the optimizer holds meta parameters at a step, or meets real ones beside them.
META_HINT = ("module.to_empty(device=...) and module.to(...) replace meta parameters by new tensors, so an optimizer "
             "built before holds the meta ones; build it after materializing the model, or call "
             "torch.__future__.set_swap_module_params_on_conversion(True) first, which keeps the parameters' identity")


def check_new_group(param_group: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]],
                    defaults: Mapping[str, Any], device: torch.device | None, *,
                    decoupled: bool) -> tuple[list[Any], torch.device | None]:
    """``add_param_group``'s checks, as torch makes them and ours (every parameter, the group's options): the
    group's parameters as a list, and the parameters' device."""
    params = param_group["params"]
    if isinstance(params, set):  # torch's error, before our checks iterate it
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                        "tensors in sets will change between runs. Please use a list instead.")
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    existing = [q for g in param_groups for q in g["params"]]
    if existing:
        # The parameters' device now: an optimizer built over meta parameters follows them to the device that
        # module.to_empty(device=...) gave them (how FSDP2 and init_empty_weights build large models).
        device = existing[0].device
    for i, p in enumerate(params):
        named = isinstance(p, tuple) and len(p) == 2  # named parameters: (name, tensor)
        device = check_param(p[1] if named else p, i, device)
    check_group({**defaults, **param_group}, decoupled=decoupled)
    return params, device


def check_grad(p: torch.Tensor, g: torch.Tensor, *, offloaded: bool) -> None:
    """``RuntimeError`` for a gradient the step cannot use (sparse, complex, mismatched; an offloaded parameter's
    must also be contiguous and of its dtype), naming the parameter's shape."""
    if g.is_sparse or g.layout != torch.strided:
        raise RuntimeError(f"ZenFlowAdamW does not support sparse gradients (parameter of shape {tuple(p.shape)} "
                           f"has a {g.layout} gradient)")
    if g.is_complex():
        raise RuntimeError(f"complex gradient for parameter of shape {tuple(p.shape)} is not supported")
    if g.shape != p.shape or g.device != p.device:
        raise RuntimeError(f"gradient of shape {tuple(g.shape)} on {g.device} does not match its parameter of shape "
                           f"{tuple(p.shape)} on {p.device}")
    # AdamW's moments have the parameter's dtype, so torch.optim.AdamW cannot use another dtype's gradient either
    # (it fails inside lerp_); checked here for every parameter, before anything steps.
    if g.dtype != p.dtype:
        raise RuntimeError(f"gradient dtype {g.dtype} differs from parameter dtype {p.dtype} "
                           f"(shape {tuple(p.shape)})")
    if offloaded and not local(g).is_contiguous():
        raise RuntimeError(f"gradient of parameter of shape {tuple(p.shape)} is not contiguous "
                           f"(strides {g.stride()})")


def describe(p: torch.Tensor, param_groups: Sequence[Mapping[str, Any]]) -> str:
    """How an error names ``p``: its name when the groups were given named parameters (``param_names``, as torch
    keeps them), else its place and shape."""
    for gi, group in enumerate(param_groups):
        for pi, q in enumerate(group["params"]):
            if q is p:
                names = group.get("param_names")
                if names and pi < len(names):
                    return f"parameter '{names[pi]}'"
                return f"parameter {pi} of param group {gi} (shape {tuple(p.shape)})"
    return f"parameter of shape {tuple(p.shape)}"


def check_unchanged(param_groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Mapping[str, Any]],
                    records: Mapping[torch.Tensor, Any]) -> None:
    """``RuntimeError`` naming the parameter when its storage was replaced (``p.data = ...``) by another shape or
    dtype since its state was made: the state no longer fits it (torch.optim.AdamW fails at its step too). Checked
    before a step changes anything."""
    for p, st in state.items():
        if not isinstance(p, torch.Tensor):
            continue  # a key a hook added (torch keeps such keys as they are)
        rec = records.get(p)
        if rec is not None:
            made, now = (rec.shape, rec.dtype), (tuple(local(p).shape), p.dtype)
        else:
            m = st.get("exp_avg")
            if not isinstance(m, torch.Tensor):
                continue
            made, now = (tuple(m.shape), m.dtype), (tuple(p.shape), p.dtype)
        if made != now:
            raise RuntimeError(
                f"{describe(p, param_groups)}: its optimizer state was made for shape {list(made[0])} ({made[1]}) but "
                f"the parameter is now {list(now[0])} ({now[1]}): its storage was replaced (p.data = ...?). The state "
                "does not fit it; restore the parameter's shape, or build a new optimizer for the new one")


def offloads(p: torch.Tensor, min_offload_numel: int) -> bool:
    """Whether a parameter stepping for the first time is offloaded: DESIGN §3's rule, for contiguous fp32, bf16 or
    fp16 parameters. Others stay resident (plain AdamW on their device, with a warning): the kernels update a
    parameter in place through a matrix view, in the model dtypes they are built for."""
    return _matrix(p, min_offload_numel) and local(p).is_contiguous() and p.dtype in MODEL_DTYPES


# The most shapes the kept-resident warning lists (a model converted to float64 would list every matrix).
_LISTED_SHAPES = 8


def warn_kept_resident(params: Sequence[torch.Tensor], min_offload_numel: int) -> None:
    """One warning for all the matrices among ``params`` (stepping for the first time) that the offload rule selects
    but that stay resident for their layout or dtype: how many, their shapes, and what to do."""
    kept = [p for p in params if _matrix(p, min_offload_numel) and not offloads(p, min_offload_numel)]
    if not kept:
        return

    def what(p: torch.Tensor) -> str:
        layout = "" if local(p).is_contiguous() else f" non-contiguous, strides {p.stride()}"
        return f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}{layout}"

    listed = "; ".join(what(p) for p in kept[:_LISTED_SHAPES])
    more = f"; and {len(kept) - _LISTED_SHAPES} more" if len(kept) > _LISTED_SHAPES else ""
    logger.warning("zenflow_triton: %d parameter matri%s stay%s resident (plain AdamW on the device, its state in "
                   "device memory): %s%s. Only contiguous float32, bfloat16 and float16 matrices are offloaded; to "
                   "offload them, convert the model (model.float()) or make those parameters contiguous before "
                   "building the optimizer", len(kept), "x" if len(kept) == 1 else "ces",
                   "s" if len(kept) == 1 else "", listed, more)


def _matrix(p: torch.Tensor, min_offload_numel: int) -> bool:
    return is_offloaded(p, min_offload_numel) and p.numel() > 0


def gather_step(
    param_groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Mapping[str, Any]], *, decoupled: bool,
    offloads: Callable[[torch.Tensor], bool], captured: Callable[[torch.Tensor], bool] = lambda p: False,
) -> tuple[list[tuple[AdamHyperparams, list[torch.Tensor]]], list[tuple[AdamHyperparams, torch.Tensor]],
           list[torch.Tensor], list[torch.Tensor], torch.device | None]:
    """What one ``step()`` works on, every group's hyperparameters and every gradient checked before anything
    changes (the error names the parameter): ``(resident, offloaded, fresh, fresh_resident, device)``, the resident
    parameters with a gradient per group, the offloaded ones with their group's record, those of each kind stepping
    for the first time (each once, though a group may list a parameter twice), and the parameters' device (None
    when no parameter has a gradient). A parameter whose gradient was ``captured`` in backward (grads_in_backward,
    checked there) has one, though its ``.grad`` is None."""
    resident: list[tuple[AdamHyperparams, list[torch.Tensor]]] = []
    offloaded: list[tuple[AdamHyperparams, torch.Tensor]] = []
    fresh: list[torch.Tensor] = []
    fresh_resident: list[torch.Tensor] = []
    seen: set[int] = set()  # ids of the fresh ones (a parameter may be listed twice)
    device = None
    for group in param_groups:
        hp = check_group(group, decoupled=decoupled)  # a group may have been edited since it was added
        resident.append((hp, []))
        for p in group["params"]:
            if p.is_meta:
                raise RuntimeError(f"{describe(p, param_groups)} is on the meta device: {META_HINT}")
            taken = captured(p)
            if p.grad is None and not taken:
                continue
            offloaded_here = offloads(p)
            try:
                if taken and p.grad is not None:
                    raise RuntimeError("has a .grad beside the gradient captured in backward (grads_in_backward): "
                                       "was .grad set by hand after backward()?")
                if not taken:
                    check_grad(p, p.grad, offloaded=offloaded_here)
            except RuntimeError as exc:
                raise RuntimeError(f"{describe(p, param_groups)}: {exc}") from None
            if device is None:
                device = p.device
            elif p.device != device:
                raise ValueError(f"{describe(p, param_groups)} is on {p.device} but other parameters are on "
                                 f"{device}; use one ZenFlowAdamW per device")
            new = (p not in state or not state[p]) and id(p) not in seen
            if new:
                seen.add(id(p))
            if offloaded_here:
                offloaded.append((hp, p))
                if new:
                    fresh.append(p)
            else:
                resident[-1][1].append(p)
                if new:
                    fresh_resident.append(p)
    return resident, offloaded, fresh, fresh_resident, device


def hp_lookup(param_groups: Sequence[Mapping[str, Any]], known: Mapping[torch.Tensor, tuple[AdamHyperparams, ...]],
              *, decoupled: bool) -> Callable[[torch.Tensor], AdamHyperparams]:
    """A parameter's hyperparameters now: from ``known`` (this step's, validated), else from its group (the groups
    indexed once, on the first parameter not in ``known``)."""
    groups: dict[torch.Tensor, Mapping[str, Any]] = {}

    def hp_of(p: torch.Tensor) -> AdamHyperparams:
        if p in known:
            return known[p][0]
        if not groups:
            groups.update({q: g for g in param_groups for q in g["params"]})
        return hyperparams(groups[p], decoupled=decoupled)

    return hp_of
