"""The machine profile on disk, and the optimizer's way in: :func:`plan_for_optimizer`.

A profile is one JSON file with a versioned schema, kept per user and per machine::

    $XDG_CACHE_HOME/zenflow_triton/profile-<machine key>.json     (or ~/.cache/zenflow_triton/...)

The machine key is the host name, CPU model and GPU name, sanitized. The environment variable
``ZENFLOW_TRITON_PROFILE`` names a profile file instead, for the CLI (where it writes) and the optimizer
(what it reads).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .model import GRAD_BYTES, Plan, Profile, Targets, Workload, plan

__all__ = [
    "ENV_VAR",
    "SCHEMA",
    "SCHEMA_VERSION",
    "MEMORY_BUDGET_FRACTION",
    "ProfileError",
    "cache_dir",
    "machine_key",
    "current_machine_key",
    "default_profile_path",
    "profile_to_json",
    "profile_from_json",
    "save_profile",
    "load_profile",
    "find_profile",
    "plan_for_optimizer",
]

logger = logging.getLogger("zenflow_triton")

ENV_VAR = "ZENFLOW_TRITON_PROFILE"
SCHEMA = "zenflow_triton.profile"
# Bump when a field changes meaning or a required field is added; older files are then re-measured.
SCHEMA_VERSION = 1
# Share of the device's free memory the optimizer's device state may take: the rest absorbs allocator
# fragmentation and the transient buffers of the device step (bf16 casts for the D2H, staging for the H2D).
MEMORY_BUDGET_FRACTION = 0.9


class ProfileError(ValueError):
    """A profile file is missing, unreadable, or of another schema or version."""


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/zenflow_triton``, else ``~/.cache/zenflow_triton``."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "zenflow_triton"


def _sanitize(text: str, limit: int = 48) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:limit] or "unknown"


def machine_key(hostname: str, cpu_model: str, gpu_name: str | None) -> str:
    """A file-name-safe key for one machine: host, CPU model and GPU (``nogpu`` without one)."""
    return "__".join(_sanitize(x) for x in (hostname, cpu_model, gpu_name or "nogpu"))


def current_machine_key() -> str:
    """This machine's key. Asks CUDA for the GPU name when CUDA is available (initializes it)."""
    import torch

    from .probes import cpu_model_name

    gpu = torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else None
    return machine_key(socket.gethostname(), cpu_model_name(), gpu)


def default_profile_path(key: str | None = None) -> Path:
    """Where the profile lives: ``$ZENFLOW_TRITON_PROFILE`` when set, else the cache file for ``key``."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return cache_dir() / f"profile-{key or current_machine_key()}.json"


def profile_to_json(profile: Profile, *, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The file's content: schema header, the profile's fields, and ``extra`` keys (ignored when loading)."""
    out: dict[str, Any] = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION}
    out.update(profile.to_dict())
    if extra:
        out.update(extra)
    return out


def profile_from_json(data: Any, *, source: str = "profile") -> Profile:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ProfileError(f"{source} is not a zenflow_triton profile (no \"schema\": \"{SCHEMA}\")")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileError(f"{source} has schema_version {version!r}, this zenflow_triton reads {SCHEMA_VERSION}; "
                           "re-run `python -m zenflow_triton.autotune`")
    try:
        return Profile.from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{source} is malformed: {exc!r}") from exc


