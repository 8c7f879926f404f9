"""Profile files: schema, versioning, location, and files written by earlier versions."""

from __future__ import annotations

import dataclasses
import json

import pytest
from autotune_profiles import BAD_PROFILES, _set, synthetic_profile, with_schema_3

from zenflow_triton.autotune.cache import (
    ENV_VAR,
    SCHEMA,
    SCHEMA_VERSION,
    ProfileError,
    cache_dir,
    default_profile_path,
    find_profile,
    load_profile,
    profile_to_json,
    save_profile,
)

# synthetic_profile(gpu=True) as the schema-1 writer saved it before the autotuner was split into modules
# (machine, profile, model, cache, bridge): files users already have must keep loading, unchanged.
SCHEMA_1_FILE = """\
{
  "schema": "zenflow_triton.profile",
  "schema_version": 1,
  "machine_key": "host__cpu__nogpu",
  "hostname": "host",
  "cpu_model": "cpu",
  "cpu_cores": 4,
  "llc_bytes": 33554432,
  "quick": true,
  "created": "2025-01-01T00:00:00+00:00",
  "versions": {"torch": "x"},
  "durations": {"total": 1.0},
  "cpu_adamw": {
    "kernel": "numba",
    "numel": 4194304,
    "rates": {
      "float32": {"1": 300000000.0, "2": 500000000.0, "3": 600000000.0, "4": 610000000.0},
      "bfloat16": {"1": 350000000.0, "2": 600000000.0, "3": 700000000.0, "4": 700000000.0}
    },
    "call_overhead_s": {"1": 2e-05, "2": 3e-05, "3": 3e-05, "4": 4e-05}
  },
  "memcpy": {"kind": "memcpy", "points": [[1048576, 5000000000.0], [67108864, 8000000000.0]]},
  "cpu_device": {"source": "synthetic", "pass_rate": 500000000.0, "adam_rate": 100000000.0, "merge_rate": 500000000.0},
  "gpu": {
    "name": "GPU",
    "total_bytes": 85899345920,
    "free_bytes": 75161927680,
    "mem_bandwidth": 2000000000000.0,
    "h2d": {"kind": "pcie-h2d", "points": [[1048576, 20000000000.0]]},
    "d2h": {"kind": "pcie-d2h", "points": [[1048576, 20000000000.0]]}
  },
  "gpu_unavailable": null
}
"""


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Never touch the real user cache, and start every test without a profile."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    return tmp_path


def test_cache_dir_follows_xdg_and_env_var_overrides_the_file(tmp_path, monkeypatch):
    assert cache_dir() == tmp_path / "xdg" / "zenflow_triton"
    assert default_profile_path("k") == tmp_path / "xdg" / "zenflow_triton" / "profile-k.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir().parts[-2:] == (".cache", "zenflow_triton")
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "mine.json"))
    assert default_profile_path("k") == tmp_path / "mine.json"


def test_save_and_load_round_trip(tmp_path):
    prof = synthetic_profile(gpu=True)
    path = save_profile(prof, tmp_path / "sub" / "p.json", extra={"plan": {"note": 1}})
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["schema_version"] == SCHEMA_VERSION
    assert data["machine_key"] == prof.machine_key
    assert load_profile(path) == prof
    assert not list(path.parent.glob(".*tmp"))  # the temporary file of the atomic write is gone


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"schema": "other"}', "not a zenflow_triton profile"),
        (json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION + 1}), "schema_version"),
        (json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "machine_key": "k"}), "malformed"),
    ],
)
def test_unusable_files_raise_profile_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message):
        load_profile(path)


