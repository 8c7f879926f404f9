"""End to end: fine-tuning a pretrained model with ZenFlowAdamW ends close to torch.optim.AdamW.

A byte-level transformer (zenflow_triton.demo.charlm) is pretrained on standard-library source, then fine-tuned on the
pydoc help topics twice, from the same weights, on the same batches, with the same hyperparameters: once with
AdamW and once with ZenFlowAdamW(topk_ratio=0.1, update_interval=4), which updates 90% of every weight matrix's
columns only once per 4-step window and one window late. The loss on held-out pydoc text must be within 8% of
AdamW's, and both must have learned (a clear drop from the pretrained model's loss), so the test cannot pass with
neither optimizer doing anything.

Measured on the 2-core CI CPU (torch 2.13, Python 3.11): pretrained 2.539, AdamW 1.976, ZenFlowAdamW 2.050, ratio
1.037 (1.033 and 1.043 with other batch seeds). About 25 s when the machine is otherwise idle, half of it the 800
pretraining steps; with other jobs loading both cores it took 40-75 s.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.demo.charlm import (
    CharLMConfig,
    evaluate,
    load_corpora,
    make_model,
    offloadable_numel,
    pretrained_state,
    train,
)

FINETUNE_STEPS = 200
# Batch 8 at lr 1e-3: after 200 steps AdamW is 0.56 nats below the pretrained model on held-out text and
# ZenFlowAdamW 0.49, so the two thresholds below have wide margins on both sides while the run stays short.
FINETUNE_BATCH = 8
LR = 1e-3
TOPK_RATIO = 0.1
UPDATE_INTERVAL = 4
MAX_LOSS_RATIO = 1.08
# Both optimizers must cut the pretrained loss by at least 10% (measured: 22% AdamW, 19% ZenFlowAdamW).
MIN_IMPROVEMENT = 0.10


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Run torch ops on one thread, restoring the caller's setting afterwards.

    On the 2-core CI machine ZenFlowAdamW's host worker takes the second core; a second torch thread would fight it.
    And with any other load on the machine, OpenMP's two threads wait on each other at every op: measured here under
    load, pretraining took 112 s wall on 2 threads and 22 s on 1. The losses are identical either way.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _finetune(opt_name: str, cfg: CharLMConfig, state: dict[str, torch.Tensor]) -> tuple[float, dict | None]:
    corpora = load_corpora()
    model = make_model(cfg)
    model.load_state_dict(state)
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        train(model, opt, corpora.finetune_train, steps=FINETUNE_STEPS, batch=FINETUNE_BATCH, seed=1)
        return evaluate(model, corpora.finetune_val), None
    zen = ZenFlowAdamW(
        model.parameters(), lr=LR, weight_decay=0.01, topk_ratio=TOPK_RATIO, update_interval=UPDATE_INTERVAL
, warmup_steps=0)
    try:
        train(model, zen, corpora.finetune_train, steps=FINETUNE_STEPS, batch=FINETUNE_BATCH, seed=1)
        # overlap=True leaves the last window's host update one window behind in the model (DESIGN §2).
        zen.flush()
        return evaluate(model, corpora.finetune_val), zen.stats()
    finally:
        zen.close()


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_zenflow_finetune_loss_close_to_adamw() -> None:
    cfg = CharLMConfig()
    offloaded, total = offloadable_numel(make_model(cfg))
    # The comparison means something only if most of the model goes through ZenFlow's offloaded path.
    assert offloaded / total > 0.9

    state = pretrained_state(cfg)
    base_model = make_model(cfg)
    base_model.load_state_dict(state)
    pretrained = evaluate(base_model, load_corpora().finetune_val)

    adamw, _ = _finetune("adamw", cfg, state)
    zenflow, stats = _finetune("zenflow", cfg, state)
    summary = f"pretrained {pretrained:.4f}, AdamW {adamw:.4f}, ZenFlowAdamW {zenflow:.4f}, stats {stats}"

    # ZenFlow really ran its windows and kept only the top-k columns on the device (not a degenerate AdamW).
    assert stats is not None
    assert stats["steps"] == FINETUNE_STEPS, summary
    assert stats["windows"] == FINETUNE_STEPS // UPDATE_INTERVAL, summary
    assert 0.0 < stats["selected_fraction"] < 2 * TOPK_RATIO, summary

    assert adamw < (1.0 - MIN_IMPROVEMENT) * pretrained, summary
    assert zenflow < (1.0 - MIN_IMPROVEMENT) * pretrained, summary
    assert zenflow <= MAX_LOSS_RATIO * adamw, summary
