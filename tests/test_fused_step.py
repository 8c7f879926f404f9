"""The Triton fused step against its oracle, ``kernels/reference.py`` (on CPU under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields, replace

import pytest
import torch
from kernel_shapes import edge_shapes

from zenflow_triton.kernels import AdamHyperparams, _triton_utils, reference
from zenflow_triton.kernels import fused_step as fs

HP = AdamHyperparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
HP_FIELDS = {f.name for f in fields(AdamHyperparams)}

# (dtype, atol, rtol) for the fp32 state (master, exp_avg, exp_avg_sq) and an fp32 param, vs the reference. The kernel
# does the reference's operations in the reference's order; torch's vectorized CPU lerp and add-with-alpha fuse a
# multiply-add (FMA) and the kernel does not, so results differ by about one rounding of the O(1) operands:
# ~1 ulp at 1.0 absolute (m near zero after cancellation), ~8 ulp relative elsewhere. Observed: <= 6e-8 absolute.
STATE_TOL = (torch.float32, 1e-7, 1e-6)
# The param, in every model dtype, must equal the kernel's own fp32 master rounded to nearest even, bit for bit. Against
# the reference's param: an fp32 param is the master (STATE_TOL); a bf16/fp16 one must be within one unit in the last
# place (masters ~1 fp32 ulp apart can round to neighbouring half-precision values, never further).
HALF_PARAM_ULPS = {torch.bfloat16: 1, torch.float16: 1}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Column sums of squares: positive terms added in another order (tiles + pairwise vs torch's vectorized sum); the
# relative error of either order is a few eps * sqrt(R) at these sizes (observed <= 3e-7).
SCORE_RTOL = 1e-5

# Shapes that break block assumptions under both tiles, plus one more ragged multi-split launch.
SHAPES = edge_shapes(fs, narrow=40, short=5) + [
    ("splits_ragged", 45, 37, dict(_block_r=4, _block_c=16, _rows_per_split=12)),
]
KMODES = ["k0", "kC", "subset"]
NAMES = ["score", "slot", "col_step", "master", "exp_avg", "exp_avg_sq", "acc"]


def _k_for(mode: str, cols: int) -> int:
    return {"k0": 0, "kC": cols, "subset": max(1, cols // 3)}[mode]


def make_case(rows: int, cols: int, k: int, dtype: torch.dtype, *, n_selected: int | None = None,
              seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs. Columns get slots in a permuted, non-sorted order; slots not taken keep random values."""
    gen = torch.Generator().manual_seed(seed)
    n_sel = k if n_selected is None else n_selected
    param = torch.randn(rows, cols, generator=gen).to(dtype)
    chosen = torch.randperm(cols, generator=gen)[:n_sel]
    slot = torch.full((cols,), -1, dtype=torch.int32)
    slot[chosen] = torch.randperm(k, generator=gen)[:n_sel].to(torch.int32)
    master = torch.randn(rows, k, generator=gen)
    master[:, slot[chosen].long()] = param[:, chosen].float()
    return dict(
        param=param,
        grad=torch.randn(rows, cols, generator=gen).to(dtype),
        score=torch.rand(cols, generator=gen),
        slot=slot,
        col_step=torch.randint(1, 50, (cols,), generator=gen, dtype=torch.int32),
        master=master,
        exp_avg=torch.randn(rows, k, generator=gen) * 0.1,
        exp_avg_sq=torch.rand(rows, k, generator=gen) * 0.01,
        acc=torch.randn(rows, cols, generator=gen),
    )


def clone(case: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in case.items()}


