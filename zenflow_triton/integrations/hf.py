"""Hugging Face Trainer: :class:`ZenFlowTrainerCallback` keeps the weights that evaluation and saved models see
fresh.

With ``overlap=True`` the parameters lag the optimizer by up to one window of host work; ``flush()`` brings them
up to date. The Trainer has no event before an evaluation or a save, but it decides both in
``on_step_end`` / ``on_epoch_end`` (``control.should_evaluate``, ``control.should_save``, set by its
``DefaultFlowCallback``, which runs first) and acts right after; the callback flushes there, and at the last step,
and closes the optimizer at ``on_train_end``. It finds the optimizer in the events' ``optimizer`` argument,
unwrapping accelerate's ``AcceleratedOptimizer``. Resuming stays exact without it: the optimizer's checkpoint
carries the pending host results. A flush changes the weights the next steps train on (they are fresher), so a run
with the callback differs slightly from one without it, and a run resumed from one of its checkpoints continues it
bit for bit.

With ``grads_in_backward=True`` the offloaded gradients are gone before the Trainer clips (``max_grad_norm``,
1.0 by default), so at ``on_train_begin`` the callback moves the Trainer's ``max_grad_norm`` into the optimizer and
sets ``args.max_grad_norm = 0`` (an INFO log line says so), or raises a ValueError when the optimizer has a
``max_grad_norm`` of its own (set ``TrainingArguments(max_grad_norm=0)`` then). ``on_train_end`` gives ``args`` its
value back; the optimizer keeps clipping.

``on_save`` is not a flush point: the Trainer calls it after the checkpoint is written, and a flush then would make
the live run part ways with the checkpoint it just wrote.

Usage::

    trainer = transformers.Trainer(..., optimizers=(ZenFlowAdamW(model.parameters()), None),
                                   callbacks=[ZenFlowTrainerCallback()])
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # the frameworks are an optional extra
    raise ImportError(
        'zenflow_triton.integrations.hf needs transformers: pip install -e ".[frameworks]" from the checkout'
    ) from exc

from .common import close_all, flush_all, take_over_clipping

__all__ = ["ZenFlowTrainerCallback"]


class ZenFlowTrainerCallback(TrainerCallback):
    """Flush the ZenFlow optimizer before the Trainer evaluates or saves, and at the last step; close it at the end.

    Args:
        close_at_train_end: ``close()`` the optimizer at ``on_train_end`` (stops the host worker). Turn it off to
            call ``trainer.train()`` again with the same optimizer (one passed in ``optimizers=``).
    """

    def __init__(self, *, close_at_train_end: bool = True) -> None:
        self.close_at_train_end = close_at_train_end
        self._clip_moved: set[int] = set()  # optimizers the Trainer's max_grad_norm was moved into
        self._restore_clip: float | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The Trainer clips when `args.max_grad_norm > 0` (a number, never None), read at every step.
        if take_over_clipping(kwargs.get("optimizer"), args.max_grad_norm, framework="the HF Trainer",
                              switch_off="TrainingArguments(max_grad_norm=0)", moved=self._clip_moved):
            self._restore_clip, args.max_grad_norm = args.max_grad_norm, 0.0

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # `should_training_stop`: the last step; flushed here, before the Trainer's end-of-training work
        # (load_best_model_at_end loads weights that a later flush would partly overwrite).
        if control.should_evaluate or control.should_save or control.should_training_stop:
            flush_all(kwargs.get("optimizer"))

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if control.should_evaluate or control.should_save or control.should_training_stop:
            flush_all(kwargs.get("optimizer"))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._restore_clip is not None:  # the user's TrainingArguments as they were
            args.max_grad_norm, self._restore_clip = self._restore_clip, None
        if self.close_at_train_end:
            close_all(kwargs.get("optimizer"))
