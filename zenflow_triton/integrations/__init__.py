"""Optional integrations with training frameworks (DESIGN §2, "Training frameworks").

Import the one you use; this package itself imports neither framework:

- :mod:`zenflow_triton.integrations.lightning`: :class:`ZenFlowCallback`, a Lightning ``Callback``;
- :mod:`zenflow_triton.integrations.hf`: :class:`ZenFlowTrainerCallback`, a Hugging Face ``TrainerCallback``.

Both need the ``frameworks`` extra: ``pip install -e ".[frameworks]"`` from the checkout. Optimizer checkpoints
are exact without them; they only make the weights that evaluation and exported checkpoints see fresh (``flush()``).
"""

from .common import close_all, flush_all, take_over_clipping, unwrap_optimizer, zenflow_optimizers

__all__ = ["close_all", "flush_all", "take_over_clipping", "unwrap_optimizer", "zenflow_optimizers"]
