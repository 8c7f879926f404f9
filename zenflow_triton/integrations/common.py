"""What both framework callbacks share: finding the ZenFlow optimizers behind the frameworks' wrappers, flushing
or closing them, and handing the framework's gradient clipping to the optimizer when it captures gradients during
backward."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from ..optimizer import ZenFlowAdamW

__all__ = ["close_all", "flush_all", "take_over_clipping", "unwrap_optimizer", "zenflow_optimizers"]

logger = logging.getLogger("zenflow_triton")

# Wrappers nest a few levels at most (Lightning's LightningOptimizer, accelerate's AcceleratedOptimizer, DeepSpeed's);
# the bound only guards against a wrapper whose `.optimizer` leads back to itself.
_MAX_WRAPPERS = 8


def unwrap_optimizer(optimizer: Any) -> ZenFlowAdamW | None:
    """The :class:`~zenflow_triton.ZenFlowAdamW` (or ``ZenFlowAdam``) behind ``optimizer``, else None.

    Follows ``.optimizer`` the way the frameworks' wrappers expose what they wrap: Lightning's ``LightningOptimizer``
    (whose class also derives from ours, so ``isinstance`` alone would stop at the wrapper) and accelerate's
    ``AcceleratedOptimizer``, as the Hugging Face Trainer uses it.
    """
    for _ in range(_MAX_WRAPPERS):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, ZenFlowAdamW) else None


def zenflow_optimizers(optimizers: Any) -> list[ZenFlowAdamW]:
    """The ZenFlow optimizers among ``optimizers`` (one optimizer, a wrapper, or an iterable of them; None gives
    none), unwrapped, each once, skipping those already closed."""
    if optimizers is None:
        return []
    items: Iterable[Any] = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    found: dict[int, ZenFlowAdamW] = {}
    for item in items:
        opt = unwrap_optimizer(item)
        if opt is not None and not _closed(opt):
            found.setdefault(id(opt), opt)
    return list(found.values())


def flush_all(optimizers: Any) -> list[ZenFlowAdamW]:
    """``flush()`` every open ZenFlow optimizer among ``optimizers``; returns them."""
    opts = zenflow_optimizers(optimizers)
    for opt in opts:
        opt.flush()
    return opts


def close_all(optimizers: Any) -> None:
    """``close()`` every open ZenFlow optimizer among ``optimizers`` (which applies finished host work first)."""
    for opt in zenflow_optimizers(optimizers):
        opt.close()


def take_over_clipping(optimizers: Any, max_norm: float | None, *, framework: str, switch_off: str,
                       moved: set[int] | None = None) -> bool:
    """Whether the framework must stop clipping because a ZenFlow optimizer clips in its place.

    With ``grads_in_backward=True`` the offloaded parameters' ``.grad`` is None after backward (the optimizer
    consumed it), so a framework's ``clip_grad_norm_`` over the model would see, scale and count only the resident
    parameters. When the framework clips (``max_norm`` > 0) and such an optimizer has no ``max_grad_norm`` of its
    own, the framework's value moves into the optimizer (which clips over all its parameters with torch's formula)
    and this returns True: the caller switches the framework's clipping off (one INFO line says so). When the
    optimizer has its own ``max_grad_norm`` too, both would clip: a ValueError says to turn the framework's off
    (``switch_off``, e.g. ``"TrainingArguments(max_grad_norm=0)"``). Optimizers without in-backward capture
    change nothing: their ``.grad`` is ordinary and the framework clipping works as usual. ``moved`` (a callback's
    own set) records the ids of the optimizers this moved a value into, so a second run of the same optimizer
    (the callback restored the framework's setting in between) moves it again instead of seeing two clippers.
    """
    if max_norm is None or max_norm <= 0:
        return False
    opts = [opt for opt in zenflow_optimizers(optimizers) if getattr(opt.config, "grads_in_backward", False)]
    for opt in opts:
        own = _max_grad_norm(opt)
        if own is not None and (moved is None or id(opt) not in moved):
            raise ValueError(
                f"{framework} clips gradients (max norm {max_norm}) and the ZenFlow optimizer clips too "
                f"(max_grad_norm={own}); with grads_in_backward=True the offloaded gradients are gone before "
                f"{framework} clips, so its clipping would see only the resident parameters. Set {switch_off} "
                f"(the optimizer's max_grad_norm={own} clips every parameter), or leave max_grad_norm=None and "
                f"{framework}'s value moves into the optimizer.")
    for opt in opts:
        _set_max_grad_norm(opt, float(max_norm))
        if moved is not None:
            moved.add(id(opt))
    if opts:
        logger.info("zenflow_triton: %s's gradient clipping (max norm %s) moved into the ZenFlow optimizer "
                    "(max_grad_norm, over all its parameters: grads_in_backward=True consumes the offloaded "
                    "gradients during backward); %s's own clipping is off (%s)", framework, max_norm, framework,
                    switch_off)
    return bool(opts)


def _max_grad_norm(opt: ZenFlowAdamW) -> float | None:
    # The clipper's value is the one step() uses (opt.config holds the constructor's until _set_max_grad_norm).
    return opt._gradients.max_norm


def _set_max_grad_norm(opt: ZenFlowAdamW, max_norm: float) -> None:
    # The config is replaced (dataclasses.replace validates the value) so that copy.deepcopy and pickle, which
    # rebuild the optimizer from opt.config, keep clipping; the clipper is what step() reads.
    opt.config = dataclasses.replace(opt.config, max_grad_norm=max_norm)
    opt._gradients.max_norm = max_norm


def _closed(opt: ZenFlowAdamW) -> bool:
    # The optimizer has no public "closed" flag; the pipeline's is the one that flush() checks. A framework may
    # run evaluation after fit (trainer.validate / trainer.evaluate) with the optimizer a callback already closed.
    return opt._pipeline.closed
