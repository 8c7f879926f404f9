"""Host buffers: one large (pinned, where CUDA is used) allocation carved into typed views.

``pin_memory=True`` goes through PyTorch's caching host allocator, which rounds every block up to a power of
two (up to 1.9x the memory asked for, per tensor or per slab alike). So a slab is ordinary host memory of
exactly the size needed, page-locked in place with ``cudaHostRegister`` and unregistered when the last view
of it is gone.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
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
        # numpy owns the memory: every torch view keeps the array alive, and a finalizer on the array
        # unregisters the pages exactly when the last view dies. Over-allocate to align the first byte.
        raw = np.empty(max(total, 1) + ALIGN_BYTES, dtype=np.uint8)
        skip = -raw.ctypes.data % ALIGN_BYTES
        self._storage = torch.from_numpy(raw)[skip : skip + max(total, 1)]
        if pin:
            _register(raw, self._storage.data_ptr(), max(total, 1))
        self.views: list[torch.Tensor] = []
        for (shape, dtype), (offset, numel) in zip(requests, offsets):
            raw = self._storage[offset : offset + numel * dtype.itemsize]
            self.views.append(raw.view(dtype).view(tuple(int(s) for s in shape)))


def _register(owner: np.ndarray, ptr: int, nbytes: int) -> None:
    cudart = torch.cuda.cudart()
    # flags=1 is cudaHostRegisterPortable: the pages count as pinned for every CUDA context.
    err = int(cudart.cudaHostRegister(ptr, nbytes, 1))
    if err != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}; the host may be out of lockable "
            "memory (check `ulimit -l`)"
        )
    weakref.finalize(owner, _unregister, ptr)


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit the CUDA runtime may already be gone
        pass
