"""Machine identity: the key a profile is filed under, and what the system says about this host."""

from __future__ import annotations

from zenflow_triton.autotune import machine
from zenflow_triton.autotune.machine import machine_key


def test_machine_key_is_a_safe_file_name():
    key = machine_key("node-7.cluster", "Intel(R) Xeon(R) Platinum 8480+ @ 2.0GHz", "NVIDIA H100 80GB HBM3")
    assert key == "node-7.cluster__Intel-R-Xeon-R-Platinum-8480-2.0GHz__NVIDIA-H100-80GB-HBM3"
    assert machine_key("h", "c", None).endswith("__nogpu")
    assert "/" not in machine_key("a/b", "../..", "x y")


def test_host_description_is_plausible():
    assert machine.available_cores() >= 1
    assert machine.last_level_cache_bytes() >= 64 * 1024
    assert machine.cpu_model_name()
