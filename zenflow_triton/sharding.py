"""Parameters sharded by FSDP2 or HSDP (DESIGN §9): DTensors placed ``Shard(0)`` on the shard dimension of their
mesh (and ``Replicate()`` on HSDP's replica dimension). The optimizer runs on each rank's local rows, so everything
here translates between a parameter as the model holds it and the local tensors the kernels and the host see:

- :func:`local`: a tensor's local part (the tensor itself when it is not a DTensor);
- :func:`check_placement`: the clear error for any other placement (``Shard(1)``, tensor parallel);
- :func:`shard_group` / :func:`all_reduce_`: the process group that holds one parameter's rows, and a bucketed sum
  over it (the column scores, so that every rank selects what a single process would);
- :func:`to_saved` / :func:`to_local_rows`: checkpoint tensors as DTensors with the parameter's placement (so
  ``torch.distributed.checkpoint`` reshards them) and back.

Nothing here is used, or imports ``torch.distributed``, for plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "add_summed_scores_",
    "all_reduce_",
    "check_placement",
    "is_sharded",
    "like_param",
    "local",
    "local_matrix_shape",
    "shard_group",
    "to_local_rows",
    "to_saved",
]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed support
        return None
    return DTensor


_DTENSOR = _dtensor_type()


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a parameter or gradient of FSDP2 / HSDP)."""
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local part of ``t`` (a view of its storage, so in-place updates reach the parameter), or ``t`` itself."""
    return t.to_local() if is_sharded(t) else t


def local_matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    """The ``[rows, C]`` matrix view of ``p``'s local part: its own rows (none on a rank with an empty shard), and the
    global column count (the columns are the same on every rank under ``Shard(0)``)."""
    cols = p.numel() // p.shape[0]
    return local(p).shape[0], cols


def check_placement(p: torch.Tensor, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``p`` is a plain tensor or a DTensor sharded on dim 0 along at
    most one mesh dimension and replicated along the others (FSDP2, HSDP)."""
    if not is_sharded(p):
        return
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(p.placements)
    shards = [pl for pl in placements if isinstance(pl, Shard)]
    ok = all(isinstance(pl, (Shard, Replicate)) for pl in placements) and len(shards) <= 1 and all(
        pl.dim == 0 for pl in shards)
    if not ok:
        raise ValueError(
            f"{where} is a DTensor placed {placements} on a {p.device_mesh.ndim}-D mesh; ZenFlowAdamW supports "
            "FSDP2/HSDP placements (Shard(0) on one mesh dimension, Replicate() on the others): its column selection "
            "needs every column of a row on one rank. Shard(1) and tensor parallelism are not supported."
        )


def shard_group(p: torch.Tensor) -> Any:
    """The process group over which ``p``'s rows are sharded (None: not sharded, or only replicated)."""
    if not is_sharded(p):
        return None
    from torch.distributed.tensor import Shard

    for dim, pl in enumerate(p.placements):
        if isinstance(pl, Shard):
            return p.device_mesh.get_group(dim)
    return None


def all_reduce_(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """Sum each tensor over ``group``, in place, with one collective: the tensors are packed into one flat buffer
    (every rank passes the same shapes in the same order)."""
    if not tensors:
        return
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def add_summed_scores_(items: Sequence[tuple[Any, torch.Tensor, torch.Tensor]]) -> None:
    """For each ``(group, delta, score)`` of sharded parameters: sum this step's local ``delta`` over ``group`` (one
    all-reduce per group, bucketed) and add it to ``score``, so every rank adds the same numbers in the same order and
    the scores stay the same on every rank."""
    by_group: dict[Any, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for group, delta, score in items:
        by_group.setdefault(group, []).append((delta, score))
    for group, pairs in by_group.items():
        all_reduce_([delta for delta, _ in pairs], group)
        for delta, score in pairs:
            score.add_(delta)


def to_saved(t: torch.Tensor, p: torch.Tensor, *, per_column: bool) -> torch.Tensor:
    """A checkpoint tensor for sharded ``p``: ``t`` is this rank's rows of a parameter-shaped tensor, or (with
    ``per_column``) a vector that is the same on every rank. Returned as a DTensor with ``p``'s placement (the
    vector replicated), so ``torch.distributed.checkpoint`` can load it on another world size."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = p.device_mesh
    if per_column:
        saved = DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
    else:
        saved = DTensor.from_local(t, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    if saved.device != t.device:
        # from_local moved the host tensor to the mesh's device (the GPU): bring it back at once, as
        # torch.distributed.checkpoint's own cpu_offload does, so the device holds one weight's local rows at a time,
        # never the whole host state.
        saved = saved.to(t.device)
    return saved


def to_local_rows(t: torch.Tensor, p: torch.Tensor, *, per_column: bool) -> torch.Tensor:
    """The inverse of :func:`to_saved` for any saved form: a DTensor of any placement (resharded to ``p``'s), or a
    plain tensor of the whole parameter (this rank's rows taken) or vector. Plain tensors pass through when ``p`` is
    not sharded."""
    if not is_sharded(p):
        return t.full_tensor() if is_sharded(t) else t
    from torch.distributed.tensor import Replicate, distribute_tensor

    if per_column:
        if is_sharded(t):
            return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim).to_local()
        return t
    if is_sharded(t):
        if tuple(t.placements) != tuple(p.placements):
            t = t.redistribute(p.device_mesh, p.placements)
        return t.to_local()
    # Every rank holds the whole tensor: each keeps its own rows, no communication (src_data_rank=None).
    return distribute_tensor(t.to(local(p).device), p.device_mesh, p.placements, src_data_rank=None).to_local()


def like_param(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A tensor of ``p``'s shape laid out as ``p`` is: a DTensor with its placement when ``p`` is sharded (``t`` a
    DTensor of any placement, or the whole tensor on every rank), a plain tensor otherwise."""
    if not is_sharded(p):
        return t.full_tensor() if is_sharded(t) else t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(to_local_rows(t, p, per_column=False), p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())
