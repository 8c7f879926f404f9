"""state_dtype="bfloat16": bf16 host moments beside the fp32 master (issue 29 item 2).

The oracle chain: the reference's bf16-moment rule (update in fp32, store with counter-based stochastic rounding)
is the definition; the numba kernel's moments equal it bit for bit (its master agrees to an ulp of the step, as
with fp32 moments: tests/test_cpu_adamw.py). The optimizer then holds 4 B/param less on the host, saves fp32
moments and the dtype, converts on load, and resumes bit for bit.
"""

from __future__ import annotations

import copy
import logging
import zlib
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_cpu_adamw import HP, assert_close, make_slot, make_state
from test_optimizer import MIN_OFFLOAD, Net, train_steps

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.config import ZenFlowConfig
from zenflow_triton.kernels import cpu_adamw, reference
from zenflow_triton.kernels.cpu_adamw import host_adamw_

# Shapes across the kernel's blocks: one row or column, primes, the 64-column skip block +-1, a 4096-column chunk
# crossed (5 x 4099), and more elements than one thread's minimum (16K) so the parallel path runs.
SHAPES = [(1, 1), (1, 37), (37, 1), (13, 127), (3, 63), (3, 65), (5, 4099), (130, 129)]
PATTERNS = ["none", "all", "random", "runs"]
KNOBS = dict(lr=2e-2, topk_ratio=0.2, update_interval=3, select_interval=6, min_offload_numel=MIN_OFFLOAD,
             warmup_steps=0, overlap_steps=None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    cpu_adamw.warmup(grad_dtypes=(torch.float32, torch.bfloat16), snapshot_dtypes=(None, torch.bfloat16),
                     state_dtypes=(torch.bfloat16,))


# ------------------------------------------------------------------------------------------------ the rounding rule


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 16, generator=gen) * 1e-3
    idx = torch.arange(x.numel())
    down = x.to(torch.bfloat16).float()  # one neighbour; the other is one bf16 ulp further from zero or nearer
    ups = []
    for step in range(1, 65):
        r = reference.bf16_stochastic(x, reference.moment_noise(idx, torch.tensor(step)) & 0xFFFF).float()
        lo = torch.minimum(down, r)
        hi = torch.maximum(down, r)
        # r is the truncation of x or one ulp above its magnitude: never further than one bf16 ulp from x
        assert bool(((hi - lo) <= torch.abs(x) * 2.0**-7 + 1e-45).all())
        assert bool((torch.sign(r) * torch.sign(x) >= 0).all())
        ups.append(r)
    mean = torch.stack(ups).mean(0)
    rel = ((mean - x).abs() / x.abs()).median()
    # 64 draws: each rounds with error up to 2^-8 relative, so the mean's error is ~2^-8 / 8; round-to-nearest's
    # median is ~2^-10 and does not shrink with draws. This bounds the bias, not the spread.
    assert float(rel) < 2.0**-10
    # Exact bf16 values stay exact, whatever the noise; NaN is 0x7FC0; inf stays inf.
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), 3.0e38]).to(torch.bfloat16).float()
    noise = torch.full(exact.shape, 0xFFFF, dtype=torch.int64)
    assert torch.equal(_bits(reference.bf16_stochastic(exact, noise)), _bits(exact.to(torch.bfloat16)))
    nan = reference.bf16_stochastic(torch.tensor([float("nan")]), torch.tensor([5]))
    assert int(_bits(nan)) == 0x7FC0


def test_noise_is_a_function_of_index_and_step() -> None:
    idx = torch.arange(1000)
    a = reference.moment_noise(idx, torch.tensor(7))
    assert torch.equal(a, reference.moment_noise(idx, torch.tensor(7)))
    assert not torch.equal(a, reference.moment_noise(idx, torch.tensor(8)))
    assert int(a.min()) >= 0 and int(a.max()) < 2**32
    # Low and high halves, the two moments' noise, are not the same bits.
    assert not torch.equal(a & 0xFFFF, a >> 16)


