"""Tensor argument checks shared by every implementation of an op, so each raises the same clear error.

Every launcher calls one of the ``check_*`` functions before touching memory; hyperparameters are checked once,
when their ``AdamHyperparams`` record is built (``hyperparams.py``). Nothing here copies or converts: an in-place
op handed a non-contiguous tensor must fail, since its update would land on a copy.
"""

from __future__ import annotations

import torch

__all__ = [
    "MODEL_DTYPES",
    "check_column_sumsq_args",
    "check_fused_step_args",
    "check_merge_args",
    "check_host_adamw_args",
    "check_slot_range",
]

# The model (parameter) dtypes every op takes; the package exports it as ``zenflow_triton.kernels.MODEL_DTYPES``.
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_tensor(
    name: str,
    t: object,
    *,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int, ...] | None = None,
    ndim: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {_describe(t)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {_describe(t)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {_describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the parameter, got {_describe(t)}")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense strided tensor, got layout {t.layout}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (in-place ops never copy), got strides {t.stride()} for {_describe(t)}"
        )
    return t


def check_column_sumsq_args(score: torch.Tensor, grad: torch.Tensor) -> tuple[int, int]:
    _check_tensor("grad", grad, dtypes=MODEL_DTYPES, ndim=2)
    rows, cols = grad.shape
    _check_tensor("score", score, dtypes=(torch.float32,), shape=(cols,), device=grad.device)
    return rows, cols


def check_fused_step_args(
    param: torch.Tensor,
    grad: torch.Tensor,
    *,
    score: torch.Tensor,
    slot: torch.Tensor,
    col_step: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    acc: torch.Tensor | None,
    accumulate: bool = False,
) -> tuple[int, int, int]:
    """Returns (R, C, k) after checking every tensor of a fused step against the parameter [R, C]. ``acc=None`` (no
    accumulation target: accumulate="host" keeps the window sum on the host) is allowed, but not with
    ``accumulate=True``, which would add into nothing."""
    _check_tensor("param", param, dtypes=MODEL_DTYPES, ndim=2)
    rows, cols = param.shape
    dev = param.device
    _check_tensor("grad", grad, dtypes=(param.dtype,), shape=(rows, cols), device=dev)
    _check_tensor("score", score, dtypes=(torch.float32,), shape=(cols,), device=dev)
    _check_tensor("slot", slot, dtypes=(torch.int32,), shape=(cols,), device=dev)
    _check_tensor("col_step", col_step, dtypes=(torch.int32,), shape=(cols,), device=dev)
    _check_tensor("master", master, dtypes=(torch.float32,), ndim=2, device=dev)
    k = master.shape[1]
    if master.shape[0] != rows or k > cols:
        raise ValueError(f"master must have shape ({rows}, k) with k <= {cols}, got {_describe(master)}")
    _check_tensor("exp_avg", exp_avg, dtypes=(torch.float32,), shape=(rows, k), device=dev)
    _check_tensor("exp_avg_sq", exp_avg_sq, dtypes=(torch.float32,), shape=(rows, k), device=dev)
    if acc is not None:
        _check_tensor("acc", acc, dtypes=(torch.float32,), shape=(rows, cols), device=dev)
    elif accumulate:
        raise ValueError("acc is None (no accumulation target) but accumulate=True asks to add into it; pass an fp32 "
                         f"acc of shape ({rows}, {cols}) or accumulate=False")
    return rows, cols, k


def check_slot_range(slot: torch.Tensor, k: int) -> None:
    """Every slot is -1 (unselected) or in [0, k). Costs a device sync, so launchers call it only when asked."""
    if slot.numel() == 0:
        return
    lo, hi = int(slot.min()), int(slot.max())
    if lo < -1 or hi >= k:
        raise ValueError(f"slot values must be -1 or in [0, {k}), got min {lo}, max {hi}")


def check_merge_args(param: torch.Tensor, snapshot: torch.Tensor, slot: torch.Tensor) -> tuple[int, int]:
    _check_tensor("param", param, dtypes=MODEL_DTYPES, ndim=2)
    rows, cols = param.shape
    # The model dtype (bits copied), or the fp32 master itself (rounded to the model dtype, to nearest even).
    _check_tensor("snapshot", snapshot, dtypes=tuple(dict.fromkeys((param.dtype, torch.float32))), shape=(rows, cols),
                  device=param.device)
    _check_tensor("slot", slot, dtypes=(torch.int32,), shape=(cols,), device=param.device)
    return rows, cols


def check_host_adamw_args(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    slot: torch.Tensor,
    col_step: torch.Tensor,
    snapshot: torch.Tensor | None,
    count: int,
) -> tuple[int, int]:
    """Host buffers are CPU tensors [R, C] (moments fp32, or both bf16: state_dtype);
    grad is the sum of ``count`` gradients in fp32 or bf16 (a landing
    buffer), or fp16 (an fp16 model's own gradient, read in place on CPU tensors)."""
    cpu = torch.device("cpu")
    _check_tensor("master", master, dtypes=(torch.float32,), ndim=2, device=cpu)
    rows, cols = master.shape
    _check_tensor("exp_avg", exp_avg, dtypes=(torch.float32, torch.bfloat16), shape=(rows, cols), device=cpu)
    _check_tensor("exp_avg_sq", exp_avg_sq, dtypes=(exp_avg.dtype,), shape=(rows, cols), device=cpu)
    _check_tensor("grad", grad, dtypes=MODEL_DTYPES, shape=(rows, cols), device=cpu)
    _check_tensor("slot", slot, dtypes=(torch.int32,), shape=(cols,), device=cpu)
    _check_tensor("col_step", col_step, dtypes=(torch.int32,), shape=(cols,), device=cpu)
    if snapshot is not None:
        _check_tensor("snapshot", snapshot, dtypes=MODEL_DTYPES, shape=(rows, cols), device=cpu)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int >= 1 (gradients summed in grad), got {count!r}")
    return rows, cols
