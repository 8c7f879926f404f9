"""zenflow_triton: ZenFlow offloaded Adam(W) as a drop-in ``torch.optim`` optimizer."""

from .config import ZenFlowConfig

__all__ = ["ZenFlowConfig"]
__version__ = "0.1.0"
