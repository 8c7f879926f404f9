"""The optimizer state of a parameter, laid out in one place (DESIGN §4): which entries exist, where they live,
how they are allocated, initialized, saved and loaded.

An offloaded parameter ``[R, C]`` keeps in ``optimizer.state[p]``:

- host (slab views, pinned with CUDA): ``host_master``, ``host_exp_avg``, ``host_exp_avg_sq`` (fp32 ``[R, C]``),
  ``host_col_step`` (int32 ``[C]``);
- device: ``score`` (fp32 ``[C]``), ``slot`` (int32 ``[C]``, -1 = unselected), ``col_step`` (int32 ``[C]``),
  the compact ``master``/``exp_avg``/``exp_avg_sq`` of the k selected columns (fp32 ``[R, k]``), ``acc`` (fp32
  ``[R, C]``, the unselected columns' gradient sum of the open window);
- counters: ``step``, ``acc_count`` (gradients in ``acc``), ``pending`` (a host result still to be merged into the
  parameter).

Buffers that are not state (derivable or transient: the landing buffer, the snapshot, the masks) are in the
parameter's :class:`OffloadedParam` record, which the pipeline owns. A resident parameter keeps what
``torch.optim.AdamW`` keeps: ``step``, ``exp_avg``, ``exp_avg_sq``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .columns import ColumnMasks, matrix_shape
from .host_memory import HostSlab

__all__ = [
    "DEVICE_KEYS",
    "HOST_KEYS",
    "OffloadedParam",
    "allocate",
    "check_saved_offloaded",
    "check_saved_resident",
    "init_offloaded",
    "init_resident",
    "load_offloaded",
    "load_resident",
    "saved_entries",
]

# State entries in the host slab.
HOST_KEYS = ("host_master", "host_exp_avg", "host_exp_avg_sq", "host_col_step")
# State entries on the parameter's device.
DEVICE_KEYS = ("score", "slot", "col_step", "master", "exp_avg", "exp_avg_sq", "acc")
_COUNTER_KEYS = ("step", "acc_count", "pending")


@dataclass
class OffloadedParam:
    """Per-offloaded-parameter buffers that are not optimizer state: derivable from it, or transient."""

    rows: int
    cols: int
    landing: torch.Tensor  # host gradient landing buffer [R, C], fp32 or bf16
    snapshot: torch.Tensor | None  # host model-dtype copy for the trip back; None: the fp32 master serves
    masks: ColumnMasks
    # The host master is the parameter's own memory (fp32 parameters on the CPU with overlap=False, see allocate).
    master_is_param: bool = False
    d2h_done: torch.cuda.Event | None = None  # acc may be overwritten only after its copy left the device
    # The state's host entries (HOST_KEYS) as allocated: slab views, or the parameter itself for the master when
    # ``master_is_param``. ``Pipeline.rehome`` points ``state[p]`` back at them after a state mover replaced them.
    host: dict[str, torch.Tensor] = field(default_factory=dict)


def allocate(
    params: Sequence[torch.Tensor], state: MutableMapping[torch.Tensor, dict[str, Any]], *, grad_dtype: torch.dtype,
    overlap: bool,
) -> tuple[HostSlab, dict[torch.Tensor, OffloadedParam]]:
    """One host slab for these parameters' master, moments, step counts, landing and snapshot buffers; sets
    ``state[p]`` to its host entries (uninitialized) and returns the slab and each parameter's record.

    An fp32 parameter on the CPU with ``overlap=False`` is its own host master: every host result is due in
    the parameter when ``step()`` returns, so a separate copy would only add a stream to every host pass.
    """
    requests: list[tuple[tuple[int, ...], torch.dtype]] = []
    alias = [p.device.type == "cpu" and p.dtype == torch.float32 and not overlap for p in params]
    for p, own_master in zip(params, alias):
        rows, cols = matrix_shape(p)
        requests += [((rows, cols), torch.float32)] * (2 if own_master else 3)
        requests += [((cols,), torch.int32), ((rows, cols), grad_dtype)]
        if p.dtype != torch.float32:
            requests.append(((rows, cols), p.dtype))
    pin = any(p.device.type == "cuda" for p in params)
    slab = HostSlab(requests, pin=pin)
    views = iter(slab.views)
    records: dict[torch.Tensor, OffloadedParam] = {}
    for p, own_master in zip(params, alias):
        rows, cols = matrix_shape(p)
        st = state[p] = {}
        st["host_master"] = p.detach().view(rows, cols) if own_master else next(views)
        st["host_exp_avg"], st["host_exp_avg_sq"] = next(views), next(views)
        st["host_col_step"] = next(views)
        landing = next(views)
        snapshot = next(views) if p.dtype != torch.float32 else None
        records[p] = OffloadedParam(rows=rows, cols=cols, landing=landing, snapshot=snapshot,
                                    masks=ColumnMasks.empty(cols, p.device), master_is_param=own_master,
                                    host={key: st[key] for key in HOST_KEYS})
    return slab, records


def init_offloaded(p: torch.Tensor, st: dict[str, Any], rec: OffloadedParam) -> None:
    """Fresh state: the master is the parameter, moments and step counts zero, nothing selected yet."""
    rows, cols = rec.rows, rec.cols
    dev = p.device
    st["step"] = 0
    if not rec.master_is_param:
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
    rec.masks.refresh(st["slot"])


def load_offloaded(p: torch.Tensor, st: dict[str, Any], rec: OffloadedParam, saved: Mapping[str, Any]) -> None:
    """Copy a saved state into the slab views and onto the parameter's device; rebuild what derives from it."""
    for key in HOST_KEYS:
        src = saved[key]
        if tuple(src.shape) != tuple(st[key].shape):
            raise ValueError(f"state '{key}' has shape {tuple(src.shape)}, expected {tuple(st[key].shape)} for "
                             f"parameter of shape {tuple(p.shape)}")
        st[key].copy_(src)
    for key in DEVICE_KEYS:
        dtype = torch.int32 if key in _INT_KEYS else torch.float32
        st[key] = saved[key].to(p.device, dtype=dtype, copy=True)
    for key in _COUNTER_KEYS:
        st[key] = int(saved[key]) if key != "pending" else bool(saved[key])
    rec.masks.refresh(st["slot"])
    if st["pending"] and rec.snapshot is not None:
        # The snapshot is master rounded to the model dtype on the columns the last job updated,
        # exactly what the host kernel wrote (both round to nearest even).
        cols = torch.nonzero(rec.masks.host_slot < 0).squeeze(1)
        rec.snapshot[:, cols] = st["host_master"][:, cols].to(rec.snapshot.dtype)


