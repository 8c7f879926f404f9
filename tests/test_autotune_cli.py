"""``python -m zenflow_triton.autotune``: flags, exit codes, outputs. Measuring runs use tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from autotune_profiles import synthetic_profile

from zenflow_triton.autotune import __main__ as cli
from zenflow_triton.autotune.cache import ENV_VAR, SCHEMA, SCHEMA_VERSION, load_profile, save_profile

# Small enough that a measuring run takes a fraction of a second once the numba kernel is compiled.
TINY = ["--quick", "--adamw-numel", "16384", "--max-copy-bytes", "262144", "--quiet"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Never touch the real user cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(ENV_VAR, raising=False)


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv",
    [
        ["--bogus"],
        ["--params", "1e9"],  # needs --step-time
        ["--step-time", "0.5"],  # needs --params
        ["--params", "-5", "--step-time", "1"],
        ["--params", "abc", "--step-time", "1"],
        ["--params", "1e9", "--step-time", "0"],
        ["--target-stall", "2"],
        ["--grad-dtype", "float16"],
        ["--output", "x.json", "--no-save"],
        ["--load", "--quick"],
    ],
)
def test_bad_flags_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_quick_json_output_writes_a_versioned_profile(tmp_path, capsys):
    path = tmp_path / "out" / "profile.json"
    code, out, err = run([*TINY, "--json", "--output", str(path), "--params", "50M", "--step-time", "0.2"], capsys)
    assert code == cli.EXIT_OK, err
    doc = json.loads(out)
    assert doc["profile_path"] == str(path)
    assert doc["profile"]["cpu_adamw"]["rates"]["float32"]
    (plan,) = doc["plans"]
    assert plan["params"] == pytest.approx(50e6, rel=1e-3) and plan["update_interval"] >= 1
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["schema_version"] == SCHEMA_VERSION
    assert data["plan"]["topk_ratio"] == plan["topk_ratio"]  # the recommendation travels with the profile
    prof = load_profile(path)
    if prof.gpu is None:
        assert doc["profile"]["gpu"] is None and "CUDA" in doc["profile"]["gpu_unavailable"]
    # Reuse it for a table from the saved profile, without measuring.
    code, out, err = run(["--load", str(path), "--params", "1e8", "--step-time", "1"], capsys)
    assert code == cli.EXIT_OK, err
    assert "would choose" in out and "why:" in out


def test_progress_goes_to_stderr_and_the_table_to_stdout(tmp_path, capsys):
    argv = [a for a in TINY if a != "--quiet"]
    code, out, err = run([*argv, "--no-save"], capsys)
    assert code == cli.EXIT_OK
    assert "host AdamW" in err and "measuring" in err
    assert out.startswith("zenflow_triton machine profile (quick")
    assert "example models" in out
    assert "profile written" not in out


def test_env_var_names_the_profile_for_writing_and_loading(tmp_path, monkeypatch, capsys):
    target = tmp_path / "env" / "zf.json"
    monkeypatch.setenv(ENV_VAR, str(target))
    code, _, err = run(TINY, capsys)
    assert code == cli.EXIT_OK, err
    assert target.exists()
    assert not (tmp_path / "xdg").exists()  # the cache folder is not used when the env var is set
    code, out, err = run(["--load", "--json"], capsys)
    assert code == cli.EXIT_OK, err
    assert json.loads(out)["profile"]["machine_key"] == load_profile(target).machine_key


def test_default_output_is_the_per_user_cache(tmp_path, capsys):
    code, _, err = run(TINY, capsys)
    assert code == cli.EXIT_OK, err
    files = list((tmp_path / "xdg" / "zenflow_triton").glob("profile-*.json"))
    assert len(files) == 1


def test_load_without_a_profile_exits_4(tmp_path, capsys):
    code, _, err = run(["--load", str(tmp_path / "absent.json")], capsys)
    assert code == cli.EXIT_NO_PROFILE
    assert "cannot read profile" in err


def test_planning_for_cuda_without_gpu_figures_exits_4(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert run([*TINY, "--output", str(path)], capsys)[0] == cli.EXIT_OK
    if load_profile(path).gpu is not None:
        pytest.skip("this machine has a GPU")
    code, _, err = run(["--load", str(path), "--device", "cuda"], capsys)
    assert code == cli.EXIT_NO_PROFILE
    assert "no GPU figures" in err


def test_unwritable_output_exits_5(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run([*TINY, "--output", str(blocker / "p.json")], capsys)
    assert code == cli.EXIT_WRITE_FAILED
    assert "cannot write the profile" in err


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "stall.png"
    code, _, err = run([*TINY, "--no-save", "--plot", str(png), "--params", "1e8", "--step-time", "0.5"], capsys)
    assert code == cli.EXIT_OK, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_exits_6_before_measuring(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    monkeypatch.setattr(cli, "probe_machine", lambda *a, **k: pytest.fail("measured before checking"))
    code, _, err = run([*TINY, "--plot", str(tmp_path / "x.png")], capsys)
    assert code == cli.EXIT_MISSING_DEPENDENCY
    assert "pip install" in err


def test_measurement_failure_exits_3(monkeypatch, capsys):
    def broken(*a, **k):
        raise RuntimeError("no memory")

    monkeypatch.setattr(cli, "probe_machine", broken)
    code, _, err = run(TINY, capsys)
    assert code == cli.EXIT_PROBE_FAILED
    assert "measurement failed: no memory" in err


def test_module_runs_as_a_script():
    proc = subprocess.run([sys.executable, "-m", "zenflow_triton.autotune", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    assert "--quick" in proc.stdout and "Exit codes" in proc.stdout


def test_plans_use_the_configs_select_windows(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "DEFAULT_SELECT_WINDOWS", 3)  # as if the optimizer's config said 3
    path = save_profile(synthetic_profile(), tmp_path / "p.json")
    code, out, err = run(["--load", str(path), "--json", "--params", "1e8", "--step-time", "0.5"], capsys)
    assert code == cli.EXIT_OK, err
    (plan,) = json.loads(out)["plans"]
    assert plan["prediction"]["select_interval"] == 3 * plan["update_interval"]
