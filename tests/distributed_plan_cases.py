"""The body of tests/test_distributed_plan.py, one spawned process per rank: each rank's probe measures another
machine (host AdamW rates scaled per rank) and its placement rule answers differently, as ranks on a shared or
mixed machine would; "auto" must still give every rank rank 0's plan and placement."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from autotune_profiles import synthetic_profile

HOST_SPEED = (1.0, 1 / 30, 1 / 1000, 1 / 30)  # per rank: plans differ (topk_ratio 0.04 / 0.1 / 1 at 5 ms a step)
PLACEMENT = ("device", "host", "host", "host")


def rank_profile(rank: int):
    base = synthetic_profile()
    f = HOST_SPEED[rank]
    rates = {dt: {t: r * f for t, r in tab.items()} for dt, tab in base.cpu_adamw.rates.items()}
    return dataclasses.replace(base, cpu_adamw=dataclasses.replace(base.cpu_adamw, rates=rates))


def agree_run(rank: int, world: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["XDG_CACHE_HOME"] = str(Path(out) / f"cache{rank}")  # no saved profile: each rank would probe
    os.environ.pop("ZENFLOW_TRITON_PROFILE", None)
    torch.set_num_threads(1)
    import zenflow_triton.autotune.placement as placement
    import zenflow_triton.autotune.probes as probes
    from zenflow_triton import ZenFlowAdamW
    from zenflow_triton.autotune.bridge import plan_for_optimizer

    probed = []
    probes.probe_machine = lambda *a, **k: probed.append(rank) or rank_profile(rank)
    placement.place_accumulation = lambda **k: SimpleNamespace(accumulate=PLACEMENT[rank], reason=f"rank {rank}")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        opt = ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio="auto", update_interval="auto",
                           min_offload_numel=1024, warmup_steps=0,  # planned after "auto"'s own warm-up
                           quality_regime="finetune")  # the fine-tune table: the ranks' host speeds decide the plan
        for step in range(10):
            opt.zero_grad()
            model(torch.randn(8, 256, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
        st = opt.stats()
        # What this rank's own probe would have chosen alone, at its own measured step time.
        alone = plan_for_optimizer(offloaded_shapes=[(256, 256)] * 3, param_dtype=torch.float32,
                                   grad_dtype="float32", step_time_s=opt._knobs.measured_step_time(),
                                   device=torch.device("cpu"), topk_ratio=None, update_interval=None,
                                   profile=rank_profile(rank), quality_regime="finetune")
        record = {k: st[k] for k in ("topk_ratio", "update_interval", "select_interval", "host_lr_scale",
                                     "overlap_steps", "accumulate", "auto_reason")}
        record.update(probed=probed, alone=[alone.topk_ratio, alone.update_interval])
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
        opt.close()
    finally:
        dist.destroy_process_group()
