"""The host pre-flight (zenflow_triton/host_budget.py): the one formula of the host layout against the slab the
optimizer maps, byte for byte; what the machine can give (meminfo, cgroups, rlimits, read from a fake /proc and
/sys); a refusal before anything is allocated, an allocation that fails anyway, and a retry that works."""

from __future__ import annotations

import dataclasses
import errno

import pytest
import torch

from zenflow_triton import ZenFlowAdamW, host_budget, host_memory
from zenflow_triton.autotune.model import host_bytes_per_param
from zenflow_triton.autotune.placement import HOST_COLUMN_BYTES, host_bytes_per_element
from zenflow_triton.config import ZenFlowConfig
from zenflow_triton.host_budget import HostMemoryError, host_need, host_room

# Widths whose every view is a multiple of the slab's 64-byte alignment, so the formula per element times the
# elements plus the step counts is the slab's size exactly.
IN, MID = 64, 48
# state_dtype exists once bf16 moments land (issue 29 item 2); the formula reads it either way.
STATE_DTYPES = ["float32"] + (["bfloat16"] if "state_dtype" in {f.name for f in dataclasses.fields(ZenFlowConfig)}
                              else [])


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, MID), torch.nn.Linear(MID, IN)).to(dtype)


def _step(model: torch.nn.Module, opt: ZenFlowAdamW, seed: int = 1) -> None:
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).dtype)
    opt.zero_grad()
    model(x).float().pow(2).mean().backward()
    opt.step()


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.ndim == 2]


@pytest.mark.parametrize("snapshot", [True, False])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["device", "host"])
def test_formula_is_the_slab_byte_for_byte(mode, dtype, grad_dtype, overlap, state_dtype, snapshot) -> None:
    model = _model(dtype)
    extra = {"state_dtype": state_dtype} if state_dtype != "float32" else {}
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, accumulate=mode, grad_dtype=grad_dtype, overlap=overlap,
                       min_offload_numel=0, host_snapshot=snapshot, **extra)
    need = host_need(_weights(model), opt.config, mode)  # before the step: what the pre-flight computes
    _step(model, opt)
    st = opt.stats()
    sums = opt._pipeline._sums
    # "host" lands gradients in a ring beside the slab once windows span steps (none in the warm-up)
    ring = sums.ring.nbytes if sums is not None and sums.ring is not None else 0
    assert st["host_bytes"] == need.total + ring
    numel = IN * MID * 2
    own_master = dtype == torch.float32 and not overlap  # CPU tensors: an fp32 parameter is its own master
    per = host_bytes_per_element(opt.config, mode, torch.tensor([], dtype=dtype).element_size(), own_master=own_master,
                                 device_type="cpu")
    assert st["host_bytes"] - ring == numel * per + HOST_COLUMN_BYTES * (MID + IN)
    assert sum(need.per_element.values()) == per
    if not own_master:  # the autotuner's figure is the same formula (on CPU tensors overlap_steps="auto" is 1)
        sums = 1 if mode == "host" and len(opt._pipeline.records[_weights(model)[0]].sums) == 1 else 2
        assert host_bytes_per_param(dtype.itemsize, grad_dtype, mode, sums=sums, state_dtype=state_dtype,
                                    snapshot=snapshot) == per
    if not snapshot:  # the slab holds no snapshot; an fp32 model never had one
        assert all(rec.snapshot is None for rec in opt._pipeline.records.values())
    opt.close()


def test_issue_figures() -> None:
    """Issue 29's bounds from the formula, bf16 model, on a GPU: "device" 18, "host" 22 (one window sum at
    overlap_steps=1: 18), with grads_in_backward 24 (20); bf16 moments 4 less each; fp32 models 2 less (no snapshot)
    but their capture slot is fp32."""
    rows = []
    for state_dtype in ("float32", "bfloat16"):
        for gib in (False, True):
            for k in ("auto", 1):
                cfg = ZenFlowConfig(state_dtype=state_dtype, grads_in_backward=gib, overlap_steps=k)
                rows.append([host_bytes_per_element(cfg, m, b) for m in ("device", "host") for b in (4, 2)])
    assert rows == [[16, 18, 20, 22], [16, 18, 16, 18], [16, 18, 24, 24], [16, 18, 20, 20],
                    [12, 14, 16, 18], [12, 14, 12, 14], [12, 14, 20, 20], [12, 14, 16, 16]]
    # host_snapshot=False: the bf16 model's 2-byte snapshot goes, so the issue's bounds hold in every mode, the lean
    # one included: "host" + grads_in_backward 22 (18 at overlap_steps=1), 18 (14) with bf16 moments; "device" 16, 12.
    lean = [[host_bytes_per_element(ZenFlowConfig(state_dtype=state_dtype, grads_in_backward=gib, overlap_steps=k,
                                                  host_snapshot=False), m, 2) for m in ("device", "host")]
            for state_dtype in ("float32", "bfloat16") for gib in (False, True) for k in ("auto", 1)]
    assert lean == [[16, 20], [16, 16], [16, 22], [16, 18], [12, 16], [12, 12], [12, 18], [12, 14]]
    # On CPU tensors overlap_steps="auto" is 1 (one window sum); planned on a GPU it counts as two.
    assert host_bytes_per_element(ZenFlowConfig(), "host", 2, device_type="cpu") == 18


