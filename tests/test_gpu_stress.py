"""The CUDA pipeline under stress, for the first device run: [8192, 8192] parameters, no synchronization between steps,
and delays injected where a missing event would let one stream overtake another, checked against the dense
simulation of tests/test_optimizer.py after every step.

Delays (``torch.cuda._sleep``, ~10 ms each): on the copy stream before a window's device-to-host copies (a step that
overwrote ``acc`` without waiting for them would ship the next window's gradients) and before each merge copy (a
merge kernel that did not wait would read a stale buffer; a host job that did not wait would overwrite the snapshot
under the copy); on the compute stream before each merge kernel (a copy that did not wait for the previous merge to
free its buffer would overwrite it under the kernel). Three parameters per dtype, so the merge's ring of two buffers
wraps around within one window end. The training loop never synchronizes: each step's parameters are cloned on the
device and compared afterwards.

Run with ``pytest -m gpu tests/test_gpu_stress.py`` (``bench/gpu_suite.py`` runs it as a phase of its own).
"""

from __future__ import annotations

import gc

import pytest
import torch
from test_optimizer import Simulation
from torch import nn

from zenflow_triton import ZenFlowAdamW

pytestmark = pytest.mark.gpu

HP = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
KNOBS = dict(topk_ratio=0.1, update_interval=2, select_interval=4, warmup_steps=1, overlap_steps=None)
# 7 steps: the warm-up window, two selections (the second migrates columns), three overlapped windows; the last one
# ends at the last step, so flush() only merges its result (no open window to end early).
STEPS = 7
# ~10 ms on an H100/H200 (torch.cuda._sleep spins for this many GPU clock cycles; the clock is ~1.7-2 GHz).
DELAY_CYCLES = 20_000_000


def _gradients(shapes: list[tuple[int, int]], dtype: torch.dtype, steps: int) -> list[list[torch.Tensor]]:
    """Per step, per parameter: random gradients whose column scales change every step, so that the selections move
    and columns migrate both ways. Made on the device up front: the loop itself must not synchronize."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(steps):
        grads = []
        for rows, cols in shapes:
            scale = torch.rand(cols, generator=gen, device="cuda") * 4 + 0.1
            grads.append((torch.randn(rows, cols, generator=gen, device="cuda") * scale * 1e-2).to(dtype))
        out.append(grads)
    return out


@pytest.mark.parametrize(("dtype", "grad_dtype", "shapes"), [
    (torch.bfloat16, "bfloat16", [(8192, 8192), (8192, 4096), (8192, 1024)]),
    (torch.float32, "float32", [(8192, 8192), (8192, 512), (512, 8192)]),
], ids=["bf16-bf16landing", "fp32"])
def test_pipeline_under_stress_matches_simulation(dtype, grad_dtype, shapes):
    torch.manual_seed(0)
    params = [nn.Parameter((torch.randn(rows, cols, device="cuda") * 0.02).to(dtype)) for rows, cols in shapes]
    sims = [Simulation(p.detach().cpu(), r=KNOBS["topk_ratio"], interval=KNOBS["update_interval"],
                       select=KNOBS["select_interval"], warmup=KNOBS["warmup_steps"], overlap=True,
                       grad_dtype=getattr(torch, grad_dtype)) for p in params]
    grads = _gradients(shapes, dtype, STEPS)
    opt = ZenFlowAdamW(params, **HP, **KNOBS, overlap=True, grad_dtype=grad_dtype, backend="triton",
                       min_offload_numel=1, worker_timeout=120.0)
    opt._pipeline.test_delays = {"d2h": DELAY_CYCLES, "h2d": DELAY_CYCLES, "merge": DELAY_CYCLES}
    seen = []
    for step in range(STEPS):
        for p, g in zip(params, grads[step]):
            p.grad = g
        opt.step()
        seen.append([p.detach().clone() for p in params])  # on the device, queued behind the step: no sync
    opt.flush()
    seen.append([p.detach().clone() for p in params])
    st = opt.stats()
    assert st["selections"] == 2 and st["columns_changed_last_selection"] > 0

    # bf16 parameters may land one bf16 ulp apart from the simulation (a master value near a rounding boundary); fp32
    # state differs by rounding only (the same math in another order). As tests/test_optimizer.py.
    atol, rtol = (2e-5, 1e-5) if dtype == torch.float32 else (1e-3, 2**-7)
    for step in range(STEPS + 1):
        for i, (sim, p_seen) in enumerate(zip(sims, seen[step])):
            if step < STEPS:
                g = grads[step][i].cpu()
                sim.step(g, HP["lr"], *HP["betas"], HP["eps"], HP["weight_decay"])
            else:
                sim.flush()
            torch.testing.assert_close(p_seen.cpu(), sim.w, atol=atol, rtol=rtol,
                                       msg=lambda m, s=step, i=i: f"step {s + 1}, parameter {i} {shapes[i]}: {m}")
    opt.close()


def test_close_returns_device_and_pinned_memory():
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    params = [nn.Parameter(torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)) for _ in range(2)]
    model_bytes = torch.cuda.memory_allocated() - base
    opt = ZenFlowAdamW(params, **HP, **KNOBS, grad_dtype="bfloat16", min_offload_numel=1)
    for _ in range(6):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert opt.stats()["pinned_bytes"] > 0
    held = torch.cuda.memory_allocated() - base - model_bytes
    for p in params:
        p.grad = None
    opt.close()
    gc.collect()
    freed = base + model_bytes + held - torch.cuda.memory_allocated()
    # acc (4 B/param), the compact state, scores and slots, the staging ring and the bf16 landing buffer all go.
    assert torch.cuda.memory_allocated() - base - model_bytes < 1 << 20, f"{freed} of {held} bytes freed"
    assert opt.stats()["pinned_bytes"] == 0


def test_worker_jobs_run_on_the_parameters_device():
    seen = []
    params = [nn.Parameter(torch.randn(256, 512, device="cuda"))]
    opt = ZenFlowAdamW(params, **HP, **KNOBS, min_offload_numel=1)
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    opt._pipeline.worker.wait(opt._pipeline.worker.submit(lambda: seen.append(torch.cuda.current_device())), 10)
    assert seen == [params[0].device.index]
    opt.close()
