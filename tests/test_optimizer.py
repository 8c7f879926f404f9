"""ZenFlowAdamW against its oracles: torch.optim.AdamW for the degenerate modes, and an independent dense
simulation of DESIGN §3 (written here, sharing no code with the library) after every step."""

from __future__ import annotations

import copy
import io
import math
import os
import threading
import time

import pytest
import torch
from torch import nn

import zenflow_triton.optimizer as zopt
import zenflow_triton.pipeline as zpipe
from zenflow_triton import ZenFlowAdam, ZenFlowAdamW

MIN_OFFLOAD = 512
BACKENDS = ["torch", "numba", "triton"]


def _skip_unavailable(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":  # these tests run it on CPU tensors, with or without a GPU
            pytest.skip("triton backend on CPU tensors needs TRITON_INTERPRET=1")


class Net(nn.Module):
    """Embedding, linear layers with biases and LayerNorm; the three weight matrices are offloaded."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.emb = nn.Embedding(64, 32)  # [64, 32]: 2048 elements, offloaded
        self.fc1 = nn.Linear(32, 48)  # [48, 32]: 1536, offloaded; bias resident
        self.norm = nn.LayerNorm(48)  # resident
        self.fc2 = nn.Linear(48, 16)  # [16, 48]: 768, offloaded
        self.to(dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).mean(dim=1)
        return self.fc2(torch.tanh(self.norm(self.fc1(h))))


def batch(i: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, 64, (16, 5), generator=g), torch.randn(16, 16, generator=g).to(dtype)


def loss_fn(model: nn.Module, i: int) -> torch.Tensor:
    p = next(model.parameters())
    x, y = batch(i, p.dtype)
    return (model(x.to(p.device)) - y.to(p.device)).float().pow(2).mean()


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """The torch.optim loop over ``steps``: zero_grad, backward of step i's loss, step."""
    for i in steps:
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()


def offloaded(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.dim() >= 2 and p.numel() >= MIN_OFFLOAD]


# ---------------------------------------------------------------------------------------------- the simulation


class Simulation:
    """DESIGN §3 for one offloaded parameter, dense: full fp32 master/m/v, a boolean selection mask and
    per-column step counts; ``w`` is what the model sees (stale on unselected columns with overlap).

    ``step`` is called at every optimizer step, with ``grad=None`` where the parameter had no gradient: the
    schedule (window ends, selections) follows the optimizer's steps, a window's mean is over the gradients it got.
    It assumes some parameter ends a window at every window end (so pending host results are applied there)."""

    def __init__(self, p: torch.Tensor, *, r: float, interval: int, select: int, warmup: int, overlap: bool,
                 decoupled: bool = True, grad_dtype: torch.dtype = torch.float32, host_lr_scale: float = 1.0,
                 overlap_steps: int | None = None) -> None:
        self.rows = p.shape[0]
        self.cols = p.numel() // self.rows
        self.dtype = p.dtype
        self.w = p.detach().reshape(self.rows, self.cols).clone()
        self.master = self.w.to(torch.float32, copy=True)
        self.m = torch.zeros_like(self.master)
        self.v = torch.zeros_like(self.master)
        self.steps = torch.zeros(self.cols, dtype=torch.float64)
        self.score = torch.zeros(self.cols, dtype=torch.float64)
        self.sel = torch.zeros(self.cols, dtype=torch.bool)
        self.acc = torch.zeros_like(self.master)
        self.n = 0
        self.t = 0
        self.k = min(self.cols, math.ceil(round(r * self.cols, 6)))
        self.interval, self.select, self.warmup = interval, select, warmup
        self.overlap, self.decoupled = overlap, decoupled
        self.grad_dtype = grad_dtype  # the host receives the window's sum rounded to this dtype
        self.host_lr_scale = host_lr_scale  # windows after warm-up step with lr * this (warm-up does not use them)
        self.overlap_steps = overlap_steps  # with overlap: a result reaches w this many steps after its window end
        self.snapshot: torch.Tensor | None = None

    def _adam(self, cols: torch.Tensor, g: torch.Tensor, lr: float, b1: float, b2: float, eps: float, wd: float):
        self.steps[cols] += 1
        p, m, v = self.master[:, cols], self.m[:, cols], self.v[:, cols]
        if self.decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        s = self.steps[cols]
        bc1 = (1 - b1**s).float()
        bc2 = (1 - b2**s).float()
        p = p - lr * (m / bc1) / ((v / bc2).sqrt() + eps)
        self.master[:, cols], self.m[:, cols], self.v[:, cols] = p, m, v

    def flush(self) -> None:
        if self.snapshot is not None:
            unsel = ~self.sel
            self.w[:, unsel] = self.snapshot[:, unsel]
            self.snapshot = None

    def _end_window(self, lr: float, b1: float, b2: float, eps: float, wd: float, *, late: bool) -> None:
        """The host applies the window's mean gradient to the unselected columns; ``late``: one window late."""
        unsel_cols = torch.arange(self.cols)[~self.sel]
        if self.n and unsel_cols.numel():
            landed = self.acc.to(self.grad_dtype).float()
            lr = lr if self.host_lr_scale == 1.0 else lr * self.host_lr_scale
            self._adam(unsel_cols, landed[:, unsel_cols] / self.n, lr, b1, b2, eps, wd)
            if late:
                self.snapshot = self.master.to(self.dtype, copy=True)
            else:
                self.w[:, unsel_cols] = self.master[:, unsel_cols].to(self.dtype)
        self.acc.zero_()
        self.n = 0

    def _merge_due(self, tau: int) -> None:
        """``overlap_steps`` K < U: the pending result reaches ``w`` K steps after its window end."""
        if self.overlap and self.overlap_steps is not None and tau >= 1 and tau % self.interval == self.overlap_steps:
            self.flush()

    def flush_all(self, lr: float, b1: float, b2: float, eps: float, wd: float) -> None:
        """``optimizer.flush()``: pending results applied, and the open window ended early with what it holds."""
        self.flush()
        self._end_window(lr, b1, b2, eps, wd, late=False)

    def step(self, grad: torch.Tensor | None, lr: float, b1: float, b2: float, eps: float, wd: float) -> None:
        self.t += 1
        tau = self.t - self.warmup
        if grad is None:
            if tau >= 1 and (tau - 1) % self.select == 0:
                self.flush()  # the selection step waits for the host and applies every pending result
            if tau >= 1 and tau % self.interval == 0:
                if self.overlap:
                    self.flush()
                self._end_window(lr, b1, b2, eps, wd, late=self.overlap)
            self._merge_due(tau)
            return
        g = grad.reshape(self.rows, self.cols).float()
        self.score += g.double().pow(2).sum(0)
        everything = torch.arange(self.cols)
        if tau <= 0:
            self._adam(everything, g.to(self.grad_dtype).float(), lr, b1, b2, eps, wd)
            self.w = self.master.to(self.dtype, copy=True)
            return
        if (tau - 1) % self.select == 0:
            self.flush()
            self.sel = torch.zeros(self.cols, dtype=torch.bool)
            if self.k:
                self.sel[torch.topk(self.score, self.k).indices] = True
            self.score.zero_()
        sel_cols, unsel_cols = everything[self.sel], everything[~self.sel]
        if sel_cols.numel():
            self._adam(sel_cols, g[:, sel_cols], lr, b1, b2, eps, wd)
            self.w[:, sel_cols] = self.master[:, sel_cols].to(self.dtype)
        self.acc[:, unsel_cols] += g[:, unsel_cols]
        self.n += 1
        if tau % self.interval == 0:
            if self.overlap:
                self.flush()
            self._end_window(lr, b1, b2, eps, wd, late=self.overlap)
        self._merge_due(tau)


def check_against_simulation(
    *, backend: str, overlap: bool, warmup: int, r: float, interval: int, select: int, steps: int,
    dtype: torch.dtype = torch.float32, opt_cls: type = ZenFlowAdamW, clip: float | None = None,
    device: str = "cpu", grad_dtype: str = "float32", accumulate: str = "auto", host_lr_scale: float = 1.0,
    overlap_steps: int | None = None,
) -> ZenFlowAdamW:
    model = Net(dtype).to(device)
    twin = Net(dtype)  # resident params follow torch.optim.AdamW on an identical copy (on the CPU)
    hp = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    opt = opt_cls(model.parameters(), **hp, topk_ratio=r, update_interval=interval, select_interval=select,
                  warmup_steps=warmup, overlap=overlap, min_offload_numel=MIN_OFFLOAD, backend=backend,
                  grad_dtype=grad_dtype, accumulate=accumulate, host_lr_scale=host_lr_scale,
                  overlap_steps=overlap_steps)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    ref_cls = torch.optim.AdamW if opt_cls is ZenFlowAdamW else torch.optim.Adam
    resident_twin = [q for q in twin.parameters() if not (q.dim() >= 2 and q.numel() >= MIN_OFFLOAD)]
    ref = ref_cls(resident_twin, **hp, foreach=False)
    sims = {p: Simulation(p.detach().cpu(), r=r, interval=interval, select=select, warmup=warmup, overlap=overlap,
                          decoupled=opt_cls is ZenFlowAdamW, grad_dtype=getattr(torch, grad_dtype),
                          host_lr_scale=host_lr_scale, overlap_steps=overlap_steps)
            for p in offloaded(model)}
    # fp32 state differs from the simulation only by rounding (it computes the same math in another order);
    # bf16 parameters may land one bf16 ulp apart when a master value sits near a rounding boundary.
    atol, rtol = (2e-5, 1e-5) if dtype == torch.float32 else (1e-3, 2**-7)
    for i in range(steps):
        opt.zero_grad()
        loss_fn(model, i).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for q, p in zip(twin.parameters(), model.parameters()):
            q.grad = p.grad.cpu()
        lr = opt.param_groups[0]["lr"]
        opt.step()
        ref.param_groups[0]["lr"] = lr
        ref.step()
        sched.step()
        for p, sim in sims.items():
            sim.step(p.grad.cpu(), lr, *hp["betas"], hp["eps"], hp["weight_decay"])
            torch.testing.assert_close(p.detach().cpu().view(sim.rows, sim.cols), sim.w, atol=atol, rtol=rtol,
                                       msg=lambda m, i=i: f"step {i + 1}: {m}")
        for q, p in zip(twin.parameters(), model.parameters()):
            if not (p.dim() >= 2 and p.numel() >= MIN_OFFLOAD):
                torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=atol, rtol=rtol)
    opt.flush()
    for p, sim in sims.items():
        sim.flush()
        torch.testing.assert_close(p.detach().cpu().view(sim.rows, sim.cols), sim.w, atol=atol, rtol=rtol)
    return opt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("overlap", [True, False])
