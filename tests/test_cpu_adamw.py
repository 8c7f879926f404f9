"""The numba host AdamW against the plain-torch reference, and the reference chain up to torch.optim.AdamW.

The kernel rounds like torch's CPU kernels in the moments (fma in lerp_/addcmul_/add(alpha=)), so exp_avg and
exp_avg_sq match torch bit for bit, but its denominator is ``fma(sqrt(v), 1 / bc2, eps)`` with IEEE ``sqrt``
(torch: ``sqrt(v) / bc2 + eps`` with an AVX2 sqrt that is an ulp off for ~16% of inputs), and the reference
orders ``(m / denom) * step_size`` where ``addcdiv_`` computes ``(step_size * m) / denom``. Masters therefore
agree to an ulp or two of the step, not bit for bit, and comparisons use tolerances.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from dataclasses import fields, replace

import numba
import numpy as np
import pytest
import torch

from zenflow_triton.kernels import AdamHyperparams, cpu_adamw, reference
from zenflow_triton.kernels._numba_utils import bf16_bits_array as _bf16_bits_array
from zenflow_triton.kernels._numba_utils import f16_bits_array as _f16_bits_array
from zenflow_triton.kernels.cpu_adamw import host_adamw_

HP = AdamHyperparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
HP_FIELDS = {f.name for f in fields(AdamHyperparams)}

# (dtype, atol, rtol) per compared tensor. The two implementations differ only in how the step rounds (sqrt,
# denominator, operand order: an ulp or two of the master); with L2 decay (g += wd * p) over several calls that
# ulp of p can flip an ulp of g, which reaches exp_avg as (1 - beta1) * ulp(|g| <= 4) ~ 5e-8, exp_avg_sq as ~1e-9.
# rtol 1e-6 is ~8 fp32 ulp. A wrong formula (bias correction, beta, decay) misses these by orders of magnitude.
# bf16/fp16 snapshots against the reference's: one ulp of the format, as the fp32 masters may straddle a rounding
# boundary (relative ulp up to 2^-7 for bf16's 8-bit significand, 2^-10 for fp16's 11), fp16's subnormal step as
# the floor. Against the kernel's own master the snapshot is checked bit for bit.
TOLS = {
    "master": (torch.float32, 1e-7, 1e-6),
    "exp_avg": (torch.float32, 1e-7, 1e-6),
    "exp_avg_sq": (torch.float32, 1e-9, 1e-6),
    "snapshot": {
        torch.float32: (torch.float32, 1e-7, 1e-6),
        torch.bfloat16: (torch.bfloat16, 0.0, 2.0**-7),
        torch.float16: (torch.float16, 2.0**-24, 2.0**-10),
    },
}
SHAPES = [(1, 1), (1, 37), (1, 9000), (37, 1), (3, 1000), (1000, 3), (13, 127), (5, 4099)]
PATTERNS = ["none", "all", "random", "runs"]
GRAD_DTYPES = [torch.float32, torch.bfloat16]
SNAP_DTYPES = [None, torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    cpu_adamw.warmup()  # compile once (or load numba's cache) before the timed tests start


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view, so comparisons are bit for bit (NaN payloads, signed zeros)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def make_slot(cols: int, pattern: str, gen: torch.Generator) -> torch.Tensor:
    slot = torch.full((cols,), -1, dtype=torch.int32)
    if pattern == "all":
        sel = torch.ones(cols, dtype=torch.bool)
    elif pattern == "random":
        sel = torch.rand(cols, generator=gen) < 0.3
    elif pattern == "runs":
        # Selected runs short enough to be computed and discarded, and long enough to cover whole 64-column skip
        # blocks (70, 130), between updated runs of 1 to 100 columns; long shapes cross the 4096-column chunks.
        sel = torch.zeros(cols, dtype=torch.bool)
        j, lengths, gaps = 0, [1, 3, 70, 5, 130, 2, 64], [2, 40, 1, 100, 7]
        for i in range(cols):
            if j >= cols:
                break
            n = lengths[i % len(lengths)]
            sel[j:j + n] = True
            j += n + gaps[i % len(gaps)]
    else:
        sel = torch.zeros(cols, dtype=torch.bool)
    slot[sel] = torch.arange(int(sel.sum()), dtype=torch.int32)
    return slot


def make_state(rows: int, cols: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [
        torch.randn(rows, cols, generator=gen),
        torch.randn(rows, cols, generator=gen).mul_(0.1),
        torch.rand(rows, cols, generator=gen).mul_(0.01),
    ]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str, what: str = "", lr: float = 1e-2) -> None:
    """``lr`` scales the absolute floor of the master's tolerance: the step's rounding is an ulp of ~lr."""
    tol = TOLS[name]
    dtype, atol, rtol = tol[actual.dtype] if isinstance(tol, dict) else tol
    assert actual.dtype == dtype
    if name == "master":
        atol *= max(1.0, lr / 1e-2)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True,
                               msg=lambda m: f"{what} {name}: {m}")


# Landing-buffer dtypes with every snapshot, and an fp16 model's own gradient (read in place on CPU tensors) with
# the fp16 parameter as the snapshot.
DTYPE_PAIRS = [(g, s) for g in GRAD_DTYPES for s in SNAP_DTYPES] + [(torch.float16, torch.float16)]


def _dtype_id(d: torch.dtype | None) -> str:
    return str(d).replace("torch.", "")


@pytest.mark.parametrize("grad_dtype,snap_dtype", DTYPE_PAIRS,
                         ids=[f"{_dtype_id(g)}-{_dtype_id(s)}" for g, s in DTYPE_PAIRS])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_reference(shape, pattern, grad_dtype, snap_dtype) -> None:
    rows, cols = shape
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape}{pattern}".encode()))
    slot = make_slot(cols, pattern, gen)
    unsel = slot < 0
    col_step = torch.full((cols,), 4, dtype=torch.int32)  # one count for all: the kernel's scalar ("uniform") path
    ours = make_state(rows, cols, gen)
    ref = [t.clone() for t in ours]
    snap_ours = None if snap_dtype is None else torch.randn(rows, cols, generator=gen).to(snap_dtype)
    snap_ref = None if snap_ours is None else snap_ours.clone()
    # Consecutive calls, as the optimizer makes them: col_step moves on for the updated columns, count varies,
    # and Adam-L2 (decoupled=False) alternates with AdamW.
    for call, (count, decoupled) in enumerate([(1, True), (3, False), (4, True)]):
        if call == 1:  # from here on, counts differ per column (columns that came back from the device)
            col_step += torch.randint(0, 30, (cols,), dtype=torch.int32, generator=gen)
        col_step[unsel] += 1
        grad = torch.randn(rows, cols, generator=gen).mul_(count).to(grad_dtype)
        before = [t.clone() for t in ours] + ([] if snap_ours is None else [snap_ours.clone()])
        kw = dict(count=count, slot=slot, col_step=col_step, hp=replace(HP, decoupled=decoupled))
        reference.host_adamw_(*ref, grad, snapshot=snap_ref, **kw)
        host_adamw_(*ours, grad, snapshot=snap_ours, **kw)
        for name, a, e in zip(("master", "exp_avg", "exp_avg_sq"), ours, ref):
            assert_close(a, e, name, f"call {call}")
        after = ours + ([] if snap_ours is None else [snap_ours])
        for b, a in zip(before, after):
            assert torch.equal(_bits(a)[:, ~unsel], _bits(b)[:, ~unsel]), "a selected column changed"
        if snap_ours is not None:
            # The snapshot is the kernel's own master in the snapshot dtype, bit for bit (torch rounds to nearest even).
            assert torch.equal(_bits(snap_ours)[:, unsel], _bits(ours[0].to(snap_dtype))[:, unsel])
            assert_close(snap_ours, snap_ref, "snapshot", f"call {call}")


@pytest.mark.parametrize(
    "hp",
    [
        dict(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0),  # lerp weight 1: torch's other formula
        dict(lr=1e-3, beta1=0.5, beta2=0.5, eps=0.0, weight_decay=0.0),  # weight exactly 0.5 takes it too
        dict(lr=1e-3, beta1=0.3, beta2=0.99, eps=1e-6, weight_decay=1.0),
        dict(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.5),  # lr 0: master unchanged
        dict(lr=1.0, beta1=0.99, beta2=0.9999, eps=1e-3, weight_decay=0.01),
    ],
    ids=["b1=0", "b1=0.5,eps=0", "b1=0.3,wd=1", "lr=0", "lr=1"],
)
@pytest.mark.parametrize("decoupled", [True, False])
def test_hyperparameter_corners(hp, decoupled) -> None:
    gen = torch.Generator().manual_seed(7)
    rows, cols = 9, 300
    slot = make_slot(cols, "random", gen)
    col_step = torch.randint(1, 5, (cols,), dtype=torch.int32, generator=gen)
    ours = make_state(rows, cols, gen)
    ours[2].add_(1e-4)  # eps = 0 with v = 0 would be 0/0 in both; keep v positive
    ref = [t.clone() for t in ours]
    grad = torch.randn(rows, cols, generator=gen)
    kw = dict(count=2, slot=slot, col_step=col_step, hp=AdamHyperparams(**hp, decoupled=decoupled))
    reference.host_adamw_(*ref, grad, **kw)
    host_adamw_(*ours, grad, **kw)
    for name, a, e in zip(("master", "exp_avg", "exp_avg_sq"), ours, ref):
        assert_close(a, e, name, lr=hp["lr"])


@pytest.mark.parametrize("chunk,block", [(16, 4), (64, 16), (256, 256)])
@pytest.mark.parametrize("shape", [(3, 1000), (1, 5003)], ids=["3x1000", "1x5003"])
def test_small_chunks_and_blocks(monkeypatch, shape, chunk, block) -> None:
    """Tiny work items and skip blocks (module constants, read per call): many chunks, so the plan runs in
    parallel, runs end at chunk edges and whole selected blocks are skipped, with step counts varying."""
    monkeypatch.setattr(cpu_adamw, "_CHUNK_COLS", chunk)
    monkeypatch.setattr(cpu_adamw, "_SKIP_BLOCK", block)
    monkeypatch.setattr(cpu_adamw, "_PARALLEL_PLAN_CHUNKS", 2)
    rows, cols = shape
    gen = torch.Generator().manual_seed(chunk + block + cols)
    slot = make_slot(cols, "runs", gen)
    slot[torch.rand(cols, generator=gen) < 0.05] = 0
    col_step = torch.full((cols,), 7, dtype=torch.int32)
    col_step[cols // 2:] += torch.randint(0, 3, (cols - cols // 2,), dtype=torch.int32, generator=gen)
    ours = make_state(rows, cols, gen)
    ref = [t.clone() for t in ours]
    snap_ours = torch.zeros(rows, cols, dtype=torch.bfloat16)
    snap_ref = snap_ours.clone()
    grad = torch.randn(rows, cols, generator=gen)
    kw = dict(count=2, slot=slot, col_step=col_step, hp=HP)
    reference.host_adamw_(*ref, grad, snapshot=snap_ref, **kw)
    host_adamw_(*ours, grad, snapshot=snap_ours, **kw)
    for name, a, e in zip(("master", "exp_avg", "exp_avg_sq"), ours, ref):
        assert_close(a, e, name)
    sel = slot >= 0
    assert torch.equal(_bits(snap_ours)[:, sel], torch.zeros_like(_bits(snap_ours)[:, sel]))
    assert torch.equal(_bits(snap_ours)[:, ~sel], _bits(ours[0].to(torch.bfloat16))[:, ~sel])


def test_plan_runs() -> None:
    """Runs skip whole selected blocks, stop at chunk edges, and are mixed exactly when they hold a selected column."""
    slot = np.full(40, -1, np.int32)
    slot[0:4] = 0  # block 0 all selected: skipped
    slot[9] = 1  # block 2 partly selected: mixed
    slot[24:32] = 2  # blocks 6 and 7 all selected: skipped
    col_step = np.full(40, 3, np.int32)
    col_step[33] = 4  # the last chunk is not uniform
    plan = cpu_adamw._plan(slot, col_step, 1e-3, 0.9, 0.999, 16, 4)
    _, _, starts, stops, mixed, uniform, run_ss, run_ib, visited = plan
    assert list(zip(starts, stops, mixed, uniform)) == [
        (4, 16, True, True), (16, 24, False, True), (32, 40, False, False)]
    assert visited == 12 + 8 + 8
    ss, ib = np.float32(1e-3 / (1 - 0.9**3)), np.float32(1 / (1 - 0.999**3) ** 0.5)
    assert run_ss[0] == ss and run_ib[0] == ib
    assert plan[0][33] == np.float32(1e-3 / (1 - 0.9**4)) and plan[0][32] == ss


@pytest.mark.parametrize("shape", [(64, 5000), (1, 20000)], ids=["64x5000", "1x20000"])
def test_deterministic_across_runs_and_threads(shape) -> None:
    threads = min(2, numba.config.NUMBA_NUM_THREADS)
    gen = torch.Generator().manual_seed(3)
    rows, cols = shape
    slot = make_slot(cols, "runs", gen)
    slot[torch.rand(cols, generator=gen) < 0.1] = -1
    col_step = torch.randint(1, 30, (cols,), dtype=torch.int32, generator=gen)
    init = make_state(rows, cols, gen)
    grad = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    results = []
    for n in (threads, threads, 1):
        state = [t.clone() for t in init]
        snap = torch.zeros(rows, cols, dtype=torch.bfloat16)
        for _ in range(2):
            host_adamw_(*state, grad, snapshot=snap, count=2, slot=slot, col_step=col_step, num_threads=n, hp=HP)
        results.append([_bits(t) for t in (*state, snap)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("decoupled,beta1", [(True, 0.9), (False, 0.9), (True, 0.3)])
def test_chained_oracle_torch_adamw(decoupled, beta1) -> None:
    """Every column unselected, count 1: N kernel steps are torch.optim.AdamW (Adam with L2) to fp32 rounding."""
    gen = torch.Generator().manual_seed(11)
    rows, cols = 33, 517
    p0 = torch.randn(rows, cols, generator=gen)
    param = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([param], lr=1e-2, betas=(beta1, 0.99), eps=1e-8, weight_decay=0.1, foreach=False)
    master, m, v = p0.clone(), torch.zeros(rows, cols), torch.zeros(rows, cols)
    slot = torch.full((cols,), -1, dtype=torch.int32)
    for step in range(1, 9):
        g = torch.randn(rows, cols, generator=gen)
        param.grad = g.clone()
        opt.step()
        host_adamw_(master, m, v, g, count=1, slot=slot, col_step=torch.full((cols,), step, dtype=torch.int32),
                    hp=AdamHyperparams(lr=1e-2, beta1=beta1, beta2=0.99, eps=1e-8, weight_decay=0.1,
                                       decoupled=decoupled))
    st = opt.state[param]
    assert_close(master, param.detach(), "master")
    assert_close(m, st["exp_avg"], "exp_avg")
    assert_close(v, st["exp_avg_sq"], "exp_avg_sq")


def test_all_selected_and_empty_touch_nothing() -> None:
    gen = torch.Generator().manual_seed(5)
    state = make_state(4, 50, gen)
    snap = torch.randn(4, 50, generator=gen).to(torch.float16)
    before = [t.clone() for t in (*state, snap)]
    slot = torch.arange(50, dtype=torch.int32)
    ones = torch.ones(50, dtype=torch.int32)
    host_adamw_(*state, torch.randn(4, 50), snapshot=snap, count=1, slot=slot, col_step=ones, hp=HP)
    for a, b in zip((*state, snap), before):
        assert torch.equal(_bits(a), _bits(b))
    for rows, cols in [(0, 5), (3, 0)]:
        z = [torch.zeros(rows, cols) for _ in range(4)]
        host_adamw_(*z, count=1, slot=torch.full((cols,), -1, dtype=torch.int32),
                    col_step=torch.ones(cols, dtype=torch.int32), hp=HP)


def test_num_threads_is_restored_and_checked() -> None:
    before = numba.get_num_threads()
    state = make_state(8, 8, torch.Generator().manual_seed(0))
    kw = dict(count=1, slot=torch.full((8,), -1, dtype=torch.int32), col_step=torch.ones(8, dtype=torch.int32), hp=HP)
    host_adamw_(*state, torch.randn(8, 8), num_threads=1, **kw)
    assert numba.get_num_threads() == before
    for bad in (0, numba.config.NUMBA_NUM_THREADS + 1, 1.5, True):
        with pytest.raises(ValueError, match="num_threads"):
            host_adamw_(*state, torch.randn(8, 8), num_threads=bad, **kw)


def _bad_cases():
    def good():
        return dict(
            master=torch.zeros(3, 4), exp_avg=torch.zeros(3, 4), exp_avg_sq=torch.zeros(3, 4), grad=torch.zeros(3, 4),
            count=1, slot=torch.full((4,), -1, dtype=torch.int32), col_step=torch.ones(4, dtype=torch.int32),
        )

    def case(**changes):
        kw = good()
        kw.update(changes)
        return kw

    dev = "cuda" if torch.cuda.is_available() else "meta"
    return {
        "master fp64": case(master=torch.zeros(3, 4, dtype=torch.float64)),
        "grad fp64": case(grad=torch.zeros(3, 4, dtype=torch.float64)),
        "exp_avg shape": case(exp_avg=torch.zeros(3, 5)),
        "master 1-D": case(master=torch.zeros(12)),
        "grad non-contiguous": case(grad=torch.zeros(4, 3).t()),
        "master non-contiguous": case(master=torch.zeros(3, 8)[:, ::2]),
        f"grad on {dev}": case(grad=torch.zeros(3, 4, device=dev)),
        f"master on {dev}": case(master=torch.zeros(3, 4, device=dev)),
        "slot int64": case(slot=torch.full((4,), -1, dtype=torch.int64)),
        "col_step shape": case(col_step=torch.ones(5, dtype=torch.int32)),
        "snapshot shape": case(snapshot=torch.zeros(4, 3, dtype=torch.bfloat16)),
        "snapshot fp64": case(snapshot=torch.zeros(3, 4, dtype=torch.float64)),
        "count 0": case(count=0),
        "count float": case(count=2.0),
        "count bool": case(count=True),
        "lr negative": case(lr=-1e-3),
        "lr nan": case(lr=float("nan")),
        "lr tensor": case(lr=torch.tensor(1e-3)),
        "beta1 1": case(beta1=1.0),
        "eps negative": case(eps=-1.0),
        "weight_decay negative": case(weight_decay=-0.1),
    }


def _with_hp(kw: dict) -> dict:
    """The keywords of a call: hyperparameter fields among ``kw`` replace HP's in the record ``hp`` (built here, so
    inside the caller's ``pytest.raises``: a bad value raises from the record)."""
    hp = replace(HP, **{k: v for k, v in kw.items() if k in HP_FIELDS})
    return {**{k: v for k, v in kw.items() if k not in HP_FIELDS}, "hp": hp}


