"""grads_in_backward (DESIGN §3, §5): the offloaded parameters' gradients consumed while backward runs.

A ``register_post_accumulate_grad_hook`` on each offloaded parameter takes its gradient as soon as autograd has
accumulated it and sets ``p.grad`` to None, so the model's full gradient never exists on the device (one parameter's
at a time). The hook (:meth:`GradientCapture.capture`)

- adds the gradient's column sums of squares (``ops.column_sumsq_``, the function the step path uses) into a
  per-step fp32 ``[C]`` buffer, added to the scores at ``step()``;
- gathers the selected columns into a compact ``[R, k]`` device buffer in the parameter's dtype;
- lands the whole gradient in its pinned host capture slot of accumulate="host" (on CUDA a non-blocking copy on
  the device-to-host stream; on CPU tensors a copy), once the last step's add has read the slot;

and a second ``backward()`` before ``step()`` adds into all three in the parameter's dtype, which rounds exactly as
``.grad``'s accumulation does (on CUDA its host add waits for the copy in the training thread). Nothing captured
enters the window sum before ``step()``: ``zero_grad()`` discards a capture as it would ``.grad``.

A hook that fires twice in one backward (a layer shared by reentrant checkpoints: each recomputation runs a backward
of its own) sums the same way, but the sum of the calls' column sums of squares is not the summed gradient's: such a
parameter is scored on its whole gradient so far (the slot) when the outermost backward ends (autograd's final
callback, followed out of each nested backward), so one backward per step scores as the default mode, bit for bit.

At ``step()`` a captured parameter steps through :meth:`GradientCapture.step_args`: the backend's own fused step on
the compact gradient (slot map the identity, scores added before), its result scattered into the parameter's
selected columns, so the update is the default mode's bit for bit; the landed slot goes to the adder as it is. A
selection step migrates the compact gradient to the new selection (staying columns from the old compact buffer,
joining ones from the host slot, which holds the whole gradient).

Every backward is captured, the first one included: its hook makes the offloaded state (as the first ``step()``
would), so the model's full gradient never exists on the device, not even at the first step. A warm-up step's
gradient then reaches the host through the window sum, and the first selection's compact gradient is gathered from
the host slot after it (an empty selection migrating to the first one). The hook passes through (``.grad`` stays,
the ordinary path) only once the optimizer is closed or failed. The hooks follow the model: a weight frozen when its
group was added is hooked too (captured once unfrozen), and a parameter whose tensor was swapped in place
(``to_empty``/``to()`` with ``torch.__future__.set_swap_module_params_on_conversion(True)``) is hooked again at the
next ``zero_grad()`` or ``step()``; an offloaded gradient found in ``.grad`` all the same is named in one warning.
One process only: in a job of several (DDP) the hook would consume the local gradient before its all-reduce, so that
is refused, as are DTensor (FSDP2) parameters. AMP's GradScaler is refused at its first ``step()``: its scale update
reads only the inf checks it made on ``.grad`` (``_step_supports_amp_scaling`` hands the optimizer the scale, never a
way back), so an overflow in a captured gradient could skip the step but never lower the scale, and every later step
would overflow and be skipped (bf16 autocast needs no scaler).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .kernels import AdamHyperparams, FusedStepArgs
from .params import check_grad, describe, offloads
from .sharding import is_sharded

__all__ = ["Captured", "GradientCapture", "Selection"]

logger = logging.getLogger("zenflow_triton")


@dataclass(eq=False)
class Selection:
    """A parameter's selection as the capture reads it; rebuilt whenever ``state["slot"]`` is a new tensor (after
    a selection step, a load, a state mover)."""

    slot: torch.Tensor  # the state["slot"] it was built from
    host_map: torch.Tensor  # CPU int32 [C]: its slot map (a copy: the masks are refreshed in place)
    idx: torch.Tensor  # device int64 [k]: the selected columns, increasing (the compact state's order)
    ident: torch.Tensor  # device int32 [k]: 0..k-1, the compact fused step's slot map
    no_score: torch.Tensor  # device fp32 [k]: the compact fused step's score argument (update_score=False)


@dataclass(eq=False)
class Captured:
    """One parameter's gradient captured since the last ``step()`` (``count`` backward() calls)."""

    step_score: torch.Tensor  # device fp32 [C]: this step's column sums of squares
    compact: torch.Tensor  # device [R, k] in the parameter's dtype: the selected columns (``selection``'s)
    host: torch.Tensor  # host [R, C] in the parameter's dtype: the whole gradient, in this step's landing slot
    selection: Selection
    count: int = 1
    ready: torch.cuda.Event | None = None  # CUDA: after the last copy into ``host``
    # The hook fired twice in one backward (a layer shared by reentrant checkpoints): scored on the whole gradient
    # (``host``) at the end of each backward (:meth:`GradientCapture._rescore`), not per call.
    rescore: bool = False