def test_matches_simulation_every_step(backend: str, overlap: bool) -> None:
    _skip_unavailable(backend)
    opt = check_against_simulation(backend=backend, overlap=overlap, warmup=3, r=0.25, interval=3, select=6,
                                   steps=27)
    st = opt.stats()
    assert st["selections"] == 4  # tau = 1, 7, 13, 19
    assert st["windows"] >= 3 + 8  # warm-up steps are windows of one step
    opt.close()


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("overlap", [True, False])
def test_host_lr_scale_matches_simulation(backend: str, overlap: bool) -> None:
    """host_lr_scale=s: the host windows after warm-up step with lr * s (decay included), warm-up and the device's
    selected columns with lr; the LR scheduler's lr at each window end (flush()'s early window: the next test)."""
    _skip_unavailable(backend)
    opt = check_against_simulation(backend=backend, overlap=overlap, warmup=2, r=0.25, interval=3, select=6,
                                   steps=17, host_lr_scale=2.5)
    assert opt.stats()["host_lr_scale"] == 2.5
    opt.close()
    # ZenFlowAdam: the coupled L2 term is not scaled (it is part of the gradient), the step is.
    check_against_simulation(backend=backend, overlap=overlap, warmup=0, r=0.1, interval=2, select=4, steps=9,
                             opt_cls=ZenFlowAdam, host_lr_scale=0.5).close()


