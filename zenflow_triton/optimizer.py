"""ZenFlowAdamW / ZenFlowAdam: drop-in ``torch.optim`` optimizers with ZenFlow offloading (DESIGN §2-§5).

Offloaded parameters (ndim >= 2, numel >= min_offload_numel) keep fp32 master weights and Adam moments in
host memory. Each step the top-k columns by accumulated gradient norm are updated on the device; the
other columns' gradients are summed on the device and applied by the host worker once per window of
``update_interval`` steps, asynchronously when ``overlap=True``. Every other parameter gets plain AdamW
on its device, as ``torch.optim.AdamW`` would do.

This module is the ``torch.optim`` shell and the schedule of DESIGN §3 (:meth:`ZenFlowAdamW._offloaded_step`). The
rest is in rooms of its own: :mod:`.pipeline` (host windows: worker, copies, merge), :mod:`.state` (the state's
layout), :mod:`.columns` (selection and migration), :mod:`.auto` ("auto" knobs) and the kernels behind
:class:`~zenflow_triton.kernels.DeviceOps`.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import checkpoint
from .auto import AUTO_WARMUP_STEPS, Knobs
from .columns import is_offloaded, reselect_
from .config import ZenFlowConfig
from .kernels import MODEL_DTYPES, AdamHyperparams, load_device_ops, reference
from .pipeline import Pipeline, Stats, Window
from .state import init_resident, load_resident

__all__ = ["ZenFlowAdamW", "ZenFlowAdam", "AUTO_WARMUP_STEPS"]

logger = logging.getLogger("zenflow_triton")

# torch.optim.AdamW's per-group options beyond the hyperparameters, with the one value each may take here. foreach
# and fused choose torch's implementation, not the math, so any value is accepted (and ignored) for them.
_REFUSED_OPTIONS = {
    "amsgrad": (False, "amsgrad=True is not supported (ZenFlow keeps no max of exp_avg_sq)"),
    "maximize": (False, "maximize=True is not supported; minimize the negated objective"),
    "capturable": (False, "capturable=True is not supported (the host half of a step cannot be graph-captured)"),
    "differentiable": (False, "differentiable=True is not supported"),
}


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
        update_interval: steps per host window (U), or "auto".
        select_interval: steps between reselections (a multiple of U); None means 8 windows.
        warmup_steps: steps of synchronous AdamW on every element before selection starts.
        overlap: apply each window's host result one window late instead of waiting for it.
        min_offload_numel: smallest parameter (ndim >= 2) that is offloaded.
        cpu_threads: numba threads of the host worker (None: all cores but one, and every core for a window that
            step() waits for anyway: warm-up steps and ``overlap=False``).
        backend: "triton", "numba" (CPU tensors), "torch" or "auto" (triton on CUDA, numba on CPU).
        grad_dtype: host gradient landing dtype, "float32" or "bfloat16" (halves device-to-host bytes).
        worker_timeout: seconds to wait for one host job before raising instead of hanging.

    Call ``flush()`` before evaluating or exporting weights when ``overlap=True``; ``state_dict()`` never
    changes the parameters, so a resumed run continues bit for bit. ``close()`` (or a ``with`` block)
    stops the worker; it also stops at interpreter exit.

    On CPU tensors (no GPU) "device" and host memory are one, and three copies are skipped: a one-step window
    that step() waits for (warm-up; ``update_interval=1, overlap=False`` with no selected column) reads the
    gradient in place and writes the parameter directly; ``acc`` and the landing buffer trade places at each
    window end; and with ``overlap=False`` an fp32 parameter is its own host master (``state["host_master"]``
    is a view of it, so ``load_state_dict()`` writes the saved master into the parameter). With
    ``topk_ratio=0`` no column scores are kept (nothing would read them).
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
        warmup_steps: int = 0,
        overlap: bool = True,
        min_offload_numel: int = 4096,
        cpu_threads: int | None = None,
        backend: str = "auto",
        grad_dtype: str = "float32",
        worker_timeout: float = 600.0,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        AdamHyperparams.from_group(defaults, decoupled=self._decoupled)
        self.config = ZenFlowConfig(
            topk_ratio=topk_ratio, update_interval=update_interval, select_interval=select_interval,
            warmup_steps=warmup_steps, overlap=overlap, min_offload_numel=min_offload_numel,
            cpu_threads=cpu_threads, backend=backend, grad_dtype=grad_dtype, worker_timeout=worker_timeout,
        )
        self._device: torch.device | None = None
        self._knobs = Knobs(self.config)
        self._stats = Stats()
        self._schedule = Schedule()
        self._pipeline = Pipeline(self.config, self._stats)
        super().__init__(params, defaults)
        if self._device is not None:
            # Fail here, not at the first step(), when the backend cannot run on the parameters' device.
            load_device_ops(self.config.backend, self._device)

    # ------------------------------------------------------------------ torch.optim surface

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        if isinstance(params, set):  # torch's error, before our checks iterate it
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                            "tensors in sets will change between runs. Please use a list instead.")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_options({**self.defaults, **param_group}, decoupled=self._decoupled)
        for i, p in enumerate(params):
            if isinstance(p, tuple) and len(p) == 2:  # named parameters: (name, tensor)
                p = p[1]
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameter {i} of the group is a {type(p).__name__}, not a torch.Tensor")
            if p.is_complex():
                raise ValueError(f"parameter {i} of shape {tuple(p.shape)} is complex ({p.dtype}); not supported")
            if self._device is None:
                self._device = p.device
            elif p.device != self._device:
                raise ValueError(
                    f"parameter {i} of shape {tuple(p.shape)} is on {p.device} but earlier parameters are on "
                    f"{self._device}; use one ZenFlowAdamW per device"
                )
        AdamHyperparams.from_group({**self.defaults, **param_group}, decoupled=self._decoupled)
        super().add_param_group(dict(param_group, params=params))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step, as ``torch.optim.AdamW.step``. A KeyboardInterrupt or SystemExit that arrives while
        it waits for the host is raised when the step is complete (see :meth:`.Pipeline.deferred_interrupts`)."""
        pipeline = self._pipeline
        pipeline.check_usable()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pipeline.raise_finished_job_error()
        entered = time.perf_counter()
        stall_before = self._stats.stall_s
        with pipeline.deferred_interrupts():
            pipeline.rehome(self.state)
            resident, offloaded = self._prepare_step()
            if not offloaded and not any(ps for _, ps in resident):
                return loss  # no gradient at all: nothing happens, as in torch (and the schedule does not advance)
            self._schedule.step += 1
            self._knobs.sample_step_time(entered, offloaded[0][1].device if offloaded else None)
            self._resident_step(resident)
            if pipeline.records:
                self._offloaded_step(offloaded)
            self._stats.steps += 1
            now = time.perf_counter()
            self._knobs.step_ended(now)
            self._stats.device_opt_s += now - entered - (self._stats.stall_s - stall_before)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """Like ``torch.optim.Optimizer.state_dict`` (its hooks run as there): waits for host work but never changes
        the parameters, so a run resumed from it continues bit for bit.

        The format (:mod:`.checkpoint`) depends on nothing but the parameters: an offloaded parameter's entry holds
        full-size CPU copies (``master``, ``exp_avg``, ``exp_avg_sq``, ``acc``) and per-column vectors; a resident
        one's is torch.optim.AdamW's, by reference as in torch (``copy.deepcopy`` the result to keep a snapshot). The
        entry ``"zenflow"`` (also in every param group, which torch.distributed.checkpoint keeps) holds the knobs
        ("auto" resolved), the schedule's step count and the format number.
        """
        self._pipeline.check_usable()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        with self._pipeline.deferred_interrupts():
            self._pipeline.rehome(self.state)
            self._pipeline.wait(self.state, merge=False)
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                index.setdefault(id(p), len(index))
            packed["params"] = [index[id(p)] for p in group["params"]]
            groups.append(packed)
        zenflow = {**self._knobs.state_dict(), "step": self._schedule.step, "format": checkpoint.FORMAT}
        for packed in groups:
            packed["zenflow"] = dict(zenflow)
        records = self._pipeline.records
        sd: dict[str, Any] = {
            "state": {index[id(p)]: (checkpoint.save_offloaded(p, st, records[p]) if p in records
                                     else checkpoint.save_resident(st))
                      for p, st in self.state.items()},
            "param_groups": groups,
            "zenflow": zenflow,
        }
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
        state_dict = state_dict.copy()  # shallow, as torch: a pre hook may edit it
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        with self._pipeline.deferred_interrupts():
            self._pipeline.wait(self.state, merge=False)
        zenflow, plan = self._check_loadable(state_dict)
        # Nothing below raises on a checked state_dict (short of running out of memory).
        if zenflow is not None:
            self._knobs.load_state_dict(zenflow)
            self._schedule.step = _saved_schedule_step(zenflow, plan)
        else:
            # torch.optim.AdamW's: the knobs stay this optimizer's and its schedule starts over (warm-up, then a
            # selection at the next step), while every column's bias correction continues from AdamW's count.
            self._schedule.step = 0
        for g, sg in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: copy.deepcopy(v) for k, v in sg.items() if k not in ("params", "zenflow")})
        self.state.clear()
        offloaded = []
        for p, saved, offloads in plan:
            if offloads:
                offloaded.append((p, saved))
            else:
                self.state[p] = load_resident(p, saved)
        self._pipeline.load(offloaded, self.state)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_loadable(
        self, state_dict: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any] | None, list[tuple[torch.Tensor, Mapping[str, Any], bool]]]:
        """Validate a state_dict against this optimizer: its "zenflow" entry (None for torch.optim.AdamW's), and
        (parameter, entry in the current format, offloaded) per state entry."""
        if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("not an optimizer state_dict (it needs 'state' and 'param_groups')")
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, optimizer has {len(groups)}")
        zenflow = state_dict.get("zenflow")
        if zenflow is None and saved_groups and isinstance(saved_groups[0], Mapping):
            zenflow = saved_groups[0].get("zenflow")  # torch.distributed.checkpoint keeps the groups, not extra keys
        adamw = zenflow is None
        if adamw and not all(checkpoint.is_adamw_entry(st) for st in state_dict["state"].values()):
            raise ValueError("this state_dict was saved neither by a ZenFlowAdamW (it has no 'zenflow' entry) nor by "
                             "torch.optim.AdamW (its entries are not step/exp_avg/exp_avg_sq)")
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"loaded state dict's group {i} has {len(sg['params'])} parameters, "
                    f"the optimizer's has {len(g['params'])}"
                )
            _check_options({**self.defaults, **sg}, decoupled=self._decoupled, where=f"loaded state dict's group {i}")
            AdamHyperparams.from_group({**self.defaults, **sg}, decoupled=self._decoupled)
        where_of = {}
        id_map = {}
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            for pi, (sid, p) in enumerate(zip(sg["params"], g["params"])):
                id_map[sid] = p
                where_of[sid] = f"parameter {pi} of group {gi} (shape {tuple(p.shape)})"
        fmt = None if adamw else zenflow.get("format", 1)
        if fmt not in (None, 1, checkpoint.FORMAT):
            raise ValueError(f"loaded state dict has checkpoint format {fmt!r}; this version reads formats 1 and "
                             f"{checkpoint.FORMAT}")
        plan = []
        for sid, saved in state_dict["state"].items():
            if sid not in id_map:
                raise ValueError(f"loaded state dict has state for parameter id {sid!r}, which no group lists")
            p, where = id_map[sid], where_of[sid]
            offloads = self._offloads(p)
            if adamw:
                checkpoint.check_resident(p, saved, where)
                entry = checkpoint.from_adamw(p, saved, offloaded=offloads)
            else:
                saved_offloaded = isinstance(saved, Mapping) and ("host_master" in saved or "selected" in saved)
                if offloads != saved_offloaded:
                    this = "offloads" if offloads else "keeps resident"
                    saved_as = "an offloaded" if saved_offloaded else "a resident"
                    raise ValueError(
                        f"{where}: this optimizer {this} it (min_offload_numel={self.config.min_offload_numel}) but "
                        f"the saved state is {saved_as} one: saved with another min_offload_numel?"
                    )
                if offloads:
                    entry = checkpoint.upgrade_v1(p, saved, where) if fmt == 1 else saved
                    checkpoint.check_offloaded(p, entry, where)
                else:
                    checkpoint.check_resident(p, saved, where)
                    entry = saved
            plan.append((p, entry, offloads))
        if zenflow is not None:
            trial = copy.copy(self._knobs)
            trial.load_state_dict(zenflow)  # raises on invalid knobs, changing nothing here
            step = zenflow.get("step")
            if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
                raise ValueError(f"loaded state dict's 'zenflow' step is {step!r}, expected an int >= 0")
        return zenflow, plan

    def adamw_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as a ``torch.optim.AdamW`` state_dict (``torch.optim.Adam``'s for
        :class:`ZenFlowAdam`), to finish a run without offloading: ``flush()`` first (every gradient is then in the
        parameters, which are AdamW's master), then each parameter's moments on its device in its dtype, with the
        parameter's own step count (see :func:`.checkpoint.to_adamw` for what per-column counts become). Load it
        into an AdamW built over the same parameters in the same groups."""
        self.flush()
        sd = self.state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        index: dict[int, int] = {}
        for p in params:
            index.setdefault(id(p), len(index))
        by_index = {index[id(p)]: p for p in params}
        groups = [{k: v for k, v in g.items() if k != "zenflow"} for g in sd["param_groups"]]
        return {"state": {i: checkpoint.to_adamw(by_index[i], entry) for i, entry in sd["state"].items()},
                "param_groups": groups}

    def flush(self) -> None:
        """Apply every gradient given to ``step()`` so far to the parameters (before evaluation or export): ends the
        open window early, with the mean of the gradients it holds, and waits for all host work. Training continues
        correctly afterwards; the next window ends at the schedule's next window end."""
        pipeline = self._pipeline
        pipeline.check_usable()
        with pipeline.deferred_interrupts():
            pipeline.rehome(self.state)
            windows = []
            groups = self._group_of_params()
            for p, rec in pipeline.records.items():
                st = self.state[p]
                if st["acc_count"] == 0:
                    continue
                if rec.masks.num_unselected:
                    windows.append(Window(p, AdamHyperparams.from_group(groups[p], decoupled=self._decoupled)))
                else:
                    st["acc_count"] = 0
            if windows:
                pipeline.end_windows(windows, self.state, sync=True, cpu_threads=self._knobs.resolved.cpu_threads)
            else:
                pipeline.wait(self.state, merge=True)

    def close(self) -> None:
        """Stop the host worker and release host buffers. The optimizer cannot step afterwards."""
        with self._pipeline.deferred_interrupts():
            if not self._pipeline.closed:
                self._pipeline.rehome(self.state)
            self._pipeline.close(self.state)

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickle keep: the constructor's arguments and a ``state_dict()``; the copy is
        a working optimizer of its own (its own worker and host memory) over the copied parameters. Hooks are not
        kept, as in torch."""
        return {"defaults": self.defaults, "param_groups": self.param_groups, "config": self.config.to_dict(),
                "saved": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        groups = [dict(g) for g in state["param_groups"]]
        kwargs = {**state["defaults"], **state["config"]}
        type(self).__init__(self, groups, **kwargs)
        self.load_state_dict(state["saved"])

    def __enter__(self) -> ZenFlowAdamW:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """Telemetry since construction (DESIGN §7); time in seconds, sizes in bytes."""
        s, records, slabs = self._stats, self._pipeline.records, self._pipeline.slabs
        total_cols = sum(rec.cols for rec in records.values())
        selected_cols = sum(rec.cols - rec.masks.num_unselected for rec in records.values())
        offloaded_numel = sum(p.numel() for p in records)
        host_bytes = sum(slab.nbytes for slab in slabs)
        out: dict[str, Any] = {
            "steps": s.steps,
            "windows": s.windows,
            "selections": s.selections,
            "stall_s": s.stall_s,
            "host_job_s": s.host_job_s,
            "device_opt_s": s.device_opt_s,
            "d2h_bytes": s.d2h_bytes,
            "h2d_bytes": s.h2d_bytes,
            "selected_fraction": selected_cols / total_cols if total_cols else 0.0,
            "selected_energy_fraction": s.selected_energy_fraction,
            "columns_changed_last_selection": s.columns_changed_last_selection,
            "pinned_bytes": sum(slab.nbytes for slab in slabs if slab.pinned),
            "host_bytes": host_bytes,
            "host_bytes_per_param": host_bytes / offloaded_numel if offloaded_numel else 0.0,
            "offloaded_params": offloaded_numel,
            **self._knobs.state_dict(),
            "measured_stall_per_window_s": s.stall_s / s.windows if s.windows else 0.0,
        }
        out.update(self._knobs.report(s))
        return out

    # ------------------------------------------------------------------ the step

    def _offloads(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is (or, stepping first, will be) offloaded: DESIGN §3's rule, for contiguous fp32, bf16 or
        fp16 parameters. Others stay resident (plain AdamW on their device, with a warning): the kernels update a
        parameter in place through a matrix view, in the model dtypes they are built for."""
        if p in self._pipeline.records:
            return True
        return self._offloadable(p) and p.is_contiguous() and p.dtype in MODEL_DTYPES

    def _offloadable(self, p: torch.Tensor) -> bool:
        return is_offloaded(p, self.config.min_offload_numel) and p.numel() > 0

    def _group_of_params(self) -> dict[torch.Tensor, dict[str, Any]]:
        return {p: g for g in self.param_groups for p in g["params"]}

    def _prepare_step(
        self,
    ) -> tuple[list[tuple[AdamHyperparams, list[torch.Tensor]]], list[tuple[AdamHyperparams, torch.Tensor]]]:
        """Validate hyperparameters and gradients, create state for parameters stepping for the first time, and
        return the parameters that step now: resident ones per group, offloaded ones with their group's record."""
        resident: list[tuple[AdamHyperparams, list[torch.Tensor]]] = []
        offloaded: list[tuple[AdamHyperparams, torch.Tensor]] = []
        fresh: list[torch.Tensor] = []
        for group in self.param_groups:
            _check_options(group, decoupled=self._decoupled)  # a group may have been edited since it was added
            hp = AdamHyperparams.from_group(group, decoupled=self._decoupled)
            resident.append((hp, []))
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse or g.layout != torch.strided:
                    raise RuntimeError(f"ZenFlowAdamW does not support sparse gradients (parameter of shape "
                                       f"{tuple(p.shape)} has a {g.layout} gradient)")
                if g.is_complex():
                    raise RuntimeError(f"complex gradient for parameter of shape {tuple(p.shape)} is not supported")
                if g.shape != p.shape or g.device != p.device:
                    raise RuntimeError(f"gradient of shape {tuple(g.shape)} on {g.device} does not match its "
                                       f"parameter of shape {tuple(p.shape)} on {p.device}")
                if self._offloads(p):
                    if not g.is_contiguous():
                        raise RuntimeError(f"gradient of parameter of shape {tuple(p.shape)} is not contiguous "
                                           f"(strides {g.stride()})")
                    if g.dtype != p.dtype:
                        raise RuntimeError(f"gradient dtype {g.dtype} differs from parameter dtype {p.dtype} "
                                           f"(shape {tuple(p.shape)})")
                    offloaded.append((hp, p))
                    if (p not in self.state or not self.state[p]) and all(q is not p for q in fresh):
                        fresh.append(p)
                else:
                    resident[-1][1].append(p)
                    if p not in self.state or not self.state[p]:
                        if self._offloadable(p):
                            logger.warning("zenflow_triton: a parameter of shape %s (%s, strides %s) stays resident "
                                           "(plain AdamW on its device): only contiguous float32, bfloat16 and "
                                           "float16 parameters are offloaded", tuple(p.shape), p.dtype, p.stride())
                        self.state[p] = init_resident(p)
        if fresh:
            self._pipeline.add(fresh, self.state)
        return resident, offloaded

    def _resident_step(self, resident: list[tuple[AdamHyperparams, list[torch.Tensor]]]) -> None:
        """Plain AdamW on every resident parameter, batched per group, device, dtype and step count (one
        ``_foreach`` call per op: a model has several small resident tensors per layer)."""
        for hp, params in resident:
            buckets: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]] = {}
            for p in params:
                st = self.state[p]
                st["step"] += 1
                buckets.setdefault((p.device, p.dtype, st["step"]), []).append(p)
            for (_, _, step), ps in buckets.items():
                sts = [self.state[p] for p in ps]
                reference.adam_update_foreach_(
                    ps, [p.grad for p in ps], [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts],
                    step=step, hp=hp,
                )

    def _offloaded_step(self, offloaded: list[tuple[AdamHyperparams, torch.Tensor]]) -> None:
        """DESIGN §3 at the schedule's step ``t``: warm-up, or steps 1-5 after it, for the offloaded parameters with
        a gradient; at a window end also for those whose window holds gradients of earlier steps only."""
        pipeline, knobs = self._pipeline, self._knobs
        device = offloaded[0][1].device if offloaded else self._device
        ops = pipeline.device_ops(device)
        warmup = knobs.warmup
        tau = self._schedule.step - warmup
        if not knobs.ready and tau >= 1:
            self._plan_auto()
        cfg = knobs.resolved
        interval, select = cfg.update_interval, cfg.select_interval
        selecting = tau >= 1 and (tau - 1) % select == 0
        window_end = tau <= 0 or tau % interval == 0
        if selecting:
            # Step 2: a selection step first makes all host work of earlier windows visible.
            pipeline.wait(self.state, merge=True)
        energy_sel = energy_all = 0.0
        changed = 0
        selected_any = False
        windows: dict[torch.Tensor, Window] = {}
        sync = not self.config.overlap or tau <= 0
        # With topk_ratio=0 no column is ever selected, so nothing would read the scores: skip them.
        scores = cfg.topk_ratio != 0
        stepped: set[torch.Tensor] = set()
        for hp, p in offloaded:
            st, rec = self.state[p], pipeline.records[p]
            pipeline.begin_step(p, st)
            st["step"] += 1
            w2, g2 = p.view(rec.rows, rec.cols), p.grad.view(rec.rows, rec.cols)
            update_score = scores
            if selecting and p not in stepped:
                # Steps 1-2: this step's scores count toward the selection it makes. (A parameter listed twice, as
                # torch allows with a warning, steps twice but selects once.)
                if scores:
                    ops.column_sumsq_(st["score"], g2)
                sel = reselect_(st, rec.masks, cfg.topk(rec.cols))
                energy_sel, energy_all = energy_sel + sel.energy_selected, energy_all + sel.energy_all
                changed += sel.columns_changed
                self._stats.d2h_bytes += sel.d2h_bytes
                self._stats.h2d_bytes += sel.h2d_bytes
                selected_any = True
                update_score = False
            stepped.add(p)
            if window_end and pipeline.takes_gradient(p, st, waited=sync):
                # A window of this step alone, applied before step() returns: the host reads this gradient.
                if update_score:
                    ops.column_sumsq_(st["score"], g2)
                windows[p] = Window(p, hp, grad=g2.detach())
                continue
            if tau >= 1 and rec.masks.num_unselected < rec.cols:
                st["col_step"].add_(rec.masks.selected)
            # Steps 1, 3 and 4 in one pass: scores, AdamW on the selected columns, the rest summed into acc.
            ops.fused_step_(
                w2, g2, score=st["score"], slot=st["slot"], col_step=st["col_step"], master=st["master"],
                exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"], acc=st["acc"], hp=hp,
                accumulate=st["acc_count"] > 0, update_score=update_score,
            )
            st["acc_count"] += 1
        if window_end:
            # Step 5 (warm-up: every element, synchronously): the host applies each window's mean gradient to the
            # unselected columns, also for parameters whose window holds gradients of earlier steps only.
            groups = None
            for p, rec in pipeline.records.items():
                st = self.state[p]
                if p in windows or st["acc_count"] == 0:
                    continue
                if tau <= 0 or rec.masks.num_unselected:
                    if p not in stepped:
                        groups = groups or self._group_of_params()
                        hp = AdamHyperparams.from_group(groups[p], decoupled=self._decoupled)
                    else:
                        hp = next(h for h, q in offloaded if q is p)
                    windows[p] = Window(p, hp)
                else:
                    st["acc_count"] = 0
        if selected_any:
            self._stats.selections += 1
            if not scores:  # topk_ratio=0: nothing is selected, whatever the (unmeasured) energy
                self._stats.selected_energy_fraction = 0.0
            else:
                self._stats.selected_energy_fraction = energy_sel / energy_all if energy_all > 0 else float("nan")
            self._stats.columns_changed_last_selection = changed
        if windows:
            pipeline.end_windows(list(windows.values()), self.state, sync=sync, cpu_threads=cfg.cpu_threads)

    def _plan_auto(self) -> None:
        records = self._pipeline.records
        self._knobs.resolve(offloaded_shapes=[(rec.rows, rec.cols) for rec in records.values()],
                            param_dtype=next(iter(records)).dtype, device=self._device or torch.device("cpu"))
        # Warm-up windows wait synchronously by design; the prediction is about the windows that follow.
        self._stats.stall_at_plan = self._stats.stall_s
        self._stats.windows_at_plan = self._stats.windows


