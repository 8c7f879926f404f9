"""``launch_overhead.py`` run once in the bench smoke job, so the script and its stand-ins never rot.

In a subprocess: the script replaces the Triton kernels module-wide and compiles them (no interpreter), so a kernel
it forgot to stub would try a real launch, which fails on a machine without a GPU, and fail this test.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

from common import BENCH_DIR


def test_launch_overhead_runs_with_every_kernel_stubbed() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(BENCH_DIR / "launch_overhead.py"), "--params", "3", "--rounds", "2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^\| (.+) \| ([^|]+) \|$", out.stdout, flags=re.M)
    values = {name: float(us) for name, us in rows[1:]}  # after the header (the separator has no spaces)
    assert len(values) == 7 and all(math.isfinite(us) and us > 0 for us in values.values()), out.stdout
    assert any("one fused_steps_ for all" in name for name in values), out.stdout
