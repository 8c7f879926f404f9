"""Host buffers: one large (pinned, where CUDA is used) allocation carved into typed views.

``pin_memory=True`` goes through PyTorch's caching host allocator, which rounds every block up to a power of
two (up to 1.9x the memory asked for, per tensor or per slab alike). So a slab is page-aligned anonymous memory of
exactly the size needed (an ``mmap``), page-locked in place with ``cudaHostRegister`` and unregistered when the last
view of it is gone.

A pinned slab is marked ``MADV_DONTFORK`` (Linux): a forked process (a DataLoader worker) does not inherit it. Pages
pinned for DMA cannot be shared copy-on-write, so without the mark the kernel copies every pinned page into each
child at fork time: gigabytes per worker, for memory no worker ever reads.

If ``cudaHostRegister`` fails (typically the locked-memory limit, ``ulimit -l``), the slab stays in pageable memory:
everything works, host<->device copies are slower and synchronous; one warning says so. Correct by CUDA's rules for
pageable memory, with the same ``non_blocking=True`` copies the pipeline issues for pinned slabs: a copy into
pageable host memory returns only once it has completed (so after the stream work it waits on), and a copy from it
returns once the source has been staged (so the host may overwrite it right away).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import weakref
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["ALIGN_BYTES", "HostSlab"]

logger = logging.getLogger("zenflow_triton")

# 64 bytes: one cache line and an AVX-512 vector, so numba's vectorized loops never straddle two lines
# at a view's start; DMA engines need far less.
ALIGN_BYTES = 64

# flags=1 is cudaHostRegisterPortable: the pages count as pinned for every CUDA context.
_REGISTER_PORTABLE = 1

# Whether this process already warned that pinning failed (one warning per process, not one per slab).
_warned_unpinned = False
# The same for a refused MADV_DONTFORK.
_warned_fork = False


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class HostSlab:
    """A single host allocation holding one contiguous tensor per ``(shape, dtype)`` request.

    ``pin=True`` page-locks the slab (needs CUDA) on ``device`` (default: the current CUDA device), so the views
    serve as sources and targets of asynchronous copies; if the pages cannot be locked, ``pinned`` is False and the
    views are ordinary memory. ``views[i]`` answers ``requests[i]``; all of them keep the slab alive. The slab
    starts on a page boundary and every view on a multiple of ``ALIGN_BYTES``.
    """

    def __init__(
        self,
        requests: Sequence[tuple[Sequence[int], torch.dtype]],
        *,
        pin: bool,
        device: torch.device | int | None = None,
    ) -> None:
        if pin and not _cuda_available():
            raise RuntimeError("pinned host memory needs CUDA; pass pin=False on a machine without a GPU")
        offsets = []
        total = 0
        for shape, dtype in requests:
            numel = 1
            for s in shape:
                numel *= int(s)
            offsets.append((total, numel))
            total = _round_up(total + numel * dtype.itemsize, ALIGN_BYTES)
        self.nbytes = total
        size = max(total, 1)
        # Anonymous mmap: page-aligned, exactly the pages needed, zero-filled lazily by the kernel. numpy owns the
        # mapping (the array keeps the mmap object alive), torch views keep the array alive, and a finalizer on the
        # array unregisters the pages when the last view dies, before the mapping goes (numpy clears weak references
        # first when an array is freed, and only then releases the mmap it views).
        try:
            pages = _map_pages(_round_up(size, mmap.PAGESIZE))
        except OSError as exc:  # out of memory or address space (ulimit -v): the pre-flight's error, not errno 12
            from .host_budget import allocation_failed

            raise allocation_failed(total, exc) from exc
        self._owner = np.frombuffer(pages, dtype=np.uint8, count=size)
        self._storage = torch.from_numpy(self._owner)
        self.pinned = False
        if pin:
            index = _device_index(device)
            self.pinned = _pin(self._owner, self._storage.data_ptr(), size, index)
            if self.pinned:
                _dont_fork(pages)
        self.views: list[torch.Tensor] = []
        for (shape, dtype), (offset, numel) in zip(requests, offsets):
            raw = self._storage[offset : offset + numel * dtype.itemsize]
            self.views.append(raw.view(dtype).view(tuple(int(s) for s in shape)))


def _map_pages(nbytes: int) -> mmap.mmap:
    """Private anonymous pages. Python's default for ``mmap(-1, n)`` is a *shared* mapping, which forked children
    would share (not copy on write) and which the kernel backs with shmem; private is what malloc would give."""
    private = getattr(mmap, "MAP_PRIVATE", None)
    if private is None:  # Windows: anonymous mappings there are private to the process anyway
        return mmap.mmap(-1, nbytes)
    return mmap.mmap(-1, nbytes, flags=private)


# ---------------------------------------------------------------------------------------------------- CUDA calls
# Module-level functions, so that tests on machines without a GPU can stand in for them.


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _device_index(device: torch.device | int | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def _register_pages(ptr: int, nbytes: int, device: int) -> int:
    """``cudaHostRegister``; returns CUDA's error code (0: success)."""
    # On the parameters' device: the call acts in the current device's context, and a thread whose current device
    # is unset would create a context on GPU 0 (hundreds of MB there, on every rank of a one-GPU-per-process job).
    with torch.cuda.device(device):
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_PORTABLE))