def save_profile(profile: Profile, path: str | os.PathLike[str], *, extra: Mapping[str, Any] | None = None) -> Path:
    """Write atomically (a reader never sees half a file); creates the folder. Returns the path."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile_to_json(profile, extra=extra), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def load_profile(path: str | os.PathLike[str]) -> Profile:
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path} is not valid JSON: {exc}") from exc
    return profile_from_json(data, source=str(path))


def find_profile(key: str | None = None) -> tuple[Profile, Path] | None:
    """The profile named by ``$ZENFLOW_TRITON_PROFILE``, else this machine's cached one; None if there is none.

    A file that exists but cannot be used raises :class:`ProfileError`.
    """
    path = default_profile_path(key)
    if not path.exists():
        return None
    return load_profile(path), path


# ------------------------------------------------------------------------------------------ optimizer

# Profiles measured by this process when none was on disk, by machine key: several optimizers in one
# process probe once. Nothing is written to the user's cache implicitly; the CLI does that.
_probed: dict[str, Profile] = {}
_probe_lock = threading.Lock()


def _profile_for(device_type: str) -> tuple[Profile, str]:
    key = current_machine_key()
    try:
        found = find_profile(key)
    except ProfileError as exc:
        logger.warning("zenflow_triton autotune: ignoring unusable profile: %s", exc)
        found = None
    if found is not None:
        profile, path = found
        if profile.machine_key != key:
            logger.warning("zenflow_triton autotune: profile %s was measured on %s, this machine is %s",
                           path, profile.machine_key, key)
        if device_type != "cuda" or profile.gpu is not None:
            return profile, str(path)
        logger.warning("zenflow_triton autotune: profile %s has no GPU figures (%s); measuring quickly instead",
                       path, profile.gpu_unavailable)
    with _probe_lock:
        profile = _probed.get(key)
        if profile is None or (device_type == "cuda" and profile.gpu is None):
            from .probes import ProbeSettings, probe_machine

            logger.warning(
                "zenflow_triton autotune: no machine profile at %s; running a quick probe (a few seconds). "
                "Run `python -m zenflow_triton.autotune` once for a full, saved profile.", default_profile_path(key)
            )
            profile = probe_machine(ProbeSettings.quick_settings())
            _probed[key] = profile
    return profile, "quick probe (this process)"


def _dtype_bytes(param_dtype: Any) -> int:
    size = getattr(param_dtype, "itemsize", None)
    if size not in (2, 4):
        raise ValueError(f"Invalid param_dtype: {param_dtype!r} (float32, bfloat16 or float16)")
    return int(size)


def plan_for_optimizer(
    *,
    offloaded_shapes: Sequence[tuple[int, int]],
    param_dtype: Any,
    grad_dtype: str,
    step_time_s: float,
    device: Any,
    topk_ratio: float | None,
    update_interval: int | None,
    select_interval: int | None = None,
    overlap: bool = True,
    cpu_threads: int | None = None,
    profile: Profile | None = None,
    targets: Targets | None = None,
) -> Plan:
    """Choose what the user left to ``"auto"`` (None here), from this machine's profile and the measured step time.

    ``offloaded_shapes``: ``[R, C]`` of every offloaded parameter; ``param_dtype``: their torch dtype;
    ``step_time_s``: seconds per training step spent outside ``step()`` (forward, backward, the rest of the
    loop), e.g. the median over the warm-up; ``device``: the parameters' torch device. ``topk_ratio`` /
    ``update_interval``: the user's fixed values, or None to choose. ``select_interval`` (None: 8 windows),
    ``overlap`` and ``cpu_threads`` (None: choose) refine the prediction when the user set them.

    The profile is ``profile`` if given, else the file named by ``$ZENFLOW_TRITON_PROFILE``, else this
    machine's file in the user cache, else a quick probe (a few seconds, logged with a hint to run
    ``python -m zenflow_triton.autotune``). The device-memory budget on CUDA is ``MEMORY_BUDGET_FRACTION`` of
    the memory free now plus the fp32 accumulators, which the optimizer holds already when it plans; CPU
    tensors have no budget.
    """
    import torch

    device = torch.device(device)
    if grad_dtype not in GRAD_BYTES:
        raise ValueError(f"Invalid grad_dtype: {grad_dtype!r} (one of {sorted(GRAD_BYTES)})")
    if not offloaded_shapes:
        raise ValueError("plan_for_optimizer needs at least one offloaded shape")
    if not (step_time_s > 0):
        # A step time of zero (no samples) would make every window look unhideable; a tiny positive one
        # gives the same answer (the host work is exposed) without dividing by zero.
        logger.warning("zenflow_triton autotune: measured step time %r s; planning with 1 ms", step_time_s)
        step_time_s = 1e-3
    shapes = tuple((int(r), int(c)) for r, c in offloaded_shapes)
    if profile is not None:
        source = "given profile"
    else:
        profile, source = _profile_for(device.type)
    budget: float | None = None
    kind = "cuda" if device.type == "cuda" else "cpu"
    if kind == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        acc_held = sum(r * c for r, c in shapes) * 4
        budget = MEMORY_BUDGET_FRACTION * free + acc_held
    workload = Workload(shapes=shapes, step_time_s=float(step_time_s), param_bytes=_dtype_bytes(param_dtype),
                        grad_dtype=grad_dtype, device=kind, memory_budget_bytes=budget)
    result = plan(profile, workload, topk_ratio=topk_ratio, update_interval=update_interval,
                  cpu_threads=cpu_threads, select_interval=select_interval, overlap=overlap, targets=targets,
                  profile_source=source)
    logger.debug("zenflow_triton autotune plan (%s): %s", source, result.reason)
    return result
