"""Which machine this is: host name, CPU model, cores, last-level cache, GPU name, and the key a profile is filed under.

These are facts the operating system states, read without timing anything; :mod:`.probes` measures the rest.
The machine key names the profile file (:mod:`.cache`) and is recorded in the profile, so a profile measured
elsewhere is recognized as such.
"""

from __future__ import annotations

import os
import platform
import re
import socket
from pathlib import Path

__all__ = [
    "machine_key",
    "current_machine_key",
    "cpu_model_name",
    "available_cores",
    "last_level_cache_bytes",
    "host_description",
]

_MiB = 2**20
# Fallback when sysfs does not say (containers, macOS): a typical server L3; only sizes the AdamW buffers.
_DEFAULT_LLC_BYTES = 32 * _MiB


def _sanitize(text: str, limit: int = 48) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:limit] or "unknown"


def machine_key(hostname: str, cpu_model: str, gpu_name: str | None) -> str:
    """A file-name-safe key for one machine: host, CPU model and GPU (``nogpu`` without one)."""
    return "__".join(_sanitize(x) for x in (hostname, cpu_model, gpu_name or "nogpu"))


def current_machine_key() -> str:
    """This machine's key. Asks CUDA for the GPU name when CUDA is available (initializes it)."""
    import torch

    gpu = torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else None
    return machine_key(socket.gethostname(), cpu_model_name(), gpu)


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), which is what a worker thread pool can use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def last_level_cache_bytes() -> int:
    """Size of the largest data or unified cache of CPU 0 (sysfs), or 32 MiB if the system does not say."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1024, "M": _MiB, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or _DEFAULT_LLC_BYTES


def host_description() -> dict[str, object]:
    return {"hostname": socket.gethostname(), "cpu_model": cpu_model_name(), "cpu_cores": available_cores(),
            "llc_bytes": last_level_cache_bytes()}
