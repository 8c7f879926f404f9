"""The code that runs inside the spawned processes of tests/test_fsdp.py (gloo, CPU): each function is one rank's
part of a scenario, and raises (an AssertionError) when the rank sees something wrong."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from zenflow_triton import ZenFlowAdamW

# Offloaded weights with rows that do not split evenly: 7 rows (2 ranks: 4 + 3; 3 ranks: 3 + 3 + 1), 5 rows
# (3 + 2; 2 + 2 + 1) and 2 rows (1 + 1; 1 + 1 + 0: an empty shard on 3 ranks). The bias stays resident.
SHAPES = {"w1": (7, 24), "w2": (5, 8, 5), "w3": (2, 33), "bias": (7,)}
KNOBS = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, topk_ratio=0.25, update_interval=2,
             select_interval=4, warmup_steps=2, overlap=True, min_offload_numel=16, backend="numba")
STEPS = 14
SAVE_AT = (1, 7)  # after step 2 (warm-up) and step 8 (mid-window, a host job in flight)


def init(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)


def finish() -> None:
    """End a rank that succeeded: leave together, then exit without running interpreter teardown, where the
    process group's and numba's native threads have aborted a rank now and then ("terminate called without an
    active exception", SIGABRT) after everything had passed."""
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def full_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def full_grad(name: str, step: int) -> torch.Tensor:
    """A gradient whose column sums of squares are exact in fp32 in any order: small integers times 2**-10, scaled by
    a power of two per column (distinct column scales, so the top-k is decided by the data, not by ties)."""
    shape = SHAPES[name]
    g = torch.Generator().manual_seed(1000 * step + len(name) * 17 + shape[0])
    ints = torch.randint(-8, 9, shape, generator=g).float()
    if len(shape) == 1:
        return ints * 2.0**-10
    cols = ints[0].numel()
    scale = 2.0 ** (torch.arange(cols) % 5 - 2).float()
    return (ints.reshape(shape[0], cols) * scale * 2.0**-10).reshape(shape)


class Holder(nn.Module):
    """The parameters as a module, so that torch.distributed.checkpoint can name them."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, value in params.items():
            self.register_parameter(name, nn.Parameter(value))


def sharded_holder(mesh, placements=None) -> Holder:
    from torch.distributed.tensor import Shard, distribute_tensor

    placements = placements or [Shard(0)]
    return Holder({n: distribute_tensor(t, mesh, placements, src_data_rank=None) for n, t in full_params().items()})


def set_grads(holder: Holder, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in holder.named_parameters():
        g = full_grad(name, step)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g


def train(holder: Holder, opt: ZenFlowAdamW, steps: range) -> None:
    for i in steps:
        set_grads(holder, i)
        opt.step()


def gathered(holder: Holder) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in holder.named_parameters()}


def single_process(steps: int) -> dict[str, torch.Tensor]:
    holder = Holder(full_params())
    opt = ZenFlowAdamW(holder.parameters(), **KNOBS)
    train(holder, opt, range(steps))
    opt.flush()
    opt.close()
    return {n: p.detach().clone() for n, p in holder.named_parameters()}


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for name in want:
        assert torch.equal(got[name], want[name]), (
            f"{what}: {name} differs by {float((got[name] - want[name]).abs().max()):.3g}")


# ------------------------------------------------------------------------------------------------ scenarios


def exact_run(rank: int, world: int, port: int, out: str) -> None:
    """Optimizer level: every rank's gathered parameters equal a single-process run bit for bit, through warm-up,
    windows with overlap, reselections, uneven and empty shards; and checkpoints are saved with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    holder = sharded_holder(mesh)
    opt = ZenFlowAdamW(holder.parameters(), **KNOBS)
    for i in range(STEPS):
        set_grads(holder, i)
        opt.step()
        if i in SAVE_AT:
            state = {"opt": get_optimizer_state_dict(holder, opt), "model": holder.state_dict()}
            dcp.save(state, checkpoint_id=str(Path(out) / f"ckpt{i + 1}"))
    opt.flush()
    stats = opt.stats()
    result = gathered(holder)
    assert_equal(result, single_process(STEPS), f"{world} ranks vs one process")
    assert stats["selections"] == 3 and stats["windows"] == 2 + (STEPS - 2) // 2, stats
    # Host memory is the shard's: this rank's rows only.
    mine = sum(p.to_local().numel() for n, p in holder.named_parameters() if n != "bias")
    assert stats["offloaded_params"] == sum(p.numel() for n, p in holder.named_parameters() if n != "bias")
    assert stats["host_bytes"] < 24 * mine + 4096, (stats["host_bytes"], mine)
    opt.close()
    finish()


def resume_run(rank: int, world: int, port: int, out: str) -> None:
    """Resume the checkpoints that exact_run saved (on any world size) and finish the run: bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    want = single_process(STEPS)
    for at in SAVE_AT:
        holder = sharded_holder(mesh)
        opt = ZenFlowAdamW(holder.parameters(), **KNOBS)
        state = {"opt": get_optimizer_state_dict(holder, opt), "model": holder.state_dict()}
        dcp.load(state, checkpoint_id=str(Path(out) / f"ckpt{at + 1}"))
        holder.load_state_dict(state["model"])
        set_optimizer_state_dict(holder, opt, state["opt"])
        train(holder, opt, range(at + 1, STEPS))
        opt.flush()
        assert_equal(gathered(holder), want, f"resumed after step {at + 1} on {world} ranks")
        opt.close()
    finish()


def hsdp_run(rank: int, world: int, port: int, out: str) -> None:
    """HSDP: a 2-D mesh (replicas x shards), placements (Replicate(), Shard(0)); scores are summed over the shard
    dimension only, and every rank equals one process bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    holder = sharded_holder(mesh, [Replicate(), Shard(0)])
    opt = ZenFlowAdamW(holder.parameters(), **KNOBS)
    train(holder, opt, range(STEPS))
    opt.flush()
    assert_equal(gathered(holder), single_process(STEPS), f"HSDP on a (2, {world // 2}) mesh vs one process")
    opt.close()
    finish()


def placement_errors(rank: int, world: int, port: int, out: str) -> None:
    """Shard(1) (tensor parallel) is refused with the parameter named; HSDP's 2-D placement is accepted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    bad = nn.Parameter(distribute_tensor(torch.randn(8, 64), mesh, [Shard(1)], src_data_rank=None))
    try:
        ZenFlowAdamW([bad], min_offload_numel=16, warmup_steps=0)
    except ValueError as exc:
        assert "parameter 0 of shape (8, 64)" in str(exc) and "Shard(dim=1)" in str(exc), str(exc)
    else:
        raise AssertionError("a Shard(1) parameter was accepted")
    finish()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc1 = nn.Linear(16, 48)
        self.fc2 = nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)


def model_run(rank: int, world: int, port: int, out: str) -> None:
    """Model level, with real forward/backward under fully_shard (each rank its slice of the batch): the distance
    from the single-process run, for ZenFlowAdamW and for torch.optim.AdamW, written for the parent to compare."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    gaps = {}
    for name, make in (("zenflow", lambda ps: ZenFlowAdamW(ps, lr=1e-2, topk_ratio=0.25, update_interval=2,
                                                           min_offload_numel=256, warmup_steps=0)),
                       ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2))):
        single = MLP()
        single_opt = make(single.parameters())
        model = MLP()
        for layer in (model.fc1, model.fc2):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = make(model.parameters())
        for step in range(10):
            x, y = batch(step)
            single_opt.zero_grad()
            (single(x) - y).pow(2).mean().backward()
            single_opt.step()
            rows = x.shape[0] // world
            opt.zero_grad()
            (model(x[rank * rows:(rank + 1) * rows]) - y[rank * rows:(rank + 1) * rows]).pow(2).mean().backward()
            opt.step()
        for o in (single_opt, opt):
            if isinstance(o, ZenFlowAdamW):
                o.flush()
                o.close()
        full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        gaps[name] = max(float((full[n] - p.detach()).abs().max()) for n, p in single.named_parameters())
    if rank == 0:
        torch.save(gaps, Path(out) / "model_gaps.pt")
    finish()


