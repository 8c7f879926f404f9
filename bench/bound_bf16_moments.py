"""What bounds the host AdamW with bf16 moments: the kernel beside bare loops of its dense arithmetic with parts of
the rounding stripped, each against the same-traffic ceiling, in interleaved rounds of one process.

    python bench/bound_bf16_moments.py [--numel 16777216] [--rounds 9] [--threads 2]

Rows, all on the same buffers (bf16 gradient in, bf16 snapshot out, nothing selected, the common flags):
``host_adamw_`` the library call (checks, plan, kernel); ``loop`` the kernel's dense-loop arithmetic in a bare
parallel loop over 16K-element chunks, built from the kernel's own helpers; then that loop ``without the NaN
selects``, ``without the hash`` (noise = index ^ key) and ``truncating`` (no rounding at all: the AdamW step with bf16
loads and stores). The last three are not valid kernels: they bound what cheaper rounding could reach. The rows ``in
L2`` do the same number of element updates with no memory traffic: each thread repeats the loop over one L2-resident
row-sized chunk of its own (16K elements). A kernel cannot take less time than its arithmetic alone, so their
``vs ceiling`` is the most any overlap of that arithmetic with the memory traffic could reach. Findings:
bench/results/host-bf16-moments-loops-2026-12-07.md, bench/results/host-bf16-moments-bound-2026-12-07.md.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import numba
import numpy as np
import torch
from common import bench_rounds, bench_shape, bench_threads, make_host_buffers, make_slot
from numba import njit, prange
from numba.extending import register_jitable
from providers import BYTES_PER_PARAM, HOST_HP, HostAdamWProvider, _bf16_moments, ceiling_bf16_moments_, host_adamw_step
from report_host import measure, table

from zenflow_triton.kernels import cpu_adamw
from zenflow_triton.kernels._bf16_moments import _bf16_rne, _lowbias32, _sr_bf16, _step_key, sr_consts
from zenflow_triton.kernels._numba_utils import U16, U32, f32_bits, flat_view, load_grad, scalar_hyperparams

LOOPS = ("loop", "loop without the NaN selects", "loop without the hash", "loop truncating")
IN_L2 = {"loop in L2": "loop", "loop truncating in L2": "loop truncating"}  # row -> the LOOPS row it repeats
_STEP = 5  # the step count the noise and the bias corrections use


def _make_loop(variant: int):
    """A parallel loop over chunks of the kernel's dense arithmetic; ``variant`` indexes LOOPS.

    ``run(p, m, v, g, s, hp, step_size, inv_bc2, size, regions)``: with ``regions`` 0, chunk ``k`` covers elements
    ``[k * size, (k + 1) * size)`` of the arrays; else there are ``len(p) // size`` chunks over the first
    ``regions * size`` elements, the items of each thread's static share on one region (``regions`` = threads).
    """

    @register_jitable(error_model="numpy")
    def chunk(p, m, v, g, s, a, b, hp, ss, inv_bc2, c):
        key = _step_key(_STEP)
        q = U32(a)
        for i in range(a, b):
            x, mm, vv = cpu_adamw._adamw_step(p[i], load_grad(m, i), load_grad(v, i), load_grad(g, i), ss, inv_bc2,
                                              hp)
            p[i] = x
            if variant == 3:
                m[i], v[i], s[i] = np.uint16(f32_bits(mm) >> U16), np.uint16(f32_bits(vv) >> U16), \
                    np.uint16(f32_bits(x) >> U16)
                continue
            noise = _lowbias32(U32(q ^ key), c[0], c[1]) if variant != 2 else U32(q ^ key)
            q = U32(q + U32(1))
            if variant == 1:
                u = f32_bits(x)
                m[i] = np.uint16(U32(f32_bits(mm) + U32(noise & U32(0xFFFF))) >> U16)
                v[i] = np.uint16(U32(f32_bits(vv) + U32(noise >> U16)) >> U16)
                s[i] = np.uint16(U32(U32(U32(u + U32(U32(u >> U16) & c[3])) + c[4]) >> U16))
            else:
                m[i] = np.uint16(_sr_bf16(mm, U32(noise & U32(0xFFFF)), c[2]))
                v[i] = np.uint16(_sr_bf16(vv, U32(noise >> U16), c[2]))
                s[i] = np.uint16(_bf16_rne(x, c))

    @njit(parallel=True, nogil=True, error_model="numpy")
    def run(p, m, v, g, s, hp, ss, inv_bc2, size, regions):
        c = sr_consts(m, hp[-1])
        n = p.shape[0]
        items = (n + size - 1) // size
        for k in prange(items):
            a = k * size if regions == 0 else k * regions // items * size
            chunk(p, m, v, g, s, np.uint64(a), np.uint64(min(n, a + size)), hp, ss, inv_bc2, c)

    return run


def loop_args() -> tuple:
    """The loops' scalar arguments for ``HOST_HP`` at step ``_STEP``: (hp in its common form, step size, 1 / bc2),
    as the kernel computes them."""
    hp = cpu_adamw._common_hyperparams(scalar_hyperparams(1, HOST_HP))
    return (hp, *cpu_adamw._bias(_STEP, float(HOST_HP.lr), float(HOST_HP.beta1), float(HOST_HP.beta2)))


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Print report_host's table for these rows; returns each row's median ratio to the ceiling."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--rounds", type=int, default=bench_rounds())
    ap.add_argument("--threads", type=int, default=bench_threads())
    args = ap.parse_args(argv)
    numba.set_num_threads(args.threads)
    rows, cols = bench_shape(args.numel)
    b = _bf16_moments(make_host_buffers(rows, cols, grad_dtype=torch.bfloat16, snapshot_dtype=torch.bfloat16, seed=5))
    views = [flat_view(t) for t in (b.master, b.exp_avg, b.exp_avg_sq, b.grad, b.snapshot)]
    steps = {"ceiling bf16 moments": lambda: ceiling_bf16_moments_(b.master, b.exp_avg, b.exp_avg_sq, b.grad,
                                                                   b.snapshot),
             "host_adamw_": host_adamw_step(b, make_slot(cols, 0.0), args.threads)}
    loops = dict(zip(LOOPS, map(_make_loop, range(len(LOOPS)))))
    for name, loop in loops.items():
        steps[name] = functools.partial(loop, *views, *loop_args(), 16384, 0)
    for name, loop in IN_L2.items():  # chunks of one row (cols | numel), one region per thread
        steps[name] = functools.partial(loops[loop], *views, *loop_args(), cols, args.threads)
    rows_ = {name: HostAdamWProvider(name, step, rows * cols, BYTES_PER_PARAM["bf16 moments"], 1.0, "bf16 moments")
             for name, step in steps.items()}
    times = measure(rows_, args.rounds)
    print(f"numel {rows * cols}, threads {args.threads}, {args.rounds} interleaved rounds")
    print(table(rows_, times))
    ceiling = statistics.median(times["ceiling bf16 moments"])
    return {name: ceiling / statistics.median(t) for name, t in times.items()}


if __name__ == "__main__":
    main()