def test_host_lr_scale_reaches_only_the_host_windows_after_warmup(monkeypatch) -> None:
    """The lr each host job gets: the group's own (an int lr stays an int) in warm-up and at the default 1.0, lr * s
    after warm-up, flush()'s early window included."""
    def lrs_seen(scale: float) -> list:
        seen: list = []
        real = zpipe.run_host_job

        def spy(items, ready, num_threads):
            seen.append(items[0].hp.lr)
            return real(items, ready, num_threads)

        monkeypatch.setattr(zpipe, "run_host_job", spy)
        w = nn.Parameter(torch.randn(32, 128))
        with ZenFlowAdamW([w], lr=1, topk_ratio=0.25, update_interval=2, warmup_steps=2, overlap=False,
                          host_lr_scale=scale) as opt:
            for _ in range(7):
                w.grad = torch.randn(32, 128)
                opt.step()
            opt.flush()  # ends the open window (tau = 5) early: a host window after warm-up like any other
        return seen

    default = lrs_seen(1.0)
    assert default == [1, 1, 1, 1, 1] and all(type(x) is int for x in default)
    assert lrs_seen(1.5) == [1, 1, 1.5, 1.5, 1.5]


def test_simulation_adam_l2_bf16_and_clipping() -> None:
    check_against_simulation(backend="torch", overlap=True, warmup=0, r=0.1, interval=2, select=4, steps=14,
                             opt_cls=ZenFlowAdam, clip=0.05)
    check_against_simulation(backend="torch", overlap=True, warmup=2, r=0.3, interval=2, select=4, steps=14,
                             dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_simulation_all_on_host_sync(dtype: torch.dtype) -> None:
    """The synchronous one-step windows on CPU tensors read the model's gradient in place and write the parameter
    directly (an fp32 parameter is its own host master): same trajectory as the simulation."""
    opt = check_against_simulation(backend="numba", overlap=False, warmup=2, r=0.0, interval=1, select=8, steps=12,
                                   dtype=dtype)
    st = opt.stats()
    # fp32: m, v and the landing buffer (no copy of the master); 16-bit: master, m, v, landing buffer and snapshot.
    # The small test weights add per-column step counts and 64-byte alignment: under half a byte per parameter.
    expected = 12.0 if dtype == torch.float32 else 18.0
    assert expected <= st["host_bytes_per_param"] < expected + 0.5
    # topk_ratio=0 keeps no scores (nothing reads them) and reports no selected energy.
    assert st["selected_energy_fraction"] == 0.0
    assert all(not opt.state[p]["score"].any() for p in opt._pipeline.records)
    opt.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_simulation_bf16_gradient_landing(overlap: bool) -> None:
    """grad_dtype="bfloat16": the host applies the window's sum rounded to bf16, in warm-up and synchronous
    one-step windows too (on CPU tensors an fp32 gradient is then not read in place)."""
    check_against_simulation(backend="numba", overlap=overlap, warmup=2, r=0.25, interval=2, select=4, steps=12,
                             grad_dtype="bfloat16")
    check_against_simulation(backend="numba", overlap=False, warmup=2, r=0.0, interval=1, select=4, steps=6,
                             grad_dtype="bfloat16")


def test_new_parameter_storage_is_followed() -> None:
    """``p.data = ...`` mid-training: like torch.optim.AdamW, the optimizer continues from the new values, also
    where the parameter is its own host master (fp32 on CPU, overlap=False)."""
    gen = torch.Generator().manual_seed(9)
    init = torch.randn(48, 96, generator=gen)
    grads = [torch.randn(48, 96, generator=gen) for _ in range(6)]
    replacement = torch.randn(48, 96, generator=gen)

    def run(make):
        w = nn.Parameter(init.clone())
        opt = make([w])
        for i, g in enumerate(grads):
            if i == 3:
                w.data = replacement.clone()
            w.grad = g.clone()
            opt.step()
        return w.detach()

    ours = run(lambda ps: ZenFlowAdamW(ps, lr=1e-2, topk_ratio=0.0, update_interval=1, overlap=False,
                                       min_offload_numel=1024, warmup_steps=0))
    ref = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_fp16_gradient_read_in_place() -> None:
    """An fp16 weight in the synchronous mode: the host kernel reads the fp16 gradient itself. (A whole fp16 model
    cannot run the simulation test: torch's resident AdamW divides by an eps that fp16 rounds to zero.)"""
    gen = torch.Generator().manual_seed(5)
    w = nn.Parameter(torch.randn(40, 70, generator=gen).to(torch.float16))
    sim = Simulation(w.detach(), r=0.0, interval=1, select=8, warmup=0, overlap=False)
    opt = ZenFlowAdamW([w], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, topk_ratio=0.0, update_interval=1,
                       overlap=False, min_offload_numel=1024, warmup_steps=0)
    for i in range(6):
        w.grad = torch.randn(40, 70, generator=gen).mul_(0.1 * (i + 1)).to(torch.float16)
        opt.step()
        sim.step(w.grad, 1e-2, 0.9, 0.99, 1e-8, 0.1)
        # One fp16 ulp where a master value sits next to a rounding boundary.
        torch.testing.assert_close(w.detach(), sim.w, atol=1e-3, rtol=2**-10, msg=lambda m, i=i: f"step {i}: {m}")
    opt.close()


@pytest.mark.parametrize("r", [0.0, 1.0])
def test_simulation_extreme_ratios_with_overlap(r: float) -> None:
    check_against_simulation(backend="torch", overlap=True, warmup=0, r=r, interval=2, select=4, steps=10)


# ----------------------------------------------------------------------------------- degenerate = AdamW


class Bigger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.emb = nn.Embedding(100, 48)
        self.fc1 = nn.Linear(48, 96)
        self.norm = nn.LayerNorm(96)
        self.fc2 = nn.Linear(96, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(self.emb(x).mean(1)))))