# ----------------------------------------------------------------------------------------- numba against reference


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "g16"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_numba_moments_match_reference_bit_for_bit(shape, pattern, grad_dtype) -> None:
    rows, cols = shape
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape}{pattern}".encode()))
    slot = make_slot(cols, pattern, gen)
    unsel = slot < 0
    col_step = torch.full((cols,), 4, dtype=torch.int32)
    master, m, v = make_state(rows, cols, gen)
    ours = [master, m.to(torch.bfloat16), v.to(torch.bfloat16)]
    ref = [t.clone() for t in ours]
    snap_ours = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    snap_ref = snap_ours.clone()
    # Decoupled decay: the moments do not read the master, so they stay bit-identical over calls (with L2 decay the
    # masters' ulp differences reach the gradient: the first call only).
    for call, (count, decoupled) in enumerate([(1, False), (3, True), (4, True)]):
        if call == 1:
            col_step += torch.randint(0, 30, (cols,), dtype=torch.int32, generator=gen)  # per-column counts
        col_step[unsel] += 1
        grad = torch.randn(rows, cols, generator=gen).mul_(count).to(grad_dtype)
        before = [t.clone() for t in ours]
        kw = dict(count=count, slot=slot, col_step=col_step, hp=replace(HP, decoupled=decoupled))
        reference.host_adamw_(*ref, grad, snapshot=snap_ref, **kw)
        host_adamw_(*ours, grad, snapshot=snap_ours, **kw)
        assert ours[1].dtype == ours[2].dtype == torch.bfloat16
        assert torch.equal(_bits(ours[1]), _bits(ref[1])), f"call {call}: exp_avg"
        assert torch.equal(_bits(ours[2]), _bits(ref[2])), f"call {call}: exp_avg_sq"
        assert_close(ours[0], ref[0], "master", f"call {call}")
        for b, a in zip(before, ours):
            assert torch.equal(_bits(a)[:, ~unsel], _bits(b)[:, ~unsel]), "a selected column changed"
        assert torch.equal(_bits(snap_ours)[:, unsel], _bits(ours[0].to(torch.bfloat16))[:, unsel])


@pytest.mark.parametrize("snap_dtype", [None, torch.float32, torch.float16, torch.bfloat16],
                         ids=["nosnap", "s32", "s16", "sb16"])
@pytest.mark.parametrize("pattern", ["none", "random"])
def test_numba_moments_match_reference_with_every_snapshot_and_nan(pattern, snap_dtype) -> None:
    """Every snapshot output (or none) beside bf16 moments, and non-finite gradients: the rounding's NaN case (0x7FC0)
    in the moments and the bf16 snapshot. The updated columns share one step count (the kernel's dense and uniform
    loops, whose noise uses the run's count: the selected columns, run starts included, count other steps)."""
    rows, cols = 9, 300
    gen = torch.Generator().manual_seed(11)
    slot = make_slot(cols, pattern, gen)
    if pattern != "none":
        slot[0] = int(slot.max()) + 1  # a run whose first column is selected
    unsel = slot < 0
    col_step = torch.full((cols,), 7, dtype=torch.int32)
    col_step[~unsel] += 3
    master, m, v = make_state(rows, cols, gen)
    ours = [master, m.to(torch.bfloat16), v.to(torch.bfloat16)]
    ref = [t.clone() for t in ours]
    grad = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    grad[0, :5] = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0])
    grad[3, 70] = float("nan")
    grad[5, cols - 1] = float("nan")
    snap = None if snap_dtype is None else torch.zeros(rows, cols, dtype=snap_dtype)
    kw = dict(count=1, slot=slot, col_step=col_step, hp=HP)
    reference.host_adamw_(*ref, grad, **kw)
    host_adamw_(*ours, grad, snapshot=snap, **kw)
    assert torch.equal(_bits(ours[1]), _bits(ref[1])), "exp_avg"
    assert torch.equal(_bits(ours[2]), _bits(ref[2])), "exp_avg_sq"
    assert bool(ours[1].isnan().any()), "the NaN case was not reached"
    assert_close(ours[0], ref[0], "master")
    if snap is not None:
        nan = ours[0].isnan()
        updated = unsel[None, :].expand(rows, cols)
        assert torch.equal(_bits(snap)[updated & ~nan], _bits(ours[0].to(snap_dtype))[updated & ~nan])
        assert bool(snap[updated & nan].isnan().all()) and bool(nan.any())
        if snap_dtype == torch.bfloat16:
            assert bool((_bits(snap)[updated & nan] == 0x7FC0).all())
        assert bool((snap[~updated] == 0).all()), "a selected column's snapshot changed"