def ddp_run(rank: int, world: int, port: int, out: str) -> None:
    """DDP: every rank ends with the same parameters."""
    init(rank, world, port)
    model = nn.parallel.DistributedDataParallel(MLP())
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, min_offload_numel=256,
                       warmup_steps=0)
    for step in range(6):
        x, y = batch(step)
        rows = x.shape[0] // world
        opt.zero_grad()
        (model(x[rank * rows:(rank + 1) * rows]) - y[rank * rows:(rank + 1) * rows]).pow(2).mean().backward()
        opt.step()
    opt.flush()
    for p in model.parameters():
        others = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(others, p.detach())
        assert all(torch.equal(o, p) for o in others), "DDP ranks differ"
    opt.close()
    finish()


def readme_run(rank: int, world: int, port: int, out: str) -> None:
    """docs/distributed.md's torchrun example, as torchrun would start it (its environment variables), checkpoint path
    moved."""
    import re

    page = (Path(__file__).resolve().parent.parent / "docs" / "distributed.md").read_text(encoding="utf-8")
    (code,) = re.findall(r"```python torchrun\n(.*?)```", page, flags=re.S)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    code = code.replace("/tmp/zenflow_fsdp_ckpt", str(Path(out) / "readme_ckpt"))
    exec(compile(code, "docs/distributed.md torchrun example", "exec"), {"__name__": "__main__"})
    os._exit(0)  # see finish(); the example destroyed its process group itself


def host_accumulate_run(rank: int, world: int, port: int, out: str) -> None:
    """accumulate="host" on FSDP2 shards (each rank sums its local rows on the host): the gathered parameters equal a
    single process with accumulate="device", bit for bit, through warm-up, windows and reselections."""
    from torch.distributed.device_mesh import init_device_mesh

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    holder = sharded_holder(mesh)
    opt = ZenFlowAdamW(holder.parameters(), **KNOBS, accumulate="host")
    train(holder, opt, range(STEPS))
    opt.flush()
    assert opt.stats()["accumulate"] == "host"
    assert_equal(gathered(holder), single_process(STEPS), f"{world} ranks (host) vs one process (device)")
    opt.close()
    finish()
