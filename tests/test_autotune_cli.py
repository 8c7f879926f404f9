"""``python -m zenflow_triton.autotune``: flags, exit codes, outputs. Measuring runs use tiny sizes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from autotune_profiles import BAD_PROFILES, synthetic_profile

from zenflow_triton.auto import Knobs
from zenflow_triton.autotune import __main__ as cli
from zenflow_triton.autotune.bridge import QUALITY_ENV_VAR
from zenflow_triton.autotune.cache import (
    ENV_VAR,
    SCHEMA,
    SCHEMA_VERSION,
    load_profile,
    profile_to_json,
    save_profile,
)
from zenflow_triton.autotune.model import format_count, format_seconds
from zenflow_triton.autotune.profile import BandwidthCurve, HostAddRates
from zenflow_triton.autotune.quality import default_quality_table
from zenflow_triton.config import ZenFlowConfig

# Small enough that a measuring run takes a fraction of a second once the numba kernel is compiled.
TINY = ["--quick", "--adamw-numel", "16384", "--max-copy-bytes", "262144", "--quiet"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Never touch the real user cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(QUALITY_ENV_VAR, raising=False)


@pytest.fixture
def saved_profile(tmp_path):
    return save_profile(synthetic_profile(), tmp_path / "synthetic.json")


def stats(windows: int = 0, stall_s: float = 0.0) -> SimpleNamespace:
    """What Knobs.report reads of the optimizer's counters (zenflow_triton.telemetry.Stats)."""
    return SimpleNamespace(windows=windows, stall_s=stall_s, windows_at_plan=0, stall_at_plan=0.0)


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv",
    [
        ["--bogus"],
        ["--step-time", "0.5"],  # needs --params
        ["--max-params", "--params", "7B"],  # every size already
        ["--params", "-5", "--step-time", "1"],
        ["--params", "abc", "--step-time", "1"],
        ["--params", "1e9", "--step-time", "0"],
        ["--target-stall", "2"],
        ["--grad-dtype", "float16"],
        ["--output", "x.json", "--no-save"],
        ["--load", "--quick"],
        ["--max-loss-ratio", "0.9"],  # below AdamW's own loss
        ["--max-update-interval", "0"],
        ["--min-topk-ratio", "2"],
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


def test_a_profile_measured_for_cuda_only_plans_cuda_and_refuses_cpu(tmp_path, capsys):
    """A profile without the CPU-tensor device step (the optimizer's quick probe for CUDA parameters skips it):
    the CLI renders and plans it for CUDA, and refuses a plan for CPU tensors with exit status 4, saying why."""
    path = save_profile(dataclasses.replace(synthetic_profile(gpu=True), cpu_device=None), tmp_path / "p.json")
    code, out, err = run(["--load", str(path), "--device", "cuda", "--params", "1e8", "--step-time", "1",
                          "--show-profile"], capsys)
    assert code == cli.EXIT_OK, err
    assert "device step on CPU tensors: not measured" in out and "would choose" in out
    code, _, err = run(["--load", str(path), "--device", "cpu", "--params", "1e8", "--step-time", "1"], capsys)
    assert code == cli.EXIT_NO_PROFILE
    assert "no device-step rates for CPU tensors" in err


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


def test_help_answers_without_importing_torch():
    # --help took 8.5 s on the 2-core VM, all of it importing torch; the parser needs none of it.
    script = ("import runpy, sys\n"
              "sys.argv = ['zenflow_triton.autotune', '--help']\n"
              "try:\n"
              "    runpy.run_module('zenflow_triton.autotune', run_name='__main__', alter_sys=True)\n"
              "except SystemExit as exc:\n"
              "    assert exc.code == 0, exc.code\n"
              "heavy = sorted(m for m in ('torch', 'numpy', 'numba', 'triton') if m in sys.modules)\n"
              "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "ZENFLOW_TRITON_PROFILE" in proc.stdout


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


def table_row(out: str) -> str:
    """The first plan row of the "would choose" table, whitespace collapsed."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "loss ratio" in line and "pred step" in line)
    return " ".join(lines[header + 1].split())


def expected_row(plan: dict) -> str:
    return " ".join([format_count(plan["params"]), format_seconds(plan["step_time_s"]), f"{plan['topk_ratio']:.3g}",
                     str(plan["update_interval"]), str(plan["cpu_threads"]), f"{plan['predicted_loss_ratio']:.3f}",
                     format_seconds(plan["predicted_time_per_step_s"]),
                     format_seconds(plan["predicted_stall_per_window_s"]),
                     f"{plan['predicted_stall_fraction']:.1%}"])


@pytest.mark.parametrize(("given", "count"), [("421k", 421_000), ("10M", 10_000_000), ("125M", 125_000_000),
                                              ("7B", 7_000_000_000)])
def test_the_parameter_count_prints_as_given_and_the_table_matches_the_json(saved_profile, capsys, given, count):
    argv = ["--load", str(saved_profile), "--params", given, "--step-time", "0.5"]
    code, out, err = run([*argv, "--json"], capsys)
    assert code == cli.EXIT_OK, err
    (plan,) = json.loads(out)["plans"]
    assert plan["params"] == count
    assert plan["predicted_loss_ratio"] <= plan["max_loss_ratio"] == 1.05 and plan["loss_budget_met"]
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_OK, err
    assert table_row(out).startswith(expected_row(plan))
    assert table_row(out).startswith(given + " ")
    why = out.split("  why:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.strip() for line in why] == plan["reason"].splitlines()
    assert f"budget {plan['max_loss_ratio']:g}" in why[0]


def test_json_table_and_stats_tell_one_story(saved_profile, capsys):
    argv = ["--load", str(saved_profile), "--params", "50M", "--step-time", "0.2", "--max-loss-ratio", "1.03"]
    code, out, err = run([*argv, "--json"], capsys)
    assert code == cli.EXIT_OK, err
    (from_json,) = json.loads(out)["plans"]
    # stats() gets the same plan's fields through Knobs.report, under the same names.
    _, plan = cli._plans(load_profile(saved_profile), cli.build_parser().parse_args(argv),
                         default_quality_table().for_regime("worst"))[0]
    knobs = Knobs(ZenFlowConfig(topk_ratio="auto", update_interval="auto"))
    knobs.plan = plan
    reported = knobs.report(stats(windows=10, stall_s=0.5))
    assert reported["auto_reason"] == from_json["reason"]
    shared = set(reported) - {"auto_reason", "measured_stall_per_window_s", "measured_step_time_s"}
    assert {"predicted_loss_ratio", "max_loss_ratio", "predicted_stall_per_window_s", "predicted_wait_per_window_s",
            "predicted_copy_per_window_s", "predicted_time_per_step_s", "hides_host_work"} <= shared
    assert {k: reported[k] for k in shared} == {k: from_json[k] for k in shared}
    assert from_json["max_loss_ratio"] == 1.03 and from_json["predicted_loss_ratio"] <= 1.03
    # The stall is the wait plus the copies, in every output.
    assert from_json["predicted_stall_per_window_s"] == pytest.approx(
        from_json["predicted_wait_per_window_s"] + from_json["predicted_copy_per_window_s"])
    assert from_json["predicted_stall_per_window_s"] == pytest.approx(from_json["prediction"]["stall_s"])


def test_stall_the_budget_cannot_hide_is_flagged_in_the_table(saved_profile, capsys):
    # A huge model behind short steps on the synthetic 4-core machine: the host job cannot hide.
    argv = ["--load", str(saved_profile), "--params", "2B", "--step-time", "0.01", "--device", "cpu"]
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_OK, err
    assert "host work not hidden" in table_row(out)
    code, out, _ = run([*argv, "--json"], capsys)
    (plan,) = json.loads(out)["plans"]
    assert not plan["hides_host_work"] and plan["loss_budget_met"]
    assert f"expect {plan['predicted_stall_fraction']:.0%} stall" in plan["reason"]


def test_bounds_reach_the_choice(saved_profile, capsys):
    argv = ["--load", str(saved_profile), "--params", "50M", "--step-time", "0.2", "--json"]
    code, out, _ = run([*argv, "--max-update-interval", "2", "--min-topk-ratio", "0.3"], capsys)
    assert code == cli.EXIT_OK
    (plan,) = json.loads(out)["plans"]
    assert plan["update_interval"] <= 2 and plan["topk_ratio"] >= 0.3


def test_a_users_quality_table_is_used_and_a_broken_one_exits_7(saved_profile, tmp_path, monkeypatch, capsys):
    mine = tmp_path / "mine.json"
    # A task where every setting but the shortest window at the largest ratio costs 20%.
    mine.write_text(json.dumps({"topk_ratios": [0.1, 0.5], "update_intervals": [1, 4],
                                "ratio": [[1.2, 1.2], [1.01, 1.2]], "task": "mine"}))
    argv = ["--load", str(saved_profile), "--params", "50M", "--step-time", "0.2", "--json"]
    code, out, err = run([*argv, "--quality-table", str(mine)], capsys)
    assert code == cli.EXIT_OK, err
    doc = json.loads(out)
    (plan,) = doc["plans"]
    assert doc["quality_table"]["source"] == str(mine) == plan["quality_table"]
    # Only U = 1 with a ratio near 0.5 (or above, toward AdamW's r = 1) is within 1.05 on that table.
    assert plan["predicted_loss_ratio"] <= 1.05 and plan["update_interval"] == 1 and plan["topk_ratio"] >= 0.4
    monkeypatch.setenv(QUALITY_ENV_VAR, str(mine))  # the same table through the environment, as "auto" reads it
    code, out, _ = run(argv, capsys)
    assert json.loads(out)["plans"][0]["quality_table"] == str(mine)
    mine.write_text("{")
    code, _, err = run([*argv, "--quality-table", str(mine)], capsys)
    assert code == cli.EXIT_BAD_QUALITY_TABLE
    assert "not JSON" in err


@pytest.mark.parametrize(("mutate", "field"), [pytest.param(m, f, id=i) for i, m, f in BAD_PROFILES])
def test_load_of_an_invalid_profile_exits_4_naming_the_field(tmp_path, capsys, mutate, field):
    data = profile_to_json(synthetic_profile())
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    code, out, err = run(["--load", str(path)], capsys)
    assert code == cli.EXIT_NO_PROFILE, err
    assert field in err and "Traceback" not in err and out == ""


def test_load_of_a_binary_file_exits_4(tmp_path, capsys):
    path = tmp_path / "profile.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xd8")
    code, _, err = run(["--load", str(path)], capsys)
    assert code == cli.EXIT_NO_PROFILE
    assert "not UTF-8" in err


def test_planning_for_a_grad_dtype_the_profile_lacks_exits_4(tmp_path, capsys):
    data = profile_to_json(synthetic_profile())
    del data["cpu_adamw"]["rates"]["bfloat16"]
    path = tmp_path / "fp32-only.json"
    path.write_text(json.dumps(data))
    code, _, err = run(["--load", str(path), "--grad-dtype", "bfloat16"], capsys)
    assert code == cli.EXIT_NO_PROFILE
    assert "bfloat16" in err


def test_an_undecodable_quality_table_exits_7(saved_profile, tmp_path, capsys):
    table = tmp_path / "table.json"
    table.write_bytes(b"\xff\xfe\x00{")
    code, _, err = run(["--load", str(saved_profile), "--quality-table", str(table)], capsys)
    assert code == cli.EXIT_BAD_QUALITY_TABLE
    assert str(table) in err and "UTF-8" in err


# ----------------------------------------------------------------------------------- for a person (issue 20, #13)


def two_core_profile(**changes):
    """The synthetic profile on a 2-core machine (this VM's size), so its cpu_threads choice is valid here."""
    prof = synthetic_profile()
    rates = {dt: {1: tab[1], 2: tab[2]} for dt, tab in prof.cpu_adamw.rates.items()}
    adamw = dataclasses.replace(prof.cpu_adamw, rates=rates, call_overhead_s={1: 2e-5, 2: 3e-5})
    return dataclasses.replace(prof, cpu_cores=2, cpu_adamw=adamw, **changes)


def test_the_printed_constructor_builds_the_chosen_optimizer(tmp_path, capsys):
    path = save_profile(two_core_profile(), tmp_path / "p.json")
    argv = ["--load", str(path), "--params", "50M", "--step-time", "0.2"]
    code, out, err = run([*argv, "--json"], capsys)
    (plan,) = json.loads(out)["plans"]
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_OK, err
    (call,) = [line.strip() for line in out.splitlines() if line.strip().startswith("optimizer = ZenFlowAdamW(")
               and '"auto"' not in line]
    assert f"topk_ratio={plan['topk_ratio']:g}" in call and f"update_interval={plan['update_interval']}" in call
    model = torch.nn.Linear(64, 32)
    assert "lr=lr," in call and "1e-4" not in out  # the user's learning rate, never one the tuner made up
    namespace = {"model": model, "ZenFlowAdamW": __import__("zenflow_triton").ZenFlowAdamW}
    with pytest.raises(NameError, match="'lr'"):
        exec(call, dict(namespace))  # pasted without a learning rate: refused, not a silent default
    exec(call, dict(namespace, lr=3e-4), namespace)  # pasted as printed, beside the user's lr
    opt = namespace["optimizer"]
    try:
        st = opt.stats()
        assert (st["topk_ratio"], st["update_interval"], st["cpu_threads"]) == (
            plan["topk_ratio"], plan["update_interval"], plan["cpu_threads"])
    finally:
        opt.close()
    assert 'topk_ratio="auto", update_interval="auto"' in out


def test_a_bfloat16_plan_pastes_its_grad_dtype(tmp_path, capsys):
    path = save_profile(two_core_profile(), tmp_path / "p.json")
    code, out, _ = run(["--load", str(path), "--params", "50M", "--step-time", "0.2", "--grad-dtype", "bfloat16"],
                       capsys)
    assert code == cli.EXIT_OK and 'grad_dtype="bfloat16")' in out


def test_the_output_says_where_the_profile_went_and_whether_auto_reads_it(tmp_path, monkeypatch, capsys):
    code, out, err = run(TINY, capsys)  # the default: the per-user cache, where "auto" looks
    assert code == cli.EXIT_OK, err
    (cached,) = (tmp_path / "xdg" / "zenflow_triton").glob("profile-*.json")
    assert f"profile written to {cached}" in out
    assert '"auto" (topk_ratio="auto", update_interval="auto") reads it from there' in out
    elsewhere = tmp_path / "mine.json"
    code, out, err = run([*TINY, "--output", str(elsewhere)], capsys)
    assert code == cli.EXIT_OK, err
    assert f"profile written to {elsewhere}" in out and f"{ENV_VAR}={elsewhere}" in out
    code, out, _ = run([*TINY, "--no-save"], capsys)
    assert "profile not saved (--no-save)" in out
    monkeypatch.setenv(ENV_VAR, str(elsewhere))
    code, out, _ = run([*TINY, "--force"], capsys)
    assert f"profile written to {elsewhere}" in out and f"named by ${ENV_VAR}" in out
    code, out, _ = run(["--load"], capsys)
    assert f"profile loaded from {elsewhere}" in out


def noisy(noise: float, **changes):
    return two_core_profile(spread={"memcpy 1 MiB": noise, "host AdamW float32 1 threads": noise}, **changes)


@pytest.mark.parametrize(("saved", "new", "force", "replaced"), [
    (0.02, 0.40, False, False),  # a calmer saved profile stays
    (0.02, 0.40, True, True),    # unless --force
    (0.40, 0.02, False, True),   # a calmer run replaces a noisy one
    (None, 0.40, False, True),   # a schema-1 profile recorded no spread: nothing says it is calmer
])
def test_a_calmer_saved_profile_is_kept_unless_forced(tmp_path, monkeypatch, capsys, saved, new, force, replaced):
    target = tmp_path / "p.json"
    old = two_core_profile(created="old") if saved is None else noisy(saved, created="old")
    save_profile(old, target)
    monkeypatch.setattr(cli, "probe_machine", lambda *a, **k: noisy(new, created="new"))
    code, out, err = run(["--output", str(target), *(["--force"] if force else []), "-q"], capsys)
    assert code == cli.EXIT_OK, err
    assert load_profile(target).created == ("new" if replaced else "old")
    if not replaced:
        assert "holds one measured calmer (median spread 2%, this run 40%)" in out and "--force" in err


def test_a_calmer_saved_profile_without_the_cpu_tensor_device_step_is_replaced(tmp_path, monkeypatch, capsys):
    """Calmer, but lacking figures the new run has (a probe for CUDA parameters saved through the API): kept, every
    CPU-tensor "auto" would refuse it and probe again in every process."""
    target = tmp_path / "p.json"
    save_profile(noisy(0.02, created="old", cpu_device=None), target)
    monkeypatch.setattr(cli, "probe_machine", lambda *a, **k: noisy(0.40, created="new"))
    code, _, err = run(["--output", str(target), "-q"], capsys)
    assert code == cli.EXIT_OK, err
    assert load_profile(target).created == "new"


def test_a_busy_machine_is_warned_about_and_each_figure_shows_its_spread(tmp_path, capsys):
    busy = save_profile(noisy(0.4, load_average=5.0), tmp_path / "busy.json")
    code, out, _ = run(["--load", str(busy), "--show-profile"], capsys)
    assert "WARNING: the machine was busy while measuring (load average 5.0 on 2 cores; the repeats of a typical " \
           "figure disagree by 40%" in out
    assert "5.00 (40%)" in out  # memcpy 1 MiB, 5 GB/s
    assert "300 (40%)" in out  # host AdamW float32 at 1 thread, 300 M params/s
    compiled = save_profile(noisy(0.4, durations={"total": 3.0, "compile": 1.2}), tmp_path / "c.json")
    assert "measured in 3.0 s, 1.2 s of it preparing the host kernels" in run(["--load", str(compiled)], capsys)[1]
    calm = save_profile(noisy(0.01, load_average=0.5), tmp_path / "calm.json")
    code, out, _ = run(["--load", str(calm), "--json"], capsys)
    assert json.loads(out)["busy"] is None
    code, out, _ = run(["--load", str(calm)], capsys)
    assert "WARNING" not in out and "spread        median 1% over 2 figures" in out


def test_quick_and_full_say_what_they_measure(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(cli, "probe_machine", lambda settings, **k: seen.append(settings) or two_core_profile())
    _, _, quick = run(["--quick", "--no-save"], capsys)
    _, _, full = run(["--no-save"], capsys)
    assert seen[0].quick and not seen[1].quick
    assert seen[0].describe() in quick and seen[1].describe() in full
    assert "x 3 repeats" in quick and "x 5 repeats" in full and "3 sizes" in quick and "6 sizes" in full


def test_load_and_force_do_not_go_together(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--load", "--force"])
    assert "--force" in capsys.readouterr().err


def test_a_plan_of_r_1_is_explained_in_the_table(tmp_path, capsys):
    path = save_profile(two_core_profile(), tmp_path / "p.json")
    code, out, _ = run(["--load", str(path), "--params", "1M", "--step-time", "1"], capsys)
    assert code == cli.EXIT_OK
    assert "topk_ratio 1 (update_interval 1): no offloading, plain AdamW on the device" in out
    assert "why no offloading:" in out and "topk_ratio=1, update_interval=1, cpu_threads" in out


def test_the_host_add_probe_shows_in_the_table_the_json_and_a_host_plan(tmp_path, capsys):
    """A measuring run records the add probe (schema 3): --json carries its curves and the pass without acc, the
    table prints them, and a "host" plan prices the adds at the measured rate; an older profile says it assumes."""
    path = tmp_path / "profile.json"
    argv = [*TINY, "--json", "--output", str(path), "--params", "50M", "--step-time", "0.2", "--accumulate", "host"]
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_OK, err
    doc = json.loads(out)
    add = doc["profile"]["host_add"]
    assert set(add["curves"]) == {"float32", "bfloat16"} and add["kernel"] in ("numba", "torch-reference")
    assert all(bw > 0 for tab in add["curves"].values() for c in tab.values() for _, bw in c["points"])
    assert doc["profile"]["cpu_device"]["pass_no_acc_rate"] > 0
    (plan,) = doc["plans"]
    assert plan["accumulate"] == "host" and "ASSUMED" not in plan["reason"]
    # The CLI's plan may not offload at all (topk_ratio=1: no host adds to price); one that does names the rate.
    from zenflow_triton.autotune.chooser import plan as make_plan
    from zenflow_triton.autotune.model import Workload

    w = Workload(shapes=((4096, 4096),), step_time_s=0.2, device="cpu")
    reason = make_plan(load_profile(path), w, accumulate="host", topk_ratio=0.1).reason
    assert "host adds at the measured" in reason and "ASSUMED" not in reason
    code, out, err = run(["--load", str(path), "--params", "50M", "--step-time", "0.2", "--show-profile"], capsys)
    assert code == cli.EXIT_OK, err
    assert 'host add of accumulate="host"' in out and "GB/s streamed" in out and "without acc" in out
    old = save_profile(synthetic_profile(), tmp_path / "old.json")
    code, out, err = run(["--load", str(old), "--params", "50M", "--step-time", "0.2", "--accumulate", "host",
                          "--show-profile"], capsys)
    assert code == cli.EXIT_OK, err
    assert 'host add (accumulate="host"): not measured' in out and "host adds ASSUMED" in out


def test_one_wild_figure_or_an_outlier_cell_is_a_busy_machine_too(tmp_path, capsys):
    """Issue 30 item 10: a 10% median hid a host add at 1/50 of one thread's rate and a 256 KiB memcpy at 0.06 GB/s.
    The widest spread and cells out of line with their neighbours count as busy, named in the warning."""
    spread = {f"memcpy {n} MiB": 0.02 for n in (1, 2, 4, 8)}
    wild = save_profile(two_core_profile(spread={**spread, "host add float32 2 threads 1 MiB": 3.0}),
                        tmp_path / "wild.json")
    code, out, _ = run(["--load", str(wild)], capsys)
    assert code == cli.EXIT_OK
    assert "WARNING: the machine was busy while measuring (the repeats of host add float32 2 threads 1 MiB " \
           "disagree by 300% (calm: under 100%))" in out
    assert json.loads(run(["--load", str(wild), "--json"], capsys)[1])["busy"] is not None

    dip = BandwidthCurve("memcpy", ((2**17, 4e9), (2**18, 0.06e9), (2**20, 5e9), (2**26, 8e9)))
    base = two_core_profile(spread=spread)
    rates = {dt: dict(tab) for dt, tab in base.cpu_adamw.rates.items()}
    rates["float32"][2] = rates["float32"][1] / 50
    add = HostAddRates(kernel="numba", curves={"float32": {
        1: BandwidthCurve("host-add", ((2**20, 60e9), (2**24, 57e9))),
        2: BandwidthCurve("host-add", ((2**20, 0.6e9), (2**24, 56e9)))}})
    odd = dataclasses.replace(base, memcpy=dip, cpu_adamw=dataclasses.replace(base.cpu_adamw, rates=rates),
                              host_add=add)
    assert odd.outliers() == ["memcpy 262144 B at 0.06 GB/s against 4 and 5",
                              "host AdamW float32 at 2 threads 6 M/s against 300 at 1",
                              "host add float32 1048576 B at 2 threads 0.6 GB/s against 60 at 1"]
    code, out, _ = run(["--load", str(save_profile(odd, tmp_path / "odd.json"))], capsys)
    assert "figures out of line with their neighbours: memcpy 262144 B at 0.06 GB/s" in out
    assert base.busy() is None and base.outliers() == []  # neighbours in line, spreads calm: not busy


def test_load_prints_the_profile_once_asked(saved_profile, capsys):
    """Issue 30 item 10: a measuring run prints the figures; --load prints one line and the choice, unless
    --show-profile."""
    argv = ["--load", str(saved_profile), "--params", "50M", "--step-time", "0.2"]
    code, short, _ = run(argv, capsys)
    code2, full, _ = run([*argv, "--show-profile"], capsys)
    assert code == code2 == cli.EXIT_OK
    assert "copy bandwidth" not in short and "host AdamW (" not in short and "--show-profile prints" in short
    assert "copy bandwidth" in full and "host AdamW (" in full
    assert short.split("would choose", 1)[1] == full.split("would choose", 1)[1]  # the same choice
    assert "profile loaded from" in short


def test_quality_regime_picks_the_tables_regime(saved_profile, tmp_path, capsys):
    fine = {"topk_ratios": [0.1, 0.5], "update_intervals": [1, 4], "ratio": [[1.02, 1.03], [1.01, 1.02]],
            "task": "fine"}
    scratch = dict(fine, ratio=[[1.2, 1.3], [1.1, 1.2]], task="scratch")
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps(dict(fine, regimes={"scratch": scratch})))
    argv = ["--load", str(saved_profile), "--params", "50M", "--step-time", "0.2", "--json", "--quality-table",
            str(mine)]
    got = {}
    for regime in ("finetune", "scratch", "worst"):
        code, out, err = run([*argv, "--quality-regime", regime], capsys)
        assert code == cli.EXIT_OK, err
        got[regime] = json.loads(out)["plans"][0]["predicted_loss_ratio"]
    # Every grid point is within the 1.05 budget on the fine-tune; from scratch none is, so the plan moves toward
    # r = 1 (AdamW); "worst" is the scratch table here, which is above the fine-tune everywhere.
    assert got["finetune"] <= 1.03 < got["scratch"] and got["worst"] == got["scratch"]
    code, out, _ = run(argv, capsys)  # the default: the worse of the two
    assert json.loads(out)["plans"][0]["predicted_loss_ratio"] == got["worst"]
