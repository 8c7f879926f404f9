"""The package face: every public name importable from ``zenflow_triton.autotune``, and a cheap import."""

from __future__ import annotations

import inspect
import subprocess
import sys

import zenflow_triton.autotune as autotune

# The names the package has exported since the autotuner landed; the split into modules must keep every one.
PUBLIC = {
    "ENV_VAR", "SCHEMA_VERSION", "BandwidthCurve", "CpuAdamwRates", "DeviceOpRates", "GpuInfo", "Plan", "Prediction",
    "ProbeSettings", "Profile", "ProfileError", "Targets", "Workload", "cache_dir", "current_machine_key",
    "default_profile_path", "find_profile", "load_profile", "machine_key", "plan", "plan_for_optimizer", "predict",
    "probe_machine", "save_profile", "shapes_for_param_count", "stall_grid",
}


def test_every_public_name_is_exported():
    assert PUBLIC <= set(autotune.__all__)
    for name in autotune.__all__:
        assert getattr(autotune, name) is not None, name


def test_plan_for_optimizer_takes_what_the_optimizer_passes():
    params = inspect.signature(autotune.plan_for_optimizer).parameters
    passed = ("offloaded_shapes", "param_dtype", "grad_dtype", "step_time_s", "device", "topk_ratio",
              "update_interval", "select_interval", "overlap", "cpu_threads")
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in passed)


def test_importing_the_package_compiles_nothing_and_leaves_cuda_alone():
    code = ("import sys, torch, zenflow_triton.autotune, zenflow_triton.autotune.__main__; "
            "assert 'numba' not in sys.modules, 'numba imported'; "
            "assert not torch.cuda.is_initialized(), 'CUDA initialized'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
