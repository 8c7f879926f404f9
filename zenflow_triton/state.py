"""The optimizer state of a parameter, laid out in one place (DESIGN §4): which entries exist, where they live,
how they are allocated, initialized, saved and loaded.

An offloaded parameter ``[R, C]`` keeps in ``optimizer.state[p]``:

- host (slab views, pinned with CUDA): ``host_master`` (fp32 ``[R, C]``), ``host_exp_avg``, ``host_exp_avg_sq``
  (``[R, C]``, fp32, or bf16 with ``state_dtype="bfloat16"``), ``host_col_step`` (int32 ``[C]``);
- device: ``score`` (fp32 ``[C]``), ``slot`` (int32 ``[C]``, -1 = unselected), ``col_step`` (int32 ``[C]``),
  the compact ``master``/``exp_avg``/``exp_avg_sq`` of the k selected columns (fp32 ``[R, k]``), ``acc`` (fp32
  ``[R, C]``, the unselected columns' gradient sum of the open window; with accumulate="host" a host slab view
  instead, one of the record's ``sums``);
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

from .columns import ColumnMasks
from .host_memory import HostSlab
from .kernels import AdamHyperparams, reference
from .sharding import like_param, local, local_matrix_shape, shard_group

__all__ = [
    "DEVICE_KEYS",
    "HOST_KEYS",
    "OffloadedParam",
    "allocate",
    "device_state_bytes",
    "init_offloaded",
    "init_resident",
    "load_offloaded",
    "load_resident",
    "rehome",
    "step_resident_",
]

# State entries in the host slab.
HOST_KEYS = ("host_master", "host_exp_avg", "host_exp_avg_sq", "host_col_step")
# State entries on the parameter's device.
DEVICE_KEYS = ("score", "slot", "col_step", "master", "exp_avg", "exp_avg_sq", "acc")


@dataclass
class OffloadedParam:
    """Per-offloaded-parameter buffers that are not optimizer state: derivable from it, or transient."""

    rows: int
    cols: int
    landing: torch.Tensor | None  # host gradient landing buffer [R, C], fp32 or bf16 (None with accumulate="host")
    snapshot: torch.Tensor | None  # host model-dtype copy for the trip back; None: the fp32 master serves (rounded)
    masks: ColumnMasks
    # The host master is the parameter's own memory (fp32 parameters on the CPU with overlap=False, see allocate).
    master_is_param: bool = False
    d2h_done: torch.cuda.Event | None = None  # acc may be overwritten only after its copy left the device
    # The state's host entries (HOST_KEYS) as allocated: slab views, or the parameter itself for the master when
    # ``master_is_param``. ``Pipeline.rehome`` points ``state[p]`` back at them after a state mover replaced them.
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    # The process group over which a sharded (FSDP2) parameter's rows are split; None for a plain tensor.
    group: Any = None
    # The parameter's (local) shape and dtype when its state was made: a parameter whose storage is replaced by
    # another shape or dtype (``p.data = ...``) no longer fits it (params.check_unchanged).
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    _score_delta: torch.Tensor | None = None
    # accumulate="host" (DESIGN §4): the window sum lives in host memory, in one fp32 buffer or two that alternate
    # by window (the job of window w reads one while window w+1's steps are added into the other;
    # staging.window_sums), and each step's gradient lands in the pipeline's landing ring, or with
    # grads_in_backward in the one capture slot of ``slots``, in ``slot_dtype``. None on the device path, where
    # ``acc`` is on the device and ``landing`` receives its sum once per window.
    sums: tuple[torch.Tensor, ...] | None = None
    slots: tuple[torch.Tensor] | None = None
    slot_dtype: torch.dtype | None = None
    parity: int = 0  # which of ``sums`` is the open window's (``state["acc"]``)

    def flip_sum(self, st: dict[str, Any]) -> None:
        """accumulate="host", at a window end: the next window sums into the other buffer, if there are two."""
        self.parity = (self.parity + 1) % len(self.sums)
        st["acc"] = self.host["acc"] = self.sums[self.parity]

    def score_delta(self) -> torch.Tensor:
        """A sharded parameter's per-step buffer for its local column scores, summed over ``group`` before it is
        added to ``score`` (allocated at first use, on the device)."""
        if self._score_delta is None:
            self._score_delta = torch.zeros(self.cols, dtype=torch.float32, device=self.masks.selected.device)
        return self._score_delta


def allocate(
    params: Sequence[torch.Tensor], state: MutableMapping[torch.Tensor, dict[str, Any]], *, grad_dtype: torch.dtype,
    overlap: bool, host_sums: bool = False, sums: int = 2, capture: bool = False, state_dtype: str = "float32",
    snapshot: bool = True,
) -> tuple[HostSlab, dict[torch.Tensor, OffloadedParam]]:
    """One host slab for these parameters' master, moments, step counts, landing and snapshot buffers; sets
    ``state[p]`` to its host entries (uninitialized) and returns the slab and each parameter's record.

    An fp32 parameter on the CPU with ``overlap=False`` is its own host master: every host result is due in
    the parameter when ``step()`` returns, so a separate copy would only add a stream to every host pass.

    ``host_sums`` (accumulate="host"): instead of one landing buffer for the window sum, ``sums`` fp32 window sums
    (1 or 2: :func:`.staging.window_sums`) and, with ``capture`` (grads_in_backward), one capture slot that the
    gradient lands in during backward; without it the gradients land in the pipeline's ring (not here). Landed
    gradients are bf16 with ``grad_dtype`` bfloat16, else in the gradient's own dtype (a bf16 or fp16 gradient
    widens to fp32 exactly, so landing it as it is halves the copy and changes nothing).

    ``state_dtype`` "bfloat16": ``host_exp_avg``/``host_exp_avg_sq`` in bf16 (the host kernel rounds them
    stochastically); the master stays fp32. ``snapshot`` False (host_snapshot): no model-dtype snapshot; the merge
    reads the fp32 master and rounds it.
    """
    moment_dtype = torch.bfloat16 if state_dtype == "bfloat16" else torch.float32
    requests: list[tuple[tuple[int, ...], torch.dtype]] = []
    alias = [p.device.type == "cpu" and p.dtype == torch.float32 and not overlap for p in params]
    for p, own_master in zip(params, alias):
        rows, cols = local_matrix_shape(p)
        requests += [((rows, cols), torch.float32)] * (0 if own_master else 1) + [((rows, cols), moment_dtype)] * 2
        requests.append(((cols,), torch.int32))
        if host_sums:
            slot_dtype = torch.bfloat16 if grad_dtype == torch.bfloat16 else p.dtype
            requests += [((rows, cols), torch.float32)] * sums + [((rows, cols), slot_dtype)] * int(capture)
        else:
            requests.append(((rows, cols), grad_dtype))
        if snapshot and p.dtype != torch.float32:
            requests.append(((rows, cols), p.dtype))
    pin = any(p.device.type == "cuda" for p in params)
    slab = HostSlab(requests, pin=pin)
    views = iter(slab.views)
    records: dict[torch.Tensor, OffloadedParam] = {}
    for p, own_master in zip(params, alias):
        rows, cols = local_matrix_shape(p)
        st = state[p] = {}
        st["host_master"] = local(p).detach().view(rows, cols) if own_master else next(views)
        st["host_exp_avg"], st["host_exp_avg_sq"] = next(views), next(views)
        st["host_col_step"] = next(views)
        held = slots = landing = None
        if host_sums:
            held = tuple(next(views) for _ in range(sums))
            slots = (next(views),) if capture else None
        else:
            landing = next(views)
        snap = next(views) if snapshot and p.dtype != torch.float32 else None
        records[p] = OffloadedParam(rows=rows, cols=cols, landing=landing, snapshot=snap,
                                    masks=ColumnMasks.empty(cols, p.device), master_is_param=own_master,
                                    host={key: st[key] for key in HOST_KEYS}, group=shard_group(p), sums=held,
                                    slots=slots, shape=tuple(local(p).shape), dtype=p.dtype,
                                    slot_dtype=torch.bfloat16 if grad_dtype == torch.bfloat16 else p.dtype)
        if host_sums:
            st["acc"] = records[p].host["acc"] = held[0]
    return slab, records


def init_offloaded(p: torch.Tensor, st: dict[str, Any], rec: OffloadedParam) -> None:
    """Fresh state: the master is the parameter, moments and step counts zero, nothing selected yet."""
    rows, cols = rec.rows, rec.cols
    dev = p.device
    st["step"] = 0
    if not rec.master_is_param:
        st["host_master"].copy_(local(p).detach().view(rows, cols))
    st["host_exp_avg"].zero_()
    st["host_exp_avg_sq"].zero_()
    st["host_col_step"].zero_()
    st["score"] = torch.zeros(cols, dtype=torch.float32, device=dev)
    st["slot"] = torch.full((cols,), -1, dtype=torch.int32, device=dev)
    st["col_step"] = torch.zeros(cols, dtype=torch.int32, device=dev)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        st[key] = torch.zeros((rows, 0), dtype=torch.float32, device=dev)
    if rec.sums is None:
        st["acc"] = torch.zeros((rows, cols), dtype=torch.float32, device=dev)
    else:
        st["acc"].zero_()  # the host window sum (accumulate="host"), bound by allocate
    st["acc_count"] = 0
    st["pending"] = False
    rec.masks.refresh(st["slot"])


def load_offloaded(p: torch.Tensor, st: dict[str, Any], rec: OffloadedParam, saved: Mapping[str, Any], *,
                   write_own_master: bool = True) -> None:
    """Load a checkpoint entry (format 2, checked: :func:`.checkpoint.check_offloaded`) into the slab views and onto
    the parameter's device; rebuild what derives from it. The selected columns' state goes to the compact device
    arrays; the host arrays get every column (they are read only where a column is unselected).
    ``write_own_master=False``: a parameter that is its own master (``rec.master_is_param``) is left unwritten, for
    the caller to copy the saved master into once nothing else can fail."""
    rows, cols = rec.rows, rec.cols
    dev = p.device
    selected = saved["selected"].detach().cpu().bool()
    idx = torch.nonzero(selected).squeeze(1)
    slot = torch.full((cols,), -1, dtype=torch.int32)
    slot[idx] = torch.arange(idx.numel(), dtype=torch.int32)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        full = saved[key].detach().cpu().reshape(rows, cols)
        if key != "master" or not rec.master_is_param or write_own_master:
            st["host_" + key].copy_(full)
        st[key] = full[:, idx].to(dev, dtype=torch.float32, copy=True)
    st["host_col_step"].copy_(saved["col_step"])
    st["col_step"] = saved["col_step"].to(dev, dtype=torch.int32, copy=True)
    st["score"] = saved["score"].to(dev, dtype=torch.float32, copy=True)
    st["slot"] = slot.to(dev)
    if rec.sums is None:
        st["acc"] = saved["acc"].detach().reshape(rows, cols).to(dev, dtype=torch.float32, copy=True)
    else:  # accumulate="host": the same entry, into the host window sum (the format does not depend on the mode)
        st["acc"].copy_(saved["acc"].detach().reshape(rows, cols))
    st["step"] = int(saved["step"])
    st["acc_count"] = int(saved["acc_count"])
    st["pending"] = bool(saved["pending"])
    rec.masks.refresh(st["slot"])
    if st["pending"] and rec.snapshot is not None:
        # The snapshot is master rounded to the model dtype on the columns the last job updated,
        # exactly what the host kernel wrote (both round to nearest even).
        cols_done = torch.nonzero(rec.masks.host_slot < 0).squeeze(1)
        rec.snapshot[:, cols_done] = st["host_master"][:, cols_done].to(rec.snapshot.dtype)


def init_resident(p: torch.Tensor) -> dict[str, Any]:
    return {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def load_resident(p: torch.Tensor, saved: Mapping[str, Any]) -> dict[str, Any]:
    """A resident parameter's AdamW state onto ``p``'s device and dtype (as torch converts it); ``step`` an int."""
    step = saved["step"]
    return {"step": int(step.item()) if isinstance(step, torch.Tensor) else int(step),
            "exp_avg": like_param(saved["exp_avg"], p).to(device=p.device, dtype=p.dtype),
            "exp_avg_sq": like_param(saved["exp_avg_sq"], p).to(device=p.device, dtype=p.dtype)}


def step_resident_(state: Mapping[torch.Tensor, dict[str, Any]],
                   resident: Sequence[tuple[AdamHyperparams, Sequence[torch.Tensor]]]) -> None:
    """Plain AdamW on every resident parameter, batched per group, device, dtype and step count (one ``_foreach``
    call per op: a model has several small resident tensors per layer). ``resident``: per group, its record and
    its resident parameters that have a gradient."""
    for hp, params in resident:
        buckets: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]] = {}
        for p in params:
            st = state[p]
            st["step"] += 1
            buckets.setdefault((p.device, p.dtype, st["step"]), []).append(p)
        for (_, _, step), ps in buckets.items():
            sts = [state[p] for p in ps]
            # Sharded (FSDP2) parameters, gradients and moments update through their local parts.
            reference.adam_update_foreach_(
                [local(p) for p in ps], [local(p.grad) for p in ps], [local(st["exp_avg"]) for st in sts],
                [local(st["exp_avg_sq"]) for st in sts], step=step, hp=hp,
            )


def rehome(records: Mapping[torch.Tensor, OffloadedParam], state: MutableMapping[torch.Tensor, dict[str, Any]]) -> None:
    """Undo what state movers did (Lightning moves every tensor of ``optimizer.state`` to the model's device after
    loading a checkpoint, and to the CPU at the end of ``fit``): host entries point back at their slab views,
    device entries go back to the parameter's device. A mover copies, it never changes values, and the slab
    view may be newer than a copy taken while a host job ran, so host entries are rebound, not copied back;
    write state through ``load_state_dict()``."""
    for p, rec in records.items():
        st = state[p]
        data = local(p)
        on_host = rec.host
        if rec.master_is_param and rec.host["host_master"].data_ptr() != data.data_ptr():
            # The parameter got new storage (``p.data = ...``): its values are the master from now on, as a
            # plain torch optimizer would read them, instead of updates landing in memory the model let go.
            rec.host["host_master"] = data.detach().view(rec.rows, rec.cols)
        for key, home in rec.host.items():
            if st[key] is not home:
                st[key] = home
        for key in DEVICE_KEYS:
            if key not in on_host and st[key].device != p.device:
                st[key] = st[key].to(p.device)


def device_state_bytes(records: Mapping[torch.Tensor, OffloadedParam], state: Mapping[Any, Mapping[str, Any]]) -> int:
    """Bytes of the offloaded parameters' state entries on the device (``acc`` unless accumulate="host", the
    compact selected state, the per-column vectors) and of their score buffers (sharded parameters)."""
    total = 0
    for p, rec in records.items():
        st = state.get(p, {})
        for key in DEVICE_KEYS:
            t = st.get(key)
            if key not in rec.host and isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
        if rec._score_delta is not None:
            total += rec._score_delta.numel() * 4
    return total