def train(make_opt, steps: int = 24, accumulate: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Bigger()
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-2, total_steps=steps, cycle_momentum=False)
    for i in range(steps):
        opt.zero_grad()
        for j in range(accumulate):
            g = torch.Generator().manual_seed(i * 10 + j)
            x, y = torch.randint(0, 100, (8, 6), generator=g), torch.randn(8, 48, generator=g)
            ((model(x) - y).pow(2).mean() / accumulate).backward()
        opt.step()
        sched.step()
    if hasattr(opt, "flush"):
        opt.flush()
    return model, opt


@pytest.mark.parametrize(
    "knobs",
    [dict(topk_ratio=1.0), dict(topk_ratio=0.0, update_interval=1, overlap=False)],
    ids=["all-on-device", "all-on-host-sync"],
)
@pytest.mark.parametrize("cls,ref_cls", [(ZenFlowAdamW, torch.optim.AdamW), (ZenFlowAdam, torch.optim.Adam)])
@pytest.mark.slow
def test_degenerate_modes_equal_torch(knobs, cls, ref_cls) -> None:
    ref_model, _ = train(lambda ps: ref_cls(ps, lr=1e-2, weight_decay=0.1, foreach=False), accumulate=2)
    model, opt = train(lambda ps: cls(ps, lr=1e-2, weight_decay=0.1, min_offload_numel=1024, **knobs),
                       accumulate=2)
    assert opt.stats()["offloaded_params"] == 100 * 48 + 96 * 48 * 2
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        # fp32 rounding: both run the same AdamW; per-column bias corrections round like torch's scalar ones
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
    opt.close()


def test_gradient_accumulation_loses_nothing() -> None:
    """Two backward() calls of half batches give the same update as one call on the whole batch."""

    def run(split: bool) -> nn.Module:
        model = Bigger()
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.2, update_interval=2, min_offload_numel=1024,
                           warmup_steps=0)
        for i in range(8):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randint(0, 100, (8, 6), generator=g), torch.randn(8, 48, generator=g)
            opt.zero_grad()
            if split:
                for xs, ys in ((x[:4], y[:4]), (x[4:], y[4:])):
                    ((model(xs) - ys).pow(2).sum() / y.numel()).backward()
            else:
                ((model(x) - y).pow(2).sum() / y.numel()).backward()
            opt.step()
        opt.close()
        return model

    a, b = run(True), run(False)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- resume


