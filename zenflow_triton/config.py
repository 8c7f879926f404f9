"""The one configuration object shared by the optimizer, the autotuner and the JSON profile."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ZenFlowConfig", "DEFAULT_SELECT_WINDOWS"]

# A selection step first drains the host pipeline (DESIGN §3 step 2), which exposes one host job as stall.
# Reselecting every 8 windows exposes at most 1/8 of the host work while still following a drifting set of
# important columns within a few dozen steps (the paper reports high overlap of the top-k sets over hundreds
# of steps).
DEFAULT_SELECT_WINDOWS = 8

Auto = Literal["auto"]


@dataclass(frozen=True)
class ZenFlowConfig:
    """Optimizer-wide ZenFlow settings (per-group lr/betas/eps/weight_decay live in the param groups)."""

    topk_ratio: float | Auto = 0.1
    """Fraction of each offloaded weight's columns updated on the device every step (k = ceil(r*C))."""
    update_interval: int | Auto = 4
    """U: steps per window; the host applies the accumulated unselected columns once per window."""
    select_interval: int | None = None
    """S: steps between reselections of the top-k columns, a multiple of U; None means 8*U."""
    warmup_steps: int = 100
    """Steps of plain synchronous AdamW on every element before selection starts (at least 5 while a knob is "auto"
    to plan; docs/quality.md: the default keeps a from-scratch run's first, fast-moving steps dense)."""
    overlap: bool = True
    """Run host windows asynchronously and apply their result one window late (bounded staleness)."""
    min_offload_numel: int = 4096
    """Parameters with ndim >= 2 and at least this many elements are offloaded; the rest stay resident."""
    cpu_threads: int | None = None
    """numba threads of the host worker; None leaves one core for the training process."""
    backend: Literal["auto", "triton", "numba", "torch"] = "auto"
    """Device-side kernels: triton (CUDA, or CPU under TRITON_INTERPRET=1), numba (CPU tensors), torch (plain
    torch, any device), or auto (triton on CUDA, numba on CPU)."""
    grad_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient landing buffer on the host; bfloat16 halves device-to-host traffic."""
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of exp_avg/exp_avg_sq on the host (the master and the device's compact state stay fp32); bfloat16 saves
    4 B/param, each host update rounding them stochastically (docs/quality.md). Fixed for the optimizer's life."""
    worker_timeout: float = 600.0
    """Seconds step() waits for one host job before declaring the worker hung (RuntimeError)."""
    # Device memory (issue 18): where the window's gradient sum lives.
    accumulate: Literal["auto", "device", "host"] = "auto"
    """Where the unselected columns' window sum is kept: "device" (an fp32 acc on the device, 4 B/param there, one
    copy per window), "host" (each step's gradient is copied to pinned host memory and summed there by the worker:
    no device acc, one copy per step), "auto" (the placement rule: "device" on CPU tensors)."""
    max_grad_norm: float | None = None
    """Clip gradients inside step() to this total L2 norm (torch.nn.utils.clip_grad_norm_'s formula, over all the
    optimizer's parameters); None: no clipping."""
    # Deferred host step (issue 21).
    host_lr_scale: float | Auto = 1.0
    """s: each host window after warm-up takes its AdamW step with lr*s (decoupled decay included); 1.0 is Adam's
    step, the default; "auto": the autotuner's choice from its quality table (1.0 where it measured no gain)."""
    overlap_steps: int | Auto | None = "auto"
    """With overlap=True, how many steps after a window end its host result is merged into the parameters: 1 to
    update_interval; None is update_interval (the next window end, ZenFlow's one window of staleness). Fewer steps
    leave fewer stale gradients in the next window but give its host job less time to finish: step() waits (stall)
    for a job that is not done by then. "auto" (the default): the autotuner's choice, the fewest steps that keep the
    predicted step time within its speed tolerance of update_interval's; 1 on CPU tensors (the host job runs on the
    same cores either way); without overlap, None."""
    quality_regime: Literal["worst", "finetune", "scratch"] = "worst"
    """Which of the autotuner's quality tables "auto" plans with: "finetune" (a pretrained model), "scratch"
    (training from a fresh initialisation), or "worst" (the higher predicted loss of the two)."""
    # Gradients consumed during backward (issue 18).
    grads_in_backward: bool = False
    """Consume each offloaded parameter's gradient in a post-accumulate-grad hook during backward (scores, the
    selected columns into a compact device buffer, the whole gradient to the host landing slot) and set ``p.grad``
    to None, so the model's full gradient never exists on the device; needs accumulate="host" ("auto" picks it)."""

    host_snapshot: bool = True
    """Keep a host copy of each offloaded bf16/fp16 weight in its dtype, which the host job writes for the trip back
    (2 B/param); False: the merge reads the fp32 master and rounds it on the device (the same bits), 2 B/param less
    on the host for twice the host-to-device bytes per window. No effect on fp32 weights (the master serves)."""

    def __post_init__(self) -> None:
        r = self.topk_ratio
        if r != "auto" and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0):
            raise ValueError(f"Invalid topk_ratio: {r!r} (a float in [0, 1] or 'auto')")
        u = self.update_interval
        if u != "auto" and (isinstance(u, bool) or not isinstance(u, int) or u < 1):
            raise ValueError(f"Invalid update_interval: {u!r} (an int >= 1 or 'auto')")
        s = self.select_interval
        if s is not None:
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise ValueError(f"Invalid select_interval: {s!r} (an int >= 1 or None)")
            if isinstance(u, int) and s % u != 0:
                raise ValueError(f"Invalid select_interval: {s} is not a multiple of update_interval={u}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"Invalid warmup_steps: {self.warmup_steps!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"Invalid overlap: {self.overlap!r} (a bool)")
        n = self.min_offload_numel
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"Invalid min_offload_numel: {n!r} (an int >= 0; 0 offloads every matrix)")
        t = self.cpu_threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"Invalid cpu_threads: {t!r} (an int >= 1 or None)")
        if self.backend not in ("auto", "triton", "numba", "torch"):
            raise ValueError(f"Invalid backend: {self.backend!r} (one of 'auto', 'triton', 'numba', 'torch')")
        if self.grad_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"Invalid grad_dtype: {self.grad_dtype!r} (one of 'float32', 'bfloat16')")
        if self.state_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"Invalid state_dtype: {self.state_dtype!r} (one of 'float32', 'bfloat16')")
        if not (isinstance(self.worker_timeout, (int, float)) and self.worker_timeout > 0):
            raise ValueError(f"Invalid worker_timeout: {self.worker_timeout!r}")
        # Device memory (issue 18)
        if self.accumulate not in ("auto", "device", "host"):
            raise ValueError(f"Invalid accumulate: {self.accumulate!r} (one of 'auto', 'device', 'host')")
        # Clipping inside the optimizer (issue 18)
        g = self.max_grad_norm
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g < math.inf):
            raise ValueError(f"Invalid max_grad_norm: {g!r} (a finite float > 0, or None)")
        # Deferred host step (issue 21).
        h = self.host_lr_scale
        if h != "auto" and (isinstance(h, bool) or not isinstance(h, (int, float)) or not (math.isfinite(h) and h > 0)):
            raise ValueError(f"Invalid host_lr_scale: {h!r} (a finite float > 0, 1.0 is Adam's step, or 'auto')")
        k = self.overlap_steps
        if k is not None:
            if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
                raise ValueError(f"Invalid overlap_steps: {k!r} (an int >= 1, 'auto', or None for update_interval)")
            if not self.overlap and k != "auto":
                raise ValueError(f"Invalid overlap_steps={k} with overlap=False: without overlap every host result is "
                                 "in the parameters when step() returns; leave overlap_steps None")
            if u == "auto" and k != "auto":
                raise ValueError(f"Invalid overlap_steps={k} with update_interval='auto': the tuner picks the window "
                                 "for a host job that fills it; give update_interval too, or overlap_steps='auto'")
            if k != "auto" and k > u:
                raise ValueError(f"Invalid overlap_steps: {k} is more than update_interval={u} (a result is merged "
                                 "by the next window end at the latest)")
        if self.quality_regime not in ("worst", "finetune", "scratch"):
            raise ValueError(f"Invalid quality_regime: {self.quality_regime!r} (one of 'worst', 'finetune', 'scratch')")
        # Gradients consumed during backward (issue 18).
        if not isinstance(self.grads_in_backward, bool):
            raise ValueError(f"Invalid grads_in_backward: {self.grads_in_backward!r} (a bool)")
        if not isinstance(self.host_snapshot, bool):
            raise ValueError(f"Invalid host_snapshot: {self.host_snapshot!r} (a bool)")
        if self.grads_in_backward and self.accumulate == "device":
            raise ValueError("Invalid accumulate='device' with grads_in_backward=True: a captured gradient must be "
                             "held until step() (zero_grad() may discard it, micro-batches must sum as .grad does), "
                             "which on the device costs what .grad costs; use accumulate='host' (or 'auto', which "
                             "picks it)")

    @property
    def is_auto(self) -> bool:
        return (self.topk_ratio == "auto" or self.update_interval == "auto" or self.host_lr_scale == "auto"
                or (self.overlap_steps == "auto" and self.overlap))

    def without_planning(self, device_type: str | None) -> ZenFlowConfig | None:
        """This config with ``overlap_steps="auto"`` resolved where no plan is needed, None where one is
        (:func:`~zenflow_triton.autotune.placement.planless_overlap_steps`: None without overlap, 1 on CPU tensors
        with the other knobs fixed)."""
        from .autotune.placement import planless_overlap_steps  # autotune's bridge imports this module

        k = planless_overlap_steps(self, device_type)
        return None if k == "auto" else self.replace(overlap_steps=k)

    def merge_due(self, tau: int) -> bool:
        """Whether step ``tau`` (after warm-up) merges the last window's host result before the next window end:
        ``overlap_steps`` K < U steps after it (DESIGN §3)."""
        k = self.overlap_steps
        u = self.update_interval
        return tau >= 1 and isinstance(k, int) and isinstance(u, int) and tau % u == k

    def resolved_select_interval(self) -> int:
        """S actually used: select_interval, or DEFAULT_SELECT_WINDOWS windows (needs a concrete U)."""
        if not isinstance(self.update_interval, int):
            raise ValueError("select_interval is resolved only once update_interval is concrete")
        if self.select_interval is not None:
            return self.select_interval
        return DEFAULT_SELECT_WINDOWS * self.update_interval

    def topk(self, num_columns: int) -> int:
        """k = ceil(r*C): 0 when r = 0, C when r = 1."""
        if not isinstance(self.topk_ratio, (int, float)):
            raise ValueError("topk is defined only once topk_ratio is concrete")
        # r*C that is an integer up to float error is that integer (0.1 * 30 is 3.0000000000000004 in binary, and k
        # must be 3): r is within half an ulp of the decimal written and the product adds half an ulp, so a few ulps
        # of r*C cover both; anything further above an integer rounds up, however small r is (1e-9 gives k = 1).
        x = self.topk_ratio * num_columns
        n = round(x)
        k = n if abs(x - n) <= 4 * sys.float_info.epsilon * x else math.ceil(x)
        return min(num_columns, k)

    def replace(self, **changes: Any) -> ZenFlowConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ZenFlowConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"Unknown ZenFlowConfig fields: {sorted(unknown)}")
        return cls(**data)
