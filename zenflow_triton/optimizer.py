"""ZenFlowAdamW / ZenFlowAdam: drop-in ``torch.optim`` optimizers with ZenFlow offloading (DESIGN §2-§5).

Offloaded parameters (ndim >= 2, numel >= min_offload_numel) keep fp32 master weights and Adam moments in
host memory. Each step the top-k columns by accumulated gradient norm are updated on the device; the
other columns' gradients are summed on the device and applied by the host worker once per window of
``update_interval`` steps, asynchronously when ``overlap=True``. Every other parameter gets plain AdamW
on its device, as ``torch.optim.AdamW`` would do.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import ZenFlowConfig
from .host_memory import HostSlab
from .kernels import reference
from .kernels._checks import MODEL_DTYPES
from .offload import HostItem, is_offloaded, matrix_shape, migrate_columns, run_host_job, select_columns
from .worker import HostWorker, WorkerError, host_thread_limit

__all__ = ["ZenFlowAdamW", "ZenFlowAdam", "AUTO_WARMUP_STEPS"]

logger = logging.getLogger("zenflow_triton")

# State entries that live in the host slab.
_HOST_KEYS = ("host_master", "host_exp_avg", "host_exp_avg_sq", "host_col_step")

# "auto" knobs measure the step time over the warm-up (synchronous, so every sample is a whole step);
# five steps give four intervals, enough for a median that ignores the first, slower, step.
AUTO_WARMUP_STEPS = 5


@dataclass
class _Runtime:
    """Per-offloaded-parameter buffers that are not optimizer state: derivable from it, or transient."""

    rows: int
    cols: int
    grad: torch.Tensor  # host gradient landing buffer [R, C], fp32 or bf16
    snapshot: torch.Tensor | None  # host model-dtype copy for the trip back; None: the fp32 master serves
    host_slot: torch.Tensor  # CPU copy of the slot map, read by the host kernel
    unselected: torch.Tensor  # CPU int32 [C]: 1 where the host updates the column
    selected: torch.Tensor  # device int32 [C]: 1 where the device updates the column
    num_unselected: int
    # The host master is the parameter's own memory (fp32 parameters on the CPU with overlap=False, see _allocate).
    master_is_param: bool = False
    d2h_done: torch.cuda.Event | None = None  # acc may be overwritten only after its copy left the device


@dataclass
class _Job:
    future: Any
    params: list[torch.Tensor]


@dataclass
class _Stats:
    steps: int = 0
    windows: int = 0
    selections: int = 0
    stall_s: float = 0.0
    host_job_s: float = 0.0
    device_opt_s: float = 0.0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    selected_energy_fraction: float = float("nan")
    columns_changed_last_selection: int = 0
    step_time_samples: list[float] = field(default_factory=list)
    stall_at_plan: float = 0.0
    windows_at_plan: int = 0


def _shutdown(worker: HostWorker) -> None:
    worker.close()


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
        _check_group_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.config = ZenFlowConfig(
            topk_ratio=topk_ratio, update_interval=update_interval, select_interval=select_interval,
            warmup_steps=warmup_steps, overlap=overlap, min_offload_numel=min_offload_numel,
            cpu_threads=cpu_threads, backend=backend, grad_dtype=grad_dtype, worker_timeout=worker_timeout,
        )
        self._device: torch.device | None = None
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        cfg = self.config
        self._warmup = max(cfg.warmup_steps, AUTO_WARMUP_STEPS) if cfg.is_auto else cfg.warmup_steps
        self._topk_ratio: float | None = None if cfg.topk_ratio == "auto" else float(cfg.topk_ratio)
        self._update_interval: int | None = None if cfg.update_interval == "auto" else cfg.update_interval
        self._select_interval: int | None = None
        if self._update_interval is not None:
            self._select_interval = cfg.resolved_select_interval()
        limit = host_thread_limit()
        if cfg.cpu_threads is not None and cfg.cpu_threads > limit:
            raise ValueError(f"Invalid cpu_threads: {cfg.cpu_threads} (this process can run at most {limit} numba "
                             "threads: its CPU affinity, capped by NUMBA_NUM_THREADS)")
        self._cpu_threads = cfg.cpu_threads or max(1, limit - 1)
        self._plan: Any = None
        self._ops: Any = None
        self._runtime: dict[torch.Tensor, _Runtime] = {}
        self._slabs: list[HostSlab] = []
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        self._copy_stream: torch.cuda.Stream | None = None
        self._job: _Job | None = None
        self._stats = _Stats()
        self._failure: BaseException | None = None
        self._closed = False
        self._last_step_end: float | None = None
        self._worker = HostWorker()
        self._finalizer = weakref.finalize(self, _shutdown, self._worker)

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
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in param_group:
                kw = {key: param_group[key]}
                _check_group_hparams(**kw)
        param_group = dict(param_group, params=params)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._check_usable()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._raise_finished_job_error()
        entered = time.perf_counter()
        stall_before = self._stats.stall_s
        offloaded = self._prepare_step()
        self._sample_step_time(entered, offloaded)
        try:
            self._resident_step()
            if offloaded:
                self._offloaded_step(offloaded)
        except WorkerError as exc:
            self._failure = exc
            raise
        self._stats.steps += 1
        self._last_step_end = time.perf_counter()
        self._stats.device_opt_s += self._last_step_end - entered - (self._stats.stall_s - stall_before)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """Like ``torch.optim.Optimizer.state_dict``: waits for host work but never changes the parameters.

        Device tensors are references to the live state, as in torch (``copy.deepcopy`` the result to keep a
        snapshot in memory). Host arrays are returned as copies: they are views into one shared slab, which
        ``torch.save`` could not write (it refuses one storage viewed as several dtypes).
        """
        self._check_usable()
        self._wait_job(merge=False)
        sd = super().state_dict()
        # New per-parameter dicts: torch packs the live ones, which must keep pointing at the slab.
        sd["state"] = {
            pid: {k: (v.clone() if _is_host_array(k, v) else v) for k, v in st.items()}
            for pid, st in sd["state"].items()
        }
        sd["zenflow"] = {
            "topk_ratio": self._topk_ratio,
            "update_interval": self._update_interval,
            "select_interval": self._select_interval,
            "cpu_threads": self._cpu_threads,
        }
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``, onto any device; training then continues bit for bit."""
        self._check_usable()
        self._wait_job(merge=False)
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
        zf = state_dict.get("zenflow", {})
        self._topk_ratio = zf.get("topk_ratio", self._topk_ratio)
        self._update_interval = zf.get("update_interval", self._update_interval)
        self._select_interval = zf.get("select_interval", self._select_interval)
        # cpu_threads stays this machine's: the thread count never changes results, and a checkpoint's may exceed
        # what this process can run.
        for g, sg in zip(groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})
        self.state.clear()
        self._runtime.clear()
        self._slabs.clear()
        offloaded: list[tuple[torch.Tensor, dict[str, Any]]] = []
        for sid, saved in state_dict["state"].items():
            p = id_map[sid]
            if "host_master" in saved:
                offloaded.append((p, saved))
            else:
                self.state[p] = {
                    k: (v.to(device=p.device, dtype=p.dtype) if isinstance(v, torch.Tensor) and k != "step" else v)
                    for k, v in saved.items()
                }
        if offloaded:
            self._allocate([p for p, _ in offloaded])
            for p, saved in offloaded:
                self._load_offloaded(p, saved)

    def flush(self) -> None:
        """Wait for all host work and write its results into the parameters (before eval or export)."""
        self._check_usable()
        self._wait_job(merge=True)

    def close(self) -> None:
        """Stop the host worker and release host buffers. The optimizer cannot step afterwards."""
        if self._closed:
            return
        try:
            if self._failure is None:
                self._wait_job(merge=True)
        finally:
            self._closed = True
            self._worker.close()
            self._finalizer.detach()
            self._slabs.clear()
            self._runtime.clear()
            self._staging.clear()

    def __enter__(self) -> ZenFlowAdamW:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """Telemetry since construction (DESIGN §7); time in seconds, sizes in bytes."""
        s = self._stats
        total_cols = selected_cols = 0
        host_bytes = sum(slab.nbytes for slab in self._slabs)
        offloaded_numel = 0
        for p, rt in self._runtime.items():
            total_cols += rt.cols
            selected_cols += rt.cols - rt.num_unselected
            offloaded_numel += p.numel()
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
            "pinned_bytes": sum(slab.nbytes for slab in self._slabs if slab.pinned),
            "host_bytes": host_bytes,
            "host_bytes_per_param": host_bytes / offloaded_numel if offloaded_numel else 0.0,
            "offloaded_params": offloaded_numel,
            "topk_ratio": self._topk_ratio,
            "update_interval": self._update_interval,
            "select_interval": self._select_interval,
            "cpu_threads": self._cpu_threads,
            "measured_stall_per_window_s": s.stall_s / s.windows if s.windows else 0.0,
        }
        if self._plan is not None:
            windows = s.windows - s.windows_at_plan
            out["measured_stall_per_window_s"] = (s.stall_s - s.stall_at_plan) / windows if windows else 0.0
            out["predicted_stall_per_window_s"] = self._plan.predicted_stall_s
            out["predicted_host_per_window_s"] = self._plan.predicted_host_s
            out["auto_reason"] = self._plan.reason
            out["measured_step_time_s"] = self._measured_step_time()
        return out

    # ------------------------------------------------------------------ step internals

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this ZenFlowAdamW was closed; create a new optimizer")
        if self._failure is not None:
            raise RuntimeError("this ZenFlowAdamW stopped after a host worker failure") from self._failure

    def _raise_finished_job_error(self) -> None:
        job = self._job
        if job is not None and job.future.done() and job.future.exception() is not None:
            self._job = None
            exc = job.future.exception()
            self._failure = exc
            raise RuntimeError("the host worker failed during an earlier window") from exc

    def _prepare_step(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """Validate gradients, create state for parameters stepping for the first time, and return the
        offloaded parameters that step now (with their groups)."""
        offloaded: list[tuple[dict[str, Any], torch.Tensor]] = []
        fresh: list[torch.Tensor] = []
        for group in self.param_groups:
            _check_group_hparams(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                 weight_decay=group["weight_decay"])
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
                    offloaded.append((group, p))
                    if p not in self.state or not self.state[p]:
                        fresh.append(p)
                elif p not in self.state or not self.state[p]:
                    self.state[p] = {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        if fresh:
            self._allocate(fresh)
            for p in fresh:
                self._init_offloaded(p)
        return offloaded

    def _resident_step(self) -> None:
        """Plain AdamW on every resident parameter, batched per group, device, dtype and step count (one
        ``_foreach`` call per op: a model has several small resident tensors per layer)."""
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            buckets: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None or is_offloaded(p, self.config.min_offload_numel):
                    continue
                st = self.state[p]
                st["step"] += 1
                buckets.setdefault((p.device, p.dtype, st["step"]), []).append(p)
            for (_, _, step), ps in buckets.items():
                sts = [self.state[p] for p in ps]
                reference.adam_update_foreach_(
                    ps, [p.grad for p in ps], [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts],
                    step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], decoupled=self._decoupled,
                )

    def _offloaded_step(self, offloaded: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        ops = self._device_ops()
        warmup = self._warmup
        if any(self.state[p]["step"] + 1 - warmup >= 1 for _, p in offloaded):
            self._resolve_auto()
        interval, select = self._update_interval, self._select_interval
        if any(self.state[p]["step"] >= warmup and (self.state[p]["step"] - warmup) % select == 0
               for _, p in offloaded):
            # A selection step first makes all host work of earlier windows visible (DESIGN §3 step 2).
            self._wait_job(merge=True)
        energy_sel = energy_all = 0.0
        changed = 0
        selected_any = False
        ending: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor | None]] = []
        sync = not self.config.overlap
        # With topk_ratio=0 no column is ever selected, so nothing would read the scores: skip them.
        scores = self._topk_ratio != 0
        for group, p in offloaded:
            st, rt = self.state[p], self._runtime[p]
            st["step"] += 1
            tau = st["step"] - warmup
            w2, g2 = p.view(rt.rows, rt.cols), p.grad.view(rt.rows, rt.cols)
            if rt.master_is_param and st["host_master"].data_ptr() != p.data_ptr():
                # The parameter got new storage (``p.data = ...``): its values are the master from now on, as a
                # plain torch optimizer would read them, instead of updates landing in memory the model let go.
                st["host_master"] = p.detach().view(rt.rows, rt.cols)
            update_score = scores
            if tau >= 1 and (tau - 1) % select == 0:
                if scores:
                    ops.column_sumsq_(st["score"], g2)
                e_sel, e_all, n_changed = self._reselect(p)
                energy_sel, energy_all, changed = energy_sel + e_sel, energy_all + e_all, changed + n_changed
                selected_any = True
                update_score = False
            window_end = tau <= 0 or tau % interval == 0
            if (p.device.type == "cpu" and window_end and (tau <= 0 or not self.config.overlap)
                    and st["acc_count"] == 0 and rt.num_unselected == rt.cols and self._lands_exactly(p)):
                # A window of this step alone, applied before step() returns, with no column on the device: on
                # CPU tensors the host kernel reads this gradient where it is and writes the parameter itself.
                # That skips the device pass (acc = g) and the landing copy: 7 streams instead of 13.
                if update_score:
                    ops.column_sumsq_(st["score"], g2)
                ending.append((group, p, g2.detach()))
                sync = sync or tau <= 0
                continue
            if rt.d2h_done is not None and st["acc_count"] == 0:
                # This step overwrites acc, which the copy stream may still be reading for the host job.
                torch.cuda.current_stream(p.device).wait_event(rt.d2h_done)
                rt.d2h_done = None
            if tau >= 1 and rt.num_unselected < rt.cols:
                st["col_step"].add_(rt.selected)
            beta1, beta2 = group["betas"]
            ops.fused_step_(
                w2, g2, score=st["score"], slot=st["slot"], col_step=st["col_step"], master=st["master"],
                exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"], acc=st["acc"], lr=group["lr"], beta1=beta1,
                beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], decoupled=self._decoupled,
                accumulate=st["acc_count"] > 0, update_score=update_score,
            )
            st["acc_count"] += 1
            if tau <= 0:
                # Warm-up: every element gets this step's AdamW update synchronously, on the host.
                ending.append((group, p, None))
                sync = True
            elif window_end:
                if rt.num_unselected:
                    ending.append((group, p, None))
                else:
                    st["acc_count"] = 0
        if selected_any:
            self._stats.selections += 1
            if not scores:  # topk_ratio=0: nothing is selected, whatever the (unmeasured) energy
                self._stats.selected_energy_fraction = 0.0
            else:
                self._stats.selected_energy_fraction = energy_sel / energy_all if energy_all > 0 else float("nan")
            self._stats.columns_changed_last_selection = changed
        if ending:
            self._end_windows(ending, sync=sync)

    def _lands_exactly(self, p: torch.Tensor) -> bool:
        """Whether this parameter's gradient passes through the landing buffer unchanged, so the host kernel may
        read it in place: with a bf16 landing buffer only bf16 gradients do (others would skip the rounding that
        a GPU run applies, and CPU and GPU runs of one configuration would part ways)."""
        return self.config.grad_dtype == "float32" or p.dtype == torch.bfloat16

    def _reselect(self, p: torch.Tensor) -> tuple[float, float, int]:
        st, rt = self.state[p], self._runtime[p]
        k = ZenFlowConfig(topk_ratio=self._topk_ratio).topk(rt.cols)
        score = st["score"]
        new_slot = select_columns(score, k)
        energy_all = float(score.sum())
        energy_sel = float(score[new_slot >= 0].sum()) if k else 0.0
        compact, d2h, h2d, changed = migrate_columns(
            old_slot=st["slot"], new_slot=new_slot, compact=(st["master"], st["exp_avg"], st["exp_avg_sq"]),
            col_step=st["col_step"], host=(st["host_master"], st["host_exp_avg"], st["host_exp_avg_sq"]),
            host_col_step=st["host_col_step"],
        )
        st["master"], st["exp_avg"], st["exp_avg_sq"] = compact
        st["slot"] = new_slot
        score.zero_()
        self._refresh_masks(p)
        self._stats.d2h_bytes += d2h
        self._stats.h2d_bytes += h2d
        return energy_sel, energy_all, changed

    def _end_windows(self, ending: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor | None]], *,
                     sync: bool) -> None:
        """DESIGN §5: wait for the previous job and apply it, ship this window's sums, submit the next job.

        ``ending`` holds (group, param, gradient): the gradient is None for a window summed in ``acc``, or the
        parameter's own gradient for a one-step synchronous window on CPU tensors (see ``_offloaded_step``).
        """
        self._wait_job(merge=True)
        device = ending[0][1].device
        cuda = device.type == "cuda"
        items: list[HostItem] = []
        ready = None
        if cuda:
            compute = torch.cuda.current_stream(device)
            copy = self._get_copy_stream(device)
            sources = []
            for _, p, _ in ending:
                acc = self.state[p]["acc"]
                src = acc.to(torch.bfloat16) if self.config.grad_dtype == "bfloat16" else acc
                sources.append(src)
            # The copies may start only after this step's fused kernels finished writing acc.
            copy.wait_stream(compute)
            with torch.cuda.stream(copy):
                for (_, p, _), src in zip(ending, sources):
                    self._runtime[p].grad.copy_(src, non_blocking=True)
                    src.record_stream(copy)
                ready = torch.cuda.Event()
                ready.record(copy)
        for group, p, direct_grad in ending:
            st, rt = self.state[p], self._runtime[p]
            snapshot = rt.snapshot
            if direct_grad is not None:
                grad, count = direct_grad, 1
                # The kernel writes the parameter: through the master itself, or as the snapshot it rounds into.
                snapshot = None if rt.master_is_param else p.detach().view(rt.rows, rt.cols)
            elif cuda:
                grad, count = rt.grad, st["acc_count"]
                rt.d2h_done = ready
            elif rt.grad.dtype == st["acc"].dtype:
                # CPU tensors: acc and the landing buffer are both host memory, so they trade places instead of
                # copying (12 bytes per parameter and window saved); the next window overwrites the other one.
                st["acc"], rt.grad = rt.grad, st["acc"]
                grad, count = rt.grad, st["acc_count"]
            else:
                rt.grad.copy_(st["acc"])
                grad, count = rt.grad, st["acc_count"]
            self._stats.d2h_bytes += grad.numel() * grad.element_size()
            beta1, beta2 = group["betas"]
            items.append(HostItem(
                master=st["host_master"], exp_avg=st["host_exp_avg"], exp_avg_sq=st["host_exp_avg_sq"],
                grad=grad, slot=rt.host_slot, unselected=rt.unselected, col_step=st["host_col_step"],
                snapshot=snapshot, count=count, lr=float(group["lr"]), beta1=float(beta1),
                beta2=float(beta2), eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                decoupled=self._decoupled,
            ))
            st["acc_count"] = 0
            # A result written straight into the parameter needs no merge.
            st["pending"] = not (direct_grad is not None or rt.master_is_param)
        self._stats.windows += 1
        # A synchronous window is waited for anyway, so its job may use every core unless the user chose a count.
        threads = self._cpu_threads
        if sync and self.config.cpu_threads is None:
            threads = max(threads, host_thread_limit())
        future = self._worker.submit(run_host_job, items, ready, threads)
        self._job = _Job(future=future, params=[p for _, p, _ in ending])
        if sync:
            self._wait_job(merge=True)

    def _wait_job(self, *, merge: bool) -> None:
        """Wait for the in-flight host job (time counted as stall); with ``merge``, write every pending
        host result into its parameter's unselected columns."""
        job = self._job
        if job is not None:
            start = time.perf_counter()
            try:
                self._stats.host_job_s += self._worker.wait(job.future, self.config.worker_timeout)
            except WorkerError as exc:
                self._failure = exc
                raise
            except BaseException as exc:
                self._failure = exc
                raise RuntimeError("the host worker failed during a window") from exc
            finally:
                self._job = None
                self._stats.stall_s += time.perf_counter() - start
        if merge:
            with torch.no_grad():
                for p, rt in self._runtime.items():
                    st = self.state[p]
                    if st.get("pending"):
                        self._merge(p, st, rt)

    def _merge(self, p: torch.Tensor, st: dict[str, Any], rt: _Runtime) -> None:
        source = rt.snapshot if rt.snapshot is not None else st["host_master"]
        w2 = p.view(rt.rows, rt.cols)
        if p.device.type == "cuda":
            numel = source.numel()
            staging = self._staging.get(p.dtype)
            if staging is None or staging.numel() < numel:
                staging = torch.empty(numel, dtype=p.dtype, device=p.device)
                self._staging[p.dtype] = staging
            view = staging[:numel].view(rt.rows, rt.cols)
            # Ordered on the compute stream, so it lands before the merge and before anything that
            # follows; the next host job starts writing the snapshot only after a copy-stream event
            # recorded later than this copy on the same compute stream, so the source stays intact.
            view.copy_(source, non_blocking=True)
            self._device_ops().merge_(w2, view, st["slot"])
        else:
            self._device_ops().merge_(w2, source, st["slot"])
        self._stats.h2d_bytes += source.numel() * source.element_size()
        st["pending"] = False

    # ------------------------------------------------------------------ state

    def _allocate(self, params: list[torch.Tensor]) -> None:
        """One host slab for these parameters' master, moments, step counts, landing and snapshot buffers.

        An fp32 parameter on the CPU with ``overlap=False`` is its own host master: every host result is due in
        the parameter when ``step()`` returns, so a separate copy would only add a stream to every host pass.
        """
        requests: list[tuple[tuple[int, ...], torch.dtype]] = []
        grad_dtype = torch.bfloat16 if self.config.grad_dtype == "bfloat16" else torch.float32
        alias = [p.device.type == "cpu" and p.dtype == torch.float32 and not self.config.overlap for p in params]
        for p, own_master in zip(params, alias):
            rows, cols = matrix_shape(p)
            requests += [((rows, cols), torch.float32)] * (2 if own_master else 3)
            requests += [((cols,), torch.int32), ((rows, cols), grad_dtype)]
            if p.dtype != torch.float32:
                requests.append(((rows, cols), p.dtype))
        pin = any(p.device.type == "cuda" for p in params)
        slab = HostSlab(requests, pin=pin)
        self._slabs.append(slab)
        views = iter(slab.views)
        for p, own_master in zip(params, alias):
            rows, cols = matrix_shape(p)
            st = self.state[p] = {}
            st["host_master"] = p.detach().view(rows, cols) if own_master else next(views)
            st["host_exp_avg"], st["host_exp_avg_sq"] = next(views), next(views)
            st["host_col_step"] = next(views)
            grad = next(views)
            snapshot = next(views) if p.dtype != torch.float32 else None
            self._runtime[p] = _Runtime(
                rows=rows, cols=cols, grad=grad, snapshot=snapshot,
                host_slot=torch.empty(cols, dtype=torch.int32), unselected=torch.empty(cols, dtype=torch.int32),
                selected=torch.empty(cols, dtype=torch.int32, device=p.device), num_unselected=cols,
                master_is_param=own_master,
            )

    def _init_offloaded(self, p: torch.Tensor) -> None:
        st, rt = self.state[p], self._runtime[p]
        rows, cols = rt.rows, rt.cols
        dev = p.device
        st["step"] = 0
        if not rt.master_is_param:
            st["host_master"].copy_(p.detach().view(rows, cols))
        st["host_exp_avg"].zero_()
        st["host_exp_avg_sq"].zero_()
        st["host_col_step"].zero_()
        st["score"] = torch.zeros(cols, dtype=torch.float32, device=dev)
        st["slot"] = torch.full((cols,), -1, dtype=torch.int32, device=dev)
        st["col_step"] = torch.zeros(cols, dtype=torch.int32, device=dev)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            st[key] = torch.zeros((rows, 0), dtype=torch.float32, device=dev)
        st["acc"] = torch.zeros((rows, cols), dtype=torch.float32, device=dev)
        st["acc_count"] = 0
        st["pending"] = False
        self._refresh_masks(p)

    def _load_offloaded(self, p: torch.Tensor, saved: dict[str, Any]) -> None:
        st, rt = self.state[p], self._runtime[p]
        for key in _HOST_KEYS:
            src = saved[key]
            if tuple(src.shape) != tuple(st[key].shape):
                raise ValueError(f"state '{key}' has shape {tuple(src.shape)}, expected {tuple(st[key].shape)} for "
                                 f"parameter of shape {tuple(p.shape)}")
            st[key].copy_(src)
        for key in ("score", "slot", "col_step", "master", "exp_avg", "exp_avg_sq", "acc"):
            st[key] = saved[key].to(p.device, copy=True)
        for key in ("step", "acc_count", "pending"):
            st[key] = saved[key]
        self._refresh_masks(p)
        if st["pending"] and rt.snapshot is not None:
            # The snapshot is master rounded to the model dtype on the columns the last job updated,
            # exactly what the host kernel wrote (both round to nearest even).
            cols = torch.nonzero(rt.host_slot < 0).squeeze(1)
            rt.snapshot[:, cols] = st["host_master"][:, cols].to(rt.snapshot.dtype)

    def _refresh_masks(self, p: torch.Tensor) -> None:
        st, rt = self.state[p], self._runtime[p]
        slot = st["slot"]
        rt.selected.copy_((slot >= 0).to(torch.int32))
        rt.host_slot.copy_(slot)
        rt.unselected.copy_((rt.host_slot < 0).to(torch.int32))
        rt.num_unselected = int(rt.unselected.sum())

    # ------------------------------------------------------------------ devices, backends, auto

    def _device_ops(self) -> Any:
        if self._ops is None:
            self._ops = _load_backend(self.config.backend, self._device or torch.device("cpu"))
        return self._ops

    def _get_copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=device)
        return self._copy_stream

    def _sample_step_time(self, entered: float, offloaded: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        if self._plan is not None or not self.config.is_auto or self._last_step_end is None or not offloaded:
            return
        if offloaded[0][1].device.type == "cuda":
            # Warm-up steps end synchronized (the host update waits), so after this sync the interval since
            # the last step's end is exactly the forward and backward time on the device.
            torch.cuda.synchronize(offloaded[0][1].device)
            entered = time.perf_counter()
        self._stats.step_time_samples.append(entered - self._last_step_end)

    def _measured_step_time(self) -> float:
        samples = self._stats.step_time_samples
        return statistics.median(samples) if samples else 0.0

    def _resolve_auto(self) -> None:
        if self._update_interval is not None and self._topk_ratio is not None:
            return
        from .autotune import plan_for_optimizer

        shapes = [(rt.rows, rt.cols) for rt in self._runtime.values()]
        param_dtype = next(iter(self._runtime)).dtype
        plan = plan_for_optimizer(
            offloaded_shapes=shapes, param_dtype=param_dtype, grad_dtype=self.config.grad_dtype,
            step_time_s=self._measured_step_time(), device=self._device or torch.device("cpu"),
            topk_ratio=self._topk_ratio, update_interval=self._update_interval,
            select_interval=self.config.select_interval, overlap=self.config.overlap,
            cpu_threads=self.config.cpu_threads,
        )
        # Warm-up windows wait synchronously by design; the prediction is about the windows that follow.
        self._stats.stall_at_plan = self._stats.stall_s
        self._stats.windows_at_plan = self._stats.windows
        self._plan = plan
        self._topk_ratio = float(plan.topk_ratio)
        self._update_interval = int(plan.update_interval)
        s = self.config.select_interval
        if s is None:
            resolved = self.config.replace(update_interval=self._update_interval)
            self._select_interval = resolved.resolved_select_interval()
        else:
            self._select_interval = math.ceil(s / self._update_interval) * self._update_interval
            if self._select_interval != s:
                logger.warning("select_interval=%d rounded up to %d, a multiple of the chosen update_interval=%d",
                               s, self._select_interval, self._update_interval)
        if self.config.cpu_threads is None:
            self._cpu_threads = max(1, min(int(plan.cpu_threads), host_thread_limit()))
        logger.info("zenflow_triton auto: topk_ratio=%.3g update_interval=%d cpu_threads=%d: %s",
                    self._topk_ratio, self._update_interval, self._cpu_threads, plan.reason)


class ZenFlowAdam(ZenFlowAdamW):
    """Adam with L2-coupled weight decay (``torch.optim.Adam``'s ``weight_decay``), with ZenFlow offloading."""

    _decoupled = False


def _is_host_array(key: str, value: Any) -> bool:
    """A state entry that may be a view into a host slab (on CPU tensors acc trades places with the landing
    buffer) or into the parameter itself (a master that is the parameter): ``state_dict()`` copies those."""
    return key in _HOST_KEYS or (key == "acc" and value.device.type == "cpu")


def _check_group_hparams(**kw: Any) -> None:
    if "lr" in kw:
        lr = kw["lr"]
        if isinstance(lr, torch.Tensor):
            raise ValueError("Invalid lr: a Tensor learning rate is not supported; pass a Python float")
        if not isinstance(lr, (int, float)) or not 0.0 <= lr or not math.isfinite(lr):
            raise ValueError(f"Invalid lr: {lr}")
    if "eps" in kw:
        eps = kw["eps"]
        if not isinstance(eps, (int, float)) or not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
    if "betas" in kw:
        betas = kw["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Invalid betas: {betas!r} (a pair of floats)")
        for i, b in enumerate(betas):
            if isinstance(b, torch.Tensor) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    if "weight_decay" in kw:
        wd = kw["weight_decay"]
        if not isinstance(wd, (int, float)) or not 0.0 <= wd:
            raise ValueError(f"Invalid weight_decay value: {wd}")


def _load_backend(name: str, device: torch.device) -> Any:
    """The device-side ops: Triton kernels, numba kernels for CPU tensors, or their plain-torch twins."""
    if name == "auto":
        if device.type == "cpu":
            name = "numba"
        else:
            name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "torch":
        return reference
    if name == "numba":
        if device.type != "cpu":
            raise ValueError(f"backend='numba' runs the device-side ops on CPU tensors; the parameters are on {device}")
        from .kernels import cpu_fused_step

        return cpu_fused_step
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to run "
            f"the kernels on {device} tensors; use backend='torch' for {device} tensors"
        )
    from types import SimpleNamespace

    from .kernels.colnorm import column_sumsq_
    from .kernels.fused_step import fused_step_
    from .kernels.merge import merge_

    return SimpleNamespace(column_sumsq_=column_sumsq_, fused_step_=fused_step_, merge_=merge_)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