@pytest.mark.parametrize("name", list(_bad_cases()))
def test_bad_inputs_raise_like_the_reference(name) -> None:
    kw = _bad_cases()[name]
    with pytest.raises((TypeError, ValueError)) as ours:
        host_adamw_(**_with_hp(kw))
    with pytest.raises((TypeError, ValueError)) as ref:
        reference.host_adamw_(**_with_hp(_bad_cases()[name]))
    assert type(ours.value) is type(ref.value)
    assert str(ours.value) == str(ref.value)


# --- rounding helpers against torch --------------------------------------------------------------------------------


def _torch_bits(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(x).to(dtype).view(torch.int16).numpy().view(np.uint16)


def _special_floats() -> np.ndarray:
    f32 = np.finfo(np.float32)
    vals = [0.0, -0.0, np.inf, -np.inf, f32.max, -f32.max, f32.tiny, f32.smallest_subnormal, 65504.0, 65519.996,
            65520.0, 65536.0, 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-9]
    bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF, 0x7F7FFFFF], np.uint32)
    return np.concatenate([np.array(vals, np.float32), bits.view(np.float32)])


def _check_rounding(fn, x: np.ndarray, dtype: torch.dtype) -> None:
    ours, theirs = fn(x), _torch_bits(x, dtype)
    nan = np.isnan(x)
    bad = (ours != theirs) & ~nan
    assert not bad.any(), f"{int(bad.sum())} mismatches, first input bits {x.view(np.uint32)[bad][:4]}"
    decoded = torch.from_numpy(ours.view(np.int16)).view(dtype).float().numpy()
    assert np.isnan(decoded[nan]).all(), "NaN must stay NaN"


