"""The Triton kernels compile for a GPU (sm_90: H100/H200) on this CPU-only machine.

The interpreter that runs the kernels in the other tests accepts code the GPU compiler rejects (Python control flow
on runtime values, dtype mixes, non-constexpr shapes) and never specializes integer arguments; a compile error found
here costs seconds, one found on a lent GPU costs minutes of its budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("triton_sm90_compile.py")


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
    if proc.returncode == 3:
        pytest.skip(f"this triton's internal compile API differs from the one the script uses: {last[:500]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(last)
    assert report["errors"] == [], json.dumps(report["errors"], indent=1)
    kernels = {c["kernel"] for c in report["compiled"]}
    assert kernels == {"fused_step", "column_sumsq", "add_partials", "merge", "fused_steps", "add_partials_grouped"}
    # 3 dtypes x (2 fused + colnorm + merge + grouped) + add_partials + the Adam-L2 multi-split fused variant + the
    # grouped launch with 1 and 16 calls (Triton specializes the count) + the grouped add-partials for 2 and 1 calls
    assert len(report["compiled"]) >= 21
    assert all(c["cubin_bytes"] > 0 for c in report["compiled"]), "ptxas produced no cubin"
