"""The demo CLI (python -m zenflow_triton.demo): flags checked before any training, progress, the table and legend.

The runs call ``main(argv)`` in-process; one subprocess run checks the ``-m`` entry point. The flag tests replace
the training functions with ones that fail the test, so a flag that is not rejected up front shows as a training
call, not as a slow pass. Measured on the 2-core CI CPU: about 14 s of CPU time for the whole file (the subprocess,
about 3 s of importing torch), 30 s of wall time with other jobs loading both cores.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zenflow_triton.demo import RunResult, charlm, format_legend, format_table, main
from zenflow_triton.demo.cli import BACKENDS, build_parser


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any pretraining or fine-tuning fails the test: what these tests run must stop at the flags."""

    def trained(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started: the flags should have been rejected first")

    for name in ("pretrained_state", "pretrain", "train", "load_corpora"):
        monkeypatch.setattr(charlm, name, trained)


def _zen_stats() -> dict[str, float]:
    return dict(
        stall_s=0.0,
        host_job_s=0.1,
        selected_fraction=0.1,
        selected_energy_fraction=0.3,
        host_bytes_per_param=16.0,
        d2h_bytes=5e6,
    )


def test_quick_run_prints_table(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # An empty pretraining cache: this run pretrains, whatever ran before it in the process, so its progress shows.
    monkeypatch.setattr(charlm, "_pretrained", {})
    # 16 fine-tuning steps (4 ZenFlow windows) are enough to fill every column, and 40 pretraining steps enough for
    # a plausible loss; --quick's other settings stay.
    assert main(["--quick", "--device", "cpu", "--pretrain-steps", "40", "--steps", "16"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()

    header = next(line for line in lines if line.startswith("optimizer"))
    for column in ("held-out loss", "loss / AdamW loss", "ms/step", "stall s", "selected cols", "selected energy"):
        assert column in header, header
    assert "vs AdamW" not in header  # read like a speed ratio
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
    # --quick's short warm-up (8 steps) leaves room for selection: columns were selected, and hold more than their
    # share of the gradient's energy.
    assert 0.0 < float(zen.split()[6]) < float(zen.split()[7]), zen
    # The ratio column is ZenFlow's held-out loss over AdamW's.
    assert float(zen.split()[2]) == pytest.approx(float(zen.split()[1]) / float(adamw.split()[1]), abs=1e-3)

    # The legend under the table says what the columns are, and that the warm-up was not timed.
    legend = out[out.index(zen) + len(zen) :]
    for text in ("loss / AdamW loss:", "not a speed ratio", "selected cols:", "selected energy:", "untimed warm-up"):
        assert text in legend, legend

    # Progress went to stderr, not into the table: pretraining (about 10 lines), each warm-up, each fine-tuning.
    pretrain_lines = [line for line in err.splitlines() if line.strip().startswith("pretraining  step")]
    assert len(pretrain_lines) == 10, err
    assert "40/40" in pretrain_lines[-1] and "loss" in pretrain_lines[-1] and pretrain_lines[-1].endswith(" s")
    assert "ZenFlowAdamW untimed warm-up" in err and "AdamW        untimed warm-up" in err
    assert "ZenFlowAdamW step" in err
    assert not any("/16  loss" in line for line in lines), out


def test_plot_written(tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = os.path.join(tmp_path, "curves.png")
    # A short pretraining of its own: the plot does not need a good starting point.
    assert main(["--quick", "--device", "cpu", "--pretrain-steps", "20", "--steps", "12", "--plot", path]) == 0
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert path in capsys.readouterr().out


def test_pretraining_reports_progress_and_caches() -> None:
    cfg = charlm.CharLMConfig(d_model=16, n_layer=1, n_head=2, seq_len=16)
    calls: list[tuple[int, float, float]] = []
    assert not charlm.is_pretrained(cfg, steps=5, seed=3)
    first = charlm.pretrained_state(cfg, steps=5, seed=3, on_step=lambda *a: calls.append(a))
    assert [c[0] for c in calls] == [1, 2, 3, 4, 5]
    assert all(0.0 < loss < 10.0 and seconds >= 0.0 for _, loss, seconds in calls)
    # From the cache: the same weights, and no steps to report.
    assert charlm.is_pretrained(cfg, steps=5, seed=3)
    again = charlm.pretrained_state(cfg, steps=5, seed=3, on_step=lambda *a: calls.append(a))
    assert len(calls) == 5
    assert all((first[k] == again[k]).all() for k in first)


def test_help_shows_every_default_and_choice() -> None:
    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest == "help":
            continue
        help_text = formatter._get_help_string(action) or ""
        assert "default" in help_text, (action.option_strings, help_text)
    text = parser.format_help()
    assert "{" + ",".join(BACKENDS) + "}" in text
    for shown in ("(default: 200, or 40 with --quick)", "(default: 800, or 150 with --quick)", "(default: 0.1)",
                  "(default: ZenFlowAdamW's, 100, or 8 with --quick)"):
        assert shown in " ".join(text.split()), text


def test_module_entry_point() -> None:
    # --help exits before any training: this checks `python -m zenflow_triton.demo` itself, cheaply.
    proc = subprocess.run(
        [sys.executable, "-m", "zenflow_triton.demo", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "--update-interval" in proc.stdout
    assert "(default: 4)" in proc.stdout and "{auto,triton,numba,torch}" in proc.stdout


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--steps", "0"], "--steps"),
        (["--steps", "-3"], "--steps"),
        (["--steps", "ten"], "--steps"),
        (["--pretrain-steps", "0"], "--pretrain-steps"),
        (["--batch", "0"], "--batch"),
        (["--update-interval", "0"], "--update-interval"),
        (["--topk-ratio", "1.5"], "--topk-ratio"),
        (["--topk-ratio", "-0.1"], "--topk-ratio"),
        (["--topk-ratio", "nan"], "--topk-ratio"),
        (["--lr", "0"], "--lr"),
        (["--lr", "-1e-3"], "--lr"),
        (["--lr", "inf"], "--lr"),
        (["--seed", "-1"], "--seed"),
        (["--backend", "cuda"], "--backend"),
        (["--device", "tpu"], "--device"),
        (["--device", "cpu:x"], "--device"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_flag_is_a_usage_error_before_training(
    argv: list[str], flag: str, no_training: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and flag in err, err


def test_cuda_device_without_cuda_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, no_training: None, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cuda"])
    assert exc.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_triton_on_cpu_is_rejected_before_training(
    monkeypatch: pytest.MonkeyPatch, no_training: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without the interpreter, Triton cannot launch on CPU tensors: say so now, not after pretraining and AdamW.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--backend", "triton", "--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--backend" in err and "TRITON_INTERPRET=1" in err, err


def test_table_headers_and_legend_explain_the_columns() -> None:
    results = [
        RunResult("AdamW", 3.0, [3.1], [0.01] * 40, None, 8, warmup_run_steps=9, warmup_run_s=0.1),
        RunResult("ZenFlowAdamW", 3.15, [3.2], [0.01] * 40, _zen_stats(), 8, warmup_run_steps=9, warmup_run_s=16.5),
    ]
    header = format_table(results).splitlines()[0]
    assert "loss / AdamW loss" in header and "selected cols" in header and "selected energy" in header
    legend = format_legend(results)
    # One legend entry per column that needs one, each starting its line.
    starts = [line.split(":")[0] for line in legend.splitlines() if not line.startswith(" ")]
    for column in ("held-out loss", "loss / AdamW loss", "ms/step", "stall s", "selected cols", "selected energy"):
        assert column in starts, legend
    # The first-run compilation is reported apart from the step times: 16.5 s of warm-up, 9 steps of 10 ms.
    assert "ZenFlowAdamW 16.5 s" in legend and "one-time set-up: ZenFlowAdamW 16.4 s" in legend, legend
    assert "AdamW 0.0 s" not in legend  # AdamW had no one-time cost worth a mention