def test_bf16_rounding_matches_torch() -> None:
    # Every sign/exponent/7-bit mantissa, with the 16 dropped bits at and around the tie; plus random patterns.
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lo = np.array([0, 1, 0x3FFF, 0x7FFF, 0x8000, 0x8001, 0xBFFF, 0xFFFF], np.uint32)
    rand = np.random.default_rng(0).integers(0, 2**32, 1 << 20, dtype=np.uint32)
    x = np.concatenate([(hi[:, None] | lo[None, :]).ravel(), rand]).view(np.float32)
    _check_rounding(_bf16_bits_array, np.concatenate([x, _special_floats()]), torch.bfloat16)


def test_f16_rounding_matches_torch() -> None:
    # Every sign/exponent/10-bit mantissa of fp32 (normal fp16 range, overflow, inf, NaN) with the 13 dropped
    # bits at and around the tie; fp16-subnormal results at every tie k * 2^-25 and one fp32 ulp either side;
    # uniform random bit patterns and random values in the subnormal range.
    hi = np.arange(1 << 19, dtype=np.uint32) << 13
    lo = np.array([0, 1, 0x7FF, 0xFFF, 0x1000, 0x1001, 0x17FF, 0x1FFF], np.uint32)
    ties = (np.arange(1 << 12, dtype=np.float64) * 2.0**-25).astype(np.float32)
    rng = np.random.default_rng(1)
    x = np.concatenate([
        (hi[:, None] | lo[None, :]).ravel().view(np.float32),
        ties, np.nextafter(ties, np.float32(1)), np.nextafter(ties, np.float32(0)), -ties,
        rng.integers(0, 2**32, 1 << 20, dtype=np.uint32).view(np.float32),
        (rng.random(1 << 18) * 2.0**-13 - 2.0**-14).astype(np.float32),
        _special_floats(),
    ])
    _check_rounding(_f16_bits_array, x, torch.float16)


@pytest.mark.parametrize(("env", "layer"), [(None, "threadsafe"), ("omp", "omp")])
def test_the_host_kernels_ask_for_a_threadsafe_layer_unless_the_user_chose(env, layer):
    """The worker's host AdamW and the adder's host add launch parallel regions at once (accumulate="host", on a
    GPU too, where numba_device_ops is never imported): numba's workqueue layer would abort the process."""
    environ = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    if env is not None:
        environ["NUMBA_THREADING_LAYER"] = env
    code = ("import numba, zenflow_triton.kernels.host_accumulate, zenflow_triton.kernels.cpu_adamw; "
            "print(numba.config.THREADING_LAYER)")
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == layer
