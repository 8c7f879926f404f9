"""Numba device-side ops for CPU tensors (kernels/cpu_fused_step.py) against kernels/reference.py."""

from __future__ import annotations

import pytest
import torch

from zenflow_triton.kernels import cpu_fused_step as nb
from zenflow_triton.kernels import reference as ref

HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
# Rows per score block is 64: 63/64/65 and 130 rows straddle one and two block boundaries.
SHAPES = [(1, 1), (1, 40), (63, 1), (64, 7), (65, 33), (130, 37), (3, 700)]
# fp32 state: both follow torch's AdamW rounding, the reference through torch's vectorized ops (which fuse some
# multiply-adds) and numba through explicit fma, so an ulp or two apart; scores are summed in another order.
TOL = dict(atol=1e-6, rtol=1e-5)


def _state(rows: int, cols: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    slot = torch.full((cols,), -1, dtype=torch.int32)
    slot[torch.randperm(cols, generator=gen)[:k]] = torch.randperm(k, generator=gen).to(torch.int32)
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
        ref.fused_step_(pa, g, **a, accumulate=accumulate, update_score=step != 1, decoupled=decoupled, **HP)
        nb.fused_step_(pb, g, **b, accumulate=accumulate, update_score=step != 1, decoupled=decoupled, **HP)
    for key in ("score", "master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(b[key], a[key], **TOL, msg=key)
    unsel = a["slot"] < 0
    assert torch.equal(b["acc"][:, unsel], a["acc"][:, unsel])  # exact: additions in the same order
    assert torch.equal(pb[:, unsel], param0[:, unsel])  # the device never writes unselected columns
    sel = ~unsel
    # selected columns of the param are the kernel's own master, rounded to nearest even
    assert torch.equal(pb[:, sel], b["master"][:, b["slot"][sel].long()].to(dtype))


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
                   update_score=False, **HP)
    assert torch.equal(acc, g.float())


def test_rejects_non_cpu_and_bad_input() -> None:
    st = _state(4, 6, 2, 0)
    with pytest.raises(ValueError, match="CPU tensors"):
        nb.merge_(torch.zeros(4, 6, device="meta"), torch.zeros(4, 6, device="meta"),
                  torch.zeros(6, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="acc must be contiguous"):
        nb.fused_step_(torch.zeros(4, 6), torch.zeros(4, 6), **dict(st, acc=torch.zeros(6, 4).t()),
                       accumulate=True, **HP)
    with pytest.raises(ValueError, match="slot values"):
        bad = st["slot"].clone()
        bad[0] = 9
        nb.fused_step_(torch.zeros(4, 6), torch.zeros(4, 6), **dict(st, slot=bad), accumulate=True,
                       check_slots=True, **HP)
