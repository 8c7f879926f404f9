"""HostSlab: one allocation, aligned typed views that do not overlap, exact size (no power-of-two rounding)."""

from __future__ import annotations

import pytest
import torch

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
