"""One choice for every process (DESIGN §9): what ``"auto"`` decides from this machine's figures and this rank's
measured step time (the plan: ``topk_ratio``, ``update_interval``, ``host_lr_scale``, ``overlap_steps``; and the
window sums' placement) is decided on rank 0 and broadcast when ``torch.distributed`` is initialized with more than
one process. Ranks that chose apart would run different schedules: under FSDP2's global selection their collectives
would not match (a hang, or shards stepping different columns).

Every rank of the default process group calls these at the same point (each optimizer's first step after warm-up,
its first step or a load): an optimizer with ``"auto"`` knobs must be built on every rank, as FSDP's are."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["distributed", "on_rank_zero"]

T = TypeVar("T")


def distributed() -> bool:
    """Whether torch.distributed is initialized with more than one process."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def on_rank_zero(decide: Callable[[], T]) -> T:
    """``decide()`` in one process: here without torch.distributed, else on rank 0, its result (picklable) sent to
    every rank. The other ranks do not call it (no probe, no planning): they wait for rank 0's."""
    if not distributed():
        return decide()
    dist = torch.distributed
    box = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