@pytest.mark.parametrize("steps", ["uniform", "per-column"])
@pytest.mark.parametrize("snap_dtype", [None, torch.bfloat16], ids=["nosnap", "sb16"])
@pytest.mark.parametrize("pattern", ["none", "random"])
def test_common_flags_loops_match_the_general_ones(pattern, snap_dtype, steps, monkeypatch) -> None:
    """With bf16 moments and the common flags (no divide, decoupled decay, beta1 > 0.5) the kernel runs loops compiled
    without the flags (``cpu_adamw._common_hyperparams``): every output bit equals the general loops' (all three: dense,
    uniform with selected columns, per-column step counts), NaN included."""
    rows, cols = 7, 4099 + 300
    gen = torch.Generator().manual_seed(zlib.crc32(f"{pattern}{snap_dtype}{steps}".encode()))
    slot = make_slot(cols, pattern, gen)
    col_step = torch.full((cols,), 5, dtype=torch.int32)
    if steps == "per-column":
        col_step += torch.randint(0, 9, (cols,), dtype=torch.int32, generator=gen)
    master, m, v = make_state(rows, cols, gen)
    grad = torch.randn(rows, cols, generator=gen).mul_(4).to(torch.bfloat16)
    grad[2, int((slot < 0).nonzero()[0])] = float("nan")  # in an updated column
    hp = replace(HP, decoupled=True)
    assert cpu_adamw._common_hyperparams(cpu_adamw.scalar_hyperparams(4, hp)) is not None
    outs = []
    for common in (True, False):
        if not common:
            monkeypatch.setattr(cpu_adamw, "_common_hyperparams", lambda hpt: None)
        state = [master.clone(), m.to(torch.bfloat16), v.to(torch.bfloat16)]
        snap = None if snap_dtype is None else torch.zeros(rows, cols, dtype=snap_dtype)
        host_adamw_(*state, grad, count=4, slot=slot, col_step=col_step, hp=hp, snapshot=snap)
        outs.append([_bits(t) for t in state + ([] if snap is None else [snap])])
    assert bool(outs[0][1].eq(0x7FC0).any()), "the NaN case was not reached"
    for name, a, b in zip(["master", "exp_avg", "exp_avg_sq", "snapshot"], *outs):
        assert torch.equal(a, b), name
    # The general form is what the other flags get: a divided count, L2 decay, beta1 <= 0.5.
    for count, h in [(3, hp), (4, replace(hp, decoupled=False)), (4, replace(hp, beta1=0.4))]:
        assert cpu_adamw._common_hyperparams(cpu_adamw.scalar_hyperparams(count, h)) is None