def _check_options(group: Mapping[str, Any], *, decoupled: bool, where: str = "param group") -> None:
    """Refuse, by name, a torch.optim.AdamW option this optimizer does not implement (amsgrad, maximize, ...)."""
    for name, (allowed, why) in _REFUSED_OPTIONS.items():
        value = group.get(name, allowed)
        if value is not None and value != allowed:
            raise ValueError(f"Invalid {name}: {value!r} in {where}: {why}")
    value = group.get("decoupled_weight_decay", decoupled)
    if value is not None and bool(value) != decoupled:
        other = "ZenFlowAdamW (AdamW's decoupled decay)" if value else "ZenFlowAdam (Adam's L2 decay)"
        raise ValueError(f"Invalid decoupled_weight_decay: {value!r} in {where}: this optimizer's weight decay is "
                         f"{'decoupled' if decoupled else 'L2'}; use {other}")


def _saved_schedule_step(zenflow: Mapping[str, Any], plan: list[tuple[torch.Tensor, Mapping[str, Any], bool]]) -> int:
    """The schedule's step count of a checkpoint; one saved before it was recorded counted each parameter's own
    steps, so its offloaded parameters' largest count is the schedule's."""
    step = zenflow.get("step")
    if step is not None:
        return int(step)
    return max((int(saved["step"]) for _, saved, offloads in plan if offloads), default=0)


class ZenFlowAdam(ZenFlowAdamW):
    """Adam with L2-coupled weight decay (``torch.optim.Adam``'s ``weight_decay``), with ZenFlow offloading."""

    _decoupled = False