def _unregister_pages(ptr: int, device: int) -> None:
    # A slab can die without close() (the optimizer dropped, interpreter exit) while an asynchronous copy from or
    # into it is still queued; CUDA does not say that unregistering waits for one, and the pages are unmapped right
    # after. Rare (a slab's death), so a device-wide wait costs nothing that matters. A failed wait (a sticky CUDA
    # error) must not keep the pages registered: their addresses may be mapped again.
    with contextlib.suppress(Exception):  # at interpreter exit the CUDA runtime may already be gone
        torch.cuda.synchronize(device)
    with contextlib.suppress(Exception):
        with torch.cuda.device(device):
            torch.cuda.cudart().cudaHostUnregister(ptr)


def _error_string(err: int) -> str:
    """CUDA's message for error code ``err``. The binding takes the ``cudaError`` enum, not an int (given an int it
    raises), as ``torch.cuda.check_error`` calls it."""
    try:
        rt = torch.cuda.cudart()
        return str(rt.cudaGetErrorString(rt.cudaError(err)))
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown error"


def _loaded_cudarts() -> list[str]:
    """Paths of the CUDA runtime libraries mapped into this process (torch's is among them when it links it
    dynamically, as its wheels do)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                path = fields[5].strip() if len(fields) == 6 else ""
                if "libcudart.so" in path and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def _clear_cuda_error(device: int) -> None:
    """Reset CUDA's "last error" after a failed call whose error was handled here.

    A failed ``cudaHostRegister`` stays the calling thread's last error, and torch reads it with
    ``cudaGetLastError`` after its next kernel launch: an unrelated op would fail with this error.
    ``cudaGetLastError`` returns and resets it; torch exposes no binding, so call every CUDA runtime mapped into the
    process. In case torch's own is not among them (linked statically), a tiny launch then reads any error left
    through torch's own check (it raises it once, here, and it is gone).
    """
    for path in _loaded_cudarts():
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(path).cudaGetLastError()
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device=torch.device("cuda", device))


def _pin(owner: np.ndarray, ptr: int, nbytes: int, device: int) -> bool:
    """Page-lock ``nbytes`` at ``ptr`` (memory of ``owner``) and unregister them when ``owner`` dies. On failure,
    clear CUDA's error, warn once per process and return False (the memory stays pageable)."""
    global _warned_unpinned
    err = _register_pages(ptr, nbytes, device)
    if err == 0:
        weakref.finalize(owner, _unregister_pages, ptr, device)
        return True
    _clear_cuda_error(device)
    if not _warned_unpinned:
        _warned_unpinned = True
        logger.warning(
            "zenflow_triton: cudaHostRegister of %d bytes failed (CUDA error %d: %s); the optimizer's host buffers "
            "stay in pageable memory, so host<->device copies are slower and do not overlap. Usually the locked-"
            "memory limit is too low: check `ulimit -l` (unlimited, or at least the optimizer's pinned_bytes; in "
            "a container, --ulimit memlock=-1).", nbytes, err, _error_string(err))
    return False


def _dont_fork(pages: mmap.mmap) -> None:
    """MADV_DONTFORK (Linux): forked children do not get these pages, so the kernel never copies them eagerly
    (pinned pages cannot be shared copy-on-write). Elsewhere a no-op. A kernel that refuses it (a sandbox such as
    gVisor may answer EINVAL) leaves the slab pinned and correct: only a fork then costs a copy of it; one warning."""
    global _warned_fork
    advice = getattr(mmap, "MADV_DONTFORK", None)
    if advice is None or not hasattr(pages, "madvise"):
        return
    try:
        pages.madvise(advice)
    except OSError as exc:
        if not _warned_fork:
            _warned_fork = True
            logger.warning(
                "zenflow_triton: madvise(MADV_DONTFORK) on the optimizer's pinned host buffers failed (%s); they stay "
                "pinned and correct, but a forked process (a DataLoader worker) gets its own copy of them at fork "
                "time. Use DataLoader(multiprocessing_context='spawn') or fewer workers if host memory runs short.",
                exc)