_INT_KEYS = ("host_col_step", "slot", "col_step")


def _check_tensor(where: str, key: str, value: Any, shape: tuple[int, ...]) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}: saved state '{key}' is a {type(value).__name__}, expected a tensor of shape "
                         f"{shape}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{where}: saved state '{key}' has shape {tuple(value.shape)}, expected {shape}")
    if key in _INT_KEYS:
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{where}: saved state '{key}' has dtype {value.dtype}, expected an integer dtype")
    elif not value.is_floating_point():
        raise ValueError(f"{where}: saved state '{key}' has dtype {value.dtype}, expected a floating-point dtype")


def check_saved_offloaded(p: torch.Tensor, saved: Mapping[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``saved`` is an offloaded parameter's state that
    :func:`load_offloaded` can load for ``p``: every entry present, with ``p``'s shapes, a consistent selection
    and sane counters. Floating-point entries in another float dtype are accepted (converted to fp32 on load)."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"{where}: saved state is a {type(saved).__name__}, expected a dict")
    missing = [k for k in (*HOST_KEYS, *DEVICE_KEYS, *_COUNTER_KEYS) if k not in saved]
    if missing:
        raise ValueError(f"{where}: saved state lacks {missing} (saved by another optimizer or version?)")
    rows, cols = matrix_shape(p)
    for key in ("host_master", "host_exp_avg", "host_exp_avg_sq", "acc"):
        _check_tensor(where, key, saved[key], (rows, cols))
    for key in ("host_col_step", "score", "slot", "col_step"):
        _check_tensor(where, key, saved[key], (cols,))
    slot = saved["slot"].detach().cpu().long()
    k = int((slot >= 0).sum())
    if not torch.equal(slot[slot >= 0], torch.arange(k)) or bool((slot < -1).any()):
        raise ValueError(f"{where}: saved state 'slot' is not a selection (-1, or the selected columns' ranks "
                         "0..k-1 in column order)")
    for key in ("master", "exp_avg", "exp_avg_sq"):
        _check_tensor(where, key, saved[key], (rows, k))
    for key in ("step", "acc_count"):
        v = saved[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}: saved state '{key}' is {v!r}, expected an int >= 0")
    if not isinstance(saved["pending"], bool):
        raise ValueError(f"{where}: saved state 'pending' is {saved['pending']!r}, expected a bool")


def check_saved_resident(p: torch.Tensor, saved: Mapping[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``saved`` is a resident parameter's AdamW state for ``p``."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"{where}: saved state is a {type(saved).__name__}, expected a dict")
    missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in saved]
    if missing:
        raise ValueError(f"{where}: saved state lacks {missing} (saved by another optimizer or version?)")
    for key in ("exp_avg", "exp_avg_sq"):
        _check_tensor(where, key, saved[key], tuple(p.shape))
    step = saved["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{where}: saved state 'step' is {step!r}, expected an int >= 0")


def init_resident(p: torch.Tensor) -> dict[str, Any]:
    return {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def load_resident(p: torch.Tensor, saved: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.to(device=p.device, dtype=p.dtype) if isinstance(v, torch.Tensor) and k != "step" else v)
            for k, v in saved.items()}


def saved_entries(st: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's state as ``state_dict()`` returns it: host arrays copied, device tensors by reference (as in
    torch). The host arrays are views into one shared slab, which ``torch.save`` could not write (it refuses one
    storage viewed as several dtypes), or into the parameter itself (a master that is the parameter); on CPU
    tensors ``acc`` may be a slab view too (it trades places with the landing buffer)."""
    return {k: (v.clone() if k in HOST_KEYS or (k == "acc" and v.device.type == "cpu") else v) for k, v in st.items()}
