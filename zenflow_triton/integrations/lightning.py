"""Lightning: :class:`ZenFlowCallback` keeps the weights that validation, testing and checkpoints see fresh.

With ``overlap=True`` the parameters lag the optimizer by up to one window of host work; ``flush()`` brings them
up to date. The callback flushes every ZenFlow optimizer of the trainer (unwrapping Lightning's
``LightningOptimizer``) before validation, testing and prediction, when a checkpoint is saved, and at the end of
training, and closes them when ``fit`` ends. Resuming stays exact without it: the optimizer's checkpoint carries the
pending host results. A flush changes the weights the next steps train on (they are fresher), so a run with the
callback differs slightly from one without it, and a run resumed from one of its checkpoints continues it bit for
bit.

With ``grads_in_backward=True`` the offloaded gradients are gone before Lightning clips (``gradient_clip_val``),
so at ``on_fit_start`` the callback moves the trainer's ``gradient_clip_val`` into the optimizer's
``max_grad_norm`` and sets the trainer's to None until ``fit`` ends (an INFO log line says so), or raises a
ValueError when the optimizer has a ``max_grad_norm`` of its own or the trainer clips by value (the optimizer clips
by norm). A LightningModule's own ``configure_gradient_clipping`` is not seen.

Usage::

    trainer = lightning.pytorch.Trainer(..., callbacks=[ZenFlowCallback()])
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as exc:  # the frameworks are an optional extra
    raise ImportError(
        'zenflow_triton.integrations.lightning needs Lightning: pip install -e ".[frameworks]" from the checkout'
    ) from exc

from .common import close_all, flush_all, take_over_clipping, zenflow_optimizers

__all__ = ["ZenFlowCallback"]


class ZenFlowCallback(pl.Callback):
    """Flush ZenFlow optimizers before evaluation, checkpoints and the end of training; close them after ``fit``.

    Args:
        close_at_fit_end: ``close()`` the optimizers when ``fit`` tears down (stops the host worker). Leave it on
            unless the optimizers are used after ``fit`` (``trainer.save_checkpoint`` after ``fit`` needs their
            state), which a closed optimizer refuses.
    """

    def __init__(self, *, close_at_fit_end: bool = True) -> None:
        super().__init__()
        self.close_at_fit_end = close_at_fit_end
        self._clip_moved: set[int] = set()  # optimizers the trainer's gradient_clip_val was moved into
        self._restore_clip: float | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After strategy.setup (the optimizers exist), before the first step; Lightning reads gradient_clip_val at
        # every optimizer step.
        clip = trainer.gradient_clip_val
        if clip is not None and clip > 0 and trainer.gradient_clip_algorithm == "value" and any(
                getattr(opt.config, "grads_in_backward", False) for opt in zenflow_optimizers(trainer.optimizers)):
            raise ValueError(
                f"Lightning clips gradients by value (gradient_clip_val={clip}, gradient_clip_algorithm='value'), "
                "but with grads_in_backward=True the offloaded gradients are gone before Lightning clips. The "
                "ZenFlow optimizer clips by norm only: set Trainer(gradient_clip_val=None) and the optimizer's "
                "max_grad_norm, or grads_in_backward=False.")
        if take_over_clipping(trainer.optimizers, clip, framework="Lightning",
                              switch_off="Trainer(gradient_clip_val=None)", moved=self._clip_moved):
            # Given back at the fit teardown: the next fit builds its optimizers anew (configure_optimizers).
            self._restore_clip, trainer.gradient_clip_val = clip, None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        flush_all(trainer.optimizers)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        flush_all(trainer.optimizers)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        flush_all(trainer.optimizers)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        flush_all(trainer.optimizers)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning calls this hook after it has gathered the model's and the optimizers' states into
        # `checkpoint`, and before writing it: a flush here changes the live weights and optimizer state after they
        # were read. So both are read again (through the strategy, as Lightning read them), and the checkpoint
        # stays what a run resumed from it needs to continue this one bit for bit.
        saved = checkpoint.get("optimizer_states")
        flushed = False
        for i, raw in enumerate(trainer.optimizers):
            if not flush_all(raw):
                continue
            flushed = True
            if saved is not None and i < len(saved):  # absent from weights-only checkpoints
                saved[i] = trainer.strategy.optimizer_state(raw)
        if flushed:
            checkpoint["state_dict"] = trainer.strategy.lightning_module_state_dict()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._restore_clip is not None:
            trainer.gradient_clip_val, self._restore_clip = self._restore_clip, None
        if stage == "fit" and self.close_at_fit_end:
            close_all(trainer.optimizers)
