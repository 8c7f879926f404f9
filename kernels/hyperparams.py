"""The Adam(W) hyperparameters of one update, as one validated record that every launcher takes as ``hp``.

This is the single place they are checked: building an :class:`AdamHyperparams` raises ``ValueError`` with
``torch.optim.AdamW``-style messages, so a launcher handed a record knows its values are sane and only checks its
type (:func:`require_hyperparams`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AdamHyperparams", "require_hyperparams"]


def _finite_number(x: object) -> bool:
    """A Python int or float (not a Tensor, whose comparisons would sync a device) that is finite."""
    return not isinstance(x, torch.Tensor) and isinstance(x, (int, float)) and math.isfinite(x)


@dataclass(frozen=True, slots=True)
class AdamHyperparams:
    """Hyperparameters of one Adam(W) update, validated on construction.

    Values are stored as given, never converted: an int ``lr`` flows into the math as the int it is, as it would in
    ``torch.optim.AdamW``. Frozen and hashable; build a variant with ``dataclasses.replace``.
    """

    lr: float
    """Learning rate: a finite Python float (or int) >= 0; a Tensor is rejected."""
    beta1: float
    """Decay rate of the first moment (``exp_avg``), in [0, 1)."""
    beta2: float
    """Decay rate of the second moment (``exp_avg_sq``), in [0, 1)."""
    eps: float
    """Added to the bias-corrected ``sqrt(exp_avg_sq)`` in the denominator, finite and >= 0."""
    weight_decay: float
    """Weight decay coefficient, finite and >= 0 (0 disables decay)."""
    decoupled: bool = True
    """True: AdamW's decoupled decay (``p *= 1 - lr * weight_decay``); False: Adam's L2 term (``g += wd * p``)."""

    def __post_init__(self) -> None:
        lr = self.lr
        if isinstance(lr, torch.Tensor):
            raise ValueError("Invalid lr: a Tensor learning rate is not supported; pass a Python float")
        if not _finite_number(lr):
            raise ValueError(f"Invalid lr: {lr!r} (a finite Python float)")
        if lr < 0:
            raise ValueError(f"Invalid lr: {lr}")
        for i, b in enumerate((self.beta1, self.beta2)):
            if not _finite_number(b) or not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b!r}")
        if not _finite_number(self.eps) or self.eps < 0:
            raise ValueError(f"Invalid epsilon value: {self.eps!r}")
        if not _finite_number(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"Invalid weight_decay value: {self.weight_decay!r}")
        if not isinstance(self.decoupled, bool):
            raise ValueError(f"Invalid decoupled: {self.decoupled!r} (a bool)")

    @classmethod
    def from_group(cls, group: Mapping[str, Any], *, decoupled: bool) -> AdamHyperparams:
        """The record of a torch param group (``lr``, ``betas`` as a pair, ``eps``, ``weight_decay``); a 1-element
        tensor ``lr`` is read as its value."""
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Invalid betas: {betas!r} (a pair of floats)")
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            # A 0-dim tensor lr, as torch.optim.AdamW takes it (schedulers then update it in place): its value now.
            # On a CUDA tensor this reads it back once per group and step, as AdamW without capturable does.
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
            lr = lr.item()
        return cls(lr=lr, beta1=betas[0], beta2=betas[1], eps=group["eps"],
                   weight_decay=group["weight_decay"], decoupled=decoupled)


def require_hyperparams(hp: object) -> AdamHyperparams:
    """``hp`` itself if it is an :class:`AdamHyperparams` (hence valid), else ``TypeError``."""
    if not isinstance(hp, AdamHyperparams):
        raise TypeError(f"hp must be an AdamHyperparams, got {type(hp).__name__}")
    return hp
