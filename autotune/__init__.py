"""Autotuner of zenflow_triton, installed as ``zenflow_triton.autotune`` (DESIGN §8).

Measure a machine once (``python -m zenflow_triton.autotune``), then choose ``topk_ratio``,
``update_interval`` and the host thread count for a model from that profile and the step time:

- :mod:`.probes` touches hardware and returns a :class:`Profile`;
- :mod:`.model` is the pure cost model and chooser (:func:`plan`, :func:`predict`);
- :mod:`.cache` stores profiles per user and machine, and :func:`plan_for_optimizer` is what the
  optimizer's ``"auto"`` calls.

Importing this package neither compiles numba kernels nor initializes CUDA.
"""

from .cache import (
    ENV_VAR,
    SCHEMA_VERSION,
    ProfileError,
    cache_dir,
    current_machine_key,
    default_profile_path,
    find_profile,
    load_profile,
    machine_key,
    plan_for_optimizer,
    save_profile,
)
from .model import (
    BandwidthCurve,
    CpuAdamwRates,
    DeviceOpRates,
    GpuInfo,
    Plan,
    Prediction,
    Profile,
    Targets,
    Workload,
    plan,
    predict,
    shapes_for_param_count,
    stall_grid,
)
from .probes import ProbeSettings, probe_machine

__all__ = [
    "ENV_VAR",
    "SCHEMA_VERSION",
    "BandwidthCurve",
    "CpuAdamwRates",
    "DeviceOpRates",
    "GpuInfo",
    "Plan",
    "Prediction",
    "ProbeSettings",
    "Profile",
    "ProfileError",
    "Targets",
    "Workload",
    "cache_dir",
    "current_machine_key",
    "default_profile_path",
    "find_profile",
    "load_profile",
    "machine_key",
    "plan",
    "plan_for_optimizer",
    "predict",
    "probe_machine",
    "save_profile",
    "shapes_for_param_count",
    "stall_grid",
]
