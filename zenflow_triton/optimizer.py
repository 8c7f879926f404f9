"""ZenFlowAdamW / ZenFlowAdam: drop-in ``torch.optim`` optimizers with ZenFlow offloading (DESIGN §2-§5).

Offloaded matrices keep fp32 master weights and Adam moments in host memory: their top-k columns step on the device
every step, the rest on the host once per window (DESIGN §1); every other parameter gets plain AdamW on its device.

This module is the ``torch.optim`` shell and the schedule of DESIGN §3 (:meth:`ZenFlowAdamW._offloaded_step`). The
rest is in rooms of its own: :mod:`.pipeline` (host windows: worker, copies, merge), :mod:`.state` (the state's
layout), :mod:`.columns` (selection and migration), :mod:`.auto` ("auto" knobs) and the kernels behind
:class:`~zenflow_triton.kernels.DeviceOps`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from . import checkpoint, retune
from .auto import AUTO_WARMUP_STEPS, Knobs
from .capture import GradientCapture
from .columns import reselect_many_
from .config import ZenFlowConfig
from .gradients import GradientClipper
from .host_jobs import Window
from .kernels import AdamHyperparams, FusedStepArgs, load_device_ops
from .params import (
    check_betas_pair,
    check_new_group,
    check_unchanged,
    gather_step,
    hp_lookup,
    hyperparams,
    offloads,
    warn_kept_resident,
)
from .pipeline import Pipeline
from .sharding import add_summed_scores_, local
from .state import init_resident, step_resident_
from .telemetry import Stats, stats_of

__all__ = ["ZenFlowAdamW", "ZenFlowAdam", "AUTO_WARMUP_STEPS"]

logger = logging.getLogger("zenflow_triton")

@dataclass
class Schedule:
    """The optimizer's step count, which window ends and selections follow (DESIGN §3): ``step()`` calls that had
    at least one gradient. Kept in a shared object, never rebound, so wrappers that copy ``__dict__`` see it."""

    step: int = 0


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with ZenFlow offloading; use exactly like ``torch.optim.AdamW``.

    Args:
        params: parameters or param groups (per-group ``lr``, ``betas``, ``eps``, ``weight_decay``).
        topk_ratio: fraction of each offloaded weight's columns updated on the device every step, or "auto".
        update_interval, select_interval: steps per host window (U), or "auto"; between reselections (None: 8 windows).
        warmup_steps: steps of synchronous AdamW on every element before selection starts (default 100).
        overlap: apply each window's host result ``overlap_steps`` steps late (None: U, one window; "auto", the
            default: the tuner's, 1 on CPU tensors) instead of waiting: fewer stale gradients, less time for the host.
        quality_regime: "finetune", "scratch" or "worst" (the default): the quality table "auto" plans with.
        min_offload_numel: smallest parameter (ndim >= 2) that is offloaded.
        cpu_threads: numba threads of the host worker (None: all cores but one, but two with CUDA parameters, and
            every core for a window that step() waits for anyway: warm-up steps and ``overlap=False``).
        backend: "triton", "numba" (CPU tensors), "torch" or "auto" (triton on CUDA, numba on CPU).
        grad_dtype, state_dtype: dtype of the host gradient landing buffer (bfloat16 halves device-to-host bytes),
            of the host exp_avg/exp_avg_sq (bfloat16: -4 B/param, stochastic rounding); "float32" or "bfloat16".
        worker_timeout: seconds to wait for one host job before raising instead of hanging.
        accumulate: where the window's gradient sum lives: "device" (fp32 acc, 4 B/param on the device), "host"
            (each step's gradient copied to the host and summed there; no device acc), or "auto".
        max_grad_norm: clip gradients at each step() to this total norm exactly as ``clip_grad_norm_`` would, or None.
        host_lr_scale: lr factor of the host windows after warm-up (DESIGN §3); 1.0 is Adam's step; "auto": the tuner's.
        grads_in_backward: consume the offloaded gradients during backward (hooks set ``p.grad`` to None; with
            accumulate="host"); clip with ``max_grad_norm``, not the model's gradients (see :mod:`.capture`).
        host_snapshot: False: no host copy of bf16/fp16 weights (-2 B/param); the merge rounds the fp32 master.

    Call ``flush()`` before evaluating or exporting weights when ``overlap=True``; ``state_dict()`` never changes the
    parameters, so a resumed run continues bit for bit. ``close()`` (or ``with``) stops the worker, as does exit.

    On CPU tensors "device" and host memory are one and three copies are skipped (DESIGN §4); with ``overlap=False``
    an fp32 parameter is its own host master, so ``load_state_dict()`` writes the saved master into it.
    """

    _decoupled = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        topk_ratio: float | str = 0.1,
        update_interval: int | str = 4,
        select_interval: int | None = None,
        warmup_steps: int = 100,
        overlap: bool = True,
        min_offload_numel: int = 4096,
        cpu_threads: int | None = None,
        backend: str = "auto",
        grad_dtype: str = "float32", state_dtype: str = "float32",
        worker_timeout: float = 600.0,
        accumulate: str = "auto",
        max_grad_norm: float | None = None,
        host_lr_scale: float | str = 1.0,
        grads_in_backward: bool = False, host_snapshot: bool = True,
        overlap_steps: int | str | None = "auto",
        quality_regime: str = "worst",
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        hyperparams(defaults, decoupled=self._decoupled)
        check_betas_pair(betas)
        self.config = ZenFlowConfig(
            topk_ratio=topk_ratio, update_interval=update_interval, select_interval=select_interval,
            warmup_steps=warmup_steps, overlap=overlap, min_offload_numel=min_offload_numel,
            cpu_threads=cpu_threads, backend=backend, grad_dtype=grad_dtype, worker_timeout=worker_timeout,
            accumulate=accumulate, max_grad_norm=max_grad_norm, host_lr_scale=host_lr_scale,
            grads_in_backward=grads_in_backward, overlap_steps=overlap_steps, quality_regime=quality_regime,
            state_dtype=state_dtype, host_snapshot=host_snapshot,
        )
        self._device: torch.device | None = None
        self._stats = Stats()
        self._schedule = Schedule()
        self._pipeline = Pipeline(self.config, self._stats)
        self._gradients = GradientClipper(self.config.max_grad_norm)
        self._capture = GradientCapture(self)  # grads_in_backward: hooks on the offloaded parameters (capture.py)
        super().__init__(params, defaults)
        self._knobs = Knobs(self.config, device=self._device)  # after the params: cpu_threads' default is per device
        if self._device is not None and self._device.type != "meta":
            # Fail here, not at the first step(), when the backend cannot run on the parameters' device (meta
            # parameters are checked at the first step, on the device they were materialized on).
            load_device_ops(self.config.backend, self._device)

    # ------------------------------------------------------------------ torch.optim surface

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params, self._device = check_new_group(param_group, self.param_groups, self.defaults, self._device,
                                               decoupled=self._decoupled)
        self._capture.check(params)  # grads_in_backward: refusals before, hooks once the group is in
        super().add_param_group(dict(param_group, params=params))
        self._capture.register(params)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step, as ``torch.optim.AdamW.step``. A KeyboardInterrupt or SystemExit that arrives while
        it waits for the host is raised when the step is complete (see :meth:`.Pipeline.deferred_interrupts`)."""
        pipeline = self._pipeline
        pipeline.check_usable()
        self._capture.before_step(self)  # grads_in_backward: GradScaler refused, hooks follow replaced tensors
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pipeline.raise_finished_job_error()
        entered = time.perf_counter()
        stall_before = self._stats.stall_s
        with pipeline.deferred_interrupts():
            check_unchanged(self.param_groups, self.state, pipeline.records)
            pipeline.rehome(self.state)
            resident, offloaded = self._prepare_step()
            if not offloaded and not any(ps for _, ps in resident):
                return loss  # no gradient at all: nothing happens, as in torch (and the schedule does not advance)
            self._gradients.clip_(self.param_groups, self._capture)  # max_grad_norm: before anything reads a gradient
            self._schedule.step += 1
            self._knobs.sample_step_time(entered, offloaded[0][1].device if offloaded else None)
            step_resident_(self.state, resident)
            if pipeline.records:
                self._offloaded_step(offloaded)
            self._stats.steps += 1
            now = time.perf_counter()
            self._knobs.step_ended(now)
            self._stats.device_opt_s += now - entered - (self._stats.stall_s - stall_before)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. Zeroing in place first orders the compute stream after any copy
        still reading a gradient (accumulate="host" on CUDA copies each step's gradient asynchronously)."""
        if not set_to_none:
            self._pipeline.release_gradients()
        self._capture.discard()  # gradients captured in backward (grads_in_backward) go as .grad would
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Like ``torch.optim.Optimizer.state_dict`` (its hooks run as there): waits for host work but never changes
        the parameters, so a run resumed from it continues bit for bit.

        The format (:mod:`.checkpoint`) depends on nothing but the parameters: an offloaded parameter's entry holds
        full-size CPU copies (``master``, moments, ``acc``) and per-column vectors; a resident one's is AdamW's, by
        reference as in torch (``copy.deepcopy`` to keep a snapshot). ``"zenflow"`` (also in every param group, which
        DCP keeps) holds the knobs ("auto" resolved), the step count and the format number."""
        self._pipeline.check_usable()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        check_unchanged(self.param_groups, self.state, self._pipeline.records)
        with self._pipeline.deferred_interrupts():
            self._pipeline.rehome(self.state)
            self._pipeline.wait(self.state, merge=False)
        zenflow = {**self._knobs.state_dict(), "step": self._schedule.step, "accumulate": self._pipeline.accumulate}
        sd = checkpoint.pack(self.param_groups, self.state, self._pipeline.records, zenflow)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``, onto any device; training then continues bit for bit. Its hooks run as in
        torch. Everything is checked before anything changes: on an error the optimizer and the parameters are as
        they were."""
        self._pipeline.check_usable()
        self._capture.check_none_pending("load_state_dict()")
        state_dict = state_dict.copy()  # shallow, as torch: a pre hook may edit it
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        with self._pipeline.deferred_interrupts():
            self._pipeline.wait(self.state, merge=False)
        checkpoint.restore(self, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def set_knobs(self, **knobs: Any) -> None:
        """Change ``topk_ratio``, ``update_interval``, ``select_interval``, ``host_lr_scale`` or ``overlap_steps``
        (keywords, concrete values checked as the constructor checks them; ``overlap_steps=None`` is U) of a running
        optimizer, typically a resumed one (a checkpoint's knobs win at ``load_state_dict()``). A new U or S ends the
        open window now, as ``flush()`` does; a new ``topk_ratio`` takes effect at the next selection step, a new
        ``host_lr_scale`` at the next window end. Without ``select_interval``, S follows a new U where it was the
        default (8 windows). ``state_dict()`` and ``stats()`` carry the new values; nothing changes when it raises."""
        self._pipeline.check_usable()
        retune.set_knobs(self._knobs, self.flush, **knobs)

    def adamw_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as a ``torch.optim.AdamW`` state_dict (``torch.optim.Adam``'s for
        :class:`ZenFlowAdam`), to finish a run without offloading: ``flush()`` first (the parameters are then AdamW's
        master), then each parameter's moments on its device in its dtype, with its own step count (per-column counts:
        :func:`.checkpoint.to_adamw`). Load it into an AdamW built over the same parameters in the same groups."""
        self.flush()
        return checkpoint.to_adamw_state_dict(self.state_dict(), self.param_groups)

    def flush(self) -> None:
        """Apply every gradient given to ``step()`` so far to the parameters (before evaluation or export): ends the
        open window early, with the mean of the gradients it holds, and waits for all host work. Training continues
        correctly afterwards; the next window ends at the schedule's next window end."""
        pipeline = self._pipeline
        pipeline.check_usable()
        check_unchanged(self.param_groups, self.state, pipeline.records)
        with pipeline.deferred_interrupts():
            pipeline.rehome(self.state)
            windows = pipeline.open_windows(self.state, hp_lookup(self.param_groups, {}, decoupled=self._decoupled))
            if windows:
                # Warm-up windows end at every step, so an open one here is past warm-up: host_lr_scale applies.
                pipeline.end_windows(windows, self.state, sync=True, cpu_threads=self._knobs.resolved.cpu_threads,
                                     lr_scale=self._knobs.value("host_lr_scale") or 1.0)
            else:
                pipeline.wait(self.state, merge=True)

    def close(self) -> None:
        """Stop the host worker and release host buffers. The optimizer cannot step afterwards. It always returns
        (within ``worker_timeout``): host work it cannot apply (a hung or failed worker, a parameter whose storage
        was replaced) is reported in a warning, not raised."""
        pipeline = self._pipeline
        with pipeline.deferred_interrupts():
            if not pipeline.closed and pipeline.failure is None:
                try:
                    check_unchanged(self.param_groups, self.state, pipeline.records)
                    pipeline.rehome(self.state)
                except Exception as exc:  # noqa: BLE001 - the state is released whatever is wrong with it
                    pipeline.failure = exc
                    logger.warning("zenflow_triton: close() drops the host work in flight: %s", exc)
            pipeline.close(self.state)
            self._capture.close()

    def __getstate__(self) -> dict[str, Any]:
        """``copy.deepcopy`` and pickle give a working optimizer of its own (its own worker and host memory) over the
        copied parameters, from the constructor's arguments and a ``state_dict()`` (:func:`.checkpoint.pickled`)."""
        return checkpoint.pickled(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        checkpoint.unpickle(self, state)

    def __enter__(self) -> ZenFlowAdamW:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """Telemetry since construction (every key in docs/telemetry.md's table); time in seconds (ms where
        named), sizes in bytes."""
        return stats_of(self)

    # ------------------------------------------------------------------ the step

    def _offloads(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is (or, stepping first, will be) offloaded (:func:`.params.offloads`)."""
        return p in self._pipeline.records or offloads(p, self.config.min_offload_numel)

    def _prepare_step(
        self,
    ) -> tuple[list[tuple[AdamHyperparams, list[torch.Tensor]]], list[tuple[AdamHyperparams, torch.Tensor]]]:
        """Validate hyperparameters and every gradient (before anything changes), create state for parameters
        stepping for the first time (all or nothing: out of memory keeps none, and a later step retries), and
        return the parameters that step now: resident ones per group, offloaded ones with their group's record."""
        resident, offloaded, fresh, fresh_resident, device = gather_step(
            self.param_groups, self.state, decoupled=self._decoupled, offloads=self._offloads,
            captured=self._capture.has)
        if device is not None:
            self._device = device  # the parameters' device now (built over meta parameters, then materialized)
        new_state = {p: init_resident(p) for p in fresh_resident}
        if fresh:
            self._pipeline.add(fresh, self.state)
        self.state.update(new_state)
        if fresh_resident:
            warn_kept_resident(fresh_resident, self.config.min_offload_numel)
        return resident, offloaded

    def _offloaded_step(self, offloaded: list[tuple[AdamHyperparams, torch.Tensor]]) -> None:
        """DESIGN §3 at the schedule's step ``t``: warm-up, or steps 1-5 after it, for the offloaded parameters with
        a gradient; at a window end also for those whose window holds gradients of earlier steps only.

        The device work is batched: one selection for all parameters (:func:`.columns.reselect_many_`), one grouped
        fused-step launch. A sharded parameter (FSDP2) steps on its local rows; its column scores are summed over its
        shard group every step (one bucketed all-reduce), so every rank holds and selects what one process would."""
        pipeline, knobs = self._pipeline, self._knobs
        records = pipeline.records
        device = offloaded[0][1].device if offloaded else self._device
        ops = pipeline.device_ops(device)
        warmup = knobs.warmup
        tau = self._schedule.step - warmup
        if not knobs.ready and tau >= 1:  # "auto" knobs are planned after warm-up, from its measured step time
            knobs.resolve(offloaded_shapes=[(rec.rows, rec.cols) for rec in records.values()],
                          param_dtype=next(iter(records)).dtype, device=self._device or torch.device("cpu"),
                          accumulate=pipeline.accumulate or "device")
            self._stats.mark_plan()
        cfg = knobs.resolved
        interval, select = cfg.update_interval, cfg.select_interval
        selecting = tau >= 1 and (tau - 1) % select == 0
        window_end = tau <= 0 or tau % interval == 0
        sync = not self.config.overlap or tau <= 0
        # With topk_ratio=0 no column is ever selected, so nothing would read the scores: skip them.
        scores = cfg.topk_ratio != 0
        if selecting:
            # Step 2: a selection step first makes all host work of earlier windows visible.
            pipeline.wait(self.state, merge=True)
        unique: dict[torch.Tensor, tuple[AdamHyperparams, torch.Tensor, torch.Tensor | None]] = {}
        capture = self._capture  # a gradient captured in backward has no .grad: g2 None (capture.py)
        for hp, p in offloaded:
            if p not in unique:
                rec = records[p]
                unique[p] = (hp, local(p).view(rec.rows, rec.cols),
                             None if capture.has(p) else local(p.grad).view(rec.rows, rec.cols))
        # Where this step's column scores go: into the score itself, or, for a sharded parameter, into a zeroed
        # buffer that is summed over the shard group before it is added (the scores stay the same on every rank).
        shared = [(records[p].group, records[p].score_delta().zero_(), self.state[p]["score"])
                  for p in unique if scores and records[p].group is not None]

        def score_of(p: torch.Tensor) -> torch.Tensor:
            rec = records[p]
            return rec.score_delta() if rec.group is not None else self.state[p]["score"]

        if selecting:
            # Steps 1-2 for every parameter with a gradient: this step's scores count toward the selection.
            if scores:
                for p, (_, _, g2) in unique.items():
                    if g2 is None:
                        capture.add_score_(p, score_of(p))
                    elif records[p].rows:
                        ops.column_sumsq_(score_of(p), g2)
                add_summed_scores_(shared)
            if unique:
                picks = reselect_many_([(self.state[p], records[p].masks, cfg.topk(records[p].cols)) for p in unique])
                self._stats.record_selection(picks, measured=scores)
        windows: dict[torch.Tensor, Window] = {}
        calls: list[FusedStepArgs] = []
        landed: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # accumulate="host": gradients for the host sum
        stepped: set[torch.Tensor] = set()
        for hp, p in offloaded:
            st, rec = self.state[p], records[p]
            _, w2, g2 = unique[p]
            if p in stepped:
                # A parameter listed twice (torch allows it, with a warning) steps twice: its first step must have
                # run before the second reads what it wrote.
                ops.fused_steps_(calls)
                calls = []
            pipeline.begin_step(p, st)
            st["step"] += 1
            # A selection step already counted this step's scores (not again for a duplicate's second step).
            update_score = scores and not (selecting and p not in stepped)
            stepped.add(p)
            if not rec.rows:  # an empty shard: nothing to update here, but the schedule and the collectives go on
                continue
            if window_end and g2 is not None and pipeline.takes_gradient(p, st, waited=sync):
                # A window of this step alone, applied before step() returns: the host reads this gradient.
                if update_score:
                    ops.column_sumsq_(score_of(p), g2)
                if p in windows:  # listed twice: its first window is applied before the second reads the parameter
                    pipeline.end_windows([windows.pop(p)], self.state, sync=True, cpu_threads=cfg.cpu_threads,
                                         lr_scale=cfg.host_lr_scale if tau >= 1 else 1.0)
                windows[p] = Window(p, hp, grad=g2.detach())
                continue
            # Steps 1, 3 and 4 in one pass: scores, AdamW on the selected columns (their step counts incremented
            # in the same pass), the rest summed into acc (with accumulate="host", step 4 is the host's: the
            # gradient lands there after the kernels).
            count_step = tau >= 1 and rec.masks.num_unselected < rec.cols
            if g2 is None:  # captured in backward: the fused step on the compact gradient; the slot has landed
                calls += capture.step_args(p, st, rec, w2=w2, hp=hp, score=score_of(p) if update_score else None,
                                           count_step=count_step)
            else:
                acc, accumulate = pipeline.step_sum(st)
                calls.append(FusedStepArgs(
                    param=w2, grad=g2, score=score_of(p), slot=st["slot"], col_step=st["col_step"],
                    master=st["master"], exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"], acc=acc, hp=hp,
                    accumulate=accumulate, update_score=update_score, count_step=count_step,
                ))
            if pipeline.host_sums:
                landed.append((p, g2, st["acc_count"] > 0))
            st["acc_count"] += 1
        if calls:
            ops.fused_steps_(calls)
        capture.finish_step()
        if landed:
            pipeline.land(landed, self.state, cpu_threads=cfg.cpu_threads)
        if not selecting:
            add_summed_scores_(shared)
        if window_end:
            # Step 5 (warm-up: every element, synchronously): the host applies each window's mean gradient to the
            # unselected columns, also for parameters whose window holds gradients of earlier steps only.
            hp_of = hp_lookup(self.param_groups, unique, decoupled=self._decoupled)
            for w in pipeline.open_windows(self.state, hp_of, skip=windows):
                windows[w.param] = w
        if windows:
            pipeline.end_windows(list(windows.values()), self.state, sync=sync, cpu_threads=cfg.cpu_threads,
                                 lr_scale=cfg.host_lr_scale if tau >= 1 else 1.0)
        elif cfg.merge_due(tau):  # overlap_steps < U: the last window's result is merged now, not at the next end
            pipeline.wait(self.state, merge=True)


class ZenFlowAdam(ZenFlowAdamW):
    """Adam with L2-coupled weight decay (``torch.optim.Adam``'s ``weight_decay``), with ZenFlow offloading."""

    _decoupled = False
