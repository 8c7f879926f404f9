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

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .auto import AUTO_WARMUP_STEPS, Knobs
from .columns import is_offloaded, reselect_
from .config import ZenFlowConfig
from .kernels import MODEL_DTYPES, AdamHyperparams, reference
from .pipeline import Pipeline, Stats, Window
from .state import init_resident, load_resident, saved_entries

__all__ = ["ZenFlowAdamW", "ZenFlowAdam", "AUTO_WARMUP_STEPS"]


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
        super().__init__(params, defaults)
        self._knobs = Knobs(self.config)
        self._stats = Stats()
        self._pipeline = Pipeline(self.config, self._stats)

    # ------------------------------------------------------------------ torch.optim surface

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter group contains the same parameter more than once")
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
            if is_offloaded(p, self.config.min_offload_numel) and not p.is_contiguous():
                raise ValueError(f"parameter {i} of shape {tuple(p.shape)} is not contiguous; offloaded parameters "
                                 "are updated in place through a matrix view")
            if is_offloaded(p, self.config.min_offload_numel) and p.dtype not in MODEL_DTYPES:
                raise TypeError(
                    f"parameter {i} of shape {tuple(p.shape)} has dtype {p.dtype}; offloaded parameters must be "
                    "float32, bfloat16 or float16 (raise min_offload_numel to keep it resident)"
                )
        AdamHyperparams.from_group({**self.defaults, **param_group}, decoupled=self._decoupled)
        super().add_param_group(dict(param_group, params=params))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._pipeline.check_usable()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._pipeline.raise_finished_job_error()
        entered = time.perf_counter()
        stall_before = self._stats.stall_s
        resident, offloaded = self._prepare_step()
        self._knobs.sample_step_time(entered, offloaded[0][1].device if offloaded else None)
        self._resident_step(resident)
        if offloaded:
            self._offloaded_step(offloaded)
        self._stats.steps += 1
        now = time.perf_counter()
        self._knobs.step_ended(now)
        self._stats.device_opt_s += now - entered - (self._stats.stall_s - stall_before)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """Like ``torch.optim.Optimizer.state_dict``: waits for host work but never changes the parameters.

        Device tensors are references to the live state, as in torch (``copy.deepcopy`` the result to keep a
        snapshot in memory). Host arrays are returned as copies (see :func:`.state.saved_entries`).
        """
        self._pipeline.check_usable()
        self._pipeline.wait(self.state, merge=False)
        sd = super().state_dict()
        # New per-parameter dicts: torch packs the live ones, which must keep pointing at the slab.
        sd["state"] = {pid: saved_entries(st) for pid, st in sd["state"].items()}
        sd["zenflow"] = self._knobs.state_dict()
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``, onto any device; training then continues bit for bit."""
        self._pipeline.check_usable()
        self._pipeline.wait(self.state, merge=False)
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, optimizer has {len(groups)}")
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"loaded state dict's group {i} has {len(sg['params'])} parameters, "
                    f"the optimizer's has {len(g['params'])}"
                )
        id_map = {sid: p for g, sg in zip(groups, saved_groups) for sid, p in zip(sg["params"], g["params"])}
        self._knobs.load_state_dict(state_dict.get("zenflow", {}))
        for g, sg in zip(groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})
        self.state.clear()
        offloaded = []
        for sid, saved in state_dict["state"].items():
            p = id_map[sid]
            if "host_master" in saved:
                offloaded.append((p, saved))
            else:
                self.state[p] = load_resident(p, saved)
        self._pipeline.load(offloaded, self.state)

    def flush(self) -> None:
        """Wait for all host work and write its results into the parameters (before eval or export)."""
        self._pipeline.check_usable()
        self._pipeline.wait(self.state, merge=True)

    def close(self) -> None:
        """Stop the host worker and release host buffers. The optimizer cannot step afterwards."""
        self._pipeline.close(self.state)

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

    def _prepare_step(
        self,
    ) -> tuple[list[tuple[AdamHyperparams, list[torch.Tensor]]], list[tuple[AdamHyperparams, torch.Tensor]]]:
        """Validate hyperparameters and gradients, create state for parameters stepping for the first time, and
        return the parameters that step now: resident ones per group, offloaded ones with their group's record."""
        resident: list[tuple[AdamHyperparams, list[torch.Tensor]]] = []
        offloaded: list[tuple[AdamHyperparams, torch.Tensor]] = []
        fresh: list[torch.Tensor] = []
        for group in self.param_groups:
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
                if is_offloaded(p, self.config.min_offload_numel):
                    if not g.is_contiguous():
                        raise RuntimeError(f"gradient of parameter of shape {tuple(p.shape)} is not contiguous "
                                           f"(strides {g.stride()})")
                    if g.dtype != p.dtype:
                        raise RuntimeError(f"gradient dtype {g.dtype} differs from parameter dtype {p.dtype} "
                                           f"(shape {tuple(p.shape)})")
                    offloaded.append((hp, p))
                    if p not in self.state or not self.state[p]:
                        fresh.append(p)
                else:
                    resident[-1][1].append(p)
                    if p not in self.state or not self.state[p]:
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
        """DESIGN §3 for every offloaded parameter with a gradient: warm-up, or steps 1-5 after it."""
        pipeline, knobs = self._pipeline, self._knobs
        ops = pipeline.device_ops(offloaded[0][1].device)
        warmup = knobs.warmup
        if not knobs.ready and any(self.state[p]["step"] + 1 - warmup >= 1 for _, p in offloaded):
            self._plan_auto()
        cfg = knobs.resolved
        interval, select = cfg.update_interval, cfg.select_interval
        if any(self.state[p]["step"] >= warmup and (self.state[p]["step"] - warmup) % select == 0
               for _, p in offloaded):
            # Step 2: a selection step first makes all host work of earlier windows visible.
            pipeline.wait(self.state, merge=True)
        energy_sel = energy_all = 0.0
        changed = 0
        selected_any = False
        windows: list[Window] = []
        sync = not self.config.overlap
        # With topk_ratio=0 no column is ever selected, so nothing would read the scores: skip them.
        scores = cfg.topk_ratio != 0
        for hp, p in offloaded:
            st, rec = self.state[p], pipeline.records[p]
            pipeline.begin_step(p, st)
            st["step"] += 1
            tau = st["step"] - warmup
            w2, g2 = p.view(rec.rows, rec.cols), p.grad.view(rec.rows, rec.cols)
            update_score = scores
            if tau >= 1 and (tau - 1) % select == 0:
                # Steps 1-2: this step's scores count toward the selection it makes.
                if scores:
                    ops.column_sumsq_(st["score"], g2)
                sel = reselect_(st, rec.masks, cfg.topk(rec.cols))
                energy_sel, energy_all = energy_sel + sel.energy_selected, energy_all + sel.energy_all
                changed += sel.columns_changed
                self._stats.d2h_bytes += sel.d2h_bytes
                self._stats.h2d_bytes += sel.h2d_bytes
                selected_any = True
                update_score = False
            window_end = tau <= 0 or tau % interval == 0
            if window_end and pipeline.takes_gradient(p, st, waited=tau <= 0 or not self.config.overlap):
                # A window of this step alone, applied before step() returns: the host reads this gradient.
                if update_score:
                    ops.column_sumsq_(st["score"], g2)
                windows.append(Window(p, hp, grad=g2.detach()))
                sync = sync or tau <= 0
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
            if tau <= 0:
                # Warm-up: every element gets this step's AdamW update synchronously, on the host.
                windows.append(Window(p, hp))
                sync = True
            elif window_end:
                # Step 5: the host applies the window's mean gradient to the unselected columns.
                if rec.masks.num_unselected:
                    windows.append(Window(p, hp))
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
            pipeline.end_windows(windows, self.state, sync=sync, cpu_threads=cfg.cpu_threads)

    def _plan_auto(self) -> None:
        records = self._pipeline.records
        self._knobs.resolve(offloaded_shapes=[(rec.rows, rec.cols) for rec in records.values()],
                            param_dtype=next(iter(records)).dtype, device=self._device or torch.device("cpu"))
        # Warm-up windows wait synchronously by design; the prediction is about the windows that follow.
        self._stats.stall_at_plan = self._stats.stall_s
        self._stats.windows_at_plan = self._stats.windows


class ZenFlowAdam(ZenFlowAdamW):
    """Adam with L2-coupled weight decay (``torch.optim.Adam``'s ``weight_decay``), with ZenFlow offloading."""

    _decoupled = False
