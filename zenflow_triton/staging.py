"""Staging buffers (DESIGN §4, §5): where data waits between a copy and the kernel that reads it.

- :class:`LandingRing` (accumulate="host", without grads_in_backward): each step's offloaded gradients land, in
  pieces, in a ring of :data:`RING_CHUNKS` pinned host chunks, and the adder drains each piece into its window sum.
  The ring is bounded by a budget (:func:`ring_chunk_bytes`), not by the model: when every chunk is still waiting
  for its add, the training thread waits for the oldest (back-pressure, counted as stall).
- :class:`MergeStaging` (CUDA): the device buffers the merge's host-to-device copies land in.
- :func:`window_sums` (the layout's rule, in ``autotune.placement`` beside the host layout it sizes): how many fp32
  window sums a schedule needs on the host (one where the next window's first gradients can wait in the ring until
  the previous window's job has read its sum).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from .autotune import placement
from .autotune.placement import (
    RING_CHUNKS,
    RING_FRACTION,
    RING_MAX_CHUNK_BYTES,
    RING_MIN_CHUNK_BYTES,
    window_sums,
)
from .host_memory import HostSlab

__all__ = ["MergeStaging", "LandingRing", "RING_CHUNKS", "ring_bytes", "ring_chunk_bytes", "window_sums"]

# The ring's rule is the host layout's (autotune/placement.py: RING_CHUNKS, ring_chunk_bytes); its bounds are named
# here too so that tests can shrink the ring.
_RING_FRACTION = RING_FRACTION
_MIN_CHUNK_BYTES = RING_MIN_CHUNK_BYTES
_MAX_CHUNK_BYTES = RING_MAX_CHUNK_BYTES

# A chunk claimed for a piece whose add is not submitted yet (it is in the batch being gathered).
_GATHERING = object()


def ring_chunk_bytes(total_bytes: int, largest_bytes: int) -> int:
    """The ring's chunk for a step that lands ``total_bytes`` of gradient (:func:`.placement.ring_chunk_bytes`)."""
    return placement.ring_chunk_bytes(total_bytes, largest_bytes, fraction=_RING_FRACTION, min_chunk=_MIN_CHUNK_BYTES,
                                      max_chunk=_MAX_CHUNK_BYTES)


def ring_bytes(total_bytes: int, largest_bytes: int) -> int:
    """Host bytes of the landing ring for those gradients (:func:`ring_chunk_bytes` × :data:`RING_CHUNKS`)."""
    return RING_CHUNKS * ring_chunk_bytes(total_bytes, largest_bytes)


class LandingRing:
    """A ring of :data:`RING_CHUNKS` host chunks of ``chunk_bytes`` (pinned with ``pin``), reused in order.

    :meth:`claim` hands out the next chunk once the add that read it last is done (``wait``: the caller's, counted
    as stall); :meth:`hold` marks it read by a job. A chunk holds a piece of one gradient, in any dtype."""

    def __init__(self, chunk_bytes: int, *, pin: bool, device: torch.device | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.slab = HostSlab([((chunk_bytes,), torch.uint8)] * RING_CHUNKS, pin=pin, device=device)
        self._busy: list[Any] = [None] * RING_CHUNKS  # per chunk: the add that reads it, _GATHERING, or None
        self._next = 0

    @property
    def nbytes(self) -> int:
        return self.slab.nbytes

    def pieces(self, numel: int, itemsize: int) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` element ranges that cover ``numel`` elements of ``itemsize`` bytes, one chunk each."""
        per = self.chunk_bytes // itemsize
        for start in range(0, numel, per):
            yield start, min(numel, start + per)

    def claim(self, wait: Callable[[Future], None], flush: Callable[[], None]) -> int:
        """The next chunk, free: first ``flush()`` if its piece's add is still being gathered (not submitted), then
        ``wait`` for that add."""
        i = self._next
        if self._busy[i] is _GATHERING:
            flush()
        job = self._busy[i]
        if job is not None:
            wait(job)
        self._busy[i] = _GATHERING
        self._next = (i + 1) % RING_CHUNKS
        return i

    def view(self, i: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Chunk ``i``'s first ``numel`` elements as ``dtype``."""
        return self.slab.views[i].view(dtype)[:numel]

    def hold(self, chunks: list[int], job: Future) -> None:
        """``chunks`` are read by ``job`` (submitted): they are free once it is done."""
        for i in chunks:
            self._busy[i] = job

    def drained(self) -> None:
        """Every add submitted so far is done (the caller waited for the last)."""
        self._busy = [None if b is not _GATHERING else b for b in self._busy]


class MergeStaging:
    """CUDA only. Per source dtype (the model's, or fp32 with ``host_snapshot=False``), a ring of two device buffers
    that the merge's host-to-device copies land in, each entry ``[buffer, filled event (copy stream), free event
    (compute stream)]``: one parameter's copy runs while the previous one's merge kernel reads the other buffer
    (``Pipeline._merge``)."""

    SLOTS = 2

    def __init__(self) -> None:
        self.rings: dict[torch.dtype, list[list[Any]]] = {}

    def take(self, dtype: torch.dtype, device: torch.device, numel: int, compute: torch.cuda.Stream) -> list[Any]:
        """The next entry for ``dtype``, its buffer at least ``numel`` elements (give it back with :meth:`put`)."""
        ring = self.rings.setdefault(dtype, [])
        entry = [None, torch.cuda.Event(), torch.cuda.Event()] if len(ring) < self.SLOTS else ring.pop(0)
        if entry[0] is None or entry[0].numel() < numel:
            # Replacing a buffer is safe without record_stream: it was allocated on the compute stream, whose last
            # use of it (the merge kernel) came after the copy stream's last write (the `filled` event).
            entry[0] = None
            entry[0] = torch.empty(numel, dtype=dtype, device=device)
            # New memory, from the compute stream's pool: kernels queued on that stream before now may still read or
            # write it (activations freed since). Its `free` event, which the copy into it waits on, must then mark
            # this point of the compute stream (for a new entry it was never recorded, and a wait on it did
            # nothing: the copy could land while a queued kernel still used the memory).
            entry[2].record(compute)
        return entry

    def put(self, dtype: torch.dtype, entry: list[Any]) -> None:
        self.rings[dtype].append(entry)

    def buffers(self) -> list[torch.Tensor]:
        return [entry[0] for ring in self.rings.values() for entry in ring if entry[0] is not None]

    def clear(self) -> None:
        self.rings.clear()
