"""What the optimizer accepts, checked where torch.optim would check it: parameters (add_param_group), their
gradients (step), and the per-group options of torch.optim.AdamW that change the math (refused by name)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from .columns import is_offloaded
from .kernels import MODEL_DTYPES, AdamHyperparams
from .sharding import check_placement, local

__all__ = ["check_grad", "check_group", "check_param", "offloads", "warn_if_kept_resident"]

logger = logging.getLogger("zenflow_triton")

# torch.optim.AdamW's per-group options beyond the hyperparameters, with the one value each may take here. foreach
# and fused choose torch's implementation, not the math, so any value is accepted (and ignored) for them.
_REFUSED_OPTIONS = {
    "amsgrad": (False, "amsgrad=True is not supported (ZenFlow keeps no max of exp_avg_sq)"),
    "maximize": (False, "maximize=True is not supported; minimize the negated objective"),
    "capturable": (False, "capturable=True is not supported (the host half of a step cannot be graph-captured)"),
    "differentiable": (False, "differentiable=True is not supported"),
}


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
    return AdamHyperparams.from_group(group, decoupled=decoupled)


def check_param(p: Any, i: int, device: torch.device | None) -> torch.device:
    """Check parameter ``i`` of a group being added; return the optimizer's device (``p``'s if none yet)."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"parameter {i} of the group is a {type(p).__name__}, not a torch.Tensor")
    if p.is_complex():
        raise ValueError(f"parameter {i} of shape {tuple(p.shape)} is complex ({p.dtype}); not supported")
    check_placement(p, f"parameter {i} of shape {tuple(p.shape)}")
    if device is not None and p.device != device:
        raise ValueError(f"parameter {i} of shape {tuple(p.shape)} is on {p.device} but earlier parameters are on "
                         f"{device}; use one ZenFlowAdamW per device")
    return p.device


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
    if offloaded:
        if not local(g).is_contiguous():
            raise RuntimeError(f"gradient of parameter of shape {tuple(p.shape)} is not contiguous "
                               f"(strides {g.stride()})")
        if g.dtype != p.dtype:
            raise RuntimeError(f"gradient dtype {g.dtype} differs from parameter dtype {p.dtype} "
                               f"(shape {tuple(p.shape)})")


def offloads(p: torch.Tensor, min_offload_numel: int) -> bool:
    """Whether a parameter stepping for the first time is offloaded: DESIGN §3's rule, for contiguous fp32, bf16 or
    fp16 parameters. Others stay resident (plain AdamW on their device, with a warning): the kernels update a
    parameter in place through a matrix view, in the model dtypes they are built for."""
    return _matrix(p, min_offload_numel) and local(p).is_contiguous() and p.dtype in MODEL_DTYPES


def warn_if_kept_resident(p: torch.Tensor, min_offload_numel: int) -> None:
    """Say so when a matrix that the offload rule selects stays resident for its layout or dtype."""
    if _matrix(p, min_offload_numel) and not offloads(p, min_offload_numel):
        logger.warning("zenflow_triton: a parameter of shape %s (%s, strides %s) stays resident (plain AdamW on its "
                       "device): only contiguous float32, bfloat16 and float16 parameters are offloaded",
                       tuple(p.shape), p.dtype, p.stride())


def _matrix(p: torch.Tensor, min_offload_numel: int) -> bool:
    return is_offloaded(p, min_offload_numel) and p.numel() > 0
