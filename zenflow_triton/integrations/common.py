"""What both framework callbacks share: finding the ZenFlow optimizers behind the frameworks' wrappers, and
flushing or closing them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..optimizer import ZenFlowAdamW

__all__ = ["close_all", "flush_all", "unwrap_optimizer", "zenflow_optimizers"]

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


def _closed(opt: ZenFlowAdamW) -> bool:
    # The optimizer has no public "closed" flag; the pipeline's is the one that flush() checks. A framework may
    # run evaluation after fit (trainer.validate / trainer.evaluate) with the optimizer a callback already closed.
    return opt._pipeline.closed