def run_with_checkpoint(total: int, at: int | None, **knobs) -> tuple[list[torch.Tensor], dict]:
    """Train ``total`` steps; if ``at`` is given, checkpoint after step ``at`` through torch.save, and finish
    on a fresh model and optimizer loaded from it."""

    def make(model):
        opt = ZenFlowAdamW(model.parameters(), lr=2e-2, min_offload_numel=MIN_OFFLOAD, **knobs)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)

    model = Net()
    opt, sched = make(model)
    for i in range(total):
        if i == at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
            opt.close()
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=True)
            model = Net()
            torch.manual_seed(999)  # a fresh process would not share the old one's RNG state either
            model.load_state_dict(ckpt["model"])
            opt, sched = make(model)
            opt.load_state_dict(ckpt["opt"])
            sched.load_state_dict(ckpt["sched"])
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
        sched.step()
    params = [p.detach().clone() for p in model.parameters()]
    sd = copy.deepcopy(opt.state_dict())
    opt.close()
    return params, sd


@pytest.mark.parametrize("overlap", [True, False])
def test_resume_is_bitwise(overlap: bool) -> None:
    knobs = dict(topk_ratio=0.2, update_interval=3, select_interval=6, warmup_steps=2, overlap=overlap)
    total = 20
    straight, straight_sd = run_with_checkpoint(total, None, **knobs)
    # after warm-up step 1; right after a window end (job in flight); mid-window; just before a selection
    for at in (1, 5, 6, 9, 13):
        resumed, resumed_sd = run_with_checkpoint(total, at, **knobs)
        for a, b in zip(straight, resumed):
            assert torch.equal(a, b), f"checkpoint after step {at}: parameters differ"
        for sid, st in straight_sd["state"].items():
            for key, value in st.items():
                other = resumed_sd["state"][sid][key]
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, other), f"checkpoint after step {at}: state {key} differs"
                else:
                    assert value == other, f"checkpoint after step {at}: state {key} differs"


@pytest.mark.parametrize("overlap", [True, False])
def test_host_lr_scale_is_checkpointed(overlap: bool) -> None:
    """host_lr_scale is saved with the knobs and a resumed run continues bit for bit; a checkpoint's value wins over
    the constructor's (the trajectory is the checkpoint's), one saved before the knob existed loads as 1.0, and an
    invalid one is refused."""
    knobs = dict(topk_ratio=0.2, update_interval=3, select_interval=6, warmup_steps=2, overlap=overlap,
                 host_lr_scale=2.0)
    straight, sd = run_with_checkpoint(14, None, **knobs)
    assert sd["zenflow"]["host_lr_scale"] == 2.0 and sd["param_groups"][0]["zenflow"]["host_lr_scale"] == 2.0
    for at in (5, 7):  # right after a window end (job in flight with overlap); mid-window
        resumed, _ = run_with_checkpoint(14, at, **knobs)
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed)), f"checkpoint after step {at}"
    adam_rule, _ = run_with_checkpoint(14, None, **dict(knobs, host_lr_scale=1.0))
    assert not all(torch.equal(a, b) for a, b in zip(straight, adam_rule))  # the knob changes the trajectory

    def loaded(saved: dict, scale: float) -> float:
        with ZenFlowAdamW(Net().parameters(), lr=2e-2, min_offload_numel=MIN_OFFLOAD,
                          **dict(knobs, host_lr_scale=scale)) as opt:
            opt.load_state_dict(saved)
            return opt.stats()["host_lr_scale"]

    assert loaded(sd, 1.0) == 2.0
    old = copy.deepcopy(sd)
    for entry in (old["zenflow"], *(g["zenflow"] for g in old["param_groups"])):
        del entry["host_lr_scale"]
    assert loaded(old, 3.0) == 1.0
    bad = copy.deepcopy(sd)
    bad["zenflow"]["host_lr_scale"] = -2.0
    with pytest.raises(ValueError, match="host_lr_scale"):
        loaded(bad, 3.0)


def test_state_dict_does_not_move_params_and_waits_for_host() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, min_offload_numel=MIN_OFFLOAD,
                       warmup_steps=0)
    for i in range(4):  # ends two windows: the second one's result is still pending with overlap
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    sd = opt.state_dict()
    assert any(st.get("pending") for st in sd["state"].values())
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    opt.flush()
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    assert any(changed), "flush() should apply the pending host window"
    opt.close()


# --------------------------------------------------------------------------------------- params and errors


