"""Host AdamW on a 64M-parameter matrix, 2 threads, one process: ``host_adamw_`` against torch and the ceiling.

Run: ``python -m pytest bench/bench_host_adamw.py -p no:cacheprovider -o python_files='bench_*.py'``
(smoke, as CI runs it: ``ZENFLOW_BENCH_SMOKE=1 ... --benchmark-disable``).

Providers (bench/providers.py builds them; each test builds only its own buffers): the memory-bandwidth ceiling
(same 28 bytes/param, trivial math), ``torch.optim.AdamW(fused=True)``, the same followed by a separate
fp32 -> bf16 copy of the weights, DeepSpeed's ``DeepSpeedCPUAdam`` (skipped when deepspeed does not import), and
``host_adamw_`` with fp32 grad, or bf16 grad in and bf16 snapshot out, at 0%, 10% and 50% of columns selected.
``extra_info``: ``params/s`` (every parameter of the matrix), ``GB/s`` (bytes the provider must move),
``vs_ceiling`` and ``vs_torch`` (seconds per step of the reference provider / this one, so > 1 is faster; torch
is ``torch fused`` for fp32 and ``torch fused + bf16 copy`` for bf16), from medians of this run: the references
run first. Rounds here are per provider, back to back; bench/report_host.py interleaves them, which is more robust
on a shared machine, and prints the table docs/performance.md quotes.
"""

from __future__ import annotations

import gc

import pytest
from common import SMOKE, bench_numel, bench_rounds, bench_threads
from providers import deepspeed_cpu_adam, host_adamw_providers

# References first: the ratios of the later tests read their medians.
PROVIDERS = [
    "ceiling",
    "torch fused",
    "torch fused + bf16 copy",
    "deepspeed",
    "host_adamw fp32 0%",
    "host_adamw fp32 10%",
    "host_adamw fp32 50%",
    "host_adamw bf16 0%",
    "host_adamw bf16 10%",
    "host_adamw bf16 50%",
]
_MEDIANS: dict[str, float] = {}


@pytest.mark.parametrize("name", PROVIDERS)
def test_host_adamw_providers(benchmark, name: str) -> None:
    if name == "deepspeed" and deepspeed_cpu_adam() is None:
        pytest.skip("deepspeed is not installed (or its CPUAdam op does not build)")
    provider = host_adamw_providers(bench_numel(), threads=bench_threads(), names=(name,))[name]
    benchmark.group = "host adamw"
    benchmark.pedantic(provider.step, rounds=bench_rounds(), warmup_rounds=0 if SMOKE else 1, iterations=1)
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: the step ran once, untimed
        return
    seconds = stats.stats.median
    _MEDIANS[name] = seconds
    info = {
        "numel": provider.numel,
        "updated_fraction": provider.updated_fraction,
        "params/s": provider.numel / seconds,
        "GB/s": provider.numel * provider.bytes_per_param / seconds / 1e9,
    }
    torch_ref = "torch fused" if provider.group == "fp32" else "torch fused + bf16 copy"
    for key, ref in (("vs_ceiling", "ceiling"), ("vs_torch", torch_ref)):
        if ref in _MEDIANS:
            info[key] = _MEDIANS[ref] / seconds
    benchmark.extra_info.update(info)
    del provider
    gc.collect()  # the next provider's gigabytes should not sit next to these


def test_bound_bf16_moments_loop_is_the_kernel() -> None:
    """bench/bound_bf16_moments.py's "loop" row computes what the kernel computes: every output bit of the dense
    kernel with nothing selected (so its stripped copies bound the kernel's own arithmetic)."""
    import bound_bf16_moments as bound
    import torch
    from common import make_host_buffers
    from providers import _bf16_moments

    from zenflow_triton.kernels._numba_utils import flat_view
    from zenflow_triton.kernels.cpu_adamw import host_adamw_

    rows, cols = 5, 4099
    b = _bf16_moments(make_host_buffers(rows, cols, grad_dtype=torch.bfloat16, snapshot_dtype=torch.bfloat16, seed=5))
    loop = [t.clone() for t in (b.master, b.exp_avg, b.exp_avg_sq, b.grad, b.snapshot)]
    host_adamw_(b.master, b.exp_avg, b.exp_avg_sq, b.grad, count=1, slot=torch.full((cols,), -1, dtype=torch.int32),
                col_step=torch.full((cols,), bound._STEP, dtype=torch.int32), hp=bound.HOST_HP, snapshot=b.snapshot)
    bound._make_loop(0)(*[flat_view(t) for t in loop], *bound.loop_args(), 16384, 0)
    for name, ours, kernel in zip(["master", "exp_avg", "exp_avg_sq", "grad", "snapshot"], loop,
                                  (b.master, b.exp_avg, b.exp_avg_sq, b.grad, b.snapshot)):
        assert torch.equal(ours.view(torch.uint8), kernel.view(torch.uint8)), name


def test_bound_bf16_moments_runs() -> None:
    """bench/bound_bf16_moments.py (what bounds the bf16-moment kernel) runs and reports every row against the
    ceiling; its figures are in bench/results, not asserted here."""
    import bound_bf16_moments

    ratios = bound_bf16_moments.main(["--numel", str(bench_numel()), "--rounds", "1", "--threads",
                                      str(bench_threads())])
    assert set(ratios) == {"ceiling bf16 moments", "host_adamw_", *bound_bf16_moments.LOOPS,
                           *bound_bf16_moments.IN_L2}
    assert ratios["ceiling bf16 moments"] == 1.0 and all(r > 0 for r in ratios.values())


def test_report_host_same_round_ratio() -> None:
    """report_host's ``vs ceiling, same round`` is the median of the per-round ratios, not the ratio of medians: a
    row that tracks the ceiling round for round reads 1.0 even when the machine's speed moves between rounds."""
    from providers import HostAdamWProvider
    from report_host import same_round, table

    ceiling, row = [2.0, 4.0, 6.0], [1.0, 8.0, 3.0]
    assert same_round(ceiling, row) == 2.0  # per round 2, 0.5, 2; the ratio of medians is 4 / 3
    providers = {name: HostAdamWProvider(name, lambda: None, 1000, 28, 1.0, "fp32") for name in ("ceiling", "x")}
    lines = table(providers, {"ceiling": ceiling, "x": row}).splitlines()
    assert "vs ceiling, same round" in lines[0]
    assert lines[-1].split("|")[7:9] == [" 1.333 ", " 2.000 "]
