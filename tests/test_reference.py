"""The first link of the oracle chain: kernels/reference.py against torch.optim.AdamW / Adam."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from zenflow_triton.kernels import AdamHyperparams
from zenflow_triton.kernels import reference as ref

HP = AdamHyperparams(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
HP_FIELDS = {f.name for f in fields(AdamHyperparams)}
SHAPES = [(1, 1), (1, 17), (13, 1), (37, 53)]


def _torch_opt(decoupled: bool, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls([p], lr=HP.lr, betas=(HP.beta1, HP.beta2), eps=HP.eps,
               weight_decay=HP.weight_decay, foreach=False)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_step_all_selected_equals_torch(shape, decoupled) -> None:
    rows, cols = shape
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(shape, generator=gen)
    p = torch.nn.Parameter(w0.clone())
    opt = _torch_opt(decoupled, p)
    param = w0.clone()
    master, m, v = w0.clone(), torch.zeros(shape), torch.zeros(shape)
    perm = torch.randperm(cols, generator=gen)
    slot = torch.empty(cols, dtype=torch.int32)
    slot[perm] = torch.arange(cols, dtype=torch.int32)  # a shuffled slot map: compact column s holds perm[s]
    master = master[:, perm].contiguous()
    col_step = torch.zeros(cols, dtype=torch.int32)
    score, acc = torch.zeros(cols), torch.zeros(shape)
    expected_score = torch.zeros(cols)
    for _ in range(25):
        g = torch.randn(shape, generator=gen)
        p.grad = g.clone()
        opt.step()
        col_step += 1
        ref.fused_step_(param, g, score=score, slot=slot, col_step=col_step, master=master, exp_avg=m, exp_avg_sq=v,
                        acc=acc, hp=replace(HP, decoupled=decoupled), accumulate=False)
        expected_score += (g.double() ** 2).sum(0).float()
    # 25 fp32 AdamW steps: identical math, the per-column bias corrections rounded once more than torch's
    torch.testing.assert_close(param, p.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(master[:, slot.long()], p.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(score, expected_score, atol=0, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("decoupled", [True, False])
def test_host_adamw_all_unselected_count_one_equals_torch(shape, decoupled) -> None:
    cols = shape[1]
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(shape, generator=gen)
    p = torch.nn.Parameter(w0.clone())
    opt = _torch_opt(decoupled, p)
    master, m, v = w0.clone(), torch.zeros(shape), torch.zeros(shape)
    snapshot = torch.empty(shape, dtype=torch.bfloat16)
    slot = torch.full((cols,), -1, dtype=torch.int32)
    col_step = torch.zeros(cols, dtype=torch.int32)
    for _ in range(25):
        g = torch.randn(shape, generator=gen)
        p.grad = g.clone()
        opt.step()
        col_step += 1
        ref.host_adamw_(master, m, v, g, count=1, slot=slot, col_step=col_step, hp=replace(HP, decoupled=decoupled),
                        snapshot=snapshot)
    torch.testing.assert_close(master, p.detach(), atol=1e-6, rtol=1e-6)
    assert torch.equal(snapshot, master.to(torch.bfloat16))


def test_host_adamw_mean_gradient_and_mask() -> None:
    """count > 1 divides the summed gradient; selected columns are untouched; bf16 sums are read exactly."""
    gen = torch.Generator().manual_seed(2)
    shape = (5, 9)
    master, m, v = torch.randn(shape, generator=gen), torch.zeros(shape), torch.zeros(shape)
    slot = torch.tensor([-1, 0, -1, -1, 1, -1, -1, 2, -1], dtype=torch.int32)
    col_step = torch.ones(9, dtype=torch.int32)
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    total = (grads[0] + grads[1] + grads[2]).to(torch.bfloat16)
    expect_p, expect_m, expect_v = master.clone(), m.clone(), v.clone()
    unsel = slot < 0
    p_u, m_u, v_u = expect_p[:, unsel], expect_m[:, unsel], expect_v[:, unsel]
    ref.adam_update_(p_u, total.float()[:, unsel] / 3, m_u, v_u, step=1, hp=HP)
    before = master.clone()
    ref.host_adamw_(master, m, v, total, count=3, slot=slot, col_step=col_step, hp=HP)
    assert torch.equal(master[:, ~unsel], before[:, ~unsel])
    torch.testing.assert_close(master[:, unsel], p_u, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(m[:, unsel], m_u, atol=1e-7, rtol=1e-6)


def test_fused_step_accumulate_and_overwrite() -> None:
    gen = torch.Generator().manual_seed(3)
    shape = (4, 6)
    slot = torch.tensor([-1, 0, -1, -1, -1, 1], dtype=torch.int32)
    args = dict(score=torch.zeros(6), slot=slot, col_step=torch.ones(6, dtype=torch.int32),
                master=torch.zeros(4, 2), exp_avg=torch.zeros(4, 2), exp_avg_sq=torch.zeros(4, 2),
                acc=torch.full(shape, 7.0))
    g1, g2 = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    param = torch.zeros(shape)
    ref.fused_step_(param, g1, **args, accumulate=False, hp=HP)
    unsel = slot < 0
    assert torch.equal(args["acc"][:, unsel], g1[:, unsel])
    ref.fused_step_(param, g2, **args, accumulate=True, update_score=False, hp=HP)
    assert torch.equal(args["acc"][:, unsel], (g1 + g2)[:, unsel])
    torch.testing.assert_close(args["score"], (g1 * g1).sum(0))  # the second call did not add its scores
    assert torch.equal(param[:, unsel], torch.zeros(4, 4))  # unselected columns of the param untouched


def test_merge_only_unselected() -> None:
    param, snap = torch.zeros(3, 5, dtype=torch.bfloat16), torch.ones(3, 5, dtype=torch.bfloat16)
    slot = torch.tensor([0, -1, 1, -1, -1], dtype=torch.int32)
    ref.merge_(param, snap, slot)
    assert torch.equal(param[:, slot < 0], snap[:, slot < 0])
    assert torch.equal(param[:, slot >= 0], torch.zeros(3, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(grad=torch.zeros(4, 6, dtype=torch.float16)), TypeError, "grad must have dtype"),
        (dict(score=torch.zeros(5)), ValueError, "score must have shape"),
        (dict(slot=torch.zeros(6, dtype=torch.int64)), TypeError, "slot must have dtype"),
        (dict(acc=torch.zeros(6, 4).t()), ValueError, "acc must be contiguous"),
        (dict(master=torch.zeros(4, 7)), ValueError, "master must have shape"),
        (dict(exp_avg=torch.zeros(4, 2, device="meta")), ValueError, "exp_avg must be on cpu"),
        (dict(slot=torch.tensor([0, 5, -1, -1, -1, -1], dtype=torch.int32), check_slots=True), ValueError,
         "slot values"),
        (dict(lr=float("nan")), ValueError, "Invalid lr"),
    ],
)
def test_fused_step_rejects_bad_input(change, error, match) -> None:
    args = dict(param=torch.zeros(4, 6), grad=torch.zeros(4, 6), score=torch.zeros(6),
                slot=torch.tensor([-1, 0, -1, -1, -1, 1], dtype=torch.int32),
                col_step=torch.ones(6, dtype=torch.int32), master=torch.zeros(4, 2), exp_avg=torch.zeros(4, 2),
                exp_avg_sq=torch.zeros(4, 2), acc=torch.zeros(4, 6), accumulate=False)
    args.update({k: v for k, v in change.items() if k not in HP_FIELDS})
    hp_change = {k: v for k, v in change.items() if k in HP_FIELDS}
    param, grad = args.pop("param"), args.pop("grad")
    with pytest.raises(error, match=match):
        ref.fused_step_(param, grad, **args, hp=replace(HP, **hp_change))


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_update_foreach_equals_torch(decoupled, weight_decay) -> None:
    """The batched update (resident parameters, and adam_update_ with an int step) is torch.optim.AdamW / Adam
    (foreach=False), bit for bit, over several steps and shapes."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(7,), (3, 5), (1,), (64,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ours = [p.detach().clone() for p in params]
    m, v = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(params, lr=3e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, foreach=False)
    for step in range(1, 6):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.adam_update_foreach_(ours, grads, m, v, step=step, hp=AdamHyperparams(
            lr=3e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=weight_decay, decoupled=decoupled))
    for p, q, mi, vi in zip(params, ours, m, v):
        assert torch.equal(p.detach(), q)
        assert torch.equal(opt.state[p]["exp_avg"], mi)
        assert torch.equal(opt.state[p]["exp_avg_sq"], vi)
