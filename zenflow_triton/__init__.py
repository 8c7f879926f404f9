"""zenflow_triton: ZenFlow offloaded Adam(W) as a drop-in ``torch.optim`` optimizer."""

from .config import ZenFlowConfig
from .optimizer import ZenFlowAdam, ZenFlowAdamW

__all__ = ["ZenFlowAdam", "ZenFlowAdamW", "ZenFlowConfig"]
__version__ = "0.1.0"
