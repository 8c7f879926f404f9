"""Plain-torch twins of every kernel: the oracle in tests, and backend ``"torch"`` of the device-side ops.

As a module this satisfies :class:`zenflow_triton.kernels.device_ops.DeviceOps` (``column_sumsq_``, ``fused_step_``,
``fused_steps_``, ``merge_``); ``host_adamw_`` is the twin of the numba host kernel in ``cpu_adamw.py``.

Layout (DESIGN §4): an offloaded parameter is viewed as a matrix ``[R, C]``; its columns are the channels.

- ``slot`` (int32 ``[C]``): -1 for an unselected column, else the column's slot in the compact state.
- compact ``master``/``exp_avg``/``exp_avg_sq`` (fp32 ``[R, k]``): Adam state of the k selected columns.
- ``col_step`` (int32 ``[C]``): per-column Adam step count used for bias correction, **already incremented**
  for the update being applied, unless the fused step is asked to count it (``count_step=True``: it adds 1 on the
  selected columns first). No other kernel writes it.
- ``acc`` (fp32 ``[R, C]``): sum of the unselected columns' gradients since the window began. Its
  selected columns hold no meaning (implementations may or may not write them). ``acc=None``: no accumulation
  target (accumulate="host" sums on the host); nothing is read or written in its place, and ``accumulate`` must be
  False.

AdamW here is ``torch.optim.AdamW``'s single-tensor update with the bias corrections taken per column, its
hyperparameters one :class:`~zenflow_triton.kernels.hyperparams.AdamHyperparams` record ``hp`` (validated when built).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ._checks import (
    check_column_sumsq_args,
    check_fused_step_args,
    check_host_adamw_args,
    check_merge_args,
    check_slot_range,
)
from .hyperparams import AdamHyperparams, require_hyperparams

if TYPE_CHECKING:  # device_ops imports this module
    from .step_args import FusedStepArgs

__all__ = [
    "adam_update_",
    "adam_update_foreach_",
    "column_sumsq_",
    "fused_step_",
    "fused_steps_",
    "merge_",
    "host_adamw_",
    "host_accumulate_",
    "moment_noise",
    "bf16_stochastic",
]

# Stochastic rounding of bf16 host moments (state_dtype="bfloat16"): 32 random bits per element and update, a hash of
# (flat index, the column's step count, a fixed seed), so a run, its resume and every backend round alike. The low 16
# bits round exp_avg, the high 16 bits exp_avg_sq. Hash: Wellons' lowbias32 (two multiplies; full avalanche) of
# index ^ rotate(step, 16) ^ seed: distinct for one element at distinct steps and for distinct elements at one step,
# with no multiply of its own (the kernel's arithmetic is what bounds it: docs/performance.md).
SR_SEED = 0x2545F491
_M32 = 0xFFFFFFFF


def moment_noise(index: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The 32 random bits (int64 in [0, 2^32)) of element ``index`` at its column's step count ``step``
    (broadcastable integer tensors): ``cpu_adamw``'s ``_noise``."""
    s = step.to(torch.int64) & _M32
    x = ((index.to(torch.int64) & _M32) ^ (((s << 16) | (s >> 16)) & _M32)) ^ SR_SEED
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def bf16_stochastic(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` to bf16, rounding the magnitude up with probability (dropped bits) / 2^16: ``noise`` (int64 in
    [0, 2^16)) is added to the low 16 bits before they are cut. NaN gives 0x7FC0; values near the largest bf16 may
    round to inf, as the magnitude's carry rolls into the exponent."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    r = ((u + noise) >> 16) & 0xFFFF
    r = torch.where(torch.isnan(x), torch.full_like(r, 0x7FC0), r)
    return torch.where(r >= 0x8000, r - 0x10000, r).to(torch.int16).view(torch.bfloat16)


def adam_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: torch.Tensor | int,
    hp: AdamHyperparams,
) -> None:
    """One Adam(W) step on fp32 tensors in place, op for op as ``torch.optim.AdamW`` (foreach=False).

    ``step`` is the (already incremented) step count: an int for the whole tensor, or an int tensor with
    one count per column (last dimension) whose bias corrections are computed in float64 like torch's.
    ``hp.decoupled=False`` is Adam with L2-coupled weight decay (``torch.optim.Adam``'s ``weight_decay``).
    """
    require_hyperparams(hp)
    if not isinstance(step, torch.Tensor):
        adam_update_foreach_([param], [grad], [exp_avg], [exp_avg_sq], step=step, hp=hp)
        return
    lr, beta1, beta2, eps, weight_decay, decoupled = hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.decoupled
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    s = step.to(torch.float64)
    step_size = (lr / (1 - beta1**s)).to(torch.float32)
    bc2_sqrt = (1 - beta2**s).sqrt().to(torch.float32)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    # addcdiv_(m, denom, value=-s) computes (-s * m) / denom on torch's CPU kernels; subtracting
    # (s * m) / denom rounds the same way with s a per-column tensor.
    param.sub_(exp_avg.mul(step_size).div_(denom))


def adam_update_foreach_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: int,
    hp: AdamHyperparams,
) -> None:
    """One Adam(W) step with an int ``step`` on lists of tensors (one device and dtype), op for op as
    ``torch.optim.AdamW`` / ``Adam`` (foreach=False), through torch's ``_foreach`` ops: one Python call per op for
    all tensors (many small resident parameters: biases, norms). :func:`adam_update_` uses it for int steps."""
    require_hyperparams(hp)
    lr, beta1, beta2, eps, weight_decay, decoupled = hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.decoupled
    if weight_decay != 0:
        if decoupled:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bc2_sqrt = (1 - beta2**step) ** 0.5
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)


def column_sumsq_(score: torch.Tensor, grad: torch.Tensor) -> None:
    """``score[j] += sum_i grad[i, j]**2`` in fp32."""
    check_column_sumsq_args(score, grad)
    g = grad.float()
    score.add_((g * g).sum(dim=0))


def fused_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    *,
    score: torch.Tensor,
    slot: torch.Tensor,
    col_step: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    acc: torch.Tensor | None,
    hp: AdamHyperparams,
    accumulate: bool,
    update_score: bool = True,
    check_slots: bool = False,
    count_step: bool = False,
) -> None:
    """One pass over ``grad [R, C]``: scores, AdamW on selected columns, accumulate the rest.

    (a) if ``update_score``: ``score += colsumsq(grad)``;
    (b) selected columns (``slot >= 0``): AdamW on the compact fp32 state with this step's gradient and
        bias correction from ``col_step`` (``count_step=True``: ``col_step += 1`` on the selected columns first, in
        place); the result is written into ``param`` in its own dtype;
    (c) unselected columns: ``acc = grad`` (``accumulate=False``, first step of a window) or ``acc += grad``;
        nothing with ``acc=None`` (then ``accumulate=True`` is a ValueError).
    ``check_slots=True`` also verifies that every slot lies in ``[-1, k)`` (costs a device sync).
    """
    _, _, k = check_fused_step_args(
        param, grad, score=score, slot=slot, col_step=col_step, master=master, exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq, acc=acc, accumulate=accumulate,
    )
    require_hyperparams(hp)
    if check_slots:
        check_slot_range(slot, k)
    if update_score:
        column_sumsq_(score, grad)
    # Selected columns of acc carry no meaning, so one dense pass beats a masked gather here.
    if acc is None:
        pass
    elif accumulate:
        acc.add_(grad)
    else:
        acc.copy_(grad)
    if k == 0:
        return
    cols = torch.nonzero(slot >= 0).squeeze(1)
    if cols.numel() == 0:
        return
    if count_step:
        col_step[cols] += 1
    slots = slot[cols].long()
    p = master.index_select(1, slots)
    m = exp_avg.index_select(1, slots)
    v = exp_avg_sq.index_select(1, slots)
    g = grad.index_select(1, cols).float()
    adam_update_(p, g, m, v, step=col_step[cols], hp=hp)
    master[:, slots] = p
    exp_avg[:, slots] = m
    exp_avg_sq[:, slots] = v
    param[:, cols] = p.to(param.dtype)


def fused_steps_(calls: Sequence[FusedStepArgs]) -> None:
    """:func:`fused_step_` for each call, in order: the definition of the batched op."""
    for c in calls:
        c.apply(fused_step_)


def merge_(param: torch.Tensor, snapshot: torch.Tensor, slot: torch.Tensor) -> None:
    """``param[:, j] = snapshot[:, j]`` for every unselected column j (``slot[j] < 0``); an fp32 ``snapshot`` (the
    master) of a bf16/fp16 ``param`` is rounded to nearest even, as the host kernel rounds the snapshot it writes."""
    check_merge_args(param, snapshot, slot)
    cols = torch.nonzero(slot < 0).squeeze(1)
    if cols.numel():
        param[:, cols] = snapshot.index_select(1, cols).to(param.dtype)


def host_adamw_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    count: int,
    slot: torch.Tensor,
    col_step: torch.Tensor,
    hp: AdamHyperparams,
    snapshot: torch.Tensor | None = None,
) -> None:
    """Host AdamW on the unselected columns (``slot < 0``) of full ``[R, C]`` state: fp32 master, fp32 or bf16 moments.

    The gradient is the mean ``grad / count`` (``grad`` fp32, bf16 or fp16, the sum of ``count`` gradients).
    Updated columns of ``master`` are also written to ``snapshot`` in its dtype (round to nearest even),
    when given; selected columns of every buffer are left untouched. bf16 moments are widened, updated in fp32
    (the master's step uses the fp32 values) and stored with :func:`bf16_stochastic`, the noise of element
    ``r * C + j`` at ``col_step[j]`` (:func:`moment_noise`; low half for exp_avg, high half for exp_avg_sq).
    """
    check_host_adamw_args(master, exp_avg, exp_avg_sq, grad, slot=slot, col_step=col_step, snapshot=snapshot,
                          count=count)
    require_hyperparams(hp)
    cols = torch.nonzero(slot < 0).squeeze(1)
    if cols.numel() == 0:
        return
    p = master.index_select(1, cols)
    m = exp_avg.index_select(1, cols)
    v = exp_avg_sq.index_select(1, cols)
    g = grad.index_select(1, cols).float()
    if count != 1:
        g.div_(count)
    m, v = m.float(), v.float()  # a copy of bf16 moments (index_select already copied fp32 ones)
    adam_update_(p, g, m, v, step=col_step[cols], hp=hp)
    master[:, cols] = p
    if exp_avg.dtype == torch.bfloat16:
        rows, width = master.shape
        index = torch.arange(rows, dtype=torch.int64)[:, None] * width + cols[None, :]
        noise = moment_noise(index, col_step[cols][None, :])
        m, v = bf16_stochastic(m, noise & 0xFFFF), bf16_stochastic(v, noise >> 16)
    exp_avg[:, cols] = m
    exp_avg_sq[:, cols] = v
    if snapshot is not None:
        snapshot[:, cols] = p.to(snapshot.dtype)


def host_accumulate_(dst: torch.Tensor, src: torch.Tensor, *, accumulate: bool) -> None:
    """The host window sum of ``accumulate="host"``: ``dst = src`` (a window's first step; a copy, so -0.0 stays
    -0.0) or ``dst += src``, ``dst`` fp32, ``src`` fp32/bf16/fp16 widened exactly: ``fused_step_``'s ``acc``."""
    if accumulate:
        dst.add_(src)
    else:
        dst.copy_(src)
