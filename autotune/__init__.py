"""Autotuner of zenflow_triton, installed as ``zenflow_triton.autotune`` (DESIGN §8).

Measure a machine once (``python -m zenflow_triton.autotune``), then choose ``topk_ratio``,
``update_interval`` and the host thread count for a model from that profile and the step time.
The modules, each importing only those listed before it:

- :mod:`.machine`: which machine this is (host, CPU model, cores, cache, GPU name) and its key;
- :mod:`.profile`: the measured figures (:class:`Profile` and its parts), to and from plain dicts;
- :mod:`.model`: the pure cost model and chooser (:func:`plan`, :func:`predict`, :func:`stall_grid`);
- :mod:`.probes`: touches hardware and returns a :class:`Profile` (:func:`probe_machine`);
- :mod:`.cache`: the profile as versioned JSON in a per-user, per-machine file;
- :mod:`.bridge`: :func:`plan_for_optimizer`, what the optimizer's ``"auto"`` calls (profile lookup, memory
  budget, the config's defaults); it imports :mod:`zenflow_triton.config`, never the optimizer;
- ``__main__``: the command line.

Importing this package neither compiles numba kernels nor initializes CUDA.
"""

from .bridge import plan_for_optimizer
from .cache import (
    ENV_VAR,
    SCHEMA_VERSION,
    ProfileError,
    cache_dir,
    default_profile_path,
    find_profile,
    load_profile,
    save_profile,
)
from .machine import current_machine_key, machine_key
from .model import (
    Plan,
    Prediction,
    Targets,
    Workload,
    plan,
    predict,
    shapes_for_param_count,
    stall_grid,
)
from .probes import ProbeSettings, probe_machine
from .profile import BandwidthCurve, CpuAdamwRates, DeviceOpRates, GpuInfo, Profile

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
