"""kernels/host_accumulate.py against its plain-torch twin (reference.host_accumulate_), bit for bit, and the twin
against what the device's fused step leaves in ``acc`` (the window sum that ``accumulate="host"`` must equal)."""

from __future__ import annotations

import pytest
import torch

from zenflow_triton.kernels import AdamHyperparams, reference
from zenflow_triton.kernels.host_accumulate import host_accumulate_

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 1 element, a prime, the parallel threshold and one past it, several chunks with a ragged end.
SIZES = ((1, 1), (7, 13), (1, 1 << 17), (3, (1 << 17) // 3 + 1), (5, 70001))


def _grads(shape, dtype, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(shape, generator=gen).to(dtype) for _ in range(n)]
    out[0].view(-1)[0] = -0.0  # a copy keeps the sign of zero; 0 + g would not
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("threads", (1, 2))
def test_matches_reference_bitwise(dtype, shape, threads):
    grads = _grads(shape, dtype, 3)
    got = torch.full(shape, 123.0)
    want = torch.full(shape, -7.0)
    for i, g in enumerate(grads):
        host_accumulate_(got, g, accumulate=i > 0, num_threads=threads)
        reference.host_accumulate_(want, g, accumulate=i > 0)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    first = torch.full(shape, 1.0)
    host_accumulate_(first, grads[0], accumulate=False, num_threads=threads)
    assert torch.equal(first.view(torch.int32), grads[0].float().view(torch.int32))  # -0.0 stays -0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_equals_fused_step_acc(dtype):
    """The sum the host builds one step at a time is the fused step's acc, bit for bit, on its unselected columns."""
    rows, cols = 6, 11
    grads = _grads((rows, cols), dtype, 4, seed=3)
    slot = torch.full((cols,), -1, dtype=torch.int32)
    slot[[2, 7]] = torch.tensor([0, 1], dtype=torch.int32)
    param = torch.randn(rows, cols).to(dtype)
    state = dict(master=param[:, [2, 7]].float(), exp_avg=torch.zeros(rows, 2), exp_avg_sq=torch.zeros(rows, 2))
    acc = torch.empty(rows, cols)
    host = torch.empty(rows, cols)
    hp = AdamHyperparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    for i, g in enumerate(grads):
        reference.fused_step_(param, g, score=torch.zeros(cols), slot=slot,
                              col_step=torch.full((cols,), i + 1, dtype=torch.int32), acc=acc, accumulate=i > 0,
                              hp=hp, **state)
        host_accumulate_(host, g, accumulate=i > 0)
    unsel = slot < 0
    assert torch.equal(acc[:, unsel].view(torch.int32), host[:, unsel].view(torch.int32))


def test_bad_arguments():
    with pytest.raises(TypeError, match="dst"):
        host_accumulate_(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3), accumulate=True)
    with pytest.raises(ValueError, match="src"):
        host_accumulate_(torch.zeros(3), torch.zeros(4), accumulate=True)
    with pytest.raises(ValueError, match="contiguous"):
        host_accumulate_(torch.zeros(4, 4).t(), torch.zeros(4, 4), accumulate=True)
    with pytest.raises(ValueError, match="num_threads"):
        host_accumulate_(torch.zeros(3), torch.zeros(3), accumulate=True, num_threads=0)
