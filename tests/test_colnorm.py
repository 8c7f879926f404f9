"""The Triton column sums of squares against ``reference.column_sumsq_`` (on CPU under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch
from kernel_shapes import edge_shapes

from zenflow_triton.kernels import colnorm, reference

# (dtype, atol, rtol) of the score vs the reference, by gradient dtype. Scores are fp32 sums of squares of values that
# are exact in fp32 for every dtype (squares of bf16/fp16 values are exact too), so the only difference is the order
# of the positive additions (tiles + row splits vs torch's vectorized sum): relative error a few eps * sqrt(R) at
# these sizes, observed <= 3e-7. atol 0: scores are positive, relative error is what matters.
TOLERANCES = [(torch.float32, 0.0, 1e-5), (torch.bfloat16, 0.0, 1e-5), (torch.float16, 0.0, 1e-5)]
DTYPES = [d for d, _, _ in TOLERANCES]

SHAPES = edge_shapes(colnorm)


def _case(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(cols, generator=gen), torch.randn(rows, cols, generator=gen).to(dtype)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES)
@pytest.mark.parametrize(("rows", "cols", "overrides"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_matches_reference(rows, cols, overrides, dtype, atol, rtol):
    score, grad = _case(rows, cols, dtype)
    grad_before, ref = grad.clone(), score.clone()
    colnorm.column_sumsq_(score, grad, **overrides)
    reference.column_sumsq_(ref, grad)
    torch.testing.assert_close(score, ref, atol=atol, rtol=rtol)
    assert torch.equal(grad, grad_before)


def test_scores_accumulate_across_calls():
    score, _ = _case(45, 37, torch.bfloat16)
    ref = score.clone()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grad = torch.randn(45, 37, generator=gen).to(torch.bfloat16)
        colnorm.column_sumsq_(score, grad, _block_r=4, _block_c=16, _rows_per_split=12)
        reference.column_sumsq_(ref, grad)
        torch.testing.assert_close(score, ref, atol=0.0, rtol=1e-5)


@pytest.mark.parametrize("overrides", [{}, dict(_block_r=4, _block_c=16, _rows_per_split=8)], ids=["plan", "splits"])
def test_deterministic(overrides):
    score, grad = _case(700, 3, torch.float32) if not overrides else _case(45, 37, torch.float32)
    again = score.clone()
    colnorm.column_sumsq_(score, grad, **overrides)
    colnorm.column_sumsq_(again, grad, **overrides)
    assert torch.equal(score.view(torch.int32), again.view(torch.int32))


@pytest.mark.parametrize(
    "bad",
    [
        lambda s, g: (s, g.to(torch.int32)),  # grad dtype
        lambda s, g: (s.double(), g),  # score dtype
        lambda s, g: (s[:-1].clone(), g),  # score shape
        lambda s, g: (s, g.reshape(-1)),  # grad not 2-D
        lambda s, g: (s, g.t().contiguous().t()),  # grad non-contiguous
        lambda s, g: (torch.empty(2 * s.numel())[::2], g),  # score non-contiguous
    ],
    ids=["grad_dtype", "score_dtype", "score_shape", "grad_1d", "grad_noncontig", "score_noncontig"],
)
def test_bad_input_raises_like_reference(bad):
    errors = []
    for fn in (reference.column_sumsq_, colnorm.column_sumsq_):
        score, grad = bad(*_case(5, 7, torch.float32))
        with pytest.raises((ValueError, TypeError)) as info:
            fn(score, grad)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


def test_a_side_of_2_31_or_more_is_refused_by_name():
    # int32 row and column indices in the kernel: refused on the sizes (meta tensors, no memory), before the device.
    grad = torch.empty(4, 2**31, device="meta")
    with pytest.raises(ValueError, match=r"column_sumsq_: grad of shape \(4, 2147483648\) has a side of 2\^31"):
        colnorm.column_sumsq_(torch.empty(2**31, device="meta"), grad)


def test_wrong_device_raises():
    score, grad = _case(5, 7, torch.float32)
    with pytest.raises(ValueError, match="meta.*CUDA.*backend='torch'"):
        colnorm.column_sumsq_(score.to("meta"), grad.to("meta"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU tensors")
def test_cpu_tensor_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    score, grad = _case(5, 7, torch.float32)
    before = score.clone()
    with pytest.raises(ValueError, match="CPU tensor.*TRITON_INTERPRET=1.*backend='torch'"):
        colnorm.column_sumsq_(score, grad)
    assert torch.equal(score, before)


def test_empty_is_a_no_op():
    score, grad = _case(0, 4, torch.float32)
    before = score.clone()
    colnorm.column_sumsq_(score, grad)
    assert torch.equal(score, before)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(8192, 8192), (50257, 768), (3, 100003)])
def test_cuda_matches_reference(rows, cols, dtype):
    score, grad = (t.cuda() for t in _case(rows, cols, dtype))
    ref, again = score.clone(), score.clone()
    colnorm.column_sumsq_(score, grad)
    colnorm.column_sumsq_(again, grad)
    reference.column_sumsq_(ref, grad)
    torch.testing.assert_close(score, ref, atol=0.0, rtol=2e-5)  # R up to 50k terms: a little more rounding
    assert torch.equal(score.view(torch.int32), again.view(torch.int32))


@pytest.mark.gpu
def test_cuda_more_than_2_31_elements():
    rows, cols = 2**16 + 1, 2**15 + 3
    need = rows * cols * 2 * 1.25  # bf16 grad, headroom
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    grad = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    score = torch.zeros(cols, device="cuda")
    colnorm.column_sumsq_(score, grad)
    probes = torch.tensor([0, cols // 2, cols - 1], device="cuda")
    expected = grad[:, probes].float().square().sum(0)
    torch.testing.assert_close(score[probes], expected, atol=0.0, rtol=2e-5)