def test_frozen_and_gradless_params_untouched() -> None:
    model = Net()
    model.fc2.weight.requires_grad_(False)
    extra = nn.Parameter(torch.randn(40, 40))  # never gets a gradient
    opt = ZenFlowAdamW(list(model.parameters()) + [extra], lr=1e-2, min_offload_numel=MIN_OFFLOAD, warmup_steps=0)
    frozen, extra0 = model.fc2.weight.detach().clone(), extra.detach().clone()
    for i in range(6):
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
    opt.flush()
    assert torch.equal(model.fc2.weight, frozen) and torch.equal(extra, extra0)
    assert model.fc2.weight not in opt.state and extra not in opt.state
    opt.close()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-1.0), "Invalid lr"),
        (dict(betas=(1.0, 0.9)), "beta parameter at index 0"),
        (dict(betas=(0.9, -0.1)), "beta parameter at index 1"),
        (dict(eps=-1e-8), "epsilon"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(topk_ratio=1.5), "topk_ratio"),
        (dict(update_interval=0), "update_interval"),
        (dict(update_interval=4, select_interval=6), "select_interval"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(backend="cuda"), "backend"),
        (dict(grad_dtype="float16"), "grad_dtype"),
        (dict(cpu_threads=0), "cpu_threads"),
        (dict(cpu_threads=10_000), "at most .* numba threads"),  # more than this process can run
        (dict(host_lr_scale=0.0), "host_lr_scale"),
        (dict(host_lr_scale=-1.0), "host_lr_scale"),
        (dict(host_lr_scale=math.inf), "host_lr_scale"),
        (dict(host_lr_scale=math.nan), "host_lr_scale"),
        (dict(host_lr_scale=True), "host_lr_scale"),
        (dict(host_lr_scale="2"), "host_lr_scale"),
        (dict(lr=torch.tensor([0.1, 0.2])), "Tensor lr must be 1-element"),  # torch.optim.AdamW's error
    ],
)
def test_invalid_hyperparameters(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ZenFlowAdamW(Net().parameters(), **kwargs)


def test_bad_params_and_grads() -> None:
    with pytest.warns(UserWarning, match="duplicate parameters"):  # as torch.optim.AdamW
        p = nn.Parameter(torch.randn(4, 4))
        ZenFlowAdamW([p, p], warmup_steps=0).close()
    with pytest.raises(ValueError, match="more than one parameter group"):  # as torch.optim.AdamW
        ZenFlowAdamW([{"params": [p]}, {"params": [p]}], warmup_steps=0)
    with pytest.raises(ValueError, match="complex"):
        ZenFlowAdamW([nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))], warmup_steps=0)
    with pytest.raises(ValueError, match="meta"):
        ZenFlowAdamW([nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.empty(4, 4, device="meta"))], warmup_steps=0)
    emb = nn.Embedding(100, 64, sparse=True)
    opt = ZenFlowAdamW(emb.parameters(), min_offload_numel=16, warmup_steps=0)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    opt.close()
    with pytest.raises(ValueError, match="parameter groups"):
        ZenFlowAdamW(Net().parameters(), warmup_steps=0).load_state_dict({"state": {}, "param_groups": []})


def test_triton_backend_on_cpu_needs_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):  # at construction, not at the first step()
        ZenFlowAdamW(Net().parameters(), min_offload_numel=MIN_OFFLOAD, backend="triton", warmup_steps=0)


# ------------------------------------------------------------------------------------------ worker faults


def _train_steps(opt: ZenFlowAdamW, model: nn.Module, steps: int) -> None:
    for i in range(steps):
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()


def test_worker_exception_surfaces_at_next_step(monkeypatch) -> None:
    def broken(*args):
        raise FloatingPointError("injected host fault")

    monkeypatch.setattr(zpipe, "run_host_job", broken)
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), topk_ratio=0.1, update_interval=2, min_offload_numel=MIN_OFFLOAD,
                       warmup_steps=0)
    _train_steps(opt, model, 2)  # the window ends here; the job fails in the worker
    time.sleep(0.2)
    with pytest.raises(RuntimeError, match="host worker failed") as info:
        _train_steps(opt, model, 1)
    assert isinstance(info.value.__cause__, FloatingPointError)
    with pytest.raises(RuntimeError, match="stopped after a host worker failure"):
        opt.step()
    opt.close()


def test_hung_worker_becomes_error(monkeypatch) -> None:
    release = threading.Event()

    def hang(*args):
        release.wait(10)
        return 0.0

    monkeypatch.setattr(zpipe, "run_host_job", hang)
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), update_interval=1, overlap=False, min_offload_numel=MIN_OFFLOAD,
                       worker_timeout=0.3, warmup_steps=0)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="did not finish a job within worker_timeout"):
        _train_steps(opt, model, 1)
    assert time.perf_counter() - start < 5
    release.set()
    opt.close()


def test_dead_worker_becomes_error() -> None:
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), update_interval=2, min_offload_numel=MIN_OFFLOAD, warmup_steps=0)
    opt._pipeline.worker._queue.put(None)  # the thread exits as if it had crashed
    opt._pipeline.worker._thread.join(5)
    with pytest.raises(RuntimeError, match="died"):
        _train_steps(opt, model, 2)
    opt.close()


# ------------------------------------------------------------------------------------- lifecycle, telemetry


def test_stats_flush_close_and_context_manager() -> None:
    model = Net()
    with ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                      min_offload_numel=MIN_OFFLOAD, warmup_steps=0) as opt:
        _train_steps(opt, model, 8)
        st = opt.stats()
        assert st["steps"] == 8 and st["windows"] == 4 and st["selections"] == 1
        assert st["selected_fraction"] == pytest.approx((8 + 8 + 12) / (32 + 32 + 48))
        assert 0.25 < st["selected_energy_fraction"] <= 1.0
        numel = 64 * 32 + 48 * 32 + 16 * 48
        assert st["offloaded_params"] == numel
        assert st["d2h_bytes"] >= 4 * numel * 4 - 1  # four windows of fp32 sums
        assert 16.0 <= st["host_bytes_per_param"] <= 18.0  # master, m, v, fp32 landing (+ alignment)
        assert st["stall_s"] >= 0 and st["host_job_s"] > 0
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    assert not opt._pipeline.worker.alive


