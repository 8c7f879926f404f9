"""``acc=None`` (no accumulation target, accumulate="host"): every backend's fused step against the same step with an
``acc``, which it must equal bit for bit everywhere but the acc it was not given, and the reference with an ``acc``.

The acc a call is not given is left filled with NaN (a sentinel nothing may write over); the gradient, which an fp32
model once passed as its own acc, must keep its bits.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_shapes import edge_shapes
from test_fused_step import GROUP, HP, NAMES, SCORE_RTOL, STATE_TOL, _args, _grouped_cases, clone, make_case

from zenflow_triton.kernels import fused_step as fs
from zenflow_triton.kernels import numba_device_ops, reference

BACKENDS = {"triton": fs, "numba": numba_device_ops, "torch": reference}
OUTPUTS = ("param", "score", "col_step", "master", "exp_avg", "exp_avg_sq")  # everything a step writes but acc
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Block-breaking shapes of the Triton tiles (1 row, 1 column, primes, BLOCK +- 1, row splits) and of numba's 64-row
# score blocks; launcher overrides (tile, split) go to the Triton kernel only.
SHAPES = edge_shapes(fs, narrow=20, short=3) + [("nb_63", 63, 7, {}), ("nb_65", 65, 33, {}), ("nb_130", 130, 5, {})]
KMODES = ["k0", "kC", "subset"]


def _k_for(mode: str, cols: int) -> int:
    return {"k0": 0, "kC": cols, "subset": max(1, cols // 3)}[mode]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _step(ops, case: dict, *, with_acc: bool, **kw) -> None:
    state = {n: case[n] for n in NAMES if n != "acc"}
    ops.fused_step_(case["param"], case["grad"], **state, acc=case["acc"] if with_acc else None,
                    **{"hp": HP, "accumulate": False, **kw})


def _assert_same_step(out: dict, want: dict, before: dict, where: str) -> None:
    for name in OUTPUTS:
        assert torch.equal(_bits(out[name]), _bits(want[name])), f"{where}: {name}"
    assert torch.equal(_bits(out["grad"]), _bits(before["grad"])), f"{where}: the gradient was written"
    assert torch.equal(_bits(out["acc"]), _bits(before["acc"])), f"{where}: the acc it was not given was written"


def _assert_close_to_reference(out: dict, ref: dict, where: str) -> None:
    _, atol, rtol = STATE_TOL
    assert torch.equal(out["col_step"], ref["col_step"]), where
    for name in ("master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(out[name], ref[name], atol=atol, rtol=rtol, msg=f"{where}: {name}")
    torch.testing.assert_close(out["score"], ref["score"], atol=0.0, rtol=SCORE_RTOL, msg=f"{where}: score")
    sel = out["slot"] >= 0
    assert torch.equal(out["param"][:, ~sel], ref["param"][:, ~sel]), where  # untouched in both
    # The selected columns: the backend's own master in the param's dtype (the existing tests check it within an ulp
    # of the reference's in half precision, as the masters above are).
    own = out["master"][:, out["slot"][sel].long()].to(out["param"].dtype)
    assert torch.equal(_bits(out["param"][:, sel]), _bits(own)), where


def _sentinel_case(rows: int, cols: int, k: int, dtype: torch.dtype, seed: int = 0) -> dict:
    case = make_case(rows, cols, k, dtype, seed=seed)
    case["acc"].fill_(float("nan"))
    return case


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("kmode", KMODES)
@pytest.mark.parametrize(("rows", "cols", "overrides"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_no_acc_is_the_step_with_acc_minus_the_acc(backend, rows, cols, overrides, kmode):
    ops = BACKENDS[backend]
    kw = overrides if backend == "triton" else {}
    dtype = DTYPES[(rows + cols) % 3]
    before = _sentinel_case(rows, cols, _k_for(kmode, cols), dtype)
    with_acc, no_acc, ref = clone(before), clone(before), clone(before)
    _step(ops, with_acc, with_acc=True, count_step=True, **kw)
    _step(ops, no_acc, with_acc=False, count_step=True, **kw)
    _step(reference, ref, with_acc=True, count_step=True)
    with_acc["acc"] = before["acc"]  # the with-acc step wrote its acc; compared here is everything else
    _assert_same_step(no_acc, with_acc, before, f"{backend} vs itself with acc")
    _assert_close_to_reference(no_acc, ref, f"{backend} vs the reference with acc")


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("update_score", "count_step"), [(False, False), (True, False), (False, True)])
def test_no_acc_every_dtype_and_flag(backend, dtype, update_score, count_step):
    ops = BACKENDS[backend]
    before = _sentinel_case(41, 29, 9, dtype, seed=3)
    with_acc, no_acc = clone(before), clone(before)
    flags = dict(update_score=update_score, count_step=count_step, hp=replace(HP, decoupled=dtype != torch.float16))
    _step(ops, with_acc, with_acc=True, **flags)
    _step(ops, no_acc, with_acc=False, **flags)
    with_acc["acc"] = before["acc"]
    _assert_same_step(no_acc, with_acc, before, backend)


def _mixed_calls(seed: int) -> list[tuple[dict, dict]]:
    """GROUP's calls, half of them (in every dtype and hyperparameter record) without an acc."""
    calls = []
    for i, (case, kw) in enumerate(_grouped_cases(seed=seed)):
        if i % 4 < 2:
            case["acc"].fill_(float("nan"))
            kw = {**kw, "accumulate": False}
        calls.append((case, kw))
    return calls