def _tiny_room(monkeypatch, room: int) -> None:
    monkeypatch.setattr(host_budget, "_mem_available", lambda: room)
    monkeypatch.setattr(host_budget, "_cgroup_rooms", lambda: {})
    monkeypatch.setattr(host_budget, "_rlimit", lambda kind: None)


def test_refusal_changes_nothing_and_a_retry_works(monkeypatch) -> None:
    model, twin = _model(torch.bfloat16), _model(torch.bfloat16)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, accumulate="host", min_offload_numel=0)
    slab = host_need(_weights(model), opt.config, "host").total
    need = slab + host_budget._ring_need(opt._pipeline, _weights(model), "host")  # the landing ring beside it
    before = [p.detach().clone() for p in model.parameters()]
    _tiny_room(monkeypatch, need - 1)
    with pytest.raises(HostMemoryError) as info:
        _step(model, opt)
    err = info.value
    assert isinstance(err, RuntimeError) and (err.needed, err.available, err.bound) == (need, need - 1, "MemAvailable")
    text = str(err)
    for part in (f"({need} bytes)", f"({need - 1} bytes, MemAvailable", "master 4 + exp_avg 4 + exp_avg_sq 4 + "
                 "window_sums 4 + snapshot 2 = 18 B per parameter", "Nothing was allocated",
                 'state_dtype="bfloat16": '):
        assert part in text, (part, text)
    # Offered only where they cut: a bf16 model's gradients land in bf16 already, overlap_steps="auto" is 1 on CPU
    # tensors (one window sum), and "device" holds the same 18 there.
    assert "grad_dtype" not in text and "overlap_steps=1" not in text and 'accumulate="device"' not in text
    assert not opt.state and not opt._pipeline.slabs and opt._pipeline.accumulate is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    monkeypatch.undo()
    _step(model, opt)  # the retry after the fix
    ref = ZenFlowAdamW(twin.parameters(), lr=1e-3, accumulate="host", min_offload_numel=0)
    _step(twin, ref)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    # The ring is made at the first landing, after the warm-up (whose one-step windows read gradients in place).
    assert opt.stats()["host_available_bound"] == "MemAvailable" and opt.stats()["host_bytes"] == slab
    opt.close()
    ref.close()


def test_load_state_dict_is_checked_first(monkeypatch) -> None:
    model = _model(torch.float32)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, accumulate="device", min_offload_numel=0)
    _step(model, opt)
    saved = opt.state_dict()
    other = ZenFlowAdamW(_model(torch.float32).parameters(), lr=1e-3, accumulate="device", min_offload_numel=0)
    _tiny_room(monkeypatch, 4096)
    with pytest.raises(HostMemoryError, match="refused before allocating"):
        other.load_state_dict(saved)
    assert not other.state and not other._pipeline.slabs
    monkeypatch.undo()
    other.load_state_dict(saved)
    assert other.state_dict()["state"].keys() == saved["state"].keys()
    opt.close()
    other.close()


def test_mmap_that_fails_anyway_is_the_same_error(monkeypatch) -> None:
    model = _model(torch.bfloat16)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, accumulate="device", min_offload_numel=0)

    def no_pages(nbytes):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(host_memory, "_map_pages", no_pages)
    with pytest.raises(HostMemoryError) as info:
        _step(model, opt)
    assert not isinstance(info.value, OSError) and isinstance(info.value.__cause__, OSError)
    assert "failed (Cannot allocate memory)" in str(info.value) and "B per parameter" in str(info.value)
    assert not opt.state and not opt._pipeline.slabs
    monkeypatch.undo()
    _step(model, opt)
    assert opt.stats()["host_bytes"] > 0
    opt.close()


# ------------------------------------------------------------------------------------------------ the room


def _fake_fs(monkeypatch, files: dict[str, str]) -> None:
    monkeypatch.setattr(host_budget, "_read", files.get)


