"""The Triton merge against ``reference.merge_`` (on CPU under ``TRITON_INTERPRET=1``): a copy, so bit for bit; and
every backend's merge from the fp32 master (``host_snapshot=False``) against the host snapshot's rounding."""

from __future__ import annotations

import pytest
import torch
from kernel_shapes import edge_shapes

from zenflow_triton.kernels import merge, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # no tolerance: a copy is exact in every dtype
SHAPES = edge_shapes(merge)


def _case(rows: int, cols: int, n_selected: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(rows, cols, generator=gen).to(dtype)
    snapshot = torch.randn(rows, cols, generator=gen).to(dtype)
    slot = torch.full((cols,), -1, dtype=torch.int32)
    chosen = torch.randperm(cols, generator=gen)[:n_selected]  # permuted: selected columns are scattered
    slot[chosen] = torch.randperm(n_selected, generator=gen).to(torch.int32)
    return param, snapshot, slot


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kmode", ["k0", "kC", "subset"])
@pytest.mark.parametrize(("rows", "cols", "overrides"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_matches_reference(rows, cols, overrides, kmode, dtype):
    n_sel = {"k0": 0, "kC": cols, "subset": max(1, cols // 3)}[kmode]
    param, snapshot, slot = _case(rows, cols, n_sel, dtype)
    before, ref = param.clone(), param.clone()
    merge.merge_(param, snapshot, slot, **overrides)
    reference.merge_(ref, snapshot, slot)
    assert torch.equal(_bits(param), _bits(ref))
    sel = slot >= 0
    assert torch.equal(_bits(param[:, sel]), _bits(before[:, sel]))  # selected columns untouched
    assert torch.equal(_bits(param[:, ~sel]), _bits(snapshot[:, ~sel]))


def _master(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    """fp32 values across fp16's subnormal, normal and overflowing ranges, with the edges and halfway cases."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(rows, cols, generator=gen) * torch.logspace(-10, 6, cols)
    master[0, :8] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 65520.0, 65519.99, 6.1e-5, 2.9e-8])
    master[1, :3] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-11)])  # bf16 / fp16 ties
    return master


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", ["triton", "numba", "reference"])
def test_an_fp32_master_is_rounded_as_the_host_snapshot_would_be(impl, dtype):
    """host_snapshot=False: the merge reads the fp32 master and rounds it itself. The param gets the bits the host
    kernel's snapshot would have held (``_numba_utils.bf16_round`` / ``f16_round``: round to nearest even), which
    are torch's ``.to(dtype)``; selected columns untouched."""
    from zenflow_triton.kernels import numba_device_ops
    from zenflow_triton.kernels._numba_utils import bf16_bits_array, f16_bits_array

    ops = {"triton": merge, "numba": numba_device_ops, "reference": reference}[impl]
    param, _, slot = _case(37, 300, 40, dtype)
    master = _master(37, 300)
    before = param.clone()
    ops.merge_(param, master, slot)
    snapshot_bits = (bf16_bits_array if dtype == torch.bfloat16 else f16_bits_array)(master.numpy().reshape(-1))
    snapshot = torch.from_numpy(snapshot_bits.view("int16")).view(dtype).reshape(master.shape)
    assert torch.equal(snapshot.view(torch.int16), master.to(dtype).view(torch.int16))  # the host rule is torch's
    sel = slot >= 0
    assert torch.equal(_bits(param[:, ~sel]), _bits(snapshot[:, ~sel]))
    assert torch.equal(_bits(param[:, sel]), _bits(before[:, sel]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_fp32_masters_nan_becomes_the_host_snapshots_nan(dtype):
    """NaN has no torch-defined rounding (its vector and scalar paths differ): Triton and numba both give the host
    kernel's (bf16 0x7FC0; fp16 quiet, sign and top payload kept)."""
    from zenflow_triton.kernels import numba_device_ops
    from zenflow_triton.kernels._numba_utils import bf16_bits_array, f16_bits_array

    master = torch.tensor([[0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FFFFFFF]], dtype=torch.int64).to(torch.int32)
    master = master.view(torch.float32)
    slot = torch.full((4,), -1, dtype=torch.int32)
    host = (bf16_bits_array if dtype == torch.bfloat16 else f16_bits_array)(master.numpy().reshape(-1))
    for ops in (merge, numba_device_ops):
        param = torch.zeros(1, 4, dtype=dtype)
        ops.merge_(param, master, slot)
        assert param.view(torch.int16).numpy().view("uint16").reshape(-1).tolist() == host.tolist()


def test_copies_bits_not_values():
    """NaN payloads, -0.0 and infinities arrive exactly as the host wrote them."""
    param, snapshot, slot = _case(4, 6, 2, torch.bfloat16)
    special = torch.tensor([0x7FC1, 0xFFFF, 0x8000, 0x7F80, 0xFF80, 0x0001], dtype=torch.int32).to(torch.int16)
    snapshot.view(torch.int16)[:] = special
    merge.merge_(param, snapshot, slot)
    unsel = slot < 0
    assert torch.equal(param.view(torch.int16)[:, unsel], snapshot.view(torch.int16)[:, unsel])


def test_deterministic_and_idempotent():
    param, snapshot, slot = _case(45, 37, 12, torch.float16)
    merge.merge_(param, snapshot, slot, _block_r=4, _block_c=16, _rows_per_split=8)
    once = param.clone()
    merge.merge_(param, snapshot, slot, _block_r=4, _block_c=16, _rows_per_split=8)
    assert torch.equal(_bits(param), _bits(once))


@pytest.mark.parametrize(
    "bad",
    [
        lambda p, s, sl: (p, s.to(torch.float16), sl),  # snapshot dtype differs from param
        lambda p, s, sl: (p.to(torch.int32), s.to(torch.int32), sl),  # not a model dtype
        lambda p, s, sl: (p, s[:, :-1].contiguous(), sl),  # snapshot shape
        lambda p, s, sl: (p, s, sl.long()),  # slot dtype
        lambda p, s, sl: (p, s, sl[:-1].clone()),  # slot shape
        lambda p, s, sl: (p.t().contiguous().t(), s, sl),  # param non-contiguous
        lambda p, s, sl: (p, s.t().contiguous().t(), sl),  # snapshot non-contiguous
    ],
    ids=["snapshot_dtype", "int_dtype", "snapshot_shape", "slot_dtype", "slot_shape", "param_noncontig",
         "snapshot_noncontig"],
)
def test_bad_input_raises_like_reference(bad):
    errors = []
    for fn in (reference.merge_, merge.merge_):
        args = bad(*_case(5, 7, 2, torch.float32))
        with pytest.raises((ValueError, TypeError)) as info:
            fn(*args)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


def test_a_side_of_2_31_or_more_is_refused_by_name():
    # int32 row and column indices in the kernel: refused on the sizes (meta tensors, no memory), before the device.
    param = torch.empty(2**31, 4, device="meta")
    with pytest.raises(ValueError, match=r"merge_: param of shape \(2147483648, 4\) has a side of 2\^31"):
        merge.merge_(param, torch.empty_like(param), torch.empty(4, dtype=torch.int32, device="meta"))


def test_wrong_device_raises():
    param, snapshot, slot = (t.to("meta") for t in _case(5, 7, 2, torch.float32))
    with pytest.raises(ValueError, match="meta.*CUDA.*backend='torch'"):
        merge.merge_(param, snapshot, slot)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU tensors")
def test_cpu_tensor_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    param, snapshot, slot = _case(5, 7, 2, torch.float32)
    before = param.clone()
    with pytest.raises(ValueError, match="CPU tensor.*TRITON_INTERPRET=1.*backend='torch'"):
        merge.merge_(param, snapshot, slot)
    assert torch.equal(param, before)


def test_empty_is_a_no_op():
    param, snapshot, slot = _case(0, 4, 1, torch.float32)
    merge.merge_(param, snapshot, slot)
    assert param.shape == (0, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(8192, 8192), (50257, 768), (3, 100003)])
def test_cuda_matches_reference(rows, cols, dtype):
    param, snapshot, slot = (t.cuda() for t in _case(rows, cols, cols // 10, dtype))
    ref = param.clone()
    merge.merge_(param, snapshot, slot)
    reference.merge_(ref, snapshot, slot)
    assert torch.equal(_bits(param), _bits(ref))


@pytest.mark.gpu
def test_cuda_more_than_2_31_elements():
    rows, cols = 2**16 + 1, 2**15 + 3
    need = rows * cols * 2 * 2 * 1.25  # bf16 param + snapshot, headroom
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    param = torch.zeros(rows, cols, device="cuda", dtype=torch.bfloat16)
    snapshot = torch.ones(rows, cols, device="cuda", dtype=torch.bfloat16)
    slot = torch.full((cols,), -1, dtype=torch.int32, device="cuda")
    slot[cols - 2] = 0
    merge.merge_(param, snapshot, slot)
    assert bool((param[-3:, -1] == 1).all()) and bool((param[:, cols - 2] == 0).all())
    assert int(torch.count_nonzero(param == 0)) == rows
