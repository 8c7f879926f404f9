"""HostSlab: one page-aligned allocation, aligned typed views that do not overlap, exact size (no power-of-two
rounding); pinning on the right device, MADV_DONTFORK, and the fallback when pinning fails (CUDA calls stood in for)."""

from __future__ import annotations

import gc
import logging
import mmap
import weakref

import pytest
import torch

from zenflow_triton import host_memory
from zenflow_triton.host_memory import ALIGN_BYTES, HostSlab


def test_views_are_aligned_disjoint_and_exactly_sized() -> None:
    requests = [((3, 5), torch.float32), ((7,), torch.int32), ((2, 9), torch.bfloat16), ((1, 1), torch.float16)]
    slab = HostSlab(requests, pin=False)
    spans = []
    for view, (shape, dtype) in zip(slab.views, requests):
        assert view.shape == shape and view.dtype == dtype and view.is_contiguous()
        assert view.data_ptr() % ALIGN_BYTES == 0
        spans.append((view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for i, view in enumerate(slab.views):
        view.fill_(i + 1)
    for i, view in enumerate(slab.views):
        assert bool((view == i + 1).all())
    # 60 + 28 + 36 + 2 bytes, each start rounded up to 64: 64 + 64 + 64 + 64
    assert slab.nbytes == 4 * ALIGN_BYTES


def test_views_outlive_the_slab_object() -> None:
    slab = HostSlab([((1000,), torch.float32)], pin=False)
    view = slab.views[0]
    view.fill_(3.0)
    del slab
    assert float(view.sum()) == 3000.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_pinning_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="pinned host memory needs CUDA"):
        HostSlab([((4,), torch.float32)], pin=True)


@pytest.mark.gpu
def test_pinned_slab_is_page_locked_and_copies_async() -> None:
    slab = HostSlab([((1 << 20,), torch.float32), ((3,), torch.bfloat16)], pin=True)
    view = slab.views[0]
    assert view.is_pinned()
    view.fill_(2.0)
    dev = view.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert float(dev.sum()) == 2.0 * (1 << 20)


# ---------------------------------------------------------------------------------------- pages, pinning, fork


def _vm_flags(address: int) -> set[str] | None:
    """The kernel's VmFlags of the mapping holding ``address`` (Linux /proc/self/smaps), or None elsewhere."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return None


class FakeCuda:
    """Stands in for the CUDA calls of host_memory on a machine without a GPU: records (un)registrations and
    answers with ``error`` (0 = success)."""

    def __init__(self, monkeypatch, error: int = 0) -> None:
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[tuple[int, int]] = []
        self.cleared: list[int] = []
        self.error = error
        monkeypatch.setattr(host_memory, "_cuda_available", lambda: True)
        monkeypatch.setattr(host_memory, "_register_pages", self.register)
        monkeypatch.setattr(host_memory, "_unregister_pages", lambda ptr, dev: self.unregistered.append((ptr, dev)))
        monkeypatch.setattr(host_memory, "_clear_cuda_error", self.cleared.append)
        monkeypatch.setattr(host_memory, "_error_string", lambda err: "out of memory")
        monkeypatch.setattr(host_memory, "_warned_unpinned", False)

    def register(self, ptr: int, nbytes: int, device: int) -> int:
        self.registered.append((ptr, nbytes, device))
        return self.error


def test_slab_is_page_aligned_exact_pages() -> None:
    slab = HostSlab([((1000,), torch.float32), ((3,), torch.int32)], pin=False)
    assert slab.views[0].data_ptr() % mmap.PAGESIZE == 0
    assert slab.nbytes == 4032 + 64  # 4000 bytes rounded up to 64, then 12 rounded up to 64
    assert not slab.pinned


def test_pinned_slab_registers_on_its_device_marks_dontfork_and_unregisters_when_views_die(monkeypatch) -> None:
    cuda = FakeCuda(monkeypatch)
    slab = HostSlab([((5000,), torch.float32), ((7,), torch.bfloat16)], pin=True, device=torch.device("cuda", 3))
    view = slab.views[0]
    assert slab.pinned
    assert cuda.registered == [(view.data_ptr(), slab.nbytes, 3)]
    flags = _vm_flags(view.data_ptr())
    if flags is not None and hasattr(mmap, "MADV_DONTFORK"):
        assert "dc" in flags  # "do not copy area on fork"
    owner = weakref.ref(slab._owner)
    del slab
    gc.collect()
    assert cuda.unregistered == []  # a view still holds the pages
    view.fill_(1.0)
    del view
    gc.collect()
    assert owner() is None
    assert cuda.unregistered == [(cuda.registered[0][0], 3)]


def test_unpinned_slab_is_inherited_by_fork() -> None:
    """Only pinned slabs are withheld from forked children: plain host memory stays copy-on-write, so a child that
    reads optimizer state (CPU training with fork-based workers) still can."""
    slab = HostSlab([((4096,), torch.float32)], pin=False)
    flags = _vm_flags(slab.views[0].data_ptr())
    if flags is None:
        pytest.skip("no /proc/self/smaps")
    assert "dc" not in flags
    assert "sh" not in flags  # private pages: copy on write in a child, as malloc'd memory would be


def test_failed_registration_falls_back_to_pageable_memory_with_one_warning(monkeypatch, caplog) -> None:
    cuda = FakeCuda(monkeypatch, error=2)
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        first = HostSlab([((100,), torch.float32)], pin=True, device=torch.device("cuda", 1))
        second = HostSlab([((100,), torch.float32)], pin=True, device=torch.device("cuda", 1))
    assert not first.pinned and not second.pinned
    assert cuda.cleared == [1, 1]  # CUDA's last error reset after each failure, on the slab's device
    warnings = [r for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(warnings) == 1
    assert "ulimit -l" in warnings[0].getMessage() and "CUDA error 2: out of memory" in warnings[0].getMessage()
    flags = _vm_flags(first.views[0].data_ptr())
    assert flags is None or "dc" not in flags
    first.views[0].fill_(2.0)  # still usable memory
    assert float(first.views[0].sum()) == 200.0
    del first, second
    gc.collect()
    assert cuda.unregistered == []  # nothing was registered, nothing to undo


def test_loaded_cudart_paths_parse_proc_maps() -> None:
    # No GPU here, so usually no CUDA runtime mapped; the parser must not fail either way.
    assert all("libcudart.so" in path for path in host_memory._loaded_cudarts())


# ---------------------------------------------------------------------------------------- refusals, messages


class _NoDontFork(mmap.mmap):
    """Pages whose madvise is refused, as a sandboxed kernel may refuse MADV_DONTFORK."""

    def madvise(self, *args) -> None:
        raise OSError(22, "Invalid argument")


def test_refused_dontfork_leaves_the_slab_pinned_with_one_warning(monkeypatch, caplog) -> None:
    if not hasattr(mmap, "MADV_DONTFORK"):
        pytest.skip("no MADV_DONTFORK on this platform: nothing to refuse")
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(host_memory, "_warned_fork", False)
    monkeypatch.setattr(host_memory, "_map_pages", lambda n: _NoDontFork(-1, n, flags=mmap.MAP_PRIVATE))
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        slabs = [HostSlab([((256,), torch.float32)], pin=True, device=0) for _ in range(2)]
    assert all(s.pinned for s in slabs) and len(cuda.registered) == 2
    warnings = [r.getMessage() for r in caplog.records if "MADV_DONTFORK" in r.getMessage()]
    assert len(warnings) == 1 and "Invalid argument" in warnings[0]
    slabs[0].views[0].fill_(4.0)
    assert float(slabs[0].views[0].sum()) == 1024.0


class _EnumOnlyCudart:
    """torch.cuda.cudart() as its binding behaves: cudaGetErrorString takes a cudaError, and raises given an int."""

    class cudaError(int):  # noqa: N801 - the binding's name
        pass

    @classmethod
    def cudaGetErrorString(cls, err) -> str:  # noqa: N802
        if not isinstance(err, cls.cudaError):
            raise TypeError("cudaGetErrorString(): incompatible function arguments")
        return {2: "out of memory", 712: "part or all of the requested memory range is already mapped"}[int(err)]


def test_error_string_passes_the_cuda_error_enum(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _EnumOnlyCudart)
    assert host_memory._error_string(2) == "out of memory"
    assert host_memory._error_string(712).startswith("part or all")
    monkeypatch.setattr(torch.cuda, "cudart", lambda: (_ for _ in ()).throw(RuntimeError("no CUDA")))
    assert host_memory._error_string(2) == "unknown error"  # the message never makes the fallback fail


def test_training_is_unchanged_when_pinning_fails(monkeypatch, caplog) -> None:
    """A failed cudaHostRegister, injected on CPU: the optimizer's slabs stay pageable, one warning, and training gives
    bit for bit the results of a run whose slabs were never meant to be pinned."""
    from torch import nn

    from zenflow_triton import ZenFlowAdamW
    from zenflow_triton import state as state_mod

    def train() -> tuple[list[torch.Tensor], dict]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 16))
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=2,
                           min_offload_numel=256, warmup_steps=0)
        gen = torch.Generator().manual_seed(1)
        for _ in range(7):
            x = torch.randn(8, 24, generator=gen)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        opt.flush()
        stats = opt.stats()
        opt.close()
        return [p.detach().clone() for p in model.parameters()], stats

    expected, plain_stats = train()
    cuda = FakeCuda(monkeypatch, error=2)
    real_slab = state_mod.HostSlab
    monkeypatch.setattr(state_mod, "HostSlab", lambda requests, pin: real_slab(requests, pin=True, device=0))
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        got, stats = train()
    assert cuda.registered and cuda.unregistered == []  # the optimizer asked for pinned slabs, and none was pinned
    assert sum("cudaHostRegister" in r.getMessage() for r in caplog.records) == 1
    assert stats["pinned_bytes"] == plain_stats["pinned_bytes"] == 0
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