def _mixed_args(case: dict, kw: dict, i: int):
    args = _args(case, kw)
    return replace(args, acc=None) if i % 4 < 2 else args


@pytest.mark.parametrize("block", [{}, dict(_block_r=8, _block_c=16)], ids=["plan", "gpu_tile"])
def test_fused_steps_mixing_acc_and_no_acc_equals_per_call(block):
    grouped = _mixed_calls(seed=50)
    before = [clone(case) for case, _ in grouped]
    single = [(clone(case), kw) for case, kw in grouped]
    for i, (case, kw) in enumerate(single):
        c = _mixed_args(case, kw, i)
        fs.fused_step_(c.param, c.grad, score=c.score, slot=c.slot, col_step=c.col_step, master=c.master,
                       exp_avg=c.exp_avg, exp_avg_sq=c.exp_avg_sq, acc=c.acc, hp=c.hp, accumulate=c.accumulate,
                       update_score=c.update_score, count_step=c.count_step, **block)
    fs.fused_steps_([_mixed_args(case, kw, i) for i, (case, kw) in enumerate(grouped)], **block)
    for i, ((a, _), (b, _)) in enumerate(zip(grouped, single)):
        for name in ("param", "grad", *NAMES):
            assert torch.equal(_bits(a[name]), _bits(b[name])), f"call {i} {GROUP[i]}: {name}"
        if i % 4 < 2:
            assert torch.equal(_bits(a["acc"]), _bits(before[i]["acc"])), f"call {i}: acc written"
            assert torch.equal(_bits(a["grad"]), _bits(before[i]["grad"])), f"call {i}: grad written"


def test_fused_steps_mixing_acc_and_no_acc_in_the_loop_backends():
    """reference and numba: their fused_steps_ (loops) against the reference's fused_step_ with every acc given."""
    for ops in (reference, numba_device_ops):
        grouped = _mixed_calls(seed=60)
        full = [(clone(case), kw) for case, kw in grouped]
        ops.fused_steps_([_mixed_args(case, kw, i) for i, (case, kw) in enumerate(grouped)])
        for case, kw in full:
            _args(case, kw).apply(ops.fused_step_)
        for i, ((a, _), (b, _)) in enumerate(zip(grouped, full)):
            names = OUTPUTS if i % 4 < 2 else ("param", *NAMES)
            for name in names:
                assert torch.equal(_bits(a[name]), _bits(b[name])), f"{ops.__name__} call {i}: {name}"


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_accumulate_into_no_acc_raises(backend):
    ops = BACKENDS[backend]
    case = make_case(6, 5, 2, torch.float32)
    with pytest.raises(ValueError, match=r"acc is None .* accumulate=True"):
        _step(ops, clone(case), with_acc=False, accumulate=True)
    args = replace(_args(case, dict(hp=HP, accumulate=True)), acc=None)
    with pytest.raises(ValueError, match=r"acc is None .* accumulate=True"):
        ops.fused_steps_([args])


@pytest.mark.gpu
def test_cuda_no_acc_equals_the_step_with_acc():
    """Compiled (HAS_ACC=False and True): per parameter and grouped, with and without acc mixed in one fused_steps_
    call, bit for bit what the steps with an acc give (aligned and unaligned shapes, one split and several)."""
    shapes = [(4096, 4096, 410), (257, 30011, 3001), (2048, 2048, 0), (8192, 512, 52)]
    for dtype in DTYPES:
        cases = [{n: t.cuda() for n, t in _sentinel_case(rows, cols, k, dtype, seed=i).items()}
                 for i, (rows, cols, k) in enumerate(shapes)]
        kws = [dict(hp=HP, accumulate=False, update_score=i != 2, count_step=True) for i in range(len(shapes))]
        with_acc = [clone(c) for c in cases]
        per_call = [clone(c) for c in cases]
        grouped = [clone(c) for c in cases]
        for case, kw in zip(with_acc, kws):
            _args(case, kw).apply(fs.fused_step_)
        for case, kw in zip(per_call, kws):
            replace(_args(case, kw), acc=None).apply(fs.fused_step_)
        fs.fused_steps_([replace(_args(case, kw), acc=None) if i % 2 == 0 else _args(case, kw)
                         for i, (case, kw) in enumerate(zip(grouped, kws))])
        torch.cuda.synchronize()
        for i, (before, want) in enumerate(zip(cases, with_acc)):
            want = {**want, "acc": before["acc"]}
            _assert_same_step(per_call[i], want, before, f"{dtype} per call {shapes[i]}")
            got = grouped[i] if i % 2 == 0 else {**grouped[i], "acc": before["acc"]}
            _assert_same_step(got, want, before, f"{dtype} grouped {shapes[i]}")
            if i % 2:
                same = torch.equal(_bits(grouped[i]["acc"]), _bits(with_acc[i]["acc"]))
                assert same, f"{dtype} grouped {shapes[i]}: acc"
