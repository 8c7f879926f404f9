"""zenflow_triton: ZenFlow offloaded Adam(W) as a drop-in ``torch.optim`` optimizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import ZenFlowConfig

if TYPE_CHECKING:
    from .optimizer import ZenFlowAdam, ZenFlowAdamW

__all__ = ["ZenFlowAdam", "ZenFlowAdamW", "ZenFlowConfig"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The optimizer imports torch (8.5 s on the 2-core CI VM): loaded on first use, so what needs no torch
    # (`python -m zenflow_triton.autotune --help`, the config) answers without paying for it.
    if name in ("ZenFlowAdam", "ZenFlowAdamW"):
        from . import optimizer

        return getattr(optimizer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