def test_bf16_rule_is_the_fp32_update_rounded() -> None:
    """The reference's bf16 rule is the fp32 rule (which tests/test_reference.py chains to torch.optim.AdamW) with
    the updated moments rounded by bf16_stochastic, and the master stepped with the unrounded ones."""
    rows, cols = 7, 33
    gen = torch.Generator().manual_seed(3)
    master, m, v = make_state(rows, cols, gen)
    m16, v16 = m.to(torch.bfloat16), v.to(torch.bfloat16)
    slot = torch.full((cols,), -1, dtype=torch.int32)
    col_step = torch.arange(1, cols + 1, dtype=torch.int32)
    grad = torch.randn(rows, cols, generator=gen)
    f32 = [master.clone(), m16.float(), v16.float()]
    b16 = [master.clone(), m16.clone(), v16.clone()]
    kw = dict(count=1, slot=slot, col_step=col_step, hp=HP)
    reference.host_adamw_(*f32, grad, **kw)
    reference.host_adamw_(*b16, grad, **kw)
    assert torch.equal(f32[0], b16[0])
    noise = reference.moment_noise(torch.arange(rows * cols).view(rows, cols), col_step[None, :])
    assert torch.equal(_bits(b16[1]), _bits(reference.bf16_stochastic(f32[1], noise & 0xFFFF)))
    assert torch.equal(_bits(b16[2]), _bits(reference.bf16_stochastic(f32[2], noise >> 16)))


def test_mixed_moment_dtypes_are_refused() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="exp_avg_sq"):
        host_adamw_(z, z.to(torch.bfloat16), z.clone(), z.clone(), count=1,
                    slot=torch.full((3,), -1, dtype=torch.int32), col_step=torch.ones(3, dtype=torch.int32), hp=HP)


# --------------------------------------------------------------------------------------------------- the optimizer


def test_config_validates_state_dtype() -> None:
    with pytest.raises(ValueError, match="Invalid state_dtype"):
        ZenFlowConfig(state_dtype="float16")
    assert ZenFlowConfig().state_dtype == "float32"
    opt = ZenFlowAdamW(Net().parameters(), state_dtype="bfloat16", **KNOBS)
    with pytest.raises(TypeError, match="state_dtype"):  # fixed for the optimizer's life
        opt.set_knobs(state_dtype="float32")
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("accumulate", ["device", "host"])
def test_host_bytes_drop_by_four_per_param(accumulate, dtype) -> None:
    per_param = {}
    for state_dtype in ("float32", "bfloat16"):
        model = Net(dtype)
        with ZenFlowAdamW(model.parameters(), accumulate=accumulate, state_dtype=state_dtype, **KNOBS) as opt:
            train_steps(model, opt, range(2))
            st = opt.stats()
            host = [opt.state[p] for p in model.parameters() if "host_exp_avg" in opt.state[p]]
        assert host and all(s["host_exp_avg"].dtype == s["host_exp_avg_sq"].dtype == getattr(torch, state_dtype)
                            for s in host)
        assert all(s["host_master"].dtype == torch.float32 and s["master"].dtype == torch.float32 for s in host)
        assert st["state_dtype"] == state_dtype
        per_param[state_dtype] = st["host_bytes_per_param"]
    # Each slab view is 64-byte aligned: three offloaded matrices lose under 0.2 B/param to it here.
    assert per_param["float32"] - per_param["bfloat16"] == pytest.approx(4.0, abs=0.2)


def _run(state_dtype: str, steps: range, model: Net | None = None, opt: ZenFlowAdamW | None = None,
         device: str = "cpu", **knobs) -> tuple[Net, ZenFlowAdamW]:
    model = model or Net().to(device)
    opt = opt or ZenFlowAdamW(model.parameters(), state_dtype=state_dtype, **{**KNOBS, **knobs})
    train_steps(model, opt, steps)
    return model, opt


