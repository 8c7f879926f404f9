"""ZenFlowAdamW under training frameworks: optimizer wrappers, state movers, and the callbacks of
``zenflow_triton.integrations`` under real Lightning and a real Hugging Face Trainer (CPU).

The framework tests need the ``frameworks`` extra and are skipped without it (CI installs it); the tests of
wrappers and state movers built here run everywhere. Every run is small (a two-layer net, a dozen steps) and
crosses windows (update_interval=4) with checkpoints and evaluations mid-window.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import logging
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.integrations import close_all, flush_all, unwrap_optimizer, zenflow_optimizers

HOST_KEYS = ("host_master", "host_exp_avg", "host_exp_avg_sq", "host_col_step")
# Windows of 4 steps and a selection every 8: checkpoints at step 6 are mid-window, with the result of the window
# that ended at step 4 pending; resumed runs cross a selection (step 9) and two window ends.
OPT_KW = dict(lr=2e-2, topk_ratio=0.25, update_interval=4, select_interval=8, min_offload_numel=128,
              warmup_steps=0, overlap_steps=None)

needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason='needs Lightning: pip install -e ".[frameworks]" from the checkout')
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason='needs transformers and accelerate: pip install -e ".[frameworks]" from the checkout')


class TinyNet(nn.Module):
    """Two linear layers; both weights are offloaded (768 and 256 elements), the biases are resident."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(24, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def dataset(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 24, generator=g)
    return x, torch.sin(x[:, :8] * 2) + 0.1 * torch.randn(n, 8, generator=g)


TRAIN, VAL = dataset(64, 1), dataset(16, 2)


def val_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(model(VAL[0]), VAL[1]).item()


def train_step(model: nn.Module, opt: Any, i: int) -> None:
    rows = slice(4 * (i % 16), 4 * (i % 16) + 4)
    opt.zero_grad()
    nn.functional.mse_loss(model(TRAIN[0][rows]), TRAIN[1][rows]).backward()
    opt.step()


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Nested equality, bitwise for tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def copying_mover(opt: torch.optim.Optimizer) -> None:
    """What a framework's state mover does when the target device differs from the tensor's: every tensor in
    ``opt.state[p]`` replaced by a copy (Lightning's ``v[key] = v.to(device)``; on CPU ``.to`` would not copy)."""
    for st in opt.state.values():
        for key, value in list(st.items()):
            if isinstance(value, torch.Tensor):
                st[key] = value.to(value.device, copy=True)


# ------------------------------------------------------------------------------------------------- packaging


@pytest.mark.slow
def test_optional_imports() -> None:
    """``import zenflow_triton`` and ``zenflow_triton.integrations`` import neither framework."""
    code = ("import sys, zenflow_triton, zenflow_triton.integrations; "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(("module", "framework"), [("lightning", "lightning"), ("hf", "transformers")])
def test_integration_without_its_framework_says_what_to_install(module: str, framework: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, framework, None)  # `import framework` now raises ImportError
    monkeypatch.delitem(sys.modules, f"zenflow_triton.integrations.{module}", raising=False)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[frameworks\]" from the checkout'):
        importlib.import_module(f"zenflow_triton.integrations.{module}")


def test_unwrap_optimizer() -> None:
    model = TinyNet()
    opt = ZenFlowAdamW(model.parameters(), **OPT_KW)

    class Wrapper:  # accelerate's AcceleratedOptimizer and DeepSpeed's wrappers expose `.optimizer`
        def __init__(self, optimizer: Any) -> None:
            self.optimizer = optimizer

    assert unwrap_optimizer(opt) is opt
    assert unwrap_optimizer(Wrapper(Wrapper(opt))) is opt
    assert unwrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)) is None
    assert unwrap_optimizer(None) is None
    assert zenflow_optimizers([opt, Wrapper(opt), None]) == [opt]
    opt.close()
    assert zenflow_optimizers(opt) == []  # a closed optimizer is neither flushed nor closed again