def check_capturable(p: torch.Tensor, where: str, *, grad_dtype: str, seen: set[int]) -> None:
    """``ValueError`` for an offloaded parameter that grads_in_backward cannot capture (named by ``where``)."""
    if p.dtype == torch.float16:
        raise ValueError(f"grads_in_backward=True: {where} is float16; AMP's GradScaler needs the gradients in "
                         ".grad to unscale them, which the capture removes. Train in bfloat16 (no scaler needed), or "
                         "set grads_in_backward=False")
    if is_sharded(p):
        raise ValueError(f"grads_in_backward=True: {where} is a DTensor (FSDP2); capturing sharded gradients is not "
                         "supported: set grads_in_backward=False")
    if grad_dtype == "bfloat16" and p.dtype == torch.float32:
        raise ValueError(f"grads_in_backward=True: {where} is float32 with grad_dtype='bfloat16': micro-batches "
                         "would sum in bf16 on the host, not as .grad sums them; use grad_dtype='float32'")
    if id(p) in seen:
        raise ValueError(f"grads_in_backward=True: {where} is listed twice; list each parameter once")
    seen.add(id(p))


def check_single_process() -> None:
    """``RuntimeError`` in a multi-process job: the hook would take each rank's local gradient before DDP's (or any)
    all-reduce of ``.grad``, which then finds None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("grads_in_backward=True in a job of several processes: the hooks would consume each "
                           "rank's local gradient before its all-reduce (DDP's, or yours on .grad); it is supported in "
                           "one process only: set grads_in_backward=False")


class GradientCapture:
    """The hooks and captured gradients of one optimizer (``optimizer.config.grads_in_backward``; without it a
    shell that captures nothing). It reads the optimizer's state, pipeline, schedule and knobs through a weak
    reference, and the hooks reach it through one: neither keeps the other alive."""

    def __init__(self, optimizer: Any) -> None:
        self._opt = weakref.ref(optimizer)
        self.enabled = bool(optimizer.config.grads_in_backward)
        if self.enabled:
            # GradScaler.step then hands the optimizer its scale and inf flag (``grad_scale``/``found_inf``) instead
            # of stepping it behind our back: that is how step() sees a scaler and refuses it (:meth:`before_step`).
            optimizer._step_supports_amp_scaling = True
        self.captured: dict[torch.Tensor, Captured] = {}
        self._hooks: dict[torch.Tensor, Any] = {}
        self._impls: dict[torch.Tensor, int] = {}  # each hooked parameter's TensorImpl when its hook was set
        self._fired: set[torch.Tensor] = set()  # captured in the backward running now (or the last one)
        self._watched: set[int] = set()  # autograd graph tasks whose end is watched (:meth:`_watch_backward`)
        self._warned_uncaptured = False
        self.last_captured = 0  # stats(): offloaded gradients captured for the last step()
        self._selections: dict[torch.Tensor, Selection] = {}
        self._scores: dict[torch.Tensor, torch.Tensor] = {}
        self._scratch: torch.Tensor | None = None  # CUDA: pinned host buffer for a later micro-batch's copy
        self._scatters: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    # ------------------------------------------------------------------ hooks

    def check(self, params: Iterable[Any]) -> None:
        """Before a group is added (named ``(name, tensor)`` pairs allowed): ``ValueError`` for a parameter the
        capture cannot take (:func:`check_capturable`)."""
        if not self.enabled:
            return
        config = self._opt().config
        check_single_process()
        seen = {id(p) for p in self._hooks}
        for i, p in enumerate(p[1] if isinstance(p, tuple) else p for p in params):
            if offloads(p, config.min_offload_numel):  # resident ones keep an ordinary .grad
                check_capturable(p, f"parameter {i} of the group (shape {tuple(p.shape)})",
                                 grad_dtype=config.grad_dtype, seen=seen)

    def register(self, params: Iterable[Any]) -> None:
        """Hook the offloaded parameters of a group just added (:meth:`check` passed)."""
        if not self.enabled:
            return
        config = self._opt().config
        plain = [p[1] if isinstance(p, tuple) else p for p in params]
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            capture = ref()
            if capture is not None:
                capture.capture(p)

        for p in plain:
            if not offloads(p, config.min_offload_numel):
                continue
            # A frozen weight is hooked too (torch refuses a hook on a tensor that does not require grad, so its flag
            # is raised for the registration only): unfrozen later, its gradient is captured from the first backward.
            frozen = not p.requires_grad
            if frozen:
                p.requires_grad_(True)
            try:
                self._hooks[p] = p.register_post_accumulate_grad_hook(hook)
            finally:
                if frozen:
                    p.requires_grad_(False)
            self._impls[p] = p._cdata

    def follow(self) -> list[torch.Tensor]:
        """At ``zero_grad()`` and ``step()``: hook again each parameter whose tensor was replaced in place since its
        hook was set (``torch.utils.swap_tensors``: ``to_empty``/``to()`` with
        ``torch.__future__.set_swap_module_params_on_conversion(True)``), which leaves the hooks on the tensor that
        was swapped out; returns those parameters. (``p.data = ...`` keeps the tensor, and its hooks.)"""
        moved = [p for p, impl in self._impls.items() if p._cdata != impl]
        for p in moved:
            # The hook table stays with the parameter object but torch registers it with the tensor it held then:
            # setting it again registers it with the tensor held now (and revives any hook of the user's in it, which
            # the swap had silenced as well).
            p._post_accumulate_grad_hooks = p._post_accumulate_grad_hooks
            self._impls[p] = p._cdata
        return moved

    def before_step(self, opt: Any) -> None:
        """Start of ``step()`` (``opt``: the object it was called on), before anything changes: refuse AMP's
        GradScaler; re-hook replaced tensors (:meth:`follow`); warn once naming offloaded parameters whose gradient
        reached ``.grad`` though they are hooked."""
        if not self.enabled:
            return
        if hasattr(opt, "found_inf"):
            # Set by GradScaler.step for this call only; it deletes them after step() returns, not when it raises.
            for name in ("found_inf", "grad_scale"):
                if name in vars(opt):
                    delattr(opt, name)
            raise RuntimeError(
                "grads_in_backward=True with AMP's GradScaler (scaler.step(optimizer)): the scaler unscales the "
                "gradients in .grad and looks there for inf/NaN to skip a step and lower its scale, but the hooks have "
                "already taken the offloaded gradients out of .grad, so they would step still scaled and an overflow "
                "in them would go unseen. Use bf16 autocast without a GradScaler (torch.autocast(device_type, "
                "dtype=torch.bfloat16); fp32 weights keep full precision and bf16 needs no loss scaling), or set "
                "grads_in_backward=False to keep fp16 autocast with the scaler")
        if self._fired:  # the end of the last backward went unseen (it raised?): its rescoring is done now
            self._backward_ended()
        moved = set(self.follow())
        if moved:
            logger.info("zenflow_triton: grads_in_backward: hooked again %d parameter(s) whose tensors were "
                        "replaced in place (to_empty/to() with swapped module params)", len(moved))
        missed = [p for p in self._hooks if p.grad is not None and p not in moved]
        if missed and not self._warned_uncaptured:
            self._warned_uncaptured = True
            groups = opt.param_groups
            names = ", ".join(describe(p, groups) for p in missed[:8]) + (", ..." if len(missed) > 8 else "")
            logger.warning("zenflow_triton: grads_in_backward=True, but %d offloaded gradient(s) were left in .grad "
                           "(their hooks did not capture them; the full gradient was held on the device): %s. "
                           "stats()['captured_last_step'] counts the captured ones", len(missed), names)

    def close(self) -> None:
        """Remove every hook (``close()``): later backward() calls leave ``.grad`` as torch does."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._impls.clear()
        self._fired.clear()
        self.captured.clear()
        self._selections.clear()
        self._scores.clear()
        self._scratch = None

    def discard(self) -> None:
        """``zero_grad()``: forget what was captured since the last step (the buffers are overwritten next time), and
        hook again what a tensor swap unhooked (:meth:`follow`), before the next backward."""
        self.captured.clear()
        self._fired.clear()
        if self.enabled:
            self.follow()

    def has(self, p: torch.Tensor) -> bool:
        return p in self.captured

    def check_none_pending(self, call: str) -> None:
        """``RuntimeError`` when a gradient was captured since the last step (``call`` would replace the state it
        was split by)."""
        if self.captured:
            raise RuntimeError(f"{call} between backward() and step() with grads_in_backward=True: the captured "
                               "gradients belong to the state being replaced; call step() or zero_grad() first")

    # ------------------------------------------------------------------ the hook's body

    def capture(self, p: torch.Tensor) -> None:
        opt = self._opt()
        if opt is None:
            return
        pipeline, knobs = opt._pipeline, opt._knobs
        g = p.grad
        if g is None or pipeline.closed or pipeline.failure is not None or p.is_meta:
            return
        if p not in pipeline.records and not opt.state.get(p):
            # The first backward: the offloaded state is made now, for every hooked parameter at once (one slab),
            # as the first step() would make it (nothing of it depends on the gradient), so that the first step's
            # gradient is captured too: the full gradient never exists, not even once.
            self._make_state(opt, pipeline)
        rec = pipeline.records.get(p)
        st = opt.state.get(p) if rec is not None else None
        if not st:
            return
        try:
            check_grad(p, g, offloaded=True)
        except RuntimeError as exc:
            raise RuntimeError(f"grads_in_backward: {describe(p, opt.param_groups)}: {exc}") from None
        ops = pipeline.device_ops(p.device)
        rows, cols = rec.rows, rec.cols
        g2 = g.view(rows, cols)
        scores = knobs.resolved.topk_ratio != 0
        cap = self.captured.get(p)
        self._watch_backward()
        if cap is not None and p in self._fired:
            # A second call in one backward (reentrant checkpoints sharing a layer: each recomputation runs a backward
            # of its own): the scores are the summed gradient's, taken from the slot when this backward ends.
            cap.rescore = True
        self._fired.add(p)
        if cap is None:
            sel = self._selection(p, st, rec)
            host = pipeline.capture_slot(p).view(rows, cols)
            score = self._scores.get(p)
            if score is None:
                score = self._scores[p] = torch.zeros(cols, dtype=torch.float32, device=p.device)
            cap = Captured(step_score=score, compact=g2.index_select(1, sel.idx), host=host, selection=sel)
            if scores:
                score.zero_()
                ops.column_sumsq_(score, g2)
            if p.device.type == "cuda":
                cap.ready = self._copy_out(pipeline, g, host, g2)
            else:
                host.copy_(g2)
            self.captured[p] = cap
        else:
            # Summed in the parameter's dtype, as autograd sums .grad over backward() calls.
            cap.compact.add_(g2.index_select(1, cap.selection.idx))
            if scores and not cap.rescore:
                ops.column_sumsq_(cap.step_score, g2)
            if p.device.type == "cuda":
                numel = g2.numel()
                if self._scratch is None or self._scratch.numel() < numel or self._scratch.dtype != g.dtype:
                    self._scratch = torch.empty(numel, dtype=g.dtype, pin_memory=True)
                scratch = self._scratch[:numel].view(rows, cols)
                # Backward (this hook, on autograd's device thread) waits for this copy and the earlier ones into
                # the slot (same stream) to add on the host: a later micro-batch costs its gradient's device-to-host
                # time inside backward. The scratch is reused only after that wait.
                self._copy_out(pipeline, g, scratch, g2).synchronize()
                cap.host.add_(scratch)
            else:
                cap.host.add_(g2)
            cap.count += 1
        p.grad = None

    def _make_state(self, opt: Any, pipeline: Any) -> None:
        check_single_process()  # the process group may have been made after the optimizer
        # Frozen ones get their state when they first have a gradient, as at step(); an optimizer built over meta
        # parameters is on the device they were materialized on.
        device = opt._device if opt._device is not None and opt._device.type != "meta" else None
        fresh = [q for q in self._hooks if q not in pipeline.records and not opt.state.get(q) and not q.is_meta
                 and q.requires_grad]
        fresh = [q for q in fresh if q.device == (device or fresh[0].device)]
        if fresh:
            opt._device = fresh[0].device
            pipeline.add(fresh, opt.state)

    def _watch_backward(self) -> None:
        """Have :meth:`_backward_ended` run when the backward running this hook is over (once per autograd graph
        task). A reentrant checkpoint's recomputation runs a backward of its own inside a node of the outer one: its
        end is followed to the end of the outer one (:func:`_task_ended`)."""
        task = torch._C._current_graph_task_id()
        if task < 0 or task in self._watched:  # < 0: not inside a backward (the hook's body called directly)
            return
        self._watched.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_task_ended, weakref.ref(self),
                                                                                   task))

    def _backward_ended(self) -> None:
        """The outermost backward is over: score the gradients it captured more than once on their sums."""
        for p in self._fired:
            cap = self.captured.get(p)
            if cap is not None and cap.rescore:
                self._rescore(p, cap)
        self._fired.clear()

    def _rescore(self, p: torch.Tensor, cap: Captured) -> None:
        """This step's scores of ``p`` from its whole gradient so far (the slot holds it, summed in the parameter's
        dtype as .grad sums it), by the function and on the device the default mode scores ``.grad`` with: with one
        backward per step bit for bit its scores. One parameter's gradient at a time on the device."""
        opt = self._opt()
        if opt is None or opt._knobs.resolved.topk_ratio == 0:
            return
        whole = cap.host
        if p.device.type == "cuda":
            if cap.ready is not None:
                # The first call's copy into the slot (on the device-to-host stream) must have landed; the later
                # calls' adds were made on the host after waiting for their copies.
                cap.ready.synchronize()
            # A blocking copy: step() may scale the slot in place (clipping) while a queued copy still reads it.
            whole = cap.host.to(p.device)
        cap.step_score.zero_()
        opt._pipeline.device_ops(p.device).column_sumsq_(cap.step_score, whole)

    def _copy_out(self, pipeline: Any, g: torch.Tensor, dst: torch.Tensor, g2: torch.Tensor) -> torch.cuda.Event:
        """CUDA: ``dst`` (pinned host) = ``g2`` on the device-to-host stream after the compute stream's work so far;
        the event marks its end."""
        device = g.device
        stream = pipeline.copy_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            if pipeline.test_delays.get("d2h"):  # tests only: a missing wait on this copy shows as wrong numbers
                torch.cuda._sleep(pipeline.test_delays["d2h"])
            dst.copy_(g2, non_blocking=True)
            # The gradient is set to None next: its memory must not be handed out before this stream read it.
            g.record_stream(stream)
            ready = torch.cuda.Event(blocking=True)
            ready.record(stream)
        return ready

    def _selection(self, p: torch.Tensor, st: dict[str, Any], rec: Any) -> Selection:
        sel = self._selections.get(p)
        if sel is None or sel.slot is not st["slot"]:
            host_map = rec.masks.host_slot.clone()
            dev = st["slot"].device
            idx = torch.nonzero(host_map >= 0).squeeze(1).to(dev)
            k = idx.numel()
            sel = self._selections[p] = Selection(
                slot=st["slot"], host_map=host_map, idx=idx,
                ident=torch.arange(k, dtype=torch.int32, device=dev),
                no_score=torch.zeros(k, dtype=torch.float32, device=dev))
        return sel

    # ------------------------------------------------------------------ step()

    def add_score_(self, p: torch.Tensor, score: torch.Tensor) -> None:
        """This step's column scores into ``score`` (``score += step_score``: the bits of ``column_sumsq_(score, g)``
        with one backward per step)."""
        score.add_(self.captured[p].step_score)

    def step_args(self, p: torch.Tensor, st: dict[str, Any], rec: Any, *, w2: torch.Tensor, hp: AdamHyperparams,
                  score: torch.Tensor | None, count_step: bool) -> list[FusedStepArgs]:
        """The fused step of a captured parameter on its compact gradient (none when nothing is selected); its
        result reaches the parameter and ``col_step`` at :meth:`finish_step`. ``score``: where this step's scores
        go (None: nowhere, a selection step already added them)."""
        cap = self.captured[p]
        if score is not None:
            score.add_(cap.step_score)
        sel = self._selection(p, st, rec)
        compact = cap.compact if cap.selection is sel else self._migrate(cap, sel, rec)
        if sel.idx.numel() == 0:
            return []
        out = torch.empty_like(compact)
        col_step = st["col_step"].index_select(0, sel.idx)
        self._scatters.append((w2, out, st["col_step"], col_step, sel.idx))
        return [FusedStepArgs(param=out, grad=compact, score=sel.no_score, slot=sel.ident, col_step=col_step,
                              master=st["master"], exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"], acc=None,
                              hp=hp, accumulate=False, update_score=False, count_step=count_step)]

    def finish_step(self) -> None:
        """After the fused steps: the compact results into the parameters' selected columns and step counts; every
        capture is consumed (the landed slots go to the adder)."""
        for w2, out, col_step, counted, idx in self._scatters:
            w2.index_copy_(1, idx, out)
            col_step.index_copy_(0, idx, counted)
        self._scatters.clear()
        self.last_captured = len(self.captured)
        self.captured.clear()
        self._fired.clear()

    def _migrate(self, cap: Captured, sel: Selection, rec: Any) -> torch.Tensor:
        """The compact gradient for the new selection ``sel``: staying columns from the old compact buffer, joining
        ones from the host slot (the whole gradient; its copies must have landed)."""
        old, new = cap.selection.host_map, sel.host_map
        dev = cap.compact.device
        out = torch.empty((rec.rows, sel.idx.numel()), dtype=cap.compact.dtype, device=dev)
        staying = torch.nonzero((old >= 0) & (new >= 0)).squeeze(1)
        joining = torch.nonzero((old < 0) & (new >= 0)).squeeze(1)
        if staying.numel():
            out[:, new[staying].long().to(dev)] = cap.compact.index_select(1, old[staying].long().to(dev))
        if joining.numel():
            if cap.ready is not None:
                cap.ready.synchronize()
            out[:, new[joining].long().to(dev)] = cap.host.index_select(1, joining).to(dev)
        return out

    # ------------------------------------------------------------------ clipping, telemetry

    def whole_gradient(self, p: torch.Tensor) -> torch.Tensor:
        """A captured parameter's whole gradient, on the host (for the clipping norm): the landing slot, once its
        copies have landed (on CUDA step() waits for them here)."""
        cap = self.captured[p]
        if cap.ready is not None:
            cap.ready.synchronize()
        return cap.host

    def scale_(self, p: torch.Tensor, coef: torch.Tensor) -> None:
        """Clipping: scale a captured gradient as ``grad.mul_(coef)`` would (compact part on the device, the slot on
        the host in the training thread); its scores by ``coef**2`` (the clipped gradient's, to rounding)."""
        cap = self.captured[p]
        cap.compact.mul_(coef.to(cap.compact.device))
        cap.host.mul_(coef.to(cap.host.device))
        cap.step_score.mul_((coef * coef).to(device=cap.step_score.device, dtype=torch.float32))

    def device_bytes(self, records: Any) -> int:
        """Device bytes of the capture per step, for ``device_bytes_per_param``: each offloaded parameter's compact
        selected gradient (counted whether or not a backward holds one now), its score buffer and selection
        indices."""
        if not self.enabled:
            return 0
        total = 0
        for p, rec in records.items():
            k = rec.cols - rec.masks.num_unselected
            total += rec.rows * k * p.element_size() + 4 * rec.cols + 16 * k
        return total


def _task_ended(ref: weakref.ref, task: int) -> None:
    """Autograd's callback at the end of graph task ``task`` (:meth:`GradientCapture._watch_backward`). Inside the
    outermost backward no node is being evaluated; inside a reentrant recomputation the node of the outer backward
    that runs it is: a hook on that node, run once it returns (in the outer task), watches the outer task."""
    capture = ref()
    if capture is None:
        return
    capture._watched.discard(task)
    node = torch._C._current_autograd_node()
    if node is None:
        capture._backward_ended()
        return
    handle = None

    def outer(grad_inputs: Any, grad_outputs: Any) -> None:
        handle.remove()
        capture = ref()
        if capture is not None:
            capture._watch_backward()

    handle = node.register_hook(outer)
