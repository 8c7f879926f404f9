"""Autotuner of zenflow_triton, installed as ``zenflow_triton.autotune`` (DESIGN §8).

Measure a machine once (``python -m zenflow_triton.autotune``), then choose ``topk_ratio``,
``update_interval`` and the host thread count for a model from that profile and the step time.
The modules, each importing only those listed before it:

- :mod:`.machine`: which machine this is (host, CPU model, cores, cache, GPU name) and its key;
- :mod:`.profile`: the measured figures (:class:`Profile` and its parts), to and from plain dicts;
- :mod:`.quality`: the loss ratio vs AdamW over ``(topk_ratio, U)``, measured on the demo's fine-tune and shipped
  as data (:class:`QualityTable`); users can pass their own;
- :mod:`.placement`: where ``accumulate="auto"`` keeps the window sum (:func:`place_accumulation`, pure), and the
  one formula of the host layout (``host_views``);
- :mod:`.model`: the pure cost model and chooser (:func:`plan`, :func:`predict`, :func:`stall_grid`), which weighs
  the predicted step time against the quality table's loss ratio;
- :mod:`.probes`: touches hardware and returns a :class:`Profile` (:func:`probe_machine`);
- :mod:`.cache`: the profile as versioned JSON in a per-user, per-machine file;
- :mod:`.bridge`: :func:`plan_for_optimizer`, what the optimizer's ``"auto"`` calls (profile lookup, memory
  budget, the config's defaults); it imports :mod:`zenflow_triton.config`, never the optimizer;
- :mod:`.capacity`: the biggest model per mode that fits a machine's GPU and host memory (``--params`` alone,
  ``--max-params``, ``python -m zenflow_triton.autotune.capacity``); it reads this machine through
  :mod:`zenflow_triton.host_budget` on first use;
- ``__main__``: the command line.

Importing this package neither compiles numba kernels nor initializes CUDA, and imports no torch: :mod:`.probes`
(which does) loads on first use of ``probe_machine`` or ``ProbeSettings``, so the CLI's ``--help`` is instant.
"""

from typing import Any

from .bridge import QUALITY_ENV_VAR, plan_for_optimizer, quality_table_for
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
from .chooser import plan, stall_grid
from .machine import current_machine_key, machine_key
from .model import (
    DEFAULT_MAX_LOSS_RATIO,
    Plan,
    Prediction,
    Targets,
    Workload,
    format_count,
    format_seconds,
    predict,
    shapes_for_param_count,
)
from .profile import BandwidthCurve, CpuAdamwRates, DeviceOpRates, GpuInfo, HostAddRates, Profile
from .quality import QualityTable, QualityTableError, default_quality_table, load_quality_table

__all__ = [
    "DEFAULT_MAX_LOSS_RATIO",
    "ENV_VAR",
    "QUALITY_ENV_VAR",
    "SCHEMA_VERSION",
    "BandwidthCurve",
    "CpuAdamwRates",
    "DeviceOpRates",
    "GpuInfo",
    "HostAddRates",
    "Plan",
    "Prediction",
    "ProbeSettings",
    "Profile",
    "ProfileError",
    "QualityTable",
    "QualityTableError",
    "Targets",
    "Workload",
    "cache_dir",
    "current_machine_key",
    "default_profile_path",
    "default_quality_table",
    "find_profile",
    "format_count",
    "format_seconds",
    "load_profile",
    "load_quality_table",
    "machine_key",
    "plan",
    "plan_for_optimizer",
    "predict",
    "probe_machine",
    "quality_table_for",
    "save_profile",
    "shapes_for_param_count",
    "stall_grid",
]


def __getattr__(name: str) -> Any:
    if name in ("ProbeSettings", "probe_machine"):
        from . import probes

        return getattr(probes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