def test_missing_file_and_invalid_rates_raise_profile_error(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "absent.json")
    data = profile_to_json(synthetic_profile())
    data["cpu_adamw"]["rates"]["float32"]["1"] = -1.0
    (tmp_path / "neg.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="malformed"):
        load_profile(tmp_path / "neg.json")


def test_find_profile_uses_the_env_var_then_the_cache(tmp_path, monkeypatch):
    assert find_profile("k") is None
    save_profile(synthetic_profile(key="k"), default_profile_path("k"))
    prof, path = find_profile("k")
    assert path.name == "profile-k.json" and prof.machine_key == "k"
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env.json"))
    assert find_profile("k") is None  # the env var names the file; the cache is not consulted
    save_profile(synthetic_profile(key="env"), tmp_path / "env.json")
    assert find_profile("k")[0].machine_key == "env"


def test_a_schema_1_file_loads_and_is_written_as_schema_2_with_the_same_fields(tmp_path):
    # Files users already have must keep loading, unchanged; schema 2 only adds the optional spread, repeats and
    # load_average (empty or None in an old file: not recorded, which the calm check treats as unknown).
    path = tmp_path / "old.json"
    path.write_text(SCHEMA_1_FILE)
    old = load_profile(path)
    assert old == synthetic_profile(gpu=True)
    assert old.spread == {} and old.repeats == {} and old.load_average is None and old.noise is None
    written = profile_to_json(synthetic_profile(gpu=True))
    assert written.pop("schema_version") == SCHEMA_VERSION == 3
    assert {k: written.pop(k) for k in ("spread", "repeats", "load_average", "host_add")} == {
        "spread": {}, "repeats": {}, "load_average": None, "host_add": None}
    assert written["cpu_device"].pop("pass_no_acc_rate") is None  # schema 3: not measured in an old file
    expected = json.loads(SCHEMA_1_FILE)
    del expected["schema_version"]
    assert written == expected
    assert list(written) == list(expected)  # same keys in the same order


def test_a_schema_3_profile_round_trips_its_host_add_and_an_older_one_loads_without(tmp_path):
    prof = with_schema_3(synthetic_profile(gpu=True), add_rate=12e9, no_acc_rate=3e8)
    loaded = load_profile(save_profile(prof, tmp_path / "p.json"))
    assert loaded == prof and loaded.host_add.curve("bfloat16", 2).peak == 12e9
    assert loaded.cpu_device.pass_no_acc_rate == 3e8
    # The same file as schema 2 wrote it: no host_add, no pass_no_acc_rate; it loads, with both None.
    data = profile_to_json(prof)
    data["schema_version"] = 2
    del data["host_add"], data["cpu_device"]["pass_no_acc_rate"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_profile(tmp_path / "old.json")
    assert old.host_add is None and old.cpu_device.pass_no_acc_rate is None
    assert old == dataclasses.replace(prof, host_add=None, cpu_device=synthetic_profile().cpu_device)


@pytest.mark.parametrize(("mutate", "field"), [
    pytest.param(_set("host_add", []), "host_add", id="host-add-list"),
    pytest.param(_set("host_add.curves", {}), "host_add.curves", id="host-add-empty"),
    pytest.param(_set("host_add.curves.float32", {}), "host_add.curves.float32", id="host-add-dtype-empty"),
    pytest.param(_set("host_add.curves.float32", {"x": 1}), "host_add.curves.float32", id="host-add-thread-key"),
    pytest.param(_set("host_add.curves.float32.1.points", [[1024, -1.0]]),
                 "host_add.curves.float32.1.points[0] bytes_per_second", id="host-add-rate-negative"),
    pytest.param(_set("host_add.curves.bfloat16.2.points", [[4096, 1e9], [1024, 1e9]]),
                 "host_add.curves.bfloat16.2.points", id="host-add-sizes-descend"),
    pytest.param(lambda d: d["host_add"].pop("kernel"), "host_add.kernel", id="host-add-kernel-missing"),
    pytest.param(_set("cpu_device.pass_no_acc_rate", 0), "cpu_device.pass_no_acc_rate", id="no-acc-rate-zero"),
    pytest.param(_set("cpu_device.pass_no_acc_rate", "fast"), "cpu_device.pass_no_acc_rate", id="no-acc-rate-str"),
])
def test_schema_3_fields_are_checked_like_every_other(tmp_path, mutate, field):
    _assert_refused(tmp_path, profile_to_json(with_schema_3(synthetic_profile())), mutate, field)


def test_a_schema_2_profile_round_trips_its_spread(tmp_path):
    prof = dataclasses.replace(synthetic_profile(), spread={"memcpy 1 MiB": 0.04, "host AdamW float32 1 threads": 0.1},
                               repeats={"copy": 3}, load_average=1.5)
    assert load_profile(save_profile(prof, tmp_path / "p.json")) == prof
    assert prof.noise == pytest.approx(0.07)


@pytest.mark.parametrize(("mutate", "field"), [pytest.param(m, f, id=i) for i, m, f in BAD_PROFILES])
def test_every_invalid_field_is_a_profile_error_naming_it(tmp_path, mutate, field):
    _assert_refused(tmp_path, profile_to_json(synthetic_profile()), mutate, field)


def _assert_refused(tmp_path, data, mutate, field) -> None:
    """The profile ``data`` after ``mutate`` is a ProfileError naming ``field`` and the file."""
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as exc:
        load_profile(path)
    assert f"{field}:" in str(exc.value) or f"{field} " in str(exc.value), str(exc.value)
    assert str(path) in str(exc.value)


def test_a_gpu_profiles_fields_are_checked_too(tmp_path):
    data = profile_to_json(synthetic_profile(gpu=True))
    data["gpu"]["free_bytes"] = float("inf")
    (tmp_path / "g.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="gpu.free_bytes"):
        load_profile(tmp_path / "g.json")


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\xff\xfe", b"\xff\xfe{}"])
def test_a_binary_file_is_a_profile_error(tmp_path, content):
    path = tmp_path / "binary.json"
    path.write_bytes(content)
    with pytest.raises(ProfileError, match="not UTF-8"):
        load_profile(path)