# ---------------------------------------------------------------------------------------------------- auto


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory) -> str:
    from zenflow_triton.autotune.__main__ import main as autotune_main

    path = tmp_path_factory.mktemp("profile") / "profile.json"
    assert autotune_main(["--quick", "--output", str(path), "-q"]) == 0
    return str(path)


def test_auto_knobs_plan_after_warmup_and_report(quick_profile, monkeypatch) -> None:
    monkeypatch.setenv("ZENFLOW_TRITON_PROFILE", quick_profile)
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio="auto", update_interval="auto",
                       min_offload_numel=MIN_OFFLOAD, warmup_steps=0)
    assert opt.stats()["update_interval"] is None  # nothing is chosen before the step time is measured
    for i in range(zopt.AUTO_WARMUP_STEPS):
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
        time.sleep(0.002)  # a known share of the step outside step(), like a forward and backward
    assert opt.stats()["selections"] == 0 and opt._knobs.plan is None  # still warming up, synchronously
    _train_steps(opt, model, 3)
    st = opt.stats()
    assert st["selections"] == 1
    r, u = st["topk_ratio"], st["update_interval"]
    assert 0.0 <= r <= 1.0 and isinstance(u, int) and u >= 1
    assert st["select_interval"] % u == 0
    assert st["measured_step_time_s"] >= 0.002
    assert st["predicted_stall_per_window_s"] >= 0.0 and "measured_stall_per_window_s" in st
    assert isinstance(st["auto_reason"], str) and st["auto_reason"]
    sd = opt.state_dict()
    assert sd["zenflow"]["update_interval"] == u and sd["zenflow"]["topk_ratio"] == r
    fresh = ZenFlowAdamW(Net().parameters(), topk_ratio="auto", update_interval="auto", min_offload_numel=MIN_OFFLOAD,
                         warmup_steps=0)
    fresh.load_state_dict(sd)
    assert fresh.stats()["update_interval"] == u and fresh.stats()["topk_ratio"] == r
    fresh.close()
    opt.close()


def test_auto_respects_a_fixed_knob(quick_profile, monkeypatch) -> None:
    monkeypatch.setenv("ZENFLOW_TRITON_PROFILE", quick_profile)
    model = Net()
    opt = ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval="auto", select_interval=12,
                       min_offload_numel=MIN_OFFLOAD, warmup_steps=0)
    _train_steps(opt, model, zopt.AUTO_WARMUP_STEPS + 1)
    st = opt.stats()
    assert st["topk_ratio"] == 0.25 and 12 % st["update_interval"] == 0 and st["select_interval"] == 12
    opt.close()


def test_auto_host_lr_scale_takes_the_quality_tables_measured_gain(quick_profile, monkeypatch, tmp_path) -> None:
    """host_lr_scale="auto": the plan's choice, from the quality table's entry at the fixed (r, U, overlap); until
    the plan (warm-up) the host steps with lr; the checkpoint records the choice."""
    import json

    from zenflow_triton.autotune.quality import default_quality_table

    doc = default_quality_table().to_dict()
    doc["host_lr_scale"] = [{"topk_ratio": 0.25, "update_interval": 2, "overlap": True, "host_lr_scale": 1.5,
                             "ratio": [0.99, 0.98], "stable": True}]
    table = tmp_path / "q.json"
    table.write_text(json.dumps(doc))
    monkeypatch.setenv("ZENFLOW_TRITON_PROFILE", quick_profile)
    monkeypatch.setenv("ZENFLOW_TRITON_QUALITY_TABLE", str(table))
    model = Net()
    with ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=2, host_lr_scale="auto",
                      min_offload_numel=MIN_OFFLOAD, warmup_steps=0) as opt:
        _train_steps(opt, model, zopt.AUTO_WARMUP_STEPS)
        assert opt.stats()["host_lr_scale"] is None  # still "auto" during the warm-up
        _train_steps(opt, model, 2)
        st = opt.stats()
        assert st["host_lr_scale"] == 1.5 and "host_lr_scale=1.5" in st["auto_reason"]
        assert opt.state_dict()["zenflow"]["host_lr_scale"] == 1.5
    model = Net()
    with ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=4, host_lr_scale="auto",
                      min_offload_numel=MIN_OFFLOAD, warmup_steps=0) as opt:  # not measured at U=4: Adam's step
        _train_steps(opt, model, zopt.AUTO_WARMUP_STEPS + 1)
        assert opt.stats()["host_lr_scale"] == 1.0


