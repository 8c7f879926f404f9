"""The machine profile on disk: where it lives, its versioned JSON schema, and saving, loading and finding it.

A profile is one JSON file with a versioned schema, kept per user and per machine::

    $XDG_CACHE_HOME/zenflow_triton/profile-<machine key>.json     (or ~/.cache/zenflow_triton/...)

The machine key (:mod:`.machine`) is the host name, CPU model and GPU name, sanitized. The environment variable
``ZENFLOW_TRITON_PROFILE`` names a profile file instead, for the CLI (where it writes) and the optimizer
(what it reads).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .machine import current_machine_key
from .profile import Profile, ProfileError

__all__ = [
    "ENV_VAR",
    "SCHEMA",
    "SCHEMA_VERSION",
    "READABLE_VERSIONS",
    "ProfileError",
    "cache_dir",
    "default_profile_path",
    "profile_to_json",
    "profile_from_json",
    "save_profile",
    "load_profile",
    "find_profile",
]

ENV_VAR = "ZENFLOW_TRITON_PROFILE"
SCHEMA = "zenflow_triton.profile"
# Bump when a field changes meaning or is added; READABLE_VERSIONS lists the versions this code still loads (an
# older file without them is re-measured). 2 added the optional spread, repeats and load_average (version 1 files
# load with them empty: not recorded). 3 added the optional host_add rates and cpu_device.pass_no_acc_rate (older
# files load without them: the model then assumes, and says so); a schema-3 file may hold a null cpu_device (a probe
# for CUDA parameters only; written by the API, never by the CLI), which readers before it reject as malformed.
SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/zenflow_triton``, else ``~/.cache/zenflow_triton``."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "zenflow_triton"


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
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise ProfileError(f"{source} has schema_version {version!r}, this zenflow_triton reads "
                           f"{', '.join(map(str, READABLE_VERSIONS))}; re-run `python -m zenflow_triton.autotune`")
    try:
        return Profile.from_dict(data)
    except ProfileError as exc:  # names the field
        raise ProfileError(f"{source} is malformed: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:  # a check in a dataclass's __post_init__
        raise ProfileError(f"{source} is malformed: {exc}") from exc


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
        raw = path.read_bytes()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        why = f"{exc.reason} at byte {exc.start}"
        raise ProfileError(f"profile {path} is not UTF-8 text (a binary file?): {why}") from None
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
