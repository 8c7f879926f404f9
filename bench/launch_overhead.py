"""Host-side cost per parameter of issuing one step's fused kernels: ``fused_step_`` once per parameter (how the
optimizer launches today) against one ``fused_steps_`` call for all of them. Runs on any machine, no GPU needed.

The Triton kernels are replaced by stand-ins that return at once (as ``tests/triton_sm90_compile.py`` does), so what
is timed is the Python the launchers run: argument checks, the split plan, the scalars, and for ``fused_steps_`` the
``FusedStepArgs`` records and the call table. Not included: Triton's own launch (its C launcher, paid once per kernel
launched: per parameter before, once per dtype after) and, on a GPU, the table's pinned copy (once per launch). The
numba and torch backends' per-parameter cost on tiny CPU tensors is given next to it: there, every call is a call.

    python bench/launch_overhead.py [--params 200] [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# The real (compiling) Triton kernel objects, never run: the stand-ins below replace them.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from zenflow_triton.kernels import AdamHyperparams, _triton_utils, fused_step, numba_device_ops, reference  # noqa: E402
from zenflow_triton.kernels.device_ops import FusedStepArgs  # noqa: E402


class _NoLaunch:
    """``kernel[grid](*args, **kwargs)`` that does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stub_triton() -> None:
    fused_step._fused_step_kernel = _NoLaunch()
    fused_step._fused_steps_kernel = _NoLaunch()
    _triton_utils._add_partials_kernel = _NoLaunch()
    _triton_utils._finish_steps_grouped_kernel = _NoLaunch()
    _triton_utils._finish_steps_kernel = _NoLaunch()
    fused_step.check_launch_device = lambda *a, **k: None


def _tensors(rows: int, cols: int, k: int) -> dict[str, torch.Tensor]:
    slot = torch.full((cols,), -1, dtype=torch.int32)
    slot[:k] = torch.arange(k, dtype=torch.int32)
    z = torch.zeros
    return dict(param=z(rows, cols, dtype=torch.bfloat16), grad=z(rows, cols, dtype=torch.bfloat16), score=z(cols),
                slot=slot, col_step=torch.ones(cols, dtype=torch.int32), master=z(rows, k), exp_avg=z(rows, k),
                exp_avg_sq=z(rows, k), acc=z(rows, cols))


def _median_us_per_param(fn, n: int, rounds: int) -> float:
    """Median CPU time of this thread per parameter: unlike wall time, it does not count time the thread waited for
    a core, so other load on a shared machine changes it little."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.thread_time()
        fn()
        times.append((time.thread_time() - t0) / n * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=200, help="offloaded parameters per step (default 200)")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    _stub_triton()
    hp = AdamHyperparams(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    # Tiny matrices: the shapes change nothing of the Python cost (the plan is cached per shape in fused_steps_).
    params = [_tensors(64, 256, 26) for _ in range(args.params)]

    def per_param(ops) -> None:
        for t in params:
            ops.fused_step_(t["param"], t["grad"], score=t["score"], slot=t["slot"], col_step=t["col_step"],
                            master=t["master"], exp_avg=t["exp_avg"], exp_avg_sq=t["exp_avg_sq"], acc=t["acc"],
                            hp=hp, accumulate=True)

    def grouped() -> None:
        fused_step.fused_steps_([FusedStepArgs(**t, hp=hp, accumulate=True) for t in params])

    prebuilt = [FusedStepArgs(**t, hp=hp, accumulate=True) for t in params]

    def check_only() -> None:  # the per-call check (and address reads) fused_steps_ runs before it builds the table
        device = prebuilt[0].param.device
        for c in prebuilt:
            fused_step._quick_check(c, device)

    def uncached() -> None:
        # fused_step_ computing its split plan and float scalars on every call, as it did before both were cached.
        cached = fused_step._plan, fused_step._scalars
        fused_step._plan = lambda r, c, br, bc: _triton_utils.plan_row_splits(r, c, block_r=br, block_c=bc)
        fused_step._scalars = fused_step._scalars.__wrapped__
        try:
            per_param(fused_step)
        finally:
            fused_step._plan, fused_step._scalars = cached

    n, r = args.params, args.rounds
    rows = [
        ("triton launcher, fused_step_ per parameter, plan and scalars uncached (kernel stubbed)",
         _median_us_per_param(uncached, n, r)),
        ("triton launcher, fused_step_ per parameter (kernel stubbed)", _median_us_per_param(
            lambda: per_param(fused_step), n, r)),
        ("triton launcher, one fused_steps_ for all (kernel stubbed)", _median_us_per_param(grouped, n, r)),
        ("... the same with the calls built once (what bench_device_kernels' enqueue_us_per_param times)",
         _median_us_per_param(lambda: fused_step.fused_steps_(prebuilt), n, r)),
        ("... of which its per-call check and address reads (_quick_check)", _median_us_per_param(check_only, n, r)),
        ("numba backend, fused_step_ per parameter (64 x 256, runs)", _median_us_per_param(
            lambda: per_param(numba_device_ops), n, r)),
        ("torch backend, fused_step_ per parameter (64 x 256, runs)", _median_us_per_param(
            lambda: per_param(reference), n, max(3, r // 4))),
    ]
    print(f"| host CPU µs per parameter ({n} parameters, median of {r} rounds) | µs |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