def test_room_is_the_tightest_cgroup_v2_level(monkeypatch) -> None:
    _fake_fs(monkeypatch, {
        "/proc/meminfo": "MemTotal: 16000000 kB\nMemAvailable: 8000000 kB\n",
        "/proc/self/cgroup": "0::/a/b\n",
        "/sys/fs/cgroup/a/b/memory.max": "max\n",
        "/sys/fs/cgroup/a/memory.max": f"{2**30}\n",
        "/sys/fs/cgroup/a/memory.current": f"{2**29}\n",
        "/sys/fs/cgroup/a/memory.stat": f"anon 1\ninactive_file {2**28}\n",
    })
    monkeypatch.setattr(host_budget, "_rlimit", lambda kind: None)
    room = host_room()
    assert room.bounds["MemAvailable"] == 8000000 * 1024
    assert room.bound == "cgroup v2 memory.max of /sys/fs/cgroup/a" and room.bytes == 2**30 - (2**29 - 2**28)


def test_room_reads_cgroup_v1_and_rlimits(monkeypatch) -> None:
    _fake_fs(monkeypatch, {
        "/proc/meminfo": "MemAvailable: 8000000 kB\n",
        "/proc/self/cgroup": "4:memory:/job\n3:cpu:/job\n",
        "/sys/fs/cgroup/memory/job/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": f"{3 * 2**30}\n",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes": f"{2**30}\n",
        "/proc/self/status": "VmSize:\t 1048576 kB\nVmLck:\t 0 kB\n",
    })
    limits = {host_budget.resource.RLIMIT_AS: 2 * 2**30, host_budget.resource.RLIMIT_MEMLOCK: 2**16}
    monkeypatch.setattr(host_budget, "_rlimit", limits.get)
    room = host_room(pinned=True)
    assert room.bounds["cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory"] == 2 * 2**30
    assert room.bound == "RLIMIT_AS (ulimit -v)" and room.bytes == 2 * 2**30 - 2**30
    assert room.pinned_bytes == 2**16


def test_this_machine_has_a_room() -> None:
    room = host_room()
    assert room.bytes is not None and room.bytes > 0 and room.bound in room.bounds


def test_the_knobs_offered_are_those_that_cut() -> None:
    """An fp32 model with "host" and grads_in_backward, merging at the next window end (two window sums): 24 B/param;
    "device" needs grads_in_backward off (16), its fp32 capture slot halves with grad_dtype="bfloat16" (22), bf16
    moments cut 4 (20), one window sum at overlap_steps=1 cuts 4 (20)."""
    weights = _weights(_model(torch.float32))
    cfg = ZenFlowConfig(accumulate="host", grads_in_backward=True, overlap_steps=None)
    cuts = host_budget._cuts(weights, cfg, host_need(weights, cfg, "host"))
    assert [c.split(":")[0] for c in cuts] == ['accumulate="device", grads_in_backward=False',
                                               'grad_dtype="bfloat16"', 'state_dtype="bfloat16"', "overlap_steps=1"]
    assert [c.split("(")[-1] for c in cuts] == ["16 B/param)", "22 B/param)", "20 B/param)", "20 B/param)"]
    # A bf16 model's snapshot is a cut too (its capture slot is bf16 already, so grad_dtype is not).
    weights = _weights(_model(torch.bfloat16))
    cuts = host_budget._cuts(weights, cfg, host_need(weights, cfg, "host"))
    assert [c.split(":")[0] for c in cuts] == ['accumulate="device", grads_in_backward=False',
                                               'state_dtype="bfloat16"', "overlap_steps=1", "host_snapshot=False"]
    assert [c.split("(")[-1] for c in cuts] == ["18 B/param)", "20 B/param)", "20 B/param)", "22 B/param)"]


_ULIMIT_V = r"""
import resource, torch
from zenflow_triton import ZenFlowAdamW
from zenflow_triton.host_budget import HostMemoryError
model = torch.nn.Linear(4096, 2048, bias=False).to(torch.bfloat16)  # 8.4M elements: a 151 MiB slab with "device"
opt = ZenFlowAdamW(model.parameters(), lr=1e-3, accumulate="device")
model(torch.randn(2, 4096, dtype=torch.bfloat16)).float().sum().backward()
used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (used + 64 * 2**20, hard))  # ulimit -v: 64 MiB more than mapped now
try:
    opt.step()
except HostMemoryError as exc:
    print("REFUSED", exc.bound, exc.needed)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
opt.step()
print("RETRY", opt.stats()["host_bytes"])
"""


def test_a_real_address_space_limit_refuses_then_a_retry_works() -> None:
    """``ulimit -v`` for real, in a child process: the pre-flight reads RLIMIT_AS less the address space in use and
    refuses; once the limit is lifted the same step runs."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ULIMIT_V], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    refused, retry = [line.split() for line in out.stdout.splitlines() if line.startswith(("REFUSED", "RETRY"))]
    assert refused[:3] == ["REFUSED", "RLIMIT_AS", "(ulimit"] and int(refused[-1]) == int(retry[1])
    assert int(retry[1]) == 4096 * 2048 * 18 + 4 * 4096
