"""Resume in a new process is bit for bit (issue 30 item 4): a small transformer with a LambdaLR schedule and
``grads_in_backward=True`` saves mid-window and goes on; a fresh process loads that checkpoint and trains the same
steps; the weights must be equal, with torch on one thread (as people pin it beside a host worker) and on its
default, with and without ``max_grad_norm``. numba's pool, started lazily at the first parallel launch, used to set
torch's thread count from 1 to the pool's size at a step that depended on where the process started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASE = Path(__file__).with_name("resume_process_case.py")
ROOT = CASE.parent.parent


def _run(threads: int, clip: float, mode: str, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(CASE), str(threads), str(clip), mode, str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["no-clip", "max_grad_norm"])
@pytest.mark.parametrize("threads", [1, 0], ids=["one-thread", "default-threads"])
def test_resume_in_a_new_process_is_bit_for_bit(tmp_path, threads: int, clip: float) -> None:
    _run(threads, clip, "straight", tmp_path / "straight.pt")
    _run(threads, clip, "resume", tmp_path / "resume.pt")
    straight = torch.load(tmp_path / "straight.pt")
    resumed = torch.load(tmp_path / "resume.pt")
    for i, (a, b) in enumerate(zip(straight, resumed, strict=True)):
        assert torch.equal(a, b), f"parameter {i}: max |diff| {(a - b).abs().max().item():.3g}"
