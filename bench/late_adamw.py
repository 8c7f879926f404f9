"""``torch.optim.AdamW`` with its offloadable matrices one update late: what ``overlap=True``'s staleness costs alone.

With ``overlap=True`` a ZenFlow window's host update reaches the parameters one window late (DESIGN §3), so the
gradients of the next window are taken at parameters that lack the last update. :class:`LateAdamW` is that delay and
nothing else, in plain torch: AdamW runs on a master copy of every parameter, and the model's parameters that
ZenFlowAdamW would offload (``ndim >= 2`` and ``numel >= min_offload_numel``) are the master *before* the last update,
the others the master itself. Nothing is deferred, selected or accumulated, so on a task it is the quality floor of a
one-update-late schedule: ZenFlowAdamW with ``update_interval=1, overlap=True`` (every column a one-step host window,
one step late) trains like it, and with ``overlap=False`` like AdamW exactly (``bench/quality_fair.py``,
``bench/results/quality-fair-2026-12-02.md``). ``flush()`` puts the current master into every parameter (before an
evaluation, as ZenFlowAdamW's does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zenflow_triton.config import ZenFlowConfig
from zenflow_triton.params import offloads

__all__ = ["LateAdamW"]


class LateAdamW(torch.optim.AdamW):
    """AdamW on masters; the model's offloadable parameters hold the master of one update before.

    The masters are the optimizer's parameters (so schedulers, ``param_groups`` and ``state`` are AdamW's own); the
    model's parameters only lend their gradients. One param group (the lr and hyperparameters of ``AdamW``)."""

    def __init__(self, params: Iterable[torch.Tensor], *,
                 min_offload_numel: int = ZenFlowConfig.min_offload_numel, **adamw: Any) -> None:
        self.model_params = list(params)
        masters = [p.detach().clone() for p in self.model_params]
        super().__init__(masters, **adamw)
        self.late = [offloads(p, min_offload_numel) for p in self.model_params]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("LateAdamW.step takes no closure")
        masters = self.param_groups[0]["params"]
        for p, m in zip(self.model_params, masters):
            m.grad = p.grad
        before = [m.clone() if late else None for m, late in zip(masters, self.late)]
        super().step()
        for p, m, old in zip(self.model_params, masters, before):
            p.copy_(m if old is None else old)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def flush(self) -> None:
        """Every parameter gets its master: the last update is in the model."""
        for p, m in zip(self.model_params, self.param_groups[0]["params"]):
            p.copy_(m)