def run(fn, case: dict[str, torch.Tensor], **kwargs) -> None:
    """``kwargs``: launcher keywords, and AdamHyperparams fields that replace HP's (the record is built here, so a
    bad value raises inside the caller's ``pytest.raises``)."""
    state = {name: case[name] for name in NAMES}
    hp = replace(HP, **{k: kwargs.pop(k) for k in HP_FIELDS & kwargs.keys()})
    fn(case["param"], case["grad"], **state, hp=hp, **{"accumulate": True, **kwargs})


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-dtype floats (0 for empty tensors)."""
    if a.numel() == 0:
        return 0
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    sign = 1 << (8 * a.element_size() - 1)

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.view(bits).long()
        return torch.where(i < 0, -(i & (sign - 1)), i)

    return int((ordered(a) - ordered(b)).abs().max())


def assert_step_matches(out: dict, ref: dict, before: dict, *, update_score: bool = True) -> None:
    """Triton result ``out`` vs reference result ``ref``, both from ``before``."""
    dtype = out["param"].dtype
    _, atol, rtol = STATE_TOL
    sel = out["slot"] >= 0
    for name in ("slot", "col_step", "grad"):  # inputs only
        assert torch.equal(out[name], before[name]), name
    for name in ("master", "exp_avg", "exp_avg_sq"):  # all slots: slots no column uses must stay as they were
        torch.testing.assert_close(out[name], ref[name], atol=atol, rtol=rtol, msg=name)
    # Plain fp32 adds: bitwise. Selected columns of acc carry no meaning; this kernel leaves them unwritten.
    assert torch.equal(out["acc"][:, ~sel], ref["acc"][:, ~sel])
    assert torch.equal(out["acc"][:, sel], before["acc"][:, sel])
    if update_score:
        torch.testing.assert_close(out["score"], ref["score"], atol=0.0, rtol=SCORE_RTOL)
    else:
        assert torch.equal(out["score"], before["score"])
    assert torch.equal(out["param"][:, ~sel], before["param"][:, ~sel])  # unselected columns untouched
    own = out["master"][:, out["slot"][sel].long()].to(dtype)
    assert torch.equal(out["param"][:, sel].view(torch.uint8), own.view(torch.uint8))  # bit for bit, also for bf16
    if dtype == torch.float32:
        torch.testing.assert_close(out["param"], ref["param"], atol=atol, rtol=rtol)
    else:
        assert ulp_distance(out["param"][:, sel], ref["param"][:, sel]) <= HALF_PARAM_ULPS[dtype]


@pytest.mark.parametrize("kmode", KMODES)
@pytest.mark.parametrize(("rows", "cols", "overrides"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_matches_reference_on_awkward_shapes(rows, cols, overrides, kmode):
    before = make_case(rows, cols, _k_for(kmode, cols), torch.bfloat16)
    out, ref = clone(before), clone(before)
    run(fs.fused_step_, out, **overrides)
    run(reference.fused_step_, ref)
    assert_step_matches(out, ref, before)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_and_hyperparams(dtype, decoupled, weight_decay, accumulate):
    before = make_case(37, 53, 17, dtype, seed=1)
    out, ref = clone(before), clone(before)
    kw = dict(decoupled=decoupled, weight_decay=weight_decay, accumulate=accumulate)
    run(fs.fused_step_, out, **kw)
    run(reference.fused_step_, ref, **kw)
    assert_step_matches(out, ref, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eps_dominant_and_small_beta1(dtype):
    """eps larger than sqrt(v) (so its value shows in every update), beta1 < 0.5 (torch's other lerp formula),
    a few zero gradients (v and m of those entries decay only)."""
    before = make_case(37, 53, 17, dtype, seed=8)
    before["exp_avg_sq"].mul_(1e-10)
    before["grad"][::5] = 0
    out, ref = clone(before), clone(before)
    kw = dict(eps=1e-3, beta1=0.2, beta2=0.5, lr=0.1)
    run(fs.fused_step_, out, **kw)
    run(reference.fused_step_, ref, **kw)
    assert_step_matches(out, ref, before)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_consecutive_steps(dtype, decoupled):
    """A window of three steps: acc overwritten then accumulated, scores accumulated, col_step incremented."""
    out = make_case(45, 37, 12, dtype, n_selected=9, seed=2)
    ref = clone(out)
    gen = torch.Generator().manual_seed(3)
    lrs = [1e-2, 3e-3, 5e-2]  # a schedule: lr is a runtime scalar
    for step, lr in enumerate(lrs):
        grad = torch.randn(45, 37, generator=gen).to(dtype)
        for case in (out, ref):
            case["grad"].copy_(grad)
            case["col_step"][case["slot"] >= 0] += 1
        before = clone(out)
        kw = dict(lr=lr, decoupled=decoupled, accumulate=step > 0)
        run(fs.fused_step_, out, _block_r=8, _block_c=16, _rows_per_split=16, **kw)  # 3 x 3 programs
        run(reference.fused_step_, ref, **kw)
        assert_step_matches(out, ref, before)
        # Carry on from identical state so that each step is checked on its own, not drift from earlier steps.
        for name in ("master", "exp_avg", "exp_avg_sq", "score", "param"):
            ref[name].copy_(out[name])


def test_update_score_false_leaves_score():
    before = make_case(37, 53, 9, torch.float32, seed=4)
    out, ref = clone(before), clone(before)
    run(fs.fused_step_, out, update_score=False, _rows_per_split=16, _block_r=8)
    run(reference.fused_step_, ref, update_score=False)
    assert_step_matches(out, ref, before, update_score=False)


def test_unused_slots_and_unselected_columns_untouched():
    # k = 8 slots, only 5 columns selected: slots 5..7 of the compact state belong to no column.
    before = make_case(21, 30, 8, torch.bfloat16, n_selected=5, seed=5)
    out = clone(before)
    run(fs.fused_step_, out)
    used = out["slot"][out["slot"] >= 0].long()
    unused = torch.ones(8, dtype=torch.bool)
    unused[used] = False
    assert unused.sum() == 3
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(out[name][:, unused], before[name][:, unused]), name
        assert not torch.equal(out[name][:, ~unused], before[name][:, ~unused]), name
    unsel = out["slot"] < 0
    assert torch.equal(out["param"][:, unsel], before["param"][:, unsel])


@pytest.mark.parametrize("overrides", [{}, dict(_block_r=4, _block_c=16, _rows_per_split=8)], ids=["plan", "splits"])
def test_deterministic(overrides):
    before = make_case(700, 3, 1, torch.bfloat16, seed=6) if not overrides else make_case(45, 37, 12, torch.float32)
    first, second = clone(before), clone(before)
    run(fs.fused_step_, first, **overrides)
    run(fs.fused_step_, second, **overrides)
    for name, t in first.items():
        assert torch.equal(t.view(torch.uint8), second[name].view(torch.uint8)), name


# numpy, inside the interpreter's fp32 -> fp16 cast, warns on the values that overflow to inf (as they should).
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize(("dtype", "bits"), [(torch.bfloat16, torch.int16), (torch.float16, torch.int16)])
def test_param_rounding_is_torchs(dtype, bits):
    """lr = 0 leaves the master as it is, so the param is exactly the rounding of chosen fp32 values: ties, values
    that overflow the model dtype, infinities, subnormals, NaN."""
    fp32_bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0xBF808000, 0x3F808001, 0x7F7FFFFF, 0x477FF000, 0x7F800000, 0xFF800000, 0x00000001,
         0x33800000, 0x33800001, 0x387FC000, 0x80000000],
        dtype=torch.int64,
    )
    values = fp32_bits.to(torch.int32).view(torch.float32)  # int64 -> int32 wraps the top bit into the sign
    rows = values.numel()
    values = torch.cat([values, torch.randn(rows * 20)]).view(-1, 1).repeat(1, 2)
    case = make_case(values.shape[0], 2, 2, dtype, seed=7)
    case["master"].copy_(values)
    case["master"][0, 0] = float("nan")
    run(fs.fused_step_, case, lr=0.0, weight_decay=0.0)
    sel = case["slot"].long()
    expected = case["master"][:, sel].to(dtype)
    got = case["param"]
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(bits), expected[~nan].view(bits))


# Bad input: every launcher raises exactly the reference's error (same check functions), and never copies.
def _bad_cases():
    def wrong_dtype(c):
        c["grad"] = c["grad"].to(torch.float16)

    def wrong_shape(c):
        c["acc"] = c["acc"][:, :-1].clone()

    def wrong_k(c):
        c["exp_avg"] = c["exp_avg"][:, :-1].clone()

    def non_contiguous(c):
        c["param"] = c["param"].t().contiguous().t()

    def non_contiguous_state(c):
        c["master"] = torch.empty(c["master"].shape[1], c["master"].shape[0]).t()

    def slot_dtype(c):
        c["slot"] = c["slot"].long()

    def bad_lr(c):
        return dict(lr=-1.0)

    def bad_beta(c):
        return dict(beta2=1.0)

    def slot_out_of_range(c):
        c["slot"][0] = 6  # k = 6
        return dict(check_slots=True)

    def slot_below_minus_one(c):
        c["slot"][0] = -2
        return dict(check_slots=True)

    return [wrong_dtype, wrong_shape, wrong_k, non_contiguous, non_contiguous_state, slot_dtype, bad_lr, bad_beta,
            slot_out_of_range, slot_below_minus_one]


@pytest.mark.parametrize("mutate", _bad_cases(), ids=lambda f: f.__name__)
def test_bad_input_raises_like_reference(mutate):
    errors = []
    for fn in (reference.fused_step_, fs.fused_step_):
        case = make_case(5, 7, 6, torch.float32)
        kwargs = mutate(case) or {}
        with pytest.raises((ValueError, TypeError)) as info:
            run(fn, case, **kwargs)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


def test_wrong_device_raises():
    case = {name: t.to("meta") for name, t in make_case(5, 7, 3, torch.float32).items()}
    with pytest.raises(ValueError, match="meta.*CUDA.*backend='torch'"):
        run(fs.fused_step_, case)


def _tall_meta(case: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """``case`` as meta tensors (no memory) with ``rows`` rows."""
    return {n: torch.empty((rows, *t.shape[1:]) if t.dim() == 2 else t.shape, dtype=t.dtype, device="meta")
            for n, t in case.items()}


def test_a_side_of_2_31_or_more_is_refused_by_name():
    # The kernels index rows and columns in int32: a program's first row would wrap negative and pass the row mask.
    # Meta tensors: refused on the sizes, before the device check.
    case = _tall_meta(make_case(5, 4, 1, torch.float32), 2**31)
    with pytest.raises(ValueError, match=r"fused_step_: param of shape \(2147483648, 4\) has a side of 2\^31"):
        run(fs.fused_step_, case)
    with pytest.raises(ValueError, match=r"fused_steps_: param of shape \(2147483648, 4\) has a side of 2\^31"):
        fs.fused_steps_([_args(case, dict(hp=HP, accumulate=True))])
    with pytest.raises(ValueError, match="meta"):  # 2^31 - 1 rows pass the size check and meet the device check
        run(fs.fused_step_, _tall_meta(make_case(5, 4, 1, torch.float32), 2**31 - 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU tensors")
def test_cpu_tensor_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    case = make_case(5, 7, 3, torch.float32)
    before = clone(case)
    with pytest.raises(ValueError, match="CPU tensor.*TRITON_INTERPRET=1.*backend='torch'"):
        run(fs.fused_step_, case)
    assert all(torch.equal(case[n], before[n]) for n in case)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU tensors")
def test_interpreter_flag_set_after_import_raises(monkeypatch):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    monkeypatch.setattr(_triton_utils, "interpreting", lambda kernel: False)  # as if compiled for a GPU
    with pytest.raises(ValueError, match="set after"):
        run(fs.fused_step_, make_case(5, 7, 3, torch.float32))


def test_without_triton_the_package_imports_and_kernels_say_what_to_do():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import zenflow_triton.kernels\n"
        "for name in ('fused_step', 'colnorm', 'merge'):\n"
        "    try:\n"
        "        __import__('zenflow_triton.kernels.' + name)\n"
        "    except ImportError as e:\n"
        "        assert \"pip install triton, or use backend='torch'\" in str(e), e\n"
        "    else:\n"
        "        raise AssertionError(name + ' imported without triton')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_empty_is_a_no_op():
    case = make_case(0, 4, 2, torch.float32)
    before = clone(case)
    run(fs.fused_step_, case)
    assert all(torch.equal(case[n], before[n]) for n in case)


# --- CUDA only ------------------------------------------------------------------------------------------------------


def _cuda_case(rows, cols, k, dtype, seed=0):
    return {name: t.cuda() for name, t in make_case(rows, cols, k, dtype, seed=seed).items()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(4096, 4096), (11008, 1024), (257, 30011)])
def test_cuda_matches_reference(rows, cols, dtype):
    before = _cuda_case(rows, cols, max(1, cols // 10), dtype)
    out, ref = clone(before), clone(before)
    run(fs.fused_step_, out)
    run(reference.fused_step_, ref)
    assert_step_matches(out, ref, before)
    again = clone(before)
    run(fs.fused_step_, again)
    for name, t in out.items():
        assert torch.equal(t.view(torch.uint8), again[name].view(torch.uint8)), name


@pytest.mark.gpu
def test_cuda_lr_change_does_not_recompile():
    case = _cuda_case(512, 512, 50, torch.bfloat16)
    kernel = fs._fused_step_kernel

    def compiled() -> int:
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    run(fs.fused_step_, case, lr=1e-3)
    n = compiled()
    for lr in (2e-3, 0.5, 0.0):
        run(fs.fused_step_, case, lr=lr, weight_decay=0.3, beta1=0.8)
    assert compiled() == n


@pytest.mark.gpu
def test_cuda_more_than_2_31_elements():
    """R*C > 2^31: checks columns whose far rows sit past int32 offsets, against the reference on those columns."""
    rows, cols, k = 2**16 + 1, 2**15 + 3, 16
    assert rows * cols > 2**31
    need = rows * cols * (2 + 2 + 4) * 1.25  # bf16 param + grad, fp32 acc, headroom
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    param = torch.randn(rows, cols, device=dev, generator=gen).to(torch.bfloat16)
    grad = torch.randn(rows, cols, device=dev, generator=gen).to(torch.bfloat16)
    acc = torch.randn(rows, cols, device=dev, generator=gen)
    probes = torch.tensor([0, 1, cols // 2, cols - 3, cols - 2, cols - 1], device=dev)
    selected = torch.tensor([cols // 2, cols - 1, 7, 1000], device=dev)  # two probes, two others
    slot = torch.full((cols,), -1, dtype=torch.int32, device=dev)
    slot[selected] = torch.tensor([3, 0, 2, 1], dtype=torch.int32, device=dev)
    state = dict(
        score=torch.rand(cols, device=dev), slot=slot,
        col_step=torch.randint(1, 9, (cols,), dtype=torch.int32, device=dev),
        master=torch.randn(rows, k, device=dev), exp_avg=torch.randn(rows, k, device=dev) * 0.1,
        exp_avg_sq=torch.rand(rows, k, device=dev) * 0.01, acc=acc,
    )
    # The oracle on the probe columns only: a contiguous sub-problem whose selected columns get slots 0, 1, ...
    sub_slot = slot[probes].clone()
    sub_sel = sub_slot >= 0
    sub_slot[sub_sel] = torch.arange(int(sub_sel.sum()), dtype=torch.int32, device=dev)
    src_slots = slot[probes][sub_sel].long()
    sub = dict(
        param=param[:, probes].contiguous(), grad=grad[:, probes].contiguous(), score=state["score"][probes].clone(),
        slot=sub_slot, col_step=state["col_step"][probes].clone(),
        master=state["master"][:, src_slots].contiguous(), exp_avg=state["exp_avg"][:, src_slots].contiguous(),
        exp_avg_sq=state["exp_avg_sq"][:, src_slots].contiguous(), acc=acc[:, probes].contiguous(),
    )
    sub_before = clone(sub)
    run(reference.fused_step_, sub)
    out = dict(param=param, grad=grad, **state)
    run(fs.fused_step_, out)
    got = dict(
        param=param[:, probes], grad=grad[:, probes], score=out["score"][probes], slot=sub_slot,
        col_step=out["col_step"][probes], master=out["master"][:, src_slots], exp_avg=out["exp_avg"][:, src_slots],
        exp_avg_sq=out["exp_avg_sq"][:, src_slots], acc=acc[:, probes],
    )
    assert_step_matches(got, sub, sub_before)


# ------------------------------------------------------------------------------------------ fused_steps_ (grouped)

# One grouped launch against fused_step_ per call: every dtype, both score paths (one split straight into score, and
# partials), k = 0 / k = C / a subset / fewer columns than slots, overwrite and accumulate, AdamW and Adam-L2, and
# two hyperparameter records. Rows of this list: (rows, cols, k, n_selected, dtype, accumulate, update_score).
GROUP = [
    (37, 53, 17, None, torch.float32, True, True),
    (700, 3, 1, None, torch.bfloat16, False, True),  # 700 rows: a multi-split plan, scores through partials
    (5, 130, 0, None, torch.float16, True, True),
    (300, 20, 20, None, torch.bfloat16, True, True),
    (1, 1, 1, None, torch.float32, False, True),
    (65, 9, 8, 5, torch.bfloat16, True, False),
    (257, 40, 13, None, torch.float32, True, True),
    (0, 7, 0, None, torch.float32, True, True),  # empty: skipped
    (129, 33, 0, None, torch.float16, False, True),
    (700, 5, 2, None, torch.float16, True, False),  # several splits, no scores: no partials row for it
    # C % 16 == 0: the aligned launch (128-bit loads on a GPU); the others above go through the unaligned one.
    (48, 32, 8, None, torch.bfloat16, True, True),
    (300, 64, 16, None, torch.float32, True, True),  # several splits: counts stored by the finishing launch
    (33, 16, 0, None, torch.float16, True, True),
]


def _grouped_cases(seed: int = 0) -> list[tuple[dict, dict]]:
    out = []
    for i, (rows, cols, k, n_sel, dtype, accumulate, update_score) in enumerate(GROUP):
        case = make_case(rows, cols, k, dtype, n_selected=n_sel, seed=seed + i)
        kw = dict(accumulate=accumulate, update_score=update_score, count_step=i % 4 != 3,
                  hp=replace(HP, decoupled=i % 3 != 1, lr=HP.lr * (1 + i % 2)))
        out.append((case, kw))
    return out


def _args(case: dict, kw: dict):
    from zenflow_triton.kernels.device_ops import FusedStepArgs

    return FusedStepArgs(param=case["param"], grad=case["grad"], **{n: case[n] for n in NAMES}, **kw)


def _assert_bitwise(a: dict, b: dict, where: str) -> None:
    for name in ("param", *NAMES):
        x, y = a[name], b[name]
        if x is None and y is None:  # acc=None
            continue
        bits = {2: torch.int16, 4: torch.int32}[x.element_size()]
        assert torch.equal(x.view(bits), y.view(bits)), f"{where}: {name}"


@pytest.mark.parametrize("block", [{}, dict(_block_r=8, _block_c=16)], ids=["plan", "gpu_tile"])
def test_fused_steps_equals_fused_step_per_call(block):
    grouped = _grouped_cases()
    single = [(clone(case), kw) for case, kw in grouped]
    for case, kw in single:
        c = _args(case, kw)
        fs.fused_step_(c.param, c.grad, score=c.score, slot=c.slot, col_step=c.col_step, master=c.master,
                       exp_avg=c.exp_avg, exp_avg_sq=c.exp_avg_sq, acc=c.acc, hp=c.hp, accumulate=c.accumulate,
                       update_score=c.update_score, count_step=c.count_step, **block)
    fs.fused_steps_([_args(case, kw) for case, kw in grouped], **block)
    for i, ((a, _), (b, _)) in enumerate(zip(grouped, single)):
        _assert_bitwise(a, b, f"call {i} {GROUP[i]}")


def test_fused_steps_over_a_window():
    """Three steps of one window, as the optimizer would launch them: acc overwritten then accumulated."""
    grouped = _grouped_cases(seed=10)
    single = [(clone(case), kw) for case, kw in grouped]
    gen = torch.Generator().manual_seed(11)
    for step in range(3):
        for (a, kw), (b, _) in zip(grouped, single):
            g = torch.randn(a["grad"].shape, generator=gen).to(a["grad"].dtype)
            a["grad"].copy_(g)
            b["grad"].copy_(g)
            kw["accumulate"] = step > 0
        fs.fused_steps_([_args(case, kw) for case, kw in grouped])
        reference_calls = [_args(case, kw) for case, kw in single]
        for c in reference_calls:
            c.apply(fs.fused_step_)
        for i, ((a, _), (b, _)) in enumerate(zip(grouped, single)):
            _assert_bitwise(a, b, f"step {step} call {i}")


def test_fused_steps_backends_agree_with_their_fused_step():
    """The torch and numba backends' fused_steps_ are loops over their fused_step_: identical by construction;
    checked here once so that the protocol's promise holds for all three."""
    from zenflow_triton.kernels import numba_device_ops

    for ops in (reference, numba_device_ops):
        grouped = _grouped_cases(seed=20)
        single = [(clone(case), kw) for case, kw in grouped]
        ops.fused_steps_([_args(case, kw) for case, kw in grouped])
        for case, kw in single:
            c = _args(case, kw)
            c.apply(ops.fused_step_)
        for i, ((a, _), (b, _)) in enumerate(zip(grouped, single)):
            _assert_bitwise(a, b, f"{ops.__name__} call {i}")


def test_fused_steps_misaligned_tensor_takes_the_unaligned_launch():
    """A contiguous view that starts 4 bytes into its storage (C % 16 == 0 otherwise): the host must not promise the
    compiler 16-byte alignment for it; the results are those of fused_step_ all the same."""
    calls, single = [], []
    for i, (rows, cols, k) in enumerate(((40, 32, 8), (24, 48, 0), (9, 16, 16))):
        case = make_case(rows, cols, k, torch.float32, seed=30 + i)
        if i == 0:
            buf = torch.empty(rows * cols + 1)
            shifted = buf[1:].view(rows, cols)
            shifted.copy_(case["grad"])
            case["grad"] = shifted
            assert shifted.data_ptr() % 16 and shifted.is_contiguous()
        kw = dict(accumulate=True, update_score=True, count_step=True, hp=HP)
        calls.append((case, kw))
        single.append((clone(case), kw))
    for case, kw in single:
        _args(case, kw).apply(fs.fused_step_)
    fs.fused_steps_([_args(case, kw) for case, kw in calls])
    for i, ((a, _), (b, _)) in enumerate(zip(calls, single)):
        _assert_bitwise(a, b, f"call {i}")


@pytest.mark.parametrize("sums", ["accumulate", "overwrite", "none"])
@pytest.mark.parametrize("rows", [70, 600], ids=["one_split", "splits"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_adam_equals_the_whole_tile_bit_for_bit(dtype, rows, sums):
    """A column block with at most BLOCK_K selected columns runs Adam on them alone, packed; with more, on the whole
    tile, masked. The same operations on the same values: every tensor bit for bit whichever path each block takes
    (BLOCK_K 2: every block whole; 16: mixed; 64: every block packed), per parameter and grouped. Blocks of 128
    columns with 40, 5 and (a partial block) 15 selected, slots in no particular order."""
    cols = 300
    case = make_case(rows, cols, 60, dtype, seed=7)
    chosen = torch.cat([torch.arange(0, 120, 3), torch.arange(130, 250, 25), torch.arange(256, 300, 3)])
    assert chosen.numel() == 60
    case["slot"] = torch.full((cols,), -1, dtype=torch.int32)
    case["slot"][chosen] = torch.randperm(60, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    assert (fs._plan(rows, cols, fs._INTERP_BLOCK_R, fs._BLOCK_C).splits > 1) == (rows == 600)
    if sums == "none":
        case["acc"] = None
    accumulate = sums == "accumulate"
    results = []
    for block_k in (2, 16, 64):
        single, grouped = ({n: (t.clone() if t is not None else None) for n, t in case.items()} for _ in range(2))
        run(fs.fused_step_, single, _block_k=block_k, count_step=True, accumulate=accumulate)
        fs.fused_steps_([_args(grouped, dict(hp=HP, accumulate=accumulate, count_step=True))], _block_k=block_k)
        _assert_bitwise(single, grouped, f"BLOCK_K {block_k}: grouped")
        results.append(single)
    for block_k, out in zip((16, 64), results[1:]):
        _assert_bitwise(out, results[0], f"BLOCK_K {block_k} against the whole tile")
    assert not torch.equal(results[0]["master"], case["master"])  # Adam ran


def test_fused_steps_launches_one_group_per_record_dtype_acc_and_alignment(monkeypatch):
    """Equal hyperparameter records (distinct objects) share a launch; another record, another dtype, calls without an
    acc and calls with a tensor off 16 bytes each get their own, and each call is in exactly one, in its order."""
    launched = []
    monkeypatch.setattr(fs, "_launch_group", lambda dtype, hp, has_acc, items, aligned, *rest: launched.append(
        (dtype, hp, has_acc, aligned, [item[0] for item in items])))
    f32, bf16 = torch.float32, torch.bfloat16
    other = replace(HP, lr=HP.lr * 2)
    specs = [(f32, replace(HP), True, 0), (f32, replace(HP), True, 0), (f32, other, True, 0), (bf16, HP, True, 0),
             (f32, HP, False, 0), (f32, HP, True, 1), (f32, replace(HP), True, 0)]
    calls = []
    for i, (dtype, hp, with_acc, shift) in enumerate(specs):
        case = make_case(8, 32, 4, dtype, seed=i)
        if shift:
            buf = torch.empty(8 * 32 + shift, dtype=dtype)
            case["grad"] = buf[shift:].view(8, 32).copy_(case["grad"])
        if not with_acc:
            case["acc"] = None
        calls.append(_args(case, dict(hp=hp, accumulate=with_acc)))
    fs.fused_steps_(calls)
    by_call = {id(c): i for i, c in enumerate(calls)}
    got = [(dtype, hp == HP, has_acc, aligned, [by_call[id(c)] for c in items])
           for dtype, hp, has_acc, aligned, items in launched]
    assert sorted(map(repr, got)) == sorted(map(repr, [
        (f32, True, True, True, [0, 1, 6]), (f32, False, True, True, [2]), (bf16, True, True, True, [3]),
        (f32, True, False, True, [4]), (f32, True, True, False, [5])]))


@pytest.mark.parametrize("splits", [None, 8], ids=["one_split", "splits"])
@pytest.mark.parametrize("kmode", KMODES)
def test_count_step_is_the_increment_then_the_step(kmode, splits):
    """count_step=True: col_step += 1 on the selected columns, then the step; bit for bit what the step does with the
    counts incremented beforehand (how the optimizer called it before the count was folded in), in every backend,
    with one row split (counts stored by the kernel) and several (stored after it)."""
    from zenflow_triton.kernels import numba_device_ops

    rows, cols = 40, 24
    case = make_case(rows, cols, _k_for(kmode, cols), torch.bfloat16, seed=41)
    sel = case["slot"] >= 0
    expected_steps = case["col_step"] + sel.to(torch.int32)
    block = {} if splits is None else dict(_block_r=8, _rows_per_split=splits)
    for name, fn, kw in (("triton", fs.fused_step_, block), ("numba", numba_device_ops.fused_step_, {}),
                         ("torch", reference.fused_step_, {})):
        counted, pre = clone(case), clone(case)
        pre["col_step"] += sel.to(torch.int32)
        run(fn, counted, count_step=True, **kw)
        run(fn, pre, **kw)
        assert torch.equal(counted["col_step"], expected_steps), name
        _assert_bitwise(counted, pre, name)
        if name == "torch":
            oracle = counted
    triton_out = clone(case)
    run(fs.fused_step_, triton_out, count_step=True, **block)
    assert torch.equal(triton_out["col_step"], oracle["col_step"])
    torch.testing.assert_close(triton_out["master"], oracle["master"], atol=STATE_TOL[1], rtol=STATE_TOL[2])


def test_fused_steps_checks_every_call_like_fused_step():
    case, kw = _grouped_cases()[0]
    good = _args(case, kw)
    bad = clone(case)
    bad["acc"] = bad["acc"][:, :-1]
    with pytest.raises(ValueError, match="acc must have shape"):
        fs.fused_steps_([good, _args(bad, kw)])
    bad = clone(case)
    bad["master"] = bad["master"].t().contiguous().t()
    with pytest.raises(ValueError, match="master must be contiguous"):
        fs.fused_steps_([_args(bad, kw)])
    with pytest.raises(ValueError, match="on one device"):
        fs.fused_steps_([good, _args({n: t.to("meta") for n, t in clone(case).items()}, kw)])
    # None is acc's alone (no sums); for any other tensor the call is refused, never launched on address 0.
    for name in ("param", "grad", *(n for n in NAMES if n != "acc")):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
            fs.fused_steps_([good, _args({**clone(case), name: None}, kw)])
    fs.fused_steps_([])  # nothing to do


@pytest.mark.gpu
def test_cuda_fused_steps_equals_fused_step_per_call():
    """Compiled: the grouped kernel against the per-parameter one, bit for bit, scores and step counts included. (The
    scores were at risk: the two kernels' tiles got different register layouts, and tl.sum's in-tile reduction tree
    follows the layout; column_sums fixes the order by construction. 30011 columns: the unaligned launch.)"""
    shapes = [(4096, 4096, 410), (11008, 1024, 103), (257, 30011, 3001), (2048, 2048, 0), (8192, 512, 52)]
    for dtype in DTYPES:
        grouped = []
        for i, (rows, cols, k) in enumerate(shapes):
            case = {n: t.cuda() for n, t in make_case(rows, cols, k, dtype, seed=i).items()}
            grouped.append((case, dict(accumulate=i % 2 == 0, update_score=i != 3, count_step=i != 1,
                                       hp=replace(HP, decoupled=i != 2))))
        single = [(clone(case), kw) for case, kw in grouped]
        for case, kw in single:
            c = _args(case, kw)
            c.apply(fs.fused_step_)
        fs.fused_steps_([_args(case, kw) for case, kw in grouped])
        for i, ((a, _), (b, _)) in enumerate(zip(grouped, single)):
            _assert_bitwise(a, b, f"{dtype} call {i} {shapes[i]}")
