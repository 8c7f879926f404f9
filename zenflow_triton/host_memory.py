"""Host buffers: one large (pinned, where CUDA is used) allocation carved into typed views.

Per-tensor ``pin_memory=True`` goes through the caching host allocator, which rounds every block up to a
power of two (up to 1.9x the memory asked for). One slab per request list holds every buffer instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["HostSlab", "ALIGN_BYTES"]

# 64 bytes: one cache line and an AVX-512 vector, so numba's vectorized loops never straddle two lines
# at a view's start; DMA engines need far less.
ALIGN_BYTES = 64


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class HostSlab:
    """A single host allocation holding one contiguous tensor per ``(shape, dtype)`` request.

    ``pin=True`` page-locks the slab (needs CUDA); the views then serve as sources and targets of
    asynchronous copies. ``views[i]`` answers ``requests[i]``; all of them keep the slab alive.
    """

    def __init__(self, requests: Sequence[tuple[Sequence[int], torch.dtype]], *, pin: bool) -> None:
        if pin and not torch.cuda.is_available():
            raise RuntimeError("pinned host memory needs CUDA; pass pin=False on a machine without a GPU")
        offsets = []
        total = 0
        for shape, dtype in requests:
            numel = 1
            for s in shape:
                numel *= int(s)
            offsets.append((total, numel))
            total = _round_up(total + numel * dtype.itemsize, ALIGN_BYTES)
        self.pinned = pin
        self.nbytes = total
        self._storage = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        self.views: list[torch.Tensor] = []
        for (shape, dtype), (offset, numel) in zip(requests, offsets):
            raw = self._storage[offset : offset + numel * dtype.itemsize]
            self.views.append(raw.view(dtype).view(tuple(int(s) for s in shape)))
