"""The demo CLI (python -m zenflow_triton.demo) runs end to end and prints its comparison table.

The runs call ``main(argv)`` in-process: that shares the pretrained weights cached by zenflow_triton.demo.charlm between
the tests (about 4 s of pretraining once instead of per test); one subprocess run checks the ``-m`` entry point.
Measured on the 2-core CI CPU: about 13 s for the whole file at light load (the --quick pretraining once, a few
seconds; the subprocess, about 3 s of importing torch), 26 s with other jobs loading both cores.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zenflow_triton.demo import main


def test_quick_run_prints_table(capsys: pytest.CaptureFixture[str]) -> None:
    # 16 fine-tuning steps (4 ZenFlow windows) are enough to fill every column; --quick's other settings stay.
    assert main(["--quick", "--device", "cpu", "--steps", "16"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()

    header = next(line for line in lines if line.startswith("optimizer"))
    for column in ("final loss", "ms/step", "stall s", "selected", "host B/param"):
        assert column in header, header
    adamw = next(line for line in lines if line.startswith("AdamW "))
    zen = next(line for line in lines if line.startswith("ZenFlowAdamW "))
    # AdamW has no offloading, so its ZenFlow-only columns are "-"; ZenFlow's are all numbers.
    assert adamw.split()[-1] == "-", adamw
    zen_cells = zen.split()[1:]
    assert len(zen_cells) == len(adamw.split()[1:])
    for cell in zen_cells:
        float(cell)  # raises if a ZenFlow column is missing or not a number
    # Both finished with a finite, plausible loss (nats per byte: 256-way, so below ln 256 = 5.55).
    for row in (adamw, zen):
        assert 0.0 < float(row.split()[1]) < 5.55, row

    # Progress went to stderr, not into the table.
    assert "ZenFlowAdamW step" in err
    assert not any(" step " in line for line in lines), out


def test_plot_written(tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = os.path.join(tmp_path, "curves.png")
    assert main(["--quick", "--device", "cpu", "--steps", "12", "--plot", path]) == 0
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert path in capsys.readouterr().out


def test_bad_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--topk-ratio", "1.5"])
    assert exc.value.code == 2
    assert "--topk-ratio" in capsys.readouterr().err


def test_module_entry_point() -> None:
    # --help exits before any training: this checks `python -m zenflow_triton.demo` itself, cheaply.
    proc = subprocess.run(
        [sys.executable, "-m", "zenflow_triton.demo", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "--update-interval" in proc.stdout
