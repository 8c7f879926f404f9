"""The side-by-side fine-tuning demo: ``python -m zenflow_triton.demo`` (``--help`` for the flags).

AdamW and ZenFlowAdamW fine-tune the same pretrained byte-level transformer on the same batches, and a table compares
their held-out loss, step time and ZenFlow's telemetry. Modules: :mod:`.cli` (flags, the runs, :func:`main`),
:mod:`.report` (the run record, the table and the plot), :mod:`.charlm` (the model and its corpora, also used by the
convergence test and the optimizer benches).
"""

from .cli import main
from .report import RunResult, format_legend, format_table

__all__ = ["main", "RunResult", "format_table", "format_legend"]
