"""Training quality with bf16 host moments (state_dtype="bfloat16") against fp32 ones, each at its best lr, on
bench/quality_fair.py's three tasks (its models, data, batches and summary; ZenFlowAdamW defaults, overlap on).

    nice -n 5 python bench/quality_state_dtype.py --out bench/results/quality-state-dtype-2026-12-03

Arguments are quality_fair.py's ("--out", "--seeds", "--lrs", "--long-steps", ...; its default grid: 3 seeds, 1000
long steps; a few minutes on one core). Its
Markdown's command line names quality_fair.py: the arguments are the same.
The two ZenFlow configurations differ only in ``state_dtype``; each is judged against AdamW's best, as there.
"""

from __future__ import annotations

import sys

import quality_fair as qf

from zenflow_triton import ZenFlowAdamW

CONFIGS = {"fp32 moments": "float32", "bf16 moments": "bfloat16"}
_dtype = ["float32"]


class _StateDtypeAdamW(ZenFlowAdamW):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, state_dtype=_dtype[0], **kwargs)


def _run(task, config, **kwargs):
    _dtype[0] = CONFIGS.get(config.name, "float32")
    return _original_run(task, config, **kwargs)


_original_run = qf._run
qf._run = _run
qf.ZenFlowAdamW = _StateDtypeAdamW
qf.configs = lambda *a, **k: [qf.Config("AdamW")] + [qf.Config(name, overlap=True) for name in CONFIGS]

if __name__ == "__main__":
    sys.exit(qf.main(sys.argv[1:]))