def _resume_is_bit_for_bit(accumulate: str, device: str) -> None:
    full_model, full_opt = _run("bfloat16", range(14), accumulate=accumulate, device=device)
    model, opt = _run("bfloat16", range(7), accumulate=accumulate, device=device)
    sd = copy.deepcopy(opt.state_dict())
    opt.close()
    assert sd["zenflow"]["state_dtype"] == "bfloat16"
    for st in sd["state"].values():  # moments saved as fp32, as torch.optim.AdamW keeps them
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
    resumed = Net().to(device)
    resumed.load_state_dict(model.state_dict())
    opt2 = ZenFlowAdamW(resumed.parameters(), state_dtype="bfloat16", accumulate=accumulate, **KNOBS)
    opt2.load_state_dict(sd)
    train_steps(resumed, opt2, range(7, 14))
    full_opt.flush()
    opt2.flush()
    for a, b in zip(full_model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    a_sd, b_sd = full_opt.state_dict(), opt2.state_dict()
    for sid, st in a_sd["state"].items():
        for key, value in st.items():
            other = b_sd["state"][sid][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
    full_opt.close()
    opt2.close()


@pytest.mark.parametrize("accumulate", ["device", "host"])
def test_resume_is_bit_for_bit(accumulate) -> None:
    """Save mid-window (step 7 of windows of 3, selections every 6), resume in a fresh optimizer: the stochastic
    rounding depends only on (index, step count), so both runs round alike."""
    _resume_is_bit_for_bit(accumulate, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", ["device", "host"])
def test_resume_is_bit_for_bit_on_cuda(accumulate) -> None:
    """The same on CUDA: pinned bf16 host moments, column moves through pinned fp32 staging."""
    _resume_is_bit_for_bit(accumulate, "cuda")


def test_bf16_moments_train_close_to_fp32() -> None:
    """Same run with either dtype: the parameters stay within bf16's relative precision of the moments' effect (a
    different update rule, e.g. a lost bias correction, is off by the step size, 2e-2, itself)."""
    m32, o32 = _run("float32", range(12))
    m16, o16 = _run("bfloat16", range(12))
    o32.flush()
    o16.flush()
    diffs = [float((a - b).abs().max()) for a, b in zip(m32.parameters(), m16.parameters())]
    assert 0.0 < max(diffs) < 2e-3, diffs
    o32.close()
    o16.close()


@pytest.mark.parametrize("saved,loaded", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_load_converts_between_dtypes_with_one_line(saved, loaded, caplog) -> None:
    model, opt = _run(saved, range(5))
    sd = copy.deepcopy(opt.state_dict())
    opt.close()
    opt2 = ZenFlowAdamW(model.parameters(), state_dtype=loaded, **KNOBS)
    with caplog.at_level(logging.INFO, logger="zenflow_triton"):
        opt2.load_state_dict(sd)
    lines = [r.getMessage() for r in caplog.records if "host moments" in r.getMessage()]
    assert len(lines) == 1 and f"kept in {saved}" in lines[0] and f"keeps them in {loaded}" in lines[0]
    host = [opt2.state[p] for p in model.parameters() if "host_exp_avg" in opt2.state[p]]
    for st, saved_st in zip(host, [v for v in sd["state"].values() if "selected" in v]):
        unsel = ~saved_st["selected"]
        want = saved_st["exp_avg"].reshape(st["host_exp_avg"].shape)[:, unsel]
        # fp32 -> bf16 rounds to nearest even; bf16 -> fp32 is exact
        assert torch.equal(_bits(st["host_exp_avg"][:, unsel]), _bits(want.to(st["host_exp_avg"].dtype)))
    # the saved state is fp32 either way, so a round trip through this optimizer's state_dict stays fp32
    assert all(v["exp_avg"].dtype == torch.float32 for v in opt2.state_dict()["state"].values())
    train_steps(model, opt2, range(5, 8))
    opt2.close()


def test_adamw_state_dict_loads_into_a_bf16_run(caplog) -> None:
    model = Net()
    adamw = torch.optim.AdamW(model.parameters(), lr=2e-2)
    train_steps(model, adamw, range(3))
    opt = ZenFlowAdamW(model.parameters(), state_dtype="bfloat16", **KNOBS)
    with caplog.at_level(logging.INFO, logger="zenflow_triton"):
        opt.load_state_dict(adamw.state_dict())
    assert sum("host moments were kept in float32" in r.getMessage() for r in caplog.records) == 1
    train_steps(model, opt, range(3, 6))
    assert all(np.isfinite(p.detach().numpy()).all() for p in model.parameters())
    opt.close()