def test_grad_scaler_unscales_and_skips_inf_steps() -> None:
    """AMP's GradScaler works unchanged: unscale_ reads .grad, and a step with inf gradients is skipped."""

    def run(use_scaler: bool, poison_step: int | None) -> list[torch.Tensor]:
        model = Net()
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                           min_offload_numel=MIN_OFFLOAD, warmup_steps=0)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=use_scaler)
        for i in range(6):
            opt.zero_grad()
            loss = loss_fn(model, i)
            if i == poison_step:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.flush()
        out = [p.detach().clone() for p in model.parameters()]
        steps = opt.stats()["steps"]
        opt.close()
        return out, steps

    plain, steps_plain = run(False, None)
    scaled, steps_scaled = run(True, None)
    for a, b in zip(plain, scaled):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)  # scales are powers of two: unscaling is exact
    _, steps_skipped = run(True, 3)
    assert steps_plain == steps_scaled == 6 and steps_skipped == 5


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_matches_simulation_every_step(backend: str, overlap: bool) -> None:
    """The CUDA pipeline (pinned slabs, copy stream, events, staging merge) against the same oracle."""
    check_against_simulation(backend=backend, overlap=overlap, warmup=2, r=0.25, interval=3, select=6, steps=21,
                             device="cuda")
    check_against_simulation(backend=backend, overlap=overlap, warmup=0, r=0.3, interval=2, select=4, steps=12,
                             dtype=torch.bfloat16, device="cuda")
    check_against_simulation(backend=backend, overlap=overlap, warmup=2, r=0.25, interval=2, select=4, steps=10,
                             device="cuda", grad_dtype="bfloat16")
    # host_lr_scale: the scaled lr reaches the host job on the CUDA path too (sums shipped on the copy stream).
    check_against_simulation(backend=backend, overlap=overlap, warmup=2, r=0.25, interval=3, select=6, steps=14,
                             device="cuda", host_lr_scale=2.5)


@pytest.mark.gpu
def test_cuda_checkpoint_loads_onto_cpu_and_back() -> None:
    model = Net().cuda()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, min_offload_numel=MIN_OFFLOAD,
                       warmup_steps=0)
    _train_steps(opt, model, 5)  # mid-window, with the last window's result pending
    assert opt.stats()["pinned_bytes"] > 0
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True, map_location="cpu")
    for device in ("cpu", "cuda"):
        other = Net().to(device)
        other.load_state_dict(ckpt["model"])
        opt2 = ZenFlowAdamW(other.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                            min_offload_numel=MIN_OFFLOAD, warmup_steps=0)
        opt2.load_state_dict(ckpt["opt"])
        _train_steps(opt2, other, 3)
        opt2.flush()
        assert all(torch.isfinite(p).all() for p in other.parameters())
        opt2.close()
    opt.close()


def test_host_threads_follow_cpu_affinity(monkeypatch) -> None:
    """A process confined to fewer cores than the machine has (containers, batch jobs) never asks numba for more
    threads than it can run: the default worker count and a synchronous window's count follow the affinity."""
    import zenflow_triton.worker as worker

    monkeypatch.setattr(worker.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(worker.os, "cpu_count", lambda: 64)
    seen: list[int] = []
    real = zpipe.run_host_job

    def spy(items, ready, num_threads):
        seen.append(num_threads)
        return real(items, ready, num_threads)

    monkeypatch.setattr(zpipe, "run_host_job", spy)
    w = nn.Parameter(torch.randn(32, 128))
    with ZenFlowAdamW([w], topk_ratio=0.0, update_interval=1, overlap=False, warmup_steps=1) as opt:
        for _ in range(3):
            w.grad = torch.randn(32, 128)
            opt.step()
        assert opt.stats()["cpu_threads"] == 1
    assert seen == [1, 1, 1]


@pytest.mark.parametrize("bound", [False, True])
def test_host_threads_split_between_local_ranks(monkeypatch, bound: bool) -> None:
    """torchrun's LOCAL_WORLD_SIZE ranks on one node share its cores: each defaults to its share (minus one core for
    its training thread) unless the launcher bound it to cores of its own, which its affinity then shows."""
    import numba

    import zenflow_triton.worker as worker

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cores = set(range(4)) if bound else set(range(16))
    monkeypatch.setattr(worker.os, "sched_getaffinity", lambda pid: cores, raising=False)
    monkeypatch.setattr(worker.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 16)
    assert worker.host_thread_share() == 4
    assert worker.host_thread_limit() == (4 if bound else 16)
    with ZenFlowAdamW([nn.Parameter(torch.randn(32, 128))], warmup_steps=0) as opt:
        assert opt.stats()["cpu_threads"] == 3


def test_first_host_kernel_load_is_announced_and_not_stall(monkeypatch, caplog) -> None:
    """The worker loads (on a machine's first run: compiles) the numba host kernels while the device works; a slow
    load is said once, and its time is compile_s, not stall."""
    import logging

    monkeypatch.setattr(zpipe, "_host_kernels_requested", False)
    monkeypatch.setattr(zpipe, "_COMPILE_NOTICE_S", 0.0)  # any load counts as slow here: the cache is warm
    model = Net()
    with caplog.at_level(logging.WARNING, logger="zenflow_triton"):
        with ZenFlowAdamW(model.parameters(), min_offload_numel=MIN_OFFLOAD, update_interval=2, warmup_steps=0) as opt:
            for i in range(6):
                opt.zero_grad()
                loss_fn(model, i).backward()
                opt.step()
            stats = opt.stats()
    notices = [r for r in caplog.records if "compiled the numba host kernels" in r.getMessage()]
    assert len(notices) == 1
    assert stats["compile_s"] > 0
    assert stats["windows"] == 3
