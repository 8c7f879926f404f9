"""Numba device-side ops for CPU tensors (kernels/numba_device_ops.py) against kernels/reference.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from zenflow_triton.kernels import AdamHyperparams
from zenflow_triton.kernels import numba_device_ops as nb
from zenflow_triton.kernels import reference as ref

HP = AdamHyperparams(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
# Rows per score block is 64: 63/64/65 and 130 rows straddle one and two block boundaries.
SHAPES = [(1, 1), (1, 40), (63, 1), (64, 7), (65, 33), (130, 37), (3, 700)]
# fp32 state: both follow torch's AdamW rounding, the reference through torch's vectorized ops (which fuse some
# multiply-adds) and numba through explicit fma, so an ulp or two apart; scores are summed in another order.
TOL = dict(atol=1e-6, rtol=1e-5)


def _state(rows: int, cols: int, k: int, seed: int, slots: str = "perm") -> dict[str, torch.Tensor]:
    """``slots``: "perm" (k random columns, slots a random permutation of 0 .. k-1), "ordered" (slots in column
    order, as the optimizer makes them), "gaps" (about 2/3 of the k slots used, slot 0 never, in random order)."""
    gen = torch.Generator().manual_seed(seed)
    slot = torch.full((cols,), -1, dtype=torch.int32)
    used = max(1, 2 * k // 3) if slots == "gaps" and k > 1 else k
    cols_sel = torch.randperm(cols, generator=gen)[:used]
    if slots == "ordered":
        slot[cols_sel.sort().values] = torch.arange(used, dtype=torch.int32)
    elif slots == "gaps":
        perm = torch.randperm(k, generator=gen)
        slot[cols_sel] = perm[perm != 0][:used].to(torch.int32)
    else:
        slot[cols_sel] = torch.randperm(k, generator=gen).to(torch.int32)
    return dict(score=torch.rand(cols, generator=gen), slot=slot,
                col_step=torch.randint(1, 9, (cols,), generator=gen, dtype=torch.int32),
                master=torch.randn(rows, k, generator=gen), exp_avg=torch.randn(rows, k, generator=gen),
                exp_avg_sq=torch.rand(rows, k, generator=gen), acc=torch.randn(rows, cols, generator=gen))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which_k", ["none", "some", "all"])
@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_step_matches_reference(shape, dtype, which_k, decoupled) -> None:
    rows, cols = shape
    k = {"none": 0, "some": max(1, cols // 3), "all": cols}[which_k]
    gen = torch.Generator().manual_seed(7)
    param0 = torch.randn(shape, generator=gen).to(dtype)
    a, b = _state(rows, cols, k, 1), _state(rows, cols, k, 1)
    pa, pb = param0.clone(), param0.clone()
    for step, accumulate in enumerate((False, True, True)):
        g = torch.randn(shape, generator=gen).to(dtype)
        ref.fused_step_(pa, g, **a, accumulate=accumulate, update_score=step != 1, hp=replace(HP, decoupled=decoupled))
        nb.fused_step_(pb, g, **b, accumulate=accumulate, update_score=step != 1, hp=replace(HP, decoupled=decoupled))
    for key in ("score", "master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(b[key], a[key], **TOL, msg=key)
    unsel = a["slot"] < 0
    assert torch.equal(b["acc"][:, unsel], a["acc"][:, unsel])  # exact: additions in the same order
    assert torch.equal(pb[:, unsel], param0[:, unsel])  # the device never writes unselected columns
    sel = ~unsel
    # selected columns of the param are the kernel's own master, rounded to nearest even
    assert torch.equal(pb[:, sel], b["master"][:, b["slot"][sel].long()].to(dtype))


# A map with unused slots needs k >= 2 slots, so at least two columns.
SLOT_MAP_CASES = [(shape, slots) for shape in SHAPES for slots in ("ordered", "gaps")
                  if slots == "ordered" or shape[1] >= 2]


@pytest.mark.parametrize("shape,slots", SLOT_MAP_CASES, ids=[f"{r}x{c}-{s}" for (r, c), s in SLOT_MAP_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_step_slot_maps(shape, slots, dtype) -> None:
    """Slots in column order (the contiguous path without a sort) and maps with unused slots (the indexed path)."""
    rows, cols = shape
    k = max(1, cols // 3) if slots == "ordered" else max(2, cols // 2)
    gen = torch.Generator().manual_seed(11)
    param0 = torch.randn(shape, generator=gen).to(dtype)
    a, b = _state(rows, cols, k, 2, slots), _state(rows, cols, k, 2, slots)
    _, _, contig = nb._selected(a["slot"].numpy())
    assert contig == (slots == "ordered")
    pa, pb = param0.clone(), param0.clone()
    for accumulate in (False, True):
        g = torch.randn(shape, generator=gen).to(dtype)
        ref.fused_step_(pa, g, **a, accumulate=accumulate, hp=HP)
        nb.fused_step_(pb, g, **b, accumulate=accumulate, hp=HP)
    for key in ("score", "master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(b[key], a[key], **TOL, msg=key)
    unused = torch.ones(k, dtype=torch.bool)
    unused[b["slot"][b["slot"] >= 0].long()] = False
    st0 = _state(rows, cols, k, 2, slots)
    for key in ("master", "exp_avg", "exp_avg_sq"):  # slots no column uses keep their bits
        assert torch.equal(b[key][:, unused], st0[key][:, unused])
    sel = b["slot"] >= 0
    assert torch.equal(pb[:, ~sel], param0[:, ~sel])
    assert torch.equal(pb[:, sel], b["master"][:, b["slot"][sel].long()].to(dtype))


def test_selected_orders_by_slot() -> None:
    """Columns come back in slot order; the contiguous path is taken exactly when the slots are 0 .. n-1."""
    cases = {
        (-1, -1, -1): ([], [], True),
        (-1, 0, 1, -1, 2): ([1, 2, 4], [0, 1, 2], True),
        (2, -1, 0, 1): ([2, 3, 0], [0, 1, 2], True),  # a permutation: sorted, then contiguous
        (3, -1, 0, 1): ([2, 3, 0], [0, 1, 3], False),  # slot 2 unused
        (1, 0, 1, -1): ([1, 0, 2], [0, 1, 1], False),  # repeated slot: its columns stay in column order
        (-1, 5): ([1], [5], False),
    }
    for slot, (cols, ids, contig) in cases.items():
        c, i, ok = nb._selected(np.array(slot, dtype=np.int32))
        assert (c.tolist(), i.tolist(), ok) == (cols, ids, contig), slot


def test_fused_step_does_not_depend_on_thread_count() -> None:
    """Per-work-item scratch buffers and the score blocks: the same bits with one thread and with the pool."""
    import numba

    rows, cols, k = 300, 400, 60  # 120K elements: past the serial threshold
    gen = torch.Generator().manual_seed(5)
    param0 = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    g = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    outs = []
    previous = numba.get_num_threads()
    try:
        for slots in ("ordered", "gaps"):
            for threads in (1, numba.config.NUMBA_NUM_THREADS):
                numba.set_num_threads(threads)
                st = _state(rows, cols, k, 3, slots)
                p = param0.clone()
                nb.fused_step_(p, g, **st, accumulate=True, hp=HP)
                outs.append((p, st))
    finally:
        numba.set_num_threads(previous)
    for (p1, s1), (p2, s2) in (outs[0:2], outs[2:4]):
        assert torch.equal(p1.view(torch.int16), p2.view(torch.int16))
        for key in s1:
            assert torch.equal(s1[key], s2[key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unselected", [0.0, 0.5, 0.9, 1.0])
def test_merge_moves_bits_exactly(dtype, unselected) -> None:
    """Random bit patterns (signalling NaNs, payloads, subnormals included) land unchanged: the masked blend, the
    all-unselected copy and the all-selected no-op alike."""
    rows, cols = 67, 45  # a tail after the vector loop and after a 64-row block
    itype = torch.int32 if dtype == torch.float32 else torch.int16
    info = torch.iinfo(itype)
    gen = torch.Generator().manual_seed(9)
    bits = torch.randint(info.min, info.max + 1, (2, rows, cols), generator=gen, dtype=torch.int64).to(itype)
    snan = 0x7F800001 if dtype == torch.float32 else (0x7F81 if dtype == torch.bfloat16 else 0x7C01)
    bits[1, :, ::3] = snan  # signalling NaNs with a payload, which a float copy could quiet
    bits[1, :, 1::3] = -(2 ** (info.bits - 1)) + snan  # the same with the sign bit set
    param, snap = bits[0].view(dtype), bits[1].view(dtype)
    slot = torch.where(torch.rand(cols, generator=gen) < unselected, -1, 0).to(torch.int32)
    if unselected == 1.0:
        slot.fill_(-1)
    elif unselected == 0.0:
        slot.fill_(0)
    p = param.clone()
    nb.merge_(p, snap, slot)
    expect = torch.where(slot < 0, bits[1], bits[0])
    assert torch.equal(p.view(itype), expect)


@pytest.mark.parametrize("shape", SHAPES)
def test_column_sumsq_and_merge(shape) -> None:
    rows, cols = shape
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(shape, generator=gen).to(torch.bfloat16)
    sa, sb = torch.rand(cols, generator=gen), None
    sb = sa.clone()
    ref.column_sumsq_(sa, g)
    nb.column_sumsq_(sb, g)
    torch.testing.assert_close(sb, sa, **TOL)
    slot = torch.where(torch.rand(cols, generator=gen) < 0.3, 0, -1).to(torch.int32)
    snap = torch.randn(shape, generator=gen).to(torch.bfloat16)
    pa, pb = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    ref.merge_(pa, snap, slot)
    nb.merge_(pb, snap, slot)
    assert torch.equal(pa, pb)


def test_scores_do_not_depend_on_thread_count() -> None:
    import numba

    g = torch.randn(300, 400)  # 120K elements: past the serial threshold, so the pool runs it when allowed
    outs = []
    previous = numba.get_num_threads()
    try:
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            s = torch.zeros(400)
            nb.column_sumsq_(s, g)
            outs.append(s)
    finally:
        numba.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1])


def test_fp16_load_is_exact() -> None:
    """fp16 gradients read through integer bit manipulation: subnormals, inf and extremes included."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    g = bits.view(torch.float16).reshape(1, -1)
    finite = torch.isfinite(g) | torch.isinf(g)
    g = g[:, finite[0]].contiguous()
    acc = torch.zeros(g.shape)
    nb.fused_step_(torch.zeros_like(g), g, score=torch.zeros(g.shape[1]),
                   slot=torch.full((g.shape[1],), -1, dtype=torch.int32),
                   col_step=torch.ones(g.shape[1], dtype=torch.int32), master=torch.zeros(1, 0),
                   exp_avg=torch.zeros(1, 0), exp_avg_sq=torch.zeros(1, 0), acc=acc, accumulate=False,
                   update_score=False, hp=HP)
    assert torch.equal(acc, g.float())


def test_rejects_non_cpu_and_bad_input() -> None:
    st = _state(4, 6, 2, 0)
    with pytest.raises(ValueError, match="CPU tensors"):
        nb.merge_(torch.zeros(4, 6, device="meta"), torch.zeros(4, 6, device="meta"),
                  torch.zeros(6, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="acc must be contiguous"):
        nb.fused_step_(torch.zeros(4, 6), torch.zeros(4, 6), **dict(st, acc=torch.zeros(6, 4).t()),
                       accumulate=True, hp=HP)
    with pytest.raises(ValueError, match="slot values"):
        bad = st["slot"].clone()
        bad[0] = 9
        nb.fused_step_(torch.zeros(4, 6), torch.zeros(4, 6), **dict(st, slot=bad), accumulate=True,
                       check_slots=True, hp=HP)