# ------------------------------------------------------------------------------------------------- wrappers


def shallow_copy_wrapper(opt: ZenFlowAdamW) -> ZenFlowAdamW:
    """A wrapper as Lightning 1.x built it, and as the issue describes it: a class derived from the optimizer's and
    a shallow copy of its ``__dict__``; a method that rebinds an attribute would rebind the wrapper's only."""
    cls = type("Wrapped" + type(opt).__name__, (type(opt),), {})
    wrapper = cls.__new__(cls)
    wrapper.__dict__ = dict(opt.__dict__)
    return wrapper


def lightning_wrapper(opt: ZenFlowAdamW) -> Any:
    """Lightning 2's ``LightningOptimizer``, built as ``Strategy`` builds it (it forwards what it lacks)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return LightningOptimizer(opt)


@pytest.mark.parametrize("make_wrapper", [shallow_copy_wrapper, pytest.param(lightning_wrapper, marks=needs_lightning)])
def test_wrapper_calls_equal_optimizer_calls(make_wrapper: Callable[[ZenFlowAdamW], Any]) -> None:
    """Flushing (several times, with host work in flight and pending), zeroing gradients and saving through a
    wrapper give exactly what the same calls on the optimizer give; the shallow copy also steps through the
    wrapper (Lightning 2's wrapper sends step() to its strategy)."""

    def run(through_wrapper: bool) -> tuple[list[float], list[torch.Tensor], dict[str, Any]]:
        model = TinyNet()
        opt = ZenFlowAdamW(model.parameters(), **OPT_KW)
        handle = make_wrapper(opt) if through_wrapper else opt
        stepper = handle if make_wrapper is shallow_copy_wrapper else opt
        losses = []
        for i in range(14):
            handle.zero_grad()
            rows = slice(4 * i, 4 * i + 4)
            nn.functional.mse_loss(model(TRAIN[0][rows]), TRAIN[1][rows]).backward()
            stepper.step()
            if i + 1 in (4, 6, 10):  # right after a window end (its job in flight), then mid-window, twice
                handle.flush()
                losses.append(val_loss(model))
        sd = copy.deepcopy(handle.state_dict())
        handle.flush()
        opt.close()
        return losses, params_of(model), sd

    losses, weights, sd = run(through_wrapper=False)
    w_losses, w_weights, w_sd = run(through_wrapper=True)
    assert w_losses == losses
    assert_same(w_weights, weights, "parameters")
    assert_same(w_sd, sd, "state_dict")


# ------------------------------------------------------------------------------------------------- state movers


def _run_with_mover(total: int, checkpoint_at: int | None, mode: str, *, mover: bool = True,
                    flush: bool = False) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """``total`` steps; with ``checkpoint_at``, a checkpoint after that step and, by ``mode``, either a new optimizer
    loading it ("after_load", as Lightning resumes) or the same optimizer going on ("live", as after Lightning's
    move to the CPU at the end of fit); then, with ``mover``, a copying state mover, and with ``flush`` a flush()
    before the next step (a validation right after resuming)."""
    model = TinyNet()
    opt = ZenFlowAdamW(model.parameters(), **OPT_KW)
    homes: dict[torch.Tensor, dict[str, int]] = {}
    for i in range(total):
        if i == checkpoint_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            if mode == "after_load":
                opt.close()
                buf.seek(0)
                ckpt = torch.load(buf, weights_only=False)
                model = TinyNet()
                model.load_state_dict(ckpt["model"])
                opt = ZenFlowAdamW(model.parameters(), **OPT_KW)
                opt.load_state_dict(ckpt["opt"])
            if mover:
                homes = {p: {k: st[k].data_ptr() for k in HOST_KEYS}
                         for p, st in opt.state.items() if "host_master" in st}
                copying_mover(opt)
                assert homes and all(opt.state[p]["host_master"].data_ptr() != ptrs["host_master"]
                                     for p, ptrs in homes.items())
            if flush:
                opt.flush()
        train_step(model, opt, i)
        if i == checkpoint_at:
            # The optimizer re-homes moved host state into its slab at the next step.
            for p, ptrs in homes.items():
                for key, ptr in ptrs.items():
                    assert opt.state[p][key].data_ptr() == ptr, f"{key} was not re-homed into its host slab"
    sd = copy.deepcopy(opt.state_dict())
    opt.flush()
    out = params_of(model)
    opt.close()
    return out, sd


@pytest.mark.parametrize("mode", ["after_load", "live"])
def test_state_mover_keeps_training_bitwise(mode: str) -> None:
    """A copying state mover after a checkpoint: training continues bit for bit like the uninterrupted run."""
    total = 14
    straight, straight_sd = _run_with_mover(total, None, mode)
    for at in (6, 8):  # mid-window with a result pending; right after a window end with its job in flight
        moved, moved_sd = _run_with_mover(total, at, mode)
        assert_same(moved, straight, f"parameters (mover after step {at})")
        assert_same(moved_sd, straight_sd, f"state_dict (mover after step {at})")


def test_flush_right_after_state_mover() -> None:
    """A flush() between the mover and the next step (Lightning's sanity-check validation on resume, with the
    callback) lands where it does without the mover: host work writes the slab, not the movers' copies."""
    for at in (6, 8):
        plain, plain_sd = _run_with_mover(14, at, "after_load", mover=False, flush=True)
        moved, moved_sd = _run_with_mover(14, at, "after_load", mover=True, flush=True)
        assert_same(moved, plain, f"parameters (mover and flush after step {at})")
        assert_same(moved_sd, plain_sd, f"state_dict (mover and flush after step {at})")


# ------------------------------------------------------------------------------------------------- Lightning


def _lightning_module(hook: str | None) -> Any:
    """A LightningModule over TinyNet with a StepLR schedule stepped per optimizer step; ``hook`` says what
    on_validation_start flushes: None, "wrapper" (``self.optimizers().flush()``, through LightningOptimizer) or
    "optimizer" (the optimizer)."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyNet()
            self.val_losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.val_losses.append(nn.functional.mse_loss(self.net(batch[0]), batch[1]).item())

        def on_validation_start(self) -> None:
            if hook == "wrapper":
                self.optimizers().flush()
            elif hook == "optimizer":
                self.optimizers().optimizer.flush()

        def configure_optimizers(self) -> Any:
            opt = ZenFlowAdamW(self.net.parameters(), **OPT_KW)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Module()


def _loader(data: tuple[torch.Tensor, torch.Tensor], batch_size: int) -> Any:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data), batch_size=batch_size, shuffle=False,
                                       num_workers=0)


def _lightning_trainer(root: Path, callbacks: list[Any], **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root, callbacks=callbacks,
                      **kwargs)


@pytest.fixture
def lightning_copying_mover(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Lightning's own state mover (``_optimizer_to_device``, after a checkpoint is loaded and at the end of fit),
    made to copy as it does when the device differs (CPU to CPU, ``.to`` returns the tensor itself). Returns the
    number of tensors it copied, in a list."""
    import lightning.fabric.utilities.optimizer as lopt

    assert hasattr(lopt, "_optimizer_to_device")
    real = lopt.move_data_to_device
    copies = [0]

    def copying(batch: Any, device: Any) -> Any:
        moved = real(batch, device)
        if isinstance(moved, torch.Tensor) and moved is batch:
            copies[0] += 1
            return moved.clone()
        return moved

    monkeypatch.setattr(lopt, "move_data_to_device", copying)
    return copies


def _lightning_fit(root: Path, *, callback: bool, ckpt_path: Path | None = None) -> Path:
    """Two epochs of 6 optimizer steps (12 batches, accumulate_grad_batches=2, gradient clipping), a checkpoint
    at each epoch end (step 6: mid-window; step 12); resumes from ``ckpt_path`` when given. Returns the folder."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from zenflow_triton.integrations.lightning import ZenFlowCallback

    ckpt_dir = root / "ckpt"
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}-{step}", save_top_k=-1)]
    if callback:
        callbacks.insert(0, ZenFlowCallback())
    trainer = _lightning_trainer(root, callbacks, max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5,
                                 limit_train_batches=12)
    trainer.fit(_lightning_module(None), train_dataloaders=_loader(TRAIN, 4), ckpt_path=ckpt_path)
    return ckpt_dir


@needs_lightning
def test_lightning_resume_mid_window_bitwise(tmp_path: Path, lightning_copying_mover: list[int]) -> None:
    """Checkpoint mid-window, a copying state mover at load (Lightning's own), resume: the last checkpoint (weights
    and optimizer) equals the uninterrupted run's bit for bit, with and without the callback. With it, the
    mid-window checkpoint holds flushed weights: those of the plain checkpoint after flush()."""
    last = {}
    for callback in (False, True):
        straight = _lightning_fit(tmp_path / f"straight-{callback}", callback=callback)
        mid = straight / "epoch=0-step=6.ckpt"
        copies = lightning_copying_mover[0]
        resumed = _lightning_fit(tmp_path / f"resumed-{callback}", callback=callback, ckpt_path=mid)
        assert lightning_copying_mover[0] > copies, "Lightning's state mover did not run"
        assert not (resumed / "epoch=0-step=6.ckpt").exists(), "the run did not resume at step 6"
        a = torch.load(straight / "epoch=1-step=12.ckpt", weights_only=False)
        b = torch.load(resumed / "epoch=1-step=12.ckpt", weights_only=False)
        assert_same(b["state_dict"], a["state_dict"], f"weights (callback={callback})")
        assert_same(b["optimizer_states"], a["optimizer_states"], f"optimizer (callback={callback})")
        last[callback] = a
        mids = torch.load(mid, weights_only=False)
        pending = [st["pending"] for st in mids["optimizer_states"][0]["state"].values() if "pending" in st]
        # The window that ended at step 4 is pending, unless the callback flushed it before saving.
        assert pending and any(pending) == (not callback)
        if not callback:
            plain_mid = mids
        else:
            flushed_mid = mids
    # The plain mid-window checkpoint, loaded and flushed, gives the weights the callback's checkpoint holds.
    module = _lightning_module(None)
    module.load_state_dict(plain_mid["state_dict"])
    opt = ZenFlowAdamW(module.net.parameters(), **OPT_KW)
    opt.load_state_dict(plain_mid["optimizer_states"][0])
    opt.flush()
    assert_same(module.state_dict(), flushed_mid["state_dict"], "flushed mid-window weights")
    assert any(not torch.equal(v, plain_mid["state_dict"][k]) for k, v in flushed_mid["state_dict"].items())
    opt.close()


@needs_lightning
def test_lightning_validation_sees_flushed_weights(tmp_path: Path) -> None:
    """Validation at step 6 (mid-window) after the callback's flush, after ``self.optimizers().flush()`` (through the
    wrapper) and after the optimizer's own flush(): the same losses and final weights, bit for bit; without a flush
    the weights are a window old and the loss differs."""
    from zenflow_triton.integrations.lightning import ZenFlowCallback

    results = {}
    for name, hook, callbacks in [("callback", None, [ZenFlowCallback()]), ("wrapper", "wrapper", []),
                                  ("optimizer", "optimizer", []), ("stale", None, [])]:
        module = _lightning_module(hook)
        trainer = _lightning_trainer(tmp_path / name, callbacks, max_steps=10, val_check_interval=6,
                                     limit_train_batches=10, enable_checkpointing=False)
        trainer.fit(module, train_dataloaders=_loader(TRAIN, 4), val_dataloaders=_loader(VAL, 8))
        flush_all(trainer.optimizers)  # what the callback does at the end of training (a no-op after it)
        close_all(trainer.optimizers)
        results[name] = (module.val_losses, params_of(module.net))
    assert results["callback"][0], "no validation ran"
    for name in ("wrapper", "optimizer"):
        assert results[name][0] == results["callback"][0], name
        assert_same(results[name][1], results["callback"][1], f"{name}: final weights")
    assert results["stale"][0][0] != results["callback"][0][0]


@needs_lightning
def test_lightning_callback_closes_at_fit_end(tmp_path: Path) -> None:
    """The callback closes the optimizer when fit ends; validating afterwards still works (nothing to flush). With
    ``close_at_fit_end=False`` the optimizer stays usable, e.g. for ``trainer.save_checkpoint`` after fit."""
    from zenflow_triton.integrations.lightning import ZenFlowCallback

    module = _lightning_module(None)
    trainer = _lightning_trainer(tmp_path, [ZenFlowCallback()], max_steps=6, enable_checkpointing=False)
    trainer.fit(module, train_dataloaders=_loader(TRAIN, 4))
    (opt,) = [unwrap_optimizer(o) for o in trainer.optimizers]
    assert zenflow_optimizers(opt) == []  # closed at teardown
    expected = val_loss(module.net)  # the callback flushed at the end of training
    trainer.validate(module, dataloaders=_loader(VAL, 16), verbose=False)
    assert module.val_losses == [pytest.approx(expected, rel=1e-6)]

    module = _lightning_module(None)
    trainer = _lightning_trainer(tmp_path, [ZenFlowCallback(close_at_fit_end=False)], max_steps=6,
                                 enable_checkpointing=False)
    trainer.fit(module, train_dataloaders=_loader(TRAIN, 4))
    trainer.save_checkpoint(tmp_path / "after-fit.ckpt")
    close_all(trainer.optimizers)


# ------------------------------------------------------------------------------------------------- HF Trainer


class HFNet(nn.Module):
    """TinyNet as the Trainer calls a model: keyword inputs, a dict with the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyNet()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def _hf_rows(data: tuple[torch.Tensor, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    return [{"x": x, "labels": y} for x, y in zip(*data)]


def _hf_trainer(out: Path, model: nn.Module, callbacks: list[Any], **kwargs: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    defaults = dict(per_device_train_batch_size=4, per_device_eval_batch_size=16, max_steps=12,
                    lr_scheduler_type="constant", max_grad_norm=0.5, logging_strategy="no", save_strategy="no",
                    eval_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=0,
                    use_cpu=True)
    args = TrainingArguments(output_dir=str(out), **{**defaults, **kwargs})
    opt = ZenFlowAdamW(model.parameters(), **OPT_KW)
    return Trainer(model=model, args=args, train_dataset=_hf_rows(TRAIN), eval_dataset=_hf_rows(VAL),
                   optimizers=(opt, None), callbacks=callbacks)


def _hf_mover_callback() -> Any:
    from transformers import TrainerCallback

    class Mover(TrainerCallback):
        """A state mover after the Trainer loaded the checkpoint (on_train_begin comes after the load); records the
        steps that follow."""

        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            copying_mover(unwrap_optimizer(kwargs["optimizer"]))

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.steps.append(state.global_step)

    return Mover()


@needs_transformers
def test_hf_trainer_resume_mid_window_and_evaluation(tmp_path: Path) -> None:
    """With the callback: evaluation and a checkpoint at step 6 (mid-window, gradient_accumulation_steps=2), the
    run resumed from it (with a state mover after the load) ends bit for bit where the uninterrupted one does; the
    evaluation at step 6 equals an explicit flush() then evaluate(), and differs from evaluate() without it."""
    from zenflow_triton.integrations.hf import ZenFlowTrainerCallback

    steps = dict(gradient_accumulation_steps=2, save_strategy="steps", save_steps=6, eval_strategy="steps",
                 eval_steps=6)
    straight_model = HFNet()
    straight = _hf_trainer(tmp_path / "straight", straight_model, [ZenFlowTrainerCallback()], **steps)
    straight.train()
    evals = {e["step"]: e["eval_loss"] for e in straight.state.log_history if "eval_loss" in e}
    assert sorted(evals) == [6, 12]

    resumed_model = HFNet()
    mover = _hf_mover_callback()
    resumed = _hf_trainer(tmp_path / "resumed", resumed_model, [ZenFlowTrainerCallback(), mover], **steps)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-6"))
    assert mover.steps == list(range(7, 13)), "the run did not resume at step 6"
    assert_same(params_of(resumed_model), params_of(straight_model), "final weights")
    for name in ("optimizer.pt", "scheduler.pt"):
        a = torch.load(tmp_path / "straight" / "checkpoint-12" / name, weights_only=False)
        b = torch.load(tmp_path / "resumed" / "checkpoint-12" / name, weights_only=False)
        assert_same(b, a, name)

    # No callback, six steps: evaluation sees the stale weights until an explicit flush().
    model = HFNet()
    plain = _hf_trainer(tmp_path / "plain", model, [], gradient_accumulation_steps=2, max_steps=6)
    plain.train()
    stale = plain.evaluate()["eval_loss"]
    unwrap_optimizer(plain.optimizer).flush()
    fresh = plain.evaluate()["eval_loss"]
    assert fresh == evals[6]
    assert stale != fresh
    unwrap_optimizer(plain.optimizer).close()


# ------------------------------------------------------------------------------------------------- clipping


def zenflow(params: Any, *, knob: bool, **kw: Any) -> ZenFlowAdamW:
    """The tests' optimizer, with ``grads_in_backward`` (the offloaded gradients consumed during backward, so only
    the optimizer can clip them) when ``knob``."""
    return ZenFlowAdamW(params, **OPT_KW, grads_in_backward=knob, **kw)


# Small enough that the framework's clipping scales every step's gradient (TinyNet's norms are ~0.3-1).
CLIP = 0.05


def _hf_clip_run(out: Path, *, knob: bool, own: float | None = None, framework_clip: float = CLIP,
                 runs: int = 1) -> tuple[list[torch.Tensor], Any, ZenFlowAdamW, list[float]]:
    """Six steps under the HF Trainer with the callback (``runs`` times with the same trainer and optimizer); the
    optimizer with ``grads_in_backward=knob`` and ``max_grad_norm=own``. Returns the weights, the Trainer's args after
    training, the optimizer and the ``args.max_grad_norm`` the Trainer read at each step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from zenflow_triton.integrations.hf import ZenFlowTrainerCallback

    seen: list[float] = []

    class Spy(TrainerCallback):  # after ZenFlowTrainerCallback: sees what the Trainer's clipping reads
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append(args.max_grad_norm)

    model = HFNet()
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=6,
                             lr_scheduler_type="constant", max_grad_norm=framework_clip, logging_strategy="no",
                             save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
                             dataloader_num_workers=0, seed=0, use_cpu=True)
    opt = zenflow(model.parameters(), knob=knob, max_grad_norm=own)
    trainer = Trainer(model=model, args=args, train_dataset=_hf_rows(TRAIN), optimizers=(opt, None),
                      callbacks=[ZenFlowTrainerCallback(close_at_train_end=False), Spy()])
    try:
        for _ in range(runs):
            trainer.train()
    finally:
        opt.close()
    return params_of(model), trainer.args, opt, seen


@needs_transformers
def test_hf_trainer_clipping_moves_into_in_backward_optimizer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """grads_in_backward on: the Trainer's max_grad_norm moves into the optimizer (one INFO line), the Trainer reads
    0 at every step and gets its value back at the end, and the weights are those of the Trainer clipping an
    ordinary run, bit for bit (the same clip_grad_norm_ over the same parameters); they differ from an unclipped
    run. A second train() with the same optimizer moves it again. Off: nothing changes."""
    with caplog.at_level(logging.INFO, logger="zenflow_triton"):
        moved, args, opt, seen = _hf_clip_run(tmp_path / "moved", knob=True, runs=2)
    assert seen == [0] * 12 and args.max_grad_norm == CLIP  # off while training, the user's value after
    assert opt.config.max_grad_norm == CLIP and opt.stats()["max_grad_norm"] == CLIP
    assert opt.stats()["last_grad_norm"] > CLIP  # the optimizer clipped
    lines = [r for r in caplog.records if "moved into the ZenFlow optimizer" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in lines)  # once per train()
    assert "TrainingArguments(max_grad_norm=0)" in lines[0].getMessage()

    moved, _, _, _ = _hf_clip_run(tmp_path / "moved-once", knob=True)
    framework, args, opt, seen = _hf_clip_run(tmp_path / "framework", knob=False)
    assert seen == [CLIP] * 6 and args.max_grad_norm == CLIP
    assert opt.config.max_grad_norm is None and opt.stats()["max_grad_norm"] is None
    assert_same(moved, framework, "weights (clipped in the optimizer vs by the Trainer)")
    unclipped, _, _, _ = _hf_clip_run(tmp_path / "unclipped", knob=False, framework_clip=0.0)
    assert any(not torch.equal(a, b) for a, b in zip(unclipped, framework))


@needs_transformers
def test_hf_trainer_clipping_twice_with_in_backward_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Set TrainingArguments\(max_grad_norm=0\).*max_grad_norm=0.3"):
        _hf_clip_run(tmp_path, knob=True, own=0.3)
    # Without the framework's clipping the optimizer's own stands.
    _, args, opt, seen = _hf_clip_run(tmp_path, knob=True, own=0.3, framework_clip=0.0)
    assert seen == [0] * 6 and opt.config.max_grad_norm == 0.3


def _lightning_clip_run(root: Path, *, knob: bool, own: float | None = None, clip: float | None = CLIP,
                        algorithm: str | None = None,
                        fits: int = 1) -> tuple[list[torch.Tensor], Any, list[ZenFlowAdamW], list[Any]]:
    """Six steps under Lightning with the callback, ``gradient_clip_val=clip`` (``fits`` times with the same
    trainer, each fit with a new optimizer from configure_optimizers); the optimizers with ``grads_in_backward=knob``
    and ``max_grad_norm=own``. Returns the weights, the trainer, the optimizers and the gradient_clip_val the
    trainer held at each step."""
    import lightning.pytorch as pl

    from zenflow_triton.integrations.lightning import ZenFlowCallback

    made: list[ZenFlowAdamW] = []
    seen: list[Any] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyNet()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(self.trainer.gradient_clip_val)
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            opt = zenflow(self.net.parameters(), knob=knob, max_grad_norm=own)
            made.append(opt)
            return opt

    module = Module()
    trainer = _lightning_trainer(root, [ZenFlowCallback()], max_steps=6, enable_checkpointing=False,
                                 gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    try:
        for i in range(fits):
            if i:
                trainer.fit_loop.epoch_loop.max_steps = 6 * (i + 1)  # six more steps on the same trainer
            trainer.fit(module, train_dataloaders=_loader(TRAIN, 4))
    finally:
        close_all(made)
    return params_of(module.net), trainer, made, seen


@needs_lightning
def test_lightning_clipping_moves_into_in_backward_optimizer(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """As the HF test: gradient_clip_val moves into the in-backward optimizer (one INFO line), the trainer holds None
    while fitting and its value again after, and the weights equal Lightning clipping an ordinary run bit for bit;
    a second fit (a new optimizer) moves it again; off: nothing changes."""
    with caplog.at_level(logging.INFO, logger="zenflow_triton"):
        moved, trainer, opts, seen = _lightning_clip_run(tmp_path / "moved", knob=True, fits=2)
    assert seen == [None] * 12 and trainer.gradient_clip_val == CLIP
    assert len(opts) == 2 and all(o.config.max_grad_norm == CLIP for o in opts)
    lines = [r for r in caplog.records if "moved into the ZenFlow optimizer" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in lines)
    assert "Trainer(gradient_clip_val=None)" in lines[0].getMessage()

    moved, _, (opt,), _ = _lightning_clip_run(tmp_path / "moved-once", knob=True)
    assert opt.stats()["max_grad_norm"] == CLIP
    framework, trainer, (opt,), seen = _lightning_clip_run(tmp_path / "framework", knob=False)
    assert seen == [CLIP] * 6 and trainer.gradient_clip_val == CLIP and opt.config.max_grad_norm is None
    assert_same(moved, framework, "weights (clipped in the optimizer vs by Lightning)")
    unclipped, _, _, _ = _lightning_clip_run(tmp_path / "unclipped", knob=False, clip=None)
    assert any(not torch.equal(a, b) for a, b in zip(unclipped, framework))


@needs_lightning
def test_lightning_clipping_twice_or_by_value_with_in_backward_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Set Trainer\(gradient_clip_val=None\).*max_grad_norm=0.3"):
        _lightning_clip_run(tmp_path / "twice", knob=True, own=0.3)
    with pytest.raises(ValueError, match=r"clips gradients by value.*gradient_clip_val=None"):
        _lightning_clip_run(tmp_path / "value", knob=True, algorithm="value")
    # By value without in-backward capture: Lightning clips as usual, the optimizer does not.
    _, trainer, (opt,), seen = _lightning_clip_run(tmp_path / "value-off", knob=False, algorithm="value")
    assert seen == [CLIP] * 6 and opt.config.max_grad_norm is None


def test_clipping_moved_in_survives_deepcopy() -> None:
    """The moved value is in opt.config, from which copy.deepcopy and pickle rebuild the optimizer."""
    from zenflow_triton.integrations import take_over_clipping

    model = TinyNet()
    opt = zenflow(model.parameters(), knob=True)
    assert not take_over_clipping(opt, 0.0, framework="X", switch_off="x=0")
    assert opt.config.max_grad_norm is None
    assert take_over_clipping([opt], 0.25, framework="X", switch_off="x=0")
    train_step(model, opt, 0)
    twin = copy.deepcopy(opt)
    assert twin.stats()["max_grad_norm"] == 0.25 and twin.config.max_grad_norm == 0.25
    plain = ZenFlowAdamW(TinyNet().parameters(), **OPT_KW)
    assert not take_over_clipping(plain, 0.25, framework="X", switch_off="x=0")  # no in-backward capture
    assert plain.config.max_grad_norm is None
    for o in (opt, twin, plain):
        o.close()


# ------------------------------------------------------------------------------------------------- docs examples

# docs/frameworks.md's examples are fenced "python frameworks": tests/test_readme.py, which runs every plain
# "python" block, leaves them to this file, which runs them where the extra is installed.
FRAMEWORKS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "frameworks.md"
FRAMEWORK_BLOCKS = re.findall(r"```python frameworks\n(.*?)```", FRAMEWORKS_PAGE.read_text(encoding="utf-8"),
                              flags=re.S)


def test_readme_has_framework_examples() -> None:
    assert len(FRAMEWORK_BLOCKS) == 3, "docs/frameworks.md should show Lightning, HF Trainer and Accelerate examples"


@needs_lightning
@needs_transformers
@pytest.mark.parametrize("index", range(len(FRAMEWORK_BLOCKS)))
def test_readme_framework_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = compile(FRAMEWORK_BLOCKS[index], f"docs/frameworks.md example {index}", "exec")
    exec(code, {"__name__": "__readme__"})
