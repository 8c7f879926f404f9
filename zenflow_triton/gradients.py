"""Gradients before the update (DESIGN §3): clipping inside the optimizer (``max_grad_norm``).

``max_grad_norm`` clips with ``torch.nn.utils.clip_grad_norm_``'s formula over all the optimizer's parameters that
have a gradient (offloaded and resident alike, each counted once), at ``step()`` before anything reads a gradient:
the step is then exactly ``clip_grad_norm_(params, max_norm)`` followed by ``step()``. It lets a training loop (or a
framework) hand clipping to the optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["GradientClipper"]


class GradientClipper:
    """Clips the gradients of an optimizer's param groups at each ``step()`` (``max_norm`` None: never), and
    remembers the last total norm (before clipping) for ``stats()``. A shared object, never rebound, so optimizer
    wrappers see one clipper."""

    def __init__(self, max_norm: float | None) -> None:
        self.max_norm = max_norm
        self._last_norm: torch.Tensor | None = None

    def clip_(self, param_groups: Iterable[Mapping[str, Any]], capture: Any = None) -> None:
        """Scale every gradient in place by ``min(1, max_norm / (total_norm + 1e-6))``, torch's formula and
        implementation (``clip_grad_norm_``), over each parameter with a gradient, once (torch allows a parameter
        listed twice; its gradient must be counted and scaled once, as ``clip_grad_norm_(model.parameters())``
        does). ``capture`` (grads_in_backward, :class:`.capture.GradientCapture`): a captured parameter counts with
        its whole gradient, the host landing slot (the norm waits for its copies), and is scaled there and in its
        compact device part, with ``clip_grad_norm_``'s formula and coefficient."""
        if self.max_norm is None:
            return
        seen: dict[int, torch.Tensor] = {}
        for group in param_groups:
            for p in group["params"]:
                if p.grad is not None or (capture is not None and capture.has(p)):
                    seen.setdefault(id(p), p)
        if not seen:
            return
        params = list(seen.values())
        if capture is None or not any(capture.has(p) for p in params):
            self._last_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
            return
        # clip_grad_norm_ is get_total_norm then clip_grads_with_norm_; the latter reads .grad, so its two lines
        # are repeated here over the captured parts.
        total = torch.nn.utils.get_total_norm([capture.whole_gradient(p) if capture.has(p) else p.grad
                                               for p in params], 2.0)
        coef = torch.clamp(float(self.max_norm) / (total + 1e-6), max=1.0)
        for p in params:
            if capture.has(p):
                capture.scale_(p, coef)
            else:
                p.grad.mul_(coef.to(p.grad.device))
        self._last_norm = total

    def report(self) -> dict[str, Any]:
        """``stats()`` entries: the knob, and the total gradient norm of the last clipped step (one device sync);
        both None without clipping (the keys are always there, as docs/telemetry.md's table lists them)."""
        norm = self._last_norm if self.max_norm is not None else None
        return {"max_grad_norm": self.max_norm, "last_grad_norm": None if norm is None else float(norm)}
